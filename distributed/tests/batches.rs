//! Token-balanced batch plans: every sample once, equal step counts, balanced tokens.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use nestor_distributed::{DistributedError, Sharding, TokenBatches};
use proptest::prelude::*;

fn plans(
    lengths: &[usize],
    budget: usize,
    world: usize,
    seed: u64,
    epoch: u64,
) -> Vec<Vec<Vec<usize>>> {
    (0..world)
        .map(|rank| {
            TokenBatches::new(lengths, budget, rank, world)
                .unwrap()
                .seed(seed)
                .pool_samples(16)
                .plan(epoch)
                .unwrap()
        })
        .collect()
}

proptest! {
    #[test]
    fn every_sample_once_equal_steps_and_balanced_tokens(
        lengths in prop::collection::vec(0usize..60, 1..120),
        budget in 1usize..200,
        world in 1usize..5,
        seed in any::<u64>(),
        epoch in 0u64..3,
    ) {
        prop_assume!(lengths.len() >= world);
        let plans = plans(&lengths, budget, world, seed, epoch);
        let steps = plans[0].len();
        prop_assert!(steps >= 1);
        let mut seen = vec![0usize; lengths.len()];
        for plan in &plans {
            prop_assert_eq!(plan.len(), steps, "equal step counts");
            for batch in plan {
                prop_assert!(!batch.is_empty(), "every rank has a sample at every step");
                for &index in batch {
                    seen[index] += 1;
                }
            }
        }
        prop_assert!(seen.iter().all(|&count| count == 1), "every sample exactly once: {:?}", seen);
        let longest = lengths.iter().copied().max().unwrap_or(0);
        for step in 0..steps {
            let tokens: Vec<usize> = plans
                .iter()
                .map(|plan| plan[step].iter().map(|&i| lengths[i]).sum())
                .collect();
            let (most, least) = (tokens.iter().max().unwrap(), tokens.iter().min().unwrap());
            prop_assert!(most - least <= longest, "step {}: tokens {:?}", step, tokens);
        }
        // The same plan again from the same seed; the global plan agrees with the ranks'.
        prop_assert_eq!(&plans, &self::plans(&lengths, budget, world, seed, epoch));
        let global = TokenBatches::new(&lengths, budget, 0, world).unwrap().seed(seed).pool_samples(16).global_plan(epoch).unwrap();
        for (step, shares) in global.iter().enumerate() {
            for (rank, share) in shares.iter().enumerate() {
                prop_assert_eq!(share, &plans[rank][step]);
            }
        }
    }
}

#[test]
fn batches_keep_to_the_token_budget_and_sort_by_length() {
    let lengths: Vec<usize> = (0..400).map(|i| 1 + (i * 37) % 97).collect();
    let batches = TokenBatches::new(&lengths, 300, 0, 2)
        .unwrap()
        .seed(3)
        .global_plan(0)
        .unwrap();
    for shares in &batches {
        let all: Vec<usize> = shares.iter().flatten().map(|&i| lengths[i]).collect();
        // Within the budget of 2 x 300 (the last batch may take the few samples left).
        let (low, high) = (all.iter().min().unwrap(), all.iter().max().unwrap());
        assert!(all.iter().sum::<usize>() <= 600 + high, "{all:?}");
        // Sorted within one pool (all 400 samples, about 4 of each length 1..97): a
        // batch holds neighbouring lengths (the shortest batch, lengths 1..17).
        assert!(high - low <= 17, "{low}..{high}");
    }
    let other = TokenBatches::new(&lengths, 300, 0, 2)
        .unwrap()
        .seed(3)
        .plan(1)
        .unwrap();
    assert_ne!(
        other,
        TokenBatches::new(&lengths, 300, 0, 2)
            .unwrap()
            .seed(3)
            .plan(0)
            .unwrap()
    );
}

#[test]
fn sample_sharding_splits_counts_not_tokens() {
    let lengths = [100, 1, 100, 1, 100, 1, 100, 1];
    let batches = TokenBatches::new(&lengths, 1000, 0, 2)
        .unwrap()
        .pool_samples(1)
        .sharding(Sharding::Samples)
        .global_plan(0)
        .unwrap();
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0][0].len(), 4);
    assert_eq!(batches[0][1].len(), 4);
}

#[test]
fn bad_plans_are_typed_errors() {
    assert!(matches!(
        TokenBatches::new(&[3, 4], 0, 0, 2),
        Err(DistributedError::Config {
            variable: "tokens_per_rank",
            ..
        })
    ));
    assert!(matches!(
        TokenBatches::new(&[3], 10, 0, 2),
        Err(DistributedError::Config {
            variable: "lengths",
            ..
        })
    ));
    assert!(matches!(
        TokenBatches::new(&[3, 4], 10, 2, 2),
        Err(DistributedError::Config {
            variable: "rank",
            ..
        })
    ));
}
