"""Every hardware decision in one place: probe the machine, emulate a card, plan the run.

    prepare_environment(cfg)        # first thing, before CUDA initialises (allocator settings)
    plan = make_plan(cfg)           # raises PlanError for impossible requests, before any model loads
    apply_runtime(plan)             # TF32 flags, memory cap when emulating
    with autocast_context(plan): ...

This is the only module that writes dtype literals (torch.bfloat16, ...) and attention-implementation names
("flash_attention_2", ...). Everything else reads them from the `Plan`.

What the planner decides, and why (docs/hardware.md has the long form):
  * precision: bf16 autocast over fp32 master weights where the card has native bf16 (compute capability >= 8.0);
    fp16 autocast over fp32 master weights with dynamic loss scaling on Volta / Turing (fp16 tensor cores, no
    bf16) when the fp16 checks pass on the device (`fp16_problems`), else fp32; fp32 on Pascal and on CPU;
  * attention: FlashAttention-2 when installed and usable, else SDPA (when one of its backends runs), else eager;
  * memory: the estimator's per-phase peaks against the card's memory decide gradient checkpointing, micro-batch
    sizes, offload and where the reference model lives.
`--emulate CARD` plans for a card from `CARDS` and, on a real GPU, caps the process to that card's memory.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from rlanywhere import estimator as est

from .plan import RolloutPlan, RuntimeSizes
from .vocabulary import (  # noqa: F401 - re-exported: the planner's vocabulary
    FP32, BF16, FP16, ACCUMULATE_DTYPE, REFERENCE_DTYPE, PRECISION_DTYPES,
    ATTN_FLASH, ATTN_SDPA, ATTN_EAGER, ATTN_IMPLEMENTATIONS, ALLOC_CONF, LOSS_SCALE_INIT,
    LOSS_SCALE_GROWTH_INTERVAL, FP16_MATMUL_TOLERANCE, dtype_from_name, dtype_name, precision_name, is_half,
    has_native_bf16, has_fast_fp16, has_tf32, flash_attn_capable, _cc_str, PlanError,
    NoFitError,
)

log = logging.getLogger(__name__)

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


# ------------------------------------------------------------------------------------------------ probe
SDPA_BACKEND_NAMES = ("flash_attention", "efficient_attention", "cudnn_attention", "math")


def sdpa_backends_that_run(dtype: torch.dtype, head_dim: int, device: Union[str, torch.device] = "cpu"
                           ) -> list[str]:
    """SDPA backends whose forward and backward run on a tiny causal input of this dtype / head size here."""
    return list(_sdpa_backends_cached(dtype_name(dtype), int(head_dim), str(torch.device(device))))


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
    return list(_fp16_problems_cached(str(torch.device(device))))


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
    error = float((out.double().cpu() - reference).norm() / reference.norm())
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
    scaler.scale((weight.half() * 2).float().sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    if weight.detach().abs().sum() != 0 or scaler.get_scale() != LOSS_SCALE_INIT / 2:
        return f"an overflowed step was not skipped (scale {scaler.get_scale()}, weight {weight.tolist()})"
    optimizer.zero_grad(set_to_none=True)
    scaler.scale((weight.half() * 0.5).float().sum()).backward()  # 2^15 * 0.5: fits fp16
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
        out.append("cudnn_attention")
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
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    torch_version: str = torch.__version__
    cuda_version: Optional[str] = None
    flash_attn_installed: bool = False
    flash_attn_version: Optional[str] = None
    cpu_sdpa_backends: dict[str, list[str]] = field(default_factory=dict)
    live: bool = True

    @property
    def cuda_available(self) -> bool:
        return bool(self.devices)

    def to_dict(self) -> dict:
        return _jsonable(asdict(self))

    def summary(self) -> str:
        lines = [f"torch {self.torch_version}" + (f", CUDA {self.cuda_version}" if self.cuda_version else ", no CUDA")
                 + f", flash_attn {'installed ' + (self.flash_attn_version or '') if self.flash_attn_installed else 'not installed'}",
                 f"CPU: {self.cpu_cores} cores, RAM {est.format_bytes(self.ram_total_bytes)} "
                 f"({est.format_bytes(self.ram_available_bytes)} available)"]
        for dev in self.devices:
            free = f", {est.format_bytes(dev.free_memory_bytes)} free" if dev.free_memory_bytes is not None else ""
            smem = (f", smem/block {dev.shared_memory_per_block_optin // 1024} KiB"
                    if dev.shared_memory_per_block_optin else "")
            caps = ", ".join(name for name, ok in (("bf16", dev.native_bf16), ("fp16 tensor cores", dev.fast_fp16),
                                                   ("tf32", dev.tf32), ("flash-attn", dev.flash_attn_usable)) if ok)
            lines.append(f"cuda:{dev.index} {dev.name}: cc {_cc_str(dev.compute_capability)}, "
                         f"{est.format_bytes(dev.total_memory_bytes)}{free}, {dev.multiprocessor_count} SMs{smem}; "
                         f"{caps or 'fp32 only'}")
            for key, backends in dev.sdpa_backends.items():
                lines.append(f"  SDPA {key}: {', '.join(backends) or 'none'}")
            if dev.fp16_problems is not None:
                lines.append(f"  fp16 checks: {'; '.join(dev.fp16_problems) or 'pass'}")
        return "\n".join(lines)

    @classmethod
    def fake(cls, card: Optional[str] = None, flash_attn_installed: bool = False, ram_gib: float = 64.0,
             cpu_cores: int = 8) -> "HardwareProbe":
        """A probe of a machine with one `card` (or none), for planning tests without that hardware."""
        devices = [DeviceInfo.from_card(card, 0, flash_attn_installed)] if card else []
        return cls(devices=devices, cpu_cores=cpu_cores, ram_total_bytes=int(ram_gib * est.GIB),
                   ram_available_bytes=int(ram_gib * est.GIB), cuda_version="12.4" if card else None,
                   flash_attn_installed=flash_attn_installed, live=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    return value


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


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


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


def probe_machine(measure_sdpa: bool = True) -> HardwareProbe:
    """Probe CUDA devices, CPU and RAM of this machine (works without CUDA)."""
    total, available = _read_meminfo()
    flash_ok, flash_version, _ = flash_attn_status()
    hw = HardwareProbe(cpu_cores=_cpu_cores(), ram_total_bytes=total, ram_available_bytes=available,
                       cuda_version=torch.version.cuda, flash_attn_installed=flash_ok,
                       flash_attn_version=flash_version, live=True)
    if measure_sdpa:
        hw.cpu_sdpa_backends = {f"float32/{PROBE_HEAD_DIM}": sdpa_backends_that_run(FP32, PROBE_HEAD_DIM, "cpu")}
    if not torch.cuda.is_available():
        return hw
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
        hw.devices.append(info)
    return hw


probe = probe_machine  # the public name; make_plan's parameter is also called `probe`


# -------------------------------------------------------------------------------------- model shapes
ModelShape = est.ModelShape

NAMED_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True, attention_bias=True, model_type="qwen2",
               max_position_embeddings=32768),
    ModelShape("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, True, attention_bias=True, model_type="qwen2",
               max_position_embeddings=32768),
    ModelShape("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True, attention_bias=True, model_type="qwen2",
               max_position_embeddings=32768),
    ModelShape("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False, attention_bias=True, model_type="qwen2",
               max_position_embeddings=32768),
    ModelShape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, True, model_type="llama", max_position_embeddings=8192),
    ModelShape("smollm2-360m", 960, 32, 15, 5, 2560, 49152, True, model_type="llama", max_position_embeddings=8192),
)}
_NAME_SUFFIXES = ("-instruct", "-chat", "-base", "-it", "-gguf")


def _normalise_model_name(path: str) -> str:
    name = str(path).rstrip("/").split("/")[-1].lower()
    name = re.sub(r"\.(gguf|json)$", "", name)
    changed = True
    while changed:
        changed = False
        for suffix in _NAME_SUFFIXES:
            if name.endswith(suffix):
                name, changed = name[: -len(suffix)], True
    return name


def _shape_from_hf_dict(config: dict, name: str) -> ModelShape:
    config = dict(config.get("text_config") or config)
    model_type = str(config.get("model_type", "llama"))
    try:
        hidden = int(config.get("hidden_size") or config.get("n_embd") or config["d_model"])
        heads = int(config.get("num_attention_heads") or config["n_head"])
        layers = int(config.get("num_hidden_layers") or config["n_layer"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError) as exc:
        raise PlanError(f"model config for {name!r} lacks {exc}: expected a decoder-only HF config.json "
                        "(hidden_size, num_hidden_layers, num_attention_heads, vocab_size)") from exc
    return ModelShape(
        name=name, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        intermediate_size=int(config.get("intermediate_size") or 4 * hidden), vocab_size=vocab,
        # PretrainedConfig's default is True when config.json does not say
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        head_dim=int(config.get("head_dim") or 0),
        attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        model_type=model_type, max_position_embeddings=config.get("max_position_embeddings"))


def gguf_value(field_: Any) -> Any:
    """The value of one GGUF metadata field (a scalar or string), for old and new `gguf` releases."""
    if hasattr(field_, "contents"):
        return field_.contents()
    part = field_.parts[field_.data[0]]  # older gguf: scalar value stored in one part
    value = part.tobytes().decode() if part.dtype.kind == "u" and part.dtype.itemsize == 1 else part[0]
    return value.item() if hasattr(value, "item") else value


def _shape_from_gguf(path: Path) -> ModelShape:
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise PlanError(f"reading {path.name} needs the gguf package: pip install gguf "
                        "(or pip install rlanywhere[gguf])") from exc
    reader = GGUFReader(str(path))

    def get(key: str, default: Any = None) -> Any:
        field_ = reader.fields.get(key)
        return gguf_value(field_) if field_ is not None else default

    arch = get("general.architecture")
    if arch is None:
        raise PlanError(f"{path} has no general.architecture metadata: not a model GGUF file")
    hidden = get(f"{arch}.embedding_length")
    layers = get(f"{arch}.block_count")
    heads = get(f"{arch}.attention.head_count")
    if None in (hidden, layers, heads):
        raise PlanError(f"{path}: GGUF metadata lacks {arch}.embedding_length / block_count / attention.head_count")
    vocab = get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 0
    names = {tensor.name for tensor in reader.tensors}
    return ModelShape(
        name=_normalise_model_name(path.name), hidden_size=int(hidden), num_layers=int(layers), num_heads=int(heads),
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        intermediate_size=int(get(f"{arch}.feed_forward_length", 4 * int(hidden))), vocab_size=int(vocab),
        tie_word_embeddings="output.weight" not in names, head_dim=int(get(f"{arch}.attention.key_length", 0)),
        attention_bias="blk.0.attn_q.bias" in names, model_type=str(arch),
        max_position_embeddings=get(f"{arch}.context_length"))


def model_config_from_path(path_or_config: Any, gguf_file: Optional[str] = None) -> ModelShape:
    """A model's shape without loading weights.

    Accepts a ModelShape, a transformers PretrainedConfig, a config dict, a directory with config.json (or .gguf
    files), a config.json / .gguf file, a named shape (NAMED_SHAPES, e.g. 'Qwen/Qwen2.5-0.5B-Instruct' ->
    'qwen2.5-0.5b'), or a hub id whose config.json is cached or downloadable."""
    if isinstance(path_or_config, ModelShape):
        return path_or_config
    if isinstance(path_or_config, dict):
        return _shape_from_hf_dict(path_or_config, str(path_or_config.get("_name_or_path") or "model"))
    if hasattr(path_or_config, "to_dict") and hasattr(path_or_config, "model_type"):
        config = path_or_config.get_text_config() if hasattr(path_or_config, "get_text_config") else path_or_config
        data = config.to_dict()
        data.setdefault("tie_word_embeddings", getattr(config, "tie_word_embeddings", True))
        return _shape_from_hf_dict(data, str(getattr(config, "_name_or_path", "") or config.model_type))
    path = Path(str(path_or_config)).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return _shape_from_gguf(path)
        return _shape_from_hf_dict(json.loads(path.read_text()), path.parent.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _shape_from_hf_dict(json.loads((path / "config.json").read_text()), path.name)
        ggufs = [path / gguf_file] if gguf_file else sorted(path.glob("*.gguf"))
        if ggufs and ggufs[0].is_file():
            return _shape_from_gguf(ggufs[0])
        raise PlanError(f"{path} has neither config.json nor a .gguf file: point actor_rollout_ref.model.path at a "
                        "Hugging Face model directory or a .gguf file")
    name = _normalise_model_name(str(path_or_config))
    if name in NAMED_SHAPES:
        return NAMED_SHAPES[name]
    return _shape_from_hub(str(path_or_config))


def _shape_from_hub(repo_id: str) -> ModelShape:
    from transformers import AutoConfig

    errors = []
    for local_only in (True, False):
        try:
            return model_config_from_path(AutoConfig.from_pretrained(repo_id, local_files_only=local_only))
        except Exception as exc:  # noqa: BLE001 - hub / network / parse errors all mean "cannot read it"
            errors.append(str(exc).splitlines()[0])
    raise PlanError(f"cannot read the model config of {repo_id!r} ({errors[-1]}). Give a local model directory, a "
                    f".gguf file, or one of the named shapes: {', '.join(NAMED_SHAPES)}")


# ------------------------------------------------------------------------------------------------ plan
@dataclass
class Plan:
    """Every hardware decision for a run, with the reason for each (see docs/ARCHITECTURE.md).

    Defaults describe a small fp32 CPU run, so tests of other modules can write `Plan()`."""

    device: str = "cpu"
    card: str = "CPU"
    compute_capability: Optional[tuple[int, int]] = None
    precision: str = "fp32"
    param_dtype: torch.dtype = FP32
    compute_dtype: torch.dtype = FP32
    use_autocast: bool = False
    use_grad_scaler: bool = False
    allow_tf32: bool = False
    attn_implementation: str = ATTN_SDPA
    gradient_checkpointing: bool = False
    logprob_chunk_size: int = 1024
    optimizer_offload: bool = False
    param_offload: bool = False
    ref_device: str = "cpu"  # the device, "cpu" (parked; moved in for its pass), or "none" (no separate ref)
    memory_fraction: Optional[float] = None
    alloc_conf: Optional[str] = None
    reasons: dict[str, str] = field(default_factory=dict)
    emulated: Optional[str] = None
    memory_budget_bytes: Optional[int] = None
    estimate: Optional[dict] = None
    # which models exist
    use_critic: bool = False
    use_ref: bool = False  # reference log-probs are needed (a separate model, or the adapter-disabled base)
    use_lora: bool = False
    rollout: RolloutPlan = field(default_factory=lambda: RolloutPlan(dtype=FP32))  # how responses are generated
    sizes: RuntimeSizes = field(default_factory=RuntimeSizes)  # batch sizes OOM recovery may lower
    world_size: int = 1  # ranks (trainer.nnodes x trainer.n_gpus_per_node); sizes above are per rank
    data_parallel: str = "none"  # "none" | "replicate" (full models per rank) | "shard" (FSDP2; sharding.py)
    dist_backend: Optional[str] = None  # "nccl" | "gloo" when world_size > 1
    cpu_threads: Optional[int] = None  # torch threads per process when several CPU ranks share a machine

    def to_dict(self) -> dict:
        return _jsonable(asdict(self))

    def summary(self) -> str:
        gib = est.format_bytes
        rows = [
            ("device", self.device, self.reasons.get("device", "")),
            ("card", self.card + (" (emulated)" if self.emulated else ""), self.reasons.get("card", "")),
            ("precision", f"{self.precision}: params {dtype_name(self.param_dtype)}, compute "
             f"{dtype_name(self.compute_dtype)}" + (", autocast" if self.use_autocast else "")
             + (", grad scaler" if self.use_grad_scaler else ""), self.reasons.get("precision", "")),
            ("rollout dtype", dtype_name(self.rollout.dtype), self.reasons.get("rollout_dtype", "")),
            ("tf32", "on" if self.allow_tf32 else "off", self.reasons.get("allow_tf32", "")),
            ("attention", self.attn_implementation, self.reasons.get("attn_implementation", "")),
            ("rollout engine", self.rollout.engine, self.reasons.get("rollout_engine", "")),
            ("critic", "yes" if self.use_critic else "no", self.reasons.get("use_critic", "")),
            ("reference", self.ref_device, self.reasons.get("ref_device", "")),
            ("lora", "yes" if self.use_lora else "no", self.reasons.get("use_lora", "")),
            ("grad checkpointing", "on" if self.gradient_checkpointing else "off",
             self.reasons.get("gradient_checkpointing", "")),
            ("actor micro-batch", str(self.sizes.actor_micro_batch_size), self.reasons.get("actor_micro_batch_size", "")),
            ("critic micro-batch", str(self.sizes.critic_micro_batch_size) if self.use_critic else "-",
             self.reasons.get("critic_micro_batch_size", "")),
            ("log-prob micro-batch", str(self.sizes.logprob_micro_batch_size),
             self.reasons.get("logprob_micro_batch_size", "")),
            ("tokens per micro-batch", str(self.sizes.max_token_len_per_micro_batch or "-"),
             self.reasons.get("max_token_len_per_micro_batch", "")),
            ("rollout batch", str(self.sizes.rollout_batch_size or "all"), self.reasons.get("rollout_batch_size", "")),
            ("log-prob chunk", f"{self.logprob_chunk_size} tokens", self.reasons.get("logprob_chunk_size", "")),
            ("optimizer offload", "on" if self.optimizer_offload else "off", self.reasons.get("optimizer_offload", "")),
            ("param offload", "on" if self.param_offload else "off", self.reasons.get("param_offload", "")),
            ("memory budget", gib(self.memory_budget_bytes) if self.memory_budget_bytes else "-",
             self.reasons.get("memory_budget", "")),
            ("memory cap", f"{self.memory_fraction:.3f} of the GPU" if self.memory_fraction else "none",
             self.reasons.get("memory_fraction", "")),
            ("allocator", self.alloc_conf or "default", self.reasons.get("alloc_conf", "")),
        ]
        if self.world_size > 1:
            rows.append(("ranks", f"{self.world_size} x {self.data_parallel} ({self.dist_backend})",
                         self.reasons.get("data_parallel", "")))
        return format_table(("decision", "choice", "reason"), rows)


def format_table(headers: tuple[str, ...], rows: list[tuple], max_width: int = 90) -> str:
    """A plain console table; long cells wrap in their column."""
    import textwrap

    def cells(row: tuple) -> list[list[str]]:
        return [textwrap.wrap(str(c), max_width) or [""] for c in row]

    wrapped = [cells(headers)] + [cells(r) for r in rows]
    widths = [max(len(line) for row in wrapped for line in row[i]) for i in range(len(headers))]
    out = []
    for number, row in enumerate(wrapped):
        for k in range(max(len(c) for c in row)):
            out.append(" | ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(row, widths)).rstrip())
        if number == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


@dataclass
class _Target:
    """The hardware the decisions are for: the emulated card, the real GPU, or the CPU."""

    name: str
    cc: Optional[tuple[int, int]]
    memory_bytes: int
    is_cuda: bool
    emulated: Optional[str] = None
    live_device: Optional[str] = None  # set when this is real hardware a kernel can be tried on

    @property
    def bf16(self) -> bool:
        return has_native_bf16(self.cc)

    @property
    def fast_fp16(self) -> bool:
        return has_fast_fp16(self.cc)

    @property
    def tf32(self) -> bool:
        return has_tf32(self.cc)


def _auto(value: Any) -> Optional[bool]:
    """'auto' / None -> None; booleans and 'true'/'false' strings -> bool."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("true", "yes", "on", "1"):
            return True
        if lowered in ("false", "no", "off", "0"):
            return False
        raise PlanError(f"expected auto, true or false, got {value!r}")
    return bool(value)


def _resolve_device(cfg: Any, hw: HardwareProbe, card: Optional[CardSpec], for_execution: bool,
                    reasons: dict[str, str]) -> tuple[str, Optional[DeviceInfo]]:
    requested = str(cfg.hardware.device or "auto").strip().lower()
    trainer_device = str(cfg.trainer.get("device", "auto") or "auto").strip().lower()
    if requested == "auto" and trainer_device == "cpu":
        requested = "cpu"
        reasons["device"] = "trainer.device=cpu"
    if requested == "cpu":
        if card is not None:
            if for_execution:
                raise PlanError(f"emulating the {card.name} caps a real GPU to its memory, but hardware.device=cpu. "
                                "Drop hardware.device=cpu (or the emulation) to run; `rlanywhere plan --emulate "
                                f"{card.key}` plans without running")
            reasons["device"] = f"planning only: the decisions are for the {card.name}"
        reasons.setdefault("device", "hardware.device=cpu")
        return "cpu", None
    if requested == "auto":
        if not hw.devices:
            if card is not None and for_execution:
                raise PlanError(f"--emulate {card.key} caps a real GPU to the {card.name}'s memory, and this machine "
                                f"has no CUDA device. Run `rlanywhere plan --emulate {card.key}` to plan without a "
                                "GPU, or drop the emulation to train on CPU")
            if card is not None:
                reasons["device"] = (f"planning only (no CUDA device here): the decisions are for the {card.name}")
            else:
                reasons["device"] = "no CUDA device visible: training on CPU"
            return "cpu", None
        index = _local_rank()
        reasons["device"] = (f"auto: this rank's GPU (LOCAL_RANK={index})" if "LOCAL_RANK" in os.environ
                             else "auto: first CUDA device")
        if index >= len(hw.devices):
            raise PlanError(f"rank with LOCAL_RANK={index} but only {len(hw.devices)} CUDA device(s) are visible: "
                            f"start at most {len(hw.devices)} processes per node (--nproc_per_node / "
                            "trainer.n_gpus_per_node)")
    else:
        match = re.fullmatch(r"cuda(?::(\d+))?", requested)
        if match is None:
            raise PlanError(f"hardware.device={requested!r} is not valid; use auto, cpu, cuda or cuda:N")
        index = int(match.group(1) or 0)
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            if match.group(1) is not None:
                raise PlanError(f"hardware.device={requested} under torchrun would put every rank on one GPU: use "
                                "hardware.device=cuda (or auto); each rank takes cuda:LOCAL_RANK")
            index = _local_rank()
        if not hw.devices:
            if card is not None and not for_execution:
                reasons["device"] = f"planning only (no CUDA device here): the decisions are for the {card.name}"
                return "cpu", None
            raise PlanError(f"hardware.device={requested} but no CUDA device is visible (torch.cuda.is_available() "
                            "is False). Use hardware.device=cpu (or auto)")
        if index >= len(hw.devices):
            raise PlanError(f"hardware.device={requested} but only {len(hw.devices)} CUDA device(s) are visible; "
                            f"use cuda:0..cuda:{len(hw.devices) - 1}")
        reasons["device"] = f"hardware.device={requested}"
    return f"cuda:{index}", hw.devices[index]


def _make_target(card: Optional[CardSpec], real: Optional[DeviceInfo], device: str, hw: HardwareProbe) -> _Target:
    if card is not None:
        return _Target(card.name, card.compute_capability, card.memory_bytes, True, emulated=card.key)
    if real is not None:
        return _Target(real.name, tuple(real.compute_capability), real.total_memory_bytes, True,
                       live_device=device if hw.live else None)
    return _Target(f"CPU ({hw.cpu_cores} cores)", None, hw.ram_available_bytes or hw.ram_total_bytes, False,
                   live_device="cpu" if hw.live else None)


@dataclass
class _Precision:
    name: str
    param: torch.dtype
    compute: torch.dtype
    autocast: bool
    scaler: bool


@dataclass
class _Fp16Checks:
    """What is known about fp16 on the device that will run the plan."""

    problems: Optional[list[str]]  # None: nothing could be run (planning without a GPU, a hand-made probe)
    where: str  # the device they ran on, or why they did not run


def _fp16_checks(target: _Target, real: Optional[DeviceInfo], device: str, hw: HardwareProbe) -> _Fp16Checks:
    if real is None:
        return _Fp16Checks(None, "planning without a GPU")
    problems = real.fp16_problems
    if problems is None and hw.live:
        problems = real.fp16_problems = fp16_problems(device)
    if problems is None:
        return _Fp16Checks(None, "a probe not taken on this machine")
    where = f"{device} ({real.name}" + (f", standing in for the {target.name})" if target.emulated else ")")
    return _Fp16Checks(problems, where)


def _decide_precision(requested: str, target: _Target, fp16: _Fp16Checks, reasons: dict[str, str]) -> _Precision:
    cc = _cc_str(target.cc)
    fp32 = _Precision("fp32", FP32, FP32, False, False)
    fp16_mixed = _Precision("fp16", FP32, FP16, True, True)
    mixed = "fp16 autocast over fp32 master weights, dynamic loss scaling"
    if requested == "auto":
        if not target.is_cuda:
            reasons["precision"] = "fp32: CPU (hardware.precision=bf16 opts in to bf16 autocast on CPU)"
            return fp32
        if target.bf16:
            reasons["precision"] = f"bf16 autocast over fp32 master weights: compute capability {cc} has native bf16"
            return _Precision("bf16", FP32, BF16, True, False)
        if not target.fast_fp16:
            reasons["precision"] = (f"fp32: compute capability {cc} has no bf16 and no fp16 tensor cores (fp16 "
                                    "would not be faster)")
            return fp32
        why = f"compute capability {cc} has fp16 tensor cores and no bf16"
        if fp16.problems is None:
            reasons["precision"] = (f"{mixed}: {why} (fp16 checks not run: {fp16.where}; `rlanywhere doctor` "
                                    "runs them on the card)")
            return fp16_mixed
        if not fp16.problems:
            reasons["precision"] = f"{mixed}: {why}; the fp16 checks passed on {fp16.where}"
            return fp16_mixed
        reasons["precision"] = (f"fp32: {why}, but the fp16 checks failed on {fp16.where}: "
                                f"{'; '.join(fp16.problems)}")
        log.warning("precision: fp32 instead of fp16 - the fp16 checks failed on %s: %s", fp16.where,
                    "; ".join(fp16.problems))
        return fp32
    if requested == "fp32":
        reasons["precision"] = "fp32: hardware.precision=fp32"
        return fp32
    if requested == "bf16":
        if target.is_cuda and not target.bf16:
            alt = " (or fp16, which this card runs on tensor cores)" if target.fast_fp16 else ""
            raise PlanError(f"hardware.precision=bf16: bf16 needs compute capability >= 8.0; the {target.name} has "
                            f"{cc}. Use hardware.precision=fp32 (or auto){alt}")
        where = "CPU (slow without AVX512-BF16/AMX)" if not target.is_cuda else f"compute capability {cc}"
        reasons["precision"] = f"bf16 autocast over fp32 master weights: hardware.precision=bf16 on {where}"
        return _Precision("bf16", FP32, BF16, True, False)
    if requested == "fp16":
        if not target.is_cuda:
            raise PlanError("hardware.precision=fp16 is not supported on CPU. Use hardware.precision=fp32 (or bf16)")
        if fp16.problems:
            raise PlanError(f"hardware.precision=fp16: the fp16 checks failed on {fp16.where}: "
                            f"{'; '.join(fp16.problems)}. Use hardware.precision=fp32 (or auto)")
        slow = "" if target.fast_fp16 else f"; compute capability {cc} has no fp16 tensor cores, so it is not faster"
        reasons["precision"] = f"{mixed}: hardware.precision=fp16{slow}"
        return fp16_mixed
    raise PlanError(f"hardware.precision={requested!r} is not valid; use auto, fp32, bf16 or fp16")


def _decide_rollout_dtype(requested: str, precision: _Precision, target: _Target, reasons: dict[str, str]
                          ) -> torch.dtype:
    if str(requested).strip().lower() in ("auto", "", "none"):
        reasons["rollout_dtype"] = "the compute dtype"
        return precision.compute
    try:
        wanted = dtype_from_name(requested)
    except ValueError as exc:
        raise PlanError(f"actor_rollout_ref.rollout.dtype={requested!r}: {exc}") from exc
    unsupported = (target.is_cuda and wanted == BF16 and not target.bf16) or (not target.is_cuda and wanted == FP16)
    if unsupported:
        # verl sets rollout.dtype=bfloat16 by default, so this is a default to adapt, not a hard request
        reasons["rollout_dtype"] = (f"actor_rollout_ref.rollout.dtype={requested} overridden: the {target.name} "
                                    f"cannot run it; rolling out in {dtype_name(precision.compute)}")
        return precision.compute
    reasons["rollout_dtype"] = f"actor_rollout_ref.rollout.dtype={requested}"
    return wanted


def _sdpa_backends(target: _Target, dtype: torch.dtype, head_dim: int) -> list[str]:
    if target.live_device is not None:
        return sdpa_backends_that_run(dtype, head_dim, target.live_device)
    return predicted_sdpa_backends(target.cc, dtype, head_dim)


def _decide_attention(requested: str, hw: HardwareProbe, target: _Target, compute: torch.dtype, head_dim: int,
                      reasons: dict[str, str]) -> tuple[str, list[str]]:
    cc = _cc_str(target.cc)
    if not target.is_cuda:
        flash_problem = "FlashAttention-2 needs a CUDA GPU"
    elif not flash_attn_capable(target.cc):
        flash_problem = f"FlashAttention-2 needs compute capability >= 8.0; the {target.name} has {cc}"
    elif not hw.flash_attn_installed:
        flash_problem = "flash_attn is not installed (pip install flash-attn --no-build-isolation)"
    elif not is_half(compute):
        flash_problem = (f"FlashAttention-2 runs only in bf16/fp16, and the plan computes in {dtype_name(compute)} "
                         "(set hardware.precision=bf16)")
    else:
        flash_problem = None
    backends = _sdpa_backends(target, compute, head_dim)
    backends_text = f"SDPA backends that run for {dtype_name(compute)}, head dim {head_dim}: {', '.join(backends)}"
    if requested == "auto":
        if flash_problem is None:
            reasons["attn_implementation"] = "auto: flash_attn is installed and usable on this card"
            return ATTN_FLASH, backends
        if backends:
            reasons["attn_implementation"] = f"auto: {flash_problem}; {backends_text}"
            return ATTN_SDPA, backends
        reasons["attn_implementation"] = f"auto: {flash_problem}; no SDPA backend runs here"
        return ATTN_EAGER, backends
    if requested == ATTN_FLASH:
        if flash_problem is not None:
            raise PlanError(f"hardware.attn_implementation={ATTN_FLASH}: {flash_problem}. "
                            f"Use hardware.attn_implementation={ATTN_SDPA} (or auto)")
        reasons["attn_implementation"] = f"hardware.attn_implementation={ATTN_FLASH}"
        return ATTN_FLASH, backends
    if requested == ATTN_SDPA:
        if not backends:
            raise PlanError(f"hardware.attn_implementation=sdpa: no SDPA backend runs for {dtype_name(compute)} "
                            f"with head dim {head_dim} here. Use hardware.attn_implementation={ATTN_EAGER} (or auto)")
        reasons["attn_implementation"] = f"hardware.attn_implementation=sdpa; {backends_text}"
        return ATTN_SDPA, backends
    if requested == ATTN_EAGER:
        reasons["attn_implementation"] = "hardware.attn_implementation=eager"
        return ATTN_EAGER, backends
    raise PlanError(f"hardware.attn_implementation={requested!r} is not valid; use auto, "
                    f"{', '.join(ATTN_IMPLEMENTATIONS)}")


def _per_device(value: Optional[int], world: int) -> Optional[int]:
    return None if value is None else max(1, int(value) // world)


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def make_plan(cfg: Any, probe: Optional[HardwareProbe] = None, *, for_execution: bool = True,
              emulate: Optional[str] = None, model_shape: Optional[ModelShape] = None,
              critic_shape: Optional[ModelShape] = None) -> Plan:
    """Decide everything hardware-related for `cfg` on `probe` (probed now when None) or an emulated card.

    for_execution=False (the `plan` command) allows planning for an emulated card on a machine without CUDA;
    the plan's device is then "cpu" and the decisions are for the card. Raises PlanError / NoFitError."""
    hw = probe if probe is not None else probe_machine()
    hcfg = cfg.hardware
    arr = cfg.actor_rollout_ref
    reasons: dict[str, str] = {}
    emulate_name = emulate or hcfg.emulate
    card = card_spec(emulate_name) if emulate_name else None
    device, real = _resolve_device(cfg, hw, card, for_execution, reasons)
    target = _make_target(card, real, device, hw)
    if card is not None:
        reasons["card"] = (f"emulated: cc {_cc_str(card.compute_capability)}, {card.memory_gib} GiB"
                           + (f" on the real {real.name}" if real is not None else ""))
    elif real is not None:
        reasons["card"] = f"probed: cc {_cc_str(real.compute_capability)}"
    else:
        reasons["card"] = f"RAM {est.format_bytes(target.memory_bytes)} available"

    shape = model_shape or model_config_from_path(arr.model.path, arr.model.get("gguf_file"))
    if critic_shape is None and cfg.critic.model.path and cfg.critic.model.path != arr.model.path:
        critic_shape = model_config_from_path(cfg.critic.model.path)

    precision = _decide_precision(str(hcfg.precision), target, _fp16_checks(target, real, device, hw), reasons)
    rollout_dtype = _decide_rollout_dtype(str(arr.rollout.get("dtype", "auto")), precision, target, reasons)
    allow_tf32 = target.is_cuda and target.tf32
    reasons["allow_tf32"] = (f"compute capability {_cc_str(target.cc)} has TF32 for fp32 matmuls" if allow_tf32 else
                             "CPU" if not target.is_cuda else f"compute capability {_cc_str(target.cc)} has no TF32")
    attn, backends = _decide_attention(str(hcfg.attn_implementation), hw, target, precision.compute, shape.head_dim,
                                       reasons)
    engine = str(arr.rollout.name)
    fallback_allowed = engine == "auto"
    if engine == "auto":
        engine = "fast"
        reasons["rollout_engine"] = ("auto: the fast engine (static KV cache, CUDA graphs); it falls back to hf "
                                     "for architectures it does not support")
    else:
        reasons["rollout_engine"] = f"actor_rollout_ref.rollout.name={engine}"

    # which models exist
    actor = arr.actor
    use_critic = cfg.algorithm.adv_estimator == "gae"
    reasons["use_critic"] = ("adv_estimator=gae needs a value model" if use_critic else
                             f"adv_estimator={cfg.algorithm.adv_estimator} needs no value model")
    kl_loss = bool(actor.use_kl_loss) and float(actor.kl_loss_coef) > 0
    kl_reward = bool(cfg.algorithm.use_kl_in_reward) and float(cfg.algorithm.kl_ctrl.kl_coef) > 0
    use_ref = kl_loss or kl_reward
    use_lora = int(arr.model.lora_rank) > 0
    critic_lora = int(cfg.critic.model.lora_rank) if use_critic else 0
    reasons["use_lora"] = (f"actor_rollout_ref.model.lora_rank={arr.model.lora_rank}" if use_lora
                           else "full fine-tuning (lora_rank=0)")

    # memory
    plan = Plan(device=device, card=target.name, compute_capability=target.cc, precision=precision.name,
                param_dtype=precision.param, compute_dtype=precision.compute,
                use_autocast=precision.autocast, use_grad_scaler=precision.scaler, allow_tf32=allow_tf32,
                attn_implementation=attn, reasons=reasons, emulated=target.emulated,
                use_critic=use_critic, use_ref=use_ref, use_lora=use_lora,
                alloc_conf=ALLOC_CONF if target.is_cuda else None)
    plan.rollout = RolloutPlan(engine=engine, fallback_allowed=fallback_allowed, dtype=rollout_dtype,
                               reasons={"engine": reasons["rollout_engine"], "dtype": reasons["rollout_dtype"],
                                        "fallback_allowed": "automatic choice" if fallback_allowed else
                                        f"actor_rollout_ref.rollout.name={engine} asked for this engine"})
    reasons["alloc_conf"] = ("fewer fragmentation OOMs as phase shapes change (set before CUDA initialises)"
                             if target.is_cuda else "CPU")
    scores = attn == ATTN_EAGER or (attn == ATTN_SDPA and set(backends) <= {"math"})
    # [distributed] several ranks: replicate when a full replica fits each, else shard (distributed.plan_sharding)
    from .distributed import plan_sharding
    plan_sharding(cfg, plan, lambda shard_world: _plan_memory(cfg, plan, target, shape, critic_shape, scores,
                                                              critic_lora, use_ref and not use_lora, reasons,
                                                              shard_world=shard_world))
    _ref_reason(plan, use_ref, use_lora, kl_loss, kl_reward, reasons)
    _memory_cap(plan, card, real, for_execution, reasons)
    _plan_data_parallel(cfg, plan, hw, for_execution, reasons)
    if for_execution and card is not None and real is not None:
        _check_real_card_runs(plan, real, hw)
    return plan


def _plan_memory(cfg: Any, plan: Plan, target: _Target, shape: ModelShape, critic_shape: Optional[ModelShape],
                 scores_materialized: bool, critic_lora: int, separate_ref: bool, reasons: dict[str, str],
                 shard_world: int = 1) -> None:
    hcfg = cfg.hardware
    arr = cfg.actor_rollout_ref
    actor, critic = arr.actor, cfg.critic
    world = max(1, int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node))
    n = int(arr.rollout.n)
    prompts = int(cfg.data.train_batch_size)
    mini = min(int(actor.ppo_mini_batch_size), prompts)
    critic_mini = min(int(critic.ppo_mini_batch_size or mini), prompts)
    if hcfg.memory_budget_gib:
        device_bytes = int(float(hcfg.memory_budget_gib) * est.GIB)
        source = f"hardware.memory_budget_gib={hcfg.memory_budget_gib}"
    else:
        device_bytes = target.memory_bytes
        source = f"{target.name}{' (emulated)' if target.emulated else ''} {est.format_bytes(device_bytes)}"
    budget = est.memory_budget_bytes(device_bytes, target.is_cuda)
    plan.memory_budget_bytes = budget
    reasons["memory_budget"] = (
        f"{source} - {est.format_bytes(est.CUDA_CONTEXT_BYTES)} CUDA context, x {est.SAFETY_FRACTION} margin"
        if target.is_cuda else f"{source} available RAM x {est.CPU_RAM_FRACTION}")
    workload = est.Workload(
        param_dtype=plan.param_dtype, compute_dtype=plan.compute_dtype, rollout_dtype=plan.rollout.dtype,
        use_autocast=plan.use_autocast, prompts_per_step=max(1, math.ceil(prompts / world)), samples_per_prompt=n,
        prompt_length=int(arr.rollout.prompt_length or cfg.data.max_prompt_length),
        response_length=int(arr.rollout.response_length or cfg.data.max_response_length),
        actor_mini_batch=max(1, mini * n // world), critic_mini_batch=max(1, critic_mini * n // world),
        has_critic=plan.use_critic, has_ref=separate_ref,
        actor_lora_rank=int(arr.model.lora_rank), critic_lora_rank=critic_lora,
        attention_materializes_scores=scores_materialized, on_cuda=target.is_cuda,
        use_dynamic_bsz=bool(actor.use_dynamic_bsz),
        token_budget_cap=int(actor.ppo_max_token_len_per_gpu) if actor.use_dynamic_bsz else None,
        rollout_engine=plan.rollout.engine,
        # [distributed] FSDP2 sharding: weights/grads/Adam divided by the ranks, gathered weights counted
        shard_world=shard_world, gather_dtype=sharded_gather_dtype(plan) if shard_world > 1 else None)

    fixed: dict[str, Any] = {
        "gradient_checkpointing": _auto(arr.model.enable_gradient_checkpointing),
        "optimizer_offload": _auto(hcfg.optimizer_offload),
        "param_offload": _auto(hcfg.param_offload),
        "ref_on_device": {"auto": None, "cpu": False}.get(str(hcfg.ref_device).lower(), True),
        "actor_micro_batch": _first(actor.ppo_micro_batch_size_per_gpu,
                                    _per_device(actor.ppo_micro_batch_size, world)),
        "critic_micro_batch": _first(critic.ppo_micro_batch_size_per_gpu,
                                     _per_device(critic.ppo_micro_batch_size, world)),
        # one size for the forward-only passes (old/ref log-probs, critic values): the first one given
        "logprob_micro_batch": _first(arr.rollout.log_prob_micro_batch_size_per_gpu,
                                      arr.ref.log_prob_micro_batch_size_per_gpu,
                                      critic.forward_micro_batch_size_per_gpu,
                                      _per_device(arr.rollout.log_prob_micro_batch_size, world),
                                      _per_device(arr.ref.log_prob_micro_batch_size, world),
                                      _per_device(critic.forward_micro_batch_size, world)),
    }
    if not target.is_cuda:
        for key in ("optimizer_offload", "param_offload"):
            if fixed[key]:
                reasons[key] = f"hardware.{key}=true ignored: a CPU run has nowhere to offload to"
            fixed[key] = None
        fixed["ref_on_device"] = None
    if shard_world > 1:  # [distributed] FSDP2 offloads with its CPUOffloadPolicy only; a sharded ref stays on device
        fixed.update(optimizer_offload=False, ref_on_device=True, param_offload=bool(fixed["param_offload"]))
    chunk = int(hcfg.logprob_chunk_size or 0) or None
    fit = est.fit_settings(shape, workload, budget, fixed, critic_shape, logprob_chunk_size=chunk)
    if fit is None:
        label = f" ({source})" if world == 1 else (  # [distributed]
            f" ({source} per rank; the models sharded over the {world} ranks)" if shard_world > 1 else
            f" ({source} per rank; each of the {world} ranks holds the full models)")
        raise NoFitError(est.explain_no_fit(shape, workload, budget, fixed, critic_shape, label))
    placement, estimate = fit.placement, fit.estimate
    plan.estimate = estimate
    plan.gradient_checkpointing = placement.gradient_checkpointing
    plan.optimizer_offload = placement.optimizer_offload and target.is_cuda
    plan.param_offload = placement.param_offload and target.is_cuda
    plan.sizes.actor_micro_batch_size = placement.actor_micro_batch
    plan.sizes.critic_micro_batch_size = placement.critic_micro_batch if plan.use_critic else None
    plan.sizes.logprob_micro_batch_size = placement.logprob_micro_batch
    plan.sizes.max_token_len_per_micro_batch = placement.max_token_len
    plan.logprob_chunk_size = placement.logprob_chunk_size
    plan.sizes.rollout_batch_size = placement.rollout_batch
    # planning-only runs (emulated card, no GPU here) still name the card's device for what lives on it
    on_device = plan.device if (plan.device != "cpu" or not target.is_cuda) else "cuda:0"
    plan.ref_device = (on_device if placement.ref_on_device else "cpu") if separate_ref else "none"
    phases = estimate["phases"]
    seq = workload.seq_len

    def peak(*names: str) -> str:
        present = [p for p in names if p in phases]
        name = max(present, key=phases.get)
        return f"{name} peak {est.format_bytes(phases[name])} of {est.format_bytes(budget)}"

    caps = est.micro_batch_caps(workload)

    def batch_reason(key: str, value: int, explicit_from: str, *phase_names: str) -> str:
        if fixed.get(key) is not None:
            return f"{explicit_from}={value} ({peak(*phase_names)})"
        cap, cap_why = caps[key]
        how = cap_why if value == cap else "the largest power of two that fits"
        return f"{value} sequences x {seq} tokens: {how} ({peak(*phase_names)})"

    for key in ("gradient_checkpointing", "optimizer_offload", "param_offload"):
        if key not in reasons:
            note = fit.notes.get(key, "")
            explicit = {"gradient_checkpointing": "actor_rollout_ref.model.enable_gradient_checkpointing",
                        "optimizer_offload": "hardware.optimizer_offload", "param_offload": "hardware.param_offload"}
            reasons[key] = (f"{explicit[key]}={getattr(plan, key)}" if note == "explicit" else
                            f"{'on' if getattr(plan, key) else 'off'}: {note}")
    if workload.use_dynamic_bsz:
        reasons["max_token_len_per_micro_batch"] = (
            f"use_dynamic_bsz: ppo_max_token_len_per_gpu={actor.ppo_max_token_len_per_gpu}"
            + (f" lowered to {placement.max_token_len} to fit" if placement.max_token_len
               < int(actor.ppo_max_token_len_per_gpu) else "") + f" ({peak('actor_update', 'critic_update')})")
        reasons["actor_micro_batch_size"] = "use_dynamic_bsz: micro-batches are cut by the token budget"
        reasons["critic_micro_batch_size"] = reasons["actor_micro_batch_size"]
    else:
        reasons["actor_micro_batch_size"] = batch_reason(
            "actor_micro_batch", placement.actor_micro_batch, "actor.ppo_micro_batch_size_per_gpu", "actor_update")
        if plan.use_critic:
            reasons["critic_micro_batch_size"] = batch_reason(
                "critic_micro_batch", placement.critic_micro_batch, "critic.ppo_micro_batch_size_per_gpu",
                "critic_update")
    reasons["logprob_micro_batch_size"] = batch_reason(
        "logprob_micro_batch", placement.logprob_micro_batch, "log_prob_micro_batch_size_per_gpu",
        "old_log_prob", "ref_log_prob", "values") + "; old/ref log-probs and values"
    reasons["rollout_batch_size"] = (
        f"{'all ' if placement.rollout_batch == workload.rollout_sequences else ''}{placement.rollout_batch} of "
        f"{workload.rollout_sequences} sequences at once ({peak('rollout')})")
    reasons["logprob_chunk_size"] = ("hardware.logprob_chunk_size" if chunk else
                                     f"logits of {placement.logprob_chunk_size} tokens x {shape.vocab_size} vocab per "
                                     f"chunk stay under {est.LOGIT_CHUNK_TARGET_FRACTION:.0%} of the budget")
    if separate_ref:
        ref_note = fit.notes.get("ref_on_device", "")
        reasons["ref_device"] = ("hardware.ref_device" if ref_note == "explicit" else
                                 "parked on CPU, moved to the device only for its log-prob pass: needed to fit"
                                 if not placement.ref_on_device else "fits beside the actor" +
                                 (" and critic" if plan.use_critic else ""))


def sharded_gather_dtype(plan: "Plan") -> Optional[torch.dtype]:
    """[distributed] The dtype FSDP2 gathers a sharded model's weights in: the compute dtype under bf16 autocast
    (MixedPrecisionPolicy, gradients reduced in fp32); None (the fp32 params) otherwise, fp16 included (it keeps
    today's autocast + loss scaler on fp32 weights)."""
    return BF16 if plan.use_autocast and plan.compute_dtype == BF16 else None


def _local_rank() -> int:
    """This process's GPU index under torchrun (0 alone)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def _plan_data_parallel(cfg: Any, plan: Plan, hw: HardwareProbe, for_execution: bool,
                        reasons: dict[str, str]) -> None:
    """Several ranks: each holds a full replica (memory above is per rank, batch sizes divided by the ranks)."""
    per_node = max(1, int(cfg.trainer.n_gpus_per_node))
    world = max(1, int(cfg.trainer.nnodes) * per_node)
    plan.world_size = world
    if world == 1:
        reasons["data_parallel"] = "one process (trainer.nnodes x trainer.n_gpus_per_node = 1)"
        return
    on_gpu = plan.device.startswith("cuda")
    if for_execution and on_gpu and per_node > len(hw.devices):
        raise PlanError(f"trainer.n_gpus_per_node={per_node} but this node has {len(hw.devices)} CUDA device(s): "
                        f"use trainer.n_gpus_per_node<={len(hw.devices)} (or hardware.device=cpu for CPU processes)")
    plan.dist_backend = "nccl" if on_gpu else "gloo"
    # [distributed] plan.data_parallel ("replicate" | "shard") and its reason come from distributed.plan_sharding
    reasons["dist_backend"] = "NCCL between GPUs" if on_gpu else "gloo between CPU processes"
    if not on_gpu:
        plan.cpu_threads = max(1, (hw.cpu_cores or os.cpu_count() or 1) // per_node)
        reasons["cpu_threads"] = f"{hw.cpu_cores} cores shared by {per_node} CPU processes on this node"


def _ref_reason(plan: Plan, use_ref: bool, use_lora: bool, kl_loss: bool, kl_reward: bool,
                reasons: dict[str, str]) -> None:
    if not use_ref:
        plan.ref_device = "none"
        reasons["ref_device"] = "no reference model: no KL term (use_kl_loss and use_kl_in_reward off, or coef 0)"
    elif use_lora:
        plan.ref_device = "none"
        reasons["ref_device"] = "LoRA: the reference is the base model with the adapter disabled (no second copy)"
    else:
        why = " and ".join(w for w, on in (("use_kl_loss", kl_loss), ("use_kl_in_reward", kl_reward)) if on)
        reasons["ref_device"] = f"{why} needs a reference; " + reasons.get("ref_device", "")


def _memory_cap(plan: Plan, card: Optional[CardSpec], real: Optional[DeviceInfo], for_execution: bool,
                reasons: dict[str, str]) -> None:
    if card is None:
        reasons["memory_fraction"] = "not emulating"
        return
    if real is None:
        reasons["memory_fraction"] = f"would cap a real GPU to {card.memory_gib} GiB when run"
        return
    fraction = card.memory_bytes / real.total_memory_bytes
    if fraction > 1.0:
        message = (f"cannot emulate the {card.name} ({card.memory_gib} GiB) on the {real.name} "
                   f"({est.format_bytes(real.total_memory_bytes)}): the card has more memory than this GPU")
        if for_execution:
            raise PlanError(message + "; emulate a smaller card or use a larger GPU")
        reasons["memory_fraction"] = message
        return
    plan.memory_fraction = fraction
    reasons["memory_fraction"] = (f"{card.memory_gib} GiB of the {real.name}'s "
                                  f"{est.format_bytes(real.total_memory_bytes)}")


def _check_real_card_runs(plan: Plan, real: DeviceInfo, hw: HardwareProbe) -> None:
    """An emulated plan still executes on the real GPU: it must support what the plan uses."""
    if plan.compute_dtype == BF16 and not real.native_bf16:
        raise PlanError(f"the plan for the emulated {plan.card} computes in bf16, which the real {real.name} "
                        f"(cc {_cc_str(real.compute_capability)}) cannot run. Set hardware.precision=fp32")
    if plan.attn_implementation == ATTN_FLASH and not (hw.flash_attn_installed and
                                                       flash_attn_capable(real.compute_capability)):
        raise PlanError(f"the plan for the emulated {plan.card} uses {ATTN_FLASH}, which the real {real.name} cannot "
                        f"run. Set hardware.attn_implementation={ATTN_SDPA}")


# --------------------------------------------------------------------------------------------- runtime
def prepare_environment(cfg: Any = None) -> None:
    """Call first thing, before anything touches torch.cuda: allocator settings are read when CUDA initialises."""
    device = str(cfg.hardware.device if cfg is not None else "auto").lower()
    if device == "cpu":
        return
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF


def apply_runtime(plan: Plan) -> None:
    """TF32 flags, the memory cap when emulating, allocator settings (if CUDA has not initialised yet)."""
    if not plan.device.startswith("cuda"):
        torch.set_float32_matmul_precision("highest")
        if plan.cpu_threads:
            torch.set_num_threads(plan.cpu_threads)
        return
    if plan.alloc_conf and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        if torch.cuda.is_initialized():
            log.warning("CUDA is already initialised: PYTORCH_CUDA_ALLOC_CONF=%s has no effect; call "
                        "hardware.prepare_environment(cfg) before touching torch.cuda", plan.alloc_conf)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = plan.alloc_conf
    torch.backends.cuda.matmul.allow_tf32 = plan.allow_tf32
    torch.backends.cudnn.allow_tf32 = plan.allow_tf32
    torch.set_float32_matmul_precision("high" if plan.allow_tf32 else "highest")
    if plan.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(plan.memory_fraction, torch.device(plan.device))


def autocast_context(plan: Plan, enabled: bool = True) -> contextlib.AbstractContextManager:
    """torch.autocast in the plan's compute dtype when the plan uses autocast, else a no-op."""
    if not (enabled and plan.use_autocast):
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(plan.device).type, dtype=plan.compute_dtype)


def make_grad_scaler(plan: Plan) -> Optional["torch.amp.GradScaler"]:
    """A GradScaler for fp16 plans (LOSS_SCALE_INIT, halved on overflow, doubled after LOSS_SCALE_GROWTH_INTERVAL
    clean steps), None otherwise."""
    if not plan.use_grad_scaler:
        return None
    return torch.amp.GradScaler(torch.device(plan.device).type, init_scale=LOSS_SCALE_INIT,
                                growth_interval=LOSS_SCALE_GROWTH_INTERVAL)


# ---------------------------------------------------------------------------------------------- CLI hooks
def _estimate_table(plan: Plan) -> str:
    estimate = plan.estimate or {}
    budget = plan.memory_budget_bytes or 0
    rows = []
    for phase, need in estimate.get("phases", {}).items():
        parts = sorted(estimate["breakdown"][phase].items(), key=lambda kv: -kv[1])[:4]
        rows.append((phase, est.format_bytes(need), f"{100 * need / budget:.0f}%" if budget else "-",
                     ", ".join(f"{k} {est.format_bytes(v)}" for k, v in parts)))
    return format_table(("phase", "predicted peak", "of budget", "largest parts"), rows, max_width=100)


def _config(config: Any, overrides: Optional[list[str]]) -> Any:
    """A loaded config passes through; a path (or None: the defaults) is loaded with the overrides."""
    from omegaconf import DictConfig

    from rlanywhere.config import load_config

    if isinstance(config, DictConfig):
        if overrides:
            raise ValueError("overrides are applied when loading: pass a config path, or fold them into the config")
        return config
    return load_config(config, list(overrides or []))


def plan_main(config: Any = None, overrides: Optional[list[str]] = None, emulate: Optional[str] = None,
              json_out: Optional[str] = None, probe: Optional[HardwareProbe] = None) -> int:
    """`rlanywhere plan`: print the probe, the plan table and the predicted per-phase peaks. 0 ok, 2 no plan.

    config: a loaded DictConfig, or a YAML path (None: defaults) loaded with `overrides`. emulate: a CARDS key
    (default: cfg.hardware.emulate). json_out: a path to also write {"probe", "plan"} as JSON; "-" or True prints
    only the JSON."""
    cfg = _config(config, overrides)
    if json_out is True:
        json_out = "-"
    hw = probe if probe is not None else probe_machine()
    try:
        plan = make_plan(cfg, hw, for_execution=False, emulate=emulate)
    except PlanError as exc:
        if json_out == "-":
            print(json.dumps({"probe": hw.to_dict(), "error": str(exc)}, indent=2))
        else:
            print("machine:\n" + hw.summary())
            print(f"\nno plan: {exc}")
        return 2
    payload = {"probe": hw.to_dict(), "plan": plan.to_dict()}
    if json_out == "-":
        print(json.dumps(payload, indent=2))
        return 0
    print("machine:\n" + hw.summary())
    print(f"\nplan{' (emulating ' + plan.emulated + ')' if plan.emulated else ''}:\n{plan.summary()}")
    print(f"\npredicted peak memory per phase (budget {est.format_bytes(plan.memory_budget_bytes or 0)}):")
    print(_estimate_table(plan))
    print(f"\nmicro-batches: actor {plan.sizes.actor_micro_batch_size}, critic "
          f"{plan.sizes.critic_micro_batch_size if plan.use_critic else '-'}, log-prob {plan.sizes.logprob_micro_batch_size}"
          + (f", tokens {plan.sizes.max_token_len_per_micro_batch}" if plan.sizes.max_token_len_per_micro_batch else "")
          + f"; rollout {plan.sizes.rollout_batch_size} sequences at once")
    if json_out:
        Path(json_out).write_text(json.dumps(payload, indent=2))
        print(f"wrote {json_out}")
    return 0


def doctor_main(config: Any = None, overrides: Optional[list[str]] = None, emulate: Optional[str] = None) -> int:
    """`rlanywhere doctor` (see doctor.doctor_main): 0 when every check passes, 1 otherwise."""
    from rlanywhere.doctor import doctor_main as run

    return run(config, overrides, emulate)
