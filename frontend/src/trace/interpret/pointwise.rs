//! Pointwise ops: constants, unary and binary functions, `where`, casts, dropout, fused expressions.

use super::*;

impl Interpreter<'_> {
    /// Runs a pointwise op.
    pub(super) fn run_pointwise(&self, op: &Op) -> Result<Value> {
        Ok(match op {
            Op::Const { value, dtype } => Value::Dense(
                Tensor::f_scalar_tensor(value.0, (Kind::Double, tch::Device::Cpu))?
                    .f_to_kind(kind_of(*dtype))?,
            ),
            Op::Unary { op, x } => unary_value(*op, self.get(*x))?,
            Op::Binary { op, lhs, rhs } => binary_value(*op, self.get(*lhs), self.get(*rhs))?,
            Op::Where { condition, x, y } => {
                where_value(self.get(*condition), self.get(*x), self.get(*y))?
            }
            Op::Cast { x, dtype } => cast_value(*dtype, self.get(*x))?,
            Op::Fused { inputs, expr } => {
                let inputs: Vec<&Value> = inputs.iter().map(|&input| self.get(input)).collect();
                fused_value(expr, &inputs)?
            }
            Op::Dropout { x, p, train } => match self.get(*x) {
                Value::Nested(nested) => Value::Nested(nested.dropout(p.0, *train)?),
                _ => Value::Dense(self.dense(*x)?.f_dropout(p.0, *train)?),
            },
            other => return Err(not_in_family(other, "pointwise")),
        })
    }
}
