//! Matrices as a pointer and (row, column) strides, as the GEMMs and the micro-kernel
//! take them.

/// A matrix of the row-major view as (pointer, row stride, column stride).
pub(crate) type Strided<T> = (*const T, isize, isize);

/// A matrix written through (pointer, row stride, column stride).
pub(crate) type StridedMut<T> = (*mut T, isize, isize);
