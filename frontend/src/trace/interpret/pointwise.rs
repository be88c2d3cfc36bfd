//! Pointwise ops: constants, unary and binary functions, `where`, casts, dropout, fused expressions.

use super::*;

impl Interpreter<'_> {
    /// Runs a pointwise op.
    pub(super) fn run_pointwise(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::Const { value, dtype } => Value::Dense(
                Tensor::f_scalar_tensor(value.0, (Kind::Double, tch::Device::Cpu))?
                    .f_to_kind(kind_of(*dtype))?,
            ),
            Op::Unary { op, x } => unary_value(*op, self.get(*x))?,
            Op::Binary { op, lhs, rhs } => binary_value(*op, self.get(*lhs), self.get(*rhs))?,
            Op::Where { condition, x, y } => {
                where_value(self.get(*condition), self.get(*x), self.get(*y))?
            }
            Op::Cast { x, dtype } => cast_value(*dtype, self.get(*x))?,
            Op::Expand { x, like, dims } => expand_value(self.get(*x), self.get(*like), dims)?,
            Op::Fused { inputs, expr } => {
                let inputs: Vec<&Value> = inputs.iter().map(|&input| self.get(input)).collect();
                fused_value(expr, &inputs)?
            }
            Op::Clamp { x, min, max } => match self.get(*x) {
                Value::Nested(nested) => Value::Nested(nested.clamp(Some(min.0), Some(max.0))?),
                _ => Value::Dense(self.dense(*x)?.f_clamp_min(min.0)?.f_clamp_max(max.0)?),
            },
            Op::Dropout { x, p, train } => match self.get(*x) {
                Value::Nested(nested) => Value::Nested(nested.dropout(p.0, *train)?),
                _ => Value::Dense(self.dense(*x)?.f_dropout(p.0, *train)?),
            },
            Op::RandomMask { like, p, .. } => {
                // libtorch's generator: the same distribution as compiled masks, not the
                // same draws.
                let mask = |like: &Tensor| -> Result<Tensor> {
                    Ok(like
                        .f_ones_like()?
                        .f_bernoulli_float_(1.0 - p.0)?
                        .f_div_scalar(1.0 - p.0)?)
                };
                match self.get(*like) {
                    Value::Nested(nested) => {
                        Value::Nested(nested.with_values(mask(nested.packed())?))
                    }
                    _ => Value::Dense(mask(self.dense(*like)?)?),
                }
            }
            other => return Err(not_in_family(other, "pointwise")),
        })
    }
}

/// `x` with size-1 dims inserted at `dims` (batch-first dims of `like`), broadcast to
/// the shape of `like`.
fn expand_value(x: &Value, like: &Value, dims: &[i64]) -> Result<Value> {
    let mismatch = |reason: String| NestedError::Unsupported {
        op: "expand",
        reason,
    };
    let rank = match like {
        Value::Nested(nested) => nested.lay().rank() + 1,
        Value::Dense(tensor) => tensor.dim(),
        Value::Lengths(_) => return Err(mismatch("cannot expand to lengths".into())),
    } as i64;
    let mut positions: Vec<i64> = dims
        .iter()
        .map(|&dim| if dim < 0 { dim + rank } else { dim })
        .collect();
    positions.sort_unstable();
    match (x, like) {
        (Value::Dense(tensor), Value::Dense(target)) => {
            let inserted = unsqueezed(tensor, &positions)?;
            Ok(Value::Dense(
                inserted.f_expand(target.size(), false)?.f_contiguous()?,
            ))
        }
        (Value::Dense(tensor), Value::Nested(target)) => {
            let inserted = unsqueezed(tensor, &positions)?;
            let aligned = target.align(&Operand::Dense(&inserted), "expand")?;
            let values = aligned
                .f_expand(target.packed().size(), false)?
                .f_contiguous()?;
            Ok(Value::Nested(target.with_values(values)))
        }
        (Value::Nested(nested), Value::Nested(target)) => {
            // An inserted element dim is static: it sits after the packed rows, among the
            // static dims of the target that come before it.
            let layout = target.lay();
            let packed: Vec<i64> = positions
                .iter()
                .map(|&position| {
                    let before = (0..(position - 1).max(0) as usize)
                        .filter(|&dim| !layout.is_ragged(dim))
                        .count();
                    1 + before as i64
                })
                .collect();
            let inserted = unsqueezed(nested.packed(), &packed)?;
            let values = inserted
                .f_expand(target.packed().size(), false)?
                .f_contiguous()?;
            Ok(Value::Nested(target.with_values(values)))
        }
        (x, _) => Err(mismatch(format!(
            "cannot expand {} to {}",
            x.describe(),
            like.describe()
        ))),
    }
}

/// `tensor` with size-1 dims at `positions` (ascending, final numbering).
fn unsqueezed(tensor: &Tensor, positions: &[i64]) -> Result<Tensor> {
    positions
        .iter()
        .try_fold(tensor.shallow_clone(), |tensor, &position| {
            Ok(tensor.f_unsqueeze(position)?)
        })
}
