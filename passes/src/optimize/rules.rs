//! The rewrite rules, in named sets. A rule looks at one e-node of a class and proposes
//! terms equal to that class; the runner adds a term only when its type (inferred by
//! the IR's own rules) is the class's type. Every rule says why it holds.

use std::collections::HashMap;

use egg::Id;
use nestor_ir::{BinaryOp, DType, FusedExpr, Graph, Op, ReduceOp, Type, UnaryOp, ValueId};

use super::egraph::{Builder, ENode, Term};

/// The rule sets, in the order they are listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuleSet {
    /// Padding round trips, all-true masks, view chains.
    Structure,
    /// Identities exact in floating point.
    Algebra,
    /// Per-element fallbacks replaced by packed ops.
    Packed,
    /// Pointwise chains and trees into one `fused` kernel.
    Fusion,
}

/// What a rule sees: the e-graph and which classes have exactly one reader.
pub struct Context<'a> {
    /// The e-graph and its types.
    pub builder: &'a Builder,
    /// Readers of every class in the graph the e-graph was built from (outputs count as
    /// readers), by canonical id.
    pub readers: &'a HashMap<Id, usize>,
}

impl Context<'_> {
    fn find(&self, class: Id) -> Id {
        self.builder.egraph.find(class)
    }

    fn ty(&self, class: Id) -> Option<&Type> {
        self.builder.ty(class)
    }

    fn nodes(&self, class: Id) -> &[ENode] {
        &self.builder.egraph[class].nodes
    }

    fn same(&self, a: Id, b: Id) -> bool {
        self.find(a) == self.find(b)
    }

    /// The value of a constant class.
    fn constant(&self, class: Id) -> Option<f64> {
        self.nodes(class).iter().find_map(|node| match node.op {
            Op::Const { value, .. } => Some(value.0),
            _ => None,
        })
    }

    /// Whether the class is `x` itself in type (a rewrite to it keeps the type).
    fn keeps_type(&self, class: Id, x: Id) -> bool {
        self.ty(class).is_some() && self.ty(class) == self.ty(x)
    }

    /// Whether the class is true on every packed position: the padding mask of a batch
    /// unpadded by its own lengths (or a cast of it).
    fn all_true(&self, class: Id) -> bool {
        self.nodes(class).iter().any(|node| match node.op {
            Op::Unpad { .. } => self.nodes(node.children[0]).iter().any(|mask| {
                matches!(mask.op, Op::Mask { .. }) && self.same(mask.children[0], node.children[1])
            }),
            Op::Cast { .. } => self.all_true(node.children[0]),
            _ => false,
        })
    }

    fn single_reader(&self, class: Id) -> bool {
        self.readers.get(&self.find(class)) == Some(&1)
    }
}

/// One rewrite rule.
pub struct Rule {
    /// Its name (used to select rules and in reports).
    pub name: &'static str,
    /// Its set.
    pub set: RuleSet,
    /// Why the rewrite holds, in one line.
    pub why: &'static str,
    /// Terms equal to the class of `node`.
    pub apply: fn(&Context, Id, &ENode) -> Vec<Term>,
}

/// Every rule, by set.
pub static RULES: &[Rule] = &[
    Rule {
        name: "unpad-pad",
        set: RuleSet::Structure,
        why: "unpadding a padded batch by its own lengths gives back its packed rows",
        apply: unpad_pad,
    },
    Rule {
        name: "packed-through-pad",
        set: RuleSet::Structure,
        why: "a pointwise op on a padded grid, then unpadded, only ever used the valid rows",
        apply: packed_through_pad,
    },
    Rule {
        name: "all-true-mask",
        set: RuleSet::Structure,
        why: "the padding mask unpadded by its own lengths is true on every packed row",
        apply: all_true_mask,
    },
    Rule {
        name: "reshape-chain",
        set: RuleSet::Structure,
        why: "reshapes of the static tail compose (row-major order is kept by both)",
        apply: reshape_chain,
    },
    Rule {
        name: "view-identity",
        set: RuleSet::Structure,
        why: "a reshape to the same tail, inference dropout and a swap undone are the input",
        apply: view_identity,
    },
    Rule {
        name: "mul-one",
        set: RuleSet::Algebra,
        why: "x * 1 and x / 1 are x exactly in IEEE arithmetic",
        apply: mul_one,
    },
    Rule {
        name: "add-negative-zero",
        set: RuleSet::Algebra,
        why:
            "x + (-0) and x - (+0) are x exactly, signed zeros included (x + 0 is not: -0 + 0 = +0)",
        apply: add_negative_zero,
    },
    Rule {
        name: "double-negation",
        set: RuleSet::Algebra,
        why: "negation flips the sign bit, twice restores it",
        apply: double_negation,
    },
    Rule {
        name: "cast-round-trip",
        set: RuleSet::Algebra,
        why: "a cast to a type holding every value of the source, then back, is exact",
        apply: cast_round_trip,
    },
    Rule {
        name: "packed-per-element",
        set: RuleSet::Packed,
        why: "row-wise ops (linear, pointwise, norms, softmax, reductions, embedding) give \
              each element the same rows packed as alone",
        apply: packed_per_element,
    },
    Rule {
        name: "fuse-pointwise",
        set: RuleSet::Fusion,
        why: "a pointwise value read by one pointwise op can be computed inside its reader's \
              kernel",
        apply: fuse_pointwise,
    },
    Rule {
        name: "fuse-prologue",
        set: RuleSet::Fusion,
        why: "a row or segmented op can compute its pointwise input itself, row by row, when \
              nothing else reads that input",
        apply: fuse_prologue,
    },
    Rule {
        name: "fuse-epilogue",
        set: RuleSet::Fusion,
        why: "a pointwise op reading a GEMM's result element for element can run on the GEMM's \
              rows as they are written, when nothing else reads the result",
        apply: fuse_epilogue,
    },
];

fn unpad_pad(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
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

fn packed_through_pad(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
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

fn all_true_mask(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
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

fn reshape_chain(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
    let Op::ReshapeTail { .. } = node.op else {
        return vec![];
    };
    cx.nodes(node.children[0])
        .iter()
        .filter(|inner| matches!(inner.op, Op::ReshapeTail { .. }))
        .map(|inner| Term::op(node.op.clone(), vec![Term::Class(inner.children[0])]))
        .collect()
}

fn view_identity(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
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

fn mul_one(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    drop_identity(
        cx,
        class,
        node,
        &[(BinaryOp::Mul, 1.0, true), (BinaryOp::Div, 1.0, false)],
    )
}

fn add_negative_zero(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
    drop_identity(
        cx,
        class,
        node,
        &[(BinaryOp::Add, -0.0, true), (BinaryOp::Sub, 0.0, false)],
    )
}

fn double_negation(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
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

fn cast_round_trip(cx: &Context, class: Id, node: &ENode) -> Vec<Term> {
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

/// Element dim `dim` of a per-element body as a batch-first dim of the packed batch.
fn batch_first(dim: i64) -> i64 {
    if dim >= 0 {
        dim + 1
    } else {
        dim
    }
}

/// A body op as the same op on the packed batch, if it is row-wise.
fn packed_op(op: &Op) -> Option<Op> {
    Some(match op {
        Op::Const { .. }
        | Op::Unary { .. }
        | Op::Binary { .. }
        | Op::Where { .. }
        | Op::Cast { .. }
        | Op::Fused { .. }
        | Op::Linear { .. }
        | Op::Matmul { .. }
        | Op::LayerNorm { .. }
        | Op::RmsNorm { .. }
        | Op::Embedding { .. } => op.clone(),
        Op::Softmax { x, axis, log } => Op::Softmax {
            x: *x,
            axis: batch_first(*axis),
            log: *log,
        },
        Op::Reduce {
            op,
            x,
            dims,
            keepdim,
            correction,
        } if !dims.is_empty() => Op::Reduce {
            op: *op,
            x: *x,
            dims: dims.iter().map(|&dim| batch_first(dim)).collect(),
            keepdim: *keepdim,
            correction: *correction,
        },
        _ => return None,
    })
}

fn packed_per_element(_cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
    let Op::PerElement { body, .. } = &node.op else {
        return vec![];
    };
    // The runner keeps the result only if it has the region's type, lengths included.
    body_as_packed(body, node.operands()).into_iter().collect()
}

/// The body of a per-element region as packed ops over the region's inputs.
fn body_as_packed(body: &Graph, inputs: &[Id]) -> Option<Term> {
    let mut terms: Vec<Term> = Vec::with_capacity(body.nodes.len());
    let mut next_input = 0;
    for node in &body.nodes {
        let term = match &node.op {
            Op::Input { .. } | Op::Param { .. } => {
                next_input += 1;
                Term::Class(*inputs.get(next_input - 1)?)
            }
            op => {
                let operands = op
                    .operands()
                    .iter()
                    .map(|operand| terms[operand.index()].clone())
                    .collect();
                Term::op(packed_op(op)?, operands)
            }
        };
        terms.push(term);
    }
    terms.get(body.outputs.first()?.index()).cloned()
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

fn fuse_pointwise(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
    let Some(outer) = expression(node).filter(|_| is_pointwise(&node.op)) else {
        return vec![];
    };
    let mut terms = Vec::new();
    for (position, &child) in node.children.iter().enumerate() {
        let child = cx.find(child);
        // A value another op (or the caller) still needs is computed once, by itself.
        let constant = cx.constant(child).is_some();
        if !constant && !cx.single_reader(child) {
            continue;
        }
        for inner in cx.nodes(child) {
            let Some(inner_expr) = expression(inner) else {
                continue;
            };
            let mut inputs = Inputs::default();
            let parts: Vec<FusedExpr> = node
                .children
                .iter()
                .enumerate()
                .map(|(index, &other)| {
                    if index == position {
                        let inner_parts: Vec<FusedExpr> = inner
                            .children
                            .iter()
                            .map(|&grandchild| inputs.input(cx.find(grandchild)))
                            .collect();
                        substitute(&inner_expr, &inner_parts)
                    } else {
                        inputs.input(cx.find(other))
                    }
                })
                .collect();
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

fn fuse_prologue(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
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
    cx.nodes(input)
        .iter()
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

fn fuse_epilogue(cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
    let Some(outer) = expression(node).filter(|_| is_pointwise(&node.op)) else {
        return vec![];
    };
    let mut terms = Vec::new();
    for (position, &child) in node.children.iter().enumerate() {
        if !cx.single_reader(child) {
            continue;
        }
        for producer in cx.nodes(child) {
            let Some((core, core_children, inner, inner_inputs)) = gemm_with_epilogue(producer)
            else {
                continue;
            };
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
            let parts: Vec<FusedExpr> = node
                .children
                .iter()
                .enumerate()
                .map(|(index, &other)| {
                    if index == position {
                        inner.clone()
                    } else {
                        inputs.input(cx.find(other))
                    }
                })
                .collect();
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
