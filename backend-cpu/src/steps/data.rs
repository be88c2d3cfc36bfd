//! The data steps the CPU runs in Rust: numbers and positions from lengths.

use nestor_passes::step::{LengthValues, Positions};
use nestor_passes::FloatType;
use nestor_runtime::{step_error, write_positions, RunState, RuntimeError};

use crate::scalar::Scalar;

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

/// A positions step of the run (step `index`): every row's position within its element
/// (nothing when the run does not know the lengths).
pub(super) fn positions_step(
    index: usize,
    step: &Positions,
    run: &RunState<'_, '_>,
) -> Result<(), RuntimeError> {
    let Some(info) = run.lengths(step.lengths) else {
        return Ok(());
    };
    let rows = usize::try_from(info.offsets.last().copied().unwrap_or(0)).unwrap_or(0);
    let slot = run.sizes().elements(run.program(), step.out);
    if slot != rows {
        return Err(step_error(
            index,
            format!("{rows} rows of positions do not fill {slot} values"),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    // `out` holds one i64 per row of these lengths (checked just above).
    let out = unsafe { std::slice::from_raw_parts_mut(run.pointer(step.out) as *mut i64, rows) };
    write_positions(&info.offsets, out);
    Ok(())
}
