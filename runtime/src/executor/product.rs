//! A product step (a GEMM's `x W^T`, row sums `a^T b`) as the column-major BLAS call a
//! device makes ([`BlasCall`]: cuBLAS's `gemm` arguments), with the strides it reads
//! and writes, so the host device runs the same call and the translation is checked
//! without a GPU.
//!
//! A GEMM step's product `out = x W^T` over row-major buffers is, read column-major,
//! `out^T = W x^T`: the BLAS is asked for `C = op(A) B` with `A` the weight, `B` the
//! input and `C` the output, each buffer as it is (no copies).

use thiserror::Error;

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
    /// use nestor_runtime::Product;
    /// let call = Product::Linear { rows: 5, k: 3, n: 4, transposed: false }.blas_call()?;
    /// assert!(call.transpose_a && !call.transpose_b);
    /// assert_eq!((call.m, call.n, call.k), (4, 5, 3));
    /// # Ok::<(), nestor_runtime::BlasSizeError>(())
    /// ```
    pub fn blas_call(&self) -> Result<BlasCall, BlasSizeError> {
        let size = |value: i64, what: &'static str| {
            i32::try_from(value).map_err(|_| BlasSizeError {
                what,
                value,
                product: *self,
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

/// A product whose sizes do not fit a BLAS call's 32-bit integers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[error("{what} {value} does not fit a BLAS call's 32-bit sizes ({product:?})")]
pub struct BlasSizeError {
    /// Which size.
    pub what: &'static str,
    /// Its value.
    pub value: i64,
    /// The product.
    pub product: Product,
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
    fn sizes_past_32_bit_blas_integers_are_an_error() {
        let product = Product::Linear {
            rows: 1 << 31,
            k: 2,
            n: 2,
            transposed: false,
        };
        let error = product.blas_call().expect_err("2^31 rows do not fit");
        assert_eq!((error.what, error.value), ("rows", 1 << 31));
    }
}
