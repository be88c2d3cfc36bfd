//! One model per lowered kernel family, for the compiled-vs-eager tests.

use nestor::{Binary, Dense, NestedTensor, Reduce};
use tch::{Kind, Tensor};

use super::{Out, Random};

pub type Model = Box<dyn Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Vec<Out>>>;

/// One model per lowered family, with parameters of `kind`.
pub fn families(kind: Kind) -> Vec<(&'static str, Model)> {
    families_rounded(kind, kind)
}

/// [`families`] with parameters of `kind` holding values of `rounded` (drawn in f64,
/// rounded to `rounded`, then converted): an f32 model with a bf16 model's parameters
/// is its reference.
pub fn families_rounded(kind: Kind, rounded: Kind) -> Vec<(&'static str, Model)> {
    let mut random = Random::new(0);
    let mut parameter = |shape: &[i64]| random.normal(shape).to_kind(rounded).to_kind(kind);
    let (w, b, g, tail, table) = (
        parameter(&[6, 4]),
        parameter(&[6]),
        parameter(&[4]),
        parameter(&[4]),
        parameter(&[5, 3]),
    );
    let (w2, g2) = (w.shallow_clone(), g.shallow_clone());
    vec![
        (
            "elementwise",
            Box::new(move |x: &[NestedTensor], _: &[Dense]| {
                let y = (&(&x[0] * 2.0)? - &tail)?.gelu("none")?;
                Ok(vec![
                    y.tanh()?.into(),
                    x[0].relu()?.maximum(&x[0].sigmoid()?)?.into(),
                    x[0].gt(0.1)?.into(),
                    x[0].where_self(&x[0].lt(0.0)?, 0.5)?.into(),
                    x[0].sign()?.into(),
                    x[0].expm1()?.into(),
                    x[0].leaky_relu(0.1)?.into(),
                    (&x[0] * 8.0)?.mish()?.into(),
                    x[0].gt(0.2)?.logical_xor(&x[0].lt(-0.1)?)?.into(),
                    x[0].clamp(Some(-0.5), Some(0.5))?.into(),
                    x[0].clamp(None, Some(0.2))?.into(),
                    x[0].elu(0.7)?.into(),
                    (&x[0] * 30.0)?.softplus(0.5, 5.0)?.into(),
                    x[0].abs()?.log1p()?.into(),
                    (&x[0].abs()? + 0.5)?.reciprocal()?.into(),
                    // Roundings of the inputs themselves: bf16 storage of an
                    // intermediate may cross an integer.
                    x[0].floor()?.into(),
                    x[0].ceil()?.into(),
                    x[0].round()?.into(),
                ])
            }),
        ),
        (
            "linear_norm",
            Box::new(move |x: &[NestedTensor], _: &[Dense]| {
                let hidden = x[0].linear(&w, Some(&b))?;
                Ok(vec![
                    hidden.layer_norm(&[6], None, None, 1e-5)?.into(),
                    x[0].rms_norm(&[4], Some(&g), Some(1e-6))?.into(),
                    x[0].matmul(&w2.transpose(0, 1))?.into(),
                    // A GEMM with an epilogue.
                    x[0].linear(&w2, None)?.gelu("none")?.into(),
                ])
            }),
        ),
        (
            "softmax",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![
                    x[0].softmax(-1)?.into(),
                    x[0].log_softmax(1)?.into(),
                    x[0].softmax(1)?.into(),
                ])
            }),
        ),
        (
            "reduce",
            Box::new(move |x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![
                    x[0].sum(&[1], false)?.into(),
                    x[0].mean(&[1], false)?.into(),
                    x[0].mean(&[-1], false)?.into(),
                    x[0].amax(&[2], true)?.into(),
                    x[0].layer_norm(&[4], Some(&g2), None, 1e-5)?.into(),
                    // Over the batch and ragged dims (a column sum).
                    x[0].sum(&[0, 1], false)?.into(),
                    // Over the ragged and static dims together.
                    x[0].mean(&[1, 2], true)?.into(),
                    x[0].sum(&[-1, 1], false)?.into(),
                    // logsumexp over the ragged dim (-inf for an empty element), the
                    // last dim, and both.
                    x[0].reduce(Reduce::LogSumExp, &[1], false)?.into(),
                    x[0].reduce(Reduce::LogSumExp, &[-1], true)?.into(),
                    x[0].reduce(Reduce::LogSumExp, &[1, 2], false)?.into(),
                    // Scans along the tail (the last dim, static).
                    x[0].cumsum(2)?.into(),
                    (&x[0] * 0.5)?.cumprod(-1)?.into(),
                    // The last two static dims swapped.
                    x[0].reshape_tail(&[2, 2])?.transpose(2, 3)?.into(),
                    x[0].reshape_tail(&[1, 2, 2])?.transpose(-1, -2)?.into(),
                    x[0].reshape_tail(&[2, 2])?.permute(&[0, 1, 3, 2])?.into(),
                    // Static reshapes: flatten and squeeze.
                    x[0].reshape_tail(&[2, 2])?.flatten(2, 3)?.into(),
                    x[0].unsqueeze(2)?.squeeze_dim(2)?.into(),
                    // Per-element operands `[B, 1, 4]` broadcast over each element's rows.
                    x[0].binary(Binary::Sub, &x[0].mean(&[1], true)?.into_dense_handle()?)?
                        .into(),
                    x[0].binary(Binary::Mul, &x[0].sum(&[1], true)?.into_dense_handle()?)?
                        .into(),
                ])
            }),
        ),
        (
            "positions",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![
                    // argmax / argmin along the last dim (i64 positions), of the values
                    // and of rows with ties (relu's zeros: the first wins).
                    x[0].argmax(-1, false)?.into(),
                    x[0].argmin(2, true)?.into(),
                    x[0].relu()?.argmax(-1, true)?.into(),
                    x[0].reshape_tail(&[2, 2])?.argmin(-1, false)?.into(),
                    x[0].max_dim(-1, false)?.0.into(),
                    x[0].relu()?.min_dim(2, true)?.1.into(),
                    x[0].kthvalue(2, -1, false)?.0.into(),
                    x[0].relu()?.kthvalue(3, -1, true)?.1.into(),
                    // The top values along the last dim (relu's ties: the first first).
                    x[0].topk(2, -1, true)?.0.into(),
                    x[0].relu()?.topk(3, 2, false)?.1.into(),
                    // Casts to i64 (toward zero; a scaling by 4 is exact in every
                    // float kind), and of truth values.
                    (&x[0] * 4.0)?.to_kind(Kind::Int64)?.into(),
                    x[0].gt(0.5)?.to_kind(Kind::Int64)?.into(),
                ])
            }),
        ),
        (
            "sorts",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                // Sorted down the ragged dim (stable), both orders, values and positions,
                // of the values and of rows with ties (relu's zeros).
                let (ascending, from) = x[0].sort(1, false)?;
                let (descending, _) = x[0].relu()?.sort(1, true)?;
                // And along the last dim.
                let (along, columns) = x[0].relu()?.sort(-1, false)?;
                // Running extremes (relu's ties: the latest equal value takes the place).
                let (largest, seen) = x[0].relu()?.cummax(1)?;
                let (smallest, at) = x[0].cummin(-1)?;
                Ok(vec![
                    ascending.into(),
                    from.into(),
                    descending.into(),
                    x[0].relu()?.argsort(1, true)?.into(),
                    along.into(),
                    columns.into(),
                    x[0].argsort(2, true)?.into(),
                    largest.into(),
                    seen.into(),
                    smallest.into(),
                    at.into(),
                ])
            }),
        ),
        (
            "embedding",
            Box::new(move |x: &[NestedTensor], _: &[Dense]| {
                Ok(vec![x[1].embedding(&table, -1)?.relu()?.into()])
            }),
        ),
        (
            "cdist",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                // Points against themselves (zero distances) and against others of the
                // same lengths, every kind of norm (p = 0 counts differing coordinates,
                // which bf16 storage of the others would change: against themselves).
                let other = x[0].tanh()?;
                let mut outputs = vec![x[0].cdist(&x[0], 0.0)?.into()];
                for p in [2.0, 1.0, f64::INFINITY, 3.0] {
                    outputs.push(x[0].cdist(&x[0], p)?.into());
                    outputs.push(x[0].cdist(&other, p)?.into());
                }
                Ok(outputs)
            }),
        ),
        (
            "attention",
            Box::new(|x: &[NestedTensor], _: &[Dense]| {
                let heads = x[0].reshape_tail(&[2, 2])?;
                let qkv = x[0].reshape_tail(&[1, 2, 2])?.select_static(2, 0)?;
                Ok(vec![
                    heads
                        .scaled_dot_product_attention(&heads, &heads, false, None)?
                        .into(),
                    qkv.scaled_dot_product_attention(&heads, &heads, true, Some(0.7))?
                        .reshape_tail(&[4])?
                        .into(),
                ])
            }),
        ),
    ]
}

pub fn ids(lengths: &[i64], seed: i64) -> NestedTensor {
    let mut random = Random::new(seed);
    let elements: Vec<Tensor> = lengths.iter().map(|&l| random.below(5, &[l])).collect();
    super::ragged_batch(&elements, &[], Kind::Int64)
}
