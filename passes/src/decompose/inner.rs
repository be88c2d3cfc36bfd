//! Ops along an inner static dim of a batch (one of its static dims, not the last),
//! which kernels run only along the last dim or down the ragged one: the op along the
//! last dim of the batch with that dim moved last. Moving a dim last is one transpose
//! of it with the dims after it (seen as one dim through `reshape_tail` views); a
//! reduction's result needs no move back (its kept dim of size 1 goes anywhere
//! through a view), any other result moves back the same way (positions too: a move
//! of i64 values).

use nestor_ir::{ElemDim, Graph, Op, ReduceOp, Type, ValueId, VerifyError};

/// `op` along an inner static dim written as the op along the last, or `None` when it
/// is not such an op (or its batch has a static dim before a ragged one).
pub(super) fn along_last(graph: &mut Graph, op: &Op) -> Result<Option<ValueId>, VerifyError> {
    let Some((x, axis, kept)) = along_one_dim(op) else {
        return Ok(None);
    };
    let Some((ragged, tail)) = static_tail(graph.ty(x)) else {
        return Ok(None);
    };
    let rank = ragged + tail.len();
    let normalized = if axis < 0 {
        axis + rank as i64 + 1
    } else {
        axis
    };
    let Some(at) = usize::try_from(normalized - 1)
        .ok()
        .filter(|&at| at >= ragged && at + 1 < rank)
    else {
        return Ok(None);
    };
    // The static tail: `before`, the dim itself, `after`.
    let place = at - ragged;
    let (before, after) = (&tail[..place], &tail[place + 1..]);
    let moved_last = move_last(graph, x, (before, tail[place], after))?;
    let along = graph.push(moved(op, moved_last, rank as i64))?;
    match kept {
        // Reduced away: the other dims are in order.
        Some(false) => Ok(Some(along)),
        // Kept (size 1): in its place through a view.
        Some(true) => {
            let tail = [before, &[1], after].concat();
            graph.push(Op::ReshapeTail { x: along, tail }).map(Some)
        }
        // As many as before (or `k`): moved back.
        None => {
            let size = static_tail(graph.ty(along))
                .and_then(|(_, tail)| tail.last().copied())
                .unwrap_or(1);
            move_back(graph, along, (before, size, after)).map(Some)
        }
    }
}

/// `x`, a batch of static tail `[before, size, after]`, as `[before, after, size]`.
pub(super) fn move_last(
    graph: &mut Graph,
    x: ValueId,
    (before, size, after): (&[i64], i64, &[i64]),
) -> Result<ValueId, VerifyError> {
    swap_runs(graph, x, (before, &[size], after))
}

/// `x`, a batch of static tail `[before, after, size]`, as `[before, size, after]`.
fn move_back(
    graph: &mut Graph,
    x: ValueId,
    (before, size, after): (&[i64], i64, &[i64]),
) -> Result<ValueId, VerifyError> {
    swap_runs(graph, x, (before, after, &[size]))
}

/// `x`, a batch of static tail `[before, first, second]` (`first` and `second` runs
/// of dims), as `[before, second, first]`: one transpose of the two runs, each seen
/// as one dim.
fn swap_runs(
    graph: &mut Graph,
    x: ValueId,
    (before, first, second): (&[i64], &[i64], &[i64]),
) -> Result<ValueId, VerifyError> {
    let merged = graph.push(Op::ReshapeTail {
        x,
        tail: [before, &[first.iter().product(), second.iter().product()]].concat(),
    })?;
    let at = ragged_dims(graph, x) + before.len();
    let swapped = graph.push(Op::TransposeStatic {
        x: merged,
        dim0: at,
        dim1: at + 1,
    })?;
    graph.push(Op::ReshapeTail {
        x: swapped,
        tail: [before, second, first].concat(),
    })
}

/// The count of a batch's leading ragged dims and the sizes of its static dims after
/// them; `None` for another type or a ragged dim after a static one.
pub(super) fn static_tail(ty: &Type) -> Option<(usize, Vec<i64>)> {
    let Type::Ragged { dims, .. } = ty else {
        return None;
    };
    let ragged = dims
        .iter()
        .take_while(|dim| matches!(dim, ElemDim::Ragged(_)))
        .count();
    let tail = dims[ragged..]
        .iter()
        .map(|dim| match dim {
            ElemDim::Fixed(dim) => dim.as_static(),
            ElemDim::Ragged(_) => None,
        })
        .collect::<Option<Vec<i64>>>()?;
    Some((ragged, tail))
}

/// The count of `x`'s leading ragged dims.
fn ragged_dims(graph: &Graph, x: ValueId) -> usize {
    match graph.ty(x) {
        Type::Ragged { dims, .. } => dims
            .iter()
            .take_while(|dim| matches!(dim, ElemDim::Ragged(_)))
            .count(),
        _ => 0,
    }
}

/// The operand, the batch-first dim and (for a reduction) whether the dim is kept, of
/// an op along one element dim whose kernels run only along the last dim or down the
/// ragged one.
fn along_one_dim(op: &Op) -> Option<(ValueId, i64, Option<bool>)> {
    match *op {
        Op::Sort { x, axis, .. }
        | Op::Running { x, axis, .. }
        | Op::TopK {
            x,
            lengths: None,
            axis,
            ..
        }
        | Op::Cumulative { x, axis, .. }
        | Op::Softmax { x, axis, .. } => Some((x, axis, None)),
        Op::KthValue {
            x, axis, keepdim, ..
        } => Some((x, axis, Some(keepdim))),
        Op::Reduce {
            op:
                ReduceOp::Sum
                | ReduceOp::Mean
                | ReduceOp::Amax
                | ReduceOp::Amin
                | ReduceOp::Max
                | ReduceOp::Min
                | ReduceOp::Argmax
                | ReduceOp::Argmin
                | ReduceOp::LogSumExp,
            x,
            ref dims,
            keepdim,
            ..
        } => match dims[..] {
            [dim] => Some((x, dim, Some(keepdim))),
            _ => None,
        },
        _ => None,
    }
}

/// `op` of operand `x` along the batch-first dim `axis`, a reduced dim dropped.
fn moved(op: &Op, x: ValueId, axis: i64) -> Op {
    let mut op = op.clone();
    match &mut op {
        Op::Sort {
            x: operand,
            axis: dim,
            ..
        }
        | Op::Running {
            x: operand,
            axis: dim,
            ..
        }
        | Op::Cumulative {
            x: operand,
            axis: dim,
            ..
        }
        | Op::Softmax {
            x: operand,
            axis: dim,
            ..
        }
        | Op::TopK {
            x: operand,
            axis: dim,
            ..
        } => (*operand, *dim) = (x, axis),
        Op::KthValue {
            x: operand,
            axis: dim,
            keepdim,
            ..
        } => (*operand, *dim, *keepdim) = (x, axis, false),
        Op::Reduce {
            x: operand,
            dims,
            keepdim,
            ..
        } => (*operand, *dims, *keepdim) = (x, vec![axis], false),
        _ => {}
    }
    op
}
