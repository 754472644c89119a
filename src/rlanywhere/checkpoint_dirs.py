"""Where a run's checkpoints are and which of them are complete: folder names only, no torch.

The run lock, the demo's run list and the CLI's resume hints read these without loading torch (checkpoint.py, which
writes and loads checkpoints, imports it); checkpoint.py takes them from here.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Optional

LATEST_FILE = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"global_step_(\d+)")


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first (`.tmp` leftovers of a killed save and `.damaged` ones are ignored)."""
    paths = [p for p in glob.glob(os.path.join(checkpoint_root(run_dir), "global_step_*"))
             if STEP_DIR.fullmatch(os.path.basename(p)) and os.path.exists(os.path.join(p, "trainer_state.json"))]
    return sorted(paths, key=lambda p: int(p.rsplit("_", 1)[-1]))


def find_latest_checkpoint(run_dir: str) -> Optional[str]:
    marker = os.path.join(checkpoint_root(run_dir), LATEST_FILE)
    if os.path.exists(marker):
        with open(marker) as handle:
            path = os.path.join(checkpoint_root(run_dir), f"global_step_{handle.read().strip()}")
        if os.path.exists(os.path.join(path, "trainer_state.json")):
            return path
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


__all__ = ["LATEST_FILE", "STEP_DIR", "checkpoint_root", "find_latest_checkpoint", "list_checkpoints"]
