//! Padding copies: packed rows into a padded grid and back.

use super::*;

/// Padded row `p` of `B x longest`: row `p % longest` of element `p / longest`, or
/// `value` past its length.
pub(super) fn pad<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64, value: f64) -> Gen<()> {
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
pub(super) fn unpad<'ctx>(kernel: &Kernel<'ctx, '_>, width: i64) -> Gen<()> {
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
