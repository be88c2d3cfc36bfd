//! Every template against its step's signature: each kernel of the GPU check's programs
//! (forward and training, so every step kind) is generated in every kernel set for
//! both targets, which fails when a template reads an argument its signature lacks or
//! passes as another kind, or never reads one it has; and planted disagreements fail.

use inkwell::context::Context;
use nestor_codegen::{generate_kernel, CodegenError, KernelSet, Storage, Target};
use nestor_passes::{Arg, Param, Program, Role, Signature, Step};

/// The GPU check's programs: name, text, and whether to train it (its loss's joint
/// forward + backward graph).
const PROGRAMS: [(&str, &str, bool); 11] = [
    (
        "encoder_layer",
        include_str!("../../tests/filetests/encoder_layer.optimized.nir"),
        false,
    ),
    (
        "device_mix",
        include_str!("../../tests/filetests/device_mix.nir"),
        false,
    ),
    (
        "pooled_loss",
        include_str!("../../tests/filetests/pooled_loss.nir"),
        true,
    ),
    (
        "attention_loss",
        include_str!("../../tests/filetests/attention_loss.nir"),
        true,
    ),
    (
        "pair_attention",
        include_str!("../../tests/filetests/pair_attention.nir"),
        false,
    ),
    (
        "pair_attention_loss",
        include_str!("../../tests/filetests/pair_attention_loss.nir"),
        true,
    ),
    (
        "conv_net",
        include_str!("../../tests/filetests/conv_net.nir"),
        false,
    ),
    (
        "window_grads",
        include_str!("../../tests/filetests/window_grads.nir"),
        false,
    ),
    (
        "conv_net_loss",
        include_str!("../../tests/filetests/conv_net_loss.nir"),
        true,
    ),
    ("dropout", DROPOUT, true),
    (
        "positions_loss",
        include_str!("../../tests/filetests/positions_loss.nir"),
        true,
    ),
];

/// Training-mode dropout under a sum: a random mask.
const DROPOUT: &str = r#"graph @dropout {
  %0 = input {name = "x.lengths"} : lengths[B]
  %1 = input {name = "x"} : ragged<f32>[B; %0, 4]
  %2 = param {name = "w"} : f32[4, 4]
  %3 = linear(%1, %2) : ragged<f32>[B; %0, 4]
  %4 = dropout(%3) {p = 0.1, train = true} : ragged<f32>[B; %0, 4]
  %5 = sum(%4) {dims = [], keepdim = false} : f32[]
  return %5
}"#;

/// The programs, lowered as for the CPU and as for a GPU (whose attention gradients read
/// saved statistics and come in two parts).
fn programs() -> Vec<(&'static str, Program)> {
    let mut programs = Vec::new();
    for attention_statistics in [false, true] {
        let options = nestor_passes::LowerOptions {
            attention_statistics,
            ..nestor_passes::LowerOptions::default()
        };
        for (name, text, train) in PROGRAMS {
            let graph = nestor_ir::parse(text).unwrap_or_else(|error| panic!("{name}: {error}"));
            let graph = if train {
                nestor_passes::differentiate_loss(&graph)
                    .unwrap_or_else(|error| panic!("{name}: {error}"))
                    .graph
            } else {
                graph
            };
            let program = nestor_passes::lower_with(&graph, options)
                .unwrap_or_else(|error| panic!("{name}: {error}"));
            programs.push((name, program));
        }
    }
    programs
}

/// Generates `step`'s kernel with `signature` into a module of its own.
fn generate(
    program: &Program,
    (target, set): (Target, KernelSet),
    step: &Step,
    signature: &Signature,
) -> Result<(), CodegenError> {
    let context = Context::create();
    let module = context.create_module("signature");
    generate_kernel(
        program,
        (target, set, Storage::Compute),
        (&context, &module),
        "kernel",
        (step, signature),
    )
}

const SETS: [KernelSet; 3] = [
    KernelSet::Library,
    KernelSet::Complete,
    KernelSet::DeviceBlas,
];

#[test]
fn every_template_reads_exactly_its_signature() {
    let mut kinds = std::collections::BTreeSet::new();
    for (name, program) in programs() {
        for step in &program.steps {
            for set in SETS {
                let Some(signature) = step.placement(&program, set).kernel().cloned() else {
                    continue;
                };
                for target in [Target::Host, Target::Nvptx] {
                    generate(&program, (target, set), step, &signature)
                        .unwrap_or_else(|error| panic!("{name}, {set:?}, {target:?}: {error}"));
                }
                if set == KernelSet::Complete {
                    kinds.insert(step.name());
                }
            }
        }
    }
    // Every kind but host steps (libtorch's) has a kernel in the GPU's set.
    let expected = [
        "Attention",
        "AttentionGrad",
        "Gather",
        "Gemm",
        "Insert",
        "LengthValues",
        "OneHot",
        "Pad",
        "PairGemm",
        "Pointwise",
        "Positions",
        "RandomMask",
        "Row",
        "ScatterRows",
        "Segment",
        "SumRows",
        "Unpad",
        "Window",
    ];
    assert_eq!(kinds.into_iter().collect::<Vec<_>>(), expected);
}

/// The attention step of the attention loss and its signature in the GPU's set.
fn attention() -> (Program, Step, Signature) {
    let (_, program) = programs()
        .into_iter()
        .find(|(name, _)| *name == "attention_loss")
        .expect("the attention loss is a program");
    let step = program
        .steps
        .iter()
        .find(|step| matches!(step, Step::Attention(_)))
        .expect("an attention step")
        .clone();
    let signature = step
        .placement(&program, KernelSet::Complete)
        .kernel()
        .cloned()
        .expect("attention is a kernel on a GPU");
    (program, step, signature)
}

fn position(signature: &Signature, role: Role) -> usize {
    signature
        .params
        .iter()
        .position(|param| param.role == role)
        .expect("the role is in the signature")
}

#[test]
fn a_swapped_argument_fails_code_generation() {
    let (program, step, mut signature) = attention();
    // The queries' buffer and the query offsets trade places in the table.
    let (queries, offsets) = (
        position(&signature, Role::Queries),
        position(&signature, Role::Offsets),
    );
    let (a, b) = (signature.params[queries].arg, signature.params[offsets].arg);
    signature.params[queries].arg = b;
    signature.params[offsets].arg = a;
    let error = generate(
        &program,
        (Target::Nvptx, KernelSet::Complete),
        &step,
        &signature,
    )
    .expect_err("a swapped argument is caught");
    assert!(
        error
            .0
            .contains("reads Queries, but the signature passes Offsets"),
        "{error}"
    );
}

#[test]
fn a_missing_or_unread_argument_fails_code_generation() {
    let (program, step, signature) = attention();
    let mut missing = signature.clone();
    missing
        .params
        .remove(position(&signature, Role::KeyOffsets));
    let error = generate(
        &program,
        (Target::Host, KernelSet::Complete),
        &step,
        &missing,
    )
    .expect_err("a missing argument is caught");
    assert!(
        error
            .0
            .contains("reads KeyOffsets, which its signature lacks"),
        "{error}"
    );

    let mut extra = signature;
    extra.params.push(Param {
        role: Role::Count,
        arg: Arg::Count(nestor_passes::Rows::fixed(1)),
    });
    let error = generate(&program, (Target::Host, KernelSet::Complete), &step, &extra)
        .expect_err("an unread argument is caught");
    assert!(error.0.contains("Count"), "{error}");
    assert!(error.0.contains("never read by the template"), "{error}");
}

#[test]
fn the_table_order_is_the_signatures() {
    // Templates ask by role: a permuted signature (the executors write the table in its
    // order) still generates.
    let (program, step, mut signature) = attention();
    signature.params.reverse();
    generate(
        &program,
        (Target::Host, KernelSet::Complete),
        &step,
        &signature,
    )
    .expect("any order of the arguments is the template's");
}

#[test]
fn kernel_keys_keep_the_output_identity() {
    // Two GEMMs whose epilogues read the output in different places compile apart.
    let (_, program) = programs()
        .into_iter()
        .find(|(name, _)| *name == "encoder_layer")
        .expect("the encoder layer");
    let step = program
        .steps
        .iter()
        .find(|step| matches!(step, Step::Gemm(gemm) if gemm.epilogue.is_some()))
        .expect("a GEMM with an epilogue")
        .clone();
    let Step::Gemm(gemm) = &step else {
        unreachable!("found as a GEMM");
    };
    let signature = step
        .placement(&program, KernelSet::Library)
        .kernel()
        .cloned()
        .expect("an epilogue kernel");
    let mut other = gemm.clone();
    let epilogue = other.epilogue.as_mut().expect("an epilogue");
    for access in &mut epilogue.inputs {
        access.slot = if access.slot == gemm.out {
            nestor_passes::Slot(999)
        } else {
            gemm.out
        };
    }
    let other = Step::Gemm(other);
    assert_ne!(step.kernel_key(&signature), other.kernel_key(&signature));
    // Renumbered buffers alone share the kernel.
    let mut renamed = gemm.clone();
    renamed.x = nestor_passes::Slot(777);
    assert_eq!(
        step.kernel_key(&signature),
        Step::Gemm(renamed).kernel_key(&signature)
    );
}
