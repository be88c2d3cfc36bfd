//! Buffers read from their first cache line: AMX's tile loads and stores run at about
//! half their speed on rows that cross cache lines (a product whose packed operand
//! started 16 bytes past a line took twice as long), and malloc aligns to 16 bytes.

/// Bytes of a cache line.
const LINE: usize = 64;

/// `len` values of `vector` from its first cache-line boundary, grown as needed (new
/// values `fill`; the values before the boundary are never handed out).
pub(crate) fn lines<T: Copy>(vector: &mut Vec<T>, len: usize, fill: T) -> &mut [T] {
    let start = line_start(vector, len, fill);
    &mut vector[start..start + len]
}

/// The values a vector must hold for [`lines`] to hand out `len` of them from a line
/// boundary, wherever its allocation starts.
pub(crate) fn with_slack<T>(len: usize) -> usize {
    len + LINE / std::mem::size_of::<T>().max(1)
}

/// Where [`lines`] hands `vector`'s values out from (an index), after growing it to hold
/// `len` values from there.
pub(crate) fn line_start<T: Copy>(vector: &mut Vec<T>, len: usize, fill: T) -> usize {
    let size = std::mem::size_of::<T>().max(1);
    let needed = with_slack::<T>(len);
    if vector.len() < needed {
        vector.resize(needed, fill);
    }
    // A vector's values are aligned to their size, which divides a line's for the
    // numbers buffers hold (2, 4, 8 bytes).
    let past = vector.as_ptr() as usize % LINE;
    if past == 0 {
        0
    } else {
        (LINE - past) / size
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn values_start_on_a_line_and_keep_their_place() {
        for offset in 0..40 {
            let mut vector: Vec<u16> = Vec::with_capacity(offset);
            vector.resize(offset, 7);
            let start = super::line_start(&mut vector, 100, 3);
            assert_eq!(vector[start..].as_ptr() as usize % 64, 0);
            assert!(vector.len() >= start + 100);
            let lines = super::lines(&mut vector, 100, 3);
            lines[0] = 9;
            assert_eq!(
                super::line_start(&mut vector, 100, 3),
                start,
                "the same vector"
            );
            assert_eq!(vector[start], 9);
        }
    }
}
