//! nestor-runtime: what a ragged batch looks like in memory, and the executor that runs
//! compiled programs.
//!
//! - [`RaggedLayout`]: element sizes, ragged dims, offsets (plain integers, shared by
//!   the eager `NestedTensor` and compiled programs);
//! - [`Executable`]: a lowered program with its JIT-compiled kernels; `run` sizes every
//!   buffer from the lengths inputs, reuses intermediate buffers, splits kernels across
//!   cores (the process's OpenMP team, libtorch's, else rayon's pool; [`pool`] says
//!   which) and calls GEMM in row chunks (the process's MKL, else the `gemm` crate;
//!   [`gemm_library`] says which, [`gemm_probe`] why);
//! - [`Parallelism`]: how runs split their work across threads;
//! - [`Stats`]: compiles, cache hits, kernel launches, bytes allocated.
//!
//! This crate never depends on tch.

mod attention;
mod blas;
mod executor;
mod layout;
mod memory;
mod microkernel;
mod parallel;
mod process;
mod scalar;
mod stats;
mod strided;
mod team;
#[cfg(test)]
mod testing;
mod window;

pub use blas::{gemm_library, gemm_probe, GemmProbe};
pub use executor::{
    convolve_images, from_bf16, round_to_bf16, to_bf16, BlasCall, BlasSizeError, DeviceOutput,
    DeviceResults, Executable, Gemms, HostBuffer, HostDevice, HostRunner, HostValue, InputData,
    KernelDevice, OutputSink, Product, RunData, RunDim, RunOutput, RunShape, RuntimeError,
};
pub use layout::{LayoutError, RaggedLayout};
pub use memory::MemoryBudget;
/// How device buffers hold floats (bf16: half the bytes; kernels compute in f32).
pub use nestor_backend_cpu::Storage;
pub use parallel::Parallelism;
pub use stats::{Stats, StatsSnapshot};
pub use team::pool;
pub use window::{
    check_window, window_images, window_taps, Outside, WindowError, WindowImage, WindowTaps,
};
