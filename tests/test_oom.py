import os
import weakref

import pytest
import torch
from torch import nn

from rlanywhere.oom import (OOMGuard, OutOfMemoryAtMinimumError, OutOfMemoryRestart, is_oom_error, lowered_sizes,
                            oom_sizes_path, remembered_sizes)
from rlanywhere.plans import RuntimeSizes, SizeKind
from rlanywhere.runstate import RunState


def fake_oom(size):
    return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size} MiB")


def test_is_oom_error_recognises_devices_and_chains():
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("x"))
    assert is_oom_error(RuntimeError("CUDA error: out of memory"))
    assert is_oom_error(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert is_oom_error(RuntimeError("XPU out of memory. Tried to allocate 2 GiB"))
    assert is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)"))
    try:
        try:
            raise torch.OutOfMemoryError("inner")
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as outer:
        assert is_oom_error(outer)
    assert not is_oom_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_oom_error(ValueError("bad config"))


def test_sizes_halve_until_it_fits_and_plan_remembers():
    plan = RuntimeSizes(actor_micro_batch_size=16)
    logs, calls = [], []

    def fn(size):
        calls.append(size)
        if size > 4:
            raise fake_oom(size)
        return size * 10

    guard = OOMGuard(plan, log_fn=logs.append)
    assert guard.run("actor_update", fn, SizeKind.ACTOR_MICRO_BATCH) == 40
    assert calls == [16, 8, 4]
    assert plan.actor_micro_batch_size == 4
    assert [(e["phase"], e["attribute"], e["old_size"], e["new_size"]) for e in guard.events] == [
        ("actor_update", "actor_micro_batch_size", 16, 8),
        ("actor_update", "actor_micro_batch_size", 8, 4),
    ]
    assert len(logs) == 2 and "actor_update" in logs[0] and "16" in logs[0] and "8" in logs[0]
    # next step starts at the remembered size: no new OOM, no new event
    calls.clear()
    assert guard.run("actor_update", fn, SizeKind.ACTOR_MICRO_BATCH) == 40
    assert calls == [4] and len(guard.events) == 2


def test_only_first_k_calls_fail():
    plan = RuntimeSizes(max_token_len_per_micro_batch=4096)
    failures = {"left": 1}

    def fn(size):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("CUDA error: out of memory")
        return size

    guard = OOMGuard(plan, log_fn=lambda _: None)
    assert guard.run("logprobs", fn, SizeKind.TOKENS_PER_MICRO_BATCH) == 2048


def test_restarted_mini_batch_accumulates_the_same_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    inputs, targets = torch.randn(8, 5), torch.randn(8, 1)

    def accumulate(size, fail_above=None):
        optimizer.zero_grad(set_to_none=True)  # restartable: forget the failed attempt's partial gradient
        for start in range(0, 8, size):
            x, y = inputs[start : start + size], targets[start : start + size]
            loss = nn.functional.mse_loss(model(x), y, reduction="sum") / 8
            loss.backward()
            if fail_above is not None and size > fail_above:
                raise fake_oom(size)  # after a partial backward, like a real OOM mid mini-batch
        return [p.grad.clone() for p in model.parameters()]

    expected_full = accumulate(8)
    expected_at_2 = accumulate(2)
    plan = RuntimeSizes(actor_micro_batch_size=8)
    guard = OOMGuard(plan, log_fn=lambda _: None)
    got = guard.run("actor_update", lambda size: accumulate(size, fail_above=2), SizeKind.ACTOR_MICRO_BATCH)
    assert plan.actor_micro_batch_size == 2
    for g, e2, e8 in zip(got, expected_at_2, expected_full):
        assert torch.equal(g, e2)  # same micro-batching, same numbers
        torch.testing.assert_close(g, e8, atol=1e-6, rtol=1e-6)  # and the same gradient as without OOM


def test_failed_attempt_memory_is_released_before_retry():
    plan = RuntimeSizes(critic_micro_batch_size=4)
    refs = []

    def fn(size):
        big = torch.ones(1000, 1000)
        refs.append(weakref.ref(big))
        if size == 4:
            try:
                raise fake_oom(size)
            except RuntimeError as error:
                kept = error  # noqa: F841 - frame <-> traceback cycle, as library code often creates
                raise
        # the first attempt's tensor is gone: the traceback no longer pins its frame
        assert refs[0]() is None
        return size

    assert OOMGuard(plan, log_fn=lambda _: None).run("critic_update", fn, SizeKind.CRITIC_MICRO_BATCH) == 2


def test_relief_frees_memory_held_outside_the_phase_once_before_any_halving():
    from types import SimpleNamespace

    released = []
    sizes = RuntimeSizes(actor_micro_batch_size=1, rollout_batch_size=8)
    run = RunState(sizes, release_kv_between_phases=False, device="cpu")
    run.engine = SimpleNamespace(release_memory=lambda: released.append(True))
    logs, calls = [], []
    guard = OOMGuard(run, log_fn=logs.append)

    def rollout(size):
        calls.append(("rollout", size))
        if size > 4:
            raise fake_oom(size)
        return size

    assert run.relieve("actor_update") is None and not released  # a CPU run keeps its cache
    run.device = "cuda:0"
    assert guard.run("rollout", rollout, SizeKind.ROLLOUT_BATCH) == 4  # the rollout uses the cache: no relief
    assert not released and [e["new_size"] for e in guard.events] == [4]

    def update(size):  # fits once the cache is gone, already at its minimum micro-batch
        calls.append(("update", size))
        if not released:
            raise fake_oom(size)
        return "ok"

    assert guard.run("actor_update", update, SizeKind.ACTOR_MICRO_BATCH) == "ok"
    assert calls[-2:] == [("update", 1), ("update", 1)] and released == [True] and sizes.actor_micro_batch_size == 1
    assert guard.events[-1]["relieved"] and guard.events[-1]["old_size"] == guard.events[-1]["new_size"] == 1
    assert "KV cache" in logs[-1] and "same size" in logs[-1]
    assert run.release_kv_between_phases  # freed after every rollout from now
    assert "actor_update ran out of memory" in run.fallbacks["release_kv_between_phases"]
    assert run.ceilings() == {"rollout_batch_size": 4}  # a relief lowered nothing
    assert run.checkpoint_record()["release_kv_between_phases"]
    # nothing left to free: the next OOM at the minimum size is the usual error
    with pytest.raises(OutOfMemoryAtMinimumError):
        guard.run("actor_update", lambda size: (_ for _ in ()).throw(fake_oom(size)), SizeKind.ACTOR_MICRO_BATCH)
    assert released == [True]


def test_minimum_size_reraises_with_advice():
    plan = RuntimeSizes(actor_micro_batch_size=2)
    guard = OOMGuard(plan, log_fn=lambda _: None)

    def always_oom(size):
        raise fake_oom(size)

    with pytest.raises(OutOfMemoryAtMinimumError) as info:
        guard.run("actor_update", always_oom, SizeKind.ACTOR_MICRO_BATCH)
    message = str(info.value)
    for hint in ("actor_micro_batch_size=1", "lora_rank", "offload", "max_response_length", "train_batch_size"):
        assert hint in message
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert [e["new_size"] for e in guard.events] == [1]


def test_minimum_per_attribute_for_token_budgets():
    plan = RuntimeSizes(max_token_len_per_micro_batch=2048)
    guard = OOMGuard(plan, log_fn=lambda _: None, min_size={SizeKind.TOKENS_PER_MICRO_BATCH: 1024})

    def always_oom(size):
        raise fake_oom(size)

    with pytest.raises(OutOfMemoryAtMinimumError, match="max_token_len_per_micro_batch=1024"):
        guard.run("logprobs", always_oom, SizeKind.TOKENS_PER_MICRO_BATCH)


def test_a_token_budget_tries_its_minimum_before_giving_up():
    """The budget's minimum is a whole row (prompt + response: 1536 here), not a power-of-two fraction of the planned
    budget: 16384 -> 8192 -> 4096 -> 2048 -> 1536, which fits."""
    guard = OOMGuard(RuntimeSizes(max_token_len_per_micro_batch=16384), log_fn=lambda _: None,
                     min_size={SizeKind.TOKENS_PER_MICRO_BATCH: 1536})
    calls = []

    def fits_at_the_minimum(size):
        calls.append(size)
        if size > 1536:
            raise fake_oom(size)
        return size

    assert guard.run("actor_update", fits_at_the_minimum, SizeKind.TOKENS_PER_MICRO_BATCH) == 1536
    assert calls == [16384, 8192, 4096, 2048, 1536]
    with pytest.raises(OutOfMemoryAtMinimumError, match="max_token_len_per_micro_batch=1536 .its minimum"):
        guard.run("actor_update", lambda size: (_ for _ in ()).throw(fake_oom(size)), SizeKind.TOKENS_PER_MICRO_BATCH)


def test_other_errors_are_not_retried_and_bad_kinds_are_explained():
    plan = RuntimeSizes(actor_micro_batch_size=8, max_token_len_per_micro_batch=None)
    calls = []

    def broken(size):
        calls.append(size)
        raise ValueError("a real bug")

    guard = OOMGuard(plan, log_fn=lambda _: None)
    with pytest.raises(ValueError, match="a real bug"):
        guard.run("actor_update", broken, SizeKind.ACTOR_MICRO_BATCH)
    assert calls == [8] and guard.events == []
    with pytest.raises(TypeError, match="SizeKind"):  # a size is named by its kind, never by a field-name string
        guard.run("actor_update", broken, "actor_micro_batch_size")
    with pytest.raises(ValueError, match="positive int"):
        guard.run("logprobs", broken, SizeKind.TOKENS_PER_MICRO_BATCH)


def test_disabled_guard_runs_once_and_the_run_state_counts_every_lowering():
    sizes = RuntimeSizes(logprob_micro_batch_size=8)
    run = RunState(sizes)

    def oom_above_2(size):
        if size > 2:
            raise fake_oom(size)
        return size

    off = OOMGuard(run, log_fn=lambda _: None, enabled=False)
    with pytest.raises(torch.OutOfMemoryError):
        off.run("log_probs", oom_above_2, SizeKind.LOGPROB_MICRO_BATCH)
    assert sizes.logprob_micro_batch_size == 8 and off.events == [] and run.changes == 0
    on = OOMGuard(run, log_fn=lambda _: None)
    assert on.run("log_probs", oom_above_2, SizeKind.LOGPROB_MICRO_BATCH) == 2
    assert run.changes == 2 and run.ceilings() == {"logprob_micro_batch_size": 2}  # 8 -> 4 -> 2
    assert on.run("log_probs", oom_above_2, SizeKind.LOGPROB_MICRO_BATCH) == 2 and run.changes == 2


def test_size_kinds_name_every_runtime_size():
    from dataclasses import fields

    assert sorted(kind.value for kind in SizeKind) == sorted(f.name for f in fields(RuntimeSizes))


def test_a_matched_phase_runs_once_and_stops_the_job_with_the_halved_size_saved(tmp_path):
    """A sharded update cannot be redone on one rank: no retry; the halved size goes to the file the next launch
    reads, and the error says so. The same sizes read back lower a fresh plan's, never raise them."""
    sizes = RuntimeSizes(actor_micro_batch_size=8, logprob_micro_batch_size=2)
    calls = []

    def oom(size):
        calls.append(size)
        raise fake_oom(size)

    run = RunState(sizes, run_dir=str(tmp_path), rank=1)
    guard = OOMGuard(run, log_fn=lambda _: None)
    with pytest.raises(OutOfMemoryRestart) as info:
        guard.run_matched("actor_update", oom, SizeKind.ACTOR_MICRO_BATCH)
    assert calls == [8] and run.changes == 1 and sizes.actor_micro_batch_size == 4
    assert "actor_micro_batch_size=4" in str(info.value) and oom_sizes_path(str(tmp_path)) in str(info.value)
    record = remembered_sizes(str(tmp_path))
    assert record["sizes"] == {"actor_micro_batch_size": 4}  # the lowered size only: the others stay the plan's
    assert {k: record["event"][k] for k in ("phase", "old_size", "new_size", "rank")} == {
        "phase": "actor_update", "old_size": 8, "new_size": 4, "rank": 1}

    fresh = RuntimeSizes(actor_micro_batch_size=16, logprob_micro_batch_size=8)
    assert lowered_sizes(fresh, record) == [("actor_micro_batch_size", 16, 4)]
    assert fresh.logprob_micro_batch_size == 8  # not lowered by an out-of-memory event: the new plan's
    assert lowered_sizes(fresh, None) == [] and remembered_sizes(str(tmp_path / "other")) is None

    from rlanywhere.checkpoint import CheckpointError

    for damage in ("{not json", '{"sizes": {"actor_batch": 2}, "event": {}}', "[]"):  # edited, another version's
        with open(oom_sizes_path(str(tmp_path)), "w") as handle:
            handle.write(damage)
        with pytest.raises(CheckpointError, match="oom_sizes.json .*delete it to run at the planned sizes"):
            remembered_sizes(str(tmp_path))


def test_a_matched_phase_at_its_minimum_or_failing_otherwise_saves_nothing(tmp_path):
    from rlanywhere.oom import oom_sizes_path

    sizes = RuntimeSizes(actor_micro_batch_size=1)
    guard = OOMGuard(RunState(sizes, run_dir=str(tmp_path)), log_fn=lambda _: None)

    def oom(size):
        raise fake_oom(size)

    with pytest.raises(OutOfMemoryAtMinimumError):
        guard.run_matched("actor_update", oom, SizeKind.ACTOR_MICRO_BATCH)
    with pytest.raises(ValueError, match="a real bug"):
        guard.run_matched("actor_update", lambda size: (_ for _ in ()).throw(ValueError("a real bug")),
                          SizeKind.ACTOR_MICRO_BATCH)
    assert not os.path.exists(oom_sizes_path(str(tmp_path))) and guard.events == []
    assert sizes.actor_micro_batch_size == 1
    assert guard.run_matched("actor_update", lambda size: size * 10, SizeKind.ACTOR_MICRO_BATCH) == 10
