"""Rollout engines and `make_engine`, which picks one for a model and a Plan.

`engine="auto"` uses FastEngine (static KV cache, CUDA graphs) where `FastEngine.supports(model)` and the plan
allows it, and falls back to HFEngine (transformers generate, any model) with a logged reason otherwise.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..vocabulary import RolloutEngineName
from .base import RolloutBatch, RolloutEngine, SamplingParams
from .fast import FastEngine
from .hf import HFEngine

logger = logging.getLogger(__name__)

ENGINE_CHOICES = RolloutEngineName.values()


def make_engine(
    model: Any,
    tokenizer: Any,
    plan: Any = None,
    engine: str = "auto",
    dtype: torch.dtype | None = None,
    max_batch_size: int | None = None,
    max_seq_len: int | None = None,
) -> RolloutEngine:
    """Build the rollout engine for `model`.

    engine: "fast", "hf" or "auto". With "auto", `plan.rollout.engine` (when a plan is given) is the request, and
    "fast" falls back to "hf" (logged) when `FastEngine.supports(model)` says no; an explicit "fast" raises
    instead, unless the plan allows the fall-back (`plan.rollout.fallback_allowed`: its own automatic choice).
    dtype: explicit engine dtype, else `plan.rollout.dtype`, else the model's own dtype.
    """
    if engine not in ENGINE_CHOICES:
        raise ValueError(f"engine must be one of {ENGINE_CHOICES}, got {engine!r}")
    rollout_plan = getattr(plan, "rollout", None) if plan is not None else None
    planned = rollout_plan.engine if rollout_plan is not None else None
    requested = planned if engine == "auto" and planned in ("fast", "hf") else engine
    # "fast" may fall back to hf when it was an automatic choice: engine="auto", or the plan's own "fast" from
    # rollout.name=auto passed through as engine=plan.rollout.engine.
    may_fall_back = engine == "auto" or (engine == planned and bool(rollout_plan.fallback_allowed))
    if dtype is None and rollout_plan is not None:
        dtype = rollout_plan.dtype

    if requested == "hf":
        if engine == "auto":
            logger.info("rollout engine: hf (chosen by the plan)")
        return HFEngine(model, tokenizer)

    ok, reason = FastEngine.supports(model)
    if not ok:
        if not may_fall_back:
            raise ValueError(f"engine='fast' cannot run this model: {reason}. Use engine='hf' or 'auto'.")
        logger.warning("rollout engine: hf (FastEngine does not support this model: %s)", reason)
        fallback = HFEngine(model, tokenizer)
        fallback.fallback_reason = f"FastEngine does not support this model: {reason}"  # for the run's record
        return fallback
    logger.info("rollout engine: fast")
    budget = getattr(plan, "memory_budget_bytes", None) if plan is not None else None
    return FastEngine(model, tokenizer, dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                      memory_budget_bytes=budget)


__all__ = ["make_engine", "RolloutBatch", "RolloutEngine", "SamplingParams", "FastEngine", "HFEngine"]
