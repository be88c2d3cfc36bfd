//! nestor-backend-cpu: turns the kernel steps of a [`Program`] into LLVM IR with
//! `inkwell` (LLVM 19), optimizes it (`default<O3>`: vectorization included) and
//! JIT-compiles it for the host.
//!
//! Every kernel has one ABI: `extern "C" fn(args: *const *mut u8, start: i64, end: i64)`,
//! where `args` are the buffers the step reads and writes (see [`KernelFn`]) and
//! `start..end` the rows (or elements, for segmented kernels) this call
//! covers, so the runtime can split work across threads. GEMM and attention steps get no kernel:
//! the runtime runs them on a GEMM library.
//!
//! What a kernel computes is in `codegen` (shared loops, loads, expressions); the
//! CUDA backend will reuse it with its own thread indexing.

mod codegen;
mod kernels;

use std::collections::HashMap;

use inkwell::attributes::AttributeLoc;
use inkwell::context::Context;
use inkwell::execution_engine::ExecutionEngine;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{CodeModel, InitializationConfig, RelocMode, Target, TargetMachine};
use inkwell::OptimizationLevel;
use nestor_passes::{Program, Step};
use thiserror::Error;

/// `ln 2` split in two (Cody and Waite): `n * LN_2_SPLIT[0]` is exact for the `n` of
/// f32 exponents, so `x - n ln 2` keeps its precision.
pub const LN_2_SPLIT: [f64; 2] = [0.693_359_375, -2.121_944_400_546_905_8e-4];

/// Coefficients of the polynomial `p` with `e^r = 1 + r + r^2 p(r)` on
/// `[-ln(2)/2, ln(2)/2]`, highest degree first (Cephes' `expf`): the generated kernels'
/// `exp` and [`fast_exp`] share them.
pub const EXP_COEFFICIENTS: [f64; 6] = [
    1.987_569_150_0e-4,
    1.398_199_950_7e-3,
    8.333_451_907_3e-3,
    4.166_579_589_4e-2,
    1.666_666_545_9e-1,
    5.000_000_120_1e-1,
];

/// The inputs `exp` works on: below, `e^x` rounds to 0 in f32 (`e^-104 < 2^-150`);
/// above, it overflows to `inf` (`e^89 > f32::MAX`). Clamping keeps `n` in range.
pub const EXP_INPUT_RANGE: [f32; 2] = [-104.0, 89.0];

/// The lowest `n` of `2^n` that `exp` applies (`n` of the lowest input rounded: 2^-150).
pub const EXP_LOWEST_EXPONENT: f32 = -150.0;

/// `e^x` computed as the generated kernels compute it (`e^x = 2^n e^r`, `n` the nearest
/// integer to `x / ln 2`, `r = x - n ln 2` in two steps, [`EXP_COEFFICIENTS`] for `e^r`,
/// `2^n` applied as two factors; within 2 ulp of the exact value, `inf` past f32's
/// range, subnormals and 0 below it, NaN for NaN), for host code that must agree with
/// them.
///
/// Branch-free f32 arithmetic without libm calls (rounding by the `1.5 * 2^23` trick,
/// to nearest even like the kernels' `rint`), so loops over it vectorize.
#[inline(always)]
pub fn fast_exp(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds |t| < 2^22 to an integer.
    let [lowest, highest] = EXP_INPUT_RANGE;
    let x = x.clamp(lowest, highest); // NaN stays NaN.
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN_2_SPLIT[0] as f32) - n * LN_2_SPLIT[1] as f32;
    let polynomial = EXP_COEFFICIENTS
        .iter()
        .fold(0.0f32, |acc, &c| acc * r + c as f32);
    let reduced = polynomial * r * r + r + 1.0;
    // `n` is an integer in [-150, 129] (x was clamped; a NaN, which makes the polynomial
    // NaN, becomes -150 here since `max` ignores NaN), so the unchecked conversion is
    // exact; a saturating `as` would keep the loop from vectorizing.
    let exponent = unsafe { n.max(EXP_LOWEST_EXPONENT).to_int_unchecked::<i32>() };
    let half = exponent >> 1;
    let power_of_two = |n: i32| f32::from_bits(((n + 127) << 23) as u32);
    reduced * power_of_two(half) * power_of_two(exponent - half)
}

/// A compiled kernel: `args` holds the step's buffers, in the order documented on each
/// [`Step`] kind in `kernels`; `start..end` is the range of rows or elements to run.
pub type KernelFn = unsafe extern "C" fn(args: *const *mut u8, start: i64, end: i64);

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
    Target::initialize_native(&InitializationConfig::default()).map_err(BackendError::new)?;
    let context_pointer = Box::into_raw(Box::new(Context::create()));
    // SAFETY: the pointer is a live allocation until `CpuKernels::drop` frees it, after
    // the engine, the last thing that borrows it.
    let context: &'static Context = unsafe { &*context_pointer };
    let module = context.create_module("nestor");
    let mut names: Vec<Option<String>> = Vec::with_capacity(program.steps.len());
    // Steps that differ only in their buffers share one kernel (the buffers are
    // arguments): the layers of a model, a forward op and its backward twin.
    let mut generated_for: HashMap<String, usize> = HashMap::new();
    for (index, step) in program.steps.iter().enumerate() {
        let key = kernel_key(step);
        if let Some(&first) = generated_for.get(&key) {
            names.push(names[first].clone());
            continue;
        }
        let name = format!("step{index}");
        let generated = kernels::generate(program.float, context, &module, &name, step)?;
        names.push(generated.then_some(name));
        generated_for.insert(key, index);
    }
    module
        .verify()
        .map_err(|error| BackendError::new(format!("invalid LLVM IR: {error}")))?;
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
    for function in module.get_functions() {
        for (key, value) in [
            ("target-cpu", cpu.as_str()),
            ("target-features", features.as_str()),
        ] {
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

/// What a step's kernel code depends on: the step with its buffers' slot numbers
/// erased (kernels take their buffers as arguments).
fn kernel_key(step: &Step) -> String {
    let text = format!("{step:?}");
    let mut key = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(start) = rest.find("Slot(") {
        key.push_str(&rest[..start + 5]);
        rest = &rest[start + 5..];
        rest = rest.trim_start_matches(|c: char| c.is_ascii_digit());
    }
    key.push_str(rest);
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate_over_the_finite_range() {
        let mut worst: f32 = 0.0;
        for step in -8700..=8800 {
            let x = step as f32 / 100.0;
            let relative = (fast_exp(x) - x.exp()).abs() / x.exp();
            worst = worst.max(relative);
        }
        // Two f32 ulp (2^-22 relative).
        assert!(worst < 2.5e-7, "worst relative error {worst}");
        assert!(fast_exp(f32::NAN).is_nan(), "NaN propagates");
    }

    #[test]
    fn fast_exp_overflows_and_underflows_as_libm() {
        for x in [88.72f32, 88.73, 89.0, 100.0, 1e30, f32::INFINITY] {
            assert_eq!(fast_exp(x), x.exp(), "e^{x}");
        }
        for x in [-104.0f32, -110.0, -1e30, f32::NEG_INFINITY] {
            assert_eq!(fast_exp(x).to_bits(), 0, "e^{x} is +0");
        }
        // Subnormal results: within one step of the subnormal grid (2^-149) of libm's.
        for step in 0..=1700 {
            let x = -87.0 - step as f32 / 100.0;
            let error = (fast_exp(x) as f64 - (x as f64).exp()).abs();
            assert!(error <= f32::from_bits(1) as f64, "e^{x}: error {error:e}");
        }
    }
}
