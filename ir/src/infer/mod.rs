//! Type inference: the type every op gives, or the rule its operands break. One module
//! per op family; this one dispatches and holds the shape helpers they share.

mod attention;
mod fused_kernel;
mod gemm;
mod loss;
mod norm;
mod per_element;
mod pointwise;
mod reduce;
mod structure;

pub use per_element::{window_output_size, Window2d};
pub use pointwise::with_inserted_dims;
use pointwise::{broadcast, infer_fused};

use crate::{
    AttentionGradPart, DType, Dim, ElemDim, Graph, LossReduction, Op, OpFamily, ReduceOp,
    SliceBounds, Type, ValueId,
};

type Inferred = Result<Type, String>;

/// The type of the fused expression `expr` over inputs of `types`, or why it is
/// ill-typed.
pub fn fused_type(expr: &crate::FusedExpr, types: &[Type]) -> Inferred {
    infer_fused(expr, types)
}

/// The type `op` gives in `graph` (whose values it reads), or why it is ill-typed.
pub(crate) fn infer_type(graph: &Graph, op: &Op) -> Inferred {
    const DECLARED: &str = "its type is declared, not inferred";
    if op.declares_type() {
        return Err(DECLARED.into());
    }
    match op.family() {
        OpFamily::Source => Err(DECLARED.into()),
        OpFamily::Pointwise => pointwise::infer(graph, op),
        OpFamily::FusedKernel => fused_kernel::infer(graph, op),
        OpFamily::Gemm => gemm::infer(graph, op),
        OpFamily::Norm => norm::infer(graph, op),
        OpFamily::Reduce => reduce::infer(graph, op),
        OpFamily::Attention => attention::infer(graph, op),
        OpFamily::Structure => structure::infer(graph, op),
        OpFamily::Loss => loss::infer(graph, op),
        OpFamily::PerElement => per_element::infer(graph, op),
    }
}

/// Checks that a value holds tensor data (not lengths).
fn data(ty: Type) -> Inferred {
    match ty {
        Type::Lengths { .. } => Err(format!("expects tensor data, got {ty}")),
        ty => Ok(ty),
    }
}

fn unreachable_dense() -> ! {
    // `static_element_dim` accepted the value, and it accepts only ragged values.
    unreachable!("static_element_dim accepts ragged values only")
}

fn lengths_batch(graph: &Graph, lengths: ValueId) -> Result<Dim, String> {
    match graph.ty(lengths) {
        Type::Lengths { batch } => Ok(batch.clone()),
        other => Err(format!("{lengths} must be a lengths value, got {other}")),
    }
}

fn float(ty: &Type) -> Result<DType, String> {
    match ty.dtype() {
        Some(dtype) if dtype.is_float() => Ok(dtype),
        _ => Err(format!("expects floating-point values, got {ty}")),
    }
}

/// That the operands of `op` that are present have one dtype, as libtorch requires of
/// products, convolutions and attention (it promotes elsewhere): an error naming the
/// first operand and one of another dtype, with their types.
fn same_dtype(op: &str, operands: &[(&str, Option<&Type>)]) -> Result<(), String> {
    let mut present = operands
        .iter()
        .filter_map(|(name, ty)| ty.map(|ty| (*name, ty)));
    let Some((first_name, first)) = present.next() else {
        return Ok(());
    };
    match present.find(|(_, ty)| ty.dtype() != first.dtype()) {
        Some((name, ty)) => Err(format!(
            "{op} needs operands of one dtype: {first_name} is {first}, {name} is {ty}"
        )),
        None => Ok(()),
    }
}

/// Dims after the batch: element dims of a ragged value, trailing dims of a dense one.
fn element_rank(ty: &Type) -> usize {
    match ty {
        Type::Ragged { dims, .. } => dims.len(),
        Type::Dense { shape, .. } => shape.len().saturating_sub(1),
        Type::Lengths { .. } => 0,
    }
}

fn fixed_static(dim: &ElemDim) -> Result<i64, String> {
    match dim {
        ElemDim::Fixed(Dim::Static(size)) => Ok(*size),
        other => Err(format!("dim {other} must be static")),
    }
}

fn static_shape(ty: &Type, what: &str) -> Result<Vec<i64>, String> {
    match ty {
        Type::Dense { shape, .. } => shape
            .iter()
            .map(|dim| {
                dim.as_static()
                    .ok_or_else(|| format!("{what} must have a static shape, got {ty}"))
            })
            .collect(),
        other => Err(format!("{what} must be dense, got {other}")),
    }
}

fn static_element_dim(ty: &Type, dim: usize) -> Result<i64, String> {
    match ty {
        Type::Ragged { dims, .. } => match dims.get(dim) {
            Some(ElemDim::Fixed(Dim::Static(size))) => Ok(*size),
            Some(other) => Err(format!("element dim {dim} ({other}) must be static")),
            None => Err(format!(
                "element dim {dim} is out of range for rank {}",
                dims.len()
            )),
        },
        other => Err(format!("expects a ragged value, got {other}")),
    }
}

fn remove_element_dim(ty: &Type, dim: usize) -> Result<Type, String> {
    match ty {
        Type::Ragged { dtype, batch, dims } => {
            let mut dims = dims.clone();
            dims.remove(dim);
            Ok(Type::Ragged {
                dtype: *dtype,
                batch: batch.clone(),
                dims,
            })
        }
        other => Err(format!("expects a ragged value, got {other}")),
    }
}

/// The static width of the last dim.
fn last_static(ty: &Type, op: &str) -> Result<i64, String> {
    let last = match ty {
        Type::Ragged { dims, .. } => match dims.last() {
            Some(ElemDim::Fixed(dim)) => dim.as_static(),
            _ => None,
        },
        Type::Dense { shape, .. } => shape.last().and_then(Dim::as_static),
        Type::Lengths { .. } => None,
    };
    last.ok_or_else(|| format!("{op} needs a static last dim, got {ty}"))
}

/// The type with its last dim set to `width`, or removed for `None`.
fn with_last(ty: &Type, width: Option<i64>) -> Type {
    let mut ty = ty.clone();
    match &mut ty {
        Type::Ragged { dims, .. } => {
            dims.pop();
            dims.extend(width.map(|width| ElemDim::Fixed(Dim::Static(width))));
        }
        Type::Dense { shape, .. } => {
            shape.pop();
            shape.extend(width.map(Dim::Static));
        }
        Type::Lengths { .. } => {}
    }
    ty
}

fn append_dim(ty: &Type, width: i64) -> Type {
    let mut ty = ty.clone();
    match &mut ty {
        Type::Ragged { dims, .. } => dims.push(ElemDim::Fixed(Dim::Static(width))),
        Type::Dense { shape, .. } => shape.push(Dim::Static(width)),
        Type::Lengths { .. } => {}
    }
    ty
}

/// The static sizes of the last `count` element dims.
fn static_tail(ty: &Type, count: usize) -> Result<Vec<i64>, String> {
    let dims: Vec<ElemDim> = match ty {
        Type::Ragged { dims, .. } => dims.clone(),
        Type::Dense { shape, .. } => shape.iter().skip(1).cloned().map(ElemDim::Fixed).collect(),
        Type::Lengths { .. } => Vec::new(),
    };
    if count == 0 || count > dims.len() {
        return Err(format!("cannot normalize {count} trailing dims of {ty}"));
    }
    dims[dims.len() - count..]
        .iter()
        .map(fixed_static)
        .collect()
}
