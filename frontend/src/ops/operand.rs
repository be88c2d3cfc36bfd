//! Operands of elementwise operators and how they line up with the packed values.

use tch::{Kind, Tensor};

use crate::guard::{slow_path, SlowPath};
use crate::{Dense, NestedError, NestedTensor, Result};

/// The other side of an elementwise operator.
///
/// - a scalar (`f64`, `i64`, `bool`) or a 0-d tensor applies to every value;
/// - a dense tensor of exactly the padded shape is packed first (dense repacking);
/// - a dense tensor of rank at most `R` broadcasts against every element from the right
///   (a tail `[C]` or `[1, C]` over `[L_i, C]` elements); its sizes at ragged dims
///   must be 1, so a positional `[1, L, C]` is an error rather than a silent guess;
/// - a dense tensor of rank `R + 1` with the batch size (or 1) at the batch dim applies
///   per element (`[B, 1, C]`);
/// - a NestedTensor must have the same structure, or elements that broadcast with
///   these (per element, every dim equal or 1 in one of them): the result then has the
///   broadcast shapes, packed (pair layouts such as `[L_i, L_i, C]`);
/// - a [`Dense`] handle lines up as its tensor does, and stays traced (a per-element
///   statistic `[B, 1, C]` such as `x.mean(&[1], true)` used against `x`).
pub enum Operand<'a> {
    /// A floating-point scalar.
    Float(f64),
    /// An integer scalar.
    Int(i64),
    /// A boolean scalar.
    Bool(bool),
    /// A dense tensor.
    Dense(&'a Tensor),
    /// A NestedTensor of the same structure.
    Nested(&'a NestedTensor),
    /// A dense handle (traced when it was computed from traced values).
    Handle(&'a Dense),
}

impl<'a> Operand<'a> {
    /// This operand, a batch traced with `base`'s length symbols
    /// ([`NestedTensor::lengths_matched`]; a new batch is kept in `matched`).
    pub(crate) fn matched<'s>(
        self,
        base: &NestedTensor,
        matched: &'s mut Option<NestedTensor>,
    ) -> Result<Operand<'s>>
    where
        'a: 's,
    {
        if let Operand::Nested(nested) = self {
            *matched = base.lengths_matched(nested)?;
            if let Some(batch) = matched.as_ref() {
                return Ok(Operand::Nested(batch));
            }
        }
        Ok(self)
    }
}

impl From<f64> for Operand<'_> {
    fn from(value: f64) -> Self {
        Operand::Float(value)
    }
}
impl From<i64> for Operand<'_> {
    fn from(value: i64) -> Self {
        Operand::Int(value)
    }
}
impl From<bool> for Operand<'_> {
    fn from(value: bool) -> Self {
        Operand::Bool(value)
    }
}
impl<'a> From<&'a Tensor> for Operand<'a> {
    fn from(tensor: &'a Tensor) -> Self {
        Operand::Dense(tensor)
    }
}
impl<'a> From<&'a Dense> for Operand<'a> {
    fn from(dense: &'a Dense) -> Self {
        Operand::Handle(dense)
    }
}
impl<'a> From<&'a NestedTensor> for Operand<'a> {
    fn from(nested: &'a NestedTensor) -> Self {
        Operand::Nested(nested)
    }
}

impl NestedTensor {
    /// A tensor that broadcasts against `self.values()` the way `operand` broadcasts
    /// against the elements (see [`Operand`]).
    pub(crate) fn align(&self, operand: &Operand<'_>, op: &'static str) -> Result<Tensor> {
        match operand {
            // A 0-d tensor takes part in type promotion as a Python number does: a float
            // keeps a floating batch's dtype and turns an integer batch into the
            // default float dtype (f32); an integer never widens a float batch.
            Operand::Float(value) => {
                let kind = if self.packed().is_floating_point() {
                    self.kind()
                } else {
                    Kind::Float
                };
                Ok(
                    Tensor::f_scalar_tensor(*value, (Kind::Double, self.device()))?
                        .f_to_kind(kind)?,
                )
            }
            Operand::Int(value) => Ok(Tensor::f_scalar_tensor(
                *value,
                (Kind::Int64, self.device()),
            )?),
            Operand::Bool(value) => Ok(Tensor::f_scalar_tensor(
                i64::from(*value),
                (Kind::Int64, self.device()),
            )?
            .f_to_kind(Kind::Bool)?),
            Operand::Nested(other) => {
                if self.check_same_structure(other, op).is_err()
                    && self.lay().element_sizes() == other.lay().element_sizes()
                {
                    // Same elements, other ragged dims (equal lengths packed densely in one
                    // operand): repack the other operand into this layout.
                    slow_path(SlowPath::DenseRepacking, op)?;
                    let repacked = NestedTensor::builder()
                        .ragged_dims(self.lay().ragged_dims())
                        .tensors(&other.elements()?)?;
                    return Ok(repacked.packed().shallow_clone());
                }
                self.check_same_structure(other, op)?;
                Ok(other.packed().shallow_clone())
            }
            Operand::Dense(tensor) => self.align_dense(tensor, op),
            Operand::Handle(dense) => self.align_dense(dense.raw(), op),
        }
    }

    /// Errors unless `other` has the same element sizes and ragged dims.
    pub(crate) fn check_same_structure(
        &self,
        other: &NestedTensor,
        op: &'static str,
    ) -> Result<()> {
        let (left, right) = (self.lay(), other.lay());
        if std::ptr::eq(left, right) || left == right {
            return Ok(());
        }
        Err(NestedError::StructureMismatch {
            op,
            left: left.element_sizes().to_vec(),
            right: right.element_sizes().to_vec(),
        })
    }

    fn align_dense(&self, tensor: &Tensor, op: &'static str) -> Result<Tensor> {
        let shape = tensor.size();
        let rank = self.lay().rank();
        if shape.is_empty() {
            return Ok(tensor.shallow_clone());
        }
        if rank > 0 && shape == self.padded_shape() {
            slow_path(SlowPath::DenseRepacking, op)?;
            return self.pack_padded(tensor);
        }
        let error = |reason: String| NestedError::DenseOperand {
            op,
            shape: shape.clone(),
            reason,
        };
        let (per_batch, element_shape) = if shape.len() == rank + 1 {
            let batch_dim = self.batch_dim();
            let batch_size = shape[batch_dim];
            let mut element_shape = shape.clone();
            element_shape.remove(batch_dim);
            match batch_size {
                1 => (false, element_shape),
                size if size == self.batch_size() as i64 => (true, element_shape),
                size => {
                    return Err(error(format!(
                        "(its batch dim {batch_dim} has size {size}, expected {} or 1)",
                        self.batch_size()
                    )))
                }
            }
        } else if shape.len() <= rank {
            let ones = vec![1i64; rank - shape.len()];
            (false, [ones, shape.clone()].concat())
        } else {
            return Err(error(format!(
                "of rank {rank} (at most rank {} is allowed)",
                rank + 1
            )));
        };
        // The operand in packed order: ragged dims must be 1, static dims 1 or the size.
        let layout = self.lay();
        for &dim in layout.ragged_dims() {
            if element_shape[dim] != 1 {
                return Err(error(format!(
                    "(element dim {dim} is ragged, so the operand must have size 1 there, not {}; \
                     pack a positional operand as a NestedTensor instead)",
                    element_shape[dim]
                )));
            }
        }
        for (&dim, &size) in layout.static_dims().iter().zip(layout.static_sizes()) {
            if element_shape[dim] != 1 && element_shape[dim] != size && size != 1 {
                return Err(error(format!("(element dim {dim} has size {size})")));
            }
        }
        let mut dense = if per_batch && self.batch_dim() == 1 {
            tensor.f_transpose(0, 1)?
        } else {
            tensor.shallow_clone()
        };
        let lead = if per_batch {
            self.batch_size() as i64
        } else {
            1
        };
        let order: Vec<i64> = std::iter::once(0)
            .chain(layout.packed_dim_order().iter().map(|&dim| dim as i64 + 1))
            .collect();
        let static_shape: Vec<i64> = layout
            .static_dims()
            .iter()
            .map(|&dim| element_shape[dim])
            .collect();
        dense = dense
            .f_reshape([vec![lead], element_shape.clone()].concat())?
            .f_permute(order)?;
        dense = dense.f_reshape([vec![lead], static_shape].concat())?;
        if per_batch {
            let owners =
                Tensor::f_from_slice(&layout.row_elements())?.f_to_device(dense.device())?;
            dense = dense.f_index_select(0, &owners)?;
        }
        Ok(dense)
    }

    /// The packed values of a dense tensor of exactly the padded shape.
    pub(crate) fn pack_padded(&self, padded: &Tensor) -> Result<Tensor> {
        let layout = self.lay();
        let batch_first = if self.batch_dim() == 1 && padded.dim() >= 2 {
            padded.f_transpose(0, 1)?
        } else {
            padded.shallow_clone()
        };
        let order: Vec<i64> = std::iter::once(0)
            .chain(layout.packed_dim_order().iter().map(|&dim| dim as i64 + 1))
            .collect();
        let grid = batch_first
            .f_permute(order)?
            .f_reshape([vec![-1], layout.static_sizes().to_vec()].concat())?;
        let rows =
            Tensor::f_from_slice(&layout.padded_row_indices())?.f_to_device(grid.device())?;
        Ok(grid.f_index_select(0, &rows)?)
    }
}
