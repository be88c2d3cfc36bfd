//! The JIT: turns the kernel steps of a [`Program`] into LLVM IR with `inkwell`
//! (LLVM 19), optimizes it (`default<O3>`: vectorization included) and compiles it for
//! the host.
//!
//! Every kernel has one ABI: `extern "C" fn(args: *const *mut u8, start: i64, end: i64)`,
//! where `args` are the buffers the step reads and writes (see [`KernelFn`]) and
//! `start..end` the rows (or elements, for segmented kernels) this call covers, so the
//! steps (`crate::steps`) can split work across threads. GEMM products and attention
//! get no kernel (a GEMM's epilogue does): they run on a GEMM library.
//!
//! What a kernel computes is in `nestor-codegen` (the templates the CUDA backend shares,
//! generated here for [`nestor_codegen::Target::Host`]).

use inkwell::attributes::AttributeLoc;
use inkwell::context::Context;
use inkwell::execution_engine::ExecutionEngine;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, InitializationConfig, RelocMode, Target, TargetMachine};
use inkwell::OptimizationLevel;
use nestor_codegen::{CodegenError, Storage, Target as CodegenTarget};
use nestor_passes::{KernelSet, Program};
use thiserror::Error;

use crate::KernelFn;

/// What went wrong while generating or compiling code: a bug of the backend, or a
/// machine LLVM does not support.
#[derive(Debug, Error)]
#[error("CPU backend: {0}")]
pub struct BackendError(pub String);

impl BackendError {
    pub(crate) fn new(message: impl std::fmt::Display) -> Self {
        Self(message.to_string())
    }
}

impl From<BackendError> for nestor_runtime::RuntimeError {
    fn from(error: BackendError) -> Self {
        Self::Backend(Box::new(error))
    }
}

impl From<CodegenError> for BackendError {
    fn from(error: CodegenError) -> Self {
        Self(error.to_string())
    }
}

/// The JIT-compiled kernels of a program, one per step (none for GEMM steps).
pub struct CpuKernels {
    // Holds the code of `kernels`; dropped before `context`, which it borrows.
    engine: std::mem::ManuallyDrop<ExecutionEngine<'static>>,
    // The program's own LLVM context (from `Box::into_raw`), freed with the kernels.
    context: *mut Context,
    kernels: Vec<Option<KernelFn>>,
    ir: String,
}

impl Drop for CpuKernels {
    fn drop(&mut self) {
        // SAFETY: the engine (and the module it owns) is the only user of the context,
        // and no kernel is called after its `CpuKernels` is gone (the executor owns
        // it); the engine goes first, then the context, which nothing else points to.
        unsafe {
            std::mem::ManuallyDrop::drop(&mut self.engine);
            drop(Box::from_raw(self.context));
        }
    }
}

// The engine is only kept alive; the kernels are plain functions over the buffers they
// are given, safe to call from several threads at once.
unsafe impl Send for CpuKernels {}
unsafe impl Sync for CpuKernels {}

impl CpuKernels {
    /// The kernel of step `index`, if it has one.
    pub fn kernel(&self, index: usize) -> Option<KernelFn> {
        self.kernels.get(index).copied().flatten()
    }

    /// The optimized LLVM IR of the program (for dumps and tests).
    pub fn llvm_ir(&self) -> &str {
        &self.ir
    }
}

/// Generates, optimizes and JIT-compiles the kernels of `program`.
///
/// ```
/// let graph = nestor_ir::parse("graph @g {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
///   %2 = exp(%1) : ragged<f32>[B; %0, 4]
///   return %2
/// }")?;
/// let program = nestor_passes::lower(&graph)?;
/// let kernels = nestor_backend_cpu::compile(&program)?;
/// assert!(kernels.kernel(0).is_some());
/// assert!(kernels.llvm_ir().contains("define"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Each compiled program has its own LLVM context, freed when its `CpuKernels` is
/// dropped (a failed compile leaves it allocated).
pub fn compile(program: &Program) -> Result<CpuKernels, BackendError> {
    // GEMMs and attention run on the host's GEMM library (faster here than the
    // templates).
    compile_with(program, KernelSet::Library)
}

/// Lets loops over `sin`, `cos`, `pow` (and f64 `exp`, `log`) vectorize into calls of
/// glibc's vector math library (`libmvec`, 4 ulp at most, libm's values for NaN, the
/// infinities and huge arguments) rather than one libm call per value: loads it into the
/// process (the JIT resolves its symbols there) and tells LLVM, once per process.
/// Without it (another libc), those loops keep calling libm. Returns whether it is in
/// use.
fn vector_math() -> bool {
    static LOADED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LOADED.get_or_init(|| {
        // SAFETY: glibc's own library; loading it runs no user code. It stays loaded
        // (leaked) for the JIT's kernels.
        let library = unsafe {
            libloading::os::unix::Library::open(
                Some("libmvec.so.1"),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        };
        let Ok(library) = library else {
            return false;
        };
        std::mem::forget(library);
        let arguments = [c"nestor".as_ptr(), c"-vector-library=LIBMVEC-X86".as_ptr()];
        // SAFETY: two NUL-terminated strings that outlive the call; LLVM copies what it
        // keeps. Called once per process, before any pass runs.
        unsafe {
            inkwell::llvm_sys::support::LLVMParseCommandLineOptions(
                arguments.len() as i32,
                arguments.as_ptr(),
                std::ptr::null(),
            )
        };
        true
    })
}

/// [`compile`] with the kernels of `set` ([`KernelSet::Complete`]: the GPU's, which the
/// tests run on the host this way).
pub fn compile_with(program: &Program, set: KernelSet) -> Result<CpuKernels, BackendError> {
    compile_storing(program, set, Storage::Compute)
}

/// [`compile_with`], the kernels keeping floats in memory as `storage` says (bf16: the
/// GPU's half-size buffers, which the tests run on the host this way).
pub fn compile_storing(
    program: &Program,
    set: KernelSet,
    storage: Storage,
) -> Result<CpuKernels, BackendError> {
    compile_for(program, (CodegenTarget::Host, set, storage), &[])
}

/// [`compile_storing`] of the code for `target` (the host's, or a simulated GPU's,
/// [`CodegenTarget::Simulated`]), the external functions named in `symbols` resolved to
/// the addresses given there (a simulator's).
pub fn compile_for(
    program: &Program,
    (target, set, storage): (CodegenTarget, KernelSet, Storage),
    symbols: &[(&str, usize)],
) -> Result<CpuKernels, BackendError> {
    if target == CodegenTarget::Nvptx {
        return Err(BackendError::new("NVPTX code does not run on the host"));
    }
    Target::initialize_native(&InitializationConfig::default()).map_err(BackendError::new)?;
    // Without glibc's vector math, such loops call libm per value: slower, as correct.
    let _ = vector_math();
    let context_pointer = Box::into_raw(Box::new(Context::create()));
    // SAFETY: the pointer is a live allocation until `CpuKernels::drop` frees it, after
    // the engine, the last thing that borrows it.
    let context: &'static Context = unsafe { &*context_pointer };
    let module = context.create_module("nestor");
    let names =
        nestor_codegen::generate_kernels(program, context, &module, (target, set, storage))?;
    let triple = TargetMachine::get_default_triple();
    let target = Target::from_triple(&triple).map_err(BackendError::new)?;
    let cpu = TargetMachine::get_host_cpu_name().to_string();
    let features = TargetMachine::get_host_cpu_features().to_string();
    let machine = target
        .create_target_machine(
            &triple,
            &cpu,
            &features,
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::JITDefault,
        )
        .ok_or_else(|| BackendError::new("no target machine for the host"))?;
    module.set_triple(&triple);
    module.set_data_layout(&machine.get_target_data().get_data_layout());
    // MCJIT generates code with its own default target machine (generic x86-64, SSE2):
    // every function names the host CPU and its features, so that both the passes and
    // the JIT's code generator use AVX2 / AVX-512 where the host has them.
    // On AVX-512 hosts LLVM keeps to 256-bit vectors unless told otherwise; the
    // kernels are throughput loops (libtorch's use 512 bits too).
    let width = if features.contains("+avx512f") {
        "512"
    } else {
        ""
    };
    for function in module.get_functions() {
        for (key, value) in [
            ("target-cpu", cpu.as_str()),
            ("target-features", features.as_str()),
            ("prefer-vector-width", width),
        ] {
            if value.is_empty() {
                continue;
            }
            function.add_attribute(
                AttributeLoc::Function,
                context.create_string_attribute(key, value),
            );
        }
    }
    module
        .run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .map_err(BackendError::new)?;
    let ir = module.print_to_string().to_string();
    let engine = module
        .create_jit_execution_engine(OptimizationLevel::Aggressive)
        .map_err(BackendError::new)?;
    for &(name, address) in symbols {
        if let Some(function) = module.get_function(name) {
            engine.add_global_mapping(&function, address);
        }
    }
    let kernels = names
        .iter()
        .map(|name| {
            name.as_ref()
                .map(|name| {
                    let address = engine
                        .get_function_address(name)
                        .map_err(BackendError::new)?;
                    // The function was generated with exactly the `KernelFn` signature.
                    Ok(unsafe { std::mem::transmute::<usize, KernelFn>(address) })
                })
                .transpose()
        })
        .collect::<Result<Vec<_>, BackendError>>()?;
    Ok(CpuKernels {
        engine: std::mem::ManuallyDrop::new(engine),
        context: context_pointer,
        kernels,
        ir,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The program of a graph's text.
    fn lowered(text: &str) -> Program {
        let graph = nestor_ir::parse(text).unwrap_or_else(|error| panic!("{error}"));
        nestor_passes::lower(&graph).unwrap_or_else(|error| panic!("{error}"))
    }

    #[test]
    fn loops_over_sin_cos_and_pow_call_the_vector_math_library() {
        let program = lowered(
            "graph @g {
  %0 = input {name = \"x.lengths\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 64]
  %2 = sin(%1) : ragged<f32>[B; %0, 64]
  %3 = cos(%2) : ragged<f32>[B; %0, 64]
  %4 = pow(%3, %1) : ragged<f32>[B; %0, 64]
  return %4
}",
        );
        let kernels = compile(&program).unwrap_or_else(|error| panic!("{error}"));
        if !vector_math() {
            eprintln!("skipped: no libmvec.so.1 in this process (not glibc)");
            return;
        }
        let ir = kernels.llvm_ir();
        for function in ["sinf", "cosf", "powf"] {
            assert!(
                ir.contains(&format!("v_{function}")),
                "no vector {function} call in\n{ir}"
            );
        }
    }

    #[test]
    fn gelu_at_infinity_follows_the_program() {
        let mut program = lowered(
            "graph @g {
  %0 = input {name = \"x.lengths\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
  %2 = gelu(%1) : ragged<f32>[B; %0, 4]
  return %2
}",
        );
        let x = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1.0];
        for nan_at_infinity in [false, true] {
            program.gelu_nan_at_infinity = nan_at_infinity;
            let kernels = compile(&program).unwrap_or_else(|error| panic!("{error}"));
            let kernel = kernels
                .kernel(0)
                .unwrap_or_else(|| panic!("no gelu kernel"));
            let mut out = [0.0f32; 4];
            let args = [out.as_mut_ptr() as *mut u8, x.as_ptr() as *mut u8];
            // One row of 4 values: both buffers hold it.
            unsafe { kernel(args.as_ptr(), 0, 1) };
            assert_eq!(out[0].is_nan(), nan_at_infinity, "{out:?}");
            if !nan_at_infinity {
                assert_eq!(out[0], f32::INFINITY);
            }
            // -inf * 0 and NaN: NaN either way, as libtorch's.
            assert!(out[1].is_nan() && out[2].is_nan(), "{out:?}");
            assert!((out[3] - 0.841_344_7).abs() < 1e-6, "{out:?}");
        }
    }

    #[test]
    fn bf16_storage_widens_loads_and_rounds_stores_to_nearest_even() {
        let program = lowered(
            "graph @g {
  %0 = input {name = \"x.lengths\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 64]
  %2 = input {name = \"y\"} : ragged<f32>[B; %0, 64]
  %3 = mul(%1, %2) : ragged<f32>[B; %0, 64]
  return %3
}",
        );
        let kernels = compile_storing(&program, KernelSet::Complete, Storage::Bf16)
            .unwrap_or_else(|error| panic!("{error}"));
        let kernel = kernels
            .kernel(0)
            .unwrap_or_else(|| panic!("no kernel for the product"));
        // Products of bf16 values are exact in f32 (8 significant bits each), so the
        // store's rounding is the only one: two products halfway between bf16 values
        // (1.0078125 x 1.5 rounds up to the even neighbour, 1.015625 x 1.25 down),
        // NaN, infinities, signed zeros, a subnormal and an overflow.
        let mut pairs: Vec<(f32, f32)> = vec![
            (1.0078125, 1.5),
            (1.015625, 1.25),
            (f32::NAN, 1.0),
            (f32::INFINITY, -2.0),
            (f32::NEG_INFINITY, 0.0),
            (0.0, -1.0),
            (1.0e-20, 1.0e-20),
            (3.0e38, 3.0e38),
        ];
        pairs.extend((0..56).map(|i| (i as f32 * 0.37 - 9.0, 1.0 - i as f32 * 0.05)));
        let bf16 = |value: f32| half::bf16::from_f32(value);
        let x: Vec<u16> = pairs.iter().map(|&(a, _)| bf16(a).to_bits()).collect();
        let y: Vec<u16> = pairs.iter().map(|&(_, b)| bf16(b).to_bits()).collect();
        let mut out = vec![0u16; 64];
        let args = [
            out.as_mut_ptr() as *mut u8,
            x.as_ptr() as *mut u8,
            y.as_ptr() as *mut u8,
        ];
        // One row of 64 values: every buffer holds it.
        unsafe { kernel(args.as_ptr(), 0, 1) };
        for (&(a, b), &got) in pairs.iter().zip(&out) {
            let product = bf16(a).to_f32() * bf16(b).to_f32();
            if product.is_nan() {
                assert_eq!(got, 0x7FC0, "NaN is bf16's quiet NaN, as torch's");
            } else {
                assert_eq!(got, bf16(product).to_bits(), "{a} x {b} = {product}");
            }
        }
        // bf16 buffers are for f32 programs: an f64 one is a typed error.
        let f64_program = lowered(
            "graph @g {
  %0 = input {name = \"x.lengths\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f64>[B; %0, 4]
  %2 = relu(%1) : ragged<f64>[B; %0, 4]
  return %2
}",
        );
        match compile_storing(&f64_program, KernelSet::Complete, Storage::Bf16) {
            Err(error) => assert!(error.to_string().contains("bf16 storage"), "{error}"),
            Ok(_) => panic!("bf16 storage of an f64 program compiled"),
        }
    }

    /// A GEMM's epilogue kernel runs on the GEMM's result in place: its reads of that
    /// result are in the output's alias scope, as its stores (in another scope LLVM
    /// could assume a store leaves them unchanged), and the residual it adds in the
    /// inputs'.
    #[test]
    fn an_epilogue_reads_its_result_in_the_outputs_alias_scope() {
        let program = lowered(
            "graph @g {
  %0 = input {name = \"x.lengths\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 8]
  %2 = param {name = \"w\"} : f32[8, 8]
  %3 = param {name = \"b\"} : f32[8]
  %4 = epilogue(%1, %2, %3, %1) {expr = \"(add (gelu $0) $1)\", inputs = 1, core = linear} : ragged<f32>[B; %0, 8]
  return %4
}",
        );
        let kernels = compile(&program).unwrap_or_else(|error| panic!("{error}"));
        let ir = kernels.llvm_ir();
        let scope = |line: &str| {
            let at = line.find("!alias.scope !")? + "!alias.scope ".len();
            line[at..].split(',').next().map(str::to_owned)
        };
        let stores: Vec<String> = ir
            .lines()
            .filter(|line| line.trim_start().starts_with("store"))
            .filter_map(scope)
            .collect();
        let loads: Vec<String> = ir
            .lines()
            .filter(|line| line.contains(" = load "))
            .filter_map(scope)
            .collect();
        let output = stores
            .first()
            .unwrap_or_else(|| panic!("no scoped store in\n{ir}"));
        assert!(stores.iter().all(|scope| scope == output), "{ir}");
        assert!(
            loads.iter().any(|scope| scope == output),
            "no load of the result in\n{ir}"
        );
        assert!(
            loads.iter().any(|scope| scope != output),
            "no load of the residual in\n{ir}"
        );
    }

    /// Rows of 16 columns are vectorized along the row: before, LLVM unrolled a row's
    /// columns and vectorized the loop over rows, a gather (and a scatter) per column
    /// (a third of the conv net's time, in its epilogues), and a segment's reductions
    /// and softmax ran down each column's rows, a gather per row. A row of a few
    /// columns is still vectorized across rows.
    #[test]
    fn rows_and_segments_of_sixteen_columns_are_vectorized_along_the_row() {
        let program = lowered(
            "graph @g {
  %0 = input {name = \"x.lengths\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 16]
  %2 = input {name = \"b\"} : f32[16]
  %3 = add(%1, %2) : ragged<f32>[B; %0, 16]
  %4 = relu(%3) : ragged<f32>[B; %0, 16]
  %5 = layer_norm(%1, %2, %2) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 16]
  %6 = sum(%1) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %7 = amax(%1) {dims = [1], keepdim = false} : f32[B, 16]
  %8 = logsumexp(%1) {dims = [1], keepdim = false} : f32[B, 16]
  %9 = softmax(%1) {axis = 1} : ragged<f32>[B; %0, 16]
  return %4, %5, %6, %7, %8, %9
}",
        );
        let kernels = compile(&program).unwrap_or_else(|error| panic!("{error}"));
        let ir = kernels.llvm_ir();
        assert!(
            !ir.contains("llvm.masked.gather") && !ir.contains("llvm.masked.scatter"),
            "a gather or scatter in\n{ir}"
        );
        let rows_kept_whole = ir
            .lines()
            .filter(|line| line.contains("!\"llvm.loop.vectorize.enable\", i1 false"))
            .count();
        assert!(rows_kept_whole > 0, "no row loop marked in\n{ir}");
        let narrow = lowered(
            "graph @g {
  %0 = input {name = \"x.lengths\"} : lengths[B]
  %1 = input {name = \"x\"} : ragged<f32>[B; %0, 2]
  %2 = softmax(%1) {axis = -1} : ragged<f32>[B; %0, 2]
  return %2
}",
        );
        let kernels = compile(&narrow).unwrap_or_else(|error| panic!("{error}"));
        assert!(
            !kernels.llvm_ir().contains("llvm.loop.vectorize.enable"),
            "rows of 2 columns marked"
        );
    }
}
