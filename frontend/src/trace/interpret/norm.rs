//! Layer, RMS and batch normalization, softmax.

use super::*;

impl Interpreter<'_> {
    /// Runs a norm op.
    pub(super) fn run_norm(&self, op: &Op, ty: &Type) -> Result<Value> {
        Ok(match op {
            Op::LayerNorm {
                x,
                weight,
                bias,
                dims,
                eps,
            } => {
                let shape = tail_sizes(ty, *dims);
                let weight = weight.map(|w| self.dense(w)).transpose()?;
                let bias = bias.map(|b| self.dense(b)).transpose()?;
                match self.get(*x) {
                    Value::Nested(nested) => {
                        Value::Nested(nested.layer_norm(&shape, weight, bias, eps.0)?)
                    }
                    _ => Value::Dense(self.dense(*x)?.f_layer_norm(
                        shape.as_slice(),
                        weight,
                        bias,
                        eps.0,
                        true,
                    )?),
                }
            }
            Op::NormGrad {
                x,
                g,
                weight,
                eps,
                centered,
                part,
            } => {
                // Over the last dim of the values, in f32 as the row kernel computes.
                let values = |value: ValueId| -> Result<Tensor> {
                    Ok(match self.get(value) {
                        Value::Nested(nested) => nested.packed().shallow_clone(),
                        _ => self.dense(value)?.shallow_clone(),
                    })
                };
                let kind = values(*x)?.kind();
                let x_values = values(*x)?.f_to_kind(Kind::Float)?;
                let mut g_values = values(*g)?.f_to_kind(Kind::Float)?;
                if let Some(weight) = weight {
                    g_values = g_values.f_mul(&self.dense(*weight)?.f_to_kind(Kind::Float)?)?;
                }
                let row_mean = |t: &Tensor| t.f_mean_dim(-1, true, None::<Kind>);
                let deviation = if *centered {
                    x_values.f_sub(&row_mean(&x_values)?)?
                } else {
                    x_values.shallow_clone()
                };
                let variance = row_mean(&deviation.f_square()?)?;
                let rstd = variance.f_add_scalar(eps.0)?.f_rsqrt()?;
                let normalized = deviation.f_mul(&rstd)?;
                let gradient = match part {
                    NormGradPart::Weight => g_values.f_mul(&normalized)?,
                    NormGradPart::Input => {
                        let projection = row_mean(&g_values.f_mul(&normalized)?)?;
                        let mut inner = g_values.f_sub(&normalized.f_mul(&projection)?)?;
                        if *centered {
                            inner = inner.f_sub(&row_mean(&g_values)?)?;
                        }
                        inner.f_mul(&rstd)?
                    }
                }
                .f_to_kind(kind)?;
                match self.get(*x) {
                    Value::Nested(nested) => Value::Nested(nested.with_values(gradient)),
                    _ => Value::Dense(gradient),
                }
            }
            Op::RmsNorm {
                x,
                weight,
                dims,
                eps,
            } => {
                let shape = tail_sizes(ty, *dims);
                let weight = weight.map(|w| self.dense(w)).transpose()?;
                match self.get(*x) {
                    Value::Nested(nested) => {
                        Value::Nested(nested.rms_norm(&shape, weight, Some(eps.0))?)
                    }
                    _ => Value::Dense(self.dense(*x)?.f_rms_norm(
                        shape.as_slice(),
                        weight,
                        Some(eps.0),
                    )?),
                }
            }
            Op::BatchNorm {
                x,
                mean,
                var,
                weight,
                bias,
                channel,
                eps,
            } => {
                let weight = weight.map(|w| self.dense(w)).transpose()?;
                let bias = bias.map(|b| self.dense(b)).transpose()?;
                let (mean, var) = (self.dense(*mean)?, self.dense(*var)?);
                // Normalized by the given statistics: eval mode's arithmetic.
                Value::Nested(self.nested(*x)?.batch_norm(
                    *channel as i64 + 1,
                    Some(mean),
                    Some(var),
                    weight,
                    bias,
                    false,
                    0.0,
                    eps.0,
                )?)
            }
            Op::Softmax { x, axis, log } => match (self.get(*x), log) {
                (Value::Nested(nested), false) => Value::Nested(nested.softmax(*axis)?),
                (Value::Nested(nested), true) => Value::Nested(nested.log_softmax(*axis)?),
                (_, false) => Value::Dense(self.dense(*x)?.f_softmax(*axis, None::<Kind>)?),
                (_, true) => Value::Dense(self.dense(*x)?.f_log_softmax(*axis, None::<Kind>)?),
            },
            Op::Cumulative {
                x,
                axis,
                product,
                reverse,
            } => {
                let nested = self.nested(*x)?;
                let dim = *axis - 1;
                Value::Nested(match (*product, *reverse) {
                    (true, false) => nested.cumprod(dim)?,
                    (false, false) => nested.cumsum(dim)?,
                    (product, true) => {
                        // The element's dim (`axis` counts the batch dim first).
                        let dim = if *axis < 0 { *axis } else { dim };
                        nested.map_elements_eager("reverse scan", true, |element| {
                            let flipped = element.f_flip([dim])?;
                            let scanned = match product {
                                true => flipped.f_cumprod(dim, None::<Kind>)?,
                                false => flipped.f_cumsum(dim, None::<Kind>)?,
                            };
                            Ok(scanned.f_flip([dim])?)
                        })?
                    }
                })
            }
            Op::Sort {
                x,
                axis,
                descending,
                positions,
            } => {
                let (values, indices) = self.nested(*x)?.sort(*axis, *descending)?;
                Value::Nested(if *positions { indices } else { values })
            }
            Op::TopK {
                x,
                axis,
                k,
                largest,
                positions,
                ..
            } => {
                let (values, at) = self.nested(*x)?.topk(*k, *axis, *largest)?;
                Value::Nested(if *positions { at } else { values })
            }
            Op::TopKGrad {
                g,
                x,
                axis,
                k,
                largest,
            } => {
                let (g, x) = (self.nested(*g)?, self.nested(*x)?);
                let from = x.topk(*k, *axis, *largest)?.1;
                // Each top value's gradient back where it came from.
                let positions = crate::ops::Reduced::Nested(from);
                Value::Nested(x.picked_gradient(*axis, &positions, g.values())?)
            }
            Op::Running {
                x,
                axis,
                largest,
                positions,
            } => {
                let x = self.nested(*x)?;
                let (values, at) = match largest {
                    true => x.cummax(*axis)?,
                    false => x.cummin(*axis)?,
                };
                Value::Nested(if *positions { at } else { values })
            }
            Op::RunningGrad {
                g,
                x,
                axis,
                largest,
            } => {
                let (g, x) = (self.nested(*g)?, self.nested(*x)?);
                let seen = match largest {
                    true => x.cummax(*axis)?.1,
                    false => x.cummin(*axis)?.1,
                };
                // Each running value's gradient summed where the value was seen.
                Value::Nested(g.scatter_along(*axis, &seen)?)
            }
            Op::SortGrad {
                g,
                x,
                axis,
                descending,
            } => {
                let (g, x) = (self.nested(*g)?, self.nested(*x)?);
                let positions = x.sort(*axis, *descending)?.1;
                // Each value's gradient back at the position it came from.
                Value::Nested(g.scatter_along(*axis, &positions)?)
            }
            other => return Err(not_in_family(other, "norm")),
        })
    }
}
