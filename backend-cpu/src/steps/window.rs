//! A window step of a run: its taps from the run's image sizes, then the kind's
//! computation (`crate::window`) on the run's buffers.

use nestor_ir::Window2d;
use nestor_layout::{window_images, WindowImage, WindowTaps};
use nestor_passes::step::Window;
use nestor_passes::{FloatType, Signature, Slot, WindowKind};
use nestor_runtime::{step_error, within_budget, RunState, RuntimeError};

use super::CpuSteps;
use crate::columns::{self, columns_pay, input_grad_scratch, tile_scratch, Work};
use crate::conv_tiles::BandedWeightGrad;
use crate::finish::Finish;
use crate::parallel::worker_threads;
use crate::window::{
    convolve_slots, fill_taps_over_team, image_means, image_spread, pixel_counts, pool, pool_grad,
    strided_conv_input_grad, weight_grad, Shape, SlotBuffers, GRAD_BLOCK_ROWS,
};

impl CpuSteps {
    /// A window step: its taps from the run's image sizes, then the kind's computation
    /// (a convolution's output rows then through its epilogue kernel, of `epilogue`'s
    /// signature, and rounded where a later product reads them so).
    pub(super) fn run_window(
        &self,
        index: usize,
        step: &Window,
        epilogue: Option<&Signature>,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let (Some(heights), Some(widths)) =
            (run.sizes().get(step.heights), run.sizes().get(step.widths))
        else {
            return Ok(());
        };
        let window = WindowRun {
            index,
            step,
            run,
            sizes: (&heights.lengths, &widths.lengths),
            shape: Shape {
                taps: 0,
                ..shape_of(step)
            },
            out_scalars: run.sizes().elements(run.program(), step.out),
            groups: usize::try_from(step.groups).unwrap_or(0),
        };
        let (channels, width, groups) = (window.shape.channels, window.shape.width, window.groups);
        if groups == 0 || channels % groups != 0 || width % groups != 0 {
            return Err(window.error(format!(
                "{} groups do not divide {channels} channels into {width}",
                step.groups
            )));
        }
        if step.kind == WindowKind::WeightGrad {
            if let Some(way) = window.banded_weight_grad() {
                return window.weight_grad_in_bands(window.shape_with_taps(), way);
            }
        }
        match step.kind {
            WindowKind::ImageMean => window.image_means(),
            WindowKind::ImageSpread => window.image_spread(),
            WindowKind::Conv | WindowKind::ConvInputGrad => {
                let epilogue_args = epilogue
                    .map(|signature| run.kernel_args(index, signature))
                    .transpose()?;
                let rows = run.sizes().rows(run.program().info(step.out).rows);
                let producing = self.producing(index, step.out, run, rows);
                let finish = Finish {
                    epilogue: self.epilogue(index, epilogue_args.as_deref().map(Vec::as_slice))?,
                    producing: producing.as_ref().map(|(producing, _)| producing),
                    width,
                };
                window.convolution(&finish)?;
                if let Some((producing, _)) = producing {
                    crate::kept::produced(producing.finish());
                }
                Ok(())
            }
            WindowKind::WeightGrad
                if columns_pay(
                    window.shape_with_taps(),
                    Work::WeightGradient,
                    run.program().products,
                ) =>
            {
                window.weight_grad_by_columns(window.shape_with_taps())
            }
            WindowKind::Max
            | WindowKind::Average
            | WindowKind::WeightGrad
            | WindowKind::MaxGrad
            | WindowKind::AverageGrad
            | WindowKind::StridedConvInputGrad => window.over_taps(),
            // Kernels on every device (`Placed for Window`).
            WindowKind::Adaptive
            | WindowKind::AdaptiveGrad
            | WindowKind::Bilinear { .. }
            | WindowKind::BilinearGrad { .. } => {
                Err(window.error("a resampling runs as a kernel, not the CPU's own code".into()))
            }
        }
    }
}

/// The bytes of partial sums a banded weight gradient keeps for its images.
type PartialBytes = fn(Shape, &Window2d, &[WindowImage]) -> usize;

/// One window step of a run, with what every kind reads.
struct WindowRun<'a, 'r, 'i> {
    index: usize,
    step: &'a Window,
    run: &'a RunState<'r, 'i>,
    /// The images' heights and widths.
    sizes: (&'a [i64], &'a [i64]),
    /// Channels in and out (no taps yet).
    shape: Shape,
    /// The scalars of the output buffer.
    out_scalars: usize,
    /// A convolution's groups (dividing both channel counts).
    groups: usize,
}

impl WindowRun<'_, '_, '_> {
    fn error(&self, reason: String) -> RuntimeError {
        step_error(self.index, reason)
    }

    /// The step's shape with its window's taps.
    fn shape_with_taps(&self) -> Shape {
        shape_of(self.step)
    }

    /// The values slot `slot` holds in this run.
    fn slot_len(&self, slot: Slot) -> usize {
        self.run.sizes().elements(self.run.program(), slot)
    }

    /// The output's and `x`'s buffers.
    fn out_and_x(&self) -> (*mut u8, *const u8) {
        (
            self.run.pointer(self.step.out),
            self.run.pointer(self.step.x) as *const u8,
        )
    }

    /// The output, `x` and the output's gradient (an error naming `what` without it).
    fn with_grad(&self, what: &str) -> Result<(*mut u8, *const u8, *const u8), RuntimeError> {
        let grad = self
            .step
            .grad
            .ok_or_else(|| self.error(format!("a {what} without the output's")))?;
        let (out, x) = self.out_and_x();
        Ok((out, x, self.run.pointer(grad) as *const u8))
    }

    /// The mean of every image.
    fn image_means(&self) -> Result<(), RuntimeError> {
        let counts = pixel_counts(self.sizes.0, self.sizes.1);
        if counts.len().checked_mul(self.shape.width) != Some(self.out_scalars) {
            return Err(self.error(format!(
                "{} images do not fill {} output scalars",
                counts.len(),
                self.out_scalars
            )));
        }
        let buffers = self.out_and_x();
        // The buffers were sized from these lengths, in the program's type.
        unsafe {
            match self.run.program().float {
                FloatType::F32 => image_means::<f32>(buffers, &counts, self.shape.channels),
                FloatType::F64 => image_means::<f64>(buffers, &counts, self.shape.channels),
            }
        }
        Ok(())
    }

    /// Every image's values spread back over its pixels (the means' gradient).
    fn image_spread(&self) -> Result<(), RuntimeError> {
        let counts = pixel_counts(self.sizes.0, self.sizes.1);
        let pixels = counts
            .iter()
            .fold(0usize, |sum, &count| sum.saturating_add(count as usize));
        if pixels.checked_mul(self.shape.width) != Some(self.out_scalars)
            || self.slot_len(self.step.x) != counts.len().saturating_mul(self.shape.channels)
        {
            return Err(self.error("the images do not fill the spread's buffers".into()));
        }
        let buffers = self.out_and_x();
        // The buffers hold what was just checked, in the program's type.
        unsafe {
            match self.run.program().float {
                FloatType::F32 => image_spread::<f32>(buffers, &counts, self.shape.channels),
                FloatType::F64 => image_spread::<f64>(buffers, &counts, self.shape.channels),
            }
        }
        Ok(())
    }

    /// A convolution, or its input's gradient (the adjoint convolution).
    fn convolution(&self, finish: &Finish<'_>) -> Result<(), RuntimeError> {
        let (step, run, shape) = (self.step, self.run, self.shape);
        let Some(weight) = step.weight else {
            return Err(self.error("a convolution without a weight".into()));
        };
        let taps = usize::try_from(step.window.taps()).unwrap_or(usize::MAX);
        // The packed weight, the flipped one of an input's gradient and a grouped
        // weight's dense one.
        let weight_bytes = (shape.width.div_ceil(16) * 16 + 2 * shape.width)
            .checked_mul(run.program().float.size())
            .and_then(|bytes| bytes.checked_mul(taps)?.checked_mul(shape.channels));
        within_budget(self.index, "the packed convolution weight", weight_bytes)?;
        within_budget(
            self.index,
            "the convolution's gathered columns",
            self.scratch_bytes(tile_scratch(Shape { taps, ..shape })),
        )?;
        let adjoint = step.kind == WindowKind::ConvInputGrad;
        let buffers = SlotBuffers {
            out: (run.pointer(step.out), self.out_scalars),
            x: (run.pointer(step.x), self.slot_len(step.x)),
            weight: (run.pointer(weight), self.slot_len(weight)),
            bias: step
                .bias
                .map(|bias| (run.pointer(bias), self.slot_len(bias))),
        };
        let channels = (shape.channels, shape.width);
        let kind = (adjoint, self.groups, run.program().products);
        // Every slot holds the values the program sized it for, in its type; the output
        // is written only here and no input aliases it.
        let result = unsafe {
            match run.program().float {
                FloatType::F32 => {
                    convolve_slots::<f32>(buffers, kind, channels, &step.window, self.sizes, finish)
                }
                FloatType::F64 => {
                    convolve_slots::<f64>(buffers, kind, channels, &step.window, self.sizes, finish)
                }
            }
        };
        result.map_err(|error| self.error(error.to_string()))
    }

    /// The kinds over the windows' taps: pooling, the weight's gradient, pooling's.
    fn over_taps(&self) -> Result<(), RuntimeError> {
        let (step, run) = (self.step, self.run);
        // The windows' output pixels: the output's, or its gradient's for the gradients
        // (`x` for the strided convolution's input gradient).
        let from_grad = matches!(
            step.kind,
            WindowKind::WeightGrad
                | WindowKind::MaxGrad
                | WindowKind::AverageGrad
                | WindowKind::StridedConvInputGrad
        );
        let pixels_slot = match step.kind {
            WindowKind::StridedConvInputGrad => step.x,
            _ => step.grad.filter(|_| from_grad).unwrap_or(step.out),
        };
        let out_rows = run.sizes().rows(run.program().info(pixels_slot).rows);
        let table_bytes = usize::try_from(out_rows)
            .ok()
            .and_then(|rows| rows.checked_mul(usize::try_from(step.window.taps()).ok()?))
            .and_then(|count| count.checked_mul(std::mem::size_of::<i64>()));
        within_budget(self.index, "window taps", table_bytes)?;
        let taps = run
            .sizes()
            .window_taps_filled_by(step.window, (step.heights, step.widths), &|table, part| {
                fill_taps_over_team(table, step.window.taps().max(1) as usize, part)
            })
            .map_err(|error| self.error(error.to_string()))?;
        let rows = taps.rows.len() / taps.taps.max(1);
        if !from_grad && rows.checked_mul(self.shape.width) != Some(self.out_scalars) {
            return Err(self.error(format!(
                "{rows} output pixels do not fill {} output scalars",
                self.out_scalars
            )));
        }
        let shape = Shape {
            taps: taps.taps,
            ..self.shape
        };
        match step.kind {
            WindowKind::Max | WindowKind::Average => {
                let max = step.kind == WindowKind::Max;
                let buffers = self.out_and_x();
                // Buffers sized from these lengths, in the program's type.
                unsafe {
                    match run.program().float {
                        FloatType::F32 => pool::<f32>(buffers, &taps, shape, max),
                        FloatType::F64 => pool::<f64>(buffers, &taps, shape, max),
                    }
                }
                Ok(())
            }
            WindowKind::WeightGrad => self.weight_grad(&taps, shape, rows),
            WindowKind::StridedConvInputGrad => self.strided_conv_input_grad(&taps, shape, rows),
            _ => self.pool_grad(&taps, shape, rows),
        }
    }

    /// The bytes of `values` per thread of the team (`None` past `usize`).
    fn scratch_bytes(&self, values: Option<usize>) -> Option<usize> {
        values?
            .checked_mul(worker_threads().max(1) as usize)?
            .checked_mul(self.run.program().float.size())
    }

    /// The convolution weight's gradient over `rows` output pixels.
    fn weight_grad(
        &self,
        taps: &WindowTaps,
        shape: Shape,
        rows: usize,
    ) -> Result<(), RuntimeError> {
        let buffers = self.weight_grad_buffers(shape, rows)?;
        // The buffers hold what was checked (and `x` every pixel the taps name), in the
        // program's type.
        unsafe {
            match self.run.program().float {
                FloatType::F32 => weight_grad::<f32>(buffers, taps, shape, self.groups),
                FloatType::F64 => weight_grad::<f64>(buffers, taps, shape, self.groups),
            }
        }
        Ok(())
    }

    /// The convolution weight's gradient as GEMMs over gathered columns
    /// (`crate::columns`), their taps found a tile at a time.
    fn weight_grad_by_columns(&self, shape: Shape) -> Result<(), RuntimeError> {
        let window = self.step.window;
        let (images, (out, x, g)) = self.weight_grad_images(shape)?;
        within_budget(
            self.index,
            "the weight gradient's gathered columns",
            self.scratch_bytes(tile_scratch(shape)),
        )?;
        let work = (self.groups, self.run.program().products);
        // The buffers hold what was just checked, in the program's type.
        unsafe {
            match self.run.program().float {
                FloatType::F32 => columns::weight_grad::<f32>(
                    (out as *mut f32, x as *const f32, g as *const f32),
                    (&images, window),
                    shape,
                    work,
                ),
                FloatType::F64 => columns::weight_grad::<f64>(
                    (out as *mut f64, x as *const f64, g as *const f64),
                    (&images, window),
                    shape,
                    work,
                ),
            }
        }
        Ok(())
    }

    /// The way that sums fixed bands of output rows which this weight gradient runs in,
    /// where one pays (an f32 program's): few channels (`conv_tiles::narrow`) or 16 and
    /// 32 on the tiles (`conv_tiles::grad`).
    fn banded_weight_grad(&self) -> Option<(PartialBytes, BandedWeightGrad)> {
        use crate::conv_tiles::{grad, narrow};
        if self.run.program().float != FloatType::F32 {
            return None;
        }
        let shape = self.shape_with_taps();
        let how = (self.groups, self.run.program().products);
        if narrow::pays(shape, &self.step.window, how) {
            Some((narrow::partial_bytes, narrow::weight_grad))
        } else if grad::pays(shape, &self.step.window, how) {
            Some((grad::partial_bytes, grad::weight_grad))
        } else {
            None
        }
    }

    /// The convolution weight's gradient (an f32 program's, bf16 products) by one of the
    /// ways that sum fixed bands of output rows into partial sums, reading the input rows
    /// rounded once a band (`crate::conv_tiles::narrow`, `crate::conv_tiles::grad`):
    /// their bytes checked against the budget first.
    fn weight_grad_in_bands(
        &self,
        shape: Shape,
        (partial_bytes, weight_grad): (PartialBytes, BandedWeightGrad),
    ) -> Result<(), RuntimeError> {
        let window = self.step.window;
        let (images, (out, x, g)) = self.weight_grad_images(shape)?;
        within_budget(
            self.index,
            "the weight gradient's partial sums",
            Some(partial_bytes(shape, &window, &images)),
        )?;
        // The buffers hold what was just checked, f32 values (the caller's program).
        unsafe {
            weight_grad(
                (out as *mut f32, x as *const f32, g as *const f32),
                (&images, window),
                shape,
            )
        };
        Ok(())
    }

    /// The images of a weight gradient computed over them (not from a taps table), and
    /// its output, input and gradient, their sizes checked against the images.
    #[allow(clippy::type_complexity)]
    fn weight_grad_images(
        &self,
        shape: Shape,
    ) -> Result<(Vec<WindowImage>, (*mut u8, *const u8, *const u8)), RuntimeError> {
        let images = window_images(&self.step.window, self.sizes.0, self.sizes.1)
            .map_err(|error| self.error(error.to_string()))?;
        let (inputs, rows) = nestor_layout::pixels(&images);
        let buffers = self.weight_grad_buffers(shape, rows)?;
        if self.slot_len(self.step.x) != inputs.saturating_mul(shape.channels) {
            return Err(self.error("the weight gradient's input does not match its images".into()));
        }
        Ok((images, buffers))
    }

    /// The output, input and gradient of a weight gradient over `rows` output pixels,
    /// their sizes checked, and its partial sums within the run's budget.
    fn weight_grad_buffers(
        &self,
        shape: Shape,
        rows: usize,
    ) -> Result<(*mut u8, *const u8, *const u8), RuntimeError> {
        let buffers = self.with_grad("weight gradient")?;
        let inner = shape.taps.saturating_mul(shape.channels);
        // Partial sums per block of pixels, and the gradient padded to 16 lanes.
        let lanes = shape.width.div_ceil(16) * 16;
        let bytes = rows
            .div_ceil(GRAD_BLOCK_ROWS)
            .checked_mul(inner)
            .and_then(|count| count.checked_mul(lanes))
            .and_then(|count| count.checked_add(rows.checked_mul(lanes)?))
            .and_then(|count| count.checked_mul(self.run.program().float.size()));
        within_budget(self.index, "the weight gradient's partial sums", bytes)?;
        let grad_len = self.step.grad.map_or(0, |grad| self.slot_len(grad));
        if self.out_scalars != shape.width.saturating_mul(inner) / self.groups
            || grad_len != rows.saturating_mul(shape.width)
        {
            return Err(self.error("the weight gradient's buffers do not match its window".into()));
        }
        Ok(buffers)
    }

    /// A strided convolution's input gradient from `rows` output pixels' gradients.
    fn strided_conv_input_grad(
        &self,
        taps: &WindowTaps,
        shape: Shape,
        rows: usize,
    ) -> Result<(), RuntimeError> {
        let Some(weight) = self.step.weight else {
            return Err(self.error("an input gradient without the weight".into()));
        };
        let images = window_images(&self.step.window, self.sizes.0, self.sizes.1)
            .map_err(|error| self.error(error.to_string()))?;
        let pixels = nestor_layout::pixels(&images).0;
        let weight_len = shape.channels.saturating_mul(shape.width) / self.groups;
        if self.out_scalars != pixels.saturating_mul(shape.width)
            || self.slot_len(self.step.x) != rows.saturating_mul(shape.channels)
            || self.slot_len(weight) != weight_len.saturating_mul(shape.taps)
        {
            return Err(self.error("the input gradient's buffers do not match its window".into()));
        }
        let scratch = input_grad_scratch(&images, shape)
            .and_then(|values| values.checked_mul(self.run.program().float.size()));
        within_budget(self.index, "the input gradient's columns", scratch)?;
        let (out, grads) = self.out_and_x();
        let buffers = (out, grads, self.run.pointer(weight) as *const u8);
        let kind = (self.groups, self.run.program().products);
        // The buffers hold what was just checked, in the program's type.
        unsafe {
            match self.run.program().float {
                FloatType::F32 => {
                    strided_conv_input_grad::<f32>(buffers, taps, &images, shape, kind)
                }
                FloatType::F64 => {
                    strided_conv_input_grad::<f64>(buffers, taps, &images, shape, kind)
                }
            }
        }
        Ok(())
    }

    /// Max or average pooling's gradient over `rows` output pixels.
    fn pool_grad(&self, taps: &WindowTaps, shape: Shape, rows: usize) -> Result<(), RuntimeError> {
        let buffers = self.with_grad("pooling gradient")?;
        let images = window_images(&self.step.window, self.sizes.0, self.sizes.1)
            .map_err(|error| self.error(error.to_string()))?;
        let grad_len = self.step.grad.map_or(0, |grad| self.slot_len(grad));
        if self.slot_len(self.step.x) != self.out_scalars
            || grad_len != rows.saturating_mul(shape.channels)
        {
            return Err(self.error("the pooling gradient's buffers do not match its window".into()));
        }
        let max = self.step.kind == WindowKind::MaxGrad;
        // The buffers hold what was just checked, in the program's type.
        unsafe {
            match self.run.program().float {
                FloatType::F32 => pool_grad::<f32>(buffers, taps, &images, shape, max),
                FloatType::F64 => pool_grad::<f64>(buffers, taps, &images, shape, max),
            }
        }
        Ok(())
    }
}

/// The input and output channels and the taps per window of a window step.
pub(super) fn shape_of(step: &Window) -> Shape {
    let size = |value: i64| usize::try_from(value).unwrap_or(0);
    Shape {
        channels: size(step.channels),
        width: size(step.width),
        taps: size(step.window.taps()),
    }
}
