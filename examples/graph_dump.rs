//! Traces one TransformerEncoder layer and writes its graph as text IR (`.nir`),
//! Graphviz DOT and, when Graphviz's `dot` is installed, SVG.
//!
//! ```sh
//! scripts/cargo run --example graph_dump -- /tmp/nestor-graphs
//! ```

use std::path::PathBuf;
use std::process::Command;

use nestor::nn::{TransformerConfig, TransformerEncoderLayer};
use nestor::{trace, NestedTensor};
use tch::{nn, Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "graphs".into()));
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: 64,
        nhead: 4,
        dim_feedforward: 128,
        ..Default::default()
    };
    let layer = TransformerEncoderLayer::new(&(store.root() / "layer"), &config);
    let tokens = NestedTensor::from_tensors(&[
        Tensor::randn([5, 64], (Kind::Float, Device::Cpu)),
        Tensor::randn([2, 64], (Kind::Float, Device::Cpu)),
    ])?;
    let traced = trace(
        "encoder_layer",
        &[&tokens],
        &[],
        Some(&store),
        |inputs, _| layer.forward(&inputs[0], false),
    )?;
    traced.dump(&dir, "00-traced")?;
    println!("{}", traced.text());
    let dot_file = dir.join("encoder_layer.00-traced.dot");
    let svg_file = dir.join("encoder_layer.00-traced.svg");
    match Command::new("dot")
        .arg("-Tsvg")
        .arg(&dot_file)
        .arg("-o")
        .arg(&svg_file)
        .status()
    {
        Ok(status) if status.success() => println!("wrote {}", svg_file.display()),
        Ok(status) => println!(
            "Graphviz failed ({status}); the DOT file is {}",
            dot_file.display()
        ),
        Err(_) => println!(
            "Graphviz `dot` is not installed; the DOT file is {}",
            dot_file.display()
        ),
    }
    println!(
        "wrote {} and {}",
        dir.join("encoder_layer.00-traced.nir").display(),
        dot_file.display()
    );
    Ok(())
}
