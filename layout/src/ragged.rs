//! The layout of a packed ragged batch: which dims are ragged, the exact size of every
//! element, and the row offsets of each element in the packed values.
//!
//! A batch of `B` elements of rank `R` is stored as `values: [N, *static_sizes]`: every
//! element is permuted so that its ragged dims come first (`packed_dim_order`), the
//! ragged dims are flattened into rows, and the elements are concatenated. Element `i`
//! owns rows `offsets[i]..offsets[i + 1]`.

use thiserror::Error;

/// Why a set of element sizes does not form a ragged layout.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    /// Elements of one batch must have the same rank.
    #[error("element {element} has rank {got}, expected rank {expected} (the rank of element 0)")]
    RankMismatch {
        /// Index of the offending element.
        element: usize,
        /// Rank of element 0.
        expected: usize,
        /// Rank of the offending element.
        got: usize,
    },
    /// Sizes and lengths are never negative.
    #[error("element {element} has size {size} in dim {dim}; sizes must not be negative")]
    NegativeSize {
        /// Index of the offending element.
        element: usize,
        /// Element dim of the negative size.
        dim: usize,
        /// The negative size.
        size: i64,
    },
    /// A dim was named that elements of this rank do not have.
    #[error("dim {dim} is out of range for elements of rank {rank}")]
    DimOutOfRange {
        /// The dim asked for.
        dim: usize,
        /// The rank of the elements.
        rank: usize,
    },
    /// The rows or values of the batch do not fit in an `i64` (sizes near `i64::MAX`).
    #[error("element {element} of sizes {sizes:?} makes the batch's {what} overflow i64")]
    TooLarge {
        /// Index of the element at which the count overflowed.
        element: usize,
        /// Its sizes.
        sizes: Vec<i64>,
        /// What overflowed: its rows, the batch's rows, or the batch's values.
        what: &'static str,
    },
    /// A ragged level was asked for that the layout does not have.
    #[error("ragged level {level} does not exist: the layout has {levels} ragged dims")]
    LevelOutOfRange {
        /// The level asked for.
        level: usize,
        /// How many ragged dims the layout has.
        levels: usize,
    },
}

/// Checks a size given for every element of dim `dim`.
fn non_negative(dim: usize, size: i64) -> Result<(), LayoutError> {
    if size < 0 {
        Err(LayoutError::NegativeSize {
            element: 0,
            dim,
            size,
        })
    } else {
        Ok(())
    }
}

/// Where every element of a packed ragged batch lives. See the module docs.
///
/// ```
/// use nestor_layout::RaggedLayout;
///
/// // Three sequences of 3, 0 and 2 tokens of 4 features, packed as [5, 4].
/// let layout = RaggedLayout::from_lengths(&[3, 0, 2], &[4])?;
/// assert_eq!(layout.packed_shape(), [5, 4]);
/// assert_eq!(layout.offsets(), [0, 3, 3, 5]);
/// assert_eq!(layout.max_sizes(), [3, 4]);
/// assert!(RaggedLayout::from_lengths(&[-1], &[4]).is_err());
/// # Ok::<(), nestor_layout::LayoutError>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RaggedLayout {
    rank: usize,
    element_sizes: Vec<Vec<i64>>,
    ragged_dims: Vec<usize>,
    static_dims: Vec<usize>,
    static_sizes: Vec<i64>,
    offsets: Vec<i64>,
}

impl RaggedLayout {
    /// The layout of elements with the given logical shapes.
    ///
    /// A dim is ragged when the elements disagree on its size, or when it is listed in
    /// `force_ragged` (so that a batch whose lengths happen to agree keeps the layout
    /// of its model). An empty batch has rank 0 unless `force_ragged` says otherwise,
    /// which is an error.
    pub fn from_element_sizes(
        element_sizes: Vec<Vec<i64>>,
        force_ragged: &[usize],
    ) -> Result<Self, LayoutError> {
        let rank = element_sizes.first().map_or(0, Vec::len);
        for (element, sizes) in element_sizes.iter().enumerate() {
            if sizes.len() != rank {
                return Err(LayoutError::RankMismatch {
                    element,
                    expected: rank,
                    got: sizes.len(),
                });
            }
            if let Some((dim, &size)) = sizes.iter().enumerate().find(|(_, size)| **size < 0) {
                return Err(LayoutError::NegativeSize { element, dim, size });
            }
        }
        if let Some(&dim) = force_ragged.iter().find(|&&dim| dim >= rank) {
            return Err(LayoutError::DimOutOfRange { dim, rank });
        }
        let is_ragged = |dim: usize| {
            force_ragged.contains(&dim)
                || element_sizes
                    .iter()
                    .any(|sizes| sizes[dim] != element_sizes[0][dim])
        };
        let ragged_dims: Vec<usize> = (0..rank).filter(|&dim| is_ragged(dim)).collect();
        let static_dims: Vec<usize> = (0..rank).filter(|&dim| !is_ragged(dim)).collect();
        // Static dims agree across elements, so element 0 holds their sizes.
        let static_sizes = static_dims
            .iter()
            .map(|&dim| element_sizes[0][dim])
            .collect();
        Self::assemble(rank, element_sizes, ragged_dims, static_dims, static_sizes)
    }

    /// The layout of `[L_i, *static_sizes]` elements: one leading ragged dim of the given
    /// lengths (ragged even if all lengths agree) and a static tail. Works for an empty
    /// batch, which keeps its rank.
    pub fn from_lengths(lengths: &[i64], static_sizes: &[i64]) -> Result<Self, LayoutError> {
        let ragged_sizes: Vec<Vec<i64>> = lengths.iter().map(|&length| vec![length]).collect();
        Self::from_ragged_sizes(1, &ragged_sizes, static_sizes)
    }

    /// The layout of elements `[*ragged_sizes[i], *static_sizes]`: the first `levels`
    /// dims are ragged (even if their sizes agree), the rest a static tail. Square pairs
    /// `[L_i, L_i, C]` have `levels = 2` and `ragged_sizes[i] = [L_i, L_i]`. Works for an
    /// empty batch, which keeps its rank.
    pub fn from_ragged_sizes(
        levels: usize,
        ragged_sizes: &[Vec<i64>],
        static_sizes: &[i64],
    ) -> Result<Self, LayoutError> {
        let rank = levels + static_sizes.len();
        let mut element_sizes = Vec::with_capacity(ragged_sizes.len());
        for (element, sizes) in ragged_sizes.iter().enumerate() {
            if sizes.len() != levels {
                return Err(LayoutError::RankMismatch {
                    element,
                    expected: levels,
                    got: sizes.len(),
                });
            }
            let full: Vec<i64> = sizes.iter().chain(static_sizes).copied().collect();
            if let Some((dim, &size)) = full.iter().enumerate().find(|(_, size)| **size < 0) {
                return Err(LayoutError::NegativeSize { element, dim, size });
            }
            element_sizes.push(full);
        }
        if let Some((position, &size)) = static_sizes.iter().enumerate().find(|(_, s)| **s < 0) {
            return Err(LayoutError::NegativeSize {
                element: 0,
                dim: levels + position,
                size,
            });
        }
        Self::assemble(
            rank,
            element_sizes,
            (0..levels).collect(),
            (levels..rank).collect(),
            static_sizes.to_vec(),
        )
    }

    /// The layout of checked element sizes: its offsets, with every product and sum
    /// checked (sizes come from users), and the packed values' count too.
    fn assemble(
        rank: usize,
        element_sizes: Vec<Vec<i64>>,
        ragged_dims: Vec<usize>,
        static_dims: Vec<usize>,
        static_sizes: Vec<i64>,
    ) -> Result<Self, LayoutError> {
        let too_large = |element: usize, what| LayoutError::TooLarge {
            element,
            sizes: element_sizes[element].clone(),
            what,
        };
        let width = static_sizes
            .iter()
            .try_fold(1i64, |width, &size| width.checked_mul(size));
        let mut offsets = Vec::with_capacity(element_sizes.len() + 1);
        offsets.push(0);
        let mut total = 0i64;
        for (element, sizes) in element_sizes.iter().enumerate() {
            let rows = ragged_dims
                .iter()
                .try_fold(1i64, |rows, &dim| rows.checked_mul(sizes[dim]))
                .ok_or_else(|| too_large(element, "rows"))?;
            total = total
                .checked_add(rows)
                .ok_or_else(|| too_large(element, "packed rows"))?;
            if width.and_then(|width| width.checked_mul(total)).is_none() {
                return Err(too_large(element, "packed values"));
            }
            offsets.push(total);
        }
        Ok(Self {
            rank,
            element_sizes,
            ragged_dims,
            static_dims,
            static_sizes,
            offsets,
        })
    }

    /// The layout of the elements at `indices` (in that order, repeats allowed).
    /// Indices must be in range (the caller checks them); many repeats can make the
    /// batch too large to count.
    pub fn select(&self, indices: &[usize]) -> Result<Self, LayoutError> {
        let element_sizes = indices
            .iter()
            .map(|&i| self.element_sizes[i].clone())
            .collect();
        Self::assemble(
            self.rank,
            element_sizes,
            self.ragged_dims.clone(),
            self.static_dims.clone(),
            self.static_sizes.clone(),
        )
    }

    /// The same layout with static dim `dim` resized to `size` in every element (used
    /// when an operation such as a slice changes it). `dim` must be a static dim.
    pub fn with_static_size(&self, dim: usize, size: i64) -> Result<Self, LayoutError> {
        let Some(position) = self.static_dims.iter().position(|&d| d == dim) else {
            return Err(LayoutError::DimOutOfRange {
                dim,
                rank: self.rank,
            });
        };
        non_negative(dim, size)?;
        let mut layout = self.clone();
        layout.static_sizes[position] = size;
        for sizes in &mut layout.element_sizes {
            sizes[dim] = size;
        }
        Ok(layout)
    }

    /// The layout after removing element dim `dim` from every element (a reduction
    /// over it). The remaining ragged dims stay ragged.
    pub fn without_dim(&self, dim: usize) -> Result<Self, LayoutError> {
        self.check_dim(dim)?;
        let shift = |&d: &usize| if d > dim { d - 1 } else { d };
        let element_sizes = self
            .element_sizes
            .iter()
            .map(|sizes| [&sizes[..dim], &sizes[dim + 1..]].concat())
            .collect();
        let ragged_dims = self
            .ragged_dims
            .iter()
            .filter(|&&d| d != dim)
            .map(shift)
            .collect();
        let (static_dims, static_sizes) = self
            .static_dims
            .iter()
            .zip(&self.static_sizes)
            .filter(|(&d, _)| d != dim)
            .map(|(d, &size)| (shift(d), size))
            .unzip();
        Self::assemble(
            self.rank - 1,
            element_sizes,
            ragged_dims,
            static_dims,
            static_sizes,
        )
    }

    /// The layout after inserting a static dim of size `size` at element dim `dim`
    /// (`dim <= rank`), as `unsqueeze` does with size 1.
    pub fn with_static_dim(&self, dim: usize, size: i64) -> Result<Self, LayoutError> {
        if dim > self.rank {
            return Err(LayoutError::DimOutOfRange {
                dim,
                rank: self.rank,
            });
        }
        non_negative(dim, size)?;
        let shift = |&d: &usize| if d >= dim { d + 1 } else { d };
        let element_sizes = self
            .element_sizes
            .iter()
            .map(|sizes| [&sizes[..dim], &[size], &sizes[dim..]].concat())
            .collect();
        let ragged_dims = self.ragged_dims.iter().map(shift).collect();
        let mut static_dims: Vec<usize> = self.static_dims.iter().map(shift).collect();
        let position = static_dims
            .iter()
            .position(|&d| d > dim)
            .unwrap_or(static_dims.len());
        static_dims.insert(position, dim);
        let mut static_sizes = self.static_sizes.clone();
        static_sizes.insert(position, size);
        Self::assemble(
            self.rank + 1,
            element_sizes,
            ragged_dims,
            static_dims,
            static_sizes,
        )
    }

    /// The same elements with their static dims permuted among themselves: static
    /// dim `static_dims()[i]` takes the size of `static_dims()[order[i]]`. Ragged dims
    /// do not move. `order` must be a permutation of `0..static_dims().len()`.
    pub fn with_static_order(&self, order: &[usize]) -> Self {
        let static_sizes: Vec<i64> = order.iter().map(|&i| self.static_sizes[i]).collect();
        let element_sizes = self
            .element_sizes
            .iter()
            .map(|sizes| {
                let mut sizes = sizes.clone();
                for (&dim, &size) in self.static_dims.iter().zip(&static_sizes) {
                    sizes[dim] = size;
                }
                sizes
            })
            .collect();
        // The ragged sizes do not move, so neither do the offsets.
        Self {
            element_sizes,
            static_sizes,
            ..self.clone()
        }
    }

    /// Where every packed row goes when the ragged dims `reduced` (a subset of
    /// `ragged_dims()`) are reduced away: for each row, the index of its row in the
    /// layout without those dims. With no ragged dim left, that is the element index.
    pub fn reduced_row_map(&self, reduced: &[usize]) -> Vec<i64> {
        let mut map = Vec::with_capacity(self.total_rows() as usize);
        let mut base = 0;
        for sizes in &self.element_sizes {
            let extents: Vec<i64> = self.ragged_dims.iter().map(|&dim| sizes[dim]).collect();
            let kept: Vec<bool> = self
                .ragged_dims
                .iter()
                .map(|dim| !reduced.contains(dim))
                .collect();
            for row in 0..extents.iter().product::<i64>() {
                // Unravel `row` over the extents (all positive, since the row exists)
                // and ravel the kept coordinates.
                let (mut rest, mut flat, mut stride) = (row, 0, 1);
                for (extent, &keep) in extents.iter().zip(&kept).rev() {
                    let coordinate = rest % extent;
                    rest /= extent;
                    if keep {
                        flat += coordinate * stride;
                        stride *= extent;
                    }
                }
                map.push(base + flat);
            }
            base += extents
                .iter()
                .zip(&kept)
                .filter(|(_, &keep)| keep)
                .map(|(extent, _)| extent)
                .product::<i64>();
        }
        map
    }

    /// For every packed row, the coordinate along ragged dim `dim` of the position it
    /// holds in its element.
    pub fn row_coordinates(&self, dim: usize) -> Vec<i64> {
        let Some(level) = self.ragged_dims.iter().position(|&d| d == dim) else {
            return vec![0; self.total_rows() as usize];
        };
        let mut coordinates = Vec::with_capacity(self.total_rows() as usize);
        for sizes in &self.element_sizes {
            let extents: Vec<i64> = self.ragged_dims.iter().map(|&d| sizes[d]).collect();
            let inner: i64 = extents[level + 1..].iter().product();
            let rows: i64 = extents.iter().product();
            coordinates.extend((0..rows).map(|row| (row / inner.max(1)) % extents[level].max(1)));
        }
        coordinates
    }

    /// For every packed row, the index of the element that owns it.
    pub fn row_elements(&self) -> Vec<i64> {
        self.offsets
            .windows(2)
            .enumerate()
            .flat_map(|(element, pair)| {
                std::iter::repeat_n(element as i64, (pair[1] - pair[0]) as usize)
            })
            .collect()
    }

    fn check_dim(&self, dim: usize) -> Result<(), LayoutError> {
        if dim < self.rank {
            Ok(())
        } else {
            Err(LayoutError::DimOutOfRange {
                dim,
                rank: self.rank,
            })
        }
    }

    /// Number of elements `B`.
    pub fn batch_size(&self) -> usize {
        self.element_sizes.len()
    }

    /// Rank `R` of every element.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The logical shape of every element.
    pub fn element_sizes(&self) -> &[Vec<i64>] {
        &self.element_sizes
    }

    /// The size of `dim` in every element (the lengths of a ragged dim); `None` past
    /// the rank.
    pub fn dim_sizes(&self, dim: usize) -> Option<Vec<i64>> {
        (dim < self.rank).then(|| self.element_sizes.iter().map(|sizes| sizes[dim]).collect())
    }

    /// The dims (of an element) whose size varies, in increasing order.
    pub fn ragged_dims(&self) -> &[usize] {
        &self.ragged_dims
    }

    /// The dims (of an element) whose size is the same for every element.
    pub fn static_dims(&self) -> &[usize] {
        &self.static_dims
    }

    /// The sizes of the static dims: the trailing shape of the packed values.
    pub fn static_sizes(&self) -> &[i64] {
        &self.static_sizes
    }

    /// Whether element dim `dim` is ragged.
    pub fn is_ragged(&self, dim: usize) -> bool {
        self.ragged_dims.contains(&dim)
    }

    /// The order in which an element's dims are laid out in the packed values: the
    /// ragged dims first, then the static dims, each in increasing order.
    pub fn packed_dim_order(&self) -> Vec<usize> {
        self.ragged_dims
            .iter()
            .chain(&self.static_dims)
            .copied()
            .collect()
    }

    /// Row offsets of the elements in the packed values (`B + 1` entries, from 0).
    pub fn offsets(&self) -> &[i64] {
        &self.offsets
    }

    /// Number of packed rows `N` (the sum of every element's ragged volume).
    pub fn total_rows(&self) -> i64 {
        self.offsets.last().copied().unwrap_or(0)
    }

    /// The shape of the packed values: `[N, *static_sizes]`.
    pub fn packed_shape(&self) -> Vec<i64> {
        std::iter::once(self.total_rows())
            .chain(self.static_sizes.iter().copied())
            .collect()
    }

    /// The shape element `i` has once its packed rows are unflattened, before it is
    /// permuted back to its logical order: `[ragged sizes..., static sizes...]`.
    pub fn packed_element_shape(&self, element: usize) -> Vec<i64> {
        let sizes = &self.element_sizes[element];
        self.packed_dim_order()
            .iter()
            .map(|&dim| sizes[dim])
            .collect()
    }

    /// The largest size of every dim over the batch (0 for ragged dims of an empty batch).
    pub fn max_sizes(&self) -> Vec<i64> {
        (0..self.rank)
            .map(
                |dim| match self.static_dims.iter().position(|&d| d == dim) {
                    Some(position) => self.static_sizes[position],
                    None => self
                        .element_sizes
                        .iter()
                        .map(|sizes| sizes[dim])
                        .max()
                        .unwrap_or(0),
                },
            )
            .collect()
    }

    /// Number of real (unpadded) scalars in the batch.
    pub fn numel(&self) -> i64 {
        self.element_sizes
            .iter()
            .map(|sizes| sizes.iter().product::<i64>())
            .sum()
    }

    /// Number of scalars in the padded tensor `[B, *max_sizes]`.
    pub fn padded_numel(&self) -> i64 {
        self.batch_size() as i64 * self.max_sizes().iter().product::<i64>()
    }

    /// Real scalars over padded scalars (0 for an empty padded tensor).
    pub fn occupancy(&self) -> f64 {
        let padded = self.padded_numel();
        if padded == 0 {
            0.0
        } else {
            self.numel() as f64 / padded as f64
        }
    }

    /// For every packed row, its flat index in the padded grid `[B, *max ragged sizes]`
    /// (row-major). Scattering the packed rows to these indices builds the padded tensor.
    pub fn padded_row_indices(&self) -> Vec<i64> {
        let max_sizes = self.max_sizes();
        let grid: Vec<i64> = self.ragged_dims.iter().map(|&dim| max_sizes[dim]).collect();
        let grid_volume: i64 = grid.iter().product();
        let mut indices = Vec::with_capacity(self.total_rows() as usize);
        for (element, sizes) in self.element_sizes.iter().enumerate() {
            let extents: Vec<i64> = self.ragged_dims.iter().map(|&dim| sizes[dim]).collect();
            let base = element as i64 * grid_volume;
            for row in 0..extents.iter().product::<i64>() {
                // Unravel the row over the element's extents, ravel it over the grid.
                // `row` exists only if every extent is positive, so `%` and `/` are safe.
                let (mut rest, mut flat, mut stride) = (row, 0, 1);
                for (extent, grid_size) in extents.iter().zip(&grid).rev() {
                    flat += (rest % extent) * stride;
                    rest /= extent;
                    stride *= grid_size;
                }
                indices.push(base + flat);
            }
        }
        indices
    }

    /// The row splits of ragged level `level`, as in a nested row-partitioned tensor:
    /// level 0 splits the elements (`B + 1` entries, the offsets of the first ragged
    /// dim), level `k` splits every row of level `k - 1` by the size of ragged dim `k`.
    pub fn ragged_level_offsets(&self, level: usize) -> Result<Vec<i64>, LayoutError> {
        let levels = self.ragged_dims.len();
        if level >= levels {
            return Err(LayoutError::LevelOutOfRange { level, levels });
        }
        let mut splits = vec![0i64];
        let mut total = 0;
        for sizes in &self.element_sizes {
            let outer: i64 = self.ragged_dims[..level]
                .iter()
                .map(|&dim| sizes[dim])
                .product();
            let inner = sizes[self.ragged_dims[level]];
            for _ in 0..outer {
                total += inner;
                splits.push(total);
            }
        }
        Ok(splits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_count_rows_of_the_ragged_dims() -> Result<(), LayoutError> {
        // Elements (L_i, 4): one ragged dim, a static tail of 4.
        let layout =
            RaggedLayout::from_element_sizes(vec![vec![3, 4], vec![0, 4], vec![5, 4]], &[])?;
        assert_eq!(layout.ragged_dims(), [0]);
        assert_eq!(layout.static_sizes(), [4]);
        assert_eq!(layout.offsets(), [0, 3, 3, 8]);
        assert_eq!(layout.packed_shape(), [8, 4]);
        assert_eq!(layout.max_sizes(), [5, 4]);
        assert_eq!(layout.numel(), 32);
        assert!((layout.occupancy() - 32.0 / 60.0).abs() < 1e-12);
        Ok(())
    }

    #[test]
    fn ragged_dims_move_to_the_front_in_packed_order() -> Result<(), LayoutError> {
        // Elements (2, L_i, M_i, 3): dims 1 and 2 ragged.
        let layout =
            RaggedLayout::from_element_sizes(vec![vec![2, 1, 2, 3], vec![2, 3, 1, 3]], &[])?;
        assert_eq!(layout.packed_dim_order(), [1, 2, 0, 3]);
        assert_eq!(layout.offsets(), [0, 2, 5]);
        assert_eq!(layout.packed_element_shape(1), [3, 1, 2, 3]);
        Ok(())
    }

    #[test]
    fn padded_row_indices_walk_the_grid_row_major() -> Result<(), LayoutError> {
        // Two ragged dims, grid [3, 2] per element: element 0 is (1, 2), element 1 (3, 1).
        let layout = RaggedLayout::from_element_sizes(vec![vec![1, 2], vec![3, 1]], &[])?;
        assert_eq!(layout.padded_row_indices(), [0, 1, 6, 8, 10]);
        Ok(())
    }

    #[test]
    fn ragged_levels_split_rows_like_nested_row_splits() -> Result<(), LayoutError> {
        // Square pairs (L_i, L_i) with L = [2, 3].
        let layout = RaggedLayout::from_element_sizes(vec![vec![2, 2], vec![3, 3]], &[])?;
        assert_eq!(layout.ragged_level_offsets(0)?, [0, 2, 5]);
        assert_eq!(layout.ragged_level_offsets(1)?, [0, 2, 4, 7, 10, 13]);
        assert_eq!(
            layout.ragged_level_offsets(2),
            Err(LayoutError::LevelOutOfRange {
                level: 2,
                levels: 2
            })
        );
        Ok(())
    }

    #[test]
    fn forced_ragged_dims_stay_ragged_when_sizes_agree() -> Result<(), LayoutError> {
        let layout = RaggedLayout::from_element_sizes(vec![vec![4, 2], vec![4, 2]], &[0])?;
        assert_eq!(layout.ragged_dims(), [0]);
        assert_eq!(layout.offsets(), [0, 4, 8]);
        let inferred = RaggedLayout::from_element_sizes(vec![vec![4, 2], vec![4, 2]], &[])?;
        assert_eq!(inferred.ragged_dims(), [] as [usize; 0]);
        assert_eq!(inferred.offsets(), [0, 1, 2]);
        Ok(())
    }

    #[test]
    fn static_dims_can_be_resized() -> Result<(), LayoutError> {
        let layout = RaggedLayout::from_element_sizes(vec![vec![3, 4], vec![1, 4]], &[])?;
        let narrowed = layout.with_static_size(1, 2)?;
        assert_eq!(narrowed.element_sizes(), [vec![3, 2], vec![1, 2]]);
        assert_eq!(narrowed.packed_shape(), [4, 2]);
        assert_eq!(
            layout.with_static_size(0, 2),
            Err(LayoutError::DimOutOfRange { dim: 0, rank: 2 })
        );
        Ok(())
    }

    #[test]
    fn bad_sizes_are_errors_that_name_the_element() {
        assert_eq!(
            RaggedLayout::from_element_sizes(vec![vec![3], vec![2, 2]], &[]),
            Err(LayoutError::RankMismatch {
                element: 1,
                expected: 1,
                got: 2
            })
        );
        assert_eq!(
            RaggedLayout::from_element_sizes(vec![vec![3], vec![-1]], &[]),
            Err(LayoutError::NegativeSize {
                element: 1,
                dim: 0,
                size: -1
            })
        );
        assert_eq!(
            RaggedLayout::from_lengths(&[2, -3], &[4]),
            Err(LayoutError::NegativeSize {
                element: 1,
                dim: 0,
                size: -3
            })
        );
        assert_eq!(
            RaggedLayout::from_element_sizes(vec![vec![3]], &[1]),
            Err(LayoutError::DimOutOfRange { dim: 1, rank: 1 })
        );
    }

    #[test]
    fn an_empty_batch_of_lengths_keeps_its_tail() -> Result<(), LayoutError> {
        let layout = RaggedLayout::from_lengths(&[], &[8])?;
        assert_eq!(layout.batch_size(), 0);
        assert_eq!(layout.packed_shape(), [0, 8]);
        assert_eq!(layout.max_sizes(), [0, 8]);
        assert_eq!(layout.occupancy(), 0.0);
        Ok(())
    }
}
