//! Decomposition: composite ops rewritten into the primitive ops they are made of, so
//! that lowering and autodiff need no rule of their own for them:
//! - `batch_norm` is `x * scale + shift` with `scale = weight * rsqrt(var + eps)` and
//!   `shift = bias - mean * scale` per channel (libtorch's arithmetic), reshaped to
//!   `[1, .., C, .., 1]` to broadcast over the batch;
//! - `mse_loss` is `mean` / `sum` of `square(x - target)` (or the squares themselves);
//! - training-mode `dropout` is `x * random_mask(x)` (the mask, a value, is read again
//!   by the backward); dropout that keeps every value (eval mode, `p = 0`) is its input;
//! - `var` (and `std`, its square root) over any dims, ragged ones included, is the
//!   `mean` of `square(x - mean(x))`, times `n / (n - correction)` (the count of the
//!   reduced values, per element over ragged dims) before the mean when corrected: NaN
//!   for an empty element, as torch;
//! - a sum, mean, extreme, logsumexp or logical reduction over ragged and static
//!   element dims together is one over the static dims, then one over the ragged ones;
//! - `cross_entropy` (targets of the logits' structure) is `-sum(q * log_softmax(x))`
//!   per row, where `q` is the one-hot target (zero rows for `ignore_index`) smoothed
//!   towards uniform, summed or divided by the number of counted rows, as torch;
//! - an op along an inner static dim (sorts, top k, running extremes, scans, softmax,
//!   k-th values, sums, means, extremes and their positions, logsumexp) is the op
//!   along the last dim of the dim moved last (`inner.rs`).

use nestor_ir::{
    BinaryOp, DType, Graph, LossReduction, Node, Op, ReduceOp, Type, UnaryOp, ValueId, VerifyError,
    F64,
};

use crate::Pass;

mod inner;

/// Rewrites composite ops into primitive ones.
pub struct Decompose;

impl Pass for Decompose {
    fn name(&self) -> &'static str {
        "decompose"
    }

    fn run(&self, graph: &Graph) -> Result<Graph, VerifyError> {
        let mut result = Graph::new(graph.name.clone());
        let mut renamed: Vec<ValueId> = Vec::with_capacity(graph.nodes.len());
        for Node { op, ty } in &graph.nodes {
            let op = op.map_operands(|value| renamed[value.index()]);
            if let Some(value) = inner::along_last(&mut result, &op)? {
                renamed.push(value);
                continue;
            }
            let value = match op {
                Op::MseLoss {
                    x,
                    target,
                    reduction,
                } => {
                    let difference = result.push(Op::Binary {
                        op: BinaryOp::Sub,
                        lhs: x,
                        rhs: target,
                    })?;
                    let square = result.push(Op::Unary {
                        op: UnaryOp::Square,
                        x: difference,
                    })?;
                    let reduce = match reduction {
                        LossReduction::Mean => Some(ReduceOp::Mean),
                        LossReduction::Sum => Some(ReduceOp::Sum),
                        LossReduction::None => None,
                    };
                    match reduce {
                        Some(op) => result.push(Op::Reduce {
                            op,
                            x: square,
                            dims: Vec::new(),
                            keepdim: false,
                            correction: 0,
                        })?,
                        None => square,
                    }
                }
                Op::CrossEntropy {
                    logits,
                    target,
                    ignore_index,
                    smoothing,
                    reduction,
                } if same_rows(&result, logits, target) => cross_entropy(
                    &mut result,
                    (logits, target),
                    ignore_index,
                    smoothing.0,
                    reduction,
                )?,
                Op::BatchNorm {
                    x,
                    mean,
                    var,
                    weight,
                    bias,
                    channel,
                    eps,
                } => batch_norm(&mut result, x, (mean, var), (weight, bias), channel, eps.0)?,
                Op::Reduce {
                    op: reduce @ (ReduceOp::Var | ReduceOp::Std),
                    x,
                    dims,
                    keepdim,
                    correction,
                } => {
                    let var = variance(&mut result, x, &dims, (keepdim, correction))?;
                    if reduce == ReduceOp::Std {
                        result.push(Op::Unary {
                            op: UnaryOp::Sqrt,
                            x: var,
                        })?
                    } else {
                        var
                    }
                }
                Op::Reduce {
                    op,
                    x,
                    ref dims,
                    keepdim,
                    ..
                } => reduce(&mut result, op, x, dims, keepdim)?,
                // Dropout that keeps every value (eval mode, or p = 0) is its input.
                Op::Dropout {
                    x, train: false, ..
                } => x,
                Op::Dropout { x, p, .. } if p.0 == 0.0 => x,
                // Training-mode dropout: a random mask the backward reads again.
                Op::Dropout { x, p, .. } => {
                    let mask = result.push(Op::RandomMask {
                        like: x,
                        p,
                        stream: renamed.len() as i64,
                    })?;
                    result.push(Op::Binary {
                        op: BinaryOp::Mul,
                        lhs: x,
                        rhs: mask,
                    })?
                }
                op if op.declares_type() => {
                    result.add_declared(op, ty.map_values(|value| renamed[value.index()]))?
                }
                op => result.push(op)?,
            };
            renamed.push(value);
        }
        result.outputs = graph
            .outputs
            .iter()
            .map(|output| renamed[output.index()])
            .collect();
        Ok(result)
    }
}

/// Whether `target` has the structure of `logits` without its class dim.
fn same_rows(graph: &Graph, logits: ValueId, target: ValueId) -> bool {
    let rows = |ty: &Type| -> Option<Type> {
        let mut ty = ty.with_dtype(DType::I64);
        match &mut ty {
            Type::Ragged { dims, .. } => {
                dims.pop()?;
            }
            Type::Dense { shape, .. } => {
                shape.pop()?;
            }
            Type::Lengths { .. } => return None,
        }
        Some(ty)
    };
    rows(graph.ty(logits)).as_ref() == Some(&graph.ty(target).with_dtype(DType::I64))
}

/// `cross_entropy` in primitive ops (see the module docs).
fn cross_entropy(
    graph: &mut Graph,
    (logits, target): (ValueId, ValueId),
    ignore: i64,
    smoothing: f64,
    reduction: LossReduction,
) -> Result<ValueId, VerifyError> {
    let ty = graph.ty(logits).clone();
    let dtype = ty.dtype().unwrap_or(DType::F32);
    let classes = match &ty {
        Type::Ragged { dims, .. } => dims.last().and_then(|dim| match dim {
            nestor_ir::ElemDim::Fixed(dim) => dim.as_static(),
            nestor_ir::ElemDim::Ragged(_) => None,
        }),
        Type::Dense { shape, .. } => shape.last().and_then(|dim| dim.as_static()),
        Type::Lengths { .. } => None,
    }
    .unwrap_or(1);
    let constant = |graph: &mut Graph, value: f64| {
        graph.push(Op::Const {
            value: F64(value),
            dtype,
        })
    };
    let reduce = |graph: &mut Graph, x: ValueId, dims: Vec<i64>, keepdim: bool| {
        graph.push(Op::Reduce {
            op: ReduceOp::Sum,
            x,
            dims,
            keepdim,
            correction: 0,
        })
    };
    let binary = |graph: &mut Graph, op: BinaryOp, lhs: ValueId, rhs: ValueId| {
        graph.push(Op::Binary { op, lhs, rhs })
    };
    let log_probabilities = graph.push(Op::Softmax {
        x: logits,
        axis: -1,
        log: true,
    })?;
    let one_hot = graph.push(Op::OneHot {
        ids: target,
        classes,
        ignore,
        dtype,
    })?;
    let weights = if smoothing == 0.0 {
        one_hot
    } else {
        // (1 - s) one_hot + s / C on every counted row.
        let counted = reduce(graph, one_hot, vec![-1], true)?;
        let kept = constant(graph, 1.0 - smoothing)?;
        let spread = constant(graph, smoothing / classes as f64)?;
        let sharp = binary(graph, BinaryOp::Mul, one_hot, kept)?;
        let uniform = binary(graph, BinaryOp::Mul, counted, spread)?;
        binary(graph, BinaryOp::Add, sharp, uniform)?
    };
    // Classes of weight 0 are selected away rather than multiplied by zero: a class
    // whose logit is -inf has log-probability -inf (and 0 * -inf is NaN), where
    // libtorch's loss reads only the target's.
    let product = binary(graph, BinaryOp::Mul, weights, log_probabilities)?;
    let zero = constant(graph, 0.0)?;
    // `x` where `condition` holds, 0 elsewhere.
    let where_else_zero = |graph: &mut Graph, condition: ValueId, x: ValueId| {
        graph.push(Op::Where {
            condition,
            x,
            y: zero,
        })
    };
    let weighed = binary(graph, BinaryOp::Ne, weights, zero)?;
    let weighted = where_else_zero(graph, weighed, product)?;
    let total = reduce(graph, weighted, vec![-1], false)?;
    let negative = graph.push(Op::Unary {
        op: UnaryOp::Neg,
        x: total,
    })?;
    // Ignored rows are selected away rather than weighted by zero, as torch masks them:
    // their gradient is 0 even where the mean divides by zero counted rows.
    let counted = reduce(graph, one_hot, vec![-1], false)?;
    let kept = binary(graph, BinaryOp::Gt, counted, zero)?;
    let per_row = where_else_zero(graph, kept, negative)?;
    match reduction {
        LossReduction::None => Ok(per_row),
        LossReduction::Sum => reduce(graph, per_row, Vec::new(), false),
        LossReduction::Mean => {
            let sum = reduce(graph, per_row, Vec::new(), false)?;
            let count = reduce(graph, one_hot, Vec::new(), false)?;
            binary(graph, BinaryOp::Div, sum, count)
        }
    }
}

/// `batch_norm` in primitive ops (see the module docs).
fn batch_norm(
    graph: &mut Graph,
    x: ValueId,
    (mean, var): (ValueId, ValueId),
    (weight, bias): (Option<ValueId>, Option<ValueId>),
    channel: usize,
    eps: f64,
) -> Result<ValueId, VerifyError> {
    let binary = |graph: &mut Graph, op: BinaryOp, lhs: ValueId, rhs: ValueId| {
        graph.push(Op::Binary { op, lhs, rhs })
    };
    let shape = crate::channel_shape(graph.ty(x), channel).ok_or_else(|| VerifyError {
        value: x,
        op: "batch_norm",
        rule: format!(
            "element dim {channel} of {} is no static channel dim",
            graph.ty(x)
        ),
    })?;
    let spread = |graph: &mut Graph, value: ValueId| {
        graph.push(Op::Reshape {
            x: value,
            shape: shape.clone(),
        })
    };
    // Per channel, as libtorch: scale = weight / sqrt(var + eps), shift = bias - mean *
    // scale; then one pass over the batch.
    let eps = graph.push(Op::Const {
        value: F64(eps),
        dtype: graph.ty(var).dtype().unwrap_or(DType::F32),
    })?;
    let shifted = binary(graph, BinaryOp::Add, var, eps)?;
    let mut scale = graph.push(Op::Unary {
        op: UnaryOp::Rsqrt,
        x: shifted,
    })?;
    if let Some(weight) = weight {
        scale = binary(graph, BinaryOp::Mul, scale, weight)?;
    }
    let moved = binary(graph, BinaryOp::Mul, mean, scale)?;
    let shift = match bias {
        Some(bias) => binary(graph, BinaryOp::Sub, bias, moved)?,
        None => graph.push(Op::Unary {
            op: UnaryOp::Neg,
            x: moved,
        })?,
    };
    let (scale, shift) = (spread(graph, scale)?, spread(graph, shift)?);
    let scaled = binary(graph, BinaryOp::Mul, x, scale)?;
    let y = binary(graph, BinaryOp::Add, scaled, shift)?;
    // Statistics or parameters in a wider type (f32 for a bf16 batch) widen the
    // arithmetic; the result has the batch's type, as libtorch's.
    match (graph.ty(x).dtype(), graph.ty(y).dtype()) {
        (Some(dtype), Some(wider)) if dtype != wider => graph.push(Op::Cast { x: y, dtype }),
        _ => Ok(y),
    }
}

/// A reduction `op` of `x` over batch-first `dims` as lowering takes it: over ragged and
/// static dims together, one over the static dims then one over the ragged ones; over
/// several static dims, one over each (or one over the last dims merged); over one
/// inner static dim, along the last with that dim moved last (`inner.rs`).
fn reduce(
    graph: &mut Graph,
    op: ReduceOp,
    x: ValueId,
    dims: &[i64],
    keepdim: bool,
) -> Result<ValueId, VerifyError> {
    if let Some(places) = several_static_dims(graph, op, x, dims) {
        return static_reduction(graph, op, x, places, keepdim);
    }
    let Some((static_dims, ragged_dims)) = split_reduction(graph, op, x, dims) else {
        return lowered_reduction(graph, op, x, dims.to_vec(), keepdim);
    };
    let inner = reduce(graph, op, x, &static_dims, keepdim)?;
    // Without keepdim the static dims before a ragged one are gone.
    let before = |dim: i64| static_dims.iter().filter(|&&s| s < dim).count() as i64;
    let shifted = ragged_dims
        .iter()
        .map(|&dim| if keepdim { dim } else { dim - before(dim) })
        .collect();
    lowered_reduction(graph, op, inner, shifted, keepdim)
}

/// A reduction as lowering takes it: along the last dim when over one inner static dim.
fn lowered_reduction(
    graph: &mut Graph,
    op: ReduceOp,
    x: ValueId,
    dims: Vec<i64>,
    keepdim: bool,
) -> Result<ValueId, VerifyError> {
    let reduction = Op::Reduce {
        op,
        x,
        dims,
        keepdim,
        correction: 0,
    };
    match inner::along_last(graph, &reduction)? {
        Some(value) => Ok(value),
        None => graph.push(reduction),
    }
}

/// Where a composable reduction `op` of `x` over batch-first `dims` reduces two or more
/// static dims and nothing else: the ragged dims' count, the static tail (after every
/// ragged dim) and the reduced places in it, in order. `None` for any other.
fn several_static_dims(
    graph: &Graph,
    op: ReduceOp,
    x: ValueId,
    dims: &[i64],
) -> Option<(usize, Vec<i64>, Vec<usize>)> {
    let composes = matches!(
        op,
        ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Amax | ReduceOp::Amin | ReduceOp::LogSumExp
    );
    let (ragged, tail) = inner::static_tail(graph.ty(x))?;
    let rank = (ragged + tail.len() + 1) as i64;
    let places: Option<Vec<usize>> = normalized_dims(dims, rank)
        .iter()
        .map(|&dim| usize::try_from(dim - 1).ok()?.checked_sub(ragged))
        .collect();
    match (composes, places) {
        (true, Some(places)) if places.len() >= 2 && places.iter().all(|&p| p < tail.len()) => {
            Some((ragged, tail, places))
        }
        _ => None,
    }
}

/// Batch-first `dims` of a value of `rank` dims counted from the front, in order, each
/// once.
pub(crate) fn normalized_dims(dims: &[i64], rank: i64) -> Vec<i64> {
    let mut normalized: Vec<i64> = dims
        .iter()
        .map(|&dim| if dim < 0 { dim + rank } else { dim })
        .collect();
    normalized.sort_unstable();
    normalized.dedup();
    normalized
}

/// The reduction `op` of `x`, of `ragged` leading ragged dims and
/// static `tail`, over the static `places`: each reduced dim moved last (the last
/// first), then one reduction over them merged into one dim (so that an extreme's
/// gradient is shared among every tie, as one reduction shares it), then the reduced
/// dims dropped (or kept, of size 1) through a view.
fn static_reduction(
    graph: &mut Graph,
    op: ReduceOp,
    x: ValueId,
    (ragged, tail, places): (usize, Vec<i64>, Vec<usize>),
    keepdim: bool,
) -> Result<ValueId, VerifyError> {
    let kept = tail.len() - places.len();
    let (mut moved, mut order) = (x, tail.clone());
    for &place in places.iter().rev() {
        if place + 1 < order.len() {
            let (before, after) = (&order[..place], &order[place + 1..]);
            moved = inner::move_last(graph, moved, (before, order[place], after))?;
            let size = order.remove(place);
            order.push(size);
        }
    }
    let merged: i64 = order[kept..].iter().product();
    let merged_tail = [&order[..kept], &[merged]].concat();
    let merged = graph.push(Op::ReshapeTail {
        x: moved,
        tail: merged_tail,
    })?;
    let reduced = lowered_reduction(graph, op, merged, vec![(ragged + kept + 1) as i64], true)?;
    let tail = tail
        .iter()
        .enumerate()
        .filter_map(|(place, &size)| match places.contains(&place) {
            true => keepdim.then_some(1),
            false => Some(size),
        })
        .collect();
    graph.push(Op::ReshapeTail { x: reduced, tail })
}

/// A reduction `op` of `x` over batch-first `dims` that mixes ragged and static element
/// dims (not the batch), split into its static dims and its ragged ones (in order):
/// lowering reduces either kind alone, and these reductions compose (a sum of sums, a
/// mean of means over equal counts, an extreme of extremes). `None` for any other.
fn split_reduction(
    graph: &Graph,
    op: ReduceOp,
    x: ValueId,
    dims: &[i64],
) -> Option<(Vec<i64>, Vec<i64>)> {
    let composes = matches!(
        op,
        ReduceOp::Sum
            | ReduceOp::Mean
            | ReduceOp::Amax
            | ReduceOp::Amin
            | ReduceOp::LogSumExp
            | ReduceOp::All
            | ReduceOp::Any
    );
    let Type::Ragged { dims: element, .. } = graph.ty(x) else {
        return None;
    };
    let rank = element.len() as i64 + 1;
    let normalized = normalized_dims(dims, rank);
    if !composes || normalized.is_empty() || normalized.iter().any(|&dim| dim < 1 || dim >= rank) {
        return None;
    }
    let ragged = |dim: &i64| matches!(element[(*dim - 1) as usize], nestor_ir::ElemDim::Ragged(_));
    let (ragged_dims, static_dims): (Vec<i64>, Vec<i64>) = normalized.into_iter().partition(ragged);
    (!ragged_dims.is_empty() && !static_dims.is_empty()).then_some((static_dims, ragged_dims))
}

/// `var(x)` over batch-first `dims` (all of them when empty) with a Bessel
/// `correction`, in primitive ops (see the module docs).
fn variance(
    graph: &mut Graph,
    x: ValueId,
    dims: &[i64],
    (keepdim, correction): (bool, i64),
) -> Result<ValueId, VerifyError> {
    let rank = crate::count::rank(graph.ty(x)) as i64;
    let all: Vec<i64> = if dims.is_empty() {
        (0..rank).collect()
    } else {
        dims.iter()
            .map(|&dim| if dim < 0 { dim + rank } else { dim })
            .collect()
    };
    let mean = |graph: &mut Graph, x: ValueId, keepdim: bool| {
        reduce(graph, ReduceOp::Mean, x, dims, keepdim)
    };
    let center = mean(graph, x, true)?;
    let centered = graph.push(Op::Binary {
        op: BinaryOp::Sub,
        lhs: x,
        rhs: center,
    })?;
    let square = graph.push(Op::Unary {
        op: UnaryOp::Square,
        x: centered,
    })?;
    if correction == 0 {
        return mean(graph, square, keepdim);
    }
    let count = crate::count::count(graph, x, &all).map_err(|error| match error {
        crate::count::CountError::Verify(error) => error,
        crate::count::CountError::Unsupported(rule) => VerifyError {
            value: x,
            op: "var",
            rule,
        },
    })?;
    let dtype = graph.ty(count).dtype().unwrap_or(DType::F32);
    let correction = graph.push(Op::Const {
        value: F64(correction as f64),
        dtype,
    })?;
    let degrees = graph.push(Op::Binary {
        op: BinaryOp::Sub,
        lhs: count,
        rhs: correction,
    })?;
    let ratio = graph.push(Op::Binary {
        op: BinaryOp::Div,
        lhs: count,
        rhs: degrees,
    })?;
    let scaled = graph.push(Op::Binary {
        op: BinaryOp::Mul,
        lhs: square,
        rhs: ratio,
    })?;
    mean(graph, scaled, keepdim)
}
