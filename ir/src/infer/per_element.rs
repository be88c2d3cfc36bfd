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
            let (dtype, shape) = element_image(&ty(*x))?;
            let weight = static_shape(&ty(*weight), "the weight")?;
            let [out, per_group, kh, kw] = weight.as_slice() else {
                return Err(format!(
                    "the weight must be [C_out, C_in / groups, Kh, Kw], got {weight:?}"
                ));
            };
            if shape[0]
                .as_static()
                .is_some_and(|channels| channels != per_group * groups)
            {
                return Err(format!(
                    "the input has {} channels, the weight expects {}",
                    shape[0],
                    per_group * groups
                ));
            }
            if let Some(bias) = bias {
                if static_shape(&ty(*bias), "the bias")? != [*out] {
                    return Err(format!("the bias must be [{out}]"));
                }
            }
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
            Ok(Type::dense(
                dtype,
                [
                    shape[0].clone(),
                    window(&shape[1], kernel[0], stride[0], padding[0], 1),
                    window(&shape[2], kernel[1], stride[1], padding[1], 1),
                ],
            ))
        }
        Op::AdaptiveAvgPool2d { x, output } => {
            let (dtype, shape) = element_image(&ty(*x))?;
            Ok(Type::dense(
                dtype,
                [
                    shape[0].clone(),
                    Dim::Static(output[0]),
                    Dim::Static(output[1]),
                ],
            ))
        }
        other => Err(format!("{} is not a per element op", other.name())),
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
/// as torch computes it (never negative).
pub fn window_output_size(size: i64, kernel: i64, stride: i64, padding: i64, dilation: i64) -> i64 {
    ((size + 2 * padding - dilation * (kernel - 1) - 1).div_euclid(stride) + 1).max(0)
}

fn element_image(ty: &Type) -> Result<(DType, Vec<Dim>), String> {
    match ty {
        Type::Dense { dtype, shape } if shape.len() == 3 => Ok((*dtype, shape.clone())),
        other => Err(format!("expects one element [C, H, W], got {other}")),
    }
}
