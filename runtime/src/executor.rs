//! The executor: runs a compiled [`Program`] on host buffers. Sizes come from the
//! lengths inputs of each run; intermediate buffers are reused once their last reader
//! has run; kernels split their rows (or elements) across the cores.

use std::collections::HashMap;

use nestor_backend_cpu::{CpuKernels, KernelFn};
use nestor_ir::DType;
use nestor_passes::{
    Access, FloatType, OutDim, Output, Program, RowBase, Rows, Slot, Source, Step,
};
use thiserror::Error;

use crate::attention::Attention;
use crate::scalar::Scalar;
use crate::Stats;

/// Why a run could not happen.
#[derive(Debug, Error)]
pub enum RuntimeError {
    /// The program could not be compiled for this machine.
    #[error(transparent)]
    Backend(#[from] nestor_backend_cpu::BackendError),
    /// A host step (a per-element region run through libtorch) failed.
    #[error("host step: {0}")]
    Host(String),
    /// A step cannot run on what it was given (inputs that must agree do not, or a
    /// program the runtime cannot execute).
    #[error("step {step}: {reason}")]
    Step {
        /// Which step of the program.
        step: usize,
        /// What is wrong.
        reason: String,
    },
    /// An input does not fit the program.
    #[error("input {input}: {reason}")]
    BadInput {
        /// Which graph input.
        input: usize,
        /// What is wrong.
        reason: String,
    },
}

/// The data of one graph input, borrowed from the caller (no copy).
#[derive(Clone, Copy, Debug)]
pub enum InputData<'a> {
    /// f32 values (bool values as 0 and 1) of a program that computes in f32.
    F32(&'a [f32]),
    /// f64 values (bool values as 0 and 1) of a program that computes in f64.
    F64(&'a [f64]),
    /// i64 values (lengths, ids).
    I64(&'a [i64]),
}

/// A dim of the elements of a ragged result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunDim {
    /// Element `i` has size `lengths[i]`.
    Ragged(Vec<i64>),
    /// Every element has this size.
    Static(i64),
}

/// Where a run may write its results directly: buffers of the caller (a tensor of its
/// framework), so that results are not copied out.
///
/// # Safety
/// A buffer returned for `elements` must hold that many values of the program's float
/// type, be valid for writes, and outlive the run.
pub unsafe trait OutputSink {
    /// A buffer for output `index` of `elements` values, or `None` to have the runtime
    /// allocate it (and copy the result out).
    fn buffer(&mut self, index: usize, elements: usize) -> Option<*mut u8>;
}

/// The shape of a result.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunShape {
    /// A ragged batch: its values are packed rows (ragged dims first) of its static dims.
    Ragged(Vec<RunDim>),
    /// A dense tensor: rows of these trailing dims.
    Dense(Vec<i64>),
    /// A dense tensor of exactly this shape (a padded grid `[B, max(L), ...]`).
    Full(Vec<i64>),
}

/// The values of a result, in the type the program computes in.
#[derive(Clone, Debug, PartialEq)]
pub enum RunData {
    /// Values of a program that computes in f32.
    F32(Vec<f32>),
    /// Values of a program that computes in f64.
    F64(Vec<f64>),
    /// This many values, written into the buffer the [`OutputSink`] gave.
    Sunk(usize),
}

impl RunData {
    /// How many values.
    pub fn len(&self) -> usize {
        match self {
            RunData::F32(values) => values.len(),
            RunData::F64(values) => values.len(),
            RunData::Sunk(elements) => *elements,
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One result of a run.
#[derive(Debug)]
pub struct RunOutput {
    /// The values: packed rows times the static dims.
    pub data: RunData,
    /// What the values are.
    pub shape: RunShape,
    /// Element type at the boundary.
    pub dtype: DType,
}

/// One input of a host step.
#[derive(Clone, Copy, Debug)]
pub enum HostValue<'a> {
    /// Per-element lengths.
    Lengths(&'a [i64]),
    /// Packed values.
    Data(&'a [f32]),
}

/// Runs the graphs of host steps (per-element regions) for the executor; the frontend
/// implements it with libtorch.
pub trait HostRunner: Sync {
    /// Runs `graph` on `inputs` (one per graph input) and writes its single result's
    /// packed values into `out` (an error unless there are exactly `out.len()`).
    fn run(
        &self,
        graph: &nestor_ir::Graph,
        inputs: &[HostValue<'_>],
        out: &mut [f32],
    ) -> Result<(), String>;
}

/// A program and its compiled kernels.
pub struct Executable {
    program: Program,
    kernels: CpuKernels,
    /// The slots each step reads (lengths excepted): fixed by the program.
    reads: Vec<Vec<Slot>>,
    /// The buffers each step is the last reader of (inputs excepted), freed after it.
    frees: Vec<Vec<Slot>>,
    /// Intermediate buffers kept between runs (their pages are already mapped), as
    /// 8-byte words so that f32 and f64 values are both aligned.
    pool: std::sync::Mutex<Vec<Vec<u64>>>,
}

/// Raw buffer pointers handed to kernels on several threads; each thread writes a
/// disjoint range of the output, and inputs are only read.
#[derive(Clone, Copy)]
struct Args<'a>(&'a [*mut u8]);
unsafe impl Send for Args<'_> {}
unsafe impl Sync for Args<'_> {}

/// What a run knows about one lengths input.
struct LengthsInfo {
    lengths: Vec<i64>,
    offsets: Vec<i64>,
    /// The longest length (0 for an empty batch): the row stride of a padded grid.
    longest: i64,
    /// For every packed row, the element that owns it (built on first use).
    owners: std::cell::OnceCell<Vec<i64>>,
}

impl LengthsInfo {
    fn new(lengths: Vec<i64>) -> Self {
        let mut offsets = Vec::with_capacity(lengths.len() + 1);
        offsets.push(0);
        for &length in &lengths {
            offsets.push(offsets.last().copied().unwrap_or(0) + length);
        }
        Self {
            longest: lengths.iter().copied().max().unwrap_or(0),
            lengths,
            offsets,
            owners: Default::default(),
        }
    }

    fn owners(&self) -> &Vec<i64> {
        self.owners.get_or_init(|| {
            self.lengths
                .iter()
                .enumerate()
                .flat_map(|(element, &length)| std::iter::repeat_n(element as i64, length as usize))
                .collect()
        })
    }
}

impl Executable {
    /// Compiles the kernels of `program`.
    pub fn compile(program: Program) -> Result<Self, RuntimeError> {
        let kernels = nestor_backend_cpu::compile(&program)?;
        let reads: Vec<Vec<Slot>> = program.steps.iter().map(Step::reads).collect();
        let frees = last_readers(&program, &reads);
        Ok(Self {
            program,
            kernels,
            reads,
            frees,
            pool: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The optimized LLVM IR of the kernels.
    pub fn llvm_ir(&self) -> &str {
        self.kernels.llvm_ir()
    }

    /// Runs the program on `inputs` (one per graph input, in order); `host` runs host
    /// steps, if the program has any.
    pub fn run(
        &self,
        inputs: &[InputData<'_>],
        stats: &Stats,
        host: Option<&dyn HostRunner>,
    ) -> Result<Vec<RunOutput>, RuntimeError> {
        self.run_into(inputs, stats, host, None)
    }

    /// [`Executable::run`], writing the results that steps compute straight into the
    /// buffers `sink` gives (their data is then [`RunData::Sunk`]).
    pub fn run_into(
        &self,
        inputs: &[InputData<'_>],
        stats: &Stats,
        host: Option<&dyn HostRunner>,
        sink: Option<&mut dyn OutputSink>,
    ) -> Result<Vec<RunOutput>, RuntimeError> {
        let program = &self.program;
        let bad = |input: usize, reason: String| RuntimeError::BadInput { input, reason };
        // Lengths first: every size depends on them.
        let mut lengths: HashMap<Slot, LengthsInfo> = HashMap::new();
        for (index, info) in program.slots.iter().enumerate() {
            if let (Source::Input(input), DType::I64, RowBase::Batch(own)) =
                (info.source, info.dtype, info.rows.base)
            {
                if own != Slot(index as u32) {
                    continue;
                }
                let Some(InputData::I64(values)) = inputs.get(input) else {
                    return Err(bad(input, "expected lengths (i64)".into()));
                };
                if let Some((element, &length)) = values.iter().enumerate().find(|(_, &l)| l < 0) {
                    return Err(bad(
                        input,
                        format!("element {element} has negative length {length}"),
                    ));
                }
                lengths.insert(Slot(index as u32), LengthsInfo::new(values.to_vec()));
            }
        }
        for op in &program.lengths_ops {
            let values: Vec<i64> = lengths
                .get(&op.input)
                .map(|info| {
                    info.lengths
                        .iter()
                        .map(|&length| {
                            nestor_ir::window_output_size(
                                length,
                                op.kernel,
                                op.stride,
                                op.padding,
                                op.dilation,
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
            lengths.insert(op.out, LengthsInfo::new(values));
        }
        let count = |rows: Rows| -> i64 {
            let base = match rows.base {
                RowBase::Volume(first, second) => match (lengths.get(&first), lengths.get(&second))
                {
                    (Some(a), Some(b)) => {
                        a.lengths.iter().zip(&b.lengths).map(|(x, y)| x * y).sum()
                    }
                    _ => 0,
                },
                RowBase::One => 1,
                RowBase::Total(slot) => lengths
                    .get(&slot)
                    .map_or(0, |info| info.offsets.last().copied().unwrap_or(0)),
                RowBase::Batch(slot) => lengths
                    .get(&slot)
                    .map_or(0, |info| info.lengths.len() as i64),
                RowBase::Padded(slot) => lengths
                    .get(&slot)
                    .map_or(0, |info| info.lengths.len() as i64 * info.longest),
            };
            base * rows.factor
        };
        // Buffers: inputs borrowed, intermediates allocated (and reused), aliases shared.
        let mut owned: Vec<Option<Vec<u64>>> = (0..program.slots.len()).map(|_| None).collect();
        let mut pointers: Vec<*mut u8> = vec![std::ptr::null_mut(); program.slots.len()];
        let mut free: Vec<Vec<u64>> = std::mem::take(
            &mut *self
                .pool
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        );
        for (index, info) in program.slots.iter().enumerate() {
            let elements = count(info.rows) * info.width;
            match info.source {
                Source::Input(input) => {
                    let floats = info.dtype != DType::I64;
                    let (pointer, length) = match (inputs.get(input), program.float) {
                        (Some(InputData::I64(values)), _) if !floats => {
                            (values.as_ptr() as *mut u8, values.len() as i64)
                        }
                        (Some(InputData::F32(values)), FloatType::F32) if floats => {
                            (values.as_ptr() as *mut u8, values.len() as i64)
                        }
                        (Some(InputData::F64(values)), FloatType::F64) if floats => {
                            (values.as_ptr() as *mut u8, values.len() as i64)
                        }
                        (Some(_), float) => {
                            let expected = if floats {
                                format!("{} values ({float:?} program)", info.dtype)
                            } else {
                                "i64 values".into()
                            };
                            return Err(bad(input, format!("expected {expected}")));
                        }
                        (None, _) => {
                            return Err(bad(
                                input,
                                format!(
                                    "missing: the program takes {} inputs",
                                    inputs.len().max(input + 1)
                                ),
                            ))
                        }
                    };
                    let is_lengths =
                        matches!(info.rows.base, RowBase::Batch(own) if own == Slot(index as u32));
                    if !is_lengths && length != elements {
                        return Err(bad(
                            input,
                            format!("has {length} values, expected {elements} for these lengths"),
                        ));
                    }
                    pointers[index] = pointer;
                }
                // Aliases read their root's pointer when used (roots are written later).
                Source::Alias(_) | Source::Step => {}
            }
        }
        // Results computed by a step go straight into the sink's buffers.
        let mut external: Vec<Option<*mut u8>> = vec![None; program.slots.len()];
        let mut sunk = vec![false; program.outputs.len()];
        if let Some(sink) = sink {
            for (index, output) in program.outputs.iter().enumerate() {
                let slot = output.slot();
                let info = program.info(slot);
                if info.source != Source::Step || external[slot.0 as usize].is_some() {
                    continue;
                }
                let elements = (count(info.rows) * info.width).max(0) as usize;
                if let Some(buffer) = sink.buffer(index, elements) {
                    external[slot.0 as usize] = Some(buffer);
                    sunk[index] = true;
                }
            }
        }
        let mut launches = 0;
        let mut moved = 0;
        let slot_bytes = |slot: Slot| {
            let info = program.info(slot);
            (count(info.rows) * info.width).max(0) as u64 * program.float.size() as u64
        };
        for (step_index, step) in program.steps.iter().enumerate() {
            let out = step.output();
            // Every buffer the step reads, once, and the one it writes.
            moved += self.reads[step_index]
                .iter()
                .map(|&slot| slot_bytes(slot))
                .sum::<u64>()
                + slot_bytes(out);
            if let Some(buffer) = external[out.0 as usize] {
                pointers[out.0 as usize] = buffer;
            } else {
                let info = program.info(out);
                let elements = (count(info.rows) * info.width).max(0) as usize;
                let words = (elements * program.float.size()).div_ceil(8);
                let reuse = free.iter().position(|buffer| buffer.capacity() >= words);
                let mut buffer = match reuse {
                    Some(position) => free.swap_remove(position),
                    None => {
                        stats.allocated((words * 8) as u64);
                        Vec::with_capacity(words)
                    }
                };
                // Every step writes all of its output, so a reused buffer keeps its old
                // contents (only a grown part is zeroed): no memset per step.
                buffer.resize(words, 0);
                pointers[out.0 as usize] = buffer.as_mut_ptr() as *mut u8;
                owned[out.0 as usize] = Some(buffer);
            }
            let started = profile().then(std::time::Instant::now);
            self.execute(
                step_index,
                step,
                &self.resolved(&pointers),
                &lengths,
                &count,
                inputs,
                host,
            )?;
            if let Some(started) = started {
                eprintln!(
                    "nestor profile: step {step_index} {:.1} us {}",
                    started.elapsed().as_secs_f64() * 1e6,
                    step_name(step)
                );
            }
            launches += 1;
            // Buffers whose last reader was this step go back to the pool.
            for slot in &self.frees[step_index] {
                if let Some(buffer) = owned[slot.0 as usize].take() {
                    free.push(buffer);
                }
            }
        }
        stats.launched(launches);
        stats.moved(moved);
        let outputs = program
            .outputs
            .iter()
            .enumerate()
            .map(|(index, output)| {
                let (slot, shape) = match output {
                    Output::Ragged { slot, dims } => (
                        *slot,
                        RunShape::Ragged(
                            dims.iter()
                                .map(|dim| match dim {
                                    OutDim::Ragged(l) => RunDim::Ragged(
                                        lengths
                                            .get(l)
                                            .map(|info| info.lengths.clone())
                                            .unwrap_or_default(),
                                    ),
                                    OutDim::Static(size) => RunDim::Static(*size),
                                })
                                .collect(),
                        ),
                    ),
                    Output::Dense { slot, tail } => (*slot, RunShape::Dense(tail.clone())),
                    Output::Padded {
                        slot,
                        lengths: lengths_slot,
                        tail,
                    } => {
                        let (batch, longest) = lengths
                            .get(lengths_slot)
                            .map_or((0, 0), |info| (info.lengths.len() as i64, info.longest));
                        let dims = [batch, longest].into_iter().chain(tail.iter().copied());
                        (*slot, RunShape::Full(dims.collect()))
                    }
                };
                let info = program.info(slot);
                let elements = (count(info.rows) * info.width).max(0) as usize;
                let pointer = pointers[self.root(slot).0 as usize];
                // The slot holds `elements` values of the program's type: an input of
                // that checked size, or a buffer this run allocated with that size
                // (outputs are never freed).
                let data = match program.float {
                    _ if sunk[index] => RunData::Sunk(elements),
                    FloatType::F32 => RunData::F32(unsafe { copy_out(pointer, elements) }),
                    FloatType::F64 => RunData::F64(unsafe { copy_out(pointer, elements) }),
                };
                RunOutput {
                    data,
                    shape,
                    dtype: info.dtype,
                }
            })
            .collect();
        // Every buffer goes back to the pool for the next run.
        free.extend(owned.into_iter().flatten());
        self.pool
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend(free);
        Ok(outputs)
    }

    /// The slot whose memory `slot` uses (itself, unless it is an alias).
    fn root(&self, slot: Slot) -> Slot {
        root(&self.program, slot)
    }

    /// Every slot's pointer, aliases pointing at their roots' memory.
    fn resolved(&self, pointers: &[*mut u8]) -> Vec<*mut u8> {
        (0..pointers.len())
            .map(|index| pointers[self.root(Slot(index as u32)).0 as usize])
            .collect()
    }

    /// For every slot, the last step that reads it (outputs: never released).
    // The run's state (buffers, lengths, sizes, inputs, host) is passed down per step.
    #[allow(clippy::too_many_arguments)]
    fn execute(
        &self,
        index: usize,
        step: &Step,
        pointers: &[*mut u8],
        lengths: &HashMap<Slot, LengthsInfo>,
        count: &dyn Fn(Rows) -> i64,
        inputs: &[InputData<'_>],
        host: Option<&dyn HostRunner>,
    ) -> Result<(), RuntimeError> {
        let pointer = |slot: Slot| pointers[slot.0 as usize];
        let info = |slot: Slot| lengths.get(&slot);
        let offsets = |slot: Slot| {
            info(slot)
                .map(|info| info.offsets.as_ptr() as *mut u8)
                .unwrap_or(std::ptr::null_mut())
        };
        match step {
            Step::Gemm {
                out,
                x,
                weight,
                bias,
                rows,
                k,
                n,
                transposed,
                epilogue,
            } => {
                let shape = GemmShape {
                    rows: count(*rows),
                    k: *k,
                    n: *n,
                    transposed: *transposed,
                };
                let (out, x, weight, bias) = (
                    pointer(*out),
                    pointer(*x),
                    pointer(*weight),
                    bias.map(pointer),
                );
                let epilogue_args: Option<Vec<*mut u8>> = epilogue
                    .as_ref()
                    .map(|epilogue| pointwise_args(out, &epilogue.inputs, &pointer, &info));
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
            Step::Pointwise {
                out,
                rows,
                width,
                inputs: accesses,
                ..
            } => {
                let args = pointwise_args(pointer(*out), accesses, &pointer, &info);
                self.launch(index, &args, count(*rows), row_grain(step, *width))
            }
            Step::Row {
                out,
                x,
                weight,
                bias,
                rows,
                width,
                ..
            } => {
                let optional = |slot: &Option<Slot>| slot.map_or(std::ptr::null_mut(), pointer);
                let mut args = vec![pointer(*out)];
                args.extend(x.inputs.iter().map(|access| pointer(access.slot)));
                args.extend([optional(weight), optional(bias)]);
                self.launch(index, &args, count(*rows), row_grain(step, *width))
            }
            Step::Segment {
                out,
                x,
                lengths: lengths_slot,
                ..
            } => {
                let batch = info(*lengths_slot).map_or(0, |info| info.lengths.len() as i64);
                let mut args = vec![pointer(*out)];
                args.extend(x.inputs.iter().map(|access| pointer(access.slot)));
                args.push(offsets(*lengths_slot));
                self.launch(index, &args, batch, 1)
            }
            Step::Attention {
                out,
                q,
                k,
                v,
                q_lengths,
                k_lengths,
                ..
            } => {
                let batch = info(*q_lengths).map_or(0, |info| info.lengths.len() as i64);
                let key_batch = info(*k_lengths).map_or(0, |info| info.lengths.len() as i64);
                if batch != key_batch {
                    return Err(RuntimeError::Step {
                        step: index,
                        reason: format!("{batch} query elements but {key_batch} key elements"),
                    });
                }
                let (Some(q_info), Some(k_info)) = (info(*q_lengths), info(*k_lengths)) else {
                    return Ok(());
                };
                let Step::Attention {
                    heads,
                    head_dim,
                    value_dim,
                    causal,
                    scale,
                    ..
                } = step
                else {
                    return Ok(());
                };
                let attention = Attention {
                    q,
                    k,
                    v,
                    heads: *heads,
                    head_dim: *head_dim,
                    value_dim: *value_dim,
                    causal: *causal,
                    scale: *scale,
                    parallel: worker_threads() > 1,
                };
                let buffers = (
                    pointer(*out),
                    pointer(q.slot),
                    pointer(k.slot),
                    pointer(v.slot),
                );
                let offsets = (&q_info.offsets[..], &k_info.offsets[..]);
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
            Step::Host {
                out,
                inputs: host_inputs,
                graph,
            } => {
                let Some(host) = host else {
                    return Err(RuntimeError::Host(
                        "the program has host steps but no host runner was given".into(),
                    ));
                };
                if self.program.float != FloatType::F32 {
                    return Err(RuntimeError::Host(
                        "host steps exchange f32 values; this program computes in f64".into(),
                    ));
                }
                let size = |slot: Slot| {
                    let info = self.program.info(slot);
                    (count(info.rows) * info.width).max(0) as usize
                };
                let values = host_inputs
                    .iter()
                    .map(|&slot| match info(slot) {
                        Some(lengths) => HostValue::Lengths(&lengths.lengths),
                        // A data slot of `size(slot)` f32 values, written before this step.
                        None if size(slot) == 0 => HostValue::Data(&[]),
                        None => HostValue::Data(unsafe {
                            std::slice::from_raw_parts(pointer(slot) as *const f32, size(slot))
                        }),
                    })
                    .collect::<Vec<_>>();
                let expected = size(*out);
                let out: &mut [f32] = if expected == 0 {
                    &mut []
                } else {
                    // The output slot was allocated with `expected` values for this run,
                    // and no input of this step is that slot.
                    unsafe { std::slice::from_raw_parts_mut(pointer(*out) as *mut f32, expected) }
                };
                host.run(&self.program.host_graphs[*graph], &values, out)
                    .map_err(RuntimeError::Host)?;
                Ok(())
            }
            Step::Pad {
                out,
                x,
                lengths: lengths_slot,
                width,
                value,
            } => {
                let Some(info) = info(*lengths_slot) else {
                    return Ok(());
                };
                let (out, x) = (pointer(*out), pointer(*x));
                // The executor sized `out` for `B x max(L)` rows and `x` for `sum L` rows.
                unsafe {
                    match self.program.float {
                        FloatType::F32 => pad::<f32>(out, x, info, *width, *value),
                        FloatType::F64 => pad::<f64>(out, x, info, *width, *value),
                    }
                };
                Ok(())
            }
            Step::Unpad {
                out,
                x,
                grid,
                lengths: lengths_slot,
                width,
            } => {
                let (Some(grid), Some(info)) = (info(*grid), info(*lengths_slot)) else {
                    return Ok(());
                };
                let longest = grid.longest;
                if grid.lengths.len() != info.lengths.len() {
                    return Err(RuntimeError::Step {
                        step: index,
                        reason: format!(
                            "unpad: a grid of {} elements, lengths of {}",
                            grid.lengths.len(),
                            info.lengths.len()
                        ),
                    });
                }
                if let Some((element, &length)) =
                    info.lengths.iter().enumerate().find(|(_, &l)| l > longest)
                {
                    return Err(RuntimeError::Step {
                        step: index,
                        reason: format!(
                            "unpad: element {element} has length {length}, the grid holds {longest}"
                        ),
                    });
                }
                let (out, x) = (pointer(*out), pointer(*x));
                // `x` holds `B x longest` rows, `out` `sum L` rows, each length <= longest.
                unsafe {
                    match self.program.float {
                        FloatType::F32 => unpad::<f32>(out, x, &info.lengths, longest, *width),
                        FloatType::F64 => unpad::<f64>(out, x, &info.lengths, longest, *width),
                    }
                };
                Ok(())
            }
            Step::Gather {
                out,
                table,
                ids,
                rows,
                width,
            } => {
                let vocabulary = count(self.program.info(*table).rows);
                let input = match self.program.info(*ids).source {
                    Source::Input(input) => input,
                    _ => {
                        return Err(RuntimeError::Step {
                            step: index,
                            reason: "embedding ids must be an input".into(),
                        })
                    }
                };
                if let Some(InputData::I64(values)) = inputs.get(input) {
                    if let Some((row, &id)) = values
                        .iter()
                        .enumerate()
                        .find(|(_, &id)| id < 0 || id >= vocabulary)
                    {
                        return Err(RuntimeError::BadInput {
                            input,
                            reason: format!(
                                "row {row} has id {id}, outside the table of {vocabulary} rows"
                            ),
                        });
                    }
                }
                self.launch(
                    index,
                    &[pointer(*out), pointer(*table), pointer(*ids)],
                    count(*rows),
                    row_grain(step, *width),
                )
            }
        }
    }

    /// Runs kernel `index` over `0..total`, split across the cores in chunks of at least
    /// `grain` rows or elements.
    fn launch(
        &self,
        index: usize,
        args: &[*mut u8],
        total: i64,
        grain: i64,
    ) -> Result<(), RuntimeError> {
        let Some(kernel) = self.kernels.kernel(index) else {
            return Ok(());
        };
        let threads = worker_threads();
        let chunks = threads.min(total / grain.max(1)).max(1);
        let shared = Args(args);
        let call = |kernel: KernelFn, args: Args<'_>, start: i64, end: i64| {
            // The kernel reads and writes only the buffers in `args`, sized for the
            // program's lengths, and writes rows start..end of its output.
            unsafe { kernel(args.0.as_ptr(), start, end) }
        };
        if chunks == 1 {
            call(kernel, shared, 0, total);
            return Ok(());
        }
        let per_chunk = (total + chunks - 1) / chunks;
        // Rayon's pool (shared with the GEMMs) runs the other chunks while this thread
        // runs the first: one thread fewer to wake, none spawned per launch.
        rayon::in_place_scope(|scope| {
            for chunk in 1..chunks {
                let (start, end) = (chunk * per_chunk, ((chunk + 1) * per_chunk).min(total));
                scope.spawn(move |_| call(kernel, shared, start, end));
            }
            call(kernel, shared, 0, per_chunk.min(total));
        });
        Ok(())
    }
}

/// Scalars per chunk below which a kernel is not split across threads: waking the
/// pool costs more than it saves on smaller work (measured on the benchmark's
/// operators: relu and add on 384k values ran faster unsplit).
const CHUNK_SCALARS: i64 = 1 << 19;

/// How many scalars' worth of memory traffic one transcendental function (an
/// exponential, erf, tanh) counts for when deciding to split a kernel.
const TRANSCENDENTAL_WEIGHT: i64 = 8;

/// Rows per chunk of `step` over rows of `width` scalars: fewer when it evaluates
/// transcendentals, which make a kernel worth splitting across threads sooner.
fn row_grain(step: &Step, width: i64) -> i64 {
    let weight = 1 + TRANSCENDENTAL_WEIGHT * step.transcendentals() as i64;
    (CHUNK_SCALARS / (width * weight).max(1)).max(1)
}
/// Whether `NESTOR_PROFILE` asks for per-step timings on stderr.
fn profile() -> bool {
    static PROFILE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PROFILE.get_or_init(|| std::env::var_os("NESTOR_PROFILE").is_some())
}

fn step_name(step: &Step) -> String {
    match step {
        Step::Pointwise { .. } => "pointwise".into(),
        Step::Gemm { rows, k, n, .. } => format!("gemm k={k} n={n} rows={rows:?}"),
        Step::Row { kind, .. } => format!("row {kind:?}"),
        Step::Segment { kind, .. } => format!("segment {kind:?}"),
        Step::Attention { .. } => "attention".into(),
        Step::Gather { .. } => "gather".into(),
        Step::Host { .. } => "host".into(),
        Step::Pad { .. } => "pad".into(),
        Step::Unpad { .. } => "unpad".into(),
    }
}

/// Threads a kernel may use: `NESTOR_THREADS`, or the machine's cores.
fn worker_threads() -> i64 {
    static THREADS: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| {
        std::env::var("NESTOR_THREADS")
            .ok()
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as i64))
            .max(1)
    })
}

/// The sizes of one GEMM.
#[derive(Clone, Copy)]
struct GemmShape {
    rows: i64,
    k: i64,
    n: i64,
    /// W is `[k, n]` rather than `[n, k]`.
    transposed: bool,
}

/// `out[rows x n] = x[rows x k] W^T + bias` (W is `[n, k]`, or `[k, n]` when `transposed`).
///
/// # Safety
/// The buffers must hold `rows*n`, `rows*k`, `n*k` and `n` values of type `T`.
unsafe fn gemm<T: Scalar>(
    out: *mut u8,
    x: *const u8,
    weight: *const u8,
    bias: Option<*mut u8>,
    shape: GemmShape,
    epilogue: Option<(KernelFn, Args<'_>)>,
) {
    let buffers = GemmBuffers {
        out: out as *mut T,
        x: x as *const T,
        weight: weight as *const T,
        bias: bias.map(|bias| bias as *const T),
    };
    let threads = worker_threads();
    // Chunks of rows on rayon's pool (the pool the kernels use; `NESTOR_THREADS`).
    let chunks = if shape.rows * shape.k * shape.n >= GEMM_PARALLEL_MACS {
        threads.min(shape.rows / 16).max(1)
    } else {
        1
    };
    // Each chunk writes its own rows of `out`, then the epilogue (a pointwise kernel
    // over those rows, reading buffers the program sized) rewrites them in place.
    let rows = move |start: i64, end: i64| unsafe {
        gemm_rows(buffers, shape, start, end);
        if let Some((kernel, args)) = epilogue {
            kernel(args.0.as_ptr(), start, end);
        }
    };
    if chunks == 1 {
        rows(0, shape.rows);
        return;
    }
    let per_chunk = (shape.rows + chunks - 1) / chunks;
    rayon::scope(|scope| {
        for chunk in 0..chunks {
            let (start, end) = (chunk * per_chunk, ((chunk + 1) * per_chunk).min(shape.rows));
            scope.spawn(move |_| rows(start, end));
        }
    });
}

/// The slot whose memory `slot` uses in `program` (itself, unless it is an alias).
fn root(program: &Program, slot: Slot) -> Slot {
    let mut current = slot;
    while let Source::Alias(source) = program.info(current).source {
        current = source;
    }
    current
}

/// The buffers each step is the last reader of (their memory, for aliases), never the
/// program's inputs or results.
fn last_readers(program: &Program, reads: &[Vec<Slot>]) -> Vec<Vec<Slot>> {
    let root = |slot: Slot| root(program, slot);
    let mut last: Vec<Option<usize>> = vec![None; program.slots.len()];
    for (index, slots) in reads.iter().enumerate() {
        for &slot in slots {
            last[root(slot).0 as usize] = Some(index);
        }
    }
    for output in &program.outputs {
        last[root(output.slot()).0 as usize] = None;
    }
    let mut frees = vec![Vec::new(); reads.len()];
    for (slot, last) in last.iter().enumerate() {
        if let Some(step) = last {
            if !matches!(program.slots[slot].source, Source::Input(_)) {
                frees[*step].push(Slot(slot as u32));
            }
        }
    }
    frees
}

/// The arguments of a pointwise kernel: its output, its inputs, then the row-to-element
/// maps of its per-element inputs.
fn pointwise_args<'a>(
    out: *mut u8,
    accesses: &[Access],
    pointer: &dyn Fn(Slot) -> *mut u8,
    info: &dyn Fn(Slot) -> Option<&'a LengthsInfo>,
) -> Vec<*mut u8> {
    let mut args: Vec<*mut u8> = vec![out];
    args.extend(accesses.iter().map(|access| pointer(access.slot)));
    for access in accesses {
        if let Some(lengths_slot) = access.per_element {
            args.push(info(lengths_slot).map_or(std::ptr::null_mut(), |info| {
                info.owners().as_ptr() as *mut u8
            }));
        }
    }
    args
}

/// Multiply-adds above which a GEMM is split across the cores.
const GEMM_PARALLEL_MACS: i64 = 1 << 21;

/// The buffers of a GEMM, shared by the tasks that compute its row chunks.
struct GemmBuffers<T> {
    out: *mut T,
    x: *const T,
    weight: *const T,
    bias: Option<*const T>,
}
impl<T> Clone for GemmBuffers<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for GemmBuffers<T> {}
unsafe impl<T> Send for GemmBuffers<T> {}
unsafe impl<T> Sync for GemmBuffers<T> {}

/// Rows `start..end` of a GEMM, on this thread.
///
/// # Safety
/// The buffers must hold `rows*n`, `rows*k`, `n*k` and `n` values of type `T`.
unsafe fn gemm_rows<T: Scalar>(buffers: GemmBuffers<T>, shape: GemmShape, start: i64, end: i64) {
    let GemmShape {
        k, n, transposed, ..
    } = shape;
    let rows = end - start;
    if rows <= 0 || n == 0 {
        return;
    }
    unsafe {
        let out = buffers.out.offset((start * n) as isize);
        if k == 0 {
            // No inner products: the output is the bias (or zeros); write it in full.
            std::slice::from_raw_parts_mut(out, (rows * n) as usize).fill(T::ZERO);
        }
        let weight = if transposed {
            (buffers.weight, n as isize, 1)
        } else {
            (buffers.weight, 1, k as isize)
        };
        T::matmul(
            (rows as usize, k as usize, n as usize),
            T::ONE,
            (buffers.x.offset((start * k) as isize), k as isize, 1),
            weight,
            (out, n as isize, 1),
        );
        if let Some(bias) = buffers.bias {
            let bias = std::slice::from_raw_parts(bias, n as usize);
            let out = std::slice::from_raw_parts_mut(out, (rows * n) as usize);
            for row in out.chunks_mut(n as usize) {
                for (value, &b) in row.iter_mut().zip(bias) {
                    *value += b;
                }
            }
        }
    }
}

/// Writes the padded grid `[B, max(L), width]` of packed rows `x`.
///
/// # Safety
/// `x` must hold `sum(lengths) * width` values and `out` `B * max(L) * width`.
unsafe fn pad<T: Scalar>(out: *mut u8, x: *const u8, info: &LengthsInfo, width: i64, value: f64) {
    let lengths = &info.lengths;
    let (width, longest) = (width.max(0) as usize, info.longest.max(0) as usize);
    if width == 0 || longest == 0 {
        return;
    }
    let out =
        unsafe { std::slice::from_raw_parts_mut(out as *mut T, lengths.len() * longest * width) };
    let mut source = x as *const T;
    for (grid, &length) in out.chunks_mut(longest * width).zip(lengths) {
        let filled = length.max(0) as usize * width;
        unsafe {
            std::ptr::copy_nonoverlapping(source, grid.as_mut_ptr(), filled);
            source = source.add(filled);
        }
        grid[filled..].fill(T::from_f64(value));
    }
}

/// Writes the packed rows of the padded grid `x` (`B x longest` rows of `width`).
///
/// # Safety
/// `x` must hold `B * longest * width` values and `out` `sum(lengths) * width`, with
/// every length at most `longest`.
unsafe fn unpad<T: Scalar>(out: *mut u8, x: *const u8, lengths: &[i64], longest: i64, width: i64) {
    let (width, longest) = (width.max(0) as usize, longest.max(0) as usize);
    let (mut target, source) = (out as *mut T, x as *const T);
    for (element, &length) in lengths.iter().enumerate() {
        let count = length.max(0) as usize * width;
        unsafe {
            std::ptr::copy_nonoverlapping(source.add(element * longest * width), target, count);
            target = target.add(count);
        }
    }
}

/// Copies `elements` values of type `T` out of a buffer (none when it is empty).
///
/// # Safety
/// A non-null `pointer` must hold `elements` values of type `T`.
unsafe fn copy_out<T: Scalar>(pointer: *const u8, elements: usize) -> Vec<T> {
    if elements == 0 || pointer.is_null() {
        return vec![T::ZERO; elements];
    }
    unsafe { std::slice::from_raw_parts(pointer as *const T, elements) }.to_vec()
}
