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
mod transformer;

pub use attention::MultiheadAttention;

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
