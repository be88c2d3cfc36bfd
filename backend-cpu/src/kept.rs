//! The bf16 roundings a run keeps for its later products: a buffer rounded for one step
//! (a GEMM's input, a weight, attention's queries, keys and values) is rounded again
//! by none of the steps after it that read it (the weight gradient of that GEMM, the
//! product of the transposed weight, attention's gradient), until a step writes over it.
//!
//! Each step of a run is bracketed by [`in_step`], which drops what the step is about to
//! overwrite (its output's memory) and, at the run's first step, what an earlier run
//! kept; after its last step nothing is kept. Outside a step of a run (tests, the eager
//! API) nothing is kept and every rounding is made anew. A thread's runs keep their
//! roundings on that thread: steps run on the run's thread, and the team only helps
//! inside a step.

use std::cell::RefCell;
use std::sync::Arc;

use crate::bf16::RoundedBuffer;

/// Most bytes of roundings a run keeps; the oldest go first. A training step keeps its
/// forward's roundings for the weight gradients, which read the first layers' last: a
/// ResNet-50 step at 81% occupancy made some 40 of them again (about 0.9 GB read and
/// written) with 256 MiB and took 4% longer; its peak memory grew by 5% with 1 GiB.
pub(crate) const KEPT_BYTES: usize = 1 << 30;

/// What the current run of this thread keeps.
#[derive(Default)]
struct Kept {
    /// Whether a step of the run is running (roundings are kept only then).
    in_step: bool,
    /// The run whose roundings are kept.
    run: Option<u64>,
    /// Roundings, oldest first, by the address range of the f32 values they round.
    entries: Vec<(std::ops::Range<usize>, Arc<RoundedBuffer>)>,
    /// The roundings of its output that the running step made as it wrote it, kept
    /// when the step ends.
    produced: Option<RoundedBuffer>,
}

impl Kept {
    /// Drops the roundings of values in `written`.
    fn overwritten(&mut self, written: &[std::ops::Range<usize>]) {
        self.entries.retain(|(range, _)| {
            written
                .iter()
                .all(|written| range.end <= written.start || written.end <= range.start)
        });
    }

    /// Keeps `rounded`, the roundings of the f32 values in `range`, dropping the oldest
    /// past [`KEPT_BYTES`].
    fn keep(&mut self, range: std::ops::Range<usize>, rounded: Arc<RoundedBuffer>) {
        self.entries.push((range, rounded));
        let mut bytes: usize = self.entries.iter().map(|(_, kept)| kept.bytes()).sum();
        while bytes > KEPT_BYTES && !self.entries.is_empty() {
            let (_, oldest) = self.entries.remove(0);
            bytes -= oldest.bytes();
        }
    }
}

thread_local! {
    static KEPT: RefCell<Kept> = RefCell::new(Kept::default());
}

/// The position of a step in its run.
pub(crate) struct StepOf {
    /// The run's number (unique in the process).
    pub run: u64,
    /// Whether it is the run's first step, and whether its last.
    pub first: bool,
    pub last: bool,
}

/// Runs `step`, a step of run `of` that writes the bytes `written` (its outputs'), with
/// the run's roundings kept across its steps (see the module's doc).
pub(crate) fn in_step<R>(
    of: StepOf,
    written: &[std::ops::Range<usize>],
    step: impl FnOnce() -> R,
) -> R {
    KEPT.with_borrow_mut(|kept| {
        if of.first || kept.run != Some(of.run) {
            kept.entries.clear();
        }
        kept.run = Some(of.run);
        kept.overwritten(written);
        kept.in_step = true;
    });
    let result = step();
    KEPT.with_borrow_mut(|kept| {
        // Nothing the step rounded of its own output stays (none of its products read
        // that, but a kept rounding must never outlive the values it rounds), but for
        // the roundings the step made of its finished output.
        kept.overwritten(written);
        kept.in_step = false;
        if let Some(produced) = kept.produced.take() {
            let range = produced.range();
            kept.keep(range, Arc::new(produced));
        }
        if of.last {
            kept.entries.clear();
            kept.run = None;
        }
    });
    result
}

/// The roundings of the `len` values at `base`: those the run keeps, if they cover the
/// values, else made now by `threads` of the team (and kept, inside a step of a run).
///
/// # Safety
/// `base` must be valid for `len` values.
pub(crate) unsafe fn rounded(base: *const f32, len: usize, threads: usize) -> Arc<RoundedBuffer> {
    let range = crate::bf16::values_range(base, len);
    let found = KEPT.with_borrow(|kept| {
        if !kept.in_step {
            return None;
        }
        kept.entries
            .iter()
            .find(|(kept, _)| kept.start <= range.start && range.end <= kept.end)
            .map(|(_, rounded)| Arc::clone(rounded))
    });
    if let Some(rounded) = found {
        return rounded;
    }
    // SAFETY: the caller vouches for the values.
    let rounded = Arc::new(unsafe { RoundedBuffer::new(base, len, threads) });
    KEPT.with_borrow_mut(|kept| {
        if kept.in_step {
            kept.keep(range, Arc::clone(&rounded));
        }
    });
    rounded
}

/// Keeps `rounded`, the roundings of the running step's output that the step made as it
/// wrote it, for the run's later steps (from when the step ends; outside a step of a run
/// they are dropped).
pub(crate) fn produced(rounded: RoundedBuffer) {
    KEPT.with_borrow_mut(|kept| {
        if kept.in_step {
            kept.produced = Some(rounded);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(run: u64, first: bool, last: bool) -> StepOf {
        StepOf { run, first, last }
    }

    /// The roundings' first value, as f32 (whichever type the process's path keeps).
    fn first_rounding(rounded: &RoundedBuffer, values: &[f32]) -> f32 {
        rounded.value_of((values.as_ptr(), 1, 1))
    }

    #[test]
    fn a_run_keeps_roundings_until_a_step_writes_over_them() {
        let mut values = vec![1.5f32; 64];
        let range = |values: &[f32]| {
            let start = values.as_ptr() as usize;
            start..start + values.len() * 4
        };
        let elsewhere = 0..4;
        let run = 7;
        // SAFETY (each `rounded` below): `values` holds 64 values.
        let kept = in_step(
            step(run, true, false),
            std::slice::from_ref(&elsewhere),
            || unsafe { rounded(values.as_ptr(), 64, 1) },
        );
        let again = in_step(
            step(run, false, false),
            std::slice::from_ref(&elsewhere),
            || unsafe { rounded(values.as_ptr(), 64, 1) },
        );
        assert!(Arc::ptr_eq(&kept, &again), "kept for a later step");
        // A part of the buffer reads the whole buffer's roundings.
        let part = in_step(
            step(run, false, false),
            std::slice::from_ref(&elsewhere),
            || unsafe { rounded(values.as_ptr().wrapping_add(8), 16, 1) },
        );
        assert!(Arc::ptr_eq(&kept, &part), "a part of a kept buffer");
        // A step that writes the values drops their roundings first.
        let written = range(&values);
        values[0] = -2.0;
        let fresh = in_step(
            step(run, false, false),
            std::slice::from_ref(&written),
            || unsafe { rounded(values.as_ptr(), 64, 1) },
        );
        assert!(!Arc::ptr_eq(&kept, &fresh));
        assert_eq!(first_rounding(&fresh, &values), -2.0);
        // Another run keeps nothing of this one's.
        let other = in_step(step(run + 1, false, true), &[elsewhere], || unsafe {
            rounded(values.as_ptr(), 64, 1)
        });
        assert!(!Arc::ptr_eq(&fresh, &other), "a new run");
        // Outside a run's steps nothing is kept, and the last step left nothing.
        let outside = unsafe { rounded(values.as_ptr(), 64, 1) };
        let outside_again = unsafe { rounded(values.as_ptr(), 64, 1) };
        assert!(!Arc::ptr_eq(&outside, &outside_again));
        assert!(KEPT.with_borrow(|kept| kept.entries.is_empty()));
    }
}
