//! Order kernels along one line of values (a row's columns, or one column of an
//! element's rows), one thread a line: positions of extremes, sorts, top `k`, running
//! extremes, `k`-th values, and their gradients. Row and segmented kernels give each
//! line's positions, values and places; the work along it is written once, here.

use super::*;

/// One line of an order kernel: its positions, how to read them, where results go.
pub(super) struct Line<'a, 'ctx> {
    /// The line's positions (results count them from the first).
    pub range: (IntValue<'ctx>, IntValue<'ctx>),
    /// `x` at a position (its prologue computed).
    pub load: Values<'a, 'ctx>,
    /// The values that order the line, for a gradient (the differentiated op's input).
    pub keys: Option<Values<'a, 'ctx>>,
    /// Where a position's result goes in an output as long as the line.
    pub at: &'a dyn Fn(IntValue<'ctx>) -> Gen<IntValue<'ctx>>,
    /// Where the line's `j`-th kept value goes in an output of [`Order::kept`] values a
    /// line (and, for a gradient, where `x` holds it).
    pub kept_at: &'a dyn Fn(IntValue<'ctx>) -> Gen<IntValue<'ctx>>,
    /// `x` at the line's `j`-th kept value (a gradient's `x` holds [`Order::kept`]
    /// values a line).
    pub kept_load: Values<'a, 'ctx>,
}

/// Runs `order` along `line`, writing `out`.
pub(super) fn order_line<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    order: Order,
    out: PointerValue<'ctx>,
    line: &Line<'_, 'ctx>,
) -> Gen<()> {
    let (start, end) = line.range;
    let load = line.load;
    let key = line.keys.unwrap_or(load);
    let from_start = |position| kernel.sub(position, start);
    match order {
        Order::Position { largest } => {
            let position = position_of_extreme(kernel, largest, line.range, load)?;
            kernel.store_i64(out, (line.kept_at)(kernel.i64(0))?, position)
        }
        Order::Sort {
            descending,
            positions,
        } => kernel.for_range(start, end, |position| {
            let rank = rank(kernel, descending, line.range, position, key)?;
            let to = (line.at)(kernel.add(start, rank)?)?;
            match positions {
                true => kernel.store_i64(out, to, from_start(position)?),
                false => kernel.store_float(out, to, load(position)?),
            }
        }),
        Order::SortGrad { descending } => kernel.for_range(start, end, |position| {
            let rank = rank(kernel, descending, line.range, position, key)?;
            let gradient = load(kernel.add(start, rank)?)?;
            kernel.store_float(out, (line.at)(position)?, gradient)
        }),
        Order::TopK {
            k,
            largest,
            positions,
        } => first_in_order(kernel, (largest, k), line.range, key, |j, position| {
            let to = (line.kept_at)(j)?;
            match positions {
                true => kernel.store_i64(out, to, from_start(position)?),
                false => kernel.store_float(out, to, load(position)?),
            }
        }),
        Order::TopKGrad { k, largest } => {
            // Zeros, then each of the `k` values' gradient (`x` holds `k` a line) where
            // it came from.
            let zero = kernel.constant(0.0);
            kernel.for_range(start, end, |position| {
                kernel.store_float(out, (line.at)(position)?, zero)
            })?;
            first_in_order(kernel, (largest, k), line.range, key, |j, position| {
                kernel.store_float(out, (line.at)(position)?, (line.kept_load)(j)?)
            })
        }
        Order::Running { largest, positions } => running(
            kernel,
            largest,
            line.range,
            load,
            |position, value, seen| {
                let to = (line.at)(position)?;
                match positions {
                    true => kernel.store_i64(out, to, from_start(seen)?),
                    false => kernel.store_float(out, to, value),
                }
            },
        ),
        Order::RunningGrad { largest } => {
            running_gradient(kernel, (largest, out), line.range, (key, load), line.at)
        }
        Order::Kth { k, positions } => {
            let position = picked(kernel, Pick::Kth { k }, line.range, load)?;
            let to = (line.kept_at)(kernel.i64(0))?;
            match positions {
                true => kernel.store_i64(out, to, position),
                false => kernel.store_float(out, to, load(kernel.add(start, position)?)?),
            }
        }
        Order::PickGrad { pick } => {
            let picked = picked(kernel, pick, line.range, key)?;
            // `x` holds one value a line: the picked value's gradient.
            let gradient = (line.kept_load)(kernel.i64(0))?;
            let zero = kernel.constant(0.0);
            kernel.for_range(start, end, |position| {
                let hit = kernel.equal(from_start(position)?, picked)?;
                let value = kernel.select(hit, gradient, zero)?;
                kernel.store_float(out, (line.at)(position)?, value)
            })
        }
    }
}

/// The position, counted from `start`, of the largest value (the smallest: not
/// `largest`) among positions `start..end`: its first, or the first NaN, as torch's
/// argmax (0 for an empty range). A segment's rows and a row's columns run this way.
fn position_of_extreme<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    largest: bool,
    (start, end): (IntValue<'ctx>, IntValue<'ctx>),
    load: &dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<IntValue<'ctx>> {
    let best = kernel.accumulator("best")?;
    let at = kernel.index_variable("at")?;
    // Every value but a NaN or the bound itself is beyond the bound; a range of bounds
    // gives its first position.
    let bound = if largest {
        f64::NEG_INFINITY
    } else {
        f64::INFINITY
    };
    kernel.set(best, kernel.constant(bound))?;
    kernel.set_index(at, start)?;
    let beyond = if largest {
        FloatPredicate::OGT
    } else {
        FloatPredicate::OLT
    };
    kernel.for_range(start, end, |position| {
        let x = load(position)?;
        let current = kernel.get(best)?;
        // A NaN wins over any number; nothing wins over a NaN.
        let first_nan = kernel.and(
            kernel.float_compare(FloatPredicate::UNO, x, x)?,
            kernel.float_compare(FloatPredicate::ORD, current, current)?,
        )?;
        let wins = kernel.or(kernel.float_compare(beyond, x, current)?, first_nan)?;
        kernel.set(best, kernel.select(wins, x, current)?)?;
        kernel.set_index(
            at,
            kernel.select_index(wins, position, kernel.get_index(at)?)?,
        )
    })?;
    kernel.sub(kernel.get_index(at)?, start)
}

/// The value at each position of a range.
pub(super) type Values<'a, 'ctx> = &'a dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>;

/// Walks positions `start..end` keeping the running largest value (the smallest: not
/// `largest`) as torch's `cummax`: a value equal to it takes its place, a NaN always
/// does (and after a NaN only NaNs); `each(position, running value, where it was
/// seen)` at every position.
fn running<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    largest: bool,
    (start, end): (IntValue<'ctx>, IntValue<'ctx>),
    load: &dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    each: impl Fn(IntValue<'ctx>, FloatValue<'ctx>, IntValue<'ctx>) -> Gen<()>,
) -> Gen<()> {
    let best = kernel.accumulator("running")?;
    let seen = kernel.index_variable("seen")?;
    let bound = if largest {
        f64::NEG_INFINITY
    } else {
        f64::INFINITY
    };
    kernel.set(best, kernel.constant(bound))?;
    kernel.set_index(seen, start)?;
    let not_behind = if largest {
        FloatPredicate::OGE
    } else {
        FloatPredicate::OLE
    };
    kernel.for_range(start, end, |position| {
        let x = load(position)?;
        let current = kernel.get(best)?;
        let takes = kernel.or(
            kernel.float_compare(FloatPredicate::UNO, x, x)?,
            kernel.and(
                kernel.float_compare(FloatPredicate::ORD, current, current)?,
                kernel.float_compare(not_behind, x, current)?,
            )?,
        )?;
        kernel.set(best, kernel.select(takes, x, current)?)?;
        kernel.set_index(
            seen,
            kernel.select_index(takes, position, kernel.get_index(seen)?)?,
        )?;
        each(position, kernel.get(best)?, kernel.get_index(seen)?)
    })
}

/// `x`'s gradient of a running extreme over positions `start..end` of `out` (`at` a
/// position's place in it): zeros, then each position's gradient (`gradient`) added
/// where its running value was seen among `keys`.
fn running_gradient<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (largest, out): (bool, PointerValue<'ctx>),
    (start, end): (IntValue<'ctx>, IntValue<'ctx>),
    (keys, gradient): (Values<'_, 'ctx>, Values<'_, 'ctx>),
    at: &dyn Fn(IntValue<'ctx>) -> Gen<IntValue<'ctx>>,
) -> Gen<()> {
    kernel.for_range(start, end, |position| {
        kernel.store_float(out, at(position)?, kernel.constant(0.0))
    })?;
    running(kernel, largest, (start, end), keys, |position, _, seen| {
        let place = at(seen)?;
        let sum = kernel.fadd(kernel.load_float(out, place)?, gradient(position)?)?;
        kernel.store_float(out, place, sum)
    })
}

/// The position, counted from `start`, of the value `pick` chooses among positions
/// `start..end`.
fn picked<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    pick: Pick,
    (start, end): (IntValue<'ctx>, IntValue<'ctx>),
    load: &dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<IntValue<'ctx>> {
    let k = match pick {
        Pick::Extreme { largest } => {
            return position_of_extreme(kernel, largest, (start, end), load)
        }
        Pick::Kth { k } => k,
    };
    // The last of the first `k` positions of a stable ascending sort.
    let at = kernel.index_variable("kth")?;
    kernel.set_index(at, start)?;
    first_in_order(kernel, (false, k), (start, end), load, |_, position| {
        kernel.set_index(at, position)
    })?;
    kernel.sub(kernel.get_index(at)?, start)
}

/// Where position `row`'s value goes in a stable sort of positions `start..end` (the
/// smallest first, or the largest: `descending`), counted from `start`: the positions
/// that [`precedes`] it. A loop over the range a position.
fn rank<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    descending: bool,
    (start, end): (IntValue<'ctx>, IntValue<'ctx>),
    row: IntValue<'ctx>,
    load: &dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<IntValue<'ctx>> {
    let own = (row, load(row)?);
    let count = kernel.index_variable("rank")?;
    kernel.set_index(count, kernel.i64(0))?;
    kernel.for_range(start, end, |other| {
        let counts = precedes(kernel, descending, (other, load(other)?), own)?;
        let next = kernel.add(kernel.get_index(count)?, kernel.i64(1))?;
        kernel.set_index(
            count,
            kernel.select_index(counts, next, kernel.get_index(count)?)?,
        )
    })?;
    kernel.get_index(count)
}

/// Whether the value at position `a` comes before the one at `b` in a stable sort (the
/// smallest first, or the largest: `descending`): a smaller (larger) value, or an
/// equal one at an earlier position; NaN after every number, before when descending;
/// NaNs are equal, and so are -0 and 0.
fn precedes<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    descending: bool,
    (a, a_value): (IntValue<'ctx>, FloatValue<'ctx>),
    (b, b_value): (IntValue<'ctx>, FloatValue<'ctx>),
) -> Gen<IntValue<'ctx>> {
    let a_nan = kernel.float_compare(FloatPredicate::UNO, a_value, a_value)?;
    let b_nan = kernel.float_compare(FloatPredicate::UNO, b_value, b_value)?;
    let (beyond, nan_first) = match descending {
        true => (FloatPredicate::OGT, kernel.and(a_nan, kernel.not(b_nan)?)?),
        false => (FloatPredicate::OLT, kernel.and(kernel.not(a_nan)?, b_nan)?),
    };
    let before = kernel.or(kernel.float_compare(beyond, a_value, b_value)?, nan_first)?;
    let equal = kernel.or(
        kernel.float_compare(FloatPredicate::OEQ, a_value, b_value)?,
        kernel.and(a_nan, b_nan)?,
    )?;
    kernel.or(before, kernel.and(equal, kernel.less(a, b)?)?)
}

/// The first `k` positions of a stable sort of positions `start..end` (the smallest
/// first, or the largest: `descending`), in order: `each(j, position)` for the `j`-th,
/// fewer for a shorter range. `k` passes over the range, each taking the first
/// position that the previous one [`precedes`] (`O(k L)`, where ranks are `O(L^2)`).
fn first_in_order<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (descending, k): (bool, i64),
    (start, end): (IntValue<'ctx>, IntValue<'ctx>),
    load: &dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    each: impl Fn(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>,
) -> Gen<()> {
    let previous = kernel.index_variable("previous")?;
    let best = kernel.index_variable("best")?;
    let [last_value, best_value] = kernel.accumulators(["last_value", "best_value"])?;
    let none = kernel.i64(-1);
    kernel.set_index(previous, none)?;
    // Read only once their position is set; defined before that all the same.
    kernel.set(last_value, kernel.constant(0.0))?;
    kernel.for_range(kernel.i64(0), kernel.i64(k), |j| {
        kernel.set_index(best, none)?;
        kernel.set(best_value, kernel.constant(0.0))?;
        kernel.for_range(start, end, |position| {
            let value = load(position)?;
            let here = (position, value);
            // After the previous pick, and before the best so far.
            let last = kernel.get_index(previous)?;
            let after = kernel.or(
                kernel.equal(last, none)?,
                precedes(kernel, descending, (last, kernel.get(last_value)?), here)?,
            )?;
            let current = kernel.get_index(best)?;
            let better = kernel.or(
                kernel.equal(current, none)?,
                precedes(kernel, descending, here, (current, kernel.get(best_value)?))?,
            )?;
            let takes = kernel.and(after, better)?;
            kernel.set(
                best_value,
                kernel.select(takes, value, kernel.get(best_value)?)?,
            )?;
            kernel.set_index(best, kernel.select_index(takes, position, current)?)
        })?;
        let found = kernel.get_index(best)?;
        kernel.if_else(
            kernel.less(none, found)?,
            || {
                kernel.set_index(previous, found)?;
                kernel.set(last_value, kernel.get(best_value)?)?;
                each(j, found)
            },
            || Ok(()),
        )
    })
}
