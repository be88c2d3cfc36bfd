//! The closed set of IR operations, with their operands and attributes in one place.

use std::fmt;
use std::hash::{Hash, Hasher};

use crate::{DType, Graph, ValueId};

/// An `f64` attribute compared and hashed by its bits (so ops can derive `Eq`/`Hash`).
#[derive(Clone, Copy, Debug)]
pub struct F64(pub f64);

impl PartialEq for F64 {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}
impl Eq for F64 {}
impl PartialOrd for F64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for F64 {
    /// IEEE total order: equal exactly when the bits are, as `Eq` says.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}
impl Hash for F64 {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state);
    }
}

/// Elementwise functions of one argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `|x|`
    Abs,
    /// `e^x`
    Exp,
    /// `ln x`
    Log,
    /// `sqrt x`
    Sqrt,
    /// `1 / sqrt x`
    Rsqrt,
    /// `x * x`
    Square,
    /// sine
    Sin,
    /// cosine
    Cos,
    /// hyperbolic tangent
    Tanh,
    /// logistic sigmoid
    Sigmoid,
    /// `max(x, 0)`
    Relu,
    /// exact GELU
    Gelu,
    /// tanh-approximated GELU
    GeluTanh,
    /// `x * sigmoid(x)`
    Silu,
    /// error function
    Erf,
    /// logical not
    Not,
}

/// Elementwise functions of two arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// `a ** b`
    Pow,
    /// `max(a, b)`
    Maximum,
    /// `min(a, b)`
    Minimum,
    /// `a == b`
    Eq,
    /// `a != b`
    Ne,
    /// `a < b`
    Lt,
    /// `a <= b`
    Le,
    /// `a > b`
    Gt,
    /// `a >= b`
    Ge,
    /// `a && b`
    And,
    /// `a || b`
    Or,
}

impl BinaryOp {
    /// Whether the result is bool whatever the operands.
    pub fn is_predicate(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq
                | BinaryOp::Ne
                | BinaryOp::Lt
                | BinaryOp::Le
                | BinaryOp::Gt
                | BinaryOp::Ge
                | BinaryOp::And
                | BinaryOp::Or
        )
    }
}

/// Reductions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReduceOp {
    /// sum
    Sum,
    /// mean over real elements
    Mean,
    /// largest value
    Amax,
    /// smallest value
    Amin,
    /// `log(sum(exp))`
    LogSumExp,
    /// variance with a Bessel correction
    Var,
    /// standard deviation with a Bessel correction
    Std,
    /// all non-zero
    All,
    /// any non-zero
    Any,
}

/// How a loss reduces over real positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LossReduction {
    /// mean
    Mean,
    /// sum
    Sum,
    /// one loss per position
    None,
}

/// Pooling kinds for per-element bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    /// max pooling
    Max,
    /// average pooling
    Avg,
}

/// One IR operation. Every op produces exactly one value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// A data input of the graph (a batch, its lengths, a dense tensor).
    Input {
        /// The input's name.
        name: String,
    },
    /// A parameter: a graph input bound to a trained tensor.
    Param {
        /// The parameter's name (its `VarStore` path when known).
        name: String,
    },
    /// A 0-d constant.
    Const {
        /// Its value.
        value: F64,
        /// Its element type.
        dtype: DType,
    },
    /// `op(x)` elementwise.
    Unary {
        /// The function.
        op: UnaryOp,
        /// The argument.
        x: ValueId,
    },
    /// `op(lhs, rhs)` elementwise, broadcasting dense operands against ragged ones as
    /// DESIGN.md section 7 says.
    Binary {
        /// The function.
        op: BinaryOp,
        /// Left operand.
        lhs: ValueId,
        /// Right operand.
        rhs: ValueId,
    },
    /// `condition ? x : y` elementwise.
    Where {
        /// Bool condition.
        condition: ValueId,
        /// Taken where true.
        x: ValueId,
        /// Taken where false.
        y: ValueId,
    },
    /// Conversion of the element type.
    Cast {
        /// The argument.
        x: ValueId,
        /// The new element type.
        dtype: DType,
    },
    /// `x W^T + b` over the last dim (one GEMM over packed rows).
    Linear {
        /// Input with a static last dim.
        x: ValueId,
        /// `[out, in]`.
        weight: ValueId,
        /// `[out]`.
        bias: Option<ValueId>,
    },
    /// `x @ w` over the last dim with a dense `[K, M]` or `[K]` operand.
    Matmul {
        /// Input.
        x: ValueId,
        /// Dense matrix or vector.
        w: ValueId,
    },
    /// Layer normalization over the last `dims` static dims.
    LayerNorm {
        /// Input.
        x: ValueId,
        /// Scale.
        weight: Option<ValueId>,
        /// Shift.
        bias: Option<ValueId>,
        /// Normalized trailing dims.
        dims: usize,
        /// Epsilon.
        eps: F64,
    },
    /// RMS normalization over the last `dims` static dims.
    RmsNorm {
        /// Input.
        x: ValueId,
        /// Scale.
        weight: Option<ValueId>,
        /// Normalized trailing dims.
        dims: usize,
        /// Epsilon.
        eps: F64,
    },
    /// softmax or log-softmax along `axis` (static: packed; ragged: segmented).
    Softmax {
        /// Input.
        x: ValueId,
        /// A batch-first dim (0 is the batch, which is an error; negative from the end).
        axis: i64,
        /// Log-softmax.
        log: bool,
    },
    /// A reduction over batch-first dims (`0` is the batch; empty means all).
    Reduce {
        /// The reduction.
        op: ReduceOp,
        /// Input.
        x: ValueId,
        /// Reduced dims.
        dims: Vec<i64>,
        /// Keep reduced dims with size 1.
        keepdim: bool,
        /// Bessel correction (variance and standard deviation).
        correction: i64,
    },
    /// Rows of `weight` gathered at integer ids: `[*s] -> [*s, D]`.
    Embedding {
        /// Integer ids.
        ids: ValueId,
        /// `[vocabulary, D]`.
        weight: ValueId,
        /// Row that gets no gradient (`-1`: none).
        padding_idx: i64,
    },
    /// Varlen attention on packed heads `[L, H, D]`: each element attends within itself.
    Attention {
        /// Queries `[B; Lq, H, D]`.
        q: ValueId,
        /// Keys `[B; Lk, H, D]`.
        k: ValueId,
        /// Values `[B; Lk, H, Dv]`.
        v: ValueId,
        /// Mask future keys.
        causal: bool,
        /// Score scale (default `1 / sqrt(D)`).
        scale: Option<F64>,
    },
    /// Reshape of the static tail (ragged dims lead).
    ReshapeTail {
        /// Input.
        x: ValueId,
        /// New static tail.
        tail: Vec<i64>,
    },
    /// Selects `index` of static element dim `dim`, removing it.
    SelectStatic {
        /// Input.
        x: ValueId,
        /// Static element dim.
        dim: usize,
        /// Position.
        index: i64,
    },
    /// Swaps two static element dims.
    TransposeStatic {
        /// Input.
        x: ValueId,
        /// First element dim.
        dim0: usize,
        /// Second element dim.
        dim1: usize,
    },
    /// Dropout with probability `p` (identity unless `train`).
    Dropout {
        /// Input.
        x: ValueId,
        /// Drop probability.
        p: F64,
        /// Training mode.
        train: bool,
    },
    /// The padded dense tensor `[B, max(L), ...]` of a ragged value.
    Pad {
        /// Ragged input.
        x: ValueId,
        /// Padding value.
        value: F64,
    },
    /// The ragged value of a padded dense tensor, by its lengths.
    Unpad {
        /// Dense input `[B, max(L), ...]`.
        x: ValueId,
        /// Lengths of the leading ragged dim.
        lengths: ValueId,
    },
    /// The padding mask `bool[B, max(L)]`, true on data.
    Mask {
        /// Lengths.
        lengths: ValueId,
    },
    /// `max(L)` as an `i64` scalar.
    MaxLength {
        /// Lengths.
        lengths: ValueId,
    },
    /// `sum(L)` (packed rows) as an `i64` scalar.
    TotalLength {
        /// Lengths.
        lengths: ValueId,
    },
    /// Cross entropy of logits `[..., C]` against class ids.
    CrossEntropy {
        /// Logits.
        logits: ValueId,
        /// Class ids: same structure without the class dim, or one per element.
        target: ValueId,
        /// Ignored class id.
        ignore_index: i64,
        /// Label smoothing.
        smoothing: F64,
        /// Reduction.
        reduction: LossReduction,
    },
    /// The lengths of a batch repeated `repeats` times, whole (`[l0, l1, l0, l1]`) or
    /// element by element (`[l0, l0, l1, l1]`).
    RepeatLengths {
        /// Lengths.
        lengths: ValueId,
        /// Copies of every element.
        repeats: i64,
        /// Element by element rather than whole.
        interleave: bool,
    },
    /// A batch repeated as `RepeatLengths` says; `lengths` are its new lengths values
    /// (one per ragged dim, from `repeat_lengths`).
    RepeatBatch {
        /// The batch.
        x: ValueId,
        /// The lengths of the result, one per ragged dim of `x`.
        lengths: Vec<ValueId>,
        /// Copies of every element.
        repeats: i64,
        /// Element by element rather than whole.
        interleave: bool,
    },
    /// Mean squared error.
    MseLoss {
        /// Predictions.
        x: ValueId,
        /// Targets.
        target: ValueId,
        /// Reduction.
        reduction: LossReduction,
    },
    /// The lengths after a convolution or pooling window slides over a ragged dim.
    WindowLengths {
        /// Input lengths.
        lengths: ValueId,
        /// Window size.
        kernel: i64,
        /// Step.
        stride: i64,
        /// Padding on each side.
        padding: i64,
        /// Dilation.
        dilation: i64,
    },
    /// A 2-d convolution of one dense element `[C, H, W]` (per-element bodies only).
    Conv2d {
        /// Input.
        x: ValueId,
        /// `[C_out, C_in / groups, Kh, Kw]`.
        weight: ValueId,
        /// `[C_out]`.
        bias: Option<ValueId>,
        /// Strides.
        stride: Vec<i64>,
        /// Paddings.
        padding: Vec<i64>,
        /// Dilations.
        dilation: Vec<i64>,
        /// Groups.
        groups: i64,
    },
    /// 2-d pooling of one dense element `[C, H, W]` (per-element bodies only).
    Pool2d {
        /// Max or average.
        kind: PoolKind,
        /// Input.
        x: ValueId,
        /// Window.
        kernel: Vec<i64>,
        /// Strides.
        stride: Vec<i64>,
        /// Paddings.
        padding: Vec<i64>,
    },
    /// Adaptive average pooling of one dense element `[C, H, W]` to `[C, *output]`.
    AdaptiveAvgPool2d {
        /// Input.
        x: ValueId,
        /// Output spatial size.
        output: Vec<i64>,
    },
    /// Elementwise ops fused into one: `expr` over `inputs` (broadcast as `binary`
    /// broadcasts); one kernel.
    Fused {
        /// The values the expression reads.
        inputs: Vec<ValueId>,
        /// The expression.
        expr: crate::FusedExpr,
    },
    /// One kernel: `core` (a layer_norm, rms_norm, softmax or log_softmax, or a
    /// sum / mean / amax / amin over one dim) reading as its first operand the
    /// pointwise `expr` over `inputs`, which is never written to memory. The first
    /// operand of `core` is unused (`%0`); its others (weight, bias) are its own.
    Prologue {
        /// The values the expression reads.
        inputs: Vec<ValueId>,
        /// The expression giving the core's input.
        expr: crate::FusedExpr,
        /// The row or segmented op.
        core: Box<Op>,
    },
    /// One kernel: `core` (a linear or matmul) whose result, `$0` of the pointwise
    /// `expr`, goes through it on its way to memory; `$1...` are `inputs`.
    Epilogue {
        /// The GEMM.
        core: Box<Op>,
        /// The other values the expression reads.
        inputs: Vec<ValueId>,
        /// The expression applied to the core's result.
        expr: crate::FusedExpr,
    },
    /// An explicit per-element fallback: `body` runs once per element of the first
    /// input (a dense element), with the other inputs passed whole.
    PerElement {
        /// The ragged input, then dense inputs.
        inputs: Vec<ValueId>,
        /// The body: its inputs are the element, then the dense inputs.
        body: Box<Graph>,
    },
}

/// An attribute value, for the text form.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// A list of integers.
    Ints(Vec<i64>),
    /// A word (enum variant names).
    Word(String),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(value) => write!(f, "{value}"),
            Attr::Float(value) => write!(f, "{value:?}"),
            Attr::Bool(value) => write!(f, "{value}"),
            Attr::Str(value) => write!(f, "{value:?}"),
            Attr::Ints(values) => {
                write!(
                    f,
                    "[{}]",
                    values
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
            Attr::Word(word) => f.write_str(word),
        }
    }
}

macro_rules! word_enum {
    ($type:ident { $($variant:ident => $word:literal),* $(,)? }) => {
        impl $type {
            /// The word of the text form.
            pub fn word(self) -> &'static str {
                match self { $($type::$variant => $word),* }
            }
            /// The variant of a word of the text form.
            pub fn from_word(word: &str) -> Option<Self> {
                match word { $($word => Some($type::$variant),)* _ => None }
            }
        }
    };
}

word_enum!(UnaryOp {
    Neg => "neg", Abs => "abs", Exp => "exp", Log => "log", Sqrt => "sqrt", Rsqrt => "rsqrt",
    Square => "square", Sin => "sin", Cos => "cos", Tanh => "tanh", Sigmoid => "sigmoid",
    Relu => "relu", Gelu => "gelu", GeluTanh => "gelu_tanh", Silu => "silu", Erf => "erf", Not => "not",
});
word_enum!(BinaryOp {
    Add => "add", Sub => "sub", Mul => "mul", Div => "div", Pow => "pow", Maximum => "maximum",
    Minimum => "minimum", Eq => "eq", Ne => "ne", Lt => "lt", Le => "le", Gt => "gt", Ge => "ge",
    And => "and", Or => "or",
});
word_enum!(ReduceOp {
    Sum => "sum", Mean => "mean", Amax => "amax", Amin => "amin", LogSumExp => "logsumexp",
    Var => "var", Std => "std", All => "all", Any => "any",
});
word_enum!(LossReduction { Mean => "mean", Sum => "sum", None => "none" });
word_enum!(PoolKind { Max => "max", Avg => "avg" });

impl Op {
    /// The op's name in the text form.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Param { .. } => "param",
            Op::Const { .. } => "const",
            Op::Unary { op, .. } => op.word(),
            Op::Binary { op, .. } => op.word(),
            Op::Where { .. } => "where",
            Op::Cast { .. } => "cast",
            Op::Linear { .. } => "linear",
            Op::Matmul { .. } => "matmul",
            Op::LayerNorm { .. } => "layer_norm",
            Op::RmsNorm { .. } => "rms_norm",
            Op::Softmax { log: false, .. } => "softmax",
            Op::Softmax { log: true, .. } => "log_softmax",
            Op::Reduce { op, .. } => op.word(),
            Op::Embedding { .. } => "embedding",
            Op::Attention { .. } => "attention",
            Op::ReshapeTail { .. } => "reshape_tail",
            Op::SelectStatic { .. } => "select_static",
            Op::TransposeStatic { .. } => "transpose_static",
            Op::Dropout { .. } => "dropout",
            Op::Pad { .. } => "pad",
            Op::Unpad { .. } => "unpad",
            Op::Mask { .. } => "mask",
            Op::MaxLength { .. } => "max_length",
            Op::TotalLength { .. } => "total_length",
            Op::CrossEntropy { .. } => "cross_entropy",
            Op::MseLoss { .. } => "mse_loss",
            Op::RepeatLengths { .. } => "repeat_lengths",
            Op::RepeatBatch { .. } => "repeat_batch",
            Op::WindowLengths { .. } => "window_lengths",
            Op::Conv2d { .. } => "conv2d",
            Op::Pool2d {
                kind: PoolKind::Max,
                ..
            } => "max_pool2d",
            Op::Pool2d {
                kind: PoolKind::Avg,
                ..
            } => "avg_pool2d",
            Op::AdaptiveAvgPool2d { .. } => "adaptive_avg_pool2d",
            Op::PerElement { .. } => "per_element",
            Op::Fused { .. } => "fused",
            Op::Prologue { .. } => "prologue",
            Op::Epilogue { .. } => "epilogue",
        }
    }

    /// The values the op reads, in order (optional operands only when present).
    pub fn operands(&self) -> Vec<ValueId> {
        let optional = |value: &Option<ValueId>| value.iter().copied().collect::<Vec<_>>();
        match self {
            Op::Input { .. } | Op::Param { .. } | Op::Const { .. } => vec![],
            Op::Unary { x, .. }
            | Op::Cast { x, .. }
            | Op::Softmax { x, .. }
            | Op::Reduce { x, .. }
            | Op::ReshapeTail { x, .. }
            | Op::SelectStatic { x, .. }
            | Op::TransposeStatic { x, .. }
            | Op::Dropout { x, .. }
            | Op::Pad { x, .. }
            | Op::Pool2d { x, .. }
            | Op::AdaptiveAvgPool2d { x, .. } => vec![*x],
            Op::Binary { lhs, rhs, .. } => vec![*lhs, *rhs],
            Op::Where { condition, x, y } => vec![*condition, *x, *y],
            Op::Linear { x, weight, bias }
            | Op::Conv2d {
                x, weight, bias, ..
            } => [vec![*x, *weight], optional(bias)].concat(),
            Op::Matmul { x, w } => vec![*x, *w],
            Op::LayerNorm {
                x, weight, bias, ..
            } => [vec![*x], optional(weight), optional(bias)].concat(),
            Op::RmsNorm { x, weight, .. } => [vec![*x], optional(weight)].concat(),
            Op::Embedding { ids, weight, .. } => vec![*ids, *weight],
            Op::Attention { q, k, v, .. } => vec![*q, *k, *v],
            Op::Unpad { x, lengths } => vec![*x, *lengths],
            Op::Mask { lengths }
            | Op::MaxLength { lengths }
            | Op::TotalLength { lengths }
            | Op::WindowLengths { lengths, .. } => {
                vec![*lengths]
            }
            Op::CrossEntropy { logits, target, .. } => vec![*logits, *target],
            Op::MseLoss { x, target, .. } => vec![*x, *target],
            Op::RepeatLengths { lengths, .. } => vec![*lengths],
            Op::RepeatBatch { x, lengths, .. } => [vec![*x], lengths.clone()].concat(),
            Op::PerElement { inputs, .. } | Op::Fused { inputs, .. } => inputs.clone(),
            Op::Prologue { inputs, core, .. } => {
                [inputs.clone(), core.operands().split_off(1)].concat()
            }
            Op::Epilogue { core, inputs, .. } => [core.operands(), inputs.clone()].concat(),
        }
    }

    /// The same op reading `operands` (in the order of [`Op::operands`]), or `None` when
    /// their number differs from the op's.
    pub fn with_operands(&self, operands: &[ValueId]) -> Option<Op> {
        if operands.len() != self.operands().len() {
            return None;
        }
        let mut next = operands.iter().copied();
        // The count was checked above, and `map_operands` visits the operands in the
        // order `operands` lists them, so `next` never runs dry.
        Some(self.map_operands(|old| next.next().unwrap_or(old)))
    }

    /// The same op reading other values: `f` maps every operand.
    pub fn map_operands(&self, mut f: impl FnMut(ValueId) -> ValueId) -> Op {
        self.map_operands_dyn(&mut f)
    }

    /// [`Op::map_operands`] through a trait object (fused kernels map their core with it).
    fn map_operands_dyn(&self, f: &mut dyn FnMut(ValueId) -> ValueId) -> Op {
        let mut op = self.clone();
        let mut map = |value: &mut ValueId| *value = f(*value);
        match &mut op {
            Op::Input { .. } | Op::Param { .. } | Op::Const { .. } => {}
            Op::Unary { x, .. }
            | Op::Cast { x, .. }
            | Op::Softmax { x, .. }
            | Op::Reduce { x, .. }
            | Op::ReshapeTail { x, .. }
            | Op::SelectStatic { x, .. }
            | Op::TransposeStatic { x, .. }
            | Op::Dropout { x, .. }
            | Op::Pad { x, .. }
            | Op::Pool2d { x, .. }
            | Op::AdaptiveAvgPool2d { x, .. } => map(x),
            Op::Binary { lhs, rhs, .. } => {
                map(lhs);
                map(rhs);
            }
            Op::Where { condition, x, y } => {
                map(condition);
                map(x);
                map(y);
            }
            Op::Linear { x, weight, bias }
            | Op::Conv2d {
                x, weight, bias, ..
            } => {
                map(x);
                map(weight);
                bias.iter_mut().for_each(map);
            }
            Op::Matmul { x, w } => {
                map(x);
                map(w);
            }
            Op::LayerNorm {
                x, weight, bias, ..
            } => {
                map(x);
                weight.iter_mut().for_each(&mut map);
                bias.iter_mut().for_each(map);
            }
            Op::RmsNorm { x, weight, .. } => {
                map(x);
                weight.iter_mut().for_each(map);
            }
            Op::Embedding { ids, weight, .. } => {
                map(ids);
                map(weight);
            }
            Op::Attention { q, k, v, .. } => {
                map(q);
                map(k);
                map(v);
            }
            Op::Unpad { x, lengths } => {
                map(x);
                map(lengths);
            }
            Op::Mask { lengths }
            | Op::MaxLength { lengths }
            | Op::TotalLength { lengths }
            | Op::WindowLengths { lengths, .. } => map(lengths),
            Op::CrossEntropy { logits, target, .. } => {
                map(logits);
                map(target);
            }
            Op::RepeatLengths { lengths, .. } => map(lengths),
            Op::RepeatBatch { x, lengths, .. } => {
                map(x);
                lengths.iter_mut().for_each(map);
            }
            Op::MseLoss { x, target, .. } => {
                map(x);
                map(target);
            }
            Op::PerElement { inputs, .. } | Op::Fused { inputs, .. } => {
                inputs.iter_mut().for_each(map)
            }
            Op::Prologue { inputs, core, .. } => {
                inputs.iter_mut().for_each(&mut map);
                // The core's first operand is the expression, not a value: kept.
                let mut first = true;
                **core = core.map_operands_dyn(&mut |operand| {
                    if std::mem::take(&mut first) {
                        operand
                    } else {
                        let mut mapped = operand;
                        map(&mut mapped);
                        mapped
                    }
                });
            }
            Op::Epilogue { core, inputs, .. } => {
                **core = core.map_operands_dyn(&mut |operand| {
                    let mut mapped = operand;
                    map(&mut mapped);
                    mapped
                });
                inputs.iter_mut().for_each(map);
            }
        }
        op
    }

    /// The op's attributes for the text form, in a fixed order.
    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        let float = |value: &F64| Attr::Float(value.0);
        match self {
            Op::Input { name } | Op::Param { name } => vec![("name", Attr::Str(name.clone()))],
            Op::Const { value, dtype } => vec![
                ("value", float(value)),
                ("dtype", Attr::Word(dtype.to_string())),
            ],
            Op::Cast { dtype, .. } => vec![("dtype", Attr::Word(dtype.to_string()))],
            Op::Unary { .. }
            | Op::Binary { .. }
            | Op::Where { .. }
            | Op::Linear { .. }
            | Op::Matmul { .. } => vec![],
            Op::LayerNorm { dims, eps, .. } | Op::RmsNorm { dims, eps, .. } => {
                vec![("dims", Attr::Int(*dims as i64)), ("eps", float(eps))]
            }
            Op::Softmax { axis, .. } => vec![("axis", Attr::Int(*axis))],
            Op::Reduce {
                dims,
                keepdim,
                correction,
                op,
                ..
            } => {
                let mut attrs = vec![
                    ("dims", Attr::Ints(dims.clone())),
                    ("keepdim", Attr::Bool(*keepdim)),
                ];
                if matches!(op, ReduceOp::Var | ReduceOp::Std) {
                    attrs.push(("correction", Attr::Int(*correction)));
                }
                attrs
            }
            Op::Embedding { padding_idx, .. } => vec![("padding_idx", Attr::Int(*padding_idx))],
            Op::Attention { causal, scale, .. } => {
                let mut attrs = vec![("causal", Attr::Bool(*causal))];
                if let Some(scale) = scale {
                    attrs.push(("scale", float(scale)));
                }
                attrs
            }
            Op::ReshapeTail { tail, .. } => vec![("tail", Attr::Ints(tail.clone()))],
            Op::SelectStatic { dim, index, .. } => vec![
                ("dim", Attr::Int(*dim as i64)),
                ("index", Attr::Int(*index)),
            ],
            Op::TransposeStatic { dim0, dim1, .. } => vec![
                ("dim0", Attr::Int(*dim0 as i64)),
                ("dim1", Attr::Int(*dim1 as i64)),
            ],
            Op::Dropout { p, train, .. } => vec![("p", float(p)), ("train", Attr::Bool(*train))],
            Op::Pad { value, .. } => vec![("value", float(value))],
            Op::Unpad { .. }
            | Op::Mask { .. }
            | Op::MaxLength { .. }
            | Op::TotalLength { .. }
            | Op::PerElement { .. } => vec![],
            Op::Fused { expr, .. } => vec![("expr", Attr::Str(expr.to_string()))],
            Op::Prologue { inputs, expr, core } | Op::Epilogue { core, inputs, expr } => [
                vec![
                    ("expr", Attr::Str(expr.to_string())),
                    ("inputs", Attr::Int(inputs.len() as i64)),
                    ("core", Attr::Word(core.name().to_owned())),
                ],
                core.attrs(),
            ]
            .concat(),
            Op::CrossEntropy {
                ignore_index,
                smoothing,
                reduction,
                ..
            } => vec![
                ("ignore_index", Attr::Int(*ignore_index)),
                ("smoothing", float(smoothing)),
                ("reduction", Attr::Word(reduction.word().into())),
            ],
            Op::RepeatLengths {
                repeats,
                interleave,
                ..
            }
            | Op::RepeatBatch {
                repeats,
                interleave,
                ..
            } => {
                vec![
                    ("repeats", Attr::Int(*repeats)),
                    ("interleave", Attr::Bool(*interleave)),
                ]
            }
            Op::MseLoss { reduction, .. } => {
                vec![("reduction", Attr::Word(reduction.word().into()))]
            }
            Op::WindowLengths {
                kernel,
                stride,
                padding,
                dilation,
                ..
            } => vec![
                ("kernel", Attr::Int(*kernel)),
                ("stride", Attr::Int(*stride)),
                ("padding", Attr::Int(*padding)),
                ("dilation", Attr::Int(*dilation)),
            ],
            Op::Conv2d {
                stride,
                padding,
                dilation,
                groups,
                ..
            } => vec![
                ("stride", Attr::Ints(stride.clone())),
                ("padding", Attr::Ints(padding.clone())),
                ("dilation", Attr::Ints(dilation.clone())),
                ("groups", Attr::Int(*groups)),
            ],
            Op::Pool2d {
                kernel,
                stride,
                padding,
                ..
            } => vec![
                ("kernel", Attr::Ints(kernel.clone())),
                ("stride", Attr::Ints(stride.clone())),
                ("padding", Attr::Ints(padding.clone())),
            ],
            Op::AdaptiveAvgPool2d { output, .. } => vec![("output", Attr::Ints(output.clone()))],
        }
    }
}

impl Op {
    /// Rebuilds an op from its text-form parts: name, operands, attributes and, for
    /// `per_element`, its body. The inverse of [`name`](Op::name), [`operands`](Op::operands),
    /// [`attrs`](Op::attrs).
    pub fn from_parts(
        name: &str,
        operands: &[ValueId],
        attrs: &[(String, Attr)],
        body: Option<Graph>,
    ) -> Result<Op, String> {
        let attr = |key: &str| attrs.iter().find(|(k, _)| k == key).map(|(_, value)| value);
        let int = |key: &str| match attr(key) {
            Some(Attr::Int(value)) => Ok(*value),
            other => Err(format!(
                "{name}: attribute {key} must be an integer, got {other:?}"
            )),
        };
        let float = |key: &str| match attr(key) {
            Some(Attr::Float(value)) => Ok(F64(*value)),
            Some(Attr::Int(value)) => Ok(F64(*value as f64)),
            other => Err(format!(
                "{name}: attribute {key} must be a number, got {other:?}"
            )),
        };
        let boolean = |key: &str| match attr(key) {
            Some(Attr::Bool(value)) => Ok(*value),
            other => Err(format!(
                "{name}: attribute {key} must be true or false, got {other:?}"
            )),
        };
        let ints = |key: &str| match attr(key) {
            Some(Attr::Ints(values)) => Ok(values.clone()),
            other => Err(format!(
                "{name}: attribute {key} must be a list of integers, got {other:?}"
            )),
        };
        let string = |key: &str| match attr(key) {
            Some(Attr::Str(value)) => Ok(value.clone()),
            other => Err(format!(
                "{name}: attribute {key} must be a string, got {other:?}"
            )),
        };
        let word = |key: &str| match attr(key) {
            Some(Attr::Word(value)) => Ok(value.clone()),
            other => Err(format!(
                "{name}: attribute {key} must be a word, got {other:?}"
            )),
        };
        let dtype = || {
            let text = word("dtype")?;
            DType::from_name(&text).ok_or_else(|| format!("{name}: unknown dtype {text}"))
        };
        let reduction = || {
            let text = word("reduction")?;
            LossReduction::from_word(&text)
                .ok_or_else(|| format!("{name}: unknown reduction {text}"))
        };
        let arity = |expected: &[usize]| {
            if expected.contains(&operands.len()) {
                Ok(())
            } else {
                Err(format!(
                    "{name} takes {expected:?} operands, got {}",
                    operands.len()
                ))
            }
        };
        let at = |index: usize| operands[index];
        let optional = |index: usize| operands.get(index).copied();
        if let Some(op) = UnaryOp::from_word(name) {
            arity(&[1])?;
            return Ok(Op::Unary { op, x: at(0) });
        }
        if let Some(op) = BinaryOp::from_word(name) {
            arity(&[2])?;
            return Ok(Op::Binary {
                op,
                lhs: at(0),
                rhs: at(1),
            });
        }
        if let Some(op) = ReduceOp::from_word(name) {
            arity(&[1])?;
            let correction = if matches!(op, ReduceOp::Var | ReduceOp::Std) {
                int("correction")?
            } else {
                0
            };
            return Ok(Op::Reduce {
                op,
                x: at(0),
                dims: ints("dims")?,
                keepdim: boolean("keepdim")?,
                correction,
            });
        }
        Ok(match name {
            "input" => Op::Input {
                name: string("name")?,
            },
            "param" => Op::Param {
                name: string("name")?,
            },
            "const" => Op::Const {
                value: float("value")?,
                dtype: dtype()?,
            },
            "where" => {
                arity(&[3])?;
                Op::Where {
                    condition: at(0),
                    x: at(1),
                    y: at(2),
                }
            }
            "cast" => {
                arity(&[1])?;
                Op::Cast {
                    x: at(0),
                    dtype: dtype()?,
                }
            }
            "linear" => {
                arity(&[2, 3])?;
                Op::Linear {
                    x: at(0),
                    weight: at(1),
                    bias: optional(2),
                }
            }
            "matmul" => {
                arity(&[2])?;
                Op::Matmul { x: at(0), w: at(1) }
            }
            "layer_norm" => {
                arity(&[1, 2, 3])?;
                Op::LayerNorm {
                    x: at(0),
                    weight: optional(1),
                    bias: optional(2),
                    dims: int("dims")? as usize,
                    eps: float("eps")?,
                }
            }
            "rms_norm" => {
                arity(&[1, 2])?;
                Op::RmsNorm {
                    x: at(0),
                    weight: optional(1),
                    dims: int("dims")? as usize,
                    eps: float("eps")?,
                }
            }
            "softmax" | "log_softmax" => {
                arity(&[1])?;
                Op::Softmax {
                    x: at(0),
                    axis: int("axis")?,
                    log: name == "log_softmax",
                }
            }
            "embedding" => {
                arity(&[2])?;
                Op::Embedding {
                    ids: at(0),
                    weight: at(1),
                    padding_idx: int("padding_idx")?,
                }
            }
            "attention" => {
                arity(&[3])?;
                let scale = if attr("scale").is_some() {
                    Some(float("scale")?)
                } else {
                    None
                };
                Op::Attention {
                    q: at(0),
                    k: at(1),
                    v: at(2),
                    causal: boolean("causal")?,
                    scale,
                }
            }
            "reshape_tail" => {
                arity(&[1])?;
                Op::ReshapeTail {
                    x: at(0),
                    tail: ints("tail")?,
                }
            }
            "select_static" => {
                arity(&[1])?;
                Op::SelectStatic {
                    x: at(0),
                    dim: int("dim")? as usize,
                    index: int("index")?,
                }
            }
            "transpose_static" => {
                arity(&[1])?;
                Op::TransposeStatic {
                    x: at(0),
                    dim0: int("dim0")? as usize,
                    dim1: int("dim1")? as usize,
                }
            }
            "dropout" => {
                arity(&[1])?;
                Op::Dropout {
                    x: at(0),
                    p: float("p")?,
                    train: boolean("train")?,
                }
            }
            "pad" => {
                arity(&[1])?;
                Op::Pad {
                    x: at(0),
                    value: float("value")?,
                }
            }
            "unpad" => {
                arity(&[2])?;
                Op::Unpad {
                    x: at(0),
                    lengths: at(1),
                }
            }
            "mask" => {
                arity(&[1])?;
                Op::Mask { lengths: at(0) }
            }
            "max_length" => {
                arity(&[1])?;
                Op::MaxLength { lengths: at(0) }
            }
            "total_length" => {
                arity(&[1])?;
                Op::TotalLength { lengths: at(0) }
            }
            "cross_entropy" => {
                arity(&[2])?;
                Op::CrossEntropy {
                    logits: at(0),
                    target: at(1),
                    ignore_index: int("ignore_index")?,
                    smoothing: float("smoothing")?,
                    reduction: reduction()?,
                }
            }
            "repeat_lengths" => {
                arity(&[1])?;
                Op::RepeatLengths {
                    lengths: at(0),
                    repeats: int("repeats")?,
                    interleave: boolean("interleave")?,
                }
            }
            "repeat_batch" => {
                if operands.is_empty() {
                    return Err("repeat_batch takes the batch and its new lengths".into());
                }
                Op::RepeatBatch {
                    x: at(0),
                    lengths: operands[1..].to_vec(),
                    repeats: int("repeats")?,
                    interleave: boolean("interleave")?,
                }
            }
            "mse_loss" => {
                arity(&[2])?;
                Op::MseLoss {
                    x: at(0),
                    target: at(1),
                    reduction: reduction()?,
                }
            }
            "window_lengths" => {
                arity(&[1])?;
                Op::WindowLengths {
                    lengths: at(0),
                    kernel: int("kernel")?,
                    stride: int("stride")?,
                    padding: int("padding")?,
                    dilation: int("dilation")?,
                }
            }
            "conv2d" => {
                arity(&[2, 3])?;
                Op::Conv2d {
                    x: at(0),
                    weight: at(1),
                    bias: optional(2),
                    stride: ints("stride")?,
                    padding: ints("padding")?,
                    dilation: ints("dilation")?,
                    groups: int("groups")?,
                }
            }
            "max_pool2d" | "avg_pool2d" => {
                arity(&[1])?;
                let kind = if name == "max_pool2d" {
                    PoolKind::Max
                } else {
                    PoolKind::Avg
                };
                Op::Pool2d {
                    kind,
                    x: at(0),
                    kernel: ints("kernel")?,
                    stride: ints("stride")?,
                    padding: ints("padding")?,
                }
            }
            "adaptive_avg_pool2d" => {
                arity(&[1])?;
                Op::AdaptiveAvgPool2d {
                    x: at(0),
                    output: ints("output")?,
                }
            }
            "fused" => {
                let text = string("expr")?;
                Op::Fused {
                    inputs: operands.to_vec(),
                    expr: crate::FusedExpr::parse(&text)
                        .map_err(|error| format!("fused: {error}"))?,
                }
            }
            "prologue" | "epilogue" => {
                let expr = crate::FusedExpr::parse(&string("expr")?)
                    .map_err(|error| format!("{name}: {error}"))?;
                let count = usize::try_from(int("inputs")?)
                    .ok()
                    .filter(|&count| count <= operands.len())
                    .ok_or_else(|| format!("{name}: inputs must be 0..={}", operands.len()))?;
                let core_name = word("core")?;
                if name == "prologue" {
                    // The core's first operand is the expression (`%0` stands for it).
                    let core_operands = [&[ValueId(0)], &operands[count..]].concat();
                    Op::Prologue {
                        inputs: operands[..count].to_vec(),
                        expr,
                        core: Box::new(Op::from_parts(&core_name, &core_operands, attrs, None)?),
                    }
                } else {
                    let split = operands.len() - count;
                    Op::Epilogue {
                        core: Box::new(Op::from_parts(
                            &core_name,
                            &operands[..split],
                            attrs,
                            None,
                        )?),
                        inputs: operands[split..].to_vec(),
                        expr,
                    }
                }
            }
            "per_element" => {
                let body = body.ok_or_else(|| "per_element needs a body".to_owned())?;
                Op::PerElement {
                    inputs: operands.to_vec(),
                    body: Box::new(body),
                }
            }
            other => return Err(format!("unknown op {other}")),
        })
    }
}
