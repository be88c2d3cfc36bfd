//! Varlen attention on the host, packed (no padding between elements).
//!
//! The forward is tiled with an online softmax (as FlashAttention): a task takes one
//! element, head and tile of [`Tiles::queries`] query rows, and walks the keys in tiles
//! of [`Tiles::keys`]: `S = scale Q K^T` for the tile (the GEMM library's microkernels),
//! each row's running maximum and sum updated, the output rows rescaled and `P V` added.
//! Memory is one tile of scores per task, never `L x L`; tasks of every element, head
//! and query tile spread over the team. The gradient recomputes `P` for a tile of query
//! rows at a time over all keys (`tile x keys`: O(L) memory per task, no extra GEMM).
//! With a causal mask a tile of query rows leaves out the keys past its last row, which
//! none of its rows sees, where that changes nothing (`maskable`: finite values, no
//! score near overflow); on a 1024-token element that is about 44% of the products.
//! With bf16 products on a host with AMX tiles both run on the tiles instead
//! ([`tiles`]); with f32 products on a host with AVX-512 or AVX2, in registers,
//! products and softmax fused per chunk of 32 query rows ([`fused`]).

mod fused;
mod rows;
mod tiles;

use nestor_passes::{Access, Products};

use crate::bf16::RoundedBuffer;
use crate::blas::Gemm;
use crate::scalar::Scalar;
use tiles::{TileInputs, TILE_ROWS};

/// The registers f32 attention (f32 products) runs fused in on this host
/// (`attention/fused.rs`): `Some("AVX-512")` or `Some("AVX2")`; `None` where it runs on
/// the GEMM library's tiles (a host without AVX2 and FMA).
///
/// ```
/// let registers = nestor_backend_cpu::attention_in_registers();
/// assert!(matches!(registers, None | Some("AVX-512") | Some("AVX2")));
/// ```
pub fn in_registers() -> Option<&'static str> {
    fused::isa::<f32>(Products::Float, (1, 1)).map(fused::Isa::name)
}

/// The tile sizes of the forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tiles {
    /// Query rows per task (per tile of probabilities in the gradient).
    pub queries: i64,
    /// Keys per tile of scores.
    pub keys: i64,
}

impl Tiles {
    /// 128 query rows x 256 keys: 128 KiB of f32 scores per task (in L2 with the tile's
    /// keys and values), whole elements of up to 256 keys in one tile (no rescaling),
    /// and tasks enough for every core from a handful of long elements. (64 rows took
    /// 5-14% longer on a Xeon with AVX-512 and AMX, f32 and bf16 products alike: twice
    /// the products, each packing its operands.)
    pub(crate) const DEFAULT: Tiles = Tiles {
        queries: 128,
        keys: 256,
    };

    /// Scalars a forward task over an element of `q_rows` queries and `k_rows` keys
    /// holds at once, `None` on overflow: a tile of scores and one of `P V` products,
    /// or on AMX tiles (`AttentionRun::tile_task`, all keys at once) the keys'
    /// transpose, the values, 16 rows of scores, probabilities and sums and the packed
    /// queries, whichever is more (bf16 values counted as whole scalars).
    pub(crate) fn forward_scalars(
        self,
        (q_rows, k_rows): (i64, i64),
        (head_dim, value_dim): (i64, i64),
    ) -> Option<usize> {
        let rows = self.queries.max(1).min(q_rows).max(0) as usize;
        let keys = self.keys.max(1).min(k_rows).max(0) as usize;
        let (head_dim, value_dim) = (head_dim.max(0) as usize, value_dim.max(0) as usize);
        let tiled = rows.checked_mul(keys.checked_add(value_dim)?)?;
        let pad = |value: usize| value.checked_next_multiple_of(32);
        let (all_keys, head, value) = (
            pad(k_rows.max(0) as usize)?,
            pad(head_dim)?,
            pad(value_dim)?,
        );
        let per_key = head.checked_add(value)?.checked_add(2 * TILE_ROWS)?;
        let on_tiles = all_keys
            .checked_mul(per_key)?
            .checked_add(rows.checked_mul(head)?)?
            .checked_add(TILE_ROWS * value)?;
        let fused = fused::scratch_scalars(k_rows, head_dim as i64, false)?;
        Some(tiled.max(on_tiles).max(fused))
    }

    /// Scalars a gradient task holds at once, `None` on overflow: probabilities and
    /// slopes of a tile of query rows over all keys, and the keys' gradient sums of the
    /// later tiles; or on AMX tiles (`AttentionGradRun::tile_task`) three panels of the
    /// keys' and values' rows, a chunk's query and output-gradient rows and their
    /// transposes, its `P` and `dS` by pairs of rows, and 16 rows of scores, `dP`,
    /// rounded `dS` and sums, whichever is more (bf16 values counted as whole scalars).
    pub(crate) fn gradient_scalars(
        self,
        (q_rows, k_rows): (i64, i64),
        head_dim: i64,
    ) -> Option<usize> {
        let rows = self.queries.max(1).min(q_rows).max(0) as usize;
        let keys = k_rows.max(0) as usize;
        let head_dim = head_dim.max(0) as usize;
        let tiled = rows
            .checked_mul(keys)?
            .checked_mul(2)?
            .checked_add(keys.checked_mul(head_dim)?.checked_mul(2)?)?;
        let pad = |value: usize| value.checked_next_multiple_of(32);
        let (keys, head, rows) = (pad(keys)?, pad(head_dim)?, pad(rows)?);
        let per_key = head
            .checked_mul(3)?
            .checked_add(rows.checked_mul(2)?)?
            .checked_add(3 * TILE_ROWS)?;
        let on_tiles = keys
            .checked_mul(per_key)?
            .checked_add(rows.checked_mul(head)?.checked_mul(4)?)?
            .checked_add(keys.max(head).checked_mul(TILE_ROWS)?)?;
        let fused = fused::scratch_scalars(k_rows, head_dim as i64, true)?;
        Some(tiled.max(on_tiles).max(fused))
    }
}

/// The shape of one attention step.
pub(crate) struct AttentionRun<'a> {
    pub q: &'a Access,
    pub k: &'a Access,
    pub v: &'a Access,
    pub heads: i64,
    pub head_dim: i64,
    pub value_dim: i64,
    pub causal: bool,
    pub scale: f64,
    /// Spread the tasks over the team (`crate::team`).
    pub parallel: bool,
    pub tiles: Tiles,
    /// The operands of the two products (the softmax is in `T` either way).
    pub products: Products,
}

/// Pointers shared by the parallel tasks; each task writes its own rows and head
/// columns of `out`.
#[derive(Clone, Copy)]
struct Buffers<T> {
    out: *mut T,
    q: *const T,
    k: *const T,
    v: *const T,
}
unsafe impl<T> Send for Buffers<T> {}

impl<T> Buffers<T> {
    /// The same pointers as buffers of `U` (for `T` known to be `U`).
    fn cast<U>(self) -> Buffers<U> {
        Buffers {
            out: self.out as *mut U,
            q: self.q as *const U,
            k: self.k as *const U,
            v: self.v as *const U,
        }
    }
}
unsafe impl<T> Sync for Buffers<T> {}

/// One task of the forward: a tile of query rows of one element and head.
#[derive(Clone, Copy, Debug)]
struct Task {
    head: i64,
    /// The element's first query row and first key row (packed), and its keys.
    q_first: i64,
    k_first: i64,
    k_rows: i64,
    /// The tile's first row within the element, and its rows.
    row: i64,
    rows: i64,
}

/// The inputs of [`InputRoundings`]: queries, keys, values, the output's gradient.
const Q: usize = 0;
const K: usize = 1;
const V: usize = 2;
const G: usize = 3;

/// The roundings of a step's input buffers for bf16 products (`Products::Bf16`), made
/// once per step rather than per tile: one per distinct buffer (queries, keys and values
/// of one projection share theirs), by input ([`Q`], [`K`], [`V`], [`G`]).
struct InputRoundings {
    buffers: Vec<std::sync::Arc<RoundedBuffer>>,
    of_input: Vec<Option<usize>>,
}

impl InputRoundings {
    /// The roundings of the `inputs` that `products` reads rounded (each a buffer, its
    /// access and the offsets of its elements' rows: its rows times the access's row
    /// stride), made by `threads` of the team (none for other products).
    ///
    /// # Safety
    /// Each buffer must hold the rows of its offsets.
    unsafe fn new<T: Gemm>(
        products: Products,
        inputs: &[(*const T, &Access, &[i64])],
        threads: usize,
    ) -> Self {
        let mut rounded: Vec<(*const T, usize)> = Vec::new();
        let mut buffers = Vec::new();
        let mut of_input = Vec::with_capacity(inputs.len());
        for &(pointer, access, offsets) in inputs {
            let rows = offsets.last().copied().unwrap_or(0).max(0) as usize;
            let input = (pointer, rows * access.row_stride.max(0) as usize);
            if let Some(at) = rounded.iter().position(|&done| done == input) {
                of_input.push(Some(at));
                continue;
            }
            // SAFETY: the caller vouches for the input.
            match unsafe { T::rounded_buffer(products, input.0, input.1, threads) } {
                Some(buffer) => {
                    rounded.push(input);
                    buffers.push(buffer);
                    of_input.push(Some(buffers.len() - 1));
                }
                None => of_input.push(None),
            }
        }
        Self { buffers, of_input }
    }

    /// The roundings of input `input`, if it has them.
    fn get(&self, input: usize) -> Option<&RoundedBuffer> {
        self.buffers
            .get(self.of_input.get(input).copied().flatten()?)
            .map(|buffer| &**buffer)
    }
}

/// The threads a step's tasks spread over: the team's, or (not `parallel`) one.
fn team_size(parallel: bool) -> usize {
    if parallel {
        crate::Parallelism::current().threads
    } else {
        1
    }
}

/// What each query row of a task has seen so far: the largest score, the sum of
/// `e^(score - largest)`, and whether a masked score was NaN or `+inf`.
struct RowState<T> {
    largest: Vec<T>,
    total: Vec<T>,
    poisoned: Vec<bool>,
}

impl AttentionRun<'_> {
    /// Runs the step on buffers of `T` (out, q, k, v). `out` holds
    /// `sum(Lq) x heads*value_dim` values; the inputs are sized for the offsets (the
    /// executor checked them).
    ///
    /// # Safety
    /// The pointers must be valid for the sizes the offsets and accesses imply.
    pub(crate) unsafe fn run<T: Gemm>(
        &self,
        (out, q, k, v): (*mut u8, *mut u8, *mut u8, *mut u8),
        (q_offsets, k_offsets): (&[i64], &[i64]),
    ) {
        let buffers = Buffers {
            out: out as *mut T,
            q: q as *const T,
            k: k as *const T,
            v: v as *const T,
        };
        let tile = self.tiles.queries.max(1);
        let mut tasks = Vec::new();
        for element in 0..q_offsets.len().saturating_sub(1) {
            let q_first = q_offsets[element];
            let q_rows = q_offsets[element + 1] - q_first;
            let k_first = k_offsets[element];
            let k_rows = k_offsets[element + 1] - k_first;
            for head in 0..self.heads {
                for row in (0..q_rows).step_by(tile as usize) {
                    tasks.push(Task {
                        head,
                        q_first,
                        k_first,
                        k_rows,
                        row,
                        rows: tile.min(q_rows - row),
                    });
                }
            }
        }
        let threads = team_size(self.parallel);
        // SAFETY: the executor sized the buffers for these offsets.
        let rounded = unsafe {
            InputRoundings::new(
                self.products,
                &[
                    (buffers.q, self.q, q_offsets),
                    (buffers.k, self.k, k_offsets),
                    (buffers.v, self.v, k_offsets),
                ],
                threads,
            )
        };
        let widths = (self.head_dim, self.value_dim);
        let on_tiles = TileInputs::of::<T>(self.products, widths, &rounded, false);
        let fused = fused::isa::<T>(self.products, widths);
        crate::team::for_each_chunk(tasks.len(), threads, &|index| {
            // The task's rows and columns are in range of buffers the executor sized;
            // `fused` vouches for f32 and the host.
            crate::vectors::widest(
                #[inline(always)]
                || unsafe {
                    match (on_tiles, fused) {
                        (Some(rounded), _) => self.tile_task(buffers.cast(), tasks[index], rounded),
                        (None, Some(isa)) => self.fused_task(isa, buffers.cast(), tasks[index]),
                        (None, None) => self.task(buffers, tasks[index], &rounded),
                    }
                },
            );
        });
    }

    /// One task: its query rows' outputs for one head.
    #[inline(always)]
    unsafe fn task<T: Gemm>(&self, buffers: Buffers<T>, task: Task, rounded: &InputRoundings) {
        let (d, dv) = (self.head_dim, self.value_dim);
        let out_width = self.heads * dv;
        let rows = task.rows as usize;
        let q_row = task.q_first + task.row;
        unsafe {
            let q = buffers
                .q
                .offset((q_row * self.q.row_stride + self.q.offset + task.head * d) as isize);
            let out = buffers
                .out
                .offset((q_row * out_width + task.head * dv) as isize);
            let out_row = |row: usize| {
                std::slice::from_raw_parts_mut(out.add(row * out_width as usize), dv as usize)
            };
            if task.k_rows == 0 {
                // No keys: libtorch's attention gives 0 (a row without a finite score).
                for row in 0..rows {
                    out_row(row).fill(T::ZERO);
                }
                return;
            }
            // With a causal mask the tile's rows see no key past its last row: those keys
            // are left out where that changes nothing (`leaves_out_keys`).
            let seen = (task.row + rows as i64).clamp(0, task.k_rows);
            let heads = (task.head * d, task.head * dv);
            let q_rows = (q, self.q.row_stride, rows);
            let element = (task.k_first, task.k_rows);
            let k_rows =
                match self.causal && self.leaves_out_keys(buffers, heads, q_rows, element, seen) {
                    true => seen,
                    false => task.k_rows,
                };
            let task = Task { k_rows, ..task };
            let key_tile = self.tiles.keys.max(1).min(task.k_rows);
            let mut scores = vec![T::ZERO; rows * key_tile as usize];
            let mut products = vec![T::ZERO; rows * dv as usize];
            // Per row, the factor its earlier output is multiplied by at this key tile.
            let mut rescale = vec![T::ONE; rows];
            let mut state = RowState {
                largest: vec![T::NEG_INFINITY; rows],
                total: vec![T::ZERO; rows],
                poisoned: vec![false; rows],
            };
            for first_key in (0..task.k_rows).step_by(key_tile as usize) {
                let keys = key_tile.min(task.k_rows - first_key) as usize;
                let key_row = task.k_first + first_key;
                let k = buffers
                    .k
                    .offset((key_row * self.k.row_stride + self.k.offset + task.head * d) as isize);
                let v = buffers.v.offset(
                    (key_row * self.v.row_stride + self.v.offset + task.head * dv) as isize,
                );
                let scores = &mut scores[..rows * keys];
                // S[rows, keys] = scale * Q K^T.
                T::tile_product(
                    self.products,
                    ((rows, d as usize, keys), T::from_f64(self.scale)),
                    ((q, self.q.row_stride as isize, 1), rounded.get(Q)),
                    ((k, 1, self.k.row_stride as isize), rounded.get(K)),
                    (scores.as_mut_ptr(), keys as isize, 1),
                );
                for (row, scores) in scores.chunks_mut(keys).enumerate() {
                    // Keys this row may see: all, or (causal) up to its own position.
                    let visible = if self.causal {
                        (task.row + row as i64 + 1 - first_key).clamp(0, keys as i64) as usize
                    } else {
                        keys
                    };
                    rescale[row] = state.update(row, scores, visible);
                }
                // O = rescale * O + P V (the first tile writes O).
                let first = first_key == 0;
                let target = if first { out } else { products.as_mut_ptr() };
                let target_width = if first { out_width } else { dv };
                T::tile_product(
                    self.products,
                    ((rows, keys, dv as usize), T::ONE),
                    ((scores.as_ptr(), keys as isize, 1), None),
                    ((v, self.v.row_stride as isize, 1), rounded.get(V)),
                    (target, target_width as isize, 1),
                );
                if !first {
                    for (row, product) in products.chunks(dv as usize).enumerate() {
                        let factor = rescale[row];
                        for (value, &added) in out_row(row).iter_mut().zip(product) {
                            *value = *value * factor + added;
                        }
                    }
                }
            }
            for row in 0..rows {
                // A row without a finite score keeps its zero numerators (libtorch
                // gives 0); a masked NaN or +inf makes the row NaN (libtorch masks by
                // adding -inf).
                let total = if state.poisoned[row] {
                    T::NAN
                } else if state.total[row] == T::ZERO {
                    T::ONE
                } else {
                    state.total[row]
                };
                let inverse = T::ONE / total;
                for value in out_row(row) {
                    *value = *value * inverse;
                }
            }
        }
    }

    /// Whether query rows (`q_rows`: the first, the scalars between rows, how many)
    /// may leave out an element's keys from `seen` on, which a causal mask hides from
    /// them: every such key is finite, in the values too, and no masked score can
    /// overflow (else they read them: a masked NaN or infinity makes libtorch's rows
    /// NaN, which reading reproduces). Keys left out have probability 0.
    ///
    /// # Safety
    /// `q` must hold the rows; the buffers the element's `k_rows` keys from `k_first`.
    #[inline(always)]
    unsafe fn leaves_out_keys<T: Scalar>(
        &self,
        buffers: Buffers<T>,
        (key_column, value_column): (i64, i64),
        (q, q_stride, rows): (*const T, i64, usize),
        (k_first, k_rows): (i64, i64),
        seen: i64,
    ) -> bool {
        if seen >= k_rows {
            return true;
        }
        let masked = (k_rows - seen) as usize;
        let (d, dv) = (self.head_dim as usize, self.value_dim as usize);
        let key_row = |buffer: *const T, access: &Access, column: i64| {
            let offset = (k_first + seen) * access.row_stride + access.offset + column;
            buffer.wrapping_offset(offset as isize)
        };
        let keys = key_row(buffers.k, self.k, key_column);
        let values = key_row(buffers.v, self.v, value_column);
        // SAFETY: the query rows, and the element's keys and values from `seen` (the
        // caller vouches).
        unsafe {
            maskable(
                (self.scale, d),
                &[(q, q_stride, (rows, d))],
                &[
                    (keys, self.k.row_stride, (masked, d)),
                    (values, self.v.row_stride, (masked, dv)),
                ],
            )
        }
    }
}

/// Rows of values: the first's pointer, the scalars between rows, and (rows, width).
type Block<T> = (*const T, i64, (usize, usize));

/// Rows of values: the first's pointer and the scalars between rows.
type Rows<T> = (*const T, isize);

/// Whether keys that a causal mask hides from a whole tile of query rows can be left
/// out of the tile's products (their probability is 0 either way): every value of the
/// tile's query-side rows (`tile`: the queries first) and of the hidden keys' rows
/// (`hidden`: the keys first) is finite, and no hidden score `scale q . k` over `width`
/// can come near overflow. Otherwise the tile reads them as libtorch does, where a
/// masked NaN or infinity makes a row NaN and `0 *` one makes a product NaN.
///
/// # Safety
/// Every block must hold its rows.
#[inline(always)]
unsafe fn maskable<T: Scalar>(
    (scale, width): (f64, usize),
    tile: &[Block<T>],
    hidden: &[Block<T>],
) -> bool {
    let mut largest = [T::ZERO; 2];
    for (side, blocks) in [tile, hidden].into_iter().enumerate() {
        for (index, &block) in blocks.iter().enumerate() {
            // SAFETY: as the caller vouches.
            match unsafe { largest_magnitude(block) } {
                None => return false,
                Some(magnitude) if index == 0 => largest[side] = magnitude,
                Some(_) => {}
            }
        }
    }
    let bound = T::from_f64(scale.abs() * width as f64);
    largest[0] * largest[1] * bound < T::from_f64(MASKED_SCORE_BOUND)
}

/// The largest magnitude a masked score may have for its keys to be left out: far below
/// overflow in f32.
const MASKED_SCORE_BOUND: f64 = 1e30;

/// Rows a [`largest_magnitude`] fetches at a time, a block before it reads them.
const MAGNITUDE_ROWS: usize = 8;

/// The largest magnitude of a block's values, `None` if one is NaN or infinite.
///
/// # Safety
/// The block must hold its rows.
#[inline(always)]
unsafe fn largest_magnitude<T: Scalar>((at, stride, (rows, width)): Block<T>) -> Option<T> {
    let ahead = crate::prefetch::Ahead::new((at, stride as isize), (rows, width), true);
    let mut largest = T::ZERO;
    for row in 0..rows {
        if row % MAGNITUDE_ROWS == 0 {
            ahead.fetch(row..row + MAGNITUDE_ROWS);
        }
        // SAFETY: row `row` of the rows the caller vouches for.
        let values =
            unsafe { std::slice::from_raw_parts(at.offset(row as isize * stride as isize), width) };
        let magnitude = crate::scalar::largest_magnitude(values)?;
        if magnitude > largest {
            largest = magnitude;
        }
    }
    Some(largest)
}

impl<T: Scalar> RowState<T> {
    /// Takes in a tile of `row`'s scores, of which the first `visible` are not masked:
    /// replaces them by `e^(score - largest)` (the masked ones by 0) and returns the
    /// factor the row's earlier output must be multiplied by (its largest score grew).
    #[inline(always)]
    fn update(&mut self, row: usize, scores: &mut [T], visible: usize) -> T {
        let (seen, masked) = scores.split_at_mut(visible);
        if masked
            .iter()
            .any(|&score| score.partial_cmp(&T::INFINITY) != Some(std::cmp::Ordering::Less))
        {
            self.poisoned[row] = true;
        }
        masked.fill(T::ZERO);
        let before = self.largest[row];
        let largest = match crate::scalar::max_of(seen) {
            tile if tile > before => tile,
            _ => before,
        };
        if largest == T::NEG_INFINITY {
            // No finite score yet: the numerators are 0, or NaN for a NaN score.
            for score in seen.iter_mut() {
                *score = if score.is_nan() { T::NAN } else { T::ZERO };
            }
            self.total[row] += crate::scalar::sum_of(seen);
            return T::ONE;
        }
        // The first finite scores: no earlier output (and no e^-inf, whose underflow
        // costs a microcode assist per row on Intel hosts).
        let factor = if before == T::NEG_INFINITY {
            T::ZERO
        } else {
            (before - largest).exp()
        };
        let added = T::exp_below(seen, largest);
        self.total[row] = self.total[row] * factor + added;
        self.largest[row] = largest;
        factor
    }
}

/// The shape of one attention-gradient step (queries, keys and values of one width).
pub(crate) struct AttentionGradRun<'a> {
    pub q: &'a Access,
    pub k: &'a Access,
    pub v: &'a Access,
    pub g: &'a Access,
    pub heads: i64,
    pub head_dim: i64,
    pub causal: bool,
    pub scale: f64,
    /// Which gradients, stacked how in the output rows.
    pub outputs: GradOutputs,
    /// Spread the tasks over the team (`crate::team`).
    pub parallel: bool,
    /// Query rows per tile of probabilities ([`Tiles::queries`]; all keys at once).
    pub tiles: Tiles,
    /// The operands of the products.
    pub products: Products,
}

/// Where a gradient goes in its output buffer's rows (in scalars; a head's columns
/// follow at `head * head_dim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placing {
    /// Scalars per row of the buffer.
    pub row: i64,
    /// Where the gradient starts in a row.
    pub at: i64,
}

/// Which gradients a gradient step writes, and where: the queries' in the step's
/// output, the keys' and values' in its output or (cross-attention's both at once) its
/// second output.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GradOutputs {
    /// The queries' gradient, if written.
    pub queries: Option<Placing>,
    /// The keys' gradient, if written, and how many scalars after it in a row the
    /// values' starts.
    pub keys_values: Option<(Placing, i64)>,
}

impl GradOutputs {
    /// The queries' gradient `[Lq, heads, head_dim]`.
    pub(crate) fn queries(width: i64) -> Self {
        Self {
            queries: Some(Placing { row: width, at: 0 }),
            keys_values: None,
        }
    }

    /// The keys' and values' gradients stacked per row, `[Lk, 2, heads, head_dim]`.
    pub(crate) fn keys_values(width: i64) -> Self {
        Self {
            queries: None,
            keys_values: Some((
                Placing {
                    row: 2 * width,
                    at: 0,
                },
                width,
            )),
        }
    }

    /// The three stacked per row, `[L, 3, heads, head_dim]` (self-attention).
    pub(crate) fn all(width: i64) -> Self {
        let row = 3 * width;
        Self {
            queries: Some(Placing { row, at: 0 }),
            keys_values: Some((Placing { row, at: width }, width)),
        }
    }

    /// The queries' gradient and the keys' and values' stacked, each in its own
    /// buffer (cross-attention).
    pub(crate) fn both(width: i64) -> Self {
        Self {
            queries: Self::queries(width).queries,
            keys_values: Self::keys_values(width).keys_values,
        }
    }
}

/// Where one head's keys' and values' gradients of an element go: its first key's
/// gradient, the scalars between key rows, and how many scalars after a key's the
/// values' gradient starts.
#[derive(Clone, Copy)]
struct KeyRows<T> {
    out: *mut T,
    row: i64,
    values_after: i64,
}

/// Pointers of a gradient step; each task writes its own rows and head columns.
#[derive(Clone, Copy)]
struct GradBuffers<T> {
    /// Where the queries' gradient goes.
    out: *mut T,
    /// Where the keys' and values' gradients go (`out` unless the step writes two
    /// buffers).
    keys_out: *mut T,
    q: *const T,
    k: *const T,
    v: *const T,
    g: *const T,
}
unsafe impl<T> Send for GradBuffers<T> {}
unsafe impl<T> Sync for GradBuffers<T> {}

impl<T> GradBuffers<T> {
    /// The same pointers as buffers of `U` (for `T` known to be `U`).
    fn cast<U>(self) -> GradBuffers<U> {
        GradBuffers {
            out: self.out as *mut U,
            keys_out: self.keys_out as *mut U,
            q: self.q as *const U,
            k: self.k as *const U,
            v: self.v as *const U,
            g: self.g as *const U,
        }
    }
}

/// The buffers of a gradient step: its outputs (the queries' gradient's, the keys' and
/// values'; one buffer twice where the step writes one), queries, keys, values and the
/// output's gradient.
pub(crate) type GradPointers = ((*mut u8, *mut u8), *mut u8, *mut u8, *mut u8, *mut u8);

impl AttentionGradRun<'_> {
    /// Runs the step on buffers of `T` (out, q, k, v, g), per element and head:
    /// `P = softmax(scale Q K^T)` again, then `dS = P (dO V^T - rowsum(P dO V^T))`,
    /// `dQ = scale dS K`, `dK = scale dS^T Q`, `dV = P^T dO` (no padding, no `L x L`
    /// buffer across elements).
    ///
    /// # Safety
    /// The pointers must be valid for the sizes the offsets and accesses imply.
    pub(crate) unsafe fn run<T: Gemm>(
        &self,
        ((out, keys_out), q, k, v, g): GradPointers,
        (q_offsets, k_offsets): (&[i64], &[i64]),
    ) {
        let buffers = GradBuffers {
            out: out as *mut T,
            keys_out: keys_out as *mut T,
            q: q as *const T,
            k: k as *const T,
            v: v as *const T,
            g: g as *const T,
        };
        let tasks = self.tasks(q_offsets, k_offsets);
        let threads = team_size(self.parallel);
        // SAFETY: the executor sized the buffers for these offsets.
        let rounded = unsafe {
            InputRoundings::new(
                self.products,
                &[
                    (buffers.q, self.q, q_offsets),
                    (buffers.k, self.k, k_offsets),
                    (buffers.v, self.v, k_offsets),
                    (buffers.g, self.g, q_offsets),
                ],
                threads,
            )
        };
        let widths = (self.head_dim, self.head_dim);
        let on_tiles = TileInputs::of::<T>(self.products, widths, &rounded, true);
        let fused = fused::isa::<T>(self.products, widths);
        crate::team::for_each_chunk(tasks.len(), threads, &|index| {
            let (element, head, row, rows) = tasks[index];
            let keys = (
                k_offsets[element],
                k_offsets[element + 1] - k_offsets[element],
            );
            let queries = (q_offsets[element] + row, rows);
            // The task's rows and columns are in range of buffers the executor sized.
            crate::vectors::widest(
                #[inline(always)]
                || unsafe {
                    match (on_tiles, fused) {
                        (Some(tiles), _) => {
                            let inputs = (buffers.cast(), tiles);
                            self.tile_task(inputs, head, queries, keys, row)
                        }
                        (None, Some(isa)) => {
                            self.fused_element(isa, buffers.cast(), head, queries, keys, row)
                        }
                        (None, None) => self.element((buffers, &rounded), head, queries, keys, row),
                    }
                },
            );
        });
    }

    /// The step's tasks: (element, head, first query row within the element, query
    /// rows). The queries' gradient alone splits an element's rows into tiles of their
    /// own; the keys' sums over every query row, so one task takes them all (the longest
    /// elements first, so that the short ones fill in at the end).
    fn tasks(&self, q_offsets: &[i64], k_offsets: &[i64]) -> Vec<(usize, i64, i64, i64)> {
        let tile = self.tiles.queries.max(1);
        let mut tasks = Vec::new();
        for element in 0..q_offsets.len().saturating_sub(1) {
            let q_rows = q_offsets[element + 1] - q_offsets[element];
            for head in 0..self.heads {
                if self.outputs.keys_values.is_some() {
                    tasks.push((element, head, 0, q_rows));
                } else {
                    for row in (0..q_rows).step_by(tile as usize) {
                        tasks.push((element, head, row, tile.min(q_rows - row)));
                    }
                }
            }
        }
        if self.outputs.keys_values.is_some() {
            let keys = |element: usize| k_offsets[element + 1] - k_offsets[element];
            tasks.sort_by_key(|&(element, _, _, rows)| std::cmp::Reverse(rows * keys(element)));
        }
        tasks
    }

    /// The gradient of query rows `q_first..q_first + q_rows` (from row `row_offset` of
    /// their element, which the causal mask counts from) of one head.
    #[inline(always)]
    unsafe fn element<T: Gemm>(
        &self,
        (buffers, rounded): (GradBuffers<T>, &InputRoundings),
        head: i64,
        (q_first, q_rows): (i64, i64),
        (k_first, k_rows): (i64, i64),
        row_offset: i64,
    ) {
        let d = self.head_dim;
        let (qs, ks) = (q_rows.max(0) as usize, k_rows.max(0) as usize);
        let at = |access: &Access, base: *const T, first: i64| unsafe {
            base.offset((first * access.row_stride + access.offset + head * d) as isize)
        };
        let (q, k, v, g) = (
            at(self.q, buffers.q, q_first),
            at(self.k, buffers.k, k_first),
            at(self.v, buffers.v, k_first),
            at(self.g, buffers.g, q_first),
        );
        if qs == 0 || ks == 0 {
            // No keys, or no queries: the forward gave 0 whatever the queries, and the
            // keys were read by no query.
            unsafe { self.zero_gradient(buffers, head, (q_first, q_rows), (k_first, k_rows)) };
            return;
        }
        // Query rows a tile at a time: each row's softmax spans all keys, so a tile of
        // probabilities is `tile x keys` (never `L x L`). The queries' gradient rows of
        // a tile are its own; the keys' and values' gradients sum over the tiles.
        let tile = (self.tiles.queries.max(1) as usize).min(qs);
        let mut probabilities = vec![T::ZERO; tile * ks];
        let mut slopes = vec![T::ZERO; tile * ks];
        let outputs = self.outputs;
        let mut partial = if outputs.keys_values.is_some() && qs > tile {
            vec![T::ZERO; 2 * ks * d as usize]
        } else {
            Vec::new()
        };
        let scale = T::from_f64(self.scale);
        // With a causal mask a tile sees no key past its last row (`seen_keys`), and the
        // tiles go last first, so that the tile writing the keys' gradients (the first)
        // sees the most keys.
        let tiles = qs.div_ceil(tile);
        let order = (0..tiles).map(|index| match self.causal {
            true => (tiles - 1 - index) * tile,
            false => index * tile,
        });
        for (index, first) in order.enumerate() {
            let rows = tile.min(qs - first);
            let line = |at: *const T, stride: i64| {
                (
                    at.wrapping_offset(first as isize * stride as isize),
                    stride as isize,
                )
            };
            let tile_rows = (line(q, self.q.row_stride), line(g, self.g.row_stride));
            let element_keys = (
                (k, self.k.row_stride as isize),
                (v, self.v.row_stride as isize),
            );
            let seen = (row_offset.max(0) as usize + first + rows).min(ks);
            // SAFETY: the tile's rows and the element's keys (the caller vouches).
            let leave_out = self.causal
                && seen < ks
                && unsafe { self.leaves_out((tile_rows, rows), element_keys, seen..ks) };
            let seen = if leave_out { seen } else { ks };
            let (probabilities, slopes) = (
                &mut probabilities[..rows * seen],
                &mut slopes[..rows * seen],
            );
            let (q, g) = (tile_rows.0 .0, tile_rows.1 .0);
            unsafe {
                // P = softmax(scale Q K^T), row by row, future keys masked.
                T::tile_product(
                    self.products,
                    ((rows, d as usize, seen), scale),
                    ((q, self.q.row_stride as isize, 1), rounded.get(Q)),
                    ((k, 1, self.k.row_stride as isize), rounded.get(K)),
                    (probabilities.as_mut_ptr(), seen as isize, 1),
                );
                // dP = dO V^T.
                T::tile_product(
                    self.products,
                    ((rows, d as usize, seen), T::ONE),
                    ((g, self.g.row_stride as isize, 1), rounded.get(G)),
                    ((v, 1, self.v.row_stride as isize), rounded.get(V)),
                    (slopes.as_mut_ptr(), seen as isize, 1),
                );
            }
            self.softmax_slopes(
                (probabilities, slopes),
                seen,
                row_offset.max(0) as usize + first,
            );
            unsafe {
                if let Some(key_rows) = self.key_rows(buffers, k_first, head) {
                    // dK = scale dS^T Q; dV = P^T dO: written by the first tile, added
                    // up from `partial` after the others.
                    if index == 0 && seen < ks {
                        // Keys no query row sees: no gradient.
                        self.zero_keys(key_rows, seen..ks);
                    }
                    let used = (2 * seen * d as usize).min(partial.len());
                    let partial = &mut partial[..used];
                    self.key_gradients(
                        (key_rows, partial, index == 0),
                        rounded,
                        (probabilities, slopes),
                        (q, g),
                        (rows, seen),
                    );
                }
                if let Some(queries) = outputs.queries {
                    // dQ = scale dS K.
                    let row = q_first + first as i64;
                    let out_q = buffers
                        .out
                        .offset((row * queries.row + queries.at + head * d) as isize);
                    T::tile_product(
                        self.products,
                        ((rows, seen, d as usize), scale),
                        ((slopes.as_ptr(), seen as isize, 1), None),
                        ((k, self.k.row_stride as isize, 1), rounded.get(K)),
                        (out_q, queries.row as isize, 1),
                    );
                }
            }
        }
    }

    /// Whether query rows may leave out the keys past their last row that a causal mask
    /// hides from them, `hidden` of the element's keys at most (`maskable`: the rows'
    /// queries and output gradients and the hidden keys and values finite, no hidden
    /// score near overflow). `tile` is the rows' queries and output gradients (first
    /// row, scalars between rows; `rows` of them), `keys` the element's keys and values.
    ///
    /// # Safety
    /// The pointers must hold the tile's rows and the element's keys up to `hidden`'s
    /// end.
    #[inline(always)]
    unsafe fn leaves_out<T: Scalar>(
        &self,
        (tile, rows): ((Rows<T>, Rows<T>), usize),
        keys: (Rows<T>, Rows<T>),
        hidden: std::ops::Range<usize>,
    ) -> bool {
        let d = self.head_dim as usize;
        let block = |(at, stride): Rows<T>, (first, count): (usize, usize)| {
            let at = at.wrapping_offset(first as isize * stride);
            (at, stride as i64, (count, d))
        };
        let (tile_rows, hidden_rows) = ((0, rows), (hidden.start, hidden.len()));
        // SAFETY: as the caller vouches.
        unsafe {
            maskable(
                (self.scale, d),
                &[block(tile.0, tile_rows), block(tile.1, tile_rows)],
                &[block(keys.0, hidden_rows), block(keys.1, hidden_rows)],
            )
        }
    }

    /// Where the keys' and values' gradients of an element's keys from row `k_first`
    /// go for `head`, if the step writes them.
    fn key_rows<T>(&self, buffers: GradBuffers<T>, k_first: i64, head: i64) -> Option<KeyRows<T>> {
        let (keys, values_after) = self.outputs.keys_values?;
        let first = k_first * keys.row + keys.at + head * self.head_dim;
        Some(KeyRows {
            out: buffers.keys_out.wrapping_offset(first as isize),
            row: keys.row,
            values_after,
        })
    }

    /// Zeros the keys' and values' gradient rows `keys` of an element.
    ///
    /// # Safety
    /// `key_rows` must hold the element's key rows.
    unsafe fn zero_keys<T: Scalar>(&self, key_rows: KeyRows<T>, keys: std::ops::Range<usize>) {
        let d = self.head_dim;
        for key in keys {
            for at in [0, key_rows.values_after] {
                let offset = key as i64 * key_rows.row + at;
                // SAFETY: row `key` of the element's keys (the caller vouches).
                unsafe {
                    std::slice::from_raw_parts_mut(key_rows.out.offset(offset as isize), d as usize)
                }
                .fill(T::ZERO);
            }
        }
    }

    /// Zeros the task's gradient rows: the queries' (when there are no keys) or the
    /// keys' and values' (when there are no queries).
    ///
    /// # Safety
    /// The rows must be in range of the output buffer.
    unsafe fn zero_gradient<T: Gemm>(
        &self,
        buffers: GradBuffers<T>,
        head: i64,
        (q_first, q_rows): (i64, i64),
        (k_first, k_rows): (i64, i64),
    ) {
        let d = self.head_dim;
        let outputs = self.outputs;
        if let Some(queries) = outputs.queries.filter(|_| k_rows <= 0) {
            for row in q_first..q_first + q_rows {
                let offset = row * queries.row + queries.at + head * d;
                let out = unsafe { buffers.out.offset(offset as isize) };
                unsafe { std::slice::from_raw_parts_mut(out, d as usize) }.fill(T::ZERO);
            }
        }
        if let Some(key_rows) = self.key_rows(buffers, k_first, head) {
            // SAFETY: the element's key rows (the caller vouches).
            unsafe { self.zero_keys(key_rows, 0..k_rows.max(0) as usize) };
        }
    }

    /// Turns a tile's scores into probabilities `P` (softmax over the keys each row
    /// sees: with a causal mask, up to its own position, `first_row` + its index) and
    /// its `dP` into `dS = P (dP - rowsum(P dP))`, zero where `P` is.
    #[inline(always)]
    fn softmax_slopes<T: Gemm>(
        &self,
        (probabilities, slopes): (&mut [T], &mut [T]),
        ks: usize,
        first_row: usize,
    ) {
        for (row, (scores, slope)) in probabilities
            .chunks_mut(ks)
            .zip(slopes.chunks_mut(ks))
            .enumerate()
        {
            let limit = if self.causal {
                (first_row + row + 1).min(ks)
            } else {
                ks
            };
            let total = T::softmax_numerators(&mut scores[..limit]);
            let inverse = T::ONE / total;
            for p in &mut scores[..limit] {
                *p = *p * inverse;
            }
            let dot = crate::scalar::dot_of(&scores[..limit], &slope[..limit]);
            for score in &mut scores[limit..] {
                *score = T::ZERO;
            }
            for (s, &p) in slope.iter_mut().zip(scores.iter()) {
                *s = p * (*s - dot);
            }
        }
    }

    /// A tile's share of `dK = scale dS^T Q` and `dV = P^T dO`, into `key_rows` for the
    /// first tile, else summed in `partial` and added.
    ///
    /// # Safety
    /// `key_rows` must hold the element's `ks` key rows; `q` and `g` the tile's `rows`.
    #[inline(always)]
    unsafe fn key_gradients<T: Gemm>(
        &self,
        (key_rows, partial, first_tile): (KeyRows<T>, &mut [T], bool),
        rounded: &InputRoundings,
        (probabilities, slopes): (&[T], &[T]),
        (q, g): (*const T, *const T),
        (rows, ks): (usize, usize),
    ) {
        let d = self.head_dim;
        let KeyRows {
            out: out_k,
            row,
            values_after,
        } = key_rows;
        let scale = T::from_f64(self.scale);
        let (target, stride) = if first_tile {
            (out_k, row as isize)
        } else {
            (partial.as_mut_ptr(), 2 * d as isize)
        };
        let half = if first_tile { values_after } else { d };
        // The caller vouches for the rows; `partial` holds `ks` rows of `2 d`.
        unsafe {
            T::tile_product(
                self.products,
                ((ks, rows, d as usize), scale),
                ((slopes.as_ptr(), 1, ks as isize), None),
                ((q, self.q.row_stride as isize, 1), rounded.get(Q)),
                (target, stride, 1),
            );
            T::tile_product(
                self.products,
                ((ks, rows, d as usize), T::ONE),
                ((probabilities.as_ptr(), 1, ks as isize), None),
                ((g, self.g.row_stride as isize, 1), rounded.get(G)),
                (target.offset(half as isize), stride, 1),
            );
        }
        if first_tile {
            return;
        }
        for (key, sums) in partial.chunks(2 * d as usize).enumerate() {
            for (part, sums) in sums.chunks(d as usize).enumerate() {
                let offset = key as i64 * row + part as i64 * values_after;
                let row = unsafe {
                    std::slice::from_raw_parts_mut(out_k.offset(offset as isize), d as usize)
                };
                for (value, &added) in row.iter_mut().zip(sums) {
                    *value += added;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    //! The attention kernel template (what the CUDA backend runs) generated for the
    //! host and compared with this module's attention, which the equivalence tests check
    //! against libtorch: the same numbers (online vs two-pass softmax: to rounding) and
    //! the same NaN, infinity and empty-element behaviour.

    use super::*;
    use nestor_passes::step::AttentionPart;
    use nestor_passes::Step;
    use proptest::prelude::*;

    const HEADS: i64 = 2;
    const HEAD_DIM: i64 = 3;
    const VALUE_DIM: i64 = 4;

    fn offsets(lengths: &[i64]) -> Vec<i64> {
        std::iter::once(0)
            .chain(lengths.iter().scan(0, |total, length| {
                *total += length;
                Some(*total)
            }))
            .collect()
    }

    /// Runs both on q `[sum Lq, H*D]`, k `[sum Lk, H*D]`, v `[sum Lk, H*Dv]`, the host's
    /// in `tiles`.
    fn both(
        (q_lengths, k_lengths): (&[i64], &[i64]),
        (q, k, v): (&[f32], &[f32], &[f32]),
        causal: bool,
        tiles: Tiles,
    ) -> (Vec<f32>, Vec<f32>) {
        let width = HEADS * HEAD_DIM;
        let (q_access, k_access) = (
            Access::rows(nestor_passes::Slot(1), width),
            Access::rows(nestor_passes::Slot(2), width),
        );
        let v_access = Access::rows(nestor_passes::Slot(3), HEADS * VALUE_DIM);
        let (q_offsets, k_offsets) = (offsets(q_lengths), offsets(k_lengths));
        let rows = *q_offsets.last().unwrap_or(&0);
        let size = (rows * HEADS * VALUE_DIM) as usize;
        let scale = 1.0 / (HEAD_DIM as f64).sqrt();
        let host = AttentionRun {
            products: Products::Float,
            q: &q_access,
            k: &k_access,
            v: &v_access,
            heads: HEADS,
            head_dim: HEAD_DIM,
            value_dim: VALUE_DIM,
            causal,
            scale,
            parallel: false,
            tiles,
        };
        let mut expected = vec![f32::from_bits(0x7fc0_0001); size];
        let pointer = |values: &[f32]| values.as_ptr() as *mut u8;
        unsafe {
            host.run::<f32>(
                (
                    expected.as_mut_ptr() as *mut u8,
                    pointer(q),
                    pointer(k),
                    pointer(v),
                ),
                (&q_offsets, &k_offsets),
            )
        };
        let step = Step::Attention(nestor_passes::step::Attention {
            out: nestor_passes::Slot(0),
            q: q_access,
            k: k_access,
            v: v_access,
            q_lengths: nestor_passes::Slot(4),
            k_lengths: nestor_passes::Slot(5),
            heads: HEADS,
            head_dim: HEAD_DIM,
            value_dim: VALUE_DIM,
            causal,
            scale: nestor_ir::F64(scale),
        });
        let elements = crate::testing::row_elements(q_lengths);
        let mut actual = vec![f32::from_bits(0x7fc0_0001); size];
        let args = [
            actual.as_mut_ptr() as *mut u8,
            pointer(q),
            pointer(k),
            pointer(v),
            q_offsets.as_ptr() as *mut u8,
            k_offsets.as_ptr() as *mut u8,
            elements.as_ptr() as *mut u8,
        ];
        // The kernel reads the buffers above, sized for these offsets, and writes the
        // rows x heads x value_dim values of `actual`.
        unsafe { crate::testing::run_template(step, &args, rows * HEADS) };
        (actual, expected)
    }

    fn value() -> impl Strategy<Value = f32> {
        prop_oneof![
            20 => -3.0f32..3.0,
            1 => Just(f32::NAN),
            1 => Just(f32::INFINITY),
            1 => Just(f32::NEG_INFINITY),
        ]
    }

    fn case() -> impl Strategy<Value = (Vec<i64>, Vec<i64>, Vec<f32>, bool)> {
        (1usize..4, any::<bool>(), any::<bool>()).prop_flat_map(|(batch, cross, specials)| {
            let lengths = proptest::collection::vec(0i64..5, batch);
            (lengths.clone(), lengths, Just(cross), Just(specials)).prop_flat_map(
                move |(q_lengths, other, cross, specials)| {
                    let k_lengths = if cross { other } else { q_lengths.clone() };
                    let count = ((q_lengths.iter().sum::<i64>()
                        + 2 * k_lengths.iter().sum::<i64>())
                        * HEADS
                        * VALUE_DIM.max(HEAD_DIM)) as usize;
                    let values = if specials {
                        proptest::collection::vec(value(), count).boxed()
                    } else {
                        proptest::collection::vec(-3.0f32..3.0, count).boxed()
                    };
                    (Just(q_lengths), Just(k_lengths), values, any::<bool>())
                },
            )
        })
    }

    proptest! {
        #[test]
        fn the_attention_template_equals_the_host_attention(
            (q_lengths, k_lengths, values, causal) in case(),
            (queries, keys) in (1i64..4, 1i64..4),
            small in any::<bool>(),
        ) {
            // Small tiles walk the multi-tile paths (rescaling, causal tiles past a
            // row's keys) on these short elements.
            let tiles = if small { Tiles { queries, keys } } else { Tiles::DEFAULT };
            let q_size = (q_lengths.iter().sum::<i64>() * HEADS * HEAD_DIM) as usize;
            let k_size = (k_lengths.iter().sum::<i64>() * HEADS * HEAD_DIM) as usize;
            let v_size = (k_lengths.iter().sum::<i64>() * HEADS * VALUE_DIM) as usize;
            let (q, rest) = values.split_at(q_size);
            let (k, rest) = rest.split_at(k_size);
            let v = &rest[..v_size];
            let (actual, expected) = both((&q_lengths, &k_lengths), (q, k, v), causal, tiles);
            for (index, (a, e)) in actual.iter().zip(&expected).enumerate() {
                let close = (a.is_nan() && e.is_nan())
                    || a == e
                    || (a - e).abs() <= 1e-5 * (1.0 + e.abs());
                prop_assert!(close, "value {index}: template {a} vs host {e} (causal {causal}, lengths {q_lengths:?} / {k_lengths:?}, {tiles:?})");
            }
        }
    }

    /// The host's attention gradient and the template's (keys' or queries'; with
    /// `saved`, reading the statistics the template of the statistics wrote), on finite
    /// values.
    fn gradients(
        (q_lengths, k_lengths): (&[i64], &[i64]),
        (q, k, v, g): (&[f32], &[f32], &[f32], &[f32]),
        (causal, keys, saved): (bool, bool, bool),
        tiles: Tiles,
    ) -> (Vec<f32>, Vec<f32>) {
        let width = HEADS * HEAD_DIM;
        let slot = nestor_passes::Slot;
        let accesses = [1, 2, 3, 4].map(|index| Access::rows(slot(index), width));
        let (q_offsets, k_offsets) = (offsets(q_lengths), offsets(k_lengths));
        let (rows, lengths) = if keys {
            (*k_offsets.last().unwrap_or(&0), k_lengths)
        } else {
            (*q_offsets.last().unwrap_or(&0), q_lengths)
        };
        let outputs = if keys {
            GradOutputs::keys_values(width)
        } else {
            GradOutputs::queries(width)
        };
        let size = (rows * (1 + usize::from(keys)) as i64 * width) as usize;
        let scale = 0.7;
        let inputs = (q, k, v, g);
        let (queries, keys_values) =
            host_gradient((q_lengths, k_lengths), inputs, (causal, tiles), outputs);
        let expected = if keys { keys_values } else { queries };
        let pointer = |values: &[f32]| values.as_ptr() as *mut u8;
        let [qa, ka, va, ga] = accesses;
        let step = |part, statistics| {
            Step::AttentionGrad(nestor_passes::step::AttentionGrad {
                out: slot(0),
                q: qa,
                k: ka,
                v: va,
                g: ga,
                q_lengths: slot(5),
                k_lengths: slot(6),
                heads: HEADS,
                head_dim: HEAD_DIM,
                causal,
                scale: nestor_ir::F64(scale),
                part,
                statistics,
                keys_values_out: None,
            })
        };
        let q_rows = *q_offsets.last().unwrap_or(&0);
        let width_of_statistics = AttentionPart::STATISTICS_WIDTH;
        let mut statistics = vec![f32::NAN; (q_rows * HEADS * width_of_statistics) as usize];
        let absent = std::ptr::null_mut();
        if saved {
            let elements = crate::testing::row_elements(q_lengths);
            let args = [
                statistics.as_mut_ptr() as *mut u8,
                pointer(q),
                pointer(k),
                pointer(v),
                pointer(g),
                absent,
                q_offsets.as_ptr() as *mut u8,
                k_offsets.as_ptr() as *mut u8,
                elements.as_ptr() as *mut u8,
            ];
            // `statistics` holds a head's statistics per query row and head.
            let statistics_step = step(AttentionPart::Statistics, None);
            unsafe { crate::testing::run_template(statistics_step, &args, q_rows * HEADS) };
        }
        let part = if keys {
            AttentionPart::KeysValues
        } else {
            AttentionPart::Queries
        };
        let gradient_step = step(part, saved.then_some(slot(7)));
        let elements = crate::testing::row_elements(lengths);
        let mut actual = vec![f32::NAN; size];
        let args = [
            actual.as_mut_ptr() as *mut u8,
            pointer(q),
            pointer(k),
            pointer(v),
            pointer(g),
            if saved {
                statistics.as_mut_ptr() as *mut u8
            } else {
                absent
            },
            q_offsets.as_ptr() as *mut u8,
            k_offsets.as_ptr() as *mut u8,
            elements.as_ptr() as *mut u8,
        ];
        // The buffers hold the rows of these offsets; `actual` the gradient's rows.
        unsafe { crate::testing::run_template(gradient_step, &args, rows * HEADS) };
        (actual, expected)
    }

    /// Buffers for the gradients `outputs` writes, filled with `fill`: the queries' (`q_rows`
    /// rows) and the keys' and values' (`k_rows`); self-attention's three in the first
    /// alone (the second empty).
    fn output_buffers(
        outputs: GradOutputs,
        (q_rows, k_rows): (i64, i64),
        fill: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let buffer = |rows: i64, placing: Option<Placing>| {
            vec![fill; placing.map_or(0, |placing| (rows * placing.row) as usize)]
        };
        let keys = outputs.keys_values.map(|(keys, _)| keys);
        match outputs.queries {
            Some(queries) if keys.is_some_and(|keys| keys.row == queries.row) => {
                (buffer(q_rows.max(k_rows), keys), Vec::new())
            }
            queries => (buffer(q_rows, queries), buffer(k_rows, keys)),
        }
    }

    /// The output pointers of `buffers` ([`output_buffers`]): one buffer twice where the
    /// second is empty.
    fn output_pointers((first, second): &mut (Vec<f32>, Vec<f32>)) -> (*mut u8, *mut u8) {
        let first = first.as_mut_ptr() as *mut u8;
        match second.is_empty() {
            true => (first, first),
            false => (first, second.as_mut_ptr() as *mut u8),
        }
    }

    /// The host's attention gradient (scale 0.7) written as `outputs` says
    /// ([`output_buffers`]).
    fn host_gradient(
        (q_lengths, k_lengths): (&[i64], &[i64]),
        (q, k, v, g): (&[f32], &[f32], &[f32], &[f32]),
        (causal, tiles): (bool, Tiles),
        outputs: GradOutputs,
    ) -> (Vec<f32>, Vec<f32>) {
        let width = HEADS * HEAD_DIM;
        let accesses = [1, 2, 3, 4].map(|index| Access::rows(nestor_passes::Slot(index), width));
        let (q_offsets, k_offsets) = (offsets(q_lengths), offsets(k_lengths));
        let rows = (
            *q_offsets.last().unwrap_or(&0),
            *k_offsets.last().unwrap_or(&0),
        );
        let host = AttentionGradRun {
            products: Products::Float,
            q: &accesses[0],
            k: &accesses[1],
            v: &accesses[2],
            g: &accesses[3],
            heads: HEADS,
            head_dim: HEAD_DIM,
            causal,
            scale: 0.7,
            outputs,
            parallel: true,
            tiles,
        };
        let pointer = |values: &[f32]| values.as_ptr() as *mut u8;
        let mut out = output_buffers(outputs, rows, f32::NAN);
        // The buffers hold the rows of the offsets; `out` the outputs' rows.
        unsafe {
            host.run::<f32>(
                (
                    output_pointers(&mut out),
                    pointer(q),
                    pointer(k),
                    pointer(v),
                    pointer(g),
                ),
                (&q_offsets, &k_offsets),
            )
        };
        out
    }

    /// Queries, keys, values and output gradients (`[rows, HEADS * HEAD_DIM]`) of
    /// `q_lengths` / `k_lengths`, from `values` over and over, a NaN or infinity as 0.5
    /// (finite values only: the gradients' NaN semantics are not specified).
    fn finite_inputs(values: &[f32], (q_lengths, k_lengths): (&[i64], &[i64])) -> [Vec<f32>; 4] {
        let size = |lengths: &[i64]| (lengths.iter().sum::<i64>() * HEADS * HEAD_DIM) as usize;
        let (queries, keys) = (size(q_lengths), size(k_lengths));
        let mut finite = values
            .iter()
            .map(|value| if value.is_finite() { *value } else { 0.5 })
            .cycle();
        [queries, keys, keys, queries].map(|size| finite.by_ref().take(size).collect())
    }

    proptest! {
        /// Self-attention's three gradients at once are, bit for bit, the queries'
        /// and the keys' and values' computed apart, stacked per row.
        #[test]
        fn all_three_gradients_are_the_two_parts_stacked(
            (lengths, _, values, causal) in case(),
            queries in 1i64..4,
            small in any::<bool>(),
        ) {
            let tiles = if small { Tiles { queries, keys: 1 } } else { Tiles::DEFAULT };
            let width = HEADS * HEAD_DIM;
            let rows = lengths.iter().sum::<i64>() as usize;
            let [q, k, v, g] = finite_inputs(&values, (&lengths, &lengths));
            let run = |outputs| host_gradient((&lengths, &lengths), (&q[..], &k[..], &v[..], &g[..]), (causal, tiles), outputs);
            let (all, queries, keys_values) = (
                run(GradOutputs::all(width)).0,
                run(GradOutputs::queries(width)).0,
                run(GradOutputs::keys_values(width)).1,
            );
            let w = width as usize;
            for row in 0..rows {
                let stacked = &all[row * 3 * w..(row + 1) * 3 * w];
                let apart = [&queries[row * w..(row + 1) * w], &keys_values[row * 2 * w..(row + 1) * 2 * w]].concat();
                let bits = |values: &[f32]| values.iter().map(|value| value.to_bits()).collect::<Vec<_>>();
                prop_assert_eq!(bits(stacked), bits(&apart), "row {} (lengths {:?}, causal {}, {:?})", row, &lengths, causal, tiles);
            }
        }

        /// Cross-attention's two gradients at once, each in its own buffer, are bit for
        /// bit the queries' and the keys' and values' computed apart.
        #[test]
        fn both_gradients_at_once_are_the_two_parts_apart(
            (q_lengths, k_lengths, values, causal) in case(),
            queries in 1i64..4,
            small in any::<bool>(),
        ) {
            let tiles = if small { Tiles { queries, keys: 1 } } else { Tiles::DEFAULT };
            let [q, k, v, g] = finite_inputs(&values, (&q_lengths, &k_lengths));
            let run = |outputs| host_gradient((&q_lengths, &k_lengths), (&q[..], &k[..], &v[..], &g[..]), (causal, tiles), outputs);
            let width = HEADS * HEAD_DIM;
            let (both, queries, keys_values) = (
                run(GradOutputs::both(width)),
                run(GradOutputs::queries(width)).0,
                run(GradOutputs::keys_values(width)).1,
            );
            let bits = |values: &[f32]| values.iter().map(|value| value.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(bits(&both.0), bits(&queries), "queries (lengths {:?} / {:?}, causal {}, {:?})", &q_lengths, &k_lengths, causal, tiles);
            prop_assert_eq!(bits(&both.1), bits(&keys_values), "keys and values (lengths {:?} / {:?}, causal {}, {:?})", &q_lengths, &k_lengths, causal, tiles);
        }

        #[test]
        fn the_attention_gradient_template_equals_the_host_gradient(
            (q_lengths, k_lengths, values, causal) in case(),
            keys in any::<bool>(),
            saved in any::<bool>(),
            queries in 1i64..4,
            small in any::<bool>(),
        ) {
            let tiles = if small { Tiles { queries, keys: 1 } } else { Tiles::DEFAULT };
            let [q, k, v, g] = finite_inputs(&values, (&q_lengths, &k_lengths));
            let (actual, expected) = gradients((&q_lengths, &k_lengths), (&q[..], &k[..], &v[..], &g[..]), (causal, keys, saved), tiles);
            for (index, (a, e)) in actual.iter().zip(&expected).enumerate() {
                prop_assert!(
                    (a - e).abs() <= 1e-4 * (1.0 + e.abs()),
                    "value {index}: template {a} vs host {e} (causal {causal}, keys {keys}, saved {saved}, lengths {q_lengths:?} / {k_lengths:?}, {tiles:?})"
                );
            }
        }
    }

    /// The memory check counts what a task on AMX tiles holds (every key at once), not
    /// only a tile of scores: a long element's keys and values, with overflow a `None`.
    #[test]
    fn forward_scalars_count_the_tiles_scratch() {
        let tiles = Tiles::DEFAULT;
        let long = tiles.forward_scalars((1, 100_000), (64, 64)).unwrap_or(0);
        assert!(long >= 100_000 * 128, "{long} scalars for 100000 keys");
        let short = tiles.forward_scalars((128, 256), (64, 64)).unwrap_or(0);
        assert!(short >= 128 * (256 + 64), "{short} scalars for a full tile");
        assert_eq!(tiles.forward_scalars((1, i64::MAX), (64, 64)), None);
    }

    #[test]
    fn gradient_scalars_count_the_tiles_scratch() {
        let tiles = Tiles::DEFAULT;
        // On tiles: three panels of the keys and values, and `P` and `dS` by pairs of
        // the chunk's rows (one row, padded to 32).
        let long = tiles.gradient_scalars((1, 100_000), 64).unwrap_or(0);
        assert!(
            long >= 100_000 * (3 * 64 + 2 * 32),
            "{long} scalars for 100000 keys"
        );
        let tiled = tiles.gradient_scalars((1000, 256), 64).unwrap_or(0);
        assert!(
            tiled >= 128 * 256 * 2 + 256 * 64 * 2,
            "{tiled} scalars for 256 keys"
        );
        assert_eq!(tiles.gradient_scalars((1, i64::MAX), 64), None);
    }

    /// The forward's tasks as `run` makes them (tiles of `Tiles::DEFAULT` query rows).
    fn forward_tasks(q_offsets: &[i64], k_offsets: &[i64], heads: i64) -> Vec<Task> {
        let tile = Tiles::DEFAULT.queries;
        let mut tasks = Vec::new();
        for element in 0..q_offsets.len() - 1 {
            let q_rows = q_offsets[element + 1] - q_offsets[element];
            for head in 0..heads {
                for row in (0..q_rows).step_by(tile as usize) {
                    tasks.push(Task {
                        head,
                        q_first: q_offsets[element],
                        k_first: k_offsets[element],
                        k_rows: k_offsets[element + 1] - k_offsets[element],
                        row,
                        rows: tile.min(q_rows - row),
                    });
                }
            }
        }
        tasks
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The forward on AMX tiles equals the tiled forward on the same bf16 roundings
        /// (f32 products of them): elements of 0, 1 and up to 40 rows (blocks of 16 query
        /// rows, keys past 32), heads of 1 to 65 columns, causal or not, cross lengths,
        /// NaN and infinities. Skipped on hosts without AMX.
        #[test]
        fn the_forward_on_amx_tiles_equals_the_tiled_forward(
            lengths in proptest::collection::vec((0i64..40, 0i64..40), 1..4),
            (heads, head_dim, value_dim) in (1i64..3, prop_oneof![1i64..4, Just(32), Just(64), Just(65)], prop_oneof![1i64..5, Just(16), Just(17), Just(64)]),
            (causal, cross, specials, seed) in (any::<bool>(), any::<bool>(), any::<bool>(), any::<u64>()),
        ) {
            if !crate::amx::usable() {
                eprintln!("skipped: this host has no AMX tiles");
                return Ok(());
            }
            let ((q_offsets, k_offsets), (q_rows, k_rows)) = drawn_offsets(&lengths, cross);
            let mut value = seeded(seed, 3.0, specials);
            let (width, value_width) = (heads * head_dim, heads * value_dim);
            let (q, k, v) = (drawn(&mut value, q_rows, width), drawn(&mut value, k_rows, width), drawn(&mut value, k_rows, value_width));
            let accesses = slot_rows([width, width, value_width]);
            let run = drawn_forward(&accesses, (heads, head_dim, value_dim), (causal, Products::Bf16));
            let size = (q_rows * value_width) as usize;
            // The tiled forward: the roundings as f32 (this test process has no MKL).
            let mut expected = vec![f32::from_bits(0x7fc0_0001); size];
            let pointer = |values: &[f32]| values.as_ptr() as *mut u8;
            unsafe {
                run.run::<f32>(
                    (expected.as_mut_ptr() as *mut u8, pointer(&q), pointer(&k), pointer(&v)),
                    (&q_offsets, &k_offsets),
                )
            };
            let rounded = |values: &[f32]| unsafe { RoundedBuffer::as_bf16(values.as_ptr(), values.len()) };
            let (q_rounded, k_rounded, v_rounded) = (rounded(&q), rounded(&k), rounded(&v));
            let inputs = TileInputs::new((&q_rounded, &k_rounded, &v_rounded), None);
            let mut actual = vec![f32::from_bits(0x7fc0_0001); size];
            let buffers = Buffers { out: actual.as_mut_ptr(), q: q.as_ptr(), k: k.as_ptr(), v: v.as_ptr() };
            // Scratch poisoned with bf16 NaNs: a slot read but not written shows.
            tiles::TILE_SCRATCH.with_borrow_mut(|scratch| {
                let most = 1 << 14;
                scratch.keys_t.poison(most);
                scratch.values.poison(most);
                scratch.queries.clear();
                scratch.queries.resize(most, 0xffc0);
                scratch.probabilities.clear();
                scratch.probabilities.resize(most, 0xffc0);
            });
            for task in forward_tasks(&q_offsets, &k_offsets, heads) {
                crate::vectors::widest(|| unsafe { run.tile_task(buffers, task, inputs) });
            }
            for (index, (&got, &want)) in actual.iter().zip(&expected).enumerate() {
                let close = (got - want).abs() <= 2e-2 || (got.is_nan() && want.is_nan()) || got == want;
                prop_assert!(close, "output {index}: {got} on tiles, {want} tiled");
            }
        }

        /// The gradient on AMX tiles equals the tiled gradient on the same bf16
        /// roundings (f32 products of them): elements of 0, 1 and up to 40 rows, chunks
        /// of 1 to 40 query rows (the keys' gradients summed over several), heads of 1 to
        /// 65 columns, causal or not, cross lengths, each part of the outputs alone, all
        /// three and both parts in two buffers, scores large enough that most probabilities underflow. Skipped on
        /// hosts without AMX.
        #[test]
        fn the_gradient_on_amx_tiles_equals_the_tiled_gradient(
            lengths in proptest::collection::vec((0i64..40, 0i64..40), 1..4),
            (heads, head_dim) in (1i64..3, prop_oneof![1i64..4, Just(16), Just(32), Just(64), Just(65)]),
            (causal, cross, part, chunk) in (any::<bool>(), any::<bool>(), 0usize..4, prop_oneof![Just(128i64), 1i64..40]),
            (spread, seed) in (prop_oneof![Just(3.0f32), Just(40.0)], any::<u64>()),
        ) {
            if !crate::amx::usable() {
                eprintln!("skipped: this host has no AMX tiles");
                return Ok(());
            }
            let ((q_offsets, k_offsets), (q_rows, k_rows)) = drawn_offsets(&lengths, cross);
            let mut value = seeded(seed, spread, false);
            let width = heads * head_dim;
            let [q, k, v, g] = [q_rows, k_rows, k_rows, q_rows].map(|rows| drawn(&mut value, rows, width));
            let accesses = slot_rows([width; 4]);
            let run = drawn_gradient(&accesses, (heads, head_dim), (causal, part, chunk), Products::Bf16);
            let outputs = run.outputs;
            if cross && outputs == GradOutputs::all(width) {
                // Self-attention's layout only.
                return Ok(());
            }
            let pointer = |values: &[f32]| values.as_ptr() as *mut u8;
            let poisoned = f32::from_bits(0x7fc0_0001);
            // The tiled gradient: the roundings as f32 (this test process has no MKL).
            let mut expected = output_buffers(outputs, (q_rows, k_rows), poisoned);
            unsafe {
                run.run::<f32>(
                    (output_pointers(&mut expected), pointer(&q), pointer(&k), pointer(&v), pointer(&g)),
                    (&q_offsets, &k_offsets),
                )
            };
            let rounded = |values: &[f32]| unsafe { RoundedBuffer::as_bf16(values.as_ptr(), values.len()) };
            let (q_rounded, k_rounded, v_rounded, g_rounded) = (rounded(&q), rounded(&k), rounded(&v), rounded(&g));
            let inputs = TileInputs::new((&q_rounded, &k_rounded, &v_rounded), Some(&g_rounded));
            let mut actual = output_buffers(outputs, (q_rows, k_rows), poisoned);
            let (out, keys_out) = output_pointers(&mut actual);
            let buffers = GradBuffers { out: out as *mut f32, keys_out: keys_out as *mut f32, q: q.as_ptr(), k: k.as_ptr(), v: v.as_ptr(), g: g.as_ptr() };
            // Scratch poisoned with bf16 NaNs: a slot read but not written shows.
            tiles::GRAD_SCRATCH.with_borrow_mut(|scratch| {
                let most = 1 << 14;
                for panel in [&mut scratch.keys_t, &mut scratch.values_t, &mut scratch.keys, &mut scratch.probabilities, &mut scratch.slopes] {
                    panel.poison(most);
                }
                for rows in [&mut scratch.queries, &mut scratch.gradients, &mut scratch.queries_t, &mut scratch.gradients_t, &mut scratch.slope_rows] {
                    rows.clear();
                    rows.resize(most, 0xffc0);
                }
            });
            for (element, head, row, rows) in run.tasks(&q_offsets, &k_offsets) {
                let queries = (q_offsets[element] + row, rows);
                let keys = (k_offsets[element], k_offsets[element + 1] - k_offsets[element]);
                unsafe { run.tile_task((buffers, inputs), head, queries, keys, row) };
            }
            let (actual, expected) = ([actual.0, actual.1].concat(), [expected.0, expected.1].concat());
            let largest = expected.iter().filter(|value| value.is_finite()).fold(0f32, |most, value| most.max(value.abs()));
            for (index, (&got, &want)) in actual.iter().zip(&expected).enumerate() {
                let close = (got - want).abs() <= 2e-2 * (1.0 + largest) || got.to_bits() == want.to_bits();
                prop_assert!(close, "output {index}: {got} on tiles, {want} tiled (largest {largest})");
            }
        }
    }

    /// A seeded generator of values in `[-spread, spread]`, NaN and infinities among
    /// them where `specials`.
    fn seeded(seed: u64, spread: f32, specials: bool) -> impl FnMut() -> f32 {
        let mut random = seed;
        move || {
            random = random
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let x = ((random >> 33) % 20001) as f32 / 10000.0 * spread - spread;
            match (specials, random >> 60) {
                (true, 0) => f32::NAN,
                (true, 1) => f32::INFINITY,
                _ => x,
            }
        }
    }

    /// Whether `got` is `want` up to `tolerance` of values as large as `largest`, or
    /// both NaN.
    fn close(got: f32, want: f32, (tolerance, largest): (f32, f32)) -> bool {
        (got - want).abs() <= tolerance * (1.0 + largest)
            || got.to_bits() == want.to_bits()
            || (got.is_nan() && want.is_nan())
    }

    /// A drawn case's query and key offsets and rows: the first length of each pair for
    /// the queries, the second for the keys where `cross` (else the queries' again).
    fn drawn_offsets(lengths: &[(i64, i64)], cross: bool) -> ((Vec<i64>, Vec<i64>), (i64, i64)) {
        let q_lengths: Vec<i64> = lengths.iter().map(|&(q, _)| q).collect();
        let k_lengths: Vec<i64> = match cross {
            true => lengths.iter().map(|&(_, k)| k).collect(),
            false => q_lengths.clone(),
        };
        let (q_offsets, k_offsets) = (offsets(&q_lengths), offsets(&k_lengths));
        let rows = (q_lengths.iter().sum(), k_lengths.iter().sum());
        ((q_offsets, k_offsets), rows)
    }

    /// `rows` rows of `width` values drawn from `value`.
    fn drawn(value: &mut impl FnMut() -> f32, rows: i64, width: i64) -> Vec<f32> {
        (0..rows * width).map(|_| value()).collect()
    }

    /// Rows of `widths` in slots 1, 2, ... (queries, keys, values, output gradients).
    fn slot_rows<const N: usize>(widths: [i64; N]) -> [Access; N] {
        let mut slot = 0;
        widths.map(|width| {
            slot += 1;
            Access::rows(nestor_passes::Slot(slot), width)
        })
    }

    /// A drawn forward of `(heads, head_dim, value_dim)` on `accesses` ([`slot_rows`]),
    /// scaled by `1 / sqrt(head_dim)`, on one thread.
    fn drawn_forward(
        accesses: &[Access; 3],
        (heads, head_dim, value_dim): (i64, i64, i64),
        (causal, products): (bool, Products),
    ) -> AttentionRun<'_> {
        AttentionRun {
            products,
            q: &accesses[0],
            k: &accesses[1],
            v: &accesses[2],
            heads,
            head_dim,
            value_dim,
            causal,
            scale: 1.0 / (head_dim as f64).sqrt(),
            parallel: false,
            tiles: Tiles::DEFAULT,
        }
    }

    /// A drawn gradient likewise, in tasks of `queries` query rows, writing the outputs
    /// of `part`: the queries', the keys' and values', all three, or both parts in two
    /// buffers (0 to 3).
    fn drawn_gradient(
        accesses: &[Access; 4],
        (heads, head_dim): (i64, i64),
        (causal, part, queries): (bool, usize, i64),
        products: Products,
    ) -> AttentionGradRun<'_> {
        let width = heads * head_dim;
        let outputs: [fn(i64) -> GradOutputs; 4] = [
            GradOutputs::queries,
            GradOutputs::keys_values,
            GradOutputs::all,
            GradOutputs::both,
        ];
        AttentionGradRun {
            products,
            q: &accesses[0],
            k: &accesses[1],
            v: &accesses[2],
            g: &accesses[3],
            heads,
            head_dim,
            causal,
            scale: 1.0 / (head_dim as f64).sqrt(),
            outputs: outputs[part](width),
            parallel: false,
            tiles: Tiles { queries, keys: 1 },
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// The fused f32 forward equals the tiled one: elements of 0, 1 and up to 100
        /// rows (several chunks, the last one part full, keys left out past a
        /// causal chunk), heads of 1 to 65 columns, causal or not, cross lengths, NaN
        /// and infinities. On every instruction set the host has (skipped where none).
        #[test]
        fn the_fused_forward_equals_the_tiled_forward(
            lengths in proptest::collection::vec((prop_oneof![0i64..3, 0i64..100], 0i64..100), 1..4),
            (heads, head_dim, value_dim) in (1i64..3, prop_oneof![1i64..4, Just(17), Just(64), Just(65)], prop_oneof![1i64..5, Just(16), Just(64)]),
            (causal, cross, specials, seed) in (any::<bool>(), any::<bool>(), any::<bool>(), any::<u64>()),
        ) {
            let isas = fused::Isa::all_here();
            if isas.is_empty() {
                eprintln!("skipped: this host has neither AVX-512 nor AVX2 with FMA");
                return Ok(());
            }
            let ((q_offsets, k_offsets), (q_rows, k_rows)) = drawn_offsets(&lengths, cross);
            let mut value = seeded(seed, 3.0, specials);
            let (width, value_width) = (heads * head_dim, heads * value_dim);
            let (q, k, v) = (drawn(&mut value, q_rows, width), drawn(&mut value, k_rows, width), drawn(&mut value, k_rows, value_width));
            let accesses = slot_rows([width, width, value_width]);
            let run = drawn_forward(&accesses, (heads, head_dim, value_dim), (causal, Products::Float));
            let size = (q_rows * value_width) as usize;
            let poisoned = f32::from_bits(0x7fc0_0001);
            let mut expected = vec![poisoned; size];
            let buffers = |out: &mut Vec<f32>| Buffers { out: out.as_mut_ptr(), q: q.as_ptr(), k: k.as_ptr(), v: v.as_ptr() };
            let tiled = buffers(&mut expected);
            let rounded = InputRoundings { buffers: Vec::new(), of_input: Vec::new() };
            let tasks = forward_tasks(&q_offsets, &k_offsets, heads);
            for &task in &tasks {
                // SAFETY: the buffers hold the tasks' rows.
                unsafe { crate::vectors::widest(|| run.task(tiled, task, &rounded)) };
            }
            let largest = expected.iter().filter(|value| value.is_finite()).fold(0f32, |most, value| most.max(value.abs()));
            for isa in isas {
                let mut actual = vec![poisoned; size];
                let on_registers = buffers(&mut actual);
                fused::poison_scratch();
                for &task in &tasks {
                    // SAFETY: the buffers hold the tasks' rows; the host has `isa`.
                    unsafe { run.fused_task(isa, on_registers, task) };
                }
                for (index, (&got, &want)) in actual.iter().zip(&expected).enumerate() {
                    prop_assert!(close(got, want, (1e-4, largest)), "{isa:?} output {index}: {got} fused, {want} tiled");
                }
            }
        }

        /// The fused f32 gradient equals the tiled one: elements of 0, 1 and up to 100
        /// rows (the keys' gradients summed over several chunks, keys left out past a
        /// causal chunk), heads of 1 to 65 columns, causal or not, cross lengths, each
        /// part of the outputs alone, all three and both parts in two buffers, tasks of
        /// 1 to 100 query rows (the queries' part alone splits elements), scores large
        /// enough that most probabilities underflow. On every instruction set the host
        /// has (skipped where none).
        #[test]
        fn the_fused_gradient_equals_the_tiled_gradient(
            lengths in proptest::collection::vec((prop_oneof![0i64..3, 0i64..100], 0i64..100), 1..4),
            (heads, head_dim) in (1i64..3, prop_oneof![1i64..4, Just(17), Just(64), Just(65)]),
            (causal, cross, part, tile) in (any::<bool>(), any::<bool>(), 0usize..4, prop_oneof![Just(128i64), 1i64..100]),
            (spread, seed) in (prop_oneof![Just(3.0f32), Just(40.0)], any::<u64>()),
        ) {
            let isas = fused::Isa::all_here();
            if isas.is_empty() {
                eprintln!("skipped: this host has neither AVX-512 nor AVX2 with FMA");
                return Ok(());
            }
            let ((q_offsets, k_offsets), (q_rows, k_rows)) = drawn_offsets(&lengths, cross);
            let mut value = seeded(seed, spread, false);
            let width = heads * head_dim;
            let [q, k, v, g] = [q_rows, k_rows, k_rows, q_rows].map(|rows| drawn(&mut value, rows, width));
            let accesses = slot_rows([width; 4]);
            let run = drawn_gradient(&accesses, (heads, head_dim), (causal, part, tile), Products::Float);
            let outputs = run.outputs;
            if cross && outputs == GradOutputs::all(width) {
                // Self-attention's layout only.
                return Ok(());
            }
            let poisoned = f32::from_bits(0x7fc0_0001);
            let mut expected = output_buffers(outputs, (q_rows, k_rows), poisoned);
            let buffers = |out: &mut (Vec<f32>, Vec<f32>)| {
                let (out, keys_out) = output_pointers(out);
                GradBuffers { out: out as *mut f32, keys_out: keys_out as *mut f32, q: q.as_ptr(), k: k.as_ptr(), v: v.as_ptr(), g: g.as_ptr() }
            };
            let tiled = buffers(&mut expected);
            let rounded = InputRoundings { buffers: Vec::new(), of_input: Vec::new() };
            let tasks: Vec<_> = run.tasks(&q_offsets, &k_offsets).into_iter().map(|(element, head, row, rows)| {
                let queries = (q_offsets[element] + row, rows);
                let keys = (k_offsets[element], k_offsets[element + 1] - k_offsets[element]);
                (head, queries, keys, row)
            }).collect();
            for &(head, queries, keys, row) in &tasks {
                // SAFETY: the buffers hold the tasks' rows.
                unsafe { crate::vectors::widest(|| run.element((tiled, &rounded), head, queries, keys, row)) };
            }
            let expected = [expected.0, expected.1].concat();
            let largest = expected.iter().filter(|value| value.is_finite()).fold(0f32, |most, value| most.max(value.abs()));
            // Scores of thousands (spread 40) carry f32 rounding of about 1e-3 into `P`.
            let tolerance = if spread > 3.0 { 4e-3 } else { 1e-4 };
            for isa in isas {
                let mut actual = output_buffers(outputs, (q_rows, k_rows), poisoned);
                let on_registers = buffers(&mut actual);
                fused::poison_scratch();
                for &(head, queries, keys, row) in &tasks {
                    // SAFETY: the buffers hold the tasks' rows; the host has `isa`.
                    unsafe { run.fused_element(isa, on_registers, head, queries, keys, row) };
                }
                let actual = [actual.0, actual.1].concat();
                for (index, (&got, &want)) in actual.iter().zip(&expected).enumerate() {
                    prop_assert!(close(got, want, (tolerance, largest)), "{isa:?} output {index}: {got} fused, {want} tiled (largest {largest})");
                }
            }
        }
    }
}
