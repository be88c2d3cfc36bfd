"""What a PyTorch user would run instead of nestor, timed on the report's batches.

The report (benches/src/pytorch.rs) runs this file with the torch venv's Python, once per
model, mode and batch, and reads one line per option from stdout:

    <option>\t<median ms>\t<25th percentile ms>\t<75th percentile ms>\t<first call ms>\t<graphs>
    <option>\tunavailable\t<why>

Options (each on the same lengths and weight shapes as the report's other columns):
- padded eager with the fast path on (PyTorch's default in eval mode under no_grad; the
  encoder's fast path packs the batch into nested tensors itself), and without it;
- padded under torch.compile (the fast path off, as it does not trace);
- torch.nested (jagged layout) eager and under torch.compile, through a hand-written
  post-norm encoder layer on scaled_dot_product_attention (nn.MultiheadAttention does
  not take jagged tensors); encoder only.
With --dtype bf16 the options are what a bf16 user runs: padded eager and torch.compile
under torch.autocast("cpu", dtype=torch.bfloat16) (the f32 model, its products in
bf16; in the lines of "padded eager (no fast path)" and "padded torch.compile", and the
channels-last ones of the conv net), the model converted to bf16 with the fast path (the
line of "padded eager, fast path on"), and torch.nested on the model and batch converted
to bf16.
"graphs" counts the graphs torch.compile compiled over every call (1: one compile served
every call; more: graph breaks or recompiles). Training steps are the report's: the mean
square of the real outputs, backward, SGD at rate 1e-5.

    python3 benches/pytorch.py --model TransformerEncoder --mode inference --samples 7 \
        --threads 2 --d-model 256 --heads 4 --feedforward 1024 --layers 2 \
        --source 256,40,117 --target 98,23,135
    python3 benches/pytorch.py --model "ResNet-style conv net" --mode training --samples 7 \
        --threads 2 --channels 16 --side 64 --images 64x64,31x12

MODEL is TransformerEncoder, TransformerDecoder, Transformer or the conv net (padded
eager and torch.compile only, in the default layout and channels-last: a 3x3 stem, a residual block of two 3x3 convolutions, each
output masked to the image's pixels, masked mean pooling, a linear head to 10 classes;
the loss is the mean square of the logits). MODE is inference or training.
"""
import argparse
import contextlib
import copy
import os
import sys

# A CPU benchmark: the CUDA wheel otherwise asks the (possibly missing) driver in some
# nested-tensor paths and fails.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from timing import timed  # noqa: E402


class Counting:
    """A torch.compile backend that counts the graphs it compiles with inductor."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph, example_inputs)


def padded_batch(lengths, d_model):
    longest = max(lengths)
    x = torch.randn(len(lengths), longest, d_model)
    padding = torch.arange(longest)[None, :] >= torch.tensor(lengths)[:, None]
    return x, padding


class Model(nn.Module):
    """The report's models: post-norm stacks with a final norm, no dropout."""

    def __init__(self, kind, d_model, heads, feedforward, layers):
        super().__init__()
        layer = lambda cls: cls(d_model, heads, feedforward, dropout=0.0, batch_first=True)
        self.encoder = None
        self.decoder = None
        if kind != "TransformerDecoder":
            self.encoder = nn.TransformerEncoder(
                layer(nn.TransformerEncoderLayer), layers, norm=nn.LayerNorm(d_model))
        if kind != "TransformerEncoder":
            self.decoder = nn.TransformerDecoder(
                layer(nn.TransformerDecoderLayer), layers, norm=nn.LayerNorm(d_model))

    def forward(self, source, source_padding, target, target_padding):
        memory = source
        if self.encoder is not None:
            memory = self.encoder(source, src_key_padding_mask=source_padding)
            if memory.is_nested:
                # The fast path returns a nested tensor; the report's output is padded.
                memory = memory.to_padded_tensor(0.0, source.size())
        if self.decoder is None:
            return memory
        causal = nn.Transformer.generate_square_subsequent_mask(target.size(1))
        return self.decoder(
            target, memory, tgt_mask=causal, tgt_is_causal=True,
            tgt_key_padding_mask=target_padding, memory_key_padding_mask=source_padding)


class ConvNet(nn.Module):
    """The report's conv net on padded images with a `[B, 1, side, side]` pixel mask."""

    def __init__(self, channels):
        super().__init__()
        conv = lambda inputs: nn.Conv2d(inputs, channels, 3, padding=1)
        self.stem, self.conv1, self.conv2 = conv(3), conv(channels), conv(channels)
        self.head = nn.Linear(channels, 10)

    def forward(self, images, mask):
        conv = lambda layer, x: layer(x) * mask
        stem = F.relu(conv(self.stem, images))
        hidden = F.relu(conv(self.conv1, stem))
        block = F.relu(conv(self.conv2, hidden) + stem)
        pooled = block.sum((2, 3)) / mask.sum((2, 3))
        return self.head(pooled)


def jagged_layer(layer, x, heads):
    """One post-norm nn.TransformerEncoderLayer's computation on a jagged batch."""
    attention = layer.self_attn
    d_model = x.size(-1)
    q, k, v = F.linear(x, attention.in_proj_weight, attention.in_proj_bias).chunk(3, dim=-1)
    # The math backend (the CPU's for jagged batches) wants each of q, k, v contiguous.
    split = lambda t: t.contiguous().unflatten(-1, [heads, d_model // heads]).transpose(1, 2)
    y = F.scaled_dot_product_attention(split(q), split(k), split(v))
    y = attention.out_proj(y.transpose(1, 2).flatten(-2))
    x = layer.norm1(x + y)
    y = layer.linear2(F.relu(layer.linear1(x)))
    return layer.norm2(x + y)


def jagged_encoder(model, x, heads):
    for layer in model.encoder.layers:
        x = jagged_layer(layer, x, heads)
    return model.encoder.norm(x)


def autocast(args):
    """A context that runs a forward in the precision of --dtype: torch.autocast to bf16,
    or nothing."""
    if args.dtype == "bf16":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def under(context, forward):
    """`forward` run inside `context()`, its result as f32 (the losses are f32)."""
    def run():
        with context():
            return forward().float()
    return run


def step_of(forward, loss, training, optimizer):
    """An inference step, or a training step: loss, backward, an optimizer step."""
    if not training:
        def infer():
            with torch.no_grad():
                forward()
        return infer

    def train():
        optimizer.zero_grad()
        loss(forward()).backward()
        optimizer.step()
    return train


def conv_options(args, training):
    """Padded eager and padded torch.compile of the conv net, in the default layout and
    channels-last (the layout oneDNN's CPU convolutions run fastest in)."""
    model = ConvNet(args.channels)
    model.train(training)
    amp = autocast(args)
    images = torch.zeros(len(args.images), 3, args.side, args.side)
    mask = torch.zeros(len(args.images), 1, args.side, args.side)
    for index, (height, width) in enumerate(args.images):
        images[index, :, :height, :width] = torch.randn(3, height, width)
        mask[index, :, :height, :width] = 1.0
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    loss = lambda logits: logits.square().mean()
    step = lambda module: step_of(under(amp, lambda: module(images, mask)), loss, training,
                                  optimizer)
    counting = Counting()
    compiled = torch.compile(model, backend=counting)
    # The same weights, images and mask channels-last, with their own optimizer.
    last = copy.deepcopy(model).to(memory_format=torch.channels_last)
    last_images = images.contiguous(memory_format=torch.channels_last)
    last_mask = mask.contiguous(memory_format=torch.channels_last)
    last_optimizer = torch.optim.SGD(last.parameters(), lr=1e-5)
    last_step = lambda module: step_of(under(amp, lambda: module(last_images, last_mask)), loss,
                                       training, last_optimizer)
    last_counting = Counting()
    last_compiled = torch.compile(last, backend=last_counting)
    return [
        ("padded eager (no fast path)", False, lambda: step(model), None),
        ("padded torch.compile", False, lambda: step(compiled), counting),
        ("padded eager channels-last", False, lambda: last_step(last), None),
        ("padded torch.compile channels-last", False, lambda: last_step(last_compiled),
         last_counting),
    ]


def transformer_options(args, training):
    """Padded eager (fast path on and off), padded torch.compile, torch.nested jagged
    eager and compiled (encoder) of a Transformer model."""
    kind, d_model, heads = args.model, args.d_model, args.heads
    feedforward, layers = args.feedforward, args.layers
    source_lengths, target_lengths = args.source, args.target
    model = Model(kind, d_model, heads, feedforward, layers)
    model.train(training)
    bf16 = args.dtype == "bf16"
    amp = autocast(args)
    # The model and batches converted to bf16 (the bf16 fast path and torch.nested).
    converted = copy.deepcopy(model).to(torch.bfloat16) if bf16 else model
    convert = (lambda tensor: tensor.to(torch.bfloat16)) if bf16 else (lambda tensor: tensor)
    converted_optimizer = torch.optim.SGD(converted.parameters(), lr=1e-5) if bf16 else None
    source, source_padding = padded_batch(source_lengths, d_model)
    target, target_padding = padded_batch(target_lengths, d_model)
    out_lengths = source_lengths if kind == "TransformerEncoder" else target_lengths
    out_mask = (~(source_padding if kind == "TransformerEncoder" else target_padding))[..., None]
    count = sum(out_lengths) * d_model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    padded_loss = lambda output: (output.float().square() * out_mask).sum() / count
    padded = under(amp, lambda: model(source, source_padding, target, target_padding))
    fast_padded = lambda: converted(convert(source), source_padding, convert(target),
                                    target_padding)
    options = []
    if not training:  # The fast path is for inference only.
        options.append(("padded eager, fast path on", True,
                        lambda: step_of(fast_padded, padded_loss, training, optimizer), None))
    options.append(("padded eager (no fast path)", False,
                    lambda: step_of(padded, padded_loss, training, optimizer), None))
    counting = Counting()
    compiled_model = torch.compile(model, backend=counting)
    options.append(("padded torch.compile", False,
                    lambda: step_of(under(amp, lambda: compiled_model(source, source_padding,
                                                                      target, target_padding)),
                                    padded_loss, training, optimizer),
                    counting))
    if kind == "TransformerEncoder":
        elements = [convert(torch.randn(length, d_model)) for length in source_lengths]
        jagged = torch.nested.nested_tensor(elements, layout=torch.jagged)
        jagged_loss = lambda output: output.values().float().square().sum() / count
        jagged_optimizer = converted_optimizer if bf16 else optimizer
        options.append(("torch.nested jagged eager", False,
                        lambda: step_of(lambda: jagged_encoder(converted, jagged, heads),
                                        jagged_loss, training, jagged_optimizer),
                        None))
        jagged_counting = Counting()
        compiled_jagged = torch.compile(jagged_encoder, backend=jagged_counting)
        options.append(("torch.nested jagged torch.compile", False,
                        lambda: step_of(lambda: compiled_jagged(converted, jagged, heads),
                                        jagged_loss, training, jagged_optimizer),
                        jagged_counting))
    return options


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--mode", choices=["inference", "training"], required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    for name in ("--d-model", "--heads", "--feedforward", "--layers", "--channels", "--side"):
        parser.add_argument(name, type=int, default=0)
    lengths = lambda text: [int(length) for length in text.split(",")]
    parser.add_argument("--source", type=lengths, default=[])
    parser.add_argument("--target", type=lengths, default=[])
    sizes = lambda text: [tuple(int(side) for side in size.split("x")) for size in text.split(",")]
    parser.add_argument("--images", type=sizes, default=[])
    return parser.parse_args()


def main():
    args = arguments()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    training = args.mode == "training"
    if args.model == "ResNet-style conv net":
        options = conv_options(args, training)
    else:
        options = transformer_options(args, training)
    for name, fast, make_step, counter in options:
        torch.backends.mha.set_fastpath_enabled(fast)
        try:
            median, low, high, first = timed(make_step(), args.samples)
        except Exception as error:  # An option PyTorch does not support here.
            why = " ".join(str(error).split())[:200]
            print(f"{name}\tunavailable\t{type(error).__name__}: {why}", flush=True)
            continue
        graphs = counter.graphs if counter is not None else 0
        print(f"{name}\t{median:.4f}\t{low:.4f}\t{high:.4f}\t{first:.1f}\t{graphs}", flush=True)
    torch.backends.mha.set_fastpath_enabled(True)


if __name__ == "__main__":
    main()
