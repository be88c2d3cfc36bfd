//! Fused kernels: a prologue becomes a row or segmented kernel reading its expression, an epilogue a GEMM whose rows go through its expression.

use super::*;

impl Lowering<'_> {
    /// Lowers a fused kernel op.
    pub(super) fn lower_fused_kernel(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        match op {
            Op::Prologue { inputs, expr, core } => {
                let types: Vec<Type> = inputs
                    .iter()
                    .map(|&input| self.graph.ty(input).clone())
                    .collect();
                let input_ty = nestor_ir::fused_type(expr, &types)
                    .map_err(|reason| unsupported(value, op, reason))?;
                let input =
                    self.pointwise(value, &input_ty, inputs, |loads| translate(expr, loads))?;
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
                let operands: Vec<ValueId> = std::iter::once(value)
                    .chain(inputs.iter().copied())
                    .collect();
                let out = self.pointwise(value, ty, &operands, |loads| translate(expr, loads))?;
                crate::fold::fold_epilogue(&mut self.program);
                Ok(out)
            }
            other => Err(unsupported(value, other, "not lowered yet")),
        }
    }

    /// A pointwise step computing `build(loads)` over `operands` broadcast to `ty`.
    /// `core` with its operand `position` reading `value` instead.
    pub(super) fn core_reading(
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
}
