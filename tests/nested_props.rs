//! Property tests of the packed layout over random ragged batches: lengths 0..=17,
//! batch 1..=9, ranks 1..=3, ragged dims in any position, both presentations.

// proptest! bodies are test code, which clippy does not recognise as such.
#![allow(clippy::unwrap_used)]

mod common;

use nestor::{NestedOptions, NestedTensor};
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

/// A random batch: element shapes of one rank, with a random set of ragged dims.
#[derive(Debug, Clone)]
struct Batch {
    shapes: Vec<Vec<i64>>,
    options: NestedOptions,
}

fn batch_strategy() -> impl Strategy<Value = Batch> {
    (1usize..=3, 1usize..=9)
        .prop_flat_map(|(rank, batch)| {
            let ragged = proptest::collection::vec(any::<bool>(), rank);
            let static_sizes = proptest::collection::vec(0i64..=4, rank);
            let lengths =
                proptest::collection::vec(proptest::collection::vec(0i64..=17, rank), batch);
            (ragged, static_sizes, lengths, any::<bool>(), any::<bool>())
        })
        .prop_map(|(ragged, static_sizes, lengths, batch_first, mask_value)| {
            let shapes = lengths
                .into_iter()
                .map(|element| {
                    element
                        .iter()
                        .zip(&ragged)
                        .zip(&static_sizes)
                        .map(|((&length, &is_ragged), &size)| if is_ragged { length } else { size })
                        .collect()
                })
                .collect();
            let options = NestedOptions {
                batch_first,
                padding_value: -7.0,
                mask_value,
            };
            Batch { shapes, options }
        })
}

/// Distinct values per element, so a misplaced row cannot go unnoticed.
fn elements(shapes: &[Vec<i64>]) -> Vec<Tensor> {
    shapes
        .iter()
        .enumerate()
        .map(|(index, shape)| {
            let volume: i64 = shape.iter().product();
            (Tensor::arange(volume, (Kind::Double, Device::Cpu)) + 1000.0 * index as f64)
                .reshape(shape.as_slice())
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(96), ..ProptestConfig::default() })]

    #[test]
    fn unbind_gives_back_the_inputs(batch in batch_strategy()) {
        let inputs = elements(&batch.shapes);
        let nested = NestedTensor::builder().options(batch.options).tensors(&inputs).unwrap();
        let outputs = nested.unbind().unwrap();
        prop_assert_eq!(outputs.len(), inputs.len());
        for (output, input) in outputs.iter().zip(&inputs) {
            prop_assert_eq!(output.size(), input.size());
            prop_assert!(output.equal(input));
        }
    }

    #[test]
    fn offsets_are_the_running_sum_of_element_volumes(batch in batch_strategy()) {
        let nested = NestedTensor::from_tensors(&elements(&batch.shapes)).unwrap();
        let layout = nested.layout();
        let offsets = Vec::<i64>::try_from(&nested.packed_offsets()).unwrap();
        let mut running = vec![0i64];
        for shape in &batch.shapes {
            let rows: i64 = layout.ragged_dims().iter().map(|&dim| shape[dim]).product();
            running.push(running.last().unwrap() + rows);
        }
        prop_assert_eq!(&offsets, &running);
        // Every packed row holds one static tail: rows times tail volume is numel.
        let tail: i64 = layout.static_sizes().iter().product();
        prop_assert_eq!(offsets.last().unwrap() * tail, nested.numel());
        prop_assert_eq!(nested.values().numel() as i64, nested.numel());
    }

    #[test]
    fn tensor_and_mask_read_back_the_same_elements(batch in batch_strategy()) {
        let inputs = elements(&batch.shapes);
        let nested = NestedTensor::builder().options(batch.options).tensors(&inputs).unwrap();
        let (tensor, mask) = nested.tensor_mask().unwrap();
        prop_assert_eq!(tensor.size(), nested.shape());
        let back = NestedTensor::builder().options(batch.options).tensor_mask(&tensor, &mask).unwrap();
        prop_assert_eq!(back.len(), inputs.len());
        for (output, input) in back.unbind().unwrap().iter().zip(&inputs) {
            if input.numel() == 0 {
                // A mask cannot tell (0, 3) from (0, 0); element_sizes() can.
                prop_assert_eq!(output.numel(), 0);
            } else {
                prop_assert_eq!(output.size(), input.size());
                prop_assert!(output.equal(input));
            }
        }
        // Outside the mask, the padded tensor holds the padding value.
        let data = if batch.options.mask_value { mask.logical_not() } else { mask.shallow_clone() };
        let real = tensor.masked_select(&broadcast_mask(&data, &tensor));
        prop_assert_eq!(real.numel() as i64, nested.numel());
        let padding = (tensor.eq(-7.0)).sum(Kind::Int64).int64_value(&[]);
        prop_assert_eq!(padding, tensor.numel() as i64 - nested.numel());
    }
}

/// The mask of a padded tensor broadcast over its dropped channel dim, if any.
fn broadcast_mask(mask: &Tensor, tensor: &Tensor) -> Tensor {
    if mask.dim() < tensor.dim() {
        mask.unsqueeze(-1).expand_as(tensor)
    } else {
        mask.shallow_clone()
    }
}
