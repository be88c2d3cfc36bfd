//! Lowering of the fused kernels the optimizer chooses: a `prologue` op is one row or
//! segmented kernel, an `epilogue` op one GEMM with its epilogue; and where the two
//! steps cannot be one kernel they stay two, computing the same. With
//! `LowerOptions::fold_epilogues` the lowering folds a 1x1 convolution's epilogue too.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::parse;
use nestor_passes::step::{Gemm, Row, Segment};
use nestor_passes::{lower, lower_with, LowerOptions, Program, Step};

const HEADER: &str = "  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
  %2 = param {name = \"w\"} : f32[4, 4]
  %3 = param {name = \"b\"} : f32[4]
";

fn lowered(body: &str) -> Program {
    lower(&parse(&format!("graph @g {{\n{HEADER}{body}}}\n")).unwrap()).unwrap()
}

/// Whether a step computes a fused expression inside its kernel.
fn fused(step: &Step) -> bool {
    match step {
        Step::Row(Row { x, width, .. }) | Step::Segment(Segment { x, width, .. }) => {
            x.as_plain(*width).is_none()
        }
        Step::Gemm(Gemm { epilogue, .. }) => epilogue.is_some(),
        _ => false,
    }
}

#[test]
fn residual_add_and_layer_norm_are_one_kernel() {
    let program = lowered(
        "  %4 = prologue(%1, %3, %3, %3) {expr = \"(add $0 $1)\", inputs = 2, core = layer_norm, dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 4]
  return %4
",
    );
    assert_eq!(program.launches(), 1, "{program:#?}");
    assert!(fused(&program.steps[0]));
}

#[test]
fn a_pointwise_input_of_a_segmented_reduction_is_its_prologue() {
    let program = lowered(
        "  %4 = prologue(%1) {expr = \"(gelu $0)\", inputs = 1, core = mean, dims = [1], keepdim = false} : f32[B, 4]
  return %4
",
    );
    assert_eq!(program.launches(), 1, "{program:#?}");
    assert!(matches!(&program.steps[0], Step::Segment(_)) && fused(&program.steps[0]));
}

#[test]
fn an_activation_and_a_residual_after_a_gemm_are_its_epilogue() {
    let program = lowered(
        "  %4 = epilogue(%1, %2, %3, %1) {expr = \"(add (relu $0) $1)\", inputs = 1, core = linear} : ragged<f32>[B; %0, 4]
  return %4
",
    );
    assert_eq!(program.launches(), 1, "{program:#?}");
    assert!(fused(&program.steps[0]));
}

#[test]
fn a_prologue_the_kernel_cannot_read_row_by_row_stays_a_step() {
    // A softmax over the ragged dim of a batch whose prologue reads a per-element
    // operand: segmented kernels take no per-element inputs, so two kernels.
    let program = lowered(
        "  %4 = input {name = \"s\"} : f32[B, 1, 4]
  %5 = prologue(%1, %4) {expr = \"(mul $0 $1)\", inputs = 2, core = softmax, axis = 1} : ragged<f32>[B; %0, 4]
  return %5
",
    );
    assert_eq!(program.launches(), 2, "{program:#?}");
    assert!(!program.steps.iter().any(fused), "{program:#?}");
}

#[test]
fn fused_ops_that_break_the_rules_do_not_type() {
    // A prologue around a GEMM, an epilogue around a norm, and an epilogue that
    // broadcasts the GEMM's result to a bigger shape are ill-typed.
    for body in [
        "  %4 = prologue(%1, %2) {expr = \"(relu $0)\", inputs = 1, core = linear} : ragged<f32>[B; %0, 4]\n  return %4\n",
        "  %4 = epilogue(%1) {expr = \"(relu $0)\", inputs = 0, core = layer_norm, dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 4]\n  return %4\n",
        "  %4 = input {name = \"y\"} : ragged<f32>[B; %0, 3, 4]\n  %5 = epilogue(%1, %2, %4) {expr = \"(add $0 $1)\", inputs = 1, core = linear} : ragged<f32>[B; %0, 3, 4]\n  return %5\n",
    ] {
        let error = parse(&format!("graph @g {{\n{HEADER}{body}}}\n")).unwrap_err();
        assert!(error.message.contains("prologue") || error.message.contains("epilogue") || error.message.contains("shape"), "{error:?}");
    }
}

/// A 1x1 convolution (a per-element region, which the optimizer's epilogue rule does
/// not take), a per-channel scale computed after it, then `relu(conv * scale)`: with
/// `fold_epilogues` the convolution's GEMM moves past the scale's step and takes the
/// relu as its epilogue; without, one op is one step.
#[test]
fn a_pointwise_conv_takes_what_follows_it_as_its_epilogue() {
    let graph = parse(
        "graph @g {
  %0 = input {name = \"h\"} : lengths[B]
  %1 = input {name = \"w\"} : lengths[B]
  %2 = input {name = \"x\"} : ragged<f32>[B; 4, %0, %1]
  %3 = param {name = \"k\"} : f32[8, 4, 1, 1]
  %4 = param {name = \"s\"} : f32[8]
  %5 = per_element(%2, %3) : ragged<f32>[B; 8, %0, %1] graph @conv2d {
    %0 = input {name = \"element\"} : f32[4, ?, ?]
    %1 = input {name = \"param0\"} : f32[8, 4, 1, 1]
    %2 = conv2d(%0, %1) {stride = [1, 1], padding = [0, 0], dilation = [1, 1], groups = 1} : f32[8, ?, ?]
    return %2
  }
  %6 = fused(%4) {expr = \"(mul $0 (const 2 f32))\"} : f32[8]
  %7 = reshape(%6) {shape = [1, 8, 1, 1]} : f32[1, 8, 1, 1]
  %8 = fused(%5, %7) {expr = \"(relu (mul $0 $1))\"} : ragged<f32>[B; 8, %0, %1]
  return %8
}
",
    )
    .unwrap();
    let unfolded = lower(&graph).unwrap();
    assert_eq!(unfolded.launches(), 3, "{unfolded:#?}");
    let options = LowerOptions {
        fold_epilogues: true,
        ..LowerOptions::default()
    };
    let folded = lower_with(&graph, options).unwrap();
    assert_eq!(folded.launches(), 2, "{folded:#?}");
    assert!(
        matches!(&folded.steps[0], Step::Pointwise(_)),
        "{folded:#?}"
    );
    assert!(fused(&folded.steps[1]), "{folded:#?}");
}
