//! Compiles a 2-layer Transformer encoder for the CPU, runs it on batches of several
//! lengths (one compile serves them all), checks it against eager execution and prints
//! the runtime's stats. With `NESTOR_DUMP=<dir>` every pipeline stage is written there
//! (traced graph, each pass, the lowered program, the LLVM IR of the kernels).
//!
//! ```sh
//! NESTOR_DUMP=/tmp/nestor-dump scripts/cargo run --release --example compile_encoder
//! ```

use std::time::Instant;

use nestor::nn::{TransformerConfig, TransformerEncoder};
use nestor::{compile, Dense, NestedTensor};
use tch::{nn, Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tch::manual_seed(0);
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: 64,
        nhead: 4,
        dim_feedforward: 128,
        ..Default::default()
    };
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, true);
    let compiled = compile("encoder", |inputs: &[NestedTensor], _: &[Dense]| {
        encoder.forward(&inputs[0], false)
    })
    .with_var_store(&store);
    for (step, lengths) in [
        vec![12i64, 3, 7],
        vec![1, 30],
        vec![5, 5, 5, 5],
        vec![64, 2, 9, 17, 4],
    ]
    .iter()
    .enumerate()
    {
        let tokens = NestedTensor::from_tensors(
            &lengths
                .iter()
                .map(|&length| Tensor::randn([length, 64], (Kind::Float, Device::Cpu)))
                .collect::<Vec<_>>(),
        )?;
        let started = Instant::now();
        let output = compiled.call(&[&tokens], &[])?.remove(0).into_nested()?;
        let elapsed = started.elapsed();
        let eager = encoder.forward(&tokens, false)?.ragged_leading()?;
        let difference = (output.values() - eager.values())
            .abs()
            .max()
            .double_value(&[]);
        println!(
            "batch {step}: lengths {lengths:?} -> {:?} in {:.2} ms, max |compiled - eager| = {difference:.2e}",
            output.shape(),
            elapsed.as_secs_f64() * 1e3
        );
    }
    let stats = compiled.stats();
    println!(
        "stats: {} compile(s), {} cache hit(s), {} kernel launches, {} bytes of intermediates allocated",
        stats.compiles, stats.cache_hits, stats.kernel_launches, stats.bytes_allocated
    );
    match std::env::var("NESTOR_DUMP") {
        Ok(dir) => println!("pipeline stages written to {dir}"),
        Err(_) => println!("set NESTOR_DUMP=<dir> to write every pipeline stage"),
    }
    Ok(())
}
