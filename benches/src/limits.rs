//! The machine's limits, measured at the start of a report: the best GEMM throughput
//! libtorch or nestor compiled reaches, the memory bandwidth (a stream copy), and every GEMM shape of the
//! Transformer models run by libtorch's `linear` and by nestor compiled on the same
//! packed rows, so that a compiled cell can be read as a share of what the machine does.

use nestor::{compile, Dense, NestedTensor};
use tch::{Device, Kind, Tensor};

use crate::lengths::lengths;
use crate::measure::{time, time_in_turns, Timing};
use crate::models::{compiled_step, Tokens};
use crate::{Result, Scale, OCCUPANCIES};

/// What the machine does at best, and the models' GEMMs.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// The side of the square f32 product that measures the GEMM peak ...
    pub peak_side: i64,
    /// ... libtorch's matmul of it in GFLOP/s (its median run) ...
    pub libtorch_gflops: f64,
    /// ... nestor compiled's `linear` (with a bias) of it, on a batch of four elements ...
    pub compiled_gflops: f64,
    /// ... and the best of the two and of every row of `gemms`: the machine's GEMM peak.
    pub peak_gflops: f64,
    /// The same square in bf16: libtorch's matmul of bf16 matrices ...
    pub bf16_libtorch_gflops: f64,
    /// ... nestor compiled's `linear` under `autocast(Kind::BFloat16)` ...
    pub bf16_compiled_gflops: f64,
    /// ... and the better of the two: the machine's bf16 GEMM peak.
    pub bf16_peak_gflops: f64,
    /// Bytes copied of the stream copy ...
    pub copy_bytes: usize,
    /// ... and the bandwidth it reached in GB/s (bytes read plus bytes written, best run).
    pub bandwidth: f64,
    /// The models' GEMM shapes, libtorch against nestor compiled.
    pub gemms: Vec<GemmRow>,
}

/// One GEMM shape `[rows, k] x [k, n]` (plus a bias) of a model at one occupancy.
#[derive(Clone, Debug, PartialEq)]
pub struct GemmRow {
    /// Which GEMM of the model.
    pub what: &'static str,
    /// The packed rows (the lengths' total).
    pub rows: i64,
    /// The inner size.
    pub k: i64,
    /// The output width.
    pub n: i64,
    /// libtorch's `linear` on the packed values.
    pub libtorch: Timing,
    /// nestor compiled `linear` on the same batch.
    pub compiled: Timing,
}

impl GemmRow {
    /// Useful FLOPs of one product.
    pub fn flops(&self) -> f64 {
        2.0 * self.rows as f64 * self.k as f64 * self.n as f64
    }

    /// GFLOP/s of a timing of this product (its median).
    pub fn gflops(&self, timing: &Timing) -> f64 {
        self.flops() / timing.median / 1e9
    }

    /// nestor compiled's throughput as a share of libtorch's (above 1: faster).
    pub fn share(&self) -> f64 {
        self.libtorch.median / self.compiled.median
    }
}

/// Measures the limits of this machine at `scale`.
pub fn measure_limits(scale: &Scale) -> Result<Limits> {
    let _no_grad = tch::no_grad_guard();
    // One untimed pass over the first occupancy's shapes: the process's first compiled
    // GEMMs run slower (the first row measured 0.45x-1.31x libtorch in three runs where
    // a second pass in the same process measured 1.9-2.0x; measured first, the square
    // product below reached 290 GFLOP/s where the models' GEMMs reached 430).
    let first = lengths(scale.batch, scale.max_length, OCCUPANCIES[0], 100);
    for (what, k, n) in model_gemms(scale) {
        gemm_row(scale, &first, (what, k, n), false)?;
    }
    let (peak_side, libtorch_gflops) = peak_gemm(scale, Kind::Float)?;
    let square = vec![peak_side / 4; 4];
    let square_shape = ("square", peak_side, peak_side);
    let square_row = gemm_row(scale, &square, square_shape, false)?;
    let compiled_gflops = square_row.gflops(&square_row.compiled);
    let (_, bf16_libtorch_gflops) = peak_gemm(scale, Kind::BFloat16)?;
    let bf16_row = gemm_row(scale, &square, square_shape, true)?;
    let bf16_compiled_gflops = bf16_row.gflops(&bf16_row.compiled);
    let (copy_bytes, bandwidth) = stream_copy(scale)?;
    let mut gemms = Vec::new();
    for (index, &occupancy) in OCCUPANCIES.iter().enumerate() {
        // The lengths the models' cells use at this occupancy (same seeds).
        let lengths = lengths(scale.batch, scale.max_length, occupancy, 100 + index as u64);
        for (what, k, n) in model_gemms(scale) {
            gemms.push(gemm_row(scale, &lengths, (what, k, n), false)?);
        }
    }
    // The best any measured product reached.
    let peak_gflops = gemms
        .iter()
        .flat_map(|row| [row.gflops(&row.libtorch), row.gflops(&row.compiled)])
        .fold(libtorch_gflops.max(compiled_gflops), f64::max);
    Ok(Limits {
        peak_side,
        libtorch_gflops,
        compiled_gflops,
        peak_gflops,
        bf16_libtorch_gflops,
        bf16_compiled_gflops,
        bf16_peak_gflops: bf16_libtorch_gflops.max(bf16_compiled_gflops),
        copy_bytes,
        bandwidth,
        gemms,
    })
}

/// The distinct GEMMs of a Transformer layer at `scale`: (name, k, n).
fn model_gemms(scale: &Scale) -> [(&'static str, i64, i64); 4] {
    let (d, ff) = (scale.d_model, scale.feedforward);
    [
        ("attention in-projection", d, 3 * d),
        ("attention out-projection", d, d),
        ("feed-forward up", d, ff),
        ("feed-forward down", ff, d),
    ]
}

/// libtorch's best throughput on a square product of `kind` (side 1024, or 256 at smoke
/// scale).
fn peak_gemm(scale: &Scale, kind: Kind) -> Result<(i64, f64)> {
    let side = if scale.samples < 3 { 256 } else { 1024 };
    let options = (kind, Device::Cpu);
    let (a, b) = (
        Tensor::f_randn([side, side], options)?,
        Tensor::f_randn([side, side], options)?,
    );
    let timing = time(scale.samples, || {
        drop(a.f_matmul(&b)?);
        Ok(())
    })?;
    Ok((side, 2.0 * (side as f64).powi(3) / timing.median / 1e9))
}

/// A copy of 256 MiB (16 MiB at smoke scale) between two buffers: bytes read plus
/// bytes written over the best time.
fn stream_copy(scale: &Scale) -> Result<(usize, f64)> {
    let bytes: usize = if scale.samples < 3 {
        16 << 20
    } else {
        256 << 20
    };
    let from = vec![1u8; bytes];
    let mut to = vec![0u8; bytes];
    let mut best = f64::INFINITY;
    for _ in 0..scale.samples.max(1) + 1 {
        let started = std::time::Instant::now();
        to.copy_from_slice(std::hint::black_box(&from));
        std::hint::black_box(&mut to);
        best = best.min(started.elapsed().as_secs_f64());
    }
    Ok((bytes, 2.0 * bytes as f64 / best / 1e9))
}

/// `[total, k] x [k, n] + bias` on tokens of `lengths`: libtorch's `linear` on the
/// packed values, and the compiled nested `linear` (checked to give the same values);
/// `mixed`: libtorch's on bf16 values and weights, the compiled one on the f32 ones
/// under `autocast(Kind::BFloat16)` (the same within bf16's rounding).
fn gemm_row(
    scale: &Scale,
    lengths: &[i64],
    (what, k, n): (&'static str, i64, i64),
    mixed: bool,
) -> Result<GemmRow> {
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let tokens = Tokens::new(lengths.to_vec(), k, longest.max(scale.max_length))?;
    let options = (Kind::Float, Device::Cpu);
    let weight = Tensor::f_randn([n, k], options)?.f_mul_scalar(0.05)?;
    let bias = Tensor::f_randn([n], options)?;
    let libtorch_kind = if mixed { Kind::BFloat16 } else { Kind::Float };
    let (values, libtorch_weight, libtorch_bias) = (
        tokens.nested.values().f_to_kind(libtorch_kind)?,
        weight.f_to_kind(libtorch_kind)?,
        bias.f_to_kind(libtorch_kind)?,
    );
    let function = compile("linear", |inputs: &[NestedTensor], _: &[Dense]| {
        inputs[0].linear(&weight, Some(&bias))
    })
    .autocast(libtorch_kind);
    let (mut step, _) = compiled_step(function, vec![&tokens.nested], |output| {
        Ok(output.values().shallow_clone())
    });
    // Timed in turns, as the model cells are: timed one after the other, the first row
    // showed compiled at 0.69x (Xeon) and 0.88x (EPYC) where the later rows were near 1x.
    let mut timings = time_in_turns(
        scale.samples,
        &mut [
            &mut || {
                drop(values.f_linear(&libtorch_weight, Some(&libtorch_bias))?);
                Ok(())
            },
            &mut || step().map(drop),
        ],
    )?
    .into_iter();
    let (Some(libtorch), Some(compiled)) = (timings.next(), timings.next()) else {
        return Err("timing two steps gave fewer than two timings".into());
    };
    // Both compute the same product (or the comparison means nothing).
    let (expected, actual) = (
        values
            .f_linear(&libtorch_weight, Some(&libtorch_bias))?
            .f_to_kind(Kind::Float)?,
        step()?,
    );
    let error = expected.f_sub(&actual)?.f_abs()?.f_max()?.double_value(&[]);
    let size = expected.f_abs()?.f_max()?.double_value(&[]);
    // A NaN error fails too.
    let tolerance = if mixed { 3e-2 } else { 1e-4 };
    let close = error <= tolerance * (1.0 + size);
    if !close {
        return Err(format!(
            "{what}: compiled differs from libtorch by {error} (largest value {size})"
        )
        .into());
    }
    Ok(GemmRow {
        what,
        rows: lengths.iter().sum(),
        k,
        n,
        libtorch,
        compiled,
    })
}
