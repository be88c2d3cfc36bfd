//! Whole-batch comparisons: `equal` and `allclose`, true or false (never an error for
//! batches of different structure), as DanLing's `torch.equal` / `torch.allclose`.

use tch::{TchError, Tensor};

use crate::guard::{slow_path, SlowPath};
use crate::{NestedTensor, Result};

/// What a batch is compared with.
pub enum Comparand<'a> {
    /// Another batch: equal structure (element shapes) is required for `true`.
    Nested(&'a NestedTensor),
    /// A dense tensor, compared with the padded view: its shape must be the padded
    /// shape, and only the real positions are compared (padding is ignored).
    Padded(&'a Tensor),
}

impl<'a> From<&'a NestedTensor> for Comparand<'a> {
    fn from(nested: &'a NestedTensor) -> Self {
        Comparand::Nested(nested)
    }
}

impl<'a> From<&'a Tensor> for Comparand<'a> {
    fn from(tensor: &'a Tensor) -> Self {
        Comparand::Padded(tensor)
    }
}

impl NestedTensor {
    /// Whether `other` holds the same elements: same shapes and the same values
    /// (`torch.equal` on every element). A batch of another structure is `false`.
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let batch = NestedTensor::from_lists(vec![vec![1.0f32, 2.0], vec![3.0]])?;
    /// assert!(batch.equal(&batch)?);
    /// assert!(batch.equal(&batch.tensor()?)?); // the padded view, padding ignored
    /// let other = NestedTensor::from_lists(vec![vec![1.0f32], vec![2.0, 3.0]])?;
    /// assert!(!batch.equal(&other)?);
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    pub fn equal<'a>(&self, other: impl Into<Comparand<'a>>) -> Result<bool> {
        self.compare(other.into(), "equal", |a, b| a.f_equal(b))
    }

    /// Whether every value is within `atol + rtol * |other|` of `other`'s
    /// (`torch.allclose` on every element; NaNs equal when `equal_nan`). A batch of
    /// another structure is `false`.
    pub fn allclose<'a>(
        &self,
        other: impl Into<Comparand<'a>>,
        rtol: f64,
        atol: f64,
        equal_nan: bool,
    ) -> Result<bool> {
        self.compare(other.into(), "allclose", |a, b| {
            a.f_allclose(b, rtol, atol, equal_nan)
        })
    }

    fn compare(
        &self,
        other: Comparand<'_>,
        op: &'static str,
        same: impl Fn(&Tensor, &Tensor) -> std::result::Result<bool, TchError>,
    ) -> Result<bool> {
        self.concrete_read(op);
        match other {
            Comparand::Padded(tensor) => {
                if tensor.size() != self.padded_shape() {
                    return Ok(false);
                }
                Ok(same(self.packed(), &self.pack_padded(tensor)?)?)
            }
            Comparand::Nested(other) => {
                other.concrete_read(op);
                let (left, right) = (self.lay(), other.lay());
                if left.element_sizes() != right.element_sizes() {
                    return Ok(false);
                }
                if left.ragged_dims() == right.ragged_dims() {
                    return Ok(same(self.packed(), other.packed())?);
                }
                // Same elements packed by other ragged dims (lengths that happen to
                // agree packed densely in one of them): element by element.
                slow_path(SlowPath::PerElement, op)?;
                for (a, b) in self.elements()?.iter().zip(other.elements()?) {
                    if !same(a, &b)? {
                        return Ok(false);
                    }
                }
                Ok(true)
            }
        }
    }
}
