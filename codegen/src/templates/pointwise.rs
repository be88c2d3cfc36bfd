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
