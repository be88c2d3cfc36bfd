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
            Op::PairMatmul { a, b } => {
                Value::Nested(self.nested(*a)?.matmul_nested(self.nested(*b)?)?)
            }
            Op::Cdist { a, b, p } => Value::Nested(self.nested(*a)?.cdist(self.nested(*b)?, p.0)?),
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
            _ => self.run_gemm_gradient(op)?,
        })
    }

    /// Runs a gradient op of a product (row contractions, embedding scatters, attention's gradient).
    fn run_gemm_gradient(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::ContractRows { a, b } => {
                let rows = |value: &Value| -> Result<Tensor> {
                    let tensor = match value {
                        Value::Nested(nested) => nested.packed().shallow_clone(),
                        Value::Dense(tensor) => tensor.shallow_clone(),
                        Value::Lengths(_) => {
                            return Err(NestedError::Unsupported {
                                op: "contract_rows",
                                reason: "lengths are not rows".into(),
                            })
                        }
                    };
                    let width = tensor.size().last().copied().unwrap_or(1);
                    Ok(tensor.f_reshape([-1, width])?)
                };
                Value::Dense(rows(self.get(*a))?.f_tr()?.f_mm(&rows(self.get(*b))?)?)
            }
            Op::ScatterRows {
                g,
                ids,
                vocabulary,
                padding_idx,
            } => {
                let flat = |value: &Value| -> Result<Tensor> {
                    Ok(match value {
                        Value::Nested(nested) => nested.packed().shallow_clone(),
                        _ => as_dense(value)?.shallow_clone(),
                    })
                };
                let rows = flat(self.get(*g))?;
                let width = rows.size().last().copied().unwrap_or(1);
                let rows = rows.f_reshape([-1, width])?;
                let ids = flat(self.get(*ids))?.f_reshape([-1])?;
                let table = Tensor::f_zeros([*vocabulary, width], (rows.kind(), rows.device()))?
                    .f_index_add(0, &ids, &rows)?;
                if (0..*vocabulary).contains(padding_idx) {
                    let _ = table.f_get(*padding_idx)?.f_zero_()?;
                }
                Value::Dense(table)
            }
            Op::AttentionGrad {
                q,
                k,
                v,
                g,
                causal,
                scale,
                part,
            } => {
                // Through libtorch's autograd on the eager attention.
                let leaf = |value: ValueId| -> Result<(NestedTensor, Tensor)> {
                    let nested = self.nested(value)?;
                    let values = nested.packed().f_detach()?.f_requires_grad_(true)?;
                    Ok((nested.with_values(values.shallow_clone()), values))
                };
                let ((q, q_values), (k, k_values), (v, v_values)) =
                    (leaf(*q)?, leaf(*k)?, leaf(*v)?);
                let out = q.scaled_dot_product_attention(&k, &v, *causal, scale.map(|s| s.0))?;
                let surrogate = out.packed().f_mul(self.nested(*g)?.packed())?.f_sum(None)?;
                let inputs = match part {
                    AttentionGradPart::Queries => vec![q_values],
                    AttentionGradPart::KeysValues => vec![k_values, v_values],
                    AttentionGradPart::All => vec![q_values, k_values, v_values],
                };
                let gradients = Tensor::f_run_backward(&[surrogate], &inputs, false, false)?;
                match part {
                    AttentionGradPart::Queries => {
                        Value::Nested(q.with_values(gradients[0].shallow_clone()))
                    }
                    _ => {
                        let stacked = Tensor::f_stack(&gradients, 1)?;
                        Value::Nested(k.packed_with_static_tail(&stacked)?)
                    }
                }
            }
            other => return Err(not_in_family(other, "gemm")),
        })
    }
}
