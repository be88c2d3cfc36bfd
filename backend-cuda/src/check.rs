//! The GPU check's cases: one kernel step each, with its PTX for every [`Arch`], its
//! buffers, its range and the output the CPU backend computed for them. The tests write
//! them on a machine with Rust (`tests/gpu_check.rs`); `gpu-check` reads them on a GPU
//! machine, runs each kernel there and compares ([`compare`]).
//!
//! A case is a folder: `meta.txt` (`kernel NAME`, `range START END`, `output INDEX`,
//! `tolerance X`, one `buffer f32|i64 LENGTH` line per buffer in argument order),
//! `buffer<i>.bin` (little-endian values), `expected.bin` and `<arch>.ptx`.

use std::path::Path;

use crate::{Arch, CudaError, Device};

/// A kernel's buffer.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    /// Floats (the program's values).
    F32(Vec<f32>),
    /// Integers (offsets, ids, row-to-element maps).
    I64(Vec<i64>),
}

/// One kernel to run and check.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    /// The kernel entry in the PTX.
    pub kernel: String,
    /// PTX per architecture.
    pub ptx: Vec<(Arch, String)>,
    /// The kernel's buffers, in argument order.
    pub buffers: Vec<Buffer>,
    /// Which buffer is the output.
    pub output: usize,
    /// The range the kernel covers.
    pub range: (i64, i64),
    /// The output the CPU backend computed.
    pub expected: Vec<f32>,
    /// Largest `|actual - expected| / (1 + |expected|)` accepted.
    pub tolerance: f64,
}

fn io(path: &Path, error: impl std::fmt::Display) -> CudaError {
    CudaError::Check(format!("{}: {error}", path.display()))
}

fn write_floats(path: &Path, values: &[f32]) -> Result<(), CudaError> {
    let bytes: Vec<u8> = values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect();
    std::fs::write(path, bytes).map_err(|error| io(path, error))
}

/// `length` little-endian values of `N` bytes from the file `path`.
fn read_values<T, const N: usize>(
    path: &Path,
    length: usize,
    from_bytes: fn([u8; N]) -> T,
) -> Result<Vec<T>, CudaError> {
    let bytes = std::fs::read(path).map_err(|error| io(path, error))?;
    if bytes.len() != length * N {
        return Err(io(
            path,
            format!("{} bytes, expected {}", bytes.len(), length * N),
        ));
    }
    Ok(bytes
        .chunks_exact(N)
        .map(|chunk| {
            let mut word = [0u8; N];
            word.copy_from_slice(chunk);
            from_bytes(word)
        })
        .collect())
}

fn read_floats(path: &Path, length: usize) -> Result<Vec<f32>, CudaError> {
    read_values(path, length, f32::from_le_bytes)
}

impl Case {
    /// Writes the case into the folder `dir` (created).
    pub fn write(&self, dir: &Path) -> Result<(), CudaError> {
        std::fs::create_dir_all(dir).map_err(|error| io(dir, error))?;
        let mut meta = format!(
            "kernel {}\nrange {} {}\noutput {}\ntolerance {:e}\n",
            self.kernel, self.range.0, self.range.1, self.output, self.tolerance
        );
        for (index, buffer) in self.buffers.iter().enumerate() {
            let path = dir.join(format!("buffer{index}.bin"));
            match buffer {
                Buffer::F32(values) => {
                    meta.push_str(&format!("buffer f32 {}\n", values.len()));
                    write_floats(&path, values)?;
                }
                Buffer::I64(values) => {
                    meta.push_str(&format!("buffer i64 {}\n", values.len()));
                    let bytes: Vec<u8> = values
                        .iter()
                        .flat_map(|value| value.to_le_bytes())
                        .collect();
                    std::fs::write(&path, bytes).map_err(|error| io(&path, error))?;
                }
            }
        }
        let path = dir.join("meta.txt");
        std::fs::write(&path, meta).map_err(|error| io(&path, error))?;
        write_floats(&dir.join("expected.bin"), &self.expected)?;
        for (arch, ptx) in &self.ptx {
            let path = dir.join(format!("{}.ptx", arch.name()));
            std::fs::write(&path, ptx).map_err(|error| io(&path, error))?;
        }
        Ok(())
    }

    /// Reads the case of the folder `dir`.
    pub fn read(dir: &Path) -> Result<Case, CudaError> {
        let path = dir.join("meta.txt");
        let meta = std::fs::read_to_string(&path).map_err(|error| io(&path, error))?;
        let bad = |line: &str| io(&path, format!("bad line `{line}`"));
        let mut case = Case {
            kernel: String::new(),
            ptx: Vec::new(),
            buffers: Vec::new(),
            output: 0,
            range: (0, 0),
            expected: Vec::new(),
            tolerance: 0.0,
        };
        for line in meta.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words[..] {
                ["kernel", name] => case.kernel = name.to_owned(),
                ["range", start, end] => {
                    case.range = (
                        start.parse().map_err(|_| bad(line))?,
                        end.parse().map_err(|_| bad(line))?,
                    )
                }
                ["output", index] => case.output = index.parse().map_err(|_| bad(line))?,
                ["tolerance", value] => case.tolerance = value.parse().map_err(|_| bad(line))?,
                ["buffer", kind, length] => {
                    let length: usize = length.parse().map_err(|_| bad(line))?;
                    let file = dir.join(format!("buffer{}.bin", case.buffers.len()));
                    case.buffers.push(match kind {
                        "f32" => Buffer::F32(read_floats(&file, length)?),
                        "i64" => Buffer::I64(read_values(&file, length, i64::from_le_bytes)?),
                        _ => return Err(bad(line)),
                    });
                }
                _ => return Err(bad(line)),
            }
        }
        let expected_length = match case.buffers.get(case.output) {
            Some(Buffer::F32(values)) => values.len(),
            _ => return Err(io(&path, "the output is not an f32 buffer")),
        };
        case.expected = read_floats(&dir.join("expected.bin"), expected_length)?;
        for arch in Arch::ALL {
            let file = dir.join(format!("{}.ptx", arch.name()));
            if let Ok(ptx) = std::fs::read_to_string(&file) {
                case.ptx.push((arch, ptx));
            }
        }
        Ok(case)
    }

    /// Runs the case's kernel on `device` and returns its output buffer.
    pub fn run_on(&self, device: &Device) -> Result<Vec<f32>, CudaError> {
        let (arch, ptx) = self
            .ptx
            .iter()
            .find(|(arch, _)| *arch == device.arch())
            .or_else(|| self.ptx.iter().find(|(arch, _)| *arch == Arch::Sm80))
            .ok_or_else(|| CudaError::Check(format!("no PTX for {}", device.arch().name())))?;
        let module = device.load(&crate::PtxModule {
            arch: *arch,
            ptx: ptx.clone(),
            kernels: vec![Some(self.kernel.clone())],
            // A thread per task: grid-stride loops cover the range with any grid (a row
            // kernel's warps then take several rows each).
            threads_per_task: vec![1],
        })?;
        let uploaded = self
            .buffers
            .iter()
            .map(|buffer| match buffer {
                Buffer::F32(values) => device.upload(values).map(Uploaded::F32),
                Buffer::I64(values) => device.upload(values).map(Uploaded::I64),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let addresses: Vec<u64> = uploaded
            .iter()
            .map(|buffer| match buffer {
                Uploaded::F32(buffer) => device.address(buffer),
                Uploaded::I64(buffer) => device.address(buffer),
            })
            .collect();
        let table = device.upload(&addresses)?;
        // SAFETY: the buffers are the case's, which the CPU backend ran the same kernel
        // on over the same range; they and the table live until the download, which
        // waits for the kernel.
        unsafe { device.launch(&module, 0, device.address(&table), self.range)? };
        match &uploaded[self.output] {
            Uploaded::F32(output) => device.download(output),
            Uploaded::I64(_) => Err(CudaError::Check("the output is not an f32 buffer".into())),
        }
    }
}

/// A case's buffer on the device.
enum Uploaded {
    F32(cudarc::driver::CudaSlice<f32>),
    I64(cudarc::driver::CudaSlice<i64>),
}

/// Whether `actual` is `expected` within `tolerance` (relative to `1 + |expected|`),
/// with NaN exactly where expected has NaN and equal infinities; returns the largest
/// error, or the first position that differs.
pub fn compare(actual: &[f32], expected: &[f32], tolerance: f64) -> Result<f64, String> {
    if actual.len() != expected.len() {
        return Err(format!(
            "{} values, expected {}",
            actual.len(),
            expected.len()
        ));
    }
    let mut worst = 0.0f64;
    for (index, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        let (a, e) = (f64::from(a), f64::from(e));
        let error = if a.is_nan() || e.is_nan() || a.is_infinite() || e.is_infinite() {
            if a.is_nan() == e.is_nan() && (a == e || a.is_nan()) {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            (a - e).abs() / (1.0 + e.abs())
        };
        if error > tolerance {
            return Err(format!("value {index}: {a} vs expected {e}"));
        }
        worst = worst.max(error);
    }
    Ok(worst)
}
