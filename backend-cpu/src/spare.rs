//! Vectors kept for reuse between steps and runs. A large vector allocated anew gets
//! fresh pages from the kernel, each faulted in and zeroed on first touch, on every
//! step that allocates it (a ResNet-50 training step allocated its convolutions' columns
//! so, a few MiB a tile range); one kept here comes back with its pages mapped and its
//! old values, for the taker to overwrite.

use std::sync::Mutex;

/// Vectors free for the next taker.
pub(crate) type Pool<E> = Mutex<Vec<Vec<E>>>;

/// Vectors a pool keeps at most (a run keeps tens of buffers' roundings, and its
/// convolutions' tiles lend columns besides: at 64, a ResNet-50 training step at 81%
/// occupancy faulted 30 MiB of fresh pages into them every step and took 3% longer).
const KEPT: usize = 256;

/// Bytes of vectors a pool keeps at most between uses: as many as a run keeps of bf16
/// roundings (`crate::kept`), which come back here when it ends. At 64 MiB, a ResNet-50
/// inference at 81% occupancy (20 MiB of roundings a buffer) faulted 16 MiB of fresh
/// pages into its products' roundings every run and took 8% longer.
const KEPT_BYTES: usize = crate::kept::KEPT_BYTES;

/// An element type with a pool of spare vectors.
pub(crate) trait Spare: Copy + Default + Send + 'static {
    fn pool() -> &'static Pool<Self>;
}

/// Each element type's pool.
macro_rules! spare {
    ($($element:ty => $pool:ident),*) => {$(
        static $pool: Pool<$element> = Mutex::new(Vec::new());

        impl Spare for $element {
            fn pool() -> &'static Pool<Self> {
                &$pool
            }
        }
    )*};
}

spare!(u16 => U16, f32 => F32, f64 => F64, i64 => I64);

/// A vector holding `len` values from its first cache line (the index returned), for the
/// caller to overwrite: the shortest kept that holds them, else the longest, grown, or a
/// new one. Vectors keep their length in the pool: the values a vector once held are not
/// set again (setting them cost more than the bf16 roundings of a step's output).
pub(crate) fn take<E: Spare>(len: usize) -> (Vec<E>, usize) {
    take_from(E::pool(), len)
}

/// [`take`] from `pool`.
fn take_from<E: Copy + Default>(pool: &Pool<E>, len: usize) -> (Vec<E>, usize) {
    // No values (a 1x1 convolution's columns, read in place): no kept vector held idle.
    if len == 0 {
        return (Vec::new(), 0);
    }
    let len_with_slack = crate::aligned::with_slack::<E>(len);
    let mut vectors = pool.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let length = |index: &usize| vectors[*index].len();
    let holding = (0..vectors.len())
        .filter(|index| length(index) >= len_with_slack)
        .min_by_key(length);
    let chosen = holding.or_else(|| (0..vectors.len()).max_by_key(length));
    let mut vector = chosen.map_or_else(Vec::new, |index| vectors.swap_remove(index));
    drop(vectors);
    let start = crate::aligned::line_start(&mut vector, len, E::default());
    (vector, start)
}

/// Keeps `vector` for a later [`take`] (unless the pool is full).
pub(crate) fn give_back<E: Spare>(vector: Vec<E>) {
    give_back_to(E::pool(), vector);
}

/// [`give_back`] to `pool`.
fn give_back_to<E>(pool: &Pool<E>, vector: Vec<E>) {
    let mut vectors = pool.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let bytes = |vector: &Vec<E>| vector.capacity() * std::mem::size_of::<E>();
    let pooled: usize = vectors.iter().map(bytes).sum();
    let fits = pooled.saturating_add(bytes(&vector)) <= KEPT_BYTES;
    if vectors.len() < KEPT && vector.capacity() > 0 && fits {
        vectors.push(vector);
    }
}

/// `len` values of a kept vector ([`take`]: old values, for the holder to overwrite),
/// given back when dropped.
pub(crate) struct Lent<E: Spare> {
    vector: Vec<E>,
    start: usize,
    len: usize,
}

impl<E: Spare> Lent<E> {
    pub(crate) fn new(len: usize) -> Self {
        let (vector, start) = take(len);
        Self { vector, start, len }
    }
}

impl<E: Spare> std::ops::Deref for Lent<E> {
    type Target = [E];

    fn deref(&self) -> &[E] {
        &self.vector[self.start..self.start + self.len]
    }
}

impl<E: Spare> std::ops::DerefMut for Lent<E> {
    fn deref_mut(&mut self) -> &mut [E] {
        &mut self.vector[self.start..self.start + self.len]
    }
}

impl<E: Spare> Drop for Lent<E> {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.vector));
    }
}

/// Gives `E`'s pool vectors of many lengths filled with `value` (tests: a lent value
/// read before it is written shows).
#[cfg(test)]
pub(crate) fn poison<E: Spare>(value: E) {
    for shift in 4..21 {
        give_back(vec![value; 1 << shift]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_back_vector_is_taken_again_with_its_values() {
        let pool: Pool<u32> = Mutex::new(Vec::new());
        let (mut vector, start) = take_from(&pool, 1000);
        assert_eq!(vector[start..].as_ptr() as usize % 64, 0);
        vector[start..start + 1000].fill(7);
        let address = vector.as_ptr();
        give_back_to(&pool, vector);
        // The kept vector holds 900 values: it is taken again, values and all.
        let (again, start) = take_from(&pool, 900);
        assert_eq!(again.as_ptr(), address);
        assert!(again[start..start + 900].iter().all(|&value| value == 7));
        give_back_to(&pool, again);
        // Taking no values leaves the kept vector for a taker that needs it.
        let (none, _) = take_from(&pool, 0);
        assert!(none.is_empty());
        assert_eq!(pool.lock().unwrap().len(), 1);
        // Nothing kept holds more: the longest is grown.
        let (grown, start) = take_from(&pool, 5000);
        assert!(grown.len() >= start + 5000);
        assert!(pool.lock().unwrap().is_empty());
    }

    #[test]
    fn a_full_pool_keeps_no_more() {
        let pool: Pool<u8> = Mutex::new(Vec::new());
        give_back_to(&pool, vec![0; KEPT_BYTES]);
        give_back_to(&pool, vec![0; 1]);
        give_back_to(&pool, Vec::new());
        assert_eq!(pool.lock().unwrap().len(), 1);
    }
}
