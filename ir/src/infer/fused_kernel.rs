//! Fused kernels: a row or segmented op reading a pointwise prologue, a GEMM writing through a pointwise epilogue.

use super::*;

/// The type of a fused kernel op in `graph`, or why it is ill-typed.
pub(super) fn infer(graph: &Graph, op: &Op) -> Inferred {
    let ty = |value: ValueId| graph.ty(value).clone();
    match op {
        Op::Prologue { inputs, expr, core } => {
            if !fusable_core(core, true) {
                return Err(format!("{} cannot take a prologue", core.name()));
            }
            let types: Vec<Type> = inputs.iter().map(|&input| ty(input)).collect();
            let input = infer_fused(expr, &types)?;
            let others = core.operands().into_iter().skip(1).map(ty);
            infer_over(core, std::iter::once(input).chain(others).collect())
        }
        Op::Epilogue { core, inputs, expr } => {
            if !fusable_core(core, false) {
                return Err(format!("{} cannot take an epilogue", core.name()));
            }
            let result = infer_type(graph, core)?;
            let types: Vec<Type> = std::iter::once(result.clone())
                .chain(inputs.iter().map(|&input| ty(input)))
                .collect();
            let output = infer_fused(expr, &types)?;
            // Computed in place over the core's result: the same elements.
            if output.with_dtype(DType::F32) != result.with_dtype(DType::F32) {
                return Err(format!(
                    "the epilogue gives {output}, not the shape of the {} result {result}",
                    core.name()
                ));
            }
            Ok(output)
        }
        other => Err(format!("{} is not a fused kernel op", other.name())),
    }
}

/// Whether `core` may be the core of a fused kernel: of a prologue (row and segmented
/// ops) or of an epilogue (GEMMs).
fn fusable_core(core: &Op, prologue: bool) -> bool {
    match core {
        Op::LayerNorm { .. } | Op::RmsNorm { .. } | Op::Softmax { .. } => prologue,
        Op::Reduce { op, dims, .. } => {
            prologue
                && dims.len() == 1
                && matches!(
                    op,
                    ReduceOp::Sum | ReduceOp::Mean | ReduceOp::Amax | ReduceOp::Amin
                )
        }
        Op::Linear { .. } | Op::Matmul { .. } => !prologue,
        _ => false,
    }
}

/// The type `op` gives when its operands, in order, have `types`.
fn infer_over(op: &Op, types: Vec<Type>) -> Inferred {
    let mut scratch = Graph::new("");
    scratch.nodes = types
        .into_iter()
        .map(|ty| crate::Node {
            op: Op::Input {
                name: String::new(),
            },
            ty,
        })
        .collect();
    let operands: Vec<ValueId> = (0..scratch.nodes.len() as u32).map(ValueId).collect();
    let op = op
        .with_operands(&operands)
        .ok_or_else(|| format!("{} takes other operands", op.name()))?;
    infer_type(&scratch, &op)
}
