//! Reductions: over static dims on the packed values, over ragged dims by segment
//! (scatter over packed rows, no padding), over the batch dim, and over everything.

use nestor_layout::RaggedLayout;
use tch::{Kind, Tensor};

use nestor_ir::{Op, ReduceOp, ValueId};

use crate::dense::stack_same_shape;
use crate::trace::{Arg, Dense};
use crate::{NestedError, NestedTensor, Result};

/// A reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// Sum (integers and bools sum to i64).
    Sum,
    /// Arithmetic mean over the real elements.
    Mean,
    /// Largest value.
    Amax,
    /// Smallest value.
    Amin,
    /// `log(sum(exp(x)))`, computed stably.
    LogSumExp,
    /// Variance with Bessel's `correction` (1 for the unbiased estimate).
    Var {
        /// Subtracted from the count in the denominator.
        correction: i64,
    },
    /// Standard deviation with Bessel's `correction`.
    Std {
        /// Subtracted from the count in the denominator.
        correction: i64,
    },
    /// Whether every value is non-zero (bool).
    All,
    /// Whether any value is non-zero (bool).
    Any,
}

impl Reduce {
    /// The IR reduction and its Bessel correction.
    fn ir(self) -> (ReduceOp, i64) {
        match self {
            Reduce::Sum => (ReduceOp::Sum, 0),
            Reduce::Mean => (ReduceOp::Mean, 0),
            Reduce::Amax => (ReduceOp::Amax, 0),
            Reduce::Amin => (ReduceOp::Amin, 0),
            Reduce::LogSumExp => (ReduceOp::LogSumExp, 0),
            Reduce::Var { correction } => (ReduceOp::Var, correction),
            Reduce::Std { correction } => (ReduceOp::Std, correction),
            Reduce::All => (ReduceOp::All, 0),
            Reduce::Any => (ReduceOp::Any, 0),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Reduce::Sum => "sum",
            Reduce::Mean => "mean",
            Reduce::Amax => "amax",
            Reduce::Amin => "amin",
            Reduce::LogSumExp => "logsumexp",
            Reduce::Var { .. } => "var",
            Reduce::Std { .. } => "std",
            Reduce::All => "all",
            Reduce::Any => "any",
        }
    }
}

/// The result of a reduction: still ragged, or dense once no ragged dim is left.
#[derive(Debug)]
pub enum Reduced {
    /// Ragged dims remain.
    Nested(NestedTensor),
    /// No ragged dim remains: a dense tensor, batch first (`[B, ...]`), or without the
    /// batch dim when it was reduced too.
    Dense(Dense),
}

impl Reduced {
    /// The dense result as a tensor, or an error if ragged dims remain (a concrete
    /// read while tracing: use [`into_dense_handle`](Self::into_dense_handle) there).
    pub fn into_dense(self) -> Result<Tensor> {
        Ok(self.into_dense_handle()?.into_tensor())
    }

    /// The dense result as a [`Dense`] handle (which keeps tracing), or an error if
    /// ragged dims remain.
    pub fn into_dense_handle(self) -> Result<Dense> {
        match self {
            Reduced::Dense(dense) => Ok(dense),
            Reduced::Nested(nested) => Err(NestedError::Unsupported {
                op: "Reduced::into_dense",
                reason: format!("ragged dims {:?} remain", nested.lay().ragged_dims()),
            }),
        }
    }

    /// The ragged result, or an error if the result is dense.
    pub fn into_nested(self) -> Result<NestedTensor> {
        match self {
            Reduced::Nested(nested) => Ok(nested),
            Reduced::Dense(dense) => Err(NestedError::Unsupported {
                op: "Reduced::into_nested",
                reason: format!("the result is dense, of shape {:?}", dense.raw().size()),
            }),
        }
    }
}

/// How the packed rows and static axes of one NestedTensor reduce over some element dims.
struct Plan {
    /// Axes of the values (1 + static position) that are reduced.
    static_axes: Vec<i64>,
    /// For each packed row, its output row; `None` when no ragged dim is reduced.
    row_map: Option<Tensor>,
    /// Number of output rows.
    out_rows: i64,
    /// Input rows per output row.
    rows_per_out: Vec<i64>,
    /// Scalars per input row that the static axes fold together.
    static_volume: i64,
    /// The layout of the result.
    out_layout: RaggedLayout,
}

impl Plan {
    fn new(
        layout: &RaggedLayout,
        dims: &[usize],
        keepdim: bool,
        device: tch::Device,
    ) -> Result<Self> {
        let ragged: Vec<usize> = dims
            .iter()
            .copied()
            .filter(|&dim| layout.is_ragged(dim))
            .collect();
        let mut static_axes = Vec::new();
        let mut static_volume = 1;
        for (position, (&dim, &size)) in layout
            .static_dims()
            .iter()
            .zip(layout.static_sizes())
            .enumerate()
        {
            if dims.contains(&dim) {
                static_axes.push(1 + position as i64);
                static_volume *= size;
            }
        }
        let mut out_layout = layout.clone();
        for &dim in dims.iter().rev() {
            out_layout = out_layout.without_dim(dim)?;
        }
        if keepdim {
            for &dim in dims {
                out_layout = out_layout.with_static_dim(dim, 1)?;
            }
        }
        let out_rows = out_layout.total_rows();
        let (row_map, rows_per_out) = if ragged.is_empty() {
            (None, vec![1; out_rows as usize])
        } else {
            let map = layout.reduced_row_map(&ragged);
            let mut counts = vec![0i64; out_rows as usize];
            for &row in &map {
                counts[row as usize] += 1;
            }
            (
                Some(Tensor::f_from_slice(&map)?.f_to_device(device)?),
                counts,
            )
        };
        Ok(Self {
            static_axes,
            row_map,
            out_rows,
            rows_per_out,
            static_volume,
            out_layout,
        })
    }

    /// Output rows with no input, by the element that owns them.
    fn first_empty_element(&self) -> Option<usize> {
        let owners = self.out_layout.row_elements();
        let empty_row = self.rows_per_out.iter().position(|&count| count == 0);
        let empty_static = self.static_volume == 0 && self.out_rows > 0;
        match (empty_row, empty_static) {
            (Some(row), _) => Some(owners[row] as usize),
            (None, true) => Some(0),
            (None, false) => None,
        }
    }

    /// Sums over the reduced static axes (kept as size 1) and rows. Half-precision
    /// values add up in f32 and round once, as torch's own sums do (an `index_add` in
    /// bf16 would round after every row).
    fn sum(&self, values: &Tensor) -> Result<Tensor> {
        if matches!(values.kind(), Kind::Half | Kind::BFloat16) && self.row_map.is_some() {
            return Ok(self
                .sum(&values.f_to_kind(Kind::Float)?)?
                .f_to_kind(values.kind())?);
        }
        let values = if values.kind() == Kind::Bool || !values.is_floating_point() {
            values.f_to_kind(Kind::Int64)?
        } else {
            values.shallow_clone()
        };
        let folded = if self.static_axes.is_empty() {
            values
        } else {
            values.f_sum_dim_intlist(self.static_axes.as_slice(), true, None::<Kind>)?
        };
        match &self.row_map {
            None => Ok(folded),
            Some(map) => {
                let mut shape = folded.size();
                shape[0] = self.out_rows;
                Ok(Tensor::f_zeros(&shape, (folded.kind(), folded.device()))?
                    .f_index_add(0, map, &folded)?)
            }
        }
    }

    /// Largest (`"amax"`) or smallest (`"amin"`) value over the reduced axes and rows;
    /// output rows with no input hold `empty`.
    fn extreme(&self, values: &Tensor, reduce: &str, empty: f64) -> Result<Tensor> {
        let folded = if self.static_axes.is_empty() {
            values.shallow_clone()
        } else if reduce == "amax" {
            values.f_amax(self.static_axes.as_slice(), true)?
        } else {
            values.f_amin(self.static_axes.as_slice(), true)?
        };
        match &self.row_map {
            None => Ok(folded),
            Some(map) => {
                let mut shape = folded.size();
                shape[0] = self.out_rows;
                let initial = Tensor::f_full(&shape, empty, (folded.kind(), folded.device()))?;
                Ok(initial.f_index_reduce(0, map, &folded, reduce, false)?)
            }
        }
    }

    /// The row map broadcast to the shape of `like`, for scatters.
    fn expand_map(&self, map: &Tensor, like: &Tensor) -> Result<Tensor> {
        let mut view = vec![1i64; like.dim()];
        view[0] = -1;
        Ok(map.f_view(view.as_slice())?.f_expand(like.size(), false)?)
    }

    /// A per-output-row result (keepdim form) broadcast back to the input rows.
    fn gather(&self, per_out: &Tensor) -> Result<Tensor> {
        match &self.row_map {
            None => Ok(per_out.shallow_clone()),
            Some(map) => Ok(per_out.f_index_select(0, map)?),
        }
    }

    /// The number of scalars folded into each output row, shaped to broadcast.
    fn counts(&self, like: &Tensor) -> Result<Tensor> {
        let counts: Vec<f64> = self
            .rows_per_out
            .iter()
            .map(|&rows| (rows * self.static_volume) as f64)
            .collect();
        let mut view = vec![1i64; like.dim()];
        view[0] = self.out_rows;
        Ok(Tensor::f_from_slice(&counts)?
            .f_to_device(like.device())?
            .f_view(view.as_slice())?)
    }

    fn run(&self, op: Reduce, values: &Tensor) -> Result<Tensor> {
        let float = |tensor: Tensor| -> Result<Tensor> {
            Ok(if tensor.is_floating_point() {
                tensor
            } else {
                tensor.f_to_kind(Kind::Float)?
            })
        };
        Ok(match op {
            Reduce::Sum => self.sum(values)?,
            Reduce::Mean => {
                let sum = float(self.sum(values)?)?;
                let counts = self.counts(&sum)?.f_to_kind(sum.kind())?;
                sum.f_div(&counts)?
            }
            Reduce::Amax => self.extreme(values, "amax", 0.0)?,
            Reduce::Amin => self.extreme(values, "amin", 0.0)?,
            Reduce::All | Reduce::Any => {
                let truth = values.f_ne(0)?.f_to_kind(Kind::Int64)?;
                let (reduce, empty) = if op == Reduce::All {
                    ("amin", 1.0)
                } else {
                    ("amax", 0.0)
                };
                self.extreme(&truth, reduce, empty)?.f_to_kind(Kind::Bool)?
            }
            Reduce::LogSumExp => {
                let values = float(values.shallow_clone())?;
                let max = self.extreme(&values, "amax", f64::NEG_INFINITY)?;
                let shift = max.f_where_scalarother(&max.f_isfinite()?, 0.0)?;
                let sum = self.sum(&values.f_sub(&self.gather(&shift)?)?.f_exp()?)?;
                sum.f_log()?.f_add(&shift)?
            }
            Reduce::Var { correction } | Reduce::Std { correction } => {
                let values = float(values.shallow_clone())?;
                let counts = self.counts(&values)?.f_to_kind(values.kind())?;
                let mean = self.sum(&values)?.f_div(&counts)?;
                let deviation = values.f_sub(&self.gather(&mean)?)?;
                let variance = self
                    .sum(&deviation.f_square()?)?
                    .f_div(&counts.f_sub_scalar(correction)?)?;
                // Nothing to average: NaN as in torch (not 0 / (0 - correction)).
                let variance = variance.f_where_self(
                    &counts.f_ne(0)?,
                    &Tensor::f_scalar_tensor(f64::NAN, (variance.kind(), variance.device()))?,
                )?;
                if matches!(op, Reduce::Std { .. }) {
                    variance.f_sqrt()?
                } else {
                    variance
                }
            }
        })
    }
}

impl NestedTensor {
    /// Reduces over `dims` (NestedTensor dims; negative count from the end; the batch
    /// dim allowed; an empty list means every dim). Static dims reduce on the packed
    /// values, ragged dims by segment. The batch dim alone reduces every element over
    /// all its dims, as DanLing does (`[B]`, or `[B, 1, ..., 1]` with `keepdim`, which
    /// broadcasts back per element); the batch dim with element dims reduces those
    /// first, then across the per-element results (which must then share a shape).
    /// The result is dense once no ragged dim is left.
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let batch = NestedTensor::from_lists(vec![vec![1.0f32, 2.0, 3.0], vec![4.0, 6.0]])?;
    /// let means = batch.mean(&[1], false)?.into_dense()?; // over the ragged dim
    /// assert_eq!(Vec::<f32>::try_from(&means)?, [2.0, 5.0]);
    /// let total = batch.sum(&[], false)?.into_dense()?;
    /// assert_eq!(total.double_value(&[]), 16.0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reduce(&self, op: Reduce, dims: &[i64], keepdim: bool) -> Result<Reduced> {
        if let Some(every_element_dim) = self.batch_dim_alone(dims)? {
            return self.reduce(op, &every_element_dim, keepdim);
        }
        let result = self.reduce_eager(op, dims, keepdim)?;
        self.traced_reduction(result, (op.ir(), op.name()), dims, keepdim)
    }

    /// `result`, the reduction `ir` (with its correction; `name` for errors) of this
    /// batch over `dims`, recorded when tracing.
    fn traced_reduction(
        &self,
        result: Reduced,
        ((ir, correction), name): ((ReduceOp, i64), &'static str),
        dims: &[i64],
        keepdim: bool,
    ) -> Result<Reduced> {
        if self.trace.is_none() {
            return Ok(result);
        }
        let ir_dims = self.ir_dims(dims)?;
        self.traced_reduced(result, name, &|x| Op::Reduce {
            op: ir,
            x,
            dims: ir_dims.clone(),
            keepdim,
            correction,
        })
    }

    /// `result`, computed from this batch, recorded as `build(this batch)` when tracing
    /// (`name` for errors).
    pub(crate) fn traced_reduced(
        &self,
        result: Reduced,
        name: &'static str,
        build: &dyn Fn(ValueId) -> Op,
    ) -> Result<Reduced> {
        if self.trace.is_none() {
            return Ok(result);
        }
        let build = |ids: &[ValueId]| build(ids[0]);
        let args = [Arg::Nested(self)];
        Ok(match result {
            Reduced::Nested(nested) => Reduced::Nested(nested.traced(&args, name, build)?),
            Reduced::Dense(dense) => Reduced::Dense(Dense::traced(
                dense.raw().shallow_clone(),
                &args,
                name,
                build,
            )?),
        })
    }

    fn reduce_eager(&self, op: Reduce, dims: &[i64], keepdim: bool) -> Result<Reduced> {
        let ndim = self.dim();
        let mut normalized = dims
            .iter()
            .map(|&dim| self.normalize_dim(dim))
            .collect::<Result<Vec<_>>>()?;
        normalized.sort_unstable();
        normalized.dedup();
        if normalized.is_empty() || normalized.len() == ndim {
            return self.reduce_all(op, keepdim);
        }
        let batch_dim = self.batch_dim();
        let over_batch = normalized.contains(&batch_dim);
        let element_dims: Vec<usize> = normalized
            .iter()
            .filter(|&&dim| dim != batch_dim)
            .map(|&dim| if dim > batch_dim { dim - 1 } else { dim })
            .collect();
        if over_batch {
            return self.reduce_with_batch(op, &element_dims, keepdim);
        }
        let plan = Plan::new(self.lay(), &element_dims, keepdim, self.device())?;
        if matches!(op, Reduce::Amax | Reduce::Amin) {
            if let Some(element) = plan.first_empty_element() {
                return Err(NestedError::EmptyReduction {
                    op: op.name(),
                    element,
                });
            }
        }
        let values = plan
            .run(op, self.packed())?
            .f_reshape(plan.out_layout.packed_shape())?;
        Ok(self.wrap_reduced(values, plan.out_layout))
    }

    /// `op` over element dims `dims`, kept as size 1, as a NestedTensor even when no
    /// ragged dim is left (global pooling keeps images as `[C, 1, 1]` elements).
    pub(crate) fn reduce_keeping_layout(&self, op: Reduce, dims: &[usize]) -> Result<NestedTensor> {
        let plan = Plan::new(self.lay(), dims, true, self.device())?;
        let values = plan
            .run(op, self.packed())?
            .f_reshape(plan.out_layout.packed_shape())?;
        Ok(NestedTensor::from_parts(
            values,
            plan.out_layout,
            self.options(),
        ))
    }

    /// A result in `layout`: nested while ragged dims remain, else the dense `[B, ...]`.
    pub(crate) fn wrap_reduced(&self, values: Tensor, layout: RaggedLayout) -> Reduced {
        if layout.ragged_dims().is_empty() {
            Reduced::Dense(Dense::from(values))
        } else {
            Reduced::Nested(NestedTensor::from_parts(values, layout, self.options()))
        }
    }

    fn reduce_all(&self, op: Reduce, keepdim: bool) -> Result<Reduced> {
        let layout = self.lay();
        let every_dim: Vec<usize> = (0..layout.rank()).collect();
        // Reduce every element dim, then the batch dim: exact for every reduction,
        // since the mean and variance below are computed over all real values at once.
        let values = self.packed();
        let result = match op {
            // One sum over every value rounds once, as torch's over the elements does
            // (summing per-element sums rounds twice in low precision).
            Reduce::Sum => values.f_sum(None::<Kind>)?,
            Reduce::Mean if values.is_floating_point() => values.f_mean(None::<Kind>)?,
            Reduce::Mean => values.f_mean(Kind::Float)?,
            Reduce::Var { correction } => {
                values.f_var_correction(None::<&[i64]>, correction, false)?
            }
            Reduce::Std { correction } => {
                values.f_std_correction(None::<&[i64]>, correction, false)?
            }
            _ => {
                let plan = Plan::new(layout, &every_dim, false, self.device())?;
                let per_element = plan.run(op, values)?.f_reshape([-1])?;
                dense_reduce(op, &per_element, 0, false)?
            }
        };
        if values.numel() == 0 && matches!(op, Reduce::Amax | Reduce::Amin) {
            return Err(NestedError::EmptyReduction {
                op: op.name(),
                element: 0,
            });
        }
        let result = if keepdim {
            result.f_reshape(vec![1i64; self.dim()])?
        } else {
            result
        };
        Ok(Reduced::Dense(Dense::from(result)))
    }

    fn reduce_with_batch(
        &self,
        op: Reduce,
        element_dims: &[usize],
        keepdim: bool,
    ) -> Result<Reduced> {
        match op {
            Reduce::Mean => {
                let sum = self.reduce_with_batch(Reduce::Sum, element_dims, keepdim)?.into_dense()?;
                let sum = if sum.is_floating_point() { sum } else { sum.f_to_kind(Kind::Float)? };
                let kept_volume: i64 = sum.numel() as i64;
                Ok(Reduced::Dense(Dense::from(sum.f_div_scalar(self.numel() as f64 / kept_volume.max(1) as f64)?)))
            }
            Reduce::Var { .. } | Reduce::Std { .. } if !element_dims.is_empty() => Err(NestedError::Unsupported {
                op: op.name(),
                reason: "over the batch dim together with element dims; reduce over all dims or the batch dim alone".into(),
            }),
            _ => {
                let per_element = if element_dims.is_empty() {
                    self.stacked_elements(op.name())?
                } else {
                    match self.reduce(op, &element_dims_as_nested(self, element_dims), keepdim)? {
                        Reduced::Dense(dense) => dense.raw().shallow_clone(),
                        Reduced::Nested(nested) => nested.stacked_elements(op.name())?,
                    }
                };
                Ok(Reduced::Dense(Dense::from(dense_reduce(op, &per_element, 0, keepdim)?)))
            }
        }
    }

    /// When `dims` names the batch dim alone (of elements of rank at least 1): every
    /// element dim, as NestedTensor dims, which is what DanLing reduces over then.
    fn batch_dim_alone(&self, dims: &[i64]) -> Result<Option<Vec<i64>>> {
        let rank = self.lay().rank();
        let [dim] = dims else { return Ok(None) };
        if rank == 0 || self.normalize_dim(*dim)? != self.batch_dim() {
            return Ok(None);
        }
        let every: Vec<usize> = (0..rank).collect();
        Ok(Some(element_dims_as_nested(self, &every)))
    }

    /// For every packed scalar, its position in its element read in row-major order
    /// (i64, the packed shape): what `argmax` of a whole element returns.
    fn flat_positions(&self) -> Result<Tensor> {
        let layout = self.lay();
        let device = self.device();
        let owners = layout.row_elements();
        // Row-major strides of every element dim, per element.
        let strides: Vec<Vec<i64>> = layout
            .element_sizes()
            .iter()
            .map(|sizes| {
                let mut strides = vec![1i64; sizes.len()];
                for dim in (0..sizes.len().saturating_sub(1)).rev() {
                    strides[dim] = strides[dim + 1] * sizes[dim + 1];
                }
                strides
            })
            .collect();
        let per_row = |dim: usize| -> Vec<i64> {
            owners
                .iter()
                .map(|&element| strides[element as usize][dim])
                .collect()
        };
        let mut base = vec![0i64; owners.len()];
        for &dim in layout.ragged_dims() {
            let coordinates = layout.row_coordinates(dim);
            for ((base, coordinate), stride) in base.iter_mut().zip(coordinates).zip(per_row(dim)) {
                *base += coordinate * stride;
            }
        }
        let axes = layout.static_dims().len();
        let mut view = vec![1i64; axes + 1];
        view[0] = -1;
        let mut positions = Tensor::f_from_slice(&base)?
            .f_to_device(device)?
            .f_view(view.as_slice())?;
        for (axis, (&dim, &size)) in layout
            .static_dims()
            .iter()
            .zip(layout.static_sizes())
            .enumerate()
        {
            let stride = Tensor::f_from_slice(&per_row(dim))?
                .f_to_device(device)?
                .f_view(view.as_slice())?;
            let mut along = vec![1i64; axes + 1];
            along[axis + 1] = size;
            let coordinate =
                Tensor::f_arange(size, (Kind::Int64, device))?.f_view(along.as_slice())?;
            positions = positions.f_add(&stride.f_mul(&coordinate)?)?;
        }
        Ok(positions
            .f_expand(self.packed().size(), false)?
            .f_contiguous()?)
    }

    /// The largest or smallest value of every element and its first flat position.
    fn extreme_per_element(&self, largest: bool, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let op = if largest { "max" } else { "min" };
        let every: Vec<usize> = (0..self.lay().rank()).collect();
        let plan = Plan::new(self.lay(), &every, false, self.device())?;
        if let Some(element) = plan.first_empty_element() {
            return Err(NestedError::EmptyReduction { op, element });
        }
        let values = self.packed();
        let rows = values.size()[0];
        let flat = values.f_reshape([rows, -1])?;
        let extreme = plan.extreme(values, if largest { "amax" } else { "amin" }, 0.0)?;
        let per_row = plan.gather(&extreme)?.f_reshape([rows, 1])?;
        let hits = extreme_hits(&flat, &per_row)?;
        let positions = self.flat_positions()?.f_reshape([rows, -1])?;
        let candidates = positions
            .f_where_scalarother(&hits, i64::MAX)?
            .f_amin([1].as_slice(), false)?;
        let batch = self.batch_size() as i64;
        let owners = self.row_elements_tensor()?;
        let indices = Tensor::f_full([batch], i64::MAX, (Kind::Int64, self.device()))?
            .f_index_reduce(0, &owners, &candidates, "amin", false)?;
        let mut shape = vec![batch];
        if keepdim {
            shape.extend(std::iter::repeat_n(1, self.lay().rank()));
        }
        Ok((extreme.f_reshape(&shape)?, indices.f_reshape(&shape)?))
    }

    /// The elements stacked into `[B, ...]`; they must share a shape.
    fn stacked_elements(&self, op: &'static str) -> Result<Tensor> {
        match stack_same_shape(&self.elements()?, op)? {
            Some(stacked) => Ok(stacked),
            None => Err(NestedError::Unsupported {
                op,
                reason: "an empty batch has no elements to stack".into(),
            }),
        }
    }

    /// Largest value and its index along one dim (static, ragged or the batch dim:
    /// then every element's largest value and its row-major position in the element).
    /// The value's gradient goes to that one position (`amax` shares it among equal
    /// values). Compiled along a ragged dim (values, positions and the gradient) or the
    /// last static one (values and positions).
    pub fn max_dim(&self, dim: i64, keepdim: bool) -> Result<(Reduced, Reduced)> {
        self.extreme_dim(dim, keepdim, true)
    }

    /// Smallest value and its index along one dim (as [`max_dim`](Self::max_dim)).
    pub fn min_dim(&self, dim: i64, keepdim: bool) -> Result<(Reduced, Reduced)> {
        self.extreme_dim(dim, keepdim, false)
    }

    /// Index (i64) of the largest value along one dim: its first, or its first NaN
    /// (compiled along a ragged dim or the last static one).
    pub fn argmax(&self, dim: i64, keepdim: bool) -> Result<Reduced> {
        self.position_of_extreme(dim, keepdim, true)
    }

    /// Index of the smallest value along one dim (as [`argmax`](Self::argmax)).
    pub fn argmin(&self, dim: i64, keepdim: bool) -> Result<Reduced> {
        self.position_of_extreme(dim, keepdim, false)
    }

    /// argmax or argmin (not `largest`), recorded when tracing (but along the batch dim,
    /// which gives each element's flat position).
    fn position_of_extreme(&self, dim: i64, keepdim: bool, largest: bool) -> Result<Reduced> {
        let (ir, name) = match largest {
            true => (ReduceOp::Argmax, "argmax"),
            false => (ReduceOp::Argmin, "argmin"),
        };
        if self.normalize_dim(dim)? == self.batch_dim() {
            self.untraceable(name)?;
        }
        let positions = self.extreme_dim_eager(dim, keepdim, (largest, name))?.1;
        self.traced_reduction(positions, ((ir, 0), name), &[dim], keepdim)
    }

    fn extreme_dim(&self, dim: i64, keepdim: bool, largest: bool) -> Result<(Reduced, Reduced)> {
        let (op, positions) = match largest {
            true => (ReduceOp::Max, ReduceOp::Argmax),
            false => (ReduceOp::Min, ReduceOp::Argmin),
        };
        if self.normalize_dim(dim)? == self.batch_dim() {
            self.untraceable(op.word())?;
        }
        let (values, at) = self.extreme_dim_eager(dim, keepdim, (largest, op.word()))?;
        Ok((
            self.traced_reduction(values, ((op, 0), op.word()), &[dim], keepdim)?,
            self.traced_reduction(at, ((positions, 0), positions.word()), &[dim], keepdim)?,
        ))
    }

    /// The extreme values along `dim` and their positions, computed eagerly (`op`
    /// names the operation in errors).
    fn extreme_dim_eager(
        &self,
        dim: i64,
        keepdim: bool,
        (largest, op): (bool, &'static str),
    ) -> Result<(Reduced, Reduced)> {
        let normalized = self.normalize_dim(dim)?;
        if normalized == self.batch_dim() {
            let (values, indices) = self.extreme_per_element(largest, keepdim)?;
            return Ok((
                Reduced::Dense(Dense::from(values)),
                Reduced::Dense(Dense::from(indices)),
            ));
        }
        let element_dim = self.element_dim(dim, op)?;
        let plan = Plan::new(self.lay(), &[element_dim], keepdim, self.device())?;
        if let Some(element) = plan.first_empty_element() {
            return Err(NestedError::EmptyReduction { op, element });
        }
        let layout = self.lay();
        let (values, indices) = match &plan.row_map {
            None => {
                let axis = plan.static_axes[0];
                let values = self.packed();
                if largest {
                    values.f_max_dim(axis, true)?
                } else {
                    values.f_min_dim(axis, true)?
                }
            }
            Some(map) => {
                let values = self.packed();
                let extreme = plan.extreme(values, if largest { "amax" } else { "amin" }, 0.0)?;
                // The first packed row of each output's rows that holds the extreme value
                // (an output's rows differ only along the dim, in packed order).
                let device = self.device();
                let rows = Tensor::f_arange(values.size()[0], (Kind::Int64, device))?;
                let rows = plan.expand_map(&rows, values)?;
                let hits = extreme_hits(values, &plan.gather(&extreme)?)?;
                let candidates = rows.f_where_scalarother(&hits, i64::MAX)?;
                let initial = Tensor::f_full(extreme.size(), i64::MAX, (Kind::Int64, device))?;
                let first = initial.f_index_reduce(0, map, &candidates, "amin", false)?;
                let coordinates = Tensor::f_from_slice(&layout.row_coordinates(element_dim))?
                    .f_to_device(device)?;
                let coordinates = plan.expand_map(&coordinates, values)?;
                // The values taken at those rows: their gradient goes there alone, as
                // torch's max(dim) on each element.
                (
                    values.f_gather(0, &first, false)?,
                    coordinates.f_gather(0, &first, false)?,
                )
            }
        };
        let shape = plan.out_layout.packed_shape();
        Ok((
            self.wrap_reduced(values.f_reshape(&shape)?, plan.out_layout.clone()),
            self.wrap_reduced(indices.f_reshape(&shape)?, plan.out_layout),
        ))
    }
}

/// Where `values` hold their slice's `extreme` (broadcast against them): equal to it, or
/// NaN where it is NaN (NaN is the extreme of a slice that holds one, as in torch).
fn extreme_hits(values: &Tensor, extreme: &Tensor) -> Result<Tensor> {
    Ok(values
        .f_eq_tensor(extreme)?
        .f_logical_or(&values.f_isnan()?.f_logical_and(&extreme.f_isnan()?)?)?)
}

/// Element dims as NestedTensor dims of a batch-first view (for recursive calls).
fn element_dims_as_nested(nested: &NestedTensor, element_dims: &[usize]) -> Vec<i64> {
    let batch_dim = nested.batch_dim();
    element_dims
        .iter()
        .map(|&dim| {
            if dim >= batch_dim {
                dim as i64 + 1
            } else {
                dim as i64
            }
        })
        .collect()
}

/// A reduction of a dense tensor along one dim.
fn dense_reduce(op: Reduce, tensor: &Tensor, dim: i64, keepdim: bool) -> Result<Tensor> {
    let dims = [dim];
    Ok(match op {
        Reduce::Sum => tensor.f_sum_dim_intlist(dims.as_slice(), keepdim, None::<Kind>)?,
        Reduce::Mean => tensor.f_mean_dim(dims.as_slice(), keepdim, None::<Kind>)?,
        Reduce::Amax => tensor.f_amax(dims.as_slice(), keepdim)?,
        Reduce::Amin => tensor.f_amin(dims.as_slice(), keepdim)?,
        Reduce::LogSumExp => tensor.f_logsumexp(dims.as_slice(), keepdim)?,
        Reduce::Var { correction } => {
            tensor.f_var_correction(dims.as_slice(), correction, keepdim)?
        }
        Reduce::Std { correction } => {
            tensor.f_std_correction(dims.as_slice(), correction, keepdim)?
        }
        Reduce::All => tensor.f_all_dim(dim, keepdim)?,
        Reduce::Any => tensor.f_any_dim(dim, keepdim)?,
    })
}

macro_rules! reductions {
    ($($(#[$doc:meta])* $name:ident => $op:expr;)*) => {
        impl NestedTensor {$(
            $(#[$doc])*
            ///
            /// See [`reduce`](Self::reduce) for `dims` and the result.
            pub fn $name(&self, dims: &[i64], keepdim: bool) -> Result<Reduced> {
                self.reduce($op, dims, keepdim)
            }
        )*}
    };
}

reductions! {
    /// Sum over `dims`.
    sum => Reduce::Sum;
    /// Mean over `dims`, counting only real elements.
    mean => Reduce::Mean;
    /// Largest value over `dims`.
    amax => Reduce::Amax;
    /// Smallest value over `dims`.
    amin => Reduce::Amin;
    /// `log(sum(exp(x)))` over `dims`.
    logsumexp => Reduce::LogSumExp;
    /// Whether every value over `dims` is non-zero.
    all => Reduce::All;
    /// Whether any value over `dims` is non-zero.
    any => Reduce::Any;
}

impl NestedTensor {
    /// Variance over `dims` with Bessel's `correction` (see [`reduce`](Self::reduce)).
    pub fn var(&self, dims: &[i64], correction: i64, keepdim: bool) -> Result<Reduced> {
        self.reduce(Reduce::Var { correction }, dims, keepdim)
    }

    /// Standard deviation over `dims` with Bessel's `correction`.
    pub fn std(&self, dims: &[i64], correction: i64, keepdim: bool) -> Result<Reduced> {
        self.reduce(Reduce::Std { correction }, dims, keepdim)
    }
}
