//! BERT from a Hugging Face checkpoint: a `BertModel` made by `transformers` in the torch
//! venv (random weights, `save_pretrained`) gives, through nestor's packed model, the
//! same last hidden states on every real token as `transformers` with an attention
//! mask, for sequences of 1 to 512 tokens, eagerly and compiled; a training step's
//! gradients equal PyTorch autograd's; bad checkpoints are typed errors naming what is
//! wrong.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use common::assert_elements_within;
use nestor::nn::{Bert, BertConfig};
use nestor::{compile, Dense, NestedError, NestedTensor, Value};
use tch::{nn, Device, Tensor};

/// The lengths of the reference batch: 1 and the longest BERT takes included.
const LENGTHS: [i64; 4] = [1, 5, 37, 512];

/// Makes a small BERT checkpoint and its outputs on a padded batch in `folder`, with
/// the venv's `transformers`.
const MAKE_CHECKPOINT: &str = r#"
import sys, torch, transformers
from safetensors.torch import save_file
folder, lengths = sys.argv[1], [int(n) for n in sys.argv[2].split(",")]
torch.manual_seed(0)
config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=64, max_position_embeddings=512,
    type_vocab_size=2, hidden_act="gelu", initializer_range=0.3,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
config._attn_implementation = "eager"
model = transformers.BertModel(config).eval()
model.save_pretrained(folder)
rows, longest = len(lengths), max(lengths)
ids = torch.randint(0, 97, (rows, longest))
types = torch.randint(0, 2, (rows, longest))
mask = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).long()
with torch.no_grad():
    out = model(input_ids=ids, token_type_ids=types, attention_mask=mask)
# A training step's gradients: the mean of the real hidden values times a probe.
probe = torch.randn(rows, longest, config.hidden_size)
out_train = model(input_ids=ids, token_type_ids=types, attention_mask=mask)
real = mask[..., None].float()
loss = (out_train.last_hidden_state * probe * real).sum() / (real.sum() * config.hidden_size)
loss.backward()
grads = {"grad." + name: p.grad.contiguous() for name, p in model.named_parameters()
         if p.grad is not None}
save_file({"ids": ids, "types": types, "hidden": out.last_hidden_state.contiguous(),
           "pooled": out.pooler_output.contiguous(), "probe": probe, "loss": loss.detach(),
           **grads}, folder + "/reference.safetensors")
"#;

/// A fresh folder with the checkpoint and the reference outputs.
fn checkpoint(name: &str) -> PathBuf {
    let argument = LENGTHS
        .iter()
        .map(i64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    common::python_made_folder(&format!("bert-{name}"), MAKE_CHECKPOINT, &argument)
}

/// The reference tensors by name.
fn reference(folder: &Path) -> std::collections::HashMap<String, Tensor> {
    common::read_tensors(&folder.join("reference.safetensors"))
}

/// Rows `0..length` of every row of a padded `[B, L, ...]` tensor.
fn unpadded(padded: &Tensor) -> Vec<Tensor> {
    LENGTHS
        .iter()
        .enumerate()
        .map(|(row, &length)| padded.get(row as i64).narrow(0, 0, length))
        .collect()
}

fn ragged(elements: &[Tensor]) -> NestedTensor {
    NestedTensor::builder()
        .ragged_dims(&[0])
        .tensors(elements)
        .unwrap()
}

#[test]
fn a_transformers_checkpoint_gives_transformers_hidden_states_eager_and_compiled() {
    let folder = checkpoint("equal");
    let reference = reference(&folder);
    let store = nn::VarStore::new(Device::Cpu);
    let bert = Bert::load(&folder, &store.root()).unwrap();
    assert_eq!(bert.config().hidden_size, 32);
    let ids = ragged(&unpadded(&reference["ids"]));
    let types = ragged(&unpadded(&reference["types"]));
    let positions = Bert::positions(&ids).unwrap();
    let expected = unpadded(&reference["hidden"]);

    let hidden = tch::no_grad(|| bert.forward(&ids, Some(&types), &positions)).unwrap();
    assert_elements_within("eager last hidden states", &hidden, &expected, 1e-4);
    let pooled = tch::no_grad(|| bert.pooled(&hidden)).unwrap();
    assert!(
        common::close_within(&pooled, &reference["pooled"], 1e-4),
        "pooler output"
    );

    // Compiled, the positions computed in the traced model from every call's lengths.
    let compiled = compile("bert", |x: &[NestedTensor], _: &[Dense]| {
        bert.forward(&x[0], Some(&x[1]), &Bert::positions(&x[0])?)
    });
    let outputs = tch::no_grad(|| compiled.call(&[&ids, &types], &[])).unwrap();
    let Some(Value::Nested(hidden)) = outputs.into_iter().next() else {
        panic!("the compiled BERT returns a batch");
    };
    assert_elements_within("compiled last hidden states", &hidden, &expected, 1e-4);

    // Without token types, every token is of type 0.
    let zeros: Vec<Tensor> = LENGTHS
        .iter()
        .map(|&n| Tensor::zeros([n], tch::kind::INT64_CPU))
        .collect();
    let typed = tch::no_grad(|| bert.forward(&ids, Some(&ragged(&zeros)), &positions)).unwrap();
    let untyped = tch::no_grad(|| bert.forward(&ids, None, &positions)).unwrap();
    assert_elements_within(
        "type 0 by default",
        &untyped,
        &typed.unbind().unwrap(),
        1e-6,
    );
    let _ = std::fs::remove_dir_all(&folder);
}

#[test]
fn training_gradients_equal_pytorch_autograd_eager_and_compiled() {
    let folder = checkpoint("train");
    let reference = reference(&folder);
    let ids = ragged(&unpadded(&reference["ids"]));
    let types = ragged(&unpadded(&reference["types"]));
    let probe = ragged(&unpadded(&reference["probe"]));
    let positions = Bert::positions(&ids).unwrap();
    let expected: Vec<(String, &Tensor)> = reference
        .iter()
        .filter_map(|(name, grad)| Some((name.strip_prefix("grad.")?.to_string(), grad)))
        .collect();
    assert!(expected.len() > 30, "{} gradients", expected.len());
    let check = |store: &nn::VarStore, how: &str| {
        let variables = store.variables();
        for (name, want) in &expected {
            let got = variables[name].grad();
            assert!(got.defined(), "{how}: no gradient for {name}");
            assert!(
                common::close_within(&got, want, 1e-4),
                "{how}: gradient of {name}"
            );
        }
        // The pooler is not in the loss: no gradient.
        assert!(
            !variables["pooler.dense.weight"].grad().defined(),
            "{how}: pooler"
        );
    };

    // Eager: libtorch's autograd through nestor's packed operators.
    let store = nn::VarStore::new(Device::Cpu);
    let bert = Bert::load(&folder, &store.root()).unwrap();
    let hidden = bert.forward(&ids, Some(&types), &positions).unwrap();
    let loss = (&hidden * &probe)
        .unwrap()
        .mean(&[], false)
        .unwrap()
        .into_dense()
        .unwrap();
    assert!(
        common::close_within(&loss, &reference["loss"], 1e-4),
        "eager loss"
    );
    loss.backward();
    check(&store, "eager");

    // Compiled training: the joint program's gradients into `.grad()`.
    let store = nn::VarStore::new(Device::Cpu);
    let bert = Bert::load(&folder, &store.root()).unwrap();
    let step = compile("bert_step", |x: &[NestedTensor], _: &[Dense]| {
        let hidden = bert.forward(&x[0], Some(&x[1]), &Bert::positions(&x[0])?)?;
        (&hidden * &x[2])?.mean(&[], false)?.into_dense_handle()
    })
    .train(&store);
    let outputs = step.call(&[&ids, &types, &probe], &[]).unwrap();
    let loss = outputs.into_iter().next().unwrap().into_dense().unwrap();
    assert!(
        common::close_within(&loss, &reference["loss"], 1e-4),
        "compiled loss"
    );
    check(&store, "compiled");
    let _ = std::fs::remove_dir_all(&folder);
}

/// Loading `folder` fails with a file error whose text contains `what`.
fn assert_load_error(folder: &Path, what: &str) {
    let store = nn::VarStore::new(Device::Cpu);
    match Bert::load(folder, &store.root()) {
        Err(NestedError::File { reason, .. }) => {
            assert!(reason.contains(what), "expected {what:?} in: {reason}")
        }
        Err(other) => panic!("expected a file error about {what:?}, got {other}"),
        Ok(_) => panic!("expected a file error about {what:?}, got a model"),
    }
}

#[test]
fn bad_checkpoints_are_errors_naming_what_is_wrong() {
    let folder = checkpoint("bad");
    let weights = folder.join("model.safetensors");
    let tensors = Tensor::read_safetensors(&weights).unwrap();

    // A tensor missing.
    let without: Vec<(String, Tensor)> = tensors
        .iter()
        .filter(|(name, _)| name != "encoder.layer.1.attention.self.key.bias")
        .map(|(name, tensor)| (name.clone(), tensor.shallow_clone()))
        .collect();
    Tensor::write_safetensors(&without, &weights).unwrap();
    assert_load_error(
        &folder,
        "encoder.layer.1.attention.self.key.bias is missing",
    );

    // A tensor of another shape.
    let reshaped: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(name, tensor)| {
            let tensor = if name == "encoder.layer.0.intermediate.dense.weight" {
                tensor.narrow(0, 0, 60).contiguous()
            } else {
                tensor.shallow_clone()
            };
            (name.clone(), tensor)
        })
        .collect();
    Tensor::write_safetensors(&reshaped, &weights).unwrap();
    assert_load_error(
        &folder,
        "encoder.layer.0.intermediate.dense.weight has shape [60, 32]",
    );

    // A truncated file.
    Tensor::write_safetensors(&tensors, &weights).unwrap();
    let bytes = std::fs::read(&weights).unwrap();
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    assert_load_error(&folder, "not a safetensors file");

    // A config nestor does not support, and one that is not JSON.
    let config = folder.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"gelu\"", "\"relu\"")).unwrap();
    assert_load_error(&folder, "`hidden_act` is \"relu\"");
    std::fs::write(&config, "{ not json").unwrap();
    assert_load_error(&folder, "not JSON");
    std::fs::remove_file(&config).unwrap();
    assert_load_error(&folder, "No such file");
    let _ = std::fs::remove_dir_all(&folder);

    assert!(BertConfig::from_json(r#"{"vocab_size": 5}"#)
        .unwrap_err()
        .contains("`hidden_size` is missing"));
}
