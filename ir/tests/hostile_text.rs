//! The `.nir` reader on hostile texts: deep nesting is an error, not a stack overflow,
//! and every string (control characters, quotes, non-ASCII) survives print and parse.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::{parse, print, FusedExpr};

/// A graph whose per-element bodies nest `depth` deep.
fn nested_bodies(depth: usize) -> String {
    let mut text = String::from(
        "graph @g {\n  %0 = input {name = \"L\"} : lengths[B]\n  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]\n",
    );
    text.push_str("  %2 = per_element(%1) : ragged<f32>[B; %0, 4] graph @body {\n");
    text.push_str("    %0 = input {name = \"element\"} : f32[L, 4]\n");
    // Deeper bodies (ill-typed, but the reader stops at their depth first).
    for _ in 1..depth {
        text.push_str("    %1 = per_element(%0) : f32[L, 4] graph @body {\n");
        text.push_str("    %0 = input {name = \"element\"} : f32[L, 4]\n");
    }
    for _ in 0..depth {
        text.push_str("    return %0\n  }\n");
    }
    text.push_str("  return %2\n}\n");
    text
}

#[test]
fn bodies_nested_a_thousand_deep_are_an_error() {
    let error = parse(&nested_bodies(1000)).unwrap_err();
    assert!(error.message.contains("nest deeper"), "{error}");
    // One level is a graph like any other.
    let one = nested_bodies(1);
    assert!(parse(&one).is_ok(), "{one}");
}

#[test]
fn expressions_nested_a_thousand_deep_are_an_error() {
    let deep = format!("{}$0{}", "(neg ".repeat(1000), ")".repeat(1000));
    let error = FusedExpr::parse(&deep).unwrap_err();
    assert!(error.contains("nests deeper"), "{error}");
    let shallow = format!("{}$0{}", "(neg ".repeat(20), ")".repeat(20));
    assert_eq!(FusedExpr::parse(&shallow).unwrap().to_string(), shallow);
}

#[test]
fn every_string_round_trips() {
    for name in [
        "plain",
        "quote \" and backslash \\ inside",
        "control \u{7f} \u{1} \n \t \r \0 characters",
        "non-ASCII: é 漢字 🙂",
        "looks like an escape: \\u{41} \\n",
        "",
    ] {
        let text = format!(
            "graph @g {{\n  %0 = input {{name = {name:?}}} : lengths[B]\n  return %0\n}}\n"
        );
        // Rust's `{:?}` escapes are read too (texts written by hand or by other tools).
        let graph = parse(&text).unwrap_or_else(|error| panic!("{name:?}: {error}"));
        let printed = print(&graph);
        let again = parse(&printed).unwrap_or_else(|error| panic!("{name:?}: {error}\n{printed}"));
        assert_eq!(again, graph, "{name:?}");
        assert!(printed.contains("name ="), "{printed}");
        let nestor_ir::Op::Input { name: read } = &again.nodes[0].op else {
            panic!("{printed}")
        };
        assert_eq!(read, name);
    }
}

#[test]
fn bad_escapes_are_errors() {
    for bad in ["\\u{110000}", "\\u{zz}", "\\u{12345678901}", "\\u"] {
        let text = format!(
            "graph @g {{\n  %0 = input {{name = \"{bad}\"}} : lengths[B]\n  return %0\n}}\n"
        );
        assert!(parse(&text).is_err(), "{bad}");
    }
}

/// A per-element pooling graph with `attributes` on its `max_pool2d`.
fn pooling(attributes: &str) -> String {
    format!(
        "graph @g {{
  %0 = input {{name = \"H\"}} : lengths[B]
  %1 = input {{name = \"W\"}} : lengths[B]
  %2 = input {{name = \"x\"}} : ragged<f32>[B; 4, %0, %1]
  %3 = window_lengths(%0) {{kernel = 2, stride = 2, padding = 0, dilation = 1}} : lengths[B]
  %4 = window_lengths(%1) {{kernel = 2, stride = 2, padding = 0, dilation = 1}} : lengths[B]
  %5 = per_element(%2) : ragged<f32>[B; 4, %3, %4] graph @pool2d {{
    %0 = input {{name = \"element\"}} : f32[4, ?, ?]
    %1 = max_pool2d(%0) {{{attributes}}} : f32[4, ?, ?]
    return %1
  }}
  return %5
}}
"
    )
}

#[test]
fn window_geometries_of_the_wrong_length_or_sign_are_errors() {
    let good = pooling("kernel = [2, 2], stride = [2, 2], padding = [0, 0]");
    parse(&good).unwrap_or_else(|error| panic!("{error}\n{good}"));
    for (attributes, what) in [
        (
            "kernel = [2, 2], stride = [2, 2], padding = [11]",
            "padding",
        ),
        ("kernel = [2], stride = [2, 2], padding = [0, 0]", "kernel"),
        (
            "kernel = [2, 2], stride = [2, 0], padding = [0, 0]",
            "stride",
        ),
        (
            "kernel = [2, 2], stride = [2, 2], padding = [0, -1]",
            "padding",
        ),
        (
            "kernel = [2, 2], stride = [2, 2, 2], padding = [0, 0]",
            "stride",
        ),
    ] {
        let text = pooling(attributes);
        let error = parse(&text).unwrap_err();
        assert!(error.message.contains(what), "{attributes}: {error}");
    }
}

#[test]
fn huge_window_geometries_give_sizes_not_overflows() {
    use nestor_ir::window_output_size;
    assert_eq!(window_output_size(5, 2, 2, 0, 1), 2);
    assert_eq!(window_output_size(i64::MAX, 1, 1, i64::MAX, 1), i64::MAX);
    assert_eq!(window_output_size(4, i64::MAX, 1, 0, i64::MAX), 0);
    assert_eq!(window_output_size(i64::MAX, 3, 1, 1, 1), i64::MAX);
}

#[test]
fn a_convolution_whose_channels_overflow_is_an_error() {
    // Channels a group times groups past i64 (found by the text fuzzer in a build with
    // overflow checks): a typed error naming the product, not a panic.
    let text = r#"graph @g {
  %0 = input {name = "h"} : lengths[B]
  %1 = input {name = "w"} : lengths[B]
  %2 = input {name = "x"} : ragged<f32>[B; 3, %0, %1]
  %3 = param {name = "k"} : f32[4, 4611686018427387904, 3, 3]
  %4 = per_element(%2, %3) : ragged<f32>[B; 4, %0, %1] graph @conv2d {
    %0 = input {name = "x"} : f32[3, ?, ?]
    %1 = input {name = "k"} : f32[4, 4611686018427387904, 3, 3]
    %2 = conv2d(%0, %1) {stride = [1, 1], padding = [1, 1], dilation = [1, 1], groups = 4} : f32[4, ?, ?]
    return %2
  }
  return %4
}"#;
    let error = parse(text).unwrap_err();
    assert!(error.message.contains("overflows"), "{error}");
}
