//! The runtime's copies between packed rows and a padded grid.

use crate::scalar::Scalar;
use nestor_runtime::LengthsInfo;

/// Writes the padded grid `[B, max(L), width]` of packed rows `x`.
///
/// # Safety
/// `x` must hold `sum(lengths) * width` values and `out` `B * max(L) * width`.
pub(super) unsafe fn pad<T: Scalar>(
    out: *mut u8,
    x: *const u8,
    info: &LengthsInfo<'_>,
    width: i64,
    value: f64,
) {
    let lengths = &info.lengths[..];
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

#[cfg(test)]
mod tests {
    //! The padding kernel templates (what the CUDA backend runs), generated for the host
    //! and compared with these copies, bit for bit.

    use super::*;
    use crate::testing::run_template;
    use nestor_passes::step::{Pad, Unpad};
    use nestor_passes::{Slot, Step};
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_padding_templates_equal_the_host_copies(
            lengths in proptest::collection::vec(0i64..6, 1..5),
            width in 1i64..4,
        ) {
            let info = LengthsInfo::new(lengths.clone().into(), Vec::new());
            let total: i64 = lengths.iter().sum();
            let values: Vec<f32> = (0..total * width).map(|index| index as f32 * 0.5 - 3.0).collect();
            let padded_size = (lengths.len() as i64 * info.longest * width) as usize;
            let pointer = |values: &[f32]| values.as_ptr() as *mut u8;

            let mut expected = vec![f32::NAN; padded_size];
            unsafe { pad::<f32>(expected.as_mut_ptr() as *mut u8, pointer(&values), &info, width, -7.5) };
            let mut actual = vec![f32::NAN; padded_size];
            let longest = [info.longest];
            let step = Step::Pad(Pad { out: Slot(0), x: Slot(1), lengths: Slot(2), width, value: nestor_ir::F64(-7.5) });
            // The buffers hold the values of these lengths.
            unsafe { run_template(step, &[
                actual.as_mut_ptr() as *mut u8,
                pointer(&values),
                info.offsets.as_ptr() as *mut u8,
                longest.as_ptr() as *mut u8,
            ], lengths.len() as i64 * info.longest) };
            let bits = |values: &[f32]| values.iter().map(|value| value.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&actual), bits(&expected));

            let mut unpadded = vec![f32::NAN; values.len()];
            let step = Step::Unpad(Unpad { out: Slot(0), x: Slot(1), grid: Slot(2), lengths: Slot(3), width });
            // The buffers hold the values of these lengths.
            unsafe { run_template(step, &[
                unpadded.as_mut_ptr() as *mut u8,
                pointer(&expected),
                info.offsets.as_ptr() as *mut u8,
                longest.as_ptr() as *mut u8,
                info.owners().as_ptr() as *mut u8,
            ], total) };
            let mut host = vec![f32::NAN; values.len()];
            unsafe { unpad::<f32>(host.as_mut_ptr() as *mut u8, pointer(&expected), &lengths, info.longest, width) };
            prop_assert_eq!(bits(&unpadded), bits(&host));
            prop_assert_eq!(bits(&unpadded), bits(&values));
        }
    }
}
