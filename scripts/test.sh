#!/usr/bin/env bash
# The test command (README, CI): install, then run every test on the CPU. Data: ../shared when it is beside the
# clone, else the small copies shipped in tests/data (README there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q tests "$@"
