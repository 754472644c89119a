"""Where the GPU waited in a profiled training step: idle time per phase, grouped by what the CPU was running.

Reads a chrome trace written by `trainer.profile_steps` (`<run dir>/profile/step_<N>.trace.json`). For every phase
range (phase/rollout, phase/update_actor, ...) it prints the wall time, the GPU's idle time and how many gaps it
came in, then the largest idle totals by the CPU operators open at each gap's middle (a few large gaps: host waits;
tens of thousands of tiny ones: kernels launched one by one).

    python bench/trace_gaps.py runs/NAME/profile/step_4.trace.json [--top 12] [--min-gap-us 20]

With --streams it prints, per phase, each CUDA stream's kernels instead: how many, how long the stream was busy (its
kernels' union), and how long it sat idle between its first and last kernel. Two phases overlapped on two streams
(`trainer.async.mode=one_step_off`) tell there what slowed them: a stream busy longer than in a step where it ran
alone waited for the card (its kernels got fewer SMs, less bandwidth); one idle longer waited for its host thread
(the Python that launches its kernels, which the two threads share through the GIL).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATEGORIES = ("cpu_op", "cuda_runtime", "python_function", "user_annotation")


def idle_gaps(gpu: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    """Intervals of [start, end] covered by no GPU activity (gpu sorted by start)."""
    gaps, last = [], start
    for s, e in gpu:
        if e <= start or s >= end:
            continue
        s, e = max(s, start), min(e, end)
        if s > last:
            gaps.append((last, s))
        last = max(last, e)
    if end > last:
        gaps.append((last, end))
    return gaps


def stream_table(events: list[dict], window: tuple[float, float]) -> list[dict]:
    """Per CUDA stream, its kernels inside `window` (start, end in trace microseconds): count, busy time (their
    union), the span from the first kernel's start to the last one's end, and the idle time inside that span."""
    by_stream: dict = collections.defaultdict(list)
    start, end = window
    for e in events:
        if e.get("cat") == "kernel" and e["ts"] < end and e["ts"] + e["dur"] > start:
            by_stream[e.get("args", {}).get("stream", "?")].append((max(e["ts"], start), min(e["ts"] + e["dur"], end)))
    rows = []
    for stream, spans in sorted(by_stream.items(), key=lambda item: -len(item[1])):
        spans.sort()
        first, last = spans[0][0], max(b for _, b in spans)
        idle = sum(b - a for a, b in idle_gaps(spans, first, last))
        rows.append({"stream": stream, "kernels": len(spans), "busy_ms": (last - first - idle) / 1e3,
                     "span_ms": (last - first) / 1e3, "idle_ms": idle / 1e3})
    return rows


def phase_ranges(events: list[dict]) -> list[tuple[float, float, str]]:
    """(start, end, name) of every `phase/...` range in the trace, in order."""
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("cat") == "user_annotation" and e["name"].startswith("phase/"))


def stream_lines(events: list[dict], window: tuple[float, float]) -> list[str]:
    """stream_table as printed lines, one per stream."""
    return [f"  stream {row['stream']!s:>4}: {row['kernels']:6d} kernels, busy {row['busy_ms']:8.1f} ms, "
            f"idle {row['idle_ms']:7.1f} ms between its first and last kernel" for row in stream_table(events, window)]


def print_streams(events: list[dict]) -> None:
    for start, end, name in phase_ranges(events):
        print(f"{name}: wall {(end - start) / 1e3:.1f} ms")
        print("\n".join(stream_lines(events, (start, end))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--min-gap-us", type=float, default=20.0, help="shorter gaps count in the total only")
    parser.add_argument("--streams", action="store_true", help="per phase, each CUDA stream's busy and idle time")
    args = parser.parse_args()
    with open(args.trace) as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    if args.streams:
        print_streams(events)
        return
    gpu = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES)
    cpu = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in CPU_CATEGORIES)
    cpu_starts = [c[0] for c in cpu]
    phases = phase_ranges(events)
    if not gpu:
        raise SystemExit(f"{args.trace} has no GPU activity (a CPU run): nothing to attribute")
    for start, end, name in phases:
        gaps = idle_gaps(gpu, start, end)
        idle = sum(b - a for a, b in gaps)
        print(f"{name}: wall {(end - start) / 1e3:.1f} ms, GPU idle {idle / 1e3:.1f} ms in {len(gaps)} gaps")
        total, count = collections.Counter(), collections.Counter()
        for a, b in gaps:
            if b - a < args.min_gap_us:
                continue
            middle = (a + b) / 2
            i = bisect.bisect_right(cpu_starts, middle)
            open_ops = [c for c in cpu[max(0, i - 4000):i] if c[1] >= middle]  # started before, still running
            key = " > ".join(c[2][:40] for c in open_ops[-3:]) if open_ops else "(no CPU operator)"
            total[key] += b - a
            count[key] += 1
        for key, us in total.most_common(args.top):
            print(f"  {us / 1e3:8.1f} ms {count[key]:6d} gaps  {key}")


if __name__ == "__main__":
    main()
