//! Attention written by hand over jagged pairs, as the fused varlen attention op.

use egg::Id;
use nestor_ir::{BinaryOp, Dim, ElemDim, Op, Type, F64};

use super::Context;
use crate::optimize::egraph::{ENode, Term};

/// `pair_matmul(softmax(scale * pair_matmul(q, transpose_ragged(k)), last), v)` as
/// `reshape_tail(attention(q', k', v', scale), [Dv])`, where `x'` is `x` seen as one
/// head (`[B; L, 1, D]`). `scale` is a constant factor or divisor of the scores (1 when
/// there is none). The runner keeps the result only when the attention op types (keys
/// and values of one lengths value) and gives the class's type.
pub(super) fn pair_attention(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
    let Op::PairMatmul { .. } = node.op else {
        return vec![];
    };
    let (weights, v) = (node.children[0], node.children[1]);
    let mut terms = Vec::new();
    for softmax in cx.nodes(weights) {
        let Op::Softmax {
            axis, log: false, ..
        } = softmax.op
        else {
            continue;
        };
        // Over the keys: the last of the scores' two element dims.
        if axis != 2 && axis != -1 {
            continue;
        }
        for (masked, causal) in causal_masked(cx, softmax.children[0]) {
            for (scores, scale) in scaled_scores(cx, masked) {
                for (q, k) in query_key(cx, scores) {
                    terms.extend(attention(cx, q, k, v, scale, causal));
                }
            }
        }
    }
    terms
}

/// The class itself (not causal), and what it masks with `causal_fill(_, -inf)`
/// (causal): keys after their query get no weight, as in causal attention.
fn causal_masked(cx: &Context, class: Id) -> Vec<(Id, bool)> {
    let mut found = vec![(class, false)];
    for node in cx.nodes(class) {
        if let Op::CausalFill { value, .. } = node.op {
            if value.0 == f64::NEG_INFINITY {
                found.push((node.children[0], true));
            }
        }
    }
    found
}

/// The scores a class scales by a constant, with the scale: `s * c`, `c * s`, `s / c`,
/// or the class itself with scale 1.
fn scaled_scores(cx: &Context, class: Id) -> Vec<(Id, f64)> {
    let mut found = vec![(class, 1.0)];
    for node in cx.nodes(class) {
        let Op::Binary { op, .. } = node.op else {
            continue;
        };
        let (a, b) = (node.children[0], node.children[1]);
        match (op, cx.constant(a), cx.constant(b)) {
            (BinaryOp::Mul, None, Some(c)) => found.push((a, c)),
            (BinaryOp::Mul, Some(c), None) => found.push((b, c)),
            (BinaryOp::Div, None, Some(c)) if c != 0.0 => found.push((a, 1.0 / c)),
            _ => {}
        }
    }
    found
}

/// `(q, k)` for every `pair_matmul(q, transpose_ragged(k))` in the class.
fn query_key(cx: &Context, class: Id) -> Vec<(Id, Id)> {
    let mut found = Vec::new();
    for node in cx.nodes(class) {
        let Op::PairMatmul { .. } = node.op else {
            continue;
        };
        for transpose in cx.nodes(node.children[1]) {
            if let Op::TransposeRagged { dim0, dim1, .. } = transpose.op {
                if (dim0, dim1) == (0, 1) || (dim0, dim1) == (1, 0) {
                    found.push((node.children[0], transpose.children[0]));
                }
            }
        }
    }
    found
}

/// The width of a `[B; L, D]` batch.
fn width(ty: Option<&Type>) -> Option<i64> {
    match ty? {
        Type::Ragged { dims, .. } => match dims.as_slice() {
            [ElemDim::Ragged(_), ElemDim::Fixed(Dim::Static(width))] => Some(*width),
            _ => None,
        },
        _ => None,
    }
}

fn attention(cx: &Context, q: Id, k: Id, v: Id, scale: f64, causal: bool) -> Option<Term> {
    let (d, dv) = (width(cx.ty(q))?, width(cx.ty(v))?);
    let one_head = |x: Id, width: i64| {
        Term::op(
            Op::ReshapeTail {
                x: nestor_ir::ValueId(0),
                tail: vec![1, width],
            },
            vec![Term::Class(x)],
        )
    };
    let fused = Term::op(
        Op::Attention {
            q: nestor_ir::ValueId(0),
            k: nestor_ir::ValueId(0),
            v: nestor_ir::ValueId(0),
            causal,
            scale: Some(F64(scale)),
        },
        vec![one_head(q, d), one_head(k, d), one_head(v, dv)],
    );
    Some(Term::op(
        Op::ReshapeTail {
            x: nestor_ir::ValueId(0),
            tail: vec![dv],
        },
        vec![fused],
    ))
}
