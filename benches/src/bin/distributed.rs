//! Data-parallel compiled training on 2 ranks against 1 process, on the same global
//! batches of the report's encoder (d 256, 4 heads, ff 1024, 2 layers; the mean square
//! of its outputs as the loss, as in the report), every process on one thread:
//! tokens per second and the scaling, the share of all-reduce time the backward hides,
//! and token-balanced against sample-balanced sharding on lognormal lengths (the
//! straggler cost: each step waits for its slowest rank).
//!
//! ```sh
//! scripts/cargo run --release -p nestor-bench --bin distributed -- --out docs/benchmarks
//! ```
//!
//! The driver starts the workers (copies of itself) on loopback with torchrun's
//! variables set by hand; `--steps N` timed steps after `--warmup N`; `--bucket-kib N`
//! sets the buckets after the first (1 MiB) to N KiB (default PyTorch DDP's 25 MiB);
//! `--pool N` sorts lengths in pools of N samples (default 512). The sharding comparison
//! runs on those batches and on batches of random lengths (no sorting).

use std::fmt::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nestor::distributed::{
    DataParallel, GroupConfig, ProcessGroup, Sharding, TokenBatches, BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
};
use nestor::nn::{TransformerConfig, TransformerEncoder};
use nestor::{compile, Dense, NestedTensor};
use nestor_bench::Result;
use rand::{Rng, SeedableRng};
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

const D_MODEL: i64 = 256;
const MAX_LENGTH: usize = 256;
/// Samples in the corpus the batches are planned from.
const SAMPLES: usize = 3000;
/// Tokens of a global batch (about the report's batch of 16 at 35% occupancy).
const GLOBAL_TOKENS: usize = 1536;

/// One worker's measurement of one step.
#[derive(Clone, Copy, Debug)]
struct StepRecord {
    seconds: f64,
    wait: f64,
    early: usize,
    buckets: usize,
    tokens: usize,
}

/// Lognormal lengths (median 48, sigma 0.9) in 1..=256, the same for every process.
fn lengths() -> Vec<usize> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    (0..SAMPLES)
        .map(|_| {
            // Box-Muller: a standard normal from two uniforms.
            let (u, v): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random());
            let normal = (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos();
            ((48f64.ln() + 0.9 * normal).exp().round() as usize).clamp(1, MAX_LENGTH)
        })
        .collect()
}

/// The features of sample `index` (`[length, d]`, the same in every process).
fn features(index: usize, length: usize) -> Tensor {
    tch::manual_seed(index as i64);
    Tensor::randn([length as i64, D_MODEL], (Kind::Float, Device::Cpu))
}

/// A worker: trains its rank's share of the plan and prints its steps.
fn worker(setting: &Setting) -> Result<()> {
    let Setting {
        steps,
        warmup,
        sharding,
        pool,
        bucket_bytes,
        ..
    } = *setting;
    let config = GroupConfig::from_env()?.timeout(Duration::from_secs(300));
    let group = ProcessGroup::new(&config)?;
    let (rank, world) = (group.rank(), group.world_size());
    let lengths = lengths();
    let plan = TokenBatches::new(&lengths, setting.tokens, rank, world)?
        .seed(5)
        .pool_samples(pool)
        .sharding(sharding)
        .plan(0)?;
    if plan.len() < steps + warmup {
        return Err(format!("{} steps planned, {} wanted", plan.len(), steps + warmup).into());
    }
    tch::manual_seed(0);
    let store = nn::VarStore::new(Device::Cpu);
    let encoder = TransformerEncoder::new(
        &(store.root() / "encoder"),
        &TransformerConfig {
            d_model: D_MODEL,
            nhead: 4,
            dim_feedforward: 1024,
            dropout: 0.0,
            ..Default::default()
        },
        2,
        true,
    );
    let step = compile("encoder", |x: &[NestedTensor], _: &[Dense]| {
        encoder
            .forward(&x[0], true)?
            .square()?
            .mean(&[], false)?
            .into_dense_handle()
    })
    .train(&store);
    let mut parallel =
        DataParallel::with_buckets(&group, &store, FIRST_BUCKET_BYTES, bucket_bytes)?;
    let mut sgd = nn::Sgd::default().build(&store, 1e-4)?;
    let mut records = Vec::with_capacity(steps);
    let mut wall = 0.0;
    for (index, samples) in plan.iter().take(warmup + steps).enumerate() {
        let elements: Vec<Tensor> = samples.iter().map(|&i| features(i, lengths[i])).collect();
        let batch = NestedTensor::builder()
            .ragged_dims(&[0])
            .tensors(&elements)?;
        let tokens: usize = samples.iter().map(|&i| lengths[i]).sum();
        let started = Instant::now();
        sgd.zero_grad();
        parallel.step(&step, &[&batch], &[], tokens)?;
        sgd.step();
        let seconds = started.elapsed().as_secs_f64();
        if index >= warmup {
            wall += seconds;
            let stats = parallel.last_step();
            records.push(StepRecord {
                seconds,
                wait: stats.wait_seconds,
                early: stats.launched_early,
                buckets: stats.buckets,
                tokens,
            });
        }
    }
    let alone = parallel.time_reduction(9)?;
    println!(
        "alone {alone} wall {wall} compiles {}",
        step.stats().compiles
    );
    for record in records {
        println!(
            "step {} {} {} {} {}",
            record.seconds, record.wait, record.early, record.buckets, record.tokens
        );
    }
    Ok(())
}

/// One worker's output: its steps, the reduction alone, its timed seconds.
struct Worker {
    steps: Vec<StepRecord>,
    alone: f64,
    wall: f64,
    compiles: u64,
}

fn parse(text: &str) -> Result<Worker> {
    let mut worker = Worker {
        steps: Vec::new(),
        alone: 0.0,
        wall: 0.0,
        compiles: 0,
    };
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["alone", alone, "wall", wall, "compiles", compiles] => {
                worker.alone = alone.parse()?;
                worker.wall = wall.parse()?;
                worker.compiles = compiles.parse()?;
            }
            ["step", seconds, wait, early, buckets, tokens] => worker.steps.push(StepRecord {
                seconds: seconds.parse()?,
                wait: wait.parse()?,
                early: early.parse()?,
                buckets: buckets.parse()?,
                tokens: tokens.parse()?,
            }),
            _ => {}
        }
    }
    if worker.steps.is_empty() {
        return Err(format!("a worker printed no steps:\n{text}").into());
    }
    Ok(worker)
}

/// What a run measures: timed and warm-up steps, how batches are planned and split,
/// the buckets' size.
#[derive(Clone, Copy, Debug)]
struct Setting {
    steps: usize,
    warmup: usize,
    sharding: Sharding,
    /// Samples sorted by length together (1: batches of random lengths).
    pool: usize,
    bucket_bytes: usize,
    /// Tokens of each rank's batch (the global batch's, divided by the ranks).
    tokens: usize,
}

/// Runs `world` workers (one thread each) and returns their outputs by rank.
fn run(world: usize, setting: Setting) -> Result<Vec<Worker>> {
    collect(spawn(world, setting)?)
}

/// Starts the `world` workers of one group.
fn spawn(world: usize, setting: Setting) -> Result<Vec<std::process::Child>> {
    let Setting {
        steps,
        warmup,
        sharding,
        pool,
        bucket_bytes,
        tokens,
    } = setting;
    let program = std::env::current_exe()?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let children = (0..world)
        .map(|rank| {
            Command::new(&program)
                .args([
                    "--worker",
                    "--steps",
                    &steps.to_string(),
                    "--warmup",
                    &warmup.to_string(),
                ])
                .args([
                    "--shard",
                    if sharding == Sharding::Tokens {
                        "tokens"
                    } else {
                        "samples"
                    },
                ])
                .args(["--bucket-kib", &(bucket_bytes >> 10).to_string()])
                .args(["--pool", &pool.to_string()])
                .args(["--tokens", &tokens.to_string()])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("NESTOR_THREADS", "1")
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    Ok(children)
}

/// The outputs of `children`, in order.
fn collect(children: Vec<std::process::Child>) -> Result<Vec<Worker>> {
    let mut workers = Vec::with_capacity(children.len());
    for child in children {
        let output = child.wait_with_output()?;
        if !output.status.success() {
            return Err(format!("a worker failed: {:?}", output.status).into());
        }
        workers.push(parse(&String::from_utf8_lossy(&output.stdout))?);
    }
    Ok(workers)
}

fn percentile(mut values: Vec<f64>, share: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let at = ((values.len() as f64 - 1.0) * share).round() as usize;
    values.get(at).copied().unwrap_or(0.0)
}

/// Tokens per second of a run: every rank's tokens over the slowest rank's seconds.
fn tokens_per_second(workers: &[Worker]) -> f64 {
    let tokens: usize = workers
        .iter()
        .flat_map(|w| &w.steps)
        .map(|s| s.tokens)
        .sum();
    let wall = workers.iter().map(|w| w.wall).fold(0.0, f64::max);
    tokens as f64 / wall.max(1e-12)
}

/// Per step, the slowest rank's compute (step less its wait) over the ranks' mean.
fn imbalance(workers: &[Worker]) -> Vec<f64> {
    let steps = workers[0].steps.len();
    (0..steps)
        .map(|step| {
            let compute: Vec<f64> = workers
                .iter()
                .map(|w| w.steps[step].seconds - w.steps[step].wait)
                .collect();
            let mean = compute.iter().sum::<f64>() / compute.len() as f64;
            compute.iter().copied().fold(0.0, f64::max) / mean.max(1e-12)
        })
        .collect()
}

/// Per step, the step time of the slowest rank (the step's time for the job).
fn step_times(workers: &[Worker]) -> Vec<f64> {
    let steps = workers[0].steps.len();
    (0..steps)
        .map(|step| {
            workers
                .iter()
                .map(|w| w.steps[step].seconds)
                .fold(0.0, f64::max)
        })
        .collect()
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut worker_mode, mut out) = (false, None);
    let mut setting = Setting {
        steps: 60,
        warmup: 6,
        sharding: Sharding::Tokens,
        pool: 512,
        bucket_bytes: BUCKET_BYTES,
        tokens: GLOBAL_TOKENS,
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--worker" => worker_mode = true,
            "--steps" => setting.steps = args.next().ok_or("--steps N")?.parse()?,
            "--warmup" => setting.warmup = args.next().ok_or("--warmup N")?.parse()?,
            "--pool" => setting.pool = args.next().ok_or("--pool N")?.parse()?,
            "--tokens" => setting.tokens = args.next().ok_or("--tokens N")?.parse()?,
            "--shard" => {
                setting.sharding = match args.next().as_deref() {
                    Some("samples") => Sharding::Samples,
                    _ => Sharding::Tokens,
                }
            }
            "--bucket-kib" => {
                setting.bucket_bytes = args.next().ok_or("--bucket-kib N")?.parse::<usize>()? << 10
            }
            "--out" => out = Some(std::path::PathBuf::from(args.next().ok_or("--out FOLDER")?)),
            other => {
                return Err(format!(
                    "unknown argument {other}: --steps N --warmup N --bucket-kib N --out FOLDER"
                )
                .into())
            }
        }
    }
    if worker_mode {
        return worker(&setting);
    }
    let Setting {
        steps,
        warmup,
        bucket_bytes,
        ..
    } = setting;
    let with = |sharding, pool| Setting {
        sharding,
        pool,
        tokens: GLOBAL_TOKENS / 2,
        ..setting
    };
    let single = run(
        1,
        Setting {
            tokens: GLOBAL_TOKENS,
            ..with(Sharding::Tokens, setting.pool)
        },
    )?;
    // The machine's ceiling: two processes doing a rank's work each at once, with no
    // communication between them.
    let apart = {
        let (first, second) = (
            spawn(1, with(Sharding::Tokens, setting.pool))?,
            spawn(1, with(Sharding::Tokens, setting.pool))?,
        );
        let mut workers = collect(first)?;
        workers.extend(collect(second)?);
        workers
    };
    let by_tokens = run(2, with(Sharding::Tokens, setting.pool))?;
    let by_samples = run(2, with(Sharding::Samples, setting.pool))?;
    // Batches of random lengths (no sorting): where sample sharding leaves stragglers.
    let random_tokens = run(2, with(Sharding::Tokens, 1))?;
    let random_samples = run(2, with(Sharding::Samples, 1))?;

    let (one, two) = (tokens_per_second(&single), tokens_per_second(&by_tokens));
    let alone = by_tokens.iter().map(|w| w.alone).fold(0.0, f64::max);
    // The communication a step did not hide: what the last rank to finish its backward
    // (the one that waits least) still waited.
    let exposed: Vec<f64> = (0..by_tokens[0].steps.len())
        .map(|step| {
            by_tokens
                .iter()
                .map(|w| w.steps[step].wait)
                .fold(f64::INFINITY, f64::min)
        })
        .collect();
    let exposed = percentile(exposed, 0.5);
    let hidden = (1.0 - exposed / alone.max(1e-12)).clamp(0.0, 1.0);
    let early = by_tokens[0].steps.iter().map(|s| s.early).sum::<usize>() as f64
        / by_tokens[0]
            .steps
            .iter()
            .map(|s| s.buckets)
            .sum::<usize>()
            .max(1) as f64;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();

    let mut text = String::new();
    let _ = writeln!(
        text,
        "# Data-parallel compiled training (nestor::distributed)\n"
    );
    let _ = writeln!(
        text,
        "`scripts/cargo run --release -p nestor-bench --bin distributed`, on {cpu} ({} cores). The report's encoder \
         (d {D_MODEL}, 4 heads, ff 1024, 2 layers) trained with SGD on global batches of about {GLOBAL_TOKENS} tokens \
         planned by `TokenBatches` from {SAMPLES} lognormal lengths (median 48, at most {MAX_LENGTH}); every process \
         on one thread (`NESTOR_THREADS=1`), Gloo on loopback; buckets of 1 MiB, then {} KiB; {steps} timed steps \
         after {warmup} warm-up steps (compiles: {} in the single process).\n",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        bucket_bytes >> 10,
        single[0].compiles,
    );
    let _ = writeln!(text, "| run | tokens/s | scaling |\n|---|---:|---:|");
    for (run, rate) in [
        ("1 process x 1 thread", one),
        (
            "2 processes x 1 thread apart (a rank's batches each, no communication: the machine's ceiling)",
            tokens_per_second(&apart),
        ),
        ("2 ranks x 1 thread, token-balanced", two),
        ("2 ranks x 1 thread, sample-balanced", tokens_per_second(&by_samples)),
    ] {
        let _ = writeln!(text, "| {run} | {rate:.0} | {:.2}x |", rate / one);
    }
    let _ = writeln!(text);
    let _ = writeln!(
        text,
        "All-reduce of the gradients ({} buckets) alone: {:.2} ms; left exposed after the backward (median over \
         steps of the smaller rank's wait): {:.2} ms, so **{:.0}% hidden**; {:.0}% of the buckets were launched from inside \
         the run, as soon as their last gradient was written (buckets hold the gradients in reverse creation order, \
         so the one with the first layers' waits for the backward's last steps).\n",
        by_tokens[0].steps[0].buckets,
        alone * 1e3,
        exposed * 1e3,
        hidden * 100.0,
        early * 100.0
    );
    let _ = writeln!(
        text,
        "| batches | sharding | step p50 | step p90 | slowest rank's compute / mean, p50 | p90 |\n\
         |---|---|---:|---:|---:|---:|"
    );
    let sorted = format!("lengths sorted in pools of {}", setting.pool);
    for (batches, name, workers) in [
        (sorted.as_str(), "tokens", &by_tokens),
        (sorted.as_str(), "samples", &by_samples),
        ("random lengths", "tokens", &random_tokens),
        ("random lengths", "samples", &random_samples),
    ] {
        let (times, ratios) = (step_times(workers), imbalance(workers));
        let _ = writeln!(
            text,
            "| {batches} | {name} | {:.1} ms | {:.1} ms | {:.2} | {:.2} |",
            percentile(times.clone(), 0.5) * 1e3,
            percentile(times, 0.9) * 1e3,
            percentile(ratios.clone(), 0.5),
            percentile(ratios, 0.9)
        );
    }
    print!("{text}");
    if let Some(folder) = out {
        std::fs::create_dir_all(&folder)?;
        std::fs::write(folder.join("distributed.md"), &text)?;
    }
    Ok(())
}
