"""Steps 1-2 of a training step (and validation's generation): sample n responses per prompt from the current
policy, score them with the reward, shape the scores (DAPO's overlong penalty), and with dynamic sampling
(algorithm.filter_groups) draw more prompts until enough groups are informative. Also the loss mask that keeps
truncated responses out of the losses (TRL's mask_truncated_completions).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Callable, Optional

import torch
from omegaconf import DictConfig

from . import algorithms as algo
from .config import as_list
from .distributed import DataParallel
from .errors import UserError
from .oom import OOMGuard
from .plans import Plan, SizeKind
from .rollout.base import RolloutBatch, RowStreams, SamplingParams, StopStringMatcher, collect_eos_ids
from .rollout.multiturn import RowStats, multiturn_from_config, multiturn_metrics, reward_extra_infos
from .sharding import weights_for_rollout
from .stepbatch import ScoredRollout
from .verl_steps import BASELINE_KEY, row_baselines
from .vocabulary import STATISTICS_DTYPE

log = logging.getLogger(__name__)

TOOL_ROWS_KEY = "_multi_turn_rows"  # a deferred rollout's rows' tool statistics, in its metrics (finish_tool_stats)
ROW_STATS_KEY = "multi_turn_row_stats"  # dynamic sampling: each row's RowStats, kept with the row


def response_length(cfg: DictConfig) -> int:
    """New tokens per response: rollout.response_length, else data.max_response_length."""
    return cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length


class RolloutPhase:
    """Generation and scoring for one run: the engine, the reward, the sampling settings of the config."""

    def __init__(self, cfg: DictConfig, plan: Plan, engine, actor, tokenizer, reward_manager, oom: OOMGuard,
                 next_prompts: Callable[[], list[dict]], dp: Optional[DataParallel] = None):
        self.cfg, self.plan, self.engine, self.actor, self.tokenizer = cfg, plan, engine, actor, tokenizer
        self.reward_manager, self.oom, self.next_prompts = reward_manager, oom, next_prompts
        self.prompts_left: Callable[[], bool] = lambda: True  # the trainer's: the run's passes over the prompts
        self.reward_keys_seen: set[str] = set()  # the per-sample numbers the reward has returned so far
        self.run = oom.run_state  # the sizes and the KV-release flag as they are now (the plan is never changed)
        self.dp = dp or DataParallel()  # [distributed] dynamic sampling decides over every rank's prompts
        self.n = cfg.actor_rollout_ref.rollout.n
        # multi_turn.enable: tool-using rollouts (rollout/multiturn.py); None for single-turn
        self.multiturn = multiturn_from_config(cfg, tokenizer, getattr(engine, "eos_ids", None)
                                               or collect_eos_ids(tokenizer, actor))
        # [async] a pipeline's rollout (a thread beside the update, or another rank) returns its rows' tool
        # statistics as they are, for the step to gather over the ranks on the trainer's thread (finish_tool_stats)
        self.defer_tool_stats = False

    @property
    def response_length(self) -> int:
        return response_length(self.cfg)

    def sampling_params(self, validation: bool = False) -> SamplingParams:
        rollout_cfg = self.cfg.actor_rollout_ref.rollout
        sampling = rollout_cfg.val_kwargs if validation else rollout_cfg
        greedy = not sampling.do_sample or sampling.temperature == 0
        return SamplingParams(max_new_tokens=self.response_length,
                              temperature=0.0 if greedy else sampling.temperature, top_p=sampling.top_p,
                              top_k=max(sampling.top_k, 0), n=sampling.n if validation else rollout_cfg.n,
                              stop_strings=tuple(as_list(rollout_cfg.stop)),
                              ignore_eos=bool(rollout_cfg.ignore_eos and not validation))

    def step_generator(self, step: int, salt: int = 0, first_prompt: int = 0) -> torch.Generator:
        """Sampling randomness is a function of (seed, step, global index of the call's first prompt): a resumed run
        draws exactly what it would have, and a rank draws what one process would for the same prompts."""
        device = self.plan.device
        gen = torch.Generator(device=device if device.startswith("cuda") else "cpu")
        gen.manual_seed(self.cfg.trainer.seed * 1_000_003 + step * 7919 + salt + first_prompt * 104_729)
        return gen

    def row_streams(self, step: int, salt: int = 0) -> RowStreams:
        """The training rollout's randomness: one stream per row, keyed by (seed, step, global prompt index, sample
        index), so a resumed run draws exactly what it would have, and the samples are the same whatever the
        world size, the rollout batch size or an OOM halving of it (rows draw the same in any wave)."""
        return RowStreams(self.cfg.trainer.seed * 1_000_003 + step * 7919 + salt)

    def generate(self, items: list[dict], params: SamplingParams, generator, first_prompt: int = 0) -> RolloutBatch:
        """Sample params.n responses per prompt, run.sizes.rollout_batch_size sequences at a time (OOM-guarded).

        `generator` is RowStreams (item i is global prompt `first_prompt` + i), a torch.Generator for all calls,
        or a function of the global index of each call's first prompt (`first_prompt` + offset) returning one."""
        self.actor.eval()
        prompts = [item["input_ids"] for item in items]
        if self.run.sizes.rollout_batch_size is None:
            self.run.sizes.rollout_batch_size = len(prompts) * params.n
        # the engine splits the request into waves itself; a callable generator gets global prompt indices
        source = (generator.offset(first_prompt) if isinstance(generator, RowStreams) else
                  (lambda offset: generator(first_prompt + offset)) if callable(generator) else generator)

        def run(rows: int) -> RolloutBatch:
            with torch.no_grad():  # step-level tensors live on the CPU; micro-batches visit the device
                if self.multiturn is not None:
                    return self.multiturn.generate(self.engine, items, params, generator, first_prompt, rows).to("cpu")
                return self.engine.generate(prompts, params, generator=source, rows_per_wave=rows).to("cpu")

        with weights_for_rollout(self.engine, self.actor):  # [distributed] sharded: gathered, synced, then freed
            return self.oom.run("rollout", run, SizeKind.ROLLOUT_BATCH)

    def score(self, items: list[dict], rollout: RolloutBatch, n: int):
        texts = rollout.decode(self.tokenizer)
        expand = lambda key: [item[key] for item in items for _ in range(n)]  # noqa: E731
        # a reward model re-templates the conversation: it gets the prompts' messages too (reward_model.py)
        prompts = {"prompts": expand("raw_prompt")} if getattr(self.reward_manager, "needs_prompts", False) else {}
        extra_info = expand("extra_info")
        if self.multiturn is not None:  # verl: num_turns and the tools' calc_reward reach the reward function
            extra_info = reward_extra_infos(extra_info, self.multiturn.last_stats)
        scores, info = self.reward_manager(texts, expand("ground_truth"), expand("data_source"), extra_info,
                                           **prompts)
        return scores.float(), info, texts

    def shaped_scores(self, items: list[dict], rollout: RolloutBatch) -> ScoredRollout:
        """Rule scores plus DAPO's overlong penalty (reward_model.overlong_buffer) when it is on."""
        scores, info, _ = self.score(items, rollout, self.n)
        buffer = self.cfg.reward_model.overlong_buffer
        if buffer.enable:
            penalty = algo.overlong_penalty(rollout.response_lengths(), self.response_length, buffer.len,
                                            buffer.penalty_factor)
            info["score"] = scores.tolist()  # before the penalty: filter_groups.metric=score compares these exactly
            scores = scores + penalty.to(scores.dtype)
            info["overlong_penalty"] = penalty.tolist()
        return ScoredRollout(items, rollout, scores, info)

    def filter_metric(self, part: ScoredRollout) -> torch.Tensor:
        """Per-row values of algorithm.filter_groups.metric: seq_reward (shaped score), score (before the overlong
        penalty), or a number the reward function returns (acc, ...)."""
        name = self.cfg.algorithm.filter_groups.metric
        if name == "seq_reward":
            return part.scores
        if name == "score":  # the reward's own scores (shaped_scores keeps them exact), else recovered
            if isinstance(part.info.get("score"), list):
                return torch.tensor(part.info["score"], dtype=STATISTICS_DTYPE)
            return part.scores - torch.tensor(part.info.get("overlong_penalty", 0.0), dtype=part.scores.dtype)
        self.reward_keys_seen.update(k for k, v in part.info.items() if isinstance(v, list))
        if not isinstance(part.info.get(name), list):
            if name in self.reward_keys_seen:  # returned for other samples, none of these: 0, as within one call
                return torch.zeros(len(part.scores), dtype=STATISTICS_DTYPE)
            known = ["score", "seq_reward"] + sorted(self.reward_keys_seen)
            raise UserError(f"algorithm.filter_groups.metric={name!r} is not a reward value; use one of {known}")
        return torch.tensor(part.info[name], dtype=STATISTICS_DTYPE)

    def rollout_and_score(self, items: list[dict], timer, step: int = 0,
                          first_prompt: int = 0) -> tuple[ScoredRollout, dict, int]:
        """Steps 1-2: n samples per prompt from the current policy, scored (and length-shaped). Returns the scored
        prompts to train on, the dynamic-sampling metrics and the global index of the first of those prompts.

        With DAPO's dynamic sampling (algorithm.filter_groups) groups whose metric is the same for every sample are
        dropped and more prompts are drawn until train_batch_size prompts are kept, at most max_num_gen_batches
        rounds; a batch still short at the cap is topped up with dropped groups (verl stops the run there).
        [distributed] each round's prompts are split over the ranks like the step's; the counts that decide another
        round are global, and the prompts trained on are those one process would pick (every round's kept
        prompts, then every round's dropped ones, in global order), moved into even blocks, one per rank."""
        filter_cfg = self.cfg.algorithm.filter_groups
        rounds, kept, dropped, counts = [], [], [], []
        while True:
            with timer("rollout"):
                # [distributed] each row's stream is keyed by its global prompt index (first_prompt: this rank's
                # first), so N ranks sample what one process would, in waves of any size
                rollout = self.generate(items, self.sampling_params(), self.row_streams(step, salt=-len(rounds)),
                                        first_prompt)
            with timer("reward"):
                rounds.append(self.shaped_scores(items, rollout))
            if not filter_cfg.enable:
                break
            keep = algo.informative_groups(self.filter_metric(rounds[-1]),
                                           torch.arange(len(items)).repeat_interleave(self.n))
            if self.multiturn is not None:  # each row's turn and tool counts go with it: the metrics of those trained
                rounds[-1].info[ROW_STATS_KEY] = list(self.multiturn.last_stats)
            kept.append(rounds[-1].select([p for p in range(len(items)) if keep[p * self.n]]))
            dropped.append(rounds[-1].select([p for p in range(len(items)) if not keep[p * self.n]]))
            # [distributed] every rank's (kept, dropped) prompt counts of this round, in rank order
            counts.append(self.dp.gather_objects([(len(kept[-1].items), len(dropped[-1].items))]))
            informative = sum(k for per_rank in counts for k, _ in per_rank)
            at_cap = 0 < filter_cfg.max_num_gen_batches <= len(rounds) or not self.prompts_left()
            if informative >= self.cfg.data.train_batch_size or at_cap:
                break
            items, first_prompt = self.dp.share(self.next_prompts())
        if not filter_cfg.enable:
            batch, metrics = rounds[0], self.multiturn_metrics()
        else:
            batch, metrics, first_prompt = self._kept_batch(rounds, kept, dropped, counts)
        if algo.estimator_needs(self.cfg.algorithm.adv_estimator).greedy_baseline:  # ReMax
            with timer("greedy_baseline"):  # with the weights that sampled the batch (the pipeline's job: its own)
                batch.info[BASELINE_KEY] = row_baselines(self, batch.items, step, self.n)
        if self.run.release_kv_between_phases:  # the planned peaks of the phases after it assume so
            self.engine.release_memory()
        return batch, metrics, first_prompt

    def _kept_batch(self, rounds: list[ScoredRollout], kept: list[ScoredRollout], dropped: list[ScoredRollout],
                    counts: list) -> tuple[ScoredRollout, dict, int]:
        """Dynamic sampling's batch from its rounds, its metrics and the global index of its first prompt."""
        batch, first_prompt = self._kept_prompts(kept, dropped, counts)
        row_stats = batch.info.pop(ROW_STATS_KEY, None)  # multi-turn: the kept rows' (not numbers to train with)
        for part in rounds:
            part.info.pop(ROW_STATS_KEY, None)
        informative = sum(k for per_rank in counts for k, _ in per_rank)
        for key, value in rounds[0].info.items():  # counts (num_errors, ...): each round's once, this rank's
            if not isinstance(value, list):
                batch.info[key] = sum(part.info.get(key, 0) for part in rounds)
        drawn = sum(n_kept + n_dropped for per_rank in counts for n_kept, n_dropped in per_rank)
        topped_up = max(len(batch.items) * self.dp.world - informative, 0)
        if topped_up and self.dp.is_main:
            why = ("the run's last pass over the prompts ended" if not self.prompts_left() else
                   "algorithm.filter_groups.max_num_gen_batches")
            log.warning("dynamic sampling: %d informative prompts after %d generation rounds (%s); topped up with "
                        "%d uninformative ones", informative, len(rounds), why, topped_up)
        acc = self.dp.sum_dict({"sum": float(sum(a for part in rounds for a in part.info["acc"])),
                                "count": float(sum(len(part.info["acc"]) for part in rounds))})
        return batch, {"filter_groups/num_gen_batches": float(len(rounds)),
                       "filter_groups/prompts_drawn": float(drawn),
                       "filter_groups/prompts_informative": float(informative),
                       "filter_groups/prompts_topped_up": float(topped_up),
                       "filter_groups/drawn_acc": acc["sum"] / acc["count"],
                       **(multiturn_metrics(self.dp.gather_objects(row_stats)) if row_stats is not None else {})}, \
            first_prompt

    def multiturn_metrics(self) -> dict:
        """Turn, tool-call, tool-error and tool-latency summaries of the last rollout (multi-turn runs); with
        defer_tool_stats the rows' statistics themselves (JSON-able: a checkpoint may keep them)."""
        if self.multiturn is None:
            return {}
        if self.defer_tool_stats:
            return {TOOL_ROWS_KEY: [asdict(stats) for stats in self.multiturn.last_stats]}
        return multiturn_metrics(self.dp.gather_objects(self.multiturn.last_stats))  # [distributed] every rank's rows

    def finish_tool_stats(self, metrics: dict) -> dict:
        """[async] A deferred rollout's metrics with its rows' tool statistics summarised over every rank's rows
        (a collective: every rank calls it for the same step, on the trainer's thread)."""
        if TOOL_ROWS_KEY not in metrics:
            return metrics
        rows = [RowStats(**stats) for stats in metrics[TOOL_ROWS_KEY]]
        rest = {key: value for key, value in metrics.items() if key != TOOL_ROWS_KEY}
        return {**rest, **multiturn_metrics(self.dp.gather_objects(rows))}

    def _kept_prompts(self, kept: list[ScoredRollout], dropped: list[ScoredRollout],
                      counts: list[list[tuple[int, int]]]) -> tuple[ScoredRollout, int]:
        """The first train_batch_size prompts of the pool one process builds (every round's kept prompts, then
        every round's dropped ones; within a round, rank order is global prompt order) and the global index of the
        first: this rank's even block of them. [distributed] prompts move to the rank whose block holds them."""
        world, rank, pad = self.dp.world, self.dp.rank, self.tokenizer.pad_token_id
        # pool offset of each (dropped?, round, rank) segment: kept segments first, then dropped ones
        offsets, position = {}, 0
        for is_dropped in (False, True):
            for r, per_rank in enumerate(counts):
                for k, per_rank_counts in enumerate(per_rank):
                    offsets[(is_dropped, r, k)] = position
                    position += per_rank_counts[is_dropped]
        chosen = min(int(self.cfg.data.train_batch_size), position)
        chosen -= chosen % world  # [distributed] even blocks (one process: all of them)
        if chosen == 0:
            raise UserError(f"dynamic sampling drew {position} prompts, fewer than the {world} ranks: raise "
                            "data.gen_batch_size or algorithm.filter_groups.max_num_gen_batches")
        block = chosen // world
        local = [(offsets[(is_dropped, r, rank)] + j, part, j)
                 for is_dropped, parts in ((False, kept), (True, dropped)) for r, part in enumerate(parts)
                 for j in range(len(part.items))]
        # [distributed] every rank's chosen prompts go to every rank (one process: its own), each keeps its block
        pieces = self.dp.gather_objects([(p, part.select([j])) for p, part, j in local if p < chosen])
        ordered = sorted((piece for piece in pieces if rank * block <= piece[0] < (rank + 1) * block),
                         key=lambda piece: piece[0])
        return ScoredRollout.concat([part for _, part in ordered], pad), rank * block

    def truncated_loss_mask(self, rollout: RolloutBatch) -> tuple[Optional[torch.Tensor], dict]:
        """TRL's mask_truncated_completions: the response mask without responses cut off by the length limit."""
        if not self.cfg.algorithm.mask_truncated_completions:
            return None, {}
        eos_ids = getattr(self.engine, "eos_ids", None) or collect_eos_ids(self.tokenizer, self.actor)  # the engine's
        truncated = algo.truncated_rows(rollout.response_ids, rollout.response_mask, self.response_length, eos_ids)
        stops = StopStringMatcher(self.tokenizer, as_list(self.cfg.actor_rollout_ref.rollout.stop))
        if stops:  # a response that ends on a stop string exactly at the limit was finished, not cut off
            for row in truncated.nonzero().flatten().tolist():
                truncated[row] = not stops.ends_with_stop(rollout.response_ids[row].tolist())
        loss_mask = rollout.response_mask.float() * (~truncated).float().unsqueeze(-1)
        return loss_mask, {"response_length/truncated_masked": float(truncated.float().mean())}
