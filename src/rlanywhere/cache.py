"""rlanywhere's cache folder: downloaded models, compiled kernels and the kernel probe's findings.

`~/.cache/rlanywhere`, or `$RLANYWHERE_CACHE` when set. A leaf module (standard library only) so that every module
can find the folder without importing the ones that fill it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("RLANYWHERE_CACHE", Path.home() / ".cache" / "rlanywhere"))


__all__ = ["cache_dir"]
