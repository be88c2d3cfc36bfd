//! `einsum` with NestedTensor operands: the equation names the dims of one element
//! (no batch dim), dense operands apply to every element (as in DanLing).
//!
//! When the ragged dims line up (every nested operand has the same structure and
//! names its ragged dims with the same letters, in the same order; dense operands do
//! not use them; the output keeps them, in that order), the einsum runs once on the
//! packed values, the ragged letters becoming the packed row. Otherwise it runs
//! element by element (a slow path).

use tch::Tensor;

use nestor_layout::RaggedLayout;

use crate::guard::{slow_path, SlowPath};
use crate::ops::Operand;
use crate::{NestedError, NestedTensor, Result};

/// `torch.einsum(equation, operands)` over every element of the nested operands (see
/// the module docs). The equation must name its output (`->`) and may not use `...`.
///
/// ```
/// use nestor_frontend::{einsum, NestedTensor, Operand};
/// use tch::{Kind, Tensor};
/// let x = NestedTensor::from_lists(vec![vec![vec![1.0f32, 2.0]; 3], vec![vec![3.0, 4.0]; 1]])?;
/// let w = Tensor::ones([2, 5], (Kind::Float, tch::Device::Cpu));
/// let y = einsum("ld,de->le", &[Operand::Nested(&x), Operand::Dense(&w)])?; // packed
/// assert_eq!(y.values().size(), [4, 5]);
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
pub fn einsum(equation: &str, operands: &[Operand<'_>]) -> Result<NestedTensor> {
    let unsupported = |reason: String| NestedError::Unsupported {
        op: "einsum",
        reason,
    };
    let equation: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let Some((inputs, output)) = equation.split_once("->") else {
        return Err(unsupported(format!(
            "{equation:?} must name its output with ->"
        )));
    };
    if equation.contains("...") {
        return Err(unsupported("`...` is not supported; name every dim".into()));
    }
    let terms: Vec<&str> = inputs.split(',').collect();
    if terms.len() != operands.len() {
        return Err(unsupported(format!(
            "{} terms for {} operands",
            terms.len(),
            operands.len()
        )));
    }
    let mut nested: Vec<(&str, &NestedTensor)> = Vec::new();
    for (term, operand) in terms.iter().zip(operands) {
        match operand {
            Operand::Nested(batch) => {
                batch.untraceable("einsum")?;
                if term.chars().count() != batch.lay().rank() {
                    return Err(unsupported(format!(
                        "term {term:?} names {} dims of elements of rank {}",
                        term.chars().count(),
                        batch.lay().rank()
                    )));
                }
                nested.push((term, batch));
            }
            Operand::Dense(_) | Operand::Handle(_) => {}
            _ => return Err(unsupported("operands are NestedTensors or tensors".into())),
        }
    }
    let Some(&(_, first)) = nested.first() else {
        return Err(unsupported(
            "at least one operand must be a NestedTensor".into(),
        ));
    };
    if let Some((_, other)) = nested
        .iter()
        .find(|(_, b)| b.batch_size() != first.batch_size())
    {
        return Err(NestedError::BatchSizeMismatch {
            op: "einsum",
            what: "a nested operand",
            expected: first.batch_size(),
            got: other.batch_size(),
        });
    }
    match packed_plan(&terms, operands, &nested, output) {
        Some(plan) => plan.run(operands, first),
        None => per_element(&equation, operands, &nested, output, first),
    }
}

/// The einsum on packed values: the ragged letters (in order) become one row letter.
struct PackedPlan {
    /// The equation over packed values.
    equation: String,
    /// The ragged letters, in order.
    ragged: Vec<char>,
    /// The output's letters.
    output: Vec<char>,
}

fn packed_plan(
    terms: &[&str],
    operands: &[Operand<'_>],
    nested: &[(&str, &NestedTensor)],
    output: &str,
) -> Option<PackedPlan> {
    let ragged_letters = |(term, batch): &(&str, &NestedTensor)| -> Vec<char> {
        let letters: Vec<char> = term.chars().collect();
        batch
            .lay()
            .ragged_dims()
            .iter()
            .map(|&dim| letters[dim])
            .collect()
    };
    let ragged = ragged_letters(&nested[0]);
    let first = nested[0].1.lay();
    let lined_up = nested.iter().all(|operand| {
        let layout = operand.1.lay();
        ragged_letters(operand) == ragged && (layout == first || same_ragged_sizes(first, layout))
    });
    let dense_free = terms.iter().zip(operands).all(|(term, operand)| {
        matches!(operand, Operand::Nested(_)) || !term.chars().any(|c| ragged.contains(&c))
    });
    let kept: Vec<char> = output.chars().filter(|c| ragged.contains(c)).collect();
    if ragged.is_empty() || !lined_up || !dense_free || kept != ragged {
        return None;
    }
    let used: String = terms.concat() + output;
    let row = ('a'..='z').chain('A'..='Z').find(|c| !used.contains(*c))?;
    let strip = |term: &str, nested: bool| -> String {
        let rest: String = term.chars().filter(|c| !ragged.contains(c)).collect();
        if nested {
            format!("{row}{rest}")
        } else {
            rest
        }
    };
    let inputs: Vec<String> = terms
        .iter()
        .zip(operands)
        .map(|(term, operand)| strip(term, matches!(operand, Operand::Nested(_))))
        .collect();
    Some(PackedPlan {
        equation: format!("{}->{}", inputs.join(","), strip(output, true)),
        ragged,
        output: output.chars().collect(),
    })
}

/// Whether two layouts have the same ragged dims with the same sizes in every element
/// (their static dims may differ).
fn same_ragged_sizes(a: &RaggedLayout, b: &RaggedLayout) -> bool {
    a.batch_size() == b.batch_size()
        && a.ragged_dims().len() == b.ragged_dims().len()
        && a.element_sizes()
            .iter()
            .zip(b.element_sizes())
            .all(|(x, y)| {
                a.ragged_dims()
                    .iter()
                    .zip(b.ragged_dims())
                    .all(|(&i, &j)| x[i] == y[j])
            })
}

impl PackedPlan {
    fn run(&self, operands: &[Operand<'_>], first: &NestedTensor) -> Result<NestedTensor> {
        let tensors: Vec<Tensor> = operands
            .iter()
            .map(|operand| match operand {
                Operand::Nested(batch) => batch.packed().shallow_clone(),
                Operand::Dense(tensor) => tensor.shallow_clone(),
                Operand::Handle(dense) => dense.raw().shallow_clone(),
                // Checked by `einsum`.
                _ => Tensor::new(),
            })
            .collect();
        let values = Tensor::f_einsum(&self.equation, &tensors, None::<&[i64]>)?;
        // The output's static sizes come from the result, its ragged sizes from the
        // first nested operand (every nested operand agrees on them).
        let layout = first.lay();
        let mut statics = values.size().into_iter().skip(1);
        let ragged_sizes = |sizes: &[i64]| -> Vec<i64> {
            layout.ragged_dims().iter().map(|&dim| sizes[dim]).collect()
        };
        let static_sizes: Vec<Option<i64>> = self
            .output
            .iter()
            .map(|c| (!self.ragged.contains(c)).then(|| statics.next().unwrap_or(0)))
            .collect();
        let sizes: Vec<Vec<i64>> = layout
            .element_sizes()
            .iter()
            .map(|sizes| {
                let ragged = ragged_sizes(sizes);
                self.output
                    .iter()
                    .zip(&static_sizes)
                    .map(|(c, size)| match size {
                        Some(size) => *size,
                        None => {
                            let level = self.ragged.iter().position(|r| r == c).unwrap_or(0);
                            ragged[level]
                        }
                    })
                    .collect()
            })
            .collect();
        let ragged_dims: Vec<usize> = self
            .output
            .iter()
            .enumerate()
            .filter(|(_, c)| self.ragged.contains(c))
            .map(|(dim, _)| dim)
            .collect();
        let out = RaggedLayout::from_element_sizes(sizes, &ragged_dims)?;
        let values = values.f_reshape(out.packed_shape())?;
        Ok(NestedTensor::from_parts(values, out, first.options()))
    }
}

/// The einsum of every element, packed back (a slow path).
fn per_element(
    equation: &str,
    operands: &[Operand<'_>],
    nested: &[(&str, &NestedTensor)],
    output: &str,
    first: &NestedTensor,
) -> Result<NestedTensor> {
    slow_path(SlowPath::PerElement, "einsum")?;
    let elements: Vec<Vec<Tensor>> = nested
        .iter()
        .map(|(_, batch)| batch.elements())
        .collect::<Result<_>>()?;
    let mut results = Vec::with_capacity(first.batch_size());
    for element in 0..first.batch_size() {
        let mut next = elements.iter();
        let tensors: Vec<Tensor> = operands
            .iter()
            .map(|operand| match operand {
                Operand::Dense(tensor) => tensor.shallow_clone(),
                Operand::Handle(dense) => dense.raw().shallow_clone(),
                _ => next
                    .next()
                    .map_or_else(Tensor::new, |list| list[element].shallow_clone()),
            })
            .collect();
        results.push(Tensor::f_einsum(equation, &tensors, None::<&[i64]>)?);
    }
    // Output dims named by a ragged dim of any nested operand stay ragged.
    let ragged_letters: Vec<char> = nested
        .iter()
        .flat_map(|(term, batch)| {
            let letters: Vec<char> = term.chars().collect();
            batch
                .lay()
                .ragged_dims()
                .iter()
                .map(move |&dim| letters[dim])
                .collect::<Vec<_>>()
        })
        .collect();
    let ragged: Vec<usize> = output
        .chars()
        .enumerate()
        .filter(|(_, c)| ragged_letters.contains(c))
        .map(|(dim, _)| dim)
        .collect();
    NestedTensor::builder()
        .options(first.options())
        .ragged_dims(&ragged)
        .tensors(&results)
}
