//! Reductions.

use super::*;

impl Interpreter<'_> {
    /// Runs a reduce op.
    pub(super) fn run_reduce(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::Reduce {
                op,
                x,
                dims,
                keepdim,
                correction,
            } => {
                match (
                    self.get(*x),
                    Reduce::from_ir(*op, *correction),
                    dims.as_slice(),
                ) {
                    (Value::Nested(nested), Some(reduce), _) => {
                        Value::from(nested.reduce(reduce, dims, *keepdim)?)
                    }
                    (Value::Nested(nested), None, &[dim]) => Value::from(match op {
                        ReduceOp::Argmax => nested.argmax(dim, *keepdim)?,
                        ReduceOp::Argmin => nested.argmin(dim, *keepdim)?,
                        ReduceOp::Max => nested.max_dim(dim, *keepdim)?.0,
                        _ => nested.min_dim(dim, *keepdim)?.0,
                    }),
                    _ => Value::Dense(reduce_dense(
                        self.dense(*x)?,
                        *op,
                        dims,
                        *keepdim,
                        *correction,
                    )?),
                }
            }
            Op::ExtremeGrad {
                g,
                x,
                axis,
                largest,
            } => {
                let x = self.nested(*x)?;
                let positions = match largest {
                    true => x.argmax(*axis, true)?,
                    false => x.argmin(*axis, true)?,
                };
                let g = match self.get(*g) {
                    Value::Nested(nested) => nested.values().shallow_clone(),
                    _ => self.dense(*g)?.shallow_clone(),
                };
                Value::Nested(x.extreme_gradient(*axis, &positions, &g)?)
            }
            other => return Err(not_in_family(other, "reduce")),
        })
    }
}
