//! Mixed-precision attention on Intel AMX tiles (`crate::amx`), forward and gradient,
//! 16 query rows at a time against all of an element's keys: the products on the tiles
//! (bf16 roundings, f32 sums), each row's softmax in a few passes over AVX-512 registers
//! ([`rows`]; rows are padded to whole tiles, so no column is left to scalar code).
//!
//! - Forward ([`AttentionRun::tile_task`]): `S = scale Q K^T`, the softmax over the
//!   visible keys, `P` rounded and multiplied by the values, each row divided by its sum.
//! - Gradient ([`AttentionGradRun::tile_task`]), per chunk of query rows: `S` and
//!   `dP = dO V^T` again, `P` and `dS = P (dP - rowsum(P dP))` rounded as they are made:
//!   `dS` by rows for `dQ = scale dS K`, both by pairs of rows for `dK^T = scale Q^T dS`
//!   and `dV^T = dO^T P` (the keys' gradients summed over the chunk's rows in one product
//!   each, written transposed).

use nestor_passes::{Access, Products};

use super::rows::{self, with_avx512, GradRow, PairOut};
use super::{AttentionGradRun, AttentionRun, Buffers, GradBuffers, InputRoundings, Task};
use super::{G, K, Q, V};
use crate::amx::{multiply_rows, Configured, Lines, Panel, RowsOfA};
use crate::bf16::RoundedBuffer;

/// Query rows the tiles take at a time (a tile's rows).
pub(super) const TILE_ROWS: usize = 16;

/// The inputs of a step as bf16 roundings, for its tasks on AMX tiles (the gradient's
/// `g` too).
#[derive(Clone, Copy)]
pub(super) struct TileInputs<'a> {
    q: &'a RoundedBuffer,
    k: &'a RoundedBuffer,
    v: &'a RoundedBuffer,
    g: Option<&'a RoundedBuffer>,
}

impl<'a> TileInputs<'a> {
    /// The roundings of a step's inputs when its tasks run on AMX tiles: f32 values,
    /// bf16 products, head widths of at least one column, every input (the output's
    /// gradient if `gradient`) rounded to bf16 bits, tiles usable (and AVX-512).
    pub(super) fn of<T: 'static>(
        products: Products,
        widths: (i64, i64),
        rounded: &'a InputRoundings,
        gradient: bool,
    ) -> Option<Self> {
        let f32_values = std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>();
        let widths = widths.0 > 0 && widths.1 > 0;
        let tiles = crate::amx::usable()
            && std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512bw");
        if !(f32_values && widths && products == Products::Bf16 && tiles) {
            return None;
        }
        let get = |input| rounded.get(input).filter(|buffer| buffer.is_bf16());
        Some(TileInputs {
            q: get(Q)?,
            k: get(K)?,
            v: get(V)?,
            g: if gradient { Some(get(G)?) } else { None },
        })
    }

    /// Roundings made by the caller (tests of the tasks).
    #[cfg(test)]
    pub(super) fn new(
        (q, k, v): (&'a RoundedBuffer, &'a RoundedBuffer, &'a RoundedBuffer),
        g: Option<&'a RoundedBuffer>,
    ) -> Self {
        TileInputs { q, k, v, g }
    }
}

/// A thread's buffers for the forward on AMX tiles, kept between tasks.
#[derive(Default)]
pub(super) struct TileScratch {
    /// Query rows packed where they cannot be read in place.
    pub(super) queries: Vec<u16>,
    /// The keys' transpose `[head_dim x keys]`, packed.
    pub(super) keys_t: Panel,
    /// The values `[keys x value_dim]`, packed.
    pub(super) values: Panel,
    /// 16 rows of scores.
    scores: Vec<f32>,
    /// The probabilities' bf16 roundings, zeros past the keys.
    pub(super) probabilities: Vec<u16>,
    /// 16 rows of outputs before the division by their sums.
    sums: Vec<f32>,
}

/// A thread's buffers for the gradient on AMX tiles, kept between tasks.
#[derive(Default)]
pub(super) struct GradScratch {
    /// The keys' and the values' transposes `[head_dim x keys]` (for `S` and `dP`), and
    /// the keys `[keys x head_dim]` (for `dQ`), packed.
    pub(super) keys_t: Panel,
    pub(super) values_t: Panel,
    pub(super) keys: Panel,
    /// A chunk's query and output-gradient rows packed where they cannot be read in
    /// place, and their transposes `[head_dim x rows]` (for `dK` and `dV`).
    pub(super) queries: Vec<u16>,
    pub(super) gradients: Vec<u16>,
    pub(super) queries_t: Vec<u16>,
    pub(super) gradients_t: Vec<u16>,
    /// A chunk's `P` and `dS` `[rows x keys]` by pairs of rows.
    pub(super) probabilities: Panel,
    pub(super) slopes: Panel,
    /// 16 rows of `dS` rounded, zeros past the keys.
    pub(super) slope_rows: Vec<u16>,
    /// 16 rows of scores (then `e^(s - largest)`) and of `dP`.
    scores: Vec<f32>,
    products: Vec<f32>,
    /// The sums of a product's 16 rows.
    sums: Vec<f32>,
}

thread_local! {
    pub(super) static TILE_SCRATCH: std::cell::RefCell<TileScratch> =
        std::cell::RefCell::new(TileScratch::default());
    pub(super) static GRAD_SCRATCH: std::cell::RefCell<GradScratch> =
        std::cell::RefCell::new(GradScratch::default());
}

impl AttentionRun<'_> {
    /// One task on AMX tiles, 16 query rows at a time: their scores against all the
    /// element's keys (`Q K^T` of the bf16 roundings, f32 sums), scaled, their softmax
    /// over the visible keys (as the tiled forward's, of the whole row), the
    /// probabilities rounded to bf16 and multiplied by the values, each row divided by
    /// its sum. The keys' transpose and the values are packed once per task.
    ///
    /// # Safety
    /// As [`AttentionRun::task`]; the rounded buffers hold the task's rows.
    #[inline(always)]
    pub(super) unsafe fn tile_task(
        &self,
        buffers: Buffers<f32>,
        task: Task,
        rounded: TileInputs<'_>,
    ) {
        let dv = self.value_dim as usize;
        let out_width = (self.heads * self.value_dim) as usize;
        let (rows, keys) = (task.rows as usize, task.k_rows as usize);
        let q_row = task.q_first + task.row;
        let at = |access: &Access, row: i64, width: i64| {
            (row * access.row_stride + access.offset + task.head * width) as isize
        };
        // SAFETY: the task's rows and head columns lie in the buffers (the caller
        // vouches).
        let (q, k, v, out) = unsafe {
            (
                buffers.q.offset(at(self.q, q_row, self.head_dim)),
                buffers.k.offset(at(self.k, task.k_first, self.head_dim)),
                buffers.v.offset(at(self.v, task.k_first, self.value_dim)),
                buffers.out.offset(
                    q_row as isize * out_width as isize + (task.head as usize * dv) as isize,
                ),
            )
        };
        let out_row = |row: usize| unsafe {
            // SAFETY: as above.
            std::slice::from_raw_parts_mut(out.add(row * out_width), dv)
        };
        if keys == 0 {
            // No keys: libtorch's attention gives 0 (a row without a finite score).
            for row in 0..rows {
                out_row(row).fill(0.0);
            }
            return;
        }
        // The thread-local's closure is compiled apart: `widest` again for the host's
        // vectors.
        TILE_SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: the host has AVX-512 (`TileInputs::of`).
            unsafe {
                with_avx512(
                    #[inline(always)]
                    || self.tile_blocks(scratch, task, (q, k, v), rounded, out_row),
                )
            }
        });
    }

    /// [`AttentionRun::tile_task`] for a task with keys, in `scratch`.
    ///
    /// # Safety
    /// As [`AttentionRun::tile_task`]; `q`, `k` and `v` point at the task's first rows
    /// and head columns, `out_row` gives its output rows.
    #[inline(always)]
    unsafe fn tile_blocks<'o>(
        &self,
        scratch: &mut TileScratch,
        task: Task,
        (q, k, v): (*const f32, *const f32, *const f32),
        rounded: TileInputs<'_>,
        out_row: impl Fn(usize) -> &'o mut [f32],
    ) {
        const ROWS: usize = TILE_ROWS;
        let (d, dv) = (self.head_dim as usize, self.value_dim as usize);
        let (rows, keys) = (task.rows as usize, task.k_rows as usize);
        let TileScratch {
            queries,
            keys_t,
            values,
            scores,
            probabilities,
            sums,
        } = scratch;
        let score_width = keys.next_multiple_of(ROWS);
        let key_depth = keys.next_multiple_of(32);
        let value_width = dv.next_multiple_of(ROWS);
        // SAFETY: the keys' and values' rows hold the head's columns (as above).
        let q_rows = unsafe {
            keys_t.pack(
                ((k, 1, self.k.row_stride as isize), Some(rounded.k)),
                (d, keys),
            );
            values.pack(
                ((v, self.v.row_stride as isize, 1), Some(rounded.v)),
                (keys, dv),
            );
            let lines = Lines::new(
                ((q, self.q.row_stride as isize, 1), Some(rounded.q)),
                true,
                d,
            );
            RowsOfA::new(&lines, rows, d.next_multiple_of(32), queries)
        };
        // The tiles' operands and sums from cache lines (`crate::aligned`).
        let scores = crate::aligned::lines(scores, ROWS * score_width, 0.0);
        let probabilities = crate::aligned::lines(probabilities, ROWS * key_depth, 0);
        let sums = crate::aligned::lines(sums, ROWS * value_width, 0.0);
        let mut totals = [0.0f32; ROWS];
        let scale = self.scale as f32;
        let _tiles = Configured::new();
        for block in 0..rows.div_ceil(ROWS) {
            let block_rows = ROWS.min(rows - block * ROWS);
            // SAFETY: the packed queries hold the block's 16 rows; `scores` 16 rows of
            // the keys' blocks.
            unsafe {
                let a = q_rows.block(block, queries);
                multiply_rows(a, keys_t, (scores.as_mut_ptr(), score_width * 4));
            }
            for (row, total) in totals.iter_mut().enumerate().take(block_rows) {
                let scores = &mut scores[row * score_width..][..score_width];
                let position = task.row as usize + block * ROWS + row;
                let visible = if self.causal {
                    (position + 1).min(keys)
                } else {
                    keys
                };
                let rounded = &mut probabilities[row * key_depth..][..key_depth];
                // SAFETY: compiled for AVX-512 (the caller); rows of whole registers.
                let (poisoned, sum) = unsafe {
                    let (largest, poisoned) = rows::scale(scores, scale, (visible, keys));
                    let sum = rows::round_numerators(scores, largest, visible, rounded);
                    (poisoned, sum)
                };
                // As the tiled forward: no finite score keeps 0, a masked NaN or +inf
                // makes the row NaN.
                *total = if poisoned {
                    f32::NAN
                } else if sum == 0.0 {
                    1.0
                } else {
                    sum
                };
            }
            // SAFETY: `probabilities` holds 16 rows of the values' depth; `sums` 16 rows
            // of the values' blocks.
            unsafe {
                let a = (probabilities.as_ptr(), key_depth * 2);
                multiply_rows(a, values, (sums.as_mut_ptr(), value_width * 4));
            }
            for (row, total) in totals.iter().enumerate().take(block_rows) {
                let inverse = 1.0 / total;
                let sums = &sums[row * value_width..][..dv];
                for (out, &sum) in out_row(block * ROWS + row).iter_mut().zip(sums) {
                    *out = sum * inverse;
                }
            }
        }
    }
}

impl AttentionGradRun<'_> {
    /// The gradient of a task's query rows `q_first..q_first + q_rows` (from row
    /// `row_offset` of their element, which the causal mask counts from) of one head on
    /// AMX tiles, a chunk of [`super::Tiles::queries`] rows at a time (see the module's
    /// comment); the keys' gradients of later chunks are added to the first's.
    ///
    /// # Safety
    /// As [`AttentionGradRun::element`]; the rounded buffers hold the task's rows.
    #[inline(always)]
    pub(super) unsafe fn tile_task(
        &self,
        (buffers, rounded): (GradBuffers<f32>, TileInputs<'_>),
        head: i64,
        (q_first, q_rows): (i64, i64),
        (k_first, k_rows): (i64, i64),
        row_offset: i64,
    ) {
        if q_rows <= 0 || k_rows <= 0 {
            // SAFETY: the caller vouches for the rows.
            unsafe { self.zero_gradient(buffers, head, (q_first, q_rows), (k_first, k_rows)) };
            return;
        }
        GRAD_SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: the host has AVX-512 (`TileInputs::of`).
            unsafe {
                with_avx512(
                    #[inline(always)]
                    || {
                        self.tile_chunks(
                            scratch,
                            (buffers, rounded),
                            head,
                            (q_first, q_rows as usize),
                            (k_first, k_rows as usize),
                            row_offset.max(0) as usize,
                        )
                    },
                )
            }
        });
    }

    /// [`AttentionGradRun::tile_task`] for a task with queries and keys, in `scratch`.
    ///
    /// # Safety
    /// As [`AttentionGradRun::tile_task`].
    #[inline(always)]
    unsafe fn tile_chunks(
        &self,
        scratch: &mut GradScratch,
        (buffers, rounded): (GradBuffers<f32>, TileInputs<'_>),
        head: i64,
        (q_first, qs): (i64, usize),
        (k_first, ks): (i64, usize),
        row_offset: usize,
    ) {
        let d = self.head_dim as usize;
        let at = |access: &Access, base: *const f32, first: i64| unsafe {
            // SAFETY: the task's rows and head columns lie in the buffers.
            base.offset((first * access.row_stride + access.offset + head * d as i64) as isize)
        };
        let (k, v) = (
            at(self.k, buffers.k, k_first),
            at(self.v, buffers.v, k_first),
        );
        let transposed = |access: &Access, start| (start, 1, access.row_stride as isize);
        // SAFETY: the keys' and values' rows hold the head's columns.
        unsafe {
            scratch
                .keys_t
                .pack((transposed(self.k, k), Some(rounded.k)), (d, ks));
            scratch
                .values_t
                .pack((transposed(self.v, v), Some(rounded.v)), (d, ks));
            if self.outputs.queries.is_some() {
                let keys = (k, self.k.row_stride as isize, 1);
                scratch.keys.pack((keys, Some(rounded.k)), (ks, d));
            }
        }
        let chunk = (self.tiles.queries.max(1) as usize).min(qs);
        let _tiles = Configured::new();
        for first in (0..qs).step_by(chunk) {
            let rows = chunk.min(qs - first);
            let q_row = q_first + first as i64;
            // SAFETY: the chunk's rows lie in the task's (the caller vouches).
            unsafe {
                self.tile_chunk(
                    scratch,
                    (buffers, rounded),
                    head,
                    (q_row, rows, row_offset + first),
                    (k_first, ks),
                    first == 0,
                )
            };
        }
    }

    /// One chunk of `rows` query rows from `q_row` (the causal mask's position of the
    /// first `position`): `dQ` of its rows, and its share of `dK` and `dV` (written when
    /// `first_chunk`, else added).
    ///
    /// # Safety
    /// As [`AttentionGradRun::tile_task`]; the panels of the task's keys are packed and
    /// the tiles configured.
    #[inline(always)]
    unsafe fn tile_chunk(
        &self,
        scratch: &mut GradScratch,
        (buffers, rounded): (GradBuffers<f32>, TileInputs<'_>),
        head: i64,
        (q_row, rows, position): (i64, usize, usize),
        (k_first, ks): (i64, usize),
        first_chunk: bool,
    ) {
        const ROWS: usize = TILE_ROWS;
        let d = self.head_dim as usize;
        let outputs = self.outputs;
        let keys_values = outputs.keys_values.is_some();
        let scale = self.scale as f32;
        let (score_width, key_depth) = (ks.next_multiple_of(ROWS), ks.next_multiple_of(32));
        let head_width = d.next_multiple_of(ROWS);
        let (depth, row_depth) = (d.next_multiple_of(32), rows.next_multiple_of(32));
        let at = |access: &Access, base: *const f32| unsafe {
            // SAFETY: the chunk's rows and head columns lie in the buffers.
            base.offset((q_row * access.row_stride + access.offset + head * d as i64) as isize)
        };
        let (q, g) = (at(self.q, buffers.q), at(self.g, buffers.g));
        let by_rows = |access: &Access, start| (start, access.row_stride as isize, 1);
        let g_rounded = rounded.g;
        let GradScratch {
            keys_t,
            values_t,
            keys,
            queries,
            gradients,
            queries_t,
            gradients_t,
            probabilities,
            slopes,
            slope_rows,
            scores,
            products,
            sums,
        } = scratch;
        // SAFETY: the chunk's rows hold the head's columns.
        let (q_rows, g_rows, transposes) = unsafe {
            let q_lines = Lines::new((by_rows(self.q, q), Some(rounded.q)), true, d);
            let g_lines = Lines::new((by_rows(self.g, g), g_rounded), true, d);
            let transposes = keys_values.then(|| {
                let q_t = Lines::new((by_rows(self.q, q), Some(rounded.q)), false, rows);
                let g_t = Lines::new((by_rows(self.g, g), g_rounded), false, rows);
                probabilities.shape((rows, ks));
                slopes.shape((rows, ks));
                (
                    RowsOfA::new(&q_t, d, row_depth, queries_t),
                    RowsOfA::new(&g_t, d, row_depth, gradients_t),
                )
            });
            (
                RowsOfA::new(&q_lines, rows, depth, queries),
                RowsOfA::new(&g_lines, rows, depth, gradients),
                transposes,
            )
        };
        let sum_width = score_width.max(head_width);
        // The tiles' operands and sums from cache lines (`crate::aligned`).
        let scores = crate::aligned::lines(scores, ROWS * score_width, 0.0);
        let products = crate::aligned::lines(products, ROWS * score_width, 0.0);
        let sums = crate::aligned::lines(sums, ROWS * sum_width, 0.0);
        let slope_rows = crate::aligned::lines(slope_rows, ROWS * key_depth, 0);
        let mut states = [GradRow::default(); ROWS];
        for block in 0..rows.div_ceil(ROWS) {
            let block_rows = ROWS.min(rows - block * ROWS);
            // SAFETY: the packed rows hold the block's 16 rows; `scores` and `products`
            // 16 rows of the keys' blocks.
            unsafe {
                let a = q_rows.block(block, queries);
                multiply_rows(a, keys_t, (scores.as_mut_ptr(), score_width * 4));
                let a = g_rows.block(block, gradients);
                multiply_rows(a, values_t, (products.as_mut_ptr(), score_width * 4));
            }
            for (row, state) in states.iter_mut().enumerate().take(block_rows) {
                let limit = if self.causal {
                    (position + block * ROWS + row + 1).min(ks)
                } else {
                    ks
                };
                let scores = &mut scores[row * score_width..][..score_width];
                let products = &products[row * score_width..][..score_width];
                // SAFETY: compiled for AVX-512 (the caller); rows of whole registers.
                *state = unsafe { rows::grad_row(scores, products, scale, limit) };
            }
            // P and dS of the block's rows, a pair of rows at a time (a missing second
            // row is zeros).
            for pair in 0..block_rows.div_ceil(2) {
                let rows_of_pair = [2 * pair, (2 * pair + 1).min(ROWS - 1)];
                let present = [true, 2 * pair + 1 < block_rows];
                let lines = rows_of_pair.map(|row| {
                    (
                        &scores[row * score_width..][..score_width],
                        &products[row * score_width..][..score_width],
                    )
                });
                let (even_slopes, odd_slopes) = slope_rows.split_at_mut((2 * pair + 1) * key_depth);
                let slope_lines = [
                    &mut even_slopes[2 * pair * key_depth..],
                    &mut odd_slopes[..key_depth],
                ];
                let pair_row = (block * ROWS) / 2 + pair;
                let out = PairOut {
                    slope_rows: slope_lines,
                    panels: keys_values.then_some((&mut *probabilities, &mut *slopes, pair_row)),
                };
                let states = (rows_of_pair.map(|row| states[row]), present);
                // SAFETY: as above; the panels are shaped for the chunk's rows and keys.
                unsafe { rows::write_pair(lines, states, ks, out) };
            }
            if let Some(queries) = outputs.queries {
                // dQ = scale dS K for the block's rows.
                // SAFETY: `slope_rows` holds 16 rows of the keys' depth; `sums` 16 rows
                // of the head's blocks.
                unsafe {
                    let a = (slope_rows.as_ptr(), key_depth * 2);
                    multiply_rows(a, keys, (sums.as_mut_ptr(), head_width * 4));
                }
                for row in 0..block_rows {
                    let out_row = q_row + (block * ROWS + row) as i64;
                    let offset = out_row * queries.row + queries.at + head * d as i64;
                    // SAFETY: the output holds the chunk's rows and the head's columns.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut(buffers.out.offset(offset as isize), d)
                    };
                    let sums = &sums[row * head_width..][..d];
                    for (out, &sum) in out.iter_mut().zip(sums) {
                        *out = scale * sum;
                    }
                }
            }
        }
        let (Some((placing, values_after)), Some((q_t, g_t))) = (outputs.keys_values, transposes)
        else {
            return;
        };
        // Pairs of rows past the chunk's are zeros (the products' depth).
        probabilities.zero_pairs_from(rows.div_ceil(2));
        slopes.zero_pairs_from(rows.div_ceil(2));
        // dK^T = scale Q^T dS and dV^T = dO^T P, 16 head columns at a time, written
        // transposed into the keys' rows.
        let parts = [
            ((q_t, &*queries_t), &*slopes, placing.at, scale),
            (
                (g_t, &*gradients_t),
                &*probabilities,
                placing.at + values_after,
                1.0,
            ),
        ];
        let mut transposed = [0u32; ROWS * ROWS];
        for ((a_rows, packed), panel, column_at, factor) in parts {
            let first = k_first * placing.row + column_at + head * d as i64;
            for block in 0..d.div_ceil(ROWS) {
                // SAFETY: the transposes hold the head's columns in blocks of 16 rows
                // of the chunk's depth; `sums` 16 rows of the keys' blocks.
                unsafe {
                    let a = a_rows.block(block, packed);
                    multiply_rows(a, panel, (sums.as_mut_ptr(), score_width * 4));
                }
                let columns = ROWS.min(d - block * ROWS);
                for key_block in 0..ks.div_ceil(ROWS) {
                    // The sums of 16 keys, a key's 16 head columns to a row.
                    let rows = std::array::from_fn(|column| {
                        sums[column * score_width + key_block * ROWS..].as_ptr() as *const u32
                    });
                    // SAFETY: each of the sums' 16 rows holds the keys' blocks; the host
                    // has AVX-512 (`TileInputs::of`).
                    unsafe { crate::amx::transpose_16x16(rows, &mut transposed) };
                    let keys = key_block * ROWS..ks.min((key_block + 1) * ROWS);
                    for (key, values) in keys.zip(transposed.chunks_exact(ROWS)) {
                        let offset = first + key as i64 * placing.row + (block * ROWS) as i64;
                        // SAFETY: the output holds the element's key rows and the head's
                        // columns.
                        let out = unsafe {
                            std::slice::from_raw_parts_mut(
                                buffers.keys_out.offset(offset as isize),
                                columns,
                            )
                        };
                        for (out, &bits) in out.iter_mut().zip(values) {
                            let value = factor * f32::from_bits(bits);
                            *out = if first_chunk { value } else { *out + value };
                        }
                    }
                }
            }
        }
    }
}
