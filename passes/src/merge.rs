//! Kernel fusion on a lowered program: a pointwise step whose output only one kernel
//! reads is computed inside that kernel. It becomes the prologue of a row kernel
//! (residual add + layer_norm, scale + softmax) or of a segmented one (the pointwise
//! inputs of a segment sum, mean, max or softmax), or the epilogue of the GEMM whose
//! output it reads (bias + activation, residual add), done on each chunk of rows while
//! they are in cache. Either way one launch and one pass over memory are saved.

use crate::program::{Access, Fusion, Program, RowBase, Rows, Slot, Source, Step};

/// Merges pointwise steps into their reader (row kernels) or producer (GEMMs) until
/// none is left to merge.
pub(crate) fn merge_pointwise(program: &mut Program) {
    while let Some((index, target)) =
        (0..program.steps.len()).find_map(|index| mergeable(program, index).map(|t| (index, t)))
    {
        let Step::Pointwise {
            out, inputs, expr, ..
        } = program.steps.remove(index)
        else {
            return;
        };
        match target {
            Target::Prologue(reader) => {
                // `remove` shifted every later step down by one.
                if let Step::Row { x, .. } | Step::Segment { x, .. } =
                    &mut program.steps[reader - 1]
                {
                    *x = Fusion { inputs, expr };
                }
            }
            Target::Epilogue(producer) => {
                if let Step::Gemm {
                    out: gemm_out,
                    epilogue,
                    ..
                } = &mut program.steps[producer]
                {
                    let written = *gemm_out;
                    // The GEMM now writes the pointwise step's buffer and the
                    // expression reads the GEMM's result there, in place.
                    let inputs = inputs
                        .into_iter()
                        .map(|access| {
                            if access.slot == written {
                                Access {
                                    slot: out,
                                    ..access
                                }
                            } else {
                                access
                            }
                        })
                        .collect();
                    *gemm_out = out;
                    *epilogue = Some(Fusion { inputs, expr });
                }
            }
        }
    }
}

/// Where a pointwise step goes.
enum Target {
    /// Into the row kernel at this index.
    Prologue(usize),
    /// Into the GEMM at this index.
    Epilogue(usize),
}

/// Whether step `index` is a pointwise step that can join another kernel, and which.
fn mergeable(program: &Program, index: usize) -> Option<Target> {
    let Step::Pointwise {
        out,
        rows,
        width,
        inputs,
        ..
    } = &program.steps[index]
    else {
        return None;
    };
    if inputs.iter().any(|access| access.per_element.is_some()) {
        return None;
    }
    if let Some(reader) = only_reader(program, *out) {
        let fits = match &program.steps[reader] {
            Step::Row {
                x,
                rows: row_rows,
                width: row_width,
                ..
            } => x.as_plain(*width) == Some(*out) && row_rows == rows && row_width == width,
            // A segmented kernel reads the packed rows of its lengths.
            Step::Segment {
                x,
                lengths,
                width: segment_width,
                ..
            } => {
                x.as_plain(*width) == Some(*out)
                    && *rows
                        == Rows {
                            base: RowBase::Total(*lengths),
                            factor: 1,
                        }
                    && segment_width == width
            }
            _ => false,
        };
        if fits {
            return Some(Target::Prologue(reader));
        }
    }
    // The GEMM whose output this step reads element for element (and nothing else
    // reads), when every other input is ready before the GEMM runs.
    let identity = |access: &Access| *access == Access::rows(access.slot, *width);
    inputs.iter().find_map(|access| {
        let producer = writer(program, access.slot)?;
        let Step::Gemm {
            rows: gemm_rows,
            n,
            epilogue: None,
            ..
        } = &program.steps[producer]
        else {
            return None;
        };
        let fits = identity(access)
            && gemm_rows == rows
            && n == width
            && only_reader(program, access.slot) == Some(index)
            && inputs.iter().all(|other| {
                other.slot == access.slot
                    || writer(program, other.slot).is_none_or(|written| written < producer)
            });
        fits.then_some(Target::Epilogue(producer))
    })
}

/// The step that writes `slot`, if a step does.
fn writer(program: &Program, slot: Slot) -> Option<usize> {
    program.steps.iter().position(|step| step.output() == slot)
}

/// The one step that reads `slot`, when exactly one does and the slot is neither a
/// result nor seen through an alias.
fn only_reader(program: &Program, slot: Slot) -> Option<usize> {
    let is_output = program.outputs.iter().any(|output| output.slot() == slot);
    let aliased = program
        .slots
        .iter()
        .any(|info| info.source == Source::Alias(slot));
    if is_output || aliased {
        return None;
    }
    let mut readers = program
        .steps
        .iter()
        .enumerate()
        .filter(|(_, step)| step.reads().contains(&slot));
    match (readers.next(), readers.next()) {
        (Some((reader, _)), None) => Some(reader),
        _ => None,
    }
}
