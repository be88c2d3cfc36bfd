//! What a product step (a GEMM, a convolution) does to its output's rows once they are
//! written, while they are in the core's cache: its epilogue kernel, then the bf16
//! roundings that later products read (`crate::kept`).

use crate::bf16::Producing;
use crate::parallel::Args;
use crate::KernelFn;

/// The finishing of a product's output rows ([`Finish::rows`]).
#[derive(Clone, Copy)]
pub(crate) struct Finish<'a> {
    /// The step's epilogue kernel (over rows, in place) and its arguments.
    pub(crate) epilogue: Option<(KernelFn, Args<'a>)>,
    /// The roundings the step makes of its output.
    pub(crate) producing: Option<&'a Producing>,
    /// Values a row of the output.
    pub(crate) width: usize,
}

/// Output values finished at a time (a block of rows of 128 KiB of f32, which stays in
/// the core's cache between the epilogue and the rounding).
const BLOCK_VALUES: usize = 32 << 10;

impl Finish<'_> {
    /// Nothing to do.
    pub(crate) const NONE: Finish<'static> = Finish {
        epilogue: None,
        producing: None,
        width: 0,
    };

    /// Whether there is anything to do.
    pub(crate) fn any(&self) -> bool {
        self.epilogue.is_some() || self.producing.is_some()
    }

    /// Finishes rows `first..end` of the output, a block at a time: the epilogue, then
    /// the roundings of what it wrote.
    ///
    /// # Safety
    /// The rows must lie within the output and be written, and no other thread may
    /// finish them at the same time.
    pub(crate) unsafe fn rows(&self, mut first: usize, end: usize) {
        let block = (BLOCK_VALUES / self.width.max(1)).max(1);
        while self.any() && first < end {
            let last = (first + block).min(end);
            // SAFETY: as the caller vouches (the kernel's arguments are the step's
            // buffers, sized by the program for these rows).
            unsafe {
                if let Some((kernel, args)) = self.epilogue {
                    kernel(args.0.as_ptr(), first as i64, last as i64);
                }
                if let Some(producing) = self.producing {
                    producing.round(first * self.width..last * self.width);
                }
            }
            first = last;
        }
    }
}
