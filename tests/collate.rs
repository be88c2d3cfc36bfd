//! Collation and batching: per-sample tensors become NestedTensor batches.

use std::collections::BTreeSet;

use nestor::{collate, Batcher, NestedError, PNTensor};
use tch::{Device, Kind, Tensor};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn samples(lengths: &[i64]) -> Vec<(PNTensor, i64)> {
    lengths
        .iter()
        .enumerate()
        .map(|(index, &length)| {
            (
                PNTensor(Tensor::full(
                    [length, 2],
                    index as f64,
                    (Kind::Float, Device::Cpu),
                )),
                index as i64,
            )
        })
        .collect()
}

#[test]
fn tuples_collate_field_by_field() -> TestResult {
    let (inputs, labels) = collate(samples(&[3, 1, 2]))?;
    assert_eq!(inputs.shape(), [3, 3, 2]);
    assert_eq!(inputs.values().size(), [6, 2]);
    assert_eq!(Vec::<i64>::try_from(&labels)?, [0, 1, 2]);
    let (a, b, c) = collate(vec![(
        PNTensor(Tensor::ones([2], (Kind::Float, Device::Cpu))),
        1.5f64,
        true,
    )])?;
    assert_eq!((a.len(), b.size(), c.kind()), (1, vec![1], Kind::Bool));
    Ok(())
}

#[test]
fn plain_tensors_of_different_shapes_do_not_stack() {
    let error = collate(vec![
        Tensor::ones([2], (Kind::Float, Device::Cpu)),
        Tensor::ones([3], (Kind::Float, Device::Cpu)),
    ])
    .err();
    assert!(
        matches!(
            error,
            Some(NestedError::ElementShapeMismatch { element: 1, .. })
        ),
        "{error:?}"
    );
}

#[test]
fn batches_cover_the_dataset_once() -> TestResult {
    let data = samples(&[5, 2, 7, 1, 3, 3, 8]);
    let batcher = Batcher::new(&data, 3).shuffle(11);
    let plan = batcher.plan(0);
    assert_eq!(plan.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 1]);
    let seen: BTreeSet<usize> = plan.iter().flatten().copied().collect();
    assert_eq!(seen.len(), data.len());
    let mut labels = Vec::new();
    for batch in batcher.epoch(0) {
        let (inputs, batch_labels) = batch?;
        assert_eq!(inputs.len() as i64, batch_labels.size()[0]);
        labels.extend(Vec::<i64>::try_from(&batch_labels)?);
    }
    let expected: Vec<i64> = plan.iter().flatten().map(|&index| index as i64).collect();
    assert_eq!(labels, expected);
    Ok(())
}

#[test]
fn shuffling_is_seeded_and_changes_per_epoch() {
    let data = samples(&[1; 32]);
    let batcher = Batcher::new(&data, 4).shuffle(3);
    assert_eq!(batcher.plan(0), Batcher::new(&data, 4).shuffle(3).plan(0));
    assert_ne!(batcher.plan(0), batcher.plan(1));
    let in_order = Batcher::new(&data, 4).plan(0);
    assert_eq!(in_order[0], [0, 1, 2, 3]);
    assert_ne!(batcher.plan(0), in_order);
}

#[test]
fn drop_last_drops_the_short_batch() {
    let data = samples(&[1; 10]);
    assert_eq!(Batcher::new(&data, 4).drop_last(true).plan(0).len(), 2);
    assert_eq!(Batcher::new(&data, 4).plan(0).len(), 3);
}

#[test]
fn bucketing_groups_similar_lengths() -> TestResult {
    let lengths: Vec<i64> = (0..64).map(|index| (index * 37 % 61) + 1).collect();
    let data = samples(&lengths);
    let occupancy = |batcher: &Batcher<'_, Vec<(PNTensor, i64)>>| -> Result<f64, NestedError> {
        let mut total = 0.0;
        let mut count = 0.0;
        for batch in batcher.epoch(0) {
            total += batch?.0.occupancy();
            count += 1.0;
        }
        Ok(total / count)
    };
    let plain = occupancy(&Batcher::new(&data, 8).shuffle(5))?;
    let bucketed_batcher = Batcher::new(&data, 8)
        .shuffle(5)
        .bucket_by_length(8, |index| lengths[index] as usize);
    let bucketed = occupancy(&bucketed_batcher)?;
    assert!(
        bucketed > plain,
        "bucketed occupancy {bucketed} should beat {plain}"
    );
    // With one pool holding the whole dataset, every batch is a run of sorted lengths.
    for batch in bucketed_batcher.plan(0) {
        let batch_lengths: Vec<i64> = batch.iter().map(|&index| lengths[index]).collect();
        assert!(
            batch_lengths.windows(2).all(|pair| pair[0] <= pair[1]),
            "{batch_lengths:?}"
        );
    }
    Ok(())
}
