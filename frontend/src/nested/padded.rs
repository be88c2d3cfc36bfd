//! The padded view of a batch: `tensor()`, `mask()` and both at once.

use tch::{Kind, Tensor};

use super::index::inverse_permutation;
use super::NestedTensor;
use nestor_ir::{Op, F64};

use crate::guard::{slow_path, SlowPath};
use crate::trace::{Arg, Dense};
use crate::Result;

impl NestedTensor {
    /// The padded tensor of [`shape`](Self::shape), `padding_value` outside the
    /// elements. Built with one scatter of the packed rows; differentiable. Kept for
    /// later calls when the values do not require grad.
    pub fn tensor(&self) -> Result<Tensor> {
        slow_path(SlowPath::PaddedMaterialization, "tensor")?;
        self.concrete_read("NestedTensor::tensor (use pad() while tracing)");
        if let Some(padded) = self.padded.get() {
            return Ok(padded.shallow_clone());
        }
        let padded = self.build_padded()?;
        if !self.requires_grad() {
            // Ignoring the result is right: a concurrent fill can only store the same tensor.
            let _ = self.padded.set(padded.shallow_clone());
        }
        Ok(padded)
    }

    /// The padding mask: true on real data (false when `mask_value` is true), shaped
    /// like [`shape`](Self::shape) without a static trailing channel dim (the last dim
    /// of elements of rank 2 or more, when every element has the same size there).
    pub fn mask(&self) -> Result<Tensor> {
        slow_path(SlowPath::PaddedMaterialization, "mask")?;
        self.concrete_read("NestedTensor::mask");
        let layout = self.lay();
        let rank = layout.rank();
        let drop_channel = rank >= 2 && !layout.is_ragged(rank - 1);
        let mask = self.grid_mask()?;
        // Broadcast the grid mask over the static dims, in packed order, except a
        // dropped channel dim, which keeps size 1 and is squeezed below.
        let batch = self.batch_size() as i64;
        let grid: Vec<i64> = layout
            .ragged_dims()
            .iter()
            .map(|&dim| layout.max_sizes()[dim])
            .collect();
        let static_sizes: Vec<i64> = layout
            .static_dims()
            .iter()
            .zip(layout.static_sizes())
            .map(|(&dim, &size)| {
                if drop_channel && dim == rank - 1 {
                    1
                } else {
                    size
                }
            })
            .collect();
        let unit_tail = vec![1i64; static_sizes.len()];
        let packed_shape: Vec<i64> = [vec![batch], grid.clone(), unit_tail].concat();
        let expanded_shape: Vec<i64> = [vec![batch], grid, static_sizes].concat();
        let mut mask = mask
            .f_reshape(&packed_shape)?
            .f_expand(&expanded_shape, false)?;
        mask = mask.f_permute(self.padded_permutation())?;
        if drop_channel {
            mask = mask.f_squeeze_dim(-1)?;
        }
        if self.options().mask_value {
            mask = mask.f_logical_not()?;
        }
        self.batch_to_its_dim(mask)
    }

    /// The padded tensor as a [`Dense`] handle, which keeps tracing (the IR's `pad`).
    pub fn pad(&self) -> Result<Dense> {
        slow_path(SlowPath::PaddedMaterialization, "pad")?;
        let padded = self.build_padded()?;
        let value = self.options().padding_value;
        Dense::traced(padded, &[Arg::Nested(self)], "pad", |ids| Op::Pad {
            x: ids[0],
            value: F64(value),
        })
    }

    /// [`tensor`](Self::tensor) and [`mask`](Self::mask) together.
    pub fn tensor_mask(&self) -> Result<(Tensor, Tensor)> {
        Ok((self.tensor()?, self.mask()?))
    }

    /// Flat indices of the packed rows in the padded grid `[B, *max ragged sizes]`.
    fn padded_row_indices(&self) -> Result<Tensor> {
        let indices = self.lay().padded_row_indices();
        Ok(Tensor::f_from_slice(&indices)?.f_to_device(self.device())?)
    }

    /// Grid volume: `B * prod(max ragged sizes)`.
    fn grid_rows(&self) -> i64 {
        let layout = self.lay();
        let max_sizes = layout.max_sizes();
        self.batch_size() as i64
            * layout
                .ragged_dims()
                .iter()
                .map(|&dim| max_sizes[dim])
                .product::<i64>()
    }

    /// True at the grid positions that hold a packed row, `bool[B * prod(grid)]`.
    fn grid_mask(&self) -> Result<Tensor> {
        let empty = Tensor::f_zeros([self.grid_rows()], (Kind::Bool, self.device()))?;
        Ok(empty.f_index_fill(0, &self.padded_row_indices()?, 1)?)
    }

    fn build_padded(&self) -> Result<Tensor> {
        let layout = self.lay();
        let static_sizes = layout.static_sizes();
        let grid_shape: Vec<i64> = std::iter::once(self.grid_rows())
            .chain(static_sizes.iter().copied())
            .collect();
        let filled = Tensor::f_full(
            &grid_shape,
            self.options().padding_value,
            (self.kind(), self.device()),
        )?;
        let scattered = filled.f_index_copy(0, &self.padded_row_indices()?, self.packed())?;
        let max_sizes = layout.max_sizes();
        let packed_shape: Vec<i64> = std::iter::once(self.batch_size() as i64)
            .chain(layout.ragged_dims().iter().map(|&dim| max_sizes[dim]))
            .chain(static_sizes.iter().copied())
            .collect();
        let padded = scattered
            .f_reshape(&packed_shape)?
            .f_permute(self.padded_permutation())?;
        self.batch_to_its_dim(padded)
    }

    /// The permutation from `[B, *packed order]` to `[B, *logical order]`.
    fn padded_permutation(&self) -> Vec<i64> {
        let inverse = inverse_permutation(&self.lay().packed_dim_order());
        std::iter::once(0)
            .chain(inverse.iter().map(|&position| position + 1))
            .collect()
    }

    /// Moves the batch dim of a batch-first tensor to [`batch_dim`](Self::batch_dim).
    fn batch_to_its_dim(&self, tensor: Tensor) -> Result<Tensor> {
        if self.batch_dim() == 1 && tensor.dim() >= 2 {
            Ok(tensor.f_transpose(0, 1)?)
        } else {
            Ok(tensor)
        }
    }
}
