//! Kernel fusion in the lowering: pointwise steps computed inside the row kernel,
//! segmented kernel or GEMM next to them, and the cases where they must stay apart.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::parse;
use nestor_passes::{lower, lower_with, LowerOptions, Program, Step};

const HEADER: &str = "  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
  %2 = param {name = \"w\"} : f32[4, 4]
  %3 = param {name = \"b\"} : f32[4]
";

fn lowered(body: &str) -> (Program, Program) {
    let graph = parse(&format!("graph @g {{\n{HEADER}{body}}}\n")).unwrap();
    let separate = lower_with(
        &graph,
        LowerOptions {
            fuse_kernels: false,
            ..LowerOptions::default()
        },
    )
    .unwrap();
    (lower(&graph).unwrap(), separate)
}

fn is_plain(step: &Step) -> bool {
    match step {
        Step::Row { x, width, .. } | Step::Segment { x, width, .. } => x.as_plain(*width).is_some(),
        Step::Gemm { epilogue, .. } => epilogue.is_none(),
        _ => true,
    }
}

#[test]
fn residual_add_and_layer_norm_are_one_kernel() {
    let (fused, separate) = lowered(
        "  %4 = add(%1, %3) : ragged<f32>[B; %0, 4]
  %5 = layer_norm(%4, %3, %3) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 4]
  return %5
",
    );
    assert_eq!((fused.launches(), separate.launches()), (1, 2));
    assert!(!is_plain(&fused.steps[0]), "{fused:#?}");
}

#[test]
fn a_pointwise_input_of_a_segmented_reduction_is_its_prologue() {
    let (fused, separate) = lowered(
        "  %4 = gelu(%1) : ragged<f32>[B; %0, 4]
  %5 = mean(%4) {dims = [1], keepdim = false, correction = 0} : f32[B, 4]
  return %5
",
    );
    assert_eq!((fused.launches(), separate.launches()), (1, 2));
    assert!(
        matches!(&fused.steps[0], Step::Segment { .. }),
        "{fused:#?}"
    );
    assert!(!is_plain(&fused.steps[0]));
}

#[test]
fn an_activation_after_a_gemm_is_its_epilogue() {
    let (fused, separate) = lowered(
        "  %4 = linear(%1, %2, %3) : ragged<f32>[B; %0, 4]
  %5 = relu(%4) : ragged<f32>[B; %0, 4]
  %6 = add(%5, %1) : ragged<f32>[B; %0, 4]
  return %6
",
    );
    // relu joins the GEMM; a GEMM takes one epilogue, so the add (the e-graph would
    // have fused it with the relu first) stays a kernel of its own.
    assert_eq!((fused.launches(), separate.launches()), (2, 3));
    assert!(!is_plain(&fused.steps[0]), "{fused:#?}");
}

#[test]
fn values_other_kernels_need_stay_in_memory() {
    // %4 is read by the layer_norm and returned: it must be written.
    let (fused, _) = lowered(
        "  %4 = add(%1, %3) : ragged<f32>[B; %0, 4]
  %5 = layer_norm(%4) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 4]
  return %5, %4
",
    );
    assert_eq!(fused.launches(), 2);
    assert!(fused.steps.iter().all(is_plain), "{fused:#?}");
    // %5 is read by two kernels: it cannot be computed inside either.
    let (fused, _) = lowered(
        "  %4 = linear(%1, %2, %3) : ragged<f32>[B; %0, 4]
  %5 = relu(%4) : ragged<f32>[B; %0, 4]
  %6 = softmax(%5) {axis = -1} : ragged<f32>[B; %0, 4]
  %7 = layer_norm(%5) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 4]
  return %6, %7
",
    );
    assert_eq!(fused.launches(), 3, "{fused:#?}");
}

#[test]
fn an_epilogue_waits_for_no_later_value() {
    // The add reads %5, computed after the GEMM: it cannot run inside the GEMM.
    let (fused, _) = lowered(
        "  %4 = linear(%1, %2, %3) : ragged<f32>[B; %0, 4]
  %5 = exp(%1) : ragged<f32>[B; %0, 4]
  %6 = add(%4, %5) : ragged<f32>[B; %0, 4]
  return %6
",
    );
    assert_eq!(fused.launches(), 3, "{fused:#?}");
    assert!(fused.steps.iter().all(is_plain), "{fused:#?}");
}
