//! The C ABI of the shim (`shim/c10d.cpp`): every call returns null or an error
//! message that the caller frees with `nestor_c10d_string_free`.

use std::ffi::c_char;

use torch_sys::C_tensor;

/// A c10d store and backend (`NestorGroup` in the shim).
#[repr(C)]
pub(crate) struct Group {
    _private: [u8; 0],
}

/// A launched collective (`NestorWork` in the shim).
#[repr(C)]
pub(crate) struct Work {
    _private: [u8; 0],
}

extern "C" {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn nestor_c10d_group(
        host: *const c_char,
        port: u16,
        serve: bool,
        rank: i32,
        world: i32,
        timeout_ms: i64,
        interface: *const c_char,
        nccl: i32,
        out: *mut *mut Group,
    ) -> *mut c_char;
    pub(crate) fn nestor_c10d_all_reduce(
        group: *mut Group,
        tensor: *mut C_tensor,
        op: i32,
        out: *mut *mut Work,
    ) -> *mut c_char;
    pub(crate) fn nestor_c10d_broadcast(
        group: *mut Group,
        tensor: *mut C_tensor,
        root: i32,
        out: *mut *mut Work,
    ) -> *mut c_char;
    pub(crate) fn nestor_c10d_wait(work: *mut Work) -> *mut c_char;
    pub(crate) fn nestor_c10d_work_free(work: *mut Work);
    pub(crate) fn nestor_c10d_group_free(group: *mut Group);
    pub(crate) fn nestor_c10d_string_free(message: *mut c_char);
}

/// The shim's message, taken (and freed), or `None` for success.
pub(crate) fn taken_message(message: *mut c_char) -> Option<String> {
    if message.is_null() {
        return None;
    }
    // SAFETY: a non-null result is a NUL-terminated string the shim malloc'd for us.
    let text = unsafe { std::ffi::CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: freed once, by the shim's allocator.
    unsafe { nestor_c10d_string_free(message) };
    Some(text)
}
