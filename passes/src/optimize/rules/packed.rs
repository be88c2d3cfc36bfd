//! Packed paths: per-element regions of row-wise ops as the packed ops.

use egg::Id;
use nestor_ir::{Graph, Op};

use super::Context;
use crate::optimize::egraph::{ENode, Term};

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

pub(super) fn packed_per_element(_cx: &Context, _class: Id, node: &ENode) -> Vec<Term> {
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
