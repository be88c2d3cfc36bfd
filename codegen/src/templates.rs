//! One LLVM function per kernel step, its arguments asked for by role from the step's
//! [`Signature`] (`nestor_passes::signature` declares every kind's). The kernel range of
//! each template: pointwise kernels, rows; GEMMs, output values (in the
//! [`KernelSet::Library`] set a GEMM's epilogue is a pointwise kernel over its rows);
//! row kernels, rows; segmented kernels, elements; gathers, rows; attention and its
//! gradient, query (or key) rows x heads; padding, the padded grid's rows; unpadding,
//! the result's rows; one-hot rows and inserts, rows; length values, elements; row
//! sums, output values; scatters, table values (or, with the ids an input the host
//! indexes, table rows: each sums its own rows, no atomics); random masks, values;
//! jagged-pair matmuls, rows (`M`); window steps, output pixels (image means and their
//! spread: images; the weight's gradient: weights; pooling's gradient: input pixels,
//! each summing its own windows in the CPU's order).

use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::values::{FloatValue, IntValue, PointerValue};
use inkwell::FloatPredicate;
use nestor_passes::step::{
    Attention, AttentionGrad, Gemm, Insert, OneHot, Pad, PairGemm, Pointwise, RandomMask, Row,
    ScatterRows, Segment, SumRows, Unpad, Window,
};
use nestor_passes::{Access, Fusion, Role, RowKind, SegmentKind, Signature, Step, WindowKind};

use crate::builder::{Gen, Kernel, Lanes};
use crate::{KernelSet, Storage, Target};

/// Generates the kernel of `step` with `signature` (its placement's in `set`) as
/// function `name`.
pub(crate) fn generate<'ctx>(
    program: &nestor_passes::Program,
    (target, set, storage): (Target, KernelSet, Storage),
    (context, module): (&'ctx Context, &Module<'ctx>),
    name: &str,
    (step, signature): (&Step, &Signature),
) -> Gen<()> {
    let kernel = Kernel::new(context, module, name, program, (target, storage), signature);
    match step {
        Step::Gemm(Gemm {
            out,
            epilogue: Some(epilogue),
            n,
            ..
        }) if set == KernelSet::Library => {
            // Run on the GEMM's result in place: its reads of that result are the
            // output's buffer.
            kernel.output_also(inputs_of(&epilogue.inputs, *out));
            pointwise(&kernel, *n, &epilogue.inputs, &epilogue.expr)?
        }
        Step::Gemm(gemm_step) => gemm(&kernel, gemm_step, set == KernelSet::DeviceBlas)?,
        Step::Attention(Attention {
            q,
            k,
            v,
            heads,
            head_dim,
            value_dim,
            causal,
            scale,
            ..
        }) => attention(
            &kernel,
            [q, k, v],
            (*heads, *head_dim, *value_dim),
            *causal,
            scale.0,
        )?,
        Step::Pad(Pad { width, value, .. }) => pad(&kernel, *width, value.0)?,
        Step::Unpad(Unpad { width, .. }) => unpad(&kernel, *width)?,
        Step::OneHot(OneHot {
            classes, ignore, ..
        }) => one_hot(&kernel, *classes, *ignore)?,
        Step::LengthValues(_) => length_values(&kernel)?,
        Step::Insert(Insert {
            size, index, inner, ..
        }) => insert(&kernel, *size, *index, *inner)?,
        Step::SumRows(SumRows { m, n, mean, .. }) => sum_rows(&kernel, (*m, *n), *mean)?,
        Step::ScatterRows(ScatterRows {
            ids,
            width,
            padding,
            ..
        }) => {
            if program.is_input(*ids) {
                scatter_indexed_rows(&kernel, *width, *padding)?
            } else {
                scatter_rows(&kernel, *width, *padding)?
            }
        }
        Step::RandomMask(RandomMask { p, .. }) => random_mask(&kernel, p.0)?,
        Step::AttentionGrad(AttentionGrad {
            q,
            k,
            v,
            g,
            heads,
            head_dim,
            causal,
            scale,
            keys,
            ..
        }) => attention_grad(
            &kernel,
            [q, k, v, g],
            (*heads, *head_dim),
            (*causal, scale.0, *keys),
        )?,
        Step::PairGemm(PairGemm { width, mix, .. }) => pair_gemm(&kernel, *width, *mix)?,
        Step::Window(window) => window_kernel(&kernel, window)?,
        Step::Host(_) => {
            return Err(crate::CodegenError::new(
                "a host step (a per-element region run through libtorch) has no kernel",
            ))
        }
        Step::Pointwise(Pointwise {
            width,
            inputs,
            expr,
            ..
        }) => pointwise(&kernel, *width, inputs, expr)?,
        Step::Row(Row {
            kind,
            x,
            width,
            eps,
            ..
        }) => row(&kernel, *kind, x, *width, eps.0)?,
        Step::Segment(Segment { kind, x, width, .. }) => segment(&kernel, *kind, x, *width)?,
        Step::Gather(gather_step) => gather(&kernel, gather_step.width)?,
    }
    kernel.finish()
}

/// The kernel of a window step.
fn window_kernel(kernel: &Kernel<'_, '_>, step: &Window) -> Gen<()> {
    let Window {
        kind,
        channels,
        width,
        window,
        ..
    } = *step;
    let taps = window.taps();
    match kind {
        WindowKind::Conv | WindowKind::ConvInputGrad => convolution(
            kernel,
            (channels, width),
            taps,
            kind == WindowKind::ConvInputGrad,
        ),
        WindowKind::WeightGrad => weight_grad(kernel, (channels, width), taps),
        WindowKind::MaxGrad | WindowKind::AverageGrad => {
            pool_grad(kernel, channels, taps, kind == WindowKind::MaxGrad)
        }
        WindowKind::ImageSpread => image_spread(kernel, channels),
        WindowKind::Max | WindowKind::Average => {
            pool(kernel, channels, taps, kind == WindowKind::Max)
        }
        WindowKind::ImageMean => image_mean(kernel, channels),
    }
}

/// The scalar index of `access` at output row `row` (or its element) and column `column`.
fn index<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    access: &Access,
    row: IntValue<'ctx>,
    column: IntValue<'ctx>,
) -> Gen<IntValue<'ctx>> {
    let column = if access.col_modulo > 0 {
        kernel.rem(column, kernel.i64(access.col_modulo))?
    } else {
        column
    };
    let row_part = kernel.mul(row, kernel.i64(access.row_stride))?;
    let column_part = kernel.mul(column, kernel.i64(access.col_stride))?;
    kernel.add(
        kernel.add(row_part, column_part)?,
        kernel.i64(access.offset),
    )
}

fn pointwise<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    width: i64,
    inputs: &[Access],
    expr: &nestor_passes::Expr,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let out = kernel.param(Role::Out)?;
    let (pointers, maps) = fused_args(kernel, inputs)?;
    if flat(width, inputs) {
        let first = kernel.mul(start, kernel.i64(width))?;
        let last = kernel.mul(end, kernel.i64(width))?;
        return kernel.parallel_range(first, last, |at| {
            let load = |input: usize| -> Gen<FloatValue<'ctx>> {
                let access = &inputs[input];
                let position = if access.row_stride == 0 {
                    kernel.i64(access.offset)
                } else {
                    kernel.add(at, kernel.i64(access.offset))?
                };
                kernel.load_float(pointers[input], position)
            };
            let value = kernel.expr(expr, &load)?;
            kernel.store_float(out, at, value)
        });
    }
    kernel.parallel_rows(start, end, |row, lanes| {
        let rows = maps
            .iter()
            .map(|map| match map {
                Some(map) => kernel.load_i64(*map, row),
                None => Ok(row),
            })
            .collect::<Gen<Vec<_>>>()?;
        let base = kernel.mul(row, kernel.i64(width))?;
        kernel.lane_range(lanes, width, |column| {
            let load = |input: usize| -> Gen<FloatValue<'ctx>> {
                let at = index(kernel, &inputs[input], rows[input], column)?;
                kernel.load_float(pointers[input], at)
            };
            let value = kernel.expr(expr, &load)?;
            kernel.store_float(out, kernel.add(base, column)?, value)
        })
    })
}

/// Whether a pointwise kernel's rows are one flat run of scalars: every input read
/// element for element (or one scalar). Then it is one loop over the scalars, with no
/// per-row overhead (narrow rows, such as the channels of packed pixels, would otherwise
/// spend most of their time there); else a loop over rows.
fn flat(width: i64, inputs: &[Access]) -> bool {
    inputs.iter().all(|access| {
        let whole = access.row_map.is_none() && access.col_modulo == 0;
        let elementwise = access.row_stride == width && access.col_stride == 1;
        let scalar = access.row_stride == 0 && access.col_stride == 0;
        whole && (elementwise || scalar)
    })
}

/// Whether `step`'s kernel runs each task of its range on a warp on a GPU
/// ([`Kernel::parallel_rows`]): row and segmented kernels, attention and its gradient,
/// jagged-pair matmuls, the window steps, gathers, scatters by an index, one-hot rows,
/// inserts, padding copies and pointwise kernels over rows, whose lanes share a row's
/// (an element's, a head's, a pixel's, an image's, a table row's) columns, and the sums
/// over rows (row sums, a weight gradient's pixels), whose lanes share the rows.
pub(crate) fn warp_per_task(program: &nestor_passes::Program, step: &Step) -> bool {
    match step {
        Step::ScatterRows(ScatterRows { ids, .. }) => program.is_input(*ids),
        Step::Row(_)
        | Step::Segment(_)
        | Step::Gather(_)
        | Step::Pad(_)
        | Step::Unpad(_)
        | Step::Attention(_)
        | Step::AttentionGrad(_)
        | Step::PairGemm(_)
        | Step::OneHot(_)
        | Step::Insert(_)
        | Step::SumRows(_) => true,
        Step::Window(_) => true,
        Step::Pointwise(Pointwise { width, inputs, .. }) => !flat(*width, inputs),
        _ => false,
    }
}

/// The roles of the `inputs` that read slot `slot`.
fn inputs_of(inputs: &[Access], slot: nestor_passes::Slot) -> Vec<Role> {
    (0u32..)
        .zip(inputs)
        .filter(|(_, access)| access.slot == slot)
        .map(|(index, _)| Role::Input(index))
        .collect()
}

/// A fused expression's buffers and the row-to-element maps of its per-element inputs.
type FusedArgs<'ctx> = (Vec<PointerValue<'ctx>>, Vec<Option<PointerValue<'ctx>>>);

/// The buffers of a fused expression's `inputs` and the row-to-element maps of its
/// per-element inputs (`None` for the others).
fn fused_args<'ctx>(kernel: &Kernel<'ctx, '_>, inputs: &[Access]) -> Gen<FusedArgs<'ctx>> {
    let pointers = prologue_args(kernel, inputs)?;
    let maps = (0u32..)
        .zip(inputs)
        .map(|(index, access)| {
            access
                .row_map
                .map(|_| kernel.param(Role::InputRows(index)))
                .transpose()
        })
        .collect::<Gen<Vec<_>>>()?;
    Ok((pointers, maps))
}

/// `sum over column of f(column)` for one row of `width`.
fn row_sum<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    width: i64,
    f: impl Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<FloatValue<'ctx>> {
    lane_sum(kernel, kernel.single_lane(), width, f)
}

/// [`row_sum`] over a row shared by `lanes`: each lane sums its columns, then the lanes'
/// sums are added (the total in every lane).
fn lane_sum<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    lanes: Lanes<'ctx>,
    width: i64,
    f: impl Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<FloatValue<'ctx>> {
    let acc = kernel.accumulator("sum")?;
    kernel.set(acc, kernel.constant(0.0))?;
    kernel.lane_range(lanes, width, |column| {
        let value = f(column)?;
        kernel.set(acc, kernel.fadd_reassociable(kernel.get(acc)?, value)?)
    })?;
    kernel.across_lanes(lanes, kernel.get(acc)?, |a, b| kernel.fadd(a, b))
}

/// The largest (or smallest) of `f(column)` over a row shared by `lanes` (in every
/// lane), NaN if any is NaN; with `bound`, a largest value for softmax (see
/// [`Kernel::softmax_bound`]).
fn lane_extreme<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    lanes: Lanes<'ctx>,
    width: i64,
    (largest, bound): (bool, bool),
    f: impl Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<FloatValue<'ctx>> {
    let combine = |a, b| {
        if bound {
            kernel.softmax_bound(a, b)
        } else {
            kernel.extreme(a, b, largest)
        }
    };
    let acc = kernel.accumulator("extreme")?;
    kernel.set(
        acc,
        kernel.constant(if largest {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        }),
    )?;
    kernel.lane_range(lanes, width, |column| {
        let value = f(column)?;
        kernel.set(acc, combine(kernel.get(acc)?, value)?)
    })?;
    kernel.across_lanes(lanes, kernel.get(acc)?, combine)
}

/// The buffers of a fused expression's inputs.
fn prologue_args<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    inputs: &[Access],
) -> Gen<Vec<PointerValue<'ctx>>> {
    (0u32..)
        .zip(inputs)
        .map(|(index, _)| kernel.param(Role::Input(index)))
        .collect()
}

/// A kernel's input at `(row, column)`: its prologue's expression over its loads (a
/// plain buffer is one load).
fn prologue<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    x: &Fusion,
    inputs: &[PointerValue<'ctx>],
    row: IntValue<'ctx>,
    column: IntValue<'ctx>,
) -> Gen<FloatValue<'ctx>> {
    kernel.expr(&x.expr, &|input: usize| {
        let at = index(kernel, &x.inputs[input], row, column)?;
        kernel.load_float(inputs[input], at)
    })
}

fn row<'ctx>(
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

/// Stores a row's one result (which every lane holds) from its first lane.
fn first_lane_stores<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    lanes: Lanes<'ctx>,
    out: PointerValue<'ctx>,
    at: IntValue<'ctx>,
    value: FloatValue<'ctx>,
) -> Gen<()> {
    if lanes.count == 1 {
        return kernel.store_float(out, at, value);
    }
    kernel.if_else(
        kernel.equal(lanes.lane, kernel.i64(0))?,
        || kernel.store_float(out, at, value),
        || Ok(()),
    )
}

fn segment<'ctx>(kernel: &Kernel<'ctx, '_>, kind: SegmentKind, x: &Fusion, width: i64) -> Gen<()> {
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

fn gather<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, table, ids] = kernel.params([Role::Out, Role::Table, Role::Ids])?;
    kernel.parallel_rows(start, end, |row, lanes| {
        let id = kernel.load_i64(ids, row)?;
        let source = kernel.mul(id, kernel.i64(width))?;
        let target = kernel.mul(row, kernel.i64(width))?;
        kernel.lane_range(lanes, width, |column| {
            let value = kernel.load_float(table, kernel.add(source, column)?)?;
            kernel.store_float(out, kernel.add(target, column)?, value)
        })
    })
}

/// The jagged-pair matmul, a row of `M` a task: scores `out[r, c] = sum_w a[r, w]
/// b[c, w]` over the element's `N_i` columns `c`, or (`mix`) `out[r, w] = sum_c a[r, c]
/// b[c, w]` over the element's pairs of row `r`.
fn pair_gemm<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64, mix: bool) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, a, b, row_offsets, column_offsets, pair_offsets, elements] = kernel.params([
        Role::Out,
        Role::A,
        Role::B,
        Role::Offsets,
        Role::ColumnOffsets,
        Role::PairOffsets,
        Role::RowOwners,
    ])?;
    let sum = kernel.accumulator("sum")?;
    // A row is a warp's on a GPU (each lane its own outputs), one thread's on the host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let element = kernel.load_i64(elements, row)?;
        let next = kernel.add(element, kernel.i64(1))?;
        let position = kernel.sub(row, kernel.load_i64(row_offsets, element)?)?;
        let first_column = kernel.load_i64(column_offsets, element)?;
        let columns = kernel.sub(kernel.load_i64(column_offsets, next)?, first_column)?;
        // The row's pairs: its element's, from the row's position on, `N_i` a row.
        let pairs = kernel.add(
            kernel.load_i64(pair_offsets, element)?,
            kernel.mul(position, columns)?,
        )?;
        // `b[first column + c, w]`.
        let b_at = |c: IntValue<'ctx>, w: IntValue<'ctx>| {
            let b_row = kernel.add(first_column, c)?;
            kernel.add(kernel.mul(b_row, kernel.i64(width))?, w)
        };
        if mix {
            let out_row = kernel.mul(row, kernel.i64(width))?;
            kernel.lane_range(lanes, width, |w| {
                kernel.set(sum, kernel.constant(0.0))?;
                kernel.for_range(kernel.i64(0), columns, |c| {
                    let x = kernel.load_float(a, kernel.add(pairs, c)?)?;
                    let y = kernel.load_float(b, b_at(c, w)?)?;
                    kernel.set(sum, kernel.fadd(kernel.get(sum)?, kernel.fmul(x, y)?)?)
                })?;
                kernel.store_float(out, kernel.add(out_row, w)?, kernel.get(sum)?)
            })
        } else {
            let a_row = kernel.mul(row, kernel.i64(width))?;
            kernel.lane_range_until(lanes, columns, |c| {
                let dot = row_sum(kernel, width, |w| {
                    let x = kernel.load_float(a, kernel.add(a_row, w)?)?;
                    kernel.fmul(x, kernel.load_float(b, b_at(c, w)?)?)
                })?;
                kernel.store_float(out, kernel.add(pairs, c)?, dot)
            })
        }
    })
}

/// A direct convolution, an output pixel a task: `out[r, o] = bias[o] + sum over the
/// taps t inside the image and the channels c of x[taps[r, t], c] weight[o, c, t]`; the
/// `adjoint` (a convolution's input gradient, `x` its output's) reads the forward weight
/// `[channels, width, taps]` flipped and transposed: `weight[c, o, taps - 1 - t]`.
fn convolution<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (channels, width): (i64, i64),
    taps: i64,
    adjoint: bool,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, weight] = kernel.params([Role::Out, Role::X, Role::Weight])?;
    let bias = kernel.optional(Role::Bias)?;
    let table = kernel.param(Role::Taps)?;
    let sum = kernel.accumulator("sum")?;
    // An output pixel is a warp's on a GPU (each lane its output channels), one
    // thread's on the host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let first_tap = kernel.mul(row, kernel.i64(taps))?;
        let out_row = kernel.mul(row, kernel.i64(width))?;
        kernel.lane_range(lanes, width, |o| {
            let initial = match bias {
                Some(bias) => kernel.load_float(bias, o)?,
                None => kernel.constant(0.0),
            };
            kernel.set(sum, initial)?;
            taps_inside(kernel, (table, first_tap, taps), |t, source| {
                let pixel = kernel.mul(source, kernel.i64(channels))?;
                // Where `weight` holds the tap, and how far apart its channels are.
                let (first, stride) = if adjoint {
                    // `weight[c, o, taps - 1 - t]` of `[channels, width, taps]`.
                    let flipped = kernel.sub(kernel.i64(taps - 1), t)?;
                    let at = kernel.add(kernel.mul(o, kernel.i64(taps))?, flipped)?;
                    (at, width.saturating_mul(taps))
                } else {
                    // `weight[o, c, t]` of `[width, channels, taps]`.
                    let row = kernel.mul(o, kernel.i64(channels.saturating_mul(taps)))?;
                    (kernel.add(row, t)?, taps)
                };
                kernel.for_range(kernel.i64(0), kernel.i64(channels), |c| {
                    let value = kernel.load_float(x, kernel.add(pixel, c)?)?;
                    let w = kernel.load_float(
                        weight,
                        kernel.add(first, kernel.mul(c, kernel.i64(stride))?)?,
                    )?;
                    kernel.set(sum, kernel.fadd(kernel.get(sum)?, kernel.fmul(value, w)?)?)
                })
            })?;
            kernel.store_float(out, kernel.add(out_row, o)?, kernel.get(sum)?)
        })
    })
}

/// `body(t, source)` for the taps `t` of a window that fall inside its image: `taps`
/// input pixels (`source`) from `first_tap` in `table`, -1 marking a tap outside.
fn taps_inside<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (table, first_tap, taps): (PointerValue<'ctx>, IntValue<'ctx>, i64),
    body: impl Fn(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>,
) -> Gen<()> {
    kernel.for_range(kernel.i64(0), kernel.i64(taps), |t| {
        let source = kernel.load_i64(table, kernel.add(first_tap, t)?)?;
        if_inside(kernel, source, || body(t, source))
    })
}

/// `body()` when `source` is an input pixel (not -1: a tap outside the image).
fn if_inside<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    source: IntValue<'ctx>,
    body: impl FnOnce() -> Gen<()>,
) -> Gen<()> {
    kernel.if_else(kernel.less(kernel.i64(-1), source)?, body, || Ok(()))
}

/// Max or average pooling, an output pixel a task: over the window's taps inside the
/// image, in order, the largest value (a NaN replaces it, as in torch; -inf for a
/// window without one) or the mean (NaN for none).
fn pool<'ctx>(kernel: &Kernel<'ctx, '_>, channels: i64, taps: i64, max: bool) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, table] = kernel.params([Role::Out, Role::X, Role::Taps])?;
    let [value, inside] = kernel.accumulators(["value", "inside"])?;
    let initial = kernel.constant(if max { f64::NEG_INFINITY } else { 0.0 });
    // An output pixel is a warp's on a GPU (each lane its channels), one thread's on the
    // host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let first_tap = kernel.mul(row, kernel.i64(taps))?;
        let out_row = kernel.mul(row, kernel.i64(channels))?;
        kernel.lane_range(lanes, channels, |c| {
            kernel.set(value, initial)?;
            kernel.set(inside, kernel.constant(0.0))?;
            taps_inside(kernel, (table, first_tap, taps), |_, source| {
                let at = kernel.add(kernel.mul(source, kernel.i64(channels))?, c)?;
                let p = kernel.load_float(x, at)?;
                let current = kernel.get(value)?;
                let next = if max {
                    let larger = kernel.select_if(FloatPredicate::OGT, (p, current), p, current)?;
                    kernel.select_if(FloatPredicate::UNO, (p, p), p, larger)?
                } else {
                    kernel.fadd(current, p)?
                };
                kernel.set(value, next)?;
                kernel.set(
                    inside,
                    kernel.fadd(kernel.get(inside)?, kernel.constant(1.0))?,
                )
            })?;
            let result = if max {
                kernel.get(value)?
            } else {
                kernel.fdiv(kernel.get(value)?, kernel.get(inside)?)?
            };
            kernel.store_float(out, kernel.add(out_row, c)?, result)
        })
    })
}

/// Every image's mean pixel, an image a task: its pixels summed in order, divided by
/// their count (NaN for an empty image, as torch's mean).
fn image_mean<'ctx>(kernel: &Kernel<'ctx, '_>, channels: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, offsets] = kernel.params([Role::Out, Role::X, Role::PairOffsets])?;
    let sum = kernel.accumulator("sum")?;
    // An image is a warp's on a GPU (each lane its channels), one thread's on the host.
    kernel.parallel_rows(start, end, |image, lanes| {
        let first = kernel.load_i64(offsets, image)?;
        let pixels = kernel.sub(
            kernel.load_i64(offsets, kernel.add(image, kernel.i64(1))?)?,
            first,
        )?;
        let out_row = kernel.mul(image, kernel.i64(channels))?;
        kernel.lane_range(lanes, channels, |c| {
            kernel.set(sum, kernel.constant(0.0))?;
            kernel.for_range(kernel.i64(0), pixels, |p| {
                let at = kernel.add(kernel.mul(kernel.add(first, p)?, kernel.i64(channels))?, c)?;
                kernel.set(
                    sum,
                    kernel.fadd(kernel.get(sum)?, kernel.load_float(x, at)?)?,
                )
            })?;
            let mean = kernel.fdiv(kernel.get(sum)?, kernel.to_float(pixels)?)?;
            kernel.store_float(out, kernel.add(out_row, c)?, mean)
        })
    })
}

/// A convolution's weight gradient, a weight a task: `out[o, c, t] = sum over the
/// output pixels r (in order; on a GPU each lane in order over its pixels) of g[r, o]
/// x[taps[r, t], c]`, taps outside the image skipped.
fn weight_grad<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (channels, width): (i64, i64),
    taps: i64,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, g, table, count] =
        kernel.params([Role::Out, Role::X, Role::Gradient, Role::Taps, Role::Count])?;
    let rows = kernel.load_i64(count, kernel.i64(0))?;
    let sum = kernel.accumulator("sum")?;
    let per_output = channels.saturating_mul(taps);
    // A weight is a warp's on a GPU (each lane every 32nd pixel, the lanes' sums added
    // with shuffles), one thread's on the host (every pixel in order).
    kernel.parallel_rows(start, end, |task, lanes| {
        let o = kernel.div(task, kernel.i64(per_output))?;
        let inner = kernel.rem(task, kernel.i64(per_output))?;
        let c = kernel.div(inner, kernel.i64(taps))?;
        let t = kernel.rem(inner, kernel.i64(taps))?;
        kernel.set(sum, kernel.constant(0.0))?;
        kernel.lane_range_until(lanes, rows, |r| {
            let source =
                kernel.load_i64(table, kernel.add(kernel.mul(r, kernel.i64(taps))?, t)?)?;
            if_inside(kernel, source, || {
                let value = kernel
                    .load_float(x, kernel.add(kernel.mul(source, kernel.i64(channels))?, c)?)?;
                let gradient =
                    kernel.load_float(g, kernel.add(kernel.mul(r, kernel.i64(width))?, o)?)?;
                kernel.set(
                    sum,
                    kernel.fadd(kernel.get(sum)?, kernel.fmul(gradient, value)?)?,
                )
            })
        })?;
        let total = kernel.across_lanes(lanes, kernel.get(sum)?, |a, b| kernel.fadd(a, b))?;
        first_lane_stores(kernel, lanes, out, task, total)
    })
}

/// Pooling's gradient, an input pixel a task: the gradients of the windows that read it
/// (`inverse`: per pixel, where its windows' list starts and ends in the same buffer,
/// then the lists, windows in order), added in order: each divided by its window's taps
/// inside the image for average pooling; for max pooling those whose window picked it
/// (the first largest, or the last NaN, as libtorch's kernel).
fn pool_grad<'ctx>(kernel: &Kernel<'ctx, '_>, channels: i64, taps: i64, max: bool) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, g, table, inverse] = kernel.params([
        Role::Out,
        Role::X,
        Role::Gradient,
        Role::Taps,
        Role::WindowsOfPixels,
    ])?;
    let [sum, best, inside] = kernel.accumulators(["sum", "best", "inside"])?;
    let picked = kernel.index_variable("picked")?;
    // An input pixel is a warp's on a GPU (each lane its channels), one thread's on the
    // host.
    kernel.parallel_rows(start, end, |pixel, lanes| {
        let from = kernel.load_i64(inverse, pixel)?;
        let to = kernel.load_i64(inverse, kernel.add(pixel, kernel.i64(1))?)?;
        let out_row = kernel.mul(pixel, kernel.i64(channels))?;
        kernel.lane_range(lanes, channels, |c| {
            kernel.set(sum, kernel.constant(0.0))?;
            kernel.for_range(from, to, |entry| {
                let r = kernel.load_i64(inverse, entry)?;
                let first_tap = kernel.mul(r, kernel.i64(taps))?;
                let gradient =
                    kernel.load_float(g, kernel.add(kernel.mul(r, kernel.i64(channels))?, c)?)?;
                // Max pooling: the tap the window picked; average: its taps inside.
                if max {
                    kernel.set(best, kernel.constant(f64::NEG_INFINITY))?;
                    kernel.set_index(picked, kernel.i64(-1))?;
                } else {
                    kernel.set(inside, kernel.constant(0.0))?;
                }
                taps_inside(kernel, (table, first_tap, taps), |_, source| {
                    if !max {
                        let one = kernel.constant(1.0);
                        return kernel.set(inside, kernel.fadd(kernel.get(inside)?, one)?);
                    }
                    let at = kernel.add(kernel.mul(source, kernel.i64(channels))?, c)?;
                    let value = kernel.load_float(x, at)?;
                    let current = kernel.get(best)?;
                    // A larger value or a NaN replaces the best so far; the first
                    // tap inside is picked whatever its value.
                    let larger = kernel.or(
                        kernel.float_compare(FloatPredicate::OGT, value, current)?,
                        kernel.float_compare(FloatPredicate::UNO, value, value)?,
                    )?;
                    let index = kernel.get_index(picked)?;
                    let replaces = kernel.or(larger, kernel.equal(index, kernel.i64(-1))?)?;
                    kernel.set(best, kernel.select(larger, value, current)?)?;
                    kernel.set_index(picked, kernel.select_index(replaces, source, index)?)
                })?;
                let add = |share| kernel.set(sum, kernel.fadd(kernel.get(sum)?, share)?);
                if max {
                    let hit = kernel.equal(kernel.get_index(picked)?, pixel)?;
                    kernel.if_else(hit, || add(gradient), || Ok(()))
                } else {
                    add(kernel.fdiv(gradient, kernel.get(inside)?)?)
                }
            })?;
            kernel.store_float(out, kernel.add(out_row, c)?, kernel.get(sum)?)
        })
    })
}

/// The gradient of every image's mean pixel spread over its pixels, an image a task:
/// `out[p, c] = x[image, c] / pixels` (`offsets`: the images' first pixels).
fn image_spread<'ctx>(kernel: &Kernel<'ctx, '_>, channels: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, offsets] = kernel.params([Role::Out, Role::X, Role::PairOffsets])?;
    // An image is a warp's on a GPU (each lane its channels), one thread's on the host.
    kernel.parallel_rows(start, end, |image, lanes| {
        let first = kernel.load_i64(offsets, image)?;
        let last = kernel.load_i64(offsets, kernel.add(image, kernel.i64(1))?)?;
        let divisor = kernel.to_float(kernel.sub(last, first)?)?;
        let mean_row = kernel.mul(image, kernel.i64(channels))?;
        kernel.for_range(first, last, |p| {
            let out_row = kernel.mul(p, kernel.i64(channels))?;
            kernel.lane_range(lanes, channels, |c| {
                let mean = kernel.load_float(x, kernel.add(mean_row, c)?)?;
                kernel.store_float(out, kernel.add(out_row, c)?, kernel.fdiv(mean, divisor)?)
            })
        })
    })
}

/// `out[r, j] = epilogue(sum_c x[r, c] W[j, c] + bias[j])` (`W[c, j]` when
/// `transposed`): one output value per iteration of the parallel loop, the epilogue
/// applied to the sum before it is stored (its reads of `out` are the sum itself). With
/// `product_given`, the sum is what `out[r, j]` holds (a BLAS wrote it).
fn gemm<'ctx>(kernel: &Kernel<'ctx, '_>, step: &Gemm, product_given: bool) -> Gen<()> {
    let Gemm {
        out: out_slot,
        k,
        n,
        transposed,
        ref epilogue,
        ..
    } = *step;
    let (start, end) = kernel.range()?;
    let out = kernel.param(Role::Out)?;
    // A given product is the output already: the kernel does not read the operands.
    let operands = if product_given {
        None
    } else {
        Some(kernel.params([Role::X, Role::Weight])?)
    };
    let bias = kernel.optional(Role::Bias)?;
    let epilogue = epilogue.as_ref();
    let inputs = epilogue.map_or(&[][..], |epilogue| &epilogue.inputs[..]);
    // The epilogue's reads of the result are the sum itself (never loaded), but their
    // arguments are the output's buffer.
    kernel.output_also(inputs_of(inputs, out_slot));
    let (pointers, maps) = fused_args(kernel, inputs)?;
    kernel.parallel_range(start, end, |task| {
        let row = kernel.div(task, kernel.i64(n))?;
        let column = kernel.rem(task, kernel.i64(n))?;
        let sum = if let Some([x, weight]) = operands {
            let x_row = kernel.mul(row, kernel.i64(k))?;
            row_sum(kernel, k, |inner| {
                let at = if transposed {
                    kernel.add(kernel.mul(inner, kernel.i64(n))?, column)?
                } else {
                    kernel.add(kernel.mul(column, kernel.i64(k))?, inner)?
                };
                let product = kernel.load_float(x, kernel.add(x_row, inner)?)?;
                kernel.fmul(product, kernel.load_float(weight, at)?)
            })?
        } else {
            kernel.load_float(out, task)?
        };
        let sum = match bias {
            Some(bias) => kernel.fadd(sum, kernel.load_float(bias, column)?)?,
            None => sum,
        };
        let value = match epilogue {
            None => sum,
            Some(epilogue) => kernel.expr(&epilogue.expr, &|input: usize| {
                let access = &inputs[input];
                if access.slot == out_slot {
                    return Ok(sum);
                }
                let element_row = match maps[input] {
                    Some(map) => kernel.load_i64(map, row)?,
                    None => row,
                };
                let at = index(kernel, access, element_row, column)?;
                kernel.load_float(pointers[input], at)
            })?,
        };
        kernel.store_float(out, task, value)
    })
}

/// `out[r, c] = 1` where `c == ids[r]` (a row of zeros for `ignore`), else 0.
fn one_hot<'ctx>(kernel: &Kernel<'ctx, '_>, classes: i64, ignore: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, ids] = kernel.params([Role::Out, Role::Ids])?;
    let [zero, one] = [0.0, 1.0].map(|value| kernel.constant(value));
    // A row is a warp's on a GPU (each lane its classes), one thread's on the host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let id = kernel.load_i64(ids, row)?;
        let ignored = kernel.equal(id, kernel.i64(ignore))?;
        let base = kernel.mul(row, kernel.i64(classes))?;
        kernel.lane_range(lanes, classes, |class| {
            let hit = kernel.select(kernel.equal(id, class)?, one, zero)?;
            let value = kernel.select(ignored, zero, hit)?;
            kernel.store_float(out, kernel.add(base, class)?, value)
        })
    })
}

/// A dropout mask: value `i` is `1 / (1 - p)` where the top 53 bits of
/// `split_mix(key ^ i)` as a fraction of 2^53 are at least `p`, else 0 (the CPU
/// runtime's generator: the same key gives the same mask).
fn random_mask<'ctx>(kernel: &Kernel<'ctx, '_>, p: f64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, key] = kernel.params([Role::Out, Role::MaskKey])?;
    let key = kernel.load_i64(key, kernel.i64(0))?;
    // `bits / 2^53 >= p` exactly when `bits >= ceil(p 2^53)` (both sides exact).
    let threshold = (p * (1u64 << 53) as f64)
        .ceil()
        .clamp(0.0, (1u64 << 53) as f64) as u64;
    let threshold = kernel.context.i64_type().const_int(threshold, false);
    let [zero, kept] = [0.0, 1.0 / (1.0 - p)].map(|value| kernel.constant(value));
    kernel.parallel_range(start, end, |position| {
        let bits = kernel.shift_right(kernel.split_mix(kernel.xor(key, position)?)?, 11)?;
        let value = kernel.select(kernel.at_least_unsigned(bits, threshold)?, kept, zero)?;
        kernel.store_float(out, position, value)
    })
}

/// `out[b] = lengths[b]` as numbers.
fn length_values<'ctx>(kernel: &Kernel<'ctx, '_>) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, lengths] = kernel.params([Role::Out, Role::Lengths])?;
    kernel.parallel_range(start, end, |element| {
        let value = kernel.to_float(kernel.load_i64(lengths, element)?)?;
        kernel.store_float(out, element, value)
    })
}

/// `out` viewed as `[rows, size, inner]`: `x`'s row at `index`, zeros elsewhere.
fn insert<'ctx>(kernel: &Kernel<'ctx, '_>, size: i64, index: i64, inner: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x] = kernel.params([Role::Out, Role::X])?;
    let zero = kernel.constant(0.0);
    // A row is a warp's on a GPU (each lane its values), one thread's on the host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let source = kernel.mul(row, kernel.i64(inner))?;
        let target = kernel.mul(row, kernel.i64(size * inner))?;
        kernel.lane_range(lanes, size * inner, |at| {
            let column = kernel.sub(at, kernel.i64(index * inner))?;
            let inside = kernel.and(
                kernel.less(kernel.i64(-1), column)?,
                kernel.less(column, kernel.i64(inner))?,
            )?;
            let destination = kernel.add(target, at)?;
            kernel.if_else(
                inside,
                || {
                    let value = kernel.load_float(x, kernel.add(source, column)?)?;
                    kernel.store_float(out, destination, value)
                },
                || kernel.store_float(out, destination, zero),
            )
        })
    })
}

/// `out[i, j] = sum over rows r of a[r, i] b[r, j]` (`a` absent: ones), divided by the
/// number of rows when `mean` (NaN for none).
fn sum_rows<'ctx>(kernel: &Kernel<'ctx, '_>, (m, n): (i64, i64), mean: bool) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let out = kernel.param(Role::Out)?;
    let a = kernel.optional(Role::A)?;
    let [b, count] = kernel.params([Role::B, Role::Count])?;
    let rows = kernel.load_i64(count, kernel.i64(0))?;
    let total = kernel.accumulator("total")?;
    // An output value is a warp's on a GPU (each lane every 32nd row in order, the
    // lanes' sums added with shuffles), one thread's on the host.
    kernel.parallel_rows(start, end, |task, lanes| {
        let i = kernel.div(task, kernel.i64(n))?;
        let j = kernel.rem(task, kernel.i64(n))?;
        kernel.set(total, kernel.constant(0.0))?;
        kernel.lane_range_until(lanes, rows, |row| {
            let y = kernel.load_float(b, kernel.add(kernel.mul(row, kernel.i64(n))?, j)?)?;
            let term = match a {
                Some(a) => {
                    let x =
                        kernel.load_float(a, kernel.add(kernel.mul(row, kernel.i64(m))?, i)?)?;
                    kernel.fmul(x, y)?
                }
                None => y,
            };
            kernel.set(total, kernel.fadd_reassociable(kernel.get(total)?, term)?)
        })?;
        let sum = kernel.across_lanes(lanes, kernel.get(total)?, |a, b| kernel.fadd(a, b))?;
        let value = if mean {
            kernel.fdiv(sum, kernel.to_float(rows)?)?
        } else {
            sum
        };
        first_lane_stores(kernel, lanes, out, task, value)
    })
}

/// `out[v, c] = sum of g[r, c] over the rows r with ids[r] == v` (nothing for
/// `padding`): each output value reads every id once.
fn scatter_rows<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64, padding: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, g, ids, count] =
        kernel.params([Role::Out, Role::Gradient, Role::Ids, Role::Count])?;
    let rows = kernel.load_i64(count, kernel.i64(0))?;
    let total = kernel.accumulator("total")?;
    let zero = kernel.constant(0.0);
    kernel.parallel_range(start, end, |task| {
        let entry = kernel.div(task, kernel.i64(width))?;
        let column = kernel.rem(task, kernel.i64(width))?;
        kernel.set(total, zero)?;
        kernel.for_range(kernel.i64(0), rows, |row| {
            let hit = kernel.equal(kernel.load_i64(ids, row)?, entry)?;
            kernel.if_else(
                hit,
                || {
                    let at = kernel.add(kernel.mul(row, kernel.i64(width))?, column)?;
                    kernel.set(
                        total,
                        kernel.fadd(kernel.get(total)?, kernel.load_float(g, at)?)?,
                    )
                },
                || Ok(()),
            )
        })?;
        let padded = kernel.equal(entry, kernel.i64(padding))?;
        let value = kernel.select(padded, zero, kernel.get(total)?)?;
        kernel.store_float(out, task, value)
    })
}

/// `out[v, c] = sum of g[r, c] over the rows r with ids[r] == v, in order` (nothing for
/// `padding`), a table row a task (a warp's on a GPU, each lane its columns) over the
/// rows of its id: `rows` holds `V + 1` positions into itself (id `v`'s rows are at
/// `rows[rows[v]..rows[v + 1]]`), then the rows, in order.
fn scatter_indexed_rows<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64, padding: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, g, rows] = kernel.params([Role::Out, Role::Gradient, Role::RowsOfIds])?;
    let total = kernel.accumulator("total")?;
    let zero = kernel.constant(0.0);
    kernel.parallel_rows(start, end, |entry, lanes| {
        let from = kernel.load_i64(rows, entry)?;
        let to = kernel.load_i64(rows, kernel.add(entry, kernel.i64(1))?)?;
        let padded = kernel.equal(entry, kernel.i64(padding))?;
        let out_row = kernel.mul(entry, kernel.i64(width))?;
        kernel.lane_range(lanes, width, |column| {
            kernel.set(total, zero)?;
            kernel.for_range(from, to, |at| {
                let row = kernel.load_i64(rows, at)?;
                let at = kernel.add(kernel.mul(row, kernel.i64(width))?, column)?;
                kernel.set(
                    total,
                    kernel.fadd(kernel.get(total)?, kernel.load_float(g, at)?)?,
                )
            })?;
            let value = kernel.select(padded, zero, kernel.get(total)?)?;
            kernel.store_float(out, kernel.add(out_row, column)?, value)
        })
    })
}

/// Padded row `p` of `B x longest`: row `p % longest` of element `p / longest`, or
/// `value` past its length.
fn pad<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64, value: f64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, offsets, longest] =
        kernel.params([Role::Out, Role::X, Role::Offsets, Role::Longest])?;
    let longest = kernel.load_i64(longest, kernel.i64(0))?;
    kernel.parallel_rows(start, end, |padded, lanes| {
        let element = kernel.div(padded, longest)?;
        let position = kernel.rem(padded, longest)?;
        let first = kernel.load_i64(offsets, element)?;
        let length = kernel.sub(
            kernel.load_i64(offsets, kernel.add(element, kernel.i64(1))?)?,
            first,
        )?;
        let target = kernel.mul(padded, kernel.i64(width))?;
        let columns = |body: &dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>| {
            kernel.lane_range(lanes, width, |column| {
                kernel.store_float(out, kernel.add(target, column)?, body(column)?)
            })
        };
        kernel.if_else(
            kernel.less(position, length)?,
            || {
                let source = kernel.mul(kernel.add(first, position)?, kernel.i64(width))?;
                columns(&|column| kernel.load_float(x, kernel.add(source, column)?))
            },
            || columns(&|_| Ok(kernel.constant(value))),
        )
    })
}

/// Result row `r` (of element `e`, position `r - offsets[e]`): row
/// `e * longest + position` of the padded grid.
fn unpad<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, offsets, longest, elements] = kernel.params([
        Role::Out,
        Role::X,
        Role::Offsets,
        Role::Longest,
        Role::RowOwners,
    ])?;
    let longest = kernel.load_i64(longest, kernel.i64(0))?;
    kernel.parallel_rows(start, end, |row, lanes| {
        let element = kernel.load_i64(elements, row)?;
        let position = kernel.sub(row, kernel.load_i64(offsets, element)?)?;
        let padded = kernel.add(kernel.mul(element, longest)?, position)?;
        let (source, target) = (
            kernel.mul(padded, kernel.i64(width))?,
            kernel.mul(row, kernel.i64(width))?,
        );
        kernel.lane_range(lanes, width, |column| {
            let value = kernel.load_float(x, kernel.add(source, column)?)?;
            kernel.store_float(out, kernel.add(target, column)?, value)
        })
    })
}

/// Varlen attention without scores in memory: one (query row, head) per task of the
/// parallel loop (a warp's on a GPU: its lanes share the head's columns and add their
/// parts of each score with shuffles; one thread's on the host), an online softmax over
/// the keys of the row's element (the running
/// maximum rescales the running sum and output), as libtorch's scaled dot-product
/// attention: a row without a finite score (or without keys) gives 0, a NaN score makes
/// the row NaN, and with `causal` a masked (future) key's score that is NaN or +inf
/// makes the row NaN (libtorch adds -inf to it) and its values count with weight 0 (a
/// value that is not finite makes its column NaN, as libtorch's product does).
fn attention<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    [q, k, v]: [&Access; 3],
    (heads, head_dim, value_dim): (i64, i64, i64),
    causal: bool,
    scale: f64,
) -> Gen<()> {
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
fn attention_grad<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    [q, k, v, g]: [&Access; 4],
    (heads, head_dim): (i64, i64),
    (causal, scale, keys): (bool, f64, bool),
) -> Gen<()> {
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
