//! Direct convolution of packed images (rows are pixels, channels last): every output
//! row of every image is a task; a task computes blocks of [`PIXELS`] output pixels x
//! [`LANES`] output channels whose sums stay in registers, reading each tap's input
//! pixels in place (a tap outside its image reads a zero pixel). No gathered copy, no
//! padded image. f32 sums live in AVX-512 or AVX2 registers when the CPU has them;
//! other types and CPUs run the same loops on arrays.

use nestor_ir::Window2d;

use nestor_layout::WindowImage;

use crate::scalar::Scalar;

/// Output channels computed at once (one 512-bit vector of f32).
const LANES: usize = 16;

/// Everything a task reads: the buffers, the weight packed for blocks of [`LANES`]
/// output channels, the images. A pixel is `units` values of `U`: its channels (`U` is
/// `T`), or for bf16 products its channels' roundings two to a `u32` ([`Bf16Pair`]).
pub(super) struct Plan<'a, T, U = T> {
    out: *mut T,
    x: *const U,
    /// `[taps, units, lanes]` (output channels padded to a multiple of [`LANES`]).
    weight: Vec<U>,
    /// `[lanes]`: the bias, zeros when none, padded like the weight.
    bias: Vec<T>,
    /// A pixel of zeros (`units` values): what taps outside their image read.
    zeros: Vec<U>,
    units: usize,
    width: usize,
    lanes: usize,
    window: Window2d,
    images: &'a [WindowImage],
}

// SAFETY: tasks write disjoint output rows (each its own image row) and only read the
// rest.
unsafe impl<T: Sync, U: Sync> Sync for Plan<'_, T, U> {}

/// Two channels' bf16 roundings (the even channel's in the low half), what
/// `vdpbf16ps` multiplies pairwise.
pub(super) type Bf16Pair = u32;

impl<'a, T: Scalar> Plan<'a, T> {
    /// A plan for the weight `[width, channels, K_h, K_w]` and the bias `[width]`.
    ///
    /// # Safety
    /// `weight` and `bias` must hold that many values; `out` and `x` must hold every
    /// pixel of `images` times `width` and `channels` values.
    pub(super) unsafe fn new(
        (out, x): (*mut T, *const T),
        (weight, bias): (*const T, Option<*const T>),
        (channels, width): (usize, usize),
        window: Window2d,
        images: &'a [WindowImage],
    ) -> Self {
        let taps = (window.kernel[0] * window.kernel[1]).max(0) as usize;
        let lanes = width.div_ceil(LANES) * LANES;
        let weight = unsafe { std::slice::from_raw_parts(weight, width * channels * taps) };
        let mut packed = vec![T::ZERO; taps * channels * lanes];
        for o in 0..width {
            for c in 0..channels {
                for t in 0..taps {
                    packed[(t * channels + c) * lanes + o] = weight[(o * channels + c) * taps + t];
                }
            }
        }
        let mut padded_bias = vec![T::ZERO; lanes];
        if let Some(bias) = bias {
            padded_bias[..width]
                .copy_from_slice(unsafe { std::slice::from_raw_parts(bias, width) });
        }
        Self {
            out,
            x,
            weight: packed,
            bias: padded_bias,
            zeros: vec![T::ZERO; channels],
            units: channels,
            width,
            lanes,
            window,
            images,
        }
    }

    /// Output row `row` of `image`, with the fastest code the CPU runs.
    pub(super) fn row(&self, image: usize, row: i64) {
        #[cfg(target_arch = "x86_64")]
        if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
            // SAFETY: `T` is `f32` (checked just above), so the plans are the same type.
            let plan = unsafe { &*(self as *const Self as *const Plan<'_, f32>) };
            if std::is_x86_feature_detected!("avx512f") {
                // The CPU has AVX-512 (checked just above).
                return unsafe { plan.row_avx512(image, row) };
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // The CPU has AVX2 and FMA (checked just above).
                return unsafe { plan.row_avx2(image, row) };
            }
        }
        // Portable code (any type, any CPU): sums in arrays.
        unsafe { self.row_with::<[T; LANES], 4>(image, row) }
    }
}

impl<T: Scalar, U: Copy> Plan<'_, T, U> {
    /// Output row `oy` of image `index`: blocks of `P` pixels x [`LANES`] channels
    /// whose sums are held as `V`.
    ///
    /// # Safety
    /// The CPU must run `V`'s instructions.
    #[inline(always)]
    unsafe fn row_with<V: TapProducts<T, U>, const P: usize>(&self, index: usize, oy: i64) {
        let out_width = self.images[index].out.1.max(0);
        // SAFETY: as the caller vouches.
        unsafe { self.pixels_with::<V, P>(index, oy, 0..out_width) }
    }

    /// [`Plan::row_with`] in blocks of `P` pixels while whole ones fill the row, the rest
    /// in blocks of `TAIL` (at the end of a row of 50 pixels, 12 at a time, a block of 12
    /// sums for 2 pixels took as long as a whole one).
    ///
    /// # Safety
    /// As [`Plan::row_with`].
    #[inline(always)]
    unsafe fn row_with_tail<V: TapProducts<T, U>, const P: usize, const TAIL: usize>(
        &self,
        index: usize,
        oy: i64,
    ) {
        let out_width = self.images[index].out.1.max(0);
        let whole = out_width / P as i64 * P as i64;
        // SAFETY: as the caller vouches.
        unsafe {
            self.pixels_with::<V, P>(index, oy, 0..whole);
            self.pixels_with::<V, TAIL>(index, oy, whole..out_width);
        }
    }

    /// Output pixels `pixels` of row `oy` of image `index` (see [`Plan::row_with`]).
    ///
    /// # Safety
    /// As [`Plan::row_with`].
    #[inline(always)]
    unsafe fn pixels_with<V: TapProducts<T, U>, const P: usize>(
        &self,
        index: usize,
        oy: i64,
        pixels: std::ops::Range<i64>,
    ) {
        let image = self.images[index];
        let Window2d {
            kernel,
            stride,
            padding,
            dilation,
        } = self.window;
        let (height, width) = image.size;
        let out_width = image.out.1;
        let units = self.units;
        let mut ox = pixels.start;
        while ox < pixels.end {
            let count = (pixels.end - ox).min(P as i64) as usize;
            for block in (0..self.lanes).step_by(LANES) {
                // SAFETY (the block): the bias and weight hold `lanes` values per row.
                let bias = unsafe { V::load(self.bias.as_ptr().add(block)) };
                let mut sums = [bias; P];
                for ky in 0..kernel[0] {
                    let y = oy * stride[0] - padding[0] + ky * dilation[0];
                    if !(0..height).contains(&y) {
                        continue; // a row of padding zeros adds nothing
                    }
                    // SAFETY (the pointers below): pixel (y, x) of the image, for `x`
                    // in `0..width`, is a row of `x`.
                    let row = unsafe { self.x.add((image.input + (y * width) as usize) * units) };
                    for kx in 0..kernel[1] {
                        let first = ox * stride[1] - padding[1] + kx * dilation[1];
                        let last = first + (count as i64 - 1) * stride[1];
                        let mut sources = [self.zeros.as_ptr(); P];
                        if count == P && first >= 0 && last < width {
                            // The whole block inside the image: evenly spaced rows.
                            let step = stride[1] as usize * units;
                            let start = unsafe { row.add(first as usize * units) };
                            for (pixel, source) in sources.iter_mut().enumerate() {
                                *source = unsafe { start.add(pixel * step) };
                            }
                        } else {
                            for (pixel, source) in sources.iter_mut().enumerate().take(count) {
                                let x = first + pixel as i64 * stride[1];
                                if (0..width).contains(&x) {
                                    *source = unsafe { row.add(x as usize * units) };
                                }
                            }
                        }
                        let tap = (ky * kernel[1] + kx) as usize;
                        // SAFETY: the packed weight holds `units` rows of `lanes` values
                        // per tap; every source holds `units` values.
                        unsafe {
                            let weights =
                                self.weight.as_ptr().add(tap * units * self.lanes + block);
                            V::add_tap(&mut sums, &sources, weights, (units, self.lanes));
                        }
                    }
                }
                let columns = (self.width - block).min(LANES);
                for (pixel, sum) in sums.iter().enumerate().take(count) {
                    let at = image.output + (oy * out_width + ox) as usize + pixel;
                    // SAFETY: output pixel `at` is in this task's row.
                    unsafe { sum.store(self.out.add(at * self.width + block), columns) };
                }
            }
            ox += count as i64;
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl Plan<'_, f32> {
    /// [`Plan::row`] for f32 on AVX-512: 12 pixels x 16 channels in 12 registers, a
    /// row's last pixels 4 at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn row_avx512(&self, image: usize, row: i64) {
        unsafe { self.row_with_tail::<x86::Zmm, 12, 4>(image, row) }
    }

    /// [`Plan::row`] for f32 on AVX2: 4 pixels x 16 channels in 8 registers.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn row_avx2(&self, image: usize, row: i64) {
        unsafe { self.row_with::<x86::Ymm2, 4>(image, row) }
    }
}

impl<'a> Plan<'a, f32, Bf16Pair> {
    /// A plan multiplying bf16 roundings ([`crate::bf16::round`]) with f32 sums: `x` the
    /// input pixels' channels rounded two to a [`Bf16Pair`] (an even count of
    /// channels), the weight `[width, channels, K_h, K_w]` rounded here, the bias
    /// `[width]` added in f32. `None` where the CPU has no AVX512-BF16 or the channels
    /// are odd.
    ///
    /// # Safety
    /// `weight` and `bias` must hold that many values; `out` must hold every output
    /// pixel of `images` times `width` values, `x` every input pixel's `channels / 2`
    /// pairs.
    pub(super) unsafe fn bf16(
        (out, x): (*mut f32, *const Bf16Pair),
        (weight, bias): (*const f32, Option<*const f32>),
        (channels, width): (usize, usize),
        window: Window2d,
        images: &'a [WindowImage],
    ) -> Option<Self> {
        if !crate::dot::host_has() || !channels.is_multiple_of(2) {
            return None;
        }
        // The f32 plan's packing (`[taps, channels, lanes]`), rounded two channels at
        // a time.
        let plan = unsafe {
            Plan::<f32>::new(
                (out, std::ptr::null()),
                (weight, bias),
                (channels, width),
                window,
                images,
            )
        };
        let (pairs, lanes) = (channels / 2, plan.lanes);
        let taps = plan.weight.len() / (channels * lanes).max(1);
        let mut packed = vec![0; taps * pairs * lanes];
        for t in 0..taps {
            for pair in 0..pairs {
                for o in 0..lanes {
                    let even = plan.weight[(t * channels + 2 * pair) * lanes + o];
                    let odd = plan.weight[(t * channels + 2 * pair + 1) * lanes + o];
                    packed[(t * pairs + pair) * lanes + o] = pair_of(even, odd);
                }
            }
        }
        Some(Self {
            out,
            x,
            weight: packed,
            bias: plan.bias,
            zeros: vec![0; pairs],
            units: pairs,
            width,
            lanes,
            window,
            images,
        })
    }

    /// Output row `row` of `image`.
    pub(super) fn row(&self, image: usize, row: i64) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: plans of bf16 pairs exist only where the CPU has AVX512-BF16 (`bf16`).
        unsafe {
            self.row_bf16(image, row)
        }
    }

    /// [`Plan::row`] on AVX512-BF16: 12 pixels x 16 channels in 12 registers, two
    /// channels a product.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and AVX512-BF16.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn row_bf16(&self, image: usize, row: i64) {
        unsafe { self.row_with::<x86::Zmm, 12>(image, row) }
    }
}

/// The bf16 roundings of two channels as a [`Bf16Pair`].
pub(super) fn pair_of(even: f32, odd: f32) -> Bf16Pair {
    u32::from(crate::bf16::round(even)) | u32::from(crate::bf16::round(odd)) << 16
}

/// A convolution's weight gradient over blocks of output pixels: for every tap `t`,
/// input channel `c` and output channel `o`, `sum over pixels r of g[r, o]
/// x[taps[r, t], c]`, with the sums of [`LANES`] output channels x a few input channels
/// in registers while the block's pixels stream by.
pub(super) struct GradPlan<'a, T> {
    /// Input pixels.
    pub(super) x: *const T,
    /// The output's gradient, rows of `lanes` values (output channels padded to a
    /// multiple of [`LANES`]).
    pub(super) g: &'a [T],
    pub(super) per_window: usize,
    pub(super) channels: usize,
    pub(super) lanes: usize,
}

// SAFETY: tasks only read the plan (each writes its own block's sums).
unsafe impl<T: Sync> Sync for GradPlan<'_, T> {}

impl<T: Scalar> GradPlan<'_, T> {
    /// The sums over output pixels `first..last` into `partial` (`[taps, channels,
    /// lanes]`, written whole), `taps` the input rows under those pixels' taps (-1
    /// outside their image; `per_window` a pixel, from pixel `first` on).
    pub(super) fn block(&self, (first, last): (usize, usize), taps: &[i64], partial: &mut [T]) {
        if taps.len() < (last - first) * self.per_window {
            // Not taps for every pixel: nothing is summed (callers give them all).
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
            // SAFETY: `T` is `f32` (checked just above): the same types.
            let (plan, partial) = unsafe {
                (
                    &*(self as *const Self as *const GradPlan<'_, f32>),
                    std::slice::from_raw_parts_mut(partial.as_mut_ptr() as *mut f32, partial.len()),
                )
            };
            if std::is_x86_feature_detected!("avx512f") {
                // The CPU has AVX-512 (checked just above).
                return unsafe { plan.block_avx512((first, last), taps, partial) };
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // The CPU has AVX2 and FMA (checked just above).
                return unsafe { plan.block_avx2((first, last), taps, partial) };
            }
        }
        // Portable code (any type, any CPU).
        unsafe { self.block_with::<[T; LANES], 4>((first, last), taps, partial) }
    }

    /// [`GradPlan::block`] with sums held as `V`, `CH` input channels at a time (or,
    /// for fewer channels, [`GradPlan::taps_at_once`]).
    ///
    /// # Safety
    /// The CPU must run `V`'s instructions.
    #[inline(always)]
    unsafe fn block_with<V: Lanes<T>, const CH: usize>(
        &self,
        (first, last): (usize, usize),
        taps: &[i64],
        partial: &mut [T],
    ) {
        let (channels, lanes) = (self.channels, self.lanes);
        if (1..CH.min(9)).contains(&channels) {
            return unsafe { self.taps_at_once::<V, CH>((first, last), taps, partial) };
        }
        for t in 0..self.per_window {
            for block in (0..lanes).step_by(LANES) {
                for c0 in (0..channels).step_by(CH) {
                    let count = (channels - c0).min(CH);
                    let mut sums = [unsafe { V::splat(T::ZERO) }; CH];
                    for r in first..last {
                        let source = taps[(r - first) * self.per_window + t];
                        if source < 0 {
                            continue;
                        }
                        // SAFETY: `g` holds `lanes` values per pixel; the taps name rows
                        // of `x` of `channels` values.
                        unsafe {
                            let g = V::load(self.g.as_ptr().add(r * lanes + block));
                            let pixel = self.x.add(source as usize * channels + c0);
                            if count == CH {
                                // A whole chunk: no test per channel.
                                for (c, sum) in sums.iter_mut().enumerate() {
                                    *sum = sum.add_product(V::splat(*pixel.add(c)), g);
                                }
                            } else {
                                for (c, sum) in sums.iter_mut().enumerate().take(count) {
                                    *sum = sum.add_product(V::splat(*pixel.add(c)), g);
                                }
                            }
                        }
                    }
                    for (c, sum) in sums.iter().enumerate().take(count) {
                        let at = (t * channels + c0 + c) * lanes + block;
                        // SAFETY: `partial` holds `taps * channels * lanes` values.
                        unsafe { sum.store(partial.as_mut_ptr().add(at), LANES) };
                    }
                }
            }
        }
    }
}

impl<T: Scalar> GradPlan<'_, T> {
    /// [`GradPlan::block_with`] for fewer than `CH` input channels (an image's first
    /// convolution: 3): the sums of `CH / channels` taps' channels at once, so that each
    /// pixel's gradient row is loaded once for up to `CH` products rather than once for
    /// `channels`. Each sum still adds its pixels in order (the same values).
    ///
    /// # Safety
    /// The CPU must run `V`'s instructions; `0 < channels < CH`.
    #[inline(always)]
    unsafe fn taps_at_once<V: Lanes<T>, const CH: usize>(
        &self,
        rows: (usize, usize),
        taps: &[i64],
        partial: &mut [T],
    ) {
        // The channel count as a constant, so that each sum is a register.
        unsafe {
            match self.channels {
                1 => self.taps_of::<V, CH, 1>(rows, taps, partial),
                2 => self.taps_of::<V, CH, 2>(rows, taps, partial),
                3 => self.taps_of::<V, CH, 3>(rows, taps, partial),
                4 => self.taps_of::<V, CH, 4>(rows, taps, partial),
                5 => self.taps_of::<V, CH, 5>(rows, taps, partial),
                6 => self.taps_of::<V, CH, 6>(rows, taps, partial),
                7 => self.taps_of::<V, CH, 7>(rows, taps, partial),
                _ => self.taps_of::<V, CH, 8>(rows, taps, partial),
            }
        }
    }

    /// [`GradPlan::taps_at_once`] for `C` channels (8 for 8: `channels <= C`, each tap's
    /// sums the first `channels` of its `C`).
    ///
    /// # Safety
    /// As [`GradPlan::taps_at_once`]; `channels <= C < CH`.
    #[inline(always)]
    unsafe fn taps_of<V: Lanes<T>, const CH: usize, const C: usize>(
        &self,
        (first, last): (usize, usize),
        table: &[i64],
        partial: &mut [T],
    ) {
        let (channels, lanes, per_window) = (self.channels, self.lanes, self.per_window);
        let group = (CH / C).max(1);
        for t0 in (0..per_window).step_by(group) {
            let taps = (per_window - t0).min(group);
            for block in (0..lanes).step_by(LANES) {
                let mut sums = [unsafe { V::splat(T::ZERO) }; CH];
                for r in first..last {
                    // SAFETY: `table` holds `per_window` rows per pixel (`t0 + j` is below
                    // `per_window`), `g` `lanes` values per pixel; the taps name rows of
                    // `x` of `channels` values.
                    unsafe {
                        let row_taps = table.as_ptr().add((r - first) * per_window + t0);
                        let g = V::load(self.g.as_ptr().add(r * lanes + block));
                        for (j, tap_sums) in sums.chunks_exact_mut(C).enumerate() {
                            let source = *row_taps.add(j.min(taps - 1));
                            if j >= taps || source < 0 {
                                continue;
                            }
                            let pixel = self.x.add(source as usize * channels);
                            for (c, sum) in tap_sums.iter_mut().enumerate() {
                                if C == channels || c < channels {
                                    *sum = sum.add_product(V::splat(*pixel.add(c)), g);
                                }
                            }
                        }
                    }
                }
                for j in 0..taps {
                    for c in 0..channels {
                        // Sum (tap t0 + j, channel c).
                        let at = ((t0 + j) * channels + c) * lanes + block;
                        // SAFETY: `partial` holds `taps * channels * lanes` values.
                        unsafe { sums[j * C + c].store(partial.as_mut_ptr().add(at), LANES) };
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
impl GradPlan<'_, f32> {
    /// [`GradPlan::block`] for f32 on AVX-512: 16 input channels x 16 output channels
    /// in 16 registers.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn block_avx512(&self, rows: (usize, usize), taps: &[i64], partial: &mut [f32]) {
        unsafe { self.block_with::<x86::Zmm, 16>(rows, taps, partial) }
    }

    /// [`GradPlan::block`] for f32 on AVX2: 6 input channels x 16 output channels in 12
    /// registers.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_avx2(&self, rows: (usize, usize), taps: &[i64], partial: &mut [f32]) {
        unsafe { self.block_with::<x86::Ymm2, 6>(rows, taps, partial) }
    }
}

/// The sums of [`LANES`] output channels of one pixel.
trait Lanes<T>: Copy {
    /// [`LANES`] values from `at`.
    ///
    /// # Safety
    /// `at` must hold them; the CPU must run the type's instructions.
    unsafe fn load(at: *const T) -> Self;
    /// `value` in every lane.
    ///
    /// # Safety
    /// The CPU must run the type's instructions.
    unsafe fn splat(value: T) -> Self;
    /// `self + a * b`, lane by lane.
    ///
    /// # Safety
    /// The CPU must run the type's instructions.
    unsafe fn add_product(self, a: Self, b: Self) -> Self;
    /// The first `count` lanes to `at`.
    ///
    /// # Safety
    /// `at` must hold them; the CPU must run the type's instructions.
    unsafe fn store(self, at: *mut T, count: usize);
}

/// How a block of pixels adds one tap's products to its sums.
trait TapProducts<T, U>: Lanes<T> {
    /// Adds, to each pixel's sums, its `units` values (at its source) times the weight's
    /// rows of [`LANES`] output channels, `lanes` apart from `weights`.
    ///
    /// # Safety
    /// Every source must hold `units` values, `weights` `units` rows; the CPU must run
    /// the type's instructions.
    unsafe fn add_tap<const P: usize>(
        sums: &mut [Self; P],
        sources: &[*const U; P],
        weights: *const U,
        units_and_lanes: (usize, usize),
    );
}

/// Channels of `T`: a broadcast channel times a row of weights, by fused multiply-add.
impl<T: Copy, V: Lanes<T>> TapProducts<T, T> for V {
    #[inline(always)]
    unsafe fn add_tap<const P: usize>(
        sums: &mut [Self; P],
        sources: &[*const T; P],
        weights: *const T,
        (units, lanes): (usize, usize),
    ) {
        for c in 0..units {
            unsafe {
                let w = V::load(weights.add(c * lanes));
                for (sum, source) in sums.iter_mut().zip(sources) {
                    *sum = sum.add_product(V::splat(*source.add(c)), w);
                }
            }
        }
    }
}

/// Portable lanes.
impl<T: Scalar> Lanes<T> for [T; LANES] {
    #[inline(always)]
    unsafe fn load(at: *const T) -> Self {
        let mut lanes = [T::ZERO; LANES];
        lanes.copy_from_slice(unsafe { std::slice::from_raw_parts(at, LANES) });
        lanes
    }
    #[inline(always)]
    unsafe fn splat(value: T) -> Self {
        [value; LANES]
    }
    #[inline(always)]
    unsafe fn add_product(mut self, a: Self, b: Self) -> Self {
        for ((s, a), b) in self.iter_mut().zip(a).zip(b) {
            *s += a * b;
        }
        self
    }
    #[inline(always)]
    unsafe fn store(self, at: *mut T, count: usize) {
        unsafe { std::slice::from_raw_parts_mut(at, count) }.copy_from_slice(&self[..count]);
    }
}

/// f32 lanes in x86 vector registers (their functions are inlined into callers that
/// enable the instructions).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Bf16Pair, Lanes, TapProducts, LANES};

    /// One AVX-512 register.
    #[derive(Clone, Copy)]
    pub(super) struct Zmm(__m512);

    impl Lanes<f32> for Zmm {
        #[inline(always)]
        unsafe fn load(at: *const f32) -> Self {
            Self(unsafe { _mm512_loadu_ps(at) })
        }
        #[inline(always)]
        unsafe fn splat(value: f32) -> Self {
            Self(unsafe { _mm512_set1_ps(value) })
        }
        #[inline(always)]
        unsafe fn add_product(self, a: Self, b: Self) -> Self {
            Self(unsafe { _mm512_fmadd_ps(a.0, b.0, self.0) })
        }
        #[inline(always)]
        unsafe fn store(self, at: *mut f32, count: usize) {
            unsafe {
                if count == LANES {
                    _mm512_storeu_ps(at, self.0);
                } else {
                    let mask = ((1u32 << count) - 1) as __mmask16;
                    _mm512_mask_storeu_ps(at, mask, self.0);
                }
            }
        }
    }

    /// bf16 pairs of channels: a broadcast pair times a row of weight pairs, by
    /// `vdpbf16ps` (both products added to the f32 sums; callers enable AVX512-BF16).
    impl TapProducts<f32, Bf16Pair> for Zmm {
        #[inline(always)]
        unsafe fn add_tap<const P: usize>(
            sums: &mut [Self; P],
            sources: &[*const Bf16Pair; P],
            weights: *const Bf16Pair,
            (units, lanes): (usize, usize),
        ) {
            for pair in 0..units {
                unsafe {
                    let w: __m512bh = std::mem::transmute(_mm512_loadu_si512(
                        weights.add(pair * lanes) as *const __m512i,
                    ));
                    for (sum, source) in sums.iter_mut().zip(sources) {
                        // Pairs of a `u16` buffer: aligned to 2 bytes only.
                        let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(
                            source.add(pair).read_unaligned() as i32,
                        ));
                        sum.0 = _mm512_dpbf16_ps(sum.0, x, w);
                    }
                }
            }
        }
    }

    /// Two AVX2 registers.
    #[derive(Clone, Copy)]
    pub(super) struct Ymm2([__m256; 2]);

    impl Lanes<f32> for Ymm2 {
        #[inline(always)]
        unsafe fn load(at: *const f32) -> Self {
            unsafe { Self([_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]) }
        }
        #[inline(always)]
        unsafe fn splat(value: f32) -> Self {
            let lane = unsafe { _mm256_set1_ps(value) };
            Self([lane, lane])
        }
        #[inline(always)]
        unsafe fn add_product(self, a: Self, b: Self) -> Self {
            unsafe {
                Self([
                    _mm256_fmadd_ps(a.0[0], b.0[0], self.0[0]),
                    _mm256_fmadd_ps(a.0[1], b.0[1], self.0[1]),
                ])
            }
        }
        #[inline(always)]
        unsafe fn store(self, at: *mut f32, count: usize) {
            let mut lanes = [0f32; LANES];
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), self.0[0]);
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), self.0[1]);
                std::slice::from_raw_parts_mut(at, count).copy_from_slice(&lanes[..count]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `GradPlan::block` against the definition, `sum over r of g[r, o] x[taps[r, t],
    /// c]`, for channel counts below, at and above a register block's (up to 8 take
    /// several taps at once), 0, 1 and odd pixel counts, taps outside the image (-1).
    fn check<T: Scalar + Into<f64>>(tolerance: f64) {
        for channels in [1usize, 2, 3, 5, 7, 8, 9, 16, 17] {
            for pixels in [0usize, 1, 2, 37] {
                let (per_window, width) = (9usize, 20usize);
                let lanes = width.div_ceil(LANES) * LANES;
                let inputs = pixels + 3;
                let x: Vec<T> = (0..inputs * channels)
                    .map(|i| T::from_f64(((i * 7) % 13) as f64 * 0.25 - 1.5))
                    .collect();
                let mut g = vec![T::ZERO; pixels * lanes];
                for r in 0..pixels {
                    for o in 0..width {
                        g[r * lanes + o] = T::from_f64(((r * 5 + o * 3) % 11) as f64 * 0.5 - 2.0);
                    }
                }
                let taps: Vec<i64> = (0..pixels * per_window)
                    .map(|i| {
                        if i % 4 == 1 {
                            -1
                        } else {
                            ((i * 3) % inputs) as i64
                        }
                    })
                    .collect();
                let plan = GradPlan {
                    x: x.as_ptr(),
                    g: &g,
                    per_window,
                    channels,
                    lanes,
                };
                // From pixel 0, and from pixel 1 with the taps from its row on.
                for from in [0, 1].into_iter().filter(|&from| from <= pixels) {
                    let mut partial = vec![T::from_f64(9.0); per_window * channels * lanes];
                    plan.block((from, pixels), &taps[from * per_window..], &mut partial);
                    for t in 0..per_window {
                        for c in 0..channels {
                            for o in 0..width {
                                let expected: f64 = (from..pixels)
                                    .filter(|&r| taps[r * per_window + t] >= 0)
                                    .map(|r| {
                                        let source = taps[r * per_window + t] as usize;
                                        g[r * lanes + o].into() * x[source * channels + c].into()
                                    })
                                    .sum();
                                let got: f64 = partial[(t * channels + c) * lanes + o].into();
                                assert!(
                                    (got - expected).abs() <= tolerance * (1.0 + expected.abs()),
                                    "channels {channels}, pixels {from}..{pixels}, tap {t}, \
                                     channel {c}, output {o}: {got} against {expected}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn weight_gradient_blocks_are_the_definition() {
        check::<f32>(1e-5);
        check::<f64>(1e-12);
    }
}
