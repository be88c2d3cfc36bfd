//! Construction of `NestedTensor`s: from element tensors, Rust lists, a padded tensor
//! with its mask, or packed values with lengths.

use nestor_ir::DType;
use nestor_layout::RaggedLayout;
use tch::{Device, Kind, Tensor};

use super::{ListElement, NestedOptions, NestedTensor};
use crate::{dtype_of, kind_of, NestedError, Result};

/// Options for constructing a [`NestedTensor`]; finish with one of the constructors
/// ([`tensors`](Self::tensors), [`lists`](Self::lists), [`tensor_mask`](Self::tensor_mask),
/// [`packed_with_lengths`](Self::packed_with_lengths)).
///
/// ```
/// use nestor_frontend::NestedTensor;
/// use tch::Kind;
///
/// let batch = NestedTensor::builder()
///     .batch_first(false)
///     .padding_value(-1.0)
///     .kind(Kind::Float)
///     .lists(vec![vec![1, 2, 3], vec![4, 5]])?;
/// let padded = Vec::<Vec<f32>>::try_from(&batch.tensor()?)?;
/// assert_eq!(padded, [[1.0, 4.0], [2.0, 5.0], [3.0, -1.0]]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct NestedBuilder {
    options: NestedOptions,
    kind: Option<Kind>,
    device: Option<Device>,
    requires_grad: bool,
    ragged_dims: Vec<usize>,
}

impl NestedBuilder {
    /// Whether the batch dim comes first in the padded view (default true).
    pub fn batch_first(mut self, batch_first: bool) -> Self {
        self.options.batch_first = batch_first;
        self
    }

    /// The value of padded positions (default 0).
    pub fn padding_value(mut self, padding_value: f64) -> Self {
        self.options.padding_value = padding_value;
        self
    }

    /// The mask's value at padded positions (default false).
    pub fn mask_value(mut self, mask_value: bool) -> Self {
        self.options.mask_value = mask_value;
        self
    }

    /// All presentation options at once.
    pub fn options(mut self, options: NestedOptions) -> Self {
        self.options = options;
        self
    }

    /// Converts the values to this scalar type (default: the promoted input type).
    pub fn kind(mut self, kind: Kind) -> Self {
        self.kind = Some(kind);
        self
    }

    /// Moves the values to this device (default: the device of the inputs).
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Makes the packed values a leaf that requires grad.
    pub fn requires_grad(mut self, requires_grad: bool) -> Self {
        self.requires_grad = requires_grad;
        self
    }

    /// Element dims to treat as ragged even if every element agrees on their size, so
    /// that a batch whose lengths happen to be equal keeps the layout of other batches.
    pub fn ragged_dims(mut self, dims: &[usize]) -> Self {
        self.ragged_dims = dims.to_vec();
        self
    }

    /// A batch of the given element tensors. Element dtypes are promoted to a common
    /// dtype as torch does; ranks and devices must agree. An empty slice gives an
    /// empty batch.
    pub fn tensors(&self, elements: &[Tensor]) -> Result<NestedTensor> {
        let kind = common_kind(elements)?;
        check_devices(elements)?;
        let sizes = elements.iter().map(Tensor::size).collect();
        let layout = RaggedLayout::from_element_sizes(sizes, &self.ragged_dims)?;
        let values = pack_elements(elements, &layout, kind.unwrap_or(Kind::Float))?;
        self.finish(values, layout)
    }

    /// A batch of elements given as Rust lists (see [`ListElement`]).
    pub fn lists<E: Into<ListElement>>(
        &self,
        elements: impl IntoIterator<Item = E>,
    ) -> Result<NestedTensor> {
        let tensors = elements
            .into_iter()
            .enumerate()
            .map(|(index, element)| element.into().to_tensor(index))
            .collect::<Result<Vec<_>>>()?;
        self.tensors(&tensors)
    }

    /// A batch read back from a padded tensor `[B, D_0, ..., D_{R-1}]` and a padding
    /// mask over its leading dims `[B, D_0, ..., D_{k-1}]` (`k <= R`; bool or 0/1),
    /// both laid out as this builder's options say (batch second when `batch_first` is
    /// false, mask inverted when `mask_value` is true). The data positions of every
    /// element must form a box anchored at index 0 (a prefix mask); element `b` is that
    /// box, with the full size of the unmasked trailing dims.
    pub fn tensor_mask(&self, tensor: &Tensor, mask: &Tensor) -> Result<NestedTensor> {
        let batch_second = !self.options.batch_first;
        let tensor = if batch_second && tensor.dim() >= 2 {
            tensor.f_transpose(0, 1)?
        } else {
            tensor.shallow_clone()
        };
        let mask = if batch_second && mask.dim() >= 2 {
            mask.f_transpose(0, 1)?
        } else {
            mask.shallow_clone()
        };
        let shape = tensor.size();
        let mask_shape = mask.size();
        if mask_shape.is_empty()
            || mask_shape.len() > shape.len()
            || shape[..mask_shape.len()] != mask_shape[..]
        {
            return Err(NestedError::ShapeMismatch {
                what: "mask",
                expected: format!("a prefix of the tensor's shape {shape:?}, batch dim included"),
                got: mask_shape,
            });
        }
        let mut data = mask.f_to_kind(Kind::Bool)?;
        if self.options.mask_value {
            data = data.f_logical_not()?;
        }
        let batch = shape[0];
        let masked_extents = prefix_extents(&data)?;
        let mut elements = Vec::with_capacity(batch as usize);
        for (element, extents) in masked_extents.iter().enumerate() {
            let mut value = tensor.f_get(element as i64)?;
            for (dim, &extent) in extents.iter().enumerate() {
                value = value.f_narrow(dim as i64, 0, extent)?;
            }
            elements.push(value);
        }
        self.tensors(&elements)
    }

    /// Zero-copy: packed values `[T, *tail]` split into elements `[L_i, *tail]` by
    /// `lengths`, which must be non-negative and sum to `T`. The leading dim is ragged
    /// even when all lengths agree. The values keep their storage and autograd history
    /// (the builder's dtype and device options still convert them).
    pub fn packed_with_lengths(&self, values: &Tensor, lengths: &[i64]) -> Result<NestedTensor> {
        if !values.defined() {
            return Err(NestedError::ShapeMismatch {
                what: "packed values",
                expected: "a defined tensor".to_owned(),
                got: Vec::new(),
            });
        }
        let shape = values.size();
        let Some((&rows, tail)) = shape.split_first() else {
            return Err(NestedError::ShapeMismatch {
                what: "packed values",
                expected: "at least one dim (the packed rows)".to_owned(),
                got: shape,
            });
        };
        let layout = RaggedLayout::from_lengths(lengths, tail)?;
        let sum = layout.total_rows();
        if sum != rows {
            return Err(NestedError::LengthsSum { sum, rows });
        }
        self.finish(values.shallow_clone(), layout)
    }

    /// Applies the dtype, device and requires_grad options to packed values.
    fn finish(&self, mut values: Tensor, layout: RaggedLayout) -> Result<NestedTensor> {
        if let Some(kind) = self.kind.filter(|&kind| kind != values.kind()) {
            values = values.f_to_kind(kind)?;
        }
        if let Some(device) = self.device.filter(|&device| device != values.device()) {
            values = values.f_to_device(device)?;
        }
        if self.requires_grad {
            values = values.f_detach()?.f_set_requires_grad(true)?;
        }
        Ok(NestedTensor::from_parts(values, layout, self.options))
    }
}

/// The dtype every element converts to (`None` for an empty batch).
fn common_kind(elements: &[Tensor]) -> Result<Option<Kind>> {
    let mut common: Option<DType> = None;
    for (element, tensor) in elements.iter().enumerate() {
        let kind = tensor.f_kind()?;
        let dtype = dtype_of(kind).ok_or(NestedError::UnsupportedKind { element, kind })?;
        common = Some(common.map_or(dtype, |common| common.promote(dtype)));
    }
    Ok(common.map(kind_of))
}

fn check_devices(elements: &[Tensor]) -> Result<()> {
    let Some(first) = elements.first() else {
        return Ok(());
    };
    let expected = first.device();
    match elements
        .iter()
        .position(|tensor| tensor.device() != expected)
    {
        Some(element) => Err(NestedError::DeviceMismatch {
            element,
            expected,
            got: elements[element].device(),
        }),
        None => Ok(()),
    }
}

/// Packs elements into `[N, *static sizes]` values in the layout's packed order.
fn pack_elements(elements: &[Tensor], layout: &RaggedLayout, kind: Kind) -> Result<Tensor> {
    if elements.is_empty() {
        return Ok(Tensor::f_empty(layout.packed_shape(), (kind, Device::Cpu))?);
    }
    let order: Vec<i64> = layout
        .packed_dim_order()
        .iter()
        .map(|&dim| dim as i64)
        .collect();
    let static_sizes = layout.static_sizes();
    let offsets = layout.offsets();
    let rows = elements
        .iter()
        .enumerate()
        .map(|(element, tensor)| {
            let rows = offsets[element + 1] - offsets[element];
            let shape: Vec<i64> = std::iter::once(rows)
                .chain(static_sizes.iter().copied())
                .collect();
            let tensor = if tensor.kind() == kind {
                tensor.shallow_clone()
            } else {
                tensor.f_to_kind(kind)?
            };
            Ok(tensor.f_permute(&order)?.f_reshape(&shape)?)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::f_cat(&rows, 0)?)
}

/// For every element of a bool data mask `[B, D_0, ..., D_{k-1}]`, the extent of its
/// data box in each masked dim, checking that the data positions fill that box.
fn prefix_extents(data: &Tensor) -> Result<Vec<Vec<i64>>> {
    let shape = data.size();
    let batch = shape[0];
    let masked_dims = shape.len() - 1;
    let mut extents_per_dim = Vec::with_capacity(masked_dims);
    for dim in 0..masked_dims {
        // Positions along `dim` that hold data anywhere: [B, D_dim].
        let other_dims: Vec<i64> = (1..=masked_dims as i64)
            .filter(|&d| d != dim as i64 + 1)
            .collect();
        let present = if other_dims.is_empty() {
            data.shallow_clone()
        } else {
            data.f_any_dims(other_dims.as_slice(), false)?
        };
        if shape[dim + 1] == 0 {
            extents_per_dim.push(vec![0; batch as usize]);
            continue;
        }
        // The extent is one past the last present position.
        let positions =
            Tensor::f_arange_start(1, shape[dim + 1] + 1, (Kind::Int64, data.device()))?;
        let extent = present
            .f_to_kind(Kind::Int64)?
            .f_mul(&positions)?
            .f_amax(-1, false)?;
        extents_per_dim.push(Vec::<i64>::try_from(&extent)?);
    }
    let counts = Vec::<i64>::try_from(&data.f_reshape([batch, -1])?.f_sum_dim_intlist(
        -1,
        false,
        Kind::Int64,
    )?)?;
    (0..batch as usize)
        .map(|element| {
            let extents: Vec<i64> = extents_per_dim
                .iter()
                .map(|per_dim| per_dim[element])
                .collect();
            if extents.iter().product::<i64>() == counts[element] {
                Ok(extents)
            } else {
                Err(NestedError::NonPrefixMask { element })
            }
        })
        .collect()
}
