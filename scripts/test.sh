#!/usr/bin/env bash
# The test command (README, CI): install, then run every test on the CPU. Reads GSM8K from ../shared/data/gsm8k.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q tests "$@"
