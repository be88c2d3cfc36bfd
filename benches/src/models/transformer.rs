//! The Transformer models' columns: padded and per-element stacks from the weights,
//! nestor eager modules, and the compiled model.

use nestor::nn::{TransformerDecoder, TransformerEncoder};
use nestor::{compile, Dense, NestedTensor};
use tch::nn;
use tch::{Device, Kind, Tensor};

use super::{compiled_step, Columns, CompiledStep, Mode, Model, Stepper, Tokens};
use crate::padded::{self, Weights};
use crate::{Result, Scale};

/// The useful FLOPs of one forward pass (matrix products only; attention over the real
/// lengths, the full square even when causal).
pub fn transformer_flops(model: Model, scale: &Scale, source: &[i64], target: &[i64]) -> f64 {
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
pub(super) struct Stacks<'a> {
    /// The store of every parameter (compiled training names them after it).
    pub(super) store: &'a nn::VarStore,
    pub(super) encoder: Option<&'a TransformerEncoder>,
    pub(super) decoder: Option<&'a TransformerDecoder>,
    pub(super) weights: &'a Weights,
    pub(super) scale: &'a Scale,
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

    pub(super) fn columns(
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
        let compiled = Some(self.compiled(source, target, &stepper, false));
        Ok(Columns {
            padded,
            per_element,
            nestor,
            compiled,
            padded_mask: (mode == Mode::Inference).then_some(&out.mask),
        })
    }

    /// The compiled column (the stepper's mode; in mixed precision when `mixed`).
    pub(super) fn compiled(
        &'a self,
        source: &'a Tokens,
        target: &'a Tokens,
        stepper: &Stepper,
        mixed: bool,
    ) -> CompiledStep<'a> {
        let inputs = vec![&source.nested, &target.nested];
        let precision = if mixed { Kind::BFloat16 } else { Kind::Float };
        match stepper.mode {
            Mode::Inference => {
                let function = compile("model", move |inputs: &[NestedTensor], _: &[Dense]| {
                    self.nestor(&inputs[0], &inputs[1])
                })
                .autocast(precision);
                compiled_step(function, inputs, |output| {
                    Ok(output.values().shallow_clone())
                })
            }
            Mode::Training => {
                // The eager column's loss: the mean square of the output values.
                let function = compile("model", move |inputs: &[NestedTensor], _: &[Dense]| {
                    let output = self.nestor(&inputs[0], &inputs[1])?;
                    output.square()?.mean(&[], false)?.into_dense_handle()
                })
                .train(self.store)
                .autocast(precision);
                stepper.compiled_training(function, inputs)
            }
        }
    }
}
