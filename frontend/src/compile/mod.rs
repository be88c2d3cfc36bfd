//! `compile`: a model traced once per input structure, optimized, lowered to kernels,
//! JIT-compiled for the host and run by the runtime on batches of any lengths; with
//! [`Compiled::train`], the program also computes the gradients of the model's loss
//! (`train.rs`).

mod device;
mod reasons;
mod train;

pub use device::RunDevice;
pub use nestor_sim::SimOptions;
pub use train::{GradientHook, GradientOf};

use rustc_hash::FxHashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use nestor_passes::{lower_with, FloatType, Limits, LowerOptions, Pipeline, Products};
use nestor_runtime::{
    Executable, HostRunner, HostValue, InputData, OutputSink, RunData, RunDim, RunOutput,
    RunProfile, RunShape, Stats, StatsSnapshot,
};
use tch::{Kind, Tensor};

use crate::error::{CompileCause, CompileReason};
use crate::trace::{
    check_inputs, earlier_equal_lengths, interpret, is_normalized, normalized_inputs,
    parameter_names, trace_named, Bound, Dense, ParameterNames, TraceOutputs, Traced, Value,
};
use crate::{kind_of, NestedError, NestedTensor, Result};
use device::{DeviceInput, Placement, RunResults, Runner};
use train::Gradient;

/// What a compiled program depends on, written as words: the numbers of batches and
/// dense inputs; where it runs (the CPU, the simulated GPU, a GPU); per batch its dtype, whether its values require grad (in training,
/// their gradients are computed), rank, ragged dims, static sizes and, per ragged dim,
/// the earlier dim with equal lengths (traced as one lengths input); per dense input
/// its dtype, rank and dims after the first; per input (batches, then dense), the first
/// with the same batch size (traced as one batch-size symbol). Never lengths. Every
/// list is preceded by its length, so two structures never write the same words.
///
/// Written on every call into a buffer of the calling thread (no allocation, no lengths
/// copied, a cheap hash); a key is made only for a new structure.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct StructureKey(Vec<u64>);

// Hashes as its words do (`Vec`'s hash is its slice's), so the cache is searched by the
// words alone.
impl std::borrow::Borrow<[u64]> for StructureKey {
    fn borrow(&self) -> &[u64] {
        &self.0
    }
}

thread_local! {
    /// The words of the calling thread's last structure key.
    static KEY_WORDS: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl StructureKey {
    /// Writes the words of the key of batches already normalized (`normalized_input`)
    /// and dense inputs into `words` (replacing what they held).
    fn write(
        normalized: &[&NestedTensor],
        dense: &[&Tensor],
        placement: Placement,
        words: &mut Vec<u64>,
    ) {
        words.clear();
        words.reserve(3 + 12 * normalized.len() + 6 * dense.len());
        words.extend([
            normalized.len() as u64,
            dense.len() as u64,
            placement.key_word(),
        ]);
        for (index, batch) in normalized.iter().enumerate() {
            let layout = batch.lay();
            words.extend([
                batch.kind() as u64,
                u64::from(batch.packed().requires_grad()),
                layout.rank() as u64,
                layout.ragged_dims().len() as u64,
            ]);
            words.extend(layout.ragged_dims().iter().map(|&dim| dim as u64));
            words.push(layout.static_sizes().len() as u64);
            words.extend(layout.static_sizes().iter().map(|&size| size as u64));
            words.extend(layout.ragged_dims().iter().map(|&dim| {
                earlier_equal_lengths(normalized, index, dim)
                    .map_or(u64::MAX, |(batch, dim)| ((batch as u64) << 32) | dim as u64)
            }));
        }
        // The dense inputs' batch sizes (no allocation without dense inputs).
        let mut dense_batch = Vec::new();
        for tensor in dense {
            let size = tensor.size();
            dense_batch.push(size.first().copied().unwrap_or(1));
            words.extend([tensor.kind() as u64, size.len() as u64]);
            words.extend(size.iter().skip(1).map(|&size| size as u64));
        }
        // Per input, the first input with its batch size.
        let batch_size = |input: usize| match normalized.get(input) {
            Some(batch) => batch.batch_size() as i64,
            None => dense_batch[input - normalized.len()],
        };
        let inputs = normalized.len() + dense.len();
        for input in 0..inputs {
            let size = batch_size(input);
            let first = (0..input).find(|&known| batch_size(known) == size);
            words.push(first.unwrap_or(input) as u64);
        }
    }

    /// How many batches and dense inputs the structure has.
    fn inputs(&self) -> (u64, u64) {
        (
            self.0.first().copied().unwrap_or(0),
            self.0.get(1).copied().unwrap_or(0),
        )
    }
}

/// Gradients named after their parameters' `VarStore` paths.
pub type NamedGradients = Vec<(String, Tensor)>;

/// A traced graph and its compiled program.
struct Entry {
    traced: Traced,
    executable: Executable,
    /// Where the program runs.
    runner: Runner,
    /// The traced graph's outputs (the program's first outputs: the model's, then batch
    /// statistics; gradients follow).
    outputs: usize,
    /// In training, the parameter of each gradient output, in output order.
    gradients: Vec<Gradient>,
}

/// A compiled model. Call it with batches of any lengths: each new input structure
/// (ragged dims, static sizes, dtypes, the device) is traced and compiled once, then
/// every call with that structure reuses the program. Programs run where the inputs
/// are (the host CPU, or a CUDA GPU), or where [`Compiled::on_device`] says.
pub struct Compiled<F> {
    name: String,
    /// Called only while tracing a new structure (under the cache lock); the mutex makes
    /// `Compiled` shareable between threads for models that are `Send`.
    model: Mutex<F>,
    /// Parameter names by tensor identity, from a `VarStore`.
    names: ParameterNames,
    /// Compute the gradients of the loss (the first output) too.
    training: bool,
    lower_options: LowerOptions,
    optimize: bool,
    /// Where the optimizer stops.
    limits: Limits,
    /// Where every compile writes its stages (`NESTOR_DUMP` by default).
    dump: Option<PathBuf>,
    cache: Mutex<FxHashMap<StructureKey, Arc<Entry>>>,
    stats: Stats,
    /// Where programs run.
    device: RunDevice,
    /// The type of the matrix products' operands, when [`Compiled::autocast`] set it.
    autocast: Option<Kind>,
}

/// Compiles `model` (written against `NestedTensor` and [`Dense`], as for [`trace`](crate::trace())).
/// Nothing is traced until the first call.
///
/// ```
/// use nestor_frontend::{compile, NestedTensor};
/// use tch::{Device, Kind, Tensor};
///
/// let weight = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
/// let ffn = compile("ffn", move |inputs: &[NestedTensor], _: &[nestor_frontend::Dense]| {
///     inputs[0].linear(&weight, None)?.relu()
/// });
/// for lengths in [[3i64, 1], [5, 2]] {
///     let batch = NestedTensor::from_tensors(&[
///         Tensor::randn([lengths[0], 4], (Kind::Float, Device::Cpu)),
///         Tensor::randn([lengths[1], 4], (Kind::Float, Device::Cpu)),
///     ])?;
///     let output = ffn.call(&[&batch], &[])?.remove(0).into_nested()?;
///     assert_eq!(output.shape(), [2, lengths[0], 8]);
/// }
/// assert_eq!(ffn.stats().compiles, 1);
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
pub fn compile<O, F>(name: &str, model: F) -> Compiled<F>
where
    O: TraceOutputs,
    F: Fn(&[NestedTensor], &[Dense]) -> Result<O>,
{
    Compiled {
        name: name.to_owned(),
        model: Mutex::new(model),
        names: ParameterNames::new(),
        training: false,
        lower_options: LowerOptions::default(),
        optimize: true,
        limits: Limits::default(),
        dump: std::env::var_os("NESTOR_DUMP").map(PathBuf::from),
        cache: Mutex::new(FxHashMap::default()),
        stats: Stats::default(),
        device: RunDevice::from_env(),
        autocast: None,
    }
}

impl<O, F> Compiled<F>
where
    O: TraceOutputs,
    F: Fn(&[NestedTensor], &[Dense]) -> Result<O>,
{
    /// Runs per-element regions (convolutions and pooling over elements of different
    /// sizes) through libtorch inside the compiled program, instead of failing to
    /// compile them. Off by default: those regions run element by element.
    pub fn per_element_fallback(mut self, enabled: bool) -> Self {
        self.lower_options.host_per_element = enabled;
        self
    }

    /// Turns the optimizer off (or on again): without it the traced graph is lowered op
    /// by op after DCE and CSE (no e-graph rewrites, so no fused kernels). On by
    /// default; off is the baseline the optimizer is measured against.
    pub fn optimized(mut self, enabled: bool) -> Self {
        self.optimize = enabled;
        self
    }

    /// Stops the optimizer at `limits` (default: [`Limits::default`], which includes
    /// half a second per phase; [`Limits::untimed`] makes the program independent of the
    /// machine's load).
    pub fn optimizer_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Writes every stage of each compile into `dir` (as `NESTOR_DUMP=<dir>` does for
    /// every compile of the process): `<name>.00-traced.nir` (and `.dot`), the joint
    /// graph of training (`00-autodiff.nir`), the graph after each pass
    /// (`<NN>-<pass>.nir`, the optimizer's report at the top of `optimize`), the lowered
    /// program (`lowered.txt`) and the kernels' LLVM IR (`kernels.ll`). Read them with
    /// `nestor-opt`.
    ///
    /// ```
    /// use nestor_frontend::{compile, Dense, NestedTensor};
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let dir = std::env::temp_dir().join(format!("nestor-doc-dump-{}", std::process::id()));
    /// let double = compile("double", |x: &[NestedTensor], _: &[Dense]| &x[0] * 2.0).dump_to(&dir);
    /// let batch = NestedTensor::from_tensors(&[Tensor::ones([3, 2], (Kind::Float, Device::Cpu))])?;
    /// double.call(&[&batch], &[])?;
    /// assert!(dir.join("double.00-traced.nir").exists());
    /// assert!(dir.join("double.06-kernels.ll").exists());
    /// # std::fs::remove_dir_all(&dir).ok();
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn dump_to(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dump = Some(dir.into());
        self
    }

    /// Runs the programs on `device` (default [`RunDevice::Inputs`]: where the inputs
    /// are). [`RunDevice::Simulated`] runs the GPU's kernels on the simulated GPU with
    /// CPU tensors in and out, which is how the GPU path is tested without a GPU:
    ///
    /// ```
    /// use nestor_frontend::{compile, Dense, NestedTensor, RunDevice, SimOptions};
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let weight = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
    /// let model = |x: &[NestedTensor], _: &[Dense]| x[0].linear(&weight, None)?.gelu("none");
    /// let batch = NestedTensor::from_tensors(&[
    ///     Tensor::randn([3, 4], (Kind::Float, Device::Cpu)),
    ///     Tensor::randn([1, 4], (Kind::Float, Device::Cpu)),
    /// ])?;
    /// let on_cpu = compile("ffn", model.clone()).call(&[&batch], &[])?.remove(0).into_nested()?;
    /// let simulated = compile("ffn", model)
    ///     .on_device(RunDevice::Simulated(SimOptions::default()))
    ///     .call(&[&batch], &[])?
    ///     .remove(0)
    ///     .into_nested()?;
    /// assert!(on_cpu.values().allclose(simulated.values(), 1e-5, 1e-5, false));
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    pub fn on_device(mut self, device: RunDevice) -> Self {
        self.device = device;
        self
    }

    /// Mixed precision, as `torch.autocast(device_type="cpu", dtype=torch.bfloat16)`
    /// gives it: with `Kind::BFloat16`, the matrix products of the program (linear
    /// layers and, in training, their gradients) multiply the bf16 roundings of their
    /// operands with f32 sums, on the host's bf16 units (AMX, AVX512-BF16) where it has
    /// them (`nestor_backend_cpu::bf16_path` says). Parameters and batches keep their
    /// types; norms, softmax, losses and reductions compute in f32; training accumulates
    /// f32 gradients into `.grad()`. Results are not rounded to bf16 between ops, so they
    /// are closer to f32 than autocast's. Without this call, products multiply in bf16
    /// when the model's inputs are bf16 (as libtorch multiplies bf16 tensors) and in f32
    /// otherwise; `Kind::Float` multiplies in f32 whatever the inputs (a bf16 model then
    /// computes as an f32 model and rounds its results once). Other kinds are an error
    /// at the first call. Programs on a GPU or the simulated GPU multiply in their
    /// buffers' type.
    ///
    /// ```
    /// use nestor_frontend::{compile, Dense, NestedTensor};
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let weight = Tensor::randn([8, 64], (Kind::Float, Device::Cpu));
    /// let model = |x: &[NestedTensor], _: &[Dense]| x[0].linear(&weight, None);
    /// let batch = NestedTensor::from_tensors(&[
    ///     Tensor::randn([3, 64], (Kind::Float, Device::Cpu)),
    ///     Tensor::randn([5, 64], (Kind::Float, Device::Cpu)),
    /// ])?;
    /// let mixed = compile("mixed", model).autocast(Kind::BFloat16);
    /// let output = mixed.call(&[&batch], &[])?.remove(0).into_nested()?;
    /// // f32 sums of the roundings' products.
    /// let rounded = |t: &Tensor| t.to_kind(Kind::BFloat16).to_kind(Kind::Float);
    /// let expected = rounded(batch.values()).matmul(&rounded(&weight).tr());
    /// assert!(output.values().allclose(&expected, 1e-4, 1e-4, false));
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    pub fn autocast(mut self, kind: Kind) -> Self {
        self.autocast = Some(kind);
        self
    }

    /// Names the parameters in graphs and dumps after their paths in `store`.
    pub fn with_var_store(mut self, store: &tch::nn::VarStore) -> Self {
        self.names = parameter_names(store);
        self
    }

    /// Compiled training: the model's first output is its loss (a float scalar). Every
    /// call then also computes the gradient of the loss with respect to every trainable
    /// parameter (those that require grad) in the same compiled program, and
    /// ACCUMULATES it into the parameter's `.grad()`, as `loss.backward()` would, so
    /// tch's optimizers and `zero_grad` work unchanged; frozen parameters get nothing.
    /// Batches whose values require grad get theirs too, flowing on through libtorch's
    /// autograd to whatever computed them.
    /// Parameters are named after their paths in `store`.
    ///
    /// ```
    /// use nestor_frontend::{compile, Dense, NestedTensor};
    /// use tch::nn::{self, Module, OptimizerConfig};
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let store = nn::VarStore::new(Device::Cpu);
    /// let layer = nn::linear(store.root() / "proj", 4, 1, Default::default());
    /// let step = compile("regression", move |x: &[NestedTensor], _: &[Dense]| {
    ///     let prediction = x[0].linear(&layer.ws, layer.bs.as_ref())?;
    ///     prediction.mse_loss(&x[1], nestor_frontend::LossReduction::Mean)
    /// })
    /// .train(&store);
    /// let mut optimizer = nn::Sgd::default().build(&store, 0.1)?;
    /// let inputs = NestedTensor::from_tensors(&[
    ///     Tensor::randn([3, 4], (Kind::Float, Device::Cpu)),
    ///     Tensor::randn([2, 4], (Kind::Float, Device::Cpu)),
    /// ])?;
    /// let targets = NestedTensor::from_tensors(&[Tensor::ones([3, 1], (Kind::Float, Device::Cpu)),
    ///     Tensor::ones([2, 1], (Kind::Float, Device::Cpu))])?;
    /// let mut losses = Vec::new();
    /// for _ in 0..20 {
    ///     optimizer.zero_grad();
    ///     let loss = step.call(&[&inputs, &targets], &[])?.remove(0).into_dense()?;
    ///     losses.push(loss.double_value(&[]));
    ///     optimizer.step();
    /// }
    /// assert!(losses[19] < losses[0]);
    /// assert_eq!(step.stats().compiles, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn train(mut self, store: &tch::nn::VarStore) -> Self {
        self.names = parameter_names(store);
        self.training = true;
        self
    }

    /// Counters: compiles, cache hits, kernel launches, bytes allocated.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// Starts (or stops) timing every step of the calls that run on the host, for
    /// [`Compiled::take_step_profiles`]: each step's kind, label with the call's sizes,
    /// seconds, the FLOPs of its products and the bytes it moved. Off by default (a
    /// step is then not timed); `NESTOR_PROFILE=1` prints the same timings to stderr
    /// for every compiled call of the process. Runs on a GPU or the simulated GPU are
    /// not timed per step.
    ///
    /// ```
    /// use nestor_frontend::{compile, Dense, NestedTensor, StepKind};
    /// use tch::{Device, Kind, Tensor};
    ///
    /// let weight = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
    /// let model = compile("ffn", |x: &[NestedTensor], _: &[Dense]| {
    ///     x[0].linear(&weight, None)?.relu()
    /// });
    /// let batch = NestedTensor::from_tensors(&[
    ///     Tensor::randn([3, 4], (Kind::Float, Device::Cpu)),
    ///     Tensor::randn([5, 4], (Kind::Float, Device::Cpu)),
    /// ])?;
    /// model.record_steps(true);
    /// model.call(&[&batch], &[])?;
    /// let runs = model.take_step_profiles();
    /// let gemm = runs[0].steps.iter().find(|step| step.kind == StepKind::Gemm).unwrap();
    /// assert_eq!(gemm.flops, 2 * 8 * 4 * 8); // 8 rows of 4 inputs times 8 outputs
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    pub fn record_steps(&self, enabled: bool) {
        self.stats.record_steps(enabled);
    }

    /// The step timings of the calls since the last take ([`Compiled::record_steps`]),
    /// oldest first, one [`RunProfile`] per program run (at most the last 1024).
    pub fn take_step_profiles(&self) -> Vec<RunProfile> {
        self.stats.take_step_profiles()
    }

    /// The optimized graph compiled for these inputs' structure (compiling if needed).
    pub fn graph_text(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<String> {
        Ok(self.entry(nested, dense)?.traced.text())
    }

    /// Runs the compiled model. Results are batches (ragged results) or dense tensors.
    /// In training ([`Compiled::train`]), the gradients are accumulated into the
    /// parameters' `.grad()` as well.
    pub fn call(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<Vec<Value>> {
        let (entry, mut values) = self.run(nested, dense, None)?;
        let gradients = values.split_off(entry.outputs.min(values.len()));
        train::accumulate(&entry.gradients, gradients, nested)?;
        entry.traced.finish_run(values)
    }

    /// In training, the model's outputs and the gradient of every trainable parameter
    /// (named after its `VarStore` path) and of every batch whose values require grad
    /// (named `x<index>`, packed values), returned rather than accumulated. A tensor the
    /// model derives from a parameter outside the trace (a view such as `narrow`, an
    /// expression) is a parameter of its own here, named `param<index>`; [`call`]
    /// accumulates its gradient into the parameter it came from through autograd.
    ///
    /// [`call`]: Compiled::call
    pub fn gradients(
        &self,
        nested: &[&NestedTensor],
        dense: &[&Tensor],
    ) -> Result<(Vec<Value>, NamedGradients)> {
        let (entry, mut values) = self.run(nested, dense, None)?;
        let gradients = values.split_off(entry.outputs.min(values.len()));
        let named = train::named(&entry.gradients, gradients, nested)?;
        Ok((entry.traced.finish_run(values)?, named))
    }

    /// [`Compiled::call`] in training, with `hook` seeing every gradient between its
    /// computation and its accumulation into `.grad()` ([`GradientHook`]): each as soon
    /// as the program has written it, while the rest of the backward still runs, and
    /// all of them before they are accumulated, to change or replace. Without
    /// [`Compiled::train`], `hook` sees nothing.
    ///
    /// ```
    /// use nestor_frontend::{compile, Dense, GradientHook, GradientOf, NestedTensor, Result};
    /// use tch::{nn, Tensor};
    ///
    /// /// Halves every gradient, and keeps the names in the order they came.
    /// struct Halve(Vec<String>);
    /// impl GradientHook for Halve {
    ///     fn ready(&mut self, _: usize, of: GradientOf<'_>, _: &Tensor) -> Result<()> {
    ///         if let GradientOf::Param(name) = of {
    ///             self.0.push(name.to_string());
    ///         }
    ///         Ok(())
    ///     }
    ///     fn finish(&mut self, gradients: &mut [Tensor]) -> Result<()> {
    ///         for gradient in gradients {
    ///             *gradient = &*gradient * 0.5;
    ///         }
    ///         Ok(())
    ///     }
    /// }
    ///
    /// let store = nn::VarStore::new(tch::Device::Cpu);
    /// let w = store.root().ones("w", &[4, 2]);
    /// let model = compile("loss", |x: &[NestedTensor], _: &[Dense]| {
    ///     x[0].linear(&w, None)?.sum(&[], false)?.into_dense_handle()
    /// })
    /// .train(&store);
    /// let batch = NestedTensor::from_tensors(&[Tensor::ones([3, 2], tch::kind::FLOAT_CPU)])?;
    /// let mut hook = Halve(Vec::new());
    /// model.call_with(&[&batch], &[], &mut hook)?;
    /// assert_eq!(hook.0, ["w"]);
    /// // d(sum(x w^T))/dw = 3 (the rows of x summed), halved.
    /// assert_eq!(store.root().get("w").unwrap().grad().double_value(&[0, 0]), 1.5);
    /// # Ok::<(), nestor_frontend::NestedError>(())
    /// ```
    pub fn call_with(
        &self,
        nested: &[&NestedTensor],
        dense: &[&Tensor],
        hook: &mut dyn GradientHook,
    ) -> Result<Vec<Value>> {
        let mut seen: Vec<bool> = Vec::new();
        let mut failure: Option<NestedError> = None;
        let (entry, mut values) = {
            let mut ready = |entry: &Entry, output: usize, tensor: &Tensor| {
                // The model's own outputs come first; gradients follow.
                let Some(index) = output.checked_sub(entry.outputs) else {
                    return;
                };
                let (None, Some(gradient)) = (&failure, entry.gradients.get(index)) else {
                    return;
                };
                seen.resize(entry.gradients.len(), false);
                let result = gradient
                    .shaped(tensor, nested)
                    .and_then(|(_, shaped)| hook.ready(index, gradient.of(), &shaped));
                match result {
                    Ok(()) => seen[index] = true,
                    Err(error) => failure = Some(error),
                }
            };
            self.run(nested, dense, Some(&mut ready))?
        };
        if let Some(error) = failure {
            return Err(error);
        }
        hook.ran();
        let gradients = values.split_off(entry.outputs.min(values.len()));
        let pairs = train::tensors(&entry.gradients, gradients, nested)?;
        for (index, ((_, gradient), of)) in pairs.iter().zip(&entry.gradients).enumerate() {
            if !seen.get(index).copied().unwrap_or(false) {
                hook.ready(index, of.of(), gradient)?;
            }
        }
        let (targets, mut gradients): (Vec<Tensor>, Vec<Tensor>) = pairs.into_iter().unzip();
        hook.finish(&mut gradients)?;
        train::accumulate_into(
            targets.into_iter().zip(gradients).collect(),
            train::Holders::Others,
        )?;
        entry.traced.finish_run(values)
    }

    /// Runs the program: every output, gradients included; on the host, `ready` sees
    /// each result written into a tensor as soon as it is final ([`OutputSink::ready`]).
    ///
    /// A call of a known structure does little besides the run: the structure key
    /// fixes every dtype, rank, static size and shared length the graph's input types
    /// need, so those are checked only when a structure is compiled, and inputs are
    /// borrowed (no tensor is cloned); the runtime still checks every input's size
    /// against its lengths.
    fn run(
        &self,
        nested: &[&NestedTensor],
        dense: &[&Tensor],
        ready: Option<ReadyHook<'_>>,
    ) -> Result<(Arc<Entry>, Vec<Value>)> {
        let placement = Placement::of(self.device, inputs_device(nested, dense)?)?;
        // Batches already as the program takes them (the usual case) are used as they
        // are, without collecting them anew.
        let (owned, renormalized);
        let normalized: &[&NestedTensor] = if nested.iter().all(|batch| is_normalized(batch)) {
            nested
        } else {
            owned = normalized_inputs(nested)?;
            renormalized = owned.iter().map(|batch| &**batch).collect::<Vec<_>>();
            &renormalized
        };
        let (entry, built) = self.entry_of(normalized, nested, dense, placement)?;
        if built {
            let values = entry.traced.bind_normalized(normalized, dense)?;
            check_inputs(entry.traced.graph(), &values)?;
        }
        // Contiguous float / i64 views of the inputs, kept alive while the program runs.
        let float = match entry.executable.program().float {
            FloatType::F32 => Kind::Float,
            FloatType::F64 => Kind::Double,
        };
        // (Loops rather than collecting `Result`s, which cannot size the vectors first.)
        let on = placement.tensors();
        // A device reads and writes its float tensors as it keeps them (bf16 tensors of
        // a bf16 program in place).
        let float = entry.runner.float_kind().unwrap_or(float);
        let bound = entry.traced.bound(normalized, dense)?;
        let mut host = Vec::with_capacity(bound.len());
        for input in bound {
            host.push(match input {
                Bound::Lengths(lengths) => HostInput::Lengths(lengths),
                Bound::Nested(batch) => HostInput::Tensor(host_tensor(batch.packed(), float, on)?),
                Bound::Dense(tensor) => HostInput::Tensor(host_tensor(tensor, float, on)?),
            });
        }
        let (outputs, written) = if entry.runner.is_host() {
            self.run_on_host(&entry, &host, float, ready)?
        } else {
            let inputs: Vec<DeviceInput<'_>> = host
                .iter()
                .map(|input| match input {
                    HostInput::Lengths(lengths) => DeviceInput::Lengths(lengths),
                    HostInput::Tensor(tensor) => DeviceInput::Tensor(tensor.tensor_and_kind().0),
                })
                .collect();
            entry.runner.run(&entry.executable, &inputs, &self.stats)?
        };
        // The tensor each output was written into, if any (outputs that are inputs or
        // aliases were not: they are copied out); the sink gave them in output order.
        let mut written = written.into_iter().peekable();
        let mut values = Vec::with_capacity(outputs.len());
        for (index, output) in outputs.into_iter().enumerate() {
            let tensor = written
                .next_if(|(output, _)| *output == index)
                .map(|(_, tensor)| tensor);
            values.push(output_value(output, tensor, (float, on), normalized)?);
        }
        Ok((entry, values))
    }

    /// Runs `entry`'s program on the host CPU: its outputs, and the tensors the results
    /// were written into, by output.
    fn run_on_host(
        &self,
        entry: &Entry,
        host: &[HostInput<'_>],
        float: Kind,
        ready: Option<ReadyHook<'_>>,
    ) -> Result<RunResults> {
        let mut inputs = Vec::with_capacity(host.len());
        for input in host {
            inputs.push(match input {
                HostInput::Lengths(lengths) => InputData::I64(lengths),
                HostInput::Tensor(tensor) => tensor_data(tensor)?,
            });
        }
        let mut sink = TensorSink {
            kind: float,
            tensors: Vec::with_capacity(entry.executable.program().outputs.len()),
            ready: ready.map(|ready| (entry, ready)),
        };
        let outputs = entry
            .executable
            .run_into(&inputs, &self.stats, Some(&TorchHost), Some(&mut sink))
            .map_err(|error| NestedError::Compile {
                stage: "runtime",
                reason: error.into(),
            })?;
        Ok((outputs, sink.tensors))
    }

    fn entry(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<Arc<Entry>> {
        let placement = Placement::of(self.device, inputs_device(nested, dense)?)?;
        let normalized = normalized_inputs(nested)?;
        let normalized: Vec<&NestedTensor> = normalized.iter().map(|batch| &**batch).collect();
        Ok(self.entry_of(&normalized, nested, dense, placement)?.0)
    }

    /// The entry of batches `nested` (`normalized`: the same, normalized) and `dense`,
    /// and whether it was built now.
    fn entry_of(
        &self,
        normalized: &[&NestedTensor],
        nested: &[&NestedTensor],
        dense: &[&Tensor],
        placement: Placement,
    ) -> Result<(Arc<Entry>, bool)> {
        let mut cache = self
            .cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // A known structure is found by the thread's key words; a new one's key copies
        // them (the borrow ends before anything else can write them).
        let found = KEY_WORDS.with_borrow_mut(|words| {
            StructureKey::write(normalized, dense, placement, words);
            cache
                .get(words.as_slice())
                .cloned()
                .ok_or_else(|| StructureKey(words.clone()))
        });
        let key = match found {
            Ok(entry) => {
                self.stats.hit();
                return Ok((entry, false));
            }
            Err(key) => key,
        };
        // Every structure of one function takes as many inputs as the first.
        if let Some(first) = cache.keys().next() {
            let (expected, got) = (first.inputs(), key.inputs());
            if expected != got {
                return Err(NestedError::InputMismatch {
                    input: "inputs".into(),
                    reason: format!(
                        "{} batches and {} dense tensors given; {} compiled {} and {}",
                        got.0, got.1, self.name, expected.0, expected.1
                    ),
                });
            }
        }
        let requires_grad: Vec<bool> = normalized
            .iter()
            .map(|batch| batch.packed().requires_grad())
            .collect();
        let entry = Arc::new(self.build(nested, dense, &requires_grad, placement)?);
        self.stats.compiled();
        cache.insert(key, Arc::clone(&entry));
        Ok((entry, true))
    }

    /// Traces, differentiates (in training; the gradients of the batches that
    /// `requires_grad` marks too), optimizes, lowers and JIT-compiles the model.
    fn build(
        &self,
        nested: &[&NestedTensor],
        dense: &[&Tensor],
        requires_grad: &[bool],
        placement: Placement,
    ) -> Result<Entry> {
        let model = self
            .model
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut phases = Phases::start();
        let traced = trace_named(
            &self.name,
            nested,
            dense,
            self.names.clone(),
            self.dump.as_deref(),
            |inputs, dense| (*model)(inputs, dense),
        )?;
        phases.done("trace");
        let outputs = traced.graph().outputs.len();
        let (graph, gradients) = if self.training {
            train::joint_graph(&traced, requires_grad)?
        } else {
            (traced.graph().clone(), Vec::new())
        };
        phases.done("autodiff");
        let dump = self.dump.as_deref();
        if let (Some(dir), true) = (dump, self.training) {
            // The joint forward + backward graph, before any pass.
            let path = dir.join(format!("{}.00-autodiff.nir", self.name));
            std::fs::write(&path, nestor_ir::print(&graph)).map_err(|error| {
                NestedError::compile(
                    "dump",
                    CompileCause::Io,
                    format!("{}: {error}", path.display()),
                )
            })?;
        }
        let mut pipeline = if self.optimize {
            Pipeline::optimizing(self.limits)
        } else {
            Pipeline::unoptimized()
        };
        if let Some(dir) = dump {
            pipeline = pipeline.dump_to(dir);
        }
        let optimized = pipeline.run(&graph).map_err(|error| NestedError::Compile {
            stage: "passes",
            reason: error.into(),
        })?;
        phases.done("passes");
        // A GPU's attention gradients read saved statistics (the CPU's need none); the
        // CPU's own code computes self-attention's three gradients at once.
        let on_host = matches!(placement, Placement::Host);
        let lower_options = LowerOptions {
            attention_statistics: !on_host,
            attention_gradients_at_once: on_host,
            fold_epilogues: self.optimize,
            ..self.lower_options
        };
        let mut program =
            lower_with(&optimized, lower_options).map_err(|error| NestedError::Compile {
                stage: "lowering",
                reason: error.into(),
            })?;
        program.gelu_nan_at_infinity = eager_gelu_nan_at_infinity(program.float);
        program.products = products_of(self.autocast, &program)?;
        phases.done("lowering");
        let executable =
            nestor_backend_cpu::executable(program).map_err(|error| NestedError::Compile {
                stage: "backend",
                reason: error.into(),
            })?;
        let runner = Runner::new(placement, &executable)?;
        phases.done("backend");
        phases.report(&self.name);
        if let Some(dir) = dump {
            let stages = pipeline.pass_names().len();
            let write = |suffix: &str, text: String| {
                std::fs::write(
                    dir.join(format!("{}.{:02}-{suffix}", self.name, stages + 1)),
                    text,
                )
                .map_err(|error| NestedError::Compile {
                    stage: "dump",
                    reason: CompileReason::of(CompileCause::Io, error),
                })
            };
            write("lowered.txt", executable.program().to_string())?;
            write("kernels.ll", executable.code().to_owned())?;
        }
        Ok(Entry {
            traced: traced.with_graph(optimized),
            executable,
            runner,
            outputs,
            gradients,
        })
    }
}

/// The operands of `program`'s matrix products: bf16 roundings under a bf16
/// [`Compiled::autocast`] or, without one, for a model with bf16 inputs (as libtorch
/// multiplies bf16 tensors), else the program's float type (always for f64 programs).
fn products_of(autocast: Option<Kind>, program: &nestor_passes::Program) -> Result<Products> {
    let bf16_inputs = program.slots.iter().any(|info| {
        matches!(info.source, nestor_passes::Source::Input(_))
            && info.dtype == nestor_ir::DType::BF16
    });
    let bf16 = match autocast {
        None => bf16_inputs,
        Some(Kind::BFloat16) => true,
        Some(Kind::Float) => false,
        Some(other) => {
            return Err(NestedError::compile(
                "lowering",
                CompileCause::Unsupported,
                format!(
                    "autocast to {other:?}: only Kind::BFloat16 (or Kind::Float, off) is supported"
                ),
            ))
        }
    };
    Ok(if bf16 && program.float == FloatType::F32 {
        Products::Bf16
    } else {
        Products::Float
    })
}

/// Whether this process's eager gelu gives NaN at +inf in `float` (libtorch's AVX-512
/// kernels do, its AVX2 kernels give +inf), so that compiled kernels give what eager
/// does on every CPU. Asked once per type, on a full vector's worth of +inf.
fn eager_gelu_nan_at_infinity(float: FloatType) -> bool {
    static ANSWERS: [OnceLock<bool>; 2] = [OnceLock::new(), OnceLock::new()];
    let (answer, kind) = match float {
        FloatType::F32 => (&ANSWERS[0], Kind::Float),
        FloatType::F64 => (&ANSWERS[1], Kind::Double),
    };
    *answer.get_or_init(|| {
        let _no_grad = tch::no_grad_guard();
        Tensor::f_full([64], f64::INFINITY, (kind, tch::Device::Cpu))
            .and_then(|infinities| infinities.f_gelu("none"))
            .map(|gelu| gelu.double_value(&[0]).is_nan())
            // Without an answer, the math's +inf.
            .unwrap_or(false)
    })
}

/// How long each phase of a compile took, printed to stderr with `NESTOR_PROFILE`.
struct Phases {
    last: std::time::Instant,
    times: Vec<(&'static str, f64)>,
}

impl Phases {
    fn start() -> Self {
        Self {
            last: std::time::Instant::now(),
            times: Vec::new(),
        }
    }

    /// Ends `phase` now.
    fn done(&mut self, phase: &'static str) {
        let now = std::time::Instant::now();
        self.times
            .push((phase, (now - self.last).as_secs_f64() * 1e3));
        self.last = now;
    }

    fn report(&self, name: &str) {
        if std::env::var_os("NESTOR_PROFILE").is_some() {
            let phases: Vec<String> = self
                .times
                .iter()
                .map(|(phase, ms)| format!("{phase} {ms:.1} ms"))
                .collect();
            eprintln!("nestor profile: compile {name}: {}", phases.join(", "));
        }
    }
}

/// The device of the inputs (the CPU without any): an error if they are on different
/// devices (nothing is moved silently).
fn inputs_device(nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<tch::Device> {
    let mut tensors = nested
        .iter()
        .map(|batch| batch.packed())
        .chain(dense.iter().copied())
        .enumerate();
    let Some((_, first)) = tensors.next() else {
        return Ok(tch::Device::Cpu);
    };
    let device = first.device();
    match tensors.find(|(_, tensor)| tensor.device() != device) {
        None => Ok(device),
        Some((input, other)) => Err(NestedError::InputMismatch {
            input: format!("input {input}"),
            reason: format!(
                "is on {:?}, the first input on {device:?}: move every input to one device",
                other.device()
            ),
        }),
    }
}

/// An input of a run as the executor reads it.
enum HostInput<'a> {
    Lengths(Vec<i64>),
    /// A contiguous CPU tensor (`host_tensor`), alive while the program runs.
    Tensor(HostTensor<'a>),
}

/// A contiguous CPU tensor as the program reads it (the caller's, or a converted
/// copy), and its kind: the program's float kind, or i64.
enum HostTensor<'a> {
    Borrowed(&'a Tensor, Kind),
    Converted(Tensor, Kind),
}

impl HostTensor<'_> {
    fn tensor_and_kind(&self) -> (&Tensor, Kind) {
        match self {
            HostTensor::Borrowed(tensor, kind) => (tensor, *kind),
            HostTensor::Converted(tensor, kind) => (tensor, *kind),
        }
    }
}

/// A contiguous tensor of the program's `float` kind (floats and bools) on `on`, the
/// device the program runs with, or of i64 values (integers) on the CPU, where the
/// runtime checks them.
fn host_tensor(tensor: &Tensor, float: Kind, on: tch::Device) -> Result<HostTensor<'_>> {
    let device = tensor.device();
    if device != on {
        return Err(NestedError::compile(
            "device",
            CompileCause::Device,
            format!(
                "an input or parameter is on {device:?}, the program runs with tensors on \
                 {on:?}: move the model and inputs to one device"
            ),
        ));
    }
    let kind = tensor.f_kind()?;
    let (target, target_device) = match kind {
        Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8 => {
            (Kind::Int64, tch::Device::Cpu)
        }
        _ => (float, on),
    };
    if kind == target && device == target_device && tensor.is_contiguous() {
        // Already as the program reads it (the usual case): no dispatch, no clone.
        return Ok(HostTensor::Borrowed(tensor, kind));
    }
    Ok(HostTensor::Converted(
        tensor
            .f_to_device(target_device)?
            .f_to_kind(target)?
            .f_contiguous()?,
        target,
    ))
}

/// The data of a contiguous host tensor, without copying.
fn tensor_data<'a>(host: &'a HostTensor<'_>) -> Result<InputData<'a>> {
    let (tensor, kind) = host.tensor_and_kind();
    let elements = numel(tensor);
    Ok(match kind {
        Kind::Int64 => InputData::I64(slice_of(tensor, elements).unwrap_or(&[])),
        Kind::Double => InputData::F64(slice_of(tensor, elements).unwrap_or(&[])),
        _ => InputData::F32(slice_of(tensor, elements).unwrap_or(&[])),
    })
}

/// The `elements` values of a contiguous CPU tensor whose element type is `T` (`None`
/// for a tensor without data).
fn slice_of<T>(tensor: &Tensor, elements: usize) -> Option<&[T]> {
    let pointer = tensor.data_ptr();
    if elements == 0 || pointer.is_null() || tensor.device() != tch::Device::Cpu {
        return None;
    }
    // The callers made the tensor contiguous on the CPU with element type `T`; the slice
    // borrows the tensor.
    Some(unsafe { std::slice::from_raw_parts(pointer as *const T, elements) })
}

/// The number of values of `tensor`, without allocating its shape (tch's `numel` does:
/// one allocation per input and call).
fn numel(tensor: &Tensor) -> usize {
    let mut shape = [0i64; 8];
    let dims = tensor.dim();
    if dims > shape.len() {
        return tensor.numel();
    }
    // SAFETY: `at_shape` writes the tensor's `dims` sizes, which `shape` has room for.
    unsafe {
        torch_sys::at_shape(
            tensor.as_ptr() as *mut torch_sys::C_tensor,
            shape.as_mut_ptr(),
        )
    };
    shape[..dims].iter().product::<i64>().max(0) as usize
}

/// What sees a program's results as soon as they are final: the entry run and the
/// result's output index and tensor.
type ReadyHook<'a> = &'a mut dyn FnMut(&Entry, usize, &Tensor);

/// Tensors the runtime writes results into (no copy out of its buffers).
struct TensorSink<'e, 'h> {
    kind: Kind,
    /// The tensors given, with the output each is for, in output order.
    tensors: Vec<(usize, Tensor)>,
    /// Told of each result as soon as it is final.
    ready: Option<(&'e Entry, ReadyHook<'h>)>,
}

// SAFETY: every buffer is the data of a new contiguous CPU tensor of `shape` in the
// program's float type (`kind`), kept in `tensors` (so alive) past the run.
unsafe impl OutputSink for TensorSink<'_, '_> {
    fn buffer(&mut self, index: usize, shape: &[i64]) -> Option<*mut u8> {
        let tensor = Tensor::f_empty(shape, (self.kind, tch::Device::Cpu)).ok()?;
        let pointer = tensor.data_ptr() as *mut u8;
        self.tensors.push((index, tensor));
        Some(pointer)
    }

    fn ready(&mut self, index: usize) {
        if let Some((entry, ready)) = &mut self.ready {
            // Given in output order: found by a search.
            if let Ok(at) = self
                .tensors
                .binary_search_by_key(&index, |(output, _)| *output)
            {
                ready(entry, index, &self.tensors[at].1);
            }
        }
    }
}

/// The value of a result: the tensor it was written into (in its packed shape, of the
/// program's `float` kind), or its copied-out data; a ragged result takes the layout of
/// an input batch with the same dims (`inputs`) rather than a new one.
fn output_value(
    output: RunOutput,
    written: Option<Tensor>,
    (float, on): (Kind, tch::Device),
    inputs: &[&NestedTensor],
) -> Result<Value> {
    let (mut values, written_kind) = match (&output.data, written) {
        (RunData::Sunk(_), Some(tensor)) => (tensor, float),
        (RunData::F32(data), _) => (
            Tensor::f_from_slice(data)?
                .f_reshape(output.shape.packed(data.len()))?
                .f_to_device(on)?,
            Kind::Float,
        ),
        (RunData::F64(data), _) => (
            Tensor::f_from_slice(data)?
                .f_reshape(output.shape.packed(data.len()))?
                .f_to_device(on)?,
            Kind::Double,
        ),
        (RunData::I64(data), _) => (
            Tensor::f_from_slice(data)?
                .f_reshape(output.shape.packed(data.len()))?
                .f_to_device(on)?,
            Kind::Int64,
        ),
        (RunData::Sunk(_), None) => {
            return Err(NestedError::compile(
                "runtime",
                CompileCause::Internal,
                "a result was written into a buffer the call did not give",
            ))
        }
    };
    let kind = kind_of(output.dtype);
    if kind != written_kind {
        values = values.f_to_kind(kind)?;
    }
    match output.shape {
        RunShape::Dense(_) | RunShape::Full(_) => Ok(Value::Dense(values)),
        RunShape::Ragged(dims) => match inputs.iter().find(|input| same_dims(input.lay(), &dims)) {
            Some(input) => Ok(Value::Nested(
                input.sharing_layout(values, Default::default()),
            )),
            None => Ok(Value::Nested(nested_from_dims(values, &dims)?)),
        },
    }
}

/// Whether `layout` has exactly `dims` (the same ragged dims, lengths and static sizes).
fn same_dims(layout: &nestor_layout::RaggedLayout, dims: &[RunDim]) -> bool {
    let mut statics = layout.static_dims().iter().zip(layout.static_sizes());
    layout.rank() == dims.len()
        && dims.iter().enumerate().all(|(dim, run_dim)| match run_dim {
            // Static dims come in order: this one must be the layout's next.
            RunDim::Static(size) => statics.next() == Some((&dim, size)),
            RunDim::Ragged(lengths) => {
                layout.ragged_dims().contains(&dim)
                    && layout.element_sizes().len() == lengths.len()
                    && layout
                        .element_sizes()
                        .iter()
                        .zip(lengths)
                        .all(|(sizes, &length)| sizes[dim] == length)
            }
        })
}

/// A batch from packed values and the dims of its elements.
fn nested_from_dims(values: Tensor, dims: &[RunDim]) -> Result<NestedTensor> {
    let batch = dims
        .iter()
        .find_map(|dim| {
            if let RunDim::Ragged(lengths) = dim {
                Some(lengths.len())
            } else {
                None
            }
        })
        .unwrap_or_else(|| values.size().first().copied().unwrap_or(0) as usize);
    let element_sizes: Vec<Vec<i64>> = (0..batch)
        .map(|element| {
            dims.iter()
                .map(|dim| match dim {
                    RunDim::Ragged(lengths) => lengths[element],
                    RunDim::Static(size) => *size,
                })
                .collect()
        })
        .collect();
    let ragged: Vec<usize> = dims
        .iter()
        .enumerate()
        .filter(|(_, dim)| matches!(dim, RunDim::Ragged(_)))
        .map(|(index, _)| index)
        .collect();
    let leading = ragged
        .iter()
        .enumerate()
        .all(|(position, &dim)| position == dim);
    let layout = if batch == 0 && leading {
        // No element to read the rank from: the dims give it, as for an eager empty batch.
        let statics = RunDim::static_sizes(dims);
        nestor_layout::RaggedLayout::from_ragged_sizes(ragged.len(), &[], &statics)?
    } else {
        nestor_layout::RaggedLayout::from_element_sizes(element_sizes, &ragged)?
    };
    if values.size() != layout.packed_shape() {
        return Err(NestedError::compile(
            "runtime",
            CompileCause::Internal,
            format!(
                "a result has shape {:?}, its layout needs {:?}",
                values.size(),
                layout.packed_shape()
            ),
        ));
    }
    Ok(NestedTensor::from_parts(values, layout, Default::default()))
}

/// Runs host steps (per-element regions) with the interpreter, through libtorch.
struct TorchHost;

impl HostRunner for TorchHost {
    fn run(
        &self,
        graph: &nestor_ir::Graph,
        inputs: &[HostValue<'_>],
        out: &mut [f32],
    ) -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let output = interpret(graph, host_values(graph, inputs)?)?
            .into_iter()
            .next()
            .ok_or("the host graph returned nothing")?;
        let packed = match output {
            Value::Nested(nested) => nested.packed().shallow_clone(),
            Value::Dense(tensor) => tensor,
            Value::Lengths(_) => return Err("a host graph returned lengths".into()),
        };
        let flat = packed
            .f_to_kind(Kind::Float)
            .and_then(|t| t.f_contiguous())?;
        if flat.numel() != out.len() {
            return Err(format!(
                "a host step returned {} values, expected {}",
                flat.numel(),
                out.len()
            )
            .into());
        }
        Ok(flat.f_copy_data(out, out.len())?)
    }
}

/// The interpreter's values for a host graph's inputs, built from packed buffers and
/// the inputs' types.
fn host_values(graph: &nestor_ir::Graph, inputs: &[HostValue<'_>]) -> Result<Vec<Value>> {
    use nestor_ir::{Dim, ElemDim, Type};
    let mut lengths_of: std::collections::HashMap<nestor_ir::ValueId, Vec<i64>> =
        Default::default();
    let mut values = Vec::with_capacity(inputs.len());
    for (value, input) in graph.inputs().into_iter().zip(inputs) {
        let ty = graph.ty(value);
        values.push(match (ty, input) {
            (Type::Lengths { .. }, HostValue::Lengths(lengths)) => {
                lengths_of.insert(value, lengths.to_vec());
                Value::Lengths(lengths.to_vec())
            }
            (Type::Ragged { dims, .. }, HostValue::Data(data)) => {
                let run_dims = dims
                    .iter()
                    .map(|dim| match dim {
                        ElemDim::Ragged(lengths) => Ok(RunDim::Ragged(
                            lengths_of.get(lengths).cloned().unwrap_or_default(),
                        )),
                        ElemDim::Fixed(Dim::Static(size)) => Ok(RunDim::Static(*size)),
                        ElemDim::Fixed(other) => Err(NestedError::compile(
                            "host",
                            CompileCause::Internal,
                            format!("dim {other} is not static"),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?;
                let shape: Vec<i64> = std::iter::once(-1)
                    .chain(RunDim::static_sizes(&run_dims))
                    .collect();
                let tensor = if data.is_empty() {
                    Tensor::f_zeros([0], (Kind::Float, tch::Device::Cpu))?
                } else {
                    // SAFETY: `data` outlives the tensor (the interpreter's values are
                    // dropped before `run` returns, and the result is copied out first),
                    // and nothing writes to inputs.
                    unsafe {
                        Tensor::f_from_blob(
                            data.as_ptr() as *const u8,
                            &[data.len() as i64],
                            &[1],
                            Kind::Float,
                            tch::Device::Cpu,
                        )?
                    }
                };
                let tensor = if tensor.numel() == 0 {
                    tensor.f_reshape(
                        shape
                            .iter()
                            .map(|&s| if s < 0 { 0 } else { s })
                            .collect::<Vec<_>>(),
                    )?
                } else {
                    tensor.f_reshape(&shape)?
                };
                Value::Nested(nested_from_dims(tensor, &run_dims)?)
            }
            (Type::Dense { shape, .. }, HostValue::Data(data)) => {
                let shape: Vec<i64> = shape
                    .iter()
                    .map(|dim| dim.as_static().unwrap_or(-1))
                    .collect();
                Value::Dense(Tensor::f_from_slice(data)?.f_reshape(&shape)?)
            }
            (ty, _) => {
                return Err(NestedError::compile(
                    "host",
                    CompileCause::Internal,
                    format!("an input of type {ty} got the wrong kind of buffer"),
                ))
            }
        });
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn batch(lengths: &[i64], width: i64) -> NestedTensor {
        let elements: Vec<Tensor> = lengths
            .iter()
            .map(|&length| Tensor::zeros([length, width], (Kind::Float, Device::Cpu)))
            .collect();
        NestedTensor::from_tensors(&elements).expect("a batch of rows")
    }

    fn key(nested: &[&NestedTensor], dense: &[&Tensor]) -> StructureKey {
        let normalized = normalized_inputs(nested).expect("normalized batches");
        let mut words = Vec::new();
        StructureKey::write(
            &normalized.iter().map(|batch| &**batch).collect::<Vec<_>>(),
            dense,
            Placement::Host,
            &mut words,
        );
        StructureKey(words)
    }

    #[test]
    fn structure_keys_ignore_lengths_but_not_which_lengths_are_shared() {
        let (a, b, c) = (batch(&[3, 1], 4), batch(&[3, 1], 4), batch(&[2, 5], 4));
        let (d, e) = (batch(&[7, 0], 4), batch(&[1, 6], 4));
        // Other lengths, the same sharing: one program.
        assert_eq!(key(&[&a, &b], &[]), key(&[&d, &d], &[]));
        assert_eq!(key(&[&a, &c], &[]), key(&[&d, &e], &[]));
        // Lengths shared or not: two programs.
        assert_ne!(key(&[&a, &b], &[]), key(&[&a, &c], &[]));
        // Static sizes, dtypes, batch sizes and input counts are part of the structure.
        assert_ne!(key(&[&a], &[]), key(&[&batch(&[3, 1], 5)], &[]));
        assert_ne!(
            key(&[&a], &[]),
            key(&[&a.to_kind(Kind::Double).expect("a cast")], &[])
        );
        let dense = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
        let other_batch = Tensor::zeros([5, 3], (Kind::Float, Device::Cpu));
        assert_ne!(key(&[&a], &[&dense]), key(&[&a], &[&other_batch]));
        assert_ne!(key(&[&a], &[]), key(&[&a], &[&dense]));
        assert_eq!(key(&[&a], &[&dense]), key(&[&e], &[&dense]));
    }
}
