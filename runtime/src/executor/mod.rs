//! The executor: runs a compiled [`Program`] on host buffers. Sizes come from the
//! lengths inputs of each run; intermediate buffers are reused once their last reader
//! has run; each step runs through the backend's [`HostSteps`], which reads and writes
//! the run's buffers ([`RunState`]). Runs time their steps when asked ([`profile`]).

use nestor_ir::DType;
use nestor_passes::{FloatType, OutDim, Output, Program, RowBase, Slot, Source, Step};
use thiserror::Error;

mod device;
mod lines;
mod marshal;
mod product;
mod profile;
mod run_state;
mod sizes;

pub use device::{
    from_bf16, round_to_bf16, to_bf16, DeviceOutput, DeviceResults, DeviceSink, Gemms, KernelDevice,
};
pub use product::{BlasCall, BlasSizeError, Product};
pub use profile::{RunProfile, StepKind, StepTiming};
pub use run_state::{
    check_ids, check_positions, mask_key, split_mix, step_error, write_positions, RunState,
};
pub use sizes::{LengthsInfo, Sizes};

use crate::MemoryBudget;
use crate::Stats;
use lines::{CacheLine, Lines};

/// Why a run could not happen.
#[derive(Debug, Error)]
pub enum RuntimeError {
    /// The program could not be compiled for this machine: the backend's own error,
    /// which a caller can downcast (the CPU backend's `BackendError`).
    #[error(transparent)]
    Backend(Box<dyn std::error::Error + Send + Sync>),
    /// A kernel device failed (no driver or device, its code, a launch, a copy): the
    /// device's own error, which a caller can downcast (the CUDA backend's `CudaError`).
    #[error("device: {0}")]
    Device(Box<dyn std::error::Error + Send + Sync>),
    /// A product's sizes do not fit the device's BLAS.
    #[error(transparent)]
    BlasSize(#[from] BlasSizeError),
    /// A host step (a per-element region run through libtorch) failed: the
    /// [`HostRunner`]'s error, which a caller can downcast (the frontend's
    /// `NestedError`).
    #[error("host step: {0}")]
    Host(Box<dyn std::error::Error + Send + Sync>),
    /// A step cannot run on what it was given (inputs that must agree do not, or a
    /// program the runtime cannot execute).
    #[error("step {step}: {reason}")]
    Step {
        /// Which step of the program.
        step: usize,
        /// What is wrong.
        reason: String,
    },
    /// A step would allocate more than the [`crate::MemoryBudget`] allows.
    #[error("step {step} ({what}) needs {bytes} bytes at once, over the memory budget of {budget} bytes (MemoryBudget, NESTOR_MEMORY_LIMIT)")]
    OutOfMemory {
        /// Which step of the program.
        step: usize,
        /// What it allocates.
        what: String,
        /// How much it needs (`u64::MAX` when the count overflows).
        bytes: u64,
        /// The budget.
        budget: u64,
    },
    /// An input does not fit the program.
    #[error("input {input}: {reason}")]
    BadInput {
        /// Which graph input.
        input: usize,
        /// What is wrong.
        reason: String,
    },
    /// Two sizes the program assumes equal (windows of different formulas that agreed
    /// when traced, met in one op) differ in this run.
    #[error("element {element} has sizes {left} and {right} where the traced model met them in one op (windows of different geometry that agreed when traced); call it with sizes on which they agree")]
    LengthsDiffer {
        /// The first element whose sizes differ.
        element: usize,
        /// Its size along one.
        left: i64,
        /// Its size along the other.
        right: i64,
    },
    /// An operation needs more positions along a dim than an element has (argmax or
    /// max of an empty element, the `k`-th smallest value of fewer than `k`).
    #[error("{op} of element {element}, which has {length} positions along the dim where {needed} are needed")]
    TooShort {
        /// The operation.
        op: &'static str,
        /// The first element too short.
        element: usize,
        /// Its length.
        length: i64,
        /// The fewest positions the operation needs.
        needed: i64,
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
    /// `len` floats already in a buffer of the kernel device a program runs on, at
    /// `address` (as its kernels take it), in the device's storage type: an f32
    /// program's float input to `Executable::run_device_resident` or `run_on_device`,
    /// which then neither uploads nor frees it. The CPU runtime rejects it.
    OnDevice {
        /// The buffer's address on the device.
        address: u64,
        /// Its values.
        len: usize,
    },
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
/// A buffer returned for `shape` must hold as many values of the program's float type
/// as the product of its dims, be valid for writes, and outlive the run.
pub unsafe trait OutputSink {
    /// A buffer for output `index`, of the values of packed shape `shape`
    /// ([`RunShape::packed`]), or `None` to have the runtime allocate it (and copy the
    /// result out).
    fn buffer(&mut self, index: usize, shape: &[i64]) -> Option<*mut u8>;

    /// Output `index`, written into the buffer this sink gave, is final: no later step
    /// of the run writes it. Called between steps, as soon as the step that completes it
    /// has run (the gradients of a training program's last layers long before the
    /// backward ends), at most once per output and run.
    fn ready(&mut self, _index: usize) {}
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
    /// Positions (argmax), whatever type the program computes in.
    I64(Vec<i64>),
    /// This many values, written into the buffer the [`OutputSink`] gave.
    Sunk(usize),
}

impl RunDim {
    /// The sizes of the static dims among `dims`, in order.
    pub fn static_sizes(dims: &[RunDim]) -> Vec<i64> {
        Self::statics(dims).collect()
    }

    /// The packed rows of a batch of these dims: over the elements, the product of
    /// their ragged dims' lengths.
    fn rows(dims: &[RunDim]) -> i64 {
        let ragged: Vec<&[i64]> = dims
            .iter()
            .filter_map(|dim| match dim {
                RunDim::Ragged(lengths) => Some(&lengths[..]),
                RunDim::Static(_) => None,
            })
            .collect();
        let elements = ragged.first().map_or(0, |lengths| lengths.len());
        (0..elements)
            .map(|element| {
                ragged
                    .iter()
                    .map(|lengths| lengths.get(element).copied().unwrap_or(0))
                    .product::<i64>()
            })
            .sum()
    }

    /// [`RunDim::static_sizes`] without collecting them.
    fn statics(dims: &[RunDim]) -> impl Iterator<Item = i64> + '_ {
        dims.iter().filter_map(|dim| match dim {
            RunDim::Static(size) => Some(*size),
            RunDim::Ragged(_) => None,
        })
    }
}

impl RunShape {
    /// The shape of a result's packed values when it holds `elements` values: rows (as
    /// many as the values fill) of the static dims of a ragged or dense result, or a
    /// padded grid's own dims.
    ///
    /// ```
    /// use nestor_runtime::{RunDim, RunShape};
    /// let ragged = RunShape::Ragged(vec![RunDim::Ragged(vec![2, 3]), RunDim::Static(4)]);
    /// assert_eq!(ragged.packed(20), vec![5, 4]);
    /// // Rows of no values: as many as the lengths make.
    /// let empty_rows = RunShape::Ragged(vec![RunDim::Ragged(vec![2, 3]), RunDim::Static(0)]);
    /// assert_eq!(empty_rows.packed(0), vec![5, 0]);
    /// assert_eq!(RunShape::Full(vec![2, 3]).packed(6), vec![2, 3]);
    /// ```
    pub fn packed(&self, elements: usize) -> Vec<i64> {
        let mut shape = Vec::new();
        self.packed_into(elements, &mut shape);
        shape
    }

    /// [`RunShape::packed`], written into `shape` (its memory reused).
    fn packed_into(&self, elements: usize, shape: &mut Vec<i64>) {
        shape.clear();
        let tail = match self {
            RunShape::Full(dims) => return shape.extend_from_slice(dims),
            RunShape::Dense(tail) => {
                shape.reserve(1 + tail.len());
                shape.push(0);
                shape.extend_from_slice(tail);
                &shape[1..]
            }
            RunShape::Ragged(dims) => {
                shape.reserve(1 + dims.len());
                shape.push(0);
                shape.extend(RunDim::statics(dims));
                &shape[1..]
            }
        };
        // As many rows as the values fill; rows of no values (a static dim of size 0)
        // as many as the ragged dims make.
        let width: i64 = tail.iter().product();
        shape[0] = match (width, self) {
            (0, RunShape::Ragged(dims)) => RunDim::rows(dims),
            (0, _) => 0,
            (width, _) => elements as i64 / width,
        };
    }
}

impl RunData {
    /// How many values.
    pub fn len(&self) -> usize {
        match self {
            RunData::F32(values) => values.len(),
            RunData::F64(values) => values.len(),
            RunData::I64(values) => values.len(),
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
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

/// How a backend runs a program's steps on the host (the CPU backend: its JIT-compiled
/// kernels, GEMM libraries and hand-written steps).
pub trait HostSteps: Send + Sync {
    /// Runs step `index` (`step`) of the run's program: reads the buffers of the slots
    /// it reads and writes all of its output's.
    fn execute(
        &self,
        index: usize,
        step: &Step,
        run: &RunState<'_, '_>,
    ) -> Result<(), RuntimeError>;
    /// The code generated for the steps (the CPU's optimized LLVM IR), for dumps.
    fn code(&self) -> &str;
}

/// A program and the backend's code that runs its steps.
pub struct Executable {
    program: Program,
    steps: Box<dyn HostSteps>,
    /// The slots each step reads (lengths excepted): fixed by the program.
    reads: Vec<Vec<Slot>>,
    /// The buffers each step is the last reader of (inputs excepted), freed after it.
    frees: Vec<Vec<Slot>>,
    /// The slot whose memory each slot uses (itself, unless it is an alias).
    roots: Vec<Slot>,
    /// The outputs each step completes (it is the last to write their memory).
    completes: Vec<Vec<usize>>,
    /// What finished runs leave for the next: one per run that was in progress at once.
    scratch: std::sync::Mutex<Vec<Scratch>>,
}

/// A run's working lists, kept between runs with the intermediate buffers, so that a
/// run allocates none of them anew (a compiled call of a small program made 24 small
/// allocations, eager libtorch 6).
#[derive(Default)]
struct Scratch {
    /// Intermediate buffers free for reuse (their pages are already mapped).
    free: Vec<Lines>,
    /// Every slot's buffer (null for aliases, which read their root's).
    pointers: Vec<*mut u8>,
    /// The intermediate buffers of this run, by slot.
    owned: Vec<Option<Lines>>,
    /// The sink's buffers, by slot.
    external: Vec<Option<*mut u8>>,
    /// Which outputs the sink holds.
    sunk: Vec<bool>,
    /// A result's packed shape, as the sink is asked for it.
    shape: Vec<i64>,
    /// A kernel's argument list.
    args: std::cell::RefCell<run_state::KernelArgs>,
    /// Offsets buffers of the lengths, for the next run's.
    offsets: Vec<Vec<i64>>,
}

// SAFETY: the pointer lists hold addresses only for the run that filled them; between
// runs, when a `Scratch` may move to another thread, they are empty.
unsafe impl Send for Scratch {}

impl Scratch {
    /// Ready for the next run: every buffer free, the lists empty (their memory kept).
    fn clear(&mut self) {
        self.free.extend(self.owned.drain(..).flatten());
        self.pointers.clear();
        self.external.clear();
        self.sunk.clear();
        self.args.get_mut().clear();
    }
}

impl Executable {
    /// `program`, its steps run by `steps` (a backend's, compiled for `program`).
    pub fn new(program: Program, steps: Box<dyn HostSteps>) -> Self {
        let reads: Vec<Vec<Slot>> = program.steps.iter().map(Step::reads).collect();
        let roots: Vec<Slot> = (0..program.slots.len())
            .map(|index| program.root(Slot(index as u32)))
            .collect();
        let frees = last_readers(&program, &reads, &roots);
        let completes = completing_steps(&program, &roots);
        Self {
            program,
            steps,
            reads,
            frees,
            roots,
            completes,
            scratch: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// The program.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// The code the backend generated for the steps (the CPU's optimized LLVM IR).
    pub fn code(&self) -> &str {
        self.steps.code()
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
        let lock = || {
            self.scratch
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        };
        let mut scratch = lock().pop().unwrap_or_default();
        let result = self.run_with(&mut scratch, inputs, stats, host, sink);
        // Kept for the next run, failed or not.
        scratch.clear();
        lock().push(scratch);
        result
    }

    /// [`Executable::run_into`] with the working lists and free buffers of `scratch`.
    fn run_with(
        &self,
        scratch: &mut Scratch,
        inputs: &[InputData<'_>],
        stats: &Stats,
        host: Option<&dyn HostRunner>,
        mut sink: Option<&mut dyn OutputSink>,
    ) -> Result<Vec<RunOutput>, RuntimeError> {
        let program = &self.program;
        // Every run draws new random masks.
        let run_number = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Scratch {
            free,
            pointers,
            owned,
            external,
            sunk,
            shape,
            args,
            offsets,
        } = scratch;
        // Lengths first: every size depends on them.
        let sizes = Sizes::of_run(program, inputs, offsets)?;
        // Buffers: inputs borrowed, intermediates allocated (and reused), aliases shared.
        self.input_pointers(inputs, &sizes, false, pointers)?;
        owned.resize_with(program.slots.len(), || None);
        let shapes = self.output_shapes(&sizes);
        match sink.as_deref_mut() {
            Some(sink) => self.sink_buffers(
                |index, shape| sink.buffer(index, shape),
                &sizes,
                &shapes,
                (external, sunk),
                shape,
            ),
            None => self.sink_buffers(|_, _| None, &sizes, &shapes, (external, sunk), shape),
        }
        let mut moved: u64 = 0;
        let timed = profile::wanted(stats);
        let mut timings = Vec::with_capacity(if timed { program.steps.len() } else { 0 });
        for (step_index, step) in program.steps.iter().enumerate() {
            let bytes = self.bytes_moved(step_index, &sizes);
            moved = moved.saturating_add(bytes);
            for out in step.outputs() {
                if let Some(buffer) = external[out.0 as usize] {
                    pointers[out.0 as usize] = buffer;
                    continue;
                }
                let bytes = within_budget(
                    step_index,
                    "its output",
                    sizes
                        .elements(program, out)
                        .checked_mul(program.value_bytes(out)),
                )?;
                let mut buffer = output_buffer(step_index, bytes, free, stats)?;
                pointers[out.0 as usize] = buffer.as_mut_ptr();
                owned[out.0 as usize] = Some(buffer);
            }
            let started = timed.then(std::time::Instant::now);
            let state = RunState {
                program,
                pointers,
                roots: &self.roots,
                sizes: &sizes,
                inputs,
                host,
                run: run_number,
                args,
            };
            #[cfg(debug_assertions)]
            self.check_own_output(step_index, pointers, &sizes);
            self.steps.execute(step_index, step, &state)?;
            if let Some(started) = started {
                let seconds = started.elapsed().as_secs_f64();
                timings.push(profile::timing(program, step_index, &sizes, seconds, bytes));
            }
            if let Some(sink) = sink.as_deref_mut() {
                for &output in &self.completes[step_index] {
                    if sunk[output] {
                        sink.ready(output);
                    }
                }
            }
            // Buffers whose last reader was this step are free for the next steps.
            for slot in &self.frees[step_index] {
                if let Some(buffer) = owned[slot.0 as usize].take() {
                    free.push(buffer);
                }
            }
        }
        stats.launched(program.steps.len() as u64);
        stats.moved(moved);
        stats.record(RunProfile { steps: timings });
        let outputs = self.outputs(&sizes, shapes, pointers, sunk);
        sizes.recycle(offsets);
        Ok(outputs)
    }

    /// Debug builds: step `index`'s outputs share no byte with a buffer the step reads
    /// (but its own result, which a GEMM's epilogue reads in place) or with each other,
    /// as the host kernels' alias scopes assume.
    #[cfg(debug_assertions)]
    fn check_own_output(&self, index: usize, pointers: &[*mut u8], sizes: &Sizes) {
        let program = &self.program;
        let span = |slot: Slot| {
            let start = pointers[self.root(slot).0 as usize] as usize;
            let width = program.value_bytes(slot);
            (start, start + sizes.elements(program, slot) * width)
        };
        let outputs: Vec<Slot> = program.steps[index].outputs().collect();
        for (position, &out) in outputs.iter().enumerate() {
            let (start, end) = span(out);
            let others = outputs[position + 1..].iter().map(|&other| (other, false));
            let reads = self.reads[index].iter().map(|&read| (read, true));
            for (other, read) in reads.chain(others) {
                let (from, to) = span(other);
                let apart = end <= from || to <= start || start == end || from == to;
                debug_assert!(
                    apart || (read && self.root(other) == self.root(out)),
                    "step {index} writes slot {} over slot {}, which it {}",
                    out.0,
                    other.0,
                    if read { "reads" } else { "writes" }
                );
            }
        }
    }

    /// The bytes step `index` reads and writes in memory: every buffer it reads, once,
    /// and those it writes ([`crate::StatsSnapshot::bytes_moved`]).
    fn bytes_moved(&self, index: usize, sizes: &Sizes) -> u64 {
        let program = &self.program;
        let slot_bytes = |slot: Slot| {
            (sizes.elements(program, slot) as u64).saturating_mul(program.value_bytes(slot) as u64)
        };
        let written = program.steps[index].outputs();
        self.reads[index]
            .iter()
            .copied()
            .chain(written)
            .map(slot_bytes)
            .fold(0, u64::saturating_add)
    }

    /// Sets `pointers` to every slot's pointer with the inputs' memory in place (null for
    /// the others), after checking each input's type and size against the program.
    fn input_pointers(
        &self,
        inputs: &[InputData<'_>],
        sizes: &Sizes,
        on_device: bool,
        pointers: &mut Vec<*mut u8>,
    ) -> Result<(), RuntimeError> {
        let program = &self.program;
        let bad = |input: usize, reason: String| RuntimeError::BadInput { input, reason };
        pointers.clear();
        pointers.resize(program.slots.len(), std::ptr::null_mut());
        for (index, info) in program.slots.iter().enumerate() {
            // Aliases read their root's pointer when used (roots are written later).
            let Source::Input(input) = info.source else {
                continue;
            };
            let floats = !info.integers;
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
                (Some(&InputData::OnDevice { address, len }), FloatType::F32)
                    if floats && on_device =>
                {
                    (address as *mut u8, i64::try_from(len).unwrap_or(i64::MAX))
                }
                (Some(InputData::OnDevice { .. }), _) if !on_device => {
                    return Err(bad(
                        input,
                        "a device buffer given to the CPU runtime (run it on its device)".into(),
                    ));
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
            let slot = Slot(index as u32);
            let is_lengths = matches!(info.rows.base, RowBase::Batch(own) if own == slot);
            let elements = sizes.scalars(program, slot);
            if !is_lengths && length != elements {
                return Err(bad(
                    input,
                    format!("has {length} values, expected {elements} for these lengths"),
                ));
            }
            pointers[index] = pointer;
        }
        Ok(())
    }

    /// Sets `external` to the buffers `sink` gives for the results that steps compute
    /// (host pointers, or a device's addresses), by slot, and `sunk` to which outputs
    /// they hold.
    pub(super) fn sink_buffers<T: Copy>(
        &self,
        mut sink: impl FnMut(usize, &[i64]) -> Option<T>,
        sizes: &Sizes,
        shapes: &[(Slot, RunShape)],
        (external, sunk): (&mut Vec<Option<T>>, &mut Vec<bool>),
        shape: &mut Vec<i64>,
    ) {
        let program = &self.program;
        external.clear();
        external.resize(program.slots.len(), None);
        sunk.clear();
        sunk.resize(program.outputs.len(), false);
        for (index, &(slot, ref run_shape)) in shapes.iter().enumerate() {
            // Sinks give float buffers: positions are copied out.
            let info = program.info(slot);
            if info.source != Source::Step || info.integers || external[slot.0 as usize].is_some() {
                continue;
            }
            let elements = sizes.elements(program, slot);
            run_shape.packed_into(elements, shape);
            // The sink sizes the buffer by the shape: it must hold every value.
            if shape
                .iter()
                .try_fold(1i64, |total, &dim| total.checked_mul(dim))
                != i64::try_from(elements).ok()
            {
                continue;
            }
            if let Some(buffer) = sink(index, shape) {
                external[slot.0 as usize] = Some(buffer);
                sunk[index] = true;
            }
        }
    }

    /// The results of a run (of `shapes`, [`Self::output_shapes`]): values copied out of
    /// their buffers unless a sink holds them.
    fn outputs(
        &self,
        sizes: &Sizes,
        shapes: Vec<(Slot, RunShape)>,
        pointers: &[*mut u8],
        sunk: &[bool],
    ) -> Vec<RunOutput> {
        let program = &self.program;
        shapes
            .into_iter()
            .enumerate()
            .map(|(index, (slot, shape))| {
                let elements = sizes.elements(program, slot);
                let pointer = pointers[self.root(slot).0 as usize];
                // The slot holds `elements` values of the program's type: an input of
                // that checked size, or a buffer this run allocated with that size
                // (outputs are never freed).
                let data = match program.float {
                    _ if sunk[index] => RunData::Sunk(elements),
                    _ if program.info(slot).integers => {
                        RunData::I64(unsafe { copy_out(pointer, elements) })
                    }
                    FloatType::F32 => RunData::F32(unsafe { copy_out(pointer, elements) }),
                    FloatType::F64 => RunData::F64(unsafe { copy_out(pointer, elements) }),
                };
                RunOutput {
                    data,
                    shape,
                    dtype: program.info(slot).dtype,
                }
            })
            .collect()
    }

    /// Each result's slot and shape in this run.
    fn output_shapes(&self, sizes: &Sizes) -> Vec<(Slot, RunShape)> {
        let lengths_of = |slot: &Slot| {
            sizes
                .get(*slot)
                .map(|info| info.lengths.to_vec())
                .unwrap_or_default()
        };
        self.program
            .outputs
            .iter()
            .map(|output| match output {
                Output::Ragged { slot, dims } => {
                    let dims = dims.iter().map(|dim| match dim {
                        OutDim::Ragged(lengths) => RunDim::Ragged(lengths_of(lengths)),
                        OutDim::Static(size) => RunDim::Static(*size),
                    });
                    (*slot, RunShape::Ragged(dims.collect()))
                }
                Output::Dense { slot, tail } => (*slot, RunShape::Dense(tail.clone())),
                Output::Scalar { slot } => (*slot, RunShape::Full(Vec::new())),
                Output::Padded {
                    slot,
                    lengths,
                    tail,
                } => {
                    let (batch, longest) = sizes
                        .get(*lengths)
                        .map_or((0, 0), |info| (info.lengths.len() as i64, info.longest));
                    let dims = [batch, longest].into_iter().chain(tail.iter().copied());
                    (*slot, RunShape::Full(dims.collect()))
                }
            })
            .collect()
    }

    /// The slot whose memory `slot` uses (itself, unless it is an alias).
    fn root(&self, slot: Slot) -> Slot {
        self.roots[slot.0 as usize]
    }
}

/// A buffer of `bytes` for step `index`'s output: a free one that is large enough, else
/// a new one (counted into `stats` at the size it took). Every step writes all of its output, so a buffer's
/// old contents are never read: it is used as it is (zeroing a reused buffer would be a
/// pass over memory per step). Large new ones are on huge pages ([`Lines`]). Debug builds
/// fill it with NaN, so that a step leaving values unwritten fails the tests rather
/// than passing on zeros.
fn output_buffer(
    index: usize,
    bytes: usize,
    free: &mut Vec<Lines>,
    stats: &Stats,
) -> Result<Lines, RuntimeError> {
    let lines = bytes.div_ceil(std::mem::size_of::<CacheLine>());
    #[allow(unused_mut)]
    let mut buffer = match smallest_fitting(free, lines, Lines::capacity) {
        Some(position) => free.swap_remove(position),
        None => {
            let buffer = Lines::new(lines).ok_or_else(|| RuntimeError::OutOfMemory {
                step: index,
                what: "its output".into(),
                bytes: bytes as u64,
                budget: MemoryBudget::bytes(),
            })?;
            // What it took, its rounding included.
            stats.allocated(buffer.bytes() as u64);
            buffer
        }
    };
    #[cfg(debug_assertions)]
    buffer.fill(lines, CacheLine([UNWRITTEN; 8]));
    Ok(buffer)
}

/// The position of the smallest of `buffers` holding `count` values by `capacity`.
///
/// Best fit, not first fit: a first fit hands a large buffer to a small output, so a
/// later large one finds none free and allocates, and so on for a different buffer
/// each call: a program's pool grew by megabytes a call for ten calls and more (a
/// Transformer's training step), and every new buffer's first touch faulted its pages
/// in (its steps 1.5-1.7x slower). With the same sizes, best fit settles on its buffers
/// (after two calls in the tests) and then allocates nothing.
pub(crate) fn smallest_fitting<B>(
    buffers: &[B],
    count: usize,
    capacity: impl Fn(&B) -> usize,
) -> Option<usize> {
    buffers
        .iter()
        .enumerate()
        .filter(|(_, buffer)| capacity(buffer) >= count)
        .min_by_key(|(_, buffer)| capacity(buffer))
        .map(|(position, _)| position)
}

/// What debug builds fill each step's output buffer with before the step: NaN as an
/// f64 and as both f32 halves.
#[cfg(debug_assertions)]
const UNWRITTEN: u64 = 0x7FF8_0000_7FC0_0000;

/// Runs of every program of the process: the key that makes each run's random masks
/// new.
static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `bytes` if a step may allocate them at once (a count that overflowed is `None`): an
/// [`RuntimeError::OutOfMemory`] naming step `step` and `what` otherwise.
pub fn within_budget(step: usize, what: &str, bytes: Option<usize>) -> Result<usize, RuntimeError> {
    let budget = MemoryBudget::bytes();
    match bytes {
        Some(bytes) if (bytes as u64) <= budget => Ok(bytes),
        _ => Err(RuntimeError::OutOfMemory {
            step,
            what: what.into(),
            bytes: bytes.map_or(u64::MAX, |bytes| bytes as u64),
            budget,
        }),
    }
}

/// The outputs each step of `program` completes: those whose memory (`roots`) no later
/// step writes.
fn completing_steps(program: &Program, roots: &[Slot]) -> Vec<Vec<usize>> {
    let root = |slot: Slot| roots[slot.0 as usize];
    let mut completes = vec![Vec::new(); program.steps.len()];
    for (index, output) in program.outputs.iter().enumerate() {
        let memory = root(output.slot());
        let last = program
            .steps
            .iter()
            .rposition(|step| step.outputs().any(|out| root(out) == memory));
        if let Some(last) = last {
            completes[last].push(index);
        }
    }
    completes
}

/// The buffers each step is the last reader of (their memory, for aliases: `roots`),
/// never the program's inputs or results.
fn last_readers(program: &Program, reads: &[Vec<Slot>], roots: &[Slot]) -> Vec<Vec<Slot>> {
    let root = |slot: Slot| roots[slot.0 as usize];
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

/// Copies `elements` values of type `T` out of a buffer (none when it is empty).
///
/// # Safety
/// A non-null `pointer` must hold `elements` values of type `T`.
unsafe fn copy_out<T: Copy + Default>(pointer: *const u8, elements: usize) -> Vec<T> {
    if elements == 0 || pointer.is_null() {
        return vec![T::default(); elements];
    }
    unsafe { std::slice::from_raw_parts(pointer as *const T, elements) }.to_vec()
}
