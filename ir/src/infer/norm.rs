//! Normalizations: layer and RMS normalization and softmax (row ops), batch
//! normalization (composite).

use super::*;

/// `x`, a float batch with an element dim `axis` (not the batch's, which has no order),
/// the type of an op along it.
fn along_element_dim(x: Type, axis: i64) -> Inferred {
    let ndim = element_rank(&x) as i64 + 1;
    if !(1..ndim).contains(&batch_first(&x, axis)) {
        return Err(format!(
            "axis {axis} is out of range for {ndim} dims (the batch dim has no order)"
        ));
    }
    float(&x).map(|_| x)
}

/// `axis` (batch-first, negative from the end) of `x` counted from the front.
fn batch_first(x: &Type, axis: i64) -> i64 {
    let ndim = element_rank(x) as i64 + 1;
    if axis < 0 {
        axis + ndim
    } else {
        axis
    }
}

/// `x` with its element dim `axis` (batch-first) `k` long: the type of its top `k`
/// values; an error for a dim shorter than `k`. Along a ragged dim the result's
/// lengths are `lengths`, which must be `k` for every element of x's there.
fn top(graph: &Graph, x: &Type, axis: i64, k: i64, lengths: Option<ValueId>) -> Inferred {
    let normalized = batch_first(x, axis);
    let at = (normalized - 1) as usize;
    let size = |dim: &Dim| match dim {
        Dim::Static(size) if (1..=*size).contains(&k) => Ok(Dim::Static(k)),
        other => Err(format!("k = {k} of a dim of size {other} (1 to the size)")),
    };
    let static_only = || match lengths {
        Some(lengths) => Err(format!(
            "lengths {lengths} are for a ragged dim, not {axis}"
        )),
        None => Ok(()),
    };
    match x {
        Type::Ragged { dtype, batch, dims } => {
            let mut dims = dims.clone();
            match dims.get(at) {
                Some(ElemDim::Fixed(dim)) => {
                    static_only()?;
                    dims[at] = ElemDim::Fixed(size(dim)?)
                }
                Some(&ElemDim::Ragged(own)) => {
                    let expected = Op::ConstantLengths {
                        lengths: own,
                        size: k,
                    };
                    match lengths {
                        Some(lengths) if k >= 1 && graph.op(lengths) == &expected => {
                            dims[at] = ElemDim::Ragged(lengths)
                        }
                        _ => {
                            return Err(format!(
                                "along a ragged dim the top k = {k} (at least 1) need lengths constant_lengths({own}) {{size={k}}}, got {lengths:?}"
                            ))
                        }
                    }
                }
                None => return Err(format!("axis {axis} is out of range")),
            }
            Ok(Type::Ragged {
                dtype: *dtype,
                batch: batch.clone(),
                dims,
            })
        }
        Type::Dense { dtype, shape } => {
            static_only()?;
            let mut shape = shape.clone();
            let dim = shape
                .get(normalized as usize)
                .ok_or_else(|| format!("axis {axis} is out of range"))?;
            shape[normalized as usize] = size(dim)?;
            Ok(Type::Dense {
                dtype: *dtype,
                shape,
            })
        }
        Type::Lengths { .. } => Err("a lengths value has no values to pick".into()),
    }
}

/// The type of a norm op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::LayerNorm {
            x,
            weight,
            bias,
            dims,
            ..
        } => {
            if bias.is_some() && weight.is_none() {
                return Err("a bias needs a weight".into());
            }
            let x = ty(*x);
            let tail = static_tail(&x, *dims)?;
            for (name, parameter) in [("weight", weight), ("bias", bias)] {
                if let Some(parameter) = parameter {
                    let parameter = ty(*parameter);
                    // libtorch's rule: the input's dtype, or f32 for a bf16 / f16 input.
                    let (own, of) = (x.dtype(), parameter.dtype());
                    let mixed =
                        matches!(own, Some(DType::BF16 | DType::F16)) && of == Some(DType::F32);
                    if own != of && !mixed {
                        return Err(format!(
                            "layer_norm needs a {name} of the input's dtype (or f32 for a bf16 \
                             or f16 input): the input is {x}, the {name} is {parameter}"
                        ));
                    }
                    let shape = static_shape(&parameter, name)?;
                    if shape != tail {
                        return Err(format!(
                            "the {name} must be {tail:?} (the normalized tail), got {shape:?}"
                        ));
                    }
                }
            }
            float(&x).map(|_| x)
        }
        Op::NormGrad { x, g, weight, .. } => {
            let (x, g) = (ty(*x), ty(*g));
            if x != g {
                return Err(format!(
                    "the cotangent must be of the input's type {x}, got {g}"
                ));
            }
            let tail = static_tail(&x, 1)?;
            if let Some(weight) = weight {
                let weight = ty(*weight);
                let shape = static_shape(&weight, "weight")?;
                if shape != tail {
                    return Err(format!("the weight must be {tail:?}, got {shape:?}"));
                }
                float(&weight)?;
            }
            float(&x).map(|_| x)
        }
        Op::RmsNorm {
            x, weight, dims, ..
        } => {
            let x = ty(*x);
            let tail = static_tail(&x, *dims)?;
            if let Some(weight) = weight {
                let shape = static_shape(&ty(*weight), "weight")?;
                if shape != tail {
                    return Err(format!("the weight must be {tail:?}, got {shape:?}"));
                }
            }
            float(&x).map(|_| x)
        }
        Op::BatchNorm {
            x,
            mean,
            var,
            weight,
            bias,
            channel,
            ..
        } => {
            let x = ty(*x);
            let channels = static_element_dim(&x, *channel)?;
            let parameters = [
                ("mean", Some(mean)),
                ("var", Some(var)),
                ("weight", weight.as_ref()),
                ("bias", bias.as_ref()),
            ];
            for (name, parameter) in parameters {
                if let Some(parameter) = parameter {
                    let shape = static_shape(&ty(*parameter), name)?;
                    if shape != [channels] {
                        return Err(format!(
                            "the {name} must be [{channels}] (one per channel), got {shape:?}"
                        ));
                    }
                }
            }
            float(&x).map(|_| x)
        }
        Op::Softmax { x, axis, .. } => {
            let x = ty(*x);
            let ndim = element_rank(&x) as i64 + 1;
            let normalized = if *axis < 0 { axis + ndim } else { *axis };
            if normalized == 0 {
                return Err("softmax over the batch dim is not defined (elements are normalized independently)".into());
            }
            if !(1..ndim).contains(&normalized) {
                return Err(format!("axis {axis} is out of range for {ndim} dims"));
            }
            float(&x).map(|_| x)
        }
        Op::Cumulative { x, axis, .. } => along_element_dim(ty(*x), *axis),
        Op::TopK {
            x,
            lengths,
            axis,
            k,
            positions,
            ..
        } => {
            let values = top(
                graph,
                &along_element_dim(ty(*x), *axis)?,
                *axis,
                *k,
                *lengths,
            )?;
            Ok(match positions {
                true => values.with_dtype(DType::I64),
                false => values,
            })
        }
        Op::TopKGrad { g, x, axis, k, .. } => {
            let (g, x) = (ty(*g), along_element_dim(ty(*x), *axis)?);
            // Along a ragged dim the gradient has the top values' lengths there.
            let at = (batch_first(&x, *axis) - 1) as usize;
            let lengths = x.lengths_of_dim(at).and(g.lengths_of_dim(at));
            let values = top(graph, &x, *axis, *k, lengths)?;
            if g != values {
                return Err(format!("the gradient is {g}, the top values {values}"));
            }
            Ok(x)
        }
        Op::Sort {
            x, axis, positions, ..
        }
        | Op::Running {
            x, axis, positions, ..
        } => {
            let values = along_element_dim(ty(*x), *axis)?;
            Ok(match positions {
                true => values.with_dtype(DType::I64),
                false => values,
            })
        }
        Op::RunningGrad { g, x, axis, .. } | Op::SortGrad { g, x, axis, .. } => {
            let (g, x) = (ty(*g), along_element_dim(ty(*x), *axis)?);
            if g != x {
                return Err(format!("the gradient is {g}, the sorted input {x}"));
            }
            Ok(x)
        }
        other => Err(format!("{} is not a norm op", other.name())),
    }
}
