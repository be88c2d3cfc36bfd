//! The models table: TransformerEncoder, TransformerDecoder, Transformer and a small
//! ResNet-style conv net, each as padded libtorch eager (key padding masks), a loop over
//! elements in libtorch, nestor eager and nestor compiled, for inference and for a
//! training step (forward, backward, SGD step).

use std::time::Instant;

use nestor::nn::{TransformerConfig, TransformerDecoder, TransformerEncoder};
use nestor::{Dense, NestedTensor};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::lengths::{image_sizes, lengths, occupancy};
use crate::measure::{peak_bytes, time, time_in_turns, Timing};
use crate::padded::Weights;
use crate::{Result, Scale};

mod batch;
mod convnet;
mod transformer;

pub use batch::{Images, Tokens};
use convnet::ConvNet;
pub use transformer::transformer_flops;
use transformer::Stacks;

/// A benchmarked model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Model {
    /// A post-norm TransformerEncoder stack with a final norm.
    Encoder,
    /// A post-norm TransformerDecoder stack (causal self-attention, cross-attention to
    /// a memory of other lengths).
    Decoder,
    /// Encoder then decoder.
    Transformer,
    /// A small ResNet-style conv net over images of different sizes.
    ConvNet,
}

impl Model {
    /// Every model, in table order.
    pub const ALL: [Model; 4] = [
        Model::Encoder,
        Model::Decoder,
        Model::Transformer,
        Model::ConvNet,
    ];

    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Model::Encoder => "TransformerEncoder",
            Model::Decoder => "TransformerDecoder",
            Model::Transformer => "Transformer",
            Model::ConvNet => "ResNet-style conv net",
        }
    }
}

/// The dtype a model's rows run in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Everything in f32.
    F32,
    /// bf16 as its users run it: the model and batch converted to bf16 for the eager
    /// columns (libtorch's bf16 kernels), and the compiled column in mixed precision (the
    /// f32 model and batch under `Compiled::autocast(Kind::BFloat16)`: bf16 products,
    /// f32 parameters and gradients).
    Bf16,
}

impl Precision {
    /// Both, in report order.
    pub const ALL: [Precision; 2] = [Precision::F32, Precision::Bf16];

    /// The report's subject for `model`'s rows in this precision.
    pub fn subject(self, model: Model) -> String {
        match self {
            Precision::F32 => model.name().to_owned(),
            Precision::Bf16 => format!("{} bf16", model.name()),
        }
    }
}

/// Inference or a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Forward only, without gradients.
    Inference,
    /// Forward, backward and an SGD step.
    Training,
}

impl Mode {
    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Inference => "inference",
            Mode::Training => "training",
        }
    }
}

/// How a step is run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Column {
    /// libtorch on the padded batch with masks.
    Padded,
    /// libtorch on each element alone.
    PerElement,
    /// nestor's NestedTensor on libtorch.
    NestorEager,
    /// `nestor::compile`.
    NestorCompiled,
    /// PyTorch (the venv's Python): padded eager with the inference fast path on.
    TorchFastPath,
    /// PyTorch: padded eager without the fast path (the conv net has none).
    TorchPadded,
    /// PyTorch: padded under `torch.compile`.
    TorchCompiled,
    /// PyTorch: padded eager, channels-last (the conv net).
    TorchChannelsLast,
    /// PyTorch: padded under `torch.compile`, channels-last (the conv net).
    TorchCompiledChannelsLast,
    /// PyTorch: `torch.nested` jagged eager.
    TorchNested,
    /// PyTorch: `torch.nested` jagged under `torch.compile`.
    TorchNestedCompiled,
}

impl Column {
    /// The Rust columns (every subject has them), in table order.
    pub const ALL: [Column; 4] = [
        Column::Padded,
        Column::PerElement,
        Column::NestorEager,
        Column::NestorCompiled,
    ];

    /// Its name in the report.
    pub fn name(self) -> &'static str {
        match self {
            Column::Padded => "padded tch eager",
            Column::PerElement => "per-element tch eager",
            Column::NestorEager => "nestor eager",
            Column::NestorCompiled => "nestor compiled",
            Column::TorchFastPath => "PyTorch padded eager, fast path on",
            Column::TorchPadded => "PyTorch padded eager (no fast path)",
            Column::TorchCompiled => "PyTorch padded torch.compile",
            Column::TorchChannelsLast => "PyTorch padded eager channels-last",
            Column::TorchCompiledChannelsLast => "PyTorch padded torch.compile channels-last",
            Column::TorchNested => "PyTorch torch.nested jagged eager",
            Column::TorchNestedCompiled => "PyTorch torch.nested jagged torch.compile",
        }
    }

    /// The PyTorch options, in `benches/pytorch.py`'s order (the channels-last ones
    /// are the conv net's, the jagged ones the encoder's).
    pub const PYTORCH: [Column; 7] = [
        Column::TorchFastPath,
        Column::TorchPadded,
        Column::TorchCompiled,
        Column::TorchChannelsLast,
        Column::TorchCompiledChannelsLast,
        Column::TorchNested,
        Column::TorchNestedCompiled,
    ];

    /// Whether it is one of what a PyTorch user would run instead (the Python columns).
    pub fn is_pytorch(self) -> bool {
        Self::PYTORCH.contains(&self)
    }
}

/// Compiles of a compiled column and the time of the call that compiled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompileCost {
    /// Programs compiled over the whole measurement (1 when one serves every call).
    pub compiles: u64,
    /// Seconds of the first call (trace, optimize, lower, JIT, run).
    pub seconds: f64,
}

/// What one cell of a table measured.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Measured.
    Measured {
        /// Step times.
        timing: Timing,
        /// Useful FLOPs (of the real lengths) per second of the median step, in GFLOP/s.
        gflops: f64,
        /// The most bytes allocated at once during a step.
        peak: Option<u64>,
        /// Compile counts and time, for compiled columns.
        compile: Option<CompileCost>,
    },
    /// Not measured, and why.
    Unavailable(String),
}

/// One measured row.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// What was run (a model or an operator).
    pub subject: String,
    /// Inference or training.
    pub mode: Mode,
    /// The occupancy the batch was drawn for (rows of one batch share it).
    pub target: f64,
    /// The batch's occupancy (real over padded elements).
    pub occupancy: f64,
    /// How.
    pub column: Column,
    /// What came out.
    pub outcome: Outcome,
}

/// A step: runs once, returning the loss for training or the output for inference.
pub type Step<'a> = Box<dyn FnMut() -> Result<Tensor> + 'a>;

/// What the suite asks of a compiled function besides its steps.
pub trait CompiledHandle {
    /// Programs compiled so far.
    fn compiles(&self) -> u64;
    /// Starts or stops timing its steps ([`nestor::Compiled::record_steps`]).
    fn record_steps(&self, enabled: bool);
    /// The step timings since the last take ([`nestor::Compiled::take_step_profiles`]).
    fn take_step_profiles(&self) -> Vec<nestor::RunProfile>;
}

impl<O, F> CompiledHandle for nestor::Compiled<F>
where
    O: nestor::TraceOutputs,
    F: Fn(&[NestedTensor], &[Dense]) -> nestor::Result<O>,
{
    fn compiles(&self) -> u64 {
        self.stats().compiles
    }

    fn record_steps(&self, enabled: bool) {
        nestor::Compiled::record_steps(self, enabled);
    }

    fn take_step_profiles(&self) -> Vec<nestor::RunProfile> {
        nestor::Compiled::take_step_profiles(self)
    }
}

/// A compiled function shared by its step and the suite.
pub type Handle<'a> = std::rc::Rc<dyn CompiledHandle + 'a>;

/// A compiled column's step and its function.
pub type CompiledStep<'a> = (Step<'a>, Handle<'a>);

/// The four columns of one model at one occupancy, ready to run.
pub struct Columns<'a> {
    /// Padded libtorch eager.
    pub padded: Step<'a>,
    /// A loop over elements in libtorch.
    pub per_element: Step<'a>,
    /// nestor eager.
    pub nestor: Step<'a>,
    /// nestor compiled and its compile counter (none for training).
    pub compiled: Option<CompiledStep<'a>>,
    /// For checks, not timed: the `[B, max, 1]` mask of the padded column's output
    /// (1 on data) when it is padded and the other columns' outputs are packed rows;
    /// none when every column's output has one shape (logits, losses).
    pub padded_mask: Option<&'a Tensor>,
}

/// A batch's columns as [`with_columns`] hands them over: the mode, the batch's
/// occupancy, the useful FLOPs of one step, and the steps.
pub type Visit<'v> = dyn FnMut(Mode, f64, f64, Columns<'_>) -> Result<()> + 'v;

/// Runs every column of `model` at about `target` occupancy in `precision`.
pub fn run_model(
    model: Model,
    scale: &Scale,
    (target, seed): (f64, u64),
    precision: Precision,
) -> Result<Vec<Measurement>> {
    let mut measurements = Vec::new();
    let subject = precision.subject(model);
    with_columns(
        model,
        scale,
        (target, seed),
        precision,
        &mut |mode, occupancy, flops, columns| {
            measurements.extend(measure_columns(
                &subject, mode, target, occupancy, flops, scale, columns,
            )?);
            Ok(())
        },
    )?;
    Ok(measurements)
}

/// The lengths of the Transformer models' source and target batches at about `target`
/// occupancy.
pub fn token_lengths(scale: &Scale, target: f64, seed: u64) -> (Vec<i64>, Vec<i64>) {
    (
        lengths(scale.batch, scale.max_length, target, seed),
        lengths(scale.batch, scale.max_length, target, seed + 1),
    )
}

/// The useful FLOPs of one conv net forward over images of `sizes` (the convolutions).
pub fn conv_flops(scale: &Scale, sizes: &[(i64, i64)]) -> f64 {
    let c = scale.channels as f64;
    sizes
        .iter()
        .map(|&(h, w)| 2.0 * (h * w) as f64 * 9.0 * (3.0 * c + 2.0 * c * c))
        .sum()
}

/// Builds `model` and a batch at about `target` occupancy, and hands `visit` the
/// columns of each mode (inference, then training) in `precision`.
pub fn with_columns(
    model: Model,
    scale: &Scale,
    (target, seed): (f64, u64),
    precision: Precision,
    visit: &mut Visit<'_>,
) -> Result<()> {
    tch::manual_seed(seed as i64);
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: scale.d_model,
        nhead: scale.heads,
        dim_feedforward: scale.feedforward,
        dropout: 0.0,
        ..Default::default()
    };
    // The eager columns' copy of the model in bf16, for the bf16 rows.
    let mut bf16_store = nn::VarStore::new(Device::Cpu);
    match model {
        Model::Encoder | Model::Decoder | Model::Transformer => {
            let stacks_of = |root: &nn::Path| {
                let encoder = (model != Model::Decoder).then(|| {
                    TransformerEncoder::new(&(root / "encoder"), &config, scale.layers, true)
                });
                let decoder = (model != Model::Encoder).then(|| {
                    TransformerDecoder::new(&(root / "decoder"), &config, scale.layers, true)
                });
                (encoder, decoder)
            };
            let (encoder, decoder) = stacks_of(&store.root());
            let (bf16_encoder, bf16_decoder) = stacks_of(&bf16_store.root());
            bf16_store.copy(&store)?;
            bf16_store.bfloat16();
            let weights = Weights::new(&store);
            let bf16_weights = Weights::new(&bf16_store);
            let (source_lengths, target_lengths) = token_lengths(scale, target, seed);
            let source = Tokens::new(source_lengths, scale.d_model, scale.max_length)?;
            let target_tokens = Tokens::new(target_lengths, scale.d_model, scale.max_length)?;
            let occupancy_now = occupancy(&source.lengths, scale.max_length);
            let flops = transformer_flops(model, scale, &source.lengths, &target_tokens.lengths);
            let stacks = Stacks {
                store: &store,
                encoder: encoder.as_ref(),
                decoder: decoder.as_ref(),
                weights: &weights,
                scale,
            };
            let bf16_stacks = Stacks {
                store: &bf16_store,
                encoder: bf16_encoder.as_ref(),
                decoder: bf16_decoder.as_ref(),
                weights: &bf16_weights,
                scale,
            };
            let bf16_tokens = [
                source.to_kind(Kind::BFloat16)?,
                target_tokens.to_kind(Kind::BFloat16)?,
            ];
            visit_modes(
                &store,
                occupancy_now,
                flops,
                visit,
                |mode, optimizer| match precision {
                    Precision::F32 => stacks.columns(&source, &target_tokens, mode, optimizer),
                    Precision::Bf16 => {
                        let [source16, target16] = &bf16_tokens;
                        mixed_columns(
                            (mode, optimizer),
                            &bf16_store,
                            |bf16_optimizer| {
                                bf16_stacks.columns(source16, target16, mode, bf16_optimizer)
                            },
                            |stepper| stacks.compiled(&source, &target_tokens, stepper, true),
                        )
                    }
                },
            )?;
        }
        Model::ConvNet => {
            let net = ConvNet::new(&(store.root() / "convnet"), scale.channels);
            let bf16_net = ConvNet::new(&(bf16_store.root() / "convnet"), scale.channels);
            bf16_store.copy(&store)?;
            bf16_store.bfloat16();
            let weights = Weights::new(&store);
            let bf16_weights = Weights::new(&bf16_store);
            let images = Images::new(
                image_sizes(scale.batch, scale.image_side, target, seed),
                scale.image_side,
            )?;
            let bf16_images = images.to_kind(Kind::BFloat16)?;
            let occupancy_now =
                images.area() / (scale.batch * scale.image_side * scale.image_side) as f64;
            let flops = conv_flops(scale, &images.sizes);
            visit_modes(
                &store,
                occupancy_now,
                flops,
                visit,
                |mode, optimizer| match precision {
                    Precision::F32 => net.columns(&store, &weights, &images, mode, optimizer),
                    Precision::Bf16 => mixed_columns(
                        (mode, optimizer),
                        &bf16_store,
                        |bf16_optimizer| {
                            let weights = &bf16_weights;
                            bf16_net.columns(
                                &bf16_store,
                                weights,
                                &bf16_images,
                                mode,
                                bf16_optimizer,
                            )
                        },
                        |stepper| net.compiled(&store, &images, stepper, true),
                    ),
                },
            )?;
        }
    }
    Ok(())
}

/// The bf16 rows' columns of one mode: the eager ones of the model's bf16 copy
/// (`eager`, with an SGD of its own on `bf16_store`) and the compiled one of the f32
/// model in mixed precision (`compiled`, stepping `optimizer`).
fn mixed_columns<'a>(
    (mode, optimizer): (Mode, nn::Optimizer),
    bf16_store: &nn::VarStore,
    eager: impl FnOnce(nn::Optimizer) -> Result<Columns<'a>>,
    compiled: impl FnOnce(&Stepper) -> CompiledStep<'a>,
) -> Result<Columns<'a>> {
    let mut columns = eager(nn::Sgd::default().build(bf16_store, 1e-5)?)?;
    columns.compiled = Some(compiled(&Stepper::new(mode, optimizer)));
    Ok(columns)
}

/// Hands `visit` the columns of inference, then of training (with a fresh SGD
/// optimizer; a training step counts three times the forward FLOPs).
fn visit_modes<'a>(
    store: &nn::VarStore,
    occupancy: f64,
    flops: f64,
    visit: &mut Visit<'_>,
    mut columns: impl FnMut(Mode, nn::Optimizer) -> Result<Columns<'a>>,
) -> Result<()> {
    for mode in [Mode::Inference, Mode::Training] {
        let optimizer = nn::Sgd::default().build(store, 1e-5)?;
        let factor = if mode == Mode::Training { 3.0 } else { 1.0 };
        visit(mode, occupancy, flops * factor, columns(mode, optimizer)?)?;
    }
    Ok(())
}

/// Turns a forward function into a step of one mode: inference without gradients, or
/// a training step (the forward gives the loss; backward; an optimizer step).
struct Stepper {
    mode: Mode,
    optimizer: std::rc::Rc<std::cell::RefCell<nn::Optimizer>>,
}

impl Stepper {
    fn new(mode: Mode, optimizer: nn::Optimizer) -> Self {
        Self {
            mode,
            optimizer: std::rc::Rc::new(std::cell::RefCell::new(optimizer)),
        }
    }

    fn step<'a>(&self, forward: Box<dyn Fn() -> Result<Tensor> + 'a>) -> Step<'a> {
        let optimizer = std::rc::Rc::clone(&self.optimizer);
        match self.mode {
            Mode::Inference => Box::new(move || {
                let _no_grad = tch::no_grad_guard();
                forward()
            }),
            Mode::Training => Box::new(move || {
                let loss = forward()?;
                let mut optimizer = optimizer.borrow_mut();
                optimizer.zero_grad();
                loss.f_backward()?;
                optimizer.step();
                Ok(loss)
            }),
        }
    }
}

impl Stepper {
    /// A compiled training function (its first result the loss) called on `inputs` as a
    /// training step: gradients accumulated by the call, then the optimizer's step.
    fn compiled_training<'a, F>(
        &self,
        function: nestor::Compiled<F>,
        inputs: Vec<&'a NestedTensor>,
    ) -> CompiledStep<'a>
    where
        F: Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Dense> + 'a,
    {
        let function = std::rc::Rc::new(function);
        let handle: Handle<'a> = function.clone();
        let optimizer = std::rc::Rc::clone(&self.optimizer);
        let step: Step<'a> = Box::new(move || {
            let mut optimizer = optimizer.borrow_mut();
            optimizer.zero_grad();
            let loss = function
                .call(&inputs, &[])?
                .into_iter()
                .next()
                .ok_or("the function returned nothing")?
                .into_dense()?;
            optimizer.step();
            Ok(loss)
        });
        (step, handle)
    }
}

/// A compiled function called on `inputs` as a step (without gradients; `finish` turns
/// its first result into the step's tensor), and the function.
pub fn compiled_step<'a, O, F>(
    function: nestor::Compiled<F>,
    inputs: Vec<&'a NestedTensor>,
    finish: impl Fn(NestedTensor) -> Result<Tensor> + 'a,
) -> CompiledStep<'a>
where
    O: nestor::TraceOutputs + 'a,
    F: Fn(&[NestedTensor], &[Dense]) -> nestor::Result<O> + 'a,
{
    let function = std::rc::Rc::new(function);
    let handle: Handle<'a> = function.clone();
    let step: Step<'a> = Box::new(move || {
        let _no_grad = tch::no_grad_guard();
        let output = function.call(&inputs, &[])?;
        let first = output
            .into_iter()
            .next()
            .ok_or("the function returned nothing")?;
        finish(first.into_nested()?)
    });
    (step, handle)
}

/// Times every column and measures its peak memory.
#[allow(clippy::too_many_arguments)]
fn measure_columns(
    subject: &str,
    mode: Mode,
    target: f64,
    occupancy: f64,
    flops: f64,
    scale: &Scale,
    columns: Columns<'_>,
) -> Result<Vec<Measurement>> {
    let Columns {
        padded,
        per_element,
        nestor,
        compiled,
        ..
    } = columns;
    let mut steps = vec![
        (Column::Padded, padded),
        (Column::PerElement, per_element),
        (Column::NestorEager, nestor),
    ];
    let compiled = match compiled {
        Some((step, compiles)) => compiled_column(step, compiles, &mut steps),
        None => Err(Outcome::Unavailable(match mode {
            Mode::Training => "no compiled training for this model yet".into(),
            Mode::Inference => "does not compile".into(),
        })),
    };
    let mut outcomes = measure_in_turns(steps, flops, scale)?;
    finish_compiled(compiled, &mut outcomes);
    Ok(outcomes
        .into_iter()
        .map(|(column, outcome)| Measurement {
            subject: subject.to_owned(),
            mode,
            target,
            occupancy,
            column,
            outcome,
        })
        .collect())
}

/// What became of a compiled column before the timing: its first call's time and its
/// function (whose compiles are read after the timing), or the outcome of a model that
/// did not compile.
pub type CompiledColumn<'a> = std::result::Result<(f64, Handle<'a>), Outcome>;

/// Calls a compiled step once (it compiles) and, if it works, adds it to the `steps`
/// to time as [`Column::NestorCompiled`].
pub fn compiled_column<'a>(
    mut step: Step<'a>,
    function: Handle<'a>,
    steps: &mut Vec<(Column, Step<'a>)>,
) -> CompiledColumn<'a> {
    let started = Instant::now();
    if let Err(error) = step() {
        return Err(Outcome::Unavailable(format!("does not compile: {error}")));
    }
    let seconds = started.elapsed().as_secs_f64();
    steps.push((Column::NestorCompiled, step));
    Ok((seconds, function))
}

/// Puts the compiled column's compile cost into its outcome, or its outcome in the
/// table when it did not compile.
pub fn finish_compiled(compiled: CompiledColumn<'_>, outcomes: &mut Vec<(Column, Outcome)>) {
    match compiled {
        Ok((seconds, function)) => {
            for (column, outcome) in outcomes.iter_mut() {
                if let (Column::NestorCompiled, Outcome::Measured { compile, .. }) =
                    (column, outcome)
                {
                    *compile = Some(CompileCost {
                        compiles: function.compiles(),
                        seconds,
                    });
                }
            }
        }
        Err(outcome) => outcomes.push((Column::NestorCompiled, outcome)),
    }
}

/// Times the steps in turns ([`crate::measure::time_in_turns`]: a slow spell of the
/// machine slows every column alike), then measures each one's peak memory.
pub fn measure_in_turns(
    mut steps: Vec<(Column, Step<'_>)>,
    flops: f64,
    scale: &Scale,
) -> Result<Vec<(Column, Outcome)>> {
    let timings = {
        let mut runs: Vec<Box<dyn FnMut() -> Result<()> + '_>> = steps
            .iter_mut()
            .map(|(_, step)| Box::new(move || step().map(drop)) as Box<dyn FnMut() -> Result<()>>)
            .collect();
        let mut turns: Vec<&mut dyn FnMut() -> Result<()>> = runs
            .iter_mut()
            .map(|run| run.as_mut() as &mut dyn FnMut() -> Result<()>)
            .collect();
        time_in_turns(scale.samples, &mut turns)?
    };
    steps
        .into_iter()
        .zip(timings)
        .map(|((column, mut step), timing)| {
            let peak = peak_bytes(|| step().map(drop))?;
            Ok((
                column,
                Outcome::Measured {
                    timing,
                    gflops: flops / timing.median / 1e9,
                    peak,
                    compile: None,
                },
            ))
        })
        .collect()
}

/// Times `step` and measures its peak memory.
pub fn measure(
    step: &mut dyn FnMut() -> Result<Tensor>,
    flops: f64,
    scale: &Scale,
    compile: Option<CompileCost>,
) -> Result<Outcome> {
    let timing = time(scale.samples, || step().map(drop))?;
    let peak = peak_bytes(|| step().map(drop))?;
    Ok(Outcome::Measured {
        timing,
        gflops: flops / timing.median / 1e9,
        peak,
        compile,
    })
}
