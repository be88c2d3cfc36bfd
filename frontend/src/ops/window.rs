//! Convolution and pooling of packed images `[C, H_i, W_i]` (ragged `H` and `W`: one
//! row of `C` scalars per pixel): a convolution is one implicit GEMM over the gathered
//! pixels of all images (each image's borders read padding zeros), pooling a reduction
//! over them, and global average pooling a segmented mean. No padding to the largest
//! image, no loop over images; autograd flows through the gather and the GEMM.

use std::cell::RefCell;
use std::rc::Rc;

use nestor_backend_cpu::convolve_images;
use nestor_ir::Window2d;
use nestor_layout::{window_images, window_taps, Outside, RaggedLayout};
use tch::{Device, Kind, Tensor};

use super::reduce::Reduce;
use crate::{NestedError, NestedTensor, Result};

/// How many gather tables a thread keeps (a model's layers share a few geometries).
const CACHED_TABLES: usize = 8;

/// The batch and window a gather table or canvas is built for.
#[derive(Clone, PartialEq, Eq)]
struct WindowKey {
    heights: Vec<i64>,
    widths: Vec<i64>,
    window: Window2d,
    device: Device,
}

/// The gather table of one batch's window: input rows (an outside tap reads row
/// `N`, one past the last pixel, or the window's first inside tap for max pooling).
struct Table {
    rows: Tensor,
    output_sizes: Vec<(i64, i64)>,
    taps: i64,
    /// Taps inside the image per output pixel (average pooling's divisors).
    inside: Vec<f64>,
}

/// The images of a batch laid out on one canvas, apart by enough zero pixels that a
/// stride-1 window over the canvas computes each image's own output: shelves of images
/// (tallest first) on a canvas about as wide as it is high. The convolution of the
/// canvas is then one libtorch convolution, channels last.
struct Canvas {
    /// `(height, width)` of the canvas.
    size: (i64, i64),
    /// For every packed pixel, its position on the canvas (row-major).
    input_rows: Tensor,
    /// For every output pixel, its position on the canvas's output.
    output_rows: Tensor,
    /// `(H_out, W_out)` of every image.
    output_sizes: Vec<(i64, i64)>,
}

impl Canvas {
    fn shelves(heights: &[i64], widths: &[i64], window: Window2d, device: Device) -> Result<Self> {
        let too_large = |what: &str| NestedError::TooLarge {
            op: "conv2d",
            what: what.into(),
        };
        let images = window_images(&window, heights, widths).map_err(window_error)?;
        // Zeros between images: what the window reads past an image (its padding),
        // and room for outputs larger than their image.
        let gap = |axis: usize| {
            let reach = window.dilation[axis] * (window.kernel[axis] - 1);
            window.padding[axis]
                .max(2 * window.padding[axis] - reach)
                .max(0)
        };
        let gaps = [gap(0), gap(1)];
        let area = images.iter().try_fold(0i64, |sum, image| {
            let (h, w) = image.size;
            sum.checked_add((h + gaps[0]).checked_mul(w + gaps[1])?)
        });
        let area = area.ok_or_else(|| too_large("the canvas area"))?;
        let widest = images.iter().map(|image| image.size.1).max().unwrap_or(0);
        let canvas_width = widest.max((area as f64).sqrt().ceil() as i64);
        let mut order: Vec<usize> = (0..images.len()).collect();
        order.sort_by_key(|&index| std::cmp::Reverse(images[index].size.0));
        let mut corners = vec![(0i64, 0i64); images.len()];
        let (mut x, mut y, mut shelf) = (0i64, 0i64, 0i64);
        for index in order {
            let (h, w) = images[index].size;
            if x > 0 && x + w > canvas_width {
                (x, y, shelf) = (0, y + shelf + gaps[0], 0);
            }
            corners[index] = (y, x);
            x += w + gaps[1];
            shelf = shelf.max(h);
        }
        let size = (y + shelf, canvas_width);
        let out_size = window.output_size(size);
        size.0
            .checked_mul(size.1)
            .ok_or_else(|| too_large("the canvas"))?;
        let mut input_rows = Vec::new();
        let mut output_rows = Vec::new();
        for (image, &(top, left)) in images.iter().zip(&corners) {
            let ((h, w), (out_h, out_w)) = (image.size, image.out);
            for row in 0..h {
                input_rows.extend((0..w).map(|column| (top + row) * size.1 + left + column));
            }
            for row in 0..out_h {
                output_rows
                    .extend((0..out_w).map(|column| (top + row) * out_size.1 + left + column));
            }
        }
        Ok(Self {
            size,
            input_rows: Tensor::f_from_slice(&input_rows)?.f_to_device(device)?,
            output_rows: Tensor::f_from_slice(&output_rows)?.f_to_device(device)?,
            output_sizes: images.iter().map(|image| image.out).collect(),
        })
    }
}

thread_local! {
    static TABLES: Cache<(WindowKey, Outside), Table> = const { RefCell::new(Vec::new()) };
    static CANVASES: Cache<WindowKey, Canvas> = const { RefCell::new(Vec::new()) };
}

/// A thread's last [`CACHED_TABLES`] values of one kind, by what they were built for.
type Cache<K, T> = RefCell<Vec<(K, Rc<T>)>>;

/// The value `cache` holds for `key`, else the one `build` makes (then kept).
fn cached<K: PartialEq, T>(
    cache: &'static std::thread::LocalKey<Cache<K, T>>,
    key: K,
    build: impl FnOnce(&K) -> Result<T>,
) -> Result<Rc<T>> {
    let known = cache.with_borrow(|values| {
        values
            .iter()
            .find(|(known, _)| *known == key)
            .map(|(_, value)| value.clone())
    });
    if let Some(value) = known {
        return Ok(value);
    }
    let value = Rc::new(build(&key)?);
    cache.with_borrow_mut(|values| {
        if values.len() == CACHED_TABLES {
            values.remove(0);
        }
        values.push((key, value.clone()));
    });
    Ok(value)
}

/// A per-element pooling kind.
#[derive(Clone, Copy)]
pub(crate) enum Pooling {
    Max,
    Average,
}

impl NestedTensor {
    /// Heights and widths of a batch of packed images: elements `[C, H_i, W_i]` whose
    /// ragged dims are exactly `H` and `W` (rows are pixels). `None` otherwise.
    pub(crate) fn packed_image_sizes(&self) -> Option<(Vec<i64>, Vec<i64>)> {
        let layout = self.lay();
        if layout.rank() != 3 || layout.ragged_dims() != [1, 2] || self.batch_size() == 0 {
            return None;
        }
        let sizes = layout.element_sizes();
        Some((
            sizes.iter().map(|size| size[1]).collect(),
            sizes.iter().map(|size| size[2]).collect(),
        ))
    }

    /// The batch and window a table or canvas of this batch is built for.
    fn window_key(&self, (heights, widths): &(Vec<i64>, Vec<i64>), window: Window2d) -> WindowKey {
        WindowKey {
            heights: heights.clone(),
            widths: widths.clone(),
            window,
            device: self.device(),
        }
    }

    /// The gather table of `window` over this batch of images (cached per thread).
    fn window_table(
        &self,
        sizes: &(Vec<i64>, Vec<i64>),
        window: Window2d,
        outside: Outside,
    ) -> Result<Rc<Table>> {
        let pixels = self.lay().total_rows();
        cached(
            &TABLES,
            (self.window_key(sizes, window), outside),
            |(key, _)| {
                let mut taps = window_taps(&window, &key.heights, &key.widths, outside)
                    .map_err(window_error)?;
                let inside = taps
                    .rows
                    .chunks(taps.taps.max(1))
                    .map(|window| window.iter().filter(|&&row| row >= 0).count() as f64)
                    .collect();
                for row in taps.rows.iter_mut().filter(|row| **row < 0) {
                    *row = pixels;
                }
                Ok(Table {
                    rows: Tensor::f_from_slice(&taps.rows)?.f_to_device(key.device)?,
                    output_sizes: taps.output_sizes,
                    taps: taps.taps as i64,
                    inside,
                })
            },
        )
    }

    /// The canvas a stride-1 window slides over for this batch of images (cached per
    /// thread), or `None` when the window has strides or an image is empty.
    fn window_canvas(
        &self,
        sizes: &(Vec<i64>, Vec<i64>),
        window: Window2d,
    ) -> Result<Option<Rc<Canvas>>> {
        if window.stride != [1, 1] || sizes.0.iter().chain(&sizes.1).any(|&side| side < 1) {
            return Ok(None);
        }
        cached(&CANVASES, self.window_key(sizes, window), |key| {
            Canvas::shelves(&key.heights, &key.widths, window, key.device)
        })
        .map(Some)
    }

    /// Images of these output sizes with `channels` channels, packed in `values`.
    fn images_like(
        &self,
        values: Tensor,
        output_sizes: impl IntoIterator<Item = (i64, i64)>,
        channels: i64,
    ) -> Result<NestedTensor> {
        let sizes = output_sizes
            .into_iter()
            .map(|(height, width)| vec![channels, height, width])
            .collect();
        let layout = RaggedLayout::from_element_sizes(sizes, &[1, 2])?;
        Ok(NestedTensor::from_parts(values, layout, self.options()))
    }

    /// The packed convolution (groups 1) of a batch of images, or `None` when the batch
    /// is not packed images. `weight` is `[C_out, C_in, K_h, K_w]`.
    pub(crate) fn conv2d_packed(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        window: Window2d,
        groups: i64,
    ) -> Result<Option<NestedTensor>> {
        let Some(sizes) = self.packed_image_sizes() else {
            return Ok(None);
        };
        let shape = weight.size();
        let [out_channels, in_channels, ..] = shape[..] else {
            return Err(NestedError::ShapeMismatch {
                what: "conv2d weight",
                expected: "[C_out, C_in / groups, K_h, K_w]".into(),
                got: shape,
            });
        };
        let channels = self.lay().static_sizes()[0];
        if groups != 1 || in_channels != channels {
            // Grouped convolutions and mismatched shapes: libtorch's own checks and
            // messages, element by element.
            return Ok(None);
        }
        if let Some(out) = self.conv2d_native(weight, bias, window, &sizes)? {
            return Ok(Some(out));
        }
        // Half precision computes in f32 (so do libtorch's CPU convolutions): the
        // gather's gradient sums up to `taps * C_out` terms per pixel.
        let kind = self.kind();
        let (values, weight, bias) = (
            accumulating(self.packed())?,
            accumulating(weight)?,
            bias.map(accumulating).transpose()?,
        );
        let bias = bias.as_ref();
        if window.kernel == [1, 1] && window.stride == [1, 1] && window.padding == [0, 0] {
            // Every tap is its own pixel: a linear layer over the rows.
            let flat = weight.f_reshape([out_channels, in_channels])?;
            let out = values.f_linear(&flat, bias)?.f_to_kind(kind)?;
            let images = window_images(&window, &sizes.0, &sizes.1).map_err(window_error)?;
            let output_sizes = images.iter().map(|image| image.out);
            return Ok(Some(self.images_like(out, output_sizes, out_channels)?));
        }
        if let Some(canvas) = self.window_canvas(&sizes, window)? {
            // One libtorch convolution (channels last) over the images on a canvas.
            let pixels = Tensor::f_zeros(
                [canvas.size.0 * canvas.size.1, channels],
                (values.kind(), values.device()),
            )?
            .f_index_copy(0, &canvas.input_rows, &values)?;
            let out = pixels
                .f_view([1, canvas.size.0, canvas.size.1, channels])?
                .f_permute([0, 3, 1, 2])?
                .f_conv2d(&weight, bias, [1, 1], window.padding, window.dilation, 1)?
                .f_permute([0, 2, 3, 1])?
                .f_reshape([-1, out_channels])?
                .f_index_select(0, &canvas.output_rows)?
                .f_to_kind(kind)?;
            let output_sizes = canvas.output_sizes.iter().copied();
            return Ok(Some(self.images_like(out, output_sizes, out_channels)?));
        }
        let table = self.window_table(&sizes, window, Outside::Marked)?;
        let rows = table.output_sizes.iter().map(|&(h, w)| h * w).sum::<i64>();
        let inner = table.taps * in_channels;
        let source = with_zero_row(&values)?;
        let columns = source
            .f_index_select(0, &table.rows)?
            .f_reshape([rows, inner])?;
        // [C_out, C_in, K_h, K_w] -> [C_out, K_h, K_w, C_in]: the gathered rows' order.
        let flat = weight
            .f_permute([0, 2, 3, 1])?
            .f_reshape([out_channels, inner])?
            .f_transpose(0, 1)?;
        let out = match bias {
            Some(bias) => bias.f_addmm(&columns, &flat)?,
            None => columns.f_mm(&flat)?,
        }
        .f_to_kind(kind)?;
        let output_sizes = table.output_sizes.iter().copied();
        Ok(Some(self.images_like(out, output_sizes, out_channels)?))
    }

    /// The convolution by nestor's own kernel (the one compiled programs run) when no
    /// gradient is recorded (inference, `no_grad`) and everything is f32 on the CPU;
    /// `None` otherwise.
    fn conv2d_native(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        window: Window2d,
        (heights, widths): &(Vec<i64>, Vec<i64>),
    ) -> Result<Option<NestedTensor>> {
        let operands = [Some(self.packed()), Some(weight), bias];
        let native = operands
            .iter()
            .flatten()
            .all(|tensor| tensor.kind() == Kind::Float && tensor.device() == Device::Cpu);
        let mut recorded = false;
        for tensor in operands.iter().flatten() {
            // A view made while gradients are off does not require one.
            recorded |= tensor.requires_grad() && tensor.f_alias()?.requires_grad();
        }
        if !native || recorded {
            return Ok(None);
        }
        let [width, channels, ..] = weight.size()[..] else {
            return Ok(None);
        };
        let images = window_images(&window, heights, widths).map_err(window_error)?;
        let rows: i64 = images.iter().map(|image| image.out.0 * image.out.1).sum();
        let (x, weight) = (self.packed().f_contiguous()?, weight.f_contiguous()?);
        let bias = bias.map(Tensor::f_contiguous).transpose()?;
        let out = Tensor::f_empty([rows, width], (Kind::Float, Device::Cpu))?;
        // Contiguous f32 CPU tensors (checked above), each read for exactly its
        // number of values; `out` is new and written only here.
        let slices = unsafe {
            (
                float_slice_mut(&out),
                float_slice(&x),
                float_slice(&weight),
                bias.as_ref().map(|bias| float_slice(bias)),
            )
        };
        convolve_images(
            slices.0,
            slices.1,
            (slices.2, slices.3),
            (channels as usize, width as usize),
            &window,
            (heights, widths),
        )
        .map_err(window_error)?;
        let output_sizes = images.iter().map(|image| image.out);
        Ok(Some(self.images_like(out, output_sizes, width)?))
    }

    /// Packed max or average pooling (padding not counted) of a batch of images, or
    /// `None` when the batch is not packed images.
    pub(crate) fn pool2d_packed(
        &self,
        kind: Pooling,
        window: Window2d,
    ) -> Result<Option<NestedTensor>> {
        let Some(sizes) = self.packed_image_sizes() else {
            return Ok(None);
        };
        if (0..2).any(|axis| window.padding[axis].saturating_mul(2) > window.kernel[axis]) {
            // libtorch's error, element by element.
            return Ok(None);
        }
        let channels = self.lay().static_sizes()[0];
        let values = self.packed();
        let outside = match kind {
            Pooling::Max => Outside::FirstInside,
            Pooling::Average => Outside::Marked,
        };
        let table = self.window_table(&sizes, window, outside)?;
        let rows = table.output_sizes.iter().map(|&(h, w)| h * w).sum::<i64>();
        let out = match kind {
            // Every window has a tap inside its image (padding is at most half the
            // window), so the table never reads past the pixels.
            Pooling::Max => {
                values
                    .f_index_select(0, &table.rows)?
                    .f_reshape([rows, table.taps, channels])?
                    .f_max_dim(1, false)?
                    .0
            }
            Pooling::Average => {
                let source = with_zero_row(&accumulating(values)?)?;
                let inside = Tensor::f_from_slice(&table.inside)?
                    .f_to_kind(source.kind())?
                    .f_to_device(self.device())?
                    .f_reshape([rows, 1])?;
                source
                    .f_index_select(0, &table.rows)?
                    .f_reshape([rows, table.taps, channels])?
                    .f_sum_dim_intlist(&[1i64][..], false, None::<Kind>)?
                    .f_div(&inside)?
                    .f_to_kind(values.kind())?
            }
        };
        Ok(Some(self.images_like(
            out,
            table.output_sizes.iter().copied(),
            channels,
        )?))
    }

    /// Global average pooling (`adaptive_avg_pool2d` to `[1, 1]`) of packed images:
    /// each image's mean pixel, elements `[C, 1, 1]`; `None` when the batch is not
    /// packed images.
    pub(crate) fn image_means(&self) -> Result<Option<NestedTensor>> {
        if self.packed_image_sizes().is_none() {
            return Ok(None);
        }
        self.reduce_keeping_layout(Reduce::Mean, &[1, 2]).map(Some)
    }
}

/// The pixels `[N, C]` and one zero row after them, which the taps outside their image
/// read.
fn with_zero_row(values: &Tensor) -> Result<Tensor> {
    Ok(values.f_constant_pad_nd([0, 0, 0, 1])?)
}

/// `tensor` in the type sums accumulate in: f32 for f16 and bf16, else its own.
fn accumulating(tensor: &Tensor) -> Result<Tensor> {
    Ok(match tensor.kind() {
        Kind::Half | Kind::BFloat16 => tensor.f_to_kind(Kind::Float)?,
        _ => tensor.shallow_clone(),
    })
}

/// A window's error as the operators'.
fn window_error(error: nestor_layout::WindowError) -> NestedError {
    NestedError::Unsupported {
        op: "window",
        reason: error.to_string(),
    }
}

/// The values of a contiguous f32 CPU tensor.
///
/// # Safety
/// The tensor must be contiguous f32 on the CPU, and not written while the slice lives.
unsafe fn float_slice(tensor: &Tensor) -> &[f32] {
    match tensor.numel() {
        0 => &[],
        count => unsafe { std::slice::from_raw_parts(tensor.data_ptr() as *const f32, count) },
    }
}

/// The values of a contiguous f32 CPU tensor, to write.
///
/// # Safety
/// As [`float_slice`], and nothing else may read or write the tensor while it lives.
#[allow(clippy::mut_from_ref)]
unsafe fn float_slice_mut(tensor: &Tensor) -> &mut [f32] {
    match tensor.numel() {
        0 => &mut [],
        count => unsafe { std::slice::from_raw_parts_mut(tensor.data_ptr() as *mut f32, count) },
    }
}
