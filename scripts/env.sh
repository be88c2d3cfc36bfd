# Sourced by the other scripts: where nestor's tools live. Every variable can be
# overridden from the environment.
NESTOR_CACHE=${NESTOR_CACHE:-$HOME/.cache/nestor}
NESTOR_TORCH_VERSION=2.13.0
NESTOR_TORCHVISION_VERSION=0.28.0
NESTOR_TRANSFORMERS_VERSION=5.23.0
NESTOR_VENV=${NESTOR_VENV:-$NESTOR_CACHE/venv}

# The torch package folder of the venv (what tch's build script reads as LIBTORCH), or
# nothing while the venv has no torch yet. A function, not a value computed once: on a
# first run this file is sourced before setup.sh creates the venv, so setup.sh asks again
# after the install.
nestor_find_libtorch() {
  local torch
  for torch in "$NESTOR_VENV"/lib/python3*/site-packages/torch; do
    if [ -f "$torch/lib/libtorch_cpu.so" ]; then
      echo "$torch"
      return 0
    fi
  done
  return 1
}

LIBTORCH=${LIBTORCH:-$(nestor_find_libtorch || true)}
LLVM_SYS_191_PREFIX=${LLVM_SYS_191_PREFIX:-/usr/lib/llvm-19}
# One target folder for every clone (the checkout, CI's fresh clone) keeps builds incremental.
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$NESTOR_CACHE/target}
export NESTOR_CACHE NESTOR_TORCH_VERSION NESTOR_TORCHVISION_VERSION NESTOR_TRANSFORMERS_VERSION NESTOR_VENV LIBTORCH LLVM_SYS_191_PREFIX CARGO_TARGET_DIR
