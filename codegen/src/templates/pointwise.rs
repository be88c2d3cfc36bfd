//! Pointwise kernels: a fused expression over rows, or over a flat run of scalars.

use super::*;

pub(super) fn pointwise<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    width: i64,
    inputs: &[Access],
    expr: &nestor_passes::Expr,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let out = kernel.param(Role::Out)?;
    let (pointers, maps) = fused_args(kernel, inputs)?;
    // The output scalar at `to` from the inputs' scalars at `place(input)`: the
    // expression, or an i64 value moved as it is.
    let compute = |to, place: &dyn Fn(usize) -> Gen<IntValue<'ctx>>| -> Gen<()> {
        if let nestor_passes::Expr::Integers(input) = *expr {
            let value = kernel.load_i64(pointers[input], place(input)?)?;
            return kernel.store_i64(out, to, value);
        }
        let load = |input: usize| kernel.load_float(pointers[input], place(input)?);
        kernel.store_float(out, to, kernel.expr(expr, &load)?)
    };
    if flat(width, inputs) {
        let first = kernel.mul(start, kernel.i64(width))?;
        let last = kernel.mul(end, kernel.i64(width))?;
        return kernel.parallel_range(first, last, |at| {
            compute(at, &|input| {
                let access = &inputs[input];
                if access.row_stride == 0 {
                    Ok(kernel.i64(access.offset))
                } else {
                    kernel.add(at, kernel.i64(access.offset))
                }
            })
        });
    }
    kernel.parallel_rows_of_width((kernel.lane_count(), width), start, end, |row, lanes| {
        let rows = maps
            .iter()
            .map(|map| match map {
                Some(map) => kernel.load_i64(*map, row),
                None => Ok(row),
            })
            .collect::<Gen<Vec<_>>>()?;
        let base = kernel.mul(row, kernel.i64(width))?;
        let values = || {
            kernel.lane_range(lanes, width, |column| {
                compute(kernel.add(base, column)?, &|input| {
                    index(kernel, &inputs[input], rows[input], column)
                })
            })
        };
        // A row that a map marks -1 has nothing to read: zeros.
        let mut skipped = None;
        for (access, &mapped) in inputs.iter().zip(&rows) {
            if access.row_map.is_some_and(RowMap::skips) {
                let absent = kernel.less(mapped, kernel.i64(0))?;
                skipped = Some(match skipped {
                    Some(before) => kernel.or(before, absent)?,
                    None => absent,
                });
            }
        }
        let Some(skipped) = skipped else {
            return values();
        };
        let zeros = || {
            kernel.lane_range(lanes, width, |column| {
                let at = kernel.add(base, column)?;
                match expr {
                    nestor_passes::Expr::Integers(_) => kernel.store_i64(out, at, kernel.i64(0)),
                    _ => kernel.store_float(out, at, kernel.constant(0.0)),
                }
            })
        };
        kernel.if_else(skipped, zeros, values)
    })
}
