//! The error type of the frontend.

use nestor_layout::LayoutError;
use tch::{Device, Kind, TchError};
use thiserror::Error;

/// What went wrong with the input of a `NestedTensor` operation.
#[derive(Debug, Error)]
pub enum NestedError {
    /// The element shapes do not form a ragged layout (ranks differ, negative sizes...).
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Elements of one batch must live on one device.
    #[error("element {element} is on {got:?}, expected {expected:?} (the device of element 0)")]
    DeviceMismatch {
        /// Index of the offending element.
        element: usize,
        /// Device of element 0.
        expected: Device,
        /// Device of the offending element.
        got: Device,
    },
    /// A scalar type nestor does not store (complex, quantized, 8-bit floats).
    #[error("element {element} has scalar type {kind:?}, which a NestedTensor cannot hold")]
    UnsupportedKind {
        /// Index of the offending element.
        element: usize,
        /// Its scalar type.
        kind: Kind,
    },
    /// A padding mask whose true region is not a box anchored at the origin.
    #[error(
        "mask of element {element} is not a prefix mask: the data positions must form a box \
         starting at index 0 in every dim"
    )]
    NonPrefixMask {
        /// Index of the offending element.
        element: usize,
    },
    /// A tensor argument has the wrong shape.
    #[error("{what} has shape {got:?}, expected {expected}")]
    ShapeMismatch {
        /// Which argument.
        what: &'static str,
        /// What was expected, in words or as a shape.
        expected: String,
        /// The shape that was given.
        got: Vec<i64>,
    },
    /// A boolean batch selector must have one entry per element.
    #[error("bool selector has {got} entries, expected {expected} (the batch size)")]
    SelectorLength {
        /// The batch size.
        expected: usize,
        /// The selector's length.
        got: usize,
    },
    /// An index past the end (or before the start) of the batch.
    #[error("index {index} is out of range for a batch of {batch_size} elements")]
    IndexOutOfRange {
        /// The index as given (negative counts from the end).
        index: i64,
        /// The batch size.
        batch_size: usize,
    },
    /// `nt.select(dim, k)` on an element that has no position `k` along `dim`.
    #[error(
        "element {element} has size {size} in dim {dim}, too short for index {index} \
         (needs at least {needed})"
    )]
    ElementTooShort {
        /// Index of the offending element.
        element: usize,
        /// The NestedTensor dim indexed.
        dim: i64,
        /// The index as given.
        index: i64,
        /// The element's size along that dim.
        size: i64,
        /// The size the index needs.
        needed: i64,
    },
    /// Packed values and lengths disagree.
    #[error("lengths sum to {sum} but the packed values have {rows} rows")]
    LengthsSum {
        /// The sum of the lengths.
        sum: i64,
        /// The rows of the packed values.
        rows: i64,
    },
    /// An operation that cannot act on the batch dim was asked to.
    #[error("{op} cannot act on the batch dim (dim {dim})")]
    BatchDim {
        /// The operation.
        op: &'static str,
        /// The dim as given.
        dim: i64,
    },
    /// A dim that the NestedTensor does not have.
    #[error("dim {dim} is out of range for a NestedTensor with {ndim} dims")]
    DimOutOfRange {
        /// The dim as given.
        dim: i64,
        /// `1 + rank` of the elements.
        ndim: usize,
    },
    /// A nested Rust list that is not a valid tensor (rows of different lengths...).
    #[error("element {element}: {reason}")]
    InvalidList {
        /// Index of the offending element.
        element: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// Results of the elements that were expected to share a shape do not.
    #[error("{op}: element {element} gives shape {got:?}, element 0 gives {expected:?}")]
    ElementShapeMismatch {
        /// The operation.
        op: &'static str,
        /// Index of the offending element.
        element: usize,
        /// The shape of element 0's result.
        expected: Vec<i64>,
        /// The shape of the offending element's result.
        got: Vec<i64>,
    },
    /// A slow path taken inside an [`ExecutionGuard`](crate::ExecutionGuard) scope.
    #[error("{op} takes {path}, which the execution guard forbids")]
    SlowPathForbidden {
        /// The operation.
        op: &'static str,
        /// The slow path it would take.
        path: crate::SlowPath,
    },
    /// Two NestedTensors of different structure in an operation that needs one.
    #[error(
        "{op}: the operands have different structures (element sizes {left:?} vs {right:?}{})",
        first_difference(.left, .right)
    )]
    StructureMismatch {
        /// The operation.
        op: &'static str,
        /// Element sizes of the left operand.
        left: Vec<Vec<i64>>,
        /// Element sizes of the right operand.
        right: Vec<Vec<i64>>,
    },
    /// A dense operand that does not broadcast against the elements.
    #[error(
        "{op}: a dense operand of shape {shape:?} does not broadcast against elements {reason}"
    )]
    DenseOperand {
        /// The operation.
        op: &'static str,
        /// Its shape.
        shape: Vec<i64>,
        /// Why not.
        reason: String,
    },
    /// An operation over elements with nothing to reduce.
    #[error("{op}: element {element} is empty along the reduced dims")]
    EmptyReduction {
        /// The operation.
        op: &'static str,
        /// The empty element.
        element: usize,
    },
    /// An operation this release does not provide for these arguments.
    #[error("{op}: {reason}")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// What is not supported.
        reason: String,
    },
    /// Something in the traced code that a graph cannot express.
    #[error("tracing {op}: {reason}")]
    Trace {
        /// The operation or call.
        op: &'static str,
        /// What went wrong.
        reason: String,
    },
    /// An input of a traced or compiled graph that does not fit its type.
    #[error("input {input}: {reason}")]
    InputMismatch {
        /// Which input of the graph.
        input: String,
        /// What does not fit.
        reason: String,
    },
    /// A graph could not be compiled or run by the compiled runtime; match on
    /// `reason.cause()` for why.
    #[error("compile ({stage}): {reason}")]
    Compile {
        /// Which stage: autodiff, passes, lowering, backend, device, runtime, host, dump.
        stage: &'static str,
        /// Why, typed ([`CompileReason::cause`]), with the message and the error of the
        /// layer that failed.
        reason: CompileReason,
    },
    /// Two batches (or two per-element lists) an operation pairs element by element
    /// have different sizes.
    #[error("{op}: {what} has {got} elements, expected {expected}")]
    BatchSizeMismatch {
        /// The operation.
        op: &'static str,
        /// Which argument.
        what: &'static str,
        /// The size it must have.
        expected: usize,
        /// Its size.
        got: usize,
    },
    /// An index into a static dim (one size in every element) is out of range.
    #[error("{op}: index {index} is out of range for dim {dim} of size {size}")]
    StaticIndexOutOfRange {
        /// The operation.
        op: &'static str,
        /// The NestedTensor dim.
        dim: i64,
        /// The index given.
        index: i64,
        /// The dim's size.
        size: i64,
    },
    /// A size or count from the caller too large to compute or to hold.
    #[error("{op}: {what} is too large")]
    TooLarge {
        /// The operation.
        op: &'static str,
        /// What overflowed, with its numbers.
        what: String,
    },
    /// A file that cannot be written, or read back as saved batches.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An error reported by libtorch. Displayed as its first line (libtorch appends a
    /// C++ backtrace); the whole report with `NESTOR_TORCH_BACKTRACE=1`, or from the
    /// `TchError` itself.
    #[error("libtorch: {}", torch_summary(.0))]
    Torch(#[from] TchError),
}

/// The first line of a libtorch error, or all of it when `NESTOR_TORCH_BACKTRACE` is set.
fn torch_summary(error: &TchError) -> String {
    let text = error.to_string();
    if std::env::var_os("NESTOR_TORCH_BACKTRACE").is_some() {
        return text;
    }
    let first = text.lines().next().unwrap_or_default();
    let more = text.lines().count() > 1;
    format!(
        "{first}{}",
        if more {
            " (NESTOR_TORCH_BACKTRACE=1 shows libtorch's backtrace)"
        } else {
            ""
        }
    )
}

/// Why a compiled call failed: a [`CompileCause`] to match on, the message (the
/// reason reads as that `str`), and the error of the layer that failed, if any (a
/// `nestor_runtime::RuntimeError`, `nestor_passes::LowerError`, `AutodiffError` or
/// `PassError`), to downcast.
///
/// ```
/// use nestor_frontend::{CompileCause, CompileReason};
///
/// let reason = CompileReason::new(CompileCause::Unsupported, "no gradient rule for sort");
/// assert_eq!(reason.cause(), CompileCause::Unsupported);
/// assert!(reason.contains("sort"));
/// ```
#[derive(Debug)]
pub struct CompileReason {
    cause: CompileCause,
    message: String,
    error: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// The kinds of [`CompileReason`]: what a caller may do something about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompileCause {
    /// The compiler does not support the graph: an op, or a mix of ops, dtypes or
    /// layouts, that it cannot lower or differentiate (run it eagerly).
    Unsupported,
    /// The model does not suit the mode: a training model whose first result is not a
    /// float scalar loss, or whose loss depends on nothing trainable.
    Model,
    /// Input `input` of the program (its inputs, then its parameters) does not fit it:
    /// its sizes, lengths or values (an id out of range).
    BadInput {
        /// Which graph input.
        input: usize,
    },
    /// Step `step` needs `bytes` at once, over the memory budget of `budget` bytes.
    MemoryBudget {
        /// Which step of the program.
        step: usize,
        /// What it needs (`u64::MAX` when the count overflows).
        bytes: u64,
        /// The budget.
        budget: u64,
    },
    /// Element `element` of this call breaks an equality of sizes the traced model
    /// relied on (windows of different geometry whose sizes agreed when traced, met in
    /// one op).
    SizesDiffer {
        /// The first element whose sizes differ.
        element: usize,
    },
    /// `op` needs `needed` positions along its dim and element `element` of this call
    /// has fewer (argmax or max of an empty element: eager's
    /// [`NestedError::EmptyReduction`](crate::NestedError); the `k`-th smallest value:
    /// eager's `ElementTooShort`).
    TooShort {
        /// The operation.
        op: &'static str,
        /// The first element too short.
        element: usize,
        /// The positions the operation needs.
        needed: i64,
    },
    /// A tensor is on a device compiled programs do not run on, or a kernel device
    /// failed.
    Device,
    /// The backend could not compile the program for this machine.
    Backend,
    /// A per-element region the program runs through libtorch failed.
    HostStep,
    /// A graph dump could not be written.
    Io,
    /// The compiler or runtime found its own program inconsistent: a bug of nestor.
    Internal,
}

impl CompileReason {
    /// A reason without an underlying error.
    pub fn new(cause: CompileCause, message: impl Into<String>) -> Self {
        Self {
            cause,
            message: message.into(),
            error: None,
        }
    }

    /// A reason for `error` of a lower layer, with its message.
    pub fn of(cause: CompileCause, error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self {
            cause,
            message: error.to_string(),
            error: Some(Box::new(error)),
        }
    }

    /// What kind of failure it is.
    pub fn cause(&self) -> CompileCause {
        self.cause
    }

    /// The message (as the error prints it after the stage).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The error of the layer that failed, if any, to downcast (for instance to
    /// `nestor_runtime::RuntimeError`).
    pub fn error(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.error.as_deref()
    }
}

impl std::fmt::Display for CompileReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The reason reads as its message, so `reason.contains(..)` and friends work on it.
impl std::ops::Deref for CompileReason {
    type Target = str;

    fn deref(&self) -> &str {
        &self.message
    }
}

impl NestedError {
    /// A [`NestedError::Compile`] at `stage` without an underlying error.
    pub(crate) fn compile(
        stage: &'static str,
        cause: CompileCause,
        message: impl Into<String>,
    ) -> Self {
        NestedError::Compile {
            stage,
            reason: CompileReason::new(cause, message),
        }
    }
}

/// `; element i is [..] vs [..]` for the first element of other sizes in two lists of
/// element sizes, or nothing.
fn first_difference(left: &[Vec<i64>], right: &[Vec<i64>]) -> String {
    left.iter()
        .zip(right)
        .position(|(a, b)| a != b)
        .map_or_else(String::new, |element| {
            format!(
                "; element {element} is {:?} vs {:?}",
                left[element], right[element]
            )
        })
}
