//! The threads a split step runs on: the process's OpenMP team when it has one (libgomp,
//! which libtorch links and exports; looked up at run time, never loaded by nestor), else
//! rayon's pool. libtorch's OpenMP threads spin for a while after each of its operators:
//! a second pool would have to be woken for every step (tens of microseconds on a
//! virtual machine) and would compete with those spinning threads for the cores, while
//! the team they belong to starts a step at once. `NESTOR_POOL=rayon` forces rayon.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// libgomp's entry points, found in this process.
struct Gomp {
    /// `GOMP_parallel(fn, data, num_threads, flags)`: runs `fn(data)` on a team of
    /// `num_threads` threads, the caller among them, and returns when all are done.
    parallel: unsafe extern "C" fn(unsafe extern "C" fn(*mut c_void), *mut c_void, u32, u32),
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
        Some(Gomp { parallel })
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
struct Work<'a> {
    next: AtomicUsize,
    chunks: usize,
    task: &'a (dyn Fn(usize) + Sync),
    /// The first panic of a task, resumed on the calling thread (a panic must not
    /// unwind through libgomp).
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Work<'_> {
    /// Takes chunks until none is left.
    fn run(&self) {
        loop {
            let chunk = self.next.fetch_add(1, Ordering::Relaxed);
            if chunk >= self.chunks {
                return;
            }
            let task = self.task;
            if let Err(panic) =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(chunk)))
            {
                // Stop handing out chunks, and keep the first panic.
                self.next.store(self.chunks, Ordering::Relaxed);
                let mut first = self
                    .panic
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner());
                first.get_or_insert(panic);
            }
        }
    }
}

/// The function each thread of an OpenMP team runs.
///
/// # Safety
/// `data` must point to a live `Work`.
unsafe extern "C" fn team_member(data: *mut c_void) {
    let work = unsafe { &*(data as *const Work<'_>) };
    work.run();
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
        next: AtomicUsize::new(0),
        chunks,
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
            for _ in 1..threads {
                scope.spawn(|_| work.run());
            }
            work.run();
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
