"""Shared fixtures: a tiny random Qwen2 model with a real (word-level) tokenizer and chat template, saved to disk
like any HF checkpoint, and small GSM8K / arithmetic parquet files. No downloads; built in about a second."""

from __future__ import annotations

import gc
import json
import os
import re
import sys
from pathlib import Path

import pytest

# Triton kernels (rollout/decode_attention.py) are tested on the CPU under Triton's interpreter, which triton picks
# when it is imported: set before any test imports it (the tests use no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_language_once_per_launch(interpreter) -> None:
    """Triton's interpreter swaps triton.language's functions for interpreted ones at each kernel launch, and again
    at every call of a @triton.jit helper inside the kernel (philox, a kernel's own helpers): about 2 ms a call,
    a third of the fused sampler's time in these tests. A helper whose language modules the running launch has
    patched already skips it (what it would set is set); the kernels run the same interpreted code."""
    import inspect

    import triton.language as tl

    original, patched = interpreter._patch_lang, set()  # ids of the modules the running launch has patched

    def patch_lang(fn):
        langs = {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}
        if patched and langs <= patched:
            return interpreter._LangPatchScope()
        launch, scope = not patched, original(fn)
        patched.update(langs)
        if launch:  # the launch's scope is restored when the grid is done: so is the record
            restore = scope.restore
            scope.restore = lambda: (restore(), patched.clear())
        return scope

    interpreter._patch_lang = patch_lang


class _PatchTritonInterpreterOnImport:
    """Applies _patch_language_once_per_launch when triton's interpreter is first imported (by a test that runs a
    kernel), so that workers which run no kernel never import triton."""

    name = "triton.runtime.interpreter"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            if hasattr(module, "_patch_lang") and hasattr(module, "_LangPatchScope"):
                _patch_language_once_per_launch(module)
        spec.loader.exec_module = exec_then_patch
        return spec


if os.environ["TRITON_INTERPRET"] == "1":
    sys.meta_path.insert(0, _PatchTritonInterpreterOnImport())

# Subprocesses (`python -m rlanywhere.cli`, torchrun's ranks, the examples) import this checkout too, as the tests
# themselves do (pyproject: pythonpath = src), not whatever copy is installed.
SRC = Path(__file__).resolve().parents[1] / "src"
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != str(SRC):
    os.environ["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])

# A subprocess (a CLI run, torchrun's ranks, mp.spawn's, the reward workers) runs beside the test process and often
# beside a sibling: one torch thread each. Tiny models gain nothing from a second thread, and OpenMP threads that
# outnumber the cores wait for each other at every op. (The test process itself: _quiet_threads below.)
os.environ.setdefault("OMP_NUM_THREADS", "1")

SHARED = Path(__file__).resolve().parents[2] / "shared"
SHIPPED = Path(__file__).resolve().parent / "data"  # a fresh clone's small copies (see tests/data/README.md)


def shared_or_shipped(shared: Path, shipped: Path) -> Path:
    """The team's full copy in ../shared when the clone has one beside it, else the copy shipped in tests/data."""
    return shared if shared.exists() else shipped


GSM8K_DIR = shared_or_shipped(SHARED / "data" / "gsm8k", SHIPPED / "gsm8k")
VERL_P40_ARGS = shared_or_shipped(SHARED / "fixtures" / "verl-p40-ppo.args", SHIPPED / "fixtures" / "verl-p40-ppo.args")
GSM8K_TOOL_CONFIG = SHIPPED / "fixtures" / "gsm8k_tool_config.yaml"  # verl's GSM8K tool config (multi-turn tests)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)


def _subset_lines(name: str, count: int) -> list[str]:
    with open(GSM8K_DIR / name) as handle:
        return [next(handle) for _ in range(count)]


def build_tiny_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    words = sorted({w for text in texts for w in re.findall(r"\w+|[^\w\s]", text)})
    # Every number 0..199 and every digit, so a random model can "answer" arithmetic and GSM8K prompts.
    words = sorted(set(words) | {str(i) for i in range(200)} | set("####=+-*.,$"))
    vocab = {tok: i for i, tok in enumerate(specials + [w for w in words if w not in specials])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<|im_end|>", bos_token=None,
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="session")
def gsm8k_subset(tmp_path_factory) -> Path:
    """A 64/32-row copy of the shared GSM8K jsonl files (the real ones are read-only and large)."""
    out = tmp_path_factory.mktemp("gsm8k_src")
    (out / "train.jsonl").write_text("".join(_subset_lines("train.jsonl", 64)))
    (out / "test.jsonl").write_text("".join(_subset_lines("test.jsonl", 32)))
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, gsm8k_subset) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    texts = [json.loads(line)["question"] + " " + json.loads(line)["answer"]
             for name in ("train.jsonl", "test.jsonl") for line in (gsm8k_subset / name).read_text().splitlines()]
    texts.append("What is 12 + 34 ? Output the final answer after \" #### \" . Let ' s think step by step")
    tokenizer = build_tiny_tokenizer(texts)
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=512,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny_qwen2")
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def arith_data(tmp_path_factory) -> Path:
    from rlanywhere.data import prepare_arithmetic

    out = tmp_path_factory.mktemp("arith")
    prepare_arithmetic(str(out), train_size=64, test_size=16, digits=1, operators="+", seed=0)
    return out


@pytest.fixture(scope="session")
def gsm8k_data(tmp_path_factory, gsm8k_subset) -> Path:
    from rlanywhere.data import prepare_gsm8k

    out = tmp_path_factory.mktemp("gsm8k_parquet")
    prepare_gsm8k(str(gsm8k_subset), str(out))
    return out


@pytest.fixture
def preempt_while_scoring(monkeypatch):
    """`fit_preempted(trainer)`: fit `trainer` while a SIGTERM comes as the rollout of its second step (global_step
    1) is scored, before any update of that step (so the step is dropped); returns the RunInterrupted it stops
    with. Scoring is itself again afterwards."""
    import signal

    from rlanywhere.rollout_phase import RolloutPhase
    from rlanywhere.runguard import RunInterrupted

    original_score = RolloutPhase.score

    def fit_preempted(trainer, at_step: int = 1) -> RunInterrupted:
        def score_then_preempted(self, items, rollout, n):
            if trainer.global_step == at_step:
                os.kill(os.getpid(), signal.SIGTERM)
            return original_score(self, items, rollout, n)

        monkeypatch.setattr(RolloutPhase, "score", score_then_preempted)
        try:
            with pytest.raises(RunInterrupted) as info:
                trainer.fit()
        finally:
            monkeypatch.setattr(RolloutPhase, "score", original_score)
        return info.value

    return fit_preempted


def _threads_per_worker() -> int:
    """Two cores on CI: more torch threads than cores only adds contention; with pytest-xdist workers (-n N) the
    cores are shared between them."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, min(2, os.cpu_count() or 1) // workers)


@pytest.fixture(autouse=True)
def _quiet_threads():
    import torch

    torch.set_num_threads(_threads_per_worker())
    yield


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves os.environ as it found it. rlanywhere sets process-wide variables as it runs (the CUDA
    allocator's settings, Triton's cache folder), and one left behind would change every later test of this
    worker: the warm ranks of tests/warm_ranks.py, whose environment would then differ from their zygote's, would
    all start cold."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


# ---------------------------------------------------------------------------------------------- progress of long tests
# The suite runs quietly (-q dots); a test that runs long says so while it runs and when it ends, so that a stall is
# never silent. With pytest-xdist these hooks run in the controller, which hears every worker's start and finish.
STILL_RUNNING_AFTER_S = float(os.environ.get("RLA_TEST_STILL_RUNNING_S", 30))
SLOW_TEST_LINE_S = 15.0


class _LongTestReporter:
    def __init__(self, config):
        import threading

        self.config, self.started, self.announced = config, {}, set()
        self.lock, self.done = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _write(self, text: str) -> None:
        # while a test runs in this process its output is captured (fd 1 points at a file): write to the terminal
        # pytest saved; between tests, and in an xdist controller, the reporter's own line
        capman = self.config.pluginmanager.get_plugin("capturemanager")
        out = getattr(getattr(capman, "_global_capturing", None), "out", None)
        saved = getattr(out, "targetfd_save", None)
        if self.started and isinstance(saved, int) and not os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
            os.write(saved, f"\n{text}\n".encode())
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(text)

    def _watch(self) -> None:
        import time

        while not self.done.wait(5.0):
            now = time.monotonic()
            with self.lock:
                long = [(nodeid, now - start) for nodeid, start in self.started.items()
                        if now - start >= STILL_RUNNING_AFTER_S and nodeid not in self.announced]
                self.announced.update(nodeid for nodeid, _ in long)
            for nodeid, seconds in long:
                self._write(f"  ... still running after {seconds:.0f} s: {nodeid}")

    @pytest.hookimpl
    def pytest_runtest_logstart(self, nodeid, location):
        import time

        with self.lock:
            self.started[nodeid] = time.monotonic()

    @pytest.hookimpl
    def pytest_runtest_logfinish(self, nodeid, location):
        with self.lock:
            self.started.pop(nodeid, None)
            self.announced.discard(nodeid)

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if report.when == "call" and report.duration >= SLOW_TEST_LINE_S:
            self._write(f"  {report.duration:5.1f} s {report.outcome}: {report.nodeid}")


def pytest_configure(config):
    # the controller (or a plain run) reports; xdist workers' output is not shown
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        config._long_test_reporter = _LongTestReporter(config)
        config.pluginmanager.register(config._long_test_reporter, "long-test-reporter")


def pytest_unconfigure(config):
    reporter = getattr(config, "_long_test_reporter", None)
    if reporter is not None:
        reporter.done.set()
    gc.unfreeze()  # see pytest_collection_finish


# ------------------------------------------------------------------------------------------------ garbage collection
# A pytest process holds torch, transformers, triton and every test module: hundreds of thousands of objects that live
# until it exits, which each full (oldest-generation) collection walked again, a quarter of a worker's time. Frozen
# (gc.freeze) after collection, and after each test file with what that file's tests imported and left (garbage
# collected first), they are left out of later collections; objects the tests make are collected as before. They are
# unfrozen at the end, so the interpreter's exit frees them as it did (libtriton's bindings report "leaked"
# objects at exit otherwise).
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)  # (old-style wrapper: pytest >= 7)
def pytest_runtest_teardown(item, nextitem):
    yield
    if nextitem is None or nextitem.path != item.path:  # the file's module-scoped fixtures are torn down
        gc.collect()
        gc.freeze()
