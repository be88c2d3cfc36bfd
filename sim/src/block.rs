//! One block of a launch: each GPU thread a fiber on its own small stack, run in a
//! seeded random order between synchronization points, suspended at barriers and
//! shuffles until their rendezvous completes, and a rendezvous that cannot complete
//! reported as a deadlock.

use std::cell::{Cell, RefCell};
use std::fmt::Write;

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult};
use nestor_backend_cpu::KernelFn;

use crate::abi::{set_thread, LaunchState, Request, ThreadState};
use nestor_codegen::sim_abi::ShuffleMode;

use crate::mma::{mma_m16n8k16, Fragments};
use crate::shuffle::{source_lane, WARP_LANES};
use crate::SimError;

/// Bytes of a GPU thread's stack (its frames and the kernel's local arrays).
const STACK_BYTES: usize = 256 * 1024;

thread_local! {
    /// Stacks of finished fibers, for the next ones on this OS thread.
    static STACKS: RefCell<Vec<DefaultStack>> = const { RefCell::new(Vec::new()) };
}

type Fiber = Coroutine<u32, Request, (), DefaultStack>;

/// A reproducible order of threads (xorshift64*).
pub(crate) struct Order(u64);

impl Order {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `bound` (a multiply's high half: no division).
    fn below(&mut self, bound: usize) -> usize {
        ((u128::from(self.next()) * bound as u128) >> 64) as usize
    }

    /// `items` in a random order (Fisher-Yates).
    pub(crate) fn shuffle<T>(&mut self, items: &mut [T]) {
        for last in (1..items.len()).rev() {
            let other = self.below(last + 1);
            items.swap(last, other);
        }
    }
}

/// Where a GPU thread is.
#[derive(Clone, Copy)]
enum State {
    /// To run (from its start, or resumed with this value).
    Ready(u32),
    /// Waiting at a rendezvous.
    Waiting(Request),
    Exited,
}

/// What a kernel call is: its function, argument table and range.
#[derive(Clone, Copy)]
pub(crate) struct Call {
    pub(crate) kernel: KernelFn,
    pub(crate) table: u64,
    pub(crate) range: (i64, i64),
}

/// The shuffles a warp's lanes wait at: per member mask, the lanes that have arrived.
#[derive(Default)]
struct Arrivals(Vec<(u32, u32)>);

/// Runs block `launch.block` of `call` to its end: the next thread to run drawn at
/// random from those ready; a rendezvous completes as its last thread arrives.
pub(crate) fn run_block(
    name: &str,
    call: Call,
    launch: &LaunchState,
    order: &mut Order,
) -> Result<(), SimError> {
    let count = launch.grid.threads;
    let threads: Vec<ThreadState> = (0..count)
        .map(|thread| ThreadState {
            thread,
            yielder: Cell::new(std::ptr::null()),
        })
        .collect();
    // Fibers that never started drop without running anything.
    let mut fibers = threads
        .iter()
        .map(|thread| fiber(call, thread))
        .collect::<Result<Vec<Fiber>, SimError>>()?;
    let mut block = Block {
        states: vec![State::Ready(0); count as usize],
        ready: (0..count as usize).collect(),
        warps: (0..count.div_ceil(WARP_LANES))
            .map(|_| Arrivals::default())
            .collect(),
        at_mma: vec![0; count.div_ceil(WARP_LANES) as usize],
        at_barrier: 0,
    };
    let outcome = loop {
        let Some(t) = block.next(order) else {
            break if block
                .states
                .iter()
                .all(|state| matches!(state, State::Exited))
            {
                Ok(())
            } else {
                Err(SimError::Deadlock {
                    kernel: name.to_owned(),
                    block: launch.block.get(),
                    waiting: describe_waiting(&block.states, count),
                })
            };
        };
        let State::Ready(value) = block.states[t] else {
            continue;
        };
        set_thread(&threads[t]);
        let result = fibers[t].resume(value);
        set_thread(std::ptr::null());
        let arrived = match result {
            CoroutineResult::Yield(request) => block.arrive(t, request),
            CoroutineResult::Return(()) => {
                block.states[t] = State::Exited;
                Ok(())
            }
        };
        if let Err(why) = arrived {
            break Err(SimError::Shuffle {
                kernel: name.to_owned(),
                block: launch.block.get(),
                why,
            });
        }
    };
    STACKS.with(|stacks| {
        let mut stacks = stacks.borrow_mut();
        for mut fiber in fibers {
            if !fiber.done() {
                // A fiber left at a rendezvous: its stack holds the kernel's frames and
                // the ABI's, none with anything to drop.
                unsafe { fiber.force_reset() };
            }
            stacks.push(fiber.into_stack());
        }
    });
    outcome
}

/// The threads of a running block.
struct Block {
    states: Vec<State>,
    /// The threads to run.
    ready: Vec<usize>,
    /// Each warp's lanes waiting at shuffles.
    warps: Vec<Arrivals>,
    /// Each warp's lanes waiting at an `mma` (a rendezvous of all 32).
    at_mma: Vec<u32>,
    /// Threads waiting at the barrier.
    at_barrier: usize,
}

impl Block {
    /// A ready thread, drawn at random.
    fn next(&mut self, order: &mut Order) -> Option<usize> {
        if self.ready.is_empty() {
            return None;
        }
        let index = order.below(self.ready.len());
        Some(self.ready.swap_remove(index))
    }

    /// Thread `t` arrives at `request`: completes its rendezvous if it is the last to;
    /// an error for a shuffle PTX leaves undefined.
    fn arrive(&mut self, t: usize, request: Request) -> Result<(), String> {
        self.states[t] = State::Waiting(request);
        match request {
            Request::Barrier => {
                self.at_barrier += 1;
                if self.at_barrier == self.states.len() {
                    self.at_barrier = 0;
                    self.states.fill(State::Ready(0));
                    self.ready.extend(0..self.states.len());
                }
                Ok(())
            }
            Request::Mma { .. } => {
                let (warp, lane) = (t / WARP_LANES as usize, t % WARP_LANES as usize);
                self.at_mma[warp] |= 1 << lane;
                if self.at_mma[warp] == u32::MAX {
                    self.at_mma[warp] = 0;
                    self.complete_mma(warp);
                }
                Ok(())
            }
            Request::Shuffle { mask, .. } => {
                let (warp, lane) = (t / WARP_LANES as usize, t % WARP_LANES as usize);
                if mask & (1 << lane) == 0 {
                    return Err(format!(
                        "thread {t} (lane {lane} of warp {warp}) shuffles with member mask {mask:#010x}, which lacks its own lane"
                    ));
                }
                let arrivals = &mut self.warps[warp].0;
                let entry = match arrivals.iter().position(|&(m, _)| m == mask) {
                    Some(entry) => entry,
                    None => {
                        arrivals.push((mask, 0));
                        arrivals.len() - 1
                    }
                };
                arrivals[entry].1 |= 1 << lane;
                if arrivals[entry].1 != mask {
                    return Ok(());
                }
                arrivals.swap_remove(entry);
                self.complete_shuffle(warp, mask)
            }
        }
    }

    /// Every lane of warp `warp` waits at an `mma`: each gets its part of `D`.
    fn complete_mma(&mut self, warp: usize) {
        let base = warp * WARP_LANES as usize;
        let mut fragments = [Fragments::default(); WARP_LANES as usize];
        let mut outputs = [std::ptr::null_mut(); WARP_LANES as usize];
        for (lane, (fragment, output)) in fragments.iter_mut().zip(&mut outputs).enumerate() {
            if let State::Waiting(Request::Mma { d, a, b, c }) = self.states[base + lane] {
                // The lane's fragments are on its fiber's stack, which lives while it
                // waits (`calls::mma_bf16` and generated kernels pass arrays of these
                // lengths).
                unsafe {
                    fragment.a = *(a as *const [u32; 4]);
                    fragment.b = *(b as *const [u32; 2]);
                    fragment.c = *(c as *const [f32; 4]);
                }
                *output = d;
            }
        }
        let d = mma_m16n8k16(&fragments);
        for (lane, (values, output)) in d.iter().zip(outputs).enumerate() {
            if !output.is_null() {
                // As above: four f32 on the waiting lane's stack.
                unsafe { *(output as *mut [f32; 4]) = *values };
            }
            self.states[base + lane] = State::Ready(0);
            self.ready.push(base + lane);
        }
    }

    /// Every lane of `mask` of warp `warp` waits at a shuffle over it: each reads its
    /// source lane's value and is ready.
    fn complete_shuffle(&mut self, warp: usize, mask: u32) -> Result<(), String> {
        let base = warp * WARP_LANES as usize;
        let request = |states: &[State], lane: usize| match states[base + lane] {
            State::Waiting(Request::Shuffle {
                mode, value, b, c, ..
            }) => (mode, value, b, c),
            // Every lane of the mask has arrived at a shuffle over it.
            _ => (-1, 0, 0, 0),
        };
        let lanes = (0..WARP_LANES as usize).filter(|&lane| mask & (1 << lane) != 0);
        let first = mask.trailing_zeros() as usize;
        let (mode, ..) = request(&self.states, first);
        let mut results = [0u32; WARP_LANES as usize];
        for lane in lanes.clone() {
            let (own_mode, _, b, c) = request(&self.states, lane);
            if own_mode != mode {
                return Err(format!(
                    "lanes {first} and {lane} of warp {warp} shuffle over mask {mask:#010x} in modes {mode} and {own_mode}"
                ));
            }
            let shuffle = ShuffleMode::of_code(mode).ok_or_else(|| {
                format!("lane {lane} of warp {warp} shuffles in mode {mode}, which PTX lacks")
            })?;
            let source = source_lane(shuffle, lane as u32, b, c) as usize;
            if mask & (1 << source) == 0 {
                return Err(format!(
                    "thread {} (lane {lane} of warp {warp}) reads lane {source}, outside its member mask {mask:#010x} (PTX leaves the value undefined)",
                    base + lane
                ));
            }
            results[lane] = request(&self.states, source).1;
        }
        for lane in lanes {
            self.states[base + lane] = State::Ready(results[lane]);
            self.ready.push(base + lane);
        }
        Ok(())
    }
}

/// The fiber of GPU thread `thread`, on a stack of this OS thread's pool (an error when
/// no memory is left for a new one).
fn fiber(call: Call, thread: &ThreadState) -> Result<Fiber, SimError> {
    let stack = match STACKS.with(|stacks| stacks.borrow_mut().pop()) {
        Some(stack) => stack,
        None => DefaultStack::new(STACK_BYTES).map_err(|_| SimError::Memory(STACK_BYTES as u64))?,
    };
    let state = thread as *const ThreadState as usize;
    Ok(Coroutine::with_stack(stack, move |yielder, _| {
        // The thread's state outlives its fiber (`run_block` holds both).
        unsafe { (*(state as *const ThreadState)).yielder.set(yielder) };
        // The caller of the launch vouches for the table and range.
        unsafe { (call.kernel)(call.table as *const *mut u8, call.range.0, call.range.1) };
    }))
}

/// The threads of a deadlocked block: where each waits and, for shuffles, the lanes of
/// the mask that are not there.
fn describe_waiting(states: &[State], count: u32) -> String {
    let mut text = String::new();
    let exited: Vec<usize> = (0..states.len())
        .filter(|&t| matches!(states[t], State::Exited))
        .collect();
    let at_barrier: Vec<usize> = (0..states.len())
        .filter(|&t| matches!(states[t], State::Waiting(Request::Barrier)))
        .collect();
    if !at_barrier.is_empty() {
        let _ = write!(
            text,
            "{} at a barrier of all {count} threads",
            who(&at_barrier, ("waits", "wait"))
        );
        if !exited.is_empty() {
            let _ = write!(text, ", {} without it", who(&exited, ("exited", "exited")));
        }
        text.push_str("; ");
    }
    // Warp rendezvous by warp and member mask (an `mma`'s is the whole warp; `None`).
    let mut masks: Vec<(u32, Option<u32>, Vec<usize>)> = Vec::new();
    for (thread, state) in states.iter().enumerate() {
        let mask = match *state {
            State::Waiting(Request::Shuffle { mask, .. }) => Some(mask),
            State::Waiting(Request::Mma { .. }) => None,
            _ => continue,
        };
        let warp = thread as u32 / WARP_LANES;
        match masks.iter_mut().find(|(w, m, _)| (*w, *m) == (warp, mask)) {
            Some((_, _, threads)) => threads.push(thread),
            None => masks.push((warp, mask, vec![thread])),
        }
    }
    for (warp, shuffle_mask, threads) in masks {
        let mask = shuffle_mask.unwrap_or(u32::MAX);
        // The lanes of the mask that are not there, by why.
        let mut missing: Vec<((&str, &str), Vec<usize>)> = Vec::new();
        for lane in (0..WARP_LANES).filter(|&lane| mask & (1 << lane) != 0) {
            let thread = (warp * WARP_LANES + lane) as usize;
            // Why, for one lane and for several.
            let why = match states.get(thread) {
                None => ("does not exist", "do not exist"),
                Some(State::Exited) => ("exited", "exited"),
                Some(State::Waiting(Request::Barrier)) => {
                    ("waits at a barrier", "wait at a barrier")
                }
                Some(State::Waiting(Request::Shuffle { .. })) if shuffle_mask.is_none() => {
                    ("waits at a shuffle", "wait at a shuffle")
                }
                Some(State::Waiting(Request::Shuffle { mask: other, .. }))
                    if Some(*other) != shuffle_mask =>
                {
                    ("shuffles over another mask", "shuffle over another mask")
                }
                Some(State::Waiting(Request::Mma { .. })) if shuffle_mask.is_some() => {
                    ("waits at an mma", "wait at an mma")
                }
                _ => continue,
            };
            match missing.iter_mut().find(|(reason, _)| *reason == why) {
                Some((_, lanes)) => lanes.push(lane as usize),
                None => missing.push((why, vec![lane as usize])),
            }
        }
        let missing: Vec<String> = missing
            .iter()
            .map(|((one, several), lanes)| match lanes.as_slice() {
                [lane] => format!("lane {lane} {one}"),
                _ => format!("lanes {} {several}", ranges(lanes)),
            })
            .collect();
        let rendezvous = match shuffle_mask {
            Some(mask) => format!("a shuffle over mask {mask:#010x}"),
            None => "an mma (all 32 lanes)".to_owned(),
        };
        let _ = write!(
            text,
            "{} at {rendezvous}: {}; ",
            who(
                &threads,
                (
                    &format!("(warp {warp}) waits"),
                    &format!("(warp {warp}) wait")
                )
            ),
            missing.join(", ")
        );
    }
    let _ = write!(text, "a block of {count} threads");
    text
}

/// `thread 3 exited` or `threads 0-2, 4-39 exited`: `threads` and the verb for one or
/// several.
fn who(threads: &[usize], (one, several): (&str, &str)) -> String {
    match threads {
        [thread] => format!("thread {thread} {one}"),
        _ => format!("threads {} {several}", ranges(threads)),
    }
}

/// `0-31, 40` for the sorted `items`.
fn ranges(items: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut index = 0;
    while index < items.len() {
        let start = items[index];
        let mut end = start;
        while index + 1 < items.len() && items[index + 1] == end + 1 {
            index += 1;
            end += 1;
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        index += 1;
    }
    parts.join(", ")
}
