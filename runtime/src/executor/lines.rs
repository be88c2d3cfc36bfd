//! The executor's intermediate buffers: whole cache lines, the large ones on transparent
//! huge pages where the kernel lends them on request (Linux's `madvise` mode, a common
//! default). A step that reads rows kilobytes apart (a head's rows of `[L, 3, heads,
//! 64]`, 3 KiB apart, in attention) touches a new 4 KiB page with nearly every row and
//! waits on the TLB, most of all in a virtual machine, whose page walks are nested: on a
//! 2-core Xeon VM the decoder's training steps took 6-8% less time with the buffers from
//! 1 MiB on placed on huge pages (its attention steps 7-23%, its layer norms 30%);
//! glibc's `glibc.malloc.hugetlb=1` tunable, which does the same for every allocation of
//! the process, 1-4% less again.

use std::alloc::Layout;
use std::ptr::NonNull;

/// The unit of the buffers: every buffer starts on a cache line. malloc aligns to 16
/// bytes only, and MKL's GEMM writing an output 16 bytes past a line ran 20-25% slower
/// (1429 x 256 x 1024: 7.1 against 5.8 ms), so one feed-forward GEMM of the encoder was
/// slow or not by where its buffer happened to fall.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct CacheLine(pub(crate) [u64; 8]);

/// Bytes of a transparent huge page (x86-64's, and aarch64's with 4 KiB pages).
const HUGE_PAGE: usize = 2 << 20;

/// Buffers of this many bytes or more are placed on huge pages, their size rounded up
/// to whole ones (a rounding glibc's tunable makes too: up to twice the size of the
/// smallest, a 1 MiB buffer taking 2 MiB; a 1.5 MiB one a third more); smaller ones on
/// ordinary pages.
const HUGE_FROM: usize = 1 << 20;

/// A buffer of cache lines, not initialized: the steps write before they read.
pub(crate) struct Lines {
    at: NonNull<CacheLine>,
    layout: Layout,
}

// SAFETY: the buffer owns its memory; the executor hands its address to one run at a
// time.
unsafe impl Send for Lines {}

impl Lines {
    /// A buffer of at least `lines` lines (at least one), on huge pages from
    /// [`HUGE_FROM`] bytes on where [`huge_pages`] allows; `None` when the size does
    /// not fit a layout or the allocator has no memory for it.
    pub(crate) fn new(lines: usize) -> Option<Self> {
        let bytes = lines.max(1).checked_mul(std::mem::size_of::<CacheLine>())?;
        let huge = bytes >= HUGE_FROM && huge_pages();
        let layout = match huge {
            true => Layout::from_size_align(bytes.checked_next_multiple_of(HUGE_PAGE)?, HUGE_PAGE),
            false => Layout::from_size_align(bytes, std::mem::align_of::<CacheLine>()),
        }
        .ok()?;
        // SAFETY: the layout's size is at least one line.
        let at = NonNull::new(unsafe { std::alloc::alloc(layout) } as *mut CacheLine)?;
        if huge {
            advise_huge_pages(at.as_ptr() as *mut u8, layout.size());
        }
        Some(Lines { at, layout })
    }

    /// The lines the buffer holds.
    pub(crate) fn capacity(&self) -> usize {
        self.layout.size() / std::mem::size_of::<CacheLine>()
    }

    /// The bytes it took (whole lines; whole huge pages for a large one).
    pub(crate) fn bytes(&self) -> usize {
        self.layout.size()
    }

    /// The first byte.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.at.as_ptr() as *mut u8
    }

    /// Writes `line` into the first `lines` lines (at most the capacity).
    #[cfg(debug_assertions)]
    pub(crate) fn fill(&mut self, lines: usize, line: CacheLine) {
        for index in 0..lines.min(self.capacity()) {
            // SAFETY: `index` is below the capacity.
            unsafe { self.at.as_ptr().add(index).write(line) };
        }
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.at.as_ptr() as *mut u8, self.layout) };
    }
}

/// Whether large buffers go on huge pages: on Linux, unless `NESTOR_HUGE_PAGES=0` or the
/// kernel lends none (its THP mode `never`: the rounding would only waste memory). Read
/// once a process.
fn huge_pages() -> bool {
    static HUGE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HUGE.get_or_init(|| {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        cfg!(target_os = "linux")
            && std::env::var_os("NESTOR_HUGE_PAGES").is_none_or(|value| value != "0")
            && mode.is_ok_and(|mode| !mode.contains("[never]"))
    })
}

/// Asks the kernel to back `bytes` bytes from `at` (whole huge pages) with huge pages
/// as they are first touched. A hint: a kernel that lends none ignores it.
fn advise_huge_pages(at: *mut u8, bytes: usize) {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            fn madvise(at: *mut std::ffi::c_void, bytes: usize, advice: i32) -> i32;
        }
        /// `MADV_HUGEPAGE` of Linux's `<sys/mman.h>`.
        const MADV_HUGEPAGE: i32 = 14;
        // SAFETY: the range is memory this buffer owns; the advice changes how the
        // kernel backs it, not what it holds (its result, a hint's, is not needed).
        unsafe { madvise(at as *mut std::ffi::c_void, bytes, MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (at, bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small buffers hold what they were asked for on cache lines; large ones whole huge
    /// pages on huge-page boundaries (unless turned off); every line can be written and
    /// read back.
    #[test]
    fn buffers_hold_their_lines_on_their_boundaries() {
        for lines in [
            0,
            1,
            3,
            HUGE_FROM / 64 - 1,
            HUGE_FROM / 64,
            HUGE_PAGE / 64 + 1,
        ] {
            let mut buffer = Lines::new(lines).expect("a buffer");
            let at = buffer.as_mut_ptr() as usize;
            assert!(buffer.capacity() >= lines.max(1), "{lines}");
            assert_eq!(buffer.bytes(), buffer.capacity() * 64, "{lines}");
            assert_eq!(at % 64, 0, "{lines}");
            if lines * 64 >= HUGE_FROM && huge_pages() {
                assert_eq!(at % HUGE_PAGE, 0, "{lines}");
                assert_eq!(buffer.capacity() * 64 % HUGE_PAGE, 0, "{lines}");
            } else {
                assert_eq!(buffer.capacity(), lines.max(1), "{lines}");
            }
            let lines = buffer.capacity();
            let first = buffer.as_mut_ptr() as *mut CacheLine;
            for index in 0..lines {
                // SAFETY: below the capacity.
                unsafe { first.add(index).write(CacheLine([index as u64; 8])) };
            }
            // SAFETY: every line was written.
            let read = unsafe { std::slice::from_raw_parts(first, lines) };
            assert!(read
                .iter()
                .enumerate()
                .all(|(index, line)| line.0 == [index as u64; 8]));
        }
    }

    /// A size past what a layout holds is `None`, not a panic.
    #[test]
    fn impossible_sizes_are_none() {
        assert!(Lines::new(usize::MAX / 32).is_none());
    }
}
