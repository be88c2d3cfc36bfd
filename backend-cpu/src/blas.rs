//! The host's BLAS, when the process already has one: Intel MKL, which libtorch links
//! in and exports (`sgemm_`, `dgemm_`, `MKL_Set_Num_Threads_Local`). nestor never loads
//! it: the symbols are looked up in the running process, and a process without MKL (the
//! GPU check, the runtime's own tests) multiplies with the `gemm` crate. Where both are
//! there, a probe at the first compile times one product with each and keeps the faster
//! (on an AMD Zen 5 with AVX-512, MKL's Zen kernels reached about 100 GFLOP/s on one core
//! and the `gemm` crate's AVX-512 ones 235: the encoder's GEMMs ran twice as fast; on the
//! Zen 3 and Xeon hosts of earlier reports MKL ran them level with libtorch). MKL runs
//! sequential on the calling thread: the executor splits rows across its team as for
//! every step, and an OpenMP team of MKL's own would spin on the cores the pool needs.
//! `NESTOR_BLAS=builtin` forces the `gemm` crate, `NESTOR_BLAS=mkl` MKL (when found).

use std::ffi::c_char;
use std::sync::OnceLock;
use std::time::Instant;

use nestor_passes::Products;

use std::sync::Arc;

use crate::bf16::RoundedBuffer;
use crate::scalar::Scalar;
use crate::strided::{Strided, StridedMut};

/// What a product calls with ranges of its output's rows as it finishes them
/// ([`Gemm::product_finishing`]).
pub(crate) type Finished<'a> = &'a dyn Fn(usize, usize);

/// The matrix products of a scalar type: on the process's MKL when it uses it, else the
/// `gemm` crate, and attention's small f32 tiles in registers where the host suits it
/// (`crate::microkernel`).
pub(crate) trait Gemm: Scalar + crate::spare::Spare {
    /// MKL's GEMM of this type.
    fn gemm_fn(mkl: &Mkl) -> GemmFn<Self>;

    /// `c = scale * a b` for `a [m x k]`, `b [k x n]` and `c [m x n]`, each given as
    /// (pointer, row stride, column stride); `c` is only written.
    ///
    /// # Safety
    /// The pointers must be valid for the sizes and strides given.
    unsafe fn matmul(
        shape: (usize, usize, usize),
        scale: Self,
        a: Strided<Self>,
        b: Strided<Self>,
        c: StridedMut<Self>,
    ) {
        unsafe { Self::product(shape, scale, a, b, c, false) }
    }

    /// [`Gemm::matmul`], or `c += scale * a b` when `add` (`c` read first: a GEMM's
    /// bias written before the product, as libtorch's `addmm` does, saves a pass).
    ///
    /// # Safety
    /// As [`Gemm::matmul`]; with `add`, `c` must hold `m x n` values.
    unsafe fn product(
        shape: (usize, usize, usize),
        scale: Self,
        a: Strided<Self>,
        b: Strided<Self>,
        c: StridedMut<Self>,
        add: bool,
    ) {
        // The process's MKL on this thread when it uses it (and it takes these strides).
        unsafe {
            if !matmul(shape, scale, a, b, c, add) {
                builtin_matmul(shape, scale, a, b, c, add);
            }
        }
    }

    /// The roundings of the `len` values at `buffer` that products of `products` read
    /// many times, made once by `threads` of the team or kept by the run from an earlier
    /// step (`crate::kept`; `None`: they read the values as they are; f64 always).
    ///
    /// # Safety
    /// `buffer` must be valid for `len` values.
    unsafe fn rounded_buffer(
        products: Products,
        buffer: *const Self,
        len: usize,
        threads: usize,
    ) -> Option<Arc<RoundedBuffer>> {
        let _ = (products, buffer, len, threads);
        None
    }

    /// The roundings of the `len` values at `buffer`, made now by `threads` of the team
    /// and kept by no run: for a buffer a step makes for itself (a weight laid out for
    /// its products), whose memory may hold other values later in the run. `None` as
    /// for [`Gemm::rounded_buffer`].
    ///
    /// # Safety
    /// `buffer` must be valid for `len` values.
    unsafe fn rounded_here(
        products: Products,
        buffer: *const Self,
        len: usize,
        threads: usize,
    ) -> Option<RoundedBuffer> {
        let _ = (products, buffer, len, threads);
        None
    }

    /// Roundings of the `len` values at `buffer` for the step that writes them to fill
    /// as it goes (`crate::bf16::Producing`), when products of `products` read them
    /// rounded (`None` for other products; f64 always).
    fn producing(
        products: Products,
        buffer: *const Self,
        len: usize,
    ) -> Option<crate::bf16::Producing> {
        let _ = (products, buffer, len);
        None
    }

    /// [`Gemm::product`] in `products`: with [`Products::Bf16`], f32 operands are
    /// multiplied as their bf16 roundings (`crate::bf16`), each made for this product or
    /// read from the [`Gemm::rounded_buffer`] the operand lies in, if any; f64
    /// multiplies as it is.
    ///
    /// # Safety
    /// As [`Gemm::product`]; a rounded operand must lie within its buffer.
    unsafe fn product_rounded(
        products: Products,
        (shape, scale): ((usize, usize, usize), Self),
        (a, b): (Rounded<'_, Self>, Rounded<'_, Self>),
        (c, add): (StridedMut<Self>, bool),
    ) {
        let _ = products;
        unsafe { Self::product(shape, scale, a.0, b.0, c, add) }
    }

    /// [`Gemm::product_rounded`] that hands `c`'s rows to `finished` as they are done
    /// (ranges of rows, in order), so that what follows the product on them (a GEMM's
    /// epilogue, the roundings of its output) reads them from the core's cache: a block
    /// of rows at a time on AMX tiles, else all rows once the product is done.
    ///
    /// # Safety
    /// As [`Gemm::product_rounded`].
    unsafe fn product_finishing(
        products: Products,
        (shape, scale): ((usize, usize, usize), Self),
        (a, b): (Rounded<'_, Self>, Rounded<'_, Self>),
        (c, add): (StridedMut<Self>, bool),
        finished: Finished<'_>,
    ) {
        unsafe { Self::product_rounded(products, (shape, scale), (a, b), (c, add)) };
        finished(0, shape.0);
    }

    /// [`Gemm::tile_matmul`] of `products` (as [`Gemm::product_rounded`]).
    ///
    /// # Safety
    /// As [`Gemm::product_rounded`].
    unsafe fn tile_product(
        products: Products,
        (shape, scale): ((usize, usize, usize), Self),
        a: Rounded<'_, Self>,
        b: Rounded<'_, Self>,
        c: StridedMut<Self>,
    ) {
        unsafe {
            match products {
                Products::Float => Self::tile_matmul(shape, scale, a.0, b.0, c),
                Products::Bf16 => {
                    Self::product_rounded(products, (shape, scale), (a, b), (c, false))
                }
            }
        }
    }

    /// [`Gemm::matmul`] for attention's small tiles: f32 on AVX2 hosts without AVX-512
    /// multiplies in registers (`crate::microkernel`), everything else as `matmul`.
    ///
    /// # Safety
    /// As [`Gemm::matmul`].
    unsafe fn tile_matmul(
        shape: (usize, usize, usize),
        scale: Self,
        a: Strided<Self>,
        b: Strided<Self>,
        c: StridedMut<Self>,
    ) {
        unsafe { Self::matmul(shape, scale, a, b, c) }
    }
}

impl Gemm for f32 {
    fn gemm_fn(mkl: &Mkl) -> GemmFn<Self> {
        mkl.sgemm
    }

    unsafe fn rounded_buffer(
        products: Products,
        buffer: *const Self,
        len: usize,
        threads: usize,
    ) -> Option<Arc<RoundedBuffer>> {
        // The caller vouches for the buffer.
        (products == Products::Bf16).then(|| unsafe { crate::kept::rounded(buffer, len, threads) })
    }

    unsafe fn rounded_here(
        products: Products,
        buffer: *const Self,
        len: usize,
        threads: usize,
    ) -> Option<RoundedBuffer> {
        // The caller vouches for the buffer.
        (products == Products::Bf16).then(|| unsafe { RoundedBuffer::new(buffer, len, threads) })
    }

    fn producing(
        products: Products,
        buffer: *const Self,
        len: usize,
    ) -> Option<crate::bf16::Producing> {
        (products == Products::Bf16).then(|| crate::bf16::Producing::new(buffer, len))
    }

    unsafe fn product_rounded(
        products: Products,
        (shape, scale): ((usize, usize, usize), Self),
        (a, b): (Rounded<'_, Self>, Rounded<'_, Self>),
        (c, add): (StridedMut<Self>, bool),
    ) {
        // The caller vouches for the operands (as for `product`).
        unsafe { Self::product_finishing(products, (shape, scale), (a, b), (c, add), &|_, _| {}) }
    }

    unsafe fn product_finishing(
        products: Products,
        (shape, scale): ((usize, usize, usize), Self),
        (a, b): (Rounded<'_, Self>, Rounded<'_, Self>),
        (c, add): (StridedMut<Self>, bool),
        finished: Finished<'_>,
    ) {
        // The caller vouches for the operands (as for `product`).
        unsafe {
            match products {
                Products::Float => {
                    Self::product(shape, scale, a.0, b.0, c, add);
                    finished(0, shape.0);
                }
                Products::Bf16 => crate::bf16::product((shape, scale), a, b, (c, add), finished),
            }
        }
    }

    unsafe fn tile_matmul(
        shape: (usize, usize, usize),
        scale: Self,
        a: Strided<Self>,
        b: Strided<Self>,
        c: StridedMut<Self>,
    ) {
        // The caller vouches for the pointers (as for `matmul`).
        unsafe {
            if !crate::microkernel::matmul(shape, scale, a, b, c) {
                Self::matmul(shape, scale, a, b, c)
            }
        }
    }
}

impl Gemm for f64 {
    fn gemm_fn(mkl: &Mkl) -> GemmFn<Self> {
        mkl.dgemm
    }
}

/// An operand of a product: its values, and the buffer of roundings it lies in (if
/// any, see [`Gemm::rounded_buffer`]).
pub(crate) type Rounded<'a, T> = (Strided<T>, Option<&'a RoundedBuffer>);

/// Fortran `?gemm_` (LP64): `c = alpha op(a) op(b) + beta c`, column-major, every
/// argument by pointer, then the hidden lengths of the two character arguments.
pub(crate) type GemmFn<T> = unsafe extern "C" fn(
    *const c_char,
    *const c_char,
    *const i32,
    *const i32,
    *const i32,
    *const T,
    *const T,
    *const i32,
    *const T,
    *const i32,
    *const T,
    *mut T,
    *const i32,
    usize,
    usize,
);

/// MKL's entry points, found in this process.
pub(crate) struct Mkl {
    pub(crate) sgemm: GemmFn<f32>,
    pub(crate) dgemm: GemmFn<f64>,
    set_threads_local: SetThreadsFn,
}

/// `MKL_Set_Num_Threads_Local`: this thread's MKL thread count (0: back to the global
/// one); returns the previous one.
pub(crate) type SetThreadsFn = unsafe extern "C" fn(i32) -> i32;

/// Runs `call` (an MKL call) with MKL on this thread alone: the executor splits the
/// work across its own threads (an MKL team would spin on the cores they need).
///
/// # Safety
/// `set_threads_local` must be MKL's.
pub(crate) unsafe fn on_one_thread<R>(
    set_threads_local: SetThreadsFn,
    call: impl FnOnce() -> R,
) -> R {
    unsafe {
        let previous = set_threads_local(1);
        let result = call();
        set_threads_local(previous);
        result
    }
}

/// How the process chose its GEMM library: the f32 products of
/// [`GemmProbe::PRODUCTS`] on one thread, timed with each library (each product's best
/// of a few runs in turns, added up).
///
/// ```
/// let names: Vec<String> = nestor_backend_cpu::GemmProbe::PRODUCTS
///     .iter()
///     .map(ToString::to_string)
///     .collect();
/// assert_eq!(names[0], "512x256 . 256x768");
/// assert_eq!(names[2], "200 x 64x64 . (64x64)^T");
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmProbe {
    /// MKL's time, in seconds.
    pub mkl_seconds: f64,
    /// The `gemm` crate's time, in seconds.
    pub builtin_seconds: f64,
}

impl GemmProbe {
    /// The probe's products, of the kinds and sizes compiled programs make on each
    /// core: a GEMM's chunk of rows (512 rows of 256 to 768 columns), a weight
    /// gradient's `a^T b` over a batch's rows (a count that is no power of two) and
    /// attention's tiles of scores `q k^T`. A square product alone misled: on a 2-core
    /// Xeon the `gemm` crate won a 256^3 one by 4%, MKL the models' programs by 2%
    /// (weight gradients and attention's tiles).
    pub const PRODUCTS: [ProbeProduct; 3] = [
        ProbeProduct::new((512, 256, 768), (false, false), 1),
        ProbeProduct::new((256, 1001, 256), (true, false), 1),
        ProbeProduct::new((64, 64, 64), (false, true), 200),
    ];
    /// Timed runs of each library.
    const RUNS: usize = 5;

    /// Times both libraries (after one untimed run each, which sets up their buffers).
    fn measure(mkl: &Mkl) -> Self {
        let mut total = [0.0; 2];
        for product in Self::PRODUCTS {
            let ProbeProduct { m, k, n, .. } = product;
            // Values with no pattern a library could skip work on (no zeros, no
            // denormals).
            let a: Vec<f32> = (0..m * k).map(|i| 1.0 + (i % 7) as f32 / 8.0).collect();
            let b: Vec<f32> = (0..k * n).map(|i| 1.0 - (i % 5) as f32 / 8.0).collect();
            let mut c = vec![0f32; m * n];
            // A matrix `[rows x cols]` stored as it is or transposed.
            let read = |values: &[f32], (rows, cols), transposed| match transposed {
                true => (values.as_ptr(), 1, rows as isize),
                false => (values.as_ptr(), cols as isize, 1),
            };
            let mut run = |with_mkl: bool| {
                let a = read(&a, (m, k), product.a_transposed);
                let b = read(&b, (k, n), product.b_transposed);
                let c = (c.as_mut_ptr(), n as isize, 1);
                let started = Instant::now();
                for _ in 0..product.repeats {
                    // SAFETY: `a` holds m x k values, `b` k x n and `c` m x n.
                    unsafe {
                        if !(with_mkl && mkl_matmul(mkl, (m, k, n), 1.0, a, b, c, false)) {
                            builtin_matmul((m, k, n), 1.0, a, b, c, false);
                        }
                    }
                }
                started.elapsed().as_secs_f64()
            };
            let mut best = [f64::INFINITY; 2];
            for timed in [false].into_iter().chain([true; Self::RUNS]) {
                for (library, best) in best.iter_mut().enumerate() {
                    let seconds = run(library == 0);
                    if timed {
                        *best = best.min(seconds);
                    }
                }
            }
            for (total, best) in total.iter_mut().zip(best) {
                *total += best;
            }
        }
        Self {
            mkl_seconds: total[0],
            builtin_seconds: total[1],
        }
    }

    /// How much faster than MKL the `gemm` crate must be to be chosen: 3%. Within it
    /// the two are a toss-up that noise decides (on an AMD Zen 3 host they were 0.2-0.7%
    /// apart, either way, from one process to the next), and a process that took one
    /// rounds its products otherwise than one that took the other; libtorch's library
    /// keeps results the same from run to run there.
    pub const BUILTIN_MARGIN: f64 = 0.03;

    /// Whether MKL is the one to use: unless the `gemm` crate is faster by more than
    /// [`GemmProbe::BUILTIN_MARGIN`].
    ///
    /// ```
    /// let probe = |mkl_seconds, builtin_seconds| nestor_backend_cpu::GemmProbe {
    ///     mkl_seconds,
    ///     builtin_seconds,
    /// };
    /// assert!(probe(0.002, 0.002).mkl_wins());
    /// assert!(probe(0.00204, 0.002).mkl_wins());
    /// assert!(!probe(0.0021, 0.002).mkl_wins());
    /// ```
    pub fn mkl_wins(&self) -> bool {
        self.mkl_seconds <= self.builtin_seconds * (1.0 + Self::BUILTIN_MARGIN)
    }
}

/// One product of [`GemmProbe`]: `[m x k] . [k x n]`, each operand read as stored
/// (row-major) or transposed, `repeats` times in a row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeProduct {
    /// Rows of the product.
    pub m: usize,
    /// The inner size.
    pub k: usize,
    /// Columns of the product.
    pub n: usize,
    /// Whether the left operand is read transposed (stored `[k x m]`).
    pub a_transposed: bool,
    /// Whether the right operand is read transposed (stored `[n x k]`).
    pub b_transposed: bool,
    /// Products timed back to back.
    pub repeats: usize,
}

impl ProbeProduct {
    const fn new(
        (m, k, n): (usize, usize, usize),
        (a_transposed, b_transposed): (bool, bool),
        repeats: usize,
    ) -> Self {
        Self {
            m,
            k,
            n,
            a_transposed,
            b_transposed,
            repeats,
        }
    }
}

impl std::fmt::Display for ProbeProduct {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let operand = |rows, cols, transposed| match transposed {
            true => format!("({cols}x{rows})^T"),
            false => format!("{rows}x{cols}"),
        };
        if self.repeats > 1 {
            write!(f, "{} x ", self.repeats)?;
        }
        let (a, b) = (
            operand(self.m, self.k, self.a_transposed),
            operand(self.k, self.n, self.b_transposed),
        );
        write!(f, "{a} . {b}")
    }
}

/// The process's MKL and the probe that chose between it and the `gemm` crate (`None`
/// when `NESTOR_BLAS` forced the choice).
struct Choice {
    mkl: Option<Mkl>,
    probe: Option<GemmProbe>,
}

/// The choice, made once per process.
fn choice() -> &'static Choice {
    static CHOICE: OnceLock<Choice> = OnceLock::new();
    CHOICE.get_or_init(|| {
        let forced = |value| crate::process::env_is("NESTOR_BLAS", value);
        let (mkl, probe) = match find_mkl() {
            _ if forced("builtin") => (None, None),
            Some(mkl) if forced("mkl") => (Some(mkl), None),
            Some(mkl) => {
                let probe = GemmProbe::measure(&mkl);
                (probe.mkl_wins().then_some(mkl), Some(probe))
            }
            None => (None, None),
        };
        Choice { mkl, probe }
    })
}

/// MKL's entry points in this process, if it has them.
fn find_mkl() -> Option<Mkl> {
    // SAFETY: these are MKL's exported C and Fortran (LP64) functions, with these
    // signatures; all three must be present, so a BLAS that only shares the name
    // `sgemm_` is not taken for MKL.
    unsafe {
        Some(Mkl {
            sgemm: crate::process::function(b"sgemm_\0")?,
            dgemm: crate::process::function(b"dgemm_\0")?,
            set_threads_local: crate::process::function(b"MKL_Set_Num_Threads_Local\0")?,
        })
    }
}

/// MKL, when this process has it and uses it for its GEMMs.
fn mkl() -> Option<&'static Mkl> {
    choice().mkl.as_ref()
}

/// Which library multiplies a compiled program's GEMMs in this process: `"MKL"` (the
/// process's, usually libtorch's, when it was the faster) or `"gemm crate"` (no MKL
/// found, the faster, or `NESTOR_BLAS=builtin`). The first call makes the choice.
pub fn gemm_library() -> &'static str {
    if mkl().is_some() {
        "MKL"
    } else {
        "gemm crate"
    }
}

/// The timings that chose [`gemm_library`]; `None` when the process has no MKL or
/// `NESTOR_BLAS` forced the choice.
pub fn gemm_probe() -> Option<GemmProbe> {
    choice().probe
}

/// `c = scale a b` (`c += scale a b` when `add`) for `a [m x k]`, `b [k x n]`,
/// `c [m x n]` (each as pointer, row stride, column stride; `c`'s columns contiguous)
/// with MKL on this thread. `false` (nothing written) when the process does not use MKL
/// or the sizes or strides are not ones BLAS takes: the caller multiplies another way
/// ([`builtin_matmul`]).
///
/// # Safety
/// The pointers must be valid for the sizes and strides given.
pub(crate) unsafe fn matmul<T: Gemm>(
    shape: (usize, usize, usize),
    scale: T,
    a: Strided<T>,
    b: Strided<T>,
    c: StridedMut<T>,
    add: bool,
) -> bool {
    mkl().is_some_and(|mkl| unsafe { mkl_matmul(mkl, shape, scale, a, b, c, add) })
}

/// [`matmul`] with this MKL.
///
/// # Safety
/// As [`matmul`].
unsafe fn mkl_matmul<T: Gemm>(
    mkl: &Mkl,
    (m, k, n): (usize, usize, usize),
    scale: T,
    a: Strided<T>,
    b: Strided<T>,
    c: StridedMut<T>,
    add: bool,
) -> bool {
    let int = |value: usize| i32::try_from(value).ok().filter(|&value| value > 0);
    let (Some(rows), Some(inner), Some(columns)) = (int(m), int(k), int(n)) else {
        return false;
    };
    // Column-major, `c^T [n x m] = b^T a^T`: `c`'s row stride is its leading dimension.
    let Some(ldc) = leading(c.2, c.1, n) else {
        return false;
    };
    let (Some((op_b, ldb)), Some((op_a, lda))) = (operand(b, n, k), operand(a, k, m)) else {
        return false;
    };
    let beta = if add { T::ONE } else { T::ZERO };
    unsafe {
        on_one_thread(mkl.set_threads_local, || {
            T::gemm_fn(mkl)(
                &op_b, &op_a, &columns, &rows, &inner, &scale, b.0, &ldb, a.0, &lda, &beta, c.0,
                &ldc, 1, 1,
            )
        });
    }
    true
}

/// [`matmul`] with the `gemm` crate on this thread (the executor splits the rows
/// itself), at any strides.
///
/// # Safety
/// As [`matmul`].
pub(crate) unsafe fn builtin_matmul<T: Scalar>(
    (m, k, n): (usize, usize, usize),
    scale: T,
    a: Strided<T>,
    b: Strided<T>,
    c: StridedMut<T>,
    add: bool,
) {
    // `gemm` takes column strides before row strides; `c = alpha c + beta a b` (`c`
    // read only with `add`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.0,
            c.2,
            c.1,
            add,
            a.0,
            a.2,
            a.1,
            b.0,
            b.2,
            b.1,
            T::ONE,
            scale,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// How BLAS reads the transpose of a row-major-view matrix `[cols x rows]` given as
/// (pointer, row stride, column stride), to get a column-major `[rows x cols]`: `N`
/// when its columns are contiguous (the transpose is stored column-major), `T` when its
/// rows are; with the leading dimension. `None` for other strides.
fn operand<T>(
    (_, row_stride, column_stride): Strided<T>,
    rows: usize,
    cols: usize,
) -> Option<(c_char, i32)> {
    if let Some(ld) = leading(column_stride, row_stride, rows) {
        Some((b'N' as c_char, ld))
    } else {
        leading(row_stride, column_stride, cols).map(|ld| (b'T' as c_char, ld))
    }
}

/// The leading dimension `stride` when `unit` is 1 and `stride` is one BLAS accepts for
/// `rows` stored rows (at least `rows`, at least 1, an `i32`).
fn leading(unit: isize, stride: isize, rows: usize) -> Option<i32> {
    let stride = usize::try_from(stride).ok()?;
    (unit == 1 && stride >= rows.max(1))
        .then(|| i32::try_from(stride).ok())
        .flatten()
}
