//! Per-element regions: one convolution or pooling of packed images as a window step,
//! other regions as host steps that run a one-op graph through libtorch.

use super::*;
use crate::step::{Gemm, Host, Window};
use crate::WindowKind;
use nestor_ir::{PoolKind, Window2d};

impl Lowering<'_> {
    /// Lowers a per element op.
    pub(super) fn lower_per_element(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        let Op::PerElement { inputs, body } = op else {
            return self.window_gradient(value, op, ty);
        };
        if let Some(window) = self.window_step(value, ty, inputs, body)? {
            return Ok(window);
        }
        if !self.options.host_per_element {
            return Err(unsupported(
                value,
                op,
                "per-element regions other than one convolution or pooling of images with ragged H and W run through libtorch only when asked (Compiled::per_element_fallback)",
            ));
        }
        self.host_region(value, ty, inputs, body)
    }

    /// A region whose body is one convolution (any groups), max / average pooling or
    /// global average pooling of images `[C, H_i, W_i]` with ragged `H` and `W`, as a
    /// [`Step::Window`]; `None` for other regions.
    fn window_step(
        &mut self,
        value: ValueId,
        ty: &Type,
        inputs: &[ValueId],
        body: &Graph,
    ) -> Result<Option<Lowered>, LowerError> {
        let ([output], Some(&images)) = (&body.outputs[..], inputs.first()) else {
            return Ok(None);
        };
        let Some(ImageOperand {
            channels,
            heights,
            widths,
            ..
        }) = self.image_operand(images)
        else {
            return Ok(None);
        };
        // The region operand a body value stands for (the images are operand 0).
        let region_input = |id: ValueId| body.input_position(id).map(|position| inputs[position]);
        let reads_images = |x: &ValueId| region_input(*x) == Some(images);
        let mut groups = 1;
        let (kind, weight, bias, window) = match body.op(*output) {
            Op::Conv2d {
                x,
                weight,
                bias,
                stride,
                padding,
                dilation,
                groups: conv_groups,
            } if reads_images(x) => {
                groups = *conv_groups;
                let Some(weight) = region_input(*weight) else {
                    return Ok(None);
                };
                let bias = match bias.map(region_input) {
                    Some(None) => return Ok(None),
                    bias => bias.flatten(),
                };
                let Some(window) = conv_window(self.graph, weight, (stride, padding, dilation))
                else {
                    return Ok(None);
                };
                (WindowKind::Conv, Some(weight), bias, window)
            }
            Op::Pool2d {
                kind,
                x,
                kernel,
                stride,
                padding,
            } if reads_images(x) => {
                let Some(window) = pool_window(kernel, stride, padding) else {
                    return Ok(None);
                };
                let kind = match kind {
                    PoolKind::Max => WindowKind::Max,
                    PoolKind::Avg => WindowKind::Average,
                };
                (kind, None, None, window)
            }
            Op::AdaptiveAvgPool2d { x, output } if reads_images(x) && output[..] == [1, 1] => {
                (WindowKind::ImageMean, None, None, WHOLE_IMAGE)
            }
            Op::AdaptiveAvgPool2d { x, output } if reads_images(x) => {
                let Some(window) =
                    self.resampling(output, (heights, widths), "adaptive_avg_pool2d")
                else {
                    return Ok(None);
                };
                (WindowKind::Adaptive, None, None, window)
            }
            Op::InterpolateBilinear {
                x,
                output,
                align_corners,
            } if reads_images(x) => {
                let Some(window) = self.resampling(output, (heights, widths), "interpolate") else {
                    return Ok(None);
                };
                let kind = WindowKind::Bilinear {
                    align_corners: *align_corners,
                };
                (kind, None, None, window)
            }
            _ => return Ok(None),
        };
        if let (WindowKind::Conv, Some(weight), true) =
            (kind, weight, groups == 1 && window == POINTWISE)
        {
            return self
                .pointwise_conv(value, ty, images, weight, bias)
                .map(Some);
        }
        let slot =
            |lowering: &Self, operand: ValueId| lowering.data(value, operand).map(|data| data.0);
        let x = slot(self, images)?;
        let weight = weight.map(|weight| slot(self, weight)).transpose()?;
        let bias = bias.map(|bias| slot(self, bias)).transpose()?;
        let out = self.result(value, ty)?;
        let Lowered::Data { tail, .. } = &out else {
            return Ok(None);
        };
        let width = volume(tail);
        self.program.steps.push(Step::Window(Window {
            kind,
            out: slot_of(&out),
            x,
            weight,
            bias,
            grad: None,
            heights,
            widths,
            channels,
            width,
            window,
            groups,
            epilogue: None,
        }));
        Ok(Some(out))
    }

    /// A 1x1 convolution without stride, padding or dilation (`window` is [`POINTWISE`])
    /// of images whose packed rows are their pixels' channels (`[sum H_i W_i, C]`): every
    /// pixel's channels times the weight `[C_out, C, 1, 1]`, one GEMM over the pixels
    /// (half of ResNet-50's convolutions; the window kernel took 25-64 ms for the 512-
    /// and 2048-channel ones of 16 images, which are GEMMs of a few ms).
    fn pointwise_conv(
        &mut self,
        value: ValueId,
        ty: &Type,
        images: ValueId,
        weight: ValueId,
        bias: Option<ValueId>,
    ) -> Result<Lowered, LowerError> {
        let (x, rows, tail, _) = self.data(value, images)?;
        let (weight, weight_rows, ..) = self.data(value, weight)?;
        let bias = bias
            .map(|bias| self.data(value, bias).map(|(slot, ..)| slot))
            .transpose()?;
        let out = self.result(value, ty)?;
        self.program.steps.push(Step::Gemm(Gemm {
            out: slot_of(&out),
            x,
            weight,
            bias,
            rows,
            k: *tail.last().unwrap_or(&1),
            n: weight_rows.factor,
            transposed: false,
            epilogue: None,
        }));
        Ok(out)
    }

    /// The gradients of a 1x1 convolution without stride, padding or groups (see
    /// [`Self::pointwise_conv`]) as products over the packed pixels: the input's is
    /// `g [P, C_out]` times the weight `[C_out, C]` (a [`Step::Gemm`] by the weight as
    /// it is, `[k, n]`), the weight's `g^T x` summed over the pixels (a
    /// [`Step::SumRows`]), where the window kernels gathered 512-pixel tiles at a
    /// fraction of the GEMM's speed (ResNet-50's 1x1 weight gradients: 150-330 GFLOP/s
    /// in bf16 on a Xeon with AMX). `None` for other ops and windows.
    fn pointwise_conv_grad(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Option<Lowered>, LowerError> {
        let pointwise = |kernel: [i64; 2], (stride, padding, groups): (&[i64], &[i64], i64)| {
            groups == 1
                && Window2d {
                    kernel,
                    stride: [stride[0], stride[1]],
                    padding: [padding[0], padding[1]],
                    dilation: [1, 1],
                } == POINTWISE
        };
        let is_images =
            |lowering: &mut Self, operand: ValueId| lowering.image_operand(operand).is_some();
        match op {
            Op::Conv2dInputGrad {
                g,
                weight,
                x,
                stride,
                padding,
                groups,
                ..
            } if stride.len() == 2 && padding.len() == 2 => {
                let Some(window) = conv_window(self.graph, *weight, (stride, padding, &[1, 1]))
                else {
                    return Ok(None);
                };
                if !pointwise(window.kernel, (stride, padding, *groups))
                    || !is_images(self, *g)
                    || !is_images(self, *x)
                {
                    return Ok(None);
                }
                self.gemm_checked(value, ty, *g, *weight, None, true)
                    .map(Some)
            }
            Op::Conv2dWeightGrad {
                x,
                g,
                kernel,
                stride,
                padding,
                groups,
                ..
            } if kernel.len() == 2 && stride.len() == 2 && padding.len() == 2 => {
                if !pointwise([kernel[0], kernel[1]], (stride, padding, *groups))
                    || !is_images(self, *g)
                    || !is_images(self, *x)
                {
                    return Ok(None);
                }
                self.contract_rows(value, ty, (*g, *x)).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The window of a resampling (`op`) of images of these heights and widths to
    /// `output`, `None` unless that is two positive sizes; an empty image has no pixel
    /// to read: an error before the run, as libtorch's.
    fn resampling(
        &mut self,
        output: &[i64],
        (heights, widths): (Slot, Slot),
        op: &'static str,
    ) -> Option<Window2d> {
        let window = resampling_window(output)?;
        for lengths in [heights, widths] {
            self.at_least(lengths, (1, op));
        }
        Some(window)
    }

    /// The buffer, channels and lengths of a batch of images `[C, H_i, W_i]` with
    /// ragged `H` and `W`, or of signals `[C, 1, W_i]` (images one pixel high: their
    /// heights a lengths op of ones); `None` for other values.
    fn image_operand(&mut self, images: ValueId) -> Option<ImageOperand> {
        let Type::Ragged { dims, .. } = self.graph.ty(images) else {
            return None;
        };
        let (channels, heights, widths) = match dims[..] {
            [ElemDim::Fixed(Dim::Static(channels)), ElemDim::Ragged(heights), ElemDim::Ragged(widths)] => {
                (channels, Some(heights), widths)
            }
            [ElemDim::Fixed(Dim::Static(channels)), ElemDim::Fixed(Dim::Static(1)), ElemDim::Ragged(widths)] => {
                (channels, None, widths)
            }
            _ => return None,
        };
        let (Lowered::Lengths(widths), Lowered::Data { slot, .. }) =
            (self.get(widths), self.get(images))
        else {
            return None;
        };
        let heights = match heights.map(|heights| self.get(heights)) {
            Some(Lowered::Lengths(heights)) => heights,
            Some(_) => return None,
            None => self.ones_like(widths),
        };
        Some(ImageOperand {
            slot,
            channels,
            heights,
            widths,
        })
    }

    /// Lengths of 1 for every element of the batch of `lengths` (the heights of signals
    /// one pixel high): the lengths op that gives them already, or a new one.
    fn ones_like(&mut self, lengths: Slot) -> Slot {
        self.derived_lengths(lengths, LengthsKind::Constant { size: 1 })
    }

    /// The gradients of window steps (convolution, global average pooling), as window
    /// steps.
    fn window_gradient(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        let images = |lowering: &mut Self, operand: ValueId| {
            lowering.image_operand(operand).ok_or_else(|| {
                unsupported(
                    value,
                    op,
                    format!("{operand} must be images with ragged H and W (or H 1)"),
                )
            })
        };
        if let Some(lowered) = self.pointwise_conv_grad(value, op, ty)? {
            return Ok(lowered);
        }
        let step = match op {
            Op::Conv2dInputGrad {
                g,
                weight,
                x,
                stride,
                padding,
                dilation,
                groups,
            } => {
                let (grads, inputs) = (images(self, *g)?, images(self, *x)?);
                let geometry = (stride.as_slice(), padding.as_slice(), dilation.as_slice());
                let step = self.conv_input_grad(value, op, (grads, inputs, *weight), geometry)?;
                return self.push_window_gradient(value, ty, step, *groups);
            }
            Op::Conv2dWeightGrad {
                x,
                g,
                kernel,
                stride,
                padding,
                dilation,
                groups,
            } => {
                let inputs = images(self, *x)?;
                let grads = images(self, *g)?;
                let window = Window2d {
                    kernel: [kernel[0], kernel[1]],
                    stride: [stride[0], stride[1]],
                    padding: [padding[0], padding[1]],
                    dilation: [dilation[0], dilation[1]],
                };
                let step = (
                    WindowKind::WeightGrad,
                    inputs,
                    None,
                    Some(grads.slot),
                    grads.channels,
                    window,
                );
                return self.push_window_gradient(value, ty, step, *groups);
            }
            Op::Pool2dGrad {
                max,
                x,
                g,
                kernel,
                stride,
                padding,
            } => {
                let inputs = images(self, *x)?;
                let grads = images(self, *g)?;
                let window = Window2d {
                    kernel: [kernel[0], kernel[1]],
                    stride: [stride[0], stride[1]],
                    padding: [padding[0], padding[1]],
                    dilation: [1, 1],
                };
                let kind = if *max {
                    WindowKind::MaxGrad
                } else {
                    WindowKind::AverageGrad
                };
                (
                    kind,
                    inputs,
                    None,
                    Some(grads.slot),
                    inputs.channels,
                    window,
                )
            }
            Op::AdaptiveAvgPool2dGrad { g, x, output } => {
                self.resampling_grad(value, op, (*g, *x, output), WindowKind::AdaptiveGrad)?
            }
            &Op::InterpolateBilinearGrad {
                g,
                x,
                ref output,
                align_corners,
            } => {
                let kind = WindowKind::BilinearGrad { align_corners };
                self.resampling_grad(value, op, (g, x, output), kind)?
            }
            Op::ImageMeanGrad { g, x } => {
                let pixels = images(self, *x)?;
                let (means, ..) = self.data(value, *g)?;
                let operand = ImageOperand {
                    slot: means,
                    ..pixels
                };
                (
                    WindowKind::ImageSpread,
                    operand,
                    None,
                    None,
                    pixels.channels,
                    WHOLE_IMAGE,
                )
            }
            other => return Err(unsupported(value, other, "not lowered yet")),
        };
        self.push_window_gradient(value, ty, step, 1)
    }

    /// The window step of a resampling's gradient (`kind`): `g`, the resampled values'
    /// gradient, spread over the images `x` resampled to `output`.
    fn resampling_grad(
        &mut self,
        value: ValueId,
        op: &Op,
        (g, x, output): (ValueId, ValueId, &[i64]),
        kind: WindowKind,
    ) -> Result<WindowGradient, LowerError> {
        let pixels = self.image_operand(x).ok_or_else(|| {
            unsupported(
                value,
                op,
                format!("{x} must be images with ragged H and W (or H 1)"),
            )
        })?;
        let (resampled, ..) = self.data(value, g)?;
        let window = resampling_window(output)
            .ok_or_else(|| unsupported(value, op, "the output size must be two positive values"))?;
        let operand = ImageOperand {
            slot: resampled,
            ..pixels
        };
        Ok((kind, operand, None, None, pixels.channels, window))
    }

    /// Pushes the window step of a gradient (`step`, of a convolution in `groups`
    /// groups), the result of `value`.
    fn push_window_gradient(
        &mut self,
        value: ValueId,
        ty: &Type,
        step: WindowGradient,
        groups: i64,
    ) -> Result<Lowered, LowerError> {
        let (kind, operand, weight, grad, width, window) = step;
        let out = self.result(value, ty)?;
        self.program.steps.push(Step::Window(Window {
            kind,
            out: slot_of(&out),
            x: operand.slot,
            weight,
            bias: None,
            grad,
            heights: operand.heights,
            widths: operand.widths,
            channels: operand.channels,
            width,
            window,
            groups,
            epilogue: None,
        }));
        Ok(out)
    }

    /// The window step of a convolution's input gradient (`g` the output's gradient, as
    /// images; `x` the convolution's input): the adjoint convolution by `weight` when
    /// the convolution has stride 1 and padding at most its window's reach, else the
    /// windows that read each input pixel.
    fn conv_input_grad(
        &mut self,
        value: ValueId,
        op: &Op,
        (grads, inputs, weight): (ImageOperand, ImageOperand, ValueId),
        (stride, padding, dilation): (&[i64], &[i64], &[i64]),
    ) -> Result<WindowGradient, LowerError> {
        let shape: Vec<i64> = match self.graph.ty(weight) {
            Type::Dense { shape, .. } => shape.iter().filter_map(Dim::as_static).collect(),
            _ => Vec::new(),
        };
        let ([_, _, kh, kw], [_, _], [_, _], [_, _]) = (&shape[..], stride, padding, dilation)
        else {
            return Err(unsupported(
                value,
                op,
                "the weight must be [C_out, C_in / groups, Kh, Kw] and the window 2-d",
            ));
        };
        // The gradient's channels: the input's (all groups').
        let (channels, kernel) = (inputs.channels, [*kh, *kw]);
        let (weight, ..) = self.data(value, weight)?;
        // How far the window reaches past its first tap.
        let reach = |axis: usize| dilation[axis].saturating_mul(kernel[axis] - 1);
        if stride == [1, 1] && (0..2).all(|axis| padding[axis] <= reach(axis)) {
            // The adjoint of a stride-1 convolution: the same window over the output's
            // gradient, padded by what the convolution's window reached past its
            // padding.
            let window = Window2d {
                kernel,
                stride: [1, 1],
                padding: [reach(0) - padding[0], reach(1) - padding[1]],
                dilation: [dilation[0], dilation[1]],
            };
            return Ok((
                WindowKind::ConvInputGrad,
                grads,
                Some(weight),
                None,
                channels,
                window,
            ));
        }
        // The convolution's own windows over the input's images; the gradient's pixels
        // are their rows.
        let window = Window2d {
            kernel,
            stride: [stride[0], stride[1]],
            padding: [padding[0], padding[1]],
            dilation: [dilation[0], dilation[1]],
        };
        let operand = ImageOperand {
            heights: inputs.heights,
            widths: inputs.widths,
            ..grads
        };
        Ok((
            WindowKind::StridedConvInputGrad,
            operand,
            Some(weight),
            None,
            channels,
            window,
        ))
    }

    /// A host step running a one-op graph (a per-element region) through libtorch: its
    /// inputs are the lengths its types need, then the region's inputs.
    pub(super) fn host_region(
        &mut self,
        value: ValueId,
        ty: &Type,
        inputs: &[ValueId],
        body: &Graph,
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        let mut host = Graph::new("host");
        let mut renamed: HashMap<ValueId, ValueId> = HashMap::new();
        let mut slots = Vec::new();
        let error = |error: nestor_ir::VerifyError| unsupported(value, op, error.to_string());
        // Lengths first: every type refers to them.
        let mut lengths: Vec<ValueId> = Vec::new();
        for referenced in inputs
            .iter()
            .flat_map(|&input| self.graph.ty(input).length_values())
            .chain(ty.length_values())
        {
            if !lengths.contains(&referenced) {
                lengths.push(referenced);
            }
        }
        for lengths_value in lengths {
            let Lowered::Lengths(slot) = self.get(lengths_value) else {
                return Err(unsupported(
                    value,
                    op,
                    "its lengths are not a lengths buffer",
                ));
            };
            let local = host
                .add_declared(
                    Op::Input {
                        name: format!("lengths{}", slots.len()),
                    },
                    self.graph.ty(lengths_value).clone(),
                )
                .map_err(error)?;
            renamed.insert(lengths_value, local);
            slots.push(slot);
        }
        for &input in inputs {
            let ty = self
                .graph
                .ty(input)
                .map_values(|v| renamed.get(&v).copied().unwrap_or(v));
            let local = host
                .add_declared(
                    Op::Input {
                        name: format!("input{}", slots.len()),
                    },
                    ty,
                )
                .map_err(error)?;
            renamed.insert(input, local);
            let (slot, ..) = self.data(value, input)?;
            slots.push(slot);
        }
        let region_inputs = inputs.iter().map(|input| renamed[input]).collect();
        let region_ty = ty.map_values(|v| renamed.get(&v).copied().unwrap_or(v));
        let region = host
            .add_declared(
                Op::PerElement {
                    inputs: region_inputs,
                    body: Box::new(body.clone()),
                },
                region_ty,
            )
            .map_err(error)?;
        host.outputs = vec![region];
        let out = self.result(value, ty)?;
        self.program.host_graphs.push(host);
        self.program.steps.push(Step::Host(Host {
            out: slot_of(&out),
            inputs: slots,
            graph: self.program.host_graphs.len() - 1,
        }));
        Ok(out)
    }
}

/// A batch of images in a program: its buffer, channels and lengths slots.
#[derive(Clone, Copy)]
struct ImageOperand {
    slot: Slot,
    channels: i64,
    heights: Slot,
    widths: Slot,
}

/// A gradient's window step: its kind, its images, weight and gradient buffers, its
/// output's channels and its window.
type WindowGradient = (
    WindowKind,
    ImageOperand,
    Option<Slot>,
    Option<Slot>,
    i64,
    Window2d,
);

/// The window of a pooling (no dilation), `None` unless every list has two values.
fn pool_window(kernel: &[i64], stride: &[i64], padding: &[i64]) -> Option<Window2d> {
    let pair = |values: &[i64]| <[i64; 2]>::try_from(values).ok();
    Some(Window2d {
        kernel: pair(kernel)?,
        stride: pair(stride)?,
        padding: pair(padding)?,
        dilation: [1, 1],
    })
}

/// The "window" of a resampling to `output`: its kernel holds the output size;
/// `None` unless that is two positive values.
fn resampling_window(output: &[i64]) -> Option<Window2d> {
    let kernel = <[i64; 2]>::try_from(output).ok()?;
    kernel.iter().all(|&size| size > 0).then_some(Window2d {
        kernel,
        ..WHOLE_IMAGE
    })
}

/// The window of an image mean: every pixel its own tap (the step reads the images'
/// sizes, not the window).
const WHOLE_IMAGE: Window2d = Window2d {
    kernel: [1, 1],
    stride: [1, 1],
    padding: [0, 0],
    dilation: [1, 1],
};

/// A 1x1 window that reads each pixel alone.
const POINTWISE: Window2d = Window2d {
    kernel: [1, 1],
    stride: [1, 1],
    padding: [0, 0],
    dilation: [1, 1],
};

/// The window of a convolution by `weight` (a dense `[O, C, kh, kw]` of `graph`) with
/// these strides, paddings and dilations (two each); `None` for other shapes.
fn conv_window(
    graph: &Graph,
    weight: ValueId,
    (stride, padding, dilation): (&[i64], &[i64], &[i64]),
) -> Option<Window2d> {
    let pair = |values: &[i64]| <[i64; 2]>::try_from(values).ok();
    let shape: Option<Vec<i64>> = match graph.ty(weight) {
        Type::Dense { shape, .. } => shape.iter().map(Dim::as_static).collect(),
        _ => None,
    };
    let [_, _, kh, kw] = <[i64; 4]>::try_from(shape?.as_slice()).ok()?;
    Some(Window2d {
        kernel: [kh, kw],
        stride: pair(stride)?,
        padding: pair(padding)?,
        dilation: pair(dilation)?,
    })
}
