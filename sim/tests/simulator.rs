//! The simulator's own rules, with kernels written in Rust against its ABI
//! (`nestor_sim::calls`) and generated ones: shuffles in every mode against the PTX ISA,
//! barriers, deadlocks, bounds, launch limits, and the planted bugs it must catch.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_codegen::sim_abi::{ShuffleMode, SpecialRegister};
use nestor_codegen::GpuGrid;
use nestor_sim::{calls, run_kernel, source_lane, Launch, Limits, SimError};

/// A launch of `blocks` x `threads`, no shared memory.
fn grid(blocks: u32, threads: u32) -> Launch {
    Launch {
        grid: GpuGrid { blocks, threads },
        shared_bytes: 0,
    }
}

/// Entry `index` of the argument table.
unsafe fn arg<T>(args: *const *mut u8, index: usize) -> *mut T {
    let slot = calls::access(unsafe { args.add(index) } as *mut u8, 8, false);
    unsafe { *(slot as *const *mut u8) as *mut T }
}

/// Loads value `index` of `base` through the simulator's check.
unsafe fn load<T: Copy>(base: *mut T, index: usize) -> T {
    let at = calls::access(
        unsafe { base.add(index) } as *mut u8,
        size_of::<T>() as i64,
        false,
    );
    unsafe { *(at as *const T) }
}

/// Stores `value` as value `index` of `base` through the simulator's check.
unsafe fn store<T>(base: *mut T, index: usize, value: T) {
    let at = calls::access(
        unsafe { base.add(index) } as *mut u8,
        size_of::<T>() as i64,
        true,
    );
    unsafe { *(at as *mut T) = value };
}

fn thread() -> usize {
    calls::special_register(SpecialRegister::Thread) as usize
}

fn global() -> usize {
    let block = calls::special_register(SpecialRegister::Block) as usize;
    block * calls::special_register(SpecialRegister::BlockThreads) as usize + thread()
}

/// Runs `kernel` (named `name`) with a table of `buffers` (each a `Vec<T>`, as raw parts) under
/// `launch`, every buffer and the table checked.
fn run(
    (name, kernel): (&str, nestor_backend_cpu::KernelFn),
    buffers: &mut [&mut [u64]],
    launch: Launch,
    seed: u64,
) -> Result<(), SimError> {
    let table: Vec<u64> = buffers
        .iter_mut()
        .map(|buffer| buffer.as_mut_ptr() as u64)
        .collect();
    let mut extents: Vec<(u64, u64)> = buffers
        .iter()
        .map(|buffer| (buffer.as_ptr() as u64, 8 * buffer.len() as u64))
        .collect();
    extents.push((table.as_ptr() as u64, 8 * table.len() as u64));
    // The kernels below access only their table's buffers, through the checks.
    unsafe {
        run_kernel(
            (name, kernel),
            (table.as_ptr() as u64, (0, 0)),
            (launch, &Limits::SM_90),
            &extents,
            seed,
        )
    }
}

/// Every lane shuffles its lane number as the table's `[mode, mask, b, c]` say and
/// stores what it read (lanes outside the mask store -1).
unsafe extern "C" fn shuffle_lanes(args: *const *mut u8, _: i64, _: i64) {
    unsafe {
        let (params, out) = (arg::<u64>(args, 0), arg::<u64>(args, 1));
        let [mode, mask, b, c] = [0, 1, 2, 3].map(|index| load(params, index) as u32);
        let lane = (thread() % 32) as u32;
        let mode = ShuffleMode::ALL[mode as usize];
        let read = if mask & (1 << lane) != 0 {
            u64::from(calls::shuffle(mode, mask, lane, b, c))
        } else {
            u64::MAX
        };
        store(out, global(), read);
    }
}

#[test]
fn shuffles_read_the_lanes_the_ptx_isa_defines() {
    // Whole warps and a half warp; segments of 32, 16 and 8 lanes with their clamps.
    for (index, mode) in ShuffleMode::ALL.into_iter().enumerate() {
        for mask in [u32::MAX, 0x0000_ffff] {
            for b in [0, 1, 3, 8, 17] {
                for c in [0x1f, 0x0, 0x101f, 0x181f, 0x1807] {
                    let mut params = [index as u64, u64::from(mask), b, c];
                    let mut out = vec![0u64; 64];
                    let result = run(
                        ("shuffle_lanes", shuffle_lanes),
                        &mut [&mut params, &mut out],
                        grid(1, 64),
                        7,
                    );
                    let expected: Vec<u64> = (0..64u32)
                        .map(|thread| {
                            let lane = thread % 32;
                            if mask & (1 << lane) == 0 {
                                return u64::MAX;
                            }
                            u64::from(source_lane(mode, lane, b as u32, c as u32))
                        })
                        .collect();
                    let outside = expected
                        .iter()
                        .any(|&source| source != u64::MAX && mask & (1 << source) == 0);
                    if outside {
                        // A source outside the mask: undefined in PTX, an error here.
                        let error = result.unwrap_err().to_string();
                        assert!(error.contains("outside its member mask"), "{error}");
                    } else {
                        result.unwrap();
                        assert_eq!(out, expected, "{mode:?} mask {mask:#x} b {b} c {c:#x}");
                    }
                }
            }
        }
    }
}

/// A butterfly sum of every lane's number over `OFFSETS`, stored per thread.
unsafe extern "C" fn butterfly_sum<const WRONG: bool>(args: *const *mut u8, _: i64, _: i64) {
    unsafe {
        let out = arg::<u64>(args, 0);
        let mut value = thread() as u32 % 32;
        // The planted bug repeats offset 2 where 1 belongs.
        let offsets: [u32; 5] = if WRONG {
            [16, 8, 4, 2, 2]
        } else {
            [16, 8, 4, 2, 1]
        };
        for offset in offsets {
            value += calls::shuffle(ShuffleMode::Butterfly, u32::MAX, value, offset, 0x1f);
        }
        store(out, global(), u64::from(value));
    }
}

#[test]
fn a_butterfly_sum_is_the_warps_sum_and_a_wrong_offset_is_caught() {
    let mut out = vec![0u64; 96];
    run(
        ("butterfly_sum", butterfly_sum::<false>),
        &mut [&mut out],
        grid(3, 32),
        1,
    )
    .unwrap();
    assert!(out.iter().all(|&sum| sum == (0..32).sum::<u64>()));
    // Planted: a wrong offset leaves every lane with a partial sum.
    run(
        ("butterfly_sum", butterfly_sum::<true>),
        &mut [&mut out],
        grid(3, 32),
        1,
    )
    .unwrap();
    assert!(
        out.iter().all(|&sum| sum != (0..32).sum::<u64>()),
        "{out:?}"
    );
}

/// A half warp's sum with offset 16: its lanes read the other half, outside the mask.
unsafe extern "C" fn half_warp_offset_16(args: *const *mut u8, _: i64, _: i64) {
    unsafe {
        let out = arg::<u64>(args, 0);
        let lane = thread() as u32 % 32;
        if lane < 16 {
            let read = calls::shuffle(ShuffleMode::Butterfly, 0xffff, lane, 16, 0x1f);
            store(out, global(), u64::from(read));
        }
    }
}

#[test]
fn a_shuffle_reading_outside_its_mask_is_an_error() {
    let mut out = vec![0u64; 32];
    let error = run(
        ("half_warp_offset_16", half_warp_offset_16),
        &mut [&mut out],
        grid(1, 32),
        3,
    )
    .unwrap_err();
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        message.contains("reads lane 16, outside its member mask 0x0000ffff"),
        "{message}"
    );
}

/// A butterfly sum that lane 5 skips (it returns first).
unsafe extern "C" fn lane_skips_shuffle(args: *const *mut u8, _: i64, _: i64) {
    unsafe {
        let out = arg::<u64>(args, 0);
        let lane = thread() as u32 % 32;
        if lane == 5 {
            return;
        }
        let read = calls::shuffle(ShuffleMode::Butterfly, u32::MAX, lane, 1, 0x1f);
        store(out, global(), u64::from(read));
    }
}

#[test]
fn a_lane_that_skips_a_shuffle_is_a_deadlock() {
    let mut out = vec![0u64; 64];
    let error = run(
        ("lane_skips_shuffle", lane_skips_shuffle),
        &mut [&mut out],
        grid(1, 64),
        11,
    )
    .unwrap_err();
    assert!(
        matches!(error, SimError::Deadlock { block: 0, .. }),
        "{error}"
    );
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        message.contains(
            "threads 0-4, 6-31 (warp 0) wait at a shuffle over mask 0xffffffff: lane 5 exited"
        ),
        "{message}"
    );
}

/// Each thread writes its number into shared memory, then reads its neighbour's
/// (after a barrier when `BARRIER`).
unsafe extern "C" fn neighbours<const BARRIER: bool>(args: *const *mut u8, _: i64, _: i64) {
    unsafe {
        let out = arg::<f32>(args, 0);
        let shared = calls::shared() as *mut f32;
        let (t, n) = (
            thread(),
            calls::special_register(SpecialRegister::BlockThreads) as usize,
        );
        store(shared, t, t as f32);
        if BARRIER {
            calls::barrier();
        }
        store(out, global(), load(shared, (t + 1) % n));
    }
}

#[test]
fn a_barrier_orders_shared_memory_and_a_missing_one_reads_nan() {
    let launch = Launch {
        grid: GpuGrid {
            blocks: 2,
            threads: 128,
        },
        shared_bytes: 128 * 4,
    };
    let mut out = vec![0u64; 128];
    run(
        ("neighbours", neighbours::<true>),
        &mut [&mut out],
        launch,
        5,
    )
    .unwrap();
    let read = |words: &[u64]| -> Vec<f32> {
        words
            .iter()
            .flat_map(|word| [*word as u32, (*word >> 32) as u32].map(f32::from_bits))
            .collect()
    };
    let expected: Vec<f32> = (0..256).map(|t| ((t % 128 + 1) % 128) as f32).collect();
    assert_eq!(read(&out), expected);
    // Planted: without the barrier some threads read a neighbour that has not written
    // yet, the NaN shared memory starts as.
    run(
        ("neighbours", neighbours::<false>),
        &mut [&mut out],
        launch,
        5,
    )
    .unwrap();
    let values = read(&out);
    assert!(values.iter().any(|value| value.is_nan()), "{values:?}");
    assert!(values.iter().any(|value| !value.is_nan()), "{values:?}");
    // Another seed, another order: the result of a race depends on it.
    let mut again = vec![0u64; 128];
    run(
        ("neighbours", neighbours::<false>),
        &mut [&mut again],
        launch,
        6,
    )
    .unwrap();
    assert_ne!(
        read(&again).iter().map(|v| v.is_nan()).collect::<Vec<_>>(),
        values.iter().map(|v| v.is_nan()).collect::<Vec<_>>()
    );
}

/// Thread 3 exits before the barrier the others wait at.
unsafe extern "C" fn exits_before_barrier(_: *const *mut u8, _: i64, _: i64) {
    if thread() != 3 {
        calls::barrier();
    }
}

#[test]
fn a_barrier_a_thread_never_reaches_is_a_deadlock() {
    let error = run(
        ("exits_before_barrier", exits_before_barrier),
        &mut [],
        grid(1, 40),
        2,
    )
    .unwrap_err();
    let message = error.to_string();
    eprintln!("{message}");
    assert!(
        message.contains(
            "threads 0-2, 4-39 wait at a barrier of all 40 threads, thread 3 exited without it"
        ),
        "{message}"
    );
}

/// Every thread stores its number at its global index, one past the buffer for the last.
unsafe extern "C" fn one_past_the_end(args: *const *mut u8, _: i64, _: i64) {
    unsafe {
        let out = arg::<u64>(args, 0);
        store(out, global(), global() as u64);
    }
}

#[test]
fn an_access_out_of_bounds_is_an_error_naming_the_thread_and_address() {
    // 65 threads over 64 values.
    let mut out = vec![0u64; 64];
    let base = out.as_ptr() as u64;
    let error = run(
        ("one_past_the_end", one_past_the_end),
        &mut [&mut out],
        grid(1, 65),
        9,
    )
    .unwrap_err();
    let SimError::OutOfBounds { first, count, .. } = &error else {
        panic!("{error}")
    };
    assert_eq!((first.thread, first.block, *count), (64, 0, 1));
    assert_eq!(first.address, base + 512);
    assert!(
        error.to_string().contains(&format!(
            "thread 64 of block 0 stores 8 bytes at {:#x}, 512 bytes past the start of the buffer at {base:#x} of 512 bytes",
            base + 512
        )),
        "{error}"
    );
    // The others stored theirs.
    assert_eq!(out, (0..64).collect::<Vec<u64>>());
}

#[test]
fn launches_over_the_architectures_limits_are_refused() {
    let limits = Limits::SM_80;
    let launch = |threads, shared_bytes| Launch {
        grid: GpuGrid { blocks: 1, threads },
        shared_bytes,
    };
    assert!(launch(1024, 0).check("k", &limits).is_ok());
    let error = launch(2048, 0).check("k", &limits).unwrap_err().to_string();
    assert!(
        error.contains("more than 1024 threads per block"),
        "{error}"
    );
    let error = launch(256, 200 * 1024)
        .check("k", &limits)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("more than 166912 bytes of shared memory"),
        "{error}"
    );
    assert!(launch(256, 200 * 1024).check("k", &Limits::SM_90).is_ok());
    let error = launch(0, 0).check("k", &limits).unwrap_err().to_string();
    assert!(error.contains("an empty grid"), "{error}");
}
