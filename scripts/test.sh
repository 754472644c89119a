#!/usr/bin/env bash
# The test command (README, CI): install, then run every test on the CPU, the documentation site's strict build
# included. Data: ../shared when it is beside the clone, else the small copies shipped in tests/data (README there).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test,docs bash scripts/setup.sh  # docs: mkdocs, whose strict build is one of the tests
# FastEngine's Triton kernels are tested on Triton's CPU interpreter (tests/conftest.py); a CPU build of torch
# brings no triton, so the tests install it (>= 3.9: older interpreters fail under numpy 2.4; a CUDA build's own
# triton is left as it is, and those tests skip there if it is older)
"${PYTHON:-python3}" -c "import triton" 2>/dev/null || "${PYTHON:-python3}" -m pip install -q "triton>=3.9"
# Two pytest-xdist workers share the cores (TEST_WORKERS=N for more, 0 for one process); an idle worker takes tests
# from the other's queue (worksteal), so a file of long tests does not keep one core busy after the other is done.
# A test over 15 s prints a line, one still running after 30 s says so, and the slowest are listed at the end.
"${PYTHON:-python3}" -c "import xdist" 2>/dev/null || "${PYTHON:-python3}" -m pip install -q "pytest-xdist>=3"
exec "${PYTHON:-python3}" -m pytest -q -n "${TEST_WORKERS:-2}" --dist worksteal --durations=15 tests "$@"
