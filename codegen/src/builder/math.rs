//! The math functions: LLVM intrinsics, the inline `exp`, `log`, `erf` and `tanh`
//! polynomials of the host, and the target's math library (libm, libdevice).

use super::*;

impl<'ctx> Kernel<'ctx, '_> {
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

    /// The math function `name` (`exp`, `log`, `sin`, `cos`, `pow`, `erf`, `tanh`,
    /// `atan2`, `expm1`, `log1p`) of the target: on the host LLVM's intrinsic
    /// (`llvm.exp`) or, for `erf`, `tanh`, `atan2`, `expm1` and `log1p`, the process's libm (`tanhf` in f32 kernels), as on the
    /// simulated GPU; on NVPTX libdevice's `__nv_tanhf`.
    pub(crate) fn math(&self, name: &str, args: &[FloatValue<'ctx>]) -> Gen<FloatValue<'ctx>> {
        let suffix = if self.double { "" } else { "f" };
        match (self.target, name) {
            (Target::Host | Target::Simulated, "erf" | "tanh" | "atan2" | "expm1" | "log1p") => {
                self.external(&format!("{name}{suffix}"), args)
            }
            (Target::Host | Target::Simulated, _) => self.intrinsic(&format!("llvm.{name}"), args),
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
}
