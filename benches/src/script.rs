//! The PyTorch side of the checkpoint-sized benchmarks (`bin/resnet50.rs`, `bin/bert.rs`):
//! a script carried in the binary, run with the torch venv's Python, its lines
//! (`<batch>\t<option>\t<median ms>\t<25th>\t<75th>\t<first ms>[\t<peak bytes>]` or
//! `<batch>\t<option>\tunavailable\t<why>`) read back as cells.

use std::path::PathBuf;
use std::process::Command;

use crate::measure::Timing;
use crate::pytorch::python;
use crate::Result;

/// What every script imports (`from timing import timed`).
const TIMING: &str = include_str!("../timing.py");

/// A script and `timing.py` written to a folder of their own under the temp folder
/// (removed when dropped), to run with the venv's Python.
pub struct ScriptFiles {
    folder: PathBuf,
    /// The script's path.
    pub script: PathBuf,
}

impl ScriptFiles {
    /// Writes `source` as `name`, and `timing.py` beside it.
    pub fn write(name: &str, source: &str) -> Result<Self> {
        let folder = std::env::temp_dir().join(format!("nestor-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&folder)?;
        let files = Self {
            script: folder.join(name),
            folder,
        };
        std::fs::write(files.folder.join("timing.py"), TIMING)?;
        std::fs::write(&files.script, source)?;
        Ok(files)
    }
}

impl Drop for ScriptFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.folder);
    }
}

/// One measured option: its step time and, when counted, its peak extra bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measured {
    /// Step times.
    pub timing: Timing,
    /// The most bytes a step allocated beyond what was allocated before it.
    pub peak: Option<u64>,
}

/// A cell: measured, or why not.
pub type Cell = std::result::Result<Measured, String>;

/// Runs `script` (named `name` in messages) with `args` and returns the cells of
/// `batches` batches x `options` (in that order, by name); every cell says why when
/// there is no torch venv or the script fails.
pub fn run_script(
    (name, script): (&str, &str),
    args: &[String],
    batches: usize,
    options: &[&str],
) -> Result<Vec<Vec<Cell>>> {
    let unavailable = |why: String| vec![vec![Err(why); options.len()]; batches];
    let Some(python) = python() else {
        return Ok(unavailable(
            "no torch venv (scripts/setup.sh makes it)".into(),
        ));
    };
    let files = ScriptFiles::write(name, script)?;
    let output = Command::new(python)
        .arg(&files.script)
        .args(args)
        .output()?;
    if !output.status.success() {
        let error = String::from_utf8_lossy(&output.stderr);
        let last = error.lines().last().unwrap_or("no message");
        return Ok(unavailable(format!("benches/{name} failed: {last}")));
    }
    let mut cells = unavailable(format!("no line from benches/{name}"));
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let (batch, option, cell) = parse_line(line, options)
            .ok_or_else(|| format!("benches/{name}: unknown line {line:?}"))?;
        if let Some(row) = cells.get_mut(batch) {
            row[option] = cell;
        }
    }
    Ok(cells)
}

/// A line of a script: its batch, its option's index in `options`, its cell.
fn parse_line(line: &str, options: &[&str]) -> Option<(usize, usize, Cell)> {
    let fields: Vec<&str> = line.split('\t').collect();
    let batch = fields.first()?.parse::<usize>().ok()?;
    let option = options
        .iter()
        .position(|known| Some(known) == fields.get(1))?;
    if fields.get(2) == Some(&"unavailable") {
        let why = fields.get(3).unwrap_or(&"no reason given").to_string();
        return Some((batch, option, Err(why)));
    }
    let number = |index: usize| fields.get(index)?.parse::<f64>().ok();
    let timing = Timing {
        median: number(2)? / 1e3,
        low: number(3)? / 1e3,
        high: number(4)? / 1e3,
        samples: 0,
    };
    let peak = fields.get(6).and_then(|field| field.parse::<u64>().ok());
    Some((batch, option, Ok(Measured { timing, peak })))
}

/// The host's CPU as `/proc/cpuinfo` names it.
pub fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|name| name.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.
mod tests {
    use super::*;

    #[test]
    fn lines_become_cells() {
        let options = ["padded eager", "per-image loop eager"];
        let (batch, option, cell) =
            parse_line("2\tper-image loop eager\t87.5\t85\t88\t900\t1024", &options).unwrap();
        assert_eq!((batch, option), (2, 1));
        let measured = cell.unwrap();
        assert_eq!(measured.timing.median, 0.0875);
        assert_eq!(measured.peak, Some(1024));
        let (_, _, cell) = parse_line("0\tpadded eager\t1\t1\t1\t1\t-", &options).unwrap();
        assert_eq!(cell.unwrap().peak, None);
        let (_, option, cell) =
            parse_line("0\tpadded eager\tunavailable\tRuntimeError: no", &options).unwrap();
        assert_eq!((option, cell), (0, Err("RuntimeError: no".into())));
        assert!(parse_line("0\tpadded numpy\t1\t1\t1\t1", &options).is_none());
        assert!(parse_line("x\tpadded eager\t1\t1\t1\t1", &options).is_none());
        assert!(parse_line("0\tpadded eager\tfast", &options).is_none());
    }
}
