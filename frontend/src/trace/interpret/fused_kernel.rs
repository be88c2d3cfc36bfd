//! Fused kernels: the core op run on the prologue expression's value, or the epilogue expression run on the core's result.

use super::*;

impl Interpreter<'_> {
    /// Runs a fused kernel op.
    pub(super) fn run_fused_kernel(&mut self, value: ValueId, op: &Op, ty: &Type) -> Result<Value> {
        Ok(match op {
            Op::Prologue { inputs, expr, core } => {
                let inputs: Vec<&Value> = inputs.iter().map(|&input| self.get(input)).collect();
                let input = fused_value(expr, &inputs)?;
                // The core reads the expression's value as this op's own (not yet
                // defined) value.
                let mut operands = core.operands();
                operands[0] = value;
                let core =
                    core.with_operands(&operands)
                        .ok_or_else(|| NestedError::Unsupported {
                            op: "prologue",
                            reason: format!("{value}: its core takes other operands"),
                        })?;
                self.values.push(input);
                let result = self.run(value, &core, ty);
                self.values.pop();
                result?
            }
            Op::Epilogue { core, inputs, expr } => {
                let core_ty =
                    self.graph
                        .type_of(core)
                        .map_err(|error| NestedError::Unsupported {
                            op: "epilogue",
                            reason: error.to_string(),
                        })?;
                let result = self.run(value, core, &core_ty)?;
                let operands: Vec<&Value> = std::iter::once(&result)
                    .chain(inputs.iter().map(|&input| self.get(input)))
                    .collect();
                fused_value(expr, &operands)?
            }
            other => return Err(not_in_family(other, "fused kernel")),
        })
    }
}
