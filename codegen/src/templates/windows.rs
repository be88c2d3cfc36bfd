//! Window steps over packed images: direct convolution and its input's gradient (the
//! adjoint convolution, or for strides an input pixel a task over the windows that read
//! it), max and average pooling over window taps, image means and their spread, the
//! weight's gradient, and pooling's gradient (an input pixel a task over the windows
//! that read it).

use super::*;

/// The channels of a convolution's step in groups: each output channel reads the input
/// channels of its group only, through a weight `[C_out, C_in / groups, taps]`.
#[derive(Clone, Copy)]
pub(super) struct Groups {
    /// Channels a pixel of `x` holds.
    channels: i64,
    /// Channels a pixel of the output holds.
    width: i64,
    /// Groups (1: every output channel reads every input channel).
    count: i64,
}

impl Groups {
    /// `count` groups of a step reading `channels` and writing `width` channels a pixel;
    /// an error unless they divide both.
    pub(super) fn new(count: i64, (channels, width): (i64, i64)) -> Gen<Self> {
        if count < 1 || channels % count != 0 || width % count != 0 {
            return Err(crate::CodegenError::new(format!(
                "{count} groups do not divide {channels} channels into {width}"
            )));
        }
        Ok(Self {
            channels,
            width,
            count,
        })
    }

    /// Input channels of a group.
    fn reads(self) -> i64 {
        self.channels / self.count
    }

    /// Output channels of a group.
    fn writes(self) -> i64 {
        self.width / self.count
    }

    /// The group of output channel `o` (0 without groups).
    fn of<'ctx>(self, kernel: &Kernel<'ctx, '_>, o: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        match self.count {
            1 => Ok(kernel.i64(0)),
            _ => kernel.div(o, kernel.i64(self.writes())),
        }
    }
}

/// A direct convolution, an output pixel a task: `out[r, o] = bias[o] + sum over the
/// taps t inside the image and the channels c of o's group of x[taps[r, t], c]
/// weight[o, c, t]` (the weight `[width, channels / groups, taps]`); the `adjoint` (a
/// convolution's input gradient, `x` its output's) reads the forward weight
/// `[channels, width / groups, taps]` flipped and transposed: `weight[c, o, taps - 1 - t]`.
/// Each value goes through the step's epilogue, if it has one, before it is stored.
pub(super) fn convolution<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (groups, taps, adjoint): (Groups, i64, bool),
    epilogue: Epilogue<'_>,
) -> Gen<()> {
    let (channels, width) = (groups.channels, groups.width);
    let (reads, writes) = (groups.reads(), groups.writes());
    let (start, end) = kernel.range()?;
    let [out, x, weight] = kernel.params([Role::Out, Role::X, Role::Weight])?;
    let bias = kernel.optional(Role::Bias)?;
    let table = kernel.param(Role::Taps)?;
    let epilogue_args = epilogue.args(kernel)?;
    let sum = kernel.accumulator("sum")?;
    // An output pixel is a warp's on a GPU (each lane its output channels), one
    // thread's on the host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let first_tap = kernel.mul(row, kernel.i64(taps))?;
        let out_row = kernel.mul(row, kernel.i64(width))?;
        kernel.lane_range(lanes, width, |o| {
            let initial = match bias {
                Some(bias) => kernel.load_float(bias, o)?,
                None => kernel.constant(0.0),
            };
            kernel.set(sum, initial)?;
            // The input channels of o's group: `reads` from `base`.
            let group = groups.of(kernel, o)?;
            let base = kernel.mul(group, kernel.i64(reads))?;
            taps_inside(kernel, (table, first_tap, taps), |t, source| {
                let pixel = kernel.add(kernel.mul(source, kernel.i64(channels))?, base)?;
                // Where `weight` holds the group's first channel at the tap, and how far
                // apart its channels are.
                let (first, stride) = if adjoint {
                    // `weight[base + k, o - group writes, taps - 1 - t]` of
                    // `[channels, writes, taps]`.
                    let flipped = kernel.sub(kernel.i64(taps - 1), t)?;
                    let within = kernel.sub(o, kernel.mul(group, kernel.i64(writes))?)?;
                    let row = kernel.add(kernel.mul(base, kernel.i64(writes))?, within)?;
                    let at = kernel.add(kernel.mul(row, kernel.i64(taps))?, flipped)?;
                    (at, writes.saturating_mul(taps))
                } else {
                    // `weight[o, k, t]` of `[width, reads, taps]`.
                    let row = kernel.mul(o, kernel.i64(reads.saturating_mul(taps)))?;
                    (kernel.add(row, t)?, taps)
                };
                kernel.for_range(kernel.i64(0), kernel.i64(reads), |k| {
                    let value = kernel.load_float(x, kernel.add(pixel, k)?)?;
                    let w = kernel.load_float(
                        weight,
                        kernel.add(first, kernel.mul(k, kernel.i64(stride))?)?,
                    )?;
                    kernel.set(sum, kernel.fadd(kernel.get(sum)?, kernel.fmul(value, w)?)?)
                })
            })?;
            let value = epilogue.finish(kernel, &epilogue_args, kernel.get(sum)?, (row, o))?;
            kernel.store_float(out, kernel.add(out_row, o)?, value)
        })
    })
}

/// `body(t, source)` for the taps `t` of a window that fall inside its image: `taps`
/// input pixels (`source`) from `first_tap` in `table`, -1 marking a tap outside.
pub(super) fn taps_inside<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (table, first_tap, taps): (PointerValue<'ctx>, IntValue<'ctx>, i64),
    body: impl Fn(IntValue<'ctx>, IntValue<'ctx>) -> Gen<()>,
) -> Gen<()> {
    kernel.for_range(kernel.i64(0), kernel.i64(taps), |t| {
        let source = kernel.load_i64(table, kernel.add(first_tap, t)?)?;
        if_inside(kernel, source, || body(t, source))
    })
}

/// `body()` when `source` is an input pixel (not -1: a tap outside the image).
pub(super) fn if_inside<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    source: IntValue<'ctx>,
    body: impl FnOnce() -> Gen<()>,
) -> Gen<()> {
    kernel.if_else(kernel.less(kernel.i64(-1), source)?, body, || Ok(()))
}

/// Max or average pooling, an output pixel a task: over the window's taps inside the
/// image, in order, the largest value (a NaN replaces it, as in torch; -inf for a
/// window without one) or the mean (NaN for none).
pub(super) fn pool<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    channels: i64,
    taps: i64,
    max: bool,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, table] = kernel.params([Role::Out, Role::X, Role::Taps])?;
    let [value, inside] = kernel.accumulators(["value", "inside"])?;
    let initial = kernel.constant(if max { f64::NEG_INFINITY } else { 0.0 });
    // An output pixel is a warp's on a GPU (each lane its channels), one thread's on the
    // host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let first_tap = kernel.mul(row, kernel.i64(taps))?;
        let out_row = kernel.mul(row, kernel.i64(channels))?;
        kernel.lane_range(lanes, channels, |c| {
            kernel.set(value, initial)?;
            kernel.set(inside, kernel.constant(0.0))?;
            taps_inside(kernel, (table, first_tap, taps), |_, source| {
                let at = kernel.add(kernel.mul(source, kernel.i64(channels))?, c)?;
                let p = kernel.load_float(x, at)?;
                let current = kernel.get(value)?;
                let next = if max {
                    let larger = kernel.select_if(FloatPredicate::OGT, (p, current), p, current)?;
                    kernel.select_if(FloatPredicate::UNO, (p, p), p, larger)?
                } else {
                    kernel.fadd(current, p)?
                };
                kernel.set(value, next)?;
                kernel.set(
                    inside,
                    kernel.fadd(kernel.get(inside)?, kernel.constant(1.0))?,
                )
            })?;
            let result = if max {
                kernel.get(value)?
            } else {
                kernel.fdiv(kernel.get(value)?, kernel.get(inside)?)?
            };
            kernel.store_float(out, kernel.add(out_row, c)?, result)
        })
    })
}

/// Every image's mean pixel, an image a task: its pixels summed in order, divided by
/// their count (NaN for an empty image, as torch's mean).
pub(super) fn image_mean<'ctx>(kernel: &Kernel<'ctx, '_>, channels: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, offsets] = kernel.params([Role::Out, Role::X, Role::PairOffsets])?;
    let sum = kernel.accumulator("sum")?;
    // An image is a warp's on a GPU (each lane its channels), one thread's on the host.
    kernel.parallel_rows(start, end, |image, lanes| {
        let first = kernel.load_i64(offsets, image)?;
        let pixels = kernel.sub(
            kernel.load_i64(offsets, kernel.add(image, kernel.i64(1))?)?,
            first,
        )?;
        let out_row = kernel.mul(image, kernel.i64(channels))?;
        kernel.lane_range(lanes, channels, |c| {
            kernel.set(sum, kernel.constant(0.0))?;
            kernel.for_range(kernel.i64(0), pixels, |p| {
                let at = kernel.add(kernel.mul(kernel.add(first, p)?, kernel.i64(channels))?, c)?;
                kernel.set(
                    sum,
                    kernel.fadd(kernel.get(sum)?, kernel.load_float(x, at)?)?,
                )
            })?;
            let mean = kernel.fdiv(kernel.get(sum)?, kernel.to_float(pixels)?)?;
            kernel.store_float(out, kernel.add(out_row, c)?, mean)
        })
    })
}

/// A convolution's weight gradient, a weight a task: `out[o, k, t] = sum over the
/// output pixels r (in order; on a GPU each lane in order over its pixels) of g[r, o]
/// x[taps[r, t], c]` (`c` the `k`-th input channel of o's group), taps outside the image
/// skipped.
pub(super) fn weight_grad<'ctx>(kernel: &Kernel<'ctx, '_>, groups: Groups, taps: i64) -> Gen<()> {
    let (channels, width, reads) = (groups.channels, groups.width, groups.reads());
    let (start, end) = kernel.range()?;
    let [out, x, g, table, count] =
        kernel.params([Role::Out, Role::X, Role::Gradient, Role::Taps, Role::Count])?;
    let rows = kernel.load_i64(count, kernel.i64(0))?;
    let sum = kernel.accumulator("sum")?;
    let per_output = reads.saturating_mul(taps);
    // A weight is a warp's on a GPU (each lane every 32nd pixel, the lanes' sums added
    // with shuffles), one thread's on the host (every pixel in order).
    kernel.parallel_rows(start, end, |task, lanes| {
        let o = kernel.div(task, kernel.i64(per_output))?;
        let inner = kernel.rem(task, kernel.i64(per_output))?;
        let base = kernel.mul(groups.of(kernel, o)?, kernel.i64(reads))?;
        let c = kernel.add(base, kernel.div(inner, kernel.i64(taps))?)?;
        let t = kernel.rem(inner, kernel.i64(taps))?;
        kernel.set(sum, kernel.constant(0.0))?;
        kernel.lane_range_until(lanes, rows, |r| {
            let source =
                kernel.load_i64(table, kernel.add(kernel.mul(r, kernel.i64(taps))?, t)?)?;
            if_inside(kernel, source, || {
                let value = kernel
                    .load_float(x, kernel.add(kernel.mul(source, kernel.i64(channels))?, c)?)?;
                let gradient =
                    kernel.load_float(g, kernel.add(kernel.mul(r, kernel.i64(width))?, o)?)?;
                kernel.set(
                    sum,
                    kernel.fadd(kernel.get(sum)?, kernel.fmul(gradient, value)?)?,
                )
            })
        })?;
        let total = kernel.across_lanes(lanes, kernel.get(sum)?, |a, b| kernel.fadd(a, b))?;
        first_lane_stores(kernel, lanes, out, task, total)
    })
}

/// A convolution's input gradient for any stride and padding, an input pixel a task:
/// `out[p, c] = sum over the windows r that read p (in order, from `inverse`), at the
/// tap t where r reads p, and over the output channels o of c's group of x[r, o]
/// weight[o, c, t]` (`x` the output's gradient, `weight` the forward
/// `[channels, width / groups, taps]`).
pub(super) fn strided_conv_input_grad<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    groups: Groups,
    taps: i64,
) -> Gen<()> {
    let (channels, width) = (groups.channels, groups.width);
    // Here the output (the input's gradient) has the forward input's channels: a
    // group's are `writes`, and its forward output channels `reads`.
    let (outputs, inputs) = (groups.reads(), groups.writes());
    let (start, end) = kernel.range()?;
    let [out, x, weight, table, inverse] = kernel.params([
        Role::Out,
        Role::X,
        Role::Weight,
        Role::Taps,
        Role::WindowsOfPixels,
    ])?;
    let sum = kernel.accumulator("sum")?;
    let tap = kernel.index_variable("tap")?;
    // An input pixel is a warp's on a GPU (each lane its channels), one thread's on the
    // host.
    kernel.parallel_rows(start, end, |pixel, lanes| {
        let from = kernel.load_i64(inverse, pixel)?;
        let to = kernel.load_i64(inverse, kernel.add(pixel, kernel.i64(1))?)?;
        let out_row = kernel.mul(pixel, kernel.i64(width))?;
        kernel.lane_range(lanes, width, |c| {
            let group = groups.of(kernel, c)?;
            // c's group's first forward output channel, and c within the group.
            let base = kernel.mul(group, kernel.i64(outputs))?;
            let within = kernel.sub(c, kernel.mul(group, kernel.i64(inputs))?)?;
            kernel.set(sum, kernel.constant(0.0))?;
            kernel.for_range(from, to, |entry| {
                let r = kernel.load_i64(inverse, entry)?;
                let first_tap = kernel.mul(r, kernel.i64(taps))?;
                // The window's one tap on this pixel.
                kernel.set_index(tap, kernel.i64(-1))?;
                kernel.for_range(kernel.i64(0), kernel.i64(taps), |t| {
                    let source = kernel.load_i64(table, kernel.add(first_tap, t)?)?;
                    let here = kernel.equal(source, pixel)?;
                    let current = kernel.get_index(tap)?;
                    kernel.set_index(tap, kernel.select_index(here, t, current)?)
                })?;
                let t = kernel.get_index(tap)?;
                let grads = kernel.add(kernel.mul(r, kernel.i64(channels))?, base)?;
                if_inside(kernel, t, || {
                    // `weight[base + k, within, t]` of `[channels, inputs, taps]`.
                    let row = kernel.add(kernel.mul(base, kernel.i64(inputs))?, within)?;
                    let first = kernel.add(kernel.mul(row, kernel.i64(taps))?, t)?;
                    let step = inputs.saturating_mul(taps);
                    kernel.for_range(kernel.i64(0), kernel.i64(outputs), |k| {
                        let gradient = kernel.load_float(x, kernel.add(grads, k)?)?;
                        let w = kernel.load_float(
                            weight,
                            kernel.add(first, kernel.mul(k, kernel.i64(step))?)?,
                        )?;
                        kernel.set(
                            sum,
                            kernel.fadd(kernel.get(sum)?, kernel.fmul(gradient, w)?)?,
                        )
                    })
                })
            })?;
            kernel.store_float(out, kernel.add(out_row, c)?, kernel.get(sum)?)
        })
    })
}

/// Pooling's gradient, an input pixel a task: the gradients of the windows that read it
/// (`inverse`: per pixel, where its windows' list starts and ends in the same buffer,
/// then the lists, windows in order), added in order: each divided by its window's taps
/// inside the image for average pooling; for max pooling those whose window picked it
/// (the first largest, or the last NaN, as libtorch's kernel).
pub(super) fn pool_grad<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    channels: i64,
    taps: i64,
    max: bool,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, g, table, inverse] = kernel.params([
        Role::Out,
        Role::X,
        Role::Gradient,
        Role::Taps,
        Role::WindowsOfPixels,
    ])?;
    let [sum, best, inside] = kernel.accumulators(["sum", "best", "inside"])?;
    let picked = kernel.index_variable("picked")?;
    // An input pixel is a warp's on a GPU (each lane its channels), one thread's on the
    // host.
    kernel.parallel_rows(start, end, |pixel, lanes| {
        let from = kernel.load_i64(inverse, pixel)?;
        let to = kernel.load_i64(inverse, kernel.add(pixel, kernel.i64(1))?)?;
        let out_row = kernel.mul(pixel, kernel.i64(channels))?;
        kernel.lane_range(lanes, channels, |c| {
            kernel.set(sum, kernel.constant(0.0))?;
            kernel.for_range(from, to, |entry| {
                let r = kernel.load_i64(inverse, entry)?;
                let first_tap = kernel.mul(r, kernel.i64(taps))?;
                let gradient =
                    kernel.load_float(g, kernel.add(kernel.mul(r, kernel.i64(channels))?, c)?)?;
                // Max pooling: the tap the window picked; average: its taps inside.
                if max {
                    kernel.set(best, kernel.constant(f64::NEG_INFINITY))?;
                    kernel.set_index(picked, kernel.i64(-1))?;
                } else {
                    kernel.set(inside, kernel.constant(0.0))?;
                }
                taps_inside(kernel, (table, first_tap, taps), |_, source| {
                    if !max {
                        let one = kernel.constant(1.0);
                        return kernel.set(inside, kernel.fadd(kernel.get(inside)?, one)?);
                    }
                    let at = kernel.add(kernel.mul(source, kernel.i64(channels))?, c)?;
                    let value = kernel.load_float(x, at)?;
                    let current = kernel.get(best)?;
                    // A larger value or a NaN replaces the best so far; the first
                    // tap inside is picked whatever its value.
                    let larger = kernel.or(
                        kernel.float_compare(FloatPredicate::OGT, value, current)?,
                        kernel.float_compare(FloatPredicate::UNO, value, value)?,
                    )?;
                    let index = kernel.get_index(picked)?;
                    let replaces = kernel.or(larger, kernel.equal(index, kernel.i64(-1))?)?;
                    kernel.set(best, kernel.select(larger, value, current)?)?;
                    kernel.set_index(picked, kernel.select_index(replaces, source, index)?)
                })?;
                let add = |share| kernel.set(sum, kernel.fadd(kernel.get(sum)?, share)?);
                if max {
                    let hit = kernel.equal(kernel.get_index(picked)?, pixel)?;
                    kernel.if_else(hit, || add(gradient), || Ok(()))
                } else {
                    add(kernel.fdiv(gradient, kernel.get(inside)?)?)
                }
            })?;
            kernel.store_float(out, kernel.add(out_row, c)?, kernel.get(sum)?)
        })
    })
}

/// The gradient of every image's mean pixel spread over its pixels, an image a task:
/// `out[p, c] = x[image, c] / pixels` (`offsets`: the images' first pixels).
pub(super) fn image_spread<'ctx>(kernel: &Kernel<'ctx, '_>, channels: i64) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, offsets] = kernel.params([Role::Out, Role::X, Role::PairOffsets])?;
    // An image is a warp's on a GPU (each lane its channels), one thread's on the host.
    kernel.parallel_rows(start, end, |image, lanes| {
        let first = kernel.load_i64(offsets, image)?;
        let last = kernel.load_i64(offsets, kernel.add(image, kernel.i64(1))?)?;
        let divisor = kernel.to_float(kernel.sub(last, first)?)?;
        let mean_row = kernel.mul(image, kernel.i64(channels))?;
        kernel.for_range(first, last, |p| {
            let out_row = kernel.mul(p, kernel.i64(channels))?;
            kernel.lane_range(lanes, channels, |c| {
                let mean = kernel.load_float(x, kernel.add(mean_row, c)?)?;
                kernel.store_float(out, kernel.add(out_row, c)?, kernel.fdiv(mean, divisor)?)
            })
        })
    })
}

/// The rows (or columns) `floor(i n / cells)` to `ceil((i + 1) n / cells)` that cell `i`
/// of adaptive pooling to `cells` averages, of a side of `n` pixels (torch's windows).
fn adaptive_span<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    i: IntValue<'ctx>,
    cells: i64,
    n: IntValue<'ctx>,
) -> Gen<(IntValue<'ctx>, IntValue<'ctx>)> {
    let first = kernel.div(kernel.mul(i, n)?, kernel.i64(cells))?;
    let next = kernel.mul(kernel.add(i, kernel.i64(1))?, n)?;
    let last = kernel.div(kernel.add(next, kernel.i64(cells - 1))?, kernel.i64(cells))?;
    Ok((first, last))
}

/// Each image's height, width and first pixel (`offsets` of the heights and widths,
/// `pixels` where each image's pixels start).
fn image_geometry<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    [heights, widths, pixels]: [PointerValue<'ctx>; 3],
    image: IntValue<'ctx>,
) -> Gen<[IntValue<'ctx>; 3]> {
    let next = kernel.add(image, kernel.i64(1))?;
    let size = |offsets| {
        kernel.sub(
            kernel.load_i64(offsets, next)?,
            kernel.load_i64(offsets, image)?,
        )
    };
    Ok([
        size(heights)?,
        size(widths)?,
        kernel.load_i64(pixels, image)?,
    ])
}

/// A resampling's cell: its row and column, and its image's height, width and first
/// pixel.
struct Cell<'ctx> {
    at: [IntValue<'ctx>; 2],
    size: [IntValue<'ctx>; 2],
    first: IntValue<'ctx>,
}

/// What a resampling writes for each channel of a cell: `value(c)`, built once a cell
/// (what does not depend on the channel computed there).
type ChannelValue<'a, 'ctx> = Box<dyn Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>> + 'a>;

/// A resampling to `[oh, ow]` (adaptive pooling, bilinear interpolation), a cell of an
/// image a task: for each channel `c`, `cell_value(cell, x)(c)` written at
/// `out[image, c, i, j]` (`[B, channels, oh, ow]`).
fn resampling<'a, 'ctx: 'a>(
    kernel: &'a Kernel<'ctx, '_>,
    [oh, ow]: [i64; 2],
    channels: i64,
    cell_value: &dyn Fn(Cell<'ctx>, PointerValue<'ctx>) -> Gen<ChannelValue<'a, 'ctx>>,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, heights, widths, pixels] = kernel.params([
        Role::Out,
        Role::X,
        Role::Offsets,
        Role::ColumnOffsets,
        Role::PairOffsets,
    ])?;
    let cells = oh.saturating_mul(ow);
    // A cell is a warp's on a GPU (each lane its channels), one thread's on the host.
    kernel.parallel_rows(start, end, |task, lanes| {
        let image = kernel.div(task, kernel.i64(cells))?;
        let cell = kernel.rem(task, kernel.i64(cells))?;
        let at = [
            kernel.div(cell, kernel.i64(ow))?,
            kernel.rem(cell, kernel.i64(ow))?,
        ];
        let [height, width, first] = image_geometry(kernel, [heights, widths, pixels], image)?;
        let size = [height, width];
        let value = cell_value(Cell { at, size, first }, x)?;
        let out_first = kernel.add(kernel.mul(image, kernel.i64(channels * cells))?, cell)?;
        kernel.lane_range(lanes, channels, |c| {
            let at = kernel.add(out_first, kernel.mul(c, kernel.i64(cells))?)?;
            kernel.store_float(out, at, value(c)?)
        })
    })
}

/// Where channel `c` of pixel `(h, w)` of an image `width` wide whose pixels start at
/// `first` is in a buffer of packed pixels of `channels`.
fn pixel_place<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    (first, width, channels): (IntValue<'ctx>, IntValue<'ctx>, i64),
    [h, w]: [IntValue<'ctx>; 2],
    c: IntValue<'ctx>,
) -> Gen<IntValue<'ctx>> {
    let pixel = kernel.add(kernel.add(first, kernel.mul(h, width)?)?, w)?;
    kernel.add(kernel.mul(pixel, kernel.i64(channels))?, c)
}

/// Adaptive average pooling to `[oh, ow]`: each cell the mean of its window's pixels,
/// in order.
pub(super) fn adaptive_mean<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    channels: i64,
    [oh, ow]: [i64; 2],
) -> Gen<()> {
    let sum = kernel.accumulator("sum")?;
    let cell_value = |cell: Cell<'ctx>, x| -> Gen<ChannelValue<'_, 'ctx>> {
        let ([i, j], [height, width]) = (cell.at, cell.size);
        let (top, bottom) = adaptive_span(kernel, i, oh, height)?;
        let (left, right) = adaptive_span(kernel, j, ow, width)?;
        let count = kernel.mul(kernel.sub(bottom, top)?, kernel.sub(right, left)?)?;
        let count = kernel.to_float(count)?;
        Ok(Box::new(move |c| {
            kernel.set(sum, kernel.constant(0.0))?;
            kernel.for_range(top, bottom, |h| {
                kernel.for_range(left, right, |w| {
                    let at = pixel_place(kernel, (cell.first, width, channels), [h, w], c)?;
                    let value = kernel.load_float(x, at)?;
                    kernel.set(sum, kernel.fadd(kernel.get(sum)?, value)?)
                })
            })?;
            kernel.fdiv(kernel.get(sum)?, count)
        }))
    };
    resampling(kernel, [oh, ow], channels, &cell_value)
}

/// How a resampling's cell `(i, j)` reads the pixel `(h, w)` of an image of `height` x
/// `width`: whether it reads it at all, and with which weight.
type CellWeight<'a, 'ctx> = &'a dyn Fn(
    [IntValue<'ctx>; 2],
    [IntValue<'ctx>; 2],
    [IntValue<'ctx>; 2],
) -> Gen<(IntValue<'ctx>, FloatValue<'ctx>)>;

/// A resampling's gradient (adaptive pooling's, bilinear interpolation's), a row of an
/// image's pixels a task: each pixel the sum over the cells that read it of
/// `x[image, c, i, j]` times the weight they read it with (`weight`), cells in order
/// (a cell that does not read it adds nothing, not even a NaN times 0).
fn resampling_spread<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    channels: i64,
    [oh, ow]: [i64; 2],
    weight: CellWeight<'_, 'ctx>,
) -> Gen<()> {
    let (start, end) = kernel.range()?;
    let [out, x, heights, widths, pixels, owners] = kernel.params([
        Role::Out,
        Role::X,
        Role::Offsets,
        Role::ColumnOffsets,
        Role::PairOffsets,
        Role::RowOwners,
    ])?;
    let sum = kernel.accumulator("sum")?;
    let cells = oh.saturating_mul(ow);
    // A row of pixels is a warp's on a GPU (each lane its channels), one thread's on
    // the host.
    kernel.parallel_rows(start, end, |row, lanes| {
        let image = kernel.load_i64(owners, row)?;
        let h = kernel.sub(row, kernel.load_i64(heights, image)?)?;
        let [height, width, first] = image_geometry(kernel, [heights, widths, pixels], image)?;
        let row_first = kernel.add(first, kernel.mul(h, width)?)?;
        let grads = kernel.mul(image, kernel.i64(channels * cells))?;
        kernel.for_range(kernel.i64(0), width, |w| {
            let out_row = kernel.mul(kernel.add(row_first, w)?, kernel.i64(channels))?;
            kernel.lane_range(lanes, channels, |c| {
                kernel.set(sum, kernel.constant(0.0))?;
                let channel = kernel.add(grads, kernel.mul(c, kernel.i64(cells))?)?;
                kernel.for_range(kernel.i64(0), kernel.i64(oh), |i| {
                    kernel.for_range(kernel.i64(0), kernel.i64(ow), |j| {
                        let (reads, share) = weight([i, j], [h, w], [height, width])?;
                        let add = || {
                            let cell = kernel.add(kernel.mul(i, kernel.i64(ow))?, j)?;
                            let g = kernel.load_float(x, kernel.add(channel, cell)?)?;
                            kernel.set(sum, kernel.fadd(kernel.get(sum)?, kernel.fmul(g, share)?)?)
                        };
                        kernel.if_else(reads, add, || Ok(()))
                    })
                })?;
                kernel.store_float(out, kernel.add(out_row, c)?, kernel.get(sum)?)
            })
        })
    })
}

/// Adaptive average pooling's gradient: each cell's gradient divided by its window's
/// pixel count, to every pixel of its window.
pub(super) fn adaptive_spread<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    channels: i64,
    [oh, ow]: [i64; 2],
) -> Gen<()> {
    let weight = |[i, j]: [IntValue<'ctx>; 2],
                  [h, w]: [IntValue<'ctx>; 2],
                  [height, width]: [IntValue<'ctx>; 2]| {
        let (top, bottom) = adaptive_span(kernel, i, oh, height)?;
        let (left, right) = adaptive_span(kernel, j, ow, width)?;
        // top <= h < bottom and left <= w < right.
        let inside = |first: IntValue<'ctx>, at, past| {
            kernel.and(
                kernel.less(at, past)?,
                kernel.less(kernel.sub(first, kernel.i64(1))?, at)?,
            )
        };
        let holds = kernel.and(inside(top, h, bottom)?, inside(left, w, right)?)?;
        let pixels = kernel.mul(kernel.sub(bottom, top)?, kernel.sub(right, left)?)?;
        let share = kernel.fdiv(kernel.constant(1.0), kernel.to_float(pixels)?)?;
        Ok((holds, share))
    };
    resampling_spread(kernel, channels, [oh, ow], &weight)
}

/// The two pixels cell `i` of `cells` interpolates between along a side of `n` pixels
/// and their weights, as torch's linear interpolation: the source point
/// `i (n - 1) / (cells - 1)` with corners aligned, else `(i + 1/2) n / cells - 1/2`
/// (at least 0); its floor (at most `n - 1`) and the next pixel (itself at the last).
fn linear_taps<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    i: IntValue<'ctx>,
    (cells, n): (i64, IntValue<'ctx>),
    align_corners: bool,
) -> Gen<(
    IntValue<'ctx>,
    IntValue<'ctx>,
    FloatValue<'ctx>,
    FloatValue<'ctx>,
)> {
    let size = kernel.to_float(n)?;
    let at = kernel.to_float(i)?;
    let source = if align_corners {
        let scale = match cells {
            1 => kernel.constant(0.0),
            _ => kernel.fdiv(
                kernel.fsub(size, kernel.constant(1.0))?,
                kernel.constant((cells - 1) as f64),
            )?,
        };
        kernel.fmul(scale, at)?
    } else {
        let scale = kernel.fdiv(size, kernel.constant(cells as f64))?;
        let centre = kernel.fadd(at, kernel.constant(0.5))?;
        let source = kernel.fsub(kernel.fmul(scale, centre)?, kernel.constant(0.5))?;
        let zero = kernel.constant(0.0);
        kernel.select_if(FloatPredicate::OLT, (source, zero), zero, source)?
    };
    let last = kernel.sub(n, kernel.i64(1))?;
    let first = kernel.min(kernel.to_index(source)?, last)?;
    let fraction = kernel.fsub(source, kernel.to_float(first)?)?;
    let (zero, one) = (kernel.constant(0.0), kernel.constant(1.0));
    let fraction = kernel.select_if(FloatPredicate::OLT, (fraction, zero), zero, fraction)?;
    let fraction = kernel.select_if(FloatPredicate::OGT, (fraction, one), one, fraction)?;
    let step = kernel.select_index(kernel.less(first, last)?, kernel.i64(1), kernel.i64(0))?;
    let second = kernel.add(first, step)?;
    Ok((first, second, kernel.fsub(one, fraction)?, fraction))
}

/// Bilinear interpolation to `[oh, ow]`: each cell the four pixels around its source
/// point, weighted as torch's.
pub(super) fn bilinear<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    channels: i64,
    [oh, ow]: [i64; 2],
    align_corners: bool,
) -> Gen<()> {
    let cell_value = |cell: Cell<'ctx>, x| -> Gen<ChannelValue<'_, 'ctx>> {
        let ([i, j], [height, width]) = (cell.at, cell.size);
        let (top, bottom, above, below) = linear_taps(kernel, i, (oh, height), align_corners)?;
        let (left, right, before, after) = linear_taps(kernel, j, (ow, width), align_corners)?;
        Ok(Box::new(move |c| {
            let value = |h, w| {
                let at = pixel_place(kernel, (cell.first, width, channels), [h, w], c)?;
                kernel.load_float(x, at)
            };
            // Along the width in each of the two rows, then between the rows.
            let across = |h| {
                kernel.fadd(
                    kernel.fmul(before, value(h, left)?)?,
                    kernel.fmul(after, value(h, right)?)?,
                )
            };
            kernel.fadd(
                kernel.fmul(above, across(top)?)?,
                kernel.fmul(below, across(bottom)?)?,
            )
        }))
    };
    resampling(kernel, [oh, ow], channels, &cell_value)
}

/// Bilinear interpolation's gradient: each cell's gradient to the four pixels it read,
/// times their weights (a pixel read twice, at an image's last row or column, gets
/// both).
pub(super) fn bilinear_spread<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    channels: i64,
    [oh, ow]: [i64; 2],
    align_corners: bool,
) -> Gen<()> {
    let weight = |[i, j]: [IntValue<'ctx>; 2],
                  [h, w]: [IntValue<'ctx>; 2],
                  [height, width]: [IntValue<'ctx>; 2]| {
        // Along one side: whether the cell reads `at`, and its weight (of the first
        // pixel plus of the second).
        let along = |at: IntValue<'ctx>, cell, (cells, n)| {
            let (first, second, near, far) = linear_taps(kernel, cell, (cells, n), align_corners)?;
            let zero = kernel.constant(0.0);
            let (is_first, is_second) = (kernel.equal(at, first)?, kernel.equal(at, second)?);
            let weight = kernel.fadd(
                kernel.select(is_first, near, zero)?,
                kernel.select(is_second, far, zero)?,
            )?;
            Gen::Ok((kernel.or(is_first, is_second)?, weight))
        };
        let (rows, down) = along(h, i, (oh, height))?;
        let (columns, across) = along(w, j, (ow, width))?;
        Ok((kernel.and(rows, columns)?, kernel.fmul(down, across)?))
    };
    resampling_spread(kernel, channels, [oh, ow], &weight)
}
