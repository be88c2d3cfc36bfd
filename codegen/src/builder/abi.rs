//! The argument ABI: a kernel's arguments asked for by role from its step's signature,
//! each a pointer loaded from the `args` table (with its alias scope on the host, as
//! global memory on a GPU, every access checked on the simulated GPU).

use super::*;

impl<'ctx> Kernel<'ctx, '_> {
    /// Declares that the arguments of `roles` (besides [`Role::Out`]) are the output's
    /// buffer too, so that accesses through them share the output's alias scope. Call
    /// it before asking for them with [`Kernel::param`].
    pub(crate) fn output_also(&self, roles: impl IntoIterator<Item = Role>) {
        self.output_roles.borrow_mut().extend(roles);
    }

    /// The argument of `role`, which must be in the signature and not absent.
    pub(crate) fn param(&self, role: Role) -> Gen<PointerValue<'ctx>> {
        self.optional(role)?.ok_or_else(|| {
            err(format!(
                "the template reads {role:?}, which its step does not have"
            ))
        })
    }

    /// The arguments of `roles`, as [`Kernel::param`].
    pub(crate) fn params<const N: usize>(&self, roles: [Role; N]) -> Gen<[PointerValue<'ctx>; N]> {
        let pointers = roles
            .into_iter()
            .map(|role| self.param(role))
            .collect::<Gen<Vec<_>>>()?;
        pointers
            .try_into()
            .map_err(|_| err("a kernel's argument count"))
    }

    /// The argument of `role`, `None` where the signature has it absent (an optional
    /// buffer). An argument the signature lacks, or one of another kind than `role`
    /// takes, is an error: the template and the signature disagree.
    pub(crate) fn optional(&self, role: Role) -> Gen<Option<PointerValue<'ctx>>> {
        let Some(index) = self
            .signature
            .params
            .iter()
            .position(|param| param.role == role)
        else {
            return Err(err(format!(
                "the template reads {role:?}, which its signature lacks"
            )));
        };
        let arg = self.signature.params[index].arg;
        if !role.accepts(&arg) {
            return Err(err(format!(
                "the template reads {role:?}, but the signature passes {arg:?} there"
            )));
        }
        self.asked.borrow_mut().push(role);
        if arg == Arg::Absent {
            return Ok(None);
        }
        self.arg(index as u64, role).map(Some)
    }

    /// Buffer number `index` of the `args` array, of role `role`: for an argument that
    /// is the output's buffer ([`Role::Out`], or one of [`Kernel::output_also`]'s), the
    /// output's pointer value where it was loaded in the block being built, else loaded.
    /// (One value for an in-place read and write, such as a GEMM epilogue's, lets LLVM
    /// see that each element is read before it is written, and vectorize; two loaded
    /// pointers that may alias made it check their distance at run time, find it 0, and
    /// take the scalar loop.) Only the output: reading it in place is the one identity
    /// of slots a kernel compiles in (`Step::kernel_key`); two inputs of one slot in
    /// this step may be two slots in another step that shares the kernel.
    fn arg(&self, index: u64, role: Role) -> Gen<PointerValue<'ctx>> {
        let slot = self.signature.params[index as usize].arg;
        let output = role == Role::Out || self.output_roles.borrow().contains(&role);
        if !output {
            return self.load_arg(index, false);
        }
        // Only a pointer loaded in the block being built (templates ask for some
        // arguments inside loops and branches): one loaded in another block may not
        // dominate this use.
        let here = self.builder.get_insert_block();
        let loaded = self
            .output_loads
            .borrow()
            .iter()
            .find_map(|&(arg, pointer)| {
                let block = pointer.as_instruction().and_then(|load| load.get_parent());
                (arg == slot && block.is_some() && block == here).then_some(pointer)
            });
        if let Some(pointer) = loaded {
            return Ok(pointer);
        }
        let pointer = self.load_arg(index, true)?;
        self.output_loads.borrow_mut().push((slot, pointer));
        Ok(pointer)
    }

    /// Loads buffer number `index` of the `args` array (registered with its alias
    /// scope on the host, the output's when `output`; in global memory on a GPU).
    fn load_arg(&self, index: u64, output: bool) -> Gen<PointerValue<'ctx>> {
        let args = self
            .function
            .get_nth_param(0)
            .ok_or_else(|| err("missing args"))?
            .into_pointer_value();
        let ptr = self.context.ptr_type(AddressSpace::default());
        let slot = unsafe {
            self.builder
                .build_gep(ptr, args, &[self.i64(index as i64)], "arg.slot")
        }
        .map_err(err)?;
        let slot = self.checked(slot, 8, false)?;
        let pointer = self
            .builder
            .build_load(ptr, slot, "arg")
            .map_err(err)?
            .into_pointer_value();
        match self.target {
            Target::Host | Target::Simulated => {
                self.buffers.borrow_mut().push((pointer, output));
                Ok(pointer)
            }
            // Buffers are device (global) memory: `ld.global` / `st.global` rather than
            // generic accesses that test the address space at run time.
            Target::Nvptx => self
                .builder
                .build_address_space_cast(
                    pointer,
                    self.context
                        .ptr_type(AddressSpace::from(GLOBAL_ADDRESS_SPACE)),
                    "global",
                )
                .map_err(err),
        }
    }
}
