//! Operators on `NestedTensor`, each on the packed values wherever a packed form exists.
//!
//! - `operand`: how scalars, dense tensors and other NestedTensors line up with the
//!   packed values (the broadcasting rules of DESIGN.md section 7);
//! - `elementwise`: unary, binary and ternary elementwise operators, Rust operators,
//!   in-place variants;
//! - `reduce`: reductions over static dims (packed), ragged dims (segmented), the batch
//!   dim and all dims;
//! - `sort`: sort, argsort, topk, kthvalue, cummax / cummin (ragged dims by segment);
//! - `normalize`: softmax / log_softmax, layer_norm, rms_norm, batch_norm, dropout;
//! - `pairs`: pair layouts from broadcasting nested operands (`[L_i, 1, C]` with
//!   `[1, L_i, C]` gives `[L_i, L_i, C]`, packed);
//! - `linear`: linear, matmul, embedding;
//! - `einsum`: einsum over elements, on the packed values when the ragged dims line up;
//! - `linalg`: det, inverse, solve, cholesky, qr, svd, eigh of square elements,
//!   batched over elements of equal shape;
//! - `structure`: zero-copy reconstruction, repeats, reshapes of static dims,
//!   segmented scans, cdist;
//! - `window`: convolution (an implicit GEMM over gathered pixels) and pooling of
//!   packed images `[C, H_i, W_i]`;
//! - `per_element`: the same element by element where no packed form applies
//!   (grouped convolutions, other layouts), interpolation;
//! - `attention`: scaled dot-product attention over packed heads;
//! - `compare`: `equal` and `allclose` of whole batches;
//! - `loss`: losses on packed values.

mod attention;
mod compare;
mod einsum;
mod elementwise;
mod linalg;
mod linear;
mod loss;
mod normalize;
mod operand;
mod pairs;
mod per_element;
mod reduce;
mod sort;
mod structure;
mod window;

pub use compare::Comparand;
pub use einsum::einsum;
pub use elementwise::Binary;
pub use loss::{LossReduction, Target};
pub use operand::Operand;
pub use reduce::{Reduce, Reduced};
