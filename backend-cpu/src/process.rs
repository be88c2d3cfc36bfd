//! Functions of libraries the running process already has (libtorch's MKL and GNU
//! OpenMP), looked up by name at run time and never loaded by nestor; and the
//! environment settings that turn them off.

/// Whether the environment variable `variable` is set to `value`.
pub(crate) fn env_is(variable: &str, value: &str) -> bool {
    std::env::var(variable).is_ok_and(|set| set == value)
}

/// The function `name` (NUL-terminated) of the running process, if it has one.
///
/// # Safety
/// `T` must be the function's type (a function pointer of its signature).
pub(crate) unsafe fn function<T: Copy>(name: &[u8]) -> Option<T> {
    let this = libloading::os::unix::Library::this();
    // SAFETY: the caller gives the function's type.
    unsafe { this.get::<T>(name).ok().map(|symbol| *symbol) }
}
