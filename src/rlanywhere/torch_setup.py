"""Which torch build has kernels for this machine's GPU: the decision `scripts/setup.sh` and `rlanywhere doctor` use.

Since PyTorch 2.8 the default CUDA wheels (`pip install torch`) carry kernels for compute capability 7.5 and newer
only; Pascal (P40, P100: sm_60/61) and Volta (V100: sm_70) kernels ship only in the CUDA 12.6 builds on PyTorch's
own index. With the wrong build the first CUDA operation fails with "no kernel image is available for execution on
the device".

setup.sh runs this file directly (`python3 src/rlanywhere/torch_setup.py`), before rlanywhere is installed, so it
uses the standard library only. It prints one line: `keep <why>` or `install <pip arguments>`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

TORCH_VERSION = "2.13.0"
CU126_INDEX = "https://download.pytorch.org/whl/cu126"
# PyTorch's CPU-only builds. On Linux, PyPI's torch wheel carries the CUDA libraries (several GB), which a machine
# without an NVIDIA GPU never uses; setup.sh falls back to pip's own index where this one cannot be reached.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The oldest compute capability the default (PyPI) CUDA wheels have kernels for.
DEFAULT_BUILD_MIN_CC = (7, 5)


def parse_compute_capabilities(nvidia_smi_output: str) -> list[tuple[int, int]]:
    """`nvidia-smi --query-gpu=compute_cap --format=csv,noheader` output ("6.1\\n8.0") as [(6, 1), (8, 0)]."""
    found = []
    for line in nvidia_smi_output.splitlines():
        text = line.strip()
        major, dot, minor = text.partition(".")
        if dot and major.isdigit() and minor.isdigit():
            found.append((int(major), int(minor)))
    return found


def arch_list_covers(arch_list: Sequence[str], cc: tuple[int, int]) -> bool:
    """Whether a torch build with `torch.cuda.get_arch_list()` == arch_list runs kernels on a card of capability cc.

    A cubin for sm_XY runs on sm_XZ with Z >= Y (same major); PTX for compute_XY is compiled at load time for any
    card of capability >= X.Y."""
    for arch in arch_list:
        kind, _, digits = arch.partition("_")
        if not digits.isdigit() or len(digits) < 2:
            continue
        major, minor = int(digits[:-1]), int(digits[-1])
        if kind == "sm" and major == cc[0] and minor <= cc[1]:
            return True
        if kind == "compute" and (major, minor) <= cc:
            return True
    return False


@dataclass
class InstalledTorch:
    version: str
    cuda: Optional[str]  # torch.version.cuda; None for a CPU build
    arch_list: list[str] = field(default_factory=list)  # torch.cuda.get_arch_list() (empty without a usable GPU)


@dataclass
class TorchDecision:
    action: str  # "keep" | "install"
    pip_args: list[str]
    reason: str

    def line(self) -> str:
        return f"keep {self.reason}" if self.action == "keep" else "install " + " ".join(self.pip_args)


def build_for(ccs: Sequence[tuple[int, int]], version: str = TORCH_VERSION) -> tuple[list[str], str]:
    """pip arguments for a torch build with kernels for every card in ccs, and why."""
    oldest = min(ccs)
    if oldest < DEFAULT_BUILD_MIN_CC:
        return ([f"torch=={version}+cu126", "--index-url", CU126_INDEX],
                f"compute capability {oldest[0]}.{oldest[1]} (Pascal/Volta) has kernels only in PyTorch's CUDA 12.6 "
                "builds")
    return [f"torch=={version}"], f"compute capability {oldest[0]}.{oldest[1]}: the default CUDA build has kernels"


def decide(ccs: Sequence[tuple[int, int]], installed: Optional[InstalledTorch],
           version: str = TORCH_VERSION, platform: str = sys.platform) -> TorchDecision:
    """Keep an installed torch that works here; otherwise the build whose kernels cover every GPU (none: CPU)."""
    if not ccs:
        if installed is not None:
            return TorchDecision("keep", [], f"torch {installed.version} (no NVIDIA GPU found)")
        if platform.startswith("linux"):
            return TorchDecision("install", [f"torch=={version}", "--index-url", CPU_INDEX],
                                 "no NVIDIA GPU found: the CPU build (PyPI's Linux wheel brings several GB of CUDA "
                                 "libraries)")
        return TorchDecision("install", [f"torch=={version}"], "no NVIDIA GPU found")
    if installed is not None and installed.cuda and all(arch_list_covers(installed.arch_list, cc) for cc in ccs):
        return TorchDecision("keep", [], f"torch {installed.version} has kernels for {_ccs_text(ccs)}")
    args, why = build_for(ccs, version)
    if installed is not None:
        args = args + ["--force-reinstall"]  # same version number, other build: pip would call it satisfied
        why += f"; the installed torch {installed.version} has none for {_ccs_text(ccs)}"
    return TorchDecision("install", args, why)


def _ccs_text(ccs: Sequence[tuple[int, int]]) -> str:
    return ", ".join(f"sm_{a}{b}" for a, b in sorted(set(ccs)))


# ---------------------------------------------------------------------------------------------- probing
def query_compute_capabilities() -> list[tuple[int, int]]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        result = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_compute_capabilities(result.stdout) if result.returncode == 0 else []


def installed_torch() -> Optional[InstalledTorch]:
    try:
        import torch
    except ImportError:
        return None
    try:
        arch_list = list(torch.cuda.get_arch_list()) if torch.cuda.is_available() else []
    except Exception:  # noqa: BLE001 - a broken CUDA set-up reads as "no kernels", which is what matters here
        arch_list = []
    return InstalledTorch(torch.__version__, torch.version.cuda, arch_list)


def main(argv: Optional[list[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    version = args[0] if args else TORCH_VERSION
    decision = decide(query_compute_capabilities(), installed_torch(), version)
    print(decision.line())
    if decision.action == "install":
        print(f"setup: installing {' '.join(decision.pip_args)}: {decision.reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
