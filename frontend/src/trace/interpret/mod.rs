//! The interpreter: runs any graph op by op with tch, through the eager NestedTensor
//! operators. It is the reference every compiled path is checked against.

use std::collections::HashMap;

use nestor_ir::{
    AttentionGradPart, BinaryOp, Dim, ElemDim, FusedExpr, Graph, LossReduction as IrLoss,
    NormGradPart, Op, OpFamily, PoolKind, ReduceOp, Type, UnaryOp, ValueId,
};
use tch::{Kind, Reduction, Tensor};

use crate::ops::Binary;

mod fused_kernel;
mod gemm;
mod loss;
mod norm;
mod per_element;
mod pointwise;
mod reduce;
mod structure;
use crate::{
    dtype_of, kind_of, Bounds, LossReduction, NestedError, NestedTensor, Operand, Reduce, Reduced,
    Result, Target,
};

/// A run-time value of a graph.
#[derive(Debug)]
pub enum Value {
    /// A ragged batch (batch first).
    Nested(NestedTensor),
    /// A dense tensor.
    Dense(Tensor),
    /// Per-element lengths.
    Lengths(Vec<i64>),
}

impl Value {
    fn share(&self) -> Value {
        match self {
            Value::Nested(nested) => Value::Nested(nested.shallow_clone()),
            Value::Dense(tensor) => Value::Dense(tensor.shallow_clone()),
            Value::Lengths(lengths) => Value::Lengths(lengths.clone()),
        }
    }

    /// The batch, or an error naming what was found instead.
    pub fn into_nested(self) -> Result<NestedTensor> {
        match self {
            Value::Nested(nested) => Ok(nested),
            other => Err(mismatch(
                "result",
                format!("expected a ragged batch, got {}", other.describe()),
            )),
        }
    }

    /// The dense tensor, or an error naming what was found instead.
    pub fn into_dense(self) -> Result<Tensor> {
        match self {
            Value::Dense(tensor) => Ok(tensor),
            other => Err(mismatch(
                "result",
                format!("expected a dense tensor, got {}", other.describe()),
            )),
        }
    }

    fn describe(&self) -> &'static str {
        match self {
            Value::Nested(_) => "a ragged batch",
            Value::Dense(_) => "a dense tensor",
            Value::Lengths(_) => "lengths",
        }
    }
}

impl From<Reduced> for Value {
    fn from(reduced: Reduced) -> Self {
        match reduced {
            Reduced::Nested(nested) => Value::Nested(nested),
            Reduced::Dense(dense) => Value::Dense(dense.tensor),
        }
    }
}

fn mismatch(input: impl Into<String>, reason: String) -> NestedError {
    NestedError::InputMismatch {
        input: input.into(),
        reason,
    }
}

/// Checks `inputs` (one per `input`/`param` op, in order) against their types, as
/// [`interpret`] does, without running anything.
pub fn check_inputs(graph: &Graph, inputs: &[Value]) -> Result<()> {
    let mut checker = Interpreter {
        graph,
        values: Vec::with_capacity(graph.nodes.len()),
        symbols: HashMap::new(),
    };
    let mut inputs = inputs.iter();
    for node in &graph.nodes {
        let value = match &node.op {
            Op::Input { name } | Op::Param { name } => {
                let input = inputs
                    .next()
                    .ok_or_else(|| mismatch(name.clone(), "missing".into()))?;
                checker.check(name, &node.ty, input)?;
                // Later types read only lengths (no batch or tensor is kept).
                match input {
                    Value::Lengths(lengths) => Value::Lengths(lengths.clone()),
                    _ => Value::Lengths(Vec::new()),
                }
            }
            // Every input is checked: only a missing one is left to find.
            _ if inputs.len() == 0 => continue,
            // Types only refer to values defined before them; later ops are not needed.
            _ => Value::Lengths(Vec::new()),
        };
        checker.values.push(value);
    }
    Ok(())
}

/// Runs `graph` on `inputs` (one per `input`/`param` op, in order), checking every
/// input against its type (dtype, static sizes, lengths, batch sizes).
///
/// ```
/// use nestor_frontend::{interpret, NestedTensor, Value};
/// use tch::Tensor;
///
/// let graph = nestor_ir::parse("graph @g {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 2]
///   %2 = mul(%1, %1) : ragged<f32>[B; %0, 2]
///   return %2
/// }")?;
/// let x = NestedTensor::from_tensors(&[
///     Tensor::from_slice(&[1.0f32, 2.0]).view([1, 2]),
///     Tensor::from_slice(&[3.0f32, 4.0, 5.0, 6.0]).view([2, 2]),
/// ])?;
/// let outputs = interpret(&graph, vec![Value::Lengths(vec![1, 2]), Value::Nested(x)])?;
/// let Value::Nested(squares) = &outputs[0] else { panic!("a batch") };
/// assert_eq!(Vec::<f32>::try_from(squares.values().flatten(0, -1))?, [1.0, 4.0, 9.0, 16.0, 25.0, 36.0]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn interpret(graph: &Graph, inputs: Vec<Value>) -> Result<Vec<Value>> {
    let mut interpreter = Interpreter {
        graph,
        values: Vec::with_capacity(graph.nodes.len()),
        symbols: HashMap::new(),
    };
    let mut inputs = inputs.into_iter();
    for (index, node) in graph.nodes.iter().enumerate() {
        let value = ValueId(index as u32);
        let result = match &node.op {
            Op::Input { name } | Op::Param { name } => {
                let input = inputs
                    .next()
                    .ok_or_else(|| mismatch(name.clone(), "missing".into()))?;
                interpreter.check(name, &node.ty, &input)?;
                input
            }
            op => interpreter.run(value, op, &node.ty)?,
        };
        interpreter.values.push(result);
    }
    graph
        .outputs
        .iter()
        .map(|&output| Ok(interpreter.get(output).share()))
        .collect()
}

struct Interpreter<'g> {
    graph: &'g Graph,
    values: Vec<Value>,
    /// Batch-size symbols bound by the inputs.
    symbols: HashMap<String, i64>,
}

impl Interpreter<'_> {
    fn get(&self, value: ValueId) -> &Value {
        &self.values[value.index()]
    }

    fn nested(&self, value: ValueId) -> Result<&NestedTensor> {
        match self.get(value) {
            Value::Nested(nested) => Ok(nested),
            other => Err(mismatch(
                value.to_string(),
                format!("expected a ragged batch, got {}", other.describe()),
            )),
        }
    }

    fn dense(&self, value: ValueId) -> Result<&Tensor> {
        match self.get(value) {
            Value::Dense(tensor) => Ok(tensor),
            other => Err(mismatch(
                value.to_string(),
                format!("expected a dense tensor, got {}", other.describe()),
            )),
        }
    }

    fn lengths(&self, value: ValueId) -> Result<&[i64]> {
        match self.get(value) {
            Value::Lengths(lengths) => Ok(lengths),
            other => Err(mismatch(
                value.to_string(),
                format!("expected lengths, got {}", other.describe()),
            )),
        }
    }

    fn operand(&self, value: ValueId) -> Result<Operand<'_>> {
        Ok(match self.get(value) {
            Value::Nested(nested) => Operand::Nested(nested),
            Value::Dense(tensor) => Operand::Dense(tensor),
            Value::Lengths(_) => {
                return Err(mismatch(
                    value.to_string(),
                    "lengths are not an elementwise operand".into(),
                ))
            }
        })
    }

    /// Binds a batch-size symbol, or checks it against its binding.
    fn bind(&mut self, input: &str, dim: &Dim, size: i64) -> Result<()> {
        match dim {
            Dim::Static(expected) if *expected != size => Err(mismatch(input, format!("a dim has size {size}, expected {expected}"))),
            // `?` is a size known only at run time, different per element.
            Dim::Sym(symbol) if symbol == "?" => Ok(()),
            Dim::Sym(symbol) => match self.symbols.get(symbol.as_str()) {
                Some(&bound) if bound != size => {
                    Err(mismatch(input, format!("batch size {size} differs from {bound}, the size of {symbol} in another input")))
                }
                Some(_) => Ok(()),
                None => {
                    self.symbols.insert(symbol.clone(), size);
                    Ok(())
                }
            },
            _ => Ok(()),
        }
    }

    fn check(&mut self, name: &str, ty: &Type, value: &Value) -> Result<()> {
        let dtype_error = |got: Kind| {
            mismatch(
                name,
                format!(
                    "has dtype {got:?}, expected {}",
                    ty.dtype().map_or("lengths".into(), |d| d.to_string())
                ),
            )
        };
        match (ty, value) {
            (Type::Lengths { batch }, Value::Lengths(lengths)) => {
                self.bind(name, batch, lengths.len() as i64)
            }
            (Type::Dense { dtype, shape }, Value::Dense(tensor)) => {
                if dtype_of(tensor.kind()) != Some(*dtype) {
                    return Err(dtype_error(tensor.kind()));
                }
                let sizes = tensor.size();
                if sizes.len() != shape.len() {
                    return Err(mismatch(
                        name,
                        format!("has shape {sizes:?}, expected {ty}"),
                    ));
                }
                for (dim, size) in shape.iter().zip(sizes) {
                    self.bind(name, dim, size)?;
                }
                Ok(())
            }
            (Type::Ragged { dtype, batch, dims }, Value::Nested(nested)) => {
                if dtype_of(nested.kind()) != Some(*dtype) {
                    return Err(dtype_error(nested.kind()));
                }
                self.bind(name, batch, nested.batch_size() as i64)?;
                let layout = nested.lay();
                if layout.rank() != dims.len() {
                    return Err(mismatch(
                        name,
                        format!("has elements of rank {}, expected {ty}", layout.rank()),
                    ));
                }
                for (dim, expected) in dims.iter().enumerate() {
                    for (element, sizes) in layout.element_sizes().iter().enumerate() {
                        let ok = match expected {
                            ElemDim::Fixed(Dim::Static(size)) => sizes[dim] == *size,
                            ElemDim::Fixed(_) => true,
                            ElemDim::Ragged(lengths) => {
                                self.lengths(*lengths)?.get(element) == Some(&sizes[dim])
                            }
                        };
                        if !ok {
                            return Err(mismatch(name, format!("element {element} has size {} in dim {dim}, expected {expected}", sizes[dim])));
                        }
                    }
                }
                if layout
                    .ragged_dims()
                    .iter()
                    .any(|&dim| matches!(dims[dim], ElemDim::Fixed(_)))
                {
                    return Err(mismatch(
                        name,
                        format!(
                            "has ragged dims {:?} where {ty} has static ones",
                            layout.ragged_dims()
                        ),
                    ));
                }
                Ok(())
            }
            (ty, value) => Err(mismatch(
                name,
                format!("expected {ty}, got {}", value.describe()),
            )),
        }
    }

    fn run(&mut self, value: ValueId, op: &Op, ty: &Type) -> Result<Value> {
        match op.family() {
            OpFamily::Source => unreachable!("inputs are bound by interpret"),
            OpFamily::Pointwise => self.run_pointwise(op),
            OpFamily::FusedKernel => self.run_fused_kernel(value, op, ty),
            OpFamily::Gemm | OpFamily::Attention => self.run_gemm(op),
            OpFamily::Norm => self.run_norm(op, ty),
            OpFamily::Reduce => self.run_reduce(op),
            OpFamily::Structure => self.run_structure(op),
            OpFamily::Loss => self.run_loss(op),
            OpFamily::PerElement => self.run_per_element(value, op, ty),
        }
    }
}

/// The error for an op handed to the runner of another family (a dispatch bug).
fn not_in_family(op: &Op, family: &str) -> NestedError {
    NestedError::Unsupported {
        op: "interpret",
        reason: format!("{} is not a {family} op", op.name()),
    }
}

fn as_operand(value: &Value) -> Result<Operand<'_>> {
    match value {
        Value::Nested(nested) => Ok(Operand::Nested(nested)),
        Value::Dense(tensor) => Ok(Operand::Dense(tensor)),
        Value::Lengths(_) => Err(mismatch(
            "operand",
            "lengths are not an elementwise operand".into(),
        )),
    }
}

fn as_dense(value: &Value) -> Result<&Tensor> {
    match value {
        Value::Dense(tensor) => Ok(tensor),
        other => Err(mismatch(
            "operand",
            format!("expected a dense tensor, got {}", other.describe()),
        )),
    }
}

fn unary_value(op: UnaryOp, x: &Value) -> Result<Value> {
    Ok(match x {
        Value::Nested(nested) => Value::Nested(unary_nested(nested, op)?),
        other => Value::Dense(unary_dense(as_dense(other)?, op)?),
    })
}

fn binary_value(op: BinaryOp, a: &Value, b: &Value) -> Result<Value> {
    let binary = Binary::from_ir(op);
    Ok(match (a, b) {
        (Value::Nested(a), b) => Value::Nested(a.binary(binary, as_operand(b)?)?),
        (a, Value::Nested(b)) => Value::Nested(b.binary_reversed(binary, as_operand(a)?)?),
        (a, b) => Value::Dense(binary.apply(as_dense(a)?, as_dense(b)?)?),
    })
}

fn where_value(condition: &Value, x: &Value, y: &Value) -> Result<Value> {
    Ok(match (x, y) {
        (Value::Nested(x), y) => {
            Value::Nested(x.where_self(as_operand(condition)?, as_operand(y)?)?)
        }
        (x, Value::Nested(y)) => {
            let negated = unary_value(UnaryOp::Not, condition)?;
            Value::Nested(y.where_self(as_operand(&negated)?, as_operand(x)?)?)
        }
        (x, y) => Value::Dense(as_dense(x)?.f_where_self(as_dense(condition)?, as_dense(y)?)?),
    })
}

fn cast_value(dtype: nestor_ir::DType, x: &Value) -> Result<Value> {
    Ok(match x {
        Value::Nested(nested) => Value::Nested(nested.to_kind(kind_of(dtype))?),
        other => Value::Dense(as_dense(other)?.f_to_kind(kind_of(dtype))?),
    })
}

/// Evaluates a fused expression with the eager operators, op by op.
fn fused_value(expr: &FusedExpr, inputs: &[&Value]) -> Result<Value> {
    let eval = |expr: &FusedExpr| fused_value(expr, inputs);
    match expr {
        FusedExpr::Input(index) => inputs
            .get(*index)
            .map(|value| value.share())
            .ok_or_else(|| mismatch("fused", format!("no input ${index}"))),
        FusedExpr::Const { value, dtype } => Ok(Value::Dense(
            Tensor::f_scalar_tensor(value.0, (Kind::Double, tch::Device::Cpu))?
                .f_to_kind(kind_of(*dtype))?,
        )),
        FusedExpr::Unary(op, x) => unary_value(*op, &eval(x)?),
        FusedExpr::Binary(op, a, b) => binary_value(*op, &eval(a)?, &eval(b)?),
        FusedExpr::Where(c, a, b) => where_value(&eval(c)?, &eval(a)?, &eval(b)?),
        FusedExpr::Cast(dtype, x) => cast_value(*dtype, &eval(x)?),
    }
}

/// The static sizes of the last `dims` dims of a type.
fn tail_sizes(ty: &Type, dims: usize) -> Vec<i64> {
    let sizes: Vec<i64> = match ty {
        Type::Ragged { dims, .. } => dims
            .iter()
            .map(|dim| match dim {
                ElemDim::Fixed(Dim::Static(size)) => *size,
                _ => -1,
            })
            .collect(),
        Type::Dense { shape, .. } => shape
            .iter()
            .map(|dim| dim.as_static().unwrap_or(-1))
            .collect(),
        Type::Lengths { .. } => Vec::new(),
    };
    sizes[sizes.len().saturating_sub(dims)..].to_vec()
}

fn length_mask(lengths: &[i64]) -> Result<Tensor> {
    let max = lengths.iter().copied().max().unwrap_or(0);
    let positions = Tensor::f_arange(max, (Kind::Int64, tch::Device::Cpu))?;
    Ok(positions
        .f_unsqueeze(0)?
        .f_lt_tensor(&Tensor::f_from_slice(lengths)?.f_unsqueeze(1)?)?)
}

fn unary_nested(nested: &NestedTensor, op: UnaryOp) -> Result<NestedTensor> {
    match op {
        UnaryOp::Neg => nested.neg(),
        UnaryOp::Abs => nested.abs(),
        UnaryOp::Exp => nested.exp(),
        UnaryOp::Log => nested.log(),
        UnaryOp::Sqrt => nested.sqrt(),
        UnaryOp::Rsqrt => nested.rsqrt(),
        UnaryOp::Square => nested.square(),
        UnaryOp::Sin => nested.sin(),
        UnaryOp::Cos => nested.cos(),
        UnaryOp::Tanh => nested.tanh(),
        UnaryOp::Sigmoid => nested.sigmoid(),
        UnaryOp::Relu => nested.relu(),
        UnaryOp::Gelu => nested.gelu("none"),
        UnaryOp::GeluTanh => nested.gelu("tanh"),
        UnaryOp::Silu => nested.silu(),
        UnaryOp::Erf => nested.erf(),
        UnaryOp::Sign => nested.sign(),
        UnaryOp::Not => nested.logical_not(),
        UnaryOp::Expm1 => nested.expm1(),
        UnaryOp::Log1p => nested.log1p(),
        UnaryOp::Reciprocal => nested.reciprocal(),
        UnaryOp::Floor => nested.floor(),
        UnaryOp::Ceil => nested.ceil(),
        UnaryOp::Round => nested.round(),
    }
}

fn unary_dense(tensor: &Tensor, op: UnaryOp) -> Result<Tensor> {
    Ok(match op {
        UnaryOp::Neg => tensor.f_neg()?,
        UnaryOp::Abs => tensor.f_abs()?,
        UnaryOp::Exp => tensor.f_exp()?,
        UnaryOp::Log => tensor.f_log()?,
        UnaryOp::Sqrt => tensor.f_sqrt()?,
        UnaryOp::Rsqrt => tensor.f_rsqrt()?,
        UnaryOp::Square => tensor.f_square()?,
        UnaryOp::Sin => tensor.f_sin()?,
        UnaryOp::Cos => tensor.f_cos()?,
        UnaryOp::Tanh => tensor.f_tanh()?,
        UnaryOp::Sigmoid => tensor.f_sigmoid()?,
        UnaryOp::Relu => tensor.f_relu()?,
        UnaryOp::Gelu => tensor.f_gelu("none")?,
        UnaryOp::GeluTanh => tensor.f_gelu("tanh")?,
        UnaryOp::Silu => tensor.f_silu()?,
        UnaryOp::Erf => tensor.f_erf()?,
        UnaryOp::Sign => tensor.f_sign()?,
        UnaryOp::Not => tensor.f_logical_not()?,
        UnaryOp::Expm1 => tensor.f_expm1()?,
        UnaryOp::Log1p => tensor.f_log1p()?,
        UnaryOp::Reciprocal => tensor.f_reciprocal()?,
        UnaryOp::Floor => tensor.f_floor()?,
        UnaryOp::Ceil => tensor.f_ceil()?,
        UnaryOp::Round => tensor.f_round()?,
    })
}

fn reduce_dense(
    tensor: &Tensor,
    op: ReduceOp,
    dims: &[i64],
    keepdim: bool,
    correction: i64,
) -> Result<Tensor> {
    let all: Vec<i64> = if dims.is_empty() {
        (0..tensor.dim() as i64).collect()
    } else {
        dims.to_vec()
    };
    let dims = all.as_slice();
    Ok(match op {
        ReduceOp::Sum => tensor.f_sum_dim_intlist(dims, keepdim, None::<Kind>)?,
        ReduceOp::Mean => tensor.f_mean_dim(dims, keepdim, None::<Kind>)?,
        ReduceOp::Amax => tensor.f_amax(dims, keepdim)?,
        ReduceOp::Amin => tensor.f_amin(dims, keepdim)?,
        ReduceOp::LogSumExp => tensor.f_logsumexp(dims, keepdim)?,
        ReduceOp::Var => tensor.f_var_correction(dims, correction, keepdim)?,
        ReduceOp::Std => tensor.f_std_correction(dims, correction, keepdim)?,
        ReduceOp::All => dims
            .iter()
            .rev()
            .try_fold(tensor.f_ne(0)?, |t, &d| t.f_all_dim(d, keepdim))?,
        ReduceOp::Any => dims
            .iter()
            .rev()
            .try_fold(tensor.f_ne(0)?, |t, &d| t.f_any_dim(d, keepdim))?,
        ReduceOp::Argmax => tensor.f_argmax(dims.first().copied(), keepdim)?,
        ReduceOp::Argmin => tensor.f_argmin(dims.first().copied(), keepdim)?,
        ReduceOp::Max => {
            tensor
                .f_max_dim(dims.first().copied().unwrap_or(0), keepdim)?
                .0
        }
        ReduceOp::Min => {
            tensor
                .f_min_dim(dims.first().copied().unwrap_or(0), keepdim)?
                .0
        }
    })
}

fn loss_reduction(reduction: IrLoss) -> LossReduction {
    match reduction {
        IrLoss::Mean => LossReduction::Mean,
        IrLoss::Sum => LossReduction::Sum,
        IrLoss::None => LossReduction::None,
    }
}

fn torch_reduction(reduction: IrLoss) -> Reduction {
    match reduction {
        IrLoss::Mean => Reduction::Mean,
        IrLoss::Sum => Reduction::Sum,
        IrLoss::None => Reduction::None,
    }
}

impl Binary {
    /// The eager operator of an IR operator.
    pub fn from_ir(op: BinaryOp) -> Binary {
        match op {
            BinaryOp::Add => Binary::Add,
            BinaryOp::Sub => Binary::Sub,
            BinaryOp::Mul => Binary::Mul,
            BinaryOp::Div => Binary::Div,
            BinaryOp::Pow => Binary::Pow,
            BinaryOp::Maximum => Binary::Maximum,
            BinaryOp::Minimum => Binary::Minimum,
            BinaryOp::Eq => Binary::Eq,
            BinaryOp::Ne => Binary::Ne,
            BinaryOp::Lt => Binary::Lt,
            BinaryOp::Le => Binary::Le,
            BinaryOp::Gt => Binary::Gt,
            BinaryOp::Ge => Binary::Ge,
            BinaryOp::And => Binary::LogicalAnd,
            BinaryOp::Or => Binary::LogicalOr,
            BinaryOp::Xor => Binary::LogicalXor,
            BinaryOp::Remainder => Binary::Remainder,
            BinaryOp::Atan2 => Binary::Atan2,
        }
    }
}

impl Reduce {
    /// The eager reduction of an IR reduction (`None` for the reductions that pick one
    /// position: argmax, argmin, max and min, which
    /// [`NestedTensor::max_dim`](crate::NestedTensor::max_dim) and its kin give).
    pub fn from_ir(op: ReduceOp, correction: i64) -> Option<Reduce> {
        Some(match op {
            ReduceOp::Sum => Reduce::Sum,
            ReduceOp::Mean => Reduce::Mean,
            ReduceOp::Amax => Reduce::Amax,
            ReduceOp::Amin => Reduce::Amin,
            ReduceOp::LogSumExp => Reduce::LogSumExp,
            ReduceOp::Var => Reduce::Var { correction },
            ReduceOp::Std => Reduce::Std { correction },
            ReduceOp::All => Reduce::All,
            ReduceOp::Any => Reduce::Any,
            ReduceOp::Argmax | ReduceOp::Argmin | ReduceOp::Max | ReduceOp::Min => return None,
        })
    }
}
