//! Convolution, pooling and interpolation for elements of different spatial size: the
//! public operators, packed where `window` has a packed form (images with ragged `H`
//! and `W`), else element by element, each element as a batch of one; and their traces
//! (a per-element region the compiler lowers).

use nestor_ir::{Dim, ElemDim, Graph, Op, PoolKind, Type, ValueId, Window2d};
use tch::Tensor;

use super::window::Pooling;
use crate::trace::{record_with, trace_error, Arg};

use crate::{NestedError, NestedTensor, Result};

/// How a per-element op sizes the spatial dims of its output.
enum Windows {
    /// A sliding window (convolution, pooling).
    Sliding {
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
        dilation: [i64; 2],
    },
    /// A fixed output size (adaptive pooling).
    Fixed([i64; 2]),
}

impl Windows {
    /// Spatial dim `axis` of the output for the input's `dim`: the fixed size, the
    /// input's lengths for a window that keeps every size, or lengths computed by a
    /// `window_lengths` op of `graph` (`fixed`: the output's size where the input's is
    /// static).
    fn output_dim(
        &self,
        graph: &mut Graph,
        axis: usize,
        dim: &ElemDim,
        fixed: i64,
    ) -> Result<ElemDim, nestor_ir::VerifyError> {
        Ok(match (self, dim) {
            (Windows::Fixed(size), _) => ElemDim::Fixed(Dim::Static(size[axis])),
            (
                Windows::Sliding {
                    kernel,
                    stride,
                    padding,
                    dilation,
                },
                ElemDim::Ragged(lengths),
            ) => {
                // One symbol for every window of one size formula (a window that keeps
                // every size: the input's own), so that branches meet again (residual
                // connections, strided downsampling).
                ElemDim::Ragged(graph.window_lengths(
                    *lengths,
                    [kernel[axis], stride[axis], padding[axis], dilation[axis]],
                )?)
            }
            (Windows::Sliding { .. }, ElemDim::Fixed(_)) => ElemDim::Fixed(Dim::Static(fixed)),
        })
    }
}

/// Runs a batched tch op on one element `[C, *spatial]` as a batch of one.
fn as_batch_of_one(
    element: &Tensor,
    f: impl Fn(&Tensor) -> Result<Tensor, tch::TchError>,
) -> Result<Tensor> {
    Ok(f(&element.f_unsqueeze(0)?)?.f_squeeze_dim(0)?)
}

impl NestedTensor {
    /// 1-d convolution of elements `[C_in, L_i]` with `weight [C_out, C_in / groups, K]`:
    /// the 2-d convolution of signals one pixel high (`[C_in, 1, L_i]`, a kernel
    /// `[K_h = 1, K]`), so it is packed and compiles (with its gradient) as `conv2d`
    /// does; the weight's view is a parameter whose gradient reaches `weight`.
    pub fn conv1d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: i64,
        padding: i64,
        dilation: i64,
        groups: i64,
    ) -> Result<NestedTensor> {
        let channels = self.signal_channels("conv1d")?;
        let weight = weight.f_unsqueeze(2)?;
        let images = self.unsqueeze(channels + 1)?;
        let convolved = images.conv2d(
            &weight,
            bias,
            [1, stride],
            [0, padding],
            [1, dilation],
            groups,
        )?;
        convolved.select_static(channels + 1, 0)
    }

    /// The NestedTensor dim of the channels of signals `[C, L_i]` (then rows one pixel
    /// high go after it); an error naming `op` for other elements.
    fn signal_channels(&self, op: &'static str) -> Result<i64> {
        let layout = self.lay();
        if layout.rank() != 2 || layout.is_ragged(0) {
            return Err(NestedError::Unsupported {
                op,
                reason: format!(
                    "expects signals [C, L_i] (static channels, then the length), got elements of rank {} with ragged dims {:?}",
                    layout.rank(),
                    layout.ragged_dims()
                ),
            });
        }
        Ok(i64::from(self.batch_dim() == 0))
    }

    /// 2-d convolution of elements `[C_in, H_i, W_i]` with
    /// `weight [C_out, C_in / groups, K_h, K_w]`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: [i64; 2],
        padding: [i64; 2],
        dilation: [i64; 2],
        groups: i64,
    ) -> Result<NestedTensor> {
        let window = Window2d {
            kernel: [
                weight.size().get(2).copied().unwrap_or(0),
                weight.size().get(3).copied().unwrap_or(0),
            ],
            stride,
            padding,
            dilation,
        };
        let result = match self.conv2d_packed(weight, bias, window, groups)? {
            Some(packed) => packed,
            None => self.map_elements_eager("conv2d", true, |element| {
                as_batch_of_one(element, |x| {
                    x.f_conv2d(weight, bias, stride, padding, dilation, groups)
                })
            })?,
        };
        let mut params = vec![weight];
        params.extend(bias);
        let has_bias = bias.is_some();
        let windows = Windows::Sliding {
            kernel: [weight.size()[2], weight.size()[3]],
            stride,
            padding,
            dilation,
        };
        self.record_per_element(result, "conv2d", &params, windows, |ids| Op::Conv2d {
            x: ids[0],
            weight: ids[1],
            bias: has_bias.then(|| ids[2]),
            stride: stride.to_vec(),
            padding: padding.to_vec(),
            dilation: dilation.to_vec(),
            groups,
        })
    }

    /// 2-d max pooling of elements `[C, H_i, W_i]`.
    pub fn max_pool2d(
        &self,
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
    ) -> Result<NestedTensor> {
        let window = Window2d {
            kernel,
            stride,
            padding,
            dilation: [1, 1],
        };
        let result = match self.pool2d_packed(Pooling::Max, window)? {
            Some(packed) => packed,
            None => self.map_elements_eager("max_pool2d", true, |element| {
                as_batch_of_one(element, |x| {
                    x.f_max_pool2d(kernel, stride, padding, [1, 1], false)
                })
            })?,
        };
        let windows = Windows::Sliding {
            kernel,
            stride,
            padding,
            dilation: [1, 1],
        };
        self.record_per_element(result, "pool2d", &[], windows, |ids| Op::Pool2d {
            kind: PoolKind::Max,
            x: ids[0],
            kernel: kernel.to_vec(),
            stride: stride.to_vec(),
            padding: padding.to_vec(),
        })
    }

    /// 2-d average pooling of elements `[C, H_i, W_i]` (padding not counted).
    pub fn avg_pool2d(
        &self,
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
    ) -> Result<NestedTensor> {
        let window = Window2d {
            kernel,
            stride,
            padding,
            dilation: [1, 1],
        };
        let result = match self.pool2d_packed(Pooling::Average, window)? {
            Some(packed) => packed,
            None => self.map_elements_eager("avg_pool2d", true, |element| {
                as_batch_of_one(element, |x| {
                    x.f_avg_pool2d(kernel, stride, padding, false, false, None::<i64>)
                })
            })?,
        };
        let windows = Windows::Sliding {
            kernel,
            stride,
            padding,
            dilation: [1, 1],
        };
        self.record_per_element(result, "pool2d", &[], windows, |ids| Op::Pool2d {
            kind: PoolKind::Avg,
            x: ids[0],
            kernel: kernel.to_vec(),
            stride: stride.to_vec(),
            padding: padding.to_vec(),
        })
    }

    /// 1-d max pooling of elements `[C, L_i]`: the 2-d pooling of signals one pixel
    /// high (a window `[1, kernel]`), packed and compiled as `max_pool2d` is.
    pub fn max_pool1d(&self, kernel: i64, stride: i64, padding: i64) -> Result<NestedTensor> {
        let channels = self.signal_channels("max_pool1d")?;
        let images = self.unsqueeze(channels + 1)?;
        let pooled = images.max_pool2d([1, kernel], [1, stride], [0, padding])?;
        pooled.select_static(channels + 1, 0)
    }

    /// Adaptive average pooling of elements `[C, H_i, W_i]` to `[C, *output]`; every
    /// element then has the same shape, so the result has no ragged dim.
    pub fn adaptive_avg_pool2d(&self, output: [i64; 2]) -> Result<NestedTensor> {
        let packed = match output {
            [1, 1] => self.image_means()?,
            _ => None,
        };
        let result = match packed {
            Some(packed) => packed,
            None => self.map_elements_eager("adaptive_avg_pool2d", false, |element| {
                as_batch_of_one(element, |x| x.f_adaptive_avg_pool2d(output))
            })?,
        };
        self.record_per_element(
            result,
            "adaptive_avg_pool2d",
            &[],
            Windows::Fixed(output),
            |ids| Op::AdaptiveAvgPool2d {
                x: ids[0],
                output: output.to_vec(),
            },
        )
    }

    /// Records a per-element region for an op over elements `[C, H_i, W_i]`: a body
    /// graph running `body` on one dense element (and `params`), lengths ops giving the
    /// output's spatial sizes, and the region with its declared result type.
    fn record_per_element(
        &self,
        result: NestedTensor,
        op: &'static str,
        params: &[&Tensor],
        windows: Windows,
        body: impl Fn(&[ValueId]) -> Op,
    ) -> Result<NestedTensor> {
        let Some(trace) = &self.trace else {
            return Ok(result);
        };
        let Type::Ragged { dtype, batch, dims } = trace.ty() else {
            return Err(trace_error(op, "expects a ragged input".into()));
        };
        if dims.len() != 3 {
            return Err(trace_error(
                op,
                format!("expects elements [C, H, W], got rank {}", dims.len()),
            ));
        }
        let element_dim = |dim: &ElemDim| match dim {
            ElemDim::Fixed(dim) => dim.clone(),
            ElemDim::Ragged(_) => Dim::Sym("?".into()),
        };
        let mut args = vec![Arg::Nested(self)];
        args.extend(params.iter().map(|param| Arg::Dense(param, None)));
        let out_channels = result.lay().max_sizes().first().copied().unwrap_or(0);
        let traced = record_with(&args, op, |graph, ids| {
            let mut body_graph = Graph::new(op);
            let element = Type::Dense {
                dtype,
                shape: dims.iter().map(element_dim).collect(),
            };
            let mut body_ids = vec![body_graph.add_declared(
                Op::Input {
                    name: "element".into(),
                },
                element,
            )?];
            for (position, &param) in ids[1..].iter().enumerate() {
                let ty = graph.ty(param).clone();
                body_ids.push(body_graph.add_declared(
                    Op::Input {
                        name: format!("param{position}"),
                    },
                    ty,
                )?);
            }
            let output = body_graph.push(body(&body_ids))?;
            body_graph.outputs = vec![output];
            let mut out_dims = vec![ElemDim::Fixed(Dim::Static(out_channels))];
            for (axis, dim) in dims[1..].iter().enumerate() {
                let fixed = result.lay().max_sizes().get(axis + 1).copied().unwrap_or(0);
                out_dims.push(windows.output_dim(graph, axis, dim, fixed)?);
            }
            let ty = Type::Ragged {
                dtype,
                batch: batch.clone(),
                dims: out_dims,
            };
            graph.add_declared(
                Op::PerElement {
                    inputs: ids.to_vec(),
                    body: Box::new(body_graph),
                },
                ty,
            )
        })?;
        let mut result = result;
        result.trace = traced;
        Ok(result)
    }

    /// Bilinear interpolation of elements `[C, H_i, W_i]` to a fixed `size` (then every
    /// element has the same shape and the result no ragged dim; this compiles, with its
    /// gradient), or scaled by `scale` per element (not traced) (`align_corners` as in
    /// torch).
    pub fn interpolate_bilinear(
        &self,
        size: Option<[i64; 2]>,
        scale: Option<f64>,
        align_corners: bool,
    ) -> Result<NestedTensor> {
        let rank = self.lay().rank();
        if rank != 3 {
            return Err(NestedError::Unsupported {
                op: "interpolate",
                reason: format!("bilinear interpolation needs [C, H, W] elements, not rank {rank}"),
            });
        }
        if let Some(scale) = scale.filter(|scale| !(scale.is_finite() && *scale > 0.0)) {
            return Err(NestedError::Unsupported {
                op: "interpolate",
                reason: format!("the scale must be finite and positive, not {scale}"),
            });
        }
        let interpolate = |element: &Tensor| {
            let shape = element.size();
            let target = match (size, scale) {
                (Some(size), _) => size,
                (None, Some(scale)) => [
                    (shape[shape.len() - 2] as f64 * scale).floor() as i64,
                    (shape[shape.len() - 1] as f64 * scale).floor() as i64,
                ],
                (None, None) => [shape[shape.len() - 2], shape[shape.len() - 1]],
            };
            as_batch_of_one(element, |x| {
                x.f_upsample_bilinear2d(target, align_corners, None::<f64>, None::<f64>)
            })
        };
        let Some(size) = size else {
            if self.trace.is_some() {
                return Err(trace_error(
                    "interpolate",
                    "a compiled interpolation needs a fixed size (a scale gives every element its own)".into(),
                ));
            }
            return self.map_elements("interpolate", true, interpolate);
        };
        let result = self.map_elements_eager("interpolate", false, interpolate)?;
        self.record_per_element(result, "interpolate", &[], Windows::Fixed(size), |ids| {
            Op::InterpolateBilinear {
                x: ids[0],
                output: size.to_vec(),
                align_corners,
            }
        })
    }
}
