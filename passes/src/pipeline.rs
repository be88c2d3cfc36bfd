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
    /// A pipeline named a pass that does not exist.
    #[error("unknown pass `{name}` (passes: {})", Pipeline::PASSES.join(", "))]
    Unknown {
        /// The name given.
        name: String,
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

    /// The passes [`Pipeline::named`] knows, in the order of the standard pipeline.
    pub const PASSES: [&'static str; 4] = ["decompose", "dce", "cse", "optimize"];

    /// A pipeline of the passes named (see [`Pipeline::PASSES`]), the optimizer stopped
    /// at `limits`.
    ///
    /// ```
    /// use nestor_passes::{Limits, Pipeline};
    ///
    /// let pipeline = Pipeline::named(["dce", "cse", "optimize"], Limits::untimed())?;
    /// assert_eq!(pipeline.pass_names(), ["dce", "cse", "optimize"]);
    /// assert!(Pipeline::named(["fuse"], Limits::untimed()).is_err());
    /// # Ok::<(), nestor_passes::PassError>(())
    /// ```
    pub fn named<'a>(
        names: impl IntoIterator<Item = &'a str>,
        limits: crate::Limits,
    ) -> Result<Self, PassError> {
        let passes = names
            .into_iter()
            .map(|name| -> Result<Box<dyn Pass + Send + Sync>, PassError> {
                Ok(match name {
                    "decompose" => Box::new(crate::Decompose),
                    "dce" => Box::new(crate::Dce),
                    "cse" => Box::new(crate::Cse),
                    "optimize" => Box::new(crate::Optimize::default().with_limits(limits)),
                    _ => {
                        return Err(PassError::Unknown {
                            name: name.to_owned(),
                        })
                    }
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Self::new(passes))
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
        let mut notes = Vec::new();
        let graph = self.run_observed(graph, |_, _, note| {
            if !note.is_empty() {
                notes.push(note.to_owned());
            }
            Ok(())
        })?;
        Ok((graph, notes))
    }

    /// Runs every pass on `graph`, verifying after each, and shows `observe` each
    /// pass's name, the verified graph after it and its note (empty: nothing to say);
    /// an error of `observe` stops the pipeline. Dumps (see [`Pipeline::dump_to`]) are
    /// written before `observe` sees the stage.
    pub fn run_observed(
        &self,
        graph: &Graph,
        mut observe: impl FnMut(&'static str, &Graph, &str) -> Result<(), PassError>,
    ) -> Result<Graph, PassError> {
        let mut current = graph.clone();
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
                std::fs::create_dir_all(dir)
                    .and_then(|()| std::fs::write(&path, annotated(&noted.note, &current)))
                    .map_err(|error| PassError::Dump { path, error })?;
            }
            observe(pass.name(), &current, &noted.note)?;
        }
        Ok(current)
    }
}

/// The text of `graph` after `note` as `//` comments (the form of dumps, which parses
/// back: the parser skips comments).
pub fn annotated(note: &str, graph: &Graph) -> String {
    let mut text: String = note.lines().map(|line| format!("// {line}\n")).collect();
    text.push_str(&nestor_ir::print(graph));
    text
}
