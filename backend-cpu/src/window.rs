//! Window computations over packed images (rows are pixels, `channels` scalars each),
//! on the host: direct convolution (`conv.rs`: every output row a task), max and
//! average pooling over the windows' taps, and the mean of every image, with their
//! gradients; the eager convolution of whole images ([`convolve_images`]). Tasks run
//! on the team; each writes its own output rows.

use nestor_layout::{window_images, WindowError, WindowImage, WindowTaps};

use crate::blas::Gemm;
use crate::columns::{columns_pay, Work};
use crate::conv::{Bf16Pair, GradPlan, Plan};
use crate::finish::Finish;
use crate::parallel::{even_part, worker_threads, SendPointer};
use crate::scalar::Scalar;
use nestor_ir::Window2d;
use nestor_passes::Products;

/// Output rows of an image a convolution task takes: neighbouring rows read the same
/// input rows, which stay in the core's cache (on the tiles, `conv_tiles.rs`, each is
/// rounded once for all of them).
pub(crate) const BAND: i64 = 8;

/// Output pixels a pooling task takes at once.
const BLOCK_ROWS: usize = 128;
/// Output pixels whose weight-gradient terms are summed together (fixed, so the sum's
/// order never depends on the threads).
pub(crate) const GRAD_BLOCK_ROWS: usize = 1024;

/// The buffers of a window step, shared by the team's threads (each writes its own
/// output rows).
#[derive(Clone, Copy)]
struct Buffers<T> {
    out: *mut T,
    x: *const T,
}
// SAFETY: the output rows each thread writes are disjoint (see `run_blocks`).
unsafe impl<T> Send for Buffers<T> {}
unsafe impl<T> Sync for Buffers<T> {}

impl<T> Buffers<T> {
    // Methods, so that closures capture the whole (Sync) struct, not its pointers.
    fn out(self) -> *mut T {
        self.out
    }

    fn x(self) -> *const T {
        self.x
    }
}

/// The sizes of a window step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    /// Input channels.
    pub(crate) channels: usize,
    /// Output channels.
    pub(crate) width: usize,
    /// Taps per window.
    pub(crate) taps: usize,
}

/// The team's threads for a kernel touching `work` scalars: all of them when it is worth
/// splitting, else one.
fn team_threads(work: usize) -> usize {
    if work >= crate::Parallelism::current().kernel_scalars {
        worker_threads().max(1) as usize
    } else {
        1
    }
}

/// Fills a table of window taps, `per_pixel` a pixel ([`nestor_layout::FillTaps`]),
/// a contiguous piece of pixels a thread when the table is worth splitting
/// ([`team_threads`]): a batch's table is megabytes, which one thread filled while the
/// others waited (about 0.6 ms of a 12.5 ms training call of the report's conv net at
/// 77% occupancy, on 2 threads).
pub(crate) fn fill_taps_over_team(
    table: &mut [i64],
    per_pixel: usize,
    part: &(dyn Fn(usize, &mut [i64]) + Sync),
) {
    let threads = team_threads(table.len());
    if threads <= 1 {
        return part(0, table);
    }
    let per_pixel = per_pixel.max(1);
    let piece = (table.len() / per_pixel).div_ceil(threads).max(1);
    let pieces: Vec<std::sync::Mutex<&mut [i64]>> = table
        .chunks_mut(piece * per_pixel)
        .map(std::sync::Mutex::new)
        .collect();
    crate::team::for_each_chunk(pieces.len(), threads, &|index| {
        // One task takes each piece: the lock is never contended.
        if let Ok(mut rows) = pieces[index].lock() {
            part(index * piece, &mut rows);
        }
    });
}

/// Runs `block(start, end)` over blocks of `rows` output rows on the team, split across
/// the cores when `work` (scalars touched) is worth it.
fn run_blocks(rows: usize, work: usize, block: &(dyn Fn(usize, usize) + Sync)) {
    let threads = team_threads(work);
    // A few blocks per thread, so that uneven images still balance.
    let blocks = rows.div_ceil(BLOCK_ROWS).max(1);
    let per_task = blocks.div_ceil(threads * 4).max(1) * BLOCK_ROWS;
    let tasks = rows.div_ceil(per_task);
    if tasks > 1 && threads > 1 {
        crate::Parallelism::count_split();
    }
    crate::team::for_each_chunk(tasks, threads, &|task| {
        block(task * per_task, ((task + 1) * per_task).min(rows))
    });
}

/// Convolves packed images `x [sum H_i W_i, channels]` (rows are pixels, channels
/// last) with `weight [width, channels, K_h, K_w]` and `bias [width]` into
/// `out [sum H_out W_out, width]`: the direct convolution compiled programs run, on
/// the team. Every size is checked against the buffers.
///
/// ```
/// use nestor_ir::Window2d;
/// use nestor_backend_cpu::convolve_images;
///
/// // One channel; a 2x2 image and a 1x1 one; a 3x3 window of ones keeping every size:
/// // each output pixel sums its image's pixels around it (outside the image: zeros).
/// let window = Window2d { kernel: [3, 3], stride: [1, 1], padding: [1, 1], dilation: [1, 1] };
/// let pixels = [1.0, 2.0, 3.0, 4.0, 5.0];
/// let mut out = [0.0f32; 5];
/// convolve_images(&mut out, &pixels, (&[1.0; 9], Some(&[0.5])), (1, 1), &window, (&[2, 1], &[2, 1]))?;
/// assert_eq!(out, [10.5, 10.5, 10.5, 10.5, 5.5]);
/// // A weight of the wrong size is an error, not a read past it.
/// assert!(convolve_images(&mut out, &pixels, (&[1.0; 4], None), (1, 1), &window, (&[2, 1], &[2, 1])).is_err());
/// # Ok::<(), nestor_layout::WindowError>(())
/// ```
pub fn convolve_images(
    out: &mut [f32],
    x: &[f32],
    (weight, bias): (&[f32], Option<&[f32]>),
    (channels, width): (usize, usize),
    window: &Window2d,
    (heights, widths): (&[i64], &[i64]),
) -> Result<(), WindowError> {
    convolve_checked(
        out,
        x,
        (weight, bias),
        (channels, width),
        window,
        (heights, widths),
        (Products::Float, false, &Finish::NONE),
    )
}

/// [`convolve_images`] in the type `T`, its products as `products` says; with
/// `adjoint`, by the adjoint of `weight` (see [`convolve`]); its output rows finished
/// by `finish`.
fn convolve_checked<T: Gemm>(
    out: &mut [T],
    x: &[T],
    (weight, bias): (&[T], Option<&[T]>),
    (channels, width): (usize, usize),
    window: &Window2d,
    (heights, widths): (&[i64], &[i64]),
    (products, adjoint, finish): (Products, bool, &Finish<'_>),
) -> Result<(), WindowError> {
    let images = window_images(window, heights, widths)?;
    let (inputs, outputs) = images.last().map_or((0, 0), |last| {
        (
            last.input + (last.size.0 * last.size.1) as usize,
            last.output + (last.out.0 * last.out.1) as usize,
        )
    });
    let taps = usize::try_from(window.taps()).unwrap_or(usize::MAX);
    let expect = |what: &'static str, expected: Option<usize>, got: usize| match expected {
        Some(expected) if expected == got => Ok(()),
        _ => Err(WindowError::Buffer {
            what,
            expected: expected.unwrap_or(usize::MAX),
            got,
        }),
    };
    expect("input pixels", inputs.checked_mul(channels), x.len())?;
    expect("output pixels", outputs.checked_mul(width), out.len())?;
    let weights = width
        .checked_mul(channels)
        .and_then(|n| n.checked_mul(taps));
    expect("weight", weights, weight.len())?;
    if let Some(bias) = bias {
        expect("bias", Some(width), bias.len())?;
    }
    let shape = Shape {
        channels,
        width,
        taps,
    };
    // Every buffer's size was checked just above.
    unsafe {
        convolve::<T>(
            (out.as_mut_ptr() as *mut u8, x.as_ptr() as *const u8),
            (
                weight.as_ptr() as *const u8,
                bias.map(|bias| bias.as_ptr() as *const u8),
            ),
            &images,
            shape,
            (*window, products, adjoint),
            finish,
        )
    };
    Ok(())
}

/// `count` values of type `T` at a run's buffer (none when `count` is 0).
///
/// # Safety
/// The buffer must hold them and not be written while the slice lives.
unsafe fn run_slice<'a, T>(pointer: *mut u8, count: usize) -> &'a [T] {
    match count {
        0 => &[],
        _ => unsafe { std::slice::from_raw_parts(pointer as *const T, count) },
    }
}

/// [`run_slice`] to write.
///
/// # Safety
/// As [`run_slice`], and nothing else may read or write the buffer while it lives.
unsafe fn run_slice_mut<'a, T>(pointer: *mut u8, count: usize) -> &'a mut [T] {
    match count {
        0 => &mut [],
        _ => unsafe { std::slice::from_raw_parts_mut(pointer as *mut T, count) },
    }
}

/// The convolution of every image (see [`crate::conv`]): one task per output row. With
/// bf16 products ([`Products::Bf16`], f32 buffers) on a CPU where they pay
/// ([`bf16_dot_pays`]) and an even count of input channels, the input and the weight
/// are rounded to bf16 and multiplied two channels at a time with f32 sums
/// ([`convolve_pairs`]); elsewhere the f32 kernel multiplies the f32 values. At large
/// channel counts ([`columns_pay`]) GEMMs over gathered columns instead
/// (`crate::columns`). With `adjoint` (an input's gradient), the weight is the forward
/// one, `[channels, width, K_h, K_w]` (its output channels this step's input), flipped
/// and with its channels swapped: `W'[c, o, ky, kx] = W[o, c, K_h - 1 - ky, K_w - 1 - kx]`.
/// `finish` finishes the output's rows as they are written.
///
/// # Safety
/// `out` must hold every output pixel of `images` times `width` values, `x` every
/// input pixel times `channels`, the weight `width * channels * taps` and the bias
/// `width`, of type `T`; `finish` must be for `out`.
unsafe fn convolve<T: Gemm>(
    (out, x): (*mut u8, *const u8),
    (weight, bias): (*const u8, Option<*const u8>),
    images: &[WindowImage],
    shape: Shape,
    (window, products, adjoint): (Window2d, Products, bool),
    finish: &Finish<'_>,
) {
    // SAFETY: as the caller promises.
    let weight = unsafe {
        std::slice::from_raw_parts(
            weight as *const T,
            shape.width * shape.channels * shape.taps,
        )
    };
    let f32_values = std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>();
    let tiles = f32_values && crate::conv_tiles::pays(shape.channels, &window, products);
    if !tiles && columns_pay(shape, Work::Convolution, products) {
        // SAFETY: as the caller promises.
        unsafe {
            let bias = bias.map(|bias| std::slice::from_raw_parts(bias as *const T, shape.width));
            crate::columns::convolve(
                (out as *mut T, x as *const T),
                (weight, bias),
                images,
                shape,
                (window, products, adjoint),
                finish,
            );
        }
        return;
    }
    let flipped;
    let weight = if adjoint {
        flipped = flip(weight, shape);
        flipped.as_ptr() as *const u8
    } else {
        weight.as_ptr() as *const u8
    };
    // SAFETY: as the caller promises (`T` is f32 with `tiles`).
    if let Some(plan) = tiles
        .then(|| unsafe {
            crate::conv_tiles::Plan::new(
                (out as *mut f32, x as *const f32),
                (weight as *const f32, bias.map(|bias| bias as *const f32)),
                (shape.channels, shape.width),
                window,
                images,
            )
        })
        .flatten()
    {
        for_each_band(images, (shape, window), finish, BAND, &|image, rows| {
            plan.rows(image, rows)
        });
        return;
    }
    let pairs = products == Products::Bf16 && f32_values;
    // SAFETY (both paths): as the caller promises (`T` is f32 for pairs, checked just
    // above).
    if pairs
        && bf16_dot_pays()
        && unsafe { convolve_pairs((out, x), (weight, bias), images, (shape, window), finish) }
    {
        return;
    }
    let plan = unsafe {
        Plan::new(
            (out as *mut T, x as *const T),
            (weight as *const T, bias.map(|bias| bias as *const T)),
            (shape.channels, shape.width),
            window,
            images,
        )
    };
    for_each_row(images, (shape, window), finish, &|image, row| {
        plan.row(image, row)
    });
}

/// [`convolve`] of bf16 roundings with f32 sums, two channels a product on
/// AVX512-BF16 (the products of two roundings are exact in f32). Returns whether it
/// ran: not where the CPU lacks AVX512-BF16 or the channels are odd.
///
/// # Safety
/// As [`convolve`], for f32 buffers.
unsafe fn convolve_pairs(
    (out, x): (*mut u8, *const u8),
    (weight, bias): (*const u8, Option<*const u8>),
    images: &[WindowImage],
    (shape, window): (Shape, Window2d),
    finish: &Finish<'_>,
) -> bool {
    let Shape {
        channels, width, ..
    } = shape;
    if !crate::dot::host_has() || !channels.is_multiple_of(2) {
        return false;
    }
    let pixels = nestor_layout::pixels(images).0;
    // SAFETY: as the caller promises.
    let x = unsafe { std::slice::from_raw_parts(x as *const f32, pixels * channels) };
    let threads = worker_threads().max(1) as usize;
    crate::bf16::with_roundings::<u16, _>(x, threads, |rounded| {
        // The roundings two to a pair: every pixel's `channels / 2` pairs.
        let pairs = rounded.as_ptr() as *const Bf16Pair;
        // SAFETY: the weight and bias as the caller promises, the pairs of every pixel.
        let plan = unsafe {
            Plan::bf16(
                (out as *mut f32, pairs),
                (weight as *const f32, bias.map(|bias| bias as *const f32)),
                (channels, width),
                window,
                images,
            )
        };
        plan.map(|plan| {
            for_each_row(images, (shape, window), finish, &|image, row| {
                plan.row(image, row)
            })
        })
        .is_some()
    })
}

/// Whether bf16 convolutions take the AVX512-BF16 kernel: where the CPU has it and it
/// convolves a probe (16 channels in and out, 3x3, a 48x48 image; best of three runs
/// after one untimed) faster than the f32 kernel does (one `vdpbf16ps` does the work of
/// two fused multiply-adds, but some CPUs issue half as many: on a Xeon with AMX the
/// pairs took 1.5 ms where the f32 kernel took 1.2).
/// `NESTOR_BF16=f32` turns it off. Chosen once per process.
fn bf16_dot_pays() -> bool {
    static CHOICE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CHOICE.get_or_init(|| {
        if !crate::dot::host_has() || crate::process::env_is("NESTOR_BF16", "f32") {
            return false;
        }
        let window = Window2d {
            kernel: [3, 3],
            stride: [1, 1],
            padding: [1, 1],
            dilation: [1, 1],
        };
        let (side, channels) = (48usize, 16usize);
        let Ok(images) = window_images(&window, &[side as i64], &[side as i64]) else {
            return false;
        };
        let shape = Shape {
            channels,
            width: channels,
            taps: 9,
        };
        let x: Vec<f32> = (0..side * side * channels)
            .map(|i| (i % 13) as f32 / 8.0)
            .collect();
        let weight: Vec<f32> = (0..channels * channels * 9)
            .map(|i| (i % 11) as f32 / 16.0)
            .collect();
        let mut out = vec![0f32; side * side * channels];
        let mut best = [f64::INFINITY; 2];
        for timed in [false, true, true, true] {
            for (dot, best) in best.iter_mut().enumerate() {
                let started = std::time::Instant::now();
                let buffers = (out.as_mut_ptr() as *mut u8, x.as_ptr() as *const u8);
                let weights = (weight.as_ptr() as *const u8, None);
                // SAFETY: the buffers hold one image's pixels, the weight its values.
                unsafe {
                    if dot == 1 {
                        convolve_pairs(buffers, weights, &images, (shape, window), &Finish::NONE);
                    } else {
                        convolve::<f32>(
                            buffers,
                            weights,
                            &images,
                            shape,
                            (window, Products::Float, false),
                            &Finish::NONE,
                        );
                    }
                }
                if timed {
                    *best = best.min(started.elapsed().as_secs_f64());
                }
            }
        }
        best[1] < best[0]
    })
}

/// `row(image, row)` for every output row of `images`, [`BAND`] rows of an image a task,
/// spread over the team when the convolution is worth splitting, each task's pixels
/// then finished by `finish`.
fn for_each_row(
    images: &[WindowImage],
    (shape, window): (Shape, Window2d),
    finish: &Finish<'_>,
    row: &(dyn Fn(usize, i64) + Sync),
) {
    for_each_band(images, (shape, window), finish, BAND, &|image, rows| {
        rows.for_each(|output_row| row(image, output_row))
    });
}

/// `rows(image, band)` for every band of `band` output rows of each image of `images`
/// (its last band shorter), spread over the team when the convolution is worth
/// splitting, each band's pixels then finished by `finish`.
fn for_each_band(
    images: &[WindowImage],
    (shape, window): (Shape, Window2d),
    finish: &Finish<'_>,
    band: i64,
    rows: &(dyn Fn(usize, std::ops::Range<i64>) + Sync),
) {
    let band = band.max(1);
    let bands: Vec<(usize, std::ops::Range<i64>)> = images
        .iter()
        .enumerate()
        .flat_map(|(index, image)| {
            let height = image.out.0;
            (0..height)
                .step_by(band as usize)
                .map(move |first| (index, first..(first + band).min(height)))
        })
        .collect();
    let pixels = nestor_layout::pixels(images).1;
    let macs = pixels
        .saturating_mul(shape.width)
        .saturating_mul(shape.channels)
        .saturating_mul(window.taps() as usize);
    let threads = if macs as f64 >= crate::Parallelism::current().gemm_macs as f64 {
        worker_threads().max(1) as usize
    } else {
        1
    };
    if threads > 1 {
        crate::Parallelism::count_split();
    }
    crate::team::for_each_chunk(bands.len(), threads, &|task| {
        let (image, band) = bands[task].clone();
        rows(image, band.clone());
        let width = images[image].out.1 as usize;
        let (first, end) = (
            images[image].output + band.start as usize * width,
            images[image].output + band.end as usize * width,
        );
        // SAFETY: `rows` wrote this band's pixels, this task's alone.
        unsafe { finish.rows(first, end) };
    });
}

/// Max or average pooling: over each window's taps inside its image, per channel.
///
/// # Safety
/// `out` must hold `rows * channels` values and `x` every row the taps name.
pub(crate) unsafe fn pool<T: Scalar>(
    (out, x): (*mut u8, *const u8),
    taps: &WindowTaps,
    shape: Shape,
    max: bool,
) {
    let Shape {
        channels,
        taps: per_window,
        ..
    } = shape;
    let rows = taps.rows.len() / per_window.max(1);
    let buffers = Buffers {
        out: out as *mut T,
        x: x as *const T,
    };
    let block = |start: usize, end: usize| {
        // SAFETY: rows `start..end` of `out` are this task's.
        let out_rows = unsafe {
            std::slice::from_raw_parts_mut(
                buffers.out().add(start * channels),
                (end - start) * channels,
            )
        };
        let windows = taps.rows[start * per_window..end * per_window].chunks(per_window.max(1));
        // Compiled for the host's vectors, its taps in a plain loop.
        crate::vectors::widest(
            #[inline(always)]
            || pool_rows::<T>(out_rows, windows, (buffers.x(), channels), max),
        );
    };
    run_blocks(rows, rows.saturating_mul(per_window * channels), &block);
}

/// [`pool`]'s output rows `out_rows`, one a window of taps of `windows`.
///
/// # Safety
/// The taps must name rows of `x`, of `channels` values each.
#[inline(always)]
fn pool_rows<'w, T: Scalar>(
    out_rows: &mut [T],
    windows: impl Iterator<Item = &'w [i64]>,
    (x, channels): (*const T, usize),
    max: bool,
) {
    {
        for (row, windows) in out_rows.chunks_mut(channels.max(1)).zip(windows) {
            row.fill(if max { T::NEG_INFINITY } else { T::ZERO });
            let mut inside = 0usize;
            for &source in windows {
                if source < 0 {
                    continue;
                }
                inside += 1;
                // SAFETY: the taps name rows of `x`.
                let pixel = unsafe {
                    std::slice::from_raw_parts(x.add(source as usize * channels), channels)
                };
                if max {
                    for (value, &p) in row.iter_mut().zip(pixel) {
                        *value = if replaces(p, *value) { p } else { *value };
                    }
                } else {
                    for (value, &p) in row.iter_mut().zip(pixel) {
                        *value += p;
                    }
                }
            }
            if !max {
                let divisor = T::from_f64(inside as f64);
                for value in row.iter_mut() {
                    *value = *value / divisor;
                }
            }
        }
    }
}

/// The mean pixel of every image (`counts` pixels each, packed in order): NaN for an
/// empty image, as torch's mean.
///
/// # Safety
/// `out` must hold `counts.len() * channels` values and `x` the sum of `counts` rows.
pub(crate) unsafe fn image_means<T: Scalar>(
    (out, x): (*mut u8, *const u8),
    counts: &[i64],
    channels: usize,
) {
    let buffers = Buffers {
        out: out as *mut T,
        x: x as *const T,
    };
    for_each_image(counts, channels, &|index, first, count| {
        // SAFETY: image `index` owns row `index` of `out` and its pixels' rows of `x`.
        let (row, pixels) = unsafe {
            (
                std::slice::from_raw_parts_mut(buffers.out().add(index * channels), channels),
                std::slice::from_raw_parts(buffers.x().add(first * channels), count * channels),
            )
        };
        row.copy_from_slice(&crate::gemm::column_sums(pixels, None, channels));
        let divisor = T::from_f64(count as f64);
        for value in row.iter_mut() {
            *value = *value / divisor;
        }
    });
}

/// Runs `image(index, first pixel, pixels)` for every image (`counts` pixels each,
/// packed in order) on the team, split across the cores when their values are worth it.
fn for_each_image(counts: &[i64], channels: usize, image: &(dyn Fn(usize, usize, usize) + Sync)) {
    let mut starts = Vec::with_capacity(counts.len());
    let mut total = 0usize;
    for &count in counts {
        starts.push(total);
        total += count.max(0) as usize;
    }
    let threads = team_threads(total.saturating_mul(channels));
    crate::team::for_each_chunk(counts.len(), threads, &|index| {
        image(index, starts[index], counts[index].max(0) as usize)
    });
}

/// The buffers of a convolution step: pointers and value counts.
pub(crate) struct SlotBuffers {
    pub(crate) out: (*mut u8, usize),
    pub(crate) x: (*mut u8, usize),
    pub(crate) weight: (*mut u8, usize),
    pub(crate) bias: Option<(*mut u8, usize)>,
}

/// A convolution step in `T`: with the weight as the program holds it, or (`adjoint`,
/// an input's gradient) flipped and with its channels swapped; its output rows finished
/// by `finish` as they are written.
///
/// # Safety
/// Every buffer must hold its count of values of type `T`; the output no other;
/// `finish` must be for the output.
pub(crate) unsafe fn convolve_slots<T: Gemm>(
    buffers: SlotBuffers,
    (adjoint, groups, products): (bool, usize, Products),
    (channels, width): (usize, usize),
    window: &Window2d,
    sizes: (&[i64], &[i64]),
    finish: &Finish<'_>,
) -> Result<(), WindowError> {
    let (out, x, grouped, bias) = unsafe {
        (
            run_slice_mut::<T>(buffers.out.0, buffers.out.1),
            run_slice::<T>(buffers.x.0, buffers.x.1),
            run_slice::<T>(buffers.weight.0, buffers.weight.1),
            buffers
                .bias
                .map(|(pointer, count)| run_slice::<T>(pointer, count)),
        )
    };
    // A grouped weight as the dense one (the forward weight's output channels are an
    // input gradient's input).
    let dense;
    let weight = match groups {
        0 | 1 => grouped,
        _ => {
            let (outs, ins) = if adjoint {
                (channels, width)
            } else {
                (width, channels)
            };
            let taps = usize::try_from(window.taps()).unwrap_or(0);
            let expected = (outs * ins / groups).saturating_mul(taps);
            if grouped.len() != expected || outs % groups != 0 || ins % groups != 0 {
                return Err(WindowError::Buffer {
                    what: "grouped weight",
                    expected,
                    got: grouped.len(),
                });
            }
            dense = block_diagonal(grouped, (outs, ins, taps), groups);
            &dense[..]
        }
    };
    convolve_checked(
        out,
        x,
        (weight, bias),
        (channels, width),
        window,
        sizes,
        (products, adjoint, finish),
    )
}

/// The forward weight `[channels, width, taps]` of an input's gradient as the weight
/// `[width, channels, taps]` its convolution runs with: flipped, its channels swapped
/// (`W'[c, o, t] = W[o, c, taps - 1 - t]`).
pub(crate) fn flip<T: Scalar>(weight: &[T], shape: Shape) -> Vec<T> {
    let Shape {
        channels,
        width,
        taps,
    } = shape;
    let mut flipped = vec![T::ZERO; weight.len()];
    for o in 0..channels {
        for c in 0..width {
            for t in 0..taps {
                flipped[(c * channels + o) * taps + (taps - 1 - t)] =
                    weight[(o * width + c) * taps + t];
            }
        }
    }
    flipped
}

/// The gradient of every image's mean pixel spread over its pixels (`counts` each):
/// `out[pixel] = g[image] / count`.
///
/// # Safety
/// `out` must hold the sum of `counts` rows of `channels` values, `g` one row per image.
pub(crate) unsafe fn image_spread<T: Scalar>(
    (out, g): (*mut u8, *const u8),
    counts: &[i64],
    channels: usize,
) {
    let buffers = Buffers {
        out: out as *mut T,
        x: g as *const T,
    };
    for_each_image(counts, channels, &|index, first, count| {
        // SAFETY: image `index` owns row `index` of `g` and its pixels' rows of `out`.
        let (mean, pixels) = unsafe {
            (
                std::slice::from_raw_parts(buffers.x().add(index * channels), channels),
                std::slice::from_raw_parts_mut(
                    buffers.out().add(first * channels),
                    count * channels,
                ),
            )
        };
        let divisor = T::from_f64(count as f64);
        for pixel in pixels.chunks_mut(channels.max(1)) {
            for (value, &m) in pixel.iter_mut().zip(mean) {
                *value = m / divisor;
            }
        }
    });
}

/// A convolution's weight gradient: `out[o, c, t] = sum over output pixels r of
/// g[r, o] x[taps[r, t], c]`, summed per block of [`GRAD_BLOCK_ROWS`] pixels
/// ([`GradPlan`]), the blocks' sums added in order.
///
/// # Safety
/// `out` must hold `width * channels * taps` values, `g` a row of `width` per output
/// pixel of `taps`, `x` every row the taps name.
pub(crate) unsafe fn weight_grad<T: Scalar>(
    (out, x, g): (*mut u8, *const u8, *const u8),
    taps: &WindowTaps,
    shape: Shape,
    groups: usize,
) {
    let Shape {
        channels,
        width,
        taps: per_window,
    } = shape;
    let rows = taps.rows.len() / per_window.max(1);
    let lanes = width.div_ceil(16) * 16;
    // SAFETY: as the caller promises.
    let g = unsafe { std::slice::from_raw_parts(g as *const T, rows * width) };
    // Rows of `lanes` values (the kernel reads 16 output channels at a time).
    let padded;
    let g = if lanes == width {
        g
    } else {
        let mut rows_of_lanes = vec![T::ZERO; rows * lanes];
        for (row, values) in rows_of_lanes.chunks_mut(lanes).zip(g.chunks(width.max(1))) {
            row[..width].copy_from_slice(values);
        }
        padded = rows_of_lanes;
        &padded[..]
    };
    let plan = GradPlan {
        x: x as *const T,
        g,
        per_window,
        channels,
        lanes,
    };
    let size = per_window * channels * lanes;
    let blocks = rows.div_ceil(GRAD_BLOCK_ROWS);
    let mut partials = vec![T::ZERO; blocks * size];
    let sums = Buffers {
        out: partials.as_mut_ptr(),
        x: std::ptr::null(),
    };
    let block = |index: usize| {
        let rows = (
            index * GRAD_BLOCK_ROWS,
            ((index + 1) * GRAD_BLOCK_ROWS).min(rows),
        );
        // SAFETY: block `index` owns its partial sums.
        let partial = unsafe { std::slice::from_raw_parts_mut(sums.out().add(index * size), size) };
        // The block's taps: its pixels' rows of the table.
        let block_taps = taps.rows.get(rows.0 * per_window..).unwrap_or(&[]);
        plan.block(rows, block_taps, partial);
    };
    let threads = if rows.saturating_mul(size) >= crate::Parallelism::current().gemm_macs {
        worker_threads().max(1) as usize
    } else {
        1
    };
    crate::team::for_each_chunk(blocks, threads, &block);
    // SAFETY: `out` holds `width * channels / groups * taps` values.
    unsafe {
        add_partials(
            out as *mut T,
            (&mut partials, size),
            (shape, groups),
            |partial, o, c, t| partial[(t * channels + c) * lanes + o],
        )
    };
}

/// Writes a weight gradient `[width, channels / groups, taps]` at `out`: the sum, in
/// order, of the blocks' `partials` (`size` values each; `at(partial, o, c, t)` reads
/// output channel `o`, input channel `c`, tap `t` of one), each output channel's over
/// its group's input channels. The blocks are added into the first in their own layout
/// (a value at a time along the buffer, in parts across the team), then read out
/// through `at` once.
///
/// # Safety
/// `out` must hold `width * channels / groups * taps` values.
pub(crate) unsafe fn add_partials<T: Scalar>(
    out: *mut T,
    (partials, size): (&mut [T], usize),
    (shape, groups): (Shape, usize),
    at: impl Fn(&[T], usize, usize, usize) -> T + Sync,
) {
    let Shape {
        channels,
        width,
        taps,
    } = shape;
    // Output channel `o` reads `reads` channels from `o / (width / groups) * reads`.
    let groups = groups.max(1);
    let (reads, writes) = (channels / groups, (width / groups).max(1));
    let per_output = reads * taps;
    let threads = if partials.len() >= ADDED_IN_PARTS {
        worker_threads().max(1) as usize
    } else {
        1
    };
    let size = size.min(partials.len());
    let (total, rest) = partials.split_at_mut(size);
    if !rest.is_empty() {
        let blocks = rest.len() / size.max(1);
        let (total, rest) = (
            SendPointer(total.as_mut_ptr()),
            SendPointer(rest.as_mut_ptr()),
        );
        crate::team::for_each_chunk(threads, threads, &|part| {
            let values = even_part(part, threads, size);
            // SAFETY: the part's values of the total are this task's alone; the other
            // blocks are only read.
            let total = unsafe {
                std::slice::from_raw_parts_mut(total.get().add(values.start), values.len())
            };
            for block in 0..blocks {
                // SAFETY: block `block` after the first holds `size` values.
                let partial = unsafe {
                    std::slice::from_raw_parts(
                        rest.get().add(block * size + values.start),
                        values.len(),
                    )
                };
                crate::vectors::widest(
                    #[inline(always)]
                    || {
                        for (sum, &value) in total.iter_mut().zip(partial) {
                            *sum += value;
                        }
                    },
                );
            }
        });
    }
    let total = &*total;
    let out = SendPointer(out);
    // The output channels in parts, one a thread.
    let parts = threads.min(width.max(1));
    crate::team::for_each_chunk(parts, parts, &|part| {
        let outputs = even_part(part, parts, width);
        // SAFETY: `out` holds `per_output` values an output channel (as the caller
        // promises); these output channels' are this part's alone.
        let out = unsafe {
            std::slice::from_raw_parts_mut(
                out.get().add(outputs.start * per_output),
                outputs.len() * per_output,
            )
        };
        for (o, sums) in outputs.clone().zip(out.chunks_exact_mut(per_output.max(1))) {
            let base = o / writes * reads;
            for k in 0..reads {
                for t in 0..taps {
                    sums[k * taps + t] = if total.is_empty() {
                        T::ZERO
                    } else {
                        at(total, o, base + k, t)
                    };
                }
            }
        }
    });
}

/// Partial sums' values from which [`add_partials`] splits its output channels across
/// the team.
const ADDED_IN_PARTS: usize = 1 << 16;

/// The dense weight `[outs, ins, taps]` of a convolution in `groups` groups whose
/// weight `grouped` is `[outs, ins / groups, taps]`: zeros outside each output channel's
/// group, so that the CPU runs a grouped convolution and its input's gradient as the
/// dense ones over it (`groups` times the arithmetic of a grouped kernel). A `grouped`
/// of another size leaves zeros where it has no values.
pub(crate) fn block_diagonal<T: Scalar>(
    grouped: &[T],
    (outs, ins, taps): (usize, usize, usize),
    groups: usize,
) -> Vec<T> {
    let groups = groups.max(1);
    let (reads, writes) = (ins / groups, (outs / groups).max(1));
    let mut dense = vec![T::ZERO; outs * ins * taps];
    let block = reads * taps;
    for o in 0..outs {
        let first = (o * ins + o / writes * reads) * taps;
        let to = dense.get_mut(first..first + block);
        if let (Some(to), Some(from)) = (to, grouped.get(o * block..(o + 1) * block)) {
            to.copy_from_slice(from);
        }
    }
    dense
}

/// A convolution's input gradient for any stride and padding: each window's gradient
/// `g[r, :]` times the weight at each of its taps inside the image, added to that tap's
/// input pixel. Images in parallel, each in order (their windows read only their own
/// pixels).
///
/// # Safety
/// `out` must hold every input pixel of `images` times `width` values, `g` every output
/// pixel times `channels`, `weight` `channels * width * taps` (`[C_out, C_in, taps]`);
/// the taps must be those of `images`.
pub(crate) unsafe fn strided_conv_input_grad<T: Gemm>(
    (out, g, weight): (*mut u8, *const u8, *const u8),
    taps: &WindowTaps,
    images: &[WindowImage],
    shape: Shape,
    (groups, products): (usize, Products),
) {
    let Shape {
        channels,
        width,
        taps: per_window,
    } = shape;
    // SAFETY: as the caller promises.
    let grouped = unsafe {
        std::slice::from_raw_parts(
            weight as *const T,
            channels * width / groups.max(1) * per_window,
        )
    };
    let dense;
    let weight = match groups {
        0 | 1 => grouped,
        _ => {
            dense = block_diagonal(grouped, (channels, width, per_window), groups);
            &dense[..]
        }
    };
    if columns_pay(shape, Work::Convolution, products) {
        // SAFETY: as the caller promises.
        unsafe {
            crate::columns::strided_input_grad(
                (out as *mut T, g as *const T),
                weight,
                (taps, images),
                shape,
                products,
            )
        };
        return;
    }
    // `[taps, width, channels]`: a tap's weights for an input channel are contiguous over
    // the output channels, as a gradient's row.
    let mut packed = vec![T::ZERO; weight.len()];
    for o in 0..channels {
        for c in 0..width {
            for t in 0..per_window {
                packed[(t * width + c) * channels + o] = weight[(o * width + c) * per_window + t];
            }
        }
    }
    let grads = Buffers {
        out: std::ptr::null_mut(),
        x: g as *const T,
    };
    let work = taps
        .rows
        .len()
        .saturating_mul(channels)
        .saturating_mul(width);
    let window = |image: &WindowImage, r: usize, out: &mut [T]| {
        // SAFETY: `g` holds every output pixel.
        let grad = unsafe { std::slice::from_raw_parts(grads.x().add(r * channels), channels) };
        let windows = &taps.rows[r * per_window..(r + 1) * per_window];
        for (t, &source) in windows.iter().enumerate() {
            if source < 0 {
                continue;
            }
            let row = &mut out[(source as usize - image.input) * width..][..width];
            let weights = &packed[t * width * channels..][..width * channels];
            for (value, tap) in row.iter_mut().zip(weights.chunks(channels.max(1))) {
                let mut sum = T::ZERO;
                for (&gradient, &w) in grad.iter().zip(tap) {
                    sum += gradient * w;
                }
                *value += sum;
            }
        }
    };
    // SAFETY: `out` holds every input pixel of `images`, `width` values each.
    unsafe { scatter_windows(out as *mut T, images, width, work, window) }
}

/// Runs `window(image, r, out)` for every window `r` of every image, in order, with
/// `out` that image's input pixels (`width` values each), zeroed first: the windows
/// scatter into the pixels they read. Images in parallel (their windows read only their
/// own pixels), split across the cores when `work` (scalars touched) is worth it; an
/// image's windows in the host's widest vectors (`window` inlined there when it is
/// `#[inline(always)]`).
///
/// # Safety
/// `out` must hold every input pixel of `images` times `width` values.
unsafe fn scatter_windows<T: Scalar>(
    out: *mut T,
    images: &[WindowImage],
    width: usize,
    work: usize,
    window: impl Fn(&WindowImage, usize, &mut [T]) + Sync,
) {
    let buffers = Buffers {
        out,
        x: std::ptr::null(),
    };
    let image = |index: usize| {
        let image = images[index];
        let pixels = (image.size.0 * image.size.1) as usize;
        let outputs = (image.out.0 * image.out.1) as usize;
        // SAFETY: image `index` owns its input pixels' rows of `out`.
        let out = unsafe {
            std::slice::from_raw_parts_mut(buffers.out().add(image.input * width), pixels * width)
        };
        out.fill(T::ZERO);
        crate::vectors::widest(
            #[inline(always)]
            || {
                for r in image.output..image.output + outputs {
                    window(&image, r, out);
                }
            },
        );
    };
    crate::team::for_each_chunk(images.len(), team_threads(work), &image);
}

/// Channels max pooling's gradient compares at a time (on the stack).
const POOL_CHUNK: usize = 32;

/// Whether `candidate` replaces `value` as a window's largest: torch's max pooling takes
/// a larger value or a NaN (so the last NaN of a window).
#[inline(always)]
fn replaces<T: Scalar>(candidate: T, value: T) -> bool {
    candidate > value || candidate.is_nan()
}

/// Takes `values` (of window tap `tap`) where they replace the `best` so far
/// ([`replaces`]), and marks their channels `picked` by `tap`.
#[inline(always)]
fn pick_larger<T: Scalar>(
    best: &mut [T; POOL_CHUNK],
    picked: &mut [u32; POOL_CHUNK],
    values: &[T; POOL_CHUNK],
    tap: u32,
) {
    for ((best, picked), &value) in best.iter_mut().zip(picked.iter_mut()).zip(values) {
        let taken = replaces(value, *best);
        *picked = if taken { tap } else { *picked };
        *best = if taken { value } else { *best };
    }
}

/// Pooling's gradient: every output pixel's gradient to the input pixel max pooling
/// picked (the first largest, or the last NaN, as libtorch's kernel), or shared by the
/// pixels an average took. Images in parallel, each in order (their windows read only
/// their own pixels).
///
/// # Safety
/// `out` and `x` must hold every input pixel of `images`, `g` every output pixel, of
/// `channels` values; the taps must be those of `images`.
pub(crate) unsafe fn pool_grad<T: Scalar>(
    (out, x, g): (*mut u8, *const u8, *const u8),
    taps: &WindowTaps,
    images: &[WindowImage],
    shape: Shape,
    max: bool,
) {
    let Shape {
        channels,
        taps: per_window,
        ..
    } = shape;
    let inputs = Buffers {
        out: std::ptr::null_mut(),
        x: x as *const T,
    };
    let grads = Buffers {
        out: std::ptr::null_mut(),
        x: g as *const T,
    };
    let work = taps.rows.len().saturating_mul(channels);
    // SAFETY: `out` holds every input pixel of `images`, `channels` values each (and
    // within the windows: `g` every output pixel, the taps name rows of `x`).
    unsafe {
        scatter_windows(
            out as *mut T,
            images,
            channels,
            work,
            #[inline(always)]
            |image: &WindowImage, r: usize, out: &mut [T]| {
                let windows = &taps.rows[r * per_window..(r + 1) * per_window];
                let grad = std::slice::from_raw_parts(grads.x().add(r * channels), channels);
                let local = |source: i64| source as usize - image.input;
                if max {
                    // Every channel's largest value and its tap, tap after tap (each tap's
                    // channels contiguous), a chunk of channels at a time on the stack; taps
                    // outside the image are skipped, and the first inside is picked unless a
                    // larger value (or a NaN) follows. Plain loops, whole chunks loaded at
                    // once, and the closure inlined into `scatter_windows`' vector code: as a
                    // closure compiled apart (SSE, memcpy per chunk) ResNet-50's max pool
                    // gradient took 20 ms at 81% occupancy on a 2-core Xeon, now 7.
                    let Some(first_tap) = windows.iter().position(|&source| source >= 0) else {
                        return;
                    };
                    for first in (0..channels).step_by(POOL_CHUNK) {
                        let count = POOL_CHUNK.min(channels - first);
                        let values = |source: i64| {
                            let pixel = std::slice::from_raw_parts(
                                inputs.x().add(source as usize * channels + first),
                                count,
                            );
                            match <&[T; POOL_CHUNK]>::try_from(pixel) {
                                Ok(whole) => *whole,
                                Err(_) => {
                                    let mut chunk = [T::ZERO; POOL_CHUNK];
                                    chunk[..count].copy_from_slice(pixel);
                                    chunk
                                }
                            }
                        };
                        let mut best = values(windows[first_tap]);
                        let mut picked = [first_tap as u32; POOL_CHUNK];
                        for (tap, &source) in windows.iter().enumerate().skip(first_tap + 1) {
                            if source >= 0 {
                                pick_larger(&mut best, &mut picked, &values(source), tap as u32);
                            }
                        }
                        for c in 0..count {
                            out[local(windows[picked[c] as usize]) * channels + first + c] +=
                                grad[first + c];
                        }
                    }
                } else {
                    let inside = windows.iter().filter(|&&source| source >= 0).count();
                    let divisor = T::from_f64(inside as f64);
                    for &source in windows.iter().filter(|&&source| source >= 0) {
                        let row = &mut out[local(source) * channels..][..channels];
                        for (value, &gradient) in row.iter_mut().zip(grad) {
                            *value += gradient / divisor;
                        }
                    }
                }
            },
        )
    }
}

/// Pixels of every image (saturating: sizes that large fail the buffer checks).
pub(crate) fn pixel_counts(heights: &[i64], widths: &[i64]) -> Vec<i64> {
    heights
        .iter()
        .zip(widths)
        .map(|(h, w)| h.saturating_mul(*w))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::Args;

    /// The bf16 rounding of `value`, as f64.
    fn rounded(value: f32) -> f64 {
        f64::from(f32::from_bits(u32::from(crate::bf16::round(value)) << 16))
    }

    /// Max pooling and its gradient on channel counts around and past a chunk
    /// ([`POOL_CHUNK`]) equal the definition, channel by channel: the largest value, or
    /// the window's last NaN; the gradient to the first tap holding it. Values are drawn
    /// from a few, so that windows tie, with NaNs among them; padded taps are skipped.
    #[test]
    fn max_pooling_picks_per_channel_across_chunks() {
        let window = Window2d {
            kernel: [3, 3],
            stride: [2, 2],
            padding: [1, 1],
            dilation: [1, 1],
        };
        let (heights, widths) = ([5i64, 1, 4], [6i64, 1, 3]);
        let images = window_images(&window, &heights, &widths).unwrap();
        let table =
            nestor_layout::window_taps(&window, &heights, &widths, nestor_layout::Outside::Marked)
                .unwrap();
        let last = images.last().unwrap();
        let inputs = last.input + (last.size.0 * last.size.1) as usize;
        let outputs = table.rows.len() / table.taps;
        for channels in [
            1,
            POOL_CHUNK - 1,
            POOL_CHUNK,
            POOL_CHUNK + 1,
            2 * POOL_CHUNK + 6,
        ] {
            let x: Vec<f32> = (0..inputs * channels)
                .map(|i| match i * 7919 % 23 {
                    0 => f32::NAN,
                    draw => (draw % 4) as f32,
                })
                .collect();
            let g: Vec<f32> = (0..outputs * channels).map(|i| 1.0 + i as f32).collect();
            let shape = Shape {
                channels,
                width: channels,
                taps: table.taps,
            };
            let (mut pooled, mut gradient) = (
                vec![0f32; outputs * channels],
                vec![7f32; inputs * channels],
            );
            // SAFETY: the buffers hold the images' input and output pixels.
            unsafe {
                pool::<f32>(
                    (pooled.as_mut_ptr() as *mut u8, x.as_ptr() as *const u8),
                    &table,
                    shape,
                    true,
                );
                pool_grad::<f32>(
                    (
                        gradient.as_mut_ptr() as *mut u8,
                        x.as_ptr() as *const u8,
                        g.as_ptr() as *const u8,
                    ),
                    &table,
                    &images,
                    shape,
                    true,
                );
            }
            let mut expected = vec![0f32; inputs * channels];
            for (r, windows) in table.rows.chunks(table.taps).enumerate() {
                for c in 0..channels {
                    let mut best: Option<(f32, usize)> = None;
                    for source in windows.iter().filter(|&&source| source >= 0) {
                        let value = x[*source as usize * channels + c];
                        if best.is_none_or(|(largest, _)| value > largest || value.is_nan()) {
                            best = Some((value, *source as usize));
                        }
                    }
                    let (largest, source) = best.unwrap();
                    let got = pooled[r * channels + c];
                    assert!(
                        got == largest || (got.is_nan() && largest.is_nan()),
                        "channels {channels}, window {r}, channel {c}: {got} against {largest}"
                    );
                    expected[source * channels + c] += g[r * channels + c];
                }
            }
            assert_eq!(gradient, expected, "channels {channels}");
        }
    }

    /// A bf16 convolution path: runs the convolution of `x` by `weight` (and `bias`)
    /// into `out` and says whether it ran.
    type Bf16Path =
        fn(&mut [f32], (&[f32], &[f32], &[f32]), &[WindowImage], Shape, Window2d) -> bool;

    /// The AVX512-BF16 pairs.
    fn run_pairs(
        out: &mut [f32],
        (x, weight, bias): (&[f32], &[f32], &[f32]),
        images: &[WindowImage],
        shape: Shape,
        window: Window2d,
    ) -> bool {
        // SAFETY: the caller's buffers hold the images' pixels, the weight and the bias.
        unsafe {
            convolve_pairs(
                (out.as_mut_ptr() as *mut u8, x.as_ptr() as *const u8),
                (
                    weight.as_ptr() as *const u8,
                    Some(bias.as_ptr() as *const u8),
                ),
                images,
                (shape, window),
                &Finish::NONE,
            )
        }
    }

    /// The AMX tiles reading the input rows in place (`conv_tiles.rs`).
    fn run_tiles(
        out: &mut [f32],
        (x, weight, bias): (&[f32], &[f32], &[f32]),
        images: &[WindowImage],
        shape: Shape,
        window: Window2d,
    ) -> bool {
        // SAFETY: the caller's buffers hold the images' pixels, the weight and the bias.
        let plan = unsafe {
            crate::conv_tiles::Plan::new(
                (out.as_mut_ptr(), x.as_ptr()),
                (weight.as_ptr(), Some(bias.as_ptr())),
                (shape.channels, shape.width),
                window,
                images,
            )
        };
        let Some(plan) = plan else {
            return false;
        };
        for_each_band(images, (shape, window), &Finish::NONE, 3, &|image, rows| {
            plan.rows(image, rows)
        });
        true
    }

    /// The bf16 convolutions (the AVX512-BF16 pairs and the AMX tiles, where the host
    /// has them) equal the f64 convolution of the rounded input and weight (the
    /// products are exact; only the sums' order differs), with a bias, images of one
    /// pixel, images whose windows leave them and images wider than a tile's 16 pixels,
    /// strides 1 and 2, a stem's 7x7 window, rows dilated, and output channels past 16
    /// and 64.
    #[test]
    fn bf16_convolutions_are_the_products_of_the_roundings() {
        let window = |kernel, stride, padding, dilation| Window2d {
            kernel,
            stride,
            padding,
            dilation,
        };
        let windows = [
            window([3, 3], [1, 1], [1, 1], [1, 1]),
            window([3, 2], [2, 2], [1, 0], [1, 1]),
            window([7, 7], [2, 2], [3, 3], [1, 1]),
            window([3, 3], [1, 2], [2, 1], [2, 1]),
        ];
        let (heights, widths) = ([5i64, 1, 3, 4], [4i64, 1, 7, 37]);
        let paths: [(&str, Bf16Path, bool); 2] = [
            ("pairs", run_pairs, crate::dot::host_has()),
            ("tiles", run_tiles, crate::amx::usable()),
        ];
        for (name, run, host_has) in paths {
            for window in windows {
                for (channels, width) in [(2, 16), (3, 5), (4, 17), (16, 16), (18, 3), (3, 70)] {
                    let shape = Shape {
                        channels,
                        width,
                        taps: window.taps() as usize,
                    };
                    let ran = check_bf16_convolution(run, window, (&heights, &widths), shape);
                    let expected = host_has
                        && match name {
                            "pairs" => channels.is_multiple_of(2),
                            _ => window.dilation[1] == 1,
                        };
                    assert_eq!(ran, expected, "{name}: {window:?}, {shape:?}");
                }
            }
        }
    }

    /// Runs `run` on images of `heights` x `widths` and checks its output against the
    /// f64 convolution of the roundings (see above); returns whether it ran.
    fn check_bf16_convolution(
        run: Bf16Path,
        window: Window2d,
        (heights, widths): (&[i64], &[i64]),
        shape: Shape,
    ) -> bool {
        let Shape {
            channels,
            width,
            taps,
        } = shape;
        let images = window_images(&window, heights, widths).unwrap();
        let (inputs, outputs) = nestor_layout::pixels(&images);
        let value = |i: usize, scale: f32| ((i * 37 % 101) as f32 - 50.0) * scale + 0.001;
        let x: Vec<f32> = (0..inputs * channels).map(|i| value(i, 0.0371)).collect();
        let weight: Vec<f32> = (0..width * channels * taps)
            .map(|i| value(i + 7, 0.0113))
            .collect();
        let bias: Vec<f32> = (0..width).map(|o| o as f32 * 0.25 - 1.0).collect();
        let mut out = vec![f32::NAN; outputs * width];
        if !run(&mut out, (&x, &weight, &bias), &images, shape, window) {
            return false;
        }
        for image in &images {
            let ((height, image_width), (out_h, out_w)) = (image.size, image.out);
            for (oy, ox) in (0..out_h).flat_map(|oy| (0..out_w).map(move |ox| (oy, ox))) {
                let pixel = image.output + (oy * out_w + ox) as usize;
                for o in 0..width {
                    let mut expected = f64::from(bias[o]);
                    let mut magnitude = expected.abs();
                    for (t, (ky, kx)) in (0..window.kernel[0])
                        .flat_map(|ky| (0..window.kernel[1]).map(move |kx| (ky, kx)))
                        .enumerate()
                    {
                        let y = oy * window.stride[0] - window.padding[0] + ky * window.dilation[0];
                        let xx =
                            ox * window.stride[1] - window.padding[1] + kx * window.dilation[1];
                        if !(0..height).contains(&y) || !(0..image_width).contains(&xx) {
                            continue;
                        }
                        let source = image.input + (y * image_width + xx) as usize;
                        for c in 0..channels {
                            let term = rounded(x[source * channels + c])
                                * rounded(weight[(o * channels + c) * taps + t]);
                            expected += term;
                            magnitude += term.abs();
                        }
                    }
                    let got = f64::from(out[pixel * width + o]);
                    assert!(
                        (got - expected).abs() <= 1e-6 * magnitude + 1e-7,
                        "{window:?} channels {channels} width {width} pixel {pixel} \
                         output {o}: {got} against {expected}"
                    );
                }
            }
        }
        true
    }

    /// nestor's direct f32 convolution equals its definition on rows of whole register
    /// blocks of pixels and of the smaller blocks of a row's end (widths 1, 4, 13, 37),
    /// with strides, padding and channels past a block of 16.
    #[test]
    fn direct_convolutions_are_the_definition_on_every_block_of_a_row() {
        for stride in [[1, 1], [2, 2]] {
            let window = Window2d {
                kernel: [3, 3],
                stride,
                padding: [1, 1],
                dilation: [1, 1],
            };
            let (heights, widths) = ([2i64, 1, 3, 2], [37i64, 1, 13, 4]);
            let images = window_images(&window, &heights, &widths).unwrap();
            let (inputs, outputs) = nestor_layout::pixels(&images);
            let (channels, width) = (3usize, 20usize);
            let x: Vec<f32> = (0..inputs * channels)
                .map(|i| (i % 7) as f32 - 3.0)
                .collect();
            let weight: Vec<f32> = (0..width * channels * 9)
                .map(|i| (i % 5) as f32 - 2.0)
                .collect();
            let bias: Vec<f32> = (0..width).map(|o| o as f32 * 0.5).collect();
            let mut out = vec![f32::NAN; outputs * width];
            let shape = Shape {
                channels,
                width,
                taps: 9,
            };
            // SAFETY: the buffers hold the images' pixels, the weight and the bias.
            unsafe {
                convolve::<f32>(
                    (out.as_mut_ptr() as *mut u8, x.as_ptr() as *const u8),
                    (
                        weight.as_ptr() as *const u8,
                        Some(bias.as_ptr() as *const u8),
                    ),
                    &images,
                    shape,
                    (window, Products::Float, false),
                    &Finish::NONE,
                )
            };
            for image in &images {
                let ((height, image_width), (out_h, out_w)) = (image.size, image.out);
                for (oy, ox) in (0..out_h).flat_map(|oy| (0..out_w).map(move |ox| (oy, ox))) {
                    let pixel = image.output + (oy * out_w + ox) as usize;
                    for o in 0..width {
                        let mut expected = f64::from(bias[o]);
                        for (ky, kx) in (0..3).flat_map(|ky| (0..3).map(move |kx| (ky, kx))) {
                            let (y, xx) = (oy * stride[0] - 1 + ky, ox * stride[1] - 1 + kx);
                            if !(0..height).contains(&y) || !(0..image_width).contains(&xx) {
                                continue;
                            }
                            let source = image.input + (y * image_width + xx) as usize;
                            for c in 0..channels {
                                expected += f64::from(x[source * channels + c])
                                    * f64::from(
                                        weight[(o * channels + c) * 9 + (ky * 3 + kx) as usize],
                                    );
                            }
                        }
                        let got = f64::from(out[pixel * width + o]);
                        assert!(
                            (got - expected).abs() <= 1e-4,
                            "stride {stride:?}, pixel {pixel}, output {o}: {got} against {expected}"
                        );
                    }
                }
            }
        }
    }

    /// Every output row of a convolution is finished once, after it is written, on each
    /// of its paths: nestor's direct kernel (3 channels), the AVX512-BF16 pairs (where
    /// the host has them), products over gathered columns (16 channels into 40) and,
    /// with bf16 products, the packed weight; its input gradient too.
    #[test]
    fn every_output_row_is_finished_once_after_it_is_written() {
        /// Counts the finishings of rows `start..end` (`args[0]`, a u32 a row): 1 for a
        /// row whose first value (`args[1]`, rows of `*args[2]` f32 values) is written,
        /// 1000 for one still NaN.
        unsafe extern "C" fn count(args: *const *mut u8, start: i64, end: i64) {
            // SAFETY: the test passes the counts, the output and its width.
            unsafe {
                let (counts, out) = (*args as *mut u32, *args.add(1) as *const f32);
                let width = *(*args.add(2) as *const usize);
                for row in start as usize..end as usize {
                    *counts.add(row) += if (*out.add(row * width)).is_nan() {
                        1000
                    } else {
                        1
                    };
                }
            }
        }
        let window = Window2d {
            kernel: [3, 3],
            stride: [2, 1],
            padding: [1, 1],
            dilation: [1, 1],
        };
        let (heights, widths) = ([7i64, 1, 40], [9i64, 1, 33]);
        let images = window_images(&window, &heights, &widths).unwrap();
        let (inputs, outputs) = nestor_layout::pixels(&images);
        for (channels, products, adjoint) in [
            (3, Products::Float, false),
            (4, Products::Bf16, false),
            (16, Products::Float, false),
            (16, Products::Bf16, false),
            (40, Products::Float, true),
            (40, Products::Bf16, true),
        ] {
            let mut width = 40usize;
            let (c_in, c_out) = if adjoint {
                (width, channels)
            } else {
                (channels, width)
            };
            width = c_out;
            let x: Vec<f32> = (0..inputs * c_in).map(|i| (i % 7) as f32 - 3.0).collect();
            let weight: Vec<f32> = (0..c_in * c_out * 9).map(|i| (i % 5) as f32).collect();
            let mut out = vec![f32::NAN; outputs * c_out];
            let mut counts = vec![0u32; outputs];
            let args = [
                counts.as_mut_ptr() as *mut u8,
                out.as_mut_ptr() as *mut u8,
                &mut width as *mut usize as *mut u8,
            ];
            let finishing = Finish {
                epilogue: Some((count, Args(&args))),
                producing: None,
                width: c_out,
            };
            let shape = Shape {
                channels: c_in,
                width: c_out,
                taps: 9,
            };
            // SAFETY: the buffers hold the images' pixels and the weight.
            unsafe {
                convolve::<f32>(
                    (args[1], x.as_ptr() as *const u8),
                    (weight.as_ptr() as *const u8, None),
                    &images,
                    shape,
                    (window, products, adjoint),
                    &finishing,
                )
            };
            assert!(out.iter().all(|value| value.is_finite()));
            let wrong = counts.iter().position(|&count| count != 1);
            assert_eq!(
                wrong.map(|row| (row, counts[row])),
                None,
                "{channels} channels, {products:?}, adjoint {adjoint}: (row, finishings)"
            );
        }
    }
}
