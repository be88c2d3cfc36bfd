//! What a run knows of its lengths: every lengths buffer's values, offsets, longest
//! element and row owners, and the number of rows of every slot computed from them.

use rustc_hash::FxHashMap as HashMap;
use std::borrow::Cow;
use std::sync::Arc;

use nestor_ir::SliceBounds;
use nestor_ir::{DType, Window2d};
use nestor_passes::{LengthsKind, Program, Repeats, RowBase, RowMap, Rows, Slot, Source};

use super::{InputData, RuntimeError};
use nestor_layout::{
    in_one_piece, window_taps_in_parts, FillTaps, Outside, WindowError, WindowTaps,
};

/// What a run knows about one lengths input: its values borrowed from the run's input
/// (or computed, for derived lengths).
pub struct LengthsInfo<'a> {
    /// Every element's length.
    pub lengths: Cow<'a, [i64]>,
    /// Where each element starts, and the total at the end (`lengths.len() + 1` values).
    pub offsets: Vec<i64>,
    /// The longest length (0 for an empty batch): the row stride of a padded grid.
    pub longest: i64,
    /// For every packed row, the element that owns it (built on first use).
    owners: std::cell::OnceCell<Vec<i64>>,
}

impl<'a> LengthsInfo<'a> {
    /// The info of `lengths`, its offsets written into `offsets` (its memory reused).
    pub fn new(lengths: Cow<'a, [i64]>, mut offsets: Vec<i64>) -> Self {
        offsets.clear();
        offsets.reserve(lengths.len() + 1);
        offsets.push(0);
        for &length in lengths.iter() {
            offsets.push(offsets.last().copied().unwrap_or(0) + length);
        }
        Self {
            longest: lengths.iter().copied().max().unwrap_or(0),
            lengths,
            offsets,
            owners: Default::default(),
        }
    }

    /// For every packed row, the element that owns it.
    pub fn owners(&self) -> &Vec<i64> {
        self.owners.get_or_init(|| {
            self.lengths
                .iter()
                .enumerate()
                .flat_map(|(element, &length)| std::iter::repeat_n(element as i64, length as usize))
                .collect()
        })
    }
}

/// The lengths of one run, by the slot of each lengths buffer (a program has a handful:
/// a list, searched in order, costs less per run than a map).
pub struct Sizes<'a> {
    lengths: Vec<(Slot, LengthsInfo<'a>)>,
    /// The pair layouts' row maps built so far (kept for the run: kernels read them).
    pair_maps: std::cell::RefCell<HashMap<RowMap, Box<[i64]>>>,
    /// The window steps' taps built so far, by geometry and image sizes (a model's
    /// layers share them).
    window_taps: std::cell::RefCell<HashMap<(Window2d, Slot, Slot), Arc<WindowTaps>>>,
}

/// Where each element's pairs `[M_i, N_i]` start, then their total (`None` when a sum
/// overflows; buffers sized by the same products never do, checked all the same).
pub(crate) fn pair_offsets(rows: &[i64], columns: &[i64]) -> Option<Vec<i64>> {
    let mut offsets = Vec::with_capacity(rows.len() + 1);
    offsets.push(0i64);
    let mut total = 0i64;
    for (&m, &n) in rows.iter().zip(columns) {
        total = total.checked_add(m.checked_mul(n)?)?;
        offsets.push(total);
    }
    Some(offsets)
}

impl<'a> Sizes<'a> {
    /// Reads the lengths inputs of `program` from `inputs` (an error for a missing or
    /// negative length; borrowed, not copied) and computes the lengths its
    /// `lengths_ops` derive from them. Offsets go into the buffers of `spare` while it
    /// has some ([`Sizes::recycle`] gives them back).
    pub(crate) fn of_run(
        program: &Program,
        inputs: &[InputData<'a>],
        spare: &mut Vec<Vec<i64>>,
    ) -> Result<Self, RuntimeError> {
        let bad = |input: usize, reason: String| RuntimeError::BadInput { input, reason };
        // The lengths inputs: (slot, input) of each slot that is its own batch's lengths.
        let lengths_inputs = || {
            program
                .slots
                .iter()
                .enumerate()
                .filter_map(|(index, info)| {
                    let slot = Slot(index as u32);
                    match (info.source, info.dtype, info.rows.base) {
                        (Source::Input(input), DType::I64, RowBase::Batch(own)) if own == slot => {
                            Some((slot, input))
                        }
                        _ => None,
                    }
                })
        };
        let mut sizes = Self {
            lengths: Vec::with_capacity(lengths_inputs().count() + program.lengths_ops.len()),
            pair_maps: Default::default(),
            window_taps: Default::default(),
        };
        for (slot, input) in lengths_inputs() {
            let Some(&InputData::I64(values)) = inputs.get(input) else {
                return Err(bad(input, "expected lengths (i64)".into()));
            };
            if let Some((element, &length)) = values.iter().enumerate().find(|(_, &l)| l < 0) {
                return Err(bad(
                    input,
                    format!("element {element} has negative length {length}"),
                ));
            }
            sizes.insert(slot, Cow::Borrowed(values), spare.pop());
        }
        for op in &program.lengths_ops {
            let lengths_of = |slot: Slot| sizes.get(slot).map_or(&[][..], |info| &info.lengths[..]);
            let input = lengths_of(op.input);
            let values: Vec<i64> = match op.kind {
                LengthsKind::Window {
                    kernel,
                    stride,
                    padding,
                    dilation,
                } => input
                    .iter()
                    .map(|&length| {
                        nestor_ir::window_output_size(length, kernel, stride, padding, dilation)
                    })
                    .collect(),
                LengthsKind::Repeated { times } => {
                    let times = lengths_of(times);
                    let count = times
                        .iter()
                        .try_fold(0usize, |sum, &t| sum.checked_add(usize::try_from(t).ok()?));
                    let mut values = Vec::new();
                    if count.is_none_or(|count| values.try_reserve_exact(count).is_err()) {
                        return Err(RuntimeError::OutOfMemory {
                            step: 0,
                            what: "the segments of a pair layout".into(),
                            bytes: u64::MAX,
                            budget: crate::MemoryBudget::bytes(),
                        });
                    }
                    for (&length, &t) in input.iter().zip(times) {
                        values.extend(std::iter::repeat_n(length, t as usize));
                    }
                    values
                }
                LengthsKind::Times { by } => {
                    let by = lengths_of(by);
                    let product = |(element, (&length, &by)): (usize, (&i64, &i64))| {
                        length.checked_mul(by).ok_or(RuntimeError::OutOfMemory {
                            step: 0,
                            what: format!("element {element}'s {length} x {by} rows"),
                            bytes: u64::MAX,
                            budget: crate::MemoryBudget::bytes(),
                        })
                    };
                    input
                        .iter()
                        .zip(by)
                        .enumerate()
                        .map(product)
                        .collect::<Result<_, _>>()?
                }
                LengthsKind::Constant { size } => vec![size; input.len()],
                LengthsKind::Repeat(repeats) => {
                    let batch = input.len() as i64;
                    let count = usize::try_from(batch.saturating_mul(repeats.times)).unwrap_or(0);
                    (0..count as i64)
                        .map(|index| input[repeats.source(index, batch) as usize])
                        .collect()
                }
                LengthsKind::Slice(bounds) => {
                    input.iter().map(|&length| bounds.length(length)).collect()
                }
                LengthsKind::Checked { against } => {
                    let against = lengths_of(against);
                    let differs = (0..input.len().max(against.len()))
                        .find(|&element| input.get(element) != against.get(element));
                    if let Some(element) = differs {
                        let size = |lengths: &[i64]| lengths.get(element).copied().unwrap_or(-1);
                        return Err(RuntimeError::LengthsDiffer {
                            element,
                            left: size(input),
                            right: size(against),
                        });
                    }
                    input.to_vec()
                }
                LengthsKind::AtLeast { count, op: name } => {
                    if let Some(element) = input.iter().position(|&length| length < count) {
                        return Err(RuntimeError::TooShort {
                            op: name,
                            element,
                            length: input[element],
                            needed: count,
                        });
                    }
                    input.to_vec()
                }
            };
            sizes.insert(op.out, Cow::Owned(values), spare.pop());
        }
        Ok(sizes)
    }

    /// Records the lengths of `slot` (replacing any before), with `offsets`' memory
    /// for their offsets if given.
    fn insert(&mut self, slot: Slot, lengths: Cow<'a, [i64]>, offsets: Option<Vec<i64>>) {
        self.lengths.retain(|(known, _)| *known != slot);
        let info = LengthsInfo::new(lengths, offsets.unwrap_or_default());
        self.lengths.push((slot, info));
    }

    /// Ends the run: the offsets buffers go to `spare` for the next.
    pub(crate) fn recycle(self, spare: &mut Vec<Vec<i64>>) {
        spare.extend(self.lengths.into_iter().map(|(_, info)| info.offsets));
    }

    /// The values of `map` for this run, built on first use: an input row for every
    /// output row. `None` when a lengths buffer is unknown or the map cannot be
    /// allocated.
    pub fn row_map(&self, map: RowMap) -> Option<(*const i64, usize)> {
        let (rows, columns) = match map {
            RowMap::Owners(slot) => {
                let owners = self.get(slot)?.owners();
                return Some((owners.as_ptr(), owners.len()));
            }
            RowMap::PairRows(rows, columns)
            | RowMap::PairColumns(rows, columns)
            | RowMap::PairTransposed(rows, columns) => (rows, columns),
            RowMap::Repeated(lengths, _)
            | RowMap::Copy(lengths, ..)
            | RowMap::Sliced(lengths, _)
            | RowMap::Unsliced(lengths, _) => (lengths, lengths),
        };
        let mut maps = self.pair_maps.borrow_mut();
        if let std::collections::hash_map::Entry::Vacant(entry) = maps.entry(map) {
            let values = match map {
                RowMap::Repeated(_, repeats) => repeat_map(self.get(rows)?, repeats, None)?,
                RowMap::Copy(_, repeats, copy) => repeat_map(self.get(rows)?, repeats, Some(copy))?,
                RowMap::Sliced(_, bounds) => slice_map(self.get(rows)?, bounds, false)?,
                RowMap::Unsliced(_, bounds) => slice_map(self.get(rows)?, bounds, true)?,
                _ => pair_map(map, self.get(rows)?, self.get(columns)?)?,
            };
            entry.insert(values);
        }
        maps.get(&map).map(|values| (values.as_ptr(), values.len()))
    }

    /// The taps of `window` over images of the heights and widths in these lengths
    /// buffers, built on first use (taps outside an image are -1).
    pub fn window_taps(
        &self,
        window: Window2d,
        slots: (Slot, Slot),
    ) -> Result<Arc<WindowTaps>, WindowError> {
        self.window_taps_filled_by(window, slots, &in_one_piece)
    }

    /// [`Sizes::window_taps`], its table filled by `fill` on first use (a backend splits
    /// it over its threads).
    pub fn window_taps_filled_by(
        &self,
        window: Window2d,
        (heights, widths): (Slot, Slot),
        fill: FillTaps<'_>,
    ) -> Result<Arc<WindowTaps>, WindowError> {
        let key = (window, heights, widths);
        if let Some(taps) = self.window_taps.borrow().get(&key) {
            return Ok(taps.clone());
        }
        let sizes = |slot: Slot| self.get(slot).map_or(&[][..], |info| &info.lengths[..]);
        let taps = Arc::new(window_taps_in_parts(
            &window,
            (sizes(heights), sizes(widths)),
            Outside::Marked,
            fill,
        )?);
        self.window_taps.borrow_mut().insert(key, taps.clone());
        Ok(taps)
    }

    /// What the run knows of the lengths buffer `slot`.
    pub fn get(&self, slot: Slot) -> Option<&LengthsInfo<'a>> {
        self.lengths
            .iter()
            .find_map(|(known, info)| (*known == slot).then_some(info))
    }

    /// The number of elements in the batch of lengths buffer `slot`.
    pub fn batch(&self, slot: Slot) -> i64 {
        self.get(slot).map_or(0, |info| info.lengths.len() as i64)
    }

    /// The number of rows `rows` stands for in this run.
    ///
    /// Counts saturate at `i64::MAX`: a count that large is over any memory budget, so
    /// the step that would allocate it fails with `OutOfMemory` rather than wrapping.
    pub fn rows(&self, rows: Rows) -> i64 {
        let base = match rows.base {
            RowBase::Volume(first, second) => match (self.get(first), self.get(second)) {
                (Some(a), Some(b)) => a
                    .lengths
                    .iter()
                    .zip(b.lengths.iter())
                    .fold(0i64, |sum, (x, y)| sum.saturating_add(x.saturating_mul(*y))),
                _ => 0,
            },
            RowBase::One => 1,
            RowBase::Total(slot) => self
                .get(slot)
                .map_or(0, |info| info.offsets.last().copied().unwrap_or(0)),
            RowBase::Batch(slot) => self.batch(slot),
            RowBase::Padded(slot) => self.get(slot).map_or(0, |info| {
                (info.lengths.len() as i64).saturating_mul(info.longest)
            }),
        };
        base.saturating_mul(rows.factor)
    }

    /// The number of scalars slot `slot` of `program` holds in this run (saturating, as
    /// [`Sizes::rows`]).
    pub fn scalars(&self, program: &Program, slot: Slot) -> i64 {
        let info = program.info(slot);
        self.rows(info.rows).saturating_mul(info.width)
    }

    /// [`Sizes::scalars`] as a buffer length.
    pub fn elements(&self, program: &Program, slot: Slot) -> usize {
        self.scalars(program, slot).max(0) as usize
    }
}

/// The values of a pair layout's row map (`rows`, `columns`: the lengths `M`, `N` of
/// the layout `[M_i, N_i, ...]` it reads for); `None` when they cannot be allocated.
/// The rows of a repeat of a batch of `lengths` (one leading ragged dim): without a
/// `copy`, the row each row of the repeated batch copies; with one, the row of the
/// repeated batch that is copy `copy` of each row. `None` when it cannot be allocated.
fn repeat_map(
    lengths: &LengthsInfo<'_>,
    repeats: Repeats,
    copy: Option<i64>,
) -> Option<Box<[i64]>> {
    let batch = i64::try_from(lengths.lengths.len()).ok()?;
    let elements = batch.checked_mul(repeats.times)?;
    let rows = |element: i64| -> Option<(i64, i64)> {
        let element = usize::try_from(element).ok()?;
        Some((lengths.offsets[element], lengths.lengths[element]))
    };
    // Where each element of the repeated batch starts.
    let mut starts = Vec::new();
    starts
        .try_reserve_exact(usize::try_from(elements).ok()?)
        .ok()?;
    let mut total = 0i64;
    for index in 0..elements {
        starts.push(total);
        total = total.checked_add(rows(repeats.source(index, batch))?.1)?;
    }
    let mut values: Vec<i64> = Vec::new();
    match copy {
        None => {
            values
                .try_reserve_exact(usize::try_from(total).ok()?)
                .ok()?;
            for index in 0..elements {
                let (first, count) = rows(repeats.source(index, batch))?;
                values.extend(first..first + count);
            }
        }
        Some(copy) => {
            values
                .try_reserve_exact(lengths.offsets.last().copied().unwrap_or(0) as usize)
                .ok()?;
            for element in 0..batch {
                let start = starts[usize::try_from(repeats.copy_of(element, copy, batch)).ok()?];
                values.extend(start..start + rows(element)?.1);
            }
        }
    }
    Some(values.into_boxed_slice())
}

/// The rows of a slice `bounds` of the leading ragged dim of a batch of `lengths` (one
/// ragged dim): the row of the batch each row of the slice is, or (`back`) the row of
/// the slice each row of the batch is, -1 for those outside it. `None` when it cannot
/// be allocated.
fn slice_map(lengths: &LengthsInfo<'_>, bounds: SliceBounds, back: bool) -> Option<Box<[i64]>> {
    let mut values: Vec<i64> = Vec::new();
    let count = match back {
        true => lengths.offsets.last().copied().unwrap_or(0),
        false => lengths
            .lengths
            .iter()
            .try_fold(0i64, |sum, &length| sum.checked_add(bounds.length(length)))?,
    };
    values
        .try_reserve_exact(usize::try_from(count).ok()?)
        .ok()?;
    let mut sliced = 0i64;
    for (&length, &first) in lengths.lengths.iter().zip(lengths.offsets.iter()) {
        let kept = bounds.resolve(length);
        if back {
            values.extend((0..length).map(|position| match kept.contains(&position) {
                true => sliced + position - kept.start,
                false => -1,
            }));
        } else {
            values.extend(first + kept.start..first + kept.end);
        }
        sliced += kept.end - kept.start;
    }
    Some(values.into_boxed_slice())
}

fn pair_map(map: RowMap, rows: &LengthsInfo<'_>, columns: &LengthsInfo<'_>) -> Option<Box<[i64]>> {
    let total: i64 = rows
        .lengths
        .iter()
        .zip(columns.lengths.iter())
        .try_fold(0i64, |sum, (m, n)| sum.checked_add(m.checked_mul(*n)?))?;
    let mut values: Vec<i64> = Vec::new();
    values
        .try_reserve_exact(usize::try_from(total).ok()?)
        .ok()?;
    let mut pairs_start = 0;
    for (element, (&m, &n)) in rows.lengths.iter().zip(columns.lengths.iter()).enumerate() {
        let (row_start, column_start) = (rows.offsets[element], columns.offsets[element]);
        for i in 0..m {
            match map {
                RowMap::PairRows(..) => {
                    values.extend(std::iter::repeat_n(row_start + i, n as usize))
                }
                RowMap::PairColumns(..) => values.extend(column_start..column_start + n),
                // Row (i, j) of [M, N] reads row (j, i) of [N, M].
                _ => values.extend((0..n).map(|j| pairs_start + j * m + i)),
            }
        }
        pairs_start += m * n;
    }
    Some(values.into_boxed_slice())
}
