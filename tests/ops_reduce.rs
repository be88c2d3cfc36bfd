//! Reductions, softmax and normalizations against per-element libtorch.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_elements, assert_elements_of, batch, close, float_kinds, lengths};
use nestor::{NestedError, NestedTensor, Reduce, Reduced};
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

fn dense(reduced: Reduced) -> Tensor {
    reduced.into_dense().unwrap()
}

/// The per-element reference of a reduction over element dims `dims`.
fn reference(op: Reduce, element: &Tensor, dims: &[i64], keepdim: bool) -> Tensor {
    let kind = if element.is_floating_point() {
        None
    } else {
        Some(Kind::Float)
    };
    match op {
        Reduce::Sum => element.sum_dim_intlist(dims, keepdim, None::<Kind>),
        Reduce::Mean => element.mean_dim(dims, keepdim, kind),
        Reduce::Amax => element.amax(dims, keepdim),
        Reduce::Amin => element.amin(dims, keepdim),
        Reduce::LogSumExp => element.logsumexp(dims, keepdim),
        Reduce::Var { correction } => element.var_correction(dims, correction, keepdim),
        Reduce::Std { correction } => element.std_correction(dims, correction, keepdim),
        Reduce::All => dims
            .iter()
            .rev()
            .fold(element.ne(0), |t, &d| t.all_dim(d, keepdim)),
        Reduce::Any => dims
            .iter()
            .rev()
            .fold(element.ne(0), |t, &d| t.any_dim(d, keepdim)),
    }
}

const OPS: [Reduce; 9] = [
    Reduce::Sum,
    Reduce::Mean,
    Reduce::Amax,
    Reduce::Amin,
    Reduce::LogSumExp,
    Reduce::Var { correction: 1 },
    Reduce::Std { correction: 0 },
    Reduce::All,
    Reduce::Any,
];

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    #[test]
    fn reductions_over_static_ragged_and_several_dims(
        lengths in proptest::collection::vec(1i64..=8, 1..=6),
        kind in prop_oneof![Just(Kind::Float), Just(Kind::Double)],
        keepdim in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let (nested, elements) = batch(&lengths, &[3, 2], kind, seed);
        // (NestedTensor dims, element dims): static, ragged, both, two static.
        for (dims, element_dims) in [(vec![2i64], vec![1i64]), (vec![1], vec![0]), (vec![1, 3], vec![0, 2]), (vec![-1, -2], vec![1, 2])] {
            for op in OPS {
                let result = nested.reduce(op, &dims, keepdim).unwrap();
                let expected: Vec<Tensor> = elements.iter().map(|e| reference(op, e, &element_dims, keepdim)).collect();
                match result {
                    Reduced::Nested(result) => {
                        assert_elements_of(&format!("{op:?} over {dims:?}"), &result, &expected, kind);
                    }
                    Reduced::Dense(result) => {
                        prop_assert!(close(result.tensor(), &Tensor::stack(&expected, 0), kind), "{:?} over {:?}", op, dims);
                    }
                }
            }
        }
    }

    #[test]
    fn the_batch_dim_alone_reduces_every_element_over_all_its_dims(
        lengths in lengths(6, 9),
        kind in float_kinds(),
        keepdim in any::<bool>(),
        seed in 0i64..1000,
    ) {
        // As in DanLing: element i gives op(element_i) over all its dims.
        let (nested, elements) = batch(&lengths, &[3], kind, seed);
        let every = [0i64, 1];
        for op in OPS {
            let empty = lengths.contains(&0);
            if empty && matches!(op, Reduce::Amax | Reduce::Amin) {
                let result = nested.reduce(op, &[0], keepdim);
                prop_assert!(matches!(result, Err(NestedError::EmptyReduction { .. })), "{:?}", op);
                continue;
            }
            let result = dense(nested.reduce(op, &[0], keepdim).unwrap());
            let expected: Vec<Tensor> = elements.iter().map(|e| reference(op, e, &every, keepdim)).collect();
            prop_assert!(close(&result, &Tensor::stack(&expected, 0), kind), "{:?} over the batch dim", op);
        }
        if !lengths.contains(&0) {
            let (values, indices) = nested.max_dim(0, false).unwrap();
            let (values, indices) = (dense(values), dense(indices));
            for (element, tensor) in elements.iter().enumerate() {
                let element = element as i64;
                prop_assert!(close(&values.get(element), &tensor.max(), kind));
                prop_assert_eq!(indices.int64_value(&[element]), tensor.argmax(None, false).int64_value(&[]));
            }
        }
    }

    #[test]
    fn sums_and_means_over_the_ragged_dim_allow_empty_elements(lengths in lengths(6, 9), kind in float_kinds(), seed in 0i64..1000) {
        let (nested, elements) = batch(&lengths, &[4], kind, seed);
        let sums = dense(nested.sum(&[1], false).unwrap());
        let expected: Vec<Tensor> = elements.iter().map(|e| e.sum_dim_intlist(0, false, None::<Kind>)).collect();
        prop_assert!(close(&sums, &Tensor::stack(&expected, 0), kind));
        let means = dense(nested.mean(&[1], false).unwrap());
        let expected: Vec<Tensor> = elements.iter().map(|e| e.mean_dim(0, false, None::<Kind>)).collect();
        prop_assert!(close(&means, &Tensor::stack(&expected, 0), kind), "empty elements give NaN means, as in torch");
        let total = dense(nested.sum(&[], false).unwrap());
        prop_assert!(close(&total, &Tensor::cat(&elements, 0).sum(None::<Kind>), kind));
        let mean = dense(nested.mean(&[], false).unwrap());
        prop_assert!(close(&mean, &Tensor::cat(&elements, 0).mean(None::<Kind>), kind));
    }

    #[test]
    fn softmax_over_ragged_and_static_dims(lengths in lengths(6, 9), kind in float_kinds(), seed in 0i64..1000) {
        let (nested, elements) = batch(&lengths, &[3], kind, seed);
        for (dim, element_dim) in [(1i64, 0i64), (2, 1), (-1, 1)] {
            let softmax = nested.softmax(dim).unwrap();
            assert_elements(&softmax, &elements.iter().map(|e| e.softmax(element_dim, None::<Kind>)).collect::<Vec<_>>(), kind);
            let log_softmax = nested.log_softmax(dim).unwrap();
            assert_elements(&log_softmax, &elements.iter().map(|e| e.log_softmax(element_dim, None::<Kind>)).collect::<Vec<_>>(), kind);
        }
    }

    #[test]
    fn segmented_softmax_gradients_match(lengths in lengths(5, 8), seed in 0i64..1000) {
        let (nested, elements) = batch(&lengths, &[2], Kind::Double, seed);
        let leaf = nested.set_requires_grad(true).unwrap();
        let weights = Tensor::randn([2], (Kind::Double, Device::Cpu));
        (&leaf.softmax(1).unwrap() * &weights).unwrap().values().sum(Kind::Double).backward();
        let grads = leaf.grad().unwrap().unbind().unwrap();
        for (element, grad) in elements.iter().zip(&grads) {
            let x = element.detach().set_requires_grad(true);
            (x.softmax(0, None::<Kind>) * &weights).sum(Kind::Double).backward();
            prop_assert!(close(grad, &x.grad(), Kind::Double));
        }
    }

    /// max_dim's values' gradient along the ragged dim goes to the first position of the
    /// largest value alone, as torch's max(dim) on each element (values rounded to
    /// halves: ties everywhere).
    #[test]
    fn max_dim_gradients_match_each_elements(lengths in proptest::collection::vec(1i64..8, 1..5), seed in 0i64..1000) {
        let (_, elements) = batch(&lengths, &[2], Kind::Double, seed);
        let elements: Vec<Tensor> = elements.iter().map(|e| (e * 2.0).round() / 2.0).collect();
        let nested = NestedTensor::builder().ragged_dims(&[0]).tensors(&elements).unwrap();
        let leaf = nested.set_requires_grad(true).unwrap();
        let weights = Tensor::randn([2], (Kind::Double, Device::Cpu));
        let (largest, _) = leaf.max_dim(1, false).unwrap();
        (dense(largest) * &weights).sum(Kind::Double).backward();
        let grads = leaf.grad().unwrap().unbind().unwrap();
        for (element, grad) in elements.iter().zip(&grads) {
            let x = element.detach().set_requires_grad(true);
            (x.max_dim(0, false).0 * &weights).sum(Kind::Double).backward();
            prop_assert!(close(grad, &x.grad(), Kind::Double), "{} vs {}", grad, x.grad());
        }
    }

    #[test]
    fn layer_norm_and_rms_norm_on_the_static_tail(lengths in lengths(6, 9), kind in float_kinds(), seed in 0i64..1000) {
        let (nested, elements) = batch(&lengths, &[8], kind, seed);
        let weight = Tensor::randn([8], (Kind::Double, Device::Cpu)).to_kind(kind);
        let bias = Tensor::randn([8], (Kind::Double, Device::Cpu)).to_kind(kind);
        let normed = nested.layer_norm(&[8], Some(&weight), Some(&bias), 1e-5).unwrap();
        assert_elements(&normed, &elements.iter().map(|e| e.layer_norm([8], Some(&weight), Some(&bias), 1e-5, false)).collect::<Vec<_>>(), kind);
        let rms = nested.rms_norm(&[8], Some(&weight), Some(1e-6)).unwrap();
        assert_elements(&rms, &elements.iter().map(|e| e.rms_norm([8], Some(&weight), Some(1e-6))).collect::<Vec<_>>(), kind);
    }
}

#[test]
fn max_min_and_argmax_with_indices() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[4, 1, 3], &[2], Kind::Float, 11);
    let (values, indices) = nested.max_dim(1, false)?;
    let (values, indices) = (values.into_dense()?, indices.into_dense()?);
    for (index, element) in elements.iter().enumerate() {
        let (max, argmax) = element.max_dim(0, false);
        assert!(close(&values.get(index as i64), &max, Kind::Float));
        assert!(argmax.equal(&indices.get(index as i64)), "element {index}");
    }
    let (mins, _) = nested.min_dim(-1, true)?;
    let mins = mins.into_nested()?;
    assert_elements(
        &mins,
        &elements
            .iter()
            .map(|e| e.min_dim(1, true).0)
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    let argmax = nested.argmax(2, false)?.into_nested()?;
    for (actual, element) in argmax.unbind()?.iter().zip(&elements) {
        assert!(actual.equal(&element.argmax(1, false)));
    }
    Ok(())
}

#[test]
fn reductions_over_the_batch_dim() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[3, 3, 3], &[2], Kind::Double, 12);
    let stacked = Tensor::stack(&elements, 0);
    // The batch dim alone: every element's own sum (DanLing), not a sum across elements.
    assert!(close(
        &nested.sum(&[0], false)?.into_dense()?,
        &stacked.sum_dim_intlist([1i64, 2].as_slice(), false, None::<Kind>),
        Kind::Double
    ));
    assert_eq!(nested.sum(&[0], true)?.into_dense()?.size(), [3, 1, 1]);
    assert!(close(
        &nested.amax(&[0, 1], false)?.into_dense()?,
        &stacked.amax([0, 1], false),
        Kind::Double
    ));
    assert!(close(
        &nested.mean(&[0, 1], false)?.into_dense()?,
        &stacked.mean_dim(&[0i64, 1][..], false, None::<Kind>),
        Kind::Double
    ));
    let (ragged, _) = batch(&[3, 2], &[2], Kind::Double, 13);
    // Means over the batch and the ragged dim count every real row once.
    let mean = ragged.mean(&[0, 1], false)?.into_dense()?;
    assert!(close(
        &mean,
        &ragged.values().mean_dim(0, false, None::<Kind>),
        Kind::Double
    ));
    assert!(matches!(
        ragged.sum(&[0, 2], false),
        Err(NestedError::ElementShapeMismatch { element: 1, .. })
    ));
    Ok(())
}

#[test]
fn softmax_over_the_batch_dim_is_an_error() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, _) = batch(&[3, 2], &[2], Kind::Float, 1);
    assert!(matches!(
        nested.softmax(0),
        Err(NestedError::BatchDim { dim: 0, .. })
    ));
    Ok(())
}

#[test]
fn extremes_of_empty_elements_are_errors() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, _) = batch(&[3, 0], &[2], Kind::Float, 1);
    assert!(matches!(
        nested.amax(&[1], false),
        Err(NestedError::EmptyReduction { element: 1, .. })
    ));
    assert!(matches!(
        nested.max_dim(1, false),
        Err(NestedError::EmptyReduction { element: 1, .. })
    ));
    Ok(())
}

#[test]
fn reductions_over_pairs_keep_the_other_ragged_dim() -> Result<(), Box<dyn std::error::Error>> {
    let kind = (Kind::Double, Device::Cpu);
    let elements = [
        Tensor::randn([2, 2, 3], kind),
        Tensor::randn([3, 3, 3], kind),
    ];
    let pairs = NestedTensor::from_tensors(&elements)?;
    let rows = pairs.sum(&[2], false)?.into_nested()?;
    assert_elements(
        &rows,
        &elements
            .iter()
            .map(|e| e.sum_dim_intlist(1, false, None::<Kind>))
            .collect::<Vec<_>>(),
        Kind::Double,
    );
    let softmax = pairs.softmax(2)?;
    assert_elements(
        &softmax,
        &elements
            .iter()
            .map(|e| e.softmax(1, None::<Kind>))
            .collect::<Vec<_>>(),
        Kind::Double,
    );
    Ok(())
}

#[test]
fn batch_norm_uses_every_real_element() -> Result<(), Box<dyn std::error::Error>> {
    let kind = (Kind::Double, Device::Cpu);
    let images = [
        Tensor::randn([3, 4, 5], kind),
        Tensor::randn([3, 2, 7], kind),
    ];
    let nested = NestedTensor::from_tensors(&images)?;
    let running_mean = Tensor::zeros([3], kind);
    let running_var = Tensor::ones([3], kind);
    let normed = nested.batch_norm(
        1,
        Some(&running_mean),
        Some(&running_var),
        None,
        None,
        true,
        0.1,
        1e-5,
    )?;
    // Reference: statistics over all real pixels of each channel.
    let pixels = Tensor::cat(
        &images
            .iter()
            .map(|i| i.reshape([3, -1]))
            .collect::<Vec<_>>(),
        1,
    );
    let mean = pixels.mean_dim(1, true, None::<Kind>);
    let var = pixels.var_correction(1, 0, true);
    let expected: Vec<Tensor> = images
        .iter()
        .map(|i| (i - mean.unsqueeze(-1)) / (var.unsqueeze(-1) + 1e-5).sqrt())
        .collect();
    assert_elements(&normed, &expected, Kind::Double);
    let unbiased = pixels.var_correction(1, 1, false);
    assert!(
        close(&running_var, &(0.9 + 0.1 * unbiased), Kind::Double),
        "running statistics are updated"
    );
    Ok(())
}

#[test]
fn dropout_is_identity_in_eval_mode_and_scales_in_training(
) -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[50, 0, 1, 73], &[4], Kind::Float, 2);
    assert_elements(&nested.dropout(0.5, false)?, &elements, Kind::Float);
    let dropped = nested.dropout(0.5, true)?;
    assert_eq!(
        dropped.layout().element_sizes(),
        nested.layout().element_sizes()
    );
    let kept = dropped.values().ne(0.0);
    // 496 values: the kept fraction is 0.5 within 4.5 standard deviations.
    let fraction = kept
        .to_kind(Kind::Double)
        .mean(Kind::Double)
        .double_value(&[]);
    assert!((fraction - 0.5).abs() < 0.1, "kept {fraction}");
    let scaled = dropped.values().masked_select(&kept);
    assert!(close(
        &scaled,
        &(nested.values().masked_select(&kept) * 2.0),
        Kind::Float
    ));
    Ok(())
}
