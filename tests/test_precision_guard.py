"""fp16 mixed precision on CPU: the loss-scaler path (an injected overflow is skipped and counted, the scale
recovers, a collapsing scale stops the run), the rollout/trainer log-prob gap guard, and fp32 computation of the
loss pieces under fp16 autocast."""

from __future__ import annotations

import math

import pytest
import torch

from rlanywhere import algorithms as algo
from rlanywhere import planner, plans, vocabulary
from rlanywhere.errors import UserError
from rlanywhere.logprobs import chunked_logprobs_and_entropy, naive_logprobs_and_entropy
from rlanywhere.precision_guard import (PrecisionGuard, PrecisionGuardError, logprobs_comparable, optimizer_step,
                                        rollout_logprob_gap)

FP16_AUTOCAST = plans.Plan(precision="fp16", compute_dtype=torch.float16, use_autocast=True, use_grad_scaler=True)


def _fp16_linear_step(model, scaler, upstream: float) -> None:
    """Backward of a fp16-autocast linear layer whose output gradient is `upstream` (times the loss scale).

    At scale 2^16 an upstream gradient >= 1 overflows fp16 (65536 > 65504) inside the backward pass."""
    with planner.autocast_context(FP16_AUTOCAST):
        out = model(torch.ones(2, 4))
    assert out.dtype == torch.float16
    scaler.scale(out.float().sum() * upstream).backward()


def test_injected_overflow_is_skipped_and_counted_and_the_scale_recovers():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=vocabulary.LOSS_SCALE_INIT, growth_interval=2)
    guard = PrecisionGuard(min_loss_scale=1.0)
    history = []
    for step, upstream in enumerate([2.0 ** -4, 1e4, 2.0 ** -4, 2.0 ** -4]):  # step 1: the injected overflow
        before = model.weight.detach().clone()
        _fp16_linear_step(model, scaler, upstream)
        outcome = optimizer_step(optimizer, model.parameters(), grad_clip=1e9, scaler=scaler)
        optimizer.zero_grad(set_to_none=True)
        guard.record("actor", outcome)
        history.append((outcome, guard.end_step({}), not torch.equal(before, model.weight)))
    (clean, m0, moved0), (overflow, m1, moved1), (_, m2, moved2), (_, m3, moved3) = history
    assert clean.applied and moved0 and math.isclose(clean.grad_norm, 2.0 ** -4 * math.sqrt(12 * 2 ** 2 + 3 * 2 ** 2),
                                                      rel_tol=1e-6)  # 12 weights, 3 biases: grad 2u each
    assert overflow.scaler_overflow and not overflow.applied and not moved1  # skipped: the weights did not move
    assert not overflow.nonfinite_failure  # a scaler skip is normal, not a fault
    assert m1["actor/skipped_steps"] == 1 and m1["actor/skipped_steps_total"] == 1
    assert m1["actor/loss_scale"] == vocabulary.LOSS_SCALE_INIT / 2
    assert moved2 and moved3 and m2["actor/skipped_steps"] == 0 and m3["actor/skipped_steps_total"] == 1
    assert m2["actor/loss_scale"] == vocabulary.LOSS_SCALE_INIT / 2
    assert m3["actor/loss_scale"] == vocabulary.LOSS_SCALE_INIT  # grew back after growth_interval clean steps


def test_nonfinite_gradient_without_a_scaler_is_a_failure_not_a_scaler_skip():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    (model(torch.ones(1, 2)).sum() * float("inf")).backward()
    outcome = optimizer_step(optimizer, model.parameters(), grad_clip=1.0)
    assert not outcome.applied and not outcome.scaler_overflow and outcome.nonfinite_failure
    assert outcome.loss_scale is None and torch.equal(before, model.weight)
    guard = PrecisionGuard()
    guard.record("actor", outcome)
    # the weights did not move: a skipped step, counted (the run's stop rule counts it as a failure too)
    assert guard.end_step({}) == {"actor/skipped_steps": 1.0, "actor/skipped_steps_total": 1.0}


def test_a_collapsing_loss_scale_stops_the_run_with_the_fix():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=vocabulary.LOSS_SCALE_INIT, growth_interval=2)
    guard = PrecisionGuard(min_loss_scale=1.0)
    steps = 0
    with pytest.raises(PrecisionGuardError) as err:
        while steps < 40:  # a forward pass that overflows at every scale: each step is skipped
            _fp16_linear_step(model, scaler, float("inf"))
            guard.record("actor", optimizer_step(optimizer, model.parameters(), 1.0, scaler))
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            guard.end_step({})
    assert steps == 17  # 2^16 halved 17 times is 0.5 < 1
    message = str(err.value)
    assert "loss scale fell to 0.5" in message and "17 skipped" in message and "hardware.precision=fp32" in message
    assert isinstance(err.value, UserError)  # the CLI prints it as one error line


def test_rollout_logprob_gap_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, 0.0]])
    rollout = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -1.25, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert float(rollout_logprob_gap(trainer, rollout, mask)) == pytest.approx((0.5 + 0 + 0 + 1.0) / 4)
    assert float(rollout_logprob_gap(trainer, trainer, mask)) == 0.0


def test_gap_guard_trips_after_patience_steps_in_a_row():
    guard = PrecisionGuard(max_logprob_gap=0.1, patience=3, precision="fp16")
    for gap in (0.2, 0.05, 0.2, 0.2):  # the 0.05 resets the run of large gaps
        guard.end_step({"actor/rollout_logprob_gap": gap})
    guard.end_step({})  # a step without the measurement (critic warm-up) changes nothing
    with pytest.raises(PrecisionGuardError, match=r"0\.2, 0\.2, nan.*max_logprob_gap=0\.1 \(fp16\)"):
        guard.end_step({"actor/rollout_logprob_gap": float("nan")})  # nan counts as over
    off = PrecisionGuard(max_logprob_gap=0.0, patience=1)
    off.end_step({"actor/rollout_logprob_gap": 50.0})


def test_gap_guard_counts_only_batches_of_the_current_policy():
    """A batch an older policy sampled (trainer.async) differs from the trainer by the update since: not counted."""
    guard = PrecisionGuard(max_logprob_gap=0.1, patience=2, precision="bf16")
    for _ in range(3):
        guard.end_step({"actor/rollout_logprob_gap": 0.3, "async/staleness": 1.0})
    guard.end_step({"actor/rollout_logprob_gap": 0.3, "async/staleness": 0.0})
    with pytest.raises(PrecisionGuardError, match="last 2 steps"):
        guard.end_step({"actor/rollout_logprob_gap": 0.3})


def test_non_finite_rollout_logprobs_stop_before_the_update():
    guard = PrecisionGuard(precision="fp16")
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    guard.check_rollout(torch.tensor([[-1.0, -2.0, float("nan")], [-1.0, float("-inf"), 0.0]]), mask)  # padding
    with pytest.raises(PrecisionGuardError, match="1 tokens of 1 responses.*rollout.dtype=float32"):
        guard.check_rollout(torch.tensor([[-1.0, float("nan"), 0.0], [-1.0, 0.0, 0.0]]), mask)
    # an fp32 rollout cannot overflow its precision: NaN there means diverged weights, which the trainer's
    # non-finite update rule stops with the advice for that (tests/test_faults.py, absurd lr)
    PrecisionGuard(precision="fp32").check_rollout(torch.tensor([[-1.0, float("nan"), 0.0], [-1.0, 0.0, 0.0]]), mask)


def test_logprobs_comparable_only_without_top_k_top_p():
    assert logprobs_comparable(-1, 1.0) and logprobs_comparable(0, 1.0) and logprobs_comparable(None, None)
    assert not logprobs_comparable(50, 1.0) and not logprobs_comparable(-1, 0.9)


def test_lm_head_log_softmax_and_entropy_stay_fp32_under_fp16_autocast():
    """The hidden states come out of a fp16-autocast decoder in fp16; the head must still be computed in fp32:
    an fp16 head rounds logits of ~10 by ~4e-3, which an fp64 reference sees."""
    torch.manual_seed(0)
    hidden = (torch.randn(3, 5, 32) * 2).half()
    weight = torch.randn(100, 32, dtype=torch.float32, requires_grad=True)
    labels = torch.randint(0, 100, (3, 5))
    ref_lp, ref_ent = naive_logprobs_and_entropy(hidden.double(), weight.detach().double(), labels,
                                                 with_entropy=True)
    with planner.autocast_context(FP16_AUTOCAST):
        logprobs, entropy = chunked_logprobs_and_entropy(hidden, weight, labels, chunk_size=4, with_entropy=True)
        fp16_head = torch.log_softmax((hidden.float() @ weight.t()).float(), -1)  # autocast: a fp16 matmul
    assert logprobs.dtype == entropy.dtype == torch.float32
    assert (logprobs.double() - ref_lp).abs().max() < 1e-4 and (entropy.double() - ref_ent).abs().max() < 1e-4
    fp16_lp = fp16_head.gather(-1, labels[..., None])[..., 0]
    assert (fp16_lp.double() - ref_lp).abs().max() > 1e-3  # what the fp32 head avoids: the test can tell
    logprobs.sum().backward()
    assert weight.grad.dtype == torch.float32 and torch.isfinite(weight.grad).all()


def test_losses_and_advantages_are_fp32_under_fp16_autocast():
    torch.manual_seed(0)
    mask = torch.ones(4, 6)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0])
    old = torch.randn(4, 6) - 2
    with planner.autocast_context(FP16_AUTOCAST):
        new = (old + 0.01 * torch.randn(4, 6)).requires_grad_(True)
        adv, returns = algo.compute_advantages("grpo", scores=scores, token_rewards=algo.scores_to_token_rewards(
            scores, mask), values=None, mask=mask, group_index=torch.tensor([0, 0, 1, 1]), gamma=1.0, lam=1.0,
            norm_adv_by_std_in_grpo=True)
        pg_loss, _ = algo.ppo_policy_loss(old, new, adv, mask, 0.2, 0.2, 3.0, "token-mean")
        kl = algo.kl_loss(new, old, mask, "low_var_kl", "token-mean")
        values = torch.randn(4, 6, requires_grad=True)
        vf_loss, _ = algo.value_loss(values, values.detach(), returns, mask, 0.5, "token-mean")
    for tensor in (adv, returns, pg_loss, kl, vf_loss):
        assert tensor.dtype == torch.float32


def test_value_head_is_fp32_under_fp16_autocast(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlanywhere.models import ValueModel

    critic = ValueModel.from_causal_lm(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    torch.nn.init.normal_(critic.value_head.weight)
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones_like(ids)
    with planner.autocast_context(FP16_AUTOCAST):
        values = critic(ids, mask)
        hidden = critic.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    assert values.dtype == torch.float32
    exact = hidden.double() @ critic.value_head.weight.double().t() + critic.value_head.bias.double()
    assert (values.double() - exact[..., 0]).abs().max() < 1e-5


# ------------------------------------------------------------------------------ the trainer, fp16 on CPU
def _trainer(model_dir, data_dir, run_dir, fp16: bool = True, **extra):
    """A trainer on the fp16 plan a T4 gets (fp32 master weights, fp16 autocast and rollout, GradScaler), run on
    CPU autocast: the planner refuses fp16 on CPU, so the CPU plan is switched to it by hand. fp16=False: the CPU's
    own fp32 plan (fp16 matmuls are slow on a CPU)."""
    from dataclasses import replace

    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan
    from rlanywhere.trainer import RLTrainer

    from .test_e2e import base_overrides

    cfg = load_config(None, base_overrides(model_dir, data_dir, run_dir, **{
        "algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3, "trainer.save_freq": -1,
        "trainer.val_before_train": False, **extra}))
    plan = make_plan(cfg)
    if fp16:
        plan = replace(plan, precision="fp16", compute_dtype=torch.float16,
                       rollout=replace(plan.rollout, dtype=torch.float16),
                       use_autocast=True, use_grad_scaler=True)
    return RLTrainer(cfg, plan, str(run_dir))


@pytest.mark.slow
def test_fp16_training_counts_an_injected_overflow_and_keeps_going(tiny_model_dir, arith_data, tmp_path):
    trainer = _trainer(tiny_model_dir, arith_data, tmp_path / "run")
    assert trainer.engine.dtype == torch.float16 and trainer.grad_scaler.get_scale() == vocabulary.LOSS_SCALE_INIT
    scale = trainer.grad_scaler.scale
    calls = {"n": 0}

    def overflow_once(loss):  # the first actor backward of step 1 overflows, as a fp16 gradient spike would
        calls["n"] += 1
        return scale(loss) * (float("inf") if calls["n"] == first_actor_call else 1.0)

    first_actor_call = 3  # critic: micro-batches of 3 rows over 4 (one mini-batch of 2 prompts x n=2): 2 calls
    trainer.grad_scaler.scale = overflow_once
    actor_before = {k: v.detach().clone() for k, v in trainer.actor.named_parameters()}
    step1 = trainer.train_step(trainer.loader.next_batch())
    trainer.global_step += 1
    assert step1["critic/skipped_steps"] == 0 and step1["actor/skipped_steps"] == 1
    assert step1["actor/loss_scale"] == vocabulary.LOSS_SCALE_INIT / 2  # shared by actor and critic: halved once
    # two actor mini-batches (4 prompts, ppo_mini_batch_size 2): the first skipped, the second applied
    assert any(not torch.equal(v, actor_before[k]) for k, v in trainer.actor.named_parameters())
    step2 = trainer.train_step(trainer.loader.next_batch())
    assert step2["actor/skipped_steps"] == 0 and step2["actor/skipped_steps_total"] == 1
    for row in (step1, step2):
        gap = row["actor/rollout_logprob_gap"]  # fp16 rollout vs fp16-autocast trainer, over response tokens
        assert 0 < gap < 0.05, gap
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["critic/vf_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("bypass", [False, True])
def test_trainer_stops_when_the_logprob_gap_stays_above_the_threshold(tiny_model_dir, arith_data, tmp_path, bypass):
    # the rail watches every precision; fp32's gap is ~1e-6, so a threshold of 1e-9 trips it. In bypass mode the
    # PPO ratio is taken against the rollout's log-probs, but the gap is still the trainer's against the rollout's
    # where the update's first micro-batches see the trainer's pi_old: with one optimizer step a step
    trainer = _trainer(tiny_model_dir, arith_data, tmp_path / "run", fp16=False, **{
        "hardware.max_logprob_gap": 1e-9, "hardware.logprob_gap_patience": 2, "algorithm.adv_estimator": "grpo",
        "algorithm.rollout_correction.bypass_mode": bypass,
        **({"actor_rollout_ref.actor.ppo_mini_batch_size": 4} if bypass else {})})
    assert trainer.train_step(trainer.loader.next_batch())["actor/rollout_logprob_gap"] < 1e-4
    with pytest.raises(PrecisionGuardError, match="last 2 steps, above hardware.max_logprob_gap=1e-09 \\(fp32\\)"):
        trainer.train_step(trainer.loader.next_batch())


@pytest.mark.slow
def test_trainer_stops_before_training_on_a_non_finite_rollout(tiny_model_dir, arith_data, tmp_path):
    trainer = _trainer(tiny_model_dir, arith_data, tmp_path / "run", **{"algorithm.adv_estimator": "grpo"})
    generate = trainer.engine.generate

    def overflowed(*args, **kwargs):
        batch = generate(*args, **kwargs)
        batch.response_logprobs[0, 0] = float("nan")
        return batch

    trainer.engine.generate = overflowed
    before = {k: v.detach().clone() for k, v in trainer.actor.named_parameters()}
    with pytest.raises(PrecisionGuardError, match="non-finite log-probs in 1 tokens of 1 responses"):
        trainer.train_step(trainer.loader.next_batch())
    assert all(torch.equal(v, before[k]) for k, v in trainer.actor.named_parameters())


@pytest.mark.slow
def test_the_loss_scale_is_checkpointed_and_resumed(tiny_model_dir, arith_data, tmp_path):
    trainer = _trainer(tiny_model_dir, arith_data, tmp_path / "run", **{"algorithm.adv_estimator": "grpo"})
    trainer.grad_scaler.scale(torch.tensor(1.0))  # the scale tensor exists from the first backward on
    trainer.grad_scaler.update(new_scale=1024.0)  # as after six overflows
    trainer.save()
    resumed = _trainer(tiny_model_dir, arith_data, tmp_path / "run", **{"algorithm.adv_estimator": "grpo"})
    assert resumed.grad_scaler.get_scale() == vocabulary.LOSS_SCALE_INIT
    resumed.maybe_resume()
    assert resumed.grad_scaler.get_scale() == 1024.0
    assert resumed.grad_scaler.get_growth_interval() == vocabulary.LOSS_SCALE_GROWTH_INTERVAL


def test_the_guards_checkpoint_state_counts_on_but_keeps_no_loss_scale():
    """A resumed run counts skipped steps and the gap window on from the checkpoint; the loss scale is the gradient
    scaler's own state: an fp16 run resumed in fp32 (as the guard's advice says) neither logs the old scale nor
    stops on it."""
    from rlanywhere.precision_guard import StepOutcome

    fp16 = PrecisionGuard(min_loss_scale=1.0, max_logprob_gap=0.1, patience=3, precision="fp16")
    fp16.record("actor", StepOutcome(grad_norm=math.inf, applied=False, scaler_overflow=True, loss_scale=2.0))
    fp16.end_step({"actor/rollout_logprob_gap": 0.5})
    fp32 = PrecisionGuard(min_loss_scale=4.0, max_logprob_gap=0.1, patience=3, precision="fp32")
    fp32.load_state_dict(fp16.state_dict())
    fp32.record("actor", StepOutcome(grad_norm=1.0, applied=True, scaler_overflow=False, loss_scale=None))
    metrics = fp32.end_step({"actor/rollout_logprob_gap": 0.5})
    assert metrics == {"actor/skipped_steps": 0.0, "actor/skipped_steps_total": 1.0}
    with pytest.raises(PrecisionGuardError, match="0.5, 0.5, 0.5"):  # the third gap over the limit in a row
        fp32.end_step({"actor/rollout_logprob_gap": 0.5})
