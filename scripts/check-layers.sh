#!/usr/bin/env bash
# The crate layers hold (make lint):
# - the runtime depends on no backend (the backends depend on it) and links no LLVM;
# - the simulated GPU (nestor-sim) needs no CUDA (neither the CUDA backend nor cudarc);
# - the eager configuration (the facade without its default `compile` feature) builds
#   without warnings and links neither LLVM (inkwell) nor the CUDA driver's crate (cudarc).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cargo="$here/cargo"

forbid() { # forbid <what> <pattern> <cargo tree args...>
    local what=$1 pattern=$2
    shift 2
    local found
    found=$("$cargo" tree -e normal --prefix none "$@" | grep -E "$pattern" | sort -u || true)
    if [[ -n $found ]]; then
        echo "check-layers: $what depends on:" >&2
        echo "$found" >&2
        exit 1
    fi
}

forbid "nestor-runtime" '^(nestor-backend-|inkwell|cudarc|nestor-codegen)' -p nestor-runtime
forbid "nestor-sim (the simulated GPU needs no CUDA)" '^(nestor-backend-cuda|cudarc)' -p nestor-sim
forbid "the eager configuration (nestor --no-default-features)" '^(inkwell|cudarc|nestor-codegen|nestor-backend-cuda)' \
    -p nestor --no-default-features
"$cargo" clippy -p nestor --no-default-features --lib --quiet -- -D warnings
echo "check-layers: the runtime depends on no backend; the simulator needs no CUDA; the eager configuration links neither LLVM nor cudarc"
