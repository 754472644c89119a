#!/usr/bin/env bash
# Install rlanywhere and what it needs on a fresh machine, with a torch build that has kernels for this GPU.
# src/rlanywhere/torch_setup.py decides (stdlib only, runs before rlanywhere is installed):
#   - an installed torch that runs here is kept (a CUDA build stays a CUDA build);
#   - an NVIDIA GPU of compute capability < 7.5 (Pascal P40/P100, Volta V100) gets PyTorch's CUDA 12.6 build
#     (--index-url https://download.pytorch.org/whl/cu126): since PyTorch 2.8 the default wheels have no kernels
#     for those cards ("no kernel image is available for execution on the device");
#   - newer GPUs get the default build; no GPU: torch 2.13.0, on Linux PyTorch's CPU build
#     (--index-url https://download.pytorch.org/whl/cpu: PyPI's Linux wheel carries several GB of CUDA libraries),
#     from pip's own index where that one cannot be reached.
# TORCH_VERSION=... picks another torch version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DECISION=$("$PY" src/rlanywhere/torch_setup.py "${TORCH_VERSION:-2.13.0}")
case "$DECISION" in
  install\ *)
    read -r -a TORCH_ARGS <<< "${DECISION#install }"
    if [[ "$DECISION" == *whl/cpu* ]]; then
      # PyTorch's CPU index, else pip's own (the same version; on Linux with CUDA libraries, several GB)
      "$PY" -m pip install -q --retries 1 "${TORCH_ARGS[@]}" \
        || { echo "setup: PyTorch's CPU index could not be reached; installing ${TORCH_ARGS[0]} from pip's index" >&2
             "$PY" -m pip install -q "${TORCH_ARGS[0]}"; } || TORCH_FAILED=1
    else
      "$PY" -m pip install -q "${TORCH_ARGS[@]}" || TORCH_FAILED=1
    fi
    if [ -n "${TORCH_FAILED:-}" ]; then
      echo "setup: 'pip install ${DECISION#install }' failed; install a torch build for your GPU by hand" \
           "(https://pytorch.org/get-started/locally/), then run this script again" >&2
      exit 1
    fi ;;
  *) echo "setup: ${DECISION}" ;;
esac
# EXTRAS: the optional dependency groups (scripts/test.sh adds docs: the tests build the documentation site)
"$PY" -m pip install -q -e ".[${EXTRAS:-test}]"
