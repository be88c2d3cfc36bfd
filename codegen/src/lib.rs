//! nestor-codegen: the kernel steps of a [`Program`] as LLVM IR (inkwell, LLVM 19), one
//! function per kernel, for a [`Target`]: the host CPU (the CPU backend JIT-compiles
//! them) or NVIDIA GPUs (the CUDA backend emits PTX).
//!
//! What a kernel computes is written once, in `templates` (pointwise, row, segmented,
//! gather) over the builder of `builder` (loops, loads, pointwise expressions, inline
//! `exp`, `erf`, `tanh`). The targets differ only in how the parallel loop is indexed
//! ([`Target::Host`]: the `start..end` a thread is given; [`Target::Nvptx`]: a
//! grid-stride loop over it), how a kernel is marked (a PTX kernel entry) and which math
//! library the transcendental functions call (LLVM intrinsics and libm, or libdevice).
//! [`Target::Simulated`] is the GPU's code for the host, its few GPU instructions calls
//! into a simulator ([`sim_abi`]).
//!
//! Every kernel has one signature, `void (ptr args, i64 start, i64 end)`: `args` is the
//! table of its step's [`Signature`] (`nestor_passes::signature`), which the templates
//! read by role, `start..end` a part of the signature's range.

mod builder;
mod templates;

use std::collections::HashMap;

use inkwell::context::Context;
use inkwell::module::Module;
pub use nestor_passes::KernelSet;
use nestor_passes::{Program, Signature, Step};
use thiserror::Error;

pub use nestor_math::{
    fast_erf, fast_exp, fast_log, fast_tanh, ERF_DENOMINATOR, ERF_NUMERATOR, EXP_COEFFICIENTS,
    EXP_INPUT_RANGE, EXP_LOWEST_EXPONENT, LN_2_SPLIT, LOG_COEFFICIENTS, TANH_BOUNDS,
    TANH_DENOMINATOR, TANH_NUMERATOR,
};

/// Where the generated code runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// The host CPU: each call runs the rows `start..end` in order.
    Host,
    /// An NVIDIA GPU through NVPTX: kernels are PTX entries, each thread runs the rows
    /// `start + global thread index` in steps of the grid's thread count (any grid size
    /// covers the range), and `exp`, `log`, `sin`, `cos`, `pow`, `erf`, `tanh` call
    /// libdevice's `__nv_*` functions (the module must be linked with libdevice).
    Nvptx,
    /// The GPU's kernels for the host, to run on a simulated GPU (`nestor-sim`): the
    /// structure of [`Target::Nvptx`] (grid-stride loops, a warp per task, butterfly
    /// shuffles), its special registers, shuffles and every access to a buffer calls into
    /// the simulator ([`sim_abi`]), and the math functions are the host's libm.
    Simulated,
}

/// The functions kernels of [`Target::Simulated`] call, which the simulator provides
/// under these names.
pub mod sim_abi {
    /// `i32 (i32 register)`: a special register of the calling GPU thread
    /// ([`SpecialRegister`]).
    pub const SPECIAL_REGISTER: &str = "nestor_sim_special_register";
    /// `i32 (i32 mode, i32 member_mask, i32 value, i32 b, i32 c)`: PTX's `shfl.sync`
    /// ([`ShuffleMode`]; `b` the lane or offset, `c` the clamp and segment mask) of a
    /// 32-bit value (an f32 as its bits).
    pub const SHUFFLE: &str = "nestor_sim_shuffle";
    /// `ptr (ptr address, i64 bytes, i32 store)`: checks an access of `bytes` at
    /// `address` of a buffer (a store when `store` is 1) and returns the address to
    /// access.
    pub const ACCESS: &str = "nestor_sim_access";
    /// `void (ptr d, ptr a, ptr b, ptr c)`: PTX's
    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` of the calling lane's
    /// fragments, a rendezvous of the whole warp: `a` four i32 registers (two bf16 of
    /// `A` each, the lower index in the low half), `b` two, `c` four f32; the lane's
    /// four f32 of `D = A B + C` are written to `d`.
    pub const MMA_BF16: &str = "nestor_sim_mma_m16n8k16_bf16";
    /// `void ()`: PTX's `bar.sync 0`, a rendezvous of every thread of the block.
    pub const BARRIER: &str = "nestor_sim_barrier";
    /// `ptr ()`: the block's shared memory (the launch's bytes of it, NaN before the
    /// block runs; its accesses are checked as the buffers' are).
    pub const SHARED: &str = "nestor_sim_shared";

    /// The special registers of [`SPECIAL_REGISTER`] (the `x` dimension).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(i32)]
    pub enum SpecialRegister {
        /// `%tid.x`: the thread's index in its block.
        Thread = 0,
        /// `%ntid.x`: threads per block.
        BlockThreads = 1,
        /// `%ctaid.x`: the block's index in the grid.
        Block = 2,
        /// `%nctaid.x`: blocks in the grid.
        GridBlocks = 3,
    }

    impl SpecialRegister {
        /// Every register, in code order.
        pub const ALL: [SpecialRegister; 4] = [
            SpecialRegister::Thread,
            SpecialRegister::BlockThreads,
            SpecialRegister::Block,
            SpecialRegister::GridBlocks,
        ];

        /// The register of a call's code, if it is one.
        pub fn of_code(code: i32) -> Option<Self> {
            Self::ALL
                .into_iter()
                .find(|register| *register as i32 == code)
        }
    }

    /// The modes of [`SHUFFLE`], PTX's `shfl.sync.{up, down, bfly, idx}`.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(i32)]
    pub enum ShuffleMode {
        /// From lane `lane - b`.
        Up = 0,
        /// From lane `lane + b`.
        Down = 1,
        /// From lane `lane ^ b`.
        Butterfly = 2,
        /// From lane `b`.
        Index = 3,
    }

    impl ShuffleMode {
        /// Every mode, in code order.
        pub const ALL: [ShuffleMode; 4] = [
            ShuffleMode::Up,
            ShuffleMode::Down,
            ShuffleMode::Butterfly,
            ShuffleMode::Index,
        ];

        /// The mode of a call's code, if it is one.
        pub fn of_code(code: i32) -> Option<Self> {
            Self::ALL.into_iter().find(|mode| *mode as i32 == code)
        }
    }
}

/// How kernels keep floats in memory; they compute in the program's float type either
/// way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Storage {
    /// The program's float type.
    #[default]
    Compute,
    /// bfloat16 (f32 programs only): loads widen to f32, stores round to the nearest
    /// even bf16, NaN to bf16's quiet NaN (torch's conversion). Half the bytes to move.
    Bf16,
}

/// How many GPU threads run each task of `step`'s kernel range, its floats kept in
/// memory as `storage` says: a warp for the kernels whose tasks are rows of columns (row
/// and segmented kernels, attention and its gradient, jagged-pair matmuls, window steps,
/// gathers, scatters by an index, one-hot rows, inserts, padding copies, pointwise
/// kernels over rows, row sums: their lanes share the columns, or the rows summed), two
/// for attention on tensor cores (a warp per 16 query rows), a row's values (up to a
/// block) for flat pointwise kernels, else one. A launch sizes
/// its grid by it; any grid gives the same result (the loops are grid-stride), this one
/// runs every task at once.
pub fn gpu_threads_per_task(program: &Program, step: &Step, storage: Storage) -> u32 {
    if let Some(threads) = templates::threads_per_task(step, program.float, storage) {
        threads
    } else if templates::block_per_task(step) {
        GPU_BLOCK_THREADS
    } else if templates::warp_per_task(step) {
        builder::WARP_LANES as u32
    } else {
        1
    }
}

/// Bytes of shared memory a block of `step`'s GPU kernel uses (a block's rows: its
/// warps' partial values; attention: the keys and values it stages), for `float`
/// values kept in memory as `storage` says.
pub fn gpu_shared_bytes(step: &Step, float: nestor_passes::FloatType, storage: Storage) -> u32 {
    // At most a few KiB: a block's warps, or `STAGED_FLOATS` of attention's keys.
    (templates::shared_floats(step, float, storage) * float.size() as i64) as u32
}

/// Threads per block of nestor's GPU launches (a multiple of 32: a warp per task).
pub const GPU_BLOCK_THREADS: u32 = 256;

/// The most blocks of one of nestor's GPU launches (the kernels' grid-stride loops cover
/// any range with fewer).
pub const GPU_MAX_BLOCKS: u32 = 65_535;

/// A GPU launch's geometry (one dimension).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuGrid {
    /// Blocks in the grid.
    pub blocks: u32,
    /// Threads per block.
    pub threads: u32,
}

/// How a GPU launches a kernel over `start..end`, `threads_per_task` threads per task
/// ([`gpu_threads_per_task`]): blocks of [`GPU_BLOCK_THREADS`], enough for every task
/// at once up to [`GPU_MAX_BLOCKS`]; `None` for an empty range (nothing to launch).
///
/// ```
/// use nestor_codegen::{gpu_grid, GpuGrid};
/// assert_eq!(gpu_grid(32, (0, 10)), Some(GpuGrid { blocks: 2, threads: 256 }));
/// assert_eq!(gpu_grid(1, (5, 5)), None);
/// ```
pub fn gpu_grid(threads_per_task: u32, (start, end): (i64, i64)) -> Option<GpuGrid> {
    if end <= start {
        return None;
    }
    let work = u64::try_from(end - start)
        .unwrap_or(u64::MAX)
        .saturating_mul(u64::from(threads_per_task.max(1)));
    let blocks = work
        .div_ceil(u64::from(GPU_BLOCK_THREADS))
        .clamp(1, u64::from(GPU_MAX_BLOCKS));
    Some(GpuGrid {
        // At most GPU_MAX_BLOCKS, a u32.
        blocks: blocks as u32,
        threads: GPU_BLOCK_THREADS,
    })
}

/// What went wrong while generating code: a bug of the templates (invalid IR), or an
/// LLVM that lacks an intrinsic.
#[derive(Debug, Error)]
#[error("code generation: {0}")]
pub struct CodegenError(pub String);

impl CodegenError {
    pub(crate) fn new(message: impl std::fmt::Display) -> Self {
        Self(message.to_string())
    }
}

/// Generates the kernels of `program` in `set` into `module` for `target`, and returns
/// each step's kernel name (`None` for steps whose placement in `set` has no kernel).
/// Steps with one [`Step::kernel_key`] share one kernel (the buffers are arguments): the
/// layers of a model, a forward op and its backward twin. The module is verified.
pub fn generate_kernels<'ctx>(
    program: &Program,
    context: &'ctx Context,
    module: &Module<'ctx>,
    (target, set, storage): (Target, KernelSet, Storage),
) -> Result<Vec<Option<String>>, CodegenError> {
    if storage == Storage::Bf16 && program.float != nestor_passes::FloatType::F32 {
        return Err(CodegenError::new(format!(
            "bf16 storage is for f32 programs (this one computes in {:?})",
            program.float
        )));
    }
    let mut names: Vec<Option<String>> = Vec::with_capacity(program.steps.len());
    let mut generated_for: HashMap<nestor_passes::KernelKey, usize> = HashMap::new();
    for (index, step) in program.steps.iter().enumerate() {
        let placement = step.placement(program, set);
        let Some(signature) = placement.kernel() else {
            names.push(None);
            continue;
        };
        let key = step.kernel_key(signature);
        if let Some(&first) = generated_for.get(&key) {
            names.push(names[first].clone());
            continue;
        }
        let name = format!("step{index}");
        generate_kernel(
            program,
            (target, set, storage),
            (context, module),
            &name,
            (step, signature),
        )?;
        names.push(Some(name));
        generated_for.insert(key, index);
    }
    module
        .verify()
        .map_err(|error| CodegenError::new(format!("invalid LLVM IR: {error}")))?;
    Ok(names)
}

/// Generates the kernel of `step` in `set` as function `name` of `module`, its arguments
/// those of `signature`; an error when the template and the signature disagree (it
/// reads an argument the signature lacks or passes as another kind, or never reads one
/// the signature has).
pub fn generate_kernel<'ctx>(
    program: &Program,
    (target, set, storage): (Target, KernelSet, Storage),
    (context, module): (&'ctx Context, &Module<'ctx>),
    name: &str,
    (step, signature): (&Step, &Signature),
) -> Result<(), CodegenError> {
    templates::generate(
        program,
        (target, set, storage),
        (context, module),
        name,
        (step, signature),
    )
    .map_err(|error| CodegenError::new(format!("{} step {name}: {}", step.name(), error.0)))
}
