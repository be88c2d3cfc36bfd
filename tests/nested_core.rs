//! The eager NestedTensor core: the examples of DanLing's NestedTensor, the data model
//! of DESIGN.md section 3, and typed errors for bad input.

use nestor::{collate, LayoutError, ListElement, NestedError, NestedTensor, PNTensor};
use tch::{Device, Kind, Tensor};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn ints(values: &[i64]) -> Tensor {
    Tensor::from_slice(values)
}

fn one_two_three_four_five() -> Result<NestedTensor, NestedError> {
    NestedTensor::from_tensors(&[ints(&[1, 2, 3]), ints(&[4, 5])])
}

#[test]
fn padded_tensor_mask_concat_shape_and_numel() -> TestResult {
    let nested = one_two_three_four_five()?;
    assert_eq!(
        Vec::<Vec<i64>>::try_from(&nested.tensor()?)?,
        [[1, 2, 3], [4, 5, 0]]
    );
    assert_eq!(
        Vec::<Vec<bool>>::try_from(&nested.mask()?)?,
        [[true, true, true], [true, true, false]]
    );
    assert_eq!(Vec::<i64>::try_from(&nested.concat())?, [1, 2, 3, 4, 5]);
    assert_eq!(nested.shape(), [2, 3]);
    assert_eq!(nested.size(1)?, 3);
    assert_eq!(nested.size(-2)?, 2);
    assert_eq!(nested.numel(), 5);
    assert_eq!(nested.len(), 2);
    assert_eq!(Vec::<i64>::try_from(&nested.packed_offsets())?, [0, 3, 5]);
    assert_eq!(
        Vec::<Vec<i64>>::try_from(&nested.element_sizes())?,
        [[3], [2]]
    );
    let (tensor, mask) = nested.tensor_mask()?;
    assert_eq!(tensor.size(), [2, 3]);
    assert_eq!(mask.kind(), Kind::Bool);
    Ok(())
}

#[test]
fn to_list_returns_the_inputs() -> TestResult {
    let lists = vec![vec![1i64, 2, 3], vec![4, 5]];
    let nested = NestedTensor::from_lists(lists.clone())?;
    let expected: Vec<ListElement> = lists.into_iter().map(ListElement::from).collect();
    assert_eq!(nested.to_list()?, expected);
    let unbound = one_two_three_four_five()?.unbind()?;
    assert_eq!(Vec::<i64>::try_from(&unbound[0])?, [1, 2, 3]);
    assert_eq!(Vec::<i64>::try_from(&unbound[1])?, [4, 5]);
    Ok(())
}

#[test]
fn lists_of_mixed_types_promote_as_torch_does() -> TestResult {
    let mixed = NestedTensor::from_lists([ListElement::from(vec![1i64, 2]), vec![0.5f32].into()])?;
    assert_eq!(mixed.kind(), Kind::Float);
    let with_double =
        NestedTensor::from_lists([ListElement::from(vec![true]), vec![0.5f64].into()])?;
    assert_eq!(with_double.kind(), Kind::Double);
    let bools = NestedTensor::from_lists(vec![vec![true, false], vec![true]])?;
    assert_eq!(bools.kind(), Kind::Bool);
    let matrices = NestedTensor::from_lists(vec![
        vec![vec![1.0f32, 2.0]],
        vec![vec![3.0, 4.0], vec![5.0, 6.0]],
    ])?;
    assert_eq!(matrices.shape(), [2, 2, 2]);
    assert_eq!(matrices.values().size(), [3, 2]);
    let scalars = NestedTensor::from_lists([1.5f64, 2.5])?;
    assert_eq!(scalars.shape(), [2]);
    assert_eq!(Vec::<f64>::try_from(&scalars.tensor()?)?, [1.5, 2.5]);
    Ok(())
}

#[test]
fn tensors_of_different_kinds_promote() -> TestResult {
    let nested = NestedTensor::from_tensors(&[
        Tensor::from_slice(&[1i64, 2]),
        Tensor::from_slice(&[0.5f32]).to_kind(Kind::BFloat16),
        Tensor::from_slice(&[0.25f32]).to_kind(Kind::Half),
    ])?;
    assert_eq!(nested.kind(), Kind::Float);
    Ok(())
}

#[test]
fn occupancy_counts_real_over_padded() -> TestResult {
    let nested = NestedTensor::from_tensors(&[ints(&[1, 2, 3, 4]), ints(&[5, 6])])?;
    assert_eq!(nested.occupancy(), 0.75);
    Ok(())
}

#[test]
fn slicing_inside_every_element() -> TestResult {
    let kind = (Kind::Int64, Device::Cpu);
    let nested = NestedTensor::from_tensors(&[Tensor::arange(3, kind), Tensor::arange(5, kind)])?;
    let sliced = nested.slice(1, 1..)?;
    assert_eq!(Vec::<i64>::try_from(&sliced.get(0)?)?, [1, 2]);
    assert_eq!(Vec::<i64>::try_from(&sliced.get(1)?)?, [1, 2, 3, 4]);
    let last_two = nested.slice(-1, -2..)?;
    assert_eq!(Vec::<i64>::try_from(&last_two.get(0)?)?, [1, 2]);
    assert_eq!(Vec::<i64>::try_from(&last_two.get(1)?)?, [3, 4]);
    // Past the end is clamped, as in Python: element 0 becomes empty.
    let far = nested.slice(1, 4..)?;
    assert_eq!(far.get(0)?.size(), [0]);
    assert_eq!(Vec::<i64>::try_from(&far.get(1)?)?, [4]);
    Ok(())
}

#[test]
fn slicing_a_static_dim_shares_storage() -> TestResult {
    let kind = (Kind::Float, Device::Cpu);
    let nested =
        NestedTensor::from_tensors(&[Tensor::zeros([2, 4], kind), Tensor::zeros([3, 4], kind)])?;
    let sliced = nested.slice(2, 1..3)?;
    assert_eq!(sliced.shape(), [2, 3, 2]);
    assert_eq!(
        sliced.values().data_ptr(),
        nested.values().get(0).get(1).data_ptr()
    );
    Ok(())
}

#[test]
fn batch_second_shape() -> TestResult {
    let kind = (Kind::Float, Device::Cpu);
    let nested = NestedTensor::builder()
        .batch_first(false)
        .tensors(&[Tensor::ones([2, 2], kind), Tensor::ones([3, 2], kind)])?;
    assert_eq!(nested.shape(), [3, 2, 2]);
    assert_eq!(nested.tensor()?.size(), [3, 2, 2]);
    assert_eq!(nested.mask()?.size(), [3, 2]);
    // The batch dim cannot be sliced; dim 0 is the length dim here.
    assert!(matches!(
        nested.slice(1, 1..),
        Err(NestedError::BatchDim { dim: 1, .. })
    ));
    assert_eq!(nested.slice(0, 1..)?.shape(), [2, 2, 2]);
    Ok(())
}

#[test]
fn a_single_tensor_is_a_batch_of_one() -> TestResult {
    let nested = NestedTensor::from_tensor(&Tensor::ones([2, 3], (Kind::Float, Device::Cpu)))?;
    assert_eq!(nested.shape(), [1, 2, 3]);
    assert_eq!(nested.len(), 1);
    Ok(())
}

#[test]
fn an_empty_batch() -> TestResult {
    let nested = NestedTensor::from_tensors(&[])?;
    assert_eq!(nested.shape(), [0]);
    assert_eq!(nested.occupancy(), 0.0);
    assert!(nested.is_empty());
    assert_eq!(nested.tensor()?.size(), [0]);
    assert_eq!(nested.mask()?.size(), [0]);
    assert_eq!(nested.unbind()?.len(), 0);
    let packed =
        NestedTensor::packed_with_lengths(&Tensor::zeros([0, 8], (Kind::Float, Device::Cpu)), &[])?;
    assert_eq!(packed.shape(), [0, 0, 8]);
    assert_eq!(packed.tensor()?.size(), [0, 0, 8]);
    Ok(())
}

#[test]
fn non_prefix_masks_are_rejected() -> TestResult {
    let tensor = Tensor::from_slice(&[1i64, 2, 3, 4, 5, 6, 7, 8]).reshape([2, 4]);
    let mask =
        Tensor::from_slice(&[true, true, true, false, true, false, true, false]).reshape([2, 4]);
    let error = NestedTensor::from_tensor_mask(&tensor, &mask).err();
    assert!(
        matches!(error, Some(NestedError::NonPrefixMask { element: 1 })),
        "{error:?}"
    );
    let mask = Tensor::from_slice(&[1i64, 1, 1, 0, 1, 1, 0, 0]).reshape([2, 4]);
    let nested = NestedTensor::from_tensor_mask(&tensor, &mask)?;
    assert_eq!(Vec::<i64>::try_from(&nested.get(0)?)?, [1, 2, 3]);
    assert_eq!(Vec::<i64>::try_from(&nested.get(1)?)?, [5, 6]);
    Ok(())
}

#[test]
fn mask_value_and_padding_value_options() -> TestResult {
    let nested = NestedTensor::builder()
        .padding_value(-1.0)
        .mask_value(true)
        .tensors(&[ints(&[1, 2, 3]), ints(&[4])])?;
    assert_eq!(
        Vec::<Vec<i64>>::try_from(&nested.tensor()?)?,
        [[1, 2, 3], [4, -1, -1]]
    );
    assert_eq!(
        Vec::<Vec<bool>>::try_from(&nested.mask()?)?,
        [[false, false, false], [false, true, true]]
    );
    let (tensor, mask) = nested.tensor_mask()?;
    let back = NestedTensor::builder()
        .mask_value(true)
        .tensor_mask(&tensor, &mask)?;
    assert_eq!(Vec::<i64>::try_from(&back.get(1)?)?, [4]);
    Ok(())
}

#[test]
fn ragged_dims_anywhere_and_pairs() -> TestResult {
    let kind = (Kind::Int64, Device::Cpu);
    // Elements (2, L_i): the ragged dim is second, so values are [sum L_i, 2].
    let a = Tensor::arange(6, kind).reshape([2, 3]);
    let b = Tensor::arange_start(6, 8, kind).reshape([2, 1]);
    let nested = NestedTensor::from_tensors(&[a.shallow_clone(), b.shallow_clone()])?;
    assert_eq!(nested.packed_dim_order(), [1, 0]);
    assert_eq!(nested.values().size(), [4, 2]);
    assert_eq!(nested.shape(), [2, 2, 3]);
    assert_eq!(
        Vec::<Vec<Vec<i64>>>::try_from(&nested.tensor()?)?,
        [[[0, 1, 2], [3, 4, 5]], [[6, 0, 0], [7, 0, 0]]]
    );
    // The last dim is ragged, so the mask keeps every dim.
    assert_eq!(nested.mask()?.size(), [2, 2, 3]);
    assert!(nested.get(0)?.equal(&a) && nested.get(-1)?.equal(&b));

    // Square pairs (L_i, L_i): two ragged levels.
    let pairs =
        NestedTensor::from_tensors(&[Tensor::ones([2, 2], kind), Tensor::ones([3, 3], kind)])?;
    assert_eq!(pairs.values().size(), [13]);
    assert_eq!(
        Vec::<i64>::try_from(&pairs.ragged_level_offsets(0)?)?,
        [0, 2, 5]
    );
    assert_eq!(
        Vec::<i64>::try_from(&pairs.ragged_level_offsets(1)?)?,
        [0, 2, 4, 7, 10, 13]
    );
    assert!(matches!(
        pairs.ragged_level_offsets(2),
        Err(NestedError::Layout(LayoutError::LevelOutOfRange { .. }))
    ));
    Ok(())
}

#[test]
fn zero_sized_elements_keep_their_shape() -> TestResult {
    let kind = (Kind::Float, Device::Cpu);
    let nested =
        NestedTensor::from_tensors(&[Tensor::zeros([0, 3], kind), Tensor::ones([2, 3], kind)])?;
    assert_eq!(
        Vec::<Vec<i64>>::try_from(&nested.element_sizes())?,
        [[0, 3], [2, 3]]
    );
    assert_eq!(nested.get(0)?.size(), [0, 3]);
    assert_eq!(nested.values().size(), [2, 3]);
    Ok(())
}

#[test]
fn batch_selection_by_range_indices_and_mask() -> TestResult {
    let nested = NestedTensor::from_lists(vec![
        vec![1i64],
        vec![2, 2],
        vec![3, 3, 3],
        vec![4, 4, 4, 4],
    ])?;
    let range = nested.select_batch(1..3)?;
    assert_eq!(
        range.to_list()?,
        NestedTensor::from_lists(vec![vec![2i64, 2], vec![3, 3, 3]])?.to_list()?
    );
    assert_eq!(range.values().data_ptr(), nested.values().get(1).data_ptr());
    let picked = nested.select_batch(vec![-1, 0, 0])?;
    assert_eq!(picked.shape(), [3, 4]);
    assert_eq!(Vec::<i64>::try_from(&picked.get(0)?)?, [4, 4, 4, 4]);
    let masked = nested.select_batch(vec![false, true, false, true])?;
    assert_eq!(Vec::<i64>::try_from(&masked.concat())?, [2, 2, 4, 4, 4, 4]);
    let from_tensor =
        nested.select_batch(nestor::BatchSelector::from_tensor(&Tensor::from_slice(&[
            true, false, false, false,
        ]))?)?;
    assert_eq!(from_tensor.len(), 1);
    Ok(())
}

#[test]
fn select_gives_a_dense_batch() -> TestResult {
    let nested = one_two_three_four_five()?;
    assert_eq!(Vec::<i64>::try_from(&nested.select(1, 0)?)?, [1, 4]);
    assert_eq!(Vec::<i64>::try_from(&nested.select(1, -1)?)?, [3, 5]);
    let error = nested.select(1, 2).err();
    assert!(
        matches!(
            error,
            Some(NestedError::ElementTooShort {
                element: 1,
                index: 2,
                size: 2,
                needed: 3,
                ..
            })
        ),
        "{error:?}"
    );
    Ok(())
}

#[test]
fn bad_input_is_a_typed_error() -> TestResult {
    let kind = (Kind::Float, Device::Cpu);
    let ranks =
        NestedTensor::from_tensors(&[Tensor::ones([2], kind), Tensor::ones([2, 2], kind)]).err();
    assert!(
        matches!(
            ranks,
            Some(NestedError::Layout(LayoutError::RankMismatch {
                element: 1,
                expected: 1,
                got: 2
            }))
        ),
        "{ranks:?}"
    );
    let complex = NestedTensor::from_tensors(&[
        Tensor::ones([2], kind),
        Tensor::ones([2], (Kind::ComplexFloat, Device::Cpu)),
    ])
    .err();
    assert!(
        matches!(
            complex,
            Some(NestedError::UnsupportedKind { element: 1, .. })
        ),
        "{complex:?}"
    );
    let nested = one_two_three_four_five()?;
    assert!(matches!(
        nested.select_batch(vec![true]),
        Err(NestedError::SelectorLength {
            expected: 2,
            got: 1
        })
    ));
    assert!(matches!(
        nested.get(2),
        Err(NestedError::IndexOutOfRange {
            index: 2,
            batch_size: 2
        })
    ));
    assert!(matches!(
        nested.get(-3),
        Err(NestedError::IndexOutOfRange { index: -3, .. })
    ));
    assert!(matches!(
        nested.select_batch(vec![0, 5]),
        Err(NestedError::IndexOutOfRange { index: 5, .. })
    ));
    assert!(matches!(
        nested.size(2),
        Err(NestedError::DimOutOfRange { dim: 2, ndim: 2 })
    ));
    assert!(matches!(
        nested.slice(0, 1..),
        Err(NestedError::BatchDim { dim: 0, .. })
    ));
    let values = Tensor::zeros([5, 2], kind);
    assert!(matches!(
        NestedTensor::packed_with_lengths(&values, &[2, 2]),
        Err(NestedError::LengthsSum { sum: 4, rows: 5 })
    ));
    assert!(matches!(
        NestedTensor::packed_with_lengths(&values, &[6, -1]),
        Err(NestedError::Layout(LayoutError::NegativeSize {
            element: 1,
            dim: 0,
            size: -1
        }))
    ));
    let ragged_rows = NestedTensor::from_lists(vec![vec![vec![1i64, 2], vec![3]]]).err();
    assert!(
        matches!(
            ragged_rows,
            Some(NestedError::InvalidList { element: 0, .. })
        ),
        "{ragged_rows:?}"
    );
    let mask = Tensor::ones([3, 4], (Kind::Bool, Device::Cpu));
    assert!(matches!(
        NestedTensor::from_tensor_mask(&Tensor::zeros([2, 4], kind), &mask),
        Err(NestedError::ShapeMismatch { what: "mask", .. })
    ));
    Ok(())
}

#[test]
fn packed_with_lengths_is_zero_copy() -> TestResult {
    let values = Tensor::arange(12, (Kind::Float, Device::Cpu)).reshape([6, 2]);
    let nested = NestedTensor::packed_with_lengths(&values, &[3, 3])?;
    assert_eq!(nested.values().data_ptr(), values.data_ptr());
    // Equal lengths stay ragged: the layout is declared, not inferred.
    assert_eq!(nested.layout().ragged_dims(), [0]);
    assert_eq!(nested.get(1)?.size(), [3, 2]);
    Ok(())
}

#[test]
fn conversion_keeps_the_structure_and_autograd_flows() -> TestResult {
    let nested = NestedTensor::builder()
        .kind(Kind::Double)
        .requires_grad(true)
        .tensors(&[
            Tensor::ones([2, 3], (Kind::Float, Device::Cpu)),
            Tensor::ones([1, 3], (Kind::Float, Device::Cpu)),
        ])?;
    assert_eq!(nested.kind(), Kind::Double);
    assert!(nested.requires_grad());
    for kind in [
        Kind::Float,
        Kind::Half,
        Kind::BFloat16,
        Kind::Int64,
        Kind::Bool,
    ] {
        let converted = nested.to_kind(kind)?;
        assert_eq!(converted.kind(), kind);
        assert_eq!(converted.layout(), nested.layout());
    }
    assert_eq!(nested.to_device(Device::Cpu)?.shape(), nested.shape());
    // d(sum(3 * padded)) / d(values) is 3 on every real position.
    let padded = nested.to_kind(Kind::Float)?.tensor()?;
    (padded * 3.0).sum(Kind::Float).backward();
    let grad = nested.grad().ok_or("no gradient")?;
    assert!(grad
        .values()
        .allclose(&(nested.values().ones_like() * 3.0), 0.0, 0.0, false));
    // Gradients also flow through elements.
    let leaf = NestedTensor::builder()
        .requires_grad(true)
        .lists(vec![vec![1.0f32, 2.0], vec![3.0]])?;
    (leaf.get(1)? * 5.0).sum(Kind::Float).backward();
    assert_eq!(
        Vec::<f32>::try_from(leaf.grad().ok_or("no gradient")?.values())?,
        [0.0, 0.0, 5.0]
    );
    Ok(())
}

#[test]
fn display_shows_the_elements() -> TestResult {
    let text = one_two_three_four_five()?.to_string();
    assert!(text.starts_with("NestedTensor(["), "{text}");
    assert!(
        text.contains("[1, 2, 3],") && text.contains("[4, 5],"),
        "{text}"
    );
    assert!(text.ends_with("], dtype=Int64, shape=[2, 3])"), "{text}");
    let matrices =
        NestedTensor::from_lists(vec![vec![vec![1i64, 2], vec![3, 4]], vec![vec![5, 6]]])?
            .to_string();
    assert!(matrices.contains("[[1, 2],\n     [3, 4]],"), "{matrices}");
    Ok(())
}

#[test]
fn collating_per_sample_tensors() -> TestResult {
    let batch = collate(vec![PNTensor(ints(&[1, 2, 3])), PNTensor(ints(&[4, 5]))])?;
    assert_eq!(
        Vec::<Vec<i64>>::try_from(&batch.tensor()?)?,
        [[1, 2, 3], [4, 5, 0]]
    );
    assert_eq!(batch.to_list()?, one_two_three_four_five()?.to_list()?);
    Ok(())
}
