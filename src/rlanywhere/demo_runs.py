"""The demo's run folders: which one `latest` names, which one `rlanywhere demo --resume` continues, and what a
demo that saved nothing leaves behind (nothing).

Each `rlanywhere demo` gets a timestamped folder under runs/demo/. `runs/demo/latest` points at the newest demo
that saved its final model, so `rlanywhere chat --model runs/demo/latest/final_model` always names a model; a demo
that stopped before saving anything (a bad input, a crash, Ctrl-C before the first step) removes its folder; one
stopped after saving a checkpoint is *unfinished* and `rlanywhere demo --resume` continues the newest such run.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Optional

from .checkpoint_dirs import list_checkpoints
from .errors import UserError

DEMO_DATA_DIR = "data/arith"


def demo_data_dir(on_gpu: bool) -> str:
    """Where the demo's arithmetic task is written: 2-digit additions on a GPU, 1-digit on a CPU."""
    return DEMO_DATA_DIR if on_gpu else f"{DEMO_DATA_DIR}-1digit"

log = logging.getLogger(__name__)

LATEST = "latest"
FINAL_MODEL = "final_model"
RESUME_COMMAND = "rlanywhere demo --resume"


def has_final_model(run_dir: str) -> bool:
    return os.path.isfile(os.path.join(run_dir, FINAL_MODEL, "config.json"))


def saved_anything(run_dir: str) -> bool:
    """A final model or a complete checkpoint: something worth keeping the folder for."""
    return has_final_model(run_dir) or bool(list_checkpoints(run_dir))


def unfinished_runs(demo_root: str) -> list[str]:
    """Run folders under `demo_root` with a checkpoint and no final model, oldest first (by their last checkpoint)."""
    if not os.path.isdir(demo_root):
        return []
    found = []
    for name in os.listdir(demo_root):
        run_dir = os.path.join(demo_root, name)
        if name == LATEST or os.path.islink(run_dir) or not os.path.isdir(run_dir) or has_final_model(run_dir):
            continue
        checkpoints = list_checkpoints(run_dir)
        if checkpoints:
            found.append((os.path.getmtime(checkpoints[-1]), run_dir))
    return [run_dir for _, run_dir in sorted(found)]


def run_to_resume(demo_root: str) -> str:
    """The newest unfinished demo under `demo_root`, or a UserError saying there is none and what to run."""
    runs = unfinished_runs(demo_root)
    if not runs:
        raise UserError(f"no unfinished demo in {demo_root} (none has a checkpoint without a final model); "
                        "`rlanywhere demo` starts a new one")
    return runs[-1]


def point_latest_at(run_dir: str) -> bool:
    """RUN_DIR's parent/latest -> RUN_DIR, only when RUN_DIR holds a final model. True when it moved."""
    if not has_final_model(run_dir):
        return False
    link = os.path.join(os.path.dirname(run_dir), LATEST)
    try:
        if os.path.islink(link):
            os.remove(link)
        if not os.path.exists(link):
            os.symlink(os.path.basename(run_dir), link)
            return True
    except OSError as exc:  # a file system without symlinks: the printed paths still work
        log.debug("could not point %s at %s: %s", link, run_dir, exc)
    return False


def finish(run_dir: str, created: bool) -> None:
    """After a demo ends, however it ended: point `latest` at it when it saved its final model; remove its folder
    when this launch `created` it and nothing was saved in it (config, plan and logs alone are not a run)."""
    if point_latest_at(run_dir):
        return
    if created and os.path.isdir(run_dir) and not saved_anything(run_dir):
        shutil.rmtree(run_dir, ignore_errors=True)
        log.info("demo: removed %s (nothing was saved there)", run_dir)


def experiment_name_of(run_dir: str, overrides: list[str]) -> list[str]:
    """[trainer.experiment_name=<the name RUN_DIR was started with>] when continuing it and the overrides do not name
    one: a resumed demo is then the same config, not a renamed one."""
    if any(item.lstrip("+").startswith("trainer.experiment_name=") for item in overrides):
        return []
    try:
        from omegaconf import OmegaConf

        name = OmegaConf.select(OmegaConf.load(os.path.join(run_dir, "config.yaml")), "trainer.experiment_name")
    except (OSError, ValueError, TypeError) as exc:
        log.debug("no saved config in %s: %s", run_dir, exc)
        return []
    return [f"trainer.experiment_name={name}"] if name else []


def start_line(run_dir: str) -> str:
    """What `rlanywhere demo` says before it plans: a new run, or the one it continues and from where."""
    checkpoints = list_checkpoints(run_dir)
    if checkpoints:
        return f"demo: continuing {run_dir} from {os.path.basename(checkpoints[-1])}"
    return f"demo: a new run in {run_dir} (an unfinished one continues with `{RESUME_COMMAND}`)"
