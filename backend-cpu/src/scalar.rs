//! The floating-point types host steps compute in (f32, or f64 for f64 programs), so
//! host steps are written once: their constants, conversions, `exp` and the reductions
//! softmax needs (matrix products are `crate::blas::Gemm`'s).

use std::ops::{Add, AddAssign, Div, Mul, Sub};

/// A scalar the executor's host-side arithmetic works on.
pub(crate) trait Scalar:
    Copy
    + Send
    + Sync
    + 'static
    + PartialOrd
    + Add<Output = Self>
    + AddAssign
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    const INFINITY: Self;
    const NAN: Self;
    /// `value` in this type.
    fn from_f64(value: f64) -> Self;
    /// `e^self`, as accurate as the generated kernels' `exp` of this type.
    fn exp(self) -> Self;
    /// Whether this is NaN.
    fn is_nan(self) -> bool;
    /// Replaces `scores` by `e^(score - max)` (softmax numerators) and returns their sum.
    fn softmax_numerators(scores: &mut [Self]) -> Self {
        Self::exp_below(scores, max_of(scores))
    }
    /// Replaces `scores` by `e^(score - largest)` and returns their sum.
    fn exp_below(scores: &mut [Self], largest: Self) -> Self {
        exp_below(scores, largest)
    }
}

/// [`Scalar::exp_below`] in portable code: each pass is a loop that vectorizes.
#[inline(always)]
fn exp_below<T: Scalar>(scores: &mut [T], largest: T) -> T {
    for score in scores.iter_mut() {
        *score = (*score - largest).exp();
    }
    sum_of(scores)
}

/// [`exp_below`] compiled for AVX-512 (16 lanes; the same arithmetic per lane).
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx512f")]
unsafe fn exp_below_avx512(scores: &mut [f32], largest: f32) -> f32 {
    exp_below(scores, largest)
}

/// [`exp_below`] compiled for AVX2 (8 lanes rather than SSE2's 4).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn exp_below_avx2(scores: &mut [f32], largest: f32) -> f32 {
    exp_below(scores, largest)
}

impl Scalar for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f32::NEG_INFINITY;
    const INFINITY: Self = f32::INFINITY;
    const NAN: Self = f32::NAN;
    fn from_f64(value: f64) -> Self {
        value as f32
    }
    fn exp(self) -> Self {
        nestor_math::fast_exp(self)
    }
    fn is_nan(self) -> bool {
        f32::is_nan(self)
    }
    fn exp_below(scores: &mut [Self], largest: Self) -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            // The CPU has AVX-512 F (checked just above).
            return unsafe { exp_below_avx512(scores, largest) };
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // The CPU has AVX2 (checked just above).
            return unsafe { exp_below_avx2(scores, largest) };
        }
        exp_below(scores, largest)
    }
}

impl Scalar for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INFINITY: Self = f64::NEG_INFINITY;
    const INFINITY: Self = f64::INFINITY;
    const NAN: Self = f64::NAN;
    fn from_f64(value: f64) -> Self {
        value
    }
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn is_nan(self) -> bool {
        f64::is_nan(self)
    }
}

/// Lanes of the independent accumulators in [`max_of`] and [`sum_of`]: enough for the
/// loops to vectorize and to hide the latency of each add or max.
const LANES: usize = 16;

/// The largest of `values` (NaNs ignored; `-inf` when empty).
#[inline(always)]
pub(crate) fn max_of<T: Scalar>(values: &[T]) -> T {
    let larger = |a: T, b: T| if b > a { b } else { a };
    let mut lanes = [T::NEG_INFINITY; LANES];
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &value) in lanes.iter_mut().zip(chunk) {
            *lane = larger(*lane, value);
        }
    }
    lanes
        .into_iter()
        .chain(rest.iter().copied())
        .fold(T::NEG_INFINITY, larger)
}

/// The sum of `values`, in [`LANES`] interleaved partial sums.
#[inline(always)]
pub(crate) fn sum_of<T: Scalar>(values: &[T]) -> T {
    let mut lanes = [T::ZERO; LANES];
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &value) in lanes.iter_mut().zip(chunk) {
            *lane += value;
        }
    }
    let mut total = T::ZERO;
    for value in lanes.into_iter().chain(rest.iter().copied()) {
        total += value;
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_match_sequential_ones() {
        for length in [0usize, 1, 15, 16, 17, 100] {
            let values: Vec<f64> = (0..length).map(|i| ((i * 37) % 11) as f64 - 5.0).collect();
            let expected_max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(max_of(&values), expected_max, "max of {length}");
            assert_eq!(
                sum_of(&values),
                values.iter().sum::<f64>(),
                "sum of {length}"
            );
        }
        assert_eq!(max_of(&[1.0f32, f32::NAN, 3.0]), 3.0, "NaNs are ignored");
    }
}
