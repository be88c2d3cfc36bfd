//! The models table: TransformerEncoder, TransformerDecoder, Transformer and a small
//! ResNet-style conv net, each as padded libtorch eager (key padding masks), a loop over
//! elements in libtorch, nestor eager and nestor compiled, for inference and for a
//! training step (forward, backward, SGD step).

use std::time::Instant;

use nestor::nn::{TransformerConfig, TransformerDecoder, TransformerEncoder};
use nestor::{compile, Dense, NestedTensor};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

use crate::lengths::{image_sizes, lengths, occupancy};
use crate::measure::{peak_bytes, time, Timing};
use crate::padded::{self, Weights};
use crate::{Result, Scale};

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
}

impl Column {
    /// Every column, in table order.
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
        }
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

/// A ragged batch of `[L_i, width]` tokens: elements, packed, padded with its mask.
pub struct Tokens {
    /// Lengths.
    pub lengths: Vec<i64>,
    /// Each element alone `[1, L_i, width]`.
    pub elements: Vec<Tensor>,
    /// Packed.
    pub nested: NestedTensor,
    /// Padded `[B, max, width]`.
    pub padded: Tensor,
    /// `[B, max, 1]`, 1 on data.
    pub mask: Tensor,
}

impl Tokens {
    /// Random tokens of these lengths.
    pub fn new(lengths: Vec<i64>, width: i64, max: i64) -> Result<Self> {
        let options = (Kind::Float, Device::Cpu);
        let elements: Vec<Tensor> = lengths
            .iter()
            .map(|&length| Tensor::f_randn([length, width], options))
            .collect::<std::result::Result<_, _>>()?;
        let nested = NestedTensor::builder()
            .ragged_dims(&[0])
            .tensors(&elements)?;
        let padded = Tensor::f_zeros([lengths.len() as i64, max, width], options)?;
        for (index, element) in elements.iter().enumerate() {
            padded
                .f_get(index as i64)?
                .f_narrow(0, 0, element.size()[0])?
                .f_copy_(element)?;
        }
        let positions = Tensor::f_arange(max, (Kind::Int64, Device::Cpu))?;
        let mask = positions
            .f_unsqueeze(0)?
            .f_lt_tensor(&Tensor::f_from_slice(&lengths)?.f_unsqueeze(1)?)?
            .f_unsqueeze(-1)?
            .f_to_kind(Kind::Float)?;
        let elements = elements
            .iter()
            .map(|element| element.f_unsqueeze(0))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Self {
            lengths,
            elements,
            nested,
            padded,
            mask,
        })
    }

    fn total(&self) -> f64 {
        self.lengths.iter().sum::<i64>() as f64
    }
}

/// A step: runs once, returning the loss for training or the output for inference.
pub type Step<'a> = Box<dyn FnMut() -> Result<Tensor> + 'a>;

/// The four columns of one model at one occupancy, ready to run.
pub struct Columns<'a> {
    /// Padded libtorch eager.
    pub padded: Step<'a>,
    /// A loop over elements in libtorch.
    pub per_element: Step<'a>,
    /// nestor eager.
    pub nestor: Step<'a>,
    /// nestor compiled and its compile counter (none for training).
    pub compiled: Option<(Step<'a>, Box<dyn Fn() -> u64 + 'a>)>,
}

/// A batch's columns as [`with_columns`] hands them over: the mode, the batch's
/// occupancy, the useful FLOPs of one step, and the steps.
pub type Visit<'v> = dyn FnMut(Mode, f64, f64, Columns<'_>) -> Result<()> + 'v;

/// Runs every column of `model` at about `target` occupancy.
pub fn run_model(model: Model, scale: &Scale, target: f64, seed: u64) -> Result<Vec<Measurement>> {
    let mut measurements = Vec::new();
    with_columns(
        model,
        scale,
        target,
        seed,
        &mut |mode, occupancy, flops, columns| {
            measurements.extend(measure_columns(
                model.name(),
                mode,
                target,
                occupancy,
                flops,
                scale,
                columns,
            )?);
            Ok(())
        },
    )?;
    Ok(measurements)
}

/// Builds `model` and a batch at about `target` occupancy, and hands `visit` the
/// columns of each mode (inference, then training).
pub fn with_columns(
    model: Model,
    scale: &Scale,
    target: f64,
    seed: u64,
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
    let root = store.root();
    match model {
        Model::Encoder | Model::Decoder | Model::Transformer => {
            let encoder = (model != Model::Decoder).then(|| {
                TransformerEncoder::new(&(&root / "encoder"), &config, scale.layers, true)
            });
            let decoder = (model != Model::Encoder).then(|| {
                TransformerDecoder::new(&(&root / "decoder"), &config, scale.layers, true)
            });
            let weights = Weights::new(&store);
            let source = Tokens::new(
                lengths(scale.batch, scale.max_length, target, seed),
                scale.d_model,
                scale.max_length,
            )?;
            let target_tokens = Tokens::new(
                lengths(scale.batch, scale.max_length, target, seed + 1),
                scale.d_model,
                scale.max_length,
            )?;
            let occupancy_now = occupancy(&source.lengths, scale.max_length);
            let flops = transformer_flops(model, scale, &source.lengths, &target_tokens.lengths);
            let stacks = Stacks {
                encoder: encoder.as_ref(),
                decoder: decoder.as_ref(),
                weights: &weights,
                scale,
            };
            visit_modes(&store, occupancy_now, flops, visit, |mode, optimizer| {
                stacks.columns(&source, &target_tokens, mode, optimizer)
            })?;
        }
        Model::ConvNet => {
            let net = ConvNet::new(&(&root / "convnet"), scale.channels);
            let weights = Weights::new(&store);
            let images = Images::new(
                image_sizes(scale.batch, scale.image_side, target, seed),
                scale.image_side,
            )?;
            let occupancy_now =
                images.area() / (scale.batch * scale.image_side * scale.image_side) as f64;
            let flops = images
                .sizes
                .iter()
                .map(|&(h, w)| {
                    let c = scale.channels as f64;
                    2.0 * (h * w) as f64 * 9.0 * (3.0 * c + 2.0 * c * c)
                })
                .sum::<f64>();
            visit_modes(&store, occupancy_now, flops, visit, |mode, optimizer| {
                net.columns(&weights, &images, mode, optimizer)
            })?;
        }
    }
    Ok(())
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

/// A compiled function called on `inputs` as a step (without gradients; `finish` turns
/// its first result into the step's tensor), and its compile counter.
pub fn compiled_step<'a, O, F>(
    function: nestor::Compiled<F>,
    inputs: Vec<&'a NestedTensor>,
    finish: impl Fn(NestedTensor) -> Result<Tensor> + 'a,
) -> (Step<'a>, Box<dyn Fn() -> u64 + 'a>)
where
    O: nestor::TraceOutputs,
    F: Fn(&[NestedTensor], &[Dense]) -> nestor::Result<O> + 'a,
{
    let function = std::rc::Rc::new(function);
    let counter = std::rc::Rc::clone(&function);
    let step: Step<'a> = Box::new(move || {
        let _no_grad = tch::no_grad_guard();
        let output = function.call(&inputs, &[])?;
        let first = output
            .into_iter()
            .next()
            .ok_or("the function returned nothing")?;
        finish(first.into_nested()?)
    });
    (step, Box::new(move || counter.stats().compiles))
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
    } = columns;
    let mut rows = Vec::new();
    let mut row = |column: Column, outcome: Outcome| {
        rows.push(Measurement {
            subject: subject.to_owned(),
            mode,
            target,
            occupancy,
            column,
            outcome,
        })
    };
    for (column, mut step) in [
        (Column::Padded, padded),
        (Column::PerElement, per_element),
        (Column::NestorEager, nestor),
    ] {
        row(column, measure(&mut step, flops, scale, None)?);
    }
    match compiled {
        Some((step, compiles)) => row(
            Column::NestorCompiled,
            measure_compiled(step, compiles, flops, scale)?,
        ),
        None => row(
            Column::NestorCompiled,
            Outcome::Unavailable(match mode {
                Mode::Training => {
                    "no compiled training yet (autodiff on the IR is not built)".into()
                }
                Mode::Inference => "does not compile".into(),
            }),
        ),
    }
    Ok(rows)
}

/// Times a compiled step: the first call (which compiles) apart, then as any step. A
/// model that does not compile is `Unavailable` with the error.
pub fn measure_compiled(
    mut step: Step<'_>,
    compiles: Box<dyn Fn() -> u64 + '_>,
    flops: f64,
    scale: &Scale,
) -> Result<Outcome> {
    let started = Instant::now();
    if let Err(error) = step() {
        return Ok(Outcome::Unavailable(format!("does not compile: {error}")));
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut outcome = measure(&mut step, flops, scale, None)?;
    if let Outcome::Measured { compile, .. } = &mut outcome {
        *compile = Some(CompileCost {
            compiles: compiles(),
            seconds,
        });
    }
    Ok(outcome)
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

/// The useful FLOPs of one forward pass (matrix products only; attention over the real
/// lengths, the full square even when causal).
fn transformer_flops(model: Model, scale: &Scale, source: &[i64], target: &[i64]) -> f64 {
    let (e, f) = (scale.d_model as f64, scale.feedforward as f64);
    let layers = scale.layers as f64;
    let sum = |lengths: &[i64]| lengths.iter().sum::<i64>() as f64;
    let squares = |lengths: &[i64]| lengths.iter().map(|&l| (l * l) as f64).sum::<f64>();
    let encoder = |lengths: &[i64]| {
        let t = sum(lengths);
        layers * (2.0 * t * (4.0 * e * e + 2.0 * e * f) + 4.0 * squares(lengths) * e)
    };
    let decoder = |lengths: &[i64], memory: &[i64]| {
        let (t, m) = (sum(lengths), sum(memory));
        let pairs: f64 = lengths
            .iter()
            .zip(memory)
            .map(|(&l, &m)| (l * m) as f64)
            .sum();
        layers
            * (2.0 * t * (4.0 * e * e + 2.0 * e * f)
                + 4.0 * squares(lengths) * e
                + 2.0 * t * 2.0 * e * e
                + 2.0 * m * 2.0 * e * e
                + 4.0 * pairs * e)
    };
    match model {
        Model::Encoder => encoder(source),
        Model::Decoder => decoder(target, source),
        Model::Transformer => encoder(source) + decoder(target, source),
        Model::ConvNet => 0.0,
    }
}

/// The transformer stacks of a model and its weights.
struct Stacks<'a> {
    encoder: Option<&'a TransformerEncoder>,
    decoder: Option<&'a TransformerDecoder>,
    weights: &'a Weights,
    scale: &'a Scale,
}

/// The loss of a training step: the mean square of the real outputs.
fn masked_loss(output: &Tensor, mask: &Tensor, count: f64) -> Result<Tensor> {
    Ok(output
        .f_square()?
        .f_mul(mask)?
        .f_sum(Kind::Float)?
        .f_div_scalar(count)?)
}

impl<'a> Stacks<'a> {
    /// The model on padded batches (`source` for the encoder, `target` for the decoder;
    /// the decoder's memory is the encoder's output or, alone, the source tokens).
    fn padded(
        &self,
        source: &Tensor,
        source_lengths: Option<&[i64]>,
        target: &Tensor,
        target_lengths: Option<&[i64]>,
    ) -> Result<Tensor> {
        let (heads, layers) = (self.scale.heads, self.scale.layers);
        let source_max = source.size()[1];
        let memory_mask = padded::attention_mask(source_lengths, source_max, 1, false)?;
        let memory = match self.encoder {
            Some(_) => padded::encoder(
                self.weights,
                "encoder",
                layers,
                source,
                memory_mask.as_ref(),
                heads,
            )?,
            None => source.shallow_clone(),
        };
        match self.decoder {
            Some(_) => {
                let target_max = target.size()[1];
                let self_mask =
                    padded::attention_mask(target_lengths, target_max, target_max, true)?;
                padded::decoder(
                    self.weights,
                    "decoder",
                    layers,
                    target,
                    &memory,
                    self_mask.as_ref(),
                    memory_mask.as_ref(),
                    heads,
                )
            }
            None => Ok(memory),
        }
    }

    fn nestor(&self, source: &NestedTensor, target: &NestedTensor) -> nestor::Result<NestedTensor> {
        let memory = match self.encoder {
            Some(encoder) => encoder.forward(source, false)?,
            None => source.shallow_clone(),
        };
        match self.decoder {
            Some(decoder) => decoder.forward(target, &memory, true, false),
            None => Ok(memory),
        }
    }

    /// The tokens the output has the structure of.
    fn output_tokens<'t>(&self, source: &'t Tokens, target: &'t Tokens) -> &'t Tokens {
        if self.decoder.is_some() {
            target
        } else {
            source
        }
    }

    fn columns(
        &'a self,
        source: &'a Tokens,
        target: &'a Tokens,
        mode: Mode,
        optimizer: nn::Optimizer,
    ) -> Result<Columns<'a>> {
        let out = self.output_tokens(source, target);
        let count = out.total() * self.scale.d_model as f64;
        let stepper = Stepper::new(mode, optimizer);
        let step = |forward: Box<dyn Fn() -> Result<Tensor> + 'a>| stepper.step(forward);
        let padded = step(Box::new(move || {
            let output = self.padded(
                &source.padded,
                Some(&source.lengths),
                &target.padded,
                Some(&target.lengths),
            )?;
            match mode {
                Mode::Inference => Ok(output),
                Mode::Training => masked_loss(&output, &out.mask, count),
            }
        }));
        let per_element = step(Box::new(move || {
            let mut total = Tensor::f_zeros([], (Kind::Float, Device::Cpu))?;
            let mut outputs = Vec::new();
            for (source, target) in source.elements.iter().zip(&target.elements) {
                let output = self.padded(source, None, target, None)?;
                match mode {
                    Mode::Inference => outputs.push(output),
                    Mode::Training => {
                        total = total.f_add(&output.f_square()?.f_sum(Kind::Float)?)?
                    }
                }
            }
            match mode {
                Mode::Inference => Ok(Tensor::f_cat(&outputs, 1)?),
                Mode::Training => Ok(total.f_div_scalar(count)?),
            }
        }));
        let nestor = step(Box::new(move || {
            let output = self.nestor(&source.nested, &target.nested)?;
            match mode {
                Mode::Inference => Ok(output.values().shallow_clone()),
                Mode::Training => Ok(output.values().f_square()?.f_mean(Kind::Float)?),
            }
        }));
        let compiled = (mode == Mode::Inference).then(|| {
            let function = compile("model", move |inputs: &[NestedTensor], _: &[Dense]| {
                self.nestor(&inputs[0], &inputs[1])
            });
            compiled_step(function, vec![&source.nested, &target.nested], |output| {
                Ok(output.values().shallow_clone())
            })
        });
        Ok(Columns {
            padded,
            per_element,
            nestor,
            compiled,
        })
    }
}

/// Images of different sizes: elements, packed, padded with a pixel mask.
pub struct Images {
    /// `(h, w)` of each image.
    pub sizes: Vec<(i64, i64)>,
    /// Each image alone `[1, 3, h, w]`.
    pub elements: Vec<Tensor>,
    /// Packed (ragged dims 1 and 2).
    pub nested: NestedTensor,
    /// Padded `[B, 3, side, side]`.
    pub padded: Tensor,
    /// `[B, 1, side, side]`, 1 on pixels.
    pub mask: Tensor,
}

impl Images {
    /// Random images of these sizes.
    pub fn new(sizes: Vec<(i64, i64)>, side: i64) -> Result<Self> {
        let options = (Kind::Float, Device::Cpu);
        let batch = sizes.len() as i64;
        let elements: Vec<Tensor> = sizes
            .iter()
            .map(|&(h, w)| Tensor::f_randn([3, h, w], options))
            .collect::<std::result::Result<_, _>>()?;
        let nested = NestedTensor::builder()
            .ragged_dims(&[1, 2])
            .tensors(&elements)?;
        let padded = Tensor::f_zeros([batch, 3, side, side], options)?;
        let mask = Tensor::f_zeros([batch, 1, side, side], options)?;
        for (index, (element, &(h, w))) in elements.iter().zip(&sizes).enumerate() {
            let index = index as i64;
            padded
                .f_get(index)?
                .f_narrow(1, 0, h)?
                .f_narrow(2, 0, w)?
                .f_copy_(element)?;
            let _ones = mask
                .f_get(index)?
                .f_narrow(1, 0, h)?
                .f_narrow(2, 0, w)?
                .f_fill_(1.0)?;
        }
        let elements = elements
            .iter()
            .map(|element| element.f_unsqueeze(0))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Self {
            sizes,
            elements,
            nested,
            padded,
            mask,
        })
    }

    fn area(&self) -> f64 {
        self.sizes.iter().map(|&(h, w)| (h * w) as f64).sum()
    }
}

/// A small ResNet-style net: a 3x3 stem, one residual block of two 3x3 convolutions,
/// global average pooling, a linear head to 10 classes.
struct ConvNet {
    stem: nn::Conv2D,
    conv1: nn::Conv2D,
    conv2: nn::Conv2D,
    head: nn::Linear,
}

impl ConvNet {
    fn new(path: &nn::Path, channels: i64) -> Self {
        let config = nn::ConvConfig {
            padding: 1,
            ..Default::default()
        };
        Self {
            stem: nn::conv2d(path / "stem", 3, channels, 3, config),
            conv1: nn::conv2d(path / "conv1", channels, channels, 3, config),
            conv2: nn::conv2d(path / "conv2", channels, channels, 3, config),
            head: nn::linear(path / "head", channels, 10, Default::default()),
        }
    }

    /// Pooled features `[B; C, 1, 1]` of packed images.
    fn features(&self, images: &NestedTensor) -> nestor::Result<NestedTensor> {
        let conv = |x: &NestedTensor, layer: &nn::Conv2D| {
            x.conv2d(&layer.ws, layer.bs.as_ref(), [1, 1], [1, 1], [1, 1], 1)
        };
        let stem = conv(images, &self.stem)?.relu()?;
        let hidden = conv(&stem, &self.conv1)?.relu()?;
        let block = (&conv(&hidden, &self.conv2)? + &stem)?.relu()?;
        block.adaptive_avg_pool2d([1, 1])
    }

    fn head(&self, pooled: &Tensor) -> Result<Tensor> {
        Ok(pooled
            .f_flatten(1, -1)?
            .f_linear(&self.head.ws, self.head.bs.as_ref())?)
    }

    fn columns<'a>(
        &'a self,
        weights: &'a Weights,
        images: &'a Images,
        mode: Mode,
        optimizer: nn::Optimizer,
    ) -> Result<Columns<'a>> {
        let stepper = Stepper::new(mode, optimizer);
        // Training minimizes the mean square of the logits.
        let step = |forward: Box<dyn Fn() -> Result<Tensor> + 'a>| {
            stepper.step(Box::new(move || {
                let logits = forward()?;
                match mode {
                    Mode::Inference => Ok(logits),
                    Mode::Training => Ok(logits.f_square()?.f_mean(Kind::Float)?),
                }
            }))
        };
        let padded = step(Box::new(move || {
            self.head(&padded::conv_net(
                weights,
                &images.padded,
                Some(&images.mask),
            )?)
        }));
        let per_element = step(Box::new(move || {
            let pooled = images
                .elements
                .iter()
                .map(|image| padded::conv_net(weights, image, None))
                .collect::<Result<Vec<_>>>()?;
            self.head(&Tensor::f_cat(&pooled, 0)?)
        }));
        let nestor = step(Box::new(move || {
            self.head(self.features(&images.nested)?.values())
        }));
        let compiled = (mode == Mode::Inference).then(|| {
            let function = compile("convnet", move |inputs: &[NestedTensor], _: &[Dense]| {
                self.features(&inputs[0])
            })
            .per_element_fallback(true);
            compiled_step(function, vec![&images.nested], move |pooled| {
                self.head(pooled.values())
            })
        });
        Ok(Columns {
            padded,
            per_element,
            nestor,
            compiled,
        })
    }
}
