//! Kernel programs: the target-independent description of what runs. Every buffer is a
//! [`Slot`] of `rows x width` scalars, where `rows` is computed from lengths at run
//! time, so one program serves every batch of its structure.

use nestor_ir::DType;

use crate::operands::{Rows, Slot};
use crate::step::Step;

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
    /// Whether the buffer holds i64 values: lengths, ids and other integer inputs, and
    /// the positions steps compute (argmax); other integer results (an integer sum) are
    /// computed in the program's float type and converted at the boundary.
    pub integers: bool,
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
    /// Every length times the same element's length in `by`: the rows of each element
    /// of a value with two ragged dims (an image's pixels, `H_i W_i`).
    Times {
        /// The other lengths.
        by: Slot,
    },
    /// `size` for every element of the input.
    Constant {
        /// Every element's length.
        size: i64,
    },
    /// The input's lengths repeated: whole or element by element.
    Repeat(crate::Repeats),
    /// The lengths of a slice of each element (bounds resolved per element).
    Slice(nestor_ir::SliceBounds),
    /// The input's lengths, checked equal to `against`'s (two window formulas that
    /// agreed when traced): an unequal run is an error before any buffer is sized.
    Checked {
        /// The lengths the input must equal.
        against: Slot,
    },
    /// The input's lengths, checked at least `count` before the run (a reduction
    /// without a value for shorter elements: argmax over an empty one, the `count`-th
    /// smallest value), as `op` (its name in the error) needs.
    AtLeast {
        /// The fewest positions each element needs.
        count: i64,
        /// The operation that needs them.
        op: &'static str,
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
    /// What the matrix products of an f32 program multiply: f32 values, or their bf16
    /// roundings with f32 sums (mixed precision, as `torch.autocast`'s products).
    pub products: Products,
}

/// The operands of a program's matrix products (GEMMs and weight gradients).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Products {
    /// The program's float type.
    #[default]
    Float,
    /// bf16 roundings of f32 operands, summed in f32, on the host's bf16 units where it
    /// has them (elsewhere in f32, from the same roundings' exact products). f64
    /// programs ignore it.
    Bf16,
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

    /// Bytes per value of `slot`'s buffer: 8 for i64 values
    /// ([`SlotInfo::integers`]), else the program's float type's.
    pub fn value_bytes(&self, slot: Slot) -> usize {
        if self.info(slot).integers {
            8
        } else {
            self.float.size()
        }
    }

    /// Whether `slot` is one of the program's inputs as given (its values are in the
    /// caller's memory when a run starts, so the host can read them: ids to check, or to
    /// index by).
    pub fn is_input(&self, slot: Slot) -> bool {
        matches!(self.info(slot).source, Source::Input(_))
    }

    /// The slot whose memory `slot` uses: itself, unless it is an alias.
    pub fn root(&self, slot: Slot) -> Slot {
        let mut root = slot;
        while let Source::Alias(of) = self.info(root).source {
            root = of;
        }
        root
    }

    /// The lengths whose positions `slot` holds (written by a [`Step::Positions`],
    /// through aliases), if it does: ids known to lie in `0..` their longest.
    pub fn positions_of(&self, slot: Slot) -> Option<Slot> {
        let root = self.root(slot);
        self.steps.iter().find_map(|step| match step {
            Step::Positions(positions) if positions.out == root => Some(positions.lengths),
            _ => None,
        })
    }

    /// The number of kernel launches per run (one per step).
    pub fn launches(&self) -> usize {
        self.steps.len()
    }
}

impl std::fmt::Display for Program {
    /// A compact listing for humans (`nestor-opt --emit program`): one line per slot
    /// (`s<index>: dtype [rows x width]` and where it comes from), lengths op, step (its
    /// fields as `Debug` writes them) and output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "program ({:?}{}): {} slots, {} steps, {} outputs",
            self.float,
            match self.products {
                Products::Float => "",
                Products::Bf16 => ", bf16 products",
            },
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
