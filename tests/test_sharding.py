"""FSDP2 sharding on CPU: 2 gloo ranks with hardware.data_parallel=shard train like one process on the same global
batch (GRPO and PPO: losses, gradient norms, every metric, the weights), survive kill -9 with DCP checkpoints, and
a 2-rank sharded checkpoint resumes on 1 rank; an out-of-memory error in a sharded update restarts the job at half
the micro-batch; an fp16 plan skips, on every rank, a step that overflowed on one. Plus the pieces on their own:
gradients of the chunked log-probs through a sharded root equal one process's, the planner's replicate/shard/refuse
decision.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from rlanywhere.config import load_config
from rlanywhere.tracking import read_metrics

from .test_distributed import (SCORED_IN_PROCESS, actor_weights, assert_same_metrics, assert_same_weights, finish,
                               forked_ranks, free_port, kill_9_after_checkpoint_2, overrides, reward_file,
                               single_process, torchrun)

pytestmark = pytest.mark.slow
_ = reward_file  # the fixture, imported for the tests below

SHARD = {"hardware.data_parallel": "shard"}
NO_POOL = SCORED_IN_PROCESS  # rewards scored in the trainer process, every run below (test_distributed says why)


def plan_record(run_dir) -> dict:
    return json.loads((run_dir / "plan.json").read_text())


def test_grpo_sharded_on_two_ranks_matches_one_process_and_survives_kill_9(tiny_model_dir, arith_data, tmp_path,
                                                                            reward_file):
    """GRPO, 3 steps, sharded: killed with SIGKILL inside step 3 (after the DCP checkpoint of step 2), resumed on 2
    ranks: steps 0-3 equal one process; the same checkpoint resumed by one process gives the same step 3."""
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    kill_9_after_checkpoint_2(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **SHARD, **NO_POOL),
                              dist_dir)
    checkpoint = dist_dir / "checkpoints" / "global_step_2"
    assert (checkpoint / "dcp" / ".metadata").exists(), sorted(os.listdir(checkpoint))
    assert (checkpoint / "actor" / "model.safetensors").exists()  # the HF-format actor, written once by rank 0
    shutil.copytree(dist_dir, tmp_path / "dist_copy")

    resume = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **SHARD, **NO_POOL))
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **NO_POOL))
    out = finish(resume)
    assert "resumed from" in out and "global_step_2" in out
    assert plan_record(dist_dir)["data_parallel"] == "shard"

    want = read_metrics(single_dir)
    assert_same_metrics(read_metrics(dist_dir), want, steps=(0, 1, 2, 3))
    assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_3"), reference.actor)
    assert any(abs(r.get("actor/pg_loss", 0.0)) > 1e-4 for r in want)

    # the 2-rank sharded checkpoint resumed by one process (DCP reshards to the world size that loads it)
    copy = tmp_path / "dist_copy"
    single_process(overrides(tiny_model_dir, arith_data, copy, reward_file, **NO_POOL))
    assert_same_metrics(read_metrics(copy), want, steps=(3,))


def test_an_oom_in_a_sharded_update_stops_the_job_and_the_restart_resumes_at_half(tiny_model_dir, arith_data,
                                                                                   tmp_path, reward_file):
    """Rank 1 runs out of memory in its sharded update of step 2 (tests/dist_oom_worker.py): the job stops with
    the micro-batch size halved in checkpoints/oom_sizes.json, torchrun's restart resumes from checkpoint 1 at
    that size, and steps 0-3 and the final weights equal one process (the loss does not depend on the
    micro-batch split)."""
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    worker = Path(__file__).with_name("dist_oom_worker.py")
    proc = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **SHARD, **NO_POOL),
                    script=str(worker), launcher=("--standalone", "--max-restarts=1"), cwd=str(tmp_path))
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **NO_POOL))
    out = finish(proc)
    assert "OutOfMemoryRestart" in out and "actor_micro_batch_size=1 is saved in" in out
    assert "resumed from" in out and "global_step_1" in out
    assert "actor_micro_batch_size 2 -> 1" in out and "3 steps, 2 of them in" in out
    record = plan_record(dist_dir)
    assert record["run_state"]["sizes"]["actor_micro_batch_size"] == 1
    assert [(e["old_size"], e["new_size"], e["rank"]) for e in record["oom_events"]] == [(2, 1, 1)]
    # the size lives on in the checkpoints written since; the file for the next launch is retired
    assert not (dist_dir / "checkpoints" / "oom_sizes.json").exists()
    got = read_metrics(dist_dir)
    assert [r["oom/recoveries"] for r in got if r["step"] >= 1] == [0, 1, 1]  # the stop counted from step 2 on
    without_count = lambda rows: [{k: v for k, v in r.items() if k != "oom/recoveries"} for r in rows]  # noqa: E731
    assert_same_metrics(without_count(got), without_count(read_metrics(single_dir)), steps=(0, 1, 2, 3))
    assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_3"), reference.actor)


def test_fp16_sharded_with_one_rank_overflowing_matches_one_process(tiny_model_dir, arith_data, tmp_path,
                                                                     reward_file, monkeypatch):
    """fp16 plans sharded (a pair of T4s or V100s): autocast and a GradScaler over FSDP2's DTensor gradients (plan
    made fp16 on the CPU by tests/dist_fp16_worker.py). Rank 1 alone overflows in step 2: both ranks skip it and
    halve the loss scale (torch max-reduces the found-inf flag over the mesh); metrics equal one process whose step
    2 overflows (steps 0-2 whole, the loss scale at every step)."""
    from . import dist_fp16_worker

    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    worker = Path(__file__).with_name("dist_fp16_worker.py")
    proc = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **SHARD, **NO_POOL),
                    script=str(worker), cwd=str(tmp_path))
    dist_fp16_worker.install(monkeypatch.setattr)
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **NO_POOL))
    finish(proc)
    assert reference.plan.use_grad_scaler and plan_record(dist_dir)["precision"] == "fp16"
    want = read_metrics(single_dir)
    scales = [(r["actor/loss_scale"], r["actor/skipped_steps"]) for r in read_metrics(dist_dir) if r["step"] >= 1]
    assert scales[1] == (scales[0][0] / 2, 1.0) and scales[2] == (scales[1][0], 0.0), scales
    # fp16 rounding differs with which rows share a micro-batch: the trainer's distance to the fp32 rollout's
    # log-probs (~4e-5) at every step, and after step 3's update a greedy validation answer; so steps 0-2 (the
    # overflow included) are compared whole, step 3 by its loss scale
    gap = "actor/rollout_logprob_gap"
    assert all(r[gap] < 1e-3 for r in read_metrics(dist_dir) + want if gap in r)
    without_gap = lambda rows: [{k: v for k, v in r.items() if k != gap} for r in rows]  # noqa: E731
    assert_same_metrics(without_gap(read_metrics(dist_dir)), without_gap(want), steps=(0, 1, 2))
    assert [r["actor/loss_scale"] for r in want if r["step"] >= 1] == [scale for scale, _ in scales]
    # no rank stepped on the overflowed gradient: its shard of every weight is as after step 1
    after_overflow = actor_weights(dist_dir / "checkpoints" / "global_step_2")
    for name, tensor in actor_weights(dist_dir / "checkpoints" / "global_step_1").items():
        assert torch.equal(after_overflow[name], tensor), name


@pytest.mark.parametrize("extra", [{}, {"algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3},
                                   {"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 16,
                                    "algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3,
                                    "critic.model.lora_rank": 4}],
                         ids=["grpo", "ppo-critic", "lora-actor-and-critic"])
def test_a_replicated_checkpoint_resumes_sharded(tiny_model_dir, arith_data, tmp_path, reward_file, extra):
    """A replicated run's checkpoint (2 replicas, killed inside step 3) resumed sharded, as when a model outgrows
    replicas or a 1-GPU run with offload moves to GPUs that plan it sharded: every rank reads the full weights and
    Adam state (the critic's too; LoRA runs: the actor's and the critic's adapters, the value head, their Adam
    state) and keeps its shards; step 3 and its weights equal one process's."""
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    kill_9_after_checkpoint_2(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra, **NO_POOL),
                              dist_dir)
    assert not (dist_dir / "checkpoints" / "global_step_2" / "dcp").exists()  # the replicated layout
    resume = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra, **SHARD, **NO_POOL))
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **extra, **NO_POOL))
    out = finish(resume)
    assert "resumed from" in out and "global_step_2" in out
    assert plan_record(dist_dir)["data_parallel"] == "shard"
    assert (dist_dir / "checkpoints" / "global_step_3" / "dcp" / ".metadata").exists()  # sharded from here on
    assert_same_metrics(read_metrics(dist_dir), read_metrics(single_dir), steps=(3,))
    if "actor_rollout_ref.model.lora_rank" in extra:  # the checkpoint's actor/ holds the LoRA-merged weights
        from rlanywhere.lora import merged_state_for_export

        assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_3"),
                            merged_state_for_export(reference.actor))
    else:
        assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_3"), reference.actor)


def test_ppo_sharded_with_critic_and_reference_matches_one_process(tiny_model_dir, arith_data, tmp_path, reward_file):
    """PPO: sharded actor, critic and reference, KL in the reward (adaptive), 2 epochs, gradient checkpointing,
    token-budget micro-batches (ranks may run different numbers of them: padded to match)."""
    extra = {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True,
             "algorithm.kl_ctrl.type": "adaptive", "algorithm.kl_ctrl.kl_coef": 0.05,
             "algorithm.kl_ctrl.target_kl": 0.01, "algorithm.kl_ctrl.horizon": 10,
             "actor_rollout_ref.actor.ppo_epochs": 2, "critic.optim.lr": 1e-3,
             "actor_rollout_ref.actor.use_dynamic_bsz": True,
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 90,
             "actor_rollout_ref.model.enable_gradient_checkpointing": True,
             "trainer.total_training_steps": 2, "trainer.test_freq": 2, "trainer.save_freq": 0}
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    proc = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra, **SHARD, **NO_POOL))
    single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **extra, **NO_POOL))
    finish(proc)
    assert plan_record(dist_dir)["data_parallel"] == "shard"
    want = read_metrics(single_dir)
    assert {"critic/vf_loss", "actor/reward_kl_penalty_coeff", "actor/kl", "actor/grad_norm",
            "critic/grad_norm"} <= set(want[-1])
    assert_same_metrics(read_metrics(dist_dir), want, steps=(0, 1, 2))


def test_lora_sharded_matches_one_process_and_exports_merged_weights(tiny_model_dir, arith_data, tmp_path,
                                                                     reward_file):
    """LoRA sharded (the adapters are the trainable parameters; the reference is the adapter-disabled base, KL
    loss on): metrics of 2 GRPO steps equal one process, and the checkpoint's HF actor (gathered, LoRA merged by
    dist_checkpoint) equals the one process's merged weights."""
    from rlanywhere.lora import merged_state_for_export

    extra = {"actor_rollout_ref.model.lora_rank": 8, "actor_rollout_ref.model.lora_alpha": 16,
             "actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.kl_loss_coef": 0.1,
             "trainer.total_training_steps": 2, "trainer.test_freq": 2, "trainer.save_freq": 2}
    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    proc = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **extra, **SHARD, **NO_POOL))
    reference = single_process(overrides(tiny_model_dir, arith_data, single_dir, reward_file, **extra, **NO_POOL))
    finish(proc)
    assert plan_record(dist_dir)["data_parallel"] == "shard"
    want = read_metrics(single_dir)
    assert {"actor/kl_loss", "actor/grad_norm"} <= set(want[-1])
    assert_same_metrics(read_metrics(dist_dir), want, steps=(0, 1, 2))
    got = actor_weights(dist_dir / "checkpoints" / "global_step_2")
    assert not any("lora" in key for key in got)
    assert_same_weights(got, merged_state_for_export(reference.actor))


def _sharded_head_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    """Chunked log-probs + entropy of a sharded model (decoder call, LM head weight read directly) on 2 gloo
    ranks, each its half of the rows in 2 micro-batches: gradients and the clipped norm, gathered to full."""
    from transformers import AutoModelForCausalLM

    from rlanywhere.distributed import DataParallel
    from rlanywhere.logprobs import response_logprobs
    from rlanywhere.sharding import call_in_root_forward, gathered, is_sharded, shard_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dp = DataParallel.from_env("cpu", "gloo")
    torch.manual_seed(0)
    ids = torch.randint(4, 200, (4, 12))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shard_model(model)
    assert is_sharded(model)
    logprobs = call_in_root_forward(model, response_logprobs)
    for row in (2 * rank, 2 * rank + 1):
        lp, ent = logprobs(model, ids[row:row + 1], torch.ones(1, 12, dtype=torch.long), 6, with_entropy=True)
        (lp.sum() / 24 + 0.1 * ent.sum() / 24).backward()  # shares of the global mean over 4 rows x 6 tokens
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    with gathered(model):  # plain full weights, no collective inside (ranks may call it unequally)
        full = model.model.layers[0].mlp.up_proj.weight
        plain = type(full) is torch.nn.Parameter and full.shape == (128, 64)
        if rank == 0:
            model(ids[:1])
    if rank == 0:
        torch.save({"grads": grads, "norm": float(norm), "plain": plain}, os.path.join(out_dir, "sharded.pt"))
    dp.close()


def test_sharded_chunked_logprob_gradients_equal_one_process(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlanywhere.logprobs import response_logprobs

    forked_ranks(_sharded_head_worker, (free_port(), str(tiny_model_dir), str(tmp_path)))
    got = torch.load(tmp_path / "sharded.pt", weights_only=True)
    torch.manual_seed(0)
    ids = torch.randint(4, 200, (4, 12))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    lp, ent = response_logprobs(model, ids, torch.ones(4, 12, dtype=torch.long), 6, with_entropy=True)
    (lp.sum() / 24 + 0.1 * ent.sum() / 24).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9)
    assert got["plain"]
    assert math.isclose(got["norm"], float(norm), rel_tol=1e-5)
    for name, param in model.named_parameters():
        # the summed (not averaged) gradient: FSDP's divide factor is 1, each rank's loss is its share
        torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-5, atol=1e-7)
    assert float(model.model.embed_tokens.weight.grad.abs().sum()) > 0  # the tied head's gradient arrived


def test_planner_shards_what_does_not_fit_replicated():
    """Qwen2.5-1.5B-shape full fine-tuning GRPO on emulated P40s (optimizer offload off): refused on one card with
    the numbers, planned "shard" on two (weights, grads and Adam halved; the gathered weights counted for the
    rollout); a small model stays replicated; hardware.data_parallel forces either; a bad value is an error."""
    from rlanywhere.errors import UserError
    from rlanywhere.planner import make_plan
    from rlanywhere.vocabulary import NoFitError

    big = ["actor_rollout_ref.model.path=qwen2.5-1.5b", "algorithm.adv_estimator=grpo", "data.train_batch_size=16",
           "actor_rollout_ref.rollout.n=8", "data.max_prompt_length=256", "data.max_response_length=512",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "hardware.optimizer_offload=false"]

    def plan(items):
        return make_plan(load_config(None, items), for_execution=False, emulate="p40")

    with pytest.raises(NoFitError, match="actor_adam 11.50 GiB"):
        plan(big)
    two = plan(big + ["trainer.n_gpus_per_node=2"])
    assert (two.world_size, two.data_parallel) == (2, "shard")
    parts = two.estimate["breakdown"]
    assert parts["actor_update"]["actor_adam"] == pytest.approx(11.50 * 2**30 / 2, rel=0.01)
    assert parts["rollout"]["gathered_weights"] == pytest.approx(5.75 * 2**30, rel=0.01)
    assert two.estimate["peak_bytes"] <= two.memory_budget_bytes
    assert "a full replica does not fit one rank" in two.reasons["data_parallel"]
    assert "gathered" in two.reasons["data_parallel"]
    seven = [item.replace("qwen2.5-1.5b", "qwen2.5-7b") for item in big]
    with pytest.raises(NoFitError, match="(?s)sharded over the 2 ranks.*does not fit either"):  # 7B: not even sharded
        plan(seven + ["trainer.n_gpus_per_node=2"])
    small = ["actor_rollout_ref.model.path=qwen2.5-0.5b", "algorithm.adv_estimator=grpo", "trainer.n_gpus_per_node=2"]
    assert plan(small).data_parallel == "replicate"
    assert plan(small + ["hardware.data_parallel=shard"]).data_parallel == "shard"
    with pytest.raises(NoFitError):
        plan(big + ["trainer.n_gpus_per_node=2", "hardware.data_parallel=replicate"])
    with pytest.raises(UserError, match="hardware.data_parallel='both'"):
        plan(small + ["hardware.data_parallel=both"])


def test_matched_micro_batches_pad_the_shorter_rank():
    """A rank with fewer micro-batches than the most any rank has repeats its first one, flagged as padding (its
    loss weighs 0); replicas and one process are left alone."""
    from rlanywhere.sharding import matched_micro_batches

    class TwoRanks:
        enabled = True

        def max_value(self, value: float) -> float:
            return max(value, 3.0)  # the other rank has 3 micro-batches

    assert matched_micro_batches([[0, 1], [2]], TwoRanks(), sharded=True) == [
        ([0, 1], False), ([2], False), ([0, 1], True)]
    assert matched_micro_batches([[0, 1], [2]], TwoRanks(), sharded=False) == [([0, 1], False), ([2], False)]


def test_planner_shards_within_a_node_across_nodes():
    """HSDP: Qwen2.5-1.5B-shape GRPO on 2 nodes x 2 emulated P40s: a shard over one node's 2 ranks fits, so each
    node holds the shards and the nodes replicate them (shard_group_size 2); verl's fsdp_size picks the group; a
    group that does not divide the ranks is refused; one node shards over all its ranks."""
    from rlanywhere.errors import UserError
    from rlanywhere.planner import make_plan

    big = ["actor_rollout_ref.model.path=qwen2.5-1.5b", "algorithm.adv_estimator=grpo", "data.train_batch_size=16",
           "actor_rollout_ref.rollout.n=8", "data.max_prompt_length=256", "data.max_response_length=512",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "hardware.optimizer_offload=false"]

    def plan(*items):
        return make_plan(load_config(None, [*big, *items]), for_execution=False, emulate="p40")

    hybrid = plan("trainer.nnodes=2", "trainer.n_gpus_per_node=2")
    assert (hybrid.world_size, hybrid.data_parallel, hybrid.shard_group_size) == (4, "shard", 2)
    assert "HSDP" in hybrid.reasons["data_parallel"] and "in groups of 2 (HSDP)" in hybrid.summary()
    # the memory is planned for a shard over 2 ranks: Adam halved, not quartered
    assert hybrid.estimate["breakdown"]["actor_update"]["actor_adam"] == pytest.approx(11.50 * 2**30 / 2, rel=0.01)
    whole = plan("trainer.nnodes=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size=4")
    assert whole.shard_group_size == 4 and "HSDP" not in whole.reasons["data_parallel"]
    assert whole.estimate["breakdown"]["actor_update"]["actor_adam"] == pytest.approx(11.50 * 2**30 / 4, rel=0.01)
    assert plan("trainer.n_gpus_per_node=4").shard_group_size == 4  # one node: all its ranks
    small = make_plan(load_config(None, ["actor_rollout_ref.model.path=qwen2.5-0.5b", "trainer.n_gpus_per_node=2",
                                         "actor_rollout_ref.actor.fsdp_config.fsdp_size=2"]),
                      for_execution=False, emulate="p40")
    assert small.data_parallel == "replicate" and "shard_group_size=2 has no effect" in small.reasons["data_parallel"]
    with pytest.raises(UserError, match="shard_group_size=3 .* must divide the 4 ranks"):
        plan("trainer.nnodes=2", "trainer.n_gpus_per_node=2", "hardware.shard_group_size=3")


def test_hsdp_on_four_ranks_matches_one_process_and_resumes_in_one(tiny_model_dir, arith_data, tmp_path, reward_file):
    """4 gloo ranks sharded in 2 groups of 2 (verl's fsdp_size=2: HSDP, the groups replicas of each other), GRPO, 2
    steps: every metric and the weights equal one process on the same global batch (default settings); the
    HSDP checkpoint (DCP) resumed by one process gives the reference's step 3."""
    from rlanywhere.planner import make_plan
    from rlanywhere.trainer import RLTrainer

    def one_process(run_dir, steps: int) -> RLTrainer:
        cfg = load_config(None, overrides(tiny_model_dir, arith_data, run_dir, reward_file, **NO_POOL, **{
            "trainer.total_training_steps": steps, "trainer.test_freq": 2}))
        plan = make_plan(cfg, for_execution=True)
        trainer = RLTrainer(cfg, plan, cfg.trainer.default_local_dir)
        trainer.fit()
        return trainer

    dist_dir, single_dir = tmp_path / "dist", tmp_path / "single"
    proc = torchrun(overrides(tiny_model_dir, arith_data, dist_dir, reward_file, **SHARD, **NO_POOL, **{
        "actor_rollout_ref.actor.fsdp_config.fsdp_size": 2, "trainer.total_training_steps": 2,
        "trainer.test_freq": 2}), nproc=4)
    reference = one_process(single_dir, steps=3)
    out = finish(proc)
    assert "FSDP2 device mesh (2, 2) (HSDP" in out
    record = plan_record(dist_dir)
    assert (record["data_parallel"], record["shard_group_size"], record["world_size"]) == ("shard", 2, 4)
    want = read_metrics(single_dir)
    assert_same_metrics(read_metrics(dist_dir), want, steps=(0, 1, 2))
    step_2 = actor_weights(single_dir / "checkpoints" / "global_step_2")
    for name, tensor in actor_weights(dist_dir / "checkpoints" / "global_step_2").items():
        torch.testing.assert_close(tensor, step_2[name], rtol=1e-5, atol=1e-5)  # as assert_same_weights
    one_process(dist_dir, steps=3)  # resumes the HSDP run's DCP checkpoint of step 2 in one process
    rows = read_metrics(dist_dir)
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3]  # resumed, not started over
    assert_same_metrics(rows, want, steps=(3,))
    assert_same_weights(actor_weights(dist_dir / "checkpoints" / "global_step_3"), reference.actor)


def test_sharded_validation_with_more_chunks_on_one_rank_matches_one_process(tiny_model_dir, arith_data, tmp_path,
                                                                               reward_file):
    """5 validation prompts in chunks of 2 on 2 sharded ranks: rank 0 has 2 chunks, rank 1 one. Each generation
    gathers the sharded weights (a collective), so rank 1 gathers for an empty chunk too; val/* equal one process."""
    def items(name):
        return overrides(tiny_model_dir, arith_data, tmp_path / name, reward_file, **NO_POOL, **{
            "trainer.val_only": True, "data.val_max_samples": 5, "data.val_batch_size": 2})

    finish(torchrun(items("dist") + [f"{key}={value}" for key, value in SHARD.items()]), timeout=120)
    single_process(items("single"))
    got, want = ({key: value for row in read_metrics(tmp_path / name) for key, value in row.items()
                  if key.startswith("val")} for name in ("dist", "single"))
    assert got["val/num_samples"] == 5 and got == pytest.approx(want)
