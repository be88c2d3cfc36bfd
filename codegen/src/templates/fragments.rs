//! Tensor-core fragments of packed matrices, as attention's kernels on tensor cores read
//! them: a head's columns of a buffer of packed rows, loaded into the `A` and `B`
//! fragments of `mma.m16n8k16` (the PTX ISA's layouts: lane `l` has `group = l / 4` and
//! `pair = 2 (l % 4)`), values outside the rows or columns given read as 0.

use super::*;
use crate::builder::{FragmentA, FragmentB, FragmentC};

/// Rows of an `m16n8k16` product's `A` and its `k`: a warp's tile of 16 rows, and 16
/// keys (or queries) a product takes.
pub(super) const TILE: i64 = 16;

/// Whether kernels of an `float` program keeping floats as `storage` may use tensor
/// cores: bf16 buffers of an f32 program (the products take bf16 as stored).
pub(super) fn tensor_core_storage(float: nestor_passes::FloatType, storage: Storage) -> bool {
    storage == Storage::Bf16 && float == nestor_passes::FloatType::F32
}

/// A lane's place in the fragments: `group = lane / 4`, `pair = 2 (lane % 4)` (its
/// first column of a `C` fragment, and of each half of an `A` row), and the four lanes
/// of its group (which share its rows).
pub(super) struct Lane<'ctx> {
    pub(super) group: IntValue<'ctx>,
    pub(super) pair: IntValue<'ctx>,
    pub(super) quad: Lanes<'ctx>,
}

impl<'ctx> Lane<'ctx> {
    /// The place of the lane of `lanes` (a warp).
    pub(super) fn of(kernel: &Kernel<'ctx, '_>, lanes: Lanes<'ctx>) -> Gen<Self> {
        let four = kernel.i64(4);
        Ok(Self {
            group: kernel.div(lanes.lane, four)?,
            pair: kernel.mul(kernel.rem(lanes.lane, four)?, kernel.i64(2))?,
            quad: Lanes {
                lane: lanes.lane,
                count: 4,
            },
        })
    }

    /// The lane's two rows of a tile of 16 from `first` (`group` and `group + 8`).
    pub(super) fn rows(
        &self,
        kernel: &Kernel<'ctx, '_>,
        first: IntValue<'ctx>,
    ) -> Gen<[IntValue<'ctx>; 2]> {
        let low = kernel.add(first, self.group)?;
        Ok([low, kernel.add(low, kernel.i64(8))?])
    }
}

/// One head's `width` columns of packed rows: of a buffer (from column `base`, read
/// through `access`), or of rows a block staged in shared memory.
#[derive(Clone, Copy)]
pub(super) struct HeadColumns<'a, 'ctx> {
    pub(super) source: Source<'a, 'ctx>,
    pub(super) width: i64,
}

/// Where [`HeadColumns`] are.
#[derive(Clone, Copy)]
pub(super) enum Source<'a, 'ctx> {
    /// A buffer's rows, the head's columns from `base`.
    Buffer {
        buffer: PointerValue<'ctx>,
        access: &'a Access,
        base: IntValue<'ctx>,
    },
    /// Shared memory of rows of `stride` floats, the head's columns from `base`.
    Shared {
        shared: PointerValue<'ctx>,
        stride: i64,
        base: i64,
    },
}

/// Whether `column` (at most `last`) is one of `width`: `None` when `last` is.
pub(super) fn column_valid<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    column: IntValue<'ctx>,
    last: i64,
    width: i64,
) -> Gen<Option<IntValue<'ctx>>> {
    if last < width {
        return Ok(None);
    }
    Ok(Some(kernel.less(column, kernel.i64(width))?))
}

/// The `C` fragments of two products of 8 columns each (`c[n]` columns `8n..`) as the
/// `A` fragment of a product with 16 rows of `k`, rounded to bf16: the layouts agree
/// (register r of `A` holds row `r % 2`'s columns `pair + 8 (r / 2)` and the next, which
/// are fragment `r / 2`'s values `2 (r % 2)` and the next), so no lane exchanges values.
pub(super) fn a_of_c<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    c: [FragmentC<'ctx>; 2],
) -> Gen<FragmentA<'ctx>> {
    let register = |register: usize| -> Gen<IntValue<'ctx>> {
        let values = c[register / 2];
        let first = 2 * (register % 2);
        kernel.pack_bf16(values[first], values[first + 1])
    };
    Ok([register(0)?, register(1)?, register(2)?, register(3)?])
}

impl<'ctx> HeadColumns<'_, 'ctx> {
    /// Value `(row, column)`, 0 where the row or the column is not valid (`None`: known
    /// to be; an invalid one is read at 0 instead, which exists).
    pub(super) fn value_or_zero(
        &self,
        kernel: &Kernel<'ctx, '_>,
        (row, column): (IntValue<'ctx>, IntValue<'ctx>),
        (row_valid, column_valid): (Option<IntValue<'ctx>>, Option<IntValue<'ctx>>),
    ) -> Gen<FloatValue<'ctx>> {
        let zero = kernel.i64(0);
        let inside = |valid: Option<IntValue<'ctx>>, at: IntValue<'ctx>| match valid {
            Some(valid) => kernel.select_index(valid, at, zero),
            None => Ok(at),
        };
        let (row, column) = (inside(row_valid, row)?, inside(column_valid, column)?);
        let value = match self.source {
            Source::Buffer {
                buffer,
                access,
                base,
            } => {
                let at = index(kernel, access, row, kernel.add(base, column)?)?;
                kernel.load_float(buffer, at)?
            }
            Source::Shared {
                shared,
                stride,
                base,
            } => {
                let at = kernel.add(kernel.mul(row, kernel.i64(stride))?, column)?;
                kernel.load_shared(shared, kernel.add(at, kernel.i64(base))?)?
            }
        };
        let valid = match (row_valid, column_valid) {
            (Some(row), Some(column)) => kernel.and(row, column)?,
            (Some(valid), None) | (None, Some(valid)) => valid,
            (None, None) => return Ok(value),
        };
        kernel.select(valid, value, kernel.constant(0.0))
    }

    /// The `A` fragment of rows `rows` (the lane's two, each read where `valid`) and
    /// columns `16 chunk..`.
    pub(super) fn a(
        &self,
        kernel: &Kernel<'ctx, '_>,
        lane: &Lane<'ctx>,
        (rows, valid): ([IntValue<'ctx>; 2], [IntValue<'ctx>; 2]),
        chunk: i64,
    ) -> Gen<FragmentA<'ctx>> {
        // Register r holds row `rows[r % 2]`, columns `pair + 8 (r / 2)` and the next.
        let register = |register: usize| -> Gen<IntValue<'ctx>> {
            let row = rows[register % 2];
            let first = kernel.add(
                lane.pair,
                kernel.i64(chunk * 16 + 8 * (register as i64 / 2)),
            )?;
            let [low, high] = [0, 1].map(|next| -> Gen<FloatValue<'ctx>> {
                let column = kernel.add(first, kernel.i64(next))?;
                let column_valid = column_valid(kernel, column, chunk * 16 + 15, self.width)?;
                self.value_or_zero(
                    kernel,
                    (row, column),
                    (Some(valid[register % 2]), column_valid),
                )
            });
            kernel.pack_bf16(low?, high?)
        };
        Ok([register(0)?, register(1)?, register(2)?, register(3)?])
    }

    /// The `B` fragment of this matrix transposed: its row `row` (the lane's column of
    /// `B`, `group`; read where `valid`), columns `16 chunk..` (`B`'s rows).
    pub(super) fn b_transposed(
        &self,
        kernel: &Kernel<'ctx, '_>,
        lane: &Lane<'ctx>,
        (row, valid): (IntValue<'ctx>, IntValue<'ctx>),
        chunk: i64,
    ) -> Gen<FragmentB<'ctx>> {
        // Register r holds `B`'s rows `pair + 8 r` and the next: this matrix's columns.
        let register = |register: i64| -> Gen<IntValue<'ctx>> {
            let first = kernel.add(lane.pair, kernel.i64(chunk * 16 + 8 * register))?;
            let [low, high] = [0, 1].map(|next| -> Gen<FloatValue<'ctx>> {
                let column = kernel.add(first, kernel.i64(next))?;
                let column_valid = column_valid(kernel, column, chunk * 16 + 15, self.width)?;
                self.value_or_zero(kernel, (row, column), (Some(valid), column_valid))
            });
            kernel.pack_bf16(low?, high?)
        };
        Ok([register(0)?, register(1)?])
    }

    /// The `B` fragment of this matrix's rows `first..` (16 of them, those from `count`
    /// on read as 0) and columns `8 slot..`.
    pub(super) fn b(
        &self,
        kernel: &Kernel<'ctx, '_>,
        lane: &Lane<'ctx>,
        (first, count): (IntValue<'ctx>, IntValue<'ctx>),
        slot: i64,
    ) -> Gen<FragmentB<'ctx>> {
        // Register r holds rows `pair + 8 r` and the next of column `8 slot + group`.
        let column = kernel.add(lane.group, kernel.i64(8 * slot))?;
        let column_valid = column_valid(kernel, column, 8 * slot + 7, self.width)?;
        let register = |register: i64| -> Gen<IntValue<'ctx>> {
            let [low, high] = [0, 1].map(|next| -> Gen<FloatValue<'ctx>> {
                let offset = kernel.add(lane.pair, kernel.i64(8 * register + next))?;
                let row_valid = Some(kernel.less(offset, count)?);
                let row = kernel.add(first, offset)?;
                self.value_or_zero(kernel, (row, column), (row_valid, column_valid))
            });
            kernel.pack_bf16(low?, high?)
        };
        Ok([register(0)?, register(1)?])
    }
}
