//! A counting `malloc` for `LD_PRELOAD`: every allocation function forwards to glibc's
//! own (`__libc_malloc` and friends) and adds the usable size of what it returns to a
//! running total (frees subtract it), keeping the peak. The report reads the counters
//! through `nestor_memcount_*` (found with `dlsym`), so it sees every byte a step
//! allocates: Rust's, libtorch's and the JIT runtime's.
//!
//! Nothing here allocates; every function is safe to call from any thread.

use std::ffi::c_void;
use std::sync::atomic::{AtomicI64, Ordering};

extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_calloc(count: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(pointer: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_memalign(alignment: usize, size: usize) -> *mut c_void;
    fn __libc_valloc(size: usize) -> *mut c_void;
    fn __libc_free(pointer: *mut c_void);
    fn malloc_usable_size(pointer: *mut c_void) -> usize;
}

static CURRENT: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);

/// Counts an allocation that returned `pointer`.
fn counted(pointer: *mut c_void) -> *mut c_void {
    if !pointer.is_null() {
        // SAFETY: `pointer` was just returned by glibc's allocator.
        let size = unsafe { malloc_usable_size(pointer) } as i64;
        let now = CURRENT.fetch_add(size, Ordering::Relaxed) + size;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
    pointer
}

/// Uncounts `pointer`, about to be freed or moved.
fn released(pointer: *mut c_void) {
    if !pointer.is_null() {
        // SAFETY: `pointer` is a live allocation of glibc's allocator.
        let size = unsafe { malloc_usable_size(pointer) } as i64;
        CURRENT.fetch_sub(size, Ordering::Relaxed);
    }
}

/// `malloc`, counted.
///
/// # Safety
/// As glibc's `malloc`.
#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    counted(unsafe { __libc_malloc(size) })
}

/// `calloc`, counted.
///
/// # Safety
/// As glibc's `calloc`.
#[no_mangle]
pub unsafe extern "C" fn calloc(count: usize, size: usize) -> *mut c_void {
    counted(unsafe { __libc_calloc(count, size) })
}

/// `realloc`, counted.
///
/// # Safety
/// As glibc's `realloc`.
#[no_mangle]
pub unsafe extern "C" fn realloc(pointer: *mut c_void, size: usize) -> *mut c_void {
    released(pointer);
    let moved = unsafe { __libc_realloc(pointer, size) };
    if moved.is_null() && size != 0 {
        // The old block is still there: count it again.
        counted(pointer);
        return moved;
    }
    counted(moved)
}

/// `memalign`, counted.
///
/// # Safety
/// As glibc's `memalign`.
#[no_mangle]
pub unsafe extern "C" fn memalign(alignment: usize, size: usize) -> *mut c_void {
    counted(unsafe { __libc_memalign(alignment, size) })
}

/// `aligned_alloc`, counted.
///
/// # Safety
/// As glibc's `aligned_alloc`.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(alignment: usize, size: usize) -> *mut c_void {
    counted(unsafe { __libc_memalign(alignment, size) })
}

/// `valloc`, counted.
///
/// # Safety
/// As glibc's `valloc`.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    counted(unsafe { __libc_valloc(size) })
}

/// `posix_memalign`, counted.
///
/// # Safety
/// As glibc's `posix_memalign`: `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(
    out: *mut *mut c_void,
    alignment: usize,
    size: usize,
) -> i32 {
    const EINVAL: i32 = 22;
    const ENOMEM: i32 = 12;
    if alignment < std::mem::size_of::<usize>() || !alignment.is_power_of_two() {
        return EINVAL;
    }
    let pointer = counted(unsafe { __libc_memalign(alignment, size) });
    if pointer.is_null() && size != 0 {
        return ENOMEM;
    }
    // SAFETY: the caller passes a writable `out`.
    unsafe { *out = pointer };
    0
}

/// `free`, counted.
///
/// # Safety
/// As glibc's `free`.
#[no_mangle]
pub unsafe extern "C" fn free(pointer: *mut c_void) {
    released(pointer);
    unsafe { __libc_free(pointer) }
}

/// Bytes allocated now.
#[no_mangle]
pub extern "C" fn nestor_memcount_current() -> i64 {
    CURRENT.load(Ordering::Relaxed)
}

/// The most bytes allocated at once since the last reset.
#[no_mangle]
pub extern "C" fn nestor_memcount_peak() -> i64 {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new peak from what is allocated now.
#[no_mangle]
pub extern "C" fn nestor_memcount_reset() {
    PEAK.store(CURRENT.load(Ordering::Relaxed), Ordering::Relaxed);
}
