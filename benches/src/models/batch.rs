//! The batches of the suite: ragged tokens and images of different sizes, each packed,
//! padded with its mask, and element by element.

use nestor::NestedTensor;
use tch::{Device, Kind, Tensor};

use crate::Result;

/// A ragged batch of `[L_i, width]` tokens: elements, packed, padded with its mask.
pub struct Tokens {
    /// Lengths.
    pub lengths: Vec<i64>,
    /// Each element alone `[1, L_i, width]`.
    pub elements: Vec<Tensor>,
    /// Packed.
    pub nested: NestedTensor,
    /// Padded `[B, max, width]`.
    pub padded: Tensor,
    /// `[B, max, 1]`, 1 on data.
    pub mask: Tensor,
}

impl Tokens {
    /// Random tokens of these lengths.
    pub fn new(lengths: Vec<i64>, width: i64, max: i64) -> Result<Self> {
        let options = (Kind::Float, Device::Cpu);
        let elements: Vec<Tensor> = lengths
            .iter()
            .map(|&length| Tensor::f_randn([length, width], options))
            .collect::<std::result::Result<_, _>>()?;
        let nested = NestedTensor::builder()
            .ragged_dims(&[0])
            .tensors(&elements)?;
        let padded = Tensor::f_zeros([lengths.len() as i64, max, width], options)?;
        for (index, element) in elements.iter().enumerate() {
            padded
                .f_get(index as i64)?
                .f_narrow(0, 0, element.size()[0])?
                .f_copy_(element)?;
        }
        let positions = Tensor::f_arange(max, (Kind::Int64, Device::Cpu))?;
        let mask = positions
            .f_unsqueeze(0)?
            .f_lt_tensor(&Tensor::f_from_slice(&lengths)?.f_unsqueeze(1)?)?
            .f_unsqueeze(-1)?
            .f_to_kind(Kind::Float)?;
        let elements = elements
            .iter()
            .map(|element| element.f_unsqueeze(0))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Self {
            lengths,
            elements,
            nested,
            padded,
            mask,
        })
    }

    /// Real tokens.
    pub fn total(&self) -> f64 {
        self.lengths.iter().sum::<i64>() as f64
    }

    /// The same tokens (and mask) in `kind`.
    pub fn to_kind(&self, kind: Kind) -> Result<Self> {
        Ok(Self {
            lengths: self.lengths.clone(),
            elements: converted(&self.elements, kind)?,
            nested: self.nested.to_kind(kind)?,
            padded: self.padded.f_to_kind(kind)?,
            mask: self.mask.f_to_kind(kind)?,
        })
    }
}

/// `tensors` in `kind`.
fn converted(tensors: &[Tensor], kind: Kind) -> Result<Vec<Tensor>> {
    Ok(tensors
        .iter()
        .map(|tensor| tensor.f_to_kind(kind))
        .collect::<std::result::Result<_, _>>()?)
}

/// Images of different sizes: elements, packed, padded with a pixel mask.
pub struct Images {
    /// `(h, w)` of each image.
    pub sizes: Vec<(i64, i64)>,
    /// Each image alone `[1, 3, h, w]`.
    pub elements: Vec<Tensor>,
    /// Packed (ragged dims 1 and 2).
    pub nested: NestedTensor,
    /// Padded `[B, 3, side, side]`.
    pub padded: Tensor,
    /// `[B, 1, side, side]`, 1 on pixels.
    pub mask: Tensor,
}

impl Images {
    /// Random images of these sizes.
    pub fn new(sizes: Vec<(i64, i64)>, side: i64) -> Result<Self> {
        let options = (Kind::Float, Device::Cpu);
        let batch = sizes.len() as i64;
        let elements: Vec<Tensor> = sizes
            .iter()
            .map(|&(h, w)| Tensor::f_randn([3, h, w], options))
            .collect::<std::result::Result<_, _>>()?;
        let nested = NestedTensor::builder()
            .ragged_dims(&[1, 2])
            .tensors(&elements)?;
        let padded = Tensor::f_zeros([batch, 3, side, side], options)?;
        let mask = Tensor::f_zeros([batch, 1, side, side], options)?;
        for (index, (element, &(h, w))) in elements.iter().zip(&sizes).enumerate() {
            let index = index as i64;
            padded
                .f_get(index)?
                .f_narrow(1, 0, h)?
                .f_narrow(2, 0, w)?
                .f_copy_(element)?;
            let _ones = mask
                .f_get(index)?
                .f_narrow(1, 0, h)?
                .f_narrow(2, 0, w)?
                .f_fill_(1.0)?;
        }
        let elements = elements
            .iter()
            .map(|element| element.f_unsqueeze(0))
            .collect::<std::result::Result<_, _>>()?;
        Ok(Self {
            sizes,
            elements,
            nested,
            padded,
            mask,
        })
    }

    /// Real pixels.
    pub fn area(&self) -> f64 {
        self.sizes.iter().map(|&(h, w)| (h * w) as f64).sum()
    }

    /// The same images (and mask) in `kind`.
    pub fn to_kind(&self, kind: Kind) -> Result<Self> {
        Ok(Self {
            sizes: self.sizes.clone(),
            elements: converted(&self.elements, kind)?,
            nested: self.nested.to_kind(kind)?,
            padded: self.padded.f_to_kind(kind)?,
            mask: self.mask.f_to_kind(kind)?,
        })
    }
}
