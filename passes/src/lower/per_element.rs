//! Per-element regions: host steps that run a one-op graph through libtorch.

use super::*;

impl Lowering<'_> {
    /// Lowers a per element op.
    pub(super) fn lower_per_element(
        &mut self,
        value: ValueId,
        op: &Op,
        ty: &Type,
    ) -> Result<Lowered, LowerError> {
        match op {
            Op::PerElement { .. } if !self.options.host_per_element => Err(unsupported(
                value,
                op,
                "per-element regions run through libtorch only when asked (Compiled::per_element_fallback)",
            )),
            Op::PerElement { inputs, body } => self.host_region(value, ty, inputs, body),
            other => Err(unsupported(value, other, "not lowered yet")),
        }
    }

    /// A host step running a one-op graph (a per-element region) through libtorch: its
    /// inputs are the lengths its types need, then the region's inputs.
    pub(super) fn host_region(
        &mut self,
        value: ValueId,
        ty: &Type,
        inputs: &[ValueId],
        body: &Graph,
    ) -> Result<Lowered, LowerError> {
        let op = self.graph.op(value);
        let mut host = Graph::new("host");
        let mut renamed: HashMap<ValueId, ValueId> = HashMap::new();
        let mut slots = Vec::new();
        let error = |error: nestor_ir::VerifyError| unsupported(value, op, error.to_string());
        // Lengths first: every type refers to them.
        let mut lengths: Vec<ValueId> = Vec::new();
        for referenced in inputs
            .iter()
            .flat_map(|&input| self.graph.ty(input).length_values())
            .chain(ty.length_values())
        {
            if !lengths.contains(&referenced) {
                lengths.push(referenced);
            }
        }
        for lengths_value in lengths {
            let Lowered::Lengths(slot) = self.get(lengths_value) else {
                return Err(unsupported(
                    value,
                    op,
                    "its lengths are not a lengths buffer",
                ));
            };
            let local = host
                .add_declared(
                    Op::Input {
                        name: format!("lengths{}", slots.len()),
                    },
                    self.graph.ty(lengths_value).clone(),
                )
                .map_err(error)?;
            renamed.insert(lengths_value, local);
            slots.push(slot);
        }
        for &input in inputs {
            let ty = self
                .graph
                .ty(input)
                .map_values(|v| renamed.get(&v).copied().unwrap_or(v));
            let local = host
                .add_declared(
                    Op::Input {
                        name: format!("input{}", slots.len()),
                    },
                    ty,
                )
                .map_err(error)?;
            renamed.insert(input, local);
            let (slot, ..) = self.data(value, input)?;
            slots.push(slot);
        }
        let region_inputs = inputs.iter().map(|input| renamed[input]).collect();
        let region_ty = ty.map_values(|v| renamed.get(&v).copied().unwrap_or(v));
        let region = host
            .add_declared(
                Op::PerElement {
                    inputs: region_inputs,
                    body: Box::new(body.clone()),
                },
                region_ty,
            )
            .map_err(error)?;
        host.outputs = vec![region];
        let out = self.result(value, ty)?;
        self.program.host_graphs.push(host);
        self.program.steps.push(Step::Host {
            out: slot_of(&out),
            inputs: slots,
            graph: self.program.host_graphs.len() - 1,
        });
        Ok(out)
    }
}
