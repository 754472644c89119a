"""torch.compile for shapes that change every step, without a recompile for each new one.

Our compiled code (the training passes' decoder layers, the log-prob head's chunk math, the decode step's
elementwise kernels) sees sizes that change with every batch: rows per micro-batch, sequence length, prompts per
engine call. It is compiled with dynamic shapes, but dynamo's "duck sizing" gives sizes that are equal at the first
call one symbol. A micro-batch of 64 rows on a model with 64-wide heads (SmolLM2, the demo) compiles a graph for
"rows == head size", and the next row count compiles again. On a GPU each compile is seconds of inductor work (a
profiled two-H200 demo run had update phases of 6.5 and 13.3 s among 0.25-0.45 s ones), and after 8 of them dynamo
stops compiling that function and it runs eager for the rest of the run.

`compile_dynamic` turns duck sizing off before it compiles (a process-wide setting of torch's symbolic shapes: each
size gets its own symbol, and a graph that needs two sizes equal still guards on it), and asks inductor not to
guard on sizes in its fusion heuristics: its mix-order reduction (RMSNorm's backward) compiled one graph for
micro-batches under 5 Mi elements and another for larger ones. Other guards are kept out by the callers: decode
batches of at least 2 rows (dynamo specializes sizes 0 and 1: they change broadcasting), micro-batch widths that
are multiples of 8 (inductor's alignment guard; plan.micro_batch_width_multiple), inputs that are not views. What
remains is a graph per function and per thing that does change the code: grad mode (the log-prob passes run without
gradients), with or without entropy, RoPE over one decode position or a prefill's many.
Python floats are specialized (constants of the graph, guarded by value): the ones our compiled code sees are a
model's constants (RMSNorm's epsilon, attention's scale and dropout, the sampling temperature). Left as symbols,
as torch does by default, dynamo traced each decoder layer, AOT autograd included, a second time at its first
compile, when the floats turned out not to be tensor inputs (a 2-layer Qwen2 on a CPU: 13.5 s instead of 16.7).
`compiles_so_far` counts compiles, which the trainer reports per step as `perf/compiles`.

Compiled kernels are cached across runs: inductor's FX-graph and autograd caches are on in torch, but they live
in /tmp by default, which many machines clear at boot (tmpfs). `compile_dynamic` points them at
`~/.cache/rlanywhere/compile` ($RLANYWHERE_CACHE/compile) unless TORCHINDUCTOR_CACHE_DIR is set, so a second run
of the same job on the same machine skips inductor's code generation and autotuning after a reboot too.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, TypeVar

import torch
import torch.nn as nn

from .cache import cache_dir

Compilable = TypeVar("Compilable", nn.Module, Callable[..., Any])


def without_duck_sizing() -> None:
    """Every dynamic size its own symbol (torch.fx.experimental._config.use_duck_shape = False)."""
    import torch.fx.experimental._config as symbolic_shapes_config

    symbolic_shapes_config.use_duck_shape = False


def specialize_floats() -> None:
    """Python floats as constants of the graph (torch._dynamo.config.specialize_float = True)."""
    import torch._dynamo.config as dynamo_config

    dynamo_config.specialize_float = True


def inductor_options() -> dict:
    """Inductor settings that keep size guards out of its fusion decisions, for the options this torch has."""
    from torch._inductor import config as inductor_config

    wanted = {"triton.mix_order_reduction_non_strict_mode": True}
    return {key: value for key, value in wanted.items()
            if hasattr(getattr(inductor_config, key.split(".")[0], None), key.split(".")[1])}


def persistent_compile_cache() -> str:
    """Inductor's cache directory, set to rlanywhere's cache folder (cache.cache_dir) unless the
    user chose one with TORCHINDUCTOR_CACHE_DIR; Triton's compiled kernels (inductor's and the decode step's own
    Triton kernels) in its `triton` folder unless TRITON_CACHE_DIR is set. Without it the decode kernels would go
    to ~/.triton until inductor's first compile points Triton at its own folder: one cache for both, kept together."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "compile")
    if not os.environ.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "triton")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compile_dynamic(target: Compilable, backend: str = "inductor") -> Compilable:
    """`target` compiled with dynamic shapes, no duck sizing and (inductor) no size guards in fusion heuristics: a
    function comes back compiled; a module is compiled in place (nn.Module.compile: parameters and state dicts
    unchanged) and returned. Inductor's caches go to `persistent_compile_cache()`."""
    without_duck_sizing()
    specialize_floats()
    if backend == "inductor":
        persistent_compile_cache()
    kwargs = {"dynamic": True, "backend": backend}
    if backend == "inductor":
        kwargs["options"] = inductor_options()
    if isinstance(target, nn.Module):
        target.compile(**kwargs)
        return target
    return torch.compile(target, **kwargs)


def compiles_so_far() -> int:
    """How many frames torch.compile has compiled in this process (first compiles and recompiles); 0 when
    nothing was compiled (dynamo not even imported)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["frames"]["total"]) if utils is not None else 0


# dynamo's timers (torch._dynamo.utils.compilation_time_metrics): a frame's whole compile (tracing, AOT autograd,
# inductor's forward) and a backward graph's inductor compile, which runs later, at the first backward
COMPILE_TIMERS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def compile_seconds_so_far() -> float:
    """Seconds this process has spent in torch.compile (frames compiled and their backward graphs); 0.0 when
    nothing was compiled."""
    utils = sys.modules.get("torch._dynamo.utils")
    timers = getattr(utils, "compilation_time_metrics", None) or {}
    return float(sum(sum(timers.get(name, ())) for name in COMPILE_TIMERS))


__all__ = ["compile_dynamic", "compile_seconds_so_far", "compiles_so_far", "inductor_options",
           "persistent_compile_cache", "specialize_floats", "without_duck_sizing"]
