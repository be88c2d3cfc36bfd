//! Opening a CUDA device: on a machine without the NVIDIA driver or without a GPU a typed
//! error, never a panic; with a GPU, a template kernel run on it equals the same kernel
//! JIT-compiled for the host.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_backend_cuda::{ptx, CudaError, Device};

#[test]
fn a_device_opens_or_says_why_not() {
    let device = match Device::open(0) {
        Ok(device) => device,
        Err(error @ (CudaError::NoDriver(_) | CudaError::NoDevice { .. })) => {
            let message = error.to_string();
            assert!(
                message.contains("libcuda.so.1") || message.contains("does not exist"),
                "{message}"
            );
            eprintln!("skipped: {message}");
            return;
        }
        Err(other) => panic!("an unexpected error: {other}"),
    };
    // A GPU: tanh of 1000 values, on the device and on the host.
    let graph = nestor_ir::parse(
        r#"graph @g {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 10]
  %2 = tanh(%1) : ragged<f32>[B; %0, 10]
  return %2
}"#,
    )
    .unwrap();
    let program = nestor_passes::lower(&graph).unwrap();
    let module = device.load(&ptx(&program, device.arch()).unwrap()).unwrap();
    let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) / 100.0).collect();
    let input = device.upload(&x).unwrap();
    let output = device.upload(&vec![f32::NAN; x.len()]).unwrap();
    let table = device
        .upload(&[device.address(&output), device.address(&input)])
        .unwrap();
    // SAFETY: both buffers hold the 100 rows of 10 values the kernel covers; they and the
    // table live until the download, which waits for the kernel.
    unsafe { device.launch(&module, 0, device.address(&table), (0, 100)) }.unwrap();
    let on_device = device.download(&output).unwrap();
    for (value, result) in x.iter().zip(&on_device) {
        assert!(
            (value.tanh() - result).abs() <= 2e-6,
            "tanh({value}) = {result}"
        );
    }
}

#[test]
fn a_missing_device_is_a_typed_error() {
    match Device::open(1 << 20) {
        Err(CudaError::NoDriver(_) | CudaError::NoDevice { .. }) => {}
        Err(other) => panic!("an unexpected error: {other}"),
        Ok(_) => panic!("device 2^20 opened"),
    }
}
