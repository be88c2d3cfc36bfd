//! Multi-head attention over packed tokens.

use tch::nn::{self, Init};
use tch::Tensor;

use super::linear;
use crate::{NestedError, NestedTensor, Result};

/// Multi-head attention with torch's parameter layout (`in_proj_weight [3E, E]`,
/// `in_proj_bias [3E]`, `out_proj`), on packed `[L_i, E]` tokens.
#[derive(Debug)]
pub struct MultiheadAttention {
    /// Query, key and value projections stacked: `[3E, E]`.
    pub in_proj_weight: Tensor,
    /// Their biases, `[3E]`, when the layer has biases.
    pub in_proj_bias: Option<Tensor>,
    /// The output projection.
    pub out_proj: nn::Linear,
    /// Number of heads.
    pub num_heads: i64,
    /// Model width `E`.
    pub embed_dim: i64,
}

impl MultiheadAttention {
    /// A layer with `num_heads` heads of width `embed_dim / num_heads`, initialized as
    /// torch does (Xavier-uniform projections, zero biases).
    pub fn new(path: &nn::Path, embed_dim: i64, num_heads: i64, bias: bool) -> Self {
        let bound = (6.0 / (embed_dim + 3 * embed_dim) as f64).sqrt();
        let in_proj_weight = path.var(
            "in_proj_weight",
            &[3 * embed_dim, embed_dim],
            Init::Uniform {
                lo: -bound,
                up: bound,
            },
        );
        let in_proj_bias = bias.then(|| path.zeros("in_proj_bias", &[3 * embed_dim]));
        let config = nn::LinearConfig {
            bias,
            bs_init: Some(Init::Const(0.0)),
            ..Default::default()
        };
        let out_proj = nn::linear(path / "out_proj", embed_dim, embed_dim, config);
        Self {
            in_proj_weight,
            in_proj_bias,
            out_proj,
            num_heads,
            embed_dim,
        }
    }

    /// Attention of `query [L_i, E]` over `key [M_i, E]` and `value [M_i, E]` (key and
    /// value of one structure), causal when asked. Self-attention projects the three
    /// inputs with one GEMM.
    pub fn forward(
        &self,
        query: &NestedTensor,
        key: &NestedTensor,
        value: &NestedTensor,
        causal: bool,
    ) -> Result<NestedTensor> {
        if self.num_heads <= 0 || self.embed_dim % self.num_heads != 0 {
            return Err(NestedError::Unsupported {
                op: "MultiheadAttention",
                reason: format!(
                    "{} heads do not split embed_dim {} into equal heads",
                    self.num_heads, self.embed_dim
                ),
            });
        }
        let width = query.last_static_width("MultiheadAttention")?;
        if width != self.embed_dim {
            return Err(NestedError::DenseOperand {
                op: "MultiheadAttention",
                shape: vec![width],
                reason: format!("(the layer's embed_dim is {})", self.embed_dim),
            });
        }
        let self_attention = std::ptr::eq(query, key) && std::ptr::eq(key, value);
        // Equal lengths in a batch must not change how heads are split.
        let query = &query.ragged_leading()?;
        let (key, value) = if self_attention {
            (query, query)
        } else {
            (&key.ragged_leading()?, &value.ragged_leading()?)
        };
        let head_dim = self.embed_dim / self.num_heads;
        let heads = [self.num_heads, head_dim];
        let (q, k, v) = if self_attention {
            let packed = query.linear(&self.in_proj_weight, self.in_proj_bias.as_ref())?;
            let qkv = packed.reshape_tail(&[3, self.num_heads, head_dim])?;
            let part = |index: i64| qkv.select_static(2, index);
            (part(0)?, part(1)?, part(2)?)
        } else {
            let project = |input: &NestedTensor, index: i64| -> Result<NestedTensor> {
                let weight =
                    self.in_proj_weight
                        .f_narrow(0, index * self.embed_dim, self.embed_dim)?;
                let bias = self
                    .in_proj_bias
                    .as_ref()
                    .map(|bias| bias.f_narrow(0, index * self.embed_dim, self.embed_dim))
                    .transpose()?;
                input.linear(&weight, bias.as_ref())?.reshape_tail(&heads)
            };
            (project(query, 0)?, project(key, 1)?, project(value, 2)?)
        };
        let attended = q.scaled_dot_product_attention(&k, &v, causal, None)?;
        linear(&self.out_proj, &attended.reshape_tail(&[self.embed_dim])?)
    }
}
