//! A launch on the simulated GPU: its geometry checked against the architecture's
//! limits, its blocks run one after another in a seeded random order, and the first
//! out-of-bounds access reported after the grid.

use nestor_codegen::GpuGrid;

use crate::abi::{with_launch, LaunchState, Traffic};
use crate::block::{run_block, Call, Order};
use crate::error::BadAccess;
use crate::memory::Extents;
use crate::SimError;

/// What a GPU accepts of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Threads of a block.
    pub block_threads: u32,
    /// Blocks of a grid's `x` dimension.
    pub grid_blocks: u32,
    /// Bytes of (dynamic) shared memory of a block.
    pub shared_bytes: u32,
}

impl Limits {
    /// Ampere (sm_80): 1024 threads per block, 163 KiB of shared memory.
    pub const SM_80: Limits = Limits {
        block_threads: 1024,
        grid_blocks: i32::MAX as u32,
        shared_bytes: 163 * 1024,
    };
    /// Hopper (sm_90): 1024 threads per block, 227 KiB of shared memory.
    pub const SM_90: Limits = Limits {
        block_threads: 1024,
        grid_blocks: i32::MAX as u32,
        shared_bytes: 227 * 1024,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::SM_90
    }
}

/// One launch: a grid over a kernel's range, with shared memory per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Blocks and threads per block.
    pub grid: GpuGrid,
    /// Bytes of shared memory per block.
    pub shared_bytes: u32,
}

impl Launch {
    /// Whether a GPU with `limits` runs it; else the limit it breaks.
    pub fn check(&self, kernel: &str, limits: &Limits) -> Result<(), SimError> {
        let why = if self.grid.threads == 0 || self.grid.blocks == 0 {
            Some("an empty grid".to_owned())
        } else if self.grid.threads > limits.block_threads {
            Some(format!(
                "more than {} threads per block",
                limits.block_threads
            ))
        } else if self.grid.blocks > limits.grid_blocks {
            Some(format!("more than {} blocks", limits.grid_blocks))
        } else if self.shared_bytes > limits.shared_bytes {
            Some(format!(
                "more than {} bytes of shared memory",
                limits.shared_bytes
            ))
        } else {
            None
        };
        match why {
            None => Ok(()),
            Some(why) => Err(SimError::Launch {
                kernel: kernel.to_owned(),
                blocks: u64::from(self.grid.blocks),
                threads: u64::from(self.grid.threads),
                shared: u64::from(self.shared_bytes),
                why,
            }),
        }
    }
}

/// Runs `kernel` (named `name`) over `range` with argument table `table` as `launch`
/// says, its accesses checked against `extents`: its blocks in the order `seed` draws,
/// dealt out in turn to the cores (rayon's pool), each block's threads in the order its
/// own seed draws (so a block runs the same whichever core runs it). Its memory
/// traffic; the error of the earliest block to fail, else the first out-of-bounds
/// access.
///
/// # Safety
/// `kernel` must be a kernel of the simulated target (or call only the simulator's ABI
/// and memory it checks), and the table and buffers must be what it expects over the
/// range.
pub(crate) unsafe fn run_grid(
    name: &str,
    call: Call,
    (launch, limits): (Launch, &Limits),
    extents: Extents,
    seed: u64,
) -> Result<Traffic, SimError> {
    use rayon::prelude::*;
    launch.check(name, limits)?;
    let mut blocks: Vec<u32> = (0..launch.grid.blocks).collect();
    Order::new(seed).shuffle(&mut blocks);
    let workers = rayon::current_num_threads().clamp(1, blocks.len());
    let outcomes: Vec<Outcome> = (0..workers)
        .into_par_iter()
        .map(|worker| {
            let state =
                LaunchState::new(launch.grid, extents.clone(), u64::from(launch.shared_bytes));
            let failed = with_launch(&state, || {
                for (position, &block) in blocks.iter().enumerate().skip(worker).step_by(workers) {
                    state.block.set(block);
                    state.shared.borrow_mut().fill(u64::MAX);
                    let mut order =
                        Order::new(seed ^ u64::from(block).wrapping_mul(0xD1B5_4A32_D192_ED03));
                    if let Err(error) = run_block(name, call, &state, &mut order) {
                        return Some((position, error));
                    }
                }
                None
            });
            let (first, count) = state.bad.take();
            let position = |block: u32| {
                blocks
                    .iter()
                    .position(|&b| b == block)
                    .unwrap_or(usize::MAX)
            };
            Outcome {
                failed,
                bad: first.map(|first| (position(first.block), first)),
                count,
                traffic: state.traffic.get(),
            }
        })
        .collect();
    let count: u64 = outcomes.iter().map(|outcome| outcome.count).sum();
    let (mut failed, mut bad, mut traffic) = (None, None, Traffic::default());
    for outcome in outcomes {
        traffic += outcome.traffic;
        failed = earliest(failed, outcome.failed);
        bad = earliest(bad, outcome.bad);
    }
    if let Some((_, error)) = failed {
        return Err(error);
    }
    match bad {
        Some((_, first)) => Err(SimError::OutOfBounds {
            kernel: name.to_owned(),
            first,
            count,
        }),
        None => Ok(traffic),
    }
}

/// What one core's share of a grid came to.
struct Outcome {
    /// The first of its blocks to fail (its position in the grid's order) and why.
    failed: Option<(usize, SimError)>,
    /// Its first out-of-bounds access, with its block's position.
    bad: Option<(usize, BadAccess)>,
    /// Its out-of-bounds accesses.
    count: u64,
    /// Its memory traffic.
    traffic: Traffic,
}

/// Of two positioned values, the earlier.
fn earliest<T>(a: Option<(usize, T)>, b: Option<(usize, T)>) -> Option<(usize, T)> {
    match (a, b) {
        (Some(a), Some(b)) => Some(if b.0 < a.0 { b } else { a }),
        (a, b) => a.or(b),
    }
}
