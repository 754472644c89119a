"""Experiment tracking: one place the trainer sends its per-step metrics.

:class:`Tracker` always appends ``{"step": step, **metrics}`` lines to ``RUN_DIR/metrics.jsonl`` (the file
``rlanywhere plot`` reads) and, as ``trainer.logger`` asks, shows a console progress bar with a one-line summary per
step, writes TensorBoard events to ``RUN_DIR/tensorboard`` and logs to Weights & Biases. A resumed run
(``resume_step=k``) drops the lines after step ``k`` so the file never holds a step twice.
"""

from __future__ import annotations

import ast
import difflib
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
KNOWN_LOGGERS = ("console", "tensorboard", "wandb", "jsonl")
# Shown in the one-line console summary, in this order, when present.
SUMMARY_KEYS = (
    "reward/mean",
    "reward/acc",
    "reward/errors",
    "val/acc",
    "actor/kl",
    "actor/entropy",
    "actor/pg_loss",
    "critic/vf_loss",
    "response_length/mean",
    "perf/tokens_per_s",
    "perf/peak_memory_gib",
    "perf/step_time_s",
)
STEP_TIME_KEY = "perf/step_time_s"  # the step's own seconds (the bar's rate also counts validation and saving)


def logger_names(loggers: str | Sequence[str] | None) -> list[str]:
    """``trainer.logger`` as lower-case names, each once: ``"console"``, ``"console,wandb"``,
    ``"['console','wandb']"``, ``"[console,wandb]"`` or a list."""
    if loggers is None:
        return []
    if isinstance(loggers, str):
        text = loggers.strip()
        if text.startswith("[") and text.endswith("]"):
            try:
                names = list(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                names = text[1:-1].split(",")  # unquoted form: [console,wandb]
        else:
            names = text.split(",")
    else:
        names = list(loggers)
    names = [str(name).strip().strip("'\"").lower() for name in names]
    return list(dict.fromkeys(name for name in names if name))


def unknown_logger_problem(name: str) -> str:
    """What to say of a trainer.logger entry that is no logger here, with the closest one."""
    close = difflib.get_close_matches(name, KNOWN_LOGGERS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"Unknown trainer.logger entry {name!r}; choose from {list(KNOWN_LOGGERS)}.{hint}"


def parse_loggers(loggers: str | Sequence[str] | None) -> list[str]:
    """``trainer.logger`` as a list of the loggers here (`logger_names`); ValueError for one that is not."""
    names = logger_names(loggers)
    for name in names:
        if name not in KNOWN_LOGGERS:
            raise ValueError(unknown_logger_problem(name))
    return names


def _to_float(value: Any) -> float | None:
    """A scalar metric as float (tensors, numpy scalars, bools); None when it is not a number."""
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return None
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _format_number(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4g}"


def _truncate_metrics_file(path: Path, resume_step: int) -> int:
    """Keep only well-formed lines with ``step <= resume_step``; returns how many lines were dropped."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = int(record["step"]) <= resume_step
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            keep = False  # a half-written line from a crash
        if keep:
            kept.append(line)
        else:
            dropped += 1
    tmp = path.with_suffix(".jsonl.tmp")
    try:
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:  # a full disk: the original stays as it was, no .tmp left behind
        tmp.unlink(missing_ok=True)
        from .errors import UserError

        free = shutil.disk_usage(path.parent).free // 1024
        raise UserError(f"could not rewrite {path} to resume at step {resume_step}: "
                        f"{(exc.strerror or str(exc)).lower()} ({free} KiB free); free space and run the same "
                        "command again") from None
    return dropped


class Tracker:
    """Sends per-step metrics to metrics.jsonl and to the loggers named in ``trainer.logger``."""

    def __init__(
        self,
        run_dir: str | Path,
        loggers: str | Sequence[str] | None = ("console",),
        project_name: str = "rlanywhere",
        experiment_name: str = "run",
        config: dict[str, Any] | None = None,
        total_steps: int | None = None,
        resume_step: int | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = parse_loggers(loggers)
        self.total_steps = total_steps
        self.resume_step = resume_step
        self.metrics_path = self.run_dir / METRICS_FILE

        if resume_step is None:
            if self.metrics_path.exists() and self.metrics_path.stat().st_size > 0:
                logger.info("starting a fresh run: replacing %s", self.metrics_path)
            self.metrics_path.write_text("", encoding="utf-8")
            # an earlier run's validation responses and curves would read as this run's
            for stale in [*self.run_dir.glob("val_generations/step_*.jsonl"), *self.run_dir.glob("plots/*.png")]:
                stale.unlink()
        else:
            dropped = _truncate_metrics_file(self.metrics_path, resume_step)
            if dropped:
                logger.info("resuming at step %d: dropped %d later lines of %s", resume_step, dropped, self.metrics_path)
        self._metrics_file = self.metrics_path.open("a", encoding="utf-8")

        self._last_log_time = time.perf_counter()
        self._last_step: int | None = resume_step
        self._postfix: dict[str, str] = {}
        self._progress = None
        if "console" in self.loggers:
            self._progress = tqdm(
                total=total_steps,
                initial=resume_step or 0,
                desc=experiment_name,
                unit="step",
                dynamic_ncols=True,
            )

        self._tensorboard = None
        if "tensorboard" in self.loggers:
            self._tensorboard = self._open_tensorboard(config, resume_step)

        self._wandb = None
        if "wandb" in self.loggers:
            self._wandb = self._open_wandb(project_name, experiment_name, config)

    def _open_tensorboard(self, config, resume_step):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.warning("TensorBoard logging skipped: `pip install tensorboard` to enable it.")
            return None
        # purge_step discards events a crashed run wrote after the checkpoint we resume from; a fresh run starts
        # without the event files of one that ran here before (as metrics.jsonl starts empty)
        log_dir = self.run_dir / "tensorboard"
        purge_step = resume_step + 1 if resume_step is not None else None
        if resume_step is None and log_dir.is_dir():
            for old in log_dir.glob("events.out.tfevents.*"):
                old.unlink()
        writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        if config:
            writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)
        return writer

    def _open_wandb(self, project_name, experiment_name, config):
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "trainer.logger includes 'wandb' but wandb is not installed: `pip install wandb`, "
                "or drop 'wandb' from trainer.logger."
            ) from None
        return wandb.init(project=project_name, name=experiment_name, config=config or {}, dir=str(self.run_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record ``metrics`` for ``step`` in every enabled sink."""
        # Wall time per step, measured between logs that advance the step (extra logs at one step don't count).
        step_seconds = None
        if self._last_step is None or step > self._last_step:
            now = time.perf_counter()
            if self._last_step is not None:
                step_seconds = (now - self._last_log_time) / (step - self._last_step)
            self._last_step, self._last_log_time = int(step), now
        scalars = {}
        for key, value in metrics.items():
            number = _to_float(value)
            if number is None:
                logger.debug("metric %s=%r is not a number; only scalars are tracked", key, value)
                continue
            scalars[key] = number

        # standard JSON: a non-finite value (a NaN loss before the guard stops the run) is written as null
        record = {key: value if math.isfinite(value) else None for key, value in scalars.items()}
        self._metrics_file.write(json.dumps({"step": int(step), **record}, allow_nan=False) + "\n")
        self._metrics_file.flush()

        if self._progress is not None:
            self._update_console(scalars, int(step), step_seconds)
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, int(step))
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))

    def _update_console(self, scalars: dict[str, float], step: int, step_seconds: float | None) -> None:
        if step > self._progress.n:
            self._progress.update(step - self._progress.n)
        # The postfix remembers earlier values so a validation-only log at the same step keeps the reward shown.
        if "reward/mean" in scalars:
            self._postfix["reward"] = _format_number(scalars["reward/mean"])
        if "reward/acc" in scalars:
            self._postfix["acc"] = _format_number(scalars["reward/acc"])
        if "val/acc" in scalars:
            self._postfix["val_acc"] = _format_number(scalars["val/acc"])
        step_time = scalars.get(STEP_TIME_KEY, step_seconds)
        if step_time is not None:
            self._postfix["s/step"] = f"{step_time:.2f}"
        self._progress.set_postfix(self._postfix, refresh=True)
        total = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"step {step}{total}"]
        parts += [f"{key} {_format_number(scalars[key])}" for key in SUMMARY_KEYS if key in scalars]
        tqdm.write(" | ".join(parts))

    def close(self) -> None:
        if self._metrics_file is not None and not self._metrics_file.closed:
            self._metrics_file.close()
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (``run_dir`` may also be the file itself), skipping broken lines."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"No metrics file at {path}: pass the directory of a training run (the one holding metrics.jsonl)."
        )
    records = []
    for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            logger.warning("skipping unreadable line %d of %s", line_number, path)
    return records

