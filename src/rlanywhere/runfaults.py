"""Faults around a run that are not about training itself: the console going away, the run folder going away,
a run name that would leave the runs folder.

- `guard_output_streams()`: stdout and stderr that survive their reader going away. Under
  `rlanywhere train ... 2>&1 | tee log`, Ctrl-C ends `tee` too, and the next progress-bar or log write would raise
  BrokenPipeError in the middle of saving (a closed terminal: EIO). Once a write finds its reader gone, the
  stream's file descriptor is pointed at /dev/null and the run goes on to save and exit as it would have.
- `check_run_names(cfg)`: trainer.project_name / trainer.experiment_name that climb out of the runs folder
  (`../../x`, an absolute path) are refused before anything loads.
- `RunDirWatch`: the run folder deleted (or replaced) while the run goes is noticed after the step and stops the
  run with one line, instead of training on with its metrics and checkpoints lost.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import sys
from typing import Optional

from .errors import UserError


class PipeSafeStream(io.TextIOBase):
    """A text stream whose writes never raise for a closed pipe: the first BrokenPipeError points its file
    descriptor at /dev/null (so C-level writes and the interpreter's final flush stay quiet too)."""

    def __init__(self, stream):
        super().__init__()
        self._stream = stream
        self.broken = False

    def _drop(self) -> None:
        self.broken = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, io.UnsupportedOperation):
            pass

    def write(self, text: str) -> int:
        if self.broken:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as exc:
            if not _reader_gone(exc):
                raise
            self._drop()
            return len(text)

    def flush(self) -> None:
        if self.broken:
            return
        try:
            self._stream.flush()
        except OSError as exc:
            if not _reader_gone(exc):
                raise
            self._drop()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self):  # noqa: D401 - mirrors the wrapped stream
        return getattr(self._stream, "encoding", "utf-8")

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _reader_gone(exc: OSError) -> bool:
    """A pipe whose reader exited (EPIPE), or a terminal that was closed (EIO)."""
    return isinstance(exc, BrokenPipeError) or exc.errno in (errno.EPIPE, errno.EIO)


def guard_output_streams() -> None:
    """Wrap sys.stdout and sys.stderr (once) so a reader that went away never stops the run mid-save."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, PipeSafeStream) and hasattr(stream, "fileno"):
            try:
                mode = os.fstat(stream.fileno()).st_mode
            except (OSError, ValueError, io.UnsupportedOperation):
                continue  # a stream without a descriptor (captured by a test harness): left alone
            # only a pipe's reader or a terminal can go away
            if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stream.isatty():
                setattr(sys, name, PipeSafeStream(stream))


def check_run_names(cfg) -> None:
    """Refuse run names that make the run folder escape the runs folder (`..` parts, absolute paths)."""
    for key in ("project_name", "experiment_name"):
        name = str(cfg.trainer.get(key, "") or "")
        parts = name.replace("\\", "/").split("/")
        if os.path.isabs(name) or ".." in parts:
            raise UserError(f"trainer.{key}={name!r} leaves the runs folder; use a plain name (letters, digits, "
                            "-_.), or set trainer.default_local_dir to choose the run folder itself")


class RunDirWatch:
    """Notices the run folder deleted or replaced while the run goes (compared by device and inode)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.identity = self._identity()

    def _identity(self) -> Optional[tuple[int, int]]:
        try:
            stat = os.stat(self.run_dir)
        except OSError:
            return None
        return stat.st_dev, stat.st_ino

    def check(self, step: int) -> None:
        if self.identity is not None and self._identity() != self.identity:
            raise UserError(f"the run folder {os.path.abspath(self.run_dir)} was deleted or replaced during step "
                            f"{step}: its metrics and checkpoints are gone with it, so the run stopped. Start it "
                            "again (a new run), or keep the folder in place while a run uses it")
