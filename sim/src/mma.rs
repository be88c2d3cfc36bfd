//! Tensor-core products as PTX defines them: `mma.sync.aligned.m16n8k16.row.col` with
//! bf16 `A` (16 x 16) and `B` (16 x 8) and f32 `C` and `D` (16 x 8), each matrix
//! spread over the 32 lanes of a warp in the fragment layouts of the PTX ISA
//! ("Matrix Fragments for mma.m16n8k16 with floating point type"): lane `l` has
//! `group = l / 4` and `thread = l % 4` (its threadID_in_group).

use crate::shuffle::WARP_LANES;

/// Rows of `A`, `C` and `D`.
pub const M: usize = 16;
/// Columns of `B`, `C` and `D`.
pub const N: usize = 8;
/// Columns of `A`, rows of `B`.
pub const K: usize = 16;

/// The `(row, column)` of `A` that element `i` (0..8; two per register, `i / 2` the
/// register) of lane `lane`'s fragment holds.
pub fn a_element(lane: u32, i: u32) -> (usize, usize) {
    let (group, thread) = ((lane >> 2) as usize, (lane % 4) as usize);
    let i = i as usize;
    let row = if i < 2 || (4..6).contains(&i) {
        group
    } else {
        group + 8
    };
    let column = thread * 2 + (i & 1) + if i < 4 { 0 } else { 8 };
    (row, column)
}

/// The `(row, column)` of `B` that element `i` (0..4) of lane `lane`'s fragment holds.
pub fn b_element(lane: u32, i: u32) -> (usize, usize) {
    let (group, thread) = ((lane >> 2) as usize, (lane % 4) as usize);
    let i = i as usize;
    let row = thread * 2 + (i & 1) + if i < 2 { 0 } else { 8 };
    (row, group)
}

/// The `(row, column)` of `C` and `D` that element `i` (0..4) of lane `lane`'s fragment
/// holds.
pub fn c_element(lane: u32, i: u32) -> (usize, usize) {
    let (group, thread) = ((lane >> 2) as usize, (lane % 4) as usize);
    let i = i as usize;
    let row = if i < 2 { group } else { group + 8 };
    (row, thread * 2 + (i & 1))
}

/// One lane's fragments of an `mma`.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fragments {
    /// Four registers of two bf16 of `A` each (element `2r` in the low half of `r`).
    pub a: [u32; 4],
    /// Two registers of two bf16 of `B` each.
    pub b: [u32; 2],
    /// Four f32 of `C`.
    pub c: [f32; 4],
}

/// The bf16 element `i` of `registers` (two per register, the lower index low).
fn half(registers: &[u32], i: u32) -> f32 {
    let register = registers[(i / 2) as usize];
    let bits = if i.is_multiple_of(2) {
        register & 0xFFFF
    } else {
        register >> 16
    };
    f32::from_bits(bits << 16)
}

/// `D = A B + C` of a warp's fragments (lane by lane), each lane's four values of `D`.
/// Products of bf16 values are exact in f32; each of `D`'s values adds them to its `C`
/// in f32 in the order of `k` (the hardware's order and intermediate rounding are not
/// specified: results within rounding of this are what a GPU gives).
pub fn mma_m16n8k16(
    fragments: &[Fragments; WARP_LANES as usize],
) -> [[f32; 4]; WARP_LANES as usize] {
    let mut a = [[0f32; K]; M];
    let mut b = [[0f32; N]; K];
    let mut c = [[0f32; N]; M];
    for (lane, fragment) in (0..WARP_LANES).zip(fragments) {
        for i in 0..8 {
            let (row, column) = a_element(lane, i);
            a[row][column] = half(&fragment.a, i);
        }
        for i in 0..4 {
            let (row, column) = b_element(lane, i);
            b[row][column] = half(&fragment.b, i);
            let (row, column) = c_element(lane, i);
            c[row][column] = fragment.c[i as usize];
        }
    }
    let mut d = [[0f32; 4]; WARP_LANES as usize];
    for (lane, values) in (0..WARP_LANES).zip(d.iter_mut()) {
        for (i, value) in (0..4).zip(values.iter_mut()) {
            let (row, column) = c_element(lane, i);
            *value = (0..K).fold(c[row][column], |sum, k| sum + a[row][k] * b[k][column]);
        }
    }
    d
}
