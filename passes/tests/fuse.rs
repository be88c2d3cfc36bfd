//! Pointwise fusion by the e-graph optimizer's `fuse-pointwise` rule: start => goal on
//! text graphs, and the cases that must not fuse.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::assert_same_meaning;
use nestor_ir::{parse, print, Op};
use nestor_passes::{Dce, Limits, Optimize, Pipeline};

fn run(text: &str) -> nestor_ir::Graph {
    let graph = parse(text).unwrap();
    let fuse = Optimize::only(&["fuse-pointwise"])
        .unwrap()
        .with_limits(Limits::untimed());
    let fused = Pipeline::new(vec![Box::new(fuse), Box::new(Dce)])
        .run(&graph)
        .unwrap();
    fused.verify().unwrap();
    assert_same_meaning(&graph, &fused, "fuse-pointwise");
    fused
}

fn count(graph: &nestor_ir::Graph, name: &str) -> usize {
    graph
        .nodes
        .iter()
        .filter(|node| node.op.name() == name)
        .count()
}

const HEADER: &str = "  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
  %2 = param {name = \"b\"} : f32[4]
";

#[test]
fn a_chain_of_elementwise_ops_becomes_one_fused_op() {
    let text = format!(
        "graph @chain {{
{HEADER}  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = gelu(%3) : ragged<f32>[B; %0, 4]
  %5 = const {{value = 0.5, dtype = f32}} : f32[]
  %6 = mul(%4, %5) : ragged<f32>[B; %0, 4]
  return %6
}}
"
    );
    let fused = run(&text);
    assert_eq!(count(&fused, "fused"), 1, "{}", print(&fused));
    assert_eq!(
        count(&fused, "add") + count(&fused, "gelu") + count(&fused, "mul"),
        0
    );
    let Op::Fused { inputs, expr } = &fused.nodes[fused.outputs[0].index()].op else {
        panic!("{}", print(&fused))
    };
    assert_eq!(inputs.len(), 2);
    assert_eq!(expr.to_string(), "(mul (gelu (add $0 $1)) (const 0.5 f32))");
    // The fused graph prints and parses back.
    assert_eq!(parse(&print(&fused)).unwrap(), fused);
}

#[test]
fn a_value_another_op_needs_is_not_fused_away() {
    let text = format!(
        "graph @shared {{
{HEADER}  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = gelu(%3) : ragged<f32>[B; %0, 4]
  %5 = layer_norm(%3) {{dims = 1, eps = 1e-5}} : ragged<f32>[B; %0, 4]
  %6 = add(%4, %5) : ragged<f32>[B; %0, 4]
  return %6
}}
"
    );
    let fused = run(&text);
    // %3 feeds both gelu and layer_norm: it stays a value; gelu joins the final add.
    assert_eq!(count(&fused, "add"), 1, "{}", print(&fused));
    assert_eq!(count(&fused, "fused"), 1, "{}", print(&fused));
    assert_eq!(count(&fused, "layer_norm"), 1);
}

#[test]
fn outputs_and_single_ops_stay_as_they_are() {
    let text = format!(
        "graph @outputs {{
{HEADER}  %3 = relu(%1) : ragged<f32>[B; %0, 4]
  %4 = neg(%3) : ragged<f32>[B; %0, 4]
  return %3, %4
}}
"
    );
    let fused = run(&text);
    assert_eq!(count(&fused, "fused"), 0, "{}", print(&fused));
    assert_eq!((count(&fused, "relu"), count(&fused, "neg")), (1, 1));
}
