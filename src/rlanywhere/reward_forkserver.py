"""The reward workers' server process (multiprocessing's "forkserver"), in a process group of its own.

The reward pool's workers are forked by one server process that the trainer starts the first time it needs them.
Started as a plain child, that server would share the trainer's process group, and a signal sent to the whole group
would reach it: torchrun stops a rank with ``killpg(SIGTERM)``, a closed terminal sends SIGHUP to its foreground
group, Ctrl-C sends SIGINT. The trainer catches those signals to save a checkpoint; the server would die of them.
The pool then takes every worker for dead (it hears of them through the server), starts new ones from a server
that is gone while the trainer saves (a ConnectionRefusedError in its maintenance thread, which ends that thread),
and its shutdown waits forever for workers it no longer tracks.

:func:`start_server` starts the server with those signals blocked, and this module, the first one the server
imports, moves the server into a process group of its own and drops any of those signals that came meanwhile.
The server still ends with the trainer: multiprocessing closes its pipe when the trainer and every worker are
gone. The workers lead process groups of their own too (``rewards._init_worker``).
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import select
import signal
import sys

# the signals a launcher, a terminal or a scheduler sends to a trainer's whole process group
GROUP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def start_server(context) -> None:
    """Start the forkserver of `context` (once per process) out of reach of signals sent to this process's group.

    The server imports this module first (it leaves the group then), then `rlanywhere.rewards` once for every
    worker (without torch: the server is up in about 0.1 s). The signals are blocked in this thread only while the
    server process is created: the mask is inherited through its exec, so none of them can end it before it leaves
    the group. A server already running (started earlier by other code) is kept as it is."""
    context.set_forkserver_preload([__name__, "rlanywhere.rewards"])
    multiprocessing.resource_tracker.ensure_running()  # the server's helper, started as usual, outside the mask
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _imported_by_the_forkserver() -> bool:
    """Whether this import runs inside multiprocessing's forkserver main loop (its preload), not in a user process."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


def _leave_the_trainers_group() -> None:
    """In the server: a process group of its own, then the signals it was started with blocked taken as before."""
    try:
        os.setpgid(0, 0)
    except OSError:  # cannot happen for a fresh child; were it to, the server works as before
        pass
    for sig in GROUP_SIGNALS:
        handler = signal.signal(sig, signal.SIG_IGN)  # ignoring a blocked signal drops one already pending
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        signal.signal(sig, handler)


def end_with_the_server() -> None:
    """In a worker forked by the server: be killed when the server ends. The server ends soon after its trainer
    does (when its pipe from the trainer closes, a few milliseconds later), so a trainer that dies (SIGKILL, the OOM
    killer) takes its workers with it; for those milliseconds the worker also watches the trainer itself, and ends
    silently at its first write after the trainer is gone, so that none prints a BrokenPipeError traceback for a
    result nobody reads any more. Linux only (prctl, pidfd); elsewhere, and in a worker the trainer forked itself,
    nothing changes."""
    if not IN_SERVER or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the parent is the server
    except (OSError, AttributeError):  # no prctl: the worker ends as before, when its next read finds no trainer
        return
    if os.getppid() == 1:  # the server was already gone before the signal was armed
        os._exit(0)
    try:  # the server outlives its trainer by the milliseconds its shutdown takes: watch the trainer itself too
        sys.stderr = _QuietOnceTheTrainerIsGone(sys.stderr, os.pidfd_open(TRAINER_PID))
    except (AttributeError, OSError, TypeError):  # no pidfd (an old kernel): the signal above is what there is
        pass


class _QuietOnceTheTrainerIsGone:
    """A worker's stderr that ends the worker, silently, at the first write after its trainer is gone: a result
    sent to a dead trainer raises BrokenPipeError, whose traceback would follow the one line the launcher prints
    about the rank that died."""

    def __init__(self, stream, trainer_pidfd: int):
        self._stream, self._trainer_pidfd = stream, trainer_pidfd

    def write(self, text: str) -> int:
        if select.select([self._trainer_pidfd], [], [], 0)[0]:  # readable: the trainer process has exited
            os._exit(0)
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


IN_SERVER = _imported_by_the_forkserver()  # True in the server, and in the workers it forks
TRAINER_PID = os.getppid() if IN_SERVER else None  # the server's parent: the trainer that started it
if IN_SERVER:
    _leave_the_trainers_group()
