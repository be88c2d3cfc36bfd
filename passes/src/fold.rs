//! Kernel fusion in the lowering of `prologue` and `epilogue` ops: the two steps such an
//! op lowers to (a pointwise step and the kernel next to it) become one kernel. A
//! prologue becomes the input expression of a row kernel (residual add + layer_norm,
//! scale + softmax) or a segmented one (gelu + segment mean); an epilogue runs on each
//! chunk of GEMM (or convolution) rows while they are in cache (bias + relu, residual
//! add). Either way one launch and one pass over memory are saved. Where the kernel
//! would read the pointwise result other than element for element as written, the two
//! steps stay (the result is the same, one launch more). [`fold_epilogues`] does the
//! same on a whole program for the GEMMs and convolutions of ops the optimizer's
//! epilogue rule does not take.
use nestor_ir::BinaryOp;

use crate::operands::{Access, Expr, Fusion, RowBase, Rows, Slot, WindowKind};
use crate::program::{Program, Source};
use crate::step::Step;
use crate::step::{Gemm, Pointwise, Row, Segment, Window};

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

/// Folds the last two steps, a GEMM (or a convolution) and a pointwise step that reads
/// its output element for element, into the GEMM (the pointwise step becomes its
/// epilogue, computed in place in the pointwise step's buffer). Returns whether it did.
pub(crate) fn fold_epilogue(program: &mut Program) -> bool {
    match program.steps.len().checked_sub(2) {
        Some(product) => fold_epilogue_at(program, product),
        None => false,
    }
}

/// Folds every pointwise step into the GEMM or convolution whose result it alone
/// reads, element for element, where that step can move down to just before it (no
/// step between writes what the product reads): the pattern of a convolution (1x1 as
/// a GEMM, else a window step), its batch norm's per-channel scale and shift computed
/// after it, then the normalization and relu (and residual add) over its result,
/// which the optimizer's epilogue rule (linear and matmul cores only) does not fuse.
/// The product's rows then go through the expression while they are in cache: one
/// pass over memory less.
pub(crate) fn fold_epilogues(program: &mut Program) {
    let mut index = 0;
    while index < program.steps.len() {
        if let Some(product) = foldable_product(program, index) {
            let moved = program.steps.remove(product);
            program.steps.insert(index - 1, moved);
            if fold_epilogue_at(program, index - 1) {
                // The pointwise step is gone: `index` is the next step now.
                continue;
            }
        }
        index += 1;
    }
}

/// What a step that takes epilogues writes, for [`fits`]: its result, the result's
/// rows and width, and whether it has an epilogue already.
struct Product {
    out: Slot,
    rows: Rows,
    width: i64,
    finished: bool,
}

/// The [`Product`] of `step` when it takes an epilogue: a GEMM, or a convolution or
/// its input gradient (rows of output pixels).
fn product_of(step: &Step, program: &Program) -> Option<Product> {
    match step {
        Step::Gemm(gemm) => Some(Product {
            out: gemm.out,
            rows: gemm.rows,
            width: gemm.n,
            finished: gemm.epilogue.is_some(),
        }),
        Step::Window(window)
            if matches!(window.kind, WindowKind::Conv | WindowKind::ConvInputGrad) =>
        {
            Some(Product {
                out: window.out,
                rows: program.info(window.out).rows,
                width: window.width,
                finished: window.epilogue.is_some(),
            })
        }
        _ => None,
    }
}

/// The earlier product (GEMM or convolution) that step `index`, a pointwise step, can
/// take as its producer ([`fold_epilogues`]): the last step writing one of its inputs,
/// a product without an epilogue whose result no other step, output or alias reads,
/// whose memory and operands no step between writes, and whose rows and columns are
/// the step's. A GEMM before a convolution where both are: the sum of a bottleneck's
/// last 1x1 convolution and its strided shortcut took twice as long (7 ms against 3.3
/// in ResNet-50's second stage) in the shortcut's epilogue as in the GEMM's.
fn foldable_product(program: &Program, index: usize) -> Option<usize> {
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
            let product = product_of(&program.steps[writer], program)?;
            let result = product.out;
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
            if !alone || !fits(&product, pointwise) {
                return None;
            }
            // Every slot the product names (operands, lengths, result), by memory.
            let mut named = Vec::new();
            program.steps[writer]
                .clone()
                .kind_mut()
                .visit_slots(&mut |slot| named.push(root(*slot)));
            let untouched = program.steps[writer + 1..index]
                .iter()
                .all(|step| step.outputs().all(|out| !named.contains(&root(out))));
            untouched.then_some((matches!(program.steps[writer], Step::Gemm(_)), writer))
        })
        .max()
        .map(|(_, writer)| writer)
}

/// Whether `pointwise` reads `product`'s result element for element over the
/// product's rows and columns (its other inputs may be anything).
fn fits(product: &Product, pointwise: &Pointwise) -> bool {
    let identity = Access::rows(product.out, pointwise.width);
    !product.finished
        && product.rows == pointwise.rows
        && product.width == pointwise.width
        && pointwise
            .inputs
            .iter()
            .all(|access| access.slot != product.out || *access == identity)
}

/// Folds steps `at` and `at + 1` of `program`, a product (GEMM or convolution) and a
/// pointwise step that reads its output element for element ([`fits`]), into the
/// product. Returns whether it did.
fn fold_epilogue_at(program: &mut Program, at: usize) -> bool {
    let (Some(product), Some(Step::Pointwise(pointwise))) = (
        program
            .steps
            .get(at)
            .and_then(|step| product_of(step, program)),
        program.steps.get(at + 1),
    ) else {
        return false;
    };
    if !fits(&product, pointwise) {
        return false;
    }
    let Step::Pointwise(Pointwise {
        out, inputs, expr, ..
    }) = program.steps.remove(at + 1)
    else {
        return false;
    };
    let (product_out, bias, epilogue) = match program.steps.get_mut(at) {
        Some(Step::Gemm(Gemm {
            out,
            bias,
            epilogue,
            ..
        }))
        | Some(Step::Window(Window {
            out,
            bias,
            epilogue,
            ..
        })) => (out, bias, epilogue),
        _ => return false,
    };
    // The product now writes the pointwise step's buffer, and the expression reads the
    // product's result there, where it writes it.
    let written = *product_out;
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
    // (the same sum the product made), so that the product is written once and the
    // bias added in the epilogue's pass over the rows, not in a pass of its own before
    // it.
    let expr = match bias.take() {
        Some(bias) => {
            let bias_input = inputs.len();
            inputs.push(Access {
                row_stride: 0,
                ..Access::rows(bias, product.width)
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
    *product_out = out;
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

    /// `out = conv(x)` with a bias (a 1x1 window over the images of lengths slot 2), or
    /// `kind` over the same windows.
    fn window(kind: WindowKind, out: u32, x: u32) -> Step {
        let conv = kind == WindowKind::Conv;
        Step::Window(Window {
            kind,
            out: Slot(out),
            x: Slot(x),
            weight: conv.then_some(Slot(1)),
            bias: conv.then_some(Slot(2)),
            grad: None,
            heights: Slot(2),
            widths: Slot(2),
            channels: if conv { 3 } else { 2 },
            width: 2,
            window: nestor_ir::Window2d {
                kernel: [1, 1],
                stride: [1, 1],
                padding: [0, 0],
                dilation: [1, 1],
            },
            groups: 1,
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

    /// A convolution folds its pointwise step as a GEMM does, its bias moving into the
    /// epilogue (`relu((result + bias) + p)`); a pooling window takes none.
    #[test]
    fn a_convolution_takes_the_pointwise_step_it_alone_feeds() {
        let broadcast = Access {
            row_stride: 0,
            ..Access::rows(Slot(4), 2)
        };
        let sum = Expr::Unary(UnaryOp::Relu, Box::new(add(0, 1)));
        let steps = |kind| {
            vec![
                window(kind, 3, 0),
                pointwise(4, rows(1), vec![Access::rows(Slot(2), 2)], relu(0)),
                pointwise(
                    5,
                    rows(4),
                    vec![Access::rows(Slot(3), 2), broadcast],
                    sum.clone(),
                ),
            ]
        };
        let mut program = program(steps(WindowKind::Conv), 5);
        fold_epilogues(&mut program);
        let [Step::Pointwise(first), Step::Window(folded)] = &program.steps[..] else {
            panic!("{:#?}", program.steps);
        };
        assert_eq!(first.out, Slot(4));
        assert_eq!(
            folded.out,
            Slot(5),
            "the convolution writes the epilogue's buffer"
        );
        assert_eq!(folded.bias, None, "the bias is added in the epilogue");
        let epilogue = folded.epilogue.as_ref().expect("an epilogue");
        let bias = Access {
            row_stride: 0,
            ..Access::rows(Slot(2), 2)
        };
        assert_eq!(epilogue.inputs, [Access::rows(Slot(5), 2), broadcast, bias]);
        let biased = Expr::Binary(
            BinaryOp::Add,
            Box::new(Expr::Load(0)),
            Box::new(Expr::Load(2)),
        );
        let expected = Expr::Unary(
            UnaryOp::Relu,
            Box::new(Expr::Binary(
                BinaryOp::Add,
                Box::new(biased),
                Box::new(Expr::Load(1)),
            )),
        );
        assert_eq!(epilogue.expr, expected);

        let pooled = self::program(steps(WindowKind::Max), 5);
        let mut folded = pooled.clone();
        fold_epilogues(&mut folded);
        assert_eq!(folded.steps, pooled.steps);
    }

    /// Where a GEMM and a convolution both could take a sum of their results, the GEMM
    /// does (it moves down past the convolution).
    #[test]
    fn a_gemm_takes_a_sum_before_a_convolution_does() {
        let steps = vec![
            gemm(3, 0),
            window(WindowKind::Conv, 4, 0),
            pointwise(
                5,
                rows(4),
                vec![Access::rows(Slot(3), 2), Access::rows(Slot(4), 2)],
                add(0, 1),
            ),
        ];
        let mut program = program(steps, 5);
        fold_epilogues(&mut program);
        let [Step::Window(conv), Step::Gemm(gemm)] = &program.steps[..] else {
            panic!("{:#?}", program.steps);
        };
        assert!(conv.epilogue.is_none());
        assert_eq!(gemm.out, Slot(5));
        assert!(gemm.epilogue.is_some());
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
