//! GEMMs (linear, matmul), the embedding gather and varlen attention.

use super::*;
use crate::step::{
    Attention, AttentionGrad, AttentionPart, Gather, Gemm, Insert, PairGemm, Pointwise,
    ScatterRows, SumRows,
};
use nestor_ir::AttentionGradPart;

impl Lowering<'_> {
    /// Lowers a gemm op.
    pub(super) fn lower_gemm(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        match op {
            Op::Linear { x, weight, bias } => self.gemm(value, ty, *x, *weight, *bias, false),
            Op::Matmul { x, w } => self.gemm(value, ty, *x, *w, None, true),
            Op::Embedding { ids, weight, .. } => {
                self.leading(value, *ids)?;
                let (ids_slot, rows, _) = self.integer_ids(value, *ids)?;
                let (table, _, table_tail, _) = self.data(value, *weight)?;
                let width = table_tail.first().copied().unwrap_or(1);
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::Gather(Gather {
                    out: slot_of(&out),
                    table,
                    ids: ids_slot,
                    rows,
                    width,
                }));
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
                self.program.steps.push(Step::Attention(Attention {
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
                    scale: scale.unwrap_or(F64(1.0 / (head_dim as f64).sqrt())),
                }));
                Ok(out)
            }
            Op::PairMatmul { a, b } => self.pair_gemm(value, op, ty, (*a, *b), None),
            Op::Cdist { a, b, p } => self.pair_gemm(value, op, ty, (*a, *b), Some(*p)),
            _ => self.lower_gemm_gradient(value, op, ty),
        }
    }

    /// Lowers a gradient op of a product (row contractions, embedding scatters, attention's gradient).
    fn lower_gemm_gradient(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        match op {
            Op::ContractRows { a, b } => self.contract_rows(value, ty, (*a, *b)),
            Op::ScatterRows {
                g,
                ids,
                vocabulary,
                padding_idx,
            } => {
                let (g, rows, tail, _) = self.data(value, *g)?;
                let (ids, ..) = self.integer_ids(value, *ids)?;
                let width = tail.last().copied().unwrap_or(1);
                let out = self.result(value, ty)?;
                self.program.steps.push(Step::ScatterRows(ScatterRows {
                    out: slot_of(&out),
                    g,
                    ids,
                    rows: rows.times(volume(&tail[..tail.len().saturating_sub(1)])),
                    width,
                    vocabulary: *vocabulary,
                    padding: *padding_idx,
                }));
                Ok(out)
            }
            Op::AttentionGrad {
                q,
                k,
                v,
                g,
                causal,
                scale,
                part,
            } => {
                if let Some(lowered) = self.attention_pairs.remove(&value) {
                    return Ok(lowered);
                }
                let (q_slot, _, q_tail, q_lengths) = self.data(value, *q)?;
                let (k_slot, _, _, k_lengths) = self.data(value, *k)?;
                let (v_slot, ..) = self.data(value, *v)?;
                let (g_slot, ..) = self.data(value, *g)?;
                let (Some(q_lengths), Some(k_lengths)) = (q_lengths, k_lengths) else {
                    return Err(unsupported(
                        value,
                        op,
                        "attention needs ragged queries and keys",
                    ));
                };
                let (heads, head_dim) = (q_tail[0], q_tail[1]);
                let rows = |slot| Access::rows(slot, heads * head_dim);
                let step = |out, part, statistics| AttentionGrad {
                    out,
                    q: rows(q_slot),
                    k: rows(k_slot),
                    v: rows(v_slot),
                    g: rows(g_slot),
                    q_lengths,
                    k_lengths,
                    heads,
                    head_dim,
                    causal: *causal,
                    scale: scale.unwrap_or(F64(1.0 / (head_dim as f64).sqrt())),
                    part,
                    statistics,
                    keys_values_out: None,
                };
                let statistics = if self.options.attention_statistics {
                    let key = [*q, *k, *v, *g];
                    Some(match self.attention_statistics.get(&key) {
                        Some(&slot) => slot,
                        None => {
                            let slot = self.program.slot(SlotInfo {
                                dtype: DType::F32,
                                rows: Rows::total(q_lengths).times(heads),
                                width: AttentionPart::STATISTICS_WIDTH,
                                source: Source::Step,
                                integers: false,
                            });
                            self.program
                                .steps
                                .push(step(slot, AttentionPart::Statistics, None).into());
                            self.attention_statistics.insert(key, slot);
                            slot
                        }
                    })
                } else {
                    None
                };
                let out = self.result(value, ty)?;
                let other = self
                    .options
                    .attention_gradients_at_once
                    .then(|| self.other_attention_part(value, op))
                    .flatten();
                if let Some(other) = other {
                    // Both parts in one step; the other's value is lowered with this one.
                    let other_out = self.result(other, self.graph.ty(other))?;
                    let (queries, keys_values) = match part {
                        AttentionGradPart::Queries => (&out, &other_out),
                        _ => (&other_out, &out),
                    };
                    let both = AttentionGrad {
                        keys_values_out: Some(slot_of(keys_values)),
                        ..step(slot_of(queries), AttentionPart::Both, statistics)
                    };
                    self.program.steps.push(both.into());
                    self.attention_pairs.insert(other, other_out);
                    return Ok(out);
                }
                let part = match part {
                    AttentionGradPart::Queries => AttentionPart::Queries,
                    AttentionGradPart::KeysValues => AttentionPart::KeysValues,
                    // The CPU's own code computes the three at once; kernels one part
                    // each, stacked.
                    AttentionGradPart::All if self.options.attention_gradients_at_once => {
                        AttentionPart::All
                    }
                    AttentionGradPart::All => {
                        let (rows, width) = (Rows::total(q_lengths), heads * head_dim);
                        let info = self.program.info(slot_of(&out)).clone();
                        let mut stacked = Vec::new();
                        for (part, index, count) in [
                            (AttentionPart::Queries, 0, 1),
                            (AttentionPart::KeysValues, 1, 2),
                        ] {
                            let gradient = self.program.slot(SlotInfo {
                                width: count * width,
                                ..info.clone()
                            });
                            self.program
                                .steps
                                .push(step(gradient, part, statistics).into());
                            let placed = self.program.slot(info.clone());
                            self.program.steps.push(Step::Insert(Insert {
                                out: placed,
                                x: gradient,
                                rows,
                                size: 3,
                                index,
                                count,
                                inner: width,
                            }));
                            stacked.push(Access::rows(placed, 3 * width));
                        }
                        self.program.steps.push(Step::Pointwise(Pointwise {
                            out: slot_of(&out),
                            rows,
                            width: 3 * width,
                            inputs: stacked,
                            expr: Expr::Binary(
                                BinaryOp::Add,
                                Box::new(Expr::Load(0)),
                                Box::new(Expr::Load(1)),
                            ),
                        }));
                        return Ok(out);
                    }
                };
                self.program
                    .steps
                    .push(step(slot_of(&out), part, statistics).into());
                Ok(out)
            }
            other => Err(unsupported(value, other, "not lowered yet")),
        }
    }

    /// The later `attention_grad` of `op`'s operands computing the part `op` does not,
    /// when `op` computes the queries' gradient or the keys' and values'.
    fn other_attention_part(&self, value: ValueId, op: &Op) -> Option<ValueId> {
        let Op::AttentionGrad { part, .. } = op else {
            return None;
        };
        let other = match part {
            AttentionGradPart::Queries => AttentionGradPart::KeysValues,
            AttentionGradPart::KeysValues => AttentionGradPart::Queries,
            AttentionGradPart::All => return None,
        };
        let mut wanted = op.clone();
        if let Op::AttentionGrad { part, .. } = &mut wanted {
            *part = other;
        }
        let later = self.graph.nodes.iter().enumerate().skip(value.index() + 1);
        later
            .filter(|(_, node)| node.op == wanted)
            .map(|(index, _)| ValueId(index as u32))
            .next()
    }

    /// `a^T b` summed over every row (`a [rows, m]`, `b [rows, n]`, their last dims the
    /// widths): a weight gradient, as a [`Step::SumRows`].
    pub(super) fn contract_rows(
        &mut self,
        value: ValueId,
        ty: &Type,
        (a, b): (ValueId, ValueId),
    ) -> Result<Lowered, LowerError> {
        let (a_slot, a_rows, a_tail, _) = self.data(value, a)?;
        let (b_slot, _, b_tail, _) = self.data(value, b)?;
        let (m, n) = (
            a_tail.last().copied().unwrap_or(1),
            b_tail.last().copied().unwrap_or(1),
        );
        let rows = a_rows.times(volume(&a_tail[..a_tail.len().saturating_sub(1)]));
        let out = self.result(value, ty)?;
        self.program.steps.push(Step::SumRows(SumRows {
            out: slot_of(&out),
            a: Some(a_slot),
            b: b_slot,
            times: None,
            plain: None,
            rows,
            m,
            n,
            mean: false,
        }));
        Ok(out)
    }

    pub(super) fn gemm(
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

    pub(super) fn gemm_checked(
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
        self.program.steps.push(Step::Gemm(Gemm {
            out: slot_of(&out),
            x: x_slot,
            weight: weight_slot,
            bias,
            rows: rows.times(outer),
            k,
            n,
            transposed,
            epilogue: None,
        }));
        Ok(out)
    }
}

impl Lowering<'_> {
    /// The jagged-pair matmul (or, with a `distance` norm, `cdist`): its row and
    /// column lengths from the operands' types.
    fn pair_gemm(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
        (a, b): (ValueId, ValueId),
        distance: Option<F64>,
    ) -> Result<Lowered, LowerError> {
        let dims = |operand: ValueId| match self.graph.ty(operand) {
            Type::Ragged { dims, .. } => dims.clone(),
            _ => Vec::new(),
        };
        // Inference accepted one of the two forms; each names its lengths values.
        let (rows, columns, width, mix) = match (dims(a).as_slice(), dims(b).as_slice()) {
            ([ElemDim::Ragged(m), ElemDim::Fixed(k)], [_, ElemDim::Ragged(n)]) => {
                (*m, *n, k.clone(), false)
            }
            // cdist's points `[M, D]` and `[N, D]`.
            ([ElemDim::Ragged(m), ElemDim::Fixed(d)], [ElemDim::Ragged(n), _])
                if distance.is_some() =>
            {
                (*m, *n, d.clone(), false)
            }
            ([ElemDim::Ragged(m), ElemDim::Ragged(n)], [_, ElemDim::Fixed(d)]) => {
                (*m, *n, d.clone(), true)
            }
            _ => return Err(unsupported(value, op, "not a jagged-pair matmul")),
        };
        let width = self.static_tail(value, std::slice::from_ref(&width))?[0];
        let lengths = |lengths: ValueId| match self.get(lengths) {
            Lowered::Lengths(slot) => Ok(slot),
            _ => Err(unsupported(
                value,
                op,
                "its lengths are not a lengths buffer",
            )),
        };
        let (rows, columns) = (lengths(rows)?, lengths(columns)?);
        let (a_slot, ..) = self.data(value, a)?;
        let (b_slot, ..) = self.data(value, b)?;
        let out = self.result(value, ty)?;
        self.program.steps.push(Step::PairGemm(PairGemm {
            out: slot_of(&out),
            a: a_slot,
            b: b_slot,
            rows,
            columns,
            width,
            mix,
            distance,
        }));
        Ok(out)
    }
}
