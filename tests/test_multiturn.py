"""Multi-turn, tool-using rollouts: tools, hermes parsing, the rollout driver's masks and limits, advantage
estimators and loss modes over a response mask with holes, and the config keys (docs/multi-turn.md)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from rlanywhere import algorithms as algo
from rlanywhere.rollout.base import RolloutEngine, build_rollout_batch
from rlanywhere.rollout.multiturn import (MultiTurnRollout, MultiTurnSettings, ToolMessageRenderer, multiturn_metrics,
                                          plan_multiturn_lengths, render_prompt_with_tools)
from rlanywhere.tools import (BaseTool, CalculatorTool, Gsm8kTool, PythonSandboxTool, ToolConfigError, ToolResponse,
                              evaluate_expression, parse_tool_calls, run_calls, tools_from_config)
from rlanywhere.tools.calculator import CalculatorError
from rlanywhere.tools.parsing import ToolCall

from .conftest import GSM8K_TOOL_CONFIG

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer(corpus: list[str] | None = None, vocab_size: int = 700):
    """One token per byte plus <pad>, <|im_start|>, <|im_end|> (EOS): any text round-trips exactly. With a
    `corpus`, byte-level BPE merges learned from it (milliseconds) make its texts a few tokens long."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=corpus is not None)
    backend.decoder = decoders.ByteLevel()
    if corpus is not None:
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.train_from_iterator(corpus, trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


class ScriptedEngine(RolloutEngine):
    """Answers from a script: script(context text, turn index) -> the turn's text (EOS added unless it says
    `no_eos`); log-prob -0.5 per token. Records every request."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []
        self.eos_ids, self.pad_token_id = [tokenizer.eos_token_id], tokenizer.pad_token_id

    def generate(self, prompts, params, generator=None, rows_per_wave=None):
        self.calls.append((len(prompts), params.n, params.max_new_tokens))
        outs = []
        for p in prompts:
            context = self.tokenizer.decode(p, skip_special_tokens=False)
            for _ in range(params.n):
                text = self.script(context, context.count("<|im_start|>tool"))
                ids = self.tokenizer(text.replace("<no_eos>", ""), add_special_tokens=False)["input_ids"]
                ids = (ids if "<no_eos>" in text else ids + [self.tokenizer.eos_token_id])[:params.max_new_tokens]
                outs.append(ids)
        width = max(len(o) for o in outs)
        tokens = torch.tensor([o + [0] * (width - len(o)) for o in outs])
        return build_rollout_batch(prompts, params.n, tokens, torch.full(tokens.shape, -0.5),
                                   torch.tensor([len(o) for o in outs]), self.pad_token_id)


def call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def items_for(tok, questions, tools_kwargs=None):
    return [{"input_ids": tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
             "raw_prompt": [{"role": "user", "content": q}], "ground_truth": "0", "data_source": "arith",
             "index": i, "extra_info": {"tools_kwargs": tools_kwargs or {}}} for i, q in enumerate(questions)]


def params(max_new=400, n=1):
    from rlanywhere.rollout.base import SamplingParams

    return SamplingParams(max_new_tokens=max_new, temperature=0.0, n=n)


# ------------------------------------------------------------------------------------------------ tools
def test_calculator_is_safe_arithmetic():
    assert evaluate_expression("123 * 456 + 7") == 56095
    assert evaluate_expression("(2 + 3) ** 2 - 10 / 4") == 22.5
    assert evaluate_expression("-7 // 2") == -4
    for bad in ("__import__('os').system('true')", "x + 1", "2 ** 100000", "1 / 0", "[1, 2]", "", "lambda: 1"):
        with pytest.raises(CalculatorError):
            evaluate_expression(bad)
    response, reward, _ = CalculatorTool().execute("i", {"expression": "6 * 7.0"})
    assert response.text == "42" and reward == 0.0


def test_sandbox_limits_hang_memory_network_output():
    tool = PythonSandboxTool({"wall_time_s": 2, "cpu_time_s": 1, "memory_mb": 256, "max_output_chars": 1000})
    assert tool.execute("i", {"code": "print(6 * 7)"})[0].text == "42\n"
    start = time.perf_counter()
    hung = tool.execute("i", {"code": "import time\ntime.sleep(60)"})[0].text
    assert "longer than 2 s" in hung and time.perf_counter() - start < 10
    spin = tool.execute("i", {"code": "while True:\n    pass"})[0].text
    assert "stopped" in spin
    assert "MemoryError" in tool.execute("i", {"code": "x = bytearray(1 << 31)"})[0].text
    assert "network access is disabled" in tool.execute(
        "i", {"code": "import socket\nsocket.create_connection(('127.0.0.1', 9))"})[0].text
    big = tool.execute("i", {"code": "print('x' * (1 << 20))"})[0].text  # 1 MB printed
    assert 1000 <= len(big) < 1100 and "characters cut" in big
    assert tool.execute("i", {"code": "open('f.txt', 'w').write('hi'); print(open('f.txt').read())"})[0].text == "hi\n"


def test_sandbox_output_is_read_back_bounded_and_its_processes_end_with_it(tmp_path):
    """Printing far more than max_output_chars costs the trainer no memory (the output goes to capped files, whose
    head and tail are read back); with namespaces, a process that left the code's process group ends when the code
    is killed (PID namespace); the socket module's other doors are shut too."""
    import resource

    from rlanywhere.tools.sandbox import network_namespace_available, run_python

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    text, info = run_python("import sys\nfor _ in range(64):\n    sys.stdout.write('x' * (1 << 20))\nprint('end')",
                            max_output_chars=500, file_mb=8)
    assert len(text) < 700 and "cut" in text and info["exit_code"] != 0  # stopped at the 8 MB file-size limit
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB: far below 64 MB read
    for door in ("socket.SocketType(socket.AF_INET, socket.SOCK_STREAM)",
                 "socket._socket.socket(socket.AF_INET, socket.SOCK_STREAM)"):
        text, _ = run_python(f"import socket\n{door}")
        assert "network access is disabled" in text or "NoneType" in text, door  # refused either way
    if not network_namespace_available():
        pytest.skip("unprivileged namespaces (unshare -rn --pid) are not available here")
    marker = tmp_path / "escaped"
    code = (f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(3)\n"
            f"    open({str(marker)!r}, 'w').write('alive')\n    os._exit(0)\ntime.sleep(60)")
    start = time.perf_counter()
    text, info = run_python(code, wall_s=1)
    assert info["timed_out"] and time.perf_counter() - start < 3
    time.sleep(3.5)
    assert not marker.exists()  # the process that left the group ended with the code


def test_sandbox_without_namespaces_is_refused_unless_allowed(monkeypatch):
    """Without namespaces only Python-level blocks would remain: the python tool is refused when it is built (a
    ToolConfigError before anything loads) and run_python raises, unless the tool's config sets allow_unisolated.
    Allowed, the fallback refuses to start processes (os and subprocess: one would have the network), and the code
    runs as before otherwise."""
    from rlanywhere.tools import sandbox
    from rlanywhere.tools.registry import ToolConfigError, tools_from_config

    monkeypatch.setattr(sandbox, "network_namespace_available", lambda: False)
    entry = {"class_name": "python", "config": {}}
    with pytest.raises(ToolConfigError, match="needs unprivileged namespaces.*allow_unisolated: true"):
        tools_from_config({"tools": [entry]})
    with pytest.raises(RuntimeError, match="allow_unisolated"):
        sandbox.run_python("print(1)")
    (tool,) = tools_from_config({"tools": [{**entry, "config": {"allow_unisolated": True}}]})
    assert tool.execute("id", {"code": "print(6 * 7)"})[0].text == "42\n"
    for start in ("import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'print(1)'])",
                  "import os\nos.system('true')", "import os\nos.fork()",
                  "import os\nos.execv('/bin/true', ['true'])"):
        text, info = sandbox.run_python(start, allow_unisolated=True)
        assert "starting processes is disabled" in text and not info["isolated"], start
    assert sandbox.run_python("import os, subprocess\nprint(os.getcwd() != '/')", allow_unisolated=True)[0] == "True\n"


def test_sandbox_code_writes_only_its_scratch_and_sees_only_its_processes(tmp_path):
    """With namespaces every file system is read-only to the code but its scratch directory (the trainer's files,
    caches and /tmp stay as they were), and /proc lists only the sandbox's own processes. The code is root of its
    user namespace but holds no capability: remounting a file system read-write (through ctypes) is refused."""
    from rlanywhere.tools.sandbox import network_namespace_available, run_python

    if not network_namespace_available():
        pytest.skip("unprivileged namespaces (unshare -rn --ipc --pid --mount-proc) are not available here")
    outside = tmp_path / "written_from_the_sandbox"
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "points = {line.split()[4] for line in open('/proc/self/mountinfo')}\n"
            "print(sum(libc.mount(None, p.encode(), None, 32 | 4096, None) == 0 for p in points))\n"  # remount rw
            "print(libc.socket(1, 1, 0), os.strerror(ctypes.get_errno()))\n"  # AF_UNIX: the host's socket files
            f"open('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())\n"
            f"try:\n    open({str(outside)!r}, 'w').write('x')\nexcept OSError as e:\n    print(e.strerror)\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    text, info = run_python(code)
    assert text.splitlines() == ["0", "-1 Operation not permitted", "ok", "Read-only file system", "[1, 2]"]
    assert info["read_only_fs"] and info["unix_sockets_refused"] and not outside.exists()


def test_sandbox_sockets_ipc_and_dev_shm(tmp_path):
    """Sockets of the IP families only (their network namespace has none of the host's): no AF_UNIX socketpair (a
    datagram pair can send to a socket file) and no AF_VSOCK; System V IPC stays in the sandbox's own namespace (a
    segment it makes is not the host's); /dev/shm is a private tmpfs, so multiprocessing works."""
    import ctypes
    import os

    from rlanywhere.tools.sandbox import network_namespace_available, run_python

    if not network_namespace_available():
        pytest.skip("unprivileged namespaces (unshare -rn --ipc --pid --mount-proc) are not available here")
    key = 0x52_4C_41_00 + os.getpid() % 256
    code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "pair = (ctypes.c_int * 2)()\nprint(libc.socketpair(1, 2, 0, pair), libc.socket(40, 1, 0))\n"
            "print(libc.socket(2, 1, 0) >= 0, libc.socket(10, 2, 0) >= 0)\n"  # AF_INET, AF_INET6
            f"print(libc.shmget({key}, 4096, 0o1600) >= 0)\n"
            "from multiprocessing import Pool\nwith Pool(2) as pool:\n    print(pool.map(abs, [-1, -2]))")
    text, info = run_python(code, wall_s=30)
    assert text.splitlines() == ["-1 -1", "True True", "True", "[1, 2]"] and info["unix_sockets_refused"], text
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.shmget(key, 0, 0) == -1  # the segment was the sandbox's IPC namespace's, gone with it


def test_sandbox_refuses_a_unix_socket_made_through_the_32_bit_system_call_interface():
    """On x86-64 a program can make i386 system calls (int 0x80), which have their own numbers (socket is 359): the
    seccomp filter refuses every call of another ABI, so that way to a Unix socket is shut too."""
    import platform

    from rlanywhere.tools.sandbox import network_namespace_available, run_python

    if platform.machine() != "x86_64" or not network_namespace_available():
        pytest.skip("x86-64 with unprivileged namespaces only")
    code = ("import ctypes, mmap\n"
            # push rbx; mov eax, 359; mov ebx, 1 (AF_UNIX); mov ecx, 1 (SOCK_STREAM); xor edx, edx; int 0x80;
            # pop rbx; ret
            "machine = bytes([0x53, 0xb8, 0x67, 1, 0, 0, 0xbb, 1, 0, 0, 0, 0xb9, 1, 0, 0, 0, 0x31, 0xd2, 0xcd, 0x80,"
            " 0x5b, 0xc3])\n"
            "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
            "page.write(machine)\n"
            "call = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))\n"
            "print(call())")
    text, info = run_python(code)
    assert text.strip() == "-1" and info["unix_sockets_refused"], text


def test_sandbox_makes_a_mount_point_with_a_non_ascii_name_read_only_too(tmp_path):
    """/proc/self/mountinfo escapes a mount point's name (octal) and need not be ASCII: a file system mounted at
    `données` is read-only to the code as well. (The mount is made in a user and mount namespace of the test's.)"""
    import shlex
    import subprocess
    import sys

    from rlanywhere.tools.sandbox import network_namespace_available

    if not network_namespace_available():
        pytest.skip("unprivileged namespaces (unshare -rn --ipc --pid --mount-proc) are not available here")
    mount_point = tmp_path / "données"
    mount_point.mkdir()
    code = f"open({str(mount_point / 'f')!r}, 'w')"  # what the sandboxed code does
    script = tmp_path / "write_there.py"
    script.write_text(f"from rlanywhere.tools.sandbox import run_python\nprint(run_python({code!r})[0])\n")
    shell = f"mount -t tmpfs scratch {shlex.quote(str(mount_point))} && {sys.executable} {shlex.quote(str(script))}"
    done = subprocess.run(["unshare", "-rm", "--propagation", "private", "sh", "-c", shell], capture_output=True,
                          check=False, text=True, timeout=60)
    if done.returncode != 0 and "mount" in done.stderr and "Traceback" not in done.stderr:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {done.stderr.strip()[:200]}")
    assert done.stdout.strip().endswith("Read-only file system: '" + str(mount_point / "f") + "'"), done


def test_tool_response_truncation_sides_are_verls():
    """verl's tool_response_truncate_side: left keeps the head, right keeps the tail, middle both ends."""
    from rlanywhere.tools.sandbox import truncate_text

    text = "HEAD" + "." * 100 + "TAIL"
    assert truncate_text(text, 10, "left").startswith("HEAD") and "TAIL" not in truncate_text(text, 10, "left")
    assert truncate_text(text, 10, "right").endswith("TAIL") and "HEAD" not in truncate_text(text, 10, "right")
    middle = truncate_text(text, 10, "middle")
    assert middle.startswith("HEAD") and middle.endswith("TAIL") and "98 characters cut" in middle
    assert truncate_text("short", 10, "left") == "short"


class Raises(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("boom")


class Hangs(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        time.sleep(30)


class Garbage(BaseTool):
    def execute(self, instance_id, parameters, **kwargs):
        return object(), "not a number", None


class Prints1MB(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):  # a verl-style async tool
        return ToolResponse(text="y" * (1 << 20)), 0.5, {}


def test_executor_turns_failures_into_error_texts():
    tools = {name: cls(None, {"type": "function", "function": {"name": name}})
             for name, cls in (("raises", Raises), ("hangs", Hangs), ("garbage", Garbage), ("big", Prints1MB))}
    jobs = [(tools[name], "id", ToolCall(name, {})) for name in ("raises", "hangs", "garbage", "big")]
    jobs.append((None, "", ToolCall(None, error="Error: bad json")))
    start = time.perf_counter()
    results = run_calls(jobs, timeout_s=1.0, max_chars=100)
    assert time.perf_counter() - start < 5
    assert [r.error for r in results] == [True, True, True, False, True]
    assert "RuntimeError: boom" in results[0].text and "within 1 s" in results[1].text
    assert "not text" in results[2].text and results[4].text == "Error: bad json"
    assert len(results[3].text) < 200 and results[3].reward == 0.5


class Sleeps(BaseTool):
    threads: list = []

    def execute(self, instance_id, parameters, **kwargs):
        self.threads.append(threading.current_thread())
        time.sleep(0.3)
        return "slept"


def test_executor_runs_calls_in_parallel_on_reused_threads():
    """Every call gets a thread at once (8 sleeps of 0.3 s take about 0.3 s); the threads are kept for the next
    calls; a hung call keeps its thread, and the next calls do not wait for it."""
    tools = {name: cls(None, {"type": "function", "function": {"name": name}})
             for name, cls in (("sleeps", Sleeps), ("hangs", Hangs))}
    sleeps = [(tools["sleeps"], "id", ToolCall("sleeps", {}))] * 8
    for _ in range(2):
        start = time.perf_counter()
        assert [r.text for r in run_calls(sleeps)] == ["slept"] * 8
        assert time.perf_counter() - start < 1.5
        time.sleep(0.1)  # the threads are back
    first, second = Sleeps.threads[:8], Sleeps.threads[8:]
    assert len(set(first)) == 8 and set(second) == set(first)  # 8 threads at once, the same ones again
    assert run_calls([(tools["hangs"], "id", ToolCall("hangs", {}))], timeout_s=0.5)[0].error
    start = time.perf_counter()
    assert [r.text for r in run_calls(sleeps)] == ["slept"] * 8
    assert time.perf_counter() - start < 1.5


def test_verl_tool_config_and_gsm8k_semantics(tmp_path):
    from rlanywhere.tools import load_tool_config

    (tool,) = load_tool_config(GSM8K_TOOL_CONFIG)
    assert isinstance(tool, Gsm8kTool) and tool.name == "calc_gsm8k_reward"
    instance, _ = tool.create(None, create_kwargs={"ground_truth": "72"})
    assert tool.execute(instance, {"answer": "70"})[1] == -0.05  # no improvement on 0
    response, reward, _ = tool.execute(instance, {"answer": "72"})
    assert reward == 0.0 and "reward=1.0" in response.text and tool.calc_reward(instance) == 1.0
    assert tool.execute(instance, {"answer": "72"})[1] == -0.05  # same answer again: not an improvement
    tool.release(instance)
    with pytest.raises(ToolConfigError, match="no counterpart"):
        tools_from_config({"tools": [{"class_name": "verl.tools.search_tool.SearchTool"}]})
    with pytest.raises(ToolConfigError, match="more than once"):
        tools_from_config({"tools": [{"class_name": "calculator"}, {"class_name": "calculator"}]})
    with pytest.raises(ToolConfigError, match="no such file"):
        load_tool_config(tmp_path / "missing.yaml")


def test_a_turn_ended_by_another_eos_is_closed_before_its_tool_messages(tok):
    """The template's end of turn (<|im_end|>) is what its tool messages follow; a turn that ended on another EOS
    id (Qwen's <|endoftext|>, here <|im_start|> as a stand-in) gets <|im_end|> written before them."""
    from rlanywhere.rollout.multiturn import _Row

    other_eos = tok.convert_tokens_to_ids("<|im_start|>")
    driver = MultiTurnRollout([CalculatorTool()], tok, MultiTurnSettings(), [tok.eos_token_id, other_eos])
    appended = {}
    for name, end in (("template", tok.eos_token_id), ("other", other_eos)):
        row = _Row(prompt=[], global_row=0, tools_kwargs={})
        row.add(tok(call("calculator", expression="1+1"), add_special_tokens=False)["input_ids"] + [end], True)
        row.stats.assistant_turns = 1
        assert driver._run_tools([row], budget=10_000) == [0]
        appended[name] = tok.decode(row.tokens[row.mask.index(0):])
    assert appended["template"].startswith("\n<|im_start|>tool")
    assert appended["other"].startswith("<|im_end|>\n<|im_start|>tool")


# ------------------------------------------------------------------------------------------------ parsing
def test_parse_hermes_calls():
    known = {"calculator"}
    calls = parse_tool_calls("x " + call("calculator", expression="1+1") + " and "
                             + call("calculator", expression="2*3"), known)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "1+1"}, None),
                                                               ("calculator", {"expression": "2*3"}, None)]
    assert "not valid JSON" in parse_tool_calls("<tool_call>{name: calculator}</tool_call>", known)[0].error
    assert "unknown tool 'search'" in parse_tool_calls(call("search", q="x"), known)[0].error
    assert "must be" in parse_tool_calls('<tool_call>["calculator"]</tool_call>', known)[0].error
    truncated = parse_tool_calls(call("calculator", expression="1") + ' <tool_call>{"name": "calcu', known)
    assert truncated[0].error is None and "no closing" in truncated[1].error
    assert parse_tool_calls("no calls here", known) == []
    as_string = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}'
                                 '</tool_call>', known)
    assert as_string[0].arguments == {"expression": "4"}


def test_json_that_pythons_parser_refuses_is_an_error_text_not_a_crash():
    """Nesting deeper than the recursion limit and integers of thousands of digits raise RecursionError and
    ValueError (not JSONDecodeError) in json.loads: each call gets an error text; an unknown tool's long name is cut
    in the text that repeats it, and the executor cuts error texts to max_chars like any answer."""
    known = {"calculator"}
    deep = parse_tool_calls("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", known)
    digits = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"x": ' + "9" * 5000 + "}}</tool_call>",
                              known)
    nested_args = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": "' + "[" * 5000 + '"}</tool_call>',
                                   known)
    assert "not valid JSON" in deep[0].error and "not valid JSON" in digits[0].error
    assert "not a JSON object" in nested_args[0].error
    long_name = parse_tool_calls(call("s" * 5000, q="x"), known)[0]
    assert "unknown tool" in long_name.error and len(long_name.error) < 200
    (result,) = run_calls([(None, "", ToolCall(None, error="Error: " + "e" * 1000))], max_chars=100)
    assert result.error and len(result.text) < 160


def test_tool_messages_rendered_with_the_chat_template(tok):
    renderer = ToolMessageRenderer(tok, "<|im_end|>")
    assert renderer.text(["42"], True) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.text(["1", "2"], False).startswith("<|im_end|>\n<|im_start|>tool\n1<|im_end|>\n")
    ids = renderer.ids(["42"], True)  # remembered: the same ids again, and a caller's edits do not stick
    assert tok.decode(ids) == renderer.text(["42"], True)
    ids.append(0)
    assert renderer.ids(["42"], True) == ids[:-1] and renderer.ids(["42"], False) != ids[:-1]
    ids = render_prompt_with_tools(tok, [{"role": "user", "content": "hi"}], [CalculatorTool()])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou can call tools") and '"name": "calculator"' in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tool_texts_reach_the_model_whatever_the_tool_returns():
    """A lone surrogate (half an emoji the model wrote as a JSON escape) repeated by an error text or a tool's
    exception becomes an escape the tokenizer takes; ToolResponse(text=None) is an empty result, not an error."""

    class Weather(BaseTool):
        def execute(self, instance_id, parameters, **kwargs):
            if parameters.get("city") is None:
                return ToolResponse(text=None), 1.0, {}
            raise ValueError(f"no such city: {parameters['city']}")

    weather = Weather(None, {"type": "function", "function": {"name": "weather"}})
    bad_name = parse_tool_calls('<tool_call>{"name": "calc\\ud83d", "arguments": 5}</tool_call>', {"weather"})[0]
    results = run_calls([(None, "", bad_name), (weather, "i", ToolCall("weather", {"city": "Paris\ud83d"})),
                         (weather, "i", ToolCall("weather", {}))])
    for result in results[:2]:
        assert "\\ud83d" in result.text and result.error
        byte_tokenizer()(result.text)  # no lone surrogate left for the tokenizer to refuse
    assert (results[2].text, results[2].reward, results[2].error) == ("", 1.0, False)


# Qwen3's way with turns: the last assistant message gets an empty think block, an earlier one does not; tool
# results go in a user turn
LAST_TURN_THINKS = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{% if loop.last %}<think>\n\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}{{ '\\n<tool_response>\\n' }}"
    "{{ m.content }}{{ '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_messages_of_templates_that_render_each_call_differently(monkeypatch):
    """Templates render a last assistant message differently from an earlier one (Qwen3), or stamp the date into
    every rendering (Llama 3: a run crossing midnight): the tool results' text comes from one rendering."""
    qwen3_like = byte_tokenizer()
    qwen3_like.chat_template = LAST_TURN_THINKS
    renderer = ToolMessageRenderer(qwen3_like, "<|im_end|>")
    assert renderer.text(["4"], True) == ("\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
                                         "<|im_start|>assistant\n")
    assert renderer.text(["1", "2"], False).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n1\n")
    dated = byte_tokenizer()
    renderings = iter(range(1000))
    render = dated.apply_chat_template
    monkeypatch.setattr(dated, "apply_chat_template",
                        lambda messages, **options: f"day {next(renderings)}\n" + render(messages, **options))
    renderer = ToolMessageRenderer(dated, "<|im_end|>")
    for _ in range(2):
        assert renderer.text(["42"], True) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------------ the driver
def arithmetic_script(context, turn):
    if turn == 0:
        return "Let me compute. " + call("calculator", expression="12*34")
    return "The answer is #### 408"


def test_driver_masks_tool_tokens_and_counts(tok):
    engine = ScriptedEngine(tok, arithmetic_script)
    driver = MultiTurnRollout([CalculatorTool()], tok, MultiTurnSettings(), engine.eos_ids)
    batch = driver.generate(engine, items_for(tok, ["12*34?", "again"]), params(n=2))
    assert batch.response_ids.shape[0] == 4 and engine.calls[0] == (2, 2, 400) and engine.calls[1][:2] == (4, 1)
    for row in range(4):
        ids, mask = batch.response_ids[row].tolist(), batch.response_mask[row].tolist()
        length = len(ids) - ids[::-1].index(tok.eos_token_id)
        first = tok(arithmetic_script("", 0), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        tool_part = tok("\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n",
                        add_special_tokens=False)["input_ids"]
        second = tok(arithmetic_script("", 1), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ids[:length] == first + tool_part + second
        assert mask[:length] == [1] * len(first) + [0] * len(tool_part) + [1] * len(second)
        logprobs = batch.response_logprobs[row, :length]
        assert torch.all((logprobs == 0) == (batch.response_mask[row, :length] == 0))
    stats = driver.last_stats
    assert [(s.assistant_turns, s.user_turns, s.tool_calls, s.tool_errors) for s in stats] == [(2, 1, 1, 0)] * 4
    metrics = multiturn_metrics(stats)
    assert metrics["multi_turn/tool_calls/mean"] == 1.0 and metrics["multi_turn/assistant_turns/mean"] == 2.0
    assert metrics["multi_turn/tool_call_rate"] == 1.0 and metrics["multi_turn/tool_errors/total"] == 0.0
    assert "<|im_start|>tool" not in batch.decode(tok)[0]  # the reward reads the model's own text


def test_driver_errors_and_limits(tok):
    def script(context, turn):
        if turn == 0:  # malformed JSON, an unknown tool and a good call in one turn
            return "<tool_call>{oops</tool_call>" + call("search", q="x") + call("calculator", expression="2+2")
        return call("calculator", expression="1/0")  # keeps calling: stopped by the turn limits
    engine = ScriptedEngine(tok, script)
    settings = MultiTurnSettings(max_assistant_turns=3, max_user_turns=2, max_parallel_calls=3)
    driver = MultiTurnRollout([CalculatorTool()], tok, settings, engine.eos_ids)
    batch = driver.generate(engine, items_for(tok, ["q"]), params(max_new=2000))
    (stats,) = driver.last_stats
    # turn 0: 3 calls (2 bad); turn 1: 1 call (division by zero); turn 2: its call is not run (user turn limit)
    assert (stats.assistant_turns, stats.user_turns, stats.tool_calls, stats.tool_errors) == (3, 2, 4, 3)
    text = tok.decode(batch.response_ids[0][batch.response_ids[0] != tok.pad_token_id])
    assert "not valid JSON" in text and "unknown tool 'search'" in text and "\n4<|im_end|>" in text
    assert "division by zero" in text


def test_truncated_call_at_the_length_limit(tok):
    engine = ScriptedEngine(tok, lambda context, turn: "x" * 20 + call("calculator", expression="9*9"))
    driver = MultiTurnRollout([CalculatorTool()], tok, MultiTurnSettings(), engine.eos_ids)
    batch = driver.generate(engine, items_for(tok, ["q"]), params(max_new=40))
    (stats,) = driver.last_stats
    assert batch.response_mask.sum() == 40 and batch.response_ids.shape[1] == 40  # cut inside the call
    assert (stats.assistant_turns, stats.user_turns, stats.tool_calls, stats.tool_errors) == (1, 0, 1, 1)


def test_no_room_for_the_tool_result_ends_the_row(tok):
    engine = ScriptedEngine(tok, arithmetic_script)
    first = len(tok(arithmetic_script("", 0), add_special_tokens=False)["input_ids"]) + 1
    driver = MultiTurnRollout([CalculatorTool()], tok, MultiTurnSettings(), engine.eos_ids)
    batch = driver.generate(engine, items_for(tok, ["q"]), params(max_new=first + 10))
    assert batch.response_mask.tolist() == [[1] * first]  # the call ran, its result did not fit: no hole at the end
    assert driver.last_stats[0].tool_calls == 1 and len(engine.calls) == 1
    assert driver.last_stats[0].user_turns == 0  # a tool turn the model never saw is not counted (as verl)


def test_tools_kwargs_reach_create(tok):
    tool = Gsm8kTool()
    engine = ScriptedEngine(tok, lambda c, t: call("calc_gsm8k_reward", answer="72") if t == 0 else "done")
    driver = MultiTurnRollout([tool], tok, MultiTurnSettings(), engine.eos_ids)
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}
    batch = driver.generate(engine, items_for(tok, ["q"], kwargs), params())
    assert "reward=1.0" in tok.decode(batch.response_ids[0])
    assert tool._instances == {}  # released


def test_tools_written_for_verls_agent_loop_get_create_kwargs(tok):
    """verl's agent loop calls create(create_kwargs={...}); a tool reading them there gets the row's."""

    class Checker(BaseTool):
        async def create(self, instance_id=None, **kwargs):
            self.seen = kwargs["create_kwargs"]["ground_truth"]
            return "id", ToolResponse()

        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(f"truth {self.seen}"), 0.0, {}

    engine = ScriptedEngine(tok, lambda c, t: call("check", answer="72") if t == 0 else "done")
    driver = MultiTurnRollout([Checker(None, {"type": "function", "function": {"name": "check"}})], tok,
                              MultiTurnSettings(), engine.eos_ids)
    batch = driver.generate(engine, items_for(tok, ["q"], {"check": {"create_kwargs": {"ground_truth": "72"}}}),
                            params())
    assert "truth 72" in tok.decode(batch.response_ids[0])


# ------------------------------------------------------------------------------------------------ holes in the mask
HOLED = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0]], dtype=torch.float64)


def test_gae_over_a_holed_mask_by_hand():
    rewards = torch.tensor([[0, 0, 0, 0, 1.0, 0], [0, 0, 0, 2.0, 0, 0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.25, 9, 9, 0.75, 9], [1.0, 9, 0.5, 0.25, 9, 9]], dtype=torch.float64)
    gamma, lam = 0.5, 0.5
    # row 0, real tokens t0, t1, t4 (holes skipped: the "next" of t1 is t4):
    # t4: d = 1 - .75 = .25, A = .25; t1: d = 0 + .5*.75 - .25 = .125, A = .125 + .25*.25 = .1875;
    # t0: d = .5*.25 - .5 = -.375, A = -.375 + .25*.1875 = -.328125
    # row 1, real t0, t2, t3: t3: d = 2 - .25 = 1.75, A = 1.75; t2: d = .5*.25 - .5 = -.375, A = -.375 + .25*1.75
    # = .0625; t0: d = .5*.5 - 1 = -.75, A = -.75 + .25*.0625 = -.734375
    raw = torch.tensor([[-0.328125, 0.1875, 0, 0, 0.25, 0], [-0.734375, 0, 0.0625, 1.75, 0, 0]], dtype=torch.float64)
    advantages, returns = algo.compute_gae_advantages(rewards, values, HOLED, gamma, lam)
    assert torch.allclose(returns, (raw + values) * HOLED)
    real = raw[HOLED.bool()]
    whitened = (real - real.mean()) / torch.sqrt(real.var(unbiased=True) + 1e-8)
    assert torch.allclose(advantages[HOLED.bool()], whitened, atol=1e-6)
    assert torch.all(advantages[~HOLED.bool()] == 0)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_every_estimator_ignores_holes(estimator):
    """Holes change nothing: the advantages on the real tokens equal those of the same rows with the holes removed."""
    holed = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 1]])
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    values = torch.linspace(0.1, 2.4, 24, dtype=torch.float64).reshape(4, 6)
    groups = torch.tensor([0, 0, 1, 1])
    width = int(holed.sum(-1).max())
    packed = torch.zeros(4, width, dtype=torch.long)
    packed_values = torch.zeros(4, width, dtype=torch.float64)
    for r in range(4):
        real = holed[r].nonzero().flatten()
        packed[r, :real.numel()] = 1
        packed_values[r, :real.numel()] = values[r, real]
    kwargs = dict(scores=scores, group_index=groups, gamma=0.9, lam=0.8)
    adv_h, ret_h = algo.compute_advantages(estimator, mask=holed, values=values, **kwargs)
    adv_p, ret_p = algo.compute_advantages(estimator, mask=packed, values=packed_values, **kwargs)
    for r in range(4):
        real = holed[r].nonzero().flatten()
        assert torch.allclose(adv_h[r, real], adv_p[r, :real.numel()], atol=1e-9)
        assert torch.allclose(ret_h[r, real], ret_p[r, :real.numel()], atol=1e-9)
        assert torch.all(adv_h[r][holed[r] == 0] == 0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_modes_ignore_tool_tokens(mode):
    """Policy loss, KL and entropy terms aggregated over a holed mask: values at tool tokens do not matter, and the
    result equals the aggregation over the same real tokens packed together."""
    per_token = torch.tensor([[1.0, 2.0, 50.0, 60.0, 3.0, 70.0], [4.0, 80.0, 5.0, 6.0, 90.0, 99.0]])
    changed = per_token.clone()
    changed[HOLED == 0] = -1e4
    packed = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    packed_mask = torch.ones(2, 3)
    scale = algo.LossScale.of(HOLED.float(), norm_length=6)  # the configured response length, as the trainer gives
    holed = algo.aggregate_loss(per_token, HOLED.float(), mode, scale)
    assert torch.allclose(holed, algo.aggregate_loss(changed, HOLED.float(), mode, scale))
    expected = {"token-mean": 21 / 6, "seq-mean-token-sum": (6 + 15) / 2, "seq-mean-token-mean": (2 + 5) / 2,
                "seq-mean-token-sum-norm": (6 + 15) / 6 / 2}
    assert holed.item() == pytest.approx(expected[mode])
    packed_scale = algo.LossScale.of(packed_mask, norm_length=6)
    assert torch.allclose(holed, algo.aggregate_loss(packed, packed_mask, mode, packed_scale))


def test_planner_counts_all_turns():
    total, reason = plan_multiturn_lengths(True, 512, 1024, 5, 5)
    assert total == 512 + 128 + 1024 and "all turns" in reason
    assert plan_multiturn_lengths(False, 512, 1024, 5, 5)[0] == 1536


def test_verl_multi_turn_keys_plan_and_checks(tmp_path):
    from rlanywhere.config import load_config
    from rlanywhere.errors import UserError
    from rlanywhere.planner import make_plan
    from rlanywhere.rollout.multiturn import multiturn_settings

    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: calculator\n  - class_name: python\n")
    key = "actor_rollout_ref.rollout.multi_turn"
    base = [f"{key}.enable=true", f"{key}.max_turns=3", f"{key}.tool_config_path={path}", "hardware.device=cpu",
            "data.return_raw_chat=true", f"{key}.format=hermes"]
    cfg = load_config(None, base)
    settings = multiturn_settings(cfg.actor_rollout_ref.rollout.multi_turn)
    assert (settings.max_assistant_turns, settings.max_user_turns) == (3, 3)  # older verl's max_turns read
    reason = make_plan(cfg, for_execution=False).reasons["multi_turn"]
    assert "tools: calculator, python" in reason and "all turns" in reason
    with pytest.raises(UserError, match="format='llama3_json' is not supported"):
        make_plan(load_config(None, base + [f"{key}.format=llama3_json"]), for_execution=False)
    from rlanywhere.preflight import tool_problems  # the tools are built before anything loads

    missing = tool_problems(load_config(None, base + [f"{key}.tool_config_path={tmp_path / 'nope.yaml'}"]))
    assert len(missing) == 1 and "no such file" in missing[0]
    notices: list[str] = []
    load_config(None, base + [f"{key}.interaction_config_path=x.yaml"], notices=notices)
    assert any("interaction_config_path" in n and "no effect" in n for n in notices)


def test_truncation_sees_the_last_column_of_a_holed_mask():
    ids = torch.tensor([[5, 5, 7, 7, 5, 5], [5, 7, 7, 5, 2, 0]])
    holed = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 0, 1, 1, 0]])
    # row 0 fills the 6 columns without EOS (2): cut off; row 1 ends with EOS at column 4
    assert algo.truncated_rows(ids, holed, 6, [2]).tolist() == [True, False]
