//! Pad and unpad steps: a ragged batch padded to its grid, changed there, and packed
//! again, for random lengths (0 and 1 included) and batch size 1.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::parse;
use nestor_passes::lower;
use nestor_runtime::{InputData, RunData, RunShape, Stats};
use proptest::prelude::*;

const ROUND_TRIP: &str = "graph @round_trip {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 2]
  %2 = pad(%1) {value = -1.0} : f32[B, max(%0), 2]
  %3 = relu(%2) : f32[B, max(%0), 2]
  %4 = unpad(%3, %0) : ragged<f32>[B; %0, 2]
  return %4, %2
}
";

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(32), ..ProptestConfig::default() })]

    #[test]
    fn padding_and_packing_again_round_trips(lengths in proptest::collection::vec(0i64..5, 1..5)) {
        let executable = nestor_backend_cpu::executable(lower(&parse(ROUND_TRIP).unwrap()).unwrap()).unwrap();
        let total: i64 = lengths.iter().sum();
        let values: Vec<f32> = (0..total * 2).map(|i| i as f32 - total as f32).collect();
        let outputs = executable
            .run(&[InputData::I64(&lengths), InputData::F32(&values)], &Stats::default(), None)
            .unwrap();
        let RunData::F32(packed) = &outputs[0].data else { panic!("f32 program") };
        let expected: Vec<f32> = values.iter().map(|v| v.max(0.0)).collect();
        prop_assert_eq!(packed, &expected);
        let longest = lengths.iter().copied().max().unwrap_or(0);
        prop_assert_eq!(&outputs[1].shape, &RunShape::Full(vec![lengths.len() as i64, longest, 2]));
        let RunData::F32(grid) = &outputs[1].data else { panic!("f32 program") };
        let mut row = 0;
        for (element, &length) in lengths.iter().enumerate() {
            for t in 0..longest {
                for column in 0..2 {
                    let at = ((element as i64 * longest + t) * 2 + column) as usize;
                    let want = if t < length { values[((row + t) * 2 + column) as usize] } else { -1.0 };
                    prop_assert_eq!(grid[at], want, "element {} row {} column {}", element, t, column);
                }
            }
            row += length;
        }
    }
}

/// Proptest cases: `PROPTEST_CASES` when set (`make fuzz`), else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}
