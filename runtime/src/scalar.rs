//! The floating-point types host steps compute in (f32, or f64 for f64 programs), so
//! GEMM and attention are written once.

use std::ops::{AddAssign, DivAssign, Sub};

/// A scalar the executor's host-side arithmetic works on.
pub(crate) trait Scalar:
    Copy + Send + Sync + 'static + PartialOrd + AddAssign + DivAssign + Sub<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    const NAN: Self;
    /// `value` in this type.
    fn from_f64(value: f64) -> Self;
    /// `e^self`, as accurate as the generated kernels' `exp` of this type.
    fn exp(self) -> Self;
}

impl Scalar for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    const NAN: Self = f32::NAN;
    fn from_f64(value: f64) -> Self {
        value as f32
    }
    fn exp(self) -> Self {
        nestor_backend_cpu::fast_exp(self)
    }
}

impl Scalar for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    const NAN: Self = f64::NAN;
    fn from_f64(value: f64) -> Self {
        value
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
}
