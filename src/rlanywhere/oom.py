"""Recover from out-of-memory errors by halving a phase's micro-batch size and redoing the phase.

The planner's memory estimate can be wrong (fragmentation, a long-response batch, another process on the card).
Instead of crashing hours into a run, ``OOMGuard.run(phase, fn, kind)`` calls ``fn(size)`` with the run's current
size of that kind (``RuntimeSizes.get(kind)``: a micro-batch size or a token budget); on an out-of-memory error it
frees what the failed attempt held, halves that size in the RuntimeSizes (so every later step of the run uses the
smaller size), logs one line, records an event and calls ``fn`` again from the start. The sizes and events live in
the run's RunState (runstate.py), never in the Plan. Before the first halving it tries ``RunState.relieve(phase)``
once: a rollout KV cache kept between phases is freed there, and the phase is retried at the same size. ``fn`` must be restartable:
it starts with ``optimizer.zero_grad()`` and recomputes everything it needs from its inputs. At the minimum size
the error is re-raised with a message naming what to change.

A sharded update cannot be redone on one rank: its forward and backward all-gather and reduce-scatter layer by
layer, so the other ranks wait in a collective the failed rank will not join in the same order.
``OOMGuard.run_matched`` runs such a phase once; on an out-of-memory error it halves the size as above, writes the
sizes to ``RUN/checkpoints/oom_sizes.json`` (``remember_sizes``) and raises ``OutOfMemoryRestart``: the job ends,
and the next launch resumes from the last checkpoint at the smaller size (``lowered_sizes``). `rlanywhere train`
relaunches its own torchrun for that (cli.py); under a torchrun started by hand, `--max-restarts` does the same.
"""

from __future__ import annotations

import gc
import time
import traceback
from typing import Callable, Mapping, Optional, TypeVar

import torch

from .errors import UserError
from .plans import RuntimeSizes, SizeKind
from .runstate import (OOM_SIZES_FILE, RunState, oom_sizes_path, remember_sizes,  # noqa: F401 (oom's names too)
                       remembered_sizes)

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


class OutOfMemoryRestart(UserError, RuntimeError):
    """Out of memory in a phase one rank cannot redo alone; the halved size is saved for the next launch. A run
    that stopped itself: one line, exit code 2 (docs/reliability.md)."""


def lowered_sizes(sizes: RuntimeSizes, record: Optional[dict]) -> list[tuple[str, int, int]]:
    """Lower each of `sizes` to the remembered one where that is smaller; returns (name, old, new) per change."""
    changes = []
    for name, remembered in ((record or {}).get("sizes") or {}).items():
        kind = SizeKind(name)
        current = sizes.get(kind)
        if isinstance(remembered, int) and isinstance(current, int) and remembered < current:
            sizes.set(kind, remembered)
            changes.append((name, current, remembered))
    return changes


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
    """Run phases under out-of-memory recovery; halves ``run.sizes.get(kind)`` on each OOM.

    ``run`` is the run's RunState (runstate.py): the sizes the phases run at, where every recovery is recorded
    (``run.oom_events``: phase, attribute, old_size, new_size, error, time), what can be freed before a halving
    (``run.relieve``) and where a size is saved for the next launch (``run.remember_for_next_launch``). A bare
    RuntimeSizes is accepted (a RunState around it: nothing to relieve, nothing remembered). ``min_size`` is the
    smallest size a phase may run at: one int for all kinds, or a mapping SizeKind -> int (e.g. a token budget's
    minimum is a sequence length, not 1). ``enabled=False`` (hardware.oom_recovery=false) runs ``fn`` once.
    """

    def __init__(self, run, log_fn: Callable[[str], None] = print,
                 min_size: int | Mapping[SizeKind, int] = 1, enabled: bool = True):
        self.run_state = run if isinstance(run, RunState) else RunState(run)
        self.log_fn = log_fn
        self.min_size = min_size
        self.enabled = enabled

    @property
    def sizes(self) -> RuntimeSizes:
        return self.run_state.sizes

    @property
    def events(self) -> list[dict]:
        return self.run_state.oom_events

    def _minimum(self, kind: SizeKind) -> int:
        if isinstance(self.min_size, Mapping):
            return int(self.min_size.get(kind, 1))
        return int(self.min_size)

    def run(self, phase: str, fn: Callable[[int], T], kind: SizeKind) -> T:
        """Return ``fn(size)`` with ``size = sizes.get(kind)``, halving it and retrying on OOM."""
        size = self.sizes.get(kind)  # a TypeError unless kind is a SizeKind
        if not self.enabled:
            return fn(size)
        return self._run(phase, fn, kind)

    def run_matched(self, phase: str, fn: Callable[[int], T], kind: SizeKind) -> T:
        """``fn(size)`` once, for a phase every rank must run alike (a sharded update). On OOM the size is halved
        and recorded as in ``run``, the run state saves it for the next launch, and OutOfMemoryRestart ends the job:
        redoing the phase here would pair this rank's collectives with other ones on the ranks that went on."""
        size = self.sizes.get(kind)
        try:
            return fn(size)
        except Exception as exc:  # noqa: BLE001 - filtered by is_oom_error, everything else re-raised
            if not self.enabled or not is_oom_error(exc):
                raise
            new_size = self._halved(phase, kind, size, exc)
            error_line = _first_line(exc)
        event = self._event(phase, kind, size, new_size, error_line)
        self.run_state.record_oom(kind, new_size, event)
        where = self.run_state.remember_for_next_launch(event)
        name = kind.value
        self.log_fn(f"[oom] {phase}: out of memory at {name}={size}; the job stops, {name}={new_size} for the next "
                    "launch")
        raise OutOfMemoryRestart(
            f"out of memory in phase {phase!r} at {name}={size} ({error_line}). A sharded update cannot be redone "
            "on one rank alone, so the job stops here; "
            + (f"{name}={new_size} is saved in {where}: the next launch resumes from the last checkpoint at that "
               "size (`rlanywhere train` relaunches by itself; under torchrun started by hand, add "
               "--max-restarts=3 or start it again)" if where else f"start it again with {name}={new_size}"))

    def _halved(self, phase: str, kind: SizeKind, size: int, exc: BaseException) -> int:
        """The size after an OOM at `size`; OutOfMemoryAtMinimumError when it cannot shrink."""
        name, minimum = kind.value, self._minimum(kind)
        new_size = max(size // 2, minimum)  # the minimum itself is tried before giving up
        if size <= minimum:
            raise OutOfMemoryAtMinimumError(
                f"Out of memory in phase {phase!r} even at {name}={size} (its minimum). To fit, reduce "
                "memory another way: train LoRA adapters instead of all weights "
                "(actor_rollout_ref.model.lora_rank), offload the optimizer and/or parameters "
                "(actor_rollout_ref.actor.fsdp_config.optimizer_offload / param_offload), shorten responses "
                "(data.max_response_length) or prompts (data.max_prompt_length), or use a smaller batch "
                f"(data.train_batch_size, actor_rollout_ref.rollout.n). Original error: {_first_line(exc)}"
            ) from exc
        return new_size

    @staticmethod
    def _event(phase: str, kind: SizeKind, size: int, new_size: int, error_line: str) -> dict:
        return {"phase": phase, "attribute": kind.value, "old_size": size, "new_size": new_size,
                "error": error_line, "time": time.time()}

    def _run(self, phase: str, fn: Callable[[int], T], kind: SizeKind) -> T:
        name = kind.value
        while True:
            size = self.sizes.get(kind)
            if not (isinstance(size, int) and size > 0):
                raise ValueError(f"{name} must be a positive int for OOM recovery in phase {phase!r}, got {size!r}")
            try:
                return fn(size)
            except Exception as exc:  # noqa: BLE001 - filtered by is_oom_error, everything else re-raised
                if not is_oom_error(exc):
                    raise
                relieved = self.run_state.relieve(phase)
                new_size = size if relieved else self._halved(phase, kind, size, exc)
                error_line = _first_line(exc)
                # the traceback's frames still reference the failed attempt's tensors: drop them
                traceback.clear_frames(exc.__traceback__)
            # outside the except block the exception itself is released too
            free_accelerator_memory()
            event = self._event(phase, kind, size, new_size, error_line)
            if relieved:  # memory held outside the phase is gone: the same size again
                self.run_state.record_oom(kind, size, {**event, "relieved": relieved})
                self.log_fn(f"[oom] {phase}: out of memory at {name}={size}; {relieved}; retrying at the same size")
                continue
            self.run_state.record_oom(kind, new_size, event)
            self.log_fn(f"[oom] {phase}: out of memory at {name}={size}; retrying with {name}={new_size}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
