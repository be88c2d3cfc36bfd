//! Every op of the IR's table is compiled and run somewhere, its results checked
//! against eager: the models below are compiled with `NESTOR_DUMP` set, and the ops of
//! every graph they went through (traced, decomposed, optimized, autodiff) are counted
//! against `Op::VARIANTS`. A new op fails this test until a model here reaches it, or
//! it is listed with the reason it cannot be.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;

use common::families::{families, ids};
use common::{assert_close_within, batch, eager_values, Out};
use nestor::ir::{parse, Graph, Op};
use nestor::{compile, Dense, LossReduction, NestedTensor};
use tch::{nn, Device, Kind, Tensor};

/// Ops no compiled model can reach, and why.
const UNREACHABLE: &[(&str, &str)] = &[
    (
        "Mask",
        "no eager operator records it; it is the optimizer's and the text form's",
    ),
    (
        "MaxLength",
        "no eager operator records it; it is the optimizer's and the text form's",
    ),
    (
        "MseLoss",
        "eager mse_loss records its subtraction, square and reduction; the op is the text form's",
    ),
    (
        "TotalLength",
        "no eager operator records it; it is the optimizer's and the text form's",
    ),
];

/// Ops that do not compile yet (a typed error names them; the interpreter runs them).
const NOT_LOWERED: &[&str] = &[];

/// The variants of `graph`'s ops and of its per-element bodies.
fn variants(graph: &Graph, into: &mut BTreeSet<&'static str>) {
    for node in &graph.nodes {
        into.insert(node.op.variant());
        if let Op::PerElement { body, .. } = &node.op {
            variants(body, into);
        }
    }
}

/// Compiles `model` (a fresh function under `name`), calls it on `inputs` and checks
/// every result against eager.
fn check(
    name: &str,
    inputs: &[&NestedTensor],
    model: impl Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Vec<Out>>,
) {
    let compiled = compile(name, &model).per_element_fallback(true);
    let got = compiled
        .call(inputs, &[])
        .unwrap_or_else(|error| panic!("{name}: {error}"));
    let owned: Vec<NestedTensor> = inputs.iter().map(|x| x.shallow_clone()).collect();
    let want = eager_values(model(&owned, &[]).unwrap());
    assert_close_within(&got, &want, 1e-4, name);
}

fn forward_models() {
    let lengths = [3i64, 0, 1, 6];
    let (x, _) = batch(&lengths, &[4], Kind::Float, 1);
    let tokens = ids(&lengths, 2);
    for (family, model) in families(Kind::Float) {
        check(family, &[&x, &tokens], |x, d| model(x, d));
    }
    check("structure", &[&x, &tokens], |x, _| {
        Ok(vec![
            x[0].gt(0.0)?.to_kind(Kind::Float)?.into(),
            x[0].dropout(0.5, false)?.into(),
            x[0].unsqueeze(2)?.tanh()?.into(),
            Out::Dense(x[0].relu()?.pad()?),
            x[0].cumsum(1)?.into(),
            x[0].cumprod(1)?.into(),
            x[1].ragged_positions()?.into(),
        ])
    });
    check("pairs", &[&x, &x], |x, _| {
        // Jagged pairs (scores, then a mix), and attention written by hand (which the
        // optimizer turns into the attention op).
        let scores = x[0].matmul_nested(&x[1].transpose(1, 2)?)?;
        let attention = (&scores * 0.5)?.softmax(2)?.matmul_nested(&x[1])?;
        let causal = (&scores * 0.5)?
            .causal_fill(f64::NEG_INFINITY)?
            .softmax(2)?
            .matmul_nested(&x[1])?;
        Ok(vec![
            scores.tanh()?.matmul_nested(&x[1])?.into(),
            attention.into(),
            causal.into(),
        ])
    });
    check("inner_dims", &[&x], |x, _| {
        let x = x[0].reshape_tail(&[2, 1, 2])?;
        Ok(vec![
            x.transpose(2, 4)?.into(),
            x.sort(2, false)?.0.into(),
            x.argmax(2, true)?.into(),
            x.argsort(2, false)?.into(),
        ])
    });
    check("repeats", &[&x], |x, _| {
        Ok(vec![
            x[0].repeat_batch(2)?.tanh()?.into(),
            x[0].repeat_interleave(3)?.into(),
        ])
    });
    let classes = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
    check("losses", &[&x, &tokens], |x, _| {
        let logits = x[0].linear(&classes, None)?;
        Ok(vec![
            logits
                .cross_entropy(&x[1], -100, 0.1, LossReduction::Mean)?
                .into(),
            x[0].mse_loss(&x[0].tanh()?, LossReduction::Sum)?.into(),
        ])
    });
    let images: Vec<Tensor> = [(6, 7), (9, 5)]
        .iter()
        .map(|&(h, w)| Tensor::randn([3, h, w], (Kind::Float, Device::Cpu)))
        .collect();
    let images = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&images)
        .unwrap();
    let weight = Tensor::randn([4, 3, 3, 3], (Kind::Float, Device::Cpu));
    let (mean, var) = (
        Tensor::randn([4], (Kind::Float, Device::Cpu)),
        Tensor::rand([4], (Kind::Float, Device::Cpu)) + 0.5,
    );
    // Windows of different formulas that agree on odd sides, added (match_lengths).
    let odd: Vec<Tensor> = [(7, 5), (9, 3)]
        .iter()
        .map(|&(h, w)| Tensor::randn([3, h, w], (Kind::Float, Device::Cpu)))
        .collect();
    let odd = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&odd)
        .unwrap();
    check("window_formulas", &[&odd], |x, _| {
        let three = x[0].max_pool2d([3, 3], [2, 2], [0, 0])?;
        let two = x[0].avg_pool2d([2, 2], [2, 2], [0, 0])?;
        Ok(vec![(&three + &two)?.into()])
    });
    check("per_element", &[&images], |x, _| {
        let features = x[0].conv2d(&weight, None, [1, 1], [1, 1], [1, 1], 1)?;
        // Batch normalization by the running statistics (eval mode) and by the batch's.
        let eval = features.batch_norm(1, Some(&mean), Some(&var), None, None, false, 0.1, 1e-5)?;
        let training = features.batch_norm(1, None, None, Some(&var), None, true, 0.1, 1e-5)?;
        Ok(vec![
            features.max_pool2d([2, 2], [2, 2], [0, 0])?.into(),
            features.adaptive_avg_pool2d([1, 1])?.into(),
            features.adaptive_avg_pool2d([2, 3])?.into(),
            features
                .interpolate_bilinear(Some([3, 5]), None, true)?
                .into(),
            eval.into(),
            training.into(),
        ])
    });
}

/// Training steps of a model with every op family that has a gradient: without
/// dropout its loss equals eager's (the gradients are checked op by op in
/// tests/train.rs); with dropout (random masks) it is finite.
fn training_models() {
    tch::manual_seed(3);
    let store = nn::VarStore::new(Device::Cpu);
    let root = store.root();
    let table = root.randn("table", &[5, 4], 0.0, 1.0);
    let weight = root.randn("weight", &[8, 4], 0.0, 0.5);
    let head = root.randn("head", &[5, 4], 0.0, 0.5);
    let model = |p: f64| {
        let (table, weight, head) = (
            table.shallow_clone(),
            weight.shallow_clone(),
            head.shallow_clone(),
        );
        move |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Dense> {
            let embedded = (&x[1].embedding(&table, -1)? + &x[0])?;
            let qkv = embedded.linear(&weight, None)?.reshape_tail(&[2, 2, 2])?;
            let (q, k) = (qkv.select_static(2, 0)?, qkv.select_static(2, 1)?);
            let attended = q.scaled_dot_product_attention(&k, &k, true, None)?;
            let hidden = attended
                .reshape_tail(&[4])?
                .layer_norm(&[4], None, None, 1e-5)?
                .dropout(p, p > 0.0)?;
            let loss = hidden
                .linear(&head, None)?
                .cross_entropy(&x[2], -100, 0.0, LossReduction::Mean)?
                .into_dense_handle()?;
            // A mean over the ragged dim of a repeated batch (its gradient sums the
            // copies back) and a padded grid in the loss too.
            let mean = hidden
                .repeat_interleave(2)?
                .mean(&[1], false)?
                .into_dense_handle()?
                .sum_all()?;
            let padded = hidden.tanh()?.pad()?.sum_all()?.scale(0.1)?;
            // Sorted values (their gradient goes back where each came from).
            let sorted = hidden
                .sort(1, true)?
                .0
                .sin()?
                .sum(&[], false)?
                .into_dense_handle()?;
            // The largest value of each column (its gradient to that one position).
            let largest = hidden.max_dim(1, false)?.0.into_dense_handle()?.sum_all()?;
            let kth = hidden
                .kthvalue(1, 1, false)?
                .0
                .into_dense_handle()?
                .sum_all()?;
            let running = hidden.cummax(1)?.0.sum(&[], false)?.into_dense_handle()?;
            let top = hidden
                .topk(2, -1, true)?
                .0
                .sum(&[], false)?
                .into_dense_handle()?;
            // And the smallest row of each element's columns.
            let bottom = hidden
                .topk(1, 1, false)?
                .0
                .sum(&[], false)?
                .into_dense_handle()?;
            // A slice of a static dim (its gradient pads it back with zeros).
            let sliced = hidden
                .slice(2, 1..3)?
                .sum(&[], false)?
                .into_dense_handle()?;
            // A language model's shift along the ragged dim (each slice's gradient puts
            // its rows back among zeros).
            let shifted = (&hidden.slice(1, ..-1)? * &hidden.slice(1, 1..)?)?
                .sum(&[], false)?
                .into_dense_handle()?;
            let running = running
                .add(&top)?
                .add(&bottom)?
                .add(&sliced)?
                .add(&shifted)?;
            let total = loss.add(&mean)?.add(&padded)?.add(&sorted)?;
            total.add(&largest)?.add(&kth)?.add(&running)
        }
    };
    let lengths = [3i64, 1, 5];
    let (x, _) = batch(&lengths, &[4], Kind::Float, 4);
    let (tokens, classes) = (ids(&lengths, 5), ids(&lengths, 6));
    let inputs = [&x, &tokens, &classes];
    let loss = |p: f64| {
        let compiled = compile("training", model(p)).train(&store);
        let loss = compiled.call(&inputs, &[]).unwrap().remove(0);
        common::value_parts(&loss).0.double_value(&[])
    };
    let owned = [
        x.shallow_clone(),
        tokens.shallow_clone(),
        classes.shallow_clone(),
    ];
    let eager = model(0.0)(&owned, &[])
        .unwrap()
        .into_tensor()
        .double_value(&[]);
    let compiled = loss(0.0);
    assert!(
        (compiled - eager).abs() < 1e-5 * eager.abs().max(1.0),
        "{compiled} vs {eager}"
    );
    assert!(loss(0.25).is_finite());
    // A conv net: convolutions (the second's input gradient too), both poolings and
    // global average pooling, differentiated.
    let kernel = root.randn("kernel", &[4, 3, 3, 3], 0.0, 0.5);
    let shift = root.randn("shift", &[4], 0.0, 0.5);
    let mixer = root.randn("mixer", &[4, 4, 3, 3], 0.0, 0.5);
    let classifier = root.randn("classifier", &[2, 4], 0.0, 0.5);
    let conv_net = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Dense> {
        let features = x[0]
            .conv2d(&kernel, Some(&shift), [1, 1], [1, 1], [1, 1], 1)?
            .relu()?
            .conv2d(&mixer, None, [1, 1], [2, 2], [2, 2], 1)?
            .max_pool2d([2, 2], [1, 1], [1, 1])?
            .avg_pool2d([3, 3], [2, 2], [1, 1])?;
        // Pooled to one pixel for the head, and to 2 x 2 cells (and interpolated to
        // 3 x 3) in the loss too.
        let cells = features
            .adaptive_avg_pool2d([2, 2])?
            .square()?
            .mean(&[], false)?
            .into_dense_handle()?
            .add(
                &features
                    .interpolate_bilinear(Some([3, 3]), None, false)?
                    .square()?
                    .mean(&[], false)?
                    .into_dense_handle()?,
            )?;
        features
            .adaptive_avg_pool2d([1, 1])?
            .reshape_tail(&[4])?
            .linear(&classifier, None)?
            .square()?
            .mean(&[], false)?
            .into_dense_handle()?
            .add(&cells)
    };
    let images: Vec<Tensor> = [(6, 7), (9, 5), (4, 4)]
        .iter()
        .map(|&(h, w)| Tensor::randn([3, h, w], (Kind::Float, Device::Cpu)))
        .collect();
    let images = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&images)
        .unwrap();
    let compiled = compile("conv_training", conv_net)
        .train(&store)
        .call(&[&images], &[])
        .unwrap()
        .remove(0);
    let compiled = common::value_parts(&compiled).0.double_value(&[]);
    let eager = conv_net(&[images.shallow_clone()], &[])
        .unwrap()
        .into_tensor()
        .double_value(&[]);
    assert!(
        (compiled - eager).abs() < 1e-5 * eager.abs().max(1.0),
        "{compiled} vs {eager}"
    );
}

#[test]
fn every_op_of_the_table_is_compiled_and_run_somewhere() {
    let dir = std::env::temp_dir().join(format!("nestor-coverage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // This test is alone in its binary: no other thread reads the environment.
    std::env::set_var("NESTOR_DUMP", &dir);
    forward_models();
    training_models();
    std::env::remove_var("NESTOR_DUMP");
    let mut seen = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|extension| extension == "nir") {
            let text = std::fs::read_to_string(&path).unwrap();
            let graph = parse(&text).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
            variants(&graph, &mut seen);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let unreachable: BTreeSet<&str> = UNREACHABLE
        .iter()
        .map(|(variant, _)| *variant)
        .chain(NOT_LOWERED.iter().copied())
        .collect();
    let missing: Vec<&str> = Op::VARIANTS
        .iter()
        .copied()
        .filter(|variant| !seen.contains(variant) && !unreachable.contains(variant))
        .collect();
    assert!(missing.is_empty(), "never compiled: {missing:?}");
    let reached: Vec<&str> = UNREACHABLE
        .iter()
        .map(|(variant, _)| *variant)
        .filter(|variant| seen.contains(variant))
        .collect();
    assert!(
        reached.is_empty(),
        "listed as unreachable but compiled: {reached:?}"
    );
}
