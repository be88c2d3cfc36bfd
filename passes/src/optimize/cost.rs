//! The cost model of extraction: kernel launches, bytes read and written, and FLOPs,
//! at nominal sizes (lengths are symbolic, so every ragged dim counts as
//! [`NOMINAL_LENGTH`] rows and every batch as [`NOMINAL_BATCH`] elements). Per-element
//! fallbacks and padding copies are priced high, so a packed path always wins.

use egg::{CostFunction, Id, Language};
use nestor_ir::{Dim, ElemDim, Op, Type};

use super::egraph::{EGraph, ENode};

/// The length a ragged dim counts for.
pub const NOMINAL_LENGTH: f64 = 64.0;
/// The batch size a symbolic batch counts for.
pub const NOMINAL_BATCH: f64 = 16.0;
/// One kernel launch, in bytes moved (a few microseconds of a core).
const LAUNCH: f64 = 32_768.0;
/// FLOPs per byte-equivalent of cost (a core does tens of FLOPs per byte it moves).
const FLOPS_PER_BYTE: f64 = 16.0;
/// The extra price of a padding copy (it touches `B x max(L)` rows).
const PAD_PENALTY: f64 = 4.0 * LAUNCH;
/// The extra price of one element of a per-element fallback (a libtorch call).
const PER_ELEMENT_CALL: f64 = 8.0 * LAUNCH;

/// Scalars in a value of type `ty` at nominal sizes (0 for lengths).
pub fn scalars(ty: &Type) -> f64 {
    let dim = |dim: &Dim| match dim {
        Dim::Static(size) => *size as f64,
        Dim::Sym(_) => NOMINAL_BATCH,
        Dim::Max(_) => NOMINAL_LENGTH,
    };
    match ty {
        Type::Dense { shape, .. } => shape.iter().map(dim).product(),
        Type::Ragged { batch, dims, .. } => {
            dim(batch)
                * dims
                    .iter()
                    .map(|elem| match elem {
                        ElemDim::Fixed(size) => dim(size),
                        ElemDim::Ragged(_) => NOMINAL_LENGTH,
                    })
                    .product::<f64>()
        }
        Type::Lengths { .. } => 0.0,
    }
}

/// Bytes of a value of type `ty` at nominal sizes.
fn bytes(ty: &Type) -> f64 {
    scalars(ty) * ty.dtype().map_or(0, |dtype| dtype.size_in_bytes()) as f64
}

/// The cost of what a node does itself (its children not counted).
pub struct KernelCost<'a> {
    egraph: &'a EGraph,
}

impl<'a> KernelCost<'a> {
    /// The cost model over `egraph`'s types.
    pub fn new(egraph: &'a EGraph) -> Self {
        Self { egraph }
    }

    fn ty(&self, class: Id) -> Option<&Type> {
        self.egraph[class].data.as_ref()
    }

    /// The cost of `node` alone.
    pub fn node_cost(&self, node: &ENode) -> f64 {
        let output_ty = self
            .egraph
            .lookup(node.clone())
            .and_then(|class| self.ty(class));
        let output = output_ty.map_or(0.0, bytes);
        let read: f64 = node
            .operands()
            .iter()
            .filter_map(|&child| self.ty(child))
            .map(bytes)
            .sum();
        let moved = read + output;
        match &node.op {
            Op::Input { .. } | Op::Param { .. } | Op::Const { .. } => 0.0,
            // Views: no kernel, no copy.
            Op::ReshapeTail { .. }
            | Op::Reshape { .. }
            | Op::TransposeRagged { .. }
            | Op::Unsqueeze { .. }
            | Op::MatchLengths { .. }
            | Op::Dropout { train: false, .. } => 1.0,
            // Host arithmetic on lengths.
            Op::MaxLength { .. }
            | Op::TotalLength { .. }
            | Op::RepeatLengths { .. }
            | Op::ConstantLengths { .. }
            | Op::SliceLengths { .. }
            | Op::WindowLengths { .. } => 1.0,
            Op::Pad { .. } | Op::Unpad { .. } | Op::Mask { .. } => LAUNCH + PAD_PENALTY + moved,
            Op::PerElement { body, .. } => {
                NOMINAL_BATCH * (PER_ELEMENT_CALL + LAUNCH * body.nodes.len() as f64) + moved
            }
            Op::Linear { .. } | Op::Matmul { .. } | Op::Epilogue { .. } => {
                let k = node
                    .operands()
                    .first()
                    .and_then(|&x| self.ty(x))
                    .and_then(last_dim)
                    .unwrap_or(1.0);
                let out_scalars = output_ty.map_or(0.0, scalars);
                LAUNCH + moved + 2.0 * k * out_scalars / FLOPS_PER_BYTE
            }
            Op::Fused { expr, .. } => {
                let out_scalars = output_ty.map_or(0.0, scalars);
                LAUNCH + moved + expr.operations() as f64 * out_scalars / FLOPS_PER_BYTE
            }
            _ => LAUNCH + moved,
        }
    }
}

/// The size of the last dim of a value, when static.
fn last_dim(ty: &Type) -> Option<f64> {
    match ty {
        Type::Dense { shape, .. } => shape.last().and_then(Dim::as_static),
        Type::Ragged { dims, .. } => match dims.last() {
            Some(ElemDim::Fixed(dim)) => dim.as_static(),
            _ => None,
        },
        Type::Lengths { .. } => None,
    }
    .map(|size| size as f64)
}

impl CostFunction<ENode> for KernelCost<'_> {
    type Cost = f64;

    fn cost<C>(&mut self, enode: &ENode, mut costs: C) -> f64
    where
        C: FnMut(Id) -> f64,
    {
        // Shared operands count once per reader (a tree cost): equal for the
        // alternatives of a class, which is what extraction compares.
        enode.fold(self.node_cost(enode), |sum, child| sum + costs(child))
    }
}
