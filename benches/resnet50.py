"""ResNet-50 as a PyTorch user runs it on batches of images of different sizes, timed on
the batches of the report's ResNet-50 rows (benches/src/bin/resnet50.rs runs this file
with the torch venv's Python and reads its lines).

torchvision's resnet50 (random weights), batch norms on their running statistics (eval
mode, as nestor's ResNet in the same rows), four options:
- padded eager: the images zero-padded into one [B, 3, H, W] batch (NCHW);
- padded eager channels-last (the layout oneDNN's CPU convolutions run fastest in);
- padded torch.compile, channels-last (compiled once, for the padded shape every batch
  shares: each batch holds a full-size image);
- a loop over the images alone, eager.
Inference runs under no_grad; a training step is the mean of the scores (of each image
alone in the loop, averaged), backward, SGD at rate 1e-5. With --dtype bf16 every option
runs under torch.autocast("cpu", dtype=torch.bfloat16).

    python3 benches/resnet50.py --mode inference --dtype f32 --samples 5 --threads 2 \\
        --batch 224x224,34x33,120x80 --batch 224x224,200x150

One line per batch and option:
    <batch index>\\t<option>\\t<median ms>\\t<25th percentile ms>\\t<75th percentile ms>\\t<first call ms>
    <batch index>\\t<option>\\tunavailable\\t<why>
"""
import argparse
import contextlib
import copy
import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402
import torchvision  # noqa: E402
from timing import print_row, timed  # noqa: E402


def sizes_of(text):
    return [tuple(int(side) for side in size.split("x")) for size in text.split(",")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["inference", "training"], required=True)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", action="append", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    training = args.mode == "training"
    autocast = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16))
        if args.dtype == "bf16"
        else contextlib.nullcontext
    )
    model = torchvision.models.resnet50().eval()
    # A copy in channels-last (`to` converts a module in place), and it compiled.
    channels_last = copy.deepcopy(model).to(memory_format=torch.channels_last)
    compiled = torch.compile(channels_last)
    optimizers = {
        id(net): torch.optim.SGD(net.parameters(), lr=1e-5) for net in (model, channels_last)
    }

    def step_of(net, forward):
        optimizer = optimizers[id(net)]

        def step():
            if training:
                optimizer.zero_grad()
                with autocast():
                    loss = forward()
                loss.backward()
                optimizer.step()
            else:
                with torch.no_grad(), autocast():
                    forward()

        return step

    for index, batch in enumerate(args.batch):
        sizes = sizes_of(batch)
        images = [torch.randn(3, h, w) for h, w in sizes]
        height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
        padded = torch.zeros(len(sizes), 3, height, width)
        for at, image in enumerate(images):
            padded[at, :, : image.shape[1], : image.shape[2]] = image
        padded_last = padded.contiguous(memory_format=torch.channels_last)
        scores = lambda net, x: net(x).float().mean()
        options = [
            ("padded eager", model, lambda: scores(model, padded)),
            ("padded eager channels-last", channels_last, lambda: scores(channels_last, padded_last)),
            ("padded torch.compile channels-last", channels_last, lambda: scores(compiled, padded_last)),
            (
                "per-image loop eager",
                model,
                lambda: sum(scores(model, image[None]) for image in images) / len(images),
            ),
        ]
        for name, net, forward in options:
            print_row(index, name, lambda: timed(step_of(net, forward), args.samples))


if __name__ == "__main__":
    main()
