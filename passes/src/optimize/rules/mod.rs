//! The rewrite rules, in named sets. A rule looks at one e-node of a class and proposes
//! terms equal to that class; the runner adds a term only when its type (inferred by
//! the IR's own rules) is the class's type. Every rule says why it holds.

use std::collections::HashMap;

use egg::Id;
use nestor_ir::{Op, Type};

use super::egraph::{Builder, ENode, Term};

mod algebra;
mod attention;
mod fusion;
mod packed;
mod structure;

pub use fusion::{is_pointwise, substitute};

/// The rule sets, in the order they are listed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuleSet {
    /// Padding round trips, all-true masks, view chains.
    Structure,
    /// Identities exact in floating point.
    Algebra,
    /// Per-element fallbacks replaced by packed ops.
    Packed,
    /// Pointwise chains and trees into one `fused` kernel.
    Fusion,
}

/// What a rule sees: the e-graph and which classes have exactly one reader.
pub struct Context<'a> {
    /// The e-graph and its types.
    pub builder: &'a Builder,
    /// Readers of every class in the graph the e-graph was built from (outputs count as
    /// readers), by canonical id.
    pub readers: &'a HashMap<Id, usize>,
}

impl Context<'_> {
    pub(super) fn find(&self, class: Id) -> Id {
        self.builder.egraph.find(class)
    }

    pub(super) fn ty(&self, class: Id) -> Option<&Type> {
        self.builder.ty(class)
    }

    pub(super) fn nodes(&self, class: Id) -> &[ENode] {
        &self.builder.egraph[class].nodes
    }

    pub(super) fn same(&self, a: Id, b: Id) -> bool {
        self.find(a) == self.find(b)
    }

    /// The value of a constant class.
    pub(super) fn constant(&self, class: Id) -> Option<f64> {
        self.nodes(class).iter().find_map(|node| match node.op {
            Op::Const { value, .. } => Some(value.0),
            _ => None,
        })
    }

    /// Whether the class is `x` itself in type (a rewrite to it keeps the type).
    pub(super) fn keeps_type(&self, class: Id, x: Id) -> bool {
        self.ty(class).is_some() && self.ty(class) == self.ty(x)
    }

    /// Whether the class is true on every packed position: the padding mask of a batch
    /// unpadded by its own lengths (or a cast of it).
    pub(super) fn all_true(&self, class: Id) -> bool {
        self.nodes(class).iter().any(|node| match node.op {
            Op::Unpad { .. } => self.nodes(node.children[0]).iter().any(|mask| {
                matches!(mask.op, Op::Mask { .. }) && self.same(mask.children[0], node.children[1])
            }),
            Op::Cast { .. } => self.all_true(node.children[0]),
            _ => false,
        })
    }

    pub(super) fn single_reader(&self, class: Id) -> bool {
        self.readers.get(&self.find(class)) == Some(&1)
    }
}

/// One rewrite rule.
pub struct Rule {
    /// Its name (used to select rules and in reports).
    pub name: &'static str,
    /// Its set.
    pub set: RuleSet,
    /// Why the rewrite holds, in one line.
    pub why: &'static str,
    /// Terms equal to the class of `node`.
    pub apply: fn(&Context, Id, &ENode) -> Vec<Term>,
}

/// Every rule, by set.
pub static RULES: &[Rule] = &[
    Rule {
        name: "unpad-pad",
        set: RuleSet::Structure,
        why: "unpadding a padded batch by its own lengths gives back its packed rows",
        apply: structure::unpad_pad,
    },
    Rule {
        name: "packed-through-pad",
        set: RuleSet::Structure,
        why: "a pointwise op on a padded grid, then unpadded, only ever used the valid rows",
        apply: structure::packed_through_pad,
    },
    Rule {
        name: "all-true-mask",
        set: RuleSet::Structure,
        why: "the padding mask unpadded by its own lengths is true on every packed row",
        apply: structure::all_true_mask,
    },
    Rule {
        name: "reshape-chain",
        set: RuleSet::Structure,
        why: "reshapes of the static tail compose (row-major order is kept by both)",
        apply: structure::reshape_chain,
    },
    Rule {
        name: "view-identity",
        set: RuleSet::Structure,
        why: "a reshape to the same tail, inference dropout and a swap undone are the input",
        apply: structure::view_identity,
    },
    Rule {
        name: "mul-one",
        set: RuleSet::Algebra,
        why: "x * 1 and x / 1 are x exactly in IEEE arithmetic",
        apply: algebra::mul_one,
    },
    Rule {
        name: "add-negative-zero",
        set: RuleSet::Algebra,
        why:
            "x + (-0) and x - (+0) are x exactly, signed zeros included (x + 0 is not: -0 + 0 = +0)",
        apply: algebra::add_negative_zero,
    },
    Rule {
        name: "double-negation",
        set: RuleSet::Algebra,
        why: "negation flips the sign bit, twice restores it",
        apply: algebra::double_negation,
    },
    Rule {
        name: "cast-round-trip",
        set: RuleSet::Algebra,
        why: "a cast to a type holding every value of the source, then back, is exact",
        apply: algebra::cast_round_trip,
    },
    Rule {
        name: "packed-per-element",
        set: RuleSet::Packed,
        why: "row-wise ops (linear, pointwise, norms, softmax, reductions, embedding) give \
              each element the same rows packed as alone",
        apply: packed::packed_per_element,
    },
    Rule {
        name: "pair-attention",
        set: RuleSet::Packed,
        why: "softmax(scale * q @ k^T [causally masked with -inf]) @ v over jagged pairs is \
              what the (causal) varlen attention op computes, one head at a time, without \
              storing the L x L scores",
        apply: attention::pair_attention,
    },
    Rule {
        name: "fuse-pointwise",
        set: RuleSet::Fusion,
        why: "a pointwise value read by one pointwise op can be computed inside its reader's \
              kernel",
        apply: fusion::fuse_pointwise,
    },
    Rule {
        name: "fuse-prologue",
        set: RuleSet::Fusion,
        why: "a row or segmented op can compute its pointwise input itself, row by row, when \
              nothing else reads that input",
        apply: fusion::fuse_prologue,
    },
    Rule {
        name: "fuse-epilogue",
        set: RuleSet::Fusion,
        why: "a pointwise op reading a GEMM's result element for element can run on the GEMM's \
              rows as they are written, when nothing else reads the result",
        apply: fusion::fuse_epilogue,
    },
];
