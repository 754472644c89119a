"""What a training step spent getting ready instead of computing: torch.compile and decode CUDA-graph capture.

A run's first steps compile the training passes and the decode step's kernels and capture a CUDA graph per decode
batch size and attention span; later steps reuse them. `WarmupClock` reads the process's running totals at a step's
start and reports what the step added, as the step's `perf/compile_s` and `perf/graph_capture_s` metrics: a slow
first step says where its seconds went, and a step that compiled again mid-run shows it.
"""

from __future__ import annotations

from .compiling import compile_seconds_so_far
from .rollout.runner import graph_capture_seconds_so_far


def warmup_seconds() -> dict[str, float]:
    """The process's running totals: seconds compiling and seconds capturing decode graphs."""
    return {"perf/compile_s": compile_seconds_so_far(), "perf/graph_capture_s": graph_capture_seconds_so_far()}


class WarmupClock:
    """Started at a step's beginning; `metrics()` gives what the step has added to each total since."""

    def __init__(self) -> None:
        self.start = warmup_seconds()

    def metrics(self) -> dict[str, float]:
        now = warmup_seconds()
        return {key: max(now[key] - self.start[key], 0.0) for key in now}


__all__ = ["WarmupClock", "warmup_seconds"]
