//! Data-parallel compiled training of the fortunes language model (the model of
//! `train_compiled.rs`) on several processes: c10d's Gloo backend, started by torchrun,
//! batches balanced by tokens between the ranks, gradients all-reduced while the
//! backward runs and normalized by the global token count.
//!
//! ```sh
//! scripts/cargo build --release --example train_distributed
//! $NESTOR_VENV/bin/torchrun --standalone --nproc-per-node 2 --no-python \
//!     $CARGO_TARGET_DIR/release/examples/train_distributed --steps 200
//! ```
//!
//! Without torchrun's variables it trains alone (a group of one). `--steps N` trains N
//! steps (default 300), `--tokens N` puts about N tokens in each rank's batch (default
//! 1024), `--shard samples` splits batches by sample counts instead of tokens. Rank 0
//! prints the global mean loss and the tokens per second of all ranks together.

use std::time::{Duration, Instant};

use nestor::distributed::{
    DataParallel, GroupConfig, ProcessGroup, ReduceOp, Sharding, TokenBatches,
};
use nestor::{compile, Dense, NestedTensor};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Tensor};

#[path = "support/fortunes.rs"]
#[allow(dead_code)]
mod fortunes;
use fortunes::{batch, corpus, LanguageModel};

/// The command line: steps, tokens per rank and step, how batches are split.
struct Options {
    steps: usize,
    tokens: usize,
    sharding: Sharding,
}

fn options() -> Result<Options, Box<dyn std::error::Error>> {
    let mut options = Options {
        steps: 300,
        tokens: 1024,
        sharding: Sharding::Tokens,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match (arg.as_str(), args.next()) {
            ("--steps", Some(value)) => options.steps = value.parse()?,
            ("--tokens", Some(value)) => options.tokens = value.parse()?,
            ("--shard", Some(kind)) if kind == "samples" => options.sharding = Sharding::Samples,
            ("--shard", Some(kind)) if kind == "tokens" => options.sharding = Sharding::Tokens,
            _ => {
                return Err(format!(
                    "unknown argument {arg}: --steps N, --tokens N, --shard tokens|samples"
                )
                .into())
            }
        }
    }
    Ok(options)
}

/// torchrun's group, or a group of one on loopback when started without torchrun.
fn group() -> Result<ProcessGroup, Box<dyn std::error::Error>> {
    let config = if std::env::var_os("RANK").is_some() {
        GroupConfig::from_env()?
    } else {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        GroupConfig::new(0, 1, "127.0.0.1", port)
    };
    Ok(ProcessGroup::new(
        &config.timeout(Duration::from_secs(120)),
    )?)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let options = options()?;
    let group = group()?;
    let (rank, world) = (group.rank(), group.world_size());
    let quotes = corpus()?;
    // A quote of n bytes is n - 1 next-byte predictions.
    let lengths: Vec<usize> = quotes.iter().map(|quote| quote.len() - 1).collect();
    let plan = TokenBatches::new(&lengths, options.tokens, rank, world)?
        .seed(0)
        .sharding(options.sharding);

    tch::manual_seed(rank as i64); // DataParallel gives every rank rank 0's values
    let store = nn::VarStore::new(Device::Cpu);
    let model = LanguageModel::new(&store.root());
    let step = compile("language_model", |x: &[NestedTensor], _: &[Dense]| {
        model.loss(x)
    })
    .train(&store);
    let mut parallel = DataParallel::new(&group, &store)?;
    let mut adam = nn::Adam::default().build(&store, 3e-3)?;
    if rank == 0 {
        println!(
            "{} quotations, {world} ranks, about {} tokens per rank and step ({:?} sharding), {} buckets",
            quotes.len(),
            options.tokens,
            options.sharding,
            parallel.buckets()
        );
    }

    let started = Instant::now();
    let (mut done, mut epoch) = (0, 0);
    // This rank's (token-weighted loss, tokens) since the last report.
    let mut window = (0.0, 0.0);
    let mut global_tokens = 0.0;
    while done < options.steps {
        for indices in plan.plan(epoch)? {
            if done == options.steps {
                break;
            }
            let samples: Vec<&Vec<u8>> = indices.iter().map(|&index| &quotes[index]).collect();
            let inputs = batch(&samples)?;
            let tokens: usize = indices.iter().map(|&index| lengths[index]).sum();
            adam.zero_grad();
            let outputs =
                parallel.step(&step, &[&inputs[0], &inputs[1], &inputs[2]], &[], tokens)?;
            adam.step();
            let loss = outputs
                .into_iter()
                .next()
                .ok_or("no loss")?
                .into_dense()?
                .double_value(&[]);
            window.0 += loss * tokens as f64;
            window.1 += tokens as f64;
            global_tokens += parallel.last_step().global_tokens;
            done += 1;
            if done % 50 == 0 || done == options.steps {
                // The global token-mean loss of the window: one small all-reduce.
                let sums = Tensor::from_slice(&[window.0, window.1]);
                group.all_reduce(&sums, ReduceOp::Sum)?.wait()?;
                let (loss_sum, token_sum) = (sums.double_value(&[0]), sums.double_value(&[1]));
                if rank == 0 {
                    let stats = parallel.last_step();
                    println!(
                        "step {done}: loss {:.3}, {:.0} tokens/s on {world} ranks (last step: {} of {} buckets launched during the backward, {:.1} ms waited)",
                        loss_sum / token_sum.max(1.0),
                        global_tokens / started.elapsed().as_secs_f64(),
                        stats.launched_early,
                        stats.buckets,
                        stats.wait_seconds * 1e3
                    );
                }
                window = (0.0, 0.0);
            }
        }
        epoch += 1;
    }
    Ok(())
}
