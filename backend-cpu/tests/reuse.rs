//! One executable run many times: what a run keeps for the next (its working lists,
//! offsets and free buffers) never changes a later result, whatever the lengths before
//! it and whether the run before it failed.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::parse;
use nestor_passes::lower;
use nestor_runtime::{InputData, RunData, RuntimeError, Stats};
use proptest::prelude::*;

/// Padding reads the longest length, the sum over each element's rows its offsets; the
/// relu between has a buffer of its own.
const PADDED_RELU: &str = "graph @padded_relu {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 3]
  %2 = pad(%1) {value = 0.0} : f32[B, max(%0), 3]
  %3 = relu(%2) : f32[B, max(%0), 3]
  %4 = unpad(%3, %0) : ragged<f32>[B; %0, 3]
  %5 = sum(%4) {dims = [1], keepdim = false} : f32[B, 3]
  return %4, %5
}
";

/// The relu of `values` and its sums over each element's rows.
fn expected(lengths: &[i64], values: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let relu: Vec<f32> = values.iter().map(|v| v.max(0.0)).collect();
    let mut sums = vec![0.0f32; lengths.len() * 3];
    let mut row = 0usize;
    for (element, &length) in lengths.iter().enumerate() {
        for _ in 0..length {
            for column in 0..3 {
                sums[element * 3 + column] += relu[row * 3 + column];
            }
            row += 1;
        }
    }
    (relu, sums)
}

/// Checks a run's results against [`expected`].
fn check(outputs: &[nestor_runtime::RunOutput], lengths: &[i64], values: &[f32]) {
    let (relu, sums) = expected(lengths, values);
    let RunData::F32(packed) = &outputs[0].data else {
        panic!("f32 program")
    };
    assert_eq!(packed, &relu, "lengths {lengths:?}");
    let RunData::F32(summed) = &outputs[1].data else {
        panic!("f32 program")
    };
    assert_eq!(summed, &sums, "lengths {lengths:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    #[test]
    fn later_runs_do_not_see_earlier_ones(
        batches in proptest::collection::vec(
            (proptest::collection::vec(0i64..6, 1..6), any::<bool>()),
            1..6,
        ),
    ) {
        let executable = nestor_backend_cpu::executable(lower(&parse(PADDED_RELU).unwrap()).unwrap()).unwrap();
        for (lengths, fail_first) in batches {
            let total: i64 = lengths.iter().sum();
            let values: Vec<f32> = (0..total * 3).map(|i| (i % 7) as f32 - 3.0).collect();
            if fail_first {
                // One value too many: an error, not a result.
                let mut longer = values.clone();
                longer.push(1.0);
                let failed = executable.run(
                    &[InputData::I64(&lengths), InputData::F32(&longer)],
                    &Stats::default(),
                    None,
                );
                let rejected = matches!(failed, Err(RuntimeError::BadInput { input: 1, .. }));
                prop_assert!(rejected, "{:?}", failed.map(|_| ()));
            }
            let outputs = executable
                .run(&[InputData::I64(&lengths), InputData::F32(&values)], &Stats::default(), None)
                .unwrap();
            check(&outputs, &lengths, &values);
        }
    }
}

#[test]
fn runs_on_several_threads_at_once_each_get_their_own_lists() {
    let executable =
        nestor_backend_cpu::executable(lower(&parse(PADDED_RELU).unwrap()).unwrap()).unwrap();
    std::thread::scope(|scope| {
        for thread in 0..4i64 {
            let executable = &executable;
            scope.spawn(move || {
                for run in 0..50i64 {
                    let lengths: Vec<i64> =
                        (0..1 + (thread + run) % 4).map(|e| (e + run) % 5).collect();
                    let total: i64 = lengths.iter().sum();
                    let values: Vec<f32> =
                        (0..total * 3).map(|i| (i + thread) as f32 - 4.0).collect();
                    let outputs = executable
                        .run(
                            &[InputData::I64(&lengths), InputData::F32(&values)],
                            &Stats::default(),
                            None,
                        )
                        .unwrap();
                    check(&outputs, &lengths, &values);
                }
            });
        }
    });
}

/// Proptest cases: `PROPTEST_CASES` when set (`make fuzz`), else `default`.
fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}
