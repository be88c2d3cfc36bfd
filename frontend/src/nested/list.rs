//! Elements given as Rust lists: scalars, vectors and matrices of f32, f64, i64, bool.

use tch::{Kind, Tensor};

use crate::{NestedError, Result};

/// One element given as Rust data, for [`NestedTensor::from_lists`](super::NestedTensor::from_lists)
/// and returned by [`NestedTensor::to_list`](super::NestedTensor::to_list).
///
/// Built with `From` from a scalar, a `Vec` or a `Vec<Vec<_>>` of `f32`, `f64`, `i64`
/// or `bool`. Elements of different types in one batch are promoted as torch does
/// (bool < i64 < f32 < f64).
#[derive(Clone, Debug, PartialEq)]
pub enum ListElement {
    /// Single-precision floats.
    F32(ListData<f32>),
    /// Double-precision floats.
    F64(ListData<f64>),
    /// 64-bit integers.
    I64(ListData<i64>),
    /// Booleans.
    Bool(ListData<bool>),
}

/// The shape of a [`ListElement`]: a 0-d, 1-d or 2-d array.
#[derive(Clone, Debug, PartialEq)]
pub enum ListData<T> {
    /// A 0-d element.
    Scalar(T),
    /// A 1-d element.
    Vector(Vec<T>),
    /// A 2-d element, row by row; every row must have the same length.
    Matrix(Vec<Vec<T>>),
}

impl<T: Copy> ListData<T> {
    /// The values in row-major order and the shape, checking that rows agree.
    fn flatten(&self, element: usize) -> Result<(Vec<T>, Vec<i64>)> {
        Ok(match self {
            ListData::Scalar(value) => (vec![*value], vec![]),
            ListData::Vector(values) => (values.clone(), vec![values.len() as i64]),
            ListData::Matrix(rows) => {
                let width = rows.first().map_or(0, Vec::len);
                if let Some((row, values)) = rows.iter().enumerate().find(|(_, r)| r.len() != width)
                {
                    return Err(NestedError::InvalidList {
                        element,
                        reason: format!(
                            "row {row} has {} values, expected {width} (the length of row 0)",
                            values.len()
                        ),
                    });
                }
                (rows.concat(), vec![rows.len() as i64, width as i64])
            }
        })
    }

    /// Reads `values` (row-major) back into the given shape of rank 0, 1 or 2.
    fn unflatten(values: Vec<T>, shape: &[i64]) -> Option<Self> {
        match shape {
            [] => values.first().copied().map(ListData::Scalar),
            [_] => Some(ListData::Vector(values)),
            [_, width] => {
                let width = *width as usize;
                if width == 0 {
                    return Some(ListData::Matrix(vec![Vec::new(); shape[0] as usize]));
                }
                Some(ListData::Matrix(
                    values.chunks(width).map(<[T]>::to_vec).collect(),
                ))
            }
            _ => None,
        }
    }
}

macro_rules! list_element_from {
    ($type:ty, $variant:ident) => {
        impl From<$type> for ListElement {
            fn from(value: $type) -> Self {
                ListElement::$variant(ListData::Scalar(value))
            }
        }
        impl From<Vec<$type>> for ListElement {
            fn from(values: Vec<$type>) -> Self {
                ListElement::$variant(ListData::Vector(values))
            }
        }
        impl From<&[$type]> for ListElement {
            fn from(values: &[$type]) -> Self {
                ListElement::$variant(ListData::Vector(values.to_vec()))
            }
        }
        impl From<Vec<Vec<$type>>> for ListElement {
            fn from(rows: Vec<Vec<$type>>) -> Self {
                ListElement::$variant(ListData::Matrix(rows))
            }
        }
    };
}

list_element_from!(f32, F32);
list_element_from!(f64, F64);
list_element_from!(i64, I64);
list_element_from!(bool, Bool);

impl ListElement {
    /// The element as a CPU tensor; `element` is its index, for errors.
    pub(crate) fn to_tensor(&self, element: usize) -> Result<Tensor> {
        fn build<T: tch::kind::Element + Copy>(
            data: &ListData<T>,
            element: usize,
        ) -> Result<Tensor> {
            let (values, shape) = data.flatten(element)?;
            Ok(Tensor::f_from_slice(&values)?.f_reshape(&shape)?)
        }
        match self {
            ListElement::F32(data) => build(data, element),
            ListElement::F64(data) => build(data, element),
            ListElement::I64(data) => build(data, element),
            ListElement::Bool(data) => build(data, element),
        }
    }

    /// A tensor of rank 0 to 2 read back as a list: floats of 32 bits or less as f32,
    /// f64 as f64, integers as i64, bool as bool.
    pub(crate) fn from_tensor(tensor: &Tensor, element: usize) -> Result<Self> {
        fn read<T: tch::kind::Element + Copy>(
            tensor: &Tensor,
            kind: Kind,
            element: usize,
        ) -> Result<ListData<T>> {
            let shape = tensor.size();
            let flat = tensor
                .f_to_kind(kind)?
                .f_to_device(tch::Device::Cpu)?
                .f_reshape([-1])?;
            let values = Vec::<T>::try_from(&flat)?;
            ListData::unflatten(values, &shape).ok_or_else(|| NestedError::InvalidList {
                element,
                reason: format!(
                    "a list holds elements of rank 0 to 2, this one has shape {shape:?}"
                ),
            })
        }
        Ok(match tensor.f_kind()? {
            Kind::Double => ListElement::F64(read(tensor, Kind::Double, element)?),
            Kind::Bool => ListElement::Bool(read(tensor, Kind::Bool, element)?),
            kind if crate::dtype_of(kind).is_some_and(nestor_ir::DType::is_float) => {
                ListElement::F32(read(tensor, Kind::Float, element)?)
            }
            _ => ListElement::I64(read(tensor, Kind::Int64, element)?),
        })
    }
}
