//! Scaled dot-product attention over packed heads: each element attends only within
//! itself (varlen), with different query and key lengths for cross-attention.

use tch::Tensor;

use nestor_ir::{Op, F64};

use crate::guard::{slow_path, SlowPath};
use crate::trace::Arg;
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
        let regular = |batch: &NestedTensor| {
            let layout = batch.lay();
            layout.rank() > 0 && layout.ragged_dims().is_empty()
        };
        if [self, keys, values].into_iter().any(regular) {
            // Batches of equal lengths (a batch of one among them) have no ragged dim:
            // their packed values carry a batch dim. Attend over their rows as a ragged
            // batch, and give the result the queries' structure.
            let attended = self.ragged_leading()?.scaled_dot_product_attention(
                &keys.ragged_leading()?,
                &values.ragged_leading()?,
                causal,
                scale,
            )?;
            if !regular(self) {
                return Ok(attended);
            }
            let width = attended.packed().size().last().copied().unwrap_or(0);
            let layout = self.lay().with_static_size(self.lay().rank() - 1, width)?;
            let packed = attended.packed().f_reshape(layout.packed_shape())?;
            return Ok(NestedTensor::from_parts(packed, layout, self.options()));
        }
        self.check_attention_operands(keys, values)?;
        let (query_offsets, key_offsets) = (self.lay().offsets(), keys.lay().offsets());
        let outputs = (0..self.batch_size())
            .map(|element| {
                let rows = |tensor: &Tensor, offsets: &[i64]| {
                    tensor
                        .f_narrow(0, offsets[element], offsets[element + 1] - offsets[element])?
                        .f_transpose(0, 1)
                };
                let q = rows(self.packed(), query_offsets)?;
                let k = rows(keys.packed(), key_offsets)?;
                let v = rows(values.packed(), key_offsets)?;
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
        let width = values.packed().size()[2];
        let output = if outputs.is_empty() {
            Tensor::f_empty(
                [0, self.packed().size()[1], width],
                (self.kind(), self.device()),
            )?
        } else {
            Tensor::f_cat(&outputs, 0)?
        };
        let args = [Arg::Nested(self), Arg::Nested(keys), Arg::Nested(values)];
        self.with_last_static_width(output, width)?
            .traced(&args, "attention", |ids| Op::Attention {
                q: ids[0],
                k: ids[1],
                v: ids[2],
                causal,
                scale: scale.map(F64),
            })
    }

    /// The queries (`self`), keys and values of an attention: keys and values of one
    /// structure, as many elements as the queries, each `[L_i, heads, head_dim]` with
    /// only the first dim ragged.
    fn check_attention_operands(&self, keys: &NestedTensor, values: &NestedTensor) -> Result<()> {
        if keys.lay().offsets() != values.lay().offsets() {
            return Err(NestedError::StructureMismatch {
                op: "scaled_dot_product_attention (keys vs values)",
                left: keys.lay().element_sizes().to_vec(),
                right: values.lay().element_sizes().to_vec(),
            });
        }
        if keys.batch_size() != self.batch_size() {
            return Err(NestedError::BatchSizeMismatch {
                op: "scaled_dot_product_attention",
                what: "keys",
                expected: self.batch_size(),
                got: keys.batch_size(),
            });
        }
        for (name, nested) in [("queries", self), ("keys", keys), ("values", values)] {
            let layout = nested.lay();
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
        Ok(())
    }
}
