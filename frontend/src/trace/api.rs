//! `trace`: run model code on example batches and record it as a graph.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nestor_ir::{Dim, ElemDim, Graph, Op, Type, ValueId};
use tch::Tensor;

use super::interpret::{interpret, Value};
use super::record::{trace_error, RunningStatistics, TraceRef, Tracer};
use super::Dense;
use crate::{dtype_of, NestedError, NestedOptions, NestedTensor, Reduced, Result};

/// Where the value of a graph input comes from when the graph runs.
#[derive(Clone, Debug)]
enum Source {
    /// Nested input `k`.
    Nested(usize),
    /// The sizes of ragged dim `dim` of nested input `k`.
    Lengths(usize, usize),
    /// Dense input `k`.
    Dense(usize),
    /// A parameter, bound to a tensor.
    Param(usize),
}

/// A traced graph, with how to feed it: which inputs are batches, lengths, dense
/// tensors, and the tensors its parameters are bound to. The graph's outputs are the
/// model's, then for every training-mode batch normalization with running statistics
/// the batch's mean, variance and count, which each run folds into the running
/// statistics.
pub struct Traced {
    graph: Graph,
    sources: Vec<(ValueId, Source)>,
    params: Vec<(ValueId, Tensor)>,
    /// Which ragged dims share a lengths input (see [`shared_lengths`]).
    shared: SharedLengths,
    /// How many of the graph's outputs are the model's; each running statistics'
    /// batch mean, variance and count follow them.
    outputs: usize,
    /// What training-mode batch normalizations update after every run (locked while
    /// they are updated, so that concurrent runs update them one at a time).
    running: Mutex<Vec<RunningStatistics>>,
}

/// For every batch, for each of its dims, the earlier `(batch, dim)` whose lengths it
/// equals (ragged dims only). Traced graphs give such dims one lengths input, so ops
/// may combine the batches (`x + y`); calls must then give equal lengths there.
pub(crate) type SharedLengths = Vec<Vec<Option<(usize, usize)>>>;

/// The [`SharedLengths`] of (normalized) batches.
pub(crate) fn shared_lengths(nested: &[&NestedTensor]) -> SharedLengths {
    nested
        .iter()
        .enumerate()
        .map(|(index, batch)| {
            (0..batch.lay().rank())
                .map(|dim| earlier_equal_lengths(nested, index, dim))
                .collect()
        })
        .collect()
}

/// The first `(batch, dim)` before ragged dim `dim` of batch `index` (batches in order,
/// then dims) with the same lengths; `None` for a static dim or new lengths.
pub(crate) fn earlier_equal_lengths(
    nested: &[&NestedTensor],
    index: usize,
    dim: usize,
) -> Option<(usize, usize)> {
    let layout = nested.get(index)?.lay();
    if !layout.is_ragged(dim) {
        return None;
    }
    nested[..index]
        .iter()
        .enumerate()
        .flat_map(|(earlier, batch)| {
            batch
                .lay()
                .ragged_dims()
                .iter()
                .map(move |&earlier_dim| (earlier, earlier_dim))
        })
        .chain(
            layout
                .ragged_dims()
                .iter()
                .take_while(|&&earlier_dim| earlier_dim < dim)
                .map(|&earlier_dim| (index, earlier_dim)),
        )
        .find(|&at| same_lengths(nested, at, (index, dim)))
}

/// Whether dim `a.1` of batch `a.0` and dim `b.1` of batch `b.0` have the same sizes in
/// every element (compared in place: no lengths are copied).
fn same_lengths(nested: &[&NestedTensor], a: (usize, usize), b: (usize, usize)) -> bool {
    let (Some(first), Some(second)) = (nested.get(a.0), nested.get(b.0)) else {
        return false;
    };
    let (first, second) = (first.lay().element_sizes(), second.lay().element_sizes());
    first.len() == second.len()
        && first
            .iter()
            .zip(second)
            .all(|(x, y)| x.get(a.1).is_some_and(|size| Some(size) == y.get(b.1)))
}

// A `Traced` only hands out shallow clones of its parameter tensors (libtorch counts
// references atomically) and never mutates them but the running statistics, which it
// updates under a lock, so threads may share it.
unsafe impl Sync for Traced {}

impl std::fmt::Debug for Traced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text())
    }
}

/// What a traced function may return: NestedTensors, [`Dense`] handles, reduction
/// results, and vectors or pairs of them.
pub trait TraceOutputs {
    /// The traced values, in order (`None` for an untraced one).
    fn trace_refs(&self) -> Vec<Option<TraceRef>>;
}

impl TraceOutputs for NestedTensor {
    fn trace_refs(&self) -> Vec<Option<TraceRef>> {
        vec![self.trace.clone()]
    }
}
impl TraceOutputs for Dense {
    fn trace_refs(&self) -> Vec<Option<TraceRef>> {
        vec![self.trace.clone()]
    }
}
impl TraceOutputs for Reduced {
    fn trace_refs(&self) -> Vec<Option<TraceRef>> {
        match self {
            Reduced::Nested(nested) => nested.trace_refs(),
            Reduced::Dense(dense) => dense.trace_refs(),
        }
    }
}
impl<T: TraceOutputs> TraceOutputs for Vec<T> {
    fn trace_refs(&self) -> Vec<Option<TraceRef>> {
        self.iter().flat_map(TraceOutputs::trace_refs).collect()
    }
}
impl<A: TraceOutputs, B: TraceOutputs> TraceOutputs for (A, B) {
    fn trace_refs(&self) -> Vec<Option<TraceRef>> {
        [self.0.trace_refs(), self.1.trace_refs()].concat()
    }
}

/// Traces `f` on example batches into a graph named `name`.
///
/// `f` receives the batches as traced NestedTensors (batch first) and the dense inputs
/// as traced [`Dense`] handles; it runs eagerly while every operator records itself.
/// Dense tensors it meets that are not inputs (weights, biases) become parameters,
/// named after their path in `store` when given. Lengths become graph inputs, so no
/// concrete length is in the graph. Reading concrete lengths or values (`len()`,
/// `shape()`, `to_list()`, `values()`, `Dense::tensor()`...) fails the trace with an
/// error naming the call, and so does an operator with no IR form.
///
/// Ragged dims whose lengths are equal in the examples share one lengths input, so
/// that ops may combine those batches (`x + y`); running the graph then requires equal
/// lengths there (a typed error otherwise). `compile` keys its programs by this
/// sharing, so it traces again when lengths that were equal differ.
///
/// With `NESTOR_DUMP=<dir>` set, the graph is written to `<dir>/<name>.00-traced.nir`
/// and `.dot`.
///
/// ```
/// use nestor_frontend::{trace, NestedTensor};
/// use tch::{Device, Kind, Tensor};
///
/// let weight = Tensor::randn([8, 4], (Kind::Float, Device::Cpu));
/// let example = NestedTensor::from_tensors(&[
///     Tensor::randn([3, 4], (Kind::Float, Device::Cpu)),
///     Tensor::randn([1, 4], (Kind::Float, Device::Cpu)),
/// ])?;
/// let traced = trace("ffn", &[&example], &[], None, |inputs, _| inputs[0].linear(&weight, None)?.relu())?;
/// assert!(traced.text().contains("relu(%3)"));
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
pub fn trace<O: TraceOutputs>(
    name: &str,
    nested: &[&NestedTensor],
    dense: &[&Tensor],
    store: Option<&tch::nn::VarStore>,
    f: impl FnOnce(&[NestedTensor], &[Dense]) -> Result<O>,
) -> Result<Traced> {
    let names = store.map(parameter_names).unwrap_or_default();
    let dump = std::env::var_os("NESTOR_DUMP").map(PathBuf::from);
    trace_named(name, nested, dense, names, dump.as_deref(), f)
}

/// Parameter names by tensor identity (data pointer, shape): the paths of `store`.
pub(crate) type ParameterNames = HashMap<(usize, Vec<i64>), String>;

/// The [`ParameterNames`] of the variables of `store`.
pub(crate) fn parameter_names(store: &tch::nn::VarStore) -> ParameterNames {
    store
        .variables()
        .into_iter()
        .map(|(name, tensor)| ((tensor.data_ptr() as usize, tensor.size()), name))
        .collect()
}

/// [`trace`] with parameter names already collected.
pub(crate) fn trace_named<O: TraceOutputs>(
    name: &str,
    nested: &[&NestedTensor],
    dense: &[&Tensor],
    names: ParameterNames,
    dump: Option<&Path>,
    f: impl FnOnce(&[NestedTensor], &[Dense]) -> Result<O>,
) -> Result<Traced> {
    let tracer = Arc::new(Mutex::new(Tracer::new(name, names)));
    let mut sources = Vec::new();
    let batch_symbol = BatchSymbols::default();
    let normalized = normalized_inputs(nested)?;
    let shared = shared_lengths(&normalized.iter().map(|batch| &**batch).collect::<Vec<_>>());
    let mut lengths_inputs = HashMap::new();
    let traced_nested = normalized
        .iter()
        .enumerate()
        .map(|(index, input)| {
            let context = InputContext {
                tracer: &tracer,
                batch_symbols: &batch_symbol,
                shared: &shared[index],
            };
            trace_input(&context, index, input, &mut lengths_inputs, &mut sources)
        })
        .collect::<Result<Vec<_>>>()?;
    let traced_dense = dense
        .iter()
        .enumerate()
        .map(|(index, tensor)| trace_dense(&tracer, &batch_symbol, (index, tensor), &mut sources))
        .collect::<Result<Vec<_>>>()?;
    let outputs = f(&traced_nested, &traced_dense);
    let mut state = tracer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    // A concrete read explains whatever failed after it, so it is reported first.
    if let Some(call) = state.concrete_reads.first() {
        return Err(trace_error(
            call,
            "reads concrete lengths or values while tracing; the graph would only be right for this batch".into(),
        ));
    }
    let outputs = outputs?;
    let mut output_values = Vec::new();
    for (position, output) in outputs.trace_refs().into_iter().enumerate() {
        match output {
            Some(output) if Arc::ptr_eq(&output.tracer, &tracer) => {
                output_values.push(output.value)
            }
            _ => {
                return Err(trace_error(
                    "trace",
                    format!(
                        "output {position} is not computed from the inputs by traced operations"
                    ),
                ))
            }
        }
    }
    let outputs = output_values.len();
    let running = std::mem::take(&mut state.running);
    for statistics in &running {
        let batch = statistics.batch;
        output_values.extend([batch.mean, batch.var, batch.count]);
    }
    let mut graph = std::mem::take(&mut state.graph);
    graph.outputs = output_values;
    graph
        .verify()
        .map_err(|error| trace_error("trace", error.to_string()))?;
    for (position, (value, _)) in state.params.iter().enumerate() {
        sources.push((*value, Source::Param(position)));
    }
    let traced = Traced {
        graph,
        sources,
        params: std::mem::take(&mut state.params),
        shared,
        outputs,
        running: Mutex::new(running),
    };
    if let Some(dir) = dump {
        traced.dump(dir, "00-traced")?;
    }
    Ok(traced)
}

/// Dense input `index` of a trace (`tensor`): a graph input whose first dim is a
/// batch-size symbol, and its source.
fn trace_dense(
    tracer: &Arc<Mutex<Tracer>>,
    batch_symbol: &BatchSymbols,
    (index, tensor): (usize, &Tensor),
    sources: &mut Vec<(ValueId, Source)>,
) -> Result<Dense> {
    let kind = tensor.f_kind()?;
    let dtype = dtype_of(kind).ok_or(NestedError::UnsupportedKind {
        element: index,
        kind,
    })?;
    let shape: Vec<Dim> = tensor
        .size()
        .iter()
        .enumerate()
        .map(|(dim, &size)| {
            if dim == 0 {
                batch_symbol.dim(size)
            } else {
                Dim::Static(size)
            }
        })
        .collect();
    let value = add_input(
        tracer,
        format!("dense{index}"),
        Type::Dense { dtype, shape },
    )?;
    sources.push((value, Source::Dense(index)));
    Ok(Dense {
        tensor: tensor.shallow_clone(),
        trace: Some(TraceRef {
            tracer: Arc::clone(tracer),
            value,
        }),
    })
}

/// One batch-size symbol per distinct example batch size (`B`, then `B1`, ...).
#[derive(Default)]
struct BatchSymbols(std::cell::RefCell<Vec<i64>>);

impl BatchSymbols {
    fn dim(&self, size: i64) -> Dim {
        let mut sizes = self.0.borrow_mut();
        let position = sizes
            .iter()
            .position(|&known| known == size)
            .unwrap_or_else(|| {
                sizes.push(size);
                sizes.len() - 1
            });
        Dim::Sym(if position == 0 {
            "B".into()
        } else {
            format!("B{position}")
        })
    }
}

fn add_input(tracer: &Arc<Mutex<Tracer>>, name: String, ty: Type) -> Result<ValueId> {
    let mut state = tracer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    state
        .graph
        .add_declared(Op::Input { name }, ty)
        .map_err(|error| trace_error("trace", error.to_string()))
}

/// What every traced input needs: the tracer, the batch-size symbols, and which of
/// this batch's dims share an earlier batch's lengths.
struct InputContext<'a> {
    tracer: &'a Arc<Mutex<Tracer>>,
    batch_symbols: &'a BatchSymbols,
    shared: &'a [Option<(usize, usize)>],
}

/// A graph input for (normalized) nested input `index`: one lengths input per ragged
/// dim (unless an earlier batch has the same lengths: then its input is reused), then
/// the batch, typed by its static sizes and those lengths.
fn trace_input(
    context: &InputContext<'_>,
    index: usize,
    input: &NestedTensor,
    lengths_inputs: &mut HashMap<(usize, usize), ValueId>,
    sources: &mut Vec<(ValueId, Source)>,
) -> Result<NestedTensor> {
    let InputContext {
        tracer,
        batch_symbols,
        shared,
    } = context;
    let layout = input.lay();
    let dtype = dtype_of(input.kind()).ok_or(NestedError::UnsupportedKind {
        element: 0,
        kind: input.kind(),
    })?;
    let batch = batch_symbols.dim(input.batch_size() as i64);
    let mut dims = Vec::with_capacity(layout.rank());
    let mut statics = layout.static_dims().iter().zip(layout.static_sizes());
    for dim in 0..layout.rank() {
        if layout.is_ragged(dim) {
            let earlier = shared
                .get(dim)
                .copied()
                .flatten()
                .and_then(|at| lengths_inputs.get(&at).copied());
            let lengths = match earlier {
                Some(lengths) => lengths,
                None => {
                    let lengths = add_input(
                        tracer,
                        format!("x{index}.lengths{dim}"),
                        Type::Lengths {
                            batch: batch.clone(),
                        },
                    )?;
                    sources.push((lengths, Source::Lengths(index, dim)));
                    lengths
                }
            };
            lengths_inputs.insert((index, dim), lengths);
            dims.push(ElemDim::Ragged(lengths));
        } else {
            let size = statics.next().map_or(0, |(_, &size)| size);
            dims.push(ElemDim::Fixed(Dim::Static(size)));
        }
    }
    let value = add_input(
        tracer,
        format!("x{index}"),
        Type::Ragged { dtype, batch, dims },
    )?;
    sources.push((value, Source::Nested(index)));
    let mut traced = input.shallow_clone();
    traced.trace = Some(TraceRef {
        tracer: Arc::clone(tracer),
        value,
    });
    Ok(traced)
}

/// Every batch as traced and compiled graphs take it ([`normalized_input`]).
pub(crate) fn normalized_inputs<'a>(
    nested: &[&'a NestedTensor],
) -> Result<Vec<Cow<'a, NestedTensor>>> {
    nested.iter().map(|batch| normalized_input(batch)).collect()
}

/// Whether `input` already is as traced and compiled graphs take it
/// ([`normalized_input`] borrows it).
pub(crate) fn is_normalized(input: &NestedTensor) -> bool {
    !input.lay().ragged_dims().is_empty() && input.options().batch_first
}

/// A batch as traced and compiled graphs take it: batch first; a batch with no ragged
/// dim (sequences of equal lengths) gets its leading dim ragged, so that it shares the
/// structure of batches of other lengths. A batch that already is one is borrowed, not
/// cloned.
pub(crate) fn normalized_input(input: &NestedTensor) -> Result<Cow<'_, NestedTensor>> {
    if is_normalized(input) {
        return Ok(Cow::Borrowed(input));
    }
    let ragged = !input.lay().ragged_dims().is_empty();
    let batch_first = input.with_options(NestedOptions {
        batch_first: true,
        ..input.options()
    });
    if ragged {
        Ok(Cow::Owned(batch_first))
    } else {
        batch_first.ragged_leading().map(Cow::Owned)
    }
}

impl Traced {
    /// The same inputs and parameters with an optimized graph (which keeps the inputs
    /// and parameters, in order).
    pub(crate) fn with_graph(self, graph: Graph) -> Self {
        Self { graph, ..self }
    }

    /// The graph.
    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The graph in the text form.
    pub fn text(&self) -> String {
        nestor_ir::print(&self.graph)
    }

    /// The graph in Graphviz DOT.
    pub fn dot(&self) -> String {
        nestor_ir::to_dot(&self.graph)
    }

    /// For every graph input and parameter, in graph order, the index of the nested
    /// batch it is (`None` for lengths, dense inputs and parameters).
    pub(crate) fn nested_sources(&self) -> Vec<Option<usize>> {
        self.sources
            .iter()
            .map(|(_, source)| match source {
                Source::Nested(index) => Some(*index),
                _ => None,
            })
            .collect()
    }

    /// The tensors the parameters are bound to, by graph value.
    pub fn params(&self) -> &[(ValueId, Tensor)] {
        &self.params
    }

    /// Writes `<dir>/<name>.<stage>.nir` and `.dot`.
    pub fn dump(&self, dir: &Path, stage: &str) -> Result<()> {
        let io = |error: std::io::Error| {
            trace_error(
                "dump",
                format!("cannot write to {}: {error}", dir.display()),
            )
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let stem = format!("{}.{stage}", self.graph.name);
        std::fs::write(dir.join(format!("{stem}.nir")), self.text()).map_err(io)?;
        std::fs::write(dir.join(format!("{stem}.dot")), self.dot()).map_err(io)?;
        Ok(())
    }

    /// Runs the graph op by op with tch (the interpreter) on new batches of the same
    /// structure (any lengths) and dense inputs, with the bound parameters.
    /// Training-mode batch normalizations update their running statistics.
    pub fn run(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<Vec<Value>> {
        self.finish_run(interpret(&self.graph, self.bind(nested, dense)?)?)
    }

    /// The model's outputs of a run's `values` (every output of the traced graph),
    /// once the batch statistics after them are folded into the running statistics.
    pub(crate) fn finish_run(&self, mut values: Vec<Value>) -> Result<Vec<Value>> {
        let statistics = values.split_off(self.outputs.min(values.len()));
        // Runs return every output, so no statistics means a graph without running
        // ones (all but training-mode batch norms): no lock on its calls.
        if statistics.is_empty() {
            return Ok(values);
        }
        let running = self
            .running
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if statistics.len() != 3 * running.len() {
            return Err(trace_error(
                "batch_norm",
                format!(
                    "{} running statistics to update but {} batch statistics",
                    running.len(),
                    statistics.len()
                ),
            ));
        }
        for (running, batch) in running.iter().zip(statistics.chunks_exact(3)) {
            running.update(&batch[0], &batch[1], &batch[2])?;
        }
        Ok(values)
    }

    /// The value of every graph input (inputs and parameters, in graph order) for these
    /// batches and dense inputs.
    pub fn bind(&self, nested: &[&NestedTensor], dense: &[&Tensor]) -> Result<Vec<Value>> {
        let normalized = normalized_inputs(nested)?;
        self.bind_normalized(
            &normalized.iter().map(|batch| &**batch).collect::<Vec<_>>(),
            dense,
        )
    }

    /// [`Traced::bind`] of batches already normalized (`normalized_input`).
    pub(crate) fn bind_normalized(
        &self,
        normalized: &[&NestedTensor],
        dense: &[&Tensor],
    ) -> Result<Vec<Value>> {
        self.check_shared_lengths(normalized)?;
        let bound = self.bound(normalized, dense)?;
        // Checked here, when a structure is first bound, rather than on every run:
        // the graph does not change after it.
        if bound.len() != self.graph.inputs().len() {
            return Err(trace_error(
                "run",
                "the graph's inputs no longer match the traced inputs".into(),
            ));
        }
        Ok(bound
            .into_iter()
            .map(|input| match input {
                Bound::Nested(batch) => Value::Nested(batch.shallow_clone()),
                Bound::Lengths(lengths) => Value::Lengths(lengths),
                Bound::Dense(tensor) => Value::Dense(tensor.shallow_clone()),
            })
            .collect())
    }

    /// What every graph input (inputs and parameters, in graph order) is bound to for
    /// these normalized batches and dense inputs, borrowed (no tensor is cloned). The
    /// caller checks that dims traced with shared lengths still share them (a compiled
    /// program's structure key does) and, once per structure, that the graph takes as
    /// many inputs ([`Traced::bind_normalized`]).
    pub(crate) fn bound<'a>(
        &'a self,
        normalized: &[&'a NestedTensor],
        dense: &[&'a Tensor],
    ) -> Result<Vec<Bound<'a>>> {
        // Sources are in the order of the graph's inputs, which passes keep.
        let mut inputs = Vec::with_capacity(self.sources.len());
        for (_, source) in &self.sources {
            let input = match source {
                Source::Nested(index) => Bound::Nested(input_at(normalized, *index)?),
                Source::Lengths(index, dim) => {
                    let layout = input_at(normalized, *index)?.lay();
                    Bound::Lengths(layout.dim_sizes(*dim).ok_or_else(|| {
                        NestedError::InputMismatch {
                            input: format!("x{index}"),
                            reason: format!("elements of rank {} have no dim {dim}", layout.rank()),
                        }
                    })?)
                }
                Source::Dense(index) => {
                    Bound::Dense(
                        dense
                            .get(*index)
                            .ok_or_else(|| NestedError::InputMismatch {
                                input: format!("dense{index}"),
                                reason: "missing".into(),
                            })?,
                    )
                }
                Source::Param(position) => Bound::Dense(&self.params[*position].1),
            };
            inputs.push(input);
        }
        Ok(inputs)
    }
}

/// What a graph input is bound to in a run ([`Traced::bound`]).
pub(crate) enum Bound<'a> {
    /// A batch's packed values (the input is the batch).
    Nested(&'a NestedTensor),
    /// The sizes of a ragged dim of a batch.
    Lengths(Vec<i64>),
    /// A dense input or a parameter.
    Dense(&'a Tensor),
}

impl Traced {
    /// Dims traced with one shared lengths input must have equal lengths again.
    fn check_shared_lengths(&self, nested: &[&NestedTensor]) -> Result<()> {
        for (index, dims) in self.shared.iter().enumerate() {
            for (dim, earlier) in dims.iter().enumerate() {
                let Some((first, first_dim)) = *earlier else {
                    continue;
                };
                if !same_lengths(nested, (index, dim), (first, first_dim)) {
                    return Err(NestedError::InputMismatch {
                        input: format!("x{index}"),
                        reason: format!(
                            "the lengths of dim {dim} differ from those of x{first} dim {first_dim}, which the graph shares (traced with equal lengths)"
                        ),
                    });
                }
            }
        }
        Ok(())
    }
}

fn input_at<'a>(nested: &[&'a NestedTensor], index: usize) -> Result<&'a NestedTensor> {
    nested
        .get(index)
        .copied()
        .ok_or_else(|| NestedError::InputMismatch {
            input: format!("x{index}"),
            reason: format!(
                "the graph takes at least {} batches, {} given",
                index + 1,
                nested.len()
            ),
        })
}
