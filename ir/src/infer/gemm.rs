//! GEMMs over packed rows (linear, matmul) and the embedding gather.

use super::*;

/// The type of a gemm op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Linear { x, weight, bias } => {
            let x = ty(*x);
            let weight_type = ty(*weight);
            let bias_type = bias.map(ty);
            same_dtype(
                "linear",
                &[
                    ("the input", Some(&x)),
                    ("the weight", Some(&weight_type)),
                    ("the bias", bias_type.as_ref()),
                ],
            )?;
            let width = last_static(&x, "linear")?;
            let weight = static_shape(&weight_type, "the weight")?;
            if weight.len() != 2 || weight[1] != width {
                return Err(format!("the weight must be [out, {width}] for an input of width {width}, got {weight:?}"));
            }
            if let Some(bias) = bias {
                let bias = static_shape(&ty(*bias), "the bias")?;
                if bias != [weight[0]] {
                    return Err(format!("the bias must be [{}], got {bias:?}", weight[0]));
                }
            }
            Ok(with_last(&x, Some(weight[0])))
        }
        Op::Matmul { x, w } => {
            let (x, w) = (ty(*x), ty(*w));
            same_dtype(
                "matmul",
                &[("the input", Some(&x)), ("the matrix", Some(&w))],
            )?;
            let width = last_static(&x, "matmul")?;
            match static_shape(&w, "the matrix")?.as_slice() {
                [k, m] if *k == width => Ok(with_last(&x, Some(*m))),
                [k] if *k == width => Ok(with_last(&x, None)),
                other => Err(format!("expected [{width}, M] or [{width}], got {other:?}")),
            }
        }
        Op::Embedding { ids, weight, .. } => {
            let ids = ty(*ids);
            if ids.dtype().is_none_or(|dtype| !dtype.is_integer()) {
                return Err(format!("ids must be integers, got {ids}"));
            }
            let weight_type = ty(*weight);
            let table = static_shape(&weight_type, "the table")?;
            let [_, width] = table.as_slice() else {
                return Err(format!("the table must be [vocabulary, D], got {table:?}"));
            };
            Ok(append_dim(&ids, *width).with_dtype(weight_type.dtype().unwrap_or(DType::F32)))
        }
        Op::ContractRows { a, b } => {
            let (a, b) = (ty(*a), ty(*b));
            let (rows_a, rows_b) = (
                last_static(&a, "contract_rows")?,
                last_static(&b, "contract_rows")?,
            );
            if with_last(&a, None).with_dtype(DType::F32)
                != with_last(&b, None).with_dtype(DType::F32)
            {
                return Err(format!(
                    "contract_rows needs two values of one structure, got {a} and {b}"
                ));
            }
            let dtype = float(&a)?;
            if b.dtype() != Some(dtype) {
                return Err(format!("contract_rows needs one dtype, got {a} and {b}"));
            }
            Ok(Type::dense_static(dtype, &[rows_a, rows_b]))
        }
        Op::ScatterRows {
            g, ids, vocabulary, ..
        } => {
            let (g, ids) = (ty(*g), ty(*ids));
            if ids.dtype().is_none_or(|dtype| !dtype.is_integer()) {
                return Err(format!("ids must be integers, got {ids}"));
            }
            let width = last_static(&g, "scatter_rows")?;
            if append_dim(&ids, width).with_dtype(DType::F32) != g.with_dtype(DType::F32) {
                return Err(format!(
                    "scatter_rows needs one row of g per id, got {g} for {ids}"
                ));
            }
            if *vocabulary < 0 {
                return Err(format!(
                    "the vocabulary must not be negative, got {vocabulary}"
                ));
            }
            Ok(Type::dense_static(float(&g)?, &[*vocabulary, width]))
        }
        Op::PairMatmul { a, b } => pair_matmul(&ty(*a), &ty(*b)),
        Op::Cdist { a, b, p } => cdist(&ty(*a), &ty(*b), p.0),
        other => Err(format!("{} is not a gemm op", other.name())),
    }
}

/// `[B; M, D]` and `[B; N, D]` (`M`, `N` ragged) give `[B; M, N]`.
fn cdist(a: &Type, b: &Type, p: f64) -> Inferred {
    if p.is_nan() || p < 0.0 {
        return Err(format!("the norm must be at least 0, got {p}"));
    }
    use ElemDim::{Fixed, Ragged};
    match (a, b) {
        (
            Type::Ragged { dtype, batch, dims },
            Type::Ragged {
                dtype: right_dtype,
                batch: right_batch,
                dims: right,
            },
        ) if batch == right_batch && dtype == right_dtype && dtype.is_float() => {
            match (dims.as_slice(), right.as_slice()) {
                ([Ragged(m), Fixed(d)], [Ragged(n), Fixed(d2)]) if d == d2 => Ok(Type::Ragged {
                    dtype: *dtype,
                    batch: batch.clone(),
                    dims: vec![Ragged(*m), Ragged(*n)],
                }),
                _ => Err(format!(
                    "cdist takes [B; M, D] and [B; N, D] with M and N ragged, got {a} and {b}"
                )),
            }
        }
        _ => Err(format!(
            "cdist needs two ragged batches of one size and float dtype, got {a} and {b}"
        )),
    }
}

/// `[B; M, K] @ [B; K, N]` (`M`, `N` ragged) or `[B; M, N] @ [B; N, D]`.
fn pair_matmul(a: &Type, b: &Type) -> Inferred {
    let (
        Type::Ragged {
            dtype,
            batch,
            dims: left,
        },
        Type::Ragged {
            dtype: right_dtype,
            batch: right_batch,
            dims: right,
        },
    ) = (a, b)
    else {
        return Err(format!(
            "pair_matmul multiplies two ragged batches, got {a} and {b}"
        ));
    };
    if batch != right_batch || dtype != right_dtype || !dtype.is_float() {
        return Err(format!(
            "pair_matmul needs one batch size and one float dtype, got {a} and {b}"
        ));
    }
    use ElemDim::{Fixed, Ragged};
    let dims = match (left.as_slice(), right.as_slice()) {
        ([Ragged(m), Fixed(k)], [Fixed(k2), Ragged(n)]) if k == k2 => vec![Ragged(*m), Ragged(*n)],
        ([Ragged(m), Ragged(n)], [Ragged(n2), Fixed(d)]) if n == n2 => {
            vec![Ragged(*m), Fixed(d.clone())]
        }
        _ => {
            return Err(format!(
                "pair_matmul takes [B; M, K] @ [B; K, N] or [B; M, N] @ [B; N, D] with M and N \
                 ragged, got {a} and {b}"
            ))
        }
    };
    Ok(Type::Ragged {
        dtype: *dtype,
        batch: batch.clone(),
        dims,
    })
}
