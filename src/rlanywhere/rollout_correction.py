"""Off-policy correction between the rollout engine's policy and the trainer's: truncated importance sampling (TIS).

The responses a step trains on were sampled by the rollout engine. Its per-token log-probs (`response_logprobs`,
the behaviour policy) differ from the trainer's log-probs of the same tokens (the old policy of the PPO ratio) for
two reasons: the engine decodes in another precision and with other kernels (the train/inference mismatch of any
run), and with `trainer.async.mode=one_step_off` it samples with the weights of the step before (staleness). The
policy gradient is an expectation under the trainer's old policy, so each token's loss is reweighted by

    rho_t = pi_old(y_t) / pi_rollout(y_t)              (level "token")
    rho   = prod_t pi_old(y_t) / pi_rollout(y_t)       (level "sequence": one weight for every token of a row)

capped at `rollout_is_threshold` (the truncation keeps one rare token from dominating the batch: bias for
variance). The weights are constants of the loss (no gradient flows through them). This follows verl's rollout
correction (`algorithm.rollout_correction.rollout_is`, `rollout_is_threshold`; verl's rollout_corr_helper.py):
log-ratios are clamped to +-20 before `exp`, padding weighs 0, and the shares of tokens (or sequences) above the
cap and below its reciprocal are measured before the cap is applied.

Pure tensor functions, plus the check of the config block (`check_rollout_correction`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .errors import UserError
from .vocabulary import STATISTICS_DTYPE

# exp(+-20) bounds a weight before the cap (verl's SAFETY_BOUND): no overflow from a very long sequence
LOG_RATIO_BOUND = 20.0
IS_LEVELS = ("token", "sequence")


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def rollout_is_weights(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor,
                       level: str = "token", threshold: float = 2.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights `min(rho, threshold)` per token ([rows, T], 0 at padding) and their statistics.

    `old_logprob`: the trainer's log-probs of the sampled tokens; `rollout_logprob`: the engine's; `mask`: 1 at
    response tokens. Statistics (0-d tensors, measured before the cap):
    `rollout_is_mean` (masked token mean of the uncapped weights), `rollout_is_capped_frac` (share of tokens, or
    at level "sequence" of rows, whose weight exceeds the cap), `rollout_is_low_frac` (below 1/threshold),
    `rollout_is_max`, and the mismatch itself: `rollout_kl` = token mean of log pi_rollout - log pi_old (verl's
    `rollout_corr/kl`) and `rollout_k3_kl` = token mean of rho - log rho - 1.
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is level {level!r}: use one of {IS_LEVELS}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    mask = mask.to(old_logprob.dtype)
    log_ratio = (old_logprob - rollout_logprob.to(old_logprob.dtype)).detach() * mask
    log_cap, log_floor = math.log(threshold), -math.log(threshold)
    if level == "token":
        weights = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)) * mask
        capped = _masked_mean((log_ratio > log_cap).to(mask.dtype), mask)
        low = _masked_mean((log_ratio < log_floor).to(mask.dtype), mask)
    else:
        per_row = log_ratio.sum(dim=-1, keepdim=True)
        weights = torch.exp(per_row.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).expand_as(log_ratio) * mask
        rows = (mask.sum(dim=-1, keepdim=True) > 0).to(mask.dtype)  # rows with a response: shares of these
        capped = _masked_mean((per_row > log_cap).to(mask.dtype), rows)
        low = _masked_mean((per_row < log_floor).to(mask.dtype), rows)
    real = mask.bool()
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    metrics = {
        "rollout_is_mean": _masked_mean(weights, mask),
        "rollout_is_max": torch.where(real.any(), weights.masked_fill(~real, float("-inf")).amax(),
                                      torch.ones((), dtype=weights.dtype, device=weights.device)),
        "rollout_is_capped_frac": capped,
        "rollout_is_low_frac": low,
        "rollout_kl": _masked_mean(-log_ratio, mask),
        "rollout_k3_kl": _masked_mean(rho - log_ratio - 1.0, mask),
    }
    return weights.clamp(max=threshold).detach(), metrics


def offpolicy_gap(old_logprob: torch.Tensor, rollout_logprob: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's policy is from the trainer's on these tokens, as plain numbers for a step's log:
    `kl` (token mean of log pi_rollout - log pi_old), `k3_kl`, and `abs_log_ratio` (token mean of |log rho|)."""
    mask = mask.to(STATISTICS_DTYPE)
    log_ratio = (old_logprob.to(STATISTICS_DTYPE) - rollout_logprob.to(STATISTICS_DTYPE)) * mask
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return {"kl": float(_masked_mean(-log_ratio, mask)), "k3_kl": float(_masked_mean(rho - log_ratio - 1.0, mask)),
            "abs_log_ratio": float(_masked_mean(log_ratio.abs(), mask))}


class RolloutCorrection:
    """The configured correction (verl's `algorithm.rollout_correction`), applied inside the actor's loss.

    `weights(old, rollout, mask)` -> (token weights or None, metrics); `behaviour(old, rollout)` -> the log-probs
    the PPO ratio is taken against (`bypass_mode`: the rollout's own, skipping the trainer's old policy).

    In bypass mode the clipped PPO ratio pi_theta / pi_rollout already is the importance ratio, so weights on top
    would count the correction twice: they are measured (pi_theta against pi_rollout) and logged, not applied, as
    verl's bypass mode does with its ppo_clip loss."""

    def __init__(self, level: Optional[str] = None, threshold: float = 2.0, bypass_mode: bool = False):
        self.level, self.threshold, self.bypass_mode = level, float(threshold), bool(bypass_mode)

    @classmethod
    def from_config(cls, section: Any) -> "RolloutCorrection":
        if section is None:
            return cls()
        return cls(section.rollout_is, section.rollout_is_threshold, section.bypass_mode)

    @property
    def enabled(self) -> bool:
        return self.level is not None

    @property
    def sequence_metrics(self) -> tuple[str, ...]:
        """Its metrics that are shares of sequences, not tokens (at level "sequence")."""
        return ("rollout_is_capped_frac", "rollout_is_low_frac") if self.level == "sequence" else ()

    def behaviour(self, old_logprob: torch.Tensor, rollout_logprob: torch.Tensor) -> torch.Tensor:
        return rollout_logprob.to(old_logprob.dtype) if self.bypass_mode else old_logprob

    def weights(self, old_logprob: torch.Tensor, rollout_logprob: torch.Tensor,
                mask: torch.Tensor) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
        if not self.enabled:
            return None, {}
        weights, means = rollout_is_weights(old_logprob, rollout_logprob, mask, self.level, self.threshold)
        return (None if self.bypass_mode else weights), means


def recomputes_old_logprobs(section: Any) -> bool:
    """Whether the trainer's log-probs of the sampled tokens (the old policy) are needed: not in bypass mode, where
    the PPO ratio is taken against the rollout's own log-probs and the logged weights compare the current policy
    with the rollout's (verl skips that forward there too)."""
    return not section.bypass_mode


def check_rollout_correction(section: Any, top_k: Optional[int], top_p: Optional[float]) -> None:
    """Config errors of `algorithm.rollout_correction`, before anything loads."""
    if section.rollout_is is not None and section.rollout_is not in IS_LEVELS:
        raise UserError(f"algorithm.rollout_correction.rollout_is={section.rollout_is!r} is not valid; use token "
                        "(a weight per token), sequence (one per response) or null (off)")
    if not float(section.rollout_is_threshold) > 0:
        raise UserError(f"algorithm.rollout_correction.rollout_is_threshold={section.rollout_is_threshold} must be "
                        "> 0 (the cap on each importance weight; verl's default is 2.0)")
    if section.rollout_is_batch_normalize:
        raise UserError("algorithm.rollout_correction.rollout_is_batch_normalize=true is not available: the weights "
                        "are capped, not renormalised; set it to false")
    if section.rollout_rs is not None:
        raise UserError(f"algorithm.rollout_correction.rollout_rs={section.rollout_rs!r}: rejection sampling is not "
                        "available; use rollout_is=token or sequence (truncated importance sampling) instead")
    if section.rollout_rs_threshold is not None:
        raise UserError(f"algorithm.rollout_correction.rollout_rs_threshold={section.rollout_rs_threshold!r}: "
                        "rejection sampling is not available, so its threshold has nothing to set; remove it")
    if section.loss_type != "ppo_clip":
        raise UserError(f"algorithm.rollout_correction.loss_type={section.loss_type!r} is not available; use "
                        "ppo_clip (the PPO clipped objective with the importance weights)")
    uses_logprobs = section.rollout_is is not None or section.bypass_mode
    if uses_logprobs and not ((top_k is None or top_k <= 0) and (top_p is None or top_p >= 1.0)):
        raise UserError("algorithm.rollout_correction needs the rollout's log-probs of the distribution the trainer "
                        "computes, but top_k / top_p renormalise the sampling distribution: set "
                        "actor_rollout_ref.rollout.top_k=-1 and top_p=1.0, or turn the correction off")


__all__ = ["IS_LEVELS", "LOG_RATIO_BOUND", "RolloutCorrection", "check_rollout_correction", "offpolicy_gap",
           "recomputes_old_logprobs", "rollout_is_weights"]
