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
                let reduce = Reduce::from_ir(*op, *correction);
                match self.get(*x) {
                    Value::Nested(nested) => Value::from(nested.reduce(reduce, dims, *keepdim)?),
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
