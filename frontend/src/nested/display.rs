//! `Display` and `Debug` for `NestedTensor`: the elements, printed as tch prints
//! tensors, then the dtype and padded shape.

use std::fmt;

use super::NestedTensor;

impl fmt::Display for NestedTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "NestedTensor([")?;
        for element in 0..self.batch_size() {
            match self.element(element) {
                Ok(tensor) => {
                    let text = format!("{tensor}");
                    // tch ends a tensor's text with a `Tensor[[shape], Kind]` line; the
                    // batch prints its own summary below.
                    let body = text
                        .rsplit_once('\n')
                        .map_or(text.as_str(), |(body, _)| body);
                    for (line_number, line) in body.lines().enumerate() {
                        let separator = if line_number + 1 == body.lines().count() {
                            ","
                        } else {
                            ""
                        };
                        writeln!(f, "    {line}{separator}")?;
                    }
                }
                Err(error) => writeln!(f, "    <element {element}: {error}>,")?,
            }
        }
        write!(
            f,
            "], dtype={:?}, shape={:?})",
            self.kind(),
            self.padded_shape()
        )
    }
}

impl fmt::Debug for NestedTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NestedTensor")
            .field("values", &self.packed())
            .field("layout", self.lay())
            .field("options", &self.options())
            .finish()
    }
}
