//! Per-column scales moved out of products' operands: `y = x * v` (`v` one value a
//! column) read only as a GEMM's input and a row sum's left operand becomes a scaled
//! weight (`(x v) W^T = x (W v)^T`, `W` a few kilobytes) and a scaled sum
//! (`(x v)^T b = v (x^T b)`, a row of the sum per column of `x`). The pass over `y`,
//! which reads and writes a buffer of the batch's size, is gone: in training with batch
//! norm on running statistics, the gradient of a convolution's output through the norm
//! (`g * weight / sqrt(var + eps)`) is such a `y`, read by the convolution's input and
//! weight gradients, and its passes took a twelfth of a ResNet-50 training step. A
//! convolution's gradients take it the same way: its input gradient reads `x` through
//! the forward weight scaled a row (an output channel), its weight gradient's rows are
//! scaled after it.

use nestor_ir::BinaryOp;

use crate::operands::{Access, Expr, RowBase, Rows, Slot, WindowKind};
use crate::program::{Program, SlotInfo, Source};
use crate::step::{Pointwise, Step, Window};

/// Moves the per-column scales of products' operands into the products (see the
/// module's doc), where every reader of the scaled values is such a product.
pub(crate) fn scale_into_products(program: &mut Program) {
    let mut index = 0;
    while index < program.steps.len() {
        match scaling(program, index) {
            Some(scaling) => apply(program, index, scaling),
            None => index += 1,
        }
    }
}

/// A step `y = x * v` whose scale moves into its readers.
struct Scaling {
    /// `y`.
    scaled: Slot,
    /// `x`.
    x: Slot,
    /// `v`, a value per column of `x`.
    scale: Slot,
}

/// The [`Scaling`] of step `index`, if it is one: a pointwise product of a buffer, read
/// element for element, and a vector, read once a column; its result read only as
/// GEMMs' inputs (contracted over its columns) and row sums' left operands, and none of
/// its operands written again after it.
fn scaling(program: &Program, index: usize) -> Option<Scaling> {
    let Step::Pointwise(pointwise) = &program.steps[index] else {
        return None;
    };
    let (first, second) = pointwise.product_of_loads()?;
    let Pointwise {
        out,
        rows,
        width,
        inputs,
        ..
    } = pointwise;
    let per_column = |access: &Access| {
        access.row_stride == 0
            && access.col_stride == 1
            && access.offset == 0
            && access.row_map.is_none()
            && access.col_modulo == 0
            && access.digits.is_none()
            && {
                // A vector of one value a column.
                let vector = program.info(access.slot);
                vector.rows.base == RowBase::One
                    && vector.rows.factor.checked_mul(vector.width) == Some(*width)
            }
    };
    let whole = |access: &Access| *access == Access::rows(access.slot, *width);
    let (x, scale) = match (&inputs[first], &inputs[second]) {
        (x, scale) if whole(x) && per_column(scale) => (x.slot, scale.slot),
        (scale, x) if whole(x) && per_column(scale) => (x.slot, scale.slot),
        _ => return None,
    };
    let root = |slot: Slot| program.root(slot);
    let aliased = |slot: Slot| {
        program
            .outputs
            .iter()
            .any(|output| root(output.slot()) == slot)
            || program
                .slots
                .iter()
                .any(|info| info.source == Source::Alias(slot))
    };
    let info = program.info(*out);
    if info.integers || aliased(*out) || root(*out) != *out {
        return None;
    }
    // Nothing after the step writes its operands or its result again.
    let operands = [root(x), root(scale), *out];
    let later = &program.steps[index + 1..];
    if later.iter().any(|step| {
        step.outputs()
            .any(|written| operands.contains(&root(written)))
    }) {
        return None;
    }
    let mut read = false;
    for step in later {
        if !step.reads().contains(out) {
            continue;
        }
        read = true;
        let takes = match step {
            Step::Gemm(gemm) => {
                gemm.x == *out
                    && gemm.weight != *out
                    && gemm.bias != Some(*out)
                    && gemm.k == *width
                    && gemm.rows == *rows
                    && gemm
                        .epilogue
                        .as_ref()
                        .is_none_or(|fusion| fusion.inputs.iter().all(|a| a.slot != *out))
            }
            Step::SumRows(sum) => {
                sum.a == Some(*out) && sum.b != *out && sum.m == *width && sum.rows == *rows
            }
            Step::Window(window) => window_takes(program, window, *out, *width),
            _ => false,
        };
        if !takes {
            return None;
        }
    }
    read.then_some(Scaling {
        scaled: *out,
        x,
        scale,
    })
}

/// Whether `window` takes the scale of `scaled` (`width` columns, a convolution's output
/// gradient): an input gradient reading it as its pixels (through the forward weight
/// `[channels, ...]`, whose rows then take the scale), or a weight gradient reading it
/// as its gradient (its rows, one an output channel, scaled after it); nothing else of
/// the step reading it.
fn window_takes(program: &Program, window: &Window, scaled: Slot, width: i64) -> bool {
    let epilogue_reads = window
        .epilogue
        .as_ref()
        .is_some_and(|fusion| fusion.inputs.iter().any(|a| a.slot == scaled));
    if epilogue_reads || window.bias == Some(scaled) || window.weight == Some(scaled) {
        return false;
    }
    match window.kind {
        WindowKind::ConvInputGrad | WindowKind::StridedConvInputGrad => {
            let weight_rows = window.weight.map(|weight| program.info(weight).rows);
            window.x == scaled
                && window.grad != Some(scaled)
                && window.channels == width
                && weight_rows == Some(Rows::fixed(width))
        }
        WindowKind::WeightGrad => {
            window.grad == Some(scaled)
                && window.x != scaled
                && window.width == width
                && program.info(window.out).rows == Rows::fixed(width)
        }
        _ => false,
    }
}

/// Removes step `index`, `scaling`'s, and moves its scale into its readers: each GEMM
/// reads `x` through a weight scaled before it, each row sum's rows are scaled after it.
fn apply(program: &mut Program, index: usize, scaling: Scaling) {
    let Scaling { scaled, x, scale } = scaling;
    let steps = std::mem::take(&mut program.steps);
    let mut rewritten = Vec::with_capacity(steps.len() + 2);
    for (at, step) in steps.into_iter().enumerate() {
        if at == index {
            continue;
        }
        match step {
            Step::Gemm(mut gemm) if at > index && gemm.x == scaled => {
                // `W [n, k]`: a scale a column; transposed `[k, n]`: a scale a row.
                let (step, weight) = scaled_weight(program, gemm.weight, scale, gemm.transposed);
                rewritten.push(step);
                gemm.x = x;
                gemm.weight = weight;
                rewritten.push(Step::Gemm(gemm));
            }
            Step::SumRows(mut sum) if at > index && sum.a == Some(scaled) => {
                // `out [m, n]`: row `i` scaled by `v[i]`.
                let outs = unscaled_out(program, &mut sum.out);
                sum.a = Some(x);
                rewritten.push(Step::SumRows(sum));
                rewritten.push(scaled_rows(program, outs, scale));
            }
            Step::Window(mut window) if at > index && window.grad == Some(scaled) => {
                // A weight gradient `[width, channels * taps]`: row `o` scaled by `v[o]`.
                let outs = unscaled_out(program, &mut window.out);
                window.grad = Some(x);
                rewritten.push(Step::Window(window));
                rewritten.push(scaled_rows(program, outs, scale));
            }
            Step::Window(mut window) if at > index && window.x == scaled => {
                // An input gradient reads `x` through the forward weight `[channels,
                // width / groups * taps]` scaled a row.
                if let Some(weight) = window.weight {
                    let (step, weight) = scaled_weight(program, weight, scale, true);
                    rewritten.push(step);
                    window.weight = Some(weight);
                }
                window.x = x;
                rewritten.push(Step::Window(window));
            }
            step => rewritten.push(step),
        }
    }
    program.steps = rewritten;
}

/// The step that scales `weight` by `scale` (a value a row when `by_rows`, else a
/// column) into a new slot shaped as it, and that slot.
fn scaled_weight(program: &mut Program, weight: Slot, scale: Slot, by_rows: bool) -> (Step, Slot) {
    let info = program.info(weight).clone();
    let scaled = program.slot(SlotInfo {
        source: Source::Step,
        ..info.clone()
    });
    let step = multiply(
        scaled,
        (info.rows, info.width),
        [
            Access::rows(weight, info.width),
            spread(scale, info.width, by_rows),
        ],
    );
    (step, scaled)
}

/// Points `out` at a new slot shaped as it, the unscaled result the step now writes:
/// `(old out, unscaled)`, which [`scaled_rows`] then reads and writes.
fn unscaled_out(program: &mut Program, out: &mut Slot) -> (Slot, Slot) {
    let result = program.info(*out).clone();
    let unscaled = program.slot(SlotInfo {
        source: Source::Step,
        ..result
    });
    (std::mem::replace(out, unscaled), unscaled)
}

/// `out = unscaled * v` row by row (`v[i]` for row `i`).
fn scaled_rows(program: &Program, (out, unscaled): (Slot, Slot), scale: Slot) -> Step {
    let result = program.info(out);
    multiply(
        out,
        (result.rows, result.width),
        [
            Access::rows(unscaled, result.width),
            spread(scale, result.width, true),
        ],
    )
}

/// The vector `scale` read over rows of `width`: a value a row (`by_rows`), else a
/// value a column.
fn spread(scale: Slot, width: i64, by_rows: bool) -> Access {
    let (row_stride, col_stride) = if by_rows { (1, 0) } else { (0, 1) };
    Access {
        row_stride,
        col_stride,
        ..Access::rows(scale, width)
    }
}

/// The pointwise step `out = a * b` over `rows` of `width`.
fn multiply(out: Slot, (rows, width): (Rows, i64), [a, b]: [Access; 2]) -> Step {
    Step::Pointwise(Pointwise {
        out,
        rows,
        width,
        inputs: vec![a, b],
        expr: Expr::Binary(
            BinaryOp::Mul,
            Box::new(Expr::Load(0)),
            Box::new(Expr::Load(1)),
        ),
    })
}

#[cfg(test)]
mod tests {
    use nestor_ir::DType;

    use super::*;
    use crate::program::Output;
    use crate::step::{Gemm, SumRows};

    fn rows(count: i64) -> Rows {
        Rows::fixed(count)
    }

    /// Slots: 0 `x [6 x 4]`, 1 `v [4 x 1]`, 2 `W [3 x 4]`, 3 `b [6 x 5]` (inputs), then
    /// 4 `y [6 x 4]`, 5 `x W^T [6 x 3]`, 6 `y^T b [4 x 5]`, 7 `[6 x 4]`.
    fn program(steps: Vec<Step>, outputs: &[u32]) -> Program {
        let mut program = Program::default();
        let shapes = [
            (6, 4),
            (4, 1),
            (3, 4),
            (6, 5),
            (6, 4),
            (6, 3),
            (4, 5),
            (6, 4),
        ];
        for (index, (count, width)) in shapes.into_iter().enumerate() {
            program.slot(SlotInfo {
                dtype: DType::F32,
                rows: rows(count),
                width,
                source: if index < 4 {
                    Source::Input(index)
                } else {
                    Source::Step
                },
                integers: false,
            });
        }
        program.steps = steps;
        for &slot in outputs {
            program.outputs.push(Output::Scalar { slot: Slot(slot) });
        }
        program
    }

    /// `y = x * v` (`v` broadcast over the rows; its operands in either order).
    fn scale_step(swapped: bool) -> Step {
        let x = Access::rows(Slot(0), 4);
        let v = Access {
            row_stride: 0,
            ..Access::rows(Slot(1), 4)
        };
        let inputs = if swapped { vec![v, x] } else { vec![x, v] };
        multiply(Slot(4), (rows(6), 4), [inputs[0], inputs[1]])
    }

    fn gemm(x: u32, transposed: bool) -> Step {
        Step::Gemm(Gemm {
            out: Slot(5),
            x: Slot(x),
            weight: Slot(2),
            bias: None,
            rows: rows(6),
            k: 4,
            n: 3,
            transposed,
            epilogue: None,
        })
    }

    fn sum_rows(a: u32) -> Step {
        Step::SumRows(SumRows {
            out: Slot(6),
            a: Some(Slot(a)),
            b: Slot(3),
            times: None,
            plain: None,
            rows: rows(6),
            m: 4,
            n: 5,
            mean: false,
        })
    }

    /// A scale read by a GEMM and a row sum moves into them: the GEMM reads `x` through
    /// the weight scaled a column (a row when transposed), the row sum of `x` is scaled
    /// a row into the old result.
    #[test]
    fn a_scale_read_by_products_moves_into_them() {
        for (swapped, transposed) in [(false, false), (true, true)] {
            let mut program = program(
                vec![scale_step(swapped), gemm(4, transposed), sum_rows(4)],
                &[5, 6],
            );
            scale_into_products(&mut program);
            let [Step::Pointwise(weight), Step::Gemm(gemm), Step::SumRows(sum), Step::Pointwise(rows_scaled)] =
                &program.steps[..]
            else {
                panic!("{:#?}", program.steps);
            };
            assert_eq!((gemm.x, gemm.weight), (Slot(0), weight.out));
            assert_eq!(weight.inputs[0], Access::rows(Slot(2), 4));
            let expected = Access {
                row_stride: i64::from(transposed),
                col_stride: i64::from(!transposed),
                ..Access::rows(Slot(1), 4)
            };
            assert_eq!(weight.inputs[1], expected);
            assert_eq!((sum.a, rows_scaled.out), (Some(Slot(0)), Slot(6)));
            assert_eq!(rows_scaled.inputs[0], Access::rows(sum.out, 5));
            assert_eq!(
                rows_scaled.inputs[1],
                Access {
                    row_stride: 1,
                    col_stride: 0,
                    ..Access::rows(Slot(1), 5)
                }
            );
        }
    }

    /// A scale read by a convolution's input and weight gradients moves into them: the
    /// input gradient reads `x` through the forward weight scaled a row (an output
    /// channel), the weight gradient's rows are scaled after it.
    #[test]
    fn a_scale_read_by_convolution_gradients_moves_into_them() {
        // Slots 0-4 as above but 2 `W [4 x 27]` (3x3 taps of 3 channels) and 3 the
        // forward's input `[6 x 3]`; 5 `dx [6 x 3]`, 6 `dW [4 x 27]`, 7-8 image sizes.
        let mut program = program(vec![], &[5, 6]);
        for (slot, (count, width)) in [(2, (4, 27)), (3, (6, 3)), (5, (6, 3)), (6, (4, 27))] {
            program.slots[slot].rows = rows(count);
            program.slots[slot].width = width;
        }
        let window = |kind, out, x, weight, grad, (channels, width)| {
            Step::Window(Window {
                kind,
                out: Slot(out),
                x: Slot(x),
                weight,
                bias: None,
                grad,
                heights: Slot(7),
                widths: Slot(7),
                channels,
                width,
                window: nestor_ir::Window2d {
                    kernel: [3, 3],
                    stride: [1, 1],
                    padding: [1, 1],
                    dilation: [1, 1],
                },
                groups: 1,
                epilogue: None,
            })
        };
        program.steps = vec![
            scale_step(false),
            window(WindowKind::ConvInputGrad, 5, 4, Some(Slot(2)), None, (4, 3)),
            window(WindowKind::WeightGrad, 6, 3, None, Some(Slot(4)), (3, 4)),
        ];
        scale_into_products(&mut program);
        let [Step::Pointwise(weight), Step::Window(input_grad), Step::Window(weight_grad), Step::Pointwise(rows_scaled)] =
            &program.steps[..]
        else {
            panic!("{:#?}", program.steps);
        };
        let by_rows = |slot| Access {
            row_stride: 1,
            col_stride: 0,
            ..Access::rows(slot, 27)
        };
        assert_eq!(weight.inputs, [Access::rows(Slot(2), 27), by_rows(Slot(1))]);
        assert_eq!(
            (input_grad.x, input_grad.weight),
            (Slot(0), Some(weight.out))
        );
        assert_eq!((weight_grad.x, weight_grad.grad), (Slot(3), Some(Slot(0))));
        assert_eq!(rows_scaled.out, Slot(6));
        assert_eq!(
            rows_scaled.inputs,
            [Access::rows(weight_grad.out, 27), by_rows(Slot(1))]
        );
    }

    /// The scale stays where something else reads `y` (a pointwise step, a GEMM's
    /// weight), where `y` is returned, or where `x` is written after it.
    #[test]
    fn a_scale_read_otherwise_stays() {
        let copy = |out, from| {
            Step::Pointwise(Pointwise {
                out: Slot(out),
                rows: rows(6),
                width: 4,
                inputs: vec![Access::rows(Slot(from), 4)],
                expr: Expr::Load(0),
            })
        };
        let as_weight = Step::Gemm(Gemm {
            weight: Slot(4),
            x: Slot(0),
            ..match gemm(0, false) {
                Step::Gemm(gemm) => gemm,
                _ => unreachable!("a GEMM"),
            }
        });
        for (steps, outputs) in [
            (
                vec![scale_step(false), gemm(4, false), copy(7, 4)],
                &[5, 7][..],
            ),
            (vec![scale_step(false), sum_rows(4), as_weight], &[5, 6][..]),
            (vec![scale_step(false), gemm(4, false)], &[4, 5][..]),
            (
                vec![scale_step(false), copy(0, 7), gemm(4, false)],
                &[5][..],
            ),
        ] {
            let mut scaled = program(steps.clone(), outputs);
            scale_into_products(&mut scaled);
            assert_eq!(scaled.steps, steps);
        }
    }
}
