//! Helpers for dense tensors built from per-element results.

use tch::Tensor;

use crate::{NestedError, Result};

/// Stacks per-element tensors along a new leading dim, or names the first element
/// whose shape differs from element 0's. `None` for no tensors (no shape to stack to).
pub(crate) fn stack_same_shape(tensors: &[Tensor], op: &'static str) -> Result<Option<Tensor>> {
    let Some(first) = tensors.first() else {
        return Ok(None);
    };
    let expected = first.size();
    if let Some((element, tensor)) = tensors
        .iter()
        .enumerate()
        .find(|(_, t)| t.size() != expected)
    {
        return Err(NestedError::ElementShapeMismatch {
            op,
            element,
            expected,
            got: tensor.size(),
        });
    }
    Ok(Some(Tensor::f_stack(tensors, 0)?))
}
