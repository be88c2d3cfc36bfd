//! Runs the whole benchmark suite and writes the Markdown report and its charts.
//!
//! ```sh
//! make report                       # CPU sizes, into docs/benchmarks/
//! scripts/cargo run --release -p nestor-bench --bin report -- --scale full --out /tmp/r
//! ```
//!
//! Options: `--scale cpu|full|smoke` (default cpu), `--out DIR` (default
//! `docs/benchmarks`), `--only TEXT` (only the models and operators whose name contains
//! it, case-insensitive: for quick measurements; the report then has only those),
//! `--precision f32|bf16` (only that precision's rows; default both). When `libnestor_memcount.so` sits next to the binary (`make
//! report` builds it), the report runs itself again with it preloaded to count peak
//! memory.

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};
use nestor::NestedTensor;
use nestor_bench::lengths::{lengths, occupancy};
use nestor_bench::limits::measure_limits;
use nestor_bench::measure::{memory_counted, time};
use nestor_bench::models::{run_model, Measurement, Model, Outcome, Precision};
use nestor_bench::operators::{run_operator, Operator};
use nestor_bench::profile::profile_training;
use nestor_bench::pytorch::run_pytorch;
use nestor_bench::report::{chart, chart_name, markdown, register_font, Context, Packing};
use nestor_bench::{Result, Scale, OCCUPANCIES};
use tch::{Device, Kind, Tensor};

fn main() {
    if let Err(error) = run() {
        eprintln!("report: {error}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    if let Some(code) = nestor_bench::measure::rerun_with_memcount("report")? {
        std::process::exit(code);
    }
    let mut scale_name = "cpu".to_owned();
    let mut out = PathBuf::from("docs/benchmarks");
    let mut only: Option<String> = None;
    let mut precisions = Precision::ALL.to_vec();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--scale" => scale_name = args.next().ok_or("--scale needs cpu, full or smoke")?,
            "--out" => out = PathBuf::from(args.next().ok_or("--out needs a folder")?),
            "--only" => only = Some(args.next().ok_or("--only needs a name")?.to_lowercase()),
            "--precision" => {
                precisions = match args.next().as_deref() {
                    Some("f32") => vec![Precision::F32],
                    Some("bf16") => vec![Precision::Bf16],
                    _ => return Err("--precision needs f32 or bf16".into()),
                }
            }
            other => {
                return Err(format!(
                    "unknown argument {other} (use --scale, --out, --only, --precision)"
                )
                .into())
            }
        }
    }
    let scale = match scale_name.as_str() {
        "cpu" => Scale::cpu(),
        "full" => Scale::full(),
        "smoke" => Scale::smoke(),
        other => return Err(format!("unknown scale {other}: cpu, full or smoke").into()),
    };
    register_font()?;
    std::fs::create_dir_all(&out)?;
    let chosen = |name: &str| {
        only.as_ref()
            .is_none_or(|only| name.to_lowercase().contains(only))
    };
    let chosen_models: Vec<Model> = Model::ALL
        .into_iter()
        .filter(|model| chosen(model.name()))
        .collect();
    let chosen_operators: Vec<Operator> = Operator::ALL
        .into_iter()
        .filter(|operator| chosen(operator.name()))
        .collect();
    // One step per model and occupancy, and per operator.
    let bar =
        ProgressBar::new((chosen_models.len() * OCCUPANCIES.len() + chosen_operators.len()) as u64);
    bar.set_style(ProgressStyle::with_template(
        "report {bar:30} {pos}/{len} [{elapsed_precise}, about {eta} left] {msg}",
    )?);
    bar.set_message("machine limits");
    let limits = measure_limits(&scale)?;
    bar.suspend(|| {
        eprintln!(
            "report: GEMM peak {:.1} GFLOP/s (libtorch {:.1}, compiled {:.1}), bf16 {:.1} (libtorch {:.1}, compiled {:.1}), bandwidth {:.1} GB/s",
            limits.peak_gflops,
            limits.libtorch_gflops,
            limits.compiled_gflops,
            limits.bf16_peak_gflops,
            limits.bf16_libtorch_gflops,
            limits.bf16_compiled_gflops,
            limits.bandwidth
        );
        for row in &limits.gemms {
            eprintln!(
                "report: {} {}x{}x{}: libtorch {:.1}, compiled {:.1} GFLOP/s ({:.2}x)",
                row.what,
                row.rows,
                row.k,
                row.n,
                row.gflops(&row.libtorch),
                row.gflops(&row.compiled),
                row.share()
            );
        }
    });
    let mut models: Vec<Measurement> = Vec::new();
    for &model in &chosen_models {
        for (index, &occupancy) in OCCUPANCIES.iter().enumerate() {
            for &precision in &precisions {
                let subject = precision.subject(model);
                bar.set_message(format!("{subject} at occupancy {occupancy}"));
                let batch = (occupancy, 100 + index as u64);
                let mut rows = run_model(model, &scale, batch, precision)?;
                rows.extend(run_pytorch(model, &scale, batch, precision)?);
                for row in &rows {
                    bar.suspend(|| eprintln!("{}", progress(row)));
                }
                models.extend(rows);
            }
            bar.inc(1);
        }
    }
    // Where each model's compiled training step spends its time: each Transformer's at
    // 35% occupancy (the full Transformer's showed steps slowed by a growing buffer pool
    // that the encoder's alone did not), the conv net's at 77%, where its goal against
    // oneDNN's channels-last convolutions is.
    let mut profiles = Vec::new();
    let profiled = [
        (Model::Encoder, 1),
        (Model::Decoder, 1),
        (Model::Transformer, 1),
        (Model::ConvNet, 2),
    ];
    for (model, index) in profiled
        .into_iter()
        .filter(|(model, _)| chosen_models.contains(model))
    {
        for &precision in &precisions {
            let subject = precision.subject(model);
            bar.set_message(format!("profiling the training of {subject}"));
            let batch = (OCCUPANCIES[index], 100 + index as u64);
            profiles.push(profile_training(model, &scale, batch, precision)?);
        }
    }
    let mut operators: Vec<Measurement> = Vec::new();
    for &operator in &chosen_operators {
        bar.set_message(operator.name());
        let rows = run_operator(operator, &scale, 0.35, 200)?;
        for row in &rows {
            bar.suspend(|| eprintln!("{}", progress(row)));
        }
        bar.inc(1);
        operators.extend(rows);
    }
    bar.finish_and_clear();
    let packing = OCCUPANCIES
        .iter()
        .enumerate()
        .map(|(index, &target)| packing(&scale, target, 100 + index as u64))
        .collect::<Result<Vec<_>>>()?;
    for &model in &chosen_models {
        chart(&models, model, &out.join(chart_name(model)))?;
    }
    let context = Context {
        command: format!("make report (scale {scale_name})"),
        machine: machine(),
        scale: describe(&scale),
        memory: memory_counted(),
    };
    let path = out.join("report.md");
    std::fs::write(
        &path,
        markdown(
            &context,
            Some(&limits),
            &packing,
            &models,
            &operators,
            &profiles,
        ),
    )?;
    eprintln!("report: wrote {}", path.display());
    Ok(())
}

/// A line saying what one measurement gave.
fn progress(row: &Measurement) -> String {
    let what = match &row.outcome {
        Outcome::Measured { timing, .. } => format!("{:.3} ms", timing.median * 1e3),
        Outcome::Unavailable(why) => why.clone(),
    };
    format!(
        "report: {} {} {:.2} {}: {what}",
        row.subject,
        row.mode.name(),
        row.occupancy,
        row.column.name()
    )
}

/// Times building a batch's metadata: packing with offsets, and padding with a mask.
fn packing(scale: &Scale, target: f64, seed: u64) -> Result<Packing> {
    let lengths = lengths(scale.batch, scale.max_length, target, seed);
    let elements: Vec<Tensor> = lengths
        .iter()
        .map(|&length| Tensor::f_randn([length, scale.d_model], (Kind::Float, Device::Cpu)))
        .collect::<std::result::Result<_, _>>()?;
    let nested = time(scale.samples, || {
        NestedTensor::builder()
            .ragged_dims(&[0])
            .tensors(&elements)?;
        Ok(())
    })?;
    let padded = time(scale.samples, || {
        let padded = Tensor::f_pad_sequence(&elements, true, 0.0, "right")?;
        let positions = Tensor::f_arange(scale.max_length, (Kind::Int64, Device::Cpu))?;
        let _mask = positions
            .f_unsqueeze(0)?
            .f_lt_tensor(&Tensor::f_from_slice(&lengths)?.f_unsqueeze(1)?)?;
        drop(padded);
        Ok(())
    })?;
    Ok(Packing {
        occupancy: occupancy(&lengths, scale.max_length),
        nested: nested.median,
        padded: padded.median,
    })
}

fn describe(scale: &Scale) -> String {
    format!(
        "batch {}, max length {}, d_model {}, {} heads, {} layers per stack, feed-forward {}; \
         images up to {s}x{s} with {} channels; vocabulary {}; {} timed runs per cell",
        scale.batch,
        scale.max_length,
        scale.d_model,
        scale.heads,
        scale.layers,
        scale.feedforward,
        scale.channels,
        scale.vocabulary,
        scale.samples,
        s = scale.image_side
    )
}

/// The host's bf16 units, as `/proc/cpuinfo`'s flags name them.
fn bf16_units(cpuinfo: &str) -> String {
    let flags: Vec<&str> = cpuinfo
        .lines()
        .find(|line| line.starts_with("flags"))
        .map_or(Vec::new(), |line| line.split_whitespace().collect());
    let units: Vec<&str> = ["amx_bf16", "avx512_bf16"]
        .into_iter()
        .filter(|unit| flags.contains(unit))
        .collect();
    if units.is_empty() {
        " (the host has no bf16 units)".to_owned()
    } else {
        format!(" (the host has {})", units.join(", "))
    }
}

/// The CPU (name, family and model, widest vectors), the threads and which library
/// multiplies the compiled GEMMs (chosen by a probe, see `nestor::gemm_probe`).
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        cpuinfo
            .lines()
            .find(|line| line.split(':').next().is_some_and(|key| key.trim() == name))
            .and_then(|line| line.split(':').nth(1))
            .map_or("?".to_owned(), |value| value.trim().to_owned())
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_arch = "x86_64")]
    let vectors = if std::is_x86_feature_detected!("avx512f") {
        "AVX-512"
    } else if std::is_x86_feature_detected!("avx2") {
        "AVX2"
    } else {
        "no AVX2"
    };
    #[cfg(not(target_arch = "x86_64"))]
    let vectors = "not x86-64";
    let probe = nestor::gemm_probe().map_or(String::new(), |probe| {
        let products: Vec<String> = nestor::GemmProbe::PRODUCTS
            .iter()
            .map(ToString::to_string)
            .collect();
        format!(
            " (f32 products {} on one thread: MKL {:.3} ms, gemm crate {:.3} ms)",
            products.join(", "),
            probe.mkl_seconds * 1e3,
            probe.builtin_seconds * 1e3,
        )
    });
    format!(
        "{} (family {}, model {}, {vectors}), {cores} cores, libtorch 2.13 through tch 0.26, {} \
         threads; compiled GEMMs by the {}{probe}; compiled bf16 products by {}{}{}{}",
        field("model name"),
        field("cpu family"),
        field("model"),
        tch::get_num_threads(),
        nestor::gemm_library(),
        nestor::bf16_path().name(),
        bf16_units(&cpuinfo),
        if nestor::attention_on_amx() {
            ", mixed-precision attention's forward and gradient on AMX tiles"
        } else {
            ""
        },
        match nestor::attention_in_registers() {
            Some(registers) =>
                format!(", f32 attention's forward and gradient fused in {registers} registers"),
            None => String::new(),
        }
    )
}
