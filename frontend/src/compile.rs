//! `compile`: a model traced once per input structure, optimized, lowered to kernels,
//! JIT-compiled for the host and run by the runtime on batches of any lengths.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use nestor_passes::{lower, Pipeline};
use nestor_runtime::{Executable, InputData, RunOutput, Stats, StatsSnapshot};
use tch::{Kind, Tensor};

use crate::trace::{check_inputs, normalized_input, trace, Dense, TraceOutputs, Traced, Value};
use crate::{kind_of, NestedError, NestedTensor, Result};

/// What a compiled program depends on: per batch its rank, ragged dims, static sizes
/// and dtype; per dense input its dims after the first and dtype. Never lengths.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct StructureKey {
    nested: Vec<(Vec<usize>, Vec<i64>, usize, Kind)>,
    dense: Vec<(Vec<i64>, Kind)>,
}

impl StructureKey {
    fn of(nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<Self> {
        let normalized = nested
            .iter()
            .map(|batch| normalized_input(batch))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            nested: normalized
                .iter()
                .map(|batch| {
                    let layout = batch.lay();
                    (
                        layout.ragged_dims().to_vec(),
                        layout.static_sizes().to_vec(),
                        layout.rank(),
                        batch.kind(),
                    )
                })
                .collect(),
            dense: dense
                .iter()
                .map(|tensor| (tensor.size().split_off(1.min(tensor.dim())), tensor.kind()))
                .collect(),
        })
    }
}

/// A traced graph and its compiled program.
struct Entry {
    traced: Traced,
    executable: Executable,
}

/// A model compiled for the host CPU. Call it with batches of any lengths: each new
/// input structure (ragged dims, static sizes, dtypes) is traced and compiled once, then
/// every call with that structure reuses the program.
pub struct Compiled<F> {
    name: String,
    /// Called only while tracing a new structure (under the cache lock); the mutex makes
    /// `Compiled` shareable between threads for models that are `Send`.
    model: Mutex<F>,
    store: Option<tch::nn::VarStore>,
    cache: Mutex<HashMap<StructureKey, Arc<Entry>>>,
    stats: Stats,
}

/// Compiles `model` (written against `NestedTensor` and [`Dense`], as for [`trace`]).
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
        store: None,
        cache: Mutex::new(HashMap::new()),
        stats: Stats::default(),
    }
}

impl<O, F> Compiled<F>
where
    O: TraceOutputs,
    F: Fn(&[NestedTensor], &[Dense]) -> Result<O>,
{
    /// Names the parameters in graphs and dumps after their paths in `store`.
    pub fn with_var_store(mut self, store: &tch::nn::VarStore) -> Self {
        let mut copy = tch::nn::VarStore::new(store.device());
        copy.copy(store).ok();
        self.store = Some(copy);
        self
    }

    /// Counters: compiles, cache hits, kernel launches, bytes allocated.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// The optimized graph compiled for these inputs' structure (compiling if needed).
    pub fn graph_text(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<String> {
        Ok(self.entry(nested, dense)?.traced.text())
    }

    /// Runs the compiled model. Results are batches (ragged results) or dense tensors.
    pub fn call(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<Vec<Value>> {
        let entry = self.entry(nested, dense)?;
        let values = entry.traced.bind(nested, dense)?;
        check_inputs(entry.traced.graph(), &values)?;
        // Contiguous f32 / i64 views of the inputs, kept alive while the program runs.
        let mut keep: Vec<Tensor> = Vec::with_capacity(values.len());
        let mut lengths: Vec<Vec<i64>> = Vec::new();
        let mut order = Vec::with_capacity(values.len());
        for value in &values {
            match value {
                Value::Lengths(values) => {
                    lengths.push(values.clone());
                    order.push((true, lengths.len() - 1));
                }
                Value::Nested(nested) => {
                    keep.push(host_tensor(nested.packed())?);
                    order.push((false, keep.len() - 1));
                }
                Value::Dense(tensor) => {
                    keep.push(host_tensor(tensor)?);
                    order.push((false, keep.len() - 1));
                }
            }
        }
        let inputs = order
            .iter()
            .map(|&(is_lengths, index)| {
                if is_lengths {
                    Ok(InputData::I64(&lengths[index]))
                } else {
                    tensor_data(&keep[index])
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let outputs = entry
            .executable
            .run(&inputs, &self.stats)
            .map_err(|error| NestedError::Compile {
                stage: "runtime",
                reason: error.to_string(),
            })?;
        outputs.into_iter().map(output_value).collect()
    }

    fn entry(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<Arc<Entry>> {
        let key = StructureKey::of(nested, dense)?;
        let mut cache = self
            .cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(entry) = cache.get(&key) {
            self.stats.hit();
            return Ok(Arc::clone(entry));
        }
        let entry = Arc::new(self.build(nested, dense)?);
        self.stats.compiled();
        cache.insert(key, Arc::clone(&entry));
        Ok(entry)
    }

    fn build(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<Entry> {
        let model = self
            .model
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let traced = trace(
            &self.name,
            nested,
            dense,
            self.store.as_ref(),
            |inputs, dense| (*model)(inputs, dense),
        )?;
        let dump = std::env::var_os("NESTOR_DUMP");
        let mut pipeline = Pipeline::default();
        if let Some(dir) = &dump {
            pipeline = pipeline.dump_to(dir);
        }
        let optimized = pipeline
            .run(traced.graph())
            .map_err(|error| NestedError::Compile {
                stage: "passes",
                reason: error.to_string(),
            })?;
        let program = lower(&optimized).map_err(|error| NestedError::Compile {
            stage: "lowering",
            reason: error.to_string(),
        })?;
        let executable = Executable::compile(program).map_err(|error| NestedError::Compile {
            stage: "backend",
            reason: error.to_string(),
        })?;
        if let Some(dir) = &dump {
            let dir = Path::new(dir);
            let stages = pipeline.pass_names().len();
            let write = |suffix: &str, text: String| {
                std::fs::write(
                    dir.join(format!("{}.{:02}-{suffix}", self.name, stages + 1)),
                    text,
                )
                .map_err(|error| NestedError::Compile {
                    stage: "dump",
                    reason: error.to_string(),
                })
            };
            write("lowered.txt", format!("{:#?}", executable.program()))?;
            write("kernels.ll", executable.llvm_ir().to_owned())?;
        }
        Ok(Entry {
            traced: traced.with_graph(optimized),
            executable,
        })
    }
}

/// A contiguous CPU tensor of f32 (floats and bools) or i64 (integers).
fn host_tensor(tensor: &Tensor) -> Result<Tensor> {
    let kind = tensor.f_kind()?;
    let target = match kind {
        Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8 => Kind::Int64,
        _ => Kind::Float,
    };
    let host = tensor
        .f_to_device(tch::Device::Cpu)?
        .f_to_kind(target)?
        .f_contiguous()?;
    Ok(host.f_detach()?)
}

/// The data of a contiguous host tensor, without copying.
fn tensor_data(tensor: &Tensor) -> Result<InputData<'_>> {
    let elements = tensor.numel();
    let pointer = tensor.data_ptr();
    if elements == 0 || pointer.is_null() {
        return Ok(match tensor.kind() {
            Kind::Int64 => InputData::I64(&[]),
            _ => InputData::F32(&[]),
        });
    }
    // `host_tensor` made the tensor contiguous on the CPU with this element type; the
    // slice borrows the tensor, which outlives the run.
    Ok(match tensor.kind() {
        Kind::Int64 => {
            InputData::I64(unsafe { std::slice::from_raw_parts(pointer as *const i64, elements) })
        }
        _ => InputData::F32(unsafe { std::slice::from_raw_parts(pointer as *const f32, elements) }),
    })
}

fn output_value(output: RunOutput) -> Result<Value> {
    let width: i64 = output.tail.iter().product();
    let rows = if width == 0 {
        0
    } else {
        output.data.len() as i64 / width
    };
    let shape: Vec<i64> = std::iter::once(rows)
        .chain(output.tail.iter().copied())
        .collect();
    let mut values = Tensor::f_from_slice(&output.data)?.f_reshape(&shape)?;
    let kind = kind_of(output.dtype);
    if kind != Kind::Float {
        values = values.f_to_kind(kind)?;
    }
    Ok(match output.lengths {
        Some(lengths) => Value::Nested(NestedTensor::packed_with_lengths(&values, &lengths)?),
        None => Value::Dense(values),
    })
}
