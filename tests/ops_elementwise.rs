//! Elementwise operators against per-element libtorch, for every operand kind, over
//! random lengths (0 and 1 included), batch sizes from 1, and f32/f64/f16/bf16.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_elements, assert_elements_of, batch, close, float_kinds, lengths};
use nestor::{Binary, NestedError, NestedTensor};
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

type Unary = (
    &'static str,
    fn(&NestedTensor) -> nestor::Result<NestedTensor>,
    fn(&Tensor) -> Tensor,
);

fn unary_ops() -> Vec<Unary> {
    vec![
        ("neg", NestedTensor::neg, |t| -t),
        ("abs", NestedTensor::abs, Tensor::abs),
        ("exp", NestedTensor::exp, Tensor::exp),
        ("expm1", NestedTensor::expm1, Tensor::expm1),
        ("log", |n| n.abs()?.log(), |t| t.abs().log()),
        ("log1p", |n| n.abs()?.log1p(), |t| t.abs().log1p()),
        ("sqrt", |n| n.abs()?.sqrt(), |t| t.abs().sqrt()),
        ("rsqrt", |n| n.abs()?.rsqrt(), |t| t.abs().rsqrt()),
        ("square", NestedTensor::square, Tensor::square),
        ("sin", NestedTensor::sin, Tensor::sin),
        ("cos", NestedTensor::cos, Tensor::cos),
        ("tanh", NestedTensor::tanh, Tensor::tanh),
        ("sigmoid", NestedTensor::sigmoid, Tensor::sigmoid),
        ("erf", NestedTensor::erf, Tensor::erf),
        ("relu", NestedTensor::relu, Tensor::relu),
        ("silu", NestedTensor::silu, Tensor::silu),
        ("mish", NestedTensor::mish, Tensor::mish),
        ("sign", NestedTensor::sign, Tensor::sign),
        ("floor", NestedTensor::floor, Tensor::floor),
        ("ceil", NestedTensor::ceil, Tensor::ceil),
        ("round", NestedTensor::round, Tensor::round),
        ("gelu", |n| n.gelu("none"), |t| t.gelu("none")),
        ("gelu_tanh", |n| n.gelu("tanh"), |t| t.gelu("tanh")),
        (
            "leaky_relu",
            |n| n.leaky_relu(0.1),
            |t| t.maximum(&(t * 0.1)),
        ),
        ("elu", |n| n.elu(1.0), Tensor::elu),
        ("softplus", |n| n.softplus(1.0, 20.0), Tensor::softplus),
        (
            "clamp",
            |n| n.clamp(Some(-0.5), Some(0.5)),
            |t| t.clamp(-0.5, 0.5),
        ),
        (
            "logical_not",
            NestedTensor::logical_not,
            Tensor::logical_not,
        ),
    ]
}

/// The libtorch call of each binary operator, written here rather than taken from
/// `Binary::apply` (the table the library itself uses).
fn torch_binary(op: Binary, a: &Tensor, b: &Tensor) -> Tensor {
    match op {
        Binary::Add => a + b,
        Binary::Sub => a - b,
        Binary::Mul => a * b,
        Binary::Div => a / b,
        Binary::Maximum => a.maximum(b),
        Binary::Minimum => a.minimum(b),
        Binary::Lt => a.lt_tensor(b),
        Binary::Ge => a.ge_tensor(b),
        Binary::Eq => a.eq_tensor(b),
        other => panic!("no reference for {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    #[test]
    fn unary_ops_match_per_element_torch(lengths in lengths(6, 9), channels in 1i64..4, kind in float_kinds(), seed in 0i64..1000) {
        let (nested, elements) = batch(&lengths, &[channels], kind, seed);
        for (name, packed, reference) in unary_ops() {
            let result = packed(&nested).unwrap();
            let expected: Vec<Tensor> = elements.iter().map(reference).collect();
            assert_elements_of(&format!("{name} on {kind:?}"), &result, &expected, kind);
        }
    }

    #[test]
    fn binary_ops_with_every_operand_kind(lengths in lengths(6, 9), kind in float_kinds(), seed in 0i64..1000) {
        let channels = 3;
        let (nested, elements) = batch(&lengths, &[channels], kind, seed);
        let (other, other_elements) = batch(&lengths, &[channels], kind, seed + 1);
        let batch_size = lengths.len() as i64;
        let options = (kind, Device::Cpu);
        let tail = Tensor::randn([channels], options);
        let row = Tensor::randn([1, channels], options);
        let per_batch = Tensor::randn([batch_size, 1, channels], options);
        let zero_d = Tensor::from(0.75f64).to_kind(kind);
        let padded = other.tensor().unwrap();
        for op in [Binary::Add, Binary::Sub, Binary::Mul, Binary::Div, Binary::Maximum, Binary::Minimum, Binary::Lt, Binary::Ge, Binary::Eq] {
            let reference = |a: &Tensor, b: &Tensor| torch_binary(op, a, b);
            let cases: Vec<(&str, NestedTensor, Vec<Tensor>)> = vec![
                ("scalar", nested.binary(op, 0.5).unwrap(), elements.iter().map(|e| reference(e, &Tensor::from(0.5f64).to_kind(kind))).collect()),
                ("0-d", nested.binary(op, &zero_d).unwrap(), elements.iter().map(|e| reference(e, &zero_d)).collect()),
                ("tail", nested.binary(op, &tail).unwrap(), elements.iter().map(|e| reference(e, &tail)).collect()),
                ("row", nested.binary(op, &row).unwrap(), elements.iter().map(|e| reference(e, &row)).collect()),
                ("per-batch", nested.binary(op, &per_batch).unwrap(), elements.iter().enumerate().map(|(i, e)| reference(e, &per_batch.get(i as i64))).collect()),
                ("nested", nested.binary(op, &other).unwrap(), elements.iter().zip(&other_elements).map(|(e, o)| reference(e, o)).collect()),
                ("padded", nested.binary(op, &padded).unwrap(), elements.iter().zip(&other_elements).map(|(e, o)| reference(e, o)).collect()),
                ("reversed", nested.binary_reversed(op, &tail).unwrap(), elements.iter().map(|e| reference(&tail, e)).collect()),
            ];
            for (operand, result, expected) in cases {
                assert_elements_of(&format!("{op:?} with {operand} operand on {kind:?}"), &result, &expected, kind);
            }
        }
    }

    #[test]
    fn gradients_flow_like_per_element_autograd(lengths in lengths(5, 8), seed in 0i64..1000) {
        let (nested, elements) = batch(&lengths, &[4], Kind::Double, seed);
        let leaf = nested.detach().unwrap().set_requires_grad(true).unwrap();
        let weight = Tensor::randn([4], (Kind::Double, Device::Cpu));
        let output = (&(&leaf.tanh().unwrap() * &weight).unwrap() + &leaf.sigmoid().unwrap()).unwrap();
        output.values().sum(Kind::Double).backward();
        let grads = leaf.grad().unwrap().unbind().unwrap();
        for (element, grad) in elements.iter().zip(&grads) {
            let x = element.detach().set_requires_grad(true);
            (x.tanh() * &weight + x.sigmoid()).sum(Kind::Double).backward();
            prop_assert!(close(grad, &x.grad(), Kind::Double));
        }
    }
}

#[test]
fn rust_operators_and_in_place_variants() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[3, 1, 0], &[2], Kind::Float, 7);
    let tail = Tensor::from_slice(&[1.0f32, -1.0]);
    let sum = (&nested + &nested)?;
    assert_elements(
        &sum,
        &elements.iter().map(|e| e * 2.0).collect::<Vec<_>>(),
        Kind::Float,
    );
    let combined = ((&(&nested * 2.0)? - 1.0)? / &tail)?;
    assert_elements(
        &combined,
        &elements
            .iter()
            .map(|e| (e * 2.0 - 1.0) / &tail)
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    let reversed = (1.0 - &nested)?;
    assert_elements(
        &reversed,
        &elements.iter().map(|e| 1.0 - e).collect::<Vec<_>>(),
        Kind::Float,
    );
    let left_dense = (&tail * &nested)?;
    assert_elements(
        &left_dense,
        &elements.iter().map(|e| &tail * e).collect::<Vec<_>>(),
        Kind::Float,
    );
    let negated = (-&nested)?;
    assert_elements(
        &negated,
        &elements.iter().map(|e| -e).collect::<Vec<_>>(),
        Kind::Float,
    );
    let integers = NestedTensor::from_lists(vec![vec![1i64, 2], vec![3]])?;
    assert_eq!((&integers + 1)?.kind(), Kind::Int64);
    assert_eq!(
        (&integers + 0.5)?.kind(),
        Kind::Float,
        "an int batch plus a float scalar is float, as in torch"
    );

    let mut in_place = nested.detach()?.to_kind(Kind::Float)?;
    let view = in_place.get(0)?;
    in_place.mul_(3.0)?;
    in_place.add_(&tail)?;
    assert_elements(
        &in_place,
        &elements.iter().map(|e| e * 3.0 + &tail).collect::<Vec<_>>(),
        Kind::Float,
    );
    assert!(
        close(&view, &(&elements[0] * 3.0 + &tail), Kind::Float),
        "views see in-place changes"
    );
    Ok(())
}

#[test]
fn where_and_masked_fill() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[4, 2], &[3], Kind::Float, 3);
    let positive = nested.gt(0.0)?;
    let clipped = nested.where_self(&positive, 0.0)?;
    assert_elements(
        &clipped,
        &elements.iter().map(|e| e.relu()).collect::<Vec<_>>(),
        Kind::Float,
    );
    let filled = nested.masked_fill(&positive, 9.0)?;
    assert_elements(
        &filled,
        &elements
            .iter()
            .map(|e| e.masked_fill(&e.gt(0.0), 9.0))
            .collect::<Vec<_>>(),
        Kind::Float,
    );
    Ok(())
}

#[test]
fn broadcasting_grows_a_static_dim_of_one() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[2, 3], &[1], Kind::Float, 5);
    let tail = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]);
    let grown = (&nested * &tail)?;
    assert_eq!(grown.values().size(), [5, 4]);
    assert_elements(
        &grown,
        &elements.iter().map(|e| e * &tail).collect::<Vec<_>>(),
        Kind::Float,
    );
    Ok(())
}

#[test]
fn positional_and_mismatched_operands_are_errors() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, _) = batch(&[4, 2], &[3], Kind::Float, 1);
    let positional = Tensor::ones([1, 4, 3], (Kind::Float, Device::Cpu));
    assert!(matches!(
        nested.add(&positional),
        Err(NestedError::DenseOperand { .. })
    ));
    let wrong_batch = Tensor::ones([3, 1, 3], (Kind::Float, Device::Cpu));
    assert!(matches!(
        nested.add(&wrong_batch),
        Err(NestedError::DenseOperand { .. })
    ));
    let wrong_tail = Tensor::ones([5], (Kind::Float, Device::Cpu));
    assert!(matches!(
        nested.add(&wrong_tail),
        Err(NestedError::DenseOperand { .. })
    ));
    let (other, _) = batch(&[3, 3], &[3], Kind::Float, 2);
    assert!(matches!(
        nested.add(&other),
        Err(NestedError::StructureMismatch { .. })
    ));
    assert!(matches!(
        &nested + &other,
        Err(NestedError::StructureMismatch { .. })
    ));
    Ok(())
}

#[test]
fn batch_second_per_batch_operands() -> Result<(), Box<dyn std::error::Error>> {
    let (nested, elements) = batch(&[3, 1], &[2], Kind::Float, 4);
    let nested = nested.with_options(nestor::NestedOptions {
        batch_first: false,
        ..Default::default()
    });
    let per_batch = Tensor::randn([1, 2, 2], (Kind::Float, Device::Cpu));
    let result = nested.add(&per_batch)?;
    let expected: Vec<Tensor> = elements
        .iter()
        .enumerate()
        .map(|(i, e)| e + per_batch.select(1, i as i64))
        .collect();
    assert_elements(&result, &expected, Kind::Float);
    Ok(())
}
