//! bf16 products on Intel AMX tiles (Sapphire Rapids and later): every mixed-precision
//! product of the process on such a host ([`product`], through `crate::bf16`), and the
//! primitives of mixed-precision attention on them (`crate::attention`). MKL's bf16 GEMM
//! packs both operands on every call (`cblas_gemm_bf16bf16f32` spent most of a 128 x 64
//! x 256 product copying them).
//!
//! - [`Panel`]: a right operand `b [k x n]` packed once into AMX's pair-interleaved
//!   layout (`tdpbf16ps`'s second operand: row `p` of a block holds `(b[2p][j],
//!   b[2p + 1][j])` for its 16 columns `j`), zeros past `k`; a transposed operand
//!   (attention's keys in `q k^T`) is transposed 16 x 16 pairs at a time in AVX-512
//!   registers; or written by its owner a pair of rows at a time.
//! - [`RowsOfA`]: a left operand's blocks of 16 rows, read in place when they are rows
//!   of bf16 roundings a whole number of tiles deep (attention's queries at a head of
//!   64), else packed with zeros past `k` (the columns of roundings, a transposed read,
//!   16 x 32 at a time in AVX-512 registers).
//! - [`multiply_rows`]: one block of 16 rows times a panel into f32 sums, four tiles of
//!   sums at a time where the columns allow, inside [`Configured`] tiles.
//! - [`product`]: `c = scale a b` of any shape and layout from those: the panel packed
//!   once, a slice of its columns at a time (kept in cache) times every row block, rows
//!   handed to the caller as they are done.
//!
//! Tiles read and write rows from cache lines (`crate::aligned`): rows across two lines
//! ran at half the speed.
//!
//! Operands are read as bf16 roundings, from a [`RoundedBuffer`] when the operand lies in
//! one, else rounded here (to nearest even, as [`crate::bf16::round`]); sums are f32. The
//! tiles treat bf16 denormals as zero, as MKL's AMX kernels do.
//!
//! [`usable`] asks the host (cpuid) and the kernel (`arch_prctl`, which must grant the
//! tile data to the process) once; `NESTOR_AMX=off` turns the tiles off (and
//! `NESTOR_BF16` naming another path: `crate::bf16`).
//!
//! On a host with AVX512-BF16 but no tiles, [`product`] packs the same way and
//! multiplies with `vdpbf16ps` in registers instead (`crate::dot`).

use std::cell::RefCell;
use std::sync::OnceLock;

use crate::bf16::{round, RoundedBuffer};
use crate::strided::{Strided, StridedMut};

/// Rows of a tile (and of a row block of `a`).
const TILE_ROWS: usize = 16;
/// f32 columns of a result tile (and columns of a block of `b`).
const TILE_COLUMNS: usize = 16;
/// bf16 values of `a` per tile row, and rows of `b` per tile (in pairs).
pub(crate) const TILE_DEPTH: usize = 32;
/// Bytes per tile row, the most a tile holds.
const ROW_BYTES: usize = 64;
/// Column blocks multiplied at once (four tiles of sums, one of `a`, three of `b`).
const WIDE: usize = 4;

/// Whether this process runs its bf16 products and mixed-precision attention on Intel
/// AMX tiles (asked once: the host has AMX-TILE and AMX-BF16, the kernel grants the
/// tile data, `NESTOR_AMX=off` is not set and `NESTOR_BF16` names no other path).
pub fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(|| {
        let off = crate::process::env_is("NESTOR_AMX", "off")
            || ["f32", "mkl", "dot"]
                .iter()
                .any(|path| crate::process::env_is("NESTOR_BF16", path));
        !off && host_grants_tiles()
    })
}

/// Whether the CPU has AMX-TILE and AMX-BF16 and the kernel lets this process use the
/// tile data (Linux's `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn host_grants_tiles() -> bool {
    // Leaf 7 reads as zeros on CPUs without it (no AMX).
    let features = std::arch::x86_64::__cpuid_count(7, 0);
    let amx_bf16 = features.edx & (1 << 22) != 0;
    let amx_tile = features.edx & (1 << 24) != 0;
    if !(amx_bf16 && amx_tile) {
        return false;
    }
    const ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let result: i64;
    // SAFETY: the arch_prctl system call with an integer request; it only changes the
    // process's permitted state components (idempotent, asked once).
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") ARCH_PRCTL => result,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    result == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn host_grants_tiles() -> bool {
    false
}

/// An operand: a matrix of f32 values, and the buffer holding its roundings, if any.
pub(crate) type Operand<'a> = (Strided<f32>, Option<&'a RoundedBuffer>);

/// A line of an operand (a row or a column), read as bf16 bits.
enum Line {
    /// Roundings already made, at a stride.
    Rounded(*const u16, isize),
    /// f32 values (or their roundings held as f32), rounded as they are read.
    Values(*const f32, isize),
}

impl Line {
    /// Writes the line's `out.len()` values into `out`.
    ///
    /// # Safety
    /// The line must hold `out.len()` values at its stride.
    #[inline(always)]
    unsafe fn read_into(&self, out: &mut [u16]) {
        unsafe {
            match *self {
                Line::Rounded(start, 1) => {
                    out.copy_from_slice(std::slice::from_raw_parts(start, out.len()))
                }
                Line::Rounded(start, step) => {
                    for (index, out) in out.iter_mut().enumerate() {
                        *out = *start.offset(index as isize * step);
                    }
                }
                Line::Values(start, 1) => {
                    crate::bf16::round_line(std::slice::from_raw_parts(start, out.len()), out)
                }
                Line::Values(start, step) => {
                    for (index, out) in out.iter_mut().enumerate() {
                        *out = round(*start.offset(index as isize * step));
                    }
                }
            }
        }
    }
}

/// An operand as lines of `length` values: its matrix's rows (`by_rows`) or columns.
pub(crate) struct Lines {
    rounded: Option<Strided<u16>>,
    values: Strided<f32>,
    by_rows: bool,
    length: usize,
}

impl Lines {
    pub(crate) fn new((matrix, buffer): Operand<'_>, by_rows: bool, length: usize) -> Self {
        Lines {
            rounded: buffer.and_then(|buffer| buffer.bf16_view(matrix)),
            values: buffer
                .and_then(|buffer| buffer.f32_view(matrix))
                .unwrap_or(matrix),
            by_rows,
            length,
        }
    }

    /// Rows of `length` bf16 bits from `start`, `row_stride` apart.
    fn of_bits(start: *const u16, row_stride: isize, length: usize) -> Self {
        Lines {
            rounded: Some((start, row_stride, 1)),
            values: (std::ptr::null(), 0, 0),
            by_rows: true,
            length,
        }
    }

    /// Line `index` as bf16 bits: in place when it is contiguous roundings, else read
    /// into `scratch`; zeros when `index` is not below `count`.
    ///
    /// # Safety
    /// Lines below `count` must lie within the matrix.
    #[inline(always)]
    unsafe fn line_or_zeros<'s>(
        &self,
        index: usize,
        count: usize,
        scratch: &'s mut Vec<u16>,
    ) -> &'s [u16] {
        if index >= count {
            scratch.clear();
            scratch.resize(self.length, 0);
            return scratch;
        }
        // SAFETY: the caller vouches for the line.
        unsafe {
            match self.line(index) {
                Line::Rounded(start, 1) => std::slice::from_raw_parts(start, self.length),
                line => {
                    scratch.resize(self.length, 0);
                    line.read_into(scratch);
                    scratch
                }
            }
        }
    }

    /// Line `index`.
    ///
    /// # Safety
    /// The line must lie within the matrix.
    unsafe fn line(&self, index: usize) -> Line {
        let pick = |(row, column): (isize, isize)| {
            let (across, along) = if self.by_rows {
                (row, column)
            } else {
                (column, row)
            };
            (index as isize * across, along)
        };
        unsafe {
            match self.rounded {
                Some((start, row, column)) => {
                    let (offset, step) = pick((row, column));
                    Line::Rounded(start.offset(offset), step)
                }
                None => {
                    let (start, row, column) = self.values;
                    let (offset, step) = pick((row, column));
                    Line::Values(start.offset(offset), step)
                }
            }
        }
    }
}

/// A right operand whose rows are taps after taps, `b[t * channels + c][j]`, read
/// straight from a convolution's weight: value `(j, c, t)` at `first + j * column +
/// c * channel + t * tap` (a forward weight `[j, c, t]`, or an input gradient's adjoint
/// `[c, j, t]` with its taps flipped).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TapRows {
    pub(crate) channels: usize,
    pub(crate) taps: usize,
    /// Columns `j`.
    pub(crate) columns: usize,
    pub(crate) first: isize,
    /// Strides of `j`, `c` and `t`, in values.
    pub(crate) strides: (isize, isize, isize),
}

/// `b [k x n]` packed in AMX's pair layout (see [`Panel::pack`]), kept by its owner
/// between products.
#[derive(Default)]
pub(crate) struct Panel {
    /// The pairs, from index `start` (a cache line: `crate::aligned`).
    pairs: Vec<u32>,
    start: usize,
    /// `k` rounded up to whole tiles.
    depth: usize,
    /// Columns `n`.
    columns: usize,
    /// Lines of `b` being interleaved.
    lines: [Vec<u16>; 2],
}

impl Panel {
    /// Fills the first `len` pairs with bf16 NaNs (for tests: a pair the tiles read but
    /// [`Panel::pack`] did not write makes sums NaN).
    #[cfg(test)]
    pub(crate) fn poison(&mut self, len: usize) {
        self.pairs.clear();
        self.start = crate::aligned::line_start(&mut self.pairs, len, 0xffc0_ffc0);
    }

    /// The first `len` pairs, grown as needed.
    fn slots(&mut self, len: usize) -> &mut [u32] {
        self.start = crate::aligned::line_start(&mut self.pairs, len, 0);
        &mut self.pairs[self.start..self.start + len]
    }

    /// The first pair (the tiles read from there).
    fn first(&self) -> *const u32 {
        self.pairs[self.start..].as_ptr()
    }

    /// Pairs per column block.
    pub(crate) fn block(&self) -> usize {
        self.depth / 2 * TILE_COLUMNS
    }

    /// Rows of `b` the panel holds: `k` rounded up to whole tiles (zeros past `k`).
    pub(crate) fn depth(&self) -> usize {
        self.depth
    }

    /// The first pair of column block `index` (columns `16 index` on).
    pub(crate) fn column_block(&self, index: usize) -> *const u32 {
        self.first().wrapping_add(index * self.block())
    }

    /// Shapes the panel for `b [k x n]` written by its caller a pair of rows at a time
    /// ([`Panel::pairs_mut`], [`Panel::zero_pairs_from`]) rather than packed.
    pub(crate) fn shape(&mut self, (k, n): (usize, usize)) {
        self.depth = k.next_multiple_of(TILE_DEPTH);
        self.columns = n;
        let len = n.div_ceil(TILE_COLUMNS) * self.block();
        self.slots(len);
    }

    /// The 16 pairs `(b[2 pair][j], b[2 pair + 1][j])` of column block `column_block`
    /// (columns `16 column_block` on), as bf16 bits, the even row's in the low half.
    /// The caller keeps within the shape it gave ([`Panel::shape`]).
    pub(crate) fn pairs_mut(&mut self, pair: usize, column_block: usize) -> &mut [u32] {
        debug_assert!(pair < self.depth / 2 && column_block < self.columns.div_ceil(16));
        let first = self.start + column_block * self.block() + pair * TILE_COLUMNS;
        &mut self.pairs[first..first + TILE_COLUMNS]
    }

    /// Zeros the pairs of rows from pair `first` to the panel's depth, in every column
    /// block (a product's rows past `k`).
    pub(crate) fn zero_pairs_from(&mut self, first: usize) {
        let (block, pairs) = (self.block(), self.depth / 2);
        for column_block in 0..self.columns.div_ceil(TILE_COLUMNS) {
            let start = self.start + column_block * block;
            let rows = (start + first.min(pairs) * TILE_COLUMNS)..(start + block);
            self.pairs[rows].fill(0);
        }
    }

    /// Packs the tap rows `rows` of `weight` (rounded to bf16 as they are read), a
    /// block of 16 columns a task of `threads` of the team: one pass over the weight,
    /// where reordering it for [`Panel::pack`] first and rounding it took a 512-channel
    /// 3x3 convolution's weight 3-5 ms, more than the convolution of 383 pixels.
    ///
    /// # Safety
    /// `weight` must hold every value `rows` names.
    pub(crate) unsafe fn pack_tap_rows(
        &mut self,
        weight: *const f32,
        rows: TapRows,
        threads: usize,
    ) {
        let TapRows {
            channels,
            taps,
            columns,
            first,
            strides: (column, channel, tap),
        } = rows;
        let k = channels * taps;
        self.shape((k, columns));
        // Rows past `k` are zeros (an odd `k`'s last pair is written below, its second
        // row a zero).
        self.zero_pairs_from(k / 2);
        let block = self.block();
        let pairs = crate::parallel::SendPointer(self.pairs[self.start..].as_mut_ptr());
        let blocks = columns.div_ceil(TILE_COLUMNS);
        let weight = crate::parallel::SendPointer(weight as *mut f32);
        // Gathers of 16 columns' values need AVX-512 and strides that fit them.
        #[cfg(target_arch = "x86_64")]
        let wide = std::is_x86_feature_detected!("avx512f")
            && i32::try_from(column.unsigned_abs() * TILE_COLUMNS).is_ok();
        crate::team::for_each_chunk(blocks, threads, &|column_block| {
            let weight = weight.get() as *const f32;
            let start = column_block * TILE_COLUMNS;
            let end = (start + TILE_COLUMNS).min(columns);
            // SAFETY: the block's pairs are this task's alone; the weight holds every
            // value named (the caller vouches).
            unsafe {
                let out = pairs.get().add(column_block * block);
                #[cfg(target_arch = "x86_64")]
                if wide && end - start == TILE_COLUMNS && channels % 2 == 0 {
                    // The whole block at once: 16 columns' values gathered per row.
                    let gather = (first + start as isize * column, (column, channel, tap));
                    return pack_tap_block(weight, gather, (channels, taps), out);
                }
                for j in start..end {
                    pack_tap_column(weight, rows, j, out.add(j - start));
                }
            }
        });
    }

    /// Packs the columns of a convolution's weight gradient straight from the roundings
    /// of its input, `b [count x taps.len() * channels]` with `b[p][t' channels + c] =
    /// x[table[p][t]][c]` for tap `t = taps.start + t'` of output pixel `p`'s window
    /// (zero where the tap is outside its image, and for rows past `count`): a pair of
    /// pixels' 16 channels at a time, interleaved in registers. No columns gathered
    /// first, nor rounded and interleaved in a second pass.
    ///
    /// # Safety
    /// `channels` must be a multiple of 16; the table must hold `count` windows of
    /// `per_window` taps, each naming a pixel of `x` (`channels` roundings) or none
    /// (negative); the host must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    pub(crate) unsafe fn pack_tap_pixels(
        &mut self,
        x: *const u16,
        (table, per_window, taps): (&[i64], usize, std::ops::Range<usize>),
        (channels, count): (usize, usize),
    ) {
        let chunks = channels / TILE_COLUMNS;
        self.shape((count, taps.len() * channels));
        let block = self.block();
        let pairs = crate::parallel::SendPointer(self.pairs[self.start..].as_mut_ptr());
        let zeros = [0u16; TILE_COLUMNS];
        // Pixel `p`'s tap `t`: its first rounding, or none.
        let source = |p: usize, t: usize| match table.get(p * per_window + t) {
            Some(&source) if p < count && source >= 0 => Some(source as usize * channels),
            _ => None,
        };
        for pair in 0..self.depth / 2 {
            for (local, t) in taps.clone().enumerate() {
                let (even, odd) = (source(2 * pair, t), source(2 * pair + 1, t));
                for chunk in 0..chunks {
                    // SAFETY: the taps name pixels of `x` (the caller vouches), 16 of their
                    // roundings from the chunk's first; the pairs hold every column block
                    // of the shape's depth; the host has AVX-512F.
                    unsafe {
                        let values = |at: Option<usize>| match at {
                            Some(at) => &*(x.add(at + chunk * TILE_COLUMNS) as *const [u16; 16]),
                            None => &zeros,
                        };
                        let column_block = local * chunks + chunk;
                        let out = std::slice::from_raw_parts_mut(
                            pairs.get().add(column_block * block + pair * TILE_COLUMNS),
                            TILE_COLUMNS,
                        );
                        interleave_16(values(even), values(odd), out);
                    }
                }
            }
        }
    }

    /// Packs `b [k x n]` (rounded to bf16 as it is read, or read from its roundings):
    /// for each block of 16 columns, `depth / 2` rows of 16 pairs `(b[2p][j],
    /// b[2p + 1][j])`, zeros for rows past `k` (columns past `n` are left as they were:
    /// their sums are never read).
    ///
    /// # Safety
    /// `b` must be valid for `k x n` values at its strides; `k` at least 1.
    pub(crate) unsafe fn pack(&mut self, b: Operand<'_>, (k, n): (usize, usize)) {
        self.depth = k.next_multiple_of(TILE_DEPTH);
        self.columns = n;
        let block = self.block();
        let pairs = self.depth / 2;
        let len = n.div_ceil(TILE_COLUMNS) * block;
        self.start = crate::aligned::line_start(&mut self.pairs, len, 0);
        let (_, row_stride, column_stride) = b.0;
        let packed = &mut self.pairs[self.start..self.start + len];
        let [line, odd] = &mut self.lines;
        let pair = |even: u16, odd: u16| u32::from(even) | (u32::from(odd) << 16);
        if column_stride == 1 || row_stride != 1 {
            // Rows of `b` (a value's rows, such as attention's values): a pair of rows
            // at a time, interleaved.
            let lines = Lines::new(b, true, n);
            #[cfg(target_arch = "x86_64")]
            let wide = std::is_x86_feature_detected!("avx512f");
            #[cfg(target_arch = "x86_64")]
            if let (true, Some((start, row_stride, 1))) = (wide, lines.rounded) {
                // SAFETY: `k` rows of `n` roundings (the caller vouches); the host has
                // AVX-512; `packed` holds every block's pairs.
                unsafe { pack_row_pairs((start, row_stride), (k, n), block, packed) };
                return;
            }
            for index in 0..pairs {
                // SAFETY: rows below `k` hold `n` values (the caller vouches).
                let (even, odd) = unsafe {
                    (
                        lines.line_or_zeros(2 * index, k, line),
                        lines.line_or_zeros(2 * index + 1, k, odd),
                    )
                };
                let blocks = even.chunks(TILE_COLUMNS).zip(odd.chunks(TILE_COLUMNS));
                for (column_block, (even, odd)) in blocks.enumerate() {
                    let out = &mut packed[column_block * block + index * TILE_COLUMNS..];
                    #[cfg(target_arch = "x86_64")]
                    if let (true, Ok(even), Ok(odd)) = (wide, even.try_into(), odd.try_into()) {
                        // SAFETY: the host has AVX-512; `out` holds the block's pairs.
                        unsafe { interleave_16(even, odd, &mut out[..TILE_COLUMNS]) };
                        continue;
                    }
                    for (out, (&even, &odd)) in out.iter_mut().zip(even.iter().zip(odd)) {
                        *out = pair(even, odd);
                    }
                }
            }
            return;
        }
        // Columns of `b` contiguous (the transpose of a value's rows, such as
        // attention's keys in `q k^T`): whole blocks of 16 columns by 16 pairs of
        // roundings in place transposed in registers, the rest a column at a time, its
        // pairs scattered.
        let lines = Lines::new(b, false, k);
        let transposed = match lines.rounded {
            // SAFETY: the columns hold `k` values (the caller vouches).
            Some((start, 1, column_stride)) => unsafe {
                transpose_pairs((start, column_stride), (k, n), block, packed)
            },
            _ => 0,
        };
        let whole_blocks = n / TILE_COLUMNS * TILE_COLUMNS;
        for column in 0..n {
            let done = if column < whole_blocks { transposed } else { 0 };
            if done == pairs {
                continue;
            }
            // SAFETY: column `column` of `b` holds `k` values (the caller vouches).
            let values = unsafe { lines.line_or_zeros(column, n, line) };
            let first = (column / TILE_COLUMNS) * block + column % TILE_COLUMNS;
            let out = packed[first + done * TILE_COLUMNS..]
                .iter_mut()
                .step_by(TILE_COLUMNS);
            let mut pairs_of_values = values[2 * done..].chunks_exact(2);
            let mut out = out.take(pairs - done);
            // The pairs first: `zip` takes from its first iterator first.
            for (values, out) in pairs_of_values.by_ref().zip(out.by_ref()) {
                *out = pair(values[0], values[1]);
            }
            // An odd `k`'s last value, paired with a zero (the slot after the pairs is
            // taken only then: the zeros below fill it otherwise).
            if let Some(&last) = pairs_of_values.remainder().first() {
                if let Some(out) = out.next() {
                    *out = pair(last, 0);
                }
            }
            for out in out {
                *out = 0;
            }
        }
    }
}

/// `sums [16 x n] = a [16 x depth] b` for one block of 16 rows of `a` (bf16 rows at a
/// stride in bytes, zeros past `b`'s `k`) and a packed `b`, its `n` columns padded to
/// whole blocks of 16: `sums` holds `n.div_ceil(16) * 16` f32 per row, rows
/// `row_bytes` apart.
///
/// # Safety
/// The tiles must be configured on this thread ([`Configured`]); `a` must hold 16 rows of
/// the panel's depth, `sums` the rows and columns above.
#[inline(always)]
pub(crate) unsafe fn multiply_rows(a: (*const u16, usize), panel: &Panel, sums: (*mut f32, usize)) {
    let column_blocks = panel.columns.div_ceil(TILE_COLUMNS);
    // SAFETY: as the caller vouches.
    unsafe { multiply_columns(a, panel, 0..column_blocks, sums) }
}

/// [`multiply_rows`] for the panel's column blocks `blocks` only: `sums` holds their
/// columns, from its first.
///
/// # Safety
/// As [`multiply_rows`], the blocks within the panel.
#[inline(always)]
unsafe fn multiply_columns(
    a: (*const u16, usize),
    panel: &Panel,
    blocks: std::ops::Range<usize>,
    (sums, row_bytes): (*mut f32, usize),
) {
    let block = panel.block();
    let steps = panel.depth / TILE_DEPTH;
    let mut column_block = blocks.start;
    while column_block < blocks.end {
        // SAFETY: the panel and the sums hold every block (the caller vouches for the
        // sums).
        unsafe {
            let b = panel.column_block(column_block);
            let sums = (
                sums.add((column_block - blocks.start) * TILE_COLUMNS),
                row_bytes,
                TILE_COLUMNS * 4,
            );
            if blocks.end - column_block >= WIDE {
                multiply_tiles(sums, a, (b, block * 4), steps);
                column_block += WIDE;
            } else {
                multiply_tile(sums, a, b, steps);
                column_block += 1;
            }
        }
    }
}

/// [`multiply_columns`] for two blocks of 16 rows of `a` at once
/// ([`multiply_tiles_2x2`] two column blocks at a time): the second block's sums 16
/// rows after the first's.
///
/// # Safety
/// As [`multiply_columns`], for both row blocks; `sums` 32 rows.
#[inline(always)]
unsafe fn multiply_columns_2(
    a: [(*const u16, usize); 2],
    panel: &Panel,
    blocks: std::ops::Range<usize>,
    (sums, row_bytes): (*mut f32, usize),
) {
    let block = panel.block();
    let steps = panel.depth / TILE_DEPTH;
    let second = TILE_ROWS * row_bytes;
    let mut column_block = blocks.start;
    while column_block < blocks.end {
        // SAFETY: the panel and the sums hold every block (the caller vouches).
        unsafe {
            let b = panel.column_block(column_block);
            let sums = sums.add((column_block - blocks.start) * TILE_COLUMNS);
            if blocks.end - column_block >= 2 {
                let tiles = (sums, row_bytes, TILE_COLUMNS * 4, second);
                multiply_tiles_2x2(tiles, a, (b, block * 4), steps);
                column_block += 2;
            } else {
                multiply_tile((sums, row_bytes, 0), a[0], b, steps);
                multiply_tile((sums.byte_add(second), row_bytes, 0), a[1], b, steps);
                column_block += 1;
            }
        }
    }
}

/// What multiplies [`product`]'s packed operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Units {
    /// AMX tiles ([`usable`]).
    Tiles,
    /// AVX512-BF16's `vdpbf16ps` in registers (`crate::dot`, where the host has it).
    Dot,
}

/// The left operand of [`product`]: values (rounded as they are read, or read from
/// their roundings), or rows of bf16 bits at a row stride (a convolution's columns,
/// gathered rounded: read in place when a whole number of tiles deep).
#[derive(Clone, Copy)]
pub(crate) enum Left<'a> {
    Values(Operand<'a>),
    Bits(*const u16, isize),
}

/// The right operand of [`product`]: values to pack for it, or a panel packed once for
/// many products ([`Panel::pack`]: the weight of a convolution's tiles of pixels).
#[derive(Clone, Copy)]
pub(crate) enum Right<'a> {
    Values(Operand<'a>),
    Packed(&'a Panel),
}

/// Per-thread scratch of [`product`], kept between products.
#[derive(Default)]
struct Scratch {
    a: Vec<u16>,
    panel: Panel,
    sums: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Bytes of the panel a product multiplies every row block of `a` by before it moves
/// to the next columns: a slice that stays in the core's cache (with `a`'s rows).
#[cfg(not(test))]
const PANEL_SLICE_BYTES: usize = 512 << 10;
/// Small in tests, so that their products take several slices.
#[cfg(test)]
const PANEL_SLICE_BYTES: usize = 8 << 10;

/// `c = scale a b` (`c += scale a b` when `add`) for `a [m x k]`, `b [k x n]`,
/// `c [m x n]` (unit column stride), on `units` (AMX tiles, or `vdpbf16ps`) with bf16
/// roundings of `a` and `b` (read from their buffers, or rounded here) and f32 sums:
/// `b` packed once, then per slice of its columns ([`PANEL_SLICE_BYTES`]) every block
/// of 16 rows of `a` (in place when they are rows of roundings a whole number of tiles
/// deep), on tiles two blocks at a time against two column blocks
/// ([`multiply_tiles_2x2`]), the sums of the blocks written into `c` as they are
/// made. `finished` gets `c`'s rows as they are done: in
/// groups of blocks of about [`FINISHED_VALUES`] values when the columns take one slice,
/// else all at the end.
///
/// # Safety
/// The host must have the units ([`usable`] for the tiles, `crate::dot::host_has` for
/// `vdpbf16ps`). The pointers must be valid for the sizes and strides given; `c`'s
/// column stride 1; a rounded operand's matrix must lie within its buffer.
pub(crate) unsafe fn product(
    units: Units,
    (m, k, n): (usize, usize, usize),
    scale: f32,
    (a, b): (Left<'_>, Right<'_>),
    (c, add): (StridedMut<f32>, bool),
    finished: crate::blas::Finished<'_>,
) {
    let out_row = |row: usize, first: usize, columns: usize| unsafe {
        // SAFETY: within `c` (the caller vouches).
        std::slice::from_raw_parts_mut(c.0.offset(row as isize * c.1 + first as isize), columns)
    };
    if m == 0 || n == 0 {
        return finished(0, m);
    }
    if k == 0 {
        if !add {
            (0..m).for_each(|row| out_row(row, 0, n).fill(0.0));
        }
        return finished(0, m);
    }
    // The thread-local's closure is compiled apart: `widest` for the host's vectors (the
    // sums written into `c`).
    SCRATCH.with_borrow_mut(|scratch| {
        crate::vectors::widest(
            #[inline(always)]
            || {
                let depth = k.next_multiple_of(TILE_DEPTH);
                // A column-major `a` as the columns of its row-major transpose (rows
                // packed 16 x 32 at a time from roundings, `pack_columns`).
                let lines = match a {
                    Left::Values(((start, 1, columns), buffer)) if columns != 1 => {
                        Lines::new(((start, columns, 1), buffer), false, k)
                    }
                    Left::Values(a) => Lines::new(a, true, k),
                    Left::Bits(start, row_stride) => Lines::of_bits(start, row_stride, k),
                };
                let Scratch {
                    a: packed_a,
                    panel: own_panel,
                    sums,
                } = scratch;
                // SAFETY: the caller vouches for the operands (a packed `b` is `k x n`).
                let (rows, panel) = unsafe {
                    let panel = match b {
                        Right::Values(b) => {
                            own_panel.pack(b, (k, n));
                            &*own_panel
                        }
                        Right::Packed(panel) => panel,
                    };
                    (RowsOfA::new(&lines, m, depth, packed_a), panel)
                };
                let a = &*packed_a;
                let blocks = n.div_ceil(TILE_COLUMNS);
                let at_once = (PANEL_SLICE_BYTES / (depth * 2 * TILE_COLUMNS)).max(WIDE);
                let sums = crate::aligned::lines(sums, 2 * TILE_ROWS * at_once * TILE_COLUMNS, 0.0);
                // One slice of columns: rows are done about `FINISHED_VALUES` values at a
                // time (else all at the end).
                let one_slice = blocks <= at_once;
                let row_blocks = m.div_ceil(TILE_ROWS);
                let _tiles = (units == Units::Tiles).then(Configured::new);
                for first_block in (0..blocks).step_by(at_once) {
                    let slice = first_block..blocks.min(first_block + at_once);
                    let width = slice.len() * TILE_COLUMNS;
                    let first = first_block * TILE_COLUMNS;
                    let columns = width.min(n - first);
                    let mut handed = 0;
                    let mut row_block = 0;
                    while row_block < row_blocks {
                        // Two row blocks at a time where both are there and read at one
                        // stride (one after the other on `vdpbf16ps`).
                        let (a0, a1) = (
                            rows.block(row_block, a),
                            rows.block((row_block + 1).min(row_blocks - 1), a),
                        );
                        let pair = row_block + 1 < row_blocks && a0.1 == a1.1;
                        // SAFETY: the packed rows hold the blocks; `sums` 32 rows of the
                        // slice.
                        unsafe {
                            let sums = (sums.as_mut_ptr(), width * 4);
                            match (units, pair) {
                                (Units::Tiles, true) => {
                                    multiply_columns_2([a0, a1], panel, slice.clone(), sums)
                                }
                                (Units::Tiles, false) => {
                                    multiply_columns(a0, panel, slice.clone(), sums)
                                }
                                (Units::Dot, _) => {
                                    crate::dot::multiply_columns(a0, panel, slice.clone(), sums);
                                    if pair {
                                        let second = sums.0.add(TILE_ROWS * width);
                                        let sums = (second, sums.1);
                                        crate::dot::multiply_columns(
                                            a1,
                                            panel,
                                            slice.clone(),
                                            sums,
                                        );
                                    }
                                }
                            }
                        }
                        let count = if pair { 2 } else { 1 };
                        let first_row = row_block * TILE_ROWS;
                        let end_row = (first_row + count * TILE_ROWS).min(m);
                        for row in first_row..end_row {
                            let out = out_row(row, first, columns);
                            let sums = &sums[(row - first_row) * width..][..columns];
                            if add {
                                for (out, &sum) in out.iter_mut().zip(sums) {
                                    *out += scale * sum;
                                }
                            } else {
                                for (out, &sum) in out.iter_mut().zip(sums) {
                                    *out = scale * sum;
                                }
                            }
                        }
                        row_block += count;
                        let enough = (end_row - handed) * n >= FINISHED_VALUES;
                        if one_slice && (enough || end_row == m) {
                            finished(handed, end_row);
                            handed = end_row;
                        }
                    }
                }
                if !one_slice {
                    finished(0, m);
                }
            },
        )
    });
}

/// Output values a product hands to its caller at a time when it finishes rows as it
/// goes (`crate::blas::Gemm::product_finishing`): 128 KiB of f32, in the core's cache.
const FINISHED_VALUES: usize = 32 << 10;

/// Where the tiles read `a`'s row blocks: in place (rows of bf16 roundings with unit
/// column stride and a depth of whole tiles: every full block), else packed.
pub(crate) struct RowsOfA {
    in_place: Option<(*const u16, isize)>,
    full_blocks: usize,
    depth: usize,
    /// Where the packed rows start in their buffer (a cache line).
    start: usize,
}

impl RowsOfA {
    /// Packs what cannot be read in place into `packed`.
    ///
    /// # Safety
    /// The lines must hold `m` rows of `k` values.
    pub(crate) unsafe fn new(a: &Lines, m: usize, depth: usize, packed: &mut Vec<u16>) -> Self {
        #[cfg(target_arch = "x86_64")]
        if let (Some((start, row_stride, 1)), false) = (a.rounded, a.by_rows) {
            if depth.is_multiple_of(TILE_DEPTH) && std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the lines are the columns of `a.length` rows of roundings (the
                // caller vouches); the host has AVX-512.
                let start =
                    unsafe { pack_columns((start, row_stride), (m, a.length), depth, packed) };
                return RowsOfA {
                    in_place: None,
                    full_blocks: 0,
                    depth,
                    start,
                };
            }
        }
        let in_place = match a.rounded {
            Some((start, rows, 1)) if a.by_rows && a.length == depth => Some((start, rows)),
            _ => None,
        };
        let full_blocks = if in_place.is_some() { m / TILE_ROWS } else { 0 };
        let first = full_blocks * TILE_ROWS;
        // SAFETY: the caller vouches for the rows.
        let start = unsafe { pack_rows(a, (first, m), depth, packed) };
        RowsOfA {
            in_place,
            full_blocks,
            depth,
            start,
        }
    }

    /// Row block `index` (16 rows of `depth` values) and its row stride in bytes.
    pub(crate) fn block(&self, index: usize, packed: &[u16]) -> (*const u16, usize) {
        match self.in_place {
            Some((start, rows)) if index < self.full_blocks => (
                start.wrapping_offset((index * TILE_ROWS) as isize * rows),
                rows as usize * 2,
            ),
            _ => {
                let block = self.start + (index - self.full_blocks) * TILE_ROWS * self.depth;
                (packed[block..].as_ptr(), self.depth * 2)
            }
        }
    }
}

/// `a`'s rows `first..m` of `k` values as bf16 rows of `depth` (zeros past `k`), into
/// `packed` from its first cache line, returned (rows past `m`, up to the next 16, are
/// left as they were: their sums are never read).
///
/// # Safety
/// The lines must hold `m` rows of `k` values.
#[inline(always)]
unsafe fn pack_rows(
    lines: &Lines,
    (first, m): (usize, usize),
    depth: usize,
    packed: &mut Vec<u16>,
) -> usize {
    let k = lines.length;
    let len = (m - first).next_multiple_of(TILE_ROWS) * depth;
    let start = crate::aligned::line_start(packed, len, 0);
    let rows = packed[start..start + len].chunks_exact_mut(depth);
    for (row, out) in rows.take(m - first).enumerate() {
        let (values, padding) = out.split_at_mut(k);
        // SAFETY: the caller vouches for the rows.
        unsafe { lines.line(first + row).read_into(values) };
        padding.fill(0);
    }
    start
}

/// Packs rows of roundings (`k` rows of `n` values, `row_stride` apart from `start`)
/// into the pair layout (blocks `block` pairs apart, each `block / 16` pairs of rows
/// deep, zeros past `k`): eight blocks of columns at a time, down all pairs of rows,
/// so that each block's pairs are written in order (a pair of rows at a time across
/// every block wrote 64 bytes to each block in turn: 5.5 values per ns for 1430 x 256
/// roundings on a Xeon, 4.1 for 1430 x 1024; this way 13.7 and 5.4). Columns past `n`
/// in the last block are left as they were (their sums are never read).
///
/// # Safety
/// The rows must hold `n` values; `packed` every block's pairs; the host must have
/// AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_row_pairs(
    (start, row_stride): (*const u16, isize),
    (k, n): (usize, usize),
    block: usize,
    packed: &mut [u32],
) {
    use std::arch::x86_64::*;
    const GROUP: usize = 8;
    let pairs = block / TILE_COLUMNS;
    let blocks = n.div_ceil(TILE_COLUMNS);
    let widened = |row: usize, column: usize| {
        // SAFETY: as the caller vouches.
        unsafe { widened_16((start, row_stride), (k, n), (row, column)) }
    };
    for first_block in (0..blocks).step_by(GROUP) {
        let group = first_block..blocks.min(first_block + GROUP);
        for pair in 0..pairs {
            for column_block in group.clone() {
                let column = column_block * TILE_COLUMNS;
                let out = &mut packed[column_block * block + pair * TILE_COLUMNS..][..TILE_COLUMNS];
                let (even, odd) = (widened(2 * pair, column), widened(2 * pair + 1, column));
                // SAFETY: `out` holds 16 pairs; the host has AVX-512F.
                unsafe {
                    let both = _mm512_or_si512(even, _mm512_slli_epi32::<16>(odd));
                    _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, both);
                }
            }
        }
    }
}

/// Row `row`'s 16 values from column `column` of a matrix of `k` rows of `n`
/// roundings (`row_stride` apart from `start`), widened to 32 bits: zeros past the
/// matrix.
///
/// # Safety
/// The rows must hold `n` values; the host must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn widened_16(
    (start, row_stride): (*const u16, isize),
    (k, n): (usize, usize),
    (row, column): (usize, usize),
) -> std::arch::x86_64::__m512i {
    use std::arch::x86_64::*;
    let mut values = [0u16; TILE_COLUMNS];
    if row < k && column < n {
        // SAFETY: the row holds its `n` values (the caller vouches).
        let at = unsafe { start.offset(row as isize * row_stride + column as isize) };
        if column + TILE_COLUMNS <= n {
            // SAFETY: 16 values of the row from `at`; the host has AVX-512F.
            return unsafe { _mm512_cvtepu16_epi32(_mm256_loadu_si256(at as *const __m256i)) };
        }
        // SAFETY: the row's values from `at` to its end.
        let line = unsafe { std::slice::from_raw_parts(at, n - column) };
        values[..n - column].copy_from_slice(line);
    }
    // SAFETY: 16 values; the host has AVX-512F.
    unsafe { _mm512_cvtepu16_epi32(_mm256_loadu_si256(values.as_ptr() as *const __m256i)) }
}

/// The pairs of column `j` of tap rows `rows` ([`Panel::pack_tap_rows`]) from `out` on,
/// [`TILE_COLUMNS`] apart, value by value.
///
/// # Safety
/// `weight` must hold every value of column `j`; `out` its `k.div_ceil(2)` pairs.
unsafe fn pack_tap_column(weight: *const f32, rows: TapRows, j: usize, out: *mut u32) {
    let TapRows {
        channels,
        taps,
        first,
        strides: (column, channel, tap),
        ..
    } = rows;
    let k = channels * taps;
    let column_first = first + j as isize * column;
    // SAFETY: within the weight and the column's pairs (the caller vouches).
    unsafe {
        if channels % 2 == 1 {
            // A pair's rows may be different taps': each row found on its own (a stem's
            // few channels: a small weight).
            let value = |row: usize| match row < k {
                true => round(*weight.offset(
                    column_first
                        + (row % channels) as isize * channel
                        + (row / channels) as isize * tap,
                )),
                false => 0,
            };
            for pair in 0..k.div_ceil(2) {
                *out.add(pair * TILE_COLUMNS) =
                    u32::from(value(2 * pair)) | (u32::from(value(2 * pair + 1)) << 16);
            }
            return;
        }
        for c in (0..channels).step_by(2) {
            let even = weight.offset(column_first + c as isize * channel);
            let odd = even.offset(channel);
            for t in 0..taps {
                let (even, odd) = (
                    *even.offset(t as isize * tap),
                    *odd.offset(t as isize * tap),
                );
                let pair = (t * channels + c) / 2;
                *out.add(pair * TILE_COLUMNS) =
                    u32::from(round(even)) | (u32::from(round(odd)) << 16);
            }
        }
    }
}

/// The pairs of a block of 16 columns of tap rows ([`Panel::pack_tap_rows`], an even
/// channel count) from `out` on: for each pair of channels and each tap, the 16
/// columns' two values gathered (`first + j * column + c * channel + t * tap` for
/// column `j` of the block), rounded to bf16 and stored as the block's 16 pairs of
/// that row pair.
///
/// # Safety
/// The host must have AVX-512F; `weight` must hold every value named, `16 * column`
/// fit an `i32`; `out` hold the block's `channels * taps / 2` rows of 16 pairs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_tap_block(
    weight: *const f32,
    (first, (column, channel, tap)): (isize, (isize, isize, isize)),
    (channels, taps): (usize, usize),
    out: *mut u32,
) {
    use std::arch::x86_64::*;
    // SAFETY: within the weight and the block (the caller vouches); the host has
    // AVX-512F.
    unsafe {
        // Column `j`'s offset, in values, in lane `j`.
        let lanes = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(column as i32),
        );
        // bf16 bits of 16 values rounded to nearest even, NaNs kept quiet (as `round`),
        // in the low half of each lane.
        let rounded = |values: __m512| {
            let bits = _mm512_castps_si512(values);
            let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
            let sum = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb);
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(values, values);
            let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
            _mm512_mask_mov_epi32(_mm512_srli_epi32::<16>(sum), nan, quiet)
        };
        for c in (0..channels).step_by(2) {
            let even = weight.offset(first + c as isize * channel);
            let odd = even.offset(channel);
            for t in 0..taps {
                let at = t as isize * tap;
                let even = _mm512_i32gather_ps::<4>(lanes, even.offset(at));
                let odd = _mm512_i32gather_ps::<4>(lanes, odd.offset(at));
                let pairs = _mm512_or_si512(
                    _mm512_and_si512(rounded(even), _mm512_set1_epi32(0xffff)),
                    _mm512_slli_epi32::<16>(rounded(odd)),
                );
                let pair = (t * channels + c) / 2;
                _mm512_storeu_si512(out.add(pair * TILE_COLUMNS) as *mut __m512i, pairs);
            }
        }
    }
}

/// `out[j] = even[j] | odd[j] << 16`: two rows' 16 values as pairs.
///
/// # Safety
/// The host must have AVX-512F; `out` 16 values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn interleave_16(even: &[u16; 16], odd: &[u16; 16], out: &mut [u32]) {
    use std::arch::x86_64::*;
    debug_assert!(out.len() >= 16);
    // SAFETY: 16 values each (the types and the caller vouch).
    unsafe {
        let load = |values: &[u16; 16]| {
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(values.as_ptr() as *const __m256i))
        };
        let pairs = _mm512_or_si512(load(even), _mm512_slli_epi32::<16>(load(odd)));
        _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, pairs);
    }
}

/// `a`'s rows when they are the `m` columns of a row-major matrix of `k` rows of
/// roundings (rows `row_stride` apart from `start`): each a row of `depth` values (a
/// whole number of tiles, zeros past `k`) in `packed` from its first cache line
/// (returned), made 16 columns by 32 rows at a time (each pair of rows interleaved into
/// 32-bit pairs, then 16 x 16 transposes).
///
/// # Safety
/// The matrix must hold `k` rows of `m` values; the host must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_columns(
    (start, row_stride): (*const u16, isize),
    (m, k): (usize, usize),
    depth: usize,
    packed: &mut Vec<u16>,
) -> usize {
    use std::arch::x86_64::*;
    let len = m.next_multiple_of(TILE_COLUMNS) * depth;
    let first_slot = crate::aligned::line_start(packed, len, 0);
    let mut pairs = [[0u32; TILE_COLUMNS]; TILE_ROWS];
    let mut transposed = [0u32; TILE_ROWS * TILE_COLUMNS];
    // Rows outer: the two blocks of 16 columns of a row's cache line are read one after
    // the other, while the line is in cache.
    for first_row in (0..depth).step_by(TILE_DEPTH) {
        for first_column in (0..m).step_by(TILE_COLUMNS) {
            // Row `row`'s 16 values from the block's first column.
            let widened = |row: usize| {
                // SAFETY: as the caller vouches.
                unsafe { widened_16((start, row_stride), (k, m), (row, first_column)) }
            };
            for (pair, out) in pairs.iter_mut().enumerate() {
                let row = first_row + 2 * pair;
                // SAFETY: as above; `out` holds 16 pairs.
                unsafe {
                    let both =
                        _mm512_or_si512(widened(row), _mm512_slli_epi32::<16>(widened(row + 1)));
                    _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, both);
                }
            }
            // SAFETY: 16 rows of 16 pairs; the host has AVX-512F.
            unsafe {
                transpose_16x16(
                    std::array::from_fn(|row| pairs[row].as_ptr()),
                    &mut transposed,
                )
            };
            for (column, pairs) in transposed.chunks_exact(TILE_COLUMNS).enumerate() {
                let at = first_slot + (first_column + column) * depth + first_row;
                let out = &mut packed[at..at + TILE_DEPTH];
                // SAFETY: 16 pairs in and 32 values out.
                unsafe {
                    let pairs = _mm512_loadu_si512(pairs.as_ptr() as *const __m512i);
                    _mm512_storeu_si512(out.as_mut_ptr() as *mut __m512i, pairs);
                }
            }
        }
    }
    first_slot
}

/// The first pairs of every whole block of 16 columns of `b` (columns `column_stride`
/// apart from `start`, each `k` contiguous roundings), in chunks of 16 pairs, written
/// into `packed` in the pair layout (blocks `block` pairs apart): 16 x 16 transposes of
/// 32-bit pairs in AVX-512 registers. Returns the pairs written per column (0 without
/// AVX-512).
///
/// # Safety
/// The columns must hold `k` values; `packed` the blocks' pairs.
unsafe fn transpose_pairs(
    (start, column_stride): (*const u16, isize),
    (k, n): (usize, usize),
    block: usize,
    packed: &mut [u32],
) -> usize {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        let chunks = k / 2 / TILE_COLUMNS;
        for column_block in 0..n / TILE_COLUMNS {
            for chunk in 0..chunks {
                let first = column_block * block + chunk * TILE_COLUMNS * TILE_COLUMNS;
                let out = &mut packed[first..first + TILE_COLUMNS * TILE_COLUMNS];
                // SAFETY: each column holds the chunk's 32 values (the caller vouches);
                // the host has AVX-512 (checked above).
                unsafe {
                    let column = |index: usize| {
                        let column = column_block * TILE_COLUMNS + index;
                        start
                            .offset(column as isize * column_stride)
                            .add(chunk * 32) as *const u32
                    };
                    transpose_16x16(std::array::from_fn(column), out);
                }
            }
        }
        return chunks * TILE_COLUMNS;
    }
    let _ = (start, column_stride, k, n, block, packed);
    0
}

/// `out[r][c] = rows[c][r]` for 16 rows of 16 32-bit values (unaligned).
///
/// # Safety
/// Each row must hold 16 values; the host must have AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose_16x16(rows: [*const u32; 16], out: &mut [u32]) {
    use std::arch::x86_64::*;
    unsafe {
        let r: [__m512i; 16] = std::array::from_fn(|i| _mm512_loadu_si512(rows[i] as *const _));
        // 32-bit interleaves within 128-bit lanes, then 64-bit: u[4i + j]'s lane l holds
        // rows 4i..4i+4 at column 4l + j.
        let t: [__m512i; 16] = std::array::from_fn(|i| {
            let (even, odd) = (r[i & !1], r[i | 1]);
            if i % 2 == 0 {
                _mm512_unpacklo_epi32(even, odd)
            } else {
                _mm512_unpackhi_epi32(even, odd)
            }
        });
        let u: [__m512i; 16] = std::array::from_fn(|i| {
            let (group, j) = (i / 4 * 4, i % 4);
            let (low, high) = (t[group + j / 2], t[group + 2 + j / 2]);
            if j % 2 == 0 {
                _mm512_unpacklo_epi64(low, high)
            } else {
                _mm512_unpackhi_epi64(low, high)
            }
        });
        // The 4 x 4 transpose of 128-bit lanes: out[4l + j] = lane l of u[j], u[4 + j],
        // u[8 + j], u[12 + j].
        for j in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x44>(u[j], u[4 + j]);
            let v1 = _mm512_shuffle_i32x4::<0xEE>(u[j], u[4 + j]);
            let v2 = _mm512_shuffle_i32x4::<0x44>(u[8 + j], u[12 + j]);
            let v3 = _mm512_shuffle_i32x4::<0xEE>(u[8 + j], u[12 + j]);
            let rows = [
                _mm512_shuffle_i32x4::<0x88>(v0, v2),
                _mm512_shuffle_i32x4::<0xDD>(v0, v2),
                _mm512_shuffle_i32x4::<0x88>(v1, v3),
                _mm512_shuffle_i32x4::<0xDD>(v1, v3),
            ];
            for (lane, row) in rows.into_iter().enumerate() {
                _mm512_storeu_si512(out[(4 * lane + j) * 16..].as_mut_ptr() as *mut _, row);
            }
        }
    }
}

/// The tile configuration (palette 1): every tile 16 rows of 64 bytes (tiles 0-3 16 x 16
/// f32 sums, tile 4 a block of 16 rows x 32 bf16 of `a`, tiles 5-7 16 pair rows x 16
/// pairs of `b`).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

/// The tiles configured on this thread for the products of one call (released when
/// dropped).
pub(crate) struct Configured;

impl Configured {
    pub(crate) fn new() -> Self {
        let mut config = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for tile in 0..8 {
            config.bytes_per_row[tile] = ROW_BYTES as u16;
            config.rows[tile] = TILE_ROWS as u8;
        }
        // SAFETY: `usable` said the host and kernel allow tiles (the only caller,
        // `product`, requires it); the configuration is valid for palette 1.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        }
        Configured
    }
}

impl Drop for Configured {
    fn drop(&mut self) {
        // SAFETY: releases the tiles this thread configured.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// The sums of [`WIDE`] tiles at most: where the first tile's first row goes, the
/// bytes between its rows and between one tile and the next.
type Sums = (*mut f32, usize, usize);

/// `sums [16 x 16] = sum over steps s of a_s b_s`, where `a_s` is 16 rows of 32 bf16
/// at `a + 32 s` (rows `a_stride` bytes apart) and `b_s` 16 rows of 16 pairs at
/// `b + 256 s` (contiguous).
///
/// # Safety
/// The tiles must be configured ([`Configured`]); `steps` at least 1; the operands and
/// the sums valid for what they are read and written as.
#[inline(always)]
unsafe fn multiply_tile(
    (sums, sum_stride, _): Sums,
    (a, a_stride): (*const u16, usize),
    b: *const u32,
    steps: usize,
) {
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "2:",
            "tileloadd tmm4, [{a} + {a_stride}*1]",
            "tileloadd tmm5, [{b} + {row}*1]",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "add {a}, 64",
            "add {b}, 1024",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{sums} + {sum_stride}*1], tmm0",
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            steps = inout(reg) steps => _,
            a_stride = in(reg) a_stride,
            row = in(reg) ROW_BYTES,
            sums = in(reg) sums,
            sum_stride = in(reg) sum_stride,
            options(nostack),
        );
    }
}

/// [`multiply_tile`] for [`WIDE`] column blocks of `b`, `b_block` bytes apart (one `a`
/// tile read once per step for four sums).
///
/// # Safety
/// As [`multiply_tile`], for every block.
#[inline(always)]
unsafe fn multiply_tiles(
    (sums, sum_stride, sum_block): Sums,
    (a, a_stride): (*const u16, usize),
    (b, b_block): (*const u32, usize),
    steps: usize,
) {
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a} + {a_stride}*1]",
            "mov {p}, {b}",
            "tileloadd tmm5, [{p} + {row}*1]",
            "tdpbf16ps tmm0, tmm4, tmm5",
            "add {p}, {b_block}",
            "tileloadd tmm6, [{p} + {row}*1]",
            "tdpbf16ps tmm1, tmm4, tmm6",
            "add {p}, {b_block}",
            "tileloadd tmm7, [{p} + {row}*1]",
            "tdpbf16ps tmm2, tmm4, tmm7",
            "add {p}, {b_block}",
            "tileloadd tmm5, [{p} + {row}*1]",
            "tdpbf16ps tmm3, tmm4, tmm5",
            "add {a}, 64",
            "add {b}, 1024",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{sums} + {sum_stride}*1], tmm0",
            "add {sums}, {sum_block}",
            "tilestored [{sums} + {sum_stride}*1], tmm1",
            "add {sums}, {sum_block}",
            "tilestored [{sums} + {sum_stride}*1], tmm2",
            "add {sums}, {sum_block}",
            "tilestored [{sums} + {sum_stride}*1], tmm3",
            a = inout(reg) a => _,
            b = inout(reg) b => _,
            p = out(reg) _,
            steps = inout(reg) steps => _,
            sums = inout(reg) sums => _,
            a_stride = in(reg) a_stride,
            b_block = in(reg) b_block,
            row = in(reg) ROW_BYTES,
            sum_stride = in(reg) sum_stride,
            sum_block = in(reg) sum_block,
            options(nostack),
        );
    }
}

/// Two blocks of 16 rows of `a` (`a[0]`, `a[1]`) times two column blocks of `b` (`b`,
/// `b_block` bytes on): four tiles of sums, each tile of `a` and of `b` read once per
/// step for two of them (half the panel's reads of [`multiply_tiles`] per sum, which
/// streams the panel from the core's second-level cache). The second row block's sums
/// are `second` bytes after the first's.
///
/// # Safety
/// As [`multiply_tile`], for both row blocks and both column blocks.
#[inline(always)]
unsafe fn multiply_tiles_2x2(
    (sums, sum_stride, sum_block, second): (*mut f32, usize, usize, usize),
    a: [(*const u16, usize); 2],
    (b, b_block): (*const u32, usize),
    steps: usize,
) {
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {a0_stride}*1]",
            "tileloadd tmm6, [{b} + {row}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a1} + {a1_stride}*1]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "mov {p}, {b}",
            "add {p}, {b_block}",
            "tileloadd tmm7, [{p} + {row}*1]",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b}, 1024",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{sums} + {sum_stride}*1], tmm0",
            "mov {p}, {sums}",
            "add {p}, {sum_block}",
            "tilestored [{p} + {sum_stride}*1], tmm1",
            "add {sums}, {second}",
            "tilestored [{sums} + {sum_stride}*1], tmm2",
            "add {sums}, {sum_block}",
            "tilestored [{sums} + {sum_stride}*1], tmm3",
            a0 = inout(reg) a[0].0 => _,
            a1 = inout(reg) a[1].0 => _,
            b = inout(reg) b => _,
            p = out(reg) _,
            steps = inout(reg) steps => _,
            sums = inout(reg) sums => _,
            a0_stride = in(reg) a[0].1,
            a1_stride = in(reg) a[1].1,
            b_block = in(reg) b_block,
            row = in(reg) ROW_BYTES,
            sum_stride = in(reg) sum_stride,
            sum_block = in(reg) sum_block,
            second = in(reg) second,
            options(nostack),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The f32 value of bf16 bits.
    fn widen(bits: u16) -> f64 {
        f64::from(f32::from_bits(u32::from(bits) << 16))
    }

    /// A matrix `[rows x columns]` stored row-major or column-major.
    fn strides(rows: usize, columns: usize, by_columns: bool) -> (isize, isize) {
        let _ = columns;
        if by_columns {
            (1, rows as isize)
        } else {
            (columns as isize, 1)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(160))]

        /// On tiles and on `vdpbf16ps` (where the host has them), every layout, sizes
        /// that do not fill a tile (0, 1, 15, 17, 33 ...) and that do (32 and 64 deep,
        /// blocks of 16 columns), columns of several slices of the panel, operands
        /// rounded here or read from rounded buffers, `c` written or added to: the f64
        /// sums of the roundings' products, to f32 accuracy.
        #[test]
        fn products_equal_the_sums_of_the_roundings(
            m in prop_oneof![0usize..40, Just(32usize), Just(48)],
            k in prop_oneof![0usize..70, Just(32usize), Just(64)],
            n in prop_oneof![0usize..40, Just(32usize), Just(64), 100usize..300],
            a_by_columns in any::<bool>(),
            b_by_columns in any::<bool>(),
            (from_buffer, add) in (0..3, any::<bool>()),
            seed in any::<u32>(),
            units in prop_oneof![Just(Units::Tiles), Just(Units::Dot)],
        ) {
            let has = match units {
                Units::Tiles => usable(),
                Units::Dot => crate::dot::host_has(),
            };
            if !has {
                eprintln!("skipped: this host has no {units:?} units");
                return Ok(());
            }
            let value = |index: usize| {
                let x = (index as u32).wrapping_mul(2654435761).wrapping_add(seed);
                (x % 2001) as f32 / 1000.0 - 1.0 + 1.0 / 3.0
            };
            let a: Vec<f32> = (0..m * k).map(value).collect();
            let b: Vec<f32> = (0..k * n).map(|i| value(i + 7919)).collect();
            let (a_rows, a_columns) = strides(m, k, a_by_columns);
            let (b_rows, b_columns) = strides(k, n, b_by_columns);
            // Operands rounded here, read from roundings held as bf16 bits (in place
            // where they can be), or from roundings held as f32.
            let buffers = (from_buffer > 0).then(|| unsafe {
                let rounded = |values: &[f32]| {
                    if from_buffer == 1 {
                        RoundedBuffer::as_bf16(values.as_ptr(), values.len())
                    } else {
                        RoundedBuffer::new(values.as_ptr(), values.len(), 1)
                    }
                };
                (rounded(&a), rounded(&b))
            });
            let before = if add { 0.25 } else { f32::NAN };
            let mut c = vec![before; m * n];
            c.push(f32::NAN);
            // Scratch poisoned with bf16 NaNs: a slot the tiles read but no packing wrote
            // makes sums NaN.
            SCRATCH.with_borrow_mut(|scratch| {
                scratch.a.clear();
                scratch.a.resize(1 << 16, 0xffc0);
                scratch.panel.poison(1 << 16);
            });
            let finished = RefCell::new(Vec::new());
            unsafe {
                product(
                    units,
                    (m, k, n),
                    0.5,
                    (
                        Left::Values(((a.as_ptr(), a_rows, a_columns), buffers.as_ref().map(|(a, _)| a))),
                        Right::Values(((b.as_ptr(), b_rows, b_columns), buffers.as_ref().map(|(_, b)| b))),
                    ),
                    ((c.as_mut_ptr(), n as isize, 1), add),
                    &|first, last| finished.borrow_mut().push((first, last)),
                );
            }
            for row in 0..m {
                for column in 0..n {
                    let expected: f64 = (0..k)
                        .map(|i| {
                            let x = a[(row as isize * a_rows + i as isize * a_columns) as usize];
                            let y = b[(i as isize * b_rows + column as isize * b_columns) as usize];
                            widen(round(x)) * widen(round(y))
                        })
                        .sum::<f64>()
                        * 0.5
                        + if add { 0.25 } else { 0.0 };
                    let got = f64::from(c[row * n + column]);
                    prop_assert!(
                        (got - expected).abs() <= 1e-5 * (1.0 + expected.abs()),
                        "c[{row}][{column}] = {got}, expected {expected}"
                    );
                }
            }
            // Nothing past `c` is written.
            prop_assert!(c[m * n].is_nan());
            // Every row handed over as finished once, in order.
            let finished = finished.into_inner();
            let mut next = 0;
            for &(first, last) in &finished {
                prop_assert!(first == next && last >= first, "{:?} for {} rows", finished, m);
                next = last;
            }
            prop_assert_eq!(next, m, "{:?}", finished);
        }
    }

    /// The tap rows of a weight packed straight from it (16 columns gathered at once in
    /// AVX-512 where the host has it, the other columns and odd channel counts one by
    /// one) are the pairs of the weight's bf16 roundings, ties to even, NaNs quiet,
    /// infinities kept, zeros past the rows, forward and flipped (adjoint) taps.
    #[test]
    fn tap_rows_pack_the_roundings_of_the_weight() {
        let specials = [
            f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0xffff_ffff),
            f32::INFINITY,
            -0.0,
            1.0 + f32::EPSILON * 64.0,
            3.0e38,
        ];
        for (channels, taps, columns, adjoint) in [
            (4usize, 3usize, 35usize, false),
            (4, 3, 32, true),
            (3, 5, 17, false),
        ] {
            let k = channels * taps;
            let len = columns * channels * taps;
            let weight: Vec<f32> = (0..len)
                .map(|i| match i % 13 {
                    0..=6 => specials[i % 13],
                    _ => (i as f32 * 0.377).sin() * 1.0e-3,
                })
                .collect();
            // Forward `[j, c, t]`; adjoint `[c, j, t]` with flipped taps.
            let rows = match adjoint {
                false => TapRows {
                    channels,
                    taps,
                    columns,
                    first: 0,
                    strides: ((channels * taps) as isize, taps as isize, 1),
                },
                true => TapRows {
                    channels,
                    taps,
                    columns,
                    first: taps as isize - 1,
                    strides: (taps as isize, (columns * taps) as isize, -1),
                },
            };
            let value = |j: usize, row: usize| {
                let (c, t) = (row % channels, row / channels);
                let at = rows.first
                    + j as isize * rows.strides.0
                    + c as isize * rows.strides.1
                    + t as isize * rows.strides.2;
                weight[at as usize]
            };
            let mut panel = Panel::default();
            panel.poison(1 << 12);
            // SAFETY: the weight holds every value the rows name.
            unsafe { panel.pack_tap_rows(weight.as_ptr(), rows, 2) };
            for j in 0..columns {
                for pair in 0..panel.depth() / 2 {
                    let half = |row: usize| match row < k {
                        true => u32::from(round(value(j, row))),
                        false => 0,
                    };
                    let expected = half(2 * pair) | (half(2 * pair + 1) << 16);
                    // SAFETY: the panel holds every column block's pairs.
                    let got = unsafe {
                        *panel
                            .column_block(j / TILE_COLUMNS)
                            .add(pair * TILE_COLUMNS + j % TILE_COLUMNS)
                    };
                    assert_eq!(
                        got, expected,
                        "{channels} channels, {taps} taps, column {j}, pair {pair}, adjoint {adjoint}"
                    );
                }
            }
        }
    }
}
