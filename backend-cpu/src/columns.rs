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

use std::any::TypeId;

use crate::amx::{Left, TapRows};
use crate::bf16::PackedRight;
use crate::blas::Gemm;
use crate::finish::Finish;
use crate::parallel::{even_part, worker_threads, SendPointer};
use crate::spare::Lent;
use crate::window::{add_partials, Shape, GRAD_BLOCK_ROWS};
use nestor_ir::Window2d;

/// Output pixels whose columns are gathered and multiplied at once (on a 2-core Xeon,
/// ResNet-50's 3x3 convolutions ran at 200-235 GFLOP/s in tiles of 128 pixels, 235-275
/// in tiles of 512, less again in tiles of 1024).
const TILE_ROWS: usize = 512;

/// What a window step computes, for [`columns_pay`].
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Work {
    /// A convolution, or its input's gradient (`channels` in, `width` out).
    Convolution,
    /// A convolution weight's gradient.
    WeightGradient,
}

/// Whether `work` of this shape runs as GEMMs over columns rather than the direct
/// kernel: from 32 output channels, and for a convolution 16 input channels (the direct
/// kernel is the faster at the 16-channel convolutions it was built for and at a stem's
/// 3 input channels; a stem's weight gradient, 3 channels times 49 taps, took 28 ms in
/// the direct kernel and 6 as a GEMM). A convolution with bf16 products on AMX tiles
/// of fewer than 32 input channels reads its input rows in place instead
/// (`crate::conv_tiles::pays`). `NESTOR_CONV=direct` or `NESTOR_CONV=columns` forces one
/// way (to compare them).
pub(crate) fn columns_pay(shape: Shape, work: Work, products: Products) -> bool {
    if let Some(columns) = forced_way() {
        return columns;
    }
    // With the process's own bf16 products a stem's convolution too (3 channels times
    // 49 taps).
    let own_bf16 = products == Products::Bf16 && crate::bf16::own_products();
    let inputs = match work {
        Work::Convolution if own_bf16 => shape.channels.saturating_mul(shape.taps) >= 64,
        Work::Convolution => shape.channels >= 16,
        Work::WeightGradient => shape.channels.saturating_mul(shape.taps) >= 64,
    };
    shape.width >= 32 && inputs
}

/// `NESTOR_CONV`, read once per process: `Some(true)` for columns, `Some(false)` for the
/// direct kernel, `None` when the shapes choose.
pub(crate) fn forced_way() -> Option<bool> {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *FORCED.get_or_init(|| {
        let is = |way| crate::process::env_is("NESTOR_CONV", way);
        (is("direct") || is("columns")).then(|| is("columns"))
    })
}

/// `weight [outs, ins, taps]` as `[outs, taps, ins]`: the order of a columns row (tap
/// after tap, each an input pixel's channels); the weight itself for one tap. Read in
/// order, each value written to its place (a 512-channel 3x3 weight's reordering,
/// gathered tap by tap with a stride, took longer than the convolution it was for).
fn by_tap<T: Gemm>(weight: &[T], (outs, ins, taps): (usize, usize, usize)) -> Reordered<'_, T> {
    if taps == 1 {
        return Reordered::Same(weight);
    }
    let inner = ins * taps;
    // Every value is written (a permutation of the weight's).
    let mut by_tap = Lent::<T>::new(weight.len());
    for (row, out) in weight
        .chunks_exact(inner)
        .zip(by_tap.chunks_exact_mut(inner))
        .take(outs)
    {
        for (c, window) in row.chunks_exact(taps).enumerate() {
            for (t, &value) in window.iter().enumerate() {
                out[t * ins + c] = value;
            }
        }
    }
    Reordered::Lent(by_tap)
}

/// The forward weight `[ins, outs, taps]` of an input's gradient as the rows of the
/// GEMM's right operand, `[taps, ins, outs]`, its taps flipped (the adjoint
/// convolution's weight `W'[c, i, t] = W[i, c, taps - 1 - t]`, tap after tap); the
/// weight itself for one tap. Read in order, as [`by_tap`].
fn adjoint_rows<T: Gemm>(
    weight: &[T],
    (ins, outs, taps): (usize, usize, usize),
) -> Reordered<'_, T> {
    if taps == 1 {
        return Reordered::Same(weight);
    }
    let plane = ins * outs;
    // Every value is written (a permutation of the weight's).
    let mut rows = Lent::<T>::new(weight.len());
    for (ic, window) in weight.chunks_exact(taps).enumerate().take(plane) {
        // Value `(i, c)` of every tap: row `i`, column `c` of the flipped tap's plane.
        for (t, &value) in window.iter().enumerate() {
            rows[(taps - 1 - t) * plane + ic] = value;
        }
    }
    Reordered::Lent(rows)
}

/// A weight as the products read it: the step's own, or reordered into a lent vector
/// (kept between steps with its pages mapped: a fresh one had them faulted in anew,
/// most of a 512-channel weight's reordering).
enum Reordered<'a, T: Gemm> {
    Same(&'a [T]),
    Lent(Lent<T>),
}

impl<T: Gemm> std::ops::Deref for Reordered<'_, T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match self {
            Reordered::Same(weight) => weight,
            Reordered::Lent(reordered) => reordered,
        }
    }
}

/// Copies the input pixel of taps `taps` of every window (`channels` values of `x`;
/// zeros for a tap outside its image, `-1`) into `columns`, row after row: `table`
/// holds `per_window` taps a window. Taps reading consecutive pixels (a window's row
/// inside the image) are one copy: at a stem's 3 channels, a copy per tap took most of
/// its weight gradient's time.
///
/// Rows are `row_len` values apart, zeros past their taps. `x` holds values of any type
/// (f32 or f64, or bf16 roundings).
///
/// # Safety
/// `x` must hold every pixel the taps name.
unsafe fn gather<E: Copy + Default>(
    x: *const E,
    (table, per_window, taps): (&[i64], usize, std::ops::Range<usize>),
    channels: usize,
    (columns, row_len): (&mut [E], usize),
) {
    let used = taps.len() * channels;
    for (row, window) in columns
        .chunks_exact_mut(row_len.max(1))
        .zip(table.chunks_exact(per_window.max(1)))
    {
        row[used..].fill(E::default());
        let sources = &window[taps.clone()];
        let mut tap = 0;
        while tap < sources.len() {
            let source = sources[tap];
            let mut end = tap + 1;
            if source < 0 {
                while end < sources.len() && sources[end] < 0 {
                    end += 1;
                }
                row[tap * channels..end * channels].fill(E::default());
            } else {
                while end < sources.len() && sources[end] == sources[end - 1] + 1 {
                    end += 1;
                }
                let count = (end - tap) * channels;
                // SAFETY: the taps name pixels of `x`, these `end - tap` consecutive ones.
                let pixels =
                    unsafe { std::slice::from_raw_parts(x.add(source as usize * channels), count) };
                row[tap * channels..end * channels].copy_from_slice(pixels);
            }
            tap = end;
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

/// A tile's work, given its index, its columns and its taps.
type TileTask<'a, E> = dyn Fn(usize, &mut [E], &mut [i64]) + Sync + 'a;

/// Runs `task(tile, columns, table)` for every one of the `tiles` on `threads` of the
/// team, a tile a chunk (so that uneven work balances), with `scratch` values of columns
/// and `table` taps lent to each ([`Lent`]: kept between steps, their old values for the
/// task to overwrite; a fresh vector per chunk had its pages faulted in and zeroed).
fn for_each_tile<E: crate::spare::Spare>(
    tiles: usize,
    threads: usize,
    (scratch, table): (usize, usize),
    task: &TileTask<'_, E>,
) {
    crate::team::for_each_chunk(tiles, threads, &|tile| {
        let (mut columns, mut taps) = (Lent::<E>::new(scratch), Lent::<i64>::new(table));
        task(tile, &mut columns, &mut taps);
    });
}

/// How many parts to split `size` (output channels or columns) into, parts of at least
/// `least`, so that `units` units of work keep every one of `threads` busy.
fn parts(units: usize, threads: usize, size: usize, least: usize) -> usize {
    match units {
        0 => 1,
        _ if units >= 2 * threads => 1,
        _ => (2 * threads).div_ceil(units).min(size / least).max(1),
    }
}

/// [`crate::window`]'s convolution as GEMMs over columns: every tile of output pixels'
/// columns times the weight (`[width, channels, taps]`; with `adjoint`, the forward
/// weight `[channels, width, taps]` of an input's gradient, flipped), on top of the
/// bias.
///
/// # Safety
/// `out` must hold every output pixel of `images` times `width` values, `x` every input
/// pixel times `channels`, the weight `width * channels * taps` and the bias `width`;
/// `finish` must be for `out` (each tile's rows are finished once multiplied).
pub(crate) unsafe fn convolve<T: Gemm>(
    (out, x): (*mut T, *const T),
    (weight, bias): (&[T], Option<&[T]>),
    images: &[WindowImage],
    shape: Shape,
    (window, products, adjoint): (Window2d, Products, bool),
    finish: &Finish<'_>,
) {
    let Shape {
        channels,
        width,
        taps,
    } = shape;
    let inner = taps * channels;
    let rows = nestor_layout::pixels(images).1;
    let threads = threads_for(rows.saturating_mul(inner).saturating_mul(width));
    // With the process's own bf16 products on f32 values: the weight packed once, its
    // columns gathered from the images' roundings (`convolve_packed`).
    if products == Products::Bf16 && TypeId::of::<T>() == TypeId::of::<f32>() {
        let bias = bias.map(|bias| bias.as_ptr() as *const f32);
        // SAFETY: `T` is f32; as the caller vouches.
        let done = unsafe {
            convolve_packed(
                (out as *mut f32, x as *const f32),
                (weight.as_ptr() as *const f32, bias),
                (images, window),
                (shape, adjoint),
                (threads, finish),
            )
        };
        if done {
            return;
        }
    }
    // The right operand `b [inner, width]`, tap after tap: the weight reordered, with
    // its (row, column) strides, and for bf16 products rounded once (each tile's
    // product packs it from its roundings).
    let (matrix, strides) = if adjoint {
        (adjoint_rows(weight, (channels, width, taps)), (width, 1))
    } else {
        (by_tap(weight, (width, channels, taps)), (1, inner))
    };
    // SAFETY: the matrix holds `inner * width` values.
    let rounded = unsafe { T::rounded_here(products, matrix.as_ptr(), matrix.len(), threads) };
    let rounded = rounded.as_ref();
    let matrix = SendPointer(matrix.as_ptr() as *mut T);
    let (out, x) = (SendPointer(out), SendPointer(x as *mut T));
    let (tile_rows, tiles) = tiling(rows, threads);
    // A 1x1 window without stride or padding reads every pixel as its own column.
    let pointwise = taps == 1 && window.stride == [1, 1] && window.padding == [0, 0];
    let scratch = if pointwise {
        (0, 0)
    } else {
        (tile_rows * inner, tile_rows * taps)
    };
    for_each_tile::<T>(tiles, threads, scratch, &|tile, columns, table| {
        let first = tile * tile_rows;
        let count = tile_rows.min(rows - first);
        let a = if pointwise {
            // SAFETY: `x` holds a pixel (`channels` values) per output pixel.
            unsafe { x.get().add(first * channels) as *const T }
        } else {
            let table = &mut table[..count * taps];
            fill_taps(&window, images, first, table, Outside::Marked);
            let columns = &mut columns[..count * inner];
            // SAFETY: `x` holds every pixel the taps name.
            unsafe { gather(x.get(), (table, taps, 0..taps), channels, (columns, inner)) };
            columns.as_ptr()
        };
        // SAFETY: rows `first..first + count` of `out` are this tile's alone; the
        // matrix holds `inner x width` values.
        unsafe {
            let c = out.get().add(first * width);
            if let Some(bias) = bias {
                write_bias(c, bias.as_ptr(), (count, width));
            }
            let b = matrix.get() as *const T;
            T::product_rounded(
                products,
                ((count, inner, width), T::ONE),
                (
                    ((a, inner as isize, 1), None),
                    ((b, strides.0 as isize, strides.1 as isize), rounded),
                ),
                ((c, width as isize, 1), bias.is_some()),
            );
            finish.rows(first, first + count);
        }
    });
}

/// The rows of output pixels a tile of [`convolve`] gathers and multiplies, and the
/// tiles: few tiles' worth of pixels (small images, late stages) are one tile a
/// thread, each thread gathering its own pixels once and multiplying them with the
/// whole weight (splitting the output channels instead gathers every pixel once per
/// part: a 512-channel 3x3 convolution of 480 pixels took 13.8 ms so, 9.4 ms this way).
fn tiling(rows: usize, threads: usize) -> (usize, usize) {
    let tile_rows = if rows < 2 * threads * TILE_ROWS {
        rows.div_ceil(threads).max(1)
    } else {
        TILE_ROWS
    };
    (tile_rows, rows.div_ceil(tile_rows))
}

/// Writes the bias into `rows` rows of `width` values from `out` (the products are
/// added to it).
///
/// # Safety
/// `out` must hold the rows, `bias` `width` values.
unsafe fn write_bias<T: Copy>(out: *mut T, bias: *const T, (rows, width): (usize, usize)) {
    for row in 0..rows {
        // SAFETY: as the caller vouches.
        unsafe { std::ptr::copy_nonoverlapping(bias, out.add(row * width), width) };
    }
}

/// The tap rows of a convolution's weight (`[width, channels, taps]`; with `adjoint`,
/// the forward weight `[channels, width, taps]` of an input's gradient, its taps
/// flipped: `W'[t][i][c] = W[i, c, taps - 1 - t]`), as [`by_tap`] and
/// [`adjoint_rows`] reorder them.
fn tap_rows(shape: Shape, adjoint: bool) -> TapRows {
    let Shape {
        channels,
        width,
        taps,
    } = shape;
    let strides = if adjoint {
        (taps as isize, (width * taps) as isize, -1)
    } else {
        ((channels * taps) as isize, taps as isize, 1)
    };
    TapRows {
        channels,
        taps,
        columns: width,
        first: if adjoint { taps as isize - 1 } else { 0 },
        strides,
    }
}

/// [`convolve`] with bf16 products on the process's own units: every tile's columns
/// gathered as bf16 roundings, rows padded with zeros to a whole number of tiles deep
/// (read in place by the tiles, where gathering f32 values and rounding them into
/// packed rows took a third of a 3x3 convolution's time), times the weight packed once
/// straight from its taps (`bf16::PackedRight`).
///
/// Returns whether it ran: only with the process's own bf16 products, which round to
/// bf16 bits (else the caller's way runs).
///
/// # Safety
/// As [`convolve`] (the weight `width * channels * taps` values).
unsafe fn convolve_packed(
    (out, x): (*mut f32, *const f32),
    (weight, bias): (*const f32, Option<*const f32>),
    (images, window): (&[WindowImage], Window2d),
    (shape, adjoint): (Shape, bool),
    (threads, finish): (usize, &Finish<'_>),
) -> bool {
    // SAFETY: the weight holds every value of its tap rows (the caller vouches).
    let Some(packed) =
        (unsafe { PackedRight::of_tap_rows(weight, tap_rows(shape, adjoint), threads) })
    else {
        return false;
    };
    let Shape {
        channels,
        width,
        taps,
    } = shape;
    let inner = taps * channels;
    // The packed weight's rows past `inner` are zeros: so are the columns'.
    let depth = inner.next_multiple_of(crate::amx::TILE_DEPTH);
    let rows = nestor_layout::pixels(images).1;
    let (tile_rows, tiles) = tiling(rows, threads);
    let (out, x, bias) = (
        SendPointer(out),
        SendPointer(x as *mut f32),
        bias.map(|bias| SendPointer(bias as *mut f32)),
    );
    let scratch = (tile_rows * depth, tile_rows * taps);
    // The images' roundings, made once (or kept by the run: the step that wrote them
    // rounded them as it went), the columns copied from them.
    let inputs = nestor_layout::pixels(images).0;
    // SAFETY: `x` holds every input pixel's `channels` values.
    let rounded = unsafe {
        <f32 as Gemm>::rounded_buffer(Products::Bf16, x.get(), inputs * channels, threads)
    };
    let Some(bits) = rounded
        .as_deref()
        .and_then(|rounded| rounded.bf16_view((x.get(), 1, 1)))
        .map(|(start, _, _)| SendPointer(start as *mut u16))
    else {
        return false;
    };
    for_each_tile::<u16>(tiles, threads, scratch, &|tile, columns, table| {
        let first = tile * tile_rows;
        let count = tile_rows.min(rows - first);
        let table = &mut table[..count * taps];
        fill_taps(&window, images, first, table, Outside::Marked);
        let columns = &mut columns[..count * depth];
        // SAFETY: `x` holds every pixel the taps name; rows `first..first + count` of
        // `out` are this tile's alone.
        unsafe {
            gather(
                bits.get() as *const u16,
                (table, taps, 0..taps),
                channels,
                (&mut *columns, depth),
            );
            let c = out.get().add(first * width);
            if let Some(bias) = bias {
                write_bias(c, bias.get() as *const f32, (count, width));
            }
            packed.product(
                ((count, depth, width), 1.0),
                Left::Bits(columns.as_ptr(), depth as isize),
                ((c, width as isize, 1), bias.is_some()),
            );
            finish.rows(first, first + count);
        }
    });
    true
}

/// Whether a convolution of `shape` (or its input's gradient) with `products` gathers
/// its columns from its images' bf16 roundings ([`convolve_packed`]): so the step
/// that writes those images makes the roundings as it goes.
pub(crate) fn gathers_roundings(shape: Shape, window: &Window2d, products: Products) -> bool {
    products == Products::Bf16
        && crate::bf16::own_products()
        && !crate::conv_tiles::pays(shape.channels, window, products)
        && columns_pay(shape, Work::Convolution, products)
}

/// [`crate::window`]'s weight gradient as GEMMs: per block of [`GRAD_BLOCK_ROWS`]
/// output pixels, the gradient's rows (transposed) times their columns, tile after
/// tile (a 1x1 window without stride reads the pixels in place); the blocks' sums added
/// in order, each output channel's over its group's input channels.
///
/// # Safety
/// `out` must hold `width * channels / groups * taps` values, `g` a row of `width` per
/// output pixel of `images`, `x` every input pixel's `channels`.
pub(crate) unsafe fn weight_grad<T: Gemm>(
    (out, x, g): (*mut T, *const T, *const T),
    (images, window): (&[WindowImage], Window2d),
    shape: Shape,
    (groups, products): (usize, Products),
) {
    let Shape {
        channels,
        width,
        taps: per_window,
    } = shape;
    let inner = per_window * channels;
    let rows = nestor_layout::pixels(images).1;
    let pointwise = per_window == 1 && window.stride == [1, 1] && window.padding == [0, 0];
    let size = width * inner;
    let blocks = rows.div_ceil(GRAD_BLOCK_ROWS);
    // Every value is written: each unit's first tile overwrites its part of its block.
    let mut partials = Lent::<T>::new(blocks * size);
    let (sums, x, g) = (
        SendPointer(partials.as_mut_ptr()),
        SendPointer(x as *mut T),
        SendPointer(g as *mut T),
    );
    let threads = threads_for(rows.saturating_mul(size));
    // With bf16 products, the gradient every unit reads transposed is rounded once (or
    // was, for an earlier step of the run: `crate::kept`), and packed from its
    // roundings.
    // SAFETY: `g` holds `rows * width` values.
    let rounded_g = unsafe { T::rounded_buffer(products, g.get(), rows * width, threads) };
    let rounded_g = rounded_g.as_deref();
    // With the process's own bf16 products on f32 values in whole 16-channel chunks, the
    // columns are packed straight from the images' roundings (made once, or kept by the
    // run) into the tiles' pair layout ([`PackedRight::of_tap_pixels`]).
    let inputs = nestor_layout::pixels(images).0;
    let direct = products == Products::Bf16
        && crate::bf16::own_products()
        && TypeId::of::<T>() == TypeId::of::<f32>()
        && !pointwise
        && channels.is_multiple_of(16);
    // SAFETY: `T` is f32 when `direct`; `x` holds every input pixel's `channels` values.
    let x_rounded = direct
        .then(|| unsafe {
            <f32 as Gemm>::rounded_buffer(
                products,
                x.get() as *const f32,
                inputs * channels,
                threads,
            )
        })
        .flatten();
    let x_bits = x_rounded.as_deref().and_then(|rounded| {
        rounded
            .bf16_view((x.get() as *const f32, 1, 1))
            .map(|(start, _, _)| SendPointer(start as *mut u16))
    });
    // Few blocks (small images, late stages) also split the work: the taps (each part
    // gathers its own), or for one tap the output channels.
    let (tap_parts, width_parts) = match per_window {
        1 => (1, parts(blocks, threads, width, 64)),
        _ => (parts(blocks, threads, per_window, 1), 1),
    };
    let part_taps = per_window.div_ceil(tap_parts);
    let units = tap_parts * width_parts;
    // Columns packed from the roundings need no f32 columns, only the taps.
    let scratch = match (pointwise, &x_bits) {
        (true, _) => (0, 0),
        (false, Some(_)) => (0, TILE_ROWS * per_window),
        (false, None) => (TILE_ROWS * part_taps * channels, TILE_ROWS * per_window),
    };
    for_each_tile::<T>(blocks * units, threads, scratch, &|unit, columns, table| {
        let (block, taps_part, width_part) =
            (unit / units, unit % units / width_parts, unit % width_parts);
        // Parts as even as they can be (9 taps in 4 parts: 3, 2, 2, 2, not 3, 3, 3
        // and an empty one), so that two threads share them nearly evenly.
        let tap_range = even_part(taps_part, tap_parts, per_window);
        let first_tap = tap_range.start;
        let part_inner = tap_range.len() * channels;
        let std::ops::Range { start, end } = even_part(width_part, width_parts, width);
        let last = ((block + 1) * GRAD_BLOCK_ROWS).min(rows);
        for first in (block * GRAD_BLOCK_ROWS..last).step_by(TILE_ROWS) {
            let count = TILE_ROWS.min(last - first);
            let c = (
                block * size + start * inner + first_tap * channels,
                inner as isize,
            );
            let add = first > block * GRAD_BLOCK_ROWS;
            if let Some(bits) = &x_bits {
                let table = &mut table[..count * per_window];
                fill_taps(&window, images, first, table, Outside::Marked);
                let taps = (&*table, per_window, tap_range.clone());
                // SAFETY: `T` is f32 (`x_bits` says so); the taps name pixels of `x`,
                // whose roundings `bits` holds; `g` holds every output pixel's row; the
                // sums as below.
                unsafe {
                    let packed = PackedRight::of_tap_pixels(bits.get(), taps, (channels, count));
                    if let Some(packed) = packed {
                        let g = (
                            g.get().add(first * width + start) as *const f32,
                            1,
                            width as isize,
                        );
                        packed.product(
                            ((end - start, count, part_inner), 1.0),
                            Left::Values((g, rounded_g)),
                            ((sums.get().add(c.0) as *mut f32, c.1, 1), add),
                        );
                        continue;
                    }
                }
            }
            let b = if pointwise {
                // SAFETY: the taps name pixel `r` for output pixel `r`.
                unsafe { x.get().add(first * channels) as *const T }
            } else {
                let columns = &mut columns[..count * part_inner];
                let table = &mut table[..count * per_window];
                fill_taps(&window, images, first, table, Outside::Marked);
                // SAFETY: `x` holds every pixel the taps name.
                unsafe {
                    gather(
                        x.get(),
                        (table, per_window, tap_range.clone()),
                        channels,
                        (columns, part_inner),
                    )
                };
                columns.as_ptr()
            };
            // SAFETY: rows `start..end`, columns of taps `tap_range`, of block
            // `block`'s partial sums are this unit's alone; `g` holds every output
            // pixel's row.
            unsafe {
                let c = sums.get().add(c.0);
                T::product_rounded(
                    products,
                    ((end - start, count, part_inner), T::ONE),
                    (
                        (
                            (g.get().add(first * width + start), 1, width as isize),
                            rounded_g,
                        ),
                        ((b, part_inner as isize, 1), None),
                    ),
                    ((c, inner as isize, 1), add),
                );
            }
        }
    });
    // SAFETY: `out` holds `width * channels / groups * taps` values.
    unsafe {
        add_partials(
            out,
            (&mut partials, size),
            (shape, groups),
            |partial, o, c, t| partial[o * inner + t * channels + c],
        )
    };
}

/// Values of the columns' gradient [`strided_input_grad`] holds at once (more for an
/// image with more output pixels; few in tests, so that they see several groups).
const GROUP_VALUES: usize = if cfg!(test) { 1 << 10 } else { 1 << 22 };

/// The values of the columns a thread gathers for `shape` at once.
pub(crate) fn tile_scratch(shape: Shape) -> Option<usize> {
    shape
        .taps
        .checked_mul(shape.channels)?
        .checked_mul(TILE_ROWS)
}

/// The values of the columns' gradient [`strided_input_grad`] holds for `images`.
pub(crate) fn input_grad_scratch(images: &[WindowImage], shape: Shape) -> Option<usize> {
    let inner = shape.taps.checked_mul(shape.width)?;
    let outputs = images
        .iter()
        .map(|image| (image.out.0 * image.out.1) as usize);
    let largest = outputs.clone().max().unwrap_or(0);
    // No more rows than the batch has (late stages have few pixels).
    let rows = (GROUP_VALUES / inner.max(1))
        .max(TILE_ROWS)
        .min(outputs.fold(0, usize::saturating_add))
        .max(largest);
    rows.checked_mul(inner)
}

/// A strided convolution's input gradient as GEMMs: the output pixels' gradients
/// (`channels` each) times the weight (`[channels, width, taps]`, dense) give their
/// columns' gradient, added to the input pixels (`width` values each) the columns were
/// gathered from. A group of images at a time: the GEMM over their pixels in tiles,
/// then every image's sums in order, images in parallel.
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
    let Some(scratch) = input_grad_scratch(images, shape) else {
        // The caller checked the scratch against the run's budget: not reached.
        return;
    };
    let group_rows = scratch / inner.max(1);
    // Every row a group reads is written by its GEMM first.
    let mut buffer = Lent::<T>::new(scratch);
    let matrix = by_tap(weight, (channels, width, per_window));
    let threads = threads_for(taps.rows.len().saturating_mul(channels * width));
    // With bf16 products, the matrix and the gradient rounded once (the gradient kept
    // by the run, `crate::kept`; the matrix, this step's own, not).
    let outputs = |image: &WindowImage| (image.out.0 * image.out.1) as usize;
    let g_values = nestor_layout::pixels(images).1 * channels;
    // SAFETY: the matrix holds `channels * inner` values; `g` a row of `channels` per
    // output pixel of `images` (from the first image's first, 0).
    let (rounded_matrix, rounded_g) = unsafe {
        (
            T::rounded_here(products, matrix.as_ptr(), matrix.len(), threads),
            T::rounded_buffer(products, g, g_values, threads),
        )
    };
    let (rounded_matrix, rounded_g) = (rounded_matrix.as_ref(), rounded_g.as_deref());
    let (matrix, columns) = (
        SendPointer(matrix.as_ptr() as *mut T),
        SendPointer(buffer.as_mut_ptr()),
    );
    let (out, g) = (SendPointer(out), SendPointer(g as *mut T));
    let mut next = 0;
    while next < images.len() {
        // Images `next..end`, their output pixels `first..first + rows`.
        let first = images[next].output;
        let mut end = next + 1;
        while end < images.len() && images[end].output + outputs(&images[end]) - first <= group_rows
        {
            end += 1;
        }
        let rows = images[end - 1].output + outputs(&images[end - 1]) - first;
        let tiles = rows.div_ceil(TILE_ROWS);
        let parts = parts(tiles, threads, inner, 256);
        crate::team::for_each_chunk(tiles * parts, threads, &|unit| {
            let (tile, part) = (unit / parts * TILE_ROWS, unit % parts);
            let count = TILE_ROWS.min(rows - tile);
            let std::ops::Range { start, end: stop } = even_part(part, parts, inner);
            // SAFETY: columns `start..stop` of rows `tile..tile + count` of the buffer
            // are this unit's alone; `g` holds every output pixel's row.
            unsafe {
                T::product_rounded(
                    products,
                    ((count, channels, stop - start), T::ONE),
                    (
                        (
                            (g.get().add((first + tile) * channels), channels as isize, 1),
                            rounded_g,
                        ),
                        ((matrix.get().add(start), inner as isize, 1), rounded_matrix),
                    ),
                    (
                        (columns.get().add(tile * inner + start), inner as isize, 1),
                        false,
                    ),
                );
            }
        });
        crate::team::for_each_chunk(end - next, threads, &|index| {
            let image = images[next + index];
            let pixels = (image.size.0 * image.size.1) as usize;
            // SAFETY: the image owns its input pixels' rows of `out`; the buffer's rows
            // were all written above and are only read now.
            let (pixels, sums) = unsafe {
                (
                    std::slice::from_raw_parts_mut(
                        out.get().add(image.input * width),
                        pixels * width,
                    ),
                    std::slice::from_raw_parts(
                        columns.get().add((image.output - first) * inner),
                        outputs(&image) * inner,
                    ),
                )
            };
            pixels.fill(T::ZERO);
            let table = &taps.rows[image.output * per_window..][..outputs(&image) * per_window];
            for (column, &source) in sums.chunks_exact(width.max(1)).zip(table) {
                if source >= 0 {
                    let pixel = &mut pixels[(source as usize - image.input) * width..][..width];
                    for (value, &gradient) in pixel.iter_mut().zip(column) {
                        *value += gradient;
                    }
                }
            }
        });
        next = end;
    }
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
    /// output channels are split, a stem's odd channel count. With bf16 products (f32),
    /// the definitions multiply the operands' bf16 roundings (the weight packed straight
    /// from its taps where the process's products are its own, reordered elsewhere; the
    /// weight gradient's columns of 16 channels packed straight from the images'
    /// roundings there).
    fn check<T: Gemm + Into<f64>>(tolerance: f64, products: Products) {
        // An operand as the products read it.
        let operand = |value: f64| match products {
            Products::Bf16 => f64::from(f32::from_bits(
                u32::from(crate::bf16::round(value as f32)) << 16,
            )),
            Products::Float => value,
        };
        // Lent columns, partial sums and taps hold NaNs and far pixels until written.
        crate::spare::poison(T::from_f64(f64::NAN));
        crate::spare::poison(i64::MAX / 4);
        let (heights, widths) = ([31i64, 1, 4, 2], [25i64, 1, 3, 1]);
        for window in windows() {
            for (channels, width) in [(16usize, 32usize), (6, 130), (3, 40)] {
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
                // SAFETY: the buffers hold the images' pixels, the weight and the bias.
                unsafe {
                    convolve(
                        (out.as_mut_ptr(), x.as_ptr()),
                        (&weight, Some(&bias)),
                        &images,
                        shape,
                        (window, products, false),
                        &Finish::NONE,
                    )
                };
                for r in 0..rows {
                    for o in 0..width {
                        let (mut expected, mut magnitude) = (f(&bias[o]), f(&bias[o]).abs());
                        for t in (0..taps).filter(|&t| tap(r, t) >= 0) {
                            for c in 0..channels {
                                let term = operand(f(&x[tap(r, t) as usize * channels + c]))
                                    * operand(f(&weight[(o * channels + c) * taps + t]));
                                expected += term;
                                magnitude += term.abs();
                            }
                        }
                        close(f(&out[r * width + o]), expected, magnitude, "output");
                    }
                }

                // The adjoint of the forward weight `[channels, width, taps]` (a
                // convolution from `width` channels to `channels`) is the convolution by
                // its flip.
                let adjoint = Shape {
                    channels: width,
                    width: channels,
                    taps,
                };
                let flipped = crate::window::flip(&weight, adjoint);
                let (mut by_flip, mut by_adjoint) =
                    (vec![T::NAN; rows * channels], vec![T::NAN; rows * channels]);
                for (out, weight, flag) in [
                    (&mut by_flip, &flipped, false),
                    (&mut by_adjoint, &weight, true),
                ] {
                    let x: Vec<T> = (0..inputs * width).map(|i| value(i + 5, 0.029)).collect();
                    // SAFETY: `x` holds every input pixel's `width` values, `out` every
                    // output pixel's `channels`, the weight `width * channels * taps`.
                    unsafe {
                        convolve(
                            (out.as_mut_ptr(), x.as_ptr()),
                            (weight, None),
                            &images,
                            adjoint,
                            (window, products, flag),
                            &Finish::NONE,
                        )
                    };
                }
                for (got, want) in by_adjoint.iter().zip(&by_flip) {
                    close(f(got), f(want), f(want).abs(), "adjoint convolution");
                }

                for groups in [1usize, 2] {
                    let reads = channels / groups;
                    let mut grad = vec![T::NAN; width * reads * taps];
                    // SAFETY: the gradient holds the grouped weight; `g` a row per pixel.
                    unsafe {
                        weight_grad(
                            (grad.as_mut_ptr(), x.as_ptr(), g.as_ptr()),
                            (&images, window),
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
                                    let term = operand(f(&g[r * width + o]))
                                        * operand(f(&x[tap(r, t) as usize * channels + base + k]));
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
                                let term = operand(f(&g[r * width + o]))
                                    * operand(f(&weight[(o * channels + c) * taps + t]));
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
        check::<f32>(1e-5, Products::Float);
        check::<f32>(1e-5, Products::Bf16);
        check::<f64>(1e-12, Products::Float);
    }
}
