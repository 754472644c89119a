"""Faults injected for real, second round: a console whose reader is gone at Ctrl-C, a closed terminal (SIGHUP),
a checkpoint without its manifest, diverged updates saved in a checkpoint, a critic whose every update is skipped,
a full disk (a small tmpfs, where the tests run as root), a run name that climbs out of the runs folder and the run
folder deleted mid-run. docs/reliability.md lists each case and its outcome."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from rlanywhere.checkpoint import (MANIFEST_FILE, CheckpointError, CheckpointWriteError, list_checkpoints,
                                   verify_checkpoint)

from . import warm_ranks
from .test_checkpoint import FakeTokenizer, tiny_lm
from .test_faults import _overrides, _resume, _save, _three_checkpoints, _train_rows, _trainer, _weights_file


# ------------------------------------------------------------------------------------------------ checkpoints
def test_a_checkpoint_without_its_manifest_is_damaged_and_said_so(tmp_path, caplog):
    """Manifest deleted, then the weights changed in a way that still loads: not loaded silently any more."""
    from safetensors.torch import load_file, save_file

    _three_checkpoints(tmp_path)
    os.remove(tmp_path / "checkpoints" / "global_step_3" / MANIFEST_FILE)
    weights = _weights_file(tmp_path, 3)
    tensors = load_file(str(weights))
    tensors = {name: tensor * 2 for name, tensor in tensors.items()}  # a well-formed file with other weights
    save_file(tensors, str(weights), metadata={"format": "pt"})
    problem = verify_checkpoint(str(tmp_path / "checkpoints" / "global_step_3"))
    assert problem and "no manifest.json" in problem and "cannot be verified" in problem
    (path, _), _ = _resume(tmp_path)
    assert path.endswith("global_step_2")
    assert "global_step_3" in caplog.text and "no manifest.json" in caplog.text
    assert (tmp_path / "checkpoints" / "global_step_3.damaged").exists()


@contextlib.contextmanager
def small_tmpfs(path, size: str):
    """A tmpfs of `size` mounted at `path` (root only; skipped elsewhere with the reason)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full disk) needs root")
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_disk_full_while_serializing_the_weights_is_one_error_and_leaves_no_tmp(tmp_path):
    """A real full disk (a 40 KiB tmpfs): safetensors fails writing the weights; the one error, no .tmp left."""
    actor = tiny_lm(0)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    with small_tmpfs(tmp_path / "disk", "40k") as disk:
        with pytest.raises(CheckpointWriteError, match="no space left on device") as info:
            _save(disk / "run", 1, actor, opt)
        assert "global_step_1" in str(info.value) and "partial write was removed" in str(info.value)
        assert os.listdir(disk / "run" / "checkpoints") == []


def test_disk_full_at_resume_is_one_error_and_leaves_no_metrics_tmp(tmp_path):
    """Resuming rewrites metrics.jsonl without the lines after the checkpoint; with the disk full that write fails:
    one error naming the file, and no metrics.jsonl.tmp left behind (the original is kept)."""
    from rlanywhere.errors import UserError
    from rlanywhere.tracking import Tracker

    with small_tmpfs(tmp_path / "disk", "12k") as disk:
        lines = "".join(json.dumps({"step": step, "reward/mean": 0.5, "pad": "x" * 200}) + "\n" for step in range(20))
        (disk / "metrics.jsonl").write_text(lines)
        filler = disk / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as handle:
            while True:  # fill the disk to the last block
                handle.write(b"\0" * 1024)
                handle.flush()
        with pytest.raises(UserError, match="metrics.jsonl.*no space left on device") as info:
            Tracker(disk, loggers=[], resume_step=3)
        assert "free" in str(info.value)
        assert sorted(os.listdir(disk)) == ["filler", "metrics.jsonl"]
        assert (disk / "metrics.jsonl").read_text() == lines


# ------------------------------------------------------------------------------------------------ runs
@pytest.mark.slow
def test_diverged_updates_name_the_last_healthy_checkpoint_and_a_rerun_never_resumes_a_later_one(
        tiny_model_dir, arith_data, tmp_path, caplog):
    """lr 1e5: the updates go bad within a few steps while checkpoints are still being saved (finite weights, a
    skipped update). The stop names the last checkpoint saved while the run was healthy; a rerun (auto-resume)
    moves the ones saved after that aside as .diverged and resumes from the healthy one: no advice loop."""
    from rlanywhere.runguard import TrainingStopped

    run = tmp_path / "run"
    args = _overrides(tiny_model_dir, arith_data, run, **{
        "actor_rollout_ref.actor.optim.lr": 1e5, "trainer.total_training_steps": 12,
        "trainer.max_consecutive_nonfinite_updates": 3})
    trainer = _trainer(args)
    with pytest.raises(TrainingStopped) as info:
        trainer.fit()
    states = {int(path.rsplit("_", 1)[1]): json.loads(open(os.path.join(path, "trainer_state.json")).read())
              for path in list_checkpoints(str(run))}
    unhealthy = sorted(step for step, state in states.items() if not state["healthy"])
    assert unhealthy, "the injected divergence saved no checkpoint after the updates went bad"
    good = trainer.stops.last_good_checkpoint
    good_step = int(good.rsplit("_", 1)[1]) if good else 0
    assert all(step > good_step for step in unhealthy)
    if good:
        assert f"trainer.resume_from_path={good}" in str(info.value)
    else:
        assert "No checkpoint was saved while the run was healthy" in str(info.value)

    rerun = _trainer(_overrides(tiny_model_dir, arith_data, run, **{
        "actor_rollout_ref.actor.optim.lr": 1e-3, "trainer.total_training_steps": 12,
        "trainer.max_consecutive_nonfinite_updates": 3}))
    rerun.maybe_resume()
    assert rerun.global_step == good_step
    assert rerun.stops.last_good_checkpoint == good
    for step in unhealthy:
        assert (run / "checkpoints" / f"global_step_{step}.diverged").exists()
    assert "saved after the updates went bad" in caplog.text


@pytest.mark.slow
def test_a_critic_whose_every_update_is_skipped_is_counted_and_stops_the_run(tiny_model_dir, arith_data, tmp_path):
    """PPO with rewards of 1e30: the value loss is inf, every critic update is skipped; the skips show in
    critic/skipped_steps_total and the run stops after K of them in a row, like the actor's."""
    from rlanywhere.runguard import TrainingStopped

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 1e30\n")
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3, "custom_reward_function.path": str(reward),
        "trainer.total_training_steps": 6, "trainer.max_consecutive_nonfinite_updates": 3}))
    with pytest.raises(TrainingStopped, match="3 critic optimizer updates in a row had a NaN/inf"):
        trainer.fit()
    assert trainer.global_step == 1  # two critic updates a step (two mini-batches): the third skip stops step 2
    rows = _train_rows(tmp_path / "run")
    assert rows[1]["critic/skipped_steps"] == 2 and rows[1]["critic/skipped_steps_total"] == 2


def test_a_run_name_that_leaves_the_runs_folder_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                                        monkeypatch):
    from rlanywhere.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    for name in ("../../../escaped", "/abs/escaped"):
        code = cli_main(["train", f"trainer.experiment_name={name}", "data.train_files=none.parquet"])
        assert code == 2
        err = capsys.readouterr().err
        assert f"trainer.experiment_name={name!r} leaves the runs folder" in err and "Traceback" not in err
    assert os.listdir(tmp_path) == [] and not (tmp_path.parent.parent / "escaped").exists()


@pytest.mark.slow
def test_the_run_folder_deleted_mid_run_stops_with_one_error(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    import shutil

    from rlanywhere.errors import UserError
    from rlanywhere.trainer import RLTrainer

    run = tmp_path / "run"
    original = RLTrainer.train_step

    def step_then_folder_deleted(self, items):
        metrics = original(self, items)
        if self.global_step == 1:
            shutil.rmtree(run)
        return metrics

    monkeypatch.setattr(RLTrainer, "train_step", step_then_folder_deleted)
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, run, **{"trainer.total_training_steps": 4,
                                                                      "trainer.save_freq": -1}))
    with pytest.raises(UserError, match="was deleted or replaced during step 2"):
        trainer.fit()
    assert trainer.global_step == 2


# ------------------------------------------------------------------------------------------------ signals
def _train_child(args, stdout, stderr):
    """`rlanywhere train ARGS`, started warm (tests/warm_ranks.py): signals to it reach the process that trains."""
    import rlanywhere

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rlanywhere.__file__)), **warm_ranks.rank_env()}
    return subprocess.Popen([sys.executable, *warm_ranks.rank_program(), "train", *args], stdout=stdout,
                            stderr=stderr, env=env)


def _wait_for_rows(run, proc, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not ((run / "metrics.jsonl").exists() and _train_rows(run)):
        assert proc.poll() is None, f"the training process exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for the training process"
        time.sleep(0.2)


@pytest.mark.slow
def test_ctrl_c_with_output_piped_and_the_reader_gone_still_saves(tiny_model_dir, arith_data, tmp_path):
    """`rlanywhere train ... 2>&1 | tee log`, then Ctrl-C: the reader (tee) is gone before the run writes its
    message; the run still saves and exits 130 instead of dying of BrokenPipeError."""
    run = tmp_path / "run"
    args = _overrides(tiny_model_dir, arith_data, run, **{"trainer.total_training_steps": 500, "trainer.save_freq": -1})
    read_end, write_end = os.pipe()
    proc = _train_child(args, write_end, write_end)
    os.close(write_end)
    reader = os.fdopen(read_end, "rb", buffering=0)
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").exists() and _train_rows(run)):  # read like tee, until a step is done
            assert proc.poll() is None and time.monotonic() < deadline
            reader.read(65536)
        reader.close()  # tee ends (Ctrl-C reached it too) ...
        proc.send_signal(signal.SIGINT)  # ... and the run gets its Ctrl-C
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    saved = list_checkpoints(str(run))
    assert len(saved) == 1 and verify_checkpoint(saved[0]) is None


@pytest.mark.slow
def test_a_closed_terminal_sighup_saves_and_exits_with_one_line(tiny_model_dir, arith_data, tmp_path):
    run = tmp_path / "run"
    args = _overrides(tiny_model_dir, arith_data, run, **{"trainer.total_training_steps": 500, "trainer.save_freq": -1})
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        proc = _train_child(args, out, err)
    try:
        _wait_for_rows(run, proc)
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=120) == 128 + signal.SIGHUP
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "err.txt").read_text()
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("stopped by SIGHUP at step")]) == 1
    saved = list_checkpoints(str(run))
    assert len(saved) == 1 and verify_checkpoint(saved[0]) is None


def test_non_finite_critic_weights_are_never_saved(tmp_path):
    """The one verification checks the critic too, whatever the layout."""
    from rlanywhere.checkpointer import save_checkpoint

    actor, critic = tiny_lm(0), tiny_lm(1)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    with torch.no_grad():
        critic.model.norm.weight[0] = float("nan")
    with pytest.raises(CheckpointError, match="model.norm.weight holds NaN/inf"):
        save_checkpoint(str(tmp_path), 1, actor=actor, tokenizer=FakeTokenizer(), critic=critic,
                        optimizers={"actor": opt}, schedulers={}, trainer_state={})
    assert not (tmp_path / "checkpoints" / "global_step_1.tmp").exists()


# ------------------------------------------------------------------------------------------------ sharded updates
from .test_loss_invariance import trainer_and_batch  # noqa: E402,F401  (the fixture: a trainer and a float64 batch)


def test_a_sharded_rank_with_an_empty_mini_batch_pads_and_a_non_finite_loss_adds_no_nan(trainer_and_batch,
                                                                                         monkeypatch):
    """Rows balanced unevenly leave a rank no rows in a mini-batch: it still runs as many passes as the other rank
    (a sharded backward communicates per layer), padding with a row of its own, and the padding pass adds an
    exact zero to the gradient even when that row's loss is not finite (infinite returns: an inf value loss)."""
    import rlanywhere.update as update
    from rlanywhere import algorithms as algo
    from rlanywhere.update import critic_loss

    trainer, batch = trainer_and_batch

    class TwoRanks:  # the other rank runs 2 micro-batches in this mini-batch
        enabled, world, rank = True, 2, 1

        def max_value(self, value):
            return max(value, 2.0)

    monkeypatch.setattr(update, "is_sharded", lambda model: True)
    monkeypatch.setattr(trainer.updater, "dp", TwoRanks())
    returns = batch.returns
    batch.returns = torch.full_like(returns, float("inf"))
    try:
        model, optimizer = trainer.critic, trainer.optimizers["critic"]
        passes = []
        original = critic_loss(batch, trainer.cfg.critic, "cpu")

        def counted(*args, **kwargs):
            passes.append(kwargs.get("padding", False))
            return original(*args, **kwargs)

        scale = algo.LossScale.of(batch.mask[[0, 1]], norm_length=trainer.response_length)
        metrics = trainer.updater.accumulate(model, optimizer, batch, [], 2, counted, scale)
        assert passes == [True, True] and metrics == {}
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.equal(g, torch.zeros_like(g)) for g in grads)
        # the same row as a real micro-batch: its loss is not finite (what the padding pass must not pass on)
        inputs = trainer.updater.forward_rows(batch, [0])
        loss, _, _ = original(model, [0], inputs, batch.mask[[0], :inputs.response_len], scale)
        assert not torch.isfinite(loss)
    finally:
        batch.returns = returns
        trainer.optimizers["critic"].zero_grad(set_to_none=True)


# ------------------------------------------------------------------------------------------------ launch layouts
def _ppo_plan_args():
    return ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=gae",
            "data.train_batch_size=64", "data.max_prompt_length=256", "data.max_response_length=256",
            "actor_rollout_ref.actor.ppo_mini_batch_size=64", "trainer.n_gpus_per_node=4"]


def test_slurm_layout_one_gpu_per_task_is_planned_on_that_gpu(monkeypatch):
    """srun --gpus-per-task=1: every task sees one GPU (its own CUDA_VISIBLE_DEVICES) and LOCAL_RANK counts 0..3."""
    from rlanywhere.config import load_config
    from rlanywhere.machine import HardwareProbe
    from rlanywhere.planner import make_plan
    from rlanywhere.rank_layout import rank_gpu_index
    from rlanywhere.vocabulary import PlanError

    probe = HardwareProbe.fake("h100")  # one visible device
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    plan = make_plan(load_config(None, _ppo_plan_args()), probe, for_execution=True)
    assert plan.device == "cuda:0" and plan.world_size == 4
    assert "CUDA_VISIBLE_DEVICES" in plan.reasons["device"]
    # one GPU on the machine and 4 ranks started on it by mistake: still refused, naming both fixes
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(PlanError, match="LOCAL_RANK=3 but only 1 CUDA device.*CUDA_VISIBLE_DEVICES"):
        make_plan(load_config(None, _ppo_plan_args()), probe, for_execution=True)
    assert rank_gpu_index(1, 4, {}) == (1, "this rank's GPU (LOCAL_RANK=1 of 4 visible)")
    assert rank_gpu_index(1, 2, {"CUDA_VISIBLE_DEVICES": "0,1"})[0] == 1


def test_api_plan_under_torchrun_plans_for_the_launch_world(monkeypatch):
    """`rlanywhere.plan(cfg)` inside a script started by torchrun plans every rank's share, like the CLI."""
    import rlanywhere
    from rlanywhere.config import load_config

    from rlanywhere import machine

    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    # the CPU plan's budget is the RAM free now: fixed here, so that cores busy with other jobs do not make it shard
    monkeypatch.setattr(machine, "_read_meminfo", lambda: (24 * 2**30, 16 * 2**30))
    cfg = load_config(None, ["hardware.device=cpu", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    plan = rlanywhere.plan(cfg)
    assert plan.world_size == 2 and plan.data_parallel == "replicate" and plan.dist_backend == "gloo"
    assert cfg.trainer.n_gpus_per_node == 2


# ------------------------------------------------------------------------------------------------ reward workers
@pytest.mark.slow
def test_reward_workers_start_from_a_fresh_server_not_a_fork_of_the_trainer(tmp_path):
    """A fork of a process running CUDA/NCCL/gloo threads can inherit a held lock and hang: the pool's workers are
    children of a fresh server process (forkserver), and a function from a file is loaded again there."""
    from rlanywhere.rewards import RewardManager, load_custom_reward

    reward = tmp_path / "reward.py"
    reward.write_text("import os, sys\nTORCH = 'torch' in sys.modules\n\n"
                      "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': float(len(solution_str)), 'parent': float(os.getppid()), 'torch': TORCH}\n")
    manager = RewardManager(load_custom_reward(reward), timeout_s=5, num_workers=1)
    try:
        scores, info = manager(["ab", "abcd"], ["1", "2"], ["x", "x"])
        assert scores.tolist() == [2.0, 4.0] and info["num_errors"] == 0
        assert all(parent != os.getpid() for parent in info["parent"])  # not forked from this (the trainer) process
        assert info["torch"] == [0.0, 0.0]  # the server did not import torch (it starts in a fraction of a second)
    finally:
        manager.close()
    # a function that cannot be pickled (a closure) still runs: its workers are forked, as before
    offset = 1.0
    closure = RewardManager(lambda data_source, text, truth, extra=None: len(text) + offset, timeout_s=5,
                            num_workers=1)
    try:
        assert closure(["abc"], ["1"], ["x"])[0].tolist() == [4.0]
    finally:
        closure.close()


def test_a_reward_worker_runs_torch_on_one_thread_whether_or_not_it_has_imported_torch(monkeypatch):
    """A worker from the server has no torch yet: OMP_NUM_THREADS=1 gives a torch the user's function imports one
    thread; a forked worker has torch already: set to one thread directly."""
    import torch

    from rlanywhere import rewards

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)  # as in a worker of the server: no torch imported
    rewards._torch_on_one_thread()
    assert os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setitem(sys.modules, "torch", torch)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    rewards._torch_on_one_thread()
    assert threads == [1] and "OMP_NUM_THREADS" not in os.environ


SCORING_CHILD = """
import sys, time
import multiprocessing.forkserver as forkserver
from rlanywhere.rewards import RewardManager, load_custom_reward
from rlanywhere.runguard import StopSignals

if __name__ == "__main__":
    reward, signalled, ending = sys.argv[1:4]
    manager = RewardManager(load_custom_reward(reward), timeout_s=60, num_workers=2)

    def processes():
        return forkserver._forkserver._forkserver_pid, sorted(worker.pid for worker in manager._pool._pool)

    with StopSignals() as signals:
        manager(["0"], ["1"], ["x"])  # the pool and its server are up
        before = processes()
        print("processes", *before[1], before[0], flush=True)
        print("scoring", flush=True)
        scores, info = manager(["1.5", "1.5"], ["1", "1"], ["x", "x"])
        assert scores.tolist() == [1.0, 1.0] and info["num_errors"] == 0, (scores, info)
        assert (signals.received is not None) == (signalled == "yes"), signals.received
        time.sleep(0.5)  # the save: the pool's maintenance thread runs meanwhile
        assert processes() == before, (before, processes())
        print("saved", flush=True)
    if ending == "close":  # the trainer closes its pool; a script may leave it to the interpreter's exit
        manager.close()
"""


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("signalled,ending", [("yes", "close"), ("no", "exit")])
def test_a_signal_to_the_trainers_process_group_leaves_the_reward_pool_working(tmp_path, signalled, ending):
    """torchrun stops a rank with killpg(SIGTERM) and a closed terminal hangs up its whole group: the reward workers'
    server must not die of it (the pool would take every worker for dead and start new ones from a gone server while
    the trainer saves: a ConnectionRefusedError, then a shutdown that waits forever). With a call in flight, the
    signal is the trainer's alone; the pool scores, keeps its processes, and the process ends promptly, its server
    and workers with it, whether it closes the pool or leaves that to the interpreter's exit."""
    import rlanywhere

    (tmp_path / "reward.py").write_text("import time\n\ndef compute_score(data_source, solution_str, ground_truth, "
                                        "extra_info=None):\n    time.sleep(float(solution_str))\n    return 1.0\n")
    (tmp_path / "child.py").write_text(SCORING_CHILD)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rlanywhere.__file__))}
    child = subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "reward.py"), signalled,
                              ending], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                             start_new_session=True)  # a group of its own, as torchrun gives each rank
    processes = []
    try:
        for line in child.stdout:
            if line.startswith("processes"):
                processes = [int(pid) for pid in line.split()[1:]]
            if line.startswith("scoring"):
                time.sleep(0.5)  # inside the 1.5 s calls
                if signalled == "yes":
                    os.killpg(child.pid, signal.SIGTERM)  # what torchrun sends: the rank's whole group
                break
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:  # a hang: end it (and what it started) so the test reports instead of waiting
            for pid in [child.pid, *processes]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert child.returncode == 0, err[-4000:]
    assert "saved" in out and "Traceback" not in err and "Error" not in err, err[-4000:]
    assert ("SIGTERM received" in err) == (signalled == "yes")
    assert len(processes) == 3  # two workers and their server
    deadline = time.time() + 30
    while not all(_gone(pid) for pid in processes) and time.time() < deadline:
        time.sleep(0.2)
    assert [pid for pid in processes if not _gone(pid)] == []  # nothing left running after the trainer ends


# ------------------------------------------------------------------------------------------------ several ranks
@pytest.mark.slow
def test_two_ranks_resume_from_a_folder_with_damaged_and_later_checkpoints(tiny_model_dir, arith_data, tmp_path):
    """Both ranks share the run folder: rank 0 alone moves checkpoints aside (damaged, then later than the resumed
    step), the other waits for it; no rank deletes or renames what the other just moved."""
    from .test_distributed import REWARD, SCORED_IN_PROCESS, finish, overrides, torchrun

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run = tmp_path / "run"
    no_validation_no_pool = {"trainer.test_freq": -1, **SCORED_IN_PROCESS}
    finish(torchrun(overrides(tiny_model_dir, arith_data, run, reward, **no_validation_no_pool)))
    checkpoints = run / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("global_step_")) == [
        "global_step_1", "global_step_2", "global_step_3"]
    weights = checkpoints / "global_step_3" / "actor" / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)

    # the damaged newest one is named and moved aside; both ranks resume from step 2 and train step 3 again
    out = finish(torchrun(overrides(tiny_model_dir, arith_data, run, reward, **no_validation_no_pool)))
    assert "resumed from" in out and "global_step_2" in out and "Traceback" not in out
    assert (checkpoints / "global_step_3.damaged").is_dir() and (checkpoints / "global_step_3").is_dir()
    assert verify_checkpoint(str(checkpoints / "global_step_3")) is None

    # resumed by name from step 1: the later checkpoints (2 and 3) are moved aside once, by rank 0
    out = finish(torchrun(overrides(tiny_model_dir, arith_data, run, reward, **no_validation_no_pool, **{
        "trainer.total_training_steps": 1, "trainer.resume_mode": "resume_path",
        "trainer.resume_from_path": str(checkpoints / "global_step_1")})))
    assert "Traceback" not in out
    assert (checkpoints / "global_step_2.stale").is_dir() and (checkpoints / "global_step_3.stale").is_dir()
    assert [os.path.basename(p) for p in list_checkpoints(str(run))] == ["global_step_1"]


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=`rank` among the launcher's descendants."""
    from .test_distributed import descendants

    for pid in descendants(launcher_pid):
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                env = dict(item.split(b"=", 1) for item in handle.read().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"RANK") == str(rank).encode() and b"TORCHELASTIC_RUN_ID" in env and \
                b"rlanywhere.cli" in open(f"/proc/{pid}/cmdline", "rb").read():
            return pid
    return None


def test_a_survivor_names_a_rank_that_ends_just_after_its_sockets_closed(monkeypatch):
    """A killed process closes its sockets before it has ended, so a survivor's collective can fail while the killed
    rank still looks alive in /proc: the survivor looks again for a while (rank_layout.PEER_EXIT_WAIT_S) before it
    says only that it lost a connection."""
    import socket
    import threading

    from rlanywhere import rank_layout

    host = socket.gethostname()
    failure = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234")
    peers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        monkeypatch.setattr(rank_layout, "_PEERS", [(host, os.getpid()), (host, peers[0].pid)])
        threading.Timer(0.3, peers[0].kill).start()  # ends after the collective failed
        assert rank_layout.failed_rank_line(failure, 0, 2).startswith("error: rank 1 of 2 stopped (killed")
        # a peer that stays alive (its machine unreachable, say): the connection line once the wait is over
        monkeypatch.setattr(rank_layout, "_PEERS", [(host, os.getpid()), (host, peers[1].pid)])
        monkeypatch.setattr(rank_layout, "PEER_EXIT_WAIT_S", 0.2)
        started = time.monotonic()
        line = rank_layout.failed_rank_line(failure, 0, 2)
        assert line.startswith("error: rank 0 of 2 lost its connection") and time.monotonic() - started >= 0.2
        assert rank_layout.failed_rank_line(ValueError("bad shape"), 0, 2) is None  # not a peer's failure
        # a reward or tool server refusing this rank's connection, every peer alive: this rank's own error
        refused = ConnectionRefusedError(111, "Connection refused")
        assert rank_layout.failed_rank_line(refused, 0, 2) is None
        assert rank_layout.failed_rank_line(TimeoutError("the tool timed out"), 0, 2) is None
    finally:
        for peer in peers:
            peer.kill()
            peer.wait()


@pytest.mark.slow
def test_a_killed_rank_is_named_in_one_line_by_the_survivor(tiny_model_dir, arith_data, tmp_path):
    """torchrun, 2 ranks, rank 1 killed with SIGKILL mid-run: rank 0's collective fails; it prints one line naming
    rank 1 instead of its gloo traceback. (torchrun checks its workers every 5 s here, so rank 0's collective fails
    before torchrun stops it; torchrun's own report of the killed worker follows, as torchrun prints it.)"""
    from .test_distributed import REWARD, overrides, torchrun

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run = tmp_path / "run"
    proc = torchrun(overrides(tiny_model_dir, arith_data, run, reward, **{
        "trainer.test_freq": -1, "trainer.save_freq": -1, "trainer.total_training_steps": 200}),
        {"RLA_TEST_SLOW_REWARD": "0.05"}, launcher=("--standalone", "--monitor-interval=5"))
    try:
        deadline = time.monotonic() + 240
        while not ((run / "metrics.jsonl").exists() and _train_rows(run)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None
        warm_ranks.kill_9(victim)  # the rank, as `kill -9 PID` would (its runner too, when warm)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    named = [line for line in out.splitlines() if line.startswith("error: rank 1 of 2 stopped")]
    assert len(named) == 1, out[-3000:]
    assert "error: rank 0 of 2 failed" not in out and "rlanywhere/trainer.py" not in out  # no rank-0 traceback


def test_the_launcher_names_the_rank_that_was_killed_not_one_torchrun_stopped():
    """torchrun's failures: the cause is the first rank that failed, not one ended by the SIGTERM torchrun sends the
    others (its timestamps have whole seconds, so they tie); a rank that exited with a code said why itself."""
    from types import SimpleNamespace

    from rlanywhere.rank_launch import failed_rank_report

    def failure(exitcode, timestamp):
        return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)

    line, code = failed_rank_report({0: failure(-signal.SIGTERM, 100), 1: failure(-signal.SIGKILL, 100)}, 2)
    assert code == 1 and line.startswith("error: rank 1 of 2 was ended by SIGKILL (kill -9, or the system's")
    assert "Run the same command to resume" in line
    # rank 0's collective failed when rank 1 was killed, and it exited 1 without a word: torchrun saw both at once
    line, code = failed_rank_report({0: failure(1, 100), 1: failure(-signal.SIGKILL, 100)}, 2)
    assert code == 1 and line.startswith("error: rank 1 of 2 was ended by SIGKILL")
    line, _ = failed_rank_report({3: failure(-signal.SIGSEGV, 101), 2: failure(-signal.SIGKILL, 100)}, 4)
    assert line.startswith("error: rank 2 of 4 was ended by SIGKILL")  # the earlier one
    line, _ = failed_rank_report({1: failure(-signal.SIGSEGV, 100)}, 2)
    assert line.startswith("error: rank 1 of 2 was ended by SIGSEGV and could not say why")
    assert failed_rank_report({0: failure(-signal.SIGTERM, 100), 1: failure(2, 100)}, 2) == (None, 2)
    line, _ = failed_rank_report({0: failure(-signal.SIGTERM, 100)}, 2)  # only a SIGTERM: that one is named
    assert line.startswith("error: rank 0 of 2 was ended by SIGTERM")


def _two_rank_cli_run(tiny_model_dir, arith_data, tmp_path):
    """`rlanywhere train ... trainer.n_gpus_per_node=2` (it starts torchrun itself) running, its first step logged."""
    import rlanywhere

    from .test_distributed import REWARD, overrides

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run = tmp_path / "run"
    items = overrides(tiny_model_dir, arith_data, run, reward, **{
        "trainer.test_freq": -1, "trainer.save_freq": -1, "trainer.total_training_steps": 200})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLA_TEST_SLOW_REWARD": "0.05",
           "PYTHONPATH": os.path.dirname(os.path.dirname(rlanywhere.__file__)), **warm_ranks.rank_env()}
    # warm, as its launcher and ranks are (tests/warm_ranks.py); a signal to the client reaches `rlanywhere train`
    proc = subprocess.Popen([sys.executable, *warm_ranks.rank_program(), "train", *items, "trainer.n_gpus_per_node=2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # a terminal's foreground group of its own
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and _train_rows(run)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    return proc, run


def _end(proc, timeout: float = 240) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            from .test_distributed import kill_9_job

            kill_9_job(proc)


@pytest.mark.slow
def test_a_killed_rank_under_rlanywhere_train_is_one_line(tiny_model_dir, arith_data, tmp_path):
    """`rlanywhere train` on 2 ranks, rank 1 killed with SIGKILL mid-run: the user sees one line naming rank 1 (no
    torchrun report, no traceback, no log lines about stopping rank 0, no leak warnings), and exit code 1."""
    proc, _ = _two_rank_cli_run(tiny_model_dir, arith_data, tmp_path)
    from .test_distributed import descendants

    victim = _rank_pid(proc.pid, 1)
    assert victim is not None, descendants(proc.pid)
    warm_ranks.kill_9(victim)  # the rank, as `kill -9 PID` would (its runner too, when warm)
    out = _end(proc)
    assert proc.returncode == 1, out[-3000:]
    errors = [line for line in out.splitlines()  # ours (error: ...), Python's, torchrun's log lines (E1202 ...)
              if line.startswith(("error", "E1", "W1")) or "Error" in line or "Warning" in line]
    assert len(errors) == 1 and errors[0].startswith("error: rank 1 of 2 was ended by SIGKILL"), out[-3000:]
    for noise in ("Traceback", "ChildFailedError", "closing signal", "leaked", "SIGTERM received"):
        assert noise not in out, out[-3000:]


@pytest.mark.slow
def test_ctrl_c_to_rlanywhere_train_on_two_ranks_waits_for_their_save(tiny_model_dir, arith_data, tmp_path):
    """Ctrl-C in the terminal (SIGINT to the foreground group) of `rlanywhere train` on 2 ranks: the ranks get it
    once, finish the step and save; `rlanywhere train` waits for them and exits 130, one line of each kind."""
    proc, run = _two_rank_cli_run(tiny_model_dir, arith_data, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    out = _end(proc)
    assert proc.returncode == 130, out[-3000:]
    assert out.count("SIGINT received: finishing the current step") == 1, out[-3000:]
    stopped = [line for line in out.splitlines() if line.startswith("stopped by SIGINT at step ")]
    assert len(stopped) == 1, out[-3000:]
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
    assert verify_checkpoint(str(run / "checkpoints" / f"global_step_{step}")) is None
    for noise in ("Traceback", "interrupted", "SignalException", "death signal"):
        assert noise not in out, out[-3000:]
