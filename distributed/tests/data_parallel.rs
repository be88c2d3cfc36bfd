//! Data-parallel compiled training across 2 processes on loopback, against one process
//! on the union of the ranks' batches.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use nestor_distributed::{DataParallel, DistributedError, GroupConfig, ProcessGroup, ReduceOp};
use nestor_frontend::{compile, Compiled, Dense, LossReduction, NestedTensor, Result};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const VOCABULARY: i64 = 13;
const WIDTH: i64 = 8;

/// A small language model: embedding, layer norm, self-attention, a gelu layer, logits.
struct Model {
    embedding: Tensor,
    norm: (Tensor, Tensor),
    qkv: Tensor,
    up: (Tensor, Tensor),
    head: Tensor,
}

impl Model {
    /// The model's parameters in `store`, of `kind`.
    fn new(store: &mut nn::VarStore, kind: Kind) -> Self {
        let path = store.root();
        let model = Self {
            embedding: path.randn("embedding", &[VOCABULARY, WIDTH], 0.0, 0.5),
            norm: (
                path.ones("norm_weight", &[WIDTH]),
                path.zeros("norm_bias", &[WIDTH]),
            ),
            qkv: path.randn("qkv", &[3 * WIDTH, WIDTH], 0.0, 0.3),
            up: (
                path.randn("up_weight", &[WIDTH, WIDTH], 0.0, 0.3),
                path.randn("up_bias", &[WIDTH], 0.0, 0.1),
            ),
            head: path.randn("head", &[VOCABULARY, WIDTH], 0.0, 0.3),
        };
        store.set_kind(kind);
        model
    }

    /// The mean cross entropy of the next tokens `x[1]` after tokens `x[0]`.
    fn loss(&self, x: &[NestedTensor]) -> Result<Dense> {
        let h = x[0].embedding(&self.embedding, -1)?;
        let h = h.layer_norm(&[WIDTH], Some(&self.norm.0), Some(&self.norm.1), 1e-5)?;
        let qkv = h
            .linear(&self.qkv, None)?
            .reshape_tail(&[3, 2, WIDTH / 2])?;
        let (q, k, v) = (
            qkv.select_static(2, 0)?,
            qkv.select_static(2, 1)?,
            qkv.select_static(2, 2)?,
        );
        let attended = q
            .scaled_dot_product_attention(&k, &v, true, None)?
            .reshape_tail(&[WIDTH])?;
        let h = (&h + &attended)?;
        let h = (&h + &h.linear(&self.up.0, Some(&self.up.1))?.gelu("none")?)?;
        h.linear(&self.head, None)?
            .cross_entropy(&x[1], -100, 0.0, LossReduction::Mean)?
            .into_dense_handle()
    }
}

/// Sequences of token ids of the given lengths (from `seed`), as (inputs, targets).
fn sequences(lengths: &[i64], seed: i64) -> Vec<(Tensor, Tensor)> {
    tch::manual_seed(seed);
    lengths
        .iter()
        .map(|&length| {
            let ids = Tensor::randint(VOCABULARY, [length + 1], (Kind::Int64, Device::Cpu));
            (ids.narrow(0, 0, length), ids.narrow(0, 1, length))
        })
        .collect()
}

/// The batch (inputs, targets) of `sequences` and its token count.
fn batch(sequences: &[(Tensor, Tensor)]) -> ([NestedTensor; 2], usize) {
    let ragged = |tensors: Vec<Tensor>| {
        NestedTensor::builder()
            .ragged_dims(&[0])
            .tensors(&tensors)
            .expect("a batch")
    };
    let inputs = ragged(sequences.iter().map(|(x, _)| x.shallow_clone()).collect());
    let targets = ragged(sequences.iter().map(|(_, y)| y.shallow_clone()).collect());
    let tokens = sequences.iter().map(|(x, _)| x.size()[0] as usize).sum();
    ([inputs, targets], tokens)
}

fn compiled<'m>(
    model: &'m Model,
    store: &nn::VarStore,
) -> Compiled<impl Fn(&[NestedTensor], &[Dense]) -> Result<Dense> + 'm> {
    compile("language_model", move |x: &[NestedTensor], _: &[Dense]| {
        model.loss(x)
    })
    .train(store)
}

/// Every parameter's values, by name, sorted.
fn values(store: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut named: Vec<_> = store.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

fn zero_grad(store: &nn::VarStore) {
    for (_, tensor) in store.variables() {
        let mut grad = tensor.grad();
        if grad.defined() {
            let _ = grad.zero_();
        }
    }
}

fn group() -> ProcessGroup {
    let config = GroupConfig::from_env()
        .unwrap()
        .timeout(Duration::from_secs(60));
    ProcessGroup::new(&config).unwrap()
}

/// The global batches of a test: each step's sequences, split unevenly between the two
/// ranks (rank 0 takes the first `split`), lengths 1 and up; in the last, rank 1's only
/// sequence is empty (no tokens: its NaN mean loss adds nothing).
const STEPS: [(&[i64], usize); 4] = [
    (&[5, 1, 9, 3, 7], 3),
    (&[1, 12], 1),
    (&[4, 4, 2, 6, 11, 1], 2),
    (&[6, 0], 1),
];

#[test]
fn gradients_equal_one_process_on_the_union_batch() {
    let test = "gradients_equal_one_process_on_the_union_batch";
    if !is_worker(test) {
        let outputs = finish_all(spawn_ranks(test, 2, |_| vec![]), Duration::from_secs(120));
        assert_all_succeeded(&outputs);
        return;
    }
    gradients_against_the_union_batch(&group());
}

#[test]
fn gradients_equal_one_process_under_torchrun() {
    let test = "gradients_equal_one_process_under_torchrun";
    if !is_worker(test) {
        let outputs = finish_all(vec![spawn_torchrun(test, 2)], Duration::from_secs(120));
        assert_all_succeeded(&outputs);
        return;
    }
    gradients_against_the_union_batch(&group());
}

/// Every step of `STEPS` on this rank's share: `.grad()` equals one process's on the
/// union of the ranks' batches.
fn gradients_against_the_union_batch(group: &ProcessGroup) {
    let rank = group.rank();
    // Different initial values on each rank: DataParallel takes rank 0's.
    tch::manual_seed(100 + rank as i64);
    let mut store = nn::VarStore::new(Device::Cpu);
    let model = Model::new(&mut store, Kind::Double);
    let step = compiled(&model, &store);
    let mut parallel = DataParallel::with_buckets(group, &store, 256, 1024).unwrap();
    assert!(
        parallel.buckets() > 1,
        "several buckets: {}",
        parallel.buckets()
    );

    // One process with the same values, on the union of the ranks' batches.
    let mut single_store = nn::VarStore::new(Device::Cpu);
    let single_model = Model::new(&mut single_store, Kind::Double);
    tch::no_grad(|| {
        for ((_, mine), (_, single)) in values(&store).iter().zip(values(&single_store)) {
            single.shallow_clone().copy_(mine);
        }
    });
    let single = compiled(&single_model, &single_store);

    for (index, (lengths, split)) in STEPS.iter().enumerate() {
        let all = sequences(lengths, index as i64);
        let mine = if rank == 0 {
            &all[..*split]
        } else {
            &all[*split..]
        };
        let ([inputs, targets], tokens) = batch(mine);
        zero_grad(&store);
        parallel
            .step(&step, &[&inputs, &targets], &[], tokens)
            .unwrap();
        let stats = parallel.last_step();
        assert_eq!(stats.global_tokens, lengths.iter().sum::<i64>() as f64);
        // The first buckets (the last layers' gradients) go while the backward runs.
        assert!(stats.launched_early >= 1, "{stats:?}");

        let ([inputs, targets], _) = batch(&all);
        zero_grad(&single_store);
        single.call(&[&inputs, &targets], &[]).unwrap();
        for ((name, mine), (_, reference)) in values(&store).iter().zip(values(&single_store)) {
            let (got, want) = (mine.grad(), reference.grad());
            let error = (&got - &want).abs().max().double_value(&[]);
            let scale = want.abs().max().double_value(&[]).max(1e-30);
            assert!(
                error <= 1e-9 * scale,
                "step {index}, {name}: |error| {error} for |grad| {scale}"
            );
        }
    }
}

#[test]
fn adam_leaves_every_rank_with_identical_parameters() {
    let test = "adam_leaves_every_rank_with_identical_parameters";
    if !is_worker(test) {
        let outputs = finish_all(spawn_ranks(test, 2, |_| vec![]), Duration::from_secs(180));
        assert_all_succeeded(&outputs);
        return;
    }
    let group = group();
    let rank = group.rank();
    tch::manual_seed(7 + rank as i64);
    let mut store = nn::VarStore::new(Device::Cpu);
    let model = Model::new(&mut store, Kind::Float);
    let step = compiled(&model, &store);
    let mut parallel = DataParallel::new(&group, &store).unwrap();
    let mut adam = nn::Adam::default().build(&store, 1e-2).unwrap();
    let mut first = None;
    let mut last = 0.0;
    for index in 0..50 {
        // Ranks hold different lengths and counts every step; one of them a single
        // token now and then.
        let lengths: Vec<i64> = (0..2 + index % 3)
            .map(|i| 1 + (index * 7 + i * 5) % 17)
            .collect();
        let all = sequences(&lengths, 1000 + index);
        let cut = if index % 5 == 0 { 1 } else { all.len() / 2 };
        let mine = if rank == 0 { &all[..cut] } else { &all[cut..] };
        let ([inputs, targets], tokens) = batch(mine);
        adam.zero_grad();
        let loss = parallel
            .step(&step, &[&inputs, &targets], &[], tokens)
            .unwrap();
        let loss = loss
            .into_iter()
            .next()
            .unwrap()
            .into_dense()
            .unwrap()
            .double_value(&[]);
        first.get_or_insert(loss);
        last = loss;
        adam.step();
    }
    assert!(last.is_finite() && first.is_some());
    // Bit-identical: every value's maximum and minimum over the ranks are this rank's.
    for (name, tensor) in values(&store) {
        let flat = tensor.detach().reshape([-1]).contiguous();
        let (max, min) = (flat.copy(), flat.copy());
        group
            .all_reduce(&max, ReduceOp::Max)
            .unwrap()
            .wait()
            .unwrap();
        group
            .all_reduce(&min, ReduceOp::Min)
            .unwrap()
            .wait()
            .unwrap();
        assert!(
            max.equal(&flat) && min.equal(&flat),
            "{name} differs between the ranks"
        );
    }
}

#[test]
fn ranks_with_different_models_are_an_error() {
    let test = "ranks_with_different_models_are_an_error";
    if !is_worker(test) {
        let outputs = finish_all(spawn_ranks(test, 2, |_| vec![]), Duration::from_secs(60));
        assert_all_succeeded(&outputs);
        return;
    }
    let group = group();
    let store = nn::VarStore::new(Device::Cpu);
    let width = if group.rank() == 0 { 4 } else { 5 };
    let _w = store.root().zeros("w", &[width, 3]);
    match DataParallel::new(&group, &store) {
        Err(DistributedError::Mismatch { rank, message }) => {
            assert_eq!(rank, group.rank());
            assert!(message.contains("different models"), "{message}");
        }
        Err(other) => panic!("expected a mismatch, got {other}"),
        Ok(_) => panic!("expected a mismatch, got a DataParallel"),
    }
}

#[test]
fn a_rank_that_dies_mid_training_is_an_error_on_the_other() {
    let test = "a_rank_that_dies_mid_training_is_an_error_on_the_other";
    if !is_worker(test) {
        let outputs = finish_all(spawn_ranks(test, 2, |_| vec![]), Duration::from_secs(90));
        assert_all_succeeded(&outputs);
        return;
    }
    let config = GroupConfig::from_env()
        .unwrap()
        .timeout(Duration::from_secs(10));
    let group = ProcessGroup::new(&config).unwrap();
    let mut store = nn::VarStore::new(Device::Cpu);
    let model = Model::new(&mut store, Kind::Float);
    let step = compiled(&model, &store);
    let mut parallel = DataParallel::new(&group, &store).unwrap();
    let all = sequences(&[4, 7], 3);
    let mine = &all[group.rank()..group.rank() + 1];
    let ([inputs, targets], tokens) = batch(mine);
    parallel
        .step(&step, &[&inputs, &targets], &[], tokens)
        .unwrap();
    if group.rank() == 1 {
        std::process::exit(0); // gone before the second step
    }
    let started = std::time::Instant::now();
    match parallel.step(&step, &[&inputs, &targets], &[], tokens) {
        Err(DistributedError::Collective { rank: 0, .. }) => {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "{:?}",
                started.elapsed()
            );
        }
        other => panic!("expected a collective error, got {:?}", other.map(|_| ())),
    }
}
