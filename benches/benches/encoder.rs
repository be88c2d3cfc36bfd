#![allow(missing_docs)] // criterion_group! generates an undocumented function.
//! The Transformer encoder forward at about 35% occupancy: nestor compiled (CPU JIT),
//! the same without the optimizer (no e-graph rewrites, no fused kernels), nestor eager
//! (packed NestedTensor on libtorch), and padded libtorch eager with a key padding
//! mask, on the same weights and batch.
//!
//! `scripts/cargo bench -p nestor-bench --bench encoder` (medians are in the closing notes).

use criterion::{criterion_group, criterion_main, Criterion};
use nestor::nn::{TransformerConfig, TransformerEncoder};
use nestor::{compile, Dense, NestedTensor};
use nestor_bench::lengths::lengths;
use nestor_bench::models::Tokens;
use nestor_bench::padded::{self, Weights};
use tch::{nn, Device};

const BATCH: i64 = 16;
const MAX_LENGTH: i64 = 128;
const D_MODEL: i64 = 64;
const HEADS: i64 = 4;
const LAYERS: usize = 2;

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
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, LAYERS, false);
    let weights = Weights::new(&store);
    let tokens = Tokens::new(lengths(BATCH, MAX_LENGTH, 0.35, 7), D_MODEL, MAX_LENGTH)
        .unwrap_or_else(|error| panic!("{error}"));
    let keep = padded::attention_mask(Some(&tokens.lengths), MAX_LENGTH, 1, false)
        .unwrap_or_else(|error| panic!("{error}"));
    let model = |x: &[NestedTensor], _: &[Dense]| encoder.forward(&x[0], false);
    let compiled = compile("encoder", model);
    let unoptimized = compile("encoder", model).optimized(false);
    for function in [&compiled, &unoptimized] {
        function
            .call(&[&tokens.nested], &[])
            .unwrap_or_else(|error| panic!("{error}"));
    }
    let (optimized_stats, unoptimized_stats) = (compiled.stats(), unoptimized.stats());
    println!(
        "per forward: optimized {} launches, {} bytes moved; unoptimized {} launches, {} bytes moved",
        optimized_stats.kernel_launches,
        optimized_stats.bytes_moved,
        unoptimized_stats.kernel_launches,
        unoptimized_stats.bytes_moved
    );
    println!(
        "occupancy {:.2}, lengths {:?}",
        tokens.nested.occupancy(),
        tokens.lengths
    );

    let mut group = c.benchmark_group("encoder_2x64_occupancy35");
    group.sample_size(20);
    for (name, function) in [
        ("nestor_compiled", &compiled),
        ("nestor_compiled_unoptimized", &unoptimized),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| {
                function
                    .call(&[&tokens.nested], &[])
                    .unwrap_or_else(|error| panic!("{error}"))
            })
        });
    }
    group.bench_function("nestor_eager", |b| {
        b.iter(|| {
            encoder
                .forward(&tokens.nested, false)
                .unwrap_or_else(|error| panic!("{error}"))
        })
    });
    group.bench_function("padded_tch_eager", |b| {
        b.iter(|| {
            padded::encoder(
                &weights,
                "encoder",
                LAYERS,
                &tokens.padded,
                keep.as_ref(),
                HEADS,
            )
            .unwrap_or_else(|error| panic!("{error}"))
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
