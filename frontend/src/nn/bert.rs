//! BERT (`transformers`' `BertModel`) on packed token batches, with the parameter names
//! of a Hugging Face checkpoint, loaded from a model folder (`config.json` and
//! `model.safetensors`, as `save_pretrained` writes them).

use std::path::Path;

use tch::{nn, Tensor};

use super::checkpoint::{file_error, Checkpoint};
use super::LayerNorm;
use crate::{NestedError, NestedTensor, Result};

/// What a BERT checkpoint's `config.json` says of the architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    /// Token ids below this.
    pub vocab_size: i64,
    /// Model width.
    pub hidden_size: i64,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer.
    pub num_attention_heads: i64,
    /// Width of each layer's feed-forward block.
    pub intermediate_size: i64,
    /// Positions below this.
    pub max_position_embeddings: i64,
    /// Token types below this.
    pub type_vocab_size: i64,
    /// The layer norms' epsilon.
    pub layer_norm_eps: f64,
    /// The padding token, whose word embedding gets no gradient (as in `transformers`).
    pub pad_token_id: Option<i64>,
}

impl BertConfig {
    /// Reads `config.json` of a model folder. Only the exact GELU (`"gelu"`) and
    /// absolute positions are supported; anything else is an error naming the field.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|error| file_error(path, error))?;
        Self::from_json(&text).map_err(|reason| NestedError::File {
            path: path.display().to_string(),
            reason,
        })
    }

    /// Parses the text of a `config.json`.
    pub fn from_json(text: &str) -> std::result::Result<Self, String> {
        let json: serde_json::Value =
            serde_json::from_str(text).map_err(|error| format!("not JSON: {error}"))?;
        let integer = |name: &str| -> std::result::Result<i64, String> {
            json.get(name)
                .and_then(serde_json::Value::as_i64)
                .filter(|&value| value > 0)
                .ok_or_else(|| format!("`{name}` is missing or not a positive integer"))
        };
        let text_field = |name: &str, default: &str, allowed: &[&str]| {
            let value = json
                .get(name)
                .and_then(serde_json::Value::as_str)
                .unwrap_or(default)
                .to_string();
            if allowed.contains(&value.as_str()) {
                Ok(())
            } else {
                Err(format!("`{name}` is {value:?}; supported: {allowed:?}"))
            }
        };
        text_field("hidden_act", "gelu", &["gelu"])?;
        text_field("position_embedding_type", "absolute", &["absolute"])?;
        let config = Self {
            vocab_size: integer("vocab_size")?,
            hidden_size: integer("hidden_size")?,
            num_hidden_layers: integer("num_hidden_layers")? as usize,
            num_attention_heads: integer("num_attention_heads")?,
            intermediate_size: integer("intermediate_size")?,
            max_position_embeddings: integer("max_position_embeddings")?,
            type_vocab_size: integer("type_vocab_size")?,
            layer_norm_eps: json
                .get("layer_norm_eps")
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(1e-12),
            // `transformers` defaults to 0; `null` means none.
            pad_token_id: match json.get("pad_token_id") {
                None => Some(0),
                Some(value) => value.as_i64(),
            },
        };
        if config.hidden_size % config.num_attention_heads != 0 {
            return Err(format!(
                "`hidden_size` {} is not a multiple of `num_attention_heads` {}",
                config.hidden_size, config.num_attention_heads
            ));
        }
        Ok(config)
    }
}

/// A dense layer `y = x W^T + b`.
#[derive(Debug)]
struct Dense {
    weight: Tensor,
    bias: Tensor,
}

impl Dense {
    fn new(path: &nn::Path, inputs: i64, outputs: i64) -> Self {
        let bound = 1.0 / (inputs as f64).sqrt();
        Self {
            weight: path.uniform("weight", &[outputs, inputs], -bound, bound),
            bias: path.zeros("bias", &[outputs]),
        }
    }

    fn forward(&self, x: &NestedTensor) -> Result<NestedTensor> {
        x.linear(&self.weight, Some(&self.bias))
    }
}

/// One encoder layer (post-norm): self-attention with separate query, key and value
/// projections, then the feed-forward block, each with a residual and a layer norm.
#[derive(Debug)]
struct BertLayer {
    query: Dense,
    key: Dense,
    value: Dense,
    attention_output: Dense,
    attention_norm: LayerNorm,
    intermediate: Dense,
    output: Dense,
    output_norm: LayerNorm,
    heads: i64,
}

impl BertLayer {
    fn new(path: &nn::Path, config: &BertConfig) -> Self {
        let (width, inner) = (config.hidden_size, config.intermediate_size);
        let attention = path / "attention";
        let norm = |path: nn::Path| LayerNorm::new(&path, &[width], config.layer_norm_eps);
        Self {
            query: Dense::new(&(&attention / "self" / "query"), width, width),
            key: Dense::new(&(&attention / "self" / "key"), width, width),
            value: Dense::new(&(&attention / "self" / "value"), width, width),
            attention_output: Dense::new(&(&attention / "output" / "dense"), width, width),
            attention_norm: norm(&attention / "output" / "LayerNorm"),
            intermediate: Dense::new(&(path / "intermediate" / "dense"), width, inner),
            output: Dense::new(&(path / "output" / "dense"), inner, width),
            output_norm: norm(path / "output" / "LayerNorm"),
            heads: config.num_attention_heads,
        }
    }

    fn forward(&self, x: &NestedTensor) -> Result<NestedTensor> {
        let width = x.last_static_width("BertLayer")?;
        let heads = [self.heads, width / self.heads];
        let q = self.query.forward(x)?.reshape_tail(&heads)?;
        let k = self.key.forward(x)?.reshape_tail(&heads)?;
        let v = self.value.forward(x)?.reshape_tail(&heads)?;
        let attended = q
            .scaled_dot_product_attention(&k, &v, false, None)?
            .reshape_tail(&[width])?;
        let x = self
            .attention_norm
            .forward(&(&self.attention_output.forward(&attended)? + x)?)?;
        let inner = self.intermediate.forward(&x)?.gelu("none")?;
        self.output_norm
            .forward(&(&self.output.forward(&inner)? + &x)?)
    }
}

/// BERT's encoder (`transformers`' `BertModel`) on packed token ids `[B; L_i]`: word,
/// position and token-type embeddings with their layer norm, post-norm layers with
/// separate query / key / value projections and exact GELU, and the optional pooler.
/// Its parameters carry the checkpoint's names (`embeddings.word_embeddings.weight`,
/// `encoder.layer.0.attention.self.query.weight`, `pooler.dense.weight`, ...), so
/// [`Bert::load`] fills them from a Hugging Face model folder.
///
/// Position ids are an input: [`Bert::positions`] makes them (0 at every sequence's
/// first token) outside a traced or compiled model, which takes them as a batch.
///
/// ```
/// use nestor_frontend::nn::{Bert, BertConfig};
/// use nestor_frontend::NestedTensor;
/// use tch::{nn, Device, Tensor};
///
/// let config = BertConfig::from_json(r#"{"vocab_size": 50, "hidden_size": 16,
///     "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 32,
///     "max_position_embeddings": 64, "type_vocab_size": 2}"#).unwrap();
/// let store = nn::VarStore::new(Device::Cpu);
/// let bert = Bert::new(&store.root(), &config, true);
/// assert!(store.variables().contains_key("encoder.layer.1.attention.self.query.weight"));
/// let ids = NestedTensor::builder().ragged_dims(&[0]).tensors(&[
///     Tensor::from_slice(&[3i64, 7, 1]),
///     Tensor::from_slice(&[9i64]),
/// ])?;
/// let positions = Bert::positions(&ids)?;
/// let hidden = bert.forward(&ids, None, &positions)?;
/// assert_eq!(hidden.shape(), [2, 3, 16]);
/// assert_eq!(bert.pooled(&hidden)?.size(), [2, 16]);
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
#[derive(Debug)]
pub struct Bert {
    word_embeddings: Tensor,
    position_embeddings: Tensor,
    token_type_embeddings: Tensor,
    embeddings_norm: LayerNorm,
    layers: Vec<BertLayer>,
    pooler: Option<Dense>,
    config: BertConfig,
}

impl Bert {
    /// A randomly initialized BERT under `path` (the pooler when `pooler`).
    pub fn new(path: &nn::Path, config: &BertConfig, pooler: bool) -> Self {
        let embeddings = path / "embeddings";
        let table = |name: &str, rows: i64| {
            (&embeddings / name).randn("weight", &[rows, config.hidden_size], 0.0, 0.02)
        };
        Self {
            word_embeddings: table("word_embeddings", config.vocab_size),
            position_embeddings: table("position_embeddings", config.max_position_embeddings),
            token_type_embeddings: table("token_type_embeddings", config.type_vocab_size),
            embeddings_norm: LayerNorm::new(
                &(&embeddings / "LayerNorm"),
                &[config.hidden_size],
                config.layer_norm_eps,
            ),
            layers: (0..config.num_hidden_layers)
                .map(|index| BertLayer::new(&(path / "encoder" / "layer" / index), config))
                .collect(),
            pooler: pooler.then(|| {
                Dense::new(
                    &(path / "pooler" / "dense"),
                    config.hidden_size,
                    config.hidden_size,
                )
            }),
            config: config.clone(),
        }
    }

    /// The BERT of a Hugging Face model folder (`config.json`, `model.safetensors`):
    /// its parameters in `store` under `path`, their values the checkpoint's (names with
    /// or without the `bert.` prefix of task models). The pooler is built when the
    /// checkpoint has one. A missing or mis-shaped tensor, a truncated file or a config
    /// nestor does not support is a [`NestedError::File`] naming it.
    pub fn load(folder: &Path, path: &nn::Path) -> Result<Self> {
        let config = BertConfig::from_json_file(&folder.join("config.json"))?;
        let checkpoint = Checkpoint::read(&folder.join("model.safetensors"))?;
        let names = checkpoint.names()?;
        let prefix = if names.iter().any(|name| name.starts_with("bert.")) {
            "bert."
        } else {
            ""
        };
        let pooler = format!("{prefix}pooler.dense.weight");
        let bert = Self::new(path, &config, names.contains(&pooler));
        checkpoint.load(bert.parameters(), prefix)?;
        Ok(bert)
    }

    /// Every parameter with its checkpoint name.
    fn parameters<'a>(&'a self) -> Vec<(String, &'a Tensor)> {
        let mut named: Vec<(String, &Tensor)> = vec![
            (
                "embeddings.word_embeddings.weight".into(),
                &self.word_embeddings,
            ),
            (
                "embeddings.position_embeddings.weight".into(),
                &self.position_embeddings,
            ),
            (
                "embeddings.token_type_embeddings.weight".into(),
                &self.token_type_embeddings,
            ),
        ];
        fn pair<'a>(named: &mut Vec<(String, &'a Tensor)>, name: String, pair: [&'a Tensor; 2]) {
            named.push((format!("{name}.weight"), pair[0]));
            named.push((format!("{name}.bias"), pair[1]));
        }
        let norm = |named: &mut Vec<(String, &'a Tensor)>, name, norm: &'a LayerNorm| {
            pair(named, name, [&norm.weight, &norm.bias])
        };
        let dense = |named: &mut Vec<(String, &'a Tensor)>, name, dense: &'a Dense| {
            pair(named, name, [&dense.weight, &dense.bias])
        };
        norm(
            &mut named,
            "embeddings.LayerNorm".into(),
            &self.embeddings_norm,
        );
        for (index, layer) in self.layers.iter().enumerate() {
            let at = |part: &str| format!("encoder.layer.{index}.{part}");
            dense(&mut named, at("attention.self.query"), &layer.query);
            dense(&mut named, at("attention.self.key"), &layer.key);
            dense(&mut named, at("attention.self.value"), &layer.value);
            dense(
                &mut named,
                at("attention.output.dense"),
                &layer.attention_output,
            );
            norm(
                &mut named,
                at("attention.output.LayerNorm"),
                &layer.attention_norm,
            );
            dense(&mut named, at("intermediate.dense"), &layer.intermediate);
            dense(&mut named, at("output.dense"), &layer.output);
            norm(&mut named, at("output.LayerNorm"), &layer.output_norm);
        }
        if let Some(pooler) = &self.pooler {
            dense(&mut named, "pooler.dense".into(), pooler);
        }
        named
    }

    /// The architecture.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// Every token's position in its sequence (0 first), as BERT's position ids
    /// ([`NestedTensor::ragged_positions`]: packed, from the lengths), outside a traced
    /// model (pass them in).
    pub fn positions(ids: &NestedTensor) -> Result<NestedTensor> {
        ids.ragged_leading()?.ragged_positions()
    }

    /// The last hidden states `[B; L_i, hidden]` of token ids `[B; L_i]`, their token
    /// types (all 0 when `None`) and positions ([`Bert::positions`]).
    pub fn forward(
        &self,
        ids: &NestedTensor,
        token_types: Option<&NestedTensor>,
        positions: &NestedTensor,
    ) -> Result<NestedTensor> {
        let padding = self.config.pad_token_id.unwrap_or(-1);
        let mut x = (&ids.embedding(&self.word_embeddings, padding)?
            + &positions.embedding(&self.position_embeddings, -1)?)?;
        x = match token_types {
            Some(types) => (&x + &types.embedding(&self.token_type_embeddings, -1)?)?,
            // Type 0 everywhere: its row, broadcast over the tokens.
            None => x.add(&self.token_type_embeddings.f_get(0)?)?,
        };
        let mut x = self.embeddings_norm.forward(&x)?;
        for layer in &self.layers {
            x = layer.forward(&x)?;
        }
        Ok(x)
    }

    /// The pooler's output `[B, hidden]`: `tanh` of its dense layer on every sequence's
    /// first hidden state (eager only). An error without a pooler.
    pub fn pooled(&self, hidden: &NestedTensor) -> Result<Tensor> {
        let pooler = self.pooler.as_ref().ok_or(NestedError::Unsupported {
            op: "Bert::pooled",
            reason: "this BERT has no pooler".into(),
        })?;
        let first = hidden.select(1, 0)?;
        Ok(first
            .f_linear(&pooler.weight, Some(&pooler.bias))?
            .f_tanh()?)
    }
}
