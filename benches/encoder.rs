#![allow(missing_docs)] // criterion_group! generates an undocumented function.
//! The Transformer encoder forward at about 35% occupancy: nestor compiled (CPU JIT),
//! the same without the optimizer (no e-graph rewrites, no kernel fusion), nestor eager
//! (packed NestedTensor on libtorch), and padded libtorch eager with a key padding
//! mask, on the same weights and batch.
//!
//! `scripts/cargo bench --bench encoder` (medians are in the closing notes).

use criterion::{criterion_group, criterion_main, Criterion};
use nestor::nn::{TransformerConfig, TransformerEncoder, TransformerEncoderLayer};
use nestor::{compile, Dense, NestedTensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tch::{nn, Device, Kind, Tensor};

const BATCH: i64 = 16;
const MAX_LENGTH: i64 = 128;
const D_MODEL: i64 = 64;
const HEADS: i64 = 4;

/// Lengths as DanLing's benchmark draws them: one element at the maximum, the rest
/// uniform around the mean that gives the target occupancy.
fn lengths(occupancy: f64, seed: u64) -> Vec<i64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mean = occupancy * MAX_LENGTH as f64;
    let spread = mean.min(MAX_LENGTH as f64 - mean);
    let mut lengths: Vec<i64> = (1..BATCH)
        .map(|_| {
            (mean + rng.random_range(-spread..=spread))
                .round()
                .clamp(1.0, MAX_LENGTH as f64) as i64
        })
        .collect();
    lengths.insert(0, MAX_LENGTH);
    lengths
}

/// One post-norm encoder layer on a padded batch `[B, L, E]` with a key padding mask,
/// using the nestor layer's weights (the padded baseline).
fn padded_layer(
    layer: &TransformerEncoderLayer,
    store: &nn::VarStore,
    prefix: &str,
    x: &Tensor,
    keep: &Tensor,
) -> Tensor {
    let variables = store.variables();
    let get = |name: &str| variables[&format!("{prefix}.{name}")].shallow_clone();
    let (batch, length) = (x.size()[0], x.size()[1]);
    let head_dim = D_MODEL / HEADS;
    let mha = &layer.self_attn;
    let qkv = x
        .linear(&mha.in_proj_weight, mha.in_proj_bias.as_ref())
        .reshape([batch, length, 3, HEADS, head_dim])
        .permute([2, 0, 3, 1, 4]);
    let attended = Tensor::scaled_dot_product_attention(
        &qkv.get(0),
        &qkv.get(1),
        &qkv.get(2),
        Some(keep),
        0.0,
        false,
        None,
        false,
    );
    let attended = attended
        .transpose(1, 2)
        .reshape([batch, length, D_MODEL])
        .linear(&mha.out_proj.ws, mha.out_proj.bs.as_ref());
    let norm = |x: &Tensor, name: &str| {
        x.layer_norm(
            [D_MODEL],
            Some(&get(&format!("{name}.weight"))),
            Some(&get(&format!("{name}.bias"))),
            1e-5,
            true,
        )
    };
    let x = norm(&(x + attended), "norm1");
    let hidden = x
        .linear(&get("linear1.weight"), Some(get("linear1.bias")))
        .relu()
        .linear(&get("linear2.weight"), Some(get("linear2.bias")));
    norm(&(&x + hidden), "norm2")
}

fn bench(c: &mut Criterion) {
    let _no_grad = tch::no_grad_guard();
    tch::manual_seed(0);
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: D_MODEL,
        nhead: HEADS,
        dim_feedforward: 4 * D_MODEL,
        dropout: 0.0,
        ..Default::default()
    };
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, false);
    let lengths = lengths(0.35, 7);
    let elements: Vec<Tensor> = lengths
        .iter()
        .map(|&l| Tensor::randn([l, D_MODEL], (Kind::Float, Device::Cpu)))
        .collect();
    let tokens = NestedTensor::builder()
        .ragged_dims(&[0])
        .tensors(&elements)
        .unwrap_or_else(|error| panic!("{error}"));
    let padded = tokens.tensor().unwrap_or_else(|error| panic!("{error}"));
    let keep = tokens
        .mask()
        .unwrap_or_else(|error| panic!("{error}"))
        .view([BATCH, 1, 1, MAX_LENGTH]);
    let compiled = compile("encoder", |x: &[NestedTensor], _: &[Dense]| {
        encoder.forward(&x[0], false)
    });
    let unoptimized = compile("encoder", |x: &[NestedTensor], _: &[Dense]| {
        encoder.forward(&x[0], false)
    })
    .optimized(false);
    compiled
        .call(&[&tokens], &[])
        .unwrap_or_else(|error| panic!("{error}"));
    unoptimized
        .call(&[&tokens], &[])
        .unwrap_or_else(|error| panic!("{error}"));
    let (optimized_stats, unoptimized_stats) = (compiled.stats(), unoptimized.stats());
    println!(
        "per forward: optimized {} launches, {} bytes moved; unoptimized {} launches, {} bytes moved",
        optimized_stats.kernel_launches,
        optimized_stats.bytes_moved,
        unoptimized_stats.kernel_launches,
        unoptimized_stats.bytes_moved
    );
    println!("occupancy {:.2}, lengths {lengths:?}", tokens.occupancy());

    let mut group = c.benchmark_group("encoder_2x64_occupancy35");
    group.sample_size(20);
    group.bench_function("nestor_compiled", |b| {
        b.iter(|| {
            compiled
                .call(&[&tokens], &[])
                .unwrap_or_else(|error| panic!("{error}"))
        })
    });
    group.bench_function("nestor_compiled_unoptimized", |b| {
        b.iter(|| {
            unoptimized
                .call(&[&tokens], &[])
                .unwrap_or_else(|error| panic!("{error}"))
        })
    });
    group.bench_function("nestor_eager", |b| {
        b.iter(|| {
            encoder
                .forward(&tokens, false)
                .unwrap_or_else(|error| panic!("{error}"))
        })
    });
    group.bench_function("padded_tch_eager", |b| {
        b.iter(|| {
            let mut x = padded.shallow_clone();
            for (index, layer) in encoder.layers.iter().enumerate() {
                x = padded_layer(layer, &store, &format!("encoder.layers.{index}"), &x, &keep);
            }
            x
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = bench
}
criterion_main!(benches);
