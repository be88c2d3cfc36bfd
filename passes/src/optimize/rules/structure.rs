//! Structure rules: padding round trips, all-true masks, view chains.

use egg::Id;
use nestor_ir::{BinaryOp, Op, Type};

use super::{is_pointwise, Context};
use crate::optimize::egraph::{ENode, Term};

pub(super) fn unpad_pad(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    let Op::Unpad { .. } = node.op else {
        return vec![];
    };
    cx.nodes(node.children[0])
        .iter()
        .filter(|pad| matches!(pad.op, Op::Pad { .. }))
        .map(|pad| pad.children[0])
        // Same type means the same lengths symbol: a batch padded by other lengths
        // is not given back.
        .filter(|&x| cx.keeps_type(class, x))
        .map(Term::Class)
        .collect()
}

/// Rank of the static tail of a padded value `[B, max(L), *tail]`.
fn padded_tail(ty: &Type) -> Option<usize> {
    match ty {
        Type::Dense { shape, .. } if shape.len() >= 2 => Some(shape.len() - 2),
        _ => None,
    }
}

pub(super) fn packed_through_pad(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
    let Op::Unpad { .. } = node.op else {
        return vec![];
    };
    let grid = node.children[0];
    let Some(tail) = cx.ty(grid).and_then(padded_tail) else {
        return vec![];
    };
    packed_grid(cx, grid, tail, 8).into_iter().collect()
}

/// The packed form of a padded grid class: the batch it pads, or a pointwise op over
/// packed grids and operands that broadcast over the tail only (so do not depend on
/// the position in the grid). `depth` bounds the search through cycles.
fn packed_grid(cx: &Context, grid: Id, tail: usize, depth: usize) -> Option<Term> {
    if depth == 0 {
        return None;
    }
    for node in cx.nodes(grid) {
        if let Op::Pad { .. } = node.op {
            return Some(Term::Class(node.children[0]));
        }
    }
    cx.nodes(grid)
        .iter()
        .filter(|node| is_pointwise(&node.op))
        .find_map(|node| {
            let operands = node
                .operands()
                .iter()
                .map(|&operand| match cx.ty(operand)? {
                    Type::Dense { shape, .. } if shape.len() <= tail => Some(Term::Class(operand)),
                    Type::Dense { .. } => packed_grid(cx, operand, tail, depth - 1),
                    _ => None,
                })
                .collect::<Option<Vec<Term>>>()?;
            Some(Term::op(node.op.clone(), operands))
        })
}

pub(super) fn all_true_mask(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    let pick = |keep: Id, mask: Id| -> Option<Term> {
        (cx.all_true(mask) && cx.keeps_type(class, keep)).then_some(Term::Class(keep))
    };
    let children = &node.children;
    let term = match node.op {
        Op::Binary {
            op: BinaryOp::Mul | BinaryOp::And,
            ..
        } => pick(children[0], children[1]).or_else(|| pick(children[1], children[0])),
        Op::Where { .. } => pick(children[1], children[0]),
        _ => None,
    };
    term.into_iter().collect()
}

pub(super) fn reshape_chain(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
    let Op::ReshapeTail { .. } = node.op else {
        return vec![];
    };
    cx.nodes(node.children[0])
        .iter()
        .filter(|inner| matches!(inner.op, Op::ReshapeTail { .. }))
        .map(|inner| Term::op(node.op.clone(), vec![Term::Class(inner.children[0])]))
        .collect()
}

pub(super) fn view_identity(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    let x = match &node.op {
        Op::ReshapeTail { .. } => Some(node.children[0]),
        Op::Dropout { p, train, .. } if !*train || p.0 == 0.0 => Some(node.children[0]),
        Op::TransposeStatic { dim0, dim1, .. } => {
            cx.nodes(node.children[0])
                .iter()
                .find_map(|inner| match inner.op {
                    Op::TransposeStatic {
                        dim0: inner0,
                        dim1: inner1,
                        ..
                    } if (inner0, inner1) == (*dim0, *dim1)
                        || (inner1, inner0) == (*dim0, *dim1) =>
                    {
                        Some(inner.children[0])
                    }
                    _ => None,
                })
        }
        _ => None,
    };
    x.filter(|&x| cx.keeps_type(class, x))
        .map(Term::Class)
        .into_iter()
        .collect()
}
