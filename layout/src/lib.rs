//! nestor-layout: what a ragged batch looks like in memory, shared by the eager
//! `NestedTensor` and compiled programs, with no compiler behind it.
//!
//! - [`RaggedLayout`]: element sizes, ragged dims, offsets (plain integers);
//! - the window geometry ([`window_images`], [`window_taps`]): which input pixel every
//!   tap of a sliding window reads, for convolution and pooling over packed images.

mod ragged;
mod window;

pub use ragged::{LayoutError, RaggedLayout};
pub use window::{
    check_window, fill_taps, in_one_piece, pixels, window_images, window_taps,
    window_taps_in_parts, FillTaps, Outside, WindowError, WindowImage, WindowTaps,
};
