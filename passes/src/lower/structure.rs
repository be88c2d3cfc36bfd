//! Structure: padding copies, aliases (reshapes, eval dropout), static selections, window lengths.

use super::*;
use crate::step::{Insert, LengthValues, OneHot, Pad, Pointwise, Positions, Unpad};
use crate::{Digits, Repeats};
use nestor_ir::SliceBounds;

/// The most copies of a repeated batch whose gradient is one kernel (a sum of as many
/// reads).
const MAX_COPIES_SUMMED: i64 = 32;

impl Lowering<'_> {
    /// Lowers a structure op.
    pub(super) fn lower_structure(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        match op {
            Op::Unpad { x, lengths } => {
                let (x_slot, rows, tail, _) = self.data(value, *x)?;
                let (RowBase::Padded(grid), Lowered::Lengths(lengths)) =
                    (rows.base, self.get(*lengths))
                else {
                    return Err(unsupported(value, op, format!("{x} must be a padded grid")));
                };
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Unpad(Unpad {
                    out: slot_of(&out),
                    x: x_slot,
                    grid,
                    lengths,
                    width: volume(&tail),
                }));
                Ok(out)
            }
            Op::Pad { x, value: padding } => {
                self.leading(value, *x)?;
                let (x_slot, _, tail, lengths) = self.data(value, *x)?;
                let Some(lengths) = lengths else {
                    return Err(unsupported(
                        value,
                        op,
                        format!("{x} must be a ragged batch"),
                    ));
                };
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Pad(Pad {
                    out: slot_of(&out),
                    x: x_slot,
                    lengths,
                    width: volume(&tail),
                    value: *padding,
                }));
                Ok(out)
            }
            // The two ragged dims of a pair layout: a copy reading every row through the
            // transposition map.
            Op::TransposeRagged { x, .. } => match self.graph.ty(*x) {
                Type::Ragged { dims, .. } => match dims.as_slice() {
                    [ElemDim::Ragged(m), ElemDim::Ragged(n), ..] => {
                        self.transpose_pairs(value, ty, *x, (*m, *n))
                    }
                    _ => self.alias_of(value, *x, ty),
                },
                _ => Err(unsupported(value, op, "expects a ragged batch")),
            },
            // A ragged dim swapped with a static one: the same packed rows; and a size-1
            // dim inserted.
            Op::ReshapeTail { x, .. } | Op::Reshape { x, .. } | Op::Unsqueeze { x, .. } => {
                self.alias_of(value, *x, ty)
            }
            Op::SelectStatic { x, dim, index } => self.select_static(value, ty, *x, *dim, *index),
            Op::MatchLengths { x, lengths } => self.match_lengths(value, ty, *x, lengths),
            Op::TransposeStatic { x, dim0, dim1 } => {
                self.transpose_static(value, ty, *x, (*dim0, *dim1))
            }
            &Op::SliceStatic { x, dim, start, end } => {
                self.slice_static(value, ty, x, (dim, start, end))
            }
            &Op::PadStatic { x, dim, before, .. } => self.pad_static(value, ty, x, (dim, before)),
            Op::RepeatBatch {
                x,
                repeats,
                interleave,
                ..
            } => {
                let repeats = Repeats {
                    times: *repeats,
                    interleave: *interleave,
                };
                let (slot, lengths, width) = self.leading_batch(value, *x)?;
                let map = RowMap::Repeated(lengths, repeats);
                self.copies(value, ty, vec![(slot, map)], width)
            }
            &Op::SliceRagged { x, start, end, .. } => {
                let (slot, lengths, width) = self.leading_batch(value, x)?;
                let map = RowMap::Sliced(lengths, SliceBounds { start, end });
                self.copies(value, ty, vec![(slot, map)], width)
            }
            &Op::UnsliceRagged {
                g,
                like,
                start,
                end,
            } => {
                let (slot, ..) = self.data(value, g)?;
                let (_, lengths, width) = self.leading_batch(value, like)?;
                let map = RowMap::Unsliced(lengths, SliceBounds { start, end });
                self.copies(value, ty, vec![(slot, map)], width)
            }
            Op::UnrepeatBatch {
                g,
                like,
                repeats,
                interleave,
            } => {
                if *repeats > MAX_COPIES_SUMMED {
                    return Err(unsupported(
                        value,
                        op,
                        format!("the gradient of more than {MAX_COPIES_SUMMED} repeats"),
                    ));
                }
                let repeats_of = Repeats {
                    times: *repeats,
                    interleave: *interleave,
                };
                let (slot, ..) = self.data(value, *g)?;
                let (_, lengths, width) = self.leading_batch(value, *like)?;
                let copies = (0..*repeats)
                    .map(|copy| (slot, RowMap::Copy(lengths, repeats_of, copy)))
                    .collect();
                self.copies(value, ty, copies, width)
            }
            _ => self.lower_lengths_op(value, op, ty),
        }
    }

    /// Two static dims of `x` swapped: a copy reading each packed row `[A, Q, B, R]`
    /// as `[B, Q, A, R]` ([`Digits::swapped`]), the dims before them folded into the
    /// rows.
    fn transpose_static(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        (dim0, dim1): (usize, usize),
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        // Floats, or i64 values (positions, ids) moved as they are.
        let (slot, rows, tail, _) = self.any_data(value, x)?;
        let integers = self.program.info(slot).integers;
        let place = |dim| static_place(self.graph.ty(x), dim);
        let (Some(i), Some(j)) = (place(dim0.min(dim1)), place(dim0.max(dim1))) else {
            return Err(unsupported(value, op, "expects two static element dims"));
        };
        if i == j {
            return self.alias_of(value, x, ty);
        }
        let dims = [
            tail[i],
            volume(&tail[i + 1..j]),
            tail[j],
            volume(&tail[j + 1..]),
        ];
        let width = volume(&dims);
        let out = self.result(value, ty)?;
        self.program.steps.push(Step::Pointwise(Pointwise {
            out: slot_of(&out),
            rows: rows.times(volume(&tail[..i])),
            width,
            inputs: vec![Access {
                digits: Some(Digits::swapped(dims)),
                ..Access::rows(slot, width)
            }],
            expr: match integers {
                true => Expr::Integers(0),
                false => Expr::Load(0),
            },
        }));
        Ok(self.holding_positions(integers, out))
    }

    /// Positions `start..end` of the static element dim `dim` of `x` (floats or i64
    /// values): a copy reading each packed row `[S, R]` from `start * R` (the dims
    /// before folded into the rows).
    fn slice_static(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        (dim, start, end): (usize, i64, i64),
    ) -> Result<Lowered, LowerError> {
        let (slot, rows, tail, _) = self.any_data(value, x)?;
        let integers = self.program.info(slot).integers;
        let Some(place) = static_place(self.graph.ty(x), dim) else {
            return Err(unsupported(
                value,
                self.graph.op(value),
                "expects a static dim",
            ));
        };
        let (size, inner) = (tail[place], volume(&tail[place + 1..]));
        let out = self.result(value, ty)?;
        self.program.steps.push(Step::Pointwise(Pointwise {
            out: slot_of(&out),
            rows: rows.times(volume(&tail[..place])),
            width: (end - start) * inner,
            inputs: vec![Access {
                offset: start * inner,
                ..Access::rows(slot, size * inner)
            }],
            expr: match integers {
                true => Expr::Integers(0),
                false => Expr::Load(0),
            },
        }));
        Ok(self.holding_positions(integers, out))
    }

    /// `x` with zeros around its values along the static element dim `dim` (`before`
    /// of them first): each packed row's block inserted into zeros.
    fn pad_static(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        (dim, before): (usize, i64),
    ) -> Result<Lowered, LowerError> {
        let (slot, rows, tail, _) = self.data(value, x)?;
        let Some(place) = static_place(self.graph.ty(x), dim) else {
            return Err(unsupported(
                value,
                self.graph.op(value),
                "expects a static dim",
            ));
        };
        let out = self.result(value, ty)?;
        let padded = tail_of(&out).get(place).copied().unwrap_or(0);
        self.program.steps.push(Step::Insert(Insert {
            out: slot_of(&out),
            x: slot,
            rows: rows.times(volume(&tail[..place])),
            size: padded,
            index: before,
            count: tail[place],
            inner: volume(&tail[place + 1..]),
        }));
        Ok(out)
    }

    /// The slot, lengths and row width of `x`, a batch with one leading ragged dim (an
    /// error otherwise).
    fn leading_batch(&self, value: ValueId, x: ValueId) -> Result<(Slot, Slot, i64), LowerError> {
        self.leading(value, x)?;
        // Floats, or i64 values (positions, ids) moved as they are.
        let (slot, _, tail, lengths) = self.any_data(value, x)?;
        let lengths = lengths.ok_or_else(|| {
            unsupported(
                value,
                self.graph.op(value),
                format!("{x} must be a batch with one leading ragged dim"),
            )
        })?;
        Ok((slot, lengths, volume(&tail)))
    }

    /// A kernel summing rows of `width` read through row maps (a copy for one).
    fn copies(
        &mut self,
        value: ValueId,
        ty: &Type,
        reads: Vec<(Slot, RowMap)>,
        width: i64,
    ) -> Result<Lowered, LowerError> {
        // A copy of i64 values (positions, ids) moves them as they are.
        let integers = matches!(&reads[..], [(slot, _)] if self.program.info(*slot).integers);
        let out = self.result(value, ty)?;
        let out = self.holding_positions(integers, out);
        let expr = match integers {
            true => Expr::Integers(0),
            false => (0..reads.len())
                .map(Expr::Load)
                .reduce(|sum, load| Expr::Binary(BinaryOp::Add, Box::new(sum), Box::new(load)))
                .unwrap_or(Expr::Const(F64(0.0))),
        };
        let inputs = reads
            .into_iter()
            .map(|(slot, map)| Access {
                row_map: Some(map),
                ..Access::rows(slot, width)
            })
            .collect();
        self.program.steps.push(Step::Pointwise(Pointwise {
            out: slot_of(&out),
            rows: rows_of(&out),
            width,
            inputs,
            expr,
        }));
        Ok(out)
    }

    /// `x` seen with the ragged dims of `lengths` (an alias), each checked equal to
    /// x's own before the run sizes its buffers (a lengths op whose result is unused).
    fn match_lengths(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        lengths: &[ValueId],
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        let own = self.graph.ty(x).length_values();
        for (&own, &new) in own.iter().zip(lengths) {
            let (Lowered::Lengths(input), Lowered::Lengths(against)) =
                (self.get(own), self.get(new))
            else {
                return Err(unsupported(value, op, "expects lengths buffers"));
            };
            if input != against {
                self.derived_lengths(input, LengthsKind::Checked { against });
            }
        }
        self.alias_of(value, x, ty)
    }

    /// Lowers an op computed from lengths (window sizes, length values, one-hot rows, inserts).
    fn lower_lengths_op(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        if let Some((lengths, kind)) = lengths_op_kind(op) {
            let Lowered::Lengths(input) = self.get(lengths) else {
                return Err(unsupported(value, op, "expects a lengths buffer"));
            };
            let out = self.result(value, ty)?;
            self.program.lengths_ops.push(LengthsOp {
                out: slot_of(&out),
                input,
                kind,
            });
            return Ok(out);
        }
        match op {
            Op::Positions { lengths } => {
                let Lowered::Lengths(lengths) = self.get(*lengths) else {
                    return Err(unsupported(value, op, "expects a lengths buffer"));
                };
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Positions(Positions {
                    out: slot_of(&out),
                    lengths,
                }));
                Ok(self.holding_positions(true, out))
            }
            Op::LengthValues { lengths, .. } => {
                let Lowered::Lengths(lengths) = self.get(*lengths) else {
                    return Err(unsupported(value, op, "expects a lengths buffer"));
                };
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::LengthValues(LengthValues {
                    out: slot_of(&out),
                    lengths,
                }));
                Ok(out)
            }
            Op::OneHot {
                ids,
                classes,
                ignore,
                ..
            } => {
                let (ids, rows, tail) = self.integer_ids(value, *ids)?;
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::OneHot(OneHot {
                    out: slot_of(&out),
                    ids,
                    rows: rows.times(volume(&tail)),
                    classes: *classes,
                    ignore: *ignore,
                }));
                Ok(out)
            }
            // A new dim of size 1 moves no value (an unsqueeze), in any layout.
            Op::InsertStatic { x, size: 1, .. } => self.alias_of(value, *x, ty),
            Op::InsertStatic {
                x,
                dim,
                index,
                size,
            } => {
                self.leading(value, *x)?;
                let (x_slot, rows, tail, lengths) = self.data(value, *x)?;
                if lengths.is_none() || *dim == 0 || *dim > tail.len() + 1 {
                    return Err(unsupported(
                        value,
                        op,
                        "only static dims after one ragged dim",
                    ));
                }
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Insert(Insert {
                    out: slot_of(&out),
                    x: x_slot,
                    rows: rows.times(volume(&tail[..dim - 1])),
                    size: *size,
                    index: *index,
                    count: 1,
                    inner: volume(&tail[dim - 1..]),
                }));
                Ok(out)
            }
            other => Err(unsupported(value, other, "not lowered yet")),
        }
    }

    /// `select_static` of the first static dim: a strided copy.
    fn select_static(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        dim: usize,
        index: i64,
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        // A dim of size 1 goes away without moving a value (an unsqueeze undone), in
        // any layout.
        if let Type::Ragged { dims, .. } = self.graph.ty(x) {
            if matches!(dims.get(dim), Some(ElemDim::Fixed(Dim::Static(1)))) {
                return self.alias_of(value, x, ty);
            }
        }
        self.leading(value, x)?;
        let (slot, _, tail, _) = self.data(value, x)?;
        if dim != 1 {
            return Err(unsupported(
                value,
                op,
                "only the first static dim can be selected",
            ));
        }
        let inner = volume(&tail[1..]);
        let access = Access {
            slot,
            row_stride: volume(&tail),
            col_stride: 1,
            offset: index * inner,
            row_map: None,
            col_modulo: 0,
            digits: None,
        };
        let out = self.result(value, ty)?;
        let width = volume(&tail_of(&out));
        self.program.steps.push(Step::Pointwise(Pointwise {
            out: slot_of(&out),
            rows: rows_of(&out),
            width,
            inputs: vec![access],
            expr: Expr::Load(0),
        }));
        Ok(out)
    }
}

impl Lowering<'_> {
    /// The transpose of a pair layout `x` `[M, N, *tail]` (lengths values `m`, `n`): a
    /// copy reading every row through the transposition map (types cannot tell the two
    /// dims apart when `M` and `N` are one lengths value, so the map is explicit).
    fn transpose_pairs(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        (m, n): (ValueId, ValueId),
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        let lengths = |lengths: ValueId| match self.get(lengths) {
            Lowered::Lengths(slot) => Ok(slot),
            _ => Err(unsupported(
                value,
                op,
                "its lengths are not lengths buffers",
            )),
        };
        let (m, n) = (lengths(m)?, lengths(n)?);
        let (slot, _, tail, _) = self.data(value, x)?;
        let out = self.result(value, ty)?;
        let width = volume(&tail);
        self.program.steps.push(Step::Pointwise(Pointwise {
            out: slot_of(&out),
            rows: rows_of(&out),
            width,
            inputs: vec![Access {
                row_map: Some(RowMap::PairTransposed(n, m)),
                ..Access::rows(slot, width)
            }],
            expr: Expr::Load(0),
        }));
        Ok(out)
    }
}

/// A static element dim's place in a packed row of `ty`, which holds the static dims in
/// order wherever the ragged ones are: the count of static dims before it; `None` for
/// a ragged dim or another type.
fn static_place(ty: &Type, dim: usize) -> Option<usize> {
    let Type::Ragged { dims, .. } = ty else {
        return None;
    };
    let is_static = |dim: &ElemDim| matches!(dim, ElemDim::Fixed(_));
    dims.get(dim)
        .filter(|dim| is_static(dim))
        .map(|_| dims[..dim].iter().filter(|dim| is_static(dim)).count())
}

/// The lengths a lengths op of the IR reads and the runtime's lengths op computing it
/// (repeats, slices, constants, window sizes); `None` for other ops.
fn lengths_op_kind(op: &Op) -> Option<(ValueId, LengthsKind)> {
    Some(match *op {
        Op::RepeatLengths {
            lengths,
            repeats,
            interleave,
        } => (
            lengths,
            LengthsKind::Repeat(Repeats {
                times: repeats,
                interleave,
            }),
        ),
        Op::SliceLengths {
            lengths,
            start,
            end,
        } => (lengths, LengthsKind::Slice(SliceBounds { start, end })),
        Op::ConstantLengths { lengths, size } => (lengths, LengthsKind::Constant { size }),
        Op::WindowLengths {
            lengths,
            kernel,
            stride,
            padding,
            dilation,
        } => (
            lengths,
            LengthsKind::Window {
                kernel,
                stride,
                padding,
                dilation,
            },
        ),
        _ => return None,
    })
}
