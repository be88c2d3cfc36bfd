//! Lengths as DanLing's benchmark draws them: one element at the maximum, the rest
//! uniform around the mean that gives the target occupancy; fixed seeds.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// `batch` lengths in `1..=max` whose mean is about `occupancy * max`; the first is
/// `max`.
pub fn lengths(batch: i64, max: i64, occupancy: f64, seed: u64) -> Vec<i64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let max_f = max as f64;
    // The mean of the other elements that makes the batch's mean `occupancy * max`.
    let others = (batch - 1).max(1) as f64;
    let mean = ((occupancy * max_f * batch as f64 - max_f) / others).clamp(1.0, max_f);
    let spread = (mean - 1.0).min(max_f - mean);
    let mut lengths: Vec<i64> = (1..batch)
        .map(|_| {
            (mean + rng.random_range(-spread..=spread))
                .round()
                .clamp(1.0, max_f) as i64
        })
        .collect();
    lengths.insert(0, max);
    lengths
}

/// `batch` image sizes `(h, w)` with sides in `4..=side` whose mean area is about
/// `occupancy * side^2`; the first is `side x side`.
pub fn image_sizes(batch: i64, side: i64, occupancy: f64, seed: u64) -> Vec<(i64, i64)> {
    let areas = lengths(batch, side * side, occupancy, seed);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    areas
        .iter()
        .enumerate()
        .map(|(index, &area)| {
            if index == 0 {
                return (side, side);
            }
            // An aspect ratio within 1:2 and 2:1, then sides that keep the area.
            let aspect: f64 = rng.random_range(0.5..2.0);
            let h = ((area as f64 * aspect).sqrt().round() as i64).clamp(4, side);
            let w = ((area as f64 / h as f64).round() as i64).clamp(4, side);
            (h, w)
        })
        .collect()
}

/// Real elements over padded elements.
pub fn occupancy(lengths: &[i64], max: i64) -> f64 {
    lengths.iter().sum::<i64>() as f64 / (lengths.len() as i64 * max).max(1) as f64
}
