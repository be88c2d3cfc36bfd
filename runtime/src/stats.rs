//! Counters of what the runtime did.

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters shared by every run of a compiled function (atomic: runs may be
/// concurrent).
#[derive(Debug, Default)]
pub struct Stats {
    compiles: AtomicU64,
    cache_hits: AtomicU64,
    kernel_launches: AtomicU64,
    bytes_allocated: AtomicU64,
    bytes_moved: AtomicU64,
}

/// A snapshot of [`Stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Programs compiled (one per structure).
    pub compiles: u64,
    /// Calls that found their program compiled already.
    pub cache_hits: u64,
    /// Kernel and GEMM launches.
    pub kernel_launches: u64,
    /// Bytes of intermediate buffers allocated.
    pub bytes_allocated: u64,
    /// Bytes kernels read and wrote in memory: every buffer a step reads, once, and the
    /// buffer it writes (what fused kernels keep in registers is not counted).
    pub bytes_moved: u64,
}

impl Stats {
    /// Counts a compile.
    pub fn compiled(&self) {
        self.compiles.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a cache hit.
    pub fn hit(&self) {
        self.cache_hits.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn launched(&self, launches: u64) {
        self.kernel_launches.fetch_add(launches, Ordering::Relaxed);
    }

    pub(crate) fn allocated(&self, bytes: u64) {
        self.bytes_allocated.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn moved(&self, bytes: u64) {
        self.bytes_moved.fetch_add(bytes, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            compiles: self.compiles.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            kernel_launches: self.kernel_launches.load(Ordering::Relaxed),
            bytes_allocated: self.bytes_allocated.load(Ordering::Relaxed),
            bytes_moved: self.bytes_moved.load(Ordering::Relaxed),
        }
    }
}
