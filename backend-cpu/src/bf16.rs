//! Mixed-precision products (`nestor_passes::Products::Bf16`): f32 operands rounded to
//! bf16 (to nearest even, as libtorch's `.to(torch.bfloat16)`) and multiplied with f32
//! sums. On a host with AMX tiles (Sapphire Rapids and later) the roundings are
//! multiplied on them by nestor's own product (`crate::amx::product`: its right operand
//! packed once, rows handed to the caller as they are done, 0.8-1.3x the time of MKL's
//! for the encoder's shapes on one core); else on a host with AVX512-BF16 (Cooper Lake,
//! AMD Zen 4 and Zen 5) by the same product with `vdpbf16ps` in registers
//! (`crate::dot`); else where the process has MKL's `cblas_gemm_bf16bf16f32` (libtorch
//! exports it) and a probe at the first use finds it faster than the f32 GEMM, there;
//! elsewhere the same roundings, held as f32, go to the f32 GEMM. A product of two bf16
//! values is exact in f32, so every path computes the same sums, up to their order.
//!
//! `NESTOR_AMX=off` skips the tiles; `NESTOR_BF16` picks a path: `dot` (no tiles),
//! `mkl` (MKL's, without the probe, where the process has it), `f32` (the last path).
//!
//! Each operand is rounded into a buffer of the calling thread (kept between calls),
//! in the layout it had, so a transposed weight stays a transposed read; an operand
//! that many products read (a GEMM's weight in every row chunk, attention's queries,
//! keys and values in every tile) is rounded once, whole, into a [`RoundedBuffer`],
//! which a run keeps for its later steps (`crate::kept`).

use std::cell::RefCell;
use std::sync::OnceLock;
use std::time::Instant;

use crate::amx::{Left, Panel, Right, TapRows, Units};
use crate::blas::{on_one_thread, Gemm, SetThreadsFn};
use crate::parallel::SendPointer;
use crate::spare::Spare;
use crate::strided::{Strided, StridedMut};

/// How this process multiplies bf16 products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Path {
    /// nestor's own products on Intel AMX tiles (`crate::amx::product`), where the host
    /// has them and neither `NESTOR_AMX=off` nor another `NESTOR_BF16` is set.
    Amx,
    /// nestor's own products with AVX512-BF16's `vdpbf16ps` (`crate::dot`), where the
    /// host has it and no tiles (or `NESTOR_BF16=dot`).
    Dot,
    /// MKL's `cblas_gemm_bf16bf16f32`: the host's bf16 units.
    Mkl,
    /// The bf16 roundings as f32 on the f32 GEMM (no bf16 GEMM in the process, a slower
    /// one, or `NESTOR_BF16=f32`).
    F32,
}

impl Bf16Path {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Path::Amx => "AMX tiles (nestor's bf16 products)",
            Bf16Path::Dot => "AVX512-BF16 vdpbf16ps (nestor's bf16 products)",
            Bf16Path::Mkl => "MKL cblas_gemm_bf16bf16f32",
            Bf16Path::F32 => "bf16 roundings on the f32 GEMM",
        }
    }
}

/// `cblas_gemm_bf16bf16f32` (LP64): `c = alpha op(a) op(b) + beta c`, with `a` and `b`
/// bf16 (as `u16`) and `c` f32.
type Bf16GemmFn = unsafe extern "C" fn(
    layout: i32,
    transa: i32,
    transb: i32,
    m: i32,
    n: i32,
    k: i32,
    alpha: f32,
    a: *const u16,
    lda: i32,
    b: *const u16,
    ldb: i32,
    beta: f32,
    c: *mut f32,
    ldc: i32,
);

/// CBLAS's row-major layout and transpose flags.
const ROW_MAJOR: i32 = 101;
const NO_TRANS: i32 = 111;
const TRANS: i32 = 112;

/// MKL's bf16 GEMM, found in this process.
#[derive(Clone, Copy)]
struct MklBf16 {
    gemm: Bf16GemmFn,
    set_threads_local: SetThreadsFn,
}

/// The path chosen once per process (with MKL's functions when they were chosen).
enum Choice {
    /// nestor's own products (`crate::amx::product`) on these units.
    Own(Units),
    Mkl(MklBf16),
    F32,
}

impl Choice {
    /// What `NESTOR_BF16` is set to to ask for the path (the tiles need no setting:
    /// `amx` only names them in messages).
    fn setting(&self) -> &'static str {
        match self {
            Choice::Own(Units::Tiles) => "amx",
            Choice::Own(Units::Dot) => "dot",
            Choice::Mkl(_) => "mkl",
            Choice::F32 => "f32",
        }
    }

    /// Whether the path reads roundings as bf16 bits (else as f32).
    fn reads_bits(&self) -> bool {
        !matches!(self, Choice::F32)
    }
}

/// The path of this process's bf16 products, chosen at the first use: AMX tiles where
/// the host has them, else the fastest on a probe ([`fastest`]) of `vdpbf16ps` (where
/// the host has it), MKL's bf16 GEMM (where the process has it) and the f32 GEMM; or the
/// path `NESTOR_BF16` names (`f32`, `mkl`, `dot`), where the host and process have it.
fn choice() -> &'static Choice {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    CHOICE.get_or_init(|| {
        let asked = |path| crate::process::env_is("NESTOR_BF16", path);
        if asked("f32") {
            return Choice::F32;
        }
        if crate::amx::usable() {
            return Choice::Own(Units::Tiles);
        }
        let mut paths = paths_without_tiles();
        if let Some(named) = paths.iter().position(|path| asked(path.setting())) {
            return paths.swap_remove(named);
        }
        fastest(paths)
    })
}

/// The paths besides the tiles this host and process have: `vdpbf16ps` (AVX512-BF16),
/// MKL's bf16 GEMM (when the process has MKL), and the f32 GEMM, last.
fn paths_without_tiles() -> Vec<Choice> {
    let dot = crate::dot::host_has().then_some(Choice::Own(Units::Dot));
    // SAFETY: MKL's exported C functions, with these signatures.
    let mkl = unsafe {
        crate::process::function(b"cblas_gemm_bf16bf16f32\0").and_then(|gemm| {
            Some(Choice::Mkl(MklBf16 {
                gemm,
                set_threads_local: crate::process::function(b"MKL_Set_Num_Threads_Local\0")?,
            }))
        })
    };
    [dot, mkl, Some(Choice::F32)]
        .into_iter()
        .flatten()
        .collect()
}

/// The path this process's bf16 products take (the first call makes the choice).
pub fn bf16_path() -> Bf16Path {
    match choice() {
        Choice::Own(Units::Tiles) => Bf16Path::Amx,
        Choice::Own(Units::Dot) => Bf16Path::Dot,
        Choice::Mkl(_) => Bf16Path::Mkl,
        Choice::F32 => Bf16Path::F32,
    }
}

/// Whether this process's bf16 products are nestor's own (`crate::amx::product`, which
/// packs its right operand whole once per call).
pub(crate) fn own_products() -> bool {
    matches!(choice(), Choice::Own(_))
}

/// The side of the square product [`fastest`] times.
const PROBE_SIDE: usize = 256;

/// The path that multiplies one [`PROBE_SIDE`]^3 product fastest, operands
/// rounded as it goes (best of three runs each, after one untimed run): on hosts
/// without bf16 units MKL emulates them, more slowly, and on some Intel hosts
/// `vdpbf16ps` runs at half the rate of f32 FMAs (one every two cycles, measured on a
/// Sapphire Rapids VM), slower than the f32 GEMM.
fn fastest(paths: Vec<Choice>) -> Choice {
    let side = PROBE_SIDE;
    let values: Vec<f32> = (0..side * side)
        .map(|i| 1.0 + (i % 7) as f32 / 8.0)
        .collect();
    let mut c = vec![0f32; side * side];
    let stride = side as isize;
    let mut timed: Vec<(Choice, f64)> = paths
        .into_iter()
        .map(|path| (path, f64::INFINITY))
        .collect();
    for counted in [false, true, true, true] {
        for (path, best) in &mut timed {
            let started = Instant::now();
            let matrix = ((values.as_ptr(), stride, 1), None);
            // SAFETY: every buffer holds side x side values, row-major; the paths are
            // the host's and the process's.
            unsafe {
                let c = ((c.as_mut_ptr(), stride, 1), false);
                product_on(
                    path,
                    ((side, side, side), 1.0),
                    matrix,
                    matrix,
                    c,
                    &|_, _| {},
                );
            }
            if counted {
                *best = best.min(started.elapsed().as_secs_f64());
            }
        }
    }
    timed
        .into_iter()
        .min_by(|(_, x), (_, y)| x.total_cmp(y))
        .map_or(Choice::F32, |(path, _)| path)
}

/// An operand: a matrix of f32 values, and the buffer that already holds its roundings
/// (if one does; else it is rounded for this product).
pub(crate) type Operand<'a> = (Strided<f32>, Option<&'a RoundedBuffer>);

/// `c = scale a b` (`c += scale a b` when `add`) for `a [m x k]`, `b [k x n]`,
/// `c [m x n]` (pointer, row stride, column stride) with `a` and `b` rounded to bf16:
/// each rounded for this product, or read from the [`RoundedBuffer`] it lies in.
/// `finished` gets `c`'s rows as they are done (`crate::blas::Gemm::product_finishing`).
///
/// # Safety
/// The pointers must be valid for the sizes and strides given; with `add`, `c` must
/// hold `m x n` values; a rounded operand's matrix must lie within its buffer.
pub(crate) unsafe fn product(
    shape: ((usize, usize, usize), f32),
    a: Operand<'_>,
    b: Operand<'_>,
    c: (StridedMut<f32>, bool),
    finished: crate::blas::Finished<'_>,
) {
    // SAFETY: as the caller vouches; the path is the process's.
    unsafe { product_on(choice(), shape, a, b, c, finished) }
}

/// A right operand packed once for the products of many left operands by it
/// ([`PackedRight::product`]; a convolution's weight, which every tile of pixels
/// multiplies), on the process's own units.
pub(crate) struct PackedRight {
    panel: Panel,
    units: Units,
}

impl PackedRight {
    /// The tap rows `rows` of `weight` packed ([`Panel::pack_tap_rows`], by `threads` of
    /// the team), when the process's bf16 products are its own (`None` on the other
    /// paths, which pack nothing).
    ///
    /// # Safety
    /// As [`Panel::pack_tap_rows`].
    pub(crate) unsafe fn of_tap_rows(
        weight: *const f32,
        rows: TapRows,
        threads: usize,
    ) -> Option<Self> {
        // SAFETY: as the caller vouches.
        Self::packed_by(|panel| unsafe { panel.pack_tap_rows(weight, rows, threads) })
    }

    /// A panel `fill` packs, when the process's bf16 products are its own (`None` on
    /// the other paths, and `fill` is not called): the panel this thread packed last,
    /// its pages mapped (a new one had a 512-channel 3x3 weight's 4.7 MB faulted in and
    /// zeroed on every step).
    pub(crate) fn packed_by(fill: impl FnOnce(&mut Panel)) -> Option<Self> {
        let Choice::Own(units) = *choice() else {
            return None;
        };
        let mut panel = SPARE_PANEL.take().unwrap_or_default();
        fill(&mut panel);
        Some(Self { panel, units })
    }

    /// The columns of a convolution's weight gradient packed straight from the
    /// roundings of its input ([`Panel::pack_tap_pixels`]), when the process's bf16
    /// products are its own and the host has AVX-512F (`None` otherwise: nothing
    /// packed).
    ///
    /// # Safety
    /// As [`Panel::pack_tap_pixels`].
    pub(crate) unsafe fn of_tap_pixels(
        x: *const u16,
        taps: (&[i64], usize, std::ops::Range<usize>),
        (channels, count): (usize, usize),
    ) -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: as the caller vouches; the host has AVX-512F.
            return Self::packed_by(|panel| unsafe {
                panel.pack_tap_pixels(x, taps, (channels, count))
            });
        }
        let _ = (x, taps, channels, count);
        None
    }

    /// [`product`] by this operand (`shape`'s `k` and `n` its own).
    ///
    /// # Safety
    /// As [`product`] for `a` and `c`; `c` with unit column stride.
    pub(crate) unsafe fn product(
        &self,
        (shape, scale): ((usize, usize, usize), f32),
        a: Left<'_>,
        c: (StridedMut<f32>, bool),
    ) {
        let b = Right::Packed(&self.panel);
        // SAFETY: as the caller vouches; the panel holds `k x n`.
        unsafe { crate::amx::product(self.units, shape, scale, (a, b), c, &|_, _| {}) }
    }
}

impl Drop for PackedRight {
    fn drop(&mut self) {
        SPARE_PANEL.set(Some(std::mem::take(&mut self.panel)));
    }
}

thread_local! {
    /// The panel of this thread's last [`PackedRight`], for its next one.
    static SPARE_PANEL: RefCell<Option<Panel>> = const { RefCell::new(None) };
}

/// [`product`] on the path `path`.
///
/// # Safety
/// As [`product`]; the host and process must have the path.
unsafe fn product_on(
    path: &Choice,
    (shape, scale): ((usize, usize, usize), f32),
    (a, a_rounded): Operand<'_>,
    (b, b_rounded): Operand<'_>,
    (c, add): (StridedMut<f32>, bool),
    finished: crate::blas::Finished<'_>,
) {
    let (m, k, n) = shape;
    match *path {
        // The tiles and MKL write `c` with unit column stride, as every caller's output
        // has.
        Choice::Own(units) if c.2 == 1 => {
            let (a, b) = (Left::Values((a, a_rounded)), Right::Values((b, b_rounded)));
            // SAFETY: the caller vouches for the operands and that the host has the units.
            unsafe { crate::amx::product(units, shape, scale, (a, b), (c, add), finished) };
            return;
        }
        Choice::Mkl(mkl) if c.2 == 1 && m * n > 0 && k > 0 => {
            BF16.with_borrow_mut(|[a_bf16, b_bf16]| {
                // SAFETY: the caller vouches for the operands; the roundings hold them.
                unsafe {
                    let a = a_rounded
                        .and_then(|buffer| buffer.bf16_view(a))
                        .unwrap_or_else(|| rounded(a, (m, k), a_bf16));
                    let b = b_rounded
                        .and_then(|buffer| buffer.bf16_view(b))
                        .unwrap_or_else(|| rounded(b, (k, n), b_bf16));
                    mkl_product(mkl, shape, scale, a, b, c, add)
                }
            })
        }
        _ => F32.with_borrow_mut(|[a_f32, b_f32]| {
            // SAFETY: as above.
            unsafe {
                let a = a_rounded
                    .and_then(|buffer| buffer.f32_view(a))
                    .unwrap_or_else(|| rounded(a, (m, k), a_f32));
                let b = b_rounded
                    .and_then(|buffer| buffer.f32_view(b))
                    .unwrap_or_else(|| rounded(b, (k, n), b_f32));
                f32::product(shape, scale, a, b, c, add)
            }
        }),
    }
    finished(0, m);
}

/// The bf16 roundings of a whole f32 buffer, value for value (in the type the process's
/// path reads), made once for the many products that read parts of it: a matrix of
/// the buffer is the same matrix of the roundings.
pub(crate) struct RoundedBuffer {
    /// The f32 buffer's first value.
    base: *const f32,
    /// Its length in values.
    len: usize,
    /// The roundings, from index `start` of the vector (a cache line: `crate::aligned`).
    values: Roundings,
    start: usize,
}

/// A buffer's roundings as MKL's bf16 GEMM reads them, or as f32.
enum Roundings {
    Bf16(Vec<u16>),
    F32(Vec<f32>),
}

// SAFETY: `base` is only compared and offset, never read through, after the roundings
// were made; the roundings are owned.
unsafe impl Send for RoundedBuffer {}
unsafe impl Sync for RoundedBuffer {}

impl RoundedBuffer {
    /// Values per task when the team rounds a buffer.
    const CHUNK: usize = 1 << 16;

    /// Rounds the `len` values at `base`, split across `threads` of the team.
    ///
    /// # Safety
    /// `base` must be valid for `len` values.
    pub(crate) unsafe fn new(base: *const f32, len: usize, threads: usize) -> Self {
        // SAFETY: the caller vouches for the values.
        unsafe { Self::of_values(base, len, threads, choice().reads_bits()) }
    }

    /// [`RoundedBuffer::new`] as bf16 bits whatever the process's path (for tests of
    /// the products that read them).
    ///
    /// # Safety
    /// As [`RoundedBuffer::new`].
    #[cfg(test)]
    pub(crate) unsafe fn as_bf16(base: *const f32, len: usize) -> Self {
        // SAFETY: the caller vouches for the values.
        unsafe { Self::of_values(base, len, 1, true) }
    }

    /// The roundings as bf16 bits (`as_bits`) or held as f32.
    ///
    /// # Safety
    /// As [`RoundedBuffer::new`].
    unsafe fn of_values(base: *const f32, len: usize, threads: usize, as_bits: bool) -> Self {
        // SAFETY: the caller vouches for the values.
        let source = unsafe { std::slice::from_raw_parts(base, len) };
        let (values, start) = if as_bits {
            let (values, start) = round_all(source, threads);
            (Roundings::Bf16(values), start)
        } else {
            let (values, start) = round_all(source, threads);
            (Roundings::F32(values), start)
        };
        Self {
            base,
            len,
            values,
            start,
        }
    }

    /// The address range of the f32 values it rounds.
    pub(crate) fn range(&self) -> std::ops::Range<usize> {
        values_range(self.base, self.len)
    }

    /// Whether it holds bf16 bits (MKL's path), not roundings held as f32.
    pub(crate) fn is_bf16(&self) -> bool {
        matches!(self.values, Roundings::Bf16(_))
    }

    /// The bytes the roundings take.
    pub(crate) fn bytes(&self) -> usize {
        match &self.values {
            Roundings::Bf16(values) => values.len() * 2,
            Roundings::F32(values) => values.len() * 4,
        }
    }

    /// Where `matrix` starts in the buffer, as an index of the roundings' vector, if it
    /// does.
    fn offset_of(&self, (pointer, _, _): Strided<f32>) -> Option<usize> {
        let offset = (pointer as usize).checked_sub(self.base as usize)? / 4;
        (offset < self.len.max(1)).then_some(self.start + offset)
    }

    /// `matrix` (within the buffer) as the same matrix of bf16 roundings.
    pub(crate) fn bf16_view(&self, matrix: Strided<f32>) -> Option<Strided<u16>> {
        let (Roundings::Bf16(values), Some(offset)) = (&self.values, self.offset_of(matrix)) else {
            return None;
        };
        // MKL takes a unit stride in one of the two dims.
        (matrix.1 == 1 || matrix.2 == 1).then(|| (values[offset..].as_ptr(), matrix.1, matrix.2))
    }

    /// The rounding of the value at `matrix`'s start (within the buffer), as f32.
    #[cfg(test)]
    pub(crate) fn value_of(&self, matrix: Strided<f32>) -> f32 {
        let offset = self.offset_of(matrix).unwrap_or(0);
        match &self.values {
            Roundings::Bf16(values) => f32::from_bits(u32::from(values[offset]) << 16),
            Roundings::F32(values) => values[offset],
        }
    }

    /// `matrix` (within the buffer) as the same matrix of roundings held as f32.
    pub(crate) fn f32_view(&self, matrix: Strided<f32>) -> Option<Strided<f32>> {
        let (Roundings::F32(values), Some(offset)) = (&self.values, self.offset_of(matrix)) else {
            return None;
        };
        Some((values[offset..].as_ptr(), matrix.1, matrix.2))
    }
}

/// The address range of the `len` f32 values at `base`.
pub(crate) fn values_range(base: *const f32, len: usize) -> std::ops::Range<usize> {
    let start = base as usize;
    start..start.saturating_add(len.saturating_mul(4))
}

/// A [`RoundedBuffer`] filled part by part by the step that writes its values: each
/// chunk of the step's output is rounded right after the chunk is written, while it is
/// in the core's cache, instead of in a pass of its own when a later product reads it.
pub(crate) struct Producing {
    buffer: RoundedBuffer,
    /// Where the roundings go (the buffer's vector, which moving `buffer` does not move).
    target: Target,
}

/// The first rounding of a [`Producing`] buffer, in the type the process's path reads.
enum Target {
    Bf16(*mut u16),
    F32(*mut f32),
}

// SAFETY: chunks write disjoint ranges of the roundings (`Producing::round`'s contract)
// through `target`, which points into the owned vector.
unsafe impl Send for Producing {}
unsafe impl Sync for Producing {}

impl Producing {
    /// Roundings for the `len` values at `base`, none made yet.
    pub(crate) fn new(base: *const f32, len: usize) -> Self {
        let (values, start, target) = if choice().reads_bits() {
            let (mut values, start) = crate::spare::take::<u16>(len);
            let target = Target::Bf16(values[start..].as_mut_ptr());
            (Roundings::Bf16(values), start, target)
        } else {
            let (mut values, start) = crate::spare::take::<f32>(len);
            let target = Target::F32(values[start..].as_mut_ptr());
            (Roundings::F32(values), start, target)
        };
        Self {
            buffer: RoundedBuffer {
                base,
                len,
                values,
                start,
            },
            target,
        }
    }

    /// Rounds the values `range` (in values from `base`), which the step has written.
    ///
    /// # Safety
    /// `range` must lie within the buffer's `len` values, which must be valid to read, and
    /// no other thread may round an overlapping range at the same time.
    pub(crate) unsafe fn round(&self, range: std::ops::Range<usize>) {
        let count = range.end.saturating_sub(range.start);
        // SAFETY: the caller vouches for the range and for the values.
        unsafe {
            let values = std::slice::from_raw_parts(self.buffer.base.add(range.start), count);
            match self.target {
                Target::Bf16(out) => round_line(
                    values,
                    std::slice::from_raw_parts_mut(out.add(range.start), count),
                ),
                Target::F32(out) => round_line(
                    values,
                    std::slice::from_raw_parts_mut(out.add(range.start), count),
                ),
            }
        }
    }

    /// The roundings, once every value has been rounded.
    pub(crate) fn finish(self) -> RoundedBuffer {
        self.buffer
    }
}

impl Drop for RoundedBuffer {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.values, Roundings::F32(Vec::new())) {
            Roundings::Bf16(values) => crate::spare::give_back(values),
            Roundings::F32(values) => crate::spare::give_back(values),
        }
    }
}

/// The roundings of `values`, in chunks across `threads` of the team (`values.len()` of
/// the vector from the index returned).
fn round_all<E: Rounding + Spare>(values: &[f32], threads: usize) -> (Vec<E>, usize) {
    let (mut out, first) = crate::spare::take::<E>(values.len());
    let chunks = values.len().div_ceil(RoundedBuffer::CHUNK);
    let target = SendPointer(out[first..].as_mut_ptr());
    crate::team::for_each_chunk(chunks, threads, &|chunk| {
        let start = chunk * RoundedBuffer::CHUNK;
        let end = (start + RoundedBuffer::CHUNK).min(values.len());
        // SAFETY: each chunk writes its own range of `out`, which holds every value.
        let out = unsafe { std::slice::from_raw_parts_mut(target.get().add(start), end - start) };
        round_line(&values[start..end], out);
    });
    (out, first)
}

/// `then` of the bf16 roundings of `values` (rounded across `threads` of the team) as
/// `u16` bits, or held as f32 (`E`): a vector of the pool, given back after.
pub(crate) fn with_roundings<E: Rounding + Spare, R>(
    values: &[f32],
    threads: usize,
    then: impl FnOnce(&[E]) -> R,
) -> R {
    let (rounded, start) = round_all::<E>(values, threads);
    let result = then(&rounded[start..start + values.len()]);
    crate::spare::give_back(rounded);
    result
}

thread_local! {
    /// The calling thread's roundings of two operands.
    static BF16: RefCell<[Vec<u16>; 2]> = const { RefCell::new([Vec::new(), Vec::new()]) };
    /// The same, held as f32.
    static F32: RefCell<[Vec<f32>; 2]> = const { RefCell::new([Vec::new(), Vec::new()]) };
}

/// `c = scale a b` (or `+=`) on MKL's bf16 GEMM, on this thread alone. `a` and `b`
/// must have a unit stride (as [`rounded`] leaves them), `c` a unit column stride.
///
/// # Safety
/// The pointers must be valid for the sizes and strides given.
unsafe fn mkl_product(
    mkl: MklBf16,
    (m, k, n): (usize, usize, usize),
    scale: f32,
    a: Strided<u16>,
    b: Strided<u16>,
    c: StridedMut<f32>,
    add: bool,
) {
    // Row-major: an operand `height x width` with unit column stride is read as it is,
    // one with unit row stride as the transpose of its column-major storage. A dim of
    // one has both strides 1 whatever the layout: a single row is read as it is, and
    // the leading dimension is never below what the layout needs (a `[n, 1]` weight
    // read as a `1 x n` row once had a leading dimension of 1, which MKL refuses,
    // leaving the output unwritten).
    let operand = |(_, rows, columns): Strided<u16>, (height, width): (usize, usize)| {
        let (height, width) = (
            isize::try_from(height).unwrap_or(isize::MAX),
            isize::try_from(width).unwrap_or(isize::MAX),
        );
        if columns == 1 && (rows >= width || height <= 1) {
            (NO_TRANS, rows.max(width).max(1) as i32)
        } else {
            (TRANS, columns.max(height).max(1) as i32)
        }
    };
    let ((trans_a, lda), (trans_b, ldb)) = (operand(a, (m, k)), operand(b, (k, n)));
    let beta = if add { 1.0 } else { 0.0 };
    unsafe {
        on_one_thread(mkl.set_threads_local, || {
            (mkl.gemm)(
                ROW_MAJOR,
                trans_a,
                trans_b,
                m as i32,
                n as i32,
                k as i32,
                scale,
                a.0,
                lda,
                b.0,
                ldb,
                beta,
                c.0,
                c.1.max(1) as i32,
            )
        })
    }
}

/// A value as the bf16 rounding of an f32, in the type a product path reads.
pub(crate) trait Rounding: Copy + Default {
    fn of(value: f32) -> Self;
}

impl Rounding for u16 {
    #[inline(always)]
    fn of(value: f32) -> Self {
        round(value)
    }
}

impl Rounding for f32 {
    #[inline(always)]
    fn of(value: f32) -> Self {
        f32::from_bits(u32::from(round(value)) << 16)
    }
}

/// The bf16 bits of `value` rounded to nearest even (NaN stays a quiet NaN, overflow
/// rounds to infinity), as libtorch rounds.
#[inline(always)]
pub(crate) fn round(value: f32) -> u16 {
    let bits = value.to_bits();
    // Only a NaN's bits (at least 0xff80_0001) can pass 2^32 here, and its sum is not
    // used: wrapping keeps debug builds from stopping on it.
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    if value.is_nan() {
        ((bits >> 16) | 0x40) as u16
    } else {
        rounded as u16
    }
}

/// The `[rows x columns]` matrix `matrix` rounded into `into` (grown as needed), in its
/// layout: rows contiguous if its columns were (or if neither were), else columns
/// contiguous. Returns the rounding as a matrix.
///
/// # Safety
/// `matrix` must be valid for its sizes and strides.
unsafe fn rounded<E: Rounding>(
    (values, row_stride, column_stride): Strided<f32>,
    (rows, columns): (usize, usize),
    into: &mut Vec<E>,
) -> Strided<E> {
    let count = rows * columns;
    if into.len() < count {
        into.resize(count, E::default());
    }
    let by_columns = column_stride != 1 && row_stride == 1;
    // Lines of the layout kept: (count, length, stride between lines, between values).
    let (lines, length, line_stride, step) = if by_columns {
        (columns, rows, column_stride, 1)
    } else {
        (rows, columns, row_stride, column_stride)
    };
    for line in 0..lines {
        let out = &mut into[line * length..(line + 1) * length];
        // SAFETY: the caller vouches for the matrix's values.
        unsafe {
            let start = values.offset(line as isize * line_stride);
            if step == 1 {
                round_line(std::slice::from_raw_parts(start, length), out);
            } else {
                for (index, out) in out.iter_mut().enumerate() {
                    *out = E::of(*start.offset(index as isize * step));
                }
            }
        }
    }
    let pointer = into.as_ptr();
    if by_columns {
        (pointer, 1, rows as isize)
    } else {
        (pointer, columns as isize, 1)
    }
}

/// `out[i] = round(values[i])`, in the widest vectors the host has.
pub(crate) fn round_line<E: Rounding>(values: &[f32], out: &mut [E]) {
    crate::vectors::widest(
        #[inline(always)]
        || {
            for (out, &value) in out.iter_mut().zip(values) {
                *out = E::of(value);
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `half`'s rounding, the reference (libtorch's too).
    fn reference(value: f32) -> u16 {
        half::bf16::from_f32(value).to_bits()
    }

    #[test]
    fn rounding_is_to_nearest_even_with_nan_and_overflow() {
        for value in [
            0.0f32,
            -0.0,
            1.0,
            1.0 + 1.0 / 256.0, // a tie: stays at the even 1.0
            1.0 + 3.0 / 256.0, // a tie: up to the even neighbour
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE / 3.0,
            1e-40,
        ] {
            assert_eq!(round(value), reference(value), "{value:e}");
        }
        assert!(half::bf16::from_bits(round(f32::NAN)).is_nan());
        assert!(half::bf16::from_bits(round(-f32::NAN)).is_nan());
        // A NaN whose bits would pass 2^32 with the rounding's increment.
        assert!(half::bf16::from_bits(round(f32::from_bits(0xffff_ffff))).is_nan());
    }

    proptest! {
        #[test]
        fn rounding_equals_half_on_any_bits(bits in any::<u32>()) {
            let value = f32::from_bits(bits);
            prop_assume!(!value.is_nan());
            prop_assert_eq!(round(value), reference(value));
        }

        /// Every path of the host and process equals an f64 product of the roundings,
        /// for every layout of the operands and sizes that fill no tile.
        #[test]
        fn products_of_roundings_equal_the_f64_reference(
            (m, k, n) in (1usize..40, 1usize..70, 1usize..40),
            a_by_columns in any::<bool>(),
            b_by_columns in any::<bool>(),
            add in any::<bool>(),
            seed in 0u32..1000,
        ) {
            check_product((m, k, n), (a_by_columns, b_by_columns), add, seed)?;
        }
    }

    /// Every size of 1 (a single row, column or inner value: both strides of such an
    /// operand are 1) in every layout: a `[n, 1]` weight once reached MKL with a
    /// leading dimension of 1, which it refused, leaving the output unwritten.
    #[test]
    fn products_with_dims_of_one_equal_the_f64_reference() {
        for (m, k, n) in [
            (1, 1, 1),
            (3, 1, 4),
            (1, 5, 1),
            (4, 3, 1),
            (1, 3, 4),
            (5, 1, 1),
            (1, 1, 6),
        ] {
            for layout in [(false, false), (false, true), (true, false), (true, true)] {
                for add in [false, true] {
                    check_product((m, k, n), layout, add, 7).unwrap();
                }
            }
        }
    }

    /// Every path and pre-rounded operands against an f64 product of the roundings.
    fn check_product(
        (m, k, n): (usize, usize, usize),
        (a_by_columns, b_by_columns): (bool, bool),
        add: bool,
        seed: u32,
    ) -> Result<(), TestCaseError> {
        let values = |count: usize, salt: u32| -> Vec<f32> {
            (0..count)
                .map(|i| ((i as u32 * 31 + seed + salt) as f32 * 0.61).sin() * 3.0)
                .collect()
        };
        let (a, b, start) = (values(m * k, 1), values(k * n, 2), values(m * n, 3));
        // A matrix stored by rows or by columns.
        let stored = |values: &[f32], rows: usize, columns: usize, by_columns: bool| {
            if by_columns {
                let transposed: Vec<f32> = (0..rows * columns)
                    .map(|i| values[(i % rows) * columns + i / rows])
                    .collect();
                (transposed, 1isize, rows as isize)
            } else {
                (values.to_vec(), columns as isize, 1isize)
            }
        };
        let (a_stored, a_rows, a_columns) = stored(&a, m, k, a_by_columns);
        let (b_stored, b_rows, b_columns) = stored(&b, k, n, b_by_columns);
        let expected: Vec<f64> = (0..m * n)
            .map(|i| {
                let (row, column) = (i / n, i % n);
                let sum: f64 = (0..k)
                    .map(|j| {
                        f64::from(f32::of(a[row * k + j])) * f64::from(f32::of(b[j * n + column]))
                    })
                    .sum();
                0.5 * sum + if add { f64::from(start[i]) } else { 0.0 }
            })
            .collect();
        // Every path of the host and process, then the process's path on operands
        // rounded beforehand.
        let mut paths: Vec<Option<Choice>> = paths_without_tiles().into_iter().map(Some).collect();
        if crate::amx::usable() {
            paths.push(Some(Choice::Own(Units::Tiles)));
        }
        paths.push(None);
        for path in paths {
            let mut c = start.clone();
            let (a, b) = (
                (a_stored.as_ptr(), a_rows, a_columns),
                (b_stored.as_ptr(), b_rows, b_columns),
            );
            // SAFETY: the operands hold their values in the strides given.
            unsafe {
                if path.is_none() {
                    // Both operands' roundings made once, whole, by two threads.
                    let a_buffer = RoundedBuffer::new(a_stored.as_ptr(), a_stored.len(), 2);
                    let b_buffer = RoundedBuffer::new(b_stored.as_ptr(), b_stored.len(), 2);
                    let c = (c.as_mut_ptr(), n as isize, 1);
                    product(
                        ((m, k, n), 0.5),
                        (a, Some(&a_buffer)),
                        (b, Some(&b_buffer)),
                        (c, add),
                        &|_, _| {},
                    )
                } else if let Some(path) = &path {
                    product_on(
                        path,
                        ((m, k, n), 0.5),
                        (a, None),
                        (b, None),
                        ((c.as_mut_ptr(), n as isize, 1), add),
                        &|_, _| {},
                    )
                }
            }
            for (index, (&actual, &expected)) in c.iter().zip(&expected).enumerate() {
                // f32 sums of k exact products.
                let tolerance = 1e-6 * (k as f64) * (1.0 + expected.abs()) * 4.0;
                prop_assert!(
                    (f64::from(actual) - expected).abs() <= tolerance,
                    "{} value {index}: {actual} vs {expected}",
                    path.as_ref()
                        .map_or("the process's path, rounded before", Choice::setting),
                );
            }
        }
        Ok(())
    }

    #[test]
    fn empty_inner_size_writes_zeros_or_keeps_the_sum() {
        let (a, b) = ([0f32; 0], [0f32; 0]);
        for (start, add, expected) in [(f32::NAN, false, 0.0), (2.5, true, 2.5)] {
            let mut c = vec![start; 6];
            let (a, b) = (((a.as_ptr(), 0, 1), None), ((b.as_ptr(), 3, 1), None));
            // SAFETY: k = 0 reads nothing; c holds 2 x 3 values.
            unsafe {
                product(
                    ((2, 0, 3), 1.0),
                    a,
                    b,
                    ((c.as_mut_ptr(), 3, 1), add),
                    &|_, _| {},
                )
            };
            assert_eq!(c, vec![expected; 6]);
        }
    }
}
