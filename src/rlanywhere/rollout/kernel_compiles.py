"""Compile a decode step's Triton kernels side by side, before the step first runs.

Triton compiles a kernel on its first launch with a new specialization (its constants and its arguments' types).
A decode step launches several (attention, norms, SiLU*mul, the sampler), and with an empty Triton cache (a new
machine, a new Triton) each compile holds the step for 0.1-1.2 s of CPU, one after another: seconds before a run's
first evaluation or rollout moves. Triton's compiler spends most of that time outside the GIL (MLIR passes, LLVM,
ptxas), so compiles started on a pool of threads overlap.

    with side_by_side():   # each `launch` in here only starts the kernel's compile on the pool; torch ops run
        step(...)          # the Python of a step to come, run through once (its Triton kernels do not run)
    # on exit: every kernel the step launches is compiled (one that failed is compiled again, and raises, at its
    # real launch; with Triton 3.4 it raises here)

Every Triton launch of the decode step goes through `launch`; DecodeRunner rehearses each new kind of step this
way (rollout/runner.py). Needs Triton's AsyncCompileMode (Triton >= 3.4); without it `available()` is False and
kernels compile as they are first launched.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Optional

from ..machine import usable_cpu_cores

MAX_COMPILE_THREADS = 8  # a step has fewer kernels than this to compile

_compiling_only = contextvars.ContextVar("rlanywhere_compiling_only", default=False)  # per thread: a rollout in its
# own thread (async_pipeline.py) rehearses without touching the trainer thread's launches
_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()


def _async_compile_mode() -> Optional[type]:
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # Triton < 3.4
        return None
    return AsyncCompileMode


def available(device: Any) -> bool:
    """Whether kernels for `device` (a torch.device) compile side by side: a CUDA device, kernels compiled (not
    Triton's CPU interpreter) by a Triton with AsyncCompileMode."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and _async_compile_mode() is not None)


def compile_threads() -> int:
    return max(1, min(MAX_COMPILE_THREADS, usable_cpu_cores()))


def _compile_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(compile_threads(), thread_name_prefix="triton-compile")
        return _pool


def launch(kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
    """kernel[grid](*args, **kwargs); inside `side_by_side`, only the start of its compile (kernel.warmup: the
    specialization these arguments give, no launch)."""
    if _compiling_only.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def side_by_side() -> Iterator[None]:
    """Within: `launch` starts compiles on a pool of threads instead of launching. On exit: waits for them all
    (failures are dropped: the kernel's real launch compiles it again and raises). Use where `available(device)`;
    Triton's interpreter (tests) ignores the compile requests."""
    mode_class = _async_compile_mode()
    if mode_class is None:
        raise RuntimeError("side_by_side needs Triton's AsyncCompileMode (Triton >= 3.4); check available() first")
    try:
        mode = mode_class(_compile_pool(), ignore_errors=True)
    except TypeError:  # Triton 3.4's has no ignore_errors: a failed compile raises here, as its launch would
        mode = mode_class(_compile_pool())
    token = _compiling_only.set(True)
    try:
        with mode:
            yield
    finally:
        _compiling_only.reset(token)


__all__ = ["available", "launch", "side_by_side", "compile_threads"]
