"""A Python sandbox tool: the model's code runs in a fresh `python -I` subprocess with
- CPU-time, address-space (memory), file-size and core-dump limits per process (`resource.setrlimit` in the child),
- a wall-time limit (the process group is killed when it runs over, e.g. blocked on input or sleeping),
- unprivileged namespaces (`unshare -rn --ipc --pid --mount-proc`): no network (a network namespace of its own),
  no System V or POSIX IPC object of the host's (an IPC namespace), a PID namespace whose first process is the
  code's (when it ends or is killed every process it started ends with it, even one that left its process group;
  /proc shows only these), and a mount namespace in which every file system is remounted read-only but the scratch
  directory and a private 64 MB /dev/shm, after which every capability is dropped (the code cannot remount them):
  it cannot change the trainer's files, caches or home,
- a seccomp filter (x86-64, arm64): sockets of the IP families and netlink only (the host's Unix socket files stay
  reachable from a network namespace: Docker's, a datagram service's), no socketpair, no io_uring, no system call
  of another ABI (32-bit calls),
- a fresh scratch directory as its working directory (deleted afterwards) and an empty environment.
Where the machine does not allow unprivileged namespaces (some containers' seccomp profiles, AppArmor's userns
restriction) the tool is refused when it is built, before anything loads: Python-level blocks (its socket, os and
subprocess modules) are all that would remain, and plain Python gets past them (the trainer's environment through
/proc, the network through `posix`). A tool config that sets `allow_unisolated: true` accepts that and runs so.
What it prints (stdout, then stderr) is the result, truncated to `max_output_chars`. The output goes to files in the
scratch directory, capped by the file-size limit, and only their head and tail are read back: a program that prints
gigabytes costs the trainer no memory.
This limits accidents and runaway code; it is not a security boundary against a hostile user on the machine.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .base import BaseTool, ToolResponse, ToolSchema

log = logging.getLogger(__name__)

# The child's program: set the limits (argv: CPU seconds, address-space bytes, file bytes; set here rather than in
# a preexec_fn, which is unsafe in the trainer's threaded process), shut the socket module's doors (a network
# namespace may not be available), then run the user's code in a process of its own and wait for it; outside a
# network namespace (argv[4] "0") that process may start no other, which would have the network. With
# namespaces this first process is the PID namespace's init: it reaps what the code leaves behind, and when it ends
# every process of the namespace ends. It writes the code's wait status to .status (unshare does not pass a signal's
# death on), then leaves.
_PRELUDE = """
import os as _os, resource as _r, socket as _s, sys as _sys
for _limit, _value in zip((_r.RLIMIT_CPU, _r.RLIMIT_AS, _r.RLIMIT_FSIZE, _r.RLIMIT_CORE), _sys.argv[1:4] + ["0"]):
    _r.setrlimit(_limit, (int(_value), int(_value)))
_isolated = _sys.argv[4] == "1"
_sys.argv = ["main.py"]
class _NoNetwork(OSError):
    pass
def _refuse(*a, **k):
    raise _NoNetwork("network access is disabled in the sandbox")
class _Socket:
    def __init__(self, *a, **k):
        _refuse()
for _name in ("socket", "SocketType", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(_s, _name, _Socket if _name in ("socket", "SocketType") else _refuse)
_s._socket = None
_sys.modules["_socket"] = None
if _isolated:  # root of its user namespace: every file system read-only but the scratch directory (the cwd)
    import ctypes as _ct, platform as _platform, re as _re
    _libc = _ct.CDLL(None, use_errno=True)
    _scratch = _os.fsencode(_os.getcwd())
    # MS_REMOUNT | MS_BIND (| MS_RDONLY), keeping each mount's locked flags: statvfs ST_* -> MS_* (nosuid, nodev,
    # noexec, noatime, nodiratime, relatime); a user namespace may not clear them
    _KEEP = ((2, 2), (4, 4), (8, 8), (1024, 1024), (2048, 2048), (4096, 1 << 21))
    def _remount(_path, _readonly):
        try:
            _have = _os.statvfs(_path).f_flag
        except OSError:
            return
        _flags = 32 | 4096 | (1 if _readonly else 0)
        for _st, _ms in _KEEP:
            if _have & _st:
                _flags |= _ms
        _libc.mount(None, _path, None, _flags, None)
    def _writable(_path):  # a mount point still writable (one that cannot even be looked at cannot be written)
        try:
            return not _os.statvfs(_path).f_flag & 1
        except OSError:
            return False
    _libc.mount(_scratch, _scratch, None, 4096, None)  # MS_BIND: a mount of its own, kept rw
    # a private /dev/shm of 64 MB (multiprocessing's semaphores live there), kept rw too
    _shm = _libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 2 | 4, b"size=64m") == 0  # MS_NOSUID | MS_NODEV
    # mountinfo's mount points, its octal escapes undone, as bytes: a name need not be ASCII
    _points = {_re.sub(rb"\\\\([0-7]{3})", lambda _m: bytes([int(_m[1], 8)]), _line.split()[4])
               for _line in open("/proc/self/mountinfo", "rb")} - {_scratch} - ({b"/dev/shm"} if _shm else set())
    for _point in sorted(_points):
        _remount(_point, True)
    _remount(_scratch, False)
    _os.chdir(_scratch)  # into the scratch's own mount (the cwd was the directory on the mount now read-only)
    # then no capability is left (nor can an exec regain one: the bounding set is emptied, no_new_privs set), so
    # the code, root of its user namespace, cannot remount anything read-write again
    for _cap in range(64):
        _libc.prctl(24, _cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails harmlessly past the last capability)
    _libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    class _CapHeader(_ct.Structure):
        _fields_ = [("version", _ct.c_uint32), ("pid", _ct.c_int)]
    class _CapData(_ct.Structure):
        _fields_ = [("effective", _ct.c_uint32), ("permitted", _ct.c_uint32), ("inheritable", _ct.c_uint32)]
    _dropped = _libc.capset(_ct.byref(_CapHeader(0x20080522, 0)), (_CapData * 2)()) == 0  # capability v3: none
    # a seccomp filter: sockets of the IP families (and netlink) only, which the network namespace confines; no
    # AF_UNIX (the host's socket files stay reachable from a network namespace: a Docker or Ray socket, a datagram
    # service), no AF_VSOCK (the hypervisor's) and no socketpair (a datagram pair can send to a socket file); no
    # io_uring (whose socket operation seccomp does not see); no system call of another ABI (32-bit calls have
    # numbers of their own: socketcall, socket 359, ...)
    _ARCH = {"x86_64": (0xC000003E, 41, 53), "aarch64": (0xC00000B7, 198, 199)}.get(_platform.machine())
    _filtered = False
    if _ARCH:
        class _Insn(_ct.Structure):
            _fields_ = [("code", _ct.c_uint16), ("jt", _ct.c_uint8), ("jf", _ct.c_uint8), ("k", _ct.c_uint32)]
        class _Prog(_ct.Structure):
            _fields_ = [("len", _ct.c_uint16), ("filter", _ct.POINTER(_Insn))]
        _LD, _JEQ, _AND, _RET, _ALLOW, _EPERM = 0x20, 0x15, 0x54, 0x06, 0x7FFF0000, 0x00050001
        # (code, jump if true, jump if false, k); a jump skips that many instructions; 11 refuses, 12 allows
        _insns = [(_LD, 0, 0, 4), (_JEQ, 0, 9, _ARCH[0]),  # 0-1 seccomp_data.arch: another ABI's call refused
                  (_LD, 0, 0, 0), (_AND, 0, 0, 0xBFFFFFFF),  # 2-3 seccomp_data.nr, x32's bit cleared
                  (_JEQ, 6, 0, 425), (_JEQ, 5, 0, _ARCH[2]),  # 4-5 io_uring_setup, socketpair: refused
                  (_JEQ, 0, 5, _ARCH[1]),  # 6 socket( ... anything else allowed
                  (_LD, 0, 0, 16), (_JEQ, 3, 0, 2), (_JEQ, 2, 0, 10), (_JEQ, 1, 0, 16),  # 7-10 AF_INET, INET6, NETLINK
                  (_RET, 0, 0, _EPERM), (_RET, 0, 0, _ALLOW)]  # 11, 12
        _program = (_Insn * len(_insns))(*[_Insn(*_i) for _i in _insns])
        _filtered = _libc.prctl(22, 2, _ct.byref(_Prog(len(_insns), _program)), 0, 0) == 0  # SECCOMP_MODE_FILTER
    _read_only = _dropped and not any(_writable(_p) for _p in _points)
    with open(".filesystem", "w") as _f:
        _f.write(("read-only" if _read_only else "writable") + (" no-unix-sockets" if _filtered else ""))
_pid = _os.fork()
if _pid == 0:
    if not _isolated:
        import _posixsubprocess as _ps
        def _no_process(*a, **k):
            raise PermissionError("starting processes is disabled in the sandbox (it would have the network)")
        _ps.fork_exec = _no_process
        for _name in dir(_os):
            if _name.startswith(("exec", "spawn", "posix_spawn", "fork")) or _name in ("system", "popen"):
                setattr(_os, _name, _no_process)
    _code = open("main.py").read()
    exec(compile(_code, "main.py", "exec"), {"__name__": "__main__"})
else:
    _status = None
    while True:
        try:
            _done, _got = _os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if _done == _pid:
            _status = _got
            break
    with open(".status", "w") as _f:
        _f.write(str(_status))
    _os._exit(0)
"""
# unshare: a user namespace (no privileges needed), no network, an IPC namespace (no shared memory or message queue
# of the host's), a PID namespace whose init is the code's process, and a mount namespace with a /proc of that PID
# namespace
_NAMESPACES = ("-rn", "--ipc", "--pid", "--fork", "--kill-child", "--mount-proc")
OUTPUT_READ_BYTES = 4  # bytes read back per character of max_output_chars, from the head and from the tail


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether `unshare -rn --ipc --pid --fork --mount-proc` (unprivileged user, network, IPC, PID and mount namespaces) works
    here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, *_NAMESPACES, "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


NOT_ISOLATED = ("the python sandbox tool needs unprivileged namespaces (unshare -rn --ipc --pid --mount-proc), which this "
                "machine does not allow (a container's seccomp profile, or AppArmor's restriction of unprivileged user "
                "namespaces: sysctl kernel.apparmor_restrict_unprivileged_userns=0). Without them only Python-level "
                "blocks would keep the code off the network, the trainer's environment and its files, and plain "
                "Python gets past them. Allow the namespaces, or set `allow_unisolated: true` in the tool's config "
                "to run it so anyway")


@functools.lru_cache(maxsize=1)
def _warn_not_isolated() -> None:
    log.warning("python sandbox: running without namespaces (allow_unisolated: true): the tool's code is kept off "
                "the network by its Python socket, os and subprocess modules only, and can read the trainer's "
                "environment and write its files")


@functools.lru_cache(maxsize=1)
def _warn_partial_lockdown() -> None:
    log.warning("python sandbox: inside its namespaces the file systems could not all be made read-only, or the "
                "filter refusing Unix sockets could not be installed, here: the tool's code may write where the "
                "trainer's user can, or reach local services through their socket files")


def _code_exit(status_path: str, returncode: int) -> int:
    """The code's exit code (-N: ended by signal N) from the wait status its parent wrote, else `returncode`."""
    try:
        with open(status_path) as handle:
            status = int(handle.read())
    except (OSError, ValueError):
        return returncode
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)


def _read_small(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read(64)
    except OSError:
        return ""


def _read_bounded(path: str, keep_bytes: int) -> tuple[str, int]:
    """(a file's text, 0), or (its first and last `keep_bytes` bytes joined, the bytes left out between them): the
    caller's cut (truncate_text) falls over the join, so one marker counts both."""
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        if size <= 2 * keep_bytes:
            return handle.read().decode(errors="replace"), 0
        head = handle.read(keep_bytes)
        handle.seek(size - keep_bytes)
        tail = handle.read()
    return head.decode(errors="replace") + tail.decode(errors="replace"), size - 2 * keep_bytes


def truncate_text(text: str, limit: int, side: str = "middle", left_out: int = 0) -> str:
    """`text` cut to about `limit` characters, verl's `tool_response_truncate_side`: "left" keeps the head (the end is
    cut), "right" keeps the tail, "middle" both halves. `left_out`: characters already left out of `text` (in the
    part this cut removes), counted in its marker."""
    if len(text) <= limit and not left_out:
        return text
    marker = f"\n...[{max(len(text) - limit, 0) + left_out} characters cut]...\n"
    if side == "left":
        return text[:limit] + marker.rstrip("\n")
    if side == "right":
        return marker.lstrip("\n") + text[-limit:]
    head = limit // 2
    return text[:head] + marker + text[len(text) - (limit - head):]


def run_python(code: str, cpu_s: int = 5, wall_s: float = 10.0, memory_mb: int = 512, max_output_chars: int = 4000,
               file_mb: int = 16, allow_unisolated: bool = False) -> tuple[str, dict]:
    """Run `code` in the sandbox; (what it printed, truncated; {"exit_code", "timed_out", "wall_s", "isolated",
    "read_only_fs", "unix_sockets_refused"}). Without namespaces: RuntimeError (NOT_ISOLATED), unless
    allow_unisolated."""
    isolated = network_namespace_available()
    if not isolated and not allow_unisolated:
        raise RuntimeError(NOT_ISOLATED)
    scratch = tempfile.mkdtemp(prefix="rlanywhere-sandbox-")
    try:
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(code)
        command = [sys.executable, "-I", "-c", _PRELUDE, str(cpu_s), str(memory_mb << 20), str(file_mb << 20),
                   "1" if isolated else "0"]
        if isolated:
            command = [shutil.which("unshare"), *_NAMESPACES] + command
        else:
            _warn_not_isolated()
        paths = [os.path.join(scratch, name) for name in (".stdout", ".stderr")]
        start = time.perf_counter()
        with open(paths[0], "wb") as out, open(paths[1], "wb") as err:
            # its own session and process group: the wall-time kill reaches any children it started
            proc = subprocess.Popen(command, cwd=scratch, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                    env={"PATH": "/usr/bin:/bin", "HOME": scratch}, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        elapsed = time.perf_counter() - start
        keep = max_output_chars * OUTPUT_READ_BYTES
        (out, out_left), (err, err_left) = _read_bounded(paths[0], keep), _read_bounded(paths[1], keep)
        text = out + err
        exit_code = _code_exit(os.path.join(scratch, ".status"), proc.returncode)
        lockdown = _read_small(os.path.join(scratch, ".filesystem")).split()
        read_only_fs, unix_sockets_refused = "read-only" in lockdown, "no-unix-sockets" in lockdown
        if isolated and not (read_only_fs and unix_sockets_refused):
            _warn_partial_lockdown()
        if timed_out:
            text += f"\nTimeoutError: the code ran longer than {wall_s:g} s and was stopped"
        elif exit_code < 0:
            text += f"\nthe code was stopped by signal {-exit_code} (a CPU-time, memory or output-size limit)"
        return (truncate_text(text, max_output_chars, left_out=out_left + err_left),
                {"exit_code": exit_code, "timed_out": timed_out, "wall_s": elapsed, "isolated": isolated,
                 "read_only_fs": read_only_fs, "unix_sockets_refused": unix_sockets_refused})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class PythonSandboxTool(BaseTool):
    """`python(code)`: run Python code and return what it prints. Config keys: cpu_time_s, wall_time_s, memory_mb,
    max_output_chars, allow_unisolated (run without namespaces where the machine has none: see the module
    docstring). Refused when built on a machine without namespaces, unless allowed."""

    def __init__(self, config: dict | None = None, tool_schema: Any = None):
        super().__init__(config, tool_schema)
        if not network_namespace_available() and not self.config.get("allow_unisolated", False):
            raise ValueError(NOT_ISOLATED)

    @classmethod
    def default_schema(cls) -> ToolSchema:
        return ToolSchema("python", "Run Python code in a sandbox (no network, limited time and memory) and return "
                          "what it prints.",
                          {"type": "object", "properties": {"code": {"type": "string",
                                                                     "description": "the Python program"}},
                           "required": ["code"]})

    def execute(self, instance_id: str, parameters: dict, **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str):
            raise ValueError("missing string argument 'code'")
        cfg = self.config
        text, info = run_python(code, cpu_s=int(cfg.get("cpu_time_s", 5)), wall_s=float(cfg.get("wall_time_s", 10)),
                                memory_mb=int(cfg.get("memory_mb", 512)),
                                max_output_chars=int(cfg.get("max_output_chars", 4000)),
                                allow_unisolated=bool(cfg.get("allow_unisolated", False)))
        return ToolResponse(text), 0.0, {"timed_out": float(info["timed_out"])}


__all__ = ["PythonSandboxTool", "run_python", "truncate_text", "network_namespace_available"]
