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
        let mut live = vec![false; graph.nodes.len()];
        let mut stack: Vec<ValueId> = graph.outputs.clone();
        for (index, node) in graph.nodes.iter().enumerate() {
            if matches!(node.op, Op::Input { .. } | Op::Param { .. }) {
                stack.push(ValueId(index as u32));
            }
        }
        while let Some(value) = stack.pop() {
            if std::mem::replace(&mut live[value.index()], true) {
                continue;
            }
            let node = &graph.nodes[value.index()];
            stack.extend(node.op.operands());
            stack.extend(node.ty.length_values());
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
