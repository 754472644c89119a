"""Guard rails for mixed-precision RL: dynamic loss scaling that is counted, and a stop before garbage is trained on.

fp16 has 5 exponent bits: gradients underflow without loss scaling, and activations or scaled gradients can
overflow. The planner chooses fp16 on Volta/Turing (planner/precision.py); this module watches the run:

* `optimizer_step` is one optimizer step through an optional `torch.amp.GradScaler`: unscale, clip, step or skip.
  Its `StepOutcome` says whether the step was applied and, if not, whether it was a *scaler overflow* (normal in
  fp16: the scale was too high, the scaler halves it and the step is skipped) or a non-finite gradient without a
  scaler (a real failure, which fault handling counts).
* `rollout_logprob_gap` is the mean |rollout log-prob - trainer log-prob| over response tokens: how far the rollout
  engine's sampling distribution is from the policy the trainer computes (the other side of every PPO ratio).
* `PrecisionGuard` turns both into metrics (`actor/loss_scale`, `actor/skipped_steps`, `actor/rollout_logprob_gap`)
  and stops the run with a `PrecisionGuardError` when
    - the loss scale falls below `hardware.min_loss_scale` (the fp16 forward/backward overflows whatever the scale:
      every step is being skipped, nothing is learned);
    - the rollout/trainer log-prob gap stays above `hardware.max_logprob_gap` for `hardware.logprob_gap_patience`
      steps in a row (the sampler no longer draws from the policy being trained);
    - the rollout produced a non-finite log-prob (an overflow inside the rollout's forward pass): at once, before
      the update trains on it.
  Stopping is deliberate: falling back to fp32 mid-run would change memory (fp32 activations and KV cache) under a
  plan made for fp16. The message names the fix: resume with hardware.precision=fp32 (the checkpoints hold fp32
  master weights and optimizer state).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from .algorithms import masked_mean
from .errors import UserError

log = logging.getLogger(__name__)

FIX = "resume with hardware.precision=fp32 (checkpoints hold fp32 master weights and optimizer state)"


class PrecisionGuardError(UserError):
    """Training stopped because the numbers can no longer be trusted; the message names the cause and the fix."""


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    grad_norm: float  # after unscaling; inf/nan when the step was skipped
    applied: bool
    scaler_overflow: bool  # skipped because the scaled fp16 gradients overflowed (the scaler lowers its scale)
    loss_scale: Optional[float]  # the scale after this step's update; None without a scaler

    @property
    def nonfinite_failure(self) -> bool:
        """Skipped for a non-finite gradient that no loss scale explains (no scaler): a real failure."""
        return not self.applied and not self.scaler_overflow


def optimizer_step(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], grad_clip: float,
                   scaler: Optional["torch.amp.GradScaler"] = None) -> StepOutcome:
    """Unscale (with a scaler), clip to `grad_clip`, then step; a non-finite gradient norm skips the step.

    With a scaler its update() runs either way: the scale halves when it found an overflow, and grows after
    LOSS_SCALE_GROWTH_INTERVAL clean steps. The caller clears the gradients (after naming non-finite ones)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
        scale_before = scaler.get_scale()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(list(params), grad_clip))
    finite = math.isfinite(grad_norm)
    if finite:
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    overflow = False
    if scaler is not None:
        scaler.update()
        overflow = scaler.get_scale() < scale_before  # the scaler found inf/nan in the scaled gradients
    return StepOutcome(grad_norm, applied=finite and not overflow, scaler_overflow=overflow,
                       loss_scale=float(scaler.get_scale()) if scaler is not None else None)


def rollout_logprob_gap(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """mean |trainer - rollout| log-prob over the response tokens in `mask` ([rows, R] each; nan if any is)."""
    return masked_mean((trainer_logprobs.float() - rollout_logprobs.float()).abs(), mask.float())


def logprobs_comparable(top_k: Optional[int], top_p: Optional[float]) -> bool:
    """Whether the rollout's log-probs are of the distribution the trainer computes (both apply the temperature;
    top-k / top-p renormalise the sampling distribution, which the trainer does not)."""
    return (top_k is None or top_k <= 0) and (top_p is None or top_p >= 1.0)


class PrecisionGuard:
    """Counts scaler-skipped steps and watches the loss scale and the rollout/trainer log-prob gap.

    min_loss_scale: stop when a scaler's scale falls below it (None or 0: never). max_logprob_gap, patience: stop
    when the gap exceeds max_logprob_gap on `patience` consecutive steps (None or 0: never)."""

    def __init__(self, min_loss_scale: Optional[float] = 1.0, max_logprob_gap: Optional[float] = 0.25,
                 patience: int = 3, precision: str = "fp32"):
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.min_loss_scale = float(min_loss_scale or 0.0)
        self.max_logprob_gap = float(max_logprob_gap or 0.0)
        self.patience = int(patience)
        self.precision = precision
        self.step_skips: dict[str, int] = {}
        self.total_skips: dict[str, int] = {}
        self.loss_scale: dict[str, float] = {}
        self.gap_history: list[float] = []

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so that a resumed run counts on: skipped steps and the recent gaps. (The loss
        scale is the gradient scaler's, which the checkpoint keeps itself; a run resumed in fp32 has none.)"""
        return {"total_skips": dict(self.total_skips), "gap_history": self.gap_history[-self.patience:]}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.total_skips = {str(k): int(v) for k, v in (state.get("total_skips") or {}).items()}
        self.gap_history = [float(g) for g in state.get("gap_history") or []]

    @classmethod
    def from_config(cls, hardware_cfg: Any, precision: str) -> "PrecisionGuard":
        return cls(hardware_cfg.min_loss_scale, hardware_cfg.max_logprob_gap, hardware_cfg.logprob_gap_patience,
                   precision)

    def record(self, model_name: str, outcome: StepOutcome) -> None:
        """One optimizer step of `model_name` ("actor", "critic")."""
        self.step_skips.setdefault(model_name, 0)
        self.total_skips.setdefault(model_name, 0)
        if not outcome.applied:  # a scaler overflow, or a non-finite gradient: the weights did not move
            self.step_skips[model_name] += 1
            self.total_skips[model_name] += 1
        if outcome.scaler_overflow:
            log.info("%s: fp16 gradients overflowed at loss scale %.0f; step skipped, scale halved to %.0f",
                     model_name, 2 * (outcome.loss_scale or 0.0), outcome.loss_scale or 0.0)
        if outcome.loss_scale is not None:
            self.loss_scale[model_name] = outcome.loss_scale

    def check_rollout(self, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> None:
        """Stop before an update trains on a rollout whose half-precision forward pass overflowed (non-finite
        log-probs). An fp32 rollout that is non-finite means the weights diverged: the update's non-finite gradient
        is skipped and counted (trainer.max_consecutive_nonfinite_updates), with advice that fits that case."""
        if self.precision in ("fp32", "float32"):
            return
        bad = ~torch.isfinite(rollout_logprobs) & mask.bool()
        if bool(bad.any()):
            rows = int(bad.any(-1).sum())
            raise PrecisionGuardError(
                f"the rollout produced non-finite log-probs in {int(bad.sum())} tokens of {rows} responses "
                f"({self.precision} rollout): its forward pass overflowed, and those samples are garbage. "
                f"Stopped before training on them; {FIX}, or set actor_rollout_ref.rollout.dtype=float32")

    def end_step(self, metrics: dict) -> dict:
        """Metrics of this step (loss scale, skipped steps) to log; raises PrecisionGuardError when a rail trips.

        Reads `actor/rollout_logprob_gap` from `metrics` when the update measured it on a batch of the current
        policy (`async/staleness` 0 or absent)."""
        out: dict[str, float] = {}
        for name, skips in self.step_skips.items():
            out[f"{name}/skipped_steps"] = float(skips)
            out[f"{name}/skipped_steps_total"] = float(self.total_skips[name])
        for name, scale in self.loss_scale.items():
            out[f"{name}/loss_scale"] = scale
        self.step_skips = {name: 0 for name in self.step_skips}
        for name, scale in self.loss_scale.items():
            if scale < self.min_loss_scale:
                raise PrecisionGuardError(
                    f"{name}: the fp16 loss scale fell to {scale:g}, below hardware.min_loss_scale="
                    f"{self.min_loss_scale:g}, after {self.total_skips.get(name, 0)} skipped optimizer steps: its "
                    f"gradients overflow at every scale (an overflow in the forward pass, not a spike), so nothing "
                    f"is being learned. {FIX[0].upper() + FIX[1:]}")
        gap = metrics.get("actor/rollout_logprob_gap")
        # a batch sampled by an older policy (trainer.async: async/staleness > 0) differs from the trainer's by the
        # updates since too: its gap measures staleness, not precision, and is logged only
        if gap is not None and not metrics.get("async/staleness"):
            self.gap_history = (self.gap_history + [float(gap)])[-self.patience:]  # the window the rail reads
            recent = self.gap_history
            over = lambda g: not math.isfinite(g) or g > self.max_logprob_gap  # noqa: E731
            if self.max_logprob_gap > 0 and len(recent) == self.patience and all(over(g) for g in recent):
                raise PrecisionGuardError(
                    f"the mean |rollout - trainer| log-prob gap was {', '.join(f'{g:.3g}' for g in recent)} on the "
                    f"last {self.patience} steps, above hardware.max_logprob_gap={self.max_logprob_gap:g} "
                    f"({self.precision}): the rollout no longer samples from the policy being trained. {FIX[0].upper()}"
                    f"{FIX[1:]}; or raise hardware.max_logprob_gap if this gap is expected")
        return out
