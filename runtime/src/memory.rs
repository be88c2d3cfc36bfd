//! The memory a run may allocate at once: a step whose buffers would exceed it is a
//! typed error ([`crate::RuntimeError::OutOfMemory`]) rather than an abort.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// The limit set with [`MemoryBudget::set`]; 0 where none was set.
static LIMIT: AtomicU64 = AtomicU64::new(0);

/// The largest allocation a step may make, in bytes, process-wide.
///
/// ```
/// use nestor_runtime::MemoryBudget;
/// assert!(MemoryBudget::bytes() > 0);
/// MemoryBudget::set(Some(1 << 30)); // 1 GiB
/// assert_eq!(MemoryBudget::bytes(), 1 << 30);
/// MemoryBudget::set(None); // back to the default
/// ```
pub struct MemoryBudget;

impl MemoryBudget {
    /// The limit in force: the one set, else `NESTOR_MEMORY_LIMIT` (bytes), else half
    /// of the machine's physical memory (unlimited where it cannot be read).
    pub fn bytes() -> u64 {
        match LIMIT.load(Ordering::Relaxed) {
            0 => Self::default_bytes(),
            limit => limit,
        }
    }

    /// Sets the limit (`None`: the default again).
    pub fn set(limit: Option<u64>) {
        LIMIT.store(limit.unwrap_or(0), Ordering::Relaxed);
    }

    fn default_bytes() -> u64 {
        static DEFAULT: OnceLock<u64> = OnceLock::new();
        *DEFAULT.get_or_init(|| {
            std::env::var("NESTOR_MEMORY_LIMIT")
                .ok()
                .and_then(|limit| limit.parse().ok())
                .or_else(|| physical_memory().map(|bytes| bytes / 2))
                .unwrap_or(u64::MAX)
        })
    }
}

/// `MemTotal` of `/proc/meminfo`, in bytes (Linux).
fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|line| line.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
