"""PNG training curves from a run's metrics.jsonl (`rlanywhere plot RUN_DIR`).

One PNG per family of metrics (reward, validation, KL, entropy, losses, response length, throughput, timing,
memory), one panel per metric, drawn only for metrics the run actually logged and that change over the run (a constant
carries no information: a KL of 0 without a KL term, the validation sample count). Uses matplotlib's Agg canvas directly
so it never touches the user's pyplot backend and works without a display.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlanywhere.errors import UserError
from rlanywhere.tracking import METRICS_FILE, read_metrics


class PlotError(UserError, ValueError):
    """A run directory with nothing to plot yet."""


logger = logging.getLogger(__name__)

# (file stem, title, exact keys, key prefixes). A family's panels are its exact keys, then keys with its prefixes.
PLOT_FAMILIES: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("reward", "Reward", ("reward/mean", "reward/acc", "reward/format"), ()),
    ("reward_model", "Reward model", ("reward_model/score_mean", "reward_model/parse_failures"), ()),
    ("validation", "Validation", (), ("val/",)),
    ("kl", "KL divergence", ("actor/kl", "actor/kl_loss", "actor/reward_kl_penalty", "actor/approx_kl"), ()),
    ("entropy", "Policy entropy", ("actor/entropy",), ()),
    ("losses", "Losses", ("actor/pg_loss", "critic/vf_loss", "actor/pg_clipfrac"), ()),
    ("response_length", "Response length", ("response_length/mean", "response_length/max"), ()),
    ("throughput", "Throughput", ("perf/tokens_per_s",), ()),
    ("timing", "Time per phase (s)", (), ("timing/",)),
    ("memory", "Peak memory", ("perf/peak_memory_gib",), ()),
    ("multi_turn", "Multi-turn tool use", (), ("multi_turn/",)),
)
BAND_KEYS = {"reward/mean": "reward/std", "reward_model/score_mean": "reward_model/score_std"}  # drawn as a +-1 std band around the curve


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the finite numeric values logged for ``key``."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        steps.append(float(record["step"]))
        values.append(float(value))
    return steps, values


def carries_information(values: list[float]) -> bool:
    """A panel is worth drawing when its curve moves: a constant (val/num_samples, a KL of 0 in a run without a KL
    term, reward/errors that stayed 0) says nothing a reader can use. A single point is kept (a one-step run)."""
    return len(values) == 1 or (len(values) > 1 and max(values) != min(values))


def _family_keys(records, present: list[str], exact: tuple[str, ...], prefixes: tuple[str, ...]) -> list[str]:
    keys = [key for key in exact if key in present]
    keys += sorted(key for key in present if key.startswith(prefixes) and key not in keys) if prefixes else []
    return [key for key in keys if carries_information(_series(records, key)[1])]


# Each panel is PANEL_INCHES; the margins are fixed in inches (room for the title, tick labels and "step"), which
# costs nothing where matplotlib's constrained layout solves for them on every figure (about a third of a run's
# plotting time)
PANEL_INCHES = (4.5, 3.2)
MARGIN_INCHES = {"left": 0.6, "right": 0.15, "bottom": 0.5, "top": 0.6}


def _plot_family(records, title: str, keys: list[str], path: Path) -> Path:
    columns = min(len(keys), 3)
    rows = math.ceil(len(keys) / columns)
    width, height = PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    margin = MARGIN_INCHES
    figure.subplots_adjust(left=margin["left"] / width, right=1 - margin["right"] / width,
                           bottom=margin["bottom"] / height, top=1 - margin["top"] / height, wspace=0.22,
                           hspace=0.45)
    figure.suptitle(title, y=1 - 0.15 / height, va="top")
    for panel, key in enumerate(keys, start=1):
        axes = figure.add_subplot(rows, columns, panel)
        steps, values = _series(records, key)
        marker = "o" if len(steps) < 30 else None  # sparse curves (validation) stay visible
        axes.plot(steps, values, marker=marker, markersize=3, linewidth=1.4)
        band_key = BAND_KEYS.get(key)
        if band_key:
            band = dict(zip(*_series(records, band_key)))
            pairs = [(s, v, band[s]) for s, v in zip(steps, values) if s in band]
            if pairs:
                axes.fill_between(
                    [s for s, _, _ in pairs],
                    [v - d for _, v, d in pairs],
                    [v + d for _, v, d in pairs],
                    alpha=0.2,
                    label=f"±{band_key}",
                )
                axes.legend(loc="best", fontsize="small")
        axes.set_title(key, fontsize="medium")
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers: no "2.5" ticks
        axes.grid(True, alpha=0.3)
    figure.savefig(path, dpi=110)
    return path


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write PNG curves for the run in ``run_dir`` to ``out_dir`` (default ``run_dir/plots``); returns their paths."""
    run_dir = Path(run_dir)
    records = [record for record in read_metrics(run_dir) if "step" in record]
    if not records:
        source = run_dir / METRICS_FILE if run_dir.is_dir() else run_dir
        raise PlotError(f"{source} has no metrics yet: train for at least one step before plotting.")
    out_dir = Path(out_dir) if out_dir is not None else (run_dir if run_dir.is_dir() else run_dir.parent) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)

    present = list(dict.fromkeys(key for record in records for key in record if key != "step"))
    written = []
    for stem, title, exact, prefixes in PLOT_FAMILIES:
        keys = _family_keys(records, present, exact, prefixes)
        if keys:
            written.append(_plot_family(records, title, keys, out_dir / f"{stem}.png"))
        else:  # a curve of an earlier file of this run dir is not this one's
            (out_dir / f"{stem}.png").unlink(missing_ok=True)
    if not written:
        logger.warning("none of the plotted metrics (reward/*, val/*, actor/*, ...) appear in %s", run_dir)
    return written
