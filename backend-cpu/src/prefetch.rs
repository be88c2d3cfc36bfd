//! Software prefetches of strided rows: a head's rows in a wide buffer (keys 3 KiB apart
//! in `[L, 3, heads, 64]`) cross a page every row or so, where the hardware prefetchers
//! stop; a kernel that reads them row by row waits on every row's first line.

use std::ops::Range;

/// Rows of a matrix fetched into L1 in step with a loop over blocks of rows: each block
/// fetches its own rows of it, or with `next` those of the block after it.
#[derive(Clone, Copy)]
pub(crate) struct Ahead {
    at: *const u8,
    /// Bytes between rows.
    stride: isize,
    /// Bytes of a row.
    bytes: usize,
    rows: usize,
    next: bool,
}

/// Bytes of a cache line.
const LINE: usize = 64;

impl Ahead {
    /// `rows` rows of `width` scalars from `at`, `stride` scalars apart; `next`: each
    /// fetched a block before the loop reaches it.
    pub(crate) fn new<T>(
        (at, stride): (*const T, isize),
        (rows, width): (usize, usize),
        next: bool,
    ) -> Ahead {
        let size = std::mem::size_of::<T>();
        Ahead {
            at: at as *const u8,
            stride: stride.wrapping_mul(size as isize),
            bytes: width.saturating_mul(size),
            rows,
            next,
        }
    }

    /// Fetches every line of the rows [`Ahead::rows_for`] the block `range`.
    #[inline(always)]
    pub(crate) fn fetch(self, range: Range<usize>) {
        for row in self.rows_for(range) {
            let line = self
                .at
                .wrapping_offset((row as isize).wrapping_mul(self.stride));
            for offset in (0..self.bytes).step_by(LINE) {
                fetch_line(line.wrapping_add(offset));
            }
        }
    }

    /// The rows a block of rows `range` fetches: its own, or with `next` as many rows
    /// after them; those below `rows`.
    fn rows_for(self, range: Range<usize>) -> Range<usize> {
        let lead = if self.next { range.len() } else { 0 };
        let end = range.end.saturating_add(lead).min(self.rows);
        range.start.saturating_add(lead).min(end)..end
    }
}

/// Asks for the line holding `at` in L1 (a hint: no fault, whatever the address).
#[inline(always)]
fn fetch_line(at: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(at as *const i8)
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_fetch_their_rows_or_the_next_blocks_below_the_last() {
        let values = [0.0f32; 12];
        let own = Ahead::new((values.as_ptr(), 3), (4, 3), false);
        let next = Ahead { next: true, ..own };
        assert_eq!(own.rows_for(0..2), 0..2);
        assert_eq!(next.rows_for(0..2), 2..4);
        assert_eq!(next.rows_for(2..4), 4..4, "past the last row: none");
        assert_eq!(own.rows_for(3..6), 3..4);
        assert_eq!(next.rows_for(usize::MAX - 1..usize::MAX), 4..4);
        assert_eq!((own.stride, own.bytes), (12, 12), "in bytes");
        // Fetching is a hint: rows past the matrix are never asked for, and asking
        // reads nothing the program sees.
        next.fetch(0..4);
    }
}
