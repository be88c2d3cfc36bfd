//! Tensor-core products on a GPU: bf16 values two to a 32-bit register, and PTX's
//! `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` of a warp's fragments (NVVM's
//! intrinsic on NVPTX, the simulator's whole-warp rendezvous on the simulated GPU). The
//! fragment layouts are the PTX ISA's ("Matrix Fragments for mma.m16n8k16 with floating
//! point type"): lane `l` has `group = l / 4` and `thread = l % 4`.

use super::*;
use inkwell::types::BasicType;

/// A warp's `A` fragment (four registers of two bf16), `B` fragment (two) and `C` / `D`
/// fragment (four f32) of one `m16n8k16` product.
pub(crate) type FragmentA<'ctx> = [IntValue<'ctx>; 4];
pub(crate) type FragmentB<'ctx> = [IntValue<'ctx>; 2];
pub(crate) type FragmentC<'ctx> = [FloatValue<'ctx>; 4];

impl<'ctx> Kernel<'ctx, '_> {
    /// How the kernel keeps floats in memory.
    pub(crate) fn storage(&self) -> Storage {
        if self.bf16 {
            Storage::Bf16
        } else {
            Storage::Compute
        }
    }

    /// The float type the kernel computes in.
    pub(crate) fn float_type(&self) -> nestor_passes::FloatType {
        if self.double {
            nestor_passes::FloatType::F64
        } else {
            nestor_passes::FloatType::F32
        }
    }

    /// `value` (f32) rounded to the nearest even bf16, NaN to bf16's quiet NaN (torch's
    /// conversion): its 16 bits, in the low half of an i32.
    pub(crate) fn bf16_bits(&self, value: FloatValue<'ctx>) -> Gen<IntValue<'ctx>> {
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
        Ok(self
            .builder
            .build_select(nan, constant(0x7FC0), rounded, "half")
            .map_err(err)?
            .into_int_value())
    }

    /// Two f32 as bf16 ([`Kernel::bf16_bits`]) in one register, `low` in the low half
    /// (the lower index of a fragment's pair).
    pub(crate) fn pack_bf16(
        &self,
        low: FloatValue<'ctx>,
        high: FloatValue<'ctx>,
    ) -> Gen<IntValue<'ctx>> {
        let i32 = self.context.i32_type();
        let high = self
            .builder
            .build_left_shift(self.bf16_bits(high)?, i32.const_int(16, false), "high")
            .map_err(err)?;
        self.builder
            .build_or(self.bf16_bits(low)?, high, "pair")
            .map_err(err)
    }

    /// `D = A B + C` of the warp's fragments: every lane of the warp must call it, with
    /// its own fragments; it returns the lane's four values of `D` (f32 accumulation).
    pub(crate) fn mma_bf16(
        &self,
        a: FragmentA<'ctx>,
        b: FragmentB<'ctx>,
        c: FragmentC<'ctx>,
    ) -> Gen<FragmentC<'ctx>> {
        match self.target {
            Target::Host => Err(err("tensor-core products are GPU instructions")),
            Target::Nvptx => {
                let args: Vec<BasicMetadataValueEnum<'ctx>> = a
                    .iter()
                    .chain(&b)
                    .map(|&register| register.into())
                    .chain(c.iter().map(|&value| value.into()))
                    .collect();
                let d = self
                    .nvvm("llvm.nvvm.mma.m16n8k16.row.col.bf16", &args)?
                    .into_struct_value();
                let value = |index: u32| -> Gen<FloatValue<'ctx>> {
                    Ok(self
                        .builder
                        .build_extract_value(d, index, "d")
                        .map_err(err)?
                        .into_float_value())
                };
                Ok([value(0)?, value(1)?, value(2)?, value(3)?])
            }
            Target::Simulated => self.simulated_mma(a, b, c),
        }
    }

    /// [`Kernel::mma_bf16`] on the simulated GPU: the fragments in arrays of the
    /// thread's own, passed to the simulator ([`crate::sim_abi::MMA_BF16`]).
    fn simulated_mma(
        &self,
        a: FragmentA<'ctx>,
        b: FragmentB<'ctx>,
        c: FragmentC<'ctx>,
    ) -> Gen<FragmentC<'ctx>> {
        let f32 = self.context.f32_type();
        let array = |values: &[BasicValueEnum<'ctx>], name: &str| -> Gen<PointerValue<'ctx>> {
            let ty = values[0].get_type();
            let slot = self.alloca_in_entry(ty.array_type(values.len() as u32).into(), name)?;
            for (index, value) in (0u64..).zip(values) {
                let at = unsafe {
                    self.builder
                        .build_gep(ty, slot, &[self.i64(index as i64)], "at")
                }
                .map_err(err)?;
                self.builder.build_store(at, *value).map_err(err)?;
            }
            Ok(slot)
        };
        let registers = |values: &[IntValue<'ctx>]| -> Vec<BasicValueEnum<'ctx>> {
            values.iter().map(|&value| value.into()).collect()
        };
        let floats: Vec<BasicValueEnum<'ctx>> = c.iter().map(|&value| value.into()).collect();
        let (a, b, c) = (
            array(&registers(&a), "mma_a")?,
            array(&registers(&b), "mma_b")?,
            array(&floats, "mma_c")?,
        );
        let d = self.alloca_in_entry(f32.array_type(4).into(), "mma_d")?;
        let ptr = self.context.ptr_type(AddressSpace::default());
        let function = self
            .module
            .get_function(crate::sim_abi::MMA_BF16)
            .unwrap_or_else(|| {
                let ty = self.context.void_type().fn_type(&[ptr.into(); 4], false);
                self.module.add_function(crate::sim_abi::MMA_BF16, ty, None)
            });
        self.builder
            .build_call(function, &[d.into(), a.into(), b.into(), c.into()], "")
            .map_err(err)?;
        let value = |index: i64| -> Gen<FloatValue<'ctx>> {
            let at =
                unsafe { self.builder.build_gep(f32, d, &[self.i64(index)], "at") }.map_err(err)?;
            Ok(self
                .builder
                .build_load(f32, at, "d")
                .map_err(err)?
                .into_float_value())
        };
        Ok([value(0)?, value(1)?, value(2)?, value(3)?])
    }
}
