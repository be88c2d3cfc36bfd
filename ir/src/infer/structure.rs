//! Structure: static reshapes and selections, padding, masks, lengths and their derived values, repeats.

use super::*;

/// The type of a structure op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::ReshapeTail { x, tail } => reshape_tail(&ty(*x), tail),
        Op::Reshape { x, shape } => reshape(&ty(*x), shape),
        Op::SelectStatic { x, dim, index } => {
            let x = ty(*x);
            let size = static_element_dim(&x, *dim)?;
            if !(0..size).contains(index) {
                return Err(format!(
                    "index {index} is out of range for dim {dim} of size {size}"
                ));
            }
            remove_element_dim(&x, *dim)
        }
        Op::InsertStatic {
            x,
            dim,
            index,
            size,
        } => match ty(*x) {
            Type::Ragged { dtype, batch, dims }
                if (1..=dims.len()).contains(dim) && (0..*size).contains(index) =>
            {
                let mut dims = dims;
                dims.insert(*dim, ElemDim::Fixed(Dim::Static(*size)));
                Ok(Type::Ragged { dtype, batch, dims })
            }
            other => Err(format!(
                "cannot insert index {index} of a dim of {size} at element dim {dim} of {other}"
            )),
        },
        Op::SliceStatic { x, dim, start, end } => {
            let x = ty(*x);
            let size = static_element_dim(&x, *dim)?;
            if !(0 <= *start && start <= end && *end <= size) {
                return Err(format!(
                    "positions {start}..{end} of element dim {dim} of size {size}"
                ));
            }
            resized_element_dim(x, *dim, end - start)
        }
        Op::PadStatic {
            x,
            dim,
            before,
            after,
        } => {
            let x = ty(*x);
            let size = static_element_dim(&x, *dim)?;
            let padded = (*before >= 0 && *after >= 0)
                .then(|| size.checked_add(*before)?.checked_add(*after))
                .flatten()
                .ok_or_else(|| format!("{before} and {after} zeros around a dim of {size}"))?;
            resized_element_dim(x, *dim, padded)
        }
        Op::TransposeStatic { x, dim0, dim1 } => {
            let x = ty(*x);
            static_element_dim(&x, *dim0)?;
            static_element_dim(&x, *dim1)?;
            let Type::Ragged { dtype, batch, dims } = x else {
                unreachable_dense()
            };
            let mut dims = dims;
            dims.swap(*dim0, *dim1);
            Ok(Type::Ragged { dtype, batch, dims })
        }
        _ => pair_views(graph, op),
    }
}

/// `x`, a ragged value, with element dim `dim` of `size`.
fn resized_element_dim(x: Type, dim: usize, size: i64) -> Inferred {
    let Type::Ragged {
        dtype,
        batch,
        mut dims,
    } = x
    else {
        return Err("expects a ragged value".into());
    };
    dims[dim] = ElemDim::Fixed(Dim::Static(size));
    Ok(Type::Ragged { dtype, batch, dims })
}

/// The type of a view of a pair layout (or of a new dim) in `graph`, or why it is ill-typed.
fn pair_views(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::CausalFill { x, .. } => match ty(*x) {
            Type::Ragged { ref dims, .. }
                if matches!(
                    dims.as_slice(),
                    [ElemDim::Ragged(_), ElemDim::Ragged(_), ..]
                ) =>
            {
                Ok(ty(*x))
            }
            other => Err(format!(
                "causal_fill takes a pair layout [B; M, N, ...], got {other}"
            )),
        },
        Op::Unsqueeze { x, dim } => match ty(*x) {
            Type::Ragged { dtype, batch, dims } if *dim <= dims.len() => {
                let mut dims = dims;
                dims.insert(*dim, ElemDim::Fixed(Dim::Static(1)));
                Ok(Type::Ragged { dtype, batch, dims })
            }
            other => Err(format!(
                "cannot insert a dim at element dim {dim} of {other}"
            )),
        },
        // The two ragged dims of a pair layout: the rows move.
        Op::TransposeRagged { x, dim0, dim1 }
            if (*dim0).min(*dim1) == 0
                && (*dim0).max(*dim1) == 1
                && matches!(
                    ty(*x),
                    Type::Ragged { ref dims, .. }
                        if matches!(dims.as_slice(), [ElemDim::Ragged(_), ElemDim::Ragged(_), ..])
                ) =>
        {
            let Type::Ragged {
                dtype,
                batch,
                mut dims,
            } = ty(*x)
            else {
                unreachable_dense()
            };
            dims.swap(0, 1);
            Ok(Type::Ragged { dtype, batch, dims })
        }
        Op::TransposeRagged { x, dim0, dim1 } => match ty(*x) {
            // Static dims keep their order (so no value moves) when none lies between.
            Type::Ragged { dtype, batch, dims }
                if *dim0 < dims.len()
                    && *dim1 < dims.len()
                    && matches!(dims[*dim0], ElemDim::Ragged(_))
                        != matches!(dims[*dim1], ElemDim::Ragged(_))
                    && dims[(*dim0).min(*dim1) + 1..(*dim0).max(*dim1)]
                        .iter()
                        .all(|dim| matches!(dim, ElemDim::Ragged(_))) =>
            {
                let mut dims = dims;
                dims.swap(*dim0, *dim1);
                Ok(Type::Ragged { dtype, batch, dims })
            }
            other => Err(format!(
                "transpose_ragged swaps a ragged dim with a static one with no static dim \
                 between them; dims {dim0} and {dim1} of {other} are not"
            )),
        },
        _ => padding_and_lengths(graph, op),
    }
}

/// The type of a padding, mask, lengths or repeat op in `graph`, or why it is ill-typed.
fn padding_and_lengths(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Pad { x, .. } => match ty(*x) {
            Type::Ragged { dtype, batch, dims } => {
                let shape = std::iter::once(batch)
                    .chain(dims.into_iter().map(|dim| match dim {
                        ElemDim::Fixed(dim) => dim,
                        ElemDim::Ragged(lengths) => Dim::Max(lengths),
                    }))
                    .collect();
                Ok(Type::Dense { dtype, shape })
            }
            other => Err(format!("expects a ragged value, got {other}")),
        },
        Op::Unpad { x, lengths } => {
            let batch = lengths_batch(graph, *lengths)?;
            match ty(*x) {
                Type::Dense { dtype, shape } if shape.len() >= 2 && shape[0] == batch => {
                    let dims = std::iter::once(ElemDim::Ragged(*lengths))
                        .chain(shape[2..].iter().cloned().map(ElemDim::Fixed))
                        .collect();
                    Ok(Type::Ragged { dtype, batch, dims })
                }
                other => Err(format!(
                    "expects a dense [{batch}, max, ...] value, got {other}"
                )),
            }
        }
        Op::Mask { lengths } => {
            let batch = lengths_batch(graph, *lengths)?;
            Ok(Type::dense(DType::Bool, [batch, Dim::Max(*lengths)]))
        }
        Op::Positions { lengths } => {
            let batch = lengths_batch(graph, *lengths)?;
            Ok(Type::Ragged {
                dtype: DType::I64,
                batch,
                dims: vec![ElemDim::Ragged(*lengths)],
            })
        }
        Op::LengthValues {
            lengths,
            dtype,
            rank,
        } => {
            let batch = lengths_batch(graph, *lengths)?;
            if *rank == 0 || !dtype.is_float() {
                return Err(format!(
                    "length values are floats of rank 1 or more, got {dtype} of rank {rank}"
                ));
            }
            let ones = std::iter::repeat_n(Dim::Static(1), rank - 1);
            Ok(Type::dense(*dtype, std::iter::once(batch).chain(ones)))
        }
        _ => lengths_ops(graph, op),
    }
}

/// The type of an op computed from lengths (one-hot rows, totals, repeats, window sizes) in `graph`, or why it is ill-typed.
fn lengths_ops(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::OneHot {
            ids,
            classes,
            dtype,
            ..
        } => {
            let ids = ty(*ids);
            if ids.dtype().is_none_or(|dtype| !dtype.is_integer()) || !dtype.is_float() {
                return Err(format!(
                    "one_hot takes integer ids and gives floats, got {ids} and {dtype}"
                ));
            }
            if *classes < 1 {
                return Err(format!("one_hot needs at least one class, got {classes}"));
            }
            Ok(append_dim(&ids, *classes).with_dtype(*dtype))
        }
        Op::MaxLength { lengths } | Op::TotalLength { lengths } => {
            lengths_batch(graph, *lengths)?;
            Ok(Type::dense(DType::I64, []))
        }
        Op::RepeatLengths {
            lengths, repeats, ..
        } => {
            if *repeats < 0 {
                return Err(format!("repeats must not be negative, got {repeats}"));
            }
            let batch = lengths_batch(graph, *lengths)?;
            Ok(Type::Lengths {
                batch: Dim::Sym(format!("{batch}x{repeats}")),
            })
        }
        Op::ConstantLengths { lengths, size } => {
            if *size < 0 {
                return Err(format!("a length must not be negative, got {size}"));
            }
            Ok(Type::Lengths {
                batch: lengths_batch(graph, *lengths)?,
            })
        }
        Op::SliceLengths { lengths, .. } => Ok(Type::Lengths {
            batch: lengths_batch(graph, *lengths)?,
        }),
        &Op::SliceRagged {
            x,
            lengths,
            start,
            end,
        } => {
            let (own, tail) = leading_ragged(&ty(x))?;
            sliced_lengths(graph, own, lengths, SliceBounds { start, end })?;
            match ty(x) {
                Type::Ragged { dtype, batch, .. } => Ok(Type::Ragged {
                    dtype,
                    batch,
                    dims: std::iter::once(ElemDim::Ragged(lengths))
                        .chain(tail)
                        .collect(),
                }),
                other => Err(format!("expects a ragged value, got {other}")),
            }
        }
        &Op::UnsliceRagged {
            g,
            like,
            start,
            end,
        } => {
            let (sliced, grads) = leading_ragged(&ty(g))?;
            let (own, tail) = leading_ragged(&ty(like))?;
            sliced_lengths(graph, own, sliced, SliceBounds { start, end })?;
            if grads != tail {
                return Err(format!(
                    "{g} must be a slice of {like}, got {} for {}",
                    ty(g),
                    ty(like)
                ));
            }
            float(&ty(g)).map(|dtype| ty(like).with_dtype(dtype))
        }
        Op::RepeatBatch {
            x,
            lengths,
            repeats,
            interleave,
        } => repeat_batch(graph, *x, lengths, *repeats, *interleave),
        Op::MatchLengths { x, lengths } => match_lengths(graph, *x, lengths),
        Op::UnrepeatBatch {
            g,
            like,
            repeats,
            interleave,
        } => {
            let (grads, own) = (ty(*g), ty(*like));
            let lengths = own
                .length_values()
                .into_iter()
                .map(|lengths| Op::RepeatLengths {
                    lengths,
                    repeats: *repeats,
                    interleave: *interleave,
                })
                .collect::<Vec<_>>();
            let repeated = grads.length_values();
            let matches = lengths.len() == repeated.len()
                && lengths
                    .iter()
                    .zip(&repeated)
                    .all(|(expected, &got)| graph.op(got) == expected);
            if !matches || grads.ragged_tail() != own.ragged_tail() {
                return Err(format!(
                    "{g} must be {like} repeated {repeats} times, got {grads} for {own}"
                ));
            }
            float(&grads).map(|dtype| own.with_dtype(dtype))
        }
        Op::WindowLengths {
            lengths,
            kernel,
            stride,
            ..
        } => {
            if *kernel < 1 || *stride < 1 {
                return Err("kernel and stride must be positive".into());
            }
            Ok(Type::Lengths {
                batch: lengths_batch(graph, *lengths)?,
            })
        }
        other => Err(format!("{} is not a structure op", other.name())),
    }
}

/// The lengths of the leading ragged dim of a value whose elements have no other (what a
/// slice of a ragged dim takes) and the dims after it, or why it is not one.
fn leading_ragged(ty: &Type) -> Result<(ValueId, Vec<ElemDim>), String> {
    if let Type::Ragged { dims, .. } = ty {
        if let [ElemDim::Ragged(lengths), tail @ ..] = &dims[..] {
            if tail.iter().all(|dim| matches!(dim, ElemDim::Fixed(_))) {
                return Ok((*lengths, tail.to_vec()));
            }
        }
    }
    Err(format!(
        "slices a ragged dim only of elements whose one ragged dim leads, got {ty}"
    ))
}

/// That `sliced` are the lengths of a slice `bounds` of elements of `own` lengths: the
/// `slice_lengths` of `own` in the same length formula (`own` itself for everything).
fn sliced_lengths(
    graph: &Graph,
    own: ValueId,
    sliced: ValueId,
    bounds: SliceBounds,
) -> Result<(), String> {
    let form = bounds.lengths_form();
    let matches = match graph.op(sliced) {
        Op::SliceLengths {
            lengths,
            start,
            end,
        } => *lengths == own && (*start, *end) == (form.start, form.end),
        _ => form == SliceBounds::ALL && sliced == own,
    };
    if matches {
        return Ok(());
    }
    Err(format!(
        "{sliced} must be the lengths of {own} sliced {}:{} (slice_lengths {}:{})",
        bounds.start, bounds.end, form.start, form.end
    ))
}

/// The type of `match_lengths`: `x` with its ragged dims sized by `lengths`, lengths
/// of its own batch.
fn match_lengths(graph: &Graph, x: ValueId, lengths: &[ValueId]) -> Inferred {
    let ty = graph.ty(x);
    let Type::Ragged { dtype, batch, dims } = ty else {
        return Err(format!("expects a ragged value, got {ty}"));
    };
    let old = ty.length_values();
    if old.len() != lengths.len() {
        return Err(format!(
            "needs {} lengths (one per ragged dim), got {}",
            old.len(),
            lengths.len()
        ));
    }
    for &new in lengths {
        let of = lengths_batch(graph, new)?;
        if of != *batch {
            return Err(format!("{new} has a batch of {of}, {x} of {batch}"));
        }
    }
    Ok(Type::Ragged {
        dtype: *dtype,
        batch: batch.clone(),
        dims: replace_ragged(dims, lengths),
    })
}

/// `dims` with their ragged dims sized by `lengths`, in order.
fn replace_ragged(dims: &[ElemDim], lengths: &[ValueId]) -> Vec<ElemDim> {
    let mut replacements = lengths.iter();
    dims.iter()
        .map(|dim| match dim {
            ElemDim::Ragged(_) => replacements
                .next()
                .map_or(dim.clone(), |&new| ElemDim::Ragged(new)),
            fixed => fixed.clone(),
        })
        .collect()
}

/// The type of `repeat_batch`: `x` repeated, its ragged dims sized by `lengths`, which
/// must be `repeat_lengths` of its own with the same repeats.
fn repeat_batch(
    graph: &Graph,
    x: ValueId,
    lengths: &[ValueId],
    repeats: i64,
    interleave: bool,
) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    let Type::Ragged { dtype, batch, dims } = ty(x) else {
        return Err(format!("expects a ragged value, got {}", ty(x)));
    };
    let old = ty(x).length_values();
    if old.len() != lengths.len() {
        return Err(format!(
            "needs {} new lengths (one per ragged dim), got {}",
            old.len(),
            lengths.len()
        ));
    }
    for (&new, &previous) in lengths.iter().zip(&old) {
        let expected = Op::RepeatLengths {
            lengths: previous,
            repeats,
            interleave,
        };
        if graph.op(new) != &expected {
            return Err(format!(
                "{new} must be repeat_lengths({previous}) with the same repeats"
            ));
        }
    }
    Ok(Type::Ragged {
        dtype,
        batch: Dim::Sym(format!("{batch}x{repeats}")),
        dims: replace_ragged(&dims, lengths),
    })
}

/// The type of `reshape_tail`: the static tail after the leading ragged dims, reshaped.
fn reshape(x: &Type, shape: &[i64]) -> Inferred {
    let Type::Dense { dtype, shape: old } = x else {
        return Err(format!("expects a dense value, got {x}"));
    };
    let old: Vec<i64> = old
        .iter()
        .map(|dim| {
            dim.as_static()
                .ok_or_else(|| format!("cannot reshape {x}: {dim} is not static"))
        })
        .collect::<Result<_, _>>()?;
    let (before, after) = (checked_volume(&old), checked_volume(shape));
    if before.is_none() || before != after || shape.iter().any(|&size| size < 0) {
        return Err(format!("cannot reshape {old:?} to {shape:?}"));
    }
    Ok(Type::dense_static(*dtype, shape))
}

/// The product of `sizes`, `None` when it overflows (sizes come from texts and users).
fn checked_volume(sizes: &[i64]) -> Option<i64> {
    sizes
        .iter()
        .try_fold(1i64, |volume, &size| volume.checked_mul(size))
}

fn reshape_tail(x: &Type, tail: &[i64]) -> Inferred {
    let Type::Ragged { dtype, batch, dims } = x else {
        return Err(format!("expects a ragged value, got {x}"));
    };
    let leading = dims
        .iter()
        .take_while(|dim| matches!(dim, ElemDim::Ragged(_)))
        .count();
    let old: Vec<i64> = dims[leading..]
        .iter()
        .map(fixed_static)
        .collect::<Result<_, _>>()?;
    let (before, after) = (checked_volume(&old), checked_volume(tail));
    if before.is_none() || before != after || tail.iter().any(|&size| size < 0) {
        return Err(format!("cannot reshape a static tail {old:?} to {tail:?}"));
    }
    let dims = dims[..leading]
        .iter()
        .cloned()
        .chain(tail.iter().map(|&size| ElemDim::Fixed(Dim::Static(size))))
        .collect();
    Ok(Type::Ragged {
        dtype: *dtype,
        batch: batch.clone(),
        dims,
    })
}
