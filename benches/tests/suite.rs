//! The suite at tiny sizes: every model, mode, column and operator runs, and the
//! lengths hit their occupancies.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor::StepKind;
use nestor_bench::lengths::{image_sizes, lengths, occupancy};
use nestor_bench::limits::measure_limits;
use nestor_bench::models::{
    run_model, with_columns, Column, Columns, Mode, Model, Outcome, Precision,
};
use nestor_bench::operators::{run_operator, Operator};
use nestor_bench::profile::{profile_training, StepProfile};
use nestor_bench::pytorch::run_pytorch;
use nestor_bench::report::{markdown, Context, Packing};
use nestor_bench::{Scale, OCCUPANCIES};
use tch::Kind;

#[test]
fn lengths_have_one_longest_element_and_their_occupancy() {
    for target in [0.2, 0.35, 0.77] {
        let drawn = lengths(16, 256, target, 3);
        assert_eq!(drawn[0], 256);
        assert!(drawn.iter().all(|&length| (1..=256).contains(&length)));
        let got = occupancy(&drawn, 256);
        assert!((got - target).abs() < 0.08, "{target}: {got}");
        let sizes = image_sizes(16, 64, target, 3);
        assert_eq!(sizes[0], (64, 64));
        let area: i64 = sizes.iter().map(|&(h, w)| h * w).sum();
        let got = area as f64 / (16.0 * 64.0 * 64.0);
        assert!((got - target).abs() < 0.12, "{target}: images {got}");
    }
    assert_eq!(
        lengths(16, 256, 0.35, 9),
        lengths(16, 256, 0.35, 9),
        "fixed seeds"
    );
}

#[test]
fn every_model_column_and_operator_runs() {
    let scale = Scale::smoke();
    let mut models = Vec::new();
    for (model, precision) in Model::ALL
        .into_iter()
        .flat_map(|model| Precision::ALL.map(|precision| (model, precision)))
    {
        let rows = run_model(model, &scale, (0.5, 1), precision).unwrap();
        // 2 modes x 4 columns, all measured.
        assert_eq!(rows.len(), 8, "{model:?} {precision:?}");
        assert!(rows
            .iter()
            .all(|row| row.subject == precision.subject(model)));
        for row in &rows {
            let Outcome::Measured {
                timing, compile, ..
            } = &row.outcome
            else {
                panic!(
                    "{model:?} {:?} {:?}: {:?}",
                    row.mode, row.column, row.outcome
                );
            };
            assert!(timing.median > 0.0);
            assert_eq!(
                compile.is_some(),
                row.column == Column::NestorCompiled,
                "{row:?}"
            );
            if let Some(cost) = compile {
                assert_eq!(cost.compiles, 1, "{row:?}");
            }
        }
        models.extend(rows);
    }
    let mut operators = Vec::new();
    for operator in Operator::ALL {
        let rows = run_operator(operator, &scale, 0.35, 2).unwrap();
        assert_eq!(rows.len(), 3);
        assert!(
            rows.iter()
                .all(|row| matches!(row.outcome, Outcome::Measured { .. })),
            "{rows:?}"
        );
        operators.extend(rows);
    }
    let context = Context {
        command: "test".into(),
        machine: "this one".into(),
        scale: "smoke".into(),
        memory: false,
    };
    let packing = [Packing {
        occupancy: 0.5,
        nested: 1e-5,
        padded: 2e-5,
    }];
    let limits = measure_limits(&scale).unwrap();
    assert!(
        limits.peak_gflops > 0.0 && limits.bandwidth > 0.0,
        "{limits:?}"
    );
    assert_eq!(limits.gemms.len(), 4 * OCCUPANCIES.len());
    let profiles: Vec<StepProfile> = Precision::ALL
        .into_iter()
        .map(|precision| profile_training(Model::Encoder, &scale, (0.35, 3), precision).unwrap())
        .collect();
    for profile in &profiles {
        assert!(profile.calls > 0 && profile.call_seconds > 0.0);
        assert!(profile
            .steps
            .iter()
            .any(|step| step.kind == StepKind::AttentionGradient));
        assert!(profile
            .steps
            .iter()
            .filter(|step| step.kind == StepKind::Gemm)
            .all(|step| step.flops > 0));
    }
    let text = markdown(
        &context,
        Some(&limits),
        &packing,
        &models,
        &operators,
        &profiles,
    );
    assert!(text.contains("## Where compiled training spends its time"));
    assert!(text.contains("| attention gradient |"));
    assert!(text.contains("## Machine limits"));
    assert!(text.contains("feed-forward down"));
    for model in Model::ALL {
        for precision in Precision::ALL {
            let subject = precision.subject(model);
            assert!(text.contains(&format!("### {subject}\n")), "{subject}");
        }
    }
    assert!(text.contains("## bf16"));
    assert!(text.contains("| layer_norm |") || text.contains("### layer_norm"));
    assert!(
        text.contains("1.00x"),
        "padded rows compare with themselves"
    );
}

/// Every model's columns compute the same thing: nestor eager, nestor compiled and the
/// per-element loop equal the padded libtorch reference on its valid positions
/// (inference outputs), or its loss (training steps; each step's SGD update at rate
/// 1e-5 moves the next column's parameters by far less than the tolerance); within
/// 1e-4 in f32, and within bf16's rounding (4e-2 of the largest value) in bf16, where
/// the eager columns run a bf16 model and the compiled one the f32 model in mixed
/// precision.
#[test]
fn every_model_column_equals_the_padded_reference() {
    let scale = Scale::smoke();
    for (model, precision) in Model::ALL
        .into_iter()
        .flat_map(|model| Precision::ALL.map(|precision| (model, precision)))
    {
        let relative = match precision {
            Precision::F32 => 1e-4,
            Precision::Bf16 => 4e-2,
        };
        with_columns(
            model,
            &scale,
            (0.5, 1),
            precision,
            &mut |mode, _, _, columns| {
                let Columns {
                    mut padded,
                    mut per_element,
                    mut nestor,
                    compiled,
                    padded_mask,
                } = columns;
                let reference = padded()?.to_kind(Kind::Float);
                // The padded output's valid rows, packed: `[sum L_i, width]`.
                let reference = match padded_mask {
                    Some(mask) => {
                        let width = reference.size()[2];
                        reference
                            .masked_select(&mask.to_kind(Kind::Bool).expand_as(&reference))
                            .reshape([-1, width])
                    }
                    None => reference,
                };
                // A training step moves the parameters: how far one step moves the loss.
                let drift = match mode {
                    Mode::Inference => 0.0,
                    Mode::Training => (padded()?.to_kind(Kind::Float) - &reference)
                        .abs()
                        .double_value(&[]),
                };
                let mut others = vec![("per-element", per_element()?), ("nestor", nestor()?)];
                if let Some((mut step, _)) = compiled {
                    others.push(("compiled", step()?));
                }
                let scale = reference.abs().max().double_value(&[]).max(1.0);
                for (steps_after, (column, output)) in (2..).zip(others) {
                    let what = format!("{} {}, {column}", precision.subject(model), mode.name());
                    let output = output.to_kind(Kind::Float).reshape(reference.size());
                    let error = (&output - &reference).abs().max().double_value(&[]);
                    let tolerance = relative * scale + f64::from(steps_after) * drift;
                    assert!(
                        error <= tolerance,
                        "{what}: differs by {error:e} (drift {drift:e})"
                    );
                    assert!(
                        output.isfinite().all().int64_value(&[]) == 1,
                        "{what}: not finite"
                    );
                }
                Ok(())
            },
        )
        .unwrap();
    }
}

/// `benches/pytorch.py` runs every PyTorch option on the encoder's and the conv net's
/// smoke batches in the torch venv's Python, in both modes, and the report reads its
/// lines back.
#[test]
fn every_pytorch_option_runs_on_the_same_batches() {
    let scale = Scale::smoke();
    let rows = run_pytorch(Model::Encoder, &scale, (0.5, 1), Precision::F32).unwrap();
    // In bf16 the same options (autocast, the converted model), the same lines.
    let bf16 = run_pytorch(Model::Encoder, &scale, (0.5, 1), Precision::Bf16).unwrap();
    assert!(bf16
        .iter()
        .all(|row| row.subject == "TransformerEncoder bf16"));
    let columns = |rows: &[nestor_bench::models::Measurement]| {
        rows.iter()
            .map(|row| (row.mode, row.column))
            .collect::<Vec<_>>()
    };
    assert_eq!(columns(&bf16), columns(&rows));
    assert!(
        bf16.iter()
            .all(|row| matches!(row.outcome, Outcome::Measured { .. })),
        "{bf16:?}"
    );
    for mode in [Mode::Inference, Mode::Training] {
        let columns: Vec<Column> = rows
            .iter()
            .filter(|row| row.mode == mode)
            .map(|row| {
                assert!(matches!(row.outcome, Outcome::Measured { .. }), "{row:?}");
                row.column
            })
            .collect();
        // The fast path is for inference only.
        let encoder = [
            Column::TorchFastPath,
            Column::TorchPadded,
            Column::TorchCompiled,
            Column::TorchNested,
            Column::TorchNestedCompiled,
        ];
        let expected = match mode {
            Mode::Inference => encoder.to_vec(),
            Mode::Training => encoder[1..].to_vec(),
        };
        assert_eq!(columns, expected, "{mode:?}");
    }
    // The conv net: padded eager and padded torch.compile, in the default layout and
    // channels-last, in both modes.
    let rows = run_pytorch(Model::ConvNet, &scale, (0.5, 1), Precision::F32).unwrap();
    let columns: Vec<Column> = rows.iter().map(|row| row.column).collect();
    let each = [
        Column::TorchPadded,
        Column::TorchCompiled,
        Column::TorchChannelsLast,
        Column::TorchCompiledChannelsLast,
    ];
    assert_eq!(columns, [each, each].concat(), "{rows:?}");
    assert!(
        rows.iter()
            .all(|row| matches!(row.outcome, Outcome::Measured { .. })),
        "{rows:?}"
    );
}
