//! nestor-frontend: the eager [`NestedTensor`] on libtorch (through `tch`) and the
//! collation of per-sample tensors into batches.
//!
//! A `NestedTensor` keeps a ragged batch packed: `values` (a `tch::Tensor` of shape
//! `[N, *static_tail]`) plus the exact shape of every element. Nothing is padded until
//! [`NestedTensor::tensor`] asks for it.
//!
//! ```
//! use nestor_frontend::NestedTensor;
//! use tch::Tensor;
//!
//! let batch = NestedTensor::from_tensors(&[
//!     Tensor::from_slice(&[1i64, 2, 3]),
//!     Tensor::from_slice(&[4i64, 5]),
//! ])?;
//! assert_eq!(batch.shape(), [2, 3]);
//! assert_eq!(batch.numel(), 5);
//! let padded = Vec::<Vec<i64>>::try_from(&batch.tensor()?)?;
//! assert_eq!(padded, [[1, 2, 3], [4, 5, 0]]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
// Without `compile`, the tracer's helpers that only `compile` calls stay unused.
#![cfg_attr(not(feature = "compile"), allow(dead_code, unused_imports))]

mod collate;
#[cfg(feature = "compile")]
mod compile;
mod dense;
mod error;
mod guard;
mod kind;
mod nested;
pub mod nn;
mod ops;
mod trace;

pub use collate::{collate, Batcher, Collate, Dataset, PNTensor};
#[cfg(feature = "compile")]
pub use compile::{
    compile, Compiled, GradientHook, GradientOf, NamedGradients, RunDevice, SimOptions,
};
pub use error::{CompileCause, CompileReason, NestedError};
pub use guard::{nested_execution_guard, ExecutionGuard, SlowPath};
pub use kind::{dtype_of, kind_of};
pub use nested::{
    load_batches, save_batches, BatchSelector, Bounds, ListData, ListElement, NestedBuilder,
    NestedOptions, NestedTensor,
};
#[cfg(feature = "compile")]
pub use nestor_runtime::{DeviceCounts, RunProfile, StatsSnapshot, StepKind, StepTiming};
pub use ops::{einsum, Binary, Comparand, LossReduction, Operand, Reduce, Reduced, Target};
pub use trace::{interpret, trace, Dense, TraceOutputs, TraceRef, Traced, Value};

/// The result type of this crate.
pub type Result<T, E = NestedError> = std::result::Result<T, E>;
