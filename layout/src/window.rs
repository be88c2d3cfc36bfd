//! Sliding windows over packed images: which input pixel every tap of every output
//! pixel's window reads. Images `[C, H_i, W_i]` with ragged `H` and `W` are packed as
//! rows of `C` scalars, one per pixel (row-major within an image, images in order), so
//! a convolution is a GEMM over gathered rows (an implicit GEMM) and pooling a
//! reduction over them. Eager operators and the compiled window step share this table.

use nestor_ir::Window2d;
use thiserror::Error;

/// The largest kernel, stride, padding or dilation a window takes.
const MAX_GEOMETRY: i64 = 1 << 24;
/// The largest image side: with [`MAX_GEOMETRY`], no coordinate overflows an `i64`.
const MAX_SIDE: i64 = 1 << 40;

/// Why a window cannot slide over a batch of images.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum WindowError {
    /// Kernel, stride and dilation must be positive and padding not negative, all at
    /// most 2^24.
    #[error("window axis {axis}: kernel {kernel}, stride {stride}, padding {padding} and dilation {dilation} must be positive (padding may be 0) and at most 2^24")]
    Geometry {
        /// 0 for the height, 1 for the width.
        axis: usize,
        /// Window size.
        kernel: i64,
        /// Step.
        stride: i64,
        /// Padding.
        padding: i64,
        /// Dilation.
        dilation: i64,
    },
    /// Heights and widths must be given for every image, never negative, at most 2^40.
    #[error("image {image} has size {height}x{width}")]
    BadImage {
        /// Index of the image.
        image: usize,
        /// Its height (-1 when missing).
        height: i64,
        /// Its width (-1 when missing).
        width: i64,
    },
    /// A buffer does not hold what the images and the window need.
    #[error("the {what} buffer holds {got} values, the images need {expected}")]
    Buffer {
        /// Which buffer.
        what: &'static str,
        /// What the sizes need (`usize::MAX` when that overflows).
        expected: usize,
        /// What it holds.
        got: usize,
    },
    /// The table would not fit in memory (or in an `i64`).
    #[error("the window table of {rows} output pixels x {taps} taps is too large")]
    TooLarge {
        /// Output pixels counted before the overflow.
        rows: i64,
        /// Taps per window.
        taps: i64,
    },
}

/// What a tap outside its image reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outside {
    /// `-1`: a padding zero (convolution, average pooling), or nothing (max pooling).
    Marked,
    /// The first tap of the same window inside the image (so a gather then a max over
    /// the taps picks the value and the input position torch's max pooling picks).
    FirstInside,
}

/// The taps of every output pixel of a batch of images.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WindowTaps {
    /// `(H_out, W_out)` of every image.
    pub output_sizes: Vec<(i64, i64)>,
    /// `rows x taps` input rows (packed pixel indices), taps row-major over the window.
    pub rows: Vec<i64>,
    /// Taps per window (`kernel[0] * kernel[1]`).
    pub taps: usize,
}

/// Checks a window's geometry.
pub fn check_window(window: &Window2d) -> Result<(), WindowError> {
    for axis in 0..2 {
        let (kernel, stride, padding, dilation) = (
            window.kernel[axis],
            window.stride[axis],
            window.padding[axis],
            window.dilation[axis],
        );
        let bounded = |value: i64| value <= MAX_GEOMETRY;
        if kernel < 1
            || stride < 1
            || padding < 0
            || dilation < 1
            || ![kernel, stride, padding, dilation].into_iter().all(bounded)
        {
            return Err(WindowError::Geometry {
                axis,
                kernel,
                stride,
                padding,
                dilation,
            });
        }
    }
    Ok(())
}

/// One image under a window: where its pixels start in the packed input and output,
/// and its input and output sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowImage {
    /// First input pixel (packed row).
    pub input: usize,
    /// First output pixel.
    pub output: usize,
    /// Input `(height, width)`.
    pub size: (i64, i64),
    /// Output `(height, width)`.
    pub out: (i64, i64),
}

/// The input and output pixels of all `images`, in order (the packed rows of their
/// inputs and of their outputs).
pub fn pixels(images: &[WindowImage]) -> (usize, usize) {
    images.last().map_or((0, 0), |last| {
        (
            last.input + (last.size.0 * last.size.1) as usize,
            last.output + (last.out.0 * last.out.1) as usize,
        )
    })
}

/// Images of these heights and widths under `window`. Every size and count is
/// checked (they come from users): pixels in and out, in total, fit in an `i64`.
pub fn window_images(
    window: &Window2d,
    heights: &[i64],
    widths: &[i64],
) -> Result<Vec<WindowImage>, WindowError> {
    check_window(window)?;
    let taps = window.taps();
    let mut images = Vec::with_capacity(heights.len());
    let (mut inputs, mut outputs) = (0i64, 0i64);
    for image in 0..heights.len().max(widths.len()) {
        let (height, width) = (
            heights.get(image).copied().unwrap_or(-1),
            widths.get(image).copied().unwrap_or(-1),
        );
        if !(0..=MAX_SIDE).contains(&height) || !(0..=MAX_SIDE).contains(&width) {
            return Err(WindowError::BadImage {
                image,
                height,
                width,
            });
        }
        let out = window.output_size((height, width));
        let too_large = WindowError::TooLarge {
            rows: outputs,
            taps,
        };
        let next_inputs = height
            .checked_mul(width)
            .and_then(|pixels| inputs.checked_add(pixels))
            .ok_or(too_large.clone())?;
        let next_outputs = out
            .0
            .checked_mul(out.1)
            .and_then(|pixels| outputs.checked_add(pixels))
            .ok_or(too_large)?;
        images.push(WindowImage {
            input: inputs as usize,
            output: outputs as usize,
            size: (height, width),
            out,
        });
        (inputs, outputs) = (next_inputs, next_outputs);
    }
    Ok(images)
}

/// The taps of every output pixel of images of these heights and widths under
/// `window`. Every size and count is checked (they come from users); the table is
/// reserved fallibly.
///
/// ```
/// use nestor_ir::Window2d;
/// use nestor_layout::{window_taps, Outside};
///
/// // A 3x3 window keeping every size, over a 2x2 image and a 1x3 one (pixels 0..4, 4..7).
/// let window = Window2d { kernel: [3, 3], stride: [1, 1], padding: [1, 1], dilation: [1, 1] };
/// let taps = window_taps(&window, &[2, 1], &[2, 3], Outside::Marked)?;
/// assert_eq!(taps.output_sizes, [(2, 2), (1, 3)]);
/// // Pixel (0, 0) of the first image: its window's centre is row 0, -1 outside the image.
/// assert_eq!(&taps.rows[..9], &[-1, -1, -1, -1, 0, 1, -1, 2, 3]);
/// # Ok::<(), nestor_layout::WindowError>(())
/// ```
pub fn window_taps(
    window: &Window2d,
    heights: &[i64],
    widths: &[i64],
    outside: Outside,
) -> Result<WindowTaps, WindowError> {
    window_taps_in_parts(window, (heights, widths), outside, &in_one_piece)
}

/// The [`FillTaps`] that fills the whole table at once, on the calling thread.
pub fn in_one_piece(table: &mut [i64], part: &(dyn Fn(usize, &mut [i64]) + Sync)) {
    part(0, table)
}

/// Fills a table of taps ([`window_taps_in_parts`]): handed the table and `part`, which
/// fills the rows of one piece of it (the piece's first pixel and its rows), it calls
/// `part` on pieces that cover the table, on as many threads as it likes (pieces are
/// independent).
pub type FillTaps<'a> = &'a dyn Fn(&mut [i64], &(dyn Fn(usize, &mut [i64]) + Sync));

/// [`window_taps`] with the table's rows filled by `fill`, which may split them over
/// threads (the table of a batch of images is megabytes).
///
/// ```
/// use nestor_ir::Window2d;
/// use nestor_layout::{window_taps, window_taps_in_parts, Outside};
///
/// let window = Window2d { kernel: [3, 3], stride: [1, 1], padding: [1, 1], dilation: [1, 1] };
/// let sizes: (&[i64], &[i64]) = (&[2, 1], &[2, 3]);
/// // Pixels 0..3 and 3..7 filled apart.
/// let halves = |table: &mut [i64], part: &(dyn Fn(usize, &mut [i64]) + Sync)| {
///     let (first, second) = table.split_at_mut(3 * 9);
///     part(0, first);
///     part(3, second);
/// };
/// let taps = window_taps_in_parts(&window, sizes, Outside::Marked, &halves)?;
/// assert_eq!(taps.rows, window_taps(&window, sizes.0, sizes.1, Outside::Marked)?.rows);
/// # Ok::<(), nestor_layout::WindowError>(())
/// ```
pub fn window_taps_in_parts(
    window: &Window2d,
    (heights, widths): (&[i64], &[i64]),
    outside: Outside,
    fill: FillTaps<'_>,
) -> Result<WindowTaps, WindowError> {
    let images = window_images(window, heights, widths)?;
    let taps = window.taps();
    let rows = images
        .last()
        .map_or(0, |last| last.output as i64 + last.out.0 * last.out.1);
    let too_large = WindowError::TooLarge { rows, taps };
    let count = rows
        .checked_mul(taps)
        .and_then(|count| usize::try_from(count).ok())
        .ok_or(too_large.clone())?;
    let mut table = Vec::new();
    table.try_reserve_exact(count).map_err(|_| too_large)?;
    table.resize(count, -1);
    fill(&mut table, &|first, rows| {
        fill_taps(window, &images, first, rows, outside)
    });
    Ok(WindowTaps {
        output_sizes: images.iter().map(|image| image.out).collect(),
        rows: table,
        taps: taps as usize,
    })
}

/// The taps of output pixels `first..` of `images` under `window`, as many as `table`
/// holds rows of [`Window2d::taps`] (a tail past the last pixel is left as it is):
/// [`window_taps`]'s rows for a range of pixels, so that a kernel working through a few
/// pixels at a time needs no table of them all. A row of taps inside its image is
/// written without a test per tap.
pub fn fill_taps(
    window: &Window2d,
    images: &[WindowImage],
    first: usize,
    table: &mut [i64],
    outside: Outside,
) {
    let taps = window.taps().max(1) as usize;
    let mut pixels = table.chunks_exact_mut(taps);
    // The image of pixel `first`, and `first`'s place in it.
    let start = images
        .partition_point(|image| image.output as i64 + image.out.0 * image.out.1 <= first as i64);
    for (index, image) in images.iter().enumerate().skip(start) {
        let ((height, width), (out_h, out_w)) = (image.size, image.out);
        let skip = if index == start {
            first.saturating_sub(image.output) as i64
        } else {
            0
        };
        let first_pixel = image.input as i64;
        for at in skip..out_h * out_w {
            let Some(pixel) = pixels.next() else {
                return;
            };
            let (oy, ox) = (at / out_w, at % out_w);
            let kernel_w = window.kernel[1].max(0) as usize;
            let x0 = ox * window.stride[1] - window.padding[1];
            let x_last = x0 + (window.kernel[1] - 1) * window.dilation[1];
            let x_inside = x0 >= 0 && x_last < width;
            for (ky, row) in (0..).zip(pixel.chunks_exact_mut(kernel_w.max(1))) {
                let y = oy * window.stride[0] - window.padding[0] + ky * window.dilation[0];
                let base = first_pixel + y * width + x0;
                if !(0..height).contains(&y) {
                    row.fill(-1);
                } else if x_inside {
                    // The whole row of taps inside the image: no test a tap.
                    for (kx, slot) in (0..).zip(row.iter_mut()) {
                        *slot = base + kx * window.dilation[1];
                    }
                } else {
                    for (kx, slot) in (0..).zip(row.iter_mut()) {
                        let x = x0 + kx * window.dilation[1];
                        *slot = if (0..width).contains(&x) {
                            base + kx * window.dilation[1]
                        } else {
                            -1
                        };
                    }
                }
            }
            if outside == Outside::FirstInside {
                let first = pixel.iter().copied().find(|&row| row >= 0).unwrap_or(-1);
                for row in pixel.iter_mut().filter(|row| **row < 0) {
                    *row = first;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn same3x3() -> Window2d {
        Window2d {
            kernel: [3, 3],
            stride: [1, 1],
            padding: [1, 1],
            dilation: [1, 1],
        }
    }

    /// Any range of pixels gets the rows of the whole table, for windows with strides,
    /// dilation and padding, both ways of treating taps outside.
    #[test]
    fn taps_from_any_pixel_are_the_table_rows() {
        let windows = [
            same3x3(),
            Window2d {
                kernel: [2, 3],
                stride: [2, 1],
                padding: [0, 2],
                dilation: [1, 2],
            },
        ];
        for window in windows {
            for outside in [Outside::Marked, Outside::FirstInside] {
                let (heights, widths) = ([3, 1, 4, 2], [2, 5, 4, 1]);
                let table = window_taps(&window, &heights, &widths, outside).unwrap();
                let images = window_images(&window, &heights, &widths).unwrap();
                let taps = table.taps;
                let pixels = table.rows.len() / taps;
                for first in 0..pixels {
                    for count in [0, 1, 3, pixels - first] {
                        let count = count.min(pixels - first);
                        let mut rows = vec![7; count * taps];
                        fill_taps(&window, &images, first, &mut rows, outside);
                        assert_eq!(
                            rows,
                            table.rows[first * taps..(first + count) * taps],
                            "{window:?} {outside:?} pixels {first}..+{count}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn taps_of_a_same_convolution_mark_the_border() {
        // Two images, 2x2 and 1x3: pixels 0..4 and 4..7.
        let taps = window_taps(&same3x3(), &[2, 1], &[2, 3], Outside::Marked).unwrap();
        assert_eq!(taps.output_sizes, [(2, 2), (1, 3)]);
        assert_eq!(taps.taps, 9);
        assert_eq!(taps.rows.len(), 7 * 9);
        // Pixel (0, 0) of the first image: its window's centre is row 0.
        assert_eq!(&taps.rows[..9], &[-1, -1, -1, -1, 0, 1, -1, 2, 3]);
        // Pixel (0, 1) of the second image (row 5): left 4, centre 5, right 6.
        assert_eq!(&taps.rows[5 * 9..6 * 9], &[-1, -1, -1, 4, 5, 6, -1, -1, -1]);
    }

    #[test]
    fn first_inside_fills_the_outside_taps() {
        let taps = window_taps(&same3x3(), &[2], &[2], Outside::FirstInside).unwrap();
        assert_eq!(&taps.rows[..9], &[0, 0, 0, 0, 0, 1, 0, 2, 3]);
    }

    #[test]
    fn strides_shrink_and_empty_images_have_no_rows() {
        let window = Window2d {
            kernel: [2, 2],
            stride: [2, 2],
            padding: [0, 0],
            dilation: [1, 1],
        };
        let taps = window_taps(&window, &[5, 0, 1], &[4, 3, 1], Outside::Marked).unwrap();
        assert_eq!(taps.output_sizes, [(2, 2), (0, 1), (0, 0)]);
        assert_eq!(&taps.rows[..4], &[0, 1, 4, 5]);
        assert_eq!(&taps.rows[12..16], &[10, 11, 14, 15]);
    }

    #[test]
    fn bad_geometry_sizes_and_overflow_are_errors() {
        let mut window = same3x3();
        window.stride[1] = 0;
        assert!(matches!(
            window_taps(&window, &[2], &[2], Outside::Marked),
            Err(WindowError::Geometry { axis: 1, .. })
        ));
        assert!(matches!(
            window_taps(&same3x3(), &[2, -3], &[2, 2], Outside::Marked),
            Err(WindowError::BadImage { image: 1, .. })
        ));
        assert!(matches!(
            window_taps(&same3x3(), &[2], &[], Outside::Marked),
            Err(WindowError::BadImage { image: 0, .. })
        ));
        assert!(matches!(
            window_taps(&same3x3(), &[i64::MAX / 2], &[4], Outside::Marked),
            Err(WindowError::BadImage { .. })
        ));
        assert!(matches!(
            window_taps(
                &same3x3(),
                &[1 << 40, 1 << 40],
                &[1 << 40, 1 << 40],
                Outside::Marked
            ),
            Err(WindowError::TooLarge { .. })
        ));
    }
}
