//! Whole programs on a kernel device, the simulated GPU (`nestor-sim`): `gpu-check
//! --device sim` runs an optimized encoder layer, a feed-forward block, a gather / padding /
//! segment graph, attention over jagged pairs, the training steps (loss and gradients)
//! of a pooled classifier, of causal attention and of the pair attention, a conv net's
//! forward (convolution, pooling, image means over images `L x L`), its training step,
//! the window gradients, a strided conv net's training step and the training step of a
//! loss over scans, logsumexp, cdist and repeated batches, for lengths with 0 and 1, batch size 1 and a larger batch,
//! with f32 buffers (and bf16 buffers for two of the batches), GEMM products in the BLAS
//! calls a GPU makes to cuBLAS (run by definition) and in GEMM kernels, from device
//! buffers and index buffers, and compares every result with the CPU runtime's (the
//! same binary runs them on a GPU in `scripts/gpu-check.sh`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

#[test]
fn programs_run_on_the_simulated_gpu_as_on_the_cpu_runtime() {
    let out = std::env::temp_dir().join(format!("nestor-gpu-programs-{}", std::process::id()));
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_gpu-check"))
        .args(["--device", "sim"])
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
        126
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
