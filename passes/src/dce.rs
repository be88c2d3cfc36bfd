//! Dead-code elimination: drops values no output needs (inputs and parameters stay,
//! since callers bind them by position).

use nestor_ir::{Graph, Node, Op, ValueId, VerifyError};

use crate::Pass;

/// Removes ops whose results no output depends on.
pub struct Dce;

impl Pass for Dce {
    fn name(&self) -> &'static str {
        "dce"
    }

    fn run(&self, graph: &Graph) -> Result<Graph, VerifyError> {
        // One walk back over the arena: a value's operands and lengths are defined
        // before it, so they are marked before the walk reaches them.
        let mut live = vec![false; graph.nodes.len()];
        for output in &graph.outputs {
            live[output.index()] = true;
        }
        for (index, node) in graph.nodes.iter().enumerate().rev() {
            live[index] |= matches!(node.op, Op::Input { .. } | Op::Param { .. });
            if live[index] {
                for value in node
                    .op
                    .operands()
                    .into_iter()
                    .chain(node.ty.length_values())
                {
                    live[value.index()] = true;
                }
            }
        }
        Ok(rebuild(graph, |index| live[index]))
    }
}

/// The graph with only the nodes `keep` accepts, values renumbered densely.
pub(crate) fn rebuild(graph: &Graph, keep: impl Fn(usize) -> bool) -> Graph {
    let mut renamed = vec![ValueId(u32::MAX); graph.nodes.len()];
    let mut result = Graph::new(graph.name.clone());
    for (index, node) in graph.nodes.iter().enumerate() {
        if !keep(index) {
            continue;
        }
        renamed[index] = ValueId(result.nodes.len() as u32);
        let rename = |value: ValueId| renamed[value.index()];
        result.nodes.push(Node {
            op: node.op.map_operands(rename),
            ty: node.ty.map_values(rename),
        });
    }
    result.outputs = graph
        .outputs
        .iter()
        .map(|output| renamed[output.index()])
        .collect();
    result
}
