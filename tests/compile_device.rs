//! `nestor::compile` on a GPU's path, run on the simulated GPU
//! (`RunDevice::Simulated`: the GPU's kernels on the CPU, CPU tensors adopted as device
//! memory): every op family, the Transformer encoder, decoder and full Transformer,
//! ResNet-18 and a small BERT, and compiled training steps equal the CPU backend (f32
//! 1e-4; bf16 2e-2); what one call asks of the device (uploads, downloads,
//! synchronizations, allocations in steady state); a GPU asked for without a driver is
//! a typed error.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::families::{families, ids};
use common::{assert_close_within, batch, lengths, random_images, Out};
use nestor::nn::{
    Bert, BertConfig, ResNet, Transformer, TransformerConfig, TransformerDecoder,
    TransformerEncoder,
};
use nestor::{
    compile, Bounds, CompileCause, Dense, LossReduction, NestedError, NestedTensor, Reduce,
    RunDevice, SimOptions, Value,
};
use proptest::prelude::*;
use tch::{nn, Device, Kind, Tensor};

fn simulated() -> RunDevice {
    RunDevice::Simulated(SimOptions::default())
}

/// The tolerance of a simulated result against the CPU's: the GPU's kernels sum in
/// another order (f32), and bf16 results round an f32 value that differs slightly.
fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::BFloat16 | Kind::Half => 2e-2,
        _ => 1e-4,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(3), ..ProptestConfig::default() })]

    #[test]
    fn every_family_on_the_simulated_gpu_equals_the_cpu(batches in proptest::collection::vec(lengths(4, 7), 1..3), seed in 0i64..1000) {
        for kind in [Kind::Float, Kind::BFloat16] {
            for (family, model) in families(kind) {
                let on_cpu = compile(family, |x: &[NestedTensor], d: &[Dense]| model(x, d));
                let on_sim = compile(family, |x: &[NestedTensor], d: &[Dense]| model(x, d))
                    .on_device(simulated());
                for (index, lengths) in batches.iter().enumerate() {
                    let (x, _) = batch(lengths, &[4], kind, seed + index as i64);
                    let tokens = ids(lengths, seed + index as i64);
                    let expected = on_cpu.call(&[&x, &tokens], &[]).unwrap();
                    let actual = on_sim
                        .call(&[&x, &tokens], &[])
                        .unwrap_or_else(|error| panic!("{family} ({kind:?}): {error}"));
                    assert_close_within(&actual, &expected, tolerance(kind), &format!("{family} ({kind:?})"));
                }
                prop_assert_eq!(on_sim.stats().compiles, 1, "{} compiles once", family);
            }
        }
    }
}

/// A small Transformer configuration (no dropout).
fn small_config(norm_first: bool) -> TransformerConfig {
    TransformerConfig {
        d_model: 16,
        nhead: 2,
        dim_feedforward: 32,
        dropout: 0.0,
        norm_first,
        ..Default::default()
    }
}

/// `model` compiled for the CPU and for the simulated GPU agree on every batch.
fn assert_simulated_equals_cpu<F, O>(what: &str, model: F, batches: &[Vec<&NestedTensor>])
where
    F: Fn(&[NestedTensor], &[Dense]) -> nestor::Result<O> + Clone,
    O: nestor::TraceOutputs,
{
    let on_cpu = compile(what, model.clone());
    let on_sim = compile(what, model).on_device(simulated());
    for inputs in batches {
        let expected = on_cpu.call(inputs, &[]).unwrap();
        let actual = on_sim
            .call(inputs, &[])
            .unwrap_or_else(|error| panic!("{what}: {error}"));
        assert_close_within(&actual, &expected, 1e-4, what);
    }
}

/// The gradient of `loss` for one input batch, compiled for the CPU and for the
/// simulated GPU, agrees on every batch (each a fresh leaf).
fn assert_simulated_gradients_equal_cpu<F>(what: &str, loss: F, batches: &[&NestedTensor])
where
    F: Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Dense> + Clone,
{
    let store = nn::VarStore::new(Device::Cpu);
    let on_cpu = compile(what, loss.clone()).train(&store);
    let on_sim = compile(what, loss).train(&store).on_device(simulated());
    for batch in batches {
        let leaf = || batch.detach().unwrap().set_requires_grad(true).unwrap();
        let (ours, theirs) = (leaf(), leaf());
        on_cpu.call(&[&ours], &[]).unwrap();
        on_sim
            .call(&[&theirs], &[])
            .unwrap_or_else(|error| panic!("{what}: {error}"));
        let (ours, theirs) = (ours.grad().unwrap(), theirs.grad().unwrap());
        assert!(
            ours.values().allclose(theirs.values(), 1e-4, 1e-4, false),
            "{what}"
        );
    }
}

/// argmax and argmin along the ragged dim (elements longer than a block's threshold
/// included: a warp's however long) and along the last dim, and the top rows of each
/// element, on the simulated GPU equal the CPU: i64 buffers written by kernels and
/// downloaded as positions.
#[test]
fn positions_on_the_simulated_gpu_equal_the_cpu() {
    let (x, _) = batch(&[70, 1, 3, 130], &[5], Kind::Float, 3);
    let (one, _) = batch(&[2], &[5], Kind::Float, 4);
    assert_simulated_equals_cpu(
        "positions",
        |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            Ok(vec![
                x[0].argmax(1, false)?.into(),
                x[0].relu()?.argmin(1, true)?.into(),
                x[0].argmax(-1, true)?.into(),
                x[0].max_dim(1, true)?.0.into(),
                x[0].min_dim(-1, false)?.0.into(),
                x[0].topk(1, 1, true)?.0.into(),
                x[0].relu()?.topk(1, 1, false)?.1.into(),
            ])
        },
        &[vec![&x], vec![&one]],
    );
}

/// Transposes of static dims with dims between and after them, a permutation, ops along
/// an inner static dim (through a transpose) and a broadcast of an inner dim, on the
/// simulated GPU equal the CPU.
#[test]
fn transposes_on_the_simulated_gpu_equal_the_cpu() {
    let (x, _) = batch(&[3, 0, 1, 40], &[120], Kind::Float, 7);
    assert_simulated_equals_cpu(
        "transposes",
        |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            let x = x[0].reshape_tail(&[2, 3, 4, 5])?;
            let mean = x.reduce(Reduce::Mean, &[3], true)?.into_nested()?;
            Ok(vec![
                x.transpose(2, 4)?.into(),
                x.permute(&[0, 1, 4, 2, 5, 3])?.into(),
                x.sort(3, false)?.0.into(),
                x.argmax(2, false)?.into(),
                x.argsort(3, true)?.into(),
                x.slice(3, 1..3)?.into(),
                x.softmax(3)?.into(),
                (&x - &mean)?.into(),
            ])
        },
        &[vec![&x]],
    );
}

/// conv1d and max_pool1d of signals `[C, L_i]` (windows one pixel high) on the
/// simulated GPU equal the CPU.
#[test]
fn signals_on_the_simulated_gpu_equal_the_cpu() {
    let elements: Vec<Tensor> = [5i64, 3, 9]
        .iter()
        .map(|&length| Tensor::randn([2, length], (Kind::Float, Device::Cpu)))
        .collect();
    let x = NestedTensor::builder()
        .ragged_dims(&[1])
        .tensors(&elements)
        .unwrap();
    let weight = std::rc::Rc::new(Tensor::randn([3, 2, 3], (Kind::Float, Device::Cpu)));
    assert_simulated_equals_cpu(
        "signals",
        move |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            let convolved = x[0].conv1d(&weight, None, 2, 1, 1, 1)?;
            Ok(vec![
                convolved.shallow_clone().into(),
                convolved.max_pool1d(2, 1, 1)?.into(),
            ])
        },
        &[vec![&x]],
    );
}

/// The order ops' gradients (sorts, the top rows and columns, running extremes, k-th
/// values; down the ragged dim, long elements included, and along the last dim) on
/// the simulated GPU equal the CPU.
#[test]
fn order_gradients_on_the_simulated_gpu_equal_the_cpu() {
    let (x, _) = batch(&[70, 2, 3, 130], &[5], Kind::Float, 5);
    let (one, _) = batch(&[2], &[5], Kind::Float, 6);
    let loss = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Dense> {
        let total = |x: NestedTensor| x.sin()?.sum(&[], false)?.into_dense_handle();
        let (sorted, _) = x[0].sort(1, true)?;
        let (top, _) = x[0].topk(2, 1, true)?;
        let (columns, _) = x[0].topk(2, -1, false)?;
        let (seen, _) = x[0].cummax(1)?;
        let kth = x[0].kthvalue(2, 1, false)?.0.into_dense_handle()?;
        let (largest, _) = x[0].max_dim(-1, true)?;
        total(sorted.cumsum(1)?)?
            .add(&total(top.cumsum(1)?)?)?
            .add(&total(columns.cumsum(-1)?)?)?
            .add(&total((&seen * &x[0])?)?)?
            .add(&kth.mul(&kth)?.sum_all()?)?
            .add(&total(largest.into_nested()?)?)
    };
    assert_simulated_gradients_equal_cpu("order_loss", loss, &[&x, &one]);
}

/// Repeated batches (their row maps are device tables) and the sum of their copies
/// (repeat_batch's gradient) on the simulated GPU equal the CPU, and so does cdist.
#[test]
fn repeats_and_their_gradients_on_the_simulated_gpu_equal_the_cpu() {
    let (x, _) = batch(&[5, 1, 0, 3], &[4], Kind::Float, 1);
    let (one, _) = batch(&[2], &[4], Kind::Float, 2);
    assert_simulated_equals_cpu(
        "repeats",
        |x: &[NestedTensor], _: &[Dense]| {
            let whole = x[0].repeat_batch(3)?.tanh()?;
            (&whole
                .cdist(&whole, 2.0)?
                .softmax(2)?
                .matmul_nested(&whole)?
                + 1.0)?
                .repeat_interleave(2)
        },
        &[vec![&x], vec![&one]],
    );
    for interleave in [false, true] {
        let loss = move |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Dense> {
            let repeated = match interleave {
                true => x[0].repeat_interleave(3)?,
                false => x[0].repeat_batch(3)?,
            };
            (&repeated.sin()? * &repeated)?
                .sum(&[], false)?
                .into_dense_handle()
        };
        assert_simulated_gradients_equal_cpu("repeat_loss", loss, &[&x, &one]);
    }
}

/// Slices of the ragged dim (their row maps are device tables) and their gradient (a
/// map that marks the rows outside the slice, written as zeros) on the simulated GPU
/// equal the CPU.
#[test]
fn ragged_slices_and_their_gradients_on_the_simulated_gpu_equal_the_cpu() {
    let (x, _) = batch(&[5, 1, 0, 3], &[4], Kind::Float, 1);
    let (one, _) = batch(&[2], &[4], Kind::Float, 2);
    assert_simulated_equals_cpu(
        "slices",
        |x: &[NestedTensor], _: &[Dense]| &x[0].slice(1, ..-1)?.tanh()? * &x[0].slice(1, 1..)?,
        &[vec![&x], vec![&one]],
    );
    let loss = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Dense> {
        // `[1:-1]` (a Rust range `1..-1` reads as empty to clippy).
        let inner = x[0].slice(
            1,
            Bounds {
                start: Some(1),
                end: Some(-1),
            },
        )?;
        let pairs = (&x[0].slice(1, ..-1)? * &x[0].slice(1, 1..)?.sin()?)?;
        (&inner.sin()? * &inner)?
            .sum(&[], false)?
            .into_dense_handle()?
            .add(&pairs.sum(&[], false)?.into_dense_handle()?)
    };
    assert_simulated_gradients_equal_cpu("slice_loss", loss, &[&x, &one]);
}

/// Adaptive average pooling to sizes other than 1 x 1 (larger than an image's side
/// too), bilinear interpolation, and their gradients (each cell's share spread over the
/// pixels it read) on the simulated GPU equal the CPU (where the same kernels run
/// JIT-compiled).
#[test]
fn resampling_on_the_simulated_gpu_equals_the_cpu() {
    let (x, one) = (
        random_images(&[(5, 3), (1, 1), (7, 4)], 1),
        random_images(&[(2, 6)], 2),
    );
    assert_simulated_equals_cpu(
        "adaptive",
        |x: &[NestedTensor], _: &[Dense]| x[0].adaptive_avg_pool2d([2, 3]),
        &[vec![&x], vec![&one]],
    );
    for align_corners in [false, true] {
        assert_simulated_equals_cpu(
            "bilinear",
            move |x: &[NestedTensor], _: &[Dense]| {
                x[0].interpolate_bilinear(Some([4, 3]), None, align_corners)
            },
            &[vec![&x], vec![&one]],
        );
    }
    let loss = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Dense> {
        let features = x[0].tanh()?;
        let pooled = features.adaptive_avg_pool2d([3, 2])?;
        let interpolated = features.interpolate_bilinear(Some([2, 5]), None, false)?;
        (&pooled * &pooled)?
            .sum(&[], false)?
            .into_dense_handle()?
            .add(
                &(&interpolated * &interpolated)?
                    .sum(&[], false)?
                    .into_dense_handle()?,
            )
    };
    assert_simulated_gradients_equal_cpu("resampling_loss", loss, &[&x, &one]);
}

/// Batch normalization on the batch's statistics and its gradient (whose sums of
/// `g * xhat` and of `g` over every pixel are one row-sum kernel reading both,
/// `SumRows::times` and `SumRows::plain`) on the simulated GPU equal the CPU.
#[test]
fn batch_norm_gradients_on_the_simulated_gpu_equal_the_cpu() {
    let (x, one) = (
        random_images(&[(5, 3), (1, 1), (7, 4)], 3),
        random_images(&[(2, 6)], 4),
    );
    let loss = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Dense> {
        let scale = Tensor::from_slice(&[0.5f32, -1.0, 2.0]);
        let shift = Tensor::from_slice(&[0.1f32, 0.2, -0.3]);
        x[0].tanh()?
            .batch_norm(1, None, None, Some(&scale), Some(&shift), true, 0.1, 1e-5)?
            .relu()?
            .sum(&[], false)?
            .into_dense_handle()
    };
    assert_simulated_gradients_equal_cpu("batch_norm_loss", loss, &[&x, &one]);
}

#[test]
fn transformer_stacks_on_the_simulated_gpu_equal_the_cpu() {
    tch::manual_seed(3);
    let store = nn::VarStore::new(Device::Cpu);
    let (src, _) = batch(&[5, 1, 0, 3], &[16], Kind::Float, 1);
    let (tgt, _) = batch(&[2, 4, 1, 3], &[16], Kind::Float, 2);
    let (other, _) = batch(&[7], &[16], Kind::Float, 3);
    let (other_tgt, _) = batch(&[1], &[16], Kind::Float, 4);
    for norm_first in [false, true] {
        let config = small_config(norm_first);
        let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, true);
        assert_simulated_equals_cpu(
            "encoder",
            |x: &[NestedTensor], _: &[Dense]| encoder.forward(&x[0], false),
            &[vec![&src], vec![&other]],
        );
        let decoder = TransformerDecoder::new(&(store.root() / "decoder"), &config, 2, true);
        assert_simulated_equals_cpu(
            "decoder",
            |x: &[NestedTensor], _: &[Dense]| decoder.forward(&x[0], &x[1], true, false),
            &[vec![&tgt, &src], vec![&other_tgt, &other]],
        );
    }
    let transformer = Transformer::new(&(store.root() / "transformer"), &small_config(true), 1, 1);
    assert_simulated_equals_cpu(
        "transformer",
        |x: &[NestedTensor], _: &[Dense]| transformer.forward(&x[0], &x[1], true, false),
        &[vec![&src, &tgt], vec![&other, &other_tgt]],
    );
}

/// One training step's loss and every parameter's gradient (not accumulated) of a
/// function compiled for the CPU and for the simulated GPU agree on `inputs`.
fn assert_simulated_step_equals_cpu<F>(
    what: &str,
    (on_cpu, on_sim): (&nestor::Compiled<F>, &nestor::Compiled<F>),
    inputs: &[&NestedTensor],
) where
    F: Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Dense>,
{
    let (loss, gradients) = on_cpu.gradients(inputs, &[]).unwrap();
    let (sim_loss, sim_gradients) = on_sim
        .gradients(inputs, &[])
        .unwrap_or_else(|error| panic!("{what}: {error}"));
    assert_close_within(&sim_loss, &loss, 1e-4, &format!("{what}: loss"));
    assert_eq!(sim_gradients.len(), gradients.len());
    assert!(!gradients.is_empty());
    for ((name, expected), (sim_name, actual)) in gradients.iter().zip(&sim_gradients) {
        assert_eq!(name, sim_name);
        assert_close_within(
            &[Value::Dense(actual.shallow_clone())],
            &[Value::Dense(expected.shallow_clone())],
            1e-4,
            &format!("{what}: {name}"),
        );
    }
}

#[test]
fn a_training_step_on_the_simulated_gpu_equals_the_cpu() {
    tch::manual_seed(5);
    let store = nn::VarStore::new(Device::Cpu);
    let config = small_config(true);
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 1, true);
    let head = nn::linear(store.root() / "head", 16, 3, Default::default());
    let model = |x: &[NestedTensor], _: &[Dense]| {
        let hidden = encoder.forward(&x[0], false)?;
        let logits = hidden.linear(&head.ws, head.bs.as_ref())?;
        logits
            .cross_entropy(&x[1], -100, 0.0, LossReduction::Mean)?
            .into_dense_handle()
    };
    let on_cpu = compile("train", model).train(&store);
    let on_sim = compile("train", model).train(&store).on_device(simulated());
    for (lengths, seed) in [(vec![4i64, 1, 6], 7), (vec![3], 8)] {
        let (x, _) = batch(&lengths, &[16], Kind::Float, seed);
        let classes: Vec<Tensor> = lengths
            .iter()
            .map(|&length| Tensor::randint(3, [length], (Kind::Int64, Device::Cpu)))
            .collect();
        let targets = NestedTensor::from_tensors(&classes).unwrap();
        assert_simulated_step_equals_cpu("training step", (&on_cpu, &on_sim), &[&x, &targets]);
    }
    // `call` accumulates the simulated gradients into `.grad()`, as on the CPU.
    let (x, _) = batch(&[2, 3], &[16], Kind::Float, 9);
    let targets = NestedTensor::from_tensors(&[
        Tensor::zeros([2], (Kind::Int64, Device::Cpu)),
        Tensor::ones([3], (Kind::Int64, Device::Cpu)),
    ])
    .unwrap();
    let (_, expected) = on_cpu.gradients(&[&x, &targets], &[]).unwrap();
    on_sim.call(&[&x, &targets], &[]).unwrap();
    let variables = store.variables();
    for (name, gradient) in &expected {
        let accumulated = variables[name].grad();
        assert!(
            accumulated.defined() && accumulated.allclose(gradient, 1e-4, 1e-4, false),
            "{name}: .grad() holds the simulated gradient"
        );
    }
}

#[test]
fn a_steady_encoder_call_uploads_once_and_allocates_nothing() {
    tch::manual_seed(11);
    let store = nn::VarStore::new(Device::Cpu);
    let encoder =
        TransformerEncoder::new(&(store.root() / "encoder"), &small_config(false), 2, true);
    let compiled = compile("encoder", move |x: &[NestedTensor], _: &[Dense]| {
        encoder.forward(&x[0], false)
    })
    .on_device(simulated());
    let (x, _) = batch(&[9, 3, 14, 1], &[16], Kind::Float, 12);
    compiled.call(&[&x], &[]).unwrap();
    let first = compiled.stats();
    compiled.call(&[&x], &[]).unwrap();
    let second = compiled.stats();
    let (launches, device) = (
        second.kernel_launches - first.kernel_launches,
        second.device,
    );
    eprintln!(
        "one steady encoder call on the simulated GPU: {launches} launches, {} upload(s) of \
         {} bytes, {} download(s), {} synchronization(s), {} allocation(s); first call {} \
         allocation(s) ({} bytes)",
        device.uploads - first.device.uploads,
        device.bytes_uploaded - first.device.bytes_uploaded,
        device.downloads - first.device.downloads,
        device.synchronizations - first.device.synchronizations,
        device.allocations - first.device.allocations,
        first.device.allocations,
        first.bytes_allocated,
    );
    assert!(launches > 0);
    // Inputs and parameters are read in place and results written into the returned
    // tensors: the lengths, indices and tables are the one upload; nothing is waited for.
    assert_eq!(device.uploads - first.device.uploads, 1);
    assert_eq!(device.downloads - first.device.downloads, 0);
    assert_eq!(device.synchronizations - first.device.synchronizations, 0);
    assert_eq!(device.allocations - first.device.allocations, 0);
    assert_eq!(second.bytes_allocated, first.bytes_allocated);
}

#[test]
fn a_failed_simulated_call_leaves_the_function_usable() {
    let weight = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
    let compiled = compile("pair", move |x: &[NestedTensor], _: &[Dense]| {
        &x[0].linear(&weight, None)? + &x[1].linear(&weight, None)?
    })
    .on_device(simulated());
    let (a, _) = batch(&[2, 3], &[4], Kind::Float, 1);
    let (b, _) = batch(&[2, 3], &[4], Kind::Float, 2);
    let (short, _) = batch(&[2, 1], &[4], Kind::Float, 3);
    let expected = compiled.call(&[&a, &b], &[]).unwrap();
    assert!(compiled.call(&[&a, &short], &[]).is_err());
    let again = compiled.call(&[&a, &b], &[]).unwrap();
    assert_close_within(&again, &expected, 0.0, "after a failed call");
}

#[test]
fn a_gpu_without_a_driver_is_a_typed_error() {
    let compiled = compile("double", |x: &[NestedTensor], _: &[Dense]| &x[0] * 2.0)
        .on_device(RunDevice::Cuda(0));
    let (x, _) = batch(&[2], &[3], Kind::Float, 1);
    match compiled.call(&[&x], &[]) {
        Err(NestedError::Compile { reason, .. }) => {
            assert_eq!(reason.cause(), CompileCause::Device, "{reason}");
            let message = reason.to_string();
            if message.contains("an input is on") {
                eprintln!("skipped: this machine has a CUDA device ({message})");
            } else {
                assert!(
                    message.contains("libcuda") || message.contains("does not exist"),
                    "the error says what is missing: {message}"
                );
            }
        }
        other => panic!("expected a device error, got {:?}", other.map(|v| v.len())),
    }
    // The failed call left nothing behind: the next fails the same way, not with a
    // poisoned cache.
    let again = compiled.call(&[&x], &[]).unwrap_err();
    assert!(
        matches!(&again, NestedError::Compile { reason, .. } if reason.cause() == CompileCause::Device),
        "{again}"
    );
}

#[test]
fn a_bf16_encoder_runs_in_bf16_buffers_on_the_simulated_gpu() {
    tch::manual_seed(13);
    let mut store = nn::VarStore::new(Device::Cpu);
    let encoder =
        TransformerEncoder::new(&(store.root() / "encoder"), &small_config(false), 2, true);
    store.bfloat16();
    let model = |x: &[NestedTensor], _: &[Dense]| encoder.forward(&x[0], false);
    let on_cpu = compile("encoder", model);
    let on_sim = compile("encoder", model).on_device(simulated());
    for (lengths, seed) in [(vec![6i64, 1, 0, 9], 14), (vec![4], 15)] {
        let (x, _) = batch(&lengths, &[16], Kind::BFloat16, seed);
        let expected = on_cpu.call(&[&x], &[]).unwrap();
        let actual = on_sim.call(&[&x], &[]).unwrap();
        let Value::Nested(result) = &actual[0] else {
            panic!("a batch")
        };
        assert_eq!(result.kind(), Kind::BFloat16);
        // Every intermediate is stored in bf16 on the device (f32 on the CPU).
        assert_close_within(&actual, &expected, 2e-2, "bf16 encoder");
    }
    let before = on_sim.stats();
    let (x, _) = batch(&[6, 1, 0, 9], &[16], Kind::BFloat16, 14);
    on_sim.call(&[&x], &[]).unwrap();
    let after = on_sim.stats();
    assert_eq!(after.device.uploads - before.device.uploads, 1);
    assert_eq!(after.device.allocations, before.device.allocations);
}

#[test]
fn f64_models_on_the_gpu_are_an_unsupported_error() {
    let compiled =
        compile("double", |x: &[NestedTensor], _: &[Dense]| &x[0] * 2.0).on_device(simulated());
    let (x, _) = batch(&[2, 1], &[3], Kind::Double, 1);
    match compiled.call(&[&x], &[]) {
        Err(NestedError::Compile { reason, .. }) => {
            assert_eq!(reason.cause(), CompileCause::Unsupported, "{reason}");
            assert!(
                reason.to_string().contains("f64 programs run on the CPU"),
                "{reason}"
            );
        }
        other => panic!(
            "expected an unsupported error, got {:?}",
            other.map(|v| v.len())
        ),
    }
}

#[test]
fn a_batch_given_twice_is_read_twice_on_the_simulated_gpu() {
    // The second input's memory is the first's: adopted once, the other uploaded.
    let compiled =
        compile("twice", |x: &[NestedTensor], _: &[Dense]| &x[0] * &x[1]).on_device(simulated());
    let on_cpu = compile("twice", |x: &[NestedTensor], _: &[Dense]| &x[0] * &x[1]);
    let (x, _) = batch(&[3, 0, 2], &[4], Kind::Float, 5);
    let expected = on_cpu.call(&[&x, &x], &[]).unwrap();
    let actual = compiled.call(&[&x, &x], &[]).unwrap();
    assert_close_within(&actual, &expected, 0.0, "x * x");
    assert_eq!(
        compiled.stats().device.uploads,
        2,
        "the staged values and one copy of x"
    );
}

/// torchvision's ResNet-18 from `nestor::nn` (64 to 512 channels: the 7x7 stride-2
/// stem, 3x3, 1x1 and strided convolutions, batch norm on running statistics, max and
/// adaptive pooling, the classifier; an image of 1x1 after the stem).
fn resnet18(store: &nn::VarStore) -> ResNet {
    tch::manual_seed(11);
    ResNet::new(&(store.root() / "resnet"), 18, 5).unwrap()
}

/// Images for [`resnet18`].
fn resnet_images() -> NestedTensor {
    random_images(&[(9, 7), (1, 1), (5, 12)], 12)
}

/// The checkpoints' models on a GPU's path: [`resnet18`]'s scores, and a small BERT's
/// (ids, token types and per-element positions embedded, post-norm layers, exact gelu)
/// last hidden states and training step (its loss and every parameter's gradient) on
/// the simulated GPU equal the CPU's.
#[test]
fn resnet_and_bert_on_the_simulated_gpu_equal_the_cpu() {
    let store = nn::VarStore::new(Device::Cpu);
    let resnet = resnet18(&store);
    let scores = |x: &[NestedTensor], _: &[Dense]| resnet.forward(&x[0], false);
    assert_simulated_equals_cpu("resnet18", scores, &[vec![&resnet_images()]]);

    let config = BertConfig {
        vocab_size: 5,
        hidden_size: 16,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        intermediate_size: 32,
        max_position_embeddings: 40,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        pad_token_id: Some(0),
    };
    let bert = Bert::new(&(store.root() / "bert"), &config, false);
    let lengths = [7, 1, 12];
    let tokens = ids(&lengths, 13);
    let mut random = common::Random::new(14);
    let types: Vec<Tensor> = lengths.iter().map(|&l| random.below(2, &[l])).collect();
    let types = common::ragged_batch(&types, &[], Kind::Int64);
    let hidden = |x: &[NestedTensor], _: &[Dense]| {
        bert.forward(&x[0], Some(&x[1]), &Bert::positions(&x[0])?)
    };
    assert_simulated_equals_cpu("bert", hidden, &[vec![&tokens, &types]]);
    let loss = |x: &[NestedTensor], _: &[Dense]| {
        let hidden = bert.forward(&x[0], Some(&x[1]), &Bert::positions(&x[0])?)?;
        (&hidden * &hidden)?.mean(&[], false)?.into_dense_handle()
    };
    let on_cpu = compile("bert_step", loss).train(&store);
    let on_sim = compile("bert_step", loss)
        .train(&store)
        .on_device(simulated());
    assert_simulated_step_equals_cpu("bert step", (&on_cpu, &on_sim), &[&tokens, &types]);
}

/// A training step of [`resnet18`] on the simulated GPU gives the CPU's loss and every
/// parameter's gradient (weight gradients of 64 to 512 channels, strided input
/// gradients, max pooling's). Ignored by `make test`: about 160 s in the debug build
/// (the simulated weight gradients of 11 million parameters); run it with
/// `scripts/cargo test --release --test compile_device -- --ignored` (about 70 s).
#[test]
#[ignore = "about 160 s in the debug build; run with --release -- --ignored"]
fn a_resnet_training_step_on_the_simulated_gpu_equals_the_cpu() {
    let store = nn::VarStore::new(Device::Cpu);
    let resnet = resnet18(&store);
    let loss = |x: &[NestedTensor], _: &[Dense]| {
        let scores = resnet.forward(&x[0], false)?;
        (&scores * &scores)?.mean(&[], false)?.into_dense_handle()
    };
    let on_cpu = compile("resnet18_step", loss).train(&store);
    let on_sim = compile("resnet18_step", loss)
        .train(&store)
        .on_device(simulated());
    assert_simulated_step_equals_cpu("resnet18 step", (&on_cpu, &on_sim), &[&resnet_images()]);
}

/// A sum over every row of a batch (the row-sum kernel, as a batch norm's statistics
/// over every pixel) stays accurate on the simulated GPU as on the CPU: 2^17 rows of
/// 0.1 in f32 within `(64 + runs + 8) * epsilon` of the exact sum, `runs` a lane's
/// runs of 64 rows (a lane adding its 4096 rows in order, as before, was outside it).
#[test]
fn long_sums_on_the_simulated_gpu_stay_accurate() {
    let rows = 1i64 << 17;
    let half = Tensor::full([rows / 2, 2], 0.1, (Kind::Float, Device::Cpu));
    let x = NestedTensor::from_tensors(&[half.shallow_clone(), half]).unwrap();
    let model = |x: &[NestedTensor], _: &[Dense]| x[0].sum(&[0, 1], false)?.into_dense_handle();
    let exact = rows as f64 * f64::from(0.1f32);
    let runs = (rows / (32 * 64)) as f64;
    let bound = (64.0 + runs + 8.0) * f64::from(f32::EPSILON);
    for (device, run_on) in [("cpu", RunDevice::Inputs), ("simulated gpu", simulated())] {
        let compiled = compile("long_sum", model).on_device(run_on);
        let got = compiled.call(&[&x], &[]).unwrap();
        let got = got.into_iter().next().unwrap().into_dense().unwrap();
        assert_eq!(got.size(), [2], "{device}");
        for column in 0..2 {
            let error = (got.double_value(&[column]) - exact).abs() / exact;
            assert!(
                error <= bound,
                "{device}: column {column}: {error:e} over {bound:e}"
            );
        }
    }
}
