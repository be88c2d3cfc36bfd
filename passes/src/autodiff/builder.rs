//! The graph a backward pass is written into, with the few shapes of op every rule
//! needs (arithmetic, constants, reductions, spreading a reduction back, sums over the
//! dims an operand was broadcast along).

use nestor_ir::{BinaryOp, DType, Dim, ElemDim, Graph, Op, ReduceOp, Type, UnaryOp, ValueId, F64};

use super::AutodiffError;
pub(super) use crate::count::rank;
use crate::count::CountError;

/// The joint graph under construction; `at` names the value whose rule is running (for
/// errors).
pub(super) struct Builder {
    graph: Graph,
    at: ValueId,
}

impl Builder {
    pub(super) fn new(graph: Graph) -> Self {
        Self {
            graph,
            at: ValueId(0),
        }
    }

    /// The value whose rule runs next.
    pub(super) fn at(&mut self, value: ValueId) {
        self.at = value;
    }

    pub(super) fn finish(self) -> Graph {
        self.graph
    }

    pub(super) fn ty(&self, value: ValueId) -> &Type {
        self.graph.ty(value)
    }

    pub(super) fn op(&self, value: ValueId) -> &Op {
        self.graph.op(value)
    }

    /// The sum of a value's cotangent `contributions`, in order. When they are every
    /// slice of one stacked value put back in place (`insert_static(select_static(s,
    /// d, i), d, i, n)` for each `i` in `0..n`, as the gradients of self-attention's
    /// queries, keys and values of one projection are), the sum is `s` itself: no
    /// zeros, no copies, no additions.
    pub(super) fn sum(&mut self, contributions: &[ValueId]) -> Result<ValueId, AutodiffError> {
        if let Some(stacked) = self.restacked(contributions) {
            return Ok(stacked);
        }
        let (&first, rest) = contributions
            .split_first()
            .ok_or_else(|| self.no_rule("a cotangent without contributions"))?;
        rest.iter()
            .try_fold(first, |total, &contribution| self.add(total, contribution))
    }

    /// The value whose every slice `contributions` put back in place, if they do.
    fn restacked(&self, contributions: &[ValueId]) -> Option<ValueId> {
        let mut stacked = None;
        let mut seen = vec![false; contributions.len()];
        for &contribution in contributions {
            let Op::InsertStatic {
                x,
                dim,
                index,
                size,
            } = *self.op(contribution)
            else {
                return None;
            };
            let Op::SelectStatic {
                x: source,
                dim: selected_dim,
                index: selected,
            } = *self.op(x)
            else {
                return None;
            };
            let slot = usize::try_from(index).ok()?;
            let fits = size == contributions.len() as i64 && selected == index;
            if !fits || selected_dim != dim || seen.get(slot) != Some(&false) {
                return None;
            }
            seen[slot] = true;
            if *stacked.get_or_insert(source) != source {
                return None;
            }
        }
        // Every index once (counted above) and the stack of the same type as the sum.
        let source = stacked?;
        (self.ty(source) == self.ty(*contributions.first()?)).then_some(source)
    }

    /// How many values of `x` a reduction over `dims` (normalized) combines
    /// ([`crate::count::count`]).
    pub(super) fn count(&mut self, x: ValueId, dims: &[i64]) -> Result<ValueId, AutodiffError> {
        crate::count::count(&mut self.graph, x, dims).map_err(|error| match error {
            CountError::Verify(error) => AutodiffError::Rule {
                value: self.at,
                op: self.graph.op(self.at).name(),
                reason: error.to_string(),
            },
            CountError::Unsupported(reason) => self.no_rule(reason),
        })
    }

    /// The error for an op this rule cannot differentiate.
    pub(super) fn no_rule(&self, reason: impl Into<String>) -> AutodiffError {
        AutodiffError::NoRule {
            value: self.at,
            op: self.graph.op(self.at).name(),
            reason: reason.into(),
        }
    }

    pub(super) fn push(&mut self, op: Op) -> Result<ValueId, AutodiffError> {
        self.graph.push(op).map_err(|error| AutodiffError::Rule {
            value: self.at,
            op: self.graph.op(self.at).name(),
            reason: error.to_string(),
        })
    }

    /// A 0-d constant of the float type of `like`.
    pub(super) fn constant(&mut self, value: f64, like: ValueId) -> Result<ValueId, AutodiffError> {
        let dtype = self.ty(like).dtype().filter(|dtype| dtype.is_float());
        self.push(Op::Const {
            value: F64(value),
            dtype: dtype.unwrap_or(DType::F32),
        })
    }

    pub(super) fn unary(&mut self, op: UnaryOp, x: ValueId) -> Result<ValueId, AutodiffError> {
        self.push(Op::Unary { op, x })
    }

    pub(super) fn binary(
        &mut self,
        op: BinaryOp,
        lhs: ValueId,
        rhs: ValueId,
    ) -> Result<ValueId, AutodiffError> {
        self.push(Op::Binary { op, lhs, rhs })
    }

    pub(super) fn add(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, AutodiffError> {
        self.binary(BinaryOp::Add, a, b)
    }

    pub(super) fn sub(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, AutodiffError> {
        self.binary(BinaryOp::Sub, a, b)
    }

    pub(super) fn mul(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, AutodiffError> {
        self.binary(BinaryOp::Mul, a, b)
    }

    pub(super) fn div(&mut self, a: ValueId, b: ValueId) -> Result<ValueId, AutodiffError> {
        self.binary(BinaryOp::Div, a, b)
    }

    /// `x * factor`.
    pub(super) fn scale(&mut self, x: ValueId, factor: f64) -> Result<ValueId, AutodiffError> {
        let factor = self.constant(factor, x)?;
        self.mul(x, factor)
    }

    /// `condition ? x : y`.
    pub(super) fn select(
        &mut self,
        condition: ValueId,
        x: ValueId,
        y: ValueId,
    ) -> Result<ValueId, AutodiffError> {
        self.push(Op::Where { condition, x, y })
    }

    pub(super) fn reduce(
        &mut self,
        op: ReduceOp,
        x: ValueId,
        dims: Vec<i64>,
        keepdim: bool,
    ) -> Result<ValueId, AutodiffError> {
        self.push(Op::Reduce {
            op,
            x,
            dims,
            keepdim,
            correction: 0,
        })
    }

    /// `x` spread over the shape of `like` (size-1 dims inserted at `dims` first).
    pub(super) fn expand(
        &mut self,
        x: ValueId,
        like: ValueId,
        dims: Vec<i64>,
    ) -> Result<ValueId, AutodiffError> {
        self.push(Op::Expand { x, like, dims })
    }

    /// `gradient`, a cotangent of the shape an elementwise op broadcast `operand` to,
    /// summed over the broadcast dims and converted to `operand`'s dtype.
    pub(super) fn unbroadcast(
        &mut self,
        gradient: ValueId,
        operand: ValueId,
    ) -> Result<ValueId, AutodiffError> {
        let (from, to) = (self.ty(gradient).clone(), self.ty(operand).clone());
        let queries_broadcast = matches!(
            (&from, &to),
            (Type::Ragged { dims: full, .. }, Type::Ragged { dims: own, .. })
                if matches!(full.as_slice(), [ElemDim::Ragged(_), ElemDim::Ragged(_), ..])
                    && matches!(own.as_slice(), [ElemDim::Fixed(Dim::Static(1)), ElemDim::Ragged(_), ..])
        );
        let reduced = if same_shape(&from, &to) {
            gradient
        } else if queries_broadcast {
            // `[1, N, ...]` broadcast over a pair layout `[M, N, ...]`: the sum over `M`,
            // the pairs' first ragged dim, is the sum over the second of their transpose.
            let swap = |b: &mut Self, x: ValueId| {
                b.push(Op::TransposeRagged {
                    x,
                    dim0: 0,
                    dim1: 1,
                })
            };
            let transposed = swap(self, gradient)?;
            let sum = self.reduce(ReduceOp::Sum, transposed, vec![2], true)?;
            swap(self, sum)?
        } else {
            let (dropped, kept) = broadcast_dims(&from, &to)
                .ok_or_else(|| self.no_rule(format!("the gradient of {to} broadcast to {from}")))?;
            // The sum over the operand's size-1 dims, then over the dims it lacks.
            let mut sum = gradient;
            if !kept.is_empty() {
                sum = self.reduce(ReduceOp::Sum, sum, kept, true)?;
            }
            if !dropped.is_empty() {
                sum = self.reduce(ReduceOp::Sum, sum, dropped, false)?;
            }
            if !same_shape(self.ty(sum), &to) {
                return Err(self.no_rule(format!("the gradient of {to} broadcast to {from}")));
            }
            sum
        };
        self.cast_like(reduced, operand)
    }

    /// `x` converted to the dtype of `like` (itself when they agree).
    pub(super) fn cast_like(
        &mut self,
        x: ValueId,
        like: ValueId,
    ) -> Result<ValueId, AutodiffError> {
        match self.ty(like).dtype() {
            Some(dtype) if self.ty(x).dtype() != Some(dtype) => self.push(Op::Cast { x, dtype }),
            _ => Ok(x),
        }
    }
}

fn same_shape(a: &Type, b: &Type) -> bool {
    a.with_dtype(DType::F32) == b.with_dtype(DType::F32)
}

/// The batch-first dims of `full` a smaller `operand` was broadcast along: those it
/// lacks (leading: a sum drops them) and its size-1 dims (a sum keeps them).
fn broadcast_dims(full: &Type, operand: &Type) -> Option<(Vec<i64>, Vec<i64>)> {
    let full_dims: Vec<Option<i64>> = match full {
        Type::Ragged { dims, .. } => std::iter::once(None)
            .chain(dims.iter().map(|dim| match dim {
                ElemDim::Fixed(Dim::Static(size)) => Some(*size),
                _ => None,
            }))
            .collect(),
        Type::Dense { shape, .. } => shape.iter().map(Dim::as_static).collect(),
        Type::Lengths { .. } => return None,
    };
    let operand_dims: Vec<Option<i64>> = match operand {
        Type::Dense { shape, .. } => shape.iter().map(Dim::as_static).collect(),
        Type::Ragged { dims, .. } => std::iter::once(None)
            .chain(dims.iter().map(|dim| match dim {
                ElemDim::Fixed(Dim::Static(size)) => Some(*size),
                _ => None,
            }))
            .collect(),
        Type::Lengths { .. } => return None,
    };
    let missing = full_dims.len().checked_sub(operand_dims.len())?;
    let kept: Vec<i64> = operand_dims
        .iter()
        .enumerate()
        .filter(|(index, size)| **size == Some(1) && full_dims[missing + index] != Some(1))
        .map(|(index, _)| (missing + index) as i64)
        .collect();
    Some(((0..missing as i64).collect(), kept))
}
