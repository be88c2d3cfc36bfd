//! The optimizer's e-graph: IR ops as egg e-nodes, every e-class typed, and the way in
//! (a [`Graph`]) and out (the cheapest node of every class, back into a [`Graph`]).

use std::cell::RefCell;
use std::collections::HashMap;

use egg::{Analysis, DidMerge, Id, Language};
use nestor_ir::{Graph, Op, Type, ValueId, VerifyError};

/// An IR op as an e-node: the op with its operands erased, its children the e-classes
/// of the operands (then, for ops whose type is declared, of the lengths that type
/// names).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ENode {
    /// The op; its operands are all `%0` (the children say what it reads).
    pub op: Op,
    /// The type of inputs, parameters and per-element regions (inferred for the rest).
    pub declared: Option<Type>,
    /// The operands' classes, then the declared type's lengths classes.
    pub children: Vec<Id>,
}

impl ENode {
    /// The node of `op` reading `children` (the classes of its operands, in order).
    pub fn new(op: &Op, children: Vec<Id>) -> Self {
        Self {
            op: erase(op),
            declared: None,
            children,
        }
    }

    /// The number of children that are operands (the rest are declared lengths).
    pub fn operand_count(&self) -> usize {
        self.op.operands().len()
    }

    /// The operands' classes.
    pub fn operands(&self) -> &[Id] {
        &self.children[..self.operand_count()]
    }
}

/// `op` with every operand `%0`.
fn erase(op: &Op) -> Op {
    op.map_operands(|_| ValueId(0))
}

impl Language for ENode {
    type Discriminant = std::mem::Discriminant<Op>;

    fn discriminant(&self) -> Self::Discriminant {
        std::mem::discriminant(&self.op)
    }

    fn matches(&self, other: &Self) -> bool {
        self.op == other.op
            && self.declared == other.declared
            && self.children.len() == other.children.len()
    }

    fn children(&self) -> &[Id] {
        &self.children
    }

    fn children_mut(&mut self) -> &mut [Id] {
        &mut self.children
    }
}

/// The type of every class. All nodes of a class have the same type: a rewrite whose
/// result has another type is refused before it is added.
#[derive(Default)]
pub struct Types;

impl Analysis<ENode> for Types {
    type Data = Option<Type>;

    fn make(_egraph: &mut egg::EGraph<ENode, Self>, _enode: &ENode) -> Self::Data {
        // Set by whoever adds the node (`Builder::add`), which knows the operand types.
        None
    }

    fn merge(&mut self, a: &mut Self::Data, b: Self::Data) -> DidMerge {
        match (a.is_some(), b) {
            (false, Some(ty)) => {
                *a = Some(ty);
                DidMerge(true, false)
            }
            (true, None) => DidMerge(false, true),
            _ => DidMerge(false, false),
        }
    }
}

/// The e-graph of the optimizer.
pub type EGraph = egg::EGraph<ENode, Types>;

/// A term to add to the e-graph: an existing class, or an op over terms.
#[derive(Clone, Debug)]
pub enum Term {
    /// An existing class.
    Class(Id),
    /// A new node (its operands erased; the terms say what it reads).
    Op(Op, Vec<Term>),
}

impl Term {
    /// `op` over `operands`.
    pub fn op(op: Op, operands: Vec<Term>) -> Self {
        Term::Op(op, operands)
    }
}

/// Builds an e-graph from a graph and adds terms to it, inferring their types with the
/// IR's own rules (on a scratch copy of the graph, so that types name the same lengths
/// values).
pub struct Builder {
    /// The e-graph.
    pub egraph: EGraph,
    /// The class of every value of the source graph.
    pub classes: Vec<Id>,
    /// The source graph; nodes appended for inference are removed again.
    scratch: RefCell<Graph>,
}

impl Builder {
    /// The e-graph of `graph`: one class per value (identical values share one).
    pub fn new(graph: &Graph) -> Self {
        let mut egraph = EGraph::new(Types);
        let mut classes: Vec<Id> = Vec::with_capacity(graph.nodes.len());
        for node in &graph.nodes {
            let mut children: Vec<Id> = node
                .op
                .operands()
                .iter()
                .map(|operand| classes[operand.index()])
                .collect();
            let declared = Op::declares_type(&node.op).then(|| {
                children.extend(
                    node.ty
                        .length_values()
                        .iter()
                        .map(|value| classes[value.index()]),
                );
                node.ty.clone()
            });
            let id = egraph.add(ENode {
                op: erase(&node.op),
                declared,
                children,
            });
            egraph[id].data = Some(node.ty.clone());
            classes.push(id);
        }
        egraph.rebuild();
        Self {
            egraph,
            classes,
            scratch: RefCell::new(graph.clone()),
        }
    }

    /// The type of a class.
    pub fn ty(&self, class: Id) -> Option<&Type> {
        self.egraph[class].data.as_ref()
    }

    /// The type `op` gives reading values of the classes `operands`, or `None` when it
    /// is ill-typed.
    pub fn infer(&self, op: &Op, operands: &[Id]) -> Option<Type> {
        let mut scratch = self.scratch.borrow_mut();
        let base = scratch.nodes.len();
        let mut values = Vec::with_capacity(operands.len());
        for &operand in operands {
            let ty = self.ty(operand)?.clone();
            values.push(ValueId(scratch.nodes.len() as u32));
            scratch.nodes.push(nestor_ir::Node {
                op: Op::Input {
                    name: String::new(),
                },
                ty,
            });
        }
        let ty = op
            .with_operands(&values)
            .and_then(|op| scratch.push(op).ok())
            .map(|value| scratch.ty(value).clone());
        scratch.nodes.truncate(base);
        ty
    }

    /// Adds `term`, returning its class, or `None` when some node of it is ill-typed.
    pub fn add(&mut self, term: &Term) -> Option<Id> {
        match term {
            Term::Class(id) => Some(self.egraph.find(*id)),
            Term::Op(op, operands) => {
                let children = operands
                    .iter()
                    .map(|operand| self.add(operand))
                    .collect::<Option<Vec<Id>>>()?;
                let ty = self.infer(op, &children)?;
                let id = self.egraph.add(ENode::new(op, children));
                match &self.egraph[id].data {
                    Some(existing) if *existing != ty => None,
                    Some(_) => Some(id),
                    None => {
                        self.egraph[id].data = Some(ty);
                        Some(id)
                    }
                }
            }
        }
    }
}

/// The graph of the chosen node of every class reachable from `outputs`: the inputs and
/// parameters of `source` first, in their order (callers bind inputs by position), then
/// every other value after the values it reads.
pub fn rebuild(
    source: &Graph,
    classes: &[Id],
    egraph: &EGraph,
    choose: impl Fn(Id) -> ENode,
) -> Result<Graph, VerifyError> {
    let mut graph = Graph::new(source.name.clone());
    let mut values: HashMap<Id, ValueId> = HashMap::new();
    let mut emit = |class: Id, graph: &mut Graph| -> Result<ValueId, VerifyError> {
        emit_class(egraph.find(class), egraph, &choose, &mut values, graph)
    };
    for input in source.inputs() {
        emit(classes[input.index()], &mut graph)?;
    }
    let mut outputs = Vec::with_capacity(source.outputs.len());
    for output in &source.outputs {
        outputs.push(emit(classes[output.index()], &mut graph)?);
    }
    graph.outputs = outputs;
    Ok(graph)
}

/// Emits the chosen node of `class` after its children (iteratively: graphs are deep).
fn emit_class(
    class: Id,
    egraph: &EGraph,
    choose: &impl Fn(Id) -> ENode,
    values: &mut HashMap<Id, ValueId>,
    graph: &mut Graph,
) -> Result<ValueId, VerifyError> {
    let mut stack = vec![(class, false)];
    let mut open = std::collections::HashSet::new();
    while let Some((class, children_done)) = stack.pop() {
        if values.contains_key(&class) {
            continue;
        }
        let node = choose(class);
        if !children_done {
            if !open.insert(class) {
                return Err(VerifyError {
                    value: ValueId(graph.nodes.len() as u32),
                    op: node.op.name(),
                    rule: "the chosen nodes form a cycle".into(),
                });
            }
            stack.push((class, true));
            for &child in node.children.iter().rev() {
                let child = egraph.find(child);
                if !values.contains_key(&child) {
                    stack.push((child, false));
                }
            }
            continue;
        }
        // Every child was pushed above this class on the stack, so it is emitted.
        let children: Vec<ValueId> = node
            .children
            .iter()
            .map(|child| values[&egraph.find(*child)])
            .collect();
        let operands = &children[..node.operand_count()];
        let op = node.op.with_operands(operands).ok_or_else(|| VerifyError {
            value: ValueId(graph.nodes.len() as u32),
            op: node.op.name(),
            rule: "an e-node with the wrong number of operands".into(),
        })?;
        let value = match &node.declared {
            Some(ty) => {
                let lengths = &children[operands.len()..];
                let named = ty.length_values();
                let ty = ty.map_values(|old| {
                    named
                        .iter()
                        .position(|&value| value == old)
                        .map_or(old, |position| lengths[position])
                });
                graph.add_declared(op, ty)?
            }
            None => graph.push(op)?,
        };
        values.insert(class, value);
    }
    Ok(values[&class])
}
