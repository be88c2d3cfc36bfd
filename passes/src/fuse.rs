//! Pointwise fusion: a tree of elementwise ops whose inner values have no other reader
//! becomes one `fused` op (one kernel). A value another op still needs is never fused
//! away; constants are copied into every expression that reads them.
//!
//! This is the greedy first version of the optimizer's fusion; the e-graph rewrites of
//! DESIGN.md section 5 will decide regions with a cost model.

use nestor_ir::{FusedExpr, Graph, Node, Op, ValueId, VerifyError};

use crate::Pass;

/// Fuses trees of elementwise ops.
pub struct Fuse;

/// Whether an op is elementwise (and so may join a fused expression).
fn elementwise(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary { .. }
            | Op::Binary { .. }
            | Op::Where { .. }
            | Op::Cast { .. }
            | Op::Fused { .. }
    )
}

impl Pass for Fuse {
    fn name(&self) -> &'static str {
        "fuse"
    }

    fn run(&self, graph: &Graph) -> Result<Graph, VerifyError> {
        let count = graph.nodes.len();
        // Readers of every value: operands of ops and of types, and the outputs.
        let mut readers: Vec<Vec<usize>> = vec![Vec::new(); count];
        for (index, node) in graph.nodes.iter().enumerate() {
            for operand in node
                .op
                .operands()
                .into_iter()
                .chain(node.ty.length_values())
            {
                readers[operand.index()].push(index);
            }
        }
        let mut is_output = vec![false; count];
        for output in &graph.outputs {
            is_output[output.index()] = true;
        }
        // An elementwise value read once, by an elementwise op, joins its reader's tree.
        let absorbed: Vec<bool> = (0..count)
            .map(|index| {
                let node = &graph.nodes[index];
                elementwise(&node.op)
                    && !is_output[index]
                    && readers[index].len() == 1
                    && elementwise(&graph.nodes[readers[index][0]].op)
            })
            .collect();
        let mut renamed = vec![ValueId(u32::MAX); count];
        let mut result = Graph::new(graph.name.clone());
        for (index, node) in graph.nodes.iter().enumerate() {
            if absorbed[index] {
                continue;
            }
            let rename = |value: ValueId| renamed[value.index()];
            let op = if elementwise(&node.op) {
                let mut inputs = Vec::new();
                let expr = expression(graph, ValueId(index as u32), &absorbed, true, &mut inputs);
                let fused_something = expr.operations() > 1 || matches!(node.op, Op::Fused { .. });
                if fused_something {
                    Op::Fused {
                        inputs: inputs.into_iter().map(rename).collect(),
                        expr,
                    }
                } else {
                    node.op.map_operands(rename)
                }
            } else {
                node.op.map_operands(rename)
            };
            let ty = node.ty.map_values(rename);
            renamed[index] = ValueId(result.nodes.len() as u32);
            result.nodes.push(Node { op, ty });
        }
        result.outputs = graph
            .outputs
            .iter()
            .map(|output| renamed[output.index()])
            .collect();
        Ok(result)
    }
}

/// The expression of `value`: absorbed elementwise operands and constants inline, other
/// values as inputs (collected, in first-use order, into `inputs`).
fn expression(
    graph: &Graph,
    value: ValueId,
    absorbed: &[bool],
    root: bool,
    inputs: &mut Vec<ValueId>,
) -> FusedExpr {
    let node = &graph.nodes[value.index()];
    let inline = root || absorbed[value.index()];
    let operand = |operand: ValueId, inputs: &mut Vec<ValueId>| {
        Box::new(expression(graph, operand, absorbed, false, inputs))
    };
    match (&node.op, inline) {
        (Op::Const { value, dtype }, _) => FusedExpr::Const {
            value: *value,
            dtype: *dtype,
        },
        (Op::Unary { op, x }, true) => FusedExpr::Unary(*op, operand(*x, inputs)),
        (Op::Binary { op, lhs, rhs }, true) => {
            let a = operand(*lhs, inputs);
            FusedExpr::Binary(*op, a, operand(*rhs, inputs))
        }
        (Op::Where { condition, x, y }, true) => {
            let c = operand(*condition, inputs);
            let a = operand(*x, inputs);
            FusedExpr::Where(c, a, operand(*y, inputs))
        }
        (Op::Cast { x, dtype }, true) => FusedExpr::Cast(*dtype, operand(*x, inputs)),
        (
            Op::Fused {
                inputs: fused_inputs,
                expr,
            },
            true,
        ) => {
            let parts: Vec<FusedExpr> = fused_inputs
                .iter()
                .map(|&input| *operand(input, inputs))
                .collect();
            substitute(expr, &parts)
        }
        _ => {
            let position = inputs
                .iter()
                .position(|&input| input == value)
                .unwrap_or_else(|| {
                    inputs.push(value);
                    inputs.len() - 1
                });
            FusedExpr::Input(position)
        }
    }
}

/// `expr` with input `n` replaced by `parts[n]`.
fn substitute(expr: &FusedExpr, parts: &[FusedExpr]) -> FusedExpr {
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
