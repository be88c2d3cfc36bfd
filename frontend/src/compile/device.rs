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
use nestor_codegen::Storage;
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

/// How a device keeps a program's floats: bf16 buffers when every float the program
/// takes and returns is bf16 (a bf16 model's tensors are then read and written in
/// place, and its intermediates stored in bf16, as a GPU's bf16 model does), else f32.
fn storage_of(program: &nestor_passes::Program) -> Storage {
    use nestor_ir::DType;
    let mut boundary = program
        .slots
        .iter()
        .filter(|info| matches!(info.source, nestor_passes::Source::Input(_)))
        .map(|info| info.dtype)
        .chain(
            program
                .outputs
                .iter()
                .map(|output| program.info(output.slot()).dtype),
        )
        .filter(|dtype| dtype.is_float());
    let first = boundary.next();
    if first == Some(DType::BF16) && boundary.all(|dtype| dtype == DType::BF16) {
        Storage::Bf16
    } else {
        Storage::Compute
    }
}

impl RunDevice {
    /// The default of every compiled function: [`RunDevice::Inputs`], or the simulated
    /// GPU where `NESTOR_DEVICE=sim` says so (to run a program's or a whole test
    /// suite's compiled calls on the GPU's kernels without a GPU).
    pub fn from_env() -> Self {
        match std::env::var("NESTOR_DEVICE").as_deref() {
            Ok("sim") => RunDevice::Simulated(SimOptions::default()),
            _ => RunDevice::Inputs,
        }
    }
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
    /// The simulated GPU, and how it keeps floats.
    Simulated(SimDevice, Storage),
    /// A GPU, and how it keeps floats.
    Cuda(CudaDevice, Storage),
}

impl Runner {
    /// The device of `placement` for `executable`'s program.
    pub(super) fn new(placement: Placement, executable: &Executable) -> Result<Self> {
        let backend = |error: nestor_runtime::RuntimeError| NestedError::Compile {
            stage: "backend",
            reason: error.into(),
        };
        let on_device = !matches!(placement, Placement::Host);
        if on_device && executable.program().float == nestor_passes::FloatType::F64 {
            return Err(NestedError::compile(
                "device",
                CompileCause::Unsupported,
                "f64 programs run on the CPU only: GPU programs compute in f32 (f16 and bf16 \
                 tensors in f32 too); use f32 or bf16 tensors on the GPU",
            ));
        }
        // Per-element regions through libtorch (`per_element_fallback`) are the host's.
        let program = executable.program();
        let kernel_set = match placement {
            Placement::Simulated(options) => Some(options.gemms.kernel_set()),
            Placement::Cuda(_) => Some(nestor_runtime::Gemms::Blas.kernel_set()),
            Placement::Host => None,
        };
        if let Some(set) = kernel_set {
            let host_step = program.steps.iter().position(|step| {
                matches!(
                    step.placement(program, set),
                    nestor_passes::Placement::Backend | nestor_passes::Placement::Libtorch
                )
            });
            if let Some(step) = host_step {
                return Err(NestedError::compile(
                    "device",
                    CompileCause::Unsupported,
                    format!(
                        "step {step} is a per-element region run through libtorch \
                         (`per_element_fallback`), which runs on the CPU only"
                    ),
                ));
            }
        }
        Ok(match placement {
            Placement::Host => Runner::Host,
            Placement::Simulated(options) => {
                let options = SimOptions {
                    storage: storage_of(executable.program()),
                    ..options
                };
                Runner::Simulated(
                    SimDevice::with(executable, options).map_err(backend)?,
                    options.storage,
                )
            }
            Placement::Cuda(ordinal) => {
                let gpu = nestor_backend_cuda::Device::open(ordinal).map_err(device_error)?;
                let storage = storage_of(executable.program());
                Runner::Cuda(
                    CudaDevice::storing(gpu, executable, storage).map_err(backend)?,
                    storage,
                )
            }
        })
    }

    /// The kind of the float tensors a device run reads and writes in place (`None`
    /// on the host).
    pub(super) fn float_kind(&self) -> Option<Kind> {
        match self {
            Runner::Host => None,
            Runner::Simulated(_, storage) | Runner::Cuda(_, storage) => Some(match storage {
                Storage::Bf16 => Kind::BFloat16,
                Storage::Compute => Kind::Float,
            }),
        }
    }

    /// Whether the program runs on the host.
    pub(super) fn is_host(&self) -> bool {
        matches!(self, Runner::Host)
    }

    /// Runs `executable` on the device with `inputs` (tensors on the placement's
    /// device: floats of [`Self::float_kind`], i64 values on the CPU; or lengths): its
    /// outputs, and the tensors of the results written in place, by output.
    pub(super) fn run(
        &self,
        executable: &Executable,
        inputs: &[DeviceInput<'_>],
        stats: &Stats,
    ) -> Result<RunResults> {
        let kind = self.float_kind().unwrap_or(Kind::Float);
        match self {
            Runner::Host => Err(NestedError::compile(
                "device",
                CompileCause::Internal,
                "a host program run as a device's",
            )),
            Runner::Simulated(device, _) => {
                let mut adopted: Vec<nestor_sim::Adopted> = Vec::new();
                let adopt = |address: u64, bytes: u64| {
                    // A CPU tensor's memory, alive while the guard is (the guards are
                    // dropped after the run and its downloads).
                    let guard = unsafe { device.adopt(address, bytes) }.ok()?;
                    adopted.push(guard);
                    Some(())
                };
                run_on(
                    device,
                    executable,
                    inputs,
                    stats,
                    adopt,
                    (tch::Device::Cpu, kind),
                )
            }
            Runner::Cuda(device, _) => {
                let on = tch::Device::Cuda(device.device().ordinal());
                run_on(
                    device,
                    executable,
                    inputs,
                    stats,
                    |_, _| Some(()),
                    (on, kind),
                )
            }
        }
    }
}

/// A run's outputs, and the tensors the results were written into, by output.
pub(super) type RunResults = (Vec<RunOutput>, Vec<(usize, Tensor)>);

/// An input of a device run.
pub(super) enum DeviceInput<'a> {
    Lengths(&'a [i64]),
    /// A contiguous tensor of f32 values on the run's device, or of i64 values on the
    /// CPU.
    Tensor(&'a Tensor),
}

/// Runs `executable` on `device`: every float input in place where `share` accepts its
/// memory (the simulated GPU adopts a CPU tensor's; a GPU's tensors are its own), else
/// uploaded; results into new tensors of `kind` on `on` (shared with the device the
/// same way).
fn run_on<D: KernelDevice>(
    device: &D,
    executable: &Executable,
    inputs: &[DeviceInput<'_>],
    stats: &Stats,
    mut share: impl FnMut(u64, u64) -> Option<()>,
    (on, kind): (tch::Device, Kind),
) -> Result<RunResults> {
    // The f32 values of the float inputs whose memory is not shared (a tensor given
    // twice), uploaded instead.
    let mut uploaded = Vec::with_capacity(inputs.len());
    for input in inputs {
        uploaded.push(match input {
            DeviceInput::Tensor(tensor) if tensor.kind() != Kind::Int64 => {
                let bytes = tensor_bytes(tensor);
                match share(tensor.data_ptr() as u64, bytes) {
                    Some(()) => None,
                    None => Some(
                        tensor
                            .f_to_kind(Kind::Float)?
                            .f_to_device(tch::Device::Cpu)?,
                    ),
                }
            }
            _ => None,
        });
    }
    let mut data = Vec::with_capacity(inputs.len());
    for (input, upload) in inputs.iter().zip(&uploaded) {
        data.push(match (input, upload) {
            (DeviceInput::Lengths(lengths), _) => InputData::I64(lengths),
            (DeviceInput::Tensor(tensor), None) if tensor.kind() == Kind::Int64 => {
                InputData::I64(super::slice_of(tensor, super::numel(tensor)).unwrap_or(&[]))
            }
            (DeviceInput::Tensor(tensor), None) => InputData::OnDevice {
                address: tensor.data_ptr() as u64,
                len: super::numel(tensor),
            },
            (_, Some(values)) => {
                InputData::F32(super::slice_of(values, super::numel(values)).unwrap_or(&[]))
            }
        });
    }
    let mut sink = TensorSink {
        on: (on, kind),
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

/// The bytes of a contiguous tensor's values.
fn tensor_bytes(tensor: &Tensor) -> u64 {
    (super::numel(tensor) * tensor.kind().elt_size_in_bytes()) as u64
}

/// New tensors on a device that a device run writes its results into.
struct TensorSink<'s, S> {
    /// The device and kind of the tensors.
    on: (tch::Device, Kind),
    /// The tensors given, with the output each is for, in output order.
    tensors: Vec<(usize, Tensor)>,
    /// Makes a tensor's memory the device's.
    share: &'s mut S,
}

// SAFETY: every address is the memory of a new contiguous tensor of `shape` on the run's
// device, of the device's float kind (made the simulated device's own by `share`), kept
// in `tensors` past the run's work.
unsafe impl<S: FnMut(u64, u64) -> Option<()>> DeviceSink for TensorSink<'_, S> {
    fn buffer(&mut self, index: usize, shape: &[i64]) -> Option<u64> {
        let (on, kind) = self.on;
        let tensor = Tensor::f_empty(shape, (kind, on)).ok()?;
        let address = tensor.data_ptr() as u64;
        (self.share)(address, tensor_bytes(&tensor))?;
        self.tensors.push((index, tensor));
        Some(address)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(text: &str) -> nestor_passes::Program {
        let graph = nestor_ir::parse(text).expect("a graph");
        nestor_passes::lower(&graph).expect("a program")
    }

    #[test]
    fn bf16_programs_keep_bf16_buffers_and_others_f32() {
        let bf16 = program(
            r#"graph @g {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<bf16>[B; %0, 4]
  %2 = tanh(%1) : ragged<bf16>[B; %0, 4]
  %3 = gt(%1, %2) : ragged<bool>[B; %0, 4]
  return %2, %3
}"#,
        );
        assert_eq!(storage_of(&bf16), Storage::Bf16);
        let mixed = program(
            r#"graph @g {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<bf16>[B; %0, 4]
  %2 = input {name = "w"} : f32[4]
  %3 = mul(%1, %2) : ragged<f32>[B; %0, 4]
  return %3
}"#,
        );
        assert_eq!(storage_of(&mixed), Storage::Compute);
    }
}
