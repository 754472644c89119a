"""Several ranks on one machine under torchrun's own launcher, a rank that dies reported in one line.

``rlanywhere train`` with ``trainer.n_gpus_per_node > 1`` and no torchrun around it starts this module
(``python -m rlanywhere.rank_launch --standalone --nproc_per_node=N -m rlanywhere.cli train ...``), which runs
torchrun (``torch.distributed.run``) in this process with the same arguments. What changes is only what a failure
prints:

* A rank that ends with an error prints its own message (``error: ...`` or a bug's traceback); nothing is added.
* A rank killed by a signal (``kill -9``, the system's out-of-memory killer, a crash) cannot say anything: one
  line names it here. The other ranks, stopped because of it, stay silent (``FAILED_RANKS_NAMED``).
* torchrun's own report of either (its ChildFailedError traceback and table, and its log lines about stopping the
  other ranks) is not printed.
* A stop signal to ``rlanywhere train`` (Ctrl-C, SIGTERM, SIGHUP) is passed on once (:func:`run_ranks`) and
  reaches every rank, which save and print one ``stopped by ...`` line; ``rlanywhere train`` waits for that and
  exits with the signal's code, without torchrun's SignalException traceback.

Started by hand, torchrun prints its report as usual (docs/reliability.md shows what that looks like).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional

# set for the ranks: the launcher names a rank that died, so a surviving rank does not name it again
FAILED_RANKS_NAMED = "RLANYWHERE_LAUNCHER_NAMES_FAILED_RANKS"

# torchrun's log lines about what the ranks or this module report themselves (its other lines are kept)
_REPORTED_HERE = ("Sending process %s closing signal %s", "failed (exitcode: %s)",
                  "Received %s death signal, shutting down workers")
_TORCHRUN_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
_LEAK_NOTICE = "ignore:resource_tracker:UserWarning:multiprocessing.resource_tracker"


def _not_reported_here(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_REPORTED_HERE)


def failed_rank_report(failures: dict, world: int) -> tuple[Optional[str], int]:
    """(the line to print or None, the exit code) for torchrun's failures ({global rank: ProcessFailure}).

    The rank that failed first is the cause; one that ended by the SIGTERM torchrun sends to stop the others
    is not (torchrun's timestamps have whole seconds, so a stopped rank can tie with the cause). Of ranks that tie,
    one killed by a signal is the cause: a rank whose collective failed because that one died exits 1 without a
    word (FAILED_RANKS_NAMED), and torchrun, which looks at its ranks every 0.1 s, can find both ended at once."""
    causes = {rank: failure for rank, failure in failures.items() if failure.exitcode != -signal.SIGTERM}
    causes = causes or failures
    rank = min(causes, key=lambda r: (causes[r].timestamp, causes[r].exitcode >= 0, r))
    code = causes[rank].exitcode
    if code > 0:
        return None, code  # the rank printed what happened
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    how = " (kill -9, or the system's out-of-memory killer)" if name == "SIGKILL" else ""
    return (f"error: rank {rank} of {world} was ended by {name}{how} and could not say why; the other ranks were "
            "stopped. Run the same command to resume from the last checkpoint"), 1


def run_ranks(command: list[str]) -> int:
    """Run `command` (this module under `rlanywhere train`) to its end and return its exit code.

    It runs in a session of its own, and each stop signal this process gets (Ctrl-C in the terminal, SIGTERM from
    a scheduler, SIGHUP) is passed on to it once: torchrun hands it to every rank, which finish or drop the step,
    save and stop, and this waits for that. (In the terminal's process group, the launcher would get Ctrl-C twice,
    and a rank that gets a second signal stops without saving; a plain wait would end here at once, leaving the
    ranks to save after the shell prompt came back.)"""
    import subprocess
    import threading

    process = subprocess.Popen(command, start_new_session=True)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in _STOP_SIGNALS:
            previous[sig] = signal.signal(sig, lambda signum, frame: process.send_signal(signum))
    try:
        return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: Optional[list[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    for name in _TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(_not_reported_here)
    os.environ[FAILED_RANKS_NAMED] = "1"  # the ranks inherit it
    # a rank killed with its reward pool leaves the pool's semaphores to multiprocessing's resource tracker, which
    # removes them and warns that they leaked: said already by the line above
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _LEAK_NOTICE]))
    try:
        run(args)
    except ChildFailedError as failed:
        line, code = failed_rank_report(failed.failures, int(args.nproc_per_node))
        if line:
            print(line, file=sys.stderr, flush=True)
        return code
    except SignalException as stop:  # every rank got the signal too, saved and said so
        return 128 + int(stop.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
