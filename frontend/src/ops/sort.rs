//! Order statistics along one dim: `sort`, `argsort`, `topk`, `kthvalue`, `cummax`,
//! `cummin`. A static dim runs on the packed values; a ragged dim runs on all
//! elements at once: one stable sort of every line (the packed rows that differ only
//! in their position along the dim) keyed by its line, or one segmented scan. Indices
//! are positions within each element; values gather from the input, so autograd flows.

use tch::{Kind, Tensor};

use crate::ops::Reduced;
use crate::{NestedError, NestedTensor, Result};

/// The lines of a ragged dim: for every packed row, its line and its position along
/// the dim, and the rows grouped by line when they are not already (a ragged dim
/// after the first).
struct Lines {
    /// The line of every row, in the grouped order.
    line: Tensor,
    /// The position along the dim of every row, in the packed order.
    position: Tensor,
    /// Rows grouped by line (a stable order) and its inverse; `None` when the packed
    /// order already groups them.
    grouped: Option<(Tensor, Tensor)>,
}

impl Lines {
    fn new(nested: &NestedTensor, dim: usize) -> Result<Self> {
        let layout = nested.lay();
        let device = nested.device();
        let line = layout.reduced_row_map(&[dim]);
        let position = Tensor::f_from_slice(&layout.row_coordinates(dim))?.f_to_device(device)?;
        if line.windows(2).all(|pair| pair[0] <= pair[1]) {
            let line = Tensor::f_from_slice(&line)?.f_to_device(device)?;
            return Ok(Self {
                line,
                position,
                grouped: None,
            });
        }
        let mut order: Vec<i64> = (0..line.len() as i64).collect();
        // Stable: rows of one line keep their order, which is the order along the dim.
        order.sort_by_key(|&row| line[row as usize]);
        let mut inverse = vec![0i64; order.len()];
        for (position, &row) in order.iter().enumerate() {
            inverse[row as usize] = position as i64;
        }
        let grouped_line: Vec<i64> = order.iter().map(|&row| line[row as usize]).collect();
        let tensor = |values: &[i64]| -> Result<Tensor> {
            Ok(Tensor::f_from_slice(values)?.f_to_device(device)?)
        };
        Ok(Self {
            line: tensor(&grouped_line)?,
            position,
            grouped: Some((tensor(&order)?, tensor(&inverse)?)),
        })
    }

    /// `rows` (grouped positions, any shape with rows first) as packed rows, read
    /// back in the packed order.
    fn to_packed(&self, rows: &Tensor) -> Result<Tensor> {
        match &self.grouped {
            None => Ok(rows.shallow_clone()),
            Some((order, inverse)) => {
                let packed = order.f_take(rows)?;
                Ok(packed.f_index_select(0, inverse)?)
            }
        }
    }

    /// Packed `[N, S]` columns in the grouped order.
    fn group(&self, columns: &Tensor) -> Result<Tensor> {
        match &self.grouped {
            None => Ok(columns.shallow_clone()),
            Some((order, _)) => Ok(columns.f_index_select(0, order)?),
        }
    }
}

impl NestedTensor {
    /// Sorts along `dim` (stable: equal values keep their order), smallest first
    /// unless `descending`; NaN sorts as the largest value, as in torch. Returns the
    /// sorted values and their positions in each element.
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let batch = NestedTensor::from_lists(vec![vec![3.0f32, 1.0, 2.0], vec![5.0, 4.0]])?;
    /// let (values, indices) = batch.sort(1, false)?;
    /// assert_eq!(Vec::<f32>::try_from(&values.values().shallow_clone())?, [1.0, 2.0, 3.0, 4.0, 5.0]);
    /// assert_eq!(Vec::<i64>::try_from(&indices.values().shallow_clone())?, [1, 2, 0, 1, 0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn sort(&self, dim: i64, descending: bool) -> Result<(NestedTensor, NestedTensor)> {
        self.untraceable("sort")?;
        let element_dim = self.element_dim(dim, "sort")?;
        if let Some(axis) = self.static_axis(element_dim) {
            let (values, indices) = self.packed().f_sort_stable(true, axis, descending)?;
            return Ok((self.with_values(values), self.with_values(indices)));
        }
        let lines = Lines::new(self, element_dim)?;
        let sources = self.sorted_sources(&lines, descending)?;
        self.gathered(&lines, &sources)
    }

    /// The positions that sort each element along `dim` (see [`sort`](Self::sort)).
    pub fn argsort(&self, dim: i64, descending: bool) -> Result<NestedTensor> {
        Ok(self.sort(dim, descending)?.1)
    }

    /// The `k` largest (or smallest) values along `dim`, sorted, and their positions.
    /// Along a ragged dim every element must have at least `k` positions.
    pub fn topk(&self, k: i64, dim: i64, largest: bool) -> Result<(NestedTensor, NestedTensor)> {
        self.untraceable("topk")?;
        let element_dim = self.element_dim(dim, "topk")?;
        self.check_k("topk", k, 0, dim, element_dim)?;
        let layout = self.lay();
        if let Some(axis) = self.static_axis(element_dim) {
            let (values, indices) = self.packed().f_topk(k, axis, largest, true)?;
            let layout = layout.with_static_size(element_dim, k)?;
            let wrap = |values| NestedTensor::from_parts(values, layout.clone(), self.options());
            return Ok((wrap(values), wrap(indices)));
        }
        let (values, indices) = self.sort(dim, largest)?;
        // The first k positions of every line, in the packed order of the result.
        let lines = Lines::new(self, element_dim)?;
        let kept = lines.position.f_lt(k)?.f_nonzero()?.f_flatten(0, -1)?;
        let sizes: Vec<Vec<i64>> = layout
            .element_sizes()
            .iter()
            .map(|sizes| {
                let mut sizes = sizes.clone();
                sizes[element_dim] = k;
                sizes
            })
            .collect();
        let layout = nestor_runtime::RaggedLayout::from_element_sizes(sizes, layout.ragged_dims())?;
        let wrap = |values: &NestedTensor| -> Result<NestedTensor> {
            Ok(NestedTensor::from_parts(
                values.packed().f_index_select(0, &kept)?,
                layout.clone(),
                self.options(),
            ))
        };
        Ok((wrap(&values)?, wrap(&indices)?))
    }

    /// The `k`-th smallest value along `dim` (`k` from 1) and its position, the dim
    /// reduced (kept as size 1 with `keepdim`). Along a ragged dim every element must
    /// have at least `k` positions.
    pub fn kthvalue(&self, k: i64, dim: i64, keepdim: bool) -> Result<(Reduced, Reduced)> {
        self.untraceable("kthvalue")?;
        let element_dim = self.element_dim(dim, "kthvalue")?;
        self.check_k("kthvalue", k, 1, dim, element_dim)?;
        let layout = self.lay();
        let reduced = if keepdim {
            layout
                .without_dim(element_dim)?
                .with_static_dim(element_dim, 1)?
        } else {
            layout.without_dim(element_dim)?
        };
        let (values, indices) = if let Some(axis) = self.static_axis(element_dim) {
            self.packed().f_kthvalue(k, axis, keepdim)?
        } else {
            let (values, indices) = self.sort(dim, false)?;
            let lines = Lines::new(self, element_dim)?;
            let kept = lines.position.f_eq(k - 1)?.f_nonzero()?.f_flatten(0, -1)?;
            (
                values.packed().f_index_select(0, &kept)?,
                indices.packed().f_index_select(0, &kept)?,
            )
        };
        let shape = reduced.packed_shape();
        Ok((
            self.wrap_reduced(values.f_reshape(&shape)?, reduced.clone()),
            self.wrap_reduced(indices.f_reshape(&shape)?, reduced),
        ))
    }

    /// The running largest value along `dim` and the position it was last seen at
    /// (torch's `cummax`: NaN, once seen, stays).
    pub fn cummax(&self, dim: i64) -> Result<(NestedTensor, NestedTensor)> {
        self.cumulative_extreme(dim, true)
    }

    /// The running smallest value along `dim` and its last position (see
    /// [`cummax`](Self::cummax)).
    pub fn cummin(&self, dim: i64) -> Result<(NestedTensor, NestedTensor)> {
        self.cumulative_extreme(dim, false)
    }

    fn cumulative_extreme(&self, dim: i64, largest: bool) -> Result<(NestedTensor, NestedTensor)> {
        let op = if largest { "cummax" } else { "cummin" };
        self.untraceable(op)?;
        let element_dim = self.element_dim(dim, op)?;
        if let Some(axis) = self.static_axis(element_dim) {
            let (values, indices) = if largest {
                self.packed().f_cummax(axis)?
            } else {
                self.packed().f_cummin(axis)?
            };
            return Ok((self.with_values(values), self.with_values(indices)));
        }
        let lines = Lines::new(self, element_dim)?;
        let columns = lines.group(&self.columns()?.f_detach()?)?;
        let rows = columns.size()[0];
        let longest = self
            .lay()
            .element_sizes()
            .iter()
            .map(|sizes| sizes[element_dim])
            .max()
            .unwrap_or(0);
        // A scan by doubling (Hillis-Steele): after the step of `shift`, every row
        // summarizes the `2 * shift` rows of its line ending at it. A summary is the
        // extreme value and the row it was last seen at; the later summary wins ties and
        // NaN, which makes the combination associative.
        let mut extreme = columns;
        let mut source = Tensor::f_arange(rows, (Kind::Int64, self.device()))?
            .f_unsqueeze(1)?
            .f_expand(extreme.size(), false)?
            .f_contiguous()?;
        let mut shift = 1;
        while shift < longest {
            // Rows before the first have line -1, so they never count.
            let earlier = shifted(&extreme, shift, 0.0)?;
            let earlier_source = shifted(&source, shift, 0.0)?;
            let same_line = lines
                .line
                .f_eq_tensor(&shifted(&lines.line, shift, -1.0)?)?
                .f_unsqueeze(1)?;
            let later_wins = if largest {
                extreme.f_ge_tensor(&earlier)?
            } else {
                extreme.f_le_tensor(&earlier)?
            };
            let later_wins = extreme.f_isnan()?.f_logical_or(
                &earlier
                    .f_isnan()?
                    .f_logical_not()?
                    .f_logical_and(&later_wins)?,
            )?;
            let take_earlier = same_line.f_logical_and(&later_wins.f_logical_not()?)?;
            extreme = earlier.f_where_self(&take_earlier, &extreme)?;
            source = earlier_source.f_where_self(&take_earlier, &source)?;
            shift *= 2;
        }
        self.gathered(&lines, &lines.to_packed(&source)?)
    }

    /// The values gathered from packed rows `sources` (`[N, S]`, per column) and those
    /// rows' positions along the dim.
    fn gathered(&self, lines: &Lines, sources: &Tensor) -> Result<(NestedTensor, NestedTensor)> {
        let shape = self.packed().size();
        let values = self
            .columns()?
            .f_gather(0, sources, false)?
            .f_reshape(&shape)?;
        let positions = lines.position.f_take(sources)?.f_reshape(&shape)?;
        Ok((self.with_values(values), self.with_values(positions)))
    }

    /// For every packed position (`[N, S]`), the packed row whose value goes there when
    /// every line is sorted: one stable sort by value, then one by line.
    fn sorted_sources(&self, lines: &Lines, descending: bool) -> Result<Tensor> {
        let columns = lines.group(&self.columns()?.f_detach()?)?;
        let by_value = columns.f_argsort_stable(true, 0, descending)?;
        let line_of = lines.line.f_take(&by_value)?;
        let by_line = line_of.f_argsort_stable(true, 0, false)?;
        lines.to_packed(&by_value.f_gather(0, &by_line, false)?)
    }

    /// The packed values as `[N, S]` (every static dim folded into columns).
    fn columns(&self) -> Result<Tensor> {
        let rows = self.packed().size()[0];
        let width: i64 = self.lay().static_sizes().iter().product();
        Ok(self.packed().f_reshape([rows, width])?)
    }

    /// Checks `minimum <= k <= size` of element dim `element_dim` in every element.
    fn check_k(
        &self,
        op: &'static str,
        k: i64,
        minimum: i64,
        dim: i64,
        element_dim: usize,
    ) -> Result<()> {
        if k < minimum {
            return Err(NestedError::Unsupported {
                op,
                reason: format!("k must be at least {minimum}, got {k}"),
            });
        }
        let sizes = self.lay().element_sizes();
        match sizes.iter().position(|sizes| sizes[element_dim] < k) {
            Some(element) => Err(NestedError::ElementTooShort {
                element,
                dim,
                index: k - 1,
                size: sizes[element][element_dim],
                needed: k,
            }),
            None => Ok(()),
        }
    }
}

/// `tensor` moved down `shift` rows, the first `shift` rows filled with `fill`.
fn shifted(tensor: &Tensor, shift: i64, fill: f64) -> Result<Tensor> {
    let mut shape = tensor.size();
    let rows = shape[0];
    let shift = shift.min(rows);
    shape[0] = shift;
    let head = Tensor::f_full(&shape, fill, (tensor.kind(), tensor.device()))?;
    Ok(Tensor::f_cat(
        &[head, tensor.f_narrow(0, 0, rows - shift)?],
        0,
    )?)
}
