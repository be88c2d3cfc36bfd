//! Saving and loading batches in the `safetensors` format, lengths included.
//!
//! A batch named `name` is three tensors, `name.values` (the packed values),
//! `name.element_sizes` (`i64[B, R]`) and `name.ragged_dims` (`i64[k]`), and its
//! presentation options in the file's metadata (`name.batch_first`,
//! `name.padding_value`, `name.mask_value`). Any safetensors reader sees the packed
//! values and the lengths. Loading reads the file into one buffer and makes every
//! tensor a view of it (no copy); a file that is not such a batch is a typed error.

use std::collections::HashMap;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, View};
use tch::{Device, Kind, Tensor};

use nestor_layout::RaggedLayout;

use super::{NestedOptions, NestedTensor};
use crate::{NestedError, Result};

/// What the metadata says a file holds.
const FORMAT: (&str, &str) = ("format", "nestor.nested/1");

/// A tensor's bytes, ready to write.
struct Bytes {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl Bytes {
    fn of(tensor: &Tensor) -> Result<Self> {
        let tensor = tensor.f_to_device(Device::Cpu)?.f_contiguous()?;
        let dtype = Dtype::try_from(tensor.kind())?;
        let shape = tensor
            .size()
            .iter()
            .map(|&size| usize::try_from(size).unwrap_or(0))
            .collect();
        let numel = tensor.numel();
        let length =
            numel
                .checked_mul(tensor.kind().elt_size_in_bytes())
                .ok_or(NestedError::TooLarge {
                    op: "save",
                    what: format!("a tensor of {numel} values"),
                })?;
        let mut data = Vec::new();
        data.try_reserve_exact(length)
            .map_err(|_| NestedError::TooLarge {
                op: "save",
                what: format!("a buffer of {length} bytes"),
            })?;
        data.resize(length, 0);
        tensor.f_copy_data_u8(&mut data, numel)?;
        Ok(Self { dtype, shape, data })
    }
}

impl View for &Bytes {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Saves named batches into one safetensors file at `path` (replacing it). Names must
/// be distinct and free of `.`-suffix clashes (`a` and `a.values` cannot both be used).
///
/// ```
/// use nestor_frontend::{load_batches, save_batches, NestedTensor};
/// let tokens = NestedTensor::from_lists(vec![vec![1i64, 2, 3], vec![4]])?;
/// let path = std::env::temp_dir().join("nestor-doc-batches.safetensors");
/// save_batches(&path, &[("tokens", &tokens)])?;
/// let loaded = load_batches(&path)?;
/// assert_eq!(loaded[0].0, "tokens");
/// assert!(loaded[0].1.equal(&tokens)?);
/// # std::fs::remove_file(&path).ok();
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
pub fn save_batches(path: impl AsRef<Path>, batches: &[(&str, &NestedTensor)]) -> Result<()> {
    let path = path.as_ref();
    let mut tensors: Vec<(String, Bytes)> = Vec::new();
    let mut metadata: HashMap<String, String> = HashMap::new();
    metadata.insert(FORMAT.0.into(), FORMAT.1.into());
    for (name, batch) in batches {
        batch.concrete_read("save_batches");
        if name.is_empty() || metadata.contains_key(&format!("{name}.batch_first")) {
            return Err(corrupt(
                path,
                format!("batch name {name:?} is empty or used twice"),
            ));
        }
        let layout = batch.lay();
        let rank = layout.rank() as i64;
        let sizes: Vec<i64> = layout.element_sizes().iter().flatten().copied().collect();
        let sizes = Tensor::f_from_slice(&sizes)?.f_reshape([batch.batch_size() as i64, rank])?;
        let ragged: Vec<i64> = layout.ragged_dims().iter().map(|&dim| dim as i64).collect();
        tensors.push((format!("{name}.values"), Bytes::of(batch.packed())?));
        tensors.push((format!("{name}.element_sizes"), Bytes::of(&sizes)?));
        tensors.push((
            format!("{name}.ragged_dims"),
            Bytes::of(&Tensor::f_from_slice(&ragged)?)?,
        ));
        let options = batch.options();
        metadata.insert(
            format!("{name}.batch_first"),
            options.batch_first.to_string(),
        );
        metadata.insert(
            format!("{name}.padding_value"),
            options.padding_value.to_string(),
        );
        metadata.insert(format!("{name}.mask_value"), options.mask_value.to_string());
    }
    let views = tensors.iter().map(|(name, bytes)| (name.as_str(), bytes));
    safetensors::tensor::serialize_to_file(views, &Some(metadata), path)
        .map_err(|error| corrupt(path, error.to_string()))
}

/// Loads every batch of a file written by [`save_batches`], in name order.
pub fn load_batches(path: impl AsRef<Path>) -> Result<Vec<(String, NestedTensor)>> {
    let path = path.as_ref();
    let length = std::fs::metadata(path)
        .map_err(|error| corrupt(path, error.to_string()))?
        .len();
    let length =
        i64::try_from(length).map_err(|_| corrupt(path, "the file is too large".into()))?;
    let name = path
        .to_str()
        .ok_or_else(|| corrupt(path, "the path is not UTF-8".into()))?;
    // One buffer for the whole file; every tensor below is a view of it.
    let buffer = Tensor::f_from_file(name, false, Some(length), (Kind::Uint8, Device::Cpu))?;
    let bytes = host_bytes(&buffer)?;
    let file = SafeTensors::deserialize(bytes).map_err(|error| corrupt(path, error.to_string()))?;
    let (_, header) =
        SafeTensors::read_metadata(bytes).map_err(|error| corrupt(path, error.to_string()))?;
    let metadata = header.metadata().clone().unwrap_or_default();
    if metadata.get(FORMAT.0).map(String::as_str) != Some(FORMAT.1) {
        return Err(corrupt(
            path,
            format!("its metadata does not say {:?}", FORMAT.1),
        ));
    }
    let tensor = |name: &str| -> Result<Tensor> {
        let view = file
            .tensor(name)
            .map_err(|_| corrupt(path, format!("tensor {name:?} is missing")))?;
        let kind = Kind::try_from(view.dtype())?;
        let start = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
        let shape: Vec<i64> = view.shape().iter().map(|&size| size as i64).collect();
        let raw = buffer.f_narrow(0, start as i64, view.data().len() as i64)?;
        Ok(raw.f_view_dtype(kind)?.f_reshape(&shape)?)
    };
    let mut names: Vec<&str> = metadata
        .keys()
        .filter_map(|key| key.strip_suffix(".batch_first"))
        .collect();
    names.sort_unstable();
    names
        .into_iter()
        .map(|name| {
            let option = |key: &str| -> Result<&str> {
                metadata
                    .get(&format!("{name}.{key}"))
                    .map(String::as_str)
                    .ok_or_else(|| corrupt(path, format!("{name}: option {key} is missing")))
            };
            let parse_error =
                |key: &str| corrupt(path, format!("{name}: option {key} is not valid"));
            let options = NestedOptions {
                batch_first: option("batch_first")?
                    .parse()
                    .map_err(|_| parse_error("batch_first"))?,
                padding_value: option("padding_value")?
                    .parse()
                    .map_err(|_| parse_error("padding_value"))?,
                mask_value: option("mask_value")?
                    .parse()
                    .map_err(|_| parse_error("mask_value"))?,
            };
            let sizes = integers(
                path,
                name,
                "element_sizes",
                &tensor(&format!("{name}.element_sizes"))?,
            )?;
            let ragged = integers(
                path,
                name,
                "ragged_dims",
                &tensor(&format!("{name}.ragged_dims"))?,
            )?;
            let layout = layout_of(path, name, &sizes, &ragged, length)?;
            let values = tensor(&format!("{name}.values"))?;
            if values.size() != layout.packed_shape() {
                return Err(corrupt(
                    path,
                    format!(
                        "{name}: the values have shape {:?}, the lengths need {:?}",
                        values.size(),
                        layout.packed_shape()
                    ),
                ));
            }
            Ok((
                name.to_string(),
                NestedTensor::from_parts(values, layout, options),
            ))
        })
        .collect()
}

impl NestedTensor {
    /// Saves this batch (values, lengths and options) as a safetensors file; see
    /// [`save_batches`] for several batches in one file.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        save_batches(path, &[("batch", self)])
    }

    /// Loads a batch saved by [`save`](Self::save) (a file of exactly one batch).
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let mut batches = load_batches(path)?;
        match batches.len() {
            1 => Ok(batches.remove(0).1),
            count => Err(corrupt(
                path,
                format!("it holds {count} batches, expected 1"),
            )),
        }
    }
}

/// The bytes of a contiguous CPU `u8` tensor.
fn host_bytes(buffer: &Tensor) -> Result<&[u8]> {
    let length = buffer.numel();
    if buffer.kind() != Kind::Uint8 || buffer.device() != Device::Cpu || !buffer.is_contiguous() {
        return Err(NestedError::Unsupported {
            op: "load",
            reason: "the file buffer is not a contiguous CPU byte tensor".into(),
        });
    }
    if length == 0 {
        return Ok(&[]);
    }
    // SAFETY: `buffer` is a contiguous CPU u8 tensor of `length` bytes (checked above),
    // its storage lives as long as the borrow of `buffer`, and nothing writes to it
    // while the returned slice is alive (the tensor is private to `load_batches`).
    Ok(unsafe { std::slice::from_raw_parts(buffer.data_ptr() as *const u8, length) })
}

/// The values of an integer tensor of the file, as i64.
fn integers(path: &Path, name: &str, what: &str, tensor: &Tensor) -> Result<(Vec<i64>, Vec<i64>)> {
    if tensor.kind() != Kind::Int64 {
        return Err(corrupt(
            path,
            format!("{name}.{what} is {:?}, not i64", tensor.kind()),
        ));
    }
    Ok((
        Vec::<i64>::try_from(&tensor.f_flatten(0, -1)?)?,
        tensor.size(),
    ))
}

/// The layout the file's element sizes and ragged dims describe.
fn layout_of(
    path: &Path,
    name: &str,
    (sizes, shape): &(Vec<i64>, Vec<i64>),
    (ragged, _): &(Vec<i64>, Vec<i64>),
    file_length: i64,
) -> Result<RaggedLayout> {
    let [batch, rank] = shape.as_slice() else {
        return Err(corrupt(
            path,
            format!("{name}.element_sizes has shape {shape:?}, not [B, R]"),
        ));
    };
    // Each element holds at least one byte of values unless it is empty, which needs a
    // dim of size 0: a batch larger than the file with rank 0 cannot be right.
    if *rank == 0 && *batch > file_length {
        return Err(corrupt(
            path,
            format!("{name}: {batch} scalar elements in a file of {file_length} bytes"),
        ));
    }
    let element_sizes: Vec<Vec<i64>> = if *rank == 0 {
        vec![Vec::new(); *batch as usize]
    } else {
        sizes.chunks(*rank as usize).map(<[i64]>::to_vec).collect()
    };
    let ragged = ragged
        .iter()
        .map(|&dim| usize::try_from(dim))
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| corrupt(path, format!("{name}.ragged_dims holds a negative dim")))?;
    let layout = RaggedLayout::from_element_sizes(element_sizes, &ragged)?;
    if layout.ragged_dims() != ragged.as_slice() {
        return Err(corrupt(
            path,
            format!(
                "{name}: ragged dims {ragged:?} do not match the sizes ({:?})",
                layout.ragged_dims()
            ),
        ));
    }
    Ok(layout)
}

fn corrupt(path: &Path, reason: String) -> NestedError {
    NestedError::File {
        path: path.display().to_string(),
        reason,
    }
}
