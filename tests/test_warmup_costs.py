"""A step's compile and graph-capture seconds (warmup_costs.py): what the step added to the process's totals."""

from __future__ import annotations

import torch

from rlanywhere import compiling, warmup_costs
from rlanywhere.rollout import runner


def test_compile_seconds_count_a_compile_and_its_backward():
    before = compiling.compile_seconds_so_far()
    frames = compiling.compiles_so_far()
    fn = compiling.compile_dynamic(lambda x: (x.sin() * 2.0).sum(), backend="eager")
    x = torch.randn(5, requires_grad=True)
    fn(x).backward()
    assert compiling.compiles_so_far() == frames + 1
    assert compiling.compile_seconds_so_far() > before
    after = compiling.compile_seconds_so_far()
    fn(torch.randn(5, requires_grad=True)).backward()  # compiled already: no time added
    assert compiling.compile_seconds_so_far() == after


def test_clock_reports_what_the_step_added(monkeypatch):
    totals = {"compile": 3.0, "capture": 1.0}
    monkeypatch.setattr(warmup_costs, "compile_seconds_so_far", lambda: totals["compile"])
    monkeypatch.setattr(warmup_costs, "graph_capture_seconds_so_far", lambda: totals["capture"])
    clock = warmup_costs.WarmupClock()
    assert clock.metrics() == {"perf/compile_s": 0.0, "perf/graph_capture_s": 0.0}
    totals["compile"] += 2.5
    totals["capture"] += 0.25
    assert clock.metrics() == {"perf/compile_s": 2.5, "perf/graph_capture_s": 0.25}


def test_capture_total_is_the_runner_module_counter():
    assert runner.graph_capture_seconds_so_far() == runner._CAPTURE_SECONDS[0]
