//! What a backend's host steps see of a run: every slot's buffer, the lengths, the
//! inputs, the host runner and the run's number, and the CPU kernels' argument lists
//! written from a step's signature.

use nestor_passes::{Arg, Program, Signature, Slot, Source};

use super::sizes::{pair_offsets, LengthsInfo, Sizes};
use super::{HostRunner, InputData, RuntimeError};

/// What every step of one run reads: the buffers of every slot (an alias's is its
/// root's), the lengths, the inputs and the host runner.
pub struct RunState<'r, 'i> {
    /// The program that runs.
    pub(super) program: &'r Program,
    /// The buffer of every slot that has its own memory (null for aliases).
    pub(super) pointers: &'r [*mut u8],
    /// The slot whose memory each slot uses (itself, unless it is an alias).
    pub(super) roots: &'r [Slot],
    pub(super) sizes: &'r Sizes<'i>,
    pub(super) inputs: &'r [InputData<'i>],
    pub(super) host: Option<&'r dyn HostRunner>,
    /// The run's number (keys its random masks).
    pub(super) run: u64,
    /// The argument list kernels are given (reused by every step).
    pub(super) args: &'r std::cell::RefCell<KernelArgs>,
}

/// A CPU kernel's argument list, the numbers its scalar arguments (a longest length,
/// a row count, a mask key) point to, and the index of ids it reads. Reused by every
/// step of a run.
#[derive(Default)]
pub(super) struct KernelArgs {
    pointers: Vec<*mut u8>,
    numbers: Vec<i64>,
    index: Vec<i64>,
    pairs: Vec<i64>,
}

impl KernelArgs {
    /// Empty, the memory kept.
    pub(super) fn clear(&mut self) {
        self.pointers.clear();
        self.numbers.clear();
        self.index.clear();
        self.pairs.clear();
    }
}

impl<'r, 'i> RunState<'r, 'i> {
    /// The program that runs.
    pub fn program(&self) -> &'r Program {
        self.program
    }

    /// The buffer of `slot` (its root's, for an alias): sized for the run's lengths, its
    /// values written by the step that computes it, or the caller's input.
    pub fn pointer(&self, slot: Slot) -> *mut u8 {
        self.pointers[self.roots[slot.0 as usize].0 as usize]
    }

    /// The run's lengths, offsets and row counts.
    pub fn sizes(&self) -> &'r Sizes<'i> {
        self.sizes
    }

    /// The lengths buffer `slot`, if the run knows it.
    pub fn lengths(&self, slot: Slot) -> Option<&'r LengthsInfo<'i>> {
        self.sizes.get(slot)
    }

    /// The offsets of lengths buffer `slot` (null when the run does not know it).
    pub fn offsets(&self, slot: Slot) -> *mut u8 {
        self.lengths(slot).map_or(std::ptr::null_mut(), |info| {
            info.offsets.as_ptr() as *mut u8
        })
    }

    /// The run's inputs, one per graph input.
    pub fn inputs(&self) -> &'r [InputData<'i>] {
        self.inputs
    }

    /// Which graph input `slot` is, with its data (`None` for other slots).
    pub fn input(&self, slot: Slot) -> Option<(usize, &'r InputData<'i>)> {
        match self.program.info(slot).source {
            Source::Input(input) => Some((input, self.inputs.get(input)?)),
            _ => None,
        }
    }

    /// The values of ids `slot` for step `index`: an i64 input's, or those an earlier
    /// step computed into the program's buffer.
    fn ids(&self, index: usize, slot: Slot) -> Result<&[i64], RuntimeError> {
        match self.input(slot) {
            Some((_, InputData::I64(values))) => Ok(values),
            None if self.program.info(slot).integers => {
                let count = self.sizes.elements(self.program, slot);
                if count == 0 {
                    return Ok(&[]);
                }
                // The executor sized the buffer for `count` i64 values of this run, and
                // the step that writes it ran before this one.
                Ok(unsafe { std::slice::from_raw_parts(self.pointer(slot) as *const i64, count) })
            }
            _ => Err(step_error(index, "scattered ids that are not i64".into())),
        }
    }

    /// What runs host steps, if the caller gave one.
    pub fn host(&self) -> Option<&'r dyn HostRunner> {
        self.host
    }

    /// The run's number (keys its random masks: [`mask_key`]).
    pub fn run(&self) -> u64 {
        self.run
    }

    /// The run's argument list for step `index`'s kernel of `signature`: the CPU's
    /// kernels take buffers, offsets, row maps, pointers to the numbers of a longest
    /// length, a row count and a mask key, and the index of the rows of each id (as a
    /// device's tables hold them).
    pub fn kernel_args(
        &self,
        index: usize,
        signature: &Signature,
    ) -> Result<std::cell::RefMut<'r, Vec<*mut u8>>, RuntimeError> {
        // Steps run one at a time and release the list when they end.
        let mut args = self
            .args
            .try_borrow_mut()
            .map_err(|_| step_error(index, "the argument list is in use".into()))?;
        let KernelArgs {
            pointers,
            numbers,
            index: ids_index,
            pairs,
        } = &mut *args;
        numbers.clear();
        // At most one number per argument: pushing never moves the ones pointed to.
        numbers.reserve(signature.params.len());
        let mut number = |value: i64| {
            numbers.push(value);
            numbers.as_mut_ptr().wrapping_add(numbers.len() - 1) as *mut u8
        };
        super::marshal::marshal(signature, pointers, |arg| match *arg {
            Arg::Buffer(slot) => Ok(self.pointer(slot)),
            Arg::Absent => Ok(std::ptr::null_mut()),
            Arg::Offsets(lengths) => Ok(self.offsets(lengths)),
            Arg::RowMap(map) => self
                .sizes
                .row_map(map)
                .map(|(values, _)| values as *mut u8)
                .ok_or_else(|| step_error(index, format!("the row map {map:?} cannot be built"))),
            Arg::Longest(lengths) => self
                .lengths(lengths)
                .map(|info| number(info.longest))
                .ok_or_else(|| step_error(index, format!("no lengths {lengths:?} in this run"))),
            Arg::Count(rows) => Ok(number(self.sizes.rows(rows))),
            Arg::MaskKey(stream) => Ok(number(mask_key(stream, self.run) as i64)),
            Arg::RowsOfIds(ids, vocabulary) => {
                let values = self.ids(index, ids)?;
                // One index per kernel: no other argument points into it.
                *ids_index = rows_of_ids(values, vocabulary)
                    .ok_or_else(|| step_error(index, format!("a table of {vocabulary} rows")))?;
                Ok(ids_index.as_mut_ptr() as *mut u8)
            }
            Arg::PairOffsets(rows, columns) => {
                let lengths = |slot| {
                    self.lengths(slot).ok_or_else(|| {
                        step_error(index, format!("no lengths {slot:?} in this run"))
                    })
                };
                // One table of pairs per kernel: no other argument points into it.
                *pairs = pair_offsets(&lengths(rows)?.lengths, &lengths(columns)?.lengths)
                    .ok_or_else(|| step_error(index, "the pairs overflow i64".into()))?;
                Ok(pairs.as_mut_ptr() as *mut u8)
            }
            other => Err(step_error(
                index,
                format!("the CPU's kernels take no {other:?}"),
            )),
        })?;
        Ok(std::cell::RefMut::map(args, |args| &mut args.pointers))
    }
}

/// For every id `0..vocabulary`, the rows of `ids` that hold it, in order:
/// `vocabulary + 1` positions into the same buffer (id `v`'s rows are at
/// `values[values[v]..values[v + 1]]`), then the rows. Ids outside the table have no
/// row listed (a scatter adds nothing for them). `None` when the table's size is
/// negative or cannot be allocated.
pub(super) fn rows_of_ids(ids: &[i64], vocabulary: i64) -> Option<Vec<i64>> {
    let table = usize::try_from(vocabulary).ok()?;
    let slot = |id: i64| usize::try_from(id).ok().filter(|&id| id < table);
    // Rows per id, then where each id's list starts (after the positions).
    let mut starts = Vec::new();
    starts.try_reserve_exact(table.checked_add(1)?).ok()?;
    starts.resize(table + 1, table + 1);
    let mut counts = vec![0usize; table];
    for id in ids.iter().filter_map(|&id| slot(id)) {
        counts[id] += 1;
    }
    for id in 0..table {
        starts[id + 1] = starts[id] + counts[id];
    }
    let mut values: Vec<i64> = starts.iter().map(|&start| start as i64).collect();
    values.resize(starts[table], 0);
    // Rows in order, so that each id's list is in order.
    let mut next = starts;
    for (row, id) in ids.iter().enumerate() {
        if let Some(id) = slot(*id) {
            values[next[id]] = row as i64;
            next[id] += 1;
        }
    }
    Some(values)
}

/// Writes every row's position within its element, for elements starting at `offsets`
/// (rows past the end of `out` are left out).
pub fn write_positions(offsets: &[i64], out: &mut [i64]) {
    let rows = out.len();
    for bounds in offsets.windows(2) {
        let (first, end) = (bounds[0].max(0) as usize, bounds[1].max(0) as usize);
        for (position, value) in (0..).zip(&mut out[first.min(rows)..end.min(rows)]) {
            *value = position;
        }
    }
}

/// The key of mask `stream` in run `run` (the device's mask kernel takes it too).
pub fn mask_key(stream: i64, run: u64) -> u64 {
    split_mix(stream as u64 ^ split_mix(run))
}

/// SplitMix64's finalizer: a bijective mix of 64 bits (a mask's value at a position is
/// `split_mix(key ^ position)`).
pub fn split_mix(value: u64) -> u64 {
    let mut z = value.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A [`RuntimeError::Step`] of step `step`.
pub fn step_error(step: usize, reason: String) -> RuntimeError {
    RuntimeError::Step { step, reason }
}

/// Checks that positions within elements of `lengths` (ids `0..length`) are in
/// `0..limit`, which kernels index with unchecked: a [`RuntimeError::Step`] of step
/// `step` naming the first element that is longer.
pub fn check_positions(step: usize, lengths: &[i64], limit: i64) -> Result<(), RuntimeError> {
    match lengths
        .iter()
        .enumerate()
        .find(|(_, &length)| length > limit)
    {
        Some((element, &length)) => Err(step_error(
            step,
            format!("element {element} has {length} positions, ids of a table of {limit} rows"),
        )),
        None => Ok(()),
    }
}

/// Checks that every id of input `input` (`values`) is in `0..limit` (or `ignored`),
/// which kernels index with unchecked: a [`RuntimeError::BadInput`] naming the first row
/// that is not.
pub fn check_ids(
    input: usize,
    values: &[i64],
    (limit, ignored): (i64, Option<i64>),
) -> Result<(), RuntimeError> {
    match values
        .iter()
        .enumerate()
        .find(|(_, &id)| Some(id) != ignored && !(0..limit).contains(&id))
    {
        Some((row, &id)) => Err(RuntimeError::BadInput {
            input,
            reason: format!("row {row} has id {id}, outside 0..{limit}"),
        }),
        None => Ok(()),
    }
}
