//! Counters of what the runtime did.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::RunProfile;

/// The most run profiles [`Stats`] keeps until they are taken (older ones are dropped).
const KEPT_PROFILES: usize = 1024;

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
    recording: AtomicBool,
    profiles: Mutex<Vec<RunProfile>>,
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

    /// Starts (or stops) keeping each host run's step timings, for
    /// [`Stats::take_step_profiles`]. Off by default: runs then do not read the clock
    /// per step (unless `NESTOR_PROFILE` prints them).
    pub fn record_steps(&self, enabled: bool) {
        self.recording.store(enabled, Ordering::Relaxed);
    }

    /// Whether runs keep their step timings.
    pub fn recording_steps(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    /// The step timings of the runs since the last take, oldest first (at most the
    /// last 1024 runs).
    pub fn take_step_profiles(&self) -> Vec<RunProfile> {
        std::mem::take(&mut *self.profiles.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Keeps a run's step timings while recording.
    pub(crate) fn record(&self, profile: RunProfile) {
        if !self.recording_steps() {
            return;
        }
        let mut profiles = self.profiles.lock().unwrap_or_else(|e| e.into_inner());
        if profiles.len() == KEPT_PROFILES {
            profiles.remove(0);
        }
        profiles.push(profile);
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
