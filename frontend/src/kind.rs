//! The bridge between libtorch scalar types (`tch::Kind`) and nestor's [`DType`].

use nestor_ir::DType;
use tch::Kind;

/// nestor's dtype for a libtorch scalar type, or `None` for types nestor does not
/// store (complex, quantized and 8-bit float types).
pub fn dtype_of(kind: Kind) -> Option<DType> {
    Some(match kind {
        Kind::Bool => DType::Bool,
        Kind::Uint8 => DType::U8,
        Kind::Int8 => DType::I8,
        Kind::Int16 => DType::I16,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        _ => return None,
    })
}

/// The libtorch scalar type of a nestor dtype.
pub fn kind_of(dtype: DType) -> Kind {
    match dtype {
        DType::Bool => Kind::Bool,
        DType::U8 => Kind::Uint8,
        DType::I8 => Kind::Int8,
        DType::I16 => Kind::Int16,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_round_trips_through_kind() {
        for dtype in DType::ALL {
            assert_eq!(dtype_of(kind_of(dtype)), Some(dtype));
        }
        assert_eq!(dtype_of(Kind::ComplexFloat), None);
    }
}
