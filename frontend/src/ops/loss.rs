//! Losses on the packed values: only real positions count, whatever the padding.

use tch::{Kind, Reduction, Tensor};

use nestor_ir::{LossReduction as IrLoss, Op, ValueId, F64};

use super::{Operand, Reduced};
use crate::trace::{trace_error, Arg, Dense};
use crate::{NestedError, NestedTensor, Result};

/// How a loss is reduced over the real positions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LossReduction {
    /// The mean over real positions (for cross entropy: over non-ignored targets).
    #[default]
    Mean,
    /// The sum over real positions.
    Sum,
    /// No reduction: one loss per position, in the structure of the input.
    None,
}

/// Targets of a loss over a NestedTensor.
pub enum Target<'a> {
    /// Targets of the same structure as the predictions (class indices for cross
    /// entropy: the predictions without their last dim).
    Nested(&'a NestedTensor),
    /// One target per element (`[B]` or `[B, ...]`), shared by every position of it, or
    /// a dense tensor of the padded shape (packed first).
    Dense(&'a Tensor),
    /// One target per element, as a [`Dense`] handle (an input of a trace).
    Handle(&'a Dense),
}

impl<'a> From<&'a NestedTensor> for Target<'a> {
    fn from(target: &'a NestedTensor) -> Self {
        Target::Nested(target)
    }
}
impl<'a> From<&'a Dense> for Target<'a> {
    fn from(target: &'a Dense) -> Self {
        Target::Handle(target)
    }
}
impl<'a> From<&'a Tensor> for Target<'a> {
    fn from(target: &'a Tensor) -> Self {
        Target::Dense(target)
    }
}

impl NestedTensor {
    /// Cross entropy of logits `[*s_i, classes]` (last dim static) against class-index
    /// targets `[*s_i]`, with torch's `ignore_index` and `label_smoothing`.
    pub fn cross_entropy<'a>(
        &self,
        target: impl Into<Target<'a>>,
        ignore_index: i64,
        label_smoothing: f64,
        reduction: LossReduction,
    ) -> Result<Reduced> {
        let target = target.into();
        let result = self.cross_entropy_eager(&target, ignore_index, label_smoothing, reduction)?;
        if self.trace.is_none() {
            return Ok(result);
        }
        let target_arg = match &target {
            Target::Nested(target) => Arg::Nested(target),
            Target::Handle(target) => Arg::Dense(target.raw(), target.trace.as_ref()),
            Target::Dense(_) => {
                return Err(trace_error(
                    "cross_entropy",
                    "dense targets of a traced loss must be a Dense input of the trace (Target::Handle)".into(),
                ))
            }
        };
        let ir = match reduction {
            LossReduction::Mean => IrLoss::Mean,
            LossReduction::Sum => IrLoss::Sum,
            LossReduction::None => IrLoss::None,
        };
        let args = [Arg::Nested(self), target_arg];
        let build = |ids: &[ValueId]| Op::CrossEntropy {
            logits: ids[0],
            target: ids[1],
            ignore_index,
            smoothing: F64(label_smoothing),
            reduction: ir,
        };
        Ok(match result {
            Reduced::Nested(nested) => {
                Reduced::Nested(nested.traced(&args, "cross_entropy", build)?)
            }
            Reduced::Dense(dense) => Reduced::Dense(Dense::traced(
                dense.raw().shallow_clone(),
                &args,
                "cross_entropy",
                build,
            )?),
        })
    }

    fn cross_entropy_eager(
        &self,
        target: &Target<'_>,
        ignore_index: i64,
        label_smoothing: f64,
        reduction: LossReduction,
    ) -> Result<Reduced> {
        let classes = self.last_static_width("cross_entropy")?;
        let logits = self.packed().f_reshape([-1, classes])?;
        let rows_layout = self.lay().without_dim(self.lay().rank() - 1)?;
        let target = match target {
            Target::Nested(target) => {
                if *target.lay() != rows_layout {
                    return Err(NestedError::StructureMismatch {
                        op: "cross_entropy",
                        left: rows_layout.element_sizes().to_vec(),
                        right: target.lay().element_sizes().to_vec(),
                    });
                }
                target.packed().shallow_clone()
            }
            Target::Dense(dense) => self.per_row_target(&rows_layout, dense)?,
            Target::Handle(handle) => self.per_row_target(&rows_layout, handle.raw())?,
        };
        let target = target.f_reshape([-1])?.f_to_kind(Kind::Int64)?;
        let per_position = logits.f_cross_entropy_loss(
            &target,
            None::<Tensor>,
            Reduction::None,
            ignore_index,
            label_smoothing,
        )?;
        let counted = target.f_ne(ignore_index)?;
        let reduced = match reduction {
            LossReduction::Mean => per_position
                .f_sum(None::<Kind>)?
                .f_div(&counted.f_sum(per_position.kind())?)?,
            LossReduction::Sum => per_position.f_sum(None::<Kind>)?,
            LossReduction::None => {
                let values = per_position.f_reshape(rows_layout.packed_shape())?;
                let nested = NestedTensor::from_parts(values, rows_layout, self.options());
                return Ok(if nested.lay().ragged_dims().is_empty() {
                    Reduced::Dense(Dense::from(nested.packed().shallow_clone()))
                } else {
                    Reduced::Nested(nested)
                });
            }
        };
        Ok(Reduced::Dense(Dense::from(reduced)))
    }

    /// Mean squared error against a target operand (NestedTensor of the same structure,
    /// per-element dense `[B, ...]`, dense tail or scalar).
    pub fn mse_loss<'a>(
        &self,
        target: impl Into<Operand<'a>>,
        reduction: LossReduction,
    ) -> Result<Reduced> {
        let difference = self.sub(target)?;
        difference.square()?.reduce_loss(reduction)
    }

    /// Mean absolute error against a target operand.
    pub fn l1_loss<'a>(
        &self,
        target: impl Into<Operand<'a>>,
        reduction: LossReduction,
    ) -> Result<Reduced> {
        self.sub(target)?.abs()?.reduce_loss(reduction)
    }

    /// Binary cross entropy of logits against probabilities (a target operand),
    /// computed stably: `max(x, 0) - x * y + log(1 + e^(-|x|))`.
    pub fn binary_cross_entropy_with_logits<'a>(
        &self,
        target: impl Into<Operand<'a>>,
        reduction: LossReduction,
    ) -> Result<Reduced> {
        let target = target.into();
        if self.trace.is_some() {
            // Traced: the same formula in recorded primitives (so it compiles and has
            // gradients), `max(x, 0) - x * y + log(1 + e^(-|x|))`.
            let softplus = (&self.abs()?.neg()?.exp()? + 1.0)?.log()?;
            let linear = (&self.relu()? - &self.mul(target)?)?;
            return (&linear + &softplus)?.reduce_loss(reduction);
        }
        let target = self.align(&target, "binary_cross_entropy_with_logits")?;
        let logits = self.packed();
        let target = target.f_expand_as(logits)?.f_to_kind(logits.kind())?;
        let losses = logits.f_binary_cross_entropy_with_logits(
            &target,
            None::<Tensor>,
            None::<Tensor>,
            Reduction::None,
        )?;
        self.with_values(losses).reduce_loss(reduction)
    }

    /// Dense targets lined up with the rows of `rows_layout` (the logits without their
    /// class dim).
    fn per_row_target(
        &self,
        rows_layout: &nestor_layout::RaggedLayout,
        dense: &Tensor,
    ) -> Result<Tensor> {
        let rows = NestedTensor::from_parts(
            Tensor::f_empty(rows_layout.packed_shape(), (Kind::Int64, self.device()))?,
            rows_layout.clone(),
            self.options(),
        );
        rows.align_target(dense, "cross_entropy")
    }

    fn reduce_loss(&self, reduction: LossReduction) -> Result<Reduced> {
        match reduction {
            LossReduction::Mean => self.mean(&[], false),
            LossReduction::Sum => self.sum(&[], false),
            LossReduction::None => Ok(Reduced::Nested(self.shallow_clone())),
        }
    }

    /// Dense targets for the packed rows of `self`: per element (`[B]`, `[B, ...]`) or
    /// of the padded shape.
    fn align_target(&self, target: &Tensor, op: &'static str) -> Result<Tensor> {
        let shape = target.size();
        if shape == self.padded_shape() && self.lay().rank() > 0 {
            return self.align(&Operand::Dense(target), op);
        }
        if shape.first() == Some(&(self.batch_size() as i64)) {
            let per_row = self.broadcast_per_element(target)?;
            return Ok(per_row);
        }
        Err(NestedError::DenseOperand {
            op,
            shape,
            reason: format!(
                "(expected one target per element, [{}], or the padded shape {:?})",
                self.batch_size(),
                self.padded_shape()
            ),
        })
    }
}
