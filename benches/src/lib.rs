//! nestor's benchmark suite, after DanLing's benchmark script: padded libtorch eager vs a
//! loop over elements vs nestor eager vs nestor compiled, for whole models (inference
//! and a training step) at several occupancies and for single operators, with step
//! times, useful GFLOP/s (FLOPs of the real lengths), peak memory and compile costs.
//!
//! `scripts/cargo build --release -p nestor-memcount && scripts/cargo run --release -p
//! nestor-bench --bin report` (or `make report`) writes the Markdown report and its
//! charts; the criterion benches (`scripts/cargo bench -p nestor-bench`) time the same
//! steps.

pub mod lengths;
pub mod limits;
pub mod measure;
pub mod models;
pub mod operators;
pub mod padded;
pub mod profile;
pub mod pytorch;
pub mod report;
pub mod script;

/// Errors of the suite: libtorch's, nestor's, I/O, charts.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A result of the suite.
pub type Result<T> = std::result::Result<T, Error>;

/// Sizes of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Scale {
    /// Elements per batch.
    pub batch: i64,
    /// The longest sequence (one element always has it).
    pub max_length: i64,
    /// Model width.
    pub d_model: i64,
    /// Attention heads.
    pub heads: i64,
    /// Layers per stack.
    pub layers: usize,
    /// Feed-forward width.
    pub feedforward: i64,
    /// The largest image side of the conv net.
    pub image_side: i64,
    /// Channels of the conv net.
    pub channels: i64,
    /// Vocabulary of the embedding operator.
    pub vocabulary: i64,
    /// Timed runs per measurement (after one warm-up run).
    pub samples: usize,
}

impl Scale {
    /// Sizes a 2-core CPU runs in minutes.
    pub fn cpu() -> Self {
        Self {
            batch: 16,
            max_length: 256,
            d_model: 256,
            heads: 4,
            layers: 2,
            feedforward: 1024,
            image_side: 64,
            channels: 16,
            vocabulary: 8192,
            samples: 7,
        }
    }

    /// The seed's full sizes (hours on a CPU).
    pub fn full() -> Self {
        Self {
            batch: 32,
            max_length: 512,
            d_model: 512,
            heads: 8,
            layers: 6,
            feedforward: 2048,
            image_side: 224,
            channels: 64,
            vocabulary: 32000,
            samples: 10,
        }
    }

    /// Tiny sizes, for checking that every path runs.
    pub fn smoke() -> Self {
        Self {
            batch: 3,
            max_length: 8,
            d_model: 16,
            heads: 2,
            layers: 1,
            feedforward: 32,
            image_side: 8,
            channels: 4,
            vocabulary: 32,
            samples: 1,
        }
    }
}

/// The occupancies of the models table (DanLing's script uses about these).
pub const OCCUPANCIES: [f64; 3] = [0.2, 0.35, 0.77];
