//! The host's BLAS, when the process already has one: Intel MKL, which libtorch links
//! in and exports (`sgemm_`, `dgemm_`, `MKL_Set_Num_Threads_Local`). nestor never loads
//! it: the symbols are looked up in the running process, so compiled GEMMs use the same
//! kernels as libtorch's `matmul`, and a process without MKL (the GPU check, the
//! runtime's own tests) multiplies with the `gemm` crate instead. MKL runs sequential on
//! the calling thread: the executor splits rows across its team as for every step,
//! and an OpenMP team of MKL's own would spin on the cores the pool needs.
//! `NESTOR_BLAS=builtin` forces the `gemm` crate.

use std::ffi::c_char;
use std::sync::OnceLock;

use crate::scalar::Scalar;

/// Fortran `?gemm_` (LP64): `c = alpha op(a) op(b) + beta c`, column-major, every
/// argument by pointer, then the hidden lengths of the two character arguments.
pub(crate) type GemmFn<T> = unsafe extern "C" fn(
    *const c_char,
    *const c_char,
    *const i32,
    *const i32,
    *const i32,
    *const T,
    *const T,
    *const i32,
    *const T,
    *const i32,
    *const T,
    *mut T,
    *const i32,
    usize,
    usize,
);

/// MKL's entry points, found in this process.
pub(crate) struct Mkl {
    pub(crate) sgemm: GemmFn<f32>,
    pub(crate) dgemm: GemmFn<f64>,
    /// `MKL_Set_Num_Threads_Local`: this thread's MKL thread count (0: back to the
    /// global one); returns the previous one.
    set_threads_local: unsafe extern "C" fn(i32) -> i32,
}

/// MKL, when this process has it (and `NESTOR_BLAS` does not say `builtin`).
pub(crate) fn mkl() -> Option<&'static Mkl> {
    static MKL: OnceLock<Option<Mkl>> = OnceLock::new();
    MKL.get_or_init(|| {
        if crate::process::env_is("NESTOR_BLAS", "builtin") {
            return None;
        }
        // SAFETY: these are MKL's exported C and Fortran (LP64) functions, with these
        // signatures; all three must be present, so a BLAS that only shares the name
        // `sgemm_` is not taken for MKL.
        unsafe {
            Some(Mkl {
                sgemm: crate::process::function(b"sgemm_\0")?,
                dgemm: crate::process::function(b"dgemm_\0")?,
                set_threads_local: crate::process::function(b"MKL_Set_Num_Threads_Local\0")?,
            })
        }
    })
    .as_ref()
}

/// Which library multiplies a compiled program's GEMMs in this process: `"MKL"` (the
/// process's, usually libtorch's) or `"gemm crate"` (none found, or `NESTOR_BLAS=builtin`).
pub fn gemm_library() -> &'static str {
    if mkl().is_some() {
        "MKL"
    } else {
        "gemm crate"
    }
}

/// A matrix of the row-major view as (pointer, row stride, column stride).
pub(crate) type Strided<T> = (*const T, isize, isize);

/// A matrix written through (pointer, row stride, column stride).
pub(crate) type StridedMut<T> = (*mut T, isize, isize);

/// `c = scale a b` (`c += scale a b` when `add`) for `a [m x k]`, `b [k x n]`,
/// `c [m x n]` (each as pointer, row stride, column stride; `c`'s columns contiguous)
/// with MKL on this thread. `false`
/// (nothing written) when the process has no MKL or the sizes or strides are not ones
/// BLAS takes: the caller multiplies another way.
///
/// # Safety
/// The pointers must be valid for the sizes and strides given.
pub(crate) unsafe fn matmul<T: Scalar>(
    (m, k, n): (usize, usize, usize),
    scale: T,
    a: Strided<T>,
    b: Strided<T>,
    c: StridedMut<T>,
    add: bool,
) -> bool {
    let Some(mkl) = mkl() else {
        return false;
    };
    let int = |value: usize| i32::try_from(value).ok().filter(|&value| value > 0);
    let (Some(rows), Some(inner), Some(columns)) = (int(m), int(k), int(n)) else {
        return false;
    };
    // Column-major, `c^T [n x m] = b^T a^T`: `c`'s row stride is its leading dimension.
    let Some(ldc) = leading(c.2, c.1, n) else {
        return false;
    };
    let (Some((op_b, ldb)), Some((op_a, lda))) = (operand(b, n, k), operand(a, k, m)) else {
        return false;
    };
    let beta = if add { T::ONE } else { T::ZERO };
    unsafe {
        // On this thread alone: the executor splits the work across its own threads (an
        // MKL team would spin on the cores they need).
        let previous = (mkl.set_threads_local)(1);
        T::gemm_fn(mkl)(
            &op_b, &op_a, &columns, &rows, &inner, &scale, b.0, &ldb, a.0, &lda, &beta, c.0, &ldc,
            1, 1,
        );
        (mkl.set_threads_local)(previous);
    }
    true
}

/// How BLAS reads the transpose of a row-major-view matrix `[cols x rows]` given as
/// (pointer, row stride, column stride), to get a column-major `[rows x cols]`: `N`
/// when its columns are contiguous (the transpose is stored column-major), `T` when its
/// rows are; with the leading dimension. `None` for other strides.
fn operand<T>(
    (_, row_stride, column_stride): Strided<T>,
    rows: usize,
    cols: usize,
) -> Option<(c_char, i32)> {
    if let Some(ld) = leading(column_stride, row_stride, rows) {
        Some((b'N' as c_char, ld))
    } else {
        leading(row_stride, column_stride, cols).map(|ld| (b'T' as c_char, ld))
    }
}

/// The leading dimension `stride` when `unit` is 1 and `stride` is one BLAS accepts for
/// `rows` stored rows (at least `rows`, at least 1, an `i32`).
fn leading(unit: isize, stride: isize, rows: usize) -> Option<i32> {
    let stride = usize::try_from(stride).ok()?;
    (unit == 1 && stride >= rows.max(1))
        .then(|| i32::try_from(stride).ok())
        .flatten()
}
