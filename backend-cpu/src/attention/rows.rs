//! The softmax passes of attention on AMX tiles over rows of scores, in AVX-512
//! registers (16 scores at a time, masks for the columns past the visible keys; rows
//! are padded to whole registers, so no column is left to scalar code). Every host with
//! AMX tiles has AVX-512 (`super::tiles::TileInputs::of` checks); callers run these in
//! code compiled for it ([`with_avx512`]).

use std::arch::x86_64::*;

/// Scores a register holds.
const LANES: usize = 16;

/// The least exponent whose power is made: `e^-87` is about the least power of e that
/// is not a denormal (a denormal result is slow to make); smaller ones are taken as 0,
/// which changes no softmax sum.
pub(super) const LOWEST_EXPONENT: f32 = -87.0;

/// Runs `body` compiled for AVX-512.
///
/// # Safety
/// The host must have AVX-512F and AVX-512BW.
#[inline(always)]
pub(super) unsafe fn with_avx512<R>(body: impl FnOnce() -> R) -> R {
    #[target_feature(enable = "avx2,avx512f,avx512bw")]
    unsafe fn run<R>(body: impl FnOnce() -> R) -> R {
        body()
    }
    // SAFETY: the caller vouches for the host.
    unsafe { run(body) }
}

/// The columns of register `index` of a row below `limit`.
#[inline(always)]
unsafe fn below(index: usize, limit: usize) -> __mmask16 {
    let first = index * LANES;
    if first + LANES <= limit {
        0xffff
    } else if first >= limit {
        0
    } else {
        ((1u32 << (limit - first)) - 1) as __mmask16
    }
}

/// `nestor_math::fast_exp` of 16 lanes: the same operations on the same constants, in
/// the same order (no fused products), so each lane equals the scalar function's.
#[inline(always)]
pub(super) unsafe fn exp(x: __m512) -> __m512 {
    use nestor_math::{EXP_COEFFICIENTS, EXP_INPUT_RANGE, EXP_LOWEST_EXPONENT, LN_2_SPLIT};
    unsafe {
        let splat = _mm512_set1_ps;
        let [lowest, highest] = EXP_INPUT_RANGE;
        // `max` and `min` return their second operand when one is NaN: NaN stays NaN.
        let x = _mm512_min_ps(splat(highest), _mm512_max_ps(splat(lowest), x));
        let round = splat(12_582_912.0);
        let n = _mm512_sub_ps(
            _mm512_add_ps(_mm512_mul_ps(x, splat(std::f32::consts::LOG2_E)), round),
            round,
        );
        let r = _mm512_sub_ps(
            _mm512_sub_ps(x, _mm512_mul_ps(n, splat(LN_2_SPLIT[0] as f32))),
            _mm512_mul_ps(n, splat(LN_2_SPLIT[1] as f32)),
        );
        let mut polynomial = _mm512_setzero_ps();
        for coefficient in EXP_COEFFICIENTS {
            polynomial = _mm512_add_ps(_mm512_mul_ps(polynomial, r), splat(coefficient as f32));
        }
        let squared = _mm512_mul_ps(_mm512_mul_ps(polynomial, r), r);
        let reduced = _mm512_add_ps(_mm512_add_ps(squared, r), splat(1.0));
        // A NaN `n` becomes the lowest exponent (the scalar `max` ignores NaN).
        let exponent = _mm512_cvttps_epi32(_mm512_max_ps(n, splat(EXP_LOWEST_EXPONENT)));
        let half = _mm512_srai_epi32::<1>(exponent);
        let power_of_two = |n: __m512i| {
            _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                n,
                _mm512_set1_epi32(127),
            )))
        };
        let scaled = _mm512_mul_ps(reduced, power_of_two(half));
        _mm512_mul_ps(scaled, power_of_two(_mm512_sub_epi32(exponent, half)))
    }
}

/// `crate::bf16::round` of 16 lanes: to nearest even, NaN kept quiet.
#[inline(always)]
pub(super) unsafe fn round(values: __m512) -> __m256i {
    unsafe {
        let bits = _mm512_castps_si512(values);
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
        let biased = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), odd);
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(values, values);
        let rounded = _mm512_mask_mov_epi32(_mm512_srli_epi32::<16>(biased), nan, quiet);
        _mm512_cvtepi32_epi16(rounded)
    }
}

/// Scales a row of scores and returns the largest of its first `visible` (`-inf` when
/// none; NaN ignored) and whether one of the masked ones, from `visible` to `keys`, is
/// NaN or `+inf`.
///
/// # Safety
/// Code compiled for AVX-512 ([`with_avx512`]); the row's length a whole number of
/// registers.
#[inline(always)]
pub(super) unsafe fn scale(
    row: &mut [f32],
    scale: f32,
    (visible, keys): (usize, usize),
) -> (f32, bool) {
    unsafe {
        let factor = _mm512_set1_ps(scale);
        let mut largest = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut poisoned: __mmask16 = 0;
        for (index, chunk) in row.as_chunks_mut::<LANES>().0.iter_mut().enumerate() {
            let scaled = _mm512_mul_ps(_mm512_loadu_ps(chunk.as_ptr()), factor);
            _mm512_storeu_ps(chunk.as_mut_ptr(), scaled);
            let seen = below(index, visible);
            let larger = _mm512_mask_cmp_ps_mask::<_CMP_GT_OQ>(seen, scaled, largest);
            largest = _mm512_mask_mov_ps(largest, larger, scaled);
            let masked = below(index, keys) & !seen;
            let infinite = _mm512_set1_ps(f32::INFINITY);
            poisoned |= _mm512_mask_cmp_ps_mask::<_CMP_NLT_UQ>(masked, scaled, infinite);
        }
        (_mm512_reduce_max_ps(largest), poisoned != 0)
    }
}

/// `e^(score - largest)` of the columns in `seen`, 0 in the others and where the
/// exponent is below -87 (the result a denormal or 0: 0, and no denormal is made, which
/// is slow; a NaN stays NaN).
#[inline(always)]
unsafe fn numerators(scores: __m512, largest: __m512, seen: __mmask16) -> __m512 {
    // SAFETY: register arithmetic (the caller vouches for the host).
    unsafe {
        let exponent = _mm512_sub_ps(scores, largest);
        let lowest = _mm512_set1_ps(LOWEST_EXPONENT);
        let kept = _mm512_mask_cmp_ps_mask::<_CMP_NLT_UQ>(seen, exponent, lowest);
        // `max` keeps its second operand when it is NaN.
        _mm512_maskz_mov_ps(kept, exp(_mm512_max_ps(lowest, exponent)))
    }
}

/// The forward's numerators of a scaled row (see [`numerators`]; with no finite score,
/// `largest` `-inf`, 0, or NaN for a NaN score, as the tiled forward's), rounded into
/// `out` (zeros from the row's end to `out`'s, a whole number of registers too); returns
/// their sum.
///
/// # Safety
/// As [`scale`].
#[inline(always)]
pub(super) unsafe fn round_numerators(
    row: &[f32],
    largest: f32,
    visible: usize,
    out: &mut [u16],
) -> f32 {
    let scores = row.as_chunks::<LANES>().0;
    let (written, padding) = out.as_chunks_mut::<LANES>().0.split_at_mut(scores.len());
    padding.fill([0; LANES]);
    if largest == f32::NEG_INFINITY {
        let mut total = 0.0;
        for (column, (&score, out)) in row.iter().zip(written.as_flattened_mut()).enumerate() {
            let value = if column < visible && score.is_nan() {
                f32::NAN
            } else {
                0.0
            };
            total += value;
            *out = crate::bf16::round(value);
        }
        return total;
    }
    unsafe {
        let at = _mm512_set1_ps(largest);
        let mut total = _mm512_setzero_ps();
        for (index, (scores, out)) in scores.iter().zip(written).enumerate() {
            let values = numerators(_mm512_loadu_ps(scores.as_ptr()), at, below(index, visible));
            total = _mm512_add_ps(total, values);
            _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, round(values));
        }
        _mm512_reduce_add_ps(total)
    }
}

/// One query row's softmax in the gradient: `1 / sum` of its numerators, `rowsum(P dP)`,
/// and the keys it sees.
#[derive(Clone, Copy, Default)]
pub(super) struct GradRow {
    inverse: f32,
    dot: f32,
    limit: usize,
}

/// The gradient's first passes over a row of scores (scaled here) and its `dP`: the
/// numerators `e^(s - largest)` of the first `limit` scores in place (0 past them).
///
/// # Safety
/// As [`scale`]; `products` as long as `scores`.
#[inline(always)]
pub(super) unsafe fn grad_row(
    scores: &mut [f32],
    products: &[f32],
    scale: f32,
    limit: usize,
) -> GradRow {
    unsafe {
        let (largest, _) = self::scale(scores, scale, (limit, limit));
        let at = _mm512_set1_ps(largest);
        let mut total = _mm512_setzero_ps();
        let mut dot = _mm512_setzero_ps();
        let chunks = scores.as_chunks_mut::<LANES>().0.iter_mut();
        for (index, (scores, products)) in chunks.zip(products.as_chunks::<LANES>().0).enumerate() {
            let seen = below(index, limit);
            let values = numerators(_mm512_loadu_ps(scores.as_ptr()), at, seen);
            _mm512_storeu_ps(scores.as_mut_ptr(), values);
            total = _mm512_add_ps(total, values);
            // Past the limit `dP` may be anything (0 times infinity is NaN).
            let product = _mm512_mul_ps(values, _mm512_loadu_ps(products.as_ptr()));
            dot = _mm512_add_ps(dot, _mm512_maskz_mov_ps(seen, product));
        }
        let inverse = 1.0 / _mm512_reduce_add_ps(total);
        GradRow {
            inverse,
            dot: _mm512_reduce_add_ps(dot) * inverse,
            limit,
        }
    }
}

/// The rounded `P` and `dS = P (dP - rowsum(P dP))` of register `index` of a row
/// (numerators and `dP`), zeros past `keys` and for a row not `present`.
#[inline(always)]
unsafe fn probabilities_slopes(
    (scores, products): (&[f32], &[f32]),
    row: GradRow,
    index: usize,
    (keys, present): (usize, bool),
) -> (__m256i, __m256i) {
    unsafe {
        let at = index * LANES;
        let numerators = _mm512_loadu_ps(scores[at..at + LANES].as_ptr());
        let products = _mm512_loadu_ps(products[at..at + LANES].as_ptr());
        let p = _mm512_maskz_mov_ps(
            below(index, row.limit),
            _mm512_mul_ps(numerators, _mm512_set1_ps(row.inverse)),
        );
        let slope = _mm512_mul_ps(p, _mm512_sub_ps(products, _mm512_set1_ps(row.dot)));
        let keep = if present { below(index, keys) } else { 0 };
        (
            round(_mm512_maskz_mov_ps(keep, p)),
            round(_mm512_maskz_mov_ps(keep, slope)),
        )
    }
}

/// Where [`write_pair`] writes: each row's `dS` line, and with the keys' gradients, the
/// pair row of the `P` and `dS` panels.
pub(super) struct PairOut<'a> {
    pub slope_rows: [&'a mut [u16]; 2],
    pub panels: Option<(&'a mut crate::amx::Panel, &'a mut crate::amx::Panel, usize)>,
}

/// The last pass of the gradient over a pair of a block's rows (`present` says which
/// exist; a missing one is zeros): `P` and `dS` of every column up to the lines' depth
/// (zeros past the keys), `dS` rounded into each row's line, and `P` and `dS` rounded
/// into the panels' pair row, interleaved (the even row's in the low half).
///
/// # Safety
/// As [`scale`]; the score lines a whole number of registers, the `dS` lines at least as
/// long, the panels shaped for the keys.
#[inline(always)]
pub(super) unsafe fn write_pair(
    lines: [(&[f32], &[f32]); 2],
    (rows, present): ([GradRow; 2], [bool; 2]),
    keys: usize,
    out: PairOut<'_>,
) {
    let PairOut {
        slope_rows: [even_line, odd_line],
        mut panels,
    } = out;
    let registers = lines[0].0.len() / LANES;
    unsafe {
        for index in 0..even_line.len().min(odd_line.len()) / LANES {
            let (even, odd) = if index < registers {
                (
                    probabilities_slopes(lines[0], rows[0], index, (keys, present[0])),
                    probabilities_slopes(lines[1], rows[1], index, (keys, present[1])),
                )
            } else {
                let zero = _mm256_setzero_si256();
                ((zero, zero), (zero, zero))
            };
            let line =
                |line: &mut [u16]| line[index * LANES..][..LANES].as_mut_ptr() as *mut __m256i;
            _mm256_storeu_si256(line(even_line), even.1);
            if present[1] {
                _mm256_storeu_si256(line(odd_line), odd.1);
            }
            let Some((probabilities, slopes, pair)) = panels.as_mut() else {
                continue;
            };
            if index * LANES >= keys {
                continue;
            }
            let interleave = |even: __m256i, odd: __m256i, out: &mut [u32]| {
                let pairs = _mm512_or_si512(
                    _mm512_cvtepu16_epi32(even),
                    _mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(odd)),
                );
                _mm512_storeu_si512(out[..LANES].as_mut_ptr() as *mut __m512i, pairs);
            };
            interleave(even.0, odd.0, probabilities.pairs_mut(*pair, index));
            interleave(even.1, odd.1, slopes.pairs_mut(*pair, index));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn avx512() -> bool {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw")
    }

    /// The vector exp and rounding equal the scalar functions bit for bit, NaN,
    /// infinities, denormals and the ends of the range included.
    #[test]
    fn lanes_equal_the_scalar_functions() {
        if !avx512() {
            eprintln!("skipped: this host has no AVX-512");
            return;
        }
        let mut values: Vec<f32> = (-2000..2000).map(|i| i as f32 * 0.061).collect();
        values.extend([
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            f32::MAX,
            f32::MIN,
            -104.5,
            89.5,
            1.0 + 1.0 / 256.0,
        ]);
        values.resize(values.len().next_multiple_of(LANES), 0.5);
        for chunk in values.as_chunks::<LANES>().0 {
            let (mut exps, mut rounded) = ([0f32; LANES], [0u16; LANES]);
            unsafe {
                with_avx512(|| {
                    let x = _mm512_loadu_ps(chunk.as_ptr());
                    _mm512_storeu_ps(exps.as_mut_ptr(), exp(x));
                    _mm256_storeu_si256(rounded.as_mut_ptr() as *mut __m256i, round(x));
                })
            };
            for lane in 0..LANES {
                let x = chunk[lane];
                let scalar = nestor_math::fast_exp(x);
                assert!(
                    exps[lane].to_bits() == scalar.to_bits()
                        || (exps[lane].is_nan() && scalar.is_nan()),
                    "exp({x}) = {} in lanes, {scalar} scalar",
                    exps[lane]
                );
                assert_eq!(rounded[lane], crate::bf16::round(x), "round({x})");
            }
        }
    }
}
