//! nestor-backend-cuda: kernel programs for NVIDIA GPUs.
//!
//! [`ptx`] generates the kernels of a [`Program`] from the templates the CPU backend uses
//! (`nestor-codegen`, [`nestor_codegen::Target::Nvptx`]: grid-stride loops, PTX kernel entries,
//! libdevice's math), links libdevice, optimizes (`default<O3>`) and emits PTX for an
//! [`Arch`] through LLVM's NVPTX target. [`ptxas`] assembles it with NVIDIA's assembler
//! (shipped in the torch virtual environment) and reports registers and spills per
//! kernel, so PTX is checked on machines without a GPU.
//!
//! Attention is one kernel of its own (online softmax, no scores in memory), the same
//! template the CPU backend can generate (and its tests run on the host). [`Device`]
//! opens a GPU through the driver (`cudarc`, libcuda loaded at run time: a machine
//! without it gets [`CudaError::NoDriver`]), loads the PTX and launches kernels;
//! [`blas::Blas`] runs GEMM products on cuBLAS (libcublas loaded at run time too:
//! [`CudaError::NoBlas`] without it), their bias and epilogue then a kernel of
//! [`KernelSet::DeviceBlas`]. nestor-runtime's device executor runs whole programs on
//! these. Not here yet: `compile` on CUDA tensors; see issue 12.

pub mod blas;
pub mod check;
mod device;
mod kernel_device;
pub mod ptxas;

pub use cudarc::driver::CudaSlice;
pub use device::{Device, LoadedModule};
pub use kernel_device::{CudaBuffer, CudaDevice};

use std::path::{Path, PathBuf};

use inkwell::context::Context;
use inkwell::module::{Linkage, Module};
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{
    CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetTriple,
};
use inkwell::OptimizationLevel;
use nestor_codegen::Target as CodegenTarget;
pub use nestor_codegen::{KernelSet, Storage};
use nestor_passes::Program;
use thiserror::Error;

/// The GPU architectures nestor emits PTX for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Ampere (A100): compute capability 8.x.
    Sm80,
    /// Hopper (H100, H200): compute capability 9.0.
    Sm90,
}

impl Arch {
    /// Every supported architecture.
    pub const ALL: [Arch; 2] = [Arch::Sm80, Arch::Sm90];

    /// The name LLVM and ptxas use (`sm_80`).
    pub fn name(self) -> &'static str {
        match self {
            Arch::Sm80 => "sm_80",
            Arch::Sm90 => "sm_90",
        }
    }

    /// The architecture whose PTX runs on a device of compute capability
    /// `major.minor`: `sm_90` for 9.x, `sm_80` for 8.x (PTX for `sm_80` runs on every
    /// 8.x); older devices are an error.
    ///
    /// ```
    /// use nestor_backend_cuda::Arch;
    /// assert_eq!(Arch::for_capability(9, 0)?, Arch::Sm90);
    /// assert_eq!(Arch::for_capability(8, 6)?, Arch::Sm80);
    /// assert!(Arch::for_capability(7, 5).is_err());
    /// # Ok::<(), nestor_backend_cuda::CudaError>(())
    /// ```
    pub fn for_capability(major: u32, minor: u32) -> Result<Arch, CudaError> {
        match major {
            9 => Ok(Arch::Sm90),
            8 => Ok(Arch::Sm80),
            _ => Err(CudaError::UnsupportedArch { major, minor }),
        }
    }
}

impl std::str::FromStr for Arch {
    type Err = CudaError;

    fn from_str(name: &str) -> Result<Arch, CudaError> {
        Arch::ALL
            .into_iter()
            .find(|arch| arch.name() == name)
            .ok_or_else(|| CudaError::UnknownArch(name.to_owned()))
    }
}

/// Why PTX could not be made or checked.
#[derive(Debug, Error)]
pub enum CudaError {
    /// The kernel templates failed (a bug).
    #[error(transparent)]
    Codegen(#[from] nestor_codegen::CodegenError),
    /// LLVM's NVPTX target failed (a bug, or an LLVM without NVPTX).
    #[error("NVPTX: {0}")]
    Llvm(String),
    /// libdevice (NVIDIA's math library as LLVM bitcode) was not found or not read.
    #[error("libdevice: {0} (set NESTOR_LIBDEVICE to libdevice.10.bc; the torch venv's triton ships one)")]
    Libdevice(String),
    /// ptxas was not found, did not run, or rejected the PTX.
    #[error("ptxas: {0}")]
    Ptxas(String),
    /// A device older than the supported architectures.
    #[error("compute capability {major}.{minor} is not supported (nestor emits PTX for sm_80 and sm_90)")]
    UnsupportedArch {
        /// Major version.
        major: u32,
        /// Minor version.
        minor: u32,
    },
    /// libcuda (the NVIDIA driver) cannot be loaded: no NVIDIA driver on this machine.
    #[error(
        "CUDA is not available: the NVIDIA driver library (libcuda.so.1) cannot be loaded: {0}"
    )]
    NoDriver(String),
    /// The driver is there but not the device asked for.
    #[error("CUDA device {ordinal} does not exist ({count} device(s) found)")]
    NoDevice {
        /// The device asked for.
        ordinal: usize,
        /// The devices there are.
        count: i32,
    },
    /// A GPU-check case could not be read, written or run.
    #[error("GPU check: {0}")]
    Check(String),
    /// A call of the CUDA driver failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// libcublas cannot be loaded or lacks a function nestor calls.
    #[error("cuBLAS is not available: {0}")]
    NoBlas(String),
    /// A cuBLAS call failed, or a GEMM does not fit its sizes.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// An architecture name that is not `sm_80` or `sm_90`.
    #[error("unknown architecture `{0}` (sm_80 or sm_90)")]
    UnknownArch(String),
}

fn llvm(error: impl std::fmt::Display) -> CudaError {
    CudaError::Llvm(error.to_string())
}

/// A program's kernels as PTX.
#[derive(Clone, Debug)]
pub struct PtxModule {
    /// The architecture it was made for.
    pub arch: Arch,
    /// The PTX text (one `.entry` per kernel).
    pub ptx: String,
    /// Each step's kernel entry, `None` for steps without a kernel.
    pub kernels: Vec<Option<String>>,
    /// Threads per task of each step's kernel ([`nestor_codegen::gpu_threads_per_task`]).
    pub threads_per_task: Vec<u32>,
}

/// The PTX of `program`'s kernels for `arch`.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let graph = nestor_ir::parse("graph @g {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
///   %2 = tanh(%1) : ragged<f32>[B; %0, 4]
///   return %2
/// }")?;
/// let program = nestor_passes::lower(&graph)?;
/// let module = nestor_backend_cuda::ptx(&program, nestor_backend_cuda::Arch::Sm90)?;
/// assert!(module.ptx.contains(".target sm_90"));
/// assert!(module.ptx.contains(".entry step0"));
/// # Ok(())
/// # }
/// ```
pub fn ptx(program: &Program, arch: Arch) -> Result<PtxModule, CudaError> {
    ptx_storing(program, arch, Storage::Compute)
}

/// [`ptx`] with floats kept in memory as `storage` says (bf16: half the bytes to move,
/// f32 arithmetic).
pub fn ptx_storing(
    program: &Program,
    arch: Arch,
    storage: Storage,
) -> Result<PtxModule, CudaError> {
    ptx_of(program, arch, (KernelSet::Complete, storage))
}

/// The kernels of `set` (`Complete`, or `DeviceBlas` when cuBLAS runs the GEMM
/// products) as PTX, floats kept in memory as `storage` says.
pub fn ptx_of(
    program: &Program,
    arch: Arch,
    (set, storage): (KernelSet, Storage),
) -> Result<PtxModule, CudaError> {
    if set == KernelSet::Library {
        return Err(llvm("the Library kernel set is the CPU runtime's"));
    }
    Target::initialize_nvptx(&InitializationConfig::default());
    let context = Context::create();
    let module = context.create_module("nestor");
    let kernels = nestor_codegen::generate_kernels(
        program,
        &context,
        &module,
        (CodegenTarget::Nvptx, set, storage),
    )?;
    let triple = TargetTriple::create("nvptx64-nvidia-cuda");
    let target = Target::from_triple(&triple).map_err(llvm)?;
    let machine = target
        .create_target_machine(
            &triple,
            arch.name(),
            "",
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::Default,
        )
        .ok_or_else(|| llvm("no NVPTX target machine"))?;
    module.set_triple(&triple);
    module.set_data_layout(&machine.get_target_data().get_data_layout());
    link_libdevice(&context, &module)?;
    module
        .run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .map_err(llvm)?;
    let buffer = machine
        .write_to_memory_buffer(&module, FileType::Assembly)
        .map_err(llvm)?;
    let ptx = String::from_utf8_lossy(buffer.as_slice())
        .trim_end_matches('\0')
        .to_owned();
    let threads_per_task = program
        .steps
        .iter()
        .map(|step| nestor_codegen::gpu_threads_per_task(program, step, storage))
        .collect();
    Ok(PtxModule {
        arch,
        ptx,
        kernels,
        threads_per_task,
    })
}

/// Links libdevice into `module` when its kernels call `__nv_*` functions, and makes
/// every libdevice function internal so that the optimizer drops what is not called.
fn link_libdevice<'ctx>(context: &'ctx Context, module: &Module<'ctx>) -> Result<(), CudaError> {
    let calls_libdevice = module.get_functions().any(|function| {
        function.count_basic_blocks() == 0 && is_libdevice(function.get_name().to_bytes())
    });
    if !calls_libdevice {
        return Ok(());
    }
    let path = libdevice_path()?;
    let libdevice = Module::parse_bitcode_from_path(&path, context)
        .map_err(|error| CudaError::Libdevice(format!("{}: {error}", path.display())))?;
    // libdevice's own triple and data layout differ (`nvptx64-nvidia-gpulibs`).
    libdevice.set_triple(&module.get_triple());
    libdevice.set_data_layout(&module.get_data_layout());
    module
        .link_in_module(libdevice)
        .map_err(|error| CudaError::Libdevice(format!("linking {}: {error}", path.display())))?;
    for function in module.get_functions() {
        if function.count_basic_blocks() > 0 && is_libdevice(function.get_name().to_bytes()) {
            function.set_linkage(Linkage::Internal);
        }
    }
    Ok(())
}

fn is_libdevice(name: &[u8]) -> bool {
    name.starts_with(b"__nv_")
}

/// Where libdevice is: `NESTOR_LIBDEVICE`, else the one triton ships in the torch venv
/// (`$LIBTORCH/../triton/backends/nvidia/lib/libdevice.10.bc`).
pub fn libdevice_path() -> Result<PathBuf, CudaError> {
    venv_file("NESTOR_LIBDEVICE", "lib/libdevice.10.bc").map_err(CudaError::Libdevice)
}

/// `$variable` if set, else `relative` under triton's NVIDIA folder next to `$LIBTORCH`
/// (the torch package folder), if it exists.
pub(crate) fn venv_file(variable: &str, relative: &str) -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os(variable) {
        return Ok(PathBuf::from(path));
    }
    let torch = std::env::var_os("LIBTORCH").ok_or_else(|| {
        format!("neither {variable} nor LIBTORCH (the torch venv, set by scripts/env.sh) is set")
    })?;
    let path = Path::new(&torch)
        .join("../triton/backends/nvidia")
        .join(relative);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!("{} does not exist", path.display()))
    }
}
