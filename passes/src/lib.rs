//! nestor-passes: what happens to a traced graph before it runs.
//!
//! - [`Pass`] and [`Pipeline`]: an explicit list of named passes, the verifier after
//!   each one, and an optional dump of the IR after every stage;
//! - [`Dce`] and [`Cse`]: dead-code and common-subexpression elimination;
//! - [`Fuse`]: trees of elementwise ops into one `fused` op (one kernel), greedily;
//! - [`Optimize`]: the egg e-graph optimizer (named rule sets, a cost model, limits);
//! - [`lower`]: a graph to a [`Program`] of kernel steps (pointwise expressions, GEMM,
//!   row normalizations, segmented reductions and softmax, varlen attention, gather)
//!   whose sizes are computed from the lengths at run time.
//!
//! Depends on no heavy crate (no tch, LLVM or CUDA).

mod cse;
mod dce;
mod forward;
mod fuse;
mod lower;
mod merge;
pub mod optimize;
mod pipeline;
mod program;

pub use cse::Cse;
pub use dce::Dce;
pub use fuse::Fuse;
pub use lower::{lower, lower_with, LowerError, LowerOptions};
pub use optimize::{Limits, Optimize, Report};
pub use pipeline::{Noted, Pass, PassError, Pipeline};
pub use program::{
    Access, Expr, FloatType, Fusion, LengthsOp, OutDim, Output, Program, RowBase, RowKind, Rows,
    SegmentKind, Slot, SlotInfo, Source, Step,
};
