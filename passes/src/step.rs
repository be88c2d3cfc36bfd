//! The steps of a program: [`Step`] holds one payload struct per kind, each with its
//! buffers and attributes; [`crate::signature`] declares each kind's kernel arguments.

use nestor_ir::{BinaryOp, Window2d, F64};

use crate::operands::{
    Access, Expr, Fusion, RowBase, RowKind, RowMap, Rows, SegmentKind, Slot, WindowKind,
};

/// One step of a program: each kind a payload struct of its own (its fields, its
/// kernel signature in [`crate::signature`]).
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Step {
    /// `out[r, c] = expr(inputs at (r, c))` for every row and column.
    Pointwise(Pointwise),
    /// `out = x W^T + b` (or `x W` with `transposed`): one GEMM over all rows.
    Gemm(Gemm),
    /// A row kernel (norms, softmax, row reductions).
    Row(Row),
    /// A segmented kernel over the rows of each element.
    Segment(Segment),
    /// Varlen attention on packed heads: each element's queries attend to its keys.
    Attention(Attention),
    /// The jagged-pair matmul, one GEMM per element on the host: scores
    /// `out [sum M_i N_i] = a [sum M_i, width] b^T` with `b [sum N_i, width]`, or (`mix`)
    /// `out [sum M_i, width] = a [sum M_i N_i] b` with `b [sum N_i, width]`.
    PairGemm(PairGemm),
    /// A sliding window over packed images `[C, H_i, W_i]` (rows are pixels), on the
    /// host: a direct convolution over the packed pixels (taps outside an image read
    /// zeros; no gathered copy), max or average pooling over the windows, each image's
    /// mean, and their gradients.
    Window(Window),
    /// A graph the host runs (through libtorch) inside the program: an explicit
    /// per-element region. `inputs` are the slots of the host graph's inputs, in order
    /// (lengths slots for its `lengths` inputs).
    Host(Host),
    /// The padded grid of a batch with one leading ragged dim: row `(b, t)` of `out`
    /// (`B x max(L)` rows) is row `offsets[b] + t` of `x` for `t < L_b`, else `value`.
    Pad(Pad),
    /// The packed rows of a padded grid: row `offsets[b] + t` of `out` is row
    /// `b * max(grid lengths) + t` of `x`, for `t < L_b` (the inverse of [`Step::Pad`]).
    Unpad(Unpad),
    /// `out[m x n] = sum over rows r of a[r]^T b[r]` (`a` absent: ones, `m` = 1: the
    /// column sums of `b`), divided by the number of rows when `mean` (NaN for none):
    /// weight gradients and reductions over every row.
    SumRows(SumRows),
    /// `out[r, c] = 1` where `c == ids[r]`, else 0 (a row of zeros for `ignore`; other
    /// ids outside `0..classes` are bad input, checked before the step runs).
    OneHot(OneHot),
    /// `out[v] = sum of g[r] over rows r with ids[r] == v`, zero for `padding` and ids
    /// outside the table.
    ScatterRows(ScatterRows),
    /// `out` viewed as `[rows, size, inner]` is zero but for `out[:, index, :] = x`
    /// (`x` viewed as `[rows, inner]`).
    Insert(Insert),
    /// The gradient of varlen attention ([`AttentionPart`]): of the queries, of the
    /// keys and values stacked per row (`[Lk, 2, heads, head_dim]`), or the softmax
    /// statistics of every query row that the other two read.
    AttentionGrad(AttentionGrad),
    /// A dropout mask: every value `1 / (1 - p)` with probability `1 - p`, else 0, from
    /// a counter-based generator keyed by `stream`, the position and the run.
    RandomMask(RandomMask),
    /// `out[b] = lengths[b]` as numbers.
    LengthValues(LengthValues),
    /// `out[r]` = row `r`'s position within its element of `lengths` (i64).
    Positions(Positions),
    /// `out[r] = table[ids[r]]`.
    Gather(Gather),
}

/// `out[r, c] = expr(inputs at (r, c))` for every row and column.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pointwise {
    /// Output slot.
    pub out: Slot,
    /// Output rows.
    pub rows: Rows,
    /// Output width.
    pub width: i64,
    /// Inputs, read as their accesses say.
    pub inputs: Vec<Access>,
    /// The expression.
    pub expr: Expr,
}

/// `out = x W^T + b` (or `x W` with `transposed`): one GEMM over all rows.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gemm {
    /// Output slot `[rows, n]`.
    pub out: Slot,
    /// Input `[rows, k]`.
    pub x: Slot,
    /// Weight `[n, k]` (or `[k, n]` when `transposed`).
    pub weight: Slot,
    /// Bias `[n]`.
    pub bias: Option<Slot>,
    /// Rows.
    pub rows: Rows,
    /// Inner size.
    pub k: i64,
    /// Output width.
    pub n: i64,
    /// The weight is `[k, n]`.
    pub transposed: bool,
    /// Computed on each chunk of output rows right after the GEMM writes it, in
    /// place (one of its inputs is `out` itself, read where it is written).
    pub epilogue: Option<Fusion>,
}

/// A row kernel (norms, softmax, row reductions).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Row {
    /// Which.
    pub kind: RowKind,
    /// Output slot.
    pub out: Slot,
    /// The input rows: a buffer as it is, or a fused pointwise prologue.
    pub x: Fusion,
    /// Scale `[width]`.
    pub weight: Option<Slot>,
    /// Shift `[width]`.
    pub bias: Option<Slot>,
    /// Rows.
    pub rows: Rows,
    /// Scalars per row.
    pub width: i64,
    /// Epsilon of the norms.
    pub eps: F64,
    /// The values that order each row when they are not `x` (the gradients of a sort
    /// and of max / min read the sorted or reduced input, and move `x`).
    pub keys: Option<Slot>,
}

/// A segmented kernel over the rows of each element.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    /// Which.
    pub kind: SegmentKind,
    /// Output slot.
    pub out: Slot,
    /// The input rows `[sum L, width]`: a buffer as it is, or a fused pointwise
    /// prologue.
    pub x: Fusion,
    /// The lengths that split the rows.
    pub lengths: Slot,
    /// Scalars per row.
    pub width: i64,
    /// The values that order each element's rows when they are not `x` (a sort's
    /// gradient ranks the sorted input and moves `x`, the values' gradient).
    pub keys: Option<Slot>,
}

/// Varlen attention on packed heads: each element's queries attend to its keys.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attention {
    /// Output `[sum Lq, heads * value_dim]`.
    pub out: Slot,
    /// Queries `[sum Lq, heads * head_dim]`, read with `q_access`.
    pub q: Access,
    /// Keys `[sum Lk, heads * head_dim]`.
    pub k: Access,
    /// Values `[sum Lk, heads * value_dim]`.
    pub v: Access,
    /// Query lengths.
    pub q_lengths: Slot,
    /// Key lengths.
    pub k_lengths: Slot,
    /// Heads.
    pub heads: i64,
    /// Query/key width per head.
    pub head_dim: i64,
    /// Value width per head.
    pub value_dim: i64,
    /// Mask future keys.
    pub causal: bool,
    /// Score scale.
    pub scale: F64,
}

/// The jagged-pair matmul, one GEMM per element on the host: scores
/// `out [sum M_i N_i] = a [sum M_i, width] b^T` with `b [sum N_i, width]`, or (`mix`)
/// `out [sum M_i, width] = a [sum M_i N_i] b` with `b [sum N_i, width]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PairGemm {
    /// Output.
    pub out: Slot,
    /// Left elements.
    pub a: Slot,
    /// Right elements.
    pub b: Slot,
    /// Lengths of the rows `M`.
    pub rows: Slot,
    /// Lengths of the other ragged dim `N`.
    pub columns: Slot,
    /// The inner size (scores) or the output width (mix).
    pub width: i64,
    /// `p @ v` rather than `q @ k^T`.
    pub mix: bool,
    /// Instead of the scores `q @ k^T`, the `p`-norm distances of the rows of `a` and
    /// `b` (`cdist`; kernels only).
    pub distance: Option<F64>,
}

/// A sliding window over packed images `[C, H_i, W_i]` (rows are pixels), on the
/// host: a direct convolution over the packed pixels (taps outside an image read
/// zeros; no gathered copy), max or average pooling over the windows, each image's
/// mean, and their gradients.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Window {
    /// What is computed over each window.
    pub kind: WindowKind,
    /// Output pixels `[sum H_out W_out, width]` (one row per image for
    /// [`WindowKind::ImageMean`]).
    pub out: Slot,
    /// Input pixels `[sum H W, channels]`.
    pub x: Slot,
    /// `[width, channels, K_h, K_w]` (convolution).
    pub weight: Option<Slot>,
    /// `[width]` (convolution).
    pub bias: Option<Slot>,
    /// The gradient of the convolution's output `[sum H_out W_out, width]`
    /// ([`WindowKind::WeightGrad`]).
    pub grad: Option<Slot>,
    /// The images' heights.
    pub heights: Slot,
    /// The images' widths.
    pub widths: Slot,
    /// Input channels.
    pub channels: i64,
    /// Output channels.
    pub width: i64,
    /// The window's geometry.
    pub window: Window2d,
    /// A convolution's groups (1 for the other kinds): each output channel reads the
    /// input channels of its group, through a weight `[C_out, C_in / groups, K_h, K_w]`.
    pub groups: i64,
    /// A convolution's (or its input gradient's) epilogue, as a GEMM's: computed on each
    /// block of output pixels right after the convolution writes it, in place.
    pub epilogue: Option<Fusion>,
}

/// A graph the host runs (through libtorch) inside the program: an explicit
/// per-element region. `inputs` are the slots of the host graph's inputs, in order
/// (lengths slots for its `lengths` inputs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Host {
    /// Output slot.
    pub out: Slot,
    /// The slots of the host graph's inputs.
    pub inputs: Vec<Slot>,
    /// Index into [`crate::Program::host_graphs`].
    pub graph: usize,
}

/// The padded grid of a batch with one leading ragged dim: row `(b, t)` of `out`
/// (`B x max(L)` rows) is row `offsets[b] + t` of `x` for `t < L_b`, else `value`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Pad {
    /// Output slot `[B * max(L), width]`.
    pub out: Slot,
    /// Packed rows `[sum L, width]`.
    pub x: Slot,
    /// The lengths of the ragged dim.
    pub lengths: Slot,
    /// Scalars per row.
    pub width: i64,
    /// The padding value.
    pub value: F64,
}

/// The packed rows of a padded grid: row `offsets[b] + t` of `out` is row
/// `b * max(grid lengths) + t` of `x`, for `t < L_b` (the inverse of [`Step::Pad`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Unpad {
    /// Output slot `[sum L, width]`.
    pub out: Slot,
    /// The padded grid `[B * max(grid lengths), width]`.
    pub x: Slot,
    /// The lengths the grid was padded for (its row stride is their longest).
    pub grid: Slot,
    /// The lengths of the result.
    pub lengths: Slot,
    /// Scalars per row.
    pub width: i64,
}

/// `out[m x n] = sum over rows r of a[r]^T b[r]` (`a` absent: ones, `m` = 1: the
/// column sums of `b`, or with `times` those of `b * times` element for element),
/// divided by the number of rows when `mean` (NaN for none): weight gradients and
/// reductions over every row.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SumRows {
    /// Output slot `[m, n]`.
    pub out: Slot,
    /// `[rows, m]`, or ones.
    pub a: Option<Slot>,
    /// `[rows, n]`.
    pub b: Slot,
    /// `[rows, n]`, multiplied into `b` value for value before the sum (`a` absent):
    /// a norm's gradient's `sum g * xhat` in one pass (`crate::sums`).
    pub times: Option<Slot>,
    /// `[1, n]`, the column sums of `b` alone, made in the same pass as those of `b *
    /// times` (`times` present, not `mean`): a norm's gradient's `sum g` beside its
    /// `sum g * xhat`, one read of `g` (`crate::sums`).
    pub plain: Option<Slot>,
    /// Rows.
    pub rows: Rows,
    /// Width of `a`.
    pub m: i64,
    /// Width of `b`.
    pub n: i64,
    /// Divide by the number of rows.
    pub mean: bool,
}

/// `out[r, c] = 1` where `c == ids[r]`, else 0 (a row of zeros for `ignore`; other
/// ids outside `0..classes` are bad input, checked before the step runs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OneHot {
    /// Output slot `[rows, classes]`.
    pub out: Slot,
    /// Ids (i64) `[rows]`.
    pub ids: Slot,
    /// Rows.
    pub rows: Rows,
    /// Row width.
    pub classes: i64,
    /// The id whose row stays zero.
    pub ignore: i64,
}

/// `out[v] = sum of g[r] over rows r with ids[r] == v`, zero for `padding` and ids
/// outside the table.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ScatterRows {
    /// Output slot `[vocabulary, width]`.
    pub out: Slot,
    /// Rows `[rows, width]`.
    pub g: Slot,
    /// Ids (i64) `[rows]`.
    pub ids: Slot,
    /// Rows.
    pub rows: Rows,
    /// Row width.
    pub width: i64,
    /// Table rows.
    pub vocabulary: i64,
    /// The id that gets nothing.
    pub padding: i64,
}

/// `out` viewed as `[rows, size, inner]` is zero but for `out[:, index, :] = x`
/// (`x` viewed as `[rows, inner]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Insert {
    /// Output slot.
    pub out: Slot,
    /// Input slot.
    pub x: Slot,
    /// Rows (the packed rows times the dims before the inserted one).
    pub rows: Rows,
    /// The inserted dim's size.
    pub size: i64,
    /// Where `x` goes.
    pub index: i64,
    /// How many positions of the dim `x` fills (1: a new dim).
    pub count: i64,
    /// Scalars after the inserted dim.
    pub inner: i64,
}

/// A part of the gradient of varlen attention ([`AttentionPart`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct AttentionGrad {
    /// Output slot.
    pub out: Slot,
    /// Queries `[sum Lq, heads, head_dim]`.
    pub q: Access,
    /// Keys `[sum Lk, heads, head_dim]`.
    pub k: Access,
    /// Values `[sum Lk, heads, head_dim]`.
    pub v: Access,
    /// The output's cotangent `[sum Lq, heads, head_dim]`.
    pub g: Access,
    /// Query lengths.
    pub q_lengths: Slot,
    /// Key lengths.
    pub k_lengths: Slot,
    /// Heads.
    pub heads: i64,
    /// Width per head (queries, keys and values alike).
    pub head_dim: i64,
    /// Mask future keys.
    pub causal: bool,
    /// Score scale.
    pub scale: F64,
    /// Which part.
    pub part: AttentionPart,
    /// The statistics of the query rows (an [`AttentionPart::Statistics`] step's
    /// output), which the gradients' GPU kernels read instead of computing them again
    /// for every key (the CPU's tiles compute their own).
    pub statistics: Option<Slot>,
    /// Where [`AttentionPart::Both`] writes the keys' and values' gradients (the
    /// queries' go to `out`); `None` for the other parts.
    pub keys_values_out: Option<Slot>,
}

/// What an [`AttentionGrad`] step computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionPart {
    /// The queries' gradient `[Lq, heads, head_dim]`.
    Queries,
    /// The keys' and values' gradients stacked per row, `[Lk, 2, heads, head_dim]`.
    KeysValues,
    /// Self-attention's three gradients stacked per row, `[L, 3, heads, head_dim]`
    /// (queries, keys, values; the CPU's own code only, with no kernel: see
    /// `LowerOptions::attention_gradients_at_once`).
    All,
    /// Cross-attention's gradients at once: the queries' `[Lq, heads, head_dim]` in
    /// `out`, the keys' and values' stacked per row, `[Lk, 2, heads, head_dim]`, in
    /// `keys_values_out` (the CPU's own code only, as [`AttentionPart::All`]).
    Both,
    /// For every query row and head, its largest visible score, its sum of
    /// exponentials and `rowsum(P dP)`, in the program's float type whatever the
    /// storage: [`AttentionPart::STATISTICS_WIDTH`] values of the storage a head hold
    /// the three (`[Lq, heads, 6]`: bf16 buffers' six halves are three f32).
    Statistics,
}

impl AttentionPart {
    /// Values of a statistics slot per query row and head.
    pub const STATISTICS_WIDTH: i64 = 6;
}

/// A dropout mask: every value `1 / (1 - p)` with probability `1 - p`, else 0, from
/// a counter-based generator keyed by `stream`, the position and the run.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RandomMask {
    /// Output slot.
    pub out: Slot,
    /// Rows.
    pub rows: Rows,
    /// Scalars per row.
    pub width: i64,
    /// Drop probability.
    pub p: F64,
    /// Which mask of the program.
    pub stream: i64,
}

/// `out[b] = lengths[b]` as numbers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LengthValues {
    /// Output slot `[B]`.
    pub out: Slot,
    /// The lengths.
    pub lengths: Slot,
}

/// `out[r]` = row `r`'s position within its element of `lengths` (i64).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Positions {
    /// Output slot `[sum L]` of i64 values.
    pub out: Slot,
    /// The lengths.
    pub lengths: Slot,
}

/// `out[r] = table[ids[r]]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Gather {
    /// Output slot `[rows, width]`.
    pub out: Slot,
    /// Table `[vocabulary, width]`.
    pub table: Slot,
    /// Ids (i64) `[rows]`.
    pub ids: Slot,
    /// Rows.
    pub rows: Rows,
    /// Table width.
    pub width: i64,
}

/// What every step kind says about its buffers (`crate::signature::Placed` says where it
/// runs and with which kernel arguments).
pub trait StepKind: std::fmt::Debug {
    /// The slot the step writes (its first, where it writes more).
    fn output(&self) -> Slot;
    /// The second slot the step writes, for the kinds that write two (an
    /// [`AttentionPart::Both`] gradient, column sums with their [`SumRows::plain`]).
    fn second_output(&self) -> Option<Slot> {
        None
    }
    /// The slots the step reads (lengths slots excepted).
    fn reads(&self) -> Vec<Slot>;
    /// Calls `visit` on every slot the step names: its output, its inputs, its lengths,
    /// those of its row maps and row counts.
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot));
}

/// Implements [`Step`]'s dispatch to its payloads: `kind`, `kind_mut`, `Debug` (the
/// payload's, so listings read `Gemm { .. }`) and `From` each payload.
macro_rules! step_kinds {
    ($($kind:ident),* $(,)?) => {
        impl Step {
            /// The payload, as every kind's trait.
            pub fn kind(&self) -> &dyn StepKind {
                match self {
                    $(Step::$kind(payload) => payload,)*
                }
            }

            /// The payload, as every kind's trait, to change.
            pub fn kind_mut(&mut self) -> &mut dyn StepKind {
                match self {
                    $(Step::$kind(payload) => payload,)*
                }
            }

            /// The kind's name (`"Gemm"`).
            pub fn name(&self) -> &'static str {
                match self {
                    $(Step::$kind(_) => stringify!($kind),)*
                }
            }
        }

        impl std::fmt::Debug for Step {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.kind().fmt(f)
            }
        }

        $(impl From<$kind> for Step {
            fn from(payload: $kind) -> Self {
                Step::$kind(payload)
            }
        })*
    };
}

/// Calls macro `$callback` with the name of every step kind (each a variant of [`Step`]
/// and its payload struct): the one list of them.
macro_rules! with_step_kinds {
    ($callback:ident) => {
        $callback!(
            Pointwise,
            Gemm,
            Row,
            Segment,
            Attention,
            PairGemm,
            Window,
            Host,
            Pad,
            Unpad,
            SumRows,
            OneHot,
            ScatterRows,
            Insert,
            AttentionGrad,
            RandomMask,
            LengthValues,
            Positions,
            Gather,
        );
    };
}
pub(crate) use with_step_kinds;

with_step_kinds!(step_kinds);

impl Step {
    /// The slots the step reads (lengths slots excepted).
    pub fn reads(&self) -> Vec<Slot> {
        self.kind().reads()
    }

    /// The slot the step writes (its first, where it writes more).
    pub fn output(&self) -> Slot {
        self.kind().output()
    }

    /// Every slot the step writes: its output, then its [`StepKind::second_output`].
    pub fn outputs(&self) -> impl Iterator<Item = Slot> {
        let kind = self.kind();
        std::iter::once(kind.output()).chain(kind.second_output())
    }

    /// The transcendental functions the step evaluates per output value (its
    /// expression's, a softmax's two exponentials): what makes it compute-bound.
    pub fn transcendentals(&self) -> usize {
        match self {
            Step::Pointwise(pointwise) => pointwise.expr.transcendentals(),
            Step::Row(row) => {
                let exponentials = match row.kind {
                    RowKind::Softmax | RowKind::LogSoftmax | RowKind::LogSumExp => 2,
                    _ => 0,
                };
                exponentials + row.x.expr.transcendentals()
            }
            _ => 0,
        }
    }
}

/// The slots of `accesses`, in order.
fn slots_of(accesses: &[Access]) -> impl Iterator<Item = Slot> + '_ {
    accesses.iter().map(|access| access.slot)
}

fn visit_access(access: &mut Access, visit: &mut dyn FnMut(&mut Slot)) {
    visit(&mut access.slot);
    if let Some(map) = &mut access.row_map {
        match map {
            RowMap::Owners(lengths)
            | RowMap::Repeated(lengths, _)
            | RowMap::Copy(lengths, ..)
            | RowMap::Sliced(lengths, _)
            | RowMap::Unsliced(lengths, _) => visit(lengths),
            RowMap::PairRows(rows, columns)
            | RowMap::PairColumns(rows, columns)
            | RowMap::PairTransposed(rows, columns) => {
                visit(rows);
                visit(columns);
            }
        }
    }
}

fn visit_accesses(accesses: &mut [Access], visit: &mut dyn FnMut(&mut Slot)) {
    for access in accesses {
        visit_access(access, visit);
    }
}

fn visit_rows(rows: &mut Rows, visit: &mut dyn FnMut(&mut Slot)) {
    match &mut rows.base {
        RowBase::One => {}
        RowBase::Total(lengths) | RowBase::Batch(lengths) | RowBase::Padded(lengths) => {
            visit(lengths)
        }
        RowBase::Volume(first, second) => {
            visit(first);
            visit(second);
        }
    }
}

fn visit_optional(slot: &mut Option<Slot>, visit: &mut dyn FnMut(&mut Slot)) {
    if let Some(slot) = slot {
        visit(slot);
    }
}

/// The slots an epilogue reads but its step's own output (read in place).
fn epilogue_reads(epilogue: &Option<Fusion>, out: Slot) -> impl Iterator<Item = Slot> + '_ {
    epilogue
        .iter()
        .flat_map(|fusion| slots_of(&fusion.inputs))
        .filter(move |slot| *slot != out)
}

impl StepKind for Pointwise {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        slots_of(&self.inputs).collect()
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        visit_rows(&mut self.rows, visit);
        visit_accesses(&mut self.inputs, visit);
    }
}

impl StepKind for Gemm {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        [self.x, self.weight]
            .into_iter()
            .chain(self.bias)
            .chain(epilogue_reads(&self.epilogue, self.out))
            .collect()
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        for slot in [&mut self.out, &mut self.x, &mut self.weight] {
            visit(slot);
        }
        visit_optional(&mut self.bias, visit);
        visit_rows(&mut self.rows, visit);
        if let Some(epilogue) = &mut self.epilogue {
            visit_accesses(&mut epilogue.inputs, visit);
        }
    }
}

impl StepKind for Row {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        slots_of(&self.x.inputs)
            .chain(self.weight)
            .chain(self.bias)
            .chain(self.keys)
            .collect()
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        visit_accesses(&mut self.x.inputs, visit);
        visit_optional(&mut self.weight, visit);
        visit_optional(&mut self.bias, visit);
        visit_optional(&mut self.keys, visit);
        visit_rows(&mut self.rows, visit);
    }
}

impl StepKind for Segment {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        slots_of(&self.x.inputs).chain(self.keys).collect()
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        visit_accesses(&mut self.x.inputs, visit);
        visit(&mut self.lengths);
        if let Some(keys) = &mut self.keys {
            visit(keys);
        }
    }
}

impl StepKind for Attention {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        vec![self.q.slot, self.k.slot, self.v.slot]
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        for access in [&mut self.q, &mut self.k, &mut self.v] {
            visit_access(access, visit);
        }
        visit(&mut self.q_lengths);
        visit(&mut self.k_lengths);
    }
}

impl StepKind for PairGemm {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        vec![self.a, self.b]
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        for slot in [
            &mut self.out,
            &mut self.a,
            &mut self.b,
            &mut self.rows,
            &mut self.columns,
        ] {
            visit(slot);
        }
    }
}

impl StepKind for Window {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        [Some(self.x), self.weight, self.bias, self.grad]
            .into_iter()
            .flatten()
            .chain(epilogue_reads(&self.epilogue, self.out))
            .collect()
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        visit(&mut self.x);
        for slot in [&mut self.weight, &mut self.bias, &mut self.grad] {
            visit_optional(slot, visit);
        }
        visit(&mut self.heights);
        visit(&mut self.widths);
        if let Some(epilogue) = &mut self.epilogue {
            visit_accesses(&mut epilogue.inputs, visit);
        }
    }
}

impl StepKind for Host {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        self.inputs.clone()
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        self.inputs.iter_mut().for_each(visit);
    }
}

impl StepKind for Pad {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        vec![self.x]
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        for slot in [&mut self.out, &mut self.x, &mut self.lengths] {
            visit(slot);
        }
    }
}

impl StepKind for Unpad {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        vec![self.x]
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        for slot in [
            &mut self.out,
            &mut self.x,
            &mut self.grid,
            &mut self.lengths,
        ] {
            visit(slot);
        }
    }
}

impl Pointwise {
    /// The inputs `(a, b)` of a product of two loads, `Load(a) * Load(b)` over two
    /// inputs (`a != b`), if the step is one.
    pub fn product_of_loads(&self) -> Option<(usize, usize)> {
        match (&self.expr, &self.inputs[..]) {
            (Expr::Binary(BinaryOp::Mul, lhs, rhs), [_, _]) => match (&**lhs, &**rhs) {
                (Expr::Load(a), Expr::Load(b)) if a != b => Some((*a, *b)),
                _ => None,
            },
            _ => None,
        }
    }
}

impl StepKind for SumRows {
    fn output(&self) -> Slot {
        self.out
    }
    fn second_output(&self) -> Option<Slot> {
        self.plain
    }
    fn reads(&self) -> Vec<Slot> {
        self.a
            .into_iter()
            .chain([self.b])
            .chain(self.times)
            .collect()
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        visit_optional(&mut self.a, visit);
        visit(&mut self.b);
        visit_optional(&mut self.times, visit);
        visit_optional(&mut self.plain, visit);
        visit_rows(&mut self.rows, visit);
    }
}

impl StepKind for OneHot {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        vec![self.ids]
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        visit(&mut self.ids);
        visit_rows(&mut self.rows, visit);
    }
}

impl StepKind for ScatterRows {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        vec![self.g, self.ids]
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        for slot in [&mut self.out, &mut self.g, &mut self.ids] {
            visit(slot);
        }
        visit_rows(&mut self.rows, visit);
    }
}

impl StepKind for Insert {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        vec![self.x]
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        visit(&mut self.x);
        visit_rows(&mut self.rows, visit);
    }
}

impl StepKind for AttentionGrad {
    fn output(&self) -> Slot {
        self.out
    }
    fn second_output(&self) -> Option<Slot> {
        self.keys_values_out
    }
    fn reads(&self) -> Vec<Slot> {
        let mut reads = vec![self.q.slot, self.k.slot, self.v.slot, self.g.slot];
        reads.extend(self.statistics);
        reads
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        if let Some(keys_values) = &mut self.keys_values_out {
            visit(keys_values);
        }
        for access in [&mut self.q, &mut self.k, &mut self.v, &mut self.g] {
            visit_access(access, visit);
        }
        visit(&mut self.q_lengths);
        visit(&mut self.k_lengths);
        if let Some(statistics) = &mut self.statistics {
            visit(statistics);
        }
    }
}

impl StepKind for RandomMask {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        Vec::new()
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        visit(&mut self.out);
        visit_rows(&mut self.rows, visit);
    }
}

/// [`StepKind`] of steps that write `out` from `lengths` alone (no data slot read).
macro_rules! from_lengths {
    ($($kind:ident),*) => {
        $(impl StepKind for $kind {
            fn output(&self) -> Slot {
                self.out
            }
            fn reads(&self) -> Vec<Slot> {
                Vec::new()
            }
            fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
                visit(&mut self.out);
                visit(&mut self.lengths);
            }
        })*
    };
}

from_lengths!(LengthValues, Positions);

impl StepKind for Gather {
    fn output(&self) -> Slot {
        self.out
    }
    fn reads(&self) -> Vec<Slot> {
        vec![self.table, self.ids]
    }
    fn visit_slots(&mut self, visit: &mut dyn FnMut(&mut Slot)) {
        for slot in [&mut self.out, &mut self.table, &mut self.ids] {
            visit(slot);
        }
        visit_rows(&mut self.rows, visit);
    }
}
