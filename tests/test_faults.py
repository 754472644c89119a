"""Fault injection, done for real: truncated and zero-filled checkpoint files, NaN weights, a full disk, hanging
and misbehaving reward functions, bad data rows, two processes on one run directory, and SIGTERM / Ctrl-C sent
to a child `rlanywhere train` process. docs/reliability.md lists each fault with the test that shows it."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

from rlanywhere.checkpoint import (MANIFEST_FILE, CheckpointError, CheckpointWriteError, list_checkpoints,
                                   load_checkpoint, resume_latest, verify_checkpoint, write_manifest)
from rlanywhere.checkpointer import save_checkpoint

from . import warm_ranks
from .test_checkpoint import FakeTokenizer, tiny_lm


# ------------------------------------------------------------------------------------------------ checkpoints
def _save(run_dir, step, actor, opt):
    return save_checkpoint(str(run_dir), step, actor=actor, tokenizer=FakeTokenizer(), optimizers={"actor": opt},
                           schedulers={}, trainer_state={"loader": {"position": step}})


def _three_checkpoints(run_dir):
    """Steps 1, 2, 3 with distinct weights; returns the actor's embedding at each step."""
    actor = tiny_lm(0)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    embeddings = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            actor.model.embed_tokens.weight.add_(float(step))
        embeddings[step] = actor.model.embed_tokens.weight.detach().clone()
        _save(run_dir, step, actor, opt)
    return embeddings


def _resume(run_dir):
    actor = tiny_lm(7)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    found = resume_latest(str(run_dir), lambda p: load_checkpoint(p, actor=actor, optimizers={"actor": opt},
                                                                 schedulers={}))
    return found, actor


def _weights_file(run_dir, step):
    return run_dir / "checkpoints" / f"global_step_{step}" / "actor" / "model.safetensors"


@pytest.mark.parametrize("damage", ["truncate", "zero_fill", "optim_truncate", "state_garbage"])
def test_damaged_latest_checkpoint_is_named_skipped_and_previous_used(tmp_path, damage, caplog):
    embeddings = _three_checkpoints(tmp_path)
    ckpt = tmp_path / "checkpoints" / "global_step_3"
    target = {"truncate": _weights_file(tmp_path, 3), "zero_fill": _weights_file(tmp_path, 3),
              "optim_truncate": ckpt / "optim.pt", "state_garbage": ckpt / "trainer_state.json"}[damage]
    size = target.stat().st_size
    if damage == "zero_fill":
        target.write_bytes(b"\0" * size)  # same size: only the checksum can tell
    elif damage == "state_garbage":
        target.write_text("{not json")
    else:
        with open(target, "r+b") as handle:
            handle.truncate(size // 2)
    assert verify_checkpoint(str(ckpt)) is not None and target.name in verify_checkpoint(str(ckpt))
    (path, state), actor = _resume(tmp_path)
    assert path.endswith("global_step_2") and state["global_step"] == 2
    assert torch.equal(actor.model.embed_tokens.weight, embeddings[2])
    assert "global_step_3" in caplog.text and target.name in caplog.text
    # moved aside: never picked again, kept for inspection
    assert not ckpt.exists() and (tmp_path / "checkpoints" / "global_step_3.damaged").exists()
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["global_step_1", "global_step_2"]


def test_damage_without_a_manifest_is_still_caught_at_load(tmp_path):
    """A checkpoint without its manifest: a truncated file fails the load, named, and is skipped."""
    _three_checkpoints(tmp_path)
    os.remove(tmp_path / "checkpoints" / "global_step_3" / MANIFEST_FILE)
    weights = _weights_file(tmp_path, 3)
    with open(weights, "r+b") as handle:
        handle.truncate(100)
    (path, _), _ = _resume(tmp_path)
    assert path.endswith("global_step_2")


def test_nan_weights_in_a_checkpoint_are_detected_at_load(tmp_path):
    from safetensors.torch import load_file, save_file

    _three_checkpoints(tmp_path)
    weights = _weights_file(tmp_path, 3)
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    tensors[name][0] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    write_manifest(str(weights.parent.parent))  # as if the NaN had been saved by the run itself
    (path, _), actor = _resume(tmp_path)
    assert path.endswith("global_step_2")
    assert all(torch.isfinite(p).all() for p in actor.parameters())


def test_every_checkpoint_damaged_is_an_error_naming_them_and_nothing_is_moved(tmp_path):
    _three_checkpoints(tmp_path)
    for step in (1, 2, 3):
        _weights_file(tmp_path, step).write_bytes(b"garbage")
    with pytest.raises(CheckpointError) as info:
        _resume(tmp_path)
    message = str(info.value)
    assert all(f"global_step_{s}" in message for s in (1, 2, 3)) and "overwrite_run_dir" in message
    assert len(list_checkpoints(str(tmp_path))) == 3


def test_resuming_an_earlier_step_moves_later_checkpoints_aside(tmp_path):
    """E.g. a diverged run resumed from its last good checkpoint: the diverged later ones must never be resumed."""
    from rlanywhere.checkpoint import find_latest_checkpoint, retire_later_checkpoints

    _three_checkpoints(tmp_path)
    moved = retire_later_checkpoints(str(tmp_path), 1)
    assert [os.path.basename(p) for p in moved] == ["global_step_2", "global_step_3"]
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["global_step_1"]
    assert find_latest_checkpoint(str(tmp_path)).endswith("global_step_1")
    assert (tmp_path / "checkpoints" / "global_step_3.stale" / MANIFEST_FILE).exists()


def test_disk_full_during_save_removes_tmp_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    actor = tiny_lm(0)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    _save(tmp_path, 1, actor, opt)

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointWriteError, match="no space left on device") as info:
        _save(tmp_path, 2, actor, opt)
    assert "global_step_1" in str(info.value)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert verify_checkpoint(str(tmp_path / "checkpoints" / "global_step_1")) is None


def test_torch_save_unexpected_pos_counts_as_disk_full(tmp_path, monkeypatch):
    actor = tiny_lm(0)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)

    def short_write(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4480 vs 4374")

    monkeypatch.setattr(torch, "save", short_write)
    with pytest.raises(CheckpointWriteError, match="no space left"):
        _save(tmp_path, 1, actor, opt)
    assert os.listdir(tmp_path / "checkpoints") == []


def test_non_finite_weights_are_never_saved(tmp_path):
    actor = tiny_lm(0)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    _save(tmp_path, 1, actor, opt)
    with torch.no_grad():
        actor.model.norm.weight[0] = float("inf")
    with pytest.raises(CheckpointError, match="model.norm.weight.*global_step_1"):
        _save(tmp_path, 2, actor, opt)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["global_step_1"]


# ------------------------------------------------------------------------------------------------ rewards
def test_reward_non_numbers_and_sys_exit_are_counted_errors():
    from rlanywhere.rewards import RewardManager

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        import sys

        return {"str": "1.0", "bool": True, "np": np.float32(0.5), "tensor": torch.tensor(0.25),
                "dict_str": {"score": "1"}, "exit": None}.get(solution_str) if solution_str != "exit" else sys.exit(3)

    manager = RewardManager(scorer)
    scores, info = manager(["str", "bool", "np", "tensor", "dict_str", "exit"], ["1"] * 6, ["x"] * 6)
    assert scores.tolist() == [0.0, 0.0, 0.5, 0.25, 0.0, 0.0]
    assert info["num_errors"] == 4
    assert "SystemExit" in manager.last_error


@pytest.mark.slow
def test_hanging_reward_times_out_scores_zero_and_the_stuck_pool_is_replaced():
    import time

    from rlanywhere.rewards import RewardManager

    def scorer(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "sleep":
            time.sleep(60)  # interruptible: SIGALRM cuts it at the per-call limit
        if solution_str == "stuck":
            import signal

            signal.signal(signal.SIGALRM, signal.SIG_IGN)  # as if stuck in C code: the alarm cannot stop it
            time.sleep(60)
        if solution_str == "exit":
            import sys

            sys.exit(3)
        return 1.0

    manager = RewardManager(scorer, timeout_s=1.0, num_workers=2)
    try:
        start = time.monotonic()
        scores, info = manager(["ok", "sleep", "exit", "ok"], ["1"] * 4, ["x"] * 4)
        assert scores.tolist() == [1.0, 0.0, 0.0, 1.0] and info["num_errors"] == 2
        assert time.monotonic() - start < 10
        scores, info = manager(["stuck", "ok", "ok"], ["1"] * 3, ["x"] * 3)
        assert scores.tolist() == [0.0, 1.0, 1.0] and info["num_errors"] == 1
        assert manager.pools_replaced == 1 and "replaced" in manager.last_error
        assert time.monotonic() - start < 20
        scores, info = manager(["ok", "ok"], ["1"] * 2, ["x"] * 2)  # the new pool works
        assert scores.tolist() == [1.0, 1.0] and info["num_errors"] == 0
    finally:
        manager.close()


def _hang_before_starting(*_initargs):
    """A pool worker stuck inside fork, as one forked while another thread held an interpreter lock: it never runs
    _init_worker, keeps its parent's process group and a Python SIGTERM handler it never gets to run."""
    import signal
    import time

    signal.signal(signal.SIGTERM, lambda *_: None)
    while True:
        time.sleep(3600)


def test_closing_the_reward_pool_does_not_wait_for_a_worker_stuck_before_it_started(monkeypatch):
    """Seen under torchrun: rank 0's RewardManager.close() waited forever in Pool.terminate() for such a worker
    while rank 1 waited in the final model's all-gather."""
    import threading

    from rlanywhere import rewards

    monkeypatch.setattr(rewards, "_init_worker", _hang_before_starting)
    manager = rewards.RewardManager(lambda *args: 1.0, timeout_s=1.0, num_workers=2)
    manager._get_pool()
    workers = list(manager._workers)
    assert len(workers) == 2
    closer = threading.Thread(target=manager.close, daemon=True)
    try:
        closer.start()
        closer.join(timeout=30)
        assert not closer.is_alive(), "close() waited for a worker that never started"
        assert not any(worker.is_alive() for worker in workers)
    finally:  # a failing close() must not leave the workers to hang the test process at exit
        for worker in workers:
            worker.kill()


# ------------------------------------------------------------------------------------------------ data
def _dataset(path, tiny_model_dir):
    from transformers import AutoTokenizer

    from rlanywhere.data import RLDataset

    return RLDataset([str(path)], AutoTokenizer.from_pretrained(tiny_model_dir), max_prompt_length=64)


@pytest.mark.parametrize("damage, expected", [
    # a struct field left out of one row reads back as null: parquet has one schema for all rows
    (lambda row: row["reward_model"].pop("ground_truth"), "row 5 (0-based): reward_model.ground_truth is null"),
    (lambda row: row["reward_model"].update(ground_truth=" "), "row 5 (0-based): reward_model.ground_truth is empty"),
    (lambda row: row["reward_model"].update(ground_truth=None), "row 5 (0-based): reward_model.ground_truth is null"),
    (lambda row: row.update(reward_model=None), "row 5 (0-based): column 'reward_model' is null"),
    (lambda row: row.update(prompt=None), "row 5 (0-based): column 'prompt' is null"),
], ids=["ground_truth_left_out", "ground_truth_blank", "ground_truth_null", "reward_model_null", "prompt_null"])
def test_a_bad_row_is_named_by_file_row_and_column(tmp_path, arith_data, tiny_model_dir, damage, expected):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlanywhere.data import DataError

    rows = pq.read_table(arith_data / "test.parquet").to_pylist()
    for row in rows:
        row["reward_model"] = dict(row["reward_model"])
    damage(rows[5])
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError) as info:
        _dataset(path, tiny_model_dir)
    assert str(path) in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("content", ['{"question": "1+1", "answer": "2"}\n', "question,answer\n1+1,2\n",
                                     "\0\1garbage"])
def test_non_parquet_data_is_one_line_naming_the_file_and_prepare_generic(tmp_path, tiny_model_dir, content):
    from rlanywhere.data import DataError

    path = tmp_path / "train.parquet"
    path.write_text(content)
    with pytest.raises(DataError, match="not a readable parquet file.*rlanywhere prepare generic") as info:
        _dataset(path, tiny_model_dir)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ CPU memory
def test_cpu_allocation_failure_shrinks_the_plan_like_cuda_oom():
    from rlanywhere.oom import OOMGuard, is_oom_error
    from rlanywhere.plans import RuntimeSizes, SizeKind

    cpu_message = ("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                   "to allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)")
    assert is_oom_error(RuntimeError(cpu_message)) and is_oom_error(MemoryError())
    plan_sizes = RuntimeSizes(actor_micro_batch_size=8)
    sizes = []

    def phase(size):
        sizes.append(size)
        if size > 2:
            raise RuntimeError(cpu_message)
        return size

    assert OOMGuard(plan_sizes, log_fn=lambda _: None).run("actor_update", phase, SizeKind.ACTOR_MICRO_BATCH) == 2
    assert sizes == [8, 4, 2] and plan_sizes.actor_micro_batch_size == 2


# ------------------------------------------------------------------------------------------------ runs
def _overrides(model_dir, data_dir, run_dir, **extra):
    from .test_e2e import base_overrides

    settings = {"algorithm.adv_estimator": "grpo", "trainer.test_freq": -1, "trainer.val_before_train": False,
                "trainer.save_freq": 1, "trainer.total_training_steps": 3}
    return base_overrides(model_dir, data_dir, run_dir, **{**settings, **extra})


def _trainer(overrides):
    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan
    from rlanywhere.trainer import RLTrainer

    cfg = load_config(None, overrides)
    return RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)


def _train_rows(run_dir):
    from rlanywhere.tracking import read_metrics

    return {m["step"]: m for m in read_metrics(run_dir) if "reward/mean" in m}


@pytest.mark.slow
def test_absurd_lr_stops_after_k_skipped_updates_naming_the_last_good_checkpoint(tiny_model_dir, arith_data,
                                                                                 tmp_path):
    from rlanywhere.runguard import TrainingStopped

    # lr 1e5 with weight decay 0.01 multiplies every weight by -999 a step: inf activations, NaN grads in a few steps
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "actor_rollout_ref.actor.optim.lr": 1e5, "trainer.total_training_steps": 12,
        "trainer.max_consecutive_nonfinite_updates": 2}))
    with pytest.raises(TrainingStopped, match="2 actor optimizer updates in a row had a NaN/inf") as info:
        trainer.fit()
    assert trainer.global_step < 12
    good = trainer.stops.last_good_checkpoint
    assert good and f"trainer.resume_from_path={good}" in str(info.value)
    assert verify_checkpoint(good) is None
    # every checkpoint on disk is finite: NaN weights are never saved
    from rlanywhere.checkpoint import _load_safetensors_dir

    for path in list_checkpoints(str(tmp_path / "run")):
        assert all(torch.isfinite(t).all() for t in _load_safetensors_dir(os.path.join(path, "actor")).values())


@pytest.mark.slow
def test_every_reward_call_failing_stops_after_k_steps_and_shows_in_the_console(tiny_model_dir, arith_data,
                                                                                  tmp_path, capsys):
    from rlanywhere.runguard import TrainingStopped

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    raise ValueError('answer key not found')\n")
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "custom_reward_function.path": str(reward), "trainer.total_training_steps": 6,
        "trainer.max_consecutive_failed_reward_steps": 2}))
    with pytest.raises(TrainingStopped, match="every reward call failed for 2 steps.*answer key not found"):
        trainer.fit()
    assert trainer.global_step == 2
    rows = _train_rows(tmp_path / "run")
    assert [rows[s]["reward/errors"] for s in (1, 2)] == [8.0, 8.0]  # 4 prompts x 2 samples, all failed
    captured = capsys.readouterr()
    assert "reward/errors 8" in captured.out + captured.err


# ------------------------------------------------------------------------------------------------ run directory
def _cfg(run_dir, *extra):
    from rlanywhere.config import load_config

    return load_config(None, [f"trainer.default_local_dir={run_dir}", *extra])


def _fake_checkpoint(run_dir, step, cfg):
    from rlanywhere.config import to_yaml

    path = run_dir / "checkpoints" / f"global_step_{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text("{}")
    (path / "config.yaml").write_text(to_yaml(cfg))
    return path


def test_checkpoints_path_that_is_a_file_is_refused_before_loading(tmp_path):
    from rlanywhere.runguard import RunDirError, prepare_run_dir

    (tmp_path / "checkpoints").write_text("oops")
    with pytest.raises(RunDirError, match="is a file, not a directory"):
        prepare_run_dir(str(tmp_path), _cfg(tmp_path))


def test_resume_mode_disable_over_an_earlier_run_refuses_unless_overwrite(tmp_path):
    from rlanywhere.runguard import RunDirError, prepare_run_dir

    _fake_checkpoint(tmp_path, 4, _cfg(tmp_path))
    with pytest.raises(RunDirError, match="global_step_4.*overwrite_run_dir=true"):
        prepare_run_dir(str(tmp_path), _cfg(tmp_path, "trainer.resume_mode=disable"))
    assert (tmp_path / "checkpoints" / "global_step_4").exists()
    lock = prepare_run_dir(str(tmp_path), _cfg(tmp_path, "trainer.resume_mode=disable",
                                               "trainer.overwrite_run_dir=true"))
    lock.release()
    assert os.listdir(tmp_path / "checkpoints") == []  # never a mix of two runs


@pytest.mark.parametrize("change", ["trainer.seed=9", "data.train_batch_size=8", "actor_rollout_ref.model.path=other",
                                    "algorithm.adv_estimator=grpo", "data.train_files=other.parquet"])
def test_resume_refuses_a_change_of_what_the_run_is(tmp_path, change):
    """Also the shared default run dir: an unrelated run (other model/data/algorithm) is never continued."""
    from rlanywhere.runguard import RunDirError, prepare_run_dir

    _fake_checkpoint(tmp_path, 2, _cfg(tmp_path))
    key = change.split("=")[0]
    with pytest.raises(RunDirError, match=f"{key}: .* -> .*cannot change on resume"):
        prepare_run_dir(str(tmp_path), _cfg(tmp_path, change))


def test_resume_prints_what_changed_and_takes_the_new_value(tmp_path, caplog):
    from rlanywhere.runguard import prepare_run_dir

    _fake_checkpoint(tmp_path, 2, _cfg(tmp_path))
    prepare_run_dir(str(tmp_path), _cfg(tmp_path, "actor_rollout_ref.actor.optim.lr=3e-5",
                                        "trainer.total_training_steps=9")).release()
    assert "actor_rollout_ref.actor.optim.lr changed 1e-06 -> 3e-05" in caplog.text
    assert "trainer.total_training_steps changed None -> 9" in caplog.text


@pytest.mark.slow
def test_trainer_skips_a_truncated_checkpoint_and_the_resumed_optimizer_uses_the_new_lr(tiny_model_dir, arith_data,
                                                                                       tmp_path, caplog):
    caplog.set_level("INFO", logger="rlanywhere")  # "resumed from" is INFO: not only after a test that set it
    run = tmp_path / "run"
    _trainer(_overrides(tiny_model_dir, arith_data, run, **{"trainer.total_training_steps": 2})).fit()
    weights = _weights_file(run, 2)
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, run, **{
        "trainer.total_training_steps": 3, "actor_rollout_ref.actor.optim.lr": 2e-4}))
    trainer.fit()
    assert "global_step_2 is damaged: actor/model.safetensors" in caplog.text
    assert "resumed from" in caplog.text and "global_step_1 at step 1" in caplog.text
    assert trainer.global_step == 3 and (run / "checkpoints" / "global_step_2.damaged").exists()
    assert [g["lr"] for g in trainer.optimizers["actor"].param_groups] == [2e-4]
    rows = _train_rows(run)
    assert sorted(rows) == [1, 2, 3] and rows[2]["actor/lr"] == pytest.approx(2e-4)


# ------------------------------------------------------------------------------------------------ signals
def test_stop_signals_drop_remember_and_a_second_signal_stops_at_once():
    import signal
    import time

    from rlanywhere.runguard import RunInterrupted, StepDropped, StopSignals

    with StopSignals() as stop:
        stop.droppable = True
        with pytest.raises(StepDropped):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted by the handler
        assert stop.received == signal.SIGTERM and not stop.droppable
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # not droppable: only remembered
        assert stop.received == signal.SIGINT
        with pytest.raises(RunInterrupted, match="without saving") as info:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert info.value.checkpoint is None and info.value.exit_code == 130
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ranks_stop_on_the_collectives_answer_even_when_a_signal_lands_during_it():
    """A SIGTERM whose handler runs while signal_received's collective is in flight (this rank already sent 0,
    the other ranks too): every rank must keep going this step and stop at the next boundary together. Answering
    from the rank's own flag stopped this rank alone while the others trained on into a collective (the hang
    test_distributed's SIGTERM test caught once in a while)."""
    import signal
    from types import SimpleNamespace

    from rlanywhere.runguard import RunStops, StopSignals

    cfg = SimpleNamespace(max_consecutive_nonfinite_updates=0, max_consecutive_failed_reward_steps=0)

    class SignalDuringCollective:
        enabled = True

        def __init__(self):
            self.sent = []

        def max_value(self, value: float) -> float:
            self.sent.append(value)
            if len(self.sent) == 1:
                stops.signals.received = signal.SIGTERM  # the handler runs before the call returns
            return max(self.sent[-1], 0.0)  # the other ranks sent 0 as well

    dp = SignalDuringCollective()
    stops = RunStops(cfg, 1e-6, dp)
    stops.signals = StopSignals()
    assert stops.signal_received() is None  # what every rank agreed: go on
    assert stops.signal_received() == signal.SIGTERM  # the next boundary: this rank's flag is in the collective
    assert dp.sent == [0.0, float(signal.SIGTERM)]
    single = RunStops(cfg, 1e-6, SimpleNamespace(enabled=False))
    single.signals = StopSignals()
    single.signals.received = signal.SIGINT
    assert single.signal_received() == signal.SIGINT  # one process: its own flag


@pytest.mark.slow
def test_sigterm_during_rollout_drops_the_step_saves_and_resume_is_exact(tiny_model_dir, arith_data, tmp_path,
                                                                         preempt_while_scoring):
    import signal

    extra = {"trainer.total_training_steps": 3, "trainer.save_freq": -1}  # the signal's save is the only one
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "a", **extra)).fit()

    stop = preempt_while_scoring(_trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra)))
    assert stop.exit_code == 143 and stop.step == 1
    assert stop.checkpoint.endswith("global_step_1") and verify_checkpoint(stop.checkpoint) is None
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored

    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra))
    trainer.fit()
    a, b = _train_rows(tmp_path / "a"), _train_rows(tmp_path / "b")
    assert sorted(b) == [1, 2, 3]
    for step in (2, 3):
        for key in ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "actor/entropy"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_ctrl_c_during_the_update_finishes_the_step_and_saves_it(tiny_model_dir, arith_data, tmp_path,
                                                                monkeypatch, capsys):
    import signal

    from rlanywhere.runguard import RunInterrupted
    from rlanywhere.update import Updater

    original_step = Updater.optimizer_step
    sent = []
    running = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "trainer.total_training_steps": 5, "trainer.save_freq": -1}))

    def step_then_interrupted(self, name, model, optimizer, grad_clip):
        norm = original_step(self, name, model, optimizer, grad_clip)
        if running.global_step == 1 and not sent:  # after the first of the step's two mini-batch updates
            sent.append(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return norm

    monkeypatch.setattr(Updater, "optimizer_step", step_then_interrupted)
    with pytest.raises(RunInterrupted) as info:
        running.fit()
    assert info.value.exit_code == 130 and info.value.step == 2
    assert info.value.checkpoint.endswith("global_step_2")
    assert sorted(_train_rows(tmp_path / "run")) == [1, 2]
    assert "SIGINT received: finishing the current step" in capsys.readouterr().err


def _wait_for(condition, timeout_s: float, proc) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the training process exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for the training process"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("signame, exit_code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_signal_to_a_training_process_saves_and_exits_with_one_line(tiny_model_dir, arith_data, tmp_path, capsys,
                                                                     signame, exit_code):
    """A real child `rlanywhere train`; while it runs, a second run in the same directory is refused."""
    import signal
    import subprocess
    import sys

    import rlanywhere
    from rlanywhere.cli import main as cli_main

    run = tmp_path / "run"
    args = _overrides(tiny_model_dir, arith_data, run, **{"trainer.total_training_steps": 500,
                                                          "trainer.save_freq": -1})
    # started warm (tests/warm_ranks.py): the client forwards the signal to the process that trains, its runner
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rlanywhere.__file__)), **warm_ranks.rank_env()}
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, *warm_ranks.rank_program(), "train", *args], stdout=out,
                                stderr=err, env=env)
    try:
        _wait_for(lambda: bool(_train_rows(run)) if (run / "metrics.jsonl").exists() else False, 180, proc)
        assert cli_main(["train", *args]) == 2
        assert f"is in use by pid {warm_ranks.runner(proc.pid)}" in capsys.readouterr().err
        proc.send_signal(getattr(signal, signame))
        assert proc.wait(timeout=120) == exit_code
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "err.txt").read_text()
    assert "Traceback" not in err
    stopped = [line for line in err.splitlines() if line.startswith(f"stopped by {signame} at step")]
    assert len(stopped) == 1 and "saved" in stopped[0] and "run the same command to resume" in stopped[0]
    saved = list_checkpoints(str(run))
    assert len(saved) == 1 and verify_checkpoint(saved[0]) is None
    assert sorted(_train_rows(run)) == list(range(1, int(saved[0].rsplit("_", 1)[1]) + 1))


def test_run_lock_is_shared_within_a_process_and_released(tmp_path):
    import subprocess
    import sys

    import rlanywhere
    from rlanywhere.runguard import RunLock

    probe = ("import sys; from rlanywhere.runguard import RunLock, RunDirError\n"
             "try:\n    RunLock(sys.argv[1]); print('locked')\nexcept RunDirError as e:\n    print(e)")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rlanywhere.__file__))}

    def other_process() -> str:
        return subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True,
                              env=env, check=True).stdout

    first, second = RunLock(str(tmp_path)), RunLock(str(tmp_path))  # same process: shared
    assert f"in use by pid {os.getpid()}" in other_process()
    first.release()
    assert "in use" in other_process()  # the second holder still has it
    second.release()
    second.release()  # idempotent
    assert other_process().strip() == "locked"
