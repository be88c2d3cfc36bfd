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

/// A pass's result and what it has to say about it (written into dumps).
pub struct Noted {
    /// The rewritten graph.
    pub graph: Graph,
    /// Lines for the reader of the dump (empty: nothing to say).
    pub note: String,
}

/// One graph-to-graph transformation.
pub trait Pass {
    /// The pass's name, used in dumps and errors.
    fn name(&self) -> &'static str;
    /// Rewrites `graph`.
    fn run(&self, graph: &Graph) -> Result<Graph, VerifyError>;
    /// Rewrites `graph` and says what it did (by default, nothing).
    fn run_noted(&self, graph: &Graph) -> Result<Noted, VerifyError> {
        Ok(Noted {
            graph: self.run(graph)?,
            note: String::new(),
        })
    }
}

/// An explicit list of passes, run in order, each followed by the verifier.
pub struct Pipeline {
    passes: Vec<Box<dyn Pass + Send + Sync>>,
    dump: Option<PathBuf>,
}

impl Default for Pipeline {
    /// The standard pipeline: decomposition, DCE, CSE, the e-graph optimizer, DCE.
    fn default() -> Self {
        Self::optimizing(crate::Limits::default())
    }
}

impl Pipeline {
    /// The standard pipeline with the optimizer stopped at `limits`.
    pub fn optimizing(limits: crate::Limits) -> Self {
        Self::new(vec![
            Box::new(crate::Decompose),
            Box::new(crate::Dce),
            Box::new(crate::Cse),
            Box::new(crate::Optimize::default().with_limits(limits)),
            Box::new(crate::Dce),
        ])
    }

    /// The pipeline without the optimizer: decomposition, DCE, CSE, DCE (a baseline for
    /// measurements).
    pub fn unoptimized() -> Self {
        Self::new(vec![
            Box::new(crate::Decompose),
            Box::new(crate::Dce),
            Box::new(crate::Cse),
            Box::new(crate::Dce),
        ])
    }

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
        Ok(self.run_noted(graph)?.0)
    }

    /// Runs every pass on `graph`, verifying after each, and returns what the passes
    /// had to say (one entry per pass that said something).
    pub fn run_noted(&self, graph: &Graph) -> Result<(Graph, Vec<String>), PassError> {
        let mut current = graph.clone();
        let mut notes = Vec::new();
        for (index, pass) in self.passes.iter().enumerate() {
            let noted = pass
                .run_noted(&current)
                .map_err(|error| PassError::Verify {
                    pass: pass.name(),
                    error,
                })?;
            current = noted.graph;
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
                let comments: String = noted
                    .note
                    .lines()
                    .map(|line| format!("// {line}\n"))
                    .collect();
                std::fs::create_dir_all(dir)
                    .and_then(|()| std::fs::write(&path, comments + &nestor_ir::print(&current)))
                    .map_err(|error| PassError::Dump { path, error })?;
            }
            if !noted.note.is_empty() {
                notes.push(noted.note);
            }
        }
        Ok((current, notes))
    }
}
