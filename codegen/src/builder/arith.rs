//! Integer and float arithmetic, comparisons, selects and branches.

use super::*;

impl<'ctx> Kernel<'ctx, '_> {
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

    /// The float rounded toward zero, as an index (a non-negative float: its floor).
    pub(crate) fn to_index(&self, value: FloatValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder
            .build_float_to_signed_int(value, self.context.i64_type(), "index")
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

    /// `!a` of a condition.
    pub(crate) fn not(&self, a: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        self.builder.build_not(a, "not").map_err(err)
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

    /// torch's `remainder` of floats: `fmod(a, b)`, plus `b` when that is not 0 and its
    /// sign is not `b`'s (the result takes the divisor's sign; NaN for `b = 0`). Where
    /// `a / b` overflows libtorch's vectorized CPU loop gives NaN (Sleef's fmod gives up)
    /// and its scalar tail the exact remainder; this is the exact one.
    pub(crate) fn remainder(
        &self,
        a: FloatValue<'ctx>,
        b: FloatValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let modulo = self.builder.build_float_rem(a, b, "fmod").map_err(err)?;
        let zero = self.constant(0.0);
        let nonzero = self.float_compare(FloatPredicate::UNE, modulo, zero)?;
        let signs_differ = self.xor(
            self.float_compare(FloatPredicate::OLT, b, zero)?,
            self.float_compare(FloatPredicate::OLT, modulo, zero)?,
        )?;
        let adjusted = self.fadd(modulo, b)?;
        self.select(self.and(nonzero, signs_differ)?, adjusted, modulo)
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
}
