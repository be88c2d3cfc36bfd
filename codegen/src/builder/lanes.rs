//! Loops and GPU lanes: counted loops, the parallel loop over a kernel's range (in order
//! on the host, grid-stride on a GPU), a task's lanes and their butterfly shuffles.

use super::*;

/// The most columns of a row a GPU lane keeps in registers ([`Kernel::register_chunks`]):
/// rows of up to 1024 values are read from memory once.
pub(crate) const ROW_REGISTERS: i64 = 32;

/// Columns from which a host kernel's rows are vectorized along the row, not across
/// rows ([`Kernel::parallel_rows_of_width`]): a vector of f32 on AVX-512. Measured on a
/// Xeon (AVX-512), 2M values: rows of 16 columns' bias and relu 0.60 -> 0.33 ms, layer
/// norm 0.92 -> 0.44 ms; rows of 8 columns' layer norm 0.44 -> 0.66 ms the other way.
const VECTOR_ROW_COLUMNS: i64 = 16;

impl<'ctx> Kernel<'ctx, '_> {
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
            Target::Nvptx | Target::Simulated => {
                let grid = self.grid()?;
                self.for_range_by(self.add(start, grid.global)?, end, grid.threads, body)
            }
        }
    }

    /// Whether the kernel runs on a GPU (NVPTX or the simulated GPU).
    pub(crate) fn on_gpu(&self) -> bool {
        self.target != Target::Host
    }

    /// Where this GPU thread is in its block and the block in the grid.
    pub(crate) fn block_place(&self) -> Gen<BlockPlace<'ctx>> {
        use crate::sim_abi::SpecialRegister;
        let thread = self.special_register(SpecialRegister::Thread)?;
        let threads = self.special_register(SpecialRegister::BlockThreads)?;
        let warp_lanes = self.i64(WARP_LANES);
        Ok(BlockPlace {
            block: self.special_register(SpecialRegister::Block)?,
            blocks: self.special_register(SpecialRegister::GridBlocks)?,
            thread,
            threads,
            warps: self.div(threads, warp_lanes)?,
            warp: self.div(thread, warp_lanes)?,
            lanes: Lanes {
                lane: self.rem(thread, warp_lanes)?,
                count: WARP_LANES,
            },
        })
    }

    /// On a GPU, the groups of as many consecutive tasks of `0..tasks` as a block has
    /// warps, a block at a time (grid-stride): `body(first task of the group)`. Every
    /// thread of a block runs the same groups, so they may meet at barriers
    /// ([`Kernel::barrier`]); warp `place.warp` takes the group's task `first + warp`.
    pub(crate) fn warp_groups(
        &self,
        place: &BlockPlace<'ctx>,
        tasks: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        let last = self.sub(place.warps, self.i64(1))?;
        let groups = self.div(self.add(tasks, last)?, place.warps)?;
        self.for_range_by(place.block, groups, place.blocks, |group| {
            body(self.mul(group, place.warps)?)
        })
    }

    /// Where this GPU thread is in the launch's grid (PTX's special registers).
    fn grid(&self) -> Gen<Grid<'ctx>> {
        use crate::sim_abi::SpecialRegister;
        let block_size = self.special_register(SpecialRegister::BlockThreads)?;
        let block_start = self.mul(self.special_register(SpecialRegister::Block)?, block_size)?;
        let thread = self.special_register(SpecialRegister::Thread)?;
        Ok(Grid {
            global: self.add(block_start, thread)?,
            threads: self.mul(
                self.special_register(SpecialRegister::GridBlocks)?,
                block_size,
            )?,
            thread,
        })
    }

    /// The lanes of a task of [`Kernel::parallel_rows`] on this target: a warp on a GPU,
    /// one on the host.
    pub(crate) fn lane_count(&self) -> i64 {
        match self.target {
            Target::Host => 1,
            Target::Nvptx | Target::Simulated => WARP_LANES,
        }
    }

    /// [`Kernel::lane_range`] over `width` columns, each with where the lane keeps its
    /// value of it in a kernel-local array of `width / lanes` (rounded up) values.
    pub(crate) fn lane_columns(
        &self,
        lanes: Lanes<'ctx>,
        width: i64,
        body: impl FnOnce(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        self.lane_range(lanes, width, |column| {
            body(column, self.lane_slot(lanes, column)?)
        })
    }

    /// Where a lane keeps its value of `column` (one of its [`Kernel::lane_range`]) in a
    /// kernel-local array ([`Kernel::lane_columns`]).
    pub(crate) fn lane_slot(
        &self,
        lanes: Lanes<'ctx>,
        column: IntValue<'ctx>,
    ) -> Gen<IntValue<'ctx>> {
        if lanes.count == 1 {
            Ok(column)
        } else {
            self.div(column, self.i64(lanes.count))
        }
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
        self.parallel_rows_of(self.lane_count(), start, end, body)
    }

    /// [`Kernel::parallel_rows_of`] `count` lanes, over rows of `width` columns that the
    /// body loops over. On the host, rows of at least [`VECTOR_ROW_COLUMNS`] columns
    /// are vectorized along their columns (or, a short row's loop unrolled, its columns
    /// side by side), never across rows: unrolled, 16 columns otherwise became a loop
    /// over 16 rows at once with a gather (and a scatter) per column, and the report's
    /// conv net spent a third of its time in its convolutions' bias-and-relu epilogues.
    /// Narrower rows are still vectorized across rows, which pays there (a softmax over
    /// 2 columns took 7x as long one row at a time, its `exp` unvectorized).
    pub(crate) fn parallel_rows_of_width(
        &self,
        (count, width): (i64, i64),
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>, Lanes<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        if self.target != Target::Host {
            return self.parallel_rows_of(count, start, end, body);
        }
        self.for_rows_of_width(width, start, end, |row| body(row, self.single_lane()))
    }

    /// `for row in start..end { body(row) }`, a loop over rows of `width` columns that
    /// the body loops over: on the host, from [`VECTOR_ROW_COLUMNS`] columns, never
    /// vectorized across rows ([`Kernel::parallel_rows_of_width`]).
    pub(crate) fn for_rows_of_width(
        &self,
        width: i64,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        let back = self.counted_loop(start, end, self.i64(1), body)?;
        if self.target == Target::Host && width >= VECTOR_ROW_COLUMNS {
            self.never_vectorize(back);
        }
        Ok(())
    }

    /// [`Kernel::parallel_rows`] with tasks of `count` lanes on a GPU: a warp
    /// ([`WARP_LANES`]) or a whole block ([`crate::GPU_BLOCK_THREADS`], launched so:
    /// [`crate::gpu_threads_per_task`]), whose lanes combine values through shared
    /// memory ([`Kernel::across_lanes`]).
    pub(crate) fn parallel_rows_of(
        &self,
        count: i64,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>, Lanes<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        match self.target {
            Target::Host => self.for_range(start, end, |row| body(row, self.single_lane())),
            Target::Nvptx | Target::Simulated => {
                let grid = self.grid()?;
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

    /// On a GPU, how many columns of a row of `width` each of `lanes` takes (its
    /// columns `lane + count * chunk`) when they fit [`ROW_REGISTERS`], so that a
    /// kernel may keep them in registers; `None` on the host and for longer rows.
    pub(crate) fn register_chunks(&self, lanes: Lanes<'ctx>, width: i64) -> Option<i64> {
        let count = lanes.count.max(1);
        let chunks = (width.max(0) + count - 1) / count;
        (lanes.count > 1 && chunks <= ROW_REGISTERS).then_some(chunks)
    }

    /// `body(column, chunk)` for each of a lane's columns `lane + count * chunk` of a row
    /// of `width` (`chunk < chunks`, [`Kernel::register_chunks`]), unrolled (each
    /// `chunk` a constant, so values kept by chunk stay in registers); the last chunk
    /// only in the lanes whose column is inside the row.
    pub(crate) fn unrolled_lane_range(
        &self,
        lanes: Lanes<'ctx>,
        (width, chunks): (i64, i64),
        mut body: impl FnMut(IntValue<'ctx>, i64) -> Gen<()>,
    ) -> Gen<()> {
        for chunk in 0..chunks {
            let column = self.add(lanes.lane, self.i64(chunk * lanes.count))?;
            if (chunk + 1) * lanes.count <= width {
                body(column, chunk)?;
            } else {
                let inside = self.less(column, self.i64(width))?;
                self.if_else(inside, || body(column, chunk), || Ok(()))?;
            }
        }
        Ok(())
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
        let mut offset = lanes.count.min(WARP_LANES) / 2;
        while offset >= 1 {
            value = combine(value, self.shuffle_xor(value, offset)?)?;
            offset /= 2;
        }
        if lanes.count <= WARP_LANES {
            return Ok(value);
        }
        // A block's lanes: each warp's value through shared memory, combined in warp
        // order by every lane (so all get the same bits). The first barrier keeps a
        // slot from being written while another lane still reads its last value.
        let warps = lanes.count / WARP_LANES;
        let shared = self.shared_floats(warps)?;
        self.barrier()?;
        let lane_in_warp = self.rem(lanes.lane, self.i64(WARP_LANES))?;
        let warp = self.div(lanes.lane, self.i64(WARP_LANES))?;
        self.if_else(
            self.equal(lane_in_warp, self.i64(0))?,
            || self.store_shared(shared, warp, value),
            || Ok(()),
        )?;
        self.barrier()?;
        let mut combined = self.load_shared(shared, self.i64(0))?;
        for index in 1..warps {
            combined = combine(combined, self.load_shared(shared, self.i64(index))?)?;
        }
        Ok(combined)
    }

    /// The `value` of lane `lane ^ offset` of this warp (`shfl.sync.bfly` over the
    /// whole warp; an f64 as its two 32-bit halves).
    pub(crate) fn shuffle_xor(
        &self,
        value: FloatValue<'ctx>,
        offset: i64,
    ) -> Gen<FloatValue<'ctx>> {
        let i32 = self.context.i32_type();
        let constant = |value: u64| i32.const_int(value, false);
        // The whole warp, `lane ^ offset`, no clamp (`c` = 0x1f: one segment of 32).
        let (whole_warp, lane_offset, clamp) = (
            constant(u64::from(u32::MAX)),
            constant(offset as u64),
            constant(0x1f),
        );
        let shuffle = |bits: bool, value: BasicValueEnum<'ctx>| -> Gen<BasicValueEnum<'ctx>> {
            if self.target == Target::Simulated {
                let mode = constant(crate::sim_abi::ShuffleMode::Butterfly as u64);
                let word = self
                    .builder
                    .build_bit_cast(value, i32, "word")
                    .map_err(err)?
                    .into_int_value();
                let moved = self.simulator_call(
                    crate::sim_abi::SHUFFLE,
                    i32.fn_type(&[i32.into(); 5], false),
                    &[
                        mode.into(),
                        whole_warp.into(),
                        word.into(),
                        lane_offset.into(),
                        clamp.into(),
                    ],
                )?;
                return self
                    .builder
                    .build_bit_cast(moved, value.get_type(), "shuffled")
                    .map_err(err);
            }
            let name = if bits {
                "llvm.nvvm.shfl.sync.bfly.i32"
            } else {
                "llvm.nvvm.shfl.sync.bfly.f32"
            };
            self.nvvm(
                name,
                &[
                    whole_warp.into(),
                    value.into(),
                    lane_offset.into(),
                    clamp.into(),
                ],
            )
        };
        if !self.double {
            return Ok(shuffle(false, value.into())?.into_float_value());
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
            let moved = shuffle(true, part)?;
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

    /// A special register of this GPU thread (an i32 of PTX's
    /// `llvm.nvvm.read.ptx.sreg.*`, or the simulator's) as an i64.
    fn special_register(&self, register: crate::sim_abi::SpecialRegister) -> Gen<IntValue<'ctx>> {
        use crate::sim_abi::SpecialRegister;
        let i32 = self.context.i32_type();
        let value = if self.target == Target::Simulated {
            let code = i32.const_int(register as u64, false);
            self.simulator_call(
                crate::sim_abi::SPECIAL_REGISTER,
                i32.fn_type(&[i32.into()], false),
                &[code.into()],
            )?
        } else {
            let name = match register {
                SpecialRegister::Thread => "llvm.nvvm.read.ptx.sreg.tid.x",
                SpecialRegister::BlockThreads => "llvm.nvvm.read.ptx.sreg.ntid.x",
                SpecialRegister::Block => "llvm.nvvm.read.ptx.sreg.ctaid.x",
                SpecialRegister::GridBlocks => "llvm.nvvm.read.ptx.sreg.nctaid.x",
            };
            self.nvvm(name, &[])?
        };
        self.builder
            .build_int_z_extend(value.into_int_value(), self.context.i64_type(), "index")
            .map_err(err)
    }

    /// `bar.sync 0`: waits until every thread of the block is here.
    pub(crate) fn barrier(&self) -> Gen<()> {
        if self.target == Target::Simulated {
            let function_type = self.context.void_type().fn_type(&[], false);
            let function = self
                .module
                .get_function(crate::sim_abi::BARRIER)
                .unwrap_or_else(|| {
                    self.module
                        .add_function(crate::sim_abi::BARRIER, function_type, None)
                });
            self.builder.build_call(function, &[], "").map_err(err)?;
            return Ok(());
        }
        let name = "llvm.nvvm.barrier0";
        let intrinsic = Intrinsic::find(name).ok_or_else(|| err(format!("no intrinsic {name}")))?;
        let function = intrinsic
            .get_declaration(self.module, &[])
            .ok_or_else(|| err(format!("no declaration of {name}")))?;
        self.builder.build_call(function, &[], "").map_err(err)?;
        Ok(())
    }

    /// The block's `count` floats of shared memory (the kernel's only shared array:
    /// [`crate::gpu_shared_bytes`] tells a launch its size). On the simulated GPU the
    /// block's shared memory, its accesses checked; on NVPTX an `addrspace(3)` array.
    pub(crate) fn shared_floats(&self, count: i64) -> Gen<PointerValue<'ctx>> {
        let ptr = self.context.ptr_type(AddressSpace::default());
        if self.target == Target::Simulated {
            return Ok(self
                .simulator_call(crate::sim_abi::SHARED, ptr.fn_type(&[], false), &[])?
                .into_pointer_value());
        }
        let name = format!("{}.shared", self.function.get_name().to_string_lossy());
        let array = self.float.array_type(u32::try_from(count).map_err(err)?);
        let global = match self.module.get_global(&name) {
            Some(global) => global,
            None => {
                let global = self
                    .module
                    .add_global(array, Some(AddressSpace::from(3u16)), &name);
                global.set_linkage(inkwell::module::Linkage::Internal);
                global.set_initializer(&array.get_undef());
                global
            }
        };
        self.builder
            .build_address_space_cast(global.as_pointer_value(), ptr, "shared")
            .map_err(err)
    }

    /// Value `index` of shared memory `shared` ([`Kernel::shared_floats`]).
    pub(crate) fn load_shared(
        &self,
        shared: PointerValue<'ctx>,
        index: IntValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let address =
            unsafe { self.builder.build_gep(self.float, shared, &[index], "at") }.map_err(err)?;
        let bytes = if self.double { 8 } else { 4 };
        let address = self.checked(address, bytes, false)?;
        Ok(self
            .builder
            .build_load(self.float, address, "shared_value")
            .map_err(err)?
            .into_float_value())
    }

    /// Stores `value` as value `index` of shared memory `shared`.
    pub(crate) fn store_shared(
        &self,
        shared: PointerValue<'ctx>,
        index: IntValue<'ctx>,
        value: FloatValue<'ctx>,
    ) -> Gen<()> {
        let address =
            unsafe { self.builder.build_gep(self.float, shared, &[index], "at") }.map_err(err)?;
        let bytes = if self.double { 8 } else { 4 };
        let address = self.checked(address, bytes, true)?;
        self.builder.build_store(address, value).map_err(err)?;
        Ok(())
    }

    /// A call of the NVVM intrinsic `name` (not overloaded).
    pub(super) fn nvvm(
        &self,
        name: &str,
        args: &[BasicMetadataValueEnum<'ctx>],
    ) -> Gen<BasicValueEnum<'ctx>> {
        let intrinsic = Intrinsic::find(name).ok_or_else(|| err(format!("no intrinsic {name}")))?;
        let function = intrinsic
            .get_declaration(self.module, &[])
            .ok_or_else(|| err(format!("no declaration of {name}")))?;
        self.builder
            .build_call(function, args, name)
            .map_err(err)?
            .try_as_basic_value()
            .basic()
            .ok_or_else(|| err(format!("{name} returned nothing")))
    }

    /// A call of the simulator's function `name` ([`crate::sim_abi`]) of type `ty`,
    /// declared on first use.
    pub(crate) fn simulator_call(
        &self,
        name: &str,
        ty: inkwell::types::FunctionType<'ctx>,
        args: &[BasicMetadataValueEnum<'ctx>],
    ) -> Gen<BasicValueEnum<'ctx>> {
        let function = self
            .module
            .get_function(name)
            .unwrap_or_else(|| self.module.add_function(name, ty, None));
        self.builder
            .build_call(function, args, name)
            .map_err(err)?
            .try_as_basic_value()
            .basic()
            .ok_or_else(|| err(format!("{name} returned nothing")))
    }

    /// `for (i = start; i < end; i += step) { body(i) }` (`step > 0`).
    pub(crate) fn for_range_by(
        &self,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        step: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        self.counted_loop(start, end, step, body).map(|_| ())
    }

    /// [`Kernel::for_range_by`], returning the branch back to the loop's header (where
    /// LLVM reads a loop's metadata).
    fn counted_loop(
        &self,
        start: IntValue<'ctx>,
        end: IntValue<'ctx>,
        step: IntValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<InstructionValue<'ctx>> {
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
        let back = self
            .builder
            .build_unconditional_branch(header)
            .map_err(err)?;
        self.builder.position_at_end(exit);
        Ok(back)
    }

    /// Tells LLVM's loop vectorizer to leave alone the loop whose branch back to its
    /// header is `back` (`!llvm.loop !{self, !{"llvm.loop.vectorize.enable", false}}`).
    fn never_vectorize(&self, back: InstructionValue<'ctx>) {
        use inkwell::context::AsContextRef;
        use inkwell::llvm_sys::core::{
            LLVMGetMDKindIDInContext, LLVMMDNodeInContext2, LLVMMDStringInContext2,
            LLVMMetadataAsValue, LLVMSetMetadata, LLVMValueAsMetadata,
        };
        use inkwell::llvm_sys::debuginfo::{LLVMMetadataReplaceAllUsesWith, LLVMTemporaryMDNode};
        use inkwell::values::AsValueRef;
        let context = self.context.as_ctx_ref();
        let option = "llvm.loop.vectorize.enable";
        let kind = "llvm.loop";
        let off = self.context.bool_type().const_zero();
        // SAFETY: every node is made in the kernel's context from values of it; the
        // temporary node (a loop's id names itself first) is replaced by the loop's node,
        // which frees it, before anything else reads it.
        unsafe {
            let name = LLVMMDStringInContext2(context, option.as_ptr().cast(), option.len());
            let mut pair = [name, LLVMValueAsMetadata(off.as_value_ref())];
            let setting = LLVMMDNodeInContext2(context, pair.as_mut_ptr(), pair.len());
            let itself = LLVMTemporaryMDNode(context, std::ptr::null_mut(), 0);
            let mut operands = [itself, setting];
            let id = LLVMMDNodeInContext2(context, operands.as_mut_ptr(), operands.len());
            LLVMMetadataReplaceAllUsesWith(itself, id);
            let kind = LLVMGetMDKindIDInContext(context, kind.as_ptr().cast(), kind.len() as u32);
            LLVMSetMetadata(back.as_value_ref(), kind, LLVMMetadataAsValue(context, id));
        }
    }
}
