"""Warm rank processes for the tests' torchrun jobs: each rank starts with torch, transformers and rlanywhere already
imported, instead of importing them again (4-5 s of CPU per rank).

torchrun itself runs as in any launch (its agent, rendezvous, restarts, signals). Its rank program is
tests/warm_rank_client.py, a stdlib-only script (about 20 ms to start) that asks a "zygote" to run
`python -m rlanywhere.cli ...` for it:

- the zygote is a fresh interpreter started from this file (never forked from pytest, which has run OpenMP work),
  with pytest's environment when the first job starts. It imports what a training rank imports, runs no
  tensor code, sets nothing, and waits on a unix socket. There are two zygotes per pytest process, one for even
  RANKs and one for odd ones, so the two ranks of a job do not share one string-hash seed (a rank's sets of strings
  iterate in a different order from another rank's, as they do in separate interpreters).
- the client sends the zygote its argv, environment, working directory, umask, ignored and blocked signals, and its
  stdin/stdout/stderr descriptors (SCM_RIGHTS). The zygote forks a child that takes all of them (a session of its
  own, as torchrun gives a rank), closes the zygote's sockets, and runs the module as `python -m` does
  (runpy._run_module_as_main, in a clean __main__; a test's worker file as `python SCRIPT` does, runpy.run_path
  as __main__ with its folder first on sys.path): the same exit codes, and an exception prints its traceback and
  exits 1 through the interpreter's own exit, which also runs atexit handlers and joins threads.
- the client forwards the signals it gets (HUP, INT, QUIT, USR1, USR2, TERM) to the child, and ends as the child
  did: the same exit code, or killed by the same signal. torchrun, and tests that look for the rank among torchrun's
  descendants (its environment has RANK, its command line `rlanywhere.cli`), see the client; a signal sent to it
  reaches the rank.
- if the client dies (SIGKILL), the zygote kills the child and every process under it at once, as `kill -9` of a
  job's whole process tree would. A zygote ends with the pytest process that started it.
- the child is the client's "runner": the zygote registers it (<client pid>.runner in its folder) and runner(pid)
  finds it; descendants() and children_by_parent() count it as the client's child, so a test walks from torchrun
  down to its ranks' runners. kill_9(pid) kills a rank as `kill -9` would: its runner, then the client.

The same client starts other processes of the tests warm: torchrun's launcher (`-m torch.distributed.run`, see
torchrun()), a single `rlanywhere train` (signals to the client reach it; the run lock names the runner's pid) and
an example script. A warm child has the zygotes' folder in its environment again, so what it starts finds them: the
launcher's ranks, and, for `rlanywhere train` with trainer.n_gpus_per_node > 1, the rank launcher and the ranks it
starts (rlanywhere.distributed.relaunch_command runs them through the client in a warm child; see
_launched_ranks_start_warm).

A rank runs warm only when its environment differs from the zygote's in nothing but variables read after start-up
(torchrun's RANK, MASTER_PORT, TORCHELASTIC_*..., the tests' RLA_TEST_*, the rank launcher's own variable; see
LATE_READ), or in PYTHONWARNINGS, which the child applies as the interpreter would have. Any other difference
(another PYTHONPATH, OMP_NUM_THREADS, TORCH_LOGS...) could have been read during the imports: the zygote declines and
the client execs `python -m rlanywhere.cli` itself, as torchrun would have started it. A variable the imports set
(torch._dynamo sets TORCHINDUCTOR_CACHE_DIR when it is unset) is set in the rank as its own imports would have set
it. The module run with -m is forgotten first (the zygote imported it; `python -m` never imports it under its own
name). Other differences from a cold rank, none of which the tests read: sys.flags (the zygote has no -u; the rank's
streams are unbuffered as with -u), sys.orig_argv, modules imported before the rank's own code runs, tracebacks
with the zygote's frames above runpy's, and a signal sent to the client's process group reaches the rank alone, not
the rest of the rank's group (its multiprocessing resource tracker, which ignores SIGINT and SIGTERM; the reward
server and workers leave the group anyway), and the objects of the zygote's imports up to triton's are frozen
(gc.freeze; see freeze_until_triton): the rank's collections and its exit leave them out.

A test leaves os.environ as it found it (tests/conftest.py): a variable rlanywhere sets in the pytest process (the
CUDA allocator's settings, Triton's cache folder) would otherwise make every later rank differ from its zygote.

RLANYWHERE_TEST_COLD_RANKS=1 turns this off: torchrun then runs `python -m rlanywhere.cli` for each rank, to compare
or to debug. Each zygote's stderr is in its folder (zygote-<n>.log, removed when pytest ends): one line for each rank,
started warm or (with the differing variables) cold.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COLD = os.environ.get("RLANYWHERE_TEST_COLD_RANKS", "") not in ("", "0")
SOCKETS_ENV = "RLANYWHERE_TEST_ZYGOTES"  # the folder of the zygotes' sockets; the client removes it from the env
CLIENT = Path(__file__).with_name("warm_rank_client.py")
ZYGOTES = 2  # even and odd RANKs

# What a rank imports before and while it trains (sys.modules at the end of the ranks of a 2-rank job; the rest
# costs under 0.1 s of CPU), and torchrun's launcher. Those that do not import triton come first (see
# freeze_until_triton).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "transformers", "safetensors.torch",
           "pyarrow.compute", "rlanywhere.cli", "rlanywhere.trainer", "rlanywhere.distributed", "rlanywhere.preflight",
           "rlanywhere.split_run", "rlanywhere.rewards", "rlanywhere.reward_forkserver", "rlanywhere.plotting",
           "transformers.models.qwen2.modeling_qwen2", "transformers.optimization", "peft", "torch.nn.attention.varlen")

# Variables that may differ between the zygote and a rank: read only after start-up (torchrun's world and
# rendezvous, the tests' reward knobs).
LATE_READ = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
             "PYTEST_CURRENT_TEST",
             "RLANYWHERE_LAUNCHER_NAMES_FAILED_RANKS"}  # rank_launch's, for its ranks: read when a rank fails
LATE_READ_PREFIXES = ("TORCHELASTIC_", "RLA_TEST_")
# Read at start-up, and applied in the child as the interpreter would have applied it (rank_launch's leak notice)
APPLIED_IN_CHILD = {"PYTHONWARNINGS"}

_zygotes: dict = {}
IMPORTS_SET: dict = {}  # in a zygote: the variables its imports set
RUNNER_SUFFIX = ".runner"  # <client pid>.runner in the zygotes' folder: the pid of the child that runs its program


# ------------------------------------------------------------------------------------------------ pytest side
def rank_program(module: str = "rlanywhere.cli", script: str | None = None) -> list[str]:
    """What torchrun should run for each rank: the client, warm; `-m module` (or `script`, a test's worker file that
    patches the trainer and then runs the CLI), cold."""
    program = [script] if script else ["-m", module]
    if COLD:
        return program
    start_zygotes()
    return [str(CLIENT), *program]


def torchrun() -> list[str]:
    """The command that starts torchrun: `python -m torch.distributed.run` (what the `torchrun` script runs) through
    the client, so that the launcher starts warm too (its import of torch is a second of CPU per launch; the env
    needs rank_env()). The test's process is then the client, and the launcher its warm runner (runner(),
    descendants()). Cold: that main run directly, with the objects of its imports frozen (gc.freeze) once they are
    done, which its interpreter's exit then leaves out of its collections (0.1 s instead of 0.5 s); torch alone
    imports no triton, whose bindings would report frozen objects as leaked."""
    if COLD:
        return [sys.executable, "-c", "import gc, sys; from torch.distributed.run import main; "
                "'triton' in sys.modules or gc.freeze(); sys.argv[0] = 'torchrun'; main()"]
    start_zygotes()
    return [sys.executable, str(CLIENT), "-m", "torch.distributed.run"]


def rank_env() -> dict:
    """The variable that tells the client where the zygotes listen (none when cold)."""
    if COLD:
        return {}
    start_zygotes()
    return {SOCKETS_ENV: _zygotes["folder"]}


def start_zygotes() -> None:
    """Start this process's zygotes once. Their sockets are bound here, before they import anything, so a client
    that comes early waits for its zygote instead of finding nothing."""
    if _zygotes:
        return
    folder = tempfile.mkdtemp(prefix="rla-warm-")
    environment = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}  # what the ranks will get
    _zygotes.update(folder=folder, processes=[])
    for index in range(ZYGOTES):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(os.path.join(folder, f"{index}.sock"))
        listener.listen(16)
        code = ("import importlib.util as u, sys; s = u.spec_from_file_location('_warm_zygote', sys.argv[1]); "
                "m = u.module_from_spec(s); s.loader.exec_module(m); m.serve(int(sys.argv[2]), int(sys.argv[3]))")
        with open(os.path.join(folder, f"zygote-{index}.log"), "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-c", code, __file__, str(listener.fileno()), str(os.getpid())],
                env=environment, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=[listener.fileno()],
                cwd=folder, start_new_session=True)  # Ctrl-C to pytest's group: pytest stops them itself
        listener.close()
        _zygotes["processes"].append(process)
    atexit.register(stop_zygotes)


def runner(pid: int) -> int:
    """The process that runs the program of process `pid`: a warm client's child (forked by a zygote, not a child
    of the client), else `pid` itself (a cold rank, or any other process)."""
    return _runners().get(pid, pid)


def kill_9(pid: int, timeout_s: float = 30.0) -> None:
    """`kill -9` of the rank (or other process) that `pid` stands for. A warm rank is two processes, its client and
    its runner: the runner is killed first, and the client once the runner has ended (a process of torch's size
    takes a moment to tear down). torchrun sees a rank end when its process has ended; it then stops the other
    ranks, which look for the dead one first, and must find it dead, as they would a cold rank."""
    target = runner(pid)
    if target != pid:
        _kill(target)
        deadline = time.monotonic() + timeout_s
        while not ended(target) and time.monotonic() < deadline:
            time.sleep(0.005)
    _kill(pid)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def ended(pid: int) -> bool:
    """Whether `pid` has ended (gone, or a zombie not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _runners() -> dict[int, int]:
    """{client pid: its warm child's pid} for the children running now, from the zygotes' folder (this pytest
    process's; in a zygote, its own)."""
    folder = _zygotes.get("folder")
    found = {}
    if folder:
        for name in os.listdir(folder):
            if name.endswith(RUNNER_SUFFIX):
                try:
                    found[int(name[:-len(RUNNER_SUFFIX)])] = int(Path(folder, name).read_text())
                except (OSError, ValueError):  # ended meanwhile, or being written
                    continue
    return found


def stop_zygotes() -> None:
    for process in _zygotes.get("processes", []):
        kill_tree(process.pid)  # with any rank still running
        process.wait()
    if _zygotes:
        shutil.rmtree(_zygotes["folder"], ignore_errors=True)
    _zygotes.clear()


# ------------------------------------------------------------------------------------------------ zygote side
def serve(listener_fd: int, parent_pid: int) -> None:
    """The zygote: import, then fork a rank for each client, until the pytest process that started it ends."""
    listener = socket.socket(fileno=listener_fd)
    _zygotes["folder"] = os.getcwd()  # the sockets' folder: where the runners are registered
    watch_parent = os.pidfd_open(parent_pid)
    if os.getppid() != parent_pid:  # it ended before the watch began
        return
    import importlib

    started_with = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
        freeze_until_triton()
    # what the imports set (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR when unset): a cold rank's imports set it too
    IMPORTS_SET.update({k: v for k, v in os.environ.items() if started_with.get(k) != v})
    sys.stdout.flush()
    sys.stderr.flush()
    job = Zygote(listener, watch_parent).run()
    run_rank(*job)  # only in a forked child; raises SystemExit (or the module's exception) to the interpreter


def freeze_until_triton() -> None:
    """Move the objects the imports made so far out of the garbage collector's reach (gc.freeze), until triton is
    imported. They live as long as the rank anyway, and the collector walked them all again in every full collection
    while the rank trains and in the collections of the interpreter's exit: 1.6 s of a rank's exit, 0.7 s with
    torch's, transformers' and rlanywhere's objects frozen. triton's are not: its bindings (nanobind) print a
    "leaked" report at exit for objects the exit did not free, which frozen ones in reference cycles are not."""
    import gc

    if "triton" not in sys.modules:
        gc.freeze()


class Zygote:
    """One poll loop over the listening socket, each client's connection, each child's pidfd and the parent."""

    def __init__(self, listener: socket.socket, watch_parent: int):
        self.listener, self.watch_parent = listener, watch_parent
        self.children: dict[int, dict] = {}  # child pid -> {"conn", "pidfd"}
        self.poll = select.poll()
        for fd in (listener.fileno(), watch_parent):
            self.poll.register(fd, select.POLLIN)
        self.handlers = {listener.fileno(): self._accept, watch_parent: self._parent_gone}

    def run(self):
        while True:
            for fd, _ in self.poll.poll():
                handler = self.handlers.get(fd)
                job = handler() if handler else None
                if job is not None:  # in the forked child
                    return job

    def _accept(self):
        conn, _ = self.listener.accept()
        try:
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        except OSError:
            conn.close()
            return None
        request = json.loads(message)
        differing = late_read_mismatch(request["env"])
        if len(fds) != 3 or not request["argv"] or differing:
            print(f"cold start: {differing or request['argv'][:2]}", file=sys.stderr, flush=True)
            conn.send(b"C")
            conn.close()
            for fd in fds:
                os.close(fd)
            return None
        client = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        pid = os.fork()
        if pid == 0:
            return self._in_child(conn, fds, request)
        for fd in fds:
            os.close(fd)
        registered, staged = (Path(_zygotes["folder"], f"{client}{suffix}") for suffix in (RUNNER_SUFFIX, ".tmp"))
        staged.write_text(str(pid))
        staged.rename(registered)  # whole, or not there
        print(f"warm start: RANK={request['env'].get('RANK')} pid {pid}", file=sys.stderr, flush=True)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = {"conn": conn, "pidfd": pidfd, "registered": registered}
        self.poll.register(conn.fileno(), select.POLLIN)
        self.poll.register(pidfd, select.POLLIN)
        self.handlers[conn.fileno()] = lambda: self._from_client(pid)
        self.handlers[pidfd] = lambda: self._child_ended(pid)
        conn.send(f"P {pid}".encode())
        return None

    def _in_child(self, conn, fds, request):
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds) - {0, 1, 2}:
            os.close(fd)
        for child in self.children.values():  # other ranks' connections and pidfds
            os.close(child["pidfd"])
            if child["conn"] is not None:
                child["conn"].close()
        os.close(self.watch_parent)
        self.listener.close()
        conn.close()
        return (request,)

    def _from_client(self, pid: int) -> None:
        child = self.children[pid]
        try:
            message = child["conn"].recv(64)
        except OSError:
            message = b""
        if message.startswith(b"S "):
            os.kill(pid, int(message[2:]))  # not reaped yet: the pid is still this child's
            return
        # the client is gone (kill -9): end the child and all it started, as killing the job's tree would
        self.poll.unregister(child["conn"].fileno())
        del self.handlers[child["conn"].fileno()]
        child["conn"].close()
        child["conn"] = None
        kill_tree(pid)

    def _child_ended(self, pid: int) -> None:
        child = self.children.pop(pid)
        child["registered"].unlink(missing_ok=True)
        _, status = os.waitpid(pid, 0)
        self.poll.unregister(child["pidfd"])
        del self.handlers[child["pidfd"]]
        os.close(child["pidfd"])
        if child["conn"] is not None:
            ending = f"K {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"X {os.waitstatus_to_exitcode(status)}"
            try:
                child["conn"].send(ending.encode())
            except OSError:
                pass
            self.poll.unregister(child["conn"].fileno())
            del self.handlers[child["conn"].fileno()]
            child["conn"].close()

    def _parent_gone(self) -> None:
        for pid in list(self.children):
            kill_tree(pid)
        os._exit(0)


def late_read_mismatch(env: dict) -> list[str]:
    """The variables, other than those read after start-up, in which a rank's environment differs from the
    zygote's after its imports (their values may have been used during the imports). A variable the imports set
    may be missing: the rank gets the imports' value, as its own imports would have set it."""
    keys = set(env) | set(os.environ)
    return sorted(k for k in keys if env.get(k) != os.environ.get(k) and not (k in IMPORTS_SET and k not in env)
                  and k not in LATE_READ | APPLIED_IN_CHILD and not k.startswith(LATE_READ_PREFIXES))


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and its descendants at once (found before any dies, so none is missed by reparenting)."""
    for target in [pid, *descendants(pid)]:
        _kill(target)


def children_by_parent() -> dict[int, list[int]]:
    """Every process's children, read from /proc at once; a warm client's runner counts as its child."""
    children: dict[int, list[int]] = {}
    for client, child in _runners().items():
        children.setdefault(client, []).append(child)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """pid's child processes, recursively."""
    children = children_by_parent()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def run_rank(request: dict) -> None:
    """In the forked child: become the process `python -m MODULE ARGS` (or `python SCRIPT ARGS`) would have been,
    then run the module (the script)."""
    os.setsid()  # a session of its own, as torchrun starts each rank
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in IMPORTS_SET.items():
        os.environ.setdefault(key, value)
    os.environ[SOCKETS_ENV] = _zygotes["folder"]  # as the client had it: what this child starts finds the zygotes
    _warning_options(request["env"].get("PYTHONWARNINGS"))
    _launched_ranks_start_warm()
    os.umask(request["umask"])
    for signum in request["ignored_signals"]:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked_signals"])
    _fresh_std_streams(request["unbuffered"])
    if "numpy.random" in sys.modules:  # its global generator was seeded once, in the zygote; a new process seeds anew
        sys.modules["numpy.random"].seed()
    main = sys.modules["__main__"].__dict__
    for name in [n for n in main if not n.startswith("__")]:  # the zygote's bootstrap names
        del main[name]
    import runpy

    if request["argv"][0] != "-m":  # `python SCRIPT`: the script's folder first, run as __main__
        script = os.path.abspath(request["argv"][0])
        sys.path[0] = os.path.dirname(script)
        sys.argv = list(request["argv"])
        runpy.run_path(script, run_name="__main__")
        return
    sys.path[0] = os.getcwd()  # `python -m`: the working directory first
    sys.argv = ["-m", *request["argv"][2:]]
    _forget_the_import_of(request["argv"][1])
    runpy._run_module_as_main(request["argv"][1])


def _forget_the_import_of(name: str) -> None:
    """`python -m NAME` runs NAME as __main__ and never imports it under its own name; the zygote imported it (it
    is among the PRELOAD's imports), and runpy would warn of that ("found in sys.modules ... unpredictable
    behaviour"). Forgotten here, as a fresh interpreter never had it; what it imported stays."""
    if sys.modules.pop(name, None) is not None and "." in name:
        package, _, attribute = name.rpartition(".")
        if hasattr(sys.modules.get(package), attribute):
            delattr(sys.modules[package], attribute)


def _warning_options(python_warnings) -> None:
    """PYTHONWARNINGS, which the zygote was started without, as the interpreter applies it at start-up: in
    sys.warnoptions (multiprocessing passes them on to its helper processes as -W) and in the warning filters."""
    if python_warnings and not sys.warnoptions:
        import warnings

        options = [option for option in python_warnings.split(",") if option]
        sys.warnoptions[:] = options
        warnings._processoptions(options)


def _launched_ranks_start_warm() -> None:
    """`rlanywhere train` with trainer.n_gpus_per_node > 1 starts torchrun's launcher (rlanywhere.rank_launch), which
    starts the ranks (rlanywhere.distributed.relaunch_command): run warm, it starts both through the client, as the
    tests' own torchrun jobs start theirs."""
    from rlanywhere import distributed

    original = distributed.relaunch_command

    def through_the_client(nproc, argv):
        command = original(nproc, argv)
        rank_program = command.index("-m", 3)  # torchrun's `-m rlanywhere.cli`, after its own options
        assert command[1:3] == ["-m", "rlanywhere.rank_launch"] and command[rank_program + 1] == "rlanywhere.cli", \
            command
        return [command[0], str(CLIENT), *command[1:rank_program], str(CLIENT), *command[rank_program:]]

    distributed.relaunch_command = through_the_client


def _fresh_std_streams(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr over the client's descriptors (now 0, 1, 2), made as the interpreter makes them at
    start-up: the encoding and error handlers of the zygote's (same environment), buffering from -u and the tty."""
    import io

    def text(fd: int, old, mode: str):
        if mode == "rb":
            buffer = io.open(fd, "rb", closefd=False)
            return io.TextIOWrapper(buffer, old.encoding, old.errors, newline=None, line_buffering=buffer.isatty())
        buffer = io.open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
        interactive = os.isatty(fd)
        return io.TextIOWrapper(buffer, old.encoding, old.errors, newline="\n",
                                line_buffering=not unbuffered and (interactive or fd == 2),
                                write_through=unbuffered)

    sys.stdin = sys.__stdin__ = text(0, sys.__stdin__, "rb")
    sys.stdout = sys.__stdout__ = text(1, sys.__stdout__, "wb")
    sys.stderr = sys.__stderr__ = text(2, sys.__stderr__, "wb")
