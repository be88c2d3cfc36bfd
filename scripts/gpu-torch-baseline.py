"""The padded PyTorch baseline of the GPU check: one post-norm TransformerEncoderLayer
(d_model 256, 4 heads, feed-forward 1024, the sizes of gpu-check's `encoder_layer_256`) on
the same 16 lengths (35% occupancy of 256), padded with a key padding mask, in inference:
the fast path on (PyTorch's default in eval mode under no_grad) and off. Prints the median
milliseconds of 20 runs after 5.

    python3 scripts/gpu-torch-baseline.py [cuda|cpu]
"""
import statistics
import sys
import time

import torch

LENGTHS = [256, 40, 117, 61, 98, 23, 135, 77, 52, 110, 89, 30, 125, 70, 64, 87]


def median_ms(step, device):
    for _ in range(5):
        step()
    times = []
    for _ in range(20):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        256, 4, dim_feedforward=1024, dropout=0.0, batch_first=True
    ).to(device).eval()
    longest = max(LENGTHS)
    x = torch.randn(len(LENGTHS), longest, 256, device=device)
    positions = torch.arange(longest, device=device)
    padding = positions[None, :] >= torch.tensor(LENGTHS, device=device)[:, None]
    occupancy = sum(LENGTHS) / (len(LENGTHS) * longest)
    print(f"torch {torch.__version__} on {device}: TransformerEncoderLayer 256/4/1024, "
          f"batch {len(LENGTHS)}, occupancy {occupancy:.2f}")
    with torch.no_grad():
        for fast in (True, False):
            torch.backends.mha.set_fastpath_enabled(fast)
            ms = median_ms(lambda: layer(x, src_key_padding_mask=padding), device)
            print(f"padded torch eager, fast path {'on' if fast else 'off'}: {ms:.3f} ms")
    torch.backends.mha.set_fastpath_enabled(True)


if __name__ == "__main__":
    main()
