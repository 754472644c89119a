"""The tests' warm rank launcher (tests/warm_ranks.py): a rank the client asks a zygote for is the process that
`python -u -m MODULE ARGS` would have been (argv, environment, working directory, sys.path, streams, exit code,
signals), and it dies with its client. A probe module in the test's folder stands in for rlanywhere.cli."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from . import warm_ranks

pytestmark = pytest.mark.skipif(warm_ranks.COLD, reason="RLANYWHERE_TEST_COLD_RANKS=1: no warm ranks to test")

PROBE = '''
import json, os, signal, subprocess, sys, time

mode = sys.argv[1]
if mode == "report":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(),
                      "ppid": os.getppid(), "sid": os.getsid(0), "rank": os.environ.get("RANK"),
                      "extra": os.environ.get("RLA_TEST_EXTRA"), "zygotes": os.environ.get("RLANYWHERE_TEST_ZYGOTES"),
                      "main": sorted(k for k in vars(sys.modules["__main__"]) if not k.startswith("__")),
                      "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd"))}))
    print("to stderr", file=sys.stderr)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "raise":
    raise RuntimeError("injected failure")
elif mode == "sigterm":
    signal.signal(signal.SIGTERM, lambda *_: (print("got SIGTERM", flush=True), sys.exit(7)))
    print("ready", flush=True)
    time.sleep(60)
elif mode == "die-by":
    os.kill(os.getpid(), int(sys.argv[2]))
elif mode == "sleep-with-child":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print(json.dumps({"rank": os.getpid(), "child": child.pid}), flush=True)
    time.sleep(60)
'''


@pytest.fixture()
def probe_dir(tmp_path):
    (tmp_path / "warm_probe.py").write_text(PROBE)
    return tmp_path


def client(probe_dir, *args, env_extra=None, script=None, cwd=None, **popen):
    """The client as torchrun starts a rank: `python -u warm_rank_client.py -m warm_probe ARGS` in probe_dir (or
    `... SCRIPT ARGS` in cwd)."""
    env = {**os.environ, "RANK": "1", "RLA_TEST_EXTRA": "yes", **warm_ranks.rank_env(), **(env_extra or {})}
    command = [sys.executable, "-u", *warm_ranks.rank_program("warm_probe", script=script), *args]
    return subprocess.Popen(command, env=env, cwd=cwd or probe_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)


def test_a_warm_rank_gets_the_clients_argv_env_folder_and_streams(probe_dir):
    proc = client(probe_dir, "report", "x=1")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert seen["ppid"] != proc.pid and seen["pid"] != proc.pid  # forked by a zygote, not the client itself
    assert seen["sid"] == seen["pid"]  # a session of its own, as torchrun gives a rank
    assert seen["argv"] == [str(probe_dir / "warm_probe.py"), "report", "x=1"]
    assert seen["cwd"] == seen["path0"] == str(probe_dir)  # `python -m`: the working directory first on sys.path
    # the zygotes' folder as the client had it: what the rank starts (torchrun's ranks) finds them too
    assert (seen["rank"], seen["extra"], seen["zygotes"]) == ("1", "yes", warm_ranks.rank_env()[warm_ranks.SOCKETS_ENV])
    assert seen["main"] == ["json", "mode", "os", "signal", "subprocess", "sys", "time"]  # none left by the zygote
    assert seen["fds"][:3] == [0, 1, 2] and len(seen["fds"]) == 4  # and the one listdir opened: no zygote socket
    assert err == "to stderr\n"


def test_exit_codes_and_exceptions_are_those_of_python_m(probe_dir):
    for args, code in ((("exit", "3"),  3), (("exit", "0"), 0), (("raise",), 1)):
        proc = client(probe_dir, *args)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == code, err
    assert "Traceback" in err and err.rstrip().endswith("RuntimeError: injected failure")
    for signum in (signal.SIGUSR2, signal.SIGKILL):  # SIGKILL: one the client cannot take a handler for
        proc = client(probe_dir, "die-by", str(int(signum)))
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == -signum and err == ""  # torchrun sees the signal that ended the rank


def test_signals_to_the_client_reach_the_rank(probe_dir):
    proc = client(probe_dir, "sigterm")
    assert proc.stdout.readline() == "ready\n"
    os.killpg(proc.pid, signal.SIGTERM)  # as torchrun stops a rank
    out, _ = proc.communicate(timeout=60)
    assert out == "got SIGTERM\n" and proc.returncode == 7


def test_a_rank_and_its_children_die_with_their_client(probe_dir):
    proc = client(probe_dir, "sleep-with-child")
    started = json.loads(proc.stdout.readline())
    # the rank is the client's runner, and counts among the client's descendants with what it started
    assert warm_ranks.runner(proc.pid) == started["rank"] != proc.pid
    assert {started["rank"], started["child"]} <= set(warm_ranks.descendants(proc.pid))
    proc.kill()  # kill -9 of the rank torchrun sees
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 5
    while not (warm_ranks.ended(started["rank"]) and warm_ranks.ended(started["child"])):
        assert time.monotonic() < deadline, started
        time.sleep(0.02)


def test_an_environment_the_zygote_was_not_started_with_starts_the_rank_cold(probe_dir):
    """A variable that may be read during the imports (here OMP_NUM_THREADS) differs: the client becomes
    `python -u -m warm_probe` itself (exec: the same pid), as torchrun would have started it."""
    proc = client(probe_dir, "report", env_extra={"OMP_NUM_THREADS": "3"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert seen["pid"] == proc.pid and seen["zygotes"] is None


def test_a_warm_script_rank_is_python_script(probe_dir, tmp_path):
    """A test's worker file as the rank program (`warm_rank_client.py SCRIPT ARGS`): the rank is `python -u SCRIPT
    ARGS`, run as __main__ with the script's folder first on sys.path, wherever it runs from."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = str(probe_dir / "warm_probe.py")
    proc = client(probe_dir, "report", "x=1", script=script, cwd=elsewhere)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    seen = json.loads(out)
    assert seen["pid"] != proc.pid and seen["sid"] == seen["pid"]  # warm: forked by a zygote
    assert seen["argv"] == [script, "report", "x=1"]
    assert (seen["cwd"], seen["path0"]) == (str(elsewhere), str(probe_dir))
    assert seen["main"] == ["json", "mode", "os", "signal", "subprocess", "sys", "time"]
    raising = client(probe_dir, "raise", script=script, cwd=elsewhere)
    _, err = raising.communicate(timeout=120)
    assert raising.returncode == 1 and err.rstrip().endswith("RuntimeError: injected failure")
