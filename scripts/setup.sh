#!/usr/bin/env bash
# Installs what nestor needs to build and test, idempotently:
#   - LLVM 19 development packages (Debian's apt), for the code generators, the DejaVu
#     fonts the benchmark report's charts are drawn with, and the `fortunes` quotations
#     the compiled-training example learns from, and Gloo's headers (libgloo-dev) for the
#     C++ shim of nestor-distributed over c10d (the torch wheel ships c10d's, not Gloo's);
#   - a virtual environment with torch==2.13.0 (the libtorch that tch 0.26 links),
#     CUDA's C++ headers (nvidia-cuda-cccl, for the NCCL shim of nestor-distributed),
#     torchvision and transformers (the tests make ResNet and BERT checkpoints with them),
#     kept in a cache outside the checkout so that every clone shares one install.
# Quick when everything is already present. Set NESTOR_CACHE to move the cache, and
# NESTOR_PYTHON to create the venv with another python3.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=scripts/env.sh
source "$here/env.sh"

apt_packages=(llvm-19-dev libpolly-19-dev libzstd-dev fonts-dejavu-core fortunes libgloo-dev)
apt_missing() {
  [ ! -x "$LLVM_SYS_191_PREFIX/bin/llvm-config" ] || [ ! -f "$LLVM_SYS_191_PREFIX/lib/libPolly.a" ] \
    || ! dpkg -s libzstd-dev fonts-dejavu-core fortunes libgloo-dev >/dev/null 2>&1
}
# NESTOR_SETUP_APT=0 skips this step (the tests of the venv logic below set it).
if [ "${NESTOR_SETUP_APT:-1}" != 0 ] && apt_missing; then
  echo "nestor setup: installing ${apt_packages[*]} with apt-get" >&2
  sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${apt_packages[@]}" >/dev/null
fi

if ! compgen -G "$NESTOR_VENV/lib/python3*/site-packages/torch-${NESTOR_TORCH_VERSION}*.dist-info" >/dev/null; then
  echo "nestor setup: installing torch==$NESTOR_TORCH_VERSION into $NESTOR_VENV (a few GB, once)" >&2
  mkdir -p "$NESTOR_CACHE"
  "${NESTOR_PYTHON:-python3}" -m venv "$NESTOR_VENV"
  "$NESTOR_VENV/bin/pip" install --quiet --disable-pip-version-check "torch==$NESTOR_TORCH_VERSION"
fi

# CUDA's C++ headers (CCCL) that the torch wheel's CUDA runtime package lacks and c10d's
# NCCL header includes: for nestor-distributed's `nccl` feature (a few MB of headers).
if ! compgen -G "$NESTOR_VENV/lib/python3*/site-packages/nvidia/cu13/include/nv/target" >/dev/null; then
  echo "nestor setup: installing nvidia-cuda-cccl (CUDA C++ headers) into $NESTOR_VENV" >&2
  "$NESTOR_VENV/bin/pip" install --quiet --disable-pip-version-check "nvidia-cuda-cccl==13.0.*"
fi

# torchvision and transformers (matching torch), with which the tests make the ResNet and
# BERT checkpoints that nestor's models load (random weights: nothing is downloaded).
if ! compgen -G "$NESTOR_VENV/lib/python3*/site-packages/torchvision-${NESTOR_TORCHVISION_VERSION}*.dist-info" >/dev/null \
    || ! compgen -G "$NESTOR_VENV/lib/python3*/site-packages/transformers-${NESTOR_TRANSFORMERS_VERSION}*.dist-info" >/dev/null; then
  echo "nestor setup: installing torchvision==$NESTOR_TORCHVISION_VERSION and transformers==$NESTOR_TRANSFORMERS_VERSION into $NESTOR_VENV" >&2
  "$NESTOR_VENV/bin/pip" install --quiet --disable-pip-version-check \
    "torchvision==$NESTOR_TORCHVISION_VERSION" "transformers==$NESTOR_TRANSFORMERS_VERSION"
fi

# env.sh was sourced before the install on a first run: ask for torch's folder again.
LIBTORCH=${LIBTORCH:-$(nestor_find_libtorch || true)}
if [ -z "$LIBTORCH" ] || [ ! -f "$LIBTORCH/lib/libtorch_cpu.so" ]; then
  echo "nestor setup: no libtorch_cpu.so under ${LIBTORCH:-$NESTOR_VENV/lib/python3*/site-packages/torch} after the install" >&2
  exit 1
fi
