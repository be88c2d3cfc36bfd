//! f32 attention in vector registers (AVX-512 or AVX2, the widest the host has:
//! [`lanes`]), forward and gradient, a chunk of [`Lanes::CHUNK`] query rows at a time
//! against all the keys its rows see: the products and the softmax fused per chunk,
//! with no GEMM-library call (which packs both operands of every small product) and no
//! causal triangle computed past the last row of each register of a chunk's rows (a
//! chunk's scores for its first register of rows stop at that register's last row:
//! [`register_keys`]; a quarter of a full chunk's diagonal block).
//!
//! A chunk's scores are kept transposed, `S^T [keys x CHUNK]`: a key's scores for the
//! chunk's rows are two registers, so each row's maximum, sum
//! and `rowsum(P dP)` are taken over registers lane by lane, and a causal mask is a mask
//! of lanes. Every product is one register kernel ([`product`]): rows of `C` as
//! broadcasts of `A` read in place at any strides, columns as registers of `B`'s rows.
//! The chunk's queries (and output gradients) are packed transposed, `[head_dim x
//! CHUNK]`, to be `B` of `S^T = K Q^T` (and `dP^T = V dO^T`); keys, values and the
//! other products' operands are read in place.
//!
//! - Forward ([`AttentionRun::fused_task`]): `S^T = scale K Q^T`, each row's softmax
//!   numerators in place, `O = P V`, each row divided by its sum.
//! - Gradient ([`AttentionGradRun::fused_element`]): `S^T` and `dP^T = V dO^T` again,
//!   `P` and `dS = P (dP - rowsum(P dP))` in place, `dQ = scale dS K`, and summed over
//!   the chunks, `dK = scale dS^T Q` and `dV = P^T dO`.
//!
//! The numbers are those of the tiled code up to rounding (an `exp` with fused
//! multiply-adds, products in another order); the NaN, infinity and empty-element
//! behaviour is the same. The kernels are generic over the register ([`Lanes`]): both
//! instruction sets run the same code, in chunks of their own size (the keys'
//! gradients are sums over chunks, so the two differ by rounding).

mod lanes;

pub(super) use lanes::Isa;
use lanes::{Avx2, Avx512, Lanes};
use nestor_passes::Products;

use crate::prefetch::Ahead;

use super::{AttentionGradRun, AttentionRun, Buffers, GradBuffers, Task};

/// The most query rows a chunk holds ([`Lanes::CHUNK`] of AVX-512).
const MOST_CHUNK: usize = Avx512::CHUNK;

/// The instruction set a step's tasks run on here: f32 values and products, heads of
/// at least one column, a host with AVX2 and FMA or AVX-512 (the widest it has).
pub(super) fn isa<T: 'static>(
    products: Products,
    (head_dim, value_dim): (i64, i64),
) -> Option<Isa> {
    let f32_products =
        std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() && products == Products::Float;
    (f32_products && head_dim > 0 && value_dim > 0)
        .then(Isa::widest)
        .flatten()
}

/// Scalars a task holds at once for an element of `keys` keys and heads of
/// `head_dim`: the chunk's scores (and in the gradient its slopes) and its packed
/// queries (and output gradients), `None` on overflow.
pub(super) fn scratch_scalars(keys: i64, head_dim: i64, gradient: bool) -> Option<usize> {
    let per_lane = (keys.max(0) as usize).checked_add(head_dim.max(0) as usize)?;
    per_lane
        .checked_mul(MOST_CHUNK)?
        .checked_mul(1 + gradient as usize)
}

/// A thread's buffers, kept between tasks.
#[derive(Default)]
struct Scratch {
    /// The chunk's query rows transposed `[head_dim x CHUNK]` (zeros past its rows).
    queries: Vec<f32>,
    /// The chunk's output-gradient rows transposed (the gradient's).
    gradients: Vec<f32>,
    /// `S^T`, then the numerators or `P^T` `[keys x CHUNK]`.
    scores: Vec<f32>,
    /// `dP^T`, then `dS^T` (the gradient's).
    slopes: Vec<f32>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Fills this thread's scratch with NaNs (tests: a value read before it is written
/// shows).
#[cfg(test)]
pub(super) fn poison_scratch() {
    SCRATCH.with_borrow_mut(|scratch| {
        let most = 1 << 16;
        for buffer in [
            &mut scratch.queries,
            &mut scratch.gradients,
            &mut scratch.scores,
            &mut scratch.slopes,
        ] {
            buffer.clear();
            buffer.resize(most, f32::NAN);
        }
    });
}

/// A matrix read in place: its first value, the scalars between rows and between
/// columns.
type Read = (*const f32, isize, isize);

/// `C = alpha A B`, or `C += alpha A B` when `add`, for `C [rows x columns]` at
/// `(c, row stride)`, `A [rows x depth]` as [`Read`], `B [depth x columns]` at `(b, row
/// stride)` with contiguous columns. Blocks of up to [`Lanes::COLUMN_REGISTERS`]
/// registers of columns (the last one masked) by as many rows of sums as the registers
/// hold without spilling: 12 by 1 or 2, 6 by 3 or 4 on AVX-512 (32 registers); 8 by 1,
/// 6 by 2 on AVX2 (16). Each block of rows first fetches its rows of `ahead`
/// ([`Ahead::fetch`]): rows read later, or `A`'s next block.
///
/// # Safety
/// Code compiled for `I` ([`Lanes::compiled`]); the matrices hold their rows.
#[inline(always)]
unsafe fn product<I: Lanes>(
    (rows, depth, columns): (usize, usize, usize),
    alpha: f32,
    a: Read,
    (b, b_row): (*const f32, isize),
    (c, c_row): (*mut f32, isize),
    add: bool,
    ahead: &[Ahead],
) {
    let mut column = 0;
    while column < columns {
        let width = (columns - column).min(I::COLUMN_REGISTERS * I::LANES);
        let registers = width.div_ceil(I::LANES);
        let last = width - (registers - 1) * I::LANES;
        // SAFETY: columns `column..column + width` of the caller's matrices.
        unsafe {
            let block = Block {
                depth,
                alpha,
                a,
                b: (b.add(column), b_row),
                c: (c.add(column), c_row),
                tail: (last < I::LANES).then(|| I::below(last)),
                add,
            };
            // The first block of columns fetches the rows; the others find them.
            let ahead = if column == 0 { ahead } else { &[] };
            // AVX2's blocks are at most two registers wide (`COLUMN_REGISTERS`): its
            // catch-all arm keeps the wider AVX-512 shapes out of its code.
            match (I::LANES, registers) {
                (16, 1) => rows_of::<I, 12, 1>(rows, block, ahead),
                (16, 2) => rows_of::<I, 12, 2>(rows, block, ahead),
                (16, 3) => rows_of::<I, 6, 3>(rows, block, ahead),
                (16, _) => rows_of::<I, 6, 4>(rows, block, ahead),
                (_, 1) => rows_of::<I, 8, 1>(rows, block, ahead),
                _ => rows_of::<I, 6, 2>(rows, block, ahead),
            }
        }
        column += width;
    }
}

/// Rows of `B` a [`product_in_blocks`] takes at a time.
const DEPTH_BLOCK: usize = 32;

/// [`product`] over [`DEPTH_BLOCK`] rows of `B` at a time, each block's sums added to
/// `C`: for `B`'s rows read in place from a wide buffer, where all of them miss L1 (rows
/// 3 KiB apart, as a head's keys in `[L, 3, heads, 64]`, fall into a quarter of its
/// sets) but 32 of them stay in it for all of `C`'s rows.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn product_in_blocks<I: Lanes>(
    (rows, depth, columns): (usize, usize, usize),
    alpha: f32,
    (a, a_row, a_column): Read,
    (b, b_row): (*const f32, isize),
    c: (*mut f32, isize),
) {
    for first in (0..depth).step_by(DEPTH_BLOCK) {
        let block = DEPTH_BLOCK.min(depth - first);
        let a = a.wrapping_offset(first as isize * a_column);
        let b = b.wrapping_offset(first as isize * b_row);
        // SAFETY: rows `first..first + block` of `B`, columns of `A` (the caller vouches).
        unsafe {
            product::<I>(
                (rows, block, columns),
                alpha,
                (a, a_row, a_column),
                (b, b_row),
                c,
                first > 0,
                &[],
            );
        }
    }
}

/// The keys register `register` of a chunk's lanes (query rows from `first_row`,
/// counted within the element) needs of the `keys` the chunk reads: with `trim` (a
/// causal mask whose hidden keys are left out), none past the register's last row;
/// else all of them. Nondecreasing in `register`.
#[inline(always)]
fn register_keys<I: Lanes>(keys: usize, first_row: usize, trim: bool, register: usize) -> usize {
    match trim {
        true => keys.min(first_row.saturating_add((register + 1) * I::LANES)),
        false => keys,
    }
}

/// A chunk's `C [keys x CHUNK] = alpha A B` (an `S^T` or `dP^T`) for `A [keys x depth]`
/// read in place (contiguous columns) and the chunk's packed `B [depth x CHUNK]`, where
/// register `r` of lanes needs only the rows below `band(r)` (nondecreasing, the last
/// all `keys`): rows `band(r - 1)..band(r)` are computed for the lanes from register `r`
/// on, and the lanes a register does not need are left unwritten. The first band
/// fetches `ahead` ([`product`]).
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn banded_panel<I: Lanes>(
    band: impl Fn(usize) -> usize,
    (depth, alpha): (usize, f32),
    (a, a_row): (*const f32, isize),
    b: *const f32,
    c: *mut f32,
    ahead: &[Ahead],
) {
    let panel = I::CHUNK as isize;
    for (lane, from, to) in bands::<I>(band) {
        // SAFETY: rows `from..to` of `A` and `C`, lanes from `lane` of `B` and `C`.
        unsafe {
            product::<I>(
                (to - from, depth, I::CHUNK - lane),
                alpha,
                (a.wrapping_offset(from as isize * a_row), a_row, 1),
                (b.add(lane), panel),
                (c.add(from * I::CHUNK + lane), panel),
                false,
                if from == 0 { ahead } else { &[] },
            );
        }
    }
}

/// The nonempty bands of rows of a chunk's `[keys x CHUNK]` panel ([`banded_panel`]):
/// `(lane, from, to)` for rows `from..to`, which the lanes from `lane` (register
/// `r`'s first) on need and those before it do not.
#[inline(always)]
fn bands<I: Lanes>(band: impl Fn(usize) -> usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..I::CHUNK / I::LANES)
        .scan(0, move |from, register| {
            let (start, to) = (*from, band(register).max(*from));
            *from = to;
            Some((register * I::LANES, start, to))
        })
        .filter(|&(_, from, to)| to > from)
}

/// `C [keys x width] = alpha A B` (or `+=` when `add`; a `dK` or `dV`) for `A` the
/// transpose of a chunk's `[keys x CHUNK]` panel (a `dS^T` or `P^T`, as
/// [`banded_panel`] left it: register `r`'s lanes hold rows below `band(r)`) and
/// `B [rows x width]` the chunk's `rows` query-side rows at `(b, row stride)`: rows
/// `band(r - 1)..band(r)` of `C` sum over the lanes from register `r` on. The first band
/// fetches `ahead`.
///
/// # Safety
/// As [`product`]; a nonempty band `r` has rows past lane `r * LANES`.
#[inline(always)]
unsafe fn banded_keys<I: Lanes>(
    band: impl Fn(usize) -> usize,
    (rows, width, alpha): (usize, usize, f32),
    panel: *const f32,
    (b, b_row): (*const f32, isize),
    (c, c_row): (*mut f32, isize),
    (add, ahead): (bool, &[Ahead]),
) {
    for (lane, from, to) in bands::<I>(band) {
        // SAFETY: rows `from..to` of the panel and `C`, query rows from `lane` on.
        unsafe {
            product::<I>(
                (to - from, rows.saturating_sub(lane), width),
                alpha,
                (panel.add(from * I::CHUNK + lane), I::CHUNK as isize, 1),
                (b.wrapping_offset(lane as isize * b_row), b_row),
                (c.wrapping_offset(from as isize * c_row), c_row),
                add,
                if from == 0 { ahead } else { &[] },
            );
        }
    }
}

/// [`product_in_blocks`] for a chunk's `rows` query rows (an `O = P V` or `dQ = dS K`)
/// with `A` read from its `[keys x CHUNK]` panel (register `r`'s lanes holding rows
/// below `band(r)`, as [`banded_panel`] left them): the rows of register `r` sum over
/// the first `band(r)` rows of `B [keys x width]` (at `(b, row stride)`); registers with
/// the same band in one product.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn banded_rows<I: Lanes>(
    band: impl Fn(usize) -> usize,
    (rows, width, alpha): (usize, usize, f32),
    panel: *const f32,
    b: (*const f32, isize),
    (c, c_row): (*mut f32, isize),
) {
    let registers = rows.div_ceil(I::LANES).min(I::CHUNK / I::LANES);
    let mut register = 0;
    while register < registers {
        let depth = band(register);
        let mut end = register + 1;
        while end < registers && band(end) == depth {
            end += 1;
        }
        let (first, last) = (register * I::LANES, (end * I::LANES).min(rows));
        // SAFETY: the chunk's rows `first..last`, `depth` keys of the panel and `B`.
        unsafe {
            product_in_blocks::<I>(
                (last - first, depth, width),
                alpha,
                (panel.add(first), 1, I::CHUNK as isize),
                b,
                (c.wrapping_offset(first as isize * c_row), c_row),
            );
        }
        register = end;
    }
}

/// One block of columns of a [`product`].
#[derive(Clone, Copy)]
struct Block<I: Lanes> {
    depth: usize,
    alpha: f32,
    a: Read,
    b: (*const f32, isize),
    c: (*mut f32, isize),
    /// The lanes of the block's last register that are columns, `None` when all are.
    tail: Option<I::Mask>,
    add: bool,
}

impl<I: Lanes> Block<I> {
    /// The block from row `row` of `A` and `C` on.
    #[inline(always)]
    fn at_row(self, row: usize) -> Self {
        let (a, a_row, a_column) = self.a;
        let (c, c_row) = self.c;
        Block {
            a: (a.wrapping_offset(row as isize * a_row), a_row, a_column),
            c: (c.wrapping_offset(row as isize * c_row), c_row),
            ..self
        }
    }
}

/// A block's `rows` rows, `ROWS` at a time, the rest by 8, 4, 2 and 1, each block
/// of rows fetching its rows of `ahead` first.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn rows_of<I: Lanes, const ROWS: usize, const REGISTERS: usize>(
    rows: usize,
    block: Block<I>,
    ahead: &[Ahead],
) {
    let fetch = |rows: std::ops::Range<usize>| {
        for target in ahead {
            target.fetch(rows.clone());
        }
    };
    let mut row = 0;
    // SAFETY: rows below `rows` (the caller vouches).
    unsafe {
        while row + ROWS <= rows {
            fetch(row..row + ROWS);
            registers::<I, ROWS, REGISTERS>(block.at_row(row));
            row += ROWS;
        }
        fetch(row..rows);
        if ROWS > 8 && rows - row >= 8 {
            registers::<I, 8, REGISTERS>(block.at_row(row));
            row += 8;
        }
        if rows - row >= 4 {
            registers::<I, 4, REGISTERS>(block.at_row(row));
            row += 4;
        }
        if rows - row >= 2 {
            registers::<I, 2, REGISTERS>(block.at_row(row));
            row += 2;
        }
        if rows - row >= 1 {
            registers::<I, 1, REGISTERS>(block.at_row(row));
        }
    }
}

/// `ROWS x REGISTERS` registers of a block's `C`, summed over its depth.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn registers<I: Lanes, const ROWS: usize, const REGISTERS: usize>(block: Block<I>) {
    let Block {
        depth,
        alpha,
        a: (a, a_row, a_column),
        b: (b, b_row),
        c: (c, c_row),
        tail,
        add,
    } = block;
    // SAFETY: the block's rows and columns (the caller vouches); the lanes past the
    // columns are neither read nor written.
    unsafe {
        let load = |at: *const f32, register: usize| match tail {
            Some(mask) if register + 1 == REGISTERS => I::load_masked(at, mask),
            _ => I::load(at),
        };
        let mut sums = [[I::zero(); REGISTERS]; ROWS];
        for step in 0..depth {
            let line = b.offset(step as isize * b_row);
            let values: [I; REGISTERS] =
                std::array::from_fn(|register| load(line.add(register * I::LANES), register));
            let column = a.offset(step as isize * a_column);
            for (row, sums) in sums.iter_mut().enumerate() {
                let x = I::splat(*column.offset(row as isize * a_row));
                for (sum, &value) in sums.iter_mut().zip(&values) {
                    *sum = x.mul_add(value, *sum);
                }
            }
        }
        let alpha = I::splat(alpha);
        for (row, sums) in sums.iter().enumerate() {
            let line = c.offset(row as isize * c_row);
            for (register, &sum) in sums.iter().enumerate() {
                let at = line.add(register * I::LANES);
                let mut value = sum.mul(alpha);
                if add {
                    value = value.add(load(at, register));
                }
                match tail {
                    Some(mask) if register + 1 == REGISTERS => value.store_masked(at, mask),
                    _ => value.store(at),
                }
            }
        }
    }
}

/// The lanes of a register of query rows, the first `first_row` (counted within the
/// element), that see key `key`: all without a causal mask, else those at or past it.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn seeing<I: Lanes>(key: usize, first_row: usize, causal: bool) -> I::Mask {
    // SAFETY: register arithmetic (the caller vouches for the host).
    unsafe {
        match !causal || key <= first_row {
            true => I::all(),
            false => I::not(I::below(key - first_row)),
        }
    }
}

/// `e^x` for `x` in `[-87, 0]` (or NaN, kept): `nestor_math::fast_exp`'s reduction and
/// polynomial with fused multiply-adds.
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn exp<I: Lanes>(x: I) -> I {
    use nestor_math::{EXP_COEFFICIENTS, LN_2_SPLIT};
    // SAFETY: register arithmetic (the caller vouches for the host).
    unsafe {
        let splat = |value: f64| I::splat(value as f32);
        let n = x.mul(splat(std::f64::consts::LOG2_E)).round();
        let r = n.neg_mul_add(splat(LN_2_SPLIT[0]), x);
        let r = n.neg_mul_add(splat(LN_2_SPLIT[1]), r);
        let mut polynomial = splat(EXP_COEFFICIENTS[0]);
        for &coefficient in &EXP_COEFFICIENTS[1..] {
            polynomial = polynomial.mul_add(r, splat(coefficient));
        }
        let reduced = polynomial.mul_add(r.mul(r), r.add(splat(1.0)));
        reduced.times_power_of_two(n)
    }
}

/// `e^(score - largest)` of the lanes in `seen`, 0 in the others and where the
/// exponent is below `rows::LOWEST_EXPONENT` (as the tiled code's numerators; a NaN
/// stays NaN).
///
/// # Safety
/// As [`product`].
#[inline(always)]
unsafe fn numerators<I: Lanes>(scores: I, largest: I, seen: I::Mask) -> I {
    // SAFETY: register arithmetic (the caller vouches for the host).
    unsafe {
        let exponent = scores.sub(largest);
        let lowest = I::splat(super::rows::LOWEST_EXPONENT);
        let kept = I::and(seen, exponent.not_less(lowest));
        // `max` keeps its second operand when it is NaN.
        I::select(kept, exp(lowest.max(exponent)), I::zero())
    }
}

/// Each lane's largest score over the `keys` keys it sees (`-inf` when none; NaN
/// ignored) of one register column of `S^T` (`CHUNK` scalars a key), and the lanes
/// with a masked score NaN or `+inf`.
///
/// # Safety
/// As [`product`]; `scores` holds `keys` keys.
#[inline(always)]
unsafe fn largest<I: Lanes>(
    scores: *const f32,
    keys: usize,
    first_row: usize,
    causal: bool,
) -> (I, I::Mask) {
    // SAFETY: as the caller vouches.
    unsafe {
        let mut largest = I::splat(f32::NEG_INFINITY);
        let mut poisoned = I::not(I::all());
        let infinite = I::splat(f32::INFINITY);
        for key in 0..keys {
            let values = I::load(scores.add(key * I::CHUNK));
            let seen = seeing::<I>(key, first_row, causal);
            let larger = I::and(seen, values.greater(largest));
            largest = I::select(larger, values, largest);
            let masked = I::and(I::not(seen), values.not_less(infinite));
            poisoned = I::or(poisoned, masked);
        }
        (largest, poisoned)
    }
}

/// Packs `rows` rows (at most [`Lanes::CHUNK`]) of `width` values (from `at`, `stride`
/// scalars apart) transposed into `out [width x CHUNK]`, zeros past the rows: blocks of
/// `LANES x LANES` transposed in registers.
///
/// # Safety
/// As [`product`]; `at` holds the rows.
#[inline(always)]
unsafe fn pack_transposed<I: Lanes>(
    out: &mut Vec<f32>,
    (at, stride): (*const f32, isize),
    rows: usize,
    width: usize,
) {
    out.clear();
    out.resize(width * I::CHUNK, 0.0);
    let target = out.as_mut_ptr();
    for first_row in (0..rows.min(I::CHUNK)).step_by(I::LANES) {
        let present = (rows - first_row).min(I::LANES);
        for first_column in (0..width).step_by(I::LANES) {
            let columns = (width - first_column).min(I::LANES);
            // SAFETY: rows below `rows` and columns below `width` are read (the caller
            // vouches for them), columns below `width` of the rows written.
            unsafe {
                let line = at.offset(first_row as isize * stride).add(first_column);
                let into = target.add(first_column * I::CHUNK + first_row);
                I::transpose_block((line, stride), (present, columns), (into, I::CHUNK));
            }
        }
    }
}

/// Grows `buffer` to `len` scalars (their values are written before they are read).
fn hold(buffer: &mut Vec<f32>, len: usize) -> *mut f32 {
    if buffer.len() < len {
        buffer.resize(len, 0.0);
    }
    buffer.as_mut_ptr()
}

impl AttentionRun<'_> {
    /// One task here: its query rows' outputs for one head, [`Lanes::CHUNK`] at a time,
    /// each against the keys it sees (with a causal mask, none past its last row where
    /// `AttentionRun::leaves_out_keys` lets all of the task's rows leave them out).
    ///
    /// # Safety
    /// As [`AttentionRun::task`]; the host has `isa` ([`isa`]).
    pub(super) unsafe fn fused_task(&self, isa: Isa, buffers: Buffers<f32>, task: Task) {
        // SAFETY: as the caller vouches.
        unsafe {
            match isa {
                Isa::Avx512 => Avx512::compiled(
                    #[inline(always)]
                    || self.fused_task_in::<Avx512>(buffers, task),
                ),
                Isa::Avx2 => Avx2::compiled(
                    #[inline(always)]
                    || self.fused_task_in::<Avx2>(buffers, task),
                ),
            }
        }
    }

    /// [`AttentionRun::fused_task`] on `I`'s registers.
    ///
    /// # Safety
    /// As [`AttentionRun::fused_task`], in code compiled for `I`.
    #[inline(always)]
    unsafe fn fused_task_in<I: Lanes>(&self, buffers: Buffers<f32>, task: Task) {
        let (d, dv) = (self.head_dim as usize, self.value_dim as usize);
        let out_width = (self.heads * self.value_dim) as isize;
        let heads = (task.head * self.head_dim, task.head * self.value_dim);
        let rows = task.rows.max(0) as usize;
        let scale = self.scale as f32;
        let q_rows = |row: i64| {
            let offset = (task.q_first + row) * self.q.row_stride + self.q.offset + heads.0;
            buffers.q.wrapping_offset(offset as isize)
        };
        // SAFETY: the task's rows and the element's keys (the caller vouches).
        let leave_out = self.causal
            && unsafe {
                // Keys past the first register of rows (`register_keys`).
                let seen = (task.row + I::LANES.min(rows) as i64).clamp(0, task.k_rows);
                let tile = (q_rows(task.row), self.q.row_stride, rows);
                self.leaves_out_keys(buffers, heads, tile, (task.k_first, task.k_rows), seen)
            };
        let mut scratch = SCRATCH.take();
        {
            let scratch = &mut scratch;
            for first in (0..rows).step_by(I::CHUNK) {
                let chunk = I::CHUNK.min(rows - first);
                let row = task.row + first as i64;
                let q_row = task.q_first + row;
                // SAFETY: the task's rows and keys (the caller vouches).
                unsafe {
                    let q = q_rows(row);
                    let out = buffers
                        .out
                        .offset((q_row as isize) * out_width + heads.1 as isize);
                    let keys = match leave_out {
                        true => (row + chunk as i64).clamp(0, task.k_rows),
                        false => task.k_rows,
                    }
                    .max(0) as usize;
                    if keys == 0 {
                        // No keys: libtorch's attention gives 0.
                        for line in 0..chunk {
                            let at = out.offset(line as isize * out_width);
                            std::slice::from_raw_parts_mut(at, dv).fill(0.0);
                        }
                        continue;
                    }
                    let at = |access: &nestor_passes::Access, buffer: *const f32, column: i64| {
                        let offset = task.k_first * access.row_stride + access.offset + column;
                        (buffer.offset(offset as isize), access.row_stride as isize)
                    };
                    let (k, k_stride) = at(self.k, buffers.k, heads.0);
                    let (v, v_stride) = at(self.v, buffers.v, heads.1);
                    pack_transposed::<I>(
                        &mut scratch.queries,
                        (q, self.q.row_stride as isize),
                        chunk,
                        d,
                    );
                    let scores = hold(&mut scratch.scores, keys * I::CHUNK);
                    // The keys a block on, the values `P V` reads, the next chunk's queries.
                    let next = first + chunk;
                    let ahead = [
                        Ahead::new((k, k_stride), (keys, d), true),
                        Ahead::new((v, v_stride), (keys, dv), false),
                        Ahead::new(
                            (q_rows(task.row + next as i64), self.q.row_stride as isize),
                            ((rows - next).min(I::CHUNK), d),
                            false,
                        ),
                    ];
                    let band = |register| {
                        register_keys::<I>(keys, row.max(0) as usize, leave_out, register)
                    };
                    // S^T = scale K Q^T.
                    banded_panel::<I>(
                        band,
                        (d, scale),
                        (k, k_stride),
                        scratch.queries.as_ptr(),
                        scores,
                        &ahead,
                    );
                    let mut inverses = [0.0f32; MOST_CHUNK];
                    for (register, inverses) in
                        inverses[..I::CHUNK].chunks_mut(I::LANES).enumerate()
                    {
                        let column = scores.add(register * I::LANES);
                        let first_row = row.max(0) as usize + register * I::LANES;
                        let inverse = self.fused_numerators::<I>(column, band(register), first_row);
                        inverse.store(inverses.as_mut_ptr());
                    }
                    // O = P V, each row divided by its sum.
                    banded_rows::<I>(
                        band,
                        (chunk, dv, 1.0),
                        scores,
                        (v, v_stride),
                        (out, out_width),
                    );
                    for (line, &inverse) in inverses[..chunk].iter().enumerate() {
                        let at = out.offset(line as isize * out_width);
                        for value in std::slice::from_raw_parts_mut(at, dv) {
                            *value *= inverse;
                        }
                    }
                }
            }
        }
        SCRATCH.set(scratch);
    }

    /// One register column of the forward's `S^T` (`keys` keys, lanes from query row
    /// `first_row`) turned into softmax numerators; returns each lane's `1 / sum`: NaN
    /// where a masked score was NaN or `+inf` (libtorch masks by adding `-inf`), 1 where
    /// no score is finite (numerators 0, or NaN for a NaN score, as the tiled forward).
    ///
    /// # Safety
    /// As [`product`]; `scores` holds `keys` keys.
    #[inline(always)]
    unsafe fn fused_numerators<I: Lanes>(
        &self,
        scores: *mut f32,
        keys: usize,
        first_row: usize,
    ) -> I {
        // SAFETY: as the caller vouches.
        unsafe {
            let (largest, poisoned) = largest::<I>(scores, keys, first_row, self.causal);
            // With no finite score, `e^(score - 0)`: 0 for `-inf`, NaN for NaN.
            let none = largest.equal(I::splat(f32::NEG_INFINITY));
            let largest = I::select(none, I::zero(), largest);
            let mut total = I::zero();
            for key in 0..keys {
                let at = scores.add(key * I::CHUNK);
                let seen = seeing::<I>(key, first_row, self.causal);
                let values = numerators(I::load(at), largest, seen);
                values.store(at);
                total = total.add(values);
            }
            let one = I::splat(1.0);
            let empty = total.equal(I::zero());
            let inverse = one.div(I::select(empty, one, total));
            I::select(poisoned, I::splat(f32::NAN), inverse)
        }
    }
}

impl AttentionGradRun<'_> {
    /// The gradient of query rows `q_first..q_first + q_rows` (from row `row_offset` of
    /// their element) of one head here, [`Lanes::CHUNK`] rows at a time against the keys
    /// it sees (`AttentionGradRun::seen_keys`; the last chunk first with a causal mask,
    /// so that the chunk writing the keys' gradients sees the most keys).
    ///
    /// # Safety
    /// As [`AttentionGradRun::element`]; the host has `isa` ([`isa`]).
    pub(super) unsafe fn fused_element(
        &self,
        isa: Isa,
        buffers: GradBuffers<f32>,
        head: i64,
        queries: (i64, i64),
        keys: (i64, i64),
        row_offset: i64,
    ) {
        let element = (head, queries, keys, row_offset);
        // SAFETY: as the caller vouches.
        unsafe {
            match isa {
                Isa::Avx512 => Avx512::compiled(
                    #[inline(always)]
                    || self.fused_element_in::<Avx512>(buffers, element),
                ),
                Isa::Avx2 => Avx2::compiled(
                    #[inline(always)]
                    || self.fused_element_in::<Avx2>(buffers, element),
                ),
            }
        }
    }

    /// [`AttentionGradRun::fused_element`] on `I`'s registers.
    ///
    /// # Safety
    /// As [`AttentionGradRun::fused_element`], in code compiled for `I`.
    #[inline(always)]
    unsafe fn fused_element_in<I: Lanes>(
        &self,
        buffers: GradBuffers<f32>,
        (head, (q_first, q_rows), (k_first, k_rows), row_offset): (
            i64,
            (i64, i64),
            (i64, i64),
            i64,
        ),
    ) {
        let d = self.head_dim as usize;
        let (qs, ks) = (q_rows.max(0) as usize, k_rows.max(0) as usize);
        if qs == 0 || ks == 0 {
            // SAFETY: the task's rows (the caller vouches).
            unsafe { self.zero_gradient(buffers, head, (q_first, q_rows), (k_first, k_rows)) };
            return;
        }
        let at = |access: &nestor_passes::Access, base: *const f32, first: i64| {
            let offset = first * access.row_stride + access.offset + head * self.head_dim;
            (
                base.wrapping_offset(offset as isize),
                access.row_stride as isize,
            )
        };
        let (q, k, v, g) = (
            at(self.q, buffers.q, q_first),
            at(self.k, buffers.k, k_first),
            at(self.v, buffers.v, k_first),
            at(self.g, buffers.g, q_first),
        );
        let scale = self.scale as f32;
        let chunks = qs.div_ceil(I::CHUNK);
        let chunk_at = |index: usize| match self.causal {
            true => (chunks - 1 - index) * I::CHUNK,
            false => index * I::CHUNK,
        };
        let first_row = row_offset.max(0) as usize;
        // With a causal mask the chunks leave out the keys past their last rows, where
        // that changes nothing (checked once for all of them; past the first register of rows:
        // `register_keys`).
        let hidden = (first_row + I::LANES.min(qs)).min(ks)..ks;
        // SAFETY: the task's rows and the element's keys (the caller vouches).
        let leave_out = self.causal && unsafe { self.leaves_out(((q, g), qs), (k, v), hidden) };
        let mut scratch = SCRATCH.take();
        {
            let scratch = &mut scratch;
            for index in 0..chunks {
                let first = chunk_at(index);
                let rows = I::CHUNK.min(qs - first);
                let line = |(at, stride): (*const f32, isize), first: usize| {
                    (at.wrapping_offset(first as isize * stride), stride)
                };
                // The next chunk's query rows and output gradients, fetched ahead.
                let next = match index + 1 < chunks {
                    true => chunk_at(index + 1),
                    false => qs,
                };
                let next_rows = ((qs - next).min(I::CHUNK), d);
                let next_ahead = [q, g].map(|rows| Ahead::new(line(rows, next), next_rows, false));
                let (q, g) = (line(q, first), line(g, first));
                // SAFETY: the chunk's rows and the element's keys (the caller vouches).
                unsafe {
                    let seen = match leave_out {
                        true => (first_row + first + rows).min(ks),
                        false => ks,
                    };
                    pack_transposed::<I>(&mut scratch.queries, q, rows, d);
                    pack_transposed::<I>(&mut scratch.gradients, g, rows, d);
                    let scores = hold(&mut scratch.scores, seen * I::CHUNK);
                    let slopes = hold(&mut scratch.slopes, seen * I::CHUNK);
                    let band =
                        |register| register_keys::<I>(seen, first_row + first, leave_out, register);
                    // S^T = scale K Q^T; dP^T = V dO^T.
                    let ahead = [
                        Ahead::new(k, (seen, d), true),
                        Ahead::new(v, (seen, d), false),
                        next_ahead[0],
                        next_ahead[1],
                    ];
                    let queries = scratch.queries.as_ptr();
                    banded_panel::<I>(band, (d, scale), k, queries, scores, &ahead);
                    let gradients = scratch.gradients.as_ptr();
                    banded_panel::<I>(band, (d, 1.0), v, gradients, slopes, &[]);
                    for register in 0..I::CHUNK / I::LANES {
                        let offset = register * I::LANES;
                        let columns = (scores.add(offset), slopes.add(offset));
                        let lanes_row = first_row + first + offset;
                        self.fused_slopes::<I>(columns, band(register), lanes_row);
                    }
                    if let Some(key_rows) = self.key_rows(buffers, k_first, head) {
                        if index == 0 && seen < ks {
                            // Keys no query row sees: no gradient.
                            self.zero_keys(key_rows, seen..ks);
                        }
                        // dK = scale dS^T Q; dV = P^T dO: written by the first chunk,
                        // added to by the others.
                        let (out, row) = (key_rows.out, key_rows.row as isize);
                        let add = index > 0;
                        let values = out.offset(key_rows.values_after as isize);
                        // The first chunk's gradient rows, a block on.
                        let written = |at: *mut f32| match add {
                            true => None,
                            false => Some(Ahead::new((at as *const f32, row), (seen, d), true)),
                        };
                        banded_keys::<I>(
                            band,
                            (rows, d, scale),
                            slopes,
                            q,
                            (out, row),
                            (add, written(out).as_slice()),
                        );
                        banded_keys::<I>(
                            band,
                            (rows, d, 1.0),
                            scores,
                            g,
                            (values, row),
                            (add, written(values).as_slice()),
                        );
                    }
                    if let Some(queries) = self.outputs.queries {
                        // dQ = scale dS K.
                        let row = q_first + first as i64;
                        let out = buffers.out.offset(
                            (row * queries.row + queries.at + head * self.head_dim) as isize,
                        );
                        let out = (out, queries.row as isize);
                        banded_rows::<I>(band, (rows, d, scale), slopes, k, out);
                    }
                }
            }
        }
        SCRATCH.set(scratch);
    }

    /// One register column of the gradient's `S^T` and `dP^T` (`keys` keys, lanes from
    /// query row `first_row`) turned into `P^T` and `dS^T = P (dP - rowsum(P dP))`, as
    /// the tiled gradient's `softmax_slopes` (0 where `P` is; `dS` NaN past the visible
    /// keys where `dP - rowsum` is not finite).
    ///
    /// # Safety
    /// As [`product`]; the columns hold `keys` keys.
    #[inline(always)]
    unsafe fn fused_slopes<I: Lanes>(
        &self,
        (scores, slopes): (*mut f32, *mut f32),
        keys: usize,
        first_row: usize,
    ) {
        // SAFETY: as the caller vouches.
        unsafe {
            let (largest, _) = largest::<I>(scores, keys, first_row, self.causal);
            let mut total = I::zero();
            let mut dot = I::zero();
            for key in 0..keys {
                let (at, products) = (scores.add(key * I::CHUNK), slopes.add(key * I::CHUNK));
                let seen = seeing::<I>(key, first_row, self.causal);
                let values = numerators(I::load(at), largest, seen);
                values.store(at);
                total = total.add(values);
                let product = values.mul(I::load(products));
                dot = dot.add(I::select(seen, product, I::zero()));
            }
            let inverse = I::splat(1.0).div(total);
            let dot = dot.mul(inverse);
            for key in 0..keys {
                let (at, products) = (scores.add(key * I::CHUNK), slopes.add(key * I::CHUNK));
                let p = I::load(at).mul(inverse);
                p.store(at);
                let slope = p.mul(I::load(products).sub(dot));
                slope.store(products);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// [`pack_transposed`] on `isa`'s registers into a buffer that held other values.
    ///
    /// # Safety
    /// The host has `isa`.
    unsafe fn pack(isa: Isa, values: &[f32], stride: usize, rows: usize, width: usize) -> Vec<f32> {
        let mut out = vec![f32::NAN; 7];
        let at = (values.as_ptr(), stride as isize);
        // SAFETY: `values` holds the rows (the test sizes it); the caller vouches for
        // the host.
        unsafe {
            match isa {
                Isa::Avx512 => {
                    Avx512::compiled(|| pack_transposed::<Avx512>(&mut out, at, rows, width))
                }
                Isa::Avx2 => Avx2::compiled(|| pack_transposed::<Avx2>(&mut out, at, rows, width)),
            }
        }
        out
    }

    /// A causal chunk's registers of rows need the keys up to their last rows, and the
    /// bands of a panel are the rows between those counts, empty ones left out.
    #[test]
    fn registers_of_a_causal_chunk_band_their_keys() {
        // Rows 40.. of an element: the first register (rows 40-55) sees keys below 56.
        assert_eq!(register_keys::<Avx512>(72, 40, true, 0), 56);
        assert_eq!(register_keys::<Avx512>(72, 40, true, 1), 72);
        assert_eq!(register_keys::<Avx512>(50, 40, true, 0), 50);
        assert_eq!(register_keys::<Avx512>(72, 40, false, 0), 72);
        let bands = |counts: [usize; 2]| bands::<Avx512>(move |r| counts[r]).collect::<Vec<_>>();
        assert_eq!(bands([56, 72]), [(0, 0, 56), (16, 56, 72)]);
        assert_eq!(bands([50, 50]), [(0, 0, 50)]);
        assert_eq!(bands([0, 9]), [(16, 0, 9)]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// On every instruction set this host has (skipped where none).
        #[test]
        fn packed_rows_are_the_rows_transposed(
            rows in 0usize..=MOST_CHUNK,
            width in 1usize..70,
            extra in 0usize..5,
        ) {
            let isas = Isa::all_here();
            if isas.is_empty() {
                eprintln!("skipped: this host has neither AVX-512 nor AVX2 with FMA");
            }
            let stride = width + extra;
            let values: Vec<f32> = (0..rows * stride).map(|at| at as f32).collect();
            for isa in isas {
                // SAFETY: the host has `isa`.
                let chunk = match isa {
                    Isa::Avx512 => Avx512::CHUNK,
                    Isa::Avx2 => Avx2::CHUNK,
                };
                let rows = rows.min(chunk);
                let packed = unsafe { pack(isa, &values, stride, rows, width) };
                prop_assert_eq!(packed.len(), width * chunk);
                for column in 0..width {
                    for lane in 0..chunk {
                        let expected = if lane < rows { values[lane * stride + column] } else { 0.0 };
                        prop_assert_eq!(packed[column * chunk + lane], expected, "{:?} {} {}", isa, column, lane);
                    }
                }
            }
        }
    }
}
