//! Common-subexpression elimination: an op with the same operands as an earlier one
//! reuses its value. Ops with side effects or randomness (dropout in training, inputs)
//! are never merged.

use std::collections::HashMap;

use nestor_ir::{Graph, Node, Op, ValueId, VerifyError};

use crate::Pass;

/// Merges identical pure ops.
pub struct Cse;

impl Pass for Cse {
    fn name(&self) -> &'static str {
        "cse"
    }

    fn run(&self, graph: &Graph) -> Result<Graph, VerifyError> {
        let mut canonical: Vec<ValueId> = Vec::with_capacity(graph.nodes.len());
        let mut seen: HashMap<Node, ValueId> = HashMap::new();
        let mut result = Graph::new(graph.name.clone());
        for node in &graph.nodes {
            let rename = |value: ValueId| canonical[value.index()];
            let node = Node {
                op: node.op.map_operands(rename),
                ty: node.ty.map_values(rename),
            };
            let pure = !matches!(
                node.op,
                Op::Input { .. }
                    | Op::Param { .. }
                    | Op::Dropout { train: true, .. }
                    | Op::RandomMask { .. }
            );
            if pure {
                if let Some(&existing) = seen.get(&node) {
                    canonical.push(existing);
                    continue;
                }
            }
            let value = ValueId(result.nodes.len() as u32);
            if pure {
                seen.insert(node.clone(), value);
            }
            result.nodes.push(node);
            canonical.push(value);
        }
        result.outputs = graph
            .outputs
            .iter()
            .map(|output| canonical[output.index()])
            .collect();
        Ok(result)
    }
}
