//! Pair layouts: two nested operands whose elements broadcast to a larger shape
//! (`x.unsqueeze(2) * x.unsqueeze(1)` for `[L_i, C]` elements gives `[L_i, L_i, C]`,
//! stored packed, `sum L_i^2` rows). Each operand is gathered to the rows of the
//! result, so gradients of repeated values accumulate through the gather.

use tch::Tensor;

use nestor_runtime::RaggedLayout;

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
    /// element shapes are equal or do not broadcast (the caller's usual rules apply).
    /// A dim is ragged in the result when it is ragged in either operand or its sizes
    /// differ between elements.
    pub(crate) fn broadcast_nested(
        &self,
        other: &NestedTensor,
        op: &'static str,
    ) -> Result<Option<Broadcast>> {
        let (left, right) = (self.lay(), other.lay());
        if left.element_sizes() == right.element_sizes()
            || left.batch_size() != right.batch_size()
            || left.rank() != right.rank()
        {
            return Ok(None);
        }
        let mut sizes = Vec::with_capacity(left.batch_size());
        for (a, b) in left.element_sizes().iter().zip(right.element_sizes()) {
            let mut element = Vec::with_capacity(a.len());
            for (&a, &b) in a.iter().zip(b) {
                match (a, b) {
                    _ if a == b => element.push(a),
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

/// Elements grouped by the size they are padded to in one batched GEMM.
struct Bucket {
    /// The padded rows and columns of the product.
    rows: i64,
    columns: i64,
    /// The elements in the bucket, in batch order.
    elements: Vec<usize>,
    /// Where the bucket's products start in the concatenation of all buckets'.
    start: i64,
}

impl NestedTensor {
    /// The jagged-pair matmul `self @ other` as batched GEMMs over elements grouped by
    /// size, or `None` when the operands are not one of the [`PairProduct`] forms.
    /// Grouping pads each element to at most one grain (1/8 of the longest length, at
    /// least 16) per dim, so the padding is bounded however ragged the batch is.
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
        // The product of element i is [rows_i, columns_i]; its GEMM pads rows_i and
        // the other ragged extent (columns for scores, the inner dim for the mix).
        let extents: Vec<(i64, i64)> = (0..sizes_a.len())
            .map(|i| match product {
                PairProduct::Scores => (sizes_a[i][0], sizes_b[i][1]),
                PairProduct::Mix => (sizes_a[i][0], sizes_a[i][1]),
            })
            .collect();
        let buckets = buckets(&extents, |rows, ragged| match product {
            PairProduct::Scores => rows * ragged,
            PairProduct::Mix => rows,
        });
        let device = self.device();
        let index = |values: Vec<i64>| -> Result<Tensor> {
            Ok(Tensor::f_from_slice(&values)?.f_to_device(device)?)
        };
        let mut products = Vec::with_capacity(buckets.len());
        for bucket in &buckets {
            let (rows, ragged) = (bucket.rows, bucket.columns);
            let count = bucket.elements.len() as i64;
            let left_rows = padded_rows(a, &bucket.elements, rows, |e, r| {
                (r < extents[e].0).then_some(r)
            });
            let gemm = match product {
                PairProduct::Scores => {
                    let left =
                        padded(self.packed(), index(left_rows)?)?.f_reshape([count, rows, -1])?;
                    let right_rows = padded_rows(b, &bucket.elements, ragged, |e, c| {
                        (c < extents[e].1).then_some(c)
                    });
                    let right = padded(other.packed(), index(right_rows)?)?
                        .f_reshape([count, ragged, -1])?;
                    left.f_bmm(&right.f_transpose(1, 2)?)?
                }
                PairProduct::Mix => {
                    // The pairs' scalars [M_i * N_i] read as an [rows, ragged] grid.
                    let cells = padded_rows(a, &bucket.elements, rows * ragged, |e, cell| {
                        let (r, c) = (cell / ragged, cell % ragged);
                        let (m, n) = extents[e];
                        (r < m && c < n).then_some(r * n + c)
                    });
                    let scalars = self.packed().f_reshape([-1, 1])?;
                    let left = padded(&scalars, index(cells)?)?.f_reshape([count, rows, ragged])?;
                    let right_rows = padded_rows(b, &bucket.elements, ragged, |e, r| {
                        (r < extents[e].1).then_some(r)
                    });
                    let right = padded(other.packed(), index(right_rows)?)?
                        .f_reshape([count, ragged, -1])?;
                    left.f_bmm(&right)?
                }
            };
            products.push(match product {
                PairProduct::Scores => gemm.f_reshape([-1])?,
                PairProduct::Mix => gemm.f_reshape([count * rows, -1])?,
            });
        }
        // Every element's real products, in batch order.
        let mut slot_of = vec![(0usize, 0i64); extents.len()];
        for (number, bucket) in buckets.iter().enumerate() {
            for (slot, &element) in bucket.elements.iter().enumerate() {
                slot_of[element] = (number, slot as i64);
            }
        }
        // Past the end of the products: the zero row `padded` appends (the mix of an
        // element with an empty inner dim is zeros).
        let zero_row: i64 = products.iter().map(|p| p.size()[0]).sum();
        let mut picks = Vec::new();
        for (element, &(m, n)) in extents.iter().enumerate() {
            let (number, slot) = slot_of[element];
            if m == 0 || n == 0 {
                if product == PairProduct::Mix {
                    picks.extend(std::iter::repeat_n(zero_row, m as usize));
                }
                continue;
            }
            let bucket = &buckets[number];
            match product {
                PairProduct::Scores => {
                    let base = bucket.start + slot * bucket.rows * bucket.columns;
                    for r in 0..m {
                        picks.extend((0..n).map(|c| base + r * bucket.columns + c));
                    }
                }
                PairProduct::Mix => {
                    let base = bucket.start + slot * bucket.rows;
                    picks.extend((0..m).map(|r| base + r));
                }
            }
        }
        let width = match product {
            PairProduct::Scores => None,
            PairProduct::Mix => Some(*b.static_sizes().first().unwrap_or(&0)),
        };
        let all = if products.is_empty() {
            // Nothing to multiply: an empty result that still depends on both operands,
            // so a backward pass through it reaches them (with empty gradients).
            let shape: Vec<i64> = std::iter::once(0).chain(width).collect();
            let empty = |x: &NestedTensor| x.packed().f_reshape([-1])?.f_narrow(0, 0, 0);
            Tensor::f_cat(&[empty(self)?, empty(other)?], 0)?.f_reshape(&shape)?
        } else {
            Tensor::f_cat(&products, 0)?
        };
        let values = padded(&all, index(picks)?)?;
        let (sizes, ragged): (Vec<Vec<i64>>, &[usize]) = match product {
            PairProduct::Scores => (extents.iter().map(|&(m, n)| vec![m, n]).collect(), &[0, 1]),
            PairProduct::Mix => (
                extents
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

/// Elements grouped by `(rows, ragged)` extents rounded up to one grain, largest
/// first; `products` gives the number of output rows of a padded product.
fn buckets(extents: &[(i64, i64)], products: impl Fn(i64, i64) -> i64) -> Vec<Bucket> {
    let longest = extents.iter().map(|&(m, n)| m.max(n)).max().unwrap_or(0);
    let grain = (longest + 7) / 8;
    let grain = grain.max(16);
    let round = |size: i64| (size + grain - 1) / grain * grain;
    let mut keyed: Vec<((i64, i64), usize)> = extents
        .iter()
        .enumerate()
        .filter(|(_, &(m, n))| m > 0 && n > 0)
        .map(|(element, &(m, n))| ((round(m), round(n)), element))
        .collect();
    keyed.sort_by_key(|&(key, element)| (std::cmp::Reverse(key), element));
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut start = 0;
    for ((rows, columns), element) in keyed {
        match buckets.last_mut() {
            Some(bucket) if (bucket.rows, bucket.columns) == (rows, columns) => {
                bucket.elements.push(element);
            }
            _ => {
                if let Some(bucket) = buckets.last() {
                    start += bucket.elements.len() as i64 * products(bucket.rows, bucket.columns);
                }
                buckets.push(Bucket {
                    rows,
                    columns,
                    elements: vec![element],
                    start,
                });
            }
        }
    }
    buckets
}

/// The packed rows of `layout` that fill `count` padded positions of each element in
/// `elements`: `position(element, p)` is the element's own row at padded position `p`,
/// or `None` for padding (which reads the zero row appended by [`padded`]).
fn padded_rows(
    layout: &RaggedLayout,
    elements: &[usize],
    count: i64,
    position: impl Fn(usize, i64) -> Option<i64>,
) -> Vec<i64> {
    let zero_row = layout.total_rows();
    let mut rows = Vec::with_capacity(elements.len() * count as usize);
    for &element in elements {
        let base = layout.offsets()[element];
        rows.extend((0..count).map(|p| position(element, p).map_or(zero_row, |row| base + row)));
    }
    rows
}

/// Rows `index` of `values` with one zero row appended (padding reads it), so
/// gradients flow to the real rows only.
fn padded(values: &Tensor, index: Tensor) -> Result<Tensor> {
    let mut shape = values.size();
    shape[0] = 1;
    let zero = Tensor::f_zeros(&shape, (values.kind(), values.device()))?;
    Ok(Tensor::f_cat(&[values.shallow_clone(), zero], 0)?.f_index_select(0, &index)?)
}
