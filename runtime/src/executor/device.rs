//! Whole programs on a kernel device: every step runs as its placement in the device's
//! kernel set says (a kernel of the `Complete` set, GEMMs, attention, padding and window
//! steps included; or the device's BLAS and a kernel after it) on memory the device
//! owns; the host only sizes the buffers from the lengths and uploads what the kernels
//! index with (offsets, row-to-element maps, longest lengths, window taps), each
//! kernel's argument table written from its step's signature.
//!
//! `nestor-sim`'s `SimDevice` runs those kernels on a simulated GPU (how the tests check
//! this executor and the GPU's templates without a GPU); the CUDA backend's
//! `CudaDevice` on a GPU.

use std::collections::hash_map::{Entry, HashMap};
use std::sync::Mutex;

use super::product::{BlasCall, Product};
use nestor_ir::Window2d;
use nestor_passes::step::{
    Attention, AttentionGrad, Gather, Gemm, OneHot, PairGemm, SumRows, Window,
};
use nestor_passes::KernelSet;
use nestor_passes::{
    Arg, FloatType, Placement, Program, Signature, Slot, Source, Step, WindowKind,
};

use super::run_state::{check_ids, check_positions, mask_key, rows_of_ids, write_positions};
use super::sizes::{pair_offsets, Sizes};
use super::{within_budget, Executable, InputData, RunData, RunOutput, RunShape, RuntimeError};
use crate::stats::DeviceCounter;
use crate::Stats;

/// Memory and kernel launches of one program's `Complete` kernel set. A device runs its
/// work (copies, launches, BLAS calls) in the order it is queued, as one CUDA stream
/// does, so a run may hand its buffers to the next run as soon as its work is queued.
pub trait KernelDevice {
    /// A buffer of the device.
    type Buffer;
    /// A buffer for `count` f32 values that a step writes whole (what it holds before is
    /// unspecified: NaN on the simulated GPU, the allocator's leftovers on a GPU).
    fn alloc_f32(&self, count: usize) -> Result<Self::Buffer, RuntimeError>;
    /// A buffer for `count` i64 values (uninitialized, as [`Self::alloc_f32`]).
    fn alloc_i64(&self, count: usize) -> Result<Self::Buffer, RuntimeError>;
    /// The f32 values `buffer` has room for (0 for an i64 buffer).
    fn capacity_f32(&self, buffer: &Self::Buffer) -> usize;
    /// The i64 values `buffer` has room for (0 for a float buffer).
    fn capacity_i64(&self, buffer: &Self::Buffer) -> usize;
    /// The device's spare buffers (float ones for steps' outputs and float inputs, i64
    /// ones for a run's staged indices), kept between runs for the next ones to reuse.
    fn spare(&self) -> &Mutex<Vec<Self::Buffer>>;
    /// Copies `values` into the first values of `buffer` (a float buffer, in the
    /// device's storage type), after the work queued before; `values` may be dropped
    /// when this returns.
    fn write_f32(&self, buffer: &mut Self::Buffer, values: &[f32]) -> Result<(), RuntimeError>;
    /// Copies `values` into the first values of `buffer` (an i64 buffer), as
    /// [`Self::write_f32`].
    fn write_i64(&self, buffer: &mut Self::Buffer, values: &[i64]) -> Result<(), RuntimeError>;
    /// A new buffer holding `values`.
    fn upload_f32(&self, values: &[f32]) -> Result<Self::Buffer, RuntimeError> {
        let mut buffer = self.alloc_f32(values.len())?;
        self.write_f32(&mut buffer, values)?;
        Ok(buffer)
    }
    /// A new buffer holding `values`.
    fn upload_i64(&self, values: &[i64]) -> Result<Self::Buffer, RuntimeError> {
        let mut buffer = self.alloc_i64(values.len())?;
        self.write_i64(&mut buffer, values)?;
        Ok(buffer)
    }
    /// The `count` floats at `address` (in the device's storage type), as f32, once the
    /// work queued before has run.
    ///
    /// # Safety
    /// `address` must be a buffer of this device holding `count` floats, alive until the
    /// copy is done.
    unsafe fn download_f32(&self, address: u64, count: usize) -> Result<Vec<f32>, RuntimeError>;
    /// The `count` i64 values at `address`, once the work queued before has run.
    ///
    /// # Safety
    /// `address` must be a buffer of this device holding `count` i64 values, alive until
    /// the copy is done.
    unsafe fn download_i64(&self, address: u64, count: usize) -> Result<Vec<i64>, RuntimeError>;
    /// Waits until the work queued on the device has run.
    fn wait(&self) -> Result<(), RuntimeError>;
    /// The buffer's address, as kernels take it in their argument table.
    fn address(&self, buffer: &Self::Buffer) -> u64;
    /// Runs step `step`'s kernel over `start..end`, its argument table (the addresses
    /// of its buffers, in its template's order) at address `table` of this device; the
    /// work may still run when this returns (a download waits for it).
    ///
    /// # Safety
    /// The table and the buffers it names must be this device's, sized for the step over
    /// the range, and alive until the work is done.
    unsafe fn launch(&self, step: usize, table: u64, range: (i64, i64))
        -> Result<(), RuntimeError>;
    /// Where the device computes GEMM products.
    fn gemms(&self) -> Gemms;
    /// Runs `call` for step `step` on the device's BLAS, `[a, b, c]` the buffers of its
    /// `A`, `B` and `C` (asked only of devices whose [`Self::gemms`] is [`Gemms::Blas`]).
    ///
    /// # Safety
    /// The addresses must be buffers of this device holding [`BlasCall::lengths`] values.
    unsafe fn blas(
        &self,
        step: usize,
        call: &BlasCall,
        buffers: [u64; 3],
    ) -> Result<(), RuntimeError>;
}

/// Where a device computes the products of GEMM steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gemms {
    /// In the GEMM step's own kernel ([`KernelSet::Complete`]): a thread per output
    /// value.
    Kernels,
    /// On the device's BLAS (cuBLAS on a GPU), then a kernel that adds the bias and
    /// applies the epilogue in place ([`KernelSet::DeviceBlas`]); row sums of products
    /// (weight gradients) on the BLAS too.
    Blas,
}

impl Gemms {
    /// The kernel set a device computing GEMM products this way runs.
    pub fn kernel_set(self) -> KernelSet {
        match self {
            Gemms::Kernels => KernelSet::Complete,
            Gemms::Blas => KernelSet::DeviceBlas,
        }
    }
}

fn device_error(step: usize, reason: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Step {
        step,
        reason: reason.to_string(),
    }
}

/// `value` as bf16 bits, rounded to the nearest even (NaN as 0x7FC0): what the kernels'
/// stores do, and torch's conversion.
pub fn to_bf16(value: f32) -> u16 {
    if value.is_nan() {
        return 0x7FC0;
    }
    let bits = value.to_bits();
    let odd = (bits >> 16) & 1;
    (bits.wrapping_add(0x7FFF + odd) >> 16) as u16
}

/// The f32 value of bf16 bits (exact).
pub fn from_bf16(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `value` rounded to the nearest bf16 (ties to even, NaN to bf16's quiet NaN), as an
/// f32: what a bf16 buffer keeps of it.
pub fn round_to_bf16(value: f32) -> f32 {
    from_bf16(to_bf16(value))
}

/// Where a device run may write its results: buffers of the caller on the device (a
/// framework's tensors), so that the run neither allocates nor copies them.
///
/// # Safety
/// An address given for `shape` must be a buffer of the device the run is on, holding as
/// many floats of the device's storage type as the product of the dims, and alive until
/// the run's work is done.
pub unsafe trait DeviceSink {
    /// The device address of a buffer for output `index`, of packed shape `shape`
    /// ([`RunShape::packed`]), or `None` to have the run allocate it.
    fn buffer(&mut self, index: usize, shape: &[i64]) -> Option<u64>;
}

impl Executable {
    /// Runs the program on `device` (an f32 program): buffers on the device, every step
    /// a kernel of the `Complete` set, the results copied back, and the launches, the
    /// step buffers' bytes, the bytes moved and the device's copies counted into
    /// `stats`. Host steps (per-element regions run through libtorch) are an error
    /// naming the step. Inputs in host memory are uploaded; [`InputData::OnDevice`] ones
    /// are read where they are.
    pub fn run_on_device<D: KernelDevice>(
        &self,
        device: &D,
        inputs: &[InputData<'_>],
        stats: &Stats,
    ) -> Result<Vec<RunOutput>, RuntimeError> {
        self.run_device_resident(device, inputs, stats)?
            .download(device, stats)
    }

    /// [`Executable::run_on_device`] without copying the results back: they stay in the
    /// device's buffers, which the returned [`DeviceResults`] keeps; the work may still
    /// be running when this returns ([`KernelDevice::wait`] or a download waits for it).
    /// (`nestor_sim::SimDevice` shows it on the simulated GPU.)
    pub fn run_device_resident<D: KernelDevice>(
        &self,
        device: &D,
        inputs: &[InputData<'_>],
        stats: &Stats,
    ) -> Result<DeviceResults<D::Buffer>, RuntimeError> {
        self.run_device_into(device, inputs, stats, None)
    }

    /// [`Executable::run_device_resident`], every result a step computes written into
    /// the buffer `sink` gives for it (where it gives one): such results are neither
    /// allocated by the run nor copied ([`RunData::Sunk`] when downloaded).
    ///
    /// A run makes one upload of its own (the lengths and other i64 inputs, the offsets,
    /// row maps and other indices its kernels read, and every step's argument table, in
    /// one staged buffer), takes every buffer it needs from the device's spare ones
    /// first, and waits for the device only to download results.
    pub fn run_device_into<D: KernelDevice>(
        &self,
        device: &D,
        inputs: &[InputData<'_>],
        stats: &Stats,
        sink: Option<&mut dyn DeviceSink>,
    ) -> Result<DeviceResults<D::Buffer>, RuntimeError> {
        let program = &self.program;
        if program.float != FloatType::F32 {
            return Err(device_error(
                0,
                "device programs compute in f32 (this one in f64)",
            ));
        }
        let sizes = Sizes::of_run(program, inputs, &mut Vec::new())?;
        // Checks every input's type and size.
        self.input_pointers(inputs, &sizes, true, &mut Vec::new())?;
        let shapes = self.output_shapes(&sizes);
        let (mut external, mut sunk) = (Vec::new(), Vec::new());
        let lists = (&mut external, &mut sunk);
        match sink {
            Some(sink) => self.sink_buffers(
                |index, shape| sink.buffer(index, shape),
                &sizes,
                &shapes,
                lists,
                &mut Vec::new(),
            ),
            None => self.sink_buffers(|_, _| None, &sizes, &shapes, lists, &mut Vec::new()),
        }
        // Every step's arguments and range, planned before anything runs. Every run
        // draws new dropout masks, as on the CPU.
        let run = super::RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (planned, indices, index_values) =
            self.plan_steps(&sizes, inputs, device.gemms().kernel_set(), run)?;
        let staged = (inputs, (&planned[..], &indices, &index_values[..]));
        // A run that fails leaves its buffers to the next (the device runs its work in
        // order, so any still queued runs before theirs).
        let mut memory = DeviceMemory::taking(device, program.slots.len());
        let ran = self
            .device_memory(device, staged, (&sizes, &external), &mut memory, stats)
            .and_then(|()| self.stage(device, staged, &mut memory, stats))
            .and_then(|tables| {
                self.launch_steps(device, (&planned, tables), &memory, &sizes, stats)
            });
        if let Err(error) = ran {
            memory.release(device);
            return Err(error);
        }
        let slot_address = |slot: Slot| memory.addresses[self.root(slot).0 as usize];
        stats.launched(program.steps.len() as u64);
        let outputs = shapes
            .into_iter()
            .zip(sunk)
            .map(|((slot, shape), in_sink)| DeviceOutput {
                address: slot_address(slot),
                len: sizes.elements(program, slot),
                shape,
                dtype: program.info(slot).dtype,
                integers: program.info(slot).integers,
                in_sink,
            })
            .collect();
        Ok(memory.finish(device, program, |slot| self.root(slot), outputs))
    }

    /// Queues every step's BLAS call and kernel, its table at `tables[step]`.
    fn launch_steps<D: KernelDevice>(
        &self,
        device: &D,
        (planned, tables): (&PlannedKernels, Vec<u64>),
        memory: &DeviceMemory<D::Buffer>,
        sizes: &Sizes,
        stats: &Stats,
    ) -> Result<(), RuntimeError> {
        let slot_address = |slot: Slot| memory.addresses[self.root(slot).0 as usize];
        for (step_index, ((kernel, product), table)) in planned.iter().zip(tables).enumerate() {
            if let Some((call, [a, b, c])) = product {
                // `blas_product` checked that the buffers hold what the call reads and
                // writes.
                let buffers = [*a, *b, *c].map(slot_address);
                unsafe { device.blas(step_index, call, buffers)? };
            }
            if let Some(signature) = kernel {
                let range = (0, sizes.rows(signature.range));
                // The buffers were sized from these lengths for this program's steps,
                // the index buffers from the same lengths, and every buffer (tables
                // included) is the run's until its work is done: later work on the
                // device, which reuses them, runs after it.
                unsafe { device.launch(step_index, table, range)? };
            }
            stats.moved(self.bytes_moved(step_index, sizes));
        }
        Ok(())
    }

    /// The device memory of a run: the inputs' buffers (float ones in host memory
    /// uploaded, the caller's on the device as they are; i64 ones are staged later) and
    /// every step's output, in step order: the sink's buffer (`external`, by slot), else
    /// the device's spare buffers where they fit and buffers whose last reader has run
    /// (as on the CPU; the device runs steps in order), else new ones.
    fn device_memory<D: KernelDevice>(
        &self,
        device: &D,
        staged: Staged<'_, '_>,
        (sizes, external): (&Sizes, &[Option<u64>]),
        memory: &mut DeviceMemory<D::Buffer>,
        stats: &Stats,
    ) -> Result<(), RuntimeError> {
        let program = &self.program;
        let inputs = staged.0;
        // The staged values are read by every step: their buffer first, before any
        // buffer is freed for reuse.
        let staging = memory.index_buffer(device, self.staged_values(staged), stats)?;
        memory.staging = Some(staging);
        for (index, info) in program.slots.iter().enumerate() {
            if let Source::Input(input) = info.source {
                memory.addresses[index] = match inputs.get(input) {
                    Some(InputData::F32(values)) => {
                        // Host memory the caller holds: no larger than what it holds.
                        let mut buffer = memory.float_buffer(device, values.len(), stats)?;
                        device.write_f32(&mut buffer, values)?;
                        stats.device(DeviceCounter::Uploads, 1);
                        stats.device(DeviceCounter::BytesUploaded, 4 * values.len() as u64);
                        memory.keep(device, buffer)
                    }
                    Some(&InputData::OnDevice { address, .. }) => address,
                    // i64 inputs are staged with the indices; `input_pointers` accepted
                    // only these for an f32 program.
                    _ => 0,
                };
            }
        }
        for (step_index, step) in program.steps.iter().enumerate() {
            for out in step.outputs() {
                if let Some(address) = external[out.0 as usize] {
                    memory.addresses[out.0 as usize] = address;
                    continue;
                }
                let elements = sizes.elements(program, out);
                // A buffer no larger than the memory budget (a count near i64::MAX from
                // hostile lengths is over it).
                let integers = program.info(out).integers;
                let bytes = if integers { 8 } else { 4 };
                within_budget(step_index, "its output", elements.checked_mul(bytes))?;
                let buffer = match integers {
                    true => memory.index_buffer(device, elements, stats)?,
                    false => memory.float_buffer(device, elements, stats)?,
                };
                memory.addresses[out.0 as usize] = device.address(&buffer);
                memory.owned[out.0 as usize] = Some(buffer);
            }
            for slot in &self.frees[step_index] {
                let freed = memory.owned[slot.0 as usize].take();
                memory.spare.extend(freed);
            }
        }
        Ok(())
    }

    /// How many i64 values a run stages ([`Self::stage`]).
    fn staged_values(&self, (inputs, (planned, _, index_values)): Staged<'_, '_>) -> usize {
        let i64_inputs: usize = self
            .i64_inputs(inputs)
            .map(|(_, values)| values.len())
            .sum();
        let tables: usize = planned
            .iter()
            .filter_map(|(kernel, _)| kernel.as_ref())
            .map(|signature| signature.params.len())
            .sum();
        i64_inputs + index_values.len() + tables
    }

    /// Every slot that is an i64 input given in host memory, with its values.
    fn i64_inputs<'a>(
        &'a self,
        inputs: &'a [InputData<'_>],
    ) -> impl Iterator<Item = (usize, &'a [i64])> + 'a {
        self.program
            .slots
            .iter()
            .enumerate()
            .filter_map(move |(index, info)| match info.source {
                Source::Input(input) => match inputs.get(input) {
                    Some(InputData::I64(values)) => Some((index, *values)),
                    _ => None,
                },
                _ => None,
            })
    }

    /// Stages the run's i64 values in its staging buffer with one upload: the i64 inputs
    /// (their slots' addresses set in `memory`), the index values, and every step's
    /// argument table (which name the buffers and those indices); the address of each
    /// step's table.
    fn stage<D: KernelDevice>(
        &self,
        device: &D,
        (inputs, (planned, indices, index_values)): Staged<'_, '_>,
        memory: &mut DeviceMemory<D::Buffer>,
        stats: &Stats,
    ) -> Result<Vec<u64>, RuntimeError> {
        let mut buffer = memory
            .staging
            .take()
            .ok_or_else(|| device_error(0, "a run without its staging buffer"))?;
        // The buffer was sized for every staged value (`staged_values`).
        let mut staged: Vec<i64> = Vec::with_capacity(device.capacity_i64(&buffer));
        let mut input_positions = Vec::new();
        for (slot, values) in self.i64_inputs(inputs) {
            input_positions.push((slot, staged.len()));
            staged.extend_from_slice(values);
        }
        let index_start = staged.len();
        staged.extend_from_slice(index_values);
        // Positions are below the staged values' count, which the buffer holds, so
        // `8 * position` stays within its addresses.
        let base = device.address(&buffer);
        let at = |position: usize| base + 8 * position as u64;
        for (slot, position) in input_positions {
            memory.addresses[slot] = at(position);
        }
        let mut starts = Vec::with_capacity(planned.len());
        let mut table = Vec::new();
        for (kernel, _) in planned {
            starts.push(at(staged.len()));
            if let Some(signature) = kernel {
                super::marshal::marshal(signature, &mut table, |arg| {
                    Ok::<_, RuntimeError>(match arg {
                        Arg::Buffer(slot) => memory.addresses[self.root(*slot).0 as usize] as i64,
                        Arg::Absent => 0,
                        // Every index an argument names was gathered while planning.
                        index => at(index_start + indices[index]) as i64,
                    })
                })?;
                staged.extend_from_slice(&table);
            }
        }
        device.write_i64(&mut buffer, &staged)?;
        stats.device(DeviceCounter::Uploads, 1);
        stats.device(DeviceCounter::BytesUploaded, 8 * staged.len() as u64);
        memory.kept.push(buffer);
        Ok(starts)
    }

    /// Every step's kernel signature and BLAS call for kernel set `set`, after checking
    /// it against the run; the index buffers the kernels read (offsets, row maps, ...),
    /// each once, at their positions in one list of values.
    fn plan_steps(
        &self,
        sizes: &Sizes,
        inputs: &[InputData<'_>],
        set: KernelSet,
        run: u64,
    ) -> Result<PlannedSteps, RuntimeError> {
        let program = &self.program;
        let mut indices: HashMap<Arg, usize> = HashMap::new();
        let mut index_values: Vec<i64> = Vec::new();
        let mut planned = Vec::with_capacity(program.steps.len());
        for (step_index, step) in program.steps.iter().enumerate() {
            let plan = Plan {
                program,
                sizes,
                inputs,
                step: step_index,
                run,
            };
            plan.check(step)?;
            let placement = step.placement(program, set);
            let product = match placement {
                Placement::Product(_) => Some(plan.blas_product(step)?),
                _ => None,
            };
            let kernel = match placement {
                Placement::Kernel(signature) | Placement::Product(Some(signature)) => {
                    for param in &signature.params {
                        if !matches!(param.arg, Arg::Buffer(_) | Arg::Absent) {
                            if let Entry::Vacant(entry) = indices.entry(param.arg) {
                                entry.insert(index_values.len());
                                index_values.extend(plan.index_values(param.arg)?);
                            }
                        }
                    }
                    Some(signature)
                }
                Placement::Product(None) => None,
                Placement::Backend | Placement::Libtorch => {
                    return Err(device_error(
                        step_index,
                        "a host step (a per-element region run through libtorch, from \
                         `per_element_fallback`) has no device kernel",
                    ))
                }
            };
            planned.push((kernel, product));
        }
        Ok((planned, indices, index_values))
    }
}

/// Every step's kernel signature and BLAS call (with its `A`, `B`, `C` slots).
type PlannedKernel = (Option<Signature>, Option<(BlasCall, [Slot; 3])>);

/// Every step's [`PlannedKernel`].
type PlannedKernels = Vec<PlannedKernel>;

/// What a run stages: its inputs (the i64 ones), and its planned kernels, the positions
/// of their index arguments and those values.
type Staged<'r, 'i> = (
    &'r [InputData<'i>],
    (&'r [PlannedKernel], &'r HashMap<Arg, usize>, &'r [i64]),
);

/// Every step's kernel signature and BLAS call, the position of every index argument in
/// the index values, and those values.
type PlannedSteps = (PlannedKernels, HashMap<Arg, usize>, Vec<i64>);

/// The memory of one device run.
struct DeviceMemory<B> {
    /// Every slot's address on the device (0 for aliases, which use their root's).
    addresses: Vec<u64>,
    /// Uploaded buffers (float inputs, the staged indices and tables).
    kept: Vec<B>,
    /// The buffer of the staged values, until they are staged.
    staging: Option<B>,
    /// The step outputs' buffers, by slot.
    owned: Vec<Option<B>>,
    /// Buffers free for the run's next buffers (then the device's next runs).
    spare: Vec<B>,
}

impl<B> DeviceMemory<B> {
    /// The memory of a run of a program of `slots` slots, holding the device's spare
    /// buffers.
    fn taking<D: KernelDevice<Buffer = B>>(device: &D, slots: usize) -> Self {
        Self {
            addresses: vec![0u64; slots],
            kept: Vec::new(),
            staging: None,
            owned: (0..slots).map(|_| None).collect(),
            spare: std::mem::take(
                &mut *device
                    .spare()
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()),
            ),
        }
    }

    /// Every buffer back to the device's spare ones (a failed run's).
    fn release<D: KernelDevice<Buffer = B>>(mut self, device: &D) {
        self.spare.extend(self.owned.into_iter().flatten());
        self.spare.extend(self.kept);
        self.spare.extend(self.staging);
        device
            .spare()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend(self.spare);
    }

    /// Keeps `buffer` for the run; its address.
    fn keep<D: KernelDevice<Buffer = B>>(&mut self, device: &D, buffer: B) -> u64 {
        let address = device.address(&buffer);
        self.kept.push(buffer);
        address
    }

    /// The smallest spare buffer holding `count` values by `capacity`, else a new one
    /// (`alloc`, counted into `stats`: `bytes` each value).
    fn buffer(
        &mut self,
        (count, bytes): (usize, u64),
        capacity: impl Fn(&B) -> usize,
        alloc: impl FnOnce(usize) -> Result<B, RuntimeError>,
        stats: &Stats,
    ) -> Result<B, RuntimeError> {
        if let Some(position) = super::smallest_fitting(&self.spare, count, capacity) {
            return Ok(self.spare.swap_remove(position));
        }
        let buffer = alloc(count)?;
        stats.allocated((count as u64).saturating_mul(bytes));
        stats.device(DeviceCounter::Allocations, 1);
        Ok(buffer)
    }

    /// A float buffer for `count` values ([`Self::buffer`]).
    fn float_buffer<D: KernelDevice<Buffer = B>>(
        &mut self,
        device: &D,
        count: usize,
        stats: &Stats,
    ) -> Result<B, RuntimeError> {
        self.buffer(
            (count, 4),
            |buffer| device.capacity_f32(buffer),
            |count| device.alloc_f32(count),
            stats,
        )
    }

    /// An i64 buffer for `count` values (at least one; [`Self::buffer`]).
    fn index_buffer<D: KernelDevice<Buffer = B>>(
        &mut self,
        device: &D,
        count: usize,
        stats: &Stats,
    ) -> Result<B, RuntimeError> {
        self.buffer(
            (count.max(1), 8),
            |buffer| device.capacity_i64(buffer),
            |count| device.alloc_i64(count),
            stats,
        )
    }

    /// The run's results: the results' buffers stay with them, the rest are spare for
    /// the device's next run (whose work runs after this run's on the device).
    fn finish<D: KernelDevice<Buffer = B>>(
        mut self,
        device: &D,
        program: &Program,
        root: impl Fn(Slot) -> Slot,
        outputs: Vec<DeviceOutput>,
    ) -> DeviceResults<B> {
        let mut results = Vec::new();
        for output in &program.outputs {
            results.extend(self.owned[root(output.slot()).0 as usize].take());
        }
        self.release(device);
        DeviceResults { outputs, results }
    }
}

/// Where one result of a device run is.
#[derive(Debug)]
pub struct DeviceOutput {
    /// The address of its buffer on the device (an input's own buffer when the program
    /// returns an input, the sink's when it gave one).
    pub address: u64,
    /// Its values (packed rows times the static dims), in the device's storage type.
    pub len: usize,
    /// What the values are.
    pub shape: RunShape,
    /// Element type at the boundary.
    pub dtype: nestor_ir::DType,
    /// Whether its buffer holds i64 values (positions), not floats.
    pub integers: bool,
    /// Whether it is in a buffer the run's [`DeviceSink`] gave.
    pub in_sink: bool,
}

/// The results of a run on a device, left in the device's buffers: this keeps the
/// buffers they are in (dropping it frees them once the device's work is done).
pub struct DeviceResults<B> {
    /// Each result, in the program's output order.
    pub outputs: Vec<DeviceOutput>,
    /// The buffers steps wrote the results to.
    results: Vec<B>,
}

impl<B> DeviceResults<B> {
    /// Copies every result back (after the run's work), as [`Executable::run_on_device`]
    /// returns them (those in a sink's buffers as [`RunData::Sunk`], not copied),
    /// counting the copies into `stats`; the results' buffers become the device's spare
    /// ones.
    pub fn download<D: KernelDevice<Buffer = B>>(
        self,
        device: &D,
        stats: &Stats,
    ) -> Result<Vec<RunOutput>, RuntimeError> {
        let outputs = self
            .outputs
            .into_iter()
            .map(|output| {
                let data = if output.in_sink {
                    RunData::Sunk(output.len)
                } else if output.len == 0 {
                    // Nothing to copy (an empty input's address may be null).
                    match output.integers {
                        true => RunData::I64(Vec::new()),
                        false => RunData::F32(Vec::new()),
                    }
                } else {
                    // The address is a buffer of this run holding `len` values (or an
                    // input the caller vouched for), alive while `self.results` is.
                    let (data, bytes) = match output.integers {
                        true => {
                            let values =
                                unsafe { device.download_i64(output.address, output.len)? };
                            (RunData::I64(values), 8)
                        }
                        false => {
                            let values =
                                unsafe { device.download_f32(output.address, output.len)? };
                            (RunData::F32(values), 4)
                        }
                    };
                    stats.device(DeviceCounter::Downloads, 1);
                    stats.device(DeviceCounter::Synchronizations, 1);
                    stats.device(DeviceCounter::BytesDownloaded, bytes * output.len as u64);
                    data
                };
                Ok(RunOutput {
                    data,
                    shape: output.shape,
                    dtype: output.dtype,
                })
            })
            .collect();
        device
            .spare()
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .extend(self.results);
        outputs
    }
}

/// The arguments and range of a step's kernel in one run.
struct Plan<'a> {
    program: &'a Program,
    sizes: &'a Sizes<'a>,
    inputs: &'a [InputData<'a>],
    step: usize,
    /// The run's number (keys its dropout masks).
    run: u64,
}

impl Plan<'_> {
    fn lengths(&self, slot: Slot) -> Result<&super::sizes::LengthsInfo<'_>, RuntimeError> {
        self.sizes
            .get(slot)
            .ok_or_else(|| device_error(self.step, "a lengths buffer the run does not know"))
    }

    /// The lengths of `first`, which must have as many elements as `second`'s (`what`
    /// names the two in the error).
    fn paired_lengths(
        &self,
        first: Slot,
        second: Slot,
        what: &str,
    ) -> Result<&super::sizes::LengthsInfo<'_>, RuntimeError> {
        let lengths = self.lengths(first)?;
        if lengths.lengths.len() != self.lengths(second)?.lengths.len() {
            return Err(device_error(
                self.step,
                format!("{what} of different batch sizes"),
            ));
        }
        Ok(lengths)
    }

    /// The values of an index argument (offsets, row maps, counts, taps, ...).
    fn index_values(&self, arg: Arg) -> Result<Vec<i64>, RuntimeError> {
        Ok(match arg {
            Arg::Buffer(_) | Arg::Absent => {
                return Err(device_error(self.step, "a buffer is not an index"))
            }
            Arg::Offsets(slot) => self.lengths(slot)?.offsets.clone(),
            Arg::RowMap(map) => {
                let (values, count) = self.sizes.row_map(map).ok_or_else(|| {
                    device_error(self.step, format!("the row map {map:?} cannot be built"))
                })?;
                // SAFETY: `row_map` gives the start and length of values the run keeps.
                unsafe { std::slice::from_raw_parts(values, count) }.to_vec()
            }
            Arg::Longest(slot) => vec![self.lengths(slot)?.longest],
            Arg::PairOffsets(rows, columns) => {
                let (rows, columns) = (self.lengths(rows)?, self.lengths(columns)?);
                pair_offsets(&rows.lengths, &columns.lengths)
                    .ok_or_else(|| device_error(self.step, "the pairs overflow i64"))?
            }
            Arg::Count(rows) => vec![self.sizes.rows(rows)],
            Arg::MaskKey(stream) => vec![mask_key(stream, self.run) as i64],
            Arg::Taps(window, heights, widths) => self.taps(window, heights, widths)?.rows.clone(),
            Arg::WindowsOfPixels(window, heights, widths) => {
                self.windows_of_pixels(window, heights, widths)?
            }
            Arg::RowsOfIds(ids, vocabulary) => self.rows_of_ids(ids, vocabulary)?,
        })
    }

    /// The index of the rows of each id of `ids` ([`rows_of_ids`]): an i64 input, or
    /// positions, which the host computes from their lengths.
    fn rows_of_ids(&self, ids: Slot, vocabulary: i64) -> Result<Vec<i64>, RuntimeError> {
        let table = |values: &[i64]| {
            rows_of_ids(values, vocabulary)
                .ok_or_else(|| device_error(self.step, format!("a table of {vocabulary} rows")))
        };
        if let Some(InputData::I64(values)) = self.input_of(ids) {
            return table(values);
        }
        let lengths = self
            .program
            .positions_of(ids)
            .and_then(|lengths| self.sizes.get(lengths))
            .ok_or_else(|| {
                device_error(
                    self.step,
                    "scattered ids that are neither an i64 input nor positions",
                )
            })?;
        let rows = usize::try_from(lengths.offsets.last().copied().unwrap_or(0)).unwrap_or(0);
        let mut positions = Vec::new();
        positions
            .try_reserve_exact(rows)
            .map_err(|_| device_error(self.step, format!("{rows} positions")))?;
        positions.resize(rows, 0);
        write_positions(&lengths.offsets, &mut positions);
        table(&positions)
    }

    /// The taps of `window` over the images of `heights` and `widths` (the run builds
    /// them once; `window_args` checked their size against the memory budget first).
    fn taps(
        &self,
        window: Window2d,
        heights: Slot,
        widths: Slot,
    ) -> Result<std::sync::Arc<nestor_layout::WindowTaps>, RuntimeError> {
        self.sizes
            .window_taps(window, (heights, widths))
            .map_err(|error| device_error(self.step, error))
    }

    /// Checks that a window step's buffers hold what its kernel reads and writes for
    /// these image sizes, and that its taps fit the memory budget.
    fn check_window(&self, step: &Window) -> Result<(), RuntimeError> {
        let Window {
            kind,
            out,
            x,
            weight,
            bias,
            grad,
            heights,
            widths,
            channels,
            width,
            window,
            groups,
            // Its inputs are sized by the program, as a GEMM's epilogue's.
            epilogue: _,
        } = step;
        let elements = |slot: Slot| self.sizes.elements(self.program, slot);
        let count = |value: i64| usize::try_from(value).unwrap_or(usize::MAX);
        let (channels, width, taps) = (count(*channels), count(*width), count(window.taps()));
        let groups = count(*groups);
        if groups == 0 || channels % groups != 0 || width % groups != 0 {
            return Err(device_error(
                self.step,
                format!("{groups} groups do not divide {channels} channels into {width}"),
            ));
        }
        // A weight's (or its gradient's) values: a block per group.
        let weights = width.saturating_mul(channels) / groups;
        // Rows of `columns` values fill `slot` exactly (kernels index them unchecked).
        let fills = |slot: Slot, rows: usize, columns: usize| {
            if rows.checked_mul(columns) == Some(elements(slot)) {
                Ok(())
            } else {
                Err(device_error(
                    self.step,
                    format!(
                        "{rows} rows of {columns} do not fill the {} values of slot {}",
                        elements(slot),
                        slot.0
                    ),
                ))
            }
        };
        let needed = |slot: Option<Slot>, what: &str| {
            slot.ok_or_else(|| device_error(self.step, format!("a window step without {what}")))
        };
        let images = self
            .paired_lengths(*heights, *widths, "heights and widths")?
            .lengths
            .len();
        let pixels = self.pixels(*heights, *widths)?;
        // Pooling keeps the channels: its kernels write `channels` values per row
        // (a resampling a cell's a channel).
        let cells = count(window.kernel[0]).saturating_mul(count(window.kernel[1]));
        let kept = match kind {
            WindowKind::Conv
            | WindowKind::ConvInputGrad
            | WindowKind::StridedConvInputGrad
            | WindowKind::WeightGrad => width,
            WindowKind::Adaptive | WindowKind::Bilinear { .. } => channels.saturating_mul(cells),
            _ => channels,
        };
        if kept != width {
            return Err(device_error(
                self.step,
                format!("pooling {channels} channels into {width}"),
            ));
        }
        // The images' pixels, or (spread) their means, or (adaptive pooling's gradient)
        // their cells; a strided input gradient's `x` has a row per window (checked
        // below).
        match kind {
            WindowKind::ImageSpread => fills(*x, images, channels)?,
            WindowKind::AdaptiveGrad | WindowKind::BilinearGrad { .. } => {
                fills(*x, images, channels.saturating_mul(cells))?
            }
            WindowKind::StridedConvInputGrad => {}
            _ => fills(*x, pixels, channels)?,
        }
        // The windows (the output's pixels, or its gradient's), `taps` indices each:
        // within the memory budget before the table is built.
        let windows = |pixels_slot: Slot| -> Result<usize, RuntimeError> {
            let rows = self.sizes.rows(self.program.info(pixels_slot).rows);
            let bytes = usize::try_from(rows).ok().and_then(|rows| {
                rows.checked_mul(taps)?
                    .checked_mul(std::mem::size_of::<i64>())
            });
            within_budget(self.step, "window taps", bytes)?;
            let table = self.taps(*window, *heights, *widths)?;
            Ok(table.rows.len() / table.taps.max(1))
        };
        let out = *out;
        match kind {
            WindowKind::ImageMean | WindowKind::Adaptive | WindowKind::Bilinear { .. } => {
                fills(out, images, width)
            }
            WindowKind::ImageSpread
            | WindowKind::AdaptiveGrad
            | WindowKind::BilinearGrad { .. } => fills(out, pixels, width),
            WindowKind::Conv | WindowKind::ConvInputGrad => {
                fills(out, windows(out)?, width)?;
                fills(needed(*weight, "a weight")?, weights, taps)?;
                bias.map_or(Ok(()), |bias| fills(bias, 1, width))
            }
            WindowKind::Max | WindowKind::Average => fills(out, windows(out)?, width),
            WindowKind::WeightGrad => {
                let grad = needed(*grad, "the output's gradient")?;
                fills(grad, windows(grad)?, width)?;
                fills(out, weights, taps)
            }
            WindowKind::MaxGrad | WindowKind::AverageGrad => {
                let grad = needed(*grad, "the output's gradient")?;
                fills(grad, windows(grad)?, channels)?;
                fills(out, pixels, channels)
            }
            WindowKind::StridedConvInputGrad => {
                fills(*x, windows(*x)?, channels)?;
                fills(needed(*weight, "a weight")?, weights, taps)?;
                fills(out, pixels, width)
            }
        }
    }

    /// The BLAS call of a step the device's BLAS computes (a GEMM's product, row sums of
    /// products `a^T b`) and the slots of its `[A, B, C]` (a GEMM's weight, input and
    /// output; the row sums' `b`, `a` and output), after checking that they hold what
    /// the call reads and writes.
    fn blas_product(&self, step: &Step) -> Result<(BlasCall, [Slot; 3]), RuntimeError> {
        let (product, buffers) = match *step {
            Step::Gemm(Gemm {
                out,
                x,
                weight,
                rows,
                k,
                n,
                transposed,
                ..
            }) => (
                Product::Linear {
                    rows: self.sizes.rows(rows),
                    k,
                    n,
                    transposed,
                },
                [weight, x, out],
            ),
            Step::SumRows(SumRows {
                out,
                a: Some(a),
                b,
                times: None,
                plain: None,
                rows,
                m,
                n,
                mean: false,
            }) => (
                Product::RowSums {
                    rows: self.sizes.rows(rows),
                    m,
                    n,
                },
                [b, a, out],
            ),
            _ => return Err(device_error(self.step, "a product of no GEMM")),
        };
        let call = product
            .blas_call()
            .map_err(|error| device_error(self.step, error))?;
        for (slot, needed) in buffers.into_iter().zip(call.lengths()) {
            let held = self.sizes.elements(self.program, slot);
            if held < needed {
                return Err(device_error(
                    self.step,
                    format!(
                        "slot {} holds {held} values, its product reads {needed}",
                        slot.0
                    ),
                ));
            }
        }
        Ok((call, buffers))
    }

    /// The pixels of the images of `heights` and `widths` (`H_i W_i` summed, checked).
    fn pixels(&self, heights: Slot, widths: Slot) -> Result<usize, RuntimeError> {
        let count = |value: i64| usize::try_from(value).ok();
        self.lengths(heights)?
            .lengths
            .iter()
            .zip(self.lengths(widths)?.lengths.iter())
            .try_fold(0usize, |sum, (&h, &w)| {
                sum.checked_add(count(h)?.checked_mul(count(w)?)?)
            })
            .ok_or_else(|| device_error(self.step, "the images' pixels overflow"))
    }

    /// For every input pixel of the images of `heights` and `widths`, the windows of
    /// `window` that read it, in order: `P + 1` positions into the same buffer (pixel
    /// `p`'s windows are at `values[values[p]..values[p + 1]]`), then the windows.
    fn windows_of_pixels(
        &self,
        window: Window2d,
        heights: Slot,
        widths: Slot,
    ) -> Result<Vec<i64>, RuntimeError> {
        let taps = self.taps(window, heights, widths)?;
        let pixels = self.pixels(heights, widths)?;
        // Windows per pixel, then where each pixel's list starts (after the positions).
        let mut starts = vec![0usize; pixels + 1];
        for &source in taps.rows.iter().filter(|&&source| source >= 0) {
            let slot = usize::try_from(source)
                .ok()
                .and_then(|pixel| starts.get_mut(pixel + 1))
                .ok_or_else(|| device_error(self.step, "a tap outside the images"))?;
            *slot += 1;
        }
        starts[0] = pixels + 1;
        for pixel in 1..=pixels {
            starts[pixel] += starts[pixel - 1];
        }
        let total = starts[pixels];
        let mut values: Vec<i64> = Vec::new();
        values
            .try_reserve_exact(total)
            .map_err(|_| device_error(self.step, "the windows of every pixel do not fit"))?;
        values.extend(starts.iter().map(|&start| start as i64));
        values.resize(total, 0);
        // Windows in order, so that each pixel's list is in order.
        let mut next = starts;
        for (r, window_taps) in taps.rows.chunks(taps.taps.max(1)).enumerate() {
            for &source in window_taps.iter().filter(|&&source| source >= 0) {
                // Counted above: every tap inside is a pixel with room left.
                let at = &mut next[source as usize];
                values[*at] = r as i64;
                *at += 1;
            }
        }
        Ok(values)
    }

    /// The caller's data of `slot` when it is an input of the program.
    fn input_of(&self, slot: Slot) -> Option<&InputData<'_>> {
        match self.program.info(slot).source {
            Source::Input(input) => self.inputs.get(input),
            _ => None,
        }
    }

    /// Ids within `0..limit` (or `ignored`) ([`check_ids`]: kernels read rows or
    /// classes by them unchecked): only ids given as inputs can be checked before the
    /// launch.
    fn check_ids(&self, ids: Slot, bounds: (i64, Option<i64>)) -> Result<(), RuntimeError> {
        let Source::Input(input) = self.program.info(ids).source else {
            // Positions within elements: below the longest element's length.
            let lengths = self
                .program
                .positions_of(ids)
                .and_then(|lengths| self.sizes.get(lengths));
            return match lengths {
                Some(info) => check_positions(self.step, &info.lengths, bounds.0),
                None => Err(device_error(
                    self.step,
                    "ids computed on the device cannot be checked yet",
                )),
            };
        };
        match self.inputs.get(input) {
            Some(InputData::I64(values)) => check_ids(input, values, bounds),
            _ => Err(device_error(self.step, "ids that are not i64 values")),
        }
    }

    /// Checks what a step's kernel reads unchecked: ids within their table (gathers,
    /// one-hot rows), lengths of one batch size where a kernel pairs them, a window
    /// step's buffers for its images.
    fn check(&self, step: &Step) -> Result<(), RuntimeError> {
        match step {
            Step::Gather(Gather { table, ids, .. }) => {
                let vocabulary = self.sizes.rows(self.program.info(*table).rows);
                self.check_ids(*ids, (vocabulary, None))
            }
            Step::OneHot(OneHot {
                ids,
                classes,
                ignore,
                ..
            }) => self.check_ids(*ids, (*classes, Some(*ignore))),
            Step::Attention(Attention {
                q_lengths,
                k_lengths,
                ..
            })
            | Step::AttentionGrad(AttentionGrad {
                q_lengths,
                k_lengths,
                ..
            }) => self
                .paired_lengths(*q_lengths, *k_lengths, "queries and keys")
                .map(|_| ()),
            Step::PairGemm(PairGemm { rows, columns, .. }) => self
                .paired_lengths(*rows, *columns, "row and column lengths")
                .map(|_| ()),
            Step::Window(window) => self.check_window(window),
            _ => Ok(()),
        }
    }
}
