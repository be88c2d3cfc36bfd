//! The [`CompileReason`] of each lower layer's error: which [`CompileCause`] it is,
//! with the error kept for a caller to downcast.

use nestor_ir::VerifyError;
use nestor_passes::{AutodiffError, LowerError, PassError};
use nestor_runtime::RuntimeError;

use crate::error::{CompileCause, CompileReason};

impl From<RuntimeError> for CompileReason {
    fn from(error: RuntimeError) -> Self {
        let cause = match &error {
            RuntimeError::Backend(_) => CompileCause::Backend,
            RuntimeError::Device(_) => CompileCause::Device,
            RuntimeError::BlasSize(_) => CompileCause::Unsupported,
            RuntimeError::Host(_) => CompileCause::HostStep,
            RuntimeError::Step { .. } => CompileCause::Internal,
            &RuntimeError::OutOfMemory {
                step,
                bytes,
                budget,
                ..
            } => CompileCause::MemoryBudget {
                step,
                bytes,
                budget,
            },
            &RuntimeError::BadInput { input, .. } => CompileCause::BadInput { input },
            &RuntimeError::LengthsDiffer { element, .. } => CompileCause::SizesDiffer { element },
            &RuntimeError::TooShort {
                op,
                element,
                needed,
                ..
            } => CompileCause::TooShort {
                op,
                element,
                needed,
            },
        };
        CompileReason::of(cause, error)
    }
}

impl From<LowerError> for CompileReason {
    fn from(error: LowerError) -> Self {
        CompileReason::of(CompileCause::Unsupported, error)
    }
}

impl From<PassError> for CompileReason {
    fn from(error: PassError) -> Self {
        let cause = match &error {
            PassError::Dump { .. } => CompileCause::Io,
            PassError::Verify { .. } | PassError::Unknown { .. } => CompileCause::Internal,
        };
        CompileReason::of(cause, error)
    }
}

impl From<AutodiffError> for CompileReason {
    fn from(error: AutodiffError) -> Self {
        let cause = match &error {
            AutodiffError::LossNotScalar { .. }
            | AutodiffError::NoParameter { .. }
            | AutodiffError::NotFloat { .. } => CompileCause::Model,
            AutodiffError::NoRule { .. } => CompileCause::Unsupported,
            AutodiffError::Rule { .. } => CompileCause::Internal,
        };
        CompileReason::of(cause, error)
    }
}

/// A pass that broke the graph: a bug of that pass.
impl From<VerifyError> for CompileReason {
    fn from(error: VerifyError) -> Self {
        CompileReason::of(CompileCause::Internal, error)
    }
}
