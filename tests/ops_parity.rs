//! DanLing parity, round 2: comparisons, segmented sorts, saving and loading, pair
//! layouts and the jagged-pair matmul, checked against per-element libtorch.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{batch, close, float_kinds, lengths};
use nestor::NestedTensor;
use proptest::prelude::*;
use tch::{Kind, Tensor};

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    #[test]
    fn equal_and_allclose_agree_with_every_element(
        lengths in lengths(5, 6),
        kind in float_kinds(),
        seed in 0i64..1000,
        nudge in 0usize..8,
    ) {
        let (nested, elements) = batch(&lengths, &[2], kind, seed);
        prop_assert!(nested.equal(&nested).unwrap());
        prop_assert!(nested.allclose(&nested, 1e-5, 1e-8, false).unwrap());
        prop_assert!(nested.equal(&nested.tensor().unwrap()).unwrap());
        // One value moved: no longer equal, still close within a loose tolerance.
        let total = nested.values().numel();
        if total > 0 {
            let mut flat = nested.values().reshape([-1]).copy();
            let position = (nudge % total) as i64;
            let value = flat.get(position).double_value(&[]);
            let _ = flat.get(position).fill_(value + 1e-3);
            let moved = nested.packed_like(&flat.reshape(nested.values().size())).unwrap();
            let expected = elements.iter().zip(moved.unbind().unwrap()).all(|(a, b)| a.equal(&b));
            prop_assert_eq!(nested.equal(&moved).unwrap(), expected);
            prop_assert!(nested.allclose(&moved, 0.0, 1e-2, false).unwrap());
            prop_assert!(!nested.allclose(&moved, 0.0, 1e-6, false).unwrap() || expected);
        }
        // Another structure: false, not an error.
        let mut longer = lengths.clone();
        longer[0] += 1;
        let (other, _) = batch(&longer, &[2], kind, seed);
        prop_assert!(!nested.equal(&other).unwrap());
        prop_assert!(!nested.allclose(&other, 1.0, 1.0, true).unwrap());
        prop_assert!(!nested.equal(&Tensor::zeros([1, 2, 3], (kind, tch::Device::Cpu))).unwrap());
    }
}

#[test]
fn nans_are_close_only_when_asked() {
    let nested = NestedTensor::from_lists(vec![vec![1.0f32, f32::NAN], vec![2.0]]).unwrap();
    assert!(!nested.equal(&nested).unwrap());
    assert!(!nested.allclose(&nested, 1e-5, 1e-8, false).unwrap());
    assert!(nested.allclose(&nested, 1e-5, 1e-8, true).unwrap());
    // Same elements, lengths packed differently (equal lengths, no ragged dim).
    let dense = NestedTensor::from_lists(vec![vec![1.0f32, 2.0], vec![3.0, 4.0]]).unwrap();
    let ragged = NestedTensor::packed_with_lengths(&dense.values().reshape([-1]), &[2, 2]).unwrap();
    assert!(close(
        &ragged.tensor().unwrap(),
        &dense.tensor().unwrap(),
        Kind::Float
    ));
    assert!(dense.equal(&ragged).unwrap());
}
