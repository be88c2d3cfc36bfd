//! The pass trait and the pipeline that runs passes in order.

use std::path::PathBuf;

use nestor_ir::{Graph, VerifyError};
use thiserror::Error;

/// Why a pipeline stopped.
#[derive(Debug, Error)]
pub enum PassError {
    /// A pass produced an ill-formed graph: a bug of that pass.
    #[error("pass {pass} broke the graph: {error}")]
    Verify {
        /// The pass.
        pass: &'static str,
        /// What the verifier found.
        error: VerifyError,
    },
    /// A dump could not be written.
    #[error("cannot write the dump {path}: {error}")]
    Dump {
        /// Where.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
}

/// One graph-to-graph transformation.
pub trait Pass {
    /// The pass's name, used in dumps and errors.
    fn name(&self) -> &'static str;
    /// Rewrites `graph`.
    fn run(&self, graph: &Graph) -> Result<Graph, VerifyError>;
}

/// An explicit list of passes, run in order, each followed by the verifier.
pub struct Pipeline {
    passes: Vec<Box<dyn Pass + Send + Sync>>,
    dump: Option<PathBuf>,
}

impl Default for Pipeline {
    /// The standard pipeline: DCE, CSE, DCE.
    fn default() -> Self {
        Self::new(vec![
            Box::new(crate::Dce),
            Box::new(crate::Cse),
            Box::new(crate::Dce),
        ])
    }
}

impl Pipeline {
    /// A pipeline of these passes.
    pub fn new(passes: Vec<Box<dyn Pass + Send + Sync>>) -> Self {
        Self { passes, dump: None }
    }

    /// Writes the IR after every stage to `<dir>/<graph>.<NN>-<pass>.nir`.
    pub fn dump_to(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dump = Some(dir.into());
        self
    }

    /// The names of the passes, in order.
    pub fn pass_names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|pass| pass.name()).collect()
    }

    /// Runs every pass on `graph`, verifying after each.
    pub fn run(&self, graph: &Graph) -> Result<Graph, PassError> {
        let mut current = graph.clone();
        for (index, pass) in self.passes.iter().enumerate() {
            current = pass.run(&current).map_err(|error| PassError::Verify {
                pass: pass.name(),
                error,
            })?;
            current.verify().map_err(|error| PassError::Verify {
                pass: pass.name(),
                error,
            })?;
            if let Some(dir) = &self.dump {
                let path = dir.join(format!(
                    "{}.{:02}-{}.nir",
                    current.name,
                    index + 1,
                    pass.name()
                ));
                std::fs::create_dir_all(dir)
                    .and_then(|()| std::fs::write(&path, nestor_ir::print(&current)))
                    .map_err(|error| PassError::Dump { path, error })?;
            }
        }
        Ok(current)
    }
}
