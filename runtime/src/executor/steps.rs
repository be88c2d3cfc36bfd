//! One step of a run: kernels (pointwise, row, segmented, gather) launched on the
//! cores, GEMMs, varlen attention, host steps and the padding copies, each reading the
//! buffers of the run's state.

use nestor_passes::step::{
    Attention, AttentionGrad, Gemm, Host, Insert, LengthValues, OneHot, Pad, PairGemm, RandomMask,
    ScatterRows, SumRows, Unpad,
};
use nestor_passes::{Arg, FloatType, Placement, Signature, Slot, Source, Step};

use super::copies::{pad, unpad};
use super::gemm::{gemm, pair_gemm, sum_rows, GemmShape, PairBlocks};
use super::sizes::{LengthsInfo, Sizes};
use super::RuntimeError;
use super::{row_grain, worker_threads, Args, Executable, HostRunner, HostValue, InputData};
use crate::attention::{AttentionGradRun, AttentionRun, Tiles};

/// What every step of one run reads: the buffers of every slot (an alias's is its
/// root's), the lengths, the inputs and the host runner.
pub(super) struct RunState<'r, 'i> {
    /// The buffer of every slot that has its own memory (null for aliases).
    pub(super) pointers: &'r [*mut u8],
    /// The slot whose memory each slot uses ([`Executable`]'s `roots`).
    pub(super) roots: &'r [Slot],
    pub(super) sizes: &'r Sizes<'i>,
    pub(super) inputs: &'r [InputData<'i>],
    pub(super) host: Option<&'r dyn HostRunner>,
    /// The run's number (keys its random masks).
    pub(super) run: u64,
    /// The argument list pointwise kernels are given (reused by every step).
    pub(super) args: &'r std::cell::RefCell<Vec<*mut u8>>,
}

impl<'r> RunState<'r, '_> {
    pub(super) fn pointer(&self, slot: Slot) -> *mut u8 {
        self.pointers[self.roots[slot.0 as usize].0 as usize]
    }

    fn lengths(&self, slot: Slot) -> Option<&LengthsInfo<'_>> {
        self.sizes.get(slot)
    }

    fn offsets(&self, slot: Slot) -> *mut u8 {
        self.lengths(slot).map_or(std::ptr::null_mut(), |info| {
            info.offsets.as_ptr() as *mut u8
        })
    }

    /// The run's argument list for step `index`'s kernel of `signature`: the CPU's
    /// kernels take buffers, offsets and row maps.
    fn kernel_args(
        &self,
        index: usize,
        signature: &Signature,
    ) -> Result<std::cell::RefMut<'r, Vec<*mut u8>>, RuntimeError> {
        // Steps run one at a time and release the list when they end.
        let mut args = self
            .args
            .try_borrow_mut()
            .map_err(|_| step_error(index, "the argument list is in use".into()))?;
        super::marshal::marshal(signature, &mut args, |arg| match *arg {
            Arg::Buffer(slot) => Ok(self.pointer(slot)),
            Arg::Absent => Ok(std::ptr::null_mut()),
            Arg::Offsets(lengths) => Ok(self.offsets(lengths)),
            Arg::RowMap(map) => self
                .sizes
                .row_map(map)
                .map(|(values, _)| values as *mut u8)
                .ok_or_else(|| step_error(index, format!("the row map {map:?} cannot be built"))),
            other => Err(step_error(
                index,
                format!("the CPU's kernels take no {other:?}"),
            )),
        })?;
        Ok(args)
    }
}

/// Writes `values` as numbers of type `T`.
///
/// # Safety
/// `out` must hold `values.len()` values of type `T` (or be unused when it is empty).
unsafe fn write_numbers<T: crate::scalar::Scalar>(out: *mut u8, values: &[i64]) {
    if values.is_empty() {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, values.len()) };
    for (number, &value) in out.iter_mut().zip(values) {
        *number = T::from_f64(value as f64);
    }
}

/// One-hot rows of `ids` (zero rows for `ignore` and out-of-range ids).
///
/// # Safety
/// `ids` must hold `rows` values and `out` `rows * classes` values of type `T` (either
/// may be unused when `rows` is 0).
unsafe fn one_hot<T: crate::scalar::Scalar>(
    out: *mut u8,
    ids: *const i64,
    rows: usize,
    classes: i64,
    ignore: i64,
) {
    let width = classes.max(0) as usize;
    if rows == 0 || width == 0 {
        return;
    }
    let ids = unsafe { std::slice::from_raw_parts(ids, rows) };
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, rows * width) };
    for (row, &id) in out.chunks_exact_mut(width).zip(ids) {
        row.fill(T::ZERO);
        if id != ignore && (0..classes).contains(&id) {
            row[id as usize] = T::ONE;
        }
    }
}

/// Adds every row of `g` into the row of `out` its id names (none for `padding` and
/// ids outside the table).
///
/// # Safety
/// `ids` must hold `rows` values, `g` `rows * width` and `out` `vocabulary * width`
/// values of type `T` (any may be unused when empty).
unsafe fn scatter_rows<T: crate::scalar::Scalar>(
    (out, g, ids): (*mut u8, *const u8, *const i64),
    (rows, width, vocabulary, padding): (usize, i64, i64, i64),
) {
    let width = width.max(0) as usize;
    let table = vocabulary.max(0) as usize * width;
    if table == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, table) };
    out.fill(T::ZERO);
    if rows == 0 {
        return;
    }
    let ids = unsafe { std::slice::from_raw_parts(ids, rows) };
    let g = unsafe { std::slice::from_raw_parts(g as *const T, rows * width) };
    for (row, &id) in g.chunks_exact(width).zip(ids) {
        if id != padding && (0..vocabulary).contains(&id) {
            let start = id as usize * width;
            for (sum, &value) in out[start..start + width].iter_mut().zip(row) {
                *sum += value;
            }
        }
    }
}

/// `out` (`[rows, size, inner]`) zero but for `out[:, index, :] = x` (`[rows, inner]`).
///
/// # Safety
/// `x` must hold `rows * inner` and `out` `rows * size * inner` values of type `T`.
unsafe fn insert<T: crate::scalar::Scalar>(
    out: *mut u8,
    x: *const u8,
    rows: usize,
    (size, index, inner): (i64, i64, i64),
) {
    let (size, inner) = (size.max(0) as usize, inner.max(0) as usize);
    if rows * size * inner == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, rows * size * inner) };
    let x = unsafe { std::slice::from_raw_parts(x as *const T, rows * inner) };
    // Each value written once: the zeros around the inserted part, and the part (at
    // `index < size`, which the IR's type check ensures; `min` keeps it in the row).
    let start = (index.max(0) as usize * inner).min(size * inner - inner);
    for (row, values) in out
        .chunks_exact_mut(size * inner)
        .zip(x.chunks_exact(inner))
    {
        let (before, rest) = row.split_at_mut(start);
        let (inserted, after) = rest.split_at_mut(inner);
        before.fill(T::ZERO);
        inserted.copy_from_slice(values);
        after.fill(T::ZERO);
    }
}

/// A dropout mask of `count` values: `1 / (1 - p)` where the position's uniform number
/// (SplitMix64 of the stream, the run and the position) is at least `p`, else 0.
///
/// # Safety
/// `out` must hold `count` values of type `T` (or be unused when `count` is 0).
unsafe fn random_mask<T: crate::scalar::Scalar>(
    out: *mut u8,
    count: usize,
    p: f64,
    (stream, run): (u64, u64),
) {
    if count == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, count) };
    let kept = T::from_f64(1.0 / (1.0 - p));
    let key = mask_key(stream as i64, run);
    for (position, value) in out.iter_mut().enumerate() {
        // The top 53 bits as a uniform number in [0, 1).
        let uniform = (split_mix(key ^ position as u64) >> 11) as f64 / (1u64 << 53) as f64;
        *value = if uniform >= p { kept } else { T::ZERO };
    }
}

/// The key of mask `stream` in run `run` (the device's mask kernel takes it too).
pub(super) fn mask_key(stream: i64, run: u64) -> u64 {
    split_mix(stream as u64 ^ split_mix(run))
}

/// SplitMix64's finalizer: a bijective mix of 64 bits.
fn split_mix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The row offsets of an attention step's queries and keys.
type Offsets<'r> = (&'r [i64], &'r [i64]);

/// The query and key offsets of an attention step, after checking that both batches
/// have as many elements (`None`: lengths not given, nothing to do).
/// The scalars one attention task holds at once for an element of (queries, keys).
type TaskScalars<'a> = &'a dyn Fn((i64, i64)) -> Option<usize>;

fn attention_offsets<'r>(
    index: usize,
    run: &'r RunState<'_, '_>,
    (q_lengths, k_lengths): (Slot, Slot),
    (task_scalars, scalar_bytes): (TaskScalars<'_>, usize),
) -> Result<Option<Offsets<'r>>, RuntimeError> {
    let (batch, key_batch) = (run.sizes.batch(q_lengths), run.sizes.batch(k_lengths));
    if batch != key_batch {
        return Err(step_error(
            index,
            format!("{batch} query elements but {key_batch} key elements"),
        ));
    }
    let Some((q_offsets, k_offsets)) = (match (run.lengths(q_lengths), run.lengths(k_lengths)) {
        (Some(q_info), Some(k_info)) => Some((&q_info.offsets[..], &k_info.offsets[..])),
        _ => None,
    }) else {
        return Ok(None);
    };
    // Each task holds `task_scalars` of its element's lengths (its tiles of scores);
    // up to one task per thread at once.
    let largest = q_offsets
        .windows(2)
        .zip(k_offsets.windows(2))
        .map(|(q, k)| task_scalars((q[1] - q[0], k[1] - k[0])))
        .try_fold(0usize, |largest, scalars| Some(largest.max(scalars?)));
    let tasks = worker_threads().max(1) as usize;
    let bytes = largest.and_then(|scalars| {
        scalars
            .checked_mul(scalar_bytes)
            .and_then(|bytes| bytes.checked_mul(tasks))
    });
    super::within_budget(index, "attention scores", bytes)?;
    Ok(Some((q_offsets, k_offsets)))
}

pub(super) fn step_error(step: usize, reason: String) -> RuntimeError {
    RuntimeError::Step { step, reason }
}

impl Executable {
    /// Runs step `index` of the program, where its placement on the CPU says.
    pub(super) fn execute(
        &self,
        index: usize,
        step: &Step,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        match (&self.placements[index], step) {
            (Placement::Kernel(signature), _) => self.run_kernel(index, step, signature, run),
            (Placement::Product(epilogue), Step::Gemm(gemm)) => {
                self.run_gemm(index, gemm, epilogue.as_ref(), run)
            }
            (Placement::Libtorch, Step::Host(Host { out, inputs, graph })) => {
                self.run_host(*out, inputs, *graph, run)
            }
            (Placement::Backend, _) => self.run_backend(index, step, run),
            (placement, _) => Err(step_error(
                index,
                format!(
                    "the CPU cannot run a {} step placed as {placement:?}",
                    step.name()
                ),
            )),
        }
    }

    /// A generated kernel over its signature's range, split in chunks across the cores.
    fn run_kernel(
        &self,
        index: usize,
        step: &Step,
        signature: &Signature,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let grain = match step {
            Step::Pointwise(pointwise) => row_grain(step, pointwise.width),
            Step::Row(row) => row_grain(step, row.width),
            Step::Gather(gather) => {
                let vocabulary = run.sizes.rows(self.program.info(gather.table).rows);
                self.check_ids(index, gather.ids, (vocabulary, None), run)?;
                row_grain(step, gather.width)
            }
            _ => 1,
        };
        let args = run.kernel_args(index, signature)?;
        self.launch(index, &args, run.sizes.rows(signature.range), grain)
    }

    /// The steps the CPU runs on its own code: attention, jagged-pair GEMMs, window
    /// steps, the padding copies and the training steps.
    fn run_backend(
        &self,
        index: usize,
        step: &Step,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        match step {
            Step::Attention(attention) => self.run_attention(index, attention, run),
            Step::AttentionGrad(gradient) => self.run_attention_grad(index, gradient, run),
            Step::PairGemm(pair_gemm) => self.run_pair_gemm(index, pair_gemm, run),
            Step::Window(window) => self.run_window(index, window, run),
            Step::Pad(Pad {
                out,
                x,
                lengths,
                width,
                value,
            }) => {
                let Some(info) = run.lengths(*lengths) else {
                    return Ok(());
                };
                let (out, x) = (run.pointer(*out), run.pointer(*x));
                // The executor sized `out` for `B x max(L)` rows and `x` for `sum L` rows.
                unsafe {
                    match self.program.float {
                        FloatType::F32 => pad::<f32>(out, x, info, *width, value.0),
                        FloatType::F64 => pad::<f64>(out, x, info, *width, value.0),
                    }
                };
                Ok(())
            }
            Step::Unpad(unpad) => self.run_unpad(index, unpad, run),
            _ => self.run_data_step(index, step, run),
        }
    }

    /// The steps that fill a buffer on the host: row sums, one-hot rows, scatter-adds,
    /// inserted copies, random masks and length values.
    fn run_data_step(
        &self,
        index: usize,
        step: &Step,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        match step {
            Step::SumRows(SumRows {
                out,
                a,
                b,
                rows,
                m,
                n,
                mean,
            }) => {
                let (out, b) = (run.pointer(*out), run.pointer(*b) as *const u8);
                let a = a.map(|a| run.pointer(a) as *const u8);
                let sizes = (run.sizes.rows(*rows), *m, *n);
                // The executor sized the buffers for these rows and widths, in the
                // program's type.
                unsafe {
                    match self.program.float {
                        FloatType::F32 => sum_rows::<f32>(out, a, b, sizes, *mean),
                        FloatType::F64 => sum_rows::<f64>(out, a, b, sizes, *mean),
                    }
                };
                Ok(())
            }
            Step::OneHot(OneHot {
                out,
                ids,
                rows,
                classes,
                ignore,
            }) => {
                self.check_ids(index, *ids, (*classes, Some(*ignore)), run)?;
                let rows = run.sizes.rows(*rows).max(0) as usize;
                let (out, ids) = (run.pointer(*out), run.pointer(*ids) as *const i64);
                // `ids` holds `rows` i64 values (an input of that checked size) and `out`
                // `rows * classes` values of the program's type.
                match self.program.float {
                    FloatType::F32 => unsafe { one_hot::<f32>(out, ids, rows, *classes, *ignore) },
                    FloatType::F64 => unsafe { one_hot::<f64>(out, ids, rows, *classes, *ignore) },
                }
                Ok(())
            }
            Step::ScatterRows(ScatterRows {
                out,
                g,
                ids,
                rows,
                width,
                vocabulary,
                padding,
            }) => {
                let rows = run.sizes.rows(*rows).max(0) as usize;
                let buffers = (
                    run.pointer(*out),
                    run.pointer(*g) as *const u8,
                    run.pointer(*ids) as *const i64,
                );
                let sizes = (rows, *width, *vocabulary, *padding);
                // `ids` holds `rows` i64 values, `g` `rows * width` and `out`
                // `vocabulary * width` values of the program's type.
                match self.program.float {
                    FloatType::F32 => unsafe { scatter_rows::<f32>(buffers, sizes) },
                    FloatType::F64 => unsafe { scatter_rows::<f64>(buffers, sizes) },
                }
                Ok(())
            }
            Step::Insert(Insert {
                out,
                x,
                rows,
                size,
                index,
                inner,
            }) => {
                let rows = run.sizes.rows(*rows).max(0) as usize;
                let (out, x) = (run.pointer(*out), run.pointer(*x) as *const u8);
                // `x` holds `rows * inner` and `out` `rows * size * inner` values of the
                // program's type.
                match self.program.float {
                    FloatType::F32 => unsafe {
                        insert::<f32>(out, x, rows, (*size, *index, *inner))
                    },
                    FloatType::F64 => unsafe {
                        insert::<f64>(out, x, rows, (*size, *index, *inner))
                    },
                }
                Ok(())
            }
            Step::RandomMask(RandomMask {
                out,
                rows,
                width,
                p,
                stream,
            }) => {
                let count = (run.sizes.rows(*rows) * width).max(0) as usize;
                let out = run.pointer(*out);
                let key = (*stream as u64, run.run);
                // `out` holds `count` values of the program's type.
                match self.program.float {
                    FloatType::F32 => unsafe { random_mask::<f32>(out, count, p.0, key) },
                    FloatType::F64 => unsafe { random_mask::<f64>(out, count, p.0, key) },
                }
                Ok(())
            }
            Step::LengthValues(LengthValues { out, lengths }) => {
                let Some(info) = run.lengths(*lengths) else {
                    return Ok(());
                };
                let out = run.pointer(*out);
                // `out` holds one value per element of these lengths, in the program's type.
                match self.program.float {
                    FloatType::F32 => unsafe { write_numbers::<f32>(out, &info.lengths) },
                    FloatType::F64 => unsafe { write_numbers::<f64>(out, &info.lengths) },
                }
                Ok(())
            }
            other => Err(step_error(
                index,
                format!("{} is not a host data step", super::step_name(other)),
            )),
        }
    }

    /// A GEMM, its epilogue kernel (of `epilogue`'s signature) run on each chunk of rows.
    fn run_gemm(
        &self,
        index: usize,
        step: &Gemm,
        epilogue: Option<&Signature>,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let Gemm {
            out,
            x,
            weight,
            bias,
            rows,
            k,
            n,
            transposed,
            ..
        } = step;
        let shape = GemmShape {
            rows: run.sizes.rows(*rows),
            k: *k,
            n: *n,
            transposed: *transposed,
        };
        let (out, x, weight) = (run.pointer(*out), run.pointer(*x), run.pointer(*weight));
        let bias = bias.map(|bias| run.pointer(bias));
        let epilogue_args = epilogue
            .map(|signature| run.kernel_args(index, signature))
            .transpose()?;
        let epilogue = match (&epilogue_args, self.kernels.kernel(index)) {
            (Some(args), Some(kernel)) => Some((kernel, Args(args))),
            _ => None,
        };
        // The executor sized the buffers for `shape` in the program's type.
        unsafe {
            match self.program.float {
                FloatType::F32 => gemm::<f32>(out, x, weight, bias, shape, epilogue),
                FloatType::F64 => gemm::<f64>(out, x, weight, bias, shape, epilogue),
            }
        }
        Ok(())
    }

    /// The jagged-pair matmul: row and column lengths must have as many elements.
    fn run_pair_gemm(
        &self,
        index: usize,
        step: &PairGemm,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let PairGemm {
            out,
            a,
            b,
            rows,
            columns,
            width,
            mix,
        } = step;
        let (Some(rows), Some(columns)) = (run.lengths(*rows), run.lengths(*columns)) else {
            return Ok(());
        };
        if rows.lengths.len() != columns.lengths.len() {
            return Err(step_error(
                index,
                format!(
                    "{} row lengths but {} column lengths",
                    rows.lengths.len(),
                    columns.lengths.len()
                ),
            ));
        }
        let blocks = PairBlocks::new(&rows.lengths, &columns.lengths, *width, *mix);
        let buffers = (
            run.pointer(*out),
            run.pointer(*a) as *const u8,
            run.pointer(*b) as *const u8,
        );
        // The buffers were sized from these lengths and the step's width, in the
        // program's type.
        unsafe {
            match self.program.float {
                FloatType::F32 => pair_gemm::<f32>(buffers, &blocks, *width, *mix),
                FloatType::F64 => pair_gemm::<f64>(buffers, &blocks, *width, *mix),
            }
        }
        Ok(())
    }

    /// Varlen attention: query and key batches must have as many elements.
    fn run_attention(
        &self,
        index: usize,
        step: &Attention,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let Attention {
            out,
            q,
            k,
            v,
            q_lengths,
            k_lengths,
            heads,
            head_dim,
            value_dim,
            causal,
            scale,
        } = step;
        let lengths = (*q_lengths, *k_lengths);
        let tiles = Tiles::DEFAULT;
        let scalars = |lengths| tiles.forward_scalars(lengths, *value_dim);
        let Some(offsets) =
            attention_offsets(index, run, lengths, (&scalars, self.program.float.size()))?
        else {
            return Ok(());
        };
        let attention = AttentionRun {
            q,
            k,
            v,
            heads: *heads,
            head_dim: *head_dim,
            value_dim: *value_dim,
            causal: *causal,
            scale: scale.0,
            parallel: worker_threads() > 1,
            tiles,
        };
        let buffers = (
            run.pointer(*out),
            run.pointer(q.slot),
            run.pointer(k.slot),
            run.pointer(v.slot),
        );
        // The buffers were sized from these offsets and the step's widths, in the
        // program's type.
        unsafe {
            match self.program.float {
                FloatType::F32 => attention.run::<f32>(buffers, offsets),
                FloatType::F64 => attention.run::<f64>(buffers, offsets),
            }
        };
        Ok(())
    }

    /// The gradient of varlen attention: query and key batches must have as many
    /// elements.
    fn run_attention_grad(
        &self,
        index: usize,
        step: &AttentionGrad,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let AttentionGrad {
            out,
            q,
            k,
            v,
            g,
            q_lengths,
            k_lengths,
            heads,
            head_dim,
            causal,
            scale,
            keys,
        } = step;
        let (lengths, tiles) = ((*q_lengths, *k_lengths), Tiles::DEFAULT);
        let scalars = |lengths| tiles.gradient_scalars(lengths, *head_dim);
        let Some(offsets) =
            attention_offsets(index, run, lengths, (&scalars, self.program.float.size()))?
        else {
            return Ok(());
        };
        let gradient = AttentionGradRun {
            q,
            k,
            v,
            g,
            heads: *heads,
            head_dim: *head_dim,
            causal: *causal,
            scale: scale.0,
            keys: *keys,
            parallel: worker_threads() > 1,
            tiles,
        };
        let buffers = (
            run.pointer(*out),
            run.pointer(q.slot),
            run.pointer(k.slot),
            run.pointer(v.slot),
            run.pointer(g.slot),
        );
        // The buffers were sized from these offsets and the step's widths, in the
        // program's type.
        unsafe {
            match self.program.float {
                FloatType::F32 => gradient.run::<f32>(buffers, offsets),
                FloatType::F64 => gradient.run::<f64>(buffers, offsets),
            }
        };
        Ok(())
    }

    /// A host step: the host runner reads the packed inputs in place and writes the
    /// output slot.
    fn run_host(
        &self,
        out: Slot,
        inputs: &[Slot],
        graph: usize,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let Some(host) = run.host else {
            return Err(RuntimeError::Host(
                "the program has host steps but no host runner was given".into(),
            ));
        };
        if self.program.float != FloatType::F32 {
            return Err(RuntimeError::Host(
                "host steps exchange f32 values; this program computes in f64".into(),
            ));
        }
        let size = |slot: Slot| run.sizes.elements(&self.program, slot);
        let values = inputs
            .iter()
            .map(|&slot| match run.lengths(slot) {
                Some(lengths) => HostValue::Lengths(&lengths.lengths),
                // A data slot of `size(slot)` f32 values, written before this step.
                None if size(slot) == 0 => HostValue::Data(&[]),
                None => HostValue::Data(unsafe {
                    std::slice::from_raw_parts(run.pointer(slot) as *const f32, size(slot))
                }),
            })
            .collect::<Vec<_>>();
        let expected = size(out);
        let out: &mut [f32] = if expected == 0 {
            &mut []
        } else {
            // The output slot was allocated with `expected` values for this run, and no
            // input of this step is that slot.
            unsafe { std::slice::from_raw_parts_mut(run.pointer(out) as *mut f32, expected) }
        };
        host.run(&self.program.host_graphs[graph], &values, out)
            .map_err(RuntimeError::Host)
    }

    /// Packed rows out of a padded grid, after checking that every length fits it.
    fn run_unpad(
        &self,
        index: usize,
        step: &Unpad,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let Unpad {
            out,
            x,
            grid,
            lengths,
            width,
        } = step;
        let (Some(grid), Some(info)) = (run.lengths(*grid), run.lengths(*lengths)) else {
            return Ok(());
        };
        let longest = grid.longest;
        if grid.lengths.len() != info.lengths.len() {
            return Err(step_error(
                index,
                format!(
                    "unpad: a grid of {} elements, lengths of {}",
                    grid.lengths.len(),
                    info.lengths.len()
                ),
            ));
        }
        if let Some((element, &length)) =
            info.lengths.iter().enumerate().find(|(_, &l)| l > longest)
        {
            return Err(step_error(
                index,
                format!("unpad: element {element} has length {length}, the grid holds {longest}"),
            ));
        }
        let (out, x) = (run.pointer(*out), run.pointer(*x));
        // `x` holds `B x longest` rows, `out` `sum L` rows, each length <= longest.
        unsafe {
            match self.program.float {
                FloatType::F32 => unpad::<f32>(out, x, &info.lengths, longest, *width),
                FloatType::F64 => unpad::<f64>(out, x, &info.lengths, longest, *width),
            }
        };
        Ok(())
    }

    /// Checks that the ids in `ids` (an input) are in `0..limit`, or equal `ignored`:
    /// the rows of an embedding table, the classes of a one-hot target.
    fn check_ids(
        &self,
        index: usize,
        ids: Slot,
        (limit, ignored): (i64, Option<i64>),
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let Source::Input(input) = self.program.info(ids).source else {
            return Err(step_error(index, "ids must be an input".into()));
        };
        if let Some(InputData::I64(values)) = run.inputs.get(input) {
            if let Some((row, &id)) = values
                .iter()
                .enumerate()
                .find(|(_, &id)| Some(id) != ignored && !(0..limit).contains(&id))
            {
                return Err(RuntimeError::BadInput {
                    input,
                    reason: format!("row {row} has id {id}, outside 0..{limit}"),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nestor_passes::Rows;

    /// The device's dropout-mask kernel draws the CPU's masks, bit for bit.
    #[test]
    fn the_mask_template_draws_the_host_masks() {
        for (p, stream, run) in [(0.5, 3i64, 7u64), (0.1, 0, 0), (0.9, 12, 123_456)] {
            let count = 1000;
            let step = Step::RandomMask(RandomMask {
                out: Slot(0),
                rows: Rows::fixed(count as i64),
                width: 1,
                p: nestor_ir::F64(p),
                stream,
            });
            let mut actual = vec![f32::NAN; count];
            let key = [mask_key(stream, run) as i64];
            let args = [actual.as_mut_ptr() as *mut u8, key.as_ptr() as *mut u8];
            // `actual` holds the `count` values of the range.
            unsafe { crate::testing::run_template(step, &args, count as i64) };
            let mut expected = vec![f32::NAN; count];
            unsafe {
                random_mask::<f32>(
                    expected.as_mut_ptr() as *mut u8,
                    count,
                    p,
                    (stream as u64, run),
                )
            };
            assert_eq!(
                actual
                    .iter()
                    .map(|value| value.to_bits())
                    .collect::<Vec<_>>(),
                expected
                    .iter()
                    .map(|value| value.to_bits())
                    .collect::<Vec<_>>(),
                "p {p}"
            );
            let dropped =
                actual.iter().filter(|&&value| value == 0.0).count() as f64 / count as f64;
            assert!((dropped - p).abs() < 0.06, "p {p}: dropped {dropped}");
        }
    }
}
