#![allow(missing_docs)] // criterion_group! generates an undocumented function.
//! Compiled calls whose programs hold the CPU's data steps (padding, dropout masks,
//! one-hot targets, an embedding's scattered gradient, a static selection's inserted
//! gradient), at about 35% occupancy: what decides whether the CPU runs such a step on
//! its JIT template (the GPU's kernel) or on hand-written code.
//!
//! `scripts/cargo bench -p nestor-bench --bench data_steps`

use criterion::{criterion_group, criterion_main, Criterion};
use nestor::{compile, Dense, LossReduction, NestedTensor};
use nestor_bench::lengths::lengths;
use nestor_bench::models::Tokens;
use tch::{nn, Device, Kind, Tensor};

const BATCH: i64 = 16;
const MAX_LENGTH: i64 = 256;
const WIDTH: i64 = 256;
const CLASSES: i64 = 64;

fn bench(c: &mut Criterion) {
    tch::manual_seed(0);
    let store = nn::VarStore::new(Device::Cpu);
    let root = store.root();
    let weight = root.randn("weight", &[CLASSES, WIDTH], 0.0, 0.1);
    let table = root.randn("table", &[CLASSES, WIDTH], 0.0, 0.1);
    let tokens = Tokens::new(lengths(BATCH, MAX_LENGTH, 0.35, 7), WIDTH, MAX_LENGTH)
        .unwrap_or_else(|error| panic!("{error}"));
    let ids = NestedTensor::from_tensors(
        &tokens
            .lengths
            .iter()
            .map(|&length| Tensor::randint(CLASSES, [length], (Kind::Int64, Device::Cpu)))
            .collect::<Vec<_>>(),
    )
    .unwrap_or_else(|error| panic!("{error}"));
    let pad = compile("pad", |x: &[NestedTensor], _: &[Dense]| x[0].pad());
    let dropout = compile("dropout", |x: &[NestedTensor], _: &[Dense]| {
        x[0].dropout(0.1, true)
    });
    let one_hot = compile("one_hot", |x: &[NestedTensor], _: &[Dense]| {
        x[0].linear(&weight, None)?
            .cross_entropy(&x[1], -100, 0.1, LossReduction::Mean)?
            .into_dense_handle()
    })
    .train(&store);
    let scatter = compile("scatter", |x: &[NestedTensor], _: &[Dense]| {
        (&x[1].embedding(&table, -1)? * &x[0])?
            .sum(&[], false)?
            .into_dense_handle()
    })
    .train(&store);
    let insert = compile("insert", |x: &[NestedTensor], _: &[Dense]| {
        x[0].linear(&weight, None)?
            .reshape_tail(&[2, CLASSES / 2])?
            .select_static(2, 0)?
            .sum(&[], false)?
            .into_dense_handle()
    })
    .train(&store);
    type Call<'a> = Box<dyn Fn() -> nestor::Result<Vec<nestor::Value>> + 'a>;
    let (x, ids) = (&tokens.nested, &ids);
    let cases: [(&str, Call<'_>); 5] = [
        ("pad", Box::new(|| pad.call(&[x], &[]))),
        ("dropout", Box::new(|| dropout.call(&[x], &[]))),
        ("one_hot_train", Box::new(|| one_hot.call(&[x, ids], &[]))),
        (
            "scatter_rows_train",
            Box::new(|| scatter.call(&[x, ids], &[])),
        ),
        ("insert_train", Box::new(|| insert.call(&[x], &[]))),
    ];
    let mut group = c.benchmark_group("data_steps_occupancy35");
    group.sample_size(20);
    for (name, call) in &cases {
        group.bench_function(*name, |b| {
            b.iter(|| call().unwrap_or_else(|error| panic!("{name}: {error}")))
        });
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = bench
}
criterion_main!(benches);
