//! The executor's split paths under a value check: every kernel family, GEMMs with
//! their epilogues and attention, split into chunks across threads, equal eager. Real
//! workloads always take these paths; the other tests' batches are too small to.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Mutex;

use common::families::{families, ids};
use common::{assert_close_within, assert_floats_close_within, batch, eager_values, lengths};
use nestor::{compile, Dense, NestedTensor, Parallelism};
use proptest::prelude::*;
use tch::{Kind, Tensor};

/// The settings are process-wide: tests that change them take turns.
static SETTINGS: Mutex<()> = Mutex::new(());

/// Runs `body` with `settings`, then puts the previous ones back (on a panic too).
fn with_parallelism<T>(settings: Parallelism, body: impl FnOnce() -> T) -> T {
    struct Restore(Parallelism);
    impl Drop for Restore {
        fn drop(&mut self) {
            self.0.set();
        }
    }
    let _turn = SETTINGS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let _restore = Restore(Parallelism::current());
    settings.set();
    body()
}

/// Compiles every family that `only` accepts and checks it against eager on `batches`
/// in each of `kinds`; in f32 under `autocast(Kind::BFloat16)` when `mixed`, its float
/// outputs within bf16's rounding.
fn families_match_eager(
    (kinds, mixed): (&[Kind], bool),
    only: impl Fn(&str) -> bool,
    batches: &[Vec<i64>],
    seed: i64,
) {
    for &kind in kinds {
        let tolerance = match kind {
            _ if mixed => 2e-2,
            Kind::Double => 1e-9,
            _ => 1e-4,
        };
        for (family, model) in families(kind) {
            if !only(family) {
                continue;
            }
            let mut compiled = compile(family, |x: &[NestedTensor], d: &[Dense]| model(x, d));
            if mixed {
                compiled = compiled.autocast(Kind::BFloat16);
            }
            for (index, lengths) in batches.iter().enumerate() {
                let (x, _) = batch(lengths, &[4], kind, seed + index as i64);
                let tokens = ids(lengths, seed + index as i64);
                let got = compiled
                    .call(&[&x, &tokens], &[])
                    .unwrap_or_else(|error| panic!("{family}: {error}"));
                let want = eager_values(model(&[x, tokens], &[]).unwrap());
                let what = format!("{family} {kind:?}");
                if mixed {
                    assert_floats_close_within(&got, &want, tolerance, &what);
                } else {
                    assert_close_within(&got, &want, tolerance, &what);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(4), ..ProptestConfig::default() })]

    /// Every kernel and GEMM split into up to four chunks however small: the chunk
    /// boundaries fall everywhere, in elements of every length.
    #[test]
    fn every_family_split_into_four_chunks_equals_eager(batches in proptest::collection::vec(lengths(9, 40), 1..3), seed in 0i64..1000) {
        let settings = Parallelism { threads: 4, kernel_scalars: 1, gemm_macs: 1 };
        with_parallelism(settings, || {
            let before = Parallelism::split_steps();
            families_match_eager((&[Kind::Float, Kind::Double], false), |_| true, &batches, seed);
            // bf16 products: weights rounded once for every chunk, attention's inputs once a step.
            families_match_eager((&[Kind::Float], true), |_| true, &batches, seed);
            // A batch of two rows is enough for a kernel to be split.
            let splittable = batches.iter().any(|lengths| lengths.iter().sum::<i64>() >= 2);
            prop_assert!(!splittable || Parallelism::split_steps() > before, "nothing was split");
            Ok(())
        })?;
    }
}

/// Batches large enough that the default thresholds split every kernel kind (pointwise,
/// row, segment, gather), GEMMs with epilogues and column sums: the paths of real
/// workloads, with four threads.
#[test]
fn large_batches_at_the_default_thresholds_equal_eager() {
    let settings = Parallelism {
        threads: 4,
        ..Parallelism::defaults()
    };
    // 24,000 elements of 0..=40 rows: about 1.9M scalars of width 4, so segment
    // kernels (split by elements) and row kernels (by rows) both have several chunks.
    // Attention (split by element and head at any size) on a few long elements.
    let many: Vec<i64> = (0..24_000).map(|i| (i * 7919) % 41).collect();
    let long = vec![300, 1, 0, 257, 128];
    with_parallelism(settings, || {
        let before = Parallelism::split_steps();
        let attention = |family: &str| family == "attention";
        families_match_eager(
            (&[Kind::Float], false),
            |family| !attention(family),
            &[many],
            3,
        );
        families_match_eager(
            (&[Kind::Float], false),
            attention,
            std::slice::from_ref(&long),
            4,
        );
        families_match_eager((&[Kind::Float], true), attention, &[long], 4);
        // Per family and kind: pointwise, row and segment kernels, gathers and GEMMs.
        let split = Parallelism::split_steps() - before;
        assert!(split >= 20, "only {split} step runs were split");
    });
}

/// In a process with libtorch (x86-64 builds link MKL and GNU OpenMP and export them),
/// compiled GEMMs multiply with that MKL where a probe finds it faster than the `gemm`
/// crate, and split steps run on that OpenMP team: the tests above check their results
/// against eager.
#[test]
#[cfg(target_arch = "x86_64")]
fn compiled_steps_use_the_processs_mkl_and_openmp() {
    let forced =
        |variable: &str, choice: &str| std::env::var(variable).is_ok_and(|value| value == choice);
    let library = if forced("NESTOR_BLAS", "builtin") {
        "gemm crate"
    } else if forced("NESTOR_BLAS", "mkl") {
        "MKL"
    } else {
        // libtorch's MKL is found, and the faster library kept.
        let probe = nestor::gemm_probe().expect("the probe ran: libtorch's MKL was found");
        assert!(
            probe.mkl_seconds > 0.0 && probe.builtin_seconds > 0.0,
            "{probe:?}"
        );
        if probe.mkl_wins() {
            "MKL"
        } else {
            "gemm crate"
        }
    };
    assert_eq!(nestor::gemm_library(), library);
    let pool = if forced("NESTOR_POOL", "rayon") {
        "rayon"
    } else {
        "OpenMP"
    };
    assert_eq!(nestor::pool(), pool);
}

/// A GEMM's rows do not depend on the chunk that computed them: a training step of a
/// linear layer and a product with a transposed weight (the loss, the input's gradient
/// and the weight's, a row sum `a^T b`) gives the same bits unsplit and split into four
/// chunks, whatever sizes the GEMM library picks its kernels by.
#[test]
fn gemm_results_do_not_depend_on_the_split() {
    let (x, _) = batch(&[37, 1, 0, 64, 5, 129, 18], &[48], Kind::Float, 9);
    let x = x.set_requires_grad(true).unwrap();
    let store = tch::nn::VarStore::new(tch::Device::Cpu);
    let layer = tch::nn::linear(store.root() / "layer", 48, 40, Default::default());
    let run = |settings: Parallelism| {
        with_parallelism(settings, || {
            let model = |inputs: &[NestedTensor], _: &[Dense]| {
                let y = inputs[0].linear(&layer.ws, layer.bs.as_ref())?;
                // `[40]`-wide rows times the weight as stored, `[40, 48]`.
                y.matmul(&layer.ws)?
                    .square()?
                    .mean(&[], false)?
                    .into_dense_handle()
            };
            let (outputs, gradients) = compile("gemms", model)
                .train(&store)
                .gradients(&[&x], &[])
                .unwrap();
            let mut tensors: Vec<Tensor> = outputs
                .into_iter()
                .map(|value| value.into_dense().unwrap())
                .collect();
            tensors.extend(gradients.into_iter().map(|(_, gradient)| gradient));
            tensors
        })
    };
    let whole = run(Parallelism {
        threads: 1,
        ..Parallelism::defaults()
    });
    let split = run(Parallelism {
        threads: 4,
        kernel_scalars: 1,
        gemm_macs: 1,
    });
    // The loss, the layer's weight and bias gradients and the input's.
    assert_eq!(whole.len(), 4);
    for (whole, split) in whole.iter().zip(&split) {
        assert!(whole.equal(split), "{whole} vs {split}");
    }
}

/// Window steps (convolution, its input and weight gradients, pooling, image means)
/// give the same bits whatever the split: output rows are tasks, weight-gradient sums
/// are added per fixed block of pixels, in order; the tables of taps are filled over
/// the threads too.
#[test]
fn window_results_do_not_depend_on_the_split() {
    let elements: Vec<Tensor> = [(40, 37), (1, 3), (64, 29), (17, 50)]
        .iter()
        .enumerate()
        .map(|(index, &(h, w))| {
            tch::manual_seed(index as i64);
            Tensor::randn([3, h, w], (Kind::Float, tch::Device::Cpu))
        })
        .collect();
    let images = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&elements)
        .unwrap();
    let store = tch::nn::VarStore::new(tch::Device::Cpu);
    let config = tch::nn::ConvConfig {
        padding: 1,
        ..Default::default()
    };
    let stem = tch::nn::conv2d(store.root() / "stem", 3, 20, 3, config);
    let conv = tch::nn::conv2d(store.root() / "conv", 20, 20, 3, config);
    let run = |settings: Parallelism| {
        with_parallelism(settings, || {
            let model = |inputs: &[NestedTensor], _: &[Dense]| {
                let conv2d = |x: &NestedTensor, layer: &tch::nn::Conv2D| {
                    x.conv2d(&layer.ws, layer.bs.as_ref(), [1, 1], [1, 1], [1, 1], 1)
                };
                let hidden = conv2d(&inputs[0], &stem)?.relu()?;
                let pooled = conv2d(&hidden, &conv)?
                    .max_pool2d([2, 2], [1, 1], [1, 1])?
                    .avg_pool2d([3, 3], [2, 2], [1, 1])?;
                pooled
                    .adaptive_avg_pool2d([1, 1])?
                    .square()?
                    .mean(&[], false)?
                    .into_dense_handle()
            };
            let (outputs, gradients) = compile("windows", model)
                .train(&store)
                .gradients(&[&images], &[])
                .unwrap();
            let mut tensors: Vec<Tensor> = outputs
                .into_iter()
                .map(|value| value.into_dense().unwrap())
                .collect();
            tensors.extend(gradients.into_iter().map(|(_, gradient)| gradient));
            tensors
        })
    };
    let whole = run(Parallelism {
        threads: 1,
        ..Parallelism::defaults()
    });
    let split = run(Parallelism {
        threads: 4,
        kernel_scalars: 1,
        gemm_macs: 1,
    });
    // The loss and both layers' weight and bias gradients.
    assert_eq!(whole.len(), 5);
    for (whole, split) in whole.iter().zip(&split) {
        assert!(whole.equal(split), "{whole} vs {split}");
    }
}
