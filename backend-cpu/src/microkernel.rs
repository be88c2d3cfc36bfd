//! Small f32 matrix products in AVX2 + FMA registers, for attention's tiles.
//!
//! Attention multiplies many small matrices (a tile of up to 128 query rows by one
//! element's keys, over a head of 64): MKL packs both operands on every such call and
//! reached about 75 useful GFLOP/s on them on a Zen 3 host, half of what it reaches on
//! the model's large GEMMs. Here `b` is copied once into a panel of 16-column blocks
//! (`k x 16` each, in L1) and every block of 6 rows of `a` is read in place (at any
//! strides: the gradient's `dS^T` too) and multiplied into 12 accumulator registers. Used where the host has AVX2 and FMA but
//! not AVX-512 (there the GEMM library's AVX-512 kernels are twice as wide: on a Zen 5
//! host attention took 2.4-2.5 ms per call with this kernel, 1.9-2.1 ms with the `gemm`
//! crate); f64 and other hosts keep [`crate::blas::Gemm::matmul`].

use std::cell::RefCell;

use crate::strided::{Strided, StridedMut};

/// Rows of `a` per register block.
const ROWS: usize = 6;
/// Columns of `b` per register block (two 8-lane vectors).
const COLUMNS: usize = 16;

/// Whether this host can run the micro-kernel (AVX2 and FMA).
fn supported() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether attention takes the micro-kernel on this host: it can run it and has no
/// AVX-512, whose GEMM kernels beat it (decided once per process).
fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            supported() && !std::is_x86_feature_detected!("avx512f")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

thread_local! {
    /// Each thread's panel of `b` (reused: attention calls this twice per task).
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `c = scale * a b` for `a [m x k]`, `b [k x n]`, `c [m x n]` (pointer, row stride,
/// column stride each) in AVX2 registers. `false` (nothing written) when the host or the
/// operands do not suit it: `c` needs contiguous columns, and `k` at least 1.
///
/// # Safety
/// The pointers must be valid for the sizes and strides given.
pub(crate) unsafe fn matmul(
    shape: (usize, usize, usize),
    scale: f32,
    a: Strided<f32>,
    b: Strided<f32>,
    c: StridedMut<f32>,
) -> bool {
    // SAFETY: as the caller vouches.
    available() && unsafe { matmul_where_supported(shape, scale, a, b, c) }
}

/// [`matmul`] on any host that can run it ([`supported`]), taken by attention or not
/// (the tests run it on every such host).
///
/// # Safety
/// As [`matmul`].
unsafe fn matmul_where_supported(
    (m, k, n): (usize, usize, usize),
    scale: f32,
    a: Strided<f32>,
    b: Strided<f32>,
    c: StridedMut<f32>,
) -> bool {
    if !supported() || c.2 != 1 || m == 0 || n == 0 || k == 0 {
        return false;
    }
    let blocks = n.div_ceil(COLUMNS);
    let Some(panel_len) = blocks
        .checked_mul(COLUMNS)
        .and_then(|width| width.checked_mul(k))
    else {
        return false;
    };
    PANEL.with(|panel| {
        let Ok(mut panel) = panel.try_borrow_mut() else {
            // Re-entered on this thread (it is not): let the caller multiply.
            return false;
        };
        if panel.len() < panel_len {
            panel.resize(panel_len, 0.0);
        }
        let panel = &mut panel[..panel_len];
        // SAFETY: the caller vouches for `b`'s `k x n` values; the panel holds
        // `blocks * k * 16` values.
        unsafe { pack(panel, b, (k, n)) };
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `supported` checked AVX2 and FMA; the caller vouches for `a` and `c`.
        unsafe {
            multiply(panel, (m, k, n), scale, a, (c.0, c.1))
        };
        true
    })
}

/// Copies `b [k x n]` into `panel` as `n / 16` blocks (rounded up) of `k` rows of 16
/// values, zeros past column `n`. Reads along `b`'s contiguous dim where it has one (the
/// keys' rows, read as `K^T`, or the values' rows).
///
/// # Safety
/// `b` must be valid for `k x n` values at its strides; `panel` holds `blocks * k * 16`.
unsafe fn pack(
    panel: &mut [f32],
    (b, row_stride, column_stride): Strided<f32>,
    (k, n): (usize, usize),
) {
    for (block, values) in panel.chunks_exact_mut(k * COLUMNS).enumerate() {
        let first = block * COLUMNS;
        let width = COLUMNS.min(n - first);
        if width < COLUMNS {
            values.fill(0.0);
        }
        if row_stride == 1 {
            // `K^T`: eight columns by eight rows at a time transposed in registers, each
            // column contiguous in `b`; the rest column by column.
            let (columns8, rows8) = (width / 8 * 8, k / 8 * 8);
            #[cfg(target_arch = "x86_64")]
            for column in (0..columns8).step_by(8) {
                for row in (0..rows8).step_by(8) {
                    // SAFETY: `pack` runs only on AVX2 hosts (`supported` checked); columns
                    // `first + column..+8` < n hold rows `row..row + 8` < k.
                    unsafe {
                        transpose_8x8(
                            b.offset((first + column) as isize * column_stride + row as isize),
                            column_stride,
                            values[row * COLUMNS + column..].as_mut_ptr(),
                        )
                    };
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let (columns8, rows8) = (0, 0);
            for column in 0..width {
                let rows_done = if column < columns8 { rows8 } else { 0 };
                // SAFETY: column `first + column` < n holds k values at stride 1.
                let source = unsafe {
                    std::slice::from_raw_parts(
                        b.offset((first + column) as isize * column_stride),
                        k,
                    )
                };
                for (row, &value) in source.iter().enumerate().skip(rows_done) {
                    values[row * COLUMNS + column] = value;
                }
            }
        } else {
            for (row, values) in values.chunks_exact_mut(COLUMNS).enumerate() {
                let start = row as isize * row_stride + first as isize * column_stride;
                if column_stride == 1 {
                    // SAFETY: row < k holds columns `first..first + width` contiguous.
                    let source = unsafe { std::slice::from_raw_parts(b.offset(start), width) };
                    values[..width].copy_from_slice(source);
                } else {
                    for (column, value) in values[..width].iter_mut().enumerate() {
                        // SAFETY: row < k and first + column < n.
                        *value = unsafe { *b.offset(start + column as isize * column_stride) };
                    }
                }
            }
        }
    }
}

/// Writes the 8 x 8 block at `source` (8 columns `column_stride` apart, each 8
/// contiguous rows) transposed into `target`'s 8 rows, [`COLUMNS`] apart.
///
/// # Safety
/// AVX; `source` valid for the 8 x 8 values, `target` for 8 rows of 8.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose_8x8(source: *const f32, column_stride: isize, target: *mut f32) {
    use std::arch::x86_64::*;
    // SAFETY: as the caller vouches.
    unsafe {
        let c: [__m256; 8] =
            std::array::from_fn(|i| _mm256_loadu_ps(source.offset(i as isize * column_stride)));
        // Pairs, then quads of columns interleaved within each 128-bit half, then halves.
        let t0 = _mm256_unpacklo_ps(c[0], c[1]);
        let t1 = _mm256_unpackhi_ps(c[0], c[1]);
        let t2 = _mm256_unpacklo_ps(c[2], c[3]);
        let t3 = _mm256_unpackhi_ps(c[2], c[3]);
        let t4 = _mm256_unpacklo_ps(c[4], c[5]);
        let t5 = _mm256_unpackhi_ps(c[4], c[5]);
        let t6 = _mm256_unpacklo_ps(c[6], c[7]);
        let t7 = _mm256_unpackhi_ps(c[6], c[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        let rows = [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ];
        for (i, row) in rows.into_iter().enumerate() {
            _mm256_storeu_ps(target.add(i * COLUMNS), row);
        }
    }
}

/// `c = scale * a panel` in blocks of 6 rows x 16 columns.
///
/// # Safety
/// AVX2 and FMA; `a` valid for `m x k` values at its strides,
/// `c` for `m x n` at row stride `c.1`, `panel` packed by [`pack`] for `k x n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn multiply(
    panel: &[f32],
    (m, k, n): (usize, usize, usize),
    scale: f32,
    a: Strided<f32>,
    c: (*mut f32, isize),
) {
    for (block, panel) in panel.chunks_exact(k * COLUMNS).enumerate() {
        let first = block * COLUMNS;
        let width = COLUMNS.min(n - first);
        for row in (0..m).step_by(ROWS) {
            // SAFETY: rows `row..row + ROWS.min(m - row)` of `a` and `c` are in range.
            unsafe {
                let rows_a = (a.0.offset(row as isize * a.1), a.1, a.2);
                let rows_c = (c.0.offset(row as isize * c.1 + first as isize), c.1);
                let tile = (panel, k, scale, rows_a, rows_c, width);
                match m - row {
                    1 => block_of::<1>(tile),
                    2 => block_of::<2>(tile),
                    3 => block_of::<3>(tile),
                    4 => block_of::<4>(tile),
                    5 => block_of::<5>(tile),
                    _ => block_of::<ROWS>(tile),
                }
            }
        }
    }
}

/// One tile of `R` rows x 16 columns: `(panel block, k, scale, (a, a's row and column
/// strides), (c, c's row stride), columns of c to write)`.
#[cfg(target_arch = "x86_64")]
type Tile<'a> = (
    &'a [f32],
    usize,
    f32,
    Strided<f32>,
    (*mut f32, isize),
    usize,
);

/// `R` rows of `a` times one 16-column block of the panel, into `R x width` of `c`.
///
/// # Safety
/// AVX2 and FMA; as [`multiply`], for `R` rows.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_of<const R: usize>(
    (panel, k, scale, (a, a_row, a_column), (c, c_row), width): Tile<'_>,
) {
    use std::arch::x86_64::*;
    // SAFETY: the panel holds k rows of 16 values; `a` holds R rows of k values.
    unsafe {
        let mut sums = [[_mm256_setzero_ps(); 2]; R];
        let values = panel.as_ptr();
        for p in 0..k {
            let low = _mm256_loadu_ps(values.add(p * COLUMNS));
            let high = _mm256_loadu_ps(values.add(p * COLUMNS + 8));
            let column = a.offset(p as isize * a_column);
            for (r, sum) in sums.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*column.offset(r as isize * a_row));
                sum[0] = _mm256_fmadd_ps(x, low, sum[0]);
                sum[1] = _mm256_fmadd_ps(x, high, sum[1]);
            }
        }
        let scale = _mm256_set1_ps(scale);
        for (r, sum) in sums.iter().enumerate() {
            let out = c.offset(r as isize * c_row);
            let low = _mm256_mul_ps(sum[0], scale);
            let high = _mm256_mul_ps(sum[1], scale);
            if width == COLUMNS {
                _mm256_storeu_ps(out, low);
                _mm256_storeu_ps(out.add(8), high);
            } else {
                let mut row = [0.0f32; COLUMNS];
                _mm256_storeu_ps(row.as_mut_ptr(), low);
                _mm256_storeu_ps(row.as_mut_ptr().add(8), high);
                std::ptr::copy_nonoverlapping(row.as_ptr(), out, width);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix's values and its (row, column) strides.
    type Values<'a> = (&'a [f32], (usize, usize));

    /// `c = scale a b` by definition, in f64.
    fn reference((m, k, n): (usize, usize, usize), scale: f32, a: Values, b: Values) -> Vec<f64> {
        let at = |(values, (row, column)): Values, i: usize, j: usize| {
            values[i * row + j * column] as f64
        };
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k).map(|p| at(a, i, p) * at(b, p, j)).sum();
                c[i * n + j] = scale as f64 * dot;
            }
        }
        c
    }

    /// A row-major `[rows x columns]` matrix, then the same values stored transposed
    /// (read through swapped strides), each with its strides.
    fn both_layouts(rows: usize, columns: usize, seed: usize) -> [(Vec<f32>, (usize, usize)); 2] {
        let value = |index: usize| ((index * 37 + 11 + seed) % 23) as f32 / 8.0 - 1.4;
        let plain: Vec<f32> = (0..rows * columns).map(value).collect();
        let transposed = (0..rows * columns)
            .map(|index| plain[(index % rows) * columns + index / rows])
            .collect();
        [(plain, (columns, 1)), (transposed, (1, rows))]
    }

    /// Whether attention's entry point multiplies a 1 x 1 x 1 product here.
    fn attention_takes_it() -> bool {
        let mut c = [0.0f32; 1];
        let one = [1.0f32];
        unsafe {
            matmul(
                (1, 1, 1),
                1.0,
                (one.as_ptr(), 1, 1),
                (one.as_ptr(), 1, 1),
                (c.as_mut_ptr(), 1, 1),
            )
        }
    }

    #[test]
    fn attention_takes_it_on_avx2_hosts_without_avx512_only() {
        #[cfg(target_arch = "x86_64")]
        let expected = supported() && !std::is_x86_feature_detected!("avx512f");
        #[cfg(not(target_arch = "x86_64"))]
        let expected = false;
        assert_eq!(attention_takes_it(), expected);
    }

    #[test]
    fn products_match_the_definition_at_every_edge() {
        if !supported() {
            eprintln!("skipped: this host has no AVX2 and FMA for the micro-kernel");
            return;
        }
        for (m, k, n) in [
            (1, 1, 1),
            (6, 64, 16),
            (7, 64, 17),
            (13, 3, 40),
            (64, 64, 256),
            (11, 70, 5),
            (5, 70, 24),
        ] {
            // `a` and `b` row-major or transposed (`dS^T`, `K^T`), in every pairing.
            for (a, a_strides) in &both_layouts(m, k, 0) {
                for (b, b_strides) in &both_layouts(k, n, 5) {
                    // Row stride of `c` wider than `n`, with a canary past each row.
                    let mut c = vec![f32::NAN; m * (n + 3)];
                    let taken = unsafe {
                        matmul_where_supported(
                            (m, k, n),
                            0.5,
                            (a.as_ptr(), a_strides.0 as isize, a_strides.1 as isize),
                            (b.as_ptr(), b_strides.0 as isize, b_strides.1 as isize),
                            (c.as_mut_ptr(), (n + 3) as isize, 1),
                        )
                    };
                    assert!(taken);
                    let expected = reference((m, k, n), 0.5, (a, *a_strides), (b, *b_strides));
                    for i in 0..m {
                        for j in 0..n {
                            let got = c[i * (n + 3) + j] as f64;
                            let want = expected[i * n + j];
                            assert!(
                                (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{m}x{k}x{n}, a {a_strides:?}, b {b_strides:?}: c[{i}][{j}] = {got}, expected {want}"
                            );
                        }
                        assert!(c[i * (n + 3) + n..(i + 1) * (n + 3)]
                            .iter()
                            .all(|x| x.is_nan()));
                    }
                }
            }
        }
    }

    #[test]
    fn strided_columns_of_c_and_empty_sums_are_declined() {
        let a = [1.0f32; 4];
        let mut c = [0.0f32; 4];
        let (strided_c, no_inner) = unsafe {
            (
                matmul_where_supported(
                    (2, 2, 2),
                    1.0,
                    (a.as_ptr(), 2, 1),
                    (a.as_ptr(), 2, 1),
                    (c.as_mut_ptr(), 1, 2),
                ),
                matmul_where_supported(
                    (2, 0, 2),
                    1.0,
                    (a.as_ptr(), 0, 1),
                    (a.as_ptr(), 2, 1),
                    (c.as_mut_ptr(), 2, 1),
                ),
            )
        };
        assert!(!strided_c && !no_inner);
        assert_eq!(c, [0.0; 4]);
    }
}
