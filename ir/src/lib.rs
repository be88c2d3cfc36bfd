//! nestor-ir: the vocabulary shared by every nestor crate.
//!
//! This crate depends on no heavy crate (no tch, no LLVM, no CUDA). Today it holds the
//! element types ([`DType`]) and their promotion rule; the ragged graph IR of
//! `DESIGN.md` section 4 will live here too.

mod dtype;

pub use dtype::DType;
