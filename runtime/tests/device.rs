//! Whole programs on a kernel device (`Executable::run_on_device`), with the host as the
//! device: `gpu-check --device host` runs an optimized encoder layer, a feed-forward
//! block, a gather / padding / segment graph, attention over jagged pairs and the training
//! steps (loss and gradients) of a pooled classifier, of causal attention and of the pair
//! attention, and a conv net's forward (convolution, pooling, image means over images
//! `L x L`) for lengths with 0 and 1, batch size 1 and a larger batch, from device buffers and index buffers, and compares every result
//! with the CPU runtime's (the same binary runs them on a GPU in `scripts/gpu-check.sh`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

#[test]
fn programs_run_on_the_host_device_as_on_the_cpu_runtime() {
    let out = std::env::temp_dir().join(format!("nestor-gpu-programs-{}", std::process::id()));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-check"))
        .args(["--device", "host"])
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("everything matched"), "{stdout}");
    let report = std::fs::read_to_string(out.join("gpu-check.txt")).unwrap();
    assert_eq!(
        report
            .lines()
            .filter(|line| line.starts_with("ok "))
            .count(),
        33
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn the_gpu_check_without_a_gpu_says_so() {
    let out = std::env::temp_dir().join(format!("nestor-gpu-check-{}", std::process::id()));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-check"))
        .args(["--device", "cuda"])
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    match output.status.code() {
        // A GPU: the programs ran on it.
        Some(0) => {}
        Some(2) => assert!(
            stderr.contains("CUDA is not available") || stderr.contains("does not exist"),
            "{stderr}"
        ),
        other => panic!("gpu-check exited with {other:?}: {stderr}"),
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn device_buffers_over_the_memory_budget_are_an_error() {
    use nestor_runtime::{Executable, HostDevice, InputData, MemoryBudget, RuntimeError, Stats};
    let graph = nestor_ir::parse(
        r#"graph @wide {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 4]
  %2 = exp(%1) : ragged<f32>[B; %0, 4]
  return %2
}"#,
    )
    .unwrap();
    let executable = Executable::compile(nestor_passes::lower(&graph).unwrap()).unwrap();
    let device = HostDevice::new(&executable).unwrap();
    let (lengths, x) = ([100i64], vec![0.5f32; 400]);
    let inputs = [InputData::I64(&lengths), InputData::F32(&x)];
    // This binary's other tests run in their own processes: the budget is this test's.
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
    assert_eq!(
        stats.snapshot().kernel_launches,
        0,
        "a refused run launches nothing"
    );
    assert_eq!(
        executable
            .run_on_device(&device, &inputs, &stats)
            .unwrap()
            .len(),
        1
    );
    // One step: exp of 400 values, 1600 bytes read and 1600 written, in a new buffer.
    let counted = stats.snapshot();
    assert_eq!(
        (
            counted.kernel_launches,
            counted.bytes_moved,
            counted.bytes_allocated
        ),
        (1, 3200, 1600)
    );
}

#[test]
fn window_gradients_without_a_device_kernel_are_a_typed_error() {
    use nestor_runtime::{Executable, HostDevice, InputData, RuntimeError, Stats};
    let graph = nestor_ir::parse(include_str!("../../tests/filetests/window_grads.nir")).unwrap();
    let executable = Executable::compile(nestor_passes::lower(&graph).unwrap()).unwrap();
    let device = HostDevice::new(&executable).unwrap();
    // Two images, 2 x 3 and 1 x 1, three channels in, four out.
    let (heights, widths) = ([2i64, 1], [3i64, 1]);
    let (x, w, g, means) = (
        vec![0.5f32; 21],
        vec![0.1f32; 108],
        vec![1.0f32; 28],
        vec![0.0f32; 6],
    );
    let inputs = [
        InputData::I64(&heights),
        InputData::I64(&widths),
        InputData::F32(&x),
        InputData::F32(&w),
        InputData::F32(&g),
        InputData::F32(&means),
    ];
    // The convolution itself has a kernel; its input's gradient (step 1) has none yet.
    match executable.run_on_device(&device, &inputs, &Stats::default()) {
        Err(RuntimeError::Step { step: 1, reason }) => {
            assert!(
                reason.contains("ConvInputGrad has no device kernel yet"),
                "{reason}"
            )
        }
        other => panic!(
            "expected a step error, got {:?}",
            other.map(|outputs| outputs.len())
        ),
    }
    // The CPU runtime runs every step of the same program.
    assert_eq!(
        executable
            .run(&inputs, &Stats::default(), None)
            .unwrap()
            .len(),
        6
    );
}
