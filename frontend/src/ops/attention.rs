//! Scaled dot-product attention over packed heads: each element attends only within
//! itself (varlen), with different query and key lengths for cross-attention.

use tch::Tensor;

use crate::guard::{slow_path, SlowPath};
use crate::{NestedError, NestedTensor, Result};

impl NestedTensor {
    /// Attention of queries `self: [L_i, H, D]` over keys `[M_i, H, D]` and values
    /// `[M_i, H, D_v]`: `softmax(q k^T * scale) v` per element and head, with an optional
    /// causal mask (query `t` sees keys `0..=t`). `scale` defaults to `1 / sqrt(D)`.
    /// Keys and values must have the same lengths; the batch sizes must agree.
    ///
    /// Runs libtorch's fused attention once per element (a per-element path: no padded
    /// `[B, H, L, L]` scores are built).
    pub fn scaled_dot_product_attention(
        &self,
        keys: &NestedTensor,
        values: &NestedTensor,
        causal: bool,
        scale: Option<f64>,
    ) -> Result<NestedTensor> {
        slow_path(SlowPath::PerElement, "scaled_dot_product_attention")?;
        if keys.layout().offsets() != values.layout().offsets() {
            return Err(NestedError::StructureMismatch {
                op: "scaled_dot_product_attention (keys vs values)",
                left: keys.layout().element_sizes().to_vec(),
                right: values.layout().element_sizes().to_vec(),
            });
        }
        if keys.len() != self.len() {
            return Err(NestedError::SelectorLength {
                expected: self.len(),
                got: keys.len(),
            });
        }
        for (name, nested) in [("queries", self), ("keys", keys), ("values", values)] {
            let layout = nested.layout();
            if layout.rank() != 3 || layout.ragged_dims().iter().any(|&dim| dim != 0) {
                return Err(NestedError::Unsupported {
                    op: "scaled_dot_product_attention",
                    reason: format!(
                        "{name} must be [L_i, heads, head_dim] with only the first dim ragged; got ragged dims {:?} of rank {}",
                        layout.ragged_dims(),
                        layout.rank()
                    ),
                });
            }
        }
        let (query_offsets, key_offsets) = (self.layout().offsets(), keys.layout().offsets());
        let outputs = (0..self.len())
            .map(|element| {
                let rows = |tensor: &Tensor, offsets: &[i64]| {
                    tensor
                        .f_narrow(0, offsets[element], offsets[element + 1] - offsets[element])?
                        .f_transpose(0, 1)
                };
                let q = rows(self.values(), query_offsets)?;
                let k = rows(keys.values(), key_offsets)?;
                let v = rows(values.values(), key_offsets)?;
                let attended = Tensor::f_scaled_dot_product_attention(
                    &q,
                    &k,
                    &v,
                    None::<Tensor>,
                    0.0,
                    causal,
                    scale,
                    false,
                )?;
                Ok(attended.f_transpose(0, 1)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let width = values.values().size()[2];
        let output = if outputs.is_empty() {
            Tensor::f_empty(
                [0, self.values().size()[1], width],
                (self.kind(), self.device()),
            )?
        } else {
            Tensor::f_cat(&outputs, 0)?
        };
        self.with_last_static_width(output, width)
    }
}
