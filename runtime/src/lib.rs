//! nestor-runtime: the backend-agnostic executor of compiled programs.
//!
//! - [`Executable`]: a lowered program and the backend's code for its steps
//!   ([`HostSteps`]); `run` sizes every buffer from the lengths inputs ([`Sizes`]),
//!   reuses intermediate buffers once their last reader has run, writes results into
//!   the caller's buffers ([`OutputSink`]) and runs every step through the backend,
//!   which sees the run as a [`RunState`];
//! - [`KernelDevice`]: a device that runs a program's `Complete` kernel set on memory it
//!   owns ([`Executable::run_on_device`]); `nestor-sim`'s `SimDevice` (a simulated GPU)
//!   and the CUDA backend's `CudaDevice` implement it;
//! - every kernel's argument list written from its step's signature, by one function
//!   (the CPU's lists, [`RunState::kernel_args`], and the devices' tables alike);
//! - [`MemoryBudget`] and [`Stats`]: what a run may allocate, and what runs did (with
//!   each step's time when asked: [`Stats::record_steps`], [`RunProfile`]).
//!
//! This crate knows no backend: the backends depend on it (the CPU backend's
//! `executable` compiles a program into an [`Executable`]). It never depends on tch.

mod executor;
mod memory;
mod stats;

pub use executor::{
    check_ids, check_positions, from_bf16, mask_key, round_to_bf16, split_mix, step_error, to_bf16,
    within_budget, write_positions, BlasCall, BlasSizeError, DeviceOutput, DeviceResults,
    DeviceSink, Executable, Gemms, HostRunner, HostSteps, HostValue, InputData, KernelDevice,
    LengthsInfo, OutputSink, Product, RunData, RunDim, RunOutput, RunProfile, RunShape, RunState,
    RuntimeError, Sizes, StepKind, StepTiming,
};
pub use memory::MemoryBudget;
pub use stats::{DeviceCounts, Stats, StatsSnapshot};
