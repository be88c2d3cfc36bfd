//! Element types and the promotion rule between them.

use std::fmt;

/// The element type of a tensor.
///
/// The variants are the dtypes nestor stores and computes with; they map one to one
/// onto libtorch scalar types of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// Boolean.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE half precision.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
}

/// The three categories of the promotion lattice, in increasing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Category {
    Bool,
    Integer,
    Float,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 10] = [
        DType::Bool,
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
    ];

    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::I16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        self.category() == Category::Float
    }

    /// Whether this is an integer type (bool excluded).
    pub fn is_integer(self) -> bool {
        self.category() == Category::Integer
    }

    fn category(self) -> Category {
        match self {
            DType::Bool => Category::Bool,
            DType::U8 | DType::I8 | DType::I16 | DType::I32 | DType::I64 => Category::Integer,
            DType::F16 | DType::BF16 | DType::F32 | DType::F64 => Category::Float,
        }
    }

    /// The smallest dtype both `self` and `other` convert to, as `torch.promote_types`
    /// computes it: bool < integers < floats; a mix of signed and unsigned 8-bit
    /// integers gives i16; f16 with bf16 gives f32; otherwise the wider type wins.
    pub fn promote(self, other: DType) -> DType {
        use DType::*;
        if self == other {
            return self;
        }
        match self.category().cmp(&other.category()) {
            std::cmp::Ordering::Less => return other,
            std::cmp::Ordering::Greater => return self,
            std::cmp::Ordering::Equal => {}
        }
        match (self, other) {
            (U8, I8) | (I8, U8) => I16,
            (F16, BF16) | (BF16, F16) => F32,
            (BF16, F32 | F64) | (F16, F32 | F64) => other,
            (F32 | F64, BF16 | F16) => self,
            // Same category, no special case: the wider type wins, and for equal widths
            // the declaration order (signed after unsigned) decides.
            _ => {
                if (other.size_in_bytes(), other) > (self.size_in_bytes(), self) {
                    other
                } else {
                    self
                }
            }
        }
    }
}

impl DType {
    /// The dtype named as [`Display`](fmt::Display) writes it (`f32`, `bf16`, ...).
    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL
            .into_iter()
            .find(|dtype| dtype.to_string() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests {
    use super::DType::{self, *};
    use proptest::prelude::*;

    #[test]
    fn promotion_matches_torch_promote_types() {
        // Pairs checked against torch.promote_types in PyTorch 2.13.
        let table = [
            (Bool, I64, I64),
            (Bool, F16, F16),
            (U8, I8, I16),
            (U8, I16, I16),
            (U8, I32, I32),
            (I32, I64, I64),
            (I64, F32, F32),
            (I64, F16, F16),
            (F16, BF16, F32),
            (BF16, F32, F32),
            (F32, F64, F64),
            (BF16, F64, F64),
        ];
        for (a, b, expected) in table {
            assert_eq!(a.promote(b), expected, "promote({a}, {b})");
        }
    }

    fn any_dtype() -> impl Strategy<Value = DType> {
        proptest::sample::select(DType::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn promotion_is_commutative_and_idempotent(a in any_dtype(), b in any_dtype()) {
            prop_assert_eq!(a.promote(b), b.promote(a));
            prop_assert_eq!(a.promote(a), a);
            let joined = a.promote(b);
            prop_assert_eq!(joined.promote(a), joined);
            prop_assert_eq!(joined.promote(b), joined);
        }

        #[test]
        fn promotion_is_associative(a in any_dtype(), b in any_dtype(), c in any_dtype()) {
            prop_assert_eq!(a.promote(b).promote(c), a.promote(b.promote(c)));
        }
    }
}
