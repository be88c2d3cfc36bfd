//! DanLing parity, round 2: comparisons, segmented sorts, saving and loading, pair
//! layouts and the jagged-pair matmul, checked against per-element libtorch.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used)]

mod common;

use common::{batch, close, float_kinds, lengths};
use nestor::NestedTensor;
use proptest::prelude::*;
use tch::{Kind, Tensor};

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    #[test]
    fn equal_and_allclose_agree_with_every_element(
        lengths in lengths(5, 6),
        kind in float_kinds(),
        seed in 0i64..1000,
        nudge in 0usize..8,
    ) {
        let (nested, elements) = batch(&lengths, &[2], kind, seed);
        prop_assert!(nested.equal(&nested).unwrap());
        prop_assert!(nested.allclose(&nested, 1e-5, 1e-8, false).unwrap());
        prop_assert!(nested.equal(&nested.tensor().unwrap()).unwrap());
        // One value moved: no longer equal, still close within a loose tolerance.
        let total = nested.values().numel();
        if total > 0 {
            let flat = nested.values().reshape([-1]).copy();
            let position = (nudge % total) as i64;
            let value = flat.get(position).double_value(&[]);
            let _ = flat.get(position).fill_(value + 1e-3);
            let moved = nested.packed_like(&flat.reshape(nested.values().size())).unwrap();
            let expected = elements.iter().zip(moved.unbind().unwrap()).all(|(a, b)| a.equal(&b));
            prop_assert_eq!(nested.equal(&moved).unwrap(), expected);
            prop_assert!(nested.allclose(&moved, 0.0, 1e-2, false).unwrap());
            prop_assert!(!nested.allclose(&moved, 0.0, 1e-6, false).unwrap() || expected);
        }
        // Another structure: false, not an error.
        let mut longer = lengths.clone();
        longer[0] += 1;
        let (other, _) = batch(&longer, &[2], kind, seed);
        prop_assert!(!nested.equal(&other).unwrap());
        prop_assert!(!nested.allclose(&other, 1.0, 1.0, true).unwrap());
        prop_assert!(!nested.equal(&Tensor::zeros([1, 2, 3], (kind, tch::Device::Cpu))).unwrap());
    }
}

#[test]
fn nans_are_close_only_when_asked() {
    let nested = NestedTensor::from_lists(vec![vec![1.0f32, f32::NAN], vec![2.0]]).unwrap();
    assert!(!nested.equal(&nested).unwrap());
    assert!(!nested.allclose(&nested, 1e-5, 1e-8, false).unwrap());
    assert!(nested.allclose(&nested, 1e-5, 1e-8, true).unwrap());
    // Same elements, lengths packed differently (equal lengths, no ragged dim).
    let dense = NestedTensor::from_lists(vec![vec![1.0f32, 2.0], vec![3.0, 4.0]]).unwrap();
    let ragged = NestedTensor::packed_with_lengths(&dense.values().reshape([-1]), &[2, 2]).unwrap();
    assert!(close(
        &ragged.tensor().unwrap(),
        &dense.tensor().unwrap(),
        Kind::Float
    ));
    assert!(dense.equal(&ragged).unwrap());
}

/// Elements `[L_i, C]` (ragged leading dim) or `[L_i, L_i + 1]` (two ragged dims, so the
/// lines of dim 0 are not contiguous rows) with some values repeated (ties).
fn sortable(lengths: &[i64], pairs: bool, kind: Kind, seed: i64) -> (NestedTensor, Vec<Tensor>) {
    let mut random = common::Random::new(seed);
    let elements: Vec<Tensor> = lengths
        .iter()
        .map(|&length| {
            let shape = if pairs {
                [length, length + 1]
            } else {
                [length, 3]
            };
            // Integers in 0..4: many ties, exact in every kind.
            random.below(4, &shape).to_kind(kind)
        })
        .collect();
    let ragged: &[usize] = if pairs { &[0, 1] } else { &[0] };
    let nested = NestedTensor::builder()
        .ragged_dims(ragged)
        .tensors(&elements)
        .unwrap();
    (nested, elements)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    #[test]
    fn sorts_and_scans_along_ragged_and_static_dims_match_every_element(
        lengths in lengths(5, 7),
        pairs in any::<bool>(),
        kind in float_kinds(),
        descending in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let (nested, elements) = sortable(&lengths, pairs, kind, seed);
        for (dim, element_dim) in [(1i64, 0i64), (2, 1)] {
            let (values, indices) = nested.sort(dim, descending).unwrap();
            let (cummax, cummax_at) = nested.cummax(dim).unwrap();
            let (cummin, cummin_at) = nested.cummin(dim).unwrap();
            let unbound = [&values, &indices, &cummax, &cummax_at, &cummin, &cummin_at].map(|n| n.unbind().unwrap());
            for (i, element) in elements.iter().enumerate() {
                let (v, at) = element.sort_stable(true, element_dim, descending);
                prop_assert!(unbound[0][i].equal(&v) && unbound[1][i].equal(&at), "sort dim {} element {}", dim, i);
                let (v, at) = element.cummax(element_dim);
                prop_assert!(unbound[2][i].equal(&v) && unbound[3][i].equal(&at), "cummax dim {} element {}", dim, i);
                let (v, at) = element.cummin(element_dim);
                prop_assert!(unbound[4][i].equal(&v) && unbound[5][i].equal(&at), "cummin dim {} element {}", dim, i);
            }
            let shortest = elements.iter().map(|e| e.size()[element_dim as usize]).min().unwrap();
            for k in [0, 1, 2, 3] {
                let topk = nested.topk(k, dim, !descending);
                if k > shortest {
                    prop_assert!(matches!(topk, Err(nestor::NestedError::ElementTooShort { .. })), "k {}", k);
                    continue;
                }
                let (top, at) = topk.unwrap();
                for ((element, top), at) in elements.iter().zip(top.unbind().unwrap()).zip(at.unbind().unwrap()) {
                    let (expected, _) = element.topk(k, element_dim, !descending, true);
                    prop_assert!(top.equal(&expected));
                    prop_assert!(element.gather(element_dim, &at, false).equal(&top));
                }
                if k >= 1 {
                    let (kth, at) = nested.kthvalue(k, dim, false).unwrap();
                    let per_element = |reduced: nestor::Reduced| match reduced {
                        nestor::Reduced::Nested(n) => n.unbind().unwrap(),
                        nestor::Reduced::Dense(d) => d.tensor().unbind(0),
                    };
                    for ((element, kth), at) in elements.iter().zip(per_element(kth)).zip(per_element(at)) {
                        let (expected, _) = element.kthvalue(k, element_dim, false);
                        prop_assert!(kth.equal(&expected));
                        prop_assert!(element.gather(element_dim, &at.unsqueeze(element_dim), false).squeeze_dim(element_dim).equal(&kth));
                    }
                }
            }
        }
    }

    #[test]
    fn sorted_values_and_running_maxima_pass_gradients_back(lengths in lengths(5, 7), pairs in any::<bool>(), seed in 0i64..1000) {
        let (nested, elements) = sortable(&lengths, pairs, Kind::Double, seed);
        let leaf = nested.set_requires_grad(true).unwrap();
        let weights = common::Random::new(seed + 1).normal(&[leaf.values().numel() as i64]).reshape(leaf.values().size());
        let (sorted, _) = leaf.sort(1, true).unwrap();
        let (running, _) = leaf.cummax(1).unwrap();
        ((sorted.values() + running.values()) * &weights).sum(Kind::Double).backward();
        let grads = leaf.grad().unwrap().unbind().unwrap();
        let weights = leaf.packed_like(&weights).unwrap().unbind().unwrap();
        for ((element, grad), weights) in elements.iter().zip(&grads).zip(&weights) {
            let x = element.detach().set_requires_grad(true);
            ((x.sort_stable(true, 0, true).0 + x.cummax(0).0) * weights).sum(Kind::Double).backward();
            prop_assert!(close(grad, &x.grad(), Kind::Double));
        }
    }
}

#[test]
fn nan_sorts_last_and_stays_the_running_maximum() {
    let nested =
        NestedTensor::from_lists(vec![vec![2.0f32, f32::NAN, 1.0, f32::NAN], vec![3.0, 1.0]])
            .unwrap();
    let (sorted, indices) = nested.sort(1, false).unwrap();
    let (running, at) = nested.cummax(1).unwrap();
    for (i, element) in nested.unbind().unwrap().iter().enumerate() {
        let (v, a) = element.sort_stable(true, 0, false);
        assert!(close(&sorted.get(i as i64).unwrap(), &v, Kind::Float));
        assert!(indices.get(i as i64).unwrap().equal(&a));
        let (v, a) = element.cummax(0);
        assert!(close(&running.get(i as i64).unwrap(), &v, Kind::Float));
        assert!(
            at.get(i as i64).unwrap().equal(&a),
            "{:?} vs {:?}",
            at.get(i as i64).unwrap(),
            a
        );
    }
}

/// A file path of this test process under the system's temp dir.
fn temp_file(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("nestor-{}-{name}.safetensors", std::process::id()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(16), ..ProptestConfig::default() })]

    #[test]
    fn saved_batches_load_back_with_their_lengths_and_options(
        lengths in lengths(5, 6),
        pairs in any::<bool>(),
        kind in prop_oneof![Just(Kind::Float), Just(Kind::Double), Just(Kind::Half), Just(Kind::BFloat16), Just(Kind::Int64), Just(Kind::Bool)],
        batch_first in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let (nested, _) = sortable(&lengths, pairs, kind, seed);
        let options = nestor::NestedOptions { batch_first, padding_value: -1.5, mask_value: !batch_first };
        let nested = nested.with_options(options);
        let (tokens, _) = batch(&lengths, &[], Kind::Float, seed + 1);
        let path = temp_file(&format!("roundtrip-{seed}"));
        nestor::save_batches(&path, &[("pairs", &nested), ("tokens", &tokens)]).unwrap();
        let loaded = nestor::load_batches(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        prop_assert_eq!(loaded.len(), 2);
        prop_assert_eq!(&loaded[0].0, "pairs");
        let pairs_back = &loaded[0].1;
        prop_assert!(pairs_back.equal(&nested).unwrap());
        prop_assert_eq!(pairs_back.layout(), nested.layout());
        prop_assert_eq!(pairs_back.options(), options);
        prop_assert_eq!(pairs_back.kind(), kind);
        prop_assert!(loaded[1].1.equal(&tokens).unwrap());
        prop_assert_eq!(loaded[1].1.layout(), tokens.layout());
    }
}

#[test]
fn truncated_or_damaged_files_are_typed_errors() {
    let (nested, _) = sortable(&[3, 0, 2], true, Kind::Float, 5);
    let path = temp_file("damaged");
    nested.save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert!(NestedTensor::load(&path).unwrap().equal(&nested).unwrap());
    // Every cut is an error: the header says how long the file must be.
    for cut in (0..bytes.len()).step_by(7) {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let result = NestedTensor::load(&path);
        assert!(
            matches!(result, Err(nestor::NestedError::File { .. })),
            "cut at {cut}: {result:?}"
        );
    }
    // Flipped bytes: an error or a batch that holds together, never a panic.
    let mut random = common::Random::new(9);
    for _ in 0..200 {
        let mut damaged = bytes.clone();
        let at = random.below(bytes.len() as u64, &[1]).int64_value(&[0]) as usize;
        damaged[at] ^= 1 << random.below(8, &[1]).int64_value(&[0]);
        std::fs::write(&path, &damaged).unwrap();
        if let Ok(batch) = NestedTensor::load(&path) {
            assert_eq!(batch.values().size(), batch.layout().packed_shape());
        }
    }
    // Not a file of batches.
    Tensor::write_safetensors(
        &[("x", Tensor::zeros([2], (Kind::Float, tch::Device::Cpu)))],
        &path,
    )
    .unwrap();
    assert!(matches!(
        NestedTensor::load(&path),
        Err(nestor::NestedError::File { .. })
    ));
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(
        NestedTensor::load(&path),
        Err(nestor::NestedError::File { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    #[test]
    fn nested_operands_broadcast_into_square_and_rectangular_pairs(
        lengths in lengths(5, 6),
        others in proptest::collection::vec(0i64..=6, 5),
        kind in float_kinds(),
        seed in 0i64..1000,
    ) {
        let (x, xs) = batch(&lengths, &[3], kind, seed);
        let others = &others[..lengths.len()];
        let (y, ys) = batch(others, &[1], kind, seed + 1);
        // Square: [L_i, 1, C] * [1, L_i, C] -> [L_i, L_i, C].
        let square = (&x.unsqueeze(2).unwrap() * &x.unsqueeze(1).unwrap()).unwrap();
        let expected: Vec<Tensor> = xs.iter().map(|e| e.unsqueeze(1) * e.unsqueeze(0)).collect();
        common::assert_elements(&square, &expected, kind);
        prop_assert_eq!(square.values().size()[0], lengths.iter().map(|l| l * l).sum::<i64>());
        // Rectangular, with a static dim broadcast too: [L_i, 1, C] - [1, M_i, 1].
        let rectangle = (&x.unsqueeze(2).unwrap() - &y.unsqueeze(1).unwrap()).unwrap();
        let expected: Vec<Tensor> = xs.iter().zip(&ys).map(|(a, b)| a.unsqueeze(1) - b.unsqueeze(0)).collect();
        common::assert_elements(&rectangle, &expected, kind);
        // Reversed operands (`other <op> self`).
        let reversed = x.unsqueeze(1).unwrap().binary_reversed(nestor::Binary::Sub, &x.unsqueeze(2).unwrap()).unwrap();
        let expected: Vec<Tensor> = xs.iter().map(|e| e.unsqueeze(1) - e.unsqueeze(0)).collect();
        common::assert_elements(&reversed, &expected, kind);
    }

    #[test]
    fn gradients_of_broadcast_pairs_accumulate(lengths in lengths(5, 6), seed in 0i64..1000) {
        let (x, xs) = batch(&lengths, &[2], Kind::Double, seed);
        let leaf = x.set_requires_grad(true).unwrap();
        let pairs = (&leaf.unsqueeze(2).unwrap() * &leaf.unsqueeze(1).unwrap()).unwrap();
        let weights = common::Random::new(seed).normal(&pairs.values().size());
        (pairs.values() * &weights).sum(Kind::Double).backward();
        let grads = leaf.grad().unwrap().unbind().unwrap();
        let weights = pairs.packed_like(&weights).unwrap().unbind().unwrap();
        for ((element, grad), weights) in xs.iter().zip(&grads).zip(&weights) {
            let e = element.detach().set_requires_grad(true);
            ((e.unsqueeze(1) * e.unsqueeze(0)) * weights).sum(Kind::Double).backward();
            prop_assert!(close(grad, &e.grad(), Kind::Double));
        }
    }
}

#[test]
fn elements_that_do_not_broadcast_are_still_a_structure_mismatch() {
    let (x, _) = batch(&[3, 2], &[2], Kind::Float, 1);
    let (y, _) = batch(&[2, 2], &[2], Kind::Float, 2);
    assert!(matches!(
        &x + &y,
        Err(nestor::NestedError::StructureMismatch { .. })
    ));
    // A static dim of size 2 cannot become a ragged one: [1 (ragged), 2] + [2 (static), 2].
    let (ones, _) = batch(&[1, 1], &[2], Kind::Float, 3);
    let wide = NestedTensor::from_tensors(&[
        Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu)),
        Tensor::ones([2, 2], (Kind::Float, tch::Device::Cpu)),
    ])
    .unwrap();
    assert!(matches!(
        &ones + &wide,
        Err(nestor::NestedError::Unsupported { .. })
    ));
}

/// `softmax(scale * q @ k^T) @ v` written by hand, element by element in libtorch.
fn attention_reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Tensor {
    (q.matmul(&k.transpose(0, 1)) * scale)
        .softmax(-1, None::<Kind>)
        .matmul(v)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(24), ..ProptestConfig::default() })]

    #[test]
    fn hand_written_attention_runs_packed_and_matches_every_element(
        lengths in lengths(6, 40),
        keys in proptest::collection::vec(1i64..=40, 6),
        cross in any::<bool>(),
        kind in float_kinds(),
        seed in 0i64..1000,
    ) {
        let keys: Vec<i64> = if cross { keys[..lengths.len()].to_vec() } else { lengths.clone() };
        let (q, qs) = batch(&lengths, &[8], kind, seed);
        let (k, ks) = batch(&keys, &[8], kind, seed + 1);
        let (v, vs) = batch(&keys, &[5], kind, seed + 2);
        let scale = 0.35;
        // No per-element fallback, no padded materialization.
        let (scores, output) = nestor::nested_execution_guard(|| {
            let scores = q.matmul_nested(&k.transpose(1, 2)?)?;
            let weights = (&scores * scale)?.softmax(2)?;
            Ok::<_, nestor::NestedError>((scores, weights.matmul_nested(&v)?))
        }).unwrap();
        let expected: Vec<Tensor> = qs.iter().zip(&ks).map(|(q, k)| q.matmul(&k.transpose(0, 1))).collect();
        common::assert_elements_of("scores", &scores, &expected, kind);
        let expected: Vec<Tensor> = qs.iter().zip(&ks).zip(&vs).map(|((q, k), v)| attention_reference(q, k, v, scale)).collect();
        // Four rounding steps (product, scale, softmax, product) on each side, in
        // different orders: half precision differed by 2.4e-3 in 1 of 400 cases
        // (lengths [36], seed 624), over the one-step tolerance of 2e-3.
        common::assert_elements_within("attention", &output, &expected, 4.0 * common::tolerance(kind));
    }

    #[test]
    fn gradients_of_the_jagged_pair_matmuls_match(lengths in lengths(5, 20), seed in 0i64..1000) {
        let (q, qs) = batch(&lengths, &[4], Kind::Double, seed);
        let (k, ks) = batch(&lengths, &[4], Kind::Double, seed + 1);
        let (v, vs) = batch(&lengths, &[3], Kind::Double, seed + 2);
        let [q, k, v] = [q, k, v].map(|x| x.set_requires_grad(true).unwrap());
        let weights = (&q.matmul_nested(&k.transpose(1, 2).unwrap()).unwrap() * 0.5).unwrap().softmax(2).unwrap();
        let output = weights.matmul_nested(&v).unwrap();
        let probe = common::Random::new(seed).normal(&output.values().size());
        (output.values() * &probe).sum(Kind::Double).backward();
        let probes = output.packed_like(&probe).unwrap().unbind().unwrap();
        let grads = [&q, &k, &v].map(|x| x.grad().unwrap().unbind().unwrap());
        for (i, ((qe, ke), ve)) in qs.iter().zip(&ks).zip(&vs).enumerate() {
            let [qe, ke, ve] = [qe, ke, ve].map(|x| x.detach().set_requires_grad(true));
            (attention_reference(&qe, &ke, &ve, 0.5) * &probes[i]).sum(Kind::Double).backward();
            for (grad, leaf) in grads.iter().zip([&qe, &ke, &ve]) {
                prop_assert!(close(&grad[i], &leaf.grad(), Kind::Double), "element {}", i);
            }
        }
    }

    #[test]
    fn transposes_move_ragged_dims(lengths in lengths(5, 6), seed in 0i64..1000) {
        let (pairs, elements) = sortable(&lengths, true, Kind::Float, seed);
        let swapped = pairs.transpose(1, 2).unwrap();
        common::assert_elements(&swapped, &elements.iter().map(|e| e.transpose(0, 1)).collect::<Vec<_>>(), Kind::Float);
        let (tokens, elements) = batch(&lengths, &[3, 2], Kind::Float, seed);
        for (dims, element_dims) in [((1, 3), (0, 2)), ((2, 1), (1, 0)), ((2, 3), (1, 2))] {
            let swapped = tokens.transpose(dims.0, dims.1).unwrap();
            common::assert_elements(&swapped, &elements.iter().map(|e| e.transpose(element_dims.0, element_dims.1)).collect::<Vec<_>>(), Kind::Float);
        }
    }
}

/// Symmetric positive definite `[n_i, n_i]` elements (`R R^T + n I`) in `kind`, with
/// both dims ragged, and their right-hand sides `[n_i, 2]`.
fn spd(
    sizes: &[i64],
    kind: Kind,
    seed: i64,
) -> (NestedTensor, Vec<Tensor>, NestedTensor, Vec<Tensor>) {
    let mut random = common::Random::new(seed);
    let matrices: Vec<Tensor> = sizes
        .iter()
        .map(|&n| {
            let r = random.normal(&[n, n]);
            (r.matmul(&r.transpose(0, 1))
                + Tensor::eye(n, (Kind::Double, tch::Device::Cpu)) * n as f64)
                .to_kind(kind)
        })
        .collect();
    let rhs: Vec<Tensor> = sizes
        .iter()
        .map(|&n| random.normal(&[n, 2]).to_kind(kind))
        .collect();
    let a = NestedTensor::builder()
        .ragged_dims(&[0, 1])
        .tensors(&matrices)
        .unwrap();
    let b = NestedTensor::builder()
        .ragged_dims(&[0])
        .tensors(&rhs)
        .unwrap();
    (a, matrices, b, rhs)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(16), ..ProptestConfig::default() })]

    #[test]
    fn linear_algebra_of_square_elements_matches_every_element(
        sizes in proptest::collection::vec(prop_oneof![Just(1i64), Just(3), 0i64..=5], 1..=5),
        double in any::<bool>(),
        seed in 0i64..1000,
    ) {
        let kind = if double { Kind::Double } else { Kind::Float };
        let tolerance = if double { 1e-9 } else { 1e-3 };
        let near = |a: &Tensor, b: &Tensor| a.size() == b.size() && a.to_kind(Kind::Double).allclose(&b.to_kind(Kind::Double), tolerance, tolerance, false);
        let (a, matrices, b, rhs) = spd(&sizes, kind, seed);
        let det = a.det().unwrap().into_dense().unwrap();
        let inverse = a.inverse().unwrap().unbind().unwrap();
        let cholesky = a.cholesky(false).unwrap().unbind().unwrap();
        let solution = a.solve(&b).unwrap().unbind().unwrap();
        let (q, r) = a.qr().unwrap();
        let (u, s, vh) = a.svd().unwrap();
        let (w, v) = a.eigh().unwrap();
        let [q, r, u, s, vh, w, v] = [q, r, u, s, vh, w, v].map(|x| x.unbind().unwrap());
        for (i, m) in matrices.iter().enumerate() {
            prop_assert!(near(&det.get(i as i64), &Tensor::linalg_det(m)), "det {}", i);
            prop_assert!(near(&inverse[i], &Tensor::linalg_inv(m)), "inverse {}", i);
            prop_assert!(near(&cholesky[i], &m.linalg_cholesky(false)), "cholesky {}", i);
            prop_assert!(near(&solution[i], &Tensor::linalg_solve(m, &rhs[i], true)), "solve {}", i);
            prop_assert!(near(&q[i].matmul(&r[i]), m), "qr {}", i);
            prop_assert!(near(&s[i], &m.svd(true, true).1), "svd values {}", i);
            prop_assert!(near(&(&u[i] * &s[i]).matmul(&vh[i]), m), "svd {}", i);
            prop_assert!(near(&w[i], &Tensor::linalg_eigvalsh(m, "L")), "eigenvalues {}", i);
            prop_assert!(near(&(&v[i] * &w[i]).matmul(&v[i].transpose(0, 1)), m), "eigh {}", i);
        }
    }

    #[test]
    fn gradients_of_det_and_solve_match(sizes in proptest::collection::vec(0i64..=4, 1..=4), seed in 0i64..1000) {
        let (a, matrices, b, rhs) = spd(&sizes, Kind::Double, seed);
        let a = a.set_requires_grad(true).unwrap();
        let b = b.set_requires_grad(true).unwrap();
        let det = a.det().unwrap().into_dense().unwrap();
        let solution = a.solve(&b).unwrap();
        (det.sum(Kind::Double) + solution.values().sum(Kind::Double)).backward();
        let (ga, gb) = (a.grad().unwrap().unbind().unwrap(), b.grad().unwrap().unbind().unwrap());
        for (i, (m, r)) in matrices.iter().zip(&rhs).enumerate() {
            let (m, r) = (m.detach().set_requires_grad(true), r.detach().set_requires_grad(true));
            (Tensor::linalg_det(&m) + Tensor::linalg_solve(&m, &r, true).sum(Kind::Double)).backward();
            prop_assert!(close(&ga[i], &m.grad(), Kind::Double), "d det+solve / dA, element {}", i);
            prop_assert!(close(&gb[i], &r.grad(), Kind::Double), "d solve / dB, element {}", i);
        }
    }
}

#[test]
fn linear_algebra_needs_square_elements() {
    let (tokens, _) = batch(&[3, 2], &[3], Kind::Float, 1);
    assert!(matches!(
        tokens.det(),
        Err(nestor::NestedError::Unsupported { .. })
    ));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(16), ..ProptestConfig::default() })]

    #[test]
    fn einsum_over_elements_matches_every_element(lengths in lengths(5, 6), keys in proptest::collection::vec(0i64..=6, 5), kind in float_kinds(), seed in 0i64..1000) {
        use nestor::Operand::{Dense, Nested};
        let (x, xs) = batch(&lengths, &[4], kind, seed);
        let (y, ys) = batch(&lengths, &[4], kind, seed + 1);
        let (k, ks) = batch(&keys[..lengths.len()], &[4], kind, seed + 2);
        let w = common::Random::new(seed + 3).normal(&[4, 3]).to_kind(kind);
        let (pairs, pair_elements) = sortable(&lengths, true, kind, seed + 4);
        let packed = nestor::nested_execution_guard(|| -> nestor::Result<_> {
            Ok([
                nestor::einsum("ld,de->le", &[Nested(&x), Dense(&w)])?,
                nestor::einsum("ld,ld->l", &[Nested(&x), Nested(&y)])?,
                nestor::einsum("ld,ld->dl", &[Nested(&x), Nested(&y)])?,
                nestor::einsum("lm,lm->lm", &[Nested(&pairs), Nested(&pairs)])?,
            ])
        }).unwrap();
        let expected: [Vec<Tensor>; 4] = [
            xs.iter().map(|e| Tensor::einsum("ld,de->le", &[e, &w], None::<&[i64]>)).collect(),
            xs.iter().zip(&ys).map(|(a, b)| Tensor::einsum("ld,ld->l", &[a, b], None::<&[i64]>)).collect(),
            xs.iter().zip(&ys).map(|(a, b)| Tensor::einsum("ld,ld->dl", &[a, b], None::<&[i64]>)).collect(),
            pair_elements.iter().map(|e| e * e).collect(),
        ];
        for (result, expected) in packed.iter().zip(&expected) {
            common::assert_elements(result, expected, kind);
        }
        // q @ k^T names two ragged dims by different letters: element by element.
        let scores = nestor::einsum("ld,md->lm", &[Nested(&x), Nested(&k)]).unwrap();
        let expected: Vec<Tensor> = xs.iter().zip(&ks).map(|(a, b)| a.matmul(&b.transpose(0, 1))).collect();
        common::assert_elements(&scores, &expected, kind);
        prop_assert!(nestor::nested_execution_guard(|| nestor::einsum("ld,md->lm", &[Nested(&x), Nested(&k)])).is_err());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(16), ..ProptestConfig::default() })]

    #[test]
    fn causal_fill_masks_keys_after_their_query(lengths in lengths(5, 6), keys in proptest::collection::vec(0i64..=6, 5), seed in 0i64..1000) {
        let (q, qs) = batch(&lengths, &[3], Kind::Double, seed);
        let (k, ks) = batch(&keys[..lengths.len()], &[3], Kind::Double, seed + 1);
        let q = q.set_requires_grad(true).unwrap();
        let scores = q.matmul_nested(&k.transpose(1, 2).unwrap()).unwrap();
        let masked = scores.causal_fill(-5.0).unwrap();
        masked.values().sum(Kind::Double).backward();
        let grads = q.grad().unwrap().unbind().unwrap();
        for (i, ((a, b), masked)) in qs.iter().zip(&ks).zip(masked.unbind().unwrap()).enumerate() {
            let a = a.detach().set_requires_grad(true);
            let s = a.matmul(&b.transpose(0, 1));
            let (m, n) = (s.size()[0], s.size()[1]);
            let after = Tensor::ones([m, n], (Kind::Bool, tch::Device::Cpu)).triu(1);
            let expected = s.masked_fill(&after, -5.0);
            prop_assert!(close(&masked, &expected, Kind::Double), "element {}", i);
            expected.sum(Kind::Double).backward();
            prop_assert!(close(&grads[i], &a.grad(), Kind::Double), "gradient {}", i);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: common::cases(8), ..ProptestConfig::default() })]

    /// Many short elements take the padded batched GEMM (one call for the batch): the
    /// same products and gradients as every element alone.
    #[test]
    fn many_short_pairs_multiply_in_one_batched_gemm(
        lengths in proptest::collection::vec(prop_oneof![Just(0i64), Just(1i64), 0i64..=6], 64..=80),
        seed in 0i64..1000,
    ) {
        let (q, qs) = batch(&lengths, &[4], Kind::Double, seed);
        let (v, vs) = batch(&lengths, &[3], Kind::Double, seed + 1);
        let [q, v] = [q, v].map(|x| x.set_requires_grad(true).unwrap());
        let scores = nestor::nested_execution_guard(|| q.matmul_nested(&q.transpose(1, 2)?)).unwrap();
        let mixed = scores.tanh().unwrap().matmul_nested(&v).unwrap();
        let expected: Vec<Tensor> = qs.iter().map(|e| e.matmul(&e.transpose(0, 1))).collect();
        common::assert_elements_of("scores", &scores, &expected, Kind::Double);
        let expected: Vec<Tensor> = qs.iter().zip(&vs).map(|(a, b)| a.matmul(&a.transpose(0, 1)).tanh().matmul(b)).collect();
        common::assert_elements_of("mix", &mixed, &expected, Kind::Double);
        mixed.values().sum(Kind::Double).backward();
        let (gq, gv) = (q.grad().unwrap().unbind().unwrap(), v.grad().unwrap().unbind().unwrap());
        for (i, (a, b)) in qs.iter().zip(&vs).enumerate() {
            let (a, b) = (a.detach().set_requires_grad(true), b.detach().set_requires_grad(true));
            a.matmul(&a.transpose(0, 1)).tanh().matmul(&b).sum(Kind::Double).backward();
            prop_assert!(close(&gq[i], &a.grad(), Kind::Double), "dq {}", i);
            prop_assert!(close(&gv[i], &b.grad(), Kind::Double), "dv {}", i);
        }
    }
}
