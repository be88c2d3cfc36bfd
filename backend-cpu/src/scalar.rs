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
        crate::vectors::widest(
            #[inline(always)]
            || exp_below(scores, largest),
        )
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
pub(crate) const LANES: usize = 16;

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

/// The largest magnitude of `values` (0 when empty), `None` if one is NaN or infinite:
/// [`LANES`] interleaved maxima, and a sum of `value - value`, which only a NaN or an
/// infinity makes NaN (two loops without a branch per value, which vectorize).
#[inline(always)]
#[allow(clippy::eq_op)] // `value - value` is the point: 0, or NaN for NaN and infinity.
pub(crate) fn largest_magnitude<T: Scalar>(values: &[T]) -> Option<T> {
    let larger = |a: T, b: T| if b > a { b } else { a };
    let magnitude = |value: T| {
        if value < T::ZERO {
            T::ZERO - value
        } else {
            value
        }
    };
    let mut lanes = [T::ZERO; LANES];
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks.clone() {
        for (lane, &value) in lanes.iter_mut().zip(chunk) {
            *lane = larger(*lane, magnitude(value));
        }
    }
    let mut probes = [T::ZERO; LANES];
    for chunk in chunks {
        for (probe, &value) in probes.iter_mut().zip(chunk) {
            *probe += value - value;
        }
    }
    let probe = probes
        .into_iter()
        .chain(rest.iter().map(|&value| value - value))
        .fold(T::ZERO, |sum, probe| sum + probe);
    if probe.is_nan() {
        return None;
    }
    let largest = lanes.into_iter().fold(T::ZERO, larger);
    Some(
        rest.iter()
            .map(|&value| magnitude(value))
            .fold(largest, larger),
    )
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

/// The dot product of `a` and `b` (as long as the shorter), in [`LANES`] interleaved
/// partial sums.
#[inline(always)]
pub(crate) fn dot_of<T: Scalar>(a: &[T], b: &[T]) -> T {
    let length = a.len().min(b.len());
    let (a, b) = (&a[..length], &b[..length]);
    let mut lanes = [T::ZERO; LANES];
    let (a_chunks, b_chunks) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest = a_chunks.remainder().iter().zip(b_chunks.remainder());
    for (a, b) in a_chunks.zip(b_chunks) {
        for ((lane, &a), &b) in lanes.iter_mut().zip(a).zip(b) {
            *lane += a * b;
        }
    }
    let mut total = T::ZERO;
    for value in lanes.into_iter().chain(rest.map(|(&a, &b)| a * b)) {
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
        for length in [0usize, 1, 15, 16, 17, 100] {
            let values: Vec<f64> = (0..length).map(|i| ((i * 37) % 11) as f64 - 7.0).collect();
            let expected = values.iter().fold(0.0, |a: f64, b| a.max(b.abs()));
            assert_eq!(largest_magnitude(&values), Some(expected), "of {length}");
            for at in [0, length / 2, length.saturating_sub(1)]
                .into_iter()
                .filter(|&at| at < length)
            {
                for odd in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
                    let mut values = values.clone();
                    values[at] = odd;
                    assert_eq!(
                        largest_magnitude(&values),
                        None,
                        "{odd} at {at} of {length}"
                    );
                }
            }
        }
        for length in [0usize, 1, 15, 16, 17, 100] {
            let a: Vec<f64> = (0..length).map(|i| ((i * 37) % 11) as f64 - 5.0).collect();
            let b: Vec<f64> = (0..length + 3)
                .map(|i| ((i * 13) % 7) as f64 - 3.0)
                .collect();
            let expected: f64 = a.iter().zip(&b).map(|(a, b)| a * b).sum();
            assert_eq!(dot_of(&a, &b), expected, "dot of {length}");
        }
    }
}
