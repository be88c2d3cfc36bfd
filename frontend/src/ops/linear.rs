//! linear and matmul with a dense weight (one GEMM over the packed rows), matmul of two
//! NestedTensors (the jagged pairs of attention), embedding (a packed gather).

use tch::Tensor;

use nestor_ir::Op;

use crate::guard::{slow_path, SlowPath};
use crate::trace::Arg;
use crate::{NestedError, NestedTensor, Result};

impl NestedTensor {
    /// `x W^T + b` over the last dim, which must be static with `W`'s input width:
    /// one GEMM over all packed rows.
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<NestedTensor> {
        let input_width = self.last_static_width("linear")?;
        let weight_shape = weight.size();
        if weight_shape.len() != 2 || weight_shape[1] != input_width {
            return Err(NestedError::DenseOperand {
                op: "linear",
                shape: weight_shape,
                reason: format!("(the weight must be [out, {input_width}])"),
            });
        }
        let output = self.packed().f_linear(weight, bias)?;
        let mut args = vec![Arg::Nested(self), Arg::Dense(weight, None)];
        args.extend(bias.map(|bias| Arg::Dense(bias, None)));
        self.with_last_static_width(output, weight_shape[0])?
            .traced(&args, "linear", |ids| Op::Linear {
                x: ids[0],
                weight: ids[1],
                bias: ids.get(2).copied(),
            })
    }

    /// Matrix product with a dense `[K, M]` matrix (or a `[K]` vector) over the last
    /// dim, which must be static of width `K`: one GEMM over all packed rows.
    pub fn matmul(&self, other: &Tensor) -> Result<NestedTensor> {
        let width = self.last_static_width("matmul")?;
        let shape = other.size();
        let args = [Arg::Nested(self), Arg::Dense(other, None)];
        let record = |result: NestedTensor| {
            result.traced(&args, "matmul", |ids| Op::Matmul {
                x: ids[0],
                w: ids[1],
            })
        };
        match shape.as_slice() {
            [k, m] if *k == width => {
                let output = self.packed().f_matmul(other)?;
                record(self.with_last_static_width(output, *m)?)
            }
            [k] if *k == width => {
                let output = self.packed().f_matmul(other)?;
                let layout = self.lay().without_dim(self.lay().rank() - 1)?;
                record(NestedTensor::from_parts(output, layout, self.options()))
            }
            _ => Err(NestedError::DenseOperand {
                op: "matmul",
                shape,
                reason: format!("(expected [{width}, M] or [{width}])"),
            }),
        }
    }

    /// Matrix product of two NestedTensors element by element: `A_i @ B_i` for 2-d
    /// elements, e.g. `Q_i [L_i, d] @ K_i^T [d, L_i] -> [L_i, L_i]` and
    /// `P_i [L_i, L_i] @ V_i [L_i, d] -> [L_i, d]`. Those two forms (the jagged pairs
    /// of attention) run packed (see `pairs.rs`): one GEMM per element on views of the
    /// packed values, the results written once in packed order, or, for many short
    /// elements, one batched GEMM padded to the longest; other ranks or layouts run
    /// element by element (a slow path).
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// let q = NestedTensor::from_lists(vec![vec![vec![1.0f32, 0.0]; 3], vec![vec![0.0, 2.0]; 2]])?;
    /// let scores = q.matmul_nested(&q.transpose(1, 2)?)?; // [L_i, L_i]
    /// assert_eq!(scores.values().size(), [13]); // 3 * 3 + 2 * 2 scores, packed
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    pub fn matmul_nested(&self, other: &NestedTensor) -> Result<NestedTensor> {
        if self.batch_size() != other.batch_size() {
            return Err(NestedError::StructureMismatch {
                op: "matmul_nested",
                left: self.lay().element_sizes().to_vec(),
                right: other.lay().element_sizes().to_vec(),
            });
        }
        if let Some(product) = self.pair_matmul(other)? {
            let args = [Arg::Nested(self), Arg::Nested(other)];
            return product.traced(&args, "matmul_nested", |ids| Op::PairMatmul {
                a: ids[0],
                b: ids[1],
            });
        }
        self.untraceable("matmul_nested")?;
        other.untraceable("matmul_nested")?;
        slow_path(SlowPath::PerElement, "matmul_nested")?;
        let products = self
            .elements()?
            .iter()
            .zip(other.elements()?)
            .map(|(a, b)| Ok(a.f_matmul(&b)?))
            .collect::<Result<Vec<_>>>()?;
        // The result's row dim is ragged where A's row dim was, its column dim where
        // B's column dim was, even if the lengths of this batch happen to agree.
        let products_rank = products.first().map_or(0, Tensor::dim);
        let mut forced: Vec<usize> = Vec::new();
        if products_rank >= 2 {
            if self.lay().is_ragged(self.lay().rank().saturating_sub(2)) {
                forced.push(products_rank - 2);
            }
            if other.lay().is_ragged(other.lay().rank().saturating_sub(1)) {
                forced.push(products_rank - 1);
            }
        }
        NestedTensor::builder()
            .options(self.options())
            .ragged_dims(&forced)
            .tensors(&products)
    }

    /// Rows of `weight` gathered at the (integer) values: `[*s_i] -> [*s_i, D]`, one
    /// packed gather. `padding_idx` rows get no gradient (as in torch; `-1` for none).
    pub fn embedding(&self, weight: &Tensor, padding_idx: i64) -> Result<NestedTensor> {
        let output = Tensor::f_embedding(weight, self.packed(), padding_idx, false, false)?;
        let width = *weight.size().last().unwrap_or(&0);
        let layout = self.lay().with_static_dim(self.lay().rank(), width)?;
        let args = [Arg::Nested(self), Arg::Dense(weight, None)];
        NestedTensor::from_parts(output, layout, self.options()).traced(&args, "embedding", |ids| {
            Op::Embedding {
                ids: ids[0],
                weight: ids[1],
                padding_idx,
            }
        })
    }

    /// The width of the last element dim, which must be static.
    pub(crate) fn last_static_width(&self, op: &'static str) -> Result<i64> {
        let layout = self.lay();
        let rank = layout.rank();
        if rank == 0 || layout.is_ragged(rank - 1) {
            return Err(NestedError::Unsupported {
                op,
                reason: format!(
                    "the last dim must be static (ragged dims: {:?}, rank {rank})",
                    layout.ragged_dims()
                ),
            });
        }
        Ok(*layout.static_sizes().last().unwrap_or(&0))
    }

    /// Values whose last static dim changed width.
    pub(crate) fn with_last_static_width(
        &self,
        values: Tensor,
        width: i64,
    ) -> Result<NestedTensor> {
        let layout = self.lay().with_static_size(self.lay().rank() - 1, width)?;
        Ok(NestedTensor::from_parts(values, layout, self.options()))
    }
}
