//! f64 kernels on the simulated GPU (their shuffles move each value as two 32-bit
//! halves) against the same templates on the host, to 1e-10: row kernels, segmented
//! kernels and attention.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_codegen::{gpu_grid, gpu_shared_bytes, gpu_threads_per_task, GpuGrid, Storage, Target};
use nestor_passes::step::{Attention, Row, Segment};
use nestor_passes::{
    Access, FloatType, Fusion, KernelSet, Program, RowKind, Rows, SegmentKind, Slot, Step,
};
use nestor_sim::{run_kernel, Launch, Limits};

const LENGTHS: [i64; 5] = [7, 0, 1, 20, 9];
const WIDTH: i64 = 24;

/// A buffer of a case: f64 values or i64 indices.
#[derive(Clone)]
enum Buffer {
    F64(Vec<f64>),
    I64(Vec<i64>),
}

fn waves(count: i64, phase: f64) -> Buffer {
    Buffer::F64(
        (0..count)
            .map(|i| (i as f64 * 0.37 + phase).sin() * 2.0)
            .collect(),
    )
}

fn offsets() -> Vec<i64> {
    std::iter::once(0)
        .chain(LENGTHS.iter().scan(0, |total, length| {
            *total += length;
            Some(*total)
        }))
        .collect()
}

fn program(step: &Step) -> Program {
    Program {
        steps: vec![step.clone()],
        float: FloatType::F64,
        ..Program::default()
    }
}

/// The buffers' pointers (the table) and their extents.
fn table(buffers: &mut [Buffer]) -> (Vec<*mut u8>, Vec<(u64, u64)>) {
    buffers
        .iter_mut()
        .map(|buffer| {
            let (pointer, bytes) = match buffer {
                Buffer::F64(values) => (values.as_mut_ptr() as *mut u8, 8 * values.len()),
                Buffer::I64(values) => (values.as_mut_ptr() as *mut u8, 8 * values.len()),
            };
            (pointer, (pointer as u64, bytes as u64))
        })
        .unzip()
}

/// The step's kernel over `range` on the host (in order) and on the simulated GPU (the
/// CUDA grid and one smaller than the work): the output, buffer 0, of each.
fn outputs(step: &Step, buffers: &[Buffer], range: (i64, i64)) -> Vec<Vec<f64>> {
    let program = program(step);
    let mut results = Vec::new();
    let host = nestor_backend_cpu::compile_with(&program, KernelSet::Complete).unwrap();
    let mut on_host = buffers.to_vec();
    let (args, _) = table(&mut on_host);
    // The buffers are sized for the step over the range.
    unsafe { host.kernel(0).unwrap()(args.as_ptr(), range.0, range.1) };
    let simulated = nestor_backend_cpu::compile_for(
        &program,
        (Target::Simulated, KernelSet::Complete, Storage::Compute),
        &nestor_sim::symbols(),
    )
    .unwrap();
    let threads = gpu_threads_per_task(&program, step, Storage::Compute);
    for grid in [
        gpu_grid(threads, range).unwrap(),
        GpuGrid {
            blocks: 1,
            threads: 64,
        },
    ] {
        let mut on_sim = buffers.to_vec();
        let (args, mut extents) = table(&mut on_sim);
        extents.push((args.as_ptr() as u64, 8 * args.len() as u64));
        let launch = Launch {
            grid,
            shared_bytes: gpu_shared_bytes(step, program.float, Storage::Compute),
        };
        // As above; every access is checked.
        unsafe {
            run_kernel(
                ("step0", simulated.kernel(0).unwrap()),
                (args.as_ptr() as u64, range),
                (launch, &Limits::SM_90),
                &extents,
                3,
            )
        }
        .unwrap();
        results.push(on_sim.swap_remove(0));
    }
    results.insert(0, on_host.swap_remove(0));
    results
        .into_iter()
        .map(|buffer| match buffer {
            Buffer::F64(values) => values,
            Buffer::I64(_) => panic!("the output is f64"),
        })
        .collect()
}

fn assert_equal(name: &str, step: &Step, buffers: &[Buffer], range: (i64, i64)) {
    let outputs = outputs(step, buffers, range);
    for simulated in &outputs[1..] {
        for (index, (&a, &e)) in simulated.iter().zip(&outputs[0]).enumerate() {
            let close = (a - e).abs() <= 1e-10 * (1.0 + e.abs()) || (a.is_nan() && e.is_nan());
            assert!(
                close,
                "{name}: value {index}: {a} on the simulated GPU, {e} on the host"
            );
        }
    }
}

#[test]
fn f64_row_segment_and_attention_kernels_match_the_host() {
    let rows: i64 = LENGTHS.iter().sum();
    for kind in [RowKind::Softmax, RowKind::LayerNorm, RowKind::Max] {
        let affine = kind == RowKind::LayerNorm;
        let out = if kind == RowKind::Max {
            rows
        } else {
            rows * WIDTH
        };
        let step = Step::Row(Row {
            kind,
            out: Slot(0),
            x: Fusion::plain(Slot(1), WIDTH),
            weight: affine.then_some(Slot(2)),
            bias: affine.then_some(Slot(3)),
            rows: Rows::fixed(rows),
            width: WIDTH,
            eps: nestor_ir::F64(1e-5),
            keys: None,
        });
        let mut buffers = vec![
            Buffer::F64(vec![f64::NAN; out as usize]),
            waves(rows * WIDTH, 0.1),
        ];
        if affine {
            buffers.extend([waves(WIDTH, 0.2), waves(WIDTH, 0.3)]);
        }
        assert_equal(&format!("row {kind:?}"), &step, &buffers, (0, rows));
    }
    for kind in [SegmentKind::Mean, SegmentKind::Softmax] {
        let out = if kind == SegmentKind::Softmax {
            rows * WIDTH
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
            Buffer::F64(vec![f64::NAN; out as usize]),
            waves(rows * WIDTH, 0.4),
            Buffer::I64(offsets()),
        ];
        assert_equal(
            &format!("segment {kind:?}"),
            &step,
            &buffers,
            (0, LENGTHS.len() as i64),
        );
    }
    let (heads, head_dim) = (2, 8);
    let width = heads * head_dim;
    let elements: Vec<i64> = LENGTHS
        .iter()
        .enumerate()
        .flat_map(|(element, &length)| std::iter::repeat_n(element as i64, length as usize))
        .collect();
    for causal in [false, true] {
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
            Buffer::F64(vec![f64::NAN; (rows * width) as usize]),
            waves(rows * width, 0.5),
            waves(rows * width, 0.6),
            waves(rows * width, 0.7),
            Buffer::I64(offsets()),
            Buffer::I64(offsets()),
            Buffer::I64(elements.clone()),
        ];
        assert_equal(
            &format!("attention (causal {causal})"),
            &step,
            &buffers,
            (0, rows * heads),
        );
    }
}
