//! Parameters from a safetensors checkpoint, by name, with errors that name the file
//! and the tensor (missing, of another shape or dtype, or a file that is not one).

use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use tch::{Kind, Tensor};

use crate::{NestedError, Result};

/// A checkpoint file's bytes.
pub(crate) struct Checkpoint {
    path: PathBuf,
    bytes: Vec<u8>,
}

/// An error about the file at `path`.
pub(crate) fn file_error(path: &Path, error: impl std::fmt::Display) -> NestedError {
    NestedError::File {
        path: path.display().to_string(),
        reason: error.to_string(),
    }
}

impl Checkpoint {
    /// Reads the file at `path` (checked as safetensors when it is used).
    pub(crate) fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|error| file_error(path, error))?;
        let checkpoint = Self {
            path: path.to_path_buf(),
            bytes,
        };
        checkpoint.tensors()?;
        Ok(checkpoint)
    }

    fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.bytes)
            .map_err(|error| file_error(&self.path, format!("not a safetensors file: {error}")))
    }

    /// The names of its tensors.
    pub(crate) fn names(&self) -> Result<Vec<String>> {
        Ok(self
            .tensors()?
            .names()
            .into_iter()
            .map(String::from)
            .collect())
    }

    /// The shape of tensor `name`, if the checkpoint has it.
    pub(crate) fn shape(&self, name: &str) -> Result<Option<Vec<i64>>> {
        Ok(self
            .tensors()?
            .tensor(name)
            .ok()
            .map(|view| view.shape().iter().map(|&size| size as i64).collect()))
    }

    /// Copies the checkpoint's tensor `prefix + name` into every `(name, parameter)`,
    /// without recording gradients; the first missing or mis-shaped one is an error.
    pub(crate) fn load(&self, named: Vec<(String, &Tensor)>, prefix: &str) -> Result<()> {
        let file = self.tensors()?;
        let _guard = tch::no_grad_guard();
        for (name, parameter) in named {
            let stored = format!("{prefix}{name}");
            let view = file
                .tensor(&stored)
                .map_err(|_| file_error(&self.path, format!("the tensor {stored} is missing")))?;
            let shape: Vec<i64> = view.shape().iter().map(|&size| size as i64).collect();
            if shape != parameter.size() {
                return Err(file_error(
                    &self.path,
                    format!(
                        "the tensor {stored} has shape {shape:?}, the model's is {:?}",
                        parameter.size()
                    ),
                ));
            }
            let kind = Kind::try_from(view.dtype()).map_err(|_| {
                file_error(
                    &self.path,
                    format!("the tensor {stored} is {:?}", view.dtype()),
                )
            })?;
            let values = Tensor::f_from_data_size(view.data(), &shape, kind)?;
            parameter.shallow_clone().f_copy_(&values)?;
        }
        Ok(())
    }
}
