//! The data steps the CPU runs in Rust: numbers from lengths, and scattered embedding
//! gradients (with ids from an input, the scatter's template reads an index of the
//! rows of each id, which the CPU does not build).

use nestor_passes::step::{LengthValues, ScatterRows};
use nestor_passes::FloatType;
use nestor_runtime::RunState;

use crate::scalar::Scalar;

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
