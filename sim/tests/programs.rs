//! Whole programs on the simulated GPU through the device executor, against the CPU
//! runtime on the same inputs: an encoder layer, a decoder block with cross lengths, a
//! mix of gathers, padding and segments, a conv net and a training step's loss and
//! gradients, over random lengths (0 and 1 included, batch size 1), with f32 and bf16
//! buffers, BLAS and kernel GEMMs, the CUDA device's grids and others; and the planted
//! bugs in generated kernels that it must catch.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_codegen::{GpuGrid, Storage};
use nestor_ir::{DType, Dim, ElemDim, Graph, Op, Type, ValueId};
use nestor_runtime::{
    round_to_bf16, Executable, Gemms, InputData, KernelDevice, RunData, RuntimeError, Stats,
};
use nestor_sim::{Geometry, SimDevice, SimError, SimOptions};
use proptest::prelude::*;

/// A decoder block: queries from `x`, keys and values from a memory `m` of other
/// lengths, cross attention, a residual and a layer norm.
const DECODER: &str = r#"graph @decoder {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 8]
  %2 = input {name = "m.lengths"} : lengths[B]
  %3 = input {name = "m"} : ragged<f32>[B; %2, 8]
  %4 = param {name = "wq"} : f32[8, 8]
  %5 = param {name = "wkv"} : f32[16, 8]
  %6 = param {name = "norm.weight"} : f32[8]
  %7 = param {name = "norm.bias"} : f32[8]
  %8 = linear(%1, %4) : ragged<f32>[B; %0, 8]
  %9 = reshape_tail(%8) {tail = [2, 4]} : ragged<f32>[B; %0, 2, 4]
  %10 = linear(%3, %5) : ragged<f32>[B; %2, 16]
  %11 = reshape_tail(%10) {tail = [2, 2, 4]} : ragged<f32>[B; %2, 2, 2, 4]
  %12 = select_static(%11) {dim = 1, index = 0} : ragged<f32>[B; %2, 2, 4]
  %13 = select_static(%11) {dim = 1, index = 1} : ragged<f32>[B; %2, 2, 4]
  %14 = attention(%9, %12, %13) {causal = false} : ragged<f32>[B; %0, 2, 4]
  %15 = reshape_tail(%14) {tail = [8]} : ragged<f32>[B; %0, 8]
  %16 = add(%15, %1) : ragged<f32>[B; %0, 8]
  %17 = layer_norm(%16, %6, %7) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 8]
  return %17
}"#;

/// Name, text, and whether its training step (loss and gradients) runs.
const PROGRAMS: [(&str, &str, bool); 12] = [
    (
        "encoder_layer",
        include_str!("../../tests/filetests/encoder_layer.optimized.nir"),
        false,
    ),
    ("decoder", DECODER, false),
    (
        "device_mix",
        include_str!("../../tests/filetests/device_mix.nir"),
        false,
    ),
    (
        "conv_net",
        include_str!("../../tests/filetests/conv_net.nir"),
        false,
    ),
    (
        "pooled_loss (training)",
        include_str!("../../tests/filetests/pooled_loss.nir"),
        true,
    ),
    (
        "pair_attention_loss (training)",
        include_str!("../../tests/filetests/pair_attention_loss.nir"),
        true,
    ),
    (
        "attention_loss (training)",
        include_str!("../../tests/filetests/attention_loss.nir"),
        true,
    ),
    (
        "conv_net_loss (training)",
        include_str!("../../tests/filetests/conv_net_loss.nir"),
        true,
    ),
    (
        "strided_conv_loss (training)",
        include_str!("../../tests/filetests/strided_conv_loss.nir"),
        true,
    ),
    (
        "order_loss (training)",
        include_str!("../../tests/filetests/order_loss.nir"),
        true,
    ),
    (
        "grouped_conv_loss (training)",
        include_str!("../../tests/filetests/grouped_conv_loss.nir"),
        true,
    ),
    (
        "positions_loss (training)",
        include_str!("../../tests/filetests/positions_loss.nir"),
        true,
    ),
];

#[test]
fn the_programs_run_every_kind_of_gpu_kernel() {
    let mut kinds: Vec<&str> = Vec::new();
    for (_, text, train) in PROGRAMS {
        let (executable, _) = executable(text, train);
        let program = executable.program();
        for set in [Gemms::Blas.kernel_set(), Gemms::Kernels.kernel_set()] {
            for step in &program.steps {
                if step.placement(program, set).kernel().is_some() {
                    kinds.push(step.name());
                }
            }
        }
    }
    kinds.sort_unstable();
    kinds.dedup();
    // Every kind of `nestor_passes::step`, but host steps (libtorch's, never a device's)
    // and dropout masks (their kernel case in `nestor-backend-cuda`'s gpu_check test
    // runs on the simulator: a run's masks differ from the CPU run's).
    let mut expected = vec![
        "Attention",
        "AttentionGrad",
        "Gather",
        "Gemm",
        "Insert",
        "LengthValues",
        "OneHot",
        "Pad",
        "PairGemm",
        "Pointwise",
        "Positions",
        "Row",
        "ScatterRows",
        "Segment",
        "SumRows",
        "Unpad",
        "Window",
    ];
    expected.sort_unstable();
    assert_eq!(kinds, expected);
}

/// The executable of a program's text (its training step's when `train`) and its graph.
fn executable(text: &str, train: bool) -> (Executable, Graph) {
    let graph = nestor_ir::parse(text).unwrap();
    let graph = if train {
        nestor_passes::differentiate_loss(&graph).unwrap().graph
    } else {
        graph
    };
    let graph = nestor_passes::Pipeline::unoptimized().run(&graph).unwrap();
    // A GPU's program: attention's gradients read saved statistics.
    let options = nestor_passes::LowerOptions {
        attention_statistics: true,
        ..nestor_passes::LowerOptions::default()
    };
    let program = nestor_passes::lower_with(&graph, options).unwrap();
    (nestor_backend_cpu::executable(program).unwrap(), graph)
}

/// Values of one input.
enum Values {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

/// Inputs of `graph`: its `n`-th lengths input holds `lengths[n % lengths.len()]`,
/// floats a wave from `seed` (rounded to bf16 when `bf16`), ids small enough for every
/// table and class count.
fn inputs(graph: &Graph, lengths: &[Vec<i64>], seed: f32, bf16: bool) -> Vec<Values> {
    let mut of_lengths: Vec<(ValueId, &Vec<i64>)> = Vec::new();
    for (index, node) in graph.nodes.iter().enumerate() {
        if matches!(node.op, Op::Input { .. }) && matches!(node.ty, Type::Lengths { .. }) {
            let next = &lengths[of_lengths.len() % lengths.len()];
            of_lengths.push((ValueId(index as u32), next));
        }
    }
    let batch = lengths[0].len();
    let size = |dim: &Dim| match dim {
        Dim::Static(size) => *size as usize,
        _ => batch,
    };
    let lengths_of = |id: &ValueId| {
        of_lengths
            .iter()
            .find(|(value, _)| value == id)
            .map(|(_, lengths)| *lengths)
            .unwrap()
    };
    let mut phase = seed;
    graph
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, node)| matches!(node.op, Op::Input { .. } | Op::Param { .. }))
        .map(|(index, node)| {
            let (count, dtype) = match &node.ty {
                Type::Lengths { .. } => {
                    return Values::I64(lengths_of(&ValueId(index as u32)).clone())
                }
                Type::Ragged { dtype, dims, .. } => {
                    let rows: usize = (0..batch)
                        .map(|element| {
                            dims.iter()
                                .map(|dim| match dim {
                                    ElemDim::Fixed(dim) => size(dim),
                                    ElemDim::Ragged(id) => lengths_of(id)[element] as usize,
                                })
                                .product::<usize>()
                        })
                        .sum();
                    (rows, *dtype)
                }
                Type::Dense { dtype, shape } => (shape.iter().map(size).product(), *dtype),
            };
            if dtype == DType::I64 {
                return Values::I64((0..count as i64).map(|index| (index * 5) % 3).collect());
            }
            phase += 0.37;
            Values::F32(
                (0..count)
                    .map(|index| {
                        let value = (index as f32 * 0.11 + phase).sin();
                        if bf16 {
                            round_to_bf16(value)
                        } else {
                            value
                        }
                    })
                    .collect(),
            )
        })
        .collect()
}

fn data(values: &[Values]) -> Vec<InputData<'_>> {
    values
        .iter()
        .map(|values| match values {
            Values::F32(values) => InputData::F32(values),
            Values::I64(values) => InputData::I64(values),
        })
        .collect()
}

/// Runs `program` on the simulated GPU as `options` say and on the CPU runtime: the
/// largest relative difference over every output (bf16 buffers: against the CPU's
/// results rounded as the device stores them), or the device's error.
fn difference(
    (executable, graph): &(Executable, Graph),
    lengths: &[Vec<i64>],
    options: SimOptions,
) -> Result<f64, RuntimeError> {
    let bf16 = options.storage == Storage::Bf16;
    let values = inputs(graph, lengths, 0.25, bf16);
    let inputs = data(&values);
    let expected = executable.run(&inputs, &Stats::default(), None)?;
    let device = SimDevice::with(executable, options)?;
    let actual = executable.run_on_device(&device, &inputs, &Stats::default())?;
    let mut worst = 0.0f64;
    for (actual, expected) in actual.iter().zip(&expected) {
        let (RunData::F32(actual), RunData::F32(expected)) = (&actual.data, &expected.data) else {
            panic!("f32 outputs")
        };
        assert_eq!(actual.len(), expected.len());
        let (mut largest, mut error_norm, mut norm) = (0.0f64, 0.0f64, 0.0f64);
        for (&a, &e) in actual.iter().zip(expected) {
            assert!(!a.is_nan() || e.is_nan(), "NaN where the CPU has {e}");
            let (a, e) = (f64::from(a), f64::from(e));
            largest = largest.max((a - e).abs() / (1.0 + e.abs()));
            error_norm += (a - e) * (a - e);
            norm += e * e;
        }
        // With bf16 buffers every step rounds its results to 8 bits: the error's norm
        // against the values' (or the square root of their count: values near 0
        // measured against 1); with f32 ones every value.
        let scale = norm.sqrt().max((actual.len() as f64).sqrt());
        let error = if bf16 {
            error_norm.sqrt() / scale.max(1.0)
        } else {
            largest
        };
        worst = worst.max(error);
    }
    Ok(worst)
}

/// What each storage needs: f32 to 1e-5 of every value (the check of the kernels'
/// logic; 5e-5 for a training program's, whose weight gradients sum hundreds of products
/// in another order than the CPU's: 1.4e-5 for strided_conv_loss on lengths [1, 3, 9, 11]),
/// bf16 buffers to 2e-2 of the outputs' norms (their rounding at every step's
/// store), 1e-1 for a training program's: its gradients go back through every rounded
/// value, and the conv net's batch norm over an image of 8 x 1 pixels divides bf16
/// differences of nearly equal values by a small deviation (8.7e-2 on heights [8, 5],
/// widths [1, 4]; 1.2e-2 on [8, 5] x [8, 5]).
fn tolerance(storage: Storage, train: bool) -> f64 {
    match storage {
        Storage::Compute if train => 5e-5,
        Storage::Compute => 1e-5,
        Storage::Bf16 if train => 1e-1,
        Storage::Bf16 => 2e-2,
    }
}

#[test]
fn every_program_runs_on_the_simulated_gpu_as_on_the_cpu() {
    let lengths = vec![vec![5, 0, 1, 9, 3]];
    let cross = vec![vec![5, 0, 1, 9, 3], vec![2, 4, 0, 7, 1]];
    for (name, text, train) in PROGRAMS {
        let program = executable(text, train);
        let lengths = if name == "decoder" { &cross } else { &lengths };
        for storage in [Storage::Compute, Storage::Bf16] {
            for gemms in [Gemms::Blas, Gemms::Kernels] {
                let options = SimOptions {
                    storage,
                    gemms,
                    ..SimOptions::default()
                };
                let worst = difference(&program, lengths, options).unwrap();
                eprintln!("{name} ({storage:?}, {gemms:?}): {worst:.2e}");
                assert!(
                    worst <= tolerance(storage, train),
                    "{name} ({storage:?}, {gemms:?}): {worst:e}"
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]

    /// Random lengths (0 and 1 among them, batch size 1 included), launch geometries
    /// (the CUDA device's, one block, a grid smaller than the work) and orders of
    /// threads: the same results as the CPU's.
    #[test]
    fn random_lengths_grids_and_orders_match_the_cpu(
        lengths in proptest::collection::vec(0i64..12, 1..5),
        memory in proptest::collection::vec(0i64..12, 4),
        program in 0usize..PROGRAMS.len(),
        geometry in 0usize..3,
        seed in any::<u64>(),
        bf16 in any::<bool>(),
    ) {
        let (name, text, train) = PROGRAMS[program];
        // Order ops over bf16 buffers: the rounding ties (or swaps) nearly equal values
        // that the f32 reference orders otherwise, and gradients routed by position go
        // elsewhere (an error of 0.2 on lengths [9, 4, 2, 11]); an f32-vs-bf16
        // comparison of a discontinuous function says nothing there. Their bf16 runs
        // are compared on the fixed lengths of the test above only.
        prop_assume!(!(bf16 && name.starts_with("order_loss")));
        let geometry = match geometry {
            0 => Geometry::Gpu,
            1 => Geometry::Fixed(GpuGrid { blocks: 1, threads: 256 }),
            _ => Geometry::Fixed(GpuGrid { blocks: 3, threads: 64 }),
        };
        let storage = if bf16 { Storage::Bf16 } else { Storage::Compute };
        let options = SimOptions { storage, gemms: Gemms::Blas, geometry, seed, ..SimOptions::default() };
        let memory: Vec<i64> = memory.into_iter().cycle().take(lengths.len()).collect();
        let worst = difference(&executable(text, train), &[lengths.clone(), memory], options).unwrap();
        prop_assert!(worst <= tolerance(storage, train), "{name} {lengths:?} {geometry:?}: {worst:e}");
    }
}

/// A softmax over rows of 40: a warp per row, butterfly sums across its lanes.
const SOFTMAX: &str = r#"graph @g {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 40]
  %2 = softmax(%1) {axis = -1} : ragged<f32>[B; %0, 40]
  return %2
}"#;

/// The device error inside a runtime error.
fn sim_error(error: &RuntimeError) -> &SimError {
    let RuntimeError::Device(inner) = error else {
        panic!("not a device error: {error}")
    };
    inner.downcast_ref::<SimError>().unwrap()
}

#[test]
fn a_block_size_the_kernels_do_not_expect_is_a_deadlock() {
    // Planted: blocks of 48 threads, where the kernels take whole warps.
    let program = executable(SOFTMAX, false);
    let options = SimOptions {
        geometry: Geometry::Fixed(GpuGrid {
            blocks: 2,
            threads: 48,
        }),
        ..SimOptions::default()
    };
    let error = difference(&program, &[vec![3, 2]], options).unwrap_err();
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        matches!(sim_error(&error), SimError::Deadlock { .. }),
        "{message}"
    );
    assert!(
        message.contains("kernel step0 (Row): deadlock in block")
            && message.contains(
                "(warp 1) wait at a shuffle over mask 0xffffffff: lanes 16-31 do not exist"
            )
            && message.contains("a block of 48 threads"),
        "{message}"
    );
}

#[test]
fn a_kernel_run_one_row_past_its_buffers_is_out_of_bounds() {
    // Planted: the softmax's kernel launched over one row more than its buffers hold.
    let (executable, _) = executable(SOFTMAX, false);
    let device = SimDevice::new(&executable).unwrap();
    let input = device.upload_f32(&[0.5; 80]).unwrap();
    let output = device.alloc_f32(80).unwrap();
    let table = [device.address(&output), device.address(&input)].map(|address| address as i64);
    let table = device.upload_i64(&table).unwrap();
    // The table and buffers are the device's; one row past them the kernel is caught.
    let error = unsafe { device.launch(0, device.address(&table), (0, 3)) }.unwrap_err();
    let message = error.to_string();
    eprintln!("{message}");
    let SimError::OutOfBounds { first, .. } = sim_error(&error) else {
        panic!("{message}")
    };
    assert!(!first.store, "the first bad access is a load: {message}");
    assert!(
        message.contains("kernel step0 (Row): out-of-bounds access: thread ")
            && message.contains("loads 4 bytes at")
            && message.contains(&format!(
                "past the start of the buffer at {:#x} of 320 bytes",
                device.address(&input)
            )),
        "{message}"
    );
    // Over its rows it runs.
    unsafe { device.launch(0, device.address(&table), (0, 2)) }.unwrap();
    let values = unsafe { device.download_f32(device.address(&output), 80) }.unwrap();
    // Seen once in CI (2026-12-04, not reproduced in 14 runs since): some values were
    // not 1/40 after the launch over the rows; the values say which.
    let wrong: Vec<(usize, f32)> = values
        .iter()
        .copied()
        .enumerate()
        .filter(|&(_, value)| (value - 1.0 / 40.0).abs() >= 1e-7)
        .collect();
    assert!(wrong.is_empty(), "values at (position, value): {wrong:?}");
}

#[test]
fn a_value_no_step_writes_reads_as_nan() {
    // Planted: the softmax's kernel over its first row only; the second stays NaN, as
    // every step's output is before its launch.
    let (executable, _) = executable(SOFTMAX, false);
    let device = SimDevice::new(&executable).unwrap();
    let input = device.upload_f32(&[0.5; 80]).unwrap();
    let output = device.upload_f32(&[1.0; 80]).unwrap();
    let table = [device.address(&output), device.address(&input)].map(|address| address as i64);
    let table = device.upload_i64(&table).unwrap();
    unsafe { device.launch(0, device.address(&table), (0, 1)) }.unwrap();
    let values = unsafe { device.download_f32(device.address(&output), 80) }.unwrap();
    assert!(values[..40].iter().all(|value| !value.is_nan()));
    assert!(values[40..].iter().all(|value| value.is_nan()));
}

#[test]
fn a_wrong_cublas_argument_fails_here() {
    use nestor_runtime::Product;
    let (executable, _) = executable(SOFTMAX, false);
    let options = SimOptions {
        gemms: Gemms::Blas,
        ..SimOptions::default()
    };
    let device = SimDevice::with(&executable, options).unwrap();
    // x [3, 4] W^T with W [5, 4]: out [3, 5].
    let (rows, k, n) = (3usize, 4usize, 5usize);
    let x: Vec<f32> = (0..rows * k).map(|i| i as f32 * 0.5 - 2.0).collect();
    let w: Vec<f32> = (0..n * k).map(|i| 1.0 - i as f32 * 0.25).collect();
    let expected: Vec<f32> = (0..rows * n)
        .map(|at| (0..k).map(|c| x[at / n * k + c] * w[at % n * k + c]).sum())
        .collect();
    let (a, b) = (
        device.upload_f32(&w).unwrap(),
        device.upload_f32(&x).unwrap(),
    );
    let c = device.alloc_f32(rows * n).unwrap();
    let buffers = [&a, &b, &c].map(|buffer| device.address(buffer));
    let call = Product::Linear {
        rows: rows as i64,
        k: k as i64,
        n: n as i64,
        transposed: false,
    }
    .blas_call()
    .unwrap();
    // The executor's call computes the product.
    unsafe { device.blas(0, &call, buffers) }.unwrap();
    let product = unsafe { device.download_f32(buffers[2], rows * n) }.unwrap();
    assert!(product
        .iter()
        .zip(&expected)
        .all(|(p, e)| (p - e).abs() < 1e-6));
    // A leading dimension below the rows of A is refused, as cuBLAS refuses it.
    let narrow = nestor_runtime::BlasCall { lda: 3, ..call };
    let error = unsafe { device.blas(0, &narrow, buffers) }
        .unwrap_err()
        .to_string();
    assert!(error.contains("lda 3 is below max(1, 4)"), "{error}");
    // One column too many reads past B's buffer (x has 3 rows, not 4).
    let wide = nestor_runtime::BlasCall { n: 4, ..call };
    let error = unsafe { device.blas(0, &wide, buffers) }
        .unwrap_err()
        .to_string();
    assert!(error.contains("B reaches 64 bytes"), "{error}");
    // A transpose dropped is another product.
    let untransposed = nestor_runtime::BlasCall {
        transpose_a: false,
        lda: 5,
        ..call
    };
    unsafe { device.blas(0, &untransposed, buffers) }.unwrap();
    let product = unsafe { device.download_f32(buffers[2], rows * n) }.unwrap();
    assert!(product
        .iter()
        .zip(&expected)
        .any(|(p, e)| (p - e).abs() > 1e-3));
}
