//! The data steps the CPU runs in Rust: numbers from lengths, one-hot rows, inserted
//! slices, scattered embedding gradients and dropout masks.

use nestor_passes::step::{Insert, LengthValues, OneHot, RandomMask, ScatterRows};
use nestor_passes::FloatType;
use nestor_runtime::{mask_key, split_mix, RunState};

use crate::scalar::Scalar;

/// A one-hot step of the run (its ids already checked).
pub(super) fn one_hot_step(step: &OneHot, run: &RunState<'_, '_>) {
    let OneHot {
        out,
        ids,
        rows,
        classes,
        ignore,
    } = *step;
    let rows = run.sizes().rows(rows).max(0) as usize;
    let (out, ids) = (run.pointer(out), run.pointer(ids) as *const i64);
    // `ids` holds `rows` i64 values (an input of that checked size) and `out`
    // `rows * classes` values of the program's type.
    match run.program().float {
        FloatType::F32 => unsafe { one_hot::<f32>(out, ids, rows, classes, ignore) },
        FloatType::F64 => unsafe { one_hot::<f64>(out, ids, rows, classes, ignore) },
    }
}

/// A scatter-add step of the run (an embedding's gradient).
pub(super) fn scatter_rows_step(step: &ScatterRows, run: &RunState<'_, '_>) {
    let rows = run.sizes().rows(step.rows).max(0) as usize;
    let buffers = (
        run.pointer(step.out),
        run.pointer(step.g) as *const u8,
        run.pointer(step.ids) as *const i64,
    );
    let sizes = (rows, step.width, step.vocabulary, step.padding);
    // `ids` holds `rows` i64 values, `g` `rows * width` and `out` `vocabulary * width`
    // values of the program's type.
    match run.program().float {
        FloatType::F32 => unsafe { scatter_rows::<f32>(buffers, sizes) },
        FloatType::F64 => unsafe { scatter_rows::<f64>(buffers, sizes) },
    }
}

/// An insert step of the run.
pub(super) fn insert_step(step: &Insert, run: &RunState<'_, '_>) {
    let rows = run.sizes().rows(step.rows).max(0) as usize;
    let (out, x) = (run.pointer(step.out), run.pointer(step.x) as *const u8);
    let at = (step.size, step.index, step.inner);
    // `x` holds `rows * inner` and `out` `rows * size * inner` values of the program's
    // type.
    match run.program().float {
        FloatType::F32 => unsafe { insert::<f32>(out, x, rows, at) },
        FloatType::F64 => unsafe { insert::<f64>(out, x, rows, at) },
    }
}

/// A dropout-mask step of the run (keyed by its stream and the run's number).
pub(super) fn random_mask_step(step: &RandomMask, run: &RunState<'_, '_>) {
    let count = (run.sizes().rows(step.rows) * step.width).max(0) as usize;
    let out = run.pointer(step.out);
    let key = (step.stream as u64, run.run());
    // `out` holds `count` values of the program's type.
    match run.program().float {
        FloatType::F32 => unsafe { random_mask::<f32>(out, count, step.p.0, key) },
        FloatType::F64 => unsafe { random_mask::<f64>(out, count, step.p.0, key) },
    }
}

/// A length-values step of the run (nothing when the run does not know the lengths).
pub(super) fn length_values_step(step: &LengthValues, run: &RunState<'_, '_>) {
    let Some(info) = run.lengths(step.lengths) else {
        return;
    };
    let out = run.pointer(step.out);
    // `out` holds one value per element of these lengths, in the program's type.
    match run.program().float {
        FloatType::F32 => unsafe { write_numbers::<f32>(out, &info.lengths) },
        FloatType::F64 => unsafe { write_numbers::<f64>(out, &info.lengths) },
    }
}

/// Writes `values` as numbers of type `T`.
///
/// # Safety
/// `out` must hold `values.len()` values of type `T` (or be unused when it is empty).
unsafe fn write_numbers<T: Scalar>(out: *mut u8, values: &[i64]) {
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
unsafe fn one_hot<T: Scalar>(
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
unsafe fn scatter_rows<T: Scalar>(
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
unsafe fn insert<T: Scalar>(
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
