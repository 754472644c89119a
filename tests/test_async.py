"""The rollout off the critical path: the rollout correction (truncated importance sampling) against hand-computed
values and verl's formulas, trainer.async's config and plan, and the one_step_off pipeline end to end (which weights
generate which batch, overlapped vs in turn, resume mid-pipeline)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from rlanywhere.algorithms import aggregate_loss, ppo_policy_loss
from rlanywhere.async_pipeline import LookaheadLoader, scored_from, scored_state
from rlanywhere.async_plan import IN_TURN, OVERLAPPED, SYNC, decide_async_rollout, overlap_bytes
from rlanywhere.config import ConfigError, load_config
from rlanywhere.rollout.base import RolloutBatch
from rlanywhere.rollout_correction import RolloutCorrection, rollout_is_weights
from rlanywhere.stepbatch import ScoredRollout

from . import warm_ranks

LOG = math.log


# ------------------------------------------------------------------------------------------------ the correction
def test_token_weights_by_hand():
    # row 0: pi_old/pi_rollout = 0.5/0.25 = 2, 0.3/0.6 = 0.5, 0.9/0.1 = 9 (capped at 2); row 1: 0.2/0.2, padding
    old = torch.tensor([[LOG(0.5), LOG(0.3), LOG(0.9)], [LOG(0.2), 0.0, 0.0]])
    rollout = torch.tensor([[LOG(0.25), LOG(0.6), LOG(0.1)], [LOG(0.2), -3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    weights, m = rollout_is_weights(old, rollout, mask, "token", threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.5, 2.0], [1.0, 0.0, 0.0]]))
    assert float(m["rollout_is_mean"]) == pytest.approx((2 + 0.5 + 9 + 1) / 4, rel=1e-6)  # before the cap
    assert float(m["rollout_is_max"]) == pytest.approx(9.0, rel=1e-6)
    assert float(m["rollout_is_capped_frac"]) == pytest.approx(1 / 4)  # 9 > 2 (2 itself is not above the cap)
    assert float(m["rollout_is_low_frac"]) == pytest.approx(0.0)  # 0.5 is not below 1/2
    kl = -(LOG(2) + LOG(0.5) + LOG(9) + 0) / 4
    assert float(m["rollout_kl"]) == pytest.approx(kl, rel=1e-6)
    k3 = sum(r - LOG(r) - 1 for r in (2, 0.5, 9, 1)) / 4
    assert float(m["rollout_k3_kl"]) == pytest.approx(k3, rel=1e-6)


def test_sequence_weights_by_hand():
    # row 0: 2 * 0.5 * 1.5 = 1.5 on every token; row 1: 3 * 1 = 3 -> capped at 2.5; row 2: 0.25 (below 1/2.5)
    old = torch.tensor([[LOG(0.4), LOG(0.2), LOG(0.6)], [LOG(0.9), LOG(0.5), 0.0], [LOG(0.1), 0.0, 0.0]])
    rollout = torch.tensor([[LOG(0.2), LOG(0.4), LOG(0.4)], [LOG(0.3), LOG(0.5), 0.0], [LOG(0.4), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    weights, m = rollout_is_weights(old, rollout, mask, "sequence", threshold=2.5)
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.5, 1.5], [2.5, 2.5, 0.0], [0.25, 0.0, 0.0]]))
    assert float(m["rollout_is_capped_frac"]) == pytest.approx(1 / 3)  # a share of sequences
    assert float(m["rollout_is_low_frac"]) == pytest.approx(1 / 3)
    assert float(m["rollout_is_mean"]) == pytest.approx((1.5 * 3 + 3 * 2 + 0.25) / 6, rel=1e-5)
    # a fourth row with no response (a padding row of a micro-batch) is no sequence: the shares stay of three
    old, rollout, mask = (torch.cat([t, torch.zeros(1, 3, dtype=t.dtype)]) for t in (old, rollout, mask))
    _, padded = rollout_is_weights(old, rollout, mask, "sequence", threshold=2.5)
    assert float(padded["rollout_is_capped_frac"]) == pytest.approx(1 / 3)
    assert float(padded["rollout_is_low_frac"]) == pytest.approx(1 / 3)


def _verl_reference(old, rollout, mask, level, threshold):
    """verl's compute_rollout_correction_weights + compute_is_metrics (rollout_corr_helper.py), re-derived here in
    its own steps as the oracle: masked_sum of the log-ratio, clamp +-20, exp, x mask, fraction above the cap."""
    log_ratio = old - rollout
    mask = mask.to(old.dtype)
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    else:
        s = (log_ratio * mask).sum(-1, keepdim=True)
        w = torch.exp(torch.clamp(s, -20.0, 20.0)).expand_as(log_ratio)
    w = w * mask
    mean = (w * mask).sum() / mask.sum()
    if level == "token":
        high = ((w > threshold).to(old.dtype) * mask).sum() / mask.sum()
    else:
        high = (s > math.log(threshold)).to(old.dtype).mean()
    return w.clamp(max=threshold), mean, high


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_match_verls_formulas_on_seeded_inputs(level):
    gen = torch.Generator().manual_seed(7)
    rollout = -torch.rand(6, 9, generator=gen, dtype=torch.float64) * 3
    old = rollout + torch.randn(6, 9, generator=gen, dtype=torch.float64) * (0.6 if level == "token" else 0.4)
    lengths = torch.tensor([9, 7, 1, 4, 9, 2])
    mask = (torch.arange(9) < lengths[:, None]).long()
    weights, m = rollout_is_weights(old, rollout, mask, level, threshold=2.0)
    want, mean, high = _verl_reference(old, rollout, mask, level, 2.0)
    torch.testing.assert_close(weights, want, rtol=1e-12, atol=0)
    assert float(m["rollout_is_mean"]) == pytest.approx(float(mean), rel=1e-12)
    assert float(m["rollout_is_capped_frac"]) == pytest.approx(float(high), rel=1e-12)
    assert 0 < float(high) < 1  # the inputs exercise the cap


def test_weights_multiply_each_tokens_policy_loss_and_pass_no_gradient():
    old = torch.log(torch.tensor([[0.5, 0.3], [0.2, 0.6]]))
    rollout = torch.log(torch.tensor([[0.25, 0.6], [0.2, 0.2]]))
    logprob = old.clone().requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.ones(2, 2)
    weights, _ = RolloutCorrection("token", 2.0).weights(old, rollout, mask)  # [[2, .5], [1, 2 (3 capped)]]
    loss, _ = ppo_policy_loss(old, logprob, advantages, mask, token_weights=weights)
    # at ratio 1 the per-token loss is -A: weighted token mean (-1*2 - 1*.5 + 2*1 + 2*2) / 4
    assert float(loss.detach()) == pytest.approx((-2 - 0.5 + 2 + 4) / 4, rel=1e-6)
    loss.backward()
    # d/dlogprob of -A * w * exp(logprob - old) at logprob = old: -A * w / 4
    torch.testing.assert_close(logprob.grad, torch.tensor([[-0.5, -0.125], [0.5, 1.0]]))
    plain, _ = ppo_policy_loss(old, old, advantages, mask)
    assert float(plain) == pytest.approx(float(aggregate_loss(-advantages, mask)))


def test_stale_batch_weights_by_hand():
    """A batch sampled by the policy of step k and trained at step k+1: one SGD step on a two-token softmax policy,
    its weights computed by hand (pi_{k+1}(y) / pi_k(y), capped) against the correction's."""
    logits = torch.tensor([0.0, 0.0], requires_grad=True)  # step k: p = (0.5, 0.5)
    sampled = torch.tensor([0, 0, 1])  # tokens drawn with the step-k policy
    behaviour = torch.log_softmax(logits, -1)[sampled].detach()
    # the update of step k: maximise log p(token 0) with lr 1 -> logits (0.5, -0.5)
    (-torch.log_softmax(logits, -1)[0]).backward()
    with torch.no_grad():
        logits -= 1.0 * logits.grad
    assert logits.tolist() == pytest.approx([0.5, -0.5])
    p0 = math.exp(0.5) / (math.exp(0.5) + math.exp(-0.5))  # 0.7311
    trainer = torch.log_softmax(logits.detach(), -1)[sampled]
    weights, m = rollout_is_weights(trainer[None], behaviour[None], torch.ones(1, 3), "token", threshold=1.4)
    want = [min(p0 / 0.5, 1.4), min(p0 / 0.5, 1.4), (1 - p0) / 0.5]  # 1.462 -> 1.4 (capped), 0.538
    assert weights[0].tolist() == pytest.approx(want, rel=1e-6)
    assert float(m["rollout_is_capped_frac"]) == pytest.approx(2 / 3)
    assert float(m["rollout_is_low_frac"]) == pytest.approx(1 / 3)  # 0.538 < 1/1.4


# ------------------------------------------------------------------------------------------------ config and plan
def test_async_and_correction_keys_and_their_errors():
    cfg = load_config(None, ["trainer.async.mode=one_step_off", "algorithm.rollout_correction.rollout_is=token",
                             "algorithm.rollout_correction.rollout_is_threshold=3.0"])
    assert cfg.trainer["async"].mode == "one_step_off" and cfg.trainer["async"].max_staleness == 1
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == 3.0
    assert load_config(None, []).trainer["async"].mode == "sync"
    assert load_config(None, ["trainer.async.priority=update"]).trainer["async"].priority == "update"
    for overrides, match in [(["trainer.async.mode=fully"], "trainer.async.mode='fully' is not valid"),
                             (["trainer.async.mode=one_step_off", "trainer.async.max_staleness=2",
                               "trainer.n_gpus_per_node=2"], "the split placement keeps one rollout ahead"),
                             (["trainer.async.mode=one_step_off", "trainer.async.max_staleness=0"], "must be >= 1"),
                             (["trainer.async.overlap=maybe"], "trainer.async.overlap='maybe'"),
                             (["trainer.async.priority=decode"], "trainer.async.priority='decode' is not valid"),
                             (["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=5",
                               "trainer.async.rollout_ranks=2"], "leaves 3 trainer rank"),
                             (["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=2",
                               "trainer.async.rollout_ranks=2"], "leaves 0 trainer rank"),
                             (["trainer.async.mode=one_step_off", "trainer.async.rollout_ranks=-1"], "must be >= 0"),
                             (["trainer.async.rollout_ranks=1"], "set trainer.async.mode=one_step_off"),
                             (["algorithm.rollout_correction.rollout_is=seq"], "rollout_is='seq' is not valid"),
                             (["algorithm.rollout_correction.rollout_rs=token_k1"], "rejection sampling"),
                             (["algorithm.rollout_correction.rollout_is=token",
                               "actor_rollout_ref.rollout.top_p=0.9"], "top_k / top_p"),
                             (["trainer.async.mod=one_step_off"], "did you mean 'trainer.async.mode'")]:
        with pytest.raises(ConfigError, match=match):
            load_config(None, overrides)
    # 3 trainer ranks and 1 rollout rank; 4 and 2 (each rollout rank for 2 trainer ranks)
    load_config(None, ["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=4", "trainer.async.rollout_ranks=1"])
    load_config(None, ["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=6", "trainer.async.rollout_ranks=2"])
    # every rank a trainer that generates its own share: any world, deeper queues too
    load_config(None, ["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=4", "trainer.async.max_staleness=2"])
    load_config(None, ["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=2", "trainer.async.rollout_ranks=0",
                       "trainer.async.max_staleness=2"])


def test_verls_one_step_off_recipe_keys_ask_for_the_mode():
    notices: list[str] = []
    cfg = load_config(None, ["rollout.n_gpus_per_node=1", "rollout.nnodes=1"], notices=notices)
    assert cfg.trainer["async"].mode == "one_step_off" and cfg.trainer["async"].rollout_ranks == 1
    assert cfg.trainer.n_gpus_per_node == 2  # 1 training + 1 rollout GPU: a split placement of 2 ranks
    assert any("rollout.n_gpus_per_node=1: verl's one-step-off recipe" in line for line in notices)
    # verl's e2e script: 8 GPUs, 2 of them for the rollout
    cfg = load_config(None, ["trainer.nnodes=1", "trainer.n_gpus_per_node=6", "rollout.nnodes=1",
                             "rollout.n_gpus_per_node=2", "data.train_batch_size=12"])
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer["async"].rollout_ranks == 2
    with pytest.raises(ConfigError, match="rollout GPUs are counted per node"):
        load_config(None, ["trainer.nnodes=2", "rollout.nnodes=1", "rollout.n_gpus_per_node=2"])
    with pytest.raises(ConfigError, match="leaves 5 trainer rank"):  # 5 trainer ranks cannot split over 2
        load_config(None, ["trainer.n_gpus_per_node=5", "rollout.n_gpus_per_node=2"])


def test_decide_async_rollout():
    assert decide_async_rollout("sync", None, True, True, 1, 2)[0] == SYNC
    assert decide_async_rollout("one_step_off", None, False, False, None, None)[0] == IN_TURN
    assert decide_async_rollout("one_step_off", None, True, True, 10, 20)[0] == OVERLAPPED
    # a card where the phases would take turns: the planner keeps the run synchronous (no staleness for nothing)
    mode, why = decide_async_rollout("one_step_off", None, True, True, 30 * 2**30, 20 * 2**30)
    assert mode == SYNC and "more than the" in why and "trainer.async.overlap=false" in why
    mode, why = decide_async_rollout("one_step_off", None, True, False, 10, 20)
    assert mode == SYNC and "fp32" in why
    mode, why = decide_async_rollout("one_step_off", True, True, True, 30 * 2**30, 20 * 2**30)
    assert mode == IN_TURN and "more than the" in why  # forcing cannot make it fit
    assert decide_async_rollout("one_step_off", True, True, False, 10, 20)[0] == OVERLAPPED
    assert decide_async_rollout("one_step_off", False, True, True, 10, 20)[0] == IN_TURN
    estimate = {"phases": {"rollout": 50, "old_log_prob": 60, "actor_update": 100},
                "breakdown": {"rollout": {"actor_weights": 8, "kv_cache": 5, "prefill_or_sampling": 3}}}
    assert overlap_bytes(estimate) == 100 + 5 + 3 + 8
    assert overlap_bytes(estimate, snapshots=2) == 100 + 5 + 3 + 8 * 3  # two queued rollouts' weights
    # the reference's pass after the rollout, the KV cache still held: the larger of it and the sampling buffers
    estimate["breakdown"]["ref_log_prob"] = {"ref_weights": 8, "activations": 4, "logits_chunks": 2}
    assert overlap_bytes(estimate, ref_pass=True) == 100 + 5 + max(3, 4 + 2) + 8
    assert overlap_bytes(estimate) == 100 + 5 + 3 + 8


@pytest.mark.parametrize("card, expected", [("h100", OVERLAPPED), ("p40", SYNC)])
def test_plan_says_whether_the_rollout_overlaps(card, expected, monkeypatch):
    from rlanywhere.planner import make_plan

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the core left to the rollout: of the machine's cores
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)

    items = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
             "actor_rollout_ref.rollout.n=8", "data.train_batch_size=16", "data.max_response_length=256",
             "trainer.async.mode=one_step_off", f"hardware.emulate={card}"]
    plan = make_plan(load_config(None, items), for_execution=False)
    assert plan.async_rollout == expected
    assert "async rollout" in plan.summary() and "one_step_off" in plan.reasons["async_rollout"]
    # asked for: the pipeline in turn (the batches of the overlapped run) where the planner would keep sync
    in_turn = make_plan(load_config(None, items + ["trainer.async.overlap=false"]), for_execution=False)
    assert in_turn.async_rollout == IN_TURN
    assert in_turn.cpu_threads is None  # in turn: the rollout's thread never runs beside the update's operators
    if expected == OVERLAPPED:  # a core left to the rollout's thread; whose kernels go first
        from rlanywhere.machine import usable_cpu_cores

        if usable_cpu_cores() > 1:
            assert plan.cpu_threads == usable_cpu_cores() - 1 and "cpu threads" in plan.summary()
        assert "the decode kernels go first" in plan.reasons["async_rollout"]
        update_first = make_plan(load_config(None, items + ["trainer.async.priority=update"]), for_execution=False)
        assert "trainer.async.priority=update" in update_first.reasons["async_rollout"]
        assert update_first.update_stream_first and not plan.update_stream_first
    else:
        assert plan.cpu_threads is None and "cpu threads" not in plan.summary()


@pytest.mark.parametrize("extra, stays", [
    ([], True),  # two mini-batches a step: the old policy's log-probs are a forward of their own
    (["algorithm.rollout_correction.bypass_mode=true"], False),  # the PPO ratio against the rollout's log-probs
    (["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"], False),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=16"], False),  # one optimizer step: the update's own forward
    # a KL penalty in the reward needs them before the update, even with one optimizer step; not in bypass mode,
    # where the rollout's own log-probs stand for them (verl's bypass mode)
    (["actor_rollout_ref.actor.ppo_mini_batch_size=16", "algorithm.use_kl_in_reward=true"], True),
    (["algorithm.use_kl_in_reward=true", "algorithm.rollout_correction.bypass_mode=true"], False),
])
def test_plan_says_what_stays_on_the_critical_path(extra, stays):
    from rlanywhere.async_plan import old_policy_forward_stays
    from rlanywhere.planner import make_plan

    cfg = load_config(None, ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
                             "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                             "trainer.async.mode=one_step_off", "hardware.emulate=h100", *extra])
    assert old_policy_forward_stays(cfg) is stays
    why = make_plan(cfg, for_execution=False).reasons["async_rollout"]
    assert ("bypass_mode=true skips it" in why) is stays
    sync = load_config(None, ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "hardware.emulate=h100",
                              "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    assert "bypass_mode" not in make_plan(sync, for_execution=False).reasons["async_rollout"]


QWEN_KL = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
           "data.train_batch_size=16", "actor_rollout_ref.actor.use_kl_loss=true", "hardware.emulate=h100"]


@pytest.mark.parametrize("extra, follows, why", [
    (["trainer.async.mode=one_step_off"], True, "on the rollout's stream beside the update"),
    (["trainer.async.mode=one_step_off", "hardware.emulate=p40", "trainer.async.overlap=false"], True,
     "the phases take turns here"),
    (["trainer.async.mode=one_step_off", "hardware.emulate=p40"], False, None),  # kept sync: no pipeline
    (["trainer.async.mode=one_step_off", "actor_rollout_ref.model.lora_rank=8"], False, "adapters off"),
    (["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=2"], False, "rollout ranks hold no reference"),
    (["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=4"], False, "balance_batch moves rows"),
    (["trainer.async.mode=one_step_off", "trainer.n_gpus_per_node=4", "trainer.balance_batch=false"], True,
     "beside the update"),
    ([], False, None),  # sync: no pipeline, nothing to say
])
def test_plan_says_where_the_reference_log_probs_run(extra, follows, why):
    from rlanywhere.planner import make_plan

    plan = make_plan(load_config(None, QWEN_KL + extra), for_execution=False)
    assert plan.use_ref and plan.ref_with_rollout is follows
    if why is None:
        assert "ref_with_rollout" not in plan.reasons and "reference log-probs" not in plan.summary()
    else:
        assert why in plan.reasons["ref_with_rollout"] and "reference log-probs" in plan.summary()
    no_kl = make_plan(load_config(None, QWEN_KL[:3] + QWEN_KL[4:] + extra), for_execution=False)
    assert not no_kl.ref_with_rollout and "ref_with_rollout" not in no_kl.reasons


def test_the_reference_pass_stays_in_the_step_when_it_does_not_fit_beside_the_update():
    """The overlap fits, the reference's pass beside it does not: the rollout still overlaps, the pass stays in the
    step; neither fits: the run stays synchronous, and with the pipeline asked for in turn the pass (which then
    costs the same anywhere) follows the rollout."""
    from rlanywhere.async_plan import plan_async_rollout
    from rlanywhere.planner import make_plan

    cfg = load_config(None, QWEN_KL + ["trainer.async.mode=one_step_off"])
    plan = make_plan(cfg, for_execution=False)
    without = overlap_bytes(plan.estimate)
    plan.estimate["breakdown"]["ref_log_prob"]["activations"] = plan.memory_budget_bytes  # a pass that cannot fit
    plan_async_rollout(cfg, plan)
    assert plan.async_rollout == OVERLAPPED and not plan.ref_with_rollout
    assert "more than the" in plan.reasons["ref_with_rollout"]
    plan.memory_budget_bytes = without - 1
    plan_async_rollout(cfg, plan)
    assert plan.async_rollout == SYNC and not plan.ref_with_rollout  # the planner keeps such a card sync
    in_turn = load_config(None, QWEN_KL + ["trainer.async.mode=one_step_off", "trainer.async.overlap=false"])
    plan_async_rollout(in_turn, plan)
    assert plan.async_rollout == IN_TURN and plan.ref_with_rollout


def test_the_core_left_to_an_overlapped_rollout_counts_ranks_and_a_users_thread_limit(monkeypatch):
    from rlanywhere.async_plan import spare_core_for_rollout
    from rlanywhere.plans import Plan

    def threads(cores, ranks, mode=OVERLAPPED, device="cuda"):
        plan = Plan(device=device, async_rollout=mode)
        spare_core_for_rollout(plan, cores, ranks)
        return plan.cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    assert threads(16, 1) == 15 and threads(16, 4) == 3 and threads(2, 1) == 1
    assert threads(1, 1) is None and threads(16, 32) is None  # one core a process: none to spare, pool untouched
    assert threads(16, 1, IN_TURN) is None and threads(16, 1, SYNC) is None and threads(16, 1, device="cpu") is None
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's limit stays one: 3 for torch, 1 for the rollout
    assert threads(16, 1) == 3 and threads(2, 1) == 1
    for limit in ("1", "1,1", " 1"):  # as torch reads it; torchrun's default for each rank
        monkeypatch.setenv("OMP_NUM_THREADS", limit)
        assert threads(16, 1) is None, limit
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("MKL_NUM_THREADS", "3")
    assert threads(16, 1) == 2


def test_the_core_left_to_an_overlapped_rollout_counts_physical_cores(monkeypatch, tmp_path):
    """On a machine with hyper-threads torch's pool has one thread per physical core by default: the overlapped plan
    leaves one of those to the rollout, not one of the logical CPUs (which would make the pool larger than torch's).
    The physical cores are read from Linux's CPU topology, each core's hyper-threads counted once."""
    from rlanywhere.async_plan import spare_core_for_rollout
    from rlanywhere.machine import usable_physical_cores
    from rlanywhere.plans import Plan

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    plan = Plan(device="cuda", async_rollout=OVERLAPPED)
    spare_core_for_rollout(plan, 16, 1, physical_cores=8)
    assert plan.cpu_threads == 7 and "8 physical cores" in plan.reasons["cpu_threads"]
    spare_core_for_rollout(plan, 16, 2, physical_cores=16)  # no hyper-threads: as before
    assert plan.cpu_threads == 7 and "8 cores" in plan.reasons["cpu_threads"]

    for cpu in range(4):  # 4 logical CPUs: 2 cores x 2 hyper-threads, one package
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{cpu % 2}\n")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert usable_physical_cores(str(tmp_path)) == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # one thread of each core: still 2 cores
    assert usable_physical_cores(str(tmp_path)) == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 2})  # the two threads of core 0
    assert usable_physical_cores(str(tmp_path)) == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})  # no topology for cpu4: unknown
    assert usable_physical_cores(str(tmp_path)) is None


def test_the_runtime_leaves_the_planned_core_to_an_overlapped_rollout(monkeypatch):
    """A GPU plan's cpu_threads (an overlapped rollout's spare core) sizes torch's CPU thread pool as a CPU rank's
    does; a plan without it leaves the pool as it is."""
    from rlanywhere.plans import Plan
    from rlanywhere.runtime import apply_runtime

    before = torch.get_num_threads()
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    try:
        apply_runtime(Plan(device="cuda", cpu_threads=1))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(before)
        apply_runtime(Plan(device="cuda"))
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
        torch.set_float32_matmul_precision("highest")


def test_training_attention_backends_hold_until_the_last_pass_on_any_thread_ends():
    """sdpa_kernel's flags are the process's: the update and the reference's pass beside it (two threads) enter
    and leave in any order, and the backends stay restricted until the last one leaves."""
    from rlanywhere.plans import Plan
    from rlanywhere.runtime import training_attention_context

    plan = Plan(training_sdpa_backends=("math",))
    assert torch.backends.cuda.flash_sdp_enabled()
    update, reference = training_attention_context(plan), training_attention_context(plan)
    update.__enter__()
    reference.__enter__()
    update.__exit__(None, None, None)  # the update ends first, the pass beside it runs on
    assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    reference.__exit__(None, None, None)
    assert torch.backends.cuda.flash_sdp_enabled()
    with training_attention_context(plan):  # another plan's backends nest as sdpa_kernel does
        with training_attention_context(Plan(training_sdpa_backends=("flash_attention",))):
            assert torch.backends.cuda.flash_sdp_enabled() and not torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_one_step_off_on_two_ranks_is_a_split_placement():
    from rlanywhere.async_plan import SPLIT
    from rlanywhere.planner import make_plan
    from rlanywhere.split_run import split_world

    base = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
            "data.train_batch_size=16", "trainer.async.mode=one_step_off", "hardware.emulate=h100"]
    plan = make_plan(load_config(None, base + ["trainer.n_gpus_per_node=2"]), for_execution=False)
    assert plan.async_rollout == SPLIT and "one rank only generates" in plan.reasons["async_rollout"]
    assert make_plan(load_config(None, base), for_execution=False).async_rollout == OVERLAPPED
    # the command line: 2 ranks of one_step_off split; rollout_ranks=1 alone asks for the 2 ranks (a relaunch)
    assert split_world(load_config(None, base), 2, True) == (True, 2)
    assert split_world(load_config(None, base), 1, False) == (False, 1)
    cfg = load_config(None, base + ["trainer.async.rollout_ranks=1"])
    assert split_world(cfg, 1, False) == (True, 2) and cfg.trainer.n_gpus_per_node == 2
    cfg = load_config(None, base + ["trainer.async.rollout_ranks=2"])  # a trainer rank per rollout rank: 4 ranks
    assert split_world(cfg, 1, False) == (True, 4) and cfg.trainer.n_gpus_per_node == 4
    assert split_world(load_config(None, base[:-2]), 2, True) == (False, 2)  # sync: data parallelism
    # rollout_ranks=0: both ranks train, each generating its share beside its own update
    data_parallel = base + ["trainer.n_gpus_per_node=2", "trainer.async.rollout_ranks=0"]
    assert split_world(load_config(None, data_parallel), 2, True) == (False, 2)
    plan = make_plan(load_config(None, data_parallel), for_execution=False)
    assert plan.async_rollout == OVERLAPPED and plan.data_parallel == "replicate"
    assert make_plan(load_config(None, base + ["trainer.n_gpus_per_node=4"]), for_execution=False).async_rollout \
        == OVERLAPPED
    from rlanywhere.vocabulary import PlanError
    with pytest.raises(PlanError, match="with sharded models"):
        make_plan(load_config(None, data_parallel + ["hardware.data_parallel=shard"]), for_execution=False)


# ------------------------------------------------------------------------------------------------ pipeline parts
def test_scored_rollout_survives_json_exactly():
    gen = torch.Generator().manual_seed(1)
    rollout = RolloutBatch(prompt_ids=torch.randint(0, 50, (4, 3), generator=gen), prompt_mask=torch.ones(4, 3).long(),
                           response_ids=torch.randint(0, 50, (4, 5), generator=gen),
                           response_mask=torch.ones(4, 5).long(),
                           response_logprobs=-torch.rand(4, 5, generator=gen), num_prompts=2, n=2)
    scored = ScoredRollout([{"input_ids": [1, 2], "index": 0, "ground_truth": "3", "extra_info": {"a": 1}},
                            {"input_ids": [4], "index": 5, "ground_truth": "x", "extra_info": {}}], rollout,
                           torch.rand(4, generator=gen), {"acc": [1.0, 0.0, 0.0, 1.0], "num_errors": 0})
    back = scored_from(json.loads(json.dumps(scored_state(scored))))
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "response_logprobs"):
        assert torch.equal(getattr(back.rollout, name), getattr(rollout, name)), name
        assert getattr(back.rollout, name).dtype == getattr(rollout, name).dtype
    assert torch.equal(back.scores, scored.scores) and back.items == scored.items and back.info == scored.info
    assert back.ref_logprobs is None
    scored.ref_logprobs = -torch.rand(4, 5, generator=gen)  # computed with the rollout: saved with it
    assert torch.equal(scored_from(json.loads(json.dumps(scored_state(scored)))).ref_logprobs, scored.ref_logprobs)


def test_rank_shares_of_saved_rollouts_are_joined_and_split_again_for_another_world():
    """A checkpoint of 2 ranks resumed on 1 and on 4: each step's shares joined in rank order (prompts, rows, the
    multi-turn rows' statistics), then cut into the new ranks' shares, each as wide as its rows need."""
    from types import SimpleNamespace

    from rlanywhere.async_pipeline import RolloutPipeline
    from rlanywhere.rollout_phase import TOOL_ROWS_KEY

    def share(first: int, response_width: int) -> dict:  # 2 prompts x 2 samples from global prompt `first`
        mask = torch.zeros(4, response_width, dtype=torch.long)
        mask[:, :2] = 1
        mask[0, :response_width] = 1  # one row uses the whole width
        rollout = RolloutBatch(prompt_ids=torch.full((4, 3), 7), prompt_mask=torch.ones(4, 3, dtype=torch.long),
                               response_ids=torch.arange(4 * response_width).reshape(4, response_width),
                               response_mask=mask, response_logprobs=-mask.float(), num_prompts=2, n=2)
        items = [{"input_ids": [first + i], "index": first + i} for i in range(2)]
        scored = ScoredRollout(items, rollout, torch.arange(4.0) + 10 * first,
                               {"acc": [float(first)] * 4, "num_errors": 1 + first},
                               ref_logprobs=-(torch.arange(4 * response_width).reshape(4, response_width) + 1.0
                                              + 100 * first) * mask)
        tools = [{"tool_calls": first * 10 + row} for row in range(4)]
        return {"5": {"weights_step": 4, "seconds": 1.0 + first, "scored": scored_state(scored), "first_prompt": first,
                      "metrics": {TOOL_ROWS_KEY: tools}}}

    states = [share(0, 3), share(2, 6)]
    cfg_like = SimpleNamespace(trainer={"async": SimpleNamespace(max_staleness=1)})
    plan_like = SimpleNamespace(async_rollout=IN_TURN, device="cpu")
    one = RolloutPipeline(cfg_like, plan_like, torch.nn.Linear(1, 1), loader=None, total_steps=9)
    one.load_rank_states(states, rank=0, world=1, pad_token_id=0)
    scored, metrics, first = one.jobs[5].wait()
    assert [item["index"] for item in scored.items] == [0, 1, 2, 3] and first == 0 and one.jobs[5].weights_step == 4
    assert scored.rollout.response_ids.shape == (8, 6) and one.jobs[5].seconds == 3.0
    assert scored.ref_logprobs.shape == (8, 6) and scored.ref_logprobs[4:, :].min() < -100  # kept, padded with 0
    assert (scored.ref_logprobs[:4, 3:] == 0).all()
    assert [row["tool_calls"] for row in metrics[TOOL_ROWS_KEY]] == [0, 1, 2, 3, 20, 21, 22, 23]
    assert scored.info["num_errors"] == 1 + 3  # both ranks' counts
    for rank in range(4):
        part = RolloutPipeline(cfg_like, plan_like, torch.nn.Linear(1, 1), loader=None, total_steps=9)
        part.load_rank_states(states, rank=rank, world=4, pad_token_id=0)
        scored, metrics, first = part.jobs[5].wait()
        assert [item["index"] for item in scored.items] == [rank] and first == rank
        assert scored.rollout.response_ids.shape[1] == (3, 2, 6, 2)[rank]  # narrowed: its first row's or 2 columns
        assert scored.ref_logprobs.shape == scored.rollout.response_ids.shape  # the reference's values kept with them
        assert torch.equal(scored.ref_logprobs != 0, scored.rollout.response_mask.bool())
        assert torch.equal(scored.scores, torch.tensor([2.0 * (rank % 2), 2.0 * (rank % 2) + 1]) + 10 * (rank // 2) * 2)
        assert [row["tool_calls"] for row in metrics[TOOL_ROWS_KEY]] == [10 * 2 * (rank // 2) + 2 * (rank % 2) + j
                                                                       for j in range(2)]
        assert scored.info["num_errors"] == (4 if rank == 0 else 0)  # counted once over the 4 ranks
    same = RolloutPipeline(cfg_like, plan_like, torch.nn.Linear(1, 1), loader=None, total_steps=9)
    same.load_rank_states(states, rank=1, world=2, pad_token_id=0)  # the same world: this rank's own share, as saved
    assert [item["index"] for item in same.jobs[5].wait()[0].items] == [2, 3]


def test_a_rollout_rank_makes_its_trainer_ranks_shares_in_one_call():
    """Contiguous shares: one rollout_and_score call for all, cut back into shares (rows, counts with the first
    share, tool statistics per row); shares that are not one block: a call each."""
    from rlanywhere.rollout_phase import TOOL_ROWS_KEY
    from rlanywhere.split_rollout import rollout_shares

    class Phase:
        def __init__(self):
            self.calls = []

        def rollout_and_score(self, items, timer, step, first_prompt):
            self.calls.append((step, [item["index"] for item in items], first_prompt))
            rows = 2 * len(items)
            mask = torch.ones(rows, 4, dtype=torch.long)
            rollout = RolloutBatch(prompt_ids=torch.ones(rows, 2, dtype=torch.long), prompt_mask=mask[:, :2],
                                   response_ids=torch.arange(rows * 4).reshape(rows, 4), response_mask=mask,
                                   response_logprobs=-mask.float(), num_prompts=len(items), n=2)
            info = {"acc": [float(r) for r in range(rows)], "num_errors": 3}
            return (ScoredRollout(items, rollout, torch.arange(float(rows)), info),
                    {TOOL_ROWS_KEY: [{"tool_calls": r} for r in range(rows)]}, first_prompt)

    def items(first: int, size: int) -> list[dict]:
        return [{"index": first + i, "input_ids": [first + i]} for i in range(size)]

    phase = Phase()
    shares = rollout_shares(phase, [(7, items(4, 2), 4), (7, items(6, 2), 6)])
    assert phase.calls == [(7, [4, 5, 6, 7], 4)]  # one call for both
    (first_share, first_metrics, first_at), (second, second_metrics, second_at) = shares
    assert (first_at, second_at) == (4, 6) and [i["index"] for i in second.items] == [6, 7]
    assert torch.equal(second.scores, torch.tensor([4.0, 5.0, 6.0, 7.0])) and second.info["acc"] == [4.0, 5.0, 6.0, 7.0]
    assert (first_share.info["num_errors"], second.info["num_errors"]) == (3, 0)  # the sum stays the batch's
    assert [r["tool_calls"] for r in second_metrics[TOOL_ROWS_KEY]] == [4, 5, 6, 7]
    assert [r["tool_calls"] for r in first_metrics[TOOL_ROWS_KEY]] == [0, 1, 2, 3]
    phase = Phase()
    rollout_shares(phase, [(7, items(0, 2), 0), (7, items(6, 2), 6)])  # not one block
    assert phase.calls == [(7, [0, 1], 0), (7, [6, 7], 6)]


class _Counter:
    def __init__(self):
        self.epoch, self.position, self.batch_size = 0, 0, 1

    def next_batch(self):
        self.position += 1
        return [self.position]

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = state["epoch"], state["position"]


def test_lookahead_loader_state_is_the_trained_steps():
    loader = LookaheadLoader(_Counter())
    assert loader.next_batch() == [1]
    assert loader.peek() == [2] and loader.peek() == [2]
    assert loader.state_dict() == {"epoch": 0, "position": 1}  # a checkpoint resumes at the peeked batch
    assert loader.next_batch() == [2] and loader.state_dict() == {"epoch": 0, "position": 2}
    loader.peek()
    loader.load_state_dict({"epoch": 0, "position": 2})  # a dropped step rewinds: the peeked batch is drawn again
    assert loader.next_batch() == [3] and loader.batch_size == 1
    # two steps ahead (max_staleness=2): the state stays the trained step's until each peeked batch is trained
    assert loader.peek(2) == [5] and loader.peek(1) == [4] and loader.state_dict() == {"epoch": 0, "position": 3}
    assert loader.next_batch() == [4] and loader.state_dict() == {"epoch": 0, "position": 4}
    assert loader.peek(2) == [6] and loader.next_batch() == [5] and loader.next_batch() == [6]


# ------------------------------------------------------------------------------------------------ runs
# a reward that differs between the samples of one prompt (the parity of the text), so every update moves the weights
PARITY_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    return float(sum(map(ord, solution_str)) % 2)\n")


def _overrides(model_dir, data_dir, run_dir, **extra):
    from .test_e2e import base_overrides

    reward = run_dir.parent / "parity_reward.py"
    reward.write_text(PARITY_REWARD)
    settings = {"custom_reward_function.path": str(reward), "custom_reward_function.timeout_s": 0,"algorithm.adv_estimator": "grpo", "trainer.test_freq": -1, "trainer.val_before_train": False,
                "trainer.save_freq": -1, "trainer.total_training_steps": 3,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 4}
    return base_overrides(model_dir, data_dir, run_dir, **{**settings, **extra})


def _trainer(overrides, overlapped: bool = False, ref_in_step: bool = False):
    from rlanywhere.planner import make_plan
    from rlanywhere.trainer import RLTrainer

    cfg = load_config(None, overrides)
    plan = make_plan(cfg, for_execution=True)
    if overlapped:  # the background thread's path on a CPU (the plan runs it in turn there)
        plan.async_rollout = OVERLAPPED
    if ref_in_step:  # the reference's log-probs computed by each step, as without the pipeline
        plan.ref_with_rollout = False
    return RLTrainer(cfg, plan, cfg.trainer.default_local_dir)


def _rows(run_dir):
    from rlanywhere.tracking import read_metrics

    return {m["step"]: m for m in read_metrics(str(run_dir)) if "reward/mean" in m}


@pytest.mark.parametrize("kl_coef, forward", [(0.0, False), (0.001, True)])
def test_a_kl_in_reward_of_coefficient_0_runs_no_old_policy_forward(tiny_model_dir, arith_data, tmp_path, kl_coef,
                                                                     forward):
    """use_kl_in_reward with kl_coef 0 beside a KL loss (which keeps the reference): the penalty adds nothing, so the
    step runs no old-policy forward for it, as the plan says (old_policy_forward_stays); with a positive
    coefficient it does (one optimizer step a step: nothing else needs it)."""
    from rlanywhere.async_plan import old_policy_forward_stays

    run = tmp_path / "run"
    items = _overrides(tiny_model_dir, arith_data, run, **{
        "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": kl_coef,
        "actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.kl_loss_coef": 0.01,
        "trainer.total_training_steps": 1})
    assert old_policy_forward_stays(load_config(None, items)) is forward
    trainer = _trainer(items)
    assert trainer.plan.use_ref  # the KL loss keeps the reference either way
    trainer.fit()
    row = _rows(run)[1]
    assert ("timing/old_log_prob" in row) is forward and ("actor/reward_kl_penalty_coeff" in row) is forward


KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "actor/entropy")


@pytest.mark.slow
def test_one_step_off_trains_on_the_previous_steps_weights(tiny_model_dir, arith_data, tmp_path):
    """Step 1 trains on the same batch as a synchronous run (the initial weights made both); from step 2 on each
    batch was generated with the weights before the previous update (staleness 1), and running the rollout in a
    background thread changes nothing."""
    sync = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "sync"))
    sync.fit()
    one_off = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "off", **{
        "trainer.async.mode": "one_step_off", "algorithm.rollout_correction.rollout_is": "token"}))
    assert one_off.plan.async_rollout == IN_TURN and one_off.pipeline is not None
    one_off.fit()
    threaded = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "thread", **{
        "trainer.async.mode": "one_step_off", "algorithm.rollout_correction.rollout_is": "token"}), overlapped=True)
    assert threaded.pipeline.executor is not None
    threaded.fit()
    s, o, t = _rows(tmp_path / "sync"), _rows(tmp_path / "off"), _rows(tmp_path / "thread")
    assert [o[k]["async/staleness"] for k in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert o[1]["response_length/mean"] == s[1]["response_length/mean"] and o[1]["reward/mean"] == s[1]["reward/mean"]
    # the stale batches: same prompts as the sync run's step 2, other samples (other weights drew them)
    assert o[2]["actor/rollout_is_mean"] != pytest.approx(1.0, abs=1e-4)
    assert 0 < o[2]["actor/rollout_is_mean"] and 0 <= o[2]["actor/rollout_is_capped_frac"] <= 1
    for step in (1, 2, 3):
        for key in KEYS + ("actor/rollout_is_mean",):
            assert t[step][key] == pytest.approx(o[step][key], rel=1e-6, abs=1e-8), (step, key)


KL = {"trainer.async.mode": "one_step_off", "algorithm.rollout_correction.rollout_is": "token",
      "actor_rollout_ref.actor.use_kl_loss": True, "actor_rollout_ref.actor.kl_loss_coef": 0.5}


@pytest.mark.slow
def test_reference_log_probs_with_the_rollout_change_no_metric(tiny_model_dir, arith_data, tmp_path):
    """plan.ref_with_rollout: each job computes its batch's reference log-probs right after the rollout (in turn,
    and on the background thread beside the update): the same KL loss and metrics as a run whose steps compute them,
    and no reference forward in the step. One that runs out of memory beside the update leaves them to the step."""
    from rlanywhere.oom import is_oom_error

    in_step = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "step", **KL), ref_in_step=True)
    assert in_step.pipeline.reference_pass is None
    in_step.fit()
    in_turn = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "turn", **KL))
    assert in_turn.plan.ref_with_rollout and in_turn.pipeline.reference_pass is not None
    passes = []

    def out_of_memory_for_step_3(scored):  # the job of step 3, started during step 2
        passes.append(1)
        if len(passes) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return in_turn.ref_logprobs_beside(scored)

    in_turn.pipeline.reference_pass = out_of_memory_for_step_3
    in_turn.fit()
    assert not in_turn.oom_guard.events  # the step's own pass ran at the planned size
    assert is_oom_error(torch.OutOfMemoryError("CUDA out of memory")) and in_turn.pipeline.reference_oom_warned
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "thread", **KL), overlapped=True).fit()
    step, turn, thread = _rows(tmp_path / "step"), _rows(tmp_path / "turn"), _rows(tmp_path / "thread")
    assert step[2]["actor/kl_loss"] > 0  # the actor moved away from the reference: the KL term counts
    for k in (1, 2, 3):
        for key in KEYS + ("actor/kl_loss", "actor/rollout_is_mean"):
            assert turn[k][key] == pytest.approx(step[k][key], rel=1e-6, abs=1e-8), (k, key)
            assert thread[k][key] == pytest.approx(step[k][key], rel=1e-6, abs=1e-8), (k, key)
        assert "timing/ref_log_prob" in step[k] and "async/ref_log_prob_s" not in step[k]
        assert ("timing/ref_log_prob" in turn[k]) is (k == 3) and "timing/ref_log_prob" not in thread[k]
        assert "async/ref_log_prob_s" in thread[k]


@pytest.mark.slow
def test_a_deeper_queue_trains_on_batches_two_versions_old(tiny_model_dir, arith_data, tmp_path):
    """max_staleness=2: the rollouts of steps 2 and 3 are both made with the initial weights, that of step 4 with
    step 2's (staleness 0, 1, 2, 2). Step 2 trains on the batch one_step_off trains on (the same weights made it and
    train on it); step 3 on an older one. Rollouts queued behind a running one in a background thread load their
    weights from a snapshot: the same batches and metrics as the phases in turn."""
    extra = {"trainer.async.mode": "one_step_off", "trainer.total_training_steps": 4,
             "algorithm.rollout_correction.rollout_is": "token"}
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "one", **extra)).fit()
    deep = {**extra, "trainer.async.max_staleness": 2}
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "two", **deep)).fit()
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "thread", **deep), overlapped=True).fit()
    one, two, thread = _rows(tmp_path / "one"), _rows(tmp_path / "two"), _rows(tmp_path / "thread")
    assert [two[k]["async/staleness"] for k in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    for key in KEYS + ("actor/rollout_is_mean",):
        for step in (1, 2):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-6, abs=1e-8), (step, key)
        for step in (1, 2, 3, 4):
            assert thread[step][key] == pytest.approx(two[step][key], rel=1e-6, abs=1e-8), (step, key)
    assert two[3]["actor/pg_loss"] != pytest.approx(one[3]["actor/pg_loss"], rel=1e-6, abs=1e-8)


@pytest.mark.slow
@pytest.mark.parametrize("depth, saved_weights, kl", [(1, {"2": 1}, False), (2, {"2": 0, "3": 1}, False),
                                                     (1, {"2": 1}, True)])
def test_resume_mid_pipeline_is_exact(tiny_model_dir, arith_data, tmp_path, monkeypatch, depth, saved_weights, kl):
    """Stopped after step 2 (Ctrl-C during its update): the checkpoint holds the finished rollouts of the steps to
    come (max_staleness=1: step 3's, made with step 2's weights, which no checkpoint holds; 2: steps 3 and 4's, made
    with step 1's and step 2's), with a KL term their reference log-probs too; the resumed run trains on them and
    matches an uninterrupted run."""
    import signal

    from rlanywhere.checkpoint import verify_checkpoint
    from rlanywhere.runguard import RunInterrupted
    from rlanywhere.update import Updater

    extra = {"trainer.async.mode": "one_step_off", "trainer.total_training_steps": 4,
             "algorithm.rollout_correction.rollout_is": "sequence", "trainer.async.max_staleness": depth,
             **({key: value for key, value in KL.items() if key.startswith("actor_rollout_ref")} if kl else {})}
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "a", **extra)).fit()

    original_step = Updater.optimizer_step
    running = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra))
    sent = []

    def step_then_interrupted(self, name, model, optimizer, grad_clip):
        norm = original_step(self, name, model, optimizer, grad_clip)
        if running.global_step == 1 and not sent:
            sent.append(1)
            os.kill(os.getpid(), signal.SIGINT)
        return norm

    monkeypatch.setattr(Updater, "optimizer_step", step_then_interrupted)
    with pytest.raises(RunInterrupted) as info:
        running.fit()
    monkeypatch.setattr(Updater, "optimizer_step", original_step)
    assert info.value.step == 2 and verify_checkpoint(info.value.checkpoint) is None
    with open(os.path.join(info.value.checkpoint, "trainer_state.json")) as handle:
        saved = json.load(handle)["async_rollouts"]
    assert {step: job["weights_step"] for step, job in saved.items()} == saved_weights
    assert all(("ref_logprobs" in job["scored"]) is kl for job in saved.values())

    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra)).fit()
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in KEYS + ("actor/rollout_is_mean", "async/staleness") + (("actor/kl_loss",) if kl else ()):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_a_step_dropped_by_sigterm_keeps_its_rollout_and_resume_is_exact(tiny_model_dir, arith_data, tmp_path,
                                                                          preempt_while_scoring):
    """SIGTERM while step 2's rollout-in-turn of step 3 is scored: step 2 is dropped before any update, the
    checkpoint of step 1 holds step 2's batch (made with the initial weights), and the resumed run matches."""
    extra = {"trainer.async.mode": "one_step_off", "trainer.total_training_steps": 3}
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "a", **extra)).fit()

    stop = preempt_while_scoring(_trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra)))
    assert stop.step == 1 and stop.checkpoint.endswith("global_step_1")
    with open(os.path.join(stop.checkpoint, "trainer_state.json")) as handle:
        saved = json.load(handle)["async_rollouts"]
    assert saved["1"]["weights_step"] == 0  # step 2's batch, from the initial weights

    _resume_and_match_the_uninterrupted_run(tiny_model_dir, arith_data, tmp_path, extra)


@pytest.mark.slow
def test_a_step_dropped_after_its_rollout_keeps_its_batch_and_resume_is_exact(tiny_model_dir, arith_data, tmp_path,
                                                                               monkeypatch):
    """SIGTERM in step 2's old-policy log-probs (after the pipeline handed it its batch, before the update): the step
    is dropped, its batch (made with the initial weights) goes back into the pipeline and into the checkpoint, and
    the resumed run trains on it: the same as an uninterrupted run."""
    import signal

    from rlanywhere.runguard import RunInterrupted
    from rlanywhere.trainer import RLTrainer

    extra = {"trainer.async.mode": "one_step_off", "trainer.total_training_steps": 3,
             "actor_rollout_ref.actor.ppo_mini_batch_size": 2}  # two mini-batches: the old log-probs are computed
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "a", **extra)).fit()

    original_logprobs = RLTrainer.logprobs
    preempted = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra))

    def logprobs_then_preempted(self, model, batch):
        if preempted.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original_logprobs(self, model, batch)

    monkeypatch.setattr(RLTrainer, "logprobs", logprobs_then_preempted)
    with pytest.raises(RunInterrupted) as info:
        preempted.fit()
    monkeypatch.setattr(RLTrainer, "logprobs", original_logprobs)
    assert info.value.step == 1
    with open(os.path.join(info.value.checkpoint, "trainer_state.json")) as handle:
        saved = json.load(handle)["async_rollouts"]
    assert {step: job["weights_step"] for step, job in saved.items()} == {"1": 0, "2": 1}

    _resume_and_match_the_uninterrupted_run(tiny_model_dir, arith_data, tmp_path, extra)


def _split_rank(rank, overrides, init_method, world=2):
    from rlanywhere.split_run import run_split

    run_split(overrides, rank, world, init_method)


@pytest.mark.slow
def test_split_placement_matches_the_one_process_pipeline(tiny_model_dir, arith_data, tmp_path):
    """1 rollout rank + 1 trainer rank over gloo: the rollout rank generates each batch with the weights the trainer
    broadcasts; samples and metrics are those of the one-process one_step_off run. The ranks are forked from this
    process (the launch itself is the next test's)."""
    from .test_distributed import forked_ranks

    extra = {"trainer.async.mode": "one_step_off", "algorithm.rollout_correction.rollout_is": "token"}
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "one", **extra)).fit()
    overrides = _overrides(tiny_model_dir, arith_data, tmp_path / "split", **extra)
    forked_ranks(_split_rank, (overrides, f"file://{tmp_path / 'rendezvous'}"))
    _assert_split_matches_one_process(tmp_path / "one", tmp_path / "split")


@pytest.mark.slow
def test_two_trainer_ranks_and_a_rollout_rank_match_the_one_process_pipeline(tiny_model_dir, arith_data, tmp_path):
    """2 trainer ranks (data parallelism among them) + 1 rollout rank that generates both their shares with the
    weights the first trainer rank broadcasts: the samples, metrics and weights of the one-process run."""
    from .test_distributed import actor_weights, assert_same_weights, forked_ranks

    extra = {"trainer.async.mode": "one_step_off", "algorithm.rollout_correction.rollout_is": "token",
             "trainer.save_freq": 3}
    one = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "one", **extra))
    one.fit()
    overrides = _overrides(tiny_model_dir, arith_data, tmp_path / "split",
                           **extra, **{"trainer.async.rollout_ranks": 1})
    forked_ranks(_split_rank, (overrides, f"file://{tmp_path / 'rendezvous'}", 3), nprocs=3)
    _assert_split_matches_one_process(tmp_path / "one", tmp_path / "split")
    with open(tmp_path / "split" / "plan.json") as handle:
        plan = json.load(handle)
    assert plan["async_rollout"] == "split" and plan["world_size"] == 2 and plan["data_parallel"] == "replicate"
    assert_same_weights(actor_weights(tmp_path / "split" / "checkpoints" / "global_step_3"), one.actor)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, rollout_ranks", [(2, []), (4, ["trainer.async.rollout_ranks=2"])])
def test_split_placement_from_the_command_line_under_torchrun(tiny_model_dir, arith_data, tmp_path, ranks,
                                                              rollout_ranks):
    """`rlanywhere train ... trainer.async.mode=one_step_off` under torchrun with CPU ranks (gloo): on 2, rank 1
    generates and rank 0 trains; on 4 with rollout_ranks=2, ranks 2 and 3 each generate for one of the trainer ranks
    0 and 1. Samples and metrics are those of the one-process one_step_off run."""
    import subprocess

    extra = {"trainer.async.mode": "one_step_off", "algorithm.rollout_correction.rollout_is": "token"}
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "one", **extra)).fit()
    command = [*warm_ranks.torchrun(), "--standalone", f"--nproc_per_node={ranks}",
               *warm_ranks.rank_program(), "train",
               *_overrides(tiny_model_dir, arith_data, tmp_path / "split", **extra), *rollout_ranks]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1", **warm_ranks.rank_env()},
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:]
    with open(tmp_path / "split" / "plan.json") as handle:
        plan = json.load(handle)
    assert plan["async_rollout"] == "split" and plan["world_size"] == ranks // 2
    _assert_split_matches_one_process(tmp_path / "one", tmp_path / "split")


def test_bypass_mode_skips_the_old_policys_log_probs():
    from rlanywhere.rollout_correction import recomputes_old_logprobs

    def section(*overrides):
        return load_config(None, list(overrides)).algorithm.rollout_correction

    assert recomputes_old_logprobs(section())
    assert recomputes_old_logprobs(section("algorithm.rollout_correction.rollout_is=token"))
    assert not recomputes_old_logprobs(section("algorithm.rollout_correction.bypass_mode=true"))
    assert not recomputes_old_logprobs(section("algorithm.rollout_correction.bypass_mode=true",
                                               "algorithm.rollout_correction.rollout_is=token"))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bypass_mode_logs_the_importance_weights_without_applying_them(level):
    """In bypass mode the clipped PPO ratio pi_theta / pi_rollout is the importance ratio already: verl's ppo_clip
    loss there takes no weights (they would count the correction twice) and logs them. Here: the same loss as
    without rollout_is, and the weights' metrics of pi_theta against pi_rollout."""
    from rlanywhere.rollout_correction import RolloutCorrection

    current = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    rollout = torch.log(torch.tensor([[0.25, 0.2, 0.3]]))  # token ratios 2, 1, 3 (3 capped at 2)
    mask = torch.ones(1, 3)
    weights, means = RolloutCorrection(level, 2.0, bypass_mode=True).weights(current, rollout, mask)
    assert weights is None
    applied, applied_means = RolloutCorrection(level, 2.0).weights(current, rollout, mask)
    assert {key: float(value) for key, value in means.items()} == \
        {key: float(value) for key, value in applied_means.items()}
    expected_mean = 2.0 if level == "token" else 6.0  # before the cap: mean(2, 1, 3), or the product
    assert float(means["rollout_is_mean"]) == pytest.approx(expected_mean)
    assert applied is not None and float(applied.max()) == pytest.approx(2.0)


def test_bypass_mode_takes_the_rewards_kl_penalty_against_the_rollouts_log_probs(tiny_model_dir, arith_data, tmp_path):
    """verl's bypass mode: the rollout's own log-probs stand for the old policy's, also in the reward's KL penalty, so
    the step runs no forward for them; with several optimizer steps a step the trainer-vs-rollout precision gap,
    which needs the trainer's pi_old, is not reported (nor watched by the precision guard): the current policy has
    moved after the first."""
    extra = {"algorithm.rollout_correction.bypass_mode": True, "algorithm.use_kl_in_reward": True,
             "algorithm.adv_estimator": "grpo", "trainer.total_training_steps": 1,
             "actor_rollout_ref.actor.ppo_mini_batch_size": 2}
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "run", **extra))
    batches = []
    original = trainer.updater.ppo_update

    def spy(name, model, optimizer, batch, *args, **kwargs):
        batches.append(batch)
        return original(name, model, optimizer, batch, *args, **kwargs)

    trainer.updater.ppo_update = spy
    trainer.fit()
    row = _rows(tmp_path / "run")[1]
    assert "timing/old_log_prob" not in row and "actor/reward_kl_penalty" in row
    assert "actor/rollout_logprob_gap" not in row
    assert batches and batches[0].old_logprobs is batches[0].rollout.response_logprobs


@pytest.mark.slow
def test_bypass_mode_trains_as_before_without_the_old_log_prob_forward(tiny_model_dir, arith_data, tmp_path,
                                                                        monkeypatch):
    """Bypass mode without importance weights (the PPO ratio against the rollout's own log-probs), two mini-batches:
    the trainer's forward for the old policy is skipped, and the losses and gradients are those of a run that
    still computes it (nothing read it)."""
    from rlanywhere import trainer as trainer_module

    extra = {"algorithm.rollout_correction.bypass_mode": True, "trainer.total_training_steps": 2,
             "actor_rollout_ref.actor.ppo_mini_batch_size": 2}
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "skip", **extra)).fit()
    monkeypatch.setattr(trainer_module, "recomputes_old_logprobs", lambda section: True)
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "forward", **extra)).fit()
    skip, forward = _rows(tmp_path / "skip"), _rows(tmp_path / "forward")
    for step in (1, 2):
        assert "timing/old_log_prob" not in skip[step] and "timing/old_log_prob" in forward[step]
        for key in KEYS:
            assert skip[step][key] == pytest.approx(forward[step][key], rel=1e-6, abs=1e-8), (step, key)


@pytest.mark.slow
@pytest.mark.parametrize("ranks, rollout_ranks", [(2, []), (3, ["trainer.async.rollout_ranks=1"])])
def test_sigterm_to_a_split_job_saves_the_batch_in_flight_and_resume_is_exact(tiny_model_dir, arith_data, tmp_path,
                                                                               ranks, rollout_ranks):
    """SIGTERM to torchrun during a split job (1 trainer rank + 1 rollout rank; 2 + 1): the trainer ranks save (the
    rollout rank finishes the batches in flight, which the checkpoint keeps: each trainer rank's share), every rank
    exits, and the resumed job trains like an uninterrupted one process."""
    import signal
    import subprocess
    import time

    steps = 5
    extra = {"trainer.async.mode": "one_step_off", "trainer.total_training_steps": steps}
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "one", **extra)).fit()
    slow_reward = tmp_path / "slow_parity_reward.py"  # the parity reward, slowed down so that a step can be hit
    slow_reward.write_text("import os, time\n" + PARITY_REWARD.replace(
        "    return", "    time.sleep(float(os.environ.get('RLA_TEST_SLOW_REWARD', 0)))\n    return"))
    command = [*warm_ranks.torchrun(), "--standalone", f"--nproc_per_node={ranks}",
               *warm_ranks.rank_program(), "train",
               *_overrides(tiny_model_dir, arith_data, tmp_path / "split", **extra),
               f"custom_reward_function.path={slow_reward}", *rollout_ranks]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **warm_ranks.rank_env()}
    proc = subprocess.Popen(command, env={**env, "RLA_TEST_SLOW_REWARD": "0.15"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline, metrics = time.time() + 600, tmp_path / "split" / "metrics.jsonl"
    while not (metrics.exists() and "reward/mean" in metrics.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert "stopped by SIGTERM at step" in out and "error: rank" not in out, out[-6000:]
    step = int(out.split("stopped by SIGTERM at step ")[1].split(":")[0])
    assert 1 <= step < steps
    checkpoint = tmp_path / "split" / "checkpoints" / f"global_step_{step}"
    with open(checkpoint / "trainer_state.json") as handle:
        saved = json.load(handle)["async_rollouts"]
    shares = saved.get("ranks", [saved])  # each trainer rank's share
    assert len(shares) == ranks - 1 and all(str(step) in share for share in shares)  # the next step's batch
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:]
    one, split = _rows(tmp_path / "one"), _rows(tmp_path / "split")
    assert sorted(split) == list(range(1, steps + 1))
    for later in range(step + 1, steps + 1):
        for key in KEYS + ("async/staleness",):
            assert split[later][key] == pytest.approx(one[later][key], rel=1e-5, abs=1e-7), (later, key)


@pytest.mark.slow
def test_oom_recovery_in_the_pipelines_rollout(tiny_model_dir, arith_data, tmp_path):
    """An out-of-memory error in the rollout of step 2 (started during step 1): the guard halves the rollout batch
    and redoes it, and the run goes on."""
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "trainer.async.mode": "one_step_off"}))
    original, calls = trainer.engine.generate, []

    def generate_once_out_of_memory(*args, **kwargs):
        calls.append(kwargs.get("rows_per_wave"))
        if len(calls) == 2:  # the first rollout of step 2
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(*args, **kwargs)

    trainer.engine.generate = generate_once_out_of_memory
    trainer.fit()
    rows = _rows(tmp_path / "run")
    assert sorted(rows) == [1, 2, 3] and calls[2] == calls[1] // 2
    assert trainer.oom_guard.events and trainer.oom_guard.events[0]["phase"] == "rollout"


# ------------------------------------------------------------------------------------------------ the overlap bench
def test_overlap_bench_schedule_and_medians_by_hand():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    import async_overlap

    assert async_overlap.schedule(["in_turn", "both"], 2, 3) == ["in_turn"] * 5 + ["both"] * 3
    records = [{"setting": "in_turn", "perf/step_time_s": 9.0, "timing/update_actor": 5.0},  # its batch: another's
               {"setting": "in_turn", "perf/step_time_s": 1.0, "timing/update_actor": 0.5},
               {"setting": "in_turn", "perf/step_time_s": 2.0, "timing/update_actor": 0.7},
               {"setting": "both", "perf/step_time_s": 7.0},
               {"setting": "both", "perf/step_time_s": 0.8, "timing/rollout_wait": 0.1}]
    summary = async_overlap.summarise(records, samples=16)
    # in_turn: steps 2-3 -> medians 1.5 s and 0.6 s, 16 / 1.5 samples/s; both: its second step alone
    assert summary["in_turn"]["s/step"] == pytest.approx(1.5) and summary["in_turn"]["update s"] == pytest.approx(0.6)
    assert summary["in_turn"]["samples/s"] == pytest.approx(16 / 1.5) and summary["in_turn"]["steps"] == 2
    assert summary["both"]["s/step"] == 0.8 and summary["both"]["wait s"] == 0.1 and summary["both"]["update s"] is None
    assert "in_turn" in async_overlap.format_table(summary)
    # the run ended: its last step (both's second) left out too, and never both's first in its place
    ended = async_overlap.summarise(records, samples=16, run_ended=True)
    assert ended["in_turn"]["s/step"] == pytest.approx(1.5) and ended["both"]["steps"] == 0
    assert ended["both"]["s/step"] is None and ended["both"]["samples/s"] is None
    assert "both" in async_overlap.format_table(ended)
    # partitionN: `both`'s overlap, stream priority and GIL interval, with the rollout's N SMs
    assert async_overlap.setting("partition40") == (*async_overlap.SETTINGS["both"][:3], "partition", 40)
    assert async_overlap.setting("green") == async_overlap.SETTINGS["green"]
    with pytest.raises(KeyError):
        async_overlap.setting("partition")
    # ref_in_step: `both`, the reference's log-probs left to the step; every other setting keeps the plan's choice
    from types import SimpleNamespace

    pipeline, plans_pass = SimpleNamespace(stream=None), object()
    async_overlap.apply_setting(pipeline, "ref_in_step", "executor", 16, reference_pass=plans_pass)
    assert pipeline.reference_pass is None and pipeline.overlap and pipeline.executor == "executor"
    async_overlap.apply_setting(pipeline, "in_turn", "executor", 16, reference_pass=plans_pass)
    assert pipeline.reference_pass is plans_pass and not pipeline.overlap and pipeline.executor is None


def _resume_and_match_the_uninterrupted_run(tiny_model_dir, arith_data, tmp_path, extra):
    """Resume the stopped run in tmp_path/b and check its steps 2-3 against the uninterrupted run in tmp_path/a."""
    _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "b", **extra)).fit()
    a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
    assert sorted(b) == [1, 2, 3]
    for step in (2, 3):
        for key in KEYS + ("async/staleness",):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


def _assert_split_matches_one_process(one_dir, split_dir):
    """The split run's steps 1-3: staleness 0, 1, 1 and the one-process one_step_off run's samples and metrics."""
    one, split = _rows(one_dir), _rows(split_dir)
    assert sorted(split) == [1, 2, 3]
    assert [split[k]["async/staleness"] for k in (1, 2, 3)] == [0.0, 1.0, 1.0]
    for step in (1, 2, 3):
        for key in KEYS + ("actor/rollout_is_mean", "actor/rollout_is_capped_frac"):
            assert split[step][key] == pytest.approx(one[step][key], rel=1e-6, abs=1e-8), (step, key)


def test_the_rollout_thread_may_call_compiled_ops_while_the_update_compiles(monkeypatch):
    """torch.compile's FX trace sets a flag that every thread sees: a compiled op that the overlapped rollout calls
    while the update compiles must run (uncompiled), not stop the run (it did, on the demo with bypass_mode), and
    the same for the trainer's calls while the rollout compiles."""
    import torch._dynamo
    import torch.fx._symbolic_trace as fx_trace
    from types import SimpleNamespace

    from rlanywhere.async_pipeline import RolloutPipeline

    monkeypatch.setattr(torch._dynamo.config, "error_on_nested_fx_trace", True)  # torch's default
    op = torch.compile(lambda x: x * 2 + 1, backend="eager")
    x = torch.arange(4.0)
    monkeypatch.setattr(fx_trace, "_is_fx_tracing_flag", True)  # as while the main thread traces the update
    with pytest.raises(RuntimeError, match="symbolically trace"):
        op(x)
    cfg = SimpleNamespace(trainer={"async": SimpleNamespace(max_staleness=1)})
    plan = SimpleNamespace(async_rollout=OVERLAPPED, device="cpu")
    pipeline = RolloutPipeline(cfg, plan, torch.nn.Linear(2, 2), loader=None, total_steps=2)
    try:
        assert torch.equal(pipeline.executor.submit(op, x).result(), x * 2 + 1)  # on the rollout's thread
        assert torch.equal(op(x), x * 2 + 1)  # on the trainer's, while the rollout's thread compiles a decode op
    finally:
        pipeline.executor.shutdown()


@pytest.mark.slow
def test_remax_validates_with_the_updated_weights_and_takes_its_baseline_in_the_job(tiny_model_dir, arith_data,
                                                                                   tmp_path, monkeypatch):
    """ReMax's greedy baseline is part of the rollout's scoring (the weights that sampled the batch: in the pipeline,
    the job's own), so the step never settles the pipeline: validation after the update gives the engine the
    updated weights (it validated with the weights before the update)."""
    from rlanywhere import trainer as trainer_module

    extra = {"trainer.async.mode": "one_step_off", "algorithm.adv_estimator": "remax", "trainer.test_freq": 1,
             "trainer.total_training_steps": 2}
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "remax", **extra))
    seen, original = [], trainer_module.validate

    def checking_validate(rollouts, *args, **kwargs):
        rollouts.sampling_params(validation=True)  # what validation calls first: the pipeline settles
        actor, copy = trainer.actor.state_dict(), trainer.pipeline.model.state_dict()
        seen.append(all(torch.equal(actor[name], copy[name]) for name in actor))
        return original(rollouts, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "validate", checking_validate)
    trainer.fit()
    rows = _rows(tmp_path / "remax")
    assert seen == [True, True] and all("timing/greedy_baseline" not in rows[step] for step in (1, 2))


@pytest.mark.slow
def test_a_step_dropped_before_it_takes_its_batch_does_not_bring_back_the_trained_one(tiny_model_dir, arith_data,
                                                                                       tmp_path):
    """SIGTERM while step 2 draws its prompts (before it takes its batch): the checkpoint keeps step 2's batch only,
    not step 1's, which was trained (it put step 1's back into the pipeline, saved in every later checkpoint), and
    a rollout in flight at the save keeps its seconds."""
    import os
    import signal

    from rlanywhere.runguard import RunInterrupted

    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "drop", **{
        "trainer.async.mode": "one_step_off"}), overlapped=True)
    next_batch = trainer.loader.next_batch

    def signalled_at_step_2():
        if trainer.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return next_batch()

    trainer.loader.next_batch = signalled_at_step_2
    with pytest.raises(RunInterrupted) as stopped:
        trainer.fit()
    with open(os.path.join(stopped.value.checkpoint, "trainer_state.json")) as handle:
        saved = json.load(handle)["async_rollouts"]
    assert sorted(saved) == ["1"] and sorted(trainer.pipeline.jobs) == [1]
    assert saved["1"]["seconds"] > 0


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_failing_rollout_ahead_leaves_the_checkpoint_of_the_step_that_trained(tiny_model_dir, arith_data, tmp_path,
                                                                              overlapped):
    """The rollout of step 3 fails (a tool server, an OOM at the smallest size) while or after step 2 trains: as in
    a synchronous run, step 2's checkpoint is written (without that batch) and the error is raised by step 3."""
    extra = {"trainer.async.mode": "one_step_off", "trainer.save_freq": 2, "trainer.total_training_steps": 4}
    trainer = _trainer(_overrides(tiny_model_dir, arith_data, tmp_path / "r", **extra), overlapped=overlapped)
    generate, calls = trainer.engine.generate, []

    def failing_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("tool server crashed")
        return generate(*args, **kwargs)

    trainer.engine.generate = failing_third
    with pytest.raises(RuntimeError, match="tool server crashed"):
        trainer.fit()
    assert trainer.global_step == 2
    assert (tmp_path / "r" / "checkpoints" / "global_step_2").is_dir()


def _killed_then_resumed_with(model_dir, data_dir, run_dir, monkeypatch, die_at: int, first: dict, second: dict,
                              **base) -> dict[int, dict]:
    """A one_step_off run killed inside step `die_at + 1` (its settings `first`), resumed with `second`: its rows."""
    from rlanywhere.trainer import RLTrainer

    train_step = RLTrainer.train_step

    def dying(self, items):
        if self.global_step == die_at:
            raise KeyboardInterrupt
        return train_step(self, items)

    monkeypatch.setattr(RLTrainer, "train_step", dying)
    with pytest.raises(KeyboardInterrupt):
        _trainer(_overrides(model_dir, data_dir, run_dir, **base, **first)).fit()
    monkeypatch.setattr(RLTrainer, "train_step", train_step)
    _trainer(_overrides(model_dir, data_dir, run_dir, **base, **second)).fit()
    return _rows(run_dir)


def test_a_lower_max_staleness_on_resume_regenerates_the_staler_saved_rollouts(tiny_model_dir, arith_data, tmp_path,
                                                                               monkeypatch):
    rows = _killed_then_resumed_with(
        tiny_model_dir, arith_data, tmp_path / "r", monkeypatch, 3, {"trainer.async.max_staleness": 2},
        {"trainer.async.max_staleness": 1}, **{"trainer.async.mode": "one_step_off",
                                               "trainer.total_training_steps": 5, "trainer.save_freq": 2})
    staleness = {step: row["async/staleness"] for step, row in rows.items() if step > 2}
    assert staleness and max(staleness.values()) <= 1, staleness


def test_an_overlap_that_would_score_with_a_large_reward_model_beside_the_update_takes_turns(tmp_path):
    """Overlapped, the rollout's job scores each batch with the reward model beside the update: its forward counts
    in the overlap's memory. A 7B reward model beside a 0.5B policy's update does not fit an H100: in turn."""
    def reward_model_dir(name, hidden, layers, heads, kv_heads, intermediate):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1,
            "max_position_embeddings": 4096, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "vocab_size": 152064, "tie_word_embeddings": False}))
        return folder

    from rlanywhere.planner import make_plan

    base = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.rollout.n=8", "data.train_batch_size=64", "data.max_prompt_length=256",
            "data.max_response_length=256", "trainer.async.mode=one_step_off", "hardware.emulate=h100",
            "reward_model.enable=true"]
    small = make_plan(load_config(None, base + [
        f"reward_model.model.path={reward_model_dir('rm3b', 2048, 36, 16, 2, 11008)}"]), for_execution=False)
    large = make_plan(load_config(None, base + [
        f"reward_model.model.path={reward_model_dir('rm7b', 3584, 28, 28, 4, 18944)}"]), for_execution=False)
    assert small.async_rollout == OVERLAPPED
    assert large.async_rollout == IN_TURN and "scoring with the reward model" in large.reasons["async_rollout"]


def test_batches_saved_ahead_are_made_again_when_the_reward_changes_on_resume(tiny_model_dir, arith_data, tmp_path,
                                                                              monkeypatch):
    """A one_step_off checkpoint keeps the next step's batch, generated and scored already: resumed with another
    reward function, that batch is made again, so step 3 trains on the new reward's scores."""
    quarter = tmp_path / "quarter.py"
    quarter.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    return 0.25\n")
    rows = _killed_then_resumed_with(
        tiny_model_dir, arith_data, tmp_path / "r", monkeypatch, 2, {}, {"custom_reward_function.path": str(quarter)},
        **{"trainer.async.mode": "one_step_off", "trainer.total_training_steps": 4, "trainer.save_freq": 2})
    rewards = {step: row["reward/mean"] for step, row in rows.items()}
    assert rewards[3] == rewards[4] == pytest.approx(0.25), rewards
