//! The data steps: gathers, one-hot rows, random masks, length values, positions,
//! inserts and scatters of rows by id.

use super::*;

pub(super) fn gather<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64) -> Gen<()> {
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

/// `out[r, c] = 1` where `c == ids[r]` (a row of zeros for `ignore`), else 0.
pub(super) fn one_hot<'ctx>(kernel: &Kernel<'ctx, '_>, classes: i64, ignore: i64) -> Gen<()> {
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
pub(super) fn random_mask<'ctx>(kernel: &Kernel<'ctx, '_>, p: f64) -> Gen<()> {
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
pub(super) fn length_values<'ctx>(kernel: &Kernel<'ctx, '_>) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, lengths] = kernel.params([Role::Out, Role::Lengths])?;
    kernel.parallel_range(start, end, |element| {
        let value = kernel.to_float(kernel.load_i64(lengths, element)?)?;
        kernel.store_float(out, element, value)
    })
}

/// `out[r]` = row `r`'s position within its element (`r - offsets[owner of r]`), i64.
pub(super) fn positions<'ctx>(kernel: &Kernel<'ctx, '_>) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, offsets, owners] = kernel.params([Role::Out, Role::Offsets, Role::RowOwners])?;
    kernel.parallel_range(start, end, |row| {
        let element = kernel.load_i64(owners, row)?;
        let position = kernel.sub(row, kernel.load_i64(offsets, element)?)?;
        kernel.store_i64(out, row, position)
    })
}

/// `out` viewed as `[rows, size, inner]`: `x`'s row (`[count, inner]`) at positions
/// `index..index + count`, zeros elsewhere.
pub(super) fn insert<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (size, index, count): (i64, i64, i64),
    inner: i64,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x] = kernel.params([Role::Out, Role::X])?;
    let zero = kernel.constant(0.0);
    let block = count * inner;
    // A row is a warp's on a GPU (each lane its values), one thread's on the host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let source = kernel.mul(row, kernel.i64(block))?;
        let target = kernel.mul(row, kernel.i64(size * inner))?;
        kernel.lane_range(lanes, size * inner, |at| {
            let column = kernel.sub(at, kernel.i64(index * inner))?;
            let inside = kernel.and(
                kernel.less(kernel.i64(-1), column)?,
                kernel.less(column, kernel.i64(block))?,
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

/// `out[v, c] = sum of g[r, c] over the rows r with ids[r] == v, in order` (nothing for
/// `padding`), a table row a task (a warp's on a GPU, each lane its columns) over the
/// rows of its id: `rows` holds `V + 1` positions into itself (id `v`'s rows are at
/// `rows[rows[v]..rows[v + 1]]`), then the rows, in order.
pub(super) fn scatter_rows<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64, padding: i64) -> Gen<()> {
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
