"""Pure tensor functions for RL post-training: advantages, KL estimators and controllers, losses.

Everything here works on plain torch tensors and holds no model or optimizer state, so it is easy to test and
to call from any trainer. Shapes follow verl's ``core_algos``:

* token-level tensors are ``[batch, response_len]`` (right-padded responses);
* ``mask`` is ``[batch, response_len]``, bool or float, 1 = real response token (EOS included), 0 = padding;
* sequence-level ``scores`` are ``[batch]``; ``group_index`` is ``[batch]`` and says which prompt each row
  answers (rows that share a value form a group, e.g. the ``n`` samples of one prompt).

Names and semantics match verl where verl defines them (advantage estimators ``gae``, ``grpo``, ``rloo``,
``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``; KL kinds ``kl``/``abs``/``mse``/``low_var_kl``;
loss aggregation modes ``token-mean``/``seq-mean-token-mean``/``seq-mean-token-sum``/``seq-mean-token-sum-norm``).
Where we deliberately differ from verl the docstring says so.

Metric dicts hold plain Python floats so they can go straight to logging.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .vocabulary import STATISTICS_DTYPE, LossAggMode

# ----------------------------------------------------------------------------------------------------------------
# Masked statistics
# ----------------------------------------------------------------------------------------------------------------

_MASK_SUM_FLOOR = 1e-8  # only reached when the mask is empty; then the masked sum is 0 and the mean is 0


def _as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Return ``mask`` as a float tensor of ``like``'s dtype/device, checking it broadcasts to ``like``."""
    if mask.shape != like.shape:
        try:
            torch.broadcast_shapes(mask.shape, like.shape)
        except RuntimeError as err:
            raise ValueError(
                f"mask shape {tuple(mask.shape)} does not match tensor shape {tuple(like.shape)}; pass the "
                "response mask with the same [batch, response_len] shape as the token tensor"
            ) from err
    dtype = like.dtype if like.is_floating_point() else torch.get_default_dtype()
    return mask.to(device=like.device, dtype=dtype)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is 1 (all positions if ``dim`` is None, else along ``dim``)."""
    mask = _as_float_mask(mask, x)
    if dim is None:
        return (x * mask).sum()
    return (x * mask).sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over masked positions; an empty mask (or empty row when ``dim`` is given) gives 0."""
    mask = _as_float_mask(mask, x)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=_MASK_SUM_FLOOR)
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=_MASK_SUM_FLOOR)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all masked positions (Bessel-corrected when ``unbiased``, like ``torch.var``)."""
    mask = _as_float_mask(mask, x)
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(
                f"masked_var(unbiased=True) needs at least 2 masked elements, got {float(count):g}; use a batch "
                "with more response tokens or pass unbiased=False"
            )
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over masked positions (verl's ``masked_whiten``).

    With ``shift_mean=False`` the original mean is added back (only the scale changes). Values at padded
    positions are transformed too but carry no meaning; callers multiply by the mask.
    """
    mean = masked_mean(x, mask)
    variance = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


# ----------------------------------------------------------------------------------------------------------------
# Helpers shared by the advantage estimators
# ----------------------------------------------------------------------------------------------------------------


def _check_token_tensors(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be [batch, response_len], got shape {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but mask has {tuple(mask.shape)}; token-level tensors "
                "must be [batch, response_len] like the response mask"
            )


def _check_scores(scores: torch.Tensor, mask: torch.Tensor) -> None:
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(
            f"scores must be [batch] = [{mask.shape[0]}] (one number per response), got {tuple(scores.shape)}; "
            "sum token rewards over the last dim to get per-sequence scores"
        )


def _group_ids(group_index, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels (tensor, ndarray or list of ints/strings) to dense ids ``0..G-1``."""
    if isinstance(group_index, torch.Tensor):
        labels = group_index.detach().cpu().reshape(-1).tolist()
    elif isinstance(group_index, np.ndarray):
        labels = group_index.reshape(-1).tolist()
    else:
        labels = list(group_index)
    if len(labels) != batch_size:
        raise ValueError(
            f"group_index has {len(labels)} entries but the batch has {batch_size} rows; pass one group label "
            "(the prompt's index/uid) per response row"
        )
    dense: dict = {}
    ids = [dense.setdefault(label, len(dense)) for label in labels]
    return torch.tensor(ids, dtype=torch.long, device=device), len(dense)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int):
    """Per-row group size, group sum and group sum of squared deviations from the group mean."""
    zeros = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
    group_size = zeros.index_add(0, group_ids, torch.ones_like(scores))
    group_sum = zeros.index_add(0, group_ids, scores)
    group_mean = group_sum / group_size
    squared_dev = zeros.index_add(0, group_ids, (scores - group_mean[group_ids]) ** 2)
    return group_size[group_ids], group_sum[group_ids], squared_dev[group_ids]


def _sequence_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Accept ``[batch]`` scores or ``[batch, T]`` token rewards (summed over real tokens) and return ``[batch]``."""
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.dim() == 2:
        _check_token_tensors(mask, token_rewards=rewards)
        return masked_sum(rewards, mask, dim=-1)
    _check_scores(rewards, mask)
    return rewards


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on the last real token of its row; every other position gets 0.

    Works for any padding layout (the last position where ``mask`` is 1 is used). A row with no real token
    cannot carry its score and raises ``ValueError``.
    """
    _check_token_tensors(mask)
    _check_scores(scores, mask)
    real = mask.bool()
    empty_rows = (~real.any(dim=-1)).nonzero().flatten().tolist()
    if empty_rows:
        raise ValueError(
            f"rows {empty_rows[:10]} of the response mask have no real token, so their score has nowhere to go; "
            "every response must contain at least one token (EOS counts)"
        )
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(real)
    last_index = torch.where(real, positions, -1).max(dim=-1).values
    token_rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    token_rewards[torch.arange(mask.shape[0], device=mask.device), last_index] = scores
    return token_rewards


def _discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go over real tokens only: padding is skipped (its reward ignored, the running return carried)."""
    mask_f = _as_float_mask(mask, token_rewards)
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        running = mask_f[:, t] * (token_rewards[:, t] + gamma * running) + (1 - mask_f[:, t]) * running
        returns[:, t] = running
    return returns * mask_f


# ----------------------------------------------------------------------------------------------------------------
# Advantage estimators
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_gae_advantages(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over response tokens (PPO with a critic).

    ``delta_t = r_t + gamma * V_{next} - V_t`` and ``A_t = delta_t + gamma * lam * A_{next}``, where "next" is
    the next *real* token: padded positions are skipped (their reward and value are ignored), so the bootstrap
    after the last real token is 0. ``returns = A + V`` uses the raw advantages (the critic's target); the
    advantages are then whitened over all real tokens of the batch, as verl does. Both are 0 at padding.
    """
    _check_token_tensors(mask, token_rewards=token_rewards, values=values)
    values = values.to(token_rewards.dtype)
    mask_f = _as_float_mask(mask, values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        real = mask_f[:, t]
        # at padding keep carrying the values from the next real token
        next_value = real * values[:, t] + (1 - real) * next_value
        next_advantage = real * advantage_t + (1 - real) * next_advantage
        advantages[:, t] = next_advantage
    returns = (advantages + values) * mask_f
    advantages = masked_whiten(advantages, mask_f) * mask_f
    return advantages, returns


@torch.no_grad()
def compute_grpo_advantages(
    scores: torch.Tensor,
    group_index,
    mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage: ``(score - group mean) / (group std + eps)`` broadcast to every real token.

    The group std is unbiased (``torch.std``). ``norm_by_std=False`` gives Dr.GRPO-style ``score - group mean``.
    A group with a single response has no baseline: as in verl, its mean counts as 0 and its std as 1, so it keeps
    its raw score. Returns ``(advantages, advantages)`` like verl.
    """
    scores = _sequence_scores(scores, mask)
    group_ids, num_groups = _group_ids(group_index, scores.shape[0], scores.device)
    size, total, squared_dev = _group_stats(scores, group_ids, num_groups)
    alone = size < 2
    centered = scores - torch.where(alone, torch.zeros_like(total), total / size)
    if norm_by_std:
        std = torch.sqrt(squared_dev / (size - 1).clamp(min=1))
        centered = centered / (torch.where(alone, torch.ones_like(std), std) + eps)
    advantages = centered.unsqueeze(-1) * mask.to(device=centered.device, dtype=centered.dtype)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_advantages(scores: torch.Tensor, group_index, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: ``score_i - mean(scores of the other responses in the group)``, broadcast to real tokens.

    A group of one has no other response and keeps its raw score, as in verl. Returns ``(advantages, advantages)``.
    """
    scores = _sequence_scores(scores, mask)
    group_ids, num_groups = _group_ids(group_index, scores.shape[0], scores.device)
    size, total, _ = _group_stats(scores, group_ids, num_groups)
    others_mean = (total - scores) / (size - 1).clamp(min=1)
    advantage = torch.where(size > 1, scores - others_mean, scores)
    advantages = advantage.unsqueeze(-1) * mask.to(device=advantage.device, dtype=advantage.dtype)
    return advantages, advantages


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go per token, whitened over the batch's real tokens.

    Returns ``(whitened advantages, raw returns)`` as verl does; both are 0 at padding.
    """
    _check_token_tensors(mask, token_rewards=token_rewards)
    returns = _discounted_returns(token_rewards, mask, gamma)
    mask_f = _as_float_mask(mask, returns)
    advantages = masked_whiten(returns, mask_f) * mask_f
    return advantages, returns


@torch.no_grad()
def compute_reinforce_plus_plus_baseline_advantages(
    rewards: torch.Tensor, group_index, mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (verl): subtract the group mean of the scores, then whiten over the batch.

    ``rewards`` is either ``[batch]`` scores or ``[batch, T]`` token rewards (summed per row). The centred
    score sits on the last real token and is turned into a return-to-go with ``gamma`` (``gamma=1``, verl's
    behaviour, gives the same centred score on every real token). A group of one is centred on a mean of 0 (it keeps
    its raw score before whitening), as in verl. Returns ``(advantages, advantages)`` like verl.
    """
    scores = _sequence_scores(rewards, mask)
    group_ids, num_groups = _group_ids(group_index, scores.shape[0], scores.device)
    size, total, _ = _group_stats(scores, group_ids, num_groups)
    centered = scores - torch.where(size > 1, total / size, torch.zeros_like(total))
    returns = _discounted_returns(scores_to_token_rewards(centered, mask), mask, gamma)
    mask_f = _as_float_mask(mask, returns)
    advantages = masked_whiten(returns, mask_f) * mask_f
    return advantages, advantages


# ----------------------------------------------------------------------------------------------------------------
# The estimator registry: one decorated function per estimator, carrying what it needs from the run
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs from the run besides the scores (the planner and trainer read these).

    * ``groups``: several responses per prompt (``group_index``), compared with each other;
    * ``critic``: a value model (``values``);
    * ``greedy_baseline``: the score of one greedy response per prompt (``baselines``, ReMax).
    """

    groups: bool = False
    critic: bool = False
    greedy_baseline: bool = False


@dataclass(frozen=True)
class RegisteredEstimator:
    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    needs: EstimatorNeeds

    def __call__(self, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(**kwargs)


# verl's algorithm.adv_estimator name -> estimator; every function takes the dispatcher's keyword arguments
# (token_rewards, outcome, values, mask, group_index, baselines, gamma, lam, norm_adv_by_std_in_grpo) and ignores
# the ones it does not use
ADVANTAGE_ESTIMATORS: dict[str, RegisteredEstimator] = {}


def register_adv_est(name: str, *, groups: bool = False, critic: bool = False, greedy_baseline: bool = False):
    """Register an advantage estimator under its ``algorithm.adv_estimator`` name (verl's ``register_adv_est``),
    with what it needs. Registering a name twice is an error."""

    def decorator(fn):
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered ({ADVANTAGE_ESTIMATORS[name].fn})")
        ADVANTAGE_ESTIMATORS[name] = RegisteredEstimator(
            name, fn, EstimatorNeeds(groups=groups, critic=critic, greedy_baseline=greedy_baseline))
        return fn

    return decorator


def kl_penalty_in_reward(algorithm: Any) -> bool:
    """Whether a KL penalty is folded into the reward (the `algorithm` config section's use_kl_in_reward): on, with a
    positive coefficient. At 0 it adds nothing, and an adaptive controller that starts at 0 stays there (it scales
    the value), so no reference or old-policy forward is run for it."""
    return bool(algorithm.use_kl_in_reward) and float(algorithm.kl_ctrl.kl_coef) > 0


def several_optimizer_steps(actor: Any, prompts: int) -> bool:
    """Whether the actor's update of a step of `prompts` prompts (over all ranks) takes more than one optimizer step
    (`actor`: the actor_rollout_ref.actor config section): then the policy moves during the update, and the old
    policy's log-probs are not the update's own first forward."""
    return int(actor.ppo_epochs) > 1 or int(actor.ppo_mini_batch_size) < int(prompts)


def estimator_needs(name: str) -> EstimatorNeeds:
    """What the estimator ``name`` needs (a ValueError naming the valid ones for an unknown name)."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADVANTAGE_ESTIMATORS)} "
                         "(set algorithm.adv_estimator)")
    return ADVANTAGE_ESTIMATORS[name].needs


@register_adv_est("gae", critic=True)
def _gae_from_kwargs(*, token_rewards, values, mask, gamma, lam, **_):
    if values is None:
        raise ValueError("advantage estimator 'gae' needs critic values; enable the critic or pick grpo/rloo")
    return compute_gae_advantages(token_rewards, values, mask, gamma, lam)


@register_adv_est("grpo", groups=True)
def _grpo_from_kwargs(*, outcome, group_index, mask, norm_adv_by_std_in_grpo, **_):
    return compute_grpo_advantages(outcome, group_index, mask, norm_by_std=norm_adv_by_std_in_grpo)


@register_adv_est("rloo", groups=True)
def _rloo_from_kwargs(*, outcome, group_index, mask, **_):
    return compute_rloo_advantages(outcome, group_index, mask)


@register_adv_est("reinforce_plus_plus")
def _rpp_from_kwargs(*, token_rewards, mask, gamma, **_):
    return compute_reinforce_plus_plus_advantages(token_rewards, mask, gamma)


@register_adv_est("reinforce_plus_plus_baseline", groups=True)
def _rpp_baseline_from_kwargs(*, outcome, group_index, mask, gamma, **_):
    return compute_reinforce_plus_plus_baseline_advantages(outcome, group_index, mask, gamma)


@register_adv_est("remax", greedy_baseline=True)
@torch.no_grad()
def compute_remax_advantages(*, token_rewards, baselines, mask, **_) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023; verl's ``remax``): the return-to-go (undiscounted) minus the score of a greedy
    response to the same prompt, on every real token. ``baselines`` is ``[batch]``: each row's prompt's greedy
    score. Returns ``(advantages, returns)``; advantages are not whitened, as in verl."""
    if baselines is None:
        raise ValueError("advantage estimator 'remax' needs baselines [batch]: the score of a greedy response to "
                         "each row's prompt")
    _check_scores(baselines, mask)
    mask_f = _as_float_mask(mask, token_rewards)
    returns = (token_rewards * mask_f).flip(-1).cumsum(-1).flip(-1)
    advantages = returns - baselines.to(returns).unsqueeze(-1) * mask_f
    return advantages, returns


@register_adv_est("gpg", groups=True)
@torch.no_grad()
def compute_gpg_advantages(*, outcome, group_index, mask, f_norm: float = 1.0, **_) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """GPG (Chu et al. 2025; verl's ``gpg``): ``alpha * (score - group mean) / f_norm`` on every real token, with
    ``alpha = batch rows / rows whose score is not 0`` (a correction for the rows that carry no signal). A group of
    one is centred on 0, as in verl. Returns ``(advantages, advantages)``."""
    scores = outcome
    group_ids, num_groups = _group_ids(group_index, scores.shape[0], scores.device)
    size, total, _ = _group_stats(scores, group_ids, num_groups)
    mean = torch.where(size > 1, total / size, torch.zeros_like(total))
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    advantage = alpha * (scores - mean) / f_norm
    advantages = advantage.unsqueeze(-1) * mask.to(device=advantage.device, dtype=advantage.dtype)
    return advantages, advantages


def compute_advantages(
    estimator: str,
    *,
    mask: torch.Tensor,
    scores: torch.Tensor | None = None,
    token_rewards: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    group_index=None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch to an advantage estimator by its verl name; returns ``(advantages, returns)``, both ``[batch, T]``.

    Give ``token_rewards`` (``[batch, T]``, e.g. scores on the last token minus an in-reward KL penalty) and/or
    ``scores`` (``[batch]``). Outcome estimators (grpo, rloo, reinforce_plus_plus_baseline) use
    ``token_rewards.sum(-1)`` when token rewards are given, as verl does, so a KL-in-reward penalty is included;
    otherwise ``scores``. Token estimators (gae, reinforce_plus_plus) use ``token_rewards``, built from
    ``scores`` with :func:`scores_to_token_rewards` when only scores are given. ``baselines`` (``[batch]``) is
    each row's prompt's greedy-response score, for estimators registered with ``greedy_baseline`` (remax).
    """
    needs = estimator_needs(estimator)
    if scores is None and token_rewards is None:
        raise ValueError("compute_advantages needs scores [batch] or token_rewards [batch, T]; got neither")
    if needs.groups and group_index is None:
        raise ValueError(
            f"advantage estimator {estimator!r} compares responses to the same prompt and needs group_index "
            "(one prompt id per row)"
        )
    # Statistics in float64: squares of rewards near 1e20 overflow fp32 and a group's std becomes inf (GRPO and
    # REINFORCE++ advantages then collapse to exactly 0). Results come back in the caller's dtype.
    given = token_rewards if token_rewards is not None else scores
    out_dtype = given.dtype if given.is_floating_point() else torch.get_default_dtype()
    if token_rewards is None:
        token_rewards = scores_to_token_rewards(scores.to(STATISTICS_DTYPE), mask)
    token_rewards = token_rewards.to(STATISTICS_DTYPE)
    values = values.to(STATISTICS_DTYPE) if values is not None else None
    outcome = masked_sum(token_rewards, mask, dim=-1)
    _warn_if_rewards_are_huge(outcome)
    advantages, returns = ADVANTAGE_ESTIMATORS[estimator](
        token_rewards=token_rewards,
        outcome=outcome,
        values=values,
        mask=mask,
        group_index=group_index,
        gamma=gamma,
        lam=lam,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        baselines=baselines.to(STATISTICS_DTYPE) if baselines is not None else None,
    )
    return advantages.to(out_dtype), returns.to(out_dtype)


HUGE_REWARD = 1e6  # beyond this, unnormalised advantages (rloo, gae) put the reward's scale into the gradient


def _warn_if_rewards_are_huge(outcome: torch.Tensor) -> None:
    largest = float(outcome.abs().max()) if outcome.numel() else 0.0
    if largest > HUGE_REWARD:
        # warnings shows a message once per place: once per run here
        warnings.warn(
            f"rewards as large as {largest:.3g}: advantage statistics are computed in float64, but estimators that do "
            "not normalise (rloo, gae's returns) carry that scale into the loss and can overflow the gradient; "
            "rescale the reward function (e.g. to [-1, 1])",
            RuntimeWarning,
            stacklevel=3,
        )


# ----------------------------------------------------------------------------------------------------------------
# KL estimators and controllers
# ----------------------------------------------------------------------------------------------------------------

# accepted names -> canonical estimator (Schulman's k1/k2/k3 and verl's names)
_KL_KINDS = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}


# every name kl_penalty takes: verl's, and each with a trailing "+" (the k2 gradient, straight-through)
KL_ESTIMATORS = tuple(sorted(_KL_KINDS)) + tuple(name + "+" for name in sorted(_KL_KINDS))


def _kl_forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, canonical: str) -> torch.Tensor:
    log_ratio = logprob - ref_logprob
    if canonical == "k1":
        return log_ratio
    if canonical == "abs":
        return log_ratio.abs()
    if canonical == "k2":
        return 0.5 * log_ratio.square()
    # k3 = r - log r - 1 with r = pi_ref / pi; clamps as in verl keep exp() finite and the estimate bounded
    ref_log_ratio = torch.clamp(-log_ratio, min=-20, max=20)
    return torch.clamp(ref_log_ratio.exp() - ref_log_ratio - 1, min=-10, max=10)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.

    ``kind``: ``"kl"``/``"k1"`` (log-ratio), ``"abs"`` (|log-ratio|), ``"mse"``/``"k2"`` (0.5 * log-ratio^2),
    ``"low_var_kl"``/``"k3"`` (``r - log r - 1``, ``r = pi_ref/pi``, clamped to [-10, 10] like verl).
    A trailing ``"+"`` (e.g. ``"k3+"``) keeps that estimator's value but uses the k2 gradient (straight-through),
    which is an unbiased KL gradient — verl's convention.
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base not in _KL_KINDS:
        valid = sorted(_KL_KINDS) + [name + "+" for name in sorted(_KL_KINDS)]
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {valid}")
    canonical = _KL_KINDS[base]
    value = _kl_forward(logprob, ref_logprob, canonical)
    if not straight_through or canonical == "k2":
        return value
    k2 = _kl_forward(logprob, ref_logprob, "k2")
    return k2 - k2.detach() + value.detach()


class FixedKLController:
    """Constant KL coefficient (``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the coefficient is the configuration's (a resume may change it)."""


class AdaptiveKLController:
    """Proportional KL controller of Ziegler et al. (2019), as in verl (``algorithm.kl_ctrl.type=adaptive``).

    ``update`` moves the coefficient by ``1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon``: above the
    target KL it grows, below it shrinks. ``n_steps`` is the number of samples since the last update.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"adaptive KL controller needs target_kl > 0 and horizon > 0, got target_kl={target_kl}, "
                f"horizon={horizon}; set algorithm.kl_ctrl.target_kl / horizon"
            )
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(float(current_kl) / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        """The adapted coefficient; target and horizon are the configuration's (a resume may change them)."""
        self.value = float(state["value"])


def make_kl_controller(
    type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` (``"fixed"`` or ``"adaptive"``)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {type!r}; valid: ['adaptive', 'fixed'] (algorithm.kl_ctrl.type)")


@torch.no_grad()
def apply_kl_in_reward(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
    update_controller: bool = True,
) -> tuple[torch.Tensor, dict]:
    """Subtract ``beta * KL`` from the token scores (``algorithm.use_kl_in_reward``), as verl's ``apply_kl_penalty``.

    ``beta`` is ``kl_ctrl.value`` before this call. The batch KL (per-sequence token mean, then batch mean) is
    reported and, with ``update_controller``, fed to ``kl_ctrl.update(kl, n_steps=batch)``.
    Metrics: ``actor/reward_kl_penalty``, ``actor/reward_kl_penalty_coeff``.
    """
    _check_token_tensors(mask, token_level_scores=token_level_scores, logprob=logprob, ref_logprob=ref_logprob)
    mask_f = _as_float_mask(mask, token_level_scores)
    kl = kl_penalty(logprob, ref_logprob, kind).to(token_level_scores.dtype) * mask_f
    beta = kl_ctrl.value
    token_rewards = token_level_scores - beta * kl
    current_kl = masked_mean(kl, mask_f, dim=-1).mean().item()
    if update_controller:
        kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    return token_rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


# ----------------------------------------------------------------------------------------------------------------
# Loss aggregation and losses
# ----------------------------------------------------------------------------------------------------------------

LOSS_AGG_MODES = LossAggMode.values()
GSPO_LOSS_AGG_MODE = LossAggMode.SEQ_MEAN_TOKEN_MEAN  # GSPO's policy loss, whatever actor.loss_agg_mode says (as verl)


@dataclass(frozen=True)
class LossScale:
    """The denominators of a loss over a whole mini-batch, fixed before it is split into micro-batches.

    With these, each micro-batch's ``aggregate_loss`` is its exact share of the mini-batch loss, so summing the
    micro-batch losses (gradient accumulation) gives the same value and gradient however the mini-batch is split
    (micro-batch size, token budget, OOM halving) — verl's global batch info, TRL's ``num_items_in_batch``.

    * ``tokens``: real (mask = 1) tokens in the mini-batch;
    * ``sequences``: rows with at least one real token;
    * ``norm_length``: the constant ``T`` of ``seq-mean-token-sum-norm`` — the configured response length, one
      number for the whole run (not the width of whichever micro-batch was trimmed to its longest row).

    Under data parallelism the counts are the sums over all ranks (see ``merged``).
    """

    tokens: float
    sequences: float
    norm_length: float

    @classmethod
    def of(cls, mask: torch.Tensor, norm_length: float | None = None) -> "LossScale":
        """The scale of the rows in ``mask`` alone; ``norm_length`` defaults to the mask's width."""
        _check_token_tensors(mask)
        per_row = mask.to(STATISTICS_DTYPE).sum(dim=-1)
        width = mask.shape[-1] if norm_length is None else norm_length
        return cls(tokens=float(per_row.sum()), sequences=float((per_row > 0).sum()), norm_length=float(width))

    def merged(self, other: "LossScale") -> "LossScale":
        """Counts of two disjoint sets of rows (e.g. two ranks' shares); ``norm_length`` must agree."""
        if other.norm_length != self.norm_length:
            raise ValueError(f"norm_length differs: {self.norm_length} vs {other.norm_length}")
        return LossScale(self.tokens + other.tokens, self.sequences + other.sequences, self.norm_length)


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", scale: LossScale | None = None
) -> torch.Tensor:
    """Reduce a ``[batch, T]`` per-token loss to a scalar (verl's ``agg_loss``; semantics of verl >= PR #5417).

    With ``N`` non-empty sequences, ``n_i`` real tokens in row ``i``, ``s_i`` = row ``i``'s token sum:

    * ``token-mean``: ``sum_i s_i / sum_i n_i`` (every token weighs the same; DAPO's token-level loss);
    * ``seq-mean-token-mean``: ``mean_i (s_i / n_i)`` (GRPO paper);
    * ``seq-mean-token-sum``: ``mean_i s_i``;
    * ``seq-mean-token-sum-norm``: ``mean_i (s_i / T)`` with a constant ``T`` (Dr. GRPO's ``MAX_TOKENS``).

    Rows with no real token are left out. ``scale`` supplies the denominators (tokens, ``N``, ``T``) of the whole
    mini-batch this slice belongs to: then the slices' losses sum to the mini-batch loss. Without it they are
    those of ``mask`` itself (``T`` = the mask's width).
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {list(LOSS_AGG_MODES)} (actor.loss_agg_mode)")
    _check_token_tensors(mask, loss_mat=loss_mat)
    if scale is None:
        scale = LossScale.of(mask)
    mask_f = _as_float_mask(mask, loss_mat)
    seq_sums = (loss_mat * mask_f).sum(dim=-1)
    if mode == "token-mean":
        return seq_sums.sum() / max(scale.tokens, _MASK_SUM_FLOOR)
    sequences = max(scale.sequences, _MASK_SUM_FLOOR)
    if mode == "seq-mean-token-sum-norm":
        return seq_sums.sum() / scale.norm_length / sequences
    if mode == "seq-mean-token-sum":
        return seq_sums.sum() / sequences
    seq_tokens = mask_f.sum(dim=-1)  # seq-mean-token-mean: empty rows have s_i = 0 and stay out
    return (seq_sums / seq_tokens.clamp(min=_MASK_SUM_FLOOR)).sum() / sequences


# verl's actor.policy_loss.loss_mode -> policy loss; every entry takes ppo_policy_loss's arguments
# (old_logprob, logprob, advantages, mask, clip_ratio_low, clip_ratio_high, clip_ratio_c, loss_agg_mode, scale)
# and returns (loss, metrics) with the same metric names
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict]]] = {}
# the metrics each loss reports as means over sequences, not tokens (the update weighs them by its rows)
SEQUENCE_METRICS: dict[str, tuple[str, ...]] = {}


def register_policy_loss(name: str, sequence_metrics: tuple[str, ...] = ()):
    """Register a policy loss under its ``actor.policy_loss.loss_mode`` name (verl's ``register_policy_loss``).
    sequence_metrics: those of its metrics that are means over the sequences (rows), not over the tokens."""

    def decorator(fn):
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered ({POLICY_LOSSES[name]})")
        POLICY_LOSSES[name] = fn
        SEQUENCE_METRICS[name] = tuple(sequence_metrics)
        return fn

    return decorator


@register_policy_loss("vanilla")
def ppo_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    scale: LossScale | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate loss with dual clip (verl's vanilla ``compute_policy_loss``).

    ``ratio = exp(logprob - old_logprob)`` (log-ratio clamped to [-20, 20]); per token
    ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``, and for ``A < 0`` additionally capped at
    ``-A * clip_ratio_c`` (dual clip, Ye et al. 2020; ``None`` disables). ``clip_ratio_high=None`` means
    ``clip_ratio_low`` (symmetric clip). Gradients flow through ``logprob`` only. ``token_weights`` (the rollout
    correction's truncated importance weights, constants) multiply each token's loss before aggregation.

    Metrics, as 0-d tensors on the loss's device (read once per optimizer step, not once per micro-batch):
    ``pg_clipfrac`` (fraction of tokens where the clipped term is active), ``pg_clipfrac_lower`` (dual-clip
    active), ``ppo_kl`` = ``approx_kl`` (token mean of old - new log-prob), ``ratio_mean``, ``ratio_max``.
    """
    _check_token_tensors(mask, old_logprob=old_logprob, logprob=logprob, advantages=advantages)
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(
            f"dual-clip constant clip_ratio_c must be > 1.0, got {clip_ratio_c}; use e.g. 3.0 or None to disable"
        )
    mask_f = _as_float_mask(mask, logprob)
    log_ratio = torch.clamp(logprob - old_logprob.detach(), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_loss = torch.maximum(unclipped, clipped)
    clipfrac = masked_mean(torch.gt(clipped, unclipped).to(mask_f.dtype), mask_f)

    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        negative = advantages < 0
        pg_losses = torch.where(negative, torch.minimum(clipped_loss, dual_bound), clipped_loss)
        clipfrac_lower = masked_mean((torch.gt(clipped_loss, dual_bound) & negative).to(mask_f.dtype), mask_f)
    else:
        pg_losses = clipped_loss
        clipfrac_lower = torch.zeros((), dtype=mask_f.dtype, device=mask_f.device)

    if token_weights is not None:  # the rollout correction's importance weights (rollout_correction.py)
        pg_losses = pg_losses * token_weights.detach()
    pg_loss = aggregate_loss(pg_losses, mask_f, loss_agg_mode, scale)
    with torch.no_grad():
        approx_kl = masked_mean(-log_ratio, mask_f)
        metrics = {
            "pg_clipfrac": clipfrac,
            "pg_clipfrac_lower": clipfrac_lower,
            "ppo_kl": approx_kl,
            "approx_kl": approx_kl,
            "ratio_mean": masked_mean(ratio, mask_f),
            "ratio_max": _masked_max(ratio, mask_f.bool()),
        }
    return pg_loss, metrics


def _masked_max(values: torch.Tensor, real: torch.Tensor, empty: float = 1.0) -> torch.Tensor:
    """The largest of `values` where `real`, `empty` when nothing is; a 0-d tensor computed without a host wait."""
    if values.numel() == 0:
        return torch.tensor(empty, dtype=values.dtype, device=values.device)
    largest = torch.where(real, values, torch.full_like(values, float("-inf"))).amax()
    return torch.where(real.any(), largest, torch.full_like(largest, empty))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict]:
    """Clipped critic loss ``0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)`` aggregated over real tokens.

    ``cliprange_value=None`` disables clipping. Metrics (0-d tensors on the loss's device): ``vf_clipfrac``
    (fraction where the clipped term is larger), ``vpred_mean``.
    """
    _check_token_tensors(mask, values=values, old_values=old_values, returns=returns)
    mask_f = _as_float_mask(mask, values)
    returns = returns.detach()
    unclipped = (values - returns) ** 2
    if cliprange_value is None:
        losses = unclipped
        clipfrac = torch.zeros((), dtype=mask_f.dtype, device=mask_f.device)
    else:
        old_values = old_values.detach()
        clipped_values = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
        clipped = (clipped_values - returns) ** 2
        losses = torch.maximum(unclipped, clipped)
        clipfrac = masked_mean(torch.gt(clipped, unclipped).to(mask_f.dtype), mask_f)
    loss = 0.5 * aggregate_loss(losses, mask_f, loss_agg_mode, scale)
    with torch.no_grad():
        metrics = {"vf_clipfrac": clipfrac, "vpred_mean": masked_mean(values, mask_f)}
    return loss, metrics


def entropy_loss(
    entropy: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str = "token-mean", scale: LossScale | None = None
) -> torch.Tensor:
    """Aggregated token entropy (positive). The actor loss is ``pg_loss - entropy_coeff * entropy_loss``."""
    return aggregate_loss(entropy, mask, loss_agg_mode, scale)


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    scale: LossScale | None = None,
) -> torch.Tensor:
    """KL(pi || pi_ref) as a loss term (``actor.use_kl_loss``); the actor adds ``kl_loss_coef * kl_loss``."""
    _check_token_tensors(mask, logprob=logprob, ref_logprob=ref_logprob)
    return aggregate_loss(kl_penalty(logprob, ref_logprob.detach(), kind), mask, loss_agg_mode, scale)


# ----------------------------------------------------------------------------------------------------------------
# Recipe variants: GSPO, DAPO's dynamic sampling and overlong shaping, masking truncated responses
# ----------------------------------------------------------------------------------------------------------------


@register_policy_loss("gspo", sequence_metrics=("ratio_mean",))
def gspo_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    scale: LossScale | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al. 2025): PPO clipping on a sequence-level importance ratio (verl's ``loss_mode=gspo``).

    ``s_i = exp(mean_t (logprob - old_logprob))`` over row ``i``'s real tokens: the length-normalised ratio of the
    whole response. Every token of row ``i`` carries the value ``s_i`` with the gradient of its own log-prob
    (GSPO-token: ``s_i * pi_t / sg(pi_t)``), and the clipped surrogate ``max(-A * s, -A * clip(s, 1 - low,
    1 + high))`` is applied per token, so a clipped sequence passes no gradient at all. The log-ratio is capped
    at 10 like verl. The paper's clip ranges are tiny (``clip_ratio_low=3e-4``, ``clip_ratio_high=4e-4``) because
    ``s_i`` is a geometric mean. Same arguments and return as :func:`ppo_policy_loss` so the trainer can call
    either; ``clip_ratio_c`` (dual clip) has no sequence-level counterpart and is not used, as in verl.

    The loss averages per sequence (``seq-mean-token-mean``) whatever ``loss_agg_mode`` says, as the GSPO paper and
    verl do (a length-weighted token mean would undo the sequence-level ratio's length normalisation); the entropy
    and KL terms still follow ``loss_agg_mode``. Metrics as :func:`ppo_policy_loss`, with ``ratio_mean``/``ratio_max`` over
    sequences and ``pg_clipfrac`` the token-weighted fraction of clipped sequences.
    """
    del clip_ratio_c  # no dual clip at sequence level
    _check_token_tensors(mask, old_logprob=old_logprob, logprob=logprob, advantages=advantages)
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    mask_f = _as_float_mask(mask, logprob)
    token_log_ratio = (logprob - old_logprob.detach()) * mask_f
    seq_log_ratio = token_log_ratio.sum(-1) / mask_f.sum(-1).clamp(min=1.0)
    # value: the sequence's log-ratio; gradient: this token's log-prob (the stop-gradient trick of GSPO-token)
    log_ratio = torch.clamp(logprob - logprob.detach() + seq_log_ratio.detach().unsqueeze(-1), max=10.0)
    ratio = torch.exp(log_ratio)
    advantages = advantages.detach()

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    if token_weights is not None:  # the rollout correction's importance weights (rollout_correction.py)
        pg_losses = pg_losses * token_weights.detach()
    pg_loss = aggregate_loss(pg_losses, mask_f, GSPO_LOSS_AGG_MODE, scale)
    with torch.no_grad():
        approx_kl = masked_mean(-token_log_ratio, mask_f)
        real_rows = mask_f.sum(-1) > 0
        seq_ratio = torch.exp(seq_log_ratio.clamp(max=10.0))
        metrics = {
            "pg_clipfrac": masked_mean(torch.gt(clipped, unclipped).to(mask_f.dtype), mask_f),
            "pg_clipfrac_lower": torch.zeros((), dtype=mask_f.dtype, device=mask_f.device),
            "ppo_kl": approx_kl,
            "approx_kl": approx_kl,
            "ratio_mean": torch.where(real_rows.any(), masked_mean(seq_ratio, real_rows),
                                      torch.ones((), dtype=seq_ratio.dtype, device=seq_ratio.device)),
            "ratio_max": _masked_max(seq_ratio, real_rows),
        }
    return pg_loss, metrics


def _token_ratio_metrics(log_ratio: torch.Tensor, mask_f: torch.Tensor, clipfrac: torch.Tensor,
                         clipfrac_lower: torch.Tensor | None = None) -> dict:
    """The metric dict every policy loss returns, from a token-level log-ratio (new - old)."""
    with torch.no_grad():
        approx_kl = masked_mean(-log_ratio, mask_f)
        ratio = torch.exp(log_ratio.clamp(min=-20.0, max=20.0))
        zero = torch.zeros((), dtype=mask_f.dtype, device=mask_f.device)
        return {"pg_clipfrac": clipfrac, "pg_clipfrac_lower": zero if clipfrac_lower is None else clipfrac_lower,
                "ppo_kl": approx_kl, "approx_kl": approx_kl, "ratio_mean": masked_mean(ratio, mask_f),
                "ratio_max": _masked_max(ratio, mask_f.bool())}


@register_policy_loss("gpg")
def gpg_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    scale: LossScale | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """GPG (Chu et al. 2025; verl's ``loss_mode=gpg``): plain policy gradient ``-A * logprob`` per token, no
    ratio and no clipping, aggregated by ``loss_agg_mode``. The clip arguments are accepted and not used; the ratio
    metrics still compare the update's policy with the one that sampled."""
    del clip_ratio_low, clip_ratio_high, clip_ratio_c
    _check_token_tensors(mask, old_logprob=old_logprob, logprob=logprob, advantages=advantages)
    mask_f = _as_float_mask(mask, logprob)
    per_token = -advantages.detach() * logprob
    if token_weights is not None:  # the rollout correction's importance weights (rollout_correction.py)
        per_token = per_token * token_weights.detach()
    pg_loss = aggregate_loss(per_token, mask_f, loss_agg_mode, scale)
    zero = torch.zeros((), dtype=mask_f.dtype, device=mask_f.device)
    return pg_loss, _token_ratio_metrics(logprob.detach() - old_logprob.detach(), mask_f, zero)


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    scale: LossScale | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """CISPO (MiniMax-M1, 2025; verl's ``loss_mode=cispo``): ``-sg(clip(ratio, 1 - low, 1 + high)) * A * logprob``.

    The importance weight is clipped and detached, so every token keeps a gradient (through its log-prob) scaled
    by at most ``1 + high``; PPO instead drops the gradient of a clipped token. The log-ratio is clamped to
    [-20, 20] like verl. ``pg_clipfrac`` is the fraction of tokens whose weight was clipped; no dual clip.
    """
    del clip_ratio_c
    _check_token_tensors(mask, old_logprob=old_logprob, logprob=logprob, advantages=advantages)
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    mask_f = _as_float_mask(mask, logprob)
    log_ratio = torch.clamp(logprob.detach() - old_logprob.detach(), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    per_token = -weight * advantages.detach() * logprob
    if token_weights is not None:  # the rollout correction's importance weights (rollout_correction.py)
        per_token = per_token * token_weights.detach()
    pg_loss = aggregate_loss(per_token, mask_f, loss_agg_mode, scale)
    clipfrac = masked_mean(torch.ne(ratio, weight).to(mask_f.dtype), mask_f)
    return pg_loss, _token_ratio_metrics(log_ratio, mask_f, clipfrac)


@register_policy_loss("geo_mean", sequence_metrics=("ratio_mean",))
def geo_mean_policy_loss(
    old_logprob: torch.Tensor,
    logprob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    scale: LossScale | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """GMPO (Zhao et al. 2025; verl's ``loss_mode=geo_mean``): the geometric mean of the token ratios per sequence.

    Per token the log-ratio is clipped to ``[-low, high]`` in log space on the side the advantage's sign makes
    pessimistic (``sign(A) * min(sign(A) * r, sign(A) * clip(r))``); a sequence's ratio is ``exp`` of the mean
    of those over its real tokens, its advantage the mean of its token advantages, its loss ``-A * ratio``; the loss
    is the mean over sequences (``loss_agg_mode`` is not used, as in verl; the mean is over the mini-batch's
    non-empty sequences via ``scale``, where verl averages each micro-batch's rows). Metrics as verl: clipped
    tokens with ``A > 0`` (``pg_clipfrac``) and with ``A < 0`` (``pg_clipfrac_lower``). ``token_weights`` (the
    rollout correction's) weigh a sequence's loss by their geometric mean over its real tokens, as verl.
    """
    del clip_ratio_c, loss_agg_mode
    _check_token_tensors(mask, old_logprob=old_logprob, logprob=logprob, advantages=advantages)
    if clip_ratio_high is None:
        clip_ratio_high = clip_ratio_low
    if scale is None:
        scale = LossScale.of(mask)
    mask_f = _as_float_mask(mask, logprob)
    advantages = advantages.detach()
    log_ratio = logprob - old_logprob.detach()
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    tokens = mask_f.sum(-1)
    seq_ratio = torch.exp((pessimistic * mask_f).sum(-1) / (tokens + 1e-8))
    seq_advantage = (advantages * mask_f).sum(-1) / (tokens + 1e-8)
    per_sequence = -seq_advantage * seq_ratio
    if token_weights is not None:  # the rollout correction's importance weights, per sequence
        log_weights = torch.log(token_weights.detach() + 1e-10) * mask_f
        per_sequence = per_sequence * torch.exp(log_weights.sum(-1) / (tokens + 1e-8))
    pg_loss = per_sequence.sum() / max(scale.sequences, _MASK_SUM_FLOOR)
    with torch.no_grad():
        clipped = torch.ne(log_ratio, clamped).to(mask_f.dtype)
        metrics = _token_ratio_metrics(log_ratio.detach(), mask_f,
                                       masked_mean(clipped * (advantages > 0).to(mask_f.dtype), mask_f),
                                       masked_mean(clipped * (advantages < 0).to(mask_f.dtype), mask_f))
        real_rows = tokens > 0
        metrics["ratio_mean"] = torch.where(real_rows.any(), masked_mean(seq_ratio.detach(), real_rows),
                                            torch.ones((), dtype=seq_ratio.dtype, device=seq_ratio.device))
        metrics["ratio_max"] = _masked_max(seq_ratio.detach(), real_rows)
    return pg_loss, metrics


def pf_ppo_resample(scores: torch.Tensor, method: str = "pow", weight_pow: float = 2.0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
    """Policy Filtration for PPO (Zhang et al. 2024; verl's ``algorithm.use_pf_ppo``): row indices ``[batch]``
    drawn with replacement, with weights from each row's score, so the update trains more on responses whose
    reward is more reliable.

    ``method``: ``pow`` (weight ``|score| ** weight_pow``), ``max_min`` (only the rows with the batch's highest or
    lowest score), ``max_random`` (0.4 for the highest score, 0.1 for the rest). Every weight gets ``1e-8`` so a
    batch of zero scores still draws (uniformly). ``generator`` seeds the draw.
    """
    scores = torch.as_tensor(scores).detach().reshape(-1).to(STATISTICS_DTYPE)
    if method == "pow":
        weights = scores.abs().pow(weight_pow)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"algorithm.pf_ppo.reweight_method={method!r} is not valid; choose pow, max_min or "
                         "max_random")
    weights = torch.clamp(weights + 1e-8, min=1e-8)
    return torch.multinomial(weights, scores.shape[0], replacement=True, generator=generator)


def informative_groups(metric: torch.Tensor, group_index) -> torch.Tensor:
    """DAPO's dynamic sampling filter (verl's ``algorithm.filter_groups``): which rows to keep, ``[batch]`` bool.

    A group whose ``metric`` (e.g. accuracy) is the same for every response has zero advantage under GRPO and
    teaches nothing, so its rows are dropped; groups with differing values are kept whole. A group of one is kept,
    as in verl (there is nothing to compare it with). Values are compared exactly (max == min), not through a
    floating-point std.
    """
    metric = torch.as_tensor(metric).detach().reshape(-1).to(STATISTICS_DTYPE)
    group_ids, num_groups = _group_ids(group_index, metric.shape[0], metric.device)
    group_max = torch.full((num_groups,), -math.inf, dtype=metric.dtype).scatter_reduce(0, group_ids, metric, "amax")
    group_min = torch.full((num_groups,), math.inf, dtype=metric.dtype).scatter_reduce(0, group_ids, metric, "amin")
    group_size = torch.zeros(num_groups, dtype=torch.long).index_add(0, group_ids, torch.ones_like(group_ids))
    keep_group = (group_max > group_min) | (group_size == 1)
    return keep_group[group_ids]


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (verl's ``reward_model.overlong_buffer``), a reward to add, ``[batch]``.

    Responses up to ``max_length - buffer_length`` tokens get 0; inside the buffer the penalty falls linearly to
    ``-penalty_factor`` at ``max_length``: ``min(0, -(length - (max_length - buffer_length)) / buffer_length *
    penalty_factor)``.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"overlong buffer length must be in 1..{max_length} (the response length limit), got {buffer_length}; "
            "set reward_model.overlong_buffer.len"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor must be >= 0, got {penalty_factor}")
    lengths = torch.as_tensor(lengths).to(torch.get_default_dtype())
    exceed = lengths - (max_length - buffer_length)
    return torch.clamp(-exceed / buffer_length * penalty_factor, max=0.0)


def truncated_rows(
    response_ids: torch.Tensor, mask: torch.Tensor, max_length: int, eos_ids: Sequence[int]
) -> torch.Tensor:
    """Rows cut off by the length limit, ``[batch]`` bool: ``max_length`` real tokens and the last one not an EOS.

    These are the responses TRL's ``mask_truncated_completions`` (DAPO's "overlong filtering") leaves out of the
    loss: their reward judges an answer that was never finished.
    """
    _check_token_tensors(mask, response_ids=response_ids)
    # the last real column (multi-turn masks have holes at tool results; a prefix mask gives its sum)
    columns = torch.arange(1, mask.shape[-1] + 1, device=mask.device)
    lengths = (mask.bool() * columns).amax(-1) if mask.shape[-1] else mask.to(torch.long).sum(-1)
    last = response_ids.gather(-1, (lengths - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ended_by_eos = torch.isin(last, torch.tensor(list(eos_ids), dtype=last.dtype, device=last.device))
    return (lengths >= max_length) & ~ended_by_eos


__all__: Sequence[str] = [
    "KL_ESTIMATORS",
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "scores_to_token_rewards",
    "compute_gae_advantages",
    "compute_grpo_advantages",
    "compute_rloo_advantages",
    "compute_reinforce_plus_plus_advantages",
    "compute_reinforce_plus_plus_baseline_advantages",
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "apply_kl_in_reward",
    "LOSS_AGG_MODES",
    "LossScale",
    "aggregate_loss",
    "ppo_policy_loss",
    "value_loss",
    "entropy_loss",
    "kl_loss",
    "gspo_policy_loss",
    "POLICY_LOSSES",
    "register_policy_loss",
    "register_adv_est",
    "estimator_needs",
    "EstimatorNeeds",
    "compute_remax_advantages",
    "compute_gpg_advantages",
    "gpg_policy_loss",
    "cispo_policy_loss",
    "geo_mean_policy_loss",
    "pf_ppo_resample",
    "informative_groups",
    "overlong_penalty",
    "truncated_rows",
]
