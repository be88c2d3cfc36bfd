//! Elementwise operators: unary math and activations, binary arithmetic, comparison and
//! logic with the operand kinds of [`Operand`], `where`, `masked_fill`, Rust operators
//! and in-place variants. All act on the packed values.

use std::ops::{Add, Div, Mul, Neg, Sub};

use tch::{TchError, Tensor};

use nestor_ir::{BinaryOp, DType, Op, UnaryOp};

use super::Operand;
use crate::trace::Arg;
use crate::{dtype_of, NestedError, NestedTensor, Result};

/// A binary elementwise operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Binary {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b` (true division).
    Div,
    /// Python's `a % b` (the sign of `b`).
    Remainder,
    /// `a ** b`.
    Pow,
    /// `max(a, b)`.
    Maximum,
    /// `min(a, b)`.
    Minimum,
    /// `atan2(a, b)`.
    Atan2,
    /// `a == b`.
    Eq,
    /// `a != b`.
    Ne,
    /// `a < b`.
    Lt,
    /// `a <= b`.
    Le,
    /// `a > b`.
    Gt,
    /// `a >= b`.
    Ge,
    /// `a && b`.
    LogicalAnd,
    /// `a || b`.
    LogicalOr,
    /// `a ^ b` on truth values.
    LogicalXor,
}

impl Binary {
    /// The operator's name, as torch spells it.
    pub fn name(self) -> &'static str {
        match self {
            Binary::Add => "add",
            Binary::Sub => "sub",
            Binary::Mul => "mul",
            Binary::Div => "div",
            Binary::Remainder => "remainder",
            Binary::Pow => "pow",
            Binary::Maximum => "maximum",
            Binary::Minimum => "minimum",
            Binary::Atan2 => "atan2",
            Binary::Eq => "eq",
            Binary::Ne => "ne",
            Binary::Lt => "lt",
            Binary::Le => "le",
            Binary::Gt => "gt",
            Binary::Ge => "ge",
            Binary::LogicalAnd => "logical_and",
            Binary::LogicalOr => "logical_or",
            Binary::LogicalXor => "logical_xor",
        }
    }

    /// The IR operator, if there is one.
    pub fn ir(self) -> Option<BinaryOp> {
        Some(match self {
            Binary::Add => BinaryOp::Add,
            Binary::Sub => BinaryOp::Sub,
            Binary::Mul => BinaryOp::Mul,
            Binary::Div => BinaryOp::Div,
            Binary::Pow => BinaryOp::Pow,
            Binary::Maximum => BinaryOp::Maximum,
            Binary::Minimum => BinaryOp::Minimum,
            Binary::Eq => BinaryOp::Eq,
            Binary::Ne => BinaryOp::Ne,
            Binary::Lt => BinaryOp::Lt,
            Binary::Le => BinaryOp::Le,
            Binary::Gt => BinaryOp::Gt,
            Binary::Ge => BinaryOp::Ge,
            Binary::LogicalAnd => BinaryOp::And,
            Binary::LogicalOr => BinaryOp::Or,
            Binary::Remainder => BinaryOp::Remainder,
            Binary::Atan2 => BinaryOp::Atan2,
            Binary::LogicalXor => BinaryOp::Xor,
        })
    }

    /// Applies the operator to two broadcastable tensors.
    pub fn apply(self, a: &Tensor, b: &Tensor) -> Result<Tensor, TchError> {
        match self {
            Binary::Add => a.f_add(b),
            Binary::Sub => a.f_sub(b),
            Binary::Mul => a.f_mul(b),
            Binary::Div => a.f_div(b),
            Binary::Remainder => a.f_remainder_tensor(b),
            Binary::Pow => a.f_pow(b),
            Binary::Maximum => a.f_maximum(b),
            Binary::Minimum => a.f_minimum(b),
            Binary::Atan2 => a.f_atan2(b),
            Binary::Eq => a.f_eq_tensor(b),
            Binary::Ne => a.f_ne_tensor(b),
            Binary::Lt => a.f_lt_tensor(b),
            Binary::Le => a.f_le_tensor(b),
            Binary::Gt => a.f_gt_tensor(b),
            Binary::Ge => a.f_ge_tensor(b),
            Binary::LogicalAnd => a.f_logical_and(b),
            Binary::LogicalOr => a.f_logical_or(b),
            Binary::LogicalXor => a.f_logical_xor(b),
        }
    }
}

macro_rules! unary_ops {
    ($($(#[$doc:meta])* $name:ident => $method:ident, $ir:expr;)*) => {
        impl NestedTensor {$(
            $(#[$doc])*
            pub fn $name(&self) -> Result<NestedTensor> {
                self.unary(stringify!($name), $ir, self.packed().$method()?)
            }
        )*}
    };
}

unary_ops! {
    /// `-x`.
    neg => f_neg, Some(UnaryOp::Neg);
    /// `|x|`.
    abs => f_abs, Some(UnaryOp::Abs);
    /// `e^x`.
    exp => f_exp, Some(UnaryOp::Exp);
    /// `e^x - 1`.
    expm1 => f_expm1, Some(UnaryOp::Expm1);
    /// Natural logarithm.
    log => f_log, Some(UnaryOp::Log);
    /// `ln(1 + x)`.
    log1p => f_log1p, Some(UnaryOp::Log1p);
    /// Square root.
    sqrt => f_sqrt, Some(UnaryOp::Sqrt);
    /// `1 / sqrt(x)`.
    rsqrt => f_rsqrt, Some(UnaryOp::Rsqrt);
    /// `x * x`.
    square => f_square, Some(UnaryOp::Square);
    /// `1 / x`.
    reciprocal => f_reciprocal, Some(UnaryOp::Reciprocal);
    /// Sine.
    sin => f_sin, Some(UnaryOp::Sin);
    /// Cosine.
    cos => f_cos, Some(UnaryOp::Cos);
    /// Hyperbolic tangent.
    tanh => f_tanh, Some(UnaryOp::Tanh);
    /// Logistic sigmoid.
    sigmoid => f_sigmoid, Some(UnaryOp::Sigmoid);
    /// Gauss error function.
    erf => f_erf, Some(UnaryOp::Erf);
    /// `max(x, 0)`.
    relu => f_relu, Some(UnaryOp::Relu);
    /// `x * sigmoid(x)`.
    silu => f_silu, Some(UnaryOp::Silu);
    /// Sign: -1, 0 or 1.
    sign => f_sign, Some(UnaryOp::Sign);
    /// Round down.
    floor => f_floor, Some(UnaryOp::Floor);
    /// Round up.
    ceil => f_ceil, Some(UnaryOp::Ceil);
    /// Round half to even.
    round => f_round, Some(UnaryOp::Round);
    /// Logical not (true where the value is zero).
    logical_not => f_logical_not, Some(UnaryOp::Not);
}

impl NestedTensor {
    /// Wraps the values of a unary op, recording it (`None`: no IR form yet).
    fn unary(
        &self,
        name: &'static str,
        op: Option<UnaryOp>,
        values: Tensor,
    ) -> Result<NestedTensor> {
        let Some(op) = op else {
            self.untraceable(name)?;
            return Ok(self.with_values(values));
        };
        self.with_values(values)
            .traced(&[Arg::Nested(self)], name, |ids| Op::Unary {
                op,
                x: ids[0],
            })
    }

    /// GELU; `approximate` is `"none"` (exact, erf) or `"tanh"`.
    pub fn gelu(&self, approximate: &str) -> Result<NestedTensor> {
        let op = if approximate == "tanh" {
            UnaryOp::GeluTanh
        } else {
            UnaryOp::Gelu
        };
        self.unary("gelu", Some(op), self.packed().f_gelu(approximate)?)
    }

    /// `x` where positive, `negative_slope * x` elsewhere (traced as that `where`).
    pub fn leaky_relu(&self, negative_slope: f64) -> Result<NestedTensor> {
        self.where_self(&self.gt(0.0)?, &(self * negative_slope)?)
    }

    /// `x` where positive, `alpha * (e^x - 1)` elsewhere (traced as that `where`; the
    /// exponential reads 0 where `x` is positive, so large inputs give no `inf * 0` in
    /// the gradient).
    pub fn elu(&self, alpha: f64) -> Result<NestedTensor> {
        let positive = self.gt(0.0)?;
        let negative = self.where_self(&positive.logical_not()?, 0.0)?;
        self.where_self(&positive, &(&negative.expm1()? * alpha)?)
    }

    /// `ln(1 + e^(beta x)) / beta`, linear where `beta x` is above `threshold` (as
    /// torch's softplus; traced as that `where`, the exponential reading 0 there so
    /// large inputs give no `inf * 0` in the gradient).
    pub fn softplus(&self, beta: f64, threshold: f64) -> Result<NestedTensor> {
        let scaled = (self * beta)?;
        let linear = scaled.gt(threshold)?;
        let safe = scaled.where_self(&linear.logical_not()?, 0.0)?;
        let smooth = (&safe.exp()?.log1p()? / beta)?;
        self.where_self(&linear, &smooth)
    }

    /// `x * tanh(softplus(x))`: libtorch's kernel eagerly, traced as those ops
    /// (softplus linear above torch's threshold of 20, its exponential reading 0 there).
    pub fn mish(&self) -> Result<NestedTensor> {
        let mut result = self.with_values(self.packed().f_mish()?);
        result.trace = crate::trace::record_with(&[Arg::Nested(self)], "mish", |graph, ids| {
            let x = ids[0];
            let dtype = graph.ty(x).dtype().unwrap_or(DType::F32);
            let mut constant = |value: f64| {
                graph.push(Op::Const {
                    value: nestor_ir::F64(value),
                    dtype,
                })
            };
            let (threshold, zero) = (constant(20.0)?, constant(0.0)?);
            let binary = |graph: &mut nestor_ir::Graph, op, lhs, rhs| {
                graph.push(Op::Binary { op, lhs, rhs })
            };
            let unary = |graph: &mut nestor_ir::Graph, op, x| graph.push(Op::Unary { op, x });
            let linear = binary(graph, BinaryOp::Gt, x, threshold)?;
            let safe = graph.push(Op::Where {
                condition: linear,
                x: zero,
                y: x,
            })?;
            let exp = unary(graph, UnaryOp::Exp, safe)?;
            let smooth = unary(graph, UnaryOp::Log1p, exp)?;
            let softplus = graph.push(Op::Where {
                condition: linear,
                x,
                y: smooth,
            })?;
            let tanh = unary(graph, UnaryOp::Tanh, softplus)?;
            binary(graph, BinaryOp::Mul, x, tanh)
        })?;
        Ok(result)
    }

    /// Clamps into `[min, max]`; `None` leaves that side open.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<NestedTensor> {
        let mut values = self.packed().shallow_clone();
        if let Some(min) = min {
            values = values.f_clamp_min(min)?;
        }
        if let Some(max) = max {
            values = values.f_clamp_max(max)?;
        }
        let (min, max) = (
            nestor_ir::F64(min.unwrap_or(f64::NEG_INFINITY)),
            nestor_ir::F64(max.unwrap_or(f64::INFINITY)),
        );
        self.with_values(values)
            .traced(&[Arg::Nested(self)], "clamp", |ids| Op::Clamp {
                x: ids[0],
                min,
                max,
            })
    }

    /// The trace argument of an operand lined up as `aligned` (whose dtype a constant
    /// takes).
    fn operand_arg<'a>(operand: &'a Operand<'a>, aligned: &Tensor) -> Result<Arg<'a>> {
        let dtype = || dtype_of(aligned.kind()).unwrap_or(DType::F32);
        Ok(match operand {
            Operand::Float(value) => Arg::Const(*value, dtype()),
            Operand::Int(value) => Arg::Const(*value as f64, dtype()),
            Operand::Bool(value) => Arg::Const(f64::from(u8::from(*value)), DType::Bool),
            Operand::Dense(tensor) => Arg::Dense(tensor, None),
            Operand::Handle(dense) => Arg::Dense(dense.raw(), dense.trace.as_ref()),
            Operand::Nested(nested) => Arg::Nested(nested),
        })
    }

    fn binary_traced(
        &self,
        op: Binary,
        other: Operand<'_>,
        reversed: bool,
    ) -> Result<NestedTensor> {
        let mut matched = None;
        let other = other.matched(self, &mut matched)?;
        if let Operand::Nested(nested) = &other {
            if let Some(pair) = self.broadcast_nested(nested, op.name())? {
                let values = if reversed {
                    op.apply(&pair.right, &pair.left)?
                } else {
                    op.apply(&pair.left, &pair.right)?
                };
                let result = NestedTensor::from_parts(values, pair.layout, self.options());
                let Some(ir) = op.ir() else {
                    self.untraceable(op.name())?;
                    nested.untraceable(op.name())?;
                    return Ok(result);
                };
                let args = if reversed {
                    [Arg::Nested(nested), Arg::Nested(self)]
                } else {
                    [Arg::Nested(self), Arg::Nested(nested)]
                };
                return result.traced(&args, op.name(), |ids| Op::Binary {
                    op: ir,
                    lhs: ids[0],
                    rhs: ids[1],
                });
            }
        }
        let aligned = self.align(&other, op.name())?;
        let values = if reversed {
            op.apply(&aligned, self.packed())?
        } else {
            op.apply(self.packed(), &aligned)?
        };
        let result = self.with_broadcast_values(values)?;
        let Some(ir) = op.ir() else {
            self.untraceable(op.name())?;
            if let Operand::Nested(other) = &other {
                other.untraceable(op.name())?;
            }
            return Ok(result);
        };
        let other_arg = Self::operand_arg(&other, &aligned)?;
        let args = if reversed {
            [other_arg, Arg::Nested(self)]
        } else {
            [Arg::Nested(self), other_arg]
        };
        result.traced(&args, op.name(), |ids| Op::Binary {
            op: ir,
            lhs: ids[0],
            rhs: ids[1],
        })
    }

    /// `self <op> other`, with `other` lined up as [`Operand`] says.
    pub fn binary<'a>(&self, op: Binary, other: impl Into<Operand<'a>>) -> Result<NestedTensor> {
        self.binary_traced(op, other.into(), false)
    }

    /// `other <op> self`: the operand on the left (as in `1.0 - nt`).
    pub fn binary_reversed<'a>(
        &self,
        op: Binary,
        other: impl Into<Operand<'a>>,
    ) -> Result<NestedTensor> {
        self.binary_traced(op, other.into(), true)
    }

    /// In place: `self = self <op> other`. The result must keep the shape of the values;
    /// views of the values (elements, batch ranges) see the change. Not traceable.
    pub fn binary_<'a>(&mut self, op: Binary, other: impl Into<Operand<'a>>) -> Result<()> {
        self.untraceable("in-place operator")?;
        let result = self.binary(op, other)?;
        // As torch: the result must be castable back (no float into an integer batch).
        let (from, to) = (result.kind(), self.kind());
        if !Tensor::f_can_cast(from, to)? {
            return Err(NestedError::Unsupported {
                op: op.name(),
                reason: format!(
                    "in place, the {from:?} result cannot be cast to the batch's {to:?}"
                ),
            });
        }
        // A handle on the same storage: copying into it updates the values in place.
        let mut values = self.packed().shallow_clone();
        values.f_copy_(result.packed())?;
        self.forget_padded();
        Ok(())
    }

    /// `self` where `condition` holds, `other` elsewhere (torch's `where(condition,
    /// self, other)`); both condition and other are operands.
    pub fn where_self<'a, 'b>(
        &self,
        condition: impl Into<Operand<'a>>,
        other: impl Into<Operand<'b>>,
    ) -> Result<NestedTensor> {
        let (mut matched_condition, mut matched_other) = (None, None);
        let condition = condition.into().matched(self, &mut matched_condition)?;
        let other = other.into().matched(self, &mut matched_other)?;
        let condition_values = self
            .align(&condition, "where")?
            .f_to_kind(tch::Kind::Bool)?;
        let other_values = self.align(&other, "where")?;
        let result = self.with_broadcast_values(
            self.packed()
                .f_where_self(&condition_values, &other_values)?,
        )?;
        let args = [
            Self::operand_arg(&condition, &condition_values)?,
            Arg::Nested(self),
            Self::operand_arg(&other, &other_values)?,
        ];
        result.traced(&args, "where", |ids| Op::Where {
            condition: ids[0],
            x: ids[1],
            y: ids[2],
        })
    }

    /// `value` where `mask` holds, `self` elsewhere.
    pub fn masked_fill<'a>(
        &self,
        mask: impl Into<Operand<'a>>,
        value: f64,
    ) -> Result<NestedTensor> {
        let mut matched = None;
        let mask = mask.into().matched(self, &mut matched)?;
        let mask_values = self
            .align(&mask, "masked_fill")?
            .f_to_kind(tch::Kind::Bool)?;
        let result =
            self.with_broadcast_values(self.packed().f_masked_fill(&mask_values, value)?)?;
        let dtype = dtype_of(self.kind()).unwrap_or(DType::F32);
        let args = [
            Self::operand_arg(&mask, &mask_values)?,
            Arg::Const(value, dtype),
            Arg::Nested(self),
        ];
        result.traced(&args, "masked_fill", |ids| Op::Where {
            condition: ids[0],
            x: ids[1],
            y: ids[2],
        })
    }

    /// Wraps the result of an elementwise operator, whose static dims may have grown by
    /// broadcasting (`[L_i, 1]` elements times a `[C]` tail give `[L_i, C]`).
    pub(crate) fn with_broadcast_values(&self, values: Tensor) -> Result<NestedTensor> {
        let tail = values.size().split_off(1);
        let layout = self.lay();
        if tail == layout.static_sizes() {
            return Ok(self.with_values(values));
        }
        let mut grown = layout.clone();
        for (&dim, &size) in layout.static_dims().iter().zip(&tail) {
            grown = grown.with_static_size(dim, size)?;
        }
        Ok(NestedTensor::from_parts(values, grown, self.options()))
    }
}

macro_rules! binary_methods {
    ($($(#[$doc:meta])* $name:ident, $in_place:ident => $op:ident;)*) => {
        impl NestedTensor {$(
            $(#[$doc])*
            pub fn $name<'a>(&self, other: impl Into<Operand<'a>>) -> Result<NestedTensor> {
                self.binary(Binary::$op, other)
            }
            #[doc = concat!("In-place `", stringify!($name), "`.")]
            pub fn $in_place<'a>(&mut self, other: impl Into<Operand<'a>>) -> Result<()> {
                self.binary_(Binary::$op, other)
            }
        )*}
    };
}

binary_methods! {
    /// `self + other`.
    add, add_ => Add;
    /// `self - other`.
    sub, sub_ => Sub;
    /// `self * other`.
    mul, mul_ => Mul;
    /// `self / other`.
    div, div_ => Div;
    /// Python's `self % other`.
    remainder, remainder_ => Remainder;
    /// `self ** other`.
    pow, pow_ => Pow;
    /// Elementwise maximum.
    maximum, maximum_ => Maximum;
    /// Elementwise minimum.
    minimum, minimum_ => Minimum;
    /// `atan2(self, other)`.
    atan2, atan2_ => Atan2;
    /// `self == other` (bool).
    eq, eq_ => Eq;
    /// `self != other` (bool).
    ne, ne_ => Ne;
    /// `self < other` (bool).
    lt, lt_ => Lt;
    /// `self <= other` (bool).
    le, le_ => Le;
    /// `self > other` (bool).
    gt, gt_ => Gt;
    /// `self >= other` (bool).
    ge, ge_ => Ge;
    /// Logical and (bool).
    logical_and, logical_and_ => LogicalAnd;
    /// Logical or (bool).
    logical_or, logical_or_ => LogicalOr;
    /// Logical xor (bool).
    logical_xor, logical_xor_ => LogicalXor;
}

/// Rust operators; each returns `Result<NestedTensor>` (`(&a + &b)?`), since a
/// mismatched operand is an error, not a panic.
macro_rules! rust_operators {
    ($($trait:ident, $method:ident => $op:ident;)*) => {$(
        impl<'a, T: Into<Operand<'a>>> $trait<T> for &NestedTensor {
            type Output = Result<NestedTensor>;
            fn $method(self, other: T) -> Self::Output {
                self.binary(Binary::$op, other)
            }
        }
        impl<'a, T: Into<Operand<'a>>> $trait<T> for NestedTensor {
            type Output = Result<NestedTensor>;
            fn $method(self, other: T) -> Self::Output {
                self.binary(Binary::$op, other)
            }
        }
        impl $trait<&NestedTensor> for f64 {
            type Output = Result<NestedTensor>;
            fn $method(self, nested: &NestedTensor) -> Self::Output {
                nested.binary_reversed(Binary::$op, self)
            }
        }
        impl $trait<&NestedTensor> for i64 {
            type Output = Result<NestedTensor>;
            fn $method(self, nested: &NestedTensor) -> Self::Output {
                nested.binary_reversed(Binary::$op, self)
            }
        }
        impl $trait<&NestedTensor> for &Tensor {
            type Output = Result<NestedTensor>;
            fn $method(self, nested: &NestedTensor) -> Self::Output {
                nested.binary_reversed(Binary::$op, self)
            }
        }
    )*};
}

rust_operators! {
    Add, add => Add;
    Sub, sub => Sub;
    Mul, mul => Mul;
    Div, div => Div;
}

impl Neg for &NestedTensor {
    type Output = Result<NestedTensor>;
    fn neg(self) -> Self::Output {
        NestedTensor::neg(self)
    }
}
