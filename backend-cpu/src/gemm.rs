//! GEMM steps: row chunks on the team (`crate::team`), each multiplied on its thread
//! (`Scalar::product`: the process's MKL, else the `gemm` crate) onto its bias written
//! first, then the step's epilogue kernel run on its rows while they are in cache.

use crate::KernelFn;

use std::sync::Mutex;

use nestor_passes::Products;

use crate::bf16::RoundedBuffer;
use crate::blas::Gemm;
use crate::finish::Finish;
use crate::parallel::{worker_threads, Args};
use crate::scalar::Scalar;

/// The sizes of one GEMM.
#[derive(Clone, Copy)]
pub(super) struct GemmShape {
    pub(super) rows: i64,
    pub(super) k: i64,
    pub(super) n: i64,
    /// W is `[k, n]` rather than `[n, k]`.
    pub(super) transposed: bool,
}

/// `out[rows x n] = x[rows x k] W^T + bias` (W is `[n, k]`, or `[k, n]` when
/// `transposed`), the product's operands as `products` says; with `rounds_output` (a
/// later product reads `out` rounded), each chunk of rows rounded as soon as it is
/// written and its epilogue has run, the roundings kept for the run (`crate::kept`).
///
/// # Safety
/// The buffers must hold `rows*n`, `rows*k`, `n*k` and `n` values of type `T`.
pub(super) unsafe fn gemm<T: Gemm>(
    out: *mut u8,
    x: *const u8,
    weight: *const u8,
    bias: Option<*mut u8>,
    (shape, products): (GemmShape, Products),
    epilogue: Option<(KernelFn, Args<'_>)>,
    rounds_output: bool,
) {
    let buffers = GemmBuffers {
        out: out as *mut T,
        x: x as *const T,
        weight: weight as *const T,
        bias: bias.map(|bias| bias as *const T),
    };
    let threads = worker_threads();
    let large = shape.rows * shape.k * shape.n >= gemm_parallel_macs();
    // Chunks of rows on rayon's pool (the pool the kernels use; `NESTOR_THREADS`).
    let chunks = if large {
        threads.min(shape.rows / 16).max(1)
    } else {
        1
    };
    // With bf16 products, the weight, which every chunk reads, and the input are rounded
    // once (or were, for an earlier step of the run: `crate::kept`).
    let round = |buffer: *const T, values: i64| {
        // SAFETY: the weight holds n*k values, the input rows*k (the caller vouches).
        unsafe { T::rounded_buffer(products, buffer, values.max(0) as usize, threads as usize) }
    };
    let rounded = (
        round(buffers.x, shape.rows * shape.k),
        round(buffers.weight, shape.n * shape.k),
    );
    let rounded = (rounded.0.as_deref(), rounded.1.as_deref());
    let output_values = (shape.rows.max(0) * shape.n.max(0)) as usize;
    let producing = rounds_output
        .then(|| T::producing(products, buffers.out, output_values))
        .flatten();
    // Each chunk writes its own rows of `out`, then the epilogue (a pointwise kernel
    // over those rows, reading buffers the program sized) rewrites them in place and
    // they are rounded, a block of rows at a time, so that the roundings read what the
    // epilogue wrote from the core's cache.
    let finishing = Finish {
        epilogue,
        producing: producing.as_ref(),
        width: shape.n.max(0) as usize,
    };
    let finish = move |first: i64, end: i64| unsafe {
        // SAFETY: the product wrote rows `first..end`, this chunk's alone.
        finishing.rows(first.max(0) as usize, end.max(0) as usize)
    };
    let rows = move |start: i64, end: i64| unsafe {
        // The product hands its rows over as it finishes them (on AMX tiles, a block of
        // rows at a time, still in the core's cache).
        let finished =
            |first: usize, last: usize| finish(start + first as i64, start + last as i64);
        gemm_rows(buffers, (shape, products, rounded), (start, end), &finished);
    };
    if chunks == 1 {
        rows(0, shape.rows);
    } else {
        crate::Parallelism::count_split();
        let per_chunk = (shape.rows + chunks - 1) / chunks;
        crate::team::for_each_chunk(chunks as usize, threads as usize, &|chunk| {
            let chunk = chunk as i64;
            rows(chunk * per_chunk, ((chunk + 1) * per_chunk).min(shape.rows))
        });
    }
    if let Some(producing) = producing {
        crate::kept::produced(producing.finish());
    }
}

/// Multiply-adds from which a GEMM is split across the cores.
fn gemm_parallel_macs() -> i64 {
    crate::Parallelism::current().gemm_macs as i64
}

/// The roundings of a GEMM's input and weight, if made (bf16 products).
type RoundedPair<'a> = (Option<&'a RoundedBuffer>, Option<&'a RoundedBuffer>);

/// The buffers of a GEMM, shared by the tasks that compute its row chunks.
struct GemmBuffers<T> {
    out: *mut T,
    x: *const T,
    weight: *const T,
    bias: Option<*const T>,
}
impl<T> Clone for GemmBuffers<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for GemmBuffers<T> {}
unsafe impl<T> Send for GemmBuffers<T> {}
unsafe impl<T> Sync for GemmBuffers<T> {}

/// Rows `start..end` of a GEMM, on this thread: the bias (if any) written first and the
/// product added to it (one pass over the rows fewer than adding the bias after; the
/// library would otherwise clear them first), or with nestor's own bf16 products, which
/// hand rows over in groups that fit the core's cache, added to each group of rows as
/// it is handed over (the same sums: `bias + product`). A GEMM with an epilogue comes
/// without a bias: the epilogue adds it (`fold_epilogue` in the passes). `finished`
/// gets the rows (from `start`) as they are done (`Gemm::product_finishing`).
///
/// # Safety
/// The buffers must hold `rows*n`, `rows*k`, `n*k` and `n` values of type `T`.
unsafe fn gemm_rows<T: Gemm>(
    buffers: GemmBuffers<T>,
    (shape, products, (rounded_x, rounded_weight)): (GemmShape, Products, RoundedPair<'_>),
    (start, end): (i64, i64),
    finished: crate::blas::Finished<'_>,
) {
    let GemmShape {
        k, n, transposed, ..
    } = shape;
    let rows = end - start;
    if rows <= 0 || n == 0 {
        return finished(0, rows.max(0) as usize);
    }
    let bias_as_handed =
        buffers.bias.is_some() && products == Products::Bf16 && crate::bf16::own_products();
    unsafe {
        let out = buffers.out.offset((start * n) as isize);
        let values = std::slice::from_raw_parts_mut(out, (rows * n) as usize);
        match buffers.bias {
            Some(_) if bias_as_handed && k > 0 => {}
            Some(bias) => {
                let bias = std::slice::from_raw_parts(bias, n as usize);
                for row in values.chunks_mut(n as usize) {
                    row.copy_from_slice(bias);
                }
            }
            // No inner products: the output is zeros.
            None if k == 0 => values.fill(T::ZERO),
            None => {}
        }
        if k == 0 {
            return finished(0, rows as usize);
        }
        let weight = if transposed {
            (buffers.weight, n as isize, 1)
        } else {
            (buffers.weight, 1, k as isize)
        };
        // With the bias added as rows are handed over: to each group, then the caller's
        // epilogue.
        let add_bias = |first: usize, last: usize| {
            if let Some(bias) = buffers.bias {
                // SAFETY: rows `first..last` of this thread's rows, which the product
                // hands over done (it writes them no more).
                let (bias, rows) = (
                    std::slice::from_raw_parts(bias, n as usize),
                    std::slice::from_raw_parts_mut(
                        out.add(first * n as usize),
                        (last - first) * n as usize,
                    ),
                );
                crate::vectors::widest(
                    #[inline(always)]
                    || {
                        for row in rows.chunks_exact_mut(n as usize) {
                            for (value, &bias) in row.iter_mut().zip(bias) {
                                *value = bias + *value;
                            }
                        }
                    },
                );
            }
            finished(first, last)
        };
        T::product_finishing(
            products,
            ((rows as usize, k as usize, n as usize), T::ONE),
            (
                (
                    (buffers.x.offset((start * k) as isize), k as isize, 1),
                    rounded_x,
                ),
                (weight, rounded_weight),
            ),
            (
                (out, n as isize, 1),
                buffers.bias.is_some() && !bias_as_handed,
            ),
            if bias_as_handed { &add_bias } else { finished },
        );
    }
}

/// `out[m x n] = sum over rows r of a[r]^T b[r]` (`a` absent: ones, `m` = 1, the column
/// sums of `b`, or with `times` of `b * times`, each product rounded as a pointwise
/// step's), divided by `rows` when `mean` (NaN for no rows, as torch's mean). Large
/// products split the output rows across the cores; column sums add the partial sums of
/// blocks of [`SUM_BLOCK_ROWS`] rows or more (split across the cores when large)
/// [`pairwise`] in block order, so the result does not depend on the split. Products'
/// operands are as `products` says.
///
/// With `plain` (column sums of `b * times`), the column sums of `b` alone are written
/// there in the same read of `b`.
///
/// # Safety
/// `out` must hold `m*n` values of type `T`, `a` (when given) `rows*m`, `b` and `times`
/// (when given) `rows*n`, `plain` (when given) `n`; `times` only without `a`, `plain`
/// only with `times`.
pub(super) unsafe fn sum_rows<T: Gemm>(
    (out, plain): (*mut u8, Option<*mut u8>),
    (a, b, times): (Option<*const u8>, *const u8, Option<*const u8>),
    (rows, m, n): (i64, i64, i64),
    (mean, products): (bool, Products),
) {
    let (rows, m, n) = (rows.max(0) as usize, m.max(0) as usize, n.max(0) as usize);
    if m * n == 0 {
        return;
    }
    let out = unsafe { std::slice::from_raw_parts_mut(out as *mut T, m * n) };
    let plain = plain
        .filter(|_| times.is_some() && a.is_none())
        .map(|plain| unsafe { std::slice::from_raw_parts_mut(plain as *mut T, n) });
    let threads = worker_threads().max(1) as usize;
    // Products split as GEMMs do; column sums read each value once, as a pointwise
    // kernel, and split at its grain.
    let grain = match a {
        Some(_) => gemm_parallel_macs(),
        None => crate::Parallelism::current().kernel_scalars as i64,
    };
    let parallel = (rows * m * n) as i64 >= grain && threads > 1;
    if rows == 0 {
        out.fill(T::ZERO);
        if let Some(plain) = plain {
            plain.fill(T::ZERO);
        }
    } else if let Some(a) = a {
        let a = a as *const T;
        let buffers = SumBuffers {
            out: out.as_mut_ptr(),
            a,
            b: b as *const T,
        };
        // Tasks take their own rows of `out`, or their own columns when `out` is wider
        // than tall: each task packs the operand it reads whole, and that is then the
        // narrower (the feed-forward's second weight gradient, `256 x L . L x 1024`,
        // took 2.85-2.92 ms split by columns against 2.99-3.07 by rows on a 2-core
        // Xeon, f32). Either way each sum is made in one order, whatever the split.
        let by_columns = n > m;
        let along = if by_columns { n } else { m };
        let chunks = if parallel {
            threads.min(along / 8).max(1)
        } else {
            1
        };
        let per_chunk = along.div_ceil(chunks);
        // With bf16 products, `a` and `b` (which every chunk reads whole) are rounded
        // once, or were for an earlier step of the run (`crate::kept`: the GEMMs whose
        // input and output gradient they are).
        // SAFETY: `a` holds rows*m values, `b` rows*n (the caller vouches).
        let rounded = unsafe {
            (
                T::rounded_buffer(products, buffers.a, rows * m, threads),
                T::rounded_buffer(products, buffers.b, rows * n, threads),
            )
        };
        let rounded = (rounded.0.as_deref(), rounded.1.as_deref());
        // Output rows (or columns) `first..first + count`.
        let product = move |first: usize, count: usize| unsafe {
            let part = (first, count, by_columns);
            buffers.product(part, (rows, m, n), (products, rounded))
        };
        if let Some(block_rows) = product_block_rows((rows, m, n), products) {
            // SAFETY: the buffers as the caller vouches.
            unsafe {
                buffers.product_by_blocks(
                    (rows, m, n),
                    (block_rows, if parallel { threads } else { 1 }),
                    (products, rounded),
                )
            };
        } else if chunks == 1 {
            product(0, along);
        } else {
            crate::Parallelism::count_split();
            crate::team::for_each_chunk(chunks, threads, &|chunk| {
                let first = chunk * per_chunk;
                product(first, per_chunk.min(along - first))
            });
        }
    } else {
        let b = unsafe { std::slice::from_raw_parts(b as *const T, rows * n) };
        let times =
            times.map(|times| unsafe { std::slice::from_raw_parts(times as *const T, rows * n) });
        // Partial sums of blocks of a fixed number of rows, added in block order: the
        // same arithmetic however many threads share the blocks.
        let block_rows = SUM_BLOCK_ROWS.max(SUM_BLOCK_VALUES / n);
        let blocks: Vec<&[T]> = b.chunks(block_rows * n).collect();
        let times_blocks: Vec<Option<&[T]>> = match times {
            Some(times) => times.chunks(block_rows * n).map(Some).collect(),
            None => vec![None; blocks.len()],
        };
        let threads = if parallel { threads } else { 1 };
        if threads > 1 && blocks.len() > 1 {
            crate::Parallelism::count_split();
        }
        let partials: Vec<Mutex<Vec<T>>> = blocks.iter().map(|_| Mutex::new(Vec::new())).collect();
        let with_plain = plain.is_some();
        crate::team::for_each_chunk(blocks.len(), threads, &|block| {
            let sums = column_sums_and_plain(blocks[block], times_blocks[block], n, with_plain);
            *partials[block]
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = sums;
        });
        let partials = partials.into_iter().map(|partial| {
            partial
                .into_inner()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
        });
        let add = |mut sums: Vec<T>, more: Vec<T>| {
            sums.iter_mut()
                .zip(more)
                .for_each(|(sum, value)| *sum += value);
            sums
        };
        let sums = pairwise(partials, add);
        let (sums, more) = match &sums {
            Some(sums) => sums.split_at(n.min(sums.len())),
            None => (&[][..], &[][..]),
        };
        for (out, sums) in
            std::iter::once((&mut *out, sums)).chain(plain.map(|plain| (plain, more)))
        {
            if sums.len() == out.len() {
                out.copy_from_slice(sums);
            } else {
                out.fill(T::ZERO);
            }
        }
    }
    finish_mean(out, rows, mean)
}

/// The sum of `parts` (in order) with `add`, added pairwise: each part's sum merges with
/// the last sum of as many parts, as a binary counter carries, so that a value passes
/// through about `log2(parts)` adds rather than up to `parts` (the rounding error of
/// `n` values grows with `log n`, as torch's cascade sums, not with `n`). `None` for no
/// parts.
#[inline(always)]
fn pairwise<P>(parts: impl Iterator<Item = P>, add: impl Fn(P, P) -> P) -> Option<P> {
    // Sums of 2^level parts, the levels decreasing from the bottom of the stack.
    let mut sums: Vec<(P, u32)> = Vec::new();
    for part in parts {
        let (mut sum, mut level) = (part, 0);
        while sums.last().is_some_and(|&(_, last)| last == level) {
            let Some((earlier, _)) = sums.pop() else {
                break;
            };
            (sum, level) = (add(earlier, sum), level + 1);
        }
        sums.push((sum, level));
    }
    // The unmerged sums, smallest first.
    let mut sums = sums.into_iter().rev().map(|(sum, _)| sum);
    let last = sums.next()?;
    Some(sums.fold(last, |total, earlier| add(earlier, total)))
}

/// Rows of both operands a block of a long product `a^T b` reads at most
/// ([`product_block_rows`]): their bf16 roundings, packed for the tiles, stay in a
/// core's cache (1 MiB).
const PRODUCT_BLOCK_BYTES: usize = 1 << 20;

/// The rows per block of a product `a^T b` of `rows` rows (`m` and `n` values) summed
/// block by block, each block's sums apart and then added in order ([`SumBuffers::
/// product_by_blocks`]), or `None` to multiply it whole: with bf16 products on the
/// process's own units (which pack both operands whole, then read the packed `b` once
/// per 16 rows of `a`), when the rows are many more than a block holds and the blocks'
/// sums are small against what they read. The weight gradient of ResNet-50's first 1x1
/// convolutions, `256 x 40754 . 40754 x 64`, took 6.2 ms whole on a 2-core Xeon with AMX.
fn product_block_rows((rows, m, n): (usize, usize, usize), products: Products) -> Option<usize> {
    if products != Products::Bf16 || !crate::bf16::own_products() {
        return None;
    }
    let row_bytes = 2 * (m.next_multiple_of(16) + n.next_multiple_of(16));
    let block_rows = (PRODUCT_BLOCK_BYTES / row_bytes.max(1)) / 32 * 32;
    let blocks = rows.div_ceil(block_rows.max(1));
    // Each block's sums (f32) at most a quarter of the roundings it reads.
    let sums_small =
        m.saturating_mul(n).saturating_mul(4).saturating_mul(4) <= block_rows * row_bytes;
    (block_rows >= 256 && blocks >= 2 && sums_small).then_some(block_rows)
}

/// Rows per block of a column sum (blocks enough for the cores from a few hundred rows)
/// ...
const SUM_BLOCK_ROWS: usize = 256;
/// ... unless the block would hold fewer values than this (narrow sums: a block's own
/// costs would outweigh its adds).
const SUM_BLOCK_VALUES: usize = 1 << 16;

/// Divides the sums in `out` by `rows` when they are to be a `mean`.
fn finish_mean<T: Scalar>(out: &mut [T], rows: usize, mean: bool) {
    if mean {
        let count = T::from_f64(rows as f64);
        out.iter_mut().for_each(|value| *value = *value / count);
    }
}

/// Columns [`column_sums`] adds at a time, their sums in registers (four AVX-512
/// vectors of f32; a row's 64 values are four whole cache lines).
const SUM_LANES: usize = 64;

/// The sums of the columns of `values` (times `times` value for value, when given, each
/// product rounded before it is added), rows of `width` (at least 1): each column added
/// row by row in runs of [`SUM_RUN_ROWS`] rows, the runs' sums [`pairwise`],
/// [`SUM_LANES`] columns at a time with their sums in registers (rather than a row's
/// worth of sums in memory, each row's adds waiting on the last row's stores), compiled
/// for the widest vectors of the host.
pub(super) fn column_sums<T: Scalar>(values: &[T], times: Option<&[T]>, width: usize) -> Vec<T> {
    column_sums_and_plain(values, times, width, false)
}

/// [`column_sums`], followed with `plain` (and `times`) by the column sums of `values`
/// alone made in the same read, bit for bit [`column_sums`] of `values`: `width` values,
/// or twice as many.
fn column_sums_and_plain<T: Scalar>(
    values: &[T],
    times: Option<&[T]>,
    width: usize,
    plain: bool,
) -> Vec<T> {
    let plain = plain && times.is_some();
    if width == 1 {
        let single = |times: Option<&[T]>| {
            let runs = (0..values.len()).step_by(SUM_RUN_ROWS * crate::scalar::LANES);
            let run_sum = |first: usize| {
                let run =
                    &values[first..(first + SUM_RUN_ROWS * crate::scalar::LANES).min(values.len())];
                match times {
                    Some(times) => {
                        let products: Vec<T> = run
                            .iter()
                            .zip(&times[first..])
                            .map(|(&v, &t)| v * t)
                            .collect();
                        crate::scalar::sum_of(&products)
                    }
                    None => crate::scalar::sum_of(run),
                }
            };
            pairwise(runs.map(run_sum), |a, b| a + b).unwrap_or(T::ZERO)
        };
        let mut sums = vec![single(times)];
        if plain {
            sums.push(single(None));
        }
        return sums;
    }
    let mut sums = vec![T::ZERO; width * (1 + usize::from(plain))];
    let (products, plain_sums) = sums.split_at_mut(width);
    crate::vectors::widest(
        #[inline(always)]
        || {
            // Sums of columns from `at`, and with `plain` those of the values alone.
            let mut write = |at: usize, sums: &[T], more: &[T]| {
                products[at..at + sums.len()].copy_from_slice(sums);
                if plain {
                    plain_sums[at..at + more.len()].copy_from_slice(more);
                }
            };
            let mut first = 0;
            while first < width {
                // `SUM_LANES` columns at a time, the last narrower ones in registers of
                // eight, then one by one.
                match width - first {
                    left if left >= SUM_LANES => {
                        let (sums, more) =
                            chunk_sums::<T, SUM_LANES>(values, times, width, first, plain);
                        write(first, &sums, &more);
                        first += SUM_LANES;
                    }
                    left if left >= 8 => {
                        let (sums, more) = chunk_sums::<T, 8>(values, times, width, first, plain);
                        write(first, &sums, &more);
                        first += 8;
                    }
                    _ => {
                        let (sums, more) = chunk_sums::<T, 1>(values, times, width, first, plain);
                        write(first, &sums, &more);
                        first += 1;
                    }
                }
            }
        },
    );
    sums
}

/// Rows a column sum adds in order before the sums of such runs are added [`pairwise`].
const SUM_RUN_ROWS: usize = 64;

/// The sums of columns `first..first + N` of `values` (times `times`, when given): row
/// by row in runs of [`SUM_RUN_ROWS`] rows, the runs' sums added [`pairwise`]; with
/// `plain` (and `times`) also those of `values` alone, the same way (else zeros).
#[inline(always)]
fn chunk_sums<T: Scalar, const N: usize>(
    values: &[T],
    times: Option<&[T]>,
    width: usize,
    first: usize,
    plain: bool,
) -> ([T; N], [T; N]) {
    let run_values = width * SUM_RUN_ROWS;
    // The runs' sums made in a loop here, not in an iterator's `next` (compiled apart,
    // without the caller's vectors: a profile of ResNet-50's training step found 18% of
    // its time there, in SSE).
    let mut runs = Vec::with_capacity(values.len().div_ceil(run_values.max(1)));
    for start in (0..values.len()).step_by(run_values.max(1)) {
        let run = &values[start..(start + run_values).min(values.len())];
        let mut lanes = [T::ZERO; N];
        let mut plain_lanes = [T::ZERO; N];
        match times {
            Some(times) => {
                let factors = &times[start..start + run.len()];
                let rows = run.chunks_exact(width).zip(factors.chunks_exact(width));
                if plain {
                    for (row, factors) in rows {
                        let columns = row[first..first + N].iter().zip(&factors[first..first + N]);
                        for ((lane, plain), (&value, &factor)) in
                            lanes.iter_mut().zip(plain_lanes.iter_mut()).zip(columns)
                        {
                            *lane += value * factor;
                            *plain += value;
                        }
                    }
                } else {
                    for (row, factors) in rows {
                        let columns = row[first..first + N].iter().zip(&factors[first..first + N]);
                        for (lane, (&value, &factor)) in lanes.iter_mut().zip(columns) {
                            *lane += value * factor;
                        }
                    }
                }
            }
            None => {
                for row in run.chunks_exact(width) {
                    for (lane, &value) in lanes.iter_mut().zip(&row[first..first + N]) {
                        *lane += value;
                    }
                }
            }
        }
        runs.push((lanes, plain_lanes));
    }
    let add = |(mut sums, mut plain): ([T; N], [T; N]), (more, more_plain): ([T; N], [T; N])| {
        for (sum, value) in sums.iter_mut().zip(more) {
            *sum += value;
        }
        for (sum, value) in plain.iter_mut().zip(more_plain) {
            *sum += value;
        }
        (sums, plain)
    };
    pairwise(runs.into_iter(), add).unwrap_or(([T::ZERO; N], [T::ZERO; N]))
}

/// The buffers of a row sum, shared by the tasks of its output chunks.
#[derive(Clone, Copy)]
struct SumBuffers<T> {
    out: *mut T,
    a: *const T,
    b: *const T,
}
unsafe impl<T> Send for SumBuffers<T> {}
unsafe impl<T> Sync for SumBuffers<T> {}

impl<T: Gemm> SumBuffers<T> {
    /// Rows `first..first + count` of `out = a^T b` (its columns, `by_columns`), `a`'s
    /// columns read with swapped strides (no copy).
    ///
    /// # Safety
    /// The buffers must hold `rows*m`, `rows*n` and `m*n` values, `first + count` at
    /// most `m` (`n`).
    unsafe fn product(
        self,
        (first, count, by_columns): (usize, usize, bool),
        (rows, m, n): (usize, usize, usize),
        (products, (rounded_a, rounded_b)): (Products, RoundedPair<'_>),
    ) {
        let (a, b, out, shape) = if by_columns {
            // SAFETY: within `b` and `out` (the caller vouches).
            unsafe {
                (
                    self.a,
                    self.b.add(first),
                    self.out.add(first),
                    (m, rows, count),
                )
            }
        } else {
            // SAFETY: within `a` and `out`.
            unsafe {
                (
                    self.a.add(first),
                    self.b,
                    self.out.add(first * n),
                    (count, rows, n),
                )
            }
        };
        unsafe {
            T::product_rounded(
                products,
                (shape, T::ONE),
                (
                    ((a, 1, m as isize), rounded_a),
                    ((b, n as isize, 1), rounded_b),
                ),
                ((out, n as isize, 1), false),
            )
        }
    }

    /// `sums [m x n] = a^T b` over rows `first..first + count` of `a` and `b`.
    ///
    /// # Safety
    /// The rows must lie within `a` and `b`; `sums` must hold `m*n` values.
    unsafe fn product_of_rows(
        self,
        (first, count): (usize, usize),
        (m, n): (usize, usize),
        sums: *mut T,
        products: Products,
        (rounded_a, rounded_b): RoundedPair<'_>,
    ) {
        // SAFETY: as the caller vouches.
        unsafe {
            T::product_rounded(
                products,
                ((m, count, n), T::ONE),
                (
                    ((self.a.add(first * m), 1, m as isize), rounded_a),
                    ((self.b.add(first * n), n as isize, 1), rounded_b),
                ),
                ((sums, n as isize, 1), false),
            )
        }
    }

    /// `out = a^T b` as the sums of blocks of `block_rows` rows (tasks of `threads` of
    /// the team), each block's sums into its own `m x n`, then added in block order: the
    /// same arithmetic however many threads share them.
    ///
    /// # Safety
    /// The buffers must hold `rows*m`, `rows*n` and `m*n` values.
    unsafe fn product_by_blocks(
        self,
        (rows, m, n): (usize, usize, usize),
        (block_rows, threads): (usize, usize),
        (products, rounded): (Products, RoundedPair<'_>),
    ) {
        let size = m * n;
        let blocks = rows.div_ceil(block_rows);
        // Every value is written: each block's product overwrites its sums.
        let mut partials = crate::spare::Lent::<T>::new(blocks * size);
        let sums = crate::parallel::SendPointer(partials.as_mut_ptr());
        if threads > 1 {
            crate::Parallelism::count_split();
        }
        crate::team::for_each_chunk(blocks, threads, &|block| {
            let first = block * block_rows;
            let rows = (first, block_rows.min(rows - first));
            // SAFETY: the rows lie within `a` and `b`; block `block`'s sums are this
            // task's alone.
            unsafe {
                self.product_of_rows(
                    rows,
                    (m, n),
                    sums.get().add(block * size),
                    products,
                    rounded,
                )
            }
        });
        // SAFETY: `out` holds `m*n` values (the caller vouches).
        let out = unsafe { std::slice::from_raw_parts_mut(self.out, size) };
        let mut blocks = partials.chunks_exact(size);
        if let Some(first) = blocks.next() {
            out.copy_from_slice(first);
        }
        for block in blocks {
            crate::vectors::widest(
                #[inline(always)]
                || {
                    for (sum, &value) in out.iter_mut().zip(block) {
                        *sum += value;
                    }
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    //! The GPU's GEMM template (sum, bias and epilogue in one kernel), generated for the
    //! host and compared with this module's GEMM followed by the epilogue kernel; the
    //! column sums.

    use super::*;
    use crate::KernelSet;
    use nestor_ir::{BinaryOp, UnaryOp};
    use nestor_passes::{Access, Expr, Fusion, Program, Rows, Slot, Step};
    use proptest::prelude::*;

    /// A long column sum's rounding error grows with the log of its rows: a million
    /// rows of 0.1 in f32, one column or three, within `(SUM_RUN_ROWS + log2(runs) +
    /// 2) * epsilon` of the exact sum (a plain loop in order is far outside it), and
    /// `sum_rows`' mean of them as close.
    #[test]
    fn long_column_sums_stay_accurate() {
        for width in 1usize..4 {
            let rows = 1_000_003;
            let values = vec![0.1f32; rows * width];
            let exact = rows as f64 * f64::from(0.1f32);
            let runs = rows.div_ceil(SUM_RUN_ROWS) as f64;
            let bound = (SUM_RUN_ROWS as f64 + runs.log2() + 2.0) * f64::from(f32::EPSILON);
            let error = |sum: f32| (f64::from(sum) - exact).abs() / exact;
            let in_order = values
                .iter()
                .step_by(width)
                .fold(0.0f32, |sum, &value| sum + value);
            assert!(
                error(in_order) > 10.0 * bound,
                "in order: {:e}",
                error(in_order)
            );
            for (column, sum) in column_sums(&values, None, width).into_iter().enumerate() {
                assert!(
                    error(sum) <= bound,
                    "column {column}: {:e} over {bound:e}",
                    error(sum)
                );
            }
            let mut means = vec![f32::NAN; width];
            // `means` holds `width` values, `values` rows * width.
            unsafe {
                sum_rows::<f32>(
                    (means.as_mut_ptr() as *mut u8, None),
                    (None, values.as_ptr() as *const u8, None),
                    (rows as i64, 1, width as i64),
                    (true, Products::Float),
                )
            };
            for mean in means {
                let error = (f64::from(mean) - exact / rows as f64).abs() / (exact / rows as f64);
                assert!(error <= bound + f64::from(f32::EPSILON), "mean: {error:e}");
            }
        }
    }

    /// A long product `a^T b` with bf16 products, summed block by block where the
    /// process's own units make them ([`product_block_rows`]), equals the f64 sum of the
    /// products of the roundings (only the sums' order differs), rows past a whole
    /// number of blocks included.
    #[test]
    fn long_products_of_roundings_sum_by_blocks() {
        let round =
            |value: f32| f64::from(f32::from_bits(u32::from(crate::bf16::round(value)) << 16));
        for (m, n) in [(48, 16), (5, 33)] {
            let rows = 3 * PRODUCT_BLOCK_BYTES / (2 * (m + n)) + 77;
            if crate::bf16::own_products() {
                assert!(product_block_rows((rows, m, n), Products::Bf16).is_some());
            }
            let value = |index: usize, scale: f32| (index as f32 * scale).sin() * 3.0;
            let a: Vec<f32> = (0..rows * m).map(|index| value(index, 0.37)).collect();
            let b: Vec<f32> = (0..rows * n).map(|index| value(index, 0.11)).collect();
            let mut out = vec![f32::NAN; m * n];
            // `a` holds rows * m values, `b` rows * n, `out` m * n.
            unsafe {
                sum_rows::<f32>(
                    (out.as_mut_ptr() as *mut u8, None),
                    (Some(a.as_ptr() as *const u8), b.as_ptr() as *const u8, None),
                    (rows as i64, m as i64, n as i64),
                    (false, Products::Bf16),
                )
            };
            for (at, &got) in out.iter().enumerate() {
                let (i, j) = (at / n, at % n);
                let (mut exact, mut magnitude) = (0f64, 0f64);
                for row in 0..rows {
                    let term = round(a[row * m + i]) * round(b[row * n + j]);
                    exact += term;
                    magnitude += term.abs();
                }
                let error = (f64::from(got) - exact).abs();
                assert!(
                    error <= 1e-5 * magnitude,
                    "{m}x{n}: sum {at}: {got} against {exact} (magnitude {magnitude})"
                );
            }
        }
    }

    proptest! {
        /// Column sums of two or more columns add each column's values row by row, in
        /// order, in runs of `SUM_RUN_ROWS` rows, and the runs' sums pairwise, whatever the
        /// width (chunks of 64, of eight, then one by one): bit for bit that definition.
        /// (One column is `scalar::sum_of`, summed in lanes.)
        #[test]
        fn column_sums_add_runs_of_rows_pairwise(
            (rows, width) in (0usize..300, prop_oneof![2usize..21, 60usize..140]),
            seed in 0u32..100,
        ) {
            let values: Vec<f32> = (0..rows * width)
                .map(|index| ((index as u32 * 7 + seed) as f32 * 0.37).sin() * 1e3)
                .collect();
            /// `parts` added as a binary tree, its left subtree the largest power of two
            /// of them that leaves some for the right.
            fn tree(parts: &[f32]) -> f32 {
                match parts.len() {
                    0 => 0.0,
                    1 => parts[0],
                    count => {
                        let left = 1 << (usize::BITS - 1 - (count - 1).leading_zeros());
                        tree(&parts[..left]) + tree(&parts[left..])
                    }
                }
            }
            let expected: Vec<f32> = (0..width)
                .map(|column| {
                    let runs: Vec<f32> = (0..rows)
                        .step_by(SUM_RUN_ROWS)
                        .map(|first| {
                            (first..rows.min(first + SUM_RUN_ROWS))
                                .fold(0.0, |sum, row| sum + values[row * width + column])
                        })
                        .collect();
                    tree(&runs)
                })
                .collect();
            let actual = column_sums(&values, None, width);
            prop_assert_eq!(
                actual.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }

        /// Column sums of a product (`times`) are bit for bit those of the product
        /// made first, as a pointwise step makes it, whatever the width (one column
        /// too), with or without the plain sums of the values beside them.
        #[test]
        fn column_sums_of_products_are_the_sums_of_the_products(
            (rows, width) in (0usize..300, prop_oneof![1usize..21, 60usize..140]),
            seed in 0u32..100,
        ) {
            let value = |index: usize, scale: f32| ((index as u32 * 7 + seed) as f32 * scale).sin() * 1e3;
            let values: Vec<f32> = (0..rows * width).map(|index| value(index, 0.37)).collect();
            let times: Vec<f32> = (0..rows * width).map(|index| value(index, 0.11)).collect();
            let products: Vec<f32> = values.iter().zip(&times).map(|(v, t)| v * t).collect();
            let bits = |sums: Vec<f32>| sums.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            prop_assert_eq!(
                bits(column_sums(&values, Some(&times), width)),
                bits(column_sums(&products, None, width))
            );
            // With the plain sums beside them, made in the same read: both halves bit
            // for bit the sums made apart.
            let mut apart = column_sums(&products, None, width);
            apart.extend(column_sums(&values, None, width));
            prop_assert_eq!(
                bits(column_sums_and_plain(&values, Some(&times), width, true)),
                bits(apart)
            );
        }

        #[test]
        fn the_gemm_template_equals_the_library_gemm_and_its_epilogue(
            (rows, k, n) in (0i64..6, 1i64..7, prop_oneof![1i64..6, 30i64..70]),
            transposed in any::<bool>(),
            with_bias in any::<bool>(),
            with_epilogue in any::<bool>(),
        ) {
            let GemmCase { program, x, weight, bias, residual } =
                gemm_case((rows, k, n), transposed, (with_bias, with_epilogue));
            let pointer = |values: &[f32]| values.as_ptr() as *mut u8;
            let bias_pointer = with_bias.then(|| pointer(&bias));

            let mut expected = vec![f32::NAN; (rows * n) as usize];
            let library = crate::compile_with(&program, KernelSet::Library)
                .unwrap_or_else(|error| panic!("{error}"));
            let out = expected.as_mut_ptr() as *mut u8;
            let epilogue_args = [out, out, pointer(&residual)];
            let epilogue = library.kernel(0).map(|kernel| (kernel, Args(&epilogue_args)));
            let shape = GemmShape { rows, k, n, transposed };
            // The buffers hold rows*n, rows*k, k*n and n values.
            unsafe {
                gemm::<f32>(out, pointer(&x), pointer(&weight), bias_pointer, (shape, Products::Float), epilogue, false)
            };

            let mut actual = vec![f32::NAN; (rows * n) as usize];
            let null = std::ptr::null_mut();
            let out = actual.as_mut_ptr() as *mut u8;
            let args = [out, pointer(&x), pointer(&weight), bias_pointer.unwrap_or(null), out, pointer(&residual)];
            // The same buffers, over rows x n output values.
            unsafe { crate::testing::run_template(program.steps[0].clone(), &args, rows * n) };
            for (index, (a, e)) in actual.iter().zip(&expected).enumerate() {
                prop_assert!((a - e).abs() <= 1e-5 * (1.0 + e.abs()), "value {index}: {a} vs {e}");
            }
        }
    }

    /// A GEMM's epilogue reads the GEMM's result through the output's own pointer (the
    /// args table's entry loaded once, its other buffer, the residual, once): with two
    /// loaded pointers that may alias, LLVM checked their distance at run time, found it
    /// 0, and ran the scalar loop.
    #[test]
    fn an_epilogue_reads_its_output_through_the_outputs_pointer() {
        let GemmCase { program, .. } = gemm_case((4, 3, 64), false, (true, true));
        let library = crate::compile_with(&program, KernelSet::Library)
            .unwrap_or_else(|error| panic!("{error}"));
        let ir = library.llvm_ir();
        let loaded = ir
            .lines()
            .filter(|line| line.contains("= load ptr, ptr"))
            .count();
        assert_eq!(loaded, 2, "{ir}");
    }

    /// A program of one GEMM step, `[rows x k] -> n`, with a bias and an epilogue
    /// (`relu(out) + residual`, reading the output in place) where asked, and its operands.
    struct GemmCase {
        program: Program,
        x: Vec<f32>,
        weight: Vec<f32>,
        bias: Vec<f32>,
        residual: Vec<f32>,
    }

    fn gemm_case(
        (rows, k, n): (i64, i64, i64),
        transposed: bool,
        (with_bias, with_epilogue): (bool, bool),
    ) -> GemmCase {
        let values = |count: i64, seed: f32| -> Vec<f32> {
            (0..count)
                .map(|index| (index as f32 * 0.37 + seed).sin() * 2.0)
                .collect()
        };
        let epilogue = with_epilogue.then(|| Fusion {
            inputs: vec![Access::rows(Slot(0), n), Access::rows(Slot(4), n)],
            expr: Expr::Binary(
                BinaryOp::Add,
                Box::new(Expr::Unary(UnaryOp::Relu, Box::new(Expr::Load(0)))),
                Box::new(Expr::Load(1)),
            ),
        });
        let step = Step::Gemm(nestor_passes::step::Gemm {
            out: Slot(0),
            x: Slot(1),
            weight: Slot(2),
            bias: with_bias.then_some(Slot(3)),
            rows: Rows::fixed(rows),
            k,
            n,
            transposed,
            epilogue,
        });
        GemmCase {
            program: Program {
                steps: vec![step],
                ..Program::default()
            },
            x: values(rows * k, 0.1),
            weight: values(k * n, 0.7),
            bias: values(n, 1.3),
            residual: values(rows * n, 2.9),
        }
    }

    /// A GEMM that rounds its output as it writes it leaves, for the run's later
    /// steps, the roundings of the output's final values (after the epilogue).
    fn check_produced_roundings(rows: i64, (k, n): (i64, i64), with_epilogue: bool) {
        let GemmCase {
            program,
            x,
            weight,
            bias,
            residual,
        } = gemm_case((rows, k, n), false, (true, with_epilogue));
        let library = crate::compile_with(&program, KernelSet::Library)
            .unwrap_or_else(|error| panic!("{error}"));
        let pointer = |values: &[f32]| values.as_ptr() as *mut u8;
        let mut output = vec![f32::NAN; (rows * n) as usize];
        let out = output.as_mut_ptr() as *mut u8;
        let epilogue_args = [out, out, pointer(&residual)];
        let epilogue = library
            .kernel(0)
            .map(|kernel| (kernel, Args(&epilogue_args)));
        let shape = (
            GemmShape {
                rows,
                k,
                n,
                transposed: false,
            },
            Products::Bf16,
        );
        let written = crate::bf16::values_range(output.as_ptr(), output.len());
        let step = |first, last| crate::kept::StepOf {
            run: u64::MAX - 3,
            first,
            last,
        };
        // SAFETY: the buffers hold rows*n, rows*k, n*k and n values.
        crate::kept::in_step(step(true, false), &[written], || unsafe {
            gemm::<f32>(
                out,
                pointer(&x),
                pointer(&weight),
                Some(pointer(&bias)),
                shape,
                epilogue,
                true,
            )
        });
        let finished = output.clone();
        // Written behind the run's back: only roundings kept from the GEMM still hold
        // the values it wrote.
        output.fill(f32::NAN);
        // SAFETY: `output` holds rows*n values.
        let kept = crate::kept::in_step(step(false, true), &[], || unsafe {
            crate::kept::rounded(output.as_ptr(), output.len(), 1)
        });
        for (index, value) in finished.iter().enumerate() {
            let expected = f32::from_bits(u32::from(crate::bf16::round(*value)) << 16);
            let found = kept.value_of((output[index..].as_ptr(), 1, 1));
            assert_eq!(
                found.to_bits(),
                expected.to_bits(),
                "value {index} of {rows} x {n}"
            );
        }
    }

    #[test]
    fn a_gemm_rounding_its_output_keeps_the_roundings_of_its_final_values() {
        // One chunk and (on more than one core) several; with and without an epilogue.
        // Several blocks of rows a chunk, the last one partial.
        for (rows, k, n) in [
            (1, 1, 1),
            (5, 3, 7),
            (600, 64, 64),
            (601, 64, 65),
            (301, 8, 1024),
        ] {
            for with_epilogue in [false, true] {
                check_produced_roundings(rows, (k, n), with_epilogue);
            }
        }
    }
}

/// Where the elements of a jagged-pair GEMM start in its three buffers, and their
/// sizes: for element `i`, `(rows M_i, columns N_i)` and the offsets (in values) of its
/// `a`, `b` and `out` blocks.
pub(super) struct PairBlocks {
    pub(super) sizes: Vec<(i64, i64)>,
    pub(super) starts: Vec<[i64; 3]>,
}

impl PairBlocks {
    /// The blocks of a scores (`mix == false`) or mix GEMM of `width`, from the row and
    /// column lengths (same batch size, checked by the caller).
    pub(super) fn new(rows: &[i64], columns: &[i64], width: i64, mix: bool) -> Self {
        let sizes: Vec<(i64, i64)> = rows.iter().copied().zip(columns.iter().copied()).collect();
        let mut starts = Vec::with_capacity(sizes.len());
        let mut at = [0i64; 3];
        for &(m, n) in &sizes {
            starts.push(at);
            // Scores: a [m, width], b [n, width], out [m, n]; mix: a [m, n], b [n, width],
            // out [m, width].
            let (a, out) = if mix {
                (m * n, m * width)
            } else {
                (m * width, m * n)
            };
            at = [at[0] + a, at[1] + n * width, at[2] + out];
        }
        Self { sizes, starts }
    }
}

/// The jagged-pair matmul, one GEMM per element (elements split across the team):
/// scores `out_i [m, n] = a_i [m, width] b_i^T` (b_i `[n, width]`), or mix
/// `out_i [m, width] = a_i [m, n] b_i [n, width]`. An element with an empty inner dim
/// gets zeros.
///
/// # Safety
/// The buffers must hold the values `blocks` places in them, of type `T`.
pub(super) unsafe fn pair_gemm<T: Gemm>(
    (out, a, b): (*mut u8, *const u8, *const u8),
    blocks: &PairBlocks,
    width: i64,
    mix: bool,
) {
    let buffers = PairBuffers {
        out: out as *mut T,
        a: a as *const T,
        b: b as *const T,
    };
    let element = |i: usize| {
        let (m, n) = blocks.sizes[i];
        let [at_a, at_b, at_out] = blocks.starts[i];
        // SAFETY (the whole block): the offsets and sizes come from the lengths the
        // buffers were sized by; elements write disjoint blocks of `out`.
        if m == 0 || (n == 0 && !mix) {
            return; // nothing to write
        }
        unsafe {
            let (a, b, out) = buffers.at([at_a, at_b, at_out]);
            let w = width as isize;
            let (mu, nu, wu) = (m as usize, n as usize, width as usize);
            if mix {
                if n == 0 {
                    std::ptr::write_bytes(out, 0, mu * wu);
                    return;
                }
                T::matmul(
                    (mu, nu, wu),
                    T::ONE,
                    (a, n as isize, 1),
                    (b, w, 1),
                    (out, w, 1),
                );
            } else {
                if width == 0 {
                    std::ptr::write_bytes(out, 0, mu * nu);
                    return;
                }
                // b^T: element (k, j) of b^T is b[j, k].
                T::matmul(
                    (mu, wu, nu),
                    T::ONE,
                    (a, w, 1),
                    (b, 1, w),
                    (out, n as isize, 1),
                );
            }
        }
    };
    let count = blocks.sizes.len();
    let macs = blocks.sizes.iter().fold(0i64, |sum, &(m, n)| {
        sum.saturating_add(m.saturating_mul(n).saturating_mul(width))
    });
    let threads = if macs >= gemm_parallel_macs() {
        worker_threads() as usize
    } else {
        1
    };
    crate::team::for_each_chunk(count, threads, &|i| element(i));
}

/// The buffers of a jagged-pair GEMM, shared by the team's threads (each writes its own
/// elements' blocks of `out`).
#[derive(Clone, Copy)]
struct PairBuffers<T> {
    out: *mut T,
    a: *const T,
    b: *const T,
}
// SAFETY: the blocks each thread writes are disjoint (see `pair_gemm`).
unsafe impl<T> Send for PairBuffers<T> {}
unsafe impl<T> Sync for PairBuffers<T> {}

impl<T> PairBuffers<T> {
    /// The blocks of `a`, `b` and `out` that start at these offsets (in values).
    ///
    /// # Safety
    /// The offsets must lie within the buffers.
    unsafe fn at(self, [a, b, out]: [i64; 3]) -> (*const T, *const T, *mut T) {
        unsafe {
            (
                self.a.add(a as usize),
                self.b.add(b as usize),
                self.out.add(out as usize),
            )
        }
    }
}
