//! Convolution with bf16 products on AMX tiles, reading each output row's input rows in
//! place: no columns. A task (an output row) rounds the input rows its window reads
//! into rows of bf16 padded with zeros on both sides; the values one window row reads
//! for an output pixel, `K_w` taps of all channels, are then contiguous there, and the
//! row of an `a` tile for 16 output pixels side by side (`stride * channels` values
//! apart). Each window row is a few tiles deep (32 of its values a tile), times the
//! weight packed once in the same order ([`Panel`]); the sums start from the bias and
//! stay in tiles over all window rows. A convolution of 16 channels (3x3: 144 values a
//! pixel) no longer spends its time gathering columns nine times the input's size, nor
//! in `vdpbf16ps`, which this kind of host issues at half the rate of f32 FMAs.

pub(crate) mod grad;
pub(crate) mod narrow;

use std::cell::RefCell;

use nestor_ir::Window2d;
use nestor_layout::WindowImage;

use nestor_passes::Products;

use crate::amx::{Configured, Panel, TILE_DEPTH};
use crate::conv::pair_of;

/// A weight gradient that sums fixed bands of output rows ([`grad`], [`narrow`]): `(out,
/// x, g)` f32 buffers, the images and window, the shape.
pub(crate) type BandedWeightGrad =
    unsafe fn((*mut f32, *const f32, *const f32), (&[WindowImage], Window2d), crate::window::Shape);

/// Rows of a tile: output pixels of a block.
const PIXELS: usize = 16;
/// Output channels of a tile of sums.
const LANES: usize = 16;
/// Tiles of sums held at once (tiles 0-3): four column blocks of one block of pixels,
/// or one column block of four blocks of pixels side by side, so that consecutive
/// `tdpbf16ps` add to different sums (with one sum, a profile showed each waiting for
/// the last) and each operand tile loaded serves four of them.
const WIDE: usize = 4;

/// Input channels from which a convolution gathers columns instead (`crate::columns`):
/// on ResNet-50 at 81% occupancy the 7x7 stem (3 channels) took 5 ms here against 13
/// over columns, the 64-channel 3x3 convolutions about as long either way, those of 256
/// channels twice as long here.
const CHANNELS: usize = 32;

/// Whether a convolution (or a stride-1 input gradient) of `channels` input channels
/// with `products` runs here: bf16 products on the process's AMX tiles, fewer than
/// [`CHANNELS`] channels, a window not dilated along rows, and no way forced by
/// `NESTOR_CONV` ([`crate::columns::forced_way`]).
pub(crate) fn pays(channels: usize, window: &Window2d, products: Products) -> bool {
    products == Products::Bf16
        && crate::amx::usable()
        && crate::columns::forced_way().is_none()
        && (1..CHANNELS).contains(&channels)
        && window.dilation[1] == 1
}

/// A convolution of f32 images with bf16 products on the tiles: the weight packed, the
/// geometry, the buffers (see the module's doc).
pub(crate) struct Plan<'a> {
    out: *mut f32,
    x: *const f32,
    /// The weight: pair rows `(window row, tile of it)` after each other, 16 of each.
    panel: Panel,
    /// The bias padded to whole column blocks (zeros when none): the sums' start.
    bias: Vec<f32>,
    channels: usize,
    width: usize,
    /// Tiles per window row (its `K_w * channels` values, 32 a tile).
    depth: usize,
    /// Values of a padded input row a task rounds (what its tiles read, see `row`).
    row_values: usize,
    window: Window2d,
    images: &'a [WindowImage],
}

// SAFETY: tasks write disjoint output rows (each its own) and only read the rest.
unsafe impl Sync for Plan<'_> {}

thread_local! {
    /// A thread's padded input rows.
    static ROWS: RefCell<Vec<u16>> = const { RefCell::new(Vec::new()) };
}

impl<'a> Plan<'a> {
    /// A plan for the weight `[width, channels, K_h, K_w]` and the bias `[width]`, or
    /// `None` where the process has no tiles ([`crate::amx::usable`]) or the window is
    /// dilated along rows (its taps' values would not be contiguous). Any number of
    /// channels runs ([`pays`] says where it is the fastest way).
    ///
    /// # Safety
    /// `weight` and `bias` must hold that many values; `out` and `x` must hold every
    /// pixel of `images` times `width` and `channels` values.
    pub(crate) unsafe fn new(
        (out, x): (*mut f32, *const f32),
        (weight, bias): (*const f32, Option<*const f32>),
        (channels, width): (usize, usize),
        window: Window2d,
        images: &'a [WindowImage],
    ) -> Option<Self> {
        if !crate::amx::usable() || window.dilation[1] != 1 || channels == 0 {
            return None;
        }
        let [kernel_h, kernel_w] = window.kernel.map(|k| k.max(0) as usize);
        let span = kernel_w * channels;
        let depth = span.div_ceil(TILE_DEPTH);
        let taps = kernel_h * kernel_w;
        // SAFETY: as the caller vouches.
        let weight = unsafe { std::slice::from_raw_parts(weight, width * channels * taps) };
        let mut panel = Panel::default();
        panel.shape((kernel_h * depth * TILE_DEPTH, width));
        // Value `s` of window row `ky` for output channel `o`: tap `(ky, s / channels)`,
        // channel `s % channels`; zero past the row's values.
        let value = |o: usize, ky: usize, s: usize| {
            if s >= span {
                return 0.0;
            }
            let (kx, c) = (s / channels, s % channels);
            weight[(o * channels + c) * taps + ky * kernel_w + kx]
        };
        for ky in 0..kernel_h {
            for pair in 0..depth * TILE_DEPTH / 2 {
                let s = 2 * pair;
                for block in 0..width.div_ceil(LANES) {
                    let pairs = panel.pairs_mut(ky * depth * TILE_DEPTH / 2 + pair, block);
                    for (j, slot) in pairs.iter_mut().enumerate() {
                        let o = block * LANES + j;
                        *slot = if o < width {
                            pair_of(value(o, ky, s), value(o, ky, s + 1))
                        } else {
                            0
                        };
                    }
                }
            }
        }
        let mut padded_bias = vec![0.0; width.next_multiple_of(LANES)];
        if let Some(bias) = bias {
            // SAFETY: the bias holds `width` values (the caller vouches).
            padded_bias[..width]
                .copy_from_slice(unsafe { std::slice::from_raw_parts(bias, width) });
        }
        // A row's tiles read `depth` tiles of values from the first pixel of each block
        // of 16, the blocks taken four at a time (at most `(64 groups - 1) * stride`
        // pixels on).
        let widest = images
            .iter()
            .map(|image| image.out.1.max(0) as usize)
            .max()
            .unwrap_or(0);
        let stride = window.stride[1].max(1) as usize;
        let row_values = (widest.next_multiple_of(WIDE * PIXELS).saturating_sub(1) * stride)
            * channels
            + depth * TILE_DEPTH;
        Some(Self {
            out,
            x,
            panel,
            bias: padded_bias,
            channels,
            width,
            depth,
            row_values,
            window,
            images,
        })
    }

    /// Output rows `band` of image `index`: the input rows they read rounded once, then
    /// row after row.
    pub(crate) fn rows(&self, index: usize, band: std::ops::Range<i64>) {
        let image = self.images[index];
        let Window2d {
            kernel, padding, ..
        } = self.window;
        let height = image.size.0;
        let y_of = |oy: i64, ky: i64| window_row(&self.window, oy, ky);
        let (low, high) = band_rows(&self.window, height, &band);
        let channels = self.channels;
        let pitch = self.row_values.next_multiple_of(TILE_DEPTH);
        ROWS.with_borrow_mut(|rows| {
            let count = (high - low + 1).max(0) as usize;
            rows.resize(count * pitch, 0);
            // Each row: zeros left of the image (its padding), the image row's pixels
            // rounded, zeros to its end.
            for (row, y) in rows.chunks_exact_mut(pitch).zip(low..) {
                // SAFETY: `y` is a row of the image, whose pixels `x` holds.
                unsafe {
                    round_padded_row(
                        (self.x, image, y),
                        (channels, padding[1]),
                        &mut row[..self.row_values],
                    )
                };
            }
            let _tiles = Configured::new();
            // The sums of blocks that are not all this row's (written by the tiles before
            // they are read): once a band, not zeroed again for every row.
            let mut spill = [0f32; PIXELS * LANES * WIDE];
            for oy in band {
                // The window rows inside the image, `first..` (`y` grows with `ky`).
                let inside = |ky: &i64| (0..height).contains(&y_of(oy, *ky));
                let first = (0..kernel[0]).find(inside).unwrap_or(0);
                let rows_inside = (first..kernel[0]).take_while(inside).count();
                let row = (y_of(oy, first) - low).max(0) as usize * pitch;
                self.row(
                    image,
                    oy,
                    (rows.as_ptr().wrapping_add(row), pitch),
                    (first, rows_inside),
                    &mut spill,
                );
            }
        });
    }

    /// Output row `oy` of `image` from the padded input rows `rows` (`pitch` values
    /// apart): window rows `first..first + count` read.
    fn row(
        &self,
        image: WindowImage,
        oy: i64,
        (rows, pitch): (*const u16, usize),
        (first, rows_inside): (i64, usize),
        spill: &mut [f32; PIXELS * LANES * WIDE],
    ) {
        let pixel_step = self.window.stride[1].max(1) as usize * self.channels;
        let pitch = pitch * self.window.dilation[0].max(1) as usize;
        let out_width = image.out.1.max(0) as usize;
        let first_pixel = image.output + oy as usize * out_width;
        let blocks = self.width.div_ceil(LANES);
        let first_pair_row = first as usize * self.depth * TILE_DEPTH / 2;
        for ox in (0..out_width).step_by(WIDE * PIXELS) {
            let count = (out_width - ox).min(WIDE * PIXELS);
            // Read only with rows inside the image (then within them: see `new`).
            let a = (rows.wrapping_add(ox * pixel_step), pixel_step * 2);
            let mut block = 0;
            while block < blocks {
                // Four column blocks of each block of pixels, or one column block of
                // all of them at once.
                let (pixel_blocks, wide) = if blocks - block >= WIDE {
                    (count.div_ceil(PIXELS), WIDE)
                } else {
                    (1, 1)
                };
                let columns = (self.width - block * LANES).min(wide * LANES);
                let b = self
                    .panel
                    .column_block(block)
                    .wrapping_add(first_pair_row * LANES);
                for pixel_block in 0..pixel_blocks {
                    let (first, count) = if wide == WIDE {
                        let first = pixel_block * PIXELS;
                        (first, (count - first).min(PIXELS))
                    } else {
                        (0, count)
                    };
                    // Straight into the output when the tiles' rows and columns are
                    // all its own, else through `spill`.
                    let direct = count == WIDE * PIXELS / wide && columns == wide * LANES;
                    let at = (first_pixel + ox + first) * self.width + block * LANES;
                    let sum_stride = if direct { self.width } else { wide * LANES } * 4;
                    let walk = Walk {
                        depth: self.depth,
                        pitch: pitch * 2,
                        b_block: self.panel.block() * 4,
                        sum_stride,
                        sums: if direct {
                            self.out.wrapping_add(at)
                        } else {
                            spill.as_mut_ptr()
                        },
                        bias: self.bias[block * LANES..].as_ptr(),
                        a_block: PIXELS * a.1,
                        sum_block: PIXELS * sum_stride,
                    };
                    let a = (a.0.wrapping_add(first * pixel_step), a.1);
                    // SAFETY: the output pixels `first_pixel + ox..` of this row are
                    // this task's; `a` reads `depth` tiles from the first pixel of
                    // each of its blocks within `row_values` (see `new`); the panel
                    // holds every window row.
                    unsafe {
                        if wide == WIDE {
                            multiply_columns_4(&walk, a, b, rows_inside);
                        } else if count > PIXELS {
                            multiply_pixels_4(&walk, a, b, rows_inside);
                        } else {
                            multiply_pixels_1(&walk, a, b, rows_inside);
                        }
                        if !direct && columns == self.width && columns == wide * LANES {
                            // Rows of the spill and of the output alike: one copy.
                            std::ptr::copy_nonoverlapping(
                                spill.as_ptr(),
                                self.out.add(at),
                                count * columns,
                            );
                        } else if !direct {
                            for pixel in 0..count {
                                std::ptr::copy_nonoverlapping(
                                    spill.as_ptr().add(pixel * wide * LANES),
                                    self.out.add(at + pixel * self.width),
                                    columns,
                                );
                            }
                        }
                    }
                }
                block += wide;
            }
        }
    }
}

/// The input row that window row `ky` of output row `oy` reads (it grows with both).
pub(crate) fn window_row(window: &Window2d, oy: i64, ky: i64) -> i64 {
    oy * window.stride[0] - window.padding[0] + ky * window.dilation[0]
}

/// The first and last input rows inside an image of `height` rows that output rows
/// `band` read (the last before the first when none is).
pub(crate) fn band_rows(window: &Window2d, height: i64, band: &std::ops::Range<i64>) -> (i64, i64) {
    (
        window_row(window, band.start, 0).max(0),
        window_row(window, band.end - 1, window.kernel[0] - 1).min(height - 1),
    )
}

/// Input row `y` of `image` (pixels of `channels` values at `x`) rounded to bf16 into
/// `row`: `left` pixels of zeros (the window's padding), the row's values (as many as
/// fit), zeros to the end.
///
/// # Safety
/// `y` must be a row of `image`, whose pixels `x` holds.
pub(crate) unsafe fn round_padded_row(
    (x, image, y): (*const f32, WindowImage, i64),
    (channels, left): (usize, i64),
    row: &mut [u16],
) {
    let width = image.size.1.max(0) as usize;
    let left = (left.max(0) as usize * channels).min(row.len());
    let values = (width * channels).min(row.len() - left);
    // SAFETY: as the caller vouches.
    let source = unsafe {
        std::slice::from_raw_parts(x.add((image.input + y as usize * width) * channels), values)
    };
    row[..left].fill(0);
    crate::bf16::round_line(source, &mut row[left..left + values]);
    row[left + values..].fill(0);
}

/// Where the kernels start and write their sums and how they walk the operands
/// (bytes): read from memory, which keeps them within the registers x86-64 has.
#[repr(C)]
struct Walk {
    /// Tiles per window row.
    depth: usize,
    /// Between the first values of two window rows of `a`.
    pitch: usize,
    /// Between two column blocks of the panel.
    b_block: usize,
    /// Between two rows of the sums.
    sum_stride: usize,
    /// The sums' first row, and the bias (a row of them, read for every row).
    sums: *mut f32,
    bias: *const f32,
    /// Between two blocks of 16 pixels of `a`, and of the sums.
    a_block: usize,
    sum_block: usize,
}

/// `sums [16 x 16] = bias + sum over window rows r and tiles t of a_{r,t} b_{r,t}`:
/// `a_{r,t}` 16 rows of 32 bf16 at `a + r pitch + 64 t` (rows `a_stride` bytes apart),
/// `b_{r,t}` the 16 pair rows at `b + 1024 (r depth + t)` (see [`Walk`]).
///
/// # Safety
/// The tiles must be configured ([`Configured`]); `depth` at least 1; every operand
/// valid for what it is read and written as.
#[inline(always)]
unsafe fn multiply_pixels_1(
    walk: &Walk,
    (a, a_stride): (*const u16, usize),
    b: *const u32,
    rows: usize,
) {
    unsafe {
        std::arch::asm!(
            "mov {p}, [{walk} + 40]",
            "xor {t:e}, {t:e}",
            "tileloadd tmm0, [{p} + {t}*1]",
            "test {rows}, {rows}",
            "jz 4f",
            "2:",
            "mov {p}, {a}",
            "mov {t}, [{walk}]",
            "3:",
            "tileloadd tmm4, [{p} + {a_stride}*1]",
            "tileloadd tmm5, [{b} + {row}*1]",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "add {p}, 64",
            "add {b}, 1024",
            "dec {t}",
            "jnz 3b",
            "add {a}, [{walk} + 8]",
            "dec {rows}",
            "jnz 2b",
            "4:",
            "mov {p}, [{walk} + 32]",
            "mov {t}, [{walk} + 24]",
            "tilestored [{p} + {t}*1], tmm0",
            walk = in(reg) walk,
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            rows = inout(reg) rows => _,
            p = out(reg) _,
            t = out(reg) _,
            a_stride = in(reg) a_stride,
            row = in(reg) 64usize,
            options(nostack),
        );
    }
}

/// [`multiply_pixels_1`] for four blocks of 16 pixels side by side (`a_block` bytes
/// apart in `a`, `sum_block` in the sums), each `b` tile read once for the four.
///
/// # Safety
/// As [`multiply_pixels_1`], for every block.
#[inline(always)]
unsafe fn multiply_pixels_4(
    walk: &Walk,
    (a, a_stride): (*const u16, usize),
    b: *const u32,
    rows: usize,
) {
    unsafe {
        std::arch::asm!(
            "mov {p}, [{walk} + 40]",
            "xor {t:e}, {t:e}",
            "tileloadd tmm0, [{p} + {t}*1]",
            "tileloadd tmm1, [{p} + {t}*1]",
            "tileloadd tmm2, [{p} + {t}*1]",
            "tileloadd tmm3, [{p} + {t}*1]",
            "test {rows}, {rows}",
            "jz 4f",
            "2:",
            "mov {p}, {a}",
            "mov {t}, [{walk}]",
            "3:",
            "tileloadd tmm7, [{b} + {row}*1]",
            "tileloadd tmm4, [{p} + {a_stride}*1]",
            "tdpbf16ps tmm0, tmm4, tmm7",
            "mov {q}, {p}",
            "add {q}, [{walk} + 48]",
            "tileloadd tmm5, [{q} + {a_stride}*1]",
            "tdpbf16ps tmm1, tmm5, tmm7",
            "add {q}, [{walk} + 48]",
            "tileloadd tmm6, [{q} + {a_stride}*1]",
            "tdpbf16ps tmm2, tmm6, tmm7",
            "add {q}, [{walk} + 48]",
            "tileloadd tmm4, [{q} + {a_stride}*1]",
            "tdpbf16ps tmm3, tmm4, tmm7",
            "add {p}, 64",
            "add {b}, 1024",
            "dec {t}",
            "jnz 3b",
            "add {a}, [{walk} + 8]",
            "dec {rows}",
            "jnz 2b",
            "4:",
            "mov {p}, [{walk} + 32]",
            "mov {t}, [{walk} + 24]",
            "tilestored [{p} + {t}*1], tmm0",
            "add {p}, [{walk} + 56]",
            "tilestored [{p} + {t}*1], tmm1",
            "add {p}, [{walk} + 56]",
            "tilestored [{p} + {t}*1], tmm2",
            "add {p}, [{walk} + 56]",
            "tilestored [{p} + {t}*1], tmm3",
            walk = in(reg) walk,
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            rows = inout(reg) rows => _,
            p = out(reg) _,
            q = out(reg) _,
            t = out(reg) _,
            a_stride = in(reg) a_stride,
            row = in(reg) 64usize,
            options(nostack),
        );
    }
}

/// [`multiply_pixels_1`] for four column blocks of sums (`b_block` bytes apart in the
/// panel, 64 bytes apart in the sums and the bias): each `a` tile read once for four.
///
/// # Safety
/// As [`multiply_pixels_1`], for every block.
#[inline(always)]
unsafe fn multiply_columns_4(
    walk: &Walk,
    (a, a_stride): (*const u16, usize),
    b: *const u32,
    rows: usize,
) {
    unsafe {
        std::arch::asm!(
            "mov {p}, [{walk} + 40]",
            "xor {t:e}, {t:e}",
            "tileloadd tmm0, [{p} + {t}*1]",
            "tileloadd tmm1, [{p} + {t}*1 + 64]",
            "tileloadd tmm2, [{p} + {t}*1 + 128]",
            "tileloadd tmm3, [{p} + {t}*1 + 192]",
            "test {rows}, {rows}",
            "jz 4f",
            "2:",
            "mov {p}, {a}",
            "mov {t}, [{walk}]",
            "3:",
            "tileloadd tmm4, [{p} + {a_stride}*1]",
            "mov {q}, {b}",
            "tileloadd tmm5, [{q} + {row}*1]",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "add {q}, [{walk} + 16]",
            "tileloadd tmm6, [{q} + {row}*1]",
            "tdpbf16ps tmm1, tmm4, tmm6",
            "add {q}, [{walk} + 16]",
            "tileloadd tmm7, [{q} + {row}*1]",
            "tdpbf16ps tmm2, tmm4, tmm7",
            "add {q}, [{walk} + 16]",
            "tileloadd tmm5, [{q} + {row}*1]",
            "tdpbf16ps tmm3, tmm4, tmm5",
            "add {p}, 64",
            "add {b}, 1024",
            "dec {t}",
            "jnz 3b",
            "add {a}, [{walk} + 8]",
            "dec {rows}",
            "jnz 2b",
            "4:",
            "mov {p}, [{walk} + 32]",
            "mov {t}, [{walk} + 24]",
            "tilestored [{p} + {t}*1], tmm0",
            "tilestored [{p} + {t}*1 + 64], tmm1",
            "tilestored [{p} + {t}*1 + 128], tmm2",
            "tilestored [{p} + {t}*1 + 192], tmm3",
            walk = in(reg) walk,
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            rows = inout(reg) rows => _,
            p = out(reg) _,
            q = out(reg) _,
            t = out(reg) _,
            a_stride = in(reg) a_stride,
            row = in(reg) 64usize,
            options(nostack),
        );
    }
}

/// Runs `weight_grad` on images of `heights` x `widths` (test values; input pixel
/// `infinite`'s channels infinite) and asserts it equals [`weight_grad_definition`]:
/// within the products' magnitudes where the definition is finite, else the same.
#[cfg(test)]
pub(crate) fn assert_weight_grad_is_the_definition(
    weight_grad: BandedWeightGrad,
    (heights, widths): (&[i64], &[i64]),
    (window, shape): (Window2d, crate::window::Shape),
    infinite: Option<usize>,
) {
    let crate::window::Shape {
        channels,
        width,
        taps,
    } = shape;
    let images = nestor_layout::window_images(&window, heights, widths).unwrap();
    let (inputs, outputs) = nestor_layout::pixels(&images);
    let value = |i: usize, scale: f32| ((i * 37 % 101) as f32 - 50.0) * scale + 0.001;
    let mut x: Vec<f32> = (0..inputs * channels).map(|i| value(i, 0.0371)).collect();
    if let Some(pixel) = infinite {
        x[pixel * channels..(pixel + 1) * channels].fill(f32::INFINITY);
    }
    let g: Vec<f32> = (0..outputs * width).map(|i| value(i + 3, 0.0213)).collect();
    let mut out = vec![f32::NAN; width * channels * taps];
    // SAFETY: the buffers hold the images' pixels and the weight.
    unsafe {
        weight_grad(
            (out.as_mut_ptr(), x.as_ptr(), g.as_ptr()),
            (&images, window),
            shape,
        )
    };
    let (expected, magnitude) = weight_grad_definition((&x, &g), (&images, window), shape);
    for (at, (&got, (&expected, &magnitude))) in
        out.iter().zip(expected.iter().zip(&magnitude)).enumerate()
    {
        let got = f64::from(got);
        assert!(
            if expected.is_finite() {
                (got - expected).abs() <= 1e-6 * magnitude + 1e-6
            } else {
                got == expected || (got.is_nan() && expected.is_nan())
            },
            "{window:?} {channels} channels into {width}: value {at}: {got} against {expected}"
        );
    }
}

/// A convolution's weight gradient by its definition, `[width, channels, taps]`: the
/// f64 sums over output pixels of the products of the bf16 roundings of `g` and of the
/// input pixels each tap reads inside its image, and the sums of the products' magnitudes
/// (for a tolerance).
#[cfg(test)]
pub(crate) fn weight_grad_definition(
    (x, g): (&[f32], &[f32]),
    (images, window): (&[WindowImage], Window2d),
    shape: crate::window::Shape,
) -> (Vec<f64>, Vec<f64>) {
    let rounded =
        |value: f32| f64::from(f32::from_bits(u32::from(crate::bf16::round(value)) << 16));
    let crate::window::Shape {
        channels,
        width,
        taps,
    } = shape;
    let mut expected = vec![0f64; width * channels * taps];
    let mut magnitude = vec![0f64; width * channels * taps];
    for image in images {
        let ((height, image_width), (out_h, out_w)) = (image.size, image.out);
        for (oy, ox) in (0..out_h).flat_map(|oy| (0..out_w).map(move |ox| (oy, ox))) {
            let pixel = image.output + (oy * out_w + ox) as usize;
            for ky in 0..window.kernel[0] {
                for kx in 0..window.kernel[1] {
                    let y = oy * window.stride[0] - window.padding[0] + ky * window.dilation[0];
                    let xx = ox * window.stride[1] - window.padding[1] + kx * window.dilation[1];
                    if !(0..height).contains(&y) || !(0..image_width).contains(&xx) {
                        continue;
                    }
                    let source = image.input + (y * image_width + xx) as usize;
                    let t = (ky * window.kernel[1] + kx) as usize;
                    for o in 0..width {
                        for c in 0..channels {
                            let term =
                                rounded(g[pixel * width + o]) * rounded(x[source * channels + c]);
                            let at = (o * channels + c) * taps + t;
                            expected[at] += term;
                            magnitude[at] += term.abs();
                        }
                    }
                }
            }
        }
    }
    (expected, magnitude)
}
