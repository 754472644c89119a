"""torchrun's rank program in the tests: `warm_rank_client.py -m MODULE ARGS` (or `warm_rank_client.py SCRIPT
ARGS`) has a warm zygote (tests/warm_ranks.py) run `python -m MODULE ARGS` (`python SCRIPT ARGS`) with this
process's descriptors, environment and working directory, forwards the signals it gets to that rank, and ends as
the rank ends (its exit code, or killed by its signal). Without a zygote, or when the zygote declines (an
environment it was not started with), it becomes that command itself.
Standard library only: it starts in about 20 ms."""

import json
import os
import signal
import socket
import sys

SOCKETS_ENV = "RLANYWHERE_TEST_ZYGOTES"
ZYGOTES = 2
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)


def interpreter_options() -> list[str]:
    """This interpreter's command-line options (torchrun gives -u)."""
    return sys.orig_argv[1:sys.orig_argv.index(sys.argv[0])]


def unbuffered() -> bool:
    flags = [o for o in interpreter_options() if o.startswith("-") and not o.startswith(("--", "-X", "-W"))]
    return any("u" in o for o in flags) or bool(os.environ.get("PYTHONUNBUFFERED"))


def become_cold_rank() -> None:
    """exec `python [this interpreter's options] -m MODULE ARGS`: what torchrun runs without the tests' client."""
    os.execv(sys.executable, [sys.executable, *interpreter_options(), *sys.argv[1:]])


def request() -> bytes:
    umask = os.umask(0)
    os.umask(umask)
    # Python itself ignores SIGPIPE and SIGXFSZ; any other signal ignored here was ignored by whoever started us
    own = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGKILL, signal.SIGSTOP)
    ignored = [s for s in range(1, signal.NSIG) if s not in own and _ignored(s)]
    return json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "umask": umask,
                       "ignored_signals": ignored, "unbuffered": unbuffered(),
                       "blocked_signals": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))
                       }).encode()


def _ignored(signum: int) -> bool:
    try:
        return signal.getsignal(signum) == signal.SIG_IGN
    except (ValueError, OSError):
        return False


def end_as(status: bytes) -> None:
    kind, value = status.split()
    if kind == b"X":
        os._exit(int(value))
    signum = int(value)
    if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two can be neither caught nor blocked
        signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not to end the process


def main() -> None:
    folder = os.environ.pop(SOCKETS_ENV, None)
    if folder is None or not sys.argv[1:] or (sys.argv[1] == "-m" and len(sys.argv) < 3):
        become_cold_rank()
    zygote = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        zygote.connect(os.path.join(folder, f"{int(os.environ.get('RANK', '0')) % ZYGOTES}.sock"))
    except OSError:
        become_cold_rank()
    held: list[int] = []  # signals that came before the request went: sent after it

    def forward(signum, frame):
        if held is not None:
            held.append(signum)
            return
        try:
            zygote.send(f"S {signum}".encode())
        except OSError:  # the zygote is gone: the loop below says so
            pass

    for signum in FORWARDED:
        if not _ignored(signum):  # an ignored signal stays ignored, here and in the rank
            signal.signal(signum, forward)
    socket.send_fds(zygote, [request()], [0, 1, 2])
    came_early, held = held, None
    for signum in came_early:
        forward(signum, None)
    while True:
        message = zygote.recv(64)
        if message == b"C":
            zygote.close()
            become_cold_rank()
        if message.startswith((b"X ", b"K ")):
            end_as(message)
        if not message:
            print("error: the warm-rank zygote ended before this rank did (tests/warm_ranks.py; "
                  "RLANYWHERE_TEST_COLD_RANKS=1 starts ranks without it)", file=sys.stderr, flush=True)
            os._exit(1)


if __name__ == "__main__":
    main()
