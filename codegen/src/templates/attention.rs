//! Varlen attention (online softmax, a query row and head a warp on a GPU) and its
//! gradient.

use super::tensor_attention::{on_tensor_cores, tensor_attention};
use super::tensor_attention_grad::{
    grad_on_tensor_cores, tensor_attention_grad, TensorGradBuffers,
};
use super::*;

/// Varlen attention without scores in memory: one (query row, head) per task of the
/// parallel loop (a warp's on a GPU: its lanes share the head's columns and add their
/// parts of each score with shuffles; one thread's on the host), an online softmax over
/// the keys of the row's element (the running
/// maximum rescales the running sum and output), as libtorch's scaled dot-product
/// attention: a row without a finite score (or without keys) gives 0, a NaN score makes
/// the row NaN, and with `causal` a masked (future) key's score that is NaN or +inf
/// makes the row NaN (libtorch adds -inf to it) and its values count with weight 0 (a
/// value that is not finite makes its column NaN, as libtorch's product does).
pub(super) fn attention<'ctx>(kernel: &Kernel<'ctx, '_>, step: &Attention) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, queries, keys, values, query_offsets, key_offsets, elements] = kernel.params([
        Role::Out,
        Role::Queries,
        Role::Keys,
        Role::Values,
        Role::Offsets,
        Role::KeyOffsets,
        Role::RowOwners,
    ])?;
    if kernel.on_gpu() && on_tensor_cores(step, kernel.float_type(), kernel.storage()) {
        let buffers = [
            out,
            queries,
            keys,
            values,
            query_offsets,
            key_offsets,
            elements,
        ];
        return tensor_attention(kernel, step, buffers, end);
    }
    // Each lane's output columns (every one on the host).
    let slots = (step.value_dim + kernel.lane_count() - 1) / kernel.lane_count();
    let query_slots = (step.head_dim + kernel.lane_count() - 1) / kernel.lane_count();
    let frame = Frame {
        kernel,
        step,
        buffers: [queries, keys, values],
        offsets: [query_offsets, key_offsets, elements],
        output: kernel.accumulator_array("output", slots)?,
        query: kernel.accumulator_array("query", query_slots)?,
        stats: kernel.accumulators(["largest", "total", "poisoned"])?,
        out,
    };
    if kernel.on_gpu() {
        if let Some(tile) = key_tile(step) {
            return frame.tiled(end, tile);
        }
    }
    kernel.parallel_rows(start, end, |task, lanes| {
        let row = kernel.div(task, kernel.i64(step.heads))?;
        let head = kernel.rem(task, kernel.i64(step.heads))?;
        frame.task(row, head, lanes)?.run_from_memory()
    })
}

/// How many of its element's keys a query at `position` sees: all `count`, or with
/// `causal` those up to its own position (none for a negative position).
pub(super) fn visible_keys<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    causal: bool,
    position: IntValue<'ctx>,
    count: IntValue<'ctx>,
) -> Gen<IntValue<'ctx>> {
    if causal {
        kernel.min(kernel.add(position, kernel.i64(1))?, count)
    } else {
        Ok(count)
    }
}

/// What an output row of the online softmax is multiplied by, from the row's largest
/// score, sum and poison: `1 / sum`, 0 without a finite score, NaN if poisoned.
pub(super) fn output_scale<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    [largest, total, poisoned]: [FloatValue<'ctx>; 3],
) -> Gen<FloatValue<'ctx>> {
    let [zero, one] = [0.0, 1.0].map(|value| kernel.constant(value));
    let inverse = kernel.fdiv(one, total)?;
    let inverse = kernel.select_if(
        FloatPredicate::OEQ,
        (largest, kernel.constant(f64::NEG_INFINITY)),
        zero,
        inverse,
    )?;
    kernel.select_if(
        FloatPredicate::OGT,
        (poisoned, zero),
        kernel.constant(f64::NAN),
        inverse,
    )
}

/// The most floats of keys and values a GPU block stages at once (16 KiB of f32).
const STAGED_FLOATS: i64 = 4096;

/// How many keys a GPU block of [`attention`] stages in shared memory at once (at most
/// 64, and [`STAGED_FLOATS`] floats of keys and values); `None` when one key's columns
/// are more than that (the warps then read the keys from memory).
fn key_tile(step: &Attention) -> Option<i64> {
    let width = step.head_dim + step.value_dim;
    (width > 0 && width <= STAGED_FLOATS).then(|| (STAGED_FLOATS / width).min(64))
}

/// Floats of shared memory a GPU block of [`attention`] uses.
pub(super) fn staged_floats(step: &Attention) -> i64 {
    key_tile(step).map_or(0, |tile| tile * (step.head_dim + step.value_dim))
}

/// What every task of [`attention`] shares: the step, its buffers (`Q`, `K`, `V`; the
/// query and key offsets and the rows' elements; the output) and the accumulators.
struct Frame<'a, 'ctx, 'm> {
    kernel: &'a Kernel<'ctx, 'm>,
    step: &'a Attention,
    buffers: [PointerValue<'ctx>; 3],
    offsets: [PointerValue<'ctx>; 3],
    output: Local<'ctx>,
    /// The lane's columns of the query row.
    query: Local<'ctx>,
    stats: [PointerValue<'ctx>; 3],
    out: PointerValue<'ctx>,
}

impl<'a, 'ctx, 'm> Frame<'a, 'ctx, 'm> {
    /// The task of query row `row` (packed) and head `head`, its accumulators reset.
    fn task(
        &self,
        row: IntValue<'ctx>,
        head: IntValue<'ctx>,
        lanes: Lanes<'ctx>,
    ) -> Gen<AttentionTask<'a, 'ctx, 'm>> {
        let kernel = self.kernel;
        let step = self.step;
        let [query_offsets, key_offsets, elements] = self.offsets;
        let element = kernel.load_i64(elements, row)?;
        let next = kernel.add(element, kernel.i64(1))?;
        let position = kernel.sub(row, kernel.load_i64(query_offsets, element)?)?;
        let first_key = kernel.load_i64(key_offsets, element)?;
        let key_count = kernel.sub(kernel.load_i64(key_offsets, next)?, first_key)?;
        let visible = visible_keys(kernel, step.causal, position, key_count)?;
        let task = AttentionTask {
            kernel,
            step,
            lanes,
            buffers: self.buffers,
            output: self.output,
            query: self.query,
            stats: self.stats,
            row,
            first_key,
            key_count,
            visible,
            query_base: kernel.mul(head, kernel.i64(step.head_dim))?,
            value_base: kernel.mul(head, kernel.i64(step.value_dim))?,
            out: self.out,
        };
        let [largest, total, poisoned] = self.stats;
        let zero = kernel.constant(0.0);
        kernel.set(largest, kernel.constant(f64::NEG_INFINITY))?;
        kernel.set(total, zero)?;
        kernel.set(poisoned, zero)?;
        task.columns(&|_, slot| kernel.store_local(self.output, slot, zero))?;
        let queries = self.buffers[0];
        kernel.lane_columns(lanes, step.head_dim, |column, slot| {
            let at = index(kernel, &step.q, row, kernel.add(task.query_base, column)?)?;
            kernel.store_local(self.query, slot, kernel.load_float(queries, at)?)
        })?;
        Ok(task)
    }

    /// The GPU kernel: a block per group of as many tasks as it has warps, a warp a
    /// task, the tasks head-major (task `t` is head `t / rows`, query row `t % rows`, so
    /// a group is consecutive query rows of a head). A group whose rows are of one
    /// element and head stages that element's keys and values through shared memory,
    /// `tile` keys at a time, which each warp then reads there; any other group's warps
    /// read them from memory. Either way a warp adds its scores in the order of the
    /// host's kernel. The launch covers the whole range (`0..rows x heads`).
    fn tiled(&self, end: IntValue<'ctx>, tile: i64) -> Gen<()> {
        let (kernel, step) = (self.kernel, self.step);
        let width = step.head_dim + step.value_dim;
        let shared = kernel.shared_floats(tile * width)?;
        let place = kernel.block_place()?;
        let (warps, warp, lanes) = (place.warps, place.warp, place.lanes);
        let heads = kernel.i64(step.heads);
        let rows = kernel.div(end, heads)?;
        let elements = self.offsets[2];
        kernel.warp_groups(&place, end, |first| {
            let last = kernel.sub(kernel.min(kernel.add(first, warps)?, end)?, kernel.i64(1))?;
            let own = kernel.add(first, warp)?;
            let active = kernel.and(kernel.less(warp, warps)?, kernel.less(own, end)?)?;
            // Threads past the group's tasks take its last one's row (and do nothing
            // with it), so that every load is in bounds.
            let task = kernel.min(own, last)?;
            let place_of = |task| -> Gen<_> {
                let row = kernel.rem(task, rows)?;
                Ok((
                    kernel.div(task, rows)?,
                    row,
                    kernel.load_i64(elements, row)?,
                ))
            };
            let (head, row, _) = place_of(task)?;
            let (first_head, _, first_element) = place_of(first)?;
            let (last_head, _, last_element) = place_of(last)?;
            let one_source = kernel.and(
                kernel.equal(first_head, last_head)?,
                kernel.equal(first_element, last_element)?,
            )?;
            let task = self.task(row, head, lanes)?;
            kernel.if_else(
                one_source,
                || task.run_staged((shared, tile), &place, active),
                || kernel.if_else(active, || task.run_from_memory(), || Ok(())),
            )
        })
    }
}

/// Where a key's columns are read: its packed row in `K` and `V`, or its slot of the
/// keys a block staged in shared memory (keys then values, a slot each).
#[derive(Clone, Copy)]
enum KeyAt<'ctx> {
    Memory(IntValue<'ctx>),
    Staged(PointerValue<'ctx>, IntValue<'ctx>),
}

/// One task of [`attention`]: a query row and head, its element's keys (the first, how
/// many, how many it sees), the buffers (`Q`, `K`, `V`) and the accumulators of its
/// online softmax.
struct AttentionTask<'a, 'ctx, 'm> {
    kernel: &'a Kernel<'ctx, 'm>,
    step: &'a Attention,
    lanes: Lanes<'ctx>,
    buffers: [PointerValue<'ctx>; 3],
    /// This lane's output columns.
    output: Local<'ctx>,
    /// This lane's columns of the query row.
    query: Local<'ctx>,
    /// The running maximum, the running sum and whether a masked score poisons the row.
    stats: [PointerValue<'ctx>; 3],
    row: IntValue<'ctx>,
    first_key: IntValue<'ctx>,
    key_count: IntValue<'ctx>,
    visible: IntValue<'ctx>,
    query_base: IntValue<'ctx>,
    value_base: IntValue<'ctx>,
    out: PointerValue<'ctx>,
}

impl<'ctx> AttentionTask<'_, 'ctx, '_> {
    /// The task with every key read from memory: the visible keys, then (causal) the
    /// masked ones, then the output row.
    fn run_from_memory(&self) -> Gen<()> {
        let kernel = self.kernel;
        let at = |key| -> Gen<KeyAt<'ctx>> { Ok(KeyAt::Memory(kernel.add(self.first_key, key)?)) };
        kernel.for_range(kernel.i64(0), self.visible, |key| self.attend(at(key)?))?;
        if self.step.causal {
            kernel.for_range(self.visible, self.key_count, |key| self.mask(at(key)?))?;
        }
        self.write()
    }

    /// The task of one warp of a GPU block whose tasks share their keys (its whole
    /// block runs this, `active` its warps with a task): `tile` keys at a time, the
    /// block stages their columns in `shared` (a key's `head_dim` columns of `K` then
    /// its `value_dim` of `V`), then each active warp takes them in order.
    fn run_staged(
        &self,
        (shared, tile): (PointerValue<'ctx>, i64),
        place: &crate::builder::BlockPlace<'ctx>,
        active: IntValue<'ctx>,
    ) -> Gen<()> {
        let (kernel, step) = (self.kernel, self.step);
        let [_, keys, values] = self.buffers;
        let width = step.head_dim + step.value_dim;
        kernel.for_range_by(kernel.i64(0), self.key_count, kernel.i64(tile), |first| {
            let count = kernel.min(kernel.i64(tile), kernel.sub(self.key_count, first)?)?;
            let first_row = kernel.add(self.first_key, first)?;
            // Every warp is done with the last tile.
            kernel.barrier()?;
            let stage = |(columns, offset, base, access, buffer): (i64, i64, _, _, _)| {
                let total = kernel.mul(count, kernel.i64(columns))?;
                kernel.for_range_by(place.thread, total, place.threads, |at| {
                    let (key, column) = (
                        kernel.div(at, kernel.i64(columns))?,
                        kernel.rem(at, kernel.i64(columns))?,
                    );
                    let from = index(
                        kernel,
                        access,
                        kernel.add(first_row, key)?,
                        kernel.add(base, column)?,
                    )?;
                    let to = kernel.add(
                        kernel.mul(key, kernel.i64(width))?,
                        kernel.add(column, kernel.i64(offset))?,
                    )?;
                    kernel.store_shared(shared, to, kernel.load_float(buffer, from)?)
                })
            };
            stage((step.head_dim, 0, self.query_base, &step.k, keys))?;
            stage((
                step.value_dim,
                step.head_dim,
                self.value_base,
                &step.v,
                values,
            ))?;
            kernel.barrier()?;
            kernel.if_else(
                active,
                || {
                    kernel.for_range(kernel.i64(0), count, |slot| {
                        let at = KeyAt::Staged(shared, kernel.mul(slot, kernel.i64(width))?);
                        if !step.causal {
                            return self.attend(at);
                        }
                        let seen = kernel.less(kernel.add(first, slot)?, self.visible)?;
                        kernel.if_else(seen, || self.attend(at), || self.mask(at))
                    })
                },
                || Ok(()),
            )
        })?;
        kernel.if_else(active, || self.write(), || Ok(()))
    }

    /// This lane's value columns, each with its slot in the output.
    fn columns(&self, body: &dyn Fn(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>) -> Gen<()> {
        self.kernel
            .lane_columns(self.lanes, self.step.value_dim, body)
    }

    /// Column `column` of this head of the key (`values`: of its value).
    fn key_column(
        &self,
        key: KeyAt<'ctx>,
        column: IntValue<'ctx>,
        values: bool,
    ) -> Gen<FloatValue<'ctx>> {
        let (kernel, step) = (self.kernel, self.step);
        match key {
            KeyAt::Memory(key_row) => {
                let (access, base, buffer) = if values {
                    (&step.v, self.value_base, self.buffers[2])
                } else {
                    (&step.k, self.query_base, self.buffers[1])
                };
                let at = index(kernel, access, key_row, kernel.add(base, column)?)?;
                kernel.load_float(buffer, at)
            }
            KeyAt::Staged(shared, slot) => {
                let offset = if values { step.head_dim } else { 0 };
                let at = kernel.add(slot, kernel.add(column, kernel.i64(offset))?)?;
                kernel.load_shared(shared, at)
            }
        }
    }

    /// `scale * <q_row, k_key>` over this head's columns.
    fn score(&self, key: KeyAt<'ctx>) -> Gen<FloatValue<'ctx>> {
        let (kernel, step) = (self.kernel, self.step);
        let dot = lane_sum(kernel, self.lanes, step.head_dim, |column| {
            let x = kernel.load_local(self.query, kernel.lane_slot(self.lanes, column)?)?;
            kernel.fmul(x, self.key_column(key, column, false)?)
        })?;
        kernel.fmul(dot, kernel.constant(step.scale.0))
    }

    /// Adds `weight * v_key` to each column, after multiplying it by `rescale` if given.
    fn add_values(
        &self,
        key: KeyAt<'ctx>,
        weight: FloatValue<'ctx>,
        rescale: Option<FloatValue<'ctx>>,
    ) -> Gen<()> {
        let (kernel, output) = (self.kernel, self.output);
        self.columns(&|column, slot| {
            let contribution = kernel.fmul(weight, self.key_column(key, column, true)?)?;
            let kept = kernel.load_local(output, slot)?;
            let kept = match rescale {
                Some(rescale) => kernel.fmul(kept, rescale)?,
                None => kept,
            };
            kernel.store_local(output, slot, kernel.fadd(kept, contribution)?)
        })
    }

    /// One visible key of the online softmax: the running maximum rescales the running
    /// sum and output, then the key's weight and values are added.
    fn attend(&self, key: KeyAt<'ctx>) -> Gen<()> {
        let kernel = self.kernel;
        let [largest, total, _] = self.stats;
        let [zero, one] = [0.0, 1.0].map(|value| kernel.constant(value));
        let negative_infinity = kernel.constant(f64::NEG_INFINITY);
        let value = self.score(key)?;
        let before = kernel.get(largest)?;
        let after = kernel.extreme(before, value, true)?;
        // While every score so far is -inf nothing is kept (and exp(-inf - -inf) would
        // be NaN).
        let rescale = kernel.fast_exp(kernel.fsub(before, after)?)?;
        let rescale = kernel.select_if(
            FloatPredicate::OEQ,
            (after, negative_infinity),
            one,
            rescale,
        )?;
        let weight = kernel.fast_exp(kernel.fsub(value, after)?)?;
        let weight = kernel.select_if(
            FloatPredicate::OEQ,
            (after, negative_infinity),
            zero,
            weight,
        )?;
        kernel.set(
            total,
            kernel.fadd(kernel.fmul(kernel.get(total)?, rescale)?, weight)?,
        )?;
        self.add_values(key, weight, Some(rescale))?;
        kernel.set(largest, after)
    }

    /// One masked (future) key: a score that is not below +inf (NaN or +inf) poisons
    /// the row, and its values count with weight 0 (NaN where one is not finite).
    fn mask(&self, key: KeyAt<'ctx>) -> Gen<()> {
        let kernel = self.kernel;
        let poisoned = self.stats[2];
        let [zero, one] = [0.0, 1.0].map(|value| kernel.constant(value));
        let infinity = kernel.constant(f64::INFINITY);
        let poison =
            kernel.select_if(FloatPredicate::OLT, (self.score(key)?, infinity), zero, one)?;
        kernel.set(
            poisoned,
            kernel.extreme(kernel.get(poisoned)?, poison, true)?,
        )?;
        self.add_values(key, zero, None)
    }

    /// The output row: the columns over the sum, 0 without a finite score, NaN if
    /// poisoned.
    fn write(&self) -> Gen<()> {
        let (kernel, step, output, out) = (self.kernel, self.step, self.output, self.out);
        let [largest, total, poisoned] = self.stats;
        let inverse = output_scale(
            kernel,
            [
                kernel.get(largest)?,
                kernel.get(total)?,
                kernel.get(poisoned)?,
            ],
        )?;
        let out_row = kernel.mul(self.row, kernel.i64(step.heads * step.value_dim))?;
        self.columns(&|column, slot| {
            let at = kernel.add(out_row, kernel.add(self.value_base, column)?)?;
            let value = kernel.fmul(kernel.load_local(output, slot)?, inverse)?;
            kernel.store_float(out, at, value)
        })
    }
}

/// The statistics of a query row and head: its largest score, sum of exponentials and
/// rowsum(P dP).
pub(super) const STATISTICS: i64 = 3;

/// The gradient of varlen attention, `P = softmax(scale Q K^T)` recomputed from each query
/// row's maximum and sum: the queries' (`dQ = scale dS K`, one query row and head per
/// iteration) or the keys' and values' (`dK = scale dS^T Q`, `dV = P^T dO`, one key row
/// and head per iteration, each visiting the queries that see it), with
/// `dS = P (dO V^T - rowsum(P dO V^T))`. Elements without keys get zeros. A task is a
/// warp's on a GPU (lanes over the head's columns, dot products added with shuffles),
/// one thread's on the host.
pub(super) fn attention_grad<'ctx>(kernel: &Kernel<'ctx, '_>, step: &AttentionGrad) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, queries, keys, values, slopes, query_offsets, key_offsets, elements] = kernel
        .params([
            Role::Out,
            Role::Queries,
            Role::Keys,
            Role::Values,
            Role::Gradient,
            Role::Offsets,
            Role::KeyOffsets,
            Role::RowOwners,
        ])?;
    let statistics = kernel
        .optional(Role::Statistics)?
        .map(|buffer| kernel.compute_type(buffer));
    if let Some(statistics) = statistics.filter(|_| {
        kernel.on_gpu() && grad_on_tensor_cores(step, kernel.float_type(), kernel.storage())
    }) {
        let buffers = TensorGradBuffers {
            out,
            matrices: [queries, keys, values, slopes],
            statistics,
            offsets: [query_offsets, key_offsets],
            elements,
        };
        return tensor_attention_grad(kernel, step, buffers, end);
    }
    let stats = kernel.accumulators(["largest", "total", "dot"])?;
    // Each lane's columns of the head (every one on the host).
    let slots = (step.head_dim + kernel.lane_count() - 1) / kernel.lane_count();
    let grads = [
        kernel.accumulator_array("first", slots)?,
        kernel.accumulator_array("second", slots)?,
    ];
    let zero = kernel.constant(0.0);
    kernel.parallel_rows(start, end, |task, lanes| {
        let row = kernel.div(task, kernel.i64(step.heads))?;
        let head = kernel.rem(task, kernel.i64(step.heads))?;
        let base = kernel.mul(head, kernel.i64(step.head_dim))?;
        let element = kernel.load_i64(elements, row)?;
        let next = kernel.add(element, kernel.i64(1))?;
        let (first_query, first_key) = (
            kernel.load_i64(query_offsets, element)?,
            kernel.load_i64(key_offsets, element)?,
        );
        let query_count = kernel.sub(kernel.load_i64(query_offsets, next)?, first_query)?;
        let key_count = kernel.sub(kernel.load_i64(key_offsets, next)?, first_key)?;
        let task = GradTask {
            kernel,
            step,
            lanes,
            buffers: GradBuffers {
                out,
                queries,
                keys,
                values,
                slopes,
            },
            stats,
            grads,
            zero,
            row,
            base,
            first_query,
            first_key,
            query_count,
            key_count,
        };
        task.columns(&|_, slot| {
            kernel.store_local(grads[0], slot, zero)?;
            kernel.store_local(grads[1], slot, zero)
        })?;
        match step.part {
            AttentionPart::Queries => task.queries_gradient(statistics),
            AttentionPart::KeysValues => task.keys_gradient(statistics),
            AttentionPart::Statistics => task.statistics(kernel.compute_type(out)),
            // Placed as the CPU's own code in every set (GPU programs have one part a
            // step).
            AttentionPart::All | AttentionPart::Both => Err(crate::CodegenError::new(
                "attention gradients at once are the CPU's own code, not a kernel",
            )),
        }
    })
}

/// The buffers of [`attention_grad`]: its output, `Q`, `K`, `V` and `dO`.
#[derive(Clone, Copy)]
struct GradBuffers<'ctx> {
    out: PointerValue<'ctx>,
    queries: PointerValue<'ctx>,
    keys: PointerValue<'ctx>,
    values: PointerValue<'ctx>,
    slopes: PointerValue<'ctx>,
}

/// One task of [`attention_grad`]: its row (a query row, or a key row of the keys'
/// gradient) and head, the packed rows of its element, and the accumulators it shares.
struct GradTask<'a, 'ctx, 'm> {
    kernel: &'a Kernel<'ctx, 'm>,
    step: &'a AttentionGrad,
    lanes: Lanes<'ctx>,
    buffers: GradBuffers<'ctx>,
    /// A query row's maximum, sum of exponentials and rowsum(P dP).
    stats: [PointerValue<'ctx>; 3],
    /// This lane's columns of the first (dK or dQ) and second (dV) gradient.
    grads: [Local<'ctx>; 2],
    zero: FloatValue<'ctx>,
    row: IntValue<'ctx>,
    /// The head's first column.
    base: IntValue<'ctx>,
    first_query: IntValue<'ctx>,
    first_key: IntValue<'ctx>,
    query_count: IntValue<'ctx>,
    key_count: IntValue<'ctx>,
}

impl<'ctx> GradTask<'_, 'ctx, '_> {
    /// This lane's columns of the head, each with its slot in the gradients.
    fn columns(&self, body: &dyn Fn(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>) -> Gen<()> {
        self.kernel
            .lane_columns(self.lanes, self.step.head_dim, body)
    }

    /// `<a_x, b_y>` over this head's columns.
    fn dot_rows(
        &self,
        (a, a_buffer): (&Access, PointerValue<'ctx>),
        x: IntValue<'ctx>,
        (b, b_buffer): (&Access, PointerValue<'ctx>),
        y: IntValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let kernel = self.kernel;
        lane_sum(kernel, self.lanes, self.step.head_dim, |column| {
            let column = kernel.add(self.base, column)?;
            let left = kernel.load_float(a_buffer, index(kernel, a, x, column)?)?;
            let right = kernel.load_float(b_buffer, index(kernel, b, y, column)?)?;
            kernel.fmul(left, right)
        })
    }

    /// `scale <q_query, k_key>`.
    fn score(&self, query: IntValue<'ctx>, key: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let (step, buffers) = (self.step, self.buffers);
        let product = self.dot_rows(
            (&step.q, buffers.queries),
            query,
            (&step.k, buffers.keys),
            key,
        )?;
        self.kernel
            .fmul(product, self.kernel.constant(step.scale.0))
    }

    /// `<dO_query, v_key>`.
    fn slope(&self, query: IntValue<'ctx>, key: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let (step, buffers) = (self.step, self.buffers);
        self.dot_rows(
            (&step.g, buffers.slopes),
            query,
            (&step.v, buffers.values),
            key,
        )
    }

    /// The keys query row `query` (packed) sees: `0..visible` of its element.
    fn visible(&self, query: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        let position = self.kernel.sub(query, self.first_query)?;
        visible_keys(self.kernel, self.step.causal, position, self.key_count)
    }

    /// `P[query, key]` from the statistics of `query` in the accumulators.
    fn probability(&self, query: IntValue<'ctx>, key: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let kernel = self.kernel;
        let [largest, total, _] = self.stats;
        let shifted = kernel.fsub(self.score(query, key)?, kernel.get(largest)?)?;
        kernel.fdiv(kernel.fast_exp(shifted)?, kernel.get(total)?)
    }

    /// `dS[query, key] = P (dP - rowsum(P dP))` from the statistics of `query`, with `P`.
    fn score_slope(
        &self,
        query: IntValue<'ctx>,
        key: IntValue<'ctx>,
    ) -> Gen<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let kernel = self.kernel;
        let p = self.probability(query, key)?;
        let centred = kernel.fsub(self.slope(query, key)?, kernel.get(self.stats[2])?)?;
        Ok((p, kernel.fmul(p, centred)?))
    }

    /// Where query row `query`'s statistics are in a statistics buffer, in values of
    /// the compute type: three a head (a head's `STATISTICS_WIDTH` values of the storage
    /// hold at least as many bytes).
    fn statistics_at(&self, query: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        let kernel = self.kernel;
        let head = kernel.div(self.base, kernel.i64(self.step.head_dim.max(1)))?;
        let entry = kernel.add(kernel.mul(query, kernel.i64(self.step.heads))?, head)?;
        kernel.mul(entry, kernel.i64(STATISTICS))
    }

    /// Row `query`'s maximum, sum of exponentials and rowsum(P dP), into the
    /// accumulators: read from `saved` (an [`AttentionPart::Statistics`] step's), or
    /// computed over the keys the row sees.
    fn row_stats(&self, query: IntValue<'ctx>, saved: Option<Local<'ctx>>) -> Gen<()> {
        let (kernel, zero) = (self.kernel, self.zero);
        let [largest, total, dot] = self.stats;
        if let Some(saved) = saved {
            let at = self.statistics_at(query)?;
            for (index, accumulator) in (0i64..).zip(self.stats) {
                let value = kernel.load_local(saved, kernel.add(at, kernel.i64(index))?)?;
                kernel.set(accumulator, value)?;
            }
            return Ok(());
        }
        let limit = self.visible(query)?;
        kernel.set(largest, kernel.constant(f64::NEG_INFINITY))?;
        kernel.for_range(kernel.i64(0), limit, |key| {
            let value = self.score(query, kernel.add(self.first_key, key)?)?;
            kernel.set(largest, kernel.extreme(kernel.get(largest)?, value, true)?)
        })?;
        kernel.set(total, zero)?;
        kernel.for_range(kernel.i64(0), limit, |key| {
            let shifted = kernel.fsub(
                self.score(query, kernel.add(self.first_key, key)?)?,
                kernel.get(largest)?,
            )?;
            kernel.set(
                total,
                kernel.fadd(kernel.get(total)?, kernel.fast_exp(shifted)?)?,
            )
        })?;
        kernel.set(dot, zero)?;
        kernel.for_range(kernel.i64(0), limit, |key| {
            let key = kernel.add(self.first_key, key)?;
            let p = self.probability(query, key)?;
            kernel.set(
                dot,
                kernel.fadd(kernel.get(dot)?, kernel.fmul(p, self.slope(query, key)?)?)?,
            )
        })
    }

    /// The statistics of this task's query row ([`GradTask::row_stats`]) into `out`,
    /// three values of the compute type a head ([`GradTask::statistics_at`]), written by
    /// the first lane.
    fn statistics(&self, out: Local<'ctx>) -> Gen<()> {
        let kernel = self.kernel;
        // A row without keys: -inf, 0 and 0.
        self.row_stats(self.row, None)?;
        let at = self.statistics_at(self.row)?;
        let first_lane = kernel.equal(self.lanes.lane, kernel.i64(0))?;
        kernel.if_else(
            first_lane,
            || {
                for (index, accumulator) in (0i64..).zip(self.stats) {
                    let value = kernel.get(accumulator)?;
                    kernel.store_local(out, kernel.add(at, kernel.i64(index))?, value)?;
                }
                Ok(())
            },
            || Ok(()),
        )
    }

    /// Key row `row`'s dK and dV: over the queries of its element that see it, into
    /// `[Lk, 2, heads, head_dim]` (dK then dV).
    fn keys_gradient(&self, saved: Option<Local<'ctx>>) -> Gen<()> {
        let (kernel, step, buffers) = (self.kernel, self.step, self.buffers);
        let [first_grad, second_grad] = self.grads;
        let (row, base) = (self.row, self.base);
        let position = kernel.sub(row, self.first_key)?;
        kernel.for_range(kernel.i64(0), self.query_count, |query| {
            let query = kernel.add(self.first_query, query)?;
            let seen = if step.causal {
                kernel.less(position, self.visible(query)?)?
            } else {
                kernel.less(kernel.i64(-1), position)?
            };
            kernel.if_else(
                seen,
                || {
                    self.row_stats(query, saved)?;
                    let (p, ds) = self.score_slope(query, row)?;
                    self.columns(&|column, slot| {
                        let column_at = kernel.add(base, column)?;
                        let x = kernel.load_float(
                            buffers.queries,
                            index(kernel, &step.q, query, column_at)?,
                        )?;
                        let y = kernel.load_float(
                            buffers.slopes,
                            index(kernel, &step.g, query, column_at)?,
                        )?;
                        let dk = kernel
                            .fadd(kernel.load_local(first_grad, slot)?, kernel.fmul(ds, x)?)?;
                        let dv = kernel
                            .fadd(kernel.load_local(second_grad, slot)?, kernel.fmul(p, y)?)?;
                        kernel.store_local(first_grad, slot, dk)?;
                        kernel.store_local(second_grad, slot, dv)
                    })
                },
                || Ok(()),
            )
        })?;
        let width = kernel.i64(2 * step.heads * step.head_dim);
        let target = kernel.add(kernel.mul(row, width)?, base)?;
        self.columns(&|column, slot| {
            let at = kernel.add(target, column)?;
            let dk = kernel.fmul(
                kernel.load_local(first_grad, slot)?,
                kernel.constant(step.scale.0),
            )?;
            kernel.store_float(buffers.out, at, dk)?;
            let at = kernel.add(at, kernel.i64(step.heads * step.head_dim))?;
            kernel.store_float(buffers.out, at, kernel.load_local(second_grad, slot)?)
        })
    }

    /// Query row `row`'s dQ: over the keys it sees, into `[Lq, heads, head_dim]`.
    fn queries_gradient(&self, saved: Option<Local<'ctx>>) -> Gen<()> {
        let (kernel, step, buffers) = (self.kernel, self.step, self.buffers);
        let first_grad = self.grads[0];
        let (row, base) = (self.row, self.base);
        let limit = self.visible(row)?;
        let has_keys = kernel.less(kernel.i64(0), limit)?;
        kernel.if_else(
            has_keys,
            || {
                self.row_stats(row, saved)?;
                kernel.for_range(kernel.i64(0), limit, |key| {
                    let key = kernel.add(self.first_key, key)?;
                    let (_, ds) = self.score_slope(row, key)?;
                    self.columns(&|column, slot| {
                        let column_at = kernel.add(base, column)?;
                        let y = kernel
                            .load_float(buffers.keys, index(kernel, &step.k, key, column_at)?)?;
                        let dq = kernel
                            .fadd(kernel.load_local(first_grad, slot)?, kernel.fmul(ds, y)?)?;
                        kernel.store_local(first_grad, slot, dq)
                    })
                })
            },
            || Ok(()),
        )?;
        let target = kernel.add(
            kernel.mul(row, kernel.i64(step.heads * step.head_dim))?,
            base,
        )?;
        self.columns(&|column, slot| {
            let dq = kernel.fmul(
                kernel.load_local(first_grad, slot)?,
                kernel.constant(step.scale.0),
            )?;
            kernel.store_float(buffers.out, kernel.add(target, column)?, dq)
        })
    }
}
