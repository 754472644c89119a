"""Tests for rlanywhere.tracking and rlanywhere.plotting."""

import importlib.util
import json
import sys

import pytest

from rlanywhere.plotting import _family_keys, carries_information, plot_run
from rlanywhere.tracking import Tracker, parse_loggers, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_parse_loggers_forms():
    assert parse_loggers("console") == ["console"]
    assert parse_loggers("['console','wandb']") == ["console", "wandb"]
    assert parse_loggers("[console, tensorboard]") == ["console", "tensorboard"]
    assert parse_loggers(["jsonl", "console", "console"]) == ["jsonl", "console"]
    with pytest.raises(ValueError, match="'tensorboard'"):
        parse_loggers("tensorbord")


def test_jsonl_lines_flushed_and_resume_truncates(tmp_path):
    tracker = Tracker(tmp_path, loggers=["jsonl"], total_steps=10)
    for step in range(1, 6):
        tracker.log({"reward/mean": step / 10, "actor/kl": 0.01 * step}, step=step)
        # flushed after every line: readable before close
        assert _lines(tmp_path)[-1] == {"step": step, "reward/mean": step / 10, "actor/kl": 0.01 * step}
    tracker.close()
    # simulate a crash mid-write: a half line at the end
    with open(tmp_path / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 6, "rew')

    resumed = Tracker(tmp_path, loggers="jsonl", total_steps=10, resume_step=3)
    assert [r["step"] for r in _lines(tmp_path)] == [1, 2, 3]
    resumed.log({"reward/mean": 0.9}, step=4)
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert read_metrics(tmp_path)[-1] == {"step": 4, "reward/mean": 0.9}

    fresh = Tracker(tmp_path, loggers=[], total_steps=10)  # a new run starts an empty file
    fresh.close()
    assert read_metrics(tmp_path) == []


def test_non_numeric_metrics_skipped_and_tensors_converted(tmp_path):
    import torch

    with Tracker(tmp_path, loggers=[]) as tracker:
        tracker.log({"a": torch.tensor(2.5), "b": "text", "c": True}, step=1)
    assert read_metrics(tmp_path) == [{"step": 1, "a": 2.5, "c": 1.0}]


def test_non_finite_values_are_written_as_null(tmp_path):
    import json

    with Tracker(tmp_path, loggers=[]) as tracker:
        tracker.log({"loss": float("nan"), "rate": float("inf"), "ok": 1.0}, step=1)
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    strict = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert strict == {"step": 1, "loss": None, "rate": None, "ok": 1.0}


def test_console_summary_line(tmp_path, capsys):
    with Tracker(tmp_path, loggers="console", experiment_name="exp", total_steps=4, resume_step=1) as tracker:
        assert tracker._progress.n == 1  # bar starts at the resume step
        tracker.log({"reward/mean": 0.25, "reward/acc": 0.5, "perf/step_time_s": 1.5}, step=2)
        assert tracker._progress.n == 2
    out = capsys.readouterr().out
    assert "step 2/4 | reward/mean 0.25 | reward/acc 0.5 | perf/step_time_s 1.5" in out


def test_wandb_missing_is_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        Tracker(tmp_path, loggers=["wandb"])


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard not installed")
def test_tensorboard_event_file_holds_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(tmp_path, loggers=["tensorboard"], config={"lr": 1e-6}) as tracker:
        tracker.log({"reward/mean": 0.5}, step=1)
        tracker.log({"reward/mean": 0.75}, step=2)
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents*"))
    assert event_files and event_files[0].stat().st_size > 0
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    events = accumulator.Scalars("reward/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.5), (2, 0.75)]


def test_plot_run_writes_pngs_for_present_keys(tmp_path):
    with Tracker(tmp_path, loggers=[]) as tracker:
        for step in range(1, 6):
            tracker.log(
                {
                    "reward/mean": 0.1 * step,
                    "reward/std": 0.05,
                    "actor/kl": 0.0,  # a run without a KL term: a flat line, no panel
                    "actor/pg_loss": -0.1 * step,
                    "critic/vf_loss": 0.3,
                    "response_length/mean": 100 + step,
                    "perf/tokens_per_s": 1000.0 + step,
                    "timing/gen": 1.0 + 0.1 * step,
                },
                step=step,
            )
            if step % 2 == 0:
                tracker.log({"val/acc": 0.2 * step, "val/num_samples": 32.0}, step=step)
    paths = plot_run(tmp_path)
    names = sorted(p.name for p in paths)
    assert names == sorted(
        ["reward.png", "validation.png", "losses.png", "response_length.png", "throughput.png", "timing.png"]
    )  # no entropy / memory: never logged; no kl: constant
    for path in paths:
        assert path.parent == tmp_path / "plots"
        content = path.read_bytes()
        assert content.startswith(PNG_SIGNATURE) and len(content) > 1000

    custom = plot_run(tmp_path, out_dir=tmp_path / "elsewhere")
    assert {p.name for p in custom} == set(names) and all(p.parent == tmp_path / "elsewhere" for p in custom)

    # a fresh run in the same folder: the earlier run's curves and validation responses go; a file with validation
    # only leaves no curve of the earlier file behind
    (tmp_path / "val_generations").mkdir()
    (tmp_path / "val_generations" / "step_4.jsonl").write_text("{}\n")
    with Tracker(tmp_path, loggers=[]) as tracker:
        assert not list((tmp_path / "plots").glob("*.png")) and not list((tmp_path / "val_generations").iterdir())
        tracker.log({"reward/mean": 0.5}, step=1)
    plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val/acc": 0.5}\n{"step": 2, "val/acc": 0.7}\n')
    assert [p.name for p in plot_run(tmp_path)] == ["validation.png"]
    assert [p.name for p in (tmp_path / "plots").glob("*.png")] == ["validation.png"]


def test_constant_panels_are_hidden():
    assert carries_information([0.5]) and carries_information([0.0, 0.1])
    assert not carries_information([]) and not carries_information([0.0, 0.0, 0.0])
    records = [{"step": s, "actor/pg_loss": -0.1 * s, "critic/vf_loss": 0.3} for s in (1, 2, 3)]
    assert _family_keys(records, ["actor/pg_loss", "critic/vf_loss"], ("actor/pg_loss", "critic/vf_loss"), ()) == [
        "actor/pg_loss"]


def test_plot_run_missing_or_empty_metrics(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics"):
        plot_run(tmp_path)
