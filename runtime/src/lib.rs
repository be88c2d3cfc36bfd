//! nestor-runtime: what a ragged batch looks like in memory, and (later) the buffers,
//! executor and kernel launches that run compiled graphs.
//!
//! This crate never depends on tch: layouts are plain integers, computed once per
//! batch and shared by the eager `NestedTensor` and the compiled runtime.

mod layout;

pub use layout::{LayoutError, RaggedLayout};
