//! Convolution, pooling and interpolation for elements of different spatial size:
//! element by element (no packed form exists), each element as a batch of one.

use tch::Tensor;

use crate::{NestedTensor, Result};

/// Runs a batched tch op on one element `[C, *spatial]` as a batch of one.
fn as_batch_of_one(
    element: &Tensor,
    f: impl Fn(&Tensor) -> Result<Tensor, tch::TchError>,
) -> Result<Tensor> {
    Ok(f(&element.f_unsqueeze(0)?)?.f_squeeze_dim(0)?)
}

impl NestedTensor {
    /// 1-d convolution of elements `[C_in, L_i]` with `weight [C_out, C_in / groups, K]`.
    pub fn conv1d(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        stride: i64,
        padding: i64,
        dilation: i64,
        groups: i64,
    ) -> Result<NestedTensor> {
        self.map_elements("conv1d", true, |element| {
            as_batch_of_one(element, |x| {
                x.f_conv1d(weight, bias, [stride], [padding], [dilation], groups)
            })
        })
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
        self.map_elements("conv2d", true, |element| {
            as_batch_of_one(element, |x| {
                x.f_conv2d(weight, bias, stride, padding, dilation, groups)
            })
        })
    }

    /// 2-d max pooling of elements `[C, H_i, W_i]`.
    pub fn max_pool2d(
        &self,
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
    ) -> Result<NestedTensor> {
        self.map_elements("max_pool2d", true, |element| {
            as_batch_of_one(element, |x| {
                x.f_max_pool2d(kernel, stride, padding, [1, 1], false)
            })
        })
    }

    /// 2-d average pooling of elements `[C, H_i, W_i]` (padding not counted).
    pub fn avg_pool2d(
        &self,
        kernel: [i64; 2],
        stride: [i64; 2],
        padding: [i64; 2],
    ) -> Result<NestedTensor> {
        self.map_elements("avg_pool2d", true, |element| {
            as_batch_of_one(element, |x| {
                x.f_avg_pool2d(kernel, stride, padding, false, false, None::<i64>)
            })
        })
    }

    /// 1-d max pooling of elements `[C, L_i]`.
    pub fn max_pool1d(&self, kernel: i64, stride: i64, padding: i64) -> Result<NestedTensor> {
        self.map_elements("max_pool1d", true, |element| {
            as_batch_of_one(element, |x| {
                x.f_max_pool1d([kernel], [stride], [padding], [1], false)
            })
        })
    }

    /// Adaptive average pooling of elements `[C, H_i, W_i]` to `[C, *output]`; every
    /// element then has the same shape, so the result has no ragged dim.
    pub fn adaptive_avg_pool2d(&self, output: [i64; 2]) -> Result<NestedTensor> {
        self.map_elements("adaptive_avg_pool2d", false, |element| {
            as_batch_of_one(element, |x| x.f_adaptive_avg_pool2d(output))
        })
    }

    /// Bilinear interpolation of elements `[C, H_i, W_i]` to a fixed `size`, or scaled by
    /// `scale` per element (`align_corners` as in torch).
    pub fn interpolate_bilinear(
        &self,
        size: Option<[i64; 2]>,
        scale: Option<f64>,
        align_corners: bool,
    ) -> Result<NestedTensor> {
        self.map_elements("interpolate", size.is_none(), |element| {
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
        })
    }
}
