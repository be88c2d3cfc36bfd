//! Whole programs on a kernel device (`Executable::run_on_device`), with the host as the
//! device: `gpu-check --device host` runs an optimized encoder layer, a feed-forward
//! block and a gather / padding / segment graph for lengths with 0 and 1, batch size 1
//! and a larger batch, from device buffers and index buffers, and compares every result
//! with the CPU runtime's (the same binary runs them on a GPU in `scripts/gpu-check.sh`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_runtime::{Executable, HostDevice, InputData};

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
        12
    );
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_step_without_a_device_kernel_is_an_error_naming_it() {
    let graph = nestor_ir::parse(
        r#"graph @one_hot {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "labels"} : i64[B]
  %2 = one_hot(%1) {classes = 3, ignore = -100, dtype = f32} : f32[B, 3]
  return %2
}"#,
    )
    .unwrap();
    let executable = Executable::compile(nestor_passes::lower(&graph).unwrap()).unwrap();
    let device = HostDevice::new(&executable).unwrap();
    let (lengths, labels) = ([2i64, 1], [0i64, 2]);
    let error = executable
        .run_on_device(
            &device,
            &[InputData::I64(&lengths), InputData::I64(&labels)],
        )
        .err()
        .unwrap();
    assert!(
        error
            .to_string()
            .contains("step 0: one_hot classes=3 has no device kernel yet"),
        "{error}"
    );
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
