//! Varlen attention (online softmax, a query row and head a warp on a GPU) and its
//! gradient.

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
    let Attention {
        ref q,
        ref k,
        ref v,
        heads,
        head_dim,
        value_dim,
        causal,
        scale,
        ..
    } = *step;
    let scale = scale.0;
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
    // Each lane's output columns (every one on the host).
    let slots = (value_dim + kernel.lane_count() - 1) / kernel.lane_count();
    let output = kernel.accumulator_array("output", slots)?;
    let [largest, total, poisoned] = kernel.accumulators(["largest", "total", "poisoned"])?;
    let [zero, one] = [0.0, 1.0].map(|value| kernel.constant(value));
    let [infinity, negative_infinity] =
        [f64::INFINITY, f64::NEG_INFINITY].map(|value| kernel.constant(value));
    kernel.parallel_rows(start, end, |task, lanes| {
        // This lane's value columns, each with its slot in `output`.
        let columns = |body: &dyn Fn(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>| {
            kernel.lane_range(lanes, value_dim, |column| {
                body(column, kernel.lane_slot(lanes, column)?)
            })
        };
        let row = kernel.div(task, kernel.i64(heads))?;
        let head = kernel.rem(task, kernel.i64(heads))?;
        let element = kernel.load_i64(elements, row)?;
        let next = kernel.add(element, kernel.i64(1))?;
        let position = kernel.sub(row, kernel.load_i64(query_offsets, element)?)?;
        let first_key = kernel.load_i64(key_offsets, element)?;
        let key_count = kernel.sub(kernel.load_i64(key_offsets, next)?, first_key)?;
        let visible = if causal {
            kernel.min(kernel.add(position, kernel.i64(1))?, key_count)?
        } else {
            key_count
        };
        let query_base = kernel.mul(head, kernel.i64(head_dim))?;
        let value_base = kernel.mul(head, kernel.i64(value_dim))?;
        // scale * <q_row, k_key> over this head's columns.
        let score = |key: IntValue<'ctx>| -> Gen<FloatValue<'ctx>> {
            let key_row = kernel.add(first_key, key)?;
            let dot = lane_sum(kernel, lanes, head_dim, |column| {
                let column = kernel.add(query_base, column)?;
                let x = kernel.load_float(queries, index(kernel, q, row, column)?)?;
                let y = kernel.load_float(keys, index(kernel, k, key_row, column)?)?;
                kernel.fmul(x, y)
            })?;
            kernel.fmul(dot, kernel.constant(scale))
        };
        kernel.set(largest, negative_infinity)?;
        kernel.set(total, zero)?;
        kernel.set(poisoned, zero)?;
        columns(&|_, slot| kernel.store_local(output, slot, zero))?;
        kernel.for_range(kernel.i64(0), visible, |key| {
            let value = score(key)?;
            let before = kernel.get(largest)?;
            let after = kernel.extreme(before, value, true)?;
            // While every score so far is -inf nothing is kept (and exp(-inf - -inf)
            // would be NaN).
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
            let key_row = kernel.add(first_key, key)?;
            columns(&|column, slot| {
                let at = index(kernel, v, key_row, kernel.add(value_base, column)?)?;
                let contribution = kernel.fmul(weight, kernel.load_float(values, at)?)?;
                let kept = kernel.fmul(kernel.load_local(output, slot)?, rescale)?;
                kernel.store_local(output, slot, kernel.fadd(kept, contribution)?)
            })?;
            kernel.set(largest, after)
        })?;
        if causal {
            kernel.for_range(visible, key_count, |key| {
                // A masked score that is not below +inf (NaN or +inf) poisons the row.
                let poison =
                    kernel.select_if(FloatPredicate::OLT, (score(key)?, infinity), zero, one)?;
                kernel.set(
                    poisoned,
                    kernel.extreme(kernel.get(poisoned)?, poison, true)?,
                )?;
                // A masked key's values count with weight 0 (NaN where one is not finite).
                let key_row = kernel.add(first_key, key)?;
                columns(&|column, slot| {
                    let at = index(kernel, v, key_row, kernel.add(value_base, column)?)?;
                    let masked = kernel.fmul(zero, kernel.load_float(values, at)?)?;
                    let kept = kernel.load_local(output, slot)?;
                    kernel.store_local(output, slot, kernel.fadd(kept, masked)?)
                })
            })?;
        }
        let inverse = kernel.fdiv(one, kernel.get(total)?)?;
        let inverse = kernel.select_if(
            FloatPredicate::OEQ,
            (kernel.get(largest)?, negative_infinity),
            zero,
            inverse,
        )?;
        let inverse = kernel.select_if(
            FloatPredicate::OGT,
            (kernel.get(poisoned)?, zero),
            kernel.constant(f64::NAN),
            inverse,
        )?;
        let out_row = kernel.mul(row, kernel.i64(heads * value_dim))?;
        columns(&|column, slot| {
            let at = kernel.add(out_row, kernel.add(value_base, column)?)?;
            let value = kernel.fmul(kernel.load_local(output, slot)?, inverse)?;
            kernel.store_float(out, at, value)
        })
    })
}

/// The gradient of varlen attention, `P = softmax(scale Q K^T)` recomputed from each query
/// row's maximum and sum: the queries' (`dQ = scale dS K`, one query row and head per
/// iteration) or the keys' and values' (`dK = scale dS^T Q`, `dV = P^T dO`, one key row
/// and head per iteration, each visiting the queries that see it), with
/// `dS = P (dO V^T - rowsum(P dO V^T))`. Elements without keys get zeros. A task is a
/// warp's on a GPU (lanes over the head's columns, dot products added with shuffles),
/// one thread's on the host.
pub(super) fn attention_grad<'ctx>(kernel: &Kernel<'ctx, '_>, step: &AttentionGrad) -> Gen<()> {
    let AttentionGrad {
        ref q,
        ref k,
        ref v,
        ref g,
        heads,
        head_dim,
        causal,
        scale,
        keys,
        ..
    } = *step;
    let scale = scale.0;
    let (start, end) = kernel.range()?;
    let [out, queries, key_rows, values, slopes, query_offsets, key_offsets, elements] = kernel
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
    let [largest, total, dot] = kernel.accumulators(["largest", "total", "dot"])?;
    // Each lane's columns of the head (every one on the host).
    let slots = (head_dim + kernel.lane_count() - 1) / kernel.lane_count();
    let first_grad = kernel.accumulator_array("first", slots)?;
    let second_grad = kernel.accumulator_array("second", slots)?;
    let zero = kernel.constant(0.0);
    kernel.parallel_rows(start, end, |task, lanes| {
        // This lane's columns of the head, each with its slot in the gradients.
        let columns = |body: &dyn Fn(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>| {
            kernel.lane_range(lanes, head_dim, |column| {
                body(column, kernel.lane_slot(lanes, column)?)
            })
        };
        let row = kernel.div(task, kernel.i64(heads))?;
        let head = kernel.rem(task, kernel.i64(heads))?;
        let base = kernel.mul(head, kernel.i64(head_dim))?;
        let element = kernel.load_i64(elements, row)?;
        let next = kernel.add(element, kernel.i64(1))?;
        let (first_query, first_key) = (
            kernel.load_i64(query_offsets, element)?,
            kernel.load_i64(key_offsets, element)?,
        );
        let query_count = kernel.sub(kernel.load_i64(query_offsets, next)?, first_query)?;
        let key_count = kernel.sub(kernel.load_i64(key_offsets, next)?, first_key)?;
        // <a_x, b_y> over this head's columns.
        let dot_rows = |(a, a_buffer): (&Access, PointerValue<'ctx>),
                        x: IntValue<'ctx>,
                        (b, b_buffer): (&Access, PointerValue<'ctx>),
                        y: IntValue<'ctx>|
         -> Gen<FloatValue<'ctx>> {
            lane_sum(kernel, lanes, head_dim, |column| {
                let column = kernel.add(base, column)?;
                let left = kernel.load_float(a_buffer, index(kernel, a, x, column)?)?;
                let right = kernel.load_float(b_buffer, index(kernel, b, y, column)?)?;
                kernel.fmul(left, right)
            })
        };
        let score = |query: IntValue<'ctx>, key: IntValue<'ctx>| -> Gen<FloatValue<'ctx>> {
            let product = dot_rows((q, queries), query, (k, key_rows), key)?;
            kernel.fmul(product, kernel.constant(scale))
        };
        let slope = |query: IntValue<'ctx>, key: IntValue<'ctx>| {
            dot_rows((g, slopes), query, (v, values), key)
        };
        // The keys query row `query` (packed) sees: `0..visible` of its element.
        let visible = |query: IntValue<'ctx>| -> Gen<IntValue<'ctx>> {
            if causal {
                let position = kernel.sub(query, first_query)?;
                kernel.min(kernel.add(position, kernel.i64(1))?, key_count)
            } else {
                Ok(key_count)
            }
        };
        // P[query, key] from the statistics of `query` in the accumulators.
        let probability = |query: IntValue<'ctx>, key: IntValue<'ctx>| -> Gen<FloatValue<'ctx>> {
            let shifted = kernel.fsub(score(query, key)?, kernel.get(largest)?)?;
            kernel.fdiv(kernel.fast_exp(shifted)?, kernel.get(total)?)
        };
        // Row `query`'s maximum, sum of exponentials and rowsum(P dP), into the
        // accumulators.
        let row_stats = |query: IntValue<'ctx>| -> Gen<()> {
            let limit = visible(query)?;
            kernel.set(largest, kernel.constant(f64::NEG_INFINITY))?;
            kernel.for_range(kernel.i64(0), limit, |key| {
                let value = score(query, kernel.add(first_key, key)?)?;
                kernel.set(largest, kernel.extreme(kernel.get(largest)?, value, true)?)
            })?;
            kernel.set(total, zero)?;
            kernel.for_range(kernel.i64(0), limit, |key| {
                let shifted = kernel.fsub(
                    score(query, kernel.add(first_key, key)?)?,
                    kernel.get(largest)?,
                )?;
                kernel.set(
                    total,
                    kernel.fadd(kernel.get(total)?, kernel.fast_exp(shifted)?)?,
                )
            })?;
            kernel.set(dot, zero)?;
            kernel.for_range(kernel.i64(0), limit, |key| {
                let key = kernel.add(first_key, key)?;
                let p = probability(query, key)?;
                kernel.set(
                    dot,
                    kernel.fadd(kernel.get(dot)?, kernel.fmul(p, slope(query, key)?)?)?,
                )
            })
        };
        columns(&|_, slot| {
            kernel.store_local(first_grad, slot, zero)?;
            kernel.store_local(second_grad, slot, zero)
        })?;
        if keys {
            // Key row `row`: the queries of its element that see it.
            let position = kernel.sub(row, first_key)?;
            kernel.for_range(kernel.i64(0), query_count, |query| {
                let query = kernel.add(first_query, query)?;
                let seen = if causal {
                    kernel.less(position, visible(query)?)?
                } else {
                    kernel.less(kernel.i64(-1), position)?
                };
                kernel.if_else(
                    seen,
                    || {
                        row_stats(query)?;
                        let p = probability(query, row)?;
                        let ds =
                            kernel.fmul(p, kernel.fsub(slope(query, row)?, kernel.get(dot)?)?)?;
                        columns(&|column, slot| {
                            let column_at = kernel.add(base, column)?;
                            let x =
                                kernel.load_float(queries, index(kernel, q, query, column_at)?)?;
                            let y =
                                kernel.load_float(slopes, index(kernel, g, query, column_at)?)?;
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
            // [Lk, 2, heads, head_dim]: dK then dV.
            let width = kernel.i64(2 * heads * head_dim);
            let target = kernel.add(kernel.mul(row, width)?, base)?;
            columns(&|column, slot| {
                let at = kernel.add(target, column)?;
                let dk =
                    kernel.fmul(kernel.load_local(first_grad, slot)?, kernel.constant(scale))?;
                kernel.store_float(out, at, dk)?;
                let at = kernel.add(at, kernel.i64(heads * head_dim))?;
                kernel.store_float(out, at, kernel.load_local(second_grad, slot)?)
            })
        } else {
            let limit = visible(row)?;
            let has_keys = kernel.less(kernel.i64(0), limit)?;
            kernel.if_else(
                has_keys,
                || {
                    row_stats(row)?;
                    kernel.for_range(kernel.i64(0), limit, |key| {
                        let key = kernel.add(first_key, key)?;
                        let p = probability(row, key)?;
                        let ds =
                            kernel.fmul(p, kernel.fsub(slope(row, key)?, kernel.get(dot)?)?)?;
                        columns(&|column, slot| {
                            let column_at = kernel.add(base, column)?;
                            let y =
                                kernel.load_float(key_rows, index(kernel, k, key, column_at)?)?;
                            let dq = kernel
                                .fadd(kernel.load_local(first_grad, slot)?, kernel.fmul(ds, y)?)?;
                            kernel.store_local(first_grad, slot, dq)
                        })
                    })
                },
                || Ok(()),
            )?;
            let target = kernel.add(kernel.mul(row, kernel.i64(heads * head_dim))?, base)?;
            columns(&|column, slot| {
                let dq =
                    kernel.fmul(kernel.load_local(first_grad, slot)?, kernel.constant(scale))?;
                kernel.store_float(out, kernel.add(target, column)?, dq)
            })
        }
    })
}
