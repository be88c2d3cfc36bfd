//! The runtime's copies between packed rows and a padded grid.

use super::sizes::LengthsInfo;
use crate::scalar::Scalar;

/// Writes the padded grid `[B, max(L), width]` of packed rows `x`.
///
/// # Safety
/// `x` must hold `sum(lengths) * width` values and `out` `B * max(L) * width`.
pub(super) unsafe fn pad<T: Scalar>(
    out: *mut u8,
    x: *const u8,
    info: &LengthsInfo,
    width: i64,
    value: f64,
) {
    let lengths = &info.lengths;
    let (width, longest) = (width.max(0) as usize, info.longest.max(0) as usize);
    if width == 0 || longest == 0 {
        return;
    }
    let out =
        unsafe { std::slice::from_raw_parts_mut(out as *mut T, lengths.len() * longest * width) };
    let mut source = x as *const T;
    for (grid, &length) in out.chunks_mut(longest * width).zip(lengths) {
        let filled = length.max(0) as usize * width;
        unsafe {
            std::ptr::copy_nonoverlapping(source, grid.as_mut_ptr(), filled);
            source = source.add(filled);
        }
        grid[filled..].fill(T::from_f64(value));
    }
}

/// Writes the packed rows of the padded grid `x` (`B x longest` rows of `width`).
///
/// # Safety
/// `x` must hold `B * longest * width` values and `out` `sum(lengths) * width`, with
/// every length at most `longest`.
pub(super) unsafe fn unpad<T: Scalar>(
    out: *mut u8,
    x: *const u8,
    lengths: &[i64],
    longest: i64,
    width: i64,
) {
    let (width, longest) = (width.max(0) as usize, longest.max(0) as usize);
    let (mut target, source) = (out as *mut T, x as *const T);
    for (element, &length) in lengths.iter().enumerate() {
        let count = length.max(0) as usize * width;
        unsafe {
            std::ptr::copy_nonoverlapping(source.add(element * longest * width), target, count);
            target = target.add(count);
        }
    }
}
