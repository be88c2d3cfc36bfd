//! Compiled training of a small Transformer language model on real variable-length
//! text: the quotations of Debian's `fortunes` package (installed by `make demo` /
//! `scripts/setup.sh`), one byte per token, batches bucketed by length and never
//! padded. The training step (forward, loss, backward) is compiled once for every set
//! of lengths; Adam from tch updates the parameters. At the end: compiled vs eager
//! tokens per second, the compile count, and a few generated samples.
//!
//! ```sh
//! scripts/cargo run --release --example train_compiled
//! scripts/cargo run --release --example train_compiled -- --steps 300 --autocast bf16
//! ```
//!
//! `--steps N` trains N steps (default 1500); `--autocast bf16` trains in mixed
//! precision (`Compiled::autocast`: products on bf16 roundings, f32 parameters and
//! gradients). The run ends with the mean loss of its last 50 steps.

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use nestor::{compile, Dense, NestedTensor};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[path = "support/fortunes.rs"]
mod fortunes;
use fortunes::{batch, corpus, LanguageModel, CORPUS, LONGEST};

const BATCH: usize = 16;
const STEPS: usize = 1500;
/// The steps the final loss is the mean of.
const LAST: usize = 50;

/// The command line: steps to train, and whether in mixed precision.
fn options() -> Result<(usize, bool), Box<dyn std::error::Error>> {
    let (mut steps, mut mixed) = (STEPS, false);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--steps", Some(value)) => steps = value.parse()?,
            ("--autocast", Some(kind)) if kind == "bf16" => mixed = true,
            _ => return Err(format!("unknown argument {arg}: --steps N, --autocast bf16").into()),
        }
    }
    Ok((steps, mixed))
}

/// Continues `prompt` byte by byte with the eager model (sampling at temperature 0.8).
fn generate(model: &LanguageModel, prompt: &str, length: usize) -> nestor::Result<String> {
    let mut bytes: Vec<i64> = prompt.bytes().map(i64::from).collect();
    let _guard = tch::no_grad_guard();
    while bytes.len() < length.min(LONGEST) {
        let ragged = |element: Tensor| {
            NestedTensor::builder()
                .ragged_dims(&[0])
                .tensors(&[element])
        };
        let ids = ragged(Tensor::from_slice(&bytes))?;
        let positions = ragged(Tensor::arange(
            bytes.len() as i64,
            (Kind::Int64, Device::Cpu),
        ))?;
        let logits = model.logits(&ids, &positions)?;
        let last = logits.values().get(bytes.len() as i64 - 1);
        let probabilities = (last / 0.8).softmax(-1, Kind::Float);
        bytes.push(probabilities.multinomial(1, true).int64_value(&[0]));
    }
    Ok(bytes.iter().map(|&b| b as u8 as char).collect())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (steps, mixed) = options()?;
    tch::manual_seed(0);
    let mut quotes = corpus()?;
    quotes.sort_by_key(|quote| quote.len());
    // Buckets of similar lengths, visited in a shuffled order.
    let buckets: Vec<Vec<&Vec<u8>>> = quotes
        .chunks(BATCH)
        .map(|chunk| chunk.iter().collect())
        .collect();
    let order = Tensor::randperm(buckets.len() as i64, (Kind::Int64, Device::Cpu));
    let order: Vec<i64> = Vec::try_from(order)?;
    println!(
        "{} quotations from {CORPUS}, {} batches of {BATCH} by length",
        quotes.len(),
        buckets.len()
    );

    let store = nn::VarStore::new(Device::Cpu);
    let model = LanguageModel::new(&store.root());
    let step = compile("language_model", |x: &[NestedTensor], _: &[Dense]| {
        model.loss(x)
    })
    .train(&store)
    .autocast(if mixed { Kind::BFloat16 } else { Kind::Float });
    let mut adam = nn::Adam::default().build(&store, 3e-3)?;
    let progress = ProgressBar::new(steps as u64);
    progress.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}")?);
    let (mut tokens, started) = (0usize, Instant::now());
    let mut first_loss = None;
    let mut last_loss = 0.0;
    let mut losses = Vec::with_capacity(steps);
    for index in 0..steps {
        let bucket = &buckets[order[index % order.len()] as usize];
        let inputs = batch(bucket)?;
        adam.zero_grad();
        let loss = step
            .call(&[&inputs[0], &inputs[1], &inputs[2]], &[])?
            .remove(0)
            .into_dense()?;
        adam.step();
        last_loss = loss.double_value(&[]);
        losses.push(last_loss);
        first_loss.get_or_insert(last_loss);
        tokens += bucket.iter().map(|q| q.len() - 1).sum::<usize>();
        progress.inc(1);
        progress.set_message(format!(
            "loss {last_loss:.3}, {:.0} tokens/s",
            tokens as f64 / started.elapsed().as_secs_f64()
        ));
    }
    progress.finish();
    let compiled_rate = tokens as f64 / started.elapsed().as_secs_f64();

    // The same steps eagerly (tch autograd), on a copy of the weights, for the speed.
    let eager_store = nn::VarStore::new(Device::Cpu);
    let eager_model = LanguageModel::new(&eager_store.root());
    let mut eager_adam = nn::Adam::default().build(&eager_store, 3e-3)?;
    let (mut eager_tokens, eager_started) = (0usize, Instant::now());
    for index in 0..steps / 4 {
        let bucket = &buckets[order[index % order.len()] as usize];
        let inputs = batch(bucket)?;
        eager_adam.zero_grad();
        eager_model.loss(&inputs)?.into_tensor().backward();
        eager_adam.step();
        eager_tokens += bucket.iter().map(|q| q.len() - 1).sum::<usize>();
    }
    let eager_rate = eager_tokens as f64 / eager_started.elapsed().as_secs_f64();

    let last = &losses[losses.len().saturating_sub(LAST)..];
    println!(
        "loss {:.3} -> {last_loss:.3} over {steps} steps{}; mean of the last {}: {:.4}",
        first_loss.unwrap_or(f64::NAN),
        if mixed {
            " (mixed precision, bf16 products)"
        } else {
            ""
        },
        last.len(),
        last.iter().sum::<f64>() / last.len().max(1) as f64
    );
    println!(
        "compiled {compiled_rate:.0} tokens/s, eager {eager_rate:.0} tokens/s ({:.2}x); {} compiles for {} batches of different lengths",
        compiled_rate / eager_rate,
        step.stats().compiles,
        steps
    );
    for prompt in ["The ", "A man ", "Life "] {
        println!("  {:?}", generate(&model, prompt, 64)?);
    }
    Ok(())
}
