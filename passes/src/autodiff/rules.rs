//! The VJP rules: for an op computing `value` and the cotangent `g` of `value`, the
//! cotangent contributions of its operands, written with IR ops. One function per op
//! family; an op without a rule is an error naming it. Formulas follow libtorch's
//! derivatives (`tools/autograd/derivatives.yaml`), so gradients match eager autograd,
//! NaN and ties included where the forward op defines them.

use nestor_ir::{
    AttentionGradPart, BinaryOp, DType, Dim, ElemDim, NormGradPart, Op, OpFamily, ReduceOp, Type,
    UnaryOp, ValueId, F64,
};

use super::builder::{rank, Builder};
use super::AutodiffError;

/// Contributions to the cotangents of operands: `(operand, contribution)`.
type Contributions = Vec<(ValueId, ValueId)>;

/// The contributions of the operands of `op` (computing `value`) that `needed` accepts.
pub(super) fn vjp(
    b: &mut Builder,
    value: ValueId,
    op: &Op,
    g: ValueId,
    needed: &dyn Fn(ValueId) -> bool,
) -> Result<Contributions, AutodiffError> {
    let float = |b: &Builder, operand: ValueId| {
        needed(operand) && b.ty(operand).dtype().is_some_and(|dtype| dtype.is_float())
    };
    let wanted: Vec<ValueId> = op.operands().into_iter().filter(|&o| float(b, o)).collect();
    if wanted.is_empty() {
        return Ok(Vec::new());
    }
    let wants = |operand: ValueId| wanted.contains(&operand);
    match op.family() {
        OpFamily::Pointwise => pointwise(b, value, op, g, &wants),
        OpFamily::Gemm => gemm(b, op, g, &wants),
        OpFamily::Reduce => reduce(b, value, op, g),
        OpFamily::Norm => norm(b, value, op, g, &wants),
        OpFamily::Structure => structure(b, op, g),
        OpFamily::Attention => attention(b, op, g, &wants),
        OpFamily::PerElement => per_element(b, op, g, &wants),
        _ => Err(b.no_rule("no rule for this op yet")),
    }
}

fn pointwise(
    b: &mut Builder,
    value: ValueId,
    op: &Op,
    g: ValueId,
    wants: &dyn Fn(ValueId) -> bool,
) -> Result<Contributions, AutodiffError> {
    match *op {
        Op::Unary { op, x } => Ok(vec![(x, unary(b, op, x, value, g)?)]),
        Op::Binary { op, lhs, rhs } => binary(b, op, (lhs, rhs), value, g, wants),
        Op::Where { condition, x, y } => {
            let zero = b.constant(0.0, g)?;
            let mut out = Vec::new();
            if wants(x) {
                let taken = b.select(condition, g, zero)?;
                out.push((x, b.unbroadcast(taken, x)?));
            }
            if wants(y) {
                let taken = b.select(condition, zero, g)?;
                out.push((y, b.unbroadcast(taken, y)?));
            }
            Ok(out)
        }
        Op::Cast { x, .. } => Ok(vec![(x, b.cast_like(g, x)?)]),
        // Passes where `min <= x <= max` (0 at NaN), as torch's clamp.
        Op::Clamp { x, min, max } => {
            let (low, high, zero) = (
                b.constant(min.0, x)?,
                b.constant(max.0, x)?,
                b.constant(0.0, g)?,
            );
            let above = b.binary(BinaryOp::Ge, x, low)?;
            let below = b.binary(BinaryOp::Le, x, high)?;
            let inside = b.binary(BinaryOp::And, above, below)?;
            Ok(vec![(x, b.select(inside, g, zero)?)])
        }
        Op::Dropout {
            x, train: false, ..
        } => Ok(vec![(x, g)]),
        // The mask reads `like` for its shape only: no gradient flows through it.
        Op::RandomMask { .. } => Ok(Vec::new()),
        _ => Err(b.no_rule("no rule for this op yet")),
    }
}

/// `g * f'(x)` for `y = f(x)`.
fn unary(
    b: &mut Builder,
    op: UnaryOp,
    x: ValueId,
    y: ValueId,
    g: ValueId,
) -> Result<ValueId, AutodiffError> {
    use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI, PI};
    let gradient = match op {
        UnaryOp::Neg => b.unary(UnaryOp::Neg, g)?,
        UnaryOp::Abs => {
            let sign = b.unary(UnaryOp::Sign, x)?;
            b.mul(g, sign)?
        }
        UnaryOp::Exp => b.mul(g, y)?,
        UnaryOp::Log => b.div(g, x)?,
        UnaryOp::Sqrt => {
            let twice = b.scale(y, 2.0)?;
            b.div(g, twice)?
        }
        UnaryOp::Rsqrt => {
            let square = b.mul(y, y)?;
            let cube = b.mul(square, y)?;
            let factor = b.scale(cube, -0.5)?;
            b.mul(g, factor)?
        }
        UnaryOp::Square => {
            let twice = b.scale(x, 2.0)?;
            b.mul(g, twice)?
        }
        UnaryOp::Sin => {
            let cos = b.unary(UnaryOp::Cos, x)?;
            b.mul(g, cos)?
        }
        UnaryOp::Cos => {
            let sin = b.unary(UnaryOp::Sin, x)?;
            let negative = b.unary(UnaryOp::Neg, sin)?;
            b.mul(g, negative)?
        }
        UnaryOp::Tanh => {
            let square = b.mul(y, y)?;
            let one = b.constant(1.0, y)?;
            let slope = b.sub(one, square)?;
            b.mul(g, slope)?
        }
        UnaryOp::Sigmoid => {
            let one = b.constant(1.0, y)?;
            let complement = b.sub(one, y)?;
            let slope = b.mul(y, complement)?;
            b.mul(g, slope)?
        }
        UnaryOp::Relu => {
            // libtorch's threshold_backward: no gradient where the result is <= 0 (a
            // NaN result passes the gradient through).
            let zero = b.constant(0.0, y)?;
            let off = b.binary(BinaryOp::Le, y, zero)?;
            b.select(off, zero, g)?
        }
        UnaryOp::Gelu => {
            // Phi(x) + x phi(x).
            let scaled = b.scale(x, FRAC_1_SQRT_2)?;
            let erf = b.unary(UnaryOp::Erf, scaled)?;
            let one = b.constant(1.0, x)?;
            let shifted = b.add(one, erf)?;
            let cdf = b.scale(shifted, 0.5)?;
            let square = b.mul(x, x)?;
            let exponent = b.scale(square, -0.5)?;
            let exp = b.unary(UnaryOp::Exp, exponent)?;
            let pdf = b.scale(exp, 1.0 / (2.0 * PI).sqrt())?;
            let tail = b.mul(x, pdf)?;
            let slope = b.add(cdf, tail)?;
            b.mul(g, slope)?
        }
        UnaryOp::GeluTanh => gelu_tanh(b, x, g)?,
        UnaryOp::Silu => {
            // s (1 + x (1 - s)).
            let s = b.unary(UnaryOp::Sigmoid, x)?;
            let one = b.constant(1.0, x)?;
            let complement = b.sub(one, s)?;
            let inner = b.mul(x, complement)?;
            let shifted = b.add(one, inner)?;
            let slope = b.mul(s, shifted)?;
            b.mul(g, slope)?
        }
        UnaryOp::Erf => {
            let square = b.mul(x, x)?;
            let negative = b.unary(UnaryOp::Neg, square)?;
            let exp = b.unary(UnaryOp::Exp, negative)?;
            let slope = b.scale(exp, FRAC_2_SQRT_PI)?;
            b.mul(g, slope)?
        }
        UnaryOp::Expm1 => {
            let one = b.constant(1.0, x)?;
            let slope = b.add(y, one)?;
            b.mul(g, slope)?
        }
        UnaryOp::Log1p => {
            let one = b.constant(1.0, x)?;
            let divisor = b.add(x, one)?;
            b.div(g, divisor)?
        }
        UnaryOp::Reciprocal => {
            let square = b.mul(y, y)?;
            let slope = b.unary(UnaryOp::Neg, square)?;
            b.mul(g, slope)?
        }
        // Steps: zero almost everywhere, as torch.
        UnaryOp::Sign | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round => {
            let zero = b.constant(0.0, g)?;
            let everywhere = b.binary(BinaryOp::Eq, g, g)?;
            b.select(everywhere, zero, zero)?
        }
        UnaryOp::Not => return Err(b.no_rule(format!("{} has no gradient", op.word()))),
    };
    Ok(gradient)
}

/// The derivative of the tanh-approximated GELU, as libtorch writes it.
fn gelu_tanh(b: &mut Builder, x: ValueId, g: ValueId) -> Result<ValueId, AutodiffError> {
    const KAPPA: f64 = 0.044715;
    let beta = (2.0 / std::f64::consts::PI).sqrt();
    let square = b.mul(x, x)?;
    let cube = b.mul(square, x)?;
    let scaled_cube = b.scale(cube, KAPPA)?;
    let sum = b.add(x, scaled_cube)?;
    let inner = b.scale(sum, beta)?;
    let tanh = b.unary(UnaryOp::Tanh, inner)?;
    let one = b.constant(1.0, x)?;
    let right = b.add(one, tanh)?;
    let left_derivative = b.scale(right, 0.5)?;
    let tanh_square = b.mul(tanh, tanh)?;
    let sech_square = b.sub(one, tanh_square)?;
    let scaled_square = b.scale(square, 3.0 * KAPPA)?;
    let inner_slope = b.add(one, scaled_square)?;
    let half_x = b.scale(x, 0.5)?;
    let product = b.mul(half_x, sech_square)?;
    let product = b.mul(product, inner_slope)?;
    let right_derivative = b.scale(product, beta)?;
    let slope = b.add(left_derivative, right_derivative)?;
    b.mul(g, slope)
}

fn binary(
    b: &mut Builder,
    op: BinaryOp,
    (lhs, rhs): (ValueId, ValueId),
    y: ValueId,
    g: ValueId,
    wants: &dyn Fn(ValueId) -> bool,
) -> Result<Contributions, AutodiffError> {
    let (left, right) = match op {
        BinaryOp::Add => (Some(g), Some(g)),
        BinaryOp::Sub => (Some(g), Some(b.unary(UnaryOp::Neg, g)?)),
        BinaryOp::Mul => (
            wants(lhs).then(|| b.mul(g, rhs)).transpose()?,
            wants(rhs).then(|| b.mul(g, lhs)).transpose()?,
        ),
        BinaryOp::Div => {
            let left = b.div(g, rhs)?;
            let right = if wants(rhs) {
                // -g a / b^2 = -(g / b) * y.
                let scaled = b.mul(left, y)?;
                Some(b.unary(UnaryOp::Neg, scaled)?)
            } else {
                None
            };
            (Some(left), right)
        }
        BinaryOp::Maximum | BinaryOp::Minimum => {
            // The larger (smaller) side takes the gradient; ties split it, as libtorch.
            let wins = if op == BinaryOp::Maximum {
                BinaryOp::Gt
            } else {
                BinaryOp::Lt
            };
            let zero = b.constant(0.0, g)?;
            let half = b.scale(g, 0.5)?;
            let tie = b.binary(BinaryOp::Eq, lhs, rhs)?;
            let side = |b: &mut Builder, this: ValueId, other: ValueId| {
                let win = b.binary(wins, this, other)?;
                let shared = b.select(tie, half, zero)?;
                b.select(win, g, shared)
            };
            (
                wants(lhs).then(|| side(b, lhs, rhs)).transpose()?,
                wants(rhs).then(|| side(b, rhs, lhs)).transpose()?,
            )
        }
        BinaryOp::Pow => {
            // d/da = b a^(b - 1) = b y / a would divide by zero; libtorch's form:
            let one = b.constant(1.0, g)?;
            let left = if wants(lhs) {
                let exponent = b.sub(rhs, one)?;
                let power = b.binary(BinaryOp::Pow, lhs, exponent)?;
                let slope = b.mul(rhs, power)?;
                Some(b.mul(g, slope)?)
            } else {
                None
            };
            let right = if wants(rhs) {
                let log = b.unary(UnaryOp::Log, lhs)?;
                let slope = b.mul(y, log)?;
                Some(b.mul(g, slope)?)
            } else {
                None
            };
            (left, right)
        }
        BinaryOp::Remainder => {
            // y = a - b floor(a / b): d/da = 1, d/db = -floor(a / b) = -(a - y) / b.
            let right = if wants(rhs) {
                let whole = b.sub(lhs, y)?;
                let quotient = b.div(whole, rhs)?;
                let slope = b.mul(g, quotient)?;
                Some(b.unary(UnaryOp::Neg, slope)?)
            } else {
                None
            };
            (Some(g), right)
        }
        BinaryOp::Atan2 => {
            // d/da = b / (a^2 + b^2), d/db = -a / (a^2 + b^2).
            let lhs_square = b.mul(lhs, lhs)?;
            let rhs_square = b.mul(rhs, rhs)?;
            let radius = b.add(lhs_square, rhs_square)?;
            let scaled = b.div(g, radius)?;
            let left = wants(lhs).then(|| b.mul(scaled, rhs)).transpose()?;
            let right = if wants(rhs) {
                let slope = b.mul(scaled, lhs)?;
                Some(b.unary(UnaryOp::Neg, slope)?)
            } else {
                None
            };
            (left, right)
        }
        _ => return Ok(Vec::new()),
    };
    let mut out = Vec::new();
    for (operand, gradient) in [(lhs, left), (rhs, right)] {
        if let (true, Some(gradient)) = (wants(operand), gradient) {
            out.push((operand, b.unbroadcast(gradient, operand)?));
        }
    }
    Ok(out)
}

fn gemm(
    b: &mut Builder,
    op: &Op,
    g: ValueId,
    wants: &dyn Fn(ValueId) -> bool,
) -> Result<Contributions, AutodiffError> {
    let mut out = Vec::new();
    match *op {
        Op::Linear { x, weight, bias } => {
            if wants(x) {
                out.push((x, b.push(Op::Matmul { x: g, w: weight })?));
            }
            if wants(weight) {
                out.push((weight, b.push(Op::ContractRows { a: g, b: x })?));
            }
            if let Some(bias) = bias.filter(|&bias| wants(bias)) {
                out.push((bias, b.unbroadcast(g, bias)?));
            }
        }
        Op::PairMatmul { a, b: right } => {
            let transpose = |b: &mut Builder, x: ValueId| {
                b.push(Op::TransposeRagged {
                    x,
                    dim0: 0,
                    dim1: 1,
                })
            };
            let scores = matches!(b.ty(right), Type::Ragged { dims, .. }
                if matches!(dims.first(), Some(nestor_ir::ElemDim::Fixed(_))));
            if scores {
                // c [M, N] = a [M, K] b [K, N]: da = c' b^T, db = (c'^T a)^T.
                if wants(a) {
                    let b_t = transpose(b, right)?;
                    out.push((a, b.push(Op::PairMatmul { a: g, b: b_t })?));
                }
                if wants(right) {
                    let g_t = transpose(b, g)?;
                    let product = b.push(Op::PairMatmul { a: g_t, b: a })?;
                    out.push((right, transpose(b, product)?));
                }
            } else {
                // c [M, D] = p [M, N] v [N, D]: dp = c' v^T, dv = p^T c'.
                if wants(a) {
                    let v_t = transpose(b, right)?;
                    out.push((a, b.push(Op::PairMatmul { a: g, b: v_t })?));
                }
                if wants(right) {
                    let p_t = transpose(b, a)?;
                    out.push((right, b.push(Op::PairMatmul { a: p_t, b: g })?));
                }
            }
        }
        Op::Cdist { a, b: right, p } if p.0 != 2.0 => {
            let [da, db] = cdist_gradients(b, (a, right), p.0, g)?;
            for (point, gradient) in [(a, da), (right, db)] {
                if wants(point) {
                    out.push((point, gradient));
                }
            }
        }
        Op::Cdist { a, b: right, p } => {
            // d [M, N] = |a_i - b_j|: with w = g / d (0 where d = 0, as torch),
            // da = a rowsum(w) - w b and db = b rowsum(w^T) - w^T a.
            let distances = b.push(Op::Cdist { a, b: right, p })?;
            let zero = b.constant(0.0, distances)?;
            let apart = b.binary(BinaryOp::Ne, distances, zero)?;
            let ratio = b.div(g, distances)?;
            let w = b.select(apart, ratio, zero)?;
            let w_t = b.push(Op::TransposeRagged {
                x: w,
                dim0: 0,
                dim1: 1,
            })?;
            for (point, weights, other) in [(a, w, right), (right, w_t, a)] {
                if wants(point) {
                    let total = b.reduce(ReduceOp::Sum, weights, vec![2], true)?;
                    let own = b.mul(point, total)?;
                    let mixed = b.push(Op::PairMatmul {
                        a: weights,
                        b: other,
                    })?;
                    out.push((point, b.sub(own, mixed)?));
                }
            }
        }
        Op::Matmul { x, w } => {
            if matches!(b.ty(w), Type::Dense { shape, .. } if shape.len() != 2) {
                return Err(b.no_rule("the gradient of a matrix-vector product"));
            }
            if wants(x) {
                out.push((
                    x,
                    b.push(Op::Linear {
                        x: g,
                        weight: w,
                        bias: None,
                    })?,
                ));
            }
            if wants(w) {
                out.push((w, b.push(Op::ContractRows { a: x, b: g })?));
            }
        }
        Op::Embedding {
            ids,
            weight,
            padding_idx,
        } => {
            let vocabulary = match b.ty(weight) {
                Type::Dense { shape, .. } => shape.first().and_then(|dim| dim.as_static()),
                _ => None,
            }
            .ok_or_else(|| b.no_rule("a table of unknown size"))?;
            out.push((
                weight,
                b.push(Op::ScatterRows {
                    g,
                    ids,
                    vocabulary,
                    padding_idx,
                })?,
            ));
        }
        _ => return Err(b.no_rule("no rule for this op yet")),
    }
    Ok(out)
}

fn reduce(
    b: &mut Builder,
    y: ValueId,
    op: &Op,
    g: ValueId,
) -> Result<Contributions, AutodiffError> {
    // The k-th smallest value's gradient goes to its position alone.
    if let Op::KthValue {
        x,
        axis,
        k,
        positions: false,
        ..
    } = *op
    {
        return Ok(vec![(x, b.push(Op::KthGrad { g, x, axis, k })?)]);
    }
    let Op::Reduce {
        op: kind,
        x,
        ref dims,
        keepdim,
        ..
    } = *op
    else {
        return Err(b.no_rule("not a reduction"));
    };
    if let (ReduceOp::Max | ReduceOp::Min, [axis]) = (kind, dims.as_slice()) {
        // To the first position of the extreme alone, as torch's max(dim).
        let gradient = b.push(Op::ExtremeGrad {
            g,
            x,
            axis: *axis,
            largest: kind == ReduceOp::Max,
        })?;
        return Ok(vec![(x, gradient)]);
    }
    if !matches!(
        kind,
        ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Amax | ReduceOp::Amin | ReduceOp::LogSumExp
    ) {
        return Err(b.no_rule(format!("no rule for {} yet", kind.word())));
    }
    let full = rank(b.ty(x)) as i64;
    let mut reduced: Vec<i64> = dims
        .iter()
        .map(|&dim| if dim < 0 { dim + full } else { dim })
        .collect();
    if reduced.is_empty() {
        reduced = (0..full).collect();
    }
    let inserted = if keepdim || dims.is_empty() {
        Vec::new()
    } else {
        reduced.clone()
    };
    let spread = b.expand(g, x, inserted.clone())?;
    let gradient = match kind {
        ReduceOp::Mean => {
            let count = b.count(x, &reduced)?;
            b.div(spread, count)?
        }
        ReduceOp::Amax | ReduceOp::Amin => {
            // Shared evenly by the values equal to the result, as libtorch.
            let extreme = b.expand(y, x, inserted)?;
            let hit = b.binary(BinaryOp::Eq, x, extreme)?;
            let dtype = b.ty(x).dtype().unwrap_or(DType::F32);
            let mask = b.push(Op::Cast { x: hit, dtype })?;
            let ties = b.reduce(ReduceOp::Sum, mask, reduced, true)?;
            let ties = b.expand(ties, x, Vec::new())?;
            let share = b.div(spread, ties)?;
            b.mul(share, mask)?
        }
        // g * exp(x - logsumexp(x)), as libtorch.
        ReduceOp::LogSumExp => {
            let result = b.expand(y, x, inserted)?;
            let shifted = b.sub(x, result)?;
            let weights = b.unary(UnaryOp::Exp, shifted)?;
            b.mul(spread, weights)?
        }
        _ => spread,
    };
    Ok(vec![(x, gradient)])
}

fn norm(
    b: &mut Builder,
    y: ValueId,
    op: &Op,
    g: ValueId,
    wants: &dyn Fn(ValueId) -> bool,
) -> Result<Contributions, AutodiffError> {
    match *op {
        Op::Softmax { x, axis, log } => {
            let full = rank(b.ty(x)) as i64;
            let axis = if axis < 0 { axis + full } else { axis };
            let sum_along =
                |b: &mut Builder, v: ValueId| b.reduce(ReduceOp::Sum, v, vec![axis], true);
            let gradient = if log {
                // g - exp(y) * sum(g).
                let total = sum_along(b, g)?;
                let probabilities = b.unary(UnaryOp::Exp, y)?;
                let share = b.mul(probabilities, total)?;
                b.sub(g, share)?
            } else {
                // y * (g - sum(g * y)).
                let weighted = b.mul(g, y)?;
                let total = sum_along(b, weighted)?;
                let centered = b.sub(g, total)?;
                b.mul(y, centered)?
            };
            Ok(vec![(x, gradient)])
        }
        // A sum's gradient is the sum the other way.
        Op::Cumulative {
            x,
            axis,
            product: false,
            reverse,
        } => Ok(vec![(x, scan(b, g, axis, false, !reverse)?)]),
        Op::Cumulative {
            x,
            axis,
            product: true,
            reverse: false,
        } => Ok(vec![(x, cumprod_gradient(b, x, axis, g)?)]),
        // Each top value's gradient goes back where the value came from.
        Op::TopK {
            x,
            axis,
            k,
            largest,
            positions: false,
            ..
        } => Ok(vec![(
            x,
            b.push(Op::TopKGrad {
                g,
                x,
                axis,
                k,
                largest,
            })?,
        )]),
        // Each running value's gradient goes where the value was seen.
        Op::Running {
            x,
            axis,
            largest,
            positions: false,
        } => Ok(vec![(
            x,
            b.push(Op::RunningGrad {
                g,
                x,
                axis,
                largest,
            })?,
        )]),
        // Each sorted value's gradient goes back where the value came from.
        Op::Sort {
            x,
            axis,
            descending,
            positions: false,
        } => Ok(vec![(
            x,
            b.push(Op::SortGrad {
                g,
                x,
                axis,
                descending,
            })?,
        )]),
        Op::LayerNorm {
            x,
            weight,
            bias,
            dims,
            eps,
        } => normalization(b, (x, weight, bias), dims, eps.0, true, g, wants),
        Op::RmsNorm {
            x,
            weight,
            dims,
            eps,
        } => normalization(b, (x, weight, None), dims, eps.0, false, g, wants),
        Op::NormGrad { .. } => Err(b.no_rule("the gradient of a norm's gradient")),
        _ => Err(b.no_rule("no rule for this op yet")),
    }
}

/// The cumulative sum (or product) of `x` along `axis`, reversed or not.
fn scan(
    b: &mut Builder,
    x: ValueId,
    axis: i64,
    product: bool,
    reverse: bool,
) -> Result<ValueId, AutodiffError> {
    b.push(Op::Cumulative {
        x,
        axis,
        product,
        reverse,
    })
}

/// The gradient of `y = cumprod(x)` along `axis`, zeros included as torch's: before an
/// element's first zero `dx_i = sum_{j >= i} g_j y_j / x_i` (the rows from its first
/// zero on have `y_j = 0`); at the first zero the same sum over the products with that
/// zero left out (`cumprod` of `x` with it replaced by 1); after it 0 (every product
/// there has two zeros or the first zero and `x_i`'s own row's).
fn cumprod_gradient(
    b: &mut Builder,
    x: ValueId,
    axis: i64,
    g: ValueId,
) -> Result<ValueId, AutodiffError> {
    let (zero, one) = (b.constant(0.0, x)?, b.constant(1.0, x)?);
    let is_zero = b.binary(BinaryOp::Eq, x, zero)?;
    let zeros = b.cast_like(is_zero, x)?;
    let zeros_so_far = scan(b, zeros, axis, false, false)?;
    let before = b.binary(BinaryOp::Eq, zeros_so_far, zero)?;
    let first = b.binary(BinaryOp::Eq, zeros_so_far, one)?;
    let first_zero = b.binary(BinaryOp::And, is_zero, first)?;
    // Before the first zero.
    let y = scan(b, x, axis, true, false)?;
    let weighted = b.mul(g, y)?;
    let later = scan(b, weighted, axis, false, true)?;
    let divisor = b.select(before, x, one)?;
    let early = b.div(later, divisor)?;
    // At the first zero.
    let without = b.select(first_zero, one, x)?;
    let y_without = scan(b, without, axis, true, false)?;
    let weighted = b.mul(g, y_without)?;
    let at_zero = scan(b, weighted, axis, false, true)?;
    let rest = b.select(first_zero, at_zero, zero)?;
    b.select(before, early, rest)
}

/// Layer norm (`centered`) or RMS norm over the last dim: `dx = rstd (gw - mean(gw) -
/// xhat mean(gw xhat))` (no `mean(gw)` term for RMS norm; `gw` multiplied as `g` is
/// read) and the products `g xhat`
/// whose column sums are `dw`, each one row kernel that recomputes the row's statistics
/// ([`Op::NormGrad`]); `db = sum(g)` over the rows.
#[allow(clippy::too_many_arguments)]
fn normalization(
    b: &mut Builder,
    (x, weight, bias): (ValueId, Option<ValueId>, Option<ValueId>),
    dims: usize,
    eps: f64,
    centered: bool,
    g: ValueId,
    wants: &dyn Fn(ValueId) -> bool,
) -> Result<Contributions, AutodiffError> {
    if dims != 1 {
        return Err(b.no_rule("the gradient of a norm over more than the last dim"));
    }
    let gradient = |b: &mut Builder, weight: Option<ValueId>, part: NormGradPart| {
        b.push(Op::NormGrad {
            x,
            g,
            weight,
            eps: F64(eps),
            centered,
            part,
        })
    };
    let mut out = Vec::new();
    if wants(x) {
        // The row kernel multiplies `g` by the weight as it reads it.
        out.push((x, gradient(b, weight, NormGradPart::Input)?));
    }
    if let Some(weight) = weight.filter(|&weight| wants(weight)) {
        let product = gradient(b, None, NormGradPart::Weight)?;
        out.push((weight, b.unbroadcast(product, weight)?));
    }
    if let Some(bias) = bias.filter(|&bias| wants(bias)) {
        out.push((bias, b.unbroadcast(g, bias)?));
    }
    Ok(out)
}

fn structure(b: &mut Builder, op: &Op, g: ValueId) -> Result<Contributions, AutodiffError> {
    match *op {
        Op::ReshapeTail { x, .. } => {
            let tail = b
                .ty(x)
                .ragged_tail()
                .ok_or_else(|| b.no_rule("a reshape of a dense value"))?;
            Ok(vec![(x, b.push(Op::ReshapeTail { x: g, tail })?)])
        }
        Op::SelectStatic { x, dim, index } => {
            let size = static_size(b, x, dim)
                .ok_or_else(|| b.no_rule("a selection from a dim of unknown size"))?;
            let inserted = b.push(Op::InsertStatic {
                x: g,
                dim,
                index,
                size,
            })?;
            Ok(vec![(x, inserted)])
        }
        // A static slice and padding with zeros are each other's gradient.
        Op::SliceStatic { x, dim, start, end } => {
            let size = static_size(b, x, dim)
                .ok_or_else(|| b.no_rule("a slice of a dim of unknown size"))?;
            let padded = b.push(Op::PadStatic {
                x: g,
                dim,
                before: start,
                after: size - end,
            })?;
            Ok(vec![(x, padded)])
        }
        Op::PadStatic { x, dim, before, .. } => {
            let size = static_size(b, x, dim)
                .ok_or_else(|| b.no_rule("padding of a dim of unknown size"))?;
            let sliced = b.push(Op::SliceStatic {
                x: g,
                dim,
                start: before,
                end: before + size,
            })?;
            Ok(vec![(x, sliced)])
        }
        // A slice of the ragged dim and its rows put back among zeros are each other's
        // gradient.
        Op::SliceRagged { x, start, end, .. } => {
            let unsliced = b.push(Op::UnsliceRagged {
                g,
                like: x,
                start,
                end,
            })?;
            Ok(vec![(x, unsliced)])
        }
        Op::UnsliceRagged {
            g: x, start, end, ..
        } => {
            let lengths = b.ty(x).length_values();
            let lengths = *lengths
                .first()
                .ok_or_else(|| b.no_rule("the slice is not a ragged batch"))?;
            let sliced = b.push(Op::SliceRagged {
                x: g,
                lengths,
                start,
                end,
            })?;
            Ok(vec![(x, sliced)])
        }
        // Padding and packing are each other's gradient.
        Op::Pad { x, .. } => {
            let lengths = b
                .ty(x)
                .length_values()
                .first()
                .copied()
                .ok_or_else(|| b.no_rule("padding a value without lengths"))?;
            Ok(vec![(x, b.push(Op::Unpad { x: g, lengths })?)])
        }
        Op::Unpad { x, .. } => Ok(vec![(
            x,
            b.push(Op::Pad {
                x: g,
                value: nestor_ir::F64(0.0),
            })?,
        )]),
        Op::TransposeStatic { x, dim0, dim1 } => {
            Ok(vec![(x, b.push(Op::TransposeStatic { x: g, dim0, dim1 })?)])
        }
        Op::TransposeRagged { x, dim0, dim1 } => {
            Ok(vec![(x, b.push(Op::TransposeRagged { x: g, dim0, dim1 })?)])
        }
        // Masked positions do not depend on x.
        Op::CausalFill { x, .. } => Ok(vec![(
            x,
            b.push(Op::CausalFill {
                x: g,
                value: nestor_ir::F64(0.0),
            })?,
        )]),
        Op::Reshape { x, .. } => {
            let shape = match b.ty(x) {
                Type::Dense { shape, .. } => shape.iter().map(Dim::as_static).collect(),
                _ => None,
            }
            .ok_or_else(|| b.no_rule("a reshape of a value without a static shape"))?;
            Ok(vec![(x, b.push(Op::Reshape { x: g, shape })?)])
        }
        // Each element's copies summed back.
        Op::RepeatBatch {
            x,
            repeats,
            interleave,
            ..
        } => Ok(vec![(
            x,
            b.push(Op::UnrepeatBatch {
                g,
                like: x,
                repeats,
                interleave,
            })?,
        )]),
        // The gradient seen with x's own lengths again.
        Op::MatchLengths { x, .. } => {
            let lengths = b.ty(x).length_values();
            Ok(vec![(x, b.push(Op::MatchLengths { x: g, lengths })?)])
        }
        // The size-1 dim selected away.
        Op::Unsqueeze { x, dim } => Ok(vec![(
            x,
            b.push(Op::SelectStatic {
                x: g,
                dim,
                index: 0,
            })?,
        )]),
        _ => Err(b.no_rule("no rule for this op yet")),
    }
}

/// Varlen attention: self-attention's three gradients stacked (one recomputation of the
/// scores), else the queries' gradient, and the keys' and values' stacked (one each),
/// split with `select_static`.
fn attention(
    b: &mut Builder,
    op: &Op,
    g: ValueId,
    wants: &dyn Fn(ValueId) -> bool,
) -> Result<Contributions, AutodiffError> {
    let Op::Attention {
        q,
        k,
        v,
        causal,
        scale,
    } = *op
    else {
        return Err(b.no_rule("no rule for this op yet"));
    };
    let gradient = |b: &mut Builder, part: AttentionGradPart| {
        b.push(Op::AttentionGrad {
            q,
            k,
            v,
            g,
            causal,
            scale,
            part,
        })
    };
    // The stacked gradients of `operands` (at 0, 1, ..), each selected.
    let select = |b: &mut Builder, stacked: ValueId, operands: &[ValueId]| {
        let mut out = Vec::new();
        for (index, &operand) in operands.iter().enumerate() {
            if wants(operand) {
                let x = stacked;
                let index = index as i64;
                out.push((operand, b.push(Op::SelectStatic { x, dim: 1, index })?));
            }
        }
        Ok::<_, AutodiffError>(out)
    };
    let one_type = b.ty(q) == b.ty(k) && b.ty(k) == b.ty(v);
    if one_type && [q, k, v].into_iter().all(wants) {
        let stacked = gradient(b, AttentionGradPart::All)?;
        return select(b, stacked, &[q, k, v]);
    }
    let mut out = Vec::new();
    if wants(q) {
        out.push((q, gradient(b, AttentionGradPart::Queries)?));
    }
    if wants(k) || wants(v) {
        let stacked = gradient(b, AttentionGradPart::KeysValues)?;
        out.extend(select(b, stacked, &[k, v])?);
    }
    Ok(out)
}

/// The window of a convolution by `weight` whose gradients compile: a static 2-d one
/// (an error naming it otherwise).
fn differentiable_kernel(b: &Builder, weight: ValueId) -> Result<Vec<i64>, AutodiffError> {
    let kernel = match b.ty(weight) {
        Type::Dense { shape, .. } if shape.len() == 4 => shape[2..]
            .iter()
            .filter_map(Dim::as_static)
            .collect::<Vec<_>>(),
        _ => Vec::new(),
    };
    if kernel.len() != 2 {
        return Err(b.no_rule("compiled gradients of convolutions need a static 2-d window"));
    }
    Ok(kernel)
}

/// A per-element region of one convolution or global average pooling of
/// images with ragged `H` and `W`.
fn per_element(
    b: &mut Builder,
    op: &Op,
    g: ValueId,
    wants: &dyn Fn(ValueId) -> bool,
) -> Result<Contributions, AutodiffError> {
    let Op::PerElement { inputs, body } = op else {
        return Err(b.no_rule("not a per-element region"));
    };
    let ([output], Some(&images)) = (&body.outputs[..], inputs.first()) else {
        return Err(b.no_rule("a region of more than one op"));
    };
    // The region operand a body value stands for (the images are operand 0).
    let region_input = |id: ValueId| body.input_position(id).map(|position| inputs[position]);
    let mut out = Vec::new();
    match body.op(*output) {
        Op::Conv2d {
            x,
            weight,
            bias,
            stride,
            padding,
            dilation,
            groups,
        } if region_input(*x) == Some(images) => {
            let weight = region_input(*weight)
                .ok_or_else(|| b.no_rule("the weight is not an input of the region"))?;
            let kernel = differentiable_kernel(b, weight)?;
            if wants(images) {
                let grad = b.push(Op::Conv2dInputGrad {
                    g,
                    weight,
                    x: images,
                    stride: stride.clone(),
                    padding: padding.clone(),
                    dilation: dilation.clone(),
                    groups: *groups,
                })?;
                out.push((images, grad));
            }
            if wants(weight) {
                let grad = b.push(Op::Conv2dWeightGrad {
                    x: images,
                    g,
                    kernel,
                    stride: stride.clone(),
                    padding: padding.clone(),
                    dilation: dilation.clone(),
                    groups: *groups,
                })?;
                out.push((weight, b.cast_like(grad, weight)?));
            }
            if let Some(bias) = bias.and_then(region_input).filter(|&bias| wants(bias)) {
                // Every pixel of every image: the batch and both ragged dims.
                let grad = b.reduce(ReduceOp::Sum, g, vec![0, 2, 3], false)?;
                out.push((bias, b.cast_like(grad, bias)?));
            }
        }
        Op::Pool2d {
            kind,
            x,
            kernel,
            stride,
            padding,
        } if region_input(*x) == Some(images) => {
            if wants(images) {
                let grad = b.push(Op::Pool2dGrad {
                    max: *kind == nestor_ir::PoolKind::Max,
                    x: images,
                    g,
                    kernel: kernel.clone(),
                    stride: stride.clone(),
                    padding: padding.clone(),
                })?;
                out.push((images, grad));
            }
        }
        Op::AdaptiveAvgPool2d { x, output }
            if region_input(*x) == Some(images) && output[..] == [1, 1] =>
        {
            if wants(images) {
                out.push((images, b.push(Op::ImageMeanGrad { g, x: images })?));
            }
        }
        Op::AdaptiveAvgPool2d { x, output } if region_input(*x) == Some(images) => {
            if wants(images) {
                let grad = b.push(Op::AdaptiveAvgPool2dGrad {
                    g,
                    x: images,
                    output: output.clone(),
                })?;
                out.push((images, grad));
            }
        }
        Op::InterpolateBilinear {
            x,
            output,
            align_corners,
        } if region_input(*x) == Some(images) => {
            if wants(images) {
                let grad = b.push(Op::InterpolateBilinearGrad {
                    g,
                    x: images,
                    output: output.clone(),
                    align_corners: *align_corners,
                })?;
                out.push((images, grad));
            }
        }
        other => {
            return Err(b.no_rule(format!(
                "no compiled gradient for a per-element {} yet",
                other.name()
            )))
        }
    }
    Ok(out)
}

/// The gradients of `cdist(a, right)` (`[M, D]` and `[N, D]` points, `p != 2`) for the
/// distances' gradient `g`, as torch's: each coordinate's difference `x = a_m - b_n`
/// (pairs `[M, N, D]`) scaled by `sign(x) |x|^(p-1) / d^(p-1)` (0 where `d = 0`, and
/// where `x = 0` for `p < 1`), `sign(x)` for `p = 1`, `sign(x)` where `|x| = d` for
/// `p = inf`, 0 for `p = 0`; summed over the other set (negated for `right`).
fn cdist_gradients(
    b: &mut Builder,
    (a, right): (ValueId, ValueId),
    p: f64,
    g: ValueId,
) -> Result<[ValueId; 2], AutodiffError> {
    let rows = b.push(Op::Unsqueeze { x: a, dim: 1 })?;
    let columns = b.push(Op::Unsqueeze { x: right, dim: 0 })?;
    let difference = b.sub(rows, columns)?;
    let distances = b.push(Op::Cdist {
        a,
        b: right,
        p: F64(p),
    })?;
    let distances = b.push(Op::Unsqueeze {
        x: distances,
        dim: 2,
    })?;
    let g = b.push(Op::Unsqueeze { x: g, dim: 2 })?;
    let zero = b.constant(0.0, difference)?;
    let sign = b.unary(UnaryOp::Sign, difference)?;
    let magnitude = b.unary(UnaryOp::Abs, difference)?;
    let term = if p == 0.0 {
        let everywhere = b.binary(BinaryOp::Eq, difference, difference)?;
        b.select(everywhere, zero, zero)?
    } else if p == 1.0 {
        b.mul(sign, g)?
    } else if p.is_infinite() {
        let largest = b.binary(BinaryOp::Eq, magnitude, distances)?;
        let signed = b.select(largest, sign, zero)?;
        b.mul(signed, g)?
    } else {
        let below = b.constant(p - 1.0, difference)?;
        let scaled = b.binary(BinaryOp::Pow, magnitude, below)?;
        let scaled = b.mul(sign, scaled)?;
        let norm = b.binary(BinaryOp::Pow, distances, below)?;
        let ratio = b.div(g, norm)?;
        let term = b.mul(scaled, ratio)?;
        // 0 where the distance is 0, and where the coordinates agree for p < 1.
        let apart = b.binary(BinaryOp::Ne, distances, zero)?;
        let term = b.select(apart, term, zero)?;
        match p < 1.0 {
            true => {
                let differs = b.binary(BinaryOp::Ne, difference, zero)?;
                b.select(differs, term, zero)?
            }
            false => term,
        }
    };
    // Sums over the pairs' second ragged dim: `right`'s through the transpose.
    let da = b.reduce(ReduceOp::Sum, term, vec![2], false)?;
    let transposed = b.push(Op::TransposeRagged {
        x: term,
        dim0: 0,
        dim1: 1,
    })?;
    let db = b.reduce(ReduceOp::Sum, transposed, vec![2], false)?;
    Ok([da, b.unary(UnaryOp::Neg, db)?])
}

/// The size of `x`'s static element dim `dim`, when it is one.
fn static_size(b: &Builder, x: ValueId, dim: usize) -> Option<i64> {
    match b.ty(x) {
        Type::Ragged { dims, .. } => match dims.get(dim) {
            Some(ElemDim::Fixed(size)) => size.as_static(),
            _ => None,
        },
        _ => None,
    }
}
