//! What can go wrong in distributed training.

use nestor_frontend::NestedError;

/// An error of a process group, a collective or data-parallel training.
#[derive(Debug, thiserror::Error)]
pub enum DistributedError {
    /// torchrun's environment (or a configuration) is missing a variable or has a bad one.
    #[error("distributed configuration: {variable} {problem}")]
    Config {
        /// The variable or setting.
        variable: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// The process group did not form: the store was unreachable, or a rank did not
    /// join within the timeout.
    #[error("rank {rank} of {world_size}: forming the process group at {address}: {message}")]
    Join {
        /// This process's rank.
        rank: usize,
        /// The number of ranks.
        world_size: usize,
        /// The store's `host:port`.
        address: String,
        /// c10d's message.
        message: String,
    },
    /// A collective failed: a rank died, left, or did not take part within the timeout.
    #[error("rank {rank}: {operation} failed: {message}")]
    Collective {
        /// This process's rank.
        rank: usize,
        /// The collective (`all_reduce`, `broadcast`).
        operation: &'static str,
        /// c10d's message.
        message: String,
    },
    /// The ranks disagree: another model, or another number of steps.
    #[error("rank {rank}: {message}")]
    Mismatch {
        /// This process's rank.
        rank: usize,
        /// What differs.
        message: String,
    },
    /// A tensor a collective cannot take, or another bad argument.
    #[error("{0}")]
    Invalid(String),
    /// An error of the compiled step or of the batches.
    #[error(transparent)]
    Nested(#[from] NestedError),
    /// An error of libtorch.
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

/// The result of distributed operations.
pub type Result<T, E = DistributedError> = std::result::Result<T, E>;
