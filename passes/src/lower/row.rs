//! Row and segmented kernels: layer and RMS norm, softmax, reductions over the tail or the ragged dim.

use super::*;
use crate::step::{Row, Segment, SumRows};

impl Lowering<'_> {
    /// Lowers a row op.
    pub(super) fn lower_row(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        match op {
            Op::LayerNorm {
                x,
                weight,
                bias,
                dims,
                eps,
            } => self.row(
                value,
                ty,
                RowKind::LayerNorm,
                *x,
                (*weight, *bias, None),
                *dims,
                eps.0,
            ),
            Op::RmsNorm {
                x,
                weight,
                dims,
                eps,
            } => self.row(
                value,
                ty,
                RowKind::RmsNorm,
                *x,
                (*weight, None, None),
                *dims,
                eps.0,
            ),
            Op::NormGrad {
                x,
                g,
                weight,
                eps,
                centered,
                part,
            } => {
                // A row kernel over the cotangent `g` that reads the norm's input `x` as
                // its keys.
                let kind = RowKind::NormGrad {
                    centered: *centered,
                    part: *part,
                };
                self.row(value, ty, kind, *g, (*weight, None, Some(*x)), 1, eps.0)
            }
            Op::Softmax { x, axis, log } => {
                if let Some(lowered) = self.pair_softmax(value, ty, *x, *axis, *log)? {
                    return Ok(lowered);
                }
                self.leading(value, *x)?;
                let (slot, _, tail, lengths) = self.data(value, *x)?;
                // The index of the last dim: after the batch dim, and the ragged dim if any.
                let last = tail.len() as i64 + i64::from(lengths.is_some());
                let ragged_axis = lengths.is_some() && *axis == 1;
                if ragged_axis {
                    let lengths = lengths.unwrap_or(slot);
                    self.segmented(value, ty, softmax_kind(*log), (slot, &tail), lengths)
                } else if *axis == last || *axis == -1 {
                    let kind = if *log {
                        RowKind::LogSoftmax
                    } else {
                        RowKind::Softmax
                    };
                    self.row(value, ty, kind, *x, (None, None, None), 1, 0.0)
                } else {
                    Err(unsupported(
                        value,
                        op,
                        "softmax over an inner static dim is not compiled",
                    ))
                }
            }
            Op::Reduce {
                op: reduce,
                x,
                dims,
                keepdim,
                ..
            } => self.reduce(value, ty, *reduce, *x, dims, *keepdim),
            Op::Cumulative {
                x,
                axis,
                product,
                reverse,
            } => {
                self.leading(value, *x)?;
                let (slot, _, tail, lengths) = self.data(value, *x)?;
                let kind = match (*product, *reverse) {
                    (false, false) => SegmentKind::CumSum,
                    (true, false) => SegmentKind::CumProd,
                    (false, true) => SegmentKind::ReverseCumSum,
                    (true, true) => SegmentKind::ReverseCumProd,
                };
                // The last dim, static: a scan along each row.
                let last = tail.len() as i64 + i64::from(lengths.is_some());
                if (*axis == last || *axis == -1) && !tail.is_empty() {
                    let width = *tail.last().unwrap_or(&1);
                    let rows = self.data(value, *x)?.1;
                    let out = self.result(value, ty)?;
                    self.program.steps.push(Step::Row(Row {
                        kind: RowKind::Scan {
                            product: *product,
                            reverse: *reverse,
                        },
                        out: slot_of(&out),
                        x: Fusion::plain(slot, width),
                        weight: None,
                        bias: None,
                        rows: rows.times(volume(&tail[..tail.len() - 1])),
                        width,
                        eps: F64(0.0),
                        keys: None,
                    }));
                    return Ok(out);
                }
                match lengths {
                    Some(lengths) if *axis == 1 => {
                        self.segmented(value, ty, kind, (slot, &tail), lengths)
                    }
                    _ => Err(unsupported(
                        value,
                        op,
                        "a scan over a dim other than the ragged one or the last is not compiled",
                    )),
                }
            }
            &Op::Sort {
                x,
                axis,
                descending,
                positions,
            } => {
                let order = Order::Sort {
                    descending,
                    positions,
                };
                self.order_kernel(value, ty, (x, axis), order, None)
            }
            &Op::TopK {
                x,
                axis,
                k,
                largest,
                positions,
                ..
            } => {
                let order = Order::TopK {
                    k,
                    largest,
                    positions,
                };
                self.order_kernel(value, ty, (x, axis), order, Some((k, "topk")))
            }
            &Op::Running {
                x,
                axis,
                largest,
                positions,
            } => {
                let order = Order::Running { largest, positions };
                self.order_kernel(value, ty, (x, axis), order, None)
            }
            &Op::KthValue {
                x,
                axis,
                k,
                positions,
                ..
            } => {
                let order = Order::Kth { k, positions };
                self.order_kernel(value, ty, (x, axis), order, Some((k, "kthvalue")))
            }
            &Op::ExtremeGrad {
                g,
                x,
                axis,
                largest,
            } => {
                let pick = Pick::Extreme { largest };
                self.ordered_gradient(value, ty, (g, x, axis), Order::PickGrad { pick })
            }
            &Op::KthGrad { g, x, axis, k } => {
                let pick = Pick::Kth { k };
                self.ordered_gradient(value, ty, (g, x, axis), Order::PickGrad { pick })
            }
            &Op::TopKGrad {
                g,
                x,
                axis,
                k,
                largest,
            } => self.ordered_gradient(value, ty, (g, x, axis), Order::TopKGrad { k, largest }),
            &Op::RunningGrad {
                g,
                x,
                axis,
                largest,
            } => self.ordered_gradient(value, ty, (g, x, axis), Order::RunningGrad { largest }),
            &Op::SortGrad {
                g,
                x,
                axis,
                descending,
            } => self.ordered_gradient(value, ty, (g, x, axis), Order::SortGrad { descending }),
            other => Err(unsupported(value, other, "not lowered yet")),
        }
    }

    /// A gradient kernel (`order`) that orders each element's rows or each row by `x`
    /// along `axis` and moves `g` (as many values a line as `x`, or as `order` keeps).
    fn ordered_gradient(
        &mut self,
        value: ValueId,
        ty: &Type,
        (g, x, axis): (ValueId, ValueId, i64),
        order: Order,
    ) -> Result<Lowered, LowerError> {
        let (g, ..) = self.data(value, g)?;
        match self.along(value, x, axis)? {
            Along::Ragged {
                slot,
                tail,
                lengths,
            } => {
                let kind = SegmentKind::Order(order);
                self.segmented_by(value, ty, kind, (g, &tail), (lengths, Some(slot)))
            }
            Along::Last { slot, rows, width } => {
                let g = Fusion::plain(g, order.kept().unwrap_or(width));
                let kind = RowKind::Order(order);
                self.row_kernel(value, ty, kind, (g, rows, width), Some(slot))
            }
        }
    }

    /// Where an op along the element dim `axis` of `x` runs: down the ragged dim (the
    /// first element dim of a batch with one leading ragged dim) or along the last
    /// static dim; a typed error for other dims.
    fn along(&self, value: ValueId, x: ValueId, axis: i64) -> Result<Along, LowerError> {
        self.leading(value, x)?;
        let (slot, rows, tail, lengths) = self.data(value, x)?;
        // The index of the last dim: after the batch dim, and the ragged dim if any.
        let last = tail.len() as i64 + i64::from(lengths.is_some());
        match (lengths, tail.split_last()) {
            (Some(lengths), _) if axis == 1 => Ok(Along::Ragged {
                slot,
                tail,
                lengths,
            }),
            (_, Some((&width, outer))) if axis == last || axis == -1 => Ok(Along::Last {
                slot,
                rows: rows.times(volume(outer)),
                width,
            }),
            _ => Err(unsupported(
                value,
                self.graph.op(value),
                "along a dim other than the ragged one or the last is not compiled",
            )),
        }
    }

    /// A row kernel of `kind` over `x`'s last `dims` dims, reading a weight, a bias and
    /// keys (a norm gradient's input) where given.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn row(
        &mut self,
        value: ValueId,
        ty: &Type,
        kind: RowKind,
        x: ValueId,
        (weight, bias, keys): (Option<ValueId>, Option<ValueId>, Option<ValueId>),
        dims: usize,
        eps: f64,
    ) -> Result<Lowered, LowerError> {
        self.leading(value, x)?;
        let (x_slot, rows, tail, _) = self.data(value, x)?;
        if dims == 0 || dims > tail.len() {
            return Err(unsupported(
                value,
                self.graph.op(value),
                format!("cannot normalize {dims} dims of a tail {tail:?}"),
            ));
        }
        let width = volume(&tail[tail.len() - dims..]);
        let slot = |operand: Option<ValueId>| {
            operand
                .map(|operand| self.data(value, operand).map(|(slot, ..)| slot))
                .transpose()
        };
        let (weight, bias, keys) = (slot(weight)?, slot(bias)?, slot(keys)?);
        let out = self.result(value, ty)?;
        let outer = volume(&tail[..tail.len() - dims]);
        self.program.steps.push(Step::Row(Row {
            kind,
            out: slot_of(&out),
            x: Fusion::plain(x_slot, width),
            weight,
            bias,
            rows: rows.times(outer),
            width,
            eps: F64(eps),
            keys,
        }));
        Ok(out)
    }

    pub(super) fn reduce(
        &mut self,
        value: ValueId,
        ty: &Type,
        reduce: ReduceOp,
        x: ValueId,
        dims: &[i64],
        keepdim: bool,
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        if reduce.gives_positions() {
            return self.positions(value, ty, reduce, x, dims);
        }
        let segment_kind = || match reduce {
            ReduceOp::Sum => Ok(SegmentKind::Sum),
            ReduceOp::Mean => Ok(SegmentKind::Mean),
            ReduceOp::Amax | ReduceOp::Max => Ok(SegmentKind::Max),
            ReduceOp::Amin | ReduceOp::Min => Ok(SegmentKind::Min),
            ReduceOp::LogSumExp => Ok(SegmentKind::LogSumExp),
            other => Err(unsupported(
                value,
                op,
                format!("{} over a ragged dim is not compiled", other.word()),
            )),
        };
        // Over the second ragged dim of a pair layout: its segments.
        if let [axis] = dims {
            if let Some((x_slot, tail, segments)) = self.pair_segments(value, x, *axis)? {
                let kind = segment_kind()?;
                return self.segmented(value, ty, kind, (x_slot, &tail), segments);
            }
        }
        if let Some(out) = self.column_sums(value, ty, reduce, x, dims)? {
            return Ok(out);
        }
        // Over every ragged dim of each element: the segments of its rows.
        if let Some((x_slot, tail, segments)) = self.element_segments(value, x, dims)? {
            let kind = segment_kind()?;
            let segments = self.non_empty(segments, reduce);
            return self.segmented(value, ty, kind, (x_slot, &tail), segments);
        }
        self.leading(value, x)?;
        let (x_slot, rows, tail, lengths) = self.data(value, x)?;
        // The index of the last dim: after the batch dim, and the ragged dim if any.
        let last = tail.len() as i64 + i64::from(lengths.is_some());
        match (dims, lengths) {
            ([1], Some(lengths)) => {
                let kind = segment_kind()?;
                let lengths = self.non_empty(lengths, reduce);
                self.segmented(value, ty, kind, (x_slot, &tail), lengths)
            }
            ([dim], _) if (*dim == last || *dim == -1) && !tail.is_empty() => {
                let kind = match reduce {
                    ReduceOp::Sum => RowKind::Sum,
                    ReduceOp::Mean => RowKind::Mean,
                    ReduceOp::Amax | ReduceOp::Max => RowKind::Max,
                    ReduceOp::Amin | ReduceOp::Min => RowKind::Min,
                    ReduceOp::LogSumExp => RowKind::LogSumExp,
                    other => {
                        return Err(unsupported(
                            value,
                            op,
                            format!("{} over the last dim is not compiled", other.word()),
                        ))
                    }
                };
                self.row_reduction(value, ty, kind, (x_slot, rows, &tail))
            }
            _ => match (reduce, leading_rows(dims, lengths.is_some(), &tail)) {
                (ReduceOp::Sum | ReduceOp::Mean, Some((rows_factor, n))) => {
                    let out = self.result(value, ty)?;
                    self.program.steps.push(Step::SumRows(SumRows {
                        out: slot_of(&out),
                        a: None,
                        b: x_slot,
                        times: None,
                        plain: None,
                        rows: rows.times(rows_factor),
                        m: 1,
                        n,
                        mean: reduce == ReduceOp::Mean,
                    }));
                    Ok(out)
                }
                _ => Err(unsupported(
                    value,
                    op,
                    format!("reductions over dims {dims:?} (keepdim {keepdim}) are not compiled"),
                )),
            },
        }
    }

    /// The reduction `kind` of each row of `x` (its last dim, `tail`'s last).
    fn row_reduction(
        &mut self,
        value: ValueId,
        ty: &Type,
        kind: RowKind,
        (x, rows, tail): (Slot, Rows, &[i64]),
    ) -> Result<Lowered, LowerError> {
        let width = *tail.last().unwrap_or(&1);
        let rows = rows.times(volume(&tail[..tail.len().saturating_sub(1)]));
        self.row_kernel(
            value,
            ty,
            kind,
            (Fusion::plain(x, width), rows, width),
            None,
        )
    }

    /// A row kernel `kind` over `rows` of `width` values (`x` read as its expression),
    /// ordered by `keys` where given.
    fn row_kernel(
        &mut self,
        value: ValueId,
        ty: &Type,
        kind: RowKind,
        (x, rows, width): (Fusion, Rows, i64),
        keys: Option<Slot>,
    ) -> Result<Lowered, LowerError> {
        let out = self.result(value, ty)?;
        self.program.steps.push(Step::Row(Row {
            kind,
            out: slot_of(&out),
            x,
            weight: None,
            bias: None,
            rows,
            width,
            eps: F64(0.0),
            keys,
        }));
        Ok(out)
    }

    /// argmax or argmin (`reduce`) along the ragged dim (each element's rows, every
    /// element checked non-empty before the run, as eager's `EmptyReduction`) or the last
    /// static dim (each row): i64 positions.
    fn positions(
        &mut self,
        value: ValueId,
        ty: &Type,
        reduce: ReduceOp,
        x: ValueId,
        dims: &[i64],
    ) -> Result<Lowered, LowerError> {
        let largest = reduce == ReduceOp::Argmax;
        let [dim] = dims else {
            return Err(unsupported(
                value,
                self.graph.op(value),
                format!("{} takes one dim, got {dims:?}", reduce.word()),
            ));
        };
        let order = Order::Position { largest };
        self.order_kernel(value, ty, (x, *dim), order, Some((1, reduce.word())))
    }

    /// `order` down the ragged dim or along the last dim of `x` (`axis`), each line
    /// first checked to hold `least`'s count of positions where given (its name in the
    /// error); the result holds i64 positions or values, as `order` gives.
    fn order_kernel(
        &mut self,
        value: ValueId,
        ty: &Type,
        (x, axis): (ValueId, i64),
        order: Order,
        least: Option<(i64, &'static str)>,
    ) -> Result<Lowered, LowerError> {
        let out = match self.along(value, x, axis)? {
            Along::Ragged {
                slot,
                tail,
                lengths,
            } => {
                let lengths = match least {
                    Some(least) => self.at_least(lengths, least),
                    None => lengths,
                };
                let kind = SegmentKind::Order(order);
                self.segmented(value, ty, kind, (slot, &tail), lengths)?
            }
            Along::Last { slot, rows, width } => {
                if let Some((count, op)) = least.filter(|&(count, _)| width < count) {
                    return Err(unsupported(
                        value,
                        self.graph.op(value),
                        format!("{op} needs {count} positions along a dim of size {width}"),
                    ));
                }
                let x = Fusion::plain(slot, width);
                self.row_kernel(value, ty, RowKind::Order(order), (x, rows, width), None)?
            }
        };
        Ok(self.holding_positions(order.gives_positions(), out))
    }

    /// `lengths`, checked non-empty before the run where `reduce` has no value for an
    /// empty element (the largest and smallest value: eager's `EmptyReduction`).
    fn non_empty(&mut self, lengths: Slot, reduce: ReduceOp) -> Slot {
        match reduce {
            ReduceOp::Amax | ReduceOp::Amin | ReduceOp::Max | ReduceOp::Min => {
                self.at_least(lengths, (1, reduce.word()))
            }
            _ => lengths,
        }
    }

    /// When `x` has several ragged dims and `dims` (batch first) are exactly them (images
    /// `[C, H, W]` over `H` and `W`): its slot, its tail and the segments of each
    /// element's rows (`H_i W_i`, lengths the runtime derives before the run). `None`
    /// for other values and dims.
    fn element_segments(
        &mut self,
        value: ValueId,
        x: ValueId,
        dims: &[i64],
    ) -> Result<Option<(Slot, Vec<i64>, Slot)>, LowerError> {
        let Lowered::Data { dims: out_dims, .. } = self.get(x) else {
            return Ok(None);
        };
        let ragged: Vec<(i64, Slot)> = (out_dims.iter().enumerate())
            .filter_map(|(index, dim)| match *dim {
                OutDim::Ragged(lengths) => Some((index as i64 + 1, lengths)),
                OutDim::Static(_) => None,
            })
            .collect();
        let reduced = crate::decompose::normalized_dims(dims, 1 + out_dims.len() as i64);
        let [(first_dim, first), (second_dim, second)] = ragged[..] else {
            return Ok(None);
        };
        if reduced != [first_dim, second_dim] {
            return Ok(None);
        }
        let (slot, _, tail, _) = self.data(value, x)?;
        Ok(Some((slot, tail, self.element_rows(first, second))))
    }

    /// The rows of each element of two ragged dims of lengths `first` and `second`
    /// (`H_i W_i`): lengths the runtime derives before the run.
    pub(super) fn element_rows(&mut self, first: Slot, second: Slot) -> Slot {
        self.derived_lengths(first, LengthsKind::Times { by: second })
    }

    /// `lengths`, checked at least `count` before the run for `op`.
    pub(super) fn at_least(&mut self, lengths: Slot, (count, op): (i64, &'static str)) -> Slot {
        self.derived_lengths(lengths, LengthsKind::AtLeast { count, op })
    }

    /// A sum or mean that adds whole packed rows: of everything (any layout, pairs
    /// included: every scalar), or over the batch and every ragged dim, wherever they
    /// are (images `[C, H, W]`: every pixel, a convolution's bias gradient, batch
    /// statistics), kept or not: the column sums of all packed rows. `None` for other
    /// reductions.
    fn column_sums(
        &mut self,
        value: ValueId,
        ty: &Type,
        reduce: ReduceOp,
        x: ValueId,
        dims: &[i64],
    ) -> Result<Option<Lowered>, LowerError> {
        // A sum or mean of everything, of any layout (pairs, a ragged dim after static
        // ones: signals `[C, L]`): every scalar.
        let (ragged_dims, leading) = match self.get(x) {
            Lowered::Data {
                dims: out_dims,
                lengths,
                ..
            } => (
                out_dims
                    .iter()
                    .filter(|dim| matches!(dim, OutDim::Ragged(_)))
                    .count(),
                lengths.is_some(),
            ),
            _ => (0, false),
        };
        let any_layout = ragged_dims > 1 || (ragged_dims == 1 && !leading);
        if dims.is_empty() && any_layout && matches!(reduce, ReduceOp::Sum | ReduceOp::Mean) {
            let (x_slot, rows, tail, _) = self.data(value, x)?;
            let out = self.result(value, ty)?;
            self.program.steps.push(Step::SumRows(SumRows {
                out: slot_of(&out),
                a: None,
                b: x_slot,
                times: None,
                plain: None,
                rows: rows.times(volume(&tail)),
                m: 1,
                n: 1,
                mean: reduce == ReduceOp::Mean,
            }));
            return Ok(Some(out));
        }
        // Over the batch and every ragged dim, wherever they are (images `[C, H, W]`:
        // every pixel, a convolution's bias gradient, batch statistics), kept or not:
        // the column sums of all packed rows.
        if let (Lowered::Data { dims: out_dims, .. }, ReduceOp::Sum | ReduceOp::Mean) =
            (self.get(x), reduce)
        {
            // The batch-first dims the packed rows stand for: the batch, the ragged dims.
            let row_dims: Vec<i64> = std::iter::once(0)
                .chain(
                    out_dims
                        .iter()
                        .enumerate()
                        .filter(|(_, dim)| matches!(dim, OutDim::Ragged(_)))
                        .map(|(index, _)| index as i64 + 1),
                )
                .collect();
            let rank = 1 + out_dims.len() as i64;
            // Static dims of size 1 reduce nothing (signals' one-pixel-high images).
            let size_one = |dim: i64| {
                usize::try_from(dim - 1)
                    .ok()
                    .and_then(|at| out_dims.get(at))
                    .is_some_and(|dim| *dim == OutDim::Static(1))
            };
            let mut reduced: Vec<i64> = dims
                .iter()
                .map(|&dim| if dim < 0 { dim + rank } else { dim })
                .filter(|&dim| !size_one(dim))
                .collect();
            reduced.sort_unstable();
            reduced.dedup();
            if row_dims.len() > 1 && reduced == row_dims {
                let (x_slot, rows, tail, _) = self.data(value, x)?;
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::SumRows(SumRows {
                    out: slot_of(&out),
                    a: None,
                    b: x_slot,
                    times: None,
                    plain: None,
                    rows,
                    m: 1,
                    n: volume(&tail),
                    mean: reduce == ReduceOp::Mean,
                }));
                return Ok(Some(out));
            }
        }
        Ok(None)
    }
}

/// When `dims` are the leading batch-first dims `0..=k` (all dims when empty) and cover
/// every dim the packed rows stand for (the batch, and the ragged dim when `ragged`):
/// the factor of rows and the width of what remains, so the reduction sums whole rows.
fn leading_rows(dims: &[i64], ragged: bool, tail: &[i64]) -> Option<(i64, i64)> {
    let row_dims = if ragged { 2 } else { 1 };
    let ndim = (row_dims + tail.len()) as i64;
    let reduced: Vec<i64> = match dims {
        [] => (0..ndim).collect(),
        dims => crate::decompose::normalized_dims(dims, ndim),
    };
    let leading = reduced
        .iter()
        .enumerate()
        .all(|(index, &dim)| dim == index as i64);
    let count = reduced.len();
    if !leading || count < row_dims || count > row_dims + tail.len() {
        return None;
    }
    let split = count - row_dims;
    Some((volume(&tail[..split]), volume(&tail[split..])))
}

impl Lowering<'_> {
    /// Softmax of a pair layout `[M, N, *tail]` over `N` (its second ragged dim): a
    /// segmented kernel over [`pair_segments`](Self::pair_segments). `None` for other
    /// values.
    fn pair_softmax(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        axis: i64,
        log: bool,
    ) -> Result<Option<Lowered>, LowerError> {
        let Some((slot, tail, segments)) = self.pair_segments(value, x, axis)? else {
            return Ok(None);
        };
        self.segmented(value, ty, softmax_kind(log), (slot, &tail), segments)
            .map(Some)
    }

    /// When `x` is a pair layout `[M, N, *tail]` and `axis` (batch first, negative from
    /// the end) names `N`: its slot, its tail and its segments along `N`, the runs of
    /// `N_i` rows, `M_i` of them per element (lengths the runtime derives before the
    /// run). `None` for other values or axes.
    fn pair_segments(
        &mut self,
        value: ValueId,
        x: ValueId,
        axis: i64,
    ) -> Result<Option<(Slot, Vec<i64>, Slot)>, LowerError> {
        // From the lowered value (a prologue's input is not the op's own type).
        let Lowered::Data { dims, .. } = self.get(x) else {
            return Ok(None);
        };
        let (Some(&OutDim::Ragged(rows)), Some(&OutDim::Ragged(columns))) =
            (dims.first(), dims.get(1))
        else {
            return Ok(None);
        };
        let rank = dims.len() as i64;
        if axis != 2 && axis != 2 - (rank + 1) {
            return Ok(None);
        }
        let (slot, _, tail, _) = self.data(value, x)?;
        let segments = self.derived_lengths(columns, LengthsKind::Repeated { times: rows });
        Ok(Some((slot, tail, segments)))
    }

    /// A segmented kernel of `kind` over the segments `lengths` gives of the rows of `x`
    /// (its slot and tail).
    fn segmented(
        &mut self,
        value: ValueId,
        ty: &Type,
        kind: SegmentKind,
        (slot, tail): (Slot, &[i64]),
        lengths: Slot,
    ) -> Result<Lowered, LowerError> {
        self.segmented_by(value, ty, kind, (slot, tail), (lengths, None))
    }

    /// [`Self::segmented`] with the rows ordered by `keys` where given (a sort's
    /// gradient).
    fn segmented_by(
        &mut self,
        value: ValueId,
        ty: &Type,
        kind: SegmentKind,
        (slot, tail): (Slot, &[i64]),
        (lengths, keys): (Slot, Option<Slot>),
    ) -> Result<Lowered, LowerError> {
        let out = self.result(value, ty)?;
        self.program.steps.push(Step::Segment(Segment {
            kind,
            out: slot_of(&out),
            x: Fusion::plain(slot, volume(tail)),
            lengths,
            width: volume(tail),
            keys,
        }));
        Ok(out)
    }
}

/// Where an op along one element dim runs.
enum Along {
    /// Down the ragged dim: `slot`'s rows split by `lengths`, `tail` values each.
    Ragged {
        slot: Slot,
        tail: Vec<i64>,
        lengths: Slot,
    },
    /// Along the last static dim: `rows` rows of `width` values.
    Last { slot: Slot, rows: Rows, width: i64 },
}

/// The segmented softmax kind, log or not.
fn softmax_kind(log: bool) -> SegmentKind {
    if log {
        SegmentKind::LogSoftmax
    } else {
        SegmentKind::Softmax
    }
}
