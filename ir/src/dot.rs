//! Graphviz output: one node per value, edges from operands.

use std::fmt::Write;

use crate::{Graph, Op};

/// The graph in Graphviz DOT, each node labelled with its op and type.
///
/// ```
/// let graph = nestor_ir::parse("graph @g {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
///   %2 = exp(%1) : ragged<f32>[B; %0, 4]
///   return %2
/// }")?;
/// let dot = nestor_ir::to_dot(&graph);
/// assert!(dot.starts_with("digraph"));
/// assert!(dot.contains("exp"));
/// # Ok::<(), nestor_ir::ParseError>(())
/// ```
pub fn to_dot(graph: &Graph) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(out, "digraph \"{}\" {{", graph.name);
    let _ = writeln!(out, "  node [shape=box, fontname=\"monospace\"];");
    for (index, node) in graph.nodes.iter().enumerate() {
        let label = match &node.op {
            Op::Input { name } | Op::Param { name } => {
                format!("%{index} {} {name:?}\\n{}", node.op.name(), node.ty)
            }
            op => format!("%{index} {}\\n{}", op.name(), node.ty),
        };
        let style = match node.op {
            Op::Input { .. } => ", style=filled, fillcolor=lightblue",
            Op::Param { .. } => ", style=filled, fillcolor=lightyellow",
            Op::PerElement { .. } => ", style=filled, fillcolor=mistyrose",
            _ => "",
        };
        let _ = writeln!(
            out,
            "  v{index} [label=\"{}\"{style}];",
            label.replace('"', "\\\"")
        );
        for operand in node.op.operands() {
            let _ = writeln!(out, "  v{} -> v{index};", operand.index());
        }
    }
    for (position, output) in graph.outputs.iter().enumerate() {
        let _ = writeln!(
            out,
            "  out{position} [label=\"return {position}\", shape=oval];"
        );
        let _ = writeln!(out, "  v{} -> out{position};", output.index());
    }
    out.push_str("}\n");
    out
}
