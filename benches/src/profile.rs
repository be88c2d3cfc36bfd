//! Where a compiled training step spends its time: every step of a model's joint
//! program timed over several calls ([`nestor::Compiled::record_steps`]), grouped by
//! kind, each product's achieved GFLOP/s against the machine's GEMM peak and each other
//! step's bytes moved against its copy bandwidth.

use std::collections::BTreeMap;
use std::fmt::Write;

use nestor::{StepKind, StepTiming};

use crate::limits::Limits;
use crate::models::{with_columns, Mode, Model, Precision};
use crate::{Result, Scale};

/// The profile of one model's compiled training step at one occupancy.
#[derive(Clone, Debug, PartialEq)]
pub struct StepProfile {
    /// The model.
    pub model: Model,
    /// f32 or mixed precision.
    pub precision: Precision,
    /// The batch's occupancy.
    pub occupancy: f64,
    /// Calls profiled.
    pub calls: usize,
    /// Median seconds of a whole call (the call, not only its steps).
    pub call_seconds: f64,
    /// Every step, in program order, its seconds the median over the profiled calls.
    pub steps: Vec<StepTiming>,
}

impl StepProfile {
    /// Seconds of all its steps (medians added).
    pub fn seconds(&self) -> f64 {
        self.steps.iter().map(|step| step.seconds).sum()
    }

    /// Its precision as the report names it.
    fn precision_name(&self) -> &'static str {
        match self.precision {
            Precision::F32 => "f32",
            Precision::Bf16 => "mixed precision (autocast bf16)",
        }
    }

    /// The GEMM peak of its products' type.
    fn peak(&self, limits: Option<&Limits>) -> Option<f64> {
        limits.map(|limits| match self.precision {
            Precision::F32 => limits.peak_gflops,
            Precision::Bf16 => limits.bf16_peak_gflops,
        })
    }
}

/// The median of `values` (0 for none).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// Profiles `model`'s compiled training step in `precision` on the report's batch at
/// about `target` occupancy: a few warm calls, then `scale.samples` recorded ones.
pub fn profile_training(
    model: Model,
    scale: &Scale,
    (target, seed): (f64, u64),
    precision: Precision,
) -> Result<StepProfile> {
    let mut profile = None;
    with_columns(
        model,
        scale,
        (target, seed),
        precision,
        &mut |mode, occupancy, _flops, columns| {
            if mode != Mode::Training {
                return Ok(());
            }
            let (mut step, function) = columns
                .compiled
                .ok_or("the model has no compiled training step")?;
            for _ in 0..3 {
                step().map(drop)?;
            }
            function.record_steps(true);
            let mut calls = Vec::with_capacity(scale.samples);
            for _ in 0..scale.samples {
                let started = std::time::Instant::now();
                step().map(drop)?;
                calls.push(started.elapsed().as_secs_f64());
            }
            function.record_steps(false);
            let runs = function.take_step_profiles();
            let first = runs.first().ok_or("no run was recorded")?;
            if runs.iter().any(|run| run.steps.len() != first.steps.len()) {
                return Err("the profiled calls ran different programs".into());
            }
            let steps = first
                .steps
                .iter()
                .enumerate()
                .map(|(index, step)| StepTiming {
                    seconds: median(runs.iter().map(|run| run.steps[index].seconds).collect()),
                    ..step.clone()
                })
                .collect();
            profile = Some(StepProfile {
                model,
                precision,
                occupancy,
                calls: runs.len(),
                call_seconds: median(calls),
                steps,
            });
            Ok(())
        },
    )?;
    profile.ok_or_else(|| "the model has no training step".into())
}

/// The report's section: per profile, a table of step kinds, then every step.
pub fn profile_section(profiles: &[StepProfile], limits: Option<&Limits>, out: &mut String) {
    if profiles.is_empty() {
        return;
    }
    let _ = writeln!(out, "## Where compiled training spends its time\n");
    let _ = writeln!(
        out,
        "Every step of the compiled training program timed over the profiled calls (`Compiled::record_steps`; \
         medians per step). Products (GEMMs, weight gradients, attention, convolutions) are read as achieved GFLOP/s, their \
         FLOPs those the step computes (attention's gradient recomputes the scores), against the GEMM peak; \
         the other steps as the bytes they read and write (every buffer read once, the one written) per \
         second against the copy bandwidth (Machine limits). The call's median includes what is outside the \
         steps (packing the inputs, accumulating the gradients into `.grad()`, the optimizer's step).\n"
    );
    for profile in profiles {
        kinds_table(profile, limits, out);
    }
    for profile in profiles {
        steps_table(profile, limits, out);
    }
}

/// A share of a limit, as `12%`, or empty without the limit.
fn share(value: f64, limit: Option<f64>) -> String {
    match limit {
        Some(limit) if limit > 0.0 && value > 0.0 => format!("{:.0}%", value / limit * 100.0),
        _ => String::new(),
    }
}

/// A rate in units of 1e9 per second (empty for no time or nothing counted).
fn rate(count: u64, seconds: f64) -> Option<f64> {
    (seconds > 0.0 && count > 0).then(|| count as f64 / seconds / 1e9)
}

/// `### <model> training, <precision>` and its kinds.
fn kinds_table(profile: &StepProfile, limits: Option<&Limits>, out: &mut String) {
    let total = profile.seconds();
    let peak = profile.peak(limits);
    let bandwidth = limits.map(|limits| limits.bandwidth);
    let _ = writeln!(
        out,
        "### {} training, {}, occupancy {:.2}\n",
        profile.model.name(),
        profile.precision_name(),
        profile.occupancy
    );
    let flops: u64 = profile.steps.iter().map(|step| step.flops).sum();
    let _ = writeln!(
        out,
        "{} steps, {:.2} ms in steps of a {:.2} ms call (median of {} calls); {:.1} GFLOP of products in steps, {:.1} GFLOP/s over the steps' time ({} of the {} peak).\n",
        profile.steps.len(),
        total * 1e3,
        profile.call_seconds * 1e3,
        profile.calls,
        flops as f64 / 1e9,
        rate(flops, total).unwrap_or(0.0),
        share(rate(flops, total).unwrap_or(0.0), peak),
        if profile.precision == Precision::F32 { "f32" } else { "bf16" },
    );
    let mut kinds: BTreeMap<StepKind, (usize, f64, u64, u64)> = BTreeMap::new();
    for step in &profile.steps {
        let entry = kinds.entry(step.kind).or_default();
        entry.0 += 1;
        entry.1 += step.seconds;
        entry.2 = entry.2.saturating_add(step.flops);
        entry.3 = entry.3.saturating_add(step.bytes);
    }
    let _ = writeln!(
        out,
        "| step kind | steps | ms | share of the steps | GFLOP/s | % of GEMM peak | GB/s moved | % of copy bandwidth |"
    );
    let _ = writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut kinds: Vec<_> = kinds.into_iter().collect();
    kinds.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    for (kind, (count, seconds, flops, bytes)) in kinds {
        let (gflops, bytes_rate) = if kind.is_product() {
            (rate(flops, seconds), None)
        } else {
            (None, rate(bytes, seconds))
        };
        let _ = writeln!(
            out,
            "| {} | {count} | {:.2} | {:.1}% | {} | {} | {} | {} |",
            kind.name(),
            seconds * 1e3,
            if total > 0.0 {
                seconds / total * 100.0
            } else {
                0.0
            },
            gflops.map_or(String::new(), |g| format!("{g:.1}")),
            gflops.map_or(String::new(), |g| share(g, peak)),
            bytes_rate.map_or(String::new(), |b| format!("{b:.1}")),
            bytes_rate.map_or(String::new(), |b| share(b, bandwidth)),
        );
    }
    out.push('\n');
}

/// Every step of a profile, in program order.
fn steps_table(profile: &StepProfile, limits: Option<&Limits>, out: &mut String) {
    let peak = profile.peak(limits);
    let bandwidth = limits.map(|limits| limits.bandwidth);
    let _ = writeln!(
        out,
        "<details><summary>Every step of the {} training program, {}, occupancy {:.2}</summary>\n",
        profile.model.name(),
        profile.precision_name(),
        profile.occupancy
    );
    let _ = writeln!(
        out,
        "| step | kind | what | ms | GFLOP/s | % of GEMM peak | MB moved | GB/s | % of copy bandwidth |"
    );
    let _ = writeln!(out, "|---:|---|---|---:|---:|---:|---:|---:|---:|");
    for step in &profile.steps {
        let gflops = rate(step.flops, step.seconds);
        let bytes_rate = rate(step.bytes, step.seconds);
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.3} | {} | {} | {:.2} | {} | {} |",
            step.step,
            step.kind.name(),
            step.label,
            step.seconds * 1e3,
            gflops.map_or(String::new(), |g| format!("{g:.1}")),
            gflops.map_or(String::new(), |g| share(g, peak)),
            step.bytes as f64 / 1e6,
            bytes_rate.map_or(String::new(), |b| format!("{b:.1}")),
            if step.kind.is_product() {
                String::new()
            } else {
                bytes_rate.map_or(String::new(), |b| share(b, bandwidth))
            },
        );
    }
    let _ = writeln!(out, "\n</details>\n");
}
