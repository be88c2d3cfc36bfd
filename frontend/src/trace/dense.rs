//! The dense tensor handle: a `tch::Tensor` that records itself while tracing, for
//! dense intermediates such as pooled features, logits and losses.

use nestor_ir::{BinaryOp, LossReduction as IrLoss, Op, ReduceOp, UnaryOp};
use tch::{Kind, Reduction, Tensor};

use super::record::{check_dtype, record, Arg, TraceRef};
use crate::{dtype_of, LossReduction, NestedError, Result};

/// A dense tensor that takes part in traces. In eager mode it is just its tensor.
pub struct Dense {
    pub(crate) tensor: Tensor,
    pub(crate) trace: Option<TraceRef>,
}

impl From<Tensor> for Dense {
    fn from(tensor: Tensor) -> Self {
        Self {
            tensor,
            trace: None,
        }
    }
}

impl std::fmt::Debug for Dense {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dense")
            .field("tensor", &self.tensor)
            .field("traced", &self.trace.is_some())
            .finish()
    }
}

impl Dense {
    /// The tensor (a concrete read while tracing, which fails the trace).
    pub fn tensor(&self) -> &Tensor {
        if let Some(trace) = &self.trace {
            trace.concrete_read("Dense::tensor");
        }
        &self.tensor
    }

    /// The tensor, giving up the handle (a concrete read while tracing).
    pub fn into_tensor(self) -> Tensor {
        if let Some(trace) = &self.trace {
            trace.concrete_read("Dense::into_tensor");
        }
        self.tensor
    }

    /// The tensor, for the library's own operators.
    pub(crate) fn raw(&self) -> &Tensor {
        &self.tensor
    }

    /// The scalar type.
    pub fn kind(&self) -> Kind {
        self.tensor.kind()
    }

    /// A result recorded as `build` of `args` when they are traced.
    pub(crate) fn traced(
        tensor: Tensor,
        args: &[Arg<'_>],
        op: &'static str,
        build: impl FnOnce(&[nestor_ir::ValueId]) -> Op,
    ) -> Result<Self> {
        let trace = record(args, op, build)?;
        if let Some(trace) = &trace {
            check_dtype(trace, tensor.kind(), op)?;
        }
        Ok(Self { tensor, trace })
    }

    fn arg(&self) -> Arg<'_> {
        Arg::Dense(&self.tensor, self.trace.as_ref())
    }

    /// `x W^T + b` over the last dim.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Dense> {
        let output = self.tensor.f_linear(weight, bias)?;
        let mut args = vec![self.arg(), Arg::Dense(weight, None)];
        args.extend(bias.map(|bias| Arg::Dense(bias, None)));
        Dense::traced(output, &args, "linear", |ids| Op::Linear {
            x: ids[0],
            weight: ids[1],
            bias: ids.get(2).copied(),
        })
    }

    fn unary(&self, op: UnaryOp, output: Tensor) -> Result<Dense> {
        Dense::traced(output, &[self.arg()], op.word(), |ids| Op::Unary {
            op,
            x: ids[0],
        })
    }

    /// `max(x, 0)`.
    pub fn relu(&self) -> Result<Dense> {
        self.unary(UnaryOp::Relu, self.tensor.f_relu()?)
    }

    /// Hyperbolic tangent.
    pub fn tanh(&self) -> Result<Dense> {
        self.unary(UnaryOp::Tanh, self.tensor.f_tanh()?)
    }

    /// Exact GELU.
    pub fn gelu(&self) -> Result<Dense> {
        self.unary(UnaryOp::Gelu, self.tensor.f_gelu("none")?)
    }

    fn binary(&self, op: BinaryOp, other: &Dense, output: Tensor) -> Result<Dense> {
        Dense::traced(output, &[self.arg(), other.arg()], op.word(), |ids| {
            Op::Binary {
                op,
                lhs: ids[0],
                rhs: ids[1],
            }
        })
    }

    /// `self + other`.
    pub fn add(&self, other: &Dense) -> Result<Dense> {
        self.binary(BinaryOp::Add, other, self.tensor.f_add(&other.tensor)?)
    }

    /// `self * other`.
    pub fn mul(&self, other: &Dense) -> Result<Dense> {
        self.binary(BinaryOp::Mul, other, self.tensor.f_mul(&other.tensor)?)
    }

    /// `self * factor`.
    pub fn scale(&self, factor: f64) -> Result<Dense> {
        let kind = self.tensor.kind();
        let dtype = dtype_of(kind).ok_or_else(|| NestedError::Unsupported {
            op: "scale",
            reason: format!("{kind:?}"),
        })?;
        let output = self.tensor.f_mul_scalar(factor)?;
        Dense::traced(
            output,
            &[self.arg(), Arg::Const(factor, dtype)],
            "mul",
            |ids| Op::Binary {
                op: BinaryOp::Mul,
                lhs: ids[0],
                rhs: ids[1],
            },
        )
    }

    /// Softmax along `dim` (not the batch dim 0).
    pub fn softmax(&self, dim: i64) -> Result<Dense> {
        let output = self.tensor.f_softmax(dim, None::<Kind>)?;
        Dense::traced(output, &[self.arg()], "softmax", |ids| Op::Softmax {
            x: ids[0],
            axis: dim,
            log: false,
        })
    }

    /// Mean of every value.
    pub fn mean_all(&self) -> Result<Dense> {
        self.reduce_all(ReduceOp::Mean, self.tensor.f_mean(None::<Kind>)?)
    }

    /// Sum of every value.
    pub fn sum_all(&self) -> Result<Dense> {
        self.reduce_all(ReduceOp::Sum, self.tensor.f_sum(None::<Kind>)?)
    }

    /// `output`, the reduction `op` of every value, recorded.
    fn reduce_all(&self, op: ReduceOp, output: Tensor) -> Result<Dense> {
        Dense::traced(output, &[self.arg()], op.word(), |ids| Op::Reduce {
            op,
            x: ids[0],
            dims: vec![],
            keepdim: false,
            correction: 0,
        })
    }

    /// Cross entropy of logits `[N, C]` against class ids `[N]` (a handle, so that
    /// the targets of a traced loss are an input of the graph).
    pub fn cross_entropy(
        &self,
        target: &Dense,
        ignore_index: i64,
        label_smoothing: f64,
        reduction: LossReduction,
    ) -> Result<Dense> {
        let (torch_reduction, ir) = match reduction {
            LossReduction::Mean => (Reduction::Mean, IrLoss::Mean),
            LossReduction::Sum => (Reduction::Sum, IrLoss::Sum),
            LossReduction::None => (Reduction::None, IrLoss::None),
        };
        let output = self.tensor.f_cross_entropy_loss(
            &target.tensor,
            None::<Tensor>,
            torch_reduction,
            ignore_index,
            label_smoothing,
        )?;
        Dense::traced(
            output,
            &[
                self.arg(),
                Arg::Dense(&target.tensor, target.trace.as_ref()),
            ],
            "cross_entropy",
            |ids| Op::CrossEntropy {
                logits: ids[0],
                target: ids[1],
                ignore_index,
                smoothing: nestor_ir::F64(label_smoothing),
                reduction: ir,
            },
        )
    }
}
