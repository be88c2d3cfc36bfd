//! The weight gradient of a convolution of few input channels (a stem's 3) with the
//! process's own bf16 products, from its input rows rounded once per band of output
//! rows: a window row's `K_w` taps of all channels are contiguous in the padded row (as
//! the forward reads them, see the parent module), so each output pixel's columns,
//! `K_h` runs of `K_w * channels` roundings, are copied straight from those rows into
//! the tiles' pair layout. No table of taps, no columns in f32 rounded in a second pass;
//! one product `g^T [width x pixels] . columns [pixels x taps * channels]` a band, the
//! bands of fixed tasks summed in order (as [`super::grad`]).

use std::cell::RefCell;

use nestor_ir::Window2d;
use nestor_layout::WindowImage;
use nestor_passes::Products;

use crate::amx::{Left, Panel};
use crate::bf16::PackedRight;
use crate::blas::Gemm;
use crate::parallel::{worker_threads, SendPointer};
use crate::spare::Lent;
use crate::window::{add_partials, Shape};

/// Input channels below which a weight gradient runs here (wider ones pack whole
/// 16-channel chunks of their columns from the roundings, `crate::columns`).
const CHANNELS: usize = 16;

/// Whether the weight gradient of a convolution of `shape` over `window` in `groups`
/// groups with `products` runs here: bf16 products on the process's own units, fewer
/// than [`CHANNELS`] input channels, no groups nor dilation along rows, no way forced
/// by `NESTOR_CONV`, and AVX-512 (the pairs are interleaved in its registers).
pub(crate) fn pays(shape: Shape, window: &Window2d, (groups, products): (usize, Products)) -> bool {
    products == Products::Bf16
        && crate::bf16::own_products()
        && crate::columns::forced_way().is_none()
        && groups <= 1
        && window.dilation[1] == 1
        && (1..CHANNELS).contains(&shape.channels)
        && host_has_vectors()
}

#[cfg(target_arch = "x86_64")]
fn host_has_vectors() -> bool {
    std::is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn host_has_vectors() -> bool {
    false
}

/// Bytes of partial sums [`weight_grad`] keeps for `images` (one set a task).
pub(crate) fn partial_bytes(shape: Shape, _: &Window2d, images: &[WindowImage]) -> usize {
    super::grad::tasks(images)
        .len()
        .saturating_mul(shape.width)
        .saturating_mul(shape.taps.saturating_mul(shape.channels))
        .saturating_mul(4)
}

thread_local! {
    /// A thread's padded input rows, and the columns of two pixels.
    static ROWS: RefCell<(Vec<u16>, [Vec<u16>; 2])> = const {
        RefCell::new((Vec::new(), [Vec::new(), Vec::new()]))
    };
}

/// `out [width, channels, K_h, K_w] = sum over output pixels of g x` for a convolution
/// [`pays`] says runs here (see the module's doc).
///
/// # Safety
/// `out` must hold `width * channels * taps` values, `g` `width` per output pixel of
/// `images`, `x` `channels` per input pixel; [`pays`] must hold.
pub(crate) unsafe fn weight_grad(
    (out, x, g): (*mut f32, *const f32, *const f32),
    (images, window): (&[WindowImage], Window2d),
    shape: Shape,
) {
    let Shape {
        channels,
        width,
        taps,
    } = shape;
    let inner = taps * channels;
    let size = width * inner;
    let tasks = super::grad::tasks(images);
    // Every value is written: each task's first band overwrites its sums.
    let mut partials = Lent::<f32>::new(tasks.len() * size);
    let partial = SendPointer(partials.as_mut_ptr());
    let pixels = nestor_layout::pixels(images).1;
    let macs = pixels.saturating_mul(size);
    let threads = if macs >= crate::Parallelism::current().gemm_macs {
        worker_threads().max(1) as usize
    } else {
        1
    };
    // The gradient every band reads transposed, rounded once (or kept by the run).
    // SAFETY: `g` holds every output pixel's `width` values.
    let rounded_g =
        unsafe { <f32 as Gemm>::rounded_buffer(Products::Bf16, g, pixels * width, threads) };
    let band = Band {
        x,
        g,
        rounded_g: rounded_g.as_deref(),
        shape,
        window,
    };
    crate::team::for_each_chunk(tasks.len(), threads, &|index| {
        // SAFETY: task `index` owns its partial sums.
        let sums = unsafe { partial.get().add(index * size) };
        for (first, (image, rows)) in tasks[index].iter().cloned().enumerate() {
            // SAFETY: as the caller vouches; the sums are this task's.
            unsafe { band.sums(images[image], rows, (sums, first > 0)) };
        }
    });
    // SAFETY: `out` holds the weight (as the caller vouches).
    unsafe {
        add_partials(
            out,
            (&mut partials, size),
            (shape, 1),
            |partial, o, c, t| partial[o * inner + t * channels + c],
        )
    };
}

/// What every band reads.
struct Band<'a> {
    x: *const f32,
    g: *const f32,
    rounded_g: Option<&'a crate::bf16::RoundedBuffer>,
    shape: Shape,
    window: Window2d,
}

// SAFETY: bands only read the buffers (each task writes its own sums).
unsafe impl Sync for Band<'_> {}

impl Band<'_> {
    /// `sums [width x taps * channels] (+)= g^T columns` over output rows `band` of
    /// `image` (added to the sums when `add`).
    ///
    /// # Safety
    /// The buffers as [`weight_grad`]'s caller vouches; `sums` this task's.
    unsafe fn sums(
        &self,
        image: WindowImage,
        band: std::ops::Range<i64>,
        (sums, add): (*mut f32, bool),
    ) {
        let Shape {
            channels,
            width,
            taps,
        } = self.shape;
        let window = &self.window;
        let [kernel_h, kernel_w] = window.kernel.map(|k| k.max(0) as usize);
        let stride = window.stride[1].max(1) as usize;
        let out_width = image.out.1.max(0) as usize;
        let count = (band.end - band.start).max(0) as usize * out_width;
        let run = kernel_w * channels;
        // A padded row: what the last pixel's window reads, from the left padding on.
        let row_values = (out_width.saturating_sub(1) * stride) * channels + run;
        let (low, high) = super::band_rows(window, image.size.0, &band);
        ROWS.with_borrow_mut(|(rows, columns)| {
            let input_rows = (high - low + 1).max(0) as usize;
            rows.resize(input_rows * row_values, 0);
            for (row, y) in rows.chunks_exact_mut(row_values.max(1)).zip(low..) {
                // SAFETY: `y` is a row of the image, whose pixels `x` holds.
                unsafe {
                    super::round_padded_row((self.x, image, y), (channels, window.padding[1]), row)
                };
            }
            let inner = taps * channels;
            for column in columns.iter_mut() {
                column.resize(inner.next_multiple_of(16), 0);
                column[inner..].fill(0);
            }
            // Output pixel `p` of the band: its window rows' runs, or zeros.
            let pixel_columns = |p: usize, column: &mut [u16]| {
                if p >= count {
                    return column.fill(0);
                }
                let oy = band.start + (p / out_width) as i64;
                let ox = p % out_width;
                for (ky, out) in column
                    .chunks_exact_mut(run.max(1))
                    .take(kernel_h)
                    .enumerate()
                {
                    let y = super::window_row(window, oy, ky as i64);
                    if (low..=high).contains(&y) {
                        let at = (y - low) as usize * row_values + ox * stride * channels;
                        out.copy_from_slice(&rows[at..at + run]);
                    } else {
                        out.fill(0);
                    }
                }
            };
            let packed = PackedRight::packed_by(|panel| {
                // SAFETY: the host has AVX-512F (`pays`).
                unsafe { pack_pixel_pairs(panel, (count, inner), columns, pixel_columns) }
            });
            let Some(packed) = packed else {
                return;
            };
            let first_pixel = image.output + band.start.max(0) as usize * out_width;
            // SAFETY: the band's `count` output pixels' rows of `g` are contiguous from
            // `first_pixel`; the sums hold `width x inner` (the caller vouches).
            unsafe {
                let g = (self.g.add(first_pixel * width), 1, width as isize);
                packed.product(
                    ((width, count, inner), 1.0),
                    Left::Values((g, self.rounded_g)),
                    ((sums, inner as isize, 1), add),
                )
            }
        });
    }
}

/// Packs `b [count x inner]` whose row `p` `pixel_columns` writes (into a buffer of
/// `inner` rounded up to 16 values, zeros past `inner`) in the tiles' pair layout: two
/// pixels' columns a pair of rows, 16 columns at a time interleaved in registers.
///
/// # Safety
/// The host must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_pixel_pairs(
    panel: &mut Panel,
    (count, inner): (usize, usize),
    [even, odd]: &mut [Vec<u16>; 2],
    pixel_columns: impl Fn(usize, &mut [u16]),
) {
    use std::arch::x86_64::*;
    panel.shape((count, inner));
    for pair in 0..panel.depth() / 2 {
        pixel_columns(2 * pair, &mut even[..inner]);
        pixel_columns(2 * pair + 1, &mut odd[..inner]);
        for (block, (even, odd)) in even.chunks_exact(16).zip(odd.chunks_exact(16)).enumerate() {
            // SAFETY: 16 values each; the host has AVX-512F.
            unsafe {
                let widen = |values: &[u16]| {
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(values.as_ptr() as *const __m256i))
                };
                let pairs = _mm512_or_si512(widen(even), _mm512_slli_epi32::<16>(widen(odd)));
                let out = panel.pairs_mut(pair, block);
                _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, pairs);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn pack_pixel_pairs(
    _: &mut Panel,
    _: (usize, usize),
    _: &mut [Vec<u16>; 2],
    _: impl Fn(usize, &mut [u16]),
) {
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weight gradient of few channels equals the f64 sum of the products of the
    /// roundings (exact products; only the sums' order differs): a stem's 7x7 window
    /// with stride 2, windows with padding, strides and dilation between rows, images of
    /// one pixel and of rows wider than a band's tile, 1 to 15 channels, widths not a
    /// multiple of 16; the task's later bands add to its first's sums.
    #[test]
    fn narrow_weight_gradients_are_the_sums_of_the_products_of_the_roundings() {
        let window = |kernel, stride, padding, dilation| Window2d {
            kernel,
            stride,
            padding,
            dilation,
        };
        let windows = [
            window([7, 7], [2, 2], [3, 3], [1, 1]),
            window([3, 3], [1, 1], [1, 1], [1, 1]),
            window([3, 2], [2, 1], [1, 0], [2, 1]),
        ];
        let (heights, widths) = ([40i64, 1, 3, 9], [37i64, 1, 70, 2]);
        for window in windows {
            for (channels, width) in [(3, 64), (1, 5), (15, 18)] {
                let taps = window.taps() as usize;
                let shape = Shape {
                    channels,
                    width,
                    taps,
                };
                if !pays(shape, &window, (1, Products::Bf16)) {
                    assert!(!crate::bf16::own_products() || !host_has_vectors());
                    return;
                }
                super::super::assert_weight_grad_is_the_definition(
                    weight_grad,
                    (&heights, &widths),
                    (window, shape),
                    None,
                );
            }
        }
    }
}
