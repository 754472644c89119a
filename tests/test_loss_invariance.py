"""The gradient of one optimizer step must not depend on how its mini-batch is split (issue 10).

For every loss_agg_mode, actor and critic: micro-batches of 1, 2 and all rows, token-budget micro-batches and a
step whose first attempt runs out of memory (OOM recovery halves the micro-batch and redoes it) all give the
gradient of the whole mini-batch in one piece. Float64 weights on the CPU, rows of very different lengths."""

from __future__ import annotations

import pytest
import torch

from rlanywhere import algorithms as algo
from rlanywhere.config import load_config
from rlanywhere.planner import make_plan
from rlanywhere.plans import SizeKind
from rlanywhere.rollout_correction import RolloutCorrection
from rlanywhere.stepbatch import StepBatch
from rlanywhere.trainer import RLTrainer
from rlanywhere.update import actor_loss, critic_loss

from .test_e2e import base_overrides

RESPONSE_LENGTHS = [1, 12, 3, 7, 12, 2, 9, 5]  # 4 prompts x n = 2


@pytest.fixture(scope="module")
def trainer_and_batch(tiny_model_dir, arith_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("invariance")
    overrides = base_overrides(tiny_model_dir, arith_data, run_dir, **{
        "algorithm.adv_estimator": "gae", "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.kl_loss_coef": 0.1, "actor_rollout_ref.actor.entropy_coeff": 0.01,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "critic.cliprange_value": 0.05})
    cfg = load_config(None, overrides)
    trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), str(run_dir))
    items = trainer.loader.next_batch()
    rollout = trainer.rollouts.generate(items, trainer.rollouts.sampling_params(), trainer.rollouts.step_generator(0))
    # rows of very different lengths (a random model rarely stops early by itself)
    for row, length in enumerate(RESPONSE_LENGTHS):
        rollout.response_mask[row, length:] = 0
        rollout.response_ids[row, length:] = trainer.tokenizer.pad_token_id
    trainer.actor.double()
    trainer.critic.double()
    rows = rollout.response_ids.shape[0]
    batch = StepBatch(rollout=rollout, group_index=torch.arange(4).repeat_interleave(2),
                      scores=torch.zeros(rows), reward_info={})
    gen = torch.Generator().manual_seed(0)
    noise = lambda scale: scale * torch.randn(batch.mask.shape, generator=gen, dtype=torch.float64) * batch.mask  # noqa: E731
    current = trainer.logprobs(trainer.actor, batch).double()
    batch.old_logprobs = current + noise(0.3)  # ratios away from 1: the clipped branches are active
    batch.ref_logprobs = current + noise(0.5)
    batch.advantages = noise(1.0)
    batch.values = trainer.updater.values(trainer.critic, batch).double() + noise(0.1)
    batch.returns = noise(1.0)
    return trainer, batch


def _gradient(trainer, model, loss_fn, batch, size, token_budget=False, fail_first=False, merge=False):
    """The accumulated gradient (and metrics) with micro-batches of `size` rows, of `size` tokens, or (merge) of as
    many rows as hold no more tokens than `size` full-length rows (plan.merge_micro_batches)."""
    trainer.run.sizes.max_token_len_per_micro_batch = size if token_budget else None
    trainer.plan.merge_micro_batches = merge
    rows = list(range(batch.rows))
    kind = trainer.updater.size_kind(SizeKind.ACTOR_MICRO_BATCH)
    trainer.run.sizes.set(kind, size)
    calls = {"n": 0}

    def flaky(*args):
        calls["n"] += 1
        if fail_first and calls["n"] == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss_fn(*args)

    optimizer = trainer.optimizers["critic" if model is trainer.critic else "actor"]
    metrics = trainer.oom_guard.run("update", lambda s: trainer.updater.accumulate(model, optimizer, batch, rows, s,
                                                                                   flaky), kind)
    if fail_first:
        assert trainer.run.sizes.get(kind) == size // 2, "OOM recovery did not halve the micro-batch"
    trainer.run.sizes.max_token_len_per_micro_batch = None
    trainer.plan.merge_micro_batches = False
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return grad.clone(), metrics


# Splits of a shared-prompt micro-batch compute a prompt's tokens once per micro-batch: their gradient is summed over
# the prompt's rows before transformers' RMSNorm rounds it to fp32 (it normalises in fp32 even for fp64 weights), so
# splits agree to fp32 rounding there and to fp64 rounding with packed rows (each row has its own prompt copy)
TOLERANCES = {"packed": dict(rtol=1e-6, atol=1e-9), "shared": dict(rtol=1e-5, atol=1e-7)}


@pytest.fixture(params=["packed", "shared"])
def layout(request, trainer_and_batch):
    """Micro-batches as packed rows or as shared-prompt streams (plan.share_prompts; the model's attention function
    serves both)."""
    trainer, _ = trainer_and_batch
    assert trainer.plan.share_prompts, "n = 2 samples per prompt: the planner shares prompts"
    trainer.plan.share_prompts = request.param == "shared"
    yield request.param
    trainer.plan.share_prompts = True


@pytest.mark.parametrize("mode", algo.LOSS_AGG_MODES)
@pytest.mark.parametrize("which", ["actor", "critic"])
def test_gradient_does_not_depend_on_the_split(trainer_and_batch, which, mode, layout):
    trainer, batch = trainer_and_batch
    section = trainer.cfg.actor_rollout_ref.actor if which == "actor" else trainer.cfg.critic
    section.loss_agg_mode = mode
    model = trainer.actor if which == "actor" else trainer.critic
    loss_fn = (actor_loss(batch, section, trainer.cfg.actor_rollout_ref.rollout, trainer.plan.logprob_chunk_size, "cpu")
               if which == "actor" else critic_loss(batch, section, "cpu"))
    reference, ref_metrics = _gradient(trainer, model, loss_fn, batch, size=batch.rows)
    assert reference.abs().max() > 0
    longest = int((batch.rollout.prompt_mask.sum(-1) + batch.mask.sum(-1)).max())
    splits = {"micro 1": dict(size=1), "micro 2": dict(size=2), "micro 3": dict(size=3),
              "token budget": dict(size=longest + 4, token_budget=True),
              "OOM halved": dict(size=batch.rows, fail_first=True),
              "token budget, OOM halved": dict(size=4 * longest, token_budget=True, fail_first=True),
              "3-row bound, short rows merged": dict(size=3, merge=True),
              "3-row bound merged, OOM halved": dict(size=3, merge=True, fail_first=True)}
    trainer.plan.merge_micro_batches = True
    merged = trainer.updater.micro_batches(batch, list(range(batch.rows)), 3)
    trainer.plan.merge_micro_batches = False
    assert len(merged) == 2  # 4 + 4 rows where 3-row micro-batches make 3: a split of its own
    for name, kwargs in splits.items():
        grad, metrics = _gradient(trainer, model, loss_fn, batch, **kwargs)
        torch.testing.assert_close(grad, reference, **TOLERANCES[layout], msg=lambda m: f"{name}: {m}")
        loss_key = "pg_loss" if which == "actor" else "vf_loss"
        assert metrics[loss_key] == pytest.approx(ref_metrics[loss_key], rel=1e-6, abs=1e-9), name


@pytest.mark.parametrize("which", ["actor", "critic"])
def test_shared_prompts_give_the_packed_rows_gradient(trainer_and_batch, which):
    """The same mini-batch as packed rows and as shared-prompt streams (each prompt once): the same loss and
    gradient, micro-batches of whole groups and micro-batches that split a group alike."""
    trainer, batch = trainer_and_batch
    section = trainer.cfg.actor_rollout_ref.actor if which == "actor" else trainer.cfg.critic
    section.loss_agg_mode = "token-mean"
    model = trainer.actor if which == "actor" else trainer.critic
    loss_fn = (actor_loss(batch, section, trainer.cfg.actor_rollout_ref.rollout, trainer.plan.logprob_chunk_size, "cpu")
               if which == "actor" else critic_loss(batch, section, "cpu"))
    try:
        trainer.plan.share_prompts = False
        reference, ref_metrics = _gradient(trainer, model, loss_fn, batch, size=batch.rows)
        trainer.plan.share_prompts = True
        for size in (batch.rows, 3):
            grad, metrics = _gradient(trainer, model, loss_fn, batch, size=size)
            torch.testing.assert_close(grad, reference, **TOLERANCES["shared"], msg=lambda m: f"size {size}: {m}")
            loss_key = "pg_loss" if which == "actor" else "vf_loss"
            assert metrics[loss_key] == pytest.approx(ref_metrics[loss_key], rel=1e-6, abs=1e-9)
    finally:
        trainer.plan.share_prompts = True


@pytest.mark.parametrize("mode", algo.LOSS_AGG_MODES)
def test_gradient_does_not_depend_on_which_rank_holds_a_row(trainer_and_batch, mode, layout):
    """trainer.balance_batch moves rows between ranks: each rank's loss is its rows' share under the mini-batch's
    LossScale of all ranks' rows (DataParallel.loss_scales), and the ranks' gradients are summed. Two ranks as two
    shares: the contiguous layout and the length-balanced one give the gradient of the whole mini-batch."""
    from rlanywhere.balance import rows_after_balancing

    trainer, batch = trainer_and_batch
    trainer.cfg.actor_rollout_ref.actor.loss_agg_mode = mode
    model, optimizer = trainer.actor, trainer.optimizers["actor"]
    loss_fn = actor_loss(batch, trainer.cfg.actor_rollout_ref.actor, trainer.cfg.actor_rollout_ref.rollout,
                         trainer.plan.logprob_chunk_size, "cpu")
    trainer.run.sizes.set(SizeKind.ACTOR_MICRO_BATCH, 2)
    every = list(range(batch.rows))
    whole_scale = algo.LossScale.of(batch.mask, norm_length=trainer.response_length)

    def summed_gradient(layout):
        total = None
        for rows in layout:
            trainer.updater.accumulate(model, optimizer, batch, rows, 2, loss_fn, whole_scale)
            grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            total = grad.clone() if total is None else total + grad
        return total

    lengths = (batch.rollout.prompt_mask.sum(-1) + batch.mask.sum(-1)).long().tolist()
    balanced = rows_after_balancing(lengths, [4, 4])
    assert balanced != [every[:4], every[4:]]  # the lengths differ: balancing moves rows
    reference = summed_gradient([every])
    assert reference.abs().max() > 0
    for rank_rows in ([every[:4], every[4:]], balanced):
        torch.testing.assert_close(summed_gradient(rank_rows), reference, **TOLERANCES[layout],
                                   msg=lambda m, rank_rows=rank_rows: f"{rank_rows}: {m}")


def test_without_entropy_bonus_backward_skips_the_entropy(trainer_and_batch, monkeypatch):
    """entropy_coeff = 0: the entropy stays a metric (same value), its softmax math leaves backward (the head's
    backward gets no entropy gradient) and the gradient is the policy loss's alone; a bonus keeps it in."""
    from rlanywhere import logprobs

    trainer, batch = trainer_and_batch
    section = trainer.cfg.actor_rollout_ref.actor
    section.loss_agg_mode = "token-mean"
    seen = []
    backward = logprobs._ChunkedLogprobEntropy.backward

    def recording(ctx, grad_logprobs, grad_entropy):
        seen.append(grad_entropy is not None)
        return backward(ctx, grad_logprobs, grad_entropy)

    monkeypatch.setattr(logprobs._ChunkedLogprobEntropy, "backward", staticmethod(recording))
    rollout_cfg, chunk = trainer.cfg.actor_rollout_ref.rollout, trainer.plan.logprob_chunk_size
    results = {}
    try:
        for coeff in (0.0, 1e-300, 0.01):
            section.entropy_coeff = coeff
            seen.clear()
            grad, metrics = _gradient(trainer, trainer.actor, actor_loss(batch, section, rollout_cfg, chunk, "cpu"),
                                      batch, size=batch.rows)
            results[coeff] = (grad, metrics, list(seen))
    finally:
        section.entropy_coeff = 0.01
    assert results[0.0][2] == [False] and results[0.01][2] == [True]
    assert results[1e-300][2] == [True]
    # a bonus too small to move a weight: the same gradient as none, through the entropy's backward or without it
    torch.testing.assert_close(results[0.0][0], results[1e-300][0], rtol=1e-12, atol=0)
    assert not torch.equal(results[0.0][0], results[0.01][0])
    assert results[0.0][1]["entropy"] == pytest.approx(results[0.01][1]["entropy"], rel=1e-12)


@pytest.mark.parametrize("loss_mode", ["gspo", "geo_mean"])
def test_sequence_metrics_do_not_depend_on_the_split(trainer_and_batch, loss_mode):
    """GSPO's and geo_mean's ratio_mean (a mean over sequences) and the sequence-level correction's shares of
    capped and low rows are weighted by each micro-batch's rows, not its tokens: the logged values are the whole
    mini-batch's, however it is split (rows of 1 to 12 tokens here)."""
    trainer, batch = trainer_and_batch
    section = trainer.cfg.actor_rollout_ref.actor
    section.policy_loss.loss_mode, section.loss_agg_mode = loss_mode, "token-mean"
    saved = batch.rollout.response_logprobs
    gen = torch.Generator().manual_seed(1)
    batch.rollout.response_logprobs = (batch.old_logprobs + 0.2 * torch.randn(
        batch.mask.shape, generator=gen, dtype=torch.float64) * batch.mask).float()
    try:
        loss_fn = actor_loss(batch, section, trainer.cfg.actor_rollout_ref.rollout, trainer.plan.logprob_chunk_size,
                             "cpu", correction=RolloutCorrection("sequence", 1.1))
        whole = _gradient(trainer, trainer.actor, loss_fn, batch, size=batch.rows)[1]
        assert 0 < whole["rollout_is_capped_frac"] < 1 and 0 < whole["rollout_is_low_frac"] < 1
        for size in (1, 3):
            split = _gradient(trainer, trainer.actor, loss_fn, batch, size=size)[1]
            for key in ("ratio_mean", "rollout_is_capped_frac", "rollout_is_low_frac", "pg_loss"):
                assert split[key] == pytest.approx(whole[key], rel=1e-6), (size, key)
    finally:
        section.policy_loss.loss_mode = "vanilla"
        batch.rollout.response_logprobs = saved
