//! nestor-sim: a simulated CUDA device, so that nestor's GPU kernels run, and are
//! checked, on machines without a GPU.
//!
//! The kernels are the GPU's own templates (`nestor-codegen`) generated for
//! [`nestor_codegen::Target::Simulated`]: the structure of the NVPTX kernels (grid-stride
//! loops, a warp per task, butterfly shuffles), with each GPU instruction a call into
//! this crate ([`nestor_codegen::sim_abi`]), JIT-compiled for the host. A launch runs
//! its grid as PTX defines it:
//!
//! - every GPU thread is a fiber on its own small stack (`corosensei`); the fibers of a
//!   block run in a seeded random order and switch only at synchronization points
//!   (`block.rs`); the blocks of a grid are dealt out to the cores (`launch.rs`);
//! - `bar.sync` is a rendezvous of the whole block, `shfl.sync` one of the lanes of its
//!   member mask with PTX's exact source lanes, clamps and segments (`shuffle.rs`); a
//!   rendezvous that can never complete is a [`SimError::Deadlock`] naming the kernel,
//!   the block, the waiting threads and the missing lanes; a shuffle PTX leaves
//!   undefined is a [`SimError::Shuffle`];
//! - every load and store of a buffer is checked against the device's live buffers
//!   ([`SimError::OutOfBounds`] names the kernel, thread, block and address), buffers
//!   hold NaN when allocated and every step's output is NaN again before its launch;
//! - launches are checked against the architecture's [`Limits`], and are grids as the
//!   CUDA device makes them ([`nestor_codegen::gpu_grid`]) or any other ([`Geometry`]);
//! - GEMM products are the cuBLAS calls a GPU makes, validated and evaluated by
//!   definition (`blas.rs`).
//!
//! [`SimDevice`] is the runtime's [`nestor_runtime::KernelDevice`] on all of it: the
//! device executor runs whole programs on it exactly as on a GPU.

mod abi;
mod blas;
mod block;
mod device;
mod error;
mod launch;
mod memory;
mod shuffle;

pub mod mma;

pub use abi::{calls, symbols, Traffic, BARRIER, SHARED};
pub use device::{Geometry, SimDevice, SimOptions};
pub use error::{BadAccess, SimError};
pub use launch::{Launch, Limits};
pub use memory::{Adopted, SimBuffer};
pub use shuffle::{source_lane, WARP_LANES};

/// Runs `kernel` (named `name` in reports) over `range` as `launch` says on a GPU with `limits`, its argument
/// table at `table` and its accesses checked against `buffers` (start, bytes): how the
/// simulator's tests run kernels written against its ABI ([`calls`]).
///
/// # Safety
/// `kernel` must access memory only through [`calls::access`] (or within `buffers`),
/// and the table and buffers must be what it expects over the range.
pub unsafe fn run_kernel(
    (name, kernel): (&str, nestor_backend_cpu::KernelFn),
    (table, range): (u64, (i64, i64)),
    (launch, limits): (Launch, &Limits),
    buffers: &[(u64, u64)],
    seed: u64,
) -> Result<Traffic, SimError> {
    let extents = memory::Extents::of(buffers);
    let call = block::Call {
        kernel,
        table,
        range,
    };
    // The caller vouches for the kernel, the table and the buffers.
    unsafe { launch::run_grid(name, call, (launch, limits), extents, seed) }
}
