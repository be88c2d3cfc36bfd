//! Compiled kernels follow libtorch's IEEE semantics: every compiled op family on
//! batches holding NaN, +-inf, -0.0, subnormals and large magnitudes gives, position by
//! position, what eager gives (NaN where eager has NaN, the same infinities).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{assert_close_within, eager_values, Out};
use nestor::ir::{BinaryOp, ReduceOp, UnaryOp};
use nestor::{compile, Binary, Dense, LossReduction, NestedTensor, Reduce};
use tch::{Device, Kind, Tensor};

/// The values every special batch cycles through.
const SPECIALS: [f32; 12] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    -0.0,
    0.0,
    1e30,
    -1e30,
    100.0,
    -100.0,
    88.8,
    -104.0,
    1e-40,
];

/// [`SPECIALS`] without the magnitudes whose squares overflow f32: where a variance
/// overflows, libtorch's own norms give NaN or not depending on the row's width (its
/// summation scheme), so there is no one answer to match.
const MODERATE: [f32; 10] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    -0.0,
    0.0,
    100.0,
    -100.0,
    88.8,
    -104.0,
    1e-40,
];

/// Elements `[L_i, 4]` of random values with a value of `specials` at every `stride`-th
/// position from `shift`: some rows hold one or more specials, others none.
fn special_batch(
    specials: &[f32],
    lengths: &[i64],
    shift: usize,
    stride: usize,
    seed: i64,
) -> NestedTensor {
    tch::manual_seed(seed);
    let total: i64 = lengths.iter().sum::<i64>() * 4;
    let mut values =
        Vec::<f32>::try_from(Tensor::randn([total], (Kind::Float, Device::Cpu))).unwrap();
    for (count, index) in (shift..values.len()).step_by(stride).enumerate() {
        values[index] = specials[count % specials.len()];
    }
    let packed = Tensor::from_slice(&values).reshape([-1, 4]);
    NestedTensor::from_tensors(&packed.split_with_sizes(lengths, 0)).unwrap()
}

const LENGTHS: [i64; 6] = [3, 1, 0, 7, 2, 5];

/// Compiles `model` and checks it against eager on batches with [`SPECIALS`] (`x`, and
/// `y` with its specials elsewhere).
fn check(
    name: &str,
    tolerance: f64,
    model: impl Fn(&NestedTensor, &NestedTensor) -> nestor::Result<Vec<Out>>,
) {
    check_with(&SPECIALS, name, tolerance, model)
}

/// [`check`] with other special values.
fn check_with(
    specials: &[f32],
    name: &str,
    tolerance: f64,
    model: impl Fn(&NestedTensor, &NestedTensor) -> nestor::Result<Vec<Out>>,
) {
    let compiled = compile(name, |x: &[NestedTensor], _: &[Dense]| model(&x[0], &x[1]));
    for (stride, seed) in [(3, 1), (5, 2), (2, 3)] {
        let x = special_batch(specials, &LENGTHS, 0, stride, seed);
        let y = special_batch(specials, &LENGTHS, 1, stride + 1, seed + 10);
        let got = compiled
            .call(&[&x, &y], &[])
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        let want = eager_values(model(&x, &y).unwrap());
        assert_close_within(&got, &want, tolerance, &format!("{name}, stride {stride}"));
    }
}

/// The eager method of each IR unary op (a new op fails to build here until added).
fn unary(op: UnaryOp, x: &NestedTensor) -> nestor::Result<NestedTensor> {
    match op {
        UnaryOp::Neg => x.neg(),
        UnaryOp::Abs => x.abs(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.log(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => x.rsqrt(),
        UnaryOp::Square => x.square(),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => x.sigmoid(),
        UnaryOp::Relu => x.relu(),
        UnaryOp::Gelu => x.gelu("none"),
        UnaryOp::GeluTanh => x.gelu("tanh"),
        UnaryOp::Silu => x.silu(),
        UnaryOp::Erf => x.erf(),
        UnaryOp::Sign => x.sign(),
        UnaryOp::Not => x.logical_not(),
        UnaryOp::Expm1 => x.expm1(),
        UnaryOp::Log1p => x.log1p(),
        UnaryOp::Reciprocal => x.reciprocal(),
        UnaryOp::Floor => x.floor(),
        UnaryOp::Ceil => x.ceil(),
        UnaryOp::Round => x.round(),
    }
}

/// The eager reduction of each IR reduction (`None`: those that pick one position),
/// and whether the compiler lowers it.
fn reduction(op: ReduceOp) -> (Option<Reduce>, bool) {
    let (reduce, lowered) = match op {
        ReduceOp::Sum => (Reduce::Sum, true),
        ReduceOp::Mean => (Reduce::Mean, true),
        ReduceOp::Amax => (Reduce::Amax, true),
        ReduceOp::Amin => (Reduce::Amin, true),
        ReduceOp::LogSumExp => (Reduce::LogSumExp, true),
        ReduceOp::Var => (Reduce::Var { correction: 1 }, true),
        ReduceOp::Std => (Reduce::Std { correction: 1 }, true),
        ReduceOp::All => (Reduce::All, false),
        ReduceOp::Any => (Reduce::Any, false),
        ReduceOp::Argmax | ReduceOp::Argmin | ReduceOp::Max | ReduceOp::Min => return (None, true),
    };
    (Some(reduce), lowered)
}

/// `op` of `x` over `dim`, eagerly (traced when tracing).
fn reduced(op: ReduceOp, x: &NestedTensor, dim: i64) -> nestor::Result<nestor::Reduced> {
    match reduction(op).0 {
        Some(reduce) => x.reduce(reduce, &[dim], false),
        None => match op {
            ReduceOp::Argmax => x.argmax(dim, false),
            ReduceOp::Argmin => x.argmin(dim, false),
            ReduceOp::Max => Ok(x.max_dim(dim, false)?.0),
            _ => Ok(x.min_dim(dim, false)?.0),
        },
    }
}

/// The table of the issue that found these bugs, exactly.
#[test]
fn relu_tanh_and_softmax_keep_nan_and_infinities() {
    let row = |values: [f32; 4]| Tensor::from_slice(&values).reshape([1, 4]);
    let batch = NestedTensor::from_tensors(&[
        row([f32::NAN, 1.0, -2.0, 0.5]),
        row([3.0, f32::INFINITY, -1.0, 0.0]),
        row([f32::NEG_INFINITY, 1.0, 2.0, -0.0]),
    ])
    .unwrap();
    let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<NestedTensor>> {
        Ok(vec![x[0].relu()?, x[0].tanh()?, x[0].softmax(-1)?])
    };
    let got = compile("table", model).call(&[&batch], &[]).unwrap();
    let got: Vec<Vec<f32>> = got
        .into_iter()
        .map(|value| Vec::try_from(value.into_nested().unwrap().values().reshape([-1])).unwrap())
        .collect();
    let nan = f32::NAN;
    // The last row's softmax: e^-inf is 0, the other three share the mass.
    let finite = Tensor::from_slice(&[1.0f32, 2.0, 0.0]).softmax(0, Kind::Float);
    let finite = Vec::<f32>::try_from(finite).unwrap();
    let expected: [Vec<f32>; 3] = [
        vec![
            nan,
            1.0,
            0.0,
            0.5,
            3.0,
            f32::INFINITY,
            0.0,
            0.0,
            0.0,
            1.0,
            2.0,
            -0.0,
        ],
        vec![
            nan,
            1f32.tanh(),
            (-2f32).tanh(),
            0.5f32.tanh(),
            3f32.tanh(),
            1.0,
            (-1f32).tanh(),
            0.0,
            -1.0,
            1f32.tanh(),
            2f32.tanh(),
            -0.0,
        ],
        vec![
            nan, nan, nan, nan, nan, nan, nan, nan, 0.0, finite[0], finite[1], finite[2],
        ],
    ];
    for (index, (got, expected)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(got.len(), expected.len(), "output {index}");
        for (position, (&g, &e)) in got.iter().zip(expected).enumerate() {
            let same = (g.is_nan() && e.is_nan())
                || (g == e && g.is_sign_negative() == e.is_sign_negative())
                || (index > 0 && (g - e).abs() < 1e-6);
            assert!(same, "output {index}, position {position}: {g} vs {e}");
        }
    }
}

#[test]
fn every_unary_op_matches_eager_on_special_values() {
    check("unary", 2e-6, |x, _| {
        UnaryOp::ALL
            .iter()
            .map(|&op| Ok(unary(op, x)?.into()))
            .collect()
    });
}

/// [`MODERATE`] without its subnormal (its last value): where `x / y` overflows (100
/// over 1e-40) libtorch's `remainder` gives NaN in its vectorized loop and the exact
/// remainder in its scalar tail, by position, so there is no one answer to match.
const NO_OVERFLOWING_QUOTIENTS: &[f32] = MODERATE.split_last().unwrap().1;

#[test]
fn every_binary_op_matches_eager_on_special_values() {
    let binary = |ops: Vec<BinaryOp>| {
        move |x: &NestedTensor, y: &NestedTensor| -> nestor::Result<Vec<Out>> {
            ops.iter()
                .flat_map(|&op| {
                    let op = Binary::from_ir(op);
                    [
                        x.binary(op, y),
                        x.binary(op, 0.5),
                        x.binary(op, f64::NEG_INFINITY),
                    ]
                })
                .map(|result| Ok(result?.into()))
                .collect()
        }
    };
    let (remainder, others): (Vec<BinaryOp>, Vec<BinaryOp>) = BinaryOp::ALL
        .iter()
        .partition(|&&op| op == BinaryOp::Remainder);
    check("binary", 2e-6, binary(others));
    check_with(
        NO_OVERFLOWING_QUOTIENTS,
        "remainder",
        2e-6,
        binary(remainder),
    );
}

#[test]
fn where_and_masks_match_eager_on_special_values() {
    check("where", 0.0, |x, y| {
        Ok(vec![
            x.where_self(&y.gt(0.0)?, f64::NAN)?.into(),
            x.where_self(&y.ne(0.0)?, -0.0)?.into(),
        ])
    });
}

#[test]
fn softmax_matches_eager_on_special_values() {
    check("softmax", 1e-6, |x, _| {
        Ok(vec![
            x.softmax(-1)?.into(),
            x.log_softmax(-1)?.into(),
            x.softmax(1)?.into(),
            x.log_softmax(1)?.into(),
        ])
    });
}

#[test]
fn lowered_reductions_match_eager_on_special_values() {
    for &op in ReduceOp::ALL {
        let lowered = reduction(op).1;
        for dim in [-1, 1] {
            let name = format!("{}, dim {dim}", op.word());
            let model = move |x: &[NestedTensor], _: &[Dense]| reduced(op, &x[0], dim);
            if !lowered {
                let x = special_batch(&SPECIALS, &LENGTHS, 0, 3, 1);
                let error = compile(&name, model).call(&[&x], &[]);
                let error = error
                    .err()
                    .unwrap_or_else(|| panic!("{name} is lowered now: check it here"));
                assert!(error.to_string().contains(op.word()), "{name}: {error}");
                continue;
            }
            // Empty elements have no maximum (eager fails): amax/amin and argmax/argmin
            // over the ragged dim run on non-empty elements only.
            let extreme = [
                ReduceOp::Amax,
                ReduceOp::Amin,
                ReduceOp::Argmax,
                ReduceOp::Argmin,
                ReduceOp::Max,
                ReduceOp::Min,
            ];
            if dim == 1 && extreme.contains(&op) {
                let compiled = compile(&name, model);
                let x = special_batch(&SPECIALS, &[3, 1, 7, 2], 0, 3, 1);
                let got = compiled.call(&[&x], &[]).unwrap();
                let want = eager_values(vec![model(&[x], &[]).unwrap().into()]);
                assert_close_within(&got, &want, 0.0, &name);
                continue;
            }
            check(&name, 1e-6, move |x, _| {
                Ok(vec![reduced(op, x, dim)?.into()])
            });
        }
    }
}

#[test]
fn norms_and_gemms_match_eager_on_special_values() {
    tch::manual_seed(5);
    let options = (Kind::Float, Device::Cpu);
    let (weight, bias, gain) = (
        Tensor::randn([6, 4], options),
        Tensor::randn([6], options),
        Tensor::randn([4], options),
    );
    check_with(&MODERATE, "norms", 1e-5, |x, _| {
        Ok(vec![
            x.layer_norm(&[4], Some(&gain), Some(&bias.narrow(0, 0, 4)), 1e-5)?
                .into(),
            x.rms_norm(&[4], Some(&gain), Some(1e-6))?.into(),
            // Batch norm by running statistics, and by the batch's (NaN where a
            // channel holds NaN or infinities of both signs).
            x.batch_norm(
                -1,
                Some(&gain),
                Some(&gain.abs()),
                None,
                Some(&gain),
                false,
                0.1,
                1e-5,
            )?
            .into(),
            x.batch_norm(-1, None, None, Some(&gain), None, true, 0.1, 1e-5)?
                .into(),
        ])
    });
    check("gemms", 1e-5, |x, _| {
        Ok(vec![
            x.linear(&weight, Some(&bias))?.into(),
            x.linear(&weight, Some(&bias))?.relu()?.into(),
            x.matmul(&weight.transpose(0, 1))?.into(),
        ])
    });
}

#[test]
fn attention_matches_eager_on_special_values() {
    check("attention", 1e-5, |x, y| {
        let heads = |t: &NestedTensor| t.reshape_tail(&[2, 2]);
        let (q, k) = (heads(x)?, heads(y)?);
        Ok(vec![
            q.scaled_dot_product_attention(&k, &k, false, None)?.into(),
            q.scaled_dot_product_attention(&k, &q, true, Some(0.7))?
                .into(),
        ])
    });
}

#[test]
fn losses_and_embeddings_match_eager_on_special_values() {
    // Six rows of specials for the ids 0..4.
    let table = Tensor::from_slice(&SPECIALS).repeat([2]).reshape([6, 4]);
    let model = |x: &[NestedTensor], _: &[Dense]| -> nestor::Result<Vec<Out>> {
        Ok(vec![
            x[0].cross_entropy(&x[1], -100, 0.0, LossReduction::None)?
                .into(),
            x[0].cross_entropy(&x[1], 2, 0.1, LossReduction::Mean)?
                .into(),
            x[0].mse_loss(&x[0].tanh()?, LossReduction::Sum)?.into(),
            x[1].embedding(&table, -1)?.into(),
        ])
    };
    let compiled = compile("losses", model);
    for (stride, seed) in [(3, 1), (5, 2), (2, 3)] {
        let x = special_batch(&SPECIALS, &LENGTHS, 0, stride, seed);
        let classes = common::families::ids(&LENGTHS, seed)
            .binary(Binary::Remainder, 4)
            .unwrap();
        let got = compiled.call(&[&x, &classes], &[]).unwrap();
        let want = eager_values(model(&[x, classes], &[]).unwrap());
        assert_close_within(&got, &want, 1e-5, &format!("losses, stride {stride}"));
    }
}

/// `max_dim` / `min_dim` (and `argmax` / `argmin`) along a ragged or a static dim give,
/// element by element, what libtorch gives on the element: NaN is the extreme wherever a
/// slice holds one, at the position of its first NaN.
#[test]
fn extremes_with_indices_follow_libtorch_on_special_values() {
    for (shift, stride) in [(0, 5), (2, 7), (1, 3)] {
        let batch = special_batch(&SPECIALS, &[4, 1, 6, 3], shift, stride, 31);
        let elements = batch.unbind().unwrap();
        for largest in [true, false] {
            for dim in [1i64, 2] {
                let (values, indices) = if largest {
                    batch.max_dim(dim, true).unwrap()
                } else {
                    batch.min_dim(dim, true).unwrap()
                };
                // Per element: a ragged dim reduced leaves a dense `[B, 1, 4]`.
                let per_element = |reduced: nestor::Reduced| match reduced {
                    nestor::Reduced::Nested(nested) => nested.unbind().unwrap(),
                    nestor::Reduced::Dense(dense) => dense.tensor().unbind(0),
                };
                let (values, indices) = (per_element(values), per_element(indices));
                for (index, element) in elements.iter().enumerate() {
                    let (expected, positions) = if largest {
                        element.max_dim(dim - 1, true)
                    } else {
                        element.min_dim(dim - 1, true)
                    };
                    let what =
                        format!("largest {largest}, dim {dim}, element {index}, shift {shift}");
                    assert!(
                        values[index].allclose(&expected, 0.0, 0.0, true),
                        "{what}: {} vs {}",
                        values[index],
                        expected
                    );
                    assert!(
                        indices[index].equal(&positions),
                        "{what}: {} vs {}",
                        indices[index],
                        positions
                    );
                }
            }
        }
    }
}

/// cummax / cummin down the ragged dim and along the last one: compiled values and
/// positions equal libtorch's on every element (a NaN, once seen, stays; an equal value
/// takes the running one's place).
#[test]
fn running_extremes_follow_libtorch_on_special_values() {
    check("running extremes", 0.0, |x, _| {
        let (largest, seen) = x.cummax(1)?;
        let (smallest, at) = x.cummin(-1)?;
        Ok(vec![
            largest.into(),
            seen.into(),
            smallest.into(),
            at.into(),
        ])
    });
}
