//! Device memory in host memory: buffers of 8-byte words (f32, bf16 and i64 values
//! aligned) filled with NaN, and the registry of their extents that every access of a
//! kernel is checked against.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::SimError;

/// The extents of the device's live buffers (start address -> bytes), shared by the
/// device and its buffers, which leave it when dropped.
#[derive(Clone, Default)]
pub(crate) struct Registry(Arc<Mutex<BTreeMap<u64, u64>>>);

impl Registry {
    fn map(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, u64>> {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The live buffer `(start, bytes)` holding `bytes` bytes at `address`, if one does
    /// (looked up in place: no copy of the registry).
    pub(crate) fn holding(&self, address: u64, bytes: u64) -> Option<(u64, u64)> {
        let map = self.map();
        let (&start, &length) = map.range(..=address).next_back()?;
        within((start, length), address, bytes)
    }

    /// The extents now, for a launch to check its accesses against.
    pub(crate) fn snapshot(&self) -> Extents {
        Extents(
            self.map()
                .iter()
                .map(|(&start, &bytes)| (start, bytes))
                .collect(),
        )
    }

    /// A new buffer of `bytes` bytes (at least one word held), NaN in every value (all
    /// bits set: a value a kernel reads before any step wrote it shows).
    pub(crate) fn alloc(&self, bytes: u64) -> Result<SimBuffer, SimError> {
        let words =
            usize::try_from(bytes.div_ceil(8).max(1)).map_err(|_| SimError::Memory(bytes))?;
        let mut storage = Vec::new();
        storage
            .try_reserve_exact(words)
            .map_err(|_| SimError::Memory(bytes))?;
        storage.resize(words, u64::MAX);
        let buffer = SimBuffer {
            words: storage,
            bytes,
            registry: self.clone(),
        };
        self.map().insert(buffer.address(), bytes);
        Ok(buffer)
    }
}

impl Registry {
    /// Registers the caller's memory `address..address + bytes` as a device buffer while
    /// the returned guard lives (none for no bytes); an error if it overlaps one.
    pub(crate) fn adopt(&self, address: u64, bytes: u64) -> Result<Adopted, SimError> {
        if bytes == 0 {
            return Ok(Adopted(None));
        }
        let end = address
            .checked_add(bytes)
            .ok_or(SimError::Adopt { address, bytes })?;
        let mut map = self.map();
        let before = map.range(..end).next_back();
        if before.is_some_and(|(&start, &length)| start.saturating_add(length) > address) {
            return Err(SimError::Adopt { address, bytes });
        }
        map.insert(address, bytes);
        Ok(Adopted(Some((self.clone(), address))))
    }
}

/// Memory of the caller that is a device buffer while this lives
/// ([`crate::SimDevice::adopt`]).
pub struct Adopted(Option<(Registry, u64)>);

impl Drop for Adopted {
    fn drop(&mut self) {
        if let Some((registry, address)) = self.0.take() {
            registry.map().remove(&address);
        }
    }
}

/// A buffer of the simulated device.
pub struct SimBuffer {
    words: Vec<u64>,
    bytes: u64,
    registry: Registry,
}

impl SimBuffer {
    /// Its address.
    pub fn address(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    /// Its bytes (kernels may access exactly these).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Its words, to fill.
    pub(crate) fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words
    }
}

impl Drop for SimBuffer {
    fn drop(&mut self) {
        // Freed memory is no buffer: a kernel reading it is out of bounds.
        self.registry.map().remove(&self.address());
    }
}

/// The extents of a device's buffers at a launch, sorted by address.
#[derive(Clone)]
pub(crate) struct Extents(Vec<(u64, u64)>);

impl Extents {
    /// The extents `(start, bytes)` of `buffers`.
    pub(crate) fn of(buffers: &[(u64, u64)]) -> Self {
        let mut extents = buffers.to_vec();
        extents.sort_unstable();
        Self(extents)
    }

    /// The buffer `(start, bytes)` holding `bytes` bytes at `address`, if one does.
    pub(crate) fn holding(&self, address: u64, bytes: u64) -> Option<(u64, u64)> {
        within(self.below(address)?, address, bytes)
    }

    /// The buffer starting nearest below or at `address`.
    pub(crate) fn below(&self, address: u64) -> Option<(u64, u64)> {
        let after = self.0.partition_point(|&(start, _)| start <= address);
        after.checked_sub(1).map(|index| self.0[index])
    }
}

/// `buffer` (start, bytes, starting at or below `address`) if it holds `bytes` bytes at
/// `address`.
fn within(buffer: (u64, u64), address: u64, bytes: u64) -> Option<(u64, u64)> {
    let (start, length) = buffer;
    let end = address.checked_add(bytes)?;
    (end <= start.checked_add(length)?).then_some(buffer)
}
