//! Filetests: every `tests/filetests/*.nir` is one test, run through `nestor-opt` as its
//! own comment lines say (in the spirit of LLVM's lit and cranelift's filetests):
//!
//! ```text
//! // run: nestor-opt %s --passes dce,cse      (one or more; %s is the file)
//! // check: optimize @ffn: kernels 5 -> 3     (in order, each a substring of a line)
//! // check-not: gelu(                          (in no line of the output)
//! // exit: 1                                   (the expected exit status, default 0)
//! ```
//!
//! The output of a file is each run's stdout then stderr (run from `tests/filetests/`,
//! so messages name the file alone). With `check:` lines the output must contain them;
//! without, it must equal `<file stem>.out` beside it, which `NESTOR_BLESS=1` writes.
//! Optimizer times are printed as `<time> ms` so that blessed outputs are stable.
//! Adding a regression case is adding one file: `cargo test --test filetests -- <name>`.

use std::path::{Path, PathBuf};
use std::process::Command;

use libtest_mimic::{Arguments, Failed, Trial};

/// What a file's comment lines ask for.
#[derive(Default)]
struct Directives {
    runs: Vec<String>,
    checks: Vec<String>,
    check_nots: Vec<String>,
    exit: i32,
}

fn directives(text: &str) -> Result<Directives, Failed> {
    let mut found = Directives::default();
    for line in text.lines() {
        let Some(comment) = line.trim_start().strip_prefix("//") else {
            continue;
        };
        let comment = comment.trim();
        if let Some(run) = comment.strip_prefix("run:") {
            found.runs.push(run.trim().to_owned());
        } else if let Some(check) = comment.strip_prefix("check:") {
            found.checks.push(check.trim().to_owned());
        } else if let Some(check) = comment.strip_prefix("check-not:") {
            found.check_nots.push(check.trim().to_owned());
        } else if let Some(exit) = comment.strip_prefix("exit:") {
            found.exit = exit
                .trim()
                .parse()
                .map_err(|_| format!("`// exit:` needs a number, got `{}`", exit.trim()))?;
        }
    }
    if found.runs.is_empty() {
        return Err("no `// run: nestor-opt %s ...` line".into());
    }
    Ok(found)
}

/// Replaces the number before each ` ms` (the optimizer's phase times) by `<time>`.
fn without_times(output: &str) -> String {
    output
        .split_inclusive('\n')
        .map(|line| {
            let Some(end) = line.find(" ms;") else {
                return line.to_owned();
            };
            let start = line[..end]
                .rfind(|c: char| !(c.is_ascii_digit() || c == '.'))
                .map_or(0, |index| index + 1);
            format!("{}<time>{}", &line[..start], &line[end..])
        })
        .collect()
}

/// Runs the file's run lines and returns their combined output.
fn output_of(dir: &Path, file: &str, found: &Directives) -> Result<String, Failed> {
    let mut output = String::new();
    for run in &found.runs {
        let mut words = run.split_whitespace();
        if words.next() != Some("nestor-opt") {
            return Err(format!("a run line starts with `nestor-opt`: `{run}`").into());
        }
        let args: Vec<&str> = words
            .map(|word| if word == "%s" { file } else { word })
            .collect();
        let result = Command::new(env!("CARGO_BIN_EXE_nestor-opt"))
            .args(&args)
            .current_dir(dir)
            .output()
            .map_err(|error| format!("cannot run nestor-opt: {error}"))?;
        output.push_str(&String::from_utf8_lossy(&result.stdout));
        output.push_str(&String::from_utf8_lossy(&result.stderr));
        let status = result.status.code();
        if status != Some(found.exit) {
            return Err(format!(
                "`{run}` exited with {status:?}, expected {}; output:\n{output}",
                found.exit
            )
            .into());
        }
    }
    Ok(without_times(&output))
}

/// FileCheck-like: each check in order in a later line than the previous one.
fn check(output: &str, found: &Directives) -> Result<(), Failed> {
    let lines: Vec<&str> = output.lines().collect();
    let mut next = 0;
    for check in &found.checks {
        let Some(at) = lines[next..]
            .iter()
            .position(|line| line.contains(check.as_str()))
        else {
            return Err(format!(
                "check `{check}` not found after line {next} of the output:\n{output}"
            )
            .into());
        };
        next += at + 1;
    }
    for check in &found.check_nots {
        if let Some(line) = lines.iter().find(|line| line.contains(check.as_str())) {
            return Err(format!("check-not `{check}` found: `{line}`\noutput:\n{output}").into());
        }
    }
    Ok(())
}

fn run_file(path: &Path) -> Result<(), Failed> {
    let text = std::fs::read_to_string(path).map_err(|error| error.to_string())?;
    let found = directives(&text)?;
    let dir = path.parent().ok_or("a file has a folder")?;
    let file = path
        .file_name()
        .and_then(|name| name.to_str())
        .ok_or("a file name in UTF-8")?;
    let output = output_of(dir, file, &found)?;
    if !found.checks.is_empty() || !found.check_nots.is_empty() {
        return check(&output, &found);
    }
    let expected_path = path.with_extension("out");
    if std::env::var_os("NESTOR_BLESS").is_some() {
        return std::fs::write(&expected_path, &output).map_err(|error| error.to_string().into());
    }
    let expected = std::fs::read_to_string(&expected_path).map_err(|_| {
        format!(
            "{} is missing: add `// check:` lines or bless it with NESTOR_BLESS=1",
            expected_path.display()
        )
    })?;
    if output != expected {
        return Err(format!(
            "the output differs from {} (NESTOR_BLESS=1 re-blesses if intended):\n{output}",
            expected_path.display()
        )
        .into());
    }
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    // Cargo sets the variable when it runs the test; the compile-time value can name
    // another clone that built this binary in the shared target folder.
    let root = std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    let dir = root.join("tests/filetests");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("cannot list {}: {error}", dir.display()))
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.extension().is_some_and(|extension| extension == "nir"))
        .collect();
    files.sort();
    let trials = files
        .into_iter()
        .map(|path| {
            let name = path
                .file_stem()
                .map_or_else(String::new, |stem| stem.to_string_lossy().into_owned());
            Trial::test(name, move || run_file(&path))
        })
        .collect();
    libtest_mimic::run(&args, trials).exit();
}
