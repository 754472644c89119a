"""Applies a plan to this process: allocator settings before CUDA initialises (`prepare_environment`), TF32 flags,
CPU threads and the emulated card's memory cap (`apply_runtime`), autocast in the plan's compute dtype
(`autocast_context`), the SDPA backends of the training passes (`training_attention_context`) and the fp16 loss
scaler (`make_grad_scaler`). It decides nothing: the planner did."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any, Optional

import torch

from .plans import Plan
from .vocabulary import ALLOC_CONF, LOSS_SCALE_GROWTH_INTERVAL, LOSS_SCALE_INIT

log = logging.getLogger(__name__)


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
                        "runtime.prepare_environment(cfg) before touching torch.cuda", plan.alloc_conf)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = plan.alloc_conf
    torch.backends.cuda.matmul.allow_tf32 = plan.allow_tf32
    torch.backends.cudnn.allow_tf32 = plan.allow_tf32
    torch.set_float32_matmul_precision("high" if plan.allow_tf32 else "highest")
    if plan.cpu_threads:  # [async] overlapped: a core left to the rollout's thread (async_plan.spare_core_for_rollout)
        torch.set_num_threads(plan.cpu_threads)
    if plan.memory_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(plan.memory_fraction, torch.device(plan.device))


class _SharedSdpaBackends:
    """The training passes' SDPA backends, shared by the threads that run passes at once.

    `sdpa_kernel` sets process-wide flags and restores the previous ones on leaving. With a pass on each of two
    threads (the update, and the reference's pass beside it: async_pipeline.py) a plain `sdpa_kernel` of the thread
    that leaves first would restore every backend under the pass still running. Here the first pass to enter sets the
    backends and the last to leave restores them. Backends other than the active ones (another plan in the same
    process) nest as plain `sdpa_kernel` does."""

    def __init__(self):
        self.lock = threading.Lock()
        self.users = 0
        self.active: tuple[str, ...] | None = None
        self.context: contextlib.AbstractContextManager | None = None

    @staticmethod
    def _kernel(backends: tuple[str, ...]) -> contextlib.AbstractContextManager:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([getattr(SDPBackend, name.upper()) for name in backends])

    @contextlib.contextmanager
    def use(self, backends: tuple[str, ...]):
        with self.lock:
            nested = self.users > 0 and backends != self.active
            if not nested:
                if self.users == 0:
                    self.context = self._kernel(backends)
                    self.context.__enter__()
                    self.active = backends
                self.users += 1
        if nested:
            with self._kernel(backends):
                yield
            return
        try:
            yield
        finally:
            with self.lock:
                self.users -= 1
                if self.users == 0:
                    context, self.context, self.active = self.context, None, None
                    context.__exit__(None, None, None)


_TRAINING_SDPA = _SharedSdpaBackends()


def training_attention_context(plan: Plan) -> contextlib.AbstractContextManager:
    """The SDPA backends of plan.training_sdpa_backends around a training forward/backward (no-op when empty);
    safe with passes on two threads at once (_SharedSdpaBackends)."""
    if not plan.training_sdpa_backends:
        return contextlib.nullcontext()
    return _TRAINING_SDPA.use(tuple(plan.training_sdpa_backends))


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
