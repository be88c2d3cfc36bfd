//! The e-graph optimizer (DESIGN.md section 5): the graph goes into an egg e-graph, the
//! rule sets of [`rules`](mod@rules) add equal forms until saturation or a limit, and extraction
//! keeps the cheapest form of every value by the [`cost`] model (kernel launches, bytes
//! moved, FLOPs; per-element fallbacks and padding priced high).
//!
//! It runs in two phases, each its own e-graph: first structure, algebra and packed
//! paths, then fusion, whose rule needs to know which values have a single reader in
//! the graph the first phase chose.

pub mod cost;
pub mod egraph;
pub mod rules;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use egg::{Extractor, Id};
use nestor_ir::{Graph, VerifyError};

use crate::pipeline::Noted;
use crate::Pass;
use egraph::{Builder, EGraph};
use rules::{Context, Rule, RuleSet, RULES};

pub use egg::StopReason;

/// When a phase stops rewriting (whichever comes first; saturation ends it earlier).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    /// Rounds of matching and adding.
    pub iterations: usize,
    /// E-nodes in the e-graph.
    pub nodes: usize,
    /// Time per phase.
    pub time: Duration,
}

impl Default for Limits {
    /// 30 rounds, 100 000 e-nodes, half a second per phase.
    fn default() -> Self {
        Self {
            iterations: 30,
            nodes: 100_000,
            time: Duration::from_millis(500),
        }
    }
}

impl Limits {
    /// The default rounds and e-nodes without a time limit: the result depends on the
    /// graph alone, never on the machine's load (tests, reproducible builds).
    pub fn untimed() -> Self {
        Self {
            time: Duration::MAX,
            ..Self::default()
        }
    }
}

/// What one phase did.
#[derive(Clone, Debug)]
pub struct PhaseReport {
    /// The phase's name.
    pub name: &'static str,
    /// Rounds run.
    pub iterations: usize,
    /// Why it stopped.
    pub stop: StopReason,
    /// E-nodes at the end.
    pub nodes: usize,
    /// E-classes at the end.
    pub classes: usize,
    /// Rewrites added, by rule (only rules that fired).
    pub fired: Vec<(&'static str, usize)>,
    /// Time taken, extraction included.
    pub time: Duration,
}

/// What the optimizer did to one graph.
#[derive(Clone, Debug)]
pub struct Report {
    /// The graph's name.
    pub graph: String,
    /// Kernel launches of the graph before and after (`None` when it does not lower).
    pub kernels: (Option<usize>, Option<usize>),
    /// The phases.
    pub phases: Vec<PhaseReport>,
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kernels = |count: Option<usize>| count.map_or("-".into(), |count| count.to_string());
        writeln!(
            f,
            "optimize @{}: kernels {} -> {}",
            self.graph,
            kernels(self.kernels.0),
            kernels(self.kernels.1)
        )?;
        for phase in &self.phases {
            let mut fired = String::new();
            for (rule, count) in &phase.fired {
                let _ = write!(fired, " {rule}={count}");
            }
            writeln!(
                f,
                "  {}: {} iterations, stop {:?}, {} e-nodes, {} e-classes, {:.1} ms; fired:{}",
                phase.name,
                phase.iterations,
                phase.stop,
                phase.nodes,
                phase.classes,
                phase.time.as_secs_f64() * 1e3,
                if fired.is_empty() { " none" } else { &fired }
            )?;
        }
        Ok(())
    }
}

/// The e-graph optimization pass.
///
/// ```
/// let graph = nestor_ir::parse("graph @ffn {
///   %0 = input {name = \"x.lengths\"} : lengths[B]
///   %1 = input {name = \"x\"} : ragged<f32>[B; %0, 4]
///   %2 = param {name = \"w\"} : f32[8, 4]
///   %3 = linear(%1, %2) : ragged<f32>[B; %0, 8]
///   %4 = relu(%3) : ragged<f32>[B; %0, 8]
///   return %4
/// }")?;
/// use nestor_passes::{Limits, Optimize};
/// let (optimized, report) = Optimize::default().with_limits(Limits::untimed()).optimize(&graph)?;
/// // relu runs in the GEMM's epilogue: one kernel instead of two.
/// assert_eq!(report.kernels, (Some(2), Some(1)));
/// assert!(nestor_ir::print(&optimized).contains("epilogue("));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Optimize {
    limits: Limits,
    rules: Vec<&'static str>,
}

impl Default for Optimize {
    /// Every rule, default limits.
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            rules: RULES.iter().map(|rule| rule.name).collect(),
        }
    }
}

/// A rule name [`Optimize::only`] does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no rewrite rule is named {0:?}; the rules are {known}", known = rule_names().join(", "))]
pub struct UnknownRule(pub String);

/// The names of every rule.
pub fn rule_names() -> Vec<&'static str> {
    RULES.iter().map(|rule| rule.name).collect()
}

/// Every rule: name, set and why it holds.
pub fn rules() -> &'static [Rule] {
    RULES
}

impl Optimize {
    /// The pass with only the named rules.
    pub fn only(names: &[&str]) -> Result<Self, UnknownRule> {
        let rules = names
            .iter()
            .map(|name| {
                RULES
                    .iter()
                    .find(|rule| rule.name == *name)
                    .map(|rule| rule.name)
                    .ok_or_else(|| UnknownRule((*name).to_owned()))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            limits: Limits::default(),
            rules,
        })
    }

    /// The pass with other limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Optimizes `graph`, saying what happened.
    pub fn optimize(&self, graph: &Graph) -> Result<(Graph, Report), VerifyError> {
        let kernels = |graph: &Graph| crate::lower(graph).ok().map(|program| program.launches());
        let before = kernels(graph);
        let phases: [(&'static str, &[RuleSet]); 2] = [
            (
                "simplify",
                &[RuleSet::Structure, RuleSet::Algebra, RuleSet::Packed],
            ),
            ("fuse", &[RuleSet::Fusion]),
        ];
        let mut current = graph.clone();
        let mut reports = Vec::new();
        for (name, sets) in phases {
            let rules: Vec<&Rule> = RULES
                .iter()
                .filter(|rule| sets.contains(&rule.set) && self.rules.contains(&rule.name))
                .collect();
            if rules.is_empty() {
                continue;
            }
            let (next, report) = self.phase(name, &current, &rules)?;
            current = next;
            reports.push(report);
        }
        let report = Report {
            graph: graph.name.clone(),
            kernels: (before, kernels(&current)),
            phases: reports,
        };
        Ok((current, report))
    }

    /// One e-graph: rewrite with `rules`, then extract.
    fn phase(
        &self,
        name: &'static str,
        graph: &Graph,
        rules: &[&Rule],
    ) -> Result<(Graph, PhaseReport), VerifyError> {
        let started = Instant::now();
        let mut builder = Builder::new(graph);
        let counts = reader_counts(graph);
        let mut fired: Vec<(&'static str, usize)> = Vec::new();
        let mut iterations = 0;
        let stop = loop {
            if iterations >= self.limits.iterations {
                break StopReason::IterationLimit(iterations);
            }
            iterations += 1;
            let readers = readers(&counts, &builder);
            let matches: Vec<(Id, usize, egraph::Term)> = {
                let context = Context {
                    builder: &builder,
                    readers: &readers,
                };
                let mut matches = Vec::new();
                for class in builder.egraph.classes() {
                    for node in &class.nodes {
                        for (index, rule) in rules.iter().enumerate() {
                            for term in (rule.apply)(&context, class.id, node) {
                                matches.push((class.id, index, term));
                            }
                        }
                    }
                }
                matches
            };
            let mut changed = false;
            for (class, rule, term) in matches {
                let Some(id) = builder.add(&term) else {
                    continue;
                };
                // Only a form of the same type joins the class.
                if builder.ty(id) != builder.ty(class) || builder.ty(id).is_none() {
                    continue;
                }
                if builder.egraph.union(class, id) {
                    changed = true;
                    let name = rules[rule].name;
                    match fired.iter_mut().find(|(fired, _)| *fired == name) {
                        Some((_, count)) => *count += 1,
                        None => fired.push((name, 1)),
                    }
                }
            }
            builder.egraph.rebuild();
            if !changed {
                break StopReason::Saturated;
            }
            if builder.egraph.total_number_of_nodes() > self.limits.nodes {
                break StopReason::NodeLimit(self.limits.nodes);
            }
            if started.elapsed() > self.limits.time {
                break StopReason::TimeLimit(self.limits.time.as_secs_f64());
            }
        };
        let egraph: &EGraph = &builder.egraph;
        let extractor = Extractor::new(egraph, cost::KernelCost::new(egraph));
        let result = egraph::rebuild(graph, &builder.classes, egraph, |class| {
            extractor.find_best_node(class).clone()
        })?;
        let report = PhaseReport {
            name,
            iterations,
            stop,
            nodes: egraph.total_number_of_nodes(),
            classes: egraph.number_of_classes(),
            fired,
            time: started.elapsed(),
        };
        Ok((result, report))
    }
}

/// Readers of every value of `graph` (ops, types naming lengths, and outputs).
fn reader_counts(graph: &Graph) -> Vec<usize> {
    let mut counts = vec![0; graph.nodes.len()];
    for node in &graph.nodes {
        for value in node
            .op
            .operands()
            .into_iter()
            .chain(node.ty.length_values())
        {
            counts[value.index()] += 1;
        }
    }
    for output in &graph.outputs {
        counts[output.index()] += 1;
    }
    counts
}

/// The reader counts of the source graph's values by their classes' current canonical
/// ids (unions move them between rounds).
fn readers(counts: &[usize], builder: &Builder) -> HashMap<Id, usize> {
    let mut readers: HashMap<Id, usize> = HashMap::new();
    for (&class, &count) in builder.classes.iter().zip(counts) {
        *readers.entry(builder.egraph.find(class)).or_default() += count;
    }
    readers
}

impl Pass for Optimize {
    fn name(&self) -> &'static str {
        "optimize"
    }

    fn run(&self, graph: &Graph) -> Result<Graph, VerifyError> {
        Ok(self.optimize(graph)?.0)
    }

    fn run_noted(&self, graph: &Graph) -> Result<Noted, VerifyError> {
        let (graph, report) = self.optimize(graph)?;
        Ok(Noted {
            graph,
            note: report.to_string(),
        })
    }
}
