//! How the executor splits its work across threads: how many chunks a step may have,
//! and the sizes below which a step runs on the calling thread alone.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The executor's splitting settings, process-wide. Results never depend on them (the
/// tests check that): they only trade the cost of waking threads against the work.
///
/// ```
/// use nestor_backend_cpu::Parallelism;
/// // Split every kernel and GEMM into four chunks, however small (for tests).
/// let saved = Parallelism::current();
/// Parallelism { threads: 4, kernel_scalars: 1, gemm_macs: 1 }.set();
/// assert_eq!(Parallelism::current().threads, 4);
/// saved.set();
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Parallelism {
    /// Chunks a step may be split into (at least 1). Default: `NESTOR_THREADS`, else
    /// `OMP_NUM_THREADS` (libtorch's threads too; torchrun sets 1 for each process),
    /// else the machine's cores. Chunks run on the process's OpenMP team when it has one
    /// (libtorch's), else on rayon's global pool ([`crate::pool`]), the calling thread
    /// taking part.
    pub threads: usize,
    /// Scalars per chunk below which a kernel is not split (weighted: a transcendental
    /// function counts for several). Default 2^15 on the process's OpenMP team, whose
    /// threads are already running and keep their rows from step to step (libtorch's
    /// grain too: relu of 77k values 15.5 us unsplit, 10.4 us in two chunks; of 26k
    /// values no gain), and 2^19 on rayon's pool, which must be woken first (relu and
    /// add on 384k values ran faster unsplit).
    pub kernel_scalars: usize,
    /// Multiply-adds below which a GEMM (and its epilogue) is not split. Default 2^21.
    pub gemm_macs: usize,
}

/// The settings made with [`Parallelism::set`]; 0 where none was made.
static THREADS: AtomicUsize = AtomicUsize::new(0);
static KERNEL_SCALARS: AtomicUsize = AtomicUsize::new(0);
static GEMM_MACS: AtomicUsize = AtomicUsize::new(0);

/// Steps run in more than one chunk.
static SPLIT_STEPS: AtomicU64 = AtomicU64::new(0);

impl Parallelism {
    /// The settings in force.
    pub fn current() -> Self {
        let or = |setting: &AtomicUsize, default: usize| match setting.load(Ordering::Relaxed) {
            0 => default,
            value => value,
        };
        let defaults = Self::defaults();
        Self {
            threads: or(&THREADS, defaults.threads),
            kernel_scalars: or(&KERNEL_SCALARS, defaults.kernel_scalars),
            gemm_macs: or(&GEMM_MACS, defaults.gemm_macs),
        }
    }

    /// The settings a process starts with.
    pub fn defaults() -> Self {
        static THREADS_FROM_ENVIRONMENT: OnceLock<usize> = OnceLock::new();
        Self {
            threads: *THREADS_FROM_ENVIRONMENT.get_or_init(|| {
                ["NESTOR_THREADS", "OMP_NUM_THREADS"]
                    .iter()
                    .find_map(|name| std::env::var(name).ok()?.trim().parse().ok())
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
                    .max(1)
            }),
            kernel_scalars: if crate::team::pool() == "OpenMP" {
                1 << 15
            } else {
                1 << 19
            },
            gemm_macs: 1 << 21,
        }
    }

    /// Makes these the settings of every later run in the process (a value of 0 is
    /// taken as 1).
    pub fn set(self) {
        THREADS.store(self.threads.max(1), Ordering::Relaxed);
        KERNEL_SCALARS.store(self.kernel_scalars.max(1), Ordering::Relaxed);
        GEMM_MACS.store(self.gemm_macs.max(1), Ordering::Relaxed);
    }

    /// How many step runs of the process were split into more than one chunk (kernels,
    /// GEMMs, column sums; attention's tasks are not counted): whether work is spread
    /// across threads at all.
    pub fn split_steps() -> u64 {
        SPLIT_STEPS.load(Ordering::Relaxed)
    }

    /// Counts a step run split into chunks.
    pub(crate) fn count_split() {
        SPLIT_STEPS.fetch_add(1, Ordering::Relaxed);
    }
}

/// Chunks a step may be split into ([`Parallelism::threads`]).
pub(crate) fn worker_threads() -> i64 {
    Parallelism::current().threads as i64
}

/// Part `part` of `0..size` split into `parts` parts whose sizes differ by at most one,
/// the larger ones first (threads take parts in order: the last ones are the shortest).
pub(crate) fn even_part(part: usize, parts: usize, size: usize) -> std::ops::Range<usize> {
    let parts = parts.max(1);
    let (base, extra) = (size / parts, size % parts);
    let start = part * base + part.min(extra);
    start..start + base + usize::from(part < extra)
}

/// How many scalars' worth of memory traffic one transcendental function (an
/// exponential, erf, tanh) counts for when deciding to split a kernel.
const TRANSCENDENTAL_WEIGHT: i64 = 8;

/// Rows per chunk of `step` over rows of `width` scalars: fewer when it evaluates
/// transcendentals, which make a kernel worth splitting across threads sooner.
pub(crate) fn row_grain(step: &nestor_passes::Step, width: i64) -> i64 {
    let weight = 1 + TRANSCENDENTAL_WEIGHT * step.transcendentals() as i64;
    let scalars = Parallelism::current().kernel_scalars as i64;
    (scalars / (width * weight).max(1)).max(1)
}

/// Raw buffer pointers handed to kernels on several threads; each thread writes a
/// disjoint range of the output, and inputs are only read.
#[derive(Clone, Copy)]
pub(crate) struct Args<'a>(pub(crate) &'a [*mut u8]);
unsafe impl Send for Args<'_> {}
unsafe impl Sync for Args<'_> {}

/// A pointer the team's tasks share: each writes its own part of what it points to (or
/// they only read), as the code making one says.
#[derive(Clone, Copy)]
pub(crate) struct SendPointer<T>(pub(crate) *mut T);
// SAFETY: the tasks sharing one write disjoint parts (see each use).
unsafe impl<T> Send for SendPointer<T> {}
unsafe impl<T> Sync for SendPointer<T> {}

impl<T> SendPointer<T> {
    /// The pointer (a method, so that closures capture the whole, Sync, struct).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}
