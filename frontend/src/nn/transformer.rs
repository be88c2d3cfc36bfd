//! Transformer encoder and decoder layers and stacks on packed tokens, pre- or
//! post-norm, with torch's parameter layout.

use tch::nn;

use super::{linear, LayerNorm, MultiheadAttention};
use crate::{NestedTensor, Result};

/// The activation of the feed-forward block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// `max(x, 0)` (torch's default).
    #[default]
    Relu,
    /// Exact GELU.
    Gelu,
}

/// The shape of a transformer layer, with torch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransformerConfig {
    /// Model width.
    pub d_model: i64,
    /// Number of attention heads.
    pub nhead: i64,
    /// Width of the feed-forward block.
    pub dim_feedforward: i64,
    /// Dropout probability (applied in training mode).
    pub dropout: f64,
    /// Feed-forward activation.
    pub activation: Activation,
    /// Layer norm epsilon.
    pub layer_norm_eps: f64,
    /// Pre-norm (norm before each block) instead of post-norm.
    pub norm_first: bool,
}

impl Default for TransformerConfig {
    fn default() -> Self {
        Self {
            d_model: 512,
            nhead: 8,
            dim_feedforward: 2048,
            dropout: 0.1,
            activation: Activation::Relu,
            layer_norm_eps: 1e-5,
            norm_first: false,
        }
    }
}

fn norm(path: &nn::Path, config: &TransformerConfig) -> LayerNorm {
    LayerNorm::new(path, &[config.d_model], config.layer_norm_eps)
}

/// The feed-forward block `linear2(dropout(activation(linear1(x))))`.
#[derive(Debug)]
struct FeedForward {
    linear1: nn::Linear,
    linear2: nn::Linear,
    activation: Activation,
    dropout: f64,
}

impl FeedForward {
    fn new(path: &nn::Path, config: &TransformerConfig) -> Self {
        Self {
            linear1: nn::linear(
                path / "linear1",
                config.d_model,
                config.dim_feedforward,
                Default::default(),
            ),
            linear2: nn::linear(
                path / "linear2",
                config.dim_feedforward,
                config.d_model,
                Default::default(),
            ),
            activation: config.activation,
            dropout: config.dropout,
        }
    }

    fn forward(&self, x: &NestedTensor, train: bool) -> Result<NestedTensor> {
        let hidden = linear(&self.linear1, x)?;
        let hidden = match self.activation {
            Activation::Relu => hidden.relu()?,
            Activation::Gelu => hidden.gelu("none")?,
        };
        linear(&self.linear2, &hidden.dropout(self.dropout, train)?)?.dropout(self.dropout, train)
    }
}

/// One encoder layer: self-attention and feed-forward, each with a residual and norm.
#[derive(Debug)]
pub struct TransformerEncoderLayer {
    /// Self-attention.
    pub self_attn: MultiheadAttention,
    feed_forward: FeedForward,
    /// Norm of the attention block.
    pub norm1: LayerNorm,
    /// Norm of the feed-forward block.
    pub norm2: LayerNorm,
    config: TransformerConfig,
}

impl TransformerEncoderLayer {
    /// A layer with parameters under `path` (`self_attn`, `linear1`, `linear2`, `norm1`,
    /// `norm2`, as in torch).
    pub fn new(path: &nn::Path, config: &TransformerConfig) -> Self {
        Self {
            self_attn: MultiheadAttention::new(
                &(path / "self_attn"),
                config.d_model,
                config.nhead,
                true,
            ),
            feed_forward: FeedForward::new(path, config),
            norm1: norm(&(path / "norm1"), config),
            norm2: norm(&(path / "norm2"), config),
            config: *config,
        }
    }

    /// Encodes packed tokens `[L_i, d_model]`; dropout only when `train`.
    pub fn forward(&self, src: &NestedTensor, train: bool) -> Result<NestedTensor> {
        let attend = |x: &NestedTensor| -> Result<NestedTensor> {
            self.self_attn
                .forward(x, x, x, false)?
                .dropout(self.config.dropout, train)
        };
        if self.config.norm_first {
            let x = (src + &attend(&self.norm1.forward(src)?)?)?;
            &x + &self.feed_forward.forward(&self.norm2.forward(&x)?, train)?
        } else {
            let x = self.norm1.forward(&(src + &attend(src)?)?)?;
            self.norm2
                .forward(&(&x + &self.feed_forward.forward(&x, train)?)?)
        }
    }
}

/// A stack of encoder layers with an optional final norm, on packed tokens.
///
/// ```
/// use nestor_frontend::nn::{TransformerConfig, TransformerEncoder};
/// use nestor_frontend::NestedTensor;
/// use tch::{nn, Device, Kind, Tensor};
///
/// let store = nn::VarStore::new(Device::Cpu);
/// let config = TransformerConfig { d_model: 8, nhead: 2, dim_feedforward: 16, ..Default::default() };
/// let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, true);
/// let tokens = NestedTensor::from_tensors(&[
///     Tensor::randn([5, 8], (Kind::Float, Device::Cpu)),
///     Tensor::randn([2, 8], (Kind::Float, Device::Cpu)),
/// ])?;
/// let encoded = encoder.forward(&tokens, false)?;
/// assert_eq!(encoded.shape(), [2, 5, 8]);
/// // torch's parameter names, so state dicts load unchanged.
/// assert!(store.variables().contains_key("encoder.layers.1.self_attn.in_proj_weight"));
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
#[derive(Debug)]
pub struct TransformerEncoder {
    /// The layers, in order.
    pub layers: Vec<TransformerEncoderLayer>,
    /// The final norm, if any.
    pub norm: Option<LayerNorm>,
}

impl TransformerEncoder {
    /// `num_layers` layers under `path / "layers" / i`, and a final norm under
    /// `path / "norm"` when `final_norm`.
    pub fn new(
        path: &nn::Path,
        config: &TransformerConfig,
        num_layers: usize,
        final_norm: bool,
    ) -> Self {
        let layers = (0..num_layers)
            .map(|index| TransformerEncoderLayer::new(&(path / "layers" / index), config))
            .collect();
        Self {
            layers,
            norm: final_norm.then(|| norm(&(path / "norm"), config)),
        }
    }

    /// Encodes packed tokens through every layer.
    pub fn forward(&self, src: &NestedTensor, train: bool) -> Result<NestedTensor> {
        let mut x = src.shallow_clone();
        for layer in &self.layers {
            x = layer.forward(&x, train)?;
        }
        match &self.norm {
            Some(norm) => norm.forward(&x),
            None => Ok(x),
        }
    }
}

/// One decoder layer: (causal) self-attention, cross-attention over the memory, and
/// feed-forward, each with a residual and norm.
#[derive(Debug)]
pub struct TransformerDecoderLayer {
    /// Self-attention over the targets.
    pub self_attn: MultiheadAttention,
    /// Cross-attention from the targets to the memory.
    pub multihead_attn: MultiheadAttention,
    feed_forward: FeedForward,
    /// Norms of the three blocks.
    pub norms: [LayerNorm; 3],
    config: TransformerConfig,
}

impl TransformerDecoderLayer {
    /// A layer with parameters under `path` (`self_attn`, `multihead_attn`, `linear1`,
    /// `linear2`, `norm1`..`norm3`, as in torch).
    pub fn new(path: &nn::Path, config: &TransformerConfig) -> Self {
        Self {
            self_attn: MultiheadAttention::new(
                &(path / "self_attn"),
                config.d_model,
                config.nhead,
                true,
            ),
            multihead_attn: MultiheadAttention::new(
                &(path / "multihead_attn"),
                config.d_model,
                config.nhead,
                true,
            ),
            feed_forward: FeedForward::new(path, config),
            norms: [
                norm(&(path / "norm1"), config),
                norm(&(path / "norm2"), config),
                norm(&(path / "norm3"), config),
            ],
            config: *config,
        }
    }

    /// Decodes packed targets `[L_i, d_model]` against memory `[M_i, d_model]` (one
    /// memory element per target element; lengths may differ). `causal` masks future
    /// targets in self-attention.
    pub fn forward(
        &self,
        tgt: &NestedTensor,
        memory: &NestedTensor,
        causal: bool,
        train: bool,
    ) -> Result<NestedTensor> {
        let dropout = self.config.dropout;
        let self_block = |x: &NestedTensor| {
            self.self_attn
                .forward(x, x, x, causal)?
                .dropout(dropout, train)
        };
        let cross_block = |x: &NestedTensor| {
            self.multihead_attn
                .forward(x, memory, memory, false)?
                .dropout(dropout, train)
        };
        let [norm1, norm2, norm3] = &self.norms;
        if self.config.norm_first {
            let x = (tgt + &self_block(&norm1.forward(tgt)?)?)?;
            let x = (&x + &cross_block(&norm2.forward(&x)?)?)?;
            &x + &self.feed_forward.forward(&norm3.forward(&x)?, train)?
        } else {
            let x = norm1.forward(&(tgt + &self_block(tgt)?)?)?;
            let x = norm2.forward(&(&x + &cross_block(&x)?)?)?;
            norm3.forward(&(&x + &self.feed_forward.forward(&x, train)?)?)
        }
    }
}

/// A stack of decoder layers with an optional final norm.
#[derive(Debug)]
pub struct TransformerDecoder {
    /// The layers, in order.
    pub layers: Vec<TransformerDecoderLayer>,
    /// The final norm, if any.
    pub norm: Option<LayerNorm>,
}

impl TransformerDecoder {
    /// `num_layers` layers under `path / "layers" / i`, and a final norm under
    /// `path / "norm"` when `final_norm`.
    pub fn new(
        path: &nn::Path,
        config: &TransformerConfig,
        num_layers: usize,
        final_norm: bool,
    ) -> Self {
        let layers = (0..num_layers)
            .map(|index| TransformerDecoderLayer::new(&(path / "layers" / index), config))
            .collect();
        Self {
            layers,
            norm: final_norm.then(|| norm(&(path / "norm"), config)),
        }
    }

    /// Decodes packed targets against the memory through every layer.
    pub fn forward(
        &self,
        tgt: &NestedTensor,
        memory: &NestedTensor,
        causal: bool,
        train: bool,
    ) -> Result<NestedTensor> {
        let mut x = tgt.shallow_clone();
        for layer in &self.layers {
            x = layer.forward(&x, memory, causal, train)?;
        }
        match &self.norm {
            Some(norm) => norm.forward(&x),
            None => Ok(x),
        }
    }
}

/// An encoder-decoder transformer (torch's `nn.Transformer`, both stacks with a final
/// norm).
#[derive(Debug)]
pub struct Transformer {
    /// The encoder stack.
    pub encoder: TransformerEncoder,
    /// The decoder stack.
    pub decoder: TransformerDecoder,
}

impl Transformer {
    /// `encoder_layers` and `decoder_layers` layers under `path / "encoder"` and
    /// `path / "decoder"`.
    pub fn new(
        path: &nn::Path,
        config: &TransformerConfig,
        encoder_layers: usize,
        decoder_layers: usize,
    ) -> Self {
        Self {
            encoder: TransformerEncoder::new(&(path / "encoder"), config, encoder_layers, true),
            decoder: TransformerDecoder::new(&(path / "decoder"), config, decoder_layers, true),
        }
    }

    /// Encodes `src`, then decodes `tgt` against it (`causal` for the decoder's
    /// self-attention).
    pub fn forward(
        &self,
        src: &NestedTensor,
        tgt: &NestedTensor,
        causal: bool,
        train: bool,
    ) -> Result<NestedTensor> {
        let memory = self.encoder.forward(src, train)?;
        self.decoder.forward(tgt, &memory, causal, train)
    }
}
