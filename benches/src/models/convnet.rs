//! The ResNet-style conv net's columns.

use nestor::{compile, Dense, NestedTensor};
use tch::nn;
use tch::{Kind, Tensor};

use super::{compiled_step, Columns, CompiledStep, Images, Mode, Stepper};
use crate::padded::{self, Weights};
use crate::Result;

/// A small ResNet-style net: a 3x3 stem, one residual block of two 3x3 convolutions,
/// global average pooling, a linear head to 10 classes.
pub(super) struct ConvNet {
    stem: nn::Conv2D,
    conv1: nn::Conv2D,
    conv2: nn::Conv2D,
    head: nn::Linear,
}

impl ConvNet {
    pub(super) fn new(path: &nn::Path, channels: i64) -> Self {
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

    /// The mean square of the logits, traced whole (compiled training): the pooled
    /// features through the head as nestor operators.
    fn traced_loss(&self, images: &NestedTensor) -> nestor::Result<nestor::Dense> {
        let channels = self.head.ws.size()[1];
        self.features(images)?
            .reshape_tail(&[channels])?
            .linear(&self.head.ws, self.head.bs.as_ref())?
            .square()?
            .mean(&[], false)?
            .into_dense_handle()
    }

    pub(super) fn columns<'a>(
        &'a self,
        store: &'a nn::VarStore,
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
        let compiled = Some(self.compiled(store, images, &stepper, false));
        Ok(Columns {
            padded,
            per_element,
            nestor,
            compiled,
            padded_mask: None,
        })
    }

    /// The compiled column (the stepper's mode; in mixed precision when `mixed`).
    pub(super) fn compiled<'a>(
        &'a self,
        store: &'a nn::VarStore,
        images: &'a Images,
        stepper: &Stepper,
        mixed: bool,
    ) -> CompiledStep<'a> {
        let precision = if mixed { Kind::BFloat16 } else { Kind::Float };
        match stepper.mode {
            Mode::Inference => {
                let function = compile("convnet", move |inputs: &[NestedTensor], _: &[Dense]| {
                    self.features(&inputs[0])
                })
                .autocast(precision);
                compiled_step(function, vec![&images.nested], move |pooled| {
                    self.head(pooled.values())
                })
            }
            Mode::Training => {
                let function = compile("convnet", move |inputs: &[NestedTensor], _: &[Dense]| {
                    self.traced_loss(&inputs[0])
                })
                .train(store)
                .autocast(precision);
                stepper.compiled_training(function, vec![&images.nested])
            }
        }
    }
}
