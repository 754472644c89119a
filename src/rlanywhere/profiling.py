"""`trainer.profile_steps`: a torch.profiler trace of chosen training steps, and a table of where the time went.

verl's key, our profiler: for every step listed (1-based, as the step numbers in metrics.jsonl), the whole step
runs under `torch.profiler.profile` (CPU and, on a GPU, CUDA activity). Each phase of the step (rollout,
update_actor, ...) is a named range in the trace (stepmetrics.PhaseTimer). Written to `<run dir>/profile/`:

    step_<N>.trace.json   open in https://ui.perfetto.dev or chrome://tracing
    step_<N>.txt          the top operators by self device time (self CPU time on a CPU), one table

Profiling slows the step it covers (CUDA graphs replay as one range; kernel launches are recorded): read the
table for shares, take the step times from the steps that were not profiled. [distributed] every rank writes its
own files (`step_<N>.rank<R>.*`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Optional

import torch


def profile_step_set(value) -> frozenset[int]:
    """trainer.profile_steps as a set of step numbers (None or [] -> empty)."""
    if value is None:
        return frozenset()
    if isinstance(value, str):  # "3" or "[3,5]" from a command line
        value = [part.strip() for part in value.strip().strip("[]").split(",") if part.strip()]
    steps = [value] if isinstance(value, int) else list(value)
    steps = [int(s) if isinstance(s, str) and s.isdigit() else s for s in steps]
    bad = [s for s in steps if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    if bad:
        raise ValueError(f"trainer.profile_steps must list step numbers >= 1 (as in metrics.jsonl), got {bad}; "
                         "e.g. trainer.profile_steps=[3]")
    return frozenset(steps)


@contextlib.contextmanager
def maybe_profile(step: int, steps: Iterable[int], run_dir: str, device: str, rank: Optional[int] = None):
    """Profile the block when `step` is one of `steps`; write the trace and the table to run_dir/profile/."""
    if step not in steps:
        yield
        return
    on_gpu = device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=False) as prof:
        yield
    if on_gpu:
        torch.cuda.synchronize()
    out = os.path.join(run_dir, "profile")
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"step_{step}" + (f".rank{rank}" if rank is not None else ""))
    prof.export_chrome_trace(stem + ".trace.json")
    sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    with open(stem + ".txt", "w") as handle:
        handle.write(prof.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=90))
