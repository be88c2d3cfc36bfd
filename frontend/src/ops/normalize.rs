//! softmax / log_softmax (packed over static dims, segmented over ragged dims),
//! layer_norm and rms_norm over a static tail, batch_norm over all real elements,
//! dropout.

use tch::{Kind, Tensor};

use nestor_ir::{Op, F64};

use crate::trace::{check_dtype, record_with, Arg, RunningStatistics};
use crate::{NestedError, NestedTensor, Result};

impl NestedTensor {
    /// Softmax along `dim`: on the packed values for a static dim, by segment (each
    /// element on its own, no padding) for a ragged dim. The batch dim is an error.
    pub fn softmax(&self, dim: i64) -> Result<NestedTensor> {
        self.softmax_traced(dim, false)
    }

    /// Log-softmax along `dim` (see [`softmax`](Self::softmax)).
    pub fn log_softmax(&self, dim: i64) -> Result<NestedTensor> {
        self.softmax_traced(dim, true)
    }

    fn softmax_traced(&self, dim: i64, log: bool) -> Result<NestedTensor> {
        let op = if log { "log_softmax" } else { "softmax" };
        let axis = self.ir_dims(&[dim])?[0];
        self.softmax_like(dim, log)?
            .traced(&[Arg::Nested(self)], op, |ids| Op::Softmax {
                x: ids[0],
                axis,
                log,
            })
    }

    fn softmax_like(&self, dim: i64, log: bool) -> Result<NestedTensor> {
        let op = if log { "log_softmax" } else { "softmax" };
        let element_dim = self.element_dim(dim, op)?;
        let layout = self.lay();
        let values = self.packed();
        if let Some(axis) = self.static_axis(element_dim) {
            let result = if log {
                values.f_log_softmax(axis, None::<Kind>)?
            } else {
                values.f_softmax(axis, None::<Kind>)?
            };
            return Ok(self.with_values(result));
        }
        // Segmented: every output row of the reduction over `element_dim` is one softmax group.
        let map = layout.reduced_row_map(&[element_dim]);
        let groups = map.iter().max().map_or(0, |&last| last + 1);
        let map = Tensor::f_from_slice(&map)?.f_to_device(self.device())?;
        let values = if values.is_floating_point() {
            values.shallow_clone()
        } else {
            values.f_to_kind(Kind::Float)?
        };
        let mut shape = values.size();
        shape[0] = groups;
        let initial = Tensor::f_full(&shape, f64::NEG_INFINITY, (values.kind(), values.device()))?;
        let max = initial
            .f_index_reduce(0, &map, &values, "amax", false)?
            .f_detach()?;
        let shifted = values.f_sub(&max.f_index_select(0, &map)?)?;
        let exp = shifted.f_exp()?;
        let sum = Tensor::f_zeros(&shape, (values.kind(), values.device()))?
            .f_index_add(0, &map, &exp)?;
        let result = if log {
            shifted.f_sub(&sum.f_log()?.f_index_select(0, &map)?)?
        } else {
            exp.f_div(&sum.f_index_select(0, &map)?)?
        };
        Ok(self.with_values(result))
    }

    /// The values axis of element dim `dim` if it is static.
    pub(crate) fn static_axis(&self, dim: usize) -> Option<i64> {
        self.lay()
            .static_dims()
            .iter()
            .position(|&d| d == dim)
            .map(|position| position as i64 + 1)
    }

    /// Checks that the last `count` element dims are static (so they are the last axes
    /// of the values) and equal `expected`.
    fn check_static_tail(&self, op: &'static str, expected: &[i64]) -> Result<()> {
        let layout = self.lay();
        let rank = layout.rank();
        let count = expected.len();
        let tail_is_static =
            count <= rank && (rank - count..rank).all(|dim| !layout.is_ragged(dim));
        let actual: Vec<i64> = layout
            .static_sizes()
            .iter()
            .rev()
            .take(count)
            .rev()
            .copied()
            .collect();
        if tail_is_static && actual == expected {
            return Ok(());
        }
        Err(NestedError::DenseOperand {
            op,
            shape: expected.to_vec(),
            reason: format!(
                "(the normalized shape must be the static tail of the elements; static sizes {:?}, ragged dims {:?})",
                layout.static_sizes(),
                layout.ragged_dims()
            ),
        })
    }

    /// Layer normalization over the trailing `normalized_shape`, which must be a static
    /// tail of the elements; on the packed values.
    pub fn layer_norm(
        &self,
        normalized_shape: &[i64],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<NestedTensor> {
        self.check_static_tail("layer_norm", normalized_shape)?;
        let result = self.with_values(self.packed().f_layer_norm(
            normalized_shape,
            weight,
            bias,
            eps,
            true,
        )?);
        let mut args = vec![Arg::Nested(self)];
        args.extend(weight.map(|weight| Arg::Dense(weight, None)));
        args.extend(bias.map(|bias| Arg::Dense(bias, None)));
        let (has_weight, has_bias) = (weight.is_some(), bias.is_some());
        let dims = normalized_shape.len();
        result.traced(&args, "layer_norm", |ids| Op::LayerNorm {
            x: ids[0],
            weight: has_weight.then(|| ids[1]),
            bias: has_bias.then(|| ids[if has_weight { 2 } else { 1 }]),
            dims,
            eps: F64(eps),
        })
    }

    /// RMS normalization over the trailing `normalized_shape` (a static tail).
    pub fn rms_norm(
        &self,
        normalized_shape: &[i64],
        weight: Option<&Tensor>,
        eps: Option<f64>,
    ) -> Result<NestedTensor> {
        self.check_static_tail("rms_norm", normalized_shape)?;
        let result = self.with_values(self.packed().f_rms_norm(normalized_shape, weight, eps)?);
        let mut args = vec![Arg::Nested(self)];
        args.extend(weight.map(|weight| Arg::Dense(weight, None)));
        let dims = normalized_shape.len();
        // torch's default epsilon is the machine epsilon of the dtype.
        let eps = eps.unwrap_or(f64::from(f32::EPSILON));
        result.traced(&args, "rms_norm", |ids| Op::RmsNorm {
            x: ids[0],
            weight: ids.get(1).copied(),
            dims,
            eps: F64(eps),
        })
    }

    /// Batch normalization over channel dim `channel_dim` (a static NestedTensor dim),
    /// with statistics over every real element (padding never counts). In training
    /// mode the batch's statistics normalize it and update the running ones (when
    /// given) as in torch: `running = (1 - momentum) * running + momentum * batch`, the
    /// variance unbiased. In eval mode the running statistics normalize it.
    ///
    /// Traced and compiled: a compiled training-mode call updates the running
    /// statistics after it runs (tracing itself leaves them alone, so a compiled call
    /// updates them once, as an eager one does).
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let images = NestedTensor::builder().ragged_dims(&[1, 2]).tensors(&[
    ///     Tensor::randn([3, 4, 5], (Kind::Float, Device::Cpu)),
    ///     Tensor::randn([3, 2, 6], (Kind::Float, Device::Cpu)),
    /// ])?;
    /// let (mean, var) = (Tensor::zeros([3], (Kind::Float, Device::Cpu)), Tensor::ones([3], (Kind::Float, Device::Cpu)));
    /// let normalized = images.batch_norm(1, Some(&mean), Some(&var), None, None, true, 0.1, 1e-5)?;
    /// assert_eq!(normalized.values().size(), images.values().size());
    /// assert!(mean.abs().sum(Kind::Float).double_value(&[]) > 0.0); // updated
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn batch_norm(
        &self,
        channel_dim: i64,
        running_mean: Option<&Tensor>,
        running_var: Option<&Tensor>,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        training: bool,
        momentum: f64,
        eps: f64,
    ) -> Result<NestedTensor> {
        let channel = self.element_dim(channel_dim, "batch_norm")?;
        let Some(axis) = self.static_axis(channel) else {
            return Err(NestedError::Unsupported {
                op: "batch_norm",
                reason: format!("the channel dim {channel_dim} is ragged; it must be static"),
            });
        };
        // A trace's graph updates the running statistics when it runs; tracing does not
        // (compile's first call traces and runs).
        let tracing = self.trace.is_some();
        let (eager_mean, eager_var) = match tracing && training {
            true => (None, None),
            false => (running_mean, running_var),
        };
        // torch's batch_norm takes channels at axis 1 of [N, C, *].
        let moved = self.packed().f_movedim(axis, 1)?;
        let normalized = Tensor::f_batch_norm(
            &moved, weight, bias, eager_mean, eager_var, training, momentum, eps, true,
        )?;
        let mut result = self.with_values(normalized.f_movedim(1, axis)?);
        if !tracing {
            return Ok(result);
        }
        // Eval mode normalizes by the running statistics (the eager call checked that
        // they are given), training mode by the batch's.
        let given = match (training, running_mean, running_var) {
            (false, Some(mean), Some(var)) => Some((mean, var)),
            _ => None,
        };
        let mut args = vec![Arg::Nested(self)];
        if let Some((mean, var)) = given {
            args.extend([Arg::Dense(mean, None), Arg::Dense(var, None)]);
        }
        args.extend(weight.map(|weight| Arg::Dense(weight, None)));
        args.extend(bias.map(|bias| Arg::Dense(bias, None)));
        let (has_weight, has_bias) = (weight.is_some(), bias.is_some());
        let mut batch = None;
        let traced = record_with(&args, "batch_norm", |graph, ids| {
            let (mean, var, affine) = match given {
                Some(_) => (ids[1], ids[2], &ids[3..]),
                None => {
                    let statistics = nestor_passes::batch_statistics(graph, ids[0], channel)?;
                    batch = Some(statistics);
                    (statistics.mean, statistics.var, &ids[1..])
                }
            };
            graph.push(Op::BatchNorm {
                x: ids[0],
                mean,
                var,
                weight: has_weight.then(|| affine[0]),
                bias: has_bias.then(|| affine[usize::from(has_weight)]),
                channel,
                eps: F64(eps),
            })
        })?;
        if let Some(trace) = traced {
            check_dtype(&trace, result.packed().kind(), "batch_norm")?;
            if let (Some(batch), Some(mean), Some(var)) = (batch, running_mean, running_var) {
                trace.lock().running.push(RunningStatistics {
                    mean: mean.shallow_clone(),
                    var: var.shallow_clone(),
                    momentum,
                    batch,
                });
            }
            result.trace = Some(trace);
        }
        Ok(result)
    }

    /// Dropout with probability `p` when `train` is true; identity otherwise.
    pub fn dropout(&self, p: f64, train: bool) -> Result<NestedTensor> {
        let result = self.with_values(self.packed().f_dropout(p, train)?);
        result.traced(&[Arg::Nested(self)], "dropout", |ids| Op::Dropout {
            x: ids[0],
            p: F64(p),
            train,
        })
    }
}
