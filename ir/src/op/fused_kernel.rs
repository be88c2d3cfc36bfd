//! The hand-written parts of the two ops that nest another (`#[op(custom)]`): a
//! `prologue` reads the pointwise expression's inputs, then its core's operands but the
//! first (the expression stands for it); an `epilogue` reads its core's operands, then
//! the expression's other inputs. Their attributes are the expression, the number of
//! its inputs, the core's name and the core's own attributes.

use super::{Attr, Op, Parts};
use crate::ValueId;

impl Op {
    /// The operands of a fused kernel.
    pub(super) fn custom_operands(&self) -> Vec<ValueId> {
        match self {
            Op::Prologue { inputs, core, .. } => {
                [inputs.clone(), core.operands().split_off(1)].concat()
            }
            Op::Epilogue { core, inputs, .. } => [core.operands(), inputs.clone()].concat(),
            _ => Vec::new(),
        }
    }

    /// Maps the operands of a fused kernel in place.
    pub(super) fn custom_map_operands(&mut self, f: &mut dyn FnMut(ValueId) -> ValueId) {
        match self {
            Op::Prologue { inputs, core, .. } => {
                inputs.iter_mut().for_each(|value| *value = f(*value));
                // The core's first operand is the expression, not a value: kept.
                let mut first = true;
                core.map_operands_in_place(&mut |operand| {
                    if std::mem::take(&mut first) {
                        operand
                    } else {
                        f(operand)
                    }
                });
            }
            Op::Epilogue { core, inputs, .. } => {
                core.map_operands_in_place(f);
                inputs.iter_mut().for_each(|value| *value = f(*value));
            }
            _ => {}
        }
    }

    /// The attributes of a fused kernel.
    pub(super) fn custom_attrs(&self) -> Vec<(&'static str, Attr)> {
        match self {
            Op::Prologue { inputs, expr, core } | Op::Epilogue { core, inputs, expr } => [
                vec![
                    ("expr", Attr::Str(expr.to_string())),
                    // Input counts are far below `i64::MAX`.
                    ("inputs", Attr::Int(inputs.len() as i64)),
                    ("core", Attr::Word(core.name().to_owned())),
                ],
                core.attrs(),
            ]
            .concat(),
            _ => Vec::new(),
        }
    }

    /// Rebuilds a fused kernel from its text-form parts.
    pub(super) fn custom_from_parts(parts: &mut Parts<'_>) -> Result<Op, String> {
        let name = parts.name;
        let expr = crate::FusedExpr::parse(parts.string("expr")?)
            .map_err(|error| format!("{name}: {error}"))?;
        let operands = parts.rest();
        let count = usize::try_from(parts.int("inputs")?)
            .ok()
            .filter(|&count| count <= operands.len())
            .ok_or_else(|| format!("{name}: inputs must be 0..={}", operands.len()))?;
        let core_name = parts.word("core")?;
        let core = |operands: &[ValueId]| {
            Op::from_parts(core_name, operands, parts.attrs(), None).map(Box::new)
        };
        if name == "prologue" {
            // The core's first operand is the expression (`%0` stands for it).
            let core_operands = [&[ValueId(0)], &operands[count..]].concat();
            Ok(Op::Prologue {
                inputs: operands[..count].to_vec(),
                expr,
                core: core(&core_operands)?,
            })
        } else {
            let split = operands.len() - count;
            Ok(Op::Epilogue {
                core: core(&operands[..split])?,
                inputs: operands[split..].to_vec(),
                expr,
            })
        }
    }
}
