//! Pair layouts: two nested operands whose elements broadcast to a larger shape
//! (`x.unsqueeze(2) * x.unsqueeze(1)` for `[L_i, C]` elements gives `[L_i, L_i, C]`,
//! stored packed, `sum L_i^2` rows). Each operand is gathered to the rows of the
//! result, so gradients of repeated values accumulate through the gather.

use tch::Tensor;

use nestor_layout::RaggedLayout;

use crate::{NestedError, NestedTensor, Result};

/// Two operands lined up on the rows of their broadcast layout.
pub(crate) struct Broadcast {
    /// The left operand's values on the result's rows.
    pub(crate) left: Tensor,
    /// The right operand's values on the result's rows.
    pub(crate) right: Tensor,
    /// The result's layout.
    pub(crate) layout: RaggedLayout,
}

impl NestedTensor {
    /// The broadcast of two batches whose elements have different shapes that
    /// broadcast (per element, every dim equal or 1 in one of them), or `None` when the
    /// layouts are equal or do not broadcast (the caller's usual rules apply).
    /// A dim is ragged in the result when it is ragged in either operand or its sizes
    /// differ between elements.
    pub(crate) fn broadcast_nested(
        &self,
        other: &NestedTensor,
        op: &'static str,
    ) -> Result<Option<Broadcast>> {
        let (left, right) = (self.lay(), other.lay());
        if left == right || left.batch_size() != right.batch_size() || left.rank() != right.rank() {
            return Ok(None);
        }
        // Equal elements packed by other ragged dims broadcast as pairs only when every
        // dim ragged in one operand has size 1 in the other (`[L, 1, C]` with `[1, L, C]`
        // for elements of length 1), so that the result has the structure a batch of
        // other lengths would give; otherwise they are repacked (see `align`).
        if left.element_sizes() == right.element_sizes() {
            let static_one = |layout: &RaggedLayout, dim: usize| {
                !layout.is_ragged(dim) && layout.element_sizes().iter().all(|sizes| sizes[dim] == 1)
            };
            let pairs = left
                .ragged_dims()
                .iter()
                .all(|&dim| right.is_ragged(dim) || static_one(right, dim))
                && right
                    .ragged_dims()
                    .iter()
                    .all(|&dim| left.is_ragged(dim) || static_one(left, dim));
            if !pairs {
                return Ok(None);
            }
        }
        let mut sizes = Vec::with_capacity(left.batch_size());
        for (a, b) in left.element_sizes().iter().zip(right.element_sizes()) {
            let mut element = Vec::with_capacity(a.len());
            for (dim, (&a, &b)) in a.iter().zip(b).enumerate() {
                // A dim ragged in both operands never broadcasts: an element of length 1
                // against a longer one is another structure (compiled code sees two
                // length symbols), a StructureMismatch from `align`.
                let both_ragged = left.is_ragged(dim) && right.is_ragged(dim);
                match (a, b) {
                    _ if a == b => element.push(a),
                    _ if both_ragged => return Ok(None),
                    (1, b) => element.push(b),
                    (a, 1) => element.push(a),
                    _ => return Ok(None),
                }
            }
            sizes.push(element);
        }
        let mut ragged: Vec<usize> = left
            .ragged_dims()
            .iter()
            .chain(right.ragged_dims())
            .copied()
            .collect();
        ragged.sort_unstable();
        ragged.dedup();
        let layout = RaggedLayout::from_element_sizes(sizes, &ragged)?;
        Ok(Some(Broadcast {
            left: self.on_rows_of(&layout, op)?,
            right: other.on_rows_of(&layout, op)?,
            layout,
        }))
    }

    /// The values gathered to the rows of `layout`, a broadcast of this batch's layout
    /// whose ragged dims include this batch's: `[rows of layout, *static sizes]`, where
    /// the static sizes broadcast against `layout`'s.
    fn on_rows_of(&self, layout: &RaggedLayout, op: &'static str) -> Result<Tensor> {
        let own = self.lay();
        if own == layout {
            return Ok(self.packed().shallow_clone());
        }
        // Static dims that become ragged must have size 1: they drop out of the values.
        let mut kept = Vec::new();
        for (axis, (&dim, &size)) in own.static_dims().iter().zip(own.static_sizes()).enumerate() {
            if layout.is_ragged(dim) {
                if size != 1 {
                    return Err(NestedError::Unsupported {
                        op,
                        reason: format!(
                            "element dim {dim} is static of size {size} in one operand and \
                             ragged in the broadcast result; only size 1 can broadcast there"
                        ),
                    });
                }
            } else {
                kept.push(axis as i64 + 1);
            }
        }
        let rows = own.total_rows();
        let shape: Vec<i64> = std::iter::once(rows)
            .chain(kept.iter().map(|&axis| self.packed().size()[axis as usize]))
            .collect();
        let values = self.packed().f_reshape(&shape)?;
        let map = Tensor::f_from_slice(&broadcast_rows(own, layout))?.f_to_device(self.device())?;
        Ok(values.f_index_select(0, &map)?)
    }
}

impl NestedTensor {
    /// A pair layout `[M_i, N_i, ...]` with `value` where the key comes after its query
    /// (`j > i`, query `i` seeing keys `0..=i`): the causal mask of attention written by
    /// hand, `scores.causal_fill(f64::NEG_INFINITY)?.softmax(2)`. The compiler turns
    /// `softmax(causal_fill(scale * q @ k^T, -inf)) @ v` into causal varlen attention.
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let q = NestedTensor::from_lists(vec![vec![vec![1.0f32]; 2], vec![vec![1.0]; 1]])?;
    /// let scores = q.matmul_nested(&q.transpose(1, 2)?)?.causal_fill(-1.0)?;
    /// assert_eq!(Vec::<f32>::try_from(scores.values())?, [1.0, -1.0, 1.0, 1.0, 1.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn causal_fill(&self, value: f64) -> Result<NestedTensor> {
        let layout = self.lay();
        if !(layout.rank() >= 2 && layout.is_ragged(0) && layout.is_ragged(1)) {
            return Err(NestedError::Unsupported {
                op: "causal_fill",
                reason: format!(
                    "it takes a pair layout [M_i, N_i, ...], got ragged dims {:?} of rank {}",
                    layout.ragged_dims(),
                    layout.rank()
                ),
            });
        }
        let (queries, keys) = (layout.row_coordinates(0), layout.row_coordinates(1));
        let after: Vec<bool> = queries.iter().zip(&keys).map(|(i, j)| j > i).collect();
        let mut shape = vec![1i64; self.packed().dim()];
        shape[0] = -1;
        let mask = Tensor::f_from_slice(&after)?
            .f_to_device(self.device())?
            .f_reshape(&shape)?;
        let values = self.packed().f_masked_fill(&mask, value)?;
        self.with_values(values)
            .traced(&[crate::trace::Arg::Nested(self)], "causal_fill", |ids| {
                nestor_ir::Op::CausalFill {
                    x: ids[0],
                    value: nestor_ir::F64(value),
                }
            })
    }
}

/// For every row of `layout`, the row of `own` (a layout that broadcasts to it, with a
/// subset of its ragged dims) that holds its values: coordinates along `own`'s ragged
/// dims, 0 where `own` has size 1.
fn broadcast_rows(own: &RaggedLayout, layout: &RaggedLayout) -> Vec<i64> {
    let mut map = Vec::with_capacity(layout.total_rows() as usize);
    for (element, (own_sizes, sizes)) in own
        .element_sizes()
        .iter()
        .zip(layout.element_sizes())
        .enumerate()
    {
        let base = own.offsets()[element];
        let extents: Vec<i64> = layout.ragged_dims().iter().map(|&dim| sizes[dim]).collect();
        // The stride of each of the result's ragged dims in the operand's rows (0 where
        // the operand does not move along it).
        let mut strides = vec![0i64; extents.len()];
        let mut stride = 1;
        for &dim in own.ragged_dims().iter().rev() {
            let level = layout.ragged_dims().iter().position(|&d| d == dim);
            if let Some(level) = level {
                if own_sizes[dim] != 1 {
                    strides[level] = stride;
                }
            }
            stride *= own_sizes[dim];
        }
        let count: i64 = extents.iter().product();
        for row in 0..count {
            let (mut rest, mut source) = (row, base);
            for (extent, stride) in extents.iter().zip(&strides).rev() {
                source += (rest % extent) * stride;
                rest /= extent;
            }
            map.push(source);
        }
    }
    map
}

/// The two jagged-pair products that run packed.
#[derive(Clone, Copy, PartialEq)]
enum PairProduct {
    /// `[M_i, K] @ [K, N_i] -> [M_i, N_i]` (attention's scores `q @ k^T`).
    Scores,
    /// `[M_i, N_i] @ [N_i, D] -> [M_i, D]` (attention's mix `p @ v`).
    Mix,
}

/// From this many elements, one padded batched GEMM may beat one GEMM per element.
const BATCHED_MIN_ELEMENTS: i64 = 64;

/// The most multiply-adds of one padded element for which padding beats a call of
/// its own (about 3 us of libtorch overhead at some 50 GMAC/s of small batched GEMMs).
const BATCHED_MAX_MACS: i64 = 1 << 17;

/// A jagged-pair matmul to run: its form, the operands and every element's extents
/// `(rows, ragged)`: the product's rows and the other ragged extent (its columns for
/// scores, the inner dim for the mix).
struct PairMatmul<'a> {
    product: PairProduct,
    left: &'a NestedTensor,
    right: &'a NestedTensor,
    extents: Vec<(i64, i64)>,
}

impl NestedTensor {
    /// The jagged-pair matmul `self @ other`, or `None` when the operands are not one
    /// of the [`PairProduct`] forms: a grouped GEMM, one GEMM per element on views of
    /// the packed values (no copy in, no padding), concatenated once in packed order;
    /// for many short elements, whose calls would cost more than their padding, one
    /// batched GEMM padded to the longest.
    pub(crate) fn pair_matmul(&self, other: &NestedTensor) -> Result<Option<NestedTensor>> {
        let (a, b) = (self.lay(), other.lay());
        let product = match (a.ragged_dims(), b.ragged_dims()) {
            _ if a.rank() != 2 || b.rank() != 2 => return Ok(None),
            ([0], [1]) => PairProduct::Scores,
            ([0, 1], [0]) => PairProduct::Mix,
            _ => return Ok(None),
        };
        let (sizes_a, sizes_b) = (a.element_sizes(), b.element_sizes());
        if let Some(element) = (0..sizes_a.len()).find(|&i| sizes_a[i][1] != sizes_b[i][0]) {
            return Err(NestedError::ElementShapeMismatch {
                op: "matmul_nested",
                element,
                expected: sizes_a[element].clone(),
                got: sizes_b[element].clone(),
            });
        }
        let extents: Vec<(i64, i64)> = (0..sizes_a.len())
            .map(|i| match product {
                PairProduct::Scores => (sizes_a[i][0], sizes_b[i][1]),
                PairProduct::Mix => (sizes_a[i][0], sizes_a[i][1]),
            })
            .collect();
        let width = match product {
            PairProduct::Scores => None,
            PairProduct::Mix => Some(*b.static_sizes().first().unwrap_or(&0)),
        };
        let matmul = PairMatmul {
            product,
            left: self,
            right: other,
            extents,
        };
        let values = if matmul.batched_is_cheaper() {
            matmul.batched(width)?
        } else {
            matmul.grouped(width)?
        };
        let (sizes, ragged): (Vec<Vec<i64>>, &[usize]) = match product {
            PairProduct::Scores => (
                matmul.extents.iter().map(|&(m, n)| vec![m, n]).collect(),
                &[0, 1],
            ),
            PairProduct::Mix => (
                matmul
                    .extents
                    .iter()
                    .map(|&(m, _)| vec![m, width.unwrap_or(0)])
                    .collect(),
                &[0],
            ),
        };
        let layout = RaggedLayout::from_element_sizes(sizes, ragged)?;
        Ok(Some(NestedTensor::from_parts(
            values,
            layout,
            self.options(),
        )))
    }
}

impl PairMatmul<'_> {
    /// One GEMM per element on views of the packed values, concatenated in order.
    /// Every operand is split into its elements' views by one call, so an element costs
    /// one GEMM call (and a reshape for the scores).
    fn grouped(&self, width: Option<i64>) -> Result<Tensor> {
        let (rows, ragged): (Vec<i64>, Vec<i64>) = self.extents.iter().copied().unzip();
        let products = match self.product {
            PairProduct::Scores => {
                // k^T's packed values are k's rows: [K, sum N_i] split by columns.
                let lefts = self.left.packed().f_split_with_sizes(&rows, 0)?;
                let rights = self
                    .right
                    .packed()
                    .f_transpose(0, 1)?
                    .f_split_with_sizes(&ragged, 1)?;
                lefts
                    .iter()
                    .zip(&rights)
                    .map(|(left, right)| Ok(left.f_mm(right)?.f_reshape([-1])?))
                    .collect::<Result<Vec<_>>>()?
            }
            PairProduct::Mix => {
                let cells: Vec<i64> = rows.iter().zip(&ragged).map(|(m, n)| m * n).collect();
                let lefts = self.left.packed().f_split_with_sizes(&cells, 0)?;
                let rights = self.right.packed().f_split_with_sizes(&ragged, 0)?;
                lefts
                    .iter()
                    .zip(&rights)
                    .zip(rows.iter().zip(&ragged))
                    .map(|((left, right), (&m, &n))| Ok(left.f_reshape([m, n])?.f_mm(right)?))
                    .collect::<Result<Vec<_>>>()?
            }
        };
        if products.is_empty() {
            return self.empty(width);
        }
        Ok(Tensor::f_cat(&products, 0)?)
    }

    /// Whether one padded batched GEMM beats one GEMM per element: many elements, each
    /// small enough padded that its multiply-adds cost less than libtorch's per-call
    /// overhead (measured: 512 elements of at most 16 x 16 x 64 ran 9x faster padded).
    fn batched_is_cheaper(&self) -> bool {
        let count = self.extents.len() as i64;
        let (longest_m, longest_n) = self
            .extents
            .iter()
            .fold((0, 0), |(a, b), &(m, n)| (a.max(m), b.max(n)));
        // The third GEMM dim: the inner size of the scores, the width of the mix.
        let third = match self.product {
            PairProduct::Scores => self.left.lay().static_sizes().first(),
            PairProduct::Mix => self.right.lay().static_sizes().first(),
        };
        let padded_macs = longest_m
            .saturating_mul(longest_n)
            .saturating_mul(*third.unwrap_or(&1));
        count >= BATCHED_MIN_ELEMENTS && padded_macs <= BATCHED_MAX_MACS
    }

    /// One batched GEMM over every element padded to the longest (zeros written by
    /// `index_copy`, so gradients reach the real rows only), the real products picked
    /// back in order.
    fn batched(&self, width: Option<i64>) -> Result<Tensor> {
        let (a, b) = (self.left.lay(), self.right.lay());
        let device = self.left.device();
        let count = self.extents.len() as i64;
        let (longest_m, longest_n) = self
            .extents
            .iter()
            .fold((0, 0), |(x, y), &(m, n)| (x.max(m), y.max(n)));
        let index = |values: Vec<i64>| -> Result<Tensor> {
            Ok(Tensor::f_from_slice(&values)?.f_to_device(device)?)
        };
        // For every row of a `[count * longest, ...]` grid, the packed row it holds, or
        // the zero row appended past the last (a gather: `index_copy` on the CPU copies
        // row by row).
        let grid_sources = |layout: &RaggedLayout, longest: i64| -> Vec<i64> {
            let zero_row = layout.total_rows();
            let mut rows = Vec::with_capacity((count * longest) as usize);
            for pair in layout.offsets().windows(2) {
                let length = pair[1] - pair[0];
                rows.extend((0..longest).map(|r| if r < length { pair[0] + r } else { zero_row }));
            }
            rows
        };
        let padded = |values: &Tensor, sources: Vec<i64>| -> Result<Tensor> {
            let mut shape = values.size();
            shape[0] = 1;
            let zero = Tensor::f_zeros(&shape, (values.kind(), device))?;
            Ok(Tensor::f_cat(&[values.shallow_clone(), zero], 0)?
                .f_index_select(0, &index(sources)?)?)
        };
        let right = padded(self.right.packed(), grid_sources(b, longest_n))?
            .f_reshape([count, longest_n, -1])?;
        let (product, picks) = match self.product {
            PairProduct::Scores => {
                let left = padded(self.left.packed(), grid_sources(a, longest_m))?
                    .f_reshape([count, longest_m, -1])?;
                let mut picks = Vec::new();
                for (element, &(m, n)) in self.extents.iter().enumerate() {
                    let base = element as i64 * longest_m * longest_n;
                    for i in 0..m {
                        picks.extend((0..n).map(|j| base + i * longest_n + j));
                    }
                }
                let scores = left.f_bmm(&right.f_transpose(1, 2)?)?;
                (scores.f_reshape([-1])?, picks)
            }
            PairProduct::Mix => {
                // The pairs' scalars on a [count, longest_m, longest_n] grid.
                let zero = a.total_rows();
                let mut cells = Vec::with_capacity((count * longest_m * longest_n) as usize);
                let mut picks = Vec::new();
                for (element, &(m, n)) in self.extents.iter().enumerate() {
                    let start = a.offsets()[element];
                    for i in 0..longest_m {
                        cells.extend((0..longest_n).map(|j| {
                            if i < m && j < n {
                                start + i * n + j
                            } else {
                                zero
                            }
                        }));
                    }
                    picks.extend((0..m).map(|i| element as i64 * longest_m + i));
                }
                let scalars = self.left.packed().f_reshape([-1])?;
                let left = padded(&scalars, cells)?.f_reshape([count, longest_m, longest_n])?;
                let rows = left.f_bmm(&right)?.f_reshape([count * longest_m, -1])?;
                (rows, picks)
            }
        };
        if picks.is_empty() {
            return self.empty(width);
        }
        Ok(product.f_index_select(0, &index(picks)?)?)
    }

    /// An empty product (`[0]`, or `[0, width]`) that still depends on both operands,
    /// so a backward pass through it reaches them (with empty gradients).
    fn empty(&self, width: Option<i64>) -> Result<Tensor> {
        let shape: Vec<i64> = std::iter::once(0).chain(width).collect();
        let empty = |x: &NestedTensor| x.packed().f_reshape([-1])?.f_narrow(0, 0, 0);
        Ok(Tensor::f_cat(&[empty(self.left)?, empty(self.right)?], 0)?.f_reshape(&shape)?)
    }
}
