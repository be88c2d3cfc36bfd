//! The fortunes language model that the compiled-training examples train: a small
//! decoder-only Transformer over bytes, the quotations of Debian's `fortunes` package
//! (installed by `make demo` / `scripts/setup.sh`) and their batches.

use nestor::{Dense, LossReduction, NestedTensor};
use tch::nn;
use tch::{Device, Kind, Tensor};

/// Where Debian's `fortunes` package keeps its quotations.
pub const CORPUS: &str = "/usr/share/games/fortunes";
const VOCABULARY: i64 = 256;
const WIDTH: i64 = 64;
const HEADS: i64 = 4;
const LAYERS: usize = 2;
/// The longest sequence the model takes (its position table's size).
pub const LONGEST: usize = 96;

/// A decoder-only Transformer over bytes: token and position embeddings, pre-norm
/// blocks of causal self-attention and a feed-forward layer, tied to nothing.
pub struct LanguageModel {
    tokens: Tensor,
    positions: Tensor,
    blocks: Vec<Block>,
    norm: (Tensor, Tensor),
    head: Tensor,
}

struct Block {
    norm1: (Tensor, Tensor),
    qkv: (Tensor, Tensor),
    out: (Tensor, Tensor),
    norm2: (Tensor, Tensor),
    up: (Tensor, Tensor),
    down: (Tensor, Tensor),
}

fn linear(path: &nn::Path, name: &str, inputs: i64, outputs: i64) -> (Tensor, Tensor) {
    let bound = 1.0 / (inputs as f64).sqrt();
    let path = path / name;
    (
        path.uniform("weight", &[outputs, inputs], -bound, bound),
        path.zeros("bias", &[outputs]),
    )
}

fn norm(path: &nn::Path, name: &str) -> (Tensor, Tensor) {
    let path = path / name;
    (path.ones("weight", &[WIDTH]), path.zeros("bias", &[WIDTH]))
}

impl LanguageModel {
    pub fn new(path: &nn::Path) -> Self {
        let blocks = (0..LAYERS)
            .map(|layer| {
                let p = path / "blocks" / layer;
                Block {
                    norm1: norm(&p, "norm1"),
                    qkv: linear(&p, "qkv", WIDTH, 3 * WIDTH),
                    out: linear(&p, "out", WIDTH, WIDTH),
                    norm2: norm(&p, "norm2"),
                    up: linear(&p, "up", WIDTH, 4 * WIDTH),
                    down: linear(&p, "down", 4 * WIDTH, WIDTH),
                }
            })
            .collect();
        Self {
            tokens: path.randn("tokens", &[VOCABULARY, WIDTH], 0.0, 0.02),
            positions: path.randn("positions", &[LONGEST as i64, WIDTH], 0.0, 0.02),
            blocks,
            norm: norm(path, "norm"),
            head: path.randn("head", &[VOCABULARY, WIDTH], 0.0, 0.02),
        }
    }

    /// Next-byte logits `[B; L, 256]` of byte ids and their positions `[B; L]`.
    pub fn logits(
        &self,
        ids: &NestedTensor,
        positions: &NestedTensor,
    ) -> nestor::Result<NestedTensor> {
        let mut x =
            (&ids.embedding(&self.tokens, -1)? + &positions.embedding(&self.positions, -1)?)?;
        let head_width = WIDTH / HEADS;
        for block in &self.blocks {
            let h = x.layer_norm(&[WIDTH], Some(&block.norm1.0), Some(&block.norm1.1), 1e-5)?;
            let qkv = h
                .linear(&block.qkv.0, Some(&block.qkv.1))?
                .reshape_tail(&[3, HEADS, head_width])?;
            let (q, k, v) = (
                qkv.select_static(2, 0)?,
                qkv.select_static(2, 1)?,
                qkv.select_static(2, 2)?,
            );
            let attended = q
                .scaled_dot_product_attention(&k, &v, true, None)?
                .reshape_tail(&[WIDTH])?;
            x = (&x + &attended.linear(&block.out.0, Some(&block.out.1))?)?;
            let h = x.layer_norm(&[WIDTH], Some(&block.norm2.0), Some(&block.norm2.1), 1e-5)?;
            let h = h.linear(&block.up.0, Some(&block.up.1))?.gelu("tanh")?;
            x = (&x + &h.linear(&block.down.0, Some(&block.down.1))?)?;
        }
        x.layer_norm(&[WIDTH], Some(&self.norm.0), Some(&self.norm.1), 1e-5)?
            .linear(&self.head, None)
    }

    /// The mean next-byte cross entropy of a batch `(ids, positions, targets)`.
    pub fn loss(&self, x: &[NestedTensor]) -> nestor::Result<Dense> {
        self.logits(&x[0], &x[1])?
            .cross_entropy(&x[2], -100, 0.0, LossReduction::Mean)?
            .into_dense_handle()
    }
}

/// The quotations of every fortune file (plain text files, `%` lines between quotes),
/// as bytes, cut to at most `LONGEST + 1`.
pub fn corpus() -> Result<Vec<Vec<u8>>, Box<dyn std::error::Error>> {
    let mut quotes = Vec::new();
    for entry in std::fs::read_dir(CORPUS).map_err(|error| {
        format!("{CORPUS}: {error} (scripts/setup.sh installs Debian's `fortunes` package)")
    })? {
        let path = entry?.path();
        if path.extension().is_some() || !path.is_file() {
            continue;
        }
        let text = std::fs::read(&path)?;
        for quote in text.split(|&byte| byte == b'%') {
            let quote: Vec<u8> = quote
                .iter()
                .copied()
                .skip_while(|b| b.is_ascii_whitespace())
                .collect();
            if quote.len() > 8 {
                quotes.push(quote[..quote.len().min(LONGEST + 1)].to_vec());
            }
        }
    }
    Ok(quotes)
}

/// One batch: byte ids, positions and next-byte targets of quotes of similar length.
pub fn batch(quotes: &[&Vec<u8>]) -> nestor::Result<[NestedTensor; 3]> {
    let ids = |quote: &Vec<u8>, skip: usize| {
        let bytes: Vec<i64> = quote.iter().map(|&b| b as i64).collect();
        let length = bytes.len() - 1;
        Tensor::from_slice(&bytes[skip..skip + length])
    };
    let inputs: Vec<Tensor> = quotes.iter().map(|q| ids(q, 0)).collect();
    let targets: Vec<Tensor> = quotes.iter().map(|q| ids(q, 1)).collect();
    let positions: Vec<Tensor> = quotes
        .iter()
        .map(|q| Tensor::arange(q.len() as i64 - 1, (Kind::Int64, Device::Cpu)))
        .collect();
    // Sequences are ragged even when a bucket's lengths happen to be equal.
    let ragged = |elements: &[Tensor]| NestedTensor::builder().ragged_dims(&[0]).tensors(elements);
    Ok([ragged(&inputs)?, ragged(&positions)?, ragged(&targets)?])
}
