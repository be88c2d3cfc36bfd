//! Where a compiled function's programs run: the host CPU, a CUDA GPU (where the inputs
//! are), or the simulated GPU (`nestor-sim`: the GPU's kernels on the CPU, for tests and
//! for checking GPU code without a GPU).
//!
//! On a device, float inputs are read where they are (a CUDA tensor's memory, or on the
//! simulated GPU a CPU tensor's, adopted as device memory) and results are written into
//! tensors allocated on that device: nothing is copied in or out but the run's one upload
//! of lengths, indices and argument tables. On a GPU the work is queued on the device's
//! default (legacy) stream, the one libtorch queues its work on unless a stream is set,
//! so libtorch's later work is ordered after it without a synchronization.

use nestor_backend_cuda::CudaDevice;
use nestor_runtime::{DeviceSink, Executable, InputData, KernelDevice, RunOutput, Stats};
use nestor_sim::{SimDevice, SimOptions};
use tch::{Kind, Tensor};

use crate::error::{CompileCause, CompileReason};
use crate::{NestedError, Result};

/// Where a compiled function runs its programs ([`super::Compiled::on_device`]).
#[derive(Clone, Copy, Debug, Default)]
pub enum RunDevice {
    /// Where the inputs are (the default): CPU tensors on the host CPU, tensors on CUDA
    /// device `n` on that GPU.
    #[default]
    Inputs,
    /// The simulated CUDA device: CPU tensors in and out, the GPU's kernels run on the
    /// CPU with a GPU's semantics (threads as fibers, checked and poisoned memory). For
    /// tests and for checking the GPU path without a GPU; far slower than the CPU.
    Simulated(SimOptions),
    /// CUDA device `n`: every input must be on it. Without an NVIDIA driver or that
    /// device, a call is a typed error that says which is missing.
    Cuda(usize),
}

/// Where the program of one structure runs.
#[derive(Clone, Copy, Debug)]
pub(super) enum Placement {
    Host,
    Simulated(SimOptions),
    Cuda(usize),
}

impl Placement {
    /// Where `choice` runs inputs on `device`.
    pub(super) fn of(choice: RunDevice, device: tch::Device) -> Result<Self> {
        match (choice, device) {
            (RunDevice::Inputs, tch::Device::Cpu) => Ok(Placement::Host),
            (RunDevice::Inputs, tch::Device::Cuda(ordinal)) => Ok(Placement::Cuda(ordinal)),
            (RunDevice::Simulated(options), tch::Device::Cpu) => Ok(Placement::Simulated(options)),
            (RunDevice::Cuda(ordinal), tch::Device::Cuda(on)) if on == ordinal => {
                Ok(Placement::Cuda(ordinal))
            }
            (RunDevice::Cuda(ordinal), _) => {
                // Without a driver or the device, that is the error.
                nestor_backend_cuda::Device::open(ordinal).map_err(device_error)?;
                Err(NestedError::compile(
                    "device",
                    CompileCause::Device,
                    format!(
                        "the function runs on cuda:{ordinal} (RunDevice::Cuda), an input is on \
                         {device:?}: move the inputs and parameters there"
                    ),
                ))
            }
            (choice, device) => Err(NestedError::compile(
                "device",
                CompileCause::Device,
                format!(
                    "compiled programs run on the CPU, a CUDA GPU or the simulated GPU; the \
                     inputs are on {device:?} ({choice:?})"
                ),
            )),
        }
    }

    /// The device of the tensors a run of this placement reads and returns.
    pub(super) fn tensors(self) -> tch::Device {
        match self {
            Placement::Host | Placement::Simulated(_) => tch::Device::Cpu,
            Placement::Cuda(ordinal) => tch::Device::Cuda(ordinal),
        }
    }

    /// The placement as a word of the structure key.
    pub(super) fn key_word(self) -> u64 {
        match self {
            Placement::Host => 0,
            Placement::Simulated(_) => 1,
            Placement::Cuda(ordinal) => 2 + ordinal as u64,
        }
    }
}

/// A device error of the call.
fn device_error(error: impl std::error::Error + Send + Sync + 'static) -> NestedError {
    NestedError::Compile {
        stage: "device",
        reason: CompileReason::of(CompileCause::Device, error),
    }
}

/// The device a program runs on, its kernels loaded there.
pub(super) enum Runner {
    /// The host CPU (the executable's own kernels).
    Host,
    Simulated(SimDevice),
    Cuda(CudaDevice),
}

impl Runner {
    /// The device of `placement` for `executable`'s program.
    pub(super) fn new(placement: Placement, executable: &Executable) -> Result<Self> {
        let backend = |error: nestor_runtime::RuntimeError| NestedError::Compile {
            stage: "backend",
            reason: error.into(),
        };
        Ok(match placement {
            Placement::Host => Runner::Host,
            Placement::Simulated(options) => {
                Runner::Simulated(SimDevice::with(executable, options).map_err(backend)?)
            }
            Placement::Cuda(ordinal) => {
                let gpu = nestor_backend_cuda::Device::open(ordinal).map_err(device_error)?;
                Runner::Cuda(CudaDevice::new(gpu, executable).map_err(backend)?)
            }
        })
    }

    /// Whether the program runs on the host.
    pub(super) fn is_host(&self) -> bool {
        matches!(self, Runner::Host)
    }

    /// Runs `executable` on the device with `inputs` (tensors on the placement's
    /// device: floats of the program's f32, i64 values on the CPU; or lengths): its
    /// outputs, and the tensors of the results written in place, by output.
    pub(super) fn run(
        &self,
        executable: &Executable,
        inputs: &[DeviceInput<'_>],
        stats: &Stats,
    ) -> Result<(Vec<RunOutput>, Vec<(usize, Tensor)>)> {
        match self {
            Runner::Host => Err(NestedError::compile(
                "device",
                CompileCause::Internal,
                "a host program run as a device's",
            )),
            Runner::Simulated(device) => {
                let mut adopted: Vec<nestor_sim::Adopted> = Vec::new();
                let adopt = |address: u64, bytes: u64| {
                    // A CPU tensor's memory, alive while the guard is (the guards are
                    // dropped after the run and its downloads).
                    let guard = unsafe { device.adopt(address, bytes) }.ok()?;
                    adopted.push(guard);
                    Some(())
                };
                run_on(device, executable, inputs, stats, adopt, tch::Device::Cpu)
            }
            Runner::Cuda(device) => {
                let ordinal = device.device().ordinal();
                run_on(
                    device,
                    executable,
                    inputs,
                    stats,
                    |_, _| Some(()),
                    tch::Device::Cuda(ordinal),
                )
            }
        }
    }
}

/// An input of a device run.
pub(super) enum DeviceInput<'a> {
    Lengths(&'a [i64]),
    /// A contiguous tensor of f32 values on the run's device, or of i64 values on the
    /// CPU.
    Tensor(&'a Tensor),
}

/// Runs `executable` on `device`: every float input in place where `share` accepts its
/// memory (the simulated GPU adopts a CPU tensor's; a GPU's tensors are its own), else
/// uploaded; results into new f32 tensors on `on` (shared with the device the same way).
fn run_on<D: KernelDevice>(
    device: &D,
    executable: &Executable,
    inputs: &[DeviceInput<'_>],
    stats: &Stats,
    mut share: impl FnMut(u64, u64) -> Option<()>,
    on: tch::Device,
) -> Result<(Vec<RunOutput>, Vec<(usize, Tensor)>)> {
    let mut data = Vec::with_capacity(inputs.len());
    for input in inputs {
        data.push(match input {
            DeviceInput::Lengths(lengths) => InputData::I64(lengths),
            DeviceInput::Tensor(tensor) => {
                let elements = super::numel(tensor);
                let address = tensor.data_ptr() as u64;
                if tensor.kind() == Kind::Int64 {
                    super::slice_of::<i64>(tensor, elements)
                        .map_or(InputData::I64(&[]), InputData::I64)
                } else if share(address, 4 * elements as u64).is_some() {
                    InputData::OnDevice {
                        address,
                        len: elements,
                    }
                } else {
                    super::slice_of::<f32>(tensor, elements)
                        .map_or(InputData::F32(&[]), InputData::F32)
                }
            }
        });
    }
    let mut sink = TensorSink {
        on,
        tensors: Vec::with_capacity(executable.program().outputs.len()),
        share: &mut share,
    };
    let results = executable
        .run_device_into(device, &data, stats, Some(&mut sink))
        .and_then(|results| results.download(device, stats))
        .map_err(|error| NestedError::Compile {
            stage: "runtime",
            reason: error.into(),
        })?;
    Ok((results, sink.tensors))
}

/// New f32 tensors on a device that a device run writes its results into.
struct TensorSink<'s, S> {
    on: tch::Device,
    /// The tensors given, with the output each is for, in output order.
    tensors: Vec<(usize, Tensor)>,
    /// Makes a tensor's memory the device's.
    share: &'s mut S,
}

// SAFETY: every address is the memory of a new contiguous f32 tensor of `shape` on the
// run's device (made the simulated device's own by `share`), kept in `tensors` past the
// run's work.
unsafe impl<S: FnMut(u64, u64) -> Option<()>> DeviceSink for TensorSink<'_, S> {
    fn buffer(&mut self, index: usize, shape: &[i64]) -> Option<u64> {
        let tensor = Tensor::f_empty(shape, (Kind::Float, self.on)).ok()?;
        let address = tensor.data_ptr() as u64;
        (self.share)(address, 4 * super::numel(&tensor) as u64)?;
        self.tensors.push((index, tensor));
        Some(address)
    }
}
