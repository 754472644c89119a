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
import signal
import sys

# the signals a launcher, a terminal or a scheduler sends to a trainer's whole process group
GROUP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def start_server(context) -> None:
    """Start the forkserver of `context` (once per process) out of reach of signals sent to this process's group.

    The server imports this module first (it leaves the group then), then `rlanywhere.rewards` (torch with it)
    once for every worker. The signals are blocked in this thread only while the server process is created: the
    mask is inherited through its exec, so none of them can end it before it leaves the group. A server already
    running (started earlier by other code) is kept as it is."""
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


if _imported_by_the_forkserver():
    _leave_the_trainers_group()
