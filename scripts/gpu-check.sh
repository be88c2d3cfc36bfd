#!/usr/bin/env bash
# The GPU check, in two halves (issue 12).
#
#   scripts/gpu-check.sh prepare   # here, with Rust: writes gpu-check/ (ignored by git):
#                                  # the kernel cases (one per template kind: PTX for
#                                  # sm_80 and sm_90, inputs, the CPU backend's outputs)
#                                  # and nestor-backend-cuda's `gpu-check` runner, which also
#                                  # runs whole programs (an encoder layer, a feed-forward
#                                  # block, gathers and padding, attention over jagged
#                                  # pairs, a conv net's windows, and training steps:
#                                  # lowered and made PTX there, run on the GPU and on the
#                                  # CPU runtime and compared); libdevice and the
#                                  # libraries LLVM needs travel along
#   scripts/gpu-check.sh run       # on the GPU machine (no Rust, no network): runs it
#                                  # (the kernel cases, the programs, and timed lines: the
#                                  # 256-wide encoder layer at 20 / 35 / 77% occupancy in
#                                  # f32 and bf16, attention's TFLOP/s on long elements,
#                                  # a pointwise kernel's GB/s) and the PyTorch baselines
#                                  # of the same sizes (scripts/gpu-torch-baseline.py:
#                                  # padded eager, torch.compile, autocast bf16, SDPA),
#                                  # writes $OUT/gpu-check.txt, torch.txt, cublas.txt and
#                                  # nvidia-smi.txt
#
# With the device tool: prepare here, then run `scripts/gpu-check.sh run` with
# carry ["gpu-check"]. GEMM products run on the machine's cuBLAS (found below: CUDA's
# folders or its Python's NVIDIA wheels; gpu-check.txt's first line says whether it
# loaded) and, compared, in GEMM kernels; attention with bf16 buffers runs on tensor
# cores (a warp per 16 query rows), with f32 buffers a block per 8 query rows sharing
# its keys through shared memory.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
folder="$root/gpu-check"

# Folders holding libcublas (CUDA 13's first, then 12's), one per line.
cublas_folders() {
  local roots=(/usr/local /usr/lib/x86_64-linux-gnu /opt)
  local packages
  packages=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null || true)
  # shellcheck disable=SC2206
  roots+=($packages)
  for version in 13 12; do
    find "${roots[@]}" -maxdepth 6 -name "libcublas.so.$version*" -printf '%h\n' 2>/dev/null || true
  done | awk '!seen[$0]++'
}

case "${1:-}" in
  prepare)
    rm -rf "$folder"
    mkdir -p "$folder/bin"
    NESTOR_GPU_CHECK_CASES="$folder/cases" "$root/scripts/cargo" test --release \
      -p nestor-backend-cuda --test gpu_check
    "$root/scripts/cargo" build --release -p nestor-backend-cuda --bin gpu-check
    # shellcheck source=scripts/env.sh
    source "$root/scripts/env.sh"
    cp "$CARGO_TARGET_DIR/release/gpu-check" "$folder/bin/"
    strip "$folder/bin/gpu-check"
    # The runner links LLVM statically, which needs libffi, zlib and zstd: they travel
    # along (a few hundred KB), and so does libdevice (the programs are made PTX there).
    ldd "$folder/bin/gpu-check" | awk '/libffi|libz\.|libzstd/ {print $3}' \
      | while read -r library; do cp "$library" "$folder/bin/"; done
    cp "${NESTOR_LIBDEVICE:-$LIBTORCH/../triton/backends/nvidia/lib/libdevice.10.bc}" "$folder/bin/"
    cp "$root/scripts/gpu-torch-baseline.py" "$folder/bin/"
    echo "gpu-check: $(find "$folder/cases" -name meta.txt | wc -l) cases, $(du -sh "$folder" | cut -f1) in $folder"
    ;;
  run)
    out="${OUT:-$folder/out}"
    mkdir -p "$out"
    (nvidia-smi || true) > "$out/nvidia-smi.txt" 2>&1
    cublas=$(cublas_folders | paste -sd: -)
    echo "libcublas folders: ${cublas:-none found}" > "$out/cublas.txt"
    export LD_LIBRARY_PATH="$folder/bin:${cublas:+$cublas:}${LD_LIBRARY_PATH:-}"
    export NESTOR_LIBDEVICE="$folder/bin/libdevice.10.bc"
    status=0
    "$folder/bin/gpu-check" --device cuda --cases "$folder/cases" "$out" || status=$?
    echo "gpu-check exited with $status" | tee -a "$out/gpu-check.txt"
    # The padded PyTorch baseline of encoder_layer_256 (same sizes and lengths).
    python3 "$folder/bin/gpu-torch-baseline.py" cuda 2>&1 | tee "$out/torch.txt" || true
    exit "$status"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh prepare|run" >&2
    exit 2
    ;;
esac
