//! torchvision's ResNets on packed images of different sizes, with a torchvision
//! `state_dict`'s parameter names, loaded from it saved as safetensors.

use std::path::Path;

use tch::{nn, Tensor};

use super::checkpoint::{file_error, Checkpoint};
use super::BatchNorm;
use crate::{NestedError, NestedTensor, Result};

/// A convolution without bias (torchvision's ResNets put a batch norm after each).
#[derive(Debug)]
struct Conv {
    weight: Tensor,
    stride: i64,
    padding: i64,
}

impl Conv {
    fn new(path: &nn::Path, inputs: i64, outputs: i64, kernel: i64, stride: i64) -> Self {
        Self {
            weight: path.kaiming_uniform("weight", &[outputs, inputs, kernel, kernel]),
            stride,
            padding: kernel / 2,
        }
    }

    fn forward(&self, x: &NestedTensor) -> Result<NestedTensor> {
        x.conv2d(
            &self.weight,
            None,
            [self.stride; 2],
            [self.padding; 2],
            [1, 1],
            1,
        )
    }
}

/// A convolution and its batch norm.
#[derive(Debug)]
struct ConvNorm {
    conv: Conv,
    norm: BatchNorm,
}

impl ConvNorm {
    /// `conv` and `norm` under `path` with these names.
    fn new(path: &nn::Path, names: [&str; 2], shape: [i64; 4]) -> Self {
        let [inputs, outputs, kernel, stride] = shape;
        Self {
            conv: Conv::new(&(path / names[0]), inputs, outputs, kernel, stride),
            norm: BatchNorm::new(&(path / names[1]), outputs, 1),
        }
    }

    fn forward(&self, x: &NestedTensor, train: bool) -> Result<NestedTensor> {
        self.norm.forward(&self.conv.forward(x)?, train)
    }

    fn parameters<'a>(&'a self, names: [String; 2], named: &mut Vec<(String, &'a Tensor)>) {
        named.push((format!("{}.weight", names[0]), &self.conv.weight));
        let norm = &self.norm;
        for (field, tensor) in [
            ("weight", &norm.weight),
            ("bias", &norm.bias),
            ("running_mean", &norm.running_mean),
            ("running_var", &norm.running_var),
        ] {
            named.push((format!("{}.{field}", names[1]), tensor));
        }
    }
}

/// A residual block: torchvision's `BasicBlock` (two 3x3 convolutions) or `Bottleneck`
/// (1x1, 3x3 with the stride, 1x1 to 4x the width), with a downsampling branch where
/// the shape changes.
#[derive(Debug)]
struct Block {
    convs: Vec<ConvNorm>,
    downsample: Option<ConvNorm>,
}

impl Block {
    fn new(path: &nn::Path, bottleneck: bool, inputs: i64, planes: i64, stride: i64) -> Self {
        let conv = |index: usize, shape| {
            ConvNorm::new(
                path,
                [&format!("conv{index}"), &format!("bn{index}")],
                shape,
            )
        };
        let (convs, outputs) = if bottleneck {
            (
                vec![
                    conv(1, [inputs, planes, 1, 1]),
                    conv(2, [planes, planes, 3, stride]),
                    conv(3, [planes, planes * 4, 1, 1]),
                ],
                planes * 4,
            )
        } else {
            (
                vec![
                    conv(1, [inputs, planes, 3, stride]),
                    conv(2, [planes, planes, 3, 1]),
                ],
                planes,
            )
        };
        let downsample = (stride != 1 || inputs != outputs).then(|| {
            ConvNorm::new(
                &(path / "downsample"),
                ["0", "1"],
                [inputs, outputs, 1, stride],
            )
        });
        Self { convs, downsample }
    }

    fn forward(&self, x: &NestedTensor, train: bool) -> Result<NestedTensor> {
        let mut y = x.shallow_clone();
        for (index, conv) in self.convs.iter().enumerate() {
            y = conv.forward(&y, train)?;
            if index + 1 < self.convs.len() {
                y = y.relu()?;
            }
        }
        let identity = match &self.downsample {
            Some(downsample) => downsample.forward(x, train)?,
            None => x.shallow_clone(),
        };
        (&y + &identity)?.relu()
    }

    fn parameters<'a>(&'a self, name: &str, named: &mut Vec<(String, &'a Tensor)>) {
        for (index, conv) in self.convs.iter().enumerate() {
            let index = index + 1;
            conv.parameters(
                [format!("{name}.conv{index}"), format!("{name}.bn{index}")],
                named,
            );
        }
        if let Some(downsample) = &self.downsample {
            downsample.parameters(
                [
                    format!("{name}.downsample.0"),
                    format!("{name}.downsample.1"),
                ],
                named,
            );
        }
    }
}

/// torchvision's ResNet (`resnet18` to `resnet152`) on packed images `[B; 3, H_i, W_i]`
/// of different sizes: the 7x7 stride-2 stem, batch norm, 3x3 stride-2 max pooling, four
/// stages of residual blocks, adaptive average pooling of every image and the
/// classifier. Parameters and running statistics carry a torchvision `state_dict`'s
/// names (`conv1.weight`, `layer1.0.bn2.running_var`, `layer2.0.downsample.0.weight`,
/// `fc.bias`, ...), so [`ResNet::load`] fills them from one saved as safetensors.
///
/// ```
/// use nestor_frontend::nn::ResNet;
/// use nestor_frontend::NestedTensor;
/// use tch::{nn, Device, Kind, Tensor};
///
/// let store = nn::VarStore::new(Device::Cpu);
/// let resnet = ResNet::new(&store.root(), 18, 10)?;
/// assert!(store.variables().contains_key("layer2.0.downsample.1.running_mean"));
/// let images = NestedTensor::from_tensors(&[
///     Tensor::randn([3, 40, 32], (Kind::Float, Device::Cpu)),
///     Tensor::randn([3, 24, 56], (Kind::Float, Device::Cpu)),
/// ])?;
/// let logits = tch::no_grad(|| resnet.forward(&images, false))?;
/// assert_eq!(logits.shape(), [2, 10]);
/// # Ok::<(), nestor_frontend::NestedError>(())
/// ```
#[derive(Debug)]
pub struct ResNet {
    stem: ConvNorm,
    stages: Vec<Vec<Block>>,
    fc: (Tensor, Tensor),
}

/// The blocks per stage and whether they are bottlenecks, of torchvision's depths.
fn architecture(depth: usize) -> Option<([usize; 4], bool)> {
    Some(match depth {
        18 => ([2, 2, 2, 2], false),
        34 => ([3, 4, 6, 3], false),
        50 => ([3, 4, 6, 3], true),
        101 => ([3, 4, 23, 3], true),
        152 => ([3, 8, 36, 3], true),
        _ => return None,
    })
}

impl ResNet {
    /// A randomly initialized ResNet of `depth` (18, 34, 50, 101 or 152) with
    /// `classes` outputs, under `path`.
    pub fn new(path: &nn::Path, depth: usize, classes: i64) -> Result<Self> {
        let (blocks, bottleneck) = architecture(depth).ok_or(NestedError::Unsupported {
            op: "ResNet::new",
            reason: format!("depth {depth}: torchvision's are 18, 34, 50, 101 and 152"),
        })?;
        Ok(Self::with_blocks(path, blocks, bottleneck, classes))
    }

    fn with_blocks(path: &nn::Path, blocks: [usize; 4], bottleneck: bool, classes: i64) -> Self {
        let stem = ConvNorm::new(path, ["conv1", "bn1"], [3, 64, 7, 2]);
        let expansion = if bottleneck { 4 } else { 1 };
        let mut inputs = 64;
        let stages = blocks
            .iter()
            .enumerate()
            .map(|(stage, &count)| {
                let planes = 64 << stage;
                let stage_path = path / format!("layer{}", stage + 1);
                (0..count)
                    .map(|index| {
                        let stride = if stage > 0 && index == 0 { 2 } else { 1 };
                        let block =
                            Block::new(&(&stage_path / index), bottleneck, inputs, planes, stride);
                        inputs = planes * expansion;
                        block
                    })
                    .collect()
            })
            .collect();
        let bound = 1.0 / (inputs as f64).sqrt();
        let fc = path / "fc";
        Self {
            stem,
            stages,
            fc: (
                fc.uniform("weight", &[classes, inputs], -bound, bound),
                fc.uniform("bias", &[classes], -bound, bound),
            ),
        }
    }

    /// The ResNet of a torchvision `state_dict` saved as safetensors (PyTorch:
    /// `safetensors.torch.save_file(model.state_dict(), path)`): its depth from the
    /// blocks the file has, its classes from `fc.weight`, every parameter and running
    /// statistic from the file (under `path`). A missing or mis-shaped tensor, a
    /// truncated file or a block layout torchvision does not make is a
    /// [`NestedError::File`] naming it.
    pub fn load(file: &Path, path: &nn::Path) -> Result<Self> {
        let checkpoint = Checkpoint::read(file)?;
        let names = checkpoint.names()?;
        let mut blocks = [0usize; 4];
        for (stage, count) in blocks.iter_mut().enumerate() {
            while names.contains(&format!("layer{}.{}.conv1.weight", stage + 1, *count)) {
                *count += 1;
            }
        }
        let bottleneck = names.iter().any(|name| name == "layer1.0.conv3.weight");
        let known = [18, 34, 50, 101, 152]
            .into_iter()
            .any(|depth| architecture(depth) == Some((blocks, bottleneck)));
        if !known {
            return Err(file_error(
                file,
                format!(
                    "blocks per stage {blocks:?} ({}) are not a torchvision ResNet's",
                    if bottleneck { "bottleneck" } else { "basic" }
                ),
            ));
        }
        let classes = checkpoint
            .shape("fc.weight")?
            .and_then(|shape| shape.first().copied())
            .ok_or_else(|| file_error(file, "the tensor fc.weight is missing"))?;
        let resnet = Self::with_blocks(path, blocks, bottleneck, classes);
        checkpoint.load(resnet.parameters(), "")?;
        Ok(resnet)
    }

    /// Every parameter and running statistic with its `state_dict` name.
    fn parameters(&self) -> Vec<(String, &Tensor)> {
        let mut named = Vec::new();
        self.stem
            .parameters(["conv1".into(), "bn1".into()], &mut named);
        for (stage, blocks) in self.stages.iter().enumerate() {
            for (index, block) in blocks.iter().enumerate() {
                block.parameters(&format!("layer{}.{index}", stage + 1), &mut named);
            }
        }
        named.push(("fc.weight".into(), &self.fc.0));
        named.push(("fc.bias".into(), &self.fc.1));
        named
    }

    /// Class scores `[B, classes]` of images `[B; 3, H_i, W_i]`; batch norms use the
    /// batch's statistics (and update the running ones) when `train`, else the running
    /// statistics.
    pub fn forward(&self, images: &NestedTensor, train: bool) -> Result<NestedTensor> {
        let x = self.stem.forward(images, train)?.relu()?;
        let mut x = x.max_pool2d([3, 3], [2, 2], [1, 1])?;
        for blocks in &self.stages {
            for block in blocks {
                x = block.forward(&x, train)?;
            }
        }
        let width = self.fc.0.size()[1];
        x.adaptive_avg_pool2d([1, 1])?
            .reshape_tail(&[width])?
            .linear(&self.fc.0, Some(&self.fc.1))
    }
}
