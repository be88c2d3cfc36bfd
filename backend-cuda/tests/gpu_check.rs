//! The GPU check's cases: one per kernel template kind (every pointwise function, every
//! row and segment kind, gather, GEMM with its epilogue, pad and unpad, attention), with random inputs and the
//! output the CPU backend computes, written where `NESTOR_GPU_CHECK_CASES` says (by
//! `scripts/gpu-check.sh prepare`, for the GPU machine) or into a temporary folder.
//!
//! Here, without a GPU, the check runs against the CPU backend: the cases read back from
//! disk, their kernels run on the host from the read buffers and the output compared as
//! `gpu-check` (this crate's binary) compares it.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_passes::step::{
    Attention, Gather, Gemm, Pad, Pointwise, RandomMask, Row, Segment, Unpad,
};
use std::path::PathBuf;

use nestor_backend_cuda::check::{compare, Buffer, Case};
use nestor_backend_cuda::{ptx, Arch};
use nestor_ir::UnaryOp;
use nestor_passes::{Access, Expr, Fusion, Program, RowKind, Rows, SegmentKind, Slot, Step};

const ROWS: i64 = 37;
const WIDTH: i64 = 24;
const LENGTHS: [i64; 5] = [7, 0, 1, 20, 9];

/// A reproducible generator (xorshift) of test values.
struct Values(u64);

impl Values {
    fn next(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 6.0 - 3.0
    }

    fn floats(&mut self, count: i64) -> Vec<f32> {
        (0..count).map(|_| self.next()).collect()
    }
}

fn offsets(lengths: &[i64]) -> Vec<i64> {
    std::iter::once(0)
        .chain(lengths.iter().scan(0, |total, length| {
            *total += length;
            Some(*total)
        }))
        .collect()
}

/// The case of the one-step program of `step`: its PTX, and its output computed by the
/// CPU backend.
fn case(step: &Step, buffers: Vec<Buffer>, range: (i64, i64), tolerance: f64) -> Case {
    let program = one_step(step);
    let mut expected_buffers = buffers.clone();
    run_on_host(&program, &mut expected_buffers, range);
    let Buffer::F32(expected) = expected_buffers.swap_remove(0) else {
        panic!("the output is buffer 0")
    };
    let ptx = Arch::ALL
        .into_iter()
        .map(|arch| (arch, ptx(&program, arch).unwrap().ptx))
        .collect();
    Case {
        kernel: "step0".into(),
        ptx,
        buffers,
        output: 0,
        range,
        expected,
        tolerance,
    }
}

/// Runs the program's one kernel on the host over `buffers` (the output is buffer 0).
fn run_on_host(program: &Program, buffers: &mut [Buffer], range: (i64, i64)) {
    let kernels =
        nestor_backend_cpu::compile_with(program, nestor_backend_cpu::KernelSet::Complete).unwrap();
    let kernel = kernels.kernel(0).unwrap();
    let args: Vec<*mut u8> = buffers
        .iter_mut()
        .map(|buffer| match buffer {
            Buffer::F32(values) => values.as_mut_ptr() as *mut u8,
            Buffer::I64(values) => values.as_mut_ptr() as *mut u8,
        })
        .collect();
    // The buffers are sized for the step over `range` by the case builders below.
    unsafe { kernel(args.as_ptr(), range.0, range.1) };
}

/// Runs the program's one kernel on the simulated GPU over `buffers` (the output is
/// buffer 0), launched as `geometry` says (the CUDA device's grid when `None`); an error
/// is the simulator's report.
fn run_on_sim(
    program: &Program,
    buffers: &mut [Buffer],
    range: (i64, i64),
    geometry: Option<nestor_codegen::GpuGrid>,
) -> Result<(), nestor_sim::SimError> {
    let kernels = nestor_backend_cpu::compile_for(
        program,
        (
            nestor_codegen::Target::Simulated,
            nestor_backend_cpu::KernelSet::Complete,
            nestor_backend_cpu::Storage::Compute,
        ),
        &nestor_sim::symbols(),
    )
    .unwrap();
    let kernel = kernels.kernel(0).unwrap();
    let mut extents = Vec::new();
    let args: Vec<*mut u8> = buffers
        .iter_mut()
        .map(|buffer| {
            let (pointer, bytes) = match buffer {
                Buffer::F32(values) => (values.as_mut_ptr() as *mut u8, 4 * values.len()),
                Buffer::I64(values) => (values.as_mut_ptr() as *mut u8, 8 * values.len()),
            };
            extents.push((pointer as u64, bytes as u64));
            pointer
        })
        .collect();
    extents.push((args.as_ptr() as u64, 8 * args.len() as u64));
    let (step, storage) = (&program.steps[0], nestor_backend_cpu::Storage::Compute);
    let threads = nestor_codegen::gpu_threads_per_task(program, step, storage);
    let Some(grid) = geometry.or_else(|| nestor_codegen::gpu_grid(threads, range)) else {
        return Ok(());
    };
    let launch = nestor_sim::Launch {
        grid,
        shared_bytes: nestor_codegen::gpu_shared_bytes(step, program.float, storage),
    };
    // The buffers are sized for the step over `range`, and every access is checked.
    unsafe {
        nestor_sim::run_kernel(
            ("step0", kernel),
            (args.as_ptr() as u64, range),
            (launch, &nestor_sim::Limits::SM_90),
            &extents,
            0x5EED,
        )
    }
    .map(drop)
}

fn one_step(step: &Step) -> Program {
    Program {
        steps: vec![step.clone()],
        ..Program::default()
    }
}

fn rows() -> Rows {
    Rows::fixed(ROWS)
}

/// Every case: its name, its step and the case.
fn cases() -> Vec<(String, Step, Case)> {
    let mut values = Values(0x9e37_79b9_7f4a_7c15);
    let mut cases = Vec::new();
    let size = ROWS * WIDTH;
    // Every pointwise function, alone over a flat run of scalars.
    for &op in UnaryOp::ALL.iter() {
        let x = values.floats(size);
        let step = Step::Pointwise(Pointwise {
            out: Slot(0),
            rows: rows(),
            width: WIDTH,
            inputs: vec![Access::rows(Slot(1), WIDTH)],
            expr: Expr::Unary(op, Box::new(Expr::Load(0))),
        });
        let buffers = vec![Buffer::F32(vec![f32::NAN; size as usize]), Buffer::F32(x)];
        // libdevice and libm differ by an ulp or two in the transcendental functions.
        cases.push((
            format!("pointwise_{}", op.word()),
            step.clone(),
            case(&step, buffers, (0, ROWS), 1e-5),
        ));
    }
    // Row kernels, with weight and bias where the kind takes them.
    for kind in [
        RowKind::LayerNorm,
        RowKind::RmsNorm,
        RowKind::Softmax,
        RowKind::LogSoftmax,
        RowKind::Sum,
        RowKind::Mean,
        RowKind::Max,
        RowKind::Min,
    ] {
        let affine = matches!(kind, RowKind::LayerNorm | RowKind::RmsNorm);
        let reduces = matches!(
            kind,
            RowKind::Sum | RowKind::Mean | RowKind::Max | RowKind::Min
        );
        let out = if reduces { ROWS } else { size };
        let step = Step::Row(Row {
            kind,
            out: Slot(0),
            x: Fusion::plain(Slot(1), WIDTH),
            weight: affine.then_some(Slot(2)),
            bias: affine.then_some(Slot(3)),
            rows: rows(),
            width: WIDTH,
            eps: nestor_ir::F64(1e-5),
            keys: None,
        });
        let mut buffers = vec![
            Buffer::F32(vec![f32::NAN; out as usize]),
            Buffer::F32(values.floats(size)),
        ];
        if affine {
            buffers.push(Buffer::F32(values.floats(WIDTH)));
            buffers.push(Buffer::F32(values.floats(WIDTH)));
        }
        cases.push((
            format!("row_{kind:?}").to_lowercase(),
            step.clone(),
            case(&step, buffers, (0, ROWS), 1e-5),
        ));
    }
    // Segmented kernels over elements of lengths 7, 0, 1, 20, 9.
    let total: i64 = LENGTHS.iter().sum();
    for kind in [
        SegmentKind::Sum,
        SegmentKind::Mean,
        SegmentKind::Max,
        SegmentKind::Min,
        SegmentKind::Softmax,
        SegmentKind::LogSoftmax,
    ] {
        let whole = matches!(kind, SegmentKind::Softmax | SegmentKind::LogSoftmax);
        let out = if whole {
            total * WIDTH
        } else {
            LENGTHS.len() as i64 * WIDTH
        };
        let step = Step::Segment(Segment {
            kind,
            out: Slot(0),
            x: Fusion::plain(Slot(1), WIDTH),
            lengths: Slot(2),
            width: WIDTH,
            keys: None,
        });
        let buffers = vec![
            Buffer::F32(vec![f32::NAN; out as usize]),
            Buffer::F32(values.floats(total * WIDTH)),
            Buffer::I64(offsets(&LENGTHS)),
        ];
        let range = (0, LENGTHS.len() as i64);
        cases.push((
            format!("segment_{kind:?}").to_lowercase(),
            step.clone(),
            case(&step, buffers, range, 1e-5),
        ));
    }
    // Gather: rows of a table by id.
    let ids: Vec<i64> = (0..ROWS).map(|row| (row * 7) % 11).collect();
    let step = Step::Gather(Gather {
        out: Slot(0),
        table: Slot(1),
        ids: Slot(2),
        rows: rows(),
        width: WIDTH,
    });
    let buffers = vec![
        Buffer::F32(vec![f32::NAN; size as usize]),
        Buffer::F32(values.floats(11 * WIDTH)),
        Buffer::I64(ids),
    ];
    cases.push((
        "gather".into(),
        step.clone(),
        case(&step, buffers, (0, ROWS), 0.0),
    ));
    // A GEMM with bias and a residual epilogue, `x W^T` and `x W`.
    for transposed in [false, true] {
        let (k, n) = (WIDTH, 16);
        let step = Step::Gemm(Gemm {
            out: Slot(0),
            x: Slot(1),
            weight: Slot(2),
            bias: Some(Slot(3)),
            rows: rows(),
            k,
            n,
            transposed,
            epilogue: Some(Fusion {
                inputs: vec![Access::rows(Slot(0), n), Access::rows(Slot(4), n)],
                expr: Expr::Binary(
                    nestor_ir::BinaryOp::Add,
                    Box::new(Expr::Unary(UnaryOp::Gelu, Box::new(Expr::Load(0)))),
                    Box::new(Expr::Load(1)),
                ),
            }),
        });
        let buffers = vec![
            Buffer::F32(vec![f32::NAN; (ROWS * n) as usize]),
            Buffer::F32(values.floats(ROWS * k)),
            Buffer::F32(values.floats(k * n)),
            Buffer::F32(values.floats(n)),
            // The epilogue's read of the output: the sum itself, never loaded.
            Buffer::F32(vec![0.0]),
            Buffer::F32(values.floats(ROWS * n)),
        ];
        let name = if transposed {
            "gemm_transposed"
        } else {
            "gemm"
        };
        cases.push((
            name.into(),
            step.clone(),
            case(&step, buffers, (0, ROWS * n), 1e-5),
        ));
    }
    // A dropout mask from a run's key.
    let step = Step::RandomMask(RandomMask {
        out: Slot(0),
        rows: rows(),
        width: WIDTH,
        p: nestor_ir::F64(0.3),
        stream: 5,
    });
    let buffers = vec![
        Buffer::F32(vec![f32::NAN; size as usize]),
        Buffer::I64(vec![0x1234_5678_9abc_def0]),
    ];
    cases.push((
        "random_mask".into(),
        step.clone(),
        case(&step, buffers, (0, size), 0.0),
    ));
    // Padding to a grid of the longest length, and back.
    let longest = *LENGTHS.iter().max().unwrap();
    let elements: Vec<i64> = LENGTHS
        .iter()
        .enumerate()
        .flat_map(|(element, &length)| std::iter::repeat_n(element as i64, length as usize))
        .collect();
    let padded = LENGTHS.len() as i64 * longest;
    let step = Step::Pad(Pad {
        out: Slot(0),
        x: Slot(1),
        lengths: Slot(2),
        width: WIDTH,
        value: nestor_ir::F64(-1.5),
    });
    let buffers = vec![
        Buffer::F32(vec![f32::NAN; (padded * WIDTH) as usize]),
        Buffer::F32(values.floats(total * WIDTH)),
        Buffer::I64(offsets(&LENGTHS)),
        Buffer::I64(vec![longest]),
    ];
    cases.push((
        "pad".into(),
        step.clone(),
        case(&step, buffers, (0, padded), 0.0),
    ));
    let step = Step::Unpad(Unpad {
        out: Slot(0),
        x: Slot(1),
        grid: Slot(2),
        lengths: Slot(3),
        width: WIDTH,
    });
    let buffers = vec![
        Buffer::F32(vec![f32::NAN; (total * WIDTH) as usize]),
        Buffer::F32(values.floats(padded * WIDTH)),
        Buffer::I64(offsets(&LENGTHS)),
        Buffer::I64(vec![longest]),
        Buffer::I64(elements.clone()),
    ];
    cases.push((
        "unpad".into(),
        step.clone(),
        case(&step, buffers, (0, total), 0.0),
    ));
    // Attention, self (causal or not) and cross, 2 heads of 8.
    let (heads, head_dim) = (2, 8);
    let keys = [3, 5, 1, 0, 12];
    for (name, causal, key_lengths) in [
        ("attention_causal", true, LENGTHS),
        ("attention", false, LENGTHS),
        ("attention_cross", false, keys),
    ] {
        let width = heads * head_dim;
        let (queries, key_rows): (i64, i64) = (total, key_lengths.iter().sum());
        let step = Step::Attention(Attention {
            out: Slot(0),
            q: Access::rows(Slot(1), width),
            k: Access::rows(Slot(2), width),
            v: Access::rows(Slot(3), width),
            q_lengths: Slot(4),
            k_lengths: Slot(5),
            heads,
            head_dim,
            value_dim: head_dim,
            causal,
            scale: nestor_ir::F64(1.0 / (head_dim as f64).sqrt()),
        });
        let buffers = vec![
            Buffer::F32(vec![f32::NAN; (queries * width) as usize]),
            Buffer::F32(values.floats(queries * width)),
            Buffer::F32(values.floats(key_rows * width)),
            Buffer::F32(values.floats(key_rows * width)),
            Buffer::I64(offsets(&LENGTHS)),
            Buffer::I64(offsets(&key_lengths)),
            Buffer::I64(elements.clone()),
        ];
        cases.push((
            name.into(),
            step.clone(),
            case(&step, buffers, (0, queries * heads), 1e-5),
        ));
    }
    cases
}

fn cases_dir() -> PathBuf {
    std::env::var_os("NESTOR_GPU_CHECK_CASES").map_or_else(
        || std::env::temp_dir().join(format!("nestor-gpu-check-{}", std::process::id())),
        PathBuf::from,
    )
}

#[test]
fn the_gpu_check_runs_against_the_cpu_backend() {
    let dir = cases_dir();
    let _ = std::fs::remove_dir_all(&dir);
    let cases = cases();
    assert_eq!(cases.len(), UnaryOp::ALL.len() + 8 + 6 + 1 + 2 + 1 + 2 + 3);
    for (name, _, case) in &cases {
        case.write(&dir.join(name)).unwrap();
    }
    for (name, step, written) in &cases {
        let case = Case::read(&dir.join(name)).unwrap();
        assert!(
            same_bits(&case, written),
            "{name} does not read back as written"
        );
        // The kernel on the host over the buffers read back, checked as on the GPU.
        let mut buffers = case.buffers.clone();
        run_on_host(&one_step(step), &mut buffers, case.range);
        let Buffer::F32(actual) = &buffers[case.output] else {
            panic!("{name}: the output is f32")
        };
        compare(actual, &case.expected, case.tolerance)
            .unwrap_or_else(|why| panic!("{name}: {why}"));
        // And on the simulated GPU: the CUDA device's grid, one block, a grid smaller
        // than the work.
        for geometry in [None, Some((1, 256)), Some((2, 64))] {
            let geometry =
                geometry.map(|(blocks, threads)| nestor_codegen::GpuGrid { blocks, threads });
            let mut buffers = case.buffers.clone();
            run_on_sim(&one_step(step), &mut buffers, case.range, geometry)
                .unwrap_or_else(|why| panic!("{name} on the simulated GPU ({geometry:?}): {why}"));
            let Buffer::F32(actual) = &buffers[case.output] else {
                panic!("{name}: the output is f32")
            };
            compare(actual, &case.expected, case.tolerance)
                .unwrap_or_else(|why| panic!("{name} on the simulated GPU ({geometry:?}): {why}"));
        }
        for (arch, ptx) in &case.ptx {
            assert!(ptx.contains(&format!(".target {}", arch.name())), "{name}");
        }
    }
    // The comparison fails where it must.
    let (_, _, first) = &cases[0];
    let mut wrong = first.expected.clone();
    wrong[3] += 1.0;
    assert!(compare(&wrong, &first.expected, first.tolerance).is_err());
    wrong[3] = f32::NAN;
    assert!(compare(&wrong, &first.expected, first.tolerance).is_err());

    if std::env::var_os("NESTOR_GPU_CHECK_CASES").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The cases are equal, floats compared by their bits (the outputs start as NaN).
fn same_bits(a: &Case, b: &Case) -> bool {
    let bits = |buffer: &Buffer| match buffer {
        Buffer::F32(values) => values
            .iter()
            .map(|value| u64::from(value.to_bits()))
            .collect(),
        Buffer::I64(values) => values
            .iter()
            .map(|&value| value as u64)
            .collect::<Vec<u64>>(),
    };
    let floats = |values: &[f32]| {
        values
            .iter()
            .map(|value| value.to_bits())
            .collect::<Vec<_>>()
    };
    (&a.kernel, &a.ptx, a.output, a.range, a.tolerance)
        == (&b.kernel, &b.ptx, b.output, b.range, b.tolerance)
        && a.buffers.len() == b.buffers.len()
        && a.buffers.iter().zip(&b.buffers).all(|(x, y)| {
            std::mem::discriminant(x) == std::mem::discriminant(y) && bits(x) == bits(y)
        })
        && floats(&a.expected) == floats(&b.expected)
}
