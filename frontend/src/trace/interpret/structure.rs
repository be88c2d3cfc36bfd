//! Structure: static reshapes and selections, padding, masks, lengths, repeats.

use super::*;

impl Interpreter<'_> {
    /// Runs a structure op.
    pub(super) fn run_structure(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::ReshapeTail { x, tail } => Value::Nested(self.nested(*x)?.reshape_tail(tail)?),
            Op::Reshape { x, shape } => Value::Dense(self.dense(*x)?.f_reshape(shape.as_slice())?),
            Op::SelectStatic { x, dim, index } => {
                Value::Nested(self.nested(*x)?.select_static(*dim as i64 + 1, *index)?)
            }
            Op::SliceStatic { x, dim, start, end } => {
                Value::Nested(self.nested(*x)?.slice(*dim as i64 + 1, *start..*end)?)
            }
            Op::PadStatic {
                x,
                dim,
                before,
                after,
            } => Value::Nested(self.nested(*x)?.pad_static(*dim, (*before, *after))?),
            Op::TransposeStatic { x, dim0, dim1 } => Value::Nested(
                self.nested(*x)?
                    .transpose(*dim0 as i64 + 1, *dim1 as i64 + 1)?,
            ),
            Op::CausalFill { x, value } => Value::Nested(self.nested(*x)?.causal_fill(value.0)?),
            Op::Unsqueeze { x, dim } => Value::Nested(self.nested(*x)?.unsqueeze(*dim as i64 + 1)?),
            Op::TransposeRagged { x, dim0, dim1 } => Value::Nested(
                self.nested(*x)?
                    .transpose(*dim0 as i64 + 1, *dim1 as i64 + 1)?,
            ),
            _ => self.run_lengths_op(op)?,
        })
    }

    /// Runs a padding, mask or lengths op.
    fn run_lengths_op(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::Pad { x, value } => {
                let nested = self.nested(*x)?;
                let options = crate::NestedOptions {
                    padding_value: value.0,
                    ..nested.options()
                };
                Value::Dense(nested.with_options(options).pad()?.tensor)
            }
            Op::Unpad { x, lengths } => {
                let mask = length_mask(self.lengths(*lengths)?)?;
                Value::Nested(
                    NestedTensor::builder()
                        .ragged_dims(&[0])
                        .tensor_mask(self.dense(*x)?, &mask)?,
                )
            }
            Op::Positions { lengths } => {
                let lengths = self.lengths(*lengths)?;
                let positions: Vec<i64> = lengths
                    .iter()
                    .flat_map(|&length| 0..length.max(0))
                    .collect();
                Value::Nested(
                    NestedTensor::builder()
                        .ragged_dims(&[0])
                        .packed_with_lengths(&Tensor::f_from_slice(&positions)?, lengths)?,
                )
            }
            Op::Mask { lengths } => Value::Dense(length_mask(self.lengths(*lengths)?)?),
            Op::MaxLength { lengths } => Value::Dense(Tensor::from(
                self.lengths(*lengths)?.iter().copied().max().unwrap_or(0),
            )),
            Op::TotalLength { lengths } => {
                Value::Dense(Tensor::from(self.lengths(*lengths)?.iter().sum::<i64>()))
            }
            Op::ConstantLengths { lengths, size } => {
                Value::Lengths(vec![*size; self.lengths(*lengths)?.len()])
            }
            &Op::SliceLengths {
                lengths,
                start,
                end,
            } => {
                let bounds = nestor_ir::SliceBounds { start, end };
                let lengths = self.lengths(lengths)?;
                Value::Lengths(lengths.iter().map(|&n| bounds.length(n)).collect())
            }
            &Op::SliceRagged { x, start, end, .. } => {
                Value::Nested(self.nested(x)?.slice(1, Bounds::of(start, end))?)
            }
            &Op::UnsliceRagged {
                g,
                like,
                start,
                end,
            } => {
                let (grads, own) = (self.nested(g)?, self.nested(like)?);
                let (rows, _) = own.ragged_slice_rows(0, Bounds::of(start, end))?;
                let rows = Tensor::f_from_slice(&rows)?.f_to_device(own.device())?;
                let zeros = own.packed().f_zeros_like()?.f_to_kind(grads.kind())?;
                let values = zeros.f_index_copy(0, &rows, grads.packed())?;
                Value::Nested(NestedTensor::from_parts(
                    values,
                    own.lay().clone(),
                    own.options(),
                ))
            }
            Op::RepeatLengths {
                lengths,
                repeats,
                interleave,
            } => {
                let lengths = self.lengths(*lengths)?;
                let repeats = *repeats as usize;
                Value::Lengths(if *interleave {
                    lengths
                        .iter()
                        .flat_map(|&length| std::iter::repeat_n(length, repeats))
                        .collect()
                } else {
                    lengths.repeat(repeats)
                })
            }
            Op::RepeatBatch {
                x,
                repeats,
                interleave,
                ..
            } => {
                let nested = self.nested(*x)?;
                let repeats = *repeats as usize;
                Value::Nested(if *interleave {
                    nested.repeat_interleave(repeats)?
                } else {
                    nested.repeat_batch(repeats)?
                })
            }
            Op::UnrepeatBatch {
                g,
                like,
                repeats,
                interleave,
            } => {
                let (grads, own) = (self.nested(*g)?, self.nested(*like)?);
                let batch = own.batch_size() as i64;
                let repeats = nestor_passes::Repeats {
                    times: *repeats,
                    interleave: *interleave,
                };
                let mut total: Option<Tensor> = None;
                for copy in 0..repeats.times {
                    let indices: Vec<i64> = (0..batch)
                        .map(|element| repeats.copy_of(element, copy, batch))
                        .collect();
                    let part = grads.select_batch(indices)?.packed().shallow_clone();
                    total = Some(match total {
                        Some(sum) => sum.f_add(&part)?,
                        None => part,
                    });
                }
                let values = match total {
                    Some(total) => total,
                    None => own.packed().f_zeros_like()?.f_to_kind(grads.kind())?,
                };
                Value::Nested(NestedTensor::from_parts(
                    values,
                    own.lay().clone(),
                    own.options(),
                ))
            }
            Op::MatchLengths { x, lengths } => {
                let own = self.graph.ty(*x).length_values();
                let sizes = |of: &[ValueId]| -> Result<Vec<Vec<i64>>> {
                    let columns = of
                        .iter()
                        .map(|&lengths| self.lengths(lengths))
                        .collect::<Result<Vec<_>>>()?;
                    let elements = columns.first().map_or(0, |lengths| lengths.len());
                    Ok((0..elements)
                        .map(|element| {
                            let size = |lengths: &&[i64]| lengths.get(element).copied();
                            columns
                                .iter()
                                .map(|lengths| size(lengths).unwrap_or(-1))
                                .collect()
                        })
                        .collect())
                };
                let (left, right) = (sizes(&own)?, sizes(lengths)?);
                if left != right {
                    return Err(NestedError::StructureMismatch {
                        op: "match_lengths",
                        left,
                        right,
                    });
                }
                Value::Nested(self.nested(*x)?.clone())
            }
            Op::WindowLengths {
                lengths,
                kernel,
                stride,
                padding,
                dilation,
            } => Value::Lengths(
                self.lengths(*lengths)?
                    .iter()
                    .map(|&length| {
                        nestor_ir::window_output_size(length, *kernel, *stride, *padding, *dilation)
                    })
                    .collect(),
            ),
            _ => self.run_lengths_data(op)?,
        })
    }

    /// Runs an op that writes values from lengths or ids (length values, one-hot rows, inserts).
    fn run_lengths_data(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::LengthValues {
                lengths,
                dtype,
                rank,
            } => {
                let lengths = self.lengths(*lengths)?;
                let shape: Vec<i64> = std::iter::once(lengths.len() as i64)
                    .chain(std::iter::repeat_n(1, rank.saturating_sub(1)))
                    .collect();
                Value::Dense(
                    Tensor::f_from_slice(lengths)?
                        .f_to_kind(kind_of(*dtype))?
                        .f_reshape(&shape)?,
                )
            }
            Op::OneHot {
                ids,
                classes,
                ignore,
                dtype,
            } => {
                let one_hot = |ids: &Tensor| -> Result<Tensor> {
                    let valid = ids
                        .f_ge(0)?
                        .f_logical_and(&ids.f_lt(*classes)?)?
                        .f_logical_and(&ids.f_ne(*ignore)?)?;
                    let clamped = ids.f_clamp(0, classes - 1)?;
                    Ok(clamped
                        .f_one_hot(*classes)?
                        .f_mul(&valid.f_unsqueeze(-1)?)?
                        .f_to_kind(kind_of(*dtype))?)
                };
                match self.get(*ids) {
                    Value::Nested(nested) => {
                        let rows = one_hot(nested.packed())?;
                        Value::Nested(nested.packed_with_static_tail(&rows)?)
                    }
                    _ => Value::Dense(one_hot(self.dense(*ids)?)?),
                }
            }
            Op::InsertStatic {
                x,
                dim,
                index,
                size,
            } => {
                let nested = self.nested(*x)?;
                let layout = nested.lay();
                // The packed position of element dim `dim`: after the rows and the static
                // dims before it.
                let position = 1 + (0..*dim).filter(|&d| !layout.is_ragged(d)).count() as i64;
                let values = nested.packed();
                let mut shape = values.size();
                shape.insert(position as usize, *size);
                let out = Tensor::f_zeros(&shape, (values.kind(), values.device()))?;
                out.f_narrow(position, *index, 1)?
                    .f_copy_(&values.f_unsqueeze(position)?)?;
                Value::Nested(nested.packed_with_static_tail(&out)?)
            }
            other => return Err(not_in_family(other, "structure")),
        })
    }
}
