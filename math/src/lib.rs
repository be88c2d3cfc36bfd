//! nestor-math: the f32 polynomials of the generated kernels' `exp`, `log`, `erf` and
//! `tanh`, as coefficients (which the code generator emits) and as Rust functions (which
//! host code that must agree with the kernels calls, bit for bit where the kernels run
//! the same operations). Plain arithmetic: no LLVM, no libm.

/// `ln 2` split in two (Cody and Waite): `n * LN_2_SPLIT[0]` is exact for the `n` of
/// f32 exponents, so `x - n ln 2` keeps its precision.
pub const LN_2_SPLIT: [f64; 2] = [0.693_359_375, -2.121_944_400_546_905_8e-4];

/// Coefficients of the polynomial `p` with `e^r = 1 + r + r^2 p(r)` on
/// `[-ln(2)/2, ln(2)/2]`, highest degree first (Cephes' `expf`): the generated kernels'
/// `exp` and [`fast_exp`] share them.
pub const EXP_COEFFICIENTS: [f64; 6] = [
    1.987_569_150_0e-4,
    1.398_199_950_7e-3,
    8.333_451_907_3e-3,
    4.166_579_589_4e-2,
    1.666_666_545_9e-1,
    5.000_000_120_1e-1,
];

/// The inputs `exp` works on: below, `e^x` rounds to 0 in f32 (`e^-104 < 2^-150`);
/// above, it overflows to `inf` (`e^89 > f32::MAX`). Clamping keeps `n` in range.
pub const EXP_INPUT_RANGE: [f32; 2] = [-104.0, 89.0];

/// The lowest `n` of `2^n` that `exp` applies (`n` of the lowest input rounded: 2^-150).
pub const EXP_LOWEST_EXPONENT: f32 = -150.0;

/// `p(at)` in f32 for the coefficients of `p`, highest degree first (Horner's scheme,
/// as the kernels evaluate their polynomials).
#[inline(always)]
fn horner(coefficients: &[f64], at: f32) -> f32 {
    coefficients.iter().fold(0.0, |acc, &c| acc * at + c as f32)
}

/// The odd numerator `x p(x^2)` of the kernels' f32 erf, as the coefficients of `p`,
/// highest degree first (Eigen's and XLA's rational erf; [`fast_erf`]).
pub const ERF_NUMERATOR: [f64; 7] = [
    -2.726_142_258_013_06e-10,
    2.770_681_424_959_02e-8,
    -2.101_024_020_825_08e-6,
    -5.692_506_394_623_46e-5,
    -7.349_906_303_268_55e-4,
    -2.954_599_808_540_25e-3,
    -1.609_603_332_624_15e-2,
];

/// The even denominator `q(x^2)` of the kernels' f32 erf, highest degree first.
pub const ERF_DENOMINATOR: [f64; 5] = [
    -1.456_607_184_649_96e-5,
    -2.133_740_552_789_05e-4,
    -1.682_826_974_382_03e-3,
    -7.373_329_167_204_68e-3,
    -1.426_473_905_141_89e-2,
];

/// `erf(x)` computed as the generated f32 kernels compute it: `x p(x^2) / q(x^2)` on `x`
/// clamped to [-4, 4] ([`ERF_NUMERATOR`], [`ERF_DENOMINATOR`]); absolute error below
/// 4.5e-7 (3.3e-7 in exact arithmetic), NaN for NaN, `erf(-0) = -0`.
///
/// ```
/// let error = (nestor_math::fast_erf(0.5) - 0.520_499_9).abs();
/// assert!(error < 4.5e-7);
/// ```
pub fn fast_erf(x: f32) -> f32 {
    // As the kernels' ordered compares: a NaN stays NaN.
    let x = x.clamp(-4.0, 4.0);
    let square = x * x;
    x * horner(&ERF_NUMERATOR, square) / horner(&ERF_DENOMINATOR, square)
}

/// The odd numerator `x p(x^2)` of the kernels' f32 tanh, as the coefficients of `p`,
/// highest degree first (Eigen's rational tanh; [`fast_tanh`]).
pub const TANH_NUMERATOR: [f64; 7] = [
    -2.760_768_477_423_55e-16,
    2.000_187_904_824_77e-13,
    -8.604_671_522_137_35e-11,
    5.122_297_090_371_14e-8,
    1.485_722_357_179_79e-5,
    6.372_619_288_754_36e-4,
    4.893_524_558_917_86e-3,
];

/// The even denominator `q(x^2)` of the kernels' f32 tanh, highest degree first.
pub const TANH_DENOMINATOR: [f64; 4] = [
    1.198_258_394_667_02e-6,
    1.185_347_056_866_54e-4,
    2.268_434_632_439_00e-3,
    4.893_525_185_543_85e-3,
];

/// The bounds of the kernels' f32 tanh: the rational's input is clamped to
/// `[-edge, edge]`; below `tiny` in magnitude tanh is `x`; from `saturated` on it is
/// `+-1` (as libm's in f32).
pub const TANH_BOUNDS: [f32; 3] = [7.905_311, 4e-4, 9.1];

/// `tanh(x)` computed as the generated f32 kernels compute it ([`TANH_NUMERATOR`],
/// [`TANH_DENOMINATOR`], [`TANH_BOUNDS`]): absolute error below 4e-7, `x` near 0 (so
/// `-0` stays `-0`), `+-1` at the infinities, NaN for NaN.
///
/// ```
/// let error = (nestor_math::fast_tanh(0.5) - 0.5f32.tanh()).abs();
/// assert!(error < 4e-7);
/// ```
pub fn fast_tanh(x: f32) -> f32 {
    let [edge, tiny, saturated] = TANH_BOUNDS;
    let clamped = x.clamp(-edge, edge);
    let square = clamped * clamped;
    let rational = clamped * horner(&TANH_NUMERATOR, square) / horner(&TANH_DENOMINATOR, square);
    if x.abs() < tiny {
        x
    } else if x.abs() >= saturated {
        1.0f32.copysign(x)
    } else {
        rational
    }
}

/// `e^x` computed as the generated kernels compute it (`e^x = 2^n e^r`, `n` the nearest
/// integer to `x / ln 2`, `r = x - n ln 2` in two steps, [`EXP_COEFFICIENTS`] for `e^r`,
/// `2^n` applied as two factors; within 2 ulp of the exact value, `inf` past f32's
/// range, subnormals and 0 below it, NaN for NaN), for host code that must agree with
/// them.
///
/// Branch-free f32 arithmetic without libm calls (rounding by the `1.5 * 2^23` trick,
/// to nearest even like the kernels' `rint`), so loops over it vectorize.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds |t| < 2^22 to an integer.
    let [lowest, highest] = EXP_INPUT_RANGE;
    let x = x.clamp(lowest, highest); // NaN stays NaN.
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN_2_SPLIT[0] as f32) - n * LN_2_SPLIT[1] as f32;
    let polynomial = horner(&EXP_COEFFICIENTS, r);
    let reduced = polynomial * r * r + r + 1.0;
    // `n` is an integer in [-150, 129] (x was clamped; a NaN, which makes the polynomial
    // NaN, becomes -150 here since `max` ignores NaN), so the unchecked conversion is
    // exact; a saturating `as` would keep the loop from vectorizing.
    let exponent = unsafe { n.max(EXP_LOWEST_EXPONENT).to_int_unchecked::<i32>() };
    let half = exponent >> 1;
    let power_of_two = |n: i32| f32::from_bits(((n + 127) << 23) as u32);
    reduced * power_of_two(half) * power_of_two(exponent - half)
}

/// Coefficients of the polynomial `p` with `log(1 + f) = f - f^2 / 2 + f^3 p(f)` on
/// `[sqrt(1/2) - 1, sqrt(2) - 1]`, highest degree first (Cephes' `logf`).
pub const LOG_COEFFICIENTS: [f64; 9] = [
    7.037_683_629_2e-2,
    -1.151_461_031_0e-1,
    1.167_699_874_0e-1,
    -1.242_014_084_6e-1,
    1.424_932_278_7e-1,
    -1.666_805_766_5e-1,
    2.000_071_476_5e-1,
    -2.499_999_399_3e-1,
    3.333_333_117_4e-1,
];

/// `ln(x)` computed as the generated f32 kernels compute it: `x = 2^e (1 + f)` with
/// `1 + f` in `[sqrt(1/2), sqrt(2))` from the bits (subnormals scaled first),
/// [`LOG_COEFFICIENTS`] for `log(1 + f)` and `e ln 2` added in two parts
/// ([`LN_2_SPLIT`]); within 2 ulp; `-inf` at 0 and -0, NaN below 0 and for NaN, `inf`
/// at `inf`, as libm.
///
/// ```
/// let error = (nestor_math::fast_log(10.0) - std::f32::consts::LN_10).abs();
/// assert!(error <= 2.0 * f32::EPSILON * std::f32::consts::LN_10);
/// ```
#[inline(always)]
pub fn fast_log(x: f32) -> f32 {
    // Subnormals times 2^23 are normal.
    let subnormal = x < f32::MIN_POSITIVE;
    let scaled = if subnormal { x * 8_388_608.0 } else { x };
    let bits = scaled.to_bits() as i32;
    // `scaled = 2^(e + 1) m`, m in [1/2, 1).
    let exponent = ((bits >> 23) & 0xff) - 126 - if subnormal { 23 } else { 0 };
    let m = f32::from_bits(((bits & 0x007f_ffff) | 0x3f00_0000) as u32);
    let low = m < std::f32::consts::FRAC_1_SQRT_2;
    let f = if low { m + m - 1.0 } else { m - 1.0 };
    let e = (exponent - i32::from(low)) as f32;
    let square = f * f;
    let polynomial = horner(&LOG_COEFFICIENTS, f);
    let tail = polynomial * f * square + e * LN_2_SPLIT[1] as f32 - 0.5 * square;
    let value = f + tail + e * LN_2_SPLIT[0] as f32;
    if x > 0.0 && x < f32::INFINITY {
        value
    } else if x == 0.0 {
        f32::NEG_INFINITY
    } else if x == f32::INFINITY {
        f32::INFINITY
    } else {
        f32::NAN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate_over_the_finite_range() {
        let mut worst: f32 = 0.0;
        for step in -8700..=8800 {
            let x = step as f32 / 100.0;
            let relative = (fast_exp(x) - x.exp()).abs() / x.exp();
            worst = worst.max(relative);
        }
        // Two f32 ulp (2^-22 relative).
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert!(fast_exp(f32::NAN).is_nan(), "NaN propagates");
    }

    #[test]
    fn fast_tanh_is_accurate_everywhere() {
        let mut worst: f64 = 0.0;
        for step in -120_000..=120_000 {
            let x = step as f32 / 10_000.0;
            worst = worst.max((fast_tanh(x) as f64 - (x as f64).tanh()).abs());
        }
        assert!(worst < 4e-7, "worst absolute error {worst:e}");
        assert_eq!(fast_tanh(f32::INFINITY), 1.0);
        assert_eq!(fast_tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(fast_tanh(1e30), 1.0);
        assert_eq!(fast_tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert!(fast_tanh(f32::NAN).is_nan());
    }

    #[test]
    fn fast_log_is_accurate_over_every_binade() {
        let mut worst: f64 = 0.0;
        // Every binade from the smallest subnormal to the largest float, 400 values each.
        let mut x = f32::from_bits(1);
        while x.is_finite() {
            for step in 0..400 {
                let value = x * (1.0 + step as f32 / 400.0);
                if !value.is_finite() {
                    break;
                }
                let exact = (value as f64).ln();
                let ulp = f32::EPSILON as f64 * exact.abs().max(f64::MIN_POSITIVE);
                worst = worst.max((fast_log(value) as f64 - exact).abs() / ulp);
            }
            x *= 2.0;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(fast_log(1.0), 0.0);
        assert_eq!(fast_log(0.0), f32::NEG_INFINITY);
        assert_eq!(fast_log(-0.0), f32::NEG_INFINITY);
        assert_eq!(fast_log(f32::INFINITY), f32::INFINITY);
        assert!(fast_log(-1.0).is_nan() && fast_log(f32::NAN).is_nan());
        assert!(fast_log(f32::NEG_INFINITY).is_nan());
    }

    #[test]
    fn fast_erf_is_accurate_everywhere() {
        let mut worst: f64 = 0.0;
        for step in -60_000..=60_000 {
            let x = step as f32 / 10_000.0;
            let exact = libm_erf(x as f64);
            worst = worst.max((fast_erf(x) as f64 - exact).abs());
        }
        // 3.3e-7 for the formula, up to 4.2e-7 with f32 rounding (7 ulp of 1).
        assert!(worst < 4.5e-7, "worst absolute error {worst:e}");
        assert!(fast_erf(f32::NAN).is_nan(), "NaN propagates");
        assert_eq!(fast_erf(f32::INFINITY), 1.0);
        assert_eq!(fast_erf(f32::NEG_INFINITY), -1.0);
        assert_eq!(
            fast_erf(-0.0).to_bits(),
            (-0.0f32).to_bits(),
            "erf(-0) = -0"
        );
    }

    /// erf in f64 from its series (|x| < 3) or continued fraction (beyond), accurate to
    /// about 1e-15: the reference for the f32 approximation.
    fn libm_erf(x: f64) -> f64 {
        let a = x.abs();
        let value = if a < 3.0 {
            // erf(x) = 2/sqrt(pi) sum (-1)^n x^(2n+1) / (n! (2n+1)).
            let (mut term, mut sum, mut n) = (a, a, 0.0);
            while term.abs() > 1e-17 * sum.abs() {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            // erfc(x) = e^-x^2 / sqrt(pi) / (x + 1/2 / (x + 1 / (x + 3/2 / (x + ...)))).
            let mut fraction = a;
            for k in (1..60).rev() {
                fraction = a + k as f64 / 2.0 / fraction;
            }
            1.0 - (-a * a).exp() / std::f64::consts::PI.sqrt() / fraction
        };
        value.copysign(x)
    }

    #[test]
    fn fast_exp_overflows_and_underflows_as_libm() {
        for x in [88.72f32, 88.73, 89.0, 100.0, 1e30, f32::INFINITY] {
            assert_eq!(fast_exp(x), x.exp(), "e^{x}");
        }
        for x in [-104.0f32, -110.0, -1e30, f32::NEG_INFINITY] {
            assert_eq!(fast_exp(x).to_bits(), 0, "e^{x} is +0");
        }
        // Subnormal results: within one step of the subnormal grid (2^-149) of libm's.
        for step in 0..=1700 {
            let x = -87.0 - step as f32 / 100.0;
            let error = (fast_exp(x) as f64 - (x as f64).exp()).abs();
            assert!(error <= f32::from_bits(1) as f64, "e^{x}: error {error:e}");
        }
    }
}
