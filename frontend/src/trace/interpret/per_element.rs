//! Per-element bodies: convolution and pooling of one element, and `per_element` regions.

use super::*;

impl Interpreter<'_> {
    /// Runs a per element op.
    pub(super) fn run_per_element(&self, value: ValueId, op: &Op, ty: &Type) -> Result<Value> {
        Ok(match op {
            Op::Conv2d {
                x,
                weight,
                bias,
                stride,
                padding,
                dilation,
                groups,
            } => {
                let bias = bias.map(|b| self.dense(b)).transpose()?;
                let image = self.dense(*x)?.f_unsqueeze(0)?;
                Value::Dense(
                    image
                        .f_conv2d(
                            self.dense(*weight)?,
                            bias,
                            stride,
                            padding,
                            dilation,
                            *groups,
                        )?
                        .f_squeeze_dim(0)?,
                )
            }
            Op::Pool2d {
                kind,
                x,
                kernel,
                stride,
                padding,
            } => {
                let image = self.dense(*x)?.f_unsqueeze(0)?;
                let pooled = match kind {
                    PoolKind::Max => image.f_max_pool2d(kernel, stride, padding, [1, 1], false)?,
                    PoolKind::Avg => {
                        image.f_avg_pool2d(kernel, stride, padding, false, false, None::<i64>)?
                    }
                };
                Value::Dense(pooled.f_squeeze_dim(0)?)
            }
            Op::AdaptiveAvgPool2d { x, output } => Value::Dense(
                self.dense(*x)?
                    .f_unsqueeze(0)?
                    .f_adaptive_avg_pool2d(output)?
                    .f_squeeze_dim(0)?,
            ),
            Op::InterpolateBilinear {
                x,
                output,
                align_corners,
            } => Value::Dense(bilinear(self.dense(*x)?, output, *align_corners)?),
            Op::PerElement { inputs, body } => self.per_element(value, inputs, body, ty)?,
            _ => self.run_window_gradient(value, op, ty)?,
        })
    }

    /// Runs the gradient op of a convolution (its input's or its weight's).
    fn run_window_gradient(&self, value: ValueId, op: &Op, ty: &Type) -> Result<Value> {
        Ok(match op {
            Op::Conv2dInputGrad {
                g,
                weight,
                x,
                stride,
                padding,
                dilation,
                groups,
            } => {
                let weight = self.dense(*weight)?;
                let (kernel, inputs) = (weight.size(), self.nested(*x)?);
                let images = self
                    .nested(*g)?
                    .elements()?
                    .iter()
                    .zip(inputs.elements()?)
                    .map(|(g, x)| {
                        if g.numel() == 0 {
                            return Ok(x.f_zeros_like()?.f_to_kind(g.kind())?);
                        }
                        // The rows and columns past the last window's reach, which no
                        // window read: the transposed convolution's output padding.
                        let (size, out) = (x.size(), g.size());
                        let unread = |axis: usize| {
                            let reach = (out[axis + 1] - 1) * stride[axis] - 2 * padding[axis]
                                + dilation[axis] * (kernel[axis + 2] - 1)
                                + 1;
                            size[axis + 1] - reach
                        };
                        Ok(g.f_unsqueeze(0)?
                            .f_conv_transpose2d(
                                weight,
                                None::<&Tensor>,
                                stride,
                                padding,
                                [unread(0), unread(1)],
                                *groups,
                                dilation,
                            )?
                            .f_squeeze_dim(0)?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                self.images(value, ty, &images)?
            }
            Op::Conv2dWeightGrad {
                x,
                g,
                kernel,
                stride,
                padding,
                dilation,
                groups,
            } => {
                let (images, grads) = (self.nested(*x)?, self.nested(*g)?);
                let mut total: Option<Tensor> = None;
                for (x, g) in images.elements()?.iter().zip(grads.elements()?) {
                    if g.numel() == 0 {
                        continue;
                    }
                    // Each input channel as an image, each output channel's gradient as
                    // a kernel: the window's taps are the output, so the convolution's
                    // stride is this one's dilation and its dilation this one's stride.
                    let part = x
                        .f_unsqueeze(1)?
                        .f_conv2d(
                            &g.f_unsqueeze(1)?,
                            None::<&Tensor>,
                            dilation,
                            padding,
                            stride,
                            1,
                        )?
                        .f_narrow(2, 0, kernel[0])?
                        .f_narrow(3, 0, kernel[1])?
                        .f_transpose(0, 1)?;
                    total = Some(match total {
                        Some(sum) => sum.f_add(&part)?,
                        None => part,
                    });
                }
                let shape = match ty {
                    Type::Dense { shape, .. } => shape.iter().filter_map(Dim::as_static).collect(),
                    _ => Vec::new(),
                };
                Value::Dense(match total {
                    Some(total) => diagonal_blocks(&total, *groups)?.f_contiguous()?,
                    None => Tensor::f_zeros(shape.as_slice(), (images.kind(), images.device()))?,
                })
            }
            _ => self.run_pooling_gradient(value, op, ty)?,
        })
    }

    /// Runs the gradient op of a pooling or an image mean.
    fn run_pooling_gradient(&self, value: ValueId, op: &Op, ty: &Type) -> Result<Value> {
        Ok(match op {
            Op::Pool2dGrad {
                max,
                x,
                g,
                kernel,
                stride,
                padding,
            } => {
                let (images, grads) = (self.nested(*x)?, self.nested(*g)?);
                let spread = images
                    .elements()?
                    .iter()
                    .zip(grads.elements()?)
                    .map(|(image, grad)| {
                        let (image, grad) = (image.f_unsqueeze(0)?, grad.f_unsqueeze(0)?);
                        let spread = if *max {
                            let (_, indices) = image.f_max_pool2d_with_indices(
                                kernel,
                                stride,
                                padding,
                                [1, 1],
                                false,
                            )?;
                            image.f_max_pool2d_with_indices_backward(
                                &grad,
                                kernel,
                                stride,
                                padding,
                                [1, 1],
                                false,
                                &indices,
                            )?
                        } else {
                            image.f_avg_pool2d_backward(
                                &grad,
                                kernel,
                                stride,
                                padding,
                                false,
                                false,
                                None::<i64>,
                            )?
                        };
                        Ok(spread.f_squeeze_dim(0)?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                self.images(value, ty, &spread)?
            }
            Op::ImageMeanGrad { g, x } => {
                let (grads, images) = (self.nested(*g)?, self.nested(*x)?);
                let spread = grads
                    .elements()?
                    .iter()
                    .zip(images.elements()?)
                    .map(|(g, image)| {
                        let size = image.size();
                        Ok(g.f_expand(&size, false)?
                            .f_div_scalar((size[1] * size[2]) as f64)?)
                    })
                    .collect::<Result<Vec<_>>>()?;
                self.images(value, ty, &spread)?
            }
            Op::AdaptiveAvgPool2dGrad { g, x, output } => {
                let pool = |x: &Tensor| -> Result<Tensor> {
                    Ok(x.f_unsqueeze(0)?
                        .f_adaptive_avg_pool2d(output.as_slice())?
                        .f_squeeze_dim(0)?)
                };
                self.adjoint(value, ty, (*g, *x), pool)?
            }
            Op::InterpolateBilinearGrad {
                g,
                x,
                output,
                align_corners,
            } => self.adjoint(value, ty, (*g, *x), |x| bilinear(x, output, *align_corners))?,
            other => return Err(not_in_family(other, "per element")),
        })
    }

    /// The images like `x` that a linear per-image map `f`'s adjoint gives `g`: the
    /// gradient of `sum(f(image) * g)`, with gradients recorded whatever the caller's
    /// mode.
    fn adjoint(
        &self,
        value: ValueId,
        ty: &Type,
        (g, x): (ValueId, ValueId),
        f: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Value> {
        let (grads, images) = (self.nested(g)?, self.nested(x)?);
        let spread = grads
            .elements()?
            .iter()
            .zip(images.elements()?)
            .map(|(g, image)| {
                tch::with_grad(|| {
                    let x = image.f_detach()?.f_set_requires_grad(true)?;
                    let product = f(&x)?.f_mul(g)?.f_sum(None)?;
                    let grads = Tensor::f_run_backward(&[product], &[&x], false, false)?;
                    Ok(grads[0].shallow_clone())
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.images(value, ty, &spread)
    }

    fn per_element(
        &self,
        value: ValueId,
        inputs: &[ValueId],
        body: &Graph,
        ty: &Type,
    ) -> Result<Value> {
        let batch = self.nested(inputs[0])?;
        if let Some(nested) = self.whole_batch(batch, inputs, body)? {
            return self.checked(value, ty, nested);
        }
        let ragged: Vec<usize> = match ty {
            Type::Ragged { dims, .. } => dims
                .iter()
                .enumerate()
                .filter(|(_, d)| matches!(d, ElemDim::Ragged(_)))
                .map(|(i, _)| i)
                .collect(),
            _ => Vec::new(),
        };
        let mut outputs = Vec::with_capacity(batch.batch_size());
        for element in batch.elements()? {
            let mut body_inputs = vec![Value::Dense(element)];
            for &input in &inputs[1..] {
                body_inputs.push(self.get(input).share());
            }
            let result = interpret(body, body_inputs)?
                .into_iter()
                .next()
                .ok_or_else(|| mismatch(value.to_string(), "the body returned nothing".into()))?;
            outputs.push(result.into_dense()?);
        }
        let nested = NestedTensor::builder()
            .ragged_dims(&ragged)
            .tensors(&outputs)?;
        self.checked(value, ty, nested)
    }

    /// Images (ragged `H` and `W`) as `value`, checked against its type `ty`.
    fn images(&self, value: ValueId, ty: &Type, images: &[Tensor]) -> Result<Value> {
        let nested = NestedTensor::builder()
            .ragged_dims(&[1, 2])
            .tensors(images)?;
        self.checked(value, ty, nested)
    }

    /// `nested` as `value`, once it is checked against its type `ty`.
    fn checked(&self, value: ValueId, ty: &Type, nested: NestedTensor) -> Result<Value> {
        let mut checker = Interpreter {
            graph: self.graph,
            values: self.values.iter().map(Value::share).collect(),
            symbols: self.symbols.clone(),
        };
        checker.check(
            &value.to_string(),
            ty,
            &Value::Nested(nested.shallow_clone()),
        )?;
        Ok(Value::Nested(nested))
    }
}

impl Interpreter<'_> {
    /// A region whose body is one convolution or pooling of its element runs as the
    /// batch's operator (packed where the batch is packed images), as eager code did;
    /// `None` for other bodies.
    fn whole_batch(
        &self,
        batch: &NestedTensor,
        inputs: &[ValueId],
        body: &Graph,
    ) -> Result<Option<NestedTensor>> {
        let [output] = body.outputs[..] else {
            return Ok(None);
        };
        // The region input a body value is (the element is input 0).
        let input = |id: ValueId| body.input_position(id);
        let param = |id: ValueId| -> Result<Option<&Tensor>> {
            match input(id) {
                Some(position) if position > 0 => Ok(Some(self.dense(inputs[position])?)),
                _ => Ok(None),
            }
        };
        let pair = |values: &[i64]| <[i64; 2]>::try_from(values).ok();
        Ok(match body.op(output) {
            Op::Conv2d {
                x,
                weight,
                bias,
                stride,
                padding,
                dilation,
                groups,
            } if input(*x) == Some(0) => {
                let (Some(weight), Some(stride), Some(padding), Some(dilation)) =
                    (param(*weight)?, pair(stride), pair(padding), pair(dilation))
                else {
                    return Ok(None);
                };
                let bias = match bias {
                    Some(bias) => match param(*bias)? {
                        Some(bias) => Some(bias),
                        None => return Ok(None),
                    },
                    None => None,
                };
                Some(batch.conv2d(weight, bias, stride, padding, dilation, *groups)?)
            }
            Op::Pool2d {
                kind,
                x,
                kernel,
                stride,
                padding,
            } if input(*x) == Some(0) => {
                let (Some(kernel), Some(stride), Some(padding)) =
                    (pair(kernel), pair(stride), pair(padding))
                else {
                    return Ok(None);
                };
                Some(match kind {
                    PoolKind::Max => batch.max_pool2d(kernel, stride, padding)?,
                    PoolKind::Avg => batch.avg_pool2d(kernel, stride, padding)?,
                })
            }
            Op::AdaptiveAvgPool2d { x, output } if input(*x) == Some(0) => match pair(output) {
                Some(output) => Some(batch.adaptive_avg_pool2d(output)?),
                None => None,
            },
            _ => None,
        })
    }
}

/// The blocks on the diagonal of a dense weight (or gradient) `[C_out, C_in, ...]` of a
/// convolution in `groups` groups: `[C_out, C_in / groups, ...]`, each output channel's
/// group's input channels.
fn diagonal_blocks(dense: &Tensor, groups: i64) -> Result<Tensor> {
    if groups == 1 {
        return Ok(dense.shallow_clone());
    }
    let size = dense.size();
    let (out, inputs) = (size[0] / groups, size[1] / groups);
    let blocks = (0..groups)
        .map(|group| {
            dense
                .f_narrow(0, group * out, out)?
                .f_narrow(1, group * inputs, inputs)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Tensor::f_cat(&blocks, 0)?)
}

/// Bilinear interpolation of one image `[C, H, W]` to `[C, *output]`, as torch's.
fn bilinear(image: &Tensor, output: &[i64], align_corners: bool) -> Result<Tensor> {
    Ok(image
        .f_unsqueeze(0)?
        .f_upsample_bilinear2d(output, align_corners, None::<f64>, None::<f64>)?
        .f_squeeze_dim(0)?)
}
