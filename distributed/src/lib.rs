//! Data-parallel compiled training on c10d, PyTorch's distributed engine (Gloo on CPUs),
//! started by `torchrun`, for ragged batches: ranks balanced by tokens rather than by
//! samples, and gradients normalized by the global token count.
//!
//! - [`ProcessGroup`]: a process group from torchrun's environment or a
//!   [`GroupConfig`], with asynchronous collectives ([`ProcessGroup::all_reduce`],
//!   [`ProcessGroup::broadcast`]).

mod error;
mod ffi;
mod group;

pub use error::{DistributedError, Result};
pub use group::{GroupConfig, Pending, ProcessGroup, ReduceOp, DEFAULT_TIMEOUT};
