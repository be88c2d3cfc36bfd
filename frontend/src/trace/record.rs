//! The tracer behind a trace, and how operators record themselves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use nestor_ir::{Graph, Op, Type, ValueId, F64};
use tch::Tensor;

use super::Value;
use crate::{dtype_of, NestedError, NestedTensor, Result};

/// The state of one trace: the graph so far, parameters bound to tensors, and the
/// concrete reads that make the trace invalid.
pub(crate) struct Tracer {
    pub(crate) graph: Graph,
    /// Parameter values and their tensors, in the order they were met.
    pub(crate) params: Vec<(ValueId, Tensor)>,
    /// Parameter names by tensor identity (data pointer, shape), from a `VarStore`.
    pub(crate) names: HashMap<(usize, Vec<i64>), String>,
    /// Parameter values by tensor identity, so a tensor used twice is one parameter.
    known: HashMap<(usize, Vec<i64>), ValueId>,
    /// Calls that read concrete lengths or values while tracing.
    pub(crate) concrete_reads: Vec<&'static str>,
    /// Running statistics that each run of the graph updates.
    pub(crate) running: Vec<RunningStatistics>,
}

/// Running statistics a traced training-mode batch normalization updates after each
/// run of the graph, from the batch statistics the graph outputs after the model's.
pub(crate) struct RunningStatistics {
    /// The running mean `[C]` (a shallow clone of the model's tensor).
    pub(crate) mean: Tensor,
    /// The running (unbiased) variance `[C]`.
    pub(crate) var: Tensor,
    /// The weight of each batch's statistics.
    pub(crate) momentum: f64,
    /// The batch statistics in the graph.
    pub(crate) batch: nestor_passes::BatchStatistics,
}

impl Tracer {
    pub(crate) fn new(name: &str, names: HashMap<(usize, Vec<i64>), String>) -> Self {
        Self {
            graph: Graph::new(name),
            params: Vec::new(),
            names,
            known: HashMap::new(),
            concrete_reads: Vec::new(),
            running: Vec::new(),
        }
    }

    /// The parameter value of an untraced dense tensor, added on first use.
    fn param_for(&mut self, tensor: &Tensor, op: &'static str) -> Result<ValueId> {
        let key = (tensor.data_ptr() as usize, tensor.size());
        if let Some(&value) = self.known.get(&key) {
            return Ok(value);
        }
        let kind = tensor.f_kind()?;
        let dtype = dtype_of(kind)
            .ok_or_else(|| trace_error(op, format!("a parameter of scalar type {kind:?}")))?;
        let name = self
            .names
            .get(&key)
            .cloned()
            .unwrap_or_else(|| format!("param{}", self.params.len()));
        let ty = Type::dense_static(dtype, &tensor.size());
        let value = self
            .graph
            .add_declared(Op::Param { name }, ty)
            .map_err(|error| trace_error(op, error.to_string()))?;
        self.known.insert(key, value);
        self.params.push((value, tensor.shallow_clone()));
        Ok(value)
    }
}

impl RunningStatistics {
    /// Folds a batch's statistics into the running ones, as libtorch does: nothing for
    /// an empty batch, else `running = (1 - momentum) * running + momentum * batch`, the
    /// variance made unbiased (`n / (n - 1)`: NaN for one value per channel, as there).
    pub(crate) fn update(&self, mean: &Value, var: &Value, count: &Value) -> Result<()> {
        let dense = |value: &Value, what: &str| match value {
            Value::Dense(tensor) => Ok(tensor.shallow_clone()),
            _ => Err(trace_error(
                "batch_norm",
                format!("the batch {what} is not a dense tensor"),
            )),
        };
        let (mean, var, count) = (
            dense(mean, "mean")?,
            dense(var, "variance")?,
            dense(count, "count")?,
        );
        let count = count.f_double_value(&[])?;
        if count == 0.0 {
            return Ok(());
        }
        let _no_grad = tch::no_grad_guard();
        let keep = 1.0 - self.momentum;
        let unbiased = var.f_mul_scalar(count / (count - 1.0))?;
        for (running, batch) in [(&self.mean, mean), (&self.var, unbiased)] {
            let mut running = running.shallow_clone();
            let batch = batch
                .f_reshape([-1])?
                .f_to_kind(running.f_kind()?)?
                .f_mul_scalar(self.momentum)?;
            let _updated = running.f_mul_scalar_(keep)?.f_add_(&batch)?;
        }
        Ok(())
    }
}

/// A handle on a traced value: which trace, which graph value. Opaque.
#[derive(Clone)]
pub struct TraceRef {
    pub(crate) tracer: Arc<Mutex<Tracer>>,
    pub(crate) value: ValueId,
}

impl TraceRef {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Tracer> {
        // A panic while holding the lock leaves a graph that is only read afterwards;
        // recovering the guard is sound.
        self.tracer
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Notes a concrete read by user code.
    pub(crate) fn concrete_read(&self, call: &'static str) {
        self.lock().concrete_reads.push(call);
    }

    /// The IR type of the traced value.
    pub(crate) fn ty(&self) -> Type {
        self.lock().graph.ty(self.value).clone()
    }
}

/// An operand of a recorded op.
pub(crate) enum Arg<'a> {
    /// A batch (traced, or an error if the trace has started).
    Nested(&'a NestedTensor),
    /// A dense tensor: a traced value, or else a parameter bound to the tensor.
    Dense(&'a Tensor, Option<&'a TraceRef>),
    /// A constant of the given element type.
    Const(f64, nestor_ir::DType),
}

impl Arg<'_> {
    fn trace(&self) -> Option<&TraceRef> {
        match self {
            Arg::Nested(nested) => nested.trace.as_ref(),
            Arg::Dense(_, trace) => *trace,
            Arg::Const(..) => None,
        }
    }
}

pub(crate) fn trace_error(op: &'static str, reason: String) -> NestedError {
    NestedError::Trace { op, reason }
}

/// Adds the op `build` makes from the operands' values to the trace the operands
/// belong to, and returns a handle on its result; `None` when nothing is traced.
pub(crate) fn record(
    args: &[Arg<'_>],
    op: &'static str,
    build: impl FnOnce(&[ValueId]) -> Op,
) -> Result<Option<TraceRef>> {
    record_with(args, op, |graph, values| graph.push(build(values)))
}

/// Like [`record`], with a function that adds whatever ops it needs to the graph and
/// returns the result's value (per-element regions add lengths ops and a body).
pub(crate) fn record_with(
    args: &[Arg<'_>],
    op: &'static str,
    add: impl FnOnce(&mut Graph, &[ValueId]) -> Result<ValueId, nestor_ir::VerifyError>,
) -> Result<Option<TraceRef>> {
    let Some(trace) = args.iter().find_map(Arg::trace) else {
        return Ok(None);
    };
    let tracer_arc = Arc::clone(&trace.tracer);
    let mut tracer = trace.lock();
    let mut values = Vec::with_capacity(args.len());
    for arg in args {
        let value = match arg {
            Arg::Nested(nested) => match &nested.trace {
                Some(other) if Arc::ptr_eq(&other.tracer, &tracer_arc) => other.value,
                Some(_) => return Err(trace_error(op, "operands come from two different traces".into())),
                None => {
                    return Err(trace_error(
                        op,
                        "an untraced NestedTensor meets a traced one; pass every batch as an input of the trace".into(),
                    ))
                }
            },
            Arg::Dense(_, Some(other)) if Arc::ptr_eq(&other.tracer, &tracer_arc) => other.value,
            Arg::Dense(_, Some(_)) => return Err(trace_error(op, "operands come from two different traces".into())),
            Arg::Dense(tensor, None) => tracer.param_for(tensor, op)?,
            Arg::Const(value, dtype) => tracer
                .graph
                .push(Op::Const { value: F64(*value), dtype: *dtype })
                .map_err(|error| trace_error(op, error.to_string()))?,
        };
        values.push(value);
    }
    let value =
        add(&mut tracer.graph, &values).map_err(|error| trace_error(op, error.to_string()))?;
    Ok(Some(TraceRef {
        tracer: Arc::clone(&tracer_arc),
        value,
    }))
}

/// Checks that the IR agrees with the eager result on the element type, so that a
/// graph never claims a dtype its interpretation would not produce.
pub(crate) fn check_dtype(trace: &TraceRef, kind: tch::Kind, op: &'static str) -> Result<()> {
    let ty = trace.ty();
    if ty.dtype() == dtype_of(kind) {
        Ok(())
    } else {
        Err(trace_error(
            op,
            format!("the graph gives {ty} but the eager result is {kind:?}"),
        ))
    }
}

impl NestedTensor {
    /// Records `build` into the trace of `args` (if any) as the op that made `self`.
    pub(crate) fn traced(
        self,
        args: &[Arg<'_>],
        op: &'static str,
        build: impl FnOnce(&[ValueId]) -> Op,
    ) -> Result<Self> {
        self.traced_with(args, op, |graph, values| graph.push(build(values)))
    }

    /// Like [`traced`](Self::traced), with a function that adds whatever ops it needs
    /// to the graph (lengths ops first) and returns the result's value.
    pub(crate) fn traced_with(
        mut self,
        args: &[Arg<'_>],
        op: &'static str,
        add: impl FnOnce(&mut Graph, &[ValueId]) -> Result<ValueId, nestor_ir::VerifyError>,
    ) -> Result<Self> {
        if let Some(trace) = record_with(args, op, add)? {
            check_dtype(&trace, self.packed().kind(), op)?;
            self.trace = Some(trace);
        }
        Ok(self)
    }

    /// `other` traced with this batch's length symbols where theirs differ although
    /// their sizes agree in this trace (windows of different geometry, such as a 3x3
    /// stride-2 and a 2x2 stride-2 one, that agree on odd sizes): a `match_lengths`,
    /// which every run checks. `None` when nothing needs matching (untraced, another
    /// structure, or the symbols agree already). Ops whose operands must have one
    /// structure (elementwise ops, `where`, losses) call it; ops that combine
    /// batches of any lengths (attention, concatenation) never do.
    pub(crate) fn lengths_matched(&self, other: &NestedTensor) -> Result<Option<NestedTensor>> {
        let (Some(own), Some(theirs)) = (&self.trace, &other.trace) else {
            return Ok(None);
        };
        if !Arc::ptr_eq(&own.tracer, &theirs.tracer) || self.lay() != other.lay() {
            return Ok(None);
        }
        let (symbols, their_symbols) = (own.ty().length_values(), theirs.ty().length_values());
        if symbols == their_symbols || symbols.len() != their_symbols.len() {
            return Ok(None);
        }
        let mut matched = other.clone();
        matched.trace = record(&[Arg::Nested(other)], "match_lengths", |ids| {
            Op::MatchLengths {
                x: ids[0],
                lengths: symbols,
            }
        })?;
        Ok(Some(matched))
    }

    /// Errors when `self` is traced: `op` has no IR form yet.
    pub(crate) fn untraceable(&self, op: &'static str) -> Result<()> {
        match self.trace {
            Some(_) => Err(trace_error(
                op,
                "this operation has no IR form yet, so it cannot be traced".into(),
            )),
            None => Ok(()),
        }
    }

    /// Batch-first dims of the IR for NestedTensor dims (negative from the end).
    pub(crate) fn ir_dims(&self, dims: &[i64]) -> Result<Vec<i64>> {
        let batch_dim = self.batch_dim();
        dims.iter()
            .map(|&dim| {
                let normalized = self.normalize_dim(dim)?;
                Ok(match normalized.cmp(&batch_dim) {
                    std::cmp::Ordering::Equal => 0,
                    std::cmp::Ordering::Less => normalized as i64 + 1,
                    std::cmp::Ordering::Greater => normalized as i64,
                })
            })
            .collect()
    }
}
