//! Token-balanced batches for data-parallel training: every rank plans the same global
//! list of token-budget batches from the epoch's seed, and takes its share of each, so
//! that ranks get nearly equal tokens and exactly equal step counts.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::error::{DistributedError, Result};

/// How a global batch is split between the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharding {
    /// Nearly equal tokens per rank: longest samples first, each to the rank with the
    /// fewest tokens so far (a rank's excess over another is at most one sample).
    Tokens,
    /// Equal sample counts per rank (as PyTorch's `DistributedSampler`): every
    /// `world_size`-th sample, whatever their lengths.
    Samples,
}

/// Plans the batches of every epoch for data-parallel training on samples of known
/// lengths (in tokens): global batches of about `world_size * tokens_per_rank` tokens
/// of samples of similar lengths (sorted within pools of shuffled samples, as
/// [`nestor_frontend::Batcher::bucket_by_length`] does), visited in a shuffled order,
/// each split between the ranks. Every rank computes the same plan from the seed, and
/// every rank gets the same number of steps, each with at least one sample.
///
/// ```
/// use nestor_distributed::TokenBatches;
///
/// let lengths = [12, 3, 40, 7, 7, 25, 1, 18, 30, 2, 9, 14];
/// let rank0 = TokenBatches::new(&lengths, 32, 0, 2)?.seed(5);
/// let rank1 = TokenBatches::new(&lengths, 32, 1, 2)?.seed(5);
/// let (mine, theirs) = (rank0.plan(0)?, rank1.plan(0)?);
/// assert_eq!(mine.len(), theirs.len()); // the same number of steps
/// let tokens = |batch: &Vec<usize>| batch.iter().map(|&i| lengths[i]).sum::<usize>();
/// for (a, b) in mine.iter().zip(&theirs) {
///     // Within one sample's length of each other.
///     assert!(tokens(a).abs_diff(tokens(b)) <= 40);
/// }
/// # Ok::<(), nestor_distributed::DistributedError>(())
/// ```
#[derive(Clone, Debug)]
pub struct TokenBatches {
    lengths: Vec<usize>,
    tokens_per_rank: usize,
    rank: usize,
    world_size: usize,
    seed: u64,
    pool_samples: usize,
    sharding: Sharding,
}

/// Samples sorted by length together, unless told otherwise.
pub const POOL_SAMPLES: usize = 4096;

impl TokenBatches {
    /// Rank `rank` of `world_size`'s batches of samples of `lengths`, about
    /// `tokens_per_rank` tokens per rank and step (a sample longer than that is a
    /// batch of its own), seed 0, token sharding.
    pub fn new(
        lengths: &[usize],
        tokens_per_rank: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<Self> {
        let problem =
            |variable, problem: String| Err(DistributedError::Config { variable, problem });
        if tokens_per_rank == 0 {
            return problem("tokens_per_rank", "is 0: 1 or more".into());
        }
        if world_size == 0 || rank >= world_size {
            return problem("rank", format!("is {rank} of a world of {world_size}"));
        }
        if lengths.len() < world_size {
            return problem(
                "lengths",
                format!(
                    "has {} samples, fewer than the {world_size} ranks: every rank needs one",
                    lengths.len()
                ),
            );
        }
        Ok(Self {
            lengths: lengths.to_vec(),
            tokens_per_rank,
            rank,
            world_size,
            seed: 0,
            pool_samples: POOL_SAMPLES,
            sharding: Sharding::Tokens,
        })
    }

    /// The seed every rank shuffles with (the same on all of them).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sorts samples by length within pools of this many shuffled samples (at least 1:
    /// no sorting; more: less padding-free waste, less randomness).
    pub fn pool_samples(mut self, pool_samples: usize) -> Self {
        self.pool_samples = pool_samples.max(1);
        self
    }

    /// How each global batch is split between the ranks.
    pub fn sharding(mut self, sharding: Sharding) -> Self {
        self.sharding = sharding;
        self
    }

    /// The sample indices of this rank's batch at each step of epoch `epoch`.
    pub fn plan(&self, epoch: u64) -> Result<Vec<Vec<usize>>> {
        Ok(self
            .global_plan(epoch)?
            .into_iter()
            .map(|mut shares| shares.swap_remove(self.rank))
            .collect())
    }

    /// Every rank's batch at each step of epoch `epoch`: `[step][rank]`.
    pub fn global_plan(&self, epoch: u64) -> Result<Vec<Vec<Vec<usize>>>> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut order: Vec<usize> = (0..self.lengths.len()).collect();
        order.shuffle(&mut rng);
        for pool in order.chunks_mut(self.pool_samples) {
            pool.sort_by_key(|&index| self.lengths[index]);
        }
        let budget = self.tokens_per_rank.saturating_mul(self.world_size);
        let mut batches: Vec<Vec<usize>> = Vec::new();
        let (mut batch, mut tokens) = (Vec::new(), 0usize);
        for index in order {
            let length = self.lengths[index];
            if batch.len() >= self.world_size && tokens.saturating_add(length) > budget {
                batches.push(std::mem::take(&mut batch));
                tokens = 0;
            }
            batch.push(index);
            tokens = tokens.saturating_add(length);
        }
        // A last batch too small to give every rank a sample joins the one before.
        match batches.last_mut() {
            Some(previous) if batch.len() < self.world_size => previous.append(&mut batch),
            _ if !batch.is_empty() => batches.push(batch),
            _ => {}
        }
        batches.shuffle(&mut rng);
        Ok(batches.into_iter().map(|batch| self.split(batch)).collect())
    }

    /// One global batch's share of every rank.
    fn split(&self, mut batch: Vec<usize>) -> Vec<Vec<usize>> {
        let mut shares = vec![Vec::new(); self.world_size];
        match self.sharding {
            Sharding::Samples => {
                for (position, index) in batch.into_iter().enumerate() {
                    shares[position % self.world_size].push(index);
                }
            }
            Sharding::Tokens => {
                // Longest first (ties by index, so every rank sorts alike), each to the
                // rank with the fewest tokens, then the fewest samples, then the lowest.
                batch.sort_by_key(|&index| (std::cmp::Reverse(self.lengths[index]), index));
                let mut tokens = vec![0usize; self.world_size];
                for index in batch {
                    let rank = (0..self.world_size)
                        .min_by_key(|&rank| (tokens[rank], shares[rank].len(), rank))
                        .unwrap_or(0);
                    tokens[rank] = tokens[rank].saturating_add(self.lengths[index]);
                    shares[rank].push(index);
                }
            }
        }
        shares
    }
}
