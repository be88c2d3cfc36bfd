//! Decomposition: composite ops rewritten into the primitive ops they are made of, so
//! that lowering and autodiff need no rule of their own for them. Today: `mse_loss` is
//! `mean` / `sum` of `square(x - target)` (or the squares themselves without reduction).

use nestor_ir::{
    BinaryOp, Graph, LossReduction, Node, Op, ReduceOp, UnaryOp, ValueId, VerifyError,
};

use crate::Pass;

/// Rewrites composite ops into primitive ones.
pub struct Decompose;

impl Pass for Decompose {
    fn name(&self) -> &'static str {
        "decompose"
    }

    fn run(&self, graph: &Graph) -> Result<Graph, VerifyError> {
        let mut result = Graph::new(graph.name.clone());
        let mut renamed: Vec<ValueId> = Vec::with_capacity(graph.nodes.len());
        for Node { op, ty } in &graph.nodes {
            let op = op.map_operands(|value| renamed[value.index()]);
            let value = match op {
                Op::MseLoss {
                    x,
                    target,
                    reduction,
                } => {
                    let difference = result.push(Op::Binary {
                        op: BinaryOp::Sub,
                        lhs: x,
                        rhs: target,
                    })?;
                    let square = result.push(Op::Unary {
                        op: UnaryOp::Square,
                        x: difference,
                    })?;
                    let reduce = match reduction {
                        LossReduction::Mean => Some(ReduceOp::Mean),
                        LossReduction::Sum => Some(ReduceOp::Sum),
                        LossReduction::None => None,
                    };
                    match reduce {
                        Some(op) => result.push(Op::Reduce {
                            op,
                            x: square,
                            dims: Vec::new(),
                            keepdim: false,
                            correction: 0,
                        })?,
                        None => square,
                    }
                }
                op if op.declares_type() => {
                    result.add_declared(op, ty.map_values(|value| renamed[value.index()]))?
                }
                op => result.push(op)?,
            };
            renamed.push(value);
        }
        result.outputs = graph
            .outputs
            .iter()
            .map(|output| renamed[output.index()])
            .collect();
        Ok(result)
    }
}
