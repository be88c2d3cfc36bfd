//! Attribute values of the text form: [`Attr`], bit-compared floats ([`F64`]) and the
//! words of enum attributes.

use std::fmt;
use std::hash::{Hash, Hasher};

/// An `f64` attribute compared and hashed by its bits (so ops can derive `Eq`/`Hash`).
#[derive(Clone, Copy, Debug)]
pub struct F64(pub f64);

impl PartialEq for F64 {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}
impl Eq for F64 {}
impl PartialOrd for F64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for F64 {
    /// IEEE total order: equal exactly when the bits are, as `Eq` says.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}
impl Hash for F64 {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.to_bits().hash(state);
    }
}

/// An attribute value, for the text form.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Str(String),
    /// A list of integers.
    Ints(Vec<i64>),
    /// A word (enum variant names).
    Word(String),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(value) => write!(f, "{value}"),
            Attr::Float(value) => write!(f, "{value:?}"),
            Attr::Bool(value) => write!(f, "{value}"),
            Attr::Str(value) => f.write_str(&crate::text::quote(value)),
            Attr::Ints(values) => {
                write!(
                    f,
                    "[{}]",
                    values
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
            Attr::Word(word) => f.write_str(word),
        }
    }
}
