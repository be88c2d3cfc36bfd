//! The optimizer on real models: the golden optimized Transformer encoder layer, its
//! kernel count, and a 6-layer encoder optimized to saturation.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{batch, golden};
use nestor::ir::print;
use nestor::nn::{TransformerConfig, TransformerEncoder, TransformerEncoderLayer};
use nestor::passes::optimize::StopReason;
use nestor::passes::{lower, Limits, Optimize, Pipeline, Step};
use nestor::{compile, trace, Dense, NestedTensor};
use nestor_passes::step::{Gemm, Row};
use tch::{nn, Device, Kind};

fn config() -> TransformerConfig {
    TransformerConfig {
        d_model: 8,
        nhead: 2,
        dim_feedforward: 16,
        dropout: 0.1,
        ..Default::default()
    }
}

#[test]
fn the_optimized_post_norm_encoder_layer_is_seven_kernels() {
    tch::manual_seed(21);
    let store = nn::VarStore::new(Device::Cpu);
    let layer = TransformerEncoderLayer::new(&(store.root() / "layer"), &config());
    let (tokens, _) = batch(&[4, 2, 3], &[8], Kind::Float, 22);
    let traced = trace("encoder_layer", &[&tokens], &[], Some(&store), |x, _| {
        layer.forward(&x[0], false)
    })
    .unwrap();
    let optimized = Pipeline::optimizing(Limits::untimed())
        .run(traced.graph())
        .unwrap();
    golden("encoder_layer.optimized", &print(&optimized));
    let unoptimized = Pipeline::unoptimized().run(traced.graph()).unwrap();
    let plain = lower(&unoptimized).unwrap();
    let program = lower(&optimized).unwrap();
    // in_proj GEMM, attention, out_proj GEMM + residual add, layer_norm, linear1 GEMM +
    // relu, linear2 GEMM + residual add, layer_norm (the bound is 12).
    assert_eq!(program.launches(), 7, "{program:#?}");
    assert_eq!(plain.launches(), 10, "{plain:#?}");
    let epilogues = program
        .steps
        .iter()
        .filter(|step| {
            matches!(
                step,
                Step::Gemm(Gemm {
                    epilogue: Some(_),
                    ..
                })
            )
        })
        .count();
    let prologues = program
        .steps
        .iter()
        .filter(
            |step| matches!(step, Step::Row(Row { x, width, .. }) if x.as_plain(*width).is_none()),
        )
        .count();
    // The residual adds could as well be layer_norm prologues: the same launches and
    // bytes, so the cost model ties and extraction keeps the epilogues.
    assert_eq!((epilogues, prologues), (3, 0), "{program:#?}");
    // Their biases are added by the epilogues (a row read by every output row), not
    // written into the output before the product.
    for step in &program.steps {
        if let Step::Gemm(Gemm {
            bias,
            epilogue: Some(epilogue),
            ..
        }) = step
        {
            assert_eq!(*bias, None, "{step:#?}");
            assert!(
                epilogue.inputs.iter().any(|access| access.row_stride == 0),
                "{step:#?}"
            );
        }
    }
}

#[test]
fn a_six_layer_encoder_optimizes_to_saturation() {
    tch::manual_seed(23);
    let store = nn::VarStore::new(Device::Cpu);
    let config = TransformerConfig {
        d_model: 16,
        nhead: 4,
        dim_feedforward: 32,
        ..Default::default()
    };
    let encoder = TransformerEncoder::new(&(store.root() / "encoder"), &config, 6, true);
    let (tokens, _) = batch(&[5, 3], &[16], Kind::Float, 24);
    let traced = trace("encoder6", &[&tokens], &[], Some(&store), |x, _| {
        encoder.forward(&x[0], false)
    })
    .unwrap();
    let (optimized, report) = Optimize::default()
        .with_limits(Limits::untimed())
        .optimize(traced.graph())
        .unwrap();
    optimized.verify().unwrap();
    for phase in &report.phases {
        assert!(matches!(phase.stop, StopReason::Saturated), "{report}");
    }
    // Printed for the record (timing is measured, never asserted).
    println!("{report}");
    let (before, after) = report.kernels;
    assert!(after.unwrap() <= before.unwrap(), "{report}");
}

#[test]
fn the_optimizer_moves_fewer_bytes_and_launches_fewer_kernels() {
    tch::manual_seed(25);
    let store = nn::VarStore::new(Device::Cpu);
    let layer = TransformerEncoderLayer::new(&(store.root() / "layer"), &config());
    let model = |x: &[NestedTensor], _: &[Dense]| layer.forward(&x[0], false);
    let optimized = compile("layer", model).optimizer_limits(Limits::untimed());
    let unoptimized = compile("layer", model).optimized(false);
    let (tokens, _) = batch(&[7, 1, 12, 4], &[8], Kind::Float, 26);
    let fast = optimized
        .call(&[&tokens], &[])
        .unwrap()
        .remove(0)
        .into_nested()
        .unwrap();
    let slow = unoptimized
        .call(&[&tokens], &[])
        .unwrap()
        .remove(0)
        .into_nested()
        .unwrap();
    assert!(fast.values().allclose(slow.values(), 1e-5, 1e-5, false));
    let (fast, slow) = (optimized.stats(), unoptimized.stats());
    assert_eq!((fast.kernel_launches, slow.kernel_launches), (7, 10));
    assert!(fast.bytes_moved < slow.bytes_moved, "{fast:?} vs {slow:?}");
}
