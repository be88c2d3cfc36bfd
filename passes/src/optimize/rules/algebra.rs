//! Algebra rules: identities exact in floating point.

use egg::Id;
use nestor_ir::{BinaryOp, DType, Op, Type, UnaryOp};

use super::Context;
use crate::optimize::egraph::{ENode, Term};

/// The operand a binary op keeps when its other operand is the constant `identity`
/// (on the right only, or on either side when `commutes`).
fn identity_operand(cx: &Context, node: &ENode, identity: f64, commutes: bool) -> Option<Id> {
    let is_identity = |class: Id| {
        cx.constant(class)
            .is_some_and(|value| value.to_bits() == identity.to_bits())
    };
    let (lhs, rhs) = (node.children[0], node.children[1]);
    if is_identity(rhs) {
        Some(lhs)
    } else if commutes && is_identity(lhs) {
        Some(rhs)
    } else {
        None
    }
}

/// The operand a binary op keeps when its other operand is the identity of one of
/// `cases` (`(op, identity, commutes)`), if that keeps the type.
fn drop_identity(
    cx: &Context,
    class: Id,
    node: &ENode,
    cases: &[(BinaryOp, f64, bool)],
) -> Vec<Term> {
    let Op::Binary { op, .. } = node.op else {
        return vec![];
    };
    cases
        .iter()
        .filter(|(case, ..)| *case == op)
        .find_map(|&(_, identity, commutes)| identity_operand(cx, node, identity, commutes))
        .filter(|&x| cx.keeps_type(class, x))
        .map(Term::Class)
        .into_iter()
        .collect()
}

pub(super) fn mul_one(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    drop_identity(
        cx,
        class,
        node,
        &[(BinaryOp::Mul, 1.0, true), (BinaryOp::Div, 1.0, false)],
    )
}

pub(super) fn add_negative_zero(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    drop_identity(
        cx,
        class,
        node,
        &[(BinaryOp::Add, -0.0, true), (BinaryOp::Sub, 0.0, false)],
    )
}

pub(super) fn double_negation(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    let neg = |node: &ENode| {
        matches!(
            node.op,
            Op::Unary {
                op: UnaryOp::Neg,
                ..
            }
        )
    };
    if !neg(node) {
        return vec![];
    }
    cx.nodes(node.children[0])
        .iter()
        .filter(|inner| neg(inner))
        .map(|inner| inner.children[0])
        .filter(|&x| cx.keeps_type(class, x))
        .map(Term::Class)
        .collect()
}

/// Whether every value of `narrow` is a value of `wide`.
fn holds_every_value(narrow: DType, wide: DType) -> bool {
    use DType::*;
    narrow == wide
        || match wide {
            F64 => matches!(narrow, F32 | F16 | BF16 | I32 | I16 | I8 | U8 | Bool),
            F32 => matches!(narrow, F16 | BF16 | I16 | I8 | U8 | Bool),
            F16 => matches!(narrow, I8 | U8 | Bool),
            BF16 => matches!(narrow, I8 | U8 | Bool),
            I64 => matches!(narrow, I32 | I16 | I8 | U8 | Bool),
            I32 => matches!(narrow, I16 | I8 | U8 | Bool),
            I16 => matches!(narrow, I8 | U8 | Bool),
            I8 | U8 | Bool => false,
        }
}

pub(super) fn cast_round_trip(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    let Op::Cast { .. } = node.op else {
        return vec![];
    };
    let middle = node.children[0];
    let Some(wide) = cx.ty(middle).and_then(Type::dtype) else {
        return vec![];
    };
    let mut terms: Vec<Term> = Vec::new();
    // A cast to the type a value already has is the value.
    if cx.keeps_type(class, middle) {
        terms.push(Term::Class(middle));
    }
    for inner in cx.nodes(middle) {
        let Op::Cast { .. } = inner.op else { continue };
        let x = inner.children[0];
        let narrow = cx.ty(x).and_then(Type::dtype);
        if narrow.is_some_and(|narrow| holds_every_value(narrow, wide)) && cx.keeps_type(class, x) {
            terms.push(Term::Class(x));
        }
    }
    terms
}
