//! Autodiff on the IR: the joint graph verifies and names its gradients; what cannot be
//! differentiated is a typed error naming the value and the op.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::{parse, ValueId};
use nestor_passes::step::AttentionPart;
use nestor_passes::{
    differentiate, lower_with, AutodiffError, Limits, LowerOptions, Pipeline, Step,
};

const MODEL: &str = "graph @model {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
  %2 = input {name = \"ids\"} : ragged<i64>[B; %0]
  %3 = param {name = \"w\"} : f32[3, 4]
  %4 = linear(%1, %3) : ragged<f32>[B; %0, 3]
  %5 = cumprod(%4) {axis = 1, reverse = true} : ragged<f32>[B; %0, 3]
  %6 = sum(%5) {dims = [], keepdim = false} : f32[]
  %7 = tanh(%4) : ragged<f32>[B; %0, 3]
  %8 = mean(%7) {dims = [], keepdim = false} : f32[]
  return %6, %8, %4
}
";

#[test]
fn the_joint_graph_verifies_passes_and_returns_one_gradient_per_value() {
    let graph = parse(MODEL).unwrap();
    let joint = differentiate(&graph, ValueId(8), &[ValueId(3), ValueId(1)]).unwrap();
    joint.graph.verify().unwrap();
    assert_eq!(joint.gradients, [Some(3), Some(4)]);
    let outputs = &joint.graph.outputs;
    assert_eq!(joint.graph.ty(outputs[3]), graph.ty(ValueId(3)));
    assert_eq!(joint.graph.ty(outputs[4]), graph.ty(ValueId(1)));
    // The default pipeline (decompose, DCE, CSE, optimize, DCE) keeps it well typed.
    Pipeline::optimizing(Limits::untimed())
        .run(&joint.graph)
        .unwrap();
}

#[test]
fn an_op_without_a_rule_is_an_error_naming_it() {
    let graph = parse(MODEL).unwrap();
    match differentiate(&graph, ValueId(6), &[ValueId(3)]) {
        Err(AutodiffError::NoRule { value, op, .. }) => {
            assert_eq!((value, op), (ValueId(5), "cumprod"));
        }
        other => panic!("expected no rule for a reversed cumprod, got {other:?}"),
    }
}

#[test]
fn bad_requests_are_typed_errors() {
    let graph = parse(MODEL).unwrap();
    assert!(matches!(
        differentiate(&graph, ValueId(4), &[ValueId(3)]),
        Err(AutodiffError::LossNotScalar {
            value: ValueId(4),
            ..
        })
    ));
    assert!(matches!(
        differentiate(&graph, ValueId(8), &[ValueId(2)]),
        Err(AutodiffError::NotFloat {
            value: ValueId(2),
            ..
        })
    ));
    assert!(matches!(
        differentiate(&graph, ValueId(8), &[ValueId(0)]),
        Err(AutodiffError::NotFloat {
            value: ValueId(0),
            ..
        })
    ));
    // The loss does not read `x`'s sibling input `ids`, nor anything when asked for none.
    assert!(matches!(
        differentiate(&graph, ValueId(8), &[]),
        Err(AutodiffError::NoParameter { value: ValueId(8) })
    ));
}

#[test]
fn a_value_the_loss_does_not_read_gets_no_gradient() {
    let graph = parse(MODEL).unwrap();
    let joint = differentiate(&graph, ValueId(8), &[ValueId(3)]).unwrap();
    assert_eq!(joint.gradients, [Some(3)]);
    let unrelated = parse(
        "graph @two {
  %0 = param {name = \"a\"} : f32[2]
  %1 = param {name = \"b\"} : f32[2]
  %2 = sum(%0) {dims = [], keepdim = false} : f32[]
  return %2
}
",
    )
    .unwrap();
    let joint = differentiate(&unrelated, ValueId(2), &[ValueId(0), ValueId(1)]).unwrap();
    assert_eq!(joint.gradients, [Some(1), None]);
}

/// Causal self-attention on heads split from one projection (as `attention_loss.nir`).
const SELF_ATTENTION: &str = include_str!("../../tests/filetests/attention_loss.nir");

#[test]
fn self_attention_from_one_projection_gets_its_three_gradients_stacked_in_place() {
    let graph = parse(SELF_ATTENTION).unwrap();
    // The loss decomposed first (what a compiled training step differentiates).
    let joint = nestor_passes::differentiate_loss(&graph).unwrap();
    joint.graph.verify().unwrap();
    let live = Pipeline::named(["dce"], Limits::untimed())
        .unwrap()
        .run(&joint.graph)
        .unwrap();
    let text = nestor_ir::print(&live);
    // One gradient step for the three, whose stack is the projection's gradient as it
    // is: no zeros placed around each part, no additions of the parts.
    assert_eq!(text.matches("attention_grad(").count(), 1, "{text}");
    assert!(text.contains("part = all"), "{text}");
    assert!(!text.contains("insert_static("), "{text}");
    assert!(!text.contains("add("), "{text}");
}

#[test]
fn attention_with_keys_of_other_lengths_gets_the_two_parts() {
    let graph = parse(
        "graph @cross {
  %0 = input {name = \"q.lengths\"} : lengths[B]
  %1 = input {name = \"q\"} : ragged<f32>[B; %0, 2, 4]
  %2 = input {name = \"k.lengths\"} : lengths[B]
  %3 = input {name = \"k\"} : ragged<f32>[B; %2, 2, 4]
  %4 = input {name = \"v\"} : ragged<f32>[B; %2, 2, 4]
  %5 = attention(%1, %3, %4) {causal = false} : ragged<f32>[B; %0, 2, 4]
  %6 = sum(%5) {dims = [], keepdim = false} : f32[]
  return %6
}",
    )
    .unwrap();
    let joint = differentiate(&graph, ValueId(6), &[ValueId(1), ValueId(3), ValueId(4)]).unwrap();
    joint.graph.verify().unwrap();
    let text = nestor_ir::print(&joint.graph);
    assert!(text.contains("part = queries"), "{text}");
    assert!(text.contains("part = keys_values"), "{text}");
    assert!(!text.contains("part = all"), "{text}");
    // Lowered for the CPU, the two parts are one step writing both gradients; for
    // kernels, a step each.
    let gradient_parts = |at_once: bool| {
        let options = LowerOptions {
            attention_gradients_at_once: at_once,
            ..LowerOptions::default()
        };
        let program = lower_with(&joint.graph, options).unwrap();
        let steps = program.steps.iter().filter_map(|step| match step {
            Step::AttentionGrad(gradient) => Some((gradient.part, gradient.keys_values_out)),
            _ => None,
        });
        steps.collect::<Vec<_>>()
    };
    let at_once = gradient_parts(true);
    assert!(
        matches!(at_once[..], [(AttentionPart::Both, Some(_))]),
        "{at_once:?}"
    );
    let apart = gradient_parts(false);
    assert_eq!(
        apart,
        [
            (AttentionPart::Queries, None),
            (AttentionPart::KeysValues, None)
        ]
    );
}
