//! [`SimDevice`]: the simulated GPU as the runtime's kernel device.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use nestor_backend_cpu::{compile_for, CpuKernels};
use nestor_codegen::{
    gpu_grid, gpu_shared_bytes, gpu_threads_per_task, GpuGrid, Storage, Target, GPU_BLOCK_THREADS,
};
use nestor_runtime::{from_bf16, to_bf16, BlasCall, Executable, Gemms, KernelDevice, RuntimeError};

use crate::block::Call;
use crate::launch::{run_grid, Launch, Limits};
use crate::memory::{Adopted, Registry, SimBuffer};
use crate::SimError;

/// How the simulated device launches kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Geometry {
    /// As the CUDA device does ([`nestor_codegen::gpu_grid`]).
    Gpu,
    /// Every launch this grid, whatever its range (one block, a grid smaller than the
    /// work, a block size the kernels do not expect).
    Fixed(GpuGrid),
}

/// A simulated device's settings.
#[derive(Clone, Copy, Debug)]
pub struct SimOptions {
    /// How floats are kept in buffers.
    pub storage: Storage,
    /// Where GEMM products are computed (on [`Gemms::Blas`], the cuBLAS calls a GPU
    /// makes, run by definition).
    pub gemms: Gemms,
    /// Launch geometry.
    pub geometry: Geometry,
    /// The architecture's limits every launch is checked against.
    pub limits: Limits,
    /// Draws the order of blocks and threads of every launch.
    pub seed: u64,
}

impl Default for SimOptions {
    fn default() -> Self {
        Self {
            storage: Storage::Compute,
            gemms: Gemms::Kernels,
            geometry: Geometry::Gpu,
            limits: Limits::SM_90,
            seed: 0x5EED,
        }
    }
}

/// What the device knows of a step's kernel.
struct StepKernel {
    /// `step3 (row)`, for reports.
    name: String,
    threads_per_task: u32,
    /// Bytes of shared memory a block uses.
    shared_bytes: u32,
    /// Argument 0 is the output, NaN before every launch.
    output_first: bool,
}

/// The simulated CUDA device: the program's GPU kernels (generated for
/// [`Target::Simulated`]: the NVPTX kernels' structure, their GPU instructions calls into
/// the simulator) run as GPU grids on the CPU, each thread a fiber; device memory in host
/// memory, NaN when allocated and every step's output NaN again before its launch, every
/// access checked against the live buffers; launches checked against the
/// architecture's limits; GEMM products as the cuBLAS calls a GPU makes. A bug a GPU
/// would hide (a missing rendezvous, an access out of bounds, a value never written)
/// is an error or a NaN here.
///
/// ```
/// use nestor_runtime::{InputData, KernelDevice, RunData, Stats};
/// use nestor_sim::SimDevice;
/// let graph = nestor_ir::parse(
///     r#"graph @g {
///   %0 = input {name = "x.lengths"} : lengths[B]
///   %1 = input {name = "x"} : ragged<f32>[B; %0, 40]
///   %2 = softmax(%1) {axis = -1} : ragged<f32>[B; %0, 40]
///   return %2
/// }"#,
/// )?;
/// let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph)?)?;
/// let device = SimDevice::new(&executable)?;
/// let (lengths, x) = ([1i64, 2], vec![0.5f32; 120]);
/// let inputs = [InputData::I64(&lengths), InputData::F32(&x)];
/// let outputs = executable.run_on_device(&device, &inputs, &Stats::default())?;
/// let RunData::F32(y) = &outputs[0].data else { panic!("f32") };
/// assert!(y.iter().all(|&value| (value - 1.0 / 40.0).abs() < 1e-7));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct SimDevice {
    kernels: CpuKernels,
    steps: Vec<StepKernel>,
    options: SimOptions,
    registry: Registry,
    spare: Mutex<Vec<SimBuffer>>,
    launches: AtomicU64,
    /// Bytes the kernels loaded and stored.
    traffic: [AtomicU64; 2],
    /// The step whose BLAS call ran last (its kernel then reads the product in place).
    blas_step: AtomicUsize,
}

impl SimDevice {
    /// The simulated device of `executable`'s program, with the default options.
    pub fn new(executable: &Executable) -> Result<Self, RuntimeError> {
        Self::with(executable, SimOptions::default())
    }

    /// The simulated device of `executable`'s program, as `options` say.
    pub fn with(executable: &Executable, options: SimOptions) -> Result<Self, RuntimeError> {
        let program = executable.program();
        let set = options.gemms.kernel_set();
        let kernels = compile_for(
            program,
            (Target::Simulated, set, options.storage),
            &crate::abi::symbols(),
        )?;
        let steps = program
            .steps
            .iter()
            .enumerate()
            .map(|(index, step)| {
                let placement = step.placement(program, set);
                let output_first = placement.kernel().is_some_and(|signature| {
                    signature
                        .params
                        .first()
                        .is_some_and(|param| param.role == nestor_passes::Role::Out)
                });
                StepKernel {
                    name: format!("step{index} ({})", step.name()),
                    threads_per_task: gpu_threads_per_task(program, step, options.storage),
                    shared_bytes: gpu_shared_bytes(step, program.float, options.storage),
                    output_first,
                }
            })
            .collect();
        Ok(Self {
            kernels,
            steps,
            options,
            registry: Registry::default(),
            spare: Mutex::default(),
            launches: AtomicU64::new(0),
            traffic: [AtomicU64::new(0), AtomicU64::new(0)],
            blas_step: AtomicUsize::new(usize::MAX),
        })
    }

    /// Makes the caller's memory at `address` (`bytes` bytes) a buffer of the device
    /// while the returned guard lives: kernels may read and write it as their own
    /// buffers (inputs given as [`nestor_runtime::InputData::OnDevice`], results written
    /// through a [`nestor_runtime::DeviceSink`]), as a GPU's kernels use a framework's
    /// tensors in place. An error if it overlaps a buffer of the device.
    ///
    /// # Safety
    /// The memory must be valid for reads and writes, and not be used otherwise while
    /// a launch may access it, for as long as the guard lives.
    pub unsafe fn adopt(&self, address: u64, bytes: u64) -> Result<Adopted, RuntimeError> {
        Ok(self.registry.adopt(address, bytes)?)
    }

    /// The bytes the device's kernels have loaded from and stored to its buffers (GEMM
    /// products on the simulated BLAS apart), over every launch so far.
    pub fn traffic(&self) -> crate::Traffic {
        crate::Traffic {
            loaded: self.traffic[0].load(Ordering::Relaxed),
            stored: self.traffic[1].load(Ordering::Relaxed),
        }
    }

    /// Bytes of a float in the device's buffers.
    fn float_bytes(&self) -> u64 {
        if self.options.storage == Storage::Bf16 {
            2
        } else {
            4
        }
    }

    /// Checks that `bytes` at `address` are a device buffer's.
    fn check_copy(&self, address: u64, bytes: u64) -> Result<(), SimError> {
        match self.registry.holding(address, bytes) {
            Some(_) => Ok(()),
            None => Err(SimError::Copy { address, bytes }),
        }
    }

    /// Fills the buffer holding `address` with NaN (all bits set).
    fn poison(&self, address: u64) {
        if let Some((start, bytes)) = self.registry.holding(address, 0) {
            // A live buffer of the device (its extents are what it allocated, whole
            // words), which no launch is running on.
            unsafe { std::ptr::write_bytes(start as *mut u8, 0xFF, bytes as usize) };
        }
    }
}

/// Checks that a copy of `bytes` fits `buffer`.
fn has_room(buffer: &SimBuffer, bytes: u64) -> Result<(), SimError> {
    if bytes > buffer.bytes() {
        return Err(SimError::Copy {
            address: buffer.address(),
            bytes,
        });
    }
    Ok(())
}

impl KernelDevice for SimDevice {
    type Buffer = SimBuffer;

    fn alloc_f32(&self, count: usize) -> Result<SimBuffer, RuntimeError> {
        let bytes = (count as u64)
            .checked_mul(self.float_bytes())
            .ok_or(SimError::Memory(u64::MAX))?;
        Ok(self.registry.alloc(bytes)?)
    }

    fn alloc_i64(&self, count: usize) -> Result<SimBuffer, RuntimeError> {
        let bytes = (count as u64)
            .checked_mul(8)
            .ok_or(SimError::Memory(u64::MAX))?;
        Ok(self.registry.alloc(bytes)?)
    }

    fn capacity_f32(&self, buffer: &SimBuffer) -> usize {
        (buffer.bytes() / self.float_bytes()) as usize
    }

    fn capacity_i64(&self, buffer: &SimBuffer) -> usize {
        (buffer.bytes() / 8) as usize
    }

    fn spare(&self) -> &Mutex<Vec<SimBuffer>> {
        &self.spare
    }

    fn write_f32(&self, buffer: &mut SimBuffer, values: &[f32]) -> Result<(), RuntimeError> {
        has_room(buffer, values.len() as u64 * self.float_bytes())?;
        let words = buffer.words_mut().as_mut_ptr();
        // The buffer holds `values.len()` values of the storage type (checked above).
        unsafe {
            if self.options.storage == Storage::Bf16 {
                let stored = words as *mut u16;
                for (index, &value) in values.iter().enumerate() {
                    *stored.add(index) = to_bf16(value);
                }
            } else {
                std::ptr::copy_nonoverlapping(values.as_ptr(), words as *mut f32, values.len());
            }
        }
        Ok(())
    }

    fn write_i64(&self, buffer: &mut SimBuffer, values: &[i64]) -> Result<(), RuntimeError> {
        has_room(buffer, values.len() as u64 * 8)?;
        for (word, &value) in buffer.words_mut().iter_mut().zip(values) {
            *word = value as u64;
        }
        Ok(())
    }

    unsafe fn download_f32(&self, address: u64, count: usize) -> Result<Vec<f32>, RuntimeError> {
        self.check_copy(address, count as u64 * self.float_bytes())?;
        // Checked to be a live buffer's values.
        Ok(unsafe {
            if self.options.storage == Storage::Bf16 {
                std::slice::from_raw_parts(address as *const u16, count)
                    .iter()
                    .map(|&bits| from_bf16(bits))
                    .collect()
            } else {
                std::slice::from_raw_parts(address as *const f32, count).to_vec()
            }
        })
    }

    unsafe fn download_i64(&self, address: u64, count: usize) -> Result<Vec<i64>, RuntimeError> {
        self.check_copy(address, count as u64 * 8)?;
        // Checked to be a live buffer's values.
        Ok(unsafe { std::slice::from_raw_parts(address as *const i64, count).to_vec() })
    }

    fn wait(&self) -> Result<(), RuntimeError> {
        // Kernels ran when they were launched.
        Ok(())
    }

    fn address(&self, buffer: &SimBuffer) -> u64 {
        buffer.address()
    }

    unsafe fn launch(
        &self,
        step: usize,
        table: u64,
        range: (i64, i64),
    ) -> Result<(), RuntimeError> {
        let (Some(kernel), Some(info)) = (self.kernels.kernel(step), self.steps.get(step)) else {
            return Err(SimError::NoKernel(step).into());
        };
        let after_blas = self.blas_step.swap(usize::MAX, Ordering::Relaxed) == step;
        if info.output_first && !after_blas {
            self.check_copy(table, 8)?;
            // The table's first entry, checked to be in a buffer.
            let output = unsafe { *(table as *const u64) };
            self.poison(output);
        }
        let grid = match self.options.geometry {
            Geometry::Gpu => match gpu_grid(info.threads_per_task, range) {
                Some(grid) => grid,
                None => return Ok(()),
            },
            Geometry::Fixed(grid) => {
                // A task of a whole block takes the block the kernel was made for.
                if info.threads_per_task == GPU_BLOCK_THREADS && grid.threads != GPU_BLOCK_THREADS {
                    return Err(SimError::Launch {
                        kernel: info.name.clone(),
                        blocks: u64::from(grid.blocks),
                        threads: u64::from(grid.threads),
                        shared: u64::from(info.shared_bytes),
                        why: format!("its tasks are blocks of {GPU_BLOCK_THREADS} threads"),
                    }
                    .into());
                }
                grid
            }
        };
        let launch = Launch {
            grid,
            shared_bytes: info.shared_bytes,
        };
        let seed = self.options.seed ^ self.launches.fetch_add(1, Ordering::Relaxed);
        let call = Call {
            kernel,
            table,
            range,
        };
        // The kernel is of the simulated target; the caller vouches for the table, the
        // buffers and the range.
        let traffic = unsafe {
            run_grid(
                &info.name,
                call,
                (launch, &self.options.limits),
                self.registry.snapshot(),
                seed,
            )
        }?;
        self.traffic[0].fetch_add(traffic.loaded, Ordering::Relaxed);
        self.traffic[1].fetch_add(traffic.stored, Ordering::Relaxed);
        Ok(())
    }

    fn gemms(&self) -> Gemms {
        self.options.gemms
    }

    unsafe fn blas(
        &self,
        step: usize,
        call: &BlasCall,
        buffers: [u64; 3],
    ) -> Result<(), RuntimeError> {
        if self.options.gemms != Gemms::Blas {
            return Err(SimError::Blas {
                step,
                call: format!("{call:?}"),
                why: "this device runs GEMMs in kernels".into(),
            }
            .into());
        }
        // cuBLAS writes all of C with beta = 0: what it held before must not matter.
        self.poison(buffers[2]);
        let extents = self.registry.snapshot();
        // The extents are the device's live buffers.
        unsafe { crate::blas::gemm_ex(step, call, buffers, (self.options.storage, &extents)) }?;
        self.blas_step.store(step, Ordering::Relaxed);
        Ok(())
    }
}
