//! Batch normalization compiled: outputs and running statistics equal eager's call after
//! call (training and eval mode, sequences `[L, C]` and images `[C, H, W]`, every float
//! kind, f32 parameters for half-precision batches, empty elements and batches), and
//! compiled training through it gives autograd's gradients.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    assert_same_values, cases, float_kinds, lengths, pooled_head_loss, tolerance, Random,
};
use nestor::{compile, Dense, NestedTensor, Value};
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

const CHANNELS: i64 = 3;

/// Random elements of one layout: sequences `[L_i, C]` (channel dim -1) or images
/// `[C, H_i, W_i]` (channel dim 1, ragged `H` and `W`).
#[derive(Clone, Debug)]
enum Layout {
    Sequences(Vec<i64>),
    Images(Vec<(i64, i64)>),
}

impl Layout {
    /// The batch of [`CHANNELS`] channels in `kind`, and its channel dim.
    fn batch(&self, kind: Kind, seed: i64) -> (NestedTensor, i64) {
        self.batch_of(CHANNELS, kind, seed)
    }

    /// The batch of `channels` channels in `kind`, and its channel dim.
    fn batch_of(&self, channels: i64, kind: Kind, seed: i64) -> (NestedTensor, i64) {
        let mut random = Random::new(seed);
        let (shapes, ragged, channel): (Vec<Vec<i64>>, &[usize], i64) = match self {
            Layout::Sequences(lengths) => (
                lengths.iter().map(|&l| vec![l, channels]).collect(),
                &[0],
                -1,
            ),
            Layout::Images(sizes) => (
                sizes.iter().map(|&(h, w)| vec![channels, h, w]).collect(),
                &[1, 2],
                1,
            ),
        };
        // Values away from zero mean, as real activations.
        let elements: Vec<Tensor> = shapes
            .iter()
            .map(|shape| (random.normal(shape) * 2.0 + 0.5).to_kind(kind))
            .collect();
        let batch = NestedTensor::builder()
            .ragged_dims(ragged)
            .tensors(&elements)
            .unwrap();
        (batch, channel)
    }
}

/// Two layouts of one kind (one compiled structure, two sets of sizes).
fn layouts() -> impl Strategy<Value = (Layout, Layout)> {
    let image_sizes = || {
        proptest::collection::vec(
            (prop_oneof![Just(0i64), Just(1i64), 1i64..=5], 1i64..=5),
            1..=3,
        )
    };
    prop_oneof![
        (lengths(4, 6), lengths(4, 6))
            .prop_map(|(a, b)| (Layout::Sequences(a), Layout::Sequences(b))),
        (image_sizes(), image_sizes()).prop_map(|(a, b)| (Layout::Images(a), Layout::Images(b))),
    ]
}

/// Per-channel parameters `[C]`: positive ones for variances.
fn per_channel(random: &mut Random, kind: Kind, positive: bool) -> Tensor {
    let values = random.normal(&[CHANNELS]);
    let values = if positive { values.abs() + 0.5 } else { values };
    values.to_kind(kind)
}

/// Normalizing divides by the standard deviation, which scales up the rounding of the
/// mean (libtorch accumulates it in double, compiled kernels in the program's type).
fn output_tolerance(kind: Kind) -> f64 {
    tolerance(kind) * 10.0
}

/// How far two correct f32 (f64 for f64) computations of training-mode batch norm may
/// land apart: normalizing divides the rounding of `x * scale + shift` (a few units of
/// the last place of the largest `|x| * scale`) by nothing, so a channel of (nearly)
/// equal values, whose exact output is 0, comes out as noise of
/// `|x| / sqrt(var + eps)` ulps. Eight of those ulps in the worst channel; 0 in eval
/// mode (running variances of at least 0.5) and for an empty batch.
fn amplified_rounding(batch: &NestedTensor, wide: Kind, training: bool) -> f64 {
    let values = batch.values().to_kind(Kind::Double);
    if !training || values.numel() == 0 {
        return 0.0;
    }
    // Packed values are rows of `[.., C]`, the channels last, for both layouts.
    let channels = values.reshape([-1, CHANNELS]);
    let var = channels.var_dim(0, false, false);
    let largest = channels.abs().amax(0, false);
    let amplification = (largest / (var + 1e-5).sqrt()).max().double_value(&[]);
    let unit = if wide == Kind::Double {
        f64::EPSILON
    } else {
        f32::EPSILON as f64
    };
    8.0 * unit * amplification
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(24)))]

    /// Compiled batch normalization equals eager on two batches in a row: the outputs,
    /// and the running statistics each call updates (training mode) or reads (eval
    /// mode), with and without the affine parameters.
    #[test]
    fn compiled_batch_norm_equals_eager(
        (first, second) in layouts(),
        kind in float_kinds(),
        training in any::<bool>(),
        affine in any::<bool>(),
        mixed in any::<bool>(),
        seed in 0i64..1000,
    ) {
        // Mixed precision: f32 parameters and statistics for a half-precision batch.
        let parameters = match kind {
            Kind::Half | Kind::BFloat16 if mixed => Kind::Float,
            _ => kind,
        };
        let mut random = Random::new(seed);
        let (weight, bias) = (per_channel(&mut random, parameters, true), per_channel(&mut random, parameters, false));
        let affine = affine.then_some((weight, bias));
        let (mean, var) = (per_channel(&mut random, parameters, false), per_channel(&mut random, parameters, true));
        let (eager_mean, eager_var) = (mean.copy(), var.copy());
        let (compiled_mean, compiled_var) = (mean.copy(), var.copy());
        let (model_mean, model_var, model_affine) = (
            compiled_mean.shallow_clone(),
            compiled_var.shallow_clone(),
            affine.as_ref().map(|(w, b)| (w.shallow_clone(), b.shallow_clone())),
        );
        let channel = match first { Layout::Sequences(_) => -1, Layout::Images(_) => 1 };
        let compiled = compile("batch_norm", move |x: &[NestedTensor], _: &[Dense]| {
            let (weight, bias) = (model_affine.as_ref().map(|p| &p.0), model_affine.as_ref().map(|p| &p.1));
            x[0].batch_norm(channel, Some(&model_mean), Some(&model_var), weight, bias, training, 0.1, 1e-5)
        });
        // libtorch's own half-precision kernels lose digits (of two close values, their
        // normalized pair came out 0.81 and -0.76 where f64 gives +-0.787), so the
        // reference is its f32 computation rounded once, as a compiled program's.
        let wide = match kind {
            Kind::Half | Kind::BFloat16 => Kind::Float,
            other => other,
        };
        for (call, layout) in [first, second].iter().enumerate() {
            let (batch, _) = layout.batch(kind, seed + call as i64);
            let widened = |p: &Tensor| p.to_kind(wide);
            let (weight, bias) = (affine.as_ref().map(|p| widened(&p.0)), affine.as_ref().map(|p| widened(&p.1)));
            let (mean, var) = (widened(&eager_mean), widened(&eager_var));
            let eager = batch
                .to_kind(wide)
                .unwrap()
                .batch_norm(channel, Some(&mean), Some(&var), weight.as_ref(), bias.as_ref(), training, 0.1, 1e-5)
                .unwrap()
                .to_kind(kind)
                .unwrap();
            // The running statistics the f32 computation updated, rounded once.
            eager_mean.shallow_clone().copy_(&mean);
            eager_var.shallow_clone().copy_(&var);
            let got = compiled.call(&[&batch], &[]).unwrap();
            let [Value::Nested(got)] = got.as_slice() else { panic!("one batch expected") };
            prop_assert_eq!(got.layout().element_sizes(), eager.layout().element_sizes());
            prop_assert_eq!(got.values().kind(), eager.values().kind());
            let what = format!("call {call} ({kind:?}, training {training})");
            let absolute = output_tolerance(kind).max(amplified_rounding(&batch, wide, training));
            assert_same_values(got.values(), eager.values(), output_tolerance(kind), absolute, &what);
            let tolerance = tolerance(kind);
            assert_same_values(&compiled_mean, &eager_mean, tolerance, tolerance, &format!("{what}: running mean"));
            assert_same_values(&compiled_var, &eager_var, tolerance, tolerance, &format!("{what}: running var"));
        }
        // A batch whose heights equal its widths (or another batch size class) is
        // another structure: at most one compile per call.
        prop_assert!(compiled.stats().compiles <= 2);
    }
}

/// Training-mode batch norm with running statistics and no affine parameters, torch's
/// defaults (momentum 0.1, eps 1e-5).
fn train_norm(
    x: &NestedTensor,
    channel: i64,
    mean: &Tensor,
    var: &Tensor,
) -> nestor::Result<NestedTensor> {
    x.batch_norm(channel, Some(mean), Some(var), None, None, true, 0.1, 1e-5)
}

/// Statistics of nothing leave the running ones alone (an empty batch), and one value
/// per channel gives a NaN running variance (`n / (n - 1)`), as libtorch.
#[test]
fn empty_batches_and_single_values_update_running_statistics_as_libtorch() {
    for sizes in [vec![(0, 4), (2, 0)], vec![(1, 1)], vec![(1, 1), (0, 0)]] {
        let (batch, channel) = Layout::Images(sizes.clone()).batch(Kind::Float, 7);
        let running = || {
            (
                Tensor::zeros([CHANNELS], (Kind::Float, Device::Cpu)),
                Tensor::ones([CHANNELS], (Kind::Float, Device::Cpu)),
            )
        };
        let (eager_mean, eager_var) = running();
        let eager = train_norm(&batch, channel, &eager_mean, &eager_var).unwrap();
        let (mean, var) = running();
        let (model_mean, model_var) = (mean.shallow_clone(), var.shallow_clone());
        let compiled = compile("batch_norm", move |x: &[NestedTensor], _: &[Dense]| {
            train_norm(&x[0], channel, &model_mean, &model_var)
        });
        let got = compiled.call(&[&batch], &[]).unwrap();
        let [Value::Nested(got)] = got.as_slice() else {
            panic!("one batch expected")
        };
        let what = format!("{sizes:?}");
        assert_same_values(got.values(), eager.values(), 1e-4, 1e-4, &what);
        assert_same_values(&mean, &eager_mean, 1e-6, 1e-6, &format!("{what}: mean"));
        assert_same_values(&var, &eager_var, 1e-6, 1e-6, &format!("{what}: var"));
    }
}

/// A small conv net with batch normalization (training mode, running statistics): a
/// convolution, batch norm, relu, global average pooling, a linear head, the mean square.
fn conv_bn_loss(x: &NestedTensor, params: &[Tensor], running: &[Tensor]) -> nestor::Result<Dense> {
    let normalized = x
        .conv2d(&params[0], Some(&params[1]), [1, 1], [1, 1], [1, 1], 1)?
        .batch_norm(
            1,
            Some(&running[0]),
            Some(&running[1]),
            Some(&params[2]),
            Some(&params[3]),
            true,
            0.1,
            1e-5,
        )?;
    pooled_head_loss(&normalized.relu()?, &params[4], &params[5])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// Compiled training through batch normalization: the loss, every parameter's
    /// gradient and the running statistics equal eager autograd's, call after call; the
    /// norm's gradient sums `g * xhat` in one pass over both (no product step).
    #[test]
    fn compiled_training_through_batch_norm_equals_autograd(
        sizes in proptest::collection::vec(
            proptest::collection::vec((1i64..=5, 1i64..=5), 1..=3),
            2,
        ),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let (c_in, c) = (2, CHANNELS);
        let mut random = Random::new(seed);
        let shapes = [vec![c, c_in, 3, 3], vec![c], vec![c], vec![c], vec![2, c], vec![2]];
        let params: Vec<Tensor> = shapes
            .iter()
            .map(|shape| (random.normal(shape) * 0.5).to_kind(kind).set_requires_grad(true))
            .collect();
        let store = tch::nn::VarStore::new(Device::Cpu);
        let root = store.root();
        let names = ["conv_weight", "conv_bias", "bn_weight", "bn_bias", "head_weight", "head_bias"];
        let variables: Vec<Tensor> = names
            .iter()
            .zip(&params)
            .map(|(name, param)| root.add(name, param.detach(), true))
            .collect();
        let eager_running = [Tensor::zeros([c], (kind, Device::Cpu)), Tensor::ones([c], (kind, Device::Cpu))];
        let running: Vec<Tensor> = eager_running.iter().map(Tensor::copy).collect();
        let model_running: Vec<Tensor> = running.iter().map(Tensor::shallow_clone).collect();
        let compiled = compile("conv_bn", move |x: &[NestedTensor], _: &[Dense]| {
            conv_bn_loss(&x[0], &variables, &model_running)
        })
        .train(&store);
        compiled.record_steps(true);
        let tolerance = if double { 1e-9 } else { 1e-4 };
        let error = |a: &Tensor, e: &Tensor| {
            ((a.to_kind(Kind::Double) - e.to_kind(Kind::Double)).abs() / (e.to_kind(Kind::Double).abs() + 1.0))
                .max()
                .double_value(&[])
        };
        for (call, sizes) in sizes.iter().enumerate() {
            let batch = Layout::Images(sizes.clone()).batch_of(c_in, kind, seed + call as i64).0;
            for param in &params {
                let mut grad = param.grad();
                if grad.defined() {
                    let _ = grad.zero_();
                }
            }
            let eager_loss = conv_bn_loss(&batch, &params, &eager_running).unwrap().into_tensor();
            eager_loss.backward();
            let (outputs, named) = compiled.gradients(&[&batch], &[]).unwrap();
            let loss = outputs.into_iter().next().unwrap().into_dense().unwrap();
            prop_assert!(error(&loss, &eager_loss) <= tolerance, "call {call}: loss {loss:?} vs {eager_loss:?}");
            for (name, param) in names.iter().zip(&params) {
                let (_, grad) = named
                    .iter()
                    .find(|(path, _)| path == name)
                    .unwrap_or_else(|| panic!("no gradient for {name}"));
                prop_assert!(error(grad, &param.grad()) <= tolerance, "call {call}, {kind:?} {name}: {grad:?} vs {:?}", param.grad());
            }
            // NaN where eager has NaN (one value per channel).
            for (got, want) in running.iter().zip(&eager_running) {
                assert_same_values(got, want, tolerance, tolerance, &format!("call {call}: running statistics"));
            }
        }
        // A batch whose heights equal its widths (or another batch size class) is
        // another structure: at most one compile per call.
        prop_assert!(compiled.stats().compiles <= 2);
        let labels: Vec<String> = compiled.take_step_profiles().into_iter().flat_map(|run| run.steps).map(|step| step.label).collect();
        prop_assert!(labels.iter().any(|label| label.starts_with("column sums of products and of values")), "{labels:?}");
    }
}

/// Two 1x1 convolutions, each with batch normalization on running statistics (eval
/// mode, as ResNet benchmarks train) and a relu, then global average pooling, a linear
/// head, the mean square: the gradient through each norm is a per-channel scale of the
/// next gradient, which compiled training moves into the convolutions' gradients.
fn pointwise_conv_bn_loss(
    x: &NestedTensor,
    params: &[Tensor],
    running: &[Tensor],
) -> nestor::Result<Dense> {
    let mut hidden = x.shallow_clone();
    for (layer, bias) in [(0, Some(&params[1])), (1, None)] {
        let at = 4 * layer;
        hidden = hidden
            .conv2d(&params[at], bias, [1, 1], [0, 0], [1, 1], 1)?
            .batch_norm(
                1,
                Some(&running[2 * layer]),
                Some(&running[2 * layer + 1]),
                Some(&params[at + 2]),
                Some(&params[at + 3]),
                false,
                0.1,
                1e-5,
            )?
            .relu()?;
    }
    pooled_head_loss(&hidden, &params[8], &params[9])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// Compiled training through 1x1 convolutions and eval-mode batch norms: the loss
    /// and every parameter's gradient equal eager autograd's, images of one pixel
    /// included.
    #[test]
    fn compiled_training_through_eval_batch_norm_equals_autograd(
        sizes in proptest::collection::vec((1i64..=5, 1i64..=5), 1..=3),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let (c_in, c) = (2, CHANNELS);
        let mut random = Random::new(seed);
        let shapes = [
            vec![c, c_in, 1, 1], vec![c], vec![c], vec![c],
            vec![c, c, 1, 1], vec![c], vec![c], vec![c],
            vec![2, c], vec![2],
        ];
        let params: Vec<Tensor> = shapes
            .iter()
            .map(|shape| (random.normal(shape) * 0.5).to_kind(kind).set_requires_grad(true))
            .collect();
        let running: Vec<Tensor> = (0..4)
            .map(|index| match index % 2 {
                0 => random.normal(&[c]).to_kind(kind),
                _ => (random.normal(&[c]).square() + 0.5).to_kind(kind),
            })
            .collect();
        let store = tch::nn::VarStore::new(Device::Cpu);
        let root = store.root();
        let names: Vec<String> = (0..params.len()).map(|index| format!("p{index}")).collect();
        let variables: Vec<Tensor> = names
            .iter()
            .zip(&params)
            .map(|(name, param)| root.add(name, param.detach(), true))
            .collect();
        let model_running: Vec<Tensor> = running.iter().map(Tensor::shallow_clone).collect();
        let compiled = compile("pointwise_conv_bn", move |x: &[NestedTensor], _: &[Dense]| {
            pointwise_conv_bn_loss(&x[0], &variables, &model_running)
        })
        .train(&store);
        let mut sizes = sizes;
        sizes.push((1, 1));
        let batch = Layout::Images(sizes).batch_of(c_in, kind, seed).0;
        let eager_loss = pointwise_conv_bn_loss(&batch, &params, &running).unwrap().into_tensor();
        eager_loss.backward();
        let (outputs, named) = compiled.gradients(&[&batch], &[]).unwrap();
        let loss = outputs.into_iter().next().unwrap().into_dense().unwrap();
        let tolerance = if double { 1e-9 } else { 1e-4 };
        assert_same_values(&loss, &eager_loss, tolerance, tolerance, "loss");
        // The second convolution has no bias: its parameter is unused.
        for (name, param) in names.iter().zip(&params).filter(|(_, param)| param.grad().defined()) {
            let (_, grad) = named
                .iter()
                .find(|(path, _)| path == name)
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            assert_same_values(grad, &param.grad(), tolerance, tolerance, &format!("{kind:?} {name}"));
        }
    }
}

/// Tracing leaves the running statistics alone; each interpreted run of the traced
/// graph updates them as one eager call does.
#[test]
fn traced_runs_update_running_statistics_once() {
    let (batch, channel) = Layout::Sequences(vec![3, 0, 5]).batch(Kind::Float, 11);
    let options = (Kind::Float, Device::Cpu);
    let (mean, var) = (
        Tensor::zeros([CHANNELS], options),
        Tensor::ones([CHANNELS], options),
    );
    let (eager_mean, eager_var) = (mean.copy(), var.copy());
    let traced = nestor::trace("batch_norm", &[&batch], &[], None, |x, _| {
        train_norm(&x[0], channel, &mean, &var)
    })
    .unwrap();
    assert_eq!(
        mean.abs().sum(Kind::Float).double_value(&[]),
        0.0,
        "tracing updated the mean"
    );
    assert!(traced.text().contains("batch_norm("), "{}", traced.text());
    for run in 0..2 {
        let got = traced.run(&[&batch], &[]).unwrap();
        let eager = train_norm(&batch, channel, &eager_mean, &eager_var).unwrap();
        let [Value::Nested(got)] = got.as_slice() else {
            panic!("one batch expected")
        };
        let what = format!("run {run}");
        assert_same_values(got.values(), eager.values(), 1e-5, 1e-5, &what);
        assert_same_values(&mean, &eager_mean, 1e-6, 1e-6, &format!("{what}: mean"));
        assert_same_values(&var, &eager_var, 1e-6, 1e-6, &format!("{what}: var"));
    }
}
