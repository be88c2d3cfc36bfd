//! Row kernels (norms, softmax, row reductions: a row a warp on a GPU) and segmented
//! kernels (reductions and softmax over each element's rows: an element a warp).

use super::*;

pub(super) fn row<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    kind: RowKind,
    x: &Fusion,
    width: i64,
    eps: f64,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let out = kernel.param(Role::Out)?;
    let inputs = prologue_args(kernel, &x.inputs)?;
    let weight = kernel.optional(Role::Weight)?;
    let bias = kernel.optional(Role::Bias)?;
    let n = kernel.constant(width as f64);
    // A row is a warp's on a GPU (its lanes share the columns), one thread's on the host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let base = kernel.mul(row, kernel.i64(width))?;
        let at = |column: IntValue<'ctx>| kernel.add(base, column);
        // Each pass over the row computes the prologue again (it is cheap, the row is
        // in cache, and the input is never written to memory).
        let load = |column| prologue(kernel, x, &inputs, row, column);
        let affine = |value: FloatValue<'ctx>, column| -> Gen<FloatValue<'ctx>> {
            let scaled = match weight {
                Some(weight) => kernel.fmul(value, kernel.load_float(weight, column)?)?,
                None => value,
            };
            match bias {
                Some(bias) => kernel.fadd(scaled, kernel.load_float(bias, column)?),
                None => Ok(scaled),
            }
        };
        match kind {
            RowKind::LayerNorm | RowKind::RmsNorm => {
                let mean = if kind == RowKind::LayerNorm {
                    kernel.fdiv(lane_sum(kernel, lanes, width, load)?, n)?
                } else {
                    kernel.constant(0.0)
                };
                let variance = kernel.fdiv(
                    lane_sum(kernel, lanes, width, |column| {
                        let centered = kernel.fsub(load(column)?, mean)?;
                        kernel.fmul(centered, centered)
                    })?,
                    n,
                )?;
                let root = kernel
                    .intrinsic("llvm.sqrt", &[kernel.fadd(variance, kernel.constant(eps))?])?;
                let inverse = kernel.fdiv(kernel.constant(1.0), root)?;
                kernel.lane_range(lanes, width, |column| {
                    let normed = kernel.fmul(kernel.fsub(load(column)?, mean)?, inverse)?;
                    kernel.store_float(out, at(column)?, affine(normed, column)?)
                })
            }
            RowKind::Softmax => {
                let max = lane_extreme(kernel, lanes, width, (true, true), load)?;
                // One exp per value: e^(x - max) is written while it is summed, then
                // scaled in place (as libtorch's kernel).
                let total = lane_sum(kernel, lanes, width, |column| {
                    let value = kernel.fast_exp(kernel.fsub(load(column)?, max)?)?;
                    kernel.store_float(out, at(column)?, value)?;
                    Ok(value)
                })?;
                let inverse = kernel.fdiv(kernel.constant(1.0), total)?;
                kernel.lane_range(lanes, width, |column| {
                    let value = kernel.load_float(out, at(column)?)?;
                    kernel.store_float(out, at(column)?, kernel.fmul(value, inverse)?)
                })
            }
            RowKind::LogSoftmax => {
                let max = lane_extreme(kernel, lanes, width, (true, true), load)?;
                let total = lane_sum(kernel, lanes, width, |column| {
                    kernel.fast_exp(kernel.fsub(load(column)?, max)?)
                })?;
                let log_total = kernel.math("log", &[total])?;
                kernel.lane_range(lanes, width, |column| {
                    let shifted = kernel.fsub(load(column)?, max)?;
                    kernel.store_float(out, at(column)?, kernel.fsub(shifted, log_total)?)
                })
            }
            RowKind::Sum | RowKind::Mean => {
                let sum = lane_sum(kernel, lanes, width, load)?;
                let value = if kind == RowKind::Mean {
                    kernel.fdiv(sum, n)?
                } else {
                    sum
                };
                first_lane_stores(kernel, lanes, out, row, value)
            }
            RowKind::Max | RowKind::Min => {
                let largest = kind == RowKind::Max;
                let value = lane_extreme(kernel, lanes, width, (largest, false), load)?;
                first_lane_stores(kernel, lanes, out, row, value)
            }
        }
    })
}

pub(super) fn segment<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    kind: SegmentKind,
    x: &Fusion,
    width: i64,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let out = kernel.param(Role::Out)?;
    let inputs = prologue_args(kernel, &x.inputs)?;
    let offsets = kernel.param(Role::Offsets)?;
    // An element is a warp's on a GPU (each lane its columns), one thread's on the host.
    kernel.parallel_rows(start, end, |element, lanes| {
        let first = kernel.load_i64(offsets, element)?;
        let last = kernel.load_i64(offsets, kernel.add(element, kernel.i64(1))?)?;
        kernel.lane_range(lanes, width, |column| {
            let at = |row: IntValue<'ctx>| kernel.add(kernel.mul(row, kernel.i64(width))?, column);
            let load = |row| prologue(kernel, x, &inputs, row, column);
            let fold =
                |initial: f64,
                 step: &dyn Fn(FloatValue<'ctx>, IntValue<'ctx>) -> Gen<FloatValue<'ctx>>|
                 -> Gen<FloatValue<'ctx>> {
                    let acc = kernel.accumulator("segment")?;
                    kernel.set(acc, kernel.constant(initial))?;
                    kernel.for_range(first, last, |row| {
                        kernel.set(acc, step(kernel.get(acc)?, row)?)
                    })?;
                    kernel.get(acc)
                };
            let out_at = kernel.add(kernel.mul(element, kernel.i64(width))?, column)?;
            match kind {
                SegmentKind::Sum | SegmentKind::Mean => {
                    let sum = fold(0.0, &|acc, row| kernel.fadd(acc, load(row)?))?;
                    let value = if kind == SegmentKind::Mean {
                        let count = kernel
                            .builder
                            .build_int_sub(last, first, "count")
                            .map_err(crate::CodegenError::new)?;
                        let count = kernel
                            .builder
                            .build_signed_int_to_float(count, kernel.float, "n")
                            .map_err(crate::CodegenError::new)?;
                        kernel.fdiv(sum, count)?
                    } else {
                        sum
                    };
                    kernel.store_float(out, out_at, value)
                }
                SegmentKind::Max | SegmentKind::Min => {
                    let largest = kind == SegmentKind::Max;
                    let initial = if largest {
                        f64::NEG_INFINITY
                    } else {
                        f64::INFINITY
                    };
                    let value = fold(initial, &|acc, row| {
                        kernel.extreme(acc, load(row)?, largest)
                    })?;
                    kernel.store_float(out, out_at, value)
                }
                SegmentKind::Softmax | SegmentKind::LogSoftmax => {
                    let max = fold(f64::NEG_INFINITY, &|acc, row| {
                        kernel.extreme(acc, load(row)?, true)
                    })?;
                    let total = fold(0.0, &|acc, row| {
                        kernel.fadd(acc, kernel.fast_exp(kernel.fsub(load(row)?, max)?)?)
                    })?;
                    let log_total = kernel.math("log", &[total])?;
                    kernel.for_range(first, last, |row| {
                        let shifted = kernel.fsub(load(row)?, max)?;
                        let value = if kind == SegmentKind::Softmax {
                            kernel.fdiv(kernel.fast_exp(shifted)?, total)?
                        } else {
                            kernel.fsub(shifted, log_total)?
                        };
                        kernel.store_float(out, at(row)?, value)
                    })
                }
            }
        })
    })
}
