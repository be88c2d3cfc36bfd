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
                self.picked_gradient(*g, x, *axis, &positions)?
            }
            Op::KthValue {
                x,
                axis,
                k,
                keepdim,
                positions,
            } => {
                let (values, at) = self.nested(*x)?.kthvalue(*k, *axis, *keepdim)?;
                Value::from(if *positions { at } else { values })
            }
            Op::KthGrad { g, x, axis, k } => {
                let x = self.nested(*x)?;
                let positions = x.kthvalue(*k, *axis, true)?.1;
                self.picked_gradient(*g, x, *axis, &positions)?
            }
            other => return Err(not_in_family(other, "reduce")),
        })
    }

    /// The gradient `g` of values picked from `x` along `axis` at `positions`, sent
    /// there.
    fn picked_gradient(
        &self,
        g: ValueId,
        x: &NestedTensor,
        axis: i64,
        positions: &Reduced,
    ) -> Result<Value> {
        let g = match self.get(g) {
            Value::Nested(nested) => nested.values().shallow_clone(),
            _ => self.dense(g)?.shallow_clone(),
        };
        Ok(Value::Nested(x.picked_gradient(axis, positions, &g)?))
    }
}
