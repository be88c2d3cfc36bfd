//! The NCCL backend (`--features nccl`): it builds against the torch wheel's CUDA and
//! NCCL, forms a group of one and all-reduces a CUDA tensor where a GPU is; without a
//! GPU, forming the group is a typed error that says so.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![cfg(feature = "nccl")]

mod common;

use std::time::Duration;

use common::free_port;
use nestor_distributed::{Backend, DistributedError, GroupConfig, ProcessGroup, ReduceOp};
use tch::{Device, Kind, Tensor};

#[test]
fn an_nccl_group_of_one_reduces_cuda_tensors_or_says_there_is_no_gpu() {
    let config = GroupConfig::new(0, 1, "127.0.0.1", free_port())
        .timeout(Duration::from_secs(60))
        .backend(Backend::Nccl);
    let group = ProcessGroup::new(&config);
    if !tch::Cuda::is_available() {
        match group {
            Err(DistributedError::Join { message, .. }) => {
                assert!(message.contains("GPU"), "{message}");
                eprintln!("no GPU here: NCCL checked for the error it gives ({message})");
            }
            Err(other) => panic!("expected a join error, got {other}"),
            Ok(_) => panic!("an NCCL group formed without a GPU"),
        }
        return;
    }
    let group = group.expect("an NCCL group of one");
    let x = Tensor::arange(6, (Kind::Float, Device::Cuda(0)));
    group.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
    let back: Vec<f32> = Vec::try_from(&x.to_device(Device::Cpu)).unwrap();
    assert_eq!(back, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let cpu = Tensor::ones([2], (Kind::Float, Device::Cpu));
    assert!(matches!(
        group.all_reduce(&cpu, ReduceOp::Sum),
        Err(DistributedError::Invalid(_))
    ));
}
