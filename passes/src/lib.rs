//! nestor-passes: what happens to a traced graph before it runs.
//!
//! - [`Pass`] and [`Pipeline`]: an explicit list of named passes, the verifier after
//!   each one, and an optional dump of the IR after every stage;
//! - [`Dce`] and [`Cse`]: dead-code and common-subexpression elimination;
//! - [`Decompose`]: composite ops (losses, training-mode dropout, batch normalization)
//!   into primitive ones; [`batch_statistics`]: the per-channel statistics traced batch
//!   norms record;
//! - [`Optimize`]: the egg e-graph optimizer: named rule sets (structure, algebra,
//!   packed paths, fusion into `fused`, `prologue` and `epilogue` kernels), a cost
//!   model, limits;
//! - [`differentiate`]: reverse-mode autodiff, a joint forward + backward graph;
//! - [`lower`]: a graph to a [`Program`] of kernel steps (pointwise expressions, GEMM,
//!   row normalizations, segmented reductions and softmax, varlen attention, gather)
//!   whose sizes are computed from the lengths at run time; the optimizer's `prologue`
//!   and `epilogue` ops become one row, segmented or GEMM kernel each.
//!
//! Depends on no heavy crate (no tch, LLVM or CUDA).

mod autodiff;
mod count;
mod cse;
mod dce;
mod decompose;
mod fold;
mod forward;
mod lower;
mod operands;
pub mod optimize;
mod pipeline;
mod program;
mod scale;
pub mod signature;
pub mod step;
mod sums;

pub use autodiff::{differentiate, differentiate_loss, AutodiffError, Gradients, LossGraphError};
pub(crate) use count::channel_shape;
pub use count::{batch_statistics, BatchStatistics};
pub use cse::Cse;
pub use dce::Dce;
pub use decompose::Decompose;
pub use lower::{lower, lower_with, LowerError, LowerOptions};
pub use operands::{
    Access, Digit, Digits, Expr, Fusion, Order, Pick, Repeats, RowBase, RowKind, RowMap, Rows,
    SegmentKind, Slot, WindowKind,
};
pub use optimize::{Limits, Optimize, Report};
pub use pipeline::{annotated, Noted, Pass, PassError, Pipeline};
pub use program::{
    FloatType, LengthsKind, LengthsOp, OutDim, Output, Products, Program, SlotInfo, Source,
};
pub use signature::{Arg, KernelKey, KernelSet, Param, Placement, Role, Signature};
pub use step::Step;
