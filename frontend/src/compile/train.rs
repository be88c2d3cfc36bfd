//! Compiled training: the traced graph's first output is the loss; the joint graph adds
//! the gradient of every trainable parameter (autodiff on the IR, `nestor_passes::
//! differentiate`), and the gradients come back into the parameters' `.grad()`.

use nestor_ir::{Graph, Op, ValueId};
use nestor_passes::{differentiate, Decompose, Pass};
use tch::Tensor;

use crate::trace::{Traced, Value};
use crate::{NestedError, Result};

/// A parameter whose gradient the program computes.
pub(super) struct Gradient {
    /// Its `VarStore` path (or `param<N>`).
    name: String,
    /// The parameter itself (a shallow clone of the model's tensor).
    tensor: Tensor,
}

// Like `Traced`, a `Gradient` only reads its parameter (multiplies it into the
// surrogate whose backward accumulates the gradient; libtorch's gradient accumulation
// locks the parameter), so threads may share it.
unsafe impl Sync for Gradient {}

fn compile_error(reason: String) -> NestedError {
    NestedError::Compile {
        stage: "autodiff",
        reason,
    }
}

/// The joint graph of `traced` (its outputs, then one gradient per trainable
/// parameter) and those parameters, in gradient order.
pub(super) fn joint_graph(traced: &Traced) -> Result<(Graph, Vec<Gradient>)> {
    let graph = Decompose
        .run(traced.graph())
        .map_err(|error| compile_error(error.to_string()))?;
    let loss = *graph.outputs.first().ok_or_else(|| {
        compile_error("a training model returns its loss first; this one returns nothing".into())
    })?;
    // Decomposition keeps inputs and parameters in order, so the traced parameter list
    // still lines up with the graph's `param` ops.
    let params: Vec<ValueId> = graph
        .inputs()
        .into_iter()
        .filter(|&value| matches!(graph.op(value), Op::Param { .. }))
        .collect();
    let trainable: Vec<(ValueId, &Tensor)> = params
        .iter()
        .zip(traced.params())
        .filter(|(_, (_, tensor))| tensor.requires_grad())
        .map(|(&value, (_, tensor))| (value, tensor))
        .collect();
    let wrt: Vec<ValueId> = trainable.iter().map(|(value, _)| *value).collect();
    let joint =
        differentiate(&graph, loss, &wrt).map_err(|error| compile_error(error.to_string()))?;
    let mut gradients = Vec::new();
    let mut outputs = graph.outputs.clone();
    for ((value, tensor), output) in trainable.iter().zip(&joint.gradients) {
        // A parameter the loss does not depend on gets no gradient, as in eager autograd.
        if let Some(output) = output {
            outputs.push(joint.graph.outputs[*output]);
            gradients.push(Gradient {
                name: parameter_name(&graph, *value),
                tensor: tensor.shallow_clone(),
            });
        }
    }
    let mut joint_graph = joint.graph;
    joint_graph.outputs = outputs;
    Ok((joint_graph, gradients))
}

fn parameter_name(graph: &Graph, value: ValueId) -> String {
    match graph.op(value) {
        Op::Param { name } => name.clone(),
        _ => value.to_string(),
    }
}

/// The gradients of a run as tensors shaped like their parameters.
fn tensors(params: &[Gradient], values: Vec<Value>) -> Result<Vec<Tensor>> {
    if params.len() != values.len() {
        return Err(compile_error(format!(
            "{} gradients for {} parameters",
            values.len(),
            params.len()
        )));
    }
    params
        .iter()
        .zip(values)
        .map(|(param, value)| {
            Ok(value
                .into_dense()?
                .f_to_kind(param.tensor.f_kind()?)?
                .f_reshape(param.tensor.size())?)
        })
        .collect()
}

/// Adds the gradients of a run to the parameters' `.grad()`: through libtorch's own
/// autograd (the backward of `sum(p * gradient)` over the parameters), so undefined
/// gradients are created and hooks run exactly as for `loss.backward()`.
pub(super) fn accumulate(params: &[Gradient], values: Vec<Value>) -> Result<()> {
    let mut surrogate: Option<Tensor> = None;
    for (param, gradient) in params.iter().zip(tensors(params, values)?) {
        let term = param.tensor.f_mul(&gradient)?.f_sum(None)?;
        surrogate = Some(match surrogate {
            Some(sum) => sum.f_add(&term)?,
            None => term,
        });
    }
    if let Some(surrogate) = surrogate {
        surrogate.f_backward()?;
    }
    Ok(())
}

/// The gradients of a run, named after their parameters.
pub(super) fn named(params: &[Gradient], values: Vec<Value>) -> Result<Vec<(String, Tensor)>> {
    Ok(params
        .iter()
        .map(|param| param.name.clone())
        .zip(tensors(params, values)?)
        .collect())
}
