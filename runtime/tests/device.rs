//! Whole programs on a kernel device (`Executable::run_on_device`), with the host as the
//! device: the GPU's kernel set (GEMMs with their epilogues, attention, norms, padding,
//! segmented reductions, gathers) run from device buffers and index buffers must give
//! what the CPU runtime gives, for lengths with 0 and 1 and batch size 1.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_ir::{Dim, ElemDim, Op, Type};
use nestor_runtime::{Executable, HostDevice, InputData, RunData, RuntimeError, Stats};

/// The inputs of `graph` for these lengths (one lengths input): values from a seed.
fn inputs(graph: &nestor_ir::Graph, lengths: &[i64]) -> (Vec<Vec<f32>>, Vec<Vec<i64>>, Vec<bool>) {
    let total: i64 = lengths.iter().sum();
    let (mut floats, mut integers, mut order) = (Vec::new(), Vec::new(), Vec::new());
    let mut seed = 0.25f32;
    for node in &graph.nodes {
        if !matches!(node.op, Op::Input { .. } | Op::Param { .. }) {
            continue;
        }
        let statics = |dims: &mut dyn Iterator<Item = &Dim>| -> i64 {
            dims.map(|dim| match dim {
                Dim::Static(size) => *size,
                _ => lengths.len() as i64,
            })
            .product()
        };
        let (count, integer) = match &node.ty {
            Type::Lengths { .. } => {
                integers.push(lengths.to_vec());
                order.push(true);
                continue;
            }
            Type::Ragged { dtype, dims, .. } => {
                let tail = statics(&mut dims.iter().filter_map(|dim| match dim {
                    ElemDim::Fixed(dim) => Some(dim),
                    ElemDim::Ragged(_) => None,
                }));
                (total * tail, *dtype == nestor_ir::DType::I64)
            }
            Type::Dense { dtype, shape } => {
                (statics(&mut shape.iter()), *dtype == nestor_ir::DType::I64)
            }
        };
        if integer {
            // Ids of a table or classes: in 0..3, valid for both here.
            integers.push((0..count).map(|index| (index * 5) % 3).collect());
        } else {
            floats.push(
                (0..count)
                    .map(|index| {
                        seed += 0.37;
                        (index as f32 * 0.11 + seed).sin()
                    })
                    .collect(),
            );
        }
        order.push(integer);
    }
    (floats, integers, order)
}

/// The values of each result of a run.
type Results = Vec<Vec<f32>>;

/// The host device's and the CPU runtime's results of `text` for `lengths`.
fn both(text: &str, lengths: &[i64]) -> Result<(Results, Results), RuntimeError> {
    let graph = nestor_ir::parse(text).unwrap();
    // Decomposed (losses), as compile does.
    let graph = nestor_passes::Pipeline::unoptimized().run(&graph).unwrap();
    let program = nestor_passes::lower(&graph).unwrap();
    let executable = Executable::compile(program)?;
    let (floats, integers, order) = inputs(&graph, lengths);
    let (mut next_float, mut next_integer) = (0, 0);
    let data: Vec<InputData<'_>> = order
        .iter()
        .map(|&integer| {
            if integer {
                next_integer += 1;
                InputData::I64(&integers[next_integer - 1])
            } else {
                next_float += 1;
                InputData::F32(&floats[next_float - 1])
            }
        })
        .collect();
    let values = |outputs: Vec<nestor_runtime::RunOutput>| -> Results {
        outputs
            .into_iter()
            .map(|output| match output.data {
                RunData::F32(values) => values,
                other => panic!("f32 results, got {other:?}"),
            })
            .collect()
    };
    let expected = values(executable.run(&data, &Stats::default(), None)?);
    let device = HostDevice::new(&executable)?;
    let actual = values(executable.run_on_device(&device, &data)?);
    Ok((actual, expected))
}

fn assert_same(text: &str) {
    for lengths in [vec![4, 0, 1, 3], vec![1], vec![7, 2]] {
        let (actual, expected) = both(text, &lengths).unwrap();
        assert_eq!(actual.len(), expected.len());
        for (output, (a, e)) in actual.iter().zip(&expected).enumerate() {
            assert_eq!(a.len(), e.len(), "output {output}");
            for (index, (x, y)) in a.iter().zip(e).enumerate() {
                assert!(
                    (x.is_nan() && y.is_nan()) || (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                    "lengths {lengths:?}, output {output}, value {index}: device {x} vs CPU {y}"
                );
            }
        }
    }
}

fn filetest(name: &str) -> String {
    let root = std::env::var_os("CARGO_MANIFEST_DIR").unwrap();
    std::fs::read_to_string(
        std::path::Path::new(&root)
            .join("../tests/filetests")
            .join(name),
    )
    .unwrap()
}

#[test]
fn an_optimized_encoder_layer_runs_on_the_device_as_on_the_cpu() {
    // Three GEMMs with epilogues, attention, two layer norms, reshapes (aliases).
    assert_same(&filetest("encoder_layer.optimized.nir"));
}

#[test]
fn feed_forward_padding_pooling_and_embedding_run_on_the_device_as_on_the_cpu() {
    assert_same(&filetest("ffn.nir"));
    assert_same(
        r#"graph @mixed {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 8]
  %2 = input {name = "ids"} : ragged<i64>[B; %0]
  %3 = param {name = "table"} : f32[7, 8]
  %4 = embedding(%2, %3) {padding_idx = -1} : ragged<f32>[B; %0, 8]
  %5 = add(%1, %4) : ragged<f32>[B; %0, 8]
  %6 = pad(%5) {value = 0.0} : f32[B, max(%0), 8]
  %7 = tanh(%6) : f32[B, max(%0), 8]
  %8 = unpad(%7, %0) : ragged<f32>[B; %0, 8]
  %9 = softmax(%8) {axis = 1} : ragged<f32>[B; %0, 8]
  %10 = mean(%9) {dims = [1], keepdim = false} : f32[B, 8]
  %11 = log_softmax(%10) {axis = -1} : f32[B, 8]
  return %6, %9, %11
}"#,
    );
}

#[test]
fn steps_without_a_device_kernel_are_errors_naming_them() {
    // Cross entropy decomposes into one-hot rows, which have no device kernel yet.
    let error = both(&filetest("loss.nir"), &[3, 2]).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("has no device kernel yet"), "{message}");
}
