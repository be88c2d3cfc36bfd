//! What an op's field is to the text form, decided by its type: [`OpField`] says whether
//! a field is operands (`ValueId`, `Option<ValueId>`, `Vec<ValueId>`), an attribute
//! (numbers, words, strings, lists, a fused expression) or the body of a region, and
//! [`OpKind`] names ops after a field (`unary` ops are named by their function).
//! `#[derive(OpTable)]` (in `nestor-ir-derive`) calls these for every field of every op.

use crate::{
    AttentionGradPart, Attr, DType, FusedExpr, Graph, LossReduction, NormGradPart, ValueId, F64,
};

/// How many operands a field reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    /// None: an attribute or a body.
    None,
    /// Exactly one.
    One,
    /// One when the op has it (optional operands come last).
    Optional,
    /// All that are left.
    Rest,
}

/// The text-form parts of one op, read field by field while it is rebuilt.
pub struct Parts<'a> {
    /// The op's name.
    pub name: &'a str,
    operands: &'a [ValueId],
    next: usize,
    attrs: &'a [(String, Attr)],
    body: Option<Graph>,
}

impl<'a> Parts<'a> {
    /// The parts as the parser found them.
    pub fn new(
        name: &'a str,
        operands: &'a [ValueId],
        attrs: &'a [(String, Attr)],
        body: Option<Graph>,
    ) -> Self {
        Self {
            name,
            operands,
            next: 0,
            attrs,
            body,
        }
    }

    /// Checks the number of operands against the fields' arities.
    pub fn check_arity(&self, fields: &[Arity]) -> Result<(), String> {
        let least = fields.iter().filter(|&&arity| arity == Arity::One).count();
        let got = self.operands.len();
        if fields.contains(&Arity::Rest) {
            return if got >= least {
                Ok(())
            } else {
                Err(format!(
                    "{} takes at least {least} operands, got {got}",
                    self.name
                ))
            };
        }
        let most = least + fields.iter().filter(|&&a| a == Arity::Optional).count();
        if (least..=most).contains(&got) {
            Ok(())
        } else {
            let expected: Vec<usize> = (least..=most).collect();
            Err(format!(
                "{} takes {expected:?} operands, got {got}",
                self.name
            ))
        }
    }

    /// The next operand, if any is left.
    pub fn next_operand(&mut self) -> Option<ValueId> {
        let operand = self.operands.get(self.next).copied();
        self.next += usize::from(operand.is_some());
        operand
    }

    /// The operands not read yet.
    pub fn rest(&mut self) -> Vec<ValueId> {
        let rest = self.operands.get(self.next..).unwrap_or_default().to_vec();
        self.next = self.operands.len();
        rest
    }

    /// The attribute `key`, if present.
    pub fn attr(&self, key: &str) -> Option<&'a Attr> {
        self.attrs
            .iter()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value)
    }

    /// All attributes (fused kernels hand them to their core).
    pub fn attrs(&self) -> &'a [(String, Attr)] {
        self.attrs
    }

    /// The error for attribute `key` that is not `expected`.
    pub fn bad_attr(&self, key: &str, expected: &str) -> String {
        format!(
            "{}: attribute {key} must be {expected}, got {:?}",
            self.name,
            self.attr(key)
        )
    }

    /// The word attribute `key`.
    pub fn word(&self, key: &str) -> Result<&'a str, String> {
        match self.attr(key) {
            Some(Attr::Word(word)) => Ok(word),
            _ => Err(self.bad_attr(key, "a word")),
        }
    }

    /// The string attribute `key`.
    pub fn string(&self, key: &str) -> Result<&'a str, String> {
        match self.attr(key) {
            Some(Attr::Str(text)) => Ok(text),
            _ => Err(self.bad_attr(key, "a string")),
        }
    }

    /// The integer attribute `key`.
    pub fn int(&self, key: &str) -> Result<i64, String> {
        match self.attr(key) {
            Some(Attr::Int(value)) => Ok(*value),
            _ => Err(self.bad_attr(key, "an integer")),
        }
    }
}

/// A field of an op: its operands, its attribute, and how to read it back.
pub trait OpField: Sized {
    /// How many operands the field reads.
    const ARITY: Arity = Arity::None;

    /// Appends the field's operands.
    fn push_operands(&self, _out: &mut Vec<ValueId>) {}

    /// Maps the field's operands in place.
    fn map_operands(&mut self, _f: &mut dyn FnMut(ValueId) -> ValueId) {}

    /// The field as an attribute of the text form (`None`: not an attribute, or absent).
    fn to_attr(&self) -> Option<Attr> {
        None
    }

    /// Reads the field (named `key`) back from the parts.
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String>;
}

/// A type whose values name ops (the function of a `unary` op names it).
pub trait OpKind: Sized + Copy {
    /// The op name of this kind.
    fn op_name(self) -> &'static str;
    /// The kind an op name stands for.
    fn from_op_name(name: &str) -> Option<Self>;
}

impl OpField for ValueId {
    const ARITY: Arity = Arity::One;
    fn push_operands(&self, out: &mut Vec<ValueId>) {
        out.push(*self);
    }
    fn map_operands(&mut self, f: &mut dyn FnMut(ValueId) -> ValueId) {
        *self = f(*self);
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        parts
            .next_operand()
            .ok_or_else(|| format!("{}: operand {key} is missing", parts.name))
    }
}

impl OpField for Option<ValueId> {
    const ARITY: Arity = Arity::Optional;
    fn push_operands(&self, out: &mut Vec<ValueId>) {
        out.extend(self);
    }
    fn map_operands(&mut self, f: &mut dyn FnMut(ValueId) -> ValueId) {
        if let Some(value) = self {
            *value = f(*value);
        }
    }
    fn parse(_key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        Ok(parts.next_operand())
    }
}

impl OpField for Vec<ValueId> {
    const ARITY: Arity = Arity::Rest;
    fn push_operands(&self, out: &mut Vec<ValueId>) {
        out.extend(self);
    }
    fn map_operands(&mut self, f: &mut dyn FnMut(ValueId) -> ValueId) {
        self.iter_mut().for_each(|value| *value = f(*value));
    }
    fn parse(_key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        Ok(parts.rest())
    }
}

impl OpField for Box<Graph> {
    fn parse(_key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        parts
            .body
            .take()
            .map(Box::new)
            .ok_or_else(|| format!("{} needs a body", parts.name))
    }
}

impl OpField for String {
    fn to_attr(&self) -> Option<Attr> {
        Some(Attr::Str(self.clone()))
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        parts.string(key).map(str::to_owned)
    }
}

impl OpField for i64 {
    fn to_attr(&self) -> Option<Attr> {
        Some(Attr::Int(*self))
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        parts.int(key)
    }
}

impl OpField for usize {
    fn to_attr(&self) -> Option<Attr> {
        // Dims of a graph's types are far below `i64::MAX`; saturating keeps printing total.
        Some(Attr::Int(i64::try_from(*self).unwrap_or(i64::MAX)))
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        usize::try_from(parts.int(key)?).map_err(|_| parts.bad_attr(key, "a non-negative integer"))
    }
}

impl OpField for bool {
    fn to_attr(&self) -> Option<Attr> {
        Some(Attr::Bool(*self))
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        match parts.attr(key) {
            Some(Attr::Bool(value)) => Ok(*value),
            _ => Err(parts.bad_attr(key, "true or false")),
        }
    }
}

impl OpField for Vec<i64> {
    fn to_attr(&self) -> Option<Attr> {
        Some(Attr::Ints(self.clone()))
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        match parts.attr(key) {
            Some(Attr::Ints(values)) => Ok(values.clone()),
            _ => Err(parts.bad_attr(key, "a list of integers")),
        }
    }
}

impl OpField for F64 {
    fn to_attr(&self) -> Option<Attr> {
        Some(Attr::Float(self.0))
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        match parts.attr(key) {
            Some(Attr::Float(value)) => Ok(F64(*value)),
            Some(Attr::Int(value)) => Ok(F64(*value as f64)),
            _ => Err(parts.bad_attr(key, "a number")),
        }
    }
}

/// An optional number: absent from the text form when `None`.
impl OpField for Option<F64> {
    fn to_attr(&self) -> Option<Attr> {
        self.as_ref().and_then(OpField::to_attr)
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        match parts.attr(key) {
            Some(_) => F64::parse(key, parts).map(Some),
            None => Ok(None),
        }
    }
}

impl OpField for DType {
    fn to_attr(&self) -> Option<Attr> {
        Some(Attr::Word(self.to_string()))
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        let word = parts.word(key)?;
        DType::from_name(word).ok_or_else(|| format!("{}: unknown dtype {word}", parts.name))
    }
}

/// Implements [`OpField`] for enums whose variants are words of the text form.
macro_rules! word_fields {
    ($($type:ident),*) => {$(
        impl OpField for $type {
            fn to_attr(&self) -> Option<Attr> {
                Some(Attr::Word(self.word().into()))
            }
            fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
                let word = parts.word(key)?;
                $type::from_word(word)
                    .ok_or_else(|| format!("{}: unknown {key} {word}", parts.name))
            }
        }
    )*};
}
word_fields!(LossReduction, AttentionGradPart, NormGradPart);

impl OpField for FusedExpr {
    fn to_attr(&self) -> Option<Attr> {
        Some(Attr::Str(self.to_string()))
    }
    fn parse(key: &str, parts: &mut Parts<'_>) -> Result<Self, String> {
        FusedExpr::parse(parts.string(key)?).map_err(|error| format!("{}: {error}", parts.name))
    }
}
