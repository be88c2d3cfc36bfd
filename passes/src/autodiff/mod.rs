//! Reverse-mode autodiff on the IR: from a graph with a scalar loss, one joint graph
//! that computes the forward values, the loss and the gradient of the loss with respect
//! to chosen values (parameters, inputs). Every gradient is written with IR ops (the
//! VJP rules of [`rules`], one per op), so the joint graph is printed, verified,
//! optimized and lowered like any other graph, and stays packed: reductions over
//! ragged dims spread back along their lengths (`expand`, `length_values`), weight
//! gradients are one GEMM over all packed rows (`contract_rows`), bias gradients are
//! column sums.
//!
//! ```
//! use nestor_ir::{parse, ValueId};
//! use nestor_passes::differentiate;
//!
//! let graph = parse("graph @loss {
//!   %0 = input {name = \"L\"} : lengths[B]
//!   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
//!   %2 = param {name = \"w\"} : f32[3, 4]
//!   %3 = linear(%1, %2) : ragged<f32>[B; %0, 3]
//!   %4 = tanh(%3) : ragged<f32>[B; %0, 3]
//!   %5 = sum(%4) {dims = [], keepdim = false} : f32[]
//!   return %5
//! }
//! ")?;
//! let joint = differentiate(&graph, ValueId(5), &[ValueId(2)])?;
//! joint.graph.verify()?;
//! // The loss, then the gradient of w: a [3, 4] GEMM over the packed rows.
//! assert_eq!(joint.graph.outputs.len(), 2);
//! assert_eq!(joint.gradients, [Some(1)]);
//! assert_eq!(joint.graph.ty(joint.graph.outputs[1]).to_string(), "f32[3, 4]");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod builder;
mod rules;

use std::collections::HashMap;

use nestor_ir::{Graph, Op, Type, ValueId};
use thiserror::Error;

use builder::Builder;

/// The joint graph of a loss graph: its first output, a float scalar, differentiated
/// with respect to every parameter after [`crate::Decompose`] (how the GPU check and the
/// kernel tests train a `.nir` loss).
pub fn differentiate_loss(graph: &Graph) -> Result<Gradients, LossGraphError> {
    use crate::Pass;
    let graph = crate::Decompose.run(graph)?;
    let params: Vec<ValueId> = (0..graph.nodes.len())
        .filter(|&index| matches!(graph.nodes[index].op, Op::Param { .. }))
        .map(|index| ValueId(index as u32))
        .collect();
    let loss = *graph.outputs.first().ok_or(LossGraphError::NoLoss)?;
    Ok(differentiate(&graph, loss, &params)?)
}

/// Why [`differentiate_loss`] failed.
#[derive(Debug, Error)]
pub enum LossGraphError {
    /// Decomposition broke the graph (a bug of the pass).
    #[error(transparent)]
    Decompose(#[from] nestor_ir::VerifyError),
    /// Differentiation failed.
    #[error(transparent)]
    Autodiff(#[from] AutodiffError),
    /// The graph returns nothing.
    #[error("a loss graph returns its loss first; this one returns nothing")]
    NoLoss,
}

/// Why a graph could not be differentiated.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AutodiffError {
    /// The loss is not a float scalar.
    #[error("the loss {value} must be a float scalar, got {ty}")]
    LossNotScalar {
        /// The loss.
        value: ValueId,
        /// Its type.
        ty: String,
    },
    /// No value gradients were asked for reaches the loss.
    #[error("the loss {value} depends on none of the values gradients were asked for")]
    NoParameter {
        /// The loss.
        value: ValueId,
    },
    /// A gradient was asked for a value that is not a float tensor.
    #[error("no gradient for {value}: it is {ty}, not a float tensor")]
    NotFloat {
        /// The value.
        value: ValueId,
        /// Its type.
        ty: String,
    },
    /// An op on the way from the values to the loss has no VJP rule.
    #[error("{value} = {op}: no gradient rule ({reason})")]
    NoRule {
        /// The value the op computes.
        value: ValueId,
        /// The op.
        op: &'static str,
        /// What is missing.
        reason: String,
    },
    /// A rule built an ill-typed gradient: a bug of that rule.
    #[error("the gradient rule of {value} = {op} built an ill-typed op: {reason}")]
    Rule {
        /// The value whose rule failed.
        value: ValueId,
        /// Its op.
        op: &'static str,
        /// What the type checker said.
        reason: String,
    },
}

/// A joint graph: the forward graph's values (same ids) and outputs, then one output per
/// gradient.
#[derive(Clone, Debug)]
pub struct Gradients {
    /// The joint graph.
    pub graph: Graph,
    /// For every value gradients were asked for, the index of its gradient among the
    /// graph's outputs, or `None` when the loss does not depend on it.
    pub gradients: Vec<Option<usize>>,
}

/// The joint graph of `graph` computing, besides its outputs, the gradient of `loss` (a
/// float scalar) with respect to each of `wrt`. A gradient has the type of its value.
///
/// ```
/// let graph = nestor_ir::parse("graph @loss {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
///   %2 = param {name = \"w\"} : f32[8, 4]
///   %3 = linear(%1, %2) : ragged<f32>[B; %0, 8]
///   %4 = tanh(%3) : ragged<f32>[B; %0, 8]
///   %5 = sum(%4) {dims = [], keepdim = false} : f32[]
///   return %5
/// }")?;
/// let (loss, weight) = (nestor_ir::ValueId(5), nestor_ir::ValueId(2));
/// let joint = nestor_passes::differentiate(&graph, loss, &[weight])?;
/// // The loss, then the weight's gradient (one GEMM over every packed row).
/// let gradient = joint.graph.outputs[joint.gradients[0].unwrap()];
/// assert_eq!(joint.graph.nodes[gradient.index()].ty, graph.nodes[2].ty);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn differentiate(
    graph: &Graph,
    loss: ValueId,
    wrt: &[ValueId],
) -> Result<Gradients, AutodiffError> {
    let loss_ty = graph.ty(loss);
    let scalar =
        matches!(loss_ty, Type::Dense { shape, dtype } if shape.is_empty() && dtype.is_float());
    if !scalar {
        return Err(AutodiffError::LossNotScalar {
            value: loss,
            ty: loss_ty.to_string(),
        });
    }
    for &value in wrt {
        let ty = graph.ty(value);
        if !matches!(ty, Type::Dense { .. } | Type::Ragged { .. })
            || !ty.dtype().is_some_and(|dtype| dtype.is_float())
        {
            return Err(AutodiffError::NotFloat {
                value,
                ty: ty.to_string(),
            });
        }
    }
    let needs = needs_gradient(graph, wrt);
    if !needs[loss.index()] {
        return Err(AutodiffError::NoParameter { value: loss });
    }
    let mut builder = Builder::new(graph.clone());
    // Each value's cotangent contributions, summed when its own rule runs (every user
    // has a later index, so all of them are in by then).
    let mut contributions: HashMap<ValueId, Vec<ValueId>> = HashMap::new();
    contributions.insert(loss, vec![builder.constant(1.0, loss)?]);
    let mut cotangents: HashMap<ValueId, ValueId> = HashMap::new();
    for index in (0..=loss.index()).rev() {
        let value = ValueId(index as u32);
        let Some(parts) = contributions.remove(&value) else {
            continue;
        };
        builder.at(value);
        let cotangent = builder.sum(&parts)?;
        cotangents.insert(value, cotangent);
        let op = graph.op(value).clone();
        if matches!(op, Op::Input { .. } | Op::Param { .. }) {
            continue;
        }
        let needed = |operand: ValueId| needs[operand.index()];
        for (operand, contribution) in rules::vjp(&mut builder, value, &op, cotangent, &needed)? {
            contributions.entry(operand).or_default().push(contribution);
        }
    }
    let mut graph = builder.finish();
    let mut gradients = Vec::with_capacity(wrt.len());
    for value in wrt {
        gradients.push(cotangents.get(value).map(|&gradient| {
            graph.outputs.push(gradient);
            graph.outputs.len() - 1
        }));
    }
    Ok(Gradients { graph, gradients })
}

/// Which values depend on one of `wrt` (so a gradient flows through them).
fn needs_gradient(graph: &Graph, wrt: &[ValueId]) -> Vec<bool> {
    let mut needs = vec![false; graph.nodes.len()];
    for &value in wrt {
        needs[value.index()] = true;
    }
    for (index, node) in graph.nodes.iter().enumerate() {
        if node
            .op
            .operands()
            .iter()
            .any(|operand| needs[operand.index()])
        {
            needs[index] = true;
        }
    }
    needs
}
