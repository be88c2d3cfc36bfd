//! ResNet-50 on batches of 16 images whose sides are drawn up to 224, at occupancies
//! near DanLing's 41 / 52 / 81%: nestor eager and compiled against what a PyTorch user
//! runs (`benches/resnet50.py`: torchvision's resnet50 on the padded batch, eager,
//! channels-last and `torch.compile`, and a loop over the images), inference and a
//! training step, in f32 and bf16. Writes `resnet50.md`.
//!
//! ```sh
//! scripts/cargo run --release -p nestor-bench --bin resnet50 -- --out docs/benchmarks
//! ```
//!
//! `--samples N` timed steps per cell (default 5); `--quick` one occupancy, f32;
//! `--precision f32|bf16` that precision's rows only (default both; on hosts without
//! bf16 hardware libtorch's bf16 cells take minutes).
//! Both sides use random weights (the time of a step does not depend on them) and batch
//! norms on their running statistics (eval mode: nestor's compiled ResNet trains so);
//! a training step is the mean of the scores, backward, SGD at rate 1e-5. bf16: nestor
//! eager runs the model and images converted to bf16 (libtorch's bf16 kernels), nestor
//! compiled the f32 model in mixed precision (`autocast(Kind::BFloat16)`: bf16
//! products, f32 activations) and the bf16 model; PyTorch runs under
//! `torch.autocast("cpu", dtype=torch.bfloat16)`.

use std::fmt::Write as _;

use nestor::nn::ResNet;
use nestor::{compile, Dense, NestedTensor};
use nestor_bench::lengths::image_sizes;
use nestor_bench::measure::time_in_turns;
use nestor_bench::script::{cpu_name, run_script, Cell, Measured};
use nestor_bench::Result;
use tch::nn::{self, OptimizerConfig};
use tch::{Device, Kind, Tensor};

/// Images per batch.
const BATCH: i64 = 16;
/// The largest side (one image of every batch has it on both sides).
const SIDE: i64 = 224;
/// DanLing's occupancies.
const OCCUPANCIES: [f64; 3] = [0.41, 0.52, 0.81];
/// The script, carried in the binary.
const SCRIPT: &str = include_str!("../../resnet50.py");

/// A step of one column: runs once.
type Step<'a> = Box<dyn FnMut() -> Result<()> + 'a>;

/// Image sizes of a batch whose occupancy (pixels over the padded batch's) is nearest
/// `goal`: `image_sizes` draws for a mean area, which the clamped sides lower.
fn batch_near(goal: f64, seed: u64) -> (Vec<(i64, i64)>, f64) {
    let occupancy = |sizes: &[(i64, i64)]| {
        sizes.iter().map(|&(h, w)| h * w).sum::<i64>() as f64 / (BATCH * SIDE * SIDE) as f64
    };
    (30..=100)
        .map(|percent| image_sizes(BATCH, SIDE, f64::from(percent) / 100.0, seed))
        .map(|sizes| {
            let share = occupancy(&sizes);
            (sizes, share)
        })
        .min_by(|a, b| (a.1 - goal).abs().total_cmp(&(b.1 - goal).abs()))
        .unwrap_or_default()
}

/// The columns nestor runs.
const NESTOR: [&str; 3] = [
    "nestor eager",
    "nestor compiled",
    "nestor compiled, bf16 model",
];

/// The options of `benches/resnet50.py`, in its order.
const PYTORCH: [&str; 4] = [
    "padded eager",
    "padded eager channels-last",
    "padded torch.compile channels-last",
    "per-image loop eager",
];

/// The scores of `model`, as a traced function.
fn scores_of(
    model: &ResNet,
) -> impl Fn(&[NestedTensor], &[Dense]) -> nestor::Result<NestedTensor> + '_ {
    move |x, _| model.forward(&x[0], false)
}

/// The mean score of `model` (a training step's loss), as a traced function.
fn loss_of(model: &ResNet) -> impl Fn(&[NestedTensor], &[Dense]) -> nestor::Result<Dense> + '_ {
    move |x, _| {
        model
            .forward(&x[0], false)?
            .mean(&[], false)?
            .into_dense_handle()
    }
}

/// nestor's cells of one batch, mode and dtype.
fn nestor_cells(
    sizes: &[(i64, i64)],
    training: bool,
    bf16: bool,
    samples: usize,
) -> Result<Vec<Cell>> {
    tch::manual_seed(0);
    let images: Vec<Tensor> = sizes
        .iter()
        .map(|&(h, w)| Tensor::randn([3, h, w], (Kind::Float, Device::Cpu)))
        .collect();
    let images = NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&images)?;
    let store = nn::VarStore::new(Device::Cpu);
    let resnet = ResNet::new(&store.root(), 50, 1000)?;
    // The model and images in bf16: the eager bf16 column and the compiled bf16 model.
    let mut bf16_store = nn::VarStore::new(Device::Cpu);
    let bf16_resnet = ResNet::new(&bf16_store.root(), 50, 1000)?;
    bf16_store.copy(&store)?;
    bf16_store.bfloat16();
    let bf16_images = images.to_kind(Kind::BFloat16)?;
    let optimizer = |store: &nn::VarStore| nn::Sgd::default().build(store, 1e-5);
    let (mut sgd, mut bf16_sgd, mut model_sgd) = (
        optimizer(&store)?,
        optimizer(&bf16_store)?,
        optimizer(&bf16_store)?,
    );
    let (eager_model, eager_images, eager_sgd) = if bf16 {
        (&bf16_resnet, &bf16_images, &mut bf16_sgd)
    } else {
        (&resnet, &images, &mut sgd)
    };
    let eager: Step<'_> = if training {
        Box::new(move || {
            eager_sgd.zero_grad();
            let loss = eager_model
                .forward(eager_images, false)?
                .values()
                .f_mean(Kind::Float)?;
            loss.f_backward()?;
            eager_sgd.step();
            Ok(())
        })
    } else {
        Box::new(move || {
            tch::no_grad(|| eager_model.forward(eager_images, false))?;
            Ok(())
        })
    };
    let mut steps = vec![eager];
    // The compiled f32 model (in mixed precision for bf16) and the compiled bf16 model.
    let mut compiled_sgd = optimizer(&store)?;
    let precision = if bf16 { Kind::BFloat16 } else { Kind::Float };
    if training {
        let f32_step = compile("resnet50_step", loss_of(&resnet))
            .train(&store)
            .autocast(precision);
        let bf16_step = compile("resnet50_bf16_step", loss_of(&bf16_resnet)).train(&bf16_store);
        let images = &images;
        let bf16_images = &bf16_images;
        steps.push(Box::new(move || {
            compiled_sgd.zero_grad();
            f32_step.call(&[images], &[])?;
            compiled_sgd.step();
            Ok(())
        }));
        steps.push(Box::new(move || {
            model_sgd.zero_grad();
            bf16_step.call(&[bf16_images], &[])?;
            model_sgd.step();
            Ok(())
        }));
    } else {
        let f32_model = compile("resnet50", scores_of(&resnet)).autocast(precision);
        let bf16_model = compile("resnet50_bf16", scores_of(&bf16_resnet));
        let (images, bf16_images) = (&images, &bf16_images);
        steps.push(Box::new(move || {
            tch::no_grad(|| f32_model.call(&[images], &[]))?;
            Ok(())
        }));
        steps.push(Box::new(move || {
            tch::no_grad(|| bf16_model.call(&[bf16_images], &[]))?;
            Ok(())
        }));
    }
    if !bf16 {
        // The bf16 model is the bf16 rows' column.
        steps.pop();
    }
    // A column that fails its first call is a cell saying why; the others are timed.
    let mut cells: Vec<Option<Cell>> = Vec::new();
    let mut working: Vec<Step<'_>> = Vec::new();
    for mut step in steps {
        match step() {
            Ok(()) => {
                cells.push(None);
                working.push(step);
            }
            Err(error) => cells.push(Some(Err(error.to_string()))),
        }
    }
    let mut turns: Vec<&mut dyn FnMut() -> Result<()>> = working
        .iter_mut()
        .map(|step| step.as_mut() as &mut dyn FnMut() -> Result<()>)
        .collect();
    let mut timings = time_in_turns(samples, &mut turns)?.into_iter();
    Ok(cells
        .into_iter()
        .map(|cell| {
            cell.unwrap_or_else(|| {
                let timing = timings.next().ok_or("not timed")?;
                Ok(Measured { timing, peak: None })
            })
        })
        .collect())
}

/// PyTorch's cells of every batch for one mode and dtype (rows of [`PYTORCH`] options).
fn pytorch_cells(
    batches: &[Vec<(i64, i64)>],
    training: bool,
    bf16: bool,
    samples: usize,
) -> Result<Vec<Vec<Cell>>> {
    let mut args: Vec<String> = [
        "--mode",
        if training { "training" } else { "inference" },
        "--dtype",
        if bf16 { "bf16" } else { "f32" },
        "--samples",
        &samples.to_string(),
        "--threads",
        &tch::get_num_threads().to_string(),
    ]
    .map(String::from)
    .into();
    for sizes in batches {
        let sizes: Vec<String> = sizes.iter().map(|(h, w)| format!("{h}x{w}")).collect();
        args.extend(["--batch".into(), sizes.join(",")]);
    }
    run_script(("resnet50.py", SCRIPT), &args, batches.len(), &PYTORCH)
}

/// A cell as the table shows it.
fn shown(cell: &Cell) -> String {
    match cell {
        Ok(measured) => format!("{:.0} ms", measured.timing.median * 1e3),
        Err(why) => format!("n/a ({})", why.replace('|', "/")),
    }
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut out, mut samples, mut quick) = (None, 5usize, false);
    // `Some(bf16)`: only f32's rows or only bf16's.
    let mut precision: Option<bool> = None;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => out = Some(std::path::PathBuf::from(args.next().ok_or("--out DIR")?)),
            "--samples" => samples = args.next().ok_or("--samples N")?.parse()?,
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
    let occupancies: &[f64] = if quick {
        &OCCUPANCIES[..1]
    } else {
        &OCCUPANCIES
    };
    let batches: Vec<(Vec<(i64, i64)>, f64)> = occupancies
        .iter()
        .zip(1u64..)
        .map(|(&goal, seed)| batch_near(goal, seed))
        .collect();
    let sizes: Vec<Vec<(i64, i64)>> = batches.iter().map(|(sizes, _)| sizes.clone()).collect();
    let cpu = cpu_name();
    let mut text = String::new();
    let _ = writeln!(text, "# ResNet-50 on ragged image batches\n");
    let _ = writeln!(
        text,
        "Written by `scripts/cargo run --release -p nestor-bench --bin resnet50 -- --out docs/benchmarks` \
         ({cpu}, {} threads, {samples} timed steps a cell, medians; ratios within one run). \
         {BATCH} images a batch, sides drawn up to {SIDE} (one image {SIDE}x{SIDE}, so every padded \
         batch is [{BATCH}, 3, {SIDE}, {SIDE}]); random weights; batch norms on their running \
         statistics (eval mode) on both sides; a training step is the mean of the scores, \
         backward, SGD. bf16: nestor eager on the model and images converted to bf16, nestor \
         compiled on the f32 model in mixed precision (`autocast(Kind::BFloat16)`) and on the \
         bf16 model; PyTorch under `torch.autocast(\"cpu\", dtype=torch.bfloat16)`. The \
         last column is the best PyTorch option over nestor's best compiled one.\n",
        tch::get_num_threads()
    );
    let dtypes: &[bool] = match (precision, quick) {
        (Some(true), _) => &[true],
        (Some(false), _) | (None, true) => &[false],
        (None, false) => &[false, true],
    };
    for &bf16 in dtypes {
        for training in [false, true] {
            let mode = if training {
                "training step"
            } else {
                "inference"
            };
            let dtype = if bf16 { "bf16" } else { "f32" };
            eprintln!("resnet50: {mode}, {dtype}");
            let torch = pytorch_cells(&sizes, training, bf16, samples)?;
            let columns = if bf16 { NESTOR.len() } else { NESTOR.len() - 1 };
            let _ = writeln!(text, "## {mode}, {dtype}\n");
            let header: Vec<&str> = NESTOR[..columns].iter().chain(&PYTORCH).copied().collect();
            let _ = writeln!(
                text,
                "| occupancy | {} | best PyTorch / nestor compiled |\n|---|{}---:|",
                header.join(" | "),
                "---:|".repeat(header.len())
            );
            for ((sizes, occupancy), torch) in batches.iter().zip(&torch) {
                let ours = nestor_cells(sizes, training, bf16, samples)?;
                let best = |cells: &[Cell]| {
                    cells
                        .iter()
                        .filter_map(|cell| {
                            cell.as_ref().ok().map(|measured| measured.timing.median)
                        })
                        .min_by(f64::total_cmp)
                };
                let ratio = match (best(torch), best(&ours[1..])) {
                    (Some(theirs), Some(compiled)) => format!("{:.2}x", theirs / compiled),
                    _ => "n/a".into(),
                };
                let cells: Vec<String> = ours.iter().chain(torch).map(shown).collect();
                let _ = writeln!(
                    text,
                    "| {:.0}% | {} | {ratio} |",
                    occupancy * 100.0,
                    cells.join(" | ")
                );
            }
            let _ = writeln!(text);
        }
    }
    match out {
        Some(folder) => {
            std::fs::create_dir_all(&folder)?;
            std::fs::write(folder.join("resnet50.md"), &text)?;
        }
        None => print!("{text}"),
    }
    Ok(())
}
