//! Timing and memory of one step.

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;
use std::time::Instant;

use crate::Result;

/// Step times in seconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// The median.
    pub median: f64,
    /// The 25th percentile.
    pub low: f64,
    /// The 75th percentile.
    pub high: f64,
    /// Timed runs.
    pub samples: usize,
}

/// Times `samples` runs of `step` after one warm-up run.
pub fn time(samples: usize, mut step: impl FnMut() -> Result<()>) -> Result<Timing> {
    step()?;
    let mut times = Vec::with_capacity(samples.max(1));
    for _ in 0..samples.max(1) {
        let started = Instant::now();
        step()?;
        times.push(started.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let at = |fraction: f64| times[((times.len() - 1) as f64 * fraction).round() as usize];
    Ok(Timing {
        median: at(0.5),
        low: at(0.25),
        high: at(0.75),
        samples: times.len(),
    })
}

/// The counters of `nestor-memcount`, when it is preloaded.
struct Counter {
    current: extern "C" fn() -> i64,
    peak: extern "C" fn() -> i64,
    reset: extern "C" fn(),
}

extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

fn counter() -> Option<&'static Counter> {
    static COUNTER: OnceLock<Option<Counter>> = OnceLock::new();
    COUNTER
        .get_or_init(|| {
            let find = |name: &std::ffi::CStr| {
                // SAFETY: `RTLD_DEFAULT` (null) searches the loaded objects; the name is
                // a C string.
                let symbol = unsafe { dlsym(std::ptr::null_mut(), name.as_ptr()) };
                (!symbol.is_null()).then_some(symbol)
            };
            let (current, peak, reset) = (
                find(c"nestor_memcount_current")?,
                find(c"nestor_memcount_peak")?,
                find(c"nestor_memcount_reset")?,
            );
            // SAFETY: nestor-memcount defines these symbols with these signatures.
            unsafe {
                Some(Counter {
                    current: std::mem::transmute::<*mut c_void, extern "C" fn() -> i64>(current),
                    peak: std::mem::transmute::<*mut c_void, extern "C" fn() -> i64>(peak),
                    reset: std::mem::transmute::<*mut c_void, extern "C" fn()>(reset),
                })
            }
        })
        .as_ref()
}

/// Whether peak memory can be measured (`nestor-memcount` is preloaded).
pub fn memory_counted() -> bool {
    counter().is_some()
}

/// The most bytes `step` had allocated at once beyond what was allocated before it
/// (`None` without `nestor-memcount`).
pub fn peak_bytes(mut step: impl FnMut() -> Result<()>) -> Result<Option<u64>> {
    let Some(counter) = counter() else {
        step()?;
        return Ok(None);
    };
    (counter.reset)();
    let before = (counter.current)();
    step()?;
    Ok(Some(((counter.peak)() - before).max(0) as u64))
}
