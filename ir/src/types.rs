//! Types of IR values: dense tensors, ragged batches whose lengths are graph values,
//! and the lengths themselves.

use std::fmt;

use crate::{DType, ValueId};

/// A dim of a dense shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    /// A size known when the graph is built.
    Static(i64),
    /// A named size known at run time (the batch size `B`).
    Sym(String),
    /// The largest of a lengths value (the padded length), known at run time.
    Max(ValueId),
}

impl Dim {
    /// The static size, if known.
    pub fn as_static(&self) -> Option<i64> {
        match self {
            Dim::Static(size) => Some(*size),
            _ => None,
        }
    }
}

/// A dim of the elements of a ragged value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ElemDim {
    /// Every element has this size.
    Fixed(Dim),
    /// Element `i` has size `lengths[i]`, where `lengths` is a `Lengths` value.
    Ragged(ValueId),
}

/// The type of an IR value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Type {
    /// A dense tensor.
    Dense {
        /// Element type.
        dtype: DType,
        /// Shape (empty for a scalar).
        shape: Vec<Dim>,
    },
    /// A ragged batch of `batch` elements of rank `dims.len()`.
    Ragged {
        /// Element type.
        dtype: DType,
        /// The batch size.
        batch: Dim,
        /// The dims of every element, ragged ones naming their lengths value.
        dims: Vec<ElemDim>,
    },
    /// Per-element lengths, an `i64[batch]` at run time.
    Lengths {
        /// The batch size.
        batch: Dim,
    },
}

impl Type {
    /// The element type, if the value holds data.
    pub fn dtype(&self) -> Option<DType> {
        match self {
            Type::Dense { dtype, .. } | Type::Ragged { dtype, .. } => Some(*dtype),
            Type::Lengths { .. } => Some(DType::I64),
        }
    }

    /// A dense type.
    pub fn dense(dtype: DType, shape: impl IntoIterator<Item = Dim>) -> Self {
        Type::Dense {
            dtype,
            shape: shape.into_iter().collect(),
        }
    }

    /// A dense type of static shape.
    pub fn dense_static(dtype: DType, shape: &[i64]) -> Self {
        Type::dense(dtype, shape.iter().map(|&size| Dim::Static(size)))
    }

    /// The same type with another element type (lengths stay lengths).
    pub fn with_dtype(&self, new: DType) -> Self {
        match self {
            Type::Dense { shape, .. } => Type::Dense {
                dtype: new,
                shape: shape.clone(),
            },
            Type::Ragged { batch, dims, .. } => Type::Ragged {
                dtype: new,
                batch: batch.clone(),
                dims: dims.clone(),
            },
            Type::Lengths { batch } => Type::Lengths {
                batch: batch.clone(),
            },
        }
    }

    /// The same type with every value it refers to (lengths, `max(%L)`) renamed by `f`.
    pub fn map_values(&self, f: impl Fn(ValueId) -> ValueId) -> Type {
        let dim = |dim: &Dim| match dim {
            Dim::Max(value) => Dim::Max(f(*value)),
            other => other.clone(),
        };
        match self {
            Type::Dense { dtype, shape } => Type::Dense {
                dtype: *dtype,
                shape: shape.iter().map(dim).collect(),
            },
            Type::Ragged { dtype, batch, dims } => Type::Ragged {
                dtype: *dtype,
                batch: dim(batch),
                dims: dims
                    .iter()
                    .map(|elem| match elem {
                        ElemDim::Ragged(value) => ElemDim::Ragged(f(*value)),
                        ElemDim::Fixed(fixed) => ElemDim::Fixed(dim(fixed)),
                    })
                    .collect(),
            },
            Type::Lengths { batch } => Type::Lengths { batch: dim(batch) },
        }
    }

    /// The lengths values a ragged type refers to, in dim order.
    pub fn length_values(&self) -> Vec<ValueId> {
        match self {
            Type::Ragged { dims, .. } => dims
                .iter()
                .filter_map(|dim| match dim {
                    ElemDim::Ragged(lengths) => Some(*lengths),
                    ElemDim::Fixed(_) => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The lengths of element dim `at` (from 0, after the batch dim) of a ragged type,
    /// where that dim is ragged.
    pub fn lengths_of_dim(&self, at: usize) -> Option<ValueId> {
        match self {
            Type::Ragged { dims, .. } => match dims.get(at) {
                Some(&ElemDim::Ragged(lengths)) => Some(lengths),
                _ => None,
            },
            _ => None,
        }
    }

    /// The sizes of a ragged type's element dims after its leading ragged ones (its
    /// packed rows' tail; -1 for a size not known statically); `None` for other types.
    pub fn ragged_tail(&self) -> Option<Vec<i64>> {
        let Type::Ragged { dims, .. } = self else {
            return None;
        };
        let size = |dim: &ElemDim| match dim {
            ElemDim::Fixed(dim) => dim.as_static().unwrap_or(-1),
            ElemDim::Ragged(_) => -1,
        };
        Some(
            dims.iter()
                .skip_while(|dim| matches!(dim, ElemDim::Ragged(_)))
                .map(size)
                .collect(),
        )
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Static(size) => write!(f, "{size}"),
            Dim::Sym(name) => f.write_str(name),
            Dim::Max(lengths) => write!(f, "max({lengths})"),
        }
    }
}

impl fmt::Display for ElemDim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ElemDim::Fixed(dim) => write!(f, "{dim}"),
            ElemDim::Ragged(lengths) => write!(f, "{lengths}"),
        }
    }
}

fn join<T: fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Dense { dtype, shape } => write!(f, "{dtype}[{}]", join(shape)),
            Type::Ragged { dtype, batch, dims } => {
                write!(f, "ragged<{dtype}>[{batch}; {}]", join(dims))
            }
            Type::Lengths { batch } => write!(f, "lengths[{batch}]"),
        }
    }
}
