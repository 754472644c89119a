"""Two step-level pieces of verl's algorithms that need more than the advantage or loss functions: ReMax's greedy
baseline (one extra greedy response per prompt, scored like the samples) and PF-PPO's resampling of the step's
rows by their score before the updates. The math lives in algorithms.py; this module applies it to a step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from . import algorithms as algo
from .rollout.base import RolloutBatch
from .stepbatch import StepBatch

BASELINE_KEY = "reward_baseline"  # reward_info key of each row's greedy baseline score (moves with balanced rows)


def greedy_baseline_scores(rollouts: Any, items: list[dict], step: int) -> torch.Tensor:
    """ReMax's baseline: one greedy response per prompt, scored (and length-shaped) like the samples, ``[prompts]``
    (``rollouts``: the RolloutPhase, which calls this as part of its scoring).

    As verl's ``remax``: same prompts, ``do_sample=False``, the reward function's score of that response."""
    params = replace(rollouts.sampling_params(), temperature=0.0, top_k=0, top_p=1.0, n=1)
    greedy = rollouts.generate(items, params, rollouts.step_generator(step, salt=-1_000_003))
    scores, _, _ = rollouts.score(items, greedy, 1)
    buffer = rollouts.cfg.reward_model.overlong_buffer
    if buffer.enable:  # the baseline is shaped as the samples are, so the penalty does not become advantage
        scores = scores + algo.overlong_penalty(greedy.response_lengths(), rollouts.response_length, buffer.len,
                                                buffer.penalty_factor).to(scores.dtype)
    return scores


def row_baselines(rollouts: Any, items: list[dict], step: int, n: int) -> list[float]:
    """Each row's prompt's greedy score, rows in prompt order with n samples each."""
    return greedy_baseline_scores(rollouts, items, step).repeat_interleave(n).tolist()


def resample_rows(batch: StepBatch, rows: torch.Tensor) -> StepBatch:
    """The step's batch with its rows replaced by ``rows`` (indices, repeats allowed): every per-row field."""
    r = batch.rollout
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    index = rows.tolist()
    info = {key: [value[i] for i in index] if isinstance(value, list) and len(value) == batch.rows else value
            for key, value in batch.reward_info.items()}
    rollout = RolloutBatch(prompt_ids=r.prompt_ids[rows], prompt_mask=r.prompt_mask[rows],
                           response_ids=r.response_ids[rows], response_mask=r.response_mask[rows],
                           response_logprobs=r.response_logprobs[rows], num_prompts=r.num_prompts, n=r.n)
    return replace(batch, rollout=rollout, group_index=batch.group_index[rows], scores=batch.scores[rows],
                   reward_info=info, old_logprobs=pick(batch.old_logprobs), ref_logprobs=pick(batch.ref_logprobs),
                   values=pick(batch.values), token_rewards=pick(batch.token_rewards),
                   advantages=pick(batch.advantages), returns=pick(batch.returns), loss_mask=pick(batch.loss_mask))


def pf_ppo_batch(batch: StepBatch, pf_cfg, seed: int) -> StepBatch:
    """PF-PPO (algorithm.use_pf_ppo): the rows redrawn with replacement, weighted by their score (after the
    advantages are computed, as verl does, by the reward scores before any KL penalty); the draw is seeded by
    (trainer.seed, step)."""
    generator = torch.Generator().manual_seed(seed)
    rows = algo.pf_ppo_resample(batch.scores, pf_cfg.reweight_method, pf_cfg.weight_pow, generator)
    return resample_rows(batch, rows)
