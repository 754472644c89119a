"""Compiling a decode step's Triton kernels side by side (rollout/kernel_compiles.py): `launch` turns into a compile
request inside `side_by_side`, and DecodeRunner's rehearsal of a new kind of step changes nothing the step computes.
The engines run on the CPU with Triton's interpreter (TRITON_INTERPRET=1, conftest.py), which ignores compile
requests; the compiles themselves need a GPU (bench/decode_profile.py, the first steps of bench/first_steps.py)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from rlanywhere.plans import RolloutPlan
from rlanywhere.rollout import FastEngine, SamplingParams, kernel_compiles

from .test_decode_attention import interpreter_runs
from .test_rollout import PAD, PROMPTS, tiny_model


class RecordingKernel:
    """Stands in for a Triton JIT function: records launches (kernel[grid](...)) and compile requests (warmup)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("compile", grid, args, kwargs))


@pytest.mark.skipif(kernel_compiles._async_compile_mode() is None, reason="needs Triton >= 3.4 (AsyncCompileMode)")
def test_launch_only_asks_for_the_compile_inside_side_by_side_and_launches_again_after():
    kernel = RecordingKernel()
    kernel_compiles.launch(kernel, (4, 2), "x", 3, BLOCK=16)
    with kernel_compiles.side_by_side():
        kernel_compiles.launch(kernel, (8,), "y", 5, BLOCK=32, num_warps=2)
    kernel_compiles.launch(kernel, (1,), "z", 7, BLOCK=64)
    assert kernel.calls == [("launch", (4, 2), ("x", 3), {"BLOCK": 16}),
                            ("compile", (8,), ("y", 5), {"BLOCK": 32, "num_warps": 2}),
                            ("launch", (1,), ("z", 7), {"BLOCK": 64})]


@pytest.mark.skipif(kernel_compiles._async_compile_mode() is None, reason="needs Triton >= 3.4 (AsyncCompileMode)")
def test_a_failure_inside_side_by_side_ends_it_and_launches_run_again():
    kernel = RecordingKernel()
    with pytest.raises(ValueError, match="in the step"):
        with kernel_compiles.side_by_side():
            raise ValueError("in the step")
    kernel_compiles.launch(kernel, (1,), "a")
    assert kernel.calls == [("launch", (1,), ("a",), {})]


def test_only_compiled_cuda_kernels_are_compiled_ahead(monkeypatch):
    monkeypatch.setattr(kernel_compiles, "_async_compile_mode", lambda: object)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert kernel_compiles.available(torch.device("cuda", 0))
    assert not kernel_compiles.available(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not kernel_compiles.available(torch.device("cuda", 0))
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(kernel_compiles, "_async_compile_mode", lambda: None)  # Triton < 3.4
    assert not kernel_compiles.available(torch.device("cuda", 0))
    assert 1 <= kernel_compiles.compile_threads() <= kernel_compiles.MAX_COMPILE_THREADS


FUSED = RolloutPlan(decode_attention="triton", fuse_weights=True, fused_kv_write=True, compile_elementwise=True,
                    fused_sampling=True, check_every=2)


@pytest.mark.skipif(not interpreter_runs(),
                    reason="needs triton >= 3.9 and TRITON_INTERPRET=1 (scripts/test.sh, conftest.py)")
@pytest.mark.parametrize("dtype,plan", [
    (torch.bfloat16, FUSED),  # every elementwise op, RoPE + cache write + attention and the sampler: Triton
    (torch.float32, dataclasses.replace(FUSED, fused_kv_write=False)),  # the cache written by torch ops
])
def test_rehearsing_each_new_kind_of_step_changes_nothing_it_computes(monkeypatch, dtype, plan):
    model = tiny_model("qwen2").to(dtype)
    runs = {}
    real_side_by_side = kernel_compiles.side_by_side
    for rehearse in (False, True):
        monkeypatch.setattr(kernel_compiles, "available", lambda device, rehearse=rehearse: rehearse)
        rehearsals = []

        @contextlib.contextmanager
        def counted():
            rehearsals.append(1)
            with real_side_by_side():
                yield

        monkeypatch.setattr(kernel_compiles, "side_by_side", counted)
        engine = FastEngine(model, None, plan, pad_token_id=PAD)
        greedy = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=0))
        sampled = [engine.generate(PROMPTS, SamplingParams(max_new_tokens=tokens, temperature=0.8, n=2),
                                   generator=torch.Generator().manual_seed(seed)) for seed, tokens in ((7, 3), (8, 2))]
        if rehearse:  # a step without Triton kernels (SDPA attention, eager ops, the torch sampler): nothing to compile
            no_triton = FastEngine(model, None, RolloutPlan(check_every=2), pad_token_id=PAD)
            no_triton.generate(PROMPTS, SamplingParams(max_new_tokens=3, temperature=0))
        runs[rehearse] = (greedy, *sampled, len(rehearsals))
    *plain_runs, _ = runs[False]
    *rehearsed_runs, rehearsals = runs[True]
    # every step samples in the step, from the wave's seed: one kind, rehearsed once per cache (the sampled calls'
    # 8 rows grow the 4-row cache of the greedy one; the third call reuses it)
    assert rehearsals == 2
    for plain, with_rehearsal in zip(plain_runs, rehearsed_runs):
        assert torch.equal(plain.response_ids, with_rehearsal.response_ids)
        assert torch.equal(plain.response_logprobs, with_rehearsal.response_logprobs)
