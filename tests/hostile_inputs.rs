//! Careless and hostile inputs get typed errors (or the right result), never a panic,
//! an abort or a silently wrapped size, in debug and release builds alike.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::batch;
use nestor::nn::MultiheadAttention;
use nestor::{LayoutError, NestedError, NestedTensor};
use tch::{nn, Device, Kind, Tensor};

/// Held by the tests that run compiled code: one of them lowers the process-wide
/// memory budget for a moment.
static COMPILED: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn compiled_turn() -> std::sync::MutexGuard<'static, ()> {
    COMPILED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[test]
fn lengths_whose_sum_or_product_overflows_are_typed_errors() {
    let values = Tensor::zeros([4, 2], (Kind::Float, Device::Cpu));
    for lengths in [vec![i64::MAX, 1], vec![i64::MAX / 2, i64::MAX / 2, 2]] {
        let error = NestedTensor::packed_with_lengths(&values, &lengths).unwrap_err();
        assert!(
            matches!(error, NestedError::Layout(LayoutError::TooLarge { .. })),
            "{lengths:?}: {error}"
        );
    }
    // Rows that fit, values that do not: i64::MAX / 2 rows of width 4.
    let error = nestor::RaggedLayout::from_lengths(&[i64::MAX / 2], &[4]);
    assert!(
        matches!(
            error,
            Err(LayoutError::TooLarge {
                what: "packed values",
                ..
            })
        ),
        "{error:?}"
    );
}

#[test]
fn extreme_slice_and_select_positions_are_clamped_or_typed_errors() {
    let (nested, _) = batch(&[3, 1, 4], &[5], Kind::Float, 1);
    // `0..=i64::MAX` reaches the end, as `0..` does.
    let all = nested.slice(2, 0..=i64::MAX).unwrap();
    assert_eq!(
        all.layout().element_sizes(),
        nested.layout().element_sizes()
    );
    assert!(all.values().equal(nested.values()));
    let empty = nested.slice(2, i64::MAX..).unwrap();
    assert_eq!(empty.layout().element_sizes()[0], [3, 0]);
    for index in [i64::MAX, i64::MIN] {
        let error = nested.select(1, index).unwrap_err();
        assert!(
            matches!(error, NestedError::ElementTooShort { .. }),
            "{index}: {error}"
        );
    }
}

#[test]
fn huge_repeats_are_typed_errors_before_any_allocation() {
    let (nested, _) = batch(&[3, 1], &[2], Kind::Float, 2);
    for repeats in [usize::MAX, 1 << 62, 1 << 40] {
        for result in [
            nested.repeat_batch(repeats),
            nested.repeat_interleave(repeats),
        ] {
            let error = result.unwrap_err();
            assert!(
                matches!(error, NestedError::TooLarge { .. }),
                "{repeats}: {error}"
            );
        }
    }
    // Small repeats still work.
    assert_eq!(nested.repeat_batch(3).unwrap().len(), 6);
    assert_eq!(nested.repeat_interleave(2).unwrap().len(), 4);
}

#[test]
fn attention_with_no_heads_is_a_typed_error() {
    let store = nn::VarStore::new(Device::Cpu);
    for heads in [0, -2, 3] {
        let layer = MultiheadAttention::new(&store.root(), 8, heads, true);
        let (x, _) = batch(&[2, 3], &[8], Kind::Float, 3);
        let error = layer.forward(&x, &x, &x, false).unwrap_err();
        assert!(
            matches!(error, NestedError::Unsupported { .. }),
            "{heads}: {error}"
        );
    }
}

#[test]
fn bilinear_interpolation_of_elements_that_are_not_images_is_a_typed_error() {
    let (tokens, _) = batch(&[3, 2], &[], Kind::Float, 4);
    let error = tokens
        .interpolate_bilinear(None, Some(2.0), false)
        .unwrap_err();
    assert!(matches!(error, NestedError::Unsupported { .. }), "{error}");
    let images = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&[
            Tensor::zeros([1, 4, 5], (Kind::Float, Device::Cpu)),
            Tensor::zeros([1, 3, 3], (Kind::Float, Device::Cpu)),
        ])
        .unwrap();
    for scale in [f64::NAN, -1.0, f64::INFINITY, 0.0] {
        let error = images
            .interpolate_bilinear(None, Some(scale), false)
            .unwrap_err();
        assert!(
            matches!(error, NestedError::Unsupported { .. }),
            "{scale}: {error}"
        );
    }
    let doubled = images.interpolate_bilinear(None, Some(2.0), false).unwrap();
    assert_eq!(doubled.layout().element_sizes()[0], [1, 8, 10]);
}

#[test]
fn an_undefined_tensor_is_a_typed_error() {
    let error = NestedTensor::packed_with_lengths(&Tensor::new(), &[1, 2]).unwrap_err();
    assert!(
        matches!(error, NestedError::ShapeMismatch { .. }),
        "{error}"
    );
}

#[test]
fn float_batch_indices_are_a_typed_error() {
    let (nested, _) = batch(&[2, 3, 1], &[2], Kind::Float, 5);
    let error = nestor::BatchSelector::from_tensor(&Tensor::from_slice(&[0.7f32, 1.2]))
        .err()
        .unwrap();
    assert!(matches!(error, NestedError::Unsupported { .. }), "{error}");
    let picked = nested
        .select_batch(nestor::BatchSelector::from_tensor(&Tensor::from_slice(&[2i32, 0])).unwrap())
        .unwrap();
    assert_eq!(picked.layout().element_sizes(), [vec![1, 2], vec![2, 2]]);
}

#[test]
fn in_place_results_that_cannot_be_cast_back_are_typed_errors() {
    let elements = [Tensor::from_slice(&[1i64, 2]), Tensor::from_slice(&[3i64])];
    let ids = NestedTensor::from_tensors(&elements).unwrap();
    let mut changed = NestedTensor::from_tensors(&elements).unwrap();
    let error = changed.binary_(nestor::Binary::Add, 0.5).unwrap_err();
    assert!(matches!(error, NestedError::Unsupported { .. }), "{error}");
    assert!(changed.values().equal(ids.values()), "left as it was");
    changed.binary_(nestor::Binary::Add, 2i64).unwrap();
    assert_eq!(Vec::<i64>::try_from(changed.values()).unwrap(), [3, 4, 5]);
}

#[test]
fn a_compiled_function_keeps_the_number_of_inputs_it_was_first_called_with() {
    let _turn = compiled_turn();
    let compiled = nestor::compile("arity", |x: &[NestedTensor], _: &[nestor::Dense]| {
        x[0].relu()
    });
    let (a, _) = batch(&[2, 1], &[3], Kind::Float, 6);
    compiled.call(&[&a], &[]).unwrap();
    let error = compiled.call(&[&a, &a], &[]).unwrap_err();
    assert!(
        matches!(error, NestedError::InputMismatch { .. }),
        "{error}"
    );
    let extra = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let error = compiled.call(&[&a], &[&extra]).unwrap_err();
    assert!(
        matches!(error, NestedError::InputMismatch { .. }),
        "{error}"
    );
    assert_eq!(
        compiled.stats().compiles,
        1,
        "no program for the wrong calls"
    );
    compiled.call(&[&a], &[]).unwrap();
}

#[test]
fn a_parameter_resized_after_compiling_is_a_typed_error_not_a_wrong_read() {
    // Calls of a known structure skip the graph's type check (the structure key fixes
    // the inputs' types); the runtime still checks every buffer's size.
    let _turn = compiled_turn();
    let mut weight = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
    let captured = weight.shallow_clone();
    let compiled = nestor::compile("resized", move |x: &[NestedTensor], _: &[nestor::Dense]| {
        x[0].linear(&captured, None)
    });
    let (a, _) = batch(&[2, 1], &[3], Kind::Float, 6);
    compiled.call(&[&a], &[]).unwrap();
    let _resized = tch::no_grad(|| weight.f_resize_([5, 3])).unwrap();
    let error = compiled.call(&[&a], &[]).unwrap_err();
    assert!(error.to_string().contains("values"), "{error}");
}

#[test]
fn reshapes_whose_sizes_overflow_do_not_type() {
    let text = "graph @g {
  %0 = input {name = \"L\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
  %2 = reshape_tail(%1) {tail = [4611686018427387904, 4611686018427387904, 4]} : ragged<f32>[B; %0, 4611686018427387904, 4611686018427387904, 4]
  return %2
}
";
    let error = nestor::ir::parse(text).unwrap_err();
    assert!(error.message.contains("cannot reshape"), "{error}");
}

#[test]
fn a_batcher_with_a_huge_batch_size_gives_one_batch() {
    let samples: Vec<nestor::PNTensor> = (1..=5)
        .map(|n| nestor::PNTensor(Tensor::zeros([n], (Kind::Float, Device::Cpu))))
        .collect();
    let batcher = nestor::Batcher::new(&samples, usize::MAX)
        .shuffle(3)
        .bucket_by_length(usize::MAX, |index| index);
    let plan = batcher.plan(0);
    assert_eq!(plan.len(), 1);
    assert_eq!(plan[0].len(), 5);
}

#[test]
fn mismatched_batches_and_static_indices_have_errors_that_say_so() {
    let (a, _) = batch(&[2, 3], &[4], Kind::Float, 7);
    let (b, _) = batch(&[2, 3, 1], &[4], Kind::Float, 8);
    let error = a.cdist(&b, 2.0).unwrap_err();
    assert!(
        matches!(
            error,
            NestedError::BatchSizeMismatch {
                op: "cdist",
                expected: 2,
                got: 3,
                ..
            }
        ),
        "{error}"
    );
    let heads = |x: &NestedTensor| x.reshape_tail(&[2, 2]).unwrap();
    let error = heads(&a)
        .scaled_dot_product_attention(&heads(&b), &heads(&b), false, None)
        .unwrap_err();
    assert!(
        matches!(error, NestedError::BatchSizeMismatch { what: "keys", .. }),
        "{error}"
    );
    let values = Tensor::zeros([5, 1], (Kind::Float, Device::Cpu));
    let error = NestedTensor::packed_with_rectangular_lengths(&values, &[1, 2], &[1]).unwrap_err();
    assert!(
        matches!(
            error,
            NestedError::BatchSizeMismatch {
                what: "columns",
                ..
            }
        ),
        "{error}"
    );
    let error = a.select_static(2, 4).unwrap_err();
    assert!(
        matches!(
            error,
            NestedError::StaticIndexOutOfRange {
                dim: 2,
                index: 4,
                size: 4,
                ..
            }
        ),
        "{error}"
    );
    assert!(error.to_string().contains("dim 2 of size 4"), "{error}");
}

#[test]
fn libtorch_errors_show_their_first_line() {
    let (ids, _) = batch(&[2, 1], &[], Kind::Float, 9);
    let ids = ids.to_kind(Kind::Int64).unwrap();
    let flat = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    let error = ids.embedding(&flat, -1).unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, NestedError::Torch(_)), "{text}");
    assert!(text.starts_with("libtorch: "), "{text}");
    assert!(!text.contains('\n') && !text.contains("frame #"), "{text}");
}

/// Attention holds one tile of scores per task, never `L x L`: an element of 5,000 rows
/// (100 MB of scores per head) runs compiled within a 16 MiB budget and agrees with
/// eager; a budget below one tile is the typed memory error of the attention step, and
/// smaller budgets stop smaller steps; the function keeps working after.
#[test]
fn steps_over_the_memory_budget_are_typed_errors_not_aborts() {
    let _turn = compiled_turn();
    tch::manual_seed(10);
    let store = nn::VarStore::new(Device::Cpu);
    let config = nestor::nn::TransformerConfig {
        d_model: 8,
        nhead: 2,
        dim_feedforward: 16,
        dropout: 0.0,
        ..Default::default()
    };
    let encoder =
        nestor::nn::TransformerEncoder::new(&(store.root() / "encoder"), &config, 1, true);
    let compiled = nestor::compile("long", |x: &[NestedTensor], _: &[nestor::Dense]| {
        encoder.forward(&x[0], false)
    });
    let (short, _) = batch(&[30, 2], &[8], Kind::Float, 12);
    let eager = encoder.forward(&short, false).unwrap();
    let got = compiled
        .call(&[&short], &[])
        .unwrap()
        .remove(0)
        .into_nested()
        .unwrap();
    assert!(got.values().allclose(eager.values(), 1e-4, 1e-4, false));
    let (long, _) = batch(&[5_000], &[8], Kind::Float, 11);
    nestor::MemoryBudget::set(Some(16 << 20));
    let got = compiled.call(&[&long], &[]);
    nestor::MemoryBudget::set(None);
    let got = got.unwrap().remove(0).into_nested().unwrap();
    let eager = encoder.forward(&long, false).unwrap();
    assert!(got.values().allclose(eager.values(), 1e-4, 1e-4, false));
    assert_eq!(compiled.stats().compiles, 1);
    // 3.5 KiB holds every buffer of the short batch (the widest, 32 rows x 24 floats,
    // is 3 KiB) but not a tile of attention scores of its 30-row element (30 x 34
    // floats per task).
    nestor::MemoryBudget::set(Some(3584));
    let error = compiled.call(&[&short], &[]).unwrap_err();
    nestor::MemoryBudget::set(None);
    assert!(
        matches!(&error, NestedError::Compile { stage: "runtime", reason } if reason.contains("memory budget") && reason.contains("attention")),
        "{error}"
    );
    // A budget of 1 KiB stops the first buffer of a batch of 30 x 8 floats (960 bytes
    // fit; 2,000 rows do not).
    nestor::MemoryBudget::set(Some(1024));
    let (wide, _) = batch(&[2_000], &[8], Kind::Float, 13);
    let error = compiled.call(&[&wide], &[]).unwrap_err();
    nestor::MemoryBudget::set(None);
    assert!(
        matches!(&error, NestedError::Compile { reason, .. } if reason.contains("memory budget")),
        "{error}"
    );
    compiled.call(&[&short], &[]).unwrap();
}

/// Arbitrary lengths, sizes, bounds and indices through the constructors and indexing:
/// a typed error or a batch whose layout agrees with its values, never a panic.
/// `NESTOR_FUZZ_INPUTS` sets how many (`make fuzz` runs 100,000).
#[test]
fn arbitrary_sizes_and_indices_never_panic() {
    let count: i64 = std::env::var("NESTOR_FUZZ_INPUTS")
        .ok()
        .and_then(|count| count.parse().ok())
        .unwrap_or(2_000);
    let extremes = [
        i64::MIN,
        i64::MIN + 1,
        -3,
        -1,
        0,
        1,
        2,
        5,
        i64::MAX / 2,
        i64::MAX,
    ];
    for n in 0..count {
        let mut random = common::Random::new(n);
        let mut pick = |bound: i64| {
            let value = random.below(u64::MAX, &[1]).int64_value(&[0]);
            if value % 3 == 0 {
                extremes[(value.unsigned_abs() % extremes.len() as u64) as usize]
            } else {
                value.rem_euclid(bound)
            }
        };
        let lengths: Vec<i64> = (0..pick(5).clamp(0, 6)).map(|_| pick(4)).collect();
        let rows: i64 = lengths.iter().map(|&l| l.clamp(0, 4)).sum();
        let values = Tensor::zeros([rows, 2], (Kind::Float, Device::Cpu));
        let (start, end, index, dim) = (pick(6), pick(6), pick(6), pick(3));
        let outcome = std::panic::catch_unwind(|| {
            let Ok(nested) = NestedTensor::packed_with_lengths(&values, &lengths) else {
                return;
            };
            assert_eq!(nested.values().size()[0], nested.layout().total_rows());
            if let Ok(sliced) = nested.slice(dim, start..end) {
                assert_eq!(sliced.values().size()[0], sliced.layout().total_rows());
            }
            let _ = nested.select(dim, index);
            let _ = nested.get(index);
            if let Ok(picked) = nested.select_batch(vec![index, start]) {
                assert_eq!(picked.values().size()[0], picked.layout().total_rows());
            }
            if let Ok(repeated) = nested.repeat_batch(start.unsigned_abs() as usize % 4) {
                assert_eq!(repeated.values().size()[0], repeated.layout().total_rows());
            }
        });
        assert!(
            outcome.is_ok(),
            "input {n} panicked: lengths {lengths:?}, dim {dim}, bounds {start}..{end}, index {index}"
        );
    }
}

/// Compiled calls with arbitrary inputs (batch sizes 0..5, lengths 0..6, widths that do
/// or do not fit the model, ranks 2 or 3, f32, f64, i64 or bool values, one or two
/// batches): each is a typed error or the eager result. `NESTOR_FUZZ_INPUTS` sets how
/// many.
#[test]
fn compiled_calls_with_arbitrary_inputs_give_typed_errors_or_eager_results() {
    let _turn = compiled_turn();
    let count: i64 = std::env::var("NESTOR_FUZZ_INPUTS")
        .ok()
        .and_then(|count| count.parse::<i64>().ok())
        .map_or(300, |count| count / 50);
    let weight = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
    let model = |x: &[NestedTensor], _: &[nestor::Dense]| -> nestor::Result<Vec<common::Out>> {
        let hidden = x[0].linear(&weight, None)?.relu()?;
        Ok(vec![
            hidden.softmax(-1)?.into(),
            hidden.sum(&[1], false)?.into(),
        ])
    };
    let compiled = nestor::compile("arbitrary", model);
    let kinds = [Kind::Float, Kind::Double, Kind::Int64, Kind::Bool];
    let ran = std::cell::Cell::new(0);
    for n in 0..count {
        let mut random = common::Random::new(n);
        let mut pick = |bound: u64| random.below(bound, &[1]).int64_value(&[0]);
        let lengths: Vec<i64> = (0..pick(5)).map(|_| pick(7)).collect();
        let width = [4, 4, 3, 0][pick(4) as usize];
        let tail: Vec<i64> = if pick(4) == 0 {
            vec![2, width]
        } else {
            vec![width]
        };
        let kind = kinds[pick(4) as usize];
        let (x, _) = batch(&lengths, &tail, Kind::Double, n);
        let x = x.to_kind(kind).unwrap();
        let inputs: Vec<&NestedTensor> = if pick(6) == 0 { vec![&x, &x] } else { vec![&x] };
        // The closure only reads; a panic fails the test right after.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let got = compiled.call(&inputs, &[]);
            let owned: Vec<NestedTensor> = inputs.iter().map(|x| x.shallow_clone()).collect();
            match (got, model(&owned, &[])) {
                (Ok(got), Ok(want)) => {
                    common::assert_close_within(&got, &common::eager_values(want), 1e-4, "call");
                    ran.set(ran.get() + 1);
                }
                (Ok(_), Err(error)) => panic!("compiled ran where eager failed: {error}"),
                (Err(_), _) => {}
            }
        }));
        assert!(
            outcome.is_ok(),
            "input {n} panicked: lengths {lengths:?}, tail {tail:?}, {kind:?}, {} batches",
            inputs.len()
        );
    }
    // About a quarter of the draws fit the model (f32, width 4, one batch).
    assert!(
        ran.get() * 10 > count,
        "only {} of {count} calls ran",
        ran.get()
    );
}

/// A dtype the model's own operators refuse (an f64 batch into f32 weights) is the
/// model's libtorch error, one line, and the function keeps working; a model that
/// converts its inputs takes other dtypes. (So inputs are not checked against parameter
/// dtypes up front: that would refuse the second model.)
#[test]
fn dtypes_the_model_refuses_are_its_own_one_line_errors() {
    let _turn = compiled_turn();
    let weight = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
    let strict = nestor::compile("strict", |x: &[NestedTensor], _: &[nestor::Dense]| {
        x[0].linear(&weight, None)
    });
    let converting = nestor::compile("converting", |x: &[NestedTensor], _: &[nestor::Dense]| {
        x[0].to_kind(Kind::Float)?.linear(&weight, None)
    });
    let (doubles, _) = batch(&[2, 3], &[4], Kind::Double, 14);
    let (floats, _) = batch(&[2, 3], &[4], Kind::Float, 14);
    let error = strict.call(&[&doubles], &[]).unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, NestedError::Torch(_)), "{text}");
    assert!(!text.contains('\n'), "{text}");
    strict.call(&[&floats], &[]).unwrap();
    // f16 inputs, converted by the model (f64 ones would mix precisions in one program,
    // a typed compile error of its own).
    let halves = floats.to_kind(Kind::Half).unwrap();
    let from_halves = converting.call(&[&halves], &[]).unwrap().remove(0);
    let eager = halves
        .to_kind(Kind::Float)
        .unwrap()
        .linear(&weight, None)
        .unwrap();
    common::assert_close_within(
        &[from_halves],
        &[nestor::Value::Nested(eager)],
        1e-6,
        "converting",
    );
}

/// A failed compiled call says why in a type a caller can match on (the reason's
/// cause) and keeps the failing layer's error to downcast: an id out of range is bad
/// input (the message names the same input), a step over the memory budget says its
/// step and sizes, a program mixing f64 and f32 is unsupported by the lowering, and a
/// training model without a scalar loss is the model's fault.
#[test]
fn compiled_failures_have_typed_causes() {
    use nestor::passes::{AutodiffError, LowerError};
    use nestor::{CompileCause, RuntimeError};
    let _turn = compiled_turn();
    let reason = |error: NestedError| match error {
        NestedError::Compile { reason, .. } => reason,
        other => panic!("expected a compile error, got {other:?}"),
    };
    let table = Tensor::randn([5, 4], (Kind::Float, Device::Cpu));
    let embed = nestor::compile("embed", |x: &[NestedTensor], _: &[nestor::Dense]| {
        x[0].embedding(&table, -1)
    });
    let ids = |last: i64| {
        NestedTensor::from_tensors(&[Tensor::from_slice(&[0i64, 4]), Tensor::from_slice(&[last])])
            .unwrap()
    };
    embed.call(&[&ids(3)], &[]).unwrap();
    let bad = reason(embed.call(&[&ids(9)], &[]).unwrap_err());
    let CompileCause::BadInput { input } = bad.cause() else {
        panic!("an id out of range: {:?}", bad.cause());
    };
    assert!(bad.starts_with(&format!("input {input}: ")), "{bad}");
    assert!(bad.contains("has id 9"), "{bad}");
    assert!(matches!(
        bad.error().and_then(|error| error.downcast_ref::<RuntimeError>()),
        Some(RuntimeError::BadInput { input: got, .. }) if *got == input
    ));

    // The hidden buffer (2,000 rows of 8 floats) is the program's own.
    let weight = Tensor::randn([8, 8], (Kind::Float, Device::Cpu));
    let relu = nestor::compile("mlp", |x: &[NestedTensor], _: &[nestor::Dense]| {
        x[0].linear(&weight, None)?.relu()?.linear(&weight, None)
    });
    let (wide, _) = batch(&[2_000], &[8], Kind::Float, 13);
    nestor::MemoryBudget::set(Some(1024));
    let over = relu.call(&[&wide], &[]);
    nestor::MemoryBudget::set(None);
    let over = reason(over.unwrap_err());
    assert!(
        matches!(over.cause(), CompileCause::MemoryBudget { bytes, budget: 1024, .. } if bytes > 1024),
        "{over:?}"
    );
    assert!(over.contains("memory budget"), "{over}");
    relu.call(&[&wide], &[]).unwrap();

    let (double, _) = batch(&[3, 1], &[4], Kind::Double, 2);
    let (single, _) = batch(&[3, 1], &[4], Kind::Float, 2);
    let mixed = nestor::compile("mixed", |x: &[NestedTensor], _: &[nestor::Dense]| {
        Ok(vec![x[0].relu()?, x[1].relu()?])
    });
    let mixed = reason(mixed.call(&[&double, &single], &[]).unwrap_err());
    assert_eq!(mixed.cause(), CompileCause::Unsupported, "{mixed}");
    assert!(mixed
        .error()
        .and_then(|error| error.downcast_ref::<LowerError>())
        .is_some());

    let store = nn::VarStore::new(Device::Cpu);
    let weight = store.root().randn("weight", &[3, 4], 0.0, 0.5);
    let not_scalar = nestor::compile(
        "not_scalar",
        move |x: &[NestedTensor], _: &[nestor::Dense]| x[0].linear(&weight, None),
    )
    .train(&store);
    let (inputs, _) = batch(&[2, 1], &[4], Kind::Float, 1);
    let model = reason(not_scalar.call(&[&inputs], &[]).unwrap_err());
    assert_eq!(model.cause(), CompileCause::Model, "{model}");
    assert!(matches!(
        model
            .error()
            .and_then(|error| error.downcast_ref::<AutodiffError>()),
        Some(AutodiffError::LossNotScalar { .. })
    ));
}
