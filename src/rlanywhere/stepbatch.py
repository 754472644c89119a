"""The data of one training step: the rollout with its scores (ScoredRollout, steps 1-2) and everything computed
from it on the way to the updates (StepBatch: log-probs, values, advantages, the loss mask)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from .rollout.base import RolloutBatch


@dataclass
class StepBatch:
    """Everything known about one step's sequences; tensors are [rows, response_len] unless noted."""

    rollout: RolloutBatch
    group_index: torch.Tensor  # [rows] which prompt each row answers: its index in the step's global batch
    scores: torch.Tensor  # [rows]
    reward_info: dict
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    token_rewards: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    metrics: dict = field(default_factory=dict)
    loss_mask: Optional[torch.Tensor] = None  # the response mask less rows kept out of the losses (truncated ones)

    @property
    def mask(self) -> torch.Tensor:
        """The mask the losses and their normalisers use."""
        return self.loss_mask if self.loss_mask is not None else self.rollout.response_mask.float()

    @property
    def rows(self) -> int:
        return self.rollout.response_ids.shape[0]


@dataclass
class ScoredRollout:
    """Steps 1-2 of a step: prompts, their rollout, per-row scores and the reward details (lists per row)."""

    items: list[dict]
    rollout: RolloutBatch
    scores: torch.Tensor
    info: dict
    # [rows, response_len] the reference's log-probs, where the pipeline computed them right after the rollout
    # (plan.ref_with_rollout); None: the step computes them. Rows picked or joined (select, concat) keep theirs.
    ref_logprobs: torch.Tensor | None = None

    def select(self, prompts: list[int]) -> "ScoredRollout":
        """The given prompts with their n samples each, in that order (counts such as num_errors are kept)."""
        r = self.rollout
        rows = [p * r.n + j for p in prompts for j in range(r.n)]
        info = {key: [value[i] for i in rows] if isinstance(value, list) else value for key, value in self.info.items()}
        rollout = RolloutBatch(prompt_ids=r.prompt_ids[rows], prompt_mask=r.prompt_mask[rows],
                               response_ids=r.response_ids[rows], response_mask=r.response_mask[rows],
                               response_logprobs=r.response_logprobs[rows], num_prompts=len(prompts), n=r.n)
        ref = None if self.ref_logprobs is None else self.ref_logprobs[rows]
        return ScoredRollout([self.items[p] for p in prompts], rollout, self.scores[rows], info, ref)

    @staticmethod
    def concat(parts: list["ScoredRollout"], pad_token_id: int) -> "ScoredRollout":
        if len(parts) == 1:
            return parts[0]
        # a number the reward returned in some parts only counts 0 in the others' rows, as within one reward call
        kinds = {key: isinstance(value, list) for part in parts for key, value in part.info.items()}
        info = {key: (sum((part.info.get(key, [0.0] * len(part.scores)) for part in parts), []) if is_list
                      else sum(part.info.get(key, 0) for part in parts)) for key, is_list in kinds.items()}
        ref = None
        if all(part.ref_logprobs is not None for part in parts):  # right-padded to the widest, as the responses
            width = max(part.ref_logprobs.shape[1] for part in parts)
            ref = torch.cat([torch.nn.functional.pad(part.ref_logprobs, (0, width - part.ref_logprobs.shape[1]))
                             for part in parts])
        return ScoredRollout(sum((part.items for part in parts), []),
                             RolloutBatch.concat([part.rollout for part in parts], pad_token_id),
                             torch.cat([part.scores for part in parts]), info, ref)
