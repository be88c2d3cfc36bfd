//! Per-element bodies: convolution and pooling of one dense element `[C, H, W]`.

use super::*;

/// The type of a per element op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Conv2d {
            x,
            weight,
            bias,
            stride,
            padding,
            dilation,
            groups,
        } => {
            let (x_type, weight_type) = (ty(*x), ty(*weight));
            let bias_type = bias.map(ty);
            same_dtype(
                "conv2d",
                &[
                    ("the input", Some(&x_type)),
                    ("the weight", Some(&weight_type)),
                    ("the bias", bias_type.as_ref()),
                ],
            )?;
            let (dtype, shape) = element_image(&x_type)?;
            let weight = static_shape(&weight_type, "the weight")?;
            let [out, per_group, kh, kw] = weight.as_slice() else {
                return Err(format!(
                    "the weight must be [C_out, C_in / groups, Kh, Kw], got {weight:?}"
                ));
            };
            let channels = grouped_channels(*per_group, *out, *groups)?;
            if shape[0].as_static().is_some_and(|given| given != channels) {
                return Err(format!(
                    "the input has {} channels, the weight expects {channels}",
                    shape[0],
                ));
            }
            if let Some(bias) = bias {
                if static_shape(&ty(*bias), "the bias")? != [*out] {
                    return Err(format!("the bias must be [{out}]"));
                }
            }
            let (stride, padding, dilation) = (
                pair("stride", stride, 1)?,
                pair("padding", padding, 0)?,
                pair("dilation", dilation, 1)?,
            );
            let spatial = [
                window(&shape[1], *kh, stride[0], padding[0], dilation[0]),
                window(&shape[2], *kw, stride[1], padding[1], dilation[1]),
            ];
            Ok(Type::dense(
                dtype,
                [Dim::Static(*out), spatial[0].clone(), spatial[1].clone()],
            ))
        }
        Op::Pool2d {
            x,
            kernel,
            stride,
            padding,
            ..
        } => {
            let (dtype, shape) = element_image(&ty(*x))?;
            let (kernel, stride, padding) = (
                pair("kernel", kernel, 1)?,
                pair("stride", stride, 1)?,
                pair("padding", padding, 0)?,
            );
            Ok(Type::dense(
                dtype,
                [
                    shape[0].clone(),
                    window(&shape[1], kernel[0], stride[0], padding[0], 1),
                    window(&shape[2], kernel[1], stride[1], padding[1], 1),
                ],
            ))
        }
        Op::AdaptiveAvgPool2d { x, output } | Op::InterpolateBilinear { x, output, .. } => {
            let (dtype, shape) = element_image(&ty(*x))?;
            let output = pair("output size", output, 1)?;
            Ok(Type::dense(
                dtype,
                [
                    shape[0].clone(),
                    Dim::Static(output[0]),
                    Dim::Static(output[1]),
                ],
            ))
        }
        _ => gradient(graph, op),
    }
}

/// The input channels of a convolution by a weight of `per_group` input channels and
/// `out` output channels in `groups` groups, or why they do not group.
fn grouped_channels(per_group: i64, out: i64, groups: i64) -> Result<i64, String> {
    if groups < 1 || out % groups != 0 {
        return Err(format!(
            "{groups} groups do not divide {out} output channels"
        ));
    }
    per_group
        .checked_mul(groups)
        .ok_or_else(|| format!("{per_group} channels a group times {groups} groups overflows"))
}

/// The type of a per-element gradient op in `graph`, or why it is ill-typed.
fn gradient(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Conv2dInputGrad {
            g,
            weight,
            x,
            stride,
            padding,
            dilation,
            groups,
        } => {
            let weight = static_shape(&ty(*weight), "the weight")?;
            let [out, per_group, _, _] = weight.as_slice() else {
                return Err(format!(
                    "the weight must be [C_out, C_in / groups, Kh, Kw], got {weight:?}"
                ));
            };
            let channels = &grouped_channels(*per_group, *out, *groups)?;
            let (g, input) = (images(&ty(*g))?, images(&ty(*x))?);
            if g.1 != Some(*out) || input.1 != Some(*channels) {
                return Err(format!(
                    "the gradient has {:?} channels and the input {:?}, the weight [{out}, {channels}, ..]",
                    g.1, input.1
                ));
            }
            pair("stride", stride, 1)?;
            pair("padding", padding, 0)?;
            pair("dilation", dilation, 1)?;
            Ok(ty(*x).with_dtype(g.0))
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
            let (x, g) = (images(&ty(*x))?, images(&ty(*g))?);
            let [kh, kw] = pair("kernel", kernel, 1)?;
            pair("stride", stride, 1)?;
            pair("padding", padding, 0)?;
            pair("dilation", dilation, 1)?;
            let (Some(channels), Some(out)) = (x.1, g.1) else {
                return Err("needs images of static channels".into());
            };
            if *groups < 1 || channels % groups != 0 || out % groups != 0 {
                return Err(format!(
                    "{groups} groups do not divide {channels} input and {out} output channels"
                ));
            }
            Ok(Type::dense_static(g.0, &[out, channels / groups, kh, kw]))
        }
        Op::Pool2dGrad {
            x,
            g,
            kernel,
            stride,
            padding,
            ..
        } => {
            let (input, grads) = (images(&ty(*x))?, images(&ty(*g))?);
            pair("kernel", kernel, 1)?;
            pair("stride", stride, 1)?;
            pair("padding", padding, 0)?;
            if input.1 != grads.1 {
                return Err("needs a gradient of the images' channels".into());
            }
            Ok(ty(*x).with_dtype(grads.0))
        }
        Op::ImageMeanGrad { g, x } => {
            let Type::Ragged { dims, dtype, .. } = ty(*g) else {
                return Err("the gradient must be a batch of [C, 1, 1]".into());
            };
            let x_channels = images(&ty(*x))?.1;
            match dims.as_slice() {
                [ElemDim::Fixed(c), ElemDim::Fixed(Dim::Static(1)), ElemDim::Fixed(Dim::Static(1))]
                    if c.as_static() == x_channels =>
                {
                    Ok(ty(*x).with_dtype(dtype))
                }
                _ => Err(format!(
                    "the gradient must be [C, 1, 1] of the images' channels, got {}",
                    ty(*g)
                )),
            }
        }
        Op::AdaptiveAvgPool2dGrad { g, x, output }
        | Op::InterpolateBilinearGrad { g, x, output, .. } => {
            let [h, w] = pair("output size", output, 1)?;
            let Type::Ragged { dims, dtype, .. } = ty(*g) else {
                return Err(format!("the gradient must be a batch of [C, {h}, {w}]"));
            };
            let x_channels = images(&ty(*x))?.1;
            match dims.as_slice() {
                [ElemDim::Fixed(c), ElemDim::Fixed(Dim::Static(gh)), ElemDim::Fixed(Dim::Static(gw))]
                    if c.as_static() == x_channels && [*gh, *gw] == [h, w] =>
                {
                    Ok(ty(*x).with_dtype(dtype))
                }
                _ => Err(format!(
                    "the gradient must be [C, {h}, {w}] of the images' channels, got {}",
                    ty(*g)
                )),
            }
        }
        other => Err(format!("{} is not a per element op", other.name())),
    }
}

/// A window attribute (`what`): one value per spatial axis, each at least `least`.
fn pair(what: &str, values: &[i64], least: i64) -> Result<[i64; 2], String> {
    match values {
        &[first, second] if first >= least && second >= least => Ok([first, second]),
        _ => Err(format!(
            "the {what} must be two values of at least {least}, got {values:?}"
        )),
    }
}

/// The size of a window op's output dim.
fn window(input: &Dim, kernel: i64, stride: i64, padding: i64, dilation: i64) -> Dim {
    match input.as_static() {
        Some(size) => Dim::Static(window_output_size(size, kernel, stride, padding, dilation)),
        None => Dim::Sym("?".into()),
    }
}

/// The geometry of a 2-d sliding window (convolution or pooling), per spatial axis.
///
/// ```
/// use nestor_ir::Window2d;
/// let pool = Window2d { kernel: [2, 2], stride: [2, 2], padding: [0, 0], dilation: [1, 1] };
/// assert_eq!(pool.output_size((5, 4)), (2, 2));
/// assert_eq!(pool.taps(), 4);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window2d {
    /// Window size.
    pub kernel: [i64; 2],
    /// Step.
    pub stride: [i64; 2],
    /// Zero padding on each side.
    pub padding: [i64; 2],
    /// Spacing of the window's taps.
    pub dilation: [i64; 2],
}

impl Window2d {
    /// The output size of an image `(height, width)`.
    pub fn output_size(&self, (height, width): (i64, i64)) -> (i64, i64) {
        let axis = |size: i64, axis: usize| {
            window_output_size(
                size,
                self.kernel[axis],
                self.stride[axis],
                self.padding[axis],
                self.dilation[axis],
            )
        };
        (axis(height, 0), axis(width, 1))
    }

    /// The window's taps: `kernel[0] * kernel[1]`.
    pub fn taps(&self) -> i64 {
        self.kernel[0].saturating_mul(self.kernel[1])
    }
}

/// The output size of a sliding window (convolution, pooling) over `size` positions,
/// as torch computes it (never negative; `stride` at least 1, as type inference
/// checks). Computed in 128 bits, so that no geometry overflows.
pub fn window_output_size(size: i64, kernel: i64, stride: i64, padding: i64, dilation: i64) -> i64 {
    let [size, kernel, stride, padding, dilation] =
        [size, kernel, stride.max(1), padding, dilation].map(i128::from);
    let reach = dilation * (kernel - 1) + 1;
    let positions = (size + 2 * padding - reach).div_euclid(stride) + 1;
    positions.clamp(0, i128::from(i64::MAX)) as i64
}

fn element_image(ty: &Type) -> Result<(DType, Vec<Dim>), String> {
    match ty {
        Type::Dense { dtype, shape } if shape.len() == 3 => Ok((*dtype, shape.clone())),
        other => Err(format!("expects one element [C, H, W], got {other}")),
    }
}

/// The element type and static channel count of a batch of images `[C, H_i, W_i]` with
/// ragged `H` and `W`.
fn images(ty: &Type) -> Result<(DType, Option<i64>), String> {
    let wanted = || format!("expects images [C, H, W] with ragged H and W (or H 1), got {ty}");
    match ty {
        Type::Ragged { dtype, dims, .. } => match dims.as_slice() {
            [ElemDim::Fixed(channels), ElemDim::Ragged(_), ElemDim::Ragged(_)]
            | [ElemDim::Fixed(channels), ElemDim::Fixed(Dim::Static(1)), ElemDim::Ragged(_)] => {
                Ok((*dtype, channels.as_static()))
            }
            _ => Err(wanted()),
        },
        _ => Err(wanted()),
    }
}
