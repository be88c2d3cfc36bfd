//! Lowering: a graph to a [`Program`] of kernel steps. One op becomes at most one step
//! (which ops fuse is the optimizer's decision, not lowering's); reshapes and eval-mode
//! dropout become aliases. Ops with no lowering yet are an error naming the op.

use std::collections::HashMap;

use nestor_ir::{BinaryOp, DType, Dim, ElemDim, FusedExpr, Graph, Op, ReduceOp, Type, ValueId};
use thiserror::Error;

use crate::program::{
    Access, Expr, FloatType, Fusion, LengthsOp, OutDim, Output, Program, RowBase, RowKind, Rows,
    SegmentKind, Slot, SlotInfo, Source, Step,
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
}

/// How an operand's rows relate to the output's rows.
#[derive(Clone, Copy, PartialEq)]
enum RowUse {
    Full,
    Broadcast,
    PerElement(Slot),
}

struct Lowering<'g> {
    graph: &'g Graph,
    options: LowerOptions,
    program: Program,
    values: Vec<Option<Lowered>>,
    /// Lengths slots by batch-size symbol, for dense values with a symbolic first dim.
    batches: HashMap<String, Slot>,
}

/// Lowers `graph` to a program with the default options.
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

    fn data_slot(&mut self, dtype: DType, rows: Rows, width: i64, source: Source) -> Slot {
        self.program.slot(SlotInfo {
            dtype,
            rows,
            width,
            source,
        })
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

    fn typed(&mut self, value: ValueId, ty: &Type, source: Source) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        match ty {
            Type::Lengths { batch } => {
                let slot = self.data_slot(DType::I64, Rows::fixed(1), 1, source);
                if let Dim::Sym(symbol) = batch {
                    self.batches.entry(symbol.clone()).or_insert(slot);
                }
                // A lengths slot's own size is its batch: it refers to itself.
                self.program.slots[slot.0 as usize].rows = Rows {
                    base: RowBase::Batch(slot),
                    factor: 1,
                };
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

    /// An alias of `source` seen with the type `ty` (same memory).
    fn alias(&mut self, value: ValueId, source: Slot, ty: &Type) -> Result<Lowered, LowerError> {
        self.typed(value, ty, Source::Alias(source))
    }

    /// Errors unless `operand` is dense or a batch with one leading ragged dim, the
    /// layouts row-wise kernels (GEMM, norms, softmax, reductions) understand.
    fn leading(&self, value: ValueId, operand: ValueId) -> Result<(), LowerError> {
        match self.get(operand) {
            Lowered::Data {
                lengths: None,
                dims,
                ..
            } if !dims.is_empty() => Err(unsupported(
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

    fn data(
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
        match op {
            Op::Const {
                value: constant, ..
            } => Ok(Lowered::Const(constant.0)),
            Op::Unary { op: unary, x } => self.pointwise(value, ty, &[*x], |loads| {
                Expr::Unary(*unary, Box::new(loads[0].clone()))
            }),
            Op::Binary {
                op: binary,
                lhs,
                rhs,
            } => self.pointwise(value, ty, &[*lhs, *rhs], |loads| {
                Expr::Binary(
                    *binary,
                    Box::new(loads[0].clone()),
                    Box::new(loads[1].clone()),
                )
            }),
            Op::Where { condition, x, y } => {
                self.pointwise(value, ty, &[*condition, *x, *y], |loads| {
                    Expr::Select(
                        Box::new(loads[0].clone()),
                        Box::new(loads[1].clone()),
                        Box::new(loads[2].clone()),
                    )
                })
            }
            Op::Cast { x, dtype } => match dtype {
                DType::F32 | DType::F64 | DType::F16 | DType::BF16 => {
                    self.pointwise(value, ty, &[*x], |loads| loads[0].clone())
                }
                DType::Bool => self.pointwise(value, ty, &[*x], |loads| {
                    Expr::Binary(
                        BinaryOp::Ne,
                        Box::new(loads[0].clone()),
                        Box::new(Expr::Const(0.0)),
                    )
                }),
                other => Err(unsupported(
                    value,
                    op,
                    format!("casts to {other} are not compiled"),
                )),
            },
            Op::Fused { inputs, expr } => {
                if let Some(dtype) = unsupported_cast(expr) {
                    return Err(unsupported(
                        value,
                        op,
                        format!("casts to {dtype} are not compiled"),
                    ));
                }
                self.pointwise(value, ty, inputs, |loads| translate(expr, loads))
            }
            Op::Prologue { inputs, expr, core } => {
                let types: Vec<Type> = inputs.iter().map(|&input| self.graph.ty(input).clone()).collect();
                let input_ty = nestor_ir::fused_type(expr, &types)
                    .map_err(|reason| unsupported(value, op, reason))?;
                let input = self.pointwise(value, &input_ty, inputs, |loads| translate(expr, loads))?;
                // The core reads the expression's result under this op's id, until the
                // core's own result takes that id.
                self.values[value.index()] = Some(input);
                let core = self.core_reading(value, op, core, 0)?;
                let out = self.op(value, &core, ty)?;
                crate::fold::fold_prologue(&mut self.program);
                Ok(out)
            }
            Op::Epilogue { core, inputs, expr } => {
                let core_ty = self
                    .graph
                    .type_of(core)
                    .map_err(|error| unsupported(value, op, error.rule))?;
                let result = self.op(value, core, &core_ty)?;
                // The expression reads the core's result (`$0`) under this op's id.
                self.values[value.index()] = Some(result);
                let operands: Vec<ValueId> = std::iter::once(value).chain(inputs.iter().copied()).collect();
                let out = self.pointwise(value, ty, &operands, |loads| translate(expr, loads))?;
                crate::fold::fold_epilogue(&mut self.program);
                Ok(out)
            }
            Op::Linear { x, weight, bias } => self.gemm(value, ty, *x, *weight, *bias, false),
            Op::Matmul { x, w } => self.gemm(value, ty, *x, *w, None, true),
            Op::LayerNorm {
                x,
                weight,
                bias,
                dims,
                eps,
            } => self.row(
                value,
                ty,
                RowKind::LayerNorm,
                *x,
                *weight,
                *bias,
                *dims,
                eps.0,
            ),
            Op::RmsNorm {
                x,
                weight,
                dims,
                eps,
            } => self.row(value, ty, RowKind::RmsNorm, *x, *weight, None, *dims, eps.0),
            Op::Softmax { x, axis, log } => {
                self.leading(value, *x)?;
                let (slot, _, tail, lengths) = self.data(value, *x)?;
                let last = tail.len() as i64 + 1;
                let ragged_axis = lengths.is_some() && *axis == 1;
                if ragged_axis {
                    let kind = if *log {
                        SegmentKind::LogSoftmax
                    } else {
                        SegmentKind::Softmax
                    };
                    let out = self.result(value, ty)?;
                    self.program.steps.push(Step::Segment {
                        kind,
                        out: slot_of(&out),
                        x: Fusion::plain(slot, volume(&tail)),
                        lengths: lengths.unwrap_or(slot),
                        width: volume(&tail),
                    });
                    Ok(out)
                } else if *axis == last || *axis == -1 {
                    let kind = if *log {
                        RowKind::LogSoftmax
                    } else {
                        RowKind::Softmax
                    };
                    self.row(value, ty, kind, *x, None, None, 1, 0.0)
                } else {
                    Err(unsupported(
                        value,
                        op,
                        "softmax over an inner static dim is not compiled",
                    ))
                }
            }
            Op::Reduce {
                op: reduce,
                x,
                dims,
                keepdim,
                ..
            } => self.reduce(value, ty, *reduce, *x, dims, *keepdim),
            Op::Embedding { ids, weight, .. } => {
                self.leading(value, *ids)?;
                let (ids_slot, rows, _, _) = self.data(value, *ids)?;
                let (table, _, table_tail, _) = self.data(value, *weight)?;
                let width = table_tail.first().copied().unwrap_or(1);
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Gather {
                    out: slot_of(&out),
                    table,
                    ids: ids_slot,
                    rows,
                    width,
                });
                Ok(out)
            }
            Op::Unpad { x, lengths } => {
                let (x_slot, rows, tail, _) = self.data(value, *x)?;
                let (RowBase::Padded(grid), Lowered::Lengths(lengths)) =
                    (rows.base, self.get(*lengths))
                else {
                    return Err(unsupported(value, op, format!("{x} must be a padded grid")));
                };
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Unpad {
                    out: slot_of(&out),
                    x: x_slot,
                    grid,
                    lengths,
                    width: volume(&tail),
                });
                Ok(out)
            }
            Op::Pad { x, value: padding } => {
                self.leading(value, *x)?;
                let (x_slot, _, tail, lengths) = self.data(value, *x)?;
                let Some(lengths) = lengths else {
                    return Err(unsupported(value, op, format!("{x} must be a ragged batch")));
                };
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Pad {
                    out: slot_of(&out),
                    x: x_slot,
                    lengths,
                    width: volume(&tail),
                    value: padding.0,
                });
                Ok(out)
            }
            Op::Attention {
                q,
                k,
                v,
                causal,
                scale,
            } => {
                let (q_slot, _, q_tail, q_lengths) = self.data(value, *q)?;
                let (k_slot, _, _, k_lengths) = self.data(value, *k)?;
                let (v_slot, _, v_tail, _) = self.data(value, *v)?;
                let (heads, head_dim, value_dim) = (q_tail[0], q_tail[1], v_tail[1]);
                let full = Access::rows;
                let out = self.result(value, ty)?;
                let (Some(q_lengths), Some(k_lengths)) = (q_lengths, k_lengths) else {
                    return Err(unsupported(
                        value,
                        op,
                        "attention needs ragged queries and keys",
                    ));
                };
                self.program.steps.push(Step::Attention {
                    out: slot_of(&out),
                    q: full(q_slot, heads * head_dim),
                    k: full(k_slot, heads * head_dim),
                    v: full(v_slot, heads * value_dim),
                    q_lengths,
                    k_lengths,
                    heads,
                    head_dim,
                    value_dim,
                    causal: *causal,
                    scale: scale.map_or(1.0 / (head_dim as f64).sqrt(), |scale| scale.0),
                });
                Ok(out)
            }
            Op::ReshapeTail { x, .. }
            | Op::Dropout {
                x, train: false, ..
            } => {
                let (slot, ..) = self.data(value, *x)?;
                self.alias(value, slot, ty)
            }
            Op::SelectStatic { x, dim, index } => {
                self.leading(value, *x)?;
                let (slot, _, tail, _) = self.data(value, *x)?;
                if *dim != 1 {
                    return Err(unsupported(
                        value,
                        op,
                        "only the first static dim can be selected",
                    ));
                }
                let inner = volume(&tail[1..]);
                let access = Access {
                    slot,
                    row_stride: volume(&tail),
                    col_stride: 1,
                    offset: index * inner,
                    per_element: None,
                    col_modulo: 0,
                };
                let out = self.result(value, ty)?;
                let width = volume(&tail_of(&out));
                self.program.steps.push(Step::Pointwise {
                    out: slot_of(&out),
                    rows: rows_of(&out),
                    width,
                    inputs: vec![access],
                    expr: Expr::Load(0),
                });
                Ok(out)
            }
            Op::WindowLengths { lengths, kernel, stride, padding, dilation } => {
                let Lowered::Lengths(input) = self.get(*lengths) else {
                    return Err(unsupported(value, op, "expects a lengths buffer"));
                };
                let out = self.result(value, ty)?;
                let out_slot = slot_of(&out);
                self.program.lengths_ops.push(LengthsOp { out: out_slot, input, kernel: *kernel, stride: *stride, padding: *padding, dilation: *dilation });
                Ok(out)
            }
            Op::PerElement { .. } if !self.options.host_per_element => Err(unsupported(
                value,
                op,
                "per-element regions run through libtorch only when asked (Compiled::per_element_fallback)",
            )),
            Op::PerElement { inputs, body } => self.host_region(value, ty, inputs, body),
            other => Err(unsupported(value, other, "not lowered yet")),
        }
    }

    /// A host step running a one-op graph (a per-element region) through libtorch: its
    /// inputs are the lengths its types need, then the region's inputs.
    fn host_region(
        &mut self,
        value: ValueId,
        ty: &Type,
        inputs: &[ValueId],
        body: &Graph,
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        let mut host = Graph::new("host");
        let mut renamed: HashMap<ValueId, ValueId> = HashMap::new();
        let mut slots = Vec::new();
        let error = |error: nestor_ir::VerifyError| unsupported(value, op, error.to_string());
        // Lengths first: every type refers to them.
        let mut lengths: Vec<ValueId> = Vec::new();
        for referenced in inputs
            .iter()
            .flat_map(|&input| self.graph.ty(input).length_values())
            .chain(ty.length_values())
        {
            if !lengths.contains(&referenced) {
                lengths.push(referenced);
            }
        }
        for lengths_value in lengths {
            let Lowered::Lengths(slot) = self.get(lengths_value) else {
                return Err(unsupported(
                    value,
                    op,
                    "its lengths are not a lengths buffer",
                ));
            };
            let local = host
                .add_declared(
                    Op::Input {
                        name: format!("lengths{}", slots.len()),
                    },
                    self.graph.ty(lengths_value).clone(),
                )
                .map_err(error)?;
            renamed.insert(lengths_value, local);
            slots.push(slot);
        }
        for &input in inputs {
            let ty = self
                .graph
                .ty(input)
                .map_values(|v| renamed.get(&v).copied().unwrap_or(v));
            let local = host
                .add_declared(
                    Op::Input {
                        name: format!("input{}", slots.len()),
                    },
                    ty,
                )
                .map_err(error)?;
            renamed.insert(input, local);
            let (slot, ..) = self.data(value, input)?;
            slots.push(slot);
        }
        let region_inputs = inputs.iter().map(|input| renamed[input]).collect();
        let region_ty = ty.map_values(|v| renamed.get(&v).copied().unwrap_or(v));
        let region = host
            .add_declared(
                Op::PerElement {
                    inputs: region_inputs,
                    body: Box::new(body.clone()),
                },
                region_ty,
            )
            .map_err(error)?;
        host.outputs = vec![region];
        let out = self.result(value, ty)?;
        self.program.host_graphs.push(host);
        self.program.steps.push(Step::Host {
            out: slot_of(&out),
            inputs: slots,
            graph: self.program.host_graphs.len() - 1,
        });
        Ok(out)
    }

    /// A pointwise step computing `build(loads)` over `operands` broadcast to `ty`.
    /// `core` with its operand `position` reading `value` instead.
    fn core_reading(
        &self,
        value: ValueId,
        op: &Op,
        core: &Op,
        position: usize,
    ) -> Result<Op, LowerError> {
        let mut operands = core.operands();
        operands[position] = value;
        core.with_operands(&operands)
            .ok_or_else(|| unsupported(value, op, "its core takes other operands"))
    }

    fn pointwise(
        &mut self,
        value: ValueId,
        ty: &Type,
        operands: &[ValueId],
        build: impl Fn(&[Expr]) -> Expr,
    ) -> Result<Lowered, LowerError> {
        let out = self.result(value, ty)?;
        let (out_slot, out_rows, out_tail) = (slot_of(&out), rows_of(&out), tail_of(&out));
        let mut inputs = Vec::new();
        let mut loads = Vec::new();
        for &operand in operands {
            match self.get(operand) {
                Lowered::Const(constant) => loads.push(Expr::Const(constant)),
                Lowered::Lengths(_) => {
                    return Err(unsupported(
                        value,
                        self.graph.op(value),
                        "lengths are not elementwise operands",
                    ))
                }
                Lowered::Data { slot, tail, .. } => {
                    let access = self.access(value, ty, operand, slot, &tail, &out_tail)?;
                    loads.push(Expr::Load(inputs.len()));
                    inputs.push(access);
                }
            }
        }
        self.program.steps.push(Step::Pointwise {
            out: out_slot,
            rows: out_rows,
            width: volume(&out_tail),
            inputs,
            expr: build(&loads),
        });
        Ok(out)
    }

    /// How an operand is read by a pointwise step whose output has type `ty`.
    fn access(
        &self,
        value: ValueId,
        ty: &Type,
        operand: ValueId,
        slot: Slot,
        tail: &[i64],
        out_tail: &[i64],
    ) -> Result<Access, LowerError> {
        let op = self.graph.op(value);
        let operand_ty = self.graph.ty(operand);
        // The operand's rows and its tail right-aligned to the output's tail.
        let (row_use, operand_tail): (RowUse, Vec<i64>) = match (ty, operand_ty) {
            (Type::Ragged { .. }, Type::Ragged { .. }) => (RowUse::Full, tail.to_vec()),
            (Type::Ragged { dims, batch, .. }, Type::Dense { shape, .. }) => {
                let rank = dims.len();
                let static_shape: Vec<i64> = shape
                    .iter()
                    .map(|dim| dim.as_static().unwrap_or(-1))
                    .collect();
                if shape.len() == rank + 1 {
                    let per_element = shape[0] == *batch && shape[0] != Dim::Static(1);
                    let ragged_lengths = ty.length_values().first().copied();
                    let lengths = ragged_lengths.and_then(|l| match self.get(l) {
                        Lowered::Lengths(slot) => Some(slot),
                        _ => None,
                    });
                    match (per_element, lengths) {
                        (true, Some(lengths)) => {
                            (RowUse::PerElement(lengths), static_shape[2..].to_vec())
                        }
                        (false, _) => (RowUse::Broadcast, static_shape[2..].to_vec()),
                        (true, None) => {
                            return Err(unsupported(
                                value,
                                op,
                                "a per-element operand without lengths",
                            ))
                        }
                    }
                } else {
                    // A tail: the leading (ragged) position is 1 or absent.
                    let element = static_shape;
                    let tail_part = if element.len() == rank {
                        element[1..].to_vec()
                    } else {
                        element
                    };
                    (RowUse::Broadcast, tail_part)
                }
            }
            (
                Type::Dense {
                    shape: out_shape, ..
                },
                Type::Dense { shape, .. },
            ) => {
                if let [_, Dim::Max(_), rest @ ..] = shape.as_slice() {
                    // Padded grids: rows are `B x max(L)`; only same-shape operands.
                    if shape != out_shape {
                        return Err(unsupported(
                            value,
                            op,
                            format!("cannot broadcast {operand_ty} into {ty}"),
                        ));
                    }
                    (RowUse::Full, self.static_tail(operand, rest)?)
                } else if shape.len() == out_shape.len() && !shape.is_empty() {
                    let row = if shape[0] == out_shape[0] {
                        RowUse::Full
                    } else {
                        RowUse::Broadcast
                    };
                    (row, self.static_tail(operand, &shape[1..])?)
                } else {
                    let all: Vec<i64> = shape
                        .iter()
                        .map(|dim| dim.as_static().unwrap_or(-1))
                        .collect();
                    (RowUse::Broadcast, all)
                }
            }
            _ => {
                return Err(unsupported(
                    value,
                    op,
                    format!("cannot broadcast {operand_ty} into {ty}"),
                ))
            }
        };
        // Right-align the operand tail to the output tail.
        let padded: Vec<i64> = if operand_tail.len() <= out_tail.len() {
            std::iter::repeat_n(1, out_tail.len() - operand_tail.len())
                .chain(operand_tail.iter().copied())
                .collect()
        } else {
            return Err(unsupported(
                value,
                op,
                format!("operand {operand} has more dims than the result"),
            ));
        };
        let (col_stride, col_modulo) = if padded == out_tail {
            (1, 0)
        } else if padded.iter().all(|&size| size == 1) {
            (0, 0)
        } else {
            let first = padded.iter().position(|&size| size != 1).unwrap_or(0);
            if padded[first..] == out_tail[first..] {
                (1, volume(&out_tail[first..]))
            } else {
                return Err(unsupported(
                    value,
                    op,
                    format!("broadcasting {padded:?} over {out_tail:?} is not compiled"),
                ));
            }
        };
        let row_stride = volume(
            &padded
                .iter()
                .copied()
                .filter(|&size| size != 1)
                .collect::<Vec<_>>(),
        )
        .max(1);
        let row_stride = if col_stride == 0 { 1 } else { row_stride };
        Ok(match row_use {
            RowUse::Full => Access {
                slot,
                row_stride,
                col_stride,
                offset: 0,
                per_element: None,
                col_modulo,
            },
            RowUse::Broadcast => Access {
                slot,
                row_stride: 0,
                col_stride,
                offset: 0,
                per_element: None,
                col_modulo,
            },
            RowUse::PerElement(lengths) => Access {
                slot,
                row_stride,
                col_stride,
                offset: 0,
                per_element: Some(lengths),
                col_modulo,
            },
        })
    }

    fn gemm(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        weight: ValueId,
        bias: Option<ValueId>,
        transposed: bool,
    ) -> Result<Lowered, LowerError> {
        self.leading(value, x)?;
        self.gemm_checked(value, ty, x, weight, bias, transposed)
    }

    fn gemm_checked(
        &mut self,
        value: ValueId,
        ty: &Type,
        x: ValueId,
        weight: ValueId,
        bias: Option<ValueId>,
        transposed: bool,
    ) -> Result<Lowered, LowerError> {
        let (x_slot, rows, tail, _) = self.data(value, x)?;
        let (weight_slot, weight_rows, weight_tail, _) = self.data(value, weight)?;
        let bias = bias
            .map(|bias| self.data(value, bias).map(|(slot, ..)| slot))
            .transpose()?;
        let k = *tail.last().unwrap_or(&1);
        let weight_first = weight_rows.factor;
        let n = if transposed {
            weight_tail.first().copied().unwrap_or(1)
        } else {
            weight_first
        };
        let out = self.result(value, ty)?;
        let outer = volume(&tail[..tail.len().saturating_sub(1)]);
        self.program.steps.push(Step::Gemm {
            out: slot_of(&out),
            x: x_slot,
            weight: weight_slot,
            bias,
            rows: rows.times(outer),
            k,
            n,
            transposed,
            epilogue: None,
        });
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn row(
        &mut self,
        value: ValueId,
        ty: &Type,
        kind: RowKind,
        x: ValueId,
        weight: Option<ValueId>,
        bias: Option<ValueId>,
        dims: usize,
        eps: f64,
    ) -> Result<Lowered, LowerError> {
        self.leading(value, x)?;
        let (x_slot, rows, tail, _) = self.data(value, x)?;
        if dims == 0 || dims > tail.len() {
            return Err(unsupported(
                value,
                self.graph.op(value),
                format!("cannot normalize {dims} dims of a tail {tail:?}"),
            ));
        }
        let width = volume(&tail[tail.len() - dims..]);
        let weight = weight
            .map(|weight| self.data(value, weight).map(|(slot, ..)| slot))
            .transpose()?;
        let bias = bias
            .map(|bias| self.data(value, bias).map(|(slot, ..)| slot))
            .transpose()?;
        let out = self.result(value, ty)?;
        let outer = volume(&tail[..tail.len() - dims]);
        self.program.steps.push(Step::Row {
            kind,
            out: slot_of(&out),
            x: Fusion::plain(x_slot, width),
            weight,
            bias,
            rows: rows.times(outer),
            width,
            eps,
        });
        Ok(out)
    }

    fn reduce(
        &mut self,
        value: ValueId,
        ty: &Type,
        reduce: ReduceOp,
        x: ValueId,
        dims: &[i64],
        keepdim: bool,
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        self.leading(value, x)?;
        let (x_slot, rows, tail, lengths) = self.data(value, x)?;
        let last = tail.len() as i64 + 1;
        match (dims, lengths) {
            ([1], Some(lengths)) if !keepdim => {
                let kind = match reduce {
                    ReduceOp::Sum => SegmentKind::Sum,
                    ReduceOp::Mean => SegmentKind::Mean,
                    ReduceOp::Amax => SegmentKind::Max,
                    ReduceOp::Amin => SegmentKind::Min,
                    other => {
                        return Err(unsupported(
                            value,
                            op,
                            format!("{} over the ragged dim is not compiled", other.word()),
                        ))
                    }
                };
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Segment {
                    kind,
                    out: slot_of(&out),
                    x: Fusion::plain(x_slot, volume(&tail)),
                    lengths,
                    width: volume(&tail),
                });
                Ok(out)
            }
            ([dim], _) if (*dim == last || *dim == -1) && !tail.is_empty() => {
                let kind = match reduce {
                    ReduceOp::Sum => RowKind::Sum,
                    ReduceOp::Mean => RowKind::Mean,
                    ReduceOp::Amax => RowKind::Max,
                    ReduceOp::Amin => RowKind::Min,
                    other => {
                        return Err(unsupported(
                            value,
                            op,
                            format!("{} over the last dim is not compiled", other.word()),
                        ))
                    }
                };
                let width = *tail.last().unwrap_or(&1);
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Row {
                    kind,
                    out: slot_of(&out),
                    x: Fusion::plain(x_slot, width),
                    weight: None,
                    bias: None,
                    rows: rows.times(volume(&tail[..tail.len().saturating_sub(1)])),
                    width,
                    eps: 0.0,
                });
                Ok(out)
            }
            _ => Err(unsupported(
                value,
                op,
                format!("reductions over dims {dims:?} (keepdim {keepdim}) are not compiled"),
            )),
        }
    }
}

/// A fused expression as a kernel expression over the loads of its inputs (casts
/// between float types are free: a program computes in one float type).
fn translate(expr: &FusedExpr, loads: &[Expr]) -> Expr {
    let recurse = |expr: &FusedExpr| Box::new(translate(expr, loads));
    match expr {
        FusedExpr::Input(index) => loads[*index].clone(),
        FusedExpr::Const { value, .. } => Expr::Const(value.0),
        FusedExpr::Unary(op, x) => Expr::Unary(*op, recurse(x)),
        FusedExpr::Binary(op, a, b) => Expr::Binary(*op, recurse(a), recurse(b)),
        FusedExpr::Where(c, a, b) => Expr::Select(recurse(c), recurse(a), recurse(b)),
        FusedExpr::Cast(DType::Bool, x) => {
            Expr::Binary(BinaryOp::Ne, recurse(x), Box::new(Expr::Const(0.0)))
        }
        FusedExpr::Cast(_, x) => *recurse(x),
    }
}

/// The first cast in `expr` to a type compiled code does not compute in.
fn unsupported_cast(expr: &FusedExpr) -> Option<DType> {
    match expr {
        FusedExpr::Input(_) | FusedExpr::Const { .. } => None,
        FusedExpr::Cast(dtype, _)
            if !matches!(
                dtype,
                DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::Bool
            ) =>
        {
            Some(*dtype)
        }
        FusedExpr::Unary(_, x) | FusedExpr::Cast(_, x) => unsupported_cast(x),
        FusedExpr::Binary(_, a, b) => unsupported_cast(a).or_else(|| unsupported_cast(b)),
        FusedExpr::Where(c, a, b) => unsupported_cast(c)
            .or_else(|| unsupported_cast(a))
            .or_else(|| unsupported_cast(b)),
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
