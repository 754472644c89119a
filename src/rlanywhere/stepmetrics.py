"""What a training step reports besides the losses: rewards, response lengths, KL, values, speed, memory, phase
timings. [distributed] Computed over all ranks' rows (the caller passes gathered tensors); timings are this rank's.
"""

from __future__ import annotations

import contextlib
import resource
import time
from typing import Optional

import numpy as np
import torch

from . import algorithms as algo
from .reward_model import reward_model_metrics
from .rollout.base import response_extents


class PhaseTimer:
    """Wall time per phase of a step (`with timer("rollout"): ...`), synchronised with the GPU."""

    def __init__(self, device: str):
        self.device = device
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        # this stream only: a rollout generating beside the update on its own stream (async_pipeline.py) goes on
        if self.device.startswith("cuda"):
            torch.cuda.current_stream(self.device).synchronize()
        start = time.perf_counter()
        with torch.profiler.record_function(f"phase/{name}"):  # a named range in trainer.profile_steps traces
            yield
        if self.device.startswith("cuda"):
            torch.cuda.current_stream(self.device).synchronize()
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


def peak_memory_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux: the process's resident high-water mark.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def step_metrics(dp, *, scores: torch.Tensor, mask: torch.Tensor, prompt_mask: torch.Tensor, info: dict,
                 response_length: int, actor_lr: float, step_time: float, timer: PhaseTimer, device: str,
                 old_logprobs: Optional[torch.Tensor], ref_logprobs: Optional[torch.Tensor],
                 kl_coef: Optional[float], values: Optional[torch.Tensor], returns: Optional[torch.Tensor],
                 oom_recoveries: int, extra: dict, compiles: int = 0) -> dict:
    """Step 7's diagnostics. `scores`, `mask` and the per-token tensors hold every rank's rows; `prompt_mask` and
    `info` are this rank's; `extra` (KL-in-reward, dynamic sampling, truncation metrics) is merged as it is.
    `compiles`: torch.compile compiles during this step on this rank (a slow step that compiled says why)."""
    resp_len = response_extents(mask).float()  # a multi-turn row's tool tokens included, as they count against the budget
    # [distributed] every rank's share of the per-rank numbers in one exchange (one host sync, not one per metric)
    ranks = dp.gather_objects([{
        "acc": list(info["acc"]), "format": list(info["format"]), "overlong": list(info.get("overlong_penalty", [])),
        "errors": float(info["num_errors"]), "prompt_tokens": float(prompt_mask.sum()),
        "peak": peak_memory_gib(device), "oom": float(oom_recoveries), "compiles": float(compiles),
        "reward_model": {k: info[k] for k in ("rm_score", "rm_parse_failures", "rm_time_s") if k in info}}])
    every = lambda key: [value for part in ranks for value in part[key]]  # noqa: E731
    total = lambda key: sum(part[key] for part in ranks)  # noqa: E731
    total_tokens = float(mask.sum()) + total("prompt_tokens")
    metrics = {
        "reward/mean": float(scores.mean()), "reward/std": float(scores.std()) if scores.numel() > 1 else 0.0,
        "reward/acc": float(np.mean(every("acc"))),
        "reward/format": float(np.mean(every("format"))),
        "reward/errors": total("errors"),
        "response_length/mean": float(resp_len.mean()), "response_length/max": float(resp_len.max()),
        "response_length/clip_ratio": float((resp_len >= response_length).float().mean()),
        "actor/lr": actor_lr,
        "perf/step_time_s": step_time, "perf/tokens_per_s": total_tokens / step_time,
        "perf/peak_memory_gib": max(part["peak"] for part in ranks),
        "perf/compiles": max(part["compiles"] for part in ranks),
        **{f"timing/{k}": v for k, v in timer.times.items()},
        **extra,
    }
    # this batch's generation seconds: the pipeline's for a batch made in the background or on a rollout rank (the
    # step timed only its wait for it), else the step's own rollout phase
    rollout_s = extra["async/generate_s"] if "async/generate_s" in extra else timer.times.get("rollout")
    if rollout_s:
        metrics["perf/rollout_tokens_per_s"] = float(mask.sum()) / rollout_s
    metrics.update(reward_model_metrics([part["reward_model"] for part in ranks]))  # {} without a reward model
    if "overlong_penalty" in info:
        metrics["reward/overlong_penalty"] = float(np.mean(every("overlong")))
    if ref_logprobs is not None and old_logprobs is not None:
        metrics["actor/kl"] = float(algo.masked_mean(algo.kl_penalty(old_logprobs, ref_logprobs, "kl"), mask))
    if kl_coef is not None:
        metrics["actor/kl_coef"] = kl_coef  # verl's: the KL loss's coefficient (in-reward: reward_kl_penalty_coeff)
    if values is not None:
        metrics["critic/values_mean"] = float(algo.masked_mean(values, mask))
        metrics["critic/returns_mean"] = float(algo.masked_mean(returns, mask))
    metrics["oom/recoveries"] = total("oom")
    return metrics
