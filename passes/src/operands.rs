//! The operands of steps: buffers ([`Slot`]) and their row counts ([`Rows`], from
//! lengths at run time), how a kernel reads a buffer ([`Access`], through a [`RowMap`]),
//! the pointwise expressions fused into kernels ([`Expr`], [`Fusion`]), and the kinds
//! of row, segmented and window kernels.

use nestor_ir::{BinaryOp, NormGradPart, SliceBounds, UnaryOp, F64};

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

    /// One row per entry of `lengths`: the batch.
    pub fn batch(lengths: Slot) -> Self {
        Self {
            base: RowBase::Batch(lengths),
            factor: 1,
        }
    }

    /// The sum of `lengths`: the packed rows.
    pub fn total(lengths: Slot) -> Self {
        Self {
            base: RowBase::Total(lengths),
            factor: 1,
        }
    }

    /// The rows of the padded grid of `lengths`.
    pub fn padded(lengths: Slot) -> Self {
        Self {
            base: RowBase::Padded(lengths),
            factor: 1,
        }
    }

    /// The rows times `factor` (saturating, as run-time counts do).
    pub fn times(self, factor: i64) -> Self {
        Self {
            factor: self.factor.saturating_mul(factor),
            ..self
        }
    }
}

/// How a kernel reads an input: scalar `(row, col)` of the output comes from
/// `offset + row' * row_stride + col' * col_stride`, where `row'` is the row or, with a
/// `row_map`, `map[row]`, and `col'` is `col % col_modulo` when `col_modulo > 0` (a
/// broadcast tail); or, with `digits`, from `offset + row' * row_stride` and the
/// column's place the digits give (dims broadcast or swapped inside a row).
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
    /// Read each column at the place its digits give (then `col_stride` and
    /// `col_modulo` are unused).
    pub digits: Option<Digits>,
}

/// A column's place in a row read through a permutation or a broadcast of its dims:
/// the sum over the digits of `(col / divisor % modulo) * stride` (a mixed-radix
/// number whose digits are moved or dropped). Unused digits are [`Digit::NONE`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Digits(pub [Digit; Digits::MAX]);

/// One digit of [`Digits`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Digit {
    /// What the column is divided by.
    pub divisor: i64,
    /// The digit's range.
    pub modulo: i64,
    /// Scalars a unit of the digit moves in the row read.
    pub stride: i64,
}

impl Digit {
    /// A digit that adds nothing.
    pub const NONE: Digit = Digit {
        divisor: 1,
        modulo: 1,
        stride: 0,
    };
}

impl Digits {
    /// The most digits of an access.
    pub const MAX: usize = 4;

    /// The digits given, `None` if there are more than [`Digits::MAX`].
    pub fn new(digits: &[Digit]) -> Option<Self> {
        let mut all = [Digit::NONE; Digits::MAX];
        all.get_mut(..digits.len())?.copy_from_slice(digits);
        Some(Digits(all))
    }

    /// A row `[A, Q, B, R]` (row-major) read as `[B, Q, A, R]`: column
    /// `((b Q + q) A + a) R + r` is scalar `((a Q + q) B + b) R + r`. A transpose of
    /// any two static dims (`Q` the dims between them, `R` those after).
    pub fn swapped([a, q, b, r]: [i64; 4]) -> Self {
        let digit = |divisor, modulo, stride| Digit {
            divisor,
            modulo,
            stride,
        };
        Digits([
            digit(1, r, 1),
            digit(r, a, q * b * r),
            digit(r * a, q, b * r),
            digit(r * a * q, b, r),
        ])
    }

    /// An operand of dims `operand` (each its result's size, or 1: broadcast) read for
    /// each column of a result of dims `out`: each run of dims the operand has is a
    /// digit. `None` for more runs than [`Digits::MAX`] or dims that do not broadcast.
    pub fn broadcast(operand: &[i64], out: &[i64]) -> Option<Self> {
        let mut digits = Vec::new();
        let (mut out_after, mut operand_after) = (1, 1);
        let mut run: Option<Digit> = None;
        for (&size, &out_size) in operand.iter().zip(out).rev() {
            if size == out_size {
                let digit = run.get_or_insert(Digit {
                    divisor: out_after,
                    modulo: 1,
                    stride: operand_after,
                });
                digit.modulo *= size;
                operand_after *= size;
            } else if size == 1 {
                digits.extend(run.take());
            } else {
                return None;
            }
            out_after *= out_size;
        }
        digits.extend(run);
        Digits::new(&digits)
    }
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
            digits: None,
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
    /// For the rows of a batch of these lengths repeated ([`Repeats`]), the row of the
    /// batch each copies.
    Repeated(Slot, Repeats),
    /// For the rows of a batch of these lengths, the row of its copy number `copy` in
    /// the batch repeated ([`Repeats`]).
    Copy(Slot, Repeats, i64),
    /// For the rows of a slice of the leading ragged dim of a batch of these lengths,
    /// the row of the batch each is.
    Sliced(Slot, SliceBounds),
    /// For the rows of a batch of these lengths, the row of its slice that each is, -1
    /// for a row outside the slice: a kernel reading through this map writes zeros
    /// for the rows it marks -1 ([`RowMap::skips`]).
    Unsliced(Slot, SliceBounds),
}

impl RowMap {
    /// Whether the map marks rows that have no row to read with -1; a pointwise kernel
    /// writes zeros for them.
    pub fn skips(self) -> bool {
        matches!(self, RowMap::Unsliced(..))
    }
}

/// How a batch is repeated: whole (`[e_0, e_1, e_0, e_1]`) or element by element
/// (`interleave`: `[e_0, e_0, e_1, e_1]`), `times` copies of each element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Repeats {
    /// Copies of every element.
    pub times: i64,
    /// Element by element rather than whole.
    pub interleave: bool,
}

impl Repeats {
    /// The element of a batch of `batch` elements that element `index` of the
    /// repeated batch copies.
    pub fn source(self, index: i64, batch: i64) -> i64 {
        match self.interleave {
            true => index / self.times.max(1),
            false => index % batch.max(1),
        }
    }

    /// The element of the repeated batch that is copy `copy` of element `element` (of a
    /// batch of `batch` elements).
    pub fn copy_of(self, element: i64, copy: i64, batch: i64) -> i64 {
        match self.interleave {
            true => element * self.times + copy,
            false => copy * batch + element,
        }
    }
}

/// A pointwise expression over the inputs of a kernel.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    /// Input number `n` at the current position.
    Load(usize),
    /// Input number `n`'s i64 value at the current position, as it is: a step whose
    /// whole expression this is moves positions or ids (nothing computes on them).
    Integers(usize),
    /// A constant.
    Const(F64),
    /// A unary function.
    Unary(UnaryOp, Box<Expr>),
    /// A binary function (predicates give 0 or 1).
    Binary(BinaryOp, Box<Expr>, Box<Expr>),
    /// `condition != 0 ? a : b`.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
}

impl Expr {
    /// This expression with each `Load(i)` replaced by `load(i)`.
    pub(crate) fn with_loads(self, load: &dyn Fn(usize) -> Expr) -> Expr {
        let boxed = |expr: Box<Expr>| Box::new(expr.with_loads(load));
        match self {
            Expr::Load(input) => load(input),
            Expr::Unary(op, x) => Expr::Unary(op, boxed(x)),
            Expr::Binary(op, a, b) => Expr::Binary(op, boxed(a), boxed(b)),
            Expr::Select(c, a, b) => Expr::Select(boxed(c), boxed(a), boxed(b)),
            Expr::Integers(_) | Expr::Const(_) => self,
        }
    }

    /// The transcendental functions the expression evaluates per element (exp, log,
    /// tanh, erf and the activations built on them): what makes a kernel compute-bound.
    pub fn transcendentals(&self) -> usize {
        match self {
            Expr::Load(_) | Expr::Integers(_) | Expr::Const(_) => 0,
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
                        | UnaryOp::Expm1
                        | UnaryOp::Log1p
                        | UnaryOp::Sin
                        | UnaryOp::Cos
                );
                usize::from(heavy) + x.transcendentals()
            }
            Expr::Binary(op, a, b) => {
                usize::from(matches!(op, BinaryOp::Pow | BinaryOp::Atan2))
                    + a.transcendentals()
                    + b.transcendentals()
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
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
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
    /// `log(sum(exp(x - m))) + m` over the row, `m` its largest value or 0 where that is
    /// infinite (libtorch's logsumexp; output width 1).
    LogSumExp,
    /// The cumulative sum (or `product`) along the row, from its last column back for
    /// `reverse` (output: the row's width; one thread a row).
    Scan {
        /// A product rather than a sum.
        product: bool,
        /// From the last column back.
        reverse: bool,
    },
    /// An order kernel along the row (one thread a row).
    Order(Order),
    /// The gradient of layer norm (`centered`) or RMS norm without its affine part
    /// (`nestor_ir::Op::NormGrad`): `x` the cotangent (times `weight` where there is
    /// one), `keys` the norm's input, whose mean and `rstd` each row recomputes.
    NormGrad {
        /// Layer norm rather than RMS norm.
        centered: bool,
        /// Which gradient.
        part: NormGradPart,
    },
}

/// Kernels that order the values along a line: a row's columns, or one column of an
/// element's rows. A line is one thread's; positions (i64) count from its first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Order {
    /// The position of the largest value (or smallest: not `largest`): its first, or
    /// its first NaN (one value a line; lines are not empty: checked before the run).
    Position {
        /// The largest rather than the smallest.
        largest: bool,
    },
    /// The line sorted (stable; NaN after every number, or first when `descending`),
    /// or (`positions`) the positions the sorted values come from: a position's rank
    /// among the line's is where its value goes.
    Sort {
        /// Largest first.
        descending: bool,
        /// The positions rather than the values.
        positions: bool,
    },
    /// A sort's gradient: each position takes `x` (the sorted values' gradient) at its
    /// rank among the step's keys (the sorted input).
    SortGrad {
        /// Largest first.
        descending: bool,
    },
    /// The line's `k` largest (or smallest) values in order, of equal values the first
    /// first, or (`positions`) their positions: `k` values a line (lines have at least
    /// `k` positions: checked before the run).
    TopK {
        /// How many values.
        k: i64,
        /// The largest rather than the smallest.
        largest: bool,
        /// The positions rather than the values.
        positions: bool,
    },
    /// The gradient of the line's top `k`: each position takes `x` (the values'
    /// gradient, `k` a line) at its rank among the step's keys when the rank is below
    /// `k`, else 0.
    TopKGrad {
        /// How many values.
        k: i64,
        /// The largest rather than the smallest.
        largest: bool,
    },
    /// The running largest (or smallest) value along the line, or (`positions`) the
    /// position it was last seen at, as torch's `cummax`.
    Running {
        /// The largest rather than the smallest.
        largest: bool,
        /// The positions rather than the values.
        positions: bool,
    },
    /// The gradient of the running largest (or smallest) value: each position's `x`
    /// (the values' gradient) summed where its running value was seen among the
    /// step's keys.
    RunningGrad {
        /// The largest rather than the smallest.
        largest: bool,
    },
    /// The line's `k`-th smallest value (one value a line; lines have at least `k`
    /// positions: checked before the run), or (`positions`) its position.
    Kth {
        /// Which smallest value, from 1.
        k: i64,
        /// The position rather than the value.
        positions: bool,
    },
    /// The gradient of a value picked from the line: `x` (one value a line) at the
    /// position `pick` chooses among the step's keys, zero elsewhere.
    PickGrad {
        /// Which value was picked.
        pick: Pick,
    },
}

impl Order {
    /// Whether the output holds positions (i64) rather than values.
    pub fn gives_positions(self) -> bool {
        match self {
            Order::Position { .. } => true,
            Order::Sort { positions, .. }
            | Order::TopK { positions, .. }
            | Order::Running { positions, .. }
            | Order::Kth { positions, .. } => positions,
            Order::SortGrad { .. }
            | Order::TopKGrad { .. }
            | Order::RunningGrad { .. }
            | Order::PickGrad { .. } => false,
        }
    }

    /// Whether the step orders by its keys (the input of the op it differentiates)
    /// and moves `x` (the gradient).
    pub fn is_gradient(self) -> bool {
        matches!(
            self,
            Order::SortGrad { .. }
                | Order::TopKGrad { .. }
                | Order::RunningGrad { .. }
                | Order::PickGrad { .. }
        )
    }

    /// How many values a line holds in the output of a forward op that keeps fewer
    /// than the line's (or in the `x` of its gradient): `k` of a top `k`, one of a
    /// picked value; `None` when as many as the line's.
    pub fn kept(self) -> Option<i64> {
        match self {
            Order::TopK { k, .. } | Order::TopKGrad { k, .. } => Some(k),
            Order::Position { .. } | Order::Kth { .. } | Order::PickGrad { .. } => Some(1),
            Order::Sort { .. }
            | Order::SortGrad { .. }
            | Order::Running { .. }
            | Order::RunningGrad { .. } => None,
        }
    }
}

/// Which one value of a row (or of an element's column) a kernel picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pick {
    /// The largest value (the smallest: not `largest`): its first, or the first NaN.
    Extreme {
        /// The largest rather than the smallest.
        largest: bool,
    },
    /// The `k`-th smallest (from 1) of a stable sort: of equal values, the first.
    Kth {
        /// Which smallest value, from 1.
        k: i64,
    },
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
    /// logsumexp over each element's rows, as [`RowKind::LogSumExp`] (-inf for an empty
    /// element).
    LogSumExp,
    /// softmax over each element's rows (output: same shape).
    Softmax,
    /// log-softmax over each element's rows.
    LogSoftmax,
    /// The cumulative sum down each element's rows (output: same shape).
    CumSum,
    /// The cumulative product down each element's rows.
    CumProd,
    /// The cumulative sum up each element's rows (each row and the rows after it).
    ReverseCumSum,
    /// The cumulative product up each element's rows.
    ReverseCumProd,
    /// An order kernel down each column of each element's rows.
    Order(Order),
}

impl SegmentKind {
    /// Whether each row of the output depends on the rows before (or, reversed, after)
    /// it only (a scan, run over the rows in order by one thread a column).
    pub fn is_scan(self) -> bool {
        matches!(
            self,
            SegmentKind::CumSum
                | SegmentKind::CumProd
                | SegmentKind::ReverseCumSum
                | SegmentKind::ReverseCumProd
        )
    }

    /// Whether the output holds positions (i64) rather than values.
    pub fn gives_positions(self) -> bool {
        matches!(self, SegmentKind::Order(order) if order.gives_positions())
    }

    /// Whether a GPU runs an element on one warp however long, each lane down its
    /// columns' rows (scans and order kernels: nothing a block combines).
    pub fn down_the_rows(self) -> bool {
        self.is_scan() || matches!(self, SegmentKind::Order(_))
    }
}

impl RowKind {
    /// Whether a GPU runs each row on one thread (its columns in order), not a warp.
    pub fn one_thread_a_row(self) -> bool {
        matches!(self, RowKind::Scan { .. } | RowKind::Order(_))
    }
}

/// What a [`crate::Step::Window`] computes over each output pixel's window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WindowKind {
    /// Convolution (in [`crate::step::Window::groups`]): the window's pixels times the
    /// weight, plus the bias.
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
    /// A convolution's gradient with respect to its input for any stride and padding,
    /// an input pixel a task: over the convolution's windows that read it (`window` is
    /// the convolution's, `heights` and `widths` its input's), the output's gradient
    /// (`x`, a row per window, `channels` = the convolution's output channels) times
    /// the weight `[channels, width, taps]` at the pixel's tap.
    StridedConvInputGrad,
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
    /// Adaptive average pooling of each image to `window.kernel` (`[oh, ow]`), as
    /// torch's: cell `(i, j)` the mean of the rows `floor(i H / oh)` to
    /// `ceil((i + 1) H / oh)` and the columns likewise; `out [B, channels, oh, ow]`, an
    /// image a row.
    Adaptive,
    /// Its gradient: every pixel of the images the sum of the cells of `x`
    /// (`[B, channels, oh, ow]`) whose windows hold it, each divided by its window's
    /// pixel count.
    AdaptiveGrad,
    /// Bilinear interpolation of each image to `window.kernel` (`[oh, ow]`), as torch's
    /// (corners aligned or not): cell `(i, j)` the four pixels around its source point,
    /// weighted by their nearness; `out [B, channels, oh, ow]`, an image a row.
    Bilinear {
        /// Whether the corner pixels of input and output align.
        align_corners: bool,
    },
    /// Its gradient: every pixel of the images the sum of the cells of `x` that read
    /// it, times the weight they read it with.
    BilinearGrad {
        /// Whether the corner pixels of input and output align.
        align_corners: bool,
    },
}

impl WindowKind {
    /// Whether the kind resamples each image to a fixed size (its output `[B, channels,
    /// oh, ow]`, `window.kernel` the size) or is such a resampling's gradient.
    pub fn resamples(self) -> bool {
        matches!(
            self,
            WindowKind::Adaptive
                | WindowKind::AdaptiveGrad
                | WindowKind::Bilinear { .. }
                | WindowKind::BilinearGrad { .. }
        )
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
