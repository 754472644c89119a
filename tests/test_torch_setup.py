"""The torch-build decision scripts/setup.sh makes (src/rlanywhere/torch_setup.py), fed fake nvidia-smi output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlanywhere.torch_setup import (CPU_INDEX, CU126_INDEX, InstalledTorch, arch_list_covers, decide,
                                    parse_compute_capabilities)

# torch 2.8+ default CUDA wheels vs the CUDA 12.6 wheels (torch.cuda.get_arch_list() of each)
DEFAULT_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]
CU126_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def test_parse_nvidia_smi_compute_cap():
    assert parse_compute_capabilities("6.1\n") == [(6, 1)]
    assert parse_compute_capabilities("8.0\n8.0\n") == [(8, 0), (8, 0)]
    assert parse_compute_capabilities("compute_cap\n7.0\n") == [(7, 0)]  # a header line is skipped
    assert parse_compute_capabilities("") == []
    assert parse_compute_capabilities("[N/A]\n") == []


def test_arch_list_coverage():
    assert not arch_list_covers(DEFAULT_ARCHS, (6, 1))  # P40 with the default build: "no kernel image"
    assert not arch_list_covers(DEFAULT_ARCHS, (7, 0))  # V100
    assert arch_list_covers(DEFAULT_ARCHS, (7, 5)) and arch_list_covers(DEFAULT_ARCHS, (9, 0))
    assert arch_list_covers(CU126_ARCHS, (6, 1))  # sm_60 cubins run on 6.1 (same major, lower minor)
    assert arch_list_covers(CU126_ARCHS, (7, 0))
    assert not arch_list_covers(["sm_61"], (6, 0))  # a cubin does not run on a lower minor
    assert arch_list_covers(["compute_60"], (8, 6))  # PTX is compiled at load for any newer card
    assert not arch_list_covers(["compute_80"], (7, 5))
    assert not arch_list_covers([], (8, 0))


def test_decisions():
    fresh_p40 = decide([(6, 1)], None)
    assert fresh_p40.action == "install"
    assert fresh_p40.pip_args == ["torch==2.13.0+cu126", "--index-url", CU126_INDEX]
    assert decide([(7, 0)], None).pip_args[0] == "torch==2.13.0+cu126"  # V100 too
    assert decide([(8, 0)], None).pip_args == ["torch==2.13.0"]  # A100: the default build
    assert decide([(8, 0), (6, 1)], None).pip_args[0].endswith("+cu126")  # the oldest card decides
    # An installed build that works here is kept; a default build on a P40 is replaced (forced: same version)
    assert decide([(6, 1)], InstalledTorch("2.13.0+cu126", "12.6", CU126_ARCHS)).action == "keep"
    wrong = decide([(6, 1)], InstalledTorch("2.13.0", "12.8", DEFAULT_ARCHS))
    assert wrong.action == "install" and "--force-reinstall" in wrong.pip_args and "sm_61" in wrong.reason
    cpu_build = decide([(8, 6)], InstalledTorch("2.13.0+cpu", None, []))
    assert cpu_build.action == "install" and cpu_build.pip_args[0] == "torch==2.13.0"
    # No GPU: an installed torch is kept; else on Linux the CPU build (PyPI's Linux wheel brings CUDA libraries)
    assert decide([], InstalledTorch("2.13.0+cpu", None, [])).action == "keep"
    assert decide([], None, platform="linux").line() == f"install torch==2.13.0 --index-url {CPU_INDEX}"
    assert decide([], None, platform="darwin").line() == "install torch==2.13.0"
    assert decide([(6, 0)], None, version="2.9.1").pip_args[0] == "torch==2.9.1+cu126"


def test_setup_script_runs_the_helper_without_rlanywhere_installed(tmp_path):
    """setup.sh calls the file by path before installing the package: it must need nothing beyond the stdlib
    (and torch when present). Here: no nvidia-smi on PATH, so the installed torch is kept."""
    helper = Path(__file__).resolve().parents[1] / "src" / "rlanywhere" / "torch_setup.py"
    result = subprocess.run([sys.executable, "-I", str(helper)], capture_output=True, text=True,
                            env={"PATH": str(tmp_path)}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("keep torch ") and "no NVIDIA GPU" in result.stdout


FAKE_PYTHON = """#!/bin/bash
# stands in for python3 in setup.sh: the helper says install the CPU build; pip fails on PyTorch's index
echo "$*" >> "$LOG"
case "$*" in
  *torch_setup.py*) echo "install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" ;;
  *whl/cpu*) exit 1 ;;
esac
"""


def test_setup_falls_back_to_pips_index_when_the_cpu_index_is_out_of_reach(tmp_path):
    fake = tmp_path / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    script = Path(__file__).resolve().parents[1] / "scripts" / "setup.sh"
    result = subprocess.run(["bash", str(script)], check=False, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHON": str(fake), "LOG": str(log)})
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert "-m pip install -q --retries 1 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in calls
    assert "-m pip install -q torch==2.13.0" in calls  # the fallback, then the package itself
    assert calls[-1].startswith("-m pip install -q -e .[")
    assert "CPU index could not be reached" in result.stderr
