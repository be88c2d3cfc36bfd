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
