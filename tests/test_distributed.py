"""Data parallelism on CPU: 2 ranks with gloo under torchrun train like one process on the same global batch.

The reference is a single process with its default settings: each response row samples from its own random stream,
keyed by its global prompt and sample index (rollout.base.RowStreams), so one process, two ranks and a halved rollout
batch draw the same samples; then losses, gradient norms, every metric and the final weights must agree to float
round-off. A 2-rank run killed with SIGKILL after its step-2
checkpoint and resumed (on 2 ranks, and on 1) reproduces step 3; a rank that raises ends the job with its message.
The 2-rank runs balance their rows (trainer.balance_batch, on by default): rows move between the ranks after each
rollout, and the results still equal one process's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlanywhere.config import load_config
from rlanywhere.distributed import DataParallel, RowLayout
from rlanywhere.planner import make_plan
from rlanywhere.tracking import read_metrics
from rlanywhere.trainer import RLTrainer

from . import warm_ranks
from .test_e2e import base_overrides

pytestmark = pytest.mark.slow

REWARD = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hang = os.environ.get("RLA_TEST_HANG_WHEN")
    if hang and os.path.exists(hang):  # the run to be killed: stop inside step 3, after checkpoint 2
        time.sleep(600)
    slow = os.environ.get("RLA_TEST_SLOW_REWARD")
    if slow:  # steps long enough to be signalled in the middle of one
        time.sleep(float(slow))
    return (len(solution_str) % 5) / 4.0  # varies within a group, so GRPO advantages are not all zero
'''


def overrides(model_dir, data_dir, run_dir, reward_file, **extra) -> list[str]:
    """test_e2e's tiny run, 3 GRPO steps, one mini-batch per step, a checkpoint every step, our reward. Responses
    stop after a word ending in "e", so their lengths differ and trainer.balance_batch (on) moves rows."""
    return base_overrides(model_dir, data_dir, run_dir, **{
        "data.max_response_length": 10, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.rollout.stop": "['e']",
        "custom_reward_function.path": str(reward_file), "trainer.total_training_steps": 3,
        "trainer.test_freq": 3, "trainer.save_freq": 1, "trainer.seed": 5, "algorithm.adv_estimator": "grpo",
        **extra})


# Tests whose subject is how ranks train (against one process) score in each trainer's own process, both sides: a
# rank's reward pool starts a server process that imports torch again, seconds of CPU per rank and launch. The pool
# under torchrun stays covered where it matters, by the kill, signal and failure tests, which keep it.
SCORED_IN_PROCESS = {"custom_reward_function.timeout_s": 0}


def single_process(items: list[str], rollout_batch_size: int | None = None) -> RLTrainer:
    """One process, its plan's rollout batch (or `rollout_batch_size` sequences at a time, as an OOM halving sets)."""
    cfg = load_config(None, items)
    plan = make_plan(cfg, for_execution=True)
    if rollout_batch_size is not None:
        plan.sizes.rollout_batch_size = rollout_batch_size
    trainer = RLTrainer(cfg, plan, cfg.trainer.default_local_dir)
    trainer.fit()
    return trainer


def torchrun(items: list[str], env_extra: dict | None = None, script: str | None = None, nproc: int = 2,
             launcher: tuple[str, ...] = ("--standalone",), **popen):
    """torchrun running `rlanywhere.cli train ITEMS` (or the worker file `script`) on `nproc` ranks. Its ranks start
    warm, with torch and rlanywhere already imported (tests/warm_ranks.py; RLANYWHERE_TEST_COLD_RANKS=1: cold)."""
    command = [*warm_ranks.torchrun(), f"--nproc_per_node={nproc}", *launcher,
               *warm_ranks.rank_program(script=script), "train", *items]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **warm_ranks.rank_env(), **(env_extra or {})}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen)


def children(pid: int) -> list[int]:
    """The direct child processes of what runs for `pid` (torchrun's: the ranks), whether it runs warm (a client's
    runner) or in `pid` itself."""
    return warm_ranks.children_by_parent().get(warm_ranks.runner(pid), [])


def descendants(pid: int) -> list[int]:
    """pid's child processes, recursively (torchrun starts each rank in a session of its own)."""
    return warm_ranks.descendants(pid)


def kill_9_job(proc) -> None:
    """SIGKILL the launcher and every rank at once, as a crashed machine or `kill -9` of the job would."""
    warm_ranks.kill_tree(proc.pid)


def finish(proc, timeout: float = 240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


# Maxima are averaged over micro-batches by _accumulate (weighted by tokens), so they depend on the split of the
# mini-batch, in one process too: not comparable across splits.
SPLIT_DEPENDENT = {"actor/ratio_max", "actor/rollout_is_max", "actor/rollout_is_min"}


def compared(row: dict) -> dict:
    """The metrics that must agree: all but timings, throughput, this machine's memory, maxima and the per-rank
    token counts of balance_batch (global_seqlen/*: only a run over several ranks has them)."""
    return {k: v for k, v in row.items()
            if not k.startswith(("perf/", "timing/", "global_seqlen/")) and k != "step" and k not in SPLIT_DEPENDENT
            and not (k.startswith("async/") and k.endswith("_s"))}  # the pipeline's wall seconds


def assert_rows_moved(rows: list[dict]) -> None:
    """balance_batch moved rows in some step: the busiest rank had fewer tokens after than as generated."""
    balanced = [r for r in rows if "global_seqlen/max" in r]
    assert balanced and any(r["global_seqlen/balanced_max"] < r["global_seqlen/max"] for r in balanced), balanced


def assert_same_metrics(got: list[dict], want: list[dict], steps) -> None:
    by_step = lambda rows: {r["step"]: compared(r) for r in rows}  # noqa: E731
    got_rows, want_rows = by_step(got), by_step(want)
    for step in steps:
        assert set(got_rows[step]) == set(want_rows[step]), step
        for key, value in want_rows[step].items():
            if value is None:  # not finite (an overflowing fp16 step's gradient norm): written as null on both
                assert got_rows[step][key] is None, (step, key, got_rows[step][key])
                continue
            assert math.isclose(got_rows[step][key], value, rel_tol=1e-4, abs_tol=1e-6), (
                step, key, got_rows[step][key], value)


def actor_weights(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "actor" / "model.safetensors"))


def assert_same_weights(got: dict, model: torch.nn.Module) -> None:
    # atol 1e-5 = 1% of lr: Adam divides by sqrt(v), so an element whose gradient is at round-off level can move by
    # a visible fraction of lr on sum-order noise alone; every other element agrees to ~1e-7.
    compared = 0
    for name, tensor in model.state_dict().items():
        if name in got:
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-5)
            compared += 1
    assert compared > 0


@pytest.fixture()
def reward_file(tmp_path) -> Path:
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return path


def kill_9_after_checkpoint_2(run_overrides: list[str], dist_dir: Path) -> None:
    """Run 2 ranks until checkpoint 2 is complete, hang them inside step 3, then SIGKILL the whole job."""
    marker = dist_dir / "checkpoints" / "global_step_2" / "trainer_state.json"
    proc = torchrun(run_overrides, {"RLA_TEST_HANG_WHEN": str(marker)})
    deadline = time.time() + 240
    latest = dist_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    while not (latest.exists() and latest.read_text().strip() == "2"):
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.time() < deadline, "no step-2 checkpoint"
        time.sleep(0.1)
    kill_9_job(proc)
    proc.communicate(timeout=60)


def test_grpo_on_two_ranks_matches_one_process_and_survives_kill_9(tiny_model_dir, arith_data, tmp_path,
                                                                    reward_file):
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    # 2 ranks, killed with SIGKILL inside step 3 (after checkpoint 2 is complete)
    kill_9_after_checkpoint_2(overrides(tiny_model_dir, arith_data, dist_dir, reward_file), dist_dir)
    assert not (dist_dir / "checkpoints" / "global_step_3").exists()
    shutil.copytree(dist_dir, tmp_path / "dist_copy")  # for the resume on one process

    # resume on 2 ranks (meanwhile the single-process reference runs here)
    resume = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file))
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file))
    out = finish(resume)
    assert "resumed from" in out and "global_step_2" in out

    want = read_metrics(single_dir)
    assert_rows_moved(read_metrics(dist_dir))
    assert_same_metrics(read_metrics(dist_dir), want, steps=(0, 1, 2, 3))
    assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_3"), reference.actor)
    assert any(abs(r.get("actor/pg_loss", 0.0)) > 1e-4 for r in want)  # a real update, not zeros matching zeros

    # the same checkpoint resumed by one process (another world size) gives the same step 3
    copy = tmp_path / "dist_copy"
    single_process(overrides(tiny_model_dir, arith_data, copy, reward_file))
    assert_same_metrics(read_metrics(copy), want, steps=(3,))


def test_one_step_off_on_two_trainer_ranks_matches_one_process_and_survives_kill_9(tiny_model_dir, arith_data,
                                                                                   tmp_path, reward_file):
    """trainer.async.mode=one_step_off with every rank a trainer (rollout_ranks=0): each rank generates its share of
    the next step's batch beside its own update (in turn on a CPU), so the batches, metrics and weights are one
    process's one_step_off run's. Killed in step 3, the checkpoint of step 2 holds each rank's share of step 3's
    batch (made with weights no checkpoint holds): resumed on 2 ranks, and on 1 (the shares joined), the same."""
    extra = {"trainer.async.mode": "one_step_off", "trainer.async.rollout_ranks": 0,
             "trainer.total_training_steps": 4, "trainer.test_freq": 4,
             "algorithm.rollout_correction.rollout_is": "token"}
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    kill_9_after_checkpoint_2(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra), dist_dir)
    assert not (dist_dir / "checkpoints" / "global_step_3").exists()
    saved = json.loads((dist_dir / "checkpoints" / "global_step_2" / "trainer_state.json").read_text())
    shares = saved["async_rollouts"]["ranks"]
    assert [sorted(share) for share in shares] == [["2"], ["2"]] and shares[0]["2"]["weights_step"] == 1
    assert shares[0]["2"]["scored"]["items"] != shares[1]["2"]["scored"]["items"]  # each rank's own prompts
    shutil.copytree(dist_dir, tmp_path / "dist_copy")

    resume = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra))
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **extra))
    out = finish(resume)
    assert "resumed from" in out and "global_step_2" in out
    plan = json.loads((dist_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["async_rollout"] == "in turn"
    want = read_metrics(single_dir)
    assert [r["async/staleness"] for r in want if "async/staleness" in r] == [0.0, 1.0, 1.0, 1.0]
    assert_same_metrics(read_metrics(dist_dir), want, steps=(1, 2, 3, 4))
    assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_4"), reference.actor)

    copy = tmp_path / "dist_copy"  # one process resumes the 2 ranks' checkpoint: their shares make its batch
    single_process(overrides(tiny_model_dir, arith_data, copy, reward_file, **extra))
    assert_same_metrics(read_metrics(copy), want, steps=(3, 4))


def test_samples_do_not_depend_on_the_rollout_batch(tiny_model_dir, arith_data, tmp_path, reward_file):
    """One process generating its rollout whole, and in waves of a half and a quarter of it (what OOM recovery's
    halving does): each row draws from its own stream, so the samples, every metric and the weights are the same.
    (Two ranks against one process with default settings: the tests above.)"""
    items = lambda name: overrides(tiny_model_dir, arith_data, tmp_path / name, reward_file,  # noqa: E731
                                   **{"trainer.total_training_steps": 2, "trainer.save_freq": 2})
    whole = single_process(items("whole"))
    rows = whole.plan.sizes.rollout_batch_size
    assert rows == 4 * 2  # the plan's default: the whole step's rollout at once
    want = read_metrics(tmp_path / "whole")
    assert any(abs(r.get("actor/pg_loss", 0.0)) > 1e-4 for r in want)
    for name, size in (("half", rows // 2), ("quarter", rows // 4)):
        part = single_process(items(name), rollout_batch_size=size)
        assert_same_metrics(read_metrics(tmp_path / name), want, steps=(0, 1, 2))
        for key, value in whole.actor.state_dict().items():
            torch.testing.assert_close(part.actor.state_dict()[key], value, rtol=1e-6, atol=1e-7)


def test_ppo_with_critic_and_adaptive_kl_on_two_ranks_matches_one_process(tiny_model_dir, arith_data, tmp_path,
                                                                          reward_file):
    """PPO + critic + reference with the KL penalty in the reward (adaptive controller), 2 epochs; launched the
    verl way: trainer.n_gpus_per_node=2 without torchrun makes `rlanywhere train` start torchrun itself."""
    extra = {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True,
             "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.05,
             "algorithm.kl_ctrl.target_kl": 0.01, "algorithm.kl_ctrl.horizon": 10,
             "actor_rollout_ref.actor.ppo_epochs": 2, "critic.optim.lr": 1e-3,
             "trainer.total_training_steps": 2, "trainer.test_freq": 2, "trainer.save_freq": 2, **SCORED_IN_PROCESS}
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    proc = subprocess.Popen(  # warm, as its launcher and ranks are (tests/warm_ranks.py)
        [sys.executable, *warm_ranks.rank_program(), "train",
         *overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra), "trainer.n_gpus_per_node=2"],
        env={**os.environ, "OMP_NUM_THREADS": "1", **warm_ranks.rank_env()}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **extra))
    out = finish(proc)
    assert "starting torchrun" in out
    plan = json.loads((dist_dir / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["data_parallel"] == "replicate" and plan["dist_backend"] == "gloo"
    assert plan["balance_batch"] is True and "batch balance: on" in out  # verl's default
    want = read_metrics(single_dir)
    assert_rows_moved(read_metrics(dist_dir))
    assert {"critic/vf_loss", "actor/reward_kl_penalty_coeff", "actor/kl"} <= set(want[-1])
    assert_same_metrics(read_metrics(dist_dir), want, steps=(0, 1, 2))
    assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_2"), reference.actor)


def test_a_failing_rank_ends_the_job_with_its_message(tiny_model_dir, arith_data, tmp_path, reward_file):
    worker = Path(__file__).with_name("dist_fail_worker.py")
    start = time.time()
    proc = torchrun(overrides(tiny_model_dir, arith_data, tmp_path / "run", reward_file), script=str(worker),
                    cwd=str(tmp_path))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "error: rank 1 of 2 failed: RuntimeError: injected failure on rank 1" in out
    assert time.time() - start < 240


def slow_run_until(items: list[str], run_dir: Path, steps: int, records: int) -> subprocess.Popen:
    """torchrun `steps` steps of a run with a slow reward (no validation, no checkpoints) and return once its
    metrics.jsonl holds `records` records."""
    proc = torchrun(items + [f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.save_freq=-1"],
                    {"RLA_TEST_SLOW_REWARD": "0.05"})
    deadline = time.time() + 240
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= records):
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.time() < deadline, f"fewer than {records} metrics records"
        time.sleep(0.1)
    return proc


def test_two_nodes_with_one_rendezvous_train_like_one_process(tiny_model_dir, arith_data, tmp_path, reward_file):
    """The README's several-machines command on one host: two torchrun launches of one rank each meet at one c10d
    rendezvous (the run dir shared) and train like one process."""
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    short = {"trainer.total_training_steps": 2, "trainer.test_freq": 2, **SCORED_IN_PROCESS}
    nodes = [torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **short), nproc=1,
                      launcher=("--nnodes=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                                "--rdzv_id=two-nodes")) for _ in range(2)]
    single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **short))
    outs = [finish(node) for node in nodes]
    assert sum("2 x replicate (gloo)" in out for out in outs) == 1  # rank 0 alone prints the plan
    assert_same_metrics(read_metrics(dist_dir), read_metrics(single_dir), steps=(0, 1, 2))


def test_sigterm_stops_every_rank_at_one_step_and_saves_it(tiny_model_dir, arith_data, tmp_path, reward_file):
    """SIGTERM to torchrun (what a scheduler or Ctrl-C does: torchrun passes it to the ranks): no rank drops its
    step (the others would wait in a collective); the ranks agree at the next step boundary, rank 0 saves that step
    and each rank stops with the faults lane's message and exit code."""
    run_dir = tmp_path / "run"
    proc = slow_run_until(overrides(tiny_model_dir, arith_data, run_dir, reward_file), run_dir, steps=40, records=2)
    os.kill(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=20)  # torchrun kills the ranks 30 s after its SIGTERM
    except subprocess.TimeoutExpired:  # a rank hangs: each rank prints its threads' stacks (cli: faulthandler)
        for rank_pid in children(proc.pid):
            os.kill(rank_pid, signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "stopped by SIGTERM at step" in out, out[-12000:]
    assert "error: rank" not in out, out[-4000:]
    step = int(out.split("stopped by SIGTERM at step ")[1].split(":")[0])
    assert 1 <= step < 40  # the step running when the signal came (1 when it came between steps 1 and 2)
    latest = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert latest.read_text().strip() == str(step)
    trained = [r["step"] for r in read_metrics(run_dir) if "reward/mean" in r]
    assert trained == list(range(1, step + 1))  # each step once: rank 0 alone logs


def test_sigusr1_prints_a_ranks_stacks_and_the_run_goes_on(tiny_model_dir, arith_data, tmp_path, reward_file):
    """`kill -USR1 PID` of a rank (how to see where a hung rank waits) prints its threads' stacks; training goes on."""
    run_dir = tmp_path / "run"
    proc = slow_run_until(overrides(tiny_model_dir, arith_data, run_dir, reward_file), run_dir, steps=3, records=1)
    ranks = children(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGUSR1)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    assert "most recent call first" in out and "rlanywhere" in out.split("most recent call first", 1)[1], out[-4000:]
    assert [r["step"] for r in read_metrics(run_dir) if "reward/mean" in r] == [1, 2, 3]


def test_dynamic_sampling_on_two_ranks_matches_one_process(tiny_model_dir, arith_data, tmp_path, reward_file):
    """DAPO's dynamic sampling over 2 ranks: every round's prompts split like a step's, the decision to draw again
    taken on global counts, and the prompts trained on those one process picks (kept prompts of every round, then
    dropped ones), moved into one block per rank: the same metrics, rounds and weights as one process."""
    extra = {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "seq_reward",
             "algorithm.filter_groups.max_num_gen_batches": 3, "data.gen_batch_size": 8,
             "data.train_batch_size": 8, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
             "trainer.total_training_steps": 3, "trainer.test_freq": 3, "trainer.save_freq": 3, **SCORED_IN_PROCESS}
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    proc = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra))
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **extra))
    finish(proc)
    want = read_metrics(single_dir)
    trained = [r for r in want if "reward/mean" in r]
    assert any(r["filter_groups/num_gen_batches"] > 1 for r in trained)  # more rounds were drawn
    assert_same_metrics(read_metrics(dist_dir), want, steps=(1, 2, 3))
    assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_3"), reference.actor)


def test_dynamic_sampling_rounds_must_split_over_the_ranks():
    from rlanywhere.distributed import check_world_config
    from rlanywhere.errors import UserError

    cfg = load_config(None, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                             "data.gen_batch_size=6"])
    check_world_config(cfg, 1)
    check_world_config(cfg, 2)
    with pytest.raises(UserError, match="data.gen_batch_size=6 is not divisible by the 4 ranks"):
        check_world_config(cfg, 4)


# ------------------------------------------------------------------------------------------ pure helpers
def test_one_process_helpers_are_the_identity():
    dp = DataParallel()
    items = list(range(6))
    assert dp.share(items) == (items, 0)
    dp.set_rows(3)
    t = torch.arange(6.0).view(3, 2)
    assert dp.gather_rows(t) is t and dp.local_rows(t, t) is t
    assert dp.sum_dict({"a": 1.5}) == {"a": 1.5} and dp.gather_objects([1, 2]) == [1, 2]
    assert torch.equal(dp.exchange_rows(t, [[2, 0]], [2]), t[[2, 0]]) and dp.max_ints([3, 1]) == [3, 1]
    with pytest.raises(ValueError, match="one send list and one receive count per rank"):
        dp.exchange_rows(t, [[0], [1]], [1, 1])
    scale = dp.loss_scale(torch.tensor([[1, 1, 0], [0, 0, 0]]), norm_length=7)
    assert (scale.tokens, scale.sequences, scale.norm_length) == (2.0, 1.0, 7.0)


def test_share_gives_contiguous_blocks_without_overlap():
    items = list(range(8))
    shares = [DataParallel(rank=r, world=4).share(items) for r in range(4)]
    assert shares == [([0, 1], 0), ([2, 3], 2), ([4, 5], 4), ([6, 7], 6)]
    with pytest.raises(Exception, match="multiple of 3"):
        DataParallel(rank=0, world=3).share(items)


def test_row_layout():
    layout = RowLayout([4, 6, 2], rank=1)
    assert (layout.start, layout.stop, layout.total) == (4, 10, 12)


def test_torchrun_launch_sets_the_verl_keys_and_a_contradiction_is_an_error(monkeypatch):
    from rlanywhere.distributed import reconcile_world
    from rlanywhere.errors import UserError

    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    cfg = load_config(None, [])
    reconcile_world(cfg)
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (2, 2)
    cfg = load_config(None, ["trainer.n_gpus_per_node=4"])
    with pytest.raises(UserError, match="trainer.nnodes=2 trainer.n_gpus_per_node=2"):
        reconcile_world(cfg)


def test_a_job_stopped_by_a_sharded_oom_is_relaunched_to_resume_at_the_saved_size(tiny_model_dir, arith_data,
                                                                                    tmp_path, reward_file,
                                                                                    monkeypatch):
    """`rlanywhere train trainer.n_gpus_per_node=2` starts torchrun itself; a job that ends after saving smaller
    sizes (oom.OOMGuard.run_matched) is started again, resuming; a job that fails otherwise is not."""
    from rlanywhere import cli
    from rlanywhere.oom import remember_sizes

    run_dir = tmp_path / "run"
    items = overrides(tiny_model_dir, arith_data, run_dir, reward_file,
                      **{"trainer.n_gpus_per_node": 2, "trainer.resume_mode": "disable"})
    launches = []

    def torchrun_job(command):
        launches.append(command)
        if len(launches) == 1:  # rank 1 ran out of memory in a sharded update
            remember_sizes(str(run_dir), {"actor_micro_batch_size": 1}, {
                "phase": "actor_update", "attribute": "actor_micro_batch_size", "old_size": 2, "new_size": 1},
                rank=1)
            return 1
        return 0

    monkeypatch.setattr(cli.rank_launch, "run_ranks", torchrun_job)
    assert cli.main(["train", *items]) == 0
    assert len(launches) == 2 and "rlanywhere.rank_launch" in launches[0]
    assert "trainer.resume_mode=auto" not in launches[0] and launches[1][-1] == "trainer.resume_mode=auto"

    launches.clear()
    monkeypatch.setattr(cli.rank_launch, "run_ranks", lambda command: launches.append(command) or 1)
    assert cli.main(["train", *items]) == 1 and len(launches) == 1  # the saved sizes did not change: no relaunch


def test_a_micro_batch_one_replicated_rank_lowered_for_memory_is_in_the_checkpoint(tiny_model_dir, arith_data, tmp_path,
                                                                          reward_file):
    """Rank 1 alone runs out of memory in its replicated update of step 2 (tests/dist_oom_worker.py) and goes on at
    half the micro-batch; rank 0 never did. The checkpoint (written by rank 0) keeps rank 1's lowered size, so a
    resumed run starts every rank below the size that ran out of memory."""
    run = tmp_path / "dist"
    worker = Path(__file__).with_name("dist_oom_worker.py")
    finish(torchrun(overrides(tiny_model_dir, arith_data, run, reward_file, **SCORED_IN_PROCESS,
                              **{"hardware.data_parallel": "replicate"}), script=str(worker)))
    recoveries = {r["step"]: r.get("oom/recoveries") for r in read_metrics(run) if "oom/recoveries" in r}
    assert recoveries[2] == 1  # the injected OOM, recovered from on rank 1 within the step
    for step in (1, 2, 3):
        state = json.loads((run / "checkpoints" / f"global_step_{step}" / "trainer_state.json").read_text())
        assert state["run_state"]["oom_ceilings"] == ({} if step == 1 else {"actor_micro_batch_size": 1}), step


def test_run_records_of_the_ranks_merge_at_their_lowest():
    from rlanywhere.runstate import RunState

    records = [{"oom_ceilings": {"actor_micro_batch_size": 4}, "release_kv_between_phases": False,
                "fallbacks": {"rollout_engine": "rank 0's reason"}},
               {"oom_ceilings": {"actor_micro_batch_size": 2, "rollout_batch_size": 8},
                "release_kv_between_phases": True,
                "fallbacks": {"rollout_engine": "rank 1's reason", "release_kv_between_phases": "freed"}}]
    assert RunState.merged_records(records) == {
        "oom_ceilings": {"actor_micro_batch_size": 2, "rollout_batch_size": 8}, "release_kv_between_phases": True,
        "fallbacks": {"rollout_engine": "rank 0's reason", "release_kv_between_phases": "freed"}}


@pytest.mark.slow
def test_sampled_validation_on_two_ranks_scores_what_one_process_scores(tiny_model_dir, arith_data, tmp_path,
                                                                       reward_file):
    """val_kwargs with sampling (n=2, temperature 1): each validation row draws from its own stream keyed by its
    global prompt, so 2 ranks (each its block, in its own chunks) score what one process scores."""
    extra = {**SCORED_IN_PROCESS, "trainer.total_training_steps": 1, "trainer.test_freq": 1,
             "trainer.val_before_train": True, "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
             "actor_rollout_ref.rollout.val_kwargs.temperature": 1.0, "actor_rollout_ref.rollout.val_kwargs.n": 2,
             "data.val_batch_size": 3}
    ranks = torchrun(overrides(tiny_model_dir, arith_data, tmp_path / "dist", reward_file, **extra))
    single_process(overrides(tiny_model_dir, arith_data, tmp_path / "single", reward_file, **extra))
    finish(ranks)
    def val(rows):
        return {r["step"]: {k: v for k, v in r.items() if k.startswith("val/")} for r in rows}

    got, want = val(read_metrics(tmp_path / "dist")), val(read_metrics(tmp_path / "single"))
    assert want[0] and set(got[0]) == set(want[0])
    for step in (0, 1):
        for key, value in want[step].items():
            assert math.isclose(got[step][key], value, rel_tol=1e-6, abs_tol=1e-9), (step, key)


def test_pf_ppo_on_several_ranks_is_refused_before_loading():
    """Each rank would redraw only its own rows (and with the same seed): not what one process trains."""
    from rlanywhere.distributed import check_world_config
    from rlanywhere.errors import UserError

    cfg = load_config(None, ["algorithm.use_pf_ppo=true", "data.train_batch_size=8",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    check_world_config(cfg, 1)
    with pytest.raises(UserError, match="use_pf_ppo on 2 ranks"):
        check_world_config(cfg, 2)


def test_batch_sizes_must_split_over_the_ranks():
    from rlanywhere.distributed import check_batch_divisible
    from rlanywhere.errors import UserError

    cfg = load_config(None, ["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6"])
    check_batch_divisible(cfg, 2)
    check_batch_divisible(cfg, 1)
    with pytest.raises(UserError, match=r"data.train_batch_size=6 is not divisible by the 4 ranks"):
        check_batch_divisible(cfg, 4)


def test_planner_plans_one_rank_of_several_gpus(monkeypatch):
    from rlanywhere.machine import DeviceInfo, HardwareProbe
    from rlanywhere.vocabulary import PlanError

    ppo = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=gae",
           "data.train_batch_size=64", "data.max_prompt_length=256", "data.max_response_length=256",
           "actor_rollout_ref.actor.ppo_mini_batch_size=64"]
    probe = HardwareProbe.fake("h100")
    probe.devices.append(DeviceInfo.from_card("h100", 1))
    one = make_plan(load_config(None, ppo), probe, for_execution=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    two = make_plan(load_config(None, ppo + ["trainer.n_gpus_per_node=2"]), probe, for_execution=False)
    assert (one.world_size, one.data_parallel, one.dist_backend) == (1, "none", None)
    assert (two.world_size, two.data_parallel, two.dist_backend, two.device) == (2, "replicate", "nccl", "cuda:1")
    # half the sequences per rank: the rollout phase (KV cache of the batch) shrinks, the weights do not
    assert two.estimate["phases"]["rollout"] < one.estimate["phases"]["rollout"]
    assert "replicate over 2 ranks" in two.reasons["data_parallel"]
    with pytest.raises(PlanError, match="n_gpus_per_node=4 but this node has 2"):
        make_plan(load_config(None, ppo + ["trainer.n_gpus_per_node=4", "hardware.device=auto"]), probe,
                  for_execution=True)


def _collectives_worker(rank: int, port: int, out_dir: str) -> None:
    """One of 2 gloo ranks with different row counts and widths; writes what the helpers returned."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dp = DataParallel.from_env("cpu", "gloo")
    rows, width = (2, 3) if rank == 0 else (3, 2)
    local = torch.full((rows, width), float(rank + 1))
    dp.set_rows(rows)
    whole = dp.gather_rows(local)
    layer = torch.nn.Linear(2, 1)
    for p in layer.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    dp.sum_gradients(layer)
    # a parameter only rank 1 has a gradient for is summed with rank 0's zeros; one no rank has stays without
    experts = torch.nn.ModuleList([torch.nn.Linear(2, 1, bias=False) for _ in range(3)])
    experts[0].weight.grad = torch.ones_like(experts[0].weight)
    if rank == 1:
        experts[1].weight.grad = torch.full_like(experts[1].weight, 2.0)
    dp.sum_gradients(experts)
    expert_grads = [None if e.weight.grad is None else e.weight.grad.flatten().tolist() for e in experts]
    scale = dp.loss_scale(torch.ones(rows, width), norm_length=4)
    # two mini-batches in one exchange: all rows, then only the first row with its first column zeroed
    partial = torch.ones(1, width)
    partial[0, 0] = 0
    scales = dp.loss_scales([torch.ones(rows, width), partial], norm_length=4)
    # all-to-all: rank 0 keeps its row 0 and sends row 1 to rank 1; rank 1 sends all its rows to rank 0, 2 first
    held = torch.tensor([[0, 0], [1, 1]]) if rank == 0 else torch.tensor([[10, 10], [11, 11], [12, 12]])
    send, receive = ([[0], [1]], [1, 3]) if rank == 0 else ([[2, 0, 1], []], [1, 0])
    exchanged = dp.exchange_rows(held, send, receive)
    result = {"whole": whole.tolist(), "back": torch.equal(dp.local_rows(whole, local), local),
              "layout": [dp.layout.start, dp.layout.stop, dp.layout.total],
              "grads": [p.grad.flatten().tolist() for p in layer.parameters()], "expert_grads": expert_grads,
              "scale": [scale.tokens, scale.sequences, scale.norm_length],
              "scales": [[s.tokens, s.sequences, s.norm_length] for s in scales],
              "sums": dp.sum_dict({"a": rank + 1.0, f"only{rank}": 1.0}), "max": dp.max_value(rank * 10.0),
              "objects": dp.gather_objects([f"r{rank}"] * (rank + 1)),
              "exchanged": exchanged.tolist(), "max_ints": dp.max_ints([3, 1] if rank == 0 else [2, 5])}
    dp.close()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def forked_ranks(worker, args: tuple, nprocs: int = 2) -> None:
    """Run `worker(rank, *args)` in `nprocs` processes forked from this one, and wait for them (an error in one is
    raised here). For tests of the collectives themselves, not of how ranks are launched: a fork starts with torch,
    transformers and rlanywhere already imported, where a spawned process imports them again (seconds of CPU each).
    (The launches themselves, torchrun and `rlanywhere train`, are tested with real launches.)"""
    import torch.multiprocessing as mp

    mp.start_processes(_one_thread, args=(worker, *args), nprocs=nprocs, join=True, start_method="fork")


def _one_thread(rank: int, worker, *args) -> None:
    """A forked rank runs its ops on one thread: this process's OpenMP pool (2 threads under `pytest -n 0`) did not
    survive the fork, and an op that waited for it would hang."""
    torch.set_num_threads(1)
    worker(rank, *args)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_two_gloo_ranks(worker, out_dir: Path) -> tuple[dict, dict]:
    """Run `worker(rank, port, out_dir)` as 2 processes on a free local port; each writes out_dir/<rank>.json,
    returned as (rank 0's, rank 1's)."""
    forked_ranks(worker, (free_port(), str(out_dir)))
    first, second = (json.loads((Path(out_dir) / f"{r}.json").read_text()) for r in (0, 1))
    return first, second


def test_collectives_with_uneven_rows_and_widths(tmp_path):
    first, second = run_two_gloo_ranks(_collectives_worker, tmp_path)
    # rank 0: 2 rows x 3 of 1.0; rank 1: 3 rows x 2 of 2.0, padded with 0 to width 3
    assert first["whole"] == second["whole"] == [[1, 1, 1]] * 2 + [[2, 2, 0]] * 3
    assert first["back"] and second["back"]
    assert first["layout"] == [0, 2, 5] and second["layout"] == [2, 5, 5]
    assert first["grads"] == second["grads"] == [[3.0, 3.0], [3.0]]  # 1 + 2
    assert first["expert_grads"] == second["expert_grads"] == [[2.0, 2.0], [2.0, 2.0], None]
    assert first["scale"] == second["scale"] == [12.0, 5.0, 4.0]  # 6 + 6 tokens, 2 + 3 sequences
    assert first["scales"] == second["scales"] == [[12.0, 5.0, 4.0], [3.0, 2.0, 4.0]]  # (3 - 1) + (2 - 1) tokens
    assert first["sums"] == {"a": 3.0, "only0": 1.0, "only1": 1.0} and first["max"] == second["max"] == 10.0
    assert first["objects"] == ["r0", "r1", "r1"]
    assert first["exchanged"] == [[0, 0], [12, 12], [10, 10], [11, 11]] and second["exchanged"] == [[1, 1]]
    assert first["max_ints"] == second["max_ints"] == [3, 5]
