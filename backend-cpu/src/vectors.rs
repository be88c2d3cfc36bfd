//! Host code compiled for the widest vector units the CPU has (chosen at run time).

/// Runs `body` compiled for AVX-512 (16 f32 lanes) or AVX2 (8) when the host has them,
/// else as built (SSE2 on x86-64: 4). Loops in `body`, and in what it inlines (mark
/// such helpers `#[inline(always)]`), vectorize to that width; the arithmetic per lane
/// is the same on every path (no FMA contraction), so results do not depend on the host.
#[inline(always)]
pub(crate) fn widest<R>(body: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2,avx512f,avx512bw")]
        unsafe fn avx512<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2<R>(body: impl FnOnce() -> R) -> R {
            body()
        }
        if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") {
            // SAFETY: the host has the features (checked just above).
            return unsafe { avx512(body) };
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { avx2(body) };
        }
    }
    body()
}
