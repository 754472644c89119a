"""The machine: what this computer has (CUDA devices, their capabilities, CPU, RAM, working kernels) and the
table of cards `--emulate` can stand in for.

`probe_machine()` looks at the real machine and runs tiny kernels (SDPA backends, the fp16 path) to see what
works; `HardwareProbe.fake(card)` describes a machine with a card from `CARDS` for planning without it. Nothing
here decides anything: the planner (planner.py) reads a probe and a card and makes the decisions.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from . import estimator as est
from .cache import cache_dir
from .vocabulary import (
    BF16, CUDNN_SDPA, FP16, FP16_MATMUL_TOLERANCE, FP32, LOSS_SCALE_GROWTH_INTERVAL, LOSS_SCALE_INIT, REFERENCE_DTYPE,
    SDPA_BACKEND_NAMES, PlanError,
    cc_str, dtype_from_name, dtype_name, flash_attn_capable, has_fast_fp16, has_native_bf16, has_tf32, is_half,
    to_jsonable,
)

# ------------------------------------------------------------------------------------------ card table
@dataclass(frozen=True)
class CardSpec:
    """A card `--emulate` can stand in for. memory_gib is what torch reports as total (ECC on), not the box."""

    key: str
    name: str
    compute_capability: tuple[int, int]
    memory_gib: float
    bf16: bool
    fp16_tensor_cores: bool
    tf32: bool
    flash_attn_capable: bool
    smem_per_block_kib: int  # shared memory per block, opt-in maximum
    multiprocessors: int

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * est.GIB)


def _card(key: str, name: str, cc: tuple[int, int], memory_gib: float, smem_kib: int, sms: int) -> CardSpec:
    return CardSpec(key, name, cc, memory_gib, has_native_bf16(cc), has_fast_fp16(cc), has_tf32(cc),
                    flash_attn_capable(cc), smem_kib, sms)


CARDS: dict[str, CardSpec] = {c.key: c for c in (
    _card("p40", "Tesla P40", (6, 1), 22.38, 48, 30),  # 24 GB board
    _card("p100", "Tesla P100", (6, 0), 15.89, 48, 56),  # 16 GB board
    _card("t4", "Tesla T4", (7, 5), 14.75, 64, 40),  # 16 GB board, ~15 usable
    _card("v100-16g", "Tesla V100 16GB", (7, 0), 15.77, 96, 80),
    _card("v100-32g", "Tesla V100 32GB", (7, 0), 31.74, 96, 80),
    _card("a10", "NVIDIA A10", (8, 6), 22.19, 99, 72),  # 24 GB board
    _card("rtx3090", "GeForce RTX 3090", (8, 6), 23.69, 99, 82),
    _card("a100-40g", "A100 40GB", (8, 0), 39.39, 163, 108),
    _card("a100-80g", "A100 80GB", (8, 0), 79.15, 163, 108),
    _card("h100", "H100 80GB", (9, 0), 79.11, 227, 132),
    _card("h200", "H200", (9, 0), 139.8, 227, 132),  # 141 GB board
)}


def card_spec(name: str) -> CardSpec:
    """Look a card up by key ('p40'), case and 'tesla-'/'nvidia-' prefixes ignored."""
    key = re.sub(r"^(tesla|nvidia|geforce)[-_ ]?", "", str(name).strip().lower()).replace("_", "-")
    key = {"3090": "rtx3090", "rtx-3090": "rtx3090", "v100": "v100-16g", "a100": "a100-40g",
           "h100-80g": "h100"}.get(key, key)
    if key not in CARDS:
        raise PlanError(f"unknown card {name!r} for --emulate / hardware.emulate; valid names: "
                        f"{', '.join(CARDS)}")
    return CARDS[key]



# ------------------------------------------------------------------------------------ kernel probe cache
# The probe's kernels take seconds on a GPU (CUDA's first launches of each SDPA backend, forward and backward, in
# three dtypes), at the start of every run. What they find depends only on the card, its driver and the torch build,
# so it is kept on disk under those and reused; `rlanywhere doctor` always runs them again.
KERNEL_PROBE_FILE = "kernel-probe.json"
_fresh_probes = False


def kernel_probe_cache_path() -> Path:
    return cache_dir() / KERNEL_PROBE_FILE


def cuda_fingerprint(device: str) -> Optional[str]:
    """What a kernel probe's result depends on for a CUDA device: card, driver, CUDA, cuDNN and torch. None off CUDA."""
    if not device.startswith("cuda"):
        return None
    props = torch.cuda.get_device_properties(torch.device(device))
    driver = ""
    try:  # Linux: the loaded kernel module's version line
        driver = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        pass
    return " | ".join(str(part) for part in (
        props.name, f"sm_{props.major}{props.minor}", props.total_memory, driver, torch.__version__,
        torch.version.cuda, torch.backends.cudnn.version()))


def _remembered(device: str, what: str, probe: Callable[[], tuple]) -> tuple:
    """probe()'s result for this CUDA device, from the cache file when the card, driver and builds are the same;
    else run it and store it. Off CUDA (a cheap probe) or with an unreadable cache, it just runs."""
    fingerprint = cuda_fingerprint(device)
    if fingerprint is None:
        return probe()
    key = f"{fingerprint} | {what}"
    path = kernel_probe_cache_path()
    stored = _read_probe_cache(path)
    if key in stored and not _fresh_probes:
        return tuple(stored[key])
    found = probe()
    stored[key] = list(found)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(stored, indent=1, sort_keys=True))
        os.replace(partial, path)  # whole or not at all: ranks may write it at once
    except OSError:
        pass  # a read-only home: the probe just runs again next time
    return found


def _read_probe_cache(path: Path) -> dict:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


# ------------------------------------------------------------------------------------------------ probe


def sdpa_backends_that_run(dtype: torch.dtype, head_dim: int, device: Union[str, torch.device] = "cpu"
                           ) -> list[str]:
    """SDPA backends whose forward and backward run on a tiny causal input of this dtype / head size here."""
    device = str(torch.device(device))
    return list(_remembered(device, f"sdpa/{dtype_name(dtype)}/{int(head_dim)}",
                            lambda: _sdpa_backends_cached(dtype_name(dtype), int(head_dim), device)))


@functools.lru_cache(maxsize=None)
def _sdpa_backends_cached(dtype_str: str, head_dim: int, device: str) -> tuple[str, ...]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = dtype_from_name(dtype_str)
    found = []
    for name in SDPA_BACKEND_NAMES:
        backend = getattr(SDPBackend, name.upper(), None)
        if backend is None:
            continue
        try:
            query = torch.randn(1, 2, 16, head_dim, dtype=dtype, device=device, requires_grad=True)
            with warnings.catch_warnings(), sdpa_kernel([backend]):
                warnings.simplefilter("ignore")
                out = torch.nn.functional.scaled_dot_product_attention(query, query, query, is_causal=True)
                out.float().sum().backward()
            if device.startswith("cuda"):
                torch.cuda.synchronize(device)
            if torch.isfinite(out).all() and torch.isfinite(query.grad).all():
                found.append(name)
        except (RuntimeError, ValueError, NotImplementedError):
            continue
    return tuple(found)


def fp16_problems(device: Union[str, torch.device]) -> list[str]:
    """Run the fp16 mixed-precision path's kernels on `device` for real: [] when they all work, else what failed.

    1. a matmul under fp16 autocast is fp16 and within FP16_MATMUL_TOLERANCE of fp64;
    2. SDPA runs forward and backward in fp16 (some backend, head dim PROBE_HEAD_DIM) with finite results;
    3. a GradScaler step whose fp16 gradient overflowed is skipped and halves the scale, and the next, finite one
       is applied unscaled.
    The planner runs this (through the probe) before choosing fp16 automatically; `rlanywhere doctor` reports it."""
    device = str(torch.device(device))
    return list(_remembered(device, "fp16", lambda: _fp16_problems_cached(device)))


@functools.lru_cache(maxsize=None)
def _fp16_problems_cached(device: str) -> tuple[str, ...]:
    problems = []
    for name, check in (("fp16 autocast matmul", _fp16_matmul_problem), ("fp16 SDPA", _fp16_sdpa_problem),
                        ("loss scaling", _loss_scaling_problem)):
        try:
            problem = check(device)
        except Exception as exc:  # noqa: BLE001 - a missing kernel raises anything; that is the finding
            problem = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if problem:
            problems.append(f"{name}: {problem}")
    return tuple(problems)


def _fp16_matmul_problem(device: str) -> Optional[str]:
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(256, 256, generator=gen, dtype=REFERENCE_DTYPE) for _ in range(2))
    with torch.autocast(device_type=torch.device(device).type, dtype=FP16):
        out = a.float().to(device) @ b.float().to(device)
    if out.dtype != FP16:
        return f"autocast produced {dtype_name(out.dtype)}, not float16"
    reference = a @ b
    error = float((out.to(REFERENCE_DTYPE).cpu() - reference).norm() / reference.norm())
    if not math.isfinite(error) or error > FP16_MATMUL_TOLERANCE:
        return f"relative error {error:.2e} against fp64 (limit {FP16_MATMUL_TOLERANCE:.0e})"
    return None


def _fp16_sdpa_problem(device: str) -> Optional[str]:
    if not sdpa_backends_that_run(FP16, PROBE_HEAD_DIM, device):
        return f"no SDPA backend runs forward and backward in float16 (head dim {PROBE_HEAD_DIM})"
    return None


def _loss_scaling_problem(device: str) -> Optional[str]:
    weight = torch.zeros(2, device=device, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=LOSS_SCALE_INIT,
                                  growth_interval=LOSS_SCALE_GROWTH_INTERVAL)
    # d/dw of scale * (2 w).sum() in fp16 is 2 * 2^16, beyond fp16's largest value (65504): an overflow
    scaler.scale((weight.to(FP16) * 2).float().sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    if weight.detach().abs().sum() != 0 or scaler.get_scale() != LOSS_SCALE_INIT / 2:
        return f"an overflowed step was not skipped (scale {scaler.get_scale()}, weight {weight.tolist()})"
    optimizer.zero_grad(set_to_none=True)
    scaler.scale((weight.to(FP16) * 0.5).float().sum()).backward()  # 2^15 * 0.5: fits fp16
    scaler.step(optimizer)
    scaler.update()
    if weight.detach().cpu().tolist() != [-0.5, -0.5]:
        return f"a finite scaled step was not applied unscaled (weight {weight.tolist()}, expected [-0.5, -0.5])"
    return None


def predicted_sdpa_backends(cc: Optional[tuple[int, int]], dtype: torch.dtype, head_dim: int) -> list[str]:
    """What SDPA would run on a card we cannot test (emulation, fake probes), from PyTorch's documented limits."""
    if cc is None:  # CPU: its flash kernel handles fp32/bf16/fp16
        return ["flash_attention", "math"]
    out = []
    half = is_half(dtype)
    aligned = head_dim % 8 == 0
    if tuple(cc) >= (8, 0) and half and aligned and head_dim <= 256:
        out.append("flash_attention")
    if tuple(cc) >= (5, 0) and aligned and (dtype != BF16 or tuple(cc) >= (8, 0)):
        out.append("efficient_attention")
    if tuple(cc) >= (9, 0) and half and aligned and head_dim <= 128:
        out.append(CUDNN_SDPA)
    if dtype != BF16 or has_native_bf16(cc):
        out.append("math")
    return out


@dataclass
class DeviceInfo:
    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory_bytes: int
    free_memory_bytes: Optional[int]
    multiprocessor_count: int
    shared_memory_per_block_optin: Optional[int]
    native_bf16: bool
    fast_fp16: bool
    tf32: bool
    flash_attn_usable: bool
    sdpa_backends: dict[str, list[str]] = field(default_factory=dict)  # "float32/64" -> backends that ran
    fp16_problems: Optional[list[str]] = None  # fp16_problems() on this device: None not run, [] all passed

    @classmethod
    def from_card(cls, card: Union[str, CardSpec], index: int = 0, flash_attn_installed: bool = False
                  ) -> "DeviceInfo":
        spec = card_spec(card) if isinstance(card, str) else card
        return cls(index, spec.name, spec.compute_capability, spec.memory_bytes, spec.memory_bytes,
                   spec.multiprocessors, spec.smem_per_block_kib * 1024, spec.bf16, spec.fp16_tensor_cores,
                   spec.tf32, flash_attn_installed and spec.flash_attn_capable)


@dataclass
class HardwareProbe:
    """What this machine has. `live=False` for probes built by hand (tests): nothing is run against them."""

    devices: list[DeviceInfo] = field(default_factory=list)
    cpu_cores: int = 1
    # the physical cores among them (hyper-threads counted once): the size of torch's CPU thread pool by default;
    # None: unknown (not Linux, or a fake probe), counted as cpu_cores
    cpu_physical_cores: int | None = None
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    torch_version: str = torch.__version__
    cuda_version: Optional[str] = None
    flash_attn_installed: bool = False
    flash_attn_version: Optional[str] = None
    triton_usable: bool = False  # triton + a C compiler: FastEngine's Triton kernels (rollout/decode_attention.py)
    cpu_sdpa_backends: dict[str, list[str]] = field(default_factory=dict)
    live: bool = True

    @property
    def cuda_available(self) -> bool:
        return bool(self.devices)

    def to_dict(self) -> dict:
        return to_jsonable(asdict(self))

    def summary(self) -> str:
        lines = [f"torch {self.torch_version}" + (f", CUDA {self.cuda_version}" if self.cuda_version else ", no CUDA")
                 + f", flash_attn {'installed ' + (self.flash_attn_version or '') if self.flash_attn_installed else 'not installed'}"
                 + f", triton {'usable' if self.triton_usable else 'not usable (not installed, or no C compiler)'}",
                 f"CPU: {self.cpu_cores} cores, RAM {est.format_bytes(self.ram_total_bytes)} "
                 f"({est.format_bytes(self.ram_available_bytes)} available)"]
        for dev in self.devices:
            free = f", {est.format_bytes(dev.free_memory_bytes)} free" if dev.free_memory_bytes is not None else ""
            smem = (f", smem/block {dev.shared_memory_per_block_optin // 1024} KiB"
                    if dev.shared_memory_per_block_optin else "")
            caps = ", ".join(name for name, ok in (("bf16", dev.native_bf16), ("fp16 tensor cores", dev.fast_fp16),
                                                   ("tf32", dev.tf32), ("flash-attn", dev.flash_attn_usable)) if ok)
            lines.append(f"cuda:{dev.index} {dev.name}: cc {cc_str(dev.compute_capability)}, "
                         f"{est.format_bytes(dev.total_memory_bytes)}{free}, {dev.multiprocessor_count} SMs{smem}; "
                         f"{caps or 'fp32 only'}")
            for key, backends in dev.sdpa_backends.items():
                lines.append(f"  SDPA {key}: {', '.join(backends) or 'none'}")
            if dev.fp16_problems is not None:
                lines.append(f"  fp16 checks: {'; '.join(dev.fp16_problems) or 'pass'}")
        return "\n".join(lines)

    @classmethod
    def fake(cls, card: Optional[str] = None, flash_attn_installed: bool = False, ram_gib: float = 64.0,
             cpu_cores: int = 8, triton_usable: Optional[bool] = None) -> "HardwareProbe":
        """A probe of a machine with one `card` (or none), for planning tests without that hardware."""
        devices = [DeviceInfo.from_card(card, 0, flash_attn_installed)] if card else []
        return cls(devices=devices, cpu_cores=cpu_cores, ram_total_bytes=int(ram_gib * est.GIB),
                   ram_available_bytes=int(ram_gib * est.GIB), cuda_version="12.4" if card else None,
                   flash_attn_installed=flash_attn_installed,
                   triton_usable=bool(card) if triton_usable is None else triton_usable, live=False)


def _read_meminfo() -> tuple[int, int]:
    """(total, available) RAM in bytes, capped by a cgroup limit when one is set."""
    total = available = 0
    try:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh if line.split()[1:]}
        total, available = info.get("MemTotal", 0), info.get("MemAvailable", info.get("MemFree", 0))
    except (OSError, ValueError, IndexError):
        try:
            total = available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            pass
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
            available = min(available, total)
        break
    return total, available


def usable_cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def usable_physical_cores(sysfs: str = "/sys/devices/system/cpu") -> int | None:
    """The physical cores among the CPUs this process may run on: hyper-threads of one core counted once (Linux's
    CPU topology in sysfs), None where it cannot be read. Torch sizes its CPU thread pool by physical cores."""
    try:
        cpus = os.sched_getaffinity(0)
        cores = set()
        for cpu in cpus:
            topology = os.path.join(sysfs, f"cpu{cpu}", "topology")
            with open(os.path.join(topology, "physical_package_id")) as package, \
                    open(os.path.join(topology, "core_id")) as core:
                cores.add((package.read().strip(), core.read().strip()))
    except (AttributeError, OSError):
        return None
    return len(cores) or None


TRITON_C_COMPILERS = ("cc", "gcc", "clang")


def triton_usable() -> bool:
    """Whether Triton kernels can be built here: triton importable (PyTorch's CUDA builds on Linux bring it, a CPU
    build does not) and a C compiler for the launcher Triton builds on first use ($CC, cc, gcc or clang)."""
    if importlib.util.find_spec("triton") is None:
        return False
    return bool(os.environ.get("CC")) or any(shutil.which(name) for name in TRITON_C_COMPILERS)


def varlen_attention_function() -> Optional[Callable]:
    """PyTorch's variable-length flash attention (torch.nn.attention.varlen.varlen_attn, torch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def flash_attn_status() -> tuple[bool, Optional[str], Optional[str]]:
    """(importable, version, why not). Importing can fail on ABI mismatches, so it is tried, not just found."""
    if importlib.util.find_spec("flash_attn") is None:
        return False, None, "flash_attn is not installed"
    try:
        module = importlib.import_module("flash_attn")
    except Exception as exc:  # noqa: BLE001 - a broken build raises anything (OSError, ImportError, RuntimeError)
        return False, None, f"flash_attn is installed but does not import: {exc}"
    return True, getattr(module, "__version__", None), None


PROBE_HEAD_DIM = 64


def probe_machine(measure_sdpa: bool = True, fresh: bool = False) -> HardwareProbe:
    """Probe CUDA devices, CPU and RAM of this machine (works without CUDA). The kernel probes' results come from
    the cache file when this card, driver and torch build were probed before, unless `fresh`."""
    global _fresh_probes
    if fresh:
        _fresh_probes = True  # this process re-runs every kernel probe (and refreshes the cache file)
        _sdpa_backends_cached.cache_clear()
        _fp16_problems_cached.cache_clear()
    total, available = _read_meminfo()
    flash_ok, flash_version, _ = flash_attn_status()
    machine = HardwareProbe(cpu_cores=usable_cpu_cores(), cpu_physical_cores=usable_physical_cores(),
                            ram_total_bytes=total, ram_available_bytes=available,
                            cuda_version=torch.version.cuda, flash_attn_installed=flash_ok,
                            flash_attn_version=flash_version,
                            triton_usable=triton_usable(), live=True)
    if measure_sdpa:
        machine.cpu_sdpa_backends = {f"float32/{PROBE_HEAD_DIM}": sdpa_backends_that_run(FP32, PROBE_HEAD_DIM, "cpu")}
    if not torch.cuda.is_available():
        return machine
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        cc = (props.major, props.minor)
        try:
            free, _ = torch.cuda.mem_get_info(index)
        except RuntimeError:
            free = None
        info = DeviceInfo(index=index, name=props.name, compute_capability=cc,
                          total_memory_bytes=int(props.total_memory), free_memory_bytes=free,
                          multiprocessor_count=int(props.multi_processor_count),
                          shared_memory_per_block_optin=getattr(props, "shared_memory_per_block_optin", None),
                          native_bf16=has_native_bf16(cc), fast_fp16=has_fast_fp16(cc), tf32=has_tf32(cc),
                          flash_attn_usable=flash_ok and flash_attn_capable(cc))
        if measure_sdpa:
            dtypes = [FP32] + ([BF16] if info.native_bf16 else []) + ([FP16] if info.fast_fp16 else [])
            for dtype in dtypes:
                info.sdpa_backends[f"{dtype_name(dtype)}/{PROBE_HEAD_DIM}"] = sdpa_backends_that_run(
                    dtype, PROBE_HEAD_DIM, f"cuda:{index}")
            if info.fast_fp16:  # also on cards with bf16: an emulated Volta/Turing plan runs its fp16 here
                info.fp16_problems = fp16_problems(f"cuda:{index}")
        machine.devices.append(info)
    return machine
