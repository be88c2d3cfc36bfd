#!/usr/bin/env bash
# The GPU check, in two halves (issue 12).
#
#   scripts/gpu-check.sh prepare   # here, with Rust: writes gpu-check/ (ignored by git):
#                                  # the cases (one per kernel template kind: PTX for
#                                  # sm_80 and sm_90, inputs, the CPU backend's outputs)
#                                  # and the `gpu-check` runner, which needs only libcuda
#   scripts/gpu-check.sh run       # on the GPU machine (no Rust, no network): runs every
#                                  # case there, compares, writes $OUT/gpu-check.txt
#
# With the device tool: prepare here, then run `scripts/gpu-check.sh run` with
# carry ["gpu-check"]. Not yet: the encoder forward and its timing against padded torch
# (the CUDA backend has no executor of whole programs yet).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
folder="$root/gpu-check"

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
    # The runner links part of LLVM statically, which needs libffi: it travels along.
    ffi=$(ldd "$folder/bin/gpu-check" | awk '/libffi/ {print $3}')
    if [ -n "$ffi" ]; then cp "$ffi" "$folder/bin/"; fi
    echo "gpu-check: $(find "$folder/cases" -name meta.txt | wc -l) cases, $(du -sh "$folder" | cut -f1) in $folder"
    ;;
  run)
    out="${OUT:-$folder/out}"
    mkdir -p "$out"
    (nvidia-smi || true) > "$out/nvidia-smi.txt" 2>&1
    status=0
    LD_LIBRARY_PATH="$folder/bin:${LD_LIBRARY_PATH:-}" "$folder/bin/gpu-check" "$folder/cases" "$out" || status=$?
    echo "gpu-check exited with $status" | tee -a "$out/gpu-check.txt"
    exit "$status"
    ;;
  *)
    echo "usage: scripts/gpu-check.sh prepare|run" >&2
    exit 2
    ;;
esac
