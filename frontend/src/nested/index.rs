//! Getting elements out: one element, a selection of elements, a slice inside every
//! element, one position of every element.

use std::ops::{Bound, Range, RangeBounds, RangeFrom, RangeFull, RangeInclusive, RangeTo};

use nestor_layout::RaggedLayout;
use tch::{Kind, Tensor};

use super::{ListElement, NestedTensor};
use crate::dense::stack_same_shape;
use crate::trace::{trace_error, Arg};
use crate::{NestedError, Result};
use nestor_ir::{Op, SliceBounds};

/// Python-style slice bounds: negative values count from the end, out-of-range bounds
/// are clamped. Built from Rust ranges of `i64` (`1..`, `..-1`, `2..5`, `..`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bounds {
    /// First position, inclusive (default 0).
    pub start: Option<i64>,
    /// Last position, exclusive (default the end).
    pub end: Option<i64>,
}

impl Bounds {
    fn from_range(range: impl RangeBounds<i64>) -> Self {
        let start = match range.start_bound() {
            Bound::Included(&start) => Some(start),
            // Past i64::MAX is past every size: clamped to the end like i64::MAX.
            Bound::Excluded(&start) => Some(start.saturating_add(1)),
            Bound::Unbounded => None,
        };
        let end = match range.end_bound() {
            // `..=-1` and `..=i64::MAX` both reach the end.
            Bound::Included(&end) => end.checked_add(1).filter(|&end| end != 0),
            Bound::Excluded(&end) => Some(end),
            Bound::Unbounded => None,
        };
        Self { start, end }
    }

    /// The concrete `start..end` these bounds select in a dim of size `size`.
    pub fn resolve(self, size: i64) -> Range<i64> {
        self.ir().resolve(size)
    }

    /// The bounds `start..end` of the IR's form (`end` [`i64::MAX`]: none).
    pub(crate) fn of(start: i64, end: i64) -> Self {
        Self {
            start: Some(start),
            end: (end != i64::MAX).then_some(end),
        }
    }

    /// These bounds in the IR's form (no end: [`i64::MAX`]).
    pub(crate) fn ir(self) -> SliceBounds {
        SliceBounds {
            start: self.start.unwrap_or(0),
            end: self.end.unwrap_or(i64::MAX),
        }
    }
}

macro_rules! bounds_from {
    ($($range:ty),*) => {$(
        impl From<$range> for Bounds {
            fn from(range: $range) -> Self {
                Bounds::from_range(range)
            }
        }
    )*};
}
bounds_from!(
    Range<i64>,
    RangeFrom<i64>,
    RangeTo<i64>,
    RangeFull,
    RangeInclusive<i64>
);

/// Which elements of a batch to keep: a range, a list of indices (negative counts from
/// the end, repeats allowed) or a bool mask with one entry per element.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BatchSelector {
    /// Python-style range of elements.
    Range(Bounds),
    /// Element indices, in the order of the result.
    Indices(Vec<i64>),
    /// Keep element `i` where `mask[i]` is true.
    Mask(Vec<bool>),
}

impl<R: Into<Bounds>> From<R> for BatchSelector {
    fn from(range: R) -> Self {
        BatchSelector::Range(range.into())
    }
}
impl From<Vec<i64>> for BatchSelector {
    fn from(indices: Vec<i64>) -> Self {
        BatchSelector::Indices(indices)
    }
}
impl From<&[i64]> for BatchSelector {
    fn from(indices: &[i64]) -> Self {
        BatchSelector::Indices(indices.to_vec())
    }
}
impl From<Vec<bool>> for BatchSelector {
    fn from(mask: Vec<bool>) -> Self {
        BatchSelector::Mask(mask)
    }
}
impl From<&[bool]> for BatchSelector {
    fn from(mask: &[bool]) -> Self {
        BatchSelector::Mask(mask.to_vec())
    }
}

impl BatchSelector {
    /// A selector read from a tensor: bool tensors are masks, integer tensors indices;
    /// other tensors are an error (as in torch: float indices would be truncated).
    pub fn from_tensor(selector: &Tensor) -> Result<Self> {
        let flat = selector.f_reshape([-1])?;
        let kind = selector.f_kind()?;
        Ok(match kind {
            Kind::Bool => BatchSelector::Mask(Vec::<bool>::try_from(&flat)?),
            Kind::Uint8 | Kind::Int8 | Kind::Int16 | Kind::Int | Kind::Int64 => {
                BatchSelector::Indices(Vec::<i64>::try_from(&flat.f_to_kind(Kind::Int64)?)?)
            }
            other => {
                return Err(NestedError::Unsupported {
                    op: "select_batch",
                    reason: format!(
                        "batch indices must be integers or bools, not a {other:?} tensor"
                    ),
                })
            }
        })
    }

    /// The selected element indices for a batch of `batch_size` elements.
    fn indices(&self, batch_size: usize) -> Result<Vec<usize>> {
        match self {
            BatchSelector::Range(bounds) => Ok(bounds
                .resolve(batch_size as i64)
                .map(|index| index as usize)
                .collect()),
            BatchSelector::Indices(indices) => indices
                .iter()
                .map(|&index| normalize_index(index, batch_size))
                .collect(),
            BatchSelector::Mask(mask) if mask.len() != batch_size => {
                Err(NestedError::SelectorLength {
                    expected: batch_size,
                    got: mask.len(),
                })
            }
            BatchSelector::Mask(mask) => Ok(mask
                .iter()
                .enumerate()
                .filter(|(_, &keep)| keep)
                .map(|(index, _)| index)
                .collect()),
        }
    }
}

fn normalize_index(index: i64, batch_size: usize) -> Result<usize> {
    let normalized = if index < 0 {
        index + batch_size as i64
    } else {
        index
    };
    if (0..batch_size as i64).contains(&normalized) {
        Ok(normalized as usize)
    } else {
        Err(NestedError::IndexOutOfRange { index, batch_size })
    }
}

impl NestedTensor {
    /// Element `index` (negative counts from the end), a view of the packed values in
    /// its logical shape.
    pub fn get(&self, index: i64) -> Result<Tensor> {
        self.concrete_read("NestedTensor::get");
        self.element(normalize_index(index, self.batch_size())?)
    }

    /// Every element, as views of the packed values in their logical shapes.
    pub fn unbind(&self) -> Result<Vec<Tensor>> {
        self.concrete_read("NestedTensor::unbind");
        self.elements()
    }

    /// Every element as views, for the library's own operators.
    pub(crate) fn elements(&self) -> Result<Vec<Tensor>> {
        (0..self.batch_size())
            .map(|element| self.element(element))
            .collect()
    }

    /// Every element as a Rust list (elements of rank 0 to 2; floats as f32 or f64,
    /// integers as i64, bools as bool).
    pub fn to_list(&self) -> Result<Vec<ListElement>> {
        self.concrete_read("NestedTensor::to_list");
        self.elements()?
            .iter()
            .enumerate()
            .map(|(element, tensor)| ListElement::from_tensor(tensor, element))
            .collect()
    }

    /// Element `element` (in range) as a view.
    pub(crate) fn element(&self, element: usize) -> Result<Tensor> {
        let layout = self.lay();
        let offsets = layout.offsets();
        let rows =
            self.packed()
                .f_narrow(0, offsets[element], offsets[element + 1] - offsets[element])?;
        let unflattened = rows.f_reshape(layout.packed_element_shape(element))?;
        Ok(unflattened.f_permute(inverse_permutation(&layout.packed_dim_order()))?)
    }

    /// The elements picked by `selector` (a range, indices or a bool mask), as a new
    /// batch with the same ragged dims. A range shares the values' storage.
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let batch = NestedTensor::from_lists(vec![vec![1, 2], vec![3], vec![4, 5, 6]])?;
    /// assert_eq!(batch.select_batch(1..)?.len(), 2);
    /// assert_eq!(batch.select_batch(vec![2, 0])?.shape(), [2, 3]);
    /// assert_eq!(batch.select_batch(vec![true, false, false])?.shape(), [1, 2]);
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    pub fn select_batch(&self, selector: impl Into<BatchSelector>) -> Result<Self> {
        self.untraceable("select_batch")?;
        let indices = selector.into().indices(self.batch_size())?;
        let layout = self.lay().select(&indices)?;
        let offsets = self.lay().offsets();
        let contiguous = indices.windows(2).all(|pair| pair[1] == pair[0] + 1);
        let values = match indices.first() {
            Some(&first) if contiguous => {
                let start = offsets[first];
                self.packed().f_narrow(0, start, layout.total_rows())?
            }
            _ => {
                let rows: Vec<i64> = indices
                    .iter()
                    .flat_map(|&element| offsets[element]..offsets[element + 1])
                    .collect();
                let rows = Tensor::f_from_slice(&rows)?.f_to_device(self.device())?;
                self.packed().f_index_select(0, &rows)?
            }
        };
        Ok(NestedTensor::from_parts(values, layout, self.options()))
    }

    /// A slice inside every element along NestedTensor dim `dim` (DanLing's
    /// `nt[:, 1:]`), with Python bounds resolved per element. The batch keeps its
    /// ragged dims. Slicing a static dim shares the values' storage; slicing a ragged
    /// dim gathers the packed rows in range (no padding, no per-element loop). Both
    /// compile with their gradients (a ragged dim where it is the elements' one ragged
    /// dim and leads; other layouts are a trace error).
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let batch = NestedTensor::from_lists(vec![vec![0, 1, 2], vec![0, 1, 2, 3, 4]])?;
    /// let tail = batch.slice(1, 1..)?;
    /// assert_eq!(Vec::<i64>::try_from(&tail.get(0)?)?, [1, 2]);
    /// assert_eq!(Vec::<i64>::try_from(&tail.get(1)?)?, [1, 2, 3, 4]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn slice(&self, dim: i64, bounds: impl Into<Bounds>) -> Result<Self> {
        let element_dim = self.element_dim(dim, "slice")?;
        let bounds = bounds.into();
        let layout = self.lay();
        if let Some(position) = layout.static_dims().iter().position(|&d| d == element_dim) {
            let range = bounds.resolve(layout.static_sizes()[position]);
            let values = self.packed().f_narrow(
                1 + position as i64,
                range.start,
                range.end - range.start,
            )?;
            let new_layout = layout.with_static_size(element_dim, range.end - range.start)?;
            let sliced = NestedTensor::from_parts(values, new_layout, self.options());
            return sliced.traced(&[Arg::Nested(self)], "slice", |ids| Op::SliceStatic {
                x: ids[0],
                dim: element_dim,
                start: range.start,
                end: range.end,
            });
        }
        if self.trace.is_some() && layout.ragged_dims() != [0] {
            return Err(trace_error(
                "slice",
                format!(
                    "a compiled slice of a ragged dim needs elements whose one ragged dim leads (dims {:?} are ragged)",
                    layout.ragged_dims()
                ),
            ));
        }
        let sliced = if self.batch_size() == 0 {
            let mut empty = self.shallow_clone();
            empty.trace = None;
            empty
        } else {
            // A ragged dim: keep the packed rows whose coordinate along it is in range.
            let (rows, new_layout) = self.ragged_slice_rows(element_dim, bounds)?;
            let rows = Tensor::f_from_slice(&rows)?.f_to_device(self.device())?;
            let values = self.packed().f_index_select(0, &rows)?;
            NestedTensor::from_parts(values, new_layout, self.options())
        };
        let bounds = bounds.ir();
        sliced.traced_with(&[Arg::Nested(self)], "slice", |graph, ids| {
            let lengths = graph.ty(ids[0]).length_values();
            let lengths = graph.slice_lengths(lengths[0], bounds)?;
            graph.push(Op::SliceRagged {
                x: ids[0],
                lengths,
                start: bounds.start,
                end: bounds.end,
            })
        })
    }

    /// The packed rows a slice `bounds` of the ragged element dim `element_dim` keeps,
    /// in order, and the layout of the slice.
    pub(crate) fn ragged_slice_rows(
        &self,
        element_dim: usize,
        bounds: Bounds,
    ) -> Result<(Vec<i64>, RaggedLayout)> {
        let layout = self.lay();
        let ranges: Vec<Range<i64>> = layout
            .element_sizes()
            .iter()
            .map(|sizes| bounds.resolve(sizes[element_dim]))
            .collect();
        let coordinates = layout.row_coordinates(element_dim);
        let owners = layout.row_elements();
        let rows: Vec<i64> = (0..layout.total_rows())
            .filter(|&row| {
                ranges[owners[row as usize] as usize].contains(&coordinates[row as usize])
            })
            .collect();
        let sizes = layout
            .element_sizes()
            .iter()
            .zip(&ranges)
            .map(|(sizes, range)| {
                let mut sizes = sizes.clone();
                sizes[element_dim] = range.end - range.start;
                sizes
            })
            .collect();
        let new_layout = RaggedLayout::from_element_sizes(sizes, layout.ragged_dims())?;
        Ok((rows, new_layout))
    }

    /// `self` with `before` zeros ahead of and `after` zeros behind its values along the
    /// static element dim `element_dim` (a static slice's gradient, for the
    /// interpreter).
    pub(crate) fn pad_static(
        &self,
        element_dim: usize,
        (before, after): (i64, i64),
    ) -> Result<Self> {
        let layout = self.lay();
        let position = layout
            .static_dims()
            .iter()
            .position(|&d| d == element_dim)
            .ok_or_else(|| NestedError::Unsupported {
                op: "pad_static",
                reason: format!("element dim {element_dim} is not static"),
            })?;
        let (axis, size) = (1 + position as i64, layout.static_sizes()[position]);
        let padded = size
            .checked_add(before)
            .and_then(|size| size.checked_add(after))
            .filter(|_| before >= 0 && after >= 0)
            .ok_or_else(|| NestedError::Unsupported {
                op: "pad_static",
                reason: format!("{before} and {after} zeros around a dim of {size}"),
            })?;
        let values = self.packed();
        let mut shape = values.size();
        shape[axis as usize] = padded;
        let out = Tensor::f_zeros(&shape, (values.kind(), values.device()))?;
        out.f_narrow(axis, before, size)?.f_copy_(values)?;
        let layout = layout.with_static_size(element_dim, padded)?;
        Ok(NestedTensor::from_parts(out, layout, self.options()))
    }

    /// Position `index` of every element along NestedTensor dim `dim` (DanLing's
    /// `nt[:, k]`), stacked into a dense `[B, ...]` tensor. Negative indices count from
    /// the end of each element. Every element must be long enough, and the remaining
    /// dims must agree across elements.
    pub fn select(&self, dim: i64, index: i64) -> Result<Tensor> {
        self.untraceable("select")?;
        let element_dim = self.element_dim(dim, "select")?;
        let picked = self
            .lay()
            .element_sizes()
            .iter()
            .enumerate()
            .map(|(element, sizes)| {
                let size = sizes[element_dim];
                let position = if index < 0 { index + size } else { index };
                if !(0..size).contains(&position) {
                    // The length that would hold the index (at most i64::MAX).
                    let needed = if index < 0 {
                        index.saturating_neg()
                    } else {
                        index.saturating_add(1)
                    };
                    return Err(NestedError::ElementTooShort {
                        element,
                        dim,
                        index,
                        size,
                        needed,
                    });
                }
                Ok(self
                    .element(element)?
                    .f_select(element_dim as i64, position)?)
            })
            .collect::<Result<Vec<_>>>()?;
        if let Some(stacked) = stack_same_shape(&picked, "select")? {
            return Ok(stacked);
        }
        let mut shape = self.lay().max_sizes();
        shape.remove(element_dim);
        shape.insert(0, 0);
        Ok(Tensor::f_empty(shape, (self.kind(), self.device()))?)
    }
}

/// The permutation that undoes `order`.
pub(crate) fn inverse_permutation(order: &[usize]) -> Vec<i64> {
    let mut inverse = vec![0i64; order.len()];
    for (position, &dim) in order.iter().enumerate() {
        inverse[dim] = position as i64;
    }
    inverse
}
