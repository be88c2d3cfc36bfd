//! GEMM products on cuBLAS (libcublas loaded at run time, as libcuda is), as the
//! runtime's [`BlasCall`]s.

use std::ffi::c_void;

use cudarc::cublas::{result, sys, CudaBlas};

use nestor_runtime::BlasCall;

use crate::{CudaError, Device, Storage};

/// The cuBLAS functions nestor calls (cudarc panics on a missing one, so they are
/// looked for first).
pub const BLAS_SYMBOLS: [&str; 4] = [
    "cublasCreate_v2",
    "cublasDestroy_v2",
    "cublasSetStream_v2",
    "cublasGemmEx",
];

/// The first of [`BLAS_SYMBOLS`] that `library` lacks.
pub fn missing_symbol(library: &libloading::Library) -> Option<&'static str> {
    BLAS_SYMBOLS.into_iter().find(|name| {
        // SAFETY: the symbol is only looked up, never called or read.
        unsafe { library.get::<*const c_void>(name.as_bytes()) }.is_err()
    })
}

/// cuBLAS on a device's stream: GEMM products ordered with the device's kernels.
pub struct Blas {
    blas: CudaBlas,
}

impl Blas {
    /// cuBLAS for `device`: [`CudaError::NoBlas`] when libcublas cannot be loaded (it is
    /// looked for under its usual names on the library path) or lacks a function nestor
    /// calls.
    pub fn new(device: &Device) -> Result<Blas, CudaError> {
        // SAFETY: loading libcublas runs its initializers, as cudarc's own loading would.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::NoBlas(
                "libcublas cannot be loaded (add its folder to LD_LIBRARY_PATH)".to_owned(),
            ));
        }
        // SAFETY: as above; present, so cudarc's loading does not panic.
        if let Some(name) = missing_symbol(unsafe { sys::culib() }) {
            return Err(CudaError::NoBlas(format!("libcublas has no {name}")));
        }
        let blas = CudaBlas::new(device.stream().clone())
            .map_err(|error| CudaError::Blas(error.to_string()))?;
        Ok(Blas { blas })
    }

    /// Runs `call` on the device's stream (cuBLAS's GemmEx): `c = op(a) op(b)` over
    /// buffers of f32, or of bf16 (`storage`), with f32 arithmetic.
    ///
    /// # Safety
    /// `[a, b, c]` must be device buffers of the blas's device holding
    /// [`BlasCall::lengths`] values of the storage type, alive until the work is done.
    pub unsafe fn run(
        &self,
        call: &BlasCall,
        [a, b, c]: [u64; 3],
        storage: Storage,
    ) -> Result<(), CudaError> {
        if call.m == 0 || call.n == 0 {
            return Ok(());
        }
        let operation = |transposed: bool| {
            if transposed {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (transpose_a, transpose_b) = (operation(call.transpose_a), operation(call.transpose_b));
        let (alpha, beta) = (1.0f32, 0.0f32);
        // f32 arithmetic either way (no TF32, as torch's default for f32 matmuls).
        let values = match storage {
            Storage::Compute => sys::cudaDataType::CUDA_R_32F,
            Storage::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        };
        // SAFETY: the caller vouches for the buffers; the sizes are the call's.
        let outcome = unsafe {
            result::gemm_ex(
                *self.blas.handle(),
                transpose_a,
                transpose_b,
                call.m,
                call.n,
                call.k,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                values,
                call.lda,
                b as *const c_void,
                values,
                call.ldb,
                &beta as *const f32 as *const c_void,
                c as *mut c_void,
                values,
                call.ldc,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        outcome.map_err(|error| CudaError::Blas(format!("{error:?} for {call:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_venvs_cublas_has_every_function_nestor_calls() {
        // The torch venv's CUDA libraries (a GPU machine's come with its torch or CUDA).
        let torch = std::env::var_os("LIBTORCH").expect("LIBTORCH is set by scripts/env.sh");
        let path = std::path::Path::new(&torch).join("../nvidia/cu13/lib/libcublas.so.13");
        // SAFETY: loading runs the library's initializers; nothing is called.
        let library = unsafe { libloading::Library::new(&path) }
            .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
        assert_eq!(missing_symbol(&library), None);
        // A library without them says which it lacks.
        let libc = unsafe { libloading::Library::new("libc.so.6") }.unwrap();
        assert_eq!(missing_symbol(&libc), Some("cublasCreate_v2"));
    }
}
