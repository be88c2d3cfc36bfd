//! The execution guard: inside its scope, the slow paths of the eager NestedTensor
//! (per-element fallbacks, padded materialization, dense repacking) are errors, so a
//! test can prove that a computation stays packed.

use std::cell::Cell;
use std::fmt;
use std::marker::PhantomData;

use crate::{NestedError, Result};

/// A slow path that the execution guard forbids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlowPath {
    /// Running an operation element by element (conv, pool, per-element attention...).
    PerElement,
    /// Building the padded tensor or mask.
    PaddedMaterialization,
    /// Packing a dense tensor of the padded shape into values.
    DenseRepacking,
}

impl fmt::Display for SlowPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SlowPath::PerElement => "a per-element fallback",
            SlowPath::PaddedMaterialization => "padded materialization",
            SlowPath::DenseRepacking => "dense repacking",
        })
    }
}

thread_local! {
    static GUARD_DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// While alive, slow paths on this thread return [`NestedError::SlowPathForbidden`].
/// Guards nest; the scope ends when the last one is dropped.
///
/// ```
/// use nestor_frontend::{ExecutionGuard, NestedError, NestedTensor};
/// let batch = NestedTensor::from_lists(vec![vec![1.0f32, 2.0], vec![3.0]])?;
/// let guard = ExecutionGuard::new();
/// assert!((&batch * 2.0).is_ok()); // packed
/// assert!(matches!(batch.tensor(), Err(NestedError::SlowPathForbidden { .. })));
/// drop(guard);
/// assert!(batch.tensor().is_ok());
/// # Ok::<(), NestedError>(())
/// ```
pub struct ExecutionGuard {
    // The guard is per thread, so it must not move to another thread.
    _not_send: PhantomData<*const ()>,
}

impl ExecutionGuard {
    /// Starts a guarded scope on this thread.
    pub fn new() -> Self {
        GUARD_DEPTH.with(|depth| depth.set(depth.get() + 1));
        Self {
            _not_send: PhantomData,
        }
    }
}

impl Default for ExecutionGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for ExecutionGuard {
    fn drop(&mut self) {
        GUARD_DEPTH.with(|depth| depth.set(depth.get().saturating_sub(1)));
    }
}

/// Runs `f` inside a guarded scope (see [`ExecutionGuard`]): a slow path inside it
/// (padding, per-element loops) is an error instead of a silent cost.
///
/// ```
/// use nestor_frontend::{nested_execution_guard, NestedTensor};
///
/// let batch = NestedTensor::from_lists(vec![vec![1.0f32, 2.0, 3.0], vec![4.0]])?;
/// // Packed operators pass; the padded view is a slow path.
/// assert!(nested_execution_guard(|| batch.softmax(1)).is_ok());
/// assert!(nested_execution_guard(|| batch.tensor()).is_err());
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
pub fn nested_execution_guard<T>(f: impl FnOnce() -> T) -> T {
    let _guard = ExecutionGuard::new();
    f()
}

/// Reports that `op` is about to take `path`: an error inside a guarded scope.
pub(crate) fn slow_path(path: SlowPath, op: &'static str) -> Result<()> {
    if GUARD_DEPTH.with(Cell::get) > 0 {
        Err(NestedError::SlowPathForbidden { op, path })
    } else {
        Ok(())
    }
}
