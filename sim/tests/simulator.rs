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
) -> Result<nestor_sim::Traffic, SimError> {
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

/// bf16 bits of `value` (truncated: the test's values are exact in bf16).
fn bf16_bits(value: f32) -> u32 {
    value.to_bits() >> 16
}

/// Each lane loads its fragments of `A` (16 x 16), `B` (16 x 8) and `C` (16 x 8)
/// (bf16 bits and f32 bits, a value a word, row-major) by the PTX ISA's layouts, runs
/// the warp's `mma` and stores its values of `D` where the layout puts them.
unsafe extern "C" fn mma_warp(args: *const *mut u8, _: i64, _: i64) {
    use nestor_sim::mma::{a_element, b_element, c_element, K, N};
    unsafe {
        let [a, b, c, d] = [0, 1, 2, 3].map(|index| arg::<u64>(args, index));
        let lane = (thread() % 32) as u32;
        let mut fragments = ([0u32; 4], [0u32; 2], [0f32; 4]);
        for i in 0..8 {
            let (row, column) = a_element(lane, i);
            let bits = load(a, row * K + column) as u32;
            fragments.0[(i / 2) as usize] |= bits << (16 * (i % 2));
        }
        for i in 0..4 {
            let (row, column) = b_element(lane, i);
            let bits = load(b, row * N + column) as u32;
            fragments.1[(i / 2) as usize] |= bits << (16 * (i % 2));
            let (row, column) = c_element(lane, i);
            fragments.2[i as usize] = f32::from_bits(load(c, row * N + column) as u32);
        }
        let values = calls::mma_bf16(fragments.0, fragments.1, fragments.2);
        for (i, value) in (0..4).zip(values) {
            let (row, column) = c_element(lane, i);
            store(d, row * N + column, u64::from(value.to_bits()));
        }
    }
}

#[test]
fn mma_fragments_follow_the_ptx_isa_layouts() {
    use nestor_sim::mma::{a_element, b_element, c_element, K, M, N};
    // The ISA's figures: lane 0 holds A[0][0..2], A[8][0..2], A[0][8..10], A[8][8..10];
    // lane 5 (group 1, thread 1) A[1][2..4], ...; B's lane 0 B[0..2][0], B[8..10][0];
    // C's lane 0 C[0][0..2], C[8][0..2]; lane 31 (group 7, thread 3) C[7][6..8], C[15][6..8].
    let a0: Vec<_> = (0..8).map(|i| a_element(0, i)).collect();
    assert_eq!(
        a0,
        [
            (0, 0),
            (0, 1),
            (8, 0),
            (8, 1),
            (0, 8),
            (0, 9),
            (8, 8),
            (8, 9)
        ]
    );
    let a5: Vec<_> = (0..8).map(|i| a_element(5, i)).collect();
    assert_eq!(
        a5,
        [
            (1, 2),
            (1, 3),
            (9, 2),
            (9, 3),
            (1, 10),
            (1, 11),
            (9, 10),
            (9, 11)
        ]
    );
    let b0: Vec<_> = (0..4).map(|i| b_element(0, i)).collect();
    assert_eq!(b0, [(0, 0), (1, 0), (8, 0), (9, 0)]);
    let b6: Vec<_> = (0..4).map(|i| b_element(6, i)).collect();
    assert_eq!(b6, [(4, 1), (5, 1), (12, 1), (13, 1)]);
    let c31: Vec<_> = (0..4).map(|i| c_element(31, i)).collect();
    assert_eq!(c31, [(7, 6), (7, 7), (15, 6), (15, 7)]);
    // Every element of every matrix is in exactly one lane's fragment.
    let mut seen = ([[0; K]; M], [[0; N]; K], [[0; N]; M]);
    for lane in 0..32 {
        for i in 0..8 {
            let (row, column) = a_element(lane, i);
            seen.0[row][column] += 1;
        }
        for i in 0..4 {
            let (row, column) = b_element(lane, i);
            seen.1[row][column] += 1;
            let (row, column) = c_element(lane, i);
            seen.2[row][column] += 1;
        }
    }
    assert!(seen.0.iter().flatten().all(|&count| count == 1));
    assert!(seen.1.iter().flatten().all(|&count| count == 1));
    assert!(seen.2.iter().flatten().all(|&count| count == 1));
}

#[test]
fn a_warps_mma_equals_the_scalar_product() {
    use nestor_sim::mma::{K, M, N};
    // Values exact in bf16 (8 bits of mantissa), so the products are exact in f32.
    let value = |seed: usize| ((seed * 37 + 11) % 23) as f32 / 8.0 - 1.375;
    let a: Vec<f32> = (0..M * K).map(value).collect();
    let b: Vec<f32> = (0..K * N).map(|index| value(index + 500)).collect();
    let c: Vec<f32> = (0..M * N).map(|index| value(index + 900) * 3.0).collect();
    let mut a_words: Vec<u64> = a.iter().map(|&x| u64::from(bf16_bits(x))).collect();
    let mut b_words: Vec<u64> = b.iter().map(|&x| u64::from(bf16_bits(x))).collect();
    let mut c_words: Vec<u64> = c.iter().map(|&x| u64::from(x.to_bits())).collect();
    let mut d_words = vec![u64::MAX; M * N];
    for seed in [1, 2, 3] {
        let traffic = run(
            ("mma_warp", mma_warp),
            &mut [&mut a_words, &mut b_words, &mut c_words, &mut d_words],
            grid(1, 32),
            seed,
        )
        .unwrap();
        // Every value of A, B and C loaded once (a word each), every value of D stored
        // once, and each lane's four table entries.
        let words = (M * K + K * N + M * N) as u64 + 32 * 4;
        assert_eq!(traffic.loaded, 8 * words);
        assert_eq!(traffic.stored, 8 * (M * N) as u64);
        for row in 0..M {
            for column in 0..N {
                let expected = (0..K).fold(f64::from(c[row * N + column]), |sum, k| {
                    sum + f64::from(a[row * K + k]) * f64::from(b[k * N + column])
                });
                let got = f32::from_bits(d_words[row * N + column] as u32);
                assert!(
                    (f64::from(got) - expected).abs() <= 1e-6 * expected.abs().max(1.0),
                    "D[{row}][{column}] = {got}, expected {expected}"
                );
            }
        }
    }
}

#[test]
fn an_mma_without_its_whole_warp_is_a_deadlock() {
    let (mut a, mut b, mut c, mut d) = (
        vec![0u64; 256],
        vec![0u64; 128],
        vec![0u64; 128],
        vec![0u64; 128],
    );
    let error = run(
        ("mma_warp", mma_warp),
        &mut [&mut a, &mut b, &mut c, &mut d],
        grid(1, 16),
        1,
    )
    .unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, SimError::Deadlock { .. }), "{text}");
    assert!(
        text.contains("an mma") && text.contains("lanes 16-31 do not exist"),
        "{text}"
    );
}
