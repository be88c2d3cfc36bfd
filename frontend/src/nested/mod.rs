//! The eager `NestedTensor`: a packed ragged batch on libtorch.

mod build;
mod display;
mod file;
mod index;
mod list;
mod padded;

use std::cell::OnceCell;
use std::sync::Arc;

use nestor_layout::RaggedLayout;
use tch::{Device, Kind, Tensor};

use crate::trace::{Arg, TraceRef};
use crate::{dtype_of, NestedError, Result};

pub use build::NestedBuilder;
pub use file::{load_batches, save_batches};
pub use index::{BatchSelector, Bounds};
pub use list::{ListData, ListElement};

/// How a `NestedTensor` presents itself padded.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NestedOptions {
    /// Whether the batch dim comes first in [`NestedTensor::tensor`] and
    /// [`NestedTensor::shape`] (`[B, L, ...]`), or second (`[L, B, ...]`). Default true.
    pub batch_first: bool,
    /// The value of padded positions in [`NestedTensor::tensor`]. Default 0.
    pub padding_value: f64,
    /// The value [`NestedTensor::mask`] holds at padded positions. Default false, so
    /// the mask is true on real data; true inverts the mask.
    pub mask_value: bool,
}

impl Default for NestedOptions {
    fn default() -> Self {
        Self {
            batch_first: true,
            padding_value: 0.0,
            mask_value: false,
        }
    }
}

/// A batch of tensors of different shapes, stored packed.
///
/// Element `i` has a logical shape `s_i`; all elements have the same rank `R`. Dims on
/// which the elements agree are static, the others ragged. The elements live in one
/// tensor, [`values`](Self::values), of shape `[N, *static sizes]`: each element is
/// permuted so that its ragged dims come first ([`packed_dim_order`](Self::packed_dim_order)),
/// its ragged dims are flattened into rows, and the elements are concatenated; element
/// `i` owns rows `offsets[i]..offsets[i + 1]`. Autograd flows through `values`.
///
/// ```
/// use nestor_frontend::NestedTensor;
/// use tch::{Kind, Tensor};
///
/// // Two sequences of 3 and 5 tokens with 4 features each.
/// let batch = NestedTensor::from_tensors(&[
///     Tensor::ones([3, 4], (Kind::Float, tch::Device::Cpu)),
///     Tensor::ones([5, 4], (Kind::Float, tch::Device::Cpu)),
/// ])?;
/// assert_eq!(batch.values().size(), [8, 4]); // packed: no padding
/// assert_eq!(batch.shape(), [2, 5, 4]); // padded view
/// assert_eq!(batch.occupancy(), 0.8);
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
pub struct NestedTensor {
    values: Tensor,
    layout: Arc<RaggedLayout>,
    options: NestedOptions,
    /// The padded tensor, kept when `values` does not require grad (a cached autograd
    /// graph would be shared between unrelated backward passes).
    padded: OnceCell<Tensor>,
    /// While tracing: the graph value this batch stands for.
    pub(crate) trace: Option<TraceRef>,
}

impl NestedTensor {
    /// Wraps packed values in a layout. The caller guarantees `values.size()` equals
    /// `layout.packed_shape()`.
    pub(crate) fn from_parts(values: Tensor, layout: RaggedLayout, options: NestedOptions) -> Self {
        Self {
            values,
            layout: Arc::new(layout),
            options,
            padded: OnceCell::new(),
            trace: None,
        }
    }

    /// The same layout and options around other packed values of the same shape.
    pub(crate) fn with_values(&self, values: Tensor) -> Self {
        self.sharing_layout(values, self.options)
    }

    /// Other packed values of the same shape on this batch's layout (shared, not
    /// copied), with `options`.
    pub(crate) fn sharing_layout(&self, values: Tensor, options: NestedOptions) -> Self {
        Self {
            values,
            layout: Arc::clone(&self.layout),
            options,
            padded: OnceCell::new(),
            trace: None,
        }
    }

    /// Drops the cached padded tensor (after the values changed in place).
    pub(crate) fn forget_padded(&mut self) {
        self.padded = OnceCell::new();
    }

    /// A builder to set options (batch_first, padding, dtype, device, ...) before
    /// constructing.
    pub fn builder() -> NestedBuilder {
        NestedBuilder::default()
    }

    /// A batch of the given element tensors, with default options. Element dtypes are
    /// promoted to a common dtype as torch does; all elements must have one rank and
    /// live on one device.
    pub fn from_tensors(elements: &[Tensor]) -> Result<Self> {
        Self::builder().tensors(elements)
    }

    /// A batch of one element.
    pub fn from_tensor(element: &Tensor) -> Result<Self> {
        Self::builder().tensors(std::slice::from_ref(element))
    }

    /// A batch of elements given as Rust lists (scalars, vectors or matrices of f32,
    /// f64, i64 or bool), promoted to one dtype as torch does.
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let batch = NestedTensor::from_lists(vec![vec![1, 2, 3], vec![4, 5]])?;
    /// assert_eq!(batch.kind(), tch::Kind::Int64);
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    pub fn from_lists<E: Into<ListElement>>(elements: impl IntoIterator<Item = E>) -> Result<Self> {
        Self::builder().lists(elements)
    }

    /// A batch read back from a padded tensor and its mask (as [`tensor`](Self::tensor)
    /// and [`mask`](Self::mask) give them, with default options). See
    /// [`NestedBuilder::tensor_mask`].
    pub fn from_tensor_mask(tensor: &Tensor, mask: &Tensor) -> Result<Self> {
        Self::builder().tensor_mask(tensor, mask)
    }

    /// Zero-copy: packed values `[T, *tail]` split into elements `[L_i, *tail]` by
    /// `lengths` (which must sum to `T`). The leading dim is ragged even when all
    /// lengths agree. See [`NestedBuilder::packed_with_lengths`].
    pub fn packed_with_lengths(values: &Tensor, lengths: &[i64]) -> Result<Self> {
        Self::builder().packed_with_lengths(values, lengths)
    }

    /// The packed values `[N, *static sizes]`.
    ///
    /// Reading them while tracing is an error of the trace (the graph could not see
    /// what is computed from them).
    pub fn values(&self) -> &Tensor {
        self.concrete_read("NestedTensor::values");
        &self.values
    }

    /// Where every element lives in the packed values. Concrete lengths: reading them
    /// while tracing is an error of the trace.
    pub fn layout(&self) -> &RaggedLayout {
        self.concrete_read("NestedTensor::layout");
        &self.layout
    }

    /// The packed values, for the library's own operators.
    pub(crate) fn packed(&self) -> &Tensor {
        &self.values
    }

    /// The layout, for the library's own operators.
    pub(crate) fn lay(&self) -> &RaggedLayout {
        &self.layout
    }

    /// The number of elements, for the library's own operators.
    pub(crate) fn batch_size(&self) -> usize {
        self.layout.batch_size()
    }

    /// The padded shape, for the library's own operators.
    pub(crate) fn padded_shape(&self) -> Vec<i64> {
        let mut shape = self.layout.max_sizes();
        shape.insert(self.batch_dim(), self.batch_size() as i64);
        shape
    }

    /// Records, while tracing, that user code read concrete lengths or values through
    /// `call`: the trace then fails, naming the call, instead of silently specializing
    /// the graph to this batch.
    pub(crate) fn concrete_read(&self, call: &'static str) {
        if let Some(trace) = &self.trace {
            trace.concrete_read(call);
        }
    }

    /// The presentation options (batch_first, padding_value, mask_value).
    pub fn options(&self) -> NestedOptions {
        self.options
    }

    /// The same batch with other presentation options (no copy).
    pub fn with_options(&self, options: NestedOptions) -> Self {
        Self {
            options,
            ..self.shallow_clone()
        }
    }

    /// The size of every element dim that is static (`None` for ragged dims). Part of
    /// the structure, not of a batch's lengths: reading it while tracing is fine.
    pub fn static_shape(&self) -> Vec<Option<i64>> {
        (0..self.layout.rank())
            .map(|dim| {
                self.static_axis(dim)
                    .map(|axis| self.values.size()[axis as usize])
            })
            .collect()
    }

    /// Number of elements `B` (a concrete read while tracing).
    pub fn len(&self) -> usize {
        self.concrete_read("NestedTensor::len");
        self.layout.batch_size()
    }

    /// Whether the batch has no element (a concrete read while tracing).
    pub fn is_empty(&self) -> bool {
        self.concrete_read("NestedTensor::is_empty");
        self.batch_size() == 0
    }

    /// Number of dims of the padded view: `1 + R`.
    pub fn dim(&self) -> usize {
        self.layout.rank() + 1
    }

    /// Number of real scalars (padding not counted).
    pub fn numel(&self) -> i64 {
        self.concrete_read("NestedTensor::numel");
        self.layout.numel()
    }

    /// Real scalars over the scalars of the padded tensor.
    pub fn occupancy(&self) -> f64 {
        self.concrete_read("NestedTensor::occupancy");
        self.layout.occupancy()
    }

    /// The scalar type of the values.
    pub fn kind(&self) -> Kind {
        self.values.kind()
    }

    /// The device of the values.
    pub fn device(&self) -> Device {
        self.values.device()
    }

    /// Whether autograd records operations on the values.
    pub fn requires_grad(&self) -> bool {
        self.values.requires_grad()
    }

    /// The padded shape: `B` then the largest size of each element dim; the batch dim
    /// is second when `batch_first` is false.
    ///
    /// A concrete read while tracing.
    pub fn shape(&self) -> Vec<i64> {
        self.concrete_read("NestedTensor::shape");
        self.padded_shape()
    }

    /// One entry of [`shape`](Self::shape); negative dims count from the end.
    pub fn size(&self, dim: i64) -> Result<i64> {
        self.concrete_read("NestedTensor::size");
        let dim = self.normalize_dim(dim)?;
        Ok(self.padded_shape()[dim])
    }

    /// Where the batch dim is in the padded view: 0, or 1 when `batch_first` is false
    /// and the elements have at least one dim.
    pub fn batch_dim(&self) -> usize {
        usize::from(!self.options.batch_first && self.layout.rank() > 0)
    }

    /// Row offsets of the elements in the packed values, `i64[B + 1]`.
    pub fn packed_offsets(&self) -> Tensor {
        self.concrete_read("NestedTensor::packed_offsets");
        Tensor::from_slice(self.layout.offsets()).to_device(self.device())
    }

    /// The exact logical shape of every element, `i64[B, R]`.
    pub fn element_sizes(&self) -> Tensor {
        self.concrete_read("NestedTensor::element_sizes");
        let flat: Vec<i64> = self
            .layout
            .element_sizes()
            .iter()
            .flatten()
            .copied()
            .collect();
        Tensor::from_slice(&flat)
            .reshape([self.batch_size() as i64, self.layout.rank() as i64])
            .to_device(self.device())
    }

    /// The row splits of ragged level `level` (see
    /// [`RaggedLayout::ragged_level_offsets`]): level 0 has `B + 1` entries.
    pub fn ragged_level_offsets(&self, level: usize) -> Result<Tensor> {
        self.concrete_read("NestedTensor::ragged_level_offsets");
        let splits = self.layout.ragged_level_offsets(level)?;
        Ok(Tensor::from_slice(&splits).to_device(self.device()))
    }

    /// The order of element dims in the packed values: ragged dims first.
    pub fn packed_dim_order(&self) -> Vec<usize> {
        self.layout.packed_dim_order()
    }

    /// The packed values: every element's rows concatenated, `[N, *static sizes]`.
    /// For elements with one leading ragged dim this is `torch.cat` of the elements.
    pub fn concat(&self) -> Tensor {
        self.values.shallow_clone()
    }

    /// The element dim of NestedTensor dim `dim` (negative counts from the end), or
    /// an error for the batch dim.
    pub(crate) fn element_dim(&self, dim: i64, op: &'static str) -> Result<usize> {
        let normalized = self.normalize_dim(dim)?;
        let batch_dim = self.batch_dim();
        match normalized.cmp(&batch_dim) {
            std::cmp::Ordering::Equal => Err(NestedError::BatchDim { op, dim }),
            std::cmp::Ordering::Less => Ok(normalized),
            std::cmp::Ordering::Greater => Ok(normalized - 1),
        }
    }

    pub(crate) fn normalize_dim(&self, dim: i64) -> Result<usize> {
        let ndim = self.dim();
        let normalized = if dim < 0 { dim + ndim as i64 } else { dim };
        if (0..ndim as i64).contains(&normalized) {
            Ok(normalized as usize)
        } else {
            Err(NestedError::DimOutOfRange { dim, ndim })
        }
    }

    /// The same batch converted to another scalar type (autograd flows through).
    pub fn to_kind(&self, kind: Kind) -> Result<Self> {
        let dtype = dtype_of(kind).ok_or(NestedError::UnsupportedKind { element: 0, kind })?;
        let result = self.with_values(self.values.f_to_kind(kind)?);
        result.traced(&[Arg::Nested(self)], "cast", |ids| nestor_ir::Op::Cast {
            x: ids[0],
            dtype,
        })
    }

    /// The same batch on another device.
    pub fn to_device(&self, device: Device) -> Result<Self> {
        self.untraceable("to_device")?;
        Ok(self.with_values(self.values.f_to_device(device)?))
    }

    /// The same batch, detached from the autograd graph (no copy).
    pub fn detach(&self) -> Result<Self> {
        Ok(self.with_values(self.values.f_detach()?))
    }

    /// Sets whether autograd records operations on the values (which must be a leaf
    /// tensor, as in torch) and returns the batch.
    pub fn set_requires_grad(self, requires_grad: bool) -> Result<Self> {
        let values = self.values.f_set_requires_grad(requires_grad)?;
        Ok(self.with_values(values))
    }

    /// The gradient of the values after a backward pass, as a batch of this layout.
    pub fn grad(&self) -> Option<Self> {
        let grad = self.values.grad();
        grad.defined().then(|| self.with_values(grad))
    }

    /// A new handle on the same values (no copy), like `Tensor::shallow_clone`.
    pub fn shallow_clone(&self) -> Self {
        Self {
            trace: self.trace.clone(),
            ..self.with_values(self.values.shallow_clone())
        }
    }
}

impl Clone for NestedTensor {
    /// Shares the values, as `Tensor::shallow_clone` does.
    fn clone(&self) -> Self {
        self.shallow_clone()
    }
}
