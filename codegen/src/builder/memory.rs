//! Loads and stores: buffers in the storage type (bf16 widened and rounded), the
//! kernel's own arrays, accumulators and index variables.

use super::*;

impl<'ctx> Kernel<'ctx, '_> {
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
            let address = self.in_buffer(address, base, 2, false)?;
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
        let address = self.in_buffer(address, base, 8, false)?;
        let value = self.builder.build_load(i64, address, "n").map_err(err)?;
        self.scoped_load(value, base)?;
        Ok(value.into_int_value())
    }

    /// Stores the i64 `value` as value `index` of buffer `base` (a buffer of positions).
    pub(crate) fn store_i64(
        &self,
        base: PointerValue<'ctx>,
        index: IntValue<'ctx>,
        value: IntValue<'ctx>,
    ) -> Gen<()> {
        let i64 = self.context.i64_type();
        let address = unsafe { self.builder.build_gep(i64, base, &[index], "at") }.map_err(err)?;
        let address = self.in_buffer(address, base, 8, true)?;
        let store = self.builder.build_store(address, value).map_err(err)?;
        self.scoped(store, base)
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
            let half = self.bf16_bits(value)?;
            let narrow = self
                .builder
                .build_int_truncate(half, self.context.i16_type(), "bf16")
                .map_err(err)?;
            let address = unsafe {
                self.builder
                    .build_gep(self.context.i16_type(), base, &[index], "at")
            }
            .map_err(err)?;
            let address = self.in_buffer(address, base, 2, true)?;
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
        let address = self.in_buffer(address, base, self.float_bytes(), false)?;
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
        let address = self.in_buffer(address, base, self.float_bytes(), true)?;
        let store = self.builder.build_store(address, value).map_err(err)?;
        self.scoped(store, base)
    }

    /// Buffer `buffer` as values of the compute type whatever the storage (for
    /// [`Kernel::load_local`] and [`Kernel::store_local`]): attention's statistics.
    pub(crate) fn compute_type(&self, buffer: PointerValue<'ctx>) -> Local<'ctx> {
        Local(buffer)
    }

    /// Bytes of a float of the compute type.
    fn float_bytes(&self) -> i64 {
        if self.double {
            8
        } else {
            4
        }
    }

    /// [`Kernel::checked`] where `base` is a buffer of the `args` array (not a local
    /// array).
    fn in_buffer(
        &self,
        address: PointerValue<'ctx>,
        base: PointerValue<'ctx>,
        bytes: i64,
        store: bool,
    ) -> Gen<PointerValue<'ctx>> {
        if self.buffer_kind(base).is_none() {
            return Ok(address);
        }
        self.checked(address, bytes, store)
    }

    /// The address an access of `bytes` at `address` of device memory goes to: on the
    /// simulated GPU the simulator checks it against the device's buffers
    /// ([`crate::sim_abi::ACCESS`]), elsewhere `address` itself.
    pub(crate) fn checked(
        &self,
        address: PointerValue<'ctx>,
        bytes: i64,
        store: bool,
    ) -> Gen<PointerValue<'ctx>> {
        if self.target != Target::Simulated {
            return Ok(address);
        }
        let (ptr, i64, i32) = (
            self.context.ptr_type(AddressSpace::default()),
            self.context.i64_type(),
            self.context.i32_type(),
        );
        let kind = i32.const_int(u64::from(store), false);
        Ok(self
            .simulator_call(
                crate::sim_abi::ACCESS,
                ptr.fn_type(&[ptr.into(), i64.into(), i32.into()], false),
                &[address.into(), self.i64(bytes).into(), kind.into()],
            )?
            .into_pointer_value())
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
    pub(super) fn alloca_in_entry(
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
}
