//! NVIDIA's PTX assembler, run on generated PTX: it must accept every kernel, and its
//! verbose report gives each kernel's registers and spills.

use std::path::PathBuf;
use std::process::Command;

use crate::{Arch, CudaError};

/// What ptxas reported for one kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelReport {
    /// The kernel entry.
    pub name: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes stored to local memory because registers ran out.
    pub spill_stores: u32,
    /// Bytes loaded back.
    pub spill_loads: u32,
}

/// Where ptxas is: `NESTOR_PTXAS`, else the one triton ships in the torch venv
/// (`$LIBTORCH/../triton/backends/nvidia/bin/ptxas`).
pub fn ptxas_path() -> Result<PathBuf, CudaError> {
    crate::venv_file("NESTOR_PTXAS", "bin/ptxas").map_err(CudaError::Ptxas)
}

/// Assembles `ptx` for `arch` (into nothing) and returns ptxas's report of every kernel;
/// a rejected PTX is an error with ptxas's messages.
pub fn assemble(ptx: &str, arch: Arch) -> Result<Vec<KernelReport>, CudaError> {
    let ptxas = ptxas_path()?;
    let file = std::env::temp_dir().join(format!(
        "nestor-{}-{:?}-{}.ptx",
        std::process::id(),
        std::thread::current().id(),
        arch.name()
    ));
    std::fs::write(&file, ptx)
        .map_err(|error| CudaError::Ptxas(format!("cannot write {}: {error}", file.display())))?;
    let output = Command::new(&ptxas)
        .arg(format!("-arch={}", arch.name()))
        .args(["-v", "-o", "/dev/null"])
        .arg(&file)
        .output();
    let _ = std::fs::remove_file(&file);
    let output = output
        .map_err(|error| CudaError::Ptxas(format!("cannot run {}: {error}", ptxas.display())))?;
    let messages = String::from_utf8_lossy(&output.stderr).into_owned()
        + &String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        return Err(CudaError::Ptxas(format!(
            "{} rejected the PTX for {}:\n{messages}",
            ptxas.display(),
            arch.name()
        )));
    }
    Ok(parse_report(&messages))
}

/// The kernels of ptxas's `-v` output:
///
/// ```text
/// ptxas info    : Compiling entry function 'step0' for 'sm_90'
/// ptxas info    : Function properties for step0
///     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
/// ptxas info    : Used 12 registers, used 0 barriers, 372 bytes cmem[0]
/// ```
pub fn parse_report(messages: &str) -> Vec<KernelReport> {
    let mut kernels: Vec<KernelReport> = Vec::new();
    for line in messages.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_owned();
            kernels.push(KernelReport {
                name,
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
            });
        } else if let Some(kernel) = kernels.last_mut() {
            if let Some(count) = number_before(line, " registers") {
                kernel.registers = count;
            }
            if let Some(count) = number_before(line, " bytes spill stores") {
                kernel.spill_stores = count;
            }
            if let Some(count) = number_before(line, " bytes spill loads") {
                kernel.spill_loads = count;
            }
        }
    }
    kernels
}

/// The number just before `marker` in `line`.
fn number_before(line: &str, marker: &str) -> Option<u32> {
    let end = line.find(marker)?;
    let start = line[..end]
        .rfind(|c: char| !c.is_ascii_digit())
        .map_or(0, |index| index + 1);
    line[start..end].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_registers_and_spills_of_each_kernel() {
        let messages = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'step0' for 'sm_90'
ptxas info    : Function properties for step0
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 12 registers, used 0 barriers, 372 bytes cmem[0]
ptxas info    : Compiling entry function 'step3' for 'sm_90'
ptxas info    : Function properties for step3
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 0 barriers, 380 bytes cmem[0]
";
        let report = parse_report(messages);
        assert_eq!(
            report,
            [
                KernelReport {
                    name: "step0".into(),
                    registers: 12,
                    spill_stores: 8,
                    spill_loads: 4
                },
                KernelReport {
                    name: "step3".into(),
                    registers: 40,
                    spill_stores: 0,
                    spill_loads: 0
                },
            ]
        );
    }
}
