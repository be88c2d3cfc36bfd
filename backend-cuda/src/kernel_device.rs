//! A GPU as the runtime's kernel device ([`KernelDevice`]): the program's PTX loaded on
//! a CUDA device, buffers in its memory, launches and cuBLAS calls queued on its stream.

use std::sync::Mutex;

use nestor_runtime::{from_bf16, to_bf16, BlasCall, Executable, Gemms, KernelDevice, RuntimeError};

use nestor_codegen::Storage;

use crate::blas::Blas;

/// A GPU as a kernel device: the program's PTX loaded on a CUDA device, GEMM products
/// on cuBLAS where it loads.
pub struct CudaDevice {
    device: crate::Device,
    module: crate::LoadedModule,
    storage: Storage,
    blas: Option<Blas>,
    spare: Mutex<Vec<CudaBuffer>>,
}

impl CudaDevice {
    /// `executable`'s program as PTX for `device`, loaded on it; GEMM products on cuBLAS
    /// where libcublas loads, else in the GEMM steps' kernels ([`KernelDevice::gemms`]
    /// says which).
    ///
    /// ```
    /// use nestor_backend_cuda::CudaDevice;
    /// use nestor_runtime::{InputData, KernelDevice, Stats};
    /// let graph = nestor_ir::parse(
    ///     r#"graph @g {
    ///   %0 = input {name = "x.lengths"} : lengths[B]
    ///   %1 = input {name = "x"} : ragged<f32>[B; %0, 2]
    ///   %2 = tanh(%1) : ragged<f32>[B; %0, 2]
    ///   return %2
    /// }"#,
    /// )?;
    /// let executable = nestor_backend_cpu::executable(nestor_passes::lower(&graph)?)?;
    /// match nestor_backend_cuda::Device::open(0) {
    ///     Ok(gpu) => {
    ///         let device = CudaDevice::new(gpu, &executable)?;
    ///         let (lengths, x) = ([1i64, 1], [0.5f32, 1.0, 2.0, -3.0]);
    ///         let inputs = [InputData::I64(&lengths), InputData::F32(&x)];
    ///         let outputs = executable.run_on_device(&device, &inputs, &Stats::default())?;
    ///         println!("{:?} ({:?} GEMMs)", outputs[0].data, device.gemms());
    ///     }
    ///     Err(why) => println!("no GPU here: {why}"),
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(device: crate::Device, executable: &Executable) -> Result<Self, RuntimeError> {
        Self::storing(device, executable, Storage::Compute)
    }

    /// [`CudaDevice::new`], its buffers holding floats as `storage` says.
    pub fn storing(
        device: crate::Device,
        executable: &Executable,
        storage: Storage,
    ) -> Result<Self, RuntimeError> {
        let blas = Blas::new(&device).ok();
        Self::loading(device, executable, storage, blas)
    }

    /// [`CudaDevice::storing`], GEMM products computed as `gemms` says (cuBLAS must
    /// load for [`Gemms::Blas`]: [`crate::CudaError::NoBlas`] otherwise).
    pub fn with(
        device: crate::Device,
        executable: &Executable,
        storage: Storage,
        gemms: Gemms,
    ) -> Result<Self, RuntimeError> {
        let blas = match gemms {
            Gemms::Blas => Some(Blas::new(&device)?),
            Gemms::Kernels => None,
        };
        Self::loading(device, executable, storage, blas)
    }

    /// The program's kernels for `blas` (GEMM products on it, or in kernels without it)
    /// loaded on `device`.
    fn loading(
        device: crate::Device,
        executable: &Executable,
        storage: Storage,
        blas: Option<Blas>,
    ) -> Result<Self, RuntimeError> {
        let gemms = if blas.is_some() {
            Gemms::Blas
        } else {
            Gemms::Kernels
        };
        let ptx = crate::ptx_of(
            executable.program(),
            device.arch(),
            (gemms.kernel_set(), storage),
        )?;
        let module = device.load(&ptx)?;
        Ok(Self {
            device,
            module,
            storage,
            blas,
            spare: Mutex::default(),
        })
    }

    /// The device.
    pub fn device(&self) -> &crate::Device {
        &self.device
    }
}

/// A buffer on a GPU (never empty: an empty one holds one unused value).
pub enum CudaBuffer {
    /// `len` f32 values.
    F32(crate::CudaSlice<f32>, usize),
    /// `len` bf16 values (their bits).
    Bf16(crate::CudaSlice<u16>, usize),
    /// `len` i64 values.
    I64(crate::CudaSlice<i64>, usize),
}

impl KernelDevice for CudaDevice {
    type Buffer = CudaBuffer;

    fn alloc_f32(&self, count: usize) -> Result<CudaBuffer, RuntimeError> {
        // Not zeroed: every step writes its whole output (no memset a buffer).
        Ok(match self.storage {
            Storage::Bf16 => CudaBuffer::Bf16(self.device.alloc(count)?, count),
            Storage::Compute => CudaBuffer::F32(self.device.alloc(count)?, count),
        })
    }

    fn alloc_i64(&self, count: usize) -> Result<CudaBuffer, RuntimeError> {
        Ok(CudaBuffer::I64(self.device.alloc(count)?, count))
    }

    fn capacity_f32(&self, buffer: &CudaBuffer) -> usize {
        match buffer {
            CudaBuffer::F32(_, len) | CudaBuffer::Bf16(_, len) => *len,
            CudaBuffer::I64(..) => 0,
        }
    }

    fn capacity_i64(&self, buffer: &CudaBuffer) -> usize {
        match buffer {
            CudaBuffer::I64(_, len) => *len,
            CudaBuffer::F32(..) | CudaBuffer::Bf16(..) => 0,
        }
    }

    fn spare(&self) -> &Mutex<Vec<CudaBuffer>> {
        &self.spare
    }

    fn write_f32(&self, buffer: &mut CudaBuffer, values: &[f32]) -> Result<(), RuntimeError> {
        let capacity = self.capacity_f32(buffer);
        match buffer {
            _ if values.len() > capacity => Err(too_small(values.len(), capacity)),
            _ if values.is_empty() => Ok(()),
            CudaBuffer::F32(slice, _) => Ok(self.device.write(slice, values)?),
            CudaBuffer::Bf16(slice, _) => {
                let stored: Vec<u16> = values.iter().map(|&value| to_bf16(value)).collect();
                Ok(self.device.write(slice, &stored)?)
            }
            CudaBuffer::I64(..) => Err(too_small(values.len(), 0)),
        }
    }

    fn write_i64(&self, buffer: &mut CudaBuffer, values: &[i64]) -> Result<(), RuntimeError> {
        let capacity = self.capacity_i64(buffer);
        match buffer {
            _ if values.len() > capacity => Err(too_small(values.len(), capacity)),
            _ if values.is_empty() => Ok(()),
            CudaBuffer::I64(slice, _) => Ok(self.device.write(slice, values)?),
            _ => Err(too_small(values.len(), 0)),
        }
    }

    unsafe fn download_f32(&self, address: u64, count: usize) -> Result<Vec<f32>, RuntimeError> {
        // The caller vouches for the buffer.
        Ok(match self.storage {
            Storage::Compute => unsafe { self.device.download_at(address, count) }?,
            Storage::Bf16 => unsafe { self.device.download_at::<u16>(address, count) }?
                .into_iter()
                .map(from_bf16)
                .collect(),
        })
    }

    unsafe fn download_i64(&self, address: u64, count: usize) -> Result<Vec<i64>, RuntimeError> {
        // The caller vouches for the buffer.
        Ok(unsafe { self.device.download_at(address, count) }?)
    }

    fn wait(&self) -> Result<(), RuntimeError> {
        Ok(self.device.synchronize()?)
    }

    fn address(&self, buffer: &CudaBuffer) -> u64 {
        match buffer {
            CudaBuffer::F32(slice, _) => self.device.address(slice),
            CudaBuffer::Bf16(slice, _) => self.device.address(slice),
            CudaBuffer::I64(slice, _) => self.device.address(slice),
        }
    }

    unsafe fn launch(
        &self,
        step: usize,
        table: u64,
        range: (i64, i64),
    ) -> Result<(), RuntimeError> {
        // The caller vouches for the table, the buffers (this device's) and the range.
        Ok(unsafe { self.device.launch(&self.module, step, table, range) }?)
    }

    fn gemms(&self) -> Gemms {
        if self.blas.is_some() {
            Gemms::Blas
        } else {
            Gemms::Kernels
        }
    }

    unsafe fn blas(
        &self,
        step: usize,
        call: &BlasCall,
        buffers: [u64; 3],
    ) -> Result<(), RuntimeError> {
        let blas = self.blas.as_ref().ok_or_else(|| RuntimeError::Step {
            step,
            reason: "this device runs GEMMs in kernels".to_owned(),
        })?;
        // The caller vouches for the buffers.
        Ok(unsafe { blas.run(call, buffers, self.storage) }?)
    }
}

/// A copy of `count` values into a buffer with room for `capacity` of their type.
fn too_small(count: usize, capacity: usize) -> RuntimeError {
    RuntimeError::Device(Box::new(crate::CudaError::Driver(format!(
        "a copy of {count} values into a buffer with room for {capacity} of their type"
    ))))
}

impl From<crate::CudaError> for RuntimeError {
    fn from(error: crate::CudaError) -> Self {
        RuntimeError::Device(Box::new(error))
    }
}
