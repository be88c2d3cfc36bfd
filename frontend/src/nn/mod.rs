//! Neural-network modules over NestedTensors, with parameters in a `tch::nn::VarStore`
//! (created through a `tch::nn::Path`, like tch's own `nn::linear`), so tch optimizers
//! train them.
//!
//! ```
//! use nestor_frontend::nn::{TransformerConfig, TransformerEncoder};
//! use nestor_frontend::NestedTensor;
//! use tch::{nn, Device, Kind, Tensor};
//!
//! let store = nn::VarStore::new(Device::Cpu);
//! let config = TransformerConfig { d_model: 16, nhead: 4, dim_feedforward: 32, ..Default::default() };
//! let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, true);
//! let tokens = NestedTensor::from_tensors(&[
//!     Tensor::randn([3, 16], (Kind::Float, Device::Cpu)),
//!     Tensor::randn([5, 16], (Kind::Float, Device::Cpu)),
//! ])?;
//! let encoded = encoder.forward(&tokens, false)?;
//! assert_eq!(encoded.shape(), [2, 5, 16]);
//! # Ok::<(), nestor_frontend::NestedError>(())
//! ```

mod attention;
mod bert;
mod checkpoint;
mod resnet;
mod transformer;

pub use attention::MultiheadAttention;
pub use bert::{Bert, BertConfig};
pub use resnet::ResNet;

pub use transformer::{
    Activation, Transformer, TransformerConfig, TransformerDecoder, TransformerDecoderLayer,
    TransformerEncoder, TransformerEncoderLayer,
};

use tch::nn;

use crate::{NestedTensor, Result};

/// A linear layer applied to the packed rows.
pub fn linear(layer: &nn::Linear, input: &NestedTensor) -> Result<NestedTensor> {
    input.linear(&layer.ws, layer.bs.as_ref())
}

/// Layer normalization over a static tail, with an affine weight and bias.
#[derive(Debug)]
pub struct LayerNorm {
    /// Scale, initialized to ones.
    pub weight: tch::Tensor,
    /// Shift, initialized to zeros.
    pub bias: tch::Tensor,
    /// The normalized tail.
    pub normalized_shape: Vec<i64>,
    /// Added to the variance.
    pub eps: f64,
}

impl LayerNorm {
    /// A layer norm over `normalized_shape` with parameters `weight` and `bias` under `path`.
    pub fn new(path: &nn::Path, normalized_shape: &[i64], eps: f64) -> Self {
        Self {
            weight: path.ones("weight", normalized_shape),
            bias: path.zeros("bias", normalized_shape),
            normalized_shape: normalized_shape.to_vec(),
            eps,
        }
    }

    /// Normalizes the static tail of the packed rows.
    pub fn forward(&self, input: &NestedTensor) -> Result<NestedTensor> {
        input.layer_norm(
            &self.normalized_shape,
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
        )
    }
}

/// Batch normalization over a static channel dim (torch's `BatchNorm1d` / `BatchNorm2d`
/// on packed batches: `[L, C]` sequences with `channel_dim` -1, `[C, H, W]` images with
/// `channel_dim` 1), with an affine weight and bias and running statistics, which the
/// store holds untrained (`running_mean`, `running_var`, as torch names them).
///
/// ```
/// use nestor_frontend::nn::BatchNorm;
/// use nestor_frontend::{compile, Dense, NestedTensor};
/// use tch::{nn, Device, Kind, Tensor};
///
/// let store = nn::VarStore::new(Device::Cpu);
/// let norm = BatchNorm::new(&(store.root() / "norm"), 3, 1);
/// let images = NestedTensor::builder().ragged_dims(&[1, 2]).tensors(&[
///     Tensor::randn([3, 4, 5], (Kind::Float, Device::Cpu)) * 2.0 + 1.0,
///     Tensor::randn([3, 2, 6], (Kind::Float, Device::Cpu)),
/// ])?;
/// // Training mode: normalized by the batch's statistics, which the call folds into
/// // the running ones (compiled as eager).
/// let train = compile("norm", |x: &[NestedTensor], _: &[Dense]| norm.forward(&x[0], true));
/// train.call(&[&images], &[])?;
/// assert!(norm.running_mean.abs().sum(Kind::Float).double_value(&[]) > 0.0);
/// // Eval mode: normalized by the running statistics.
/// let normalized = norm.forward(&images, false)?;
/// assert_eq!(normalized.values().size(), images.values().size());
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
#[derive(Debug)]
pub struct BatchNorm {
    /// Scale `[C]`, initialized to ones.
    pub weight: tch::Tensor,
    /// Shift `[C]`, initialized to zeros.
    pub bias: tch::Tensor,
    /// The running mean `[C]`, initialized to zeros.
    pub running_mean: tch::Tensor,
    /// The running (unbiased) variance `[C]`, initialized to ones.
    pub running_var: tch::Tensor,
    /// The channel dim of the batches (a NestedTensor dim).
    pub channel_dim: i64,
    /// The weight of each training batch's statistics in the running ones.
    pub momentum: f64,
    /// Added to the variance.
    pub eps: f64,
}

impl BatchNorm {
    /// A batch norm of `channels` channels at `channel_dim`, its parameters and running
    /// statistics under `path`; torch's defaults (momentum 0.1, eps 1e-5).
    pub fn new(path: &nn::Path, channels: i64, channel_dim: i64) -> Self {
        Self {
            weight: path.ones("weight", &[channels]),
            bias: path.zeros("bias", &[channels]),
            running_mean: path.zeros_no_train("running_mean", &[channels]),
            running_var: path.ones_no_train("running_var", &[channels]),
            channel_dim,
            momentum: 0.1,
            eps: 1e-5,
        }
    }

    /// Normalizes `input` per channel: by the batch's statistics when `train` (and
    /// updates the running ones), else by the running statistics.
    pub fn forward(&self, input: &NestedTensor, train: bool) -> Result<NestedTensor> {
        input.batch_norm(
            self.channel_dim,
            Some(&self.running_mean),
            Some(&self.running_var),
            Some(&self.weight),
            Some(&self.bias),
            train,
            self.momentum,
            self.eps,
        )
    }
}
