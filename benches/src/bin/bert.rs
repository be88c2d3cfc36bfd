//! A BERT-large-shaped encoder (hidden 1024, 16 heads, feed-forward 4096; `--layers N`,
//! default 4) trained on real text (the `fortunes` package's quotations, as bytes:
//! every byte predicts the next, through a linear head) at occupancies near DanLing's
//! IMDB rows (20 / 35 / 77% of 512), in the form of DanLing's IMDB table: step time and
//! peak extra memory of nestor eager, nestor compiled (f32 and mixed precision) and what
//! a PyTorch user runs (`benches/bert.py`: `transformers`' BertModel on the padded batch,
//! eager and `torch.compile`, in f32 and under bf16 autocast, and the same layers on
//! `torch.nested`). Writes `bert.md`.
//!
//! ```sh
//! scripts/cargo build --release -p nestor-memcount -p nestor-bench
//! scripts/cargo run --release -p nestor-bench --bin bert -- --out docs/benchmarks
//! ```
//!
//! `--samples N` timed steps per cell (default 3), `--batch N` sequences a batch
//! (default 8), `--quick` one occupancy, `--precision f32|bf16` that precision's rows only
//! (default both; on hosts without bf16 units PyTorch's autocast steps take minutes). Peak memory is counted when `nestor-memcount`
//! is built next to the binary (the binary runs itself again with it preloaded; the
//! Python child inherits it). Random weights on both sides (a step's time and memory do
//! not depend on them); no dropout; a step is the mean next-byte cross entropy over the
//! real tokens, backward, SGD at rate 1e-5.

use std::fmt::Write as _;

use nestor::nn::{Bert, BertConfig};
use nestor::{compile, Dense, LossReduction, NestedTensor};
use nestor_bench::lengths::{lengths, occupancy};
use nestor_bench::measure::{peak_bytes, rerun_with_memcount, time_in_turns};
use nestor_bench::script::{cpu_name, run_script, Cell, Measured};
use nestor_bench::Result;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// The longest sequence (one of every batch has it).
const LONGEST: i64 = 512;
/// Model width, heads, feed-forward width: BERT-large's.
const SHAPE: (i64, i64, i64) = (1024, 16, 4096);
/// Byte ids.
const VOCABULARY: i64 = 256;
/// DanLing's IMDB occupancies.
const OCCUPANCIES: [f64; 3] = [0.20, 0.35, 0.77];
/// The quotations' folder (Debian's `fortunes`, which `scripts/setup.sh` installs).
const CORPUS: &str = "/usr/share/games/fortunes";
/// The script, carried in the binary.
const SCRIPT: &str = include_str!("../../bert.py");

/// nestor's columns.
const NESTOR: [&str; 3] = [
    "nestor eager",
    "nestor compiled",
    "nestor compiled, mixed bf16",
];

/// The options of `benches/bert.py`, in its order.
const PYTORCH: [&str; 5] = [
    "padded eager",
    "padded torch.compile",
    "padded eager autocast bf16",
    "padded torch.compile autocast bf16",
    "torch.nested jagged eager",
];

/// Whether a column (nestor's or PyTorch's, by name) is a bf16 one.
fn is_bf16(name: &str) -> bool {
    name.contains("bf16")
}

/// A step of one column: runs once.
type Step<'a> = Box<dyn FnMut() -> Result<()> + 'a>;

/// Every quotation file's bytes, one after another (no byte is 0, the padding id).
fn corpus() -> Result<Vec<u8>> {
    let mut text = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(CORPUS)
        .map_err(|error| format!("{CORPUS}: {error} (scripts/setup.sh installs `fortunes`)"))?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|path| path.is_file() && path.extension().is_none())
        .collect();
    files.sort();
    for file in files {
        text.extend(std::fs::read(file)?.into_iter().filter(|&byte| byte != 0));
    }
    if text.len() < 2 {
        return Err(format!("{CORPUS} holds no text").into());
    }
    Ok(text)
}

/// Sequences of `lengths + 1` consecutive bytes of `text` (inputs and next-byte
/// targets), from `start` on, around the end.
fn sequences(text: &[u8], lengths: &[i64], start: usize) -> Vec<Vec<i64>> {
    let mut at = start;
    lengths
        .iter()
        .map(|&length| {
            let sequence = (0..=length as usize)
                .map(|offset| i64::from(text[(at + offset) % text.len()]))
                .collect();
            at += length as usize + 1;
            sequence
        })
        .collect()
}

/// `batch` lengths whose occupancy is nearest `goal` (`lengths` draws around a mean
/// whose clamping to `1..=LONGEST` moves the occupancy off its target).
fn lengths_near(batch: i64, goal: f64, seed: u64) -> Vec<i64> {
    (1..=100)
        .map(|percent| lengths(batch, LONGEST, f64::from(percent) / 100.0, seed))
        .min_by(|a, b| {
            let off = |lengths: &[i64]| (occupancy(lengths, LONGEST) - goal).abs();
            off(a).total_cmp(&off(b))
        })
        .unwrap_or_default()
}

/// The BERT of these rows.
fn config(layers: usize) -> BertConfig {
    BertConfig {
        vocab_size: VOCABULARY,
        hidden_size: SHAPE.0,
        num_hidden_layers: layers,
        num_attention_heads: SHAPE.1,
        intermediate_size: SHAPE.2,
        max_position_embeddings: LONGEST,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        pad_token_id: Some(0),
    }
}

/// The model and its next-byte head.
struct Model {
    bert: Bert,
    head: (Tensor, Tensor),
}

impl Model {
    fn new(store: &nn::VarStore, layers: usize) -> Self {
        let root = store.root();
        Self {
            bert: Bert::new(&(&root / "bert"), &config(layers), false),
            head: (
                root.randn("head_weight", &[VOCABULARY, SHAPE.0], 0.0, 0.02),
                root.zeros("head_bias", &[VOCABULARY]),
            ),
        }
    }

    /// The mean next-byte cross entropy of byte ids and their targets (`[B; L]` each).
    fn loss(&self, ids: &NestedTensor, targets: &NestedTensor) -> nestor::Result<Dense> {
        self.bert
            .forward(ids, None, &Bert::positions(ids)?)?
            .linear(&self.head.0, Some(&self.head.1))?
            .cross_entropy(targets, -100, 0.0, LossReduction::Mean)?
            .into_dense_handle()
    }
}

/// nestor's cells of one batch; the columns `wanted` refuses are not run.
fn nestor_cells(
    sequences: &[Vec<i64>],
    layers: usize,
    samples: usize,
    wanted: &dyn Fn(&str) -> bool,
) -> Result<Vec<Cell>> {
    tch::manual_seed(0);
    let ragged = |part: &dyn Fn(&[i64]) -> &[i64]| {
        let elements: Vec<Tensor> = sequences
            .iter()
            .map(|sequence| Tensor::from_slice(part(sequence)))
            .collect();
        NestedTensor::builder().ragged_dims(&[0]).tensors(&elements)
    };
    let ids = ragged(&|sequence| &sequence[..sequence.len() - 1])?;
    let targets = ragged(&|sequence| &sequence[1..])?;
    let store = nn::VarStore::new(Device::Cpu);
    let model = Model::new(&store, layers);
    let sgd = || nn::Sgd::default().build(&store, 1e-5);
    let (mut eager_sgd, mut compiled_sgd, mut mixed_sgd) = (sgd()?, sgd()?, sgd()?);
    let (ids, targets, model) = (&ids, &targets, &model);
    let traced = move |x: &[NestedTensor], _: &[Dense]| model.loss(&x[0], &x[1]);
    let compiled = compile("bert_step", traced).train(&store);
    let mixed = compile("bert_step_mixed", traced)
        .train(&store)
        .autocast(Kind::BFloat16);
    let mut steps: Vec<Step<'_>> = vec![
        Box::new(move || {
            eager_sgd.zero_grad();
            model.loss(ids, targets)?.into_tensor().f_backward()?;
            eager_sgd.step();
            Ok(())
        }),
        Box::new(move || {
            compiled_sgd.zero_grad();
            compiled.call(&[ids, targets], &[])?;
            compiled_sgd.step();
            Ok(())
        }),
        Box::new(move || {
            mixed_sgd.zero_grad();
            mixed.call(&[ids, targets], &[])?;
            mixed_sgd.step();
            Ok(())
        }),
    ];
    // A column that fails its first call is a cell saying why; the others are timed.
    let mut failed: Vec<Option<String>> = Vec::new();
    for (step, name) in steps.iter_mut().zip(NESTOR) {
        failed.push(if wanted(name) {
            step().err().map(|error| error.to_string())
        } else {
            Some("not run".into())
        });
    }
    let mut working: Vec<&mut Step<'_>> = steps
        .iter_mut()
        .zip(&failed)
        .filter(|(_, failed)| failed.is_none())
        .map(|(step, _)| step)
        .collect();
    let timings = {
        let mut turns: Vec<&mut dyn FnMut() -> Result<()>> = working
            .iter_mut()
            .map(|step| step.as_mut() as &mut dyn FnMut() -> Result<()>)
            .collect();
        time_in_turns(samples, &mut turns)?
    };
    let mut measured = Vec::new();
    for (step, timing) in working.into_iter().zip(timings) {
        let peak = peak_bytes(&mut **step)?;
        measured.push(Measured { timing, peak });
    }
    let mut measured = measured.into_iter();
    Ok(failed
        .into_iter()
        .map(|failed| match failed {
            Some(why) => Err(why),
            None => measured.next().ok_or_else(|| "not measured".to_owned()),
        })
        .collect())
}

/// A time cell and its ratio to `padded`.
fn time_cell(cell: &Cell, padded: Option<f64>) -> String {
    match (cell, padded) {
        (Ok(measured), Some(padded)) => format!(
            "{:.0} ms ({:.2}x)",
            measured.timing.median * 1e3,
            padded / measured.timing.median
        ),
        (Ok(measured), None) => format!("{:.0} ms", measured.timing.median * 1e3),
        (Err(why), _) => format!("n/a ({})", why.replace('|', "/")),
    }
}

/// A memory cell and its saving against `padded`.
fn memory_cell(cell: &Cell, padded: Option<u64>) -> String {
    match (
        cell.as_ref().ok().and_then(|measured| measured.peak),
        padded,
    ) {
        (Some(peak), Some(padded)) if padded > 0 => format!(
            "{:.0} MiB ({:+.0}%)",
            peak as f64 / 1048576.0,
            (peak as f64 / padded as f64 - 1.0) * 100.0
        ),
        (Some(peak), _) => format!("{:.0} MiB", peak as f64 / 1048576.0),
        (None, _) => "-".into(),
    }
}

fn main() -> Result<()> {
    if let Some(code) = rerun_with_memcount("bert")? {
        std::process::exit(code);
    }
    let mut args = std::env::args().skip(1);
    let (mut out, mut samples, mut quick, mut layers, mut batch) = (None, 3usize, false, 4, 8);
    // `Some(bf16)`: only f32's rows or only bf16's.
    let mut precision: Option<bool> = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = Some(std::path::PathBuf::from(args.next().ok_or("--out DIR")?)),
            "--samples" => samples = args.next().ok_or("--samples N")?.parse()?,
            "--layers" => layers = args.next().ok_or("--layers N")?.parse()?,
            "--batch" => batch = args.next().ok_or("--batch N")?.parse()?,
            "--quick" => quick = true,
            "--precision" => {
                precision = match args.next().as_deref() {
                    Some("f32") => Some(false),
                    Some("bf16") => Some(true),
                    _ => return Err("--precision needs f32 or bf16".into()),
                }
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let wanted = |name: &str| precision.is_none_or(|bf16| is_bf16(name) == bf16);
    let text = corpus()?;
    let occupancies: &[f64] = if quick {
        &OCCUPANCIES[..1]
    } else {
        &OCCUPANCIES
    };
    let batches: Vec<Vec<Vec<i64>>> = occupancies
        .iter()
        .zip(1u64..)
        .map(|(&goal, seed)| {
            let lengths = lengths_near(batch, goal, seed);
            sequences(&text, &lengths, seed as usize * 100_000)
        })
        .collect();
    let mut args: Vec<String> = vec![
        "--samples".into(),
        samples.to_string(),
        "--threads".into(),
        tch::get_num_threads().to_string(),
        "--hidden".into(),
        SHAPE.0.to_string(),
        "--heads".into(),
        SHAPE.1.to_string(),
        "--intermediate".into(),
        SHAPE.2.to_string(),
        "--layers".into(),
        layers.to_string(),
        "--vocabulary".into(),
        VOCABULARY.to_string(),
        "--positions".into(),
        LONGEST.to_string(),
        "--precision".into(),
        match precision {
            None => "both",
            Some(false) => "f32",
            Some(true) => "bf16",
        }
        .into(),
    ];
    for sequences in &batches {
        let joined: Vec<String> = sequences
            .iter()
            .map(|sequence| {
                let ids: Vec<String> = sequence.iter().map(i64::to_string).collect();
                ids.join(",")
            })
            .collect();
        args.extend(["--batch".into(), joined.join(":")]);
    }
    eprintln!("bert: PyTorch");
    let torch = run_script(("bert.py", SCRIPT), &args, batches.len(), &PYTORCH)?;
    let mut text = String::new();
    let _ = writeln!(
        text,
        "# A BERT-large-shaped encoder trained on ragged text\n"
    );
    let _ = writeln!(
        text,
        "Written by `scripts/cargo run --release -p nestor-bench --bin bert -- --out docs/benchmarks` \
         ({}, {} threads, {samples} timed steps a cell, medians; ratios within one run). \
         Hidden {}, {} heads, feed-forward {}, {layers} layers (BERT-large has 24: {layers} keep a \
         run on 2 cores within minutes), byte vocabulary, {batch} sequences a batch, the longest \
         {LONGEST}; the text is the `fortunes` package's quotations. A training step: the mean \
         next-byte cross entropy over the real tokens, backward, SGD. Peak memory: the most \
         bytes a step allocates beyond what was allocated before it (the counting malloc, both \
         sides). In parentheses: speed against PyTorch's padded eager step, and memory \
         against its.\n",
        cpu_name(),
        tch::get_num_threads(),
        SHAPE.0,
        SHAPE.1,
        SHAPE.2,
    );
    for ((sequences, torch), &target) in batches.iter().zip(&torch).zip(occupancies) {
        let tokens: usize = sequences.iter().map(|sequence| sequence.len() - 1).sum();
        let occupancy = tokens as f64 / (sequences.len() as f64 * LONGEST as f64);
        eprintln!("bert: nestor at {:.0}%", occupancy * 100.0);
        let ours = nestor_cells(sequences, layers, samples, &wanted)?;
        let padded = torch[0].as_ref().ok();
        let (padded_time, padded_peak) = (
            padded.map(|measured| measured.timing.median),
            padded.and_then(|measured| measured.peak),
        );
        let _ = writeln!(
            text,
            "## Occupancy {:.0}% (DanLing's {:.0}%)\n\n| | step time | peak extra memory |\n|---|---:|---:|",
            occupancy * 100.0,
            target * 100.0
        );
        for (name, cell) in PYTORCH
            .iter()
            .map(|name| format!("PyTorch {name}"))
            .zip(torch)
            .chain(NESTOR.iter().map(|name| name.to_string()).zip(&ours))
            .filter(|(name, _)| wanted(name))
        {
            let _ = writeln!(
                text,
                "| {name} | {} | {} |",
                time_cell(cell, padded_time),
                memory_cell(cell, padded_peak)
            );
        }
        // Same dtype against same dtype: f32 against PyTorch's f32 options (padded eager,
        // torch.compile, torch.nested), mixed precision against its autocast ones.
        let best = |cells: &[&Cell]| {
            cells
                .iter()
                .filter_map(|cell| cell.as_ref().ok().map(|measured| measured.timing.median))
                .min_by(f64::total_cmp)
        };
        let pairs = [
            ("f32", [&torch[0], &torch[1], &torch[4]].to_vec(), &ours[1]),
            ("bf16", [&torch[2], &torch[3]].to_vec(), &ours[2]),
        ];
        for (dtype, theirs, compiled) in pairs {
            if let (Some(theirs), Some(compiled)) = (best(&theirs), best(&[compiled])) {
                let _ = writeln!(
                    text,
                    "\nnestor compiled ({dtype}) against the best PyTorch option in {dtype}: \
                     {:.2}x.",
                    theirs / compiled
                );
            }
        }
        let _ = writeln!(text);
    }
    match out {
        Some(folder) => {
            std::fs::create_dir_all(&folder)?;
            std::fs::write(folder.join("bert.md"), &text)?;
        }
        None => print!("{text}"),
    }
    Ok(())
}
