"""Recover from out-of-memory errors by halving a phase's micro-batch size and redoing the phase.

The planner's memory estimate can be wrong (fragmentation, a long-response batch, another process on the card).
Instead of crashing hours into a run, ``OOMGuard.run(phase, fn, size_attr)`` calls ``fn(size)`` with the plan's
current micro-batch size (or token budget) for that phase; on an out-of-memory error it frees what the failed
attempt held, halves the plan attribute (so every later step of the run uses the smaller size), logs one line,
records an event and calls ``fn`` again from the start. ``fn`` must be restartable: it starts with
``optimizer.zero_grad()`` and recomputes everything it needs from its inputs. At the minimum size the error is
re-raised with a message naming what to change.
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Callable, Mapping, TypeVar

import torch

T = TypeVar("T")

_OOM_MESSAGES = (
    "out of memory",  # CUDA ("CUDA out of memory", "CUDA error: out of memory"), XPU, MPS ("MPS backend out of memory")
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "failed to allocate memory",
    "can't allocate memory",  # the CPU: "DefaultCPUAllocator: can't allocate memory: you tried to allocate ..."
)


def _oom_types() -> tuple[type, ...]:
    types: list[type] = [MemoryError]  # a CPU allocation failure (numpy, Python) shrinks the plan like CUDA OOM
    for owner, name in ((torch, "OutOfMemoryError"), (torch.cuda, "OutOfMemoryError")):
        cls = getattr(owner, name, None)
        if isinstance(cls, type):
            types.append(cls)
    return tuple(types)


def is_oom_error(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError and for RuntimeErrors whose message says the device ran out of memory
    (CUDA, cuBLAS/cuDNN allocation failures, MPS, XPU). Follows ``raise ... from`` / implicit exception chains."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, _oom_types()):
            return True
        if isinstance(exc, RuntimeError):
            message = str(exc).lower()
            if any(text in message for text in _OOM_MESSAGES):
                return True
        exc = exc.__cause__ or exc.__context__
    return False


class OutOfMemoryAtMinimumError(RuntimeError):
    """Out of memory although the phase already runs at its minimum micro-batch size."""


def free_accelerator_memory() -> None:
    """Collect garbage and return cached blocks to the driver so the retry starts from a clean allocator."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and hasattr(mps, "empty_cache") and torch.backends.mps.is_available():
        mps.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and hasattr(xpu, "empty_cache") and xpu.is_available():
        xpu.empty_cache()


class OOMGuard:
    """Run phases under out-of-memory recovery; halves ``plan.<size_attr>`` on each OOM.

    ``min_size`` is the smallest size a phase may run at: one int for all attributes, or a mapping
    attribute -> int (e.g. a token budget's minimum is a sequence length, not 1). ``events`` lists every
    recovery as a dict (phase, attribute, old_size, new_size, error, time).
    """

    def __init__(self, plan, log_fn: Callable[[str], None] = print, min_size: int | Mapping[str, int] = 1):
        self.plan = plan
        self.log_fn = log_fn
        self.min_size = min_size
        self.events: list[dict] = []

    def _minimum(self, size_attr: str) -> int:
        if isinstance(self.min_size, Mapping):
            return int(self.min_size.get(size_attr, 1))
        return int(self.min_size)

    def run(self, phase: str, fn: Callable[[int], T], size_attr: str) -> T:
        """Return ``fn(size)`` with ``size = plan.<size_attr>``, halving it and retrying on OOM."""
        if not hasattr(self.plan, size_attr):
            raise AttributeError(
                f"the plan has no attribute {size_attr!r}; pass the name of the plan field holding this phase's "
                "micro-batch size (e.g. 'actor_micro_batch_size') or token budget ('max_token_len_per_micro_batch')"
            )
        minimum = self._minimum(size_attr)
        while True:
            size = getattr(self.plan, size_attr)
            if not (isinstance(size, int) and size > 0):
                raise ValueError(
                    f"plan.{size_attr} must be a positive int for OOM recovery in phase {phase!r}, got {size!r}"
                )
            try:
                return fn(size)
            except Exception as exc:  # noqa: BLE001 - filtered by is_oom_error, everything else re-raised
                if not is_oom_error(exc):
                    raise
                new_size = size // 2
                if size <= minimum or new_size < minimum:
                    raise OutOfMemoryAtMinimumError(
                        f"Out of memory in phase {phase!r} even at {size_attr}={size} (its minimum). To fit, reduce "
                        "memory another way: train LoRA adapters instead of all weights "
                        "(actor_rollout_ref.model.lora_rank), offload the optimizer and/or parameters "
                        "(actor_rollout_ref.actor.fsdp_config.optimizer_offload / param_offload), shorten responses "
                        "(data.max_response_length) or prompts (data.max_prompt_length), or use a smaller batch "
                        f"(data.train_batch_size, actor_rollout_ref.rollout.n). Original error: {_first_line(exc)}"
                    ) from exc
                error_line = _first_line(exc)
                # the traceback's frames still reference the failed attempt's tensors: drop them
                traceback.clear_frames(exc.__traceback__)
            # outside the except block the exception itself is released too
            free_accelerator_memory()
            setattr(self.plan, size_attr, new_size)
            self.events.append(
                {
                    "phase": phase,
                    "attribute": size_attr,
                    "old_size": size,
                    "new_size": new_size,
                    "error": error_line,
                    "time": time.time(),
                }
            )
            self.log_fn(f"[oom] {phase}: out of memory at {size_attr}={size}; retrying with {size_attr}={new_size}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
