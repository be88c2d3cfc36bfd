//! How many values a reduction combines, as a graph value (what autodiff's rule for
//! `mean` divides by), and the batch statistics of batch normalization, which traced
//! models record and the running statistics are updated from.

use nestor_ir::{
    BinaryOp, DType, Dim, ElemDim, Graph, Op, ReduceOp, Type, UnaryOp, ValueId, VerifyError, F64,
};

/// Why a count cannot be written.
#[derive(Debug)]
pub(crate) enum CountError {
    /// The graph rejected an op of the count.
    Verify(VerifyError),
    /// The reduction's count is not expressible (a symbolic static dim, a batch with
    /// no lengths in the graph).
    Unsupported(String),
}

impl From<VerifyError> for CountError {
    fn from(error: VerifyError) -> Self {
        CountError::Verify(error)
    }
}

/// The number of batch-first dims of a value of type `ty`.
pub(crate) fn rank(ty: &Type) -> usize {
    match ty {
        Type::Ragged { dims, .. } => dims.len() + 1,
        Type::Dense { shape, .. } => shape.len(),
        Type::Lengths { .. } => 1,
    }
}

/// A lengths value of `graph` whose batch is `batch`.
pub(crate) fn lengths_of_batch(graph: &Graph, batch: &Dim) -> Option<ValueId> {
    graph
        .nodes
        .iter()
        .position(|node| matches!(&node.ty, Type::Lengths { batch: own } if own == batch))
        .map(|index| ValueId(index as u32))
}

/// How many values of `x` a reduction over batch-first `dims` (normalized, not empty)
/// combines, in `x`'s float type: a constant for static dims, times the product of the
/// lengths of the reduced ragged dims (per element, `[B, 1, ...]` of `x`'s rank, or
/// summed when the batch dim is reduced too), or times the batch size when the batch
/// dim is reduced without a ragged dim.
pub(crate) fn count(graph: &mut Graph, x: ValueId, dims: &[i64]) -> Result<ValueId, CountError> {
    let ty = graph.ty(x).clone();
    let dtype = ty
        .dtype()
        .filter(|dtype| dtype.is_float())
        .unwrap_or(DType::F32);
    let constant = |graph: &mut Graph, value: f64| {
        graph.push(Op::Const {
            value: F64(value),
            dtype,
        })
    };
    let (batch, element): (Dim, Vec<ElemDim>) = match &ty {
        Type::Ragged { batch, dims, .. } => (batch.clone(), dims.clone()),
        Type::Dense { shape, .. } if !shape.is_empty() => (
            shape[0].clone(),
            shape[1..].iter().cloned().map(ElemDim::Fixed).collect(),
        ),
        _ => return Ok(constant(graph, 1.0)?),
    };
    let mut fixed = 1i64;
    let mut ragged = Vec::new();
    for &dim in dims.iter().filter(|&&dim| dim >= 1) {
        match element.get(dim as usize - 1) {
            Some(ElemDim::Fixed(size)) => {
                let size = size
                    .as_static()
                    .ok_or_else(|| CountError::Unsupported("a mean over a symbolic dim".into()))?;
                fixed = fixed.checked_mul(size).ok_or_else(|| {
                    CountError::Unsupported(format!("a count over dims {dims:?} of {ty}"))
                })?;
            }
            Some(ElemDim::Ragged(lengths)) => ragged.push(*lengths),
            None => return Err(CountError::Unsupported(format!("dim {dim} of {ty}"))),
        }
    }
    let factor = constant(graph, fixed as f64)?;
    let batch_reduced = dims.contains(&0);
    let rank = rank(&ty);
    // The product of the reduced ragged dims' lengths, per element.
    let mut per_element: Option<ValueId> = None;
    for lengths in ragged {
        let values = graph.push(Op::LengthValues {
            lengths,
            dtype,
            rank: if batch_reduced { 1 } else { rank },
        })?;
        per_element = Some(match per_element {
            Some(product) => graph.push(Op::Binary {
                op: BinaryOp::Mul,
                lhs: product,
                rhs: values,
            })?,
            None => values,
        });
    }
    let variable = match (per_element, batch_reduced) {
        (None, false) => return Ok(factor),
        (Some(values), false) => values,
        (Some(values), true) => sum_over_batch(graph, values)?,
        (None, true) => {
            let lengths = lengths_of_batch(graph, &batch)
                .ok_or_else(|| CountError::Unsupported(format!("a mean over the batch {batch}")))?;
            let values = graph.push(Op::LengthValues {
                lengths,
                dtype,
                rank: 1,
            })?;
            // One per element (lengths are never negative), summed: the batch size.
            let zero = constant(graph, 0.0)?;
            let present = graph.push(Op::Binary {
                op: BinaryOp::Ge,
                lhs: values,
                rhs: zero,
            })?;
            let ones = graph.push(Op::Cast { x: present, dtype })?;
            sum_over_batch(graph, ones)?
        }
    };
    Ok(graph.push(Op::Binary {
        op: BinaryOp::Mul,
        lhs: variable,
        rhs: factor,
    })?)
}

fn sum_over_batch(graph: &mut Graph, values: ValueId) -> Result<ValueId, VerifyError> {
    graph.push(Op::Reduce {
        op: ReduceOp::Sum,
        x: values,
        dims: vec![0],
        keepdim: false,
        correction: 0,
    })
}

/// The per-channel statistics of a batch, `[C]` each, in the input's float type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchStatistics {
    /// The mean over every value of the channel.
    pub mean: ValueId,
    /// The biased variance (what the batch is normalized by).
    pub var: ValueId,
    /// How many values each channel has (a scalar).
    pub count: ValueId,
}

/// The batch-first dims a channel's statistics reduce: the batch and every element dim
/// but `channel` (an element dim of a value of element rank `rank`).
fn statistics_dims(rank: usize, channel: usize) -> Vec<i64> {
    std::iter::once(0)
        .chain(
            (0..rank)
                .filter(|&dim| dim != channel)
                .map(|dim| dim as i64 + 1),
        )
        .collect()
}

/// Adds the [`BatchStatistics`] of `x` (a batch) over every value of each channel (its
/// element dim `channel`) to `graph`: the mean, then the mean square of the values
/// minus it (two passes), in f32 for f16 and bf16 batches.
pub fn batch_statistics(
    graph: &mut Graph,
    x: ValueId,
    channel: usize,
) -> Result<BatchStatistics, VerifyError> {
    let ty = graph.ty(x).clone();
    let unsupported = |rule: String| VerifyError {
        value: x,
        op: "batch_norm",
        rule,
    };
    let (Type::Ragged { dims: element, .. }, Some(shape)) = (&ty, channel_shape(&ty, channel))
    else {
        return Err(unsupported(format!(
            "batch statistics need a batch with a static channel dim {channel}, got {ty}"
        )));
    };
    let dims = statistics_dims(element.len(), channel);
    // Half-precision batches are summed in f32, as libtorch does (their statistics,
    // and the count, would lose digits otherwise).
    let x = match ty.dtype() {
        Some(DType::F16 | DType::BF16) => graph.push(Op::Cast {
            x,
            dtype: DType::F32,
        })?,
        _ => x,
    };
    let reduce = |graph: &mut Graph, x: ValueId| {
        graph.push(Op::Reduce {
            op: ReduceOp::Mean,
            x,
            dims: dims.clone(),
            keepdim: false,
            correction: 0,
        })
    };
    let mean = reduce(graph, x)?;
    let spread = graph.push(Op::Reshape { x: mean, shape })?;
    let centered = graph.push(Op::Binary {
        op: BinaryOp::Sub,
        lhs: x,
        rhs: spread,
    })?;
    let square = graph.push(Op::Unary {
        op: UnaryOp::Square,
        x: centered,
    })?;
    let var = reduce(graph, square)?;
    let count = count(graph, x, &dims).map_err(|error| match error {
        CountError::Verify(error) => error,
        CountError::Unsupported(reason) => unsupported(reason),
    })?;
    Ok(BatchStatistics { mean, var, count })
}

/// The shape `[1, .., C, .., 1]` a per-channel value `[C]` takes to broadcast over
/// `batch` (a ragged type) whose channel is its static element dim `channel`; `None`
/// when that dim is not static.
pub(crate) fn channel_shape(batch: &Type, channel: usize) -> Option<Vec<i64>> {
    let Type::Ragged { dims, .. } = batch else {
        return None;
    };
    let channels = match dims.get(channel)? {
        ElemDim::Fixed(size) => size.as_static()?,
        ElemDim::Ragged(_) => return None,
    };
    Some(
        std::iter::once(1)
            .chain((0..dims.len()).map(|dim| if dim == channel { channels } else { 1 }))
            .collect(),
    )
}
