//! Varlen attention on tensor cores: bf16 storage on a GPU, a warp per (head, tile of
//! 16 packed query rows), both products as `mma.m16n8k16` (bf16 in, f32 out). A block
//! takes as many consecutive tiles as it has warps; when they are all one element's and
//! head's, the block stages that element's keys and values through shared memory
//! ([`STAGED_FLOATS`] at a time) and every warp reads its `B` fragments there, else each
//! warp reads them from memory.
//!
//! A warp holds its tile's queries as `A` fragments, and for each element with rows in
//! the tile takes that element's keys 16 at a time: the scores `S = Q K^T` (two
//! `16 x 8` products a head chunk of 16 columns), an online softmax per row in f32 (a
//! row's four lanes combine their maxima and sums with shuffles), the probabilities
//! rounded to bf16 as the `A` fragment of `P V` (the layout of `S`'s two fragments is
//! `A`'s: no shuffles), and the output rows accumulated in `C` fragments of f32. The
//! rows of other elements in the tile are computed and dropped; each is written in its
//! own element's turn. Semantics are the warp kernel's (`attention.rs`): a row without
//! a finite score gives 0, a NaN score makes the row NaN, a masked (future) key's NaN
//! or +inf score makes the row NaN and its values count with weight 0.

use std::ops::Range;

use super::attention::{output_scale, visible_keys};
use super::fragments::{a_of_c, tensor_core_storage, HeadColumns, Lane, Source, TILE};
use super::*;
use crate::builder::{FragmentA, FragmentC};

/// Query rows of a warp's tile: the rows of an `m16n8k16` product.
const TILE_ROWS: i64 = TILE;
/// The widest head whose query fragments a lane keeps in registers for all its keys;
/// wider ones are read again (from the caches) for each chunk of keys, so that the
/// output's fragments fit beside them.
const HELD_QUERY_COLUMNS: i64 = 64;
/// Output fragments (of 8 value columns) a lane keeps at once: wider values take the
/// keys again for each group of 64 columns (their scores recomputed), so that the
/// fragments fit in registers.
const GROUP_SLOTS: i64 = 8;
/// Keys a warp takes at once: the `k` of the product `P V`.
const KEY_CHUNK: i64 = TILE;
/// The widest head (queries and keys, or values) whose fragments a lane keeps in
/// registers.
const WIDEST_HEAD: i64 = 128;

/// Whether `step`'s GPU kernel runs on tensor cores: floats stored as bf16 by an f32
/// program, heads of at most [`WIDEST_HEAD`] columns.
pub(crate) fn on_tensor_cores(
    step: &Attention,
    float: nestor_passes::FloatType,
    storage: Storage,
) -> bool {
    tensor_core_storage(float, storage)
        && (1..=WIDEST_HEAD).contains(&step.head_dim)
        && (1..=WIDEST_HEAD).contains(&step.value_dim)
}

/// GPU threads per task (a query row and head) of the tensor-core kernel: a warp per
/// [`TILE_ROWS`] rows.
pub(crate) const THREADS_PER_ROW: u32 = (WARP_LANES / TILE_ROWS) as u32;

/// The kernel: `buffers` are the output, `Q`, `K`, `V`, the query and key offsets and
/// the rows' elements; `end` the whole range (query rows x heads: the device executor
/// launches it whole).
pub(super) fn tensor_attention<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    step: &Attention,
    buffers: [PointerValue<'ctx>; 7],
    end: IntValue<'ctx>,
) -> Gen<()> {
    let [out, queries, keys, values, query_offsets, key_offsets, elements] = buffers;
    let heads = kernel.i64(step.heads);
    let rows = kernel.div(end, heads)?;
    let tile_rows = kernel.i64(TILE_ROWS);
    let tiles = kernel.div(kernel.add(rows, kernel.i64(TILE_ROWS - 1))?, tile_rows)?;
    let value_chunks = (step.value_dim + 7) / 8;
    let warp = Warp {
        kernel,
        step,
        buffers: [queries, keys, values],
        offsets: [query_offsets, key_offsets],
        output: kernel.accumulator_array("output", value_chunks.min(GROUP_SLOTS) * 4)?,
        stats: [
            kernel.accumulators(["largest", "total", "poisoned"])?,
            kernel.accumulators(["largest_high", "total_high", "poisoned_high"])?,
        ],
        rows,
        value_chunks,
    };
    let width = step.head_dim + step.value_dim;
    let stage = Stage {
        shared: kernel.shared_floats(stage_keys(step) * width)?,
        keys: stage_keys(step),
        place: kernel.block_place()?,
    };
    let place = &stage.place;
    let (warps, warp_index, lanes) = (place.warps, place.warp, place.lanes);
    let tasks = kernel.mul(tiles, heads)?;
    let last_task = kernel.sub(tasks, kernel.i64(1))?;
    // A task's head, its tile's first packed row and the element of its first and last
    // rows.
    let place_of = |task: IntValue<'ctx>| -> Gen<_> {
        let first_row = kernel.mul(kernel.rem(task, tiles)?, tile_rows)?;
        let last_row = kernel.min(
            kernel.add(first_row, kernel.i64(TILE_ROWS - 1))?,
            kernel.sub(rows, kernel.i64(1))?,
        )?;
        Ok((
            kernel.div(task, tiles)?,
            first_row,
            kernel.load_i64(elements, first_row)?,
            kernel.load_i64(elements, last_row)?,
        ))
    };
    kernel.warp_groups(place, tasks, |first_task| {
        let own = kernel.add(first_task, warp_index)?;
        let active = kernel.less(own, tasks)?;
        // Warps past the last task take its tile (and write nothing).
        let (head, first_row, first_element, last_element) = place_of(kernel.min(own, last_task)?)?;
        let group_last = kernel.min(
            kernel.add(first_task, kernel.sub(warps, kernel.i64(1))?)?,
            last_task,
        )?;
        let (group_head, _, group_element, _) = place_of(first_task)?;
        let (last_head, _, _, last_of_group) = place_of(group_last)?;
        let one_source = kernel.and(
            kernel.equal(group_head, last_head)?,
            kernel.equal(group_element, last_of_group)?,
        )?;
        let lane = Lane::of(kernel, lanes)?;
        let tile = warp.tile(head, first_row, &lane)?;
        kernel.if_else(
            one_source,
            || {
                let (_, keys) = warp.keys_of(&tile, group_element, Some(active))?;
                warp.run((&tile, &keys), out, Some(&stage))
            },
            || {
                kernel.if_else(
                    active,
                    || {
                        kernel.for_range(
                            first_element,
                            kernel.add(last_element, kernel.i64(1))?,
                            |element| warp.element(&tile, element, out),
                        )
                    },
                    || Ok(()),
                )
            },
        )
    })
}

/// The most floats of keys and values a block stages in shared memory at once (16 KiB).
const STAGED_FLOATS: i64 = 4096;

/// Keys a block stages at once: a multiple of [`KEY_CHUNK`], at most
/// [`STAGED_FLOATS`] floats of keys and values (at least one chunk).
fn stage_keys(step: &Attention) -> i64 {
    let width = (step.head_dim + step.value_dim).max(1);
    (STAGED_FLOATS / width / KEY_CHUNK).max(1) * KEY_CHUNK
}

/// Floats of shared memory a block of the tensor-core kernel uses.
pub(crate) fn staged_floats(step: &Attention) -> i64 {
    stage_keys(step) * (step.head_dim + step.value_dim)
}

/// A block's staging of keys and values: its shared memory (`keys` rows of `K`'s then
/// `V`'s head columns) and its place in the grid.
struct Stage<'ctx> {
    shared: PointerValue<'ctx>,
    keys: i64,
    place: crate::builder::BlockPlace<'ctx>,
}

/// What a warp's tasks share: the step, `Q`, `K`, `V`, the query and key offsets, the
/// output fragments (of a group of at most [`GROUP_SLOTS`] of the `value_chunks`, four
/// f32 each) and the running statistics of the
/// lane's two rows (`group` and `group + 8`: the largest score, the sum of
/// exponentials, whether a masked score poisons the row).
struct Warp<'a, 'ctx, 'm> {
    kernel: &'a Kernel<'ctx, 'm>,
    step: &'a Attention,
    buffers: [PointerValue<'ctx>; 3],
    offsets: [PointerValue<'ctx>; 2],
    output: Local<'ctx>,
    stats: [[PointerValue<'ctx>; 3]; 2],
    rows: IntValue<'ctx>,
    value_chunks: i64,
}

/// A warp's tile: its head, the lane's place and two rows, and the queries as `A`
/// fragments (one per 16 columns of the head; none when they are read again for each
/// chunk of keys).
struct Tile<'a, 'ctx> {
    head: IntValue<'ctx>,
    lane: &'a Lane<'ctx>,
    /// The lane's rows, `first + group` and `first + group + 8`.
    rows: [IntValue<'ctx>; 2],
    queries: Vec<FragmentA<'ctx>>,
}

/// Where a chunk's keys and values are read: this head's columns of `K` and `V` (their
/// packed rows, `first` the row of the element's key 0), or a stage of them in shared
/// memory (`first` minus the stage's first key).
struct KeySource<'a, 'ctx> {
    keys: HeadColumns<'a, 'ctx>,
    values: HeadColumns<'a, 'ctx>,
    first: IntValue<'ctx>,
}

/// One element's keys as a tile sees them: where they start, how many, and for each of
/// the lane's rows whether it is the element's and how many keys it sees.
struct Keys<'ctx> {
    first: IntValue<'ctx>,
    count: IntValue<'ctx>,
    own: [IntValue<'ctx>; 2],
    visible: [IntValue<'ctx>; 2],
}

impl<'a, 'ctx, 'm> Warp<'a, 'ctx, 'm> {
    /// This head's columns of `Q`, `K` (`buffer` 0, 1: `head_dim` wide) or `V` (2:
    /// `value_dim`).
    fn head(&self, head: IntValue<'ctx>, buffer: usize) -> Gen<HeadColumns<'a, 'ctx>> {
        let (kernel, step) = (self.kernel, self.step);
        let (access, width) = match buffer {
            0 => (&step.q, step.head_dim),
            1 => (&step.k, step.head_dim),
            _ => (&step.v, step.value_dim),
        };
        Ok(HeadColumns {
            source: Source::Buffer {
                buffer: self.buffers[buffer],
                access,
                base: kernel.mul(head, kernel.i64(width))?,
            },
            width,
        })
    }

    /// The tile of `head` from packed query row `first`: the lane's rows, and its query
    /// fragments when the head is at most [`HELD_QUERY_COLUMNS`] wide.
    fn tile<'l>(
        &self,
        head: IntValue<'ctx>,
        first: IntValue<'ctx>,
        lane: &'l Lane<'ctx>,
    ) -> Gen<Tile<'l, 'ctx>> {
        let mut tile = Tile {
            head,
            lane,
            rows: lane.rows(self.kernel, first)?,
            queries: Vec::new(),
        };
        if self.step.head_dim <= HELD_QUERY_COLUMNS {
            tile.queries = (0..(self.step.head_dim + 15) / 16)
                .map(|chunk| self.queries(&tile, chunk))
                .collect::<Gen<_>>()?;
        }
        Ok(tile)
    }

    /// The `A` fragment of the tile's queries in head columns `16 chunk..` (rows past
    /// the last and columns past the head's are 0).
    fn queries(&self, tile: &Tile<'_, 'ctx>, chunk: i64) -> Gen<FragmentA<'ctx>> {
        if let Some(fragment) = tile.queries.get(chunk as usize) {
            return Ok(*fragment);
        }
        let kernel = self.kernel;
        let valid = tile.rows.map(|row| kernel.less(row, self.rows));
        let [low, high] = valid;
        let queries = self.head(tile.head, 0)?;
        queries.a(kernel, tile.lane, (tile.rows, [low?, high?]), chunk)
    }

    /// Element `element`'s turn in `tile`: when it has query rows, its keys, then its
    /// rows of the tile written to `out`.
    fn element(
        &self,
        tile: &Tile<'_, 'ctx>,
        element: IntValue<'ctx>,
        out: PointerValue<'ctx>,
    ) -> Gen<()> {
        let kernel = self.kernel;
        let (has_rows, keys) = self.keys_of(tile, element, None)?;
        kernel.if_else(has_rows, || self.run((tile, &keys), out, None), || Ok(()))
    }

    /// Whether `element` has query rows, and its keys as `tile` sees them (its rows
    /// only where `active`, when given).
    fn keys_of(
        &self,
        tile: &Tile<'_, 'ctx>,
        element: IntValue<'ctx>,
        active: Option<IntValue<'ctx>>,
    ) -> Gen<(IntValue<'ctx>, Keys<'ctx>)> {
        let kernel = self.kernel;
        let [query_offsets, key_offsets] = self.offsets;
        let next = kernel.add(element, kernel.i64(1))?;
        let first_query = kernel.load_i64(query_offsets, element)?;
        let query_end = kernel.load_i64(query_offsets, next)?;
        let first = kernel.load_i64(key_offsets, element)?;
        let count = kernel.sub(kernel.load_i64(key_offsets, next)?, first)?;
        let own_and_visible = |row: IntValue<'ctx>| -> Gen<(IntValue<'ctx>, IntValue<'ctx>)> {
            let own = kernel.and(
                kernel.less(row, query_end)?,
                kernel.less(kernel.sub(first_query, kernel.i64(1))?, row)?,
            )?;
            let position = kernel.sub(row, first_query)?;
            let visible = visible_keys(kernel, self.step.causal, position, count)?;
            let own = match active {
                Some(active) => kernel.and(own, active)?,
                None => own,
            };
            Ok((own, visible))
        };
        let (low_own, low_visible) = own_and_visible(tile.rows[0])?;
        let (high_own, high_visible) = own_and_visible(tile.rows[1])?;
        let keys = Keys {
            first,
            count,
            own: [low_own, high_own],
            visible: [low_visible, high_visible],
        };
        Ok((kernel.less(first_query, query_end)?, keys))
    }

    /// The tile's rows of one element: for each group of output columns, every chunk of
    /// its keys (read from memory, or, with `stage`, staged by the whole block, which
    /// must all run this), then the rows written.
    fn run(
        &self,
        (tile, keys): (&Tile<'_, 'ctx>, &Keys<'ctx>),
        out: PointerValue<'ctx>,
        stage: Option<&Stage<'ctx>>,
    ) -> Gen<()> {
        let kernel = self.kernel;
        let groups = (self.value_chunks + GROUP_SLOTS - 1) / GROUP_SLOTS;
        for group in 0..groups {
            let slots = group * GROUP_SLOTS..self.value_chunks.min((group + 1) * GROUP_SLOTS);
            self.reset(slots.clone())?;
            match stage {
                None => {
                    let source = KeySource {
                        keys: self.head(tile.head, 1)?,
                        values: self.head(tile.head, 2)?,
                        first: keys.first,
                    };
                    kernel.for_range_by(
                        kernel.i64(0),
                        keys.count,
                        kernel.i64(KEY_CHUNK),
                        |chunk| self.key_chunk((tile, keys, &source), chunk, slots.clone()),
                    )?;
                }
                Some(stage) => {
                    kernel.for_range_by(
                        kernel.i64(0),
                        keys.count,
                        kernel.i64(stage.keys),
                        |first| self.staged_keys((tile, keys, stage), first, slots.clone()),
                    )?;
                }
            }
            self.write(tile, keys, out, slots)?;
        }
        Ok(())
    }

    /// Keys `first..first + stage.keys` of the element staged by the block (their
    /// `K` columns, then `V`'s, a row each, zero past the last key), then taken a chunk
    /// at a time from shared memory.
    fn staged_keys(
        &self,
        (tile, keys, stage): (&Tile<'_, 'ctx>, &Keys<'ctx>, &Stage<'ctx>),
        first: IntValue<'ctx>,
        slots: Range<i64>,
    ) -> Gen<()> {
        let (kernel, step) = (self.kernel, self.step);
        let width = step.head_dim + step.value_dim;
        let place = &stage.place;
        // Every warp is done with the last stage.
        kernel.barrier()?;
        for (matrix, offset) in [(1, 0), (2, step.head_dim)] {
            let columns = self.head(tile.head, matrix)?;
            let total = kernel.i64(stage.keys * columns.width);
            kernel.for_range_by(place.thread, total, place.threads, |at| {
                let (key, column) = (
                    kernel.div(at, kernel.i64(columns.width))?,
                    kernel.rem(at, kernel.i64(columns.width))?,
                );
                let key_index = kernel.add(first, key)?;
                let row = kernel.add(keys.first, key_index)?;
                let valid = kernel.less(key_index, keys.count)?;
                let value = columns.value_or_zero(kernel, (row, column), (Some(valid), None))?;
                let to = kernel.add(
                    kernel.mul(key, kernel.i64(width))?,
                    kernel.add(column, kernel.i64(offset))?,
                )?;
                kernel.store_shared(stage.shared, to, value)
            })?;
        }
        kernel.barrier()?;
        let staged = |base: i64, width: i64| HeadColumns {
            source: Source::Shared {
                shared: stage.shared,
                stride: step.head_dim + step.value_dim,
                base,
            },
            width,
        };
        let source = KeySource {
            keys: staged(0, step.head_dim),
            values: staged(step.head_dim, step.value_dim),
            first: kernel.sub(kernel.i64(0), first)?,
        };
        let end = kernel.min(kernel.add(first, kernel.i64(stage.keys))?, keys.count)?;
        kernel.for_range_by(first, end, kernel.i64(KEY_CHUNK), |chunk| {
            self.key_chunk((tile, keys, &source), chunk, slots.clone())
        })
    }

    /// Empty statistics and output fragments.
    fn reset(&self, slots: Range<i64>) -> Gen<()> {
        let kernel = self.kernel;
        let zero = kernel.constant(0.0);
        for [largest, total, poisoned] in self.stats {
            kernel.set(largest, kernel.constant(f64::NEG_INFINITY))?;
            kernel.set(total, zero)?;
            kernel.set(poisoned, zero)?;
        }
        for value in 0..slots.count() as i64 * 4 {
            kernel.store_local(self.output, kernel.i64(value), zero)?;
        }
        Ok(())
    }

    /// Keys `chunk..chunk + 16` of the element: scores, the online softmax of the
    /// lane's rows, and `P V` added to the output fragments.
    fn key_chunk(
        &self,
        (tile, keys, source): (&Tile<'_, 'ctx>, &Keys<'ctx>, &KeySource<'_, 'ctx>),
        chunk: IntValue<'ctx>,
        slots: Range<i64>,
    ) -> Gen<()> {
        let (kernel, step) = (self.kernel, self.step);
        let lane = tile.lane;
        // Scores: fragment `n` holds keys `chunk + 8n..`; its value `i` is row
        // `rows[i / 2]`, key `chunk + 8n + 2 thread + i % 2`.
        let keys_of_head = source.keys;
        let mut scores = Vec::with_capacity(2);
        for n in 0..2 {
            let key = kernel.add(chunk, kernel.add(lane.group, kernel.i64(8 * n))?)?;
            let key_row = (
                kernel.add(source.first, key)?,
                kernel.less(key, keys.count)?,
            );
            let mut sums: FragmentC<'ctx> = [kernel.constant(0.0); 4];
            for head_chunk in 0..(step.head_dim + 15) / 16 {
                let queries = self.queries(tile, head_chunk)?;
                let b = keys_of_head.b_transposed(kernel, lane, key_row, head_chunk)?;
                sums = kernel.mma_bf16(queries, b, sums)?;
            }
            scores.push(sums);
        }
        let mut probabilities = [[kernel.constant(0.0); 4]; 2];
        for half in 0..2 {
            let rescale =
                self.softmax_rows((tile, keys), chunk, &scores, half, &mut probabilities)?;
            for slot in 0..slots.clone().count() as i64 {
                for next in 0..2 {
                    let at = kernel.i64(slot * 4 + 2 * half as i64 + next);
                    let kept = kernel.load_local(self.output, at)?;
                    kernel.store_local(self.output, at, kernel.fmul(kept, rescale)?)?;
                }
            }
        }
        let a = a_of_c(kernel, probabilities)?;
        let values = source.values;
        let rest = (
            kernel.add(source.first, chunk)?,
            kernel.sub(keys.count, chunk)?,
        );
        for (local, slot) in (0i64..).zip(slots) {
            let b = values.b(kernel, lane, rest, slot)?;
            let c: FragmentC<'ctx> = [0, 1, 2, 3]
                .map(|next| kernel.load_local(self.output, kernel.i64(local * 4 + next)))
                .into_iter()
                .collect::<Gen<Vec<_>>>()?
                .try_into()
                .map_err(|_| crate::CodegenError::new("four output values"))?;
            let d = kernel.mma_bf16(a, b, c)?;
            for (next, value) in (0i64..).zip(d) {
                kernel.store_local(self.output, kernel.i64(local * 4 + next), value)?;
            }
        }
        Ok(())
    }

    /// The online softmax of the lane's row `half` (`rows[half]`) over this chunk's
    /// scores: the row's new maximum and sum (its four lanes combined), its
    /// probabilities into `probabilities[n][2 half..]`; returns the factor that rescales
    /// what the row kept.
    fn softmax_rows(
        &self,
        (tile, keys): (&Tile<'_, 'ctx>, &Keys<'ctx>),
        chunk: IntValue<'ctx>,
        scores: &[FragmentC<'ctx>],
        half: usize,
        probabilities: &mut [[FloatValue<'ctx>; 4]; 2],
    ) -> Gen<FloatValue<'ctx>> {
        let (kernel, step) = (self.kernel, self.step);
        let [largest, total, poisoned] = self.stats[half];
        let [zero, one] = [0.0, 1.0].map(|value| kernel.constant(value));
        let negative_infinity = kernel.constant(f64::NEG_INFINITY);
        let quad = tile.lane.quad;
        let mut seen_scores = Vec::with_capacity(4);
        for (n, fragment) in scores.iter().enumerate() {
            for next in 0..2 {
                let key = kernel.add(
                    chunk,
                    kernel.add(tile.lane.pair, kernel.i64(8 * n as i64 + next))?,
                )?;
                let score = kernel.fmul(
                    fragment[2 * half + next as usize],
                    kernel.constant(step.scale.0),
                )?;
                let seen = kernel.less(key, keys.visible[half])?;
                if step.causal {
                    // A masked key of the element (`visible <= count`): a score that is
                    // not below +inf poisons the row.
                    let masked = kernel.xor(kernel.less(key, keys.count)?, seen)?;
                    let below = kernel.float_compare(
                        FloatPredicate::OLT,
                        score,
                        kernel.constant(f64::INFINITY),
                    )?;
                    let poison =
                        kernel.select(kernel.and(masked, kernel.not(below)?)?, one, zero)?;
                    kernel.set(
                        poisoned,
                        kernel.extreme(kernel.get(poisoned)?, poison, true)?,
                    )?;
                }
                seen_scores.push((
                    n,
                    next as usize,
                    seen,
                    kernel.select(seen, score, negative_infinity)?,
                ));
            }
        }
        let mut chunk_largest = negative_infinity;
        for &(_, _, _, score) in &seen_scores {
            chunk_largest = kernel.extreme(chunk_largest, score, true)?;
        }
        let chunk_largest =
            kernel.across_lanes(quad, chunk_largest, |a, b| kernel.extreme(a, b, true))?;
        let before = kernel.get(largest)?;
        let after = kernel.extreme(before, chunk_largest, true)?;
        let nothing_yet = kernel.float_compare(FloatPredicate::OEQ, after, negative_infinity)?;
        // While every score so far is -inf nothing is kept (exp(-inf - -inf) is NaN).
        let rescale = kernel.select(
            nothing_yet,
            one,
            kernel.fast_exp(kernel.fsub(before, after)?)?,
        )?;
        let mut sum = zero;
        for (n, next, seen, score) in seen_scores {
            let weight = kernel.fast_exp(kernel.fsub(score, after)?)?;
            let weight =
                kernel.select(kernel.and(seen, kernel.not(nothing_yet)?)?, weight, zero)?;
            probabilities[n][2 * half + next] = weight;
            sum = kernel.fadd(sum, weight)?;
        }
        let sum = kernel.across_lanes(quad, sum, |a, b| kernel.fadd(a, b))?;
        kernel.set(
            total,
            kernel.fadd(kernel.fmul(kernel.get(total)?, rescale)?, sum)?,
        )?;
        kernel.set(largest, after)?;
        Ok(rescale)
    }

    /// The element's rows of the tile: each lane's columns `8 slot + 2 thread` and the
    /// next of its rows that are the element's, over the row's sum (0 without a finite
    /// score, NaN if poisoned).
    fn write(
        &self,
        tile: &Tile<'_, 'ctx>,
        keys: &Keys<'ctx>,
        out: PointerValue<'ctx>,
        slots: Range<i64>,
    ) -> Gen<()> {
        let (kernel, step) = (self.kernel, self.step);
        let (quad, pair) = (tile.lane.quad, tile.lane.pair);
        let value_base = kernel.mul(tile.head, kernel.i64(step.value_dim))?;
        for half in 0..2 {
            let [largest, total, poisoned] = self.stats[half];
            let poisoned = kernel.across_lanes(quad, kernel.get(poisoned)?, |a, b| {
                kernel.extreme(a, b, true)
            })?;
            let inverse =
                output_scale(kernel, [kernel.get(largest)?, kernel.get(total)?, poisoned])?;
            let row = tile.rows[half];
            let out_row = kernel.mul(row, kernel.i64(step.heads * step.value_dim))?;
            kernel.if_else(
                keys.own[half],
                || {
                    for (local, slot) in (0i64..).zip(slots.clone()) {
                        for next in 0..2 {
                            let column = kernel.add(pair, kernel.i64(8 * slot + next))?;
                            let inside = kernel.less(column, kernel.i64(step.value_dim))?;
                            let value = kernel.load_local(
                                self.output,
                                kernel.i64(local * 4 + 2 * half as i64 + next),
                            )?;
                            let value = kernel.fmul(value, inverse)?;
                            kernel.if_else(
                                inside,
                                || {
                                    let at =
                                        kernel.add(out_row, kernel.add(value_base, column)?)?;
                                    kernel.store_float(out, at, value)
                                },
                                || Ok(()),
                            )?;
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
