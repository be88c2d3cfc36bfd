//! Kernel argument tables from signatures: the one place an executor, on the host or a
//! device, turns a step's [`Signature`] into the table its kernel reads.

use nestor_passes::{Arg, Signature};

/// Fills `table` with the value of every argument of `signature`, in its order, as
/// `resolve` gives each (a pointer on the host, a device address).
pub(super) fn marshal<T, E>(
    signature: &Signature,
    table: &mut Vec<T>,
    mut resolve: impl FnMut(&Arg) -> Result<T, E>,
) -> Result<(), E> {
    table.clear();
    for param in &signature.params {
        table.push(resolve(&param.arg)?);
    }
    Ok(())
}
