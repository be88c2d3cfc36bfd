//! Kernel programs: the target-independent description of what runs. Every buffer is a
//! [`Slot`] of `rows x width` scalars, where `rows` is computed from lengths at run
//! time, so one program serves every batch of its structure.

use nestor_ir::{BinaryOp, DType, UnaryOp, Window2d};

/// A buffer of a program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(pub u32);

/// How many rows a buffer has: `factor` times a count known at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rows {
    /// What is counted.
    pub base: RowBase,
    /// Rows per counted unit.
    pub factor: i64,
}

/// The run-time count behind [`Rows`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowBase {
    /// One (a static number of rows).
    One,
    /// The sum of a lengths buffer: the packed rows of a ragged batch.
    Total(Slot),
    /// The number of entries of a lengths buffer: the batch size.
    Batch(Slot),
    /// `sum(a[i] * b[i])` of two lengths buffers: the packed rows of a batch with two
    /// ragged dims (images `[C, H_i, W_i]`).
    Volume(Slot, Slot),
    /// The batch size times the longest length: the rows of a padded `[B, max(L)]` grid.
    Padded(Slot),
}

impl Rows {
    /// `count` static rows.
    pub fn fixed(count: i64) -> Self {
        Self {
            base: RowBase::One,
            factor: count,
        }
    }

    /// The rows times `factor`.
    pub fn times(self, factor: i64) -> Self {
        Self {
            factor: self.factor * factor,
            ..self
        }
    }
}

/// What a slot holds and where its contents come from.
#[derive(Clone, Debug, PartialEq)]
pub struct SlotInfo {
    /// Element type at the program's boundary. Computation and buffers use the
    /// program's [`FloatType`] (f16 and bf16 values are converted at the boundary; bool
    /// is 0/1); lengths and ids are i64.
    pub dtype: DType,
    /// Rows.
    pub rows: Rows,
    /// Scalars per row.
    pub width: i64,
    /// Where the contents come from.
    pub source: Source,
}

/// Where a slot's contents come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Graph input number `n` (inputs and parameters in graph order).
    Input(usize),
    /// Written by a step.
    Step,
    /// The same memory as another slot, seen with another width (a reshape).
    Alias(Slot),
}

/// How a kernel reads an input: scalar `(row, col)` of the output comes from
/// `offset + row' * row_stride + col' * col_stride`, where `row'` is the row or, with
/// a `row_map`, `map[row]`, and `col'` is `col % col_modulo` when `col_modulo > 0` (a
/// broadcast tail).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Access {
    /// The buffer.
    pub slot: Slot,
    /// Scalars between rows (0 broadcasts over rows).
    pub row_stride: i64,
    /// Scalars between columns (0 broadcasts over columns).
    pub col_stride: i64,
    /// First scalar.
    pub offset: i64,
    /// Rows read through a map the runtime builds from lengths buffers.
    pub row_map: Option<RowMap>,
    /// Wrap columns (0: no wrap).
    pub col_modulo: i64,
}

impl Access {
    /// Rows of `width` scalars of `slot`, read as they are (row `r`, column `c` is
    /// scalar `r * width + c`).
    pub fn rows(slot: Slot, width: i64) -> Self {
        Self {
            slot,
            row_stride: width,
            col_stride: 1,
            offset: 0,
            row_map: None,
            col_modulo: 0,
        }
    }
}

/// A map from the rows of a kernel's output to the rows of one of its inputs, built
/// by the runtime from lengths buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowMap {
    /// The element that owns each row of a batch of these lengths (a per-element input
    /// `[B, ...]`).
    Owners(Slot),
    /// For the rows `(i, m, n)` of a pair layout `[M_i, N_i, ...]` (lengths `M`, `N`),
    /// the row `(i, m)` of an input `[M_i, 1, ...]`.
    PairRows(Slot, Slot),
    /// For the same rows, the row `(i, n)` of an input `[1, N_i, ...]`.
    PairColumns(Slot, Slot),
    /// For the rows `(i, m, n)` of a pair layout `[M_i, N_i, ...]`, the row `(i, n, m)`
    /// of an input `[N_i, M_i, ...]` (its transpose).
    PairTransposed(Slot, Slot),
}

/// A pointwise expression over the inputs of a kernel.
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// Input number `n` at the current position.
    Load(usize),
    /// A constant.
    Const(f64),
    /// A unary function.
    Unary(UnaryOp, Box<Expr>),
    /// A binary function (predicates give 0 or 1).
    Binary(BinaryOp, Box<Expr>, Box<Expr>),
    /// `condition != 0 ? a : b`.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
}

impl Expr {
    /// The transcendental functions the expression evaluates per element (exp, log,
    /// tanh, erf and the activations built on them): what makes a kernel compute-bound.
    pub fn transcendentals(&self) -> usize {
        match self {
            Expr::Load(_) | Expr::Const(_) => 0,
            Expr::Unary(op, x) => {
                let heavy = matches!(
                    op,
                    UnaryOp::Exp
                        | UnaryOp::Log
                        | UnaryOp::Tanh
                        | UnaryOp::Sigmoid
                        | UnaryOp::Gelu
                        | UnaryOp::GeluTanh
                        | UnaryOp::Silu
                        | UnaryOp::Erf
                        | UnaryOp::Sin
                        | UnaryOp::Cos
                );
                usize::from(heavy) + x.transcendentals()
            }
            Expr::Binary(op, a, b) => {
                usize::from(*op == BinaryOp::Pow) + a.transcendentals() + b.transcendentals()
            }
            Expr::Select(c, a, b) => {
                c.transcendentals() + a.transcendentals() + b.transcendentals()
            }
        }
    }
}

/// A pointwise expression computed inside another kernel: a row or segmented kernel's
/// input (its prologue) or what a GEMM does to its output rows (its epilogue). `Load(i)` reads
/// `inputs[i]` at the kernel's current row and column.
#[derive(Clone, Debug, PartialEq)]
pub struct Fusion {
    /// Inputs, read as their accesses say (never per element).
    pub inputs: Vec<Access>,
    /// The expression.
    pub expr: Expr,
}

impl Fusion {
    /// Reads rows of `width` scalars of `slot` as they are.
    pub fn plain(slot: Slot, width: i64) -> Self {
        Self {
            inputs: vec![Access::rows(slot, width)],
            expr: Expr::Load(0),
        }
    }

    /// The slot read, when the fusion only reads one buffer as it is.
    pub fn as_plain(&self, width: i64) -> Option<Slot> {
        let [access] = &self.inputs[..] else {
            return None;
        };
        (self.expr == Expr::Load(0) && *self == Fusion::plain(access.slot, width))
            .then_some(access.slot)
    }
}

/// Row kernels: one row of `width` scalars at a time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RowKind {
    /// `(x - mean) / sqrt(var + eps) * weight + bias`.
    LayerNorm,
    /// `x / sqrt(mean(x^2) + eps) * weight`.
    RmsNorm,
    /// softmax over the row.
    Softmax,
    /// log-softmax over the row.
    LogSoftmax,
    /// The row's sum (output width 1).
    Sum,
    /// The row's mean (output width 1).
    Mean,
    /// The row's largest value (output width 1).
    Max,
    /// The row's smallest value (output width 1).
    Min,
}

/// Segmented kernels over the rows of each element, column by column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentKind {
    /// Sum over each element's rows (output: one row per element).
    Sum,
    /// Mean over each element's rows (NaN for an empty element, as torch).
    Mean,
    /// Largest value over each element's rows.
    Max,
    /// Smallest value over each element's rows.
    Min,
    /// softmax over each element's rows (output: same shape).
    Softmax,
    /// log-softmax over each element's rows.
    LogSoftmax,
}

/// What a [`Step::Window`] computes over each output pixel's window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WindowKind {
    /// Convolution (groups 1): the window's pixels times the weight, plus the bias.
    Conv,
    /// The largest of the window's pixels inside the image (NaN wins, as in torch).
    Max,
    /// The mean of the window's pixels inside the image (padding not counted).
    Average,
    /// The mean of every pixel of each image (global average pooling; NaN for an
    /// empty image).
    ImageMean,
    /// A convolution's gradient with respect to its input: the convolution of the
    /// output's gradient (`x`, `channels` = the convolution's output channels) with the
    /// weight flipped and transposed (`window` is the convolution's adjoint).
    ConvInputGrad,
    /// A convolution's gradient with respect to its weight, `out [width, channels *
    /// K_h * K_w]`: the windows of `x` times the output's gradient `grad`, summed over
    /// every pixel in blocks of fixed size, added in order.
    WeightGrad,
    /// The gradient of every image's mean pixel (`x`: one row per image) spread over
    /// the image's pixels, divided by their count.
    ImageSpread,
    /// Max pooling's gradient: each window's `grad` to the pixel the pooling picked
    /// (the first largest, or the last NaN, as libtorch), images like `x`.
    MaxGrad,
    /// Average pooling's gradient: each window's `grad` shared by its pixels inside
    /// the image.
    AverageGrad,
}

/// Lengths computed from other lengths before a run sizes its buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LengthsOp {
    /// The lengths computed.
    pub out: Slot,
    /// The lengths they are computed from.
    pub input: Slot,
    /// How.
    pub kind: LengthsKind,
}

/// How a [`LengthsOp`] computes its lengths from its input's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LengthsKind {
    /// The output sizes of a sliding window (convolution, pooling) over a ragged dim.
    Window {
        /// Window size.
        kernel: i64,
        /// Step.
        stride: i64,
        /// Padding on each side.
        padding: i64,
        /// Dilation.
        dilation: i64,
    },
    /// Every length `n_i` repeated `times[i]` times: the segments of a pair layout
    /// `[M_i, N_i, ...]` along its second ragged dim (`times` the lengths `M`).
    Repeated {
        /// How many times each length repeats.
        times: Slot,
    },
}

/// One step of a program.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// `out[r, c] = expr(inputs at (r, c))` for every row and column.
    Pointwise {
        /// Output slot.
        out: Slot,
        /// Output rows.
        rows: Rows,
        /// Output width.
        width: i64,
        /// Inputs, read as their accesses say.
        inputs: Vec<Access>,
        /// The expression.
        expr: Expr,
    },
    /// `out = x W^T + b` (or `x W` with `transposed`): one GEMM over all rows.
    Gemm {
        /// Output slot `[rows, n]`.
        out: Slot,
        /// Input `[rows, k]`.
        x: Slot,
        /// Weight `[n, k]` (or `[k, n]` when `transposed`).
        weight: Slot,
        /// Bias `[n]`.
        bias: Option<Slot>,
        /// Rows.
        rows: Rows,
        /// Inner size.
        k: i64,
        /// Output width.
        n: i64,
        /// The weight is `[k, n]`.
        transposed: bool,
        /// Computed on each chunk of output rows right after the GEMM writes it, in
        /// place (one of its inputs is `out` itself, read where it is written).
        epilogue: Option<Fusion>,
    },
    /// A row kernel (norms, softmax, row reductions).
    Row {
        /// Which.
        kind: RowKind,
        /// Output slot.
        out: Slot,
        /// The input rows: a buffer as it is, or a fused pointwise prologue.
        x: Fusion,
        /// Scale `[width]`.
        weight: Option<Slot>,
        /// Shift `[width]`.
        bias: Option<Slot>,
        /// Rows.
        rows: Rows,
        /// Scalars per row.
        width: i64,
        /// Epsilon of the norms.
        eps: f64,
    },
    /// A segmented kernel over the rows of each element.
    Segment {
        /// Which.
        kind: SegmentKind,
        /// Output slot.
        out: Slot,
        /// The input rows `[sum L, width]`: a buffer as it is, or a fused pointwise
        /// prologue.
        x: Fusion,
        /// The lengths that split the rows.
        lengths: Slot,
        /// Scalars per row.
        width: i64,
    },
    /// Varlen attention on packed heads: each element's queries attend to its keys.
    Attention {
        /// Output `[sum Lq, heads * value_dim]`.
        out: Slot,
        /// Queries `[sum Lq, heads * head_dim]`, read with `q_access`.
        q: Access,
        /// Keys `[sum Lk, heads * head_dim]`.
        k: Access,
        /// Values `[sum Lk, heads * value_dim]`.
        v: Access,
        /// Query lengths.
        q_lengths: Slot,
        /// Key lengths.
        k_lengths: Slot,
        /// Heads.
        heads: i64,
        /// Query/key width per head.
        head_dim: i64,
        /// Value width per head.
        value_dim: i64,
        /// Mask future keys.
        causal: bool,
        /// Score scale.
        scale: f64,
    },
    /// The jagged-pair matmul, one GEMM per element on the host: scores
    /// `out [sum M_i N_i] = a [sum M_i, width] b^T` with `b [sum N_i, width]`, or (`mix`)
    /// `out [sum M_i, width] = a [sum M_i N_i] b` with `b [sum N_i, width]`.
    PairGemm {
        /// Output.
        out: Slot,
        /// Left elements.
        a: Slot,
        /// Right elements.
        b: Slot,
        /// Lengths of the rows `M`.
        rows: Slot,
        /// Lengths of the other ragged dim `N`.
        columns: Slot,
        /// The inner size (scores) or the output width (mix).
        width: i64,
        /// `p @ v` rather than `q @ k^T`.
        mix: bool,
    },
    /// A sliding window over packed images `[C, H_i, W_i]` (rows are pixels), on the
    /// host: a direct convolution over the packed pixels (taps outside an image read
    /// zeros; no gathered copy), max or average pooling over the windows, each image's
    /// mean, and their gradients.
    Window {
        /// What is computed over each window.
        kind: WindowKind,
        /// Output pixels `[sum H_out W_out, width]` (one row per image for
        /// [`WindowKind::ImageMean`]).
        out: Slot,
        /// Input pixels `[sum H W, channels]`.
        x: Slot,
        /// `[width, channels, K_h, K_w]` (convolution).
        weight: Option<Slot>,
        /// `[width]` (convolution).
        bias: Option<Slot>,
        /// The gradient of the convolution's output `[sum H_out W_out, width]`
        /// ([`WindowKind::WeightGrad`]).
        grad: Option<Slot>,
        /// The images' heights.
        heights: Slot,
        /// The images' widths.
        widths: Slot,
        /// Input channels.
        channels: i64,
        /// Output channels.
        width: i64,
        /// The window's geometry.
        window: Window2d,
    },
    /// A graph the host runs (through libtorch) inside the program: an explicit
    /// per-element region. `inputs` are the slots of the host graph's inputs, in order
    /// (lengths slots for its `lengths` inputs).
    Host {
        /// Output slot.
        out: Slot,
        /// The slots of the host graph's inputs.
        inputs: Vec<Slot>,
        /// Index into [`Program::host_graphs`].
        graph: usize,
    },
    /// The padded grid of a batch with one leading ragged dim: row `(b, t)` of `out`
    /// (`B x max(L)` rows) is row `offsets[b] + t` of `x` for `t < L_b`, else `value`.
    Pad {
        /// Output slot `[B * max(L), width]`.
        out: Slot,
        /// Packed rows `[sum L, width]`.
        x: Slot,
        /// The lengths of the ragged dim.
        lengths: Slot,
        /// Scalars per row.
        width: i64,
        /// The padding value.
        value: f64,
    },
    /// The packed rows of a padded grid: row `offsets[b] + t` of `out` is row
    /// `b * max(grid lengths) + t` of `x`, for `t < L_b` (the inverse of [`Step::Pad`]).
    Unpad {
        /// Output slot `[sum L, width]`.
        out: Slot,
        /// The padded grid `[B * max(grid lengths), width]`.
        x: Slot,
        /// The lengths the grid was padded for (its row stride is their longest).
        grid: Slot,
        /// The lengths of the result.
        lengths: Slot,
        /// Scalars per row.
        width: i64,
    },
    /// `out[m x n] = sum over rows r of a[r]^T b[r]` (`a` absent: ones, `m` = 1: the
    /// column sums of `b`), divided by the number of rows when `mean` (NaN for none):
    /// weight gradients and reductions over every row.
    SumRows {
        /// Output slot `[m, n]`.
        out: Slot,
        /// `[rows, m]`, or ones.
        a: Option<Slot>,
        /// `[rows, n]`.
        b: Slot,
        /// Rows.
        rows: Rows,
        /// Width of `a`.
        m: i64,
        /// Width of `b`.
        n: i64,
        /// Divide by the number of rows.
        mean: bool,
    },
    /// `out[r, c] = 1` where `c == ids[r]`, else 0 (a row of zeros for `ignore`; other
    /// ids outside `0..classes` are bad input, checked before the step runs).
    OneHot {
        /// Output slot `[rows, classes]`.
        out: Slot,
        /// Ids (i64) `[rows]`.
        ids: Slot,
        /// Rows.
        rows: Rows,
        /// Row width.
        classes: i64,
        /// The id whose row stays zero.
        ignore: i64,
    },
    /// `out[v] = sum of g[r] over rows r with ids[r] == v`, zero for `padding` and ids
    /// outside the table.
    ScatterRows {
        /// Output slot `[vocabulary, width]`.
        out: Slot,
        /// Rows `[rows, width]`.
        g: Slot,
        /// Ids (i64) `[rows]`.
        ids: Slot,
        /// Rows.
        rows: Rows,
        /// Row width.
        width: i64,
        /// Table rows.
        vocabulary: i64,
        /// The id that gets nothing.
        padding: i64,
    },
    /// `out` viewed as `[rows, size, inner]` is zero but for `out[:, index, :] = x`
    /// (`x` viewed as `[rows, inner]`).
    Insert {
        /// Output slot.
        out: Slot,
        /// Input slot.
        x: Slot,
        /// Rows (the packed rows times the dims before the inserted one).
        rows: Rows,
        /// The inserted dim's size.
        size: i64,
        /// Where `x` goes.
        index: i64,
        /// Scalars after the inserted dim.
        inner: i64,
    },
    /// The gradient of varlen attention: of the queries, or (`keys`) of the keys and
    /// values stacked per row (`[Lk, 2, heads, head_dim]`).
    AttentionGrad {
        /// Output slot.
        out: Slot,
        /// Queries `[sum Lq, heads, head_dim]`.
        q: Access,
        /// Keys `[sum Lk, heads, head_dim]`.
        k: Access,
        /// Values `[sum Lk, heads, head_dim]`.
        v: Access,
        /// The output's cotangent `[sum Lq, heads, head_dim]`.
        g: Access,
        /// Query lengths.
        q_lengths: Slot,
        /// Key lengths.
        k_lengths: Slot,
        /// Heads.
        heads: i64,
        /// Width per head (queries, keys and values alike).
        head_dim: i64,
        /// Mask future keys.
        causal: bool,
        /// Score scale.
        scale: f64,
        /// The keys' and values' gradient rather than the queries'.
        keys: bool,
    },
    /// A dropout mask: every value `1 / (1 - p)` with probability `1 - p`, else 0, from
    /// a counter-based generator keyed by `stream`, the position and the run.
    RandomMask {
        /// Output slot.
        out: Slot,
        /// Rows.
        rows: Rows,
        /// Scalars per row.
        width: i64,
        /// Drop probability.
        p: f64,
        /// Which mask of the program.
        stream: i64,
    },
    /// `out[b] = lengths[b]` as numbers.
    LengthValues {
        /// Output slot `[B]`.
        out: Slot,
        /// The lengths.
        lengths: Slot,
    },
    /// `out[r] = table[ids[r]]`.
    Gather {
        /// Output slot `[rows, width]`.
        out: Slot,
        /// Table `[vocabulary, width]`.
        table: Slot,
        /// Ids (i64) `[rows]`.
        ids: Slot,
        /// Rows.
        rows: Rows,
        /// Table width.
        width: i64,
    },
}

impl Step {
    /// The slots the step reads (lengths slots excepted).
    pub fn reads(&self) -> Vec<Slot> {
        match self {
            Step::Pointwise { inputs, .. } => inputs.iter().map(|access| access.slot).collect(),
            Step::Gemm {
                out,
                x,
                weight,
                bias,
                epilogue,
                ..
            } => [
                vec![*x, *weight],
                bias.iter().copied().collect(),
                epilogue
                    .iter()
                    .flat_map(|fusion| fusion.inputs.iter())
                    .map(|access| access.slot)
                    .filter(|slot| slot != out)
                    .collect(),
            ]
            .concat(),
            Step::Row {
                x, weight, bias, ..
            } => [
                x.inputs.iter().map(|access| access.slot).collect(),
                weight.iter().copied().collect(),
                bias.iter().copied().collect::<Vec<_>>(),
            ]
            .concat(),
            Step::Segment { x, .. } => x.inputs.iter().map(|access| access.slot).collect(),
            Step::Attention { q, k, v, .. } => vec![q.slot, k.slot, v.slot],
            Step::PairGemm { a, b, .. } => vec![*a, *b],
            Step::Window {
                x,
                weight,
                bias,
                grad,
                ..
            } => [Some(*x), *weight, *bias, *grad]
                .into_iter()
                .flatten()
                .collect(),
            Step::Gather { table, ids, .. } => vec![*table, *ids],
            Step::SumRows { a, b, .. } => a.iter().copied().chain([*b]).collect(),
            Step::LengthValues { .. } => Vec::new(),
            Step::OneHot { ids, .. } => vec![*ids],
            Step::ScatterRows { g, ids, .. } => vec![*g, *ids],
            Step::Insert { x, .. } => vec![*x],
            Step::RandomMask { .. } => Vec::new(),
            Step::AttentionGrad { q, k, v, g, .. } => vec![q.slot, k.slot, v.slot, g.slot],
            Step::Pad { x, .. } | Step::Unpad { x, .. } => vec![*x],
            Step::Host { inputs, .. } => inputs.clone(),
        }
    }

    /// The transcendental functions the step evaluates per output value (its
    /// expression's, a softmax's two exponentials): what makes it compute-bound.
    pub fn transcendentals(&self) -> usize {
        match self {
            Step::Pointwise { expr, .. } => expr.transcendentals(),
            Step::Row { kind, x, .. } => {
                let exponentials = match kind {
                    RowKind::Softmax | RowKind::LogSoftmax => 2,
                    _ => 0,
                };
                exponentials + x.expr.transcendentals()
            }
            _ => 0,
        }
    }

    /// The slot the step writes.
    pub fn output(&self) -> Slot {
        match self {
            Step::Pointwise { out, .. }
            | Step::Gemm { out, .. }
            | Step::Row { out, .. }
            | Step::Segment { out, .. }
            | Step::Attention { out, .. }
            | Step::PairGemm { out, .. }
            | Step::Window { out, .. }
            | Step::Host { out, .. }
            | Step::Pad { out, .. }
            | Step::Unpad { out, .. }
            | Step::Gather { out, .. }
            | Step::SumRows { out, .. }
            | Step::LengthValues { out, .. }
            | Step::OneHot { out, .. }
            | Step::ScatterRows { out, .. }
            | Step::Insert { out, .. }
            | Step::RandomMask { out, .. }
            | Step::AttentionGrad { out, .. } => *out,
        }
    }
}

/// A dim of the elements of a ragged result.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDim {
    /// Sized by a lengths buffer.
    Ragged(Slot),
    /// The same size in every element.
    Static(i64),
}

/// A ragged or dense result of a program.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    /// A ragged batch: packed rows (ragged dims first, as always) of its static dims.
    Ragged {
        /// The data.
        slot: Slot,
        /// The dims of every element.
        dims: Vec<OutDim>,
    },
    /// A dense tensor: `rows` rows of `tail` (the first dim is the row count).
    Dense {
        /// The data.
        slot: Slot,
        /// The dims after the first.
        tail: Vec<i64>,
    },
    /// A 0-d tensor (a loss): one value.
    Scalar {
        /// The data.
        slot: Slot,
    },
    /// A padded tensor `[B, max(L), *tail]` of a [`Step::Pad`].
    Padded {
        /// The data.
        slot: Slot,
        /// The lengths whose longest is the second dim.
        lengths: Slot,
        /// The dims after the padded one.
        tail: Vec<i64>,
    },
}

impl Output {
    /// The slot that holds the result.
    pub fn slot(&self) -> Slot {
        match self {
            Output::Ragged { slot, .. }
            | Output::Dense { slot, .. }
            | Output::Scalar { slot }
            | Output::Padded { slot, .. } => *slot,
        }
    }
}

/// A lowered graph: slots, steps in order, outputs.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Program {
    /// Every buffer.
    pub slots: Vec<SlotInfo>,
    /// What runs, in order.
    pub steps: Vec<Step>,
    /// The results.
    pub outputs: Vec<Output>,
    /// Lengths computed before each run sizes its buffers, in order.
    pub lengths_ops: Vec<LengthsOp>,
    /// The graphs of host steps.
    pub host_graphs: Vec<nestor_ir::Graph>,
    /// What kernels compute in and buffers hold: f32, or f64 for f64 programs.
    pub float: FloatType,
    /// Whether kernels give NaN for gelu(+inf), as libtorch's AVX-512 kernels do, rather
    /// than +inf, as its AVX2 kernels and the math do (the default): the frontend sets
    /// it to what the process's eager gelu gives.
    pub gelu_nan_at_infinity: bool,
}

/// The floating-point type a program computes in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum FloatType {
    /// Single precision (also for f16 and bf16 models, converted at the boundary).
    #[default]
    F32,
    /// Double precision.
    F64,
}

impl FloatType {
    /// Bytes per scalar.
    pub fn size(self) -> usize {
        match self {
            FloatType::F32 => 4,
            FloatType::F64 => 8,
        }
    }
}

impl Program {
    /// Adds a slot.
    pub fn slot(&mut self, info: SlotInfo) -> Slot {
        self.slots.push(info);
        Slot(self.slots.len() as u32 - 1)
    }

    /// A slot's description.
    pub fn info(&self, slot: Slot) -> &SlotInfo {
        &self.slots[slot.0 as usize]
    }

    /// Whether `slot` is one of the program's inputs as given (its values are in the
    /// caller's memory when a run starts, so the host can read them: ids to check, or to
    /// index by).
    pub fn is_input(&self, slot: Slot) -> bool {
        matches!(self.info(slot).source, Source::Input(_))
    }

    /// The number of kernel launches per run (one per step).
    pub fn launches(&self) -> usize {
        self.steps.len()
    }
}

impl std::fmt::Display for Rows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let base = match self.base {
            RowBase::One => return write!(f, "{}", self.factor),
            RowBase::Total(lengths) => format!("total(s{})", lengths.0),
            RowBase::Batch(lengths) => format!("batch(s{})", lengths.0),
            RowBase::Volume(a, b) => format!("volume(s{}, s{})", a.0, b.0),
            RowBase::Padded(lengths) => format!("padded(s{})", lengths.0),
        };
        match self.factor {
            1 => f.write_str(&base),
            factor => write!(f, "{base} * {factor}"),
        }
    }
}

impl std::fmt::Display for Program {
    /// A compact listing for humans (`nestor-opt --emit program`): one line per slot
    /// (`s<index>: dtype [rows x width]` and where it comes from), lengths op, step (its
    /// fields as `Debug` writes them) and output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "program ({:?}): {} slots, {} steps, {} outputs",
            self.float,
            self.slots.len(),
            self.steps.len(),
            self.outputs.len()
        )?;
        for (index, slot) in self.slots.iter().enumerate() {
            let source = match slot.source {
                Source::Input(input) => format!(" <- input {input}"),
                Source::Step => String::new(),
                Source::Alias(of) => format!(" = s{}", of.0),
            };
            writeln!(
                f,
                "  s{index}: {} [{} x {}]{source}",
                slot.dtype, slot.rows, slot.width
            )?;
        }
        for op in &self.lengths_ops {
            writeln!(f, "  lengths {op:?}")?;
        }
        for (index, step) in self.steps.iter().enumerate() {
            writeln!(f, "  step {index}: {step:?}")?;
        }
        for (index, output) in self.outputs.iter().enumerate() {
            writeln!(f, "  output {index}: {output:?}")?;
        }
        Ok(())
    }
}
