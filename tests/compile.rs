//! `nestor::compile` on the CPU: compiled == eager for every lowered family and a
//! 2-layer encoder, one compile for all lengths, thread safety, typed errors.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::families::{families, families_rounded, ids};
use common::{
    assert_close_within, assert_floats_close_within, assert_same_values, batch, eager_values,
    lengths, random_images, value_parts, Out,
};
use nestor::nn::{TransformerConfig, TransformerEncoder};
use nestor::{compile, Dense, NestedError, NestedTensor, Reduce, Value};
use proptest::prelude::*;
use tch::{nn, Device, Kind, Tensor};

/// Every nested result is of `kind` (or bool).
fn assert_kinds(outputs: &[Value], kind: Kind, family: &str) {
    for output in outputs {
        if let Value::Nested(output) = output {
            assert!(
                matches!(output.kind(), Kind::Bool | Kind::Int64) || output.kind() == kind,
                "{family}: {:?} result",
                output.kind()
            );
        }
    }
}

/// Compiled results agree with eager ones (f32: relative and absolute 1e-4, since the
/// kernels sum in another order than libtorch).
fn assert_close(compiled: &[Value], eager: &[Value], what: &str) {
    assert_close_within(compiled, eager, 1e-4, what)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    #[test]
    fn compiled_equals_eager_for_every_lowered_family(batches in proptest::collection::vec(lengths(5, 9), 1..4), seed in 0i64..1000) {
        // f64 programs compute in f64 (libm exp, tanh, erf): they match libtorch closely.
        for (kind, tolerance) in [(Kind::Float, 1e-4), (Kind::Double, 1e-9)] {
            for (family, model) in families(kind) {
                let compiled = compile(family, |x: &[NestedTensor], d: &[Dense]| model(x, d));
                for (index, lengths) in batches.iter().enumerate() {
                    let (x, _) = batch(lengths, &[4], kind, seed + index as i64);
                    let tokens = ids(lengths, seed + index as i64);
                    let compiled_outputs = compiled.call(&[&x, &tokens], &[]).unwrap_or_else(|error| panic!("{family}: {error}"));
                    let eager = eager_values(model(&[x, tokens], &[]).unwrap());
                    assert_kinds(&compiled_outputs, kind, family);
                    assert_close_within(&compiled_outputs, &eager, tolerance, family);
                }
                prop_assert_eq!(compiled.stats().compiles, 1, "{} compiles once for every lengths", family);
            }
        }
    }

    /// bf16 programs multiplying in f32 (`autocast(Kind::Float)`) and f16 programs
    /// compute in f32 and round each result once: they equal an f32 model on the same
    /// rounded parameters and inputs, rounded to the format, to one step of the format
    /// (two results an f32 rounding apart may round to neighbours), comparisons
    /// included.
    #[test]
    fn half_precision_programs_round_an_f32_computation_once(batches in proptest::collection::vec(lengths(5, 9), 1..3), seed in 0i64..1000) {
        for kind in [Kind::BFloat16, Kind::Half] {
            let reference_models = families_rounded(Kind::Float, kind);
            for ((family, model), (_, reference)) in families(kind).into_iter().zip(reference_models) {
                let compiled = compile(family, |x: &[NestedTensor], d: &[Dense]| model(x, d)).autocast(Kind::Float);
                for (index, lengths) in batches.iter().enumerate() {
                    let (x, _) = batch(lengths, &[4], kind, seed + index as i64);
                    let tokens = ids(lengths, seed + index as i64);
                    let compiled_outputs = compiled.call(&[&x, &tokens], &[]).unwrap_or_else(|error| panic!("{family}: {error}"));
                    assert_kinds(&compiled_outputs, kind, family);
                    let wide = x.to_kind(Kind::Float).unwrap();
                    let expected = eager_values(reference(&[wide, tokens], &[]).unwrap());
                    assert_eq!(compiled_outputs.len(), expected.len(), "{family}: outputs");
                    for (position, (got, want)) in compiled_outputs.iter().zip(&expected).enumerate() {
                        let (got, got_sizes) = value_parts(got);
                        let (want, want_sizes) = value_parts(want);
                        assert_eq!(got_sizes, want_sizes, "{family}: output {position} sizes");
                        let want = if want.is_floating_point() { want.to_kind(kind) } else { want };
                        let step = if kind == Kind::BFloat16 { 2f64.powi(-7) } else { 2f64.powi(-10) };
                        assert_same_values(&got, &want, step, 1e-5, &format!("{family} {kind:?}: output {position}"));
                    }
                }
            }
        }
    }

    /// bf16 models multiply bf16 values with f32 sums, as eager libtorch does (and, on
    /// hosts with bf16 units, on them): every family equals eager bf16 within 2e-2.
    /// f32 models under `autocast(Kind::BFloat16)` multiply the roundings of their
    /// operands: every family equals eager f32 within 2e-2, its results still f32.
    /// (Comparisons are left to `half_precision_programs_round_an_f32_computation_once`:
    /// eager bf16 compares with the scalar rounded to bf16, compiled programs with the
    /// f32 scalar, so a value at the boundary, 0.2 against bf16(0.2) = 0.2002, differs.)
    #[test]
    fn bf16_products_equal_eager_within_bf16_rounding(batches in proptest::collection::vec(lengths(5, 9), 1..3), seed in 0i64..1000) {
        for (kind, autocast) in [(Kind::BFloat16, None), (Kind::Float, Some(Kind::BFloat16))] {
            for (family, model) in families(kind) {
                let mut compiled = compile(family, |x: &[NestedTensor], d: &[Dense]| model(x, d));
                if let Some(autocast) = autocast {
                    compiled = compiled.autocast(autocast);
                }
                for (index, lengths) in batches.iter().enumerate() {
                    let (x, _) = batch(lengths, &[4], kind, seed + index as i64);
                    let tokens = ids(lengths, seed + index as i64);
                    let compiled_outputs = compiled.call(&[&x, &tokens], &[]).unwrap_or_else(|error| panic!("{family}: {error}"));
                    let eager = eager_values(model(&[x, tokens], &[]).unwrap());
                    assert_kinds(&compiled_outputs, kind, family);
                    assert_floats_close_within(&compiled_outputs, &eager, 2e-2, &format!("{family} {kind:?}"));
                }
            }
        }
    }

    /// bf16 products where a size is 1 (one input feature, one output, one row): the
    /// roundings' product once reached MKL's bf16 GEMM with a leading dimension below
    /// the row it read (a `[n, 1]` weight), which it refused, leaving garbage.
    #[test]
    fn bf16_products_with_sizes_of_one_equal_eager(
        lengths in lengths(4, 6),
        (inputs, outputs) in (1i64..=3, 1i64..=3),
        seed in 0i64..1000,
    ) {
        let mut random = common::Random::new(seed);
        let weight = random.normal(&[outputs, inputs]);
        for (kind, autocast) in [(Kind::BFloat16, None), (Kind::Float, Some(Kind::BFloat16))] {
            let weight = weight.to_kind(kind);
            let model = |x: &[NestedTensor], _: &[Dense]| x[0].linear(&weight, None);
            let mut compiled = compile("narrow_linear", model);
            if let Some(autocast) = autocast {
                compiled = compiled.autocast(autocast);
            }
            let (x, _) = batch(&lengths, &[inputs], kind, seed);
            let outputs = compiled.call(&[&x], &[]).unwrap();
            let eager = vec![Value::Nested(model(&[x], &[]).unwrap())];
            assert_floats_close_within(&outputs, &eager, 2e-2, &format!("{kind:?} {inputs} -> {outputs:?}"));
        }
    }

    /// Positions within every element (BERT's position ids), traced from the lengths:
    /// the compiled values equal eager ones for every lengths (0 and 1 included), from
    /// one compile, and embedded they train as autograd does.
    #[test]
    fn ragged_positions_compile_once_for_every_lengths(batches in proptest::collection::vec(lengths(5, 9), 1..4), seed in 0i64..1000) {
        let compiled = compile("positions", |x: &[NestedTensor], _: &[Dense]| x[0].ragged_positions());
        tch::manual_seed(seed);
        let store = nn::VarStore::new(Device::Cpu);
        let table = store.root().randn("table", &[10, 3], 0.0, 1.0);
        let embedded = |x: &NestedTensor| x.ragged_positions()?.embedding(&table, -1)?.sum(&[], false);
        let step = compile("embedded_positions", |x: &[NestedTensor], _: &[Dense]| embedded(&x[0])?.into_dense_handle()).train(&store);
        for lengths in &batches {
            let ids = ids(lengths, seed);
            let outputs = compiled.call(&[&ids], &[]).unwrap();
            let eager = vec![Value::Nested(ids.ragged_positions().unwrap())];
            assert_close_within(&outputs, &eager, 0.0, "positions");
            let zero_grad = || {
                let mut grad = table.grad();
                if grad.defined() {
                    let _ = grad.zero_();
                }
            };
            zero_grad();
            let loss = step.call(&[&ids], &[]).unwrap();
            let compiled_grad = table.grad().copy();
            zero_grad();
            let eager_loss = embedded(&ids).unwrap().into_dense().unwrap();
            eager_loss.backward();
            assert_close_within(&loss, &[Value::Dense(eager_loss)], 1e-5, "loss");
            prop_assert!(common::close_within(&compiled_grad, &table.grad(), 1e-5), "the table's gradient");
        }
        prop_assert_eq!(compiled.stats().compiles, 1);
    }

    #[test]
    fn a_two_layer_encoder_compiles(batches in proptest::collection::vec(lengths(4, 8), 1..3), norm_first in any::<bool>(), seed in 0i64..1000) {
        tch::manual_seed(seed);
        let store = nn::VarStore::new(Device::Cpu);
        let config = TransformerConfig { d_model: 64, nhead: 4, dim_feedforward: 128, dropout: 0.1, norm_first, ..Default::default() };
        let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, true);
        let compiled = compile("encoder", |x: &[NestedTensor], _: &[Dense]| encoder.forward(&x[0], false));
        for (index, lengths) in batches.iter().enumerate() {
            let (tokens, _) = batch(lengths, &[64], Kind::Float, seed + index as i64);
            let compiled_outputs = compiled.call(&[&tokens], &[]).unwrap();
            let eager = vec![Value::Nested(encoder.forward(&tokens, false).unwrap())];
            assert_close(&compiled_outputs, &eager, "encoder");
        }
    }
}

/// A deep stack of linears in mixed precision, whose runs reuse buffers from layer to
/// layer (and whose roundings a run keeps for later steps until a step writes over
/// them): each layer equals the f32 product of the bf16 roundings of its input and
/// weight, run after run with other values.
#[test]
fn mixed_precision_layers_read_the_roundings_of_their_own_inputs() {
    tch::manual_seed(3);
    let layers: Vec<(Tensor, Tensor)> = (0..8)
        .map(|_| {
            let weight = Tensor::randn([16, 16], (Kind::Float, Device::Cpu)) * 0.4;
            (weight, Tensor::randn([16], (Kind::Float, Device::Cpu)))
        })
        .collect();
    let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<NestedTensor> {
        let mut h = x[0].clone();
        for (weight, bias) in &layers {
            h = h.linear(weight, Some(bias))?.relu()?;
        }
        Ok(h)
    };
    let compiled = compile("deep", model).autocast(Kind::BFloat16);
    let rounded = |t: &Tensor| t.to_kind(Kind::BFloat16).to_kind(Kind::Float);
    for (index, lengths) in [vec![5i64, 0, 9], vec![1, 7], vec![5, 0, 9]]
        .iter()
        .enumerate()
    {
        let (x, _) = batch(lengths, &[16], Kind::Float, 40 + index as i64);
        let mut h = x.values().shallow_clone();
        for (weight, bias) in &layers {
            h = rounded(&h)
                .matmul(&rounded(weight).tr())
                .f_add(bias)
                .unwrap()
                .relu();
        }
        let out = compiled
            .call(&[&x], &[])
            .unwrap()
            .remove(0)
            .into_nested()
            .unwrap();
        let error = (out.values() - &h).abs().max().double_value(&[]);
        let scale = h.abs().max().double_value(&[]).max(1.0);
        assert!(
            error <= 1e-3 * scale,
            "run {index}: {error} off (largest {scale})"
        );
    }
}

#[test]
fn a_linear_without_inputs_features_gives_its_bias_after_other_runs() {
    let (weight, bias) = (
        Tensor::zeros([3, 0], (Kind::Float, Device::Cpu)),
        Tensor::randn([3], (Kind::Float, Device::Cpu)),
    );
    let wide = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
    let compiled = compile("empty_inner", |x: &[NestedTensor], _: &[Dense]| {
        let w = if x[0].static_shape()[1] == Some(0) {
            &weight
        } else {
            &wide
        };
        x[0].linear(w, Some(&bias))?.relu()
    });
    // A run with data first, so that reused buffers hold stale values.
    let (full, _) = batch(&[4, 2], &[4], Kind::Float, 1);
    compiled.call(&[&full], &[]).unwrap();
    let (empty, _) = batch(&[4, 2], &[0], Kind::Float, 2);
    let compiled_outputs = compiled.call(&[&empty], &[]).unwrap();
    let eager = vec![Value::Nested(
        empty.linear(&weight, Some(&bias)).unwrap().relu().unwrap(),
    )];
    assert_close(&compiled_outputs, &eager, "linear with k = 0");
}

/// A ragged result takes an input's layout only when every dim agrees: same lengths and
/// static sizes (a relu's), not a linear's wider rows, on empty batches too.
#[test]
fn results_share_an_input_layout_only_when_their_dims_agree() {
    let weight = Tensor::randn([5, 3], (Kind::Float, Device::Cpu));
    let compiled = compile("two", |x: &[NestedTensor], _: &[Dense]| {
        Ok(vec![
            Out::Nested(x[0].relu()?),
            Out::Nested(x[0].linear(&weight, None)?),
        ])
    });
    for lengths in [vec![3i64, 0, 2], vec![], vec![1]] {
        let (x, _) = batch(&lengths, &[3], Kind::Float, 4);
        let outputs = compiled.call(&[&x], &[]).unwrap();
        let eager = vec![
            Value::Nested(x.relu().unwrap()),
            Value::Nested(x.linear(&weight, None).unwrap()),
        ];
        assert_close(&outputs, &eager, "relu and linear");
        for (output, width) in outputs.into_iter().zip([3, 5]) {
            let nested = output.into_nested().unwrap();
            assert_eq!(
                nested.static_shape(),
                vec![None, Some(width)],
                "{lengths:?}"
            );
            assert_eq!(
                nested.values().size(),
                vec![lengths.iter().sum::<i64>(), width]
            );
            assert_eq!(nested.unbind().unwrap().len(), lengths.len());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    #[test]
    fn padded_results_compile(batches in proptest::collection::vec(lengths(4, 6), 1..3), double in any::<bool>(), seed in 0i64..1000) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let compiled = compile("pad", |x: &[NestedTensor], _: &[Dense]| {
            let options = nestor::NestedOptions { padding_value: -2.5, ..x[0].options() };
            let relu = x[0].relu()?.with_options(options);
            Ok(vec![Out::Dense(relu.pad()?), Out::Dense(x[0].pad()?.tanh()?)])
        });
        for (index, lengths) in batches.iter().enumerate() {
            let (x, _) = batch(lengths, &[3], kind, seed + index as i64);
            let compiled_outputs = compiled.call(&[&x], &[]).unwrap();
            let options = nestor::NestedOptions { padding_value: -2.5, ..x.options() };
            let eager = vec![
                Value::Dense(x.relu().unwrap().with_options(options).pad().unwrap().into_tensor()),
                Value::Dense(x.pad().unwrap().tanh().unwrap().into_tensor()),
            ];
            for output in &compiled_outputs {
                let Value::Dense(output) = output else { panic!("a padded result is dense") };
                prop_assert_eq!(output.size(), vec![lengths.len() as i64, lengths.iter().copied().max().unwrap_or(0), 3]);
            }
            assert_close(&compiled_outputs, &eager, "pad");
        }
        prop_assert_eq!(compiled.stats().compiles, 1);
    }
}

#[test]
fn one_compile_serves_a_hundred_batches_and_new_structures_compile_again() {
    let weight = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
    let wide = Tensor::randn([8, 6], (Kind::Float, Device::Cpu));
    let compiled = compile("ffn", |x: &[NestedTensor], _: &[Dense]| {
        let w = if x[0].static_shape()[1] == Some(4) {
            &weight
        } else {
            &wide
        };
        x[0].linear(w, None)?.relu()
    });
    for index in 0..100 {
        let lengths: Vec<i64> = (0..1 + index % 5)
            .map(|i| (index * 7 + i * 3) % 11)
            .collect();
        let (x, _) = batch(&lengths, &[4], Kind::Float, index);
        compiled.call(&[&x], &[]).unwrap();
    }
    let stats = compiled.stats();
    assert_eq!((stats.compiles, stats.cache_hits), (1, 99));
    assert_eq!(
        stats.kernel_launches, 100,
        "a GEMM with its relu as epilogue per call"
    );
    let (wider, _) = batch(&[3, 2], &[6], Kind::Float, 1);
    compiled.call(&[&wider], &[]).unwrap();
    assert_eq!(
        compiled.stats().compiles,
        2,
        "a new static width compiles again"
    );
    let relu = compile("relu", |x: &[NestedTensor], _: &[Dense]| x[0].relu());
    for kind in [Kind::Float, Kind::Double, Kind::Float] {
        let (x, _) = batch(&[3, 2], &[4], kind, 2);
        let output = relu
            .call(&[&x], &[])
            .unwrap()
            .remove(0)
            .into_nested()
            .unwrap();
        assert_eq!(output.kind(), kind);
    }
    assert_eq!(relu.stats().compiles, 2, "a new dtype compiles again, once");
}

#[test]
fn batches_whose_lengths_must_agree_but_do_not_are_typed_errors() {
    let compiled = compile("sum", |x: &[NestedTensor], _: &[Dense]| &x[0] + &x[1]);
    let (a, _) = batch(&[3, 2], &[4], Kind::Float, 1);
    let (b, _) = batch(&[3, 2], &[4], Kind::Float, 2);
    compiled.call(&[&a, &b], &[]).unwrap();
    let (other, _) = batch(&[3, 1], &[4], Kind::Float, 3);
    let (wider_batch, _) = batch(&[3, 2, 1], &[4], Kind::Float, 4);
    for (what, y) in [("lengths", &other), ("batch size", &wider_batch)] {
        // Other lengths are another structure: the model is traced again, and the add
        // of two batches of different structures is an error naming it.
        match compiled.call(&[&a, y], &[]) {
            Err(NestedError::StructureMismatch { op: "add", .. })
            | Err(NestedError::Trace { op: "add", .. }) => {}
            other => panic!("{what}: adding batches of different {what}: {other:?}"),
        }
    }
    assert!(compiled.call(&[&a, &b], &[]).is_ok(), "still works");
}

#[test]
fn concurrent_calls_from_two_threads() {
    let weight = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
    let model_weight = weight.shallow_clone();
    let compiled = compile("threads", move |x: &[NestedTensor], _: &[Dense]| {
        x[0].linear(&model_weight, None)?.softmax(1)
    });
    let (warmup, _) = batch(&[2, 3], &[4], Kind::Float, 0);
    compiled.call(&[&warmup], &[]).unwrap();
    std::thread::scope(|scope| {
        for thread in 0..2 {
            let compiled = &compiled;
            let weight = weight.shallow_clone();
            scope.spawn(move || {
                for round in 0..20 {
                    let (x, _) = batch(
                        &[1 + round % 4, 3, thread + 1],
                        &[4],
                        Kind::Float,
                        thread * 100 + round,
                    );
                    let compiled_outputs = compiled.call(&[&x], &[]).unwrap();
                    let eager = vec![Value::Nested(
                        x.linear(&weight, None).unwrap().softmax(1).unwrap(),
                    )];
                    assert_close(&compiled_outputs, &eager, "threads");
                }
            });
        }
    });
    assert_eq!(compiled.stats().compiles, 1);
}

#[test]
fn bad_input_is_a_typed_error_and_the_function_keeps_working() {
    let weight = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
    let compiled = compile("checked", |x: &[NestedTensor], _: &[Dense]| {
        x[0].linear(&weight, None)
    });
    let (good, _) = batch(&[3, 1], &[4], Kind::Float, 0);
    compiled.call(&[&good], &[]).unwrap();
    let (wrong_width, _) = batch(&[3, 1], &[5], Kind::Float, 1);
    assert!(matches!(
        compiled.call(&[&wrong_width], &[]),
        Err(NestedError::DenseOperand { op: "linear", .. })
    ));
    let (double, _) = batch(&[3, 1], &[4], Kind::Double, 2);
    let (single, _) = batch(&[3, 1], &[4], Kind::Float, 2);
    let mixed = compile("mixed", |x: &[NestedTensor], _: &[Dense]| {
        Ok(vec![x[0].relu()?, x[1].relu()?])
    });
    match mixed.call(&[&double, &single], &[]) {
        Err(NestedError::Compile {
            stage: "lowering",
            reason,
        }) => assert!(reason.contains("mixes f64"), "{reason}"),
        other => panic!("mixing f64 and f32 in one program: {other:?}"),
    }
    let ragged_last = NestedTensor::from_lists(vec![vec![1.0f32, 2.0], vec![3.0]]).unwrap();
    assert!(matches!(
        compiled.call(&[&ragged_last], &[]),
        Err(NestedError::Unsupported { op: "linear", .. })
    ));
    let (other, _) = batch(&[7], &[4], Kind::Float, 3);
    assert!(
        compiled.call(&[&other], &[]).is_ok(),
        "still works after bad input"
    );
}

/// Targets computed in the model (a cast to i64 compiles, but computed ids are not an
/// input the host checks before the run): the loss's one-hot rows are a lowering error
/// naming the op.
#[test]
fn ops_without_a_lowering_are_errors_naming_the_op() {
    let compiled = compile("loss", |x: &[NestedTensor], _: &[Dense]| {
        let targets = x[0].gt(0.0)?.to_kind(Kind::Int64)?.select_static(2, 0)?;
        x[0].cross_entropy(&targets, -100, 0.0, nestor::LossReduction::Mean)
    });
    let (x, _) = batch(&[3, 1], &[4], Kind::Float, 0);
    match compiled.call(&[&x], &[]) {
        Err(NestedError::Compile {
            stage: "lowering",
            reason,
        }) => assert!(
            reason.contains("one_hot") && reason.contains("integer input"),
            "{reason}"
        ),
        other => panic!("expected a lowering error, got {other:?}"),
    }
}

#[test]
fn batches_of_equal_lengths_reuse_the_ragged_program() {
    tch::manual_seed(3);
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: 16,
        nhead: 2,
        dim_feedforward: 32,
        dropout: 0.0,
        ..Default::default()
    };
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 1, false);
    let compiled = compile("uniform", |x: &[NestedTensor], _: &[Dense]| {
        encoder.forward(&x[0], false)
    });
    let elements = |lengths: &[i64]| -> Vec<Tensor> {
        lengths
            .iter()
            .map(|&l| Tensor::randn([l, 16], (Kind::Float, Device::Cpu)))
            .collect()
    };
    let ragged = NestedTensor::from_tensors(&elements(&[3, 5])).unwrap();
    let uniform = NestedTensor::from_tensors(&elements(&[4, 4, 4])).unwrap();
    assert!(
        uniform.layout().ragged_dims().is_empty(),
        "equal lengths pack densely"
    );
    for batch in [&ragged, &uniform] {
        let compiled_outputs = compiled.call(&[batch], &[]).unwrap();
        let eager = vec![Value::Nested(
            encoder
                .forward(batch, false)
                .unwrap()
                .ragged_leading()
                .unwrap(),
        )];
        assert_close(&compiled_outputs, &eager, "uniform");
    }
    assert_eq!(compiled.stats().compiles, 1);
}

/// A 2-layer encoder (d_model 32, 4 heads, no dropout) with parameters of `kind`.
fn small_encoder(seed: i64, kind: Kind) -> (nn::VarStore, TransformerConfig, TransformerEncoder) {
    tch::manual_seed(seed);
    let mut store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: 32,
        nhead: 4,
        dim_feedforward: 64,
        dropout: 0.0,
        ..Default::default()
    };
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, true);
    store.set_kind(kind);
    (store, config, encoder)
}

#[test]
fn f64_models_compute_in_f64() {
    let (_store, _, encoder) = small_encoder(5, Kind::Double);
    let compiled = compile("double", |x: &[NestedTensor], _: &[Dense]| {
        encoder.forward(&x[0], false)
    });
    for (index, lengths) in [vec![5i64, 0, 3], vec![1]].iter().enumerate() {
        let (tokens, _) = batch(lengths, &[32], Kind::Double, index as i64);
        let compiled_outputs = compiled.call(&[&tokens], &[]).unwrap();
        let eager = vec![Value::Nested(encoder.forward(&tokens, false).unwrap())];
        // An f32 computation would differ by about 1e-6; f64 agrees to rounding.
        assert_close_within(&compiled_outputs, &eager, 1e-10, "f64 encoder");
    }
    assert_eq!(compiled.stats().compiles, 1);
}

/// Mixed precision is bf16 only: another kind is a typed error naming it, at the call
/// that compiles.
#[test]
fn autocast_to_another_kind_is_an_error() {
    let weight = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
    let compiled = compile("f16", |x: &[NestedTensor], _: &[Dense]| {
        x[0].linear(&weight, None)
    })
    .autocast(Kind::Half);
    let (x, _) = batch(&[2, 1], &[4], Kind::Float, 0);
    let error = compiled
        .call(&[&x], &[])
        .expect_err("autocast to f16 is refused");
    assert!(error.to_string().contains("autocast to Half"), "{error}");
}

/// Asked to (`autocast(Kind::Float)`), bf16 models multiply in f32 like f16 ones.
#[test]
fn bf16_and_f16_models_compile_with_f32_compute() {
    for kind in [Kind::BFloat16, Kind::Half] {
        let (store, config, encoder) = small_encoder(4, kind);
        let compiled = compile("low_precision", |x: &[NestedTensor], _: &[Dense]| {
            encoder.forward(&x[0], false)
        })
        .autocast(Kind::Float);
        for (index, lengths) in [vec![5i64, 1, 3], vec![2, 7]].iter().enumerate() {
            let (tokens, _) = batch(lengths, &[32], kind, index as i64);
            let compiled_output = compiled
                .call(&[&tokens], &[])
                .unwrap()
                .remove(0)
                .into_nested()
                .unwrap();
            assert_eq!(compiled_output.kind(), kind);
            // The reference: the same model in f32 on the same (rounded) inputs; the
            // compiled model computes in f32 and rounds only its result.
            let reference_store = {
                let mut copy = nn::VarStore::new(Device::Cpu);
                let reference =
                    TransformerEncoder::new(&(copy.root() / "encoder"), &config, 2, true);
                copy.copy(&store).unwrap();
                copy.set_kind(Kind::Float);
                let expected = reference
                    .forward(&tokens.to_kind(Kind::Float).unwrap(), false)
                    .unwrap();
                (expected, copy)
            };
            // One step of the format: the reference and the compiled f32 results, an f32
            // rounding apart, may round to neighbours.
            let step = if kind == Kind::BFloat16 {
                2f64.powi(-7)
            } else {
                2f64.powi(-10)
            };
            assert_same_values(
                compiled_output.values(),
                &reference_store.0.values().to_kind(kind),
                step,
                1e-5,
                &format!("{kind:?} encoder"),
            );
        }
        assert_eq!(compiled.stats().compiles, 1);
    }
}

#[test]
fn per_element_regions_run_through_libtorch_when_asked() {
    tch::manual_seed(6);
    let options = (Kind::Float, Device::Cpu);
    let weight = Tensor::randn([4, 3, 3, 3], options);
    let bias = Tensor::randn([4], options);
    let block = move |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
        let features = x[0]
            .conv2d(&weight, Some(&bias), [1, 1], [1, 1], [1, 1], 1)?
            .relu()?;
        let pooled = features.max_pool2d([2, 2], [2, 2], [0, 0])?;
        Ok(vec![
            pooled.sigmoid()?.into(),
            // Pooling images of a fixed size (every element 3 x 3 after the adaptive
            // pooling: no ragged H and W) has no window step: a per-element region.
            features
                .adaptive_avg_pool2d([3, 3])?
                .max_pool2d([2, 2], [1, 1], [0, 0])?
                .into(),
        ])
    };
    let strict = compile("conv_strict", &block);
    let error = strict
        .call(&[&random_images(&[(6, 7), (9, 5)], 1)], &[])
        .unwrap_err();
    assert!(
        matches!(&error, NestedError::Compile { stage: "lowering", reason } if reason.contains("per_element")),
        "{error}"
    );
    let compiled = compile("conv", &block).per_element_fallback(true);
    for (index, sizes) in [vec![(6, 7), (9, 5)], vec![(8, 8), (5, 11), (12, 6)]]
        .iter()
        .enumerate()
    {
        let batch = random_images(sizes, 10 + index as i64);
        let compiled_outputs = compiled.call(&[&batch], &[]).unwrap();
        let eager = eager_values(block(std::slice::from_ref(&batch), &[]).unwrap());
        assert_close(&compiled_outputs, &eager, "conv");
    }
    assert_eq!(compiled.stats().compiles, 1);
    // A convolution that keeps every size keeps the lengths symbol, so a residual
    // connection around it traces and compiles.
    let square = Tensor::randn([3, 3, 3, 3], options);
    let residual = move |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
        let h = x[0]
            .conv2d(&square, None, [1, 1], [1, 1], [1, 1], 1)?
            .relu()?;
        Ok(vec![(&h + &x[0])?.relu()?.into()])
    };
    let compiled = compile("residual", &residual).per_element_fallback(true);
    for (index, sizes) in [vec![(6, 7), (9, 5)], vec![(4, 4), (5, 11), (12, 6)]]
        .iter()
        .enumerate()
    {
        let batch = random_images(sizes, 20 + index as i64);
        let compiled_outputs = compiled.call(&[&batch], &[]).unwrap();
        let eager = eager_values(residual(std::slice::from_ref(&batch), &[]).unwrap());
        assert_close(&compiled_outputs, &eager, "residual conv");
    }
    assert_eq!(compiled.stats().compiles, 1);
}

#[test]
fn a_strided_bottleneck_block_compiles_once_for_every_image_size() {
    // ResNet's bottleneck with downsampling: 1x1, 3x3 of stride 2 and padding 1, 1x1,
    // batch norm (inference), and a 1x1 downsample of stride 2 on the shortcut. The two
    // strided windows have one size formula, so their lengths are one symbol and the
    // residual add traces; one compile serves every set of image sizes (odd and even
    // sides, 1 x 1 included).
    tch::manual_seed(8);
    let options = (Kind::Float, Device::Cpu);
    let reduce = Tensor::randn([4, 3, 1, 1], options);
    let spatial = Tensor::randn([4, 4, 3, 3], options);
    let expand = Tensor::randn([8, 4, 1, 1], options);
    let downsample = Tensor::randn([8, 3, 1, 1], options);
    let (mean, var) = (
        Tensor::randn([8], options),
        Tensor::rand([8], options) + 0.5,
    );
    let (scale, shift) = (Tensor::randn([8], options), Tensor::randn([8], options));
    let block = move |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
        let h = x[0]
            .conv2d(&reduce, None, [1, 1], [0, 0], [1, 1], 1)?
            .relu()?;
        let h = h
            .conv2d(&spatial, None, [2, 2], [1, 1], [1, 1], 1)?
            .relu()?;
        let h = h.conv2d(&expand, None, [1, 1], [0, 0], [1, 1], 1)?;
        let h = h.batch_norm(
            1,
            Some(&mean),
            Some(&var),
            Some(&scale),
            Some(&shift),
            false,
            0.1,
            1e-5,
        )?;
        let shortcut = x[0].conv2d(&downsample, None, [2, 2], [0, 0], [1, 1], 1)?;
        Ok(vec![(&h + &shortcut)?.relu()?.into()])
    };
    let batches = [
        random_images(&[(7, 6), (9, 5)], 30),
        random_images(&[(8, 8), (1, 1), (12, 3)], 31),
    ];
    assert_one_compile_equals_eager("bottleneck", block, &batches);
}

/// `model` compiled once equals eager on every batch of `batches` (of one structure).
fn assert_one_compile_equals_eager(
    name: &str,
    model: impl Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Vec<Out>>,
    batches: &[NestedTensor],
) {
    let compiled = compile(name, &model);
    for batch in batches {
        let got = compiled.call(&[batch], &[]).unwrap();
        let want = eager_values(model(std::slice::from_ref(batch), &[]).unwrap());
        assert_close(&got, &want, name);
    }
    assert_eq!(compiled.stats().compiles, 1, "{name}");
}

/// Batches `[L_i, 3]` of the lengths a compiled test runs: empty and one-row elements,
/// a batch of one.
fn edge_batches(seed: i64) -> Vec<NestedTensor> {
    [vec![4, 0, 1, 7], vec![5], vec![3, 2]]
        .iter()
        .map(|lengths| batch(lengths, &[3], Kind::Float, seed).0)
        .collect()
}

#[test]
fn variance_and_standard_deviation_compile_over_ragged_and_static_dims() {
    // Decomposed into means of squared deviations (times n / (n - correction)): over the
    // ragged dim (an empty element and one of one row give NaN, as torch; a correction
    // of 2 over 1 row a negative count) and over the static tail; corrected and not,
    // kept dims and not; a batch of one. (Over both at once, the mean it takes has no
    // compiled lowering with kept dims yet.)
    let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
        Ok(vec![
            Out::Dense(x[0].var(&[1], 1, false)?.into_dense_handle()?),
            Out::Dense(x[0].std(&[1], 0, true)?.into_dense_handle()?),
            Out::Nested(x[0].var(&[2], 1, false)?.into_nested()?),
            Out::Dense(x[0].var(&[1], 2, true)?.into_dense_handle()?),
        ])
    };
    assert_one_compile_equals_eager("variance", model, &edge_batches(11));
}

#[test]
fn scans_over_the_ragged_dim_compile() {
    // cumsum and cumprod down each element's rows (a segmented scan, one thread a
    // column), empty and one-row elements and a batch of one included, one compile.
    let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
        Ok(vec![
            Out::Nested(x[0].cumsum(1)?),
            Out::Nested((&x[0] * 0.5)?.cumprod(1)?),
        ])
    };
    assert_one_compile_equals_eager("scans", model, &edge_batches(12));
}

/// One step of a random model: what it does to the running value, reading earlier
/// values for binary steps.
#[derive(Clone, Debug)]
enum RandomStep {
    Unary(u8),
    AddEarlier(usize),
    MulConst(i8),
    AddTail,
    Linear,
    LayerNorm,
    Softmax,
    WhereNegative,
}

fn random_step() -> impl Strategy<Value = RandomStep> {
    prop_oneof![
        (0u8..6).prop_map(RandomStep::Unary),
        (0usize..8).prop_map(RandomStep::AddEarlier),
        (-3i8..4).prop_map(RandomStep::MulConst),
        Just(RandomStep::AddTail),
        Just(RandomStep::Linear),
        Just(RandomStep::LayerNorm),
        Just(RandomStep::Softmax),
        Just(RandomStep::WhereNegative),
    ]
}

fn apply(
    steps: &[RandomStep],
    x: &NestedTensor,
    weight: &Tensor,
    tail: &Tensor,
) -> nestor::Result<NestedTensor> {
    let mut values = vec![x.clone()];
    for step in steps {
        let current = values.last().unwrap().clone();
        let next = match step {
            RandomStep::Unary(kind) => match kind {
                0 => current.relu()?,
                1 => current.tanh()?,
                2 => current.sigmoid()?,
                3 => current.gelu("tanh")?,
                4 => current.neg()?,
                // Away from 0, where sqrt is ill-conditioned: values that cancelled to
                // about 1e-7 of their terms (tanh-GELU of a negative input) differ by
                // far more than the tolerance after sqrt, in eager and compiled code alike.
                _ => (current.abs()? + 1.0)?.sqrt()?,
            },
            RandomStep::AddEarlier(index) => (&current + &values[index % values.len()])?,
            RandomStep::MulConst(factor) => (&current * (*factor as f64 / 2.0))?,
            RandomStep::AddTail => (&current + tail)?,
            RandomStep::Linear => current.linear(weight, None)?,
            RandomStep::LayerNorm => current.layer_norm(&[4], None, None, 1e-5)?,
            RandomStep::Softmax => current.softmax(1)?,
            // Continuous at the threshold (a leaky relu), so values that round to either
            // side of 0 in compiled and eager code still agree.
            RandomStep::WhereNegative => {
                current.where_self(&current.lt(0.0)?, &(&current * 0.25)?)?
            }
        };
        values.push(next);
    }
    Ok(values.pop().unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    /// Differential test of the whole compiler (tracing, DCE, CSE, the e-graph
    /// optimizer, lowering with kernel fusion, kernels) against eager execution, and of
    /// the optimized against the unoptimized compile, on random models and lengths.
    #[test]
    fn random_models_compile_to_what_eager_computes(steps in proptest::collection::vec(random_step(), 1..10), batches in proptest::collection::vec(lengths(5, 9), 1..3), seed in 0i64..1000) {
        tch::manual_seed(seed);
        let weight = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)) * 0.5;
        let tail = Tensor::randn([4], (Kind::Float, Device::Cpu));
        let model = |x: &[NestedTensor], _: &[Dense]| apply(&steps, &x[0], &weight, &tail);
        let compiled = compile("random", model);
        let unoptimized = compile("random", model).optimized(false);
        for (index, lengths) in batches.iter().enumerate() {
            let (x, _) = batch(lengths, &[4], Kind::Float, seed + index as i64);
            let compiled_outputs = compiled.call(&[&x], &[]).unwrap_or_else(|error| panic!("{steps:?}: {error}"));
            let eager = vec![Value::Nested(apply(&steps, &x, &weight, &tail).unwrap())];
            assert_close(&compiled_outputs, &eager, &format!("{steps:?}"));
            let plain = unoptimized.call(&[&x], &[]).unwrap();
            assert_close(&compiled_outputs, &plain, &format!("optimized vs unoptimized, {steps:?}"));
        }
    }
}

/// The inline transcendental functions of f32 kernels (erf, tanh, exp and what is
/// built on them) against libtorch in f64, over the range where they change.
#[test]
fn inline_transcendentals_are_accurate_in_f32() {
    let values = Tensor::linspace(-9.0, 9.0, 20_001, (Kind::Float, Device::Cpu));
    let batch =
        NestedTensor::from_tensors(&[values.narrow(0, 0, 12_345), values.narrow(0, 12_345, 7_656)])
            .unwrap();
    let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
        Ok(vec![
            x[0].erf()?.into(),
            x[0].tanh()?.into(),
            x[0].gelu("none")?.into(),
            x[0].gelu("tanh")?.into(),
            x[0].sigmoid()?.into(),
        ])
    };
    let compiled = compile("transcendentals", model)
        .call(&[&batch], &[])
        .unwrap();
    let exact = values.to_kind(Kind::Double);
    let expected = [
        exact.erf(),
        exact.tanh(),
        exact.gelu("none"),
        exact.gelu("tanh"),
        exact.sigmoid(),
    ];
    assert_eq!(compiled.len(), expected.len(), "outputs");
    for (index, (output, expected)) in compiled.into_iter().zip(expected).enumerate() {
        let got = output.into_nested().unwrap().values().to_kind(Kind::Double);
        let error = (&got - &expected).abs() / (expected.abs() + 1.0);
        let worst = error.max().double_value(&[]);
        assert!(worst < 2e-6, "function {index}: error {worst:.2e}");
    }
}

/// Results written straight into the caller's tensors: the input itself returned first
/// (copied out, not written), one value returned twice, a view of it, and an empty
/// element, all still right.
#[test]
fn results_returned_twice_or_as_views_are_right() {
    let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
        let h = (x[0].relu()? * 2.0)?;
        Ok(vec![
            x[0].shallow_clone().into(),
            h.clone().into(),
            h.clone().into(),
            h.reshape_tail(&[2, 2])?.into(),
        ])
    };
    let compiled = compile("twice", model);
    for lengths in [vec![0i64, 3, 1], vec![2, 0], vec![1]] {
        let (x, _) = batch(&lengths, &[4], Kind::Float, 31);
        let got = compiled.call(&[&x], &[]).unwrap();
        let want = eager_values(model(std::slice::from_ref(&x), &[]).unwrap());
        assert_close(&got, &want, "twice");
    }
    assert_eq!(compiled.stats().compiles, 1);
}

/// Compiled `sign` gives exactly what libtorch gives, at NaN, the infinities and both
/// zeros too (0 for NaN and -0, as torch).
#[test]
fn sign_matches_libtorch_on_special_values() {
    let values = Tensor::from_slice(&[
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        2.5,
        -1e-30,
        1e-45,
    ]);
    let batch =
        NestedTensor::from_tensors(&[values.narrow(0, 0, 5), values.narrow(0, 5, 3)]).unwrap();
    let sign = compile("sign", |x: &[NestedTensor], _: &[Dense]| x[0].sign());
    let compiled = sign.call(&[&batch], &[]).unwrap().remove(0);
    let got = Vec::<f32>::try_from(compiled.into_nested().unwrap().values()).unwrap();
    let expected = Vec::<f32>::try_from(values.sign()).unwrap();
    let bits = |values: &[f32]| {
        values
            .iter()
            .map(|value| value.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&got), bits(&expected), "{got:?} vs {expected:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(12), ..ProptestConfig::default() })]

    /// Cross-attention: queries of one batch, keys and values of another whose lengths
    /// differ element by element (the runtime keeps their offsets apart), causal or not.
    #[test]
    fn cross_attention_with_unequal_lengths_equals_eager(queries in lengths(5, 9), keys in lengths(5, 9), causal in any::<bool>(), seed in 0i64..1000) {
        let batch_size = queries.len().min(keys.len());
        let (queries, keys) = (&queries[..batch_size], &keys[..batch_size]);
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            let (q, kv) = (x[0].reshape_tail(&[2, 3])?, x[1].reshape_tail(&[2, 2, 3])?);
            let (k, v) = (kv.select_static(2, 0)?, kv.select_static(2, 1)?);
            Ok(vec![q.scaled_dot_product_attention(&k, &v, causal, Some(0.6))?.into()])
        };
        let compiled = compile("cross_attention", model);
        let (q, _) = batch(queries, &[6], Kind::Float, seed);
        let (kv, _) = batch(keys, &[12], Kind::Float, seed + 1);
        let got = compiled.call(&[&q, &kv], &[]).unwrap();
        let want = eager_values(model(&[q, kv], &[]).unwrap());
        assert_close(&got, &want, "cross attention");
    }
}

/// Dense inputs (batch first): a per-element `[B, 1, 4]` tensor broadcast over each
/// element's rows, and a `[B, 4]` tensor used alone, compiled once for batches of
/// different sizes and lengths.
#[test]
fn dense_inputs_compile_and_broadcast_per_element() {
    let tail = Tensor::randn([4], (Kind::Float, Device::Cpu));
    let model = |x: &[NestedTensor], d: &[Dense]| -> nestor::Result<Vec<Out>> {
        Ok(vec![
            x[0].binary(nestor::Binary::Mul, &d[0])?.into(),
            (&x[0]
                - &x[0]
                    .binary(nestor::Binary::Maximum, &d[0])?
                    .maximum(&tail)?)?
                .into(),
            Out::Dense(d[1].tanh()?),
        ])
    };
    let compiled = compile("dense_inputs", model);
    for (index, lengths) in [vec![3i64, 0, 5], vec![1], vec![2, 7, 1, 4]]
        .iter()
        .enumerate()
    {
        let (x, _) = batch(lengths, &[4], Kind::Float, index as i64);
        let options = (Kind::Float, Device::Cpu);
        let batch_size = lengths.len() as i64;
        let per_element = Tensor::randn([batch_size, 1, 4], options);
        let rows = Tensor::randn([batch_size, 4], options);
        let got = compiled.call(&[&x], &[&per_element, &rows]).unwrap();
        let dense = [Dense::from(per_element), Dense::from(rows)];
        let want = eager_values(model(&[x], &dense).unwrap());
        assert_close(&got, &want, "dense inputs");
    }
    assert_eq!(compiled.stats().compiles, 1);
}

/// A batch of no elements runs compiled as it does eagerly (it was a layout error),
/// before and after batches with elements.
#[test]
fn an_empty_batch_compiles_as_it_runs_eagerly() {
    for (family, model) in families(Kind::Float) {
        let compiled = compile(family, |x: &[NestedTensor], d: &[Dense]| model(x, d));
        for lengths in [vec![], vec![2i64, 0, 3], vec![]] {
            let (x, _) = batch(&lengths, &[4], Kind::Float, 1);
            let tokens = ids(&lengths, 2);
            let got = compiled
                .call(&[&x, &tokens], &[])
                .unwrap_or_else(|error| panic!("{family} on {lengths:?}: {error}"));
            let want = eager_values(model(&[x, tokens], &[]).unwrap());
            assert_close(&got, &want, &format!("{family} on {lengths:?}"));
        }
    }
}

/// Attention written by hand over jagged pairs: `softmax(scale * q @ k^T) @ v`.
fn hand_written_attention(x: &[NestedTensor], scale: f64) -> nestor::Result<NestedTensor> {
    let scores = x[0].matmul_nested(&x[1].transpose(1, 2)?)?;
    (&scores * scale)?.softmax(2)?.matmul_nested(&x[2])
}

/// The same with a causal mask: keys after their query get no weight.
fn hand_written_causal_attention(x: &[NestedTensor], scale: f64) -> nestor::Result<NestedTensor> {
    let scores = (&x[0].matmul_nested(&x[1].transpose(1, 2)?)? * scale)?;
    scores
        .causal_fill(f64::NEG_INFINITY)?
        .softmax(2)?
        .matmul_nested(&x[2])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    #[test]
    fn hand_written_attention_compiles_to_the_fused_attention_kernel(
        batches in proptest::collection::vec(lengths(5, 12), 1..3),
        cross in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let dir = std::env::temp_dir().join(format!("nestor-pair-attention-{}-{seed}", std::process::id()));
        let compiled = compile("pair_attention", |x: &[NestedTensor], _: &[Dense]| hand_written_attention(x, 0.25)).dump_to(&dir);
        for (index, lengths) in batches.iter().enumerate() {
            let seed = seed + 3 * index as i64;
            let keys: Vec<i64> = if cross { lengths.iter().map(|l| (l * 7 + 3) % 11).collect() } else { lengths.clone() };
            let (q, _) = batch(lengths, &[8], Kind::Float, seed);
            let (k, _) = batch(&keys, &[8], Kind::Float, seed + 1);
            let (v, _) = batch(&keys, &[5], Kind::Float, seed + 2);
            let outputs = compiled.call(&[&q, &k, &v], &[]).unwrap();
            let eager = eager_values(vec![hand_written_attention(&[q, k, v], 0.25).unwrap().into()]);
            assert_close(&outputs, &eager, "hand-written attention");
        }
        // The rule fired: the optimized graph holds the attention op and no jagged pair.
        let optimized = std::fs::read_dir(&dir).unwrap()
            .filter_map(|entry| entry.ok())
            .find(|entry| entry.file_name().to_string_lossy().ends_with("optimize.nir"))
            .map(|entry| std::fs::read_to_string(entry.path()).unwrap())
            .unwrap_or_default();
        std::fs::remove_dir_all(&dir).unwrap();
        prop_assert!(optimized.contains("attention("), "{}", optimized);
        prop_assert!(!optimized.contains("pair_matmul"), "{}", optimized);
    }
}

#[test]
fn hand_written_attention_without_keys_is_zeros_as_in_eager() {
    let compiled = compile("pair_attention", |x: &[NestedTensor], _: &[Dense]| {
        hand_written_attention(x, 0.5)
    });
    let (q, _) = batch(&[3, 0, 2], &[4], Kind::Float, 1);
    let (k, _) = batch(&[0, 2, 1], &[4], Kind::Float, 2);
    let (v, _) = batch(&[0, 2, 1], &[3], Kind::Float, 3);
    let outputs = compiled.call(&[&q, &k, &v], &[]).unwrap();
    let eager = eager_values(vec![hand_written_attention(&[q, k, v], 0.5)
        .unwrap()
        .into()]);
    assert_close(&outputs, &eager, "attention over no keys");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    /// Without the attention pattern (scores kept, scaled by an input) the jagged pairs
    /// compile as they are: one GEMM per element, a segmented softmax over the keys.
    #[test]
    fn jagged_pair_matmuls_compile_on_their_own(
        batches in proptest::collection::vec(lengths(5, 12), 1..3),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let (kind, tolerance) = if double { (Kind::Double, 1e-9) } else { (Kind::Float, 1e-4) };
        let model = |x: &[NestedTensor], d: &[Dense]| -> nestor::Result<(NestedTensor, NestedTensor)> {
            let scores = x[0].matmul_nested(&x[1].transpose(1, 2)?)?;
            let weights = (&scores * &d[0])?.softmax(2)?;
            Ok((weights.matmul_nested(&x[2])?, scores))
        };
        let compiled = compile("pairs", model);
        for (index, lengths) in batches.iter().enumerate() {
            let seed = seed + 3 * index as i64;
            let keys: Vec<i64> = lengths.iter().map(|l| (l * 5 + 1) % 9).collect();
            let (q, _) = batch(lengths, &[6], kind, seed);
            let (k, _) = batch(&keys, &[6], kind, seed + 1);
            let (v, _) = batch(&keys, &[3], kind, seed + 2);
            let scale = Tensor::from(0.3f64).to_kind(kind);
            let outputs = compiled.call(&[&q, &k, &v], &[&scale]).unwrap();
            let (mixed, scores) = model(&[q, k, v], &[Dense::from(scale)]).unwrap();
            let eager = eager_values(vec![mixed.into(), scores.into()]);
            assert_close_within(&outputs, &eager, tolerance, "jagged pairs");
        }
    }
}

#[test]
fn softmax_over_the_first_dim_of_jagged_pairs_is_a_typed_lowering_error() {
    // Its segments are strided columns of every element: no kernel reads them yet.
    let compiled = compile("pair_softmax", |x: &[NestedTensor], _: &[Dense]| {
        x[0].matmul_nested(&x[1].transpose(1, 2)?)?.softmax(1)
    });
    let (q, _) = batch(&[3, 2], &[4], Kind::Float, 1);
    let error = compiled.call(&[&q, &q], &[]).unwrap_err();
    assert!(
        matches!(
            error,
            NestedError::Compile {
                stage: "lowering",
                ..
            }
        ),
        "{error}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    /// Pair layouts from broadcasting (`unsqueeze` and a broadcasting binary op), square
    /// and rectangular, traced, interpreted and compiled as eager computes them: the
    /// kernels read each operand's rows through the pair layout's row maps.
    #[test]
    fn broadcast_pairs_trace_interpret_and_compile(
        lengths in lengths(5, 6),
        others in proptest::collection::vec(0i64..=6, 5),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let (kind, tolerance) = if double { (Kind::Double, 1e-12) } else { (Kind::Float, 1e-6) };
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<(NestedTensor, NestedTensor)> {
            let square = (&x[0].unsqueeze(2)? * &x[0].unsqueeze(1)?)?;
            let rectangle = (&x[0].unsqueeze(2)? - &x[1].unsqueeze(1)?)?.relu()?;
            Ok((square, rectangle))
        };
        let (x, _) = batch(&lengths, &[3], kind, seed);
        let (y, _) = batch(&others[..lengths.len()], &[3], kind, seed + 1);
        let traced = nestor::trace("pairs", &[&x, &y], &[], None, model).unwrap();
        let text = traced.text();
        prop_assert!(text.contains("unsqueeze") && text.contains("[B; %0, %0, 3]"), "{}", text);
        let eager = {
            let (square, rectangle) = model(&[x.shallow_clone(), y.shallow_clone()], &[]).unwrap();
            eager_values(vec![square.into(), rectangle.into()])
        };
        let interpreted = traced.run(&[&x, &y], &[]).unwrap();
        assert_close_within(&interpreted, &eager, 0.0, "pairs interpreted");
        let compiled = compile("pairs", model).call(&[&x, &y], &[]).unwrap();
        assert_close_within(&compiled, &eager, tolerance, "pairs compiled");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    /// The transpose of a pair layout compiles to a copy through the transposition map,
    /// square (one lengths value for both dims: types alone cannot tell them apart)
    /// and rectangular.
    #[test]
    fn pair_transposes_compile(lengths in lengths(5, 6), keys in proptest::collection::vec(0i64..=6, 5), square in any::<bool>(), seed in 0i64..1000) {
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<(NestedTensor, NestedTensor)> {
            let scores = x[0].matmul_nested(&x[1].transpose(1, 2)?)?;
            let swapped = scores.transpose(1, 2)?;
            Ok((swapped.tanh()?, swapped))
        };
        let keys: Vec<i64> = if square { lengths.clone() } else { keys[..lengths.len()].to_vec() };
        let (q, _) = batch(&lengths, &[4], Kind::Double, seed);
        let (k, _) = batch(&keys, &[4], Kind::Double, seed + 1);
        let compiled = compile("transpose", model).call(&[&q, &k], &[]).unwrap();
        let (a, b) = model(&[q, k], &[]).unwrap();
        assert_close_within(&compiled, &eager_values(vec![a.into(), b.into()]), 1e-12, "pair transpose");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    /// Reductions over the keys of jagged pairs (their second ragged dim) compile to
    /// segmented kernels over the runs of keys, as eager computes them.
    #[test]
    fn reductions_over_the_keys_of_jagged_pairs_compile(lengths in lengths(5, 7), keys in proptest::collection::vec(1i64..=7, 5), seed in 0i64..1000) {
        let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
            let scores = x[0].matmul_nested(&x[1].transpose(1, 2)?)?;
            Ok(vec![
                Out::Nested(scores.sum(&[2], false)?.into_nested()?),
                Out::Nested(scores.mean(&[2], true)?.into_nested()?),
                Out::Nested(scores.amax(&[-1], false)?.into_nested()?),
                Out::Nested(scores.log_softmax(2)?),
            ])
        };
        let (q, _) = batch(&lengths, &[4], Kind::Double, seed);
        let (k, _) = batch(&keys[..lengths.len()], &[4], Kind::Double, seed + 1);
        let compiled = compile("pair_reductions", model).call(&[&q, &k], &[]).unwrap();
        let eager = eager_values(model(&[q, k], &[]).unwrap());
        assert_close_within(&compiled, &eager, 1e-12, "reductions over keys");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    /// Causal attention written by hand compiles to the causal attention kernel.
    #[test]
    fn hand_written_causal_attention_compiles_to_causal_attention(
        lengths in lengths(5, 12),
        cross in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let keys: Vec<i64> = if cross { lengths.iter().map(|l| (l * 7 + 3) % 11).collect() } else { lengths.clone() };
        let (q, _) = batch(&lengths, &[8], Kind::Float, seed);
        let (k, _) = batch(&keys, &[8], Kind::Float, seed + 1);
        let (v, _) = batch(&keys, &[5], Kind::Float, seed + 2);
        let compiled = compile("causal", |x: &[NestedTensor], _: &[Dense]| hand_written_causal_attention(x, 0.25));
        let text = compiled.graph_text(&[&q, &k, &v], &[]).unwrap();
        prop_assert!(text.contains("causal = true") && !text.contains("pair_matmul"), "{}", text);
        let outputs = compiled.call(&[&q, &k, &v], &[]).unwrap();
        let eager = eager_values(vec![hand_written_causal_attention(&[q, k, v], 0.25).unwrap().into()]);
        assert_close(&outputs, &eager, "causal attention");
    }
}

#[test]
fn a_causal_fill_outside_attention_is_a_typed_lowering_error() {
    // Only the attention rule absorbs it yet: no kernel reads a pair's coordinates.
    let compiled = compile("causal_fill", |x: &[NestedTensor], _: &[Dense]| {
        x[0].matmul_nested(&x[1].transpose(1, 2)?)?.causal_fill(0.0)
    });
    let (q, _) = batch(&[3, 2], &[4], Kind::Float, 1);
    let error = compiled.call(&[&q, &q], &[]).unwrap_err();
    assert!(
        matches!(&error, NestedError::Compile { stage: "lowering", reason } if reason.contains("causal_fill")),
        "{error}"
    );
}

/// argmax and argmin along the ragged dim (each element's rows, column by column), kept
/// dims or not, and along the last dim, max_dim / min_dim's values and positions, and
/// the top value of each element's column: compiled positions (i64) equal eager's in
/// every float kind, the first of equal values winning (bf16 and f16 values tie often).
fn positions_model(x: &[NestedTensor], _: &[Dense]) -> nestor::Result<Vec<Out>> {
    let (largest, at) = x[0].max_dim(1, true)?;
    let (smallest, _) = x[0].min_dim(-1, false)?;
    let (first, first_at) = x[0].kthvalue(1, 1, false)?;
    let (second, second_at) = x[0].kthvalue(2, -1, true)?;
    let (top, top_at) = x[0].topk(1, 1, true)?;
    Ok(vec![
        top.into(),
        top_at.into(),
        x[0].relu()?.topk(1, 1, false)?.1.into(),
        first.into(),
        first_at.into(),
        second.into(),
        second_at.into(),
        x[0].argmax(1, false)?.into(),
        x[0].argmin(1, true)?.into(),
        x[0].argmax(-1, false)?.into(),
        largest.into(),
        at.into(),
        smallest.into(),
    ])
}

/// The `k` largest and smallest values of each element's columns and their positions
/// (`k` rows an element, whatever its length).
fn top_rows(k: i64) -> impl Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Vec<Out>> {
    move |x, _| {
        let (largest, from) = x[0].topk(k, 1, true)?;
        let (smallest, _) = x[0].relu()?.topk(k, 1, false)?;
        // The top rows computed on: the result's lengths are a new symbol.
        let mixed = (&largest.tanh()? * &smallest)?.softmax(1)?;
        Ok(vec![
            largest.into(),
            from.into(),
            smallest.into(),
            mixed.into(),
        ])
    }
}

/// Transposes of any two static dims of `[L, 2, 3, 4, 5]` elements (with dims between
/// and after them, neighbours, the first and last, the last two), a permutation, a
/// swap of static dims on either side of the ragged dim (moved inside by a ragged
/// transpose), and slices of static dims.
fn transposes(x: &[NestedTensor], _: &[Dense]) -> nestor::Result<Vec<Out>> {
    let x = x[0].reshape_tail(&[2, 3, 4, 5])?;
    Ok(vec![
        x.transpose(2, 4)?.into(),
        x.transpose(3, 2)?.tanh()?.into(),
        x.transpose(2, 5)?.into(),
        x.transpose(4, 5)?.into(),
        x.permute(&[0, 1, 4, 2, 5, 3])?.into(),
        x.transpose(1, 2)?.transpose(1, 4)?.into(),
        // Slices of static dims: the first, an inner one, the last (Python bounds),
        // an empty one, and of positions (i64).
        x.slice(2, 1..)?.into(),
        x.slice(3, 1..=2)?.tanh()?.into(),
        x.slice(-1, ..-2)?.into(),
        x.slice(4, 2..2)?.into(),
        x.argsort(4, false)?.slice(3, ..2)?.into(),
    ])
}

/// Ops along inner static dims of `[L, 3, 4, 2]` elements (the first and the middle
/// one): sorts, scans, softmax, running extremes, the top values, k-th values and
/// extremes, with their positions (dims kept or not; moved back as i64 values), sums,
/// means, logsumexp; positions transposed; and reductions' kept dims broadcast back (`[3, 1, 2]`, `[3, 4, 1]`, `[1, 4, 1]` over `[3, 4, 2]`).
fn along_inner_dims(x: &[NestedTensor], _: &[Dense]) -> nestor::Result<Vec<Out>> {
    let x = x[0].reshape_tail(&[3, 4, 2])?;
    let (kth, kth_at) = x.kthvalue(2, 3, true)?;
    let (largest, largest_at) = x.max_dim(2, false)?;
    let middle = x.reduce(Reduce::Mean, &[3], true)?.into_nested()?;
    let last = x.reduce(Reduce::Sum, &[4], true)?.into_nested()?;
    let both = last.reduce(Reduce::Amax, &[2], true)?.into_nested()?;
    Ok(vec![
        (&x - &middle)?.into(),
        (&x * &last)?.into(),
        (&x + &both)?.into(),
        x.sort(2, true)?.0.into(),
        x.cumsum(3)?.into(),
        (&x * 0.5)?.cumprod(2)?.into(),
        x.softmax(2)?.into(),
        x.log_softmax(3)?.into(),
        x.relu()?.cummax(2)?.0.into(),
        x.relu()?.cummax(2)?.1.into(),
        x.topk(2, 3, false)?.0.into(),
        x.topk(2, 2, true)?.1.into(),
        x.relu()?.argsort(3, true)?.into(),
        // Positions (i64) moved by a transpose of their own.
        x.argsort(2, false)?.transpose(2, 4)?.into(),
        kth.into(),
        kth_at.into(),
        largest.into(),
        largest_at.into(),
        x.relu()?.argmin(3, true)?.into(),
        x.reduce(Reduce::Amax, &[2], true)?.into(),
        x.reduce(Reduce::LogSumExp, &[3], false)?.into(),
    ])
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    /// Ops along inner static dims, compiled as the op along the last dim of the dim
    /// moved last, equal eager's in every float kind (values chosen exactly; computed
    /// ones within the kind's rounding), empty and one-row elements, batch size 1.
    #[test]
    fn compiled_ops_along_inner_static_dims_equal_eager(batches in proptest::collection::vec(lengths(4, 6), 1..3), seed in 0i64..1000) {
        for (kind, tolerance) in [(Kind::Float, 1e-5), (Kind::Double, 1e-9), (Kind::BFloat16, 2e-2), (Kind::Half, 5e-3)] {
            let compiled = compile("inner", along_inner_dims);
            for (index, lengths) in batches.iter().enumerate() {
                let (x, _) = batch(lengths, &[24], kind, seed + index as i64);
                let got = compiled.call(&[&x], &[]).unwrap();
                let want = eager_values(along_inner_dims(&[x], &[]).unwrap());
                assert_close_within(&got, &want, tolerance, &format!("{kind:?} {lengths:?}"));
            }
            prop_assert_eq!(compiled.stats().compiles, 1);
        }
    }

    /// Compiled transposes of static dims equal eager's (the same values moved) in
    /// every float kind, empty and one-row elements, batch size 1; one compile.
    #[test]
    fn compiled_transposes_of_any_static_dims_equal_eager(batches in proptest::collection::vec(lengths(4, 6), 1..3), seed in 0i64..1000) {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half, Kind::Double] {
            let compiled = compile("transposes", transposes);
            for (index, lengths) in batches.iter().enumerate() {
                let (x, _) = batch(lengths, &[120], kind, seed + index as i64);
                let got = compiled.call(&[&x], &[]).unwrap();
                let want = eager_values(transposes(&[x], &[]).unwrap());
                for (got, want) in got.iter().zip(&want) {
                    let ((got, got_sizes), (want, want_sizes)) = (value_parts(got), value_parts(want));
                    prop_assert_eq!(got_sizes, want_sizes);
                    prop_assert!(got.allclose(&want, 1e-2, 1e-3, false), "{:?} {:?}", kind, lengths);
                }
            }
            prop_assert_eq!(compiled.stats().compiles, 1);
        }
    }

    /// topk down the ragged dim: values and positions (ties among relu's zeros: the
    /// first first) equal eager's in every float kind, for several `k` and elements
    /// from `k` rows long, batch size 1 included; one compile for every batch.
    #[test]
    fn compiled_top_rows_equal_eager(extra in proptest::collection::vec(proptest::collection::vec(0i64..40, 1..5), 1..3), seed in 0i64..1000) {
        for (k, kind) in [(1, Kind::Float), (3, Kind::Float), (2, Kind::BFloat16), (4, Kind::Half)] {
            let compiled = compile("top_rows", top_rows(k));
            for (index, extra) in extra.iter().enumerate() {
                let lengths: Vec<i64> = extra.iter().map(|&more| k + more).collect();
                let (x, _) = batch(&lengths, &[3], kind, seed + index as i64);
                let got = compiled.call(&[&x], &[]).unwrap();
                let want = eager_values(top_rows(k)(&[x], &[]).unwrap());
                for (position, (got, want)) in got.iter().zip(&want).enumerate() {
                    let (got, want) = (value_parts(got).0, value_parts(want).0);
                    match position {
                        // Chosen, not computed: equal.
                        0..=2 => prop_assert!(got.equal(&want), "{:?} {:?} k {}: {} vs {}", kind, lengths, k, got, want),
                        _ => prop_assert!(got.allclose(&want, 1e-2, 1e-2, false), "{:?} {:?} k {}", kind, lengths, k),
                    }
                }
            }
            prop_assert_eq!(compiled.stats().compiles, 1);
        }
    }

    #[test]
    fn compiled_positions_along_the_ragged_dim_equal_eager(batches in proptest::collection::vec(proptest::collection::vec(1i64..80, 1..5), 1..3), seed in 0i64..1000) {
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let compiled = compile("positions", positions_model);
            for (index, lengths) in batches.iter().enumerate() {
                let (x, _) = batch(lengths, &[3], kind, seed + index as i64);
                let got = compiled.call(&[&x], &[]).unwrap();
                let want = eager_values(positions_model(&[x], &[]).unwrap());
                for (got, want) in got.iter().zip(&want) {
                    // Values and positions alike are chosen, not computed: equal.
                    let (got, want) = (value_parts(got).0, value_parts(want).0);
                    prop_assert!(got.equal(&want), "{:?} {:?}: {} vs {}", kind, lengths, got, want);
                }
            }
            prop_assert_eq!(compiled.stats().compiles, 1);
        }
    }
}

/// An element without rows has no largest value nor its position: eagerly (and when a
/// first call traces on it) `EmptyReduction`, a compiled program's call
/// `CompileCause::TooShort` naming the element, checked before the run; the
/// compiled function keeps working.
#[test]
fn compiled_positions_of_an_empty_element_are_an_error() {
    let compiled = compile("positions", positions_model);
    let (empty, _) = batch(&[3, 0, 2], &[3], Kind::Float, 1);
    for error in [
        positions_model(&[empty.shallow_clone()], &[])
            .err()
            .unwrap(),
        compiled.call(&[&empty], &[]).err().unwrap(),
    ] {
        assert!(
            matches!(
                error,
                NestedError::EmptyReduction {
                    op: "max",
                    element: 1
                }
            ),
            "{error}"
        );
    }
    let (fine, _) = batch(&[3, 1, 2], &[3], Kind::Float, 2);
    assert!(compiled.call(&[&fine], &[]).is_ok());
    let error = compiled.call(&[&empty], &[]).err().unwrap();
    let NestedError::Compile { reason, .. } = &error else {
        panic!("{error}");
    };
    // The first check the program runs names its reduction.
    assert!(
        matches!(
            reason.cause(),
            nestor::CompileCause::TooShort {
                op: "max" | "argmax" | "kthvalue" | "topk",
                element: 1,
                needed: 1
            }
        ),
        "{error}"
    );
    assert!(compiled.call(&[&fine], &[]).is_ok());
    assert_eq!(compiled.stats().compiles, 1);
}

/// A model returning results of positions.
type PositionsModel = fn(&[NestedTensor], &[Dense]) -> nestor::Result<Vec<Out>>;

/// Positions (argmax) and ids are returned, viewed or gathered by; arithmetic on them
/// (here a cast back to floats, an add and a sum) is a typed lowering error naming the
/// op, never a read of their i64 values as floats. Eagerly they compute.
#[test]
fn arithmetic_on_positions_is_a_typed_error() {
    let (x, _) = batch(&[3, 1, 2], &[3], Kind::Float, 3);
    let models: [(&str, PositionsModel); 2] = [
        ("add", |x, _| {
            let positions = x[0].argmax(-1, false)?.into_nested()?;
            Ok(vec![(&positions + 1.0)?.into()])
        }),
        ("sum", |x, _| {
            let positions = x[0].argmax(-1, false)?.into_nested()?;
            Ok(vec![positions.sum(&[1], false)?.into()])
        }),
    ];
    for (name, model) in models {
        assert!(model(&[x.shallow_clone()], &[]).is_ok(), "{name} eagerly");
        let error = compile(name, model).call(&[&x], &[]).err().unwrap();
        assert!(error.to_string().contains("i64 values"), "{name}: {error}");
    }
}

/// The k-th smallest value, or the top k, of an element with fewer than k rows:
/// eagerly `ElementTooShort`, a compiled call `CompileCause::TooShort` naming the op
/// (checked before the run); the compiled function keeps working.
#[test]
fn the_kth_value_or_top_k_of_a_short_element_is_an_error() {
    let models: [(&'static str, PositionsModel); 2] = [
        ("kthvalue", |x, _| {
            Ok(vec![x[0].kthvalue(2, 1, false)?.0.into()])
        }),
        ("topk", |x, _| Ok(vec![x[0].topk(2, 1, true)?.1.into()])),
    ];
    for (op, model) in models {
        let compiled = compile(op, model);
        let (fine, _) = batch(&[3, 2, 4], &[3], Kind::Float, 1);
        let (short, _) = batch(&[3, 1, 2], &[3], Kind::Float, 2);
        assert!(compiled.call(&[&fine], &[]).is_ok());
        let eager = model(&[short.shallow_clone()], &[]).err().unwrap();
        assert!(
            matches!(eager, NestedError::ElementTooShort { element: 1, .. }),
            "{eager}"
        );
        let error = compiled.call(&[&short], &[]).err().unwrap();
        let NestedError::Compile { reason, .. } = &error else {
            panic!("{error}");
        };
        assert_eq!(
            reason.cause(),
            nestor::CompileCause::TooShort {
                op,
                element: 1,
                needed: 2
            },
            "{error}"
        );
        assert!(compiled.call(&[&fine], &[]).is_ok());
    }
}

/// Reductions over several static dims of `[L, 3, 4, 2]` elements (neighbours, the last
/// two, apart, all of them) and over the ragged dim with static ones, kept or not.
fn static_reductions(x: &[NestedTensor], _: &[Dense]) -> nestor::Result<Vec<Out>> {
    let x = x[0].reshape_tail(&[3, 4, 2])?;
    let mut outputs = Vec::new();
    for op in [Reduce::Sum, Reduce::Mean, Reduce::Amax, Reduce::LogSumExp] {
        for dims in [&[2i64, 3][..], &[3, 4], &[2, -1], &[2, 3, 4]] {
            outputs.push(x.reduce(op, dims, false)?.into());
            outputs.push(x.reduce(op, dims, true)?.into());
        }
        // The ragged dim too (no largest value of an empty element).
        if op != Reduce::Amax {
            outputs.push(x.reduce(op, &[1, 3], false)?.into());
            outputs.push(x.reduce(op, &[1, 2, 4], true)?.into());
        }
    }
    Ok(outputs)
}

/// Reductions, softmax and scans over the ragged dim (`amax` only `with_max`: an empty
/// element has no largest value).
fn ragged_dim_folds(x: &NestedTensor, with_max: bool) -> nestor::Result<Vec<Out>> {
    let mut outputs = Vec::new();
    let maximum = with_max.then_some(Reduce::Amax);
    for op in [Reduce::Sum, Reduce::Mean, Reduce::LogSumExp]
        .into_iter()
        .chain(maximum)
    {
        outputs.push(x.reduce(op, &[1], false)?.into());
    }
    outputs.push(x.softmax(1)?.into());
    outputs.push(x.log_softmax(1)?.into());
    outputs.push(x.cumsum(1)?.into());
    outputs.push(x.cumprod(1)?.into());
    Ok(outputs)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(6), ..ProptestConfig::default() })]

    /// Compiled reductions, softmax and scans over the ragged dim equal eager's in every float
    /// kind, for rows narrower than a vector, of 16 columns, and of 300 (the host's
    /// blocks of 256 columns and a rest of 44), empty and one-row elements included.
    #[test]
    fn compiled_folds_over_the_ragged_dim_equal_eager(lengths in lengths(4, 9), seed in 0i64..1000) {
        let with_max = lengths.iter().all(|&length| length > 0);
        for width in [3, 16, 300] {
            for (kind, tolerance) in [(Kind::Float, 1e-5), (Kind::Double, 1e-9), (Kind::BFloat16, 3e-2), (Kind::Half, 5e-3)] {
                let compiled = compile("ragged_dim_folds", |x: &[NestedTensor], _: &[Dense]| {
                    ragged_dim_folds(&x[0], with_max)
                });
                let (x, _) = batch(&lengths, &[width], kind, seed);
                let got = compiled.call(&[&x], &[]).unwrap();
                let want = eager_values(ragged_dim_folds(&x, with_max).unwrap());
                assert_close_within(&got, &want, tolerance, &format!("{kind:?} {width} {lengths:?}"));
            }
        }
    }

    /// Compiled reductions over several static dims (one over each, or one over the
    /// last dims merged) equal eager's in every float kind, empty and one-row elements.
    #[test]
    fn compiled_reductions_over_several_static_dims_equal_eager(batches in proptest::collection::vec(lengths(4, 6), 1..3), seed in 0i64..1000) {
        for (kind, tolerance) in [(Kind::Float, 1e-5), (Kind::Double, 1e-9), (Kind::BFloat16, 3e-2), (Kind::Half, 5e-3)] {
            let compiled = compile("static_reductions", static_reductions);
            for (index, lengths) in batches.iter().enumerate() {
                let (x, _) = batch(lengths, &[24], kind, seed + index as i64);
                let got = compiled.call(&[&x], &[]).unwrap();
                let want = eager_values(static_reductions(&[x], &[]).unwrap());
                assert_close_within(&got, &want, tolerance, &format!("{kind:?} {lengths:?}"));
            }
            prop_assert_eq!(compiled.stats().compiles, 1);
        }
    }
}

/// Positions past the end of the table they index are an error naming the element, not
/// a read past the table.
#[test]
fn positions_past_their_table_are_an_error() {
    let table = Tensor::randn([3, 2], (Kind::Float, Device::Cpu));
    let compiled = compile("positions_table", |x: &[NestedTensor], _: &[Dense]| {
        x[0].ragged_positions()?.embedding(&table, -1)
    });
    assert!(compiled.call(&[&ids(&[3, 1], 0)], &[]).is_ok());
    let error = compiled
        .call(&[&ids(&[2, 4], 0)], &[])
        .expect_err("4 positions in a table of 3 rows");
    assert!(
        error.to_string().contains("element 1 has 4 positions"),
        "{error}"
    );
}

/// A reduction of each element over both ragged dims of a pair layout (`cdist`'s
/// `[L_i, M_i]` distances: sum, mean, amax, amin; kept or not) compiles to one
/// segmented kernel over each element's `L_i M_i` pairs, equal to eager on the CPU and
/// the simulated GPU, elements of one row included; an empty element has no largest
/// distance, the typed error as eagerly.
#[test]
fn compiled_reductions_over_both_ragged_dims_of_pairs_equal_eager() {
    let reductions = [
        (Reduce::Sum, false),
        (Reduce::Mean, true),
        (Reduce::Amax, false),
        (Reduce::Amin, true),
    ];
    for (rows, columns) in [
        (vec![3i64, 1, 4], vec![2i64, 5, 1]),
        (vec![1], vec![3]),
        (vec![2, 0], vec![4, 3]),
    ] {
        let (x, _) = batch(&rows, &[4], Kind::Float, 3);
        let (y, _) = batch(&columns, &[4], Kind::Float, 4);
        for (reduce, keepdim) in reductions {
            let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
                let distances = x[0].cdist(&x[1], 2.0)?;
                Ok(vec![distances.reduce(reduce, &[1, 2], keepdim)?.into()])
            };
            let what = format!("{reduce:?} keepdim {keepdim} {rows:?} x {columns:?}");
            let devices = [
                nestor::RunDevice::Inputs,
                nestor::RunDevice::Simulated(nestor::SimOptions::default()),
            ];
            for device in devices {
                let compiled = compile("pair_reduction", model)
                    .on_device(device)
                    .call(&[&x, &y], &[]);
                match model(&[x.shallow_clone(), y.shallow_clone()], &[]) {
                    Ok(eager) => {
                        let got = compiled.unwrap_or_else(|error| panic!("{what}: {error}"));
                        assert_close_within(&got, &eager_values(eager), 1e-5, &what);
                    }
                    Err(_) => {
                        assert!(
                            matches!(reduce, Reduce::Amax | Reduce::Amin),
                            "{what}: eager fails"
                        );
                        let error = compiled
                            .expect_err("eager fails, compiled must too")
                            .to_string();
                        assert!(error.contains("element 1"), "{what}: {error}");
                    }
                }
            }
        }
    }
}
