//! The typed step ABI: for every step kind, where it runs on a backend
//! ([`Placement`]) and, when that is a generated kernel, the kernel's arguments in
//! order ([`Signature`]). Codegen builds each kernel from its signature (a template asks
//! for its arguments by [`Role`], never by position) and every executor writes a
//! kernel's argument table from the same signature, so the two cannot disagree.
//!
//! Every kernel takes `(ptr args, i64 start, i64 end)`: `args` is the table of
//! [`Signature::params`], `start..end` a part of [`Signature::range`].

use nestor_ir::Window2d;

use crate::operands::{Access, RowMap, Rows, Slot, WindowKind};
use crate::program::Program;
use crate::step::{
    Attention, AttentionGrad, AttentionPart, Gather, Gemm, Host, Insert, LengthValues, OneHot, Pad,
    PairGemm, Pointwise, Positions, RandomMask, Row, ScatterRows, Segment, Step, SumRows, Unpad,
    Window,
};

/// Which steps a backend runs as generated kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelSet {
    /// The CPU's: GEMMs run on a GEMM library with their epilogue as a kernel of its
    /// own; attention, the padding copies, window and training steps run on the CPU
    /// backend's own code (a convolution's epilogue a kernel of its own).
    Library,
    /// A GPU's without a BLAS: every step but host steps is a kernel (a GEMM and its
    /// epilogue one kernel).
    Complete,
    /// A GPU's with a BLAS: `Complete`, but a GEMM's product is the BLAS's, written to
    /// its output first, and its kernel only adds the bias and applies the epilogue in
    /// place (no kernel when it has neither); row sums of products `a^T b` (weight
    /// gradients) are the BLAS's alone.
    DeviceBlas,
}

/// Where a step runs on a backend of a [`KernelSet`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// A generated kernel with this signature.
    Kernel(Signature),
    /// The backend's GEMM (a library on the CPU, the BLAS on a GPU) or the CPU's own
    /// convolution computes the product, then the kernel of this signature, when there
    /// is one, finishes the output in place (bias, epilogue).
    Product(Option<Signature>),
    /// Code of the backend's own (the CPU's attention, copies, window and training
    /// steps).
    Backend,
    /// A graph run through libtorch on the host (a per-element region).
    Libtorch,
}

impl Placement {
    /// The signature of the step's kernel, if one runs.
    pub fn kernel(&self) -> Option<&Signature> {
        match self {
            Placement::Kernel(signature) | Placement::Product(Some(signature)) => Some(signature),
            _ => None,
        }
    }
}

/// A kernel's arguments, in the order of its argument table, and the range of tasks a
/// launch covers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Signature {
    /// The arguments.
    pub params: Vec<Param>,
    /// The tasks of a whole launch (rows, elements, output values, ...).
    pub range: Rows,
}

/// One argument of a kernel: what the template reads it as, and what the executor
/// puts there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Param {
    /// What the kernel does with it.
    pub role: Role,
    /// What it is.
    pub arg: Arg,
}

/// What a kernel does with one of its arguments; templates ask for their arguments by
/// role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The buffer the kernel writes.
    Out,
    /// Input `n` of a fused expression (pointwise, a prologue, an epilogue).
    Input(u32),
    /// The row map input `n` reads its rows through.
    InputRows(u32),
    /// The main input.
    X,
    /// A weight (a GEMM's, a norm's scale, a convolution's).
    Weight,
    /// A bias or shift.
    Bias,
    /// A gathered table.
    Table,
    /// Ids (i64).
    Ids,
    /// Attention's queries.
    Queries,
    /// Attention's keys; the values that order a sort's rows.
    Keys,
    /// Attention's values.
    Values,
    /// A gradient read (an output's cotangent).
    Gradient,
    /// Softmax statistics of attention's query rows (written once, read by its
    /// gradients).
    Statistics,
    /// The left operand of a product.
    A,
    /// The right operand of a product.
    B,
    /// Values multiplied into another operand's, value for value.
    Times,
    /// A second buffer the kernel writes: the column sums of `b` alone beside those of
    /// `b` times `times` (`SumRows::plain`).
    Plain,
    /// Lengths (i64) read as numbers.
    Lengths,
    /// Offsets of the step's main lengths (segments, queries, rows), `B + 1` values.
    Offsets,
    /// Offsets of the keys' lengths.
    KeyOffsets,
    /// Offsets of a pair layout's column lengths.
    ColumnOffsets,
    /// Where each element's pairs (or pixels) start: the sums of `M_i N_i`.
    PairOffsets,
    /// `[longest length]`.
    Longest,
    /// The element of each row of the range.
    RowOwners,
    /// `[count]`: a number of rows.
    Count,
    /// `[key]`: a random mask's key for this run.
    MaskKey,
    /// The rows of each id (positions, then rows).
    RowsOfIds,
    /// The input pixel of every tap of every window.
    Taps,
    /// The windows that read each input pixel (positions, then windows).
    WindowsOfPixels,
}

/// What an executor puts in one entry of a kernel's argument table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    /// A slot's buffer.
    Buffer(Slot),
    /// A null pointer: an optional buffer the step does not have.
    Absent,
    /// The offsets of a lengths slot (`B + 1` i64).
    Offsets(Slot),
    /// A row map (i64 per row).
    RowMap(RowMap),
    /// `[longest length]` of a lengths slot (i64).
    Longest(Slot),
    /// The pair offsets of row lengths `.0` and column lengths `.1` (`B + 1` i64).
    PairOffsets(Slot, Slot),
    /// `[the run's count of these rows]` (i64).
    Count(Rows),
    /// `[the run's key of the mask stream .0]` (i64).
    MaskKey(i64),
    /// The taps of a window over images of heights `.1` and widths `.2` (i64).
    Taps(Window2d, Slot, Slot),
    /// The windows that read each pixel of the same images (i64).
    WindowsOfPixels(Window2d, Slot, Slot),
    /// The rows of each id `0..vocabulary .1` among the ids input `.0` (i64).
    RowsOfIds(Slot, i64),
}

impl Role {
    /// Whether an argument of this role may be `arg`: float buffers (or absent ones),
    /// id and lengths buffers, and each index of its own kind.
    pub fn accepts(self, arg: &Arg) -> bool {
        match self {
            Role::Out
            | Role::Input(_)
            | Role::X
            | Role::Weight
            | Role::Bias
            | Role::Table
            | Role::Queries
            | Role::Keys
            | Role::Values
            | Role::Gradient
            | Role::Statistics
            | Role::A
            | Role::B
            | Role::Times
            | Role::Plain => matches!(arg, Arg::Buffer(_) | Arg::Absent),
            Role::Ids | Role::Lengths => matches!(arg, Arg::Buffer(_)),
            Role::Offsets | Role::KeyOffsets | Role::ColumnOffsets => {
                matches!(arg, Arg::Offsets(_))
            }
            Role::InputRows(_) | Role::RowOwners => matches!(arg, Arg::RowMap(_)),
            Role::PairOffsets => matches!(arg, Arg::PairOffsets(..)),
            Role::Longest => matches!(arg, Arg::Longest(_)),
            Role::Count => matches!(arg, Arg::Count(_)),
            Role::MaskKey => matches!(arg, Arg::MaskKey(_)),
            Role::RowsOfIds => matches!(arg, Arg::RowsOfIds(..)),
            Role::Taps => matches!(arg, Arg::Taps(..)),
            Role::WindowsOfPixels => matches!(arg, Arg::WindowsOfPixels(..)),
        }
    }
}

/// Where a step kind runs and with which kernel arguments.
pub trait Placed {
    /// Where the step runs on a backend of `set`, in `program`.
    fn placement(&self, program: &Program, set: KernelSet) -> Placement;
}

/// Implements [`Step::placement`]: each kind's [`Placed::placement`].
macro_rules! placements {
    ($($kind:ident),* $(,)?) => {
        impl Step {
            /// Where the step runs on a backend of `set` ([`Placed::placement`]).
            pub fn placement(&self, program: &Program, set: KernelSet) -> Placement {
                match self {
                    $(Step::$kind(payload) => payload.placement(program, set),)*
                }
            }
        }
    };
}

crate::step::with_step_kinds!(placements);

impl Step {
    /// What the step's kernel code depends on: the step with its output's slot as
    /// `Slot(0)` and every other slot as `Slot(1)` (kernels take their buffers as
    /// arguments, and reading the output in place is the one identity they compile
    /// in), and its signature's roles. Steps with equal keys share a kernel.
    pub fn kernel_key(&self, signature: &Signature) -> KernelKey {
        let mut step = self.clone();
        let out = self.output();
        step.kind_mut().visit_slots(&mut |slot| {
            *slot = Slot(u32::from(*slot != out));
        });
        KernelKey {
            step,
            roles: signature.params.iter().map(|param| param.role).collect(),
        }
    }
}

/// A hashable key of a kernel's code ([`Step::kernel_key`]).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    step: Step,
    roles: Vec<Role>,
}

/// Builds a signature param by param.
struct Params(Vec<Param>);

impl Params {
    fn new(out: Slot) -> Self {
        Self(vec![Param {
            role: Role::Out,
            arg: Arg::Buffer(out),
        }])
    }

    fn with(mut self, role: Role, arg: Arg) -> Self {
        self.0.push(Param { role, arg });
        self
    }

    fn buffer(self, role: Role, slot: Slot) -> Self {
        self.with(role, Arg::Buffer(slot))
    }

    fn optional(self, role: Role, slot: Option<Slot>) -> Self {
        self.with(role, slot.map_or(Arg::Absent, Arg::Buffer))
    }

    /// A fused expression's inputs, then the row maps of those that read through one.
    fn fused(mut self, inputs: &[Access]) -> Self {
        for (index, access) in (0u32..).zip(inputs) {
            self = self.buffer(Role::Input(index), access.slot);
        }
        for (index, access) in (0u32..).zip(inputs) {
            if let Some(map) = access.row_map {
                self = self.with(Role::InputRows(index), Arg::RowMap(map));
            }
        }
        self
    }

    /// A fused prologue's inputs (read row by row: no row maps).
    fn prologue(mut self, inputs: &[Access]) -> Self {
        for (index, access) in (0u32..).zip(inputs) {
            self = self.buffer(Role::Input(index), access.slot);
        }
        self
    }

    fn over(self, range: Rows) -> Signature {
        Signature {
            params: self.0,
            range,
        }
    }

    fn kernel(self, range: Rows) -> Placement {
        Placement::Kernel(self.over(range))
    }
}

/// The rows of `lengths`' owners: the element of each packed row.
fn owners(lengths: Slot) -> Arg {
    Arg::RowMap(RowMap::Owners(lengths))
}

impl Placed for Pointwise {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out).fused(&self.inputs).kernel(self.rows)
    }
}

impl Placed for Gemm {
    fn placement(&self, _: &Program, set: KernelSet) -> Placement {
        let epilogue_inputs = self.epilogue.as_ref().map_or(&[][..], |e| &e.inputs);
        let values = self.rows.times(self.n);
        match set {
            // The library's product, then the epilogue over its rows.
            KernelSet::Library => Placement::Product(self.epilogue.as_ref().map(|epilogue| {
                Params::new(self.out)
                    .fused(&epilogue.inputs)
                    .over(self.rows)
            })),
            KernelSet::Complete => Placement::Kernel(
                Params::new(self.out)
                    .buffer(Role::X, self.x)
                    .buffer(Role::Weight, self.weight)
                    .optional(Role::Bias, self.bias)
                    .fused(epilogue_inputs)
                    .over(values),
            ),
            KernelSet::DeviceBlas => {
                Placement::Product((self.bias.is_some() || self.epilogue.is_some()).then(|| {
                    Params::new(self.out)
                        .optional(Role::Bias, self.bias)
                        .fused(epilogue_inputs)
                        .over(values)
                }))
            }
        }
    }
}

impl Placed for Row {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out)
            .prologue(&self.x.inputs)
            .optional(Role::Weight, self.weight)
            .optional(Role::Bias, self.bias)
            .optional(Role::Keys, self.keys)
            .kernel(self.rows)
    }
}

impl Placed for Segment {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out)
            .prologue(&self.x.inputs)
            .with(Role::Offsets, Arg::Offsets(self.lengths))
            .optional(Role::Keys, self.keys)
            .kernel(Rows::batch(self.lengths))
    }
}

impl Placed for Gather {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out)
            .buffer(Role::Table, self.table)
            .buffer(Role::Ids, self.ids)
            .kernel(self.rows)
    }
}

impl Placed for Attention {
    fn placement(&self, _: &Program, set: KernelSet) -> Placement {
        if set == KernelSet::Library {
            return Placement::Backend;
        }
        Params::new(self.out)
            .buffer(Role::Queries, self.q.slot)
            .buffer(Role::Keys, self.k.slot)
            .buffer(Role::Values, self.v.slot)
            .with(Role::Offsets, Arg::Offsets(self.q_lengths))
            .with(Role::KeyOffsets, Arg::Offsets(self.k_lengths))
            .with(Role::RowOwners, owners(self.q_lengths))
            .kernel(Rows::total(self.q_lengths).times(self.heads))
    }
}

impl Placed for AttentionGrad {
    fn placement(&self, _: &Program, set: KernelSet) -> Placement {
        // The statistics are a kernel everywhere (the CPU's gradients do without them:
        // only programs for a GPU have them); the gradients are the CPU's own code, and
        // the parts at once have no kernel at all.
        let library = set == KernelSet::Library && self.part != AttentionPart::Statistics;
        if library || matches!(self.part, AttentionPart::All | AttentionPart::Both) {
            return Placement::Backend;
        }
        // A task per query row and head, or (the keys' gradient) per key row and head.
        let rows = if self.part == AttentionPart::KeysValues {
            self.k_lengths
        } else {
            self.q_lengths
        };
        Params::new(self.out)
            .buffer(Role::Queries, self.q.slot)
            .buffer(Role::Keys, self.k.slot)
            .buffer(Role::Values, self.v.slot)
            .buffer(Role::Gradient, self.g.slot)
            .optional(Role::Statistics, self.statistics)
            .with(Role::Offsets, Arg::Offsets(self.q_lengths))
            .with(Role::KeyOffsets, Arg::Offsets(self.k_lengths))
            .with(Role::RowOwners, owners(rows))
            .kernel(Rows::total(rows).times(self.heads))
    }
}

impl Placed for Pad {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out)
            .buffer(Role::X, self.x)
            .with(Role::Offsets, Arg::Offsets(self.lengths))
            .with(Role::Longest, Arg::Longest(self.lengths))
            .kernel(Rows::padded(self.lengths))
    }
}

impl Placed for Unpad {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out)
            .buffer(Role::X, self.x)
            .with(Role::Offsets, Arg::Offsets(self.lengths))
            .with(Role::Longest, Arg::Longest(self.grid))
            .with(Role::RowOwners, owners(self.lengths))
            .kernel(Rows::total(self.lengths))
    }
}

impl Placed for OneHot {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out)
            .buffer(Role::Ids, self.ids)
            .kernel(self.rows)
    }
}

impl Placed for Positions {
    fn placement(&self, _: &Program, set: KernelSet) -> Placement {
        if set == KernelSet::Library {
            return Placement::Backend;
        }
        Params::new(self.out)
            .with(Role::Offsets, Arg::Offsets(self.lengths))
            .with(Role::RowOwners, owners(self.lengths))
            .kernel(Rows::total(self.lengths))
    }
}

impl Placed for LengthValues {
    fn placement(&self, _: &Program, set: KernelSet) -> Placement {
        if set == KernelSet::Library {
            return Placement::Backend;
        }
        Params::new(self.out)
            .buffer(Role::Lengths, self.lengths)
            .kernel(Rows::batch(self.lengths))
    }
}

impl Placed for Insert {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out)
            .buffer(Role::X, self.x)
            .kernel(self.rows)
    }
}

impl Placed for SumRows {
    fn placement(&self, _: &Program, set: KernelSet) -> Placement {
        match set {
            KernelSet::Library => Placement::Backend,
            // `a^T b` is the BLAS's whole result.
            KernelSet::DeviceBlas if self.a.is_some() && !self.mean => Placement::Product(None),
            _ => Params::new(self.out)
                .optional(Role::A, self.a)
                .buffer(Role::B, self.b)
                .optional(Role::Times, self.times)
                .optional(Role::Plain, self.plain)
                .with(Role::Count, Arg::Count(self.rows))
                .kernel(Rows::fixed(self.m).times(self.n)),
        }
    }
}

impl Placed for ScatterRows {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        // Each table row sums its own rows, from an index of them the host builds: from
        // the ids (an input's, or on the CPU computed ones), or for positions from their
        // lengths.
        Params::new(self.out)
            .buffer(Role::Gradient, self.g)
            .with(Role::RowsOfIds, Arg::RowsOfIds(self.ids, self.vocabulary))
            .kernel(Rows::fixed(self.vocabulary))
    }
}

impl Placed for RandomMask {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Params::new(self.out)
            .with(Role::MaskKey, Arg::MaskKey(self.stream))
            .kernel(self.rows.times(self.width))
    }
}

impl Placed for PairGemm {
    fn placement(&self, _: &Program, set: KernelSet) -> Placement {
        // Distances have no library call: a kernel in every set.
        if set == KernelSet::Library && self.distance.is_none() {
            return Placement::Backend;
        }
        Params::new(self.out)
            .buffer(Role::A, self.a)
            .buffer(Role::B, self.b)
            .with(Role::Offsets, Arg::Offsets(self.rows))
            .with(Role::ColumnOffsets, Arg::Offsets(self.columns))
            .with(Role::PairOffsets, Arg::PairOffsets(self.rows, self.columns))
            .with(Role::RowOwners, owners(self.rows))
            .kernel(Rows::total(self.rows))
    }
}

impl Placed for Window {
    fn placement(&self, program: &Program, set: KernelSet) -> Placement {
        let epilogue_inputs = self.epilogue.as_ref().map_or(&[][..], |e| &e.inputs);
        let out_rows = program.info(self.out).rows;
        // The CPU's own code (then a convolution's epilogue over its output pixels, as
        // a GEMM's), but for resampling (a kernel on every device).
        if set == KernelSet::Library && !self.kind.resamples() {
            return match &self.epilogue {
                Some(epilogue) => Placement::Product(Some(
                    Params::new(self.out).fused(&epilogue.inputs).over(out_rows),
                )),
                None => Placement::Backend,
            };
        }
        let (heights, widths) = (self.heights, self.widths);
        let taps = Arg::Taps(self.window, heights, widths);
        let windows_of_pixels = Arg::WindowsOfPixels(self.window, heights, widths);
        let params = Params::new(self.out).buffer(Role::X, self.x);
        let grad = |params: Params| params.optional(Role::Gradient, self.grad);
        // Each image's height and width (as offsets) and first pixel.
        let image_sizes = |params: Params| {
            params
                .with(Role::Offsets, Arg::Offsets(heights))
                .with(Role::ColumnOffsets, Arg::Offsets(widths))
                .with(Role::PairOffsets, Arg::PairOffsets(heights, widths))
        };
        match self.kind {
            // An image a task.
            WindowKind::ImageMean | WindowKind::ImageSpread => params
                .with(Role::PairOffsets, Arg::PairOffsets(heights, widths))
                .kernel(Rows::batch(heights)),
            // An output pixel a task.
            WindowKind::Conv | WindowKind::ConvInputGrad => params
                .optional(Role::Weight, self.weight)
                .optional(Role::Bias, self.bias)
                .with(Role::Taps, taps)
                .fused(epilogue_inputs)
                .kernel(out_rows),
            WindowKind::Max | WindowKind::Average => params.with(Role::Taps, taps).kernel(out_rows),
            // A weight a task, over the windows of the output's gradient.
            WindowKind::WeightGrad => {
                let windows = self.grad.map_or(Rows::fixed(0), |g| program.info(g).rows);
                grad(params)
                    .with(Role::Taps, taps)
                    .with(Role::Count, Arg::Count(windows))
                    .kernel(out_rows.times(program.info(self.out).width))
            }
            // An input pixel a task, over the windows that read it.
            WindowKind::MaxGrad | WindowKind::AverageGrad => grad(params)
                .with(Role::Taps, taps)
                .with(Role::WindowsOfPixels, windows_of_pixels)
                .kernel(out_rows),
            WindowKind::StridedConvInputGrad => params
                .optional(Role::Weight, self.weight)
                .with(Role::Taps, taps)
                .with(Role::WindowsOfPixels, windows_of_pixels)
                .kernel(out_rows),
            // A cell of an image a task.
            WindowKind::Adaptive | WindowKind::Bilinear { .. } => {
                let cells = self.window.kernel[0].saturating_mul(self.window.kernel[1]);
                image_sizes(params).kernel(Rows::batch(heights).times(cells))
            }
            // A row of an image's pixels a task.
            WindowKind::AdaptiveGrad | WindowKind::BilinearGrad { .. } => image_sizes(params)
                .with(Role::RowOwners, owners(heights))
                .kernel(Rows::total(heights)),
        }
    }
}

impl Placed for Host {
    fn placement(&self, _: &Program, _: KernelSet) -> Placement {
        Placement::Libtorch
    }
}
