//! Compiling and dropping programs over and over keeps memory flat: each program's LLVM
//! context goes with it (it used to stay for the life of the process). Alone in its
//! binary, so no other test's allocations move the measurement.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::batch;
use nestor::nn::{TransformerConfig, TransformerEncoder};
use nestor::{compile, Dense, NestedTensor};
use tch::{nn, Device, Kind};

/// Resident memory in bytes (Linux `/proc/self/statm`, 4 KiB pages).
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn two_hundred_compile_and_drop_cycles_keep_resident_memory_flat() {
    tch::manual_seed(1);
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: 8,
        nhead: 2,
        dim_feedforward: 16,
        dropout: 0.0,
        ..Default::default()
    };
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 1, true);
    let (tokens, _) = batch(&[3, 5], &[8], Kind::Float, 2);
    let mut series = Vec::new();
    for cycle in 1..=200 {
        let compiled = compile("cycle", |x: &[NestedTensor], _: &[Dense]| {
            encoder.forward(&x[0], false)
        });
        compiled.call(&[&tokens], &[]).unwrap();
        drop(compiled);
        if cycle % 50 == 0 {
            series.push(resident());
        }
    }
    println!("resident memory at cycles 50, 100, 150, 200: {series:?}");
    // After the first 50 (allocator and libtorch warm-up), growth stays under 5 MiB.
    let growth = series[3].saturating_sub(series[0]);
    assert!(
        growth < 5 << 20,
        "grew {growth} bytes over 150 cycles: {series:?}"
    );
}
