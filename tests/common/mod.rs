//! Helpers shared by the operator tests: random ragged batches and comparisons with
//! per-element libtorch.
#![allow(dead_code, clippy::unwrap_used)]

pub mod families;

use nestor::{Dense, NestedTensor, Value};
use proptest::prelude::*;
use tch::{Kind, Tensor};

/// Element shapes `[L_i, *tail]` with lengths drawn from 0..=max_len (0 and 1 included
/// often), batch 1..=max_batch.
pub fn lengths(max_batch: usize, max_len: i64) -> impl Strategy<Value = Vec<i64>> {
    proptest::collection::vec(
        prop_oneof![Just(0i64), Just(1i64), 0..=max_len],
        1..=max_batch,
    )
}

/// Proptest cases for a test: `PROPTEST_CASES` when set (`make fuzz` raises it), else
/// `default`.
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default)
}

/// The float kinds every packed op is checked in, with the tolerance for each.
pub fn float_kinds() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Float),
        Just(Kind::Double),
        Just(Kind::Half),
        Just(Kind::BFloat16)
    ]
}

/// Absolute and relative tolerance per kind.
pub fn tolerance(kind: Kind) -> f64 {
    match kind {
        Kind::Double => 1e-10,
        Kind::Float => 1e-5,
        Kind::Half => 2e-3,
        _ => 2e-2,
    }
}

/// Random elements `[L_i, *tail]` of one kind (drawn in f64, then converted, so every
/// kind sees the same numbers), and their NestedTensor.
pub fn batch(lengths: &[i64], tail: &[i64], kind: Kind, seed: i64) -> (NestedTensor, Vec<Tensor>) {
    let mut random = Random::new(seed);
    let elements: Vec<Tensor> = lengths
        .iter()
        .map(|&length| {
            let shape: Vec<i64> = std::iter::once(length)
                .chain(tail.iter().copied())
                .collect();
            random.normal(&shape).to_kind(kind)
        })
        .collect();
    (ragged_batch(&elements, tail, kind), elements)
}

/// The batch of `elements` `[L_i, *tail]` (ragged first dim; an empty list gives an empty
/// batch of that rank).
pub fn ragged_batch(elements: &[Tensor], tail: &[i64], kind: Kind) -> NestedTensor {
    if elements.is_empty() {
        let shape: Vec<i64> = std::iter::once(0).chain(tail.iter().copied()).collect();
        let values = Tensor::zeros(shape, (kind, tch::Device::Cpu));
        return NestedTensor::packed_with_lengths(&values, &[]).unwrap();
    }
    NestedTensor::builder()
        .ragged_dims(&[0])
        .tensors(elements)
        .unwrap()
}

/// Random test data from a seed alone: libtorch's generator is one per process, so
/// tests on other threads would change what `manual_seed` + `randn` draw.
pub struct Random(u64);

impl Random {
    pub fn new(seed: i64) -> Self {
        Self(seed as u64 ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// The next 64 random bits (SplitMix64).
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal values of `shape` in f64 (Box-Muller).
    pub fn normal(&mut self, shape: &[i64]) -> Tensor {
        let count = shape.iter().product::<i64>().max(0) as usize;
        let values: Vec<f64> = (0..count)
            .map(|_| {
                let (u, v) = (self.uniform(), self.uniform());
                (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
            })
            .collect();
        Tensor::from_slice(&values).reshape(shape)
    }

    /// Integers in `0..bound` of `shape` (i64).
    pub fn below(&mut self, bound: u64, shape: &[i64]) -> Tensor {
        let count = shape.iter().product::<i64>().max(0) as usize;
        let values: Vec<i64> = (0..count).map(|_| (self.next() % bound) as i64).collect();
        Tensor::from_slice(&values).reshape(shape)
    }
}

/// Whether two tensors agree within the tolerance of `kind` (compared in f64; NaNs
/// must agree in position).
pub fn close(actual: &Tensor, expected: &Tensor, kind: Kind) -> bool {
    close_within(actual, expected, tolerance(kind))
}

/// [`close`] within `tolerance` (absolute and relative).
pub fn close_within(actual: &Tensor, expected: &Tensor, tolerance: f64) -> bool {
    if actual.size() != expected.size() {
        eprintln!("shape {:?} != {:?}", actual.size(), expected.size());
        return false;
    }
    let (a, e) = (actual.to_kind(Kind::Double), expected.to_kind(Kind::Double));
    let ok = a.allclose(&e, tolerance, tolerance, true);
    if !ok {
        eprintln!(
            "max difference {}",
            (&a - &e)
                .abs()
                .nan_to_num(0.0, None, None)
                .max()
                .double_value(&[])
        );
    }
    ok
}

/// The largest difference of `actual` from `expected` relative to the larger of 1 and
/// `expected`'s largest magnitude (infinite for other shapes): the error measure of
/// values that are sums of terms as large as the tensor's largest (a gradient summed
/// over images and pixels), whose f32 rounding is of that scale whatever an element's
/// own size.
pub fn error_to_scale(actual: &Tensor, expected: &Tensor) -> f64 {
    if actual.size() != expected.size() {
        eprintln!("shape {:?} != {:?}", actual.size(), expected.size());
        return f64::INFINITY;
    }
    let (a, e) = (actual.to_kind(Kind::Double), expected.to_kind(Kind::Double));
    let scale = e.abs().max().double_value(&[]).max(1.0);
    (&a - &e).abs().max().double_value(&[]) / scale
}

/// Whether [`error_to_scale`] is at most `tolerance`.
pub fn close_to_scale(actual: &Tensor, expected: &Tensor, tolerance: f64) -> bool {
    let error = error_to_scale(actual, expected);
    if error > tolerance {
        eprintln!("largest difference {error} of the tensor's scale");
    }
    error <= tolerance
}

/// Asserts every element of `nested` matches `expected` elementwise.
pub fn assert_elements(nested: &NestedTensor, expected: &[Tensor], kind: Kind) {
    assert_elements_of("result", nested, expected, kind)
}

/// [`assert_elements`] for the result named `what` (in the failure message).
pub fn assert_elements_of(what: &str, nested: &NestedTensor, expected: &[Tensor], kind: Kind) {
    assert_elements_within(what, nested, expected, tolerance(kind))
}

/// [`assert_elements_of`] within `tolerance` (absolute and relative).
pub fn assert_elements_within(
    what: &str,
    nested: &NestedTensor,
    expected: &[Tensor],
    tolerance: f64,
) {
    let actual = nested.unbind().unwrap();
    assert_eq!(actual.len(), expected.len(), "{what}: batch size");
    for (index, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            close_within(a, e, tolerance),
            "{what}, element {index}: {a:?} vs {e:?}"
        );
    }
}

/// Compares `text` with the graph of `tests/filetests/<name>.nir` (the lines after its
/// leading `//` comments, which hold the file's filetest directives); `NESTOR_BLESS=1`
/// rewrites the graph and keeps the comments.
pub fn golden(name: &str, text: &str) {
    // Cargo sets the variable when it runs the test; the compile-time value can name
    // another clone that built this binary in the shared target folder.
    let root = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    );
    let path = root.join("tests/filetests").join(format!("{name}.nir"));
    let file = std::fs::read_to_string(&path).unwrap_or_default();
    let graph_at = file
        .split_inclusive('\n')
        .take_while(|line| line.starts_with("//"))
        .map(str::len)
        .sum::<usize>();
    let (comments, expected) = file.split_at(graph_at);
    if std::env::var_os("NESTOR_BLESS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, format!("{comments}{text}")).unwrap();
        return;
    }
    assert!(
        !expected.is_empty(),
        "{} is missing: run with NESTOR_BLESS=1",
        path.display()
    );
    assert_eq!(
        text,
        expected,
        "{name} differs from {}; run with NESTOR_BLESS=1 if the change is intended",
        path.display()
    );
    assert_eq!(
        nestor::ir::parse(expected).unwrap(),
        nestor::ir::parse(text).unwrap()
    );
}

/// A model output of either kind, for models returning both.
pub enum Out {
    Nested(NestedTensor),
    Dense(Dense),
}

impl nestor::TraceOutputs for Out {
    fn trace_refs(&self) -> Vec<Option<nestor::TraceRef>> {
        match self {
            Out::Nested(nested) => nested.trace_refs(),
            Out::Dense(dense) => dense.trace_refs(),
        }
    }
}
impl From<NestedTensor> for Out {
    fn from(nested: NestedTensor) -> Self {
        Out::Nested(nested)
    }
}
impl From<nestor::Reduced> for Out {
    fn from(reduced: nestor::Reduced) -> Self {
        match reduced {
            nestor::Reduced::Nested(nested) => Out::Nested(nested),
            nestor::Reduced::Dense(dense) => Out::Dense(dense),
        }
    }
}

/// The outputs of an eager call as the values a compiled call returns.
pub fn eager_values(outputs: Vec<Out>) -> Vec<Value> {
    outputs
        .into_iter()
        .map(|output| match output {
            Out::Nested(nested) => Value::Nested(nested),
            Out::Dense(dense) => Value::Dense(dense.into_tensor()),
        })
        .collect()
}

/// A value's packed values (a dense value's tensor) and its element sizes (none for
/// dense values).
pub fn value_parts(value: &Value) -> (Tensor, Option<Vec<Vec<i64>>>) {
    match value {
        Value::Nested(nested) => (
            nested.values().shallow_clone(),
            Some(nested.layout().element_sizes().to_vec()),
        ),
        Value::Dense(dense) => (dense.shallow_clone(), None),
        Value::Lengths(lengths) => (Tensor::from_slice(lengths), None),
    }
}

/// Compiled results agree with eager ones position by position: as many outputs, the
/// same kinds and element sizes, NaN exactly where eager has NaN, infinities equal,
/// finite values within `tolerance` (relative and absolute). A failure names the output,
/// the flat position and both values.
pub fn assert_close_within(compiled: &[Value], eager: &[Value], tolerance: f64, what: &str) {
    assert_eq!(compiled.len(), eager.len(), "{what}: outputs");
    for (position, (c, e)) in compiled.iter().zip(eager).enumerate() {
        let ((c, c_sizes), (e, e_sizes)) = (value_parts(c), value_parts(e));
        assert_eq!(c_sizes, e_sizes, "{what}: output {position} sizes");
        let what = format!("{what}: output {position}");
        assert_same_values(&c, &e, tolerance, tolerance, &what);
    }
}

/// [`assert_close_within`] for the float outputs only (integer and boolean outputs are
/// left out: a comparison of a value that products rounded differently may flip), each
/// within `tolerance` of its own value plus `tolerance` of the output's largest
/// magnitude (at least 1): bf16 roundings of a product's operands err relative to the
/// terms, which a sum that cancels leaves much larger than its result.
#[allow(dead_code)] // Not every test binary uses every helper.
pub fn assert_floats_close_within(compiled: &[Value], eager: &[Value], tolerance: f64, what: &str) {
    assert_eq!(compiled.len(), eager.len(), "{what}: outputs");
    for (position, (c, e)) in compiled.iter().zip(eager).enumerate() {
        let ((c, c_sizes), (e, e_sizes)) = (value_parts(c), value_parts(e));
        assert_eq!(c_sizes, e_sizes, "{what}: output {position} sizes");
        if e.is_floating_point() {
            let what = format!("{what}: output {position}");
            let finite = e
                .to_kind(Kind::Double)
                .nan_to_num(0.0, Some(0.0), Some(0.0));
            let largest = if finite.numel() == 0 {
                0.0
            } else {
                finite.abs().max().double_value(&[])
            };
            assert_same_values(&c, &e, tolerance, tolerance * largest.max(1.0), &what);
        }
    }
}

/// `actual` equals `expected` position by position (see [`assert_close_within`]),
/// within `relative * |expected| + absolute`.
pub fn assert_same_values(
    actual: &Tensor,
    expected: &Tensor,
    relative: f64,
    absolute: f64,
    what: &str,
) {
    assert_eq!(actual.size(), expected.size(), "{what}: shape");
    let (a, e) = (
        actual.to_kind(Kind::Double).reshape([-1]),
        expected.to_kind(Kind::Double).reshape([-1]),
    );
    let close = a.isclose(&e, relative, absolute, true);
    let bad = close.logical_not().nonzero();
    if bad.size()[0] > 0 {
        let at = bad.int64_value(&[0, 0]);
        panic!(
            "{what}: {} of {} values differ; first at {at}: got {}, expected {}",
            bad.size()[0],
            e.size()[0],
            a.double_value(&[at]),
            e.double_value(&[at])
        );
    }
}

/// The head of the conv-net test models: global average pooling of the images, a linear
/// layer (`weight [out, C]`), the mean square of its outputs.
pub fn pooled_head_loss(
    images: &NestedTensor,
    weight: &Tensor,
    bias: &Tensor,
) -> nestor::Result<Dense> {
    let channels = weight.size()[1];
    images
        .adaptive_avg_pool2d([1, 1])?
        .reshape_tail(&[channels])?
        .linear(weight, Some(bias))?
        .square()?
        .mean(&[], false)?
        .into_dense_handle()
}

/// Images `[3, h, w]` of these sizes (ragged in H and W) from libtorch's generator
/// seeded with `seed`.
pub fn random_images(sizes: &[(i64, i64)], seed: i64) -> NestedTensor {
    tch::manual_seed(seed);
    let elements: Vec<Tensor> = sizes
        .iter()
        .map(|&(h, w)| Tensor::randn([3, h, w], (Kind::Float, tch::Device::Cpu)))
        .collect();
    NestedTensor::builder()
        .ragged_dims(&[1, 2])
        .tensors(&elements)
        .unwrap()
}

/// A fresh folder `nestor-<name>-<pid>` under the temporary folder, in which the torch
/// venv's python (`NESTOR_VENV`, else under `NESTOR_CACHE` or `~/.cache/nestor`, as
/// scripts/env.sh sets them) ran `script` with the folder and `argument` as arguments:
/// how the checkpoint tests make their models and references with torchvision and
/// transformers.
pub fn python_made_folder(name: &str, script: &str, argument: &str) -> std::path::PathBuf {
    let venv = std::env::var("NESTOR_VENV").unwrap_or_else(|_| {
        let cache = std::env::var("NESTOR_CACHE").unwrap_or_else(|_| {
            format!(
                "{}/.cache/nestor",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        format!("{cache}/venv")
    });
    let python = std::path::Path::new(&venv).join("bin/python");
    assert!(
        python.exists(),
        "{} is missing: run scripts/setup.sh",
        python.display()
    );
    let folder = std::env::temp_dir().join(format!("nestor-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&folder);
    std::fs::create_dir_all(&folder).unwrap();
    let output = std::process::Command::new(python)
        .args(["-c", script])
        .arg(&folder)
        .arg(argument)
        .output()
        .expect("the venv's python");
    assert!(
        output.status.success(),
        "the venv's python failed (scripts/setup.sh installs torchvision and transformers):\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    folder
}

/// The tensors of a safetensors file, by name.
pub fn read_tensors(path: &std::path::Path) -> std::collections::HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}
