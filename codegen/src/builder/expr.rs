//! Pointwise expressions: a fused [`Expr`] over a kernel's loads, and the unary and
//! binary functions it applies (libtorch's semantics).

use super::*;

impl<'ctx> Kernel<'ctx, '_> {
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
            Expr::Integers(_) => {
                return Err(crate::CodegenError::new(
                    "i64 values are moved, never computed on in a float expression",
                ))
            }
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
    /// polynomial), libdevice's on the GPU (a hardware instruction there), libm's on the
    /// simulated GPU.
    fn exp(&self, x: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        match self.target {
            Target::Host => self.fast_exp(x),
            Target::Nvptx | Target::Simulated => self.math("exp", &[x]),
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
                Target::Nvptx | Target::Simulated => self.math("log", &[x]),
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
            UnaryOp::Expm1 => self.math("expm1", &[x]),
            UnaryOp::Log1p => self.math("log1p", &[x]),
            UnaryOp::Reciprocal => self.fdiv(self.constant(1.0), x),
            UnaryOp::Floor => self.intrinsic("llvm.floor", &[x]),
            UnaryOp::Ceil => self.intrinsic("llvm.ceil", &[x]),
            UnaryOp::Round => self.intrinsic("llvm.roundeven", &[x]),
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
            BinaryOp::Atan2 => self.math("atan2", &[a, b]),
            BinaryOp::Remainder => self.remainder(a, b),
            BinaryOp::Maximum => self.extreme(a, b, true),
            BinaryOp::Minimum => self.extreme(a, b, false),
            BinaryOp::Eq => compare(FloatPredicate::OEQ),
            BinaryOp::Ne => compare(FloatPredicate::UNE),
            BinaryOp::Lt => compare(FloatPredicate::OLT),
            BinaryOp::Le => compare(FloatPredicate::OLE),
            BinaryOp::Gt => compare(FloatPredicate::OGT),
            BinaryOp::Ge => compare(FloatPredicate::OGE),
            BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => {
                let (a, b) = (self.nonzero(a)?, self.nonzero(b)?);
                let result = match op {
                    BinaryOp::And => self.builder.build_and(a, b, "and"),
                    BinaryOp::Or => self.builder.build_or(a, b, "or"),
                    _ => self.builder.build_xor(a, b, "xor"),
                }
                .map_err(err)?;
                self.truth(result)
            }
        }
    }
}
