//! Fused elementwise expressions: the body of a `fused` op, a tree over the op's
//! inputs, printed as an s-expression (`(add (gelu $0) (const 0.5 f32))`).

use std::fmt;

use crate::{BinaryOp, DType, UnaryOp, F64};

/// An elementwise expression over the inputs of a `fused` op.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FusedExpr {
    /// Input number `n` of the op.
    Input(usize),
    /// A 0-d constant.
    Const {
        /// Its value.
        value: F64,
        /// Its element type.
        dtype: DType,
    },
    /// A unary function.
    Unary(UnaryOp, Box<FusedExpr>),
    /// A binary function.
    Binary(BinaryOp, Box<FusedExpr>, Box<FusedExpr>),
    /// `condition ? x : y`.
    Where(Box<FusedExpr>, Box<FusedExpr>, Box<FusedExpr>),
    /// A conversion of the element type.
    Cast(DType, Box<FusedExpr>),
}

impl FusedExpr {
    /// The number of operations in the expression (inputs and constants excluded).
    pub fn operations(&self) -> usize {
        match self {
            FusedExpr::Input(_) | FusedExpr::Const { .. } => 0,
            FusedExpr::Unary(_, x) | FusedExpr::Cast(_, x) => 1 + x.operations(),
            FusedExpr::Binary(_, a, b) => 1 + a.operations() + b.operations(),
            FusedExpr::Where(c, a, b) => 1 + c.operations() + a.operations() + b.operations(),
        }
    }

    /// Reads the s-expression form written by `Display`.
    pub fn parse(text: &str) -> Result<FusedExpr, String> {
        let tokens: Vec<String> = text
            .replace('(', " ( ")
            .replace(')', " ) ")
            .split_whitespace()
            .map(str::to_owned)
            .collect();
        // Nesting is checked before the recursive descent, so a deep text is an error
        // rather than a stack overflow.
        let mut depth = 0usize;
        for token in &tokens {
            match token.as_str() {
                "(" => depth += 1,
                ")" => depth = depth.saturating_sub(1),
                _ => {}
            }
            if depth > MAX_DEPTH {
                return Err(format!(
                    "the expression nests deeper than {MAX_DEPTH} levels"
                ));
            }
        }
        let mut position = 0;
        let expr = parse_expr(&tokens, &mut position)?;
        if position != tokens.len() {
            return Err(format!(
                "unexpected {:?} after the expression",
                tokens[position]
            ));
        }
        Ok(expr)
    }
}

/// How deep a fused expression's text may nest (fusion builds far shallower ones).
pub const MAX_DEPTH: usize = 256;

fn parse_expr(tokens: &[String], position: &mut usize) -> Result<FusedExpr, String> {
    let next = |position: &mut usize| -> Result<String, String> {
        let token = tokens
            .get(*position)
            .cloned()
            .ok_or("unexpected end of expression")?;
        *position += 1;
        Ok(token)
    };
    let token = next(position)?;
    if let Some(index) = token.strip_prefix('$') {
        return index
            .parse()
            .map(FusedExpr::Input)
            .map_err(|_| format!("bad input {token}"));
    }
    if token != "(" {
        return Err(format!("expected ( or $n, got {token}"));
    }
    let head = next(position)?;
    let expr = match head.as_str() {
        "const" => {
            let value = next(position)?;
            let value: f64 = value.parse().map_err(|_| format!("bad constant {value}"))?;
            let dtype = next(position)?;
            let dtype = DType::from_name(&dtype).ok_or(format!("unknown dtype {dtype}"))?;
            FusedExpr::Const {
                value: F64(value),
                dtype,
            }
        }
        "where" => {
            let condition = parse_expr(tokens, position)?;
            let x = parse_expr(tokens, position)?;
            let y = parse_expr(tokens, position)?;
            FusedExpr::Where(Box::new(condition), Box::new(x), Box::new(y))
        }
        "cast" => {
            let dtype = next(position)?;
            let dtype = DType::from_name(&dtype).ok_or(format!("unknown dtype {dtype}"))?;
            FusedExpr::Cast(dtype, Box::new(parse_expr(tokens, position)?))
        }
        word => {
            if let Some(op) = UnaryOp::from_word(word) {
                FusedExpr::Unary(op, Box::new(parse_expr(tokens, position)?))
            } else if let Some(op) = BinaryOp::from_word(word) {
                let a = parse_expr(tokens, position)?;
                let b = parse_expr(tokens, position)?;
                FusedExpr::Binary(op, Box::new(a), Box::new(b))
            } else {
                return Err(format!("unknown function {word}"));
            }
        }
    };
    let close = next(position)?;
    if close != ")" {
        return Err(format!("expected ), got {close}"));
    }
    Ok(expr)
}

impl fmt::Display for FusedExpr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FusedExpr::Input(index) => write!(f, "${index}"),
            FusedExpr::Const { value, dtype } => write!(f, "(const {:?} {dtype})", value.0),
            FusedExpr::Unary(op, x) => write!(f, "({} {x})", op.word()),
            FusedExpr::Binary(op, a, b) => write!(f, "({} {a} {b})", op.word()),
            FusedExpr::Where(c, a, b) => write!(f, "(where {c} {a} {b})"),
            FusedExpr::Cast(dtype, x) => write!(f, "(cast {dtype} {x})"),
        }
    }
}
