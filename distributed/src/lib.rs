//! Data-parallel compiled training on c10d, PyTorch's distributed engine (Gloo on CPUs),
//! started by `torchrun`, for ragged batches: ranks balanced by tokens rather than by
//! samples, and gradients normalized by the global token count.
//!
//! - [`ProcessGroup`]: a process group from torchrun's environment or a
//!   [`GroupConfig`], with asynchronous collectives ([`ProcessGroup::all_reduce`],
//!   [`ProcessGroup::broadcast`]).
//! - [`DataParallel`]: compiled training steps whose gradients are all-reduced in
//!   buckets while the backward runs, normalized by the global token count.
//! - [`TokenBatches`]: every rank's batches of an epoch, balanced by tokens, with equal
//!   step counts.

mod batches;
mod data_parallel;
mod error;
mod ffi;
mod group;

pub use batches::{Sharding, TokenBatches, POOL_SAMPLES};
pub use data_parallel::{DataParallel, StepStats, BUCKET_BYTES, FIRST_BUCKET_BYTES};
pub use error::{DistributedError, Result};
pub use group::{Backend, GroupConfig, Pending, ProcessGroup, ReduceOp, DEFAULT_TIMEOUT};
