//! GEMM products on cuBLAS (libcublas loaded at run time, as libcuda is). The
//! column-major call a product becomes ([`BlasCall`]) also tells its strides, so the
//! host device runs the same call and the translation is checked without a GPU.
//!
//! A GEMM step's product `out = x W^T` over row-major buffers is, read column-major,
//! `out^T = W x^T`: cuBLAS is asked for `C = op(A) B` with `A` the weight, `B` the input
//! and `C` the output, each buffer as it is (no copies).

use std::ffi::c_void;

use cudarc::cublas::{result, sys, CudaBlas};

use crate::{CudaError, Device, Storage};

/// A product over row-major buffers that a BLAS call computes in place of a step's
/// kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Product {
    /// A GEMM step's `out = x W^T` (`x W` when `transposed`): `x [rows, k]`, the weight
    /// `[n, k]` (`[k, n]`), `out [rows, n]`. The call's `[A, B, C]` are the weight, `x`
    /// and `out`.
    Linear {
        /// Rows of `x` and `out`.
        rows: i64,
        /// Inner size.
        k: i64,
        /// Columns of `out`.
        n: i64,
        /// The weight is `[k, n]`.
        transposed: bool,
    },
    /// A row-sums step's `out [m, n] = a^T b` over the rows of `a [rows, m]` and
    /// `b [rows, n]` (weight gradients). The call's `[A, B, C]` are `b`, `a` and `out`.
    RowSums {
        /// Rows summed over.
        rows: i64,
        /// Columns of `a`.
        m: i64,
        /// Columns of `b`.
        n: i64,
    },
}

/// A column-major BLAS call `C = op(A) op(B)` (`C` is `m x n`, `op(A)` `m x k`, `op(B)`
/// `k x n`; `op(X) = X^T` when it is transposed), with its leading dimensions: cuBLAS's
/// `gemm` arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlasCall {
    /// `op(A) = A^T`.
    pub transpose_a: bool,
    /// `op(B) = B^T`.
    pub transpose_b: bool,
    /// Rows of `C`.
    pub m: i32,
    /// Columns of `C`.
    pub n: i32,
    /// Inner size.
    pub k: i32,
    /// Leading dimension of `A`.
    pub lda: i32,
    /// Leading dimension of `B`.
    pub ldb: i32,
    /// Leading dimension of `C`.
    pub ldc: i32,
}

impl Product {
    /// The column-major call computing this product (row-major buffers read as the
    /// transposes they are column-major); an error when a size does not fit cuBLAS's
    /// 32-bit integers.
    ///
    /// ```
    /// use nestor_backend_cuda::blas::Product;
    /// let call = Product::Linear { rows: 5, k: 3, n: 4, transposed: false }.blas_call()?;
    /// assert!(call.transpose_a && !call.transpose_b);
    /// assert_eq!((call.m, call.n, call.k), (4, 5, 3));
    /// # Ok::<(), nestor_backend_cuda::CudaError>(())
    /// ```
    pub fn blas_call(&self) -> Result<BlasCall, CudaError> {
        let size = |value: i64, what: &str| {
            i32::try_from(value).map_err(|_| {
                CudaError::Blas(format!(
                    "{what} {value} does not fit cuBLAS's 32-bit sizes ({self:?})"
                ))
            })
        };
        // Leading dimensions of at least 1, as BLAS requires even for empty matrices.
        Ok(match *self {
            Product::Linear {
                rows,
                k,
                n,
                transposed,
            } => {
                let (rows, k, n) = (size(rows, "rows")?, size(k, "k")?, size(n, "n")?);
                // `out^T = W x^T`: row-major W [n, k] is column-major k x n (A^T is the
                // n x k needed); W [k, n] is column-major n x k already.
                BlasCall {
                    transpose_a: !transposed,
                    transpose_b: false,
                    m: n,
                    n: rows,
                    k,
                    lda: if transposed { n } else { k }.max(1),
                    ldb: k.max(1),
                    ldc: n.max(1),
                }
            }
            Product::RowSums { rows, m, n } => {
                let (rows, m, n) = (size(rows, "rows")?, size(m, "m")?, size(n, "n")?);
                // `out^T = b^T a`: row-major b [rows, n] is column-major n x rows, and
                // a [rows, m] column-major m x rows (transposed: rows x m).
                BlasCall {
                    transpose_a: false,
                    transpose_b: true,
                    m: n,
                    n: m,
                    k: rows,
                    lda: n.max(1),
                    ldb: m.max(1),
                    ldc: n.max(1),
                }
            }
        })
    }
}

impl BlasCall {
    /// Values each buffer must hold: `[A, B, C]`.
    pub fn lengths(&self) -> [usize; 3] {
        let count = |value: i32| usize::try_from(value).unwrap_or(0);
        let (m, n, k) = (count(self.m), count(self.n), count(self.k));
        let (lda, ldb, ldc) = (count(self.lda), count(self.ldb), count(self.ldc));
        // Column-major: the last column starts `ld * (columns - 1)` in.
        let span = |ld: usize, rows: usize, columns: usize| {
            if rows == 0 || columns == 0 {
                0
            } else {
                ld * (columns - 1) + rows
            }
        };
        let a = if self.transpose_a {
            span(lda, k, m)
        } else {
            span(lda, m, k)
        };
        let b = if self.transpose_b {
            span(ldb, n, k)
        } else {
            span(ldb, k, n)
        };
        [a, b, span(ldc, m, n)]
    }

    /// How the call reads and writes its matrices, as cuBLAS does: the (row, column)
    /// strides in values of `op(A)` (`m x k`), `op(B)` (`k x n`) and `C` (`m x n`).
    pub fn strides(&self) -> [(isize, isize); 3] {
        let operand = |ld: i32, transposed: bool| {
            if transposed {
                (ld as isize, 1)
            } else {
                (1, ld as isize)
            }
        };
        [
            operand(self.lda, self.transpose_a),
            operand(self.ldb, self.transpose_b),
            (1, self.ldc as isize),
        ]
    }
}

/// The cuBLAS functions nestor calls (cudarc panics on a missing one, so they are
/// looked for first).
pub const BLAS_SYMBOLS: [&str; 4] = [
    "cublasCreate_v2",
    "cublasDestroy_v2",
    "cublasSetStream_v2",
    "cublasGemmEx",
];

/// The first of [`BLAS_SYMBOLS`] that `library` lacks.
pub fn missing_symbol(library: &libloading::Library) -> Option<&'static str> {
    BLAS_SYMBOLS.into_iter().find(|name| {
        // SAFETY: the symbol is only looked up, never called or read.
        unsafe { library.get::<*const c_void>(name.as_bytes()) }.is_err()
    })
}

/// cuBLAS on a device's stream: GEMM products ordered with the device's kernels.
pub struct Blas {
    blas: CudaBlas,
}

impl Blas {
    /// cuBLAS for `device`: [`CudaError::NoBlas`] when libcublas cannot be loaded (it is
    /// looked for under its usual names on the library path) or lacks a function nestor
    /// calls.
    pub fn new(device: &Device) -> Result<Blas, CudaError> {
        // SAFETY: loading libcublas runs its initializers, as cudarc's own loading would.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::NoBlas(
                "libcublas cannot be loaded (add its folder to LD_LIBRARY_PATH)".to_owned(),
            ));
        }
        // SAFETY: as above; present, so cudarc's loading does not panic.
        if let Some(name) = missing_symbol(unsafe { sys::culib() }) {
            return Err(CudaError::NoBlas(format!("libcublas has no {name}")));
        }
        let blas = CudaBlas::new(device.stream().clone())
            .map_err(|error| CudaError::Blas(error.to_string()))?;
        Ok(Blas { blas })
    }

    /// Runs `call` on the device's stream (cuBLAS's GemmEx): `c = op(a) op(b)` over
    /// buffers of f32, or of bf16 (`storage`), with f32 arithmetic.
    ///
    /// # Safety
    /// `[a, b, c]` must be device buffers of the blas's device holding
    /// [`BlasCall::lengths`] values of the storage type, alive until the work is done.
    pub unsafe fn run(
        &self,
        call: &BlasCall,
        [a, b, c]: [u64; 3],
        storage: Storage,
    ) -> Result<(), CudaError> {
        if call.m == 0 || call.n == 0 {
            return Ok(());
        }
        let operation = |transposed: bool| {
            if transposed {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (transpose_a, transpose_b) = (operation(call.transpose_a), operation(call.transpose_b));
        let (alpha, beta) = (1.0f32, 0.0f32);
        // f32 arithmetic either way (no TF32, as torch's default for f32 matmuls).
        let values = match storage {
            Storage::Compute => sys::cudaDataType::CUDA_R_32F,
            Storage::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        };
        // SAFETY: the caller vouches for the buffers; the sizes are the call's.
        let outcome = unsafe {
            result::gemm_ex(
                *self.blas.handle(),
                transpose_a,
                transpose_b,
                call.m,
                call.n,
                call.k,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                values,
                call.lda,
                b as *const c_void,
                values,
                call.ldb,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                values,
                call.ldc,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        outcome.map_err(|error| CudaError::Blas(format!("{error:?} for {call:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `x W^T` (or `x W`) the plain row-major way.
    fn linear(rows: usize, k: usize, n: usize, transposed: bool, x: &[f32], w: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0f32; rows * n];
        for r in 0..rows {
            for j in 0..n {
                out[r * n + j] = (0..k)
                    .map(|c| {
                        let w = if transposed {
                            w[c * n + j]
                        } else {
                            w[j * k + c]
                        };
                        x[r * k + c] * w
                    })
                    .sum();
            }
        }
        out
    }

    /// `a^T b` the plain row-major way.
    fn row_sums(rows: usize, m: usize, n: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..rows).map(|r| a[r * m + i] * b[r * n + j]).sum();
            }
        }
        out
    }

    /// Values `0..count` of a fixed sequence.
    fn values(count: i64, seed: usize) -> Vec<f32> {
        (0..count as usize)
            .map(|i| ((i * 7 + seed) % 11) as f32 * 0.25 - 1.25)
            .collect()
    }

    /// `c = op(a) op(b)` read through the call's strides, summed in order.
    fn run_on_host(call: &BlasCall, a: &[f32], b: &[f32], c: &mut [f32]) {
        let [(a_row, a_column), (b_row, b_column), (c_row, c_column)] = call.strides();
        for i in 0..call.m as isize {
            for j in 0..call.n as isize {
                let sum = (0..call.k as isize)
                    .map(|l| {
                        a[(i * a_row + l * a_column) as usize]
                            * b[(l * b_row + j * b_column) as usize]
                    })
                    .sum();
                c[(i * c_row + j * c_column) as usize] = sum;
            }
        }
    }

    #[test]
    fn the_blas_call_computes_the_row_major_product() {
        for (rows, k, n) in [(5, 3, 4), (1, 1, 1), (0, 3, 2), (3, 0, 2), (7, 16, 1)] {
            for transposed in [false, true] {
                let product = Product::Linear {
                    rows,
                    k,
                    n,
                    transposed,
                };
                let (x, weight) = (values(rows * k, 1), values(k * n, 2));
                let call = product.blas_call().unwrap();
                let [a, b, c] = call.lengths();
                assert!(a <= weight.len() && b <= x.len(), "{product:?}: {call:?}");
                assert_eq!(c, (rows * n) as usize, "{product:?}: {call:?}");
                let mut out = vec![f32::NAN; (rows * n) as usize];
                run_on_host(&call, &weight, &x, &mut out);
                let (rows, k, n) = (rows as usize, k as usize, n as usize);
                assert_eq!(
                    out,
                    linear(rows, k, n, transposed, &x, &weight),
                    "{product:?}"
                );
            }
        }
    }

    #[test]
    fn the_blas_call_computes_row_sums() {
        for (rows, m, n) in [(5, 3, 4), (1, 1, 1), (0, 3, 2), (6, 1, 5), (2, 7, 3)] {
            let product = Product::RowSums { rows, m, n };
            let (a, b) = (values(rows * m, 3), values(rows * n, 4));
            let call = product.blas_call().unwrap();
            let [a_len, b_len, c_len] = call.lengths();
            assert!(
                a_len <= b.len() && b_len <= a.len(),
                "{product:?}: {call:?}"
            );
            assert_eq!(c_len, (m * n) as usize, "{product:?}: {call:?}");
            let mut out = vec![f32::NAN; (m * n) as usize];
            run_on_host(&call, &b, &a, &mut out);
            let (rows, m, n) = (rows as usize, m as usize, n as usize);
            assert_eq!(out, row_sums(rows, m, n, &a, &b), "{product:?}");
        }
    }

    #[test]
    fn the_venvs_cublas_has_every_function_nestor_calls() {
        // The torch venv's CUDA libraries (a GPU machine's come with its torch or CUDA).
        let torch = std::env::var_os("LIBTORCH").expect("LIBTORCH is set by scripts/env.sh");
        let path = std::path::Path::new(&torch).join("../nvidia/cu13/lib/libcublas.so.13");
        // SAFETY: loading runs the library's initializers; nothing is called.
        let library = unsafe { libloading::Library::new(&path) }
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        assert_eq!(missing_symbol(&library), None);
        // A library without them says which it lacks.
        let libc = unsafe { libloading::Library::new("libc.so.6") }.unwrap();
        assert_eq!(missing_symbol(&libc), Some("cublasCreate_v2"));
    }

    #[test]
    fn sizes_past_cublas_integers_are_an_error() {
        let product = Product::Linear {
            rows: 1 << 31,
            k: 2,
            n: 2,
            transposed: false,
        };
        assert!(matches!(product.blas_call(), Err(CudaError::Blas(_))));
    }
}
