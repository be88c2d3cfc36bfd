# Sourced by the other scripts: where nestor's tools live. Every variable can be
# overridden from the environment.
NESTOR_CACHE=${NESTOR_CACHE:-$HOME/.cache/nestor}
NESTOR_TORCH_VERSION=2.13.0
NESTOR_VENV=${NESTOR_VENV:-$NESTOR_CACHE/venv}
# tch's build script reads LIBTORCH (the torch package folder of the venv).
LIBTORCH=${LIBTORCH:-$(compgen -G "$NESTOR_VENV/lib/python3*/site-packages/torch" | head -n 1 || true)}
LIBTORCH=${LIBTORCH:-$NESTOR_VENV/lib/python3/site-packages/torch}
LLVM_SYS_191_PREFIX=${LLVM_SYS_191_PREFIX:-/usr/lib/llvm-19}
# One target folder for every clone (the checkout, CI's fresh clone) keeps builds incremental.
CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$NESTOR_CACHE/target}
export NESTOR_CACHE NESTOR_TORCH_VERSION NESTOR_VENV LIBTORCH LLVM_SYS_191_PREFIX CARGO_TARGET_DIR
