//! Type inference: the type every op gives, or the rule its operands break.

use crate::{DType, Dim, ElemDim, Graph, LossReduction, Op, ReduceOp, Type, ValueId};

type Inferred = Result<Type, String>;

/// Whether `core` may be the core of a fused kernel: of a prologue (row and segmented
/// ops) or of an epilogue (GEMMs).
fn fusable_core(core: &Op, prologue: bool) -> bool {
    match core {
        Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Softmax { .. } => prologue,
        Op::Reduce { op, dims, .. } => {
            prologue
                && dims.len() == 1
                && matches!(
                    op,
                    ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Amax | ReduceOp::Amin
                )
        }
        Op::Linear { .. } | Op::Matmul { .. } => !prologue,
        _ => false,
    }
}

/// The type `op` gives when its operands, in order, have `types`.
fn infer_over(op: &Op, types: Vec<Type>) -> Inferred {
    let mut scratch = Graph::new("");
    scratch.nodes = types
        .into_iter()
        .map(|ty| crate::Node {
            op: Op::Input {
                name: String::new(),
            },
            ty,
        })
        .collect();
    let operands: Vec<ValueId> = (0..scratch.nodes.len() as u32).map(ValueId).collect();
    let op = op
        .with_operands(&operands)
        .ok_or_else(|| format!("{} takes other operands", op.name()))?;
    infer_type(&scratch, &op)
}

/// The type of the fused expression `expr` over inputs of `types`, or why it is
/// ill-typed.
pub fn fused_type(expr: &crate::FusedExpr, types: &[Type]) -> Inferred {
    infer_fused(expr, types)
}

/// The type `op` gives in `graph` (whose values it reads), or why it is ill-typed.
pub(crate) fn infer_type(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::PerElement { .. } => {
            Err("its type is declared, not inferred".into())
        }
        Op::Const { dtype, .. } => Ok(Type::dense(*dtype, [])),
        Op::Fused { inputs, expr } => {
            let types: Vec<Type> = inputs.iter().map(|&input| ty(input)).collect();
            infer_fused(expr, &types)
        }
        Op::Prologue { inputs, expr, core } => {
            if !fusable_core(core, true) {
                return Err(format!("{} cannot take a prologue", core.name()));
            }
            let types: Vec<Type> = inputs.iter().map(|&input| ty(input)).collect();
            let input = infer_fused(expr, &types)?;
            let others = core.operands().into_iter().skip(1).map(ty);
            infer_over(core, std::iter::once(input).chain(others).collect())
        }
        Op::Epilogue { core, inputs, expr } => {
            if !fusable_core(core, false) {
                return Err(format!("{} cannot take an epilogue", core.name()));
            }
            let result = infer_type(graph, core)?;
            let types: Vec<Type> = std::iter::once(result.clone())
                .chain(inputs.iter().map(|&input| ty(input)))
                .collect();
            let output = infer_fused(expr, &types)?;
            // Computed in place over the core's result: the same elements.
            if output.with_dtype(DType::F32) != result.with_dtype(DType::F32) {
                return Err(format!(
                    "the epilogue gives {output}, not the shape of the {} result {result}",
                    core.name()
                ));
            }
            Ok(output)
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
        Op::Linear { x, weight, bias } => {
            let x = ty(*x);
            let width = last_static(&x, "linear")?;
            let weight = static_shape(&ty(*weight), "the weight")?;
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
            let x = ty(*x);
            let width = last_static(&x, "matmul")?;
            match static_shape(&ty(*w), "the matrix")?.as_slice() {
                [k, m] if *k == width => Ok(with_last(&x, Some(*m))),
                [k] if *k == width => Ok(with_last(&x, None)),
                other => Err(format!("expected [{width}, M] or [{width}], got {other:?}")),
            }
        }
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
                    let shape = static_shape(&ty(*parameter), name)?;
                    if shape != tail {
                        return Err(format!(
                            "the {name} must be {tail:?} (the normalized tail), got {shape:?}"
                        ));
                    }
                }
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
            reduce(&ty(*x), *op, dims, *keepdim)
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
        Op::Attention { q, k, v, .. } => attention(&ty(*q), &ty(*k), &ty(*v), *q, *k, *v),
        Op::ReshapeTail { x, tail } => {
            let x = ty(*x);
            let Type::Ragged { dtype, batch, dims } = &x else {
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
            if old.iter().product::<i64>() != tail.iter().product::<i64>()
                || tail.iter().any(|&size| size < 0)
            {
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
        Op::Dropout { x, .. } => data(ty(*x)),
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
        Op::MaxLength { lengths } | Op::TotalLength { lengths } => {
            lengths_batch(graph, *lengths)?;
            Ok(Type::dense(DType::I64, []))
        }
        Op::CrossEntropy {
            logits,
            target,
            reduction,
            ..
        } => {
            let logits = ty(*logits);
            last_static(&logits, "cross_entropy")?;
            let rows = with_last(&logits, None);
            let target = ty(*target);
            let per_element = matches!((&logits, &target), (Type::Ragged { batch, .. }, Type::Dense { shape, .. }) if shape.len() == 1 && shape[0] == *batch);
            if target.with_dtype(DType::I64) != rows.with_dtype(DType::I64) && !per_element {
                return Err(format!("targets must be {} (the logits without their class dim) or one per element, got {target}", rows.with_dtype(DType::I64)));
            }
            if target.dtype().is_none_or(|dtype| !dtype.is_integer()) {
                return Err(format!(
                    "targets must be class ids (integers), got {target}"
                ));
            }
            let dtype = float(&logits)?;
            Ok(loss_type(rows.with_dtype(dtype), *reduction))
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
        Op::RepeatBatch {
            x,
            lengths,
            repeats,
            interleave,
        } => {
            let Type::Ragged { dtype, batch, dims } = ty(*x) else {
                return Err(format!("expects a ragged value, got {}", ty(*x)));
            };
            let old = ty(*x).length_values();
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
                    repeats: *repeats,
                    interleave: *interleave,
                };
                if graph.op(new) != &expected {
                    return Err(format!(
                        "{new} must be repeat_lengths({previous}) with the same repeats"
                    ));
                }
            }
            let mut replacements = lengths.iter();
            let dims = dims
                .into_iter()
                .map(|dim| match dim {
                    ElemDim::Ragged(_) => replacements
                        .next()
                        .map_or(dim.clone(), |&new| ElemDim::Ragged(new)),
                    fixed => fixed,
                })
                .collect();
            Ok(Type::Ragged {
                dtype,
                batch: Dim::Sym(format!("{batch}x{repeats}")),
                dims,
            })
        }
        Op::MseLoss {
            x,
            target,
            reduction,
        } => {
            let (shape, dtype) = broadcast(&ty(*x), &ty(*target))?;
            Ok(loss_type(shape.with_dtype(dtype), *reduction))
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
        Op::Conv2d {
            x,
            weight,
            bias,
            stride,
            padding,
            dilation,
            groups,
        } => {
            let (dtype, shape) = element_image(&ty(*x))?;
            let weight = static_shape(&ty(*weight), "the weight")?;
            let [out, per_group, kh, kw] = weight.as_slice() else {
                return Err(format!(
                    "the weight must be [C_out, C_in / groups, Kh, Kw], got {weight:?}"
                ));
            };
            if shape[0]
                .as_static()
                .is_some_and(|channels| channels != per_group * groups)
            {
                return Err(format!(
                    "the input has {} channels, the weight expects {}",
                    shape[0],
                    per_group * groups
                ));
            }
            if let Some(bias) = bias {
                if static_shape(&ty(*bias), "the bias")? != [*out] {
                    return Err(format!("the bias must be [{out}]"));
                }
            }
            let spatial = [
                window(&shape[1], *kh, stride[0], padding[0], dilation[0]),
                window(&shape[2], *kw, stride[1], padding[1], dilation[1]),
            ];
            Ok(Type::dense(
                dtype,
                [Dim::Static(*out), spatial[0].clone(), spatial[1].clone()],
            ))
        }
        Op::Pool2d {
            x,
            kernel,
            stride,
            padding,
            ..
        } => {
            let (dtype, shape) = element_image(&ty(*x))?;
            Ok(Type::dense(
                dtype,
                [
                    shape[0].clone(),
                    window(&shape[1], kernel[0], stride[0], padding[0], 1),
                    window(&shape[2], kernel[1], stride[1], padding[1], 1),
                ],
            ))
        }
        Op::AdaptiveAvgPool2d { x, output } => {
            let (dtype, shape) = element_image(&ty(*x))?;
            Ok(Type::dense(
                dtype,
                [
                    shape[0].clone(),
                    Dim::Static(output[0]),
                    Dim::Static(output[1]),
                ],
            ))
        }
    }
}

/// The type of a fused expression over inputs of the given types, by the rules of the
/// ops it is made of.
fn infer_fused(expr: &crate::FusedExpr, inputs: &[Type]) -> Inferred {
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

/// The size of a window op's output dim.
fn window(input: &Dim, kernel: i64, stride: i64, padding: i64, dilation: i64) -> Dim {
    match input.as_static() {
        Some(size) => Dim::Static(window_output_size(size, kernel, stride, padding, dilation)),
        None => Dim::Sym("?".into()),
    }
}

/// The output size of a sliding window (convolution, pooling) over `size` positions,
/// as torch computes it (never negative).
pub fn window_output_size(size: i64, kernel: i64, stride: i64, padding: i64, dilation: i64) -> i64 {
    ((size + 2 * padding - dilation * (kernel - 1) - 1).div_euclid(stride) + 1).max(0)
}

fn element_image(ty: &Type) -> Result<(DType, Vec<Dim>), String> {
    match ty {
        Type::Dense { dtype, shape } if shape.len() == 3 => Ok((*dtype, shape.clone())),
        other => Err(format!("expects one element [C, H, W], got {other}")),
    }
}

fn lengths_batch(graph: &Graph, lengths: ValueId) -> Result<Dim, String> {
    match graph.ty(lengths) {
        Type::Lengths { batch } => Ok(batch.clone()),
        other => Err(format!("{lengths} must be a lengths value, got {other}")),
    }
}

fn loss_type(per_position: Type, reduction: LossReduction) -> Type {
    match reduction {
        LossReduction::None => per_position,
        LossReduction::Mean | LossReduction::Sum => {
            Type::dense(per_position.dtype().unwrap_or(DType::F32), [])
        }
    }
}

fn float(ty: &Type) -> Result<DType, String> {
    match ty.dtype() {
        Some(dtype) if dtype.is_float() => Ok(dtype),
        _ => Err(format!("expects floating-point values, got {ty}")),
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
fn broadcast(a: &Type, b: &Type) -> Result<(Type, DType), String> {
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

fn reduce(x: &Type, op: ReduceOp, dims: &[i64], keepdim: bool) -> Inferred {
    let dtype = match (op, x.dtype()) {
        (ReduceOp::All | ReduceOp::Any, _) => DType::Bool,
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

fn attention(q: &Type, k: &Type, v: &Type, qv: ValueId, kv: ValueId, vv: ValueId) -> Inferred {
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
