//! Structure operations: zero-copy reconstruction from packed values, repeats over the
//! batch dim, reshapes of static dims, segmented scans, and cdist between elements.

use nestor_layout::RaggedLayout;
use tch::{Kind, Tensor};

use nestor_ir::Op;

use crate::guard::{slow_path, SlowPath};
use crate::trace::{record_with, Arg};
use crate::{NestedError, NestedTensor, Result};

/// torch's `cdist` compute mode that never takes the matrix-product shortcut.
const DIRECT_DISTANCES: i64 = 2;

impl NestedTensor {
    /// Zero-copy: new packed values in this batch's layout. `values` must have the shape
    /// of [`values`](Self::values); it keeps its storage and autograd history.
    pub fn packed_like(&self, values: &Tensor) -> Result<NestedTensor> {
        self.untraceable("packed_like")?;
        let expected = self.lay().packed_shape();
        if values.size() != expected {
            return Err(NestedError::ShapeMismatch {
                what: "packed values",
                expected: format!("{expected:?}"),
                got: values.size(),
            });
        }
        Ok(self.with_values(values.shallow_clone()))
    }

    /// The same batch with its first dim ragged (sequences whose lengths happen to be
    /// equal pack as a dense `[B, L, ...]`; sequence models want `[sum L, ...]`). Zero
    /// copy when no dim is ragged; a repack when other dims are.
    pub fn ragged_leading(&self) -> Result<NestedTensor> {
        let layout = self.lay();
        if layout.rank() == 0 || layout.is_ragged(0) {
            return Ok(self.shallow_clone());
        }
        self.untraceable("ragged_leading")?;
        if layout.ragged_dims().is_empty() {
            let sizes = layout.static_sizes();
            let batch = self.batch_size() as i64;
            let shape: Vec<i64> = std::iter::once(batch * sizes[0])
                .chain(sizes[1..].iter().copied())
                .collect();
            let values = self.packed().f_reshape(&shape)?;
            let lengths = vec![sizes[0]; batch as usize];
            return NestedTensor::builder()
                .options(self.options())
                .packed_with_lengths(&values, &lengths);
        }
        let mut ragged = layout.ragged_dims().to_vec();
        ragged.insert(0, 0);
        NestedTensor::builder()
            .options(self.options())
            .ragged_dims(&ragged)
            .tensors(&self.elements()?)
    }

    /// Zero-copy: packed values `[N, *tail]` with this batch's rows (same `N`) and a new
    /// static tail: element `i` becomes `[*ragged sizes of i, *tail]`.
    pub fn packed_with_static_tail(&self, values: &Tensor) -> Result<NestedTensor> {
        self.untraceable("packed_with_static_tail")?;
        self.retail(values)
    }

    /// New values with this batch's rows and another static tail (no checks of tracing).
    fn retail(&self, values: &Tensor) -> Result<NestedTensor> {
        let shape = values.size();
        let rows = self.lay().total_rows();
        if shape.first() != Some(&rows) {
            return Err(NestedError::ShapeMismatch {
                what: "packed values",
                expected: format!("[{rows}, ...] (the packed rows of the batch)"),
                got: shape,
            });
        }
        let layout = self.lay();
        let ragged_sizes: Vec<Vec<i64>> = layout
            .element_sizes()
            .iter()
            .map(|sizes| layout.ragged_dims().iter().map(|&dim| sizes[dim]).collect())
            .collect();
        let layout = RaggedLayout::from_ragged_sizes(
            layout.ragged_dims().len(),
            &ragged_sizes,
            &shape[1..],
        )?;
        Ok(NestedTensor::from_parts(
            values.shallow_clone(),
            layout,
            self.options(),
        ))
    }

    /// Zero-copy: packed values `[sum L_i^2, *tail]` as square pairs `[L_i, L_i, *tail]`
    /// (attention scores, pair features).
    pub fn packed_with_square_lengths(values: &Tensor, lengths: &[i64]) -> Result<NestedTensor> {
        let pairs: Vec<Vec<i64>> = lengths.iter().map(|&length| vec![length, length]).collect();
        Self::packed_with_ragged_sizes(values, &pairs)
    }

    /// Zero-copy: packed values `[sum P_i R_i, *tail]` as rectangular pairs
    /// `[P_i, R_i, *tail]` (cross-attention scores between two batches).
    pub fn packed_with_rectangular_lengths(
        values: &Tensor,
        rows: &[i64],
        columns: &[i64],
    ) -> Result<NestedTensor> {
        if rows.len() != columns.len() {
            return Err(NestedError::BatchSizeMismatch {
                op: "packed_with_rectangular_lengths",
                what: "columns",
                expected: rows.len(),
                got: columns.len(),
            });
        }
        let pairs: Vec<Vec<i64>> = rows
            .iter()
            .zip(columns)
            .map(|(&p, &r)| vec![p, r])
            .collect();
        Self::packed_with_ragged_sizes(values, &pairs)
    }

    fn packed_with_ragged_sizes(
        values: &Tensor,
        ragged_sizes: &[Vec<i64>],
    ) -> Result<NestedTensor> {
        let shape = values.size();
        let Some((&rows, tail)) = shape.split_first() else {
            return Err(NestedError::ShapeMismatch {
                what: "packed values",
                expected: "at least one dim (the packed rows)".into(),
                got: shape,
            });
        };
        let layout = RaggedLayout::from_ragged_sizes(2, ragged_sizes, tail)?;
        if layout.total_rows() != rows {
            return Err(NestedError::LengthsSum {
                sum: layout.total_rows(),
                rows,
            });
        }
        Ok(NestedTensor::from_parts(
            values.shallow_clone(),
            layout,
            Default::default(),
        ))
    }

    /// The whole batch repeated `repeats` times: `[e_0, ..., e_B, e_0, ...]`. Compiled
    /// for batches with one leading ragged dim (a copy through a row map, the new
    /// lengths computed each run); its gradient sums every copy back into its element.
    pub fn repeat_batch(&self, repeats: usize) -> Result<NestedTensor> {
        let batch = self.batch_size();
        let indices = self.repeat_indices("repeat_batch", repeats, |i| i % batch.max(1))?;
        self.repeated(indices, repeats, false)
    }

    /// Every element repeated `repeats` times in place: `[e_0, e_0, e_1, e_1, ...]`
    /// (compiled as [`repeat_batch`](Self::repeat_batch) is).
    pub fn repeat_interleave(&self, repeats: usize) -> Result<NestedTensor> {
        let indices = self.repeat_indices("repeat_interleave", repeats, |i| i / repeats)?;
        self.repeated(indices, repeats, true)
    }

    /// `element(i)` for the `batch * repeats` elements of a repeat, with the counts
    /// checked (elements and values) and the list allocated fallibly.
    fn repeat_indices(
        &self,
        op: &'static str,
        repeats: usize,
        element: impl Fn(usize) -> usize,
    ) -> Result<Vec<i64>> {
        let too_large = |what: String| NestedError::TooLarge { op, what };
        let batch = self.batch_size();
        let count = batch
            .checked_mul(repeats)
            .filter(|&count| i64::try_from(count).is_ok())
            .ok_or_else(|| too_large(format!("{batch} elements repeated {repeats} times")))?;
        let values = self.packed().numel();
        if values
            .checked_mul(repeats)
            .and_then(|n| i64::try_from(n).ok())
            .is_none()
        {
            return Err(too_large(format!(
                "{values} values repeated {repeats} times"
            )));
        }
        let mut indices = Vec::new();
        indices
            .try_reserve_exact(count)
            .map_err(|_| too_large(format!("a list of {count} element indices")))?;
        // Each index is below `batch`, which fits in an i64 (it counts a tensor's rows).
        indices.extend((0..count).map(|i| element(i) as i64));
        Ok(indices)
    }

    /// The elements at `indices`, recorded as a repeat of the batch.
    fn repeated(
        &self,
        indices: Vec<i64>,
        repeats: usize,
        interleave: bool,
    ) -> Result<NestedTensor> {
        let mut result = self.shallow_clone();
        result.trace = None;
        let mut result = result.select_batch(indices)?;
        let repeats = repeats as i64;
        result.trace = record_with(&[Arg::Nested(self)], "repeat_batch", |graph, ids| {
            let old = graph.ty(ids[0]).length_values();
            let lengths = old
                .into_iter()
                .map(|lengths| {
                    graph.push(Op::RepeatLengths {
                        lengths,
                        repeats,
                        interleave,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            graph.push(Op::RepeatBatch {
                x: ids[0],
                lengths,
                repeats,
                interleave,
            })
        })?;
        Ok(result)
    }

    /// Every row's position within its element (0 first), as i64 `[B; L_i]`, for a batch
    /// `[B; L_i]` of one ragged dim: BERT's position ids, which restart in every
    /// sequence. Computed packed from the lengths, and traced (the `positions` op, from
    /// the lengths alone): a compiled model computes them from the lengths of every call.
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let ids = NestedTensor::from_lists(vec![vec![7i64, 8, 9], vec![5]])?;
    /// let positions = ids.ragged_positions()?;
    /// assert_eq!(Vec::<i64>::try_from(positions.values())?, [0, 1, 2, 0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn ragged_positions(&self) -> Result<NestedTensor> {
        let layout = self.lay();
        if layout.rank() != 1 || !layout.is_ragged(0) {
            return Err(NestedError::ShapeMismatch {
                what: "ragged_positions input",
                expected: "[B; L_i]: one dim, ragged".into(),
                got: layout.packed_shape(),
            });
        }
        let positions = Tensor::f_from_slice(&layout.row_coordinates(0))?
            .f_to_device(self.packed().device())?;
        self.with_values(positions).traced_with(
            &[Arg::Nested(self)],
            "ragged_positions",
            |graph, ids| match graph.ty(ids[0]).length_values()[..] {
                [lengths] => graph.push(Op::Positions { lengths }),
                _ => Err(nestor_ir::VerifyError {
                    value: ids[0],
                    op: "ragged_positions",
                    rule: "traced without exactly one ragged dim".into(),
                }),
            },
        )
    }

    /// Cumulative sum along `dim`: packed for a static dim, element by element for a
    /// ragged dim.
    pub fn cumsum(&self, dim: i64) -> Result<NestedTensor> {
        self.scan(dim, "cumsum", |tensor, axis| {
            tensor.f_cumsum(axis, None::<Kind>)
        })
    }

    /// Cumulative product along `dim` (see [`cumsum`](Self::cumsum)).
    pub fn cumprod(&self, dim: i64) -> Result<NestedTensor> {
        self.scan(dim, "cumprod", |tensor, axis| {
            tensor.f_cumprod(axis, None::<Kind>)
        })
    }

    fn scan(
        &self,
        dim: i64,
        op: &'static str,
        scan: impl Fn(&Tensor, i64) -> Result<Tensor, tch::TchError>,
    ) -> Result<NestedTensor> {
        let element_dim = self.element_dim(dim, op)?;
        let axis = self.ir_dims(&[dim])?[0];
        let product = op == "cumprod";
        let result = match self.static_axis(element_dim) {
            // A static dim: on the packed values at once.
            Some(packed_axis) => self.with_values(scan(self.packed(), packed_axis)?),
            None => {
                self.map_elements_eager(op, true, |element| Ok(scan(element, element_dim as i64)?))?
            }
        };
        result.traced(&[Arg::Nested(self)], op, |ids| Op::Cumulative {
            x: ids[0],
            axis,
            product,
            reverse: false,
        })
    }

    /// Pairwise `p`-norm distances between the elements of two batches:
    /// `[L_i, D]` and `[M_i, D]` give `[L_i, M_i]`, as torch's `cdist` on each element,
    /// computed directly (torch's `compute_mode="donot_use_mm_for_euclid_dist"`: its
    /// default matrix-product shortcut for more than 25 points gives a distance of
    /// 0.001 between a point and itself), bf16 and f16 in f32, rounded once.
    /// Compiled (one kernel over every element's pairs, no padding), with its gradient
    /// for every `p` (torch's formulas).
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let a = NestedTensor::from_lists(vec![vec![vec![0.0f32, 0.0], vec![3.0, 4.0]], vec![vec![1.0, 1.0]]])?;
    /// let b = NestedTensor::from_lists(vec![vec![vec![0.0f32, 4.0]], vec![vec![1.0, 2.0], vec![4.0, 5.0]]])?;
    /// let distances = a.cdist(&b, 2.0)?; // [2, 1] and [1, 2]
    /// assert_eq!(Vec::<f32>::try_from(distances.values())?, [4.0, 3.0, 1.0, 5.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn cdist(&self, other: &NestedTensor, p: f64) -> Result<NestedTensor> {
        let distances = self.cdist_eager(other, p)?;
        distances.traced(&[Arg::Nested(self), Arg::Nested(other)], "cdist", |ids| {
            Op::Cdist {
                a: ids[0],
                b: ids[1],
                p: nestor_ir::F64(p),
            }
        })
    }

    /// `cdist` element by element through libtorch.
    fn cdist_eager(&self, other: &NestedTensor, p: f64) -> Result<NestedTensor> {
        slow_path(SlowPath::PerElement, "cdist")?;
        if self.batch_size() != other.batch_size() {
            return Err(NestedError::BatchSizeMismatch {
                op: "cdist",
                what: "the other batch",
                expected: self.batch_size(),
                got: other.batch_size(),
            });
        }
        let distances = self
            .elements()?
            .iter()
            .zip(other.elements()?)
            .map(|(a, b)| {
                // libtorch has no half-precision cdist on the CPU: computed in f32 and
                // rounded once, as compiled programs do.
                let kind = a.kind();
                if matches!(kind, Kind::BFloat16 | Kind::Half) {
                    let (a, b) = (a.f_to_kind(Kind::Float)?, b.f_to_kind(Kind::Float)?);
                    return Ok(Tensor::f_cdist(&a, &b, p, DIRECT_DISTANCES)?.f_to_kind(kind)?);
                }
                Ok(Tensor::f_cdist(a, &b, p, DIRECT_DISTANCES)?)
            })
            .collect::<Result<Vec<_>>>()?;
        if self.lay().rank() != 2 || other.lay().rank() != 2 {
            // Batches of point sets `[*, L_i, D]`: torch's batched distances.
            return NestedTensor::builder()
                .options(self.options())
                .ragged_dims(&[0, 1])
                .tensors(&distances);
        }
        // Pairs `[L_i, M_i]`, an empty batch included.
        let sizes: Vec<Vec<i64>> = distances.iter().map(Tensor::size).collect();
        let layout = RaggedLayout::from_ragged_sizes(2, &sizes, &[])?;
        let values = match distances.is_empty() {
            true => Tensor::f_empty([0], (self.kind(), self.device()))?,
            false => Tensor::f_cat(
                &distances
                    .iter()
                    .map(|d| d.f_reshape([-1]))
                    .collect::<Result<Vec<_>, _>>()?,
                0,
            )?,
        };
        Ok(NestedTensor::from_parts(
            values.f_reshape(layout.packed_shape())?,
            layout,
            self.options(),
        ))
    }

    /// Inserts a static dim of size 1 at NestedTensor dim `dim` (which may not be the
    /// batch dim; `dim` may equal `self.dim()` to append).
    pub fn unsqueeze(&self, dim: i64) -> Result<NestedTensor> {
        let ndim = self.dim() as i64 + 1;
        let normalized = if dim < 0 { dim + ndim } else { dim };
        let batch_dim = self.batch_dim() as i64;
        if !(0..ndim).contains(&normalized) {
            return Err(NestedError::DimOutOfRange {
                dim,
                ndim: ndim as usize,
            });
        }
        if normalized == batch_dim {
            return Err(NestedError::BatchDim {
                op: "unsqueeze",
                dim,
            });
        }
        let element_dim = (if normalized > batch_dim {
            normalized - 1
        } else {
            normalized
        }) as usize;
        let layout = self.lay().with_static_dim(element_dim, 1)?;
        let axis = layout
            .static_dims()
            .iter()
            .position(|&d| d == element_dim)
            .map_or(1, |p| p as i64 + 1);
        NestedTensor::from_parts(self.packed().f_unsqueeze(axis)?, layout, self.options()).traced(
            &[Arg::Nested(self)],
            "unsqueeze",
            |ids| Op::Unsqueeze {
                x: ids[0],
                dim: element_dim,
            },
        )
    }

    /// Removes static dim `dim`, which must have size 1.
    pub fn squeeze_dim(&self, dim: i64) -> Result<NestedTensor> {
        let element_dim = self.element_dim(dim, "squeeze")?;
        let axis = self.static_axis_or_error(element_dim, "squeeze")?;
        let size = self.packed().size()[axis as usize];
        if size != 1 {
            return Err(NestedError::Unsupported {
                op: "squeeze",
                reason: format!("dim {dim} has size {size}, not 1"),
            });
        }
        let layout = self.lay().without_dim(element_dim)?;
        let squeezed =
            NestedTensor::from_parts(self.packed().f_squeeze_dim(axis)?, layout, self.options());
        self.traced_as_new_tail(squeezed, "squeeze")
    }

    /// `result`, a reshape of this batch's static dims, recorded as `reshape_tail` (when
    /// the ragged dims lead the elements of both; otherwise a traced batch is an error
    /// naming `op`).
    fn traced_as_new_tail(&self, result: NestedTensor, op: &'static str) -> Result<NestedTensor> {
        let ragged_first = |batch: &NestedTensor| {
            let layout = batch.lay();
            layout
                .ragged_dims()
                .iter()
                .enumerate()
                .all(|(position, &dim)| position == dim)
        };
        if !ragged_first(self) || !ragged_first(&result) {
            self.untraceable(op)?;
            return Ok(result);
        }
        let tail = result.packed().size().split_off(1);
        result.traced(&[Arg::Nested(self)], op, |ids| Op::ReshapeTail {
            x: ids[0],
            tail,
        })
    }

    /// Swaps two element dims. Two static dims swap on the packed values; a ragged dim
    /// swaps with a static one without moving any value (`[L_i, D]` elements give
    /// `[D, L_i]`: the same packed rows); two ragged dims reorder each element's rows.
    pub fn transpose(&self, dim0: i64, dim1: i64) -> Result<NestedTensor> {
        let first = self.element_dim(dim0, "transpose")?;
        let second = self.element_dim(dim1, "transpose")?;
        let layout = self.lay();
        if layout.is_ragged(first) || layout.is_ragged(second) {
            // The IR's transpose_ragged takes a ragged dim with a static one, or a pair
            // layout's two ragged dims.
            return self.transpose_ragged(first, second)?.traced(
                &[Arg::Nested(self)],
                "transpose",
                |ids| Op::TransposeRagged {
                    x: ids[0],
                    dim0: first,
                    dim1: second,
                },
            );
        }
        let (axis0, axis1) = (
            self.static_axis_or_error(first, "transpose")?,
            self.static_axis_or_error(second, "transpose")?,
        );
        let mut order: Vec<usize> = (0..self.lay().static_dims().len()).collect();
        order.swap(axis0 as usize - 1, axis1 as usize - 1);
        let layout = self.lay().with_static_order(&order);
        let result = NestedTensor::from_parts(
            self.packed().f_transpose(axis0, axis1)?,
            layout,
            self.options(),
        );
        result.traced(&[Arg::Nested(self)], "transpose", |ids| {
            Op::TransposeStatic {
                x: ids[0],
                dim0: first,
                dim1: second,
            }
        })
    }

    /// [`transpose`](Self::transpose) of element dims at least one of which is ragged.
    fn transpose_ragged(&self, first: usize, second: usize) -> Result<NestedTensor> {
        let layout = self.lay();
        let swap = |dim: usize| match dim {
            _ if dim == first => second,
            _ if dim == second => first,
            _ => dim,
        };
        let sizes: Vec<Vec<i64>> = layout
            .element_sizes()
            .iter()
            .map(|sizes| (0..sizes.len()).map(|dim| sizes[swap(dim)]).collect())
            .collect();
        let mut ragged: Vec<usize> = layout.ragged_dims().iter().map(|&dim| swap(dim)).collect();
        ragged.sort_unstable();
        let swapped = RaggedLayout::from_element_sizes(sizes, &ragged)?;
        // Static dims keep their values axes unless two of them change order.
        let static_order: Vec<i64> = std::iter::once(0)
            .chain(swapped.static_dims().iter().map(|&dim| {
                let old = swap(dim);
                layout
                    .static_dims()
                    .iter()
                    .position(|&d| d == old)
                    .unwrap_or(0) as i64
                    + 1
            }))
            .collect();
        let mut values = self.packed().f_permute(static_order)?;
        if layout.is_ragged(first) && layout.is_ragged(second) {
            let rows = Tensor::f_from_slice(&transposed_rows(layout, &swapped, &swap))?
                .f_to_device(self.device())?;
            values = values.f_index_select(0, &rows)?;
        }
        Ok(NestedTensor::from_parts(values, swapped, self.options()))
    }

    /// Position `index` of static dim `dim` (a NestedTensor dim) in every element,
    /// removing the dim: elements `[L_i, 3, H, D]` give `[L_i, H, D]` for dim 2.
    /// Shares the values' storage.
    pub fn select_static(&self, dim: i64, index: i64) -> Result<NestedTensor> {
        let element_dim = self.element_dim(dim, "select_static")?;
        let axis = self.static_axis_or_error(element_dim, "select_static")?;
        let size = self.packed().size()[axis as usize];
        let position = if index < 0 { index + size } else { index };
        if !(0..size).contains(&position) {
            return Err(NestedError::StaticIndexOutOfRange {
                op: "select_static",
                dim,
                index,
                size,
            });
        }
        let layout = self.lay().without_dim(element_dim)?;
        let result = NestedTensor::from_parts(
            self.packed().f_select(axis, position)?,
            layout,
            self.options(),
        );
        result.traced(&[Arg::Nested(self)], "select_static", |ids| {
            Op::SelectStatic {
                x: ids[0],
                dim: element_dim,
                index: position,
            }
        })
    }

    /// Reorders the dims: `dims` is a permutation of the NestedTensor dims that keeps
    /// the batch dim and every ragged dim in place, so only static dims move. Traced as
    /// the transposes of static dims that make it (compiled when each swaps the last two).
    pub fn permute(&self, dims: &[i64]) -> Result<NestedTensor> {
        let ndim = self.dim();
        let normalized = dims
            .iter()
            .map(|&dim| self.normalize_dim(dim))
            .collect::<Result<Vec<_>>>()?;
        let mut seen = normalized.clone();
        seen.sort_unstable();
        if normalized.len() != ndim || seen.windows(2).any(|pair| pair[0] == pair[1]) {
            return Err(NestedError::Unsupported {
                op: "permute",
                reason: format!("{dims:?} is not a permutation of {ndim} dims"),
            });
        }
        let batch_dim = self.batch_dim();
        let element_dim = |dim: usize| if dim > batch_dim { dim - 1 } else { dim };
        let layout = self.lay();
        let mut static_order = Vec::new();
        for (position, &source) in normalized.iter().enumerate() {
            let fixed = position == batch_dim || layout.is_ragged(element_dim(position));
            if fixed && source != position {
                return Err(NestedError::Unsupported {
                    op: "permute",
                    reason: format!(
                        "dim {position} is the batch dim or ragged and must stay in place"
                    ),
                });
            }
            if !fixed {
                let axis = self.static_axis_or_error(element_dim(source), "permute")?;
                static_order.push(axis as usize - 1);
            }
        }
        if self.trace.is_some() {
            // One transpose a misplaced dim: the same values, each step recorded.
            let mut order: Vec<usize> = (0..ndim).collect();
            let mut result = self.shallow_clone();
            for (position, &wanted) in normalized.iter().enumerate() {
                let Some(from) = order.iter().position(|&dim| dim == wanted) else {
                    continue;
                };
                if from != position {
                    result = result.transpose(position as i64, from as i64)?;
                    order.swap(position, from);
                }
            }
            return Ok(result);
        }
        let axes: Vec<i64> = std::iter::once(0)
            .chain(static_order.iter().map(|&p| p as i64 + 1))
            .collect();
        let layout = layout.with_static_order(&static_order);
        Ok(NestedTensor::from_parts(
            self.packed().f_permute(axes)?,
            layout,
            self.options(),
        ))
    }

    /// Flattens the consecutive static dims `start..=end` into one.
    pub fn flatten(&self, start: i64, end: i64) -> Result<NestedTensor> {
        let first = self.element_dim(start, "flatten")?;
        let last = self.element_dim(end, "flatten")?;
        if last < first {
            return Err(NestedError::Unsupported {
                op: "flatten",
                reason: format!("end dim {end} precedes start dim {start}"),
            });
        }
        let axes = (first..=last)
            .map(|dim| self.static_axis_or_error(dim, "flatten"))
            .collect::<Result<Vec<_>>>()?;
        let volume: i64 = axes
            .iter()
            .map(|&axis| self.packed().size()[axis as usize])
            .product();
        let mut layout = self.lay().clone();
        for dim in (first..=last).rev() {
            layout = layout.without_dim(dim)?;
        }
        let layout = layout.with_static_dim(first, volume)?;
        let values = self.packed().f_flatten(axes[0], axes[axes.len() - 1])?;
        self.traced_as_new_tail(
            NestedTensor::from_parts(values, layout, self.options()),
            "flatten",
        )
    }

    /// Reshapes the static tail: elements `[*ragged, *static]` (ragged dims first)
    /// become `[*ragged, *tail]`, with one `-1` allowed in `tail`.
    pub fn reshape_tail(&self, tail: &[i64]) -> Result<NestedTensor> {
        let rows = self.lay().total_rows();
        let shape: Vec<i64> = std::iter::once(rows).chain(tail.iter().copied()).collect();
        let reshaped = self.packed().f_reshape(shape)?;
        let layout = self.lay();
        let ragged_first = layout
            .ragged_dims()
            .iter()
            .enumerate()
            .all(|(position, &dim)| position == dim);
        if !ragged_first {
            return Err(NestedError::Unsupported {
                op: "reshape_tail",
                reason: format!(
                    "the ragged dims {:?} must lead the elements",
                    layout.ragged_dims()
                ),
            });
        }
        let resolved = reshaped.size().split_off(1);
        let result = self.retail(&reshaped)?;
        result.traced(&[Arg::Nested(self)], "reshape_tail", |ids| {
            Op::ReshapeTail {
                x: ids[0],
                tail: resolved,
            }
        })
    }

    /// The values axis of static element dim `dim`, or an error naming the op.
    fn static_axis_or_error(&self, dim: usize, op: &'static str) -> Result<i64> {
        self.static_axis(dim)
            .ok_or_else(|| NestedError::Unsupported {
                op,
                reason: format!("element dim {dim} is ragged; only static dims can be reshaped"),
            })
    }

    /// Applies `f` to every element and packs the results with this batch's options. With
    /// `keep_ragged`, dims that were ragged stay ragged (where the result's rank allows)
    /// even if the results agree on their sizes; otherwise raggedness is inferred from
    /// the results. A per-element path.
    pub fn map_elements(
        &self,
        op: &'static str,
        keep_ragged: bool,
        f: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<NestedTensor> {
        self.untraceable(op)?;
        self.map_elements_eager(op, keep_ragged, f)
    }

    /// [`map_elements`](Self::map_elements) without the tracing check, for per-element
    /// operators that record themselves.
    pub(crate) fn map_elements_eager(
        &self,
        op: &'static str,
        keep_ragged: bool,
        f: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<NestedTensor> {
        slow_path(SlowPath::PerElement, op)?;
        if self.batch_size() == 0 {
            return Ok(self.shallow_clone());
        }
        let results = self.elements()?.iter().map(f).collect::<Result<Vec<_>>>()?;
        let rank = results.first().map_or(0, Tensor::dim);
        let ragged: Vec<usize> = if keep_ragged {
            self.lay()
                .ragged_dims()
                .iter()
                .copied()
                .filter(|&dim| dim < rank)
                .collect()
        } else {
            Vec::new()
        };
        NestedTensor::builder()
            .options(self.options())
            .ragged_dims(&ragged)
            .tensors(&results)
    }

    /// Packed rows of the elements, one index per row: the element that owns it.
    pub(crate) fn row_elements_tensor(&self) -> Result<Tensor> {
        Ok(Tensor::f_from_slice(&self.lay().row_elements())?.f_to_device(self.device())?)
    }

    /// A dense per-element tensor `[B, *tail]` broadcast to every packed row `[N, *tail]`.
    pub(crate) fn broadcast_per_element(&self, per_element: &Tensor) -> Result<Tensor> {
        let rows = self.row_elements_tensor()?;
        Ok(per_element.f_index_select(0, &rows)?)
    }
}

/// For every row of `swapped` (the layout with two ragged dims swapped by `swap`), the
/// row of `layout` that holds its values.
fn transposed_rows(
    layout: &RaggedLayout,
    swapped: &RaggedLayout,
    swap: &dyn Fn(usize) -> usize,
) -> Vec<i64> {
    let mut rows = Vec::with_capacity(swapped.total_rows() as usize);
    for (element, sizes) in layout.element_sizes().iter().enumerate() {
        let base = layout.offsets()[element];
        let extents: Vec<i64> = layout.ragged_dims().iter().map(|&dim| sizes[dim]).collect();
        let mut strides = vec![1i64; extents.len()];
        for level in (0..extents.len().saturating_sub(1)).rev() {
            strides[level] = strides[level + 1] * extents[level + 1];
        }
        // The new ragged dims in order, each read from the old level it came from.
        let levels: Vec<usize> = swapped
            .ragged_dims()
            .iter()
            .map(|&dim| {
                let old = swap(dim);
                layout
                    .ragged_dims()
                    .iter()
                    .position(|&d| d == old)
                    .unwrap_or(0)
            })
            .collect();
        let new_extents: Vec<i64> = levels.iter().map(|&level| extents[level]).collect();
        let count: i64 = new_extents.iter().product();
        for row in 0..count {
            let (mut rest, mut source) = (row, base);
            for (extent, &level) in new_extents.iter().zip(&levels).rev() {
                source += (rest % extent) * strides[level];
                rest /= extent;
            }
            rows.push(source);
        }
    }
    rows
}
