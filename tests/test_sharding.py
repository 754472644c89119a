"""FSDP2 sharding on CPU: 2 gloo ranks with hardware.data_parallel=shard train like one process on the same global
batch (GRPO and PPO: losses, gradient norms, every metric, the weights), survive kill -9 with DCP checkpoints, and
a 2-rank sharded checkpoint resumes on 1 rank. Plus the pieces on their own: gradients of the chunked log-probs
through a sharded root equal one process's, the planner's replicate/shard/refuse decision.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time

import pytest
import torch

from rlanywhere.config import load_config
from rlanywhere.tracking import read_metrics

from .test_distributed import (actor_weights, assert_same_metrics, assert_same_weights, finish, kill_9_job,
                               overrides, reward_file, single_process, torchrun)

pytestmark = pytest.mark.slow
_ = reward_file  # the fixture, imported for the tests below

SHARD = {"hardware.data_parallel": "shard"}


def plan_record(run_dir) -> dict:
    return json.loads((run_dir / "plan.json").read_text())


def test_grpo_sharded_on_two_ranks_matches_one_process_and_survives_kill_9(tiny_model_dir, arith_data, tmp_path,
                                                                            reward_file):
    """GRPO, 3 steps, sharded: killed with SIGKILL inside step 3 (after the DCP checkpoint of step 2), resumed on 2
    ranks: steps 0-3 equal one process; the same checkpoint resumed by one process gives the same step 3."""
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    marker = dist_dir / "checkpoints" / "global_step_2" / "trainer_state.json"
    proc = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **SHARD),
                    {"RLA_TEST_HANG_WHEN": str(marker)})
    deadline = time.time() + 240
    latest = dist_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    while not (latest.exists() and latest.read_text().strip() == "2"):
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.time() < deadline, "no step-2 checkpoint"
        time.sleep(0.1)
    kill_9_job(proc)
    proc.communicate(timeout=60)
    checkpoint = dist_dir / "checkpoints" / "global_step_2"
    assert (checkpoint / "dcp" / ".metadata").exists(), sorted(os.listdir(checkpoint))
    assert (checkpoint / "actor" / "model.safetensors").exists()  # the HF-format actor, written once by rank 0
    shutil.copytree(dist_dir, tmp_path / "dist_copy")

    resume = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **SHARD))
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file))
    out = finish(resume)
    assert "resumed from" in out and "global_step_2" in out
    assert plan_record(dist_dir)["data_parallel"] == "shard"

    want = read_metrics(single_dir)
    assert_same_metrics(read_metrics(dist_dir), want, steps=(0, 1, 2, 3))
    assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_3"), reference.actor)
    assert any(abs(r.get("actor/pg_loss", 0.0)) > 1e-4 for r in want)

    # the 2-rank sharded checkpoint resumed by one process (DCP reshards to the world size that loads it)
    copy = tmp_path / "dist_copy"
    single_process(overrides(tiny_model_dir, arith_data, copy, reward_file))
    assert_same_metrics(read_metrics(copy), want, steps=(3,))


def test_ppo_sharded_with_critic_and_reference_matches_one_process(tiny_model_dir, arith_data, tmp_path, reward_file):
    """PPO: sharded actor, critic and reference, KL in the reward (adaptive), 2 epochs, 2 mini-batches, token-budget
    micro-batches (ranks run different numbers of them: padded to match)."""
    extra = {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True,
             "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.05,
             "algorithm.kl_ctrl.target_kl": 0.01, "algorithm.kl_ctrl.horizon": 10,
             "actor_rollout_ref.actor.ppo_epochs": 2, "critic.optim.lr": 1e-3,
             "actor_rollout_ref.actor.use_dynamic_bsz": True,
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 90,
             "trainer.total_training_steps": 2, "trainer.test_freq": 2, "trainer.save_freq": 0}
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    proc = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra, **SHARD))
    single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **extra))
    finish(proc)
    assert plan_record(dist_dir)["data_parallel"] == "shard"
    want = read_metrics(single_dir)
    assert {"critic/vf_loss", "actor/kl_coef", "actor/kl", "actor/grad_norm", "critic/grad_norm"} <= set(want[-1])
    assert_same_metrics(read_metrics(dist_dir), want, steps=(0, 1, 2))
