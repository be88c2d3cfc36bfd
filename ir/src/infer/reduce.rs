//! Reductions over static dims, ragged dims (segmented) and the batch.

use super::*;

/// The type of a reduce op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Reduce {
            op,
            x,
            dims,
            keepdim,
            correction,
        } => {
            if *correction != 0 && !matches!(op, ReduceOp::Var | ReduceOp::Std) {
                return Err(format!(
                    "a correction ({correction}) applies to var and std only"
                ));
            }
            if op.picks_one() {
                if dims.len() != 1 {
                    return Err(format!("{} takes one dim, got {dims:?}", op.word()));
                }
                if !ty(*x).dtype().is_some_and(|dtype| dtype.is_float()) {
                    return Err(format!("{} of {} (floats only)", op.word(), ty(*x)));
                }
            }
            reduce(&ty(*x), *op, dims, *keepdim)
        }
        Op::KthValue {
            x,
            axis,
            k,
            keepdim,
            positions,
        } => {
            let x = ty(*x);
            if !x.dtype().is_some_and(|dtype| dtype.is_float()) {
                return Err(format!("kthvalue of {x} (floats only)"));
            }
            if *k < 1 {
                return Err(format!("k must be at least 1, got {k}"));
            }
            let reduced = reduce(&x, ReduceOp::Max, &[*axis], *keepdim)?;
            Ok(match positions {
                true => reduced.with_dtype(DType::I64),
                false => reduced,
            })
        }
        Op::KthGrad { g, x, axis, .. } => picked_gradient(&ty(*g), &ty(*x), *axis),
        Op::ExtremeGrad { g, x, axis, .. } => picked_gradient(&ty(*g), &ty(*x), *axis),
        other => Err(format!("{} is not a reduce op", other.name())),
    }
}

/// `x`'s type, for the gradient `g` of a value picked from `x` along `axis` (dims kept
/// or not).
fn picked_gradient(g: &Type, x: &Type, axis: i64) -> Inferred {
    let reduced = |keepdim| reduce(x, ReduceOp::Max, &[axis], keepdim);
    if reduced(true)? != *g && reduced(false)? != *g {
        return Err(format!(
            "the gradient is {g}, the values of {x} reduced along {axis} are {}",
            reduced(false)?
        ));
    }
    Ok(x.clone())
}

fn reduce(x: &Type, op: ReduceOp, dims: &[i64], keepdim: bool) -> Inferred {
    let dtype = match (op, x.dtype()) {
        (ReduceOp::All | ReduceOp::Any, _) => DType::Bool,
        (ReduceOp::Argmax | ReduceOp::Argmin, _) => DType::I64,
        (ReduceOp::Sum, Some(dtype)) if !dtype.is_float() => DType::I64,
        (ReduceOp::Mean | ReduceOp::LogSumExp | ReduceOp::Var | ReduceOp::Std, Some(dtype))
            if !dtype.is_float() =>
        {
            DType::F32
        }
        (_, Some(dtype)) => dtype,
        (_, None) => return Err(format!("cannot reduce {x}")),
    };
    let (batch, element): (Dim, Vec<ElemDim>) = match x {
        Type::Ragged { batch, dims, .. } => (batch.clone(), dims.clone()),
        Type::Dense { shape, .. } if !shape.is_empty() => (
            shape[0].clone(),
            shape[1..].iter().cloned().map(ElemDim::Fixed).collect(),
        ),
        Type::Dense { .. } => return Ok(Type::dense(dtype, [])),
        Type::Lengths { .. } => return Err("cannot reduce a lengths value".into()),
    };
    let ndim = element.len() as i64 + 1;
    let mut reduced = Vec::new();
    for &dim in dims {
        let normalized = if dim < 0 { dim + ndim } else { dim };
        if !(0..ndim).contains(&normalized) {
            return Err(format!("dim {dim} is out of range for {ndim} dims"));
        }
        reduced.push(normalized as usize);
    }
    reduced.sort_unstable();
    reduced.dedup();
    if op.picks_one() && reduced.contains(&0) {
        return Err(format!("{} over the batch dim is not an IR op", op.word()));
    }
    if reduced.is_empty() || reduced.len() as i64 == ndim {
        let shape = if keepdim {
            vec![Dim::Static(1); ndim as usize]
        } else {
            Vec::new()
        };
        return Ok(Type::Dense { dtype, shape });
    }
    let one = || ElemDim::Fixed(Dim::Static(1));
    let kept: Vec<ElemDim> = element
        .iter()
        .enumerate()
        .filter_map(
            |(index, dim)| match (reduced.contains(&(index + 1)), keepdim) {
                (false, _) => Some(dim.clone()),
                (true, true) => Some(one()),
                (true, false) => None,
            },
        )
        .collect();
    let ragged_left = kept.iter().any(|dim| matches!(dim, ElemDim::Ragged(_)));
    let to_dense = |dims: &[ElemDim]| -> Result<Vec<Dim>, String> {
        dims.iter()
            .map(|dim| match dim {
                ElemDim::Fixed(dim) => Ok(dim.clone()),
                ElemDim::Ragged(lengths) => Err(format!(
                    "reducing over the batch dim leaves the ragged dim {lengths}"
                )),
            })
            .collect()
    };
    if reduced.contains(&0) {
        let mut shape = to_dense(&kept)?;
        if keepdim {
            shape.insert(0, Dim::Static(1));
        }
        return Ok(Type::Dense { dtype, shape });
    }
    if ragged_left && matches!(x, Type::Ragged { .. }) {
        Ok(Type::Ragged {
            dtype,
            batch,
            dims: kept,
        })
    } else {
        let shape = std::iter::once(Ok(batch))
            .chain(to_dense(&kept)?.into_iter().map(Ok))
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Type::Dense { dtype, shape })
    }
}
