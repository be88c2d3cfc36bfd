//! Per-step timings of host runs: what each step of a program is ([`StepKind`], a
//! label with the run's sizes), how long it took, the FLOPs of its products and the
//! bytes it moved ([`StepTiming`]), recorded by [`Stats`] when asked
//! ([`Stats::record_steps`]) and printed to stderr with `NESTOR_PROFILE`.

use nestor_passes::step::{AttentionGrad, AttentionPart, Gemm, PairGemm, SumRows, Window};
use nestor_passes::{Program, Slot, Step, WindowKind};

use super::Sizes;
use crate::Stats;

/// What kind of work a step does, as a profile groups it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StepKind {
    /// A product over every row: a linear layer or its input's gradient
    /// (`Step::Gemm`).
    Gemm,
    /// A product summed over every row: a weight gradient (`Step::SumRows` of two
    /// operands).
    WeightGradient,
    /// Products per element of a jagged pair (scores, their mix, distances).
    PairGemm,
    /// Varlen attention's forward.
    Attention,
    /// Varlen attention's gradient (and its softmax statistics).
    AttentionGradient,
    /// Convolutions and their gradients over packed images.
    Convolution,
    /// Pooling, image means, resizing and their gradients.
    Pooling,
    /// Elementwise kernels (fused chains included).
    Pointwise,
    /// Row kernels: norms, softmax, row reductions.
    Row,
    /// Segmented kernels over each element's rows.
    Segment,
    /// Column sums over every row (bias gradients, means over a batch).
    Reduction,
    /// Data movement: inserts, gathers, padding and unpadding.
    Copy,
    /// Everything else: dropout masks, one-hot rows, embedding gradients, lengths as
    /// numbers, per-element regions run through libtorch.
    Other,
}

impl StepKind {
    /// Its name in a profile.
    pub fn name(self) -> &'static str {
        match self {
            StepKind::Gemm => "GEMM",
            StepKind::WeightGradient => "weight gradient",
            StepKind::PairGemm => "pair GEMM",
            StepKind::Attention => "attention",
            StepKind::AttentionGradient => "attention gradient",
            StepKind::Convolution => "convolution",
            StepKind::Pooling => "pooling",
            StepKind::Pointwise => "pointwise",
            StepKind::Row => "row",
            StepKind::Segment => "segment",
            StepKind::Reduction => "column sums",
            StepKind::Copy => "copy",
            StepKind::Other => "other",
        }
    }

    /// Whether the step's time is spent in products (measured in FLOP/s; the others in
    /// bytes moved per second).
    pub fn is_product(self) -> bool {
        matches!(
            self,
            StepKind::Gemm
                | StepKind::WeightGradient
                | StepKind::PairGemm
                | StepKind::Attention
                | StepKind::AttentionGradient
                | StepKind::Convolution
        )
    }
}

/// One step of one run.
#[derive(Clone, Debug, PartialEq)]
pub struct StepTiming {
    /// Its index in the program.
    pub step: usize,
    /// What kind of work it does.
    pub kind: StepKind,
    /// What it is, with this run's sizes (`gemm 1388x256 -> 768`).
    pub label: String,
    /// Wall-clock seconds it took.
    pub seconds: f64,
    /// FLOPs its products performed (a multiply-add counts 2, recomputations inside the
    /// step included; 0 for steps without products).
    pub flops: u64,
    /// Bytes it read and wrote: every buffer it reads, once, and the one it writes.
    pub bytes: u64,
}

impl StepTiming {
    /// Achieved GFLOP/s of its products (0 for a step without products).
    pub fn gflops(&self) -> f64 {
        rate(self.flops, self.seconds)
    }

    /// Achieved GB/s of the bytes it moved.
    pub fn gigabytes_per_second(&self) -> f64 {
        rate(self.bytes, self.seconds)
    }
}

/// `count / seconds / 1e9` (0 for no time).
fn rate(count: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        count as f64 / seconds / 1e9
    } else {
        0.0
    }
}

/// The steps of one run, in program order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunProfile {
    /// Every step that ran.
    pub steps: Vec<StepTiming>,
}

impl RunProfile {
    /// Seconds of all its steps.
    pub fn seconds(&self) -> f64 {
        self.steps.iter().map(|step| step.seconds).sum()
    }
}

/// Whether a run times its steps: `stats` records them, or `NESTOR_PROFILE` prints them
/// (otherwise the run does not read the clock).
pub(crate) fn wanted(stats: &Stats) -> bool {
    stats.recording_steps() || printing()
}

/// Whether `NESTOR_PROFILE` asks for per-step timings on stderr.
fn printing() -> bool {
    static PRINT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *PRINT.get_or_init(|| std::env::var_os("NESTOR_PROFILE").is_some())
}

/// The timing of step `index` of `program`, which took `seconds` and moved `bytes` in
/// a run of `sizes`; printed with `NESTOR_PROFILE`.
pub(crate) fn timing(
    program: &Program,
    index: usize,
    sizes: &Sizes,
    seconds: f64,
    bytes: u64,
) -> StepTiming {
    let step = &program.steps[index];
    let (kind, label, flops) = describe(program, step, sizes);
    if printing() {
        eprintln!(
            "nestor profile: step {index} {:.1} us {label}",
            seconds * 1e6
        );
    }
    StepTiming {
        step: index,
        kind,
        label,
        seconds,
        flops,
        bytes,
    }
}

/// A step's kind, label (with the run's sizes) and the FLOPs of its products.
fn describe(program: &Program, step: &Step, sizes: &Sizes) -> (StepKind, String, u64) {
    let rows_of = |slot: Slot| sizes.rows(program.info(slot).rows).max(0) as u64;
    let times = |factors: &[i64]| {
        factors
            .iter()
            .fold(2u64, |product, &f| product.saturating_mul(f.max(0) as u64))
    };
    match step {
        Step::Gemm(Gemm {
            rows,
            k,
            n,
            epilogue,
            ..
        }) => {
            let rows = sizes.rows(*rows);
            let then = if epilogue.is_some() {
                " + epilogue"
            } else {
                ""
            };
            (
                StepKind::Gemm,
                format!("gemm {rows}x{k} -> {n}{then}"),
                times(&[rows, *k, *n]),
            )
        }
        Step::SumRows(SumRows {
            a,
            times: product,
            plain,
            rows,
            m,
            n,
            ..
        }) => {
            let rows = sizes.rows(*rows);
            let also = if plain.is_some() {
                " and of values"
            } else {
                ""
            };
            match (a, product) {
                (Some(_), _) => (
                    StepKind::WeightGradient,
                    format!("sum_rows {m}x{rows} . {rows}x{n}"),
                    times(&[rows, *m, *n]),
                ),
                (None, Some(_)) => (
                    StepKind::Reduction,
                    format!("column sums of products{also} {rows}x{n}"),
                    0,
                ),
                (None, None) => (StepKind::Reduction, format!("column sums {rows}x{n}"), 0),
            }
        }
        Step::PairGemm(PairGemm {
            rows,
            columns,
            width,
            mix,
            distance,
            ..
        }) => {
            let pairs = pairs(sizes, *rows, *columns, false);
            let what = match (distance, mix) {
                (Some(_), _) => "cdist",
                (None, true) => "pair mix",
                (None, false) => "pair scores",
            };
            (
                StepKind::PairGemm,
                format!("{what} width {width}, {pairs} pairs"),
                times(&[pairs, *width]),
            )
        }
        Step::Attention(attention) => {
            let pairs = pairs(
                sizes,
                attention.q_lengths,
                attention.k_lengths,
                attention.causal,
            );
            // Scores (head_dim) and their mix with the values (value_dim).
            let width = attention.head_dim.saturating_add(attention.value_dim);
            (
                StepKind::Attention,
                format!(
                    "attention {} heads x {}, {pairs} pairs{}",
                    attention.heads,
                    attention.head_dim,
                    causal_label(attention.causal)
                ),
                times(&[pairs, attention.heads, width]),
            )
        }
        Step::AttentionGrad(AttentionGrad {
            q_lengths,
            k_lengths,
            heads,
            head_dim,
            causal,
            part,
            ..
        }) => {
            let pairs = pairs(sizes, *q_lengths, *k_lengths, *causal);
            // Products of head_dim each: the scores recomputed, dP = dO V^T, then dQ,
            // dK and dV as the part asks.
            let products = match part {
                AttentionPart::Statistics => 1,
                AttentionPart::Queries => 3,
                AttentionPart::KeysValues => 4,
                AttentionPart::All | AttentionPart::Both => 5,
            };
            (
                StepKind::AttentionGradient,
                format!(
                    "attention_grad {part:?} {heads} heads x {head_dim}, {pairs} pairs{}",
                    causal_label(*causal)
                ),
                times(&[pairs, *heads, *head_dim, products]),
            )
        }
        Step::Window(window) => describe_window(window, rows_of),
        Step::Pointwise(_) => (StepKind::Pointwise, "pointwise".into(), 0),
        Step::Row(row) => (StepKind::Row, format!("row {:?}", row.kind), 0),
        Step::Segment(segment) => (StepKind::Segment, format!("segment {:?}", segment.kind), 0),
        Step::Insert(insert) => (StepKind::Copy, format!("insert size={}", insert.size), 0),
        Step::Gather(_) => (StepKind::Copy, "gather".into(), 0),
        Step::Pad(_) => (StepKind::Copy, "pad".into(), 0),
        Step::Unpad(_) => (StepKind::Copy, "unpad".into(), 0),
        Step::OneHot(one_hot) => (
            StepKind::Other,
            format!("one_hot classes={}", one_hot.classes),
            0,
        ),
        Step::RandomMask(mask) => (StepKind::Other, format!("random_mask p={}", mask.p.0), 0),
        Step::ScatterRows(scatter) => (
            StepKind::Other,
            format!(
                "scatter_rows vocabulary={} width={}",
                scatter.vocabulary, scatter.width
            ),
            0,
        ),
        Step::LengthValues(_) => (StepKind::Other, "length_values".into(), 0),
        Step::Positions(_) => (StepKind::Other, "positions".into(), 0),
        Step::Host(_) => (StepKind::Other, "host".into(), 0),
    }
}

/// A window step's kind, label and FLOPs: a convolution's (or its gradients')
/// multiply-adds are `windows * channels * width / groups * taps`, its windows the
/// rows of its output (forward, stride-1 input gradient), of `x` (strided input
/// gradient) or of `grad` (weight gradient).
fn describe_window(window: &Window, rows_of: impl Fn(Slot) -> u64) -> (StepKind, String, u64) {
    let Window {
        kind,
        out,
        x,
        grad,
        channels,
        width,
        window: geometry,
        groups,
        epilogue,
        ..
    } = window;
    let then = if epilogue.is_some() {
        " + epilogue"
    } else {
        ""
    };
    let label = format!(
        "window {kind:?} {channels}->{width} kernel={:?} stride={:?} groups={groups}{then}",
        geometry.kernel, geometry.stride
    );
    let windows = match kind {
        WindowKind::Conv | WindowKind::ConvInputGrad => rows_of(*out),
        WindowKind::StridedConvInputGrad => rows_of(*x),
        WindowKind::WeightGrad => grad.map_or(0, &rows_of),
        _ => return (StepKind::Pooling, label, 0),
    };
    let taps = geometry.kernel[0].max(0) as u64 * geometry.kernel[1].max(0) as u64;
    let per_window = (*channels).max(0) as u64 * (*width).max(0) as u64 / (*groups).max(1) as u64;
    let flops = windows
        .saturating_mul(per_window)
        .saturating_mul(taps)
        .saturating_mul(2);
    (StepKind::Convolution, label, flops)
}

/// `, causal` for a causal mask.
fn causal_label(causal: bool) -> &'static str {
    if causal {
        ", causal"
    } else {
        ""
    }
}

/// The (query, key) pairs of a batch whose elements pair the rows of `rows` with the
/// rows of `columns` (lengths buffers): `sum M_i N_i`, or with a causal mask the pairs
/// of each query with the keys up to its own position.
fn pairs(sizes: &Sizes, rows: Slot, columns: Slot, causal: bool) -> i64 {
    match (sizes.get(rows), sizes.get(columns)) {
        (Some(rows), Some(columns)) => pair_count(&rows.lengths, &columns.lengths, causal),
        _ => 0,
    }
}

/// [`pairs`] of elements of `rows` and `columns` rows (saturating).
fn pair_count(rows: &[i64], columns: &[i64], causal: bool) -> i64 {
    rows.iter().zip(columns).fold(0i64, |sum, (&m, &n)| {
        let pairs = if causal {
            // Query t sees min(t + 1, n) keys.
            let full = m.min(n);
            let triangle = full.saturating_mul(full.saturating_add(1)) / 2;
            triangle.saturating_add((m - full).max(0).saturating_mul(n))
        } else {
            m.saturating_mul(n)
        };
        sum.saturating_add(pairs)
    })
}

#[cfg(test)]
mod tests {
    use super::pair_count;

    #[test]
    fn pairs_count_each_query_with_the_keys_it_sees() {
        assert_eq!(pair_count(&[3, 1, 0, 5], &[3, 1, 0, 5], false), 9 + 1 + 25);
        // Causal: query t sees keys 0..=t.
        assert_eq!(pair_count(&[3, 1, 0, 5], &[3, 1, 0, 5], true), 6 + 1 + 15);
        // Cross lengths: queries past the keys see every key.
        assert_eq!(
            pair_count(&[4, 2], &[2, 5], true),
            (1 + 2 + 2 + 2) + (1 + 2)
        );
        assert_eq!(pair_count(&[4, 2], &[2, 5], false), 8 + 10);
        assert_eq!(pair_count(&[], &[], true), 0);
    }
}
