//! Fusion rules: pointwise DAGs into `fused` ops, pointwise prologues into row and
//! segmented ops, pointwise epilogues into GEMMs; each only into a value's single reader.

use egg::Id;
use nestor_ir::{FusedExpr, Op, ReduceOp, ValueId};

use super::Context;
use crate::optimize::egraph::{ENode, Term};

/// The parts of `node`'s expression: child `position` replaced by what `inner` builds,
/// every other child an input (numbered in first-use order).
fn splice(
    cx: &Context,
    node: &ENode,
    position: usize,
    inputs: &mut Inputs,
    inner: impl Fn(&mut Inputs) -> FusedExpr,
) -> Vec<FusedExpr> {
    node.children
        .iter()
        .enumerate()
        .map(|(index, &other)| {
            if index == position {
                inner(inputs)
            } else {
                inputs.input(cx.find(other))
            }
        })
        .collect()
}

/// Whether an op is pointwise (one kernel that may join a fused expression).
pub fn is_pointwise(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary { .. }
            | Op::Binary { .. }
            | Op::Where { .. }
            | Op::Cast { .. }
            | Op::Fused { .. }
    )
}

/// The number of operations in an expression (what a fused node computes).
fn size(expr: &FusedExpr) -> usize {
    match expr {
        FusedExpr::Input(_) | FusedExpr::Const { .. } => 1,
        FusedExpr::Unary(_, x) | FusedExpr::Cast(_, x) => 1 + size(x),
        FusedExpr::Binary(_, a, b) => 1 + size(a) + size(b),
        FusedExpr::Where(c, a, b) => 1 + size(c) + size(a) + size(b),
    }
}

/// The pointwise node of `class` that computes the most (the largest fusion so far),
/// if the class has one. Fusion grows only from it: the smaller forms of a class would
/// add fusions the extractor never prefers, and their number grows exponentially
/// along chains of pointwise ops (backward graphs are long such chains).
fn largest<'a>(cx: &'a Context, class: Id) -> Option<&'a ENode> {
    cx.nodes(class)
        .iter()
        .filter(|node| is_pointwise(&node.op) || matches!(node.op, Op::Const { .. }))
        .max_by_key(|node| expression(node).map_or(0, |expr| size(&expr)))
}

/// Whether `node` is the largest pointwise form of its class.
fn is_largest(cx: &Context, class: Id, node: &ENode) -> bool {
    largest(cx, class).is_some_and(|largest| std::ptr::eq(largest, node))
}

/// A pointwise node as an expression over its children (`$n` is child `n`).
fn expression(node: &ENode) -> Option<FusedExpr> {
    let input = |index: usize| Box::new(FusedExpr::Input(index));
    Some(match &node.op {
        Op::Unary { op, .. } => FusedExpr::Unary(*op, input(0)),
        Op::Binary { op, .. } => FusedExpr::Binary(*op, input(0), input(1)),
        Op::Where { .. } => FusedExpr::Where(input(0), input(1), input(2)),
        Op::Cast { dtype, .. } => FusedExpr::Cast(*dtype, input(0)),
        Op::Fused { expr, .. } => expr.clone(),
        Op::Const { value, dtype } => FusedExpr::Const {
            value: *value,
            dtype: *dtype,
        },
        _ => return None,
    })
}

/// `expr` with `$n` replaced by `parts[n]`.
pub fn substitute(expr: &FusedExpr, parts: &[FusedExpr]) -> FusedExpr {
    let recurse = |expr: &FusedExpr| Box::new(substitute(expr, parts));
    match expr {
        FusedExpr::Input(index) => parts[*index].clone(),
        FusedExpr::Const { .. } => expr.clone(),
        FusedExpr::Unary(op, x) => FusedExpr::Unary(*op, recurse(x)),
        FusedExpr::Binary(op, a, b) => FusedExpr::Binary(*op, recurse(a), recurse(b)),
        FusedExpr::Where(c, a, b) => FusedExpr::Where(recurse(c), recurse(a), recurse(b)),
        FusedExpr::Cast(dtype, x) => FusedExpr::Cast(*dtype, recurse(x)),
    }
}

/// A fused expression over distinct inputs, built child by child.
/// (Its expression's `$n` is input `n + offset`: an epilogue keeps `$0` for the GEMM.)
#[derive(Default)]
struct Inputs {
    classes: Vec<Id>,
    offset: usize,
}

impl Inputs {
    fn input(&mut self, class: Id) -> FusedExpr {
        let index = self
            .classes
            .iter()
            .position(|&seen| seen == class)
            .unwrap_or_else(|| {
                self.classes.push(class);
                self.classes.len() - 1
            });
        FusedExpr::Input(index + self.offset)
    }

    fn terms(self) -> Vec<Term> {
        self.classes.into_iter().map(Term::Class).collect()
    }
}

pub(super) fn fuse_pointwise(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    let Some(outer) = expression(node).filter(|_| is_pointwise(&node.op)) else {
        return vec![];
    };
    if !is_largest(cx, class, node) {
        return vec![];
    }
    let mut terms = Vec::new();
    for (position, &child) in node.children.iter().enumerate() {
        let child = cx.find(child);
        // A value another op (or the caller) still needs is computed once, by itself.
        let constant = cx.constant(child).is_some();
        if !constant && !cx.single_reader(child) {
            continue;
        }
        if let Some(inner) = largest(cx, child) {
            let Some(inner_expr) = expression(inner) else {
                continue;
            };
            let mut inputs = Inputs::default();
            let parts = splice(cx, node, position, &mut inputs, |inputs| {
                let inner_parts: Vec<FusedExpr> = inner
                    .children
                    .iter()
                    .map(|&grandchild| inputs.input(cx.find(grandchild)))
                    .collect();
                substitute(&inner_expr, &inner_parts)
            });
            let expr = substitute(&outer, &parts);
            let fused = Op::Fused {
                inputs: vec![ValueId(0); inputs.classes.len()],
                expr,
            };
            terms.push(Term::op(fused, inputs.terms()));
        }
    }
    terms
}

pub(super) fn fuse_prologue(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
    let core = match &node.op {
        Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Softmax { .. } => &node.op,
        Op::Reduce {
            op: ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Amax | ReduceOp::Amin,
            dims,
            ..
        } if dims.len() == 1 => &node.op,
        _ => return vec![],
    };
    let input = node.children[0];
    if !cx.single_reader(input) {
        return vec![];
    }
    let params: Vec<Term> = node.children[1..].iter().map(|&c| Term::Class(c)).collect();
    largest(cx, input)
        .into_iter()
        .filter(|pointwise| is_pointwise(&pointwise.op))
        .filter_map(|pointwise| {
            let mut inputs = Inputs::default();
            let parts: Vec<FusedExpr> = pointwise
                .children
                .iter()
                .map(|&child| inputs.input(cx.find(child)))
                .collect();
            let expr = substitute(&expression(pointwise)?, &parts);
            let count = inputs.classes.len();
            Some(Term::op(
                Op::Prologue {
                    inputs: vec![ValueId(0); count],
                    expr,
                    core: Box::new(core.clone()),
                },
                [inputs.terms(), params.clone()].concat(),
            ))
        })
        .collect()
}

/// A node that computes a GEMM's result, then maybe an epilogue: the GEMM, its
/// operands' classes, and the epilogue so far (`$0` the result) over further classes.
fn gemm_with_epilogue(node: &ENode) -> Option<(&Op, &[Id], FusedExpr, &[Id])> {
    match &node.op {
        Op::Linear { .. } | Op::Matmul { .. } => {
            Some((&node.op, &node.children[..], FusedExpr::Input(0), &[]))
        }
        Op::Epilogue { core, expr, .. } => {
            let split = core.operands().len();
            Some((
                &**core,
                &node.children[..split],
                expr.clone(),
                &node.children[split..],
            ))
        }
        _ => None,
    }
}

pub(super) fn fuse_epilogue(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    let Some(outer) = expression(node).filter(|_| is_pointwise(&node.op)) else {
        return vec![];
    };
    if !is_largest(cx, class, node) {
        return vec![];
    }
    let mut terms = Vec::new();
    for (position, &child) in node.children.iter().enumerate() {
        if !cx.single_reader(child) {
            continue;
        }
        // The GEMM with the largest epilogue so far.
        let producer = cx
            .nodes(child)
            .iter()
            .filter_map(|producer| gemm_with_epilogue(producer))
            .max_by_key(|(_, _, inner, _)| size(inner));
        if let Some((core, core_children, inner, inner_inputs)) = producer {
            // `$0` stays the GEMM's result; every other value read becomes `$1...`.
            let mut inputs = Inputs {
                classes: Vec::new(),
                offset: 1,
            };
            let inner_parts: Vec<FusedExpr> = std::iter::once(FusedExpr::Input(0))
                .chain(
                    inner_inputs
                        .iter()
                        .map(|&input| inputs.input(cx.find(input))),
                )
                .collect();
            let inner = substitute(&inner, &inner_parts);
            let parts = splice(cx, node, position, &mut inputs, |_| inner.clone());
            let count = inputs.classes.len();
            let operands: Vec<Term> = core_children.iter().map(|&c| Term::Class(c)).collect();
            terms.push(Term::op(
                Op::Epilogue {
                    core: Box::new(core.clone()),
                    inputs: vec![ValueId(0); count],
                    expr: substitute(&outer, &parts),
                },
                [operands, inputs.terms()].concat(),
            ));
        }
    }
    terms
}
