//! Kernel programs: the target-independent description of what runs. Every buffer is a
//! [`Slot`] of `rows x width` scalars, where `rows` is computed from lengths at run
//! time, so one program serves every batch of its structure.

use nestor_ir::{BinaryOp, DType, UnaryOp, F64};

use crate::step::Step;

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
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    /// Input number `n` at the current position.
    Load(usize),
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
