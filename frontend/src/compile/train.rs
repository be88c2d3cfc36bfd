//! Compiled training: the traced graph's first output is the loss; the joint graph adds
//! the gradient of every trainable parameter (autodiff on the IR, `nestor_passes::
//! differentiate`), and the gradients come back into the parameters' `.grad()`.

use nestor_ir::{Graph, Op, ValueId};
use nestor_passes::{differentiate, Decompose, Optimize, Pass};
use tch::{Kind, Tensor};

use crate::error::{CompileCause, CompileReason};
use crate::trace::{normalized_input, Traced, Value};
use crate::{NestedError, NestedTensor, Result};

/// What a gradient output of the program is the gradient of.
pub(super) enum Gradient {
    /// A parameter.
    Param {
        /// Its `VarStore` path (or `param<N>`).
        name: String,
        /// The parameter itself (a shallow clone of the model's tensor).
        tensor: Tensor,
    },
    /// The packed values of nested input `k` of each call.
    Input(usize),
}

// Like `Traced`, a `Gradient` only reads its parameter (multiplies it into the
// surrogate whose backward accumulates the gradient; libtorch's gradient accumulation
// locks the parameter), so threads may share it.
unsafe impl Sync for Gradient {}

/// An error of the autodiff stage.
fn compile_error(reason: impl Into<CompileReason>) -> NestedError {
    NestedError::Compile {
        stage: "autodiff",
        reason: reason.into(),
    }
}

/// An error of the autodiff stage without an underlying error.
fn autodiff_error(cause: CompileCause, message: String) -> NestedError {
    NestedError::compile("autodiff", cause, message)
}

/// The joint graph of `traced` (its outputs, then one gradient per trainable parameter
/// and per batch whose values require grad) and what each gradient is of.
pub(super) fn joint_graph(
    traced: &Traced,
    requires_grad: &[bool],
) -> Result<(Graph, Vec<Gradient>)> {
    let graph = Decompose.run(traced.graph()).map_err(compile_error)?;
    // Attention written over jagged pairs trains as the attention op, whose gradient
    // is one kernel and stores no L x L scores: rewrite it before differentiating.
    let graph = if graph
        .nodes
        .iter()
        .any(|node| matches!(node.op, Op::PairMatmul { .. }))
    {
        Optimize::only(&["pair-attention"])
            .map_err(|error| compile_error(CompileReason::of(CompileCause::Internal, error)))?
            .optimize(&graph)
            .map_err(compile_error)?
            .0
    } else {
        graph
    };
    let loss = *graph.outputs.first().ok_or_else(|| {
        autodiff_error(
            CompileCause::Model,
            "a training model returns its loss first; this one returns nothing".into(),
        )
    })?;
    // Decomposition keeps inputs and parameters in order, so the traced sources and
    // parameter list still line up with the graph's `input` and `param` ops.
    let inputs = graph.inputs();
    let params = inputs
        .iter()
        .filter(|&&value| matches!(graph.op(value), Op::Param { .. }));
    let mut wanted: Vec<(ValueId, Gradient)> = params
        .zip(traced.params())
        .filter(|(_, (_, tensor))| tensor.requires_grad())
        .map(|(&value, (_, tensor))| {
            let gradient = Gradient::Param {
                name: parameter_name(&graph, value),
                tensor: tensor.shallow_clone(),
            };
            (value, gradient)
        })
        .collect();
    for (&value, source) in inputs.iter().zip(traced.nested_sources()) {
        if let Some(index) = source.filter(|&index| requires_grad.get(index) == Some(&true)) {
            wanted.push((value, Gradient::Input(index)));
        }
    }
    let wrt: Vec<ValueId> = wanted.iter().map(|(value, _)| *value).collect();
    let joint = differentiate(&graph, loss, &wrt).map_err(compile_error)?;
    let mut gradients = Vec::new();
    let mut outputs = graph.outputs.clone();
    for ((_, gradient), output) in wanted.into_iter().zip(&joint.gradients) {
        // A value the loss does not depend on gets no gradient, as in eager autograd.
        if let Some(output) = output {
            outputs.push(joint.graph.outputs[*output]);
            gradients.push(gradient);
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

impl Gradient {
    /// The tensor the gradient is of, in this call.
    fn target(&self, nested: &[&NestedTensor]) -> Result<Tensor> {
        match self {
            Gradient::Param { tensor, .. } => Ok(tensor.shallow_clone()),
            Gradient::Input(index) => {
                let batch = nested.get(*index).ok_or_else(|| {
                    autodiff_error(
                        CompileCause::Internal,
                        format!("no nested input {index} for its gradient"),
                    )
                })?;
                Ok(normalized_input(batch)?.packed().shallow_clone())
            }
        }
    }

    fn name(&self) -> String {
        match self {
            Gradient::Param { name, .. } => name.clone(),
            Gradient::Input(index) => format!("x{index}"),
        }
    }

    /// What this is the gradient of.
    pub(super) fn of(&self) -> GradientOf<'_> {
        match self {
            Gradient::Param { name, .. } => GradientOf::Param(name),
            Gradient::Input(index) => GradientOf::Input(*index),
        }
    }

    /// The tensor the gradient is of in this call, and `gradient` (a program's result, in
    /// its packed shape and float kind) shaped and typed like it.
    pub(super) fn shaped(
        &self,
        gradient: &Tensor,
        nested: &[&NestedTensor],
    ) -> Result<(Tensor, Tensor)> {
        let target = self.target(nested)?;
        let gradient = gradient
            .f_to_kind(target.f_kind()?)?
            .f_reshape(target.size())?;
        Ok((target, gradient))
    }
}

/// What a gradient of a training call is the gradient of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradientOf<'a> {
    /// A parameter: its `VarStore` path, or `param<index>` for a tensor the model derives
    /// from a parameter outside the trace.
    Param(&'a str),
    /// The packed values of nested input `index` (a batch whose values require grad).
    Input(usize),
}

/// Sees the gradients of a training call ([`crate::Compiled::call_with`]) between the
/// program computing them and their accumulation into `.grad()`: data-parallel training
/// all-reduces them here, each as soon as the backward has produced it.
pub trait GradientHook {
    /// Gradient `index` (of `of`, shaped like it) is computed: called once per gradient
    /// and call, as soon as the program has written it (on the CPU, between the steps
    /// of the backward, the last layers' first), at the latest after the run.
    fn ready(&mut self, index: usize, of: GradientOf<'_>, gradient: &Tensor) -> Result<()>;

    /// The program has run; the gradients not handed to [`GradientHook::ready`] yet
    /// follow.
    fn ran(&mut self) {}

    /// Every gradient is computed; `gradients` (in index order) are accumulated into
    /// `.grad()` as they are when this returns (replace or change them in place).
    fn finish(&mut self, gradients: &mut [Tensor]) -> Result<()>;
}

/// The gradients of a run as tensors shaped like what they are the gradients of, with
/// those tensors.
pub(super) fn tensors(
    params: &[Gradient],
    values: Vec<Value>,
    nested: &[&NestedTensor],
) -> Result<Vec<(Tensor, Tensor)>> {
    if params.len() != values.len() {
        return Err(autodiff_error(
            CompileCause::Internal,
            format!("{} gradients for {} values", values.len(), params.len()),
        ));
    }
    params
        .iter()
        .zip(values)
        .map(|(param, value)| {
            let gradient = match value {
                Value::Nested(batch) => batch.packed().shallow_clone(),
                other => other.into_dense()?,
            };
            param.shaped(&gradient, nested)
        })
        .collect()
}

/// Adds the gradients of a run to the parameters' `.grad()` (and through the batches'
/// values to what computed them), as autograd's accumulation would: in place where a
/// parameter (a leaf) has a `.grad()` of the gradient's shape and kind already (one
/// pass); as the gradient itself, no copy, where it has none ([`became_grad`]); into
/// its part of the base's `.grad()` where the parameter is a slice of a leaf
/// ([`added_to_base`]); else through libtorch's own autograd (the backward of
/// `sum(p * gradient)` over them, `p . gradient` where both are f32 or f64), so
/// gradients reach what computed any other view or a batch's values, exactly as for
/// `loss.backward()`.
pub(super) fn accumulate(
    params: &[Gradient],
    values: Vec<Value>,
    nested: &[&NestedTensor],
) -> Result<()> {
    accumulate_into(tensors(params, values, nested)?, Holders::OnlyThisCall)
}

/// Who may hold the gradient tensors handed to [`accumulate_into`] besides it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Holders {
    /// Nobody: they are the run's own results (a leaf whose `.grad()` is undefined
    /// may take one as it is).
    OnlyThisCall,
    /// Perhaps the caller (a hook saw or made them): each is read, never kept.
    Others,
}

/// [`accumulate`] of gradients already shaped like their `(target, gradient)`.
pub(super) fn accumulate_into(pairs: Vec<(Tensor, Tensor)>, holders: Holders) -> Result<()> {
    let mut surrogate: Option<Tensor> = None;
    // The bytes of the gradients made a `.grad()`, which no other may share.
    let mut taken = Vec::new();
    for (target, gradient) in pairs {
        if added_in_place(&target, &gradient)? {
            continue;
        }
        if holders == Holders::OnlyThisCall && became_grad(&target, &gradient, &mut taken)? {
            continue;
        }
        if added_to_base(&target, &gradient)? {
            continue;
        }
        // `dot` (f32 and f64 of one kind) reads both once and makes no product tensor;
        // its backward is `1 * gradient`, as `sum(p * gradient)`'s.
        let term = match (target.kind(), gradient.kind()) {
            (Kind::Float, Kind::Float) | (Kind::Double, Kind::Double) => {
                target.f_reshape([-1])?.f_dot(&gradient.f_reshape([-1])?)?
            }
            _ => target.f_mul(&gradient)?.f_sum(None)?,
        };
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

/// Adds `gradient` to `target.grad()` in place when `target` is a leaf whose gradient
/// is defined with `gradient`'s shape and kind; whether it did.
fn added_in_place(target: &Tensor, gradient: &Tensor) -> Result<bool> {
    if !target.f_is_leaf()? {
        return Ok(false);
    }
    let mut grad = target.f_grad()?;
    let fits =
        grad.defined() && grad.size() == gradient.size() && grad.f_kind()? == gradient.f_kind()?;
    if fits {
        let _ = grad.f_add_(gradient)?;
    }
    Ok(fits)
}

extern "C" {
    /// shim/grad.cpp: `param.mutable_grad() = gradient`; 0 on success.
    fn nestor_set_grad(
        param: *const torch_sys::C_tensor,
        gradient: *const torch_sys::C_tensor,
    ) -> std::os::raw::c_int;
    /// shim/grad.cpp: a new handle to `view._base()`, or null when `view` is no view.
    fn nestor_view_base(view: *const torch_sys::C_tensor) -> *mut torch_sys::C_tensor;
}

/// Adds `gradient` into the part of its base's `.grad()` that `target` views, when
/// `target` is a view without overlapping values (a slice of a fused projection's
/// weight, say) of a contiguous leaf that requires grad, of `gradient`'s shape, kind and
/// device: no autograd pass, whose backward made a gradient of the whole base per
/// slice. A base without a `.grad()` gets one of zeros first. Whether it did.
fn added_to_base(target: &Tensor, gradient: &Tensor) -> Result<bool> {
    // SAFETY: `target` is a live tensor handle; the shim returns a new handle or null.
    let base = unsafe { nestor_view_base(target.as_ptr()) };
    if base.is_null() {
        return Ok(false);
    }
    // SAFETY: a handle the shim made for this call alone: the tensor owns (frees) it.
    let base = unsafe { Tensor::from_ptr(base) };
    let kind = gradient.f_kind()?;
    let (size, stride) = (target.size(), target.stride());
    let offset = target.f_storage_offset()? - base.f_storage_offset()?;
    let fits = base.f_is_leaf()?
        && base.requires_grad()
        && base.is_contiguous()
        && base.f_kind()? == kind
        && base.device() == gradient.device()
        && gradient.size() == size
        && views_within(&size, &stride, offset, base.numel());
    if !fits {
        return Ok(false);
    }
    let mut grad = base.f_grad()?;
    if !grad.defined() {
        let zeros = Tensor::f_zeros(base.size(), (kind, base.device()))?;
        // SAFETY: both are live tensor handles; the shim copies the handle of `zeros`.
        if unsafe { nestor_set_grad(base.as_ptr(), zeros.as_ptr()) } != 0 {
            return Ok(false);
        }
        grad = zeros;
    } else if grad.size() != base.size() || grad.f_kind()? != kind || !grad.is_contiguous() {
        return Ok(false);
    }
    let start = grad.f_storage_offset()? + offset;
    let _ = grad.f_as_strided(size, stride, start)?.f_add_(gradient)?;
    Ok(true)
}

/// Whether the view of `size` and `stride` from element `offset` of a contiguous tensor
/// of `elements` values reads only its values, each at most once (strides, smallest
/// first, each past the extent of the dims with smaller ones).
fn views_within(size: &[i64], stride: &[i64], offset: i64, elements: usize) -> bool {
    let mut dims: Vec<(i64, i64)> = size
        .iter()
        .zip(stride)
        .filter(|(&size, _)| size != 1)
        .map(|(&size, &stride)| (stride, size))
        .collect();
    if dims.iter().any(|&(_, size)| size == 0) {
        return offset >= 0;
    }
    dims.sort_unstable();
    let mut extent: i64 = 1;
    for &(stride, size) in &dims {
        if stride < extent {
            return false;
        }
        let Some(past) = stride
            .checked_mul(size - 1)
            .and_then(|reach| reach.checked_add(extent))
        else {
            return false;
        };
        extent = past;
    }
    // The last value the view reads is offset + extent - 1.
    offset >= 0
        && offset
            .checked_add(extent)
            .and_then(|end| usize::try_from(end).ok())
            .is_some_and(|end| end <= elements)
}

/// Makes `gradient` the `.grad()` of `target` without a copy, as autograd's
/// accumulation does with an incoming gradient nobody else holds, when `target` is a
/// leaf that requires grad and has no `.grad()` (as after `zero_grad` setting them to
/// none), `gradient` has its shape, kind, device and a contiguous layout as `target`
/// has, and shares no byte with a gradient taken before (`taken`: their byte ranges);
/// whether it did.
fn became_grad(
    target: &Tensor,
    gradient: &Tensor,
    taken: &mut Vec<(usize, usize)>,
) -> Result<bool> {
    if !target.f_is_leaf()? || !target.requires_grad() || target.f_grad()?.defined() {
        return Ok(false);
    }
    let kind = gradient.f_kind()?;
    let fits = kind == target.f_kind()?
        && gradient.device() == target.device()
        && gradient.size() == target.size()
        && !gradient.requires_grad()
        && gradient.is_contiguous()
        && target.is_contiguous();
    if !fits {
        return Ok(false);
    }
    let start = gradient.data_ptr() as usize;
    let bytes = gradient.numel().saturating_mul(kind.elt_size_in_bytes());
    let end = start.saturating_add(bytes);
    if taken.iter().any(|&(from, to)| from < end && start < to) {
        return Ok(false);
    }
    // A tensor of its own over the gradient's values: `gradient` may be a view (a
    // reshape of the run's result), and a `.grad()` that is a view cannot be detached
    // in place, as `zero_grad` does.
    let mut own = Tensor::f_empty([0], (kind, gradient.device()))?;
    let _ = own.f_set_source_tensor_storage_offset_(
        gradient,
        gradient.f_storage_offset()?,
        gradient.size(),
        gradient.stride(),
    )?;
    // SAFETY: both are live tensor handles for the call; the shim copies the gradient's
    // handle (a reference count), so `own` may be dropped after it.
    if unsafe { nestor_set_grad(target.as_ptr(), own.as_ptr()) } != 0 {
        return Ok(false);
    }
    taken.push((start, end));
    Ok(true)
}

/// The gradients of a run, named after what they are the gradients of.
pub(super) fn named(
    params: &[Gradient],
    values: Vec<Value>,
    nested: &[&NestedTensor],
) -> Result<Vec<(String, Tensor)>> {
    Ok(params
        .iter()
        .map(Gradient::name)
        .zip(
            tensors(params, values, nested)?
                .into_iter()
                .map(|(_, gradient)| gradient),
        )
        .collect())
}

#[cfg(test)]
mod tests {
    use super::views_within;

    /// Views of a contiguous `[3, 4]` (12 values) that stay inside it and read each
    /// value once are within it; overlapping or outside ones are not.
    #[test]
    fn views_within_their_base() {
        // The whole, a row, two columns, the transpose, nothing.
        assert!(views_within(&[3, 4], &[4, 1], 0, 12));
        assert!(views_within(&[1, 4], &[4, 1], 8, 12));
        assert!(views_within(&[3, 2], &[4, 1], 2, 12));
        assert!(views_within(&[4, 3], &[1, 4], 0, 12));
        assert!(views_within(&[0, 4], &[4, 1], 0, 12));
        // Past the end, before the start, broadcast, overlapping rows.
        assert!(!views_within(&[1, 4], &[4, 1], 9, 12));
        assert!(!views_within(&[3, 4], &[4, 1], -1, 12));
        assert!(!views_within(&[3, 4], &[0, 1], 0, 12));
        assert!(!views_within(&[3, 3], &[1, 1], 0, 12));
        assert!(!views_within(&[2, 4], &[3, 1], 0, 12));
    }
}
