//! The padded baselines: the same models on padded `[B, L, E]` tensors with key padding
//! masks, written with libtorch ops and the nestor modules' weights (read from the
//! `VarStore` by their torch names). With a batch of one unpadded element they are the
//! per-element baselines too.

use std::collections::HashMap;

use tch::{Kind, Tensor};

use crate::Result;

/// The parameters of a `VarStore`, by name.
pub struct Weights(HashMap<String, Tensor>);

impl Weights {
    /// The parameters of `store`.
    pub fn new(store: &tch::nn::VarStore) -> Self {
        Self(store.variables())
    }

    /// The parameter `name`.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.0
            .get(name)
            .ok_or_else(|| format!("no parameter {name} in the store").into())
    }
}

/// What a query position may attend to: `keep [B, 1, Lq or 1, Lk]`, true on keys that
/// are data (and, when causal, not in the future); `None` attends to everything.
pub fn attention_mask(
    key_lengths: Option<&[i64]>,
    key_max: i64,
    query_max: i64,
    causal: bool,
) -> Result<Option<Tensor>> {
    let options = (Kind::Bool, tch::Device::Cpu);
    let padding = match key_lengths {
        Some(lengths) => {
            let positions = Tensor::f_arange(key_max, (Kind::Int64, tch::Device::Cpu))?;
            let lengths = Tensor::f_from_slice(lengths)?.f_unsqueeze(1)?;
            Some(
                positions
                    .f_unsqueeze(0)?
                    .f_lt_tensor(&lengths)?
                    .f_view([-1, 1, 1, key_max])?,
            )
        }
        None => None,
    };
    let causal = if causal {
        Some(
            Tensor::f_ones([query_max, key_max], options)?
                .f_tril(0)?
                .f_view([1, 1, query_max, key_max])?,
        )
    } else {
        None
    };
    Ok(match (padding, causal) {
        (Some(padding), Some(causal)) => Some(padding.f_logical_and(&causal)?),
        (mask, None) | (None, mask) => mask,
    })
}

/// Multi-head attention of `query [B, Lq, E]` over `key`/`value [B, Lk, E]` with the
/// weights under `prefix` (`in_proj_weight`, `in_proj_bias`, `out_proj`).
pub fn attention(
    weights: &Weights,
    prefix: &str,
    query: &Tensor,
    memory: &Tensor,
    mask: Option<&Tensor>,
    heads: i64,
) -> Result<Tensor> {
    let in_weight = weights.get(&format!("{prefix}.in_proj_weight"))?;
    let in_bias = weights.get(&format!("{prefix}.in_proj_bias"))?;
    let (batch, query_length, width) = query.size3()?;
    let key_length = memory.size()[1];
    let head_dim = width / heads;
    let project = |x: &Tensor, part: i64, length: i64| -> Result<Tensor> {
        let weight = in_weight.f_narrow(0, part * width, width)?;
        let bias = in_bias.f_narrow(0, part * width, width)?;
        Ok(x.f_linear(&weight, Some(&bias))?
            .f_view([batch, length, heads, head_dim])?
            .f_transpose(1, 2)?)
    };
    let attended = Tensor::f_scaled_dot_product_attention(
        &project(query, 0, query_length)?,
        &project(memory, 1, key_length)?,
        &project(memory, 2, key_length)?,
        mask,
        0.0,
        false,
        None,
        false,
    )?;
    Ok(attended
        .f_transpose(1, 2)?
        .f_reshape([batch, query_length, width])?
        .f_linear(
            weights.get(&format!("{prefix}.out_proj.weight"))?,
            Some(weights.get(&format!("{prefix}.out_proj.bias"))?),
        )?)
}

fn norm(weights: &Weights, prefix: &str, x: &Tensor) -> Result<Tensor> {
    let width = *x.size().last().unwrap_or(&1);
    Ok(x.f_layer_norm(
        [width],
        Some(weights.get(&format!("{prefix}.weight"))?),
        Some(weights.get(&format!("{prefix}.bias"))?),
        1e-5,
        true,
    )?)
}

fn feed_forward(weights: &Weights, prefix: &str, x: &Tensor) -> Result<Tensor> {
    let linear = |x: &Tensor, name: &str| -> Result<Tensor> {
        Ok(x.f_linear(
            weights.get(&format!("{prefix}.{name}.weight"))?,
            Some(weights.get(&format!("{prefix}.{name}.bias"))?),
        )?)
    };
    linear(&linear(x, "linear1")?.f_relu()?, "linear2")
}

/// A post-norm encoder stack (`layers` layers under `prefix.layers.i`, a final norm
/// under `prefix.norm` when the store has one) on `x [B, L, E]`.
pub fn encoder(
    weights: &Weights,
    prefix: &str,
    layers: usize,
    x: &Tensor,
    mask: Option<&Tensor>,
    heads: i64,
) -> Result<Tensor> {
    let mut x = x.shallow_clone();
    for index in 0..layers {
        let layer = format!("{prefix}.layers.{index}");
        let attended = attention(weights, &format!("{layer}.self_attn"), &x, &x, mask, heads)?;
        x = norm(weights, &format!("{layer}.norm1"), &(&x + attended))?;
        let hidden = feed_forward(weights, &layer, &x)?;
        x = norm(weights, &format!("{layer}.norm2"), &(&x + hidden))?;
    }
    final_norm(weights, prefix, x)
}

/// A post-norm decoder stack on targets `[B, L, E]` against memory `[B, M, E]`.
#[allow(clippy::too_many_arguments)]
pub fn decoder(
    weights: &Weights,
    prefix: &str,
    layers: usize,
    tgt: &Tensor,
    memory: &Tensor,
    self_mask: Option<&Tensor>,
    memory_mask: Option<&Tensor>,
    heads: i64,
) -> Result<Tensor> {
    let mut x = tgt.shallow_clone();
    for index in 0..layers {
        let layer = format!("{prefix}.layers.{index}");
        let attended = attention(
            weights,
            &format!("{layer}.self_attn"),
            &x,
            &x,
            self_mask,
            heads,
        )?;
        x = norm(weights, &format!("{layer}.norm1"), &(&x + attended))?;
        let crossed = attention(
            weights,
            &format!("{layer}.multihead_attn"),
            &x,
            memory,
            memory_mask,
            heads,
        )?;
        x = norm(weights, &format!("{layer}.norm2"), &(&x + crossed))?;
        let hidden = feed_forward(weights, &layer, &x)?;
        x = norm(weights, &format!("{layer}.norm3"), &(&x + hidden))?;
    }
    final_norm(weights, prefix, x)
}

fn final_norm(weights: &Weights, prefix: &str, x: Tensor) -> Result<Tensor> {
    if weights.get(&format!("{prefix}.norm.weight")).is_ok() {
        norm(weights, &format!("{prefix}.norm"), &x)
    } else {
        Ok(x)
    }
}

/// The conv net on images `[B, 3, H, W]` (zero outside each image's `mask [B, 1, H, W]`,
/// kept zero after every convolution so that borders see what a lone image sees):
/// pooled features `[B, C]` over the real pixels.
pub fn conv_net(weights: &Weights, images: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let conv = |x: &Tensor, name: &str| -> Result<Tensor> {
        let out = x.f_conv2d(
            weights.get(&format!("convnet.{name}.weight"))?,
            Some(weights.get(&format!("convnet.{name}.bias"))?),
            [1, 1],
            [1, 1],
            [1, 1],
            1,
        )?;
        Ok(match mask {
            Some(mask) => out.f_mul(mask)?,
            None => out,
        })
    };
    let stem = conv(images, "stem")?.f_relu()?;
    let hidden = conv(&stem, "conv1")?.f_relu()?;
    let block = (conv(&hidden, "conv2")? + &stem).f_relu()?;
    Ok(match mask {
        Some(mask) => block
            .f_sum_dim_intlist(&[2i64, 3][..], false, None::<Kind>)?
            .f_div(&mask.f_sum_dim_intlist(&[2i64, 3][..], false, None::<Kind>)?)?,
        None => block.f_mean_dim(&[2i64, 3][..], false, None::<Kind>)?,
    })
}
