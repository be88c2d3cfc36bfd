//! The CPU's steps of a run: generated kernels (pointwise, row, segmented, gather,
//! padding, one-hot rows, inserts, scatter-adds, dropout masks) launched on the cores,
//! GEMMs on the GEMM library with a kernel for their epilogue, and the CPU's own code
//! where it is faster (varlen attention, window steps, row sums) or simplest (length
//! values), and host steps, each reading and writing the buffers of the run's state.

use nestor_passes::step::{
    Attention, AttentionGrad, AttentionPart, Gemm, Host, PairGemm, SumRows, Unpad,
};
use nestor_passes::{
    FloatType, KernelSet, Placement, Products, Program, Signature, Slot, Step, WindowKind,
};
use nestor_runtime::{
    step_error, within_budget, HostSteps, HostValue, InputData, RunState, RuntimeError,
};

use crate::attention::{AttentionGradRun, AttentionRun, GradOutputs, Tiles};
use crate::bf16::Producing;
use crate::gemm::{gemm, pair_gemm, sum_rows, GemmShape, PairBlocks};
use crate::jit::{BackendError, CpuKernels};
use crate::parallel::{row_grain, worker_threads, Args};
use crate::{KernelFn, Parallelism};

mod data;
mod window;

/// How the CPU runs a program's steps: the JIT-compiled kernels of its generated steps
/// and where each step runs ([`KernelSet::Library`]'s placements, with each kernel's
/// signature).
pub(crate) struct CpuSteps {
    kernels: CpuKernels,
    placements: Vec<Placement>,
    /// Per step, whether it rounds its output as it writes it ([`rounds_output`]).
    rounds_output: Vec<bool>,
}

/// The slots a step multiplies as bf16 roundings when the program's products are
/// [`Products::Bf16`] (a GEMM's input and weight, attention's inputs and its
/// gradient's, a weight gradient's two operands, the images a convolution gathers
/// its columns from as roundings, `crate::columns::gathers_roundings`).
fn rounded_operands(step: &Step) -> Vec<Slot> {
    match step {
        Step::Gemm(gemm) => vec![gemm.x, gemm.weight],
        Step::Window(window)
            if matches!(window.kind, WindowKind::Conv | WindowKind::ConvInputGrad)
                && crate::columns::gathers_roundings(
                    window::shape_of(window),
                    &window.window,
                    Products::Bf16,
                ) =>
        {
            vec![window.x]
        }
        Step::Attention(attention) => vec![attention.q.slot, attention.k.slot, attention.v.slot],
        Step::AttentionGrad(grad) => vec![grad.q.slot, grad.k.slot, grad.v.slot, grad.g.slot],
        Step::SumRows(SumRows { a: Some(a), b, .. }) => vec![*a, *b],
        _ => Vec::new(),
    }
}

/// Per step of `program`, whether it rounds its output to bf16 chunk by chunk as it
/// writes it (while the chunk is in cache; `crate::bf16::Producing`): a GEMM,
/// convolution, row or pointwise step of an f32 program with bf16 products whose
/// output a later step multiplies rounded before any step writes it again. Every other
/// rounding is made by the product that reads it, in a pass of its own.
fn rounds_output(program: &Program) -> Vec<bool> {
    let rounding = program.products == Products::Bf16 && program.float == FloatType::F32;
    program
        .steps
        .iter()
        .enumerate()
        .map(|(index, step)| {
            let producer = match step {
                Step::Gemm(_) | Step::Row(_) | Step::Pointwise(_) => true,
                Step::Window(window) => {
                    matches!(window.kind, WindowKind::Conv | WindowKind::ConvInputGrad)
                }
                _ => false,
            };
            let out = step.output();
            rounding
                && producer
                && program.steps[index + 1..]
                    .iter()
                    .map(|later| {
                        (
                            rounded_operands(later).contains(&out),
                            later.outputs().any(|written| written == out),
                        )
                    })
                    .take_while(|&(_, rewrites)| !rewrites)
                    .any(|(rounds, _)| rounds)
        })
        .collect()
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
    let (batch, key_batch) = (run.sizes().batch(q_lengths), run.sizes().batch(k_lengths));
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
    within_budget(index, "attention scores", bytes)?;
    Ok(Some((q_offsets, k_offsets)))
}

impl HostSteps for CpuSteps {
    fn execute(
        &self,
        index: usize,
        step: &Step,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        // Only bf16 products round their operands.
        if run.program().products != Products::Bf16 {
            return self.execute_step(index, step, run);
        }
        // The run keeps its bf16 roundings across its steps but for the memory this step
        // writes (8 bytes a scalar of integers, else the program's float's: a wider
        // range dropped the roundings of the buffer after a step's, which its next
        // product then made again).
        let written: Vec<_> = step
            .outputs()
            .map(|out| {
                let scalars = run.sizes().scalars(run.program(), out).max(0) as usize;
                let start = run.pointer(out) as usize;
                start..start.saturating_add(scalars.saturating_mul(run.program().value_bytes(out)))
            })
            .collect();
        let of = crate::kept::StepOf {
            run: run.run(),
            first: index == 0,
            last: index + 1 == self.placements.len(),
        };
        crate::kept::in_step(of, &written, || self.execute_step(index, step, run))
    }

    fn code(&self) -> &str {
        self.kernels.llvm_ir()
    }
}

impl CpuSteps {
    /// Runs step `index` where its placement says.
    fn execute_step(
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
            (Placement::Product(epilogue), Step::Window(window)) => {
                self.run_window(index, window, epilogue.as_ref(), run)
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

    /// Compiles the kernels of `program`'s steps that the CPU runs as generated code
    /// ([`KernelSet::Library`]), and chooses the GEMM library (a probe of a few
    /// milliseconds, once per process) now rather than inside a run.
    pub(crate) fn compile(program: &Program) -> Result<Self, BackendError> {
        let kernels = crate::jit::compile(program)?;
        let placements = program
            .steps
            .iter()
            .map(|step| step.placement(program, KernelSet::Library))
            .collect();
        crate::blas::gemm_library();
        Ok(Self {
            kernels,
            placements,
            rounds_output: rounds_output(program),
        })
    }

    /// Runs kernel `index` over `0..total`, split across the cores in chunks of at least
    /// `grain` rows or elements.
    ///
    /// With `producing` (its output's roundings and the output values per unit of the
    /// range), each chunk's output is rounded right after the kernel wrote it, and the
    /// roundings are kept for the run.
    fn launch(
        &self,
        index: usize,
        args: &[*mut u8],
        (total, grain): (i64, i64),
        producing: Option<(Producing, usize)>,
    ) -> Result<(), RuntimeError> {
        let Some(kernel) = self.kernels.kernel(index) else {
            return Ok(());
        };
        let threads = worker_threads();
        let chunks = threads.min(total / grain.max(1)).max(1);
        let shared = Args(args);
        let rounding = producing.as_ref();
        let call = |kernel: KernelFn, args: Args<'_>, start: i64, end: i64| {
            // The kernel reads and writes only the buffers in `args`, sized for the
            // program's lengths, and writes rows start..end of its output; the
            // roundings cover that output, `per` values a row.
            unsafe {
                kernel(args.0.as_ptr(), start, end);
                if let Some((producing, per)) = rounding {
                    producing.round(start.max(0) as usize * per..end.max(0) as usize * per);
                }
            }
        };
        if chunks == 1 {
            call(kernel, shared, 0, total);
        } else {
            Parallelism::count_split();
            let per_chunk = (total + chunks - 1) / chunks;
            // The team (shared with the GEMMs) runs the chunks, this thread among them.
            crate::team::for_each_chunk(chunks as usize, threads as usize, &|chunk| {
                let chunk = chunk as i64;
                call(
                    kernel,
                    shared,
                    chunk * per_chunk,
                    ((chunk + 1) * per_chunk).min(total),
                )
            });
        }
        if let Some((producing, _)) = producing {
            crate::kept::produced(producing.finish());
        }
        Ok(())
    }

    /// Whether step `index` rounds its output as it writes it ([`rounds_output`]).
    fn rounds_output_of(&self, index: usize) -> bool {
        self.rounds_output.get(index).copied().unwrap_or(false)
    }

    /// The roundings step `index` makes of its output as it writes it, if it does
    /// ([`rounds_output`]), with the output's values per unit of the kernel's range
    /// `total` (none where the output is not a whole number of values per unit).
    fn producing(
        &self,
        index: usize,
        out: Slot,
        run: &RunState<'_, '_>,
        total: i64,
    ) -> Option<(Producing, usize)> {
        if !self.rounds_output_of(index) || total <= 0 {
            return None;
        }
        let values = run.sizes().scalars(run.program(), out).max(0);
        let per = (values % total == 0).then_some(values / total)?;
        // The program computes in f32 (`rounds_output`): its output holds f32 values.
        let producing = Producing::new(run.pointer(out) as *const f32, values as usize);
        Some((producing, per as usize))
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
                let vocabulary = run.sizes().rows(run.program().info(gather.table).rows);
                self.check_ids(index, gather.ids, (vocabulary, None), run)?;
                row_grain(step, gather.width)
            }
            Step::OneHot(one_hot) => {
                let ids = (one_hot.classes, Some(one_hot.ignore));
                self.check_ids(index, one_hot.ids, ids, run)?;
                1
            }
            Step::Unpad(unpad) => {
                self.check_unpad(index, unpad, run)?;
                1
            }
            _ => 1,
        };
        let args = run.kernel_args(index, signature)?;
        let total = run.sizes().rows(signature.range);
        let producing = self.producing(index, step.output(), run, total);
        self.launch(index, &args, (total, grain), producing)
    }

    /// The steps the CPU runs on its own code: attention, jagged-pair GEMMs, window
    /// steps, row sums and length values.
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
            Step::Window(window) => self.run_window(index, window, None, run),
            _ => self.run_data_step(index, step, run),
        }
    }

    /// The steps that fill a buffer on the host: row sums and length values.
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
                times,
                plain,
                rows,
                m,
                n,
                mean,
            }) => {
                if a.is_some() && times.is_some() {
                    return Err(step_error(
                        index,
                        "a row sum of products reads no left operand".into(),
                    ));
                }
                if plain.is_some() && (times.is_none() || *mean || *m != 1) {
                    return Err(step_error(
                        index,
                        "plain column sums come only beside the sums of products".into(),
                    ));
                }
                let out = (run.pointer(*out), plain.map(|plain| run.pointer(plain)));
                let b = run.pointer(*b) as *const u8;
                let a = a.map(|a| run.pointer(a) as *const u8);
                let times = times.map(|times| run.pointer(times) as *const u8);
                let sizes = (run.sizes().rows(*rows), *m, *n);
                let options = (*mean, run.program().products);
                // The executor sized the buffers for these rows and widths, in the
                // program's type.
                unsafe {
                    match run.program().float {
                        FloatType::F32 => sum_rows::<f32>(out, (a, b, times), sizes, options),
                        FloatType::F64 => sum_rows::<f64>(out, (a, b, times), sizes, options),
                    }
                };
                Ok(())
            }
            Step::LengthValues(step) => {
                data::length_values_step(step, run);
                Ok(())
            }
            Step::Positions(step) => data::positions_step(index, step, run),
            other => Err(step_error(
                index,
                format!("{} is not a host data step", other.name()),
            )),
        }
    }

    /// The epilogue kernel of step `index` with its arguments `args`, if it has one (an
    /// error where the program has its arguments but no kernel).
    fn epilogue<'a>(
        &self,
        index: usize,
        args: Option<&'a [*mut u8]>,
    ) -> Result<Option<(KernelFn, Args<'a>)>, RuntimeError> {
        match (args, self.kernels.kernel(index)) {
            (Some(args), Some(kernel)) => Ok(Some((kernel, Args(args)))),
            (Some(_), None) => Err(step_error(index, "its epilogue has no kernel".into())),
            (None, _) => Ok(None),
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
        let shape = (
            GemmShape {
                rows: run.sizes().rows(*rows),
                k: *k,
                n: *n,
                transposed: *transposed,
            },
            run.program().products,
        );
        let (out, x, weight) = (run.pointer(*out), run.pointer(*x), run.pointer(*weight));
        let bias = bias.map(|bias| run.pointer(bias));
        let epilogue_args = epilogue
            .map(|signature| run.kernel_args(index, signature))
            .transpose()?;
        let epilogue = self.epilogue(index, epilogue_args.as_deref().map(Vec::as_slice))?;
        let rounds = self.rounds_output_of(index);
        // The executor sized the buffers for `shape` in the program's type.
        unsafe {
            match run.program().float {
                FloatType::F32 => gemm::<f32>(out, x, weight, bias, shape, epilogue, rounds),
                FloatType::F64 => gemm::<f64>(out, x, weight, bias, shape, epilogue, rounds),
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
            distance,
        } = step;
        if distance.is_some() {
            return Err(step_error(
                index,
                "distances run as a kernel, not a GEMM".into(),
            ));
        }
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
            match run.program().float {
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
        let scalars = |lengths| tiles.forward_scalars(lengths, (*head_dim, *value_dim));
        let Some(offsets) =
            attention_offsets(index, run, lengths, (&scalars, run.program().float.size()))?
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
            products: run.program().products,
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
            match run.program().float {
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
            part,
            keys_values_out,
            ..
        } = step;
        let width = *heads * *head_dim;
        let outputs = match part {
            AttentionPart::Queries => GradOutputs::queries(width),
            AttentionPart::KeysValues => GradOutputs::keys_values(width),
            AttentionPart::All => GradOutputs::all(width),
            AttentionPart::Both => GradOutputs::both(width),
            // Placed as a kernel in every set.
            AttentionPart::Statistics => {
                return Err(step_error(
                    index,
                    "attention's statistics are a kernel's, not the CPU's own code".to_owned(),
                ))
            }
        };
        let (lengths, tiles) = ((*q_lengths, *k_lengths), Tiles::DEFAULT);
        let scalars = |lengths| tiles.gradient_scalars(lengths, *head_dim);
        let Some(offsets) =
            attention_offsets(index, run, lengths, (&scalars, run.program().float.size()))?
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
            outputs,
            parallel: worker_threads() > 1,
            tiles,
            products: run.program().products,
        };
        let keys_out = match (part, keys_values_out) {
            (AttentionPart::Both, Some(keys_values)) => run.pointer(*keys_values),
            (AttentionPart::Both, None) => {
                return Err(step_error(
                    index,
                    "both attention gradients at once need a second output".to_owned(),
                ))
            }
            _ => run.pointer(*out),
        };
        let buffers = (
            (run.pointer(*out), keys_out),
            run.pointer(q.slot),
            run.pointer(k.slot),
            run.pointer(v.slot),
            run.pointer(g.slot),
        );
        // The buffers were sized from these offsets and the step's widths, in the
        // program's type.
        unsafe {
            match run.program().float {
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
        let Some(host) = run.host() else {
            return Err(RuntimeError::Host(
                "the program has host steps but no host runner was given".into(),
            ));
        };
        if run.program().float != FloatType::F32 {
            return Err(RuntimeError::Host(
                "host steps exchange f32 values; this program computes in f64".into(),
            ));
        }
        let size = |slot: Slot| run.sizes().elements(run.program(), slot);
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
        host.run(&run.program().host_graphs[graph], &values, out)
            .map_err(RuntimeError::Host)
    }

    /// Checks that an unpad step's grid has as many elements as its lengths and that
    /// every length fits the grid (its kernel reads each element's rows from it).
    fn check_unpad(
        &self,
        index: usize,
        step: &Unpad,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError> {
        let (Some(grid), Some(info)) = (run.lengths(step.grid), run.lengths(step.lengths)) else {
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
        let Some((input, data)) = run.input(ids) else {
            // Positions within elements: below the longest element's length.
            let lengths = run
                .program()
                .positions_of(ids)
                .and_then(|lengths| run.lengths(lengths));
            return match lengths {
                Some(info) => nestor_runtime::check_positions(index, &info.lengths, limit),
                None => Err(step_error(
                    index,
                    "ids must be an input or positions".into(),
                )),
            };
        };
        match data {
            InputData::I64(values) => nestor_runtime::check_ids(input, values, (limit, ignored)),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nestor_passes::Rows;

    /// `out = x w^T`, a GEMM of the slots given.
    fn gemm(out: u32, x: u32, weight: u32) -> Step {
        Step::Gemm(Gemm {
            out: Slot(out),
            x: Slot(x),
            weight: Slot(weight),
            bias: None,
            rows: Rows::fixed(4),
            k: 2,
            n: 2,
            transposed: false,
            epilogue: None,
        })
    }

    #[test]
    fn outputs_a_later_product_reads_rounded_are_rounded_by_their_step() {
        let program = |products, steps| Program {
            steps,
            products,
            ..Program::default()
        };
        // Slot 0 is read by the next GEMM as its input, slot 3 as the last one's weight;
        // slot 4 by nothing.
        let steps = vec![gemm(0, 1, 2), gemm(3, 0, 2), gemm(4, 1, 3)];
        assert_eq!(
            rounds_output(&program(Products::Bf16, steps.clone())),
            [true, true, false]
        );
        assert_eq!(
            rounds_output(&program(Products::Float, steps)),
            [false, false, false]
        );
        // A step that writes slot 0 again first: the later product reads its values.
        let steps = vec![gemm(0, 1, 2), gemm(0, 1, 2), gemm(3, 0, 2)];
        assert_eq!(
            rounds_output(&program(Products::Bf16, steps)),
            [false, true, false]
        );
    }
}
