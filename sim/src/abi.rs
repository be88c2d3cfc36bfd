//! The functions simulated kernels call in place of GPU instructions
//! ([`nestor_codegen::sim_abi`], plus the barrier and shared memory that hand-written
//! kernels use), and the state of the launch and GPU thread they read: which launch
//! runs on this OS thread, and which of its GPU threads (fibers) is running.

use std::cell::{Cell, RefCell, UnsafeCell};

use nestor_codegen::sim_abi::{self, SpecialRegister};
use nestor_codegen::GpuGrid;

use crate::error::BadAccess;
use crate::memory::Extents;

/// `void ()`: PTX's `bar.sync 0`, a rendezvous of every thread of the block.
pub const BARRIER: &str = sim_abi::BARRIER;
/// `ptr ()`: the block's shared memory (the launch's bytes of it, NaN before the block
/// runs; its accesses are checked as the buffers' are).
pub const SHARED: &str = sim_abi::SHARED;

/// Why a GPU thread suspends: the rendezvous it waits at.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Request {
    /// `shfl.sync` of `mode` (a [`nestor_codegen::sim_abi::ShuffleMode`] code) over the
    /// lanes of `mask`, this lane's `value` and operands `b` and `c`.
    Shuffle {
        mode: i32,
        mask: u32,
        value: u32,
        b: u32,
        c: u32,
    },
    /// `bar.sync`.
    Barrier,
    /// `mma.sync.aligned.m16n8k16` of the whole warp: the lane's fragments, and where
    /// its part of `D` goes (all on its fiber's stack, alive while it waits).
    Mma {
        d: *mut f32,
        a: *const u32,
        b: *const u32,
        c: *const f32,
    },
}

/// A GPU thread's fiber: resumed with a shuffle's result, suspended at a rendezvous.
pub(crate) type Yielder = corosensei::Yielder<u32, Request>;

/// A GPU thread of the running block.
pub(crate) struct ThreadState {
    /// Its index in the block.
    pub(crate) thread: u32,
    /// Its fiber's yielder, set when the fiber starts.
    pub(crate) yielder: Cell<*const Yielder>,
}

/// The launch running on this OS thread.
pub(crate) struct LaunchState {
    pub(crate) grid: GpuGrid,
    /// The running block.
    pub(crate) block: Cell<u32>,
    /// The device's buffers at the launch.
    pub(crate) extents: Extents,
    /// The running block's shared memory.
    pub(crate) shared: RefCell<Vec<u64>>,
    /// The launch's bytes of shared memory per block.
    pub(crate) shared_bytes: u64,
    /// The first bad access, and how many there were.
    pub(crate) bad: RefCell<(Option<BadAccess>, u64)>,
    /// Bytes loaded from and stored to the device's buffers (shared memory apart).
    pub(crate) traffic: Cell<Traffic>,
    /// Where a bad access goes instead (NaN for loads).
    scratch: UnsafeCell<[u64; SCRATCH_WORDS]>,
}

impl LaunchState {
    pub(crate) fn new(grid: GpuGrid, extents: Extents, shared_bytes: u64) -> Self {
        Self {
            grid,
            block: Cell::new(0),
            extents,
            shared: RefCell::new(vec![u64::MAX; shared_bytes.div_ceil(8) as usize]),
            shared_bytes,
            bad: RefCell::new((None, 0)),
            traffic: Cell::new(Traffic::default()),
            scratch: UnsafeCell::new([u64::MAX; SCRATCH_WORDS]),
        }
    }

    /// Whether `bytes` at `address` are in the block's shared memory.
    fn in_shared(&self, address: u64, bytes: u64) -> bool {
        let start = self.shared.borrow().as_ptr() as u64;
        address >= start
            && address
                .checked_add(bytes)
                .is_some_and(|end| end <= start + self.shared_bytes)
    }
}

/// The bytes kernels loaded from and stored to the device's buffers (their global
/// memory: argument tables included, shared memory not), as a GPU's memory traffic
/// would be without caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes loaded.
    pub loaded: u64,
    /// Bytes stored.
    pub stored: u64,
}

impl std::ops::AddAssign for Traffic {
    fn add_assign(&mut self, other: Traffic) {
        self.loaded += other.loaded;
        self.stored += other.stored;
    }
}

/// Words of the scratch memory a bad access goes to: accesses are at most 64 bytes.
const SCRATCH_WORDS: usize = 8;

thread_local! {
    static LAUNCH: Cell<*const LaunchState> = const { Cell::new(std::ptr::null()) };
    static THREAD: Cell<*const ThreadState> = const { Cell::new(std::ptr::null()) };
}

/// Runs `body` with `launch` as this OS thread's running launch.
pub(crate) fn with_launch<T>(launch: &LaunchState, body: impl FnOnce() -> T) -> T {
    let before = LAUNCH.replace(launch);
    let result = body();
    LAUNCH.set(before);
    result
}

/// Makes `thread` the running GPU thread (the scheduler, before resuming its fiber).
pub(crate) fn set_thread(thread: *const ThreadState) {
    THREAD.set(thread);
}

/// The running launch and GPU thread, when a simulated kernel runs.
fn current() -> Option<(&'static LaunchState, &'static ThreadState)> {
    let (launch, thread) = (LAUNCH.get(), THREAD.get());
    if launch.is_null() || thread.is_null() {
        return None;
    }
    // Both outlive every fiber of the launch, which is the only code that calls the
    // functions of this module (the scheduler sets them before it resumes one).
    Some(unsafe { (&*launch, &*thread) })
}

/// Suspends the running fiber at `request`; its result once the rendezvous completes.
fn suspend(request: Request) -> Option<u32> {
    let (_, thread) = current()?;
    let yielder = thread.yielder.get();
    if yielder.is_null() {
        return None;
    }
    // Set by the fiber itself when it started, and it is still running.
    Some(unsafe { &*yielder }.suspend(request))
}

extern "C" fn special_register(register: i32) -> i32 {
    let Some((launch, thread)) = current() else {
        return 0;
    };
    let value = match SpecialRegister::of_code(register) {
        Some(SpecialRegister::Thread) => thread.thread,
        Some(SpecialRegister::BlockThreads) => launch.grid.threads,
        Some(SpecialRegister::Block) => launch.block.get(),
        Some(SpecialRegister::GridBlocks) => launch.grid.blocks,
        None => u32::MAX,
    };
    value as i32
}

extern "C" fn shuffle(mode: i32, mask: i32, value: i32, b: i32, c: i32) -> i32 {
    let request = Request::Shuffle {
        mode,
        mask: mask as u32,
        value: value as u32,
        b: b as u32,
        c: c as u32,
    };
    suspend(request).map_or(value, |result| result as i32)
}

extern "C" fn barrier() {
    suspend(Request::Barrier);
}

extern "C" fn mma_bf16(d: *mut f32, a: *const u32, b: *const u32, c: *const f32) {
    suspend(Request::Mma { d, a, b, c });
}

extern "C" fn shared() -> *mut u8 {
    match current() {
        Some((launch, _)) => launch.shared.borrow_mut().as_mut_ptr() as *mut u8,
        None => std::ptr::null_mut(),
    }
}

extern "C" fn access(address: *mut u8, bytes: i64, store: i32) -> *mut u8 {
    let Some((launch, thread)) = current() else {
        return address;
    };
    let (at, bytes) = (address as u64, bytes.max(0) as u64);
    if launch.extents.holding(at, bytes).is_some() {
        let mut traffic = launch.traffic.get();
        if store != 0 {
            traffic.stored += bytes;
        } else {
            traffic.loaded += bytes;
        }
        launch.traffic.set(traffic);
        return address;
    }
    if launch.in_shared(at, bytes) {
        return address;
    }
    let mut bad = launch.bad.borrow_mut();
    if bad.0.is_none() {
        bad.0 = Some(BadAccess {
            thread: thread.thread,
            block: launch.block.get(),
            address: at,
            bytes,
            store: store != 0,
            near: launch.extents.below(at),
        });
    }
    bad.1 += 1;
    // The access goes to the scratch words instead, NaN for a load.
    let scratch = launch.scratch.get();
    // Only this OS thread's fibers use the launch, one at a time.
    unsafe { *scratch = [u64::MAX; SCRATCH_WORDS] };
    scratch as *mut u8
}

/// Every function of the simulator's ABI, by name, as the JIT resolves them.
pub fn symbols() -> [(&'static str, usize); 6] {
    [
        (
            sim_abi::SPECIAL_REGISTER,
            special_register as *const () as usize,
        ),
        (sim_abi::SHUFFLE, shuffle as *const () as usize),
        (sim_abi::ACCESS, access as *const () as usize),
        (sim_abi::MMA_BF16, mma_bf16 as *const () as usize),
        (BARRIER, barrier as *const () as usize),
        (SHARED, shared as *const () as usize),
    ]
}

/// The ABI's functions for kernels written in Rust (the simulator's own tests and
/// planted bugs), with the signatures the generated kernels call them with.
pub mod calls {
    /// The calling thread's special register.
    pub fn special_register(register: nestor_codegen::sim_abi::SpecialRegister) -> u32 {
        super::special_register(register as i32) as u32
    }
    /// `shfl.sync` of a 32-bit value.
    pub fn shuffle(
        mode: nestor_codegen::sim_abi::ShuffleMode,
        mask: u32,
        value: u32,
        b: u32,
        c: u32,
    ) -> u32 {
        super::shuffle(mode as i32, mask as i32, value as i32, b as i32, c as i32) as u32
    }
    /// `bar.sync 0`.
    pub fn barrier() {
        super::barrier()
    }
    /// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` of this lane's fragments
    /// ([`crate::mma`]): its four values of `D`.
    pub fn mma_bf16(a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        let mut d = c;
        super::mma_bf16(d.as_mut_ptr(), a.as_ptr(), b.as_ptr(), c.as_ptr());
        d
    }
    /// The block's shared memory.
    pub fn shared() -> *mut u8 {
        super::shared()
    }
    /// The address an access of `bytes` (at most 64) at `address` goes to: `address`
    /// when it is in a buffer or the block's shared memory, else scratch memory (NaN)
    /// and the access recorded, to be reported after the launch.
    pub fn access(address: *mut u8, bytes: i64, store: bool) -> *mut u8 {
        super::access(address, bytes, i32::from(store))
    }
}
