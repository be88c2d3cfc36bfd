//! The closed set of IR operations. The `Op` enum is the op table: each variant is one
//! declaration, and `#[derive(OpTable)]` writes its name, operands, attributes and parser
//! from it (a field's role comes from its type, see [`field`](self::field)). Adding an op
//! is one variant here plus its type rule in `infer`; the text form comes with it.

mod attr;
mod field;
mod fused_kernel;

use nestor_ir_derive::OpTable;

pub use attr::{Attr, F64};
pub(crate) use field::{OpField, OpKind, Parts};

use crate::{DType, Graph, ValueId};

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
    /// `-1`, `0` or `1` by the sign of `x` (`0` for `-0` and NaN, as torch)
    Sign,
    /// logical not
    Not,
    /// `e^x - 1`
    Expm1,
    /// `ln(1 + x)`
    Log1p,
    /// `1 / x`
    Reciprocal,
    /// round down
    Floor,
    /// round up
    Ceil,
    /// round half to even
    Round,
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
    /// `a != b` as truth values (exactly one nonzero)
    Xor,
    /// `a - b floor(a / b)`: the remainder with the divisor's sign (torch's
    /// `remainder`, Python's `%`).
    Remainder,
    /// `atan2(a, b)`: the angle of the point `(b, a)`.
    Atan2,
}

impl ReduceOp {
    /// Whether the reduction takes a Bessel correction (variance, standard deviation).
    pub fn has_correction(self) -> bool {
        matches!(self, ReduceOp::Var | ReduceOp::Std)
    }

    /// Whether the reduction gives positions (i64) rather than values.
    pub fn gives_positions(self) -> bool {
        matches!(self, ReduceOp::Argmax | ReduceOp::Argmin)
    }

    /// Whether the reduction chooses one position along one dim (its value, or the
    /// position itself).
    pub fn picks_one(self) -> bool {
        matches!(
            self,
            ReduceOp::Argmax | ReduceOp::Argmin | ReduceOp::Max | ReduceOp::Min
        )
    }
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
                | BinaryOp::Xor
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
    /// the position (i64) of the largest value along one dim: its first, or its first
    /// NaN
    Argmax,
    /// the position (i64) of the smallest value along one dim, as [`ReduceOp::Argmax`]
    Argmin,
    /// the largest value along one dim, its gradient to that one position (torch's
    /// `max(dim)`; `amax` shares it among equal values)
    Max,
    /// the smallest value along one dim, as [`ReduceOp::Max`]
    Min,
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

/// Which gradients an [`Op::AttentionGrad`] gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AttentionGradPart {
    /// the queries' (the type of `q`)
    Queries,
    /// the keys' and values' stacked, `[B; Lk, 2, heads, head_dim]` (keys at 0)
    KeysValues,
    /// all three stacked, `[B; L, 3, heads, head_dim]` (queries at 0, keys at 1, values
    /// at 2): self-attention, queries, keys and values of one type
    All,
}

/// Which gradient an [`Op::NormGrad`] gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NormGradPart {
    /// the input's: `rstd (g - mean(g) - xhat mean(g xhat))` per row (no `mean(g)` for
    /// RMS norm), `g` the output's cotangent times the weight
    Input,
    /// `g xhat` per value, whose column sums are the weight's gradient (`g` the output's
    /// cotangent)
    Weight,
}

/// Pooling kinds for per-element bodies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PoolKind {
    /// max pooling
    Max,
    /// average pooling
    Avg,
}

/// `word` / `from_word` for an enum whose variants are words of the text form.
macro_rules! word_enum {
    ($type:ident { $($variant:ident => $word:literal),* $(,)? }) => {
        impl $type {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$type] = &[$($type::$variant),*];
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

/// Names ops after an enum's words.
macro_rules! op_kind {
    ($($type:ident),*) => {$(
        impl OpKind for $type {
            fn op_name(self) -> &'static str {
                self.word()
            }
            fn from_op_name(name: &str) -> Option<Self> {
                Self::from_word(name)
            }
        }
    )*};
}

word_enum!(UnaryOp {
    Neg => "neg", Abs => "abs", Exp => "exp", Log => "log", Sqrt => "sqrt", Rsqrt => "rsqrt",
    Square => "square", Sin => "sin", Cos => "cos", Tanh => "tanh", Sigmoid => "sigmoid",
    Relu => "relu", Gelu => "gelu", GeluTanh => "gelu_tanh", Silu => "silu", Erf => "erf", Sign => "sign", Not => "not",
    Expm1 => "expm1", Log1p => "log1p", Reciprocal => "reciprocal", Floor => "floor", Ceil => "ceil",
    Round => "round",
});
word_enum!(BinaryOp {
    Add => "add", Sub => "sub", Mul => "mul", Div => "div", Pow => "pow", Maximum => "maximum",
    Minimum => "minimum", Eq => "eq", Ne => "ne", Lt => "lt", Le => "le", Gt => "gt", Ge => "ge",
    And => "and", Or => "or", Xor => "xor", Remainder => "remainder", Atan2 => "atan2",
});
word_enum!(ReduceOp {
    Sum => "sum", Mean => "mean", Amax => "amax", Amin => "amin", LogSumExp => "logsumexp",
    Var => "var", Std => "std", All => "all", Any => "any", Argmax => "argmax",
    Argmin => "argmin", Max => "max", Min => "min",
});
word_enum!(LossReduction { Mean => "mean", Sum => "sum", None => "none" });
word_enum!(AttentionGradPart { Queries => "queries", KeysValues => "keys_values", All => "all" });
word_enum!(NormGradPart { Input => "input", Weight => "weight" });
word_enum!(PoolKind { Max => "max_pool2d", Avg => "avg_pool2d" });
op_kind!(UnaryOp, BinaryOp, ReduceOp, PoolKind);

/// The families of ops. Each stage (type inference, the interpreter, lowering) has one
/// module per family, and dispatches on [`Op::family`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpFamily {
    /// Graph inputs and parameters (their types are declared).
    Source,
    /// Elementwise ops: constants, unary and binary functions, `where`, casts, dropout,
    /// fused expressions.
    Pointwise,
    /// A row or segmented op with a pointwise prologue, a GEMM with a pointwise epilogue.
    FusedKernel,
    /// GEMMs over packed rows and the embedding gather.
    Gemm,
    /// Layer and RMS normalization, softmax.
    Norm,
    /// Reductions.
    Reduce,
    /// Varlen attention.
    Attention,
    /// Reshapes, selections, padding, masks, lengths and repeats.
    Structure,
    /// Losses.
    Loss,
    /// Convolution and pooling of one element, and per-element regions.
    PerElement,
}

/// One IR operation. Every op produces exactly one value.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, OpTable)]
pub enum Op {
    /// A data input of the graph (a batch, its lengths, a dense tensor).
    #[op(name = "input", family = Source)]
    Input {
        /// The input's name.
        name: String,
    },
    /// A parameter: a graph input bound to a trained tensor.
    #[op(name = "param", family = Source)]
    Param {
        /// The parameter's name (its `VarStore` path when known).
        name: String,
    },
    /// A 0-d constant.
    #[op(name = "const", family = Pointwise)]
    Const {
        /// Its value.
        value: F64,
        /// Its element type.
        dtype: DType,
    },
    /// `op(x)` elementwise.
    #[op(family = Pointwise)]
    Unary {
        /// The function.
        #[op(kind)]
        op: UnaryOp,
        /// The argument.
        x: ValueId,
    },
    /// `op(lhs, rhs)` elementwise, broadcasting dense operands against ragged ones as
    /// DESIGN.md section 7 says.
    #[op(family = Pointwise)]
    Binary {
        /// The function.
        #[op(kind)]
        op: BinaryOp,
        /// Left operand.
        lhs: ValueId,
        /// Right operand.
        rhs: ValueId,
    },
    /// `condition ? x : y` elementwise.
    #[op(name = "where", family = Pointwise)]
    Where {
        /// Bool condition.
        condition: ValueId,
        /// Taken where true.
        x: ValueId,
        /// Taken where false.
        y: ValueId,
    },
    /// Conversion of the element type.
    #[op(name = "cast", family = Pointwise)]
    Cast {
        /// The argument.
        x: ValueId,
        /// The new element type.
        dtype: DType,
    },
    /// `x W^T + b` over the last dim (one GEMM over packed rows).
    #[op(name = "linear", family = Gemm)]
    Linear {
        /// Input with a static last dim.
        x: ValueId,
        /// `[out, in]`.
        weight: ValueId,
        /// `[out]`.
        bias: Option<ValueId>,
    },
    /// `x @ w` over the last dim with a dense `[K, M]` or `[K]` operand.
    #[op(name = "matmul", family = Gemm)]
    Matmul {
        /// Input.
        x: ValueId,
        /// Dense matrix or vector.
        w: ValueId,
    },
    /// Layer normalization over the last `dims` static dims.
    #[op(name = "layer_norm", family = Norm)]
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
    #[op(name = "rms_norm", family = Norm)]
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
    /// The gradient of layer norm (`centered`) or RMS norm over the last dim of `x`
    /// without its affine part, as [`NormGradPart`] says, with `xhat` the normalized
    /// `x`: its mean and `rstd = 1 / sqrt(var + eps)` recomputed from `x` row by row
    /// (one row kernel; nothing of the forward is kept).
    #[op(name = "norm_grad", family = Norm)]
    NormGrad {
        /// The norm's input.
        x: ValueId,
        /// The cotangent, of `x`'s type.
        g: ValueId,
        /// The norm's weight (`[width]`), that `g` is multiplied by first.
        weight: Option<ValueId>,
        /// Epsilon.
        eps: F64,
        /// Layer norm (centered) rather than RMS norm.
        centered: bool,
        /// Which gradient.
        part: NormGradPart,
    },
    /// Batch normalization by given per-channel statistics (the batch's own, which
    /// traced models compute with reductions, or eval mode's running ones): each channel
    /// (static element dim `channel`) minus its mean, over `sqrt(var + eps)`, scaled and
    /// shifted. Composite: decomposition makes it pointwise ops.
    #[op(name = "batch_norm", family = Norm)]
    BatchNorm {
        /// Input.
        x: ValueId,
        /// Per-channel mean `[C]`.
        mean: ValueId,
        /// Per-channel (biased) variance `[C]`.
        var: ValueId,
        /// Scale `[C]`.
        weight: Option<ValueId>,
        /// Shift `[C]`.
        bias: Option<ValueId>,
        /// The channel's element dim.
        channel: usize,
        /// Epsilon.
        eps: F64,
    },
    /// softmax or log-softmax along `axis` (static: packed; ragged: segmented).
    #[op(family = Norm)]
    Softmax {
        /// Input.
        x: ValueId,
        /// A batch-first dim (0 is the batch, which is an error; negative from the end).
        axis: i64,
        /// Log-softmax.
        #[op(names("softmax", "log_softmax"))]
        log: bool,
    },
    /// The cumulative sum or product along the ragged dim `axis` (segmented: each
    /// element's rows in order, or from its last row back for `reverse`).
    #[op(family = Norm)]
    Cumulative {
        /// Input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// A product rather than a sum.
        #[op(names("cumsum", "cumprod"))]
        product: bool,
        /// From the last row back: each row combines itself and the rows after it.
        reverse: bool,
    },
    /// The `k` largest (`largest`) or smallest values along the element dim `axis`,
    /// in order (of equal values, the first first), or (`positions`) their positions
    /// (i64): the dim becomes `k` long (along a ragged dim, by `lengths`).
    #[op(family = Norm)]
    TopK {
        /// Input.
        x: ValueId,
        /// Along a ragged dim, the result's lengths there: `constant_lengths` of x's,
        /// `k` each (elements have at least `k` positions: checked when the program
        /// runs). None along a static dim.
        lengths: Option<ValueId>,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// How many values.
        k: i64,
        /// The largest rather than the smallest.
        largest: bool,
        /// The positions rather than the values.
        #[op(names("topk", "argtopk"))]
        positions: bool,
    },
    /// The gradient of `topk(x)` along `axis`: each of the `k` values' gradient (`g`)
    /// at the position it came from, zero elsewhere.
    #[op(name = "topk_grad", family = Norm)]
    TopKGrad {
        /// The values' gradient.
        g: ValueId,
        /// The input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// How many values.
        k: i64,
        /// The largest rather than the smallest.
        largest: bool,
    },
    /// The running largest (`largest`) or smallest value along the element dim `axis`,
    /// or (`positions`) where it was last seen (i64), as torch's `cummax` / `cummin`: a
    /// value equal to the running one takes its place, and a NaN, once seen, stays.
    #[op(family = Norm)]
    Running {
        /// Input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// The largest rather than the smallest.
        #[op(names("cummin", "cummax"))]
        largest: bool,
        /// The positions rather than the values.
        positions: bool,
    },
    /// The gradient of `cummax(x)` (or `cummin`) along `axis`: each position's `g`
    /// summed where its running value was seen.
    #[op(family = Norm)]
    RunningGrad {
        /// The values' gradient (`x`'s type).
        g: ValueId,
        /// The input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// The largest rather than the smallest.
        #[op(names("cummin_grad", "cummax_grad"))]
        largest: bool,
    },
    /// Each element sorted along `axis` (stable: equal values keep their order; NaN
    /// after every number, or first when `descending`), as torch's stable sort: the
    /// values, or (`argsort`) the positions (i64) they come from.
    #[op(family = Norm)]
    Sort {
        /// Input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// Largest first.
        descending: bool,
        /// The positions rather than the values.
        #[op(names("sort", "argsort"))]
        positions: bool,
    },
    /// The gradient of `sort(x)`'s values: `g` sent back where each value came from
    /// (`out[i] = g[rank of x[i]]` along `axis`).
    #[op(name = "sort_grad", family = Norm)]
    SortGrad {
        /// The values' gradient (`x`'s type).
        g: ValueId,
        /// The sorted input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// Largest first.
        descending: bool,
    },
    /// The `k`-th smallest value along the element dim `axis` (`k` from 1; the `k`-th
    /// of a stable sort: of equal values, the first), or (`positions`) its position,
    /// the dim reduced (kept as 1: `keepdim`).
    #[op(family = Reduce)]
    KthValue {
        /// Input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// Which smallest value, from 1.
        k: i64,
        /// Keep the dim with size 1.
        keepdim: bool,
        /// The position rather than the value.
        #[op(names("kthvalue", "argkth"))]
        positions: bool,
    },
    /// The gradient of `kthvalue(x)` along `axis`: `g` (dims kept or not) at the
    /// position of the `k`-th smallest value, zero elsewhere.
    #[op(name = "kthvalue_grad", family = Reduce)]
    KthGrad {
        /// The values' gradient.
        g: ValueId,
        /// The reduced input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// Which smallest value, from 1.
        k: i64,
    },
    /// The gradient of `max(x)` (`largest`) or `min(x)` along the element dim `axis`:
    /// `g` (the reduced values' gradient, dims kept or not) at the first position of
    /// the extreme (the first NaN), zero elsewhere.
    #[op(family = Reduce)]
    ExtremeGrad {
        /// The values' gradient.
        g: ValueId,
        /// The reduced input.
        x: ValueId,
        /// A batch-first dim (negative from the end).
        axis: i64,
        /// The largest rather than the smallest.
        #[op(names("min_grad", "max_grad"))]
        largest: bool,
    },
    /// A reduction over batch-first dims (`0` is the batch; empty means all).
    #[op(family = Reduce)]
    Reduce {
        /// The reduction.
        #[op(kind)]
        op: ReduceOp,
        /// Input.
        x: ValueId,
        /// Reduced dims.
        dims: Vec<i64>,
        /// Keep reduced dims with size 1.
        keepdim: bool,
        /// Bessel correction (variance and standard deviation).
        #[op(only_if = "ReduceOp::has_correction")]
        correction: i64,
    },
    /// Rows of `weight` gathered at integer ids: `[*s] -> [*s, D]`.
    #[op(name = "embedding", family = Gemm)]
    Embedding {
        /// Integer ids.
        ids: ValueId,
        /// `[vocabulary, D]`.
        weight: ValueId,
        /// Row that gets no gradient (`-1`: none).
        padding_idx: i64,
    },
    /// Varlen attention on packed heads `[L, H, D]`: each element attends within itself.
    #[op(name = "attention", family = Attention)]
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
    #[op(name = "reshape_tail", family = Structure)]
    ReshapeTail {
        /// Input.
        x: ValueId,
        /// New static tail.
        tail: Vec<i64>,
    },
    /// A dense value of static shape seen with another static shape of the same volume
    /// (no value moves).
    #[op(name = "reshape", family = Structure)]
    Reshape {
        /// Input.
        x: ValueId,
        /// New shape.
        shape: Vec<i64>,
    },
    /// Selects `index` of static element dim `dim`, removing it.
    #[op(name = "select_static", family = Structure)]
    SelectStatic {
        /// Input.
        x: ValueId,
        /// Static element dim.
        dim: usize,
        /// Position.
        index: i64,
    },
    /// Swaps two static element dims.
    #[op(name = "transpose_static", family = Structure)]
    TransposeStatic {
        /// Input.
        x: ValueId,
        /// First element dim.
        dim0: usize,
        /// Second element dim.
        dim1: usize,
    },
    /// A pair layout `[M, N, ...]` with `value` at the positions `(i, j)` of a key after
    /// its query (`j > i`): the causal mask of attention written over pairs.
    #[op(name = "causal_fill", family = Structure)]
    CausalFill {
        /// Input.
        x: ValueId,
        /// The value of masked positions (`-inf` for attention).
        value: F64,
    },
    /// A static dim of size 1 inserted at element dim `dim` (`0..=rank`): no value
    /// moves.
    #[op(name = "unsqueeze", family = Structure)]
    Unsqueeze {
        /// Input.
        x: ValueId,
        /// Where the new dim goes.
        dim: usize,
    },
    /// Swaps a ragged element dim with a static one (`[B; L, D]` gives `[B; D, L]`: no
    /// value moves, the packed rows are the same), or the two ragged dims of a pair
    /// layout (`[B; M, N, ...]` gives `[B; N, M, ...]`: every element's rows reorder).
    #[op(name = "transpose_ragged", family = Structure)]
    TransposeRagged {
        /// Input.
        x: ValueId,
        /// First element dim.
        dim0: usize,
        /// Second element dim (one of the two is ragged, the other static).
        dim1: usize,
    },
    /// The jagged-pair matmul, element by element: `[B; M, K] @ [B; K, N] -> [B; M, N]`
    /// with `M` and `N` ragged (attention's scores, `q @ k^T`), or
    /// `[B; M, N] @ [B; N, D] -> [B; M, D]` with `M` and `N` ragged (its mix, `p @ v`).
    #[op(name = "pair_matmul", family = Gemm)]
    PairMatmul {
        /// The left elements.
        a: ValueId,
        /// The right elements.
        b: ValueId,
    },
    /// Pairwise `p`-norm distances, element by element: `[B; M, D]` and `[B; N, D]`
    /// give `[B; M, N]` (`M`, `N` ragged; torch's `cdist`: `p = 0` counts the differing
    /// coordinates, `p = inf` takes the largest difference).
    #[op(name = "cdist", family = Gemm)]
    Cdist {
        /// The left points.
        a: ValueId,
        /// The right points.
        b: ValueId,
        /// The norm (at least 0, `inf` included).
        p: F64,
    },
    /// `x` clamped into `[min, max]` (an infinite bound leaves that side open; NaN stays
    /// NaN), as torch's `clamp`, whose gradient passes where `min <= x <= max`.
    #[op(name = "clamp", family = Pointwise)]
    Clamp {
        /// Input.
        x: ValueId,
        /// The lower bound.
        min: F64,
        /// The upper bound.
        max: F64,
    },
    /// Dropout with probability `p` (identity unless `train`).
    #[op(name = "dropout", family = Pointwise)]
    Dropout {
        /// Input.
        x: ValueId,
        /// Drop probability.
        p: F64,
        /// Training mode.
        train: bool,
    },
    /// The padded dense tensor `[B, max(L), ...]` of a ragged value.
    #[op(name = "pad", family = Structure)]
    Pad {
        /// Ragged input.
        x: ValueId,
        /// Padding value.
        value: F64,
    },
    /// The ragged value of a padded dense tensor, by its lengths.
    #[op(name = "unpad", family = Structure)]
    Unpad {
        /// Dense input `[B, max(L), ...]`.
        x: ValueId,
        /// Lengths of the leading ragged dim.
        lengths: ValueId,
    },
    /// The padding mask `bool[B, max(L)]`, true on data.
    #[op(name = "mask", family = Structure)]
    Mask {
        /// Lengths.
        lengths: ValueId,
    },
    /// `max(L)` as an `i64` scalar.
    #[op(name = "max_length", family = Structure)]
    MaxLength {
        /// Lengths.
        lengths: ValueId,
    },
    /// `sum(L)` (packed rows) as an `i64` scalar.
    #[op(name = "total_length", family = Structure)]
    TotalLength {
        /// Lengths.
        lengths: ValueId,
    },
    /// Cross entropy of logits `[..., C]` against class ids.
    #[op(name = "cross_entropy", family = Loss)]
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
    #[op(name = "repeat_lengths", family = Structure)]
    RepeatLengths {
        /// Lengths.
        lengths: ValueId,
        /// Copies of every element.
        repeats: i64,
        /// Element by element rather than whole.
        interleave: bool,
    },
    /// Lengths of `size` for every element of the batch of `lengths` (the `k` rows of
    /// a top `k` along a ragged dim).
    #[op(name = "constant_lengths", family = Structure)]
    ConstantLengths {
        /// Lengths (the batch).
        lengths: ValueId,
        /// Every element's length.
        size: i64,
    },
    /// The lengths of a slice `start:end` (bounds as Python's, resolved per element:
    /// [`crate::SliceBounds`]) of each element of the batch of `lengths`.
    #[op(name = "slice_lengths", family = Structure)]
    SliceLengths {
        /// Lengths.
        lengths: ValueId,
        /// First position.
        start: i64,
        /// Past the last position ([`i64::MAX`]: the end).
        end: i64,
    },
    /// Positions `start:end` (resolved per element, as Python's) of the leading ragged
    /// dim of `x`'s elements (its only ragged dim); `lengths` is the result's,
    /// `slice_lengths` of x's in the same length formula.
    #[op(name = "slice_ragged", family = Structure)]
    SliceRagged {
        /// The batch.
        x: ValueId,
        /// The lengths of the result.
        lengths: ValueId,
        /// First position.
        start: i64,
        /// Past the last position ([`i64::MAX`]: the end).
        end: i64,
    },
    /// The gradient of `slice_ragged`: the rows of `g` at the positions `start:end` of
    /// elements like `like` (the batch that was sliced), zeros at the others.
    #[op(name = "unslice_ragged", family = Structure)]
    UnsliceRagged {
        /// The slice's gradient.
        g: ValueId,
        /// The batch that was sliced (its type).
        like: ValueId,
        /// First position.
        start: i64,
        /// Past the last position ([`i64::MAX`]: the end).
        end: i64,
    },
    /// A batch repeated as `RepeatLengths` says; `lengths` are its new lengths values
    /// (one per ragged dim, from `repeat_lengths`).
    #[op(name = "repeat_batch", family = Structure)]
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
    /// The sum of the copies of each element of a repeated batch `g` (`repeat_batch`'s
    /// gradient): elements like `like`, the batch that was repeated.
    #[op(name = "unrepeat_batch", family = Structure)]
    UnrepeatBatch {
        /// The repeated batch.
        g: ValueId,
        /// The batch that was repeated (its type).
        like: ValueId,
        /// Copies of every element.
        repeats: i64,
        /// Element by element rather than whole.
        interleave: bool,
    },
    /// `x` seen with other lengths values for its ragged dims (`lengths`, one per
    /// ragged dim, in order), which must equal its own when the program runs (window
    /// sizes of two formulas that agreed when traced): the same values; an unequal run
    /// is an error naming the element.
    #[op(name = "match_lengths", family = Structure)]
    MatchLengths {
        /// The batch.
        x: ValueId,
        /// The lengths its ragged dims take, one per ragged dim.
        lengths: Vec<ValueId>,
    },
    /// Mean squared error.
    #[op(name = "mse_loss", family = Loss)]
    MseLoss {
        /// Predictions.
        x: ValueId,
        /// Targets.
        target: ValueId,
        /// Reduction.
        reduction: LossReduction,
    },
    /// The lengths after a convolution or pooling window slides over a ragged dim.
    #[op(name = "window_lengths", family = Structure)]
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
    #[op(name = "conv2d", family = PerElement)]
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
    #[op(family = PerElement)]
    Pool2d {
        /// Max or average.
        #[op(kind)]
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
    #[op(name = "adaptive_avg_pool2d", family = PerElement)]
    AdaptiveAvgPool2d {
        /// Input.
        x: ValueId,
        /// Output spatial size.
        output: Vec<i64>,
    },
    /// Bilinear interpolation of one dense element `[C, H, W]` to `[C, *output]`
    /// (`align_corners` as torch's; per-element bodies only).
    #[op(name = "interpolate_bilinear", family = PerElement)]
    InterpolateBilinear {
        /// Input.
        x: ValueId,
        /// Output spatial size.
        output: Vec<i64>,
        /// Whether the corner pixels of input and output align.
        align_corners: bool,
    },
    /// The gradient of bilinear interpolation to `output`: each pixel of `x` gets the
    /// cells of `g [C, *output]` that read it, times the weight they read it with;
    /// images like `x`.
    #[op(name = "interpolate_bilinear_grad", family = PerElement)]
    InterpolateBilinearGrad {
        /// The interpolated values' gradient.
        g: ValueId,
        /// The interpolated images (their sizes).
        x: ValueId,
        /// The interpolation's output size.
        output: Vec<i64>,
        /// Whether the corner pixels of input and output align.
        align_corners: bool,
    },
    /// The gradient of a convolution of images `[C_in, H_i, W_i]` with respect to its
    /// input, from the gradient `g` of its output `[C_out, H_out, W_out]` (a transposed
    /// convolution): images like `x`.
    #[op(name = "conv2d_input_grad", family = PerElement)]
    Conv2dInputGrad {
        /// The output's gradient.
        g: ValueId,
        /// `[C_out, C_in / groups, Kh, Kw]`.
        weight: ValueId,
        /// The convolution's input (its sizes).
        x: ValueId,
        /// Strides.
        stride: Vec<i64>,
        /// Paddings.
        padding: Vec<i64>,
        /// Dilations.
        dilation: Vec<i64>,
        /// Groups.
        groups: i64,
    },
    /// The gradient of a convolution of images `x` with respect to its weight, from the
    /// gradient `g` of its output: `[C_out, C_in / groups, Kh, Kw]`, summed over every
    /// image.
    #[op(name = "conv2d_weight_grad", family = PerElement)]
    Conv2dWeightGrad {
        /// The convolution's input.
        x: ValueId,
        /// The output's gradient.
        g: ValueId,
        /// Window.
        kernel: Vec<i64>,
        /// Strides.
        stride: Vec<i64>,
        /// Paddings.
        padding: Vec<i64>,
        /// Dilations.
        dilation: Vec<i64>,
        /// Groups.
        groups: i64,
    },
    /// The gradient of max (`max`) or average pooling (padding not counted) of images
    /// `x` from the gradient `g` of its output: images like `x` (each window's share goes
    /// to the pixel libtorch's pooling picked, or to every pixel it averaged).
    #[op(name = "pool2d_grad", family = PerElement)]
    Pool2dGrad {
        /// Max pooling rather than average.
        max: bool,
        /// The pooled images.
        x: ValueId,
        /// The output's gradient.
        g: ValueId,
        /// Window.
        kernel: Vec<i64>,
        /// Strides.
        stride: Vec<i64>,
        /// Paddings.
        padding: Vec<i64>,
    },
    /// The gradient of each image's mean pixel (global average pooling) spread over its
    /// pixels: `g [C, 1, 1]` divided by the image's pixel count, images like `x`.
    #[op(name = "image_mean_grad", family = PerElement)]
    ImageMeanGrad {
        /// The means' gradient.
        g: ValueId,
        /// The pooled images (their sizes).
        x: ValueId,
    },
    /// The gradient of adaptive average pooling to `output` (other than `[1, 1]`): each
    /// pixel of `x` gets the cells of `g [C, *output]` whose windows hold it, each
    /// divided by its window's pixel count; images like `x`.
    #[op(name = "adaptive_avg_pool2d_grad", family = PerElement)]
    AdaptiveAvgPool2dGrad {
        /// The pooled values' gradient.
        g: ValueId,
        /// The pooled images (their sizes).
        x: ValueId,
        /// The pooling's output size.
        output: Vec<i64>,
    },
    /// Elementwise ops fused into one: `expr` over `inputs` (broadcast as `binary`
    /// broadcasts); one kernel.
    #[op(name = "fused", family = Pointwise)]
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
    #[op(name = "prologue", custom, family = FusedKernel)]
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
    #[op(name = "epilogue", custom, family = FusedKernel)]
    Epilogue {
        /// The GEMM.
        core: Box<Op>,
        /// The other values the expression reads.
        inputs: Vec<ValueId>,
        /// The expression applied to the core's result.
        expr: crate::FusedExpr,
    },
    /// `x` with size-1 dims inserted at `dims` (batch-first dims of `like`), broadcast to
    /// the shape of `like`, which is not read: the gradient of a reduction spread back
    /// over what was reduced.
    #[op(name = "expand", family = Pointwise)]
    Expand {
        /// The values.
        x: ValueId,
        /// The value whose shape (and lengths) the result takes.
        like: ValueId,
        /// Where `x` lacks the dims of `like` (reduced without `keepdim`).
        dims: Vec<i64>,
    },
    /// `sum over rows r of a[r]^T b[r]`: the `[Ma, Mb]` product of two values of one
    /// structure over all their positions but the last dim (batch, ragged and static
    /// dims alike): a weight gradient, one GEMM over the packed rows.
    #[op(name = "contract_rows", family = Gemm)]
    ContractRows {
        /// `[..., Ma]`.
        a: ValueId,
        /// `[..., Mb]`, the same positions as `a`.
        b: ValueId,
    },
    /// The lengths as numbers: `dtype[B, 1, ..., 1]` of rank `rank` (a divisor that
    /// broadcasts per element).
    #[op(name = "length_values", family = Structure)]
    LengthValues {
        /// Lengths.
        lengths: ValueId,
        /// Element type.
        dtype: DType,
        /// Rank of the result (at least 1).
        rank: usize,
    },
    /// Every row's position within its element (0 first): `i64[B; L]` of these lengths,
    /// from the lengths alone (BERT's position ids).
    #[op(name = "positions", family = Structure)]
    Positions {
        /// Lengths.
        lengths: ValueId,
    },
    /// One row of `classes` numbers per integer id: 1 at the id, 0 elsewhere (a row of
    /// zeros for `ignore` and for ids outside `0..classes`).
    #[op(name = "one_hot", family = Structure)]
    OneHot {
        /// Integer ids.
        ids: ValueId,
        /// Row width.
        classes: i64,
        /// The id whose row is all zeros (torch's `ignore_index`).
        ignore: i64,
        /// Element type of the rows.
        dtype: DType,
    },
    /// The gradient of an embedding table: `out[v] = sum of g[r] over the rows r whose
    /// id is v` (`[vocabulary, D]`), nothing for `padding_idx` (as torch).
    #[op(name = "scatter_rows", family = Gemm)]
    ScatterRows {
        /// Rows `[..., D]`, one per id.
        g: ValueId,
        /// Integer ids `[...]`.
        ids: ValueId,
        /// Rows of the result.
        vocabulary: i64,
        /// The id that gets no gradient (`-1`: none).
        padding_idx: i64,
    },
    /// Positions `start..end` of the static element dim `dim`.
    #[op(name = "slice_static", family = Structure)]
    SliceStatic {
        /// Input.
        x: ValueId,
        /// The element dim.
        dim: usize,
        /// First position.
        start: i64,
        /// Past the last position.
        end: i64,
    },
    /// `x` with `before` zeros ahead of and `after` zeros behind its values along the
    /// static element dim `dim` (the gradient of a slice).
    #[op(name = "pad_static", family = Structure)]
    PadStatic {
        /// Input.
        x: ValueId,
        /// The element dim.
        dim: usize,
        /// Zeros before.
        before: i64,
        /// Zeros after.
        after: i64,
    },
    /// The inverse of `select_static`: `x` placed at `index` of a new static element
    /// dim `dim` of `size`, zeros at the other indices (the gradient of a selection).
    #[op(name = "insert_static", family = Structure)]
    InsertStatic {
        /// Input.
        x: ValueId,
        /// The new element dim.
        dim: usize,
        /// Where `x` goes.
        index: i64,
        /// The new dim's size.
        size: i64,
    },
    /// The gradient of varlen attention with output cotangent `g`: of the queries, of
    /// the keys and values, or of all three, as [`AttentionGradPart`] says.
    #[op(name = "attention_grad", family = Attention)]
    AttentionGrad {
        /// Queries `[B; Lq, H, D]`.
        q: ValueId,
        /// Keys `[B; Lk, H, D]`.
        k: ValueId,
        /// Values `[B; Lk, H, D]`.
        v: ValueId,
        /// The cotangent of the attention output `[B; Lq, H, D]`.
        g: ValueId,
        /// Mask future keys.
        causal: bool,
        /// Score scale (default `1 / sqrt(D)`).
        scale: Option<F64>,
        /// Which gradients.
        part: AttentionGradPart,
    },
    /// A random dropout mask of the shape of `like` (which is not read): each value is
    /// `1 / (1 - p)` with probability `1 - p`, else 0, drawn from a counter-based
    /// generator keyed by `stream`, the position and the call (a new mask every call).
    #[op(name = "random_mask", family = Pointwise)]
    RandomMask {
        /// The value whose shape the mask takes.
        like: ValueId,
        /// Drop probability.
        p: F64,
        /// Which mask of the graph this is (masks of one call differ by it).
        stream: i64,
    },
    /// An explicit per-element fallback: `body` runs once per element of the first
    /// input (a dense element), with the other inputs passed whole.
    #[op(name = "per_element", family = PerElement)]
    PerElement {
        /// The ragged input, then dense inputs.
        inputs: Vec<ValueId>,
        /// The body: its inputs are the element, then the dense inputs.
        body: Box<Graph>,
    },
}

impl Op {
    /// Whether the op's type is declared rather than inferred: inputs, parameters and
    /// per-element regions ([`Graph::add_declared`](crate::Graph::add_declared)).
    pub fn declares_type(&self) -> bool {
        matches!(
            self,
            Op::Input { .. } | Op::Param { .. } | Op::PerElement { .. }
        )
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
        let mut op = self.clone();
        op.map_operands_in_place(&mut f);
        op
    }
}
