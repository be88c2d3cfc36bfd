//! Copy forwarding on a lowered program: a pointwise step that only copies a strided
//! view of another buffer (`select`, `narrow` or a head split before attention and its
//! gradient) is dropped when every reader can read that view directly through its own
//! access.

use crate::operands::{Access, Expr, RowBase};
use crate::program::{Program, Source};
use crate::step::Step;
use crate::step::{Attention, AttentionGrad, Pointwise};

/// Drops the copies whose readers all take accesses, rewriting those accesses to read
/// the copied view in place. The program computes the same values with fewer steps.
pub(crate) fn forward_copies(program: &mut Program) {
    // Dropping a copy can make an earlier one forwardable (its readers change), so the
    // search starts over; programs have tens to hundreds of steps.
    while let Some(index) = (0..program.steps.len()).find(|&index| forwardable(program, index)) {
        let Step::Pointwise(Pointwise { out, inputs, .. }) = &program.steps[index] else {
            return;
        };
        let (copy, view) = (*out, inputs[0]);
        for step in &mut program.steps {
            for access in accesses_mut(step) {
                if access.slot == copy {
                    *access = compose(&view, access);
                }
            }
        }
        program.steps.remove(index);
    }
}

/// `reader` reads whole rows of a copy of `view` (checked by [`forwardable`]); it reads
/// the same rows and columns of `view`'s buffer in place.
fn compose(view: &Access, reader: &Access) -> Access {
    Access {
        slot: view.slot,
        row_stride: view.row_stride,
        col_stride: 1,
        offset: view.offset + reader.offset,
        row_map: None,
        col_modulo: 0,
        digits: None,
    }
}

/// Whether step `index` is a plain copy every reader of which can read its view.
fn forwardable(program: &Program, index: usize) -> bool {
    let Step::Pointwise(Pointwise {
        out,
        rows,
        width,
        inputs,
        expr: Expr::Load(0),
    }) = &program.steps[index]
    else {
        return false;
    };
    let [view] = &inputs[..] else {
        return false;
    };
    let plain = |access: &Access| {
        access.col_stride == 1
            && access.row_map.is_none()
            && access.col_modulo == 0
            && access.digits.is_none()
    };
    let is_output = program.outputs.iter().any(|output| output.slot() == *out);
    let aliased = program
        .slots
        .iter()
        .any(|info| info.source == Source::Alias(*out));
    if !plain(view)
        || is_output
        || aliased
        || program.info(view.slot).dtype != program.info(*out).dtype
    {
        return false;
    }
    // Every reader reads whole rows of the copy through an access over the same rows.
    let row_access = |access: &Access| plain(access) && access.row_stride == *width;
    // Attention and its gradient read their heads' columns of each row of the copy.
    let heads_access = |operands: &[(&Access, &crate::Slot)]| {
        operands
            .iter()
            .filter(|(access, _)| access.slot == *out)
            .all(|(access, lengths)| {
                row_access(access) && rows.base == RowBase::Total(**lengths) && rows.factor == 1
            })
    };
    program.steps.iter().all(|step| {
        if !step.reads().contains(out) {
            return true;
        }
        match step {
            Step::Pointwise(Pointwise {
                rows: reader_rows,
                width: reader_width,
                inputs,
                ..
            }) => {
                reader_rows == rows
                    && reader_width == width
                    && inputs
                        .iter()
                        .filter(|access| access.slot == *out)
                        .all(|access| row_access(access) && access.offset == 0)
            }
            Step::Attention(Attention {
                q,
                k,
                v,
                q_lengths,
                k_lengths,
                ..
            }) => heads_access(&[(q, q_lengths), (k, k_lengths), (v, k_lengths)]),
            Step::AttentionGrad(AttentionGrad {
                q,
                k,
                v,
                g,
                q_lengths,
                k_lengths,
                ..
            }) => heads_access(&[
                (q, q_lengths),
                (k, k_lengths),
                (v, k_lengths),
                (g, q_lengths),
            ]),
            _ => false,
        }
    })
}

/// The accesses of a step that reads through accesses.
fn accesses_mut(step: &mut Step) -> Vec<&mut Access> {
    match step {
        Step::Pointwise(Pointwise { inputs, .. }) => inputs.iter_mut().collect(),
        Step::Attention(Attention { q, k, v, .. }) => vec![q, k, v],
        Step::AttentionGrad(AttentionGrad { q, k, v, g, .. }) => vec![q, k, v, g],
        _ => Vec::new(),
    }
}
