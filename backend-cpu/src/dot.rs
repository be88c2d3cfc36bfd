//! bf16 products with AVX512-BF16's `vdpbf16ps` (Cooper Lake, AMD Zen 4 and Zen 5), on
//! hosts that have it but no AMX tiles: the operands packed as for the tiles
//! (`crate::amx`'s panel of `b` in pairs of rows, `a`'s blocks of 16 rows of
//! roundings), multiplied in registers. One instruction multiplies 16 pairs of a row of
//! the panel by a pair of `a`'s row broadcast from memory and adds both products to 16
//! f32 sums; [`ROWS`] rows by three column blocks of sums stay in registers over the
//! whole depth, so each load of the panel serves [`ROWS`] rows and each pair of `a`
//! three blocks.
//!
//! Like the tiles, `vdpbf16ps` treats bf16 denormals as zero and rounds each addition
//! to f32; a product of two bf16 values is exact in f32.

use std::ops::Range;

use crate::amx::Panel;

/// Rows of `a` per register block (a block of 16 rows is two).
const ROWS: usize = 8;
/// Rows of a block of `a` (as the tiles').
const BLOCK_ROWS: usize = 16;
/// f32 sums per register (and columns of a column block of the panel).
const LANES: usize = 16;

/// Whether the host has `vdpbf16ps` (AVX512-BF16, with AVX-512F).
pub(crate) fn host_has() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `sums [16 x 16 blocks.len()] = a [16 x depth] b` for one block of 16 rows of `a`
/// (bf16 rows at a stride in bytes, zeros past `b`'s `k`) and the panel's column
/// blocks `blocks` (as `crate::amx::multiply_rows`, which does it on the tiles): `sums`
/// rows `row_bytes` apart, from the first block's first column.
///
/// # Safety
/// [`host_has`] must be true; `a` must hold 16 rows of the panel's depth, `sums` 16
/// rows of the blocks' columns, the blocks within the panel.
pub(crate) unsafe fn multiply_columns(
    (a, a_stride): (*const u16, usize),
    panel: &Panel,
    blocks: Range<usize>,
    (sums, row_bytes): (*mut f32, usize),
) {
    #[cfg(target_arch = "x86_64")]
    for half in 0..BLOCK_ROWS / ROWS {
        let mut block = blocks.start;
        while block < blocks.end {
            // SAFETY: the caller vouches for the rows, the blocks and the sums; the host
            // has the instructions.
            unsafe {
                let a = (a.byte_add(half * ROWS * a_stride), a_stride);
                let sums = (
                    sums.byte_add(half * ROWS * row_bytes)
                        .add((block - blocks.start) * LANES),
                    row_bytes,
                );
                let b = panel.column_block(block);
                block += match blocks.end - block {
                    1 => x86::multiply::<1>(a, (b, panel.block()), panel.depth() / 2, sums),
                    2 => x86::multiply::<2>(a, (b, panel.block()), panel.depth() / 2, sums),
                    _ => x86::multiply::<3>(a, (b, panel.block()), panel.depth() / 2, sums),
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (a, a_stride, panel, blocks, sums, row_bytes);
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{LANES, ROWS};

    /// `sums [ROWS x 16 C] = a [ROWS x 2 pairs] b` for `C` column blocks of the panel
    /// (`b` the first block's first pair, blocks `b_block` pairs apart): the sums in
    /// `ROWS x C` registers over every pair of the depth. Returns `C`.
    ///
    /// # Safety
    /// The host must have AVX512-BF16; `a` must hold `ROWS` rows of `2 pairs` values,
    /// `b` `C` blocks of `pairs` rows of 16 pairs, `sums` `ROWS` rows of `16 C` values.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn multiply<const C: usize>(
        (a, a_stride): (*const u16, usize),
        (b, b_block): (*const u32, usize),
        pairs: usize,
        (sums, row_bytes): (*mut f32, usize),
    ) -> usize {
        let mut sum = [[_mm512_setzero_ps(); C]; ROWS];
        for pair in 0..pairs {
            // SAFETY: within the operands (the caller vouches); `__m512i` and `__m512bh`
            // are both 512 bits.
            unsafe {
                let mut row_of_b =
                    [std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()); C];
                for (block, row) in row_of_b.iter_mut().enumerate() {
                    let at = b.add(block * b_block + pair * LANES);
                    *row = std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                        at as *const __m512i,
                    ));
                }
                for (row, sums) in sum.iter_mut().enumerate() {
                    // A pair of `a`'s row (rows of `u16`: aligned to 2 bytes only).
                    let at = a.byte_add(row * a_stride).add(2 * pair) as *const u32;
                    let pair_of_a = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(
                        at.read_unaligned() as i32,
                    ));
                    for (sum, row_of_b) in sums.iter_mut().zip(&row_of_b) {
                        *sum = _mm512_dpbf16_ps(*sum, pair_of_a, *row_of_b);
                    }
                }
            }
        }
        for (row, row_of_sums) in sum.iter().enumerate() {
            for (block, &sum) in row_of_sums.iter().enumerate() {
                // SAFETY: within the sums (the caller vouches).
                unsafe { _mm512_storeu_ps(sums.byte_add(row * row_bytes).add(block * LANES), sum) };
            }
        }
        C
    }
}
