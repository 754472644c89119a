"""A Python sandbox tool: the model's code runs in a fresh `python -I` subprocess with
- CPU-time, address-space (memory), file-size and process-count limits (`resource.setrlimit` in the child),
- a wall-time limit (the process group is killed when it runs over, e.g. blocked on input or sleeping),
- no network: the child runs in a new network namespace (`unshare -rn`) where the machine allows it, and in any
  case its `socket` module is replaced before the user's code runs, so opening a socket raises,
- a fresh scratch directory as its working directory (deleted afterwards) and an empty environment.
What it prints (stdout, then stderr) is the result, truncated to `max_output_chars`.
This limits accidents and runaway code; it is not a security boundary against a hostile user on the machine.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from .base import BaseTool, ToolResponse, ToolSchema

# Runs before the user's code in the child: no sockets of any family (a network namespace may not be available).
_PRELUDE = """
import socket as _s, sys as _sys
class _NoNetwork(OSError):
    pass
def _refuse(*a, **k):
    raise _NoNetwork("network access is disabled in the sandbox")
class _Socket:
    def __init__(self, *a, **k):
        _refuse()
for _name in ("socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"):
    setattr(_s, _name, _Socket if _name == "socket" else _refuse)
_sys.modules["_socket"] = None
del _s, _sys
_code = open("main.py").read()
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__"})
"""


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether `unshare -rn` (an unprivileged user + network namespace) works here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    try:
        return subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _limit_child(cpu_s: int, memory_bytes: int, file_bytes: int) -> None:
    import resource

    os.setsid()  # its own process group: the wall-time kill reaches any children it started
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def truncate_text(text: str, limit: int, side: str = "middle") -> str:
    """`text` cut to about `limit` characters, keeping its head ("right" cuts the end), tail ("left") or both."""
    if len(text) <= limit:
        return text
    marker = f"\n...[{len(text) - limit} characters cut]...\n"
    if side == "left":
        return marker.lstrip("\n") + text[-limit:]
    if side == "right":
        return text[:limit] + marker.rstrip("\n")
    head = limit // 2
    return text[:head] + marker + text[len(text) - (limit - head):]


def run_python(code: str, cpu_s: int = 5, wall_s: float = 10.0, memory_mb: int = 512, max_output_chars: int = 4000,
               file_mb: int = 16) -> tuple[str, dict]:
    """Run `code` in the sandbox; (what it printed, truncated; {"exit_code", "timed_out", "wall_s", "isolated"})."""
    scratch = tempfile.mkdtemp(prefix="rlanywhere-sandbox-")
    try:
        with open(os.path.join(scratch, "main.py"), "w") as f:
            f.write(code)
        command = [sys.executable, "-I", "-c", _PRELUDE]
        isolated = network_namespace_available()
        if isolated:
            command = [shutil.which("unshare"), "-rn"] + command
        start = time.perf_counter()
        proc = subprocess.Popen(command, cwd=scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "HOME": scratch},
                                preexec_fn=functools.partial(_limit_child, cpu_s, memory_mb << 20, file_mb << 20))
        timed_out = False
        try:
            out, err = proc.communicate(timeout=wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        elapsed = time.perf_counter() - start
        text = out.decode(errors="replace") + err.decode(errors="replace")
        if timed_out:
            text += f"\nTimeoutError: the code ran longer than {wall_s:g} s and was stopped"
        elif proc.returncode < 0:
            text += f"\nthe code was stopped by signal {-proc.returncode} (CPU-time or memory limit)"
        return truncate_text(text, max_output_chars), {"exit_code": proc.returncode, "timed_out": timed_out,
                                                       "wall_s": elapsed, "isolated": isolated}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class PythonSandboxTool(BaseTool):
    """`python(code)`: run Python code and return what it prints. Config keys: cpu_time_s, wall_time_s, memory_mb,
    max_output_chars."""

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
                                max_output_chars=int(cfg.get("max_output_chars", 4000)))
        return ToolResponse(text), 0.0, {"timed_out": float(info["timed_out"])}


__all__ = ["PythonSandboxTool", "run_python", "truncate_text", "network_namespace_available"]
