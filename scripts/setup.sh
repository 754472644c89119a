#!/usr/bin/env bash
# Install rlanywhere and what it needs on a fresh machine, with a torch build that has kernels for this GPU.
# src/rlanywhere/torch_setup.py decides (stdlib only, runs before rlanywhere is installed):
#   - an installed torch that runs here is kept (a CUDA build stays a CUDA build);
#   - an NVIDIA GPU of compute capability < 7.5 (Pascal P40/P100, Volta V100) gets PyTorch's CUDA 12.6 build
#     (--index-url https://download.pytorch.org/whl/cu126): since PyTorch 2.8 the default wheels have no kernels
#     for those cards ("no kernel image is available for execution on the device");
#   - newer GPUs get the default build; no GPU: torch 2.13.0 from pip's index (on Linux PyPI's build carries
#     CUDA libraries, several GB: install the CPU build first to keep it small, it is then kept:
#     pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu).
# TORCH_VERSION=... picks another torch version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DECISION=$("$PY" src/rlanywhere/torch_setup.py "${TORCH_VERSION:-2.13.0}")
case "$DECISION" in
  install\ *)
    # shellcheck disable=SC2086  # the pip arguments are meant to split
    if ! "$PY" -m pip install -q ${DECISION#install }; then
      echo "setup: 'pip install ${DECISION#install }' failed; install a torch build for your GPU by hand" \
           "(https://pytorch.org/get-started/locally/), then run this script again" >&2
      exit 1
    fi ;;
  *) echo "setup: ${DECISION}" ;;
esac
# EXTRAS: the optional dependency groups (scripts/test.sh adds docs: the tests build the documentation site)
"$PY" -m pip install -q -e ".[${EXTRAS:-test}]"
