//! Process groups across processes on loopback: collectives, torchrun, failures.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use nestor_distributed::{DistributedError, GroupConfig, ProcessGroup, ReduceOp};
use tch::{Kind, Tensor};

/// Each worker's group, from the variables `spawn_ranks` (or torchrun) set.
fn group(timeout: Duration) -> ProcessGroup {
    let config = GroupConfig::from_env()
        .expect("torchrun's variables")
        .timeout(timeout);
    ProcessGroup::new(&config).expect("the group forms")
}

/// The collectives every rank runs: sums, extrema and a broadcast, checked against what
/// every rank knows the others hold.
fn collectives(group: &ProcessGroup) {
    let (rank, world) = (group.rank() as f64, group.world_size() as f64);
    let x = Tensor::from_slice(&[rank + 1.0, -rank, 0.5]).to_kind(Kind::Double);
    group.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
    let sum = world * (world + 1.0) / 2.0;
    assert_eq!(
        Vec::<f64>::try_from(&x).unwrap(),
        [sum, -(sum - world), 0.5 * world]
    );

    let y = Tensor::from_slice(&[rank as f32, -(rank as f32)]);
    group.all_reduce(&y, ReduceOp::Max).unwrap().wait().unwrap();
    assert_eq!(Vec::<f32>::try_from(&y).unwrap(), [world as f32 - 1.0, 0.0]);
    let z = Tensor::from_slice(&[rank as i64]);
    group.all_reduce(&z, ReduceOp::Min).unwrap().wait().unwrap();
    assert_eq!(z.int64_value(&[0]), 0);

    // Two reductions in flight at once, waited in the other order.
    let a = Tensor::ones([1000], (Kind::Float, tch::Device::Cpu));
    let b = Tensor::full([7], rank + 2.0, (Kind::Float, tch::Device::Cpu));
    let first = group.all_reduce(&a, ReduceOp::Sum).unwrap();
    let second = group.all_reduce(&b, ReduceOp::Sum).unwrap();
    second.wait().unwrap();
    first.wait().unwrap();
    assert_eq!(a.min().double_value(&[]), world);
    assert_eq!(b.double_value(&[3]), sum + world);

    let root = group.world_size() - 1;
    let w = Tensor::full([3, 4], rank, (Kind::Float, tch::Device::Cpu));
    group.broadcast(&w, root).unwrap().wait().unwrap();
    assert_eq!(w.max().double_value(&[]), root as f64);
    assert_eq!(w.min().double_value(&[]), root as f64);
}

#[test]
fn collectives_across_two_processes() {
    let test = "collectives_across_two_processes";
    if is_worker(test) {
        collectives(&group(Duration::from_secs(30)));
        return;
    }
    let outputs = finish_all(spawn_ranks(test, 2, |_| vec![]), Duration::from_secs(60));
    assert_all_succeeded(&outputs);
}

#[test]
fn collectives_under_torchrun() {
    let test = "collectives_under_torchrun";
    if is_worker(test) {
        assert!(
            std::env::var("TORCHELASTIC_USE_AGENT_STORE").is_ok(),
            "started by torchrun"
        );
        collectives(&group(Duration::from_secs(30)));
        return;
    }
    let outputs = finish_all(vec![spawn_torchrun(test, 2)], Duration::from_secs(90));
    assert_all_succeeded(&outputs);
}

#[test]
fn invalid_configurations_are_typed_errors() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| value.to_string())
        }
    };
    let missing = GroupConfig::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "2")]));
    assert!(
        matches!(
            missing,
            Err(DistributedError::Config {
                variable: "MASTER_ADDR",
                ..
            })
        ),
        "{missing:?}"
    );
    let base = [("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
    let bad_rank = GroupConfig::from_vars(|name| match name {
        "RANK" => Some("2".into()),
        "WORLD_SIZE" => Some("2".into()),
        _ => base
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, v)| v.to_string()),
    });
    assert!(
        matches!(
            bad_rank,
            Err(DistributedError::Config {
                variable: "RANK",
                ..
            })
        ),
        "{bad_rank:?}"
    );
    let bad_port = GroupConfig::from_vars(|name| match name {
        "MASTER_PORT" => Some("http".into()),
        "RANK" | "WORLD_SIZE" => Some("1".into()),
        _ => Some("x".into()),
    });
    assert!(
        matches!(
            bad_port,
            Err(DistributedError::Config {
                variable: "MASTER_PORT",
                ..
            })
        ),
        "{bad_port:?}"
    );
    let agent = GroupConfig::from_vars(|name| match name {
        "TORCHELASTIC_USE_AGENT_STORE" => Some("True".into()),
        "RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("2".into()),
        _ => base
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, v)| v.to_string()),
    })
    .unwrap();
    assert!(!agent.serve_store, "torchrun's agent serves the store");
}

#[test]
fn a_rank_that_never_joins_is_an_error_within_the_timeout() {
    let config = GroupConfig::new(0, 2, "127.0.0.1", free_port()).timeout(Duration::from_secs(2));
    let started = Instant::now();
    let error = ProcessGroup::new(&config).err().expect("no second rank");
    assert!(
        matches!(
            error,
            DistributedError::Join {
                rank: 0,
                world_size: 2,
                ..
            }
        ),
        "{error}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn a_killed_rank_is_an_error_on_the_other() {
    let test = "a_killed_rank_is_an_error_on_the_other";
    if is_worker(test) {
        let group = group(Duration::from_secs(5));
        let x = Tensor::ones([4], (Kind::Float, tch::Device::Cpu));
        group.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
        if group.rank() == 1 {
            std::process::exit(0); // dies without taking part in the next collective
        }
        let started = Instant::now();
        let result = group
            .all_reduce(&x, ReduceOp::Sum)
            .and_then(|pending| pending.wait());
        match result {
            Err(DistributedError::Collective {
                rank: 0,
                operation: "all_reduce",
                message,
            }) => {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "{:?}",
                    started.elapsed()
                );
                println!("rank 0 saw: {message}");
            }
            other => panic!("expected a collective error, got {other:?}"),
        }
        return;
    }
    let outputs = finish_all(spawn_ranks(test, 2, |_| vec![]), Duration::from_secs(60));
    assert_all_succeeded(&outputs);
}
