//! Row kernels: norms, softmax, row reductions (a row a warp on a GPU, a block for long
//! rows).

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
    let keys = kernel.optional(Role::Keys)?;
    let n = kernel.constant(width as f64);
    let passes = matches!(
        kind,
        RowKind::LayerNorm
            | RowKind::RmsNorm
            | RowKind::Softmax
            | RowKind::LogSoftmax
            | RowKind::NormGrad { .. }
    );
    // A row is a warp's on a GPU (its lanes share the columns; a block's for rows over
    // `BLOCK_ROW_WIDTH`; a thread's for a scan, whose columns run in order), one
    // thread's on the host.
    let lanes_per_row = if kind.one_thread_a_row() {
        1
    } else if width > BLOCK_ROW_WIDTH {
        i64::from(crate::GPU_BLOCK_THREADS)
    } else {
        kernel.lane_count()
    };
    kernel.parallel_rows_of_width((lanes_per_row, width), start, end, |row, lanes| {
        let base = kernel.mul(row, kernel.i64(width))?;
        let at = |column: IntValue<'ctx>| kernel.add(base, column);
        let load = |column| prologue(kernel, x, &inputs, row, column);
        // Kernels of several passes over the row keep it in registers on a GPU (read
        // once); on the host each pass computes the prologue again (it is cheap, the
        // row is in cache, and the input is never written to memory).
        let row_values = match kernel.register_chunks(lanes, width).filter(|_| passes) {
            Some(chunks) => RowValues::kept(kernel, lanes, (width, chunks), &load)?,
            None => RowValues::loaded(kernel, lanes, width, &load),
        };
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
                let centered = kind == RowKind::LayerNorm;
                let (mean, inverse) =
                    row_values.norm_statistics(&|_, value| Ok(value), centered, (n, eps))?;
                row_values.each(|column, value| {
                    let normed = kernel.fmul(kernel.fsub(value, mean)?, inverse)?;
                    kernel.store_float(out, at(column)?, affine(normed, column)?)
                })
            }
            RowKind::Softmax => {
                let max = row_values.extreme((true, true))?;
                // One exp per value: e^(x - max) is kept (in registers, else written to
                // the output) while it is summed, then scaled (as libtorch's kernel).
                let store = |column, value| kernel.store_float(out, at(column)?, value);
                let total = row_values
                    .replace(|_, value| kernel.fast_exp(kernel.fsub(value, max)?), &store)?;
                let inverse = kernel.fdiv(kernel.constant(1.0), total)?;
                let stored = |column| kernel.load_float(out, at(column)?);
                row_values.each_replaced(&stored, |column, value| {
                    kernel.store_float(out, at(column)?, kernel.fmul(value, inverse)?)
                })
            }
            RowKind::LogSoftmax => {
                let max = row_values.extreme((true, true))?;
                let total = row_values.sum(|_, value| kernel.fast_exp(kernel.fsub(value, max)?))?;
                let log_total = kernel.math("log", &[total])?;
                row_values.each(|column, value| {
                    let shifted = kernel.fsub(value, max)?;
                    kernel.store_float(out, at(column)?, kernel.fsub(shifted, log_total)?)
                })
            }
            RowKind::Sum | RowKind::Mean => {
                let sum = row_values.sum(|_, value| Ok(value))?;
                let value = if kind == RowKind::Mean {
                    kernel.fdiv(sum, n)?
                } else {
                    sum
                };
                first_lane_stores(kernel, lanes, out, row, value)
            }
            RowKind::Max | RowKind::Min => {
                let value = row_values.extreme((kind == RowKind::Max, false))?;
                first_lane_stores(kernel, lanes, out, row, value)
            }
            RowKind::Scan { product, reverse } => scan(
                kernel,
                (product, reverse),
                (kernel.i64(0), kernel.i64(width)),
                &load,
                |column, value| kernel.store_float(out, at(column)?, value),
            ),
            RowKind::Order(order) => {
                let keyed = keys.map(|keys| move |column| kernel.load_float(keys, at(column)?));
                // A line's kept values are columns `row * kept ..` of a narrow output
                // (or of a gradient's `x`, read through its prologue).
                let kept = order.kept().unwrap_or(1);
                let kept_at = |j| kernel.add(kernel.mul(row, kernel.i64(kept))?, j);
                let kept_load = |j| prologue(kernel, x, &inputs, row, j);
                let line = Line {
                    range: (kernel.i64(0), kernel.i64(width)),
                    load: &load,
                    keys: keyed.as_ref().map(|key| key as Values<'_, 'ctx>),
                    at: &at,
                    kept_at: &kept_at,
                    kept_load: &kept_load,
                };
                order_line(kernel, order, out, &line)
            }
            RowKind::NormGrad { centered, part } => {
                let keys = keys.ok_or_else(|| {
                    crate::CodegenError::new("a norm's gradient reads the norm's input as its keys")
                })?;
                // The row's statistics, recomputed from the norm's input `x` (the keys).
                let x_at = |column| kernel.load_float(keys, at(column)?);
                let (mean, rstd) =
                    row_values.norm_statistics(&|column, _| x_at(column), centered, (n, eps))?;
                let deviation = |column| kernel.fsub(x_at(column)?, mean);
                let normalized = |column| kernel.fmul(deviation(column)?, rstd);
                // The cotangent times the weight, if any.
                let scaled = |column, g| match weight {
                    Some(weight) => kernel.fmul(g, kernel.load_float(weight, column)?),
                    None => Ok(g),
                };
                match part {
                    // g xhat.
                    NormGradPart::Weight => row_values.each(|column, g| {
                        let product = kernel.fmul(scaled(column, g)?, normalized(column)?)?;
                        kernel.store_float(out, at(column)?, product)
                    }),
                    // rstd (g - mean(g) - xhat mean(g xhat)).
                    NormGradPart::Input => {
                        let shift = if centered {
                            kernel.fdiv(row_values.sum(scaled)?, n)?
                        } else {
                            kernel.constant(0.0)
                        };
                        let projection = kernel.fdiv(
                            row_values.sum(|column, g| {
                                kernel.fmul(scaled(column, g)?, normalized(column)?)
                            })?,
                            n,
                        )?;
                        row_values.each(|column, g| {
                            let along = kernel.fmul(normalized(column)?, projection)?;
                            let inner =
                                kernel.fsub(kernel.fsub(scaled(column, g)?, shift)?, along)?;
                            kernel.store_float(out, at(column)?, kernel.fmul(rstd, inner)?)
                        })
                    }
                }
            }
            RowKind::LogSumExp => {
                let shift = finite_shift(kernel, row_values.extreme((true, false))?)?;
                let total =
                    row_values.sum(|_, value| kernel.fast_exp(kernel.fsub(value, shift)?))?;
                let value = kernel.fadd(kernel.math("log", &[total])?, shift)?;
                first_lane_stores(kernel, lanes, out, row, value)
            }
        }
    })
}

/// logsumexp's shift: the largest value, or 0 where that is infinite (as libtorch, so
/// that a row of -inf gives -inf and a row with +inf gives +inf, not NaN).
pub(super) fn finite_shift<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    largest: FloatValue<'ctx>,
) -> Gen<FloatValue<'ctx>> {
    let magnitude = kernel.intrinsic("llvm.fabs", &[largest])?;
    let infinite = kernel.float_compare(
        FloatPredicate::OEQ,
        magnitude,
        kernel.constant(f64::INFINITY),
    )?;
    kernel.select(infinite, kernel.constant(0.0), largest)
}

/// A row's values as the passes of a row kernel see them: kept in a lane's registers
/// (a GPU's rows of up to [`ROW_REGISTERS`] values a lane, read once), or loaded (the
/// prologue computed) again by every pass.
struct RowValues<'a, 'ctx, 'm> {
    kernel: &'a Kernel<'ctx, 'm>,
    lanes: Lanes<'ctx>,
    width: i64,
    /// The value at a column.
    load: &'a dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    /// The lane's values, one a chunk, and how many chunks.
    kept: Option<(Local<'ctx>, i64)>,
}

impl<'a, 'ctx, 'm> RowValues<'a, 'ctx, 'm> {
    /// Values `load` gives, computed by every pass.
    fn loaded(
        kernel: &'a Kernel<'ctx, 'm>,
        lanes: Lanes<'ctx>,
        width: i64,
        load: &'a dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    ) -> Self {
        Self {
            kernel,
            lanes,
            width,
            load,
            kept: None,
        }
    }

    /// Values `load` gives, each computed once into the lane's registers.
    fn kept(
        kernel: &'a Kernel<'ctx, 'm>,
        lanes: Lanes<'ctx>,
        (width, chunks): (i64, i64),
        load: &'a dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    ) -> Gen<Self> {
        let values = kernel.accumulator_array("row", chunks)?;
        kernel.unrolled_lane_range(lanes, (width, chunks), |column, chunk| {
            kernel.store_local(values, kernel.i64(chunk), load(column)?)
        })?;
        Ok(Self {
            kernel,
            lanes,
            width,
            load,
            kept: Some((values, chunks)),
        })
    }

    /// `body(column, value)` over the lane's columns.
    fn each(&self, mut body: impl FnMut(IntValue<'ctx>, FloatValue<'ctx>) -> Gen<()>) -> Gen<()> {
        let kernel = self.kernel;
        match self.kept {
            Some((values, chunks)) => {
                kernel.unrolled_lane_range(self.lanes, (self.width, chunks), |column, chunk| {
                    body(column, kernel.load_local(values, kernel.i64(chunk))?)
                })
            }
            None => kernel.lane_range(self.lanes, self.width, |column| {
                body(column, (self.load)(column)?)
            }),
        }
    }

    /// The sum of `f(column, value)` over the row, in every lane.
    fn sum(
        &self,
        f: impl Fn(IntValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    ) -> Gen<FloatValue<'ctx>> {
        let kernel = self.kernel;
        let acc = kernel.accumulator("sum")?;
        kernel.set(acc, kernel.constant(0.0))?;
        self.each(|column, value| {
            kernel.set(
                acc,
                kernel.fadd_reassociable(kernel.get(acc)?, f(column, value)?)?,
            )
        })?;
        kernel.across_lanes(self.lanes, kernel.get(acc)?, |a, b| kernel.fadd(a, b))
    }

    /// A norm's statistics of the values `f(column, value)`: their mean (0 when not
    /// `centered`: RMS norm) and `1 / sqrt(var + eps)`, `var` the mean square about it
    /// (`n` the row's width as a float).
    fn norm_statistics(
        &self,
        f: &dyn Fn(IntValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>>,
        centered: bool,
        (n, eps): (FloatValue<'ctx>, f64),
    ) -> Gen<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let kernel = self.kernel;
        let mean = if centered {
            kernel.fdiv(self.sum(f)?, n)?
        } else {
            kernel.constant(0.0)
        };
        let variance = kernel.fdiv(
            self.sum(|column, value| {
                let deviation = kernel.fsub(f(column, value)?, mean)?;
                kernel.fmul(deviation, deviation)
            })?,
            n,
        )?;
        let root =
            kernel.intrinsic("llvm.sqrt", &[kernel.fadd(variance, kernel.constant(eps))?])?;
        Ok((mean, kernel.fdiv(kernel.constant(1.0), root)?))
    }

    /// The largest (or smallest) value of the row, in every lane, NaN if any is NaN;
    /// with `bound`, a largest value for softmax ([`Kernel::softmax_bound`]).
    fn extreme(&self, (largest, bound): (bool, bool)) -> Gen<FloatValue<'ctx>> {
        let kernel = self.kernel;
        let combine = |a, b| {
            if bound {
                kernel.softmax_bound(a, b)
            } else {
                kernel.extreme(a, b, largest)
            }
        };
        let acc = kernel.accumulator("extreme")?;
        let start = if largest {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        };
        kernel.set(acc, kernel.constant(start))?;
        self.each(|_, value| kernel.set(acc, combine(kernel.get(acc)?, value)?))?;
        kernel.across_lanes(self.lanes, kernel.get(acc)?, combine)
    }

    /// The sum of `f(column, value)` over the row, each result kept in place of the
    /// value (registers), or given to `store` (which keeps it in memory).
    fn replace(
        &self,
        f: impl Fn(IntValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>>,
        store: &dyn Fn(IntValue<'ctx>, FloatValue<'ctx>) -> Gen<()>,
    ) -> Gen<FloatValue<'ctx>> {
        let kernel = self.kernel;
        self.sum(|column, value| {
            let result = f(column, value)?;
            match self.kept {
                Some((values, _)) => {
                    // `column` is `lane + count * chunk` with `chunk` a constant, which
                    // this folds back to.
                    let chunk = kernel.div(
                        kernel.sub(column, self.lanes.lane)?,
                        kernel.i64(self.lanes.count),
                    )?;
                    kernel.store_local(values, chunk, result)?
                }
                None => store(column, result)?,
            }
            Ok(result)
        })
    }

    /// `body(column, value)` over what [`Self::replace`] kept: the registers, or what
    /// `stored` reads back.
    fn each_replaced(
        &self,
        stored: &dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
        mut body: impl FnMut(IntValue<'ctx>, FloatValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        match self.kept {
            Some(_) => self.each(body),
            None => self.kernel.lane_range(self.lanes, self.width, |column| {
                body(column, stored(column)?)
            }),
        }
    }
}
