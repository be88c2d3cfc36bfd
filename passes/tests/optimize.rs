//! The e-graph optimizer, rule by rule: every rule turns its start graph into its goal
//! (alone, so the test shows that rule at work), and rewrites that would be wrong do
//! not happen. Graphs are written in the text form.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_same_bits, assert_same_meaning};
use nestor_frontend::{NestedTensor, Value};
use nestor_ir::{parse, print, BinaryOp, DType, ElemDim, Graph, Op, Type, UnaryOp, ValueId, F64};
use nestor_passes::optimize::{rule_names, rules, StopReason};
use nestor_passes::{Limits, Optimize, Pass, Pipeline};

/// `text` after the optimizer with only `rule`.
fn with_rule(rule: &str, text: &str) -> Graph {
    let graph = parse(text).unwrap();
    let (optimized, report) = Optimize::only(&[rule])
        .unwrap()
        .with_limits(Limits::untimed())
        .optimize(&graph)
        .unwrap();
    optimized.verify().unwrap();
    for phase in &report.phases {
        assert!(matches!(phase.stop, StopReason::Saturated), "{report}");
    }
    optimized
}

/// Asserts that `rule` turns `start` into `goal` (both in the text form), and that both
/// compute the same on random inputs.
fn rewrites(rule: &str, start: &str, goal: &str) {
    let optimized = with_rule(rule, start);
    assert_eq!(print(&optimized), print(&parse(goal).unwrap()), "{rule}");
    assert_same_meaning(&parse(start).unwrap(), &optimized, rule);
}

/// Asserts that `rule` leaves `start` as it is.
fn keeps(rule: &str, start: &str) {
    let optimized = with_rule(rule, start);
    assert_eq!(print(&optimized), print(&parse(start).unwrap()), "{rule}");
}

const HEADER: &str = "%0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]";

fn graph(body: &str) -> String {
    format!("graph @g {{\n  {HEADER}\n{body}}}\n")
}

#[test]
fn every_rule_is_named_once_and_says_why_it_holds() {
    let names = rule_names();
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), names.len());
    assert!(rules().iter().all(|rule| !rule.why.is_empty()));
    let error = Optimize::only(&["no-such-rule"]).unwrap_err();
    assert!(error.to_string().contains("unpad-pad"), "{error}");
}

#[test]
fn unpad_of_pad_is_the_batch() {
    rewrites(
        "unpad-pad",
        &graph(
            "  %2 = pad(%1) {value = 0.0} : f32[B, max(%0), 4]
  %3 = unpad(%2, %0) : ragged<f32>[B; %0, 4]
  return %3
",
        ),
        &graph("  return %1\n"),
    );
}

#[test]
fn unpad_by_other_lengths_is_not_the_batch() {
    keeps(
        "unpad-pad",
        "graph @g {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
  %2 = input {name = \"M\"} : lengths[B]
  %3 = pad(%1) {value = 0.0} : f32[B, max(%0), 4]
  %4 = unpad(%3, %2) : ragged<f32>[B; %2, 4]
  return %4
}
",
    );
}

#[test]
fn pointwise_ops_on_a_padded_grid_run_packed() {
    rewrites(
        "packed-through-pad",
        &graph(
            "  %2 = input {name = \"w\"} : f32[4]
  %3 = pad(%1) {value = 0.0} : f32[B, max(%0), 4]
  %4 = add(%3, %2) : f32[B, max(%0), 4]
  %5 = relu(%4) : f32[B, max(%0), 4]
  %6 = unpad(%5, %0) : ragged<f32>[B; %0, 4]
  return %6
",
        ),
        // Two rounds: relu moves inside first, then add.
        &graph(
            "  %2 = input {name = \"w\"} : f32[4]
  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = relu(%3) : ragged<f32>[B; %0, 4]
  return %4
",
        ),
    );
}

#[test]
fn an_operand_that_varies_over_the_grid_keeps_the_padding() {
    keeps(
        "packed-through-pad",
        &graph(
            "  %2 = input {name = \"g\"} : f32[B, max(%0), 4]
  %3 = pad(%1) {value = 0.0} : f32[B, max(%0), 4]
  %4 = add(%3, %2) : f32[B, max(%0), 4]
  %5 = unpad(%4, %0) : ragged<f32>[B; %0, 4]
  return %5
",
        ),
    );
}

#[test]
fn multiplying_by_the_packed_mask_is_nothing() {
    let start = "graph @g {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0]
  %2 = mask(%0) : bool[B, max(%0)]
  %3 = unpad(%2, %0) : ragged<bool>[B; %0]
  %4 = cast(%3) {dtype = f32} : ragged<f32>[B; %0]
  %5 = mul(%1, %4) : ragged<f32>[B; %0]
  %6 = where(%3, %5, %1) : ragged<f32>[B; %0]
  return %6
}
";
    let goal = "graph @g {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0]
  return %1
}
";
    rewrites("all-true-mask", start, goal);
}

#[test]
fn the_mask_of_other_lengths_is_kept() {
    keeps(
        "all-true-mask",
        "graph @g {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0]
  %2 = input {name = \"M\"} : lengths[B]
  %3 = mask(%2) : bool[B, max(%2)]
  %4 = unpad(%3, %0) : ragged<bool>[B; %0]
  %5 = where(%4, %1, %1) : ragged<f32>[B; %0]
  return %5
}
",
    );
}

#[test]
fn reshape_chains_fold_and_views_that_change_nothing_go() {
    rewrites(
        "reshape-chain",
        &graph(
            "  %2 = reshape_tail(%1) {tail = [2, 2]} : ragged<f32>[B; %0, 2, 2]
  %3 = reshape_tail(%2) {tail = [4, 1]} : ragged<f32>[B; %0, 4, 1]
  return %3
",
        ),
        &graph(
            "  %2 = reshape_tail(%1) {tail = [4, 1]} : ragged<f32>[B; %0, 4, 1]
  return %2
",
        ),
    );
    rewrites(
        "view-identity",
        &graph(
            "  %2 = reshape_tail(%1) {tail = [4]} : ragged<f32>[B; %0, 4]
  %3 = dropout(%2) {p = 0.1, train = false} : ragged<f32>[B; %0, 4]
  %4 = reshape_tail(%3) {tail = [2, 2]} : ragged<f32>[B; %0, 2, 2]
  %5 = transpose_static(%4) {dim0 = 1, dim1 = 2} : ragged<f32>[B; %0, 2, 2]
  %6 = transpose_static(%5) {dim0 = 2, dim1 = 1} : ragged<f32>[B; %0, 2, 2]
  return %6
",
        ),
        &graph(
            "  %2 = reshape_tail(%1) {tail = [2, 2]} : ragged<f32>[B; %0, 2, 2]
  return %2
",
        ),
    );
}

#[test]
fn training_dropout_is_not_a_view() {
    keeps(
        "view-identity",
        &graph(
            "  %2 = dropout(%1) {p = 0.1, train = true} : ragged<f32>[B; %0, 4]
  return %2
",
        ),
    );
}

#[test]
fn exact_identities_go() {
    let start = graph(
        "  %2 = const {value = 1.0, dtype = f32} : f32[]
  %3 = mul(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = div(%3, %2) : ragged<f32>[B; %0, 4]
  %5 = mul(%2, %4) : ragged<f32>[B; %0, 4]
  return %5
",
    );
    rewrites("mul-one", &start, &graph("  return %1\n"));
    rewrites(
        "add-negative-zero",
        &graph(
            "  %2 = const {value = -0.0, dtype = f32} : f32[]
  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = const {value = 0.0, dtype = f32} : f32[]
  %5 = sub(%3, %4) : ragged<f32>[B; %0, 4]
  return %5
",
        ),
        &graph("  return %1\n"),
    );
    rewrites(
        "double-negation",
        &graph(
            "  %2 = neg(%1) : ragged<f32>[B; %0, 4]
  %3 = neg(%2) : ragged<f32>[B; %0, 4]
  return %3
",
        ),
        &graph("  return %1\n"),
    );
    rewrites(
        "cast-round-trip",
        &graph(
            "  %2 = cast(%1) {dtype = f64} : ragged<f64>[B; %0, 4]
  %3 = cast(%2) {dtype = f32} : ragged<f32>[B; %0, 4]
  %4 = cast(%3) {dtype = f32} : ragged<f32>[B; %0, 4]
  return %4
",
        ),
        &graph("  return %1\n"),
    );
}

#[test]
fn inexact_identities_stay() {
    // -0 + 0 is +0, so x + 0 is not x.
    keeps(
        "add-negative-zero",
        &graph(
            "  %2 = const {value = 0.0, dtype = f32} : f32[]
  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  return %3
",
        ),
    );
    // f16 rounds f32 values.
    keeps(
        "cast-round-trip",
        &graph(
            "  %2 = cast(%1) {dtype = f16} : ragged<f16>[B; %0, 4]
  %3 = cast(%2) {dtype = f32} : ragged<f32>[B; %0, 4]
  return %3
",
        ),
    );
    // An integer times a float 1 is a float: another type, so not the integer.
    keeps(
        "mul-one",
        "graph @g {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"ids\"} : ragged<i64>[B; %0]
  %2 = const {value = 1.0, dtype = f32} : f32[]
  %3 = mul(%1, %2) : ragged<f32>[B; %0]
  return %3
}
",
    );
}

#[test]
fn per_element_regions_of_row_wise_ops_run_packed() {
    rewrites(
        "packed-per-element",
        &graph(
            "  %2 = input {name = \"w\"} : f32[3, 4]
  %3 = per_element(%1, %2) : ragged<f32>[B; %0, 3] graph @body {
    %0 = input {name = \"element\"} : f32[L, 4]
    %1 = input {name = \"w\"} : f32[3, 4]
    %2 = linear(%0, %1) : f32[L, 3]
    %3 = softmax(%2) {axis = -1} : f32[L, 3]
    return %3
  }
  return %3
",
        ),
        &graph(
            "  %2 = input {name = \"w\"} : f32[3, 4]
  %3 = linear(%1, %2) : ragged<f32>[B; %0, 3]
  %4 = softmax(%3) {axis = -1} : ragged<f32>[B; %0, 3]
  return %4
",
        ),
    );
}

#[test]
fn per_element_regions_of_other_ops_stay() {
    // Training dropout draws its mask per call: one draw per element is not the
    // draw of one packed call.
    keeps(
        "packed-per-element",
        &graph(
            "  %2 = per_element(%1) : ragged<f32>[B; %0, 4] graph @body {
    %0 = input {name = \"element\"} : f32[L, 4]
    %1 = dropout(%0) {p = 0.5, train = true} : f32[L, 4]
    return %1
  }
  return %2
",
        ),
    );
}

#[test]
fn pointwise_chains_fuse_into_one_kernel() {
    rewrites(
        "fuse-pointwise",
        &graph(
            "  %2 = input {name = \"w\"} : f32[4]
  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = relu(%3) : ragged<f32>[B; %0, 4]
  %5 = const {value = 2.0, dtype = f32} : f32[]
  %6 = mul(%4, %5) : ragged<f32>[B; %0, 4]
  return %6
",
        ),
        &graph(
            "  %2 = input {name = \"w\"} : f32[4]
  %3 = fused(%1, %2) {expr = \"(mul (relu (add $0 $1)) (const 2.0 f32))\"} : ragged<f32>[B; %0, 4]
  return %3
",
        ),
    );
}

#[test]
fn a_value_another_kernel_needs_is_not_fused_away() {
    // %3 is read by the relu and by the output: computing it inside the relu's kernel
    // would compute it twice.
    keeps(
        "fuse-pointwise",
        &graph(
            "  %2 = input {name = \"w\"} : f32[4]
  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = relu(%3) : ragged<f32>[B; %0, 4]
  return %4, %3
",
        ),
    );
}

#[test]
fn equal_length_computations_are_shared() {
    let optimized = with_rule(
        "mul-one",
        &graph(
            "  %2 = max_length(%0) : i64[]
  %3 = max_length(%0) : i64[]
  %4 = add(%2, %3) : i64[]
  return %4
",
        ),
    );
    let maxima = optimized
        .nodes
        .iter()
        .filter(|node| matches!(node.op, Op::MaxLength { .. }))
        .count();
    assert_eq!(maxima, 1, "{}", print(&optimized));
}

#[test]
fn limits_stop_the_rewriting_and_say_so() {
    let start = parse(&graph(
        "  %2 = neg(%1) : ragged<f32>[B; %0, 4]
  %3 = neg(%2) : ragged<f32>[B; %0, 4]
  %4 = neg(%3) : ragged<f32>[B; %0, 4]
  %5 = neg(%4) : ragged<f32>[B; %0, 4]
  return %5
",
    ))
    .unwrap();
    let limited = Optimize::default().with_limits(Limits {
        iterations: 1,
        ..Limits::default()
    });
    let (optimized, report) = limited.optimize(&start).unwrap();
    assert!(
        matches!(report.phases[0].stop, StopReason::IterationLimit(1)),
        "{report}"
    );
    optimized.verify().unwrap();
    let text = report.to_string();
    assert!(text.contains("IterationLimit"), "{text}");
    // Even stopped early, what it chose is correct: fewer negations, an even number.
    let negations = optimized
        .nodes
        .iter()
        .filter(|node| matches!(node.op, Op::Unary { .. }))
        .count();
    assert!(negations % 2 == 0 && negations < 4, "{}", print(&optimized));
}

#[test]
fn dumps_carry_the_report() {
    let dir = std::env::temp_dir().join(format!("nestor-optimize-{}", std::process::id()));
    let start = parse(&graph(
        "  %2 = neg(%1) : ragged<f32>[B; %0, 4]
  %3 = neg(%2) : ragged<f32>[B; %0, 4]
  return %3
",
    ))
    .unwrap();
    let optimized = Pipeline::optimizing(Limits::untimed())
        .dump_to(&dir)
        .run(&start)
        .unwrap();
    assert_eq!(optimized.nodes.len(), 2);
    let stage = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.to_string_lossy().ends_with("-optimize.nir"))
        .unwrap();
    let text = std::fs::read_to_string(&stage).unwrap();
    assert!(text.starts_with("// optimize @g: kernels 2 -> 0"), "{text}");
    assert!(text.contains("stop Saturated"), "{text}");
    assert!(text.contains("double-negation=1"), "{text}");
    // The comments do not stop the file from parsing back.
    assert_eq!(parse(&text).unwrap(), optimized);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(Optimize::default().name(), "optimize");
}

#[test]
fn a_residual_add_becomes_the_prologue_of_its_layer_norm() {
    rewrites(
        "fuse-prologue",
        &graph(
            "  %2 = input {name = \"y\"} : ragged<f32>[B; %0, 4]
  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = layer_norm(%3) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 4]
  return %4
",
        ),
        &graph(
            "  %2 = input {name = \"y\"} : ragged<f32>[B; %0, 4]
  %3 = prologue(%1, %2) {expr = \"(add $0 $1)\", inputs = 2, core = layer_norm, dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 4]
  return %3
",
        ),
    );
}

#[test]
fn an_input_someone_else_reads_is_no_prologue() {
    keeps(
        "fuse-prologue",
        &graph(
            "  %2 = input {name = \"y\"} : ragged<f32>[B; %0, 4]
  %3 = add(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = layer_norm(%3) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 4]
  return %4, %3
",
        ),
    );
}

#[test]
fn activations_and_residuals_become_the_epilogue_of_their_gemm() {
    rewrites(
        "fuse-epilogue",
        &graph(
            "  %2 = param {name = \"w\"} : f32[4, 4]
  %3 = param {name = \"b\"} : f32[4]
  %4 = linear(%1, %2, %3) : ragged<f32>[B; %0, 4]
  %5 = relu(%4) : ragged<f32>[B; %0, 4]
  %6 = add(%5, %1) : ragged<f32>[B; %0, 4]
  return %6
",
        ),
        &graph(
            "  %2 = param {name = \"w\"} : f32[4, 4]
  %3 = param {name = \"b\"} : f32[4]
  %4 = epilogue(%1, %2, %3, %1) {expr = \"(add (relu $0) $1)\", inputs = 1, core = linear} : ragged<f32>[B; %0, 4]
  return %4
",
        ),
    );
}

#[test]
fn a_gemm_result_someone_else_reads_keeps_its_own_kernel() {
    keeps(
        "fuse-epilogue",
        &graph(
            "  %2 = param {name = \"w\"} : f32[4, 4]
  %3 = linear(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = relu(%3) : ragged<f32>[B; %0, 4]
  %5 = softmax(%3) {axis = -1} : ragged<f32>[B; %0, 4]
  return %4, %5
",
        ),
    );
}

/// Every binary op with the constants an identity rule looks for (and near misses), on
/// either side, then negated twice: the whole optimizer keeps every bit (NaN, infinities
/// and signed zeros in the input), so no rule fires where it does not hold (`1 / x`,
/// `x + 0`, `x * -1`...).
#[test]
fn the_optimizer_keeps_every_bit_of_pointwise_graphs() {
    let values = [
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        0.0,
        1.0,
        -2.5,
        1e-40,
    ];
    let lengths = vec![3i64, 0, 5];
    let packed = tch::Tensor::from_slice(&values);
    let batch = NestedTensor::builder()
        .ragged_dims(&[0])
        .tensors(&packed.split_with_sizes([3, 0, 5], 0))
        .unwrap();
    let inputs = [Value::Lengths(lengths), Value::Nested(batch)];
    for &op in BinaryOp::ALL {
        for constant in [0.0, -0.0, 1.0, -1.0, 2.0] {
            for constant_first in [false, true] {
                let mut graph = Graph::new("g");
                let lengths = graph
                    .add_declared(
                        Op::Input { name: "L".into() },
                        Type::Lengths {
                            batch: nestor_ir::Dim::Sym("B".into()),
                        },
                    )
                    .unwrap();
                let x = graph
                    .add_declared(
                        Op::Input { name: "x".into() },
                        Type::Ragged {
                            dtype: DType::F32,
                            batch: nestor_ir::Dim::Sym("B".into()),
                            dims: vec![ElemDim::Ragged(lengths)],
                        },
                    )
                    .unwrap();
                let c = graph
                    .push(Op::Const {
                        value: F64(constant),
                        dtype: DType::F32,
                    })
                    .unwrap();
                let (lhs, rhs): (ValueId, ValueId) = if constant_first { (c, x) } else { (x, c) };
                let mut value = graph.push(Op::Binary { op, lhs, rhs }).unwrap();
                if graph.ty(value).dtype() == Some(DType::F32) {
                    for _ in 0..2 {
                        value = graph
                            .push(Op::Unary {
                                op: UnaryOp::Neg,
                                x: value,
                            })
                            .unwrap();
                    }
                }
                graph.outputs.push(value);
                let (optimized, _) = Optimize::default()
                    .with_limits(Limits::untimed())
                    .optimize(&graph)
                    .unwrap();
                let what = format!("{} with {constant} (first: {constant_first})", op.word());
                assert_same_bits(&graph, &optimized, &inputs, &what);
            }
        }
    }
}

/// Hand-written attention over jagged pairs: `q`, `k` `[B; L, 4]`, `v` `[B; V, 3]`, the
/// scores scaled by `%5` (`scale` is its definition) and normalized over `axis`.
fn pair_attention(values: &str, scale: &str, axis: i64) -> String {
    format!(
        "graph @g {{
  %0 = input {{name = \"L\"}} : lengths[B]
  %1 = input {{name = \"q\"}} : ragged<f32>[B; %0, 4]
  %2 = input {{name = \"k\"}} : ragged<f32>[B; %0, 4]
  %3 = input {{name = \"V\"}} : lengths[B]
  %4 = input {{name = \"v\"}} : ragged<f32>[B; {values}, 3]
  %5 = {scale}
  %6 = transpose_ragged(%2) {{dim0 = 0, dim1 = 1}} : ragged<f32>[B; 4, %0]
  %7 = pair_matmul(%1, %6) : ragged<f32>[B; %0, %0]
  %8 = mul(%7, %5) : ragged<f32>[B; %0, %0]
  %9 = softmax(%8) {{axis = {axis}}} : ragged<f32>[B; %0, %0]
  %10 = pair_matmul(%9, %4) : ragged<f32>[B; %0, 3]
  return %10
}}
"
    )
}

const CONSTANT_SCALE: &str = "const {value = 0.5, dtype = f32} : f32[]";

#[test]
fn hand_written_attention_over_pairs_is_the_attention_op() {
    rewrites(
        "pair-attention",
        &pair_attention("%0", CONSTANT_SCALE, 2),
        "graph @g {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"q\"} : ragged<f32>[B; %0, 4]
  %2 = input {name = \"k\"} : ragged<f32>[B; %0, 4]
  %3 = input {name = \"V\"} : lengths[B]
  %4 = input {name = \"v\"} : ragged<f32>[B; %0, 3]
  %5 = reshape_tail(%1) {tail = [1, 4]} : ragged<f32>[B; %0, 1, 4]
  %6 = reshape_tail(%2) {tail = [1, 4]} : ragged<f32>[B; %0, 1, 4]
  %7 = reshape_tail(%4) {tail = [1, 3]} : ragged<f32>[B; %0, 1, 3]
  %8 = attention(%5, %6, %7) {causal = false, scale = 0.5} : ragged<f32>[B; %0, 1, 3]
  %9 = reshape_tail(%8) {tail = [3]} : ragged<f32>[B; %0, 3]
  return %9
}
",
    );
}

#[test]
fn attention_is_not_guessed_from_pairs_that_differ() {
    let untouched = |start: &str| {
        let optimized = print(&with_rule("pair-attention", start));
        assert!(!optimized.contains("attention("), "{optimized}");
        assert_eq!(optimized.matches("pair_matmul").count(), 2, "{optimized}");
    };
    // A scale that is not a constant: the attention op takes a number.
    untouched(&pair_attention("%0", "input {name = \"s\"} : f32[]", 2));
    // Softmax over the queries, not the keys.
    untouched(&pair_attention("%0", CONSTANT_SCALE, 1));
    // Values of other lengths than the keys (pair_matmul would reject them too: the
    // start graph does not even type, so check the rule through the verifier's eyes).
    let mismatched = pair_attention("%3", CONSTANT_SCALE, 2);
    assert!(
        parse(&mismatched).is_err(),
        "values must share the keys' lengths"
    );
}

/// `pair_attention` with the scaled scores masked by `mask` (its definition, of `%8`).
fn masked_pair_attention(mask: &str) -> String {
    pair_attention("%0", CONSTANT_SCALE, 2).replace(
        "  %9 = softmax(%8) {axis = 2} : ragged<f32>[B; %0, %0]
  %10 = pair_matmul(%9, %4) : ragged<f32>[B; %0, 3]
  return %10",
        &format!(
            "  %9 = {mask}
  %10 = softmax(%9) {{axis = 2}} : ragged<f32>[B; %0, %0]
  %11 = pair_matmul(%10, %4) : ragged<f32>[B; %0, 3]
  return %11"
        ),
    )
}

#[test]
fn causally_masked_attention_over_pairs_is_causal_attention() {
    let optimized = print(&with_rule(
        "pair-attention",
        &masked_pair_attention("causal_fill(%8) {value = -inf} : ragged<f32>[B; %0, %0]"),
    ));
    assert!(
        optimized.contains("attention(") && optimized.contains("causal = true"),
        "{optimized}"
    );
    assert!(!optimized.contains("pair_matmul"), "{optimized}");
    assert_same_meaning(
        &parse(&masked_pair_attention(
            "causal_fill(%8) {value = -inf} : ragged<f32>[B; %0, %0]",
        ))
        .unwrap(),
        &with_rule(
            "pair-attention",
            &masked_pair_attention("causal_fill(%8) {value = -inf} : ragged<f32>[B; %0, %0]"),
        ),
        "causal pair attention",
    );
}

#[test]
fn masks_that_are_not_causal_attention_stay_pairs() {
    for mask in [
        // Masked positions keep some weight: not causal attention.
        "causal_fill(%8) {value = -1000.0} : ragged<f32>[B; %0, %0]",
        // Any other mask (here, no mask at all but a non-causal op in between).
        "tanh(%8) : ragged<f32>[B; %0, %0]",
    ] {
        let optimized = print(&with_rule("pair-attention", &masked_pair_attention(mask)));
        assert!(!optimized.contains("attention("), "{mask}: {optimized}");
    }
}
