//! Copy forwarding after lowering: copies of strided views that readers can read in
//! place are dropped; copies something else needs stay.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::parse;
use nestor_passes::step::{Attention, Pointwise};
use nestor_passes::{lower, Expr, Step};

const QKV: &str = "graph @qkv {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 24]
  %2 = reshape_tail(%1) {tail = [3, 2, 4]} : ragged<f32>[B; %0, 3, 2, 4]
  %3 = select_static(%2) {dim = 1, index = 0} : ragged<f32>[B; %0, 2, 4]
  %4 = select_static(%2) {dim = 1, index = 1} : ragged<f32>[B; %0, 2, 4]
  %5 = select_static(%2) {dim = 1, index = 2} : ragged<f32>[B; %0, 2, 4]
  %6 = attention(%3, %4, %5) {causal = false} : ragged<f32>[B; %0, 2, 4]
  return %6
}
";

fn copies(steps: &[Step]) -> usize {
    steps
        .iter()
        .filter(|step| {
            matches!(
                step,
                Step::Pointwise(Pointwise {
                    expr: Expr::Load(0),
                    ..
                })
            )
        })
        .count()
}

#[test]
fn attention_reads_q_k_v_in_place_from_the_packed_projection() {
    let program = lower(&parse(QKV).unwrap()).unwrap();
    assert_eq!(program.steps.len(), 1, "{:#?}", program.steps);
    let Step::Attention(Attention { q, k, v, .. }) = &program.steps[0] else {
        panic!("{:#?}", program.steps)
    };
    for (access, offset) in [(q, 0), (k, 8), (v, 16)] {
        assert_eq!(access.slot, k.slot, "all read the input buffer");
        assert_eq!((access.row_stride, access.offset), (24, offset));
    }
}

#[test]
fn a_copy_that_is_a_result_or_feeds_a_gemm_stays() {
    let text = QKV.replace(
        "  return %6",
        "  %7 = param {name = \"w\"} : f32[5, 8]
  %8 = reshape_tail(%3) {tail = [8]} : ragged<f32>[B; %0, 8]
  %9 = linear(%8, %7) : ragged<f32>[B; %0, 5]
  return %6, %4, %9",
    );
    let program = lower(&parse(&text).unwrap()).unwrap();
    // q feeds a GEMM (which reads whole rows) and k is a result: both copies stay; v
    // is read in place.
    assert_eq!(copies(&program.steps), 2, "{:#?}", program.steps);
}
