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
    device: [AtomicU64; 6],
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
    /// What device runs did besides their launches.
    pub device: DeviceCounts,
}

/// What runs on a kernel device asked of it besides launches (the host's runs ask none
/// of these).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    /// Copies from the host to the device (a run stages its lengths, indices and
    /// argument tables in one; float inputs in host memory are one each).
    pub uploads: u64,
    /// Bytes of those copies.
    pub bytes_uploaded: u64,
    /// Copies of results from the device to the host (each waits for the device's work).
    pub downloads: u64,
    /// Bytes of those copies.
    pub bytes_downloaded: u64,
    /// Times the host waited for the device: every download, and every explicit wait.
    pub synchronizations: u64,
    /// Device buffers allocated (spare buffers of earlier runs are reused first).
    pub allocations: u64,
}

/// The position of each [`DeviceCounts`] counter in [`Stats`].
#[derive(Clone, Copy)]
pub(crate) enum DeviceCounter {
    Uploads,
    BytesUploaded,
    Downloads,
    BytesDownloaded,
    Synchronizations,
    Allocations,
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

    /// Adds `count` to a device counter.
    pub(crate) fn device(&self, counter: DeviceCounter, count: u64) {
        self.device[counter as usize].fetch_add(count, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            compiles: self.compiles.load(Ordering::Relaxed),
            cache_hits: self.cache_hits.load(Ordering::Relaxed),
            kernel_launches: self.kernel_launches.load(Ordering::Relaxed),
            bytes_allocated: self.bytes_allocated.load(Ordering::Relaxed),
            bytes_moved: self.bytes_moved.load(Ordering::Relaxed),
            device: {
                let count =
                    |counter: DeviceCounter| self.device[counter as usize].load(Ordering::Relaxed);
                DeviceCounts {
                    uploads: count(DeviceCounter::Uploads),
                    bytes_uploaded: count(DeviceCounter::BytesUploaded),
                    downloads: count(DeviceCounter::Downloads),
                    bytes_downloaded: count(DeviceCounter::BytesDownloaded),
                    synchronizations: count(DeviceCounter::Synchronizations),
                    allocations: count(DeviceCounter::Allocations),
                }
            },
        }
    }
}
