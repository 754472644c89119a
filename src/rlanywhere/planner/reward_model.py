"""The reward model's plan: one more model in the policy's memory estimate (a "reward" scoring phase), offloaded
between scorings when the training phases do not fit beside it, refused before anything loads when scoring itself
cannot fit. Pure functions of the config, the policy's plan and the estimate (reward_model.py runs what they decide).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from .. import estimator as est
from ..vocabulary import NoFitError, dtype_name

DISCRIMINATIVE, GENERATIVE = "discriminative", "generative"
# transient parts of a phase's breakdown (what the phase frees when it ends); the rest is state that stays
_TRANSIENT = ("prefill_or_sampling", "activations", "logits_chunks", "autocast_cache", "optimizer_step",
              "gathered_weights", "gathered_units")


def reward_model_kind(rm_cfg) -> str:
    """'generative' when reward_model.judge.enable, else 'discriminative'."""
    return GENERATIVE if rm_cfg.judge.enable else DISCRIMINATIVE


def rm_micro_batch_request(rm_cfg) -> Optional[int]:
    """verl's micro_batch_size_per_gpu, else its deprecated global micro_batch_size (one process: the same)."""
    return rm_cfg.micro_batch_size_per_gpu or rm_cfg.micro_batch_size or None


# ------------------------------------------------------------------------------------------------ planning
@dataclass
class RewardModelPlan:
    """What the planner decided for the reward model (plan.reward_model, JSON-able through to_dict)."""

    kind: str
    path: str
    dtype: str  # vocabulary dtype name
    attn_implementation: str
    micro_batch: int  # rows per forward (discriminative) or per generation wave (judge)
    max_length: int  # tokens per scored sequence (a judge: the grading prompt; it generates max_new_tokens more)
    max_token_len: Optional[int]  # token budget per micro-batch (use_dynamic_bsz)
    offload: bool  # kept in CPU memory between scorings, moved to the device for the scoring phase
    weights_bytes: int
    scoring_bytes: int  # the scoring phase's peak
    reasons: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def reward_model_weight_bytes(shape, kind: str, dtype_bytes: int, num_labels: int = 1) -> int:
    """A classifier: backbone + a hidden x labels head; a judge: the whole causal LM."""
    if kind == GENERATIVE:
        return shape.num_params(with_lm_head=True) * dtype_bytes
    return (shape.backbone_params() + shape.hidden_size * num_labels) * dtype_bytes


def reward_model_scoring_bytes(shape, kind: str, rows: int, seq_len: int, dtype_bytes: int,
                               scores_materialized: bool, new_tokens: int = 0) -> int:
    """Transient memory of one scoring micro-batch: a no-grad forward over rows x seq_len tokens; a judge adds
    its KV cache for the prompt plus new_tokens, and one step of logits per row."""
    activations = est.nograd_activation_bytes(shape, rows * seq_len, seq_len, dtype_bytes, dtype_bytes,
                                              scores_materialized)
    if kind != GENERATIVE:
        return activations
    cache = est.kv_cache_bytes(shape, rows, seq_len + new_tokens, dtype_bytes)
    sampling = rows * shape.vocab_size * est.SAMPLING_BYTES_PER_LOGIT
    return cache + max(activations, sampling)


def plan_reward_model(estimate: dict, shape, *, kind: str, path: str, dtype: torch.dtype, attn_implementation: str,
                      rows: int, seq_len: int, budget_bytes: Optional[int], on_cuda: bool,
                      micro_batch: Optional[int] = None, max_token_len: Optional[int] = None,
                      offload_request: Any = "auto", new_tokens: int = 0,
                      scores_materialized: bool = False, kept_cache_bytes: int = 0) -> tuple[RewardModelPlan, dict]:
    """The reward model's plan and the policy's estimate with it added. Pure: no model, no device.

    estimate: the policy's estimate (estimator.estimate_memory). The scoring phase holds what the rollout phase
    holds but its transients (the actor, the rollout's cache and engine weights, the other models' resident state)
    plus the reward model's weights and one micro-batch's forward. Every other phase holds the reward model's
    weights too unless it is offloaded: offloaded when asked (param_offload=true) or, on a GPU, when a phase would
    not fit beside it. Raises NoFitError, with the estimates kept and offloaded, when the scoring phase itself
    cannot fit. kept_cache_bytes: the rollout's KV cache when the plan keeps it between phases (it then sits beside
    every training phase too)."""
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    weights = reward_model_weight_bytes(shape, kind, dtype_bytes)
    budget = budget_bytes if budget_bytes else None
    phases, breakdown = dict(estimate["phases"]), {k: dict(v) for k, v in estimate["breakdown"].items()}
    resident = {k: v for k, v in breakdown.get("rollout", {}).items() if k not in _TRANSIENT}
    reasons: dict[str, str] = {}

    def scoring(rows_per_batch: int) -> int:
        tokens = max_token_len if max_token_len else rows_per_batch * seq_len
        batch_rows = max(tokens // max(seq_len, 1), 1)
        return reward_model_scoring_bytes(shape, kind, batch_rows, seq_len, dtype_bytes, scores_materialized,
                                          new_tokens)

    base = sum(resident.values()) + weights
    if micro_batch:
        chosen = int(micro_batch)
        reasons["micro_batch"] = f"reward_model.micro_batch_size_per_gpu={chosen}"
    else:  # the most rows at once that fit (a power of two, at most the step's rows)
        chosen = 1
        candidate = 1
        while candidate * 2 <= max(rows, 1):
            candidate *= 2
        while candidate > 1 and budget is not None and base + scoring(candidate) > budget:
            candidate //= 2
        chosen = min(candidate, max(rows, 1))
        reasons["micro_batch"] = (f"{chosen} rows per scoring forward: the most of the step's {rows} that fit beside "
                                  "the models kept on the device" if budget is not None else
                                  f"{chosen} rows per scoring forward (no memory limit known)")
    if max_token_len:
        reasons["micro_batch"] = (f"reward_model.use_dynamic_bsz: micro-batches of up to {max_token_len} tokens "
                                  "(reward_model.forward_max_token_len_per_gpu)")
    scoring_parts = {**resident, "reward_model_weights": weights, "reward_model_forward": scoring(chosen)}
    scoring_peak = sum(scoring_parts.values())
    training = [v + kept_cache_bytes for k, v in phases.items() if k != "rollout"] + [phases.get("rollout", 0)]
    kept_peak = max(training) + weights
    offloaded_peak = max(max(training), scoring_peak)
    fits = lambda peak: budget is None or peak <= budget  # noqa: E731
    if offload_request is True:
        offload = on_cuda
        reasons["offload"] = ("reward_model.model.fsdp_config.param_offload=true: kept in CPU memory between "
                              "scorings, moved to the GPU to score" if on_cuda else
                              "a CPU run: the reward model stays where it is (param_offload has nothing to do)")
    elif not on_cuda:
        offload = False
        reasons["offload"] = "a CPU run: the reward model stays in memory beside the others"
    elif fits(kept_peak):
        offload = False
        reasons["offload"] = "kept on the GPU: every phase fits beside it"
    else:
        offload = True
        reasons["offload"] = ("kept in CPU memory between scorings and moved to the GPU only to score: the training "
                              "phases do not fit beside it on this card")
    if not fits(scoring_peak) or not fits(offloaded_peak if offload else kept_peak):
        gib = est.format_bytes
        raise NoFitError(
            f"the reward model ({kind}, {path}) does not fit: its scoring phase needs {gib(scoring_peak)} "
            f"({gib(weights)} of reward-model weights, {gib(scoring_parts['reward_model_forward'])} for a "
            f"{chosen}-row forward, {gib(sum(resident.values()))} of the policy's models) of {gib(budget)}; with it "
            f"kept on the GPU the run peaks at {gib(kept_peak)}, offloaded between scorings at "
            f"{gib(offloaded_peak)}. Fixes: a smaller reward model, reward_model.max_length or "
            "reward_model.micro_batch_size_per_gpu lower, a smaller data.train_batch_size, or a larger card")
    if not offload:
        for name in phases:
            breakdown[name]["reward_model_weights"] = weights
            phases[name] += weights
    breakdown["reward"] = scoring_parts
    phases["reward"] = scoring_peak
    peak_phase = max(phases, key=phases.get)
    combined = {**estimate, "phases": phases, "breakdown": breakdown, "peak_bytes": phases[peak_phase],
                "peak_phase": peak_phase,
                "fits": None if budget is None else phases[peak_phase] <= budget}
    reasons["dtype"] = f"{dtype_name(dtype)}: the precision the plan runs inference in on this card (the rollout's)"
    reasons["attn_implementation"] = f"{attn_implementation}: the actor's"
    plan = RewardModelPlan(kind=kind, path=str(path), dtype=dtype_name(dtype), attn_implementation=attn_implementation,
                           micro_batch=chosen, max_length=seq_len, max_token_len=max_token_len, offload=offload,
                           weights_bytes=weights, scoring_bytes=scoring_peak, reasons=reasons)
    return plan, combined


def plan_from_config(cfg, plan, estimate: dict, budget_bytes: Optional[int], on_cuda: bool,
                     scores_materialized: bool = False) -> tuple[RewardModelPlan, dict]:
    """plan_reward_model for a run's config and the policy's plan (the planner's one call)."""
    from ..model_shape import read_model_shape

    rm = cfg.reward_model
    kind = reward_model_kind(rm)
    shape = read_model_shape(rm.model.path)
    prompt_len = int(cfg.data.max_prompt_length)
    response_len = int(cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length)
    # the re-templated sequence is about the policy's (another template adds a few tokens); a judge's prompt adds
    # the grading instructions: count a quarter more
    natural = prompt_len + response_len
    seq_len = int(rm.max_length) if rm.max_length else (natural if kind == DISCRIMINATIVE else natural * 5 // 4)
    rows = int(cfg.data.train_batch_size) * int(cfg.actor_rollout_ref.rollout.n)
    budget_tokens = rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None
    if rm.use_dynamic_bsz and not budget_tokens:
        budget_tokens = seq_len * max(rm_micro_batch_request(rm) or 1, 1)
    return plan_reward_model(
        estimate, shape, kind=kind, path=rm.model.path, dtype=plan.rollout.dtype,
        attn_implementation=plan.attn_implementation, rows=rows, seq_len=seq_len, budget_bytes=budget_bytes,
        on_cuda=on_cuda, micro_batch=rm_micro_batch_request(rm), max_token_len=budget_tokens,
        offload_request=rm.model.fsdp_config.param_offload,
        new_tokens=int(rm.judge.max_new_tokens) if kind == GENERATIVE else 0,
        scores_materialized=scores_materialized,
        kept_cache_bytes=0 if plan.rollout.release_kv_between_phases else
        estimate.get("breakdown", {}).get("rollout", {}).get("kv_cache", 0))


__all__ = ["DISCRIMINATIVE", "GENERATIVE", "RewardModelPlan", "plan_from_config", "plan_reward_model",
           "reward_model_kind", "reward_model_scoring_bytes", "reward_model_weight_bytes", "rm_micro_batch_request"]
