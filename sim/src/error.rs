//! What the simulated device reports: the GPU bugs it catches, and launches a GPU would
//! refuse.

use thiserror::Error;

/// An access of device memory outside every buffer the device holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadAccess {
    /// The GPU thread's index in its block.
    pub thread: u32,
    /// Its block's index in the grid.
    pub block: u32,
    /// The address accessed.
    pub address: u64,
    /// Bytes accessed.
    pub bytes: u64,
    /// A store (else a load).
    pub store: bool,
    /// The nearest buffer below the address, `(start, bytes)`, if any.
    pub near: Option<(u64, u64)>,
}

impl std::fmt::Display for BadAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = if self.store { "stores" } else { "loads" };
        write!(
            f,
            "thread {} of block {} {what} {} bytes at {:#x}",
            self.thread, self.block, self.bytes, self.address
        )?;
        match self.near {
            Some((start, bytes)) => write!(
                f,
                ", {} bytes past the start of the buffer at {start:#x} of {bytes} bytes",
                self.address - start
            ),
            None => write!(f, ", below every buffer of the device"),
        }
    }
}

/// What went wrong on the simulated device.
#[derive(Debug, Error)]
pub enum SimError {
    /// A launch a GPU refuses: its block size, grid or shared memory over the limits.
    #[error("kernel {kernel}: launch of {blocks} blocks x {threads} threads with {shared} bytes of shared memory: {why}")]
    Launch {
        /// The kernel.
        kernel: String,
        /// Blocks of the grid.
        blocks: u64,
        /// Threads per block.
        threads: u64,
        /// Shared memory per block.
        shared: u64,
        /// The limit it breaks.
        why: String,
    },
    /// A rendezvous that can never complete: threads waiting at a barrier or shuffle for
    /// threads that exited, wait elsewhere, or do not exist.
    #[error("kernel {kernel}: deadlock in block {block}: {waiting}")]
    Deadlock {
        /// The kernel.
        kernel: String,
        /// The block.
        block: u32,
        /// The waiting threads, what they wait at and for whom.
        waiting: String,
    },
    /// A shuffle PTX leaves undefined: a lane outside its own member mask, reading a lane
    /// outside the mask, lanes of one mask in different modes.
    #[error("kernel {kernel}: block {block}: {why}")]
    Shuffle {
        /// The kernel.
        kernel: String,
        /// The block.
        block: u32,
        /// Which lanes did what.
        why: String,
    },
    /// Loads or stores outside the device's buffers (the first, and how many in all).
    #[error("kernel {kernel}: out-of-bounds access: {first} ({count} in all)")]
    OutOfBounds {
        /// The kernel.
        kernel: String,
        /// The first bad access.
        first: BadAccess,
        /// Bad accesses of the launch.
        count: u64,
    },
    /// A BLAS call cuBLAS refuses (`CUBLAS_STATUS_INVALID_VALUE`) or whose matrices
    /// reach outside their buffers.
    #[error("step {step}: BLAS call {call}: {why}")]
    Blas {
        /// The step.
        step: usize,
        /// The call's arguments.
        call: String,
        /// What is wrong with them.
        why: String,
    },
    /// Memory adopted as a device buffer that overlaps one.
    #[error("the {bytes} bytes at {address:#x} overlap a device buffer")]
    Adopt {
        /// Its address.
        address: u64,
        /// Its bytes.
        bytes: u64,
    },
    /// A copy to or from the host outside the device's buffers.
    #[error("copy of {bytes} bytes at {address:#x} outside the device's buffers")]
    Copy {
        /// Its address.
        address: u64,
        /// Its bytes.
        bytes: u64,
    },
    /// The host has no memory left for a buffer or a GPU thread's stack.
    #[error("cannot allocate {0} bytes of host memory for the simulated device")]
    Memory(u64),
    /// A step without a kernel was launched.
    #[error("step {0} has no kernel")]
    NoKernel(usize),
}

impl From<SimError> for nestor_runtime::RuntimeError {
    fn from(error: SimError) -> Self {
        nestor_runtime::RuntimeError::Device(Box::new(error))
    }
}
