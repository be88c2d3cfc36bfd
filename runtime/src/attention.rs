//! Varlen attention on the host as two GEMMs per element and head (`S = Q K^T`,
//! `O = softmax(S) V`) with a row softmax in between: packed (no padding between
//! elements), and the GEMM library's microkernels do the arithmetic.

use nestor_passes::Access;
use rayon::prelude::*;

use crate::scalar::Scalar;

/// The shape of one attention step.
pub(crate) struct Attention<'a> {
    pub q: &'a Access,
    pub k: &'a Access,
    pub v: &'a Access,
    pub heads: i64,
    pub head_dim: i64,
    pub value_dim: i64,
    pub causal: bool,
    pub scale: f64,
    /// Spread the (element, head) tasks over rayon's pool.
    pub parallel: bool,
}

/// Pointers shared by the parallel tasks; each task writes its own rows and head
/// columns of `out`.
#[derive(Clone, Copy)]
struct Buffers<T> {
    out: *mut T,
    q: *const T,
    k: *const T,
    v: *const T,
}
unsafe impl<T> Send for Buffers<T> {}
unsafe impl<T> Sync for Buffers<T> {}

impl Attention<'_> {
    /// Runs the step on buffers of `T` (out, q, k, v). `out` holds
    /// `sum(Lq) x heads*value_dim` values; the inputs are sized for the offsets (the
    /// executor checked them).
    ///
    /// # Safety
    /// The pointers must be valid for the sizes the offsets and accesses imply.
    pub(crate) unsafe fn run<T: Scalar>(
        &self,
        (out, q, k, v): (*mut u8, *mut u8, *mut u8, *mut u8),
        (q_offsets, k_offsets): (&[i64], &[i64]),
    ) {
        let buffers = Buffers {
            out: out as *mut T,
            q: q as *const T,
            k: k as *const T,
            v: v as *const T,
        };
        let elements = q_offsets.len().saturating_sub(1);
        let tasks: Vec<(usize, i64)> = (0..elements)
            .flat_map(|e| (0..self.heads).map(move |h| (e, h)))
            .collect();
        let task = |(element, head): (usize, i64)| {
            let (q_first, q_rows) = (
                q_offsets[element],
                q_offsets[element + 1] - q_offsets[element],
            );
            let (k_first, k_rows) = (
                k_offsets[element],
                k_offsets[element + 1] - k_offsets[element],
            );
            // The task's rows and columns are in range of buffers the executor sized.
            unsafe { self.element(buffers, head, q_first, q_rows, k_first, k_rows) };
        };
        if self.parallel {
            tasks.into_par_iter().for_each(task);
        } else {
            tasks.into_iter().for_each(task);
        }
    }

    #[allow(clippy::too_many_arguments)]
    unsafe fn element<T: Scalar>(
        &self,
        buffers: Buffers<T>,
        head: i64,
        q_first: i64,
        q_rows: i64,
        k_first: i64,
        k_rows: i64,
    ) {
        if q_rows == 0 {
            return;
        }
        let (d, dv) = (self.head_dim, self.value_dim);
        let out_width = self.heads * dv;
        let mut scores = vec![T::ZERO; (q_rows * k_rows.max(1)) as usize];
        unsafe {
            let q = buffers
                .q
                .offset((q_first * self.q.row_stride + self.q.offset + head * d) as isize);
            let k = buffers
                .k
                .offset((k_first * self.k.row_stride + self.k.offset + head * d) as isize);
            let v = buffers
                .v
                .offset((k_first * self.v.row_stride + self.v.offset + head * dv) as isize);
            let out = buffers
                .out
                .offset((q_first * out_width + head * dv) as isize);
            if k_rows > 0 {
                // S[q_rows, k_rows] = scale * Q K^T.
                T::matmul(
                    (q_rows as usize, d as usize, k_rows as usize),
                    T::from_f64(self.scale),
                    (q, self.q.row_stride as isize, 1),
                    (k, 1, self.k.row_stride as isize),
                    (scores.as_mut_ptr(), k_rows as isize, 1),
                );
            }
            // Each row's softmax denominator: the output rows are divided by it after the
            // second GEMM (dv values per row rather than k_rows scores).
            let mut totals = vec![T::ONE; q_rows as usize];
            for ((row, scores), total) in scores
                .chunks_mut(k_rows.max(1) as usize)
                .enumerate()
                .zip(&mut totals)
            {
                let limit = if self.causal {
                    (row + 1).min(k_rows as usize)
                } else {
                    k_rows as usize
                };
                *total = T::softmax_numerators(&mut scores[..limit]);
                for score in &mut scores[limit..] {
                    *score = T::ZERO;
                }
            }
            if k_rows == 0 {
                // No keys: torch gives NaN.
                for row in 0..q_rows {
                    for column in 0..dv {
                        *out.offset((row * out_width + column) as isize) = T::NAN;
                    }
                }
                return;
            }
            // O[q_rows, dv] = P V.
            T::matmul(
                (q_rows as usize, k_rows as usize, dv as usize),
                T::ONE,
                (scores.as_ptr(), k_rows as isize, 1),
                (v, self.v.row_stride as isize, 1),
                (out, out_width as isize, 1),
            );
            for (row, &total) in totals.iter().enumerate() {
                let row = std::slice::from_raw_parts_mut(
                    out.offset(row as isize * out_width as isize),
                    dv as usize,
                );
                let inverse = T::ONE / total;
                for value in row {
                    *value = *value * inverse;
                }
            }
        }
    }
}
