//! The kernel builder the templates are written with: a kernel function with the common
//! signature, counted and parallel loops, typed loads and stores, accumulators,
//! pointwise expressions, and the math functions of the target.

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
            signature,
            asked: std::cell::RefCell::new(Vec::new()),
            scopes: Scopes::new(context, name),
        }
    }

    /// Declares that the arguments of `roles` (besides [`Role::Out`]) are the output's
    /// buffer too, so that accesses through them share the output's alias scope. Call
    /// it before asking for them with [`Kernel::param`].
    pub(crate) fn output_also(&self, roles: impl IntoIterator<Item = Role>) {
        self.output_roles.borrow_mut().extend(roles);
    }

    /// [`Kernel::scoped`] of a load's value.
    fn scoped_load(&self, load: BasicValueEnum<'ctx>, base: PointerValue<'ctx>) -> Gen<()> {
        match load.as_instruction_value() {
            Some(access) => self.scoped(access, base),
            None => Ok(()),
        }
    }

    /// Marks `access`, a load or store at `base`, with its buffer's alias scope when
    /// `base` is a buffer of the `args` array (only host kernels register theirs, in
    /// [`Kernel::arg`]).
    fn scoped(&self, access: InstructionValue<'ctx>, base: PointerValue<'ctx>) -> Gen<()> {
        let output = self
            .buffers
            .borrow()
            .iter()
            .find(|(buffer, _)| *buffer == base)
            .map(|&(_, output)| output);
        let Some(output) = output else {
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

    /// The argument of `role`, which must be in the signature and not absent.
    pub(crate) fn param(&self, role: Role) -> Gen<PointerValue<'ctx>> {
        self.optional(role)?.ok_or_else(|| {
            err(format!(
                "the template reads {role:?}, which its step does not have"
            ))
        })
    }

    /// The arguments of `roles`, as [`Kernel::param`].
    pub(crate) fn params<const N: usize>(&self, roles: [Role; N]) -> Gen<[PointerValue<'ctx>; N]> {
        let pointers = roles
            .into_iter()
            .map(|role| self.param(role))
            .collect::<Gen<Vec<_>>>()?;
        pointers
            .try_into()
            .map_err(|_| err("a kernel's argument count"))
    }

    /// The argument of `role`, `None` where the signature has it absent (an optional
    /// buffer). An argument the signature lacks, or one of another kind than `role`
    /// takes, is an error: the template and the signature disagree.
    pub(crate) fn optional(&self, role: Role) -> Gen<Option<PointerValue<'ctx>>> {
        let Some(index) = self
            .signature
            .params
            .iter()
            .position(|param| param.role == role)
        else {
            return Err(err(format!(
                "the template reads {role:?}, which its signature lacks"
            )));
        };
        let arg = self.signature.params[index].arg;
        if !role.accepts(&arg) {
            return Err(err(format!(
                "the template reads {role:?}, but the signature passes {arg:?} there"
            )));
        }
        self.asked.borrow_mut().push(role);
        if arg == Arg::Absent {
            return Ok(None);
        }
        self.arg(index as u64, role).map(Some)
    }

    /// Buffer number `index` of the `args` array, of role `role`.
    fn arg(&self, index: u64, role: Role) -> Gen<PointerValue<'ctx>> {
        let args = self
            .function
            .get_nth_param(0)
            .ok_or_else(|| err("missing args"))?
            .into_pointer_value();
        let ptr = self.context.ptr_type(AddressSpace::default());
        let slot = unsafe {
            self.builder
                .build_gep(ptr, args, &[self.i64(index as i64)], "arg.slot")
        }
        .map_err(err)?;
        let pointer = self
            .builder
            .build_load(ptr, slot, "arg")
            .map_err(err)?
            .into_pointer_value();
        match self.target {
            Target::Host => {
                let output = role == Role::Out || self.output_roles.borrow().contains(&role);
                self.buffers.borrow_mut().push((pointer, output));
                Ok(pointer)
            }
            // Buffers are device (global) memory: `ld.global` / `st.global` rather than
            // generic accesses that test the address space at run time.
            Target::Nvptx => self
                .builder
                .build_address_space_cast(
                    pointer,
                    self.context
                        .ptr_type(AddressSpace::from(GLOBAL_ADDRESS_SPACE)),
                    "global",
                )
                .map_err(err),
        }
    }

    /// Value `index` of buffer `base`, in the compute type (widened from bf16 storage).
    pub(crate) fn load_float(
        &self,
        base: PointerValue<'ctx>,
        index: IntValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        if self.bf16 {
            let i16 = self.context.i16_type();
            let i32 = self.context.i32_type();
            let address =
                unsafe { self.builder.build_gep(i16, base, &[index], "at") }.map_err(err)?;
            let half = self.builder.build_load(i16, address, "bf16").map_err(err)?;
            self.scoped_load(half, base)?;
            let wide = self
                .builder
                .build_int_z_extend(half.into_int_value(), i32, "wide")
                .map_err(err)?;
            let bits = self
                .builder
                .build_left_shift(wide, i32.const_int(16, false), "bits")
                .map_err(err)?;
            return Ok(self
                .builder
                .build_bit_cast(bits, self.float, "x")
                .map_err(err)?
                .into_float_value());
        }
        self.load_local(Local(base), index)
    }

    pub(crate) fn load_i64(
        &self,
        base: PointerValue<'ctx>,
        index: IntValue<'ctx>,
    ) -> Gen<IntValue<'ctx>> {
        let i64 = self.context.i64_type();
        let address = unsafe { self.builder.build_gep(i64, base, &[index], "at") }.map_err(err)?;
        let value = self.builder.build_load(i64, address, "n").map_err(err)?;
        self.scoped_load(value, base)?;
        Ok(value.into_int_value())
    }

    /// Stores `value` as value `index` of buffer `base` (rounded to the nearest even
    /// bf16 for bf16 storage, NaN as bf16's quiet NaN, as torch's conversion).
    pub(crate) fn store_float(
        &self,
        base: PointerValue<'ctx>,
        index: IntValue<'ctx>,
        value: FloatValue<'ctx>,
    ) -> Gen<()> {
        if self.bf16 {
            let i16 = self.context.i16_type();
            let i32 = self.context.i32_type();
            let constant = |value: u64| i32.const_int(value, false);
            let bits = self
                .builder
                .build_bit_cast(value, i32, "bits")
                .map_err(err)?
                .into_int_value();
            let sixteen = constant(16);
            let above = self
                .builder
                .build_right_shift(bits, sixteen, false, "above")
                .map_err(err)?;
            let odd = self
                .builder
                .build_and(above, constant(1), "odd")
                .map_err(err)?;
            let bias = self
                .builder
                .build_int_add(odd, constant(0x7FFF), "bias")
                .map_err(err)?;
            let biased = self
                .builder
                .build_int_add(bits, bias, "biased")
                .map_err(err)?;
            let rounded = self
                .builder
                .build_right_shift(biased, sixteen, false, "rounded")
                .map_err(err)?;
            let nan = self
                .builder
                .build_float_compare(FloatPredicate::UNO, value, value, "nan")
                .map_err(err)?;
            let half = self
                .builder
                .build_select(nan, constant(0x7FC0), rounded, "half")
                .map_err(err)?
                .into_int_value();
            let narrow = self
                .builder
                .build_int_truncate(half, i16, "bf16")
                .map_err(err)?;
            let address =
                unsafe { self.builder.build_gep(i16, base, &[index], "at") }.map_err(err)?;
            let store = self.builder.build_store(address, narrow).map_err(err)?;
            return self.scoped(store, base);
        }
        self.store_local(Local(base), index, value)
    }

    /// Value `index` of a local array ([`Kernel::accumulator_array`]), or of a buffer
    /// stored in the compute type.
    pub(crate) fn load_local(
        &self,
        Local(base): Local<'ctx>,
        index: IntValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let address =
            unsafe { self.builder.build_gep(self.float, base, &[index], "at") }.map_err(err)?;
        let value = self
            .builder
            .build_load(self.float, address, "x")
            .map_err(err)?;
        self.scoped_load(value, base)?;
        Ok(value.into_float_value())
    }

    /// Stores `value` as value `index` of a local array, or of a buffer stored in the
    /// compute type.
    pub(crate) fn store_local(
        &self,
        Local(base): Local<'ctx>,
        index: IntValue<'ctx>,
        value: FloatValue<'ctx>,
    ) -> Gen<()> {
        let address =
            unsafe { self.builder.build_gep(self.float, base, &[index], "at") }.map_err(err)?;
        let store = self.builder.build_store(address, value).map_err(err)?;
        self.scoped(store, base)
    }

    /// A float accumulator in the entry block (promoted to a register by the optimizer).
    pub(crate) fn accumulator(&self, name: &str) -> Gen<PointerValue<'ctx>> {
        self.alloca_in_entry(self.float.into(), name)
    }

    /// An i64 variable in the entry block (a row index a loop keeps).
    pub(crate) fn index_variable(&self, name: &str) -> Gen<PointerValue<'ctx>> {
        self.alloca_in_entry(self.context.i64_type().into(), name)
    }

    pub(crate) fn get_index(&self, slot: PointerValue<'ctx>) -> Gen<IntValue<'ctx>> {
        Ok(self
            .builder
            .build_load(self.context.i64_type(), slot, "index")
            .map_err(err)?
            .into_int_value())
    }

    pub(crate) fn set_index(&self, slot: PointerValue<'ctx>, value: IntValue<'ctx>) -> Gen<()> {
        self.builder.build_store(slot, value).map_err(err)?;
        Ok(())
    }

    /// One accumulator per name.
    pub(crate) fn accumulators<const N: usize>(
        &self,
        names: [&str; N],
    ) -> Gen<[PointerValue<'ctx>; N]> {
        let slots = names
            .into_iter()
            .map(|name| self.accumulator(name))
            .collect::<Gen<Vec<_>>>()?;
        slots.try_into().map_err(|_| err("accumulator count"))
    }

    /// `length` floats of the compute type in the entry block (registers or local
    /// memory), indexed with [`Kernel::load_local`] and [`Kernel::store_local`].
    pub(crate) fn accumulator_array(&self, name: &str, length: i64) -> Gen<Local<'ctx>> {
        let length = u32::try_from(length.max(1)).map_err(err)?;
        Ok(Local(self.alloca_in_entry(
            self.float.array_type(length).into(),
            name,
        )?))
    }

    /// A stack slot of `ty`, allocated once in the entry block whatever the loop the
    /// builder is in.
    fn alloca_in_entry(
        &self,
        ty: inkwell::types::BasicTypeEnum<'ctx>,
        name: &str,
    ) -> Gen<PointerValue<'ctx>> {
        let here = self
            .builder
            .get_insert_block()
            .ok_or_else(|| err("no insert block"))?;
        match self.entry.get_first_instruction() {
            Some(first) => self.builder.position_before(&first),
            None => self.builder.position_at_end(self.entry),
        }
        let slot = self.builder.build_alloca(ty, name).map_err(err)?;
        self.builder.position_at_end(here);
        Ok(slot)
    }

    pub(crate) fn get(&self, slot: PointerValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        Ok(self
            .builder
            .build_load(self.float, slot, "acc")
            .map_err(err)?
            .into_float_value())
    }

    pub(crate) fn set(&self, slot: PointerValue<'ctx>, value: FloatValue<'ctx>) -> Gen<()> {
        self.builder.build_store(slot, value).map_err(err)?;
        Ok(())
    }

    /// `for i in start..end { body(i) }`.
    pub(crate) fn for_range(
        &self,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        self.for_range_by(start, end, self.i64(1), body)
    }

    /// The kernel's loop over the rows (or elements) `start..end` of its range: in order
    /// on the host; on a GPU, each thread takes every `threads`-th from `start + its
    /// global index`, so any grid covers the range.
    pub(crate) fn parallel_range(
        &self,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        match self.target {
            Target::Host => self.for_range(start, end, body),
            Target::Nvptx => {
                let grid = self.grid()?;
                self.for_range_by(self.add(start, grid.global)?, end, grid.threads, body)
            }
        }
    }

    /// Where this GPU thread is in the launch's grid (PTX's special registers).
    fn grid(&self) -> Gen<Grid<'ctx>> {
        let register =
            |name: &str| self.special_register(&format!("llvm.nvvm.read.ptx.sreg.{name}"));
        let block_size = register("ntid.x")?;
        let block_start = self.mul(register("ctaid.x")?, block_size)?;
        let thread = register("tid.x")?;
        Ok(Grid {
            global: self.add(block_start, thread)?,
            threads: self.mul(register("nctaid.x")?, block_size)?,
            thread,
        })
    }

    /// The lanes of a task of [`Kernel::parallel_rows`] on this target: a warp on a GPU,
    /// one on the host.
    pub(crate) fn lane_count(&self) -> i64 {
        match self.target {
            Target::Host => 1,
            Target::Nvptx => WARP_LANES,
        }
    }

    /// Where a lane keeps its value of `column` (one of the columns its [`lane_range`]
    /// gives) in a kernel-local array of `columns / lanes` (rounded up) values.
    ///
    /// [`lane_range`]: Kernel::lane_range
    pub(crate) fn lane_slot(
        &self,
        lanes: Lanes<'ctx>,
        column: IntValue<'ctx>,
    ) -> Gen<IntValue<'ctx>> {
        if lanes.count == 1 {
            return Ok(column);
        }
        self.div(column, self.i64(lanes.count))
    }

    /// One lane: a task that one thread runs whole.
    pub(crate) fn single_lane(&self) -> Lanes<'ctx> {
        Lanes {
            lane: self.i64(0),
            count: 1,
        }
    }

    /// The kernel's loop over the rows `start..end` of its range, each row a task of
    /// [`Lanes`]: on the host, one thread's ([`Kernel::parallel_range`]); on a GPU, a
    /// warp's (warp `w` of the grid takes every `warps`-th row from `start + w`; the
    /// launch must give blocks a multiple of 32 threads), so every lane of a warp runs
    /// the same rows and may exchange values with [`Kernel::across_lanes`].
    pub(crate) fn parallel_rows(
        &self,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>, Lanes<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        match self.target {
            Target::Host => self.for_range(start, end, |row| body(row, self.single_lane())),
            Target::Nvptx => {
                let grid = self.grid()?;
                let count = self.lane_count();
                let warps = self.div(grid.threads, self.i64(count))?;
                let lanes = Lanes {
                    lane: self.rem(grid.thread, self.i64(count))?,
                    count,
                };
                let first = self.add(start, self.div(grid.global, self.i64(count))?)?;
                self.for_range_by(first, end, warps, |row| body(row, lanes))
            }
        }
    }

    /// `for column in (lane..width).step_by(lanes)`: a lane's columns of a row.
    pub(crate) fn lane_range(
        &self,
        lanes: Lanes<'ctx>,
        width: i64,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        self.lane_range_until(lanes, self.i64(width), body)
    }

    /// [`Kernel::lane_range`] to a bound known at run time.
    pub(crate) fn lane_range_until(
        &self,
        lanes: Lanes<'ctx>,
        end: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        if lanes.count == 1 {
            return self.for_range(self.i64(0), end, body);
        }
        self.for_range_by(lanes.lane, end, self.i64(lanes.count), body)
    }

    /// Every lane's `value` combined by `combine` (a sum, a largest value), the result in
    /// every lane: butterfly shuffles across the warp on a GPU, `value` itself with one
    /// lane. Every lane of the warp must call it.
    pub(crate) fn across_lanes(
        &self,
        lanes: Lanes<'ctx>,
        value: FloatValue<'ctx>,
        combine: impl Fn(FloatValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    ) -> Gen<FloatValue<'ctx>> {
        let mut value = value;
        let mut offset = lanes.count / 2;
        while offset >= 1 {
            value = combine(value, self.shuffle_xor(value, offset)?)?;
            offset /= 2;
        }
        Ok(value)
    }

    /// The `value` of lane `lane ^ offset` of this warp (`shfl.sync.bfly` over the
    /// whole warp; an f64 as its two 32-bit halves).
    fn shuffle_xor(&self, value: FloatValue<'ctx>, offset: i64) -> Gen<FloatValue<'ctx>> {
        let i32 = self.context.i32_type();
        let shuffle = |name: &str, value: inkwell::values::BasicValueEnum<'ctx>| {
            let intrinsic =
                Intrinsic::find(name).ok_or_else(|| err(format!("no intrinsic {name}")))?;
            let function = intrinsic
                .get_declaration(self.module, &[])
                .ok_or_else(|| err(format!("no declaration of {name}")))?;
            let whole_warp = i32.const_int(u64::from(u32::MAX), false);
            let lane_offset = i32.const_int(offset as u64, false);
            let clamp = i32.const_int(0x1f, false);
            self.builder
                .build_call(
                    function,
                    &[
                        whole_warp.into(),
                        value.into(),
                        lane_offset.into(),
                        clamp.into(),
                    ],
                    "shuffled",
                )
                .map_err(err)?
                .try_as_basic_value()
                .basic()
                .ok_or_else(|| err(format!("{name} returned nothing")))
        };
        if !self.double {
            return Ok(shuffle("llvm.nvvm.shfl.sync.bfly.f32", value.into())?.into_float_value());
        }
        let halves = i32.vec_type(2);
        let split = self
            .builder
            .build_bit_cast(value, halves, "halves")
            .map_err(err)?
            .into_vector_value();
        let mut joined = halves.get_undef();
        for half in 0..2 {
            let index = i32.const_int(half, false);
            let part = self
                .builder
                .build_extract_element(split, index, "half")
                .map_err(err)?;
            let moved = shuffle("llvm.nvvm.shfl.sync.bfly.i32", part)?;
            joined = self
                .builder
                .build_insert_element(joined, moved, index, "joined")
                .map_err(err)?;
        }
        Ok(self
            .builder
            .build_bit_cast(joined, self.float, "shuffled")
            .map_err(err)?
            .into_float_value())
    }

    /// A PTX special register (`llvm.nvvm.read.ptx.sreg.*`, an i32) as an i64.
    fn special_register(&self, name: &str) -> Gen<IntValue<'ctx>> {
        let intrinsic = Intrinsic::find(name).ok_or_else(|| err(format!("no intrinsic {name}")))?;
        let function = intrinsic
            .get_declaration(self.module, &[])
            .ok_or_else(|| err(format!("no declaration of {name}")))?;
        let value = self
            .builder
            .build_call(function, &[], name)
            .map_err(err)?
            .try_as_basic_value()
            .basic()
            .ok_or_else(|| err(format!("{name} returned nothing")))?
            .into_int_value();
        self.builder
            .build_int_z_extend(value, self.context.i64_type(), "index")
            .map_err(err)
    }

    /// `for (i = start; i < end; i += step) { body(i) }` (`step > 0`).
    fn for_range_by(
        &self,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        step: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        let before = self
            .builder
            .get_insert_block()
            .ok_or_else(|| err("no insert block"))?;
        let header = self.context.append_basic_block(self.function, "loop");
        let inner = self.context.append_basic_block(self.function, "body");
        let exit = self.context.append_basic_block(self.function, "exit");
        self.builder
            .build_unconditional_branch(header)
            .map_err(err)?;
        self.builder.position_at_end(header);
        let index = self
            .builder
            .build_phi(self.context.i64_type(), "i")
            .map_err(err)?;
        index.add_incoming(&[(&start, before)]);
        let i = index.as_basic_value().into_int_value();
        let more = self
            .builder
            .build_int_compare(IntPredicate::SLT, i, end, "more")
            .map_err(err)?;
        self.builder
            .build_conditional_branch(more, inner, exit)
            .map_err(err)?;
        self.builder.position_at_end(inner);
        body(i)?;
        let next = self.builder.build_int_add(i, step, "next").map_err(err)?;
        let latch = self
            .builder
            .get_insert_block()
            .ok_or_else(|| err("no insert block"))?;
        index.add_incoming(&[(&next, latch)]);
        self.builder
            .build_unconditional_branch(header)
            .map_err(err)?;
        self.builder.position_at_end(exit);
        Ok(())
    }

    pub(crate) fn add(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_int_add(a, b, "add").map_err(err)
    }

    pub(crate) fn mul(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_int_mul(a, b, "mul").map_err(err)
    }

    pub(crate) fn rem(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_int_signed_rem(a, b, "rem").map_err(err)
    }

    pub(crate) fn sub(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_int_sub(a, b, "sub").map_err(err)
    }

    pub(crate) fn div(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_int_signed_div(a, b, "div").map_err(err)
    }

    /// The integer as a float.
    pub(crate) fn to_float(&self, value: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        self.builder
            .build_signed_int_to_float(value, self.float, "float")
            .map_err(err)
    }

    /// SplitMix64's finalizer of a 64-bit integer (wrapping arithmetic): the counter-based
    /// generator of dropout masks, as the CPU runtime computes it.
    pub(crate) fn split_mix(&self, value: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        let b = &self.builder;
        let constant = |value: u64| self.context.i64_type().const_int(value, false);
        let shifted_xor = |z: IntValue<'ctx>, bits: u64| -> Gen<IntValue<'ctx>> {
            let shifted = b
                .build_right_shift(z, constant(bits), false, "shift")
                .map_err(err)?;
            b.build_xor(z, shifted, "xor").map_err(err)
        };
        let z = b
            .build_int_add(value, constant(0x9E37_79B9_7F4A_7C15), "z")
            .map_err(err)?;
        let z = b
            .build_int_mul(shifted_xor(z, 30)?, constant(0xBF58_476D_1CE4_E5B9), "z")
            .map_err(err)?;
        let z = b
            .build_int_mul(shifted_xor(z, 27)?, constant(0x94D0_49BB_1331_11EB), "z")
            .map_err(err)?;
        shifted_xor(z, 31)
    }

    /// `a ^ b`.
    pub(crate) fn xor(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_xor(a, b, "xor").map_err(err)
    }

    /// `a >= b`, unsigned.
    pub(crate) fn at_least_unsigned(
        &self,
        a: IntValue<'ctx>,
        b: IntValue<'ctx>,
    ) -> Gen<IntValue<'ctx>> {
        self.builder
            .build_int_compare(IntPredicate::UGE, a, b, "at_least")
            .map_err(err)
    }

    /// `value >> bits`, unsigned.
    pub(crate) fn shift_right(&self, value: IntValue<'ctx>, bits: u64) -> Gen<IntValue<'ctx>> {
        let bits = self.context.i64_type().const_int(bits, false);
        self.builder
            .build_right_shift(value, bits, false, "shift")
            .map_err(err)
    }

    /// `a == b`.
    pub(crate) fn equal(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder
            .build_int_compare(IntPredicate::EQ, a, b, "equal")
            .map_err(err)
    }

    /// `condition ? a : b`.
    pub(crate) fn select(
        &self,
        condition: IntValue<'ctx>,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        Ok(self
            .builder
            .build_select(condition, a, b, "select")
            .map_err(err)?
            .into_float_value())
    }

    /// `a && b` of two conditions.
    pub(crate) fn and(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_and(a, b, "and").map_err(err)
    }

    /// `a || b` of two conditions.
    pub(crate) fn or(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_or(a, b, "or").map_err(err)
    }

    /// `x <predicate> y`, a condition.
    pub(crate) fn float_compare(
        &self,
        predicate: FloatPredicate,
        x: FloatValue<'ctx>,
        y: FloatValue<'ctx>,
    ) -> Gen<IntValue<'ctx>> {
        self.builder
            .build_float_compare(predicate, x, y, "fcmp")
            .map_err(err)
    }

    /// `condition ? a : b` of two integers.
    pub(crate) fn select_index(
        &self,
        condition: IntValue<'ctx>,
        a: IntValue<'ctx>,
        b: IntValue<'ctx>,
    ) -> Gen<IntValue<'ctx>> {
        Ok(self
            .builder
            .build_select(condition, a, b, "pick")
            .map_err(err)?
            .into_int_value())
    }

    /// `a < b` (signed).
    pub(crate) fn less(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder
            .build_int_compare(IntPredicate::SLT, a, b, "less")
            .map_err(err)
    }

    /// `if condition { then() } else { otherwise() }`.
    pub(crate) fn if_else(
        &self,
        condition: IntValue<'ctx>,
        then: impl FnOnce() -> Gen<()>,
        otherwise: impl FnOnce() -> Gen<()>,
    ) -> Gen<()> {
        let [yes, no, join] = ["then", "else", "join"]
            .map(|name| self.context.append_basic_block(self.function, name));
        self.builder
            .build_conditional_branch(condition, yes, no)
            .map_err(err)?;
        for (block, body) in [
            (yes, Box::new(then) as Box<dyn FnOnce() -> Gen<()>>),
            (no, Box::new(otherwise)),
        ] {
            self.builder.position_at_end(block);
            body()?;
            self.builder.build_unconditional_branch(join).map_err(err)?;
        }
        self.builder.position_at_end(join);
        Ok(())
    }

    /// The smaller of two signed integers.
    pub(crate) fn min(&self, a: IntValue<'ctx>, b: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        let less = self.less(a, b)?;
        Ok(self
            .builder
            .build_select(less, a, b, "min")
            .map_err(err)?
            .into_int_value())
    }

    pub(crate) fn fadd(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        self.contractible(self.builder.build_float_add(a, b, "fadd").map_err(err)?)
    }

    /// `value` with the `contract` flag: a multiply feeding an add may become one fused
    /// multiply-add (one rounding instead of two: never less accurate).
    fn contractible(&self, value: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        if let Some(instruction) = value.as_instruction() {
            let flags = instruction
                .get_fast_math_flags()
                .unwrap_or(FastMathFlags::empty());
            instruction
                .set_fast_math_flags(flags | FastMathFlags::AllowContract)
                .map_err(err)?;
        }
        Ok(value)
    }

    /// `a + b` that may be reassociated with the other adds of its chain: a running sum
    /// built from it vectorizes (partial sums in lanes) instead of adding one value at a
    /// time. The result differs from a sequential sum only by rounding (and the sign of
    /// a zero sum).
    pub(crate) fn fadd_reassociable(
        &self,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let sum = self.fadd(a, b)?;
        if let Some(instruction) = sum.as_instruction() {
            instruction
                .set_fast_math_flags(FastMathFlags::AllowReassoc | FastMathFlags::NoSignedZeros)
                .map_err(err)?;
        }
        Ok(sum)
    }

    pub(crate) fn fsub(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        self.contractible(self.builder.build_float_sub(a, b, "fsub").map_err(err)?)
    }

    pub(crate) fn fmul(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        self.contractible(self.builder.build_float_mul(a, b, "fmul").map_err(err)?)
    }

    pub(crate) fn fdiv(&self, a: FloatValue<'ctx>, b: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        self.builder.build_float_div(a, b, "fdiv").map_err(err)
    }

    /// The larger of `a` and `b` (the smaller with `largest` false), NaN when either is
    /// NaN, as torch's `maximum` / `minimum` (`llvm.maximum`: a running maximum built from
    /// it still vectorizes, as a compare, a max and a NaN blend per vector).
    pub(crate) fn extreme(
        &self,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
        largest: bool,
    ) -> Gen<FloatValue<'ctx>> {
        let name = if largest {
            "llvm.maximum"
        } else {
            "llvm.minimum"
        };
        self.intrinsic(name, &[a, b])
    }

    /// The larger of `a` and `b` for a running maximum that only bounds softmax's
    /// exponents: a compare and select that may assume no NaN, so the loop vectorizes to
    /// one `max` per vector. A NaN in the row still makes every output NaN, through its
    /// own exponential in the denominator; [`Kernel::extreme`] is for values that are
    /// results.
    pub(crate) fn softmax_bound(
        &self,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let flags = FastMathFlags::NoNaNs | FastMathFlags::NoSignedZeros;
        let compare = self
            .builder
            .build_float_compare(FloatPredicate::OGT, a, b, "cmp")
            .map_err(err)?;
        let pick = self
            .builder
            .build_select(compare, a, b, "pick")
            .map_err(err)?
            .into_float_value();
        for value in [compare.as_instruction(), pick.as_instruction()]
            .into_iter()
            .flatten()
        {
            value.set_fast_math_flags(flags).map_err(err)?;
        }
        Ok(pick)
    }

    /// `condition ? a : b` for a float compare of `x` with `y`.
    /// `x <predicate> y ? a : b`.
    pub(crate) fn select_if(
        &self,
        predicate: FloatPredicate,
        (x, y): (FloatValue<'ctx>, FloatValue<'ctx>),
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let condition = self
            .builder
            .build_float_compare(predicate, x, y, "cmp")
            .map_err(err)?;
        Ok(self
            .builder
            .build_select(condition, a, b, "select")
            .map_err(err)?
            .into_float_value())
    }

    /// An LLVM float intrinsic of one argument (`llvm.exp`, `llvm.sqrt`, ...).
    pub(crate) fn intrinsic(&self, name: &str, args: &[FloatValue<'ctx>]) -> Gen<FloatValue<'ctx>> {
        let intrinsic = Intrinsic::find(name).ok_or_else(|| err(format!("no intrinsic {name}")))?;
        let function = intrinsic
            .get_declaration(self.module, &[self.float.into()])
            .ok_or_else(|| err(format!("no declaration of {name}")))?;
        self.call_float(function, args, name)
    }

    /// The float `function(args)`.
    fn call_float(
        &self,
        function: FunctionValue<'ctx>,
        args: &[FloatValue<'ctx>],
        name: &str,
    ) -> Gen<FloatValue<'ctx>> {
        let args: Vec<_> = args.iter().map(|&arg| arg.into()).collect();
        self.builder
            .build_call(function, &args, name)
            .map_err(err)?
            .try_as_basic_value()
            .basic()
            .map(|value| value.into_float_value())
            .ok_or_else(|| err(format!("{name} returned nothing")))
    }

    /// `p(at)` for the coefficients of `p`, highest degree first (Horner's scheme).
    fn horner(&self, coefficients: &[f64], at: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let (&highest, rest) = coefficients
            .split_first()
            .ok_or_else(|| err("a polynomial without coefficients"))?;
        rest.iter()
            .try_fold(self.constant(highest), |acc, &coefficient| {
                self.fadd(self.fmul(acc, at)?, self.constant(coefficient))
            })
    }

    /// `e^x` inline: `2^n e^r` with `n` the nearest integer to `x / ln 2`, `r = x - n ln 2`
    /// in two steps (Cody and Waite) and Cephes' polynomial for `e^r` (within 2 ulp), so
    /// loops over it vectorize instead of calling libm once per value. `2^n` is applied
    /// as two factors, so results overflow to `inf` and underflow through the subnormals
    /// to 0 as libm's; NaN stays NaN. [`crate::fast_exp`] computes the same on the host.
    pub(crate) fn fast_exp(&self, x: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        if self.double {
            // f64 kernels keep full precision.
            return self.math("exp", &[x]);
        }
        let [lowest, highest] = crate::EXP_INPUT_RANGE.map(|bound| self.constant(bound.into()));
        // Ordered compares: a NaN passes both clamps and makes the polynomial NaN.
        let x = self.select_if(FloatPredicate::OLT, (x, lowest), lowest, x)?;
        let x = self.select_if(FloatPredicate::OGT, (x, highest), highest, x)?;
        let t = self.fmul(x, self.constant(std::f64::consts::LOG2_E))?;
        let n = self.intrinsic("llvm.rint", &[t])?;
        let [high, low] = crate::LN_2_SPLIT;
        let r = self.fsub(x, self.fmul(n, self.constant(high))?)?;
        let r = self.fsub(r, self.fmul(n, self.constant(low))?)?;
        let polynomial = self.horner(&crate::EXP_COEFFICIENTS, r)?;
        let square = self.fmul(r, r)?;
        let polynomial = self.fadd(
            self.fadd(self.fmul(polynomial, square)?, r)?,
            self.constant(1.0),
        )?;
        // The exponent as an integer: a NaN `n` becomes the lowest one (an ordered
        // compare), so the conversion is always defined; the NaN polynomial decides.
        let floor = self.constant(crate::EXP_LOWEST_EXPONENT.into());
        let n = self.select_if(FloatPredicate::OGE, (n, floor), n, floor)?;
        let i32_type = self.context.i32_type();
        let exponent = self
            .builder
            .build_float_to_signed_int(n, i32_type, "n")
            .map_err(err)?;
        let half = self
            .builder
            .build_right_shift(exponent, i32_type.const_int(1, false), true, "half")
            .map_err(err)?;
        let rest = self
            .builder
            .build_int_sub(exponent, half, "rest")
            .map_err(err)?;
        let power_of_two = |exponent: IntValue<'ctx>| -> Gen<FloatValue<'ctx>> {
            let biased = self
                .builder
                .build_int_add(exponent, i32_type.const_int(127, false), "biased")
                .map_err(err)?;
            let shifted = self
                .builder
                .build_left_shift(biased, i32_type.const_int(23, false), "bits")
                .map_err(err)?;
            Ok(self
                .builder
                .build_bit_cast(shifted, self.float, "scale")
                .map_err(err)?
                .into_float_value())
        };
        // Two products, never contracted or reassociated: the first is exact, the second
        // rounds once (into the subnormals or to inf where the result does).
        let scaled = self.fmul(polynomial, power_of_two(half)?)?;
        self.fmul(scaled, power_of_two(rest)?)
    }

    /// `ln(x)` inline in f32 kernels, as [`crate::fast_log`] (within 2 ulp, libm's
    /// values at 0, below 0, at `inf` and for NaN), so loops vectorize instead of
    /// calling libm once per value; f64 kernels call libm.
    pub(crate) fn fast_log(&self, x: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        if self.double {
            return self.math("log", &[x]);
        }
        let i32_type = self.context.i32_type();
        let int = |value: u64| i32_type.const_int(value, false);
        let compare = |predicate, a, b, name| {
            self.builder
                .build_float_compare(predicate, a, b, name)
                .map_err(err)
        };
        let select_int = |condition, a: IntValue<'ctx>, b: IntValue<'ctx>| -> Gen<IntValue<'ctx>> {
            Ok(self
                .builder
                .build_select(condition, a, b, "pick")
                .map_err(err)?
                .into_int_value())
        };
        let select_float =
            |condition, a: FloatValue<'ctx>, b: FloatValue<'ctx>| -> Gen<FloatValue<'ctx>> {
                Ok(self
                    .builder
                    .build_select(condition, a, b, "pick")
                    .map_err(err)?
                    .into_float_value())
            };
        // Subnormals times 2^23 are normal.
        let subnormal = compare(
            FloatPredicate::OLT,
            x,
            self.constant(f32::MIN_POSITIVE.into()),
            "subnormal",
        )?;
        let scaled = select_float(subnormal, self.fmul(x, self.constant(8_388_608.0))?, x)?;
        let bits = self
            .builder
            .build_bit_cast(scaled, i32_type, "bits")
            .map_err(err)?
            .into_int_value();
        let b = &self.builder;
        // `scaled = 2^(e + 1) m`, m in [1/2, 1).
        let biased = b
            .build_right_shift(bits, int(23), false, "biased")
            .map_err(err)?;
        let biased = b.build_and(biased, int(0xff), "biased").map_err(err)?;
        let offset = select_int(subnormal, int(126 + 23), int(126))?;
        let exponent = b.build_int_sub(biased, offset, "exponent").map_err(err)?;
        let mantissa = b
            .build_and(bits, int(0x007f_ffff), "mantissa")
            .map_err(err)?;
        let mantissa = b
            .build_or(mantissa, int(0x3f00_0000), "mantissa")
            .map_err(err)?;
        let m = b
            .build_bit_cast(mantissa, self.float, "m")
            .map_err(err)?
            .into_float_value();
        let low = compare(
            FloatPredicate::OLT,
            m,
            self.constant(std::f64::consts::FRAC_1_SQRT_2),
            "low",
        )?;
        let one = self.constant(1.0);
        let f = select_float(low, self.fsub(self.fadd(m, m)?, one)?, self.fsub(m, one)?)?;
        let exponent = b
            .build_int_sub(exponent, select_int(low, int(1), int(0))?, "e")
            .map_err(err)?;
        let e = b
            .build_signed_int_to_float(exponent, self.float, "e")
            .map_err(err)?;
        let square = self.fmul(f, f)?;
        let polynomial = self.horner(&crate::LOG_COEFFICIENTS, f)?;
        let [high, low_part] = crate::LN_2_SPLIT;
        let tail = self.fmul(self.fmul(polynomial, f)?, square)?;
        let tail = self.fadd(tail, self.fmul(e, self.constant(low_part))?)?;
        let tail = self.fsub(tail, self.fmul(square, self.constant(0.5))?)?;
        let value = self.fadd(self.fadd(f, tail)?, self.fmul(e, self.constant(high))?)?;
        // libm's values outside (0, inf): -inf at +-0, inf at inf, NaN below 0 and NaN.
        let infinity = self.constant(f64::INFINITY);
        let zero = self.constant(0.0);
        let finite_positive = b
            .build_and(
                compare(FloatPredicate::OGT, x, zero, "positive")?,
                compare(FloatPredicate::OLT, x, infinity, "finite")?,
                "inside",
            )
            .map_err(err)?;
        let edge = select_float(
            compare(FloatPredicate::OEQ, x, zero, "zero")?,
            self.constant(f64::NEG_INFINITY),
            select_float(
                compare(FloatPredicate::OEQ, x, infinity, "infinite")?,
                infinity,
                self.constant(f64::NAN),
            )?,
        )?;
        select_float(finite_positive, value, edge)
    }

    /// `erf(x)` inline in f32 kernels: `x p(x^2) / q(x^2)` on `x` clamped to [-4, 4]
    /// (beyond, erf is +-1 in f32), the rational approximation of Eigen and XLA
    /// ([`crate::fast_erf`] computes the same on the host), so loops vectorize: 17 vector operations and one division, about
    /// twice as fast as an erf from `exp` and two polynomials. NaN stays NaN, erf(-0) is
    /// -0. f64 kernels call libm.
    pub(crate) fn fast_erf(&self, x: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        if self.double {
            return self.math("erf", &[x]);
        }
        let [lowest, highest] = [-4.0, 4.0].map(|bound| self.constant(bound));
        // Ordered compares: a NaN passes both clamps and makes the result NaN.
        let x = self.select_if(FloatPredicate::OLT, (x, lowest), lowest, x)?;
        let x = self.select_if(FloatPredicate::OGT, (x, highest), highest, x)?;
        let square = self.fmul(x, x)?;
        let numerator = self.fmul(x, self.horner(&crate::ERF_NUMERATOR, square)?)?;
        let denominator = self.horner(&crate::ERF_DENOMINATOR, square)?;
        self.fdiv(numerator, denominator)
    }

    /// `tanh(x)` inline in f32 kernels as [`crate::fast_tanh`]: `x p(x^2) / q(x^2)` on `x`
    /// clamped to the rational's range (Eigen's), `x` itself near 0 and `+-1` from 9.1
    /// on, so loops vectorize; f64 kernels call libm.
    pub(crate) fn fast_tanh(&self, x: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        if self.double {
            return self.math("tanh", &[x]);
        }
        let [edge, tiny, saturated] = crate::TANH_BOUNDS.map(|bound| self.constant(bound.into()));
        let minus_edge = self.builder.build_float_neg(edge, "edge").map_err(err)?;
        // Ordered compares: a NaN passes both clamps and makes the rational NaN.
        let clamped = self.select_if(FloatPredicate::OLT, (x, minus_edge), minus_edge, x)?;
        let clamped = self.select_if(FloatPredicate::OGT, (clamped, edge), edge, clamped)?;
        let square = self.fmul(clamped, clamped)?;
        let numerator = self.fmul(clamped, self.horner(&crate::TANH_NUMERATOR, square)?)?;
        let rational = self.fdiv(numerator, self.horner(&crate::TANH_DENOMINATOR, square)?)?;
        let magnitude = self.intrinsic("llvm.fabs", &[x])?;
        let one = self.intrinsic("llvm.copysign", &[self.constant(1.0), x])?;
        let value = self.select_if(FloatPredicate::OGE, (magnitude, saturated), one, rational)?;
        self.select_if(FloatPredicate::OLT, (magnitude, tiny), x, value)
    }

    /// The math function `name` (`exp`, `log`, `sin`, `cos`, `pow`, `erf`, `tanh`) of
    /// the target: on the host LLVM's intrinsic (`llvm.exp`) or, for `erf` and `tanh`,
    /// the process's libm (`tanhf` in f32 kernels); on NVPTX libdevice's `__nv_tanhf`.
    pub(crate) fn math(&self, name: &str, args: &[FloatValue<'ctx>]) -> Gen<FloatValue<'ctx>> {
        let suffix = if self.double { "" } else { "f" };
        match (self.target, name) {
            (Target::Host, "erf" | "tanh") => self.external(&format!("{name}{suffix}"), args),
            (Target::Host, _) => self.intrinsic(&format!("llvm.{name}"), args),
            (Target::Nvptx, _) => self.external(&format!("__nv_{name}{suffix}"), args),
        }
    }

    /// A call of the external function `name` of `float`s.
    fn external(&self, name: &str, args: &[FloatValue<'ctx>]) -> Gen<FloatValue<'ctx>> {
        let function = self.module.get_function(name).unwrap_or_else(|| {
            let parameters: Vec<_> = args.iter().map(|_| self.float.into()).collect();
            self.module
                .add_function(name, self.float.fn_type(&parameters, false), None)
        });
        self.call_float(function, args, name)
    }

    fn truth(&self, value: inkwell::values::IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        self.builder
            .build_unsigned_int_to_float(value, self.float, "truth")
            .map_err(err)
    }

    fn nonzero(&self, value: FloatValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder
            .build_float_compare(FloatPredicate::UNE, value, self.constant(0.0), "nonzero")
            .map_err(err)
    }

    /// The value of `expr`, where `load(n)` gives input `n` at the current position.
    pub(crate) fn expr(
        &self,
        expr: &Expr,
        load: &dyn Fn(usize) -> Gen<FloatValue<'ctx>>,
    ) -> Gen<FloatValue<'ctx>> {
        Ok(match expr {
            Expr::Load(input) => load(*input)?,
            Expr::Const(value) => self.constant(value.0),
            Expr::Unary(op, x) => {
                let x = self.expr(x, load)?;
                self.unary(*op, x)?
            }
            Expr::Binary(op, a, b) => {
                let (a, b) = (self.expr(a, load)?, self.expr(b, load)?);
                self.binary(*op, a, b)?
            }
            Expr::Select(condition, a, b) => {
                let condition = self.expr(condition, load)?;
                let (a, b) = (self.expr(a, load)?, self.expr(b, load)?);
                let condition = self.nonzero(condition)?;
                self.builder
                    .build_select(condition, a, b, "select")
                    .map_err(err)?
                    .into_float_value()
            }
        })
    }

    /// `e^x` of a pointwise kernel: inline on the host ([`Self::fast_exp`]: LLVM's
    /// `llvm.exp` is a libm call per value, about 12x slower than the vectorized
    /// polynomial), libdevice's on the GPU (a hardware instruction there).
    fn exp(&self, x: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        match self.target {
            Target::Host => self.fast_exp(x),
            Target::Nvptx => self.math("exp", &[x]),
        }
    }

    fn sigmoid(&self, x: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let negative = self.builder.build_float_neg(x, "neg").map_err(err)?;
        let exp = self.exp(negative)?;
        self.fdiv(self.constant(1.0), self.fadd(self.constant(1.0), exp)?)
    }

    pub(crate) fn unary(&self, op: UnaryOp, x: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        match op {
            UnaryOp::Neg => self.builder.build_float_neg(x, "neg").map_err(err),
            UnaryOp::Abs => self.intrinsic("llvm.fabs", &[x]),
            UnaryOp::Exp => self.exp(x),
            UnaryOp::Log => match self.target {
                Target::Host => self.fast_log(x),
                Target::Nvptx => self.math("log", &[x]),
            },
            UnaryOp::Sqrt => self.intrinsic("llvm.sqrt", &[x]),
            UnaryOp::Rsqrt => {
                let root = self.intrinsic("llvm.sqrt", &[x])?;
                self.fdiv(self.constant(1.0), root)
            }
            UnaryOp::Square => self.fmul(x, x),
            UnaryOp::Sin => self.math("sin", &[x]),
            UnaryOp::Cos => self.math("cos", &[x]),
            UnaryOp::Tanh => self.fast_tanh(x),
            UnaryOp::Sigmoid => self.sigmoid(x),
            UnaryOp::Relu => {
                // `x < 0 ? 0 : x`, as libtorch: NaN and -0 pass through.
                let zero = self.constant(0.0);
                self.select_if(FloatPredicate::OLT, (x, zero), zero, x)
            }
            UnaryOp::Gelu => {
                let scaled = self.fmul(x, self.constant(std::f64::consts::FRAC_1_SQRT_2))?;
                let erf = self.fast_erf(scaled)?;
                let half = self.fmul(x, self.constant(0.5))?;
                let gelu = self.fmul(half, self.fadd(self.constant(1.0), erf)?)?;
                // NaN at -inf, as `-inf * 0` is here and in libtorch; at +inf, libtorch's
                // AVX-512 kernels give NaN, its AVX2 ones +inf (as this product does).
                if !self.gelu_nan_at_infinity {
                    return Ok(gelu);
                }
                let infinity = self.constant(f64::INFINITY);
                self.select_if(
                    FloatPredicate::OEQ,
                    (x, infinity),
                    self.constant(f64::NAN),
                    gelu,
                )
            }
            UnaryOp::GeluTanh => {
                let cube = self.fmul(self.fmul(x, x)?, x)?;
                let inner = self.fadd(x, self.fmul(cube, self.constant(0.044715))?)?;
                let scaled =
                    self.fmul(inner, self.constant((2.0 / std::f64::consts::PI).sqrt()))?;
                let tanh = self.fast_tanh(scaled)?;
                let half = self.fmul(x, self.constant(0.5))?;
                self.fmul(half, self.fadd(self.constant(1.0), tanh)?)
            }
            UnaryOp::Silu => self.fmul(x, self.sigmoid(x)?),
            UnaryOp::Erf => self.fast_erf(x),
            UnaryOp::Sign => {
                // Ordered compares: NaN and both zeros give 0 - 0 = +0, as torch.
                let zero = self.constant(0.0);
                let compare = |predicate, name| {
                    let test = self.builder.build_float_compare(predicate, x, zero, name);
                    self.truth(test.map_err(err)?)
                };
                let positive = compare(FloatPredicate::OGT, "positive")?;
                let negative = compare(FloatPredicate::OLT, "negative")?;
                self.builder
                    .build_float_sub(positive, negative, "sign")
                    .map_err(err)
            }
            UnaryOp::Not => {
                let zero = self
                    .builder
                    .build_float_compare(FloatPredicate::OEQ, x, self.constant(0.0), "zero")
                    .map_err(err)?;
                self.truth(zero)
            }
        }
    }

    pub(crate) fn binary(
        &self,
        op: BinaryOp,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let compare = |predicate: FloatPredicate| -> Gen<FloatValue<'ctx>> {
            let result = self
                .builder
                .build_float_compare(predicate, a, b, "cmp")
                .map_err(err)?;
            self.truth(result)
        };
        match op {
            BinaryOp::Add => self.fadd(a, b),
            BinaryOp::Sub => self.fsub(a, b),
            BinaryOp::Mul => self.fmul(a, b),
            BinaryOp::Div => self.fdiv(a, b),
            BinaryOp::Pow => self.math("pow", &[a, b]),
            BinaryOp::Maximum => self.extreme(a, b, true),
            BinaryOp::Minimum => self.extreme(a, b, false),
            BinaryOp::Eq => compare(FloatPredicate::OEQ),
            BinaryOp::Ne => compare(FloatPredicate::UNE),
            BinaryOp::Lt => compare(FloatPredicate::OLT),
            BinaryOp::Le => compare(FloatPredicate::OLE),
            BinaryOp::Gt => compare(FloatPredicate::OGT),
            BinaryOp::Ge => compare(FloatPredicate::OGE),
            BinaryOp::And | BinaryOp::Or => {
                let (a, b) = (self.nonzero(a)?, self.nonzero(b)?);
                let result = if op == BinaryOp::And {
                    self.builder.build_and(a, b, "and")
                } else {
                    self.builder.build_or(a, b, "or")
                }
                .map_err(err)?;
                self.truth(result)
            }
        }
    }
}
