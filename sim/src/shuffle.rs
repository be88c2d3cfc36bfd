//! PTX's `shfl.sync`: which lane each lane reads, as the PTX ISA defines it.

use nestor_codegen::sim_abi::ShuffleMode;

/// Lanes of a warp.
pub const WARP_LANES: u32 = 32;

/// The lane that lane `lane` reads in a `shfl.sync` of `mode` with operands `b` and `c`
/// (the PTX ISA's definition: `c` packs the clamp value in bits 0-4 and the segment mask
/// in bits 8-12; a source out of the lane's segment or clamp is the lane itself).
///
/// ```
/// use nestor_codegen::sim_abi::ShuffleMode;
/// use nestor_sim::source_lane;
/// // A butterfly over the whole warp (c = 0x1f).
/// assert_eq!(source_lane(ShuffleMode::Butterfly, 5, 16, 0x1f), 21);
/// // Down by 4 past the last lane: the lane's own value.
/// assert_eq!(source_lane(ShuffleMode::Down, 30, 4, 0x1f), 30);
/// // Up by 1 within segments of 8 lanes (c = (32 - 8) << 8): lane 8 starts a segment.
/// assert_eq!(source_lane(ShuffleMode::Up, 8, 1, 0x1800), 8);
/// assert_eq!(source_lane(ShuffleMode::Up, 9, 1, 0x1800), 8);
/// ```
pub fn source_lane(mode: ShuffleMode, lane: u32, b: u32, c: u32) -> u32 {
    let lane = lane & 0x1f;
    let b = b & 0x1f;
    let clamp = c & 0x1f;
    let segment_mask = (c >> 8) & 0x1f;
    let max_lane = (lane & segment_mask) | (clamp & !segment_mask);
    let min_lane = lane & segment_mask;
    let (source, valid) = match mode {
        ShuffleMode::Up => {
            let source = i64::from(lane) - i64::from(b);
            (source, source >= i64::from(max_lane))
        }
        ShuffleMode::Down => {
            let source = i64::from(lane + b);
            (source, source <= i64::from(max_lane))
        }
        ShuffleMode::Butterfly => {
            let source = i64::from(lane ^ b);
            (source, source <= i64::from(max_lane))
        }
        ShuffleMode::Index => {
            let source = i64::from(min_lane | (b & !segment_mask));
            (source, source <= i64::from(max_lane))
        }
    };
    if valid {
        // Within 0..32: checked by `valid` for up (>= max_lane >= 0) and below 32 for
        // the others (at most max_lane, a 5-bit value).
        source as u32
    } else {
        lane
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ISA's pseudo-code, transcribed literally with its 5-bit wrap-around, as the
    /// oracle the implementation is checked against.
    fn isa(mode: ShuffleMode, lane: u32, b: u32, c: u32) -> u32 {
        let bval = b & 0x1f;
        let cval = c & 0x1f;
        let segmask = (c >> 8) & 0x1f;
        let max_lane = (lane & segmask) | (cval & !segmask);
        let min_lane = lane & segmask;
        let (j, pval): (i32, bool) = match mode {
            ShuffleMode::Up => {
                let j = lane as i32 - bval as i32;
                (j, j >= max_lane as i32)
            }
            ShuffleMode::Down => {
                let j = (lane + bval) as i32;
                (j, j <= max_lane as i32)
            }
            ShuffleMode::Butterfly => {
                let j = (lane ^ bval) as i32;
                (j, j <= max_lane as i32)
            }
            ShuffleMode::Index => {
                let j = (min_lane | (bval & !segmask)) as i32;
                (j, j <= max_lane as i32)
            }
        };
        if pval {
            j as u32
        } else {
            lane
        }
    }

    #[test]
    fn every_mode_lane_and_operand_follows_the_isa() {
        // Clamps of every value with the segment widths 32, 16, 8, 4, 2, 1.
        let cs: Vec<u32> = [0u32, 16, 24, 28, 30, 31]
            .into_iter()
            .flat_map(|segment| (0..32).map(move |clamp| (segment << 8) | clamp))
            .collect();
        for mode in ShuffleMode::ALL {
            for lane in 0..32 {
                for b in 0..40 {
                    for &c in &cs {
                        let source = source_lane(mode, lane, b, c);
                        assert_eq!(source, isa(mode, lane, b, c), "{mode:?} {lane} {b} {c:#x}");
                        assert!(source < WARP_LANES);
                    }
                }
            }
        }
    }

    #[test]
    fn whole_warp_shuffles_read_the_lanes_cuda_documents() {
        // __shfl_xor_sync(mask, v, 1): lanes swap in pairs.
        assert_eq!(source_lane(ShuffleMode::Butterfly, 6, 1, 0x1f), 7);
        // __shfl_down_sync(mask, v, 16): the upper half reads itself.
        assert_eq!(source_lane(ShuffleMode::Down, 3, 16, 0x1f), 19);
        assert_eq!(source_lane(ShuffleMode::Down, 20, 16, 0x1f), 20);
        // __shfl_up_sync(mask, v, 2) (c = 0): lanes 0 and 1 read themselves.
        assert_eq!(source_lane(ShuffleMode::Up, 1, 2, 0), 1);
        assert_eq!(source_lane(ShuffleMode::Up, 2, 2, 0), 0);
        // __shfl_sync(mask, v, 7): every lane reads lane 7; in segments of 16
        // (c = (32 - 16) << 8 | 0x1f), lane 7 of each segment.
        assert_eq!(source_lane(ShuffleMode::Index, 30, 7, 0x1f), 7);
        assert_eq!(source_lane(ShuffleMode::Index, 30, 7, 0x101f), 23);
        // __shfl_xor_sync(mask, v, lane_mask, 8) (c = 0x181f): a lane may read an
        // earlier group of 8 lanes, and reads itself for a later one.
        assert_eq!(source_lane(ShuffleMode::Butterfly, 9, 4, 0x181f), 13);
        assert_eq!(source_lane(ShuffleMode::Butterfly, 9, 8, 0x181f), 1);
        assert_eq!(source_lane(ShuffleMode::Butterfly, 1, 8, 0x181f), 1);
        assert_eq!(ShuffleMode::of_code(2), Some(ShuffleMode::Butterfly));
        assert_eq!(ShuffleMode::of_code(4), None);
    }
}
