#![allow(missing_docs)] // criterion_group! generates an undocumented function.
//! The suite's steps under criterion: every model's inference at 35% occupancy in its
//! four columns, and every operator at 35% (padded, nestor eager, nestor compiled).
//! The report (`make report`) measures the same steps at every occupancy, training
//! included; this is for looking closer at one with criterion's statistics.
//!
//! `scripts/cargo bench -p nestor-bench --bench suite`

use criterion::{criterion_group, criterion_main, Criterion};
use nestor_bench::models::{with_columns, Columns, Mode, Model, Precision};
use nestor_bench::operators::{with_steps, Operator, OperatorSteps};
use nestor_bench::Scale;

fn models(c: &mut Criterion) {
    let scale = Scale::cpu();
    for model in Model::ALL {
        let mut group =
            c.benchmark_group(format!("{}_inference_35", model.name().replace(' ', "_")));
        group.sample_size(10);
        with_columns(
            model,
            &scale,
            (0.35, 100),
            Precision::F32,
            &mut |mode, _, _, columns| {
                if mode != Mode::Inference {
                    return Ok(());
                }
                let Columns {
                    mut padded,
                    mut per_element,
                    mut nestor,
                    compiled,
                    ..
                } = columns;
                let mut bench = |name: &str, step: &mut nestor_bench::models::Step<'_>| {
                    group.bench_function(name, |b| {
                        b.iter(|| step().unwrap_or_else(|error| panic!("{error}")))
                    });
                };
                bench("padded_tch_eager", &mut padded);
                bench("per_element_tch_eager", &mut per_element);
                bench("nestor_eager", &mut nestor);
                if let Some((mut step, _)) = compiled {
                    bench("nestor_compiled", &mut step);
                }
                Ok(())
            },
        )
        .unwrap_or_else(|error| panic!("{error}"));
        group.finish();
    }
}

fn operators(c: &mut Criterion) {
    let scale = Scale::cpu();
    for operator in Operator::ALL {
        let mut group = c.benchmark_group(format!("{}_35", operator.name()));
        group.sample_size(20);
        with_steps(operator, &scale, 0.35, 200, &mut |_, _, steps| {
            let OperatorSteps {
                mut padded,
                mut eager,
                mut compiled,
                ..
            } = steps;
            for (name, step) in [
                ("padded_tch_eager", &mut padded),
                ("nestor_eager", &mut eager),
                ("nestor_compiled", &mut compiled),
            ] {
                group.bench_function(name, |b| {
                    b.iter(|| step().unwrap_or_else(|error| panic!("{error}")))
                });
            }
            Ok(())
        })
        .unwrap_or_else(|error| panic!("{error}"));
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = models, operators
}
criterion_main!(benches);
