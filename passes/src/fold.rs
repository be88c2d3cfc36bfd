//! Kernel fusion in the lowering of `prologue` and `epilogue` ops: the two steps such an
//! op lowers to (a pointwise step and the kernel next to it) become one kernel. A
//! prologue becomes the input expression of a row kernel (residual add + layer_norm,
//! scale + softmax) or a segmented one (gelu + segment mean); an epilogue runs on each
//! chunk of GEMM rows while they are in cache (bias + relu, residual add). Either way
//! one launch and one pass over memory are saved. Where the kernel would read the
//! pointwise result other than element for element as written, the two steps stay
//! (the result is the same, one launch more). [`fold_epilogues`] does the same on a
//! whole program for the GEMMs of ops the optimizer's epilogue rule does not take.

use nestor_ir::BinaryOp;

use crate::operands::{Access, Expr, Fusion, RowBase, Rows, Slot};
use crate::program::{Program, Source};
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
    match program.steps.len().checked_sub(2) {
        Some(gemm) => fold_epilogue_at(&mut program.steps, gemm),
        None => false,
    }
}

/// Folds every pointwise step into the GEMM whose result it alone reads, element for
/// element, where that GEMM can move down to just before it (no step between writes
/// what the GEMM reads): the pattern of a 1x1 convolution, its batch norm's per-channel
/// scale and shift computed after it, then the normalization and relu (and residual
/// add) over its result, which the optimizer's epilogue rule (linear and matmul cores
/// only) does not fuse. The GEMM's rows then go through the expression while they are
/// in cache: one pass over memory less.
pub(crate) fn fold_epilogues(program: &mut Program) {
    let mut index = 0;
    while index < program.steps.len() {
        if let Some(gemm) = foldable_gemm(program, index) {
            let moved = program.steps.remove(gemm);
            program.steps.insert(index - 1, moved);
            if fold_epilogue_at(&mut program.steps, index - 1) {
                // The pointwise step is gone: `index` is the next step now.
                continue;
            }
        }
        index += 1;
    }
}

/// The earlier GEMM that step `index`, a pointwise step, can take as its producer
/// ([`fold_epilogues`]): the last step writing one of its inputs, a GEMM without an
/// epilogue whose result no other step, output or alias reads, whose memory and
/// operands no step between writes, and whose rows and columns are the step's.
fn foldable_gemm(program: &Program, index: usize) -> Option<usize> {
    let Step::Pointwise(pointwise) = &program.steps[index] else {
        return None;
    };
    let root = |slot: Slot| program.root(slot);
    pointwise
        .inputs
        .iter()
        .filter_map(|access| {
            let memory = root(access.slot);
            let writer = program.steps[..index]
                .iter()
                .rposition(|step| step.outputs().any(|out| root(out) == memory))?;
            let Step::Gemm(gemm) = &program.steps[writer] else {
                return None;
            };
            let result = gemm.out;
            let info = program.info(result);
            let alone = result == memory
                && !info.integers
                && info.dtype == program.info(pointwise.out).dtype
                && !program
                    .outputs
                    .iter()
                    .any(|output| root(output.slot()) == memory)
                && !program
                    .slots
                    .iter()
                    .any(|info| info.source == Source::Alias(memory))
                && program
                    .steps
                    .iter()
                    .enumerate()
                    .all(|(at, step)| at == index || !step.reads().contains(&memory));
            if !alone || !fits(gemm, pointwise) {
                return None;
            }
            // Every slot the GEMM names (operands, lengths, result), by memory.
            let mut named = Vec::new();
            Step::Gemm(gemm.clone())
                .kind_mut()
                .visit_slots(&mut |slot| named.push(root(*slot)));
            let untouched = program.steps[writer + 1..index]
                .iter()
                .all(|step| step.outputs().all(|out| !named.contains(&root(out))));
            untouched.then_some(writer)
        })
        .max()
}

/// Whether `pointwise` reads `gemm`'s result element for element over the GEMM's rows
/// and columns (its other inputs may be anything).
fn fits(gemm: &Gemm, pointwise: &Pointwise) -> bool {
    let identity = Access::rows(gemm.out, pointwise.width);
    gemm.epilogue.is_none()
        && gemm.rows == pointwise.rows
        && gemm.n == pointwise.width
        && pointwise
            .inputs
            .iter()
            .all(|access| access.slot != gemm.out || *access == identity)
}

/// Folds steps `gemm` and `gemm + 1` of `steps`, a GEMM and a pointwise step that
/// reads its output element for element ([`fits`]), into the GEMM. Returns whether it
/// did.
fn fold_epilogue_at(steps: &mut Vec<Step>, gemm: usize) -> bool {
    let (Some(Step::Gemm(producer)), Some(Step::Pointwise(pointwise))) =
        (steps.get(gemm), steps.get(gemm + 1))
    else {
        return false;
    };
    if !fits(producer, pointwise) {
        return false;
    }
    let Step::Pointwise(Pointwise {
        out, inputs, expr, ..
    }) = steps.remove(gemm + 1)
    else {
        return false;
    };
    let Some(Step::Gemm(Gemm {
        out: gemm_out,
        bias,
        n,
        epilogue,
        ..
    })) = steps.get_mut(gemm)
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

#[cfg(test)]
mod tests {
    use nestor_ir::{DType, UnaryOp};

    use super::*;
    use crate::program::{Output, SlotInfo};

    /// Rows of the test programs' buffers: a static count.
    const fn rows(count: i64) -> Rows {
        Rows {
            base: RowBase::One,
            factor: count,
        }
    }

    /// A program whose steps read inputs `x [4 x 3]`, `w [2 x 3]` and `p [1 x 2]`
    /// (slots 0 to 2) and make slots from 3 on, `[4 x 2]` but for `p`'s.
    fn program(steps: Vec<Step>, output: u32) -> Program {
        let info = |rows, width, source| SlotInfo {
            dtype: DType::F32,
            rows,
            width,
            source,
            integers: false,
        };
        let mut program = Program::default();
        for (input, (count, width)) in [(4, 3), (2, 3), (1, 2)].into_iter().enumerate() {
            program.slot(info(self::rows(count), width, Source::Input(input)));
        }
        for _ in 0..4 {
            program.slot(info(self::rows(4), 2, Source::Step));
        }
        program.steps = steps;
        program.outputs.push(Output::Scalar { slot: Slot(output) });
        program
    }

    /// `out = x w^T` (the GEMM of the test programs).
    fn gemm(out: u32, x: u32) -> Step {
        Step::Gemm(Gemm {
            out: Slot(out),
            x: Slot(x),
            weight: Slot(1),
            bias: None,
            rows: rows(4),
            k: 3,
            n: 2,
            transposed: false,
            epilogue: None,
        })
    }

    /// A pointwise step `out = expr(inputs)` over `[rows x 2]`.
    fn pointwise(out: u32, rows: Rows, inputs: Vec<Access>, expr: Expr) -> Step {
        Step::Pointwise(Pointwise {
            out: Slot(out),
            rows,
            width: 2,
            inputs,
            expr,
        })
    }

    fn relu(input: usize) -> Expr {
        Expr::Unary(UnaryOp::Relu, Box::new(Expr::Load(input)))
    }

    fn add(a: usize, b: usize) -> Expr {
        Expr::Binary(
            BinaryOp::Add,
            Box::new(Expr::Load(a)),
            Box::new(Expr::Load(b)),
        )
    }

    /// The GEMM, a step of `p` after it, then `relu(result + p)` over the result: the
    /// GEMM moves down past the step of `p` and takes the last step as its epilogue.
    #[test]
    fn a_gemm_moves_down_to_the_pointwise_step_it_alone_feeds() {
        let broadcast = Access {
            row_stride: 0,
            ..Access::rows(Slot(4), 2)
        };
        let sum = Expr::Unary(UnaryOp::Relu, Box::new(add(0, 1)));
        let mut program = program(
            vec![
                gemm(3, 0),
                pointwise(4, rows(1), vec![Access::rows(Slot(2), 2)], relu(0)),
                pointwise(5, rows(4), vec![Access::rows(Slot(3), 2), broadcast], sum),
            ],
            5,
        );
        fold_epilogues(&mut program);
        let [Step::Pointwise(first), Step::Gemm(folded)] = &program.steps[..] else {
            panic!("{:#?}", program.steps);
        };
        assert_eq!(first.out, Slot(4));
        assert_eq!(folded.out, Slot(5), "the GEMM writes the epilogue's buffer");
        let epilogue = folded.epilogue.as_ref().expect("an epilogue");
        assert_eq!(epilogue.inputs[0], Access::rows(Slot(5), 2));
        assert_eq!(epilogue.inputs[1], broadcast);
    }

    /// Where the GEMM cannot move down (a step between writes its operand) or its result
    /// has another reader, the steps stay as they were.
    #[test]
    fn a_gemm_stays_where_moving_or_folding_it_would_change_a_value() {
        let copy = |out, from| pointwise(out, rows(4), vec![Access::rows(Slot(from), 2)], relu(0));
        let scaled = Expr::Binary(
            BinaryOp::Mul,
            Box::new(Expr::Load(0)),
            Box::new(Expr::Load(0)),
        );
        let overwritten = vec![
            // `x' = relu(x)`; `y = x' w^T`; `x'` squared in place; `relu(y)`.
            pointwise(3, rows(4), vec![Access::rows(Slot(0), 3)], relu(0)),
            gemm(4, 3),
            pointwise(3, rows(4), vec![Access::rows(Slot(3), 2)], scaled),
            copy(5, 4),
        ];
        let read_twice = vec![gemm(3, 0), copy(4, 3), copy(5, 3)];
        let returned = vec![gemm(3, 0), copy(4, 3)];
        for (steps, output) in [(overwritten, 5), (read_twice, 5), (returned, 3)] {
            let mut folded = program(steps.clone(), output);
            fold_epilogues(&mut folded);
            assert_eq!(folded.steps, steps);
        }
    }
}
