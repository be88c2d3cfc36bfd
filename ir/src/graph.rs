//! The graph: an arena of SSA values, each the result of one op, plus the outputs.

use std::fmt;

use thiserror::Error;

use crate::infer::infer_type;
use crate::{Op, Type};

/// The index of a value (the result of one op) in its graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl ValueId {
    /// The arena index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ValueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One op and the type of its result.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Node {
    /// The operation.
    pub op: Op,
    /// The type of its result.
    pub ty: Type,
}

/// A rule of the IR that a graph breaks: a bug of whatever built the graph, never a
/// user error. Names the value and the rule.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{value} = {op}: {rule}")]
pub struct VerifyError {
    /// The offending value.
    pub value: ValueId,
    /// The name of its op.
    pub op: &'static str,
    /// What is wrong.
    pub rule: String,
}

/// A graph of SSA values. Inputs and parameters are ops too (`input`, `param`); a
/// value may only read values defined before it.
///
/// ```
/// use nestor_ir::{DType, Dim, ElemDim, Graph, Op, Type, UnaryOp};
///
/// let mut graph = Graph::new("tanh");
/// let batch = Dim::Sym("B".into());
/// let lengths = graph.add_declared(
///     Op::Input { name: "x.lengths".into() },
///     Type::Lengths { batch: batch.clone() },
/// )?;
/// let x = graph.add_declared(
///     Op::Input { name: "x".into() },
///     Type::Ragged {
///         dtype: DType::F32,
///         batch,
///         dims: vec![ElemDim::Ragged(lengths), ElemDim::Fixed(Dim::Static(4))],
///     },
/// )?;
/// // Types of pushed ops are inferred; an ill-typed op is an error.
/// let y = graph.push(Op::Unary { op: UnaryOp::Tanh, x })?;
/// assert!(graph.push(Op::Unary { op: UnaryOp::Tanh, x: lengths }).is_err());
/// graph.outputs = vec![y];
/// graph.verify()?;
/// assert!(nestor_ir::print(&graph).contains("%2 = tanh(%1) : ragged<f32>[B; %0, 4]"));
/// # Ok::<(), nestor_ir::VerifyError>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Graph {
    /// The graph's name.
    pub name: String,
    /// Every value, in definition order.
    pub nodes: Vec<Node>,
    /// The values the graph returns.
    pub outputs: Vec<ValueId>,
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            nodes: Vec::new(),
            outputs: Vec::new(),
        }
    }

    /// Appends an op whose type is declared rather than inferred (inputs, parameters,
    /// per-element regions, whose result lengths the caller names), after checking it.
    pub fn add_declared(&mut self, op: Op, ty: Type) -> Result<ValueId, VerifyError> {
        let value = ValueId(self.nodes.len() as u32);
        self.check_declared(value, &op, &ty)?;
        self.nodes.push(Node { op, ty });
        Ok(value)
    }

    fn check_declared(&self, value: ValueId, op: &Op, ty: &Type) -> Result<(), VerifyError> {
        let error = |rule: String| VerifyError {
            value,
            op: op.name(),
            rule,
        };
        match op {
            Op::Input { .. } | Op::Param { .. } => {}
            Op::PerElement { inputs, body } => {
                if let Some(missing) = inputs.iter().find(|input| input.index() >= value.index()) {
                    return Err(error(format!(
                        "reads {missing}, which is not defined before it"
                    )));
                }
                if !matches!(
                    inputs.first().map(|&input| self.ty(input)),
                    Some(Type::Ragged { .. })
                ) {
                    return Err(error("its first input must be ragged".into()));
                }
                if body.inputs().len() != inputs.len() || body.outputs.len() != 1 {
                    return Err(error(format!(
                        "its body takes {} inputs and returns {} values; expected {} and 1",
                        body.inputs().len(),
                        body.outputs.len(),
                        inputs.len()
                    )));
                }
                body.verify()?;
                let output = body.ty(body.outputs[0]);
                let (
                    Type::Dense { dtype, shape },
                    Type::Ragged {
                        dtype: declared,
                        dims,
                        ..
                    },
                ) = (output, ty)
                else {
                    return Err(error(format!("its body must return a dense element and it must be ragged, got {output} and {ty}")));
                };
                if dtype != declared || shape.len() != dims.len() {
                    return Err(error(format!(
                        "its body returns {output}, which elements of {ty} cannot hold"
                    )));
                }
            }
            other => {
                return Err(error(format!(
                    "{} has an inferred type; use Graph::push",
                    other.name()
                )))
            }
        }
        self.check_type_refs(value, op.name(), ty)
    }

    /// Appends an op, inferring its type; an ill-typed op is an error naming it.
    pub fn push(&mut self, op: Op) -> Result<ValueId, VerifyError> {
        let value = ValueId(self.nodes.len() as u32);
        let ty = self.infer(value, &op)?;
        self.nodes.push(Node { op, ty });
        Ok(value)
    }

    /// The lengths of a window (`kernel`, `stride`, `padding`, `dilation`) sliding over
    /// `lengths`, as one symbol for every window of one formula: the output size
    /// `floor((L + 2 padding - dilation (kernel - 1) - 1) / stride) + 1` depends on the
    /// window only through its stride and `2 padding - dilation (kernel - 1)`, so
    /// windows that agree on those (a 3x3 convolution of stride 2 and padding 1 and a
    /// 1x1 of stride 2: ResNet's two branches) give the same lengths value, and a window
    /// that keeps every size gives `lengths` itself. Otherwise a `window_lengths` op is
    /// appended.
    ///
    /// ```
    /// use nestor_ir::{DType, Graph, Op, Type};
    /// let mut graph = Graph::new("g");
    /// let lengths = graph.add_declared(
    ///     Op::Input { name: "h".into() },
    ///     Type::Lengths { batch: nestor_ir::Dim::Sym("B".into()) },
    /// )?;
    /// let strided = graph.window_lengths(lengths, [3, 2, 1, 1])?;
    /// assert_eq!(graph.window_lengths(lengths, [1, 2, 0, 1])?, strided);
    /// assert_eq!(graph.window_lengths(lengths, [3, 1, 1, 1])?, lengths);
    /// assert_ne!(graph.window_lengths(lengths, [3, 2, 0, 1])?, strided);
    /// # Ok::<(), nestor_ir::VerifyError>(())
    /// ```
    pub fn window_lengths(
        &mut self,
        lengths: ValueId,
        [kernel, stride, padding, dilation]: [i64; 4],
    ) -> Result<ValueId, VerifyError> {
        let form = |kernel: i64, stride: i64, padding: i64, dilation: i64| {
            let reach = i128::from(dilation) * (i128::from(kernel) - 1);
            (stride.max(1), 2 * i128::from(padding) - reach)
        };
        let wanted = form(kernel, stride, padding, dilation);
        if wanted == (1, 0) {
            return Ok(lengths);
        }
        let existing = self.nodes.iter().position(|node| match node.op {
            Op::WindowLengths {
                lengths: of,
                kernel,
                stride,
                padding,
                dilation,
            } => of == lengths && form(kernel, stride, padding, dilation) == wanted,
            _ => false,
        });
        match existing {
            Some(index) => Ok(ValueId(index as u32)),
            None => self.push(Op::WindowLengths {
                lengths,
                kernel,
                stride,
                padding,
                dilation,
            }),
        }
    }

    /// Lengths of `size` for every element of the batch of `lengths`: the value that
    /// already says so, or a new `constant_lengths`, so that equal lengths are one
    /// symbol.
    pub fn constant_lengths(
        &mut self,
        lengths: ValueId,
        size: i64,
    ) -> Result<ValueId, VerifyError> {
        let op = Op::ConstantLengths { lengths, size };
        match self.nodes.iter().position(|node| node.op == op) {
            Some(index) => Ok(ValueId(index as u32)),
            None => self.push(op),
        }
    }

    /// The lengths of a slice `bounds` of each element of the batch of `lengths`: the
    /// value of the same length formula ([`crate::SliceBounds::lengths_form`]) if the
    /// graph has one, `lengths` itself for a slice of everything, or a new
    /// `slice_lengths`, so that equal lengths are one symbol.
    ///
    /// ```
    /// use nestor_ir::{Graph, Op, SliceBounds, Type};
    /// let mut graph = Graph::new("g");
    /// let lengths = graph.add_declared(
    ///     Op::Input { name: "L".into() },
    ///     Type::Lengths { batch: nestor_ir::Dim::Sym("B".into()) },
    /// )?;
    /// let tail = graph.slice_lengths(lengths, SliceBounds { start: 1, end: i64::MAX })?;
    /// assert_eq!(graph.slice_lengths(lengths, SliceBounds { start: 0, end: -1 })?, tail);
    /// assert_eq!(graph.slice_lengths(lengths, SliceBounds::ALL)?, lengths);
    /// # Ok::<(), nestor_ir::VerifyError>(())
    /// ```
    pub fn slice_lengths(
        &mut self,
        lengths: ValueId,
        bounds: crate::SliceBounds,
    ) -> Result<ValueId, VerifyError> {
        let form = bounds.lengths_form();
        if form == crate::SliceBounds::ALL {
            return Ok(lengths);
        }
        let op = Op::SliceLengths {
            lengths,
            start: form.start,
            end: form.end,
        };
        match self.nodes.iter().position(|node| node.op == op) {
            Some(index) => Ok(ValueId(index as u32)),
            None => self.push(op),
        }
    }

    /// The type `op` would have if it were appended, or the rule it breaks.
    pub fn type_of(&self, op: &Op) -> Result<Type, VerifyError> {
        self.infer(ValueId(self.nodes.len() as u32), op)
    }

    fn infer(&self, value: ValueId, op: &Op) -> Result<Type, VerifyError> {
        if let Some(missing) = op
            .operands()
            .into_iter()
            .find(|operand| operand.index() >= value.index())
        {
            return Err(VerifyError {
                value,
                op: op.name(),
                rule: format!("reads {missing}, which is not defined before it"),
            });
        }
        infer_type(self, op).map_err(|rule| VerifyError {
            value,
            op: op.name(),
            rule,
        })
    }

    /// The type of a value.
    pub fn ty(&self, value: ValueId) -> &Type {
        &self.nodes[value.index()].ty
    }

    /// The op of a value.
    pub fn op(&self, value: ValueId) -> &Op {
        &self.nodes[value.index()].op
    }

    /// The input and parameter values, in order.
    pub fn inputs(&self) -> Vec<ValueId> {
        (0..self.nodes.len() as u32)
            .map(ValueId)
            .filter(|&value| matches!(self.op(value), Op::Input { .. } | Op::Param { .. }))
            .collect()
    }

    /// Which of the graph's inputs `value` is (its position in [`Graph::inputs`]): in a
    /// per-element body, the region operand it stands for.
    pub fn input_position(&self, value: ValueId) -> Option<usize> {
        self.inputs().iter().position(|&input| input == value)
    }

    /// Checks every rule: operands defined before use, types as inferred, ragged types
    /// referring to lengths values of their batch size, outputs defined.
    pub fn verify(&self) -> Result<(), VerifyError> {
        let mut prefix = Graph::new(self.name.clone());
        for (index, node) in self.nodes.iter().enumerate() {
            let value = ValueId(index as u32);
            match &node.op {
                op if op.declares_type() => prefix.check_declared(value, op, &node.ty)?,
                op => {
                    let inferred = prefix.infer(value, op)?;
                    if inferred != node.ty {
                        return Err(VerifyError {
                            value,
                            op: op.name(),
                            rule: format!("declared type {} but the op gives {inferred}", node.ty),
                        });
                    }
                }
            }
            prefix.nodes.push(node.clone());
        }
        if let Some(&output) = self
            .outputs
            .iter()
            .find(|output| output.index() >= self.nodes.len())
        {
            return Err(VerifyError {
                value: output,
                op: "return",
                rule: "returns an undefined value".into(),
            });
        }
        Ok(())
    }

    fn check_type_refs(
        &self,
        value: ValueId,
        op: &'static str,
        ty: &Type,
    ) -> Result<(), VerifyError> {
        let Type::Ragged { batch, .. } = ty else {
            return Ok(());
        };
        for lengths in ty.length_values() {
            match self.nodes.get(lengths.index()).map(|node| &node.ty) {
                Some(Type::Lengths { batch: lengths_batch }) if lengths_batch == batch => {}
                Some(Type::Lengths { batch: lengths_batch }) => {
                    return Err(VerifyError {
                        value,
                        op,
                        rule: format!("its batch {batch} differs from the batch {lengths_batch} of its lengths {lengths}"),
                    })
                }
                _ => {
                    return Err(VerifyError {
                        value,
                        op,
                        rule: format!("its type refers to {lengths}, which is not a lengths value defined before it"),
                    })
                }
            }
        }
        Ok(())
    }
}
