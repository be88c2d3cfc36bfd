//! Pointwise ops: constants, unary and binary functions, `where`, casts, dropout and fused expressions, with the broadcasting rules of DESIGN section 7.

use super::*;

/// The type of a pointwise op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Const { dtype, .. } => Ok(Type::dense(*dtype, [])),
        Op::Fused { inputs, expr } => {
            let types: Vec<Type> = inputs.iter().map(|&input| ty(input)).collect();
            infer_fused(expr, &types)
        }
        Op::Unary { op, x } => {
            let x = data(ty(*x))?;
            Ok(if *op == crate::UnaryOp::Not {
                x.with_dtype(DType::Bool)
            } else {
                x
            })
        }
        Op::Binary { op, lhs, rhs } => {
            let (shape, dtype) = broadcast(&ty(*lhs), &ty(*rhs))?;
            Ok(shape.with_dtype(if op.is_predicate() {
                DType::Bool
            } else {
                dtype
            }))
        }
        Op::Where { condition, x, y } => {
            if ty(*condition).dtype() != Some(DType::Bool) {
                return Err(format!("the condition {condition} must be bool"));
            }
            let (shape, dtype) = broadcast(&ty(*x), &ty(*y))?;
            let (shape, _) = broadcast(&shape, &ty(*condition))?;
            Ok(shape.with_dtype(dtype))
        }
        Op::Cast { x, dtype } => Ok(data(ty(*x))?.with_dtype(*dtype)),
        Op::Dropout { x, .. } => data(ty(*x)),
        Op::Clamp { x, .. } => {
            let x = data(ty(*x))?;
            float(&x)?;
            Ok(x)
        }
        Op::Expand { x, like, dims } => expand(&ty(*x), &ty(*like), dims),
        Op::RandomMask { like, p, .. } => {
            let like = data(ty(*like))?;
            if !(0.0..1.0).contains(&p.0) {
                return Err(format!(
                    "the drop probability must be in [0, 1), got {}",
                    p.0
                ));
            }
            float(&like)?;
            Ok(like)
        }
        other => Err(format!("{} is not a pointwise op", other.name())),
    }
}

/// The type of a fused expression over inputs of the given types, by the rules of the
/// ops it is made of.
pub(super) fn infer_fused(expr: &crate::FusedExpr, inputs: &[Type]) -> Inferred {
    use crate::FusedExpr;
    match expr {
        FusedExpr::Input(index) => inputs
            .get(*index)
            .cloned()
            .ok_or_else(|| format!("the expression reads ${index} of {} inputs", inputs.len())),
        FusedExpr::Const { dtype, .. } => Ok(Type::dense(*dtype, [])),
        FusedExpr::Unary(op, x) => {
            let x = data(infer_fused(x, inputs)?)?;
            Ok(if *op == crate::UnaryOp::Not {
                x.with_dtype(DType::Bool)
            } else {
                x
            })
        }
        FusedExpr::Binary(op, a, b) => {
            let (shape, dtype) = broadcast(&infer_fused(a, inputs)?, &infer_fused(b, inputs)?)?;
            Ok(shape.with_dtype(if op.is_predicate() {
                DType::Bool
            } else {
                dtype
            }))
        }
        FusedExpr::Where(condition, x, y) => {
            let condition = infer_fused(condition, inputs)?;
            if condition.dtype() != Some(DType::Bool) {
                return Err("the condition of where must be bool".into());
            }
            let (shape, dtype) = broadcast(&infer_fused(x, inputs)?, &infer_fused(y, inputs)?)?;
            let (shape, _) = broadcast(&shape, &condition)?;
            Ok(shape.with_dtype(dtype))
        }
        FusedExpr::Cast(dtype, x) => Ok(data(infer_fused(x, inputs)?)?.with_dtype(*dtype)),
    }
}

fn broadcast_dims(a: &Dim, b: &Dim) -> Result<Dim, String> {
    match (a, b) {
        _ if a == b => Ok(a.clone()),
        (Dim::Static(1), other) | (other, Dim::Static(1)) => Ok(other.clone()),
        _ => Err(format!("dims {a} and {b} do not broadcast")),
    }
}

fn category(dtype: DType) -> u8 {
    if dtype.is_float() {
        2
    } else if dtype.is_integer() {
        1
    } else {
        0
    }
}

/// The result dtype of two operands: torch's promotion, where a 0-d operand does not
/// widen an operand of the same or a higher category.
fn result_dtype(a: &Type, b: &Type) -> DType {
    let rank0 = |ty: &Type| matches!(ty, Type::Dense { shape, .. } if shape.is_empty());
    let (da, db) = (
        a.dtype().unwrap_or(DType::F32),
        b.dtype().unwrap_or(DType::F32),
    );
    match (rank0(a), rank0(b)) {
        (true, false) if category(da) <= category(db) => db,
        (false, true) if category(db) <= category(da) => da,
        _ => da.promote(db),
    }
}

/// The shape two elementwise operands broadcast to, and their dtype.
pub(super) fn broadcast(a: &Type, b: &Type) -> Result<(Type, DType), String> {
    let dtype = result_dtype(a, b);
    let shape = match (a, b) {
        (Type::Ragged { .. }, Type::Ragged { .. }) => broadcast_ragged(a, b)?,
        (Type::Ragged { .. }, Type::Dense { shape, .. }) => broadcast_dense_into(a, shape)?,
        (Type::Dense { shape, .. }, Type::Ragged { .. }) => broadcast_dense_into(b, shape)?,
        (Type::Dense { shape: sa, .. }, Type::Dense { shape: sb, .. }) => {
            let rank = sa.len().max(sb.len());
            let padded = |shape: &Vec<Dim>| -> Vec<Dim> {
                std::iter::repeat_n(Dim::Static(1), rank - shape.len())
                    .chain(shape.iter().cloned())
                    .collect()
            };
            let shape = padded(sa)
                .iter()
                .zip(padded(sb).iter())
                .map(|(x, y)| broadcast_dims(x, y))
                .collect::<Result<Vec<_>, _>>()?;
            Type::Dense { dtype, shape }
        }
        _ => {
            return Err(format!(
                "lengths values are not elementwise operands ({a}, {b})"
            ))
        }
    };
    Ok((shape, dtype))
}

fn broadcast_ragged(a: &Type, b: &Type) -> Result<Type, String> {
    let (
        Type::Ragged {
            dtype,
            batch,
            dims: da,
        },
        Type::Ragged {
            batch: bb,
            dims: db,
            ..
        },
    ) = (a, b)
    else {
        return Err("expects two ragged values".into());
    };
    if batch != bb || da.len() != db.len() {
        return Err(format!(
            "ragged operands of different structure: {a} and {b}"
        ));
    }
    let dims = da
        .iter()
        .zip(db)
        .map(|pair| match pair {
            (ElemDim::Ragged(x), ElemDim::Ragged(y)) if x == y => Ok(ElemDim::Ragged(*x)),
            (ElemDim::Ragged(x), ElemDim::Ragged(y)) => {
                Err(format!("the operands mix length symbols {x} and {y}"))
            }
            (ElemDim::Fixed(x), ElemDim::Fixed(y)) => broadcast_dims(x, y).map(ElemDim::Fixed),
            // A size-1 dim broadcasts over a ragged one: pair layouts such as
            // [L, 1, C] with [1, L, C] giving [L, L, C].
            (ElemDim::Fixed(Dim::Static(1)), ElemDim::Ragged(x))
            | (ElemDim::Ragged(x), ElemDim::Fixed(Dim::Static(1))) => Ok(ElemDim::Ragged(*x)),
            (x, y) => Err(format!("a ragged dim {x} meets a fixed dim {y}")),
        })
        .collect::<Result<_, _>>()?;
    Ok(Type::Ragged {
        dtype: *dtype,
        batch: batch.clone(),
        dims,
    })
}

/// A dense operand against a ragged value: a tail (rank <= R, ones at ragged dims) or
/// per element (rank R + 1, the batch size or 1 first).
fn broadcast_dense_into(ragged: &Type, shape: &[Dim]) -> Result<Type, String> {
    let Type::Ragged { dtype, batch, dims } = ragged else {
        return Err("expects a ragged value".into());
    };
    let rank = dims.len();
    let element: Vec<Dim> = if shape.len() == rank + 1 {
        if shape[0] != *batch && shape[0] != Dim::Static(1) {
            return Err(format!(
                "a per-element operand must lead with the batch size {batch} or 1, got {}",
                shape[0]
            ));
        }
        shape[1..].to_vec()
    } else if shape.len() <= rank {
        std::iter::repeat_n(Dim::Static(1), rank - shape.len())
            .chain(shape.iter().cloned())
            .collect()
    } else {
        return Err(format!(
            "a dense operand of rank {} does not broadcast against elements of rank {rank}",
            shape.len()
        ));
    };
    let dims = dims
        .iter()
        .zip(&element)
        .map(|(dim, operand)| match dim {
            ElemDim::Ragged(lengths) if *operand == Dim::Static(1) => Ok(ElemDim::Ragged(*lengths)),
            ElemDim::Ragged(lengths) => Err(format!(
                "a dense operand must have size 1 at the ragged dim {lengths}, got {operand}"
            )),
            ElemDim::Fixed(fixed) => broadcast_dims(fixed, operand).map(ElemDim::Fixed),
        })
        .collect::<Result<_, _>>()?;
    Ok(Type::Ragged {
        dtype: *dtype,
        batch: batch.clone(),
        dims,
    })
}

/// The type of `expand`: `like`'s shape with `x`'s dtype, when `x` with size-1 dims
/// inserted at `dims` broadcasts to it.
fn expand(x: &Type, like: &Type, dims: &[i64]) -> Inferred {
    let dtype = data(x.clone())?.dtype().unwrap_or(DType::F32);
    let inserted = with_inserted_dims(x, like, dims)?;
    let (shape, _) = broadcast(&inserted, like)?;
    let target = like.with_dtype(dtype);
    if shape.with_dtype(dtype) != target {
        return Err(format!(
            "{x} with dims {dims:?} inserted does not broadcast to {like}"
        ));
    }
    Ok(target)
}

/// `x` with size-1 dims inserted at `dims`, batch-first dims of `like` (what `expand`
/// broadcasts).
pub fn with_inserted_dims(x: &Type, like: &Type, dims: &[i64]) -> Inferred {
    let rank = element_rank(like) + 1;
    let mut positions: Vec<usize> = Vec::with_capacity(dims.len());
    for &dim in dims {
        let normalized = if dim < 0 { dim + rank as i64 } else { dim };
        match usize::try_from(normalized) {
            Ok(dim) if dim < rank => positions.push(dim),
            _ => return Err(format!("dim {dim} is out of range for {rank} dims")),
        }
    }
    positions.sort_unstable();
    let mut inserted = x.clone();
    for position in positions {
        match &mut inserted {
            Type::Dense { shape, .. } if position <= shape.len() => {
                shape.insert(position, Dim::Static(1))
            }
            Type::Ragged { dims, .. } if position >= 1 && position <= dims.len() + 1 => {
                dims.insert(position - 1, ElemDim::Fixed(Dim::Static(1)))
            }
            _ => return Err(format!("cannot insert dim {position} into {x}")),
        }
    }
    Ok(inserted)
}
