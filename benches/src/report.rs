//! The Markdown report and its PNG charts (speed-up over padded vs occupancy).

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;

use crate::limits::Limits;
use crate::models::{Column, Measurement, Mode, Model, Outcome, Precision};
use crate::profile::{profile_section, StepProfile};
use crate::Result;

/// Packing costs at one occupancy: building the batch's metadata, timed apart from the
/// steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Packing {
    /// The occupancy.
    pub occupancy: f64,
    /// Median seconds of `NestedTensor::from_tensors` (packing and offsets).
    pub nested: f64,
    /// Median seconds of padding into `[B, max, d]` and building the mask.
    pub padded: f64,
}

/// What the report says about where it was made.
pub struct Context {
    /// The command that made it.
    pub command: String,
    /// The machine.
    pub machine: String,
    /// The sizes.
    pub scale: String,
    /// Whether peak memory was counted.
    pub memory: bool,
}

fn median(outcome: &Outcome) -> Option<f64> {
    match outcome {
        Outcome::Measured { timing, .. } => Some(timing.median),
        Outcome::Unavailable(_) => None,
    }
}

/// The padded median of the row's subject, mode and occupancy.
fn padded_median(rows: &[Measurement], row: &Measurement) -> Option<f64> {
    rows.iter()
        .find(|other| {
            other.subject == row.subject
                && other.mode == row.mode
                && other.target == row.target
                && other.column == Column::Padded
        })
        .and_then(|other| median(&other.outcome))
}

/// Speed-up of `row` over padded eager (above 1: faster).
pub fn speedup(rows: &[Measurement], row: &Measurement) -> Option<f64> {
    Some(padded_median(rows, row)? / median(&row.outcome)?)
}

/// The table of `rows`; `peak_gflops` (the machine's GEMM limit) adds each cell's
/// useful GFLOP/s as a share of it.
/// The fastest PyTorch option measured for the row's subject, mode and occupancy, and
/// its median.
fn best_pytorch<'r>(rows: &'r [Measurement], row: &Measurement) -> Option<(&'r Measurement, f64)> {
    rows.iter()
        .filter(|other| {
            other.subject == row.subject
                && other.mode == row.mode
                && other.target == row.target
                && other.column.is_pytorch()
        })
        .filter_map(|other| Some((other, median(&other.outcome)?)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
}

/// Speed-up of `row` over the best PyTorch option (above 1: faster).
pub fn speedup_over_pytorch(rows: &[Measurement], row: &Measurement) -> Option<f64> {
    Some(best_pytorch(rows, row)?.1 / median(&row.outcome)?)
}

fn table(rows: &[Measurement], out: &mut String, with_mode: bool, peak_gflops: Option<f64>) {
    let _ = writeln!(
        out,
        "| {}occupancy | column | median ms | IQR ms | vs padded | vs best PyTorch | GFLOP/s | % of GEMM peak | peak MiB | compiles (first call) |",
        if with_mode { "mode | " } else { "" }
    );
    let _ = writeln!(
        out,
        "|{}---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        if with_mode { "---|" } else { "" }
    );
    for row in rows_in_order(rows) {
        let mode = if with_mode {
            format!("{} | ", row.mode.name())
        } else {
            String::new()
        };
        match &row.outcome {
            Outcome::Measured {
                timing,
                gflops,
                peak,
                compile,
            } => {
                let peak = peak.map_or("-".into(), |bytes| {
                    format!("{:.2}", bytes as f64 / 1048576.0)
                });
                let compile = compile.map_or("-".into(), |cost| {
                    format!("{} ({:.0} ms)", cost.compiles, cost.seconds * 1e3)
                });
                let times =
                    |ratio: Option<f64>| ratio.map_or("-".into(), |ratio| format!("{ratio:.2}x"));
                let ratio = times(speedup(rows, row));
                let pytorch = times(speedup_over_pytorch(rows, row));
                let (gflops, share) = match peak_gflops {
                    _ if *gflops <= 0.0 => ("-".into(), "-".into()),
                    Some(limit) => (
                        format!("{gflops:.1}"),
                        format!("{:.0}%", 100.0 * gflops / limit),
                    ),
                    None => (format!("{gflops:.1}"), "-".into()),
                };
                let _ = writeln!(
                    out,
                    "| {mode}{:.2} | {} | {:.3} | {:.3}-{:.3} | {ratio} | {pytorch} | {gflops} | {share} | {peak} | {compile} |",
                    row.occupancy,
                    row.column.name(),
                    timing.median * 1e3,
                    timing.low * 1e3,
                    timing.high * 1e3,
                );
            }
            Outcome::Unavailable(why) => {
                let _ = writeln!(
                    out,
                    "| {mode}{:.2} | {} | - | - | - | - | - | - | - | {} |",
                    row.occupancy,
                    row.column.name(),
                    why.replace('|', "/")
                );
            }
        }
    }
}

/// Rows sorted by mode, occupancy, then column order.
fn rows_in_order(rows: &[Measurement]) -> Vec<&Measurement> {
    let mut sorted: Vec<&Measurement> = rows.iter().collect();
    sorted.sort_by(|a, b| {
        (a.mode as u8, a.target, a.column as u8)
            .partial_cmp(&(b.mode as u8, b.target, b.column as u8))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    sorted
}

/// The headline: nestor's speed-up over the fastest PyTorch option, per model, mode and
/// occupancy (rows only where PyTorch options were measured).
fn pytorch_summary(models: &[Measurement], out: &mut String) {
    let _ = writeln!(
        out,
        "| model | mode | occupancy | best PyTorch option | its ms | nestor eager | nestor compiled |"
    );
    let _ = writeln!(out, "|---|---|---:|---|---:|---:|---:|");
    for (subject, mode) in subjects_and_modes() {
        {
            let mut compiled: Vec<&Measurement> = models
                .iter()
                .filter(|row| {
                    row.subject == subject
                        && row.mode == mode
                        && row.column == Column::NestorCompiled
                })
                .collect();
            compiled.sort_by(|a, b| a.target.total_cmp(&b.target));
            for row in compiled {
                let Some((best, seconds)) = best_pytorch(models, row) else {
                    continue;
                };
                let cell = |column: Column| {
                    models
                        .iter()
                        .find(|other| {
                            other.subject == row.subject
                                && other.mode == mode
                                && other.target == row.target
                                && other.column == column
                        })
                        .and_then(|other| speedup_over_pytorch(models, other))
                        .map_or("-".into(), |ratio| format!("{ratio:.2}x"))
                };
                let _ = writeln!(
                    out,
                    "| {} | {} | {:.2} | {} | {:.2} | {} | {} |",
                    subject,
                    mode.name(),
                    row.occupancy,
                    best.column.name().trim_start_matches("PyTorch "),
                    seconds * 1e3,
                    cell(Column::NestorEager),
                    cell(Column::NestorCompiled)
                );
            }
        }
    }
}

/// Every model's subjects (f32, then bf16), each with both modes, in table order.
fn subjects_and_modes() -> Vec<(String, Mode)> {
    Model::ALL
        .into_iter()
        .flat_map(|model| Precision::ALL.map(|precision| precision.subject(model)))
        .flat_map(|subject| [Mode::Inference, Mode::Training].map(|mode| (subject.clone(), mode)))
        .collect()
}

/// The speed-up over padded of every Rust column, per model, mode and occupancy.
fn summary(models: &[Measurement], out: &mut String) {
    let _ = writeln!(
        out,
        "| model | mode | occupancy | padded ms | per-element | nestor eager | nestor compiled |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|");
    for (subject, mode) in subjects_and_modes() {
        {
            let mut batches: Vec<&Measurement> = models
                .iter()
                .filter(|row| {
                    row.subject == subject && row.mode == mode && row.column == Column::Padded
                })
                .collect();
            batches.sort_by(|a, b| a.target.total_cmp(&b.target));
            for batch in batches {
                let cell = |column: Column| {
                    models
                        .iter()
                        .find(|row| {
                            row.subject == subject
                                && row.mode == mode
                                && row.target == batch.target
                                && row.column == column
                        })
                        .and_then(|row| speedup(models, row))
                        .map_or("-".into(), |ratio| format!("{ratio:.2}x"))
                };
                let padded = median(&batch.outcome)
                    .map_or("-".into(), |seconds| format!("{:.2}", seconds * 1e3));
                let occupancy = batch.occupancy;
                let _ = writeln!(
                    out,
                    "| {} | {} | {occupancy:.2} | {padded} | {} | {} | {} |",
                    subject,
                    mode.name(),
                    cell(Column::PerElement),
                    cell(Column::NestorEager),
                    cell(Column::NestorCompiled)
                );
            }
        }
    }
}

/// What the machine does at best, and the models' GEMMs in libtorch and nestor compiled.
fn limits_section(limits: &Limits, out: &mut String) {
    let _ = writeln!(out, "\n## Machine limits\n");
    let _ = writeln!(
        out,
        "Measured at the start of the run, after one untimed pass over the first occupancy's \
         GEMMs below (the process's first compiled GEMMs ran slower). GEMM peak: the best of \
         libtorch's f32 matmul of two {side}x{side} matrices ({:.1} GFLOP/s), nestor \
         compiled's `linear` of the same sizes ({:.1} GFLOP/s) and every product of the table \
         below, {:.1} GFLOP/s. Memory bandwidth: a copy of {} MiB, {:.1} GB/s (bytes read \
         plus written). Each GEMM of a Transformer layer at the models' lengths (every \
         occupancy), `linear` with a bias on the packed rows: libtorch on the values tensor \
         against nestor compiled on the batch (a whole compiled call).\n",
        limits.libtorch_gflops,
        limits.compiled_gflops,
        limits.peak_gflops,
        limits.copy_bytes >> 20,
        limits.bandwidth,
        side = limits.peak_side,
    );
    let _ = writeln!(
        out,
        "bf16 GEMM peak: the better of libtorch's matmul of the same square in bf16 ({:.1} \
         GFLOP/s) and nestor compiled's `linear` of it under `autocast(Kind::BFloat16)` ({:.1} \
         GFLOP/s), {:.1} GFLOP/s ({:.1}x the f32 peak).\n",
        limits.bf16_libtorch_gflops,
        limits.bf16_compiled_gflops,
        limits.bf16_peak_gflops,
        limits.bf16_peak_gflops / limits.peak_gflops
    );
    let _ = writeln!(
        out,
        "| GEMM | rows x k x n | libtorch ms | libtorch GFLOP/s | compiled ms | compiled GFLOP/s | compiled / libtorch |"
    );
    let _ = writeln!(out, "|---|---|---:|---:|---:|---:|---:|");
    for row in &limits.gemms {
        let _ = writeln!(
            out,
            "| {} | {} x {} x {} | {:.3} | {:.1} | {:.3} | {:.1} | {:.2}x |",
            row.what,
            row.rows,
            row.k,
            row.n,
            row.libtorch.median * 1e3,
            row.gflops(&row.libtorch),
            row.compiled.median * 1e3,
            row.gflops(&row.compiled),
            row.share()
        );
    }
}

/// The models' bf16 rows: what each column runs in bf16, then a table per model.
fn bf16_section(models: &[Measurement], limits: Option<&Limits>, out: &mut String) {
    let _ = writeln!(out, "## bf16\n");
    let _ = writeln!(
        out,
        "The same batches in bf16, as a bf16 user runs them. padded tch eager, per-element tch \
         eager and nestor eager run the model and batch converted to bf16 (libtorch's bf16 \
         kernels); nestor compiled runs the f32 model and batch in mixed precision \
         (`Compiled::autocast(Kind::BFloat16)`: products on bf16 roundings with f32 sums, f32 \
         parameters and gradients). PyTorch: \"padded eager (no fast path)\" and \"padded \
         torch.compile\" (and the conv net's channels-last ones) run the f32 model under \
         `torch.autocast(\"cpu\", dtype=torch.bfloat16)`; \"padded eager, fast path on\" and \
         the `torch.nested` options run the model and batch converted to bf16. % of GEMM peak \
         is of the bf16 GEMM peak (Machine limits).\n"
    );
    for model in Model::ALL {
        let subject = Precision::Bf16.subject(model);
        let rows: Vec<Measurement> = models
            .iter()
            .filter(|row| row.subject == subject)
            .cloned()
            .collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(out, "### {subject}\n");
        table(
            &rows,
            out,
            true,
            limits.map(|limits| limits.bf16_peak_gflops),
        );
        out.push('\n');
    }
}

/// The file name of a model's chart.
pub fn chart_name(model: Model) -> String {
    format!(
        "speedup-{}.png",
        model
            .name()
            .to_lowercase()
            .replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    )
}

/// Registers the font charts are drawn with: `NESTOR_FONT`, or DejaVu Sans where Debian
/// puts it (`fonts-dejavu-core`, installed by `scripts/setup.sh`).
pub fn register_font() -> Result<()> {
    let path = std::env::var("NESTOR_FONT")
        .unwrap_or_else(|_| "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf".into());
    let bytes = std::fs::read(&path).map_err(|error| {
        format!("cannot read the chart font {path}: {error} (install fonts-dejavu-core or set NESTOR_FONT)")
    })?;
    plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| format!("{path} is not a font"))?;
    Ok(())
}

/// One line of a chart: a column in a mode, its (occupancy, speed-up) points.
type Series = (Column, Mode, Vec<(f64, f64)>);

/// Draws the speed-up over padded eager against occupancy of one model's columns.
pub fn chart(models: &[Measurement], model: Model, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let series: Vec<Series> = [Mode::Inference, Mode::Training]
        .into_iter()
        .flat_map(|mode| {
            [
                Column::PerElement,
                Column::NestorEager,
                Column::NestorCompiled,
            ]
            .into_iter()
            .map(move |column| (mode, column))
        })
        .filter_map(|(mode, column)| {
            let mut points: Vec<(f64, f64)> = models
                .iter()
                .filter(|row| {
                    row.subject == model.name() && row.mode == mode && row.column == column
                })
                .filter_map(|row| Some((row.occupancy, speedup(models, row)?)))
                .collect();
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            (!points.is_empty()).then_some((column, mode, points))
        })
        .collect();
    let top = series
        .iter()
        .flat_map(|(_, _, points)| points.iter().map(|point| point.1))
        .fold(1.0f64, f64::max)
        * 1.15;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("{}: speed-up over padded tch eager", model.name()),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0f64..1.0f64, 0.0f64..top)?;
    chart
        .configure_mesh()
        .x_desc("occupancy")
        .y_desc("speed-up (x)")
        .draw()?;
    chart.draw_series(LineSeries::new([(0.0, 1.0), (1.0, 1.0)], BLACK.mix(0.4)))?;
    for (column, mode, points) in &series {
        // One color per column; inference thick, training thin.
        let color = match column {
            Column::PerElement => RGBColor(230, 97, 1),
            Column::NestorEager => RGBColor(27, 120, 55),
            _ => RGBColor(33, 102, 172),
        }
        .to_rgba();
        let width = if *mode == Mode::Inference { 3 } else { 1 };
        let style = ShapeStyle::from(color).stroke_width(width);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))?
            .label(format!("{} {}", column.name(), mode.name()))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
        chart.draw_series(
            points
                .iter()
                .map(|&point| Circle::new(point, 3, color.filled())),
        )?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperRight)
        .draw()?;
    root.present()?;
    Ok(())
}

/// The whole report in Markdown; charts are linked as `chart_name(model)`.
pub fn markdown(
    context: &Context,
    limits: Option<&Limits>,
    packing: &[Packing],
    models: &[Measurement],
    operators: &[Measurement],
    profiles: &[StepProfile],
) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# nestor benchmark report\n");
    let _ = writeln!(
        out,
        "Made by `{}` on {}. Sizes: {}. Every cell is the median of its timed runs after one warm-up run (a step under 1 ms is called back to back for at least 1 ms per run, and the run's time divided by the calls); the Rust columns of a batch are timed in turns, one run of each per round, so that a slow spell of the machine slows them alike, each run of a step under 100 ms right after an untimed call of the same step (as the PyTorch options are timed: calls back to back); \
         IQR is the 25th-75th percentile range. Peak memory: {}.\n",
        context.command,
        context.machine,
        context.scale,
        if context.memory {
            "the most bytes allocated at once during one step beyond what was allocated before it, \
             counted by the preloaded `nestor-memcount` malloc (libtorch's allocations included)"
        } else {
            "not counted (run through `make report`, which preloads `nestor-memcount`)"
        }
    );
    let _ = writeln!(out, "## How to read it\n");
    let _ = writeln!(
        out,
        "- **vs best PyTorch** is the median of the fastest PyTorch option over the cell's median. The \
         PyTorch options are what a PyTorch user would run instead, run by `benches/pytorch.py` in the \
         torch venv's Python on the same lengths and weight shapes: padded eager with the inference fast \
         path on and without it, padded under `torch.compile`, and `torch.nested` (jagged layout) eager and under \
         `torch.compile` (encoder only); for the conv net padded eager and padded `torch.compile`. Their \
         compiles column counts the graphs torch.compile made (graph breaks and recompiles included) and \
         the first call's time.\n\
         - **vs padded** is the padded median over the cell's median: above 1x the column is faster than \
         libtorch on the padded batch with masks (a Rust baseline on the same libtorch).\n\
         - **GFLOP/s** counts only useful FLOPs, those of the real lengths (matrix products; attention over \
         each element's own square; training counts 3x forward), divided by the median: padding shows up as \
         lower GFLOP/s for the padded column, not higher.\n\
         - **% of GEMM peak** is the cell's useful GFLOP/s over the machine's GEMM peak (see Machine \
         limits): how far a GEMM-bound step is from what the machine does.\n\
         - **compiles (first call)**: programs compiled over all calls of the cell (1: one program served \
         every call) and the time of the first call, which traces, optimizes, lowers and JIT-compiles.\n\
         - Packing (building a batch's offsets and metadata, or padding it with its mask) is timed apart, \
         below, and not part of the steps.\n"
    );
    let _ = writeln!(out, "## Summary: speed-up over the best PyTorch option\n");
    pytorch_summary(models, &mut out);
    let _ = writeln!(
        out,
        "\n## Speed-up over padded tch eager (the Rust baseline, on the same libtorch)\n"
    );
    summary(models, &mut out);
    if let Some(limits) = limits {
        limits_section(limits, &mut out);
    }
    let _ = writeln!(out, "\n## Packing (metadata, timed apart from the steps)\n");
    let _ = writeln!(
        out,
        "| occupancy | NestedTensor::from_tensors ms | padding + mask ms |"
    );
    let _ = writeln!(out, "|---:|---:|---:|");
    for packing in packing {
        let _ = writeln!(
            out,
            "| {:.2} | {:.3} | {:.3} |",
            packing.occupancy,
            packing.nested * 1e3,
            packing.padded * 1e3
        );
    }
    let _ = writeln!(out, "\n## Models\n");
    for model in Model::ALL {
        let rows: Vec<Measurement> = models
            .iter()
            .filter(|row| row.subject == model.name())
            .cloned()
            .collect();
        if rows.is_empty() {
            continue;
        }
        let _ = writeln!(out, "### {}\n", model.name());
        let _ = writeln!(out, "![{} speed-up]({})\n", model.name(), chart_name(model));
        table(
            &rows,
            &mut out,
            true,
            limits.map(|limits| limits.peak_gflops),
        );
        out.push('\n');
    }
    bf16_section(models, limits, &mut out);
    profile_section(profiles, limits, &mut out);
    let _ = writeln!(out, "## Operators\n");
    let subjects: Vec<String> = {
        let mut seen: Vec<String> = Vec::new();
        for row in operators {
            if !seen.contains(&row.subject) {
                seen.push(row.subject.clone());
            }
        }
        seen
    };
    for subject in subjects {
        let rows: Vec<Measurement> = operators
            .iter()
            .filter(|row| row.subject == subject)
            .cloned()
            .collect();
        let _ = writeln!(out, "### {subject}\n");
        table(
            &rows,
            &mut out,
            false,
            limits.map(|limits| limits.peak_gflops),
        );
        out.push('\n');
    }
    out
}
