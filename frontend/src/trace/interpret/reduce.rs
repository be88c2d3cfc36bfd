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
                        _ => nested.argmin(dim, *keepdim)?,
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
            other => return Err(not_in_family(other, "reduce")),
        })
    }
}
