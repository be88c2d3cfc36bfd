//! Per-element convolution and pooling (a small ResNet block over images of different
//! sizes), losses on packed values, structure operations, the execution guard.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_elements, batch, close, lengths};
use nestor::{nested_execution_guard, LossReduction, NestedError, NestedTensor, SlowPath};
use proptest::prelude::*;
use tch::{nn, Device, Kind, Tensor};

fn images(sizes: &[(i64, i64)], channels: i64, seed: i64) -> (NestedTensor, Vec<Tensor>) {
    tch::manual_seed(seed);
    let elements: Vec<Tensor> = sizes
        .iter()
        .map(|&(h, w)| Tensor::randn([channels, h, w], (Kind::Float, Device::Cpu)))
        .collect();
    (NestedTensor::from_tensors(&elements).unwrap(), elements)
}

#[test]
fn convolution_pooling_and_interpolation_per_element() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = images(&[(6, 5), (4, 7), (3, 3)], 2, 1);
    let weight = Tensor::randn([4, 2, 3, 3], (Kind::Float, Device::Cpu));
    let bias = Tensor::randn([4], (Kind::Float, Device::Cpu));
    let one = |e: &Tensor, f: &dyn Fn(&Tensor) -> Tensor| f(&e.unsqueeze(0)).squeeze_dim(0);
    let conv = nested.conv2d(&weight, Some(&bias), [1, 1], [1, 1], [1, 1], 1)?;
    assert_elements(
        &conv,
        &elements
            .iter()
            .map(|e| {
                one(e, &|x| {
                    x.conv2d(&weight, Some(&bias), [1, 1], [1, 1], [1, 1], 1)
                })
            })
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    let pooled = nested.max_pool2d([2, 2], [2, 2], [0, 0])?;
    assert_elements(
        &pooled,
        &elements
            .iter()
            .map(|e| one(e, &|x| x.max_pool2d([2, 2], [2, 2], [0, 0], [1, 1], false)))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    let averaged = nested.avg_pool2d([2, 2], [1, 1], [0, 0])?;
    assert_elements(
        &averaged,
        &elements
            .iter()
            .map(|e| {
                one(e, &|x| {
                    x.avg_pool2d([2, 2], [1, 1], [0, 0], false, false, None::<i64>)
                })
            })
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    let adaptive = nested.adaptive_avg_pool2d([1, 1])?;
    assert!(
        adaptive.layout().ragged_dims().is_empty(),
        "equal output sizes leave no ragged dim"
    );
    assert_eq!(adaptive.values().size(), [3, 2, 1, 1]);
    let resized = nested.interpolate_bilinear(None, Some(2.0), false)?;
    assert_eq!(resized.get(1)?.size(), [2, 8, 14]);
    let (signals, signal_elements) = batch(&[5, 3], &[2], Kind::Float, 3);
    let signals = signals.transpose_to_channels_first()?;
    let kernel = Tensor::randn([3, 2, 2], (Kind::Float, Device::Cpu));
    let conv1d = signals.conv1d(&kernel, None, 1, 0, 1, 1)?;
    assert_elements(
        &conv1d,
        &signal_elements
            .iter()
            .map(|e| {
                one(&e.transpose(0, 1), &|x| {
                    x.conv1d(&kernel, None::<Tensor>, [1], [0], [1], 1)
                })
            })
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    Ok(())
}

/// Elements `[L_i, C]` as `[C, L_i]` (the channel-first layout convolutions take).
trait ChannelsFirst {
    fn transpose_to_channels_first(&self) -> nestor::Result<NestedTensor>;
}

impl ChannelsFirst for NestedTensor {
    fn transpose_to_channels_first(&self) -> nestor::Result<NestedTensor> {
        let elements: Vec<Tensor> = self.unbind()?.iter().map(|e| e.transpose(0, 1)).collect();
        NestedTensor::builder().ragged_dims(&[1]).tensors(&elements)
    }
}

#[test]
fn a_resnet_block_over_images_of_different_sizes() -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(2);
    let store = nn::VarStore::new(Device::Cpu);
    let root = store.root();
    let conv_config = nn::ConvConfig {
        padding: 1,
        bias: false,
        ..Default::default()
    };
    let conv1 = nn::conv2d(&root / "conv1", 3, 3, 3, conv_config);
    let conv2 = nn::conv2d(&root / "conv2", 3, 3, 3, conv_config);
    let head = nn::linear(&root / "head", 3, 5, Default::default());
    let (gamma, beta) = (root.ones("gamma", &[3]), root.zeros("beta", &[3]));
    let block = |x: &NestedTensor| -> nestor::Result<Tensor> {
        let h = x.conv2d(&conv1.ws, None, [1, 1], [1, 1], [1, 1], 1)?;
        let h = h
            .batch_norm(1, None, None, Some(&gamma), Some(&beta), true, 0.1, 1e-5)?
            .relu()?;
        let h = h.conv2d(&conv2.ws, None, [1, 1], [1, 1], [1, 1], 1)?;
        let h = (&h + x)?.relu()?;
        let pooled = h.adaptive_avg_pool2d([1, 1])?.values().flatten(1, -1);
        Ok(pooled.linear(&head.ws, head.bs.as_ref()))
    };
    let (images, elements) = images(&[(8, 6), (5, 9), (7, 7), (4, 4)], 3, 3);
    let logits = block(&images)?;
    assert_eq!(logits.size(), [4, 5]);
    // Reference: per image, with batch statistics over all real pixels.
    let convolve = |e: &Tensor, w: &Tensor| {
        e.unsqueeze(0)
            .conv2d(w, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1)
            .squeeze_dim(0)
    };
    let hidden: Vec<Tensor> = elements.iter().map(|e| convolve(e, &conv1.ws)).collect();
    let pixels = Tensor::cat(
        &hidden
            .iter()
            .map(|h| h.reshape([3, -1]))
            .collect::<Vec<_>>(),
        1,
    );
    let (mean, var) = (
        pixels.mean_dim(1, false, None::<Kind>),
        pixels.var_correction(1, 0, false),
    );
    let expected: Vec<Tensor> = hidden
        .iter()
        .zip(&elements)
        .map(|(h, x)| {
            let normed = ((h - mean.view([3, 1, 1])) / (var.view([3, 1, 1]) + 1e-5).sqrt()).relu();
            let h = (convolve(&normed, &conv2.ws) + x).relu();
            h.mean_dim(&[1i64, 2][..], false, None::<Kind>)
                .linear(&head.ws, head.bs.as_ref())
        })
        .collect();
    assert!(close(&logits, &Tensor::stack(&expected, 0), Kind::Float));
    let mut optimizer = tch::nn::Sgd::default().build(&store, 0.1)?;
    let labels = Tensor::from_slice(&[0i64, 1, 2, 3]);
    let loss = |logits: &Tensor| logits.cross_entropy_for_logits(&labels);
    let before = loss(&block(&images)?).double_value(&[]);
    for _ in 0..10 {
        optimizer.backward_step(&loss(&block(&images)?));
    }
    assert!(
        loss(&block(&images)?).double_value(&[]) < before,
        "the block trains"
    );
    Ok(())
}

use tch::nn::OptimizerConfig;

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(16), ..ProptestConfig::default() })]

    #[test]
    fn losses_count_only_real_positions(lengths in lengths(6, 8), smoothing in prop_oneof![Just(0.0), Just(0.1)], seed in 0i64..1000) {
        let (logits, logit_elements) = batch(&lengths, &[5], Kind::Double, seed);
        let labels: Vec<Tensor> = lengths.iter().map(|&l| Tensor::randint(5, [l], (Kind::Int64, Device::Cpu))).collect();
        // Ignore class 0 to exercise ignore_index.
        let targets = NestedTensor::builder().ragged_dims(&[0]).tensors(&labels).unwrap();
        let all_logits = Tensor::cat(&logit_elements, 0);
        let all_labels = Tensor::cat(&labels, 0);
        let loss = logits.cross_entropy(&targets, 0, smoothing, LossReduction::Mean).unwrap().into_dense().unwrap();
        let expected = all_logits.cross_entropy_loss::<Tensor>(&all_labels, None, tch::Reduction::Mean, 0, smoothing);
        prop_assert!(close(&loss, &expected, Kind::Double) || (loss.isnan().int64_value(&[]) == 1 && expected.isnan().int64_value(&[]) == 1));
        let summed = logits.cross_entropy(&targets, -100, smoothing, LossReduction::Sum).unwrap().into_dense().unwrap();
        let expected = all_logits.cross_entropy_loss::<Tensor>(&all_labels, None, tch::Reduction::Sum, -100, smoothing);
        prop_assert!(close(&summed, &expected, Kind::Double));

        let (predictions, prediction_elements) = batch(&lengths, &[5], Kind::Double, seed + 1);
        let all_predictions = Tensor::cat(&prediction_elements, 0);
        let mse = logits.mse_loss(&predictions, LossReduction::Mean).unwrap().into_dense().unwrap();
        prop_assert!(close(&mse, &all_logits.mse_loss(&all_predictions, tch::Reduction::Mean), Kind::Double) || all_logits.numel() == 0);
        let l1 = logits.l1_loss(&predictions, LossReduction::Sum).unwrap().into_dense().unwrap();
        prop_assert!(close(&l1, &all_logits.l1_loss(&all_predictions, tch::Reduction::Sum), Kind::Double));
        let probabilities = predictions.sigmoid().unwrap();
        let bce = logits.binary_cross_entropy_with_logits(&probabilities, LossReduction::Sum).unwrap().into_dense().unwrap();
        let expected = all_logits.binary_cross_entropy_with_logits::<Tensor>(&all_predictions.sigmoid(), None, None, tch::Reduction::Sum);
        prop_assert!(close(&bce, &expected, Kind::Double));
    }
}

#[test]
fn per_sample_dense_targets_apply_to_every_position() -> Result<(), Box<dyn std::error::Error>> {
    let (logits, elements) = batch(&[3, 2], &[4], Kind::Double, 1);
    let per_sample = Tensor::from_slice(&[1i64, 3]);
    let loss = logits
        .cross_entropy(&per_sample, -100, 0.0, LossReduction::None)?
        .into_nested()?;
    let expected: Vec<Tensor> = elements
        .iter()
        .enumerate()
        .map(|(i, e)| {
            e.cross_entropy_loss::<Tensor>(
                &per_sample.get(i as i64).expand([e.size()[0]], false),
                None,
                tch::Reduction::None,
                -100,
                0.0,
            )
        })
        .collect();
    assert_elements(&loss, &expected, Kind::Double);
    Ok(())
}

#[test]
fn zero_copy_reconstruction() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, _) = batch(&[3, 1], &[2], Kind::Float, 1);
    let doubled = nested.values() * 2.0;
    let like = nested.packed_like(&doubled)?;
    assert_eq!(like.values().data_ptr(), doubled.data_ptr());
    assert!(matches!(
        nested.packed_like(&Tensor::zeros([4, 3], (Kind::Float, Device::Cpu))),
        Err(NestedError::ShapeMismatch { .. })
    ));
    let wide = Tensor::zeros([4, 5, 6], (Kind::Float, Device::Cpu));
    let tailed = nested.packed_with_static_tail(&wide)?;
    assert_eq!(tailed.shape(), [2, 3, 5, 6]);
    assert_eq!(tailed.values().data_ptr(), wide.data_ptr());
    let scores = Tensor::arange(13, (Kind::Float, Device::Cpu));
    let square = NestedTensor::packed_with_square_lengths(&scores, &[2, 3])?;
    assert_eq!(square.get(1)?.size(), [3, 3]);
    assert_eq!(square.values().data_ptr(), scores.data_ptr());
    let rectangular =
        NestedTensor::packed_with_rectangular_lengths(&scores.narrow(0, 0, 11), &[2, 3], &[1, 3])?;
    assert_eq!(rectangular.get(0)?.size(), [2, 1]);
    assert!(matches!(
        NestedTensor::packed_with_square_lengths(&scores, &[2, 2]),
        Err(NestedError::LengthsSum { sum: 8, rows: 13 })
    ));
    Ok(())
}

#[test]
fn repeats_over_the_batch_dim() -> Result<(), Box<dyn std::error::Error>> {
    let nested = NestedTensor::from_lists(vec![vec![1i64], vec![2, 2]])?;
    assert_eq!(
        Vec::<i64>::try_from(nested.repeat_batch(2)?.values())?,
        [1, 2, 2, 1, 2, 2]
    );
    assert_eq!(
        Vec::<i64>::try_from(nested.repeat_interleave(2)?.values())?,
        [1, 1, 2, 2, 2, 2]
    );
    Ok(())
}

#[test]
fn segmented_scans_and_cdist() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[4, 0, 2], &[3], Kind::Double, 4);
    assert_elements(
        &nested.cumsum(1)?,
        &elements
            .iter()
            .map(|e| e.cumsum(0, None::<Kind>))
            .collect::<Vec<_>>(),
        Kind::Double,
    );
    assert_elements(
        &nested.cumprod(1)?,
        &elements
            .iter()
            .map(|e| e.cumprod(0, None::<Kind>))
            .collect::<Vec<_>>(),
        Kind::Double,
    );
    assert_elements(
        &nested.cumsum(2)?,
        &elements
            .iter()
            .map(|e| e.cumsum(1, None::<Kind>))
            .collect::<Vec<_>>(),
        Kind::Double,
    );
    let (other, other_elements) = batch(&[2, 3, 1], &[3], Kind::Double, 5);
    let distances = nested.cdist(&other, 2.0)?;
    assert_elements(
        &distances,
        &elements
            .iter()
            .zip(&other_elements)
            .map(|(a, b)| Tensor::cdist(a, b, 2.0, None::<i64>))
            .collect::<Vec<_>>(),
        Kind::Double,
    );
    Ok(())
}

#[test]
fn reshapes_of_static_dims() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[3, 1], &[2, 4], Kind::Float, 6);
    assert_elements(
        &nested.transpose(2, 3)?,
        &elements
            .iter()
            .map(|e| e.transpose(1, 2))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    assert_elements(
        &nested.flatten(2, 3)?,
        &elements.iter().map(|e| e.flatten(1, 2)).collect::<Vec<_>>(),
        Kind::Float,
    );
    let unsqueezed = nested.unsqueeze(2)?;
    assert_elements(
        &unsqueezed,
        &elements.iter().map(|e| e.unsqueeze(1)).collect::<Vec<_>>(),
        Kind::Float,
    );
    assert_elements(&unsqueezed.squeeze_dim(2)?, &elements, Kind::Float);
    assert_elements(
        &nested.unsqueeze(-1)?,
        &elements.iter().map(|e| e.unsqueeze(-1)).collect::<Vec<_>>(),
        Kind::Float,
    );
    assert_elements(
        &nested.reshape_tail(&[8])?,
        &elements
            .iter()
            .map(|e| e.reshape([-1, 8]))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    // The ragged dim moves without moving a value: [L_i, 2, 4] -> [2, L_i, 4].
    let moved = nested.transpose(1, 2)?;
    assert!(moved.values().equal(nested.values()));
    assert_elements(
        &moved,
        &elements
            .iter()
            .map(|e| e.transpose(0, 1))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    assert!(
        matches!(nested.squeeze_dim(2), Err(NestedError::Unsupported { .. })),
        "size 2 cannot be squeezed"
    );
    Ok(())
}

#[test]
fn the_guard_turns_slow_paths_into_errors() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, _) = batch(&[3, 1], &[2], Kind::Float, 7);
    let square = |side: i64| Tensor::randn([side, side], (Kind::Float, Device::Cpu));
    let squares =
        NestedTensor::builder()
            .ragged_dims(&[0, 1])
            .tensors(&[square(2), square(3), square(4)])?;
    let same_squares = NestedTensor::builder()
        .ragged_dims(&[0, 1])
        .tensors(&[square(3), square(3)])?;
    let padded = nested.tensor()?;
    nested_execution_guard(|| {
        assert!(matches!(
            nested.tensor(),
            Err(NestedError::SlowPathForbidden {
                path: SlowPath::PaddedMaterialization,
                ..
            })
        ));
        assert!(matches!(
            nested.mask(),
            Err(NestedError::SlowPathForbidden { .. })
        ));
        assert!(matches!(
            nested.add(&padded),
            Err(NestedError::SlowPathForbidden {
                path: SlowPath::DenseRepacking,
                ..
            })
        ));
        assert!(matches!(
            nested.cumsum(1),
            Err(NestedError::SlowPathForbidden {
                path: SlowPath::PerElement,
                ..
            })
        ));
        assert!(
            nested.cumsum(2).is_ok(),
            "a scan over a static dim is packed"
        );
        assert!(
            nested.slice(1, 1..).is_ok(),
            "slicing a ragged dim is a packed gather"
        );
        assert!(nested.sum(&[1], false).is_ok());
        // Linear algebra on square elements of several shapes: a call per shape.
        assert!(matches!(
            squares.det(),
            Err(NestedError::SlowPathForbidden {
                path: SlowPath::PerElement,
                ..
            })
        ));
        assert!(matches!(
            squares.svd(),
            Err(NestedError::SlowPathForbidden {
                path: SlowPath::PerElement,
                ..
            })
        ));
        assert!(same_squares.det().is_ok(), "one shape: one batched call");
    });
    assert!(nested.tensor().is_ok(), "the guard ends with its scope");
    assert!(squares.det().is_ok());
    Ok(())
}

#[test]
fn permute_moves_static_dims_only() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[3, 1], &[2, 4, 5], Kind::Float, 8);
    let permuted = nested.permute(&[0, 1, 4, 2, 3])?;
    assert_elements(
        &permuted,
        &elements
            .iter()
            .map(|e| e.permute([0, 3, 1, 2]))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    assert!(matches!(
        nested.permute(&[1, 0, 2, 3, 4]),
        Err(NestedError::Unsupported { .. })
    ));
    Ok(())
}

#[test]
fn losses_and_binary_ops_between_structures_fail_alike_eager_and_compiled() {
    // Lengths [2, 1] against [1, 2]: element 0 of length 2 meets one of length 1 in a
    // dim ragged in both, which is another structure (not a broadcast), eagerly as in
    // compiled code, for losses and plain binary ops alike.
    let options = (Kind::Float, Device::Cpu);
    let of = |lengths: [i64; 2]| {
        let elements: Vec<Tensor> = lengths
            .iter()
            .map(|&length| Tensor::arange(length * 3, options).view([length, 3]))
            .collect();
        NestedTensor::from_tensors(&elements).unwrap()
    };
    let (x, target) = (of([2, 1]), of([1, 2]));
    let is_mismatch = |error: &NestedError| {
        matches!(error, NestedError::StructureMismatch { .. })
            && error.to_string().contains("element 0 is [2, 3] vs [1, 3]")
    };
    for reduction in [LossReduction::Mean, LossReduction::Sum] {
        let error = x.mse_loss(&target, reduction).unwrap_err();
        assert!(is_mismatch(&error), "mse_loss: {error}");
        let error = x.l1_loss(&target, reduction).unwrap_err();
        assert!(is_mismatch(&error), "l1_loss: {error}");
    }
    let error = (&x + &target).unwrap_err();
    assert!(is_mismatch(&error), "add: {error}");
    let model =
        |inputs: &[NestedTensor], _: &[nestor::Dense]| -> nestor::Result<Vec<common::Out>> {
            Ok(vec![inputs[0]
                .mse_loss(&inputs[1], LossReduction::Mean)?
                .into()])
        };
    let compiled = nestor::compile("mismatched_loss", &model);
    let error = compiled.call(&[&x, &target], &[]).unwrap_err();
    assert!(
        error.to_string().contains("element 0 is [2, 3] vs [1, 3]"),
        "compiled: {error}"
    );
    // The same structure still works, and a static dim of size 1 still broadcasts.
    assert!(x.mse_loss(&of([2, 1]), LossReduction::Mean).is_ok());
}

#[test]
fn scans_along_any_static_dim_compile() {
    // A cumulative sum or product along the last (static) dim compiles (a row scan),
    // along another static dim too (the dim moved last), and equals eager (it once
    // left the trace silently and the error named no operator).
    for (tail, dim) in [(vec![2i64], 2i64), (vec![2, 3], 2)] {
        let (x, _) = batch(&[3, 1], &tail, Kind::Float, 3);
        for op in ["cumsum", "cumprod"] {
            let model = move |inputs: &[NestedTensor],
                              _: &[nestor::Dense]|
                  -> nestor::Result<Vec<common::Out>> {
                let scanned = if op == "cumsum" {
                    inputs[0].cumsum(dim)?
                } else {
                    inputs[0].cumprod(dim)?
                };
                Ok(vec![scanned.into()])
            };
            let eager = model(std::slice::from_ref(&x), &[]).unwrap();
            let got = nestor::compile(op, &model).call(&[&x], &[]).unwrap();
            common::assert_close_within(&got, &common::eager_values(eager), 1e-6, op);
        }
    }
}
