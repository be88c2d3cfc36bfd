//! Segmented kernels: reductions, softmax and scans (cumulative sums and products) over
//! each element's rows (the ragged dim), column by column. On the host an element is
//! one thread's (but for the order kernels, its columns side by side, a pass down the
//! rows at a time). On a GPU:
//!
//! - elements of at least [`BLOCK_SEGMENT_WIDTH`] columns are a block each, a thread a
//!   column;
//! - narrower ones go to blocks in groups of as many as a block has warps: an element of
//!   fewer than [`LONG_SEGMENT_ROWS`] rows is one warp's (lanes over its columns, its rows
//!   in order), a longer one the whole block's (the warps take every `warps`-th row, then
//!   combine their values column by column through shared memory, in warp order); a
//!   scan's elements are a warp's however long (each lane down its columns' rows).
//!
//! Columns are independent: lanes never combine values across columns.

use super::*;

/// The most columns a host segment kernel folds at once ([`Segments::by_rows`]): 1 KiB
/// of f32 a local array.
const HOST_SEGMENT_COLUMNS: i64 = 256;

/// The fewest rows of an element that a whole block reduces (fewer: a warp).
pub(crate) const LONG_SEGMENT_ROWS: i64 = 64;

/// The most warps of a block (the shared memory of a block's long elements is sized for
/// them: a launch of larger blocks is refused by the simulated GPU's bounds).
const BLOCK_WARPS: i64 = crate::GPU_BLOCK_THREADS as i64 / WARP_LANES;

/// Floats of shared memory a block of a segmented kernel of `width` columns uses: a value
/// a warp and column, for its long elements (none for a block a column).
pub(crate) fn segment_shared_floats(width: i64) -> i64 {
    if width >= BLOCK_SEGMENT_WIDTH {
        0
    } else {
        BLOCK_WARPS * width
    }
}

pub(super) fn segment<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    kind: SegmentKind,
    x: &Fusion,
    width: i64,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let segments = Segments {
        kernel,
        kind,
        x,
        inputs: prologue_args(kernel, &x.inputs)?,
        out: kernel.param(Role::Out)?,
        offsets: kernel.param(Role::Offsets)?,
        width,
        keys: kernel.optional(Role::Keys)?,
    };
    if width >= BLOCK_SEGMENT_WIDTH {
        let threads = i64::from(crate::GPU_BLOCK_THREADS);
        return kernel.parallel_rows_of(threads, start, end, |element, lanes| {
            segments.alone(element, lanes)
        });
    }
    if !kernel.on_gpu() {
        return kernel.parallel_rows(start, end, |element, lanes| segments.alone(element, lanes));
    }
    // The launch covers the whole range (`0..B`).
    segments.grouped(end)
}

/// The shift of a column's exponentials from its largest value: that value, or with
/// `finite` (logsumexp) 0 where it is infinite.
fn shift_of<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    largest: FloatValue<'ctx>,
    finite: bool,
) -> Gen<FloatValue<'ctx>> {
    if finite {
        finite_shift(kernel, largest)
    } else {
        Ok(largest)
    }
}

/// Whether a scan multiplies (else adds), and whether it runs from the last row up.
fn scan_of(kind: SegmentKind) -> (bool, bool) {
    (
        matches!(kind, SegmentKind::CumProd | SegmentKind::ReverseCumProd),
        matches!(
            kind,
            SegmentKind::ReverseCumSum | SegmentKind::ReverseCumProd
        ),
    )
}

/// A running sum (or `product`) over positions `start..end` (from the last back for
/// `reverse`): each position's `load`, the running value given to `store` there. A
/// segment's rows and a row's columns scan this way.
pub(super) fn scan<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (product, reverse): (bool, bool),
    (start, end): (IntValue<'ctx>, IntValue<'ctx>),
    load: &dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    store: impl Fn(IntValue<'ctx>, FloatValue<'ctx>) -> Gen<()>,
) -> Gen<()> {
    let acc = kernel.accumulator("scan")?;
    kernel.set(acc, kernel.constant(scan_start(product)))?;
    kernel.for_range(start, end, |step| {
        let position = scan_position(kernel, (start, end), step, reverse)?;
        let next = scan_step(kernel, product, kernel.get(acc)?, load(position)?)?;
        kernel.set(acc, next)?;
        store(position, next)
    })
}

/// Where a scan starts: 1 for a product, 0 for a sum.
fn scan_start(product: bool) -> f64 {
    if product {
        1.0
    } else {
        0.0
    }
}

/// The position of a scan's `step`-th value over `start..end` (from the last back for
/// `reverse`).
fn scan_position<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (start, end): (IntValue<'ctx>, IntValue<'ctx>),
    step: IntValue<'ctx>,
    reverse: bool,
) -> Gen<IntValue<'ctx>> {
    match reverse {
        true => kernel.sub(kernel.add(start, end)?, kernel.add(step, kernel.i64(1))?),
        false => Ok(step),
    }
}

/// A scan's running value after `x`: `kept * x` for a product, `kept + x` for a sum.
fn scan_step<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    product: bool,
    kept: FloatValue<'ctx>,
    x: FloatValue<'ctx>,
) -> Gen<FloatValue<'ctx>> {
    match product {
        true => kernel.fmul(kept, x),
        false => kernel.fadd(kept, x),
    }
}

/// A segmented kernel's step and buffers.
struct Segments<'a, 'ctx, 'm> {
    kernel: &'a Kernel<'ctx, 'm>,
    kind: SegmentKind,
    x: &'a Fusion,
    inputs: Vec<PointerValue<'ctx>>,
    out: PointerValue<'ctx>,
    offsets: PointerValue<'ctx>,
    width: i64,
    /// The values that order the rows, when not `x` (a sort's gradient).
    keys: Option<PointerValue<'ctx>>,
}

/// How a value folds into a running one, and where the fold starts.
#[derive(Clone, Copy)]
struct Fold<'a, 'ctx> {
    initial: f64,
    step: &'a dyn Fn(FloatValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>>,
}

impl<'ctx> Segments<'_, 'ctx, '_> {
    /// The element's first row and the row after its last.
    fn rows(&self, element: IntValue<'ctx>) -> Gen<(IntValue<'ctx>, IntValue<'ctx>)> {
        let kernel = self.kernel;
        let next = kernel.add(element, kernel.i64(1))?;
        Ok((
            kernel.load_i64(self.offsets, element)?,
            kernel.load_i64(self.offsets, next)?,
        ))
    }

    /// The input at `(row, column)` (its prologue computed).
    fn load(&self, row: IntValue<'ctx>, column: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        prologue(self.kernel, self.x, &self.inputs, row, column)
    }

    /// Where `(row, column)` of a `width`-wide buffer is.
    fn at(&self, row: IntValue<'ctx>, column: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        let kernel = self.kernel;
        kernel.add(kernel.mul(row, kernel.i64(self.width))?, column)
    }

    /// The largest value (`softmax`'s shift, `max`) or the smallest.
    fn extreme(
        &self,
        largest: bool,
    ) -> impl Fn(FloatValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> + '_ {
        move |a, b| self.kernel.extreme(a, b, largest)
    }

    /// A sum.
    fn sum(&self) -> impl Fn(FloatValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> + '_ {
        move |a, b| self.kernel.fadd(a, b)
    }

    /// Element `element` by one task of `lanes` (each lane its columns, the rows in
    /// order).
    fn alone(&self, element: IntValue<'ctx>, lanes: Lanes<'ctx>) -> Gen<()> {
        let (kernel, kind) = (self.kernel, self.kind);
        if !kernel.on_gpu() && !matches!(kind, SegmentKind::Order(_)) {
            return self.by_rows(element);
        }
        let (first, last) = self.rows(element)?;
        kernel.lane_range(lanes, self.width, |column| {
            // The column's values (after subtracting `shift`, their exponentials) folded.
            let fold = |fold: Fold<'_, 'ctx>, shift: Option<FloatValue<'ctx>>| {
                let acc = kernel.accumulator("segment")?;
                kernel.set(acc, kernel.constant(fold.initial))?;
                kernel.for_range(first, last, |row| {
                    let x = self.load(row, column)?;
                    let x = match shift {
                        Some(shift) => kernel.fast_exp(kernel.fsub(x, shift)?)?,
                        None => x,
                    };
                    kernel.set(acc, (fold.step)(kernel.get(acc)?, x)?)
                })?;
                kernel.get(acc)
            };
            let out_at = self.at(element, column)?;
            let sum = self.sum();
            // The column's largest value (0 where infinite, for logsumexp: `finite`) and
            // the sum of the exponentials of the values less it.
            let exp_sum = |finite: bool| -> Gen<(FloatValue<'ctx>, FloatValue<'ctx>)> {
                let largest = self.extreme(true);
                let shift = fold(
                    Fold {
                        initial: f64::NEG_INFINITY,
                        step: &largest,
                    },
                    None,
                )?;
                let shift = shift_of(kernel, shift, finite)?;
                let total = fold(
                    Fold {
                        initial: 0.0,
                        step: &sum,
                    },
                    Some(shift),
                )?;
                Ok((shift, total))
            };
            match kind {
                SegmentKind::Sum | SegmentKind::Mean => {
                    let total = fold(
                        Fold {
                            initial: 0.0,
                            step: &sum,
                        },
                        None,
                    )?;
                    kernel.store_float(self.out, out_at, self.finished(total, (first, last))?)
                }
                SegmentKind::LogSumExp => {
                    let (shift, total) = exp_sum(true)?;
                    let value = kernel.fadd(kernel.math("log", &[total])?, shift)?;
                    kernel.store_float(self.out, out_at, value)
                }
                SegmentKind::Max | SegmentKind::Min => {
                    let (initial, extreme) = self.bound();
                    let value = fold(
                        Fold {
                            initial,
                            step: &extreme,
                        },
                        None,
                    )?;
                    kernel.store_float(self.out, out_at, value)
                }
                SegmentKind::CumSum
                | SegmentKind::CumProd
                | SegmentKind::ReverseCumSum
                | SegmentKind::ReverseCumProd => scan(
                    kernel,
                    scan_of(kind),
                    (first, last),
                    &|row| self.load(row, column),
                    |row, value| kernel.store_float(self.out, self.at(row, column)?, value),
                ),
                SegmentKind::Softmax | SegmentKind::LogSoftmax => {
                    let (shift, total) = exp_sum(false)?;
                    kernel.for_range(first, last, |row| {
                        self.softmax_at(row, column, (shift, total))
                    })
                }
                SegmentKind::Order(order) => {
                    let load = |row| self.load(row, column);
                    let key = |row| self.key(row, column);
                    let at = |row| self.at(row, column);
                    // A line's kept values are rows `element * kept ..` of a narrow
                    // output (or of a gradient's `x`).
                    let kept = order.kept().unwrap_or(1);
                    let kept_row = |j| kernel.add(kernel.mul(element, kernel.i64(kept))?, j);
                    let kept_at = |j| self.at(kept_row(j)?, column);
                    let kept_load = |j| self.load(kept_row(j)?, column);
                    let line = Line {
                        range: (first, last),
                        load: &load,
                        keys: self.keys.map(|_| &key as Values<'_, 'ctx>),
                        at: &at,
                        kept_at: &kept_at,
                        kept_load: &kept_load,
                    };
                    order_line(kernel, order, self.out, &line)
                }
            }
        })
    }

    /// Element `element` on the host, a reduction, softmax or scan: in blocks of at most
    /// [`HOST_SEGMENT_COLUMNS`] columns, each fold a pass down the rows with the block's
    /// columns side by side in a local array (LLVM vectorizes along the row), every
    /// column folded in row order as [`Segments::alone`] folds it (the same values).
    /// Column by column, a fold read the rows a column apart: a segment's `max` over 16
    /// columns ran as gathers down the rows, a sum one value at a time.
    fn by_rows(&self, element: IntValue<'ctx>) -> Gen<()> {
        let kernel = self.kernel;
        let rows = self.rows(element)?;
        let block = self.width.clamp(1, HOST_SEGMENT_COLUMNS);
        let locals = (
            kernel.accumulator_array("folded", block)?,
            kernel.accumulator_array("shifts", block)?,
        );
        // Whole blocks, then the rest: each a constant count of columns, so that a
        // block's loop over them is unrolled or vectorized whole (and a narrow block's
        // sums kept in registers, not in the local array).
        let whole = self.width / block;
        kernel.for_range(kernel.i64(0), kernel.i64(whole), |index| {
            let base = kernel.mul(index, kernel.i64(block))?;
            self.block_by_rows(element, rows, locals, (base, block))
        })?;
        match self.width % block {
            0 => Ok(()),
            rest => self.block_by_rows(element, rows, locals, (kernel.i64(whole * block), rest)),
        }
    }

    /// [`Segments::by_rows`] of the `count` columns from `base`, with the local arrays
    /// of the folded values and the shifts.
    fn block_by_rows(
        &self,
        element: IntValue<'ctx>,
        rows: (IntValue<'ctx>, IntValue<'ctx>),
        (folded, shifts): (Local<'ctx>, Local<'ctx>),
        (base, count): (IntValue<'ctx>, i64),
    ) -> Gen<()> {
        let kernel = self.kernel;
        let (first, last) = rows;
        let columns = |body: &dyn Fn(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>| {
            kernel.for_range(kernel.i64(0), kernel.i64(count), |slot| {
                body(kernel.add(base, slot)?, slot)
            })
        };
        // Every column's values (less its shift, their exponentials) folded down the
        // rows into `folded`.
        let fold = |fold: Fold<'_, 'ctx>, shifted: bool| -> Gen<()> {
            columns(&|_, slot| kernel.store_local(folded, slot, kernel.constant(fold.initial)))?;
            kernel.for_rows_of_width(count, first, last, |row| {
                columns(&|column, slot| {
                    let x = self.load(row, column)?;
                    let x = match shifted {
                        true => {
                            kernel.fast_exp(kernel.fsub(x, kernel.load_local(shifts, slot)?)?)?
                        }
                        false => x,
                    };
                    let next = (fold.step)(kernel.load_local(folded, slot)?, x)?;
                    kernel.store_local(folded, slot, next)
                })
            })
        };
        let sum = self.sum();
        let sums = Fold {
            initial: 0.0,
            step: &sum,
        };
        // The largest values as the shifts (finite ones, 0 for an infinite one, with
        // `finite`), then the sums of the exponentials less them.
        let exp_sums = |finite: bool| -> Gen<()> {
            let largest = self.extreme(true);
            fold(
                Fold {
                    initial: f64::NEG_INFINITY,
                    step: &largest,
                },
                false,
            )?;
            columns(&|_, slot| {
                let shift = shift_of(kernel, kernel.load_local(folded, slot)?, finite)?;
                kernel.store_local(shifts, slot, shift)
            })?;
            fold(sums, true)
        };
        let store = |value: &dyn Fn(FloatValue<'ctx>, IntValue<'ctx>) -> Gen<FloatValue<'ctx>>| {
            columns(&|column, slot| {
                let result = value(kernel.load_local(folded, slot)?, slot)?;
                kernel.store_float(self.out, self.at(element, column)?, result)
            })
        };
        match self.kind {
            SegmentKind::Sum | SegmentKind::Mean => {
                fold(sums, false)?;
                store(&|total, _| self.finished(total, (first, last)))
            }
            SegmentKind::Max | SegmentKind::Min => {
                let (initial, extreme) = self.bound();
                fold(
                    Fold {
                        initial,
                        step: &extreme,
                    },
                    false,
                )?;
                store(&|value, _| Ok(value))
            }
            SegmentKind::LogSumExp => {
                exp_sums(true)?;
                store(&|total, slot| {
                    kernel.fadd(
                        kernel.math("log", &[total])?,
                        kernel.load_local(shifts, slot)?,
                    )
                })
            }
            SegmentKind::Softmax | SegmentKind::LogSoftmax => {
                exp_sums(false)?;
                kernel.for_rows_of_width(count, first, last, |row| {
                    columns(&|column, slot| {
                        let statistics = (
                            kernel.load_local(shifts, slot)?,
                            kernel.load_local(folded, slot)?,
                        );
                        self.softmax_at(row, column, statistics)
                    })
                })
            }
            SegmentKind::CumSum
            | SegmentKind::CumProd
            | SegmentKind::ReverseCumSum
            | SegmentKind::ReverseCumProd => {
                // Each column's running value down the rows (up them, reversed), every
                // row's stored as the scan passes it.
                let (product, reverse) = scan_of(self.kind);
                let initial = kernel.constant(scan_start(product));
                columns(&|_, slot| kernel.store_local(folded, slot, initial))?;
                kernel.for_rows_of_width(count, first, last, |step| {
                    let row = scan_position(kernel, (first, last), step, reverse)?;
                    columns(&|column, slot| {
                        let (kept, x) = (kernel.load_local(folded, slot)?, self.load(row, column)?);
                        let next = scan_step(kernel, product, kept, x)?;
                        kernel.store_local(folded, slot, next)?;
                        kernel.store_float(self.out, self.at(row, column)?, next)
                    })
                })
            }
            other => Err(crate::CodegenError::new(format!(
                "segment kind {other:?} runs down each column's rows, not by rows"
            ))),
        }
    }

    /// The value that orders row `row` in column `column`: the step's keys, or `x`.
    fn key(&self, row: IntValue<'ctx>, column: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        match self.keys {
            Some(keys) => self.kernel.load_float(keys, self.at(row, column)?),
            None => self.load(row, column),
        }
    }

    /// A reduction's result from its fold over rows `first..last`: the mean divides
    /// the sum by their count (NaN for none).
    fn finished(
        &self,
        folded: FloatValue<'ctx>,
        (first, last): (IntValue<'ctx>, IntValue<'ctx>),
    ) -> Gen<FloatValue<'ctx>> {
        let kernel = self.kernel;
        if self.kind != SegmentKind::Mean {
            return Ok(folded);
        }
        kernel.fdiv(folded, kernel.to_float(kernel.sub(last, first)?)?)
    }

    /// Where `max` and `min` start, and how they fold.
    fn bound(
        &self,
    ) -> (
        f64,
        impl Fn(FloatValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> + '_,
    ) {
        let largest = self.kind == SegmentKind::Max;
        let initial = if largest {
            f64::NEG_INFINITY
        } else {
            f64::INFINITY
        };
        (initial, self.extreme(largest))
    }

    /// Softmax (or log-softmax) at `(row, column)` from the column's largest value and
    /// sum of exponentials.
    fn softmax_at(
        &self,
        row: IntValue<'ctx>,
        column: IntValue<'ctx>,
        (shift, total): (FloatValue<'ctx>, FloatValue<'ctx>),
    ) -> Gen<()> {
        let kernel = self.kernel;
        let shifted = kernel.fsub(self.load(row, column)?, shift)?;
        let value = if self.kind == SegmentKind::Softmax {
            kernel.fdiv(kernel.fast_exp(shifted)?, total)?
        } else {
            kernel.fsub(shifted, kernel.math("log", &[total])?)?
        };
        kernel.store_float(self.out, self.at(row, column)?, value)
    }

    /// The GPU kernel of narrow elements: a block per group of as many elements as it
    /// has warps (the grid-stride loop over groups), each short element its warp's,
    /// then each long one the whole block's.
    fn grouped(&self, end: IntValue<'ctx>) -> Gen<()> {
        let kernel = self.kernel;
        let place = kernel.block_place()?;
        let (warps, warp, lanes) = (place.warps, place.warp, place.lanes);
        let last_element = kernel.sub(end, kernel.i64(1))?;
        // Element `first + index` of the group, if there is one and it is long (or
        // short): every thread of the block computes the same for the same index.
        let of_length = |first, index, long: bool| -> Gen<(IntValue<'ctx>, IntValue<'ctx>)> {
            let element = kernel.add(first, index)?;
            let exists = kernel.less(element, end)?;
            let element = kernel.min(element, last_element)?;
            let (rows_start, rows_end) = self.rows(element)?;
            let rows = kernel.sub(rows_end, rows_start)?;
            // A scan (a search for a position, a sort) runs down the rows in order: its
            // elements are a warp's however long.
            let is_long = if self.kind.down_the_rows() {
                kernel.less(rows, kernel.i64(0))?
            } else {
                kernel.less(kernel.i64(LONG_SEGMENT_ROWS - 1), rows)?
            };
            let wanted = if long { is_long } else { kernel.not(is_long)? };
            Ok((element, kernel.and(exists, wanted)?))
        };
        kernel.warp_groups(&place, end, |first| {
            let (own, short) = of_length(first, warp, false)?;
            kernel.if_else(short, || self.alone(own, lanes), || Ok(()))?;
            kernel.for_range(kernel.i64(0), warps, |index| {
                let (element, long) = of_length(first, index, true)?;
                kernel.if_else(
                    long,
                    || self.together(element, (warp, warps), lanes),
                    || Ok(()),
                )
            })
        })
    }

    /// Long element `element` by the whole block: warp `warp` of `warps` folds rows
    /// `first + warp`, `first + warp + warps`, ..., each lane its columns; the warps'
    /// values are combined column by column in warp order through shared memory, so
    /// that every warp has each column's result; warp 0 writes reductions, every warp
    /// its rows of a softmax.
    fn together(
        &self,
        element: IntValue<'ctx>,
        (warp, warps): (IntValue<'ctx>, IntValue<'ctx>),
        lanes: Lanes<'ctx>,
    ) -> Gen<()> {
        let kernel = self.kernel;
        let (first, last) = self.rows(element)?;
        let shared = kernel.shared_floats(segment_shared_floats(self.width))?;
        let my_rows = |body: &dyn Fn(IntValue<'ctx>) -> Gen<()>| {
            kernel.for_range_by(kernel.add(first, warp)?, last, warps, body)
        };
        let slots = (self.width + WARP_LANES - 1) / WARP_LANES;
        let partial = kernel.accumulator_array("partial", slots)?;
        // Every column's fold over the element's rows: this warp's rows into `partial`,
        // then the warps' partial values combined (the result in `partial`).
        let fold_columns = |fold: Fold<'_, 'ctx>, shifts: Option<Local<'ctx>>| -> Gen<()> {
            let value = |row: IntValue<'ctx>, column: IntValue<'ctx>, slot: IntValue<'ctx>| {
                let x = self.load(row, column)?;
                match shifts {
                    None => Ok(x),
                    Some(shifts) => {
                        kernel.fast_exp(kernel.fsub(x, kernel.load_local(shifts, slot)?)?)
                    }
                }
            };
            kernel.lane_columns(lanes, self.width, |_, slot| {
                kernel.store_local(partial, slot, kernel.constant(fold.initial))
            })?;
            my_rows(&|row| {
                kernel.lane_columns(lanes, self.width, |column, slot| {
                    let kept = kernel.load_local(partial, slot)?;
                    let next = (fold.step)(kept, value(row, column, slot)?)?;
                    kernel.store_local(partial, slot, next)
                })
            })?;
            // The last readers of the shared values are done before they change.
            kernel.barrier()?;
            let base = kernel.mul(warp, kernel.i64(self.width))?;
            kernel.lane_columns(lanes, self.width, |column, slot| {
                let at = kernel.add(base, column)?;
                kernel.store_shared(shared, at, kernel.load_local(partial, slot)?)
            })?;
            kernel.barrier()?;
            kernel.lane_columns(lanes, self.width, |column, slot| {
                let combined = kernel.accumulator("combined")?;
                kernel.set(combined, kernel.constant(fold.initial))?;
                kernel.for_range(kernel.i64(0), warps, |other| {
                    let at = kernel.add(kernel.mul(other, kernel.i64(self.width))?, column)?;
                    let value = kernel.load_shared(shared, at)?;
                    kernel.set(combined, (fold.step)(kernel.get(combined)?, value)?)
                })?;
                kernel.store_local(partial, slot, kernel.get(combined)?)
            })
        };
        let sum = self.sum();
        // Every column's largest value (0 where infinite, for logsumexp: `finite`) in
        // `shifts`, then the sum of the exponentials of its values less it in `partial`.
        let exp_sums = |finite: bool| -> Gen<Local<'ctx>> {
            let largest = self.extreme(true);
            let shifts = kernel.accumulator_array("shifts", slots)?;
            fold_columns(
                Fold {
                    initial: f64::NEG_INFINITY,
                    step: &largest,
                },
                None,
            )?;
            kernel.lane_columns(lanes, self.width, |_, slot| {
                let shift = shift_of(kernel, kernel.load_local(partial, slot)?, finite)?;
                kernel.store_local(shifts, slot, shift)
            })?;
            fold_columns(
                Fold {
                    initial: 0.0,
                    step: &sum,
                },
                Some(shifts),
            )?;
            Ok(shifts)
        };
        match self.kind {
            SegmentKind::Softmax | SegmentKind::LogSoftmax => {
                let shifts = exp_sums(false)?;
                my_rows(&|row| {
                    kernel.lane_columns(lanes, self.width, |column, slot| {
                        let shift = kernel.load_local(shifts, slot)?;
                        let total = kernel.load_local(partial, slot)?;
                        self.softmax_at(row, column, (shift, total))
                    })
                })
            }
            SegmentKind::LogSumExp => {
                let shifts = exp_sums(true)?;
                kernel.if_else(
                    kernel.equal(warp, kernel.i64(0))?,
                    || {
                        kernel.lane_columns(lanes, self.width, |column, slot| {
                            let total = kernel.load_local(partial, slot)?;
                            let shift = kernel.load_local(shifts, slot)?;
                            let value = kernel.fadd(kernel.math("log", &[total])?, shift)?;
                            kernel.store_float(self.out, self.at(element, column)?, value)
                        })
                    },
                    || Ok(()),
                )
            }
            kind => {
                if matches!(kind, SegmentKind::Max | SegmentKind::Min) {
                    let (initial, extreme) = self.bound();
                    fold_columns(
                        Fold {
                            initial,
                            step: &extreme,
                        },
                        None,
                    )?;
                } else {
                    fold_columns(
                        Fold {
                            initial: 0.0,
                            step: &sum,
                        },
                        None,
                    )?;
                }
                kernel.if_else(
                    kernel.equal(warp, kernel.i64(0))?,
                    || {
                        kernel.lane_columns(lanes, self.width, |column, slot| {
                            let value =
                                self.finished(kernel.load_local(partial, slot)?, (first, last))?;
                            kernel.store_float(self.out, self.at(element, column)?, value)
                        })
                    },
                    || Ok(()),
                )
            }
        }
    }
}
