//! f32 attention in AVX-512 registers, forward and gradient, a chunk of [`CHUNK`] query
//! rows at a time against all the keys its rows see: the products and the softmax
//! fused per chunk, with no GEMM-library call (which packs both operands of every small
//! product) and no causal triangle computed past the chunk's last row.
//!
//! A chunk's scores are kept transposed, `S^T [keys x CHUNK]`: a key's scores for the
//! chunk's rows are two registers, so each row's maximum, sum and `rowsum(P dP)` are
//! taken over registers lane by lane, and a causal mask is a mask of lanes. Every product
//! is one register kernel ([`product`]): rows of `C` as broadcasts of `A` read in place
//! at any strides, columns as registers of `B`'s rows. The chunk's queries (and output
//! gradients) are packed transposed, `[head_dim x CHUNK]`, to be `B` of `S^T = K Q^T`
//! (and `dP^T = V dO^T`); keys, values and the other products' operands are read in
//! place.
//!
//! - Forward ([`AttentionRun::fused_task`]): `S^T = scale K Q^T`, each row's softmax
//!   numerators in place, `O = P V`, each row divided by its sum.
//! - Gradient ([`AttentionGradRun::fused_element`]): `S^T` and `dP^T = V dO^T` again,
//!   `P` and `dS = P (dP - rowsum(P dP))` in place, `dQ = scale dS K`, and summed over
//!   the chunks, `dK = scale dS^T Q` and `dV = P^T dO`.
//!
//! The numbers are those of the tiled code up to rounding (an `exp` with fused
//! multiply-adds, products in another order); the NaN, infinity and empty-element
//! behaviour is the same.

use std::arch::x86_64::*;

use nestor_passes::Products;

use super::{AttentionGradRun, AttentionRun, Buffers, GradBuffers, Task};

/// Query rows per chunk: two registers of lanes.
const CHUNK: usize = 32;
/// Lanes of a register.
const LANES: usize = 16;
/// Column registers per block of a product (64 columns: a head of 64 at once).
const COLUMN_REGISTERS: usize = 4;

/// Whether a step's tasks run here: f32 values and products, heads of at least one
/// column, a host with AVX-512.
pub(super) fn usable<T: 'static>(products: Products, (head_dim, value_dim): (i64, i64)) -> bool {
    std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>()
        && products == Products::Float
        && head_dim > 0
        && value_dim > 0
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
}

/// Scalars a task holds at once for an element of `keys` keys and heads of
/// `head_dim`: the chunk's scores (and in the gradient its slopes) and its packed
/// queries (and output gradients), `None` on overflow.
pub(super) fn scratch_scalars(keys: i64, head_dim: i64, gradient: bool) -> Option<usize> {
    let per_lane = (keys.max(0) as usize).checked_add(head_dim.max(0) as usize)?;
    per_lane
        .checked_mul(CHUNK)?
        .checked_mul(1 + gradient as usize)
}

/// A thread's buffers, kept between tasks.
#[derive(Default)]
struct Scratch {
    /// The chunk's query rows transposed `[head_dim x CHUNK]` (zeros past its rows).
    queries: Vec<f32>,
    /// The chunk's output-gradient rows transposed (the gradient's).
    gradients: Vec<f32>,
    /// `S^T`, then the numerators or `P^T` `[keys x CHUNK]`.
    scores: Vec<f32>,
    /// `dP^T`, then `dS^T` (the gradient's).
    slopes: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Fills this thread's scratch with NaNs (tests: a value read before it is written
/// shows).
#[cfg(test)]
pub(super) fn poison_scratch() {
    SCRATCH.with_borrow_mut(|scratch| {
        let most = 1 << 16;
        for buffer in [
            &mut scratch.queries,
            &mut scratch.gradients,
            &mut scratch.scores,
            &mut scratch.slopes,
        ] {
            buffer.clear();
            buffer.resize(most, f32::NAN);
        }
    });
}

/// A matrix read in place: its first value, the scalars between rows and between
/// columns.
type Read = (*const f32, isize, isize);

/// `C = alpha A B`, or `C += alpha A B` when `add`, for `C [rows x columns]` at
/// `(c, row stride)`, `A [rows x depth]` as [`Read`], `B [depth x columns]` at `(b, row
/// stride)` with contiguous columns. Blocks of up to 64 columns (the last register of a
/// block masked) by up to 12 (6 for wider blocks) rows of accumulators.
///
/// # Safety
/// Code compiled for AVX-512 (the tasks here); the matrices hold their rows.
#[inline(always)]
unsafe fn product(
    (rows, depth, columns): (usize, usize, usize),
    alpha: f32,
    a: Read,
    (b, b_row): (*const f32, isize),
    (c, c_row): (*mut f32, isize),
    add: bool,
) {
    let mut column = 0;
    while column < columns {
        let width = (columns - column).min(COLUMN_REGISTERS * LANES);
        let registers = width.div_ceil(LANES);
        let tail = lanes_below(width - (registers - 1) * LANES);
        // SAFETY: columns `column..column + width` of the caller's matrices.
        unsafe {
            let block = Block {
                depth,
                alpha,
                a,
                b: (b.add(column), b_row),
                c: (c.add(column), c_row),
                tail,
                add,
            };
            match registers {
                1 => rows_of::<12, 1>(rows, block),
                2 => rows_of::<12, 2>(rows, block),
                3 => rows_of::<6, 3>(rows, block),
                _ => rows_of::<6, 4>(rows, block),
            }
        }
        column += width;
    }
}

/// Rows of `B` a [`product_in_blocks`] takes at a time.
const DEPTH_BLOCK: usize = 32;

/// [`product`] over [`DEPTH_BLOCK`] rows of `B` at a time, each block's sums added to
/// `C`: for `B`'s rows read in place from a wide buffer, where all of them miss L1 (rows
/// 3 KiB apart, as a head's keys in `[L, 3, heads, 64]`, fall into a quarter of its
/// sets) but 32 of them stay in it for all of `C`'s rows.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn product_in_blocks(
    (rows, depth, columns): (usize, usize, usize),
    alpha: f32,
    (a, a_row, a_column): Read,
    (b, b_row): (*const f32, isize),
    c: (*mut f32, isize),
) {
    for first in (0..depth).step_by(DEPTH_BLOCK) {
        let block = DEPTH_BLOCK.min(depth - first);
        let a = a.wrapping_offset(first as isize * a_column);
        let b = b.wrapping_offset(first as isize * b_row);
        // SAFETY: rows `first..first + block` of `B`, columns of `A` (the caller vouches).
        unsafe {
            product(
                (rows, block, columns),
                alpha,
                (a, a_row, a_column),
                (b, b_row),
                c,
                first > 0,
            );
        }
    }
}

/// One block of columns of a [`product`].
#[derive(Clone, Copy)]
struct Block {
    depth: usize,
    alpha: f32,
    a: Read,
    b: (*const f32, isize),
    c: (*mut f32, isize),
    /// The lanes of the block's last register that are columns.
    tail: __mmask16,
    add: bool,
}

impl Block {
    /// The block from row `row` of `A` and `C` on.
    #[inline(always)]
    fn at_row(self, row: usize) -> Self {
        let (a, a_row, a_column) = self.a;
        let (c, c_row) = self.c;
        Block {
            a: (a.wrapping_offset(row as isize * a_row), a_row, a_column),
            c: (c.wrapping_offset(row as isize * c_row), c_row),
            ..self
        }
    }
}

/// A block's `rows` rows, `ROWS` at a time, the rest by 8, 4, 2 and 1.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn rows_of<const ROWS: usize, const REGISTERS: usize>(rows: usize, block: Block) {
    let mut row = 0;
    // SAFETY: rows below `rows` (the caller vouches).
    unsafe {
        while row + ROWS <= rows {
            registers::<ROWS, REGISTERS>(block.at_row(row));
            row += ROWS;
        }
        if ROWS > 8 && rows - row >= 8 {
            registers::<8, REGISTERS>(block.at_row(row));
            row += 8;
        }
        if rows - row >= 4 {
            registers::<4, REGISTERS>(block.at_row(row));
            row += 4;
        }
        if rows - row >= 2 {
            registers::<2, REGISTERS>(block.at_row(row));
            row += 2;
        }
        if rows - row >= 1 {
            registers::<1, REGISTERS>(block.at_row(row));
        }
    }
}

/// `ROWS x REGISTERS` registers of a block's `C`, summed over its depth.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn registers<const ROWS: usize, const REGISTERS: usize>(block: Block) {
    let Block {
        depth,
        alpha,
        a: (a, a_row, a_column),
        b: (b, b_row),
        c: (c, c_row),
        tail,
        add,
    } = block;
    let mask = |register: usize| {
        if register + 1 == REGISTERS {
            tail
        } else {
            0xffff
        }
    };
    // SAFETY: the block's rows and columns (the caller vouches); masked lanes are
    // neither read nor written.
    unsafe {
        let mut sums = [[_mm512_setzero_ps(); REGISTERS]; ROWS];
        for step in 0..depth {
            let line = b.offset(step as isize * b_row);
            let values: [__m512; REGISTERS] = std::array::from_fn(|register| {
                _mm512_maskz_loadu_ps(mask(register), line.add(register * LANES))
            });
            let column = a.offset(step as isize * a_column);
            for (row, sums) in sums.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*column.offset(row as isize * a_row));
                for (sum, &value) in sums.iter_mut().zip(&values) {
                    *sum = _mm512_fmadd_ps(x, value, *sum);
                }
            }
        }
        let alpha = _mm512_set1_ps(alpha);
        for (row, sums) in sums.iter().enumerate() {
            let line = c.offset(row as isize * c_row);
            for (register, &sum) in sums.iter().enumerate() {
                let at = line.add(register * LANES);
                let mut value = _mm512_mul_ps(sum, alpha);
                if add {
                    value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask(register), at));
                }
                _mm512_mask_storeu_ps(at, mask(register), value);
            }
        }
    }
}

/// The lanes below `count` (all from 16).
#[inline(always)]
fn lanes_below(count: usize) -> __mmask16 {
    if count >= LANES {
        0xffff
    } else {
        ((1u32 << count) - 1) as __mmask16
    }
}

/// The lanes of a register of query rows, the first `first_row` (counted within the
/// element), that see key `key`: all without a causal mask, else those at or past it.
#[inline(always)]
fn seeing(key: usize, first_row: usize, causal: bool) -> __mmask16 {
    if !causal || key <= first_row {
        0xffff
    } else {
        !lanes_below(key - first_row)
    }
}

/// `e^x` of 16 lanes for `x` at most 0 (or NaN, kept): `nestor_math::fast_exp`'s
/// reduction and polynomial with fused multiply-adds, the power of two by `scalef`.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn exp(x: __m512) -> __m512 {
    use nestor_math::{EXP_COEFFICIENTS, LN_2_SPLIT};
    // SAFETY: register arithmetic (the caller vouches for the host).
    unsafe {
        let splat = _mm512_set1_ps;
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, splat(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, splat(LN_2_SPLIT[0] as f32), x);
        let r = _mm512_fnmadd_ps(n, splat(LN_2_SPLIT[1] as f32), r);
        let mut polynomial = splat(EXP_COEFFICIENTS[0] as f32);
        for &coefficient in &EXP_COEFFICIENTS[1..] {
            polynomial = _mm512_fmadd_ps(polynomial, r, splat(coefficient as f32));
        }
        let reduced = _mm512_fmadd_ps(
            polynomial,
            _mm512_mul_ps(r, r),
            _mm512_add_ps(r, splat(1.0)),
        );
        _mm512_scalef_ps(reduced, n)
    }
}

/// `e^(score - largest)` of the lanes in `seen` by this module's [`exp`]
/// (`rows::numerators_by`).
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn numerators(scores: __m512, largest: __m512, seen: __mmask16) -> __m512 {
    // SAFETY: register arithmetic (the caller vouches for the host).
    unsafe {
        super::rows::numerators_by(
            #[inline(always)]
            |x| exp(x),
            (scores, largest),
            seen,
        )
    }
}

/// Each lane's largest score over the `keys` keys it sees (`-inf` when none; NaN
/// ignored) of one register column of `S^T` (`CHUNK` scalars a key), and the lanes
/// with a masked score NaN or `+inf`.
///
/// # Safety
/// As [`product`]; `scores` holds `keys` keys.
#[inline(always)]
unsafe fn largest(
    scores: *const f32,
    keys: usize,
    first_row: usize,
    causal: bool,
) -> (__m512, __mmask16) {
    // SAFETY: as the caller vouches.
    unsafe {
        let mut largest = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut poisoned: __mmask16 = 0;
        let infinite = _mm512_set1_ps(f32::INFINITY);
        for key in 0..keys {
            let values = _mm512_loadu_ps(scores.add(key * CHUNK));
            let seen = seeing(key, first_row, causal);
            let larger = _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(seen, values, largest);
            largest = _mm512_mask_mov_ps(largest, larger, values);
            poisoned |= _mm512_mask_cmp_ps_mask::<_CMP_NLT_UQ>(!seen, values, infinite);
        }
        (largest, poisoned)
    }
}

/// Packs `rows` rows (at most [`CHUNK`]) of `width` values (from `at`, `stride`
/// scalars apart) transposed into `out [width x CHUNK]`, zeros past the rows: blocks of
/// 16 x 16 transposed in registers.
///
/// # Safety
/// As [`product`]; `at` holds the rows.
#[inline(always)]
unsafe fn pack_transposed(
    out: &mut Vec<f32>,
    (at, stride): (*const f32, isize),
    rows: usize,
    width: usize,
) {
    out.clear();
    out.resize(width * CHUNK, 0.0);
    let target = out.as_mut_ptr();
    for first_row in (0..rows.min(CHUNK)).step_by(LANES) {
        let present = (rows - first_row).min(LANES);
        for first_column in (0..width).step_by(LANES) {
            let columns = (width - first_column).min(LANES);
            let mask = lanes_below(columns);
            // SAFETY: rows below `rows` and columns below `width` are read (the caller
            // vouches for them), columns below `width` of the rows written.
            unsafe {
                let block = transposed(std::array::from_fn(|row| {
                    if row < present {
                        let line = at.offset((first_row + row) as isize * stride);
                        _mm512_maskz_loadu_ps(mask, line.add(first_column))
                    } else {
                        _mm512_setzero_ps()
                    }
                }));
                for (column, &values) in block.iter().take(columns).enumerate() {
                    let line = target.add((first_column + column) * CHUNK + first_row);
                    _mm512_storeu_ps(line, values);
                }
            }
        }
    }
}

/// The transpose of 16 registers of 16 lanes: interleaved by 32 and 64 bits, then by
/// 128-bit lanes twice.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn transposed(rows: [__m512; LANES]) -> [__m512; LANES] {
    // SAFETY: register shuffles (the caller vouches for the host).
    unsafe {
        let mut pairs = rows;
        for pair in 0..LANES / 2 {
            let (even, odd) = (rows[2 * pair], rows[2 * pair + 1]);
            pairs[2 * pair] = _mm512_unpacklo_ps(even, odd);
            pairs[2 * pair + 1] = _mm512_unpackhi_ps(even, odd);
        }
        let mut quads = pairs;
        for base in (0..LANES).step_by(4) {
            let half = |at: usize| _mm512_castps_pd(pairs[base + at]);
            let (low, high) = ((half(0), half(2)), (half(1), half(3)));
            quads[base] = _mm512_castpd_ps(_mm512_unpacklo_pd(low.0, low.1));
            quads[base + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(low.0, low.1));
            quads[base + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(high.0, high.1));
            quads[base + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(high.0, high.1));
        }
        by_lanes(by_lanes(quads, 4), 8)
    }
}

/// Registers `at` and `at + distance`, for every `at` without `distance`'s bit, made
/// their 128-bit lanes 0 and 2 (into `at`) and 1 and 3 (into `at + distance`).
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn by_lanes(registers: [__m512; LANES], distance: usize) -> [__m512; LANES] {
    let mut out = registers;
    for at in 0..LANES {
        if at & distance != 0 {
            continue;
        }
        let (a, b) = (registers[at], registers[at + distance]);
        // SAFETY: register shuffles (the caller vouches for the host).
        unsafe {
            out[at] = _mm512_shuffle_f32x4::<0x88>(a, b);
            out[at + distance] = _mm512_shuffle_f32x4::<0xdd>(a, b);
        }
    }
    out
}

/// Grows `buffer` to `len` scalars (their values are written before they are read).
fn hold(buffer: &mut Vec<f32>, len: usize) -> *mut f32 {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    buffer.as_mut_ptr()
}

impl AttentionRun<'_> {
    /// One task here: its query rows' outputs for one head, a [`CHUNK`] at a time, each
    /// against the keys it sees (with a causal mask, none past its last row where
    /// `AttentionRun::leaves_out_keys` lets all of the task's rows leave them out).
    ///
    /// # Safety
    /// As [`AttentionRun::task`]; the host has AVX-512 ([`usable`]).
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
    pub(super) unsafe fn fused_task(&self, buffers: Buffers<f32>, task: Task) {
        let (d, dv) = (self.head_dim as usize, self.value_dim as usize);
        let out_width = (self.heads * self.value_dim) as isize;
        let heads = (task.head * self.head_dim, task.head * self.value_dim);
        let rows = task.rows.max(0) as usize;
        let scale = self.scale as f32;
        let q_rows = |row: i64| {
            let offset = (task.q_first + row) * self.q.row_stride + self.q.offset + heads.0;
            buffers.q.wrapping_offset(offset as isize)
        };
        // SAFETY: the task's rows and the element's keys (the caller vouches).
        let leave_out = self.causal
            && unsafe {
                let seen = (task.row + CHUNK.min(rows) as i64).clamp(0, task.k_rows);
                let tile = (q_rows(task.row), self.q.row_stride, rows);
                self.leaves_out_keys(buffers, heads, tile, (task.k_first, task.k_rows), seen)
            };
        let mut scratch = SCRATCH.take();
        {
            let scratch = &mut scratch;
            for first in (0..rows).step_by(CHUNK) {
                let chunk = CHUNK.min(rows - first);
                let row = task.row + first as i64;
                let q_row = task.q_first + row;
                // SAFETY: the task's rows and keys (the caller vouches).
                unsafe {
                    let q = q_rows(row);
                    let out = buffers
                        .out
                        .offset((q_row as isize) * out_width + heads.1 as isize);
                    let keys = match leave_out {
                        true => (row + chunk as i64).clamp(0, task.k_rows),
                        false => task.k_rows,
                    }
                    .max(0) as usize;
                    if keys == 0 {
                        // No keys: libtorch's attention gives 0.
                        for line in 0..chunk {
                            let at = out.offset(line as isize * out_width);
                            std::slice::from_raw_parts_mut(at, dv).fill(0.0);
                        }
                        continue;
                    }
                    let at = |access: &nestor_passes::Access, buffer: *const f32, column: i64| {
                        let offset = task.k_first * access.row_stride + access.offset + column;
                        (buffer.offset(offset as isize), access.row_stride as isize)
                    };
                    let (k, k_stride) = at(self.k, buffers.k, heads.0);
                    let (v, v_stride) = at(self.v, buffers.v, heads.1);
                    pack_transposed(
                        &mut scratch.queries,
                        (q, self.q.row_stride as isize),
                        chunk,
                        d,
                    );
                    let scores = hold(&mut scratch.scores, keys * CHUNK);
                    // S^T = scale K Q^T.
                    product(
                        (keys, d, CHUNK),
                        scale,
                        (k, k_stride, 1),
                        (scratch.queries.as_ptr(), CHUNK as isize),
                        (scores, CHUNK as isize),
                        false,
                    );
                    let mut inverses = [0.0f32; CHUNK];
                    for (register, inverses) in inverses.chunks_mut(LANES).enumerate() {
                        let column = scores.add(register * LANES);
                        let first_row = row.max(0) as usize + register * LANES;
                        let inverse = self.fused_numerators(column, keys, first_row);
                        _mm512_storeu_ps(inverses.as_mut_ptr(), inverse);
                    }
                    // O = P V, each row divided by its sum.
                    product_in_blocks(
                        (chunk, keys, dv),
                        1.0,
                        (scores, 1, CHUNK as isize),
                        (v, v_stride),
                        (out, out_width),
                    );
                    for (line, &inverse) in inverses[..chunk].iter().enumerate() {
                        let at = out.offset(line as isize * out_width);
                        for value in std::slice::from_raw_parts_mut(at, dv) {
                            *value *= inverse;
                        }
                    }
                }
            }
        }
        SCRATCH.set(scratch);
    }

    /// One register column of the forward's `S^T` (`keys` keys, lanes from query row
    /// `first_row`) turned into softmax numerators; returns each lane's `1 / sum`: NaN
    /// where a masked score was NaN or `+inf` (libtorch masks by adding `-inf`), 1 where
    /// no score is finite (numerators 0, or NaN for a NaN score, as the tiled forward).
    ///
    /// # Safety
    /// As [`product`]; `scores` holds `keys` keys.
    #[inline(always)]
    unsafe fn fused_numerators(&self, scores: *mut f32, keys: usize, first_row: usize) -> __m512 {
        // SAFETY: as the caller vouches.
        unsafe {
            let (largest, poisoned) = largest(scores, keys, first_row, self.causal);
            let infinite = _mm512_set1_ps(f32::NEG_INFINITY);
            // With no finite score, `e^(score - 0)`: 0 for `-inf`, NaN for NaN.
            let none = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(largest, infinite);
            let largest = _mm512_mask_mov_ps(largest, none, _mm512_setzero_ps());
            let mut total = _mm512_setzero_ps();
            for key in 0..keys {
                let at = scores.add(key * CHUNK);
                let seen = seeing(key, first_row, self.causal);
                let values = numerators(_mm512_loadu_ps(at), largest, seen);
                _mm512_storeu_ps(at, values);
                total = _mm512_add_ps(total, values);
            }
            let one = _mm512_set1_ps(1.0);
            let empty = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(total, _mm512_setzero_ps());
            let inverse = _mm512_div_ps(one, _mm512_mask_mov_ps(total, empty, one));
            _mm512_mask_mov_ps(inverse, poisoned, _mm512_set1_ps(f32::NAN))
        }
    }
}

impl AttentionGradRun<'_> {
    /// The gradient of query rows `q_first..q_first + q_rows` (from row `row_offset` of
    /// their element) of one head here, a [`CHUNK`] of rows at a time against the keys
    /// it sees (`AttentionGradRun::seen_keys`; the last chunk first with a causal mask,
    /// so that the chunk writing the keys' gradients sees the most keys).
    ///
    /// # Safety
    /// As [`AttentionGradRun::element`]; the host has AVX-512 ([`usable`]).
    #[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
    pub(super) unsafe fn fused_element(
        &self,
        buffers: GradBuffers<f32>,
        head: i64,
        (q_first, q_rows): (i64, i64),
        (k_first, k_rows): (i64, i64),
        row_offset: i64,
    ) {
        let d = self.head_dim as usize;
        let (qs, ks) = (q_rows.max(0) as usize, k_rows.max(0) as usize);
        if qs == 0 || ks == 0 {
            // SAFETY: the task's rows (the caller vouches).
            unsafe { self.zero_gradient(buffers, head, (q_first, q_rows), (k_first, k_rows)) };
            return;
        }
        let at = |access: &nestor_passes::Access, base: *const f32, first: i64| {
            let offset = first * access.row_stride + access.offset + head * self.head_dim;
            (
                base.wrapping_offset(offset as isize),
                access.row_stride as isize,
            )
        };
        let (q, k, v, g) = (
            at(self.q, buffers.q, q_first),
            at(self.k, buffers.k, k_first),
            at(self.v, buffers.v, k_first),
            at(self.g, buffers.g, q_first),
        );
        let scale = self.scale as f32;
        let chunks = qs.div_ceil(CHUNK);
        let order = (0..chunks).map(|index| match self.causal {
            true => (chunks - 1 - index) * CHUNK,
            false => index * CHUNK,
        });
        let first_row = row_offset.max(0) as usize;
        // With a causal mask the chunks leave out the keys past their last rows, where
        // that changes nothing (checked once for all of them).
        let hidden = (first_row + CHUNK.min(qs)).min(ks)..ks;
        // SAFETY: the task's rows and the element's keys (the caller vouches).
        let leave_out = self.causal && unsafe { self.leaves_out(((q, g), qs), (k, v), hidden) };
        let mut scratch = SCRATCH.take();
        {
            let scratch = &mut scratch;
            for (index, first) in order.enumerate() {
                let rows = CHUNK.min(qs - first);
                let line = |(at, stride): (*const f32, isize)| {
                    (at.wrapping_offset(first as isize * stride), stride)
                };
                let (q, g) = (line(q), line(g));
                // SAFETY: the chunk's rows and the element's keys (the caller vouches).
                unsafe {
                    let seen = match leave_out {
                        true => (first_row + first + rows).min(ks),
                        false => ks,
                    };
                    pack_transposed(&mut scratch.queries, q, rows, d);
                    pack_transposed(&mut scratch.gradients, g, rows, d);
                    let scores = hold(&mut scratch.scores, seen * CHUNK);
                    let slopes = hold(&mut scratch.slopes, seen * CHUNK);
                    let panel = CHUNK as isize;
                    // S^T = scale K Q^T; dP^T = V dO^T.
                    let shape = (seen, d, CHUNK);
                    let (k_read, v_read) = ((k.0, k.1, 1), (v.0, v.1, 1));
                    product(
                        shape,
                        scale,
                        k_read,
                        (scratch.queries.as_ptr(), panel),
                        (scores, panel),
                        false,
                    );
                    product(
                        shape,
                        1.0,
                        v_read,
                        (scratch.gradients.as_ptr(), panel),
                        (slopes, panel),
                        false,
                    );
                    for register in 0..CHUNK / LANES {
                        let offset = register * LANES;
                        let columns = (scores.add(offset), slopes.add(offset));
                        self.fused_slopes(columns, seen, first_row + first + offset);
                    }
                    if let Some(key_rows) = self.key_rows(buffers, k_first, head) {
                        if index == 0 && seen < ks {
                            // Keys no query row sees: no gradient.
                            self.zero_keys(key_rows, seen..ks);
                        }
                        // dK = scale dS^T Q; dV = P^T dO: written by the first chunk,
                        // added to by the others.
                        let (out, row) = (key_rows.out, key_rows.row as isize);
                        let shape = (seen, rows, d);
                        let add = index > 0;
                        product(
                            shape,
                            scale,
                            (slopes, panel, 1),
                            (q.0, q.1),
                            (out, row),
                            add,
                        );
                        let values = out.offset(key_rows.values_after as isize);
                        product(
                            shape,
                            1.0,
                            (scores, panel, 1),
                            (g.0, g.1),
                            (values, row),
                            add,
                        );
                    }
                    if let Some(queries) = self.outputs.queries {
                        // dQ = scale dS K.
                        let row = q_first + first as i64;
                        let out = buffers.out.offset(
                            (row * queries.row + queries.at + head * self.head_dim) as isize,
                        );
                        let shape = (rows, seen, d);
                        product_in_blocks(
                            shape,
                            scale,
                            (slopes, 1, panel),
                            (k.0, k.1),
                            (out, queries.row as isize),
                        );
                    }
                }
            }
        }
        SCRATCH.set(scratch);
    }

    /// One register column of the gradient's `S^T` and `dP^T` (`keys` keys, lanes from
    /// query row `first_row`) turned into `P^T` and `dS^T = P (dP - rowsum(P dP))`, as
    /// the tiled gradient's `softmax_slopes` (0 where `P` is; `dS` NaN past the visible
    /// keys where `dP - rowsum` is not finite).
    ///
    /// # Safety
    /// As [`product`]; the columns hold `keys` keys.
    #[inline(always)]
    unsafe fn fused_slopes(
        &self,
        (scores, slopes): (*mut f32, *mut f32),
        keys: usize,
        first_row: usize,
    ) {
        // SAFETY: as the caller vouches.
        unsafe {
            let (largest, _) = largest(scores, keys, first_row, self.causal);
            let mut total = _mm512_setzero_ps();
            let mut dot = _mm512_setzero_ps();
            for key in 0..keys {
                let (at, products) = (scores.add(key * CHUNK), slopes.add(key * CHUNK));
                let seen = seeing(key, first_row, self.causal);
                let values = numerators(_mm512_loadu_ps(at), largest, seen);
                _mm512_storeu_ps(at, values);
                total = _mm512_add_ps(total, values);
                let product = _mm512_mul_ps(values, _mm512_loadu_ps(products));
                dot = _mm512_add_ps(dot, _mm512_maskz_mov_ps(seen, product));
            }
            let inverse = _mm512_div_ps(_mm512_set1_ps(1.0), total);
            let dot = _mm512_mul_ps(dot, inverse);
            for key in 0..keys {
                let (at, products) = (scores.add(key * CHUNK), slopes.add(key * CHUNK));
                let p = _mm512_mul_ps(_mm512_loadu_ps(at), inverse);
                _mm512_storeu_ps(at, p);
                let slope = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(products), dot));
                _mm512_storeu_ps(products, slope);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
    unsafe fn pack(values: &[f32], stride: usize, rows: usize, width: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; 7];
        // SAFETY: `values` holds the rows (the test sizes it).
        unsafe { pack_transposed(&mut out, (values.as_ptr(), stride as isize), rows, width) };
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn packed_rows_are_the_rows_transposed(
            rows in 0usize..=CHUNK,
            width in 1usize..70,
            extra in 0usize..5,
        ) {
            if !usable::<f32>(Products::Float, (1, 1)) {
                eprintln!("skipped: the host has no AVX-512");
                return Ok(());
            }
            let stride = width + extra;
            let values: Vec<f32> = (0..rows * stride).map(|at| at as f32).collect();
            // SAFETY: the host has AVX-512 (checked above).
            let packed = unsafe { pack(&values, stride, rows, width) };
            prop_assert_eq!(packed.len(), width * CHUNK);
            for column in 0..width {
                for lane in 0..CHUNK {
                    let expected = if lane < rows { values[lane * stride + column] } else { 0.0 };
                    prop_assert_eq!(packed[column * CHUNK + lane], expected, "{} {}", column, lane);
                }
            }
        }
    }
}
