"""`trainer.profile_steps`: a torch.profiler trace of chosen training steps, and a table of where the time went.

verl's key, our profiler: for every step listed (1-based, as the step numbers in metrics.jsonl), the whole step
runs under `torch.profiler.profile` (CPU and, on a GPU, CUDA activity). Each phase of the step (rollout,
update_actor, ...) is a named range in the trace (stepmetrics.PhaseTimer). Written to `<run dir>/profile/`:

    step_<N>.trace.json   open in https://ui.perfetto.dev or chrome://tracing
    step_<N>.txt          per phase: wall time and how much of it the GPU was busy (a phase far below 100 % is
                          waiting on the CPU: Python, kernel launches, host syncs); then the top operators by self
                          device time (self CPU time on a CPU)

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
    """trainer.profile_steps (an int, a list or ListConfig, or a "[3,5]" string) as a set of step numbers (None or
    [] -> empty)."""
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
        handle.write(phase_table(prof.events()) + "\n\n")
        handle.write(prof.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=90))


def covered_time(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of `intervals` (start, end) inside [start, end]: overlapping kernels count once."""
    total, run_start, run_end = 0.0, None, None
    for lo, hi in sorted((max(lo, start), min(hi, end)) for lo, hi in intervals):
        if hi <= lo:
            continue
        if run_end is None or lo > run_end:
            total += (run_end - run_start) if run_end is not None else 0.0
            run_start, run_end = lo, hi
        else:
            run_end = max(run_end, hi)
    return total + ((run_end - run_start) if run_end is not None else 0.0)


def phase_table(events) -> str:
    """One line per phase of the profiled step: wall ms, device-busy ms and their ratio (torch.profiler events:
    CPU-side `phase/<name>` ranges, device-side kernels and copies on the same clock)."""
    from torch.autograd import DeviceType

    phases = [(e.name[len("phase/"):], e.time_range.start, e.time_range.end) for e in events
              if e.device_type == DeviceType.CPU and e.name.startswith("phase/")]
    device = [(e.time_range.start, e.time_range.end) for e in events
              if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    lines = [f"{'phase':<16} {'wall ms':>10} {'device busy ms':>15} {'busy':>6}"]
    for name, start, end in phases:
        wall = (end - start) / 1000
        if not device:
            lines.append(f"{name:<16} {wall:>10.1f} {'-':>15} {'-':>6}")
            continue
        busy = covered_time(device, start, end) / 1000
        lines.append(f"{name:<16} {wall:>10.1f} {busy:>15.1f} {busy / max(wall, 1e-9):>6.0%}")
    if not device:
        lines.append("(no device activity recorded: a CPU run)")
    return "\n".join(lines)
