"""The PyTorch baselines of the GPU check, on the same sizes and lengths as gpu-check's
timed lines (backend-cuda/src/bin/gpu-check.rs):

- one post-norm TransformerEncoderLayer (d_model 256, 4 heads, feed-forward 1024: the
  sizes of `encoder_layer_256`) on 16 lengths at 20, 35 and 77% occupancy of 256, padded
  with a key padding mask, in inference: f32 eager with the fast path on and off, f32
  torch.compile, and bf16 as a user runs it (torch.autocast, eager and torch.compile);
- attention over elements of 2048, 1536, 1024 and 512 rows (16 heads of 64, bf16): padded
  scaled_dot_product_attention with a padding mask, and one call per element (no
  padding, flash attention), with their achieved TFLOP/s;
- torch.exp over 32 Mi values (f32 and bf16) and its achieved bandwidth.

Prints the median milliseconds of 20 runs after 5. torch.compile's compilations stop
once 180 s have gone by (the rest are reported as skipped), so that the check stays
within its budget.

    python3 scripts/gpu-torch-baseline.py [cuda|cpu]
"""
import statistics
import sys
import time

import torch

OCCUPANCIES = {
    "20%": [256, 20, 45, 31, 60, 12, 70, 41, 28, 55, 47, 15, 52, 36, 30, 21],
    "35%": [256, 40, 117, 61, 98, 23, 135, 77, 52, 110, 89, 30, 125, 70, 64, 87],
    "77%": [256, 180, 240, 199, 220, 150, 256, 210, 175, 230, 205, 160, 245, 190, 198, 40],
}
ATTENTION_LENGTHS = [2048, 1536, 1024, 512]
COMPILE_BUDGET_S = 180.0
STARTED = time.perf_counter()


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


def compile_allowed():
    return time.perf_counter() - STARTED < COMPILE_BUDGET_S


def encoder(device):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        256, 4, dim_feedforward=1024, dropout=0.0, batch_first=True
    ).to(device).eval()
    print(f"torch {torch.__version__} on {device}: TransformerEncoderLayer 256/4/1024, batch 16")
    for name, lengths in OCCUPANCIES.items():
        longest = max(lengths)
        x = torch.randn(len(lengths), longest, 256, device=device)
        positions = torch.arange(longest, device=device)
        padding = positions[None, :] >= torch.tensor(lengths, device=device)[:, None]
        run = lambda model: (lambda: model(x, src_key_padding_mask=padding))
        with torch.no_grad():
            for fast in (True, False):
                torch.backends.mha.set_fastpath_enabled(fast)
                ms = median_ms(run(layer), device)
                print(f"{name}: padded torch eager f32, fast path {'on' if fast else 'off'}: {ms:.3f} ms")
            torch.backends.mha.set_fastpath_enabled(True)
            with torch.autocast(device, dtype=torch.bfloat16):
                ms = median_ms(run(layer), device)
                print(f"{name}: padded torch eager, autocast bf16: {ms:.3f} ms")
            for dtype in ("f32", "bf16"):
                if not compile_allowed():
                    print(f"{name}: padded torch.compile {dtype}: skipped (compile budget spent)")
                    continue
                torch._dynamo.reset()
                compiled = torch.compile(layer)
                if dtype == "f32":
                    ms = median_ms(run(compiled), device)
                else:
                    with torch.autocast(device, dtype=torch.bfloat16):
                        ms = median_ms(run(compiled), device)
                print(f"{name}: padded torch.compile {dtype}: {ms:.3f} ms")


def attention(device):
    torch.manual_seed(0)
    dtype = torch.bfloat16
    heads, width = 16, 64
    longest = max(ATTENTION_LENGTHS)
    flops = sum(4.0 * length * length * heads * width for length in ATTENTION_LENGTHS)
    q, k, v = (
        torch.randn(len(ATTENTION_LENGTHS), heads, longest, width, device=device, dtype=dtype)
        for _ in range(3)
    )
    positions = torch.arange(longest, device=device)
    keep = positions[None, :] < torch.tensor(ATTENTION_LENGTHS, device=device)[:, None]
    mask = keep[:, None, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        ms = median_ms(lambda: sdpa(q, k, v, attn_mask=mask), device)
        print(f"attention bf16 {ATTENTION_LENGTHS}, padded SDPA with a mask: {ms:.3f} ms, "
              f"{flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s of the real pairs")
        parts = [
            (q[i : i + 1, :, :n], k[i : i + 1, :, :n], v[i : i + 1, :, :n])
            for i, n in enumerate(ATTENTION_LENGTHS)
        ]
        ms = median_ms(lambda: [sdpa(*part) for part in parts], device)
        print(f"attention bf16 {ATTENTION_LENGTHS}, an SDPA call per element: {ms:.3f} ms, "
              f"{flops / (ms * 1e-3) / 1e12:.1f} TFLOP/s")


def pointwise(device):
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(8 * 4096, 1024, device=device, dtype=dtype)
        ms = median_ms(lambda: torch.exp(x), device)
        gbps = 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9
        print(f"torch.exp over 32 Mi {dtype}: {ms:.3f} ms, {gbps:.0f} GB/s")


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    encoder(device)
    attention(device)
    pointwise(device)


if __name__ == "__main__":
    main()
