//! Packed operators agree with padded libtorch on the valid positions, and their
//! gradients agree with padded autograd.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{batch, close, lengths};
use nestor::NestedTensor;
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

/// Valid positions of a padded `[B, L, C]` result, packed.
fn valid(nested: &NestedTensor, padded: &Tensor) -> Tensor {
    let mask = nested.mask().unwrap();
    padded
        .masked_select(&mask.unsqueeze(-1).expand_as(padded))
        .reshape([-1, padded.size()[2]])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    #[test]
    fn packed_ops_equal_padded_ops_on_valid_positions(lengths in lengths(6, 9), seed in 0i64..1000) {
        let (nested, _) = batch(&lengths, &[4], Kind::Double, seed);
        let leaf = nested.set_requires_grad(true).unwrap();
        let padded = leaf.tensor().unwrap().detach().set_requires_grad(true);
        let mask = leaf.mask().unwrap();
        let weight = Tensor::randn([6, 4], (Kind::Double, Device::Cpu));
        let gamma = Tensor::randn([6], (Kind::Double, Device::Cpu));

        // A packed block: linear, gelu, layer_norm, softmax over the ragged dim.
        let packed = leaf.linear(&weight, None).unwrap().gelu("none").unwrap().layer_norm(&[6], Some(&gamma), None, 1e-5).unwrap();
        let packed_softmax = packed.softmax(1).unwrap();
        // The same block on the padded tensor, with -inf at padding before softmax.
        let dense = padded.linear(&weight, None::<Tensor>).gelu("none").layer_norm([6], Some(&gamma), None::<&Tensor>, 1e-5, false);
        let dense_softmax = dense.masked_fill(&mask.logical_not().unsqueeze(-1), f64::NEG_INFINITY).softmax(1, None::<Kind>);
        prop_assert!(close(packed_softmax.values(), &valid(&leaf, &dense_softmax), Kind::Double));

        // Gradients of a weighted sum agree on the valid positions.
        let probe = Tensor::randn([6], (Kind::Double, Device::Cpu));
        (packed_softmax.values() * &probe).sum(Kind::Double).backward();
        (dense_softmax.nan_to_num(0.0, None, None) * &probe).sum(Kind::Double).backward();
        prop_assert!(close(leaf.grad().unwrap().values(), &valid(&leaf, &padded.grad()), Kind::Double));

        // Sums over the ragged dim equal padded sums (padding is zero).
        let sums = leaf.sum(&[1], false).unwrap().into_dense().unwrap();
        prop_assert!(close(&sums, &padded.sum_dim_intlist(1, false, None::<Kind>), Kind::Double));
    }
}

#[test]
fn gradients_of_segmented_reductions_match_per_element_autograd(
) -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[4, 1, 3], &[3], Kind::Double, 9);
    let leaf = nested.set_requires_grad(true)?;
    let mean = leaf.mean(&[1], false)?.into_dense()?;
    let lse = leaf.logsumexp(&[1], false)?.into_dense()?;
    let max = leaf.amax(&[1], false)?.into_dense()?;
    let std = leaf.std(&[1], 1, false)?.into_dense()?;
    (mean.sum(Kind::Double)
        + lse.sum(Kind::Double) * 2.0
        + max.sum(Kind::Double) * 3.0
        + std.sum(Kind::Double))
    .backward();
    let grads = leaf.grad().ok_or("no gradient")?.unbind()?;
    for (element, grad) in elements.iter().zip(&grads) {
        let x = element.detach().set_requires_grad(true);
        let loss = x.mean_dim(0, false, None::<Kind>).sum(Kind::Double)
            + x.logsumexp(0, false).sum(Kind::Double) * 2.0
            + x.amax(0, false).sum(Kind::Double) * 3.0
            + x.std_correction(0, 1, false).sum(Kind::Double);
        loss.backward();
        assert!(close(grad, &x.grad(), Kind::Double));
    }
    Ok(())
}
