//! Elementwise operators: unary math and activations, binary arithmetic, comparison and
//! logic with the operand kinds of [`Operand`], `where`, `masked_fill`, Rust operators
//! and in-place variants. All act on the packed values.

use std::ops::{Add, Div, Mul, Neg, Sub};

use tch::{TchError, Tensor};

use super::Operand;
use crate::{NestedTensor, Result};

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
    ($($(#[$doc:meta])* $name:ident => $method:ident;)*) => {
        impl NestedTensor {$(
            $(#[$doc])*
            pub fn $name(&self) -> Result<NestedTensor> {
                Ok(self.with_values(self.values().$method()?))
            }
        )*}
    };
}

unary_ops! {
    /// `-x`.
    neg => f_neg;
    /// `|x|`.
    abs => f_abs;
    /// `e^x`.
    exp => f_exp;
    /// `e^x - 1`.
    expm1 => f_expm1;
    /// Natural logarithm.
    log => f_log;
    /// `ln(1 + x)`.
    log1p => f_log1p;
    /// Square root.
    sqrt => f_sqrt;
    /// `1 / sqrt(x)`.
    rsqrt => f_rsqrt;
    /// `x * x`.
    square => f_square;
    /// `1 / x`.
    reciprocal => f_reciprocal;
    /// Sine.
    sin => f_sin;
    /// Cosine.
    cos => f_cos;
    /// Hyperbolic tangent.
    tanh => f_tanh;
    /// Logistic sigmoid.
    sigmoid => f_sigmoid;
    /// Gauss error function.
    erf => f_erf;
    /// `max(x, 0)`.
    relu => f_relu;
    /// `x * sigmoid(x)`.
    silu => f_silu;
    /// `x * tanh(softplus(x))`.
    mish => f_mish;
    /// Sign: -1, 0 or 1.
    sign => f_sign;
    /// Round down.
    floor => f_floor;
    /// Round up.
    ceil => f_ceil;
    /// Round half to even.
    round => f_round;
    /// Logical not (true where the value is zero).
    logical_not => f_logical_not;
}

impl NestedTensor {
    /// GELU; `approximate` is `"none"` (exact, erf) or `"tanh"`.
    pub fn gelu(&self, approximate: &str) -> Result<NestedTensor> {
        Ok(self.with_values(self.values().f_gelu(approximate)?))
    }

    /// `x` where positive, `negative_slope * x` elsewhere.
    pub fn leaky_relu(&self, negative_slope: f64) -> Result<NestedTensor> {
        let values = self.values();
        Ok(self.with_values(
            values.f_where_self(&values.f_gt(0.0)?, &values.f_mul_scalar(negative_slope)?)?,
        ))
    }

    /// `x` where positive, `alpha * (e^x - 1)` elsewhere.
    pub fn elu(&self, alpha: f64) -> Result<NestedTensor> {
        let values = self.values();
        let negative = values.f_expm1()?.f_mul_scalar(alpha)?;
        Ok(self.with_values(values.f_where_self(&values.f_gt(0.0)?, &negative)?))
    }

    /// `ln(1 + e^(beta x)) / beta`, linear above `threshold` (as torch's softplus).
    pub fn softplus(&self, beta: f64, threshold: f64) -> Result<NestedTensor> {
        let values = self.values();
        let scaled = values.f_mul_scalar(beta)?;
        let smooth = scaled.f_exp()?.f_log1p()?.f_div_scalar(beta)?;
        Ok(self.with_values(values.f_where_self(&scaled.f_gt(threshold)?, &smooth)?))
    }

    /// Clamps into `[min, max]`; `None` leaves that side open.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<NestedTensor> {
        let mut values = self.values().shallow_clone();
        if let Some(min) = min {
            values = values.f_clamp_min(min)?;
        }
        if let Some(max) = max {
            values = values.f_clamp_max(max)?;
        }
        Ok(self.with_values(values))
    }

    /// `self <op> other`, with `other` lined up as [`Operand`] says.
    pub fn binary<'a>(&self, op: Binary, other: impl Into<Operand<'a>>) -> Result<NestedTensor> {
        let other = self.align(&other.into(), op.name())?;
        self.with_broadcast_values(op.apply(self.values(), &other)?)
    }

    /// `other <op> self`: the operand on the left (as in `1.0 - nt`).
    pub fn binary_reversed<'a>(
        &self,
        op: Binary,
        other: impl Into<Operand<'a>>,
    ) -> Result<NestedTensor> {
        let other = self.align(&other.into(), op.name())?;
        self.with_broadcast_values(op.apply(&other, self.values())?)
    }

    /// In place: `self = self <op> other`. The result must keep the shape of the values;
    /// views of the values (elements, batch ranges) see the change.
    pub fn binary_<'a>(&mut self, op: Binary, other: impl Into<Operand<'a>>) -> Result<()> {
        let result = self.binary(op, other)?;
        // A handle on the same storage: copying into it updates the values in place.
        let mut values = self.values().shallow_clone();
        values.f_copy_(result.values())?;
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
        let condition = self
            .align(&condition.into(), "where")?
            .f_to_kind(tch::Kind::Bool)?;
        let other = self.align(&other.into(), "where")?;
        self.with_broadcast_values(self.values().f_where_self(&condition, &other)?)
    }

    /// `value` where `mask` holds, `self` elsewhere.
    pub fn masked_fill<'a>(
        &self,
        mask: impl Into<Operand<'a>>,
        value: f64,
    ) -> Result<NestedTensor> {
        let mask = self
            .align(&mask.into(), "masked_fill")?
            .f_to_kind(tch::Kind::Bool)?;
        self.with_broadcast_values(self.values().f_masked_fill(&mask, value)?)
    }

    /// Wraps the result of an elementwise operator, whose static dims may have grown by
    /// broadcasting (`[L_i, 1]` elements times a `[C]` tail give `[L_i, C]`).
    pub(crate) fn with_broadcast_values(&self, values: Tensor) -> Result<NestedTensor> {
        let tail = values.size().split_off(1);
        let layout = self.layout();
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
