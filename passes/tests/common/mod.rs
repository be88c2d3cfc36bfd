//! Runs graphs on random inputs drawn from their input types, through the interpreter
//! (libtorch op by op): the check that a rewrite keeps a graph's meaning.
#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;

use nestor_frontend::{interpret, NestedTensor, Value};
use nestor_ir::{DType, Dim, ElemDim, Graph, Op, Type, ValueId};
use tch::{Device, Kind, Tensor};

/// The batch size of the random inputs.
const BATCH: i64 = 3;

/// Random inputs for `graph`'s `input` / `param` ops: lengths with a 0 and a 1 among
/// them, ragged batches of those lengths, dense tensors of the typed shapes.
pub fn random_inputs(graph: &Graph, seed: i64) -> Vec<Value> {
    // Seeding and drawing from libtorch's global generator, one test at a time.
    static GENERATOR: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = GENERATOR
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    tch::manual_seed(seed);
    let mut lengths: HashMap<ValueId, Vec<i64>> = HashMap::new();
    let mut inputs = Vec::new();
    for (index, node) in graph.nodes.iter().enumerate() {
        if !matches!(node.op, Op::Input { .. } | Op::Param { .. }) {
            continue;
        }
        let value = ValueId(index as u32);
        inputs.push(match &node.ty {
            Type::Lengths { .. } => {
                let drawn: Vec<i64> = (0..BATCH)
                    .map(|i| [0, 1, 4, 2, 5][(i + seed).rem_euclid(5) as usize])
                    .collect();
                lengths.insert(value, drawn.clone());
                Value::Lengths(drawn)
            }
            Type::Dense { dtype, shape } => {
                let shape: Vec<i64> = shape.iter().map(|dim| size(dim, &lengths)).collect();
                Value::Dense(random(*dtype, &shape))
            }
            Type::Ragged { dtype, dims, .. } => {
                let elements: Vec<Tensor> = (0..BATCH as usize)
                    .map(|element| {
                        let shape: Vec<i64> = dims
                            .iter()
                            .map(|dim| match dim {
                                ElemDim::Fixed(dim) => size(dim, &lengths),
                                ElemDim::Ragged(of) => lengths[of][element],
                            })
                            .collect();
                        random(*dtype, &shape)
                    })
                    .collect();
                let ragged: Vec<usize> = dims
                    .iter()
                    .enumerate()
                    .filter(|(_, dim)| matches!(dim, ElemDim::Ragged(_)))
                    .map(|(position, _)| position)
                    .collect();
                Value::Nested(
                    NestedTensor::builder()
                        .ragged_dims(&ragged)
                        .tensors(&elements)
                        .unwrap(),
                )
            }
        });
    }
    inputs
}

fn size(dim: &Dim, lengths: &HashMap<ValueId, Vec<i64>>) -> i64 {
    match dim {
        Dim::Static(size) => *size,
        Dim::Sym(_) => BATCH,
        Dim::Max(of) => lengths[of].iter().copied().max().unwrap_or(0),
    }
}

fn random(dtype: DType, shape: &[i64]) -> Tensor {
    let options = (Kind::Double, Device::Cpu);
    match dtype {
        DType::Bool => Tensor::rand(shape, options).gt(0.5),
        DType::I64 | DType::I32 => Tensor::randint(3, shape, (Kind::Int64, Device::Cpu))
            .to_kind(nestor_frontend::kind_of(dtype)),
        other => Tensor::randn(shape, options).to_kind(nestor_frontend::kind_of(other)),
    }
}

/// Asserts that `graph` and `rewritten` compute the same on random inputs (f32: within
/// 1e-5, since a rewrite may reorder arithmetic).
pub fn assert_same_meaning(graph: &Graph, rewritten: &Graph, what: &str) {
    for seed in 0..3 {
        // Drawn once for both graphs (their inputs are the same ops).
        let inputs = random_inputs(graph, seed);
        let run = |graph: &Graph| {
            let inputs = inputs.iter().map(share).collect();
            interpret(graph, inputs)
                .unwrap_or_else(|error| panic!("{what}: {error}\n{}", nestor_ir::print(graph)))
        };
        let (before, after) = (run(graph), run(rewritten));
        assert_eq!(before.len(), after.len(), "{what}: outputs");
        for (position, (a, b)) in before.iter().zip(&after).enumerate() {
            let (a, b) = (tensor(a), tensor(b));
            assert_eq!(a.size(), b.size(), "{what}: output {position} shape");
            let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
            assert!(
                a.allclose(&b, 1e-5, 1e-5, true),
                "{what}: output {position} differs on seed {seed}: {a} vs {b}"
            );
        }
    }
}

fn share(value: &Value) -> Value {
    match value {
        Value::Nested(nested) => Value::Nested(nested.shallow_clone()),
        Value::Dense(tensor) => Value::Dense(tensor.shallow_clone()),
        Value::Lengths(lengths) => Value::Lengths(lengths.clone()),
    }
}

fn tensor(value: &Value) -> Tensor {
    match value {
        Value::Nested(nested) => nested.values().shallow_clone(),
        Value::Dense(tensor) => tensor.shallow_clone(),
        Value::Lengths(lengths) => Tensor::from_slice(lengths),
    }
}

/// Asserts that `graph` and `rewritten` give the same bits on `inputs` (NaN for NaN,
/// the sign of every zero): for rewrites that claim to be exact.
pub fn assert_same_bits(graph: &Graph, rewritten: &Graph, inputs: &[Value], what: &str) {
    let run = |graph: &Graph| {
        interpret(graph, inputs.iter().map(share).collect())
            .unwrap_or_else(|error| panic!("{what}: {error}\n{}", nestor_ir::print(graph)))
    };
    let (before, after) = (run(graph), run(rewritten));
    assert_eq!(before.len(), after.len(), "{what}: outputs");
    for (position, (a, b)) in before.iter().zip(&after).enumerate() {
        let (a, b) = (tensor(a), tensor(b));
        assert_eq!(
            (a.size(), a.kind()),
            (b.size(), b.kind()),
            "{what}: output {position}"
        );
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        let same = a
            .eq_tensor(&b)
            .logical_and(&a.signbit().eq_tensor(&b.signbit()))
            .logical_or(&a.isnan().logical_and(&b.isnan()));
        assert!(
            same.all().int64_value(&[]) == 1,
            "{what}: output {position}: {a} vs {b}\n{}",
            nestor_ir::print(rewritten)
        );
    }
}
