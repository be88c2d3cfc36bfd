//! Mutated `.nir` texts through the reader, the verifier, the default pipeline and
//! lowering: each gives a typed error or a graph, never a panic; a graph that reads
//! prints to a text that reads back to it. `NESTOR_FUZZ_TEXTS` sets how many texts
//! (`make fuzz` runs a million; `make test` a bounded few thousand).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::{parse, print};
use nestor_passes::{lower, Limits, Pipeline};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The golden texts of the repository, the seeds of the mutations.
fn seeds() -> Vec<String> {
    let root = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    );
    let dir = root.join("../tests/filetests");
    let mut seeds: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
        .map(|entry| std::fs::read_to_string(entry.unwrap().path()).unwrap())
        .collect();
    seeds.sort();
    assert!(!seeds.is_empty(), "no seeds in {}", dir.display());
    seeds
}

/// Random choices, reproducible from the text number alone.
struct Random(StdRng);

impl Random {
    fn below(&mut self, bound: usize) -> usize {
        self.0.random_range(0..bound.max(1))
    }
}

/// Pieces that make mutations hit the grammar rather than only break tokens.
const PIECES: &[&str] = &[
    "%0",
    "%1",
    "%99",
    "-1",
    "0",
    "1",
    "4294967296",
    "9223372036854775807",
    "-9223372036854775808",
    "1e308",
    "nan",
    "inf",
    "f32",
    "f16",
    "i64",
    "bool",
    "ragged<f32>[B; %0, 4]",
    "f32[B, 4]",
    "lengths[B]",
    "max(%0)",
    "(",
    ")",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "=",
    "\"",
    "\\u{0}",
    "@",
    "graph @g {",
    "return",
    "add",
    "softmax",
    "per_element(%1)",
    "dims = [1]",
    "expr = \"(neg $0)\"",
];

/// Text number `n`: a seed with one to four random edits (delete, duplicate, insert a
/// piece, swap two lines, truncate).
fn mutated(seeds: &[String], n: u64) -> String {
    let mut random = Random(StdRng::seed_from_u64(n));
    let mut text: Vec<char> = seeds[random.below(seeds.len())].chars().collect();
    for _ in 0..1 + random.below(4) {
        let at = random.below(text.len() + 1);
        match random.below(5) {
            0 => {
                let end = (at + 1 + random.below(8)).min(text.len());
                text.drain(at.min(end)..end);
            }
            1 => {
                let end = (at + 1 + random.below(16)).min(text.len());
                let copy: Vec<char> = text[at.min(end)..end].to_vec();
                text.splice(at..at, copy);
            }
            2 => {
                let piece = PIECES[random.below(PIECES.len())];
                text.splice(at..at, piece.chars());
            }
            3 => {
                let mut lines: Vec<String> = text
                    .iter()
                    .collect::<String>()
                    .lines()
                    .map(str::to_owned)
                    .collect();
                let (a, b) = (random.below(lines.len()), random.below(lines.len()));
                if a < lines.len() && b < lines.len() {
                    lines.swap(a, b);
                }
                text = (lines.join("\n") + "\n").chars().collect();
            }
            _ => text.truncate(at),
        }
    }
    text.into_iter().collect()
}

/// What happens to one text; a panic anywhere fails the test with the text's number.
fn exercise(text: &str) -> bool {
    let Ok(graph) = parse(text) else {
        return false;
    };
    let printed = print(&graph);
    let again =
        parse(&printed).unwrap_or_else(|error| panic!("reprint does not read: {error}\n{printed}"));
    assert_eq!(
        again, graph,
        "print then parse changed the graph:\n{printed}"
    );
    if let Ok(optimized) = Pipeline::optimizing(Limits::untimed()).run(&graph) {
        let _ = lower(&optimized);
    }
    true
}

#[test]
fn mutated_texts_give_typed_errors_or_graphs_never_panics() {
    let seeds = seeds();
    let count: u64 = std::env::var("NESTOR_FUZZ_TEXTS")
        .ok()
        .and_then(|count| count.parse().ok())
        .unwrap_or(3_000);
    let mut read = 0;
    for n in 0..count {
        let text = mutated(&seeds, n);
        let outcome = std::panic::catch_unwind(|| exercise(&text));
        match outcome {
            Ok(true) => read += 1,
            Ok(false) => {}
            Err(_) => panic!("text {n} panicked (NESTOR_FUZZ_TEXTS reproduces it):\n{text}"),
        }
    }
    println!("{count} mutated texts, {read} of them graphs");
    // Some mutations keep a text readable (a changed number, a swapped line).
    assert!(
        count < 100 || read > 0,
        "no mutated text read back: are the seeds right?"
    );
}
