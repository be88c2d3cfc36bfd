//! The threads a split step runs on: the process's OpenMP team when it has one (libgomp,
//! which libtorch links and exports; looked up at run time, never loaded by nestor), else
//! rayon's pool. libtorch's OpenMP threads spin for a while after each of its operators:
//! a second pool would have to be woken for every step (tens of microseconds on a
//! virtual machine) and would compete with those spinning threads for the cores, while
//! the team they belong to starts a step at once. `NESTOR_POOL=rayon` forces rayon.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// libgomp's entry points, found in this process.
struct Gomp {
    /// `GOMP_parallel(fn, data, num_threads, flags)`: runs `fn(data)` on a team of
    /// `num_threads` threads, the caller among them, and returns when all are done.
    parallel: unsafe extern "C" fn(unsafe extern "C" fn(*mut c_void), *mut c_void, u32, u32),
    /// `omp_get_thread_num()`: the calling thread's number in its team (0 for the
    /// thread that started it).
    thread_num: unsafe extern "C" fn() -> i32,
    /// `omp_get_num_threads()`: the size of the calling thread's team (smaller than
    /// asked for inside another parallel region).
    num_threads: unsafe extern "C" fn() -> i32,
}

fn gomp() -> Option<&'static Gomp> {
    static GOMP: OnceLock<Option<Gomp>> = OnceLock::new();
    GOMP.get_or_init(|| {
        if crate::process::env_is("NESTOR_POOL", "rayon") {
            return None;
        }
        // SAFETY: libgomp's `GOMP_parallel` (the ABI of `#pragma omp parallel` since GCC
        // 4.9) has this signature.
        let parallel = unsafe { crate::process::function(b"GOMP_parallel\0")? };
        // SAFETY: OpenMP's `int omp_get_thread_num(void)`.
        let thread_num = unsafe { crate::process::function(b"omp_get_thread_num\0")? };
        // SAFETY: OpenMP's `int omp_get_num_threads(void)`.
        let num_threads = unsafe { crate::process::function(b"omp_get_num_threads\0")? };
        Some(Gomp {
            parallel,
            thread_num,
            num_threads,
        })
    })
    .as_ref()
}

/// Which threads split steps run on: `"OpenMP"` (the process's team) or `"rayon"`.
pub fn pool() -> &'static str {
    if gomp().is_some() {
        "OpenMP"
    } else {
        "rayon"
    }
}

/// What every thread of a team shares: the chunks left and the task.
///
/// Member `m` of a team of `t` threads runs chunk `m` first, then takes chunks from
/// `t` on as they come (`t` is the team's real size, which nested parallelism may make
/// smaller than asked for). When a step has one chunk per thread (kernels and GEMMs split
/// in equal parts) each thread thus gets the same rows on every call and every step: the
/// rows one step wrote are still in that core's cache when the next step reads them
/// (libtorch's static schedule does the same). Taking chunks in arrival order instead
/// sent rows to a different core on about half the calls: relu of 388k values took
/// 45 us where libtorch's took 18.
struct Work<'a> {
    /// Chunks taken after each member's first, counted from the team's size.
    taken: AtomicUsize,
    chunks: usize,
    /// Set by a panicking chunk: no chunk starts after it.
    stopped: AtomicBool,
    task: &'a (dyn Fn(usize) + Sync),
    /// The first panic of a task, resumed on the calling thread (a panic must not
    /// unwind through libgomp).
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Work<'_> {
    /// Runs chunk `member` (this thread's number in a team of `team`), then takes
    /// chunks from `team` on until none is left.
    fn run(&self, member: usize, team: usize) {
        let mut chunk = if member < team { member } else { self.chunks };
        loop {
            if chunk >= self.chunks || self.stopped.load(Ordering::Relaxed) {
                return;
            }
            let task = self.task;
            if let Err(panic) =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(chunk)))
            {
                // Stop handing out chunks, and keep the first panic.
                self.stopped.store(true, Ordering::Relaxed);
                let mut first = self
                    .panic
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                first.get_or_insert(panic);
            }
            chunk = team.saturating_add(self.taken.fetch_add(1, Ordering::Relaxed));
        }
    }
}

/// The function each thread of an OpenMP team runs.
///
/// # Safety
/// `data` must point to a live `Work`.
unsafe extern "C" fn team_member(data: *mut c_void) {
    let work = unsafe { &*(data as *const Work<'_>) };
    // Called by libgomp inside a team, so `gomp()` found it; both calls only read the
    // calling thread's team.
    let (member, team) = gomp().map_or((0, 1), |gomp| unsafe {
        ((gomp.thread_num)(), (gomp.num_threads)())
    });
    let index = |value: i32| usize::try_from(value).unwrap_or(0);
    work.run(index(member), index(team).max(1));
}

/// Runs `task(chunk)` for every chunk in `0..chunks` on up to `threads` threads (the
/// calling thread one of them), each thread taking the next chunk left; returns when
/// every chunk is done.
pub(crate) fn for_each_chunk(chunks: usize, threads: usize, task: &(dyn Fn(usize) + Sync)) {
    let threads = threads.min(chunks);
    if threads <= 1 {
        (0..chunks).for_each(task);
        return;
    }
    let work = Work {
        taken: AtomicUsize::new(0),
        chunks,
        stopped: AtomicBool::new(false),
        task,
        panic: Mutex::new(None),
    };
    match gomp() {
        Some(gomp) => {
            let team = u32::try_from(threads).unwrap_or(u32::MAX);
            // SAFETY: `work` outlives the call, which returns when every member is done.
            unsafe {
                (gomp.parallel)(
                    team_member,
                    &work as *const Work<'_> as *mut c_void,
                    team,
                    0,
                )
            };
        }
        None => rayon::in_place_scope(|scope| {
            for member in 1..threads {
                let work = &work;
                scope.spawn(move |_| work.run(member, threads));
            }
            work.run(0, threads);
        }),
    }
    let panic = work
        .panic
        .into_inner()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(panic) = panic {
        std::panic::resume_unwind(panic);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_chunk_runs_once_whatever_the_threads() {
        for (chunks, threads) in [(0, 4), (1, 4), (7, 1), (7, 3), (64, 2), (3, 8)] {
            let runs: Vec<AtomicU64> = (0..chunks).map(|_| AtomicU64::new(0)).collect();
            for_each_chunk(chunks, threads, &|chunk| {
                runs[chunk].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                runs.iter().all(|runs| runs.load(Ordering::Relaxed) == 1),
                "{chunks} {threads}"
            );
        }
    }

    #[test]
    fn the_first_chunk_runs_on_the_calling_thread_every_time() {
        // Member 0 (the caller) always takes chunk 0: the rows a step split in equal
        // parts gives this thread are the same on every call.
        let caller = std::thread::current().id();
        for _ in 0..20 {
            let owner = Mutex::new(None);
            for_each_chunk(2, 2, &|chunk| {
                if chunk == 0 {
                    *owner.lock().unwrap() = Some(std::thread::current().id());
                }
            });
            assert_eq!(owner.into_inner().unwrap(), Some(caller));
        }
    }

    #[test]
    fn nested_teams_run_every_chunk() {
        // Inside a team a nested one may get fewer threads than asked for.
        let runs: Vec<AtomicU64> = (0..4 * 6).map(|_| AtomicU64::new(0)).collect();
        for_each_chunk(4, 4, &|outer| {
            for_each_chunk(6, 3, &|inner| {
                runs[outer * 6 + inner].fetch_add(1, Ordering::Relaxed);
            });
        });
        assert!(runs.iter().all(|runs| runs.load(Ordering::Relaxed) == 1));
    }

    #[test]
    fn a_panicking_chunk_panics_on_the_caller() {
        let outcome = std::panic::catch_unwind(|| {
            for_each_chunk(8, 4, &|chunk| assert_ne!(chunk, 5, "chunk 5 fails"));
        });
        let panic = outcome.expect_err("the panic of chunk 5 reaches the caller");
        let message = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .unwrap_or_default();
        assert!(message.contains("chunk 5 fails"), "{message}");
    }
}
