//! One LLVM function per kernel step, its arguments asked for by role from the step's
//! [`Signature`] (`nestor_passes::signature` declares every kind's). The kernel range of
//! each template: pointwise kernels, rows; GEMMs, output values (in the
//! [`KernelSet::Library`] set a GEMM's epilogue is a pointwise kernel over its rows);
//! row kernels, rows; segmented kernels, elements; gathers, rows; attention and its
//! gradient, query (or key) rows x heads; padding, the padded grid's rows; unpadding,
//! the result's rows; one-hot rows and inserts, rows; length values, elements; row
//! sums, output values; scatters, table values (or, with the ids an input the host
//! indexes, table rows: each sums its own rows, no atomics); random masks, values;
//! jagged-pair matmuls, rows (`M`); window steps, output pixels (image means and their
//! spread: images; the weight's gradient: weights; pooling's gradient: input pixels,
//! each summing its own windows in the CPU's order). One file per family: `pointwise`,
//! `rows` (row kernels), `segments` (segmented kernels), `products` (GEMMs, row sums, jagged pairs),
//! `attention`, `windows`, `padding`, `data` (gathers, scatters, one-hot rows, inserts,
//! masks, length values); this module dispatches and holds what they share.

use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::values::{FloatValue, IntValue, PointerValue};
use inkwell::FloatPredicate;
use nestor_ir::NormGradPart;
use nestor_passes::step::AttentionPart;
use nestor_passes::step::{
    Attention, AttentionGrad, Gemm, Insert, OneHot, Pad, PairGemm, Pointwise, RandomMask, Row,
    ScatterRows, Segment, SumRows, Unpad, Window,
};
use nestor_passes::{
    Access, Digits, Fusion, Order, Pick, Role, RowKind, RowMap, SegmentKind, Signature, Step,
    WindowKind,
};

use crate::builder::{Gen, Kernel, Lanes, Local, ROW_REGISTERS, WARP_LANES};
use crate::{KernelSet, Storage, Target};

mod attention;
mod data;
mod fragments;
mod order;
mod padding;
mod pointwise;
mod products;
mod rows;
mod segments;
mod tensor_attention;
mod tensor_attention_grad;
mod windows;

use attention::{attention, attention_grad};
use data::{gather, insert, length_values, one_hot, positions, random_mask, scatter_rows};
use order::{order_line, Line, Values};
use padding::{pad, unpad};
use pointwise::pointwise;
use products::{gemm, pair_gemm, sum_rows};
use rows::{finite_shift, row};
use segments::{scan, segment};
use windows::{
    adaptive_mean, adaptive_spread, bilinear, bilinear_spread, convolution, image_mean,
    image_spread, pool, pool_grad, strided_conv_input_grad, weight_grad, Groups,
};

/// Generates the kernel of `step` with `signature` (its placement's in `set`) as
/// function `name`.
pub(crate) fn generate<'ctx>(
    program: &nestor_passes::Program,
    (target, set, storage): (Target, KernelSet, Storage),
    (context, module): (&'ctx Context, &Module<'ctx>),
    name: &str,
    (step, signature): (&Step, &Signature),
) -> Gen<()> {
    let kernel = Kernel::new(context, module, name, program, (target, storage), signature);
    match step {
        Step::Gemm(Gemm {
            out,
            epilogue: Some(epilogue),
            n,
            ..
        }) if set == KernelSet::Library => {
            // Run on the GEMM's result in place: its reads of that result are the
            // output's buffer.
            kernel.output_also(inputs_of(&epilogue.inputs, *out));
            pointwise(&kernel, *n, &epilogue.inputs, &epilogue.expr)?
        }
        Step::Window(Window {
            out,
            epilogue: Some(epilogue),
            width,
            ..
        }) if set == KernelSet::Library => {
            // The CPU's own convolution, then this kernel on its output pixels in place.
            kernel.output_also(inputs_of(&epilogue.inputs, *out));
            pointwise(&kernel, *width, &epilogue.inputs, &epilogue.expr)?
        }
        Step::Gemm(gemm_step) => gemm(&kernel, gemm_step, set == KernelSet::DeviceBlas)?,
        Step::Attention(step) => attention(&kernel, step)?,
        Step::Pad(Pad { width, value, .. }) => pad(&kernel, *width, value.0)?,
        Step::Unpad(Unpad { width, .. }) => unpad(&kernel, *width)?,
        Step::OneHot(OneHot {
            classes, ignore, ..
        }) => one_hot(&kernel, *classes, *ignore)?,
        Step::LengthValues(_) => length_values(&kernel)?,
        Step::Positions(_) => positions(&kernel)?,
        Step::Insert(Insert {
            size,
            index,
            count,
            inner,
            ..
        }) => insert(&kernel, (*size, *index, *count), *inner)?,
        Step::SumRows(SumRows { m, n, mean, .. }) => sum_rows(&kernel, (*m, *n), *mean)?,
        Step::ScatterRows(ScatterRows { width, padding, .. }) => {
            scatter_rows(&kernel, *width, *padding)?
        }
        Step::RandomMask(RandomMask { p, .. }) => random_mask(&kernel, p.0)?,
        Step::AttentionGrad(step) => attention_grad(&kernel, step)?,
        Step::PairGemm(PairGemm {
            width,
            mix,
            distance,
            ..
        }) => pair_gemm(&kernel, *width, *mix, distance.map(|p| p.0))?,
        Step::Window(window) => window_kernel(&kernel, window)?,
        Step::Host(_) => {
            return Err(crate::CodegenError::new(
                "a host step (a per-element region run through libtorch) has no kernel",
            ))
        }
        Step::Pointwise(Pointwise {
            width,
            inputs,
            expr,
            ..
        }) => pointwise(&kernel, *width, inputs, expr)?,
        Step::Row(Row {
            kind,
            x,
            width,
            eps,
            ..
        }) => row(&kernel, *kind, x, *width, eps.0)?,
        Step::Segment(Segment { kind, x, width, .. }) => segment(&kernel, *kind, x, *width)?,
        Step::Gather(gather_step) => gather(&kernel, gather_step.width)?,
    }
    kernel.finish()
}

/// The kernel of a window step.
fn window_kernel(kernel: &Kernel<'_, '_>, step: &Window) -> Gen<()> {
    let Window {
        kind,
        channels,
        width,
        window,
        groups,
        ..
    } = *step;
    let taps = window.taps();
    let groups = Groups::new(groups, (channels, width))?;
    let epilogue = Epilogue {
        fusion: step.epilogue.as_ref(),
        out: step.out,
    };
    match kind {
        WindowKind::Conv | WindowKind::ConvInputGrad => convolution(
            kernel,
            (groups, taps, kind == WindowKind::ConvInputGrad),
            epilogue,
        ),
        WindowKind::StridedConvInputGrad => strided_conv_input_grad(kernel, groups, taps),
        WindowKind::WeightGrad => weight_grad(kernel, groups, taps),
        WindowKind::MaxGrad | WindowKind::AverageGrad => {
            pool_grad(kernel, channels, taps, kind == WindowKind::MaxGrad)
        }
        WindowKind::ImageSpread => image_spread(kernel, channels),
        WindowKind::Max | WindowKind::Average => {
            pool(kernel, channels, taps, kind == WindowKind::Max)
        }
        WindowKind::ImageMean => image_mean(kernel, channels),
        WindowKind::Adaptive => adaptive_mean(kernel, channels, window.kernel),
        WindowKind::AdaptiveGrad => adaptive_spread(kernel, channels, window.kernel),
        WindowKind::Bilinear { align_corners } => {
            bilinear(kernel, channels, window.kernel, align_corners)
        }
        WindowKind::BilinearGrad { align_corners } => {
            bilinear_spread(kernel, channels, window.kernel, align_corners)
        }
    }
}

/// The scalar index of `access` at output row `row` (or its element) and column `column`.
fn index<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    access: &Access,
    row: IntValue<'ctx>,
    column: IntValue<'ctx>,
) -> Gen<IntValue<'ctx>> {
    let row_part = kernel.mul(row, kernel.i64(access.row_stride))?;
    let column_part = match access.digits {
        Some(digits) => column_place(kernel, digits, column)?,
        None => {
            let column = if access.col_modulo > 0 {
                kernel.rem(column, kernel.i64(access.col_modulo))?
            } else {
                column
            };
            kernel.mul(column, kernel.i64(access.col_stride))?
        }
    };
    kernel.add(
        kernel.add(row_part, column_part)?,
        kernel.i64(access.offset),
    )
}

/// Where column `column` of a row read through `digits` is in the row.
fn column_place<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    Digits(digits): Digits,
    column: IntValue<'ctx>,
) -> Gen<IntValue<'ctx>> {
    let mut sum = kernel.i64(0);
    for digit in digits
        .iter()
        .filter(|digit| digit.modulo > 1 && digit.stride != 0)
    {
        let shifted = match digit.divisor {
            1 => column,
            divisor => kernel.div(column, kernel.i64(divisor))?,
        };
        let value = kernel.rem(shifted, kernel.i64(digit.modulo))?;
        sum = kernel.add(sum, kernel.mul(value, kernel.i64(digit.stride))?)?;
    }
    Ok(sum)
}

/// Whether a pointwise kernel's rows are one flat run of scalars: every input read
/// element for element (or one scalar). Then it is one loop over the scalars, with no
/// per-row overhead (narrow rows, such as the channels of packed pixels, would otherwise
/// spend most of their time there); else a loop over rows.
fn flat(width: i64, inputs: &[Access]) -> bool {
    inputs.iter().all(|access| {
        let whole = access.row_map.is_none() && access.col_modulo == 0 && access.digits.is_none();
        let elementwise = access.row_stride == width && access.col_stride == 1;
        let scalar = access.row_stride == 0 && access.col_stride == 0;
        whole && (elementwise || scalar)
    })
}

/// Whether `step`'s kernel runs each task of its range on a warp on a GPU
/// ([`Kernel::parallel_rows`]): row and segmented kernels, attention and its gradient,
/// jagged-pair matmuls, the window steps, gathers, scatters by an index, one-hot rows,
/// inserts, padding copies and pointwise kernels over rows, whose lanes share a row's
/// (an element's, a head's, a pixel's, an image's, a table row's) columns, and the sums
/// over rows (row sums, a weight gradient's pixels), whose lanes share the rows.
/// Rows longer than this are a block's on a GPU (a warp's otherwise): [`ROW_REGISTERS`]
/// values a lane of a warp.
pub(crate) const BLOCK_ROW_WIDTH: i64 = WARP_LANES * ROW_REGISTERS;

/// Segments at least this wide are a block's on a GPU (a warp's otherwise): a thread
/// per column of each element, every thread busy.
pub(crate) const BLOCK_SEGMENT_WIDTH: i64 = crate::GPU_BLOCK_THREADS as i64;

/// Whether a task of `step`'s GPU kernel is a whole block: a row kernel's long rows, or
/// a segmented kernel's wide elements.
pub(crate) fn block_per_task(step: &Step) -> bool {
    match step {
        Step::Row(row) => row.width > BLOCK_ROW_WIDTH && !scans(row),
        Step::Segment(segment) => segment.width >= BLOCK_SEGMENT_WIDTH,
        _ => false,
    }
}

/// Floats of shared memory a block of `step`'s GPU kernel uses: a block's rows and a
/// block's long elements combine their warps' values there, attention (but on tensor
/// cores) stages its keys and values there.
pub(crate) fn shared_floats(step: &Step, float: nestor_passes::FloatType, storage: Storage) -> i64 {
    match step {
        Step::Row(row) if row.width > BLOCK_ROW_WIDTH && !scans(row) => {
            i64::from(crate::GPU_BLOCK_THREADS) / WARP_LANES
        }
        Step::Segment(segment) => segments::segment_shared_floats(segment.width),
        Step::Attention(attention) => {
            if tensor_attention::on_tensor_cores(attention, float, storage) {
                tensor_attention::staged_floats(attention)
            } else {
                attention::staged_floats(attention)
            }
        }
        _ => 0,
    }
}

/// GPU threads per task of `step`'s kernel when that is not a block, a warp or one
/// ([`crate::gpu_threads_per_task`]): attention and its gradients on tensor cores, a
/// warp per 16 rows; a flat pointwise kernel, a thread per value of a row (up to a
/// block's), so that its grid-stride loop over the values starts every value at once
/// (a thread per row left the H200 at 12% of its bandwidth: too few loads in flight).
pub(crate) fn threads_per_task(
    step: &Step,
    float: nestor_passes::FloatType,
    storage: Storage,
) -> Option<u32> {
    match step {
        Step::Attention(attention)
            if tensor_attention::on_tensor_cores(attention, float, storage) =>
        {
            Some(tensor_attention::THREADS_PER_ROW)
        }
        Step::AttentionGrad(gradient)
            if tensor_attention_grad::grad_on_tensor_cores(gradient, float, storage) =>
        {
            Some(tensor_attention::THREADS_PER_ROW)
        }
        Step::Pointwise(Pointwise { width, inputs, .. }) if flat(*width, inputs) => {
            let block = i64::from(crate::GPU_BLOCK_THREADS);
            // Within 1..=GPU_BLOCK_THREADS, a u32.
            Some((*width).clamp(1, block) as u32)
        }
        _ => None,
    }
}

/// Whether a row kernel runs its row on one thread (its columns in order: a scan, a
/// search for a position).
fn scans(row: &Row) -> bool {
    row.kind.one_thread_a_row()
}

pub(crate) fn warp_per_task(step: &Step) -> bool {
    match step {
        Step::Row(row) => !scans(row),
        Step::Segment(_)
        | Step::Gather(_)
        | Step::Pad(_)
        | Step::Unpad(_)
        | Step::Attention(_)
        | Step::AttentionGrad(_)
        | Step::PairGemm(_)
        | Step::OneHot(_)
        | Step::Insert(_)
        | Step::SumRows(_)
        | Step::ScatterRows(_) => true,
        Step::Window(_) => true,
        Step::Pointwise(Pointwise { width, inputs, .. }) => !flat(*width, inputs),
        _ => false,
    }
}

/// The roles of the `inputs` that read slot `slot`.
fn inputs_of(inputs: &[Access], slot: nestor_passes::Slot) -> Vec<Role> {
    (0u32..)
        .zip(inputs)
        .filter(|(_, access)| access.slot == slot)
        .map(|(index, _)| Role::Input(index))
        .collect()
}

/// A fused expression's buffers and the row-to-element maps of its per-element inputs.
type FusedArgs<'ctx> = (Vec<PointerValue<'ctx>>, Vec<Option<PointerValue<'ctx>>>);

/// The epilogue of a kernel that makes a product's values itself (a GEMM's, a
/// convolution's), if it has one, and the product's output.
#[derive(Clone, Copy)]
struct Epilogue<'s> {
    fusion: Option<&'s Fusion>,
    out: nestor_passes::Slot,
}

impl Epilogue<'_> {
    fn inputs(&self) -> &[Access] {
        self.fusion.map_or(&[][..], |fusion| &fusion.inputs[..])
    }

    /// The epilogue's arguments: its reads of the output are the value made (never
    /// loaded), but their arguments are the output's buffer.
    fn args<'ctx>(&self, kernel: &Kernel<'ctx, '_>) -> Gen<FusedArgs<'ctx>> {
        kernel.output_also(inputs_of(self.inputs(), self.out));
        fused_args(kernel, self.inputs())
    }

    /// `value`, the product at `row` and `column` of the output, through the epilogue.
    fn finish<'ctx>(
        &self,
        kernel: &Kernel<'ctx, '_>,
        (pointers, maps): &FusedArgs<'ctx>,
        value: FloatValue<'ctx>,
        (row, column): (IntValue<'ctx>, IntValue<'ctx>),
    ) -> Gen<FloatValue<'ctx>> {
        let Some(fusion) = self.fusion else {
            return Ok(value);
        };
        kernel.expr(&fusion.expr, &|input: usize| {
            let access = &fusion.inputs[input];
            if access.slot == self.out {
                return Ok(value);
            }
            let element_row = match maps[input] {
                Some(map) => kernel.load_i64(map, row)?,
                None => row,
            };
            let at = index(kernel, access, element_row, column)?;
            kernel.load_float(pointers[input], at)
        })
    }
}

/// The buffers of a fused expression's `inputs` and the row-to-element maps of its
/// per-element inputs (`None` for the others).
fn fused_args<'ctx>(kernel: &Kernel<'ctx, '_>, inputs: &[Access]) -> Gen<FusedArgs<'ctx>> {
    let pointers = prologue_args(kernel, inputs)?;
    let maps = (0u32..)
        .zip(inputs)
        .map(|(index, access)| {
            access
                .row_map
                .map(|_| kernel.param(Role::InputRows(index)))
                .transpose()
        })
        .collect::<Gen<Vec<_>>>()?;
    Ok((pointers, maps))
}

/// `sum over column of f(column)` for one row of `width`.
fn row_sum<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    width: i64,
    f: impl Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<FloatValue<'ctx>> {
    lane_sum(kernel, kernel.single_lane(), width, f)
}

/// [`row_sum`] over a row shared by `lanes`: each lane sums its columns, then the lanes'
/// sums are added (the total in every lane).
fn lane_sum<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    lanes: Lanes<'ctx>,
    width: i64,
    f: impl Fn(IntValue<'ctx>) -> Gen<FloatValue<'ctx>>,
) -> Gen<FloatValue<'ctx>> {
    let acc = kernel.accumulator("sum")?;
    kernel.set(acc, kernel.constant(0.0))?;
    kernel.lane_range(lanes, width, |column| {
        let value = f(column)?;
        kernel.set(acc, kernel.fadd_reassociable(kernel.get(acc)?, value)?)
    })?;
    kernel.across_lanes(lanes, kernel.get(acc)?, |a, b| kernel.fadd(a, b))
}

/// The buffers of a fused expression's inputs.
fn prologue_args<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    inputs: &[Access],
) -> Gen<Vec<PointerValue<'ctx>>> {
    (0u32..)
        .zip(inputs)
        .map(|(index, _)| kernel.param(Role::Input(index)))
        .collect()
}

/// A kernel's input at `(row, column)`: its prologue's expression over its loads (a
/// plain buffer is one load).
fn prologue<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    x: &Fusion,
    inputs: &[PointerValue<'ctx>],
    row: IntValue<'ctx>,
    column: IntValue<'ctx>,
) -> Gen<FloatValue<'ctx>> {
    kernel.expr(&x.expr, &|input: usize| {
        let at = index(kernel, &x.inputs[input], row, column)?;
        kernel.load_float(inputs[input], at)
    })
}

/// Stores a row's one result (which every lane holds) from its first lane.
fn first_lane_stores<'ctx>(
    kernel: &Kernel<'ctx, '_>,
    lanes: Lanes<'ctx>,
    out: PointerValue<'ctx>,
    at: IntValue<'ctx>,
    value: FloatValue<'ctx>,
) -> Gen<()> {
    if lanes.count == 1 {
        return kernel.store_float(out, at, value);
    }
    kernel.if_else(
        kernel.equal(lanes.lane, kernel.i64(0))?,
        || kernel.store_float(out, at, value),
        || Ok(()),
    )
}
