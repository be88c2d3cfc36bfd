//! The operators table: single operators at 35% occupancy on `[B; L, d_model]` tokens,
//! padded libtorch eager vs nestor eager vs nestor compiled.

use nestor::{compile, Dense, NestedTensor};
use tch::{Device, Kind, Tensor};

use crate::lengths::{lengths, occupancy};
use crate::models::{
    compiled_column, compiled_step, finish_compiled, measure_in_turns, Column, Handle, Measurement,
    Mode, Step, Tokens,
};
use crate::{Result, Scale};

/// A benchmarked operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operator {
    /// `x W^T + b`, `W [d, d]`.
    Linear,
    /// Layer norm over the last dim, with weight and bias.
    LayerNorm,
    /// `max(x, 0)`.
    Relu,
    /// Exact GELU.
    Gelu,
    /// softmax over the last dim.
    Softmax,
    /// Rows of a `[vocabulary, d]` table at integer ids `[B; L]`.
    Embedding,
    /// `x @ W`, `W [d, d]`.
    Matmul,
    /// `x + y` of two batches of one structure.
    Add,
}

impl Operator {
    /// Every operator, in table order.
    pub const ALL: [Operator; 8] = [
        Operator::Linear,
        Operator::LayerNorm,
        Operator::Relu,
        Operator::Gelu,
        Operator::Softmax,
        Operator::Embedding,
        Operator::Matmul,
        Operator::Add,
    ];

    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Operator::Linear => "linear",
            Operator::LayerNorm => "layer_norm",
            Operator::Relu => "relu",
            Operator::Gelu => "gelu",
            Operator::Softmax => "softmax",
            Operator::Embedding => "embedding",
            Operator::Matmul => "matmul",
            Operator::Add => "add",
        }
    }

    /// FLOPs per output element (products count 2 per multiply-add; pointwise ops 1,
    /// norms and softmax the handful of operations they do per element).
    fn flops_per_element(self, d: f64) -> f64 {
        match self {
            Operator::Linear | Operator::Matmul => 2.0 * d,
            Operator::LayerNorm => 7.0,
            Operator::Softmax => 5.0,
            Operator::Relu | Operator::Gelu | Operator::Add => 1.0,
            Operator::Embedding => 0.0,
        }
    }
}

/// The nestor form of an operator (eager and traced alike).
fn nested_op(
    operator: Operator,
    x: &NestedTensor,
    y: &NestedTensor,
    weight: &Tensor,
    bias: &Tensor,
) -> nestor::Result<NestedTensor> {
    let width = weight.size()[1];
    match operator {
        Operator::Linear => x.linear(weight, Some(bias)),
        Operator::LayerNorm => x.layer_norm(&[width], Some(bias), Some(bias), 1e-5),
        Operator::Relu => x.relu(),
        Operator::Gelu => x.gelu("none"),
        Operator::Softmax => x.softmax(-1),
        Operator::Embedding => x.embedding(weight, -1),
        Operator::Matmul => x.matmul(weight),
        Operator::Add => x + y,
    }
}

/// The padded libtorch form of an operator.
fn padded_op(
    operator: Operator,
    x: &Tensor,
    y: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
) -> Result<Tensor> {
    let width = weight.size()[1];
    Ok(match operator {
        Operator::Linear => x.f_linear(weight, Some(bias))?,
        Operator::LayerNorm => x.f_layer_norm([width], Some(bias), Some(bias), 1e-5, true)?,
        Operator::Relu => x.f_relu()?,
        Operator::Gelu => x.f_gelu("none")?,
        Operator::Softmax => x.f_softmax(-1, Kind::Float)?,
        Operator::Embedding => Tensor::f_embedding(weight, x, -1, false, false)?,
        Operator::Matmul => x.f_matmul(weight)?,
        Operator::Add => x.f_add(y)?,
    })
}

/// The three columns of one operator, ready to run.
pub struct OperatorSteps<'a> {
    /// Padded libtorch eager.
    pub padded: Step<'a>,
    /// nestor eager.
    pub eager: Step<'a>,
    /// nestor compiled (its first call compiles).
    pub compiled: Step<'a>,
    /// The compiled function.
    pub function: Handle<'a>,
}

/// Runs the three columns of `operator` at about `target` occupancy.
pub fn run_operator(
    operator: Operator,
    scale: &Scale,
    target: f64,
    seed: u64,
) -> Result<Vec<Measurement>> {
    let mut rows = Vec::new();
    with_steps(
        operator,
        scale,
        target,
        seed,
        &mut |occupancy, flops, steps| {
            let OperatorSteps {
                padded,
                eager,
                compiled,
                function,
            } = steps;
            let mut timed = vec![(Column::Padded, padded), (Column::NestorEager, eager)];
            let compiled = compiled_column(compiled, function, &mut timed);
            let mut outcomes = measure_in_turns(timed, flops, scale)?;
            finish_compiled(compiled, &mut outcomes);
            rows.extend(outcomes.into_iter().map(|(column, outcome)| Measurement {
                subject: operator.name().to_owned(),
                mode: Mode::Inference,
                target,
                occupancy,
                column,
                outcome,
            }));
            Ok(())
        },
    )?;
    Ok(rows)
}

/// Builds `operator`'s inputs at about `target` occupancy (without gradients) and hands
/// `visit` the occupancy, the useful FLOPs of one step and the steps.
pub fn with_steps(
    operator: Operator,
    scale: &Scale,
    target: f64,
    seed: u64,
    visit: &mut dyn FnMut(f64, f64, OperatorSteps<'_>) -> Result<()>,
) -> Result<()> {
    let _no_grad = tch::no_grad_guard();
    tch::manual_seed(seed as i64);
    let d = scale.d_model;
    let lengths = lengths(scale.batch, scale.max_length, target, seed);
    let occupancy_now = occupancy(&lengths, scale.max_length);
    let x = Tokens::new(lengths.clone(), d, scale.max_length)?;
    let y = Tokens::new(lengths.clone(), d, scale.max_length)?;
    let ids = if operator == Operator::Embedding {
        let elements: Vec<Tensor> = lengths
            .iter()
            .map(|&length| {
                Tensor::f_randint(scale.vocabulary, [length], (Kind::Int64, Device::Cpu))
            })
            .collect::<std::result::Result<_, _>>()?;
        let padded = Tensor::f_zeros([scale.batch, scale.max_length], (Kind::Int64, Device::Cpu))?;
        for (index, element) in elements.iter().enumerate() {
            padded
                .f_get(index as i64)?
                .f_narrow(0, 0, element.size()[0])?
                .f_copy_(element)?;
        }
        Some((
            NestedTensor::builder()
                .ragged_dims(&[0])
                .tensors(&elements)?,
            padded,
        ))
    } else {
        None
    };
    let rows = if operator == Operator::Embedding {
        scale.vocabulary
    } else {
        d
    };
    let weight = Tensor::f_randn([rows, d], (Kind::Float, Device::Cpu))?.f_mul_scalar(0.05)?;
    let bias = Tensor::f_randn([d], (Kind::Float, Device::Cpu))?;
    let (nested_x, padded_x) = match &ids {
        Some((nested, padded)) => (nested.shallow_clone(), padded.shallow_clone()),
        None => (x.nested.shallow_clone(), x.padded.shallow_clone()),
    };
    let total: f64 = lengths.iter().sum::<i64>() as f64 * d as f64;
    let flops = total * operator.flops_per_element(d as f64);
    let padded: Step<'_> = Box::new(|| padded_op(operator, &padded_x, &y.padded, &weight, &bias));
    let eager: Step<'_> = Box::new(|| {
        Ok(nested_op(operator, &nested_x, &y.nested, &weight, &bias)?
            .values()
            .shallow_clone())
    });
    let function = compile(operator.name(), |inputs: &[NestedTensor], _: &[Dense]| {
        nested_op(operator, &inputs[0], &inputs[1], &weight, &bias)
    });
    let (compiled, function) = compiled_step(function, vec![&nested_x, &y.nested], |output| {
        Ok(output.values().shallow_clone())
    });
    visit(
        occupancy_now,
        flops,
        OperatorSteps {
            padded,
            eager,
            compiled,
            function,
        },
    )
}
