//! Varlen attention on packed heads.

use super::*;

/// The type of a attention op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Attention { q, k, v, .. } => attention(&ty(*q), &ty(*k), &ty(*v), *q, *k, *v),
        Op::AttentionGrad {
            q, k, v, g, part, ..
        } => {
            let output = attention(&ty(*q), &ty(*k), &ty(*v), *q, *k, *v)?;
            if ty(*g) != output {
                return Err(format!(
                    "the cotangent {g} must be {output}, got {}",
                    ty(*g)
                ));
            }
            if ty(*k).with_dtype(DType::F32) != ty(*v).with_dtype(DType::F32) {
                return Err(
                    "gradients of keys and values of different widths are not stacked".into(),
                );
            }
            let stacked = match part {
                AttentionGradPart::Queries => return Ok(ty(*q)),
                AttentionGradPart::KeysValues => 2,
                AttentionGradPart::All if ty(*q) == ty(*k) => 3,
                AttentionGradPart::All => {
                    return Err(format!(
                    "the gradients of queries {q} and keys {k} of different types are not stacked"
                ))
                }
            };
            let Type::Ragged {
                dtype,
                batch,
                mut dims,
            } = ty(*k)
            else {
                return Err(format!("{k} must be ragged"));
            };
            dims.insert(1, ElemDim::Fixed(Dim::Static(stacked)));
            Ok(Type::Ragged { dtype, batch, dims })
        }
        other => Err(format!("{} is not a attention op", other.name())),
    }
}

fn attention(q: &Type, k: &Type, v: &Type, qv: ValueId, kv: ValueId, vv: ValueId) -> Inferred {
    same_dtype(
        "attention",
        &[
            ("the queries", Some(q)),
            ("the keys", Some(k)),
            ("the values", Some(v)),
        ],
    )?;
    let parts = |ty: &Type, value: ValueId| -> Result<(DType, Dim, ValueId, i64, i64), String> {
        match ty {
            Type::Ragged { dtype, batch, dims } => match dims.as_slice() {
                [ElemDim::Ragged(lengths), ElemDim::Fixed(Dim::Static(heads)), ElemDim::Fixed(Dim::Static(width))] => {
                    Ok((*dtype, batch.clone(), *lengths, *heads, *width))
                }
                _ => Err(format!("{value} must be [B; L, heads, head_dim], got {ty}")),
            },
            _ => Err(format!("{value} must be ragged, got {ty}")),
        }
    };
    let (dtype, batch, q_lengths, heads, width) = parts(q, qv)?;
    let (_, k_batch, k_lengths, k_heads, k_width) = parts(k, kv)?;
    let (_, _, v_lengths, v_heads, v_width) = parts(v, vv)?;
    if batch != k_batch {
        return Err(format!(
            "queries and keys have different batch sizes {batch} and {k_batch}"
        ));
    }
    if k_lengths != v_lengths {
        return Err(format!(
            "keys and values have different lengths {k_lengths} and {v_lengths}"
        ));
    }
    if (heads, width) != (k_heads, k_width) || heads != v_heads {
        return Err(format!(
            "queries {q}, keys {k} and values {v} disagree on heads or head width"
        ));
    }
    Ok(Type::Ragged {
        dtype,
        batch,
        dims: vec![
            ElemDim::Ragged(q_lengths),
            ElemDim::Fixed(Dim::Static(heads)),
            ElemDim::Fixed(Dim::Static(v_width)),
        ],
    })
}
