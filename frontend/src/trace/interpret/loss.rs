//! Losses.

use super::*;

impl Interpreter<'_> {
    /// Runs a loss op.
    pub(super) fn run_loss(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::CrossEntropy {
                logits,
                target,
                ignore_index,
                smoothing,
                reduction,
            } => match self.get(*logits) {
                Value::Nested(nested) => {
                    let target = match self.get(*target) {
                        Value::Nested(target) => Target::Nested(target),
                        _ => Target::Dense(self.dense(*target)?),
                    };
                    Value::from(nested.cross_entropy(
                        target,
                        *ignore_index,
                        smoothing.0,
                        loss_reduction(*reduction),
                    )?)
                }
                _ => Value::Dense(self.dense(*logits)?.f_cross_entropy_loss(
                    self.dense(*target)?,
                    None::<Tensor>,
                    torch_reduction(*reduction),
                    *ignore_index,
                    smoothing.0,
                )?),
            },
            Op::MseLoss {
                x,
                target,
                reduction,
            } => match self.get(*x) {
                Value::Nested(nested) => Value::from(
                    nested.mse_loss(self.operand(*target)?, loss_reduction(*reduction))?,
                ),
                _ => Value::Dense(
                    self.dense(*x)?
                        .f_mse_loss(self.dense(*target)?, torch_reduction(*reduction))?,
                ),
            },
            other => return Err(not_in_family(other, "loss")),
        })
    }
}
