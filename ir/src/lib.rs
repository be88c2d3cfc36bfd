//! nestor-ir: the vocabulary shared by every nestor crate, and the ragged graph IR.
//!
//! This crate depends on no heavy crate (no tch, no LLVM, no CUDA).
//!
//! - [`DType`]: element types and torch's promotion rule;
//! - [`Type`]: dense tensors, ragged batches whose lengths are graph values
//!   ([`ElemDim::Ragged`] names a `lengths` value), and lengths themselves;
//! - [`Op`]: the closed set of operations, with operands and attributes in one place;
//! - [`Graph`]: an arena of SSA values with type inference on insertion and a verifier;
//! - [`print()`]/[`parse`]: the text form (`.nir`), which parses back to the same graph;
//! - [`to_dot`]: Graphviz output.
//!
//! ```
//! use nestor_ir::{parse, print};
//! let text = "graph @ffn {
//!   %0 = input {name = \"L\"} : lengths[B]
//!   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
//!   %2 = param {name = \"w\"} : f32[8, 4]
//!   %3 = linear(%1, %2) : ragged<f32>[B; %0, 8]
//!   %4 = gelu(%3) : ragged<f32>[B; %0, 8]
//!   %5 = mean(%4) {dims = [1], keepdim = false} : f32[B, 8]
//!   return %5
//! }
//! ";
//! let graph = parse(text)?;
//! graph.verify()?;
//! assert_eq!(print(&graph), text);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod dot;
mod dtype;
mod fused;
mod graph;
mod infer;
mod op;
mod slice;
mod text;
mod types;

pub use dot::to_dot;
pub use dtype::DType;
pub use fused::FusedExpr;
pub use graph::{Graph, Node, ValueId, VerifyError};
pub use infer::{fused_type, window_output_size, with_inserted_dims, Window2d};
pub use op::{
    AttentionGradPart, Attr, BinaryOp, LossReduction, NormGradPart, Op, OpFamily, PoolKind,
    ReduceOp, UnaryOp, F64,
};
pub use slice::SliceBounds;
pub use text::{parse, print, ParseError};
pub use types::{Dim, ElemDim, Type};
