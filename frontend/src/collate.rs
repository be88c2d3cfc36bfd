//! Turning per-sample data into batches: the [`PNTensor`] marker, the [`Collate`]
//! trait, and a batching iterator over a [`Dataset`].

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use tch::Tensor;

use crate::dense::stack_same_shape;
use crate::{NestedError, NestedTensor, Result};

/// A per-sample tensor that collates into a [`NestedTensor`] (DanLing's `PNTensor`):
/// samples of different lengths are batched packed, never padded.
#[derive(Debug)]
pub struct PNTensor(pub Tensor);

impl Clone for PNTensor {
    /// Shares the tensor's storage.
    fn clone(&self) -> Self {
        PNTensor(self.0.shallow_clone())
    }
}

impl From<Tensor> for PNTensor {
    fn from(tensor: Tensor) -> Self {
        PNTensor(tensor)
    }
}

/// A sample type that knows how to batch a list of itself.
///
/// [`PNTensor`] samples become a [`NestedTensor`]; plain [`Tensor`] samples (which must
/// share a shape) and numbers are stacked; tuples collate field by field, so a dataset
/// of `(PNTensor, i64)` yields `(NestedTensor, Tensor)` batches.
pub trait Collate: Sized {
    /// What a batch of these samples becomes.
    type Batch;
    /// Batches `samples` in order.
    fn collate(samples: Vec<Self>) -> Result<Self::Batch>;
}

/// Batches samples (see [`Collate`]).
///
/// ```
/// use nestor_frontend::{collate, PNTensor};
/// use tch::Tensor;
/// let batch = collate(vec![
///     PNTensor(Tensor::from_slice(&[1i64, 2, 3])),
///     PNTensor(Tensor::from_slice(&[4i64, 5])),
/// ])?;
/// assert_eq!(batch.shape(), [2, 3]);
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
pub fn collate<T: Collate>(samples: Vec<T>) -> Result<T::Batch> {
    T::collate(samples)
}

impl Collate for PNTensor {
    type Batch = NestedTensor;
    fn collate(samples: Vec<Self>) -> Result<NestedTensor> {
        let tensors: Vec<Tensor> = samples.into_iter().map(|sample| sample.0).collect();
        NestedTensor::from_tensors(&tensors)
    }
}

impl Collate for Tensor {
    type Batch = Tensor;
    fn collate(samples: Vec<Self>) -> Result<Tensor> {
        const OP: &str =
            "collate (stack of plain tensors; wrap samples of different shapes in PNTensor)";
        match stack_same_shape(&samples, OP)? {
            Some(stacked) => Ok(stacked),
            None => Ok(Tensor::f_empty([0], tch::kind::FLOAT_CPU)?),
        }
    }
}

macro_rules! collate_numbers {
    ($($number:ty),*) => {$(
        impl Collate for $number {
            type Batch = Tensor;
            fn collate(samples: Vec<Self>) -> Result<Tensor> {
                Ok(Tensor::f_from_slice(&samples)?)
            }
        }
    )*};
}
collate_numbers!(i64, f32, f64, bool);

impl<A: Collate, B: Collate> Collate for (A, B) {
    type Batch = (A::Batch, B::Batch);
    fn collate(samples: Vec<Self>) -> Result<Self::Batch> {
        let (a, b): (Vec<A>, Vec<B>) = samples.into_iter().unzip();
        Ok((A::collate(a)?, B::collate(b)?))
    }
}

impl<A: Collate, B: Collate, C: Collate> Collate for (A, B, C) {
    type Batch = (A::Batch, B::Batch, C::Batch);
    fn collate(samples: Vec<Self>) -> Result<Self::Batch> {
        let mut a = Vec::with_capacity(samples.len());
        let mut b = Vec::with_capacity(samples.len());
        let mut c = Vec::with_capacity(samples.len());
        for (x, y, z) in samples {
            a.push(x);
            b.push(y);
            c.push(z);
        }
        Ok((A::collate(a)?, B::collate(b)?, C::collate(c)?))
    }
}

/// An indexed collection of samples.
pub trait Dataset {
    /// One sample.
    type Item: Collate;
    /// Number of samples.
    fn len(&self) -> usize;
    /// Whether there is no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Sample `index` (`index < len()`).
    fn get(&self, index: usize) -> Result<Self::Item>;
}

impl<T: Collate + Clone> Dataset for Vec<T> {
    type Item = T;
    fn len(&self) -> usize {
        Vec::len(self)
    }
    fn get(&self, index: usize) -> Result<T> {
        self.as_slice()
            .get(index)
            .cloned()
            .ok_or(NestedError::IndexOutOfRange {
                index: index as i64,
                batch_size: Vec::len(self),
            })
    }
}

/// Length-based bucketing: samples are sorted by length inside pools of
/// `pool_batches` batches, so that each batch holds samples of similar lengths.
struct Bucketing<'a> {
    pool_batches: usize,
    length: Box<dyn Fn(usize) -> usize + 'a>,
}

/// Iterates a [`Dataset`] in batches, like a data loader: batch size, seeded shuffle,
/// `drop_last`, and optional bucketing by length.
///
/// ```
/// use nestor_frontend::{Batcher, PNTensor};
/// use tch::Tensor;
///
/// let lengths = [3, 1, 4, 1, 5, 9, 2, 6];
/// let samples: Vec<PNTensor> =
///     lengths.iter().map(|&n| PNTensor(Tensor::arange(n, tch::kind::INT64_CPU))).collect();
/// let batcher = Batcher::new(&samples, 3).shuffle(7).drop_last(true);
/// let batches: Vec<_> = batcher.epoch(0).collect::<Result<_, _>>()?;
/// assert_eq!(batches.len(), 2);
/// assert!(batches.iter().all(|batch| batch.len() == 3));
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
pub struct Batcher<'a, D: Dataset> {
    dataset: &'a D,
    batch_size: usize,
    seed: Option<u64>,
    drop_last: bool,
    bucketing: Option<Bucketing<'a>>,
}

impl<'a, D: Dataset> Batcher<'a, D> {
    /// Batches of `batch_size` samples (at least 1), in dataset order.
    pub fn new(dataset: &'a D, batch_size: usize) -> Self {
        Self {
            dataset,
            batch_size: batch_size.max(1),
            seed: None,
            drop_last: false,
            bucketing: None,
        }
    }

    /// Shuffles the samples of every epoch, reproducibly from `seed` and the epoch.
    pub fn shuffle(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Drops a last batch smaller than `batch_size`.
    pub fn drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Groups samples of similar length: within pools of `pool_batches` batches, samples
    /// are sorted by `length(index)` before being cut into batches (then, with
    /// shuffling, the batches are shuffled). Less padding, less wasted compute.
    pub fn bucket_by_length(
        mut self,
        pool_batches: usize,
        length: impl Fn(usize) -> usize + 'a,
    ) -> Self {
        self.bucketing = Some(Bucketing {
            pool_batches: pool_batches.max(1),
            length: Box::new(length),
        });
        self
    }

    /// The sample indices of every batch of epoch `epoch`.
    pub fn plan(&self, epoch: u64) -> Vec<Vec<usize>> {
        let mut order: Vec<usize> = (0..self.dataset.len()).collect();
        let mut rng = self
            .seed
            .map(|seed| StdRng::seed_from_u64(seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        if let Some(rng) = rng.as_mut() {
            order.shuffle(rng);
        }
        if let Some(bucketing) = &self.bucketing {
            // A pool larger than any dataset is the whole dataset: saturating is exact.
            let pool_size = self.batch_size.saturating_mul(bucketing.pool_batches);
            for pool in order.chunks_mut(pool_size) {
                pool.sort_by_key(|&index| (bucketing.length)(index));
            }
        }
        let mut batches: Vec<Vec<usize>> = order
            .chunks(self.batch_size)
            .filter(|batch| !self.drop_last || batch.len() == self.batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        if let (Some(_), Some(rng)) = (&self.bucketing, rng.as_mut()) {
            batches.shuffle(rng);
        }
        batches
    }

    /// The batches of epoch `epoch`, collated.
    pub fn epoch(
        &self,
        epoch: u64,
    ) -> impl Iterator<Item = Result<<D::Item as Collate>::Batch>> + '_ {
        self.plan(epoch).into_iter().map(move |indices| {
            let samples = indices
                .into_iter()
                .map(|index| self.dataset.get(index))
                .collect::<Result<Vec<_>>>()?;
            D::Item::collate(samples)
        })
    }
}
