//! The quick start of DanLing's NestedTensor, in Rust: build a ragged batch, look at
//! it packed and padded, index it, and batch samples with a collate function.

use nestor::{collate, Batcher, NestedTensor, PNTensor};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Two sequences of different lengths, kept packed.
    let nested = NestedTensor::from_tensors(&[
        Tensor::from_slice(&[1i64, 2, 3]),
        Tensor::from_slice(&[4i64, 5]),
    ])?;
    println!("{nested}");
    println!(
        "packed values: {:?}",
        Vec::<i64>::try_from(nested.values())?
    );
    println!(
        "offsets:       {:?}",
        Vec::<i64>::try_from(&nested.packed_offsets())?
    );
    println!(
        "padded tensor: {:?}",
        Vec::<Vec<i64>>::try_from(&nested.tensor()?)?
    );
    println!(
        "mask:          {:?}",
        Vec::<Vec<bool>>::try_from(&nested.mask()?)?
    );
    println!(
        "shape {:?}, numel {}, occupancy {:.3}",
        nested.shape(),
        nested.numel(),
        nested.occupancy()
    );

    // Indexing: one element, a slice inside every element, one position of every element.
    println!(
        "nested[0]      = {:?}",
        Vec::<i64>::try_from(&nested.get(0)?)?
    );
    let tail = nested.slice(1, 1..)?;
    println!("nested[:, 1:]  = {:?}", tail.to_list()?);
    println!(
        "nested[:, 0]   = {:?}",
        Vec::<i64>::try_from(&nested.select(1, 0)?)?
    );

    // Features per token: the packed values are [total tokens, features].
    let tokens = NestedTensor::builder().requires_grad(true).tensors(&[
        Tensor::randn([3, 4], (Kind::Float, Device::Cpu)),
        Tensor::randn([7, 4], (Kind::Float, Device::Cpu)),
    ])?;
    println!(
        "tokens: packed {:?}, padded {:?}",
        tokens.values().size(),
        tokens.shape()
    );
    // Autograd flows through the packed values, also through the padded view.
    tokens.tensor()?.sum(Kind::Float).backward();
    let grad = tokens.grad().ok_or("no gradient")?;
    println!(
        "gradient of sum(padded) over the packed values: all ones = {}",
        grad.values().equal(&tokens.values().ones_like())
    );

    // Collation: per-sample tensors become a NestedTensor batch.
    let samples: Vec<(PNTensor, i64)> = [5, 2, 8, 3, 6, 1]
        .iter()
        .enumerate()
        .map(|(label, &length)| {
            (
                PNTensor(Tensor::arange(length, (Kind::Float, Device::Cpu))),
                label as i64,
            )
        })
        .collect();
    let (batch, labels) = collate(samples[..2].to_vec())?;
    println!(
        "collated batch shape {:?}, labels {:?}",
        batch.shape(),
        Vec::<i64>::try_from(&labels)?
    );
    let lengths = [5, 2, 8, 3, 6, 1];
    let batcher = Batcher::new(&samples, 2)
        .shuffle(0)
        .bucket_by_length(3, |index| lengths[index]);
    for (step, batch) in batcher.epoch(0).enumerate() {
        let (inputs, labels) = batch?;
        println!(
            "epoch 0 batch {step}: lengths {:?}, labels {:?}, occupancy {:.2}",
            inputs
                .layout()
                .offsets()
                .windows(2)
                .map(|w| w[1] - w[0])
                .collect::<Vec<_>>(),
            Vec::<i64>::try_from(&labels)?,
            inputs.occupancy()
        );
    }

    // A model on packed tokens: a 2-layer Transformer encoder, mean pooling over the
    // ragged dim, a classifier, trained with a tch optimizer. No padding anywhere.
    let store = tch::nn::VarStore::new(Device::Cpu);
    let config = nestor::nn::TransformerConfig {
        d_model: 32,
        nhead: 4,
        dim_feedforward: 64,
        ..Default::default()
    };
    let encoder =
        nestor::nn::TransformerEncoder::new(&(store.root() / "encoder"), &config, 2, true);
    let classifier = tch::nn::linear(store.root() / "classifier", 32, 3, Default::default());
    let mut optimizer = tch::nn::OptimizerConfig::build(tch::nn::Adam::default(), &store, 1e-3)?;
    let sentences = NestedTensor::from_tensors(&[
        Tensor::randn([7, 32], (Kind::Float, Device::Cpu)),
        Tensor::randn([2, 32], (Kind::Float, Device::Cpu)),
        Tensor::randn([12, 32], (Kind::Float, Device::Cpu)),
    ])?;
    let labels = Tensor::from_slice(&[0i64, 2, 1]);
    for step in 0..3 {
        let pooled = encoder
            .forward(&sentences, true)?
            .mean(&[1], false)?
            .into_dense()?;
        let loss = pooled.apply(&classifier).cross_entropy_for_logits(&labels);
        optimizer.backward_step(&loss);
        println!("training step {step}: loss {:.4}", loss.double_value(&[]));
    }
    Ok(())
}
