"""Rollout engines and `make_engine`, which picks one for a model and a Plan.

Layout: base.py (the engine interface, RolloutBatch, sampling), hf.py (HFEngine: transformers generate, any
model), and FastEngine split by job: llama.py (model forward and weights), runner.py (KV cache, buffers, CUDA
graphs), scheduler.py (waves, compaction, stop strings), fast.py (the engine composing them from a RolloutPlan).

`engine="auto"` uses FastEngine (static KV cache, CUDA graphs) where `FastEngine.supports(model)` and the plan
allows it, and falls back to HFEngine (transformers generate, any model) with a logged reason otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..plans import RolloutPlan
from ..vocabulary import RolloutEngineName
from .base import RolloutBatch, RolloutEngine, SamplingParams
from .fast import FastEngine
from .hf import HFEngine

logger = logging.getLogger(__name__)

ENGINE_CHOICES = RolloutEngineName.values()


def make_engine(model: Any, tokenizer: Any, plan: Any = None, engine: str = "auto") -> RolloutEngine:
    """Build the rollout engine for `model` from `plan.rollout` (no plan: `RolloutPlan(engine="fast")`, the portable
    defaults; a bench wanting the planner's choices without a config uses `planner.plan_rollout_for`).

    engine: "fast", "hf" or "auto". With "auto", `plan.rollout.engine` (when a plan is given) is the request, and
    "fast" falls back to "hf" (logged) when `FastEngine.supports(model)` says no; an explicit "fast" raises
    instead, unless the plan allows the fall-back (`plan.rollout.fallback_allowed`: its own automatic choice).
    """
    if engine not in ENGINE_CHOICES:
        raise ValueError(f"engine must be one of {ENGINE_CHOICES}, got {engine!r}")
    rollout_plan = getattr(plan, "rollout", None) if plan is not None else None
    planned = rollout_plan.engine if rollout_plan is not None else None
    requested = planned if engine == "auto" and planned in ("fast", "hf") else engine
    # "fast" may fall back to hf when it was an automatic choice: engine="auto", or the plan's own "fast" from
    # rollout.name=auto passed through as engine=plan.rollout.engine.
    may_fall_back = engine == "auto" or (engine == planned and bool(rollout_plan.fallback_allowed))

    hf_rows = rollout_plan.rows_per_wave if rollout_plan is not None else None
    if requested == "hf":
        if engine == "auto":
            logger.info("rollout engine: hf (chosen by the plan)")
        return HFEngine(model, tokenizer, rows_per_wave=hf_rows)

    ok, reason = FastEngine.supports(model)
    if not ok:
        if not may_fall_back:
            raise ValueError(f"engine='fast' cannot run this model: {reason}. Use engine='hf' or 'auto'.")
        logger.warning("rollout engine: hf (FastEngine does not support this model: %s)", reason)
        fallback = HFEngine(model, tokenizer, rows_per_wave=hf_rows)
        fallback.fallback_reason = f"FastEngine does not support this model: {reason}"  # for the run's record
        return fallback
    logger.info("rollout engine: fast")
    rollout = RolloutPlan(engine="fast") if rollout_plan is None else dataclasses.replace(rollout_plan, engine="fast")
    return FastEngine(model, tokenizer, rollout)


__all__ = ["make_engine", "RolloutBatch", "RolloutEngine", "RolloutPlan", "SamplingParams", "FastEngine", "HFEngine"]
