//! A convolution's weight gradient with bf16 products on AMX tiles, reading its input
//! rows in place: `dW[o, c, ky, kx] = sum over output pixels p of g[p, o] x[p + (ky,
//! kx), c]`, as `dW_(ky, kx) [16 o x 16 c] += G^T [16 o x 32 p] X_(ky, kx) [32 p x 16 c]`
//! per block of 32 output pixels of a row. A task (8 output rows of an image) rounds
//! the input rows they read into rows of pixel pairs, `(x[2q][c], x[2q + 1][c])` for
//! every channel, and the same from the odd pixels: tap `kx`'s 32 pixels, two to a
//! pair, are then 16 rows of a tile read in place (`channels` pairs apart), which is
//! `tdpbf16ps`'s second operand as it is. The gradient's block is transposed once
//! (`G^T`) for every tap. No columns nine times the input's size, no packing per tap.
//!
//! Each task sums into its own partials (fixed tasks, so the sums' order never depends
//! on the threads), added in order at the end.

use std::cell::RefCell;

use nestor_ir::Window2d;
use nestor_layout::WindowImage;
use nestor_passes::Products;

use crate::amx::Configured;
use crate::parallel::{worker_threads, SendPointer};
use crate::window::{Shape, BAND};

/// Output pixels of a block (32 bf16 in a tile's row of `G^T`).
const PIXELS: usize = 32;
/// Output channels of a tile of sums, and input channels (a tile's columns).
const LANES: usize = 16;
/// Output pixels a task sums at least (its partial sums added to the others' at the
/// end): a few tasks a thread.
const TASK_PIXELS: usize = 4096;
/// Taps (each a 16-channel chunk) summed at once: four tiles of sums.
const WIDE: usize = 4;
/// Most input channels it runs for: wider convolutions pack their columns for the
/// tiles straight from the images' roundings (`crate::columns::weight_grad`), which on
/// ResNet-50 at 81% occupancy took 16.0 ms for its three 64-channel 3x3 weight
/// gradients against 19.1 here (2-core Xeon).
const CHANNELS: usize = 32;

/// Whether the weight gradient of a convolution of `shape` over `window` in `groups`
/// groups with `products` runs here: bf16 products on the process's tiles, no stride,
/// dilation nor groups along rows, a whole number of 16-channel chunks up to
/// [`CHANNELS`], and no way forced by `NESTOR_CONV`.
pub(crate) fn pays(shape: Shape, window: &Window2d, (groups, products): (usize, Products)) -> bool {
    products == Products::Bf16
        && crate::amx::usable()
        && crate::columns::forced_way().is_none()
        && groups <= 1
        && window.stride[1] == 1
        && window.dilation[1] == 1
        && shape.channels.is_multiple_of(LANES)
        && (LANES..=CHANNELS).contains(&shape.channels)
}

/// Bytes of partial sums [`weight_grad`] keeps for `images` (one set a task).
pub(crate) fn partial_bytes(shape: Shape, window: &Window2d, images: &[WindowImage]) -> usize {
    tasks(images)
        .len()
        .saturating_mul(Sums::of(shape, window).len())
        .saturating_mul(4)
}

/// Where a task's sums lie: per block of 16 output channels, a tile per tap and chunk
/// of 16 input channels, padded to a whole number of [`WIDE`].
#[derive(Clone, Copy)]
struct Sums {
    out_blocks: usize,
    /// Tiles per block of output channels.
    slots: usize,
    chunks: usize,
}

impl Sums {
    fn of(shape: Shape, window: &Window2d) -> Self {
        let taps = (window.kernel[0] * window.kernel[1]).max(0) as usize;
        let chunks = shape.channels / LANES;
        Self {
            out_blocks: shape.width.div_ceil(LANES),
            slots: (taps * chunks).next_multiple_of(WIDE),
            chunks,
        }
    }

    /// Values of a task's sums.
    fn len(self) -> usize {
        self.out_blocks * self.slots * LANES * LANES
    }
}

/// A thread's buffers for its tasks.
struct Scratch {
    /// Rows of pairs (even, then odd, per input row).
    rows: Vec<u32>,
    /// Tiles of `G^T`.
    tiles: Vec<u16>,
    /// Copies of the tiles a block past its row's end reads.
    spill: Vec<u32>,
    /// An input row rounded.
    rounded: Vec<u16>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch {
            rows: Vec::new(),
            tiles: Vec::new(),
            spill: Vec::new(),
            rounded: Vec::new(),
        })
    };
}

/// `out [width, channels, K_h, K_w] = sum over output pixels of g x` (see the module's
/// doc) for a convolution [`pays`] says runs here.
///
/// # Safety
/// `out` must hold `width * channels * taps` values, `g` `width` per output pixel of
/// `images`, `x` `channels` per input pixel.
pub(crate) unsafe fn weight_grad(
    (out, x, g): (*mut f32, *const f32, *const f32),
    (images, window): (&[WindowImage], Window2d),
    shape: Shape,
) {
    let sums = Sums::of(shape, &window);
    let tasks = tasks(images);
    // Each task's sums start at zero and gather its bands'.
    let mut partials = vec![0f32; tasks.len() * sums.len()];
    let task = Task {
        x,
        g,
        shape,
        window,
        sums,
    };
    let partial = SendPointer(partials.as_mut_ptr());
    let pixels = nestor_layout::pixels(images).1;
    let macs = pixels.saturating_mul(shape.width * shape.channels * shape.taps);
    let threads = if macs >= crate::Parallelism::current().gemm_macs {
        worker_threads().max(1) as usize
    } else {
        1
    };
    crate::team::for_each_chunk(tasks.len(), threads, &|index| {
        // SAFETY: task `index` owns its partial sums; the buffers as the caller vouches.
        let partial = unsafe {
            std::slice::from_raw_parts_mut(partial.get().add(index * sums.len()), sums.len())
        };
        for (image, band) in tasks[index].iter().cloned() {
            // SAFETY: as above.
            unsafe { task.band(images[image], band, partial) };
        }
    });
    // The tasks' sums added in order, then laid out as the weight.
    let first = sums.len().min(partials.len());
    let (total, rest) = partials.split_at_mut(first);
    for partial in rest.chunks_exact(sums.len().max(1)) {
        for (sum, &value) in total.iter_mut().zip(partial) {
            *sum += value;
        }
    }
    let Shape {
        channels,
        width,
        taps,
    } = shape;
    // SAFETY: `out` holds the weight (as the caller vouches).
    let out = unsafe { std::slice::from_raw_parts_mut(out, width * channels * taps) };
    for (at, value) in out.iter_mut().enumerate() {
        let (o, c, t) = (at / (channels * taps), at / taps % channels, at % taps);
        let slot = t * sums.chunks + c / LANES;
        *value = total
            .get(((o / LANES * sums.slots + slot) * LANES + o % LANES) * LANES + c % LANES)
            .copied()
            .unwrap_or(0.0);
    }
}

/// The output rows of every image in bands of [`BAND`] (image, rows), runs of
/// consecutive bands of at least [`TASK_PIXELS`] output pixels a task (the last
/// smaller): fixed by the images alone, so the sums' order is.
pub(super) fn tasks(images: &[WindowImage]) -> Vec<Vec<(usize, std::ops::Range<i64>)>> {
    let mut tasks = Vec::new();
    let (mut task, mut pixels) = (Vec::new(), 0);
    for (index, image) in images.iter().enumerate() {
        for first in (0..image.out.0).step_by(BAND as usize) {
            let band = first..(first + BAND).min(image.out.0);
            pixels += (band.end - band.start) as usize * image.out.1.max(0) as usize;
            task.push((index, band));
            if pixels >= TASK_PIXELS {
                tasks.push(std::mem::take(&mut task));
                pixels = 0;
            }
        }
    }
    if !task.is_empty() {
        tasks.push(task);
    }
    tasks
}

/// What every task reads.
struct Task {
    x: *const f32,
    g: *const f32,
    shape: Shape,
    window: Window2d,
    sums: Sums,
}

// SAFETY: tasks only read the buffers (each writes its own partial sums).
unsafe impl Sync for Task {}

impl Task {
    /// The partial sums of output rows `band` of `image`.
    ///
    /// # Safety
    /// The buffers as [`weight_grad`]'s caller vouches; `partial` this task's.
    unsafe fn band(&self, image: WindowImage, band: std::ops::Range<i64>, partial: &mut [f32]) {
        let Shape {
            channels, width, ..
        } = self.shape;
        let Window2d {
            kernel, padding, ..
        } = self.window;
        let height = image.size.0;
        let out_width = image.out.1.max(0) as usize;
        let y_of = |oy: i64, ky: i64| super::window_row(&self.window, oy, ky);
        let (low, high) = super::band_rows(&self.window, height, &band);
        let input_rows = (high - low + 1).max(0) as usize;
        // Pairs of a row: every block's taps read up to pixel `blocks * 32 + K_w` of
        // the padded row.
        let pairs = (out_width.next_multiple_of(PIXELS) + kernel[1].max(0) as usize) / 2 + 1;
        let pitch = pairs * channels;
        let out_blocks = self.sums.out_blocks;
        SCRATCH.with_borrow_mut(|scratch| {
            let Scratch {
                rows,
                tiles,
                spill,
                rounded,
            } = scratch;
            // Rows of pairs: even copy then odd copy per input row, then a row of zeros
            // (window rows outside the image read it).
            rows.resize((2 * input_rows + 1) * pitch, 0);
            rounded.resize((2 * pairs + 2) * channels, 0);
            let rounded = &mut rounded[..(2 * pairs + 2) * channels];
            for (index, y) in (low..=high).enumerate() {
                // SAFETY: `y` is a row of the image, whose pixels `x` holds.
                unsafe {
                    super::round_padded_row((self.x, image, y), (channels, padding[1]), rounded)
                };
                let (even, odd) =
                    rows[2 * index * pitch..(2 * index + 2) * pitch].split_at_mut(pitch);
                interleave(rounded, channels, even, 0);
                interleave(rounded, channels, odd, 1);
            }
            let zeros = 2 * input_rows * pitch;
            rows[zeros..].fill(0);
            // The blocks of 32 pixels (output row, first pixel, pixels) and their
            // tiles of `G^T`.
            let blocks: Vec<(i64, usize, usize)> = band
                .clone()
                .flat_map(|oy| {
                    (0..out_width)
                        .step_by(PIXELS)
                        .map(move |first| (oy, first, (out_width - first).min(PIXELS)))
                })
                .collect();
            let tile = LANES * PIXELS;
            tiles.resize(blocks.len() * out_blocks * tile, 0);
            for (block, &(oy, first, count)) in
                tiles.chunks_exact_mut(out_blocks * tile).zip(&blocks)
            {
                let pixel = image.output + oy as usize * out_width + first;
                // SAFETY: the block's `count` pixels hold `width` values of `g` each; the
                // host has AVX-512 (it has AMX).
                unsafe { transpose_rounded((self.g.add(pixel * width), width, count), block) };
            }
            // Window row `ky` of output row `oy`: its input row's even pairs, or zeros.
            let row_of = |oy: i64, ky: i64| {
                let y = y_of(oy, ky);
                if (0..height).contains(&y) {
                    Some(2 * (y - low) as usize * pitch)
                } else {
                    None
                }
            };
            // Per group of four taps (and chunks of 16 channels), per block: its
            // `b` tiles and their stride (the `a` tile set per block of output channels
            // below). A block past its row's end reads copies of its tiles with zeros
            // for those pixels (an infinite input there times a zero of `G^T` would
            // make a NaN).
            let sums = self.sums;
            let combos = kernel[0].max(0) as usize * kernel[1].max(0) as usize * sums.chunks;
            let partial_blocks = blocks.iter().filter(|block| block.2 < PIXELS).count();
            spill.resize(partial_blocks * sums.slots * LANES * LANES, 0);
            let mut entries = Vec::with_capacity(sums.slots / WIDE * blocks.len());
            let mut spilled = 0;
            for group in (0..sums.slots).step_by(WIDE) {
                for &(oy, first, count) in &blocks {
                    let mut entry = [0; 6];
                    entry[5] = if count == PIXELS {
                        channels * 4
                    } else {
                        LANES * 4
                    };
                    for (i, b) in entry[1..5].iter_mut().enumerate() {
                        let slot = group + i;
                        let (t, chunk) = (slot / sums.chunks, slot % sums.chunks);
                        let (ky, kx) = (t as i64 / kernel[1], (t as i64 % kernel[1]) as usize);
                        // Tap `kx`'s pairs from pixel `first + kx` (even or odd copy).
                        let source = row_of(oy, ky).filter(|_| slot < combos).map(|row| {
                            row + (kx % 2) * pitch + (first + kx) / 2 * channels + chunk * LANES
                        });
                        *b = match source {
                            None => rows[zeros..].as_ptr() as usize,
                            Some(at) if count == PIXELS => rows[at..].as_ptr() as usize,
                            Some(at) => {
                                let copy = &mut spill[spilled * LANES * LANES..][..LANES * LANES];
                                spilled += 1;
                                copy_masked(&rows[at..], channels, count, copy);
                                copy.as_ptr() as usize
                            }
                        };
                    }
                    entries.push(entry);
                }
            }
            let _tiles = Configured::new();
            for out_block in 0..out_blocks {
                for (group, entries) in entries.chunks_exact_mut(blocks.len().max(1)).enumerate() {
                    for (index, entry) in entries.iter_mut().enumerate() {
                        entry[0] =
                            tiles[(index * out_blocks + out_block) * tile..].as_ptr() as usize;
                    }
                    let slot = out_block * sums.slots + group * WIDE;
                    let sums = partial[slot * LANES * LANES..].as_mut_ptr();
                    // SAFETY: every entry's tiles lie in the rows, the copies or the tiles
                    // of `G^T` (16 rows each, at its stride); the four tiles of sums in
                    // this task's partial.
                    unsafe { accumulate_4(entries, sums) };
                }
            }
        });
    }
}

/// `out[q][c] = (rounded[(2q + odd)][c], rounded[(2q + odd + 1)][c])` (bf16 bits, the
/// first in the low half) for every pair `q` of `out`.
fn interleave(rounded: &[u16], channels: usize, out: &mut [u32], odd: usize) {
    for (q, pair) in out.chunks_exact_mut(channels).enumerate() {
        let first = (2 * q + odd) * channels;
        let (low, high) = (
            &rounded[first..first + channels],
            &rounded[first + channels..first + 2 * channels],
        );
        for ((slot, &low), &high) in pair.iter_mut().zip(low).zip(high) {
            *slot = u32::from(low) | u32::from(high) << 16;
        }
    }
}

/// The 16 rows of a tile of pairs at `rows` (`channels` apart, 16 read of each) into
/// `copy` (rows of 16), the pairs of pixels from `count` on zeros.
fn copy_masked(rows: &[u32], channels: usize, count: usize, copy: &mut [u32]) {
    for (pair, out) in copy.chunks_exact_mut(LANES).enumerate() {
        let mask = match count.saturating_sub(2 * pair) {
            0 => 0,
            1 => 0xffff,
            _ => u32::MAX,
        };
        let source: &[u32; LANES] = rows[pair * channels..][..LANES]
            .try_into()
            .unwrap_or(&[0; LANES]);
        for (out, &value) in out.iter_mut().zip(source) {
            *out = value & mask;
        }
    }
}

/// The rounded transposes of a block of `count` output pixels' gradients (`g`, rows of
/// `width`): per block of 16 output channels a tile `[16 x 32]` of bf16, zeros past
/// `count` pixels and past `width` channels.
///
/// # Safety
/// `g` must hold `count` rows of `width` values; the host must have AVX-512F.
unsafe fn transpose_rounded((g, width, count): (*const f32, usize, usize), tiles: &mut [u16]) {
    let zero_row = [0f32; LANES];
    let mut padded = [[0f32; LANES]; PIXELS];
    let mut transposed = [0u32; LANES * LANES];
    // A tile's values, `[16 x 32]`, rounded at once.
    let mut values = [0f32; LANES * PIXELS];
    for (out_block, tile) in tiles.chunks_exact_mut(LANES * PIXELS).enumerate() {
        let columns = width.saturating_sub(out_block * LANES).min(LANES);
        for half in 0..PIXELS / LANES {
            let rows: [*const u32; LANES] = std::array::from_fn(|r| {
                let pixel = half * LANES + r;
                if pixel >= count {
                    return zero_row.as_ptr() as *const u32;
                }
                // SAFETY: pixel `pixel` holds `width` values (the caller vouches).
                let row = unsafe { g.add(pixel * width + out_block * LANES) };
                if columns == LANES {
                    row as *const u32
                } else {
                    // SAFETY: as above, `columns` of them from this block.
                    let values = unsafe { std::slice::from_raw_parts(row, columns) };
                    padded[pixel][..columns].copy_from_slice(values);
                    padded[pixel].as_ptr() as *const u32
                }
            });
            // SAFETY: every row holds 16 values; the host has AVX-512F (the caller
            // vouches).
            unsafe { crate::amx::transpose_16x16(rows, &mut transposed) };
            for (line, out) in transposed
                .chunks_exact(LANES)
                .zip(values.chunks_exact_mut(PIXELS))
            {
                for (out, &bits) in out[half * LANES..].iter_mut().zip(line) {
                    *out = f32::from_bits(bits);
                }
            }
        }
        crate::bf16::round_line(&values, tile);
    }
}

/// Four tiles of sums `[16 x 16]` (1 KiB apart from `sums`) `+=` over every entry
/// `[a, b0, b1, b2, b3, stride]` of `a b_i`: `a` a tile of 16 rows of 32 bf16 (64 bytes
/// apart), `b_i` 16 rows of 16 pairs `stride` bytes apart.
///
/// # Safety
/// The tiles must be configured ([`Configured`]); every pointer valid for its tile.
unsafe fn accumulate_4(entries: &[[usize; 6]], sums: *mut f32) {
    unsafe {
        std::arch::asm!(
            "tileloadd tmm0, [{sums} + {row}*1]",
            "add {sums}, 1024",
            "tileloadd tmm1, [{sums} + {row}*1]",
            "add {sums}, 1024",
            "tileloadd tmm2, [{sums} + {row}*1]",
            "add {sums}, 1024",
            "tileloadd tmm3, [{sums} + {row}*1]",
            "test {n}, {n}",
            "jz 4f",
            "2:",
            "mov {p}, [{e}]",
            "tileloadd tmm4, [{p} + {row}*1]",
            "mov {bs}, [{e} + 40]",
            "mov {p}, [{e} + 8]",
            "tileloadd tmm5, [{p} + {bs}*1]",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "mov {p}, [{e} + 16]",
            "tileloadd tmm6, [{p} + {bs}*1]",
            "tdpbf16ps tmm1, tmm4, tmm6",
            "mov {p}, [{e} + 24]",
            "tileloadd tmm7, [{p} + {bs}*1]",
            "tdpbf16ps tmm2, tmm4, tmm7",
            "mov {p}, [{e} + 32]",
            "tileloadd tmm5, [{p} + {bs}*1]",
            "tdpbf16ps tmm3, tmm4, tmm5",
            "add {e}, 48",
            "dec {n}",
            "jnz 2b",
            "4:",
            "tilestored [{sums} + {row}*1], tmm3",
            "sub {sums}, 1024",
            "tilestored [{sums} + {row}*1], tmm2",
            "sub {sums}, 1024",
            "tilestored [{sums} + {row}*1], tmm1",
            "sub {sums}, 1024",
            "tilestored [{sums} + {row}*1], tmm0",
            e = inout(reg) entries.as_ptr() => _,
            n = inout(reg) entries.len() => _,
            sums = inout(reg) sums => _,
            p = out(reg) _,
            bs = out(reg) _,
            row = in(reg) 64usize,
            options(nostack),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The weight gradient on the tiles equals the f64 sum of the products of the
    /// roundings (exact products; only the sums' order differs): windows with padding,
    /// strides and dilation along columns, images of one pixel and rows that end inside
    /// a block of 32 pixels, 16 and 32 channels, output channels past a block of 16 and
    /// widths not a multiple of 16; an infinite input leaves finite the sums of the taps
    /// that only pixels past its row's end would read it with.
    #[test]
    fn weight_gradients_are_the_sums_of_the_products_of_the_roundings() {
        let window = |kernel, stride, padding, dilation| Window2d {
            kernel,
            stride,
            padding,
            dilation,
        };
        let windows = [
            window([3, 3], [1, 1], [1, 1], [1, 1]),
            window([3, 2], [2, 1], [1, 0], [2, 1]),
            window([1, 1], [1, 1], [0, 0], [1, 1]),
        ];
        let (heights, widths) = ([5i64, 1, 3, 2], [37i64, 1, 33, 64]);
        for window in windows {
            for (channels, width) in [(16, 16), (32, 5), (16, 70), (32, 33)] {
                let taps = window.taps() as usize;
                let shape = Shape {
                    channels,
                    width,
                    taps,
                };
                if !pays(shape, &window, (1, Products::Bf16)) {
                    assert!(!crate::amx::usable());
                    return;
                }
                // An infinite pixel at the end of the first image's first row (37 pixels:
                // a block of 32 and one of 5): the taps that read it from real output
                // pixels sum infinities, the others (which only pixels past the row's
                // end would read) stay finite.
                super::super::assert_weight_grad_is_the_definition(
                    weight_grad,
                    (&heights, &widths),
                    (window, shape),
                    Some((widths[0] - 1) as usize),
                );
            }
        }
    }
}
