#!/usr/bin/env bash
# Install rlanywhere and what it needs on a fresh machine. Keeps a torch that is already installed (a CUDA build
# stays a CUDA build); otherwise installs torch 2.13.0 (on our CPU machines a local wheel, seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
