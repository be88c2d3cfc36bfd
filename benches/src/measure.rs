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

/// How long one timed run lasts at least: a step shorter than this is called several
/// times in a row per run, and the run's time divided by the calls. A step of tens of
/// microseconds timed alone measures the timer and the scheduler as much as the step.
pub const SHORTEST_RUN_SECONDS: f64 = 1e-3;

/// Steps shorter than this are called once untimed before each timed run
/// ([`time_in_turns`]).
pub const WARMED_BELOW_SECONDS: f64 = 0.1;

/// Times `samples` runs of `step` after one warm-up run (each run at least
/// [`SHORTEST_RUN_SECONDS`] of back-to-back calls; times are per call).
pub fn time(samples: usize, mut step: impl FnMut() -> Result<()>) -> Result<Timing> {
    let mut timings = time_in_turns(samples, &mut [&mut step])?;
    Ok(timings.remove(0))
}

/// [`time`] for several steps in turns: each round times one run of every step, so a
/// machine that slows down for a while (a busy neighbour on a shared host) slows every
/// step alike, and their ratios hold. A timed run of a step under
/// [`WARMED_BELOW_SECONDS`] follows an untimed call of the same step, so that it is
/// timed as the Python scripts time PyTorch's (calls back to back) rather than just
/// after another step has filled the caches and the core has idled (a 2 ms compiled
/// call of the report's conv net took 1.3-1.8x as long right after another step or a
/// pause; a step of hundreds of milliseconds hardly changes).
pub fn time_in_turns(
    samples: usize,
    steps: &mut [&mut dyn FnMut() -> Result<()>],
) -> Result<Vec<Timing>> {
    let mut calls = Vec::with_capacity(steps.len());
    for step in steps.iter_mut() {
        step()?;
        let started = Instant::now();
        step()?;
        let seconds = started.elapsed().as_secs_f64();
        calls.push((calls_per_run(seconds), seconds < WARMED_BELOW_SECONDS));
    }
    let mut times = vec![Vec::with_capacity(samples.max(1)); steps.len()];
    for _ in 0..samples.max(1) {
        for ((step, &(calls, warmed)), times) in steps.iter_mut().zip(&calls).zip(&mut times) {
            if warmed {
                step()?;
            }
            let started = Instant::now();
            for _ in 0..calls {
                step()?;
            }
            times.push(started.elapsed().as_secs_f64() / calls as f64);
        }
    }
    Ok(times.into_iter().map(timing_of).collect())
}

/// The median and quartiles of `times`.
fn timing_of(mut times: Vec<f64>) -> Timing {
    times.sort_by(f64::total_cmp);
    let at = |fraction: f64| times[((times.len() - 1) as f64 * fraction).round() as usize];
    Timing {
        median: at(0.5),
        low: at(0.25),
        high: at(0.75),
        samples: times.len(),
    }
}

/// Calls of a step that took `seconds` once for a run of [`SHORTEST_RUN_SECONDS`]
/// (at least 1, at most 1000).
fn calls_per_run(seconds: f64) -> usize {
    if seconds <= 0.0 || !seconds.is_finite() {
        return 1000;
    }
    (SHORTEST_RUN_SECONDS / seconds).ceil().clamp(1.0, 1000.0) as usize
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

/// Runs this binary (`name` in messages) again with `nestor-memcount` preloaded, if it
/// is built next to it (`make report` builds it) and not preloaded yet; returns its exit
/// status (`None`: go on in this process, counting or not).
pub fn rerun_with_memcount(name: &str) -> Result<Option<i32>> {
    if std::env::var_os("NESTOR_MEMCOUNT").is_some() {
        return Ok(None);
    }
    let exe = std::env::current_exe()?;
    let library = exe.with_file_name("libnestor_memcount.so");
    if !library.exists() {
        eprintln!(
            "{name}: {} is not built: peak memory is not counted (make report builds it)",
            library.display()
        );
        return Ok(None);
    }
    let status = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env("LD_PRELOAD", &library)
        .env("NESTOR_MEMCOUNT", "1")
        .status()?;
    Ok(Some(status.code().unwrap_or(1)))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_steps_are_timed_in_runs_of_several_calls() {
        assert_eq!(calls_per_run(2e-3), 1);
        assert_eq!(calls_per_run(1e-3), 1);
        assert_eq!(calls_per_run(4e-5), 25);
        assert_eq!(calls_per_run(1e-9), 1000);
        assert_eq!(calls_per_run(0.0), 1000);
        let mut calls = 0;
        let timing = time(3, || {
            calls += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(timing.samples, 3);
        // Warm-up, the estimate, then three runs of (at most) 1000 calls each.
        assert!(calls > 3, "{calls} calls");
    }

    #[test]
    fn steps_timed_in_turns_each_get_their_samples() {
        let (mut slow, mut fast) = (0, 0);
        let timings = time_in_turns(
            5,
            &mut [
                &mut || {
                    slow += 1;
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    Ok(())
                },
                &mut || {
                    fast += 1;
                    Ok(())
                },
            ],
        )
        .unwrap();
        assert_eq!(timings.len(), 2);
        assert!(timings.iter().all(|timing| timing.samples == 5));
        assert!(timings[0].median > timings[1].median);
        // One call per run for the slow step (2 ms), after an untimed one (it is under
        // `WARMED_BELOW_SECONDS`); many for the fast one.
        assert_eq!(slow, 2 + 5 * 2);
        assert!(fast > 2 + 5);
    }
}
