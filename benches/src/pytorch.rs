//! What a PyTorch user would run instead: `benches/pytorch.py` (padded eager with the
//! fast path on and without it, padded `torch.compile`, `torch.nested` jagged eager and
//! compiled; for the conv net padded eager and `torch.compile`), run with the torch
//! venv's Python on the same lengths, image sizes and weight shapes as the report's
//! other cells, its lines read back as measurements.

use std::path::PathBuf;
use std::process::Command;

use crate::lengths::{image_sizes, occupancy};
use crate::measure::Timing;
use crate::models::{
    conv_flops, token_lengths, transformer_flops, Column, CompileCost, Measurement, Mode, Model,
    Outcome, Precision,
};
use crate::script::ScriptFiles;
use crate::{Result, Scale};

/// The script, carried in the binary.
const SCRIPT: &str = include_str!("../pytorch.py");

/// The Python of the torch venv: `$NESTOR_VENV/bin/python` (`scripts/env.sh` exports
/// it), else the default cache's.
pub fn python() -> Option<PathBuf> {
    let venv = std::env::var_os("NESTOR_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/nestor/venv"))
        })?;
    let python = venv.join("bin/python");
    python.exists().then_some(python)
}

/// The PyTorch rows of `model` at about `target` occupancy in `precision` (both modes;
/// the batches of the report's other columns), or a row that says why there are none
/// (no venv Python).
pub fn run_pytorch(
    model: Model,
    scale: &Scale,
    (target, seed): (f64, u64),
    precision: Precision,
) -> Result<Vec<Measurement>> {
    let joined = |items: Vec<String>| items.join(",");
    let mut args: Vec<String> = vec![
        "--model".into(),
        model.name().into(),
        "--samples".into(),
        scale.samples.to_string(),
        "--threads".into(),
        tch::get_num_threads().to_string(),
        "--dtype".into(),
        match precision {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
        .into(),
    ];
    let subject = precision.subject(model);
    let (occupancy, flops) = if model == Model::ConvNet {
        let sizes = image_sizes(scale.batch, scale.image_side, target, seed);
        let area: i64 = sizes.iter().map(|&(h, w)| h * w).sum();
        let images = joined(sizes.iter().map(|(h, w)| format!("{h}x{w}")).collect());
        args.extend([
            "--channels".into(),
            scale.channels.to_string(),
            "--side".into(),
            scale.image_side.to_string(),
            "--images".into(),
            images,
        ]);
        let pixels = (scale.batch * scale.image_side * scale.image_side) as f64;
        (area as f64 / pixels, conv_flops(scale, &sizes))
    } else {
        let (source, target_lengths) = token_lengths(scale, target, seed);
        let output = if model == Model::Decoder {
            &target_lengths
        } else {
            &source
        };
        let lengths = |lengths: &[i64]| joined(lengths.iter().map(i64::to_string).collect());
        args.extend([
            "--d-model".into(),
            scale.d_model.to_string(),
            "--heads".into(),
            scale.heads.to_string(),
            "--feedforward".into(),
            scale.feedforward.to_string(),
            "--layers".into(),
            scale.layers.to_string(),
            "--source".into(),
            lengths(&source),
            "--target".into(),
            lengths(&target_lengths),
        ]);
        let flops = transformer_flops(model, scale, &source, &target_lengths);
        (occupancy(output, scale.max_length), flops)
    };
    let mut rows = Vec::new();
    for mode in [Mode::Inference, Mode::Training] {
        let row = |column: Column, outcome: Outcome| Measurement {
            subject: subject.clone(),
            mode,
            target,
            occupancy,
            column,
            outcome,
        };
        let Some(python) = python() else {
            let why = "no torch venv Python (NESTOR_VENV/bin/python)".to_owned();
            rows.push(row(Column::TorchPadded, Outcome::Unavailable(why)));
            continue;
        };
        let files = ScriptFiles::write("pytorch.py", SCRIPT)?;
        let result = Command::new(&python)
            .arg(&files.script)
            .args(&args)
            .args(["--mode", mode.name()])
            .output()?;
        if !result.status.success() {
            let error = String::from_utf8_lossy(&result.stderr);
            let last = error.lines().last().unwrap_or("no message");
            return Err(format!("benches/pytorch.py failed ({}): {last}", result.status).into());
        }
        // Training counts 3x the forward's FLOPs, as the other columns do.
        let factor = if mode == Mode::Training { 3.0 } else { 1.0 };
        for line in String::from_utf8_lossy(&result.stdout).lines() {
            let (column, outcome) = parse_line(line, factor * flops)?;
            rows.push(row(column, outcome));
        }
    }
    Ok(rows)
}

/// One line of the script: an option and its timing, or why it could not run.
fn parse_line(line: &str, flops: f64) -> Result<(Column, Outcome)> {
    let fields: Vec<&str> = line.split('\t').collect();
    let column = Column::PYTORCH
        .into_iter()
        .find(|column| column.name().strip_prefix("PyTorch ") == Some(fields[0]))
        .ok_or_else(|| format!("benches/pytorch.py: unknown option in {line:?}"))?;
    if fields.get(1) == Some(&"unavailable") {
        let why = fields.get(2).unwrap_or(&"no reason given");
        return Ok((column, Outcome::Unavailable(why.to_string())));
    }
    let number = |index: usize| -> Result<f64> {
        fields
            .get(index)
            .and_then(|field| field.parse::<f64>().ok())
            .ok_or_else(|| format!("benches/pytorch.py: field {index} of {line:?}").into())
    };
    let (median, low, high, first) = (
        number(1)? / 1e3,
        number(2)? / 1e3,
        number(3)? / 1e3,
        number(4)? / 1e3,
    );
    let graphs = number(5)? as u64;
    let compiled = matches!(
        column,
        Column::TorchCompiled | Column::TorchCompiledChannelsLast | Column::TorchNestedCompiled
    );
    Ok((
        column,
        Outcome::Measured {
            timing: Timing {
                median,
                low,
                high,
                samples: 0,
            },
            gflops: flops / median / 1e9,
            peak: None,
            compile: compiled.then_some(CompileCost {
                compiles: graphs,
                seconds: first,
            }),
        },
    ))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.
mod tests {
    use super::*;

    #[test]
    fn lines_of_the_script_become_measurements() {
        let (column, outcome) =
            parse_line("padded torch.compile\t87.5\t85.0\t88.0\t4300.0\t2", 8.75e9).unwrap();
        assert_eq!(column, Column::TorchCompiled);
        let Outcome::Measured {
            timing,
            gflops,
            compile,
            ..
        } = outcome
        else {
            panic!("{outcome:?}");
        };
        assert_eq!(
            (timing.median, timing.low, timing.high),
            (0.0875, 0.085, 0.088)
        );
        assert!((gflops - 100.0).abs() < 1e-9);
        assert_eq!(compile.map(|cost| cost.compiles), Some(2));
        let (column, outcome) = parse_line(
            "torch.nested jagged eager\tunavailable\tRuntimeError: no",
            1.0,
        )
        .unwrap();
        assert_eq!(column, Column::TorchNested);
        assert_eq!(outcome, Outcome::Unavailable("RuntimeError: no".into()));
        assert!(parse_line("padded numpy\t1\t1\t1\t1\t0", 1.0).is_err());
        assert!(parse_line("padded torch.compile\tfast", 1.0).is_err());
    }
}
