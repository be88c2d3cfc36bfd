//! The GPU check (`scripts/gpu-check.sh run` on a GPU machine; no Rust or libtorch
//! needed there, only libcuda, libcublas on the library path (the runs with BLAS GEMMs
//! fail without it) and libdevice through `NESTOR_LIBDEVICE`):
//!
//! - with `--cases DIR`, every kernel case written by `nestor-backend-cuda`'s
//!   `tests/gpu_check.rs` (one kernel template each, its PTX, buffers and the CPU
//!   backend's output) runs on the GPU and is compared;
//! - whole programs (an optimized Transformer encoder layer, a feed-forward block, a graph
//!   of gathers, padding and segmented kernels, attention written over jagged pairs, and
//!   the training steps of a pooled classifier, of causal attention, of the pair
//!   attention, of a strided conv net and of a loss over scans, logsumexp, cdist and
//!   repeated batches, with their gradients) are lowered here, run on the device
//!   (`--device cuda`: the GPU, PTX made on the spot; `--device sim`: the same kernels
//!   on the simulated GPU, `nestor-sim`, the self-test of `make test`) and on the CPU runtime for several sets of
//!   lengths, with f32 and bf16 buffers, GEMM products on the BLAS (cuBLAS; on the host
//!   the same column-major calls) and in GEMM kernels, and compared.
//!
//! ```sh
//! gpu-check --device cuda --cases gpu-check/cases OUT_DIR
//! ```
//!
//! On a GPU it also times the encoder layer at three occupancies, attention's achieved
//! TFLOP/s and a pointwise kernel's bandwidth ([`run_benchmarks`]).
//!
//! Writes `OUT_DIR/gpu-check.txt`; exit status 0 when everything matches, 1 when
//! something differs or fails, 2 when the device cannot be opened.

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use nestor_backend_cpu::Storage;
use nestor_backend_cuda::CudaDevice;
use nestor_ir::{DType, Dim, ElemDim, Graph, Op, Type};
use nestor_runtime::{
    round_to_bf16, Executable, Gemms, InputData, KernelDevice, RunData, RunOutput, RuntimeError,
    Stats,
};

/// Name, text, whether to run its training step (the loss, its first output, and every
/// parameter's gradient) rather than the graph itself, and the bf16 buffers' tolerance
/// ([`compare`]).
const PROGRAMS: [(&str, &str, bool, f64); 14] = [
    (
        "encoder_layer",
        include_str!("../../../tests/filetests/encoder_layer.optimized.nir"),
        false,
        BF16_TOLERANCE,
    ),
    (
        "ffn",
        include_str!("../../../tests/filetests/ffn.nir"),
        false,
        BF16_TOLERANCE,
    ),
    (
        "device_mix",
        include_str!("../../../tests/filetests/device_mix.nir"),
        false,
        BF16_TOLERANCE,
    ),
    (
        "pooled_loss (training)",
        include_str!("../../../tests/filetests/pooled_loss.nir"),
        true,
        BF16_TOLERANCE,
    ),
    (
        "attention_loss (training)",
        include_str!("../../../tests/filetests/attention_loss.nir"),
        true,
        BF16_TOLERANCE,
    ),
    (
        "pair_attention",
        include_str!("../../../tests/filetests/pair_attention.nir"),
        false,
        BF16_TOLERANCE,
    ),
    (
        "pair_attention_loss (training)",
        include_str!("../../../tests/filetests/pair_attention_loss.nir"),
        true,
        BF16_TOLERANCE,
    ),
    (
        "conv_net",
        include_str!("../../../tests/filetests/conv_net.nir"),
        false,
        BF16_TOLERANCE,
    ),
    (
        "window_grads",
        include_str!("../../../tests/filetests/window_grads.nir"),
        false,
        BF16_TOLERANCE,
    ),
    (
        "conv_net_loss (training)",
        include_str!("../../../tests/filetests/conv_net_loss.nir"),
        true,
        BF16_TOLERANCE,
    ),
    (
        "strided_conv_loss (training)",
        include_str!("../../../tests/filetests/strided_conv_loss.nir"),
        true,
        BF16_TOLERANCE,
    ),
    (
        "coverage_loss (training)",
        include_str!("../../../tests/filetests/coverage_loss.nir"),
        true,
        // Its weight gradient sums terms that nearly cancel (cdist's, the scans'):
        // eager torch's own bf16 gradient of this loss is 4.6e-2 off its f64 one.
        1e-1,
    ),
    (
        "order_loss (training)",
        include_str!("../../../tests/filetests/order_loss.nir"),
        true,
        BF16_TOLERANCE,
    ),
    (
        "grouped_conv_loss (training)",
        include_str!("../../../tests/filetests/grouped_conv_loss.nir"),
        true,
        BF16_TOLERANCE,
    ),
];

/// The bf16 buffers' tolerance of a program whose gradients are well conditioned.
const BF16_TOLERANCE: f64 = 2e-2;

/// Batches with empty and one-row elements, a batch of one, a larger one.
const LENGTHS: [&[i64]; 4] = [&[4, 0, 1, 3], &[1], &[7, 2], &[64, 17, 3, 40, 9, 1, 33, 20]];

/// 16 lengths up to 256 at 20, 35 and 77% occupancy, DanLing's benchmark's (the same in
/// `scripts/gpu-torch-baseline.py`).
const BENCHMARK_LENGTHS: [(&str, [i64; 16]); 3] = [
    (
        "20%",
        [
            256, 20, 45, 31, 60, 12, 70, 41, 28, 55, 47, 15, 52, 36, 30, 21,
        ],
    ),
    (
        "35%",
        [
            256, 40, 117, 61, 98, 23, 135, 77, 52, 110, 89, 30, 125, 70, 64, 87,
        ],
    ),
    (
        "77%",
        [
            256, 180, 240, 199, 220, 150, 256, 210, 175, 230, 205, 160, 245, 190, 198, 40,
        ],
    ),
];

/// Long elements for attention's throughput: 16 heads of 64 columns.
const ATTENTION_LENGTHS: [i64; 4] = [2048, 1536, 1024, 512];

/// Varlen self-attention (16 heads of 64), causal or not.
fn attention_graph(causal: bool) -> String {
    format!(
        r#"graph @attention {{
  %0 = input {{name = "x.lengths"}} : lengths[B]
  %1 = input {{name = "q"}} : ragged<f32>[B; %0, 16, 64]
  %2 = input {{name = "k"}} : ragged<f32>[B; %0, 16, 64]
  %3 = input {{name = "v"}} : ragged<f32>[B; %0, 16, 64]
  %4 = attention(%1, %2, %3) {{causal = {causal}}} : ragged<f32>[B; %0, 16, 64]
  return %4
}}"#
    )
}

/// The floating-point operations of attention over `lengths` (two products of
/// `2 L^2 d` per head; causal: the visible half and the diagonal).
fn attention_flops(lengths: &[i64], causal: bool) -> f64 {
    lengths
        .iter()
        .map(|&length| {
            let pairs = if causal {
                length * (length + 1) / 2
            } else {
                length * length
            };
            4.0 * pairs as f64 * 16.0 * 64.0
        })
        .sum()
}

/// A pointwise kernel over 32 Mi values (8 elements of 4096 rows of 1024): memory
/// bound, its bytes read and written measure the device's bandwidth.
const POINTWISE: &str = r#"graph @pointwise {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 1024]
  %2 = exp(%1) : ragged<f32>[B; %0, 1024]
  return %2
}"#;

/// The H200's dense bf16 tensor-core peak (TFLOP/s), which attention's line is read
/// against.
const H200_BF16_TFLOPS: f64 = 989.0;

/// The H200's memory bandwidth (HBM3e, GB/s), which the pointwise line is read against.
const H200_GBPS: f64 = 4800.0;

/// The optimized encoder layer of the filetests (d_model 8, 2 heads, ff 16) at d_model
/// 256, 4 heads of 64, feed-forward 1024.
fn encoder_layer_256() -> String {
    let replacements = [
        ("[3, 2, 4]", "[3, 4, 64]"),
        ("%0, 3, 2, 4]", "%0, 3, 4, 64]"),
        ("%0, 2, 4]", "%0, 4, 64]"),
        ("f32[24, 8]", "f32[768, 256]"),
        ("f32[24]", "f32[768]"),
        ("%0, 24]", "%0, 768]"),
        ("f32[8, 8]", "f32[256, 256]"),
        ("f32[16, 8]", "f32[1024, 256]"),
        ("f32[8, 16]", "f32[256, 1024]"),
        ("f32[16]", "f32[1024]"),
        ("f32[8]", "f32[256]"),
        ("%0, 16]", "%0, 1024]"),
        ("%0, 8]", "%0, 256]"),
        ("tail = [8]", "tail = [256]"),
    ];
    replacements
        .into_iter()
        .fold(PROGRAMS[0].1.to_owned(), |text, (from, to)| {
            text.replace(from, to)
        })
}

/// Which device the programs run on.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// The simulated GPU (`nestor-sim`).
    Sim,
    Cuda,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((kind, cases, out)) = parse_args(&args) else {
        return usage();
    };
    let mut report = String::new();
    let mut failures = 0;
    if kind == Kind::Cuda {
        match device_report(cases) {
            Ok((lines, failed)) => {
                report.push_str(&lines);
                failures += failed;
            }
            Err(why) => {
                eprintln!("gpu-check: {why}");
                return ExitCode::from(2);
            }
        }
    }
    failures += run_programs(kind, &mut |line: String| {
        println!("{line}");
        report.push_str(&line);
        report.push('\n');
    });
    let summary = if failures == 0 {
        "everything matched\n".to_owned()
    } else {
        format!("{failures} failure(s)\n")
    };
    print!("{summary}");
    report.push_str(&summary);
    let path = Path::new(out).join("gpu-check.txt");
    if let Err(error) = std::fs::create_dir_all(out).and_then(|()| std::fs::write(&path, report)) {
        eprintln!("gpu-check: {}: {error}", path.display());
        return ExitCode::from(2);
    }
    if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// `--device sim|cuda [--cases FILE] OUT` (cases only on CUDA), or `None`.
fn parse_args(args: &[String]) -> Option<(Kind, Option<&String>, &String)> {
    let [flag, kind, rest @ ..] = args else {
        return None;
    };
    let kind = match (flag.as_str(), kind.as_str()) {
        ("--device", "sim") => Kind::Sim,
        ("--device", "cuda") => Kind::Cuda,
        _ => return None,
    };
    match rest {
        [out] => Some((kind, None, out)),
        [flag, cases, out] if flag == "--cases" && kind == Kind::Cuda => {
            Some((kind, Some(cases), out))
        }
        _ => None,
    }
}

/// The device's header line (its name, architecture and whether cuBLAS loaded) and the
/// lines of the cases file, if any, with their failures; an error if the device does
/// not open or the cases cannot be read.
fn device_report(cases: Option<&String>) -> Result<(String, usize), String> {
    let device = nestor_backend_cuda::Device::open(0).map_err(|error| error.to_string())?;
    let mut report = format!(
        "device {} ({}); {}\n",
        device.name(),
        device.arch().name(),
        match nestor_backend_cuda::blas::Blas::new(&device) {
            Ok(_) => "cuBLAS loaded".to_owned(),
            Err(error) => error.to_string(),
        }
    );
    let mut failures = 0;
    if let Some(cases) = cases {
        let (lines, failed) = run_cases(&device, Path::new(cases))?;
        report.push_str(&lines);
        failures += failed;
    }
    Ok((report, failures))
}

/// Runs the encoder layer and every program on `kind`, a line per run to `record`;
/// returns the failures.
fn run_programs(kind: Kind, record: &mut dyn FnMut(String)) -> usize {
    let mut failures = 0;
    if kind == Kind::Cuda {
        failures += run_benchmarks(record);
    }
    // Every program for every batch with f32 buffers and BLAS products (what a GPU runs
    // by default); with GEMM kernels, and with bf16 buffers, for a batch with empty and
    // one-row elements and for the largest one (bf16 with GEMM kernels: the largest).
    let first = LENGTHS[0];
    // The simulated GPU (about 60 ns a thread switch, every dot product of attention's
    // gradients a warp's shuffles) runs the largest batch with f32 buffers and BLAS
    // GEMMs only; the others with `[7, 2]`.
    let largest = if kind == Kind::Cuda {
        LENGTHS[3]
    } else {
        LENGTHS[2]
    };
    let runs = LENGTHS
        .iter()
        .map(|lengths| (*lengths, Storage::Compute, Gemms::Blas))
        .chain([first, largest].map(|lengths| (lengths, Storage::Compute, Gemms::Kernels)))
        .chain([first, largest].map(|lengths| (lengths, Storage::Bf16, Gemms::Blas)))
        .chain([(largest, Storage::Bf16, Gemms::Kernels)]);
    for (lengths, storage, gemms) in runs {
        for (name, text, train, bf16_tolerance) in PROGRAMS {
            let how = how_named(storage, gemms);
            record(
                match check(text, train, lengths, (kind, storage, gemms), bf16_tolerance) {
                    Ok((error, device, cpu_ms)) => format!(
                        "ok   {name} {lengths:?} ({how}): relative error {error:.2e}; \
                     device {:.3} ms (queued in {:.3} ms), CPU runtime {cpu_ms:.3} ms",
                        device.total_ms, device.queued_ms
                    ),
                    Err(why) => {
                        failures += 1;
                        format!("FAIL {name} {lengths:?} ({how}): {why}")
                    }
                },
            );
        }
    }
    failures
}

/// The timed checks of a GPU: the encoder layer at the benchmark's sizes and three
/// occupancies (against padded torch in `scripts/gpu-torch-baseline.py`, same lengths),
/// with f32 and bf16 buffers and BLAS GEMMs (GEMM kernels too at 35%); attention's
/// achieved TFLOP/s on long elements (bf16 buffers: tensor cores); a pointwise kernel's
/// achieved bandwidth. Each is checked against the CPU runtime too. A line per run to
/// `record`; returns the failures.
fn run_benchmarks(record: &mut dyn FnMut(String)) -> usize {
    let mut failures = 0;
    let mut line = |name: String,
                    outcome: Result<(f64, Timing, f64), String>,
                    rate: &dyn Fn(f64) -> String| {
        record(match outcome {
            Ok((error, device, cpu_ms)) => format!(
                "ok   {name}: relative error {error:.2e}; device {:.3} ms (inputs and results \
                 on the device; queued in {:.3} ms){}, CPU runtime {cpu_ms:.3} ms",
                device.total_ms,
                device.queued_ms,
                rate(device.total_ms)
            ),
            Err(why) => {
                failures += 1;
                format!("FAIL {name}: {why}")
            }
        });
    };
    for (occupancy, lengths) in BENCHMARK_LENGTHS {
        for storage in [Storage::Compute, Storage::Bf16] {
            let gemms: &[Gemms] = if occupancy == "35%" {
                &[Gemms::Blas, Gemms::Kernels]
            } else {
                &[Gemms::Blas]
            };
            for &gemms in gemms {
                let how = how_named(storage, gemms);
                let name = format!(
                    "encoder_layer_256 (d_model 256, 4 heads, ff 1024; 16 elements at \
                     {occupancy}; {how})"
                );
                let run = (Kind::Cuda, storage, gemms);
                line(
                    name,
                    check(&encoder_layer_256(), false, &lengths, run, BF16_TOLERANCE),
                    &|_| String::new(),
                );
            }
        }
    }
    for causal in [false, true] {
        for storage in [Storage::Compute, Storage::Bf16] {
            let flops = attention_flops(&ATTENTION_LENGTHS, causal);
            let name = format!(
                "attention (16 heads of 64, lengths {ATTENTION_LENGTHS:?}, causal {causal}; {})",
                how_named(storage, Gemms::Blas)
            );
            let run = (Kind::Cuda, storage, Gemms::Blas);
            let outcome = check(
                &attention_graph(causal),
                false,
                &ATTENTION_LENGTHS,
                run,
                BF16_TOLERANCE,
            );
            line(name, outcome, &|ms| {
                let tflops = flops / (ms * 1e-3) / 1e12;
                format!(
                    "; {tflops:.1} TFLOP/s, {:.1}% of the H200's {H200_BF16_TFLOPS} bf16 peak",
                    100.0 * tflops / H200_BF16_TFLOPS
                )
            });
        }
    }
    for storage in [Storage::Compute, Storage::Bf16] {
        let lengths = [4096i64; 8];
        let values = lengths.iter().sum::<i64>() as f64 * 1024.0;
        let bytes = 2.0 * values * if storage == Storage::Bf16 { 2.0 } else { 4.0 };
        let name = format!(
            "pointwise exp over 32 Mi values ({})",
            how_named(storage, Gemms::Blas)
        );
        let outcome = check(
            POINTWISE,
            false,
            &lengths,
            (Kind::Cuda, storage, Gemms::Blas),
            BF16_TOLERANCE,
        );
        line(name, outcome, &|ms| {
            let gbps = bytes / (ms * 1e-3) / 1e9;
            format!(
                "; {gbps:.0} GB/s, {:.1}% of the H200's {H200_GBPS} GB/s",
                100.0 * gbps / H200_GBPS
            )
        });
    }
    failures
}

/// How a report line names a storage and where GEMM products ran.
fn how_named(storage: Storage, gemms: Gemms) -> String {
    let buffers = match storage {
        Storage::Compute => "f32 buffers",
        Storage::Bf16 => "bf16 buffers",
    };
    let products = match gemms {
        Gemms::Blas => "BLAS GEMMs",
        Gemms::Kernels => "GEMM kernels",
    };
    format!("{buffers}, {products}")
}

fn usage() -> ExitCode {
    eprintln!("usage: gpu-check --device sim|cuda [--cases DIR (cuda)] OUT_DIR");
    ExitCode::from(2)
}

/// Runs every kernel case under `dir` on `device`: the report's lines and the number of
/// failures.
fn run_cases(device: &nestor_backend_cuda::Device, dir: &Path) -> Result<(String, usize), String> {
    use nestor_backend_cuda::check::{compare, Case};
    let mut folders: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .map_err(|error| format!("{}: {error}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.join("meta.txt").exists())
        .collect();
    if folders.is_empty() {
        return Err(format!("no cases in {}", dir.display()));
    }
    folders.sort();
    let (mut lines, mut failed) = (String::new(), 0);
    for folder in &folders {
        let name = folder
            .file_name()
            .map_or_else(String::new, |name| name.to_string_lossy().into_owned());
        let outcome = Case::read(folder)
            .map_err(|error| error.to_string())
            .and_then(|case| {
                let actual = case.run_on(device).map_err(|error| error.to_string())?;
                compare(&actual, &case.expected, case.tolerance)
            });
        let line = match outcome {
            Ok(worst) => format!("ok   kernel {name}: largest relative error {worst:.2e}"),
            Err(why) => {
                failed += 1;
                format!("FAIL kernel {name}: {why}")
            }
        };
        println!("{line}");
        lines.push_str(&line);
        lines.push('\n');
    }
    Ok((lines, failed))
}

/// Runs `text` for `lengths` on the device and on the CPU runtime: the largest relative
/// difference and each one's time (on a GPU the median of five runs after one; on the
/// host, one run).
fn check(
    text: &str,
    train: bool,
    lengths: &[i64],
    (kind, storage, gemms): (Kind, Storage, Gemms),
    bf16_tolerance: f64,
) -> Result<(f64, Timing, f64), String> {
    let fail = |error: RuntimeError| error.to_string();
    let graph = nestor_ir::parse(text).map_err(|error| error.to_string())?;
    let graph = if train { joint(&graph)? } else { graph };
    let graph = nestor_passes::Pipeline::unoptimized()
        .run(&graph)
        .map_err(|error| error.to_string())?;
    // A GPU's program: attention's gradients read saved statistics.
    let options = nestor_passes::LowerOptions {
        attention_statistics: true,
        ..nestor_passes::LowerOptions::default()
    };
    let program = nestor_passes::lower_with(&graph, options).map_err(|error| error.to_string())?;
    let executable = nestor_backend_cpu::executable(program).map_err(fail)?;
    let mut values = example_inputs(&graph, lengths);
    if storage == Storage::Bf16 {
        // The CPU runtime computes on what the device's bf16 buffers hold.
        for input in &mut values {
            if let Values::F32(floats) = input {
                floats
                    .iter_mut()
                    .for_each(|value| *value = round_to_bf16(*value));
            }
        }
    }
    let inputs: Vec<InputData<'_>> = values.iter().map(Values::data).collect();
    let stats = Stats::default();
    // Timed on a GPU; the host's self-test runs each once.
    let runs = if kind == Kind::Cuda { 5 } else { 0 };
    let (expected, cpu_ms) = timed(runs, || executable.run(&inputs, &stats, None)).map_err(fail)?;
    let device_stats = Stats::default();
    let (uploaded, resident, device) = match kind {
        Kind::Sim => {
            let options = nestor_sim::SimOptions {
                storage,
                gemms,
                ..Default::default()
            };
            let device = nestor_sim::SimDevice::with(&executable, options).map_err(fail)?;
            on_device(&executable, &device, &inputs, &device_stats, runs)
        }
        Kind::Cuda => {
            let gpu = nestor_backend_cuda::Device::open(0).map_err(|error| error.to_string())?;
            let device = CudaDevice::with(gpu, &executable, storage, gemms).map_err(fail)?;
            on_device(&executable, &device, &inputs, &device_stats, runs)
        }
    }
    .map_err(fail)?;
    // One run from host memory against the CPU's timed ones: the same launches and
    // bytes moved per run.
    let (cpu, gpu) = (stats.snapshot(), device_stats.snapshot());
    let per_run = |count: u64| count.checked_div(runs as u64 + 1).unwrap_or(0);
    let cpu_counts = (per_run(cpu.kernel_launches), per_run(cpu.bytes_moved));
    if cpu_counts != (gpu.kernel_launches, gpu.bytes_moved) {
        return Err(format!(
            "the device counted {} launches and {} bytes moved, the CPU {} and {} a run",
            gpu.kernel_launches, gpu.bytes_moved, cpu_counts.0, cpu_counts.1
        ));
    }
    let mut worst = 0.0f64;
    for (what, actual) in [("from host memory", uploaded), ("resident", resident)] {
        worst = worst.max(
            compare_outputs(&actual, &expected, storage, bf16_tolerance)
                .map_err(|why| format!("{what}: {why}"))?,
        );
    }
    Ok((worst, device, cpu_ms))
}

/// The largest error of `actual` against `expected`, output by output ([`compare`]).
fn compare_outputs(
    actual: &[RunOutput],
    expected: &[RunOutput],
    storage: Storage,
    bf16_tolerance: f64,
) -> Result<f64, String> {
    if actual.len() != expected.len() {
        return Err(format!(
            "{} outputs, expected {}",
            actual.len(),
            expected.len()
        ));
    }
    let mut worst = 0.0f64;
    for (output, (a, e)) in actual.iter().zip(expected).enumerate() {
        let (RunData::F32(a), RunData::F32(e)) = (&a.data, &e.data) else {
            return Err(format!("output {output} is not f32"));
        };
        let error = compare(a, e, storage, bf16_tolerance)
            .map_err(|why| format!("output {output}, {why}"))?;
        worst = worst.max(error);
    }
    Ok(worst)
}

/// The error of `actual` against `expected` (the CPU runtime's): NaN and infinities
/// where expected, and then with f32 buffers every value within 1e-4 of it relative to
/// `1 + |expected|` (the largest such error is returned); with bf16 buffers, whose every
/// step rounds its results to 8 significant bits, the error's norm within
/// `bf16_tolerance` of the expected values' norm, or of the square root of their count where that is larger
/// (values near 0 measured against 1, as the f32 check does; that relative error is
/// returned).
fn compare(
    actual: &[f32],
    expected: &[f32],
    storage: Storage,
    bf16_tolerance: f64,
) -> Result<f64, String> {
    if actual.len() != expected.len() {
        return Err(format!(
            "{} values, expected {}",
            actual.len(),
            expected.len()
        ));
    }
    let (mut worst, mut error_norm, mut norm) = (0.0f64, 0.0f64, 0.0f64);
    for (index, (&x, &y)) in actual.iter().zip(expected).enumerate() {
        let mismatch = || format!("value {index}: device {x} vs CPU {y}");
        if !y.is_finite() || !x.is_finite() {
            if x.is_nan() != y.is_nan() || (!x.is_nan() && x != y) {
                return Err(mismatch());
            }
            continue;
        }
        let (x, y) = (f64::from(x), f64::from(y));
        let error = (x - y).abs() / (1.0 + y.abs());
        if storage == Storage::Compute && error > 1e-4 {
            return Err(mismatch());
        }
        worst = worst.max(error);
        error_norm += (x - y) * (x - y);
        norm += y * y;
    }
    if storage == Storage::Compute {
        return Ok(worst);
    }
    let relative = error_norm.sqrt() / norm.max(actual.len() as f64).sqrt();
    if relative > bf16_tolerance {
        return Err(format!(
            "the error's norm is {relative:.2e} of the values' (largest error {worst:.2e})"
        ));
    }
    Ok(relative)
}

/// The joint forward + backward graph of a loss (the first output): decomposed, then
/// differentiated with respect to every parameter.
fn joint(graph: &Graph) -> Result<Graph, String> {
    nestor_passes::differentiate_loss(graph)
        .map(|joint| joint.graph)
        .map_err(|error| error.to_string())
}

/// The program on `device`: once from host memory (counted into `stats`), then with
/// its float inputs already on the device and its results left there, timed over
/// `runs` runs after one until the device's work is done (as torch's timings, which
/// synchronize); both runs' results and that time.
fn on_device<D: KernelDevice>(
    executable: &Executable,
    device: &D,
    inputs: &[InputData<'_>],
    stats: &Stats,
    runs: usize,
) -> Result<(Vec<RunOutput>, Vec<RunOutput>, Timing), RuntimeError> {
    let uploaded = executable.run_on_device(device, inputs, stats)?;
    let buffers = inputs
        .iter()
        .map(|input| match input {
            InputData::F32(values) => device.upload_f32(values).map(Some),
            _ => Ok(None),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let resident_inputs: Vec<InputData<'_>> = inputs
        .iter()
        .zip(&buffers)
        .map(|(input, buffer)| match (input, buffer) {
            (InputData::F32(values), Some(buffer)) => InputData::OnDevice {
                address: device.address(buffer),
                len: values.len(),
            },
            _ => *input,
        })
        .collect();
    let unseen = Stats::default();
    let queued = std::cell::RefCell::new(Vec::new());
    let (results, total_ms) = timed(runs, || {
        let started = Instant::now();
        let results = executable.run_device_resident(device, &resident_inputs, &unseen)?;
        queued
            .borrow_mut()
            .push(started.elapsed().as_secs_f64() * 1e3);
        device.wait()?;
        Ok(results)
    })?;
    // The timed runs' (the first one's alone when there are none).
    let mut queued = queued.into_inner();
    let queued = queued.split_off(queued.len().saturating_sub(runs.max(1)));
    let timing = Timing {
        total_ms,
        queued_ms: median(queued),
    };
    Ok((uploaded, results.download(device, &unseen)?, timing))
}

/// A device run's median time until its work is done, and until its launches are queued
/// (the host's share: sizes, index buffers, argument tables, launches).
#[derive(Clone, Copy)]
struct Timing {
    total_ms: f64,
    queued_ms: f64,
}

/// The median of `times` (0 for none).
fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(0.0)
}

/// `step`'s result and its median time in milliseconds over `runs` runs after one (the
/// first one's time when `runs` is 0).
fn timed<T>(
    runs: usize,
    mut step: impl FnMut() -> Result<T, RuntimeError>,
) -> Result<(T, f64), RuntimeError> {
    let started = Instant::now();
    let mut result = step()?;
    let first = started.elapsed().as_secs_f64() * 1e3;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let started = Instant::now();
        result = step()?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    if times.is_empty() {
        times.push(first);
    }
    Ok((result, median(times)))
}

/// One input's values.
enum Values {
    F32(Vec<f32>),
    I64(Vec<i64>),
}

impl Values {
    fn data(&self) -> InputData<'_> {
        match self {
            Values::F32(values) => InputData::F32(values),
            Values::I64(values) => InputData::I64(values),
        }
    }
}

/// Values for every input of `graph` (every lengths input set to `lengths`): floats of
/// a fixed sequence in [-1, 1], integers (ids) in 0..3.
fn example_inputs(graph: &Graph, lengths: &[i64]) -> Vec<Values> {
    let batch = lengths.len() as i64;
    let volume = |dims: &mut dyn Iterator<Item = &Dim>| -> i64 {
        dims.map(|dim| match dim {
            Dim::Static(size) => *size,
            _ => batch,
        })
        .product()
    };
    let mut phase = 0.25f32;
    graph
        .nodes
        .iter()
        .filter(|node| matches!(node.op, Op::Input { .. } | Op::Param { .. }))
        .map(|node| {
            let (count, dtype) = match &node.ty {
                Type::Lengths { .. } => return Values::I64(lengths.to_vec()),
                Type::Ragged { dtype, dims, .. } => {
                    let tail = volume(&mut dims.iter().filter_map(|dim| match dim {
                        ElemDim::Fixed(dim) => Some(dim),
                        ElemDim::Ragged(_) => None,
                    }));
                    // Every lengths input holds `lengths`: an element is `L_i` long in
                    // each of its ragged dims (images `L_i x L_i`).
                    let ragged = dims
                        .iter()
                        .filter(|dim| matches!(dim, ElemDim::Ragged(_)))
                        .count() as u32;
                    let rows: i64 = lengths.iter().map(|&length| length.pow(ragged)).sum();
                    (rows * tail, *dtype)
                }
                Type::Dense { dtype, shape } => (volume(&mut shape.iter()), *dtype),
            };
            if dtype == DType::I64 {
                Values::I64((0..count).map(|index| (index * 5) % 3).collect())
            } else {
                phase += 0.37;
                Values::F32(
                    (0..count)
                        .map(|index| (index as f32 * 0.11 + phase).sin())
                        .collect(),
                )
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_benchmark_lengths_have_the_occupancies_they_are_named_by() {
        for (name, lengths) in BENCHMARK_LENGTHS {
            let longest = lengths.iter().copied().max().unwrap_or(0);
            let occupancy = lengths.iter().sum::<i64>() as f64 / (16 * longest) as f64;
            assert_eq!(format!("{:.0}%", 100.0 * occupancy), name);
        }
    }

    #[test]
    fn the_timed_graphs_lower_and_count_their_work() {
        for text in [
            attention_graph(false),
            attention_graph(true),
            POINTWISE.to_owned(),
        ] {
            let graph = nestor_ir::parse(&text).unwrap_or_else(|error| panic!("{error}"));
            assert!(nestor_passes::lower(&graph).is_ok());
        }
        // One element of 2: 4 scores of 64 columns, 16 heads, two products of 2 flops;
        // causal: 3 of the 4 pairs.
        assert_eq!(attention_flops(&[2], false), 4.0 * 4.0 * 16.0 * 64.0);
        assert_eq!(attention_flops(&[2], true), 4.0 * 3.0 * 16.0 * 64.0);
    }
}
