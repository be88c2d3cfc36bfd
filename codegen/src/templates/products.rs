//! Products: the GEMM (its sum, bias and epilogue in one kernel, or only the bias and
//! epilogue after a BLAS product), row sums `a^T b`, and the jagged-pair matmul.

use super::*;

/// `out[r, j] = epilogue(sum_c x[r, c] W[j, c] + bias[j])` (`W[c, j]` when
/// `transposed`): one output value per iteration of the parallel loop, the epilogue
/// applied to the sum before it is stored (its reads of `out` are the sum itself). With
/// `product_given`, the sum is what `out[r, j]` holds (a BLAS wrote it).
pub(super) fn gemm<'ctx>(kernel: &Kernel<'ctx, '_>, step: &Gemm, product_given: bool) -> Gen<()> {
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
    let epilogue = Epilogue {
        fusion: epilogue.as_ref(),
        out: out_slot,
    };
    let epilogue_args = epilogue.args(kernel)?;
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
        let value = epilogue.finish(kernel, &epilogue_args, sum, (row, column))?;
        kernel.store_float(out, task, value)
    })
}

/// Rows a lane of [`sum_rows`] adds in order before adding their sum to its total.
const SUM_RUN_ROWS: i64 = 64;

/// `out[i, j] = sum over rows r of a[r, i] b[r, j]` (`a` absent: ones; with `times`,
/// `b[r, j] times[r, j]`), divided by the number of rows when `mean` (NaN for none);
/// with `plain` (`times`, one row of sums) also `plain[j] = sum over rows r of b[r, j]`,
/// added the same way in the same loop.
pub(super) fn sum_rows<'ctx>(kernel: &Kernel<'ctx, '_>, (m, n): (i64, i64), mean: bool) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let out = kernel.param(Role::Out)?;
    let a = kernel.optional(Role::A)?;
    let times = kernel.optional(Role::Times)?;
    let plain = kernel.optional(Role::Plain)?;
    let [b, count] = kernel.params([Role::B, Role::Count])?;
    let rows = kernel.load_i64(count, kernel.i64(0))?;
    let [total, run] = kernel.accumulators(["total", "run"])?;
    let plain_sums = match plain {
        Some(plain) => Some((plain, kernel.accumulators(["plain_total", "plain_run"])?)),
        None => None,
    };
    // An output value is a warp's on a GPU (each lane every 32nd row in order, the
    // lanes' sums added with shuffles), one thread's on the host. A lane adds its rows
    // in runs of `SUM_RUN_ROWS`, each run's sum then into its total, so that a value
    // passes through about `SUM_RUN_ROWS + rows / (lanes SUM_RUN_ROWS)` adds rather
    // than `rows / lanes` (the error of a long sum, such as a batch norm's statistics
    // over every pixel of a batch).
    kernel.parallel_rows(start, end, |task, lanes| {
        let i = kernel.div(task, kernel.i64(n))?;
        let j = kernel.rem(task, kernel.i64(n))?;
        let (lane, stride) = match lanes.count {
            1 => (kernel.i64(0), 1),
            count => (lanes.lane, count),
        };
        let span = kernel.i64(stride * SUM_RUN_ROWS);
        kernel.set(total, kernel.constant(0.0))?;
        if let Some((_, [plain_total, _])) = plain_sums {
            kernel.set(plain_total, kernel.constant(0.0))?;
        }
        kernel.for_range_by(kernel.i64(0), rows, span, |first| {
            kernel.set(run, kernel.constant(0.0))?;
            if let Some((_, [_, plain_run])) = plain_sums {
                kernel.set(plain_run, kernel.constant(0.0))?;
            }
            let (from, to) = (
                kernel.add(first, lane)?,
                kernel.min(kernel.add(first, span)?, rows)?,
            );
            kernel.for_range_by(from, to, kernel.i64(stride), |row| {
                let at = kernel.add(kernel.mul(row, kernel.i64(n))?, j)?;
                let y = kernel.load_float(b, at)?;
                if let Some((_, [_, plain_run])) = plain_sums {
                    kernel.set(
                        plain_run,
                        kernel.fadd_reassociable(kernel.get(plain_run)?, y)?,
                    )?;
                }
                let y = match times {
                    Some(times) => kernel.fmul(y, kernel.load_float(times, at)?)?,
                    None => y,
                };
                let term = match a {
                    Some(a) => {
                        let at = kernel.add(kernel.mul(row, kernel.i64(m))?, i)?;
                        kernel.fmul(kernel.load_float(a, at)?, y)?
                    }
                    None => y,
                };
                kernel.set(run, kernel.fadd_reassociable(kernel.get(run)?, term)?)
            })?;
            if let Some((_, [plain_total, plain_run])) = plain_sums {
                let sum = kernel.fadd(kernel.get(plain_total)?, kernel.get(plain_run)?)?;
                kernel.set(plain_total, sum)?;
            }
            kernel.set(total, kernel.fadd(kernel.get(total)?, kernel.get(run)?)?)
        })?;
        if let Some((plain, [plain_total, _])) = plain_sums {
            let sum =
                kernel.across_lanes(lanes, kernel.get(plain_total)?, |a, b| kernel.fadd(a, b))?;
            first_lane_stores(kernel, lanes, plain, j, sum)?;
        }
        let sum = kernel.across_lanes(lanes, kernel.get(total)?, |a, b| kernel.fadd(a, b))?;
        let value = if mean {
            kernel.fdiv(sum, kernel.to_float(rows)?)?
        } else {
            sum
        };
        first_lane_stores(kernel, lanes, out, task, value)
    })
}

/// The `p`-norm of the differences `difference(w)` over a row of `width`, as torch's
/// `cdist`: `(sum |d|^p)^(1/p)`, the root of the sum of squares for 2, the count of
/// nonzero differences for 0 (a NaN counts), the largest magnitude for infinity.
fn p_norm<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    width: i64,
    p: f64,
    difference: impl Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<FloatValue<'ctx>> {
    if p == f64::INFINITY {
        let largest = kernel.accumulator("largest")?;
        kernel.set(largest, kernel.constant(0.0))?;
        kernel.for_range(kernel.i64(0), kernel.i64(width), |w| {
            let magnitude = kernel.math("fabs", &[difference(w)?])?;
            kernel.set(
                largest,
                kernel.extreme(kernel.get(largest)?, magnitude, true)?,
            )
        })?;
        return kernel.get(largest);
    }
    let sum = row_sum(kernel, width, |w| {
        let d = difference(w)?;
        if p == 0.0 {
            let differs = kernel.float_compare(FloatPredicate::UNE, d, kernel.constant(0.0))?;
            return kernel.select(differs, kernel.constant(1.0), kernel.constant(0.0));
        }
        if p == 2.0 {
            return kernel.fmul(d, d);
        }
        let magnitude = kernel.math("fabs", &[d])?;
        match p == 1.0 {
            true => Ok(magnitude),
            false => kernel.math("pow", &[magnitude, kernel.constant(p)]),
        }
    })?;
    match p {
        0.0 | 1.0 => Ok(sum),
        2.0 => kernel.math("sqrt", &[sum]),
        _ => kernel.math("pow", &[sum, kernel.constant(1.0 / p)]),
    }
}

/// The jagged-pair matmul, a row of `M` a task: scores `out[r, c] = sum_w a[r, w]
/// b[c, w]` over the element's `N_i` columns `c`, or (`mix`) `out[r, w] = sum_c a[r, c]
/// b[c, w]` over the element's pairs of row `r`; with a `distance` norm `p`, `cdist`:
/// `out[r, c]` the `p`-norm of `a[r, :] - b[c, :]`.
pub(super) fn pair_gemm<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    width: i64,
    mix: bool,
    distance: Option<f64>,
) -> Gen<()> {
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
                let pair = |w| {
                    let x = kernel.load_float(a, kernel.add(a_row, w)?)?;
                    Ok((x, kernel.load_float(b, b_at(c, w)?)?))
                };
                let value = match distance {
                    Some(p) => p_norm(kernel, width, p, |w| {
                        let (x, y) = pair(w)?;
                        kernel.fsub(x, y)
                    })?,
                    None => row_sum(kernel, width, |w| {
                        let (x, y) = pair(w)?;
                        kernel.fmul(x, y)
                    })?,
                };
                kernel.store_float(out, kernel.add(pairs, c)?, value)
            })
        }
    })
}
