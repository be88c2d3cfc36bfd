//! The data steps the CPU runs in Rust: numbers from lengths, one-hot rows, inserted
//! slices, scattered embedding gradients and dropout masks.

use nestor_runtime::{mask_key, split_mix};

use crate::scalar::Scalar;

/// Writes `values` as numbers of type `T`.
///
/// # Safety
/// `out` must hold `values.len()` values of type `T` (or be unused when it is empty).
pub(super) unsafe fn write_numbers<T: Scalar>(out: *mut u8, values: &[i64]) {
    if values.is_empty() {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, values.len()) };
    for (number, &value) in out.iter_mut().zip(values) {
        *number = T::from_f64(value as f64);
    }
}

/// One-hot rows of `ids` (zero rows for `ignore` and out-of-range ids).
///
/// # Safety
/// `ids` must hold `rows` values and `out` `rows * classes` values of type `T` (either
/// may be unused when `rows` is 0).
pub(super) unsafe fn one_hot<T: Scalar>(
    out: *mut u8,
    ids: *const i64,
    rows: usize,
    classes: i64,
    ignore: i64,
) {
    let width = classes.max(0) as usize;
    if rows == 0 || width == 0 {
        return;
    }
    let ids = unsafe { std::slice::from_raw_parts(ids, rows) };
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, rows * width) };
    for (row, &id) in out.chunks_exact_mut(width).zip(ids) {
        row.fill(T::ZERO);
        if id != ignore && (0..classes).contains(&id) {
            row[id as usize] = T::ONE;
        }
    }
}

/// Adds every row of `g` into the row of `out` its id names (none for `padding` and
/// ids outside the table).
///
/// # Safety
/// `ids` must hold `rows` values, `g` `rows * width` and `out` `vocabulary * width`
/// values of type `T` (any may be unused when empty).
pub(super) unsafe fn scatter_rows<T: Scalar>(
    (out, g, ids): (*mut u8, *const u8, *const i64),
    (rows, width, vocabulary, padding): (usize, i64, i64, i64),
) {
    let width = width.max(0) as usize;
    let table = vocabulary.max(0) as usize * width;
    if table == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, table) };
    out.fill(T::ZERO);
    if rows == 0 {
        return;
    }
    let ids = unsafe { std::slice::from_raw_parts(ids, rows) };
    let g = unsafe { std::slice::from_raw_parts(g as *const T, rows * width) };
    for (row, &id) in g.chunks_exact(width).zip(ids) {
        if id != padding && (0..vocabulary).contains(&id) {
            let start = id as usize * width;
            for (sum, &value) in out[start..start + width].iter_mut().zip(row) {
                *sum += value;
            }
        }
    }
}

/// `out` (`[rows, size, inner]`) zero but for `out[:, index, :] = x` (`[rows, inner]`).
///
/// # Safety
/// `x` must hold `rows * inner` and `out` `rows * size * inner` values of type `T`.
pub(super) unsafe fn insert<T: Scalar>(
    out: *mut u8,
    x: *const u8,
    rows: usize,
    (size, index, inner): (i64, i64, i64),
) {
    let (size, inner) = (size.max(0) as usize, inner.max(0) as usize);
    if rows * size * inner == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, rows * size * inner) };
    let x = unsafe { std::slice::from_raw_parts(x as *const T, rows * inner) };
    // Each value written once: the zeros around the inserted part, and the part (at
    // `index < size`, which the IR's type check ensures; `min` keeps it in the row).
    let start = (index.max(0) as usize * inner).min(size * inner - inner);
    for (row, values) in out
        .chunks_exact_mut(size * inner)
        .zip(x.chunks_exact(inner))
    {
        let (before, rest) = row.split_at_mut(start);
        let (inserted, after) = rest.split_at_mut(inner);
        before.fill(T::ZERO);
        inserted.copy_from_slice(values);
        after.fill(T::ZERO);
    }
}

/// A dropout mask of `count` values: `1 / (1 - p)` where the position's uniform number
/// (SplitMix64 of the stream, the run and the position) is at least `p`, else 0.
///
/// # Safety
/// `out` must hold `count` values of type `T` (or be unused when `count` is 0).
pub(super) unsafe fn random_mask<T: Scalar>(
    out: *mut u8,
    count: usize,
    p: f64,
    (stream, run): (u64, u64),
) {
    if count == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, count) };
    let kept = T::from_f64(1.0 / (1.0 - p));
    let key = mask_key(stream as i64, run);
    for (position, value) in out.iter_mut().enumerate() {
        // The top 53 bits as a uniform number in [0, 1).
        let uniform = (split_mix(key ^ position as u64) >> 11) as f64 / (1u64 << 53) as f64;
        *value = if uniform >= p { kept } else { T::ZERO };
    }
}
