//! Column sums of a product in one pass: `p = x * y` (two buffers read element for
//! element) read only by the column sums of `p` becomes those sums reading `x` and `y`
//! (`SumRows::times`). A batch norm's gradient sums `g * xhat` over every pixel; its
//! product pass wrote a buffer of the batch's size only for the sum to read it back
//! (on ResNet-50's training step, 53 such passes and sums took a tenth of the step).
//! The plain column sums of the same values then join them (`SumRows::plain`).

use crate::operands::{Access, Slot};
use crate::program::{Program, Source};
use crate::step::{Pointwise, Step, SumRows};

/// Folds every product read only by its column sums into them (see the module's doc).
pub(crate) fn products_into_sums(program: &mut Program) {
    let mut index = 0;
    while index < program.steps.len() {
        match folding(program, index) {
            Some((sum, [x, y])) => {
                if let Step::SumRows(step) = &mut program.steps[sum] {
                    step.b = x;
                    step.times = Some(y);
                }
                program.steps.remove(index);
            }
            None => index += 1,
        }
    }
}

/// For a step `index` that is such a product: the index of the sum that alone reads it
/// and the product's two operands. None of them is written again before the sum, and
/// the product is no output nor alias.
fn folding(program: &Program, index: usize) -> Option<(usize, [Slot; 2])> {
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
    let whole = |access: &Access| *access == Access::rows(access.slot, *width);
    let (x, y) = (&inputs[first], &inputs[second]);
    if !whole(x) || !whole(y) {
        return None;
    }
    let root = |slot: Slot| program.root(slot);
    let aliased = program
        .outputs
        .iter()
        .any(|output| root(output.slot()) == *out)
        || program
            .slots
            .iter()
            .any(|info| info.source == Source::Alias(*out));
    if program.info(*out).integers || aliased || root(*out) != *out {
        return None;
    }
    let later = &program.steps[index + 1..];
    let readers: Vec<usize> = (0..later.len())
        .filter(|&at| later[at].reads().contains(out))
        .collect();
    let [reader] = readers[..] else {
        return None;
    };
    let Step::SumRows(SumRows {
        a: None,
        b,
        times: None,
        plain: None,
        rows: sum_rows,
        m: 1,
        n,
        ..
    }) = &later[reader]
    else {
        return None;
    };
    if b != out || n != width || sum_rows != rows {
        return None;
    }
    // Nothing between the product and the sum writes its operands or its result.
    let operands = [root(x.slot), root(y.slot), *out];
    if later[..reader].iter().any(|step| {
        step.outputs()
            .any(|written| operands.contains(&root(written)))
    }) {
        return None;
    }
    Some((index + 1 + reader, [x.slot, y.slot]))
}

/// Gives each column sum of a product (`times`) the plain column sums of the same
/// values that another step makes (`SumRows::plain`), one read of them for both: a
/// batch norm's gradient sums `g` beside `g * xhat` (on ResNet-50's training step, 53
/// second reads of a buffer of the batch's size).
pub(crate) fn plain_sums_beside_products(program: &mut Program) {
    let mut index = 0;
    while index < program.steps.len() {
        if let Some(other) = plain_partner(program, index) {
            let removed = program.steps.remove(other);
            let at = if other < index { index - 1 } else { index };
            if let (Step::SumRows(plain), Step::SumRows(sum)) = (removed, &mut program.steps[at]) {
                sum.plain = Some(plain.out);
            }
            index = at;
        }
        index += 1;
    }
}

/// For a step `index` that sums the columns of a product (`times`, no plain sums yet):
/// the index of a step summing the columns of the same values alone over the same rows,
/// which can run in its place: nothing between the two writes the values, and (when
/// it came first) nothing between reads its sums.
fn plain_partner(program: &Program, index: usize) -> Option<usize> {
    let Step::SumRows(SumRows {
        a: None,
        b,
        times: Some(_),
        plain: None,
        rows,
        m: 1,
        n,
        mean: false,
        ..
    }) = &program.steps[index]
    else {
        return None;
    };
    let root = |slot: Slot| program.root(slot);
    program.steps.iter().enumerate().find_map(|(other, step)| {
        let Step::SumRows(SumRows {
            out,
            a: None,
            b: other_b,
            times: None,
            plain: None,
            rows: other_rows,
            m: 1,
            n: other_n,
            mean: false,
        }) = step
        else {
            return None;
        };
        if other == index || other_b != b || other_rows != rows || other_n != n {
            return None;
        }
        let between = &program.steps[index.min(other) + 1..index.max(other)];
        let writes_values = between
            .iter()
            .any(|step| step.outputs().any(|written| root(written) == root(*b)));
        let reads_sums = other < index
            && between
                .iter()
                .any(|step| step.reads().iter().any(|&read| root(read) == *out));
        (!writes_values && !reads_sums).then_some(other)
    })
}

#[cfg(test)]
mod tests {
    use nestor_ir::{BinaryOp, DType};

    use super::*;
    use crate::operands::{Expr, Rows};
    use crate::program::{Output, SlotInfo};

    /// `p = x * y; s = column sums of p` over 5 rows of 3 (slots: 0 `x`, 1 `y` inputs,
    /// 2 `p`, 3 and 4 sums), `p` read again by a second sum with `also_read`, or a
    /// program output with `output`.
    fn program(also_read: bool, output: bool) -> Program {
        let mut program = Program::default();
        for (index, count) in [5, 5, 5, 1, 1].into_iter().enumerate() {
            program.slot(SlotInfo {
                dtype: DType::F32,
                rows: Rows::fixed(count),
                width: 3,
                source: if index < 2 {
                    Source::Input(index)
                } else {
                    Source::Step
                },
                integers: false,
            });
        }
        program.steps.push(Step::Pointwise(Pointwise {
            out: Slot(2),
            rows: Rows::fixed(5),
            width: 3,
            inputs: vec![Access::rows(Slot(0), 3), Access::rows(Slot(1), 3)],
            expr: Expr::Binary(
                BinaryOp::Mul,
                Box::new(Expr::Load(0)),
                Box::new(Expr::Load(1)),
            ),
        }));
        for out in 3..4 + u32::from(also_read) {
            program.steps.push(Step::SumRows(SumRows {
                out: Slot(out),
                a: None,
                b: Slot(2),
                times: None,
                plain: None,
                rows: Rows::fixed(5),
                m: 1,
                n: 3,
                mean: false,
            }));
        }
        if output {
            program.outputs.push(Output::Scalar { slot: Slot(2) });
        }
        program
    }

    /// The plain column sums of the product's operand move beside the sums of the
    /// product, before or after them, unless a step between writes the operand.
    #[test]
    fn plain_sums_of_the_same_values_join_the_sums_of_their_product() {
        let sum = |out: u32, times: Option<Slot>| {
            Step::SumRows(SumRows {
                out: Slot(out),
                a: None,
                b: Slot(0),
                times,
                plain: None,
                rows: Rows::fixed(5),
                m: 1,
                n: 3,
                mean: false,
            })
        };
        let write_x = Step::Pointwise(Pointwise {
            out: Slot(0),
            rows: Rows::fixed(5),
            width: 3,
            inputs: vec![Access::rows(Slot(1), 3)],
            expr: Expr::Load(0),
        });
        for plain_first in [false, true] {
            let mut program = program(false, false);
            let (with_times, plain) = (sum(3, Some(Slot(1))), sum(4, None));
            program.steps = if plain_first {
                vec![plain, with_times]
            } else {
                vec![with_times, plain]
            };
            plain_sums_beside_products(&mut program);
            let [Step::SumRows(joined)] = &program.steps[..] else {
                panic!("{:?}", program.steps);
            };
            assert_eq!((joined.out, joined.plain), (Slot(3), Some(Slot(4))));
        }
        let mut program = program(false, false);
        program.steps = vec![sum(3, Some(Slot(1))), write_x, sum(4, None)];
        let steps = program.steps.clone();
        plain_sums_beside_products(&mut program);
        assert_eq!(program.steps, steps);
    }

    #[test]
    fn a_product_read_only_by_its_column_sums_moves_into_them() {
        let mut folded = program(false, false);
        products_into_sums(&mut folded);
        assert_eq!(folded.steps.len(), 1, "{:?}", folded.steps);
        let Step::SumRows(sum) = &folded.steps[0] else {
            panic!("{:?}", folded.steps[0]);
        };
        assert_eq!((sum.b, sum.times), (Slot(0), Some(Slot(1))));
        // A product read by anything else, or returned, stays.
        for (also_read, output) in [(true, false), (false, true)] {
            let mut kept = program(also_read, output);
            let steps = kept.steps.clone();
            products_into_sums(&mut kept);
            assert_eq!(kept.steps, steps);
        }
    }
}
