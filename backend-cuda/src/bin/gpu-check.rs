//! Runs the GPU check's cases on a GPU (`scripts/gpu-check.sh run` on the GPU machine):
//! every case's kernel from its PTX, on its buffers, compared with the output the CPU
//! backend computed for them. Needs no Rust, LLVM or libtorch there: only libcuda.
//!
//! ```sh
//! gpu-check CASES_DIR OUT_DIR
//! ```
//!
//! Writes `OUT_DIR/gpu-check.txt` (the device, then `ok` / `FAIL` per case with its
//! largest relative error); exit status 0 when every case passes, 1 when one fails, 2
//! when there is no GPU or the cases cannot be read.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use nestor_backend_cuda::check::{compare, Case};
use nestor_backend_cuda::Device;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [cases, out] = &args[..] else {
        eprintln!("usage: gpu-check CASES_DIR OUT_DIR");
        return ExitCode::from(2);
    };
    match run(Path::new(cases), Path::new(out)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(message) => {
            eprintln!("gpu-check: {message}");
            ExitCode::from(2)
        }
    }
}

/// Runs every case; true when all pass.
fn run(cases: &Path, out: &Path) -> Result<bool, String> {
    let device = Device::open(0).map_err(|error| error.to_string())?;
    let mut folders: Vec<PathBuf> = std::fs::read_dir(cases)
        .map_err(|error| format!("{}: {error}", cases.display()))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.join("meta.txt").exists())
        .collect();
    folders.sort();
    let mut report = format!("device {} ({})\n", device.name(), device.arch().name());
    let mut passed = 0;
    for folder in &folders {
        let name = folder
            .file_name()
            .map_or_else(String::new, |name| name.to_string_lossy().into_owned());
        let started = std::time::Instant::now();
        let outcome = Case::read(folder)
            .map_err(|error| error.to_string())
            .and_then(|case| {
                let actual = case.run_on(&device).map_err(|error| error.to_string())?;
                compare(&actual, &case.expected, case.tolerance)
            });
        let line = match outcome {
            Ok(worst) => {
                passed += 1;
                format!(
                    "ok   {name}: largest relative error {worst:.2e}, {:.2} ms\n",
                    started.elapsed().as_secs_f64() * 1e3
                )
            }
            Err(why) => format!("FAIL {name}: {why}\n"),
        };
        print!("{line}");
        report.push_str(&line);
    }
    report.push_str(&format!("{passed} of {} cases passed\n", folders.len()));
    println!("{passed} of {} cases passed", folders.len());
    std::fs::create_dir_all(out).map_err(|error| format!("{}: {error}", out.display()))?;
    let path = out.join("gpu-check.txt");
    std::fs::write(&path, report).map_err(|error| format!("{}: {error}", path.display()))?;
    Ok(passed == folders.len() && !folders.is_empty())
}
