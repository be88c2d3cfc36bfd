//! A CUDA device through the driver API (`cudarc`, libcuda loaded at run time), the
//! PTX of a program loaded on it, and kernel launches over buffers the device holds.
//!
//! On a machine without libcuda or without a device, [`Device::open`] is a typed error
//! that says which (cudarc itself panics when libcuda is missing, so it is looked for
//! first).

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};

use crate::{Arch, CudaError, PtxModule};

fn driver(error: impl std::fmt::Display) -> CudaError {
    CudaError::Driver(error.to_string())
}

/// An opened CUDA device and the stream its work is ordered on.
pub struct Device {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    name: String,
}

impl Device {
    /// Opens device `ordinal`: an error without libcuda ([`CudaError::NoDriver`]), with
    /// fewer devices ([`CudaError::NoDevice`]) or with one older than `sm_80`.
    ///
    /// ```
    /// match nestor_backend_cuda::Device::open(0) {
    ///     Ok(device) => println!("{} ({})", device.name(), device.arch().name()),
    ///     Err(error) => println!("no CUDA here: {error}"),
    /// }
    /// ```
    pub fn open(ordinal: usize) -> Result<Device, CudaError> {
        driver_present()?;
        let count = CudaContext::device_count().map_err(driver)?;
        if ordinal >= usize::try_from(count).unwrap_or(0) {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let context = CudaContext::new(ordinal).map_err(driver)?;
        let (major, minor) = context.compute_capability().map_err(driver)?;
        let arch = Arch::for_capability(major.max(0) as u32, minor.max(0) as u32)?;
        let name = context.name().map_err(driver)?;
        let stream = context.default_stream();
        Ok(Device {
            context,
            stream,
            arch,
            name,
        })
    }

    /// The device's ordinal (CUDA's number for it).
    pub fn ordinal(&self) -> usize {
        self.context.ordinal()
    }

    /// The architecture PTX for this device is made for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The stream the device's work is ordered on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's name (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Loads `module` (made for this device's architecture, or `sm_80`, whose PTX every
    /// supported device runs).
    pub fn load(&self, module: &PtxModule) -> Result<LoadedModule, CudaError> {
        if module.arch != self.arch && module.arch != Arch::Sm80 {
            return Err(CudaError::Driver(format!(
                "PTX for {} cannot run on {} ({})",
                module.arch.name(),
                self.name,
                self.arch.name()
            )));
        }
        let loaded = self
            .context
            .load_module(cudarc::nvrtc::Ptx::from_src(module.ptx.clone()))
            .map_err(driver)?;
        let kernels = module
            .kernels
            .iter()
            .map(|name| {
                name.as_ref()
                    .map(|name| loaded.load_function(name).map_err(driver))
                    .transpose()
            })
            .collect::<Result<_, _>>()?;
        Ok(LoadedModule {
            kernels,
            threads_per_task: module.threads_per_task.clone(),
        })
    }

    /// A new device buffer for `count` values (at least one), not initialized: for
    /// kernels that write every value before any is read. `T` is a plain number type,
    /// for which any bits are a value.
    pub fn alloc<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        count: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        // SAFETY: the memory stays on the device; any bits are a value of `T`.
        unsafe { self.stream.alloc(count.max(1)) }.map_err(driver)
    }

    /// Copies `values` to a new device buffer.
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        values: &[T],
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream.clone_htod(values).map_err(driver)
    }

    /// Copies `values` into the first values of `buffer` (which holds at least as many),
    /// queued on the device's stream after the work before it.
    pub fn write<T: cudarc::driver::DeviceRepr>(
        &self,
        buffer: &mut CudaSlice<T>,
        values: &[T],
    ) -> Result<(), CudaError> {
        if values.len() > buffer.len() {
            return Err(CudaError::Driver(format!(
                "a copy of {} values into a buffer of {}",
                values.len(),
                buffer.len()
            )));
        }
        let mut first = buffer.slice_mut(..values.len());
        self.stream.memcpy_htod(values, &mut first).map_err(driver)
    }

    /// Copies a device buffer back (waiting for the work before it).
    pub fn download<T: cudarc::driver::DeviceRepr>(
        &self,
        buffer: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.stream.clone_dtoh(buffer).map_err(driver)
    }

    /// Copies `count` values at device address `address` back, after the work queued
    /// before.
    ///
    /// # Safety
    /// `address` must be a buffer of this device holding `count` values of `T`, alive
    /// until the copy is done.
    pub unsafe fn download_at<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        address: u64,
        count: usize,
    ) -> Result<Vec<T>, CudaError> {
        let mut values = vec![T::default(); count];
        if count == 0 {
            return Ok(values);
        }
        self.context.bind_to_thread().map_err(driver)?;
        // SAFETY: the caller vouches for the buffer; `values` lives until the stream has
        // run the copy (synchronized below).
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut values, address, self.stream.cu_stream())
        }
        .map_err(driver)?;
        self.synchronize()?;
        Ok(values)
    }

    /// Waits for the work queued on the device's stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(driver)
    }

    /// The device address of `buffer`, for a kernel's argument table.
    pub fn address<T>(&self, buffer: &CudaSlice<T>) -> u64 {
        let (address, _record) = buffer.device_ptr(&self.stream);
        address
    }

    /// Queues the kernel of step `step` over `start..end` on the device's stream, its
    /// argument table (the addresses of its buffers, in the order the step's template
    /// documents) at device address `table`. It does not wait: work on the stream runs
    /// in order, and a download waits for it.
    ///
    /// # Safety
    /// The table and the buffers it names must be device buffers of this device, sized
    /// for the step over `start..end` (the kernel reads and writes them without checks)
    /// and alive until the work is done.
    pub unsafe fn launch(
        &self,
        module: &LoadedModule,
        step: usize,
        table: u64,
        (start, end): (i64, i64),
    ) -> Result<(), CudaError> {
        let kernel = module
            .kernels
            .get(step)
            .and_then(Option::as_ref)
            .ok_or_else(|| CudaError::Driver(format!("step {step} has no kernel")))?;
        let threads = module.threads_per_task.get(step).copied().unwrap_or(1);
        // The grid the simulated GPU's tests launch too.
        let Some(grid) = nestor_codegen::gpu_grid(threads, (start, end)) else {
            return Ok(());
        };
        let config = LaunchConfig {
            grid_dim: (grid.blocks, 1, 1),
            block_dim: (grid.threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(kernel);
        launch.arg(&table).arg(&start).arg(&end);
        // SAFETY: the kernel's signature is (ptr, i64, i64); the caller vouches for the
        // table and the buffers it names.
        unsafe { launch.launch(config) }.map_err(driver)?;
        Ok(())
    }
}

/// A program's kernels loaded on a device.
pub struct LoadedModule {
    kernels: Vec<Option<CudaFunction>>,
    threads_per_task: Vec<u32>,
}

/// libcuda can be loaded (cudarc panics when it cannot).
fn driver_present() -> Result<(), CudaError> {
    // SAFETY: loading the driver library runs its initializers, as cudarc's own loading
    // would; nothing from it is called here.
    unsafe { libloading::Library::new("libcuda.so.1") }
        .map(drop)
        .map_err(|error| CudaError::NoDriver(error.to_string()))
}
