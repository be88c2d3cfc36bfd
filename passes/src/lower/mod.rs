//! Lowering: a graph to a [`Program`] of kernel steps. One op becomes at most one step
//! (which ops fuse is the optimizer's decision, not lowering's, but for the GEMM
//! epilogues of [`LowerOptions::fold_epilogues`]); reshapes and eval-mode dropout
//! become aliases. Ops with no lowering yet are an error naming the op.
//!
//! Compiled values are f32 inside (f16, bf16 and bool converted at the boundary, i64
//! for lengths and ids), or f64 when the graph's floats are f64 ([`Program::float`];
//! mixing f64 with lower precisions, or f64 with host steps, is a [`LowerError`]).
//! `window_lengths` become `LengthsOp`s the runtime evaluates before sizing buffers;
//! with [`LowerOptions::host_per_element`], `per_element` regions become host steps.
//! One module per op family; `mod.rs` holds the buffers' bookkeeping and dispatches.

use std::collections::HashMap;

use nestor_ir::{
    BinaryOp, DType, Dim, ElemDim, FusedExpr, Graph, Op, OpFamily, ReduceOp, Type, ValueId, F64,
};
use thiserror::Error;

mod fused_kernel;
mod gemm;
mod per_element;
mod pointwise;
mod row;
mod structure;

use pointwise::translate;

use crate::step::Step;

use crate::operands::{
    Access, Expr, Fusion, Order, Pick, RowBase, RowKind, RowMap, Rows, SegmentKind, Slot,
};
use crate::program::{
    FloatType, LengthsKind, LengthsOp, OutDim, Output, Program, SlotInfo, Source,
};

/// An op the compiler cannot lower yet.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{value} = {op}: no compiled lowering ({reason}); the interpreter (Traced::run) runs it")]
pub struct LowerError {
    /// The value.
    pub value: ValueId,
    /// Its op.
    pub op: &'static str,
    /// What is not supported.
    pub reason: String,
}

/// A lowered value.
#[derive(Clone, Debug)]
enum Lowered {
    /// A compile-time constant.
    Const(f64),
    /// A lengths buffer.
    Lengths(Slot),
    /// A buffer of `rows x product(tail)` scalars. `lengths` names the lengths of a
    /// batch with one leading ragged dim; `dims` describes every element dim of a
    /// ragged value (empty for dense values).
    Data {
        slot: Slot,
        rows: Rows,
        tail: Vec<i64>,
        lengths: Option<Slot>,
        dims: Vec<OutDim>,
    },
}

/// Choices of the lowering.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LowerOptions {
    /// Run `per_element` regions (convolutions, pooling) on the host through libtorch
    /// inside the program, instead of failing to lower them.
    pub host_per_element: bool,
    /// Attention's gradients read the softmax statistics of each query row from a step
    /// of their own (`AttentionPart::Statistics`, once for both gradients): what GPU
    /// kernels need, whose keys' gradient visits every query of a key and would
    /// otherwise compute its statistics again each time (cubic in the length). The
    /// CPU's gradients compute them inside their tiles: its programs do without.
    pub attention_statistics: bool,
    /// Self-attention's three gradients (`attention_grad {part = all}`) in one step
    /// (`AttentionPart::All`: the CPU's own code, with no kernel), rather than the
    /// queries' and the keys' and values' apart, stacked by inserts (what kernels do);
    /// and cross-attention's two parts of the same operands in one step
    /// (`AttentionPart::Both`), rather than one each.
    pub attention_gradients_at_once: bool,
    /// Fold each pointwise step into the GEMM (or convolution) whose result it alone
    /// reads, moving the product down past the steps between that do not touch it
    /// (`fold.rs`): what the optimizer's epilogue rule does for `linear` and `matmul`,
    /// for the products of other ops (convolutions followed by a batch norm and a
    /// relu); move per-column scales of products' operands into the products
    /// (`scale.rs`) and products read only by their column sums into the sums
    /// (`sums.rs`). Off, one op is at most one step; `compile` sets it when it
    /// optimizes.
    pub fold_epilogues: bool,
}

/// How an operand's rows relate to the output's rows.
#[derive(Clone, Copy, PartialEq)]
enum RowUse {
    Full,
    Broadcast,
    PerElement(Slot),
    /// Rows read through a map (an operand broadcast over a pair layout's rows).
    Mapped(RowMap),
}

struct Lowering<'g> {
    graph: &'g Graph,
    options: LowerOptions,
    program: Program,
    values: Vec<Option<Lowered>>,
    /// Lengths slots by batch-size symbol, for dense values with a symbolic first dim.
    batches: HashMap<String, Slot>,
    /// The statistics slot of attention's gradients, by their queries, keys, values and
    /// cotangent ([`LowerOptions::attention_statistics`]): both gradients read one.
    attention_statistics: HashMap<[ValueId; 4], Slot>,
    /// Attention gradients lowered already with the other part of theirs (one
    /// [`crate::step::AttentionPart::Both`] step), by value.
    attention_pairs: HashMap<ValueId, Lowered>,
}

/// Lowers `graph` to a program with the default options.
///
/// ```
/// let graph = nestor_ir::parse("graph @ffn {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
///   %2 = param {name = \"w\"} : f32[8, 4]
///   %3 = linear(%1, %2) : ragged<f32>[B; %0, 8]
///   %4 = relu(%3) : ragged<f32>[B; %0, 8]
///   return %4
/// }")?;
/// let program = nestor_passes::lower(&graph)?;
/// // The GEMM and the relu: two steps, whose buffers are sized from the lengths.
/// assert_eq!(program.launches(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn lower(graph: &Graph) -> Result<Program, LowerError> {
    lower_with(graph, LowerOptions::default())
}

/// Lowers `graph` to a program.
pub fn lower_with(graph: &Graph, options: LowerOptions) -> Result<Program, LowerError> {
    let mut lowering = Lowering {
        graph,
        options,
        program: Program::default(),
        values: vec![None; graph.nodes.len()],
        batches: HashMap::new(),
        attention_statistics: HashMap::new(),
        attention_pairs: HashMap::new(),
    };
    let mut input_index = 0;
    for (index, node) in graph.nodes.iter().enumerate() {
        let value = ValueId(index as u32);
        let lowered = match &node.op {
            Op::Input { .. } | Op::Param { .. } => {
                let lowered = lowering.input(value, &node.ty, input_index)?;
                input_index += 1;
                lowered
            }
            op => lowering.op(value, op, &node.ty)?,
        };
        lowering.values[index] = Some(lowered);
    }
    for &output in &graph.outputs {
        let lowered = lowering.get(output);
        let out = match (lowered, graph.ty(output)) {
            (Lowered::Data { slot, dims, .. }, Type::Ragged { .. }) => {
                Output::Ragged { slot, dims }
            }
            (
                Lowered::Data {
                    slot,
                    tail,
                    rows:
                        Rows {
                            base: RowBase::Padded(lengths),
                            ..
                        },
                    ..
                },
                Type::Dense { .. },
            ) => Output::Padded {
                slot,
                lengths,
                tail,
            },
            (Lowered::Data { slot, .. }, Type::Dense { shape, .. }) if shape.is_empty() => {
                Output::Scalar { slot }
            }
            (Lowered::Data { slot, tail, .. }, Type::Dense { .. }) => Output::Dense { slot, tail },
            _ => {
                return Err(unsupported(
                    output,
                    graph.op(output),
                    "only batches and dense tensors can be returned",
                ))
            }
        };
        lowering.program.outputs.push(out);
    }
    lowering.program.float = precision(graph, &lowering.program)?;
    crate::forward::forward_copies(&mut lowering.program);
    if options.fold_epilogues {
        crate::fold::fold_epilogues(&mut lowering.program);
        crate::scale::scale_into_products(&mut lowering.program);
        crate::sums::products_into_sums(&mut lowering.program);
        crate::sums::plain_sums_beside_products(&mut lowering.program);
    }
    Ok(lowering.program)
}

/// The float type of a program: f64 when its floating values are f64, f32 otherwise.
/// Mixing f64 with lower precisions is not compiled (one kernel type per program).
fn precision(graph: &Graph, program: &Program) -> Result<FloatType, LowerError> {
    let floats: Vec<DType> = program
        .slots
        .iter()
        .map(|slot| slot.dtype)
        .filter(|dtype| dtype.is_float())
        .collect();
    let double = floats.contains(&DType::F64);
    if double && floats.iter().any(|&dtype| dtype != DType::F64) {
        let value = ValueId(graph.nodes.len().saturating_sub(1) as u32);
        return Err(LowerError {
            value,
            op: "program",
            reason:
                "it mixes f64 with lower precisions; compiled programs compute in one float type"
                    .into(),
        });
    }
    if double && !program.host_graphs.is_empty() {
        let value = ValueId(graph.nodes.len().saturating_sub(1) as u32);
        return Err(LowerError {
            value,
            op: "per_element",
            reason: "host regions compute in f32; f64 programs cannot use them".into(),
        });
    }
    Ok(if double {
        FloatType::F64
    } else {
        FloatType::F32
    })
}

fn unsupported(value: ValueId, op: &Op, reason: impl Into<String>) -> LowerError {
    LowerError {
        value,
        op: op.name(),
        reason: reason.into(),
    }
}

fn volume(tail: &[i64]) -> i64 {
    tail.iter().product()
}

impl Lowering<'_> {
    fn get(&self, value: ValueId) -> Lowered {
        // Values are lowered in definition order and operands precede their uses.
        self.values[value.index()]
            .clone()
            .unwrap_or(Lowered::Const(f64::NAN))
    }

    /// A new slot: integer inputs (and views of integer slots) hold i64 values, other
    /// slots floats (a step of positions marks its own, [`Self::holding_positions`]).
    fn data_slot(&mut self, dtype: DType, rows: Rows, width: i64, source: Source) -> Slot {
        let integers = dtype == DType::I64
            && match source {
                Source::Input(_) => true,
                Source::Alias(root) => self.program.info(root).integers,
                Source::Step => false,
            };
        self.program.slot(SlotInfo {
            dtype,
            rows,
            width,
            source,
            integers,
        })
    }

    /// `lowered`, marked as holding i64 values when its step writes `positions`.
    fn holding_positions(&mut self, positions: bool, lowered: Lowered) -> Lowered {
        if let Some(info) = self.program.slots.get_mut(slot_of(&lowered).0 as usize) {
            info.integers |= positions;
        }
        lowered
    }

    /// The rows of a dim: static, or the batch size of a lengths input.
    fn rows_of(&self, value: ValueId, dim: &Dim) -> Result<Rows, LowerError> {
        match dim {
            Dim::Static(size) => Ok(Rows::fixed(*size)),
            Dim::Sym(symbol) => match self.batches.get(symbol) {
                Some(&lengths) => Ok(Rows {
                    base: RowBase::Batch(lengths),
                    factor: 1,
                }),
                None => Err(unsupported(
                    value,
                    self.graph.op(value),
                    format!("no lengths input gives the size {symbol}"),
                )),
            },
            Dim::Max(_) => Err(unsupported(
                value,
                self.graph.op(value),
                "padded dims are not compiled",
            )),
        }
    }

    fn static_tail(&self, value: ValueId, dims: &[Dim]) -> Result<Vec<i64>, LowerError> {
        dims.iter()
            .map(|dim| {
                dim.as_static().ok_or_else(|| {
                    unsupported(
                        value,
                        self.graph.op(value),
                        format!("dim {dim} is not static"),
                    )
                })
            })
            .collect()
    }

    /// The lowering of a value of type `ty` held in a new slot written by a step.
    fn result(&mut self, value: ValueId, ty: &Type) -> Result<Lowered, LowerError> {
        self.typed(value, ty, Source::Step)
    }

    /// A new lengths slot (its own size is its batch: it refers to itself).
    fn lengths_slot(&mut self, source: Source) -> Slot {
        let slot = self.data_slot(DType::I64, Rows::fixed(1), 1, source);
        let info = &mut self.program.slots[slot.0 as usize];
        info.rows = Rows {
            base: RowBase::Batch(slot),
            factor: 1,
        };
        info.integers = true;
        slot
    }

    /// The lengths the runtime derives from `input` by `kind` before the run: the
    /// lengths op that gives them already (a softmax and its gradient's sums over one
    /// pair layout share one derivation), or a new one.
    pub(super) fn derived_lengths(&mut self, input: Slot, kind: LengthsKind) -> Slot {
        let existing =
            (self.program.lengths_ops.iter()).find(|op| op.input == input && op.kind == kind);
        if let Some(op) = existing {
            return op.out;
        }
        let out = self.lengths_slot(Source::Step);
        self.program
            .lengths_ops
            .push(LengthsOp { out, input, kind });
        out
    }

    fn typed(&mut self, value: ValueId, ty: &Type, source: Source) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        match ty {
            Type::Lengths { batch } => {
                let slot = self.lengths_slot(source);
                if let Dim::Sym(symbol) = batch {
                    self.batches.entry(symbol.clone()).or_insert(slot);
                }
                Ok(Lowered::Lengths(slot))
            }
            Type::Ragged { dtype, dims, batch } => {
                let mut out_dims = Vec::with_capacity(dims.len());
                let mut ragged = Vec::new();
                let mut tail = Vec::new();
                for dim in dims {
                    match dim {
                        ElemDim::Ragged(lengths) => {
                            let Lowered::Lengths(slot) = self.get(*lengths) else {
                                return Err(unsupported(
                                    value,
                                    op,
                                    "its lengths are not a lengths buffer",
                                ));
                            };
                            ragged.push(slot);
                            out_dims.push(OutDim::Ragged(slot));
                        }
                        ElemDim::Fixed(fixed) => {
                            let size = self.static_tail(value, std::slice::from_ref(fixed))?[0];
                            tail.push(size);
                            out_dims.push(OutDim::Static(size));
                        }
                    }
                }
                let base = match ragged.as_slice() {
                    [] => self.rows_of(value, batch)?.base,
                    [lengths] => RowBase::Total(*lengths),
                    [first, second] => RowBase::Volume(*first, *second),
                    _ => {
                        return Err(unsupported(
                            value,
                            op,
                            format!("compiled batches have at most two ragged dims, got {ty}"),
                        ))
                    }
                };
                let rows = Rows { base, factor: 1 };
                let leading = matches!(dims.first(), Some(ElemDim::Ragged(_))) && ragged.len() == 1;
                let slot = self.data_slot(*dtype, rows, volume(&tail), source);
                Ok(Lowered::Data {
                    slot,
                    rows,
                    tail,
                    lengths: leading.then(|| ragged[0]),
                    dims: out_dims,
                })
            }
            Type::Dense { dtype, shape } => {
                let (rows, tail) = match shape.as_slice() {
                    [] => (Rows::fixed(1), Vec::new()),
                    // A padded grid `[B, max(L), ...]`: B x max(L) rows.
                    [_, Dim::Max(lengths), rest @ ..] => match self.get(*lengths) {
                        Lowered::Lengths(slot) => (
                            Rows {
                                base: RowBase::Padded(slot),
                                factor: 1,
                            },
                            self.static_tail(value, rest)?,
                        ),
                        _ => return Err(unsupported(value, op, "its padded dim has no lengths")),
                    },
                    [first, rest @ ..] => {
                        (self.rows_of(value, first)?, self.static_tail(value, rest)?)
                    }
                };
                let slot = self.data_slot(*dtype, rows, volume(&tail), source);
                Ok(Lowered::Data {
                    slot,
                    rows,
                    tail,
                    lengths: None,
                    dims: Vec::new(),
                })
            }
        }
    }

    fn input(&mut self, value: ValueId, ty: &Type, index: usize) -> Result<Lowered, LowerError> {
        if let Some(dtype) = ty.dtype() {
            if !matches!(
                dtype,
                DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::I64 | DType::Bool
            ) {
                return Err(unsupported(
                    value,
                    self.graph.op(value),
                    format!("compiled inputs are f32, f64, f16, bf16, i64 or bool, got {dtype}"),
                ));
            }
        }
        self.typed(value, ty, Source::Input(index))
    }

    /// `value` as a view of the buffer of `x`.
    fn alias_of(&mut self, value: ValueId, x: ValueId, ty: &Type) -> Result<Lowered, LowerError> {
        let (slot, ..) = self.any_data(value, x)?;
        self.alias(value, slot, ty)
    }

    /// An alias of `source` seen with the type `ty` (same memory).
    fn alias(&mut self, value: ValueId, source: Slot, ty: &Type) -> Result<Lowered, LowerError> {
        self.typed(value, ty, Source::Alias(source))
    }

    /// Errors unless `operand` is dense, a batch with one leading ragged dim, or a batch
    /// without ragged dims (one row per element), the layouts row-wise kernels (GEMM,
    /// norms, softmax, reductions) understand.
    fn leading(&self, value: ValueId, operand: ValueId) -> Result<(), LowerError> {
        match self.get(operand) {
            Lowered::Data {
                lengths: None,
                dims,
                ..
            } if dims.iter().any(|dim| matches!(dim, OutDim::Ragged(_))) => Err(unsupported(
                value,
                self.graph.op(value),
                format!(
                    "{operand} must have one leading ragged dim, got {}",
                    self.graph.ty(operand)
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The buffer, rows, tail and lengths of the float tensor `operand` of `value`; a
    /// typed error for a buffer of i64 values (positions, ids), which only gathers and
    /// views read.
    fn data(
        &self,
        value: ValueId,
        operand: ValueId,
    ) -> Result<(Slot, Rows, Vec<i64>, Option<Slot>), LowerError> {
        let found = self.any_data(value, operand)?;
        self.floats(value, found.0)?;
        Ok(found)
    }

    /// Errors unless `slot`, read by `value`, holds floats (or 0/1 truth values).
    fn floats(&self, value: ValueId, slot: Slot) -> Result<(), LowerError> {
        if self.program.info(slot).integers {
            return Err(unsupported(
                value,
                self.graph.op(value),
                "its operand holds i64 values (positions or ids), which compiled programs \
                 only return, view or gather by",
            ));
        }
        Ok(())
    }

    /// [`Self::data`] of any buffer, floats or i64 values.
    fn any_data(
        &self,
        value: ValueId,
        operand: ValueId,
    ) -> Result<(Slot, Rows, Vec<i64>, Option<Slot>), LowerError> {
        match self.get(operand) {
            Lowered::Data {
                slot,
                rows,
                tail,
                lengths,
                ..
            } => Ok((slot, rows, tail, lengths)),
            _ => Err(unsupported(
                value,
                self.graph.op(value),
                format!("{operand} must be a tensor"),
            )),
        }
    }

    /// The buffer of integer ids `ids` (an input, or a view of one: the host checks them
    /// before the run), its rows and tail.
    fn integer_ids(
        &self,
        value: ValueId,
        ids: ValueId,
    ) -> Result<(Slot, Rows, Vec<i64>), LowerError> {
        let (slot, rows, tail, _) = self.any_data(value, ids)?;
        let root = self.program.root(slot);
        let checkable = self.program.is_input(root) || self.program.positions_of(root).is_some();
        if !self.program.info(slot).integers || !checkable {
            return Err(unsupported(
                value,
                self.graph.op(value),
                "its ids must be an integer input or positions",
            ));
        }
        Ok((slot, rows, tail))
    }

    fn op(&mut self, value: ValueId, op: &Op, ty: &Type) -> Result<Lowered, LowerError> {
        if let Some(dtype) = ty.dtype() {
            if !matches!(
                dtype,
                DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::Bool | DType::I64
            ) {
                return Err(unsupported(
                    value,
                    op,
                    format!("compiled values are f32 or f64 (f16 and bf16 at the boundary), got {dtype}"),
                ));
            }
        }
        match op.family() {
            OpFamily::Pointwise => self.lower_pointwise(value, op, ty),
            OpFamily::FusedKernel => self.lower_fused_kernel(value, op, ty),
            OpFamily::Gemm | OpFamily::Attention => self.lower_gemm(value, op, ty),
            OpFamily::Norm | OpFamily::Reduce => self.lower_row(value, op, ty),
            OpFamily::Structure => self.lower_structure(value, op, ty),
            OpFamily::PerElement => self.lower_per_element(value, op, ty),
            OpFamily::Source | OpFamily::Loss => Err(unsupported(value, op, "not lowered yet")),
        }
    }
}

fn slot_of(lowered: &Lowered) -> Slot {
    match lowered {
        Lowered::Data { slot, .. } | Lowered::Lengths(slot) => *slot,
        Lowered::Const(_) => Slot(u32::MAX),
    }
}

fn rows_of(lowered: &Lowered) -> Rows {
    match lowered {
        Lowered::Data { rows, .. } => *rows,
        _ => Rows::fixed(1),
    }
}

fn tail_of(lowered: &Lowered) -> Vec<i64> {
    match lowered {
        Lowered::Data { tail, .. } => tail.clone(),
        _ => Vec::new(),
    }
}
