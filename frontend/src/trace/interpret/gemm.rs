//! Linear, matmul, embedding and varlen attention, on the eager packed operators.

use super::*;

impl Interpreter<'_> {
    /// Runs a gemm op.
    pub(super) fn run_gemm(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::Linear { x, weight, bias } => {
                let bias = bias.map(|bias| self.dense(bias)).transpose()?;
                match self.get(*x) {
                    Value::Nested(nested) => {
                        Value::Nested(nested.linear(self.dense(*weight)?, bias)?)
                    }
                    _ => Value::Dense(self.dense(*x)?.f_linear(self.dense(*weight)?, bias)?),
                }
            }
            Op::Matmul { x, w } => match self.get(*x) {
                Value::Nested(nested) => Value::Nested(nested.matmul(self.dense(*w)?)?),
                _ => Value::Dense(self.dense(*x)?.f_matmul(self.dense(*w)?)?),
            },
            Op::Embedding {
                ids,
                weight,
                padding_idx,
            } => Value::Nested(
                self.nested(*ids)?
                    .embedding(self.dense(*weight)?, *padding_idx)?,
            ),
            Op::Attention {
                q,
                k,
                v,
                causal,
                scale,
            } => Value::Nested(self.nested(*q)?.scaled_dot_product_attention(
                self.nested(*k)?,
                self.nested(*v)?,
                *causal,
                scale.map(|scale| scale.0),
            )?),
            other => return Err(not_in_family(other, "gemm")),
        })
    }
}
