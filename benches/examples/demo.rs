//! What nestor is for, in under a minute (`make demo`): a Transformer encoder on ragged
//! batches, compiled once for every set of lengths, against nestor eager and padded
//! libtorch on the same batches and weights; the compiled graph's dumps; a few compiled
//! training steps.
//!
//! ```sh
//! scripts/cargo run --release -p nestor-bench --example demo
//! ```

use std::path::PathBuf;
use std::time::Instant;

use nestor::nn::{TransformerConfig, TransformerEncoder};
use nestor::{compile, Dense, LossReduction, NestedTensor};
use nestor_bench::lengths::{lengths, occupancy};
use nestor_bench::measure::time;
use nestor_bench::models::Tokens;
use nestor_bench::padded::{self, Weights};
use nestor_bench::Result;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const D_MODEL: i64 = 128;
const HEADS: i64 = 4;
const LAYERS: usize = 2;
const BATCH: i64 = 16;
const MAX_LENGTH: i64 = 256;
const OCCUPANCY: f64 = 0.35;
/// Batches of different lengths, each run by every column.
const BATCHES: u64 = 6;
const SAMPLES: usize = 5;
const TRAINING_STEPS: usize = 30;

fn config() -> TransformerConfig {
    TransformerConfig {
        d_model: D_MODEL,
        nhead: HEADS,
        dim_feedforward: 4 * D_MODEL,
        dropout: 0.0,
        ..Default::default()
    }
}

fn main() -> Result<()> {
    tch::manual_seed(0);
    let _no_grad = tch::no_grad_guard();
    let store = nn::VarStore::new(Device::Cpu);
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config(), LAYERS, false);
    let batches: Vec<Tokens> = (0..BATCHES)
        .map(|seed| {
            Tokens::new(
                lengths(BATCH, MAX_LENGTH, OCCUPANCY, seed),
                D_MODEL,
                MAX_LENGTH,
            )
        })
        .collect::<Result<_>>()?;
    let all_lengths: Vec<i64> = batches
        .iter()
        .flat_map(|batch| batch.lengths.clone())
        .collect();
    println!(
        "nestor demo: a {LAYERS}-layer Transformer encoder (d_model {D_MODEL}, {HEADS} heads) on \
         {BATCHES} batches of {BATCH} sequences, lengths 1..={MAX_LENGTH}, {:.0}% occupancy \
         (padding would make {:.1}x the tokens)\n",
        100.0 * occupancy(&all_lengths, MAX_LENGTH),
        1.0 / occupancy(&all_lengths, MAX_LENGTH)
    );

    // 1. Compile once: the first call traces, optimizes and JIT-compiles; every other set
    //    of lengths reuses that program.
    let dumps = std::env::temp_dir().join("nestor-demo");
    let _ = std::fs::remove_dir_all(&dumps);
    let compiled = compile("encoder", |x: &[NestedTensor], _: &[Dense]| {
        encoder.forward(&x[0], false)
    })
    .with_var_store(&store)
    .dump_to(&dumps);
    let started = Instant::now();
    compiled.call(&[&batches[0].nested], &[])?;
    println!(
        "compile: traced, optimized and JIT-compiled in {:.0} ms on the first call",
        started.elapsed().as_secs_f64() * 1e3
    );
    let mut worst = 0.0f64;
    for batch in &batches {
        let ours = compiled
            .call(&[&batch.nested], &[])?
            .remove(0)
            .into_nested()?;
        let eager = encoder.forward(&batch.nested, false)?;
        let difference = (ours.values() - eager.values())
            .abs()
            .max()
            .double_value(&[]);
        worst = worst.max(difference);
    }
    let stats = compiled.stats();
    println!(
        "         {} batches of different lengths ran: compiles: {}, cache hits: {}; \
         max |compiled - eager| = {worst:.1e}\n",
        BATCHES, stats.compiles, stats.cache_hits
    );

    // 2. Inference on the same batches and weights.
    let weights = Weights::new(&store);
    let masks: Vec<Option<Tensor>> = batches
        .iter()
        .map(|batch| padded::attention_mask(Some(&batch.lengths), MAX_LENGTH, 1, false))
        .collect::<Result<_>>()?;
    let padded_time = time(SAMPLES, || {
        for (batch, mask) in batches.iter().zip(&masks) {
            let _output = padded::encoder(
                &weights,
                "encoder",
                LAYERS,
                &batch.padded,
                mask.as_ref(),
                HEADS,
            )?;
        }
        Ok(())
    })?;
    let eager_time = time(SAMPLES, || {
        for batch in &batches {
            encoder.forward(&batch.nested, false)?;
        }
        Ok(())
    })?;
    let compiled_time = time(SAMPLES, || {
        for batch in &batches {
            compiled.call(&[&batch.nested], &[])?;
        }
        Ok(())
    })?;
    let per_batch = |seconds: f64| seconds * 1e3 / BATCHES as f64;
    println!("inference, median ms per batch ({SAMPLES} passes over the {BATCHES} batches):");
    println!(
        "  padded libtorch (key padding mask)  {:7.2} ms",
        per_batch(padded_time.median)
    );
    for (name, timing) in [
        ("nestor eager (packed NestedTensor) ", eager_time),
        ("nestor compiled (CPU JIT)          ", compiled_time),
    ] {
        println!(
            "  {name} {:7.2} ms   {:.2}x faster than padded",
            per_batch(timing.median),
            padded_time.median / timing.median
        );
    }
    println!("  (the best PyTorch options on these batches are compared in `make report`)\n");

    // 3. Every stage of the compile, for debugging.
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dumps)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .collect();
    files.sort();
    println!("graph dumps (`Compiled::dump_to`, or NESTOR_DUMP=<dir> for every compile):");
    for file in &files {
        println!("  {}", file.display());
    }
    println!(
        "  read them with: scripts/cargo run --bin nestor-opt -- {} --print-after-all\n",
        dumps.join("encoder.00-traced.nir").display()
    );
    drop(_no_grad);

    train()
}

/// A few compiled training steps of a classifier (the encoder, mean pooling over each
/// sequence, a linear layer, cross entropy) on a toy task: is a sequence's mean of
/// feature 0 positive?
fn train() -> Result<()> {
    let store = nn::VarStore::new(Device::Cpu);
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config(), LAYERS, false);
    let classifier = nn::linear(store.root() / "classifier", D_MODEL, 2, Default::default());
    let step = compile("classifier", |x: &[NestedTensor], labels: &[Dense]| {
        encoder
            .forward(&x[0], true)?
            .mean(&[1], false)?
            .into_dense_handle()?
            .linear(&classifier.ws, classifier.bs.as_ref())?
            .cross_entropy(&labels[0], -100, 0.0, LossReduction::Mean)
    })
    .train(&store);
    let mut adam = nn::Adam::default().build(&store, 1e-3)?;
    let data: Vec<(Tokens, Tensor)> = (0..4)
        .map(|seed| -> Result<(Tokens, Tensor)> {
            let tokens = Tokens::new(lengths(BATCH, 64, OCCUPANCY, 100 + seed), D_MODEL, 64)?;
            let labels = Tensor::stack(
                &tokens
                    .elements
                    .iter()
                    .map(|element| element.select(2, 0).mean(Kind::Float).gt(0.0))
                    .collect::<Vec<_>>(),
                0,
            )
            .to_kind(Kind::Int64);
            Ok((tokens, labels))
        })
        .collect::<Result<_>>()?;
    println!(
        "compiled training ({TRAINING_STEPS} Adam steps, {} batches of {BATCH} sequences of lengths 1..=64):",
        data.len()
    );
    let started = Instant::now();
    let mut losses = Vec::new();
    for index in 0..TRAINING_STEPS {
        let (tokens, labels) = &data[index % data.len()];
        adam.zero_grad();
        let loss = step
            .call(&[&tokens.nested], &[labels])?
            .remove(0)
            .into_dense()?;
        adam.step();
        losses.push(loss.double_value(&[]));
    }
    let shown: Vec<String> = losses
        .iter()
        .enumerate()
        .filter(|(index, _)| index % 5 == 0 || *index + 1 == losses.len())
        .map(|(index, loss)| format!("step {}: {loss:.3}", index + 1))
        .collect();
    println!("  loss  {}", shown.join(", "));
    println!(
        "  {:.0} ms per step; compiles: {} (one joint forward + backward program for every batch)",
        started.elapsed().as_secs_f64() * 1e3 / TRAINING_STEPS as f64,
        step.stats().compiles
    );
    Ok(())
}
