//! Pointwise ops: one `Step::Pointwise` over a fused expression, operands read through `Access` patterns (broadcasting, per-element operands, strided views).

use super::*;
use crate::step::{Pointwise, RandomMask};
use crate::Digits;
use nestor_ir::UnaryOp;

impl Lowering<'_> {
    /// Lowers a pointwise op.
    pub(super) fn lower_pointwise(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        match op {
            // Eval-mode dropout is the identity.
            Op::Dropout {
                x, train: false, ..
            } => self.alias_of(value, *x, ty),
            Op::Const {
                value: constant, ..
            } => Ok(Lowered::Const(constant.0)),
            Op::Unary { op: unary, x } => self.pointwise(value, ty, &[*x], |loads| {
                Expr::Unary(*unary, Box::new(loads[0].clone()))
            }),
            Op::Binary {
                op: binary,
                lhs,
                rhs,
            } => self.pointwise(value, ty, &[*lhs, *rhs], |loads| {
                Expr::Binary(
                    *binary,
                    Box::new(loads[0].clone()),
                    Box::new(loads[1].clone()),
                )
            }),
            Op::Where { condition, x, y } => {
                self.pointwise(value, ty, &[*condition, *x, *y], |loads| {
                    Expr::Select(
                        Box::new(loads[0].clone()),
                        Box::new(loads[1].clone()),
                        Box::new(loads[2].clone()),
                    )
                })
            }
            // `x < min ? min : (x > max ? max : x)`: NaN passes through.
            Op::Clamp { x, min, max } => self.pointwise(value, ty, &[*x], |loads| {
                let x = &loads[0];
                let bound = |value: F64| Box::new(Expr::Const(value));
                let compare =
                    |op, value| Box::new(Expr::Binary(op, Box::new(x.clone()), bound(value)));
                let upper = Expr::Select(
                    compare(BinaryOp::Gt, *max),
                    bound(*max),
                    Box::new(x.clone()),
                );
                Expr::Select(compare(BinaryOp::Lt, *min), bound(*min), Box::new(upper))
            }),
            Op::Cast { x, dtype } => match dtype {
                DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
                    self.pointwise(value, ty, &[*x], |loads| loads[0].clone())
                }
                DType::Bool => self.pointwise(value, ty, &[*x], |loads| {
                    Expr::Binary(
                        BinaryOp::Ne,
                        Box::new(loads[0].clone()),
                        Box::new(Expr::Const(F64(0.0))),
                    )
                }),
                DType::I64 => self.pointwise(value, ty, &[*x], |loads| truncated(&loads[0])),
                other => Err(unsupported(
                    value,
                    op,
                    format!("casts to {other} are not compiled"),
                )),
            },
            Op::Fused { inputs, expr } => {
                if let Some(dtype) = unsupported_cast(expr) {
                    return Err(unsupported(
                        value,
                        op,
                        format!("casts to {dtype} are not compiled"),
                    ));
                }
                self.pointwise(value, ty, inputs, |loads| translate(expr, loads))
            }
            Op::Expand { x, like, dims } => self.expand(value, ty, *x, *like, dims),
            Op::RandomMask { p, stream, .. } => {
                let out = self.result(value, ty)?;
                let width = volume(&tail_of(&out));
                self.program.steps.push(Step::RandomMask(RandomMask {
                    out: slot_of(&out),
                    rows: rows_of(&out),
                    width,
                    p: *p,
                    stream: *stream,
                }));
                Ok(out)
            }
            other => Err(unsupported(value, other, "not lowered yet")),
        }
    }

    /// `expand`: a copy that reads `x` as its type with the size-1 dims inserted.
    fn expand(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        like: ValueId,
        dims: &[i64],
    ) -> Result<Lowered, LowerError> {
        if let Lowered::Const(_) = self.get(x) {
            // A constant fills the result whatever its shape.
            return self.pointwise(value, ty, &[x], |loads| loads[0].clone());
        }
        let op = self.graph.op(value);
        let inserted = nestor_ir::with_inserted_dims(self.graph.ty(x), self.graph.ty(like), dims)
            .map_err(|reason| unsupported(value, op, reason))?;
        let (slot, ..) = self.data(value, x)?;
        let tail = inserted.ragged_tail().unwrap_or_default();
        let out = self.result(value, ty)?;
        let out_tail = tail_of(&out);
        let access = self.access_as(value, ty, (x, &inserted), slot, &tail, &out_tail)?;
        self.program.steps.push(Step::Pointwise(Pointwise {
            out: slot_of(&out),
            rows: rows_of(&out),
            width: volume(&out_tail),
            inputs: vec![access],
            expr: Expr::Load(0),
        }));
        Ok(out)
    }

    pub(super) fn pointwise(
        &mut self,
        value: ValueId,
        ty: &Type,
        operands: &[ValueId],
        build: impl Fn(&[Expr]) -> Expr,
    ) -> Result<Lowered, LowerError> {
        let out = self.result(value, ty)?;
        let (out_slot, out_rows, out_tail) = (slot_of(&out), rows_of(&out), tail_of(&out));
        let mut inputs = Vec::new();
        let mut loads = Vec::new();
        for &operand in operands {
            match self.get(operand) {
                Lowered::Const(constant) => loads.push(Expr::Const(F64(constant))),
                Lowered::Lengths(_) => {
                    return Err(unsupported(
                        value,
                        self.graph.op(value),
                        "lengths are not elementwise operands",
                    ))
                }
                Lowered::Data { slot, tail, .. } => {
                    self.floats(value, slot)?;
                    let access = self.access(value, ty, operand, slot, &tail, &out_tail)?;
                    loads.push(Expr::Load(inputs.len()));
                    inputs.push(access);
                }
            }
        }
        self.program.steps.push(Step::Pointwise(Pointwise {
            out: out_slot,
            rows: out_rows,
            width: volume(&out_tail),
            inputs,
            expr: build(&loads),
        }));
        Ok(out)
    }

    /// How an operand is read by a pointwise step whose output has type `ty`.
    pub(super) fn access(
        &mut self,
        value: ValueId,
        ty: &Type,
        operand: ValueId,
        slot: Slot,
        tail: &[i64],
        out_tail: &[i64],
    ) -> Result<Access, LowerError> {
        let operand_ty = self.graph.ty(operand);
        self.access_as(value, ty, (operand, operand_ty), slot, tail, out_tail)
    }

    /// [`Self::access`] of an operand seen with type `operand_ty` (its buffer read as
    /// that shape: `expand` inserts size-1 dims).
    fn access_as(
        &mut self,
        value: ValueId,
        ty: &Type,
        (operand, operand_ty): (ValueId, &Type),
        slot: Slot,
        tail: &[i64],
        out_tail: &[i64],
    ) -> Result<Access, LowerError> {
        let op = self.graph.op(value);
        let (row_use, operand_tail) = self.operand_rows(value, ty, (operand, operand_ty), tail)?;
        // Right-align the operand tail to the output tail.
        let padded: Vec<i64> = if operand_tail.len() <= out_tail.len() {
            std::iter::repeat_n(1, out_tail.len() - operand_tail.len())
                .chain(operand_tail.iter().copied())
                .collect()
        } else {
            return Err(unsupported(
                value,
                op,
                format!("operand {operand} has more dims than the result"),
            ));
        };
        // How a row's columns are read: as they are, one value, a broadcast tail
        // (wrapped), or any other broadcast (digits).
        let (col_stride, col_modulo, digits) = if padded == out_tail {
            (1, 0, None)
        } else if padded.iter().all(|&size| size == 1) {
            (0, 0, None)
        } else {
            let first = padded.iter().position(|&size| size != 1).unwrap_or(0);
            if padded[first..] == out_tail[first..] {
                (1, volume(&out_tail[first..]), None)
            } else {
                let digits = Digits::broadcast(&padded, out_tail).ok_or_else(|| {
                    unsupported(
                        value,
                        op,
                        format!("broadcasting {padded:?} over {out_tail:?} is not compiled"),
                    )
                })?;
                (1, 0, Some(digits))
            }
        };
        let row_stride = volume(
            &padded
                .iter()
                .copied()
                .filter(|&size| size != 1)
                .collect::<Vec<_>>(),
        )
        .max(1);
        let row_stride = if col_stride == 0 { 1 } else { row_stride };
        let (row_stride, row_map) = match row_use {
            RowUse::Full => (row_stride, None),
            RowUse::Broadcast => (0, None),
            RowUse::PerElement(lengths) => (row_stride, Some(RowMap::Owners(lengths))),
            RowUse::Mapped(map) => (row_stride, Some(map)),
        };
        Ok(Access {
            slot,
            row_stride,
            col_stride,
            offset: 0,
            row_map,
            col_modulo,
            digits,
        })
    }

    /// [`Self::operand_rows`] of a ragged operand (element dims `operand_dims`) of a
    /// ragged result (element dims `dims`): the same rows, or a pair layout's rows
    /// through a map.
    fn ragged_operand_rows(
        &self,
        value: ValueId,
        ty: &Type,
        (operand, operand_ty): (ValueId, &Type),
        tail: &[i64],
        (dims, operand_dims): (&[ElemDim], &[ElemDim]),
    ) -> Result<(RowUse, Vec<i64>), LowerError> {
        let op = self.graph.op(value);
        let ragged = |dims: &[ElemDim]| -> Vec<(usize, ValueId)> {
            dims.iter()
                .enumerate()
                .filter_map(|(dim, size)| match size {
                    ElemDim::Ragged(lengths) => Some((dim, *lengths)),
                    ElemDim::Fixed(_) => None,
                })
                .collect()
        };
        let (out_ragged, own) = (ragged(dims), ragged(operand_dims));
        if out_ragged == own {
            return Ok((RowUse::Full, tail.to_vec()));
        }
        // A pair layout [M, N, ...] read by an operand [M, 1, ...] or [1, N, ...]:
        // its rows through a map, its size-1 dim dropped from its tail.
        let lengths = |lengths: ValueId| match self.get(lengths) {
            Lowered::Lengths(slot) => Some(slot),
            _ => None,
        };
        let map = match (out_ragged.as_slice(), own.as_slice()) {
            ([(0, m), (1, n)], [(0, mine)]) if mine == m => lengths(*m)
                .zip(lengths(*n))
                .map(|(m, n)| RowMap::PairRows(m, n)),
            ([(0, m), (1, n)], [(1, mine)]) if mine == n => lengths(*m)
                .zip(lengths(*n))
                .map(|(m, n)| RowMap::PairColumns(m, n)),
            _ => None,
        };
        let Some(map) = map else {
            return Err(unsupported(
                value,
                op,
                format!(
                    "broadcasting {operand} ({operand_ty}) over the ragged dims of {ty} \
                     is not compiled (only [M, 1, ...] and [1, N, ...] over a pair \
                     layout [M, N, ...])"
                ),
            ));
        };
        let own_tail: Vec<i64> = operand_dims
            .iter()
            .enumerate()
            .filter(|(dim, _)| !out_ragged.iter().any(|(d, _)| d == dim))
            .map(|(_, size)| match size {
                ElemDim::Fixed(size) => size.as_static().unwrap_or(1),
                ElemDim::Ragged(_) => 1,
            })
            .collect();
        Ok((RowUse::Mapped(map), own_tail))
    }

    /// [`Self::operand_rows`] of a dense operand (`shape`) of a dense result
    /// (`out_shape`): padded grids of the same shape, equal or broadcast rows.
    fn dense_operand_rows(
        &self,
        value: ValueId,
        ty: &Type,
        (operand, operand_ty): (ValueId, &Type),
        (out_shape, shape): (&[Dim], &[Dim]),
    ) -> Result<(RowUse, Vec<i64>), LowerError> {
        let op = self.graph.op(value);
        if let [_, Dim::Max(_), rest @ ..] = shape {
            // Padded grids: rows are `B x max(L)`; only same-shape operands.
            if shape != out_shape {
                return Err(unsupported(
                    value,
                    op,
                    format!("cannot broadcast {operand_ty} into {ty}"),
                ));
            }
            Ok((RowUse::Full, self.static_tail(operand, rest)?))
        } else if shape.len() == out_shape.len() && !shape.is_empty() {
            let row = if shape[0] == out_shape[0] {
                RowUse::Full
            } else {
                RowUse::Broadcast
            };
            Ok((row, self.static_tail(operand, &shape[1..])?))
        } else {
            let all: Vec<i64> = shape
                .iter()
                .map(|dim| dim.as_static().unwrap_or(-1))
                .collect();
            Ok((RowUse::Broadcast, all))
        }
    }

    /// How an operand's rows relate to the rows of a pointwise result of type `ty`, and
    /// the operand's tail (to be right-aligned to the result's).
    fn operand_rows(
        &mut self,
        value: ValueId,
        ty: &Type,
        (operand, operand_ty): (ValueId, &Type),
        tail: &[i64],
    ) -> Result<(RowUse, Vec<i64>), LowerError> {
        let op = self.graph.op(value);
        Ok(match (ty, operand_ty) {
            (
                Type::Ragged { dims, .. },
                Type::Ragged {
                    dims: operand_dims, ..
                },
            ) => self.ragged_operand_rows(
                value,
                ty,
                (operand, operand_ty),
                tail,
                (dims, operand_dims),
            )?,
            (Type::Ragged { dims, batch, .. }, Type::Dense { shape, .. }) => {
                let rank = dims.len();
                let static_shape: Vec<i64> = shape
                    .iter()
                    .map(|dim| dim.as_static().unwrap_or(-1))
                    .collect();
                // The operand's sizes at the result's static dims, in order: the packed
                // rows stand for the batch and the ragged dims (where type inference
                // made the operand's size 1), the tail for the static dims.
                let at_static = |element: &[i64]| -> Vec<i64> {
                    element
                        .iter()
                        .zip(dims)
                        .filter(|(_, dim)| matches!(dim, ElemDim::Fixed(_)))
                        .map(|(&size, _)| size)
                        .collect()
                };
                if shape.len() == rank + 1 {
                    let per_element = shape[0] == *batch && shape[0] != Dim::Static(1);
                    let ragged_lengths = ty.length_values();
                    // An element's rows: one ragged dim's, or two's (`H_i W_i`).
                    let lengths = match ragged_lengths.as_slice() {
                        [lengths] => match self.get(*lengths) {
                            Lowered::Lengths(slot) => Some(slot),
                            _ => None,
                        },
                        [first, second] => match (self.get(*first), self.get(*second)) {
                            (Lowered::Lengths(first), Lowered::Lengths(second)) => {
                                Some(self.element_rows(first, second))
                            }
                            _ => None,
                        },
                        _ => None,
                    };
                    match (per_element, lengths) {
                        (true, Some(lengths)) => {
                            (RowUse::PerElement(lengths), at_static(&static_shape[1..]))
                        }
                        (false, _) => (RowUse::Broadcast, at_static(&static_shape[1..])),
                        (true, None) => {
                            return Err(unsupported(
                                value,
                                op,
                                "a per-element operand over more than two ragged dims",
                            ))
                        }
                    }
                } else {
                    // A tail, right-aligned to the element dims (1 at the ragged ones).
                    let element: Vec<i64> =
                        std::iter::repeat_n(1, rank.saturating_sub(shape.len()))
                            .chain(static_shape)
                            .collect();
                    (RowUse::Broadcast, at_static(&element))
                }
            }
            (
                Type::Dense {
                    shape: out_shape, ..
                },
                Type::Dense { shape, .. },
            ) => self.dense_operand_rows(value, ty, (operand, operand_ty), (out_shape, shape))?,
            _ => {
                return Err(unsupported(
                    value,
                    op,
                    format!("cannot broadcast {operand_ty} into {ty}"),
                ))
            }
        })
    }
}

/// A fused expression as a kernel expression over the loads of its inputs (casts
/// between float types are free: a program computes in one float type).
pub(super) fn translate(expr: &FusedExpr, loads: &[Expr]) -> Expr {
    let recurse = |expr: &FusedExpr| Box::new(translate(expr, loads));
    match expr {
        FusedExpr::Input(index) => loads[*index].clone(),
        FusedExpr::Const { value, .. } => Expr::Const(*value),
        FusedExpr::Unary(op, x) => Expr::Unary(*op, recurse(x)),
        FusedExpr::Binary(op, a, b) => Expr::Binary(*op, recurse(a), recurse(b)),
        FusedExpr::Where(c, a, b) => Expr::Select(recurse(c), recurse(a), recurse(b)),
        FusedExpr::Cast(DType::Bool, x) => {
            Expr::Binary(BinaryOp::Ne, recurse(x), Box::new(Expr::Const(F64(0.0))))
        }
        FusedExpr::Cast(DType::I64, x) => truncated(&recurse(x)),
        FusedExpr::Cast(_, x) => *recurse(x),
    }
}

/// `x` rounded toward zero: a cast to i64 computed in the float type (exact: the
/// rounded value of a float is a float) and converted at the boundary by libtorch, so
/// NaN and values out of range convert as eager's cast does.
fn truncated(x: &Expr) -> Expr {
    let negative = Expr::Binary(
        BinaryOp::Lt,
        Box::new(x.clone()),
        Box::new(Expr::Const(F64(0.0))),
    );
    Expr::Select(
        Box::new(negative),
        Box::new(Expr::Unary(UnaryOp::Ceil, Box::new(x.clone()))),
        Box::new(Expr::Unary(UnaryOp::Floor, Box::new(x.clone()))),
    )
}

/// The first cast in `expr` to a type compiled code does not compute in.
pub(super) fn unsupported_cast(expr: &FusedExpr) -> Option<DType> {
    match expr {
        FusedExpr::Input(_) | FusedExpr::Const { .. } => None,
        FusedExpr::Cast(dtype, _)
            if !matches!(
                dtype,
                DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::Bool | DType::I64
            ) =>
        {
            Some(*dtype)
        }
        FusedExpr::Unary(_, x) | FusedExpr::Cast(_, x) => unsupported_cast(x),
        FusedExpr::Binary(_, a, b) => unsupported_cast(a).or_else(|| unsupported_cast(b)),
        FusedExpr::Where(c, a, b) => unsupported_cast(c)
            .or_else(|| unsupported_cast(a))
            .or_else(|| unsupported_cast(b)),
    }
}
