//! Test helpers: the GPU's kernel templates (the `Complete` kernel set) run on the host,
//! for comparison with the runtime's own implementations.

use nestor_passes::{Program, Step};

/// Runs `step`'s `Complete` kernel, generated for the host, over `0..range` on `args`.
///
/// # Safety
/// `args` must be the step's buffers in its template's order, sized for the range.
pub(crate) unsafe fn run_template(step: Step, args: &[*mut u8], range: i64) {
    let program = Program {
        steps: vec![step],
        ..Program::default()
    };
    let kernels = crate::compile_with(&program, crate::KernelSet::Complete)
        .unwrap_or_else(|error| panic!("{error}"));
    let kernel = kernels
        .kernel(0)
        .unwrap_or_else(|| panic!("the step has no template"));
    // The caller vouches for the buffers.
    unsafe { kernel(args.as_ptr(), 0, range) };
}

/// The element of every packed row of elements of `lengths`.
pub(crate) fn row_elements(lengths: &[i64]) -> Vec<i64> {
    lengths
        .iter()
        .enumerate()
        .flat_map(|(element, &length)| std::iter::repeat_n(element as i64, length.max(0) as usize))
        .collect()
}
