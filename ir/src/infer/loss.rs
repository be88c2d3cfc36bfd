//! Losses.

use super::*;

/// The type of a loss op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::CrossEntropy {
            logits,
            target,
            reduction,
            ..
        } => {
            let logits = ty(*logits);
            last_static(&logits, "cross_entropy")?;
            let rows = with_last(&logits, None);
            let target = ty(*target);
            let per_element = matches!((&logits, &target), (Type::Ragged { batch, .. }, Type::Dense { shape, .. }) if shape.len() == 1 && shape[0] == *batch);
            if target.with_dtype(DType::I64) != rows.with_dtype(DType::I64) && !per_element {
                return Err(format!("targets must be {} (the logits without their class dim) or one per element, got {target}", rows.with_dtype(DType::I64)));
            }
            if target.dtype().is_none_or(|dtype| !dtype.is_integer()) {
                return Err(format!(
                    "targets must be class ids (integers), got {target}"
                ));
            }
            let dtype = float(&logits)?;
            Ok(loss_type(rows.with_dtype(dtype), *reduction))
        }
        Op::MseLoss {
            x,
            target,
            reduction,
        } => {
            let (shape, dtype) = broadcast(&ty(*x), &ty(*target))?;
            Ok(loss_type(shape.with_dtype(dtype), *reduction))
        }
        other => Err(format!("{} is not a loss op", other.name())),
    }
}

fn loss_type(per_position: Type, reduction: LossReduction) -> Type {
    match reduction {
        LossReduction::None => per_position,
        LossReduction::Mean | LossReduction::Sum => {
            Type::dense(per_position.dtype().unwrap_or(DType::F32), [])
        }
    }
}
