//! Kernel fusion in the lowering of `prologue` and `epilogue` ops: the two steps such an
//! op lowers to (a pointwise step and the kernel next to it) become one kernel. A
//! prologue becomes the input expression of a row kernel (residual add + layer_norm,
//! scale + softmax) or a segmented one (gelu + segment mean); an epilogue runs on each
//! chunk of GEMM rows while they are in cache (bias + relu, residual add). Either way
//! one launch and one pass over memory are saved. Where the kernel would read the
//! pointwise result other than element for element as written, the two steps stay
//! (the result is the same, one launch more).

use nestor_ir::BinaryOp;

use crate::operands::{Access, Expr, Fusion, RowBase, Rows};
use crate::program::Program;
use crate::step::Step;
use crate::step::{Gemm, Pointwise, Row, Segment};

/// Folds the last two steps, a pointwise step and the row or segmented kernel that
/// reads its output, into that kernel. Returns whether it did.
pub(crate) fn fold_prologue(program: &mut Program) -> bool {
    let [.., Step::Pointwise(Pointwise {
        out,
        rows,
        width,
        inputs,
        ..
    }), reader] = &program.steps[..]
    else {
        return false;
    };
    let fits = inputs.iter().all(|access| access.row_map.is_none())
        && match reader {
            Step::Row(Row {
                x,
                rows: row_rows,
                width: row_width,
                ..
            }) => x.as_plain(*width) == Some(*out) && row_rows == rows && row_width == width,
            // A segmented kernel reads the packed rows of its lengths.
            Step::Segment(Segment {
                x,
                lengths,
                width: segment_width,
                ..
            }) => {
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
    if !fits {
        return false;
    }
    let (Some(mut reader), Some(Step::Pointwise(Pointwise { inputs, expr, .. }))) =
        (program.steps.pop(), program.steps.pop())
    else {
        return false;
    };
    if let Step::Row(Row { x, .. }) | Step::Segment(Segment { x, .. }) = &mut reader {
        *x = Fusion { inputs, expr };
    }
    program.steps.push(reader);
    true
}

/// Folds the last two steps, a GEMM and a pointwise step that reads its output element
/// for element, into the GEMM (the pointwise step becomes its epilogue, computed in
/// place in the pointwise step's buffer). Returns whether it did.
pub(crate) fn fold_epilogue(program: &mut Program) -> bool {
    let [.., Step::Gemm(Gemm {
        out: written,
        rows: gemm_rows,
        n,
        epilogue: None,
        ..
    }), Step::Pointwise(Pointwise {
        rows,
        width,
        inputs,
        ..
    })] = &program.steps[..]
    else {
        return false;
    };
    let identity = Access::rows(*written, *width);
    let fits = gemm_rows == rows
        && n == width
        && inputs
            .iter()
            .all(|access| access.slot != *written || *access == identity);
    if !fits {
        return false;
    }
    let Some(Step::Pointwise(Pointwise {
        out, inputs, expr, ..
    })) = program.steps.pop()
    else {
        return false;
    };
    let Some(Step::Gemm(Gemm {
        out: gemm_out,
        bias,
        n,
        epilogue,
        ..
    })) = program.steps.last_mut()
    else {
        return false;
    };
    // The GEMM now writes the pointwise step's buffer, and the expression reads the
    // GEMM's result there, where it writes it.
    let written = *gemm_out;
    let reads_result: Vec<bool> = inputs.iter().map(|access| access.slot == written).collect();
    let mut inputs: Vec<Access> = inputs
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
    // The bias moves into the epilogue: its reads of the result become `result + bias`
    // (the same sum the GEMM made), so that the product is written once and the bias
    // added in the epilogue's pass over the rows, not in a pass of its own before it.
    let expr = match bias.take() {
        Some(bias) => {
            let bias_input = inputs.len();
            inputs.push(Access {
                row_stride: 0,
                ..Access::rows(bias, *n)
            });
            expr.with_loads(&|input| {
                if reads_result.get(input) == Some(&true) {
                    Expr::Binary(
                        BinaryOp::Add,
                        Box::new(Expr::Load(input)),
                        Box::new(Expr::Load(bias_input)),
                    )
                } else {
                    Expr::Load(input)
                }
            })
        }
        None => expr,
    };
    *gemm_out = out;
    *epilogue = Some(Fusion { inputs, expr });
    true
}
