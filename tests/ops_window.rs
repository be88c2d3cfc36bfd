//! Packed convolution and pooling of images `[C, H_i, W_i]` (ragged `H` and `W`)
//! against libtorch on every image alone: values and gradients, every float kind,
//! random sizes (1 included), strides, paddings and dilations, batch size 1.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    assert_close_within, assert_floats_close_within, cases, close, close_within, eager_values,
    float_kinds, pooled_head_loss, Out, Random,
};
use nestor::{
    compile, nested_execution_guard, Binary, CompileCause, Dense, NestedError, NestedTensor,
    Reduce, RunDevice, SimOptions,
};
use proptest::prelude::*;
use tch::{Kind, Tensor};

/// A window's geometry per axis: kernel, stride, padding, dilation.
#[derive(Clone, Debug)]
struct Geometry {
    kernel: [i64; 2],
    stride: [i64; 2],
    padding: [i64; 2],
    dilation: [i64; 2],
}

fn geometry(max_dilation: i64) -> impl Strategy<Value = Geometry> {
    let axis = (1i64..=3, 1i64..=2, 1i64..=max_dilation).prop_flat_map(|(k, s, d)| {
        // Pooling takes padding up to half the window; convolution any, this suffices.
        (Just(k), Just(s), 0..=k / 2, Just(d))
    });
    (axis.clone(), axis).prop_map(|(h, w)| Geometry {
        kernel: [h.0, w.0],
        stride: [h.1, w.1],
        padding: [h.2, w.2],
        dilation: [h.3, w.3],
    })
}

fn image_sizes() -> impl Strategy<Value = Vec<(i64, i64)>> {
    proptest::collection::vec((1i64..=9, 1i64..=9), 1..=4)
}

/// Leaves `[C, h, w]` in f64 (for the reference and their gradients) and the packed
/// batch of their copies in `kind`, ragged in `H` and `W` even when sizes agree.
fn images(
    sizes: &[(i64, i64)],
    channels: i64,
    kind: Kind,
    seed: i64,
) -> (Vec<Tensor>, Vec<Tensor>, NestedTensor) {
    let mut random = Random::new(seed);
    let reference: Vec<Tensor> = sizes
        .iter()
        .map(|&(h, w)| {
            random
                .normal(&[channels, h, w])
                .to_kind(kind)
                .to_kind(Kind::Double)
                .set_requires_grad(true)
        })
        .collect();
    let leaves: Vec<Tensor> = reference
        .iter()
        .map(|e| e.detach().to_kind(kind).set_requires_grad(true))
        .collect();
    let nested = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&leaves)
        .unwrap();
    (reference, leaves, nested)
}

/// Runs `packed` on the batch and `alone` on each image (in f64), then the gradients
/// of a random weighting of the outputs; compares outputs and the gradients of the
/// images and of `params` (pairs of the packed run's and the reference's leaves).
fn check(
    sizes: &[(i64, i64)],
    channels: i64,
    kind: Kind,
    packed: &dyn Fn(&NestedTensor) -> NestedTensor,
    alone: &dyn Fn(&Tensor) -> Tensor,
    params: &[(&Tensor, &Tensor)],
) {
    let (reference, leaves, nested) = images(sizes, channels, kind, 7);
    // Packed: no per-element slow path.
    let out = nested_execution_guard(|| packed(&nested));
    // Without gradients (inference), f32 convolutions run nestor's own kernel.
    let inference = tch::no_grad(|| nested_execution_guard(|| packed(&nested)));
    let expected: Vec<Tensor> = reference
        .iter()
        .map(|e| alone(&e.unsqueeze(0)).squeeze_dim(0))
        .collect();
    let actual = out.unbind().unwrap();
    for (index, (a, e)) in inference
        .unbind()
        .unwrap()
        .iter()
        .zip(&expected)
        .enumerate()
    {
        assert!(
            close(a, e, kind),
            "{kind:?} inference output of image {index}"
        );
    }
    assert_eq!(actual.len(), expected.len());
    let mut random = Random::new(11);
    let mut loss = Tensor::zeros([], (Kind::Double, tch::Device::Cpu));
    let mut reference_loss = Tensor::zeros([], (Kind::Double, tch::Device::Cpu));
    for (index, (a, e)) in actual.iter().zip(&expected).enumerate() {
        assert!(
            close(a, e, kind),
            "{kind:?} output of image {index} {:?}",
            sizes[index]
        );
        let weights = random.normal(&e.size());
        loss += (a.to_kind(Kind::Double) * &weights).sum(Kind::Double);
        reference_loss += (e * &weights).sum(Kind::Double);
    }
    loss.backward();
    reference_loss.backward();
    for (index, (leaf, reference)) in leaves.iter().zip(&reference).enumerate() {
        assert_gradient(
            &leaf.grad(),
            &reference.grad(),
            kind,
            &format!("image {index}"),
        );
    }
    for (index, (param, reference)) in params.iter().enumerate() {
        assert_gradient(
            &param.grad(),
            &reference.grad(),
            kind,
            &format!("parameter {index}"),
        );
    }
}

/// A gradient against the f64 reference's: position by position in f32 and f64; in f16
/// and bf16 (whose outputs' gradients arrive rounded, then sum many terms) against the
/// largest entry, at bf16's tolerance.
fn assert_gradient(actual: &Tensor, expected: &Tensor, kind: Kind, what: &str) {
    if !matches!(kind, Kind::Half | Kind::BFloat16) {
        assert!(close(actual, expected, kind), "{kind:?} gradient of {what}");
        return;
    }
    let (actual, expected) = (actual.to_kind(Kind::Double), expected.to_kind(Kind::Double));
    let error = (&actual - &expected).abs().max().double_value(&[]);
    let scale = 1.0 + expected.abs().max().double_value(&[]);
    assert!(
        error <= common::tolerance(Kind::BFloat16) * scale,
        "{kind:?} gradient of {what}: error {error}, scale {scale}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(24)))]

    #[test]
    fn packed_conv2d_matches_each_image(
        sizes in image_sizes(),
        geometry in geometry(2),
        (c_in, c_out) in (1i64..=3, 1i64..=4),
        with_bias in any::<bool>(),
        kind in float_kinds(),
        seed in 0i64..1000,
    ) {
        let Geometry { kernel, stride, padding, dilation } = geometry;
        // Every image covers the window (libtorch refuses an empty output).
        let reach = |axis: usize| dilation[axis] * (kernel[axis] - 1) + 1 - 2 * padding[axis];
        let sizes: Vec<(i64, i64)> = sizes.iter().map(|&(h, w)| (h.max(reach(0)), w.max(reach(1)))).collect();
        let mut random = Random::new(seed);
        let weight_ref = random.normal(&[c_out, c_in, kernel[0], kernel[1]]).to_kind(kind).to_kind(Kind::Double).set_requires_grad(true);
        let bias_ref = random.normal(&[c_out]).to_kind(kind).to_kind(Kind::Double).set_requires_grad(true);
        let weight = weight_ref.detach().to_kind(kind).set_requires_grad(true);
        let bias = bias_ref.detach().to_kind(kind).set_requires_grad(true);
        let mut params = vec![(&weight, &weight_ref)];
        if with_bias {
            params.push((&bias, &bias_ref));
        }
        check(
            &sizes,
            c_in,
            kind,
            &|x| x.conv2d(&weight, with_bias.then_some(&bias), stride, padding, dilation, 1).unwrap(),
            &|x| x.conv2d(&weight_ref, with_bias.then_some(&bias_ref), stride, padding, dilation, 1),
            &params,
        );
    }

    #[test]
    fn packed_pooling_matches_each_image(
        sizes in image_sizes(),
        geometry in geometry(1),
        channels in 1i64..=3,
        kind in float_kinds(),
    ) {
        let Geometry { kernel, stride, padding, .. } = geometry;
        let reach = |axis: usize| kernel[axis] - 2 * padding[axis];
        let sizes: Vec<(i64, i64)> = sizes.iter().map(|&(h, w)| (h.max(reach(0)), w.max(reach(1)))).collect();
        check(
            &sizes,
            channels,
            kind,
            &|x| x.max_pool2d(kernel, stride, padding).unwrap(),
            &|x| x.max_pool2d(kernel, stride, padding, [1, 1], false),
            &[],
        );
        check(
            &sizes,
            channels,
            kind,
            &|x| x.avg_pool2d(kernel, stride, padding).unwrap(),
            &|x| x.avg_pool2d(kernel, stride, padding, false, false, None::<i64>),
            &[],
        );
        check(
            &sizes,
            channels,
            kind,
            &|x| x.adaptive_avg_pool2d([1, 1]).unwrap(),
            &|x| x.adaptive_avg_pool2d([1, 1]),
            &[],
        );
    }
}

#[test]
fn max_pooling_ties_and_nan_pick_the_pixel_libtorch_picks() {
    // Ties (all ones), NaN and -inf, with padding: the gradient goes where libtorch's goes.
    let image = Tensor::from_slice(&[
        1.0f32,
        1.0,
        f32::NAN,
        1.0,
        f32::NEG_INFINITY,
        f32::NEG_INFINITY,
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
        1.0,
    ])
    .reshape([1, 3, 4]);
    let other = Tensor::full(
        [1, 2, 2],
        f64::NEG_INFINITY,
        (Kind::Float, tch::Device::Cpu),
    );
    for (kernel, stride, padding) in [
        ([2, 2], [1, 1], [1, 1]),
        ([3, 3], [2, 2], [1, 1]),
        ([2, 3], [1, 2], [0, 1]),
    ] {
        let leaves = [
            image.copy().set_requires_grad(true),
            other.copy().set_requires_grad(true),
        ];
        let nested = NestedTensor::builder()
            .ragged_dims(&[1, 2])
            .tensors(&leaves)
            .unwrap();
        let out = nested.max_pool2d(kernel, stride, padding).unwrap();
        out.values().sum(Kind::Float).backward();
        for (leaf, pooled) in leaves.iter().zip(out.unbind().unwrap()) {
            let reference = leaf.detach().set_requires_grad(true);
            let expected = reference
                .unsqueeze(0)
                .max_pool2d(kernel, stride, padding, [1, 1], false)
                .squeeze_dim(0);
            assert!(
                pooled.allclose(&expected, 0.0, 0.0, true),
                "{pooled:?} vs {expected:?}"
            );
            expected.sum(Kind::Float).backward();
            assert!(
                leaf.grad().equal(&reference.grad()),
                "{kernel:?} {stride:?} {padding:?}"
            );
        }
    }
}

#[test]
fn empty_outputs_grouped_convolutions_and_other_layouts() {
    let weight = Tensor::randn([4, 2, 3, 3], (Kind::Float, tch::Device::Cpu));
    // A 1 x 5 image under a 3 x 3 window without padding has no output pixel.
    let sizes = [(1, 5), (4, 6)];
    let elements: Vec<Tensor> = sizes
        .iter()
        .map(|&(h, w)| Tensor::randn([2, h, w], (Kind::Float, tch::Device::Cpu)))
        .collect();
    let nested = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&elements)
        .unwrap();
    let out = nested
        .conv2d(&weight, None, [1, 1], [0, 0], [1, 1], 1)
        .unwrap();
    assert_eq!(out.layout().element_sizes(), [vec![4, 0, 3], vec![4, 2, 4]]);
    // Grouped convolutions and images ragged in one dim only run per element.
    let grouped = Tensor::randn([4, 1, 3, 3], (Kind::Float, tch::Device::Cpu));
    let per_element = nested
        .conv2d(&grouped, None, [1, 1], [1, 1], [1, 1], 2)
        .unwrap();
    let expected: Vec<Tensor> = elements
        .iter()
        .map(|e| {
            e.unsqueeze(0)
                .conv2d(&grouped, None::<Tensor>, [1, 1], [1, 1], [1, 1], 2)
                .squeeze_dim(0)
        })
        .collect();
    common::assert_elements(&per_element, &expected, Kind::Float);
    let rows: Vec<Tensor> = [3, 5]
        .iter()
        .map(|&w| Tensor::randn([2, 4, w], (Kind::Float, tch::Device::Cpu)))
        .collect();
    let one_ragged = NestedTensor::from_tensors(&rows).unwrap();
    assert_eq!(one_ragged.layout().ragged_dims(), [2]);
    let out = one_ragged
        .conv2d(&weight, None, [1, 1], [1, 1], [1, 1], 1)
        .unwrap();
    let expected: Vec<Tensor> = rows
        .iter()
        .map(|e| {
            e.unsqueeze(0)
                .conv2d(&weight, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1)
                .squeeze_dim(0)
        })
        .collect();
    common::assert_elements(&out, &expected, Kind::Float);
    // A weight of the wrong shape is an error, not a panic.
    let flat = Tensor::randn([4, 2], (Kind::Float, tch::Device::Cpu));
    assert!(nested
        .conv2d(&flat, None, [1, 1], [1, 1], [1, 1], 1)
        .is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(12)))]

    /// Compiled without any per-element fallback: convolution, pooling and global
    /// average pooling are window steps, one program for every batch.
    #[test]
    fn compiled_windows_equal_eager(
        batches in proptest::collection::vec(image_sizes(), 2),
        conv in geometry(2),
        pool in geometry(1),
        (c_in, c_out) in (1i64..=3, 1i64..=4),
        average in any::<bool>(),
        kind in float_kinds(),
        seed in 0i64..1000,
    ) {
        let mut random = Random::new(seed);
        let weight = random.normal(&[c_out, c_in, conv.kernel[0], conv.kernel[1]]).to_kind(kind);
        let bias = random.normal(&[c_out]).to_kind(kind);
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            let features = x[0]
                .conv2d(&weight, Some(&bias), conv.stride, conv.padding, conv.dilation, 1)?
                .relu()?;
            let pooled = if average {
                features.avg_pool2d(pool.kernel, pool.stride, pool.padding)?
            } else {
                features.max_pool2d(pool.kernel, pool.stride, pool.padding)?
            };
            Ok(vec![
                features.shallow_clone().into(),
                pooled.into(),
                x[0].adaptive_avg_pool2d([1, 1])?.into(),
            ])
        };
        let compiled = compile("windows", model);
        // Every image covers both windows (libtorch refuses an empty output).
        let reach = |axis: usize| {
            let conv_reach = conv.dilation[axis] * (conv.kernel[axis] - 1) + 1 - 2 * conv.padding[axis];
            let out = conv_reach.max(pool.kernel[axis] - 2 * pool.padding[axis]);
            // The convolution's output must still cover the pooling window.
            (out - 1) * conv.stride[axis] + conv_reach
        };
        for (index, sizes) in batches.iter().enumerate() {
            let mut sizes: Vec<(i64, i64)> = sizes.iter().map(|&(h, w)| (h.max(reach(0)), w.max(reach(1)))).collect();
            // Heights and widths differ (equal lengths would trace as one symbol, another
            // structure).
            let side = reach(0).max(reach(1)).max(1);
            sizes.extend([(side, side + 1), (side + 1, side)]);
            let (_, leaves, batch) = images(&sizes, c_in, kind, index as i64);
            let batch = batch.detach().unwrap();
            drop(leaves);
            let outputs = compiled.call(&[&batch], &[]).unwrap();
            let eager = eager_values(model(std::slice::from_ref(&batch), &[]).unwrap());
            assert_close_within(&outputs, &eager, common::tolerance(kind).max(1e-5), &format!("{kind:?} windows {sizes:?}"));
        }
        prop_assert_eq!(compiled.stats().compiles, 1);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// A 1x1 convolution without stride or padding compiles to one GEMM over the
    /// packed pixels, and what follows it to that GEMM's epilogue: a relu, or (as in
    /// ResNet's blocks) a batch norm on running statistics, whose per-channel scale and
    /// shift are computed after the convolution, plus a second 1x1 convolution as the
    /// residual, then the relu. Equal to eager on the CPU and on the simulated GPU,
    /// images of one pixel included, with and without bias, in every float kind (f64 on
    /// the CPU).
    #[test]
    fn compiled_pointwise_conv_equals_eager(
        sizes in image_sizes(),
        (c_in, c_out) in (1i64..=5, 1i64..=6),
        (with_bias, with_norm) in (any::<bool>(), any::<bool>()),
        kind in float_kinds(),
        seed in 0i64..1000,
    ) {
        let mut random = Random::new(seed);
        let weight = random.normal(&[c_out, c_in, 1, 1]).to_kind(kind);
        let bias = random.normal(&[c_out]).to_kind(kind);
        let residual_weight = random.normal(&[c_out, c_in, 1, 1]).to_kind(kind);
        let [mean, scale, shift] = [0; 3].map(|_| random.normal(&[c_out]).to_kind(kind));
        let variance = (random.normal(&[c_out]).square() + 0.5).to_kind(kind);
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            let bias = with_bias.then_some(&bias);
            let mut y = x[0].conv2d(&weight, bias, [1, 1], [0, 0], [1, 1], 1)?;
            if with_norm {
                let norm = (Some(&mean), Some(&variance), Some(&scale), Some(&shift));
                y = y.batch_norm(1, norm.0, norm.1, norm.2, norm.3, false, 0.1, 1e-5)?;
                y = (&y + &x[0].conv2d(&residual_weight, None, [1, 1], [0, 0], [1, 1], 1)?)?;
            }
            Ok(vec![y.relu()?.into()])
        };
        let mut sizes = sizes;
        sizes.extend([(1, 1), (2, 3)]);
        let (_, leaves, batch) = images(&sizes, c_in, kind, seed);
        let batch = batch.detach().unwrap();
        drop(leaves);
        let eager = eager_values(model(std::slice::from_ref(&batch), &[]).unwrap());
        let on_cpu = compile("pointwise_conv", model);
        let tolerance = common::tolerance(kind).max(1e-5);
        assert_floats_close_within(&on_cpu.call(&[&batch], &[]).unwrap(), &eager, tolerance, &format!("{kind:?} CPU {sizes:?}"));
        // GPU programs compute in f32 (f64 is the CPU's only).
        if kind != Kind::Double {
            let on_sim = compile("pointwise_conv_sim", model)
                .on_device(RunDevice::Simulated(SimOptions::default()));
            assert_floats_close_within(&on_sim.call(&[&batch], &[]).unwrap(), &eager, tolerance, &format!("{kind:?} simulated GPU {sizes:?}"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// A convolution of any geometry takes what follows it as its epilogue, computed on
    /// each block of its output pixels as it writes them: a relu, or (as in ResNet's
    /// blocks) a batch norm on running statistics (its scale and shift computed after
    /// the convolution) plus a residual of the same geometry, then the relu; the bias
    /// moves into it. Equal to eager on the CPU (3 channels on nestor's direct kernel, 16
    /// into 24 on products over gathered columns, and those under autocast to bf16, on
    /// AMX tiles reading the input rows in place where the host has them) and
    /// on the simulated GPU, in every float kind (f64 on the CPU), images of one pixel
    /// and batches of one included.
    #[test]
    fn compiled_conv_epilogues_equal_eager(
        sizes in proptest::collection::vec((1i64..=7, 1i64..=7), 1..=3),
        geometry in strided_geometry(),
        (wide, with_bias, with_norm) in (any::<bool>(), any::<bool>(), any::<bool>()),
        kind in float_kinds(),
        seed in 0i64..1000,
    ) {
        let (c_in, c_out) = if wide { (16, 24) } else { (3, 2) };
        let mut random = Random::new(seed);
        let [kh, kw] = geometry.kernel;
        let weight = (random.normal(&[c_out, c_in, kh, kw]) / (c_in as f64).sqrt()).to_kind(kind);
        let residual_weight = (random.normal(&[c_out, c_in, kh, kw]) / (c_in as f64).sqrt()).to_kind(kind);
        let bias = random.normal(&[c_out]).to_kind(kind);
        let [mean, scale, shift] = [0; 3].map(|_| random.normal(&[c_out]).to_kind(kind));
        let variance = (random.normal(&[c_out]).square() + 0.5).to_kind(kind);
        let g = &geometry;
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            let conv = |weight: &Tensor, bias: Option<&Tensor>| x[0].conv2d(weight, bias, g.stride, g.padding, g.dilation, 1);
            let mut y = conv(&weight, with_bias.then_some(&bias))?;
            if with_norm {
                let norm = (Some(&mean), Some(&variance), Some(&scale), Some(&shift));
                y = y.batch_norm(1, norm.0, norm.1, norm.2, norm.3, false, 0.1, 1e-5)?;
                y = (&y + &conv(&residual_weight, None)?)?;
            }
            Ok(vec![y.relu()?.into()])
        };
        let one = Geometry { kernel: [1, 1], stride: [1, 1], padding: [0, 0], dilation: [1, 1] };
        let mut sizes = large_enough(&[sizes], [&geometry, &one]).remove(0);
        let least = large_enough(&[vec![(1, 1)]], [&geometry, &one]).remove(0)[0];
        sizes.push(least);
        let (_, leaves, batch) = images(&sizes, c_in, kind, seed);
        let batch = batch.detach().unwrap();
        drop(leaves);
        let eager = eager_values(model(std::slice::from_ref(&batch), &[]).unwrap());
        let tolerance = common::tolerance(kind).max(1e-5);
        let on_cpu = compile("conv_epilogue", model);
        on_cpu.record_steps(true);
        assert_floats_close_within(&on_cpu.call(&[&batch], &[]).unwrap(), &eager, tolerance, &format!("{kind:?} CPU {sizes:?}"));
        let labels: Vec<String> = on_cpu.take_step_profiles().into_iter().flat_map(|run| run.steps).map(|step| step.label).collect();
        prop_assert!(labels.iter().any(|label| label.starts_with("window Conv") && label.ends_with("+ epilogue")), "{labels:?}");
        if kind == Kind::Float {
            // Mixed precision: products of bf16 roundings (each within bf16's rounding of
            // the f32 product), against eager f32.
            let mixed = compile("conv_epilogue_mixed", model).autocast(Kind::BFloat16);
            assert_floats_close_within(&mixed.call(&[&batch], &[]).unwrap(), &eager, 8.0 * common::tolerance(Kind::BFloat16), &format!("mixed CPU {sizes:?}"));
        }
        // GPU programs compute in f32 (f64 is the CPU's only).
        if kind != Kind::Double {
            let on_sim = compile("conv_epilogue_sim", model)
                .on_device(RunDevice::Simulated(SimOptions::default()));
            assert_floats_close_within(&on_sim.call(&[&batch], &[]).unwrap(), &eager, tolerance, &format!("{kind:?} simulated GPU {sizes:?}"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// Reductions of each image over its pixels (`x.mean([2, 3])`, as global average
    /// pooling is often written, and sum, amax, amin; kept dims or not, and then
    /// multiplied back into the image's pixels) compile to one segmented kernel over
    /// each image's `H_i W_i` packed rows. Equal to eager on the
    /// CPU and on the simulated GPU, images of one pixel included, in every float kind
    /// (f64 on the CPU); an image of no pixels has no largest value, a typed error as
    /// eagerly.
    #[test]
    fn compiled_reductions_over_every_pixel_equal_eager(
        sizes in image_sizes(),
        channels in 1i64..=5,
        (reduce, keepdim) in (0usize..4, any::<bool>()),
        kind in float_kinds(),
        seed in 0i64..1000,
    ) {
        let reduce = [Reduce::Sum, Reduce::Mean, Reduce::Amax, Reduce::Amin][reduce];
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            let pooled = x[0].reduce(reduce, &[2, -1], keepdim)?;
            if !keepdim {
                return Ok(vec![pooled.into()]);
            }
            // Kept dims `[B, C, 1, 1]` scale every pixel of their image back (a
            // squeeze-excitation's gate: a per-image operand over two ragged dims).
            let pooled = pooled.into_dense_handle()?;
            Ok(vec![x[0].binary(Binary::Mul, &pooled)?.into(), Out::Dense(pooled)])
        };
        let mut sizes = sizes;
        sizes.extend([(1, 1), (2, 3)]);
        let (_, leaves, batch) = images(&sizes, channels, kind, seed);
        let batch = batch.detach().unwrap();
        drop(leaves);
        let eager = eager_values(model(std::slice::from_ref(&batch), &[]).unwrap());
        let tolerance = common::tolerance(kind).max(1e-5);
        let on_cpu = compile("pixel_reduction", model);
        let what = format!("{reduce:?} keepdim {keepdim} {kind:?} {sizes:?}");
        assert_floats_close_within(&on_cpu.call(&[&batch], &[]).unwrap(), &eager, tolerance, &format!("CPU {what}"));
        // GPU programs compute in f32 (f64 is the CPU's only).
        if kind != Kind::Double {
            let on_sim = compile("pixel_reduction_sim", model)
                .on_device(RunDevice::Simulated(SimOptions::default()));
            assert_floats_close_within(&on_sim.call(&[&batch], &[]).unwrap(), &eager, tolerance, &format!("simulated GPU {what}"));
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// A squeeze-excitation gate (the channels' mean over each image's pixels, kept
    /// `[B, C, 1, 1]`, through tanh, scaling every pixel of its image) after a
    /// convolution, then each image's sum over its pixels into a linear head: compiled
    /// training gives autograd's loss and gradients (the gradients of the pixel
    /// reductions are per-image operands over two ragged dims).
    #[test]
    fn compiled_squeeze_excitation_gradients_equal_autograd(
        batches in proptest::collection::vec(image_sizes(), 2),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let (c_in, c) = (2, 3);
        let shapes = [vec![c, c_in, 1, 1], vec![c], vec![2, c], vec![2]];
        let names = ["conv_weight", "conv_bias", "head_weight", "head_bias"];
        // Heights and widths differ in every batch (equal ones are another structure).
        let batches: Vec<Vec<(i64, i64)>> = batches.into_iter().map(|mut sizes| {
            sizes.extend([(4, 5), (5, 4)]);
            sizes
        }).collect();
        let loss = |x: &NestedTensor, params: &[Tensor]| {
            let y = x.conv2d(&params[0], Some(&params[1]), [1, 1], [0, 0], [1, 1], 1)?.relu()?;
            let gate = y.mean(&[2, 3], true)?.into_dense_handle()?.tanh()?;
            let summed = y.binary(Binary::Mul, &gate)?.sum(&[2, 3], false)?.into_dense_handle()?;
            let head = summed.linear(&params[2], Some(&params[3]))?;
            head.mul(&head)?.mean_all()
        };
        assert_trains_as_autograd("squeeze_excitation", loss, (&names, &shapes), &batches, (c_in, kind), seed)?;
    }
}

/// An image of no pixels: its sum is 0 and its mean NaN compiled as eagerly; its
/// largest value does not exist, a typed error before the run (eager fails too).
#[test]
fn reductions_over_an_image_of_no_pixels() {
    let (_, _, batch) = images(&[(2, 3), (0, 4), (1, 1)], 2, Kind::Float, 7);
    let batch = batch.detach().unwrap();
    for reduce in [Reduce::Sum, Reduce::Mean, Reduce::Amax] {
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            Ok(vec![x[0].reduce(reduce, &[2, 3], false)?.into()])
        };
        let compiled = compile("empty_image_reduction", model).call(&[&batch], &[]);
        match model(std::slice::from_ref(&batch), &[]) {
            Ok(eager) => {
                assert!(!matches!(reduce, Reduce::Amax), "eager amax of no pixels");
                let eager = eager_values(eager);
                assert_close_within(&compiled.unwrap(), &eager, 1e-6, &format!("{reduce:?}"));
            }
            Err(_) => {
                let error = compiled
                    .expect_err("eager fails, compiled must too")
                    .to_string();
                assert!(error.contains("element 1"), "{reduce:?}: {error}");
            }
        }
    }
}

#[test]
fn hostile_geometry_is_an_error_not_a_panic() {
    let elements: Vec<Tensor> = [(3, 4), (5, 2)]
        .iter()
        .map(|&(h, w)| Tensor::randn([2, h, w], (Kind::Float, tch::Device::Cpu)))
        .collect();
    let nested = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&elements)
        .unwrap();
    let weight = Tensor::randn([3, 2, 3, 3], (Kind::Float, tch::Device::Cpu));
    for (stride, padding, dilation) in [
        ([1, 1], [i64::MAX / 2, 1], [1, 1]),
        ([1, 1], [i64::MAX, 1], [1, 1]),
        ([0, 1], [1, 1], [1, 1]),
        ([1, 1], [1, 1], [i64::MAX, 1]),
        ([-1, 1], [-1, 1], [1, 1]),
    ] {
        for grad in [false, true] {
            let run = || nested.conv2d(&weight, None, stride, padding, dilation, 1);
            let result = if grad { run() } else { tch::no_grad(run) };
            assert!(result.is_err(), "{stride:?} {padding:?} {dilation:?}");
        }
        if dilation == [1, 1] {
            // Pooling has no dilation: the other geometries are hostile to it too.
            assert!(nested.max_pool2d([3, 3], stride, padding).is_err());
            assert!(nested.avg_pool2d([3, 3], stride, padding).is_err());
        }
    }
}

/// A small conv net's loss, for compiled training: two convolutions (a residual), global
/// average pooling, a linear head, the mean square.
fn conv_net_loss(
    x: &NestedTensor,
    params: &[Tensor],
    geometry: &Geometry,
    pool: &Option<(bool, Geometry)>,
) -> nestor::Result<Dense> {
    let conv = |x: &NestedTensor, weight: &Tensor, bias: &Tensor| {
        x.conv2d(
            weight,
            Some(bias),
            [1, 1],
            geometry.padding,
            geometry.dilation,
            1,
        )
    };
    let stem = conv(x, &params[0], &params[1])?.relu()?;
    let hidden = conv(&stem, &params[2], &params[3])?.relu()?;
    let mut block = (&hidden + &stem)?.relu()?;
    if let Some((max, pool)) = pool {
        block = match max {
            true => block.max_pool2d(pool.kernel, pool.stride, pool.padding)?,
            false => block.avg_pool2d(pool.kernel, pool.stride, pool.padding)?,
        };
    }
    pooled_head_loss(&block, &params[4], &params[5])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// Compiled training of convolutions (stride 1), residuals and global average
    /// pooling: the loss and the gradients of every parameter and of the images equal
    /// eager autograd's.
    #[test]
    fn compiled_conv_net_gradients_equal_autograd(
        batches in proptest::collection::vec(image_sizes(), 2),
        (k, dilation) in (1i64..=3, 1i64..=2),
        pool in proptest::option::of((any::<bool>(), geometry(1))),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        // A window that keeps every size (the residual needs it).
        let reach = dilation * (k - 1);
        prop_assume!(reach % 2 == 0);
        let geometry = Geometry { kernel: [k, k], stride: [1, 1], padding: [reach / 2; 2], dilation: [dilation; 2] };
        let (c_in, c) = (2, 3);
        let shapes = [vec![c, c_in, k, k], vec![c], vec![c, c, k, k], vec![c], vec![2, c], vec![2]];
        let names = ["stem_weight", "stem_bias", "conv_weight", "conv_bias", "head_weight", "head_bias"];
        // At least the pooling window: every image keeps a pixel to average.
        let batches: Vec<Vec<(i64, i64)>> = batches.iter().map(|sizes| {
            let mut sizes: Vec<(i64, i64)> = sizes.iter().map(|&(h, w)| (h.max(3), w.max(3))).collect();
            sizes.extend([(4, 5), (5, 4)]);
            sizes
        }).collect();
        let loss = move |x: &NestedTensor, params: &[Tensor]| conv_net_loss(x, params, &geometry, &pool);
        assert_trains_as_autograd("conv_net", loss, (&names, &shapes), &batches, (c_in, kind), seed)?;
    }

    /// Compiled training of two convolutions of any stride, padding (beyond the
    /// window's reach too) and dilation: the loss and every parameter's gradient equal
    /// eager autograd's (the second convolution's input gradient reaches the first's
    /// parameters).
    #[test]
    fn compiled_strided_conv_gradients_equal_autograd(
        batches in proptest::collection::vec(image_sizes(), 2),
        first in strided_geometry(),
        second in strided_geometry(),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let (c_in, c) = (2, 3);
        let shapes = [vec![c, c_in, first.kernel[0], first.kernel[1]], vec![c], vec![c, c, second.kernel[0], second.kernel[1]], vec![c], vec![2, c], vec![2]];
        let names = ["first_weight", "first_bias", "second_weight", "second_bias", "head_weight", "head_bias"];
        let batches = large_enough(&batches, [&first, &second]);
        let loss = move |x: &NestedTensor, params: &[Tensor]| {
            let conv = |x: &NestedTensor, g: &Geometry, weight: &Tensor, bias: &Tensor| x.conv2d(weight, Some(bias), g.stride, g.padding, g.dilation, 1);
            let hidden = conv(x, &first, &params[0], &params[1])?.relu()?;
            let hidden = conv(&hidden, &second, &params[2], &params[3])?.relu()?;
            pooled_head_loss(&hidden, &params[4], &params[5])
        };
        assert_trains_as_autograd("strided_convs", loss, (&names, &shapes), &batches, (c_in, kind), seed)?;
    }

    /// The same at channel counts where convolutions run as GEMMs over gathered window
    /// columns (16 in, 32 and 40 out; the second convolution in 1 or 2 groups), the
    /// weights' gradients and the input gradients, strided ones included, so.
    #[test]
    fn compiled_wide_conv_gradients_equal_autograd(
        batches in proptest::collection::vec(image_sizes(), 2),
        first in strided_geometry(),
        second in strided_geometry(),
        (double, grouped) in (any::<bool>(), any::<bool>()),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let (c_in, c, groups) = (16, if grouped { 32 } else { 40 }, if grouped { 2 } else { 1 });
        let shapes = [vec![c, c_in, first.kernel[0], first.kernel[1]], vec![c], vec![c, c / groups, second.kernel[0], second.kernel[1]], vec![c], vec![2, c], vec![2]];
        let names = ["first_weight", "first_bias", "second_weight", "second_bias", "head_weight", "head_bias"];
        let batches = large_enough(&batches, [&first, &second]);
        let loss = move |x: &NestedTensor, params: &[Tensor]| {
            let conv = |x: &NestedTensor, g: &Geometry, groups: i64, weight: &Tensor, bias: &Tensor| x.conv2d(weight, Some(bias), g.stride, g.padding, g.dilation, groups);
            let hidden = conv(x, &first, 1, &params[0], &params[1])?.relu()?;
            let hidden = conv(&hidden, &second, groups, &params[2], &params[3])?.relu()?;
            pooled_head_loss(&hidden, &params[4], &params[5])
        };
        assert_trains_as_autograd("wide_convs", loss, (&names, &shapes), &batches, (c_in, kind), seed)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// Compiled training of grouped convolutions (2 groups, and depthwise: a group per
    /// channel) of any stride, padding and dilation: the loss and every parameter's
    /// gradient equal eager autograd's (the second convolution's input gradient reaches
    /// the first's parameters).
    #[test]
    fn compiled_grouped_conv_gradients_equal_autograd(
        batches in proptest::collection::vec(image_sizes(), 2),
        first in strided_geometry(),
        second in strided_geometry(),
        groups in (prop_oneof![Just(1i64), Just(2), Just(4)], prop_oneof![Just(2i64), Just(4)]),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let c = 4;
        let shapes = [
            vec![c, c / groups.0, first.kernel[0], first.kernel[1]], vec![c],
            vec![c, c / groups.1, second.kernel[0], second.kernel[1]], vec![c],
            vec![2, c], vec![2],
        ];
        let names = ["first_weight", "first_bias", "second_weight", "second_bias", "head_weight", "head_bias"];
        let batches = large_enough(&batches, [&first, &second]);
        let loss = move |x: &NestedTensor, params: &[Tensor]| {
            let conv = |x: &NestedTensor, g: &Geometry, groups: i64, weight: &Tensor, bias: &Tensor| x.conv2d(weight, Some(bias), g.stride, g.padding, g.dilation, groups);
            let hidden = conv(x, &first, groups.0, &params[0], &params[1])?.tanh()?;
            let hidden = conv(&hidden, &second, groups.1, &params[2], &params[3])?.tanh()?;
            pooled_head_loss(&hidden, &params[4], &params[5])
        };
        assert_trains_as_autograd("grouped_convs", loss, (&names, &shapes), &batches, (c, kind), seed)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// Compiled adaptive average pooling and bilinear interpolation (corners aligned or
    /// not) to any output size (larger than an image's sides too: windows overlap, as
    /// torch's) train as autograd: the loss and every parameter's gradient, images of
    /// 1 x 1 pixel included, one compile.
    #[test]
    fn compiled_resampling_trains_as_autograd(
        batches in proptest::collection::vec(image_sizes(), 2),
        output in (1i64..=4, 1i64..=4),
        bilinear in proptest::option::of(any::<bool>()),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let (c_in, c) = (2, 3);
        let cells = output.0 * output.1;
        let shapes = [vec![c, c_in, 3, 3], vec![c], vec![2, c * cells], vec![2]];
        let names = ["conv_weight", "conv_bias", "head_weight", "head_bias"];
        let batches: Vec<Vec<(i64, i64)>> = batches.iter().map(|sizes| {
            let mut sizes = sizes.clone();
            // Heights equal to the widths are another structure (shared lengths).
            if sizes.iter().all(|(h, w)| h == w) {
                sizes[0].1 += 1;
            }
            sizes
        }).collect();
        let size = [output.0, output.1];
        let loss = move |x: &NestedTensor, params: &[Tensor]| {
            let features = x.conv2d(&params[0], Some(&params[1]), [1, 1], [1, 1], [1, 1], 1)?.tanh()?;
            match bilinear {
                Some(align_corners) => features.interpolate_bilinear(Some(size), None, align_corners)?,
                None => features.adaptive_avg_pool2d(size)?,
            }
                .reshape_tail(&[c * cells])?
                .linear(&params[2], Some(&params[3]))?
                .square()?
                .mean(&[], false)?
                .into_dense_handle()
        };
        assert_trains_as_autograd("resampling", loss, (&names, &shapes), &batches, (c_in, kind), seed)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(4)))]

    /// Compiled training of ResNet's bottleneck block with downsampling (1x1, 3x3 of
    /// stride 2 and padding 1, 1x1, batch norm in training mode after each, a 1x1
    /// downsample of stride 2 with its batch norm on the shortcut): one compile for
    /// images of every size (1 x 1 included), its loss and every parameter's gradient
    /// equal eager autograd's.
    #[test]
    fn compiled_bottleneck_training_equals_autograd(
        batches in proptest::collection::vec(image_sizes(), 2),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let (c_in, mid, out) = (3, 2, 4);
        let names = [
            "reduce", "reduce_scale", "reduce_shift", "spatial", "spatial_scale", "spatial_shift",
            "expand", "expand_scale", "expand_shift", "downsample", "downsample_scale",
            "downsample_shift", "head_weight", "head_bias",
        ];
        let shapes = [
            vec![mid, c_in, 1, 1], vec![mid], vec![mid], vec![mid, mid, 3, 3], vec![mid], vec![mid],
            vec![out, mid, 1, 1], vec![out], vec![out], vec![out, c_in, 1, 1], vec![out], vec![out],
            vec![2, out], vec![2],
        ];
        let batches: Vec<Vec<(i64, i64)>> = batches.iter().map(|sizes| {
            let mut sizes = sizes.clone();
            // Heights equal to the widths are another structure (shared lengths).
            if sizes.iter().all(|(h, w)| h == w) {
                sizes[0].1 += 1;
            }
            sizes
        }).collect();
        assert_trains_as_autograd("bottleneck", bottleneck_loss, (&names, &shapes), &batches, (c_in, kind), seed)?;
    }
}

/// Adaptive pooling and bilinear interpolation of an empty image fail eagerly (libtorch
/// has no pixel to read) and compiled (`CompileCause::TooShort` naming the op and the
/// image, before the run); the compiled function still runs the next batch. A traced
/// interpolation by a scale (a size per element) is a trace error naming it.
#[test]
fn resampling_an_empty_image_is_an_error() {
    for (op, pool) in [
        (
            "adaptive_avg_pool2d",
            (|x: &[NestedTensor], _: &[Dense]| x[0].adaptive_avg_pool2d([2, 3])) as Resampling,
        ),
        ("interpolate", |x: &[NestedTensor], _: &[Dense]| {
            x[0].interpolate_bilinear(Some([2, 3]), None, false)
        }),
    ] {
        assert_empty_image_fails(op, pool);
    }
    let (_, _, fine) = images(&[(3, 4), (5, 2)], 2, Kind::Float, 1);
    let scaled = compile("scaled", |x: &[NestedTensor], _: &[Dense]| {
        x[0].interpolate_bilinear(None, Some(2.0), false)
    })
    .call(&[&fine], &[]);
    assert!(
        matches!(
            &scaled,
            Err(NestedError::Trace {
                op: "interpolate",
                ..
            })
        ),
        "{scaled:?}"
    );
}

/// A model resampling its images.
type Resampling = fn(&[NestedTensor], &[Dense]) -> nestor::Result<NestedTensor>;

/// Asserts that `pool` of a batch with an empty image fails eagerly and compiled (a
/// `TooShort` naming `op`), and runs compiled on other batches, as eagerly.
fn assert_empty_image_fails(op: &str, pool: Resampling) {
    let compiled = compile(op, pool);
    let (_, _, fine) = images(&[(3, 4), (5, 2)], 2, Kind::Float, 1);
    let want = pool(std::slice::from_ref(&fine), &[]).unwrap();
    let got = compiled
        .call(&[&fine], &[])
        .unwrap()
        .remove(0)
        .into_nested()
        .unwrap();
    assert!(got.values().allclose(want.values(), 1e-6, 1e-6, false));
    let (_, _, empty) = images(&[(3, 4), (0, 2)], 2, Kind::Float, 2);
    assert!(pool(std::slice::from_ref(&empty), &[]).is_err());
    let error = compiled.call(&[&empty], &[]).err().unwrap();
    let NestedError::Compile { reason, .. } = &error else {
        panic!("{error}");
    };
    assert!(
        matches!(
            reason.cause(),
            nestor::CompileCause::TooShort {
                op: name,
                element: 1,
                needed: 1
            } if name == op
        ),
        "{error}"
    );
    assert!(compiled.call(&[&fine], &[]).is_ok());
    assert_eq!(compiled.stats().compiles, 1);
}

/// Two branches of different window geometry, 3x3 and 2x2 both of stride 2, whose sizes
/// agree on odd sides only (`(H - 1) / 2` and `H / 2`), added, then the pooled head's
/// loss.
fn odd_windows_loss(x: &NestedTensor, params: &[Tensor]) -> nestor::Result<Dense> {
    let three = x.conv2d(&params[0], None, [2, 2], [0, 0], [1, 1], 1)?;
    let two = x.conv2d(&params[1], None, [2, 2], [0, 0], [1, 1], 1)?;
    pooled_head_loss(&(&three + &two)?.relu()?, &params[2], &params[3])
}

/// Windows of different formulas that agree on the traced sizes meet in one op: the
/// program checks their sizes each call. Odd sides compile once and train as autograd;
/// an even side is a typed error naming the element, as eager's structure mismatch.
#[test]
fn windows_that_agree_when_traced_are_checked_each_call() {
    let names = ["three", "two", "head_weight", "head_bias"];
    let shapes = [vec![3, 2, 3, 3], vec![3, 2, 2, 2], vec![2, 3], vec![2]];
    let odd = [
        vec![(7, 5), (9, 3)],
        vec![(3, 11)],
        vec![(5, 7), (13, 9), (3, 3)],
    ];
    for kind in [Kind::Float, Kind::Double] {
        assert_trains_as_autograd(
            "odd_windows",
            odd_windows_loss,
            (&names, &shapes),
            &odd,
            (2, kind),
            3,
        )
        .unwrap();
    }
    let mut random = Random::new(5);
    let params: Vec<Tensor> = shapes
        .iter()
        .map(|shape| random.normal(shape).to_kind(Kind::Float))
        .collect();
    let model = {
        let params: Vec<Tensor> = params.iter().map(Tensor::shallow_clone).collect();
        move |x: &[NestedTensor], _: &[Dense]| {
            Ok(vec![Out::Dense(odd_windows_loss(&x[0], &params)?)])
        }
    };
    let compiled = compile("odd_windows", &model);
    for sizes in &odd {
        let (_, _, batch) = images(sizes, 2, Kind::Float, 1);
        let want = eager_values(model(std::slice::from_ref(&batch), &[]).unwrap());
        assert_close_within(
            &compiled.call(&[&batch], &[]).unwrap(),
            &want,
            1e-5,
            "odd sides",
        );
    }
    // Element 1's height is even: 2x2 windows give 4 rows, 3x3 ones 3.
    let (_, _, even) = images(&[(7, 5), (8, 3)], 2, Kind::Float, 2);
    let eager = model(std::slice::from_ref(&even), &[]).err().unwrap();
    assert!(
        matches!(eager, NestedError::StructureMismatch { .. }),
        "{eager}"
    );
    let error = compiled.call(&[&even], &[]).err().unwrap();
    let NestedError::Compile { reason, .. } = &error else {
        panic!("{error}");
    };
    assert_eq!(
        reason.cause(),
        CompileCause::SizesDiffer { element: 1 },
        "{error}"
    );
    assert!(
        error.to_string().contains("element 1 has sizes 4 and 3"),
        "{error}"
    );
    assert_eq!(compiled.stats().compiles, 1);
}

/// ResNet's bottleneck block with a strided downsample (see
/// `compiled_bottleneck_training_equals_autograd`), then the pooled head's loss.
fn bottleneck_loss(x: &NestedTensor, params: &[Tensor]) -> nestor::Result<Dense> {
    // A convolution then batch norm in training mode (no running statistics).
    let conv_norm = |x: &NestedTensor, at: usize, stride: i64, padding: i64| {
        x.conv2d(&params[at], None, [stride; 2], [padding; 2], [1, 1], 1)?
            .batch_norm(
                1,
                None,
                None,
                Some(&params[at + 1]),
                Some(&params[at + 2]),
                true,
                0.1,
                1e-5,
            )
    };
    let h = conv_norm(x, 0, 1, 0)?.relu()?;
    let h = conv_norm(&h, 3, 2, 1)?.relu()?;
    let h = conv_norm(&h, 6, 1, 0)?;
    let shortcut = conv_norm(x, 9, 2, 0)?;
    pooled_head_loss(&(&h + &shortcut)?.relu()?, &params[12], &params[13])
}

/// A convolution's geometry of strides 1 to 3 and paddings up to 3 (beyond the reach of
/// small windows).
fn strided_geometry() -> impl Strategy<Value = Geometry> {
    let axis = (1i64..=3, 1i64..=3, 0i64..=3, 1i64..=2);
    (axis.clone(), axis).prop_map(|(h, w)| Geometry {
        kernel: [h.0, w.0],
        stride: [h.1, w.1],
        padding: [h.2, w.2],
        dilation: [h.3, w.3],
    })
}

/// The image sizes of `batches`, grown where needed so that two windows one after the
/// other (`first`, then `second`) leave every image a pixel to average; heights and
/// widths never all equal (that is another structure: shared lengths).
fn large_enough(
    batches: &[Vec<(i64, i64)>],
    [first, second]: [&Geometry; 2],
) -> Vec<Vec<(i64, i64)>> {
    let least = |axis: usize| {
        let needs = |g: &Geometry, out: i64| {
            (out - 1) * g.stride[axis] + g.dilation[axis] * (g.kernel[axis] - 1) + 1
                - 2 * g.padding[axis]
        };
        needs(first, needs(second, 1).max(1)).max(1)
    };
    batches
        .iter()
        .map(|sizes| {
            let mut sizes: Vec<(i64, i64)> = sizes
                .iter()
                .map(|&(h, w)| (h.max(least(0)), w.max(least(1))))
                .collect();
            if sizes.iter().all(|(h, w)| h == w) {
                sizes[0].1 += 1;
            }
            sizes
        })
        .collect()
}

/// Compiles `loss` (of a batch of images `[c_in, H, W]` and parameters of these `names`
/// and `shapes`, random from `seed`) for training once, then for every image sizes of
/// `batches` compares its loss and parameters' gradients with eager autograd's.
fn assert_trains_as_autograd(
    name: &str,
    loss: impl Fn(&NestedTensor, &[Tensor]) -> nestor::Result<Dense> + Clone + 'static,
    (names, shapes): (&[&str], &[Vec<i64>]),
    batches: &[Vec<(i64, i64)>],
    (c_in, kind): (i64, Kind),
    seed: i64,
) -> Result<(), TestCaseError> {
    let mut random = Random::new(seed);
    let params: Vec<Tensor> = shapes
        .iter()
        .map(|shape| {
            (random.normal(shape) * 0.5)
                .to_kind(kind)
                .set_requires_grad(true)
        })
        .collect();
    let store = tch::nn::VarStore::new(tch::Device::Cpu);
    let root = store.root();
    let variables: Vec<Tensor> = names
        .iter()
        .zip(&params)
        .map(|(name, param)| root.add(name, param.detach(), true))
        .collect();
    let model = loss.clone();
    let compiled = compile(name, move |x: &[NestedTensor], _: &[Dense]| {
        model(&x[0], &variables)
    })
    .train(&store);
    let tolerance = if kind == Kind::Double { 1e-9 } else { 1e-4 };
    let error = |a: &Tensor, e: &Tensor| {
        ((a.to_kind(Kind::Double) - e.to_kind(Kind::Double)).abs()
            / (e.to_kind(Kind::Double).abs() + 1.0))
            .max()
            .double_value(&[])
    };
    for (index, sizes) in batches.iter().enumerate() {
        let (_, eager_leaves, eager_batch) = images(sizes, c_in, kind, index as i64);
        let eager_loss = loss(&eager_batch, &params).unwrap().into_tensor();
        for param in &params {
            let mut grad = param.grad();
            if grad.defined() {
                let _ = grad.zero_();
            }
        }
        eager_loss.backward();
        let (_, leaves, batch) = images(sizes, c_in, kind, index as i64);
        let (outputs, named) = compiled.gradients(&[&batch], &[]).unwrap();
        let loss = outputs.into_iter().next().unwrap().into_dense().unwrap();
        prop_assert!(
            error(&loss, &eager_loss) <= tolerance,
            "{name} {sizes:?}: loss {loss:?} vs {eager_loss:?}"
        );
        for (param_name, param) in names.iter().zip(&params) {
            let compiled_grad = named
                .iter()
                .find(|(path, _)| path == param_name)
                .map(|(_, grad)| grad)
                .unwrap_or_else(|| panic!("{name}: no gradient for {param_name}"));
            prop_assert!(
                error(compiled_grad, &param.grad()) <= tolerance,
                "{name} {sizes:?} {kind:?} {param_name}: {compiled_grad:?} vs {:?}",
                param.grad()
            );
        }
        drop((eager_leaves, leaves));
    }
    prop_assert_eq!(compiled.stats().compiles, 1);
    Ok(())
}

/// A batch of signals `[channels, L_i]` (ragged length), each value drawn from `seed`,
/// that requires grad.
fn signals(lengths: &[i64], channels: i64, kind: Kind, seed: i64) -> NestedTensor {
    let mut random = Random::new(seed);
    let elements: Vec<Tensor> = lengths
        .iter()
        .map(|&length| random.normal(&[channels, length]).to_kind(kind))
        .collect();
    NestedTensor::builder()
        .ragged_dims(&[1])
        .tensors(&elements)
        .unwrap()
        .set_requires_grad(true)
        .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases(8)))]

    /// conv1d and max_pool1d of signals `[C, L_i]` compile as 2-d windows one pixel
    /// high: the loss equals eager's (libtorch's conv1d and max_pool1d on each
    /// element), and compiled training gives the weight, the bias and the signals
    /// autograd's gradients (the weight's 2-d view reaches the weight); one compile for
    /// every batch, f32 and f64.
    #[test]
    fn signals_convolve_and_pool_compiled(
        batches in proptest::collection::vec(proptest::collection::vec(3i64..12, 1..4), 2),
        stride in 1i64..3,
        padding in 0i64..2,
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let store = tch::nn::VarStore::new(tch::Device::Cpu);
        let mut random = Random::new(seed);
        let weight = store.root().add("weight", (random.normal(&[3, 2, 3]) * 0.5).to_kind(kind), true);
        let bias = store.root().add("bias", random.normal(&[3]).to_kind(kind), true);
        let model = move |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Dense> {
            let convolved = x[0].conv1d(&weight, Some(&bias), stride, padding, 1, 1)?.tanh()?;
            let pooled = convolved.max_pool1d(2, 1, 1)?;
            (&pooled * &pooled)?.sum(&[], false)?.into_dense_handle()
        };
        let compiled = compile("signals", &model).train(&store);
        let variables = store.trainable_variables();
        let zero_grads = || {
            for variable in &variables {
                let mut grad = variable.grad();
                if grad.defined() {
                    let _ = grad.zero_();
                }
            }
        };
        let tolerance = if double { 1e-9 } else { 1e-4 };
        for (index, lengths) in batches.iter().enumerate() {
            zero_grads();
            let eager = signals(lengths, 2, kind, seed + index as i64);
            let eager_loss = model(std::slice::from_ref(&eager), &[]).unwrap().into_tensor();
            eager_loss.backward();
            let expected: Vec<Tensor> = variables.iter().map(|variable| variable.grad().copy()).collect();
            zero_grads();
            let ours = signals(lengths, 2, kind, seed + index as i64);
            let loss = compiled.call(&[&ours], &[]).unwrap();
            let loss = loss.into_iter().next().unwrap().into_dense().unwrap();
            prop_assert!(close_within(&loss, &eager_loss, tolerance), "{lengths:?}: loss {loss} vs {eager_loss}");
            for (variable, expected) in variables.iter().zip(&expected) {
                prop_assert!(close_within(&variable.grad(), expected, tolerance), "{lengths:?}: {} vs {}", variable.grad(), expected);
            }
            prop_assert!(close_within(ours.grad().unwrap().values(), eager.grad().unwrap().values(), tolerance), "{lengths:?}: the signals' gradient");
        }
        prop_assert_eq!(compiled.stats().compiles, 1);
    }
}

/// A ResNet-like net's loss: a 7x7 stride-2 stem, a 3x3 convolution and a 1x1 one on a
/// residual, global average pooling and a linear head.
fn resnet_like_loss(x: &NestedTensor, params: &[Tensor]) -> nestor::Result<Dense> {
    let stem = x
        .conv2d(&params[0], None, [2, 2], [3, 3], [1, 1], 1)?
        .relu()?;
    let hidden = stem
        .conv2d(&params[1], Some(&params[2]), [1, 1], [1, 1], [1, 1], 1)?
        .relu()?;
    let block = (&hidden.conv2d(&params[3], None, [1, 1], [0, 0], [1, 1], 1)? + &stem)?.relu()?;
    pooled_head_loss(&block, &params[4], &params[5])
}

/// Mixed-precision training of convolutions (`autocast(Kind::BFloat16)`): a 3-channel
/// stem and a 3x3 convolution of 32 channels (on hosts with bf16 units GEMMs over
/// columns gathered as bf16 roundings, rows padded to whole tiles; its weight gradient
/// on AMX tiles reading the input rows in place where the host has them), a 1x1 convolution
/// (a GEMM) on a residual, and their gradients. With parameters and images that hold
/// bf16 values (only the roundings inside differ), the loss and every gradient are
/// within 2e-2 of (1 + |value|) of f64 autograd on the same values, for images of one
/// pixel and a batch of one.
#[test]
fn mixed_precision_conv_training_is_within_bf16_rounding() {
    let channels = 32;
    let shapes = [
        vec![channels, 3, 7, 7],
        vec![channels, channels, 3, 3],
        vec![channels],
        vec![channels, channels, 1, 1],
        vec![2, channels],
        vec![2],
    ];
    let names = [
        "stem",
        "conv",
        "conv_bias",
        "pointwise",
        "head",
        "head_bias",
    ];
    let mut random = Random::new(5);
    // f64 values that bf16 holds.
    let held = |tensor: Tensor| tensor.to_kind(Kind::BFloat16).to_kind(Kind::Double);
    let reference: Vec<Tensor> = shapes
        .iter()
        .map(|shape| held(random.normal(shape) * 0.2).set_requires_grad(true))
        .collect();
    let store = tch::nn::VarStore::new(tch::Device::Cpu);
    let root = store.root();
    let variables: Vec<Tensor> = names
        .iter()
        .zip(&reference)
        .map(|(name, param)| root.add(name, param.detach().to_kind(Kind::Float), true))
        .collect();
    let compiled = compile("mixed_convs", move |x: &[NestedTensor], _: &[Dense]| {
        resnet_like_loss(&x[0], &variables)
    })
    .train(&store)
    .autocast(Kind::BFloat16);
    let error = |got: &Tensor, want: &Tensor| {
        ((got.to_kind(Kind::Double) - want).abs() / (want.abs() + 1.0))
            .max()
            .double_value(&[])
    };
    for (seed, sizes) in [vec![(9, 7), (1, 1), (12, 5)], vec![(4, 4)]]
        .into_iter()
        .enumerate()
    {
        // Images holding bf16 values: in f64 for the reference, in f32 compiled.
        let (elements, _, _) = images(&sizes, 3, Kind::BFloat16, seed as i64);
        let batch = |kind: Kind| {
            let elements: Vec<Tensor> = elements.iter().map(|e| e.detach().to_kind(kind)).collect();
            NestedTensor::builder()
                .ragged_dims(&[1, 2])
                .tensors(&elements)
                .unwrap()
        };
        for param in &reference {
            let mut grad = param.grad();
            if grad.defined() {
                let _ = grad.zero_();
            }
        }
        let eager_loss = resnet_like_loss(&batch(Kind::Double), &reference)
            .unwrap()
            .into_tensor();
        eager_loss.backward();
        let (outputs, named) = compiled.gradients(&[&batch(Kind::Float)], &[]).unwrap();
        let loss = outputs.into_iter().next().unwrap().into_dense().unwrap();
        assert!(
            error(&loss, &eager_loss) <= 2e-2,
            "{sizes:?}: loss {loss:?} against {eager_loss:?}"
        );
        for (name, param) in names.iter().zip(&reference) {
            let (_, grad) = named
                .iter()
                .find(|(path, _)| path == name)
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            assert_eq!(grad.kind(), Kind::Float, "{name}");
            let error = error(grad, &param.grad());
            assert!(error <= 2e-2, "{sizes:?} {name}: error {error}");
        }
    }
}
