//! Convolutions as GEMMs over gathered window columns: a tile of output pixels' taps
//! copied into a `[pixels, taps * channels]` matrix (zeros outside the image) and
//! multiplied with the weight on the host's GEMM (`crate::blas`: MKL or the `gemm`
//! crate; bf16 products on the bf16 units). At ResNet's channel counts (64 to 2048) the
//! work is the GEMM's, where the direct kernel (`crate::conv`, built for 16 channels)
//! reaches a fraction of it. The forward convolution, the weight's gradient (per block of
//! [`GRAD_BLOCK_ROWS`] pixels, the blocks' sums added in order, as the direct kernel's)
//! and a strided convolution's input gradient (the columns' gradient added back into
//! the pixels they were gathered from, image by image).

use nestor_layout::{fill_taps, Outside, WindowImage, WindowTaps};
use nestor_passes::Products;

use crate::blas::Gemm;
use crate::parallel::worker_threads;
use crate::window::{Shape, GRAD_BLOCK_ROWS};
use nestor_ir::Window2d;

/// Output pixels whose columns are gathered and multiplied at once (on a 2-core Xeon,
/// ResNet-50's 3x3 convolutions ran at 200-235 GFLOP/s in tiles of 128 pixels, 235-275
/// in tiles of 512, less again in tiles of 1024).
const TILE_ROWS: usize = 512;

/// Whether a convolution of this shape runs as GEMMs over columns rather than the
/// direct kernel: from 16 input and 32 output channels (the direct kernel is the faster
/// at the 16-channel convolutions it was built for and at a stem's 3 input channels). `NESTOR_CONV=direct` or
/// `NESTOR_CONV=columns` forces one way (to compare them).
pub(crate) fn columns_pay(shape: Shape) -> bool {
    if crate::process::env_is("NESTOR_CONV", "direct") {
        return false;
    }
    if crate::process::env_is("NESTOR_CONV", "columns") {
        return true;
    }
    shape.width >= 32 && shape.channels >= 16
}

/// A pointer shared by the team's tasks (each reads, or writes its own part).
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: the tasks sharing one write disjoint parts of it (see each use).
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}

impl<T> Shared<T> {
    // A method, so that closures capture the whole (Sync) struct, not its pointer.
    fn get(self) -> *mut T {
        self.0
    }
}

/// `weight [outs, ins, taps]` as `[outs, taps, ins]`: the order of a columns row (tap
/// after tap, each an input pixel's channels).
fn taps_major<T: Copy>(weight: &[T], (outs, ins, taps): (usize, usize, usize)) -> Vec<T> {
    let mut by_tap = Vec::with_capacity(weight.len());
    for o in 0..outs {
        let row = &weight[o * ins * taps..][..ins * taps];
        for t in 0..taps {
            by_tap.extend((0..ins).map(|c| row[c * taps + t]));
        }
    }
    by_tap
}

/// Copies every tap's input pixel (`channels` values of `x`; zeros for a tap outside
/// its image, `-1`) into `columns`, row after row.
///
/// # Safety
/// `x` must hold every pixel the taps name.
unsafe fn gather<T: Gemm>(x: *const T, taps: &[i64], channels: usize, columns: &mut [T]) {
    for (column, &source) in columns.chunks_exact_mut(channels.max(1)).zip(taps) {
        if source < 0 {
            column.fill(T::ZERO);
        } else {
            // SAFETY: the taps name pixels of `x`.
            let pixel =
                unsafe { std::slice::from_raw_parts(x.add(source as usize * channels), channels) };
            column.copy_from_slice(pixel);
        }
    }
}

/// The team's threads for `macs` multiply-adds: all of them when worth splitting.
fn threads_for(macs: usize) -> usize {
    if macs >= crate::Parallelism::current().gemm_macs {
        let threads = worker_threads().max(1) as usize;
        if threads > 1 {
            crate::Parallelism::count_split();
        }
        threads
    } else {
        1
    }
}

/// Runs `task(tiles, columns)` over ranges of the `tiles`, a few per thread (so that
/// uneven work still balances), each range given its own `columns` of `scratch` values.
fn for_each_tile_range<T: Gemm>(
    tiles: usize,
    threads: usize,
    scratch: usize,
    task: &(dyn Fn(std::ops::Range<usize>, &mut [T]) + Sync),
) {
    let per_task = tiles.div_ceil(threads * 4).max(1);
    crate::team::for_each_chunk(tiles.div_ceil(per_task), threads, &|chunk| {
        let mut columns = vec![T::ZERO; scratch];
        task(
            chunk * per_task..((chunk + 1) * per_task).min(tiles),
            &mut columns,
        );
    });
}

/// [`crate::window`]'s convolution as GEMMs over columns: every tile of output pixels'
/// columns times the weight (`[width, channels, taps]`), on top of the bias.
///
/// # Safety
/// `out` must hold every output pixel of `images` times `width` values, `x` every input
/// pixel times `channels`, the weight `width * channels * taps` and the bias `width`.
pub(crate) unsafe fn convolve<T: Gemm>(
    (out, x): (*mut T, *const T),
    (weight, bias): (&[T], Option<&[T]>),
    images: &[WindowImage],
    shape: Shape,
    (window, products): (Window2d, Products),
) {
    let Shape {
        channels,
        width,
        taps,
    } = shape;
    let inner = taps * channels;
    let rows = images
        .last()
        .map_or(0, |last| last.output + (last.out.0 * last.out.1) as usize);
    let by_tap = taps_major(weight, (width, channels, taps));
    let (out, x) = (Shared(out), Shared(x as *mut T));
    let tiles = rows.div_ceil(TILE_ROWS);
    let macs = rows.saturating_mul(inner).saturating_mul(width);
    // Few tiles (small images, late stages) also split the output channels, so that
    // every thread has work: parts of at least 64 channels.
    let threads = threads_for(macs);
    let parts = match tiles {
        0 => 1,
        _ if tiles >= 2 * threads => 1,
        _ => (2 * threads).div_ceil(tiles).min(width / 64).max(1),
    };
    let part_width = width.div_ceil(parts);
    // A 1x1 window without stride or padding reads every pixel as its own column.
    let pointwise = taps == 1 && window.stride == [1, 1] && window.padding == [0, 0];
    let scratch = if pointwise { 0 } else { TILE_ROWS * inner };
    for_each_tile_range::<T>(tiles * parts, threads, scratch, &|range, columns| {
        let mut table = vec![-1i64; if pointwise { 0 } else { TILE_ROWS * taps }];
        for unit in range {
            let (first, part) = (unit / parts * TILE_ROWS, unit % parts);
            let count = TILE_ROWS.min(rows - first);
            let (start, end) = (part * part_width, ((part + 1) * part_width).min(width));
            let a = if pointwise {
                // SAFETY: `x` holds a pixel (`channels` values) per output pixel.
                unsafe { x.get().add(first * channels) as *const T }
            } else {
                let table = &mut table[..count * taps];
                fill_taps(&window, images, first, table, Outside::Marked);
                let columns = &mut columns[..count * inner];
                // SAFETY: `x` holds every pixel the taps name.
                unsafe { gather(x.get(), table, channels, columns) };
                columns.as_ptr()
            };
            // SAFETY: columns `start..end` of rows `first..first + count` of `out` are
            // this unit's alone; the weight holds `width` rows of `inner`.
            unsafe {
                let c = out.get().add(first * width + start);
                if let Some(bias) = bias {
                    for row in 0..count {
                        let to = c.add(row * width);
                        std::ptr::copy_nonoverlapping(bias[start..].as_ptr(), to, end - start);
                    }
                }
                T::product_rounded(
                    products,
                    ((count, inner, end - start), T::ONE),
                    (
                        ((a, inner as isize, 1), None),
                        (
                            (by_tap.as_ptr().add(start * inner), 1, inner as isize),
                            None,
                        ),
                    ),
                    ((c, width as isize, 1), bias.is_some()),
                );
            }
        }
    });
}

/// [`crate::window`]'s weight gradient as GEMMs: per block of [`GRAD_BLOCK_ROWS`]
/// output pixels, the gradient's rows (transposed) times their columns, tile after
/// tile; the blocks' sums added in order, each output channel's over its group's input
/// channels.
///
/// # Safety
/// `out` must hold `width * channels / groups * taps` values, `g` a row of `width` per
/// output pixel of `taps`, `x` every row the taps name.
pub(crate) unsafe fn weight_grad<T: Gemm>(
    (out, x, g): (*mut T, *const T, *const T),
    taps: &WindowTaps,
    shape: Shape,
    (groups, products): (usize, Products),
) {
    let Shape {
        channels,
        width,
        taps: per_window,
    } = shape;
    let inner = per_window * channels;
    let rows = taps.rows.len() / per_window.max(1);
    let size = width * inner;
    let blocks = rows.div_ceil(GRAD_BLOCK_ROWS);
    let mut partials = vec![T::ZERO; blocks * size];
    let (sums, x, g) = (
        Shared(partials.as_mut_ptr()),
        Shared(x as *mut T),
        Shared(g as *mut T),
    );
    let macs = rows.saturating_mul(size);
    for_each_tile_range::<T>(
        blocks,
        threads_for(macs),
        TILE_ROWS * inner,
        &|range, columns| {
            for block in range {
                let end = ((block + 1) * GRAD_BLOCK_ROWS).min(rows);
                for first in (block * GRAD_BLOCK_ROWS..end).step_by(TILE_ROWS) {
                    let count = TILE_ROWS.min(end - first);
                    let columns = &mut columns[..count * inner];
                    // SAFETY: block `block` owns its partial sums; `x` holds every pixel the
                    // taps name, `g` every output pixel's row.
                    unsafe {
                        let table = &taps.rows[first * per_window..(first + count) * per_window];
                        gather(x.get(), table, channels, columns);
                        T::product_rounded(
                            products,
                            ((width, count, inner), T::ONE),
                            (
                                ((g.get().add(first * width), 1, width as isize), None),
                                ((columns.as_ptr(), inner as isize, 1), None),
                            ),
                            (
                                (sums.get().add(block * size), inner as isize, 1),
                                first > block * GRAD_BLOCK_ROWS,
                            ),
                        );
                    }
                }
            }
        },
    );
    // Each output channel's gradient is over its group's input channels: `reads` from
    // `o / (width / groups) * reads`.
    let groups = groups.max(1);
    let (reads, writes) = (channels / groups, (width / groups).max(1));
    // SAFETY: `out` holds `width * channels / groups * taps` values.
    let out = unsafe { std::slice::from_raw_parts_mut(out, width * reads * per_window) };
    out.fill(T::ZERO);
    for partial in partials.chunks(size.max(1)) {
        for o in 0..width {
            let base = o / writes * reads;
            let row = &partial[o * inner..][..inner];
            for k in 0..reads {
                for t in 0..per_window {
                    out[(o * reads + k) * per_window + t] += row[t * channels + base + k];
                }
            }
        }
    }
}

/// A strided convolution's input gradient as GEMMs: every tile of output pixels'
/// gradients (`channels` each) times the weight (`[channels, width, taps]`, dense) gives
/// their columns' gradient, added to the input pixels (`width` values each) the columns
/// were gathered from. Images in parallel, each in order (their columns come from their
/// own pixels).
///
/// # Safety
/// `out` must hold every input pixel of `images` times `width` values, `g` every output
/// pixel times `channels`, `weight` `channels * width * taps`; the taps must be those of
/// `images`.
pub(crate) unsafe fn strided_input_grad<T: Gemm>(
    (out, g): (*mut T, *const T),
    weight: &[T],
    (taps, images): (&WindowTaps, &[WindowImage]),
    shape: Shape,
    products: Products,
) {
    let Shape {
        channels,
        width,
        taps: per_window,
    } = shape;
    let inner = per_window * width;
    let by_tap = taps_major(weight, (channels, width, per_window));
    let (out, g) = (Shared(out), Shared(g as *mut T));
    let macs = taps.rows.len().saturating_mul(channels * width);
    for_each_tile_range::<T>(
        images.len(),
        threads_for(macs),
        TILE_ROWS * inner,
        &|range, columns| {
            for image in &images[range] {
                let pixels = (image.size.0 * image.size.1) as usize;
                let outputs = (image.out.0 * image.out.1) as usize;
                // SAFETY: the image owns its input pixels' rows of `out`.
                let pixels = unsafe {
                    std::slice::from_raw_parts_mut(
                        out.get().add(image.input * width),
                        pixels * width,
                    )
                };
                pixels.fill(T::ZERO);
                for first in (image.output..image.output + outputs).step_by(TILE_ROWS) {
                    let count = TILE_ROWS.min(image.output + outputs - first);
                    let columns = &mut columns[..count * inner];
                    // SAFETY: `g` holds every output pixel's row; `columns` is this task's.
                    unsafe {
                        T::product_rounded(
                            products,
                            ((count, channels, inner), T::ONE),
                            (
                                ((g.get().add(first * channels), channels as isize, 1), None),
                                ((by_tap.as_ptr(), inner as isize, 1), None),
                            ),
                            ((columns.as_mut_ptr(), inner as isize, 1), false),
                        );
                    }
                    let table = &taps.rows[first * per_window..(first + count) * per_window];
                    for (column, &source) in columns.chunks_exact(width.max(1)).zip(table) {
                        if source >= 0 {
                            let pixel =
                                &mut pixels[(source as usize - image.input) * width..][..width];
                            for (value, &gradient) in pixel.iter_mut().zip(column) {
                                *value += gradient;
                            }
                        }
                    }
                }
            }
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use nestor_layout::{window_images, window_taps};

    fn windows() -> [Window2d; 4] {
        let window = |kernel, stride, padding, dilation| Window2d {
            kernel,
            stride,
            padding,
            dilation,
        };
        [
            window([3, 3], [1, 1], [1, 1], [1, 1]),
            window([3, 2], [2, 2], [1, 0], [1, 2]),
            window([1, 1], [1, 1], [0, 0], [1, 1]),
            window([1, 1], [2, 2], [0, 0], [1, 1]),
        ]
    }

    /// A value of a test buffer.
    fn value<T: Gemm>(i: usize, scale: f64) -> T {
        T::from_f64(((i * 37 % 101) as f64 - 50.0) * scale + 0.001)
    }

    /// The forward convolution, the weight's gradient (groups 1 and 2) and the strided
    /// input gradient over columns against their definitions in f64 over the window's
    /// taps: an image spanning several tiles, images of one pixel, windows leaving the
    /// image, strides and dilation, 1x1 windows read in place, and few tiles whose
    /// output channels are split.
    fn check<T: Gemm + Into<f64>>(tolerance: f64) {
        let (heights, widths) = ([31i64, 1, 4, 2], [25i64, 1, 3, 1]);
        for window in windows() {
            for (channels, width) in [(16usize, 32usize), (6, 130)] {
                let images = window_images(&window, &heights, &widths).unwrap();
                let table = window_taps(&window, &heights, &widths, Outside::Marked).unwrap();
                let last = images.last().unwrap();
                let inputs = last.input + (last.size.0 * last.size.1) as usize;
                let rows = last.output + (last.out.0 * last.out.1) as usize;
                let taps = table.taps;
                let shape = Shape {
                    channels,
                    width,
                    taps,
                };
                let x: Vec<T> = (0..inputs * channels).map(|i| value(i, 0.037)).collect();
                let weight: Vec<T> = (0..width * channels * taps)
                    .map(|i| value(i + 7, 0.011))
                    .collect();
                let bias: Vec<T> = (0..width).map(|o| value(o + 3, 0.02)).collect();
                let g: Vec<T> = (0..rows * width).map(|i| value(i + 11, 0.013)).collect();
                let f = |v: &T| -> f64 { (*v).into() };
                let tap = |r: usize, t: usize| table.rows[r * taps + t];
                let close = |got: f64, expected: f64, magnitude: f64, what: &str| {
                    assert!(
                        (got - expected).abs() <= tolerance * (1.0 + magnitude),
                        "{window:?} channels {channels} width {width} {what}: {got} against {expected}"
                    );
                };

                let mut out = vec![T::NAN; rows * width];
                let products = Products::Float;
                // SAFETY: the buffers hold the images' pixels, the weight and the bias.
                unsafe {
                    convolve(
                        (out.as_mut_ptr(), x.as_ptr()),
                        (&weight, Some(&bias)),
                        &images,
                        shape,
                        (window, products),
                    )
                };
                for r in 0..rows {
                    for o in 0..width {
                        let (mut expected, mut magnitude) = (f(&bias[o]), f(&bias[o]).abs());
                        for t in (0..taps).filter(|&t| tap(r, t) >= 0) {
                            for c in 0..channels {
                                let term = f(&x[tap(r, t) as usize * channels + c])
                                    * f(&weight[(o * channels + c) * taps + t]);
                                expected += term;
                                magnitude += term.abs();
                            }
                        }
                        close(f(&out[r * width + o]), expected, magnitude, "output");
                    }
                }

                for groups in [1usize, 2] {
                    let reads = channels / groups;
                    let mut grad = vec![T::NAN; width * reads * taps];
                    // SAFETY: the gradient holds the grouped weight; `g` a row per pixel.
                    unsafe {
                        weight_grad(
                            (grad.as_mut_ptr(), x.as_ptr(), g.as_ptr()),
                            &table,
                            shape,
                            (groups, products),
                        )
                    };
                    for o in 0..width {
                        let base = o / (width / groups) * reads;
                        for k in 0..reads {
                            for t in 0..taps {
                                let (mut expected, mut magnitude) = (0.0, 0.0);
                                for r in (0..rows).filter(|&r| tap(r, t) >= 0) {
                                    let term = f(&g[r * width + o])
                                        * f(&x[tap(r, t) as usize * channels + base + k]);
                                    expected += term;
                                    magnitude += term.abs();
                                }
                                let got = f(&grad[(o * reads + k) * taps + t]);
                                close(got, expected, magnitude, "weight gradient");
                            }
                        }
                    }
                }

                // The input's gradient: the forward's output channels are its input.
                let mut dx = vec![T::NAN; inputs * channels];
                let adjoint = Shape {
                    channels: width,
                    width: channels,
                    taps,
                };
                // SAFETY: `dx` holds every input pixel, `g` every output pixel's row.
                unsafe {
                    strided_input_grad(
                        (dx.as_mut_ptr(), g.as_ptr()),
                        &weight,
                        (&table, &images),
                        adjoint,
                        products,
                    )
                };
                let mut expected = vec![0f64; inputs * channels];
                let mut magnitude = vec![0f64; inputs * channels];
                for r in 0..rows {
                    for t in (0..taps).filter(|&t| tap(r, t) >= 0) {
                        for c in 0..channels {
                            let at = tap(r, t) as usize * channels + c;
                            for o in 0..width {
                                let term = f(&g[r * width + o])
                                    * f(&weight[(o * channels + c) * taps + t]);
                                expected[at] += term;
                                magnitude[at] += term.abs();
                            }
                        }
                    }
                }
                for at in 0..inputs * channels {
                    close(f(&dx[at]), expected[at], magnitude[at], "input gradient");
                }
            }
        }
    }

    #[test]
    fn column_products_are_the_definitions() {
        check::<f32>(1e-5);
        check::<f64>(1e-12);
    }
}
