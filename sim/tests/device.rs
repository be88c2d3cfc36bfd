//! Programs on a kernel device (`nestor_runtime::Executable::run_on_device`), with the
//! simulated GPU as the device: memory budgets, window steps, host steps, inputs and
//! results left on the device, buffer reuse (whole models run in `nestor-backend-cuda`'s
//! `tests/gpu_check_runner.rs`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

/// Held by the tests that set the process's memory budget.
static BUDGET: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn device_buffers_over_the_memory_budget_are_an_error() {
    use nestor_runtime::{InputData, MemoryBudget, RuntimeError, Stats};
    use nestor_sim::SimDevice;
    let graph = nestor_ir::parse(
        r#"graph @wide {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 4]
  %2 = exp(%1) : ragged<f32>[B; %0, 4]
  return %2
}"#,
    )
    .unwrap();
    let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph).unwrap()).unwrap();
    let device = SimDevice::new(&executable).unwrap();
    let (lengths, x) = ([100i64], vec![0.5f32; 400]);
    let inputs = [InputData::I64(&lengths), InputData::F32(&x)];
    // The budget is the process's: the tests that set one take turns (the others' buffers
    // are far under it).
    let _turn = BUDGET
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    MemoryBudget::set(Some(1000));
    let stats = Stats::default();
    let result = executable.run_on_device(&device, &inputs, &stats);
    MemoryBudget::set(None);
    match result {
        Err(RuntimeError::OutOfMemory {
            bytes: 1600,
            budget: 1000,
            ..
        }) => {}
        other => panic!(
            "expected OutOfMemory, got {:?}",
            other.map(|outputs| outputs.len())
        ),
    }
    let refused = stats.snapshot();
    assert_eq!(refused.kernel_launches, 0, "a refused run launches nothing");
    // The staged values' buffer and the input's upload, not the output's.
    assert_eq!(refused.device.allocations, 2);
    assert_eq!(
        executable
            .run_on_device(&device, &inputs, &stats)
            .unwrap()
            .len(),
        1
    );
    // One step: exp of 400 values, 1600 bytes read and 1600 written, in a new buffer
    // (the refused run's buffers are reused).
    let counted = stats.snapshot();
    assert_eq!(
        (
            counted.kernel_launches,
            counted.bytes_moved,
            counted.bytes_allocated - refused.bytes_allocated,
            counted.device.allocations,
        ),
        (1, 3200, 1600, 3)
    );
}

#[test]
fn window_gradients_on_the_device_follow_the_cpu_on_ties_nan_and_infinities() {
    use nestor_runtime::{InputData, Stats};
    use nestor_sim::SimDevice;
    let graph = nestor_ir::parse(include_str!("../../tests/filetests/window_grads.nir")).unwrap();
    let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph).unwrap()).unwrap();
    let device = SimDevice::new(&executable).unwrap();
    // Not under another test's small memory budget.
    let _turn = BUDGET
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // Two images, 2 x 3 and 1 x 1, three channels in, four out. Channel 0 is all ties
    // (max pooling picks the first largest) but for a NaN (the last NaN wins), channel 1
    // of the 1 x 1 image is -inf (its only tap is picked all the same), channel 2 has
    // +inf.
    let (heights, widths) = ([2i64, 1], [3i64, 1]);
    let mut x = vec![0.5f32; 21];
    x[3 * 4] = f32::NAN;
    x[3 * 6 + 1] = f32::NEG_INFINITY;
    x[3 * 2 + 2] = f32::INFINITY;
    let w: Vec<f32> = (0..108).map(|i| (i as f32 * 0.37).sin()).collect();
    let g: Vec<f32> = (0..28).map(|i| (i as f32 * 0.11).cos()).collect();
    let means = [0.25f32, -1.0, 2.0, 0.0, 3.0, f32::NAN];
    let inputs = [
        InputData::I64(&heights),
        InputData::I64(&widths),
        InputData::F32(&x),
        InputData::F32(&w),
        InputData::F32(&g),
        InputData::F32(&means),
    ];
    let on_device = executable
        .run_on_device(&device, &inputs, &Stats::default())
        .unwrap();
    let on_cpu = executable.run(&inputs, &Stats::default(), None).unwrap();
    assert_eq!(on_device.len(), 6);
    if let Some(why) = first_difference(&on_device, &on_cpu, 1e-5) {
        panic!("{why}");
    }
}

/// Where `on_device` differs from `on_cpu` first: a value farther than `tolerance`
/// relative to `1 + |expected|`, NaN or an infinity where the CPU has none, or a shape.
fn first_difference(
    on_device: &[nestor_runtime::RunOutput],
    on_cpu: &[nestor_runtime::RunOutput],
    tolerance: f32,
) -> Option<String> {
    use nestor_runtime::RunData;
    if on_device.len() != on_cpu.len() {
        return Some(format!(
            "{} outputs, expected {}",
            on_device.len(),
            on_cpu.len()
        ));
    }
    for (output, (a, e)) in on_device.iter().zip(on_cpu).enumerate() {
        let (a, e) = match (&a.data, &e.data) {
            (RunData::F32(a), RunData::F32(e)) => (a, e),
            // Positions are equal or not.
            (RunData::I64(a), RunData::I64(e)) if a == e => continue,
            (RunData::I64(a), RunData::I64(e)) => {
                return Some(format!("output {output}: positions {a:?} vs {e:?}"))
            }
            _ => return Some(format!("output {output}: not f32 on both")),
        };
        if a.len() != e.len() {
            return Some(format!(
                "output {output}: {} values, expected {}",
                a.len(),
                e.len()
            ));
        }
        for (index, (&a, &e)) in a.iter().zip(e).enumerate() {
            let same = if a.is_finite() && e.is_finite() {
                (a - e).abs() <= tolerance * (1.0 + e.abs())
            } else {
                a.is_nan() && e.is_nan() || a == e
            };
            if !same {
                return Some(format!(
                    "output {output}, value {index}: device {a} vs CPU {e}"
                ));
            }
        }
    }
    None
}

#[test]
fn window_taps_over_the_memory_budget_are_an_error() {
    use nestor_runtime::{InputData, MemoryBudget, RuntimeError, Stats};
    use nestor_sim::SimDevice;
    let graph = nestor_ir::parse(include_str!("../../tests/filetests/conv_net.nir")).unwrap();
    let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph).unwrap()).unwrap();
    let device = SimDevice::new(&executable).unwrap();
    // One 64 x 64 image: its convolution's taps table (4096 pixels x 9 taps x 8 bytes,
    // 295 KB) is over a 200 KB budget, though every buffer is under it.
    let (sizes, x) = ([64i64], vec![0.5f32; 3 * 64 * 64]);
    let (w, b) = (vec![0.1f32; 108], vec![0.0f32; 4]);
    let inputs = [
        InputData::I64(&sizes),
        InputData::I64(&sizes),
        InputData::F32(&x),
        InputData::F32(&w),
        InputData::F32(&b),
    ];
    let _turn = BUDGET
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    MemoryBudget::set(Some(200_000));
    let result = executable.run_on_device(&device, &inputs, &Stats::default());
    MemoryBudget::set(None);
    match result {
        Err(RuntimeError::OutOfMemory {
            step: 0,
            what,
            bytes: 294_912,
            budget: 200_000,
        }) => assert_eq!(what, "window taps"),
        other => panic!(
            "expected OutOfMemory, got {:?}",
            other.map(|outputs| outputs.len())
        ),
    }
    assert!(executable
        .run_on_device(&device, &inputs, &Stats::default())
        .is_ok());
}

/// Values in [-1, 1] from a seed.
fn waves(count: usize, seed: f32) -> Vec<f32> {
    (0..count)
        .map(|index| (index as f32 * 0.61 + seed).sin())
        .collect()
}

proptest::proptest! {
    // 24 cases, or `PROPTEST_CASES` (`make fuzz`).
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|cases| cases.parse().ok()).unwrap_or(24),
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Windows over images of any heights and widths (0 and 1 included, not square, a
    /// batch of one) give on the host device what the CPU runtime gives: a conv net's
    /// forward and every window gradient.
    #[test]
    fn window_kernels_on_the_device_equal_the_cpu_for_any_image_sizes(
        sizes in proptest::collection::vec((0i64..7, 0i64..7), 1..5),
        seed in 0.0f32..6.0,
    ) {
        use nestor_sim::SimDevice;
    use nestor_runtime::{InputData, Stats};
        let _turn = BUDGET.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let heights: Vec<i64> = sizes.iter().map(|&(h, _)| h).collect();
        let widths: Vec<i64> = sizes.iter().map(|&(_, w)| w).collect();
        let pixels = sizes.iter().map(|&(h, w)| (h * w) as usize).sum::<usize>();
        let forward = (
            include_str!("../../tests/filetests/conv_net.nir"),
            vec![waves(pixels * 3, seed), waves(108, seed + 1.0), waves(4, seed + 2.0)],
        );
        let gradients = (
            include_str!("../../tests/filetests/window_grads.nir"),
            vec![
                waves(pixels * 3, seed),
                waves(108, seed + 1.0),
                waves(pixels * 4, seed + 2.0),
                waves(sizes.len() * 3, seed + 3.0),
            ],
        );
        for (text, floats) in [forward, gradients] {
            let graph = nestor_ir::parse(text).unwrap();
            let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph).unwrap()).unwrap();
            let device = SimDevice::new(&executable).unwrap();
            let mut inputs = vec![InputData::I64(&heights), InputData::I64(&widths)];
            inputs.extend(floats.iter().map(|values| InputData::F32(values)));
            let on_device = executable.run_on_device(&device, &inputs, &Stats::default()).unwrap();
            let on_cpu = executable.run(&inputs, &Stats::default(), None).unwrap();
            let difference = first_difference(&on_device, &on_cpu, 1e-4);
            proptest::prop_assert!(difference.is_none(), "{sizes:?}: {difference:?}");
        }
    }
}

#[test]
fn host_steps_on_a_device_are_a_typed_error() {
    use nestor_runtime::{InputData, RuntimeError, Stats};
    use nestor_sim::SimDevice;
    // A convolution of images of a fixed height (2, ragged widths) has no window step:
    // with the per-element fallback it is a host step, which libtorch runs on the CPU
    // only.
    let graph = nestor_ir::parse(
        r#"graph @fixed_height {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; 3, 2, %0]
  %2 = param {name = "w"} : f32[3, 3, 3, 3]
  %3 = per_element(%1, %2) : ragged<f32>[B; 3, 2, %0] graph @conv2d {
    %0 = input {name = "element"} : f32[3, 2, ?]
    %1 = input {name = "w"} : f32[3, 3, 3, 3]
    %2 = conv2d(%0, %1) {stride = [1, 1], padding = [1, 1], dilation = [1, 1], groups = 1} : f32[3, 2, ?]
    return %2
  }
  return %3
}"#,
    )
    .unwrap();
    let options = nestor_passes::LowerOptions {
        host_per_element: true,
        ..nestor_passes::LowerOptions::default()
    };
    let program = nestor_passes::lower_with(&graph, options).unwrap();
    let executable = nestor_backend_cpu::executable(program).unwrap();
    let device = SimDevice::new(&executable).unwrap();
    let (sizes, x, w) = ([2i64], vec![0.5f32; 12], vec![0.1f32; 81]);
    let inputs = [
        InputData::I64(&sizes),
        InputData::F32(&x),
        InputData::F32(&w),
    ];
    match executable.run_on_device(&device, &inputs, &Stats::default()) {
        Err(RuntimeError::Step { reason, .. }) => {
            assert!(reason.contains("host step"), "{reason}")
        }
        other => panic!(
            "expected a step error, got {:?}",
            other.map(|outputs| outputs.len())
        ),
    }
}

#[test]
fn inputs_and_results_stay_on_the_device() {
    use nestor_runtime::{InputData, KernelDevice, Stats};
    use nestor_sim::SimDevice;
    let graph = nestor_ir::parse(
        r#"graph @resident {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 2]
  %2 = exp(%1) : ragged<f32>[B; %0, 2]
  return %2, %1
}"#,
    )
    .unwrap();
    let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph).unwrap()).unwrap();
    let device = SimDevice::new(&executable).unwrap();
    let (lengths, x) = ([2i64, 0, 1], [0.5f32, -1.0, 0.0, 2.0, f32::NAN, -0.25]);
    let buffer = device.upload_f32(&x).unwrap();
    let address = device.address(&buffer);
    let inputs = [
        InputData::I64(&lengths),
        InputData::OnDevice { address, len: 6 },
    ];
    let stats = Stats::default();
    let results = executable
        .run_device_resident(&device, &inputs, &stats)
        .unwrap();
    // The returned input is the caller's own buffer; the result a buffer of the run.
    assert_eq!(results.outputs[1].address, address);
    assert_ne!(results.outputs[0].address, address);
    assert_eq!(results.outputs[0].len, 6);
    let outputs = results.download(&device, &stats).unwrap();
    let host = [InputData::I64(&lengths), InputData::F32(&x)];
    let expected = executable.run(&host, &stats, None).unwrap();
    assert_eq!(first_difference(&outputs, &expected, 1e-6), None);
    for (output, expected) in outputs.iter().zip(&expected) {
        assert_eq!(output.shape, expected.shape);
    }
    // A device buffer of the wrong size, or given to the CPU runtime, is a typed error.
    let short = [
        InputData::I64(&lengths),
        InputData::OnDevice { address, len: 4 },
    ];
    let error = executable
        .run_device_resident(&device, &short, &stats)
        .err()
        .unwrap();
    assert!(
        error.to_string().contains("has 4 values, expected 6"),
        "{error}"
    );
    let error = executable.run(&inputs, &stats, None).unwrap_err();
    assert!(error.to_string().contains("a device buffer"), "{error}");
}

#[test]
fn device_buffers_are_reused_within_a_run_and_across_runs() {
    use nestor_runtime::{InputData, Stats};
    use nestor_sim::SimDevice;
    let graph = nestor_ir::parse(
        r#"graph @chain {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 4]
  %2 = exp(%1) : ragged<f32>[B; %0, 4]
  %3 = neg(%2) : ragged<f32>[B; %0, 4]
  %4 = exp(%3) : ragged<f32>[B; %0, 4]
  return %4
}"#,
    )
    .unwrap();
    let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph).unwrap()).unwrap();
    assert_eq!(executable.program().steps.len(), 3);
    let device = SimDevice::new(&executable).unwrap();
    let (lengths, x) = ([60i64, 40], vec![0.25f32; 400]);
    let inputs = [InputData::I64(&lengths), InputData::F32(&x)];
    let stats = Stats::default();
    let first = executable.run_on_device(&device, &inputs, &stats).unwrap();
    // The input's upload, one staged buffer of lengths, offsets and tables, and three
    // outputs of 1600 bytes in two buffers: the last step writes into the first step's,
    // whose last reader ran before it.
    let after_first = stats.snapshot();
    assert_eq!(after_first.device.allocations, 4);
    assert_eq!(after_first.device.uploads, 2);
    assert_eq!(after_first.device.downloads, 1);
    let second = executable.run_on_device(&device, &inputs, &stats).unwrap();
    // The next run finds every buffer it needs among the spare ones.
    let after_second = stats.snapshot();
    assert_eq!(after_second.device.allocations, 4);
    assert_eq!(after_second.bytes_allocated, after_first.bytes_allocated);
    assert_eq!(after_second.device.uploads, 4);
    assert_eq!(
        after_second.device.bytes_uploaded,
        2 * after_first.device.bytes_uploaded
    );
    let on_cpu = executable.run(&inputs, &Stats::default(), None).unwrap();
    assert_eq!(first_difference(&first, &on_cpu, 1e-6), None);
    assert_eq!(first_difference(&second, &on_cpu, 1e-6), None);
}

/// The CPU's executable of the graph `text`.
fn executable_of(text: &str) -> nestor_runtime::Executable {
    let graph = nestor_ir::parse(text).unwrap();
    nestor_backend_cpu::executable(nestor_passes::lower(&graph).unwrap()).unwrap()
}

/// `executable` on `device` gives the CPU runtime's results on `inputs` (to 1e-5).
fn assert_device_matches_cpu(
    executable: &nestor_runtime::Executable,
    device: &nestor_sim::SimDevice,
    inputs: &[nestor_runtime::InputData<'_>],
) {
    assert_device_within(executable, device, inputs, (1e-5, ""));
}

/// `executable` on `device` gives the CPU runtime's results on `inputs` within
/// `tolerance` ([`first_difference`]); `what` names the case when it does not.
fn assert_device_within(
    executable: &nestor_runtime::Executable,
    device: &nestor_sim::SimDevice,
    inputs: &[nestor_runtime::InputData<'_>],
    (tolerance, what): (f32, &str),
) {
    use nestor_runtime::Stats;
    let on_device = executable
        .run_on_device(device, inputs, &Stats::default())
        .unwrap();
    let on_cpu = executable.run(inputs, &Stats::default(), None).unwrap();
    assert_eq!(
        first_difference(&on_device, &on_cpu, tolerance),
        None,
        "{what}"
    );
}

/// [`assert_device_within`] on a simulated GPU of `options`: that device's memory
/// traffic.
fn traffic_within(
    executable: &nestor_runtime::Executable,
    options: nestor_sim::SimOptions,
    inputs: &[nestor_runtime::InputData<'_>],
    (tolerance, what): (f32, &str),
) -> nestor_sim::Traffic {
    let device = nestor_sim::SimDevice::with(executable, options).unwrap();
    assert_device_within(executable, &device, inputs, (tolerance, what));
    device.traffic()
}

/// Simulated-GPU options with bf16 buffers and `geometry`.
fn bf16_on(geometry: nestor_sim::Geometry) -> nestor_sim::SimOptions {
    nestor_sim::SimOptions {
        storage: nestor_codegen::Storage::Bf16,
        geometry,
        ..nestor_sim::SimOptions::default()
    }
}

/// The memory traffic of one run of `text` on the simulated GPU in one warp (so that
/// the argument tables are loaded 32 times only; the lengths `[5, 3]`, float inputs of
/// `values` each), and the bytes of its first float input.
fn traffic_of(text: &str, values: &[usize]) -> (nestor_sim::Traffic, u64) {
    use nestor_runtime::InputData;
    use nestor_sim::{Geometry, SimDevice, SimOptions};
    let executable = executable_of(text);
    let one_warp = nestor_codegen::GpuGrid {
        blocks: 1,
        threads: 32,
    };
    let options = SimOptions {
        geometry: Geometry::Fixed(one_warp),
        ..SimOptions::default()
    };
    let device = SimDevice::with(&executable, options).unwrap();
    let lengths = [5i64, 3];
    let data: Vec<Vec<f32>> = values
        .iter()
        .map(|&count| (0..count).map(|i| (i % 7) as f32 * 0.25 - 0.5).collect())
        .collect();
    let inputs: Vec<InputData<'_>> = std::iter::once(InputData::I64(&lengths))
        .chain(data.iter().map(|values| InputData::F32(values)))
        .collect();
    assert_device_matches_cpu(&executable, &device, &inputs);
    (device.traffic(), 4 * values[0] as u64)
}

#[test]
fn rows_of_several_passes_read_their_input_once_on_the_gpu() {
    // A row a warp, 200 values: 7 a lane, kept in registers.
    let (traffic, bytes) = traffic_of(
        r#"graph @norm {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 200]
  %2 = input {name = "w"} : f32[200]
  %3 = input {name = "b"} : f32[200]
  %4 = layer_norm(%1, %2, %3) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 200]
  %5 = softmax(%1) {axis = -1} : ragged<f32>[B; %0, 200]
  return %4, %5
}"#,
        &[8 * 200, 200, 200],
    );
    eprintln!("layer norm and softmax of 8 rows of 200: {traffic:?}, x {bytes} bytes");
    // Layer norm reads x once and its weight and bias once a row; softmax reads x once;
    // each writes its output once. The rest is the argument tables (8 bytes an entry,
    // 32 threads: under 2 KiB a kernel). Before the rows were kept in registers, layer
    // norm read x three times and softmax read x twice and its output once more.
    let values = 2 * bytes + 2 * bytes;
    assert!(
        traffic.loaded >= values && traffic.loaded < values + bytes,
        "{traffic:?}"
    );
    assert_eq!(traffic.stored, 2 * bytes);
}

#[test]
fn wide_rows_run_in_registers_and_long_rows_a_block_each() {
    // 1000 values a row: a warp's, 32 a lane in registers; 3000: a block's, its warps'
    // values combined through shared memory. Every kind of row kernel (norms' gradients
    // included), against the CPU
    // (`traffic_of` compares them), on the CUDA device's grid.
    use nestor_runtime::InputData;
    use nestor_sim::SimDevice;
    for width in [1000, 3000] {
        let text = format!(
            r#"graph @wide {{
  %0 = input {{name = "x.lengths"}} : lengths[B]
  %1 = input {{name = "x"}} : ragged<f32>[B; %0, {width}]
  %2 = input {{name = "w"}} : f32[{width}]
  %3 = layer_norm(%1, %2, %2) {{dims = 1, eps = 1e-5}} : ragged<f32>[B; %0, {width}]
  %4 = rms_norm(%1, %2) {{dims = 1, eps = 1e-6}} : ragged<f32>[B; %0, {width}]
  %5 = softmax(%1) {{axis = -1}} : ragged<f32>[B; %0, {width}]
  %6 = log_softmax(%1) {{axis = -1}} : ragged<f32>[B; %0, {width}]
  %7 = sum(%1) {{dims = [-1], keepdim = false}} : ragged<f32>[B; %0]
  %8 = mean(%1) {{dims = [-1], keepdim = false}} : ragged<f32>[B; %0]
  %9 = amax(%1) {{dims = [-1], keepdim = false}} : ragged<f32>[B; %0]
  %10 = amin(%1) {{dims = [-1], keepdim = false}} : ragged<f32>[B; %0]
  %11 = norm_grad(%1, %5) {{eps = 1e-5, centered = true, part = input}} : ragged<f32>[B; %0, {width}]
  %12 = norm_grad(%1, %5) {{eps = 1e-6, centered = false, part = input}} : ragged<f32>[B; %0, {width}]
  %13 = norm_grad(%1, %5) {{eps = 1e-5, centered = true, part = weight}} : ragged<f32>[B; %0, {width}]
  %14 = norm_grad(%1, %5, %2) {{eps = 1e-5, centered = true, part = input}} : ragged<f32>[B; %0, {width}]
  return %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14
}}"#
        );
        let executable = executable_of(&text);
        let device = SimDevice::new(&executable).unwrap();
        let lengths = [3i64, 0, 1, 2];
        let rows = 6 * width;
        let x: Vec<f32> = (0..rows)
            .map(|i| ((i * 37) % 101) as f32 * 0.05 - 2.5)
            .collect();
        let w: Vec<f32> = (0..width).map(|i| 1.0 + (i % 5) as f32 * 0.1).collect();
        let inputs = [
            InputData::I64(&lengths),
            InputData::F32(&x),
            InputData::F32(&w),
        ];
        // To 1e-4: a row's values (up to 2.5 in magnitude) sum to about 1, and the
        // CPU's lanes and the device's warp tree round their partial sums apart by up to
        // 2e-5 of it (an AVX2 host's eight lanes).
        let what = format!("rows of {width}");
        assert_device_within(&executable, &device, &inputs, (1e-4, &what));
    }
}

#[test]
fn wide_segments_are_a_block_each() {
    // 300 columns: a block of 256 threads an element (44 of them take two columns), every
    // segmented kind against the CPU, on the CUDA device's grid; the extremes and their
    // positions on elements that are not empty.
    use nestor_runtime::InputData;
    use nestor_sim::SimDevice;
    let kinds = r#"
  %2 = softmax(%1) {axis = 1} : ragged<f32>[B; %0, 300]
  %3 = log_softmax(%1) {axis = 1} : ragged<f32>[B; %0, 300]
  %4 = sum(%1) {dims = [1], keepdim = false} : f32[B, 300]
  %5 = mean(%1) {dims = [1], keepdim = false} : f32[B, 300]
  return %2, %3, %4, %5"#;
    let extremes = r#"
  %2 = amax(%1) {dims = [1], keepdim = false} : f32[B, 300]
  %3 = amin(%1) {dims = [1], keepdim = false} : f32[B, 300]
  %4 = argmax(%1) {dims = [1], keepdim = false} : i64[B, 300]
  %5 = argmin(%1) {dims = [1], keepdim = true} : i64[B, 1, 300]
  return %2, %3, %4, %5"#;
    for (body, lengths) in [(kinds, [4i64, 1, 0, 7]), (extremes, [4, 1, 2, 5])] {
        let executable = executable_of(&format!(
            "graph @segments {{\n  %0 = input {{name = \"x.lengths\"}} : lengths[B]\n  \
             %1 = input {{name = \"x\"}} : ragged<f32>[B; %0, 300]{body}\n}}"
        ));
        let program = executable.program();
        let segments = program
            .steps
            .iter()
            .filter(|step| matches!(step, nestor_passes::Step::Segment(_)));
        let mut count = 0;
        for step in segments {
            assert_eq!(
                nestor_codegen::gpu_threads_per_task(
                    program,
                    step,
                    nestor_codegen::Storage::Compute
                ),
                256
            );
            count += 1;
        }
        assert_eq!(count, 4, "every output a segmented step");
        let device = SimDevice::new(&executable).unwrap();
        let x: Vec<f32> = (0..12 * 300)
            .map(|i| ((i * 53) % 97) as f32 * 0.04 - 2.0)
            .collect();
        let inputs = [InputData::I64(&lengths), InputData::F32(&x)];
        assert_device_matches_cpu(&executable, &device, &inputs);
    }
}

#[test]
fn long_segments_are_a_block_each_short_ones_a_warp() {
    // 40 columns (lanes take one or two): elements of 1, 3, 63 rows (a warp's) and 64,
    // 200 rows (a block's: the warps take every 8th row and combine through shared
    // memory; scans and positions stay a warp's, down the rows in order or up), every
    // segmented kind against
    // the CPU, on the CUDA device's grid (groups
    // of 8 elements), on 3 blocks of 2 warps (groups of 2, the grid-stride loop) and on
    // one warp (a long element alone). Values include a NaN and infinities in the long
    // elements, which every warp's part must carry to the result.
    use nestor_runtime::InputData;
    use nestor_sim::{Geometry, SimDevice, SimOptions};
    let executable = executable_of(
        r#"graph @segments {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 40]
  %2 = softmax(%1) {axis = 1} : ragged<f32>[B; %0, 40]
  %3 = log_softmax(%1) {axis = 1} : ragged<f32>[B; %0, 40]
  %4 = sum(%1) {dims = [1], keepdim = false} : f32[B, 40]
  %5 = mean(%1) {dims = [1], keepdim = false} : f32[B, 40]
  %6 = argmax(%1) {dims = [1], keepdim = false} : i64[B, 40]
  %7 = argmin(%1) {dims = [1], keepdim = false} : i64[B, 40]
  %8 = cumsum(%1) {axis = 1, reverse = false} : ragged<f32>[B; %0, 40]
  %9 = cumprod(%1) {axis = 1, reverse = false} : ragged<f32>[B; %0, 40]
  %10 = cumsum(%1) {axis = 1, reverse = true} : ragged<f32>[B; %0, 40]
  %11 = cumprod(%1) {axis = 1, reverse = true} : ragged<f32>[B; %0, 40]
  %12 = logsumexp(%1) {dims = [1], keepdim = false} : f32[B, 40]
  %13 = amax(%1) {dims = [1], keepdim = false} : f32[B, 40]
  %14 = amin(%1) {dims = [1], keepdim = false} : f32[B, 40]
  return %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14
}"#,
    );
    // No element is empty: the extremes and their positions have none.
    let lengths = [63i64, 200, 1, 3, 64, 5, 130, 2, 9];
    let rows = lengths.iter().sum::<i64>() as usize;
    let mut x: Vec<f32> = (0..rows * 40)
        .map(|i| ((i * 53) % 97) as f32 * 0.04 - 2.0)
        .collect();
    // Element 1 (rows 63..263): a NaN in column 3, +inf in column 5, -inf in column 6.
    x[(63 + 150) * 40 + 3] = f32::NAN;
    x[(63 + 7) * 40 + 5] = f32::INFINITY;
    x[(63 + 199) * 40 + 6] = f32::NEG_INFINITY;
    let inputs = [InputData::I64(&lengths), InputData::F32(&x)];
    let grid = |blocks, threads| Geometry::Fixed(nestor_codegen::GpuGrid { blocks, threads });
    for geometry in [Geometry::Gpu, grid(3, 64), grid(1, 32)] {
        let options = SimOptions {
            geometry,
            ..SimOptions::default()
        };
        let device = SimDevice::with(&executable, options).unwrap();
        assert_device_matches_cpu(&executable, &device, &inputs);
    }
}

#[test]
fn attention_stages_each_key_once_a_block() {
    // Query lengths 0, 1, odd, and longer than a tile of 64 keys (100: a tile and 36);
    // cross attention with other key lengths, and causal self-attention. On the CUDA
    // device's grid (8 warps a block) and on 3 blocks of 2 warps (the grid-stride loop
    // over groups of two rows), against the CPU.
    use nestor_runtime::InputData;
    use nestor_sim::{Geometry, SimOptions};
    let (heads, head_dim) = (2i64, 8i64);
    let queries = [100i64, 1, 0, 33, 9];
    let cross = [70i64, 5, 3, 0, 40];
    for (causal, keys) in [(false, cross), (true, queries)] {
        let text = attention_text(heads, (head_dim, head_dim), causal);
        let executable = executable_of(&text);
        let width = (heads * head_dim) as usize;
        let (query_rows, key_rows) = (queries.iter().sum::<i64>(), keys.iter().sum::<i64>());
        let q = waves(query_rows as usize * width, 0.3);
        let k = waves(key_rows as usize * width, 1.1);
        let v = waves(key_rows as usize * width, 2.7);
        let inputs = [
            InputData::I64(&queries),
            InputData::F32(&q),
            InputData::I64(&keys),
            InputData::F32(&k),
            InputData::F32(&v),
        ];
        // Every thread loads the argument table and its rows' offsets: the grid of
        // one warp a block has as many threads as the CUDA device's grid, so that the
        // two differ only in how often a key is loaded.
        let blocks = (query_rows * heads) as u32;
        let traffic = [
            Geometry::Gpu,
            Geometry::Fixed(nestor_codegen::GpuGrid {
                blocks: 3,
                threads: 64,
            }),
            Geometry::Fixed(nestor_codegen::GpuGrid {
                blocks,
                threads: 32,
            }),
        ]
        .map(|geometry| {
            let options = SimOptions {
                geometry,
                ..SimOptions::default()
            };
            traffic_within(&executable, options, &inputs, (1e-5, ""))
        });
        // A warp a (query row, head) loads each key's 16 columns of K and V once a
        // query row; a block of 8 warps stages them once for its 8 rows.
        let keys_read: i64 = queries
            .iter()
            .zip(&keys)
            .map(|(&rows, &keys)| rows * keys * heads * 2 * head_dim * 4)
            .sum();
        let (staged, alone) = (traffic[0].loaded, traffic[2].loaded);
        eprintln!("attention (causal {causal}): {staged} bytes loaded by blocks of 8 warps, {alone} by warps alone, {keys_read} of keys and values a row each");
        assert!(
            alone - staged > keys_read as u64 / 2,
            "{staged} bytes loaded by blocks, {alone} by warps alone"
        );
    }
}

/// A graph of varlen attention: `heads` heads of `head_dim` columns of queries and keys
/// and `value_dim` of values, queries of lengths `q.lengths`, keys and values of
/// `kv.lengths`.
fn attention_text(heads: i64, (head_dim, value_dim): (i64, i64), causal: bool) -> String {
    format!(
        r#"graph @attention {{
  %0 = input {{name = "q.lengths"}} : lengths[B]
  %1 = input {{name = "q"}} : ragged<f32>[B; %0, {heads}, {head_dim}]
  %2 = input {{name = "kv.lengths"}} : lengths[B]
  %3 = input {{name = "k"}} : ragged<f32>[B; %2, {heads}, {head_dim}]
  %4 = input {{name = "v"}} : ragged<f32>[B; %2, {heads}, {value_dim}]
  %5 = attention(%1, %3, %4) {{causal = {causal}}} : ragged<f32>[B; %0, {heads}, {value_dim}]
  return %5
}}"#
    )
}

/// `values` as bf16 buffers hold them.
fn bf16_rounded(values: Vec<f32>) -> Vec<f32> {
    values
        .into_iter()
        .map(nestor_runtime::round_to_bf16)
        .collect()
}

#[test]
fn attention_on_tensor_cores_equals_the_cpu() {
    // bf16 buffers: a warp per 16 query rows of a head, both products on the simulated
    // tensor cores (mma.m16n8k16). Query lengths 0, 1, odd, a tile and one (17) and
    // more than two tiles (40); heads of 24 columns and values of 12 (neither fills a
    // fragment); cross attention with other key lengths (0 included), causal
    // self-attention, and causal cross attention (fewer keys than queries, or more);
    // on the CUDA device's grid and on 3 blocks of 2 warps (a grid smaller than the
    // work), against the CPU's f32 on the same (bf16) values.
    use nestor_runtime::InputData;
    use nestor_sim::Geometry;
    let heads = 2i64;
    let queries = [17i64, 1, 0, 40, 9, 3];
    let cross = [20i64, 5, 3, 0, 33, 1];
    // Values of 72 columns: two groups of output fragments (64 and 8 columns), the keys
    // taken again for the second.
    let cases = [
        (false, cross, 24i64, 12i64),
        (true, queries, 24, 12),
        (true, cross, 16, 72),
    ];
    for (causal, keys, head_dim, value_dim) in cases {
        let executable = executable_of(&attention_text(heads, (head_dim, value_dim), causal));
        let (query_rows, key_rows) = (queries.iter().sum::<i64>(), keys.iter().sum::<i64>());
        let q = bf16_rounded(waves((query_rows * heads * head_dim) as usize, 0.3));
        let k = bf16_rounded(waves((key_rows * heads * head_dim) as usize, 1.1));
        let v = bf16_rounded(waves((key_rows * heads * value_dim) as usize, 2.7));
        let inputs = [
            InputData::I64(&queries),
            InputData::F32(&q),
            InputData::I64(&keys),
            InputData::F32(&k),
            InputData::F32(&v),
        ];
        let small = nestor_codegen::GpuGrid {
            blocks: 3,
            threads: 64,
        };
        for geometry in [Geometry::Gpu, Geometry::Fixed(small)] {
            let step = &executable.program().steps[0];
            assert_eq!(
                nestor_codegen::gpu_threads_per_task(
                    executable.program(),
                    step,
                    nestor_codegen::Storage::Bf16
                ),
                2,
                "a warp per 16 query rows"
            );
            // The probabilities are rounded to bf16 for the second product (and the
            // results as the buffers store them).
            let what = format!("causal {causal}, {geometry:?}");
            traffic_within(&executable, bf16_on(geometry), &inputs, (2e-2, &what));
        }
    }
}

#[test]
fn attention_on_tensor_cores_keeps_the_cpu_special_values() {
    // Causal self-attention over 5 and 18 rows: an infinite key column makes scores
    // +-inf or NaN (rows that see the key, and rows for which it is masked: NaN or +inf
    // there poisons the row), an infinite value makes its column NaN even where its
    // key is masked (weight 0), as libtorch's product does; -inf queries give rows
    // without a finite score.
    use nestor_runtime::InputData;
    use nestor_sim::{SimDevice, SimOptions};
    let (heads, head_dim, value_dim) = (1i64, 16i64, 8i64);
    let lengths = [5i64, 18];
    let executable = executable_of(&attention_text(heads, (head_dim, value_dim), true));
    let rows = lengths.iter().sum::<i64>() as usize;
    let mut q = bf16_rounded(waves(rows * head_dim as usize, 0.7));
    let mut k = bf16_rounded(waves(rows * head_dim as usize, 1.9));
    let mut v = bf16_rounded(waves(rows * value_dim as usize, 0.2));
    k[3 * head_dim as usize] = f32::INFINITY;
    v[4 * value_dim as usize + 2] = f32::INFINITY;
    k[(5 + 10) * head_dim as usize + 1] = f32::NAN;
    for column in 0..head_dim as usize {
        q[(5 + 2) * head_dim as usize + column] = f32::NEG_INFINITY;
    }
    let inputs = [
        InputData::I64(&lengths),
        InputData::F32(&q),
        InputData::I64(&lengths),
        InputData::F32(&k),
        InputData::F32(&v),
    ];
    let options = SimOptions {
        storage: nestor_codegen::Storage::Bf16,
        ..SimOptions::default()
    };
    let device = SimDevice::with(&executable, options).unwrap();
    let on_device = executable
        .run_on_device(&device, &inputs, &nestor_runtime::Stats::default())
        .unwrap();
    let on_cpu = executable
        .run(&inputs, &nestor_runtime::Stats::default(), None)
        .unwrap();
    let nan = |outputs: &[nestor_runtime::RunOutput]| match &outputs[0].data {
        nestor_runtime::RunData::F32(values) => values.iter().filter(|x| x.is_nan()).count(),
        _ => 0,
    };
    assert!(nan(&on_cpu) > 0 && nan(&on_cpu) < rows * value_dim as usize);
    assert_eq!(first_difference(&on_device, &on_cpu, 2e-2), None);
}

#[test]
fn attention_gradients_read_saved_statistics_once() {
    // Training causal attention (tests/filetests/attention_loss.nir): lowered for a GPU,
    // a statistics step computes each query row's largest score, sum of exponentials
    // and rowsum(P dP) once, and both gradients read them; without it the keys'
    // gradient computes them again for every key a query sees (cubic in the length).
    // Both equal the CPU; the saved statistics cut the memory the program loads.
    use nestor_passes::step::AttentionPart;
    use nestor_passes::{LowerOptions, Step};
    use nestor_runtime::InputData;
    use nestor_sim::SimDevice;
    let graph = nestor_ir::parse(include_str!("../../tests/filetests/attention_loss.nir")).unwrap();
    let joint = nestor_passes::differentiate_loss(&graph).unwrap().graph;
    let joint = nestor_passes::Pipeline::unoptimized().run(&joint).unwrap();
    let lengths = [64i64, 1, 0, 17];
    let rows = lengths.iter().sum::<i64>() as usize;
    let (x, qkv) = (waves(rows * 8, 0.4), waves(24 * 8, 1.3));
    let inputs = [
        InputData::I64(&lengths),
        InputData::F32(&x),
        InputData::F32(&qkv),
    ];
    let loaded = [false, true].map(|attention_statistics| {
        let options = LowerOptions {
            attention_statistics,
            ..LowerOptions::default()
        };
        let program = nestor_passes::lower_with(&joint, options).unwrap();
        let parts: Vec<AttentionPart> = program
            .steps
            .iter()
            .filter_map(|step| match step {
                Step::AttentionGrad(grad) => Some(grad.part),
                _ => None,
            })
            .collect();
        let statistics_steps = parts
            .iter()
            .filter(|part| **part == AttentionPart::Statistics)
            .count();
        assert_eq!(
            statistics_steps,
            usize::from(attention_statistics),
            "{parts:?}"
        );
        let executable = nestor_backend_cpu::executable(program).unwrap();
        let device = SimDevice::new(&executable).unwrap();
        assert_device_matches_cpu(&executable, &device, &inputs);
        device.traffic().loaded
    });
    eprintln!(
        "attention training, lengths {lengths:?}: {} bytes loaded recomputing the statistics, {} reading them",
        loaded[0], loaded[1]
    );
    assert!(loaded[1] * 3 < loaded[0], "{loaded:?}");
}

#[test]
fn attention_gradients_on_tensor_cores_equal_the_cpu() {
    // bf16 buffers: the statistics step, then the queries' gradient (a warp per 16 query
    // rows) and the keys' and values' (a warp per 16 key rows) on the simulated tensor
    // cores, against the CPU's gradients on the same (bf16) values. Query lengths 0, 1,
    // odd, 17 and 40; cross attention with other key lengths (0 included), causal
    // self-attention and causal cross attention; heads of 24 columns (not a fragment's
    // multiple); the CUDA device's grid and 3 blocks of 2 warps.
    use nestor_passes::step::AttentionPart;
    use nestor_passes::{LowerOptions, Step};
    use nestor_runtime::InputData;
    use nestor_sim::Geometry;
    let (heads, head_dim) = (2i64, 24i64);
    let queries = [17i64, 1, 0, 40, 9, 3];
    let cross = [20i64, 5, 3, 0, 33, 1];
    for (causal, keys) in [(false, cross), (true, queries), (true, cross)] {
        let text = format!(
            r#"graph @attention_grad {{
  %0 = input {{name = "q.lengths"}} : lengths[B]
  %1 = input {{name = "q"}} : ragged<f32>[B; %0, {heads}, {head_dim}]
  %2 = input {{name = "kv.lengths"}} : lengths[B]
  %3 = input {{name = "k"}} : ragged<f32>[B; %2, {heads}, {head_dim}]
  %4 = input {{name = "v"}} : ragged<f32>[B; %2, {heads}, {head_dim}]
  %5 = input {{name = "g"}} : ragged<f32>[B; %0, {heads}, {head_dim}]
  %6 = attention_grad(%1, %3, %4, %5) {{causal = {causal}, part = queries}} : ragged<f32>[B; %0, {heads}, {head_dim}]
  %7 = attention_grad(%1, %3, %4, %5) {{causal = {causal}, part = keys_values}} : ragged<f32>[B; %2, 2, {heads}, {head_dim}]
  return %6, %7
}}"#
        );
        let graph = nestor_ir::parse(&text).unwrap();
        let options = LowerOptions {
            attention_statistics: true,
            ..LowerOptions::default()
        };
        let program = nestor_passes::lower_with(&graph, options).unwrap();
        let parts: Vec<AttentionPart> = program
            .steps
            .iter()
            .filter_map(|step| match step {
                Step::AttentionGrad(grad) => Some(grad.part),
                _ => None,
            })
            .collect();
        assert_eq!(
            parts,
            [
                AttentionPart::Statistics,
                AttentionPart::Queries,
                AttentionPart::KeysValues
            ]
        );
        let threads: Vec<u32> = program
            .steps
            .iter()
            .map(|step| {
                nestor_codegen::gpu_threads_per_task(&program, step, nestor_codegen::Storage::Bf16)
            })
            .collect();
        assert_eq!(threads, [32, 2, 2], "the gradients a warp per 16 rows");
        let executable = nestor_backend_cpu::executable(program).unwrap();
        let (query_rows, key_rows) = (queries.iter().sum::<i64>(), keys.iter().sum::<i64>());
        let width = (heads * head_dim) as usize;
        let q = bf16_rounded(waves(query_rows as usize * width, 0.3));
        let k = bf16_rounded(waves(key_rows as usize * width, 1.1));
        let v = bf16_rounded(waves(key_rows as usize * width, 2.7));
        let g = bf16_rounded(waves(query_rows as usize * width, 0.9));
        let inputs = [
            InputData::I64(&queries),
            InputData::F32(&q),
            InputData::I64(&keys),
            InputData::F32(&k),
            InputData::F32(&v),
            InputData::F32(&g),
        ];
        let small = nestor_codegen::GpuGrid {
            blocks: 3,
            threads: 64,
        };
        for geometry in [Geometry::Gpu, Geometry::Fixed(small)] {
            // P and dS are rounded to bf16 for the products that follow (and the results
            // as the buffers store them).
            let what = format!("causal {causal}, keys {keys:?}, {geometry:?}");
            traffic_within(&executable, bf16_on(geometry), &inputs, (3e-2, &what));
        }
    }
}

#[test]
fn attention_on_tensor_cores_stages_keys_once_a_block() {
    // A block of 8 warps (8 tiles of 16 query rows) inside one element and head stages
    // its keys and values through shared memory, 128 keys at a time (the last stage of
    // 300 keys partial, 44 of them), and its warps read their fragments there; a block
    // whose tiles span elements (the tail of 300 and the element of 7) reads them from
    // memory warp by warp. Causal and not, against the CPU, and against blocks of one
    // warp, which load every key once per tile.
    use nestor_runtime::InputData;
    use nestor_sim::Geometry;
    let (heads, head_dim) = (2i64, 16i64);
    let lengths = [300i64, 7];
    let rows = lengths.iter().sum::<i64>();
    for causal in [false, true] {
        let executable = executable_of(&attention_text(heads, (head_dim, head_dim), causal));
        let width = (rows * heads * head_dim) as usize;
        let (q, k, v) = (
            bf16_rounded(waves(width, 0.3)),
            bf16_rounded(waves(width, 1.1)),
            bf16_rounded(waves(width, 2.7)),
        );
        let inputs = [
            InputData::I64(&lengths),
            InputData::F32(&q),
            InputData::I64(&lengths),
            InputData::F32(&k),
            InputData::F32(&v),
        ];
        let one_warp_blocks = nestor_codegen::GpuGrid {
            blocks: 40,
            threads: 32,
        };
        let loaded = [Geometry::Gpu, Geometry::Fixed(one_warp_blocks)].map(|geometry| {
            let what = format!("causal {causal}, {geometry:?}");
            traffic_within(&executable, bf16_on(geometry), &inputs, (2e-2, &what)).loaded
        });
        eprintln!(
            "tensor-core attention (causal {causal}): {} bytes loaded by blocks of 8 warps, {} by blocks of one",
            loaded[0], loaded[1]
        );
        assert!(loaded[0] * 2 < loaded[1], "{loaded:?}");
    }
}
