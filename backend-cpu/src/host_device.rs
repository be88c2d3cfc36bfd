//! The CPU as a kernel device: the `Complete` (or `DeviceBlas`) kernel set JIT-compiled
//! for the host and run on host buffers laid out as a GPU's, so that the tests check the
//! device executor and the GPU's templates without a GPU.

use std::sync::Mutex;

use nestor_codegen::Storage;
use nestor_runtime::{from_bf16, to_bf16, BlasCall, Executable, Gemms, KernelDevice, RuntimeError};

use crate::blas::Gemm;
use crate::jit::{compile_storing, CpuKernels};

fn device_error(step: usize, reason: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Step {
        step,
        reason: reason.to_string(),
    }
}

/// The CPU as a kernel device: the GPU's kernels JIT-compiled for the host, and (with
/// [`Gemms::Blas`]) the column-major BLAS calls a GPU makes, run through their strides
/// ([`BlasCall::strides`]) by the runtime's GEMM.
///
/// ```
/// use nestor_backend_cpu::{executable, HostDevice};
/// use nestor_runtime::{InputData, KernelDevice, RunData, Stats};
/// let graph = nestor_ir::parse(
///     r#"graph @g {
///   %0 = input {name = "x.lengths"} : lengths[B]
///   %1 = input {name = "x"} : ragged<f32>[B; %0, 2]
///   %2 = neg(%1) : ragged<f32>[B; %0, 2]
///   return %2
/// }"#,
/// )?;
/// let executable = executable(nestor_passes::lower(&graph)?)?;
/// let device = HostDevice::new(&executable)?;
/// // x already on the device: two elements of one row.
/// let x = device.upload_f32(&[0.5, 1.0, 2.0, -3.0])?;
/// let inputs = [
///     InputData::I64(&[1, 1]),
///     InputData::OnDevice { address: device.address(&x), len: 4 },
/// ];
/// let results = executable.run_device_resident(&device, &inputs, &Stats::default())?;
/// assert_eq!(results.outputs[0].len, 4);
/// let outputs = results.download(&device)?;
/// assert!(matches!(&outputs[0].data, RunData::F32(v) if v == &[-0.5, -1.0, -2.0, 3.0]));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct HostDevice {
    kernels: CpuKernels,
    storage: Storage,
    gemms: Gemms,
    spare: Mutex<Vec<HostBuffer>>,
}

impl HostDevice {
    /// The host device of `executable`'s program.
    pub fn new(executable: &Executable) -> Result<Self, RuntimeError> {
        Self::storing(executable, Storage::Compute)
    }

    /// The host device of `executable`'s program, its buffers holding floats as
    /// `storage` says (bf16: the GPU's half-size buffers, checked on the CPU).
    pub fn storing(executable: &Executable, storage: Storage) -> Result<Self, RuntimeError> {
        Self::with(executable, storage, Gemms::Kernels)
    }

    /// [`HostDevice::storing`], GEMM products computed as `gemms` says.
    pub fn with(
        executable: &Executable,
        storage: Storage,
        gemms: Gemms,
    ) -> Result<Self, RuntimeError> {
        Ok(Self {
            kernels: compile_storing(executable.program(), gemms.kernel_set(), storage)?,
            storage,
            gemms,
            spare: Mutex::default(),
        })
    }

    /// `count` values of the storage type at `address`, as f32.
    ///
    /// # Safety
    /// `address` must hold `count` values of the storage type.
    unsafe fn read_floats(&self, address: u64, count: usize) -> Vec<f32> {
        // The caller vouches for the values.
        unsafe {
            if self.storage == Storage::Bf16 {
                std::slice::from_raw_parts(address as *const u16, count)
                    .iter()
                    .map(|&bits| from_bf16(bits))
                    .collect()
            } else {
                std::slice::from_raw_parts(address as *const f32, count).to_vec()
            }
        }
    }
}

/// A host buffer: 8-byte words, so that f32, bf16 and i64 values are aligned.
pub struct HostBuffer {
    words: Vec<u64>,
}

impl KernelDevice for HostDevice {
    type Buffer = HostBuffer;

    fn alloc_f32(&self, count: usize) -> Result<HostBuffer, RuntimeError> {
        // One word at least: kernels take the address of every buffer.
        let per_word = if self.storage == Storage::Bf16 { 4 } else { 2 };
        let length = count.div_ceil(per_word).max(1);
        let mut words = Vec::new();
        words
            .try_reserve_exact(length)
            .map_err(|_| device_error(0, format!("cannot allocate {count} values")))?;
        // NaN in every value (all bits set), as a GPU's buffers hold leftovers: a step
        // that leaves a value unwritten shows.
        words.resize(length, u64::MAX);
        Ok(HostBuffer { words })
    }

    fn capacity_f32(&self, buffer: &HostBuffer) -> usize {
        let per_word = if self.storage == Storage::Bf16 { 4 } else { 2 };
        buffer.words.len() * per_word
    }

    fn spare(&self) -> &Mutex<Vec<HostBuffer>> {
        &self.spare
    }

    fn upload_f32(&self, values: &[f32]) -> Result<HostBuffer, RuntimeError> {
        let HostBuffer { mut words } = self.alloc_f32(values.len())?;
        // The words hold at least `values.len()` values of the storage type.
        unsafe {
            if self.storage == Storage::Bf16 {
                let stored = words.as_mut_ptr() as *mut u16;
                for (index, &value) in values.iter().enumerate() {
                    *stored.add(index) = to_bf16(value);
                }
            } else {
                std::ptr::copy_nonoverlapping(
                    values.as_ptr(),
                    words.as_mut_ptr() as *mut f32,
                    values.len(),
                )
            }
        };
        Ok(HostBuffer { words })
    }

    fn upload_i64(&self, values: &[i64]) -> Result<HostBuffer, RuntimeError> {
        let mut words: Vec<u64> = values.iter().map(|&value| value as u64).collect();
        // One word at least: kernels take the address of every buffer.
        words.push(0);
        Ok(HostBuffer { words })
    }

    unsafe fn download_f32(&self, address: u64, count: usize) -> Result<Vec<f32>, RuntimeError> {
        // The caller vouches for the values.
        Ok(unsafe { self.read_floats(address, count) })
    }

    fn wait(&self) -> Result<(), RuntimeError> {
        // Kernels ran when they were launched.
        Ok(())
    }

    fn address(&self, buffer: &HostBuffer) -> u64 {
        buffer.words.as_ptr() as u64
    }

    unsafe fn launch(
        &self,
        step: usize,
        table: u64,
        (start, end): (i64, i64),
    ) -> Result<(), RuntimeError> {
        let kernel = self
            .kernels
            .kernel(step)
            .ok_or_else(|| device_error(step, "no kernel"))?;
        // The caller vouches for the table, the buffers (this device's) and the range.
        unsafe { kernel(table as *const *mut u8, start, end) };
        Ok(())
    }

    fn gemms(&self) -> Gemms {
        self.gemms
    }

    unsafe fn blas(
        &self,
        _step: usize,
        call: &BlasCall,
        [a, b, c]: [u64; 3],
    ) -> Result<(), RuntimeError> {
        let [a_len, b_len, c_len] = call.lengths();
        // The caller vouches for the buffers' lengths.
        let (a, b) = unsafe { (self.read_floats(a, a_len), self.read_floats(b, b_len)) };
        let mut product = vec![0.0f32; c_len];
        let count = |value: i32| usize::try_from(value).unwrap_or(0);
        let [a_strides, b_strides, c_strides] = call.strides();
        if call.k > 0 && call.m > 0 && call.n > 0 {
            // `a`, `b` and `product` hold what the call's strides reach (`lengths`).
            unsafe {
                <f32 as Gemm>::matmul(
                    (count(call.m), count(call.k), count(call.n)),
                    1.0,
                    (a.as_ptr(), a_strides.0, a_strides.1),
                    (b.as_ptr(), b_strides.0, b_strides.1),
                    (product.as_mut_ptr(), c_strides.0, c_strides.1),
                )
            };
        }
        // The caller vouches for `c`: `c_len` values of the storage type.
        unsafe {
            if self.storage == Storage::Bf16 {
                let stored = c as *mut u16;
                for (index, &value) in product.iter().enumerate() {
                    *stored.add(index) = to_bf16(value);
                }
            } else {
                std::ptr::copy_nonoverlapping(product.as_ptr(), c as *mut f32, c_len);
            }
        }
        Ok(())
    }
}
