//! The kernel builder the templates are written with: a kernel function with the common
//! signature (this module), its arguments by role (`abi`), loads and stores (`memory`),
//! counted and parallel loops and GPU lanes (`lanes`), arithmetic (`arith`), the
//! target's math functions (`math`) and pointwise expressions (`expr`).

mod abi;
mod arith;
mod expr;
mod lanes;
pub(crate) use lanes::ROW_REGISTERS;
mod math;
mod memory;
mod tensor_core;
pub(crate) use tensor_core::{FragmentA, FragmentB, FragmentC};

use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::Module;
use inkwell::types::FloatType;
use inkwell::values::{
    BasicMetadataValueEnum, BasicValue, BasicValueEnum, FastMathFlags, FloatValue, FunctionValue,
    InstructionValue, IntValue, MetadataValue, PointerValue,
};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};
use nestor_ir::{BinaryOp, UnaryOp};
use nestor_passes::{Arg, Expr, Role, Signature};

use crate::{CodegenError, Storage, Target};

pub(crate) type Gen<T> = Result<T, CodegenError>;

fn err(error: impl std::fmt::Display) -> CodegenError {
    CodegenError::new(error)
}

/// NVPTX's address space of global (device) memory.
const GLOBAL_ADDRESS_SPACE: u16 = 1;

/// LLVM's calling convention of PTX kernel entries (`ptx_kernel`).
const PTX_KERNEL_CALLING_CONVENTION: u32 = 71;

/// Threads of a GPU warp: a row kernel's row is one warp's on a GPU, each thread a lane
/// over every 32nd column ([`Kernel::parallel_rows`]).
pub(crate) const WARP_LANES: i64 = 32;

/// How the threads of one task share its columns: `count` lanes, this thread's is
/// `lane` (one lane on the host: the task is one thread's).
#[derive(Clone, Copy)]
pub(crate) struct Lanes<'ctx> {
    pub(crate) lane: IntValue<'ctx>,
    pub(crate) count: i64,
}

/// A GPU thread's place in its launch: its index in the grid, the grid's threads, and
/// its index in its block.
struct Grid<'ctx> {
    global: IntValue<'ctx>,
    threads: IntValue<'ctx>,
    thread: IntValue<'ctx>,
}

/// A GPU thread's place in its block, and its block's in the grid: its thread and
/// warp (the block's `warps`, this thread's `warp`, its lanes).
pub(crate) struct BlockPlace<'ctx> {
    pub(crate) block: IntValue<'ctx>,
    pub(crate) blocks: IntValue<'ctx>,
    pub(crate) thread: IntValue<'ctx>,
    pub(crate) threads: IntValue<'ctx>,
    pub(crate) warps: IntValue<'ctx>,
    pub(crate) warp: IntValue<'ctx>,
    pub(crate) lanes: Lanes<'ctx>,
}

/// Floats of the compute type in a kernel's own memory (never bf16).
#[derive(Clone, Copy)]
pub(crate) struct Local<'ctx>(PointerValue<'ctx>);

/// A kernel under construction: `fn(args: ptr, start: i64, end: i64)`.
pub(crate) struct Kernel<'ctx, 'm> {
    pub(crate) context: &'ctx Context,
    pub(crate) module: &'m Module<'ctx>,
    pub(crate) builder: Builder<'ctx>,
    pub(crate) function: FunctionValue<'ctx>,
    pub(crate) float: FloatType<'ctx>,
    /// Whether `float` is f64.
    pub(crate) double: bool,
    /// gelu(+inf) is NaN ([`nestor_passes::Program::gelu_nan_at_infinity`]).
    gelu_nan_at_infinity: bool,
    /// Floats in memory are bf16 ([`Storage::Bf16`]).
    bf16: bool,
    target: Target,
    entry: inkwell::basic_block::BasicBlock<'ctx>,
    /// The buffers of the `args` array loaded so far, and whether each is the output
    /// ([`Role::Out`], or one of `output_roles`): accesses through them carry [`Scopes`].
    buffers: std::cell::RefCell<Vec<(PointerValue<'ctx>, bool)>>,
    /// Arguments besides [`Role::Out`] that are the output's buffer
    /// ([`Kernel::output_also`]).
    output_roles: std::cell::RefCell<Vec<Role>>,
    /// The output's buffer as loaded so far: an argument that is the output's buffer
    /// again (a GEMM epilogue's read of the GEMM's own result) is the same pointer
    /// value ([`Kernel::arg`]).
    output_loads: std::cell::RefCell<Vec<(Arg, PointerValue<'ctx>)>>,
    /// The kernel's arguments: the template asks for them by role.
    signature: &'m Signature,
    /// The roles the template has asked for ([`Kernel::finish`] checks it asked for
    /// every one).
    asked: std::cell::RefCell<Vec<Role>>,
    scopes: Scopes<'ctx>,
}

/// Alias scopes that tell LLVM a kernel's output (buffer 0) never overlaps the buffers
/// it reads (the executors give every step a buffer of its own, none of its inputs';
/// a GEMM epilogue reading the GEMM's own result is given that buffer again, and its
/// template says so with [`Kernel::output_also`]):
/// without them a kernel over short rows with a broadcast operand (batch norm's
/// `(x - mean)^2` over 16 channels) was unrolled into scalar code that reloaded the
/// operand after every store. Host kernels only (the PTX is left as it was).
#[derive(Clone, Copy)]
struct Scopes<'ctx> {
    /// `!alias.scope` / `!noalias` kind ids.
    scope_kind: u32,
    noalias_kind: u32,
    /// Scope lists `!{out}` and `!{inputs}`.
    output: MetadataValue<'ctx>,
    inputs: MetadataValue<'ctx>,
}

impl<'ctx> Scopes<'ctx> {
    fn new(context: &'ctx Context, kernel: &str) -> Self {
        let node = |values: &[BasicMetadataValueEnum<'ctx>]| context.metadata_node(values);
        let named = |name: String| BasicMetadataValueEnum::from(context.metadata_string(&name));
        let domain = node(&[named(format!("nestor.{kernel}.buffers"))]);
        let scope = |what: &str| {
            node(&[
                named(format!("nestor.{kernel}.{what}")),
                BasicMetadataValueEnum::from(domain),
            ])
        };
        let (output, inputs) = (scope("output"), scope("inputs"));
        Self {
            scope_kind: context.get_kind_id("alias.scope"),
            noalias_kind: context.get_kind_id("noalias"),
            output: node(&[output.into()]),
            inputs: node(&[inputs.into()]),
        }
    }
}

impl<'ctx, 'm> Kernel<'ctx, 'm> {
    pub(crate) fn new(
        context: &'ctx Context,
        module: &'m Module<'ctx>,
        name: &str,
        program: &nestor_passes::Program,
        (target, storage): (Target, Storage),
        signature: &'m Signature,
    ) -> Self {
        let precision = program.float;
        let ptr = context.ptr_type(AddressSpace::default());
        let i64 = context.i64_type();
        let function_type = context
            .void_type()
            .fn_type(&[ptr.into(), i64.into(), i64.into()], false);
        let function = module.add_function(name, function_type, None);
        if target == Target::Nvptx {
            // A PTX kernel entry (simulated kernels are plain host functions).
            function.set_call_conventions(PTX_KERNEL_CALLING_CONVENTION);
        }
        let entry = context.append_basic_block(function, "entry");
        let builder = context.create_builder();
        builder.position_at_end(entry);
        Self {
            context,
            module,
            builder,
            function,
            float: if precision == nestor_passes::FloatType::F64 {
                context.f64_type()
            } else {
                context.f32_type()
            },
            double: precision == nestor_passes::FloatType::F64,
            gelu_nan_at_infinity: program.gelu_nan_at_infinity,
            bf16: storage == Storage::Bf16,
            target,
            entry,
            buffers: std::cell::RefCell::new(Vec::new()),
            output_roles: std::cell::RefCell::new(Vec::new()),
            output_loads: std::cell::RefCell::new(Vec::new()),
            signature,
            asked: std::cell::RefCell::new(Vec::new()),
            scopes: Scopes::new(context, name),
        }
    }

    /// [`Kernel::scoped`] of a load's value.
    fn scoped_load(&self, load: BasicValueEnum<'ctx>, base: PointerValue<'ctx>) -> Gen<()> {
        match load.as_instruction_value() {
            Some(access) => self.scoped(access, base),
            None => Ok(()),
        }
    }

    /// Whether `base` is a buffer of the `args` array, and if so whether it is the
    /// output's (host and simulated kernels register theirs, in [`Kernel::arg`]).
    fn buffer_kind(&self, base: PointerValue<'ctx>) -> Option<bool> {
        self.buffers
            .borrow()
            .iter()
            .find(|(buffer, _)| *buffer == base)
            .map(|&(_, output)| output)
    }

    /// Marks `access`, a load or store at `base`, with its buffer's alias scope when
    /// `base` is a buffer of the `args` array (host kernels only).
    fn scoped(&self, access: InstructionValue<'ctx>, base: PointerValue<'ctx>) -> Gen<()> {
        if self.target != Target::Host {
            return Ok(());
        }
        let Some(output) = self.buffer_kind(base) else {
            return Ok(());
        };
        let Scopes {
            scope_kind,
            noalias_kind,
            output: out,
            inputs,
        } = self.scopes;
        let (own, other) = if output { (out, inputs) } else { (inputs, out) };
        access.set_metadata(own, scope_kind).map_err(err)?;
        access.set_metadata(other, noalias_kind).map_err(err)
    }

    /// Finishes the kernel with `ret void`, after checking that the template asked for
    /// every argument of its signature (an argument it never reads is a signature and a
    /// template that disagree).
    pub(crate) fn finish(self) -> Gen<()> {
        let asked = self.asked.borrow();
        if let Some(unread) = self
            .signature
            .params
            .iter()
            .find(|param| !asked.contains(&param.role))
        {
            return Err(err(format!(
                "the signature's argument {:?} ({:?}) is never read by the template",
                unread.role, unread.arg
            )));
        }
        self.builder.build_return(None).map_err(err)?;
        Ok(())
    }

    pub(crate) fn i64(&self, value: i64) -> IntValue<'ctx> {
        self.context.i64_type().const_int(value as u64, true)
    }

    pub(crate) fn constant(&self, value: f64) -> FloatValue<'ctx> {
        self.float.const_float(value)
    }

    /// The range `start..end` the call covers.
    pub(crate) fn range(&self) -> Gen<(IntValue<'ctx>, IntValue<'ctx>)> {
        let param = |index: u32| {
            self.function
                .get_nth_param(index)
                .map(|value| value.into_int_value())
                .ok_or_else(|| err("missing parameter"))
        };
        Ok((param(1)?, param(2)?))
    }
}
