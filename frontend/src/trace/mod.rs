//! Tracing: model code written against `NestedTensor` (and the [`Dense`] handle) runs
//! eagerly on example batches while every operator records itself into a
//! [`nestor_ir::Graph`]. Lengths become graph inputs, so the graph holds no concrete
//! length and serves every batch of the same structure.
//!
//! - `record`: how an operator adds its op (operands that are traced values,
//!   parameters bound to tch tensors, constants);
//! - `dense`: the dense tensor handle for dense intermediates (pooled features, logits);
//! - `api`: [`trace`], [`Traced`], graph dumps;
//! - `interpret`: runs any graph op by op with tch, the eager reference for graphs.

mod api;
mod dense;
mod interpret;
mod record;

pub(crate) use api::{
    earlier_equal_lengths, is_normalized, normalized_input, normalized_inputs, parameter_names,
    trace_named, Bound, ParameterNames,
};
pub use api::{trace, TraceOutputs, Traced};
pub use dense::Dense;
pub use interpret::{check_inputs, interpret, Value};
pub use record::TraceRef;
pub(crate) use record::{check_dtype, record_with, trace_error, Arg, RunningStatistics};
