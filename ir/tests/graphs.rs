//! The text form round-trips, the verifier names the op and the rule it breaks.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::{
    parse, print, to_dot, Attr, BinaryOp, DType, Dim, ElemDim, Graph, LossReduction, Op, ReduceOp,
    SliceBounds, Type, UnaryOp, ValueId, F64,
};
use proptest::prelude::*;

fn ragged(dtype: DType, lengths: ValueId, tail: &[i64]) -> Type {
    Type::Ragged {
        dtype,
        batch: Dim::Sym("B".into()),
        dims: std::iter::once(ElemDim::Ragged(lengths))
            .chain(tail.iter().map(|&s| ElemDim::Fixed(Dim::Static(s))))
            .collect(),
    }
}

fn lengths_type() -> Type {
    Type::Lengths {
        batch: Dim::Sym("B".into()),
    }
}

/// A graph with two length symbols, a token batch, a second batch, weights.
fn base_graph() -> (Graph, [ValueId; 6]) {
    let mut graph = Graph::new("base");
    let l = graph
        .add_declared(Op::Input { name: "L".into() }, lengths_type())
        .unwrap();
    let m = graph
        .add_declared(Op::Input { name: "M".into() }, lengths_type())
        .unwrap();
    let x = graph
        .add_declared(Op::Input { name: "x".into() }, ragged(DType::F32, l, &[4]))
        .unwrap();
    let y = graph
        .add_declared(Op::Input { name: "y".into() }, ragged(DType::F32, m, &[4]))
        .unwrap();
    let w = graph
        .add_declared(
            Op::Param { name: "w".into() },
            Type::dense_static(DType::F32, &[4, 4]),
        )
        .unwrap();
    let b = graph
        .add_declared(
            Op::Param { name: "b".into() },
            Type::dense_static(DType::F32, &[4]),
        )
        .unwrap();
    (graph, [l, m, x, y, w, b])
}

/// One random op over the existing values; ill-typed candidates are skipped by the
/// caller (Graph::push rejects them), so every kept graph is well typed.
fn random_op(choice: u8, a: ValueId, b: ValueId, c: ValueId, number: i64) -> Op {
    let unary = UnaryOp::ALL;
    let binary = [
        BinaryOp::Add,
        BinaryOp::Mul,
        BinaryOp::Sub,
        BinaryOp::Lt,
        BinaryOp::Maximum,
    ];
    let reduce = [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Amax,
        ReduceOp::Var,
        ReduceOp::LogSumExp,
    ];
    match choice % 12 {
        0 => Op::Unary {
            op: unary[number as usize % unary.len()],
            x: a,
        },
        1 => Op::Binary {
            op: binary[number as usize % binary.len()],
            lhs: a,
            rhs: b,
        },
        2 => Op::Linear {
            x: a,
            weight: b,
            bias: Some(c),
        },
        3 => Op::Softmax {
            x: a,
            axis: 1 + number % 2,
            log: number % 3 == 0,
        },
        4 => {
            let op = reduce[number as usize % reduce.len()];
            let correction = i64::from(matches!(op, ReduceOp::Var));
            Op::Reduce {
                op,
                x: a,
                dims: vec![number % 3],
                keepdim: number % 2 == 0,
                correction,
            }
        }
        5 => Op::LayerNorm {
            x: a,
            weight: Some(b),
            bias: Some(c),
            dims: 1,
            eps: F64(1e-5),
        },
        6 => Op::Const {
            value: F64(number as f64 / 7.0),
            dtype: DType::F32,
        },
        7 => Op::Cast {
            x: a,
            dtype: DType::F64,
        },
        8 => Op::Dropout {
            x: a,
            p: F64(0.25),
            train: number % 2 == 0,
        },
        9 => Op::Pad {
            x: a,
            value: F64(-1.5),
        },
        10 => Op::Where {
            condition: a,
            x: b,
            y: c,
        },
        _ => Op::MseLoss {
            x: a,
            target: b,
            reduction: LossReduction::Mean,
        },
    }
}

proptest! {
    #[test]
    fn printing_then_parsing_gives_the_same_graph(steps in proptest::collection::vec((any::<u8>(), any::<u16>(), any::<u16>(), any::<u16>(), -3i64..6), 1..40)) {
        let (mut graph, _) = base_graph();
        for (choice, a, b, c, number) in steps {
            let pick = |index: u16| ValueId(index as u32 % graph.nodes.len() as u32);
            let op = random_op(choice, pick(a), pick(b), pick(c), number);
            let _ = graph.push(op);
        }
        graph.outputs = vec![ValueId(graph.nodes.len() as u32 - 1)];
        graph.verify().unwrap();
        let text = print(&graph);
        let parsed = parse(&text).map_err(|error| TestCaseError::fail(format!("{error}\n{text}")))?;
        prop_assert_eq!(&parsed, &graph);
        prop_assert_eq!(print(&parsed), text);
    }
}

#[test]
fn mixing_two_length_symbols_is_rejected() {
    let (mut graph, [_, _, x, y, _, _]) = base_graph();
    let error = graph
        .push(Op::Binary {
            op: BinaryOp::Add,
            lhs: x,
            rhs: y,
        })
        .unwrap_err();
    assert_eq!(error.op, "add");
    assert!(
        error.rule.contains("mix length symbols %0 and %1"),
        "{error}"
    );
}

#[test]
fn a_wrong_tail_width_into_linear_is_rejected() {
    let (mut graph, [_, _, x, _, _, _]) = base_graph();
    let wide = graph
        .add_declared(
            Op::Param {
                name: "wide".into(),
            },
            Type::dense_static(DType::F32, &[8, 5]),
        )
        .unwrap();
    let error = graph
        .push(Op::Linear {
            x,
            weight: wide,
            bias: None,
        })
        .unwrap_err();
    assert_eq!(error.op, "linear");
    assert!(error.rule.contains("[out, 4]"), "{error}");
}

/// topk down a ragged dim takes `constant_lengths` of that dim's lengths, `k` each
/// (one symbol however often asked for), and gives the result those lengths; other
/// lengths, a missing one, or lengths along a static dim are rejected naming the op;
/// the graph prints and parses back.
#[test]
fn top_rows_take_constant_lengths_of_k() {
    let (mut graph, [l, m, x, _, _, _]) = base_graph();
    let three = graph.constant_lengths(l, 3).unwrap();
    assert_eq!(graph.constant_lengths(l, 3).unwrap(), three);
    let top = |lengths, axis, k| Op::TopK {
        x,
        lengths,
        axis,
        k,
        largest: true,
        positions: false,
    };
    let values = graph.push(top(Some(three), 1, 3)).unwrap();
    assert_eq!(graph.ty(values), &ragged(DType::F32, three, &[4]));
    let other = graph.constant_lengths(m, 3).unwrap();
    for (lengths, axis, k) in [
        (Some(other), 1, 3),
        (None, 1, 3),
        (Some(three), 1, 2),
        (Some(three), 2, 3),
    ] {
        let error = graph.push(top(lengths, axis, k)).unwrap_err();
        assert_eq!(error.op, "topk", "{error}");
    }
    let gradient = graph
        .push(Op::TopKGrad {
            g: values,
            x,
            axis: 1,
            k: 3,
            largest: true,
        })
        .unwrap();
    assert_eq!(graph.ty(gradient), graph.ty(x));
    graph.outputs = vec![values, gradient];
    graph.verify().unwrap();
    assert_eq!(parse(&print(&graph)).unwrap(), graph);
}

#[test]
fn ragged_slices_take_the_lengths_of_their_formula() {
    let (mut graph, [l, m, x, y, _, _]) = base_graph();
    let bounds = |start, end| SliceBounds { start, end };
    let tail = graph.slice_lengths(l, bounds(1, i64::MAX)).unwrap();
    // `[:-1]` keeps as many rows as `[1:]`: one symbol; `[:]` is the lengths themselves.
    assert_eq!(graph.slice_lengths(l, bounds(0, -1)).unwrap(), tail);
    assert_eq!(graph.slice_lengths(l, SliceBounds::ALL).unwrap(), l);
    let slice = |x, lengths, start, end| Op::SliceRagged {
        x,
        lengths,
        start,
        end,
    };
    let head = graph.push(slice(x, tail, 0, -1)).unwrap();
    let shifted = graph.push(slice(x, tail, 1, i64::MAX)).unwrap();
    assert_eq!(graph.ty(head), &ragged(DType::F32, tail, &[4]));
    let product = graph
        .push(Op::Binary {
            op: BinaryOp::Mul,
            lhs: head,
            rhs: shifted,
        })
        .unwrap();
    // Lengths of another formula, of other lengths, or none.
    for (x, lengths, start, end) in [
        (x, tail, 2, i64::MAX),
        (y, tail, 1, i64::MAX),
        (x, l, 1, i64::MAX),
        (x, m, 0, i64::MAX),
    ] {
        let error = graph.push(slice(x, lengths, start, end)).unwrap_err();
        assert_eq!(error.op, "slice_ragged", "{error}");
    }
    let gradient = graph
        .push(Op::UnsliceRagged {
            g: product,
            like: x,
            start: 0,
            end: -1,
        })
        .unwrap();
    assert_eq!(graph.ty(gradient), graph.ty(x));
    let wrong = Op::UnsliceRagged {
        g: product,
        like: y,
        start: 0,
        end: -1,
    };
    assert_eq!(graph.push(wrong).unwrap_err().op, "unslice_ragged");
    graph.outputs = vec![product, gradient];
    graph.verify().unwrap();
    assert_eq!(parse(&print(&graph)).unwrap(), graph);
}

#[test]
fn softmax_over_the_batch_dim_is_rejected() {
    let (mut graph, [_, _, x, _, _, _]) = base_graph();
    let error = graph
        .push(Op::Softmax {
            x,
            axis: 0,
            log: false,
        })
        .unwrap_err();
    assert_eq!(error.op, "softmax");
    assert!(error.rule.contains("batch dim"), "{error}");
}

#[test]
fn the_verifier_checks_declared_types_and_definition_order() {
    let (mut graph, [_, _, x, _, _, _]) = base_graph();
    let relu = graph
        .push(Op::Unary {
            op: UnaryOp::Relu,
            x,
        })
        .unwrap();
    graph.outputs = vec![relu];
    graph.verify().unwrap();
    let mut wrong_type = graph.clone();
    wrong_type.nodes[relu.index()].ty = Type::dense_static(DType::F32, &[4]);
    let error = wrong_type.verify().unwrap_err();
    assert_eq!((error.value, error.op), (relu, "relu"));
    let mut use_before_def = graph.clone();
    use_before_def.nodes[relu.index()].op = Op::Unary {
        op: UnaryOp::Relu,
        x: ValueId(99),
    };
    assert!(use_before_def
        .verify()
        .unwrap_err()
        .rule
        .contains("not defined before"));
    let mut bad_lengths = Graph::new("bad");
    let error = bad_lengths
        .add_declared(
            Op::Input { name: "x".into() },
            ragged(DType::F32, ValueId(0), &[2]),
        )
        .unwrap_err();
    assert!(error.rule.contains("not a lengths value"), "{error}");
}

/// A graph's name that is not one word (a compiled function named `"inner dims"`, or
/// with a quote in it) is quoted in the text and reads back.
#[test]
fn names_that_are_not_words_round_trip() {
    for name in ["inner dims", "a \"quoted\" name", "3d", "ok_name.v2"] {
        let (mut graph, [_, _, x, _, _, _]) = base_graph();
        graph.name = name.into();
        graph.outputs = vec![x];
        let text = print(&graph);
        assert_eq!(parse(&text).unwrap(), graph, "{text}");
    }
}

#[test]
fn parse_errors_name_the_line() {
    let text = "graph @g {\n  %0 = input {name = \"L\"} : lengths[B]\n  %1 = relu(%0) : lengths[B]\n  return %1\n}\n";
    let error = parse(text).unwrap_err();
    assert_eq!(error.line, 3, "{error}");
    let error = parse("graph @g {\n  %0 = frobnicate : f32[]\n  return\n}\n").unwrap_err();
    assert!(error.message.contains("unknown op frobnicate"), "{error}");
}

#[test]
fn pairs_pad_and_dot_output() {
    let mut graph = Graph::new("pairs");
    let l = graph
        .add_declared(Op::Input { name: "L".into() }, lengths_type())
        .unwrap();
    let scores = Type::Ragged {
        dtype: DType::F32,
        batch: Dim::Sym("B".into()),
        dims: vec![
            ElemDim::Ragged(l),
            ElemDim::Ragged(l),
            ElemDim::Fixed(Dim::Static(2)),
        ],
    };
    let s = graph
        .add_declared(
            Op::Input {
                name: "scores".into(),
            },
            scores,
        )
        .unwrap();
    let p = graph
        .push(Op::Softmax {
            x: s,
            axis: 2,
            log: false,
        })
        .unwrap();
    let padded = graph
        .push(Op::Pad {
            x: p,
            value: F64(0.0),
        })
        .unwrap();
    assert_eq!(graph.ty(padded).to_string(), "f32[B, max(%0), max(%0), 2]");
    graph.outputs = vec![padded];
    assert_eq!(parse(&print(&graph)).unwrap(), graph);
    let dot = to_dot(&graph);
    assert!(dot.starts_with("digraph \"pairs\""));
    assert!(
        dot.contains("v1 -> v2;") && dot.contains("v3 -> out0;"),
        "{dot}"
    );
}

/// Every op named by a kind (unary and binary functions, reductions, pooling) prints and
/// parses back as itself, and no two kinds share a name.
#[test]
fn every_kind_word_names_one_op_and_parses_back() {
    let mut names = std::collections::HashSet::new();
    let x = ValueId(0);
    let ops = UnaryOp::ALL
        .iter()
        .map(|&op| Op::Unary { op, x })
        .chain(
            BinaryOp::ALL
                .iter()
                .map(|&op| Op::Binary { op, lhs: x, rhs: x }),
        )
        .chain(ReduceOp::ALL.iter().map(|&op| Op::Reduce {
            op,
            x,
            dims: vec![1],
            keepdim: false,
            correction: i64::from(op.has_correction()),
        }));
    for op in ops {
        assert!(names.insert(op.name()), "{} names two ops", op.name());
        let attrs: Vec<(String, Attr)> = op
            .attrs()
            .into_iter()
            .map(|(key, value)| (key.to_owned(), value))
            .collect();
        let parsed = Op::from_parts(op.name(), &op.operands(), &attrs, None);
        assert_eq!(parsed.as_ref(), Ok(&op), "{}", op.name());
    }
}

#[test]
fn products_convolutions_and_attention_of_mixed_dtypes_are_rejected() {
    // libtorch refuses these (it promotes elsewhere: elementwise ops, where, losses).
    let cases = [
        (
            "linear",
            r#"%2 = param {name = "w"} : f64[4, 8]
  %3 = linear(%1, %2) : ragged<f32>[B; %0, 4]"#,
        ),
        (
            "matmul",
            r#"%2 = param {name = "w"} : bf16[8, 4]
  %3 = matmul(%1, %2) : ragged<f32>[B; %0, 4]"#,
        ),
        (
            "attention",
            r#"%2 = cast(%1) {dtype = f64} : ragged<f64>[B; %0, 8]
  %3 = reshape_tail(%1) {tail = [2, 4]} : ragged<f32>[B; %0, 2, 4]
  %4 = reshape_tail(%2) {tail = [2, 4]} : ragged<f64>[B; %0, 2, 4]
  %5 = attention(%3, %4, %3) {causal = false} : ragged<f32>[B; %0, 2, 4]"#,
        ),
    ];
    for (op, body) in cases {
        let result = if op == "attention" { "%5" } else { "%3" };
        let text = format!(
            r#"graph @g {{
  %0 = input {{name = "x.lengths"}} : lengths[B]
  %1 = input {{name = "x"}} : ragged<f32>[B; %0, 8]
  {body}
  return {result}
}}"#
        );
        let error = nestor_ir::parse(&text).unwrap_err().to_string();
        assert!(
            error.contains(&format!("{op} needs operands of one dtype")),
            "{op}: {error}"
        );
    }
    let conv = r#"graph @g {
  %0 = input {name = "h"} : lengths[B]
  %1 = input {name = "w"} : lengths[B]
  %2 = input {name = "x"} : ragged<f32>[B; 3, %0, %1]
  %3 = param {name = "k"} : f64[4, 3, 3, 3]
  %4 = per_element(%2, %3) : ragged<f32>[B; 4, %0, %1] graph @conv2d {
    %0 = input {name = "x"} : f32[3, ?, ?]
    %1 = input {name = "k"} : f64[4, 3, 3, 3]
    %2 = conv2d(%0, %1) {stride = [1, 1], padding = [1, 1], dilation = [1, 1], groups = 1} : f32[4, ?, ?]
    return %2
  }
  return %4
}"#;
    let error = nestor_ir::parse(conv).unwrap_err().to_string();
    assert!(
        error.contains("conv2d needs operands of one dtype"),
        "{error}"
    );
}

#[test]
fn layer_norm_parameters_take_the_input_dtype_or_f32_for_half_inputs() {
    // libtorch: f32 input with f64 or bf16 parameters fails; bf16 / f16 input with f32
    // parameters is its mixed-dtype kernel.
    let text = |x: &str, parameter: &str| {
        format!(
            r#"graph @g {{
  %0 = input {{name = "x.lengths"}} : lengths[B]
  %1 = input {{name = "x"}} : ragged<{x}>[B; %0, 8]
  %2 = param {{name = "w"}} : {parameter}[8]
  %3 = layer_norm(%1, %2, %2) {{dims = 1, eps = 1e-5}} : ragged<{x}>[B; %0, 8]
  return %3
}}"#
        )
    };
    for (x, parameter, accepted) in [
        ("f32", "f64", false),
        ("f32", "bf16", false),
        ("f64", "f32", false),
        ("f32", "f32", true),
        ("bf16", "f32", true),
        ("f16", "f32", true),
        ("bf16", "bf16", true),
    ] {
        let result = nestor_ir::parse(&text(x, parameter));
        assert_eq!(result.is_ok(), accepted, "{x} with {parameter}: {result:?}");
        if let Err(error) = result {
            assert!(
                error
                    .to_string()
                    .contains("layer_norm needs a weight of the input's dtype"),
                "{error}"
            );
        }
    }
}
