//! Attention's gradients on tensor cores (bf16 storage on a GPU, the query rows'
//! statistics saved by an `AttentionPart::Statistics` step): a warp per (head, tile of
//! 16 packed rows), every product an `mma.m16n8k16` (bf16 in, f32 out), the
//! flash-attention-2 backward without a grid-wide step:
//!
//! - the queries' gradient (a tile of query rows): for each 16 keys of the element,
//!   `S = Q K^T` and `dP = dO V^T`, then `P = exp(scale S - m) / l` and
//!   `dS = P (dP - D)` from the rows' saved statistics (`m`, `l`, `D = rowsum(P dP)`), and
//!   `dQ += dS K`;
//! - the keys' and values' (a tile of key rows): for each 16 queries of the element, the
//!   transposes `S^T = K Q^T` and `dP^T = V dO^T`, `P^T` and `dS^T` from the queries'
//!   statistics, `dV += P^T dO` and `dK += dS^T Q`.
//!
//! `P` and `dS` are rounded to bf16 as the `A` fragment of the next product (their `C`
//! fragments' layout is `A`'s). A tile's rows of other elements are computed and dropped,
//! each written in its own element's turn. Causal masks count positions within the
//! element, as the warp kernels do.

use std::ops::Range;

use super::attention::visible_keys;
use super::fragments::{a_of_c, tensor_core_storage, HeadColumns, Lane, Source, TILE};
use super::*;
use crate::builder::{FragmentA, FragmentC};

/// The widest head whose gradients run on tensor cores (a lane keeps two heads' rows of
/// fragments and two gradients' accumulators).
const WIDEST_HEAD: i64 = 64;

/// Whether `step`'s GPU kernel runs on tensor cores: a gradient (not the statistics)
/// reading saved statistics, floats stored as bf16 by an f32 program, heads of at most
/// [`WIDEST_HEAD`] columns.
pub(crate) fn grad_on_tensor_cores(
    step: &AttentionGrad,
    float: nestor_passes::FloatType,
    storage: Storage,
) -> bool {
    tensor_core_storage(float, storage)
        && step.part != AttentionPart::Statistics
        && step.statistics.is_some()
        && (1..=WIDEST_HEAD).contains(&step.head_dim)
}

/// The buffers of the kernel: its output, `Q`, `K`, `V`, `dO`, the statistics, the
/// query and key offsets and the elements of the range's rows.
pub(super) struct TensorGradBuffers<'ctx> {
    pub(super) out: PointerValue<'ctx>,
    pub(super) matrices: [PointerValue<'ctx>; 4],
    pub(super) statistics: Local<'ctx>,
    pub(super) offsets: [PointerValue<'ctx>; 2],
    pub(super) elements: PointerValue<'ctx>,
}

/// The kernel over the whole range `end` (rows x heads: query rows for the queries'
/// gradient, key rows for the keys' and values').
pub(super) fn tensor_attention_grad<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    step: &AttentionGrad,
    buffers: TensorGradBuffers<'ctx>,
    end: IntValue<'ctx>,
) -> Gen<()> {
    let heads = kernel.i64(step.heads);
    let rows = kernel.div(end, heads)?;
    let tile_rows = kernel.i64(TILE);
    let tiles = kernel.div(kernel.add(rows, kernel.i64(TILE - 1))?, tile_rows)?;
    let chunks = (step.head_dim + 7) / 8;
    let warp = GradWarp {
        kernel,
        step,
        buffers: &buffers,
        chunks,
        gradients: [
            kernel.accumulator_array("first_gradient", chunks * 4)?,
            kernel.accumulator_array("second_gradient", chunks * 4)?,
        ],
    };
    kernel.parallel_rows(kernel.i64(0), kernel.mul(tiles, heads)?, |task, lanes| {
        let head = kernel.div(task, tiles)?;
        let first_row = kernel.mul(kernel.rem(task, tiles)?, tile_rows)?;
        let last_row = kernel.min(
            kernel.add(first_row, kernel.i64(TILE - 1))?,
            kernel.sub(rows, kernel.i64(1))?,
        )?;
        let lane = Lane::of(kernel, lanes)?;
        let tile_rows = lane.rows(kernel, first_row)?;
        let valid = tile_rows.map(|row| kernel.less(row, rows));
        let [low, high] = valid;
        let tile = GradTile {
            head,
            lane: &lane,
            rows: tile_rows,
            valid: [low?, high?],
        };
        let first_element = kernel.load_i64(buffers.elements, first_row)?;
        let last_element = kernel.load_i64(buffers.elements, last_row)?;
        kernel.for_range(
            first_element,
            kernel.add(last_element, kernel.i64(1))?,
            |element| warp.element(&tile, element),
        )
    })
}

/// What a warp's tasks share: the step, its buffers, the gradients'
/// chunks of 8 columns and their `C` fragments (dQ; or dK, dV).
struct GradWarp<'a, 'ctx, 'm> {
    kernel: &'a Kernel<'ctx, 'm>,
    step: &'a AttentionGrad,
    buffers: &'a TensorGradBuffers<'ctx>,
    chunks: i64,
    gradients: [Local<'ctx>; 2],
}

/// A warp's tile: its head, the lane's place, its two rows and whether each exists.
struct GradTile<'a, 'ctx> {
    head: IntValue<'ctx>,
    lane: &'a Lane<'ctx>,
    rows: [IntValue<'ctx>; 2],
    valid: [IntValue<'ctx>; 2],
}

/// An element as a tile sees it: its first query and key rows and their counts.
struct Element<'ctx> {
    first_query: IntValue<'ctx>,
    queries: IntValue<'ctx>,
    first_key: IntValue<'ctx>,
    keys: IntValue<'ctx>,
}

/// A query row's saved statistics: the largest score, the sum of exponentials and
/// `rowsum(P dP)`.
#[derive(Clone, Copy)]
struct Statistics<'ctx> {
    largest: FloatValue<'ctx>,
    total: FloatValue<'ctx>,
    dot: FloatValue<'ctx>,
}

impl<'ctx> GradWarp<'_, 'ctx, '_> {
    /// This head's columns of `Q`, `K`, `V` or `dO` (`matrix` 0 to 3).
    fn head(&self, head: IntValue<'ctx>, matrix: usize) -> Gen<HeadColumns<'_, 'ctx>> {
        let (kernel, step) = (self.kernel, self.step);
        let access = [&step.q, &step.k, &step.v, &step.g][matrix];
        Ok(HeadColumns {
            source: Source::Buffer {
                buffer: self.buffers.matrices[matrix],
                access,
                base: kernel.mul(head, kernel.i64(step.head_dim))?,
            },
            width: step.head_dim,
        })
    }

    /// The saved statistics of packed query row `row` (read at row 0 where `valid` is
    /// false).
    fn statistics(
        &self,
        head: IntValue<'ctx>,
        (row, valid): (IntValue<'ctx>, IntValue<'ctx>),
    ) -> Gen<Statistics<'ctx>> {
        let kernel = self.kernel;
        let row = kernel.select_index(valid, row, kernel.i64(0))?;
        let entry = kernel.add(kernel.mul(row, kernel.i64(self.step.heads))?, head)?;
        let at = kernel.mul(entry, kernel.i64(super::attention::STATISTICS))?;
        let value = |index: i64| -> Gen<FloatValue<'ctx>> {
            kernel.load_local(self.buffers.statistics, kernel.add(at, kernel.i64(index))?)
        };
        Ok(Statistics {
            largest: value(0)?,
            total: value(1)?,
            dot: value(2)?,
        })
    }

    /// `P` and `dS` of one score: `p = exp(scale s - m) / l` where `seen`, else 0, and
    /// `p (dp - D)`.
    fn slopes(
        &self,
        (score, slope): (FloatValue<'ctx>, FloatValue<'ctx>),
        statistics: Statistics<'ctx>,
        seen: IntValue<'ctx>,
    ) -> Gen<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let kernel = self.kernel;
        let scaled = kernel.fmul(score, kernel.constant(self.step.scale.0))?;
        let shifted = kernel.fsub(scaled, statistics.largest)?;
        let p = kernel.fdiv(kernel.fast_exp(shifted)?, statistics.total)?;
        let p = kernel.select(seen, p, kernel.constant(0.0))?;
        let ds = kernel.fmul(p, kernel.fsub(slope, statistics.dot)?)?;
        Ok((p, ds))
    }

    /// Two `16 x 8` products of the tile's rows of `left` with rows `first + 8n +
    /// group` of `right` (`n` = 0, 1; those from `count` on are 0), over the head's
    /// columns: `left right^T` in two `C` fragments.
    fn products(
        &self,
        tile: &GradTile<'_, 'ctx>,
        (left, right): (usize, usize),
        (first, count): (IntValue<'ctx>, IntValue<'ctx>),
    ) -> Gen<[FragmentC<'ctx>; 2]> {
        let kernel = self.kernel;
        let (left, right) = (self.head(tile.head, left)?, self.head(tile.head, right)?);
        let zero = kernel.constant(0.0);
        let mut products = [[zero; 4]; 2];
        for (n, product) in (0i64..).zip(products.iter_mut()) {
            let offset = kernel.add(tile.lane.group, kernel.i64(8 * n))?;
            let row = (kernel.add(first, offset)?, kernel.less(offset, count)?);
            for chunk in 0..(self.step.head_dim + 15) / 16 {
                let a: FragmentA<'ctx> =
                    left.a(kernel, tile.lane, (tile.rows, tile.valid), chunk)?;
                let b = right.b_transposed(kernel, tile.lane, row, chunk)?;
                *product = kernel.mma_bf16(a, b, *product)?;
            }
        }
        Ok(products)
    }

    /// Adds `a` times rows `first..first + 16` of `matrix` (those from `count` on 0) to
    /// gradient `gradient`'s fragments.
    fn accumulate(
        &self,
        tile: &GradTile<'_, 'ctx>,
        (a, matrix): (FragmentA<'ctx>, usize),
        (first, count): (IntValue<'ctx>, IntValue<'ctx>),
        gradient: usize,
    ) -> Gen<()> {
        let kernel = self.kernel;
        let matrix = self.head(tile.head, matrix)?;
        let fragments = self.gradients[gradient];
        for slot in 0..self.chunks {
            let b = matrix.b(kernel, tile.lane, (first, count), slot)?;
            let at = |next: i64| kernel.i64(slot * 4 + next);
            let c: FragmentC<'ctx> = [
                kernel.load_local(fragments, at(0))?,
                kernel.load_local(fragments, at(1))?,
                kernel.load_local(fragments, at(2))?,
                kernel.load_local(fragments, at(3))?,
            ];
            let d = kernel.mma_bf16(a, b, c)?;
            for (next, value) in (0i64..).zip(d) {
                kernel.store_local(fragments, at(next), value)?;
            }
        }
        Ok(())
    }

    /// Element `element`'s turn in `tile`: when it has rows in the range, its gradient
    /// rows of the tile.
    fn element(&self, tile: &GradTile<'_, 'ctx>, element: IntValue<'ctx>) -> Gen<()> {
        let kernel = self.kernel;
        let [query_offsets, key_offsets] = self.buffers.offsets;
        let next = kernel.add(element, kernel.i64(1))?;
        let first_query = kernel.load_i64(query_offsets, element)?;
        let first_key = kernel.load_i64(key_offsets, element)?;
        let of = Element {
            first_query,
            queries: kernel.sub(kernel.load_i64(query_offsets, next)?, first_query)?,
            first_key,
            keys: kernel.sub(kernel.load_i64(key_offsets, next)?, first_key)?,
        };
        let keys_part = self.step.part == AttentionPart::KeysValues;
        // The range's rows of the element: its keys' or its queries'.
        let (first, count) = if keys_part {
            (of.first_key, of.keys)
        } else {
            (of.first_query, of.queries)
        };
        kernel.if_else(
            kernel.less(kernel.i64(0), count)?,
            || {
                let zero = kernel.constant(0.0);
                for gradient in self.gradients {
                    for value in 0..self.chunks * 4 {
                        kernel.store_local(gradient, kernel.i64(value), zero)?;
                    }
                }
                let positions = tile.rows.map(|row| kernel.sub(row, first));
                let [low, high] = positions;
                let positions = [low?, high?];
                if keys_part {
                    kernel.for_range_by(kernel.i64(0), of.queries, kernel.i64(TILE), |chunk| {
                        self.query_chunk(tile, &of, positions, chunk)
                    })?;
                } else {
                    // The tile's query rows: their statistics and the keys they see.
                    let [low, high] = [0, 1].map(|half| -> Gen<_> {
                        let row = (tile.rows[half], tile.valid[half]);
                        let visible =
                            visible_keys(kernel, self.step.causal, positions[half], of.keys)?;
                        Ok((self.statistics(tile.head, row)?, visible))
                    });
                    let rows = [low?, high?];
                    kernel.for_range_by(kernel.i64(0), of.keys, kernel.i64(TILE), |chunk| {
                        self.key_chunk(tile, &of, rows, chunk)
                    })?;
                }
                self.write(tile, (positions, count))
            },
            || Ok(()),
        )
    }

    /// The queries' gradient over keys `chunk..chunk + 16` of the element (the tile's
    /// rows are queries with `rows`' statistics, seeing that many keys).
    fn key_chunk(
        &self,
        tile: &GradTile<'_, 'ctx>,
        of: &Element<'ctx>,
        rows: [(Statistics<'ctx>, IntValue<'ctx>); 2],
        chunk: IntValue<'ctx>,
    ) -> Gen<()> {
        let kernel = self.kernel;
        let keys = (
            kernel.add(of.first_key, chunk)?,
            kernel.sub(of.keys, chunk)?,
        );
        let scores = self.products(tile, (0, 1), keys)?;
        let slopes = self.products(tile, (3, 2), keys)?;
        let mut ds = [[kernel.constant(0.0); 4]; 2];
        for n in 0..2 {
            for i in 0..4 {
                let half = i / 2;
                let key = kernel.add(
                    chunk,
                    kernel.add(tile.lane.pair, kernel.i64(8 * n as i64 + (i % 2) as i64))?,
                )?;
                let (statistics, visible) = rows[half];
                let seen = kernel.less(key, visible)?;
                ds[n][i] = self
                    .slopes((scores[n][i], slopes[n][i]), statistics, seen)?
                    .1;
            }
        }
        self.accumulate(tile, (a_of_c(kernel, ds)?, 1), keys, 0)
    }

    /// The keys' and values' gradients over queries `chunk..chunk + 16` of the element
    /// (the tile's rows are keys at `positions` in it).
    fn query_chunk(
        &self,
        tile: &GradTile<'_, 'ctx>,
        of: &Element<'ctx>,
        positions: [IntValue<'ctx>; 2],
        chunk: IntValue<'ctx>,
    ) -> Gen<()> {
        let kernel = self.kernel;
        let queries = (
            kernel.add(of.first_query, chunk)?,
            kernel.sub(of.queries, chunk)?,
        );
        let scores = self.products(tile, (1, 0), queries)?;
        let slopes = self.products(tile, (2, 3), queries)?;
        let zero = kernel.constant(0.0);
        let (mut p, mut ds) = ([[zero; 4]; 2], [[zero; 4]; 2]);
        for n in 0..2 {
            for next in 0..2 {
                // The lane's query of fragment `n`'s values `next` and `2 + next`.
                let query = kernel.add(
                    chunk,
                    kernel.add(tile.lane.pair, kernel.i64(8 * n as i64 + next as i64))?,
                )?;
                let exists = kernel.less(query, of.queries)?;
                let row = kernel.add(of.first_query, query)?;
                let statistics = self.statistics(tile.head, (row, exists))?;
                for (half, position) in positions.into_iter().enumerate() {
                    let seen = if self.step.causal {
                        // A key is seen by the queries at or after its position.
                        let after = kernel.less(query, position)?;
                        kernel.and(exists, kernel.not(after)?)?
                    } else {
                        exists
                    };
                    let i = 2 * half + next;
                    (p[n][i], ds[n][i]) =
                        self.slopes((scores[n][i], slopes[n][i]), statistics, seen)?;
                }
            }
        }
        self.accumulate(tile, (a_of_c(kernel, p)?, 3), queries, 1)?;
        self.accumulate(tile, (a_of_c(kernel, ds)?, 0), queries, 0)
    }

    /// The tile's rows that are the element's (at `positions`, below `count`): dQ
    /// scaled (`[Lq, heads, head_dim]`), or dK scaled and dV (`[Lk, 2, heads,
    /// head_dim]`).
    fn write(
        &self,
        tile: &GradTile<'_, 'ctx>,
        (positions, count): ([IntValue<'ctx>; 2], IntValue<'ctx>),
    ) -> Gen<()> {
        let (kernel, step) = (self.kernel, self.step);
        let keys_part = step.part == AttentionPart::KeysValues;
        let row_width = step.heads * step.head_dim;
        let base = kernel.mul(tile.head, kernel.i64(step.head_dim))?;
        let parts: Range<usize> = if keys_part { 0..2 } else { 0..1 };
        for (half, (position, row)) in positions.into_iter().zip(tile.rows).enumerate() {
            let own = kernel.and(
                kernel.less(kernel.i64(-1), position)?,
                kernel.less(position, count)?,
            )?;
            kernel.if_else(
                own,
                || {
                    for part in parts.clone() {
                        let scale = if part == 0 { step.scale.0 } else { 1.0 };
                        let row_start = if keys_part {
                            kernel.mul(row, kernel.i64(2 * row_width))?
                        } else {
                            kernel.mul(row, kernel.i64(row_width))?
                        };
                        let row_start =
                            kernel.add(row_start, kernel.i64(part as i64 * row_width))?;
                        for slot in 0..self.chunks {
                            for next in 0..2 {
                                let column =
                                    kernel.add(tile.lane.pair, kernel.i64(8 * slot + next))?;
                                let value = kernel.load_local(
                                    self.gradients[part],
                                    kernel.i64(slot * 4 + 2 * half as i64 + next),
                                )?;
                                let value = kernel.fmul(value, kernel.constant(scale))?;
                                let at = kernel.add(row_start, kernel.add(base, column)?)?;
                                let inside = kernel.less(column, kernel.i64(step.head_dim))?;
                                kernel.if_else(
                                    inside,
                                    || kernel.store_float(self.buffers.out, at, value),
                                    || Ok(()),
                                )?;
                            }
                        }
                    }
                    Ok(())
                },
                || Ok(()),
            )?;
        }
        Ok(())
    }
}
