//! The vector registers the fused attention kernels ([`super`]) run on: AVX-512 (16
//! f32 lanes, masks as bits) and AVX2 with FMA (8 lanes, masks as lanes of all ones).
//! Every operation gives the same value per lane on both.

use std::arch::x86_64::*;

/// The instruction sets the fused kernels run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::attention) enum Isa {
    /// AVX-512F and AVX-512BW: [`Avx512`].
    Avx512,
    /// AVX2 and FMA: [`Avx2`].
    Avx2,
}

impl Isa {
    /// Whether this host runs `self`.
    pub(in crate::attention) fn here(self) -> bool {
        match self {
            Isa::Avx512 => {
                std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
            }
            Isa::Avx2 => {
                std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
            }
        }
    }

    /// Its name, as vendors write it.
    pub(in crate::attention) fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "AVX-512",
            Isa::Avx2 => "AVX2",
        }
    }

    /// The widest this host runs, `None` without AVX2 and FMA.
    pub(in crate::attention) fn widest() -> Option<Isa> {
        Self::EVERY.into_iter().find(|isa| isa.here())
    }

    /// Every one this host runs, widest first (tests run the kernels on each).
    #[cfg(test)]
    pub(in crate::attention) fn all_here() -> Vec<Isa> {
        Self::EVERY.into_iter().filter(|isa| isa.here()).collect()
    }

    /// Every instruction set, widest first.
    const EVERY: [Isa; 2] = [Isa::Avx512, Isa::Avx2];
}

/// A register of f32 lanes and the operations on it the kernels use, with its masks
/// (lanes chosen by a mask are its "true" lanes).
///
/// # Safety
/// Every function runs only in code compiled for the instruction set
/// ([`Lanes::compiled`]) on a host that has it.
pub(super) trait Lanes: Copy {
    /// A choice of lanes.
    type Mask: Copy;
    /// Lanes of a register.
    const LANES: usize;
    /// Column registers a block of a product holds (its rows of sums fill the register
    /// file).
    const COLUMN_REGISTERS: usize;
    /// Query rows per chunk of the kernels: two registers of lanes (32 on AVX-512, 16 on
    /// AVX2, which ran faster than 32 there: the products' blocks are 16 columns wide
    /// anyway, and a causal chunk wastes less of its diagonal block).
    const CHUNK: usize = 2 * Self::LANES;

    /// Runs `body` compiled for the instruction set.
    unsafe fn compiled<R>(body: impl FnOnce() -> R) -> R;

    unsafe fn zero() -> Self;
    unsafe fn splat(value: f32) -> Self;
    unsafe fn load(at: *const f32) -> Self;
    unsafe fn store(self, at: *mut f32);
    /// The lanes of `mask` from `at` (the others neither read nor faulted on), zeros in
    /// the others.
    unsafe fn load_masked(at: *const f32, mask: Self::Mask) -> Self;
    /// Writes the lanes of `mask` to `at` (the others neither written nor faulted on).
    unsafe fn store_masked(self, at: *mut f32, mask: Self::Mask);

    unsafe fn add(self, other: Self) -> Self;
    unsafe fn sub(self, other: Self) -> Self;
    unsafe fn mul(self, other: Self) -> Self;
    unsafe fn div(self, other: Self) -> Self;
    /// `self * factor + addend`, rounded once.
    unsafe fn mul_add(self, factor: Self, addend: Self) -> Self;
    /// `addend - self * factor`, rounded once.
    unsafe fn neg_mul_add(self, factor: Self, addend: Self) -> Self;
    /// The larger of each pair of lanes, `other`'s where either is NaN.
    unsafe fn max(self, other: Self) -> Self;
    /// Each lane rounded to the nearest integer (ties to even).
    unsafe fn round(self) -> Self;
    /// `self * 2^n` for integers `n` (lanes whose `n` is outside `[-126, 127]` are
    /// not used by the callers: any value).
    unsafe fn times_power_of_two(self, n: Self) -> Self;

    /// `if_true`'s lanes where `mask` is true, else `if_false`'s.
    unsafe fn select(mask: Self::Mask, if_true: Self, if_false: Self) -> Self;
    /// `self > other`, false where either is NaN.
    unsafe fn greater(self, other: Self) -> Self::Mask;
    /// `!(self < other)`: true where either is NaN.
    unsafe fn not_less(self, other: Self) -> Self::Mask;
    /// `self == other`, false where either is NaN.
    unsafe fn equal(self, other: Self) -> Self::Mask;

    /// Every lane.
    unsafe fn all() -> Self::Mask;
    /// The lanes below `count` (all from [`Lanes::LANES`]).
    unsafe fn below(count: usize) -> Self::Mask;
    unsafe fn not(mask: Self::Mask) -> Self::Mask;
    unsafe fn and(a: Self::Mask, b: Self::Mask) -> Self::Mask;
    unsafe fn or(a: Self::Mask, b: Self::Mask) -> Self::Mask;

    /// Writes `rows` rows (at most [`Lanes::LANES`]; zeros past them) of `columns`
    /// values (at most [`Lanes::LANES`]) from `at`, `stride` scalars apart, transposed:
    /// `columns` rows of [`Lanes::LANES`] values at `target`, `target_stride` apart.
    unsafe fn transpose_block(
        source: (*const f32, isize),
        shape: (usize, usize),
        target: (*mut f32, usize),
    );
}

/// The [`Lanes`] methods that are one intrinsic on the register(s): `arithmetic` of
/// registers to a register, `compare` (by a predicate) to a mask.
macro_rules! one_intrinsic {
    (arithmetic $($name:ident($($operand:ident),*) => $intrinsic:ident;)*) => {$(
        #[inline(always)]
        unsafe fn $name(self, $($operand: Self),*) -> Self {
            // SAFETY: register arithmetic (the caller vouches for the host).
            unsafe { Self($intrinsic(self.0, $($operand.0),*)) }
        }
    )*};
    (compare $($name:ident => $intrinsic:ident::<$predicate:ident>;)*) => {$(
        #[inline(always)]
        unsafe fn $name(self, other: Self) -> Self::Mask {
            // SAFETY: register arithmetic (the caller vouches for the host).
            unsafe { $intrinsic::<$predicate>(self.0, other.0) }
        }
    )*};
}

/// AVX-512: 16 lanes, 32 registers.
#[derive(Clone, Copy)]
pub(super) struct Avx512(__m512);

impl Lanes for Avx512 {
    type Mask = __mmask16;
    const LANES: usize = 16;
    const COLUMN_REGISTERS: usize = 4;

    #[inline(always)]
    unsafe fn compiled<R>(body: impl FnOnce() -> R) -> R {
        #[target_feature(enable = "avx2,fma,avx512f,avx512bw")]
        unsafe fn run<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        // SAFETY: the caller vouches for the host.
        unsafe { run(body) }
    }

    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { Self(_mm512_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(value: f32) -> Self {
        unsafe { Self(_mm512_set1_ps(value)) }
    }
    #[inline(always)]
    unsafe fn load(at: *const f32) -> Self {
        unsafe { Self(_mm512_loadu_ps(at)) }
    }
    #[inline(always)]
    unsafe fn store(self, at: *mut f32) {
        unsafe { _mm512_storeu_ps(at, self.0) }
    }
    #[inline(always)]
    unsafe fn load_masked(at: *const f32, mask: __mmask16) -> Self {
        unsafe { Self(_mm512_maskz_loadu_ps(mask, at)) }
    }
    #[inline(always)]
    unsafe fn store_masked(self, at: *mut f32, mask: __mmask16) {
        unsafe { _mm512_mask_storeu_ps(at, mask, self.0) }
    }
    one_intrinsic! { arithmetic
        add(other) => _mm512_add_ps;
        sub(other) => _mm512_sub_ps;
        mul(other) => _mm512_mul_ps;
        div(other) => _mm512_div_ps;
        max(other) => _mm512_max_ps;
        mul_add(factor, addend) => _mm512_fmadd_ps;
        neg_mul_add(factor, addend) => _mm512_fnmadd_ps;
    }
    one_intrinsic! { compare
        greater => _mm512_cmp_ps_mask::<_CMP_GT_OQ>;
        not_less => _mm512_cmp_ps_mask::<_CMP_NLT_UQ>;
        equal => _mm512_cmp_ps_mask::<_CMP_EQ_OQ>;
    }
    #[inline(always)]
    unsafe fn round(self) -> Self {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        unsafe { Self(_mm512_roundscale_ps::<NEAREST>(self.0)) }
    }
    #[inline(always)]
    unsafe fn times_power_of_two(self, n: Self) -> Self {
        unsafe { Self(_mm512_scalef_ps(self.0, n.0)) }
    }
    #[inline(always)]
    unsafe fn select(mask: __mmask16, if_true: Self, if_false: Self) -> Self {
        unsafe { Self(_mm512_mask_mov_ps(if_false.0, mask, if_true.0)) }
    }
    #[inline(always)]
    unsafe fn all() -> __mmask16 {
        0xffff
    }
    #[inline(always)]
    unsafe fn below(count: usize) -> __mmask16 {
        if count >= Self::LANES {
            0xffff
        } else {
            ((1u32 << count) - 1) as __mmask16
        }
    }
    #[inline(always)]
    unsafe fn not(mask: __mmask16) -> __mmask16 {
        !mask
    }
    #[inline(always)]
    unsafe fn and(a: __mmask16, b: __mmask16) -> __mmask16 {
        a & b
    }
    #[inline(always)]
    unsafe fn or(a: __mmask16, b: __mmask16) -> __mmask16 {
        a | b
    }

    /// 16 registers transposed: interleaved by 32 and 64 bits, then by 128-bit lanes
    /// twice.
    #[inline(always)]
    unsafe fn transpose_block(
        (at, stride): (*const f32, isize),
        (rows, columns): (usize, usize),
        (target, target_stride): (*mut f32, usize),
    ) {
        // SAFETY: the caller vouches for the rows, columns and target.
        unsafe {
            let mask = Self::below(columns);
            let rows: [__m512; 16] = std::array::from_fn(|row| match row < rows {
                true => _mm512_maskz_loadu_ps(mask, at.offset(row as isize * stride)),
                false => _mm512_setzero_ps(),
            });
            let mut pairs = rows;
            for pair in 0..8 {
                let (even, odd) = (rows[2 * pair], rows[2 * pair + 1]);
                pairs[2 * pair] = _mm512_unpacklo_ps(even, odd);
                pairs[2 * pair + 1] = _mm512_unpackhi_ps(even, odd);
            }
            let mut quads = pairs;
            for base in (0..16).step_by(4) {
                let half = |at: usize| _mm512_castps_pd(pairs[base + at]);
                let (low, high) = ((half(0), half(2)), (half(1), half(3)));
                quads[base] = _mm512_castpd_ps(_mm512_unpacklo_pd(low.0, low.1));
                quads[base + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(low.0, low.1));
                quads[base + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(high.0, high.1));
                quads[base + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(high.0, high.1));
            }
            /// Registers `at` and `at + distance` made their 128-bit lanes 0 and 2
            /// (into `at`) and 1 and 3 (into `at + distance`).
            #[inline(always)]
            unsafe fn by_lanes(registers: [__m512; 16], distance: usize) -> [__m512; 16] {
                let mut out = registers;
                for at in (0..16).filter(|at| at & distance == 0) {
                    let (a, b) = (registers[at], registers[at + distance]);
                    // SAFETY: register shuffles (the caller vouches for the host).
                    unsafe {
                        out[at] = _mm512_shuffle_f32x4::<0x88>(a, b);
                        out[at + distance] = _mm512_shuffle_f32x4::<0xdd>(a, b);
                    }
                }
                out
            }
            let block = by_lanes(by_lanes(quads, 4), 8);
            for (column, &values) in block.iter().take(columns).enumerate() {
                _mm512_storeu_ps(target.add(column * target_stride), values);
            }
        }
    }
}

/// AVX2 with FMA: 8 lanes, 16 registers.
#[derive(Clone, Copy)]
pub(super) struct Avx2(__m256);

impl Avx2 {
    /// A mask's lanes as the integers `maskload` and `maskstore` take.
    #[inline(always)]
    unsafe fn integers(mask: __m256) -> __m256i {
        unsafe { _mm256_castps_si256(mask) }
    }
}

impl Lanes for Avx2 {
    type Mask = __m256;
    const LANES: usize = 8;
    const COLUMN_REGISTERS: usize = 2;

    #[inline(always)]
    unsafe fn compiled<R>(body: impl FnOnce() -> R) -> R {
        #[target_feature(enable = "avx2,fma")]
        unsafe fn run<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        // SAFETY: the caller vouches for the host.
        unsafe { run(body) }
    }

    #[inline(always)]
    unsafe fn zero() -> Self {
        unsafe { Self(_mm256_setzero_ps()) }
    }
    #[inline(always)]
    unsafe fn splat(value: f32) -> Self {
        unsafe { Self(_mm256_set1_ps(value)) }
    }
    #[inline(always)]
    unsafe fn load(at: *const f32) -> Self {
        unsafe { Self(_mm256_loadu_ps(at)) }
    }
    #[inline(always)]
    unsafe fn store(self, at: *mut f32) {
        unsafe { _mm256_storeu_ps(at, self.0) }
    }
    #[inline(always)]
    unsafe fn load_masked(at: *const f32, mask: __m256) -> Self {
        unsafe { Self(_mm256_maskload_ps(at, Self::integers(mask))) }
    }
    #[inline(always)]
    unsafe fn store_masked(self, at: *mut f32, mask: __m256) {
        unsafe { _mm256_maskstore_ps(at, Self::integers(mask), self.0) }
    }
    one_intrinsic! { arithmetic
        add(other) => _mm256_add_ps;
        sub(other) => _mm256_sub_ps;
        mul(other) => _mm256_mul_ps;
        div(other) => _mm256_div_ps;
        max(other) => _mm256_max_ps;
        mul_add(factor, addend) => _mm256_fmadd_ps;
        neg_mul_add(factor, addend) => _mm256_fnmadd_ps;
    }
    one_intrinsic! { compare
        greater => _mm256_cmp_ps::<_CMP_GT_OQ>;
        not_less => _mm256_cmp_ps::<_CMP_NLT_UQ>;
        equal => _mm256_cmp_ps::<_CMP_EQ_OQ>;
    }
    #[inline(always)]
    unsafe fn round(self) -> Self {
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        unsafe { Self(_mm256_round_ps::<NEAREST>(self.0)) }
    }
    /// The power as bits: exact for `n` in `[-126, 127]`, as AVX-512's `scalef`.
    #[inline(always)]
    unsafe fn times_power_of_two(self, n: Self) -> Self {
        unsafe {
            let biased = _mm256_add_epi32(_mm256_cvtps_epi32(n.0), _mm256_set1_epi32(127));
            let power = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased));
            Self(_mm256_mul_ps(self.0, power))
        }
    }
    #[inline(always)]
    unsafe fn select(mask: __m256, if_true: Self, if_false: Self) -> Self {
        unsafe { Self(_mm256_blendv_ps(if_false.0, if_true.0, mask)) }
    }
    #[inline(always)]
    unsafe fn all() -> __m256 {
        unsafe { _mm256_castsi256_ps(_mm256_set1_epi32(-1)) }
    }
    #[inline(always)]
    unsafe fn below(count: usize) -> __m256 {
        unsafe {
            let count = _mm256_set1_epi32(count.min(Self::LANES) as i32);
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, lanes))
        }
    }
    #[inline(always)]
    unsafe fn not(mask: __m256) -> __m256 {
        unsafe { _mm256_xor_ps(mask, Self::all()) }
    }
    #[inline(always)]
    unsafe fn and(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_and_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn or(a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_or_ps(a, b) }
    }

    /// 8 registers transposed: interleaved by 32 and 64 bits, then by 128-bit halves.
    #[inline(always)]
    unsafe fn transpose_block(
        (at, stride): (*const f32, isize),
        (rows, columns): (usize, usize),
        (target, target_stride): (*mut f32, usize),
    ) {
        // SAFETY: the caller vouches for the rows, columns and target.
        unsafe {
            let mask = Self::integers(Self::below(columns));
            let rows: [__m256; 8] = std::array::from_fn(|row| match row < rows {
                true => _mm256_maskload_ps(at.offset(row as isize * stride), mask),
                false => _mm256_setzero_ps(),
            });
            let mut pairs = rows;
            for pair in 0..4 {
                let (even, odd) = (rows[2 * pair], rows[2 * pair + 1]);
                pairs[2 * pair] = _mm256_unpacklo_ps(even, odd);
                pairs[2 * pair + 1] = _mm256_unpackhi_ps(even, odd);
            }
            let mut quads = pairs;
            for base in (0..8).step_by(4) {
                let half = |at: usize| _mm256_castps_pd(pairs[base + at]);
                let (low, high) = ((half(0), half(2)), (half(1), half(3)));
                quads[base] = _mm256_castpd_ps(_mm256_unpacklo_pd(low.0, low.1));
                quads[base + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(low.0, low.1));
                quads[base + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(high.0, high.1));
                quads[base + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(high.0, high.1));
            }
            let mut block = quads;
            for at in 0..4 {
                let (a, b) = (quads[at], quads[at + 4]);
                block[at] = _mm256_permute2f128_ps::<0x20>(a, b);
                block[at + 4] = _mm256_permute2f128_ps::<0x31>(a, b);
            }
            for (column, &values) in block.iter().take(columns).enumerate() {
                _mm256_storeu_ps(target.add(column * target_stride), values);
            }
        }
    }
}
