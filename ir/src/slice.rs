//! Python-style slice bounds, resolved in the size of each element's dim.

use std::ops::Range;

/// The bounds of a slice `start:end` as Python reads them: a negative position counts
/// from the end, positions past either end are clamped, and `end` is [`i64::MAX`] for
/// none.
///
/// ```
/// use nestor_ir::SliceBounds;
/// let drop_last = SliceBounds { start: 0, end: -1 };
/// assert_eq!(drop_last.resolve(4), 0..3);
/// assert_eq!(drop_last.resolve(0), 0..0);
/// // `[:-1]` and `[1:]` give every element the same length.
/// assert_eq!(drop_last.lengths_form(), SliceBounds { start: 1, end: i64::MAX }.lengths_form());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SliceBounds {
    /// First position, inclusive.
    pub start: i64,
    /// Past the last position.
    pub end: i64,
}

impl SliceBounds {
    /// Every position (`[:]`).
    pub const ALL: Self = Self {
        start: 0,
        end: i64::MAX,
    };

    /// The positions `start..end` these bounds select in a dim of `size`.
    pub fn resolve(self, size: i64) -> Range<i64> {
        let size = size.max(0);
        let clamp = |position: i64| {
            let position = if position < 0 {
                position.saturating_add(size)
            } else {
                position
            };
            position.clamp(0, size)
        };
        let start = clamp(self.start);
        start..clamp(self.end).max(start)
    }

    /// How many positions these bounds select in a dim of `size`.
    pub fn length(self, size: i64) -> i64 {
        let range = self.resolve(size);
        range.end - range.start
    }

    /// Bounds that select as many positions as these in every size, one form per
    /// length formula (`[:-k]` as `[k:]`, `[-k:]` as `[:k]`), so that a lengths value
    /// of one formula is one symbol; [`SliceBounds::ALL`] for the whole dim.
    pub fn lengths_form(self) -> Self {
        match (self.start, self.end) {
            // `[:-k]` keeps `max(n - k, 0)` positions, as `[k:]` does.
            (0, end) if end < 0 && end != i64::MIN => Self {
                start: -end,
                end: i64::MAX,
            },
            // `[-k:]` keeps `min(n, k)` positions, as `[:k]` does.
            (start, i64::MAX) if start < 0 && start != i64::MIN => Self {
                start: 0,
                end: -start,
            },
            (start, end) if start <= 0 && end == i64::MAX => Self::ALL,
            _ => self,
        }
    }
}
