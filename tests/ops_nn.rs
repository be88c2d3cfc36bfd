//! linear / matmul / embedding, attention, MultiheadAttention and the Transformer
//! layers against per-element libtorch, values and gradients.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_elements, batch, close, float_kinds, lengths};
use nestor::nn::{
    MultiheadAttention, Transformer, TransformerConfig, TransformerDecoderLayer,
    TransformerEncoder, TransformerEncoderLayer,
};
use nestor::{ExecutionGuard, NestedTensor};
use proptest::prelude::*;
use tch::nn::OptimizerConfig;
use tch::{nn, Device, Kind, Tensor};

/// Multi-head attention of one element `[L, E]` over `[M, E]` with plain tch ops and
/// an explicit softmax (no fused kernel), for reference.
fn reference_attention(
    mha: &MultiheadAttention,
    query: &Tensor,
    memory: &Tensor,
    causal: bool,
) -> Tensor {
    reference_attention_of(mha, query, (memory, memory), causal)
}

/// [`reference_attention`] with keys and values from two inputs.
fn reference_attention_of(
    mha: &MultiheadAttention,
    query: &Tensor,
    (keys, values): (&Tensor, &Tensor),
    causal: bool,
) -> Tensor {
    let e = mha.embed_dim;
    let heads = mha.num_heads;
    let head_dim = e / heads;
    let project = |x: &Tensor, index: i64| {
        let weight = mha.in_proj_weight.narrow(0, index * e, e);
        let bias = mha.in_proj_bias.as_ref().map(|b| b.narrow(0, index * e, e));
        x.linear(&weight, bias.as_ref())
            .reshape([-1, heads, head_dim])
            .transpose(0, 1)
    };
    let (q, k, v) = (project(query, 0), project(keys, 1), project(values, 2));
    let mut scores = q.matmul(&k.transpose(1, 2)) / (head_dim as f64).sqrt();
    if causal {
        let (l, m) = (query.size()[0], keys.size()[0]);
        let future = Tensor::ones([l, m], (Kind::Bool, Device::Cpu)).triu(1);
        scores = scores.masked_fill(&future, f64::NEG_INFINITY);
    }
    let attended = scores
        .softmax(-1, None::<Kind>)
        .matmul(&v)
        .transpose(0, 1)
        .reshape([-1, e]);
    attended.linear(&mha.out_proj.ws, mha.out_proj.bs.as_ref())
}

fn reference_layer_norm(norm: &nestor::nn::LayerNorm, x: &Tensor) -> Tensor {
    x.layer_norm(
        &norm.normalized_shape,
        Some(&norm.weight),
        Some(&norm.bias),
        norm.eps,
        false,
    )
}

/// A post- or pre-norm encoder layer on one element, with plain tch ops.
fn reference_encoder_layer(
    store: &nn::VarStore,
    prefix: &str,
    layer: &TransformerEncoderLayer,
    x: &Tensor,
    norm_first: bool,
) -> Tensor {
    let variables = store.variables();
    let get = |name: &str| variables[&format!("{prefix}.{name}")].shallow_clone();
    let feed_forward = |x: &Tensor| {
        x.linear(&get("linear1.weight"), Some(get("linear1.bias")))
            .relu()
            .linear(&get("linear2.weight"), Some(get("linear2.bias")))
    };
    if norm_first {
        let normed = reference_layer_norm(&layer.norm1, x);
        let x = x + reference_attention(&layer.self_attn, &normed, &normed, false);
        &x + feed_forward(&reference_layer_norm(&layer.norm2, &x))
    } else {
        let x = reference_layer_norm(
            &layer.norm1,
            &(x + reference_attention(&layer.self_attn, x, x, false)),
        );
        reference_layer_norm(&layer.norm2, &(&x + feed_forward(&x)))
    }
}

fn small_config(norm_first: bool) -> TransformerConfig {
    TransformerConfig {
        d_model: 16,
        nhead: 4,
        dim_feedforward: 24,
        dropout: 0.0,
        norm_first,
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(16), ..ProptestConfig::default() })]

    #[test]
    fn linear_matmul_and_embedding(lengths in lengths(6, 9), kind in float_kinds(), seed in 0i64..1000) {
        let (nested, elements) = batch(&lengths, &[5], kind, seed);
        let weight = Tensor::randn([7, 5], (Kind::Double, Device::Cpu)).to_kind(kind);
        let bias = Tensor::randn([7], (Kind::Double, Device::Cpu)).to_kind(kind);
        assert_elements(&nested.linear(&weight, Some(&bias)).unwrap(), &elements.iter().map(|e| e.linear(&weight, Some(&bias))).collect::<Vec<_>>(), kind);
        let matrix = weight.transpose(0, 1);
        assert_elements(&nested.matmul(&matrix).unwrap(), &elements.iter().map(|e| e.matmul(&matrix)).collect::<Vec<_>>(), kind);
        let vector = bias.narrow(0, 0, 5);
        assert_elements(&nested.matmul(&vector).unwrap(), &elements.iter().map(|e| e.matmul(&vector)).collect::<Vec<_>>(), kind);
        let table = Tensor::randn([11, 3], (Kind::Double, Device::Cpu)).to_kind(kind);
        let tokens: Vec<Tensor> = lengths.iter().map(|&l| Tensor::randint(11, [l], (Kind::Int64, Device::Cpu))).collect();
        let ids = NestedTensor::builder().ragged_dims(&[0]).tensors(&tokens).unwrap();
        let embedded = ids.embedding(&table, -1).unwrap();
        assert_elements(&embedded, &tokens.iter().map(|t| Tensor::embedding(&table, t, -1, false, false)).collect::<Vec<_>>(), kind);
    }

    #[test]
    fn attention_matches_explicit_softmax(lengths in lengths(5, 7), key_lengths_seed in 0u64..100, causal in any::<bool>(), seed in 0i64..1000) {
        // Queries and keys of different lengths (cross-attention); keys never empty so
        // every softmax has something to normalize.
        let key_lengths: Vec<i64> = lengths.iter().enumerate().map(|(i, _)| 1 + ((key_lengths_seed as i64 + 3 * i as i64) % 6)).collect();
        let (q, q_elements) = batch(&lengths, &[2, 4], Kind::Double, seed);
        let (k, k_elements) = batch(&key_lengths, &[2, 4], Kind::Double, seed + 1);
        let (v, v_elements) = batch(&key_lengths, &[2, 3], Kind::Double, seed + 2);
        let attended = q.scaled_dot_product_attention(&k, &v, causal, None).unwrap();
        assert_elements(&attended, &explicit_attention(&q_elements, &k_elements, &v_elements, causal), Kind::Double);
    }

    #[test]
    fn encoder_layers_match_per_element_reference(lengths in lengths(4, 7), norm_first in any::<bool>(), seed in 0i64..1000) {
        tch::manual_seed(seed);
        let store = nn::VarStore::new(Device::Cpu);
        let layer = TransformerEncoderLayer::new(&(store.root() / "layer"), &small_config(norm_first));
        let (tokens, elements) = batch(&lengths, &[16], Kind::Float, seed);
        let encoded = layer.forward(&tokens, false).unwrap();
        let expected: Vec<Tensor> = elements.iter().map(|e| reference_encoder_layer(&store, "layer", &layer, e, norm_first)).collect();
        assert_elements(&encoded, &expected, Kind::Float);
    }
}

/// `softmax(q k^T / sqrt(D)) v` per element and head, future keys masked when `causal`.
fn explicit_attention(q: &[Tensor], k: &[Tensor], v: &[Tensor], causal: bool) -> Vec<Tensor> {
    q.iter()
        .zip(k)
        .zip(v)
        .map(|((q, k), v)| {
            let (q, k, v) = (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1));
            let scale = (q.size()[2] as f64).sqrt();
            let mut scores = q.matmul(&k.transpose(1, 2)) / scale;
            if causal {
                let future =
                    Tensor::ones([q.size()[1], k.size()[1]], (Kind::Bool, Device::Cpu)).triu(1);
                scores = scores.masked_fill(&future, f64::NEG_INFINITY);
            }
            scores.softmax(-1, None::<Kind>).matmul(&v).transpose(0, 1)
        })
        .collect()
}

#[test]
fn attention_over_batches_of_equal_lengths_and_of_one() -> Result<(), Box<dyn std::error::Error>> {
    // Elements of equal shapes make a batch without a ragged dim (its packed values
    // carry the batch dim): attention once attended over the heads of such batches.
    let element = |seed: i64, rows: i64, width: i64| {
        common::batch(&[rows], &[2, width], Kind::Double, seed)
            .1
            .remove(0)
    };
    for (q_rows, k_rows) in [
        (vec![3, 3], vec![3, 3]),
        (vec![4], vec![4]),
        (vec![2, 5], vec![3, 3]),
    ] {
        let q: Vec<Tensor> = q_rows
            .iter()
            .enumerate()
            .map(|(i, &rows)| element(i as i64, rows, 4))
            .collect();
        let k: Vec<Tensor> = k_rows
            .iter()
            .enumerate()
            .map(|(i, &rows)| element(10 + i as i64, rows, 4))
            .collect();
        let v: Vec<Tensor> = k_rows
            .iter()
            .enumerate()
            .map(|(i, &rows)| element(20 + i as i64, rows, 3))
            .collect();
        let batch = |elements: &[Tensor]| NestedTensor::from_tensors(elements);
        for causal in [false, true] {
            let attended =
                batch(&q)?.scaled_dot_product_attention(&batch(&k)?, &batch(&v)?, causal, None)?;
            assert_eq!(attended.len(), q.len());
            assert_eq!(
                attended.layout().ragged_dims(),
                batch(&q)?.layout().ragged_dims(),
                "the result keeps the queries' structure"
            );
            assert_elements(
                &attended,
                &explicit_attention(&q, &k, &v, causal),
                Kind::Double,
            );
        }
    }
    Ok(())
}

#[test]
fn encoder_gradients_reach_the_var_store_like_per_element_autograd(
) -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(3);
    let store = nn::VarStore::new(Device::Cpu);
    let layer = TransformerEncoderLayer::new(&(store.root() / "layer"), &small_config(false));
    let (tokens, elements) = batch(&[5, 1, 3], &[16], Kind::Float, 4);
    let loss = layer
        .forward(&tokens, false)?
        .values()
        .square()
        .sum(Kind::Float);
    loss.backward();
    let packed_grads: Vec<(String, Tensor)> = store
        .variables()
        .into_iter()
        .map(|(name, t)| (name, t.grad().copy()))
        .collect();
    store.variables().values().for_each(|t| {
        let _ = t.grad().zero_();
    });
    let reference: Tensor = elements
        .iter()
        .map(|e| {
            reference_encoder_layer(&store, "layer", &layer, e, false)
                .square()
                .sum(Kind::Float)
        })
        .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b);
    reference.backward();
    let variables = store.variables();
    for (name, grad) in packed_grads {
        assert!(
            close(&grad, &variables[&name].grad(), Kind::Float)
                || grad.allclose(&variables[&name].grad(), 1e-4, 1e-4, false),
            "gradient of {name}"
        );
    }
    Ok(())
}

#[test]
fn decoder_layer_matches_reference_with_causal_self_attention(
) -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(5);
    let store = nn::VarStore::new(Device::Cpu);
    let layer = TransformerDecoderLayer::new(&(store.root() / "dec"), &small_config(false));
    let (targets, target_elements) = batch(&[4, 2, 1], &[16], Kind::Float, 6);
    let (memory, memory_elements) = batch(&[3, 5, 2], &[16], Kind::Float, 7);
    let decoded = layer.forward(&targets, &memory, true, false)?;
    let variables = store.variables();
    let get = |name: &str| variables[&format!("dec.{name}")].shallow_clone();
    let [norm1, norm2, norm3] = &layer.norms;
    let expected: Vec<Tensor> = target_elements
        .iter()
        .zip(&memory_elements)
        .map(|(t, m)| {
            let x = reference_layer_norm(
                norm1,
                &(t + reference_attention(&layer.self_attn, t, t, true)),
            );
            let x = reference_layer_norm(
                norm2,
                &(&x + reference_attention(&layer.multihead_attn, &x, m, false)),
            );
            let ff = x
                .linear(&get("linear1.weight"), Some(get("linear1.bias")))
                .relu()
                .linear(&get("linear2.weight"), Some(get("linear2.bias")));
            reference_layer_norm(norm3, &(&x + ff))
        })
        .collect();
    assert_elements(&decoded, &expected, Kind::Float);
    Ok(())
}

#[test]
fn stacks_and_the_full_transformer_run_and_train() -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(9);
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        dropout: 0.1,
        ..small_config(true)
    };
    let encoder = TransformerEncoder::new(&(store.root() / "enc"), &config, 2, true);
    let transformer = Transformer::new(&(store.root() / "t"), &config, 2, 2);
    let (src, _) = batch(&[6, 2, 4], &[16], Kind::Float, 10);
    let (tgt, _) = batch(&[3, 5, 1], &[16], Kind::Float, 11);
    assert_eq!(encoder.forward(&src, true)?.shape(), [3, 6, 16]);
    let mut optimizer = nn::Adam::default().build(&store, 1e-2)?;
    let loss = |train| -> nestor::Result<Tensor> {
        Ok(transformer
            .forward(&src, &tgt, true, train)?
            .values()
            .square()
            .mean(Kind::Float))
    };
    let before = loss(false)?.double_value(&[]);
    for _ in 0..20 {
        optimizer.backward_step(&loss(true)?);
    }
    let after = loss(false)?.double_value(&[]);
    assert!(
        after < before,
        "training lowers the loss: {before} -> {after}"
    );
    Ok(())
}

#[test]
fn multihead_self_and_cross_attention_match_reference() -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(1);
    let store = nn::VarStore::new(Device::Cpu);
    let mha = MultiheadAttention::new(&store.root(), 16, 4, true);
    let (x, x_elements) = batch(&[3, 1, 4], &[16], Kind::Float, 2);
    let (m, m_elements) = batch(&[2, 2, 5], &[16], Kind::Float, 3);
    assert_elements(
        &mha.forward(&x, &x, &x, true)?,
        &x_elements
            .iter()
            .map(|e| reference_attention(&mha, e, e, true))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    assert_elements(
        &mha.forward(&x, &m, &m, false)?,
        &x_elements
            .iter()
            .zip(&m_elements)
            .map(|(e, m)| reference_attention(&mha, e, m, false))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    // Keys and values of two inputs (one GEMM each) or of one (one GEMM for both).
    let (values, value_elements) = batch(&[2, 2, 5], &[16], Kind::Float, 4);
    assert_elements(
        &mha.forward(&x, &m, &values, false)?,
        &x_elements
            .iter()
            .zip(&m_elements)
            .zip(&value_elements)
            .map(|((e, m), v)| reference_attention_of(&mha, e, (m, v), false))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    Ok(())
}

#[test]
fn jagged_pair_matmul() -> Result<(), Box<dyn std::error::Error>> {
    let (q, q_elements) = batch(&[3, 1, 2], &[4], Kind::Double, 5);
    let (_, k_elements) = batch(&[3, 1, 2], &[4], Kind::Double, 6);
    let keys_t = NestedTensor::builder().ragged_dims(&[1]).tensors(
        &k_elements
            .iter()
            .map(|k| k.transpose(0, 1))
            .collect::<Vec<_>>(),
    )?;
    let scores = q.matmul_nested(&keys_t)?;
    assert_eq!(scores.layout().ragged_dims(), [0, 1]);
    assert_elements(
        &scores,
        &q_elements
            .iter()
            .zip(&k_elements)
            .map(|(q, k)| q.matmul(&k.transpose(0, 1)))
            .collect::<Vec<_>>(),
        Kind::Double,
    );
    let probabilities = scores.softmax(-1)?;
    let (v, v_elements) = batch(&[3, 1, 2], &[4], Kind::Double, 7);
    let attended = probabilities.matmul_nested(&v)?;
    let expected: Vec<Tensor> = q_elements
        .iter()
        .zip(&k_elements)
        .zip(&v_elements)
        .map(|((q, k), v)| {
            q.matmul(&k.transpose(0, 1))
                .softmax(-1, None::<Kind>)
                .matmul(v)
        })
        .collect();
    assert_elements(&attended, &expected, Kind::Double);
    Ok(())
}

#[test]
fn the_guard_proves_linear_and_norm_paths_are_packed() -> Result<(), Box<dyn std::error::Error>> {
    let (tokens, _) = batch(&[4, 2], &[8], Kind::Float, 1);
    let weight = Tensor::randn([8, 8], (Kind::Float, Device::Cpu));
    let _guard = ExecutionGuard::new();
    let hidden = tokens
        .linear(&weight, None)?
        .gelu("none")?
        .layer_norm(&[8], None, None, 1e-5)?;
    let pooled = hidden.softmax(1)?.mean(&[1], false)?;
    assert!(pooled.into_dense().is_ok());
    assert!(matches!(
        tokens.scaled_dot_product_attention(
            &tokens.reshape_tail(&[2, 4])?,
            &tokens.reshape_tail(&[2, 4])?,
            false,
            None
        ),
        Err(nestor::NestedError::SlowPathForbidden { .. })
    ));
    Ok(())
}
