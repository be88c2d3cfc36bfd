//! Data-parallel compiled training: every rank runs the compiled training step on its
//! own batch; the gradients are all-reduced in buckets, each launched as soon as the
//! backward has produced its gradients, and normalized by the global token count.

use std::collections::HashMap;

use nestor_frontend::{
    Compiled, Dense, GradientHook, GradientOf, NestedError, NestedTensor, TraceOutputs, Value,
};
use tch::{Kind, Tensor};

use crate::error::{DistributedError, Result};
use crate::group::{Pending, ProcessGroup, ReduceOp};

/// The first bucket's size: small, so that communication starts early (as PyTorch DDP's).
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;
/// Every other bucket's size (PyTorch DDP's `bucket_cap_mb`: 25 MiB).
pub const BUCKET_BYTES: usize = 25 << 20;

/// What the last [`DataParallel::step`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// The tokens of every rank's batch.
    pub global_tokens: f64,
    /// The buckets all-reduced.
    pub buckets: usize,
    /// Those launched while the compiled program still ran (as soon as their gradients
    /// were computed); the others were launched after it.
    pub launched_early: usize,
    /// Seconds this rank waited for the reductions after its program ran: the
    /// communication the backward did not hide.
    pub wait_seconds: f64,
}

/// One trainable parameter: where its gradient goes in the buckets.
struct Param {
    name: String,
    tensor: Tensor,
    bucket: usize,
    /// Its first value in the bucket.
    offset: i64,
    numel: i64,
}

/// A flat buffer that one all-reduce sums: the gradients of consecutive parameters.
struct Bucket {
    flat: Tensor,
    /// The parameters in the bucket.
    params: Vec<usize>,
}

/// Trains a compiled model on several processes, each with its own batches, as one
/// process would on the union of their batches: after [`DataParallel::step`], every
/// rank's `.grad()` holds the gradient of (the sum of every rank's token losses) /
/// (the global token count), whatever each rank's share of the tokens.
///
/// At construction, the ranks check that they train the same model (names, shapes and
/// kinds of the trainable parameters) and take rank 0's parameter values. The model's
/// loss is the mean over the `tokens` of the rank's batch (a `Mean` cross entropy).
///
/// ```no_run
/// use nestor_distributed::{DataParallel, ProcessGroup};
/// use nestor_frontend::{compile, Dense, LossReduction, NestedTensor};
/// use tch::nn::{self, OptimizerConfig};
///
/// let group = ProcessGroup::from_env()?;
/// let store = nn::VarStore::new(tch::Device::Cpu);
/// let w = store.root().randn("w", &[16, 8], 0.0, 0.1);
/// let step = compile("loss", |x: &[NestedTensor], _: &[Dense]| {
///     x[0].linear(&w, None)?.cross_entropy(&x[1], -100, 0.0, LossReduction::Mean)?.into_dense_handle()
/// })
/// .train(&store);
/// let mut parallel = DataParallel::new(&group, &store)?;
/// let mut sgd = nn::Sgd::default().build(&store, 0.1)?;
/// // This rank's batch: two sequences of features and their classes.
/// let ragged = |tensors: &[tch::Tensor]| NestedTensor::builder().ragged_dims(&[0]).tensors(tensors);
/// let inputs = ragged(&[tch::Tensor::randn([5, 8], tch::kind::FLOAT_CPU), tch::Tensor::randn([2, 8], tch::kind::FLOAT_CPU)])?;
/// let targets = ragged(&[tch::Tensor::from_slice(&[1i64, 4, 0, 9, 3]), tch::Tensor::from_slice(&[7i64, 2])])?;
/// sgd.zero_grad();
/// let tokens = targets.values().numel();
/// parallel.step(&step, &[&inputs, &targets], &[], tokens)?;
/// sgd.step();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct DataParallel<'g> {
    group: &'g ProcessGroup,
    params: Vec<Param>,
    by_name: HashMap<String, usize>,
    buckets: Vec<Bucket>,
    last: StepStats,
}

impl<'g> DataParallel<'g> {
    /// Data-parallel training of `store`'s trainable parameters on `group`, with
    /// PyTorch DDP's bucket sizes (1 MiB first, then 25 MiB). Collective: every rank
    /// calls it.
    pub fn new(group: &'g ProcessGroup, store: &tch::nn::VarStore) -> Result<Self> {
        Self::with_buckets(group, store, FIRST_BUCKET_BYTES, BUCKET_BYTES)
    }

    /// [`DataParallel::new`] with buckets of `first` bytes, then `rest` bytes (a
    /// parameter larger than a bucket has one of its own).
    pub fn with_buckets(
        group: &'g ProcessGroup,
        store: &tch::nn::VarStore,
        first: usize,
        rest: usize,
    ) -> Result<Self> {
        let named = store.variables();
        let name_of: HashMap<usize, &String> = named
            .iter()
            .map(|(name, tensor)| (tensor.data_ptr() as usize, name))
            .collect();
        // Creation order is the forward's, so the reverse is about the order in which
        // the backward produces the gradients (PyTorch DDP buckets the same way).
        let mut params = Vec::new();
        for tensor in store.trainable_variables().into_iter().rev() {
            let name = name_of
                .get(&(tensor.data_ptr() as usize))
                .map(|name| name.to_string())
                .ok_or_else(|| {
                    DistributedError::Invalid(format!(
                        "a trainable variable of shape {:?} has no name in its VarStore",
                        tensor.size()
                    ))
                })?;
            params.push(Param {
                name,
                numel: tensor.numel() as i64,
                tensor,
                bucket: 0,
                offset: 0,
            });
        }
        check_same_model(group, &params)?;
        broadcast_values(group, &params)?;
        let buckets = plan_buckets(&mut params, first, rest)?;
        let by_name = params
            .iter()
            .enumerate()
            .map(|(index, param)| (param.name.clone(), index))
            .collect();
        Ok(Self {
            group,
            params,
            by_name,
            buckets,
            last: StepStats::default(),
        })
    }

    /// The median seconds of `repeats` reductions of the buckets alone (no program
    /// running), as a step launches them: what communication costs when nothing hides
    /// it. Collective; the buckets' contents are lost (a step overwrites them).
    pub fn time_reduction(&mut self, repeats: usize) -> Result<f64> {
        let mut seconds = Vec::with_capacity(repeats);
        for _ in 0..repeats.max(1) {
            let started = std::time::Instant::now();
            let launched = self
                .buckets
                .iter()
                .map(|bucket| self.group.all_reduce(&bucket.flat, ReduceOp::Sum))
                .collect::<Result<Vec<_>>>()?;
            for pending in launched {
                pending.wait()?;
            }
            seconds.push(started.elapsed().as_secs_f64());
        }
        seconds.sort_by(f64::total_cmp);
        Ok(seconds[seconds.len() / 2])
    }

    /// What the last step did: the global token count, and how much of its
    /// communication the backward hid.
    pub fn last_step(&self) -> StepStats {
        self.last
    }

    /// The number of buckets the gradients are reduced in.
    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// One training step on this rank's batch (`nested`, `dense`) of `tokens` tokens
    /// (those the model's mean loss is over; 0 is allowed: the rank then adds nothing):
    /// runs `model` (compiled with [`Compiled::train`]), all-reduces the gradients in
    /// buckets while its backward runs, and accumulates the gradient of the global
    /// token-mean loss into `.grad()`. Returns the model's outputs on this rank (its
    /// loss first: the mean over this rank's tokens). Collective: every rank calls it,
    /// the same number of times.
    pub fn step<O, F>(
        &mut self,
        model: &Compiled<F>,
        nested: &[&NestedTensor],
        dense: &[&Tensor],
        tokens: usize,
    ) -> Result<Vec<Value>>
    where
        O: TraceOutputs,
        F: Fn(&[NestedTensor], &[Dense]) -> nestor_frontend::Result<O>,
    {
        // On the buckets' device (NCCL reduces CUDA tensors only).
        let device = self
            .buckets
            .first()
            .map_or(tch::Device::Cpu, |bucket| bucket.flat.device());
        let count = Tensor::from_slice(&[tokens as f64]).f_to_device(device)?;
        let counted = self.group.all_reduce(&count, ReduceOp::Sum)?;
        let mut hook = Reduction {
            group: self.group,
            params: &self.params,
            by_name: &self.by_name,
            buckets: &self.buckets,
            tokens: tokens as f64,
            weight: Tensor::from(tokens as f64),
            counted: Some(counted),
            count: &count,
            filled: vec![0; self.buckets.len()],
            written: vec![false; self.params.len()],
            launched: Vec::with_capacity(self.buckets.len()),
            gradient_params: Vec::new(),
            failure: None,
            stats: StepStats {
                buckets: self.buckets.len(),
                ..StepStats::default()
            },
        };
        let values = model.call_with(nested, dense, &mut hook);
        if let Some(error) = hook.failure.take() {
            return Err(error);
        }
        self.last = hook.stats;
        Ok(values?)
    }
}

/// A step's reduction: the [`GradientHook`] that copies the gradients into their
/// buckets, launches each bucket's all-reduce when it is full (in bucket order, the same
/// on every rank), and hands the reduced gradients back.
struct Reduction<'a, 'g> {
    group: &'g ProcessGroup,
    params: &'a [Param],
    by_name: &'a HashMap<String, usize>,
    buckets: &'a [Bucket],
    /// This rank's tokens.
    tokens: f64,
    /// The same, as a tensor each gradient is multiplied by on its way into its bucket.
    weight: Tensor,
    /// The global token count's reduction, until waited for.
    counted: Option<Pending<'g>>,
    count: &'a Tensor,
    /// The gradients written into each bucket.
    filled: Vec<usize>,
    /// Whether each parameter's gradient was written.
    written: Vec<bool>,
    /// The buckets launched, in order.
    launched: Vec<Pending<'g>>,
    /// The parameter of each gradient of the call (`None`: a batch's).
    gradient_params: Vec<Option<usize>>,
    /// The first error, for the caller (the hook's own errors are `NestedError`s).
    failure: Option<DistributedError>,
    stats: StepStats,
}

impl Reduction<'_, '_> {
    /// Launches the all-reduce of every full bucket after those already launched.
    fn launch_full(&mut self) -> Result<()> {
        while let Some(bucket) = self.buckets.get(self.launched.len()) {
            if self.filled[self.launched.len()] < bucket.params.len() {
                break;
            }
            self.launch_next()?;
        }
        Ok(())
    }

    /// Launches the next bucket, the slots of parameters without a gradient zeroed (all
    /// of them for a rank without tokens: the mean loss of no tokens is NaN, and so is
    /// its gradient).
    fn launch_next(&mut self) -> Result<()> {
        let bucket = &self.buckets[self.launched.len()];
        let mut flat = bucket.flat.shallow_clone();
        if self.tokens == 0.0 {
            let _ = flat.f_zero_()?;
        } else {
            for &param in &bucket.params {
                if !self.written[param] {
                    let param = &self.params[param];
                    let _ = flat.f_narrow(0, param.offset, param.numel)?.f_zero_()?;
                }
            }
        }
        let pending = self.group.all_reduce(&bucket.flat, ReduceOp::Sum)?;
        self.launched.push(pending);
        Ok(())
    }

    /// Records `error` for the caller and returns a `NestedError` that stops the call.
    fn failed(&mut self, error: DistributedError) -> NestedError {
        let message = error.to_string();
        self.failure.get_or_insert(error);
        // The caller returns `failure` instead.
        NestedError::Unsupported {
            op: "data-parallel reduction",
            reason: message,
        }
    }
}

impl GradientHook for Reduction<'_, '_> {
    fn ready(
        &mut self,
        index: usize,
        of: GradientOf<'_>,
        gradient: &Tensor,
    ) -> nestor_frontend::Result<()> {
        if self.gradient_params.len() <= index {
            self.gradient_params.resize(index + 1, None);
        }
        let GradientOf::Param(name) = of else {
            return Ok(());
        };
        let Some(&param) = self.by_name.get(name) else {
            return Err(self.failed(DistributedError::Invalid(format!(
                "the compiled step has a gradient for {name}, which is not a trainable \
                 variable of the VarStore (a tensor the model derives from a parameter \
                 outside the trace): data-parallel training reduces VarStore parameters only"
            ))));
        };
        self.gradient_params[index] = Some(param);
        let info = &self.params[param];
        // Into its slot, times this rank's tokens, in one pass.
        let copied = self.buckets[info.bucket]
            .flat
            .f_narrow(0, info.offset, info.numel)
            .and_then(|slot| gradient.f_reshape([-1])?.f_mul_out(&slot, &self.weight));
        if let Err(error) = copied {
            return Err(self.failed(error.into()));
        }
        if !self.written[param] {
            self.written[param] = true;
            self.filled[info.bucket] += 1;
        }
        self.launch_full().map_err(|error| self.failed(error))
    }

    fn ran(&mut self) {
        self.stats.launched_early = self.launched.len();
    }

    fn finish(&mut self, gradients: &mut [Tensor]) -> nestor_frontend::Result<()> {
        let result = (|| -> Result<()> {
            while self.launched.len() < self.buckets.len() {
                self.launch_next()?;
            }
            let started = std::time::Instant::now();
            if let Some(counted) = self.counted.take() {
                counted.wait()?;
            }
            let global = self.count.f_double_value(&[0])?;
            for pending in self.launched.drain(..) {
                pending.wait()?;
            }
            self.stats.wait_seconds = started.elapsed().as_secs_f64();
            self.stats.global_tokens = global;
            for (gradient, param) in gradients.iter_mut().zip(&self.gradient_params) {
                // No tokens anywhere: every loss was empty, and so is its gradient.
                let scale = if global > 0.0 { 1.0 / global } else { 0.0 };
                *gradient = match param {
                    Some(param) => {
                        let info = &self.params[*param];
                        // In place: the bucket's slot is the gradient handed back.
                        let mut slot =
                            self.buckets[info.bucket]
                                .flat
                                .f_narrow(0, info.offset, info.numel)?;
                        let _ = slot.f_mul_scalar_(scale)?;
                        slot.f_view_as(&info.tensor)?
                    }
                    // A batch's gradient: this rank's share of the global loss.
                    None => gradient.f_mul_scalar(self.tokens * scale)?,
                };
            }
            Ok(())
        })();
        result.map_err(|error| self.failed(error))
    }
}

/// Splits `params` (in order) into buckets of one kind and device and at most `first` bytes (the
/// first), then `rest` bytes, and sets where each parameter's gradient goes.
fn plan_buckets(params: &mut [Param], first: usize, rest: usize) -> Result<Vec<Bucket>> {
    let mut buckets: Vec<Bucket> = Vec::new();
    type Open = Option<((Kind, tch::Device), i64, Vec<usize>)>;
    let mut open: Open = None;
    let mut close = |open: &mut Open| -> Result<()> {
        if let Some((options, numel, members)) = open.take() {
            let flat = Tensor::f_zeros([numel], options)?;
            buckets.push(Bucket {
                flat,
                params: members,
            });
        }
        Ok(())
    };
    let mut closed = 0usize;
    for (index, param) in params.iter_mut().enumerate() {
        let kind = param.tensor.f_kind()?;
        let options = (kind, param.tensor.device());
        let bytes_of =
            |numel: i64| (numel.max(0) as usize).saturating_mul(kind.elt_size_in_bytes());
        let cap = if closed == 0 { first } else { rest };
        let fits = match &open {
            Some((open_options, numel, _)) => {
                *open_options == options && bytes_of(numel + param.numel) <= cap
            }
            None => false,
        };
        if !fits && open.is_some() {
            close(&mut open)?;
            closed += 1;
        }
        let (_, numel, members) = open.get_or_insert_with(|| (options, 0, Vec::new()));
        param.bucket = closed;
        param.offset = *numel;
        *numel += param.numel;
        members.push(index);
    }
    close(&mut open)?;
    Ok(buckets)
}

/// Checks that every rank has the same trainable parameters (names, shapes, kinds, in
/// order): the maximum and minimum over the ranks of a hash of them agree.
fn check_same_model(group: &ProcessGroup, params: &[Param]) -> Result<()> {
    let mut text = String::new();
    for param in params {
        text.push_str(&format!(
            "{} {:?} {:?};",
            param.name,
            param.tensor.size(),
            param.tensor.f_kind()?
        ));
    }
    // FNV-1a, 64 bits, as two halves (exact in i64).
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3)
    });
    let mine = [
        (hash >> 32) as i64,
        (hash & 0xffff_ffff) as i64,
        params.len() as i64,
    ];
    // On the parameters' device (NCCL reduces CUDA tensors only).
    let device = params
        .first()
        .map_or(tch::Device::Cpu, |param| param.tensor.device());
    let highest = Tensor::from_slice(&mine).f_to_device(device)?;
    let lowest = Tensor::from_slice(&mine).f_to_device(device)?;
    let max = group.all_reduce(&highest, ReduceOp::Max)?;
    let min = group.all_reduce(&lowest, ReduceOp::Min)?;
    max.wait()?;
    min.wait()?;
    let (highest, lowest) = (
        Vec::<i64>::try_from(&highest)?,
        Vec::<i64>::try_from(&lowest)?,
    );
    if highest != lowest {
        return Err(DistributedError::Mismatch {
            rank: group.rank(),
            message: format!(
                "the ranks train different models: trainable parameters (names, shapes, \
                 kinds) differ; this rank has {} of them ({})",
                params.len(),
                text.chars().take(400).collect::<String>()
            ),
        });
    }
    Ok(())
}

/// Gives every rank rank 0's parameter values.
fn broadcast_values(group: &ProcessGroup, params: &[Param]) -> Result<()> {
    let _guard = tch::no_grad_guard();
    let mut pending = Vec::with_capacity(params.len());
    for param in params {
        let contiguous = param.tensor.f_contiguous()?;
        pending.push((group.broadcast(&contiguous, 0)?, contiguous));
    }
    for (param, (work, contiguous)) in params.iter().zip(pending) {
        work.wait()?;
        if contiguous.data_ptr() != param.tensor.data_ptr() {
            param.tensor.shallow_clone().f_copy_(&contiguous)?;
        }
    }
    Ok(())
}
