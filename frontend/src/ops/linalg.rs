//! Linear algebra on every element's square matrices (`[*, n_i, n_i]`): `det`,
//! `inverse`, `solve`, `cholesky`, `qr`, `svd`, `eigh`. Elements are grouped by shape
//! and every group runs as one batched libtorch call on its stacked elements, so a
//! batch of equal shapes is a single call; the results are packed back in order.

use tch::Tensor;

use crate::guard::{slow_path, SlowPath};
use crate::ops::Reduced;
use crate::trace::Dense;
use crate::{NestedError, NestedTensor, Result};

/// The shape an output of a linear-algebra operator has in each element, relative to
/// the input's `[*, n, n]`.
#[derive(Clone, Copy)]
enum Output {
    /// `[*, n, n]` (or the right-hand side's `[*, n, k]`).
    Matrix,
    /// `[*, n]`: singular values, eigenvalues.
    Vector,
}

impl NestedTensor {
    /// The determinant of every element's matrices: `[B, *]`, dense unless leading
    /// dims are ragged.
    ///
    /// ```
    /// use nestor_frontend::NestedTensor;
    /// use tch::{Kind, Tensor};
    /// let a = Tensor::from_slice(&[2.0f64, 0.0, 0.0, 3.0]).reshape([2, 2]);
    /// let b = Tensor::from_slice(&[5.0f64]).reshape([1, 1]);
    /// let batch = NestedTensor::from_tensors(&[a, b])?;
    /// let det = batch.det()?.into_dense()?;
    /// assert_eq!(Vec::<f64>::try_from(&det)?, [6.0, 5.0]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn det(&self) -> Result<Reduced> {
        let [det] = self.square_op("det", &[], |a, _| Ok(vec![Tensor::f_linalg_det(a)?]))?;
        let rank = self.lay().rank();
        let ragged = self.ragged_below(rank - 2);
        if ragged.is_empty() {
            let stacked = if det.is_empty() {
                Tensor::f_empty([0], (self.kind(), self.device()))?
            } else {
                Tensor::f_stack(&det, 0)?
            };
            return Ok(Reduced::Dense(Dense::from(stacked)));
        }
        Ok(Reduced::Nested(self.packed_results("det", &det, &ragged)?))
    }

    /// The inverse of every element's matrices.
    pub fn inverse(&self) -> Result<NestedTensor> {
        let [inverse] =
            self.square_op("inverse", &[], |a, _| Ok(vec![Tensor::f_linalg_inv(a)?]))?;
        self.output("inverse", &inverse, Output::Matrix)
    }

    /// The Cholesky factor of every element's matrices (lower, or upper when `upper`).
    pub fn cholesky(&self, upper: bool) -> Result<NestedTensor> {
        let [factor] = self.square_op("cholesky", &[], |a, _| {
            Ok(vec![a.f_linalg_cholesky(upper)?])
        })?;
        self.output("cholesky", &factor, Output::Matrix)
    }

    /// `X` with `A_i X_i = B_i` for every element: `self` holds the `[*, n, n]`
    /// matrices, `rhs` the `[*, n, k]` right-hand sides (same batch size).
    pub fn solve(&self, rhs: &NestedTensor) -> Result<NestedTensor> {
        if rhs.batch_size() != self.batch_size() {
            return Err(NestedError::BatchSizeMismatch {
                op: "solve",
                what: "the right-hand side",
                got: rhs.batch_size(),
                expected: self.batch_size(),
            });
        }
        let [solution] = self.square_op("solve", &rhs.elements()?, |a, b| {
            Ok(vec![Tensor::f_linalg_solve(a, b.unwrap_or(a), true)?])
        })?;
        rhs.output("solve", &solution, Output::Matrix)
    }

    /// The reduced QR decomposition of every element's matrices: `(Q, R)`.
    pub fn qr(&self) -> Result<(NestedTensor, NestedTensor)> {
        let [q, r] = self.square_op("qr", &[], |a, _| {
            let (q, r) = Tensor::f_linalg_qr(a, "reduced")?;
            Ok(vec![q, r])
        })?;
        Ok((
            self.output("qr", &q, Output::Matrix)?,
            self.output("qr", &r, Output::Matrix)?,
        ))
    }

    /// The singular value decomposition of every element's matrices: `(U, S, Vh)`.
    pub fn svd(&self) -> Result<(NestedTensor, NestedTensor, NestedTensor)> {
        let [u, s, vh] = self.square_op("svd", &[], |a, _| {
            // torch.svd: linalg_svd's `driver` cannot be left out through tch, and
            // any driver is an error on the CPU.
            let (u, s, v) = a.f_svd(true, true)?;
            Ok(vec![u, s, v.f_transpose(-2, -1)?])
        })?;
        Ok((
            self.output("svd", &u, Output::Matrix)?,
            self.output("svd", &s, Output::Vector)?,
            self.output("svd", &vh, Output::Matrix)?,
        ))
    }

    /// The eigenvalues (ascending) and eigenvectors of every element's symmetric
    /// matrices (read from the lower triangle).
    pub fn eigh(&self) -> Result<(NestedTensor, NestedTensor)> {
        let [values, vectors] = self.square_op("eigh", &[], |a, _| {
            let (values, vectors) = a.f_linalg_eigh("L")?;
            Ok(vec![values, vectors])
        })?;
        Ok((
            self.output("eigh", &values, Output::Vector)?,
            self.output("eigh", &vectors, Output::Matrix)?,
        ))
    }

    /// Runs `op` on the elements grouped by shape (and by the shape of `with`'s
    /// element, when given): one batched call per group of stacked elements (more than
    /// one group is a per-element slow path, which the execution guard refuses).
    /// Returns every output's per-element results in batch order.
    fn square_op<const N: usize>(
        &self,
        op: &'static str,
        with: &[Tensor],
        run: impl Fn(&Tensor, Option<&Tensor>) -> Result<Vec<Tensor>>,
    ) -> Result<[Vec<Tensor>; N]> {
        self.untraceable(op)?;
        let rank = self.lay().rank();
        let sizes = self.lay().element_sizes();
        if rank < 2 {
            return Err(NestedError::Unsupported {
                op,
                reason: format!("elements of rank {rank}; square matrices need rank 2 or more"),
            });
        }
        if let Some(element) = sizes.iter().position(|s| s[rank - 1] != s[rank - 2]) {
            return Err(NestedError::Unsupported {
                op,
                reason: format!(
                    "element {element} has shape {:?}, not square",
                    sizes[element]
                ),
            });
        }
        let elements = self.elements()?;
        // Groups of equal shapes (of both operands), in order of first appearance.
        let mut groups: Vec<(Vec<i64>, Vec<usize>)> = Vec::new();
        for (element, tensor) in elements.iter().enumerate() {
            let mut key = tensor.size();
            key.extend(with.get(element).map(Tensor::size).unwrap_or_default());
            match groups.iter_mut().find(|(shape, _)| *shape == key) {
                Some((_, members)) => members.push(element),
                None => groups.push((key, vec![element])),
            }
        }
        if groups.len() > 1 {
            // A call per shape: a loop over the elements' shapes.
            slow_path(SlowPath::PerElement, op)?;
        }
        let mut outputs: [Vec<Option<Tensor>>; N] =
            std::array::from_fn(|_| (0..elements.len()).map(|_| None).collect());
        for (_, members) in &groups {
            let stack = |tensors: &[Tensor]| -> Result<Tensor> {
                let picked: Vec<Tensor> = members
                    .iter()
                    .map(|&e| tensors[e].shallow_clone())
                    .collect();
                Ok(Tensor::f_stack(&picked, 0)?)
            };
            let other = if with.is_empty() {
                None
            } else {
                Some(stack(with)?)
            };
            let results = run(&stack(&elements)?, other.as_ref())?;
            for (output, result) in outputs.iter_mut().zip(results) {
                for (position, result) in result.f_unbind(0)?.into_iter().enumerate() {
                    output[members[position]] = Some(result);
                }
            }
        }
        let mut done: [Vec<Tensor>; N] = std::array::from_fn(|_| Vec::new());
        for (done, output) in done.iter_mut().zip(outputs) {
            *done = output.into_iter().flatten().collect();
        }
        Ok(done)
    }

    /// The input's ragged dims below `rank` (those an output of that rank keeps).
    fn ragged_below(&self, rank: usize) -> Vec<usize> {
        self.lay()
            .ragged_dims()
            .iter()
            .copied()
            .filter(|&d| d < rank)
            .collect()
    }

    /// Per-element results of one output packed, with this batch's ragged dims where the
    /// output has them.
    fn output(&self, op: &'static str, results: &[Tensor], output: Output) -> Result<NestedTensor> {
        let rank = self.lay().rank();
        let ragged = match output {
            Output::Matrix => self.lay().ragged_dims().to_vec(),
            Output::Vector => {
                let mut ragged = self.ragged_below(rank - 2);
                if self.lay().is_ragged(rank - 2) || self.lay().is_ragged(rank - 1) {
                    ragged.push(rank - 2);
                }
                ragged
            }
        };
        self.packed_results(op, results, &ragged)
    }

    fn packed_results(
        &self,
        op: &'static str,
        results: &[Tensor],
        ragged: &[usize],
    ) -> Result<NestedTensor> {
        if results.len() != self.batch_size() {
            return Err(NestedError::Unsupported {
                op,
                reason: "an output is missing for some element".into(),
            });
        }
        NestedTensor::builder()
            .options(self.options())
            .ragged_dims(ragged)
            .tensors(results)
    }
}
