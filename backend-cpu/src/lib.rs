//! nestor-backend-cpu: the CPU's numerics and the code that runs compiled programs on
//! the host.
//!
//! - [`executable`]: a lowered program's kernels JIT-compiled for the host (`jit.rs`,
//!   LLVM through `nestor-codegen`'s templates) and the CPU's steps (`steps/`): each
//!   step runs where its placement in [`KernelSet::Library`] says, a generated kernel
//!   split across the cores, a GEMM on the GEMM library with a kernel for its epilogue,
//!   or the CPU's own code (attention, windows, some data steps), on the
//!   runtime's [`nestor_runtime::Executable`];
//! - the GEMM libraries (the process's MKL, else the `gemm` crate; [`gemm_library`]
//!   says which, [`gemm_probe`] why) and an f32 micro-kernel for small tiles;
//! - varlen attention (`attention.rs`; its mixed-precision forward and gradient on Intel
//!   AMX tiles, `amx.rs`, where [`attention_on_amx`] says, as are all bf16 products
//!   there, [`bf16_path`]; with `vdpbf16ps`, `dot.rs`, on hosts with AVX512-BF16 and no
//!   tiles where a probe finds it fastest; f32 attention fused in AVX-512 or AVX2
//!   registers where [`attention_in_registers`] says), direct convolution and pooling over packed
//!   images (`conv.rs`, `window.rs`; [`convolve_images`] for the eager API);
//! - the thread team (the process's OpenMP team, libtorch's, else rayon's pool; [`pool`]
//!   says which) and how runs split their work ([`Parallelism`]);
//!
//! Without the default `jit` feature the crate links no LLVM and holds the numerics
//! only (what the eager `NestedTensor` uses).
#![cfg_attr(not(feature = "jit"), allow(dead_code))]

mod aligned;
mod amx;
mod attention;
mod bf16;
mod blas;
mod columns;
mod conv;
mod conv_tiles;
mod dot;
mod finish;
mod gemm;
#[cfg(feature = "jit")]
mod jit;
mod kept;
mod microkernel;
mod parallel;
mod prefetch;
mod process;
mod scalar;
mod spare;
#[cfg(feature = "jit")]
mod steps;
mod strided;
mod team;
#[cfg(test)]
mod testing;
mod vectors;
mod window;

pub use amx::usable as attention_on_amx;
pub use attention::in_registers as attention_in_registers;
pub use bf16::{bf16_path, Bf16Path};
pub use blas::{gemm_library, gemm_probe, GemmProbe, ProbeProduct};
#[cfg(feature = "jit")]
pub use jit::{compile, compile_for, compile_storing, compile_with, BackendError, CpuKernels};
#[cfg(feature = "jit")]
pub use nestor_codegen::Storage;
pub use nestor_passes::KernelSet;
pub use parallel::Parallelism;
pub use team::pool;
pub use window::convolve_images;

/// A compiled kernel: `args` holds the step's buffers, in the order of its step's
/// signature (`nestor_passes::signature`); `start..end` is the range of rows or
/// elements to run.
pub type KernelFn = unsafe extern "C" fn(args: *const *mut u8, start: i64, end: i64);

/// `program` ready to run on the CPU: its kernels JIT-compiled for the host, its steps
/// run by the CPU's code.
///
/// ```
/// use nestor_runtime::{InputData, RunData, Stats};
/// let graph = nestor_ir::parse("graph @g {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 2]
///   %2 = neg(%1) : ragged<f32>[B; %0, 2]
///   return %2
/// }")?;
/// let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph)?)?;
/// let outputs = executable.run(
///     &[InputData::I64(&[1, 1]), InputData::F32(&[0.5, 1.0, 2.0, -3.0])],
///     &Stats::default(),
///     None,
/// )?;
/// assert!(matches!(&outputs[0].data, RunData::F32(v) if v == &[-0.5, -1.0, -2.0, 3.0]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[cfg(feature = "jit")]
pub fn executable(
    program: nestor_passes::Program,
) -> Result<nestor_runtime::Executable, nestor_runtime::RuntimeError> {
    let steps = steps::CpuSteps::compile(&program)?;
    Ok(nestor_runtime::Executable::new(program, Box::new(steps)))
}
