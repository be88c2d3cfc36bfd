//! PTX of every kernel template, checked without a GPU: each graph below is lowered
//! (as it comes and through the optimizer, for the fused forms), generated for NVPTX,
//! and assembled by ptxas for sm_80 and sm_90 in f32, f64 and f32 with bf16 buffers;
//! ptxas must accept it and
//! the kernels must not spill. The registers and spills of every kernel are printed
//! (`cargo test -p nestor-backend-cuda --test ptx -- --nocapture`).

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_backend_cuda::{ptx, ptx_of, ptx_storing, ptxas, Arch, KernelSet, Storage};
use nestor_passes::step::{Gemm, ScatterRows, SumRows, Window};
use nestor_passes::{lower, Limits, Pipeline, Step, WindowKind};

/// The butterfly shuffles in the PTX of step `step`'s kernel.
fn shuffles(module: &nestor_backend_cuda::PtxModule, step: usize) -> usize {
    let kernel = module.kernels[step].as_ref().unwrap();
    module
        .ptx
        .split(".entry ")
        .find(|entry| entry.starts_with(&format!("{kernel}(")))
        .unwrap()
        .matches("shfl.sync.bfly")
        .count()
}

/// Row kernels (norms and their gradients, softmax, reductions over the last dim), segmented kernels
/// (softmax and reductions over the ragged dim), a gather, GEMMs with and without
/// epilogues and a norm prologue.
const ROWS_AND_SEGMENTS: &str = r#"graph @rows_and_segments {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 8]
  %2 = input {name = "ids"} : ragged<i64>[B; %0]
  %3 = param {name = "gain"} : f32[8]
  %4 = param {name = "shift"} : f32[8]
  %5 = param {name = "table"} : f32[16, 8]
  %6 = param {name = "w"} : f32[8, 8]
  %7 = layer_norm(%1, %3, %4) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 8]
  %8 = rms_norm(%1, %3) {dims = 1, eps = 1e-6} : ragged<f32>[B; %0, 8]
  %9 = softmax(%1) {axis = -1} : ragged<f32>[B; %0, 8]
  %10 = log_softmax(%1) {axis = -1} : ragged<f32>[B; %0, 8]
  %11 = softmax(%1) {axis = 1} : ragged<f32>[B; %0, 8]
  %12 = log_softmax(%1) {axis = 1} : ragged<f32>[B; %0, 8]
  %13 = sum(%1) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %14 = mean(%1) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %15 = amax(%1) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %16 = amin(%1) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %17 = sum(%1) {dims = [1], keepdim = false} : f32[B, 8]
  %18 = mean(%1) {dims = [1], keepdim = false} : f32[B, 8]
  %19 = amax(%1) {dims = [1], keepdim = false} : f32[B, 8]
  %20 = amin(%1) {dims = [1], keepdim = false} : f32[B, 8]
  %21 = embedding(%2, %5) {padding_idx = -1} : ragged<f32>[B; %0, 8]
  %22 = epilogue(%1, %6, %4) {expr = "(gelu $0)", inputs = 0, core = linear} : ragged<f32>[B; %0, 8]
  %23 = epilogue(%22, %6, %4, %1) {expr = "(add $1 $0)", inputs = 1, core = linear} : ragged<f32>[B; %0, 8]
  %24 = prologue(%1, %22, %23, %3, %4) {expr = "(add $0 (mul $1 $2))", inputs = 3, core = layer_norm, dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 8]
  %25 = linear(%1, %6) : ragged<f32>[B; %0, 8]
  %26 = logsumexp(%1) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %27 = logsumexp(%1) {dims = [1], keepdim = false} : f32[B, 8]
  %28 = cumsum(%1) {axis = -1, reverse = false} : ragged<f32>[B; %0, 8]
  %29 = cumprod(%1) {axis = 2, reverse = true} : ragged<f32>[B; %0, 8]
  %30 = argmax(%1) {dims = [-1], keepdim = false} : ragged<i64>[B; %0]
  %31 = argmin(%1) {dims = [1], keepdim = true} : i64[B, 1, 8]
  %32 = sort(%1) {axis = 1, descending = false} : ragged<f32>[B; %0, 8]
  %33 = argsort(%1) {axis = 1, descending = true} : ragged<i64>[B; %0, 8]
  %34 = sort_grad(%9, %1) {axis = 1, descending = true} : ragged<f32>[B; %0, 8]
  %35 = max(%1) {dims = [1], keepdim = false} : f32[B, 8]
  %36 = max_grad(%35, %1) {axis = 1} : ragged<f32>[B; %0, 8]
  %37 = sort(%1) {axis = -1, descending = true} : ragged<f32>[B; %0, 8]
  %38 = argsort(%1) {axis = 2, descending = false} : ragged<i64>[B; %0, 8]
  %39 = sort_grad(%9, %1) {axis = -1, descending = false} : ragged<f32>[B; %0, 8]
  %40 = min(%1) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %41 = min_grad(%40, %1) {axis = -1} : ragged<f32>[B; %0, 8]
  %42 = kthvalue(%1) {axis = 1, k = 2, keepdim = false} : f32[B, 8]
  %43 = argkth(%1) {axis = -1, k = 3, keepdim = false} : ragged<i64>[B; %0]
  %44 = kthvalue_grad(%42, %1) {axis = 1, k = 2} : ragged<f32>[B; %0, 8]
  %45 = kthvalue(%1) {axis = -1, k = 3, keepdim = false} : ragged<f32>[B; %0]
  %46 = kthvalue_grad(%45, %1) {axis = -1, k = 3} : ragged<f32>[B; %0, 8]
  %47 = cummax(%1) {axis = 1, positions = false} : ragged<f32>[B; %0, 8]
  %48 = cummin(%1) {axis = -1, positions = true} : ragged<i64>[B; %0, 8]
  %49 = cummax_grad(%9, %1) {axis = 1} : ragged<f32>[B; %0, 8]
  %50 = cummin_grad(%9, %1) {axis = -1} : ragged<f32>[B; %0, 8]
  %51 = topk(%1) {axis = -1, k = 3, largest = true} : ragged<f32>[B; %0, 3]
  %52 = argtopk(%1) {axis = 2, k = 2, largest = false} : ragged<i64>[B; %0, 2]
  %53 = topk_grad(%51, %1) {axis = -1, k = 3, largest = true} : ragged<f32>[B; %0, 8]
  %54 = norm_grad(%1, %9, %3) {eps = 1e-5, centered = true, part = input} : ragged<f32>[B; %0, 8]
  %55 = norm_grad(%1, %9) {eps = 1e-6, centered = false, part = weight} : ragged<f32>[B; %0, 8]
  return %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55
}
"#;

/// Rows kept in a warp's registers (1000 values) and rows of a block (3000 values,
/// combined through shared memory); segments of 3000 columns, a block each.
const WIDE_ROWS: &str = r#"graph @wide_rows {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 1000]
  %2 = input {name = "y"} : ragged<f32>[B; %0, 3000]
  %3 = param {name = "gain"} : f32[3000]
  %4 = layer_norm(%1) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 1000]
  %5 = softmax(%1) {axis = -1} : ragged<f32>[B; %0, 1000]
  %6 = layer_norm(%2, %3, %3) {dims = 1, eps = 1e-5} : ragged<f32>[B; %0, 3000]
  %7 = rms_norm(%2, %3) {dims = 1, eps = 1e-6} : ragged<f32>[B; %0, 3000]
  %8 = softmax(%2) {axis = -1} : ragged<f32>[B; %0, 3000]
  %9 = log_softmax(%2) {axis = -1} : ragged<f32>[B; %0, 3000]
  %10 = sum(%2) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %11 = amax(%2) {dims = [-1], keepdim = false} : ragged<f32>[B; %0]
  %12 = softmax(%2) {axis = 1} : ragged<f32>[B; %0, 3000]
  %13 = sum(%2) {dims = [1], keepdim = false} : f32[B, 3000]
  %14 = norm_grad(%1, %5) {eps = 1e-5, centered = true, part = input} : ragged<f32>[B; %0, 1000]
  %15 = norm_grad(%2, %8) {eps = 1e-5, centered = true, part = input} : ragged<f32>[B; %0, 3000]
  return %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15
}
"#;

/// Varlen attention (self and cross, causal or not), one kernel each.
const ATTENTION: &str = r#"graph @attention {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 2, 8]
  %2 = input {name = "m.lengths"} : lengths[B]
  %3 = input {name = "m"} : ragged<f32>[B; %2, 2, 8]
  %4 = attention(%1, %1, %1) {causal = true} : ragged<f32>[B; %0, 2, 8]
  %5 = attention(%1, %1, %1) {causal = false} : ragged<f32>[B; %0, 2, 8]
  %6 = attention(%1, %3, %3) {causal = false} : ragged<f32>[B; %0, 2, 8]
  return %4, %5, %6
}
"#;

/// Padding to a grid and back.
const PADDING: &str = r#"graph @padding {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 8]
  %2 = pad(%1) {value = 0.0} : f32[B, max(%0), 8]
  %3 = tanh(%2) : f32[B, max(%0), 8]
  %4 = unpad(%3, %0) : ragged<f32>[B; %0, 8]
  return %2, %4
}
"#;

/// A dropout mask (the counter-based generator) applied.
const DROPOUT: &str = r#"graph @dropout {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 8]
  %2 = random_mask(%1) {p = 0.25, stream = 3} : ragged<f32>[B; %0, 8]
  %3 = mul(%1, %2) : ragged<f32>[B; %0, 8]
  return %3
}
"#;

/// Every pointwise function (one kernel each as it comes, one fused kernel through the
/// optimizer), with scalar and broadcast operands.
const POINTWISE: &str = r#"graph @pointwise {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 8]
  %2 = param {name = "bias"} : f32[8]
  %3 = const {value = 0.5, dtype = f32} : f32[]
  %4 = exp(%1) : ragged<f32>[B; %0, 8]
  %5 = log(%4) : ragged<f32>[B; %0, 8]
  %6 = sin(%5) : ragged<f32>[B; %0, 8]
  %7 = cos(%6) : ragged<f32>[B; %0, 8]
  %8 = tanh(%7) : ragged<f32>[B; %0, 8]
  %9 = sigmoid(%8) : ragged<f32>[B; %0, 8]
  %10 = gelu(%9) : ragged<f32>[B; %0, 8]
  %11 = gelu_tanh(%10) : ragged<f32>[B; %0, 8]
  %12 = silu(%11) : ragged<f32>[B; %0, 8]
  %13 = erf(%12) : ragged<f32>[B; %0, 8]
  %14 = sqrt(%13) : ragged<f32>[B; %0, 8]
  %15 = rsqrt(%14) : ragged<f32>[B; %0, 8]
  %16 = abs(%15) : ragged<f32>[B; %0, 8]
  %17 = sign(%16) : ragged<f32>[B; %0, 8]
  %18 = relu(%17) : ragged<f32>[B; %0, 8]
  %19 = neg(%18) : ragged<f32>[B; %0, 8]
  %20 = square(%19) : ragged<f32>[B; %0, 8]
  %21 = pow(%20, %3) : ragged<f32>[B; %0, 8]
  %22 = maximum(%21, %2) : ragged<f32>[B; %0, 8]
  %23 = minimum(%22, %1) : ragged<f32>[B; %0, 8]
  %24 = div(%23, %1) : ragged<f32>[B; %0, 8]
  %25 = sub(%24, %3) : ragged<f32>[B; %0, 8]
  %26 = gt(%25, %1) : ragged<bool>[B; %0, 8]
  %27 = where(%26, %25, %1) : ragged<f32>[B; %0, 8]
  %28 = expm1(%27) : ragged<f32>[B; %0, 8]
  %29 = log1p(%28) : ragged<f32>[B; %0, 8]
  %30 = reciprocal(%29) : ragged<f32>[B; %0, 8]
  %31 = floor(%30) : ragged<f32>[B; %0, 8]
  %32 = ceil(%31) : ragged<f32>[B; %0, 8]
  %33 = round(%32) : ragged<f32>[B; %0, 8]
  return %33
}
"#;

/// The program of `text` (with `f32` replaced by `dtype`), optimized or as it comes.
fn program(text: &str, dtype: &str, optimized: bool) -> nestor_passes::Program {
    let graph = nestor_ir::parse(&text.replace("f32", dtype)).unwrap();
    let graph = if optimized {
        Pipeline::optimizing(Limits::untimed()).run(&graph).unwrap()
    } else {
        graph
    };
    lower(&graph).unwrap()
}

/// cdist of every kind of norm (libdevice's `fabs`, `sqrt` and `pow`).
const CDIST: &str = r#"graph @cdist {
  %0 = input {name = "a.lengths"} : lengths[B]
  %1 = input {name = "a"} : ragged<f32>[B; %0, 8]
  %2 = input {name = "b.lengths"} : lengths[B]
  %3 = input {name = "b"} : ragged<f32>[B; %2, 8]
  %4 = cdist(%1, %3) {p = 2.0} : ragged<f32>[B; %0, %2]
  %5 = cdist(%1, %3) {p = 1.0} : ragged<f32>[B; %0, %2]
  %6 = cdist(%1, %3) {p = 0.0} : ragged<f32>[B; %0, %2]
  %7 = cdist(%1, %3) {p = inf} : ragged<f32>[B; %0, %2]
  %8 = cdist(%1, %3) {p = 3.0} : ragged<f32>[B; %0, %2]
  return %4, %5, %6, %7, %8
}"#;

#[test]
fn every_kernel_template_assembles_for_sm80_and_sm90_without_spills() {
    let mut kernels = 0;
    for (name, text) in [
        ("rows_and_segments", ROWS_AND_SEGMENTS),
        ("wide_rows", WIDE_ROWS),
        ("attention", ATTENTION),
        ("padding", PADDING),
        ("dropout", DROPOUT),
        ("pointwise", POINTWISE),
        ("cdist", CDIST),
    ] {
        // bf16: an f32 program whose buffers hold bf16.
        for dtype in ["f32", "f64", "bf16"] {
            let (float, storage) = match dtype {
                "bf16" => ("f32", Storage::Bf16),
                other => (other, Storage::Compute),
            };
            for optimized in [false, true] {
                let program = program(text, float, optimized);
                for arch in Arch::ALL {
                    let module = ptx_storing(&program, arch, storage).unwrap();
                    let report = ptxas::assemble(&module.ptx, arch).unwrap_or_else(|error| {
                        panic!("{name} {dtype} on {}: {error}", arch.name())
                    });
                    let entries: Vec<&String> = module.kernels.iter().flatten().collect();
                    for entry in &entries {
                        assert!(
                            report.iter().any(|kernel| &&kernel.name == entry),
                            "{name}: ptxas reports no {entry}"
                        );
                    }
                    for kernel in &report {
                        println!(
                            "{name} {dtype} optimized={optimized} {} {}: {} registers, {} / {} bytes spilled",
                            arch.name(),
                            kernel.name,
                            kernel.registers,
                            kernel.spill_stores,
                            kernel.spill_loads
                        );
                        assert_eq!(
                            (kernel.spill_stores, kernel.spill_loads),
                            (0, 0),
                            "{name} {dtype} {}: {} spills",
                            arch.name(),
                            kernel.name
                        );
                    }
                    kernels += report.len();
                }
            }
        }
    }
    assert!(kernels > 100, "{kernels} kernels assembled");
}

/// Every step of these graphs has a PTX entry (GEMMs, attention and padding included,
/// which the CPU runs on its libraries).
#[test]
fn every_step_with_a_template_has_a_ptx_entry() {
    let (mut attention, mut padding) = (0, 0);
    for text in [ROWS_AND_SEGMENTS, ATTENTION, PADDING] {
        let program = program(text, "f32", false);
        let module = ptx(&program, Arch::Sm80).unwrap();
        for (step, kernel) in program.steps.iter().zip(&module.kernels) {
            attention += usize::from(matches!(step, Step::Attention(_)));
            padding += usize::from(matches!(step, Step::Pad(_) | Step::Unpad(_)));
            assert!(kernel.is_some(), "{step:?}");
            if let Some(kernel) = kernel {
                assert!(
                    module.ptx.contains(&format!(".entry {kernel}(")),
                    "{kernel}"
                );
            }
        }
    }
    assert_eq!((attention, padding), (3, 2));
}

/// With cuBLAS computing GEMM products (`DeviceBlas`), a GEMM step with a bias or an
/// epilogue keeps a kernel (adding them to the product in place), one with neither has
/// none, every other step keeps its kernel; they assemble without spills, with f32 and
/// bf16 buffers.
#[test]
fn gemm_steps_after_cublas_keep_only_their_bias_and_epilogue() {
    let program = program(ROWS_AND_SEGMENTS, "f32", false);
    let mut gemms = (0, 0);
    for arch in Arch::ALL {
        for storage in [Storage::Compute, Storage::Bf16] {
            let module = ptx_of(&program, arch, (KernelSet::DeviceBlas, storage)).unwrap();
            gemms = (0, 0);
            for (step, kernel) in program.steps.iter().zip(&module.kernels) {
                match step {
                    Step::Gemm(Gemm { bias, epilogue, .. })
                        if bias.is_none() && epilogue.is_none() =>
                    {
                        gemms.0 += 1;
                        assert!(kernel.is_none(), "{step:?}");
                    }
                    Step::Gemm(_) => {
                        gemms.1 += 1;
                        assert!(kernel.is_some(), "{step:?}");
                    }
                    _ => assert!(kernel.is_some(), "{step:?}"),
                }
            }
            for kernel in ptxas::assemble(&module.ptx, arch).unwrap() {
                assert_eq!(
                    (kernel.spill_stores, kernel.spill_loads),
                    (0, 0),
                    "{}",
                    kernel.name
                );
            }
        }
    }
    // `linear(x, w)` alone; the two GEMMs with a bias and an epilogue.
    assert_eq!(gemms, (1, 2));
    // Weight gradients (row sums of products) are cuBLAS's alone; column sums keep
    // their kernel.
    use nestor_passes::Pass;
    let graph = nestor_passes::Decompose
        .run(&nestor_ir::parse(&filetest("attention_loss.nir")).unwrap())
        .unwrap();
    let program = training_program(&graph);
    let module = ptx_of(
        &program,
        Arch::Sm90,
        (KernelSet::DeviceBlas, Storage::Compute),
    )
    .unwrap();
    let mut products = 0;
    for (step, kernel) in program.steps.iter().zip(&module.kernels) {
        match step {
            Step::SumRows(SumRows {
                a: Some(_),
                mean: false,
                ..
            }) => {
                products += 1;
                assert!(kernel.is_none(), "{step:?}");
            }
            Step::Gemm(_) => {}
            _ => assert!(kernel.is_some(), "{step:?}"),
        }
    }
    assert!(products >= 1, "{products} weight gradients");
}

/// A row kernel's row is a warp's: its lanes combine their sums and extremes with
/// butterfly shuffles (f64 as two 32-bit halves), and its launch takes 32 threads a row;
/// so is attention's (query row, head) (the lanes add their parts of each score);
/// segmented kernels and gathers take a warp a task too (lanes over the columns, no
/// shuffles), GEMMs one thread an output value.
#[test]
fn row_kernels_share_each_row_across_a_warp() {
    let mut shared = 0;
    for dtype in ["f32", "f64"] {
        for text in [ROWS_AND_SEGMENTS, ATTENTION] {
            let program = program(text, dtype, false);
            let module = ptx(&program, Arch::Sm90).unwrap();
            for (index, (step, threads)) in program
                .steps
                .iter()
                .zip(&module.threads_per_task)
                .enumerate()
            {
                let shuffles = shuffles(&module, index);
                match step {
                    // A scan (or argmax) along the row: a thread's, its columns in order.
                    Step::Row(row) if row.kind.one_thread_a_row() => {
                        assert_eq!((*threads, shuffles), (1, 0), "{step:?}")
                    }
                    Step::Row(_) | Step::Attention(_) => {
                        shared += 1;
                        assert_eq!(*threads, 32, "{step:?}");
                        // Five steps (16, 8, 4, 2, 1 lanes apart) per combined value.
                        assert!(shuffles >= 5, "{dtype} {step:?}: {shuffles} shuffles");
                    }
                    Step::Segment(_) | Step::Gather(_) => {
                        assert_eq!((*threads, shuffles), (32, 0), "{step:?}")
                    }
                    _ => assert_eq!((*threads, shuffles), (1, 0), "{step:?}"),
                }
            }
        }
    }
    assert!(shared >= 2 * (8 + 3), "{shared} row and attention kernels");
    // The gradients of attention too.
    use nestor_passes::Pass;
    let graph = nestor_passes::Decompose
        .run(&nestor_ir::parse(&filetest("attention_loss.nir")).unwrap())
        .unwrap();
    let program = training_program(&graph);
    let module = ptx(&program, Arch::Sm90).unwrap();
    let gradients: Vec<u32> = program
        .steps
        .iter()
        .zip(&module.threads_per_task)
        .filter(|(step, _)| matches!(step, Step::AttentionGrad(_)))
        .map(|(_, &threads)| threads)
        .collect();
    // f32 buffers: the statistics and both gradients are warp kernels.
    assert_eq!(
        gradients,
        [32, 32, 32],
        "the statistics, the queries' and the keys' gradients"
    );
}

/// The PTX of a small kernel, whole: a grid-stride loop over the flat scalars of a
/// pointwise `relu(x) * 2`. Re-bless with `NESTOR_BLESS=1` after an intended change
/// (another LLVM release changes it too).
#[test]
fn the_ptx_of_a_pointwise_kernel_is_its_snapshot() {
    assert_snapshot(
        "relu_twice",
        r#"graph @relu_twice {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 8]
  %2 = const {value = 2.0, dtype = f32} : f32[]
  %3 = relu(%1) : ragged<f32>[B; %0, 8]
  %4 = mul(%3, %2) : ragged<f32>[B; %0, 8]
  return %4
}"#,
    );
}

/// The PTX of a row kernel, whole: softmax over rows of 40 values, a row a warp (two
/// columns for the first 8 lanes, one for the others, read once into registers), the
/// largest value and the sum each combined by five butterfly shuffles, the result
/// written once. Re-bless as above.
#[test]
fn the_ptx_of_a_row_kernel_is_its_snapshot() {
    assert_snapshot(
        "softmax_rows",
        r#"graph @softmax_rows {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 40]
  %2 = softmax(%1) {axis = -1} : ragged<f32>[B; %0, 40]
  return %2
}"#,
    );
}

/// The optimized program of `text` as sm_90 PTX equals `tests/snapshots/<name>.sm_90.ptx`
/// (written instead with `NESTOR_BLESS=1`) and assembles.
fn assert_snapshot(name: &str, text: &str) {
    let module = ptx(&program(text, "f32", true), Arch::Sm90).unwrap();
    let root = std::env::var_os("CARGO_MANIFEST_DIR").unwrap();
    let path = std::path::Path::new(&root).join(format!("tests/snapshots/{name}.sm_90.ptx"));
    if std::env::var_os("NESTOR_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &module.ptx).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("{} is missing: run with NESTOR_BLESS=1", path.display()));
    assert_eq!(
        module.ptx, expected,
        "re-bless with NESTOR_BLESS=1 if intended"
    );
    ptxas::assemble(&module.ptx, Arch::Sm90).unwrap();
}

/// The text of `tests/filetests/<file>`.
fn filetest(file: &str) -> String {
    let root = std::env::var_os("CARGO_MANIFEST_DIR").unwrap();
    std::fs::read_to_string(
        std::path::Path::new(&root)
            .join("../tests/filetests")
            .join(file),
    )
    .unwrap()
}

/// The GPU program of the joint forward + backward graph of `graph`'s loss (its first
/// output) with respect to every parameter (attention's statistics saved).
fn training_program(graph: &nestor_ir::Graph) -> nestor_passes::Program {
    let params: Vec<nestor_ir::ValueId> = (0..graph.nodes.len() as u32)
        .map(nestor_ir::ValueId)
        .filter(|value| matches!(graph.nodes[value.index()].op, nestor_ir::Op::Param { .. }))
        .collect();
    let joint = nestor_passes::differentiate(graph, graph.outputs[0], &params).unwrap();
    // A GPU's program: attention's gradients read saved statistics.
    let options = nestor_passes::LowerOptions {
        attention_statistics: true,
        ..nestor_passes::LowerOptions::default()
    };
    nestor_passes::lower_with(&Pipeline::unoptimized().run(&joint.graph).unwrap(), options).unwrap()
}

/// Every step of `program` has a kernel, and ptxas assembles them for every
/// architecture, with f32 and bf16 buffers, without spills.
fn assert_every_step_assembles(program: &nestor_passes::Program, what: &str) {
    for (arch, storage) in Arch::ALL
        .into_iter()
        .flat_map(|arch| [(arch, Storage::Compute), (arch, Storage::Bf16)])
    {
        let module = ptx_storing(program, arch, storage).unwrap();
        assert!(
            module.kernels.iter().all(Option::is_some),
            "every step of {what} has a kernel"
        );
        for kernel in ptxas::assemble(&module.ptx, arch).unwrap() {
            assert_eq!(
                (kernel.spill_stores, kernel.spill_loads),
                (0, 0),
                "{what}: {}",
                kernel.name
            );
        }
    }
}

/// The training steps of a pooled classifier (one-hot rows, row sums for weight
/// gradients, lengths as numbers, a scatter and an insert), of causal attention (the
/// gradients of the queries and of the keys and values) and of attention over jagged
/// pairs (pair matmuls, scores and mix) assemble too.
#[test]
fn training_steps_assemble_for_sm80_and_sm90() {
    use nestor_passes::Pass;
    let mut kinds = Vec::new();
    for file in [
        "pooled_loss.nir",
        "attention_loss.nir",
        "pair_attention_loss.nir",
        "order_loss.nir",
        "grouped_conv_loss.nir",
        "positions_loss.nir",
    ] {
        let graph = nestor_passes::Decompose
            .run(&nestor_ir::parse(&filetest(file)).unwrap())
            .unwrap();
        let program = training_program(&graph);
        // A scatter of an input's ids sums each table row's own rows (an index the host
        // builds): a warp a table row.
        let threads = ptx(&program, Arch::Sm90).unwrap().threads_per_task;
        for (step, threads) in program.steps.iter().zip(threads) {
            match step {
                Step::ScatterRows(ScatterRows { ids, .. }) if program.is_input(*ids) => {
                    assert_eq!(threads, 32, "{step:?}");
                }
                // One-hot rows, inserts and column sums: a warp a task too.
                Step::OneHot(_) | Step::Insert(_) | Step::SumRows(_) => {
                    assert_eq!(threads, 32, "{step:?}")
                }
                _ => {}
            }
        }
        kinds.extend(program.steps.iter().map(|step| {
            format!("{step:?}")
                .split([' ', '{'])
                .next()
                .unwrap_or_default()
                .to_owned()
        }));
        assert_every_step_assembles(&program, file);
    }
    for kind in [
        "OneHot",
        "SumRows",
        "LengthValues",
        "Positions",
        "ScatterRows",
        "Insert",
        "AttentionGrad",
        "PairGemm",
    ] {
        assert!(
            kinds.iter().any(|name| name == kind),
            "the training steps have {kind}: {kinds:?}"
        );
    }
}

/// The window steps of a conv net's forward (a convolution with bias, max and average
/// pooling, image means) and their gradients (the convolution's input and weight, max
/// and average pooling's, the means' spread, a strided convolution's input) have
/// kernels, which assemble without spills.
#[test]
fn window_steps_assemble_for_sm80_and_sm90() {
    let mut windows: Vec<String> = Vec::new();
    for file in [
        "conv_net.nir",
        "window_grads.nir",
        "conv_net_loss.nir",
        "strided_conv_loss.nir",
        "adaptive_loss.nir",
    ] {
        let graph = nestor_ir::parse(&filetest(file)).unwrap();
        let program = if file.ends_with("_loss.nir") {
            training_program(&graph)
        } else {
            lower(&Pipeline::unoptimized().run(&graph).unwrap()).unwrap()
        };
        // Window steps take a warp a pixel or image (lanes over its channels) or a
        // weight (lanes over the pixels).
        let module = ptx(&program, Arch::Sm90).unwrap();
        for (index, (step, &threads)) in program
            .steps
            .iter()
            .zip(&module.threads_per_task)
            .enumerate()
        {
            if let Step::Window(Window { kind, .. }) = step {
                windows.push(format!("{kind:?}"));
                assert_eq!(threads, 32, "{kind:?}");
                // The weight gradient adds its lanes' sums with shuffles.
                if *kind == WindowKind::WeightGrad {
                    assert!(shuffles(&module, index) >= 5, "{kind:?}");
                }
            }
        }
        assert_every_step_assembles(&program, file);
    }
    for kind in [
        "Conv",
        "Max",
        "Average",
        "ImageMean",
        "ConvInputGrad",
        "StridedConvInputGrad",
        "WeightGrad",
        "MaxGrad",
        "AverageGrad",
        "ImageSpread",
        "Adaptive",
        "AdaptiveGrad",
        "Bilinear { align_corners: true }",
        "BilinearGrad { align_corners: true }",
    ] {
        assert!(
            windows.iter().any(|name| name == kind),
            "{kind}: {windows:?}"
        );
    }
}

/// Attention with bf16 buffers runs on tensor cores (`mma.sync` m16n8k16, bf16 in, f32
/// out) at the head sizes of real models (64: BERT; 128, the widest it takes), without
/// spills; with f32 buffers, and heads of 256 columns (whose causal kernel spilled on
/// sm_80), it keeps the warp kernel (no `mma`).
#[test]
fn bf16_attention_runs_on_tensor_cores_without_spills() {
    const MMA: &str = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32";
    for head_dim in [64usize, 128, 256] {
        let text = ATTENTION.replace("2, 8]", &format!("4, {head_dim}]"));
        let program = program(&text, "f32", false);
        for arch in Arch::ALL {
            for storage in [Storage::Compute, Storage::Bf16] {
                let module = ptx_storing(&program, arch, storage).unwrap();
                let products = module.ptx.matches(MMA).count();
                if storage == Storage::Compute || head_dim > 128 {
                    assert_eq!(products, 0, "no tensor cores");
                    continue;
                }
                // Per kernel (causal, and one the two others share), per way of reading
                // keys (staged by the block, or from memory), and chunk of 16 keys: two
                // products per 16 columns of the head for the scores (for each group of
                // 64 value columns), one per 8 value columns for P V (unrolled).
                let groups = head_dim.div_ceil(64);
                assert_eq!(
                    products,
                    2 * 2 * (groups * head_dim / 16 * 2 + head_dim / 8)
                );
                assert_assembles_without_spills(
                    &module,
                    arch,
                    &format!("attention d={head_dim} bf16"),
                );
            }
        }
    }
}

/// Attention's gradients with bf16 buffers run on tensor cores at heads of 64 columns
/// (the queries' and the keys' and values', reading the statistics step's results),
/// without spills; wider heads keep the warp kernels.
#[test]
fn bf16_attention_gradients_run_on_tensor_cores_without_spills() {
    const MMA: &str = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32";
    for head_dim in [64usize, 128] {
        let text = format!(
            r#"graph @attention_grad {{
  %0 = input {{name = "x.lengths"}} : lengths[B]
  %1 = input {{name = "q"}} : ragged<f32>[B; %0, 4, {head_dim}]
  %2 = input {{name = "g"}} : ragged<f32>[B; %0, 4, {head_dim}]
  %3 = attention_grad(%1, %1, %1, %2) {{causal = true, part = queries}} : ragged<f32>[B; %0, 4, {head_dim}]
  %4 = attention_grad(%1, %1, %1, %2) {{causal = true, part = keys_values}} : ragged<f32>[B; %0, 2, 4, {head_dim}]
  return %3, %4
}}"#
        );
        let options = nestor_passes::LowerOptions {
            attention_statistics: true,
            ..nestor_passes::LowerOptions::default()
        };
        let program =
            nestor_passes::lower_with(&nestor_ir::parse(&text).unwrap(), options).unwrap();
        for arch in Arch::ALL {
            let module = ptx_storing(&program, arch, Storage::Bf16).unwrap();
            let products = module.ptx.matches(MMA).count();
            if head_dim > 64 {
                assert_eq!(products, 0, "heads of {head_dim}: no tensor cores");
                continue;
            }
            // Queries: scores and slopes (2 x 2 products per 16 columns), dQ (one per
            // 8); keys: the same, dV and dK (one each per 8).
            let per_chunk = head_dim / 16 * 4;
            assert_eq!(products, 2 * per_chunk + head_dim / 8 * 3, "{products} mma");
            assert_assembles_without_spills(
                &module,
                arch,
                &format!("attention_grad d={head_dim} bf16"),
            );
        }
    }
}

/// ptxas assembles `module` for `arch` and no kernel spills; each kernel's registers
/// are printed after `what`.
fn assert_assembles_without_spills(
    module: &nestor_backend_cuda::PtxModule,
    arch: Arch,
    what: &str,
) {
    for kernel in ptxas::assemble(&module.ptx, arch).unwrap() {
        println!(
            "{what} {} {}: {} registers, {} / {} bytes spilled",
            arch.name(),
            kernel.name,
            kernel.registers,
            kernel.spill_stores,
            kernel.spill_loads
        );
        assert_eq!(
            (kernel.spill_stores, kernel.spill_loads),
            (0, 0),
            "{what}: {}",
            kernel.name
        );
    }
}
