//! Tracing: trace-then-interpret equals eager on batches of other lengths, graphs do not
//! depend on lengths, concrete reads and untraceable operators are clear errors, and the
//! traced graphs of an FFN block, an encoder layer and a loss match golden files.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{batch, close, golden, lengths, random_images};
use nestor::nn::{TransformerConfig, TransformerEncoder, TransformerEncoderLayer};
use nestor::{trace, Dense, LossReduction, NestedError, NestedTensor, Reduce, Traced, Value};
use proptest::prelude::*;
use tch::{nn, Device, Kind, Tensor};

type Model<'a> = dyn Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Vec<Output>> + 'a;

/// A traced function's result: a batch or a dense handle.
enum Output {
    Nested(NestedTensor),
    Dense(Dense),
}

impl nestor::TraceOutputs for Output {
    fn trace_refs(&self) -> Vec<Option<nestor::TraceRef>> {
        match self {
            Output::Nested(nested) => nested.trace_refs(),
            Output::Dense(dense) => dense.trace_refs(),
        }
    }
}

impl From<NestedTensor> for Output {
    fn from(nested: NestedTensor) -> Self {
        Output::Nested(nested)
    }
}
impl From<nestor::Reduced> for Output {
    fn from(reduced: nestor::Reduced) -> Self {
        match reduced {
            nestor::Reduced::Nested(nested) => Output::Nested(nested),
            nestor::Reduced::Dense(dense) => Output::Dense(dense),
        }
    }
}
impl From<Dense> for Output {
    fn from(dense: Dense) -> Self {
        Output::Dense(dense)
    }
}

/// Compares eager outputs with interpreted ones.
fn assert_same(eager: &[Output], interpreted: Vec<Value>, kind: Kind, family: &str) {
    assert_eq!(eager.len(), interpreted.len(), "{family}: output count");
    for (position, (eager, interpreted)) in eager.iter().zip(interpreted).enumerate() {
        match (eager, interpreted) {
            (Output::Nested(eager), Value::Nested(interpreted)) => {
                assert_eq!(
                    eager.layout(),
                    interpreted.layout(),
                    "{family}: output {position} layout"
                );
                assert!(
                    close(eager.values(), interpreted.values(), kind),
                    "{family}: output {position}"
                );
            }
            (Output::Dense(eager), Value::Dense(interpreted)) => {
                assert!(
                    close(eager.tensor(), &interpreted, kind),
                    "{family}: output {position}"
                );
            }
            (_, other) => panic!("{family}: output {position} has the wrong kind: {other:?}"),
        }
    }
}

/// Traces `model` on `example`, then checks that interpreting the graph on `other`
/// (other lengths) gives what running the model eagerly on `other` gives.
fn check_family(
    family: &str,
    model: &Model<'_>,
    example: &[&NestedTensor],
    other: &[&NestedTensor],
    dense: &[&Tensor],
    kind: Kind,
) -> Traced {
    let traced = trace(family, example, dense, None, |inputs, dense| {
        model(inputs, dense)
    })
    .unwrap_or_else(|error| panic!("{family}: {error}"));
    let eager_inputs: Vec<NestedTensor> = other.iter().map(|n| (*n).clone()).collect();
    let eager_dense: Vec<Dense> = dense
        .iter()
        .map(|t| Dense::from(t.shallow_clone()))
        .collect();
    let eager = model(&eager_inputs, &eager_dense).unwrap();
    // Every traced graph round-trips through the text form.
    assert_eq!(
        nestor::ir::parse(&traced.text()).unwrap(),
        *traced.graph(),
        "{family}"
    );
    // The optimized graph (DCE, CSE, fusion) interprets to the same results.
    let optimized = nestor::passes::Pipeline::optimizing(nestor::passes::Limits::untimed())
        .run(traced.graph())
        .unwrap();
    let interpreted_optimized =
        nestor::interpret(&optimized, traced.bind(other, dense).unwrap()).unwrap();
    let eager_again = model(
        &other.iter().map(|n| (*n).clone()).collect::<Vec<_>>(),
        &dense
            .iter()
            .map(|t| Dense::from(t.shallow_clone()))
            .collect::<Vec<_>>(),
    )
    .unwrap();
    assert_same(&eager_again, interpreted_optimized, kind, family);
    let interpreted = traced
        .run(other, dense)
        .unwrap_or_else(|error| panic!("{family}: {error}"));
    assert_same(&eager, interpreted, kind, family);
    traced
}

fn families(weights: &Weights) -> Vec<(&'static str, Box<Model<'static>>)> {
    let w = weights.linear.shallow_clone();
    let b = weights.bias.shallow_clone();
    let g = weights.gamma.shallow_clone();
    let tail = weights.tail.shallow_clone();
    let table = weights.table.shallow_clone();
    vec![
        (
            "unary",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![
                    x[0].relu()?.into(),
                    x[0].gelu("tanh")?.exp()?.into(),
                    x[0].sigmoid()?.neg()?.into(),
                    x[0].tanh()?.abs()?.sqrt()?.into(),
                ])
            }),
        ),
        (
            "binary",
            Box::new(move |x: &[NestedTensor], _: &[Dense]| {
                let sum = (&x[0] + &x[0])?;
                Ok(vec![
                    (&sum * 0.5)?.into(),
                    (2.0 - &x[0])?.into(),
                    x[0].mul(&tail)?.into(),
                    x[0].maximum(&x[0].neg()?)?.into(),
                    x[0].lt(0.25)?.into(),
                ])
            }),
        ),
        (
            "where",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                let positive = x[0].gt(0.0)?;
                Ok(vec![
                    x[0].where_self(&positive, 0.0)?.into(),
                    x[0].masked_fill(&positive, -1.0)?.into(),
                    x[0].to_kind(Kind::Double)?.into(),
                ])
            }),
        ),
        (
            "linear",
            Box::new(move |x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![
                    x[0].linear(&w, Some(&b))?.into(),
                    x[0].matmul(&w.transpose(0, 1))?.into(),
                ])
            }),
        ),
        (
            "norms",
            Box::new(move |x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![
                    x[0].layer_norm(&[4], Some(&g), None, 1e-5)?.into(),
                    x[0].rms_norm(&[4], Some(&g), Some(1e-6))?.into(),
                    x[0].dropout(0.5, false)?.into(),
                ])
            }),
        ),
        (
            "softmax",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![x[0].softmax(1)?.into(), x[0].log_softmax(-1)?.into()])
            }),
        ),
        (
            "reduce",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![
                    x[0].sum(&[1], false)?.into(),
                    x[0].mean(&[2], true)?.into(),
                    x[0].logsumexp(&[1, 2], false)?.into(),
                    x[0].reduce(Reduce::Var { correction: 0 }, &[], false)?
                        .into(),
                    x[0].amax(&[-1], false)?.into(),
                    x[0].argmax(-1, false)?.into(),
                    x[0].sort(1, true)?.0.into(),
                    x[0].argsort(1, false)?.into(),
                    x[0].kthvalue(2, -1, false)?.0.into(),
                    x[0].topk(2, -1, false)?.0.into(),
                ])
            }),
        ),
        (
            "structure",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                let heads = x[0].reshape_tail(&[2, 2])?;
                Ok(vec![
                    heads.clone().into(),
                    heads.transpose(2, 3)?.into(),
                    heads.select_static(2, 1)?.into(),
                    x[0].pad()?.into(),
                ])
            }),
        ),
        (
            "repeat",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                let repeated = x[0].repeat_batch(2)?;
                Ok(vec![
                    (&repeated + &repeated)?.into(),
                    x[0].repeat_interleave(3)?.softmax(1)?.into(),
                ])
            }),
        ),
        (
            "embedding",
            Box::new(move |x: &[NestedTensor], _: &[Dense]| {
                let ids = x[0]
                    .gt(0.0)?
                    .to_kind(Kind::Int64)?
                    .sum(&[2], false)?
                    .into_nested()?;
                Ok(vec![ids.embedding(&table, -1)?.into()])
            }),
        ),
        (
            "attention",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                let heads = x[0].reshape_tail(&[2, 2])?;
                let keys = x[1].reshape_tail(&[2, 2])?;
                Ok(vec![
                    heads
                        .scaled_dot_product_attention(&keys, &keys, false, None)?
                        .into(),
                    heads
                        .scaled_dot_product_attention(&heads, &heads, true, Some(0.3))?
                        .into(),
                ])
            }),
        ),
        (
            "loss",
            Box::new(|x: &[NestedTensor], labels: &[Dense]| {
                let pooled = x[0].mean(&[1], false)?.into_dense_handle()?;
                let logits = pooled.relu()?.scale(2.0)?;
                let targets = x[0].gt(0.0)?.to_kind(Kind::Int64)?.select_static(2, 0)?;
                let token_loss = x[0].cross_entropy(&targets, -100, 0.1, LossReduction::Mean)?;
                Ok(vec![
                    logits
                        .cross_entropy(&labels[0], -100, 0.0, LossReduction::Mean)?
                        .into(),
                    token_loss.into(),
                ])
            }),
        ),
    ]
}

struct Weights {
    linear: Tensor,
    bias: Tensor,
    gamma: Tensor,
    tail: Tensor,
    table: Tensor,
}

fn weights() -> Weights {
    tch::manual_seed(0);
    let options = (Kind::Float, Device::Cpu);
    Weights {
        linear: Tensor::randn([6, 4], options),
        bias: Tensor::randn([6], options),
        gamma: Tensor::randn([4], options),
        tail: Tensor::randn([4], options),
        table: Tensor::randn([5, 3], options),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(12), ..ProptestConfig::default() })]

    #[test]
    fn trace_then_interpret_equals_eager_on_other_lengths(
        example_lengths in lengths(5, 7),
        other_lengths in lengths(5, 7),
        seed in 0i64..1000,
    ) {
        // Keys never empty (softmax over no keys is NaN in both paths, which hides
        // nothing) and one longer than the queries: equal lengths at trace time would
        // make the graph share one lengths input for both (see `trace`).
        let nonempty = |lengths: &[i64]| lengths.iter().map(|&l| l + 1).collect::<Vec<_>>();
        let weights = weights();
        let (example, _) = batch(&example_lengths, &[4], Kind::Float, seed);
        let (example_keys, _) = batch(&nonempty(&example_lengths), &[4], Kind::Float, seed + 1);
        let (other, _) = batch(&other_lengths, &[4], Kind::Float, seed + 2);
        let (other_keys, _) = batch(&nonempty(&other_lengths), &[4], Kind::Float, seed + 3);
        let example_labels = Tensor::zeros([example_lengths.len() as i64], (Kind::Int64, Device::Cpu));
        let other_labels = Tensor::ones([other_lengths.len() as i64], (Kind::Int64, Device::Cpu));
        for (family, model) in families(&weights) {
            let (example_inputs, other_inputs): (Vec<&NestedTensor>, Vec<&NestedTensor>) = if family == "attention" {
                (vec![&example, &example_keys], vec![&other, &other_keys])
            } else {
                (vec![&example], vec![&other])
            };
            if family == "loss" {
                let traced = trace(family, &example_inputs, &[&example_labels], None, |x, d| model(x, d)).unwrap();
                let eager = model(std::slice::from_ref(&other), &[Dense::from(other_labels.shallow_clone())]).unwrap();
                assert_same(&eager, traced.run(&other_inputs, &[&other_labels]).unwrap(), Kind::Float, family);
            } else {
                check_family(family, model.as_ref(), &example_inputs, &other_inputs, &[], Kind::Float);
            }
        }
    }

    #[test]
    fn a_two_layer_encoder_traces_and_interprets(example_lengths in lengths(4, 6), other_lengths in lengths(4, 6), norm_first in any::<bool>(), seed in 0i64..1000) {
        tch::manual_seed(seed);
        let store = nn::VarStore::new(Device::Cpu);
        let config = TransformerConfig { d_model: 16, nhead: 4, dim_feedforward: 32, dropout: 0.0, norm_first, ..Default::default() };
        let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, true);
        let (example, _) = batch(&example_lengths, &[16], Kind::Float, seed);
        let (other, _) = batch(&other_lengths, &[16], Kind::Float, seed + 1);
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Output>> { Ok(vec![encoder.forward(&x[0], false)?.into()]) };
        check_family("encoder", &model, &[&example], &[&other], &[], Kind::Float);
    }
}

#[test]
fn graphs_do_not_depend_on_lengths() {
    tch::manual_seed(1);
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: 8,
        nhead: 2,
        dim_feedforward: 16,
        dropout: 0.0,
        ..Default::default()
    };
    let layer = TransformerEncoderLayer::new(&(store.root() / "layer"), &config);
    let (first, _) = batch(&[3, 1, 4], &[8], Kind::Float, 2);
    let (second, _) = batch(&[7, 2], &[8], Kind::Float, 3);
    let text = |example: &NestedTensor| {
        trace("layer", &[example], &[], Some(&store), |x, _| {
            layer.forward(&x[0], false)
        })
        .unwrap()
        .text()
    };
    assert_eq!(text(&first), text(&second));
    // Equal lengths in one batch do not make the ragged dim static.
    let (uniform, _) = batch(&[3, 3], &[8], Kind::Float, 4);
    assert_eq!(text(&first), text(&uniform));
}

#[test]
fn concrete_reads_fail_the_trace_and_name_the_call() {
    let (example, _) = batch(&[3, 1], &[4], Kind::Float, 5);
    for (call, model) in [
        (
            "NestedTensor::len",
            Box::new(|x: &NestedTensor| -> nestor::Result<NestedTensor> {
                if x.len() > 1 {
                    x.relu()
                } else {
                    x.tanh()
                }
            }) as Box<dyn Fn(&NestedTensor) -> nestor::Result<NestedTensor>>,
        ),
        (
            "NestedTensor::shape",
            Box::new(|x: &NestedTensor| {
                let width = x.shape()[2];
                x.mul(width)
            }),
        ),
        (
            "NestedTensor::to_list",
            Box::new(|x: &NestedTensor| {
                x.to_list()?;
                x.relu()
            }),
        ),
        (
            "NestedTensor::values",
            Box::new(|x: &NestedTensor| {
                let _ = x.values().sum(Kind::Float);
                x.relu()
            }),
        ),
        (
            "NestedTensor::tensor (use pad() while tracing)",
            Box::new(|x: &NestedTensor| {
                let _padded = x.tensor()?;
                x.relu()
            }),
        ),
    ] {
        match trace("reads", &[&example], &[], None, |x, _| model(&x[0])) {
            Err(NestedError::Trace { op, .. }) => assert_eq!(op, call),
            Err(other) => panic!("{call}: wrong error {other}"),
            Ok(_) => panic!("{call}: the trace should fail"),
        }
    }
    let dense = trace("dense", &[&example], &[], None, |x, _| {
        let pooled = x[0].sum(&[1], false)?.into_dense()?;
        x[0].mul(&pooled.unsqueeze(1))
    });
    assert!(
        matches!(
            dense,
            Err(NestedError::Trace {
                op: "Dense::into_tensor",
                ..
            })
        ),
        "{dense:?}"
    );
}

#[test]
fn untraceable_operators_and_untraced_outputs_are_errors() {
    let (example, _) = batch(&[3, 1], &[4], Kind::Float, 6);
    let selection = trace("select_batch", &[&example], &[], None, |x, _| {
        x[0].select_batch(1..)
    });
    assert!(
        matches!(
            selection,
            Err(NestedError::Trace {
                op: "select_batch",
                ..
            })
        ),
        "{selection:?}"
    );
    // A slice of a ragged dim that is not the elements' one leading ragged dim.
    let slice = trace("slice", &[&example], &[], None, |x, _| {
        x[0].cdist(&x[0], 2.0)?.slice(2, 1..)
    });
    assert!(
        matches!(slice, Err(NestedError::Trace { op: "slice", .. })),
        "{slice:?}"
    );
    let (untraced, _) = batch(&[3, 1], &[4], Kind::Float, 7);
    let mixed = trace("mixed", &[&example], &[], None, |x, _| &x[0] + &untraced);
    assert!(
        matches!(mixed, Err(NestedError::Trace { op: "add", .. })),
        "{mixed:?}"
    );
    let constant = trace("constant", &[&example], &[], None, |_, _| {
        Ok(untraced.clone())
    });
    assert!(
        matches!(constant, Err(NestedError::Trace { op: "trace", .. })),
        "{constant:?}"
    );
}

#[test]
fn running_a_graph_on_bad_input_is_a_typed_error() {
    let weights = weights();
    let (example, _) = batch(&[3, 1], &[4], Kind::Float, 8);
    let traced = trace("linear", &[&example], &[], None, |x, _| {
        x[0].linear(&weights.linear, None)
    })
    .unwrap();
    let (wide, _) = batch(&[2, 2], &[5], Kind::Float, 9);
    assert!(matches!(
        traced.run(&[&wide], &[]),
        Err(NestedError::InputMismatch { .. })
    ));
    let (double, _) = batch(&[2, 2], &[4], Kind::Double, 9);
    assert!(matches!(
        traced.run(&[&double], &[]),
        Err(NestedError::InputMismatch { .. })
    ));
    assert!(matches!(
        traced.run(&[], &[]),
        Err(NestedError::InputMismatch { .. })
    ));
    let (fine, _) = batch(&[5], &[4], Kind::Float, 10);
    assert!(
        traced.run(&[&fine], &[]).is_ok(),
        "the graph keeps working after bad input"
    );
}

#[test]
fn golden_graphs_of_an_ffn_an_encoder_layer_and_a_loss() {
    tch::manual_seed(11);
    let store = nn::VarStore::new(Device::Cpu);
    let root = store.root();
    let linear1 = nn::linear(&root / "ffn" / "linear1", 8, 32, Default::default());
    let linear2 = nn::linear(&root / "ffn" / "linear2", 32, 8, Default::default());
    let config = TransformerConfig {
        d_model: 8,
        nhead: 2,
        dim_feedforward: 16,
        dropout: 0.1,
        ..Default::default()
    };
    let layer = TransformerEncoderLayer::new(&(&root / "layer"), &config);
    let classifier = nn::linear(&root / "classifier", 8, 3, Default::default());
    let (tokens, _) = batch(&[4, 2, 3], &[8], Kind::Float, 12);
    let labels = Tensor::from_slice(&[0i64, 2, 1]);

    let ffn = trace("ffn", &[&tokens], &[], Some(&store), |x, _| {
        let hidden = nestor::nn::linear(&linear1, &x[0])?.gelu("none")?;
        (&x[0] + &nestor::nn::linear(&linear2, &hidden)?)?.layer_norm(&[8], None, None, 1e-5)
    })
    .unwrap();
    golden("ffn", &ffn.text());
    let encoder_layer = trace("encoder_layer", &[&tokens], &[], Some(&store), |x, _| {
        layer.forward(&x[0], true)
    })
    .unwrap();
    golden("encoder_layer", &encoder_layer.text());
    let loss = trace("loss", &[&tokens], &[&labels], Some(&store), |x, labels| {
        let pooled = layer
            .forward(&x[0], false)?
            .mean(&[1], false)?
            .into_dense_handle()?;
        pooled
            .linear(&classifier.ws, classifier.bs.as_ref())?
            .cross_entropy(&labels[0], -100, 0.0, LossReduction::Mean)
    })
    .unwrap();
    golden("loss", &loss.text());
}

/// The graph of a loss over the operators added for compiled coverage (a segmented and a
/// row scan, clamp, expm1 and log1p, logsumexp over a ragged and a static dim, cdist and
/// a repeated batch): `gpu-check` trains it on a GPU against the CPU runtime.
#[test]
fn golden_graph_of_the_coverage_loss() {
    tch::manual_seed(13);
    let store = nn::VarStore::new(Device::Cpu);
    let linear = nn::linear(store.root() / "proj", 4, 4, Default::default());
    let (tokens, _) = batch(&[5, 1, 0, 3], &[4], Kind::Float, 14);
    let loss = trace("coverage_loss", &[&tokens], &[], Some(&store), |x, _| {
        let hidden = nestor::nn::linear(&linear, &x[0])?.tanh()?;
        let scans = (&hidden.cumsum(1)? + &hidden.sigmoid()?.cumprod(2)?)?;
        let row_lse = hidden.logsumexp(&[2], true)?.into_nested()?;
        let mixed = (&scans.clamp(Some(-1.5), Some(1.5))?.expm1()? * &row_lse)?;
        let repeated = mixed
            .repeat_batch(2)?
            .sum(&[], false)?
            .into_dense_handle()?;
        let distances = hidden.cdist(&hidden, 2.0)?.log1p()?;
        let distances = distances.sum(&[], false)?.into_dense_handle()?;
        let ragged_lse = hidden.logsumexp(&[1], false)?.into_dense_handle()?;
        repeated.add(&distances)?.add(&ragged_lse.sum_all()?)
    })
    .unwrap();
    golden("coverage_loss", &loss.text());
}

/// The graph of a loss over the order ops (sorts, running extremes, top values, k-th
/// values, extremes; down the ragged dim, along the last dim, along an inner dim):
/// `gpu-check` trains it on a GPU against the CPU runtime. The ops read the input
/// shifted by a parameter per column (down the ragged dim) or one for everything
/// (along a row), so that its gradient does not depend on how bf16 rounding breaks ties.
#[test]
fn golden_graph_of_the_order_loss() {
    let store = nn::VarStore::new(Device::Cpu);
    let columns = store
        .root()
        .var("column_shift", &[4], nn::Init::Const(0.25));
    let all = store.root().var("shift", &[1], nn::Init::Const(-0.5));
    let (tokens, _) = batch(&[5, 1, 0, 3], &[4], Kind::Float, 15);
    let loss = trace("order_loss", &[&tokens], &[], Some(&store), |x, _| {
        let total = |x: NestedTensor| x.sum(&[], false)?.into_dense_handle();
        let down = (&x[0] + &columns)?;
        let sorted = down.sort(1, true)?.0.cumsum(1)?.sin()?;
        let running = (&down.cummax(1)?.0 * &down)?;
        let along = (&x[0] + &all)?;
        let top = along.topk(2, -1, true)?.0.tanh()?;
        let kth = along.kthvalue(2, -1, true)?.0;
        let largest = along.max_dim(-1, true)?.0.into_nested()?;
        let inner = along
            .reshape_tail(&[2, 2])?
            .sort(2, false)?
            .0
            .cumsum(3)?
            .sin()?;
        total(sorted)?
            .add(&total(running)?)?
            .add(&total(top)?)?
            .add(&total((&kth.into_nested()? * &largest)?)?)?
            .add(&total(inner)?)
    })
    .unwrap();
    golden("order_loss", &loss.text());
}

#[test]
fn dumps_write_text_and_dot() {
    let (example, _) = batch(&[2, 3], &[4], Kind::Float, 13);
    let traced = trace("dumped", &[&example], &[], None, |x, _| x[0].relu()).unwrap();
    let dir = std::env::temp_dir().join(format!("nestor-dump-{}", std::process::id()));
    traced.dump(&dir, "00-traced").unwrap();
    let text = std::fs::read_to_string(dir.join("dumped.00-traced.nir")).unwrap();
    assert_eq!(nestor::ir::parse(&text).unwrap(), *traced.graph());
    assert!(std::fs::read_to_string(dir.join("dumped.00-traced.dot"))
        .unwrap()
        .starts_with("digraph"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn per_element_convolution_and_pooling_trace_as_regions() {
    tch::manual_seed(14);
    let weight = Tensor::randn([4, 3, 3, 3], (Kind::Float, Device::Cpu));
    let bias = Tensor::randn([4], (Kind::Float, Device::Cpu));
    let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Output>> {
        let features = x[0]
            .conv2d(&weight, Some(&bias), [1, 1], [1, 1], [1, 1], 1)?
            .relu()?;
        let pooled = features.max_pool2d([2, 2], [2, 2], [0, 0])?;
        Ok(vec![
            pooled.clone().into(),
            pooled.avg_pool2d([2, 2], [1, 1], [0, 0])?.into(),
            features.adaptive_avg_pool2d([2, 2])?.into(),
        ])
    };
    let example = random_images(&[(6, 7), (9, 5)], 15);
    let other = random_images(&[(8, 8), (5, 11), (12, 6)], 16);
    let traced = check_family("conv", &model, &[&example], &[&other], &[], Kind::Float);
    let text = traced.text();
    assert!(
        text.contains("per_element(") && text.contains("window_lengths("),
        "{text}"
    );
    assert_eq!(nestor::ir::parse(&text).unwrap(), *traced.graph());
}
