//! The suite at tiny sizes: every model, mode, column and operator runs, and the
//! lengths hit their occupancies.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

use nestor_bench::lengths::{image_sizes, lengths, occupancy};
use nestor_bench::models::{run_model, Column, Mode, Model, Outcome};
use nestor_bench::operators::{run_operator, Operator};
use nestor_bench::report::{markdown, Context, Packing};
use nestor_bench::Scale;

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
    for model in Model::ALL {
        let rows = run_model(model, &scale, 0.5, 1).unwrap();
        // 2 modes x 4 columns, all measured but the conv net's compiled training (its
        // convolutions run per element through libtorch and have no gradient rule).
        assert_eq!(rows.len(), 8, "{model:?}");
        for row in &rows {
            let unavailable = model == Model::ConvNet
                && row.column == Column::NestorCompiled
                && row.mode == Mode::Training;
            match (&row.outcome, unavailable) {
                (
                    Outcome::Measured {
                        timing, compile, ..
                    },
                    false,
                ) => {
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
                (Outcome::Unavailable(why), true) => assert!(why.contains("training"), "{why}"),
                (outcome, _) => panic!("{model:?} {:?} {:?}: {outcome:?}", row.mode, row.column),
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
    let text = markdown(&context, &packing, &models, &operators);
    for model in Model::ALL {
        assert!(text.contains(model.name()), "{}", model.name());
    }
    assert!(text.contains("| layer_norm |") || text.contains("### layer_norm"));
    assert!(
        text.contains("1.00x"),
        "padded rows compare with themselves"
    );
}
