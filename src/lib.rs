//! # nestor
//!
//! A graph compiler for ragged tensor batches. Real batches are ragged (sentences,
//! documents, molecules, images of different sizes); nestor keeps them packed (values
//! plus offsets) and never pays for padding.
//!
//! nestor provides the eager [`NestedTensor`] on libtorch (through `tch`), the
//! collation of per-sample tensors into batches, and [`compile`]: a model traced once
//! per input structure into a ragged IR ([`ir`]), optimized and JIT-compiled for the
//! host CPU ([`passes`]), reused for every set of lengths, and with
//! [`Compiled::train`] trained too (autodiff on the IR, gradients into the tch
//! parameters). See `ARCHITECTURE.md`.
//!
//! ```
//! use nestor::NestedTensor;
//!
//! let batch = NestedTensor::from_lists(vec![vec![1.0f32, 2.0, 3.0], vec![4.0, 5.0]])?;
//! assert_eq!(batch.shape(), [2, 3]);
//! assert_eq!(batch.occupancy(), 5.0 / 6.0);
//! let mask = Vec::<Vec<bool>>::try_from(&batch.mask()?)?;
//! assert_eq!(mask, [[true, true, true], [true, true, false]]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

/// Data-parallel compiled training on c10d, started by `torchrun`: process groups,
/// gradients all-reduced while the backward runs, token-balanced batches.
#[cfg(feature = "distributed")]
pub use nestor_distributed as distributed;
pub use nestor_frontend::{
    collate, dtype_of, einsum, kind_of, load_batches, nested_execution_guard, nn, save_batches,
    BatchSelector, Batcher, Binary, Bounds, Collate, Comparand, CompileCause, CompileReason,
    Dataset, ExecutionGuard, ListData, ListElement, LossReduction, NestedBuilder, NestedError,
    NestedOptions, NestedTensor, Operand, PNTensor, Reduce, Reduced, Result, SlowPath, Target,
};
#[cfg(feature = "compile")]
pub use nestor_frontend::{
    compile, Compiled, DeviceCounts, GradientHook, GradientOf, NamedGradients, RunDevice,
    SimOptions, StatsSnapshot,
};
pub use nestor_frontend::{interpret, trace, Dense, TraceOutputs, TraceRef, Traced, Value};
pub use nestor_ir::DType;

pub use nestor_backend_cpu::{
    attention_in_registers, attention_on_amx, bf16_path, gemm_library, gemm_probe, pool, Bf16Path,
    GemmProbe, Parallelism, ProbeProduct,
};
/// The ragged graph IR (types, ops, text form, verifier, Graphviz output).
pub use nestor_ir as ir;
pub use nestor_layout::{LayoutError, RaggedLayout};
/// Passes over graphs (DCE, CSE, fusion) and lowering to kernel programs.
pub use nestor_passes as passes;
#[cfg(feature = "compile")]
pub use nestor_runtime::{MemoryBudget, RunProfile, RuntimeError, StepKind, StepTiming};
