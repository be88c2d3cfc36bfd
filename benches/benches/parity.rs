#![allow(missing_docs)] // criterion_group! generates an undocumented function.
//! DanLing-parity operators against padded libtorch at 35% occupancy (batch 16, longest
//! 256, the report's CPU batch; and 512 elements of at most 16): the jagged-pair matmuls of a hand-written attention (`q @ k^T`, then `p @ v`)
//! and segmented top-k along the ragged dim, packed in nestor (eager, and top-k
//! compiled), padded in tch (what a user without nested support would run), and
//! element by element.
//!
//! `scripts/cargo bench -p nestor-bench --bench parity`

use criterion::{criterion_group, criterion_main, Criterion};
use nestor::NestedTensor;
use nestor_bench::lengths::lengths;
use tch::{Device, Kind, Tensor};

/// (batch, longest length): the report's CPU batch, and many short elements.
const SIZES: [(i64, i64); 2] = [(16, 256), (512, 16)];
const WIDTH: i64 = 64;

fn batch(lengths: &[i64], width: i64) -> (NestedTensor, Tensor) {
    let total: i64 = lengths.iter().sum();
    let values = Tensor::randn([total, width], (Kind::Float, Device::Cpu));
    let nested = NestedTensor::packed_with_lengths(&values, lengths)
        .unwrap_or_else(|error| panic!("{error}"));
    let padded = nested.tensor().unwrap_or_else(|error| panic!("{error}"));
    (nested, padded)
}

fn bench(c: &mut Criterion) {
    let _no_grad = tch::no_grad_guard();
    tch::manual_seed(0);
    for (batch_size, max_length) in SIZES {
        bench_sizes(c, batch_size, max_length);
    }
}

fn bench_sizes(c: &mut Criterion, batch_size: i64, max_length: i64) {
    let lengths = lengths(batch_size, max_length, 0.35, 7);
    let suffix = format!("35_b{batch_size}_l{max_length}");
    let (q, q_padded) = batch(&lengths, WIDTH);
    let (k, k_padded) = batch(&lengths, WIDTH);
    let (v, v_padded) = batch(&lengths, WIDTH);
    let k_t = k.transpose(1, 2).unwrap_or_else(|error| panic!("{error}"));
    let scores = q
        .matmul_nested(&k_t)
        .unwrap_or_else(|error| panic!("{error}"));
    let weights = scores.softmax(2).unwrap_or_else(|error| panic!("{error}"));
    let weights_padded = weights.tensor().unwrap_or_else(|error| panic!("{error}"));
    let (q_list, k_list, v_list, w_list) = (
        q.unbind().unwrap_or_default(),
        k.unbind().unwrap_or_default(),
        v.unbind().unwrap_or_default(),
        weights.unbind().unwrap_or_default(),
    );

    let mut group = c.benchmark_group(format!("pair_matmul_scores_{suffix}"));
    group.sample_size(20);
    group.bench_function("padded_tch_bmm", |b| {
        b.iter(|| q_padded.bmm(&k_padded.transpose(1, 2)))
    });
    group.bench_function("nestor_packed", |b| b.iter(|| q.matmul_nested(&k_t)));
    group.bench_function("per_element_tch", |b| {
        b.iter(|| {
            q_list
                .iter()
                .zip(&k_list)
                .map(|(q, k)| q.matmul(&k.transpose(0, 1)))
                .collect::<Vec<_>>()
        })
    });
    group.finish();

    let mut group = c.benchmark_group(format!("pair_matmul_mix_{suffix}"));
    group.sample_size(20);
    group.bench_function("padded_tch_bmm", |b| {
        b.iter(|| weights_padded.bmm(&v_padded))
    });
    group.bench_function("nestor_packed", |b| b.iter(|| weights.matmul_nested(&v)));
    group.bench_function("per_element_tch", |b| {
        b.iter(|| {
            w_list
                .iter()
                .zip(&v_list)
                .map(|(w, v)| w.matmul(v))
                .collect::<Vec<_>>()
        })
    });
    group.finish();

    let k_top = *lengths.iter().min().unwrap_or(&1);
    let k_top = k_top.min(8);
    let mask = q.mask().unwrap_or_else(|error| panic!("{error}"));
    let mut group = c.benchmark_group(format!("segmented_topk_{suffix}"));
    group.sample_size(20);
    group.bench_function("padded_tch_topk", |b| {
        b.iter(|| {
            // Padding must never win: fill it with -inf first.
            let filled = q_padded.masked_fill(&mask.logical_not().unsqueeze(-1), f64::NEG_INFINITY);
            filled.topk(k_top, 1, true, true)
        })
    });
    group.bench_function("nestor_packed", |b| b.iter(|| q.topk(k_top, 1, true)));
    // Compiled: each element's columns ranked by one segmented kernel (k rows an element).
    let compiled = nestor::compile(
        "segmented_topk",
        move |x: &[NestedTensor], _: &[nestor::Dense]| Ok(x[0].topk(k_top, 1, true)?.0),
    );
    compiled
        .call(&[&q], &[])
        .unwrap_or_else(|error| panic!("{error}"));
    group.bench_function("nestor_compiled", |b| b.iter(|| compiled.call(&[&q], &[])));
    group.bench_function("per_element_tch", |b| {
        b.iter(|| {
            q_list
                .iter()
                .map(|q| q.topk(k_top, 0, true, true))
                .collect::<Vec<_>>()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
