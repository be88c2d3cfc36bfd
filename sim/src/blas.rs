//! cuBLAS's `cublasGemmEx` as the simulated device runs it: the call's exact arguments
//! (transposes, `m`, `n`, `k`, leading dimensions, `alpha = 1`, `beta = 0`) validated as
//! cuBLAS validates them and evaluated by definition, column-major, with f32
//! accumulation, every matrix checked to lie inside its buffer.

use nestor_codegen::Storage;
use nestor_runtime::{from_bf16, to_bf16, BlasCall};

use crate::memory::Extents;
use crate::SimError;

/// `C = op(A) op(B)` of `call` over the buffers at `[a, b, c]`, values of `storage`.
///
/// # Safety
/// The addresses are checked against `extents`, which must be the device's live buffers.
pub(crate) unsafe fn gemm_ex(
    step: usize,
    call: &BlasCall,
    [a, b, c]: [u64; 3],
    (storage, extents): (Storage, &Extents),
) -> Result<(), SimError> {
    let refuse = |why: String| SimError::Blas {
        step,
        call: format!("{call:?}"),
        why,
    };
    let BlasCall {
        transpose_a,
        transpose_b,
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
    } = *call;
    // cuBLAS's CUBLAS_STATUS_INVALID_VALUE: negative sizes, leading dimensions below the
    // rows of the matrix as stored.
    if m < 0 || n < 0 || k < 0 {
        return Err(refuse(
            "a negative size (CUBLAS_STATUS_INVALID_VALUE)".into(),
        ));
    }
    let stored_rows_a = if transpose_a { k } else { m };
    let stored_rows_b = if transpose_b { n } else { k };
    for (name, ld, rows) in [
        ("lda", lda, stored_rows_a),
        ("ldb", ldb, stored_rows_b),
        ("ldc", ldc, m),
    ] {
        if ld < rows.max(1) {
            return Err(refuse(format!(
                "{name} {ld} is below max(1, {rows}) (CUBLAS_STATUS_INVALID_VALUE)"
            )));
        }
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    let size = if storage == Storage::Bf16 { 2 } else { 4 };
    let [a_len, b_len, c_len] = call.lengths();
    for (name, address, len) in [("A", a, a_len), ("B", b, b_len), ("C", c, c_len)] {
        let bytes = len as u64 * size;
        if extents.holding(address, bytes).is_none() {
            return Err(refuse(format!(
                "{name} reaches {bytes} bytes from {address:#x}, past its buffer {:?}",
                extents.below(address)
            )));
        }
    }
    let read = |address: u64, index: usize| -> f32 {
        // Inside the buffer, checked above against the extents of `lengths`.
        unsafe {
            if storage == Storage::Bf16 {
                from_bf16(*(address as *const u16).add(index))
            } else {
                *(address as *const f32).add(index)
            }
        }
    };
    let (m, n, k) = (m as usize, n as usize, k as usize);
    let (lda, ldb, ldc) = (lda as usize, ldb as usize, ldc as usize);
    let mut column = vec![0.0f32; m];
    for j in 0..n {
        column.fill(0.0);
        for p in 0..k {
            let b_value = read(
                b,
                if transpose_b {
                    j + p * ldb
                } else {
                    p + j * ldb
                },
            );
            for (i, sum) in column.iter_mut().enumerate() {
                let a_value = read(
                    a,
                    if transpose_a {
                        p + i * lda
                    } else {
                        i + p * lda
                    },
                );
                *sum += a_value * b_value;
            }
        }
        for (i, &sum) in column.iter().enumerate() {
            let index = i + j * ldc;
            // Inside C, checked above.
            unsafe {
                if storage == Storage::Bf16 {
                    *(c as *mut u16).add(index) = to_bf16(sum);
                } else {
                    *(c as *mut f32).add(index) = sum;
                }
            }
        }
    }
    Ok(())
}
