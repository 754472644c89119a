"""Split placement for one_step_off: rollout ranks generate while the trainer ranks train.

The trainer ranks run the usual run (RLTrainer) with `SplitRolloutPipeline`: where the one-process pipeline would
start the next step's rollout on its own weight copy, each trainer rank sends its share of the prompts to its
rollout rank, and the first trainer rank broadcasts the actor's weights to the rollout ranks (NCCL on GPUs, gloo on
CPUs); each rollout rank (`serve_rollouts`) generates and scores its trainer ranks' shares in one call
(`rollout_shares`) with the same seeds and sends each its scored share back. The trainer ranks train meanwhile
(among themselves, as data parallelism does), so the phases overlap on different devices, and the batches, the
weights that made them and the metrics are those of a one-process one_step_off run. The ranks (`SplitLayout`):
0..T-1 train, T..T+R-1 generate, each rollout rank for a contiguous block of T/R trainer ranks. `split_run` starts
the roles (`rlanywhere train` under torchrun, or `run_split` from Python).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .async_pipeline import RolloutPipeline, _Job, _prompt_keys, cut_into_shares, timed_rollout
from .async_plan import SPLIT, SYNC

log = logging.getLogger(__name__)

TRAINER_RANK = 0  # the trainer rank that broadcasts the weights
_OPEN: "weakref.WeakSet[SplitRolloutPipeline]" = weakref.WeakSet()  # pipelines whose rollout rank still serves


@dataclass(frozen=True)
class SplitLayout:
    """Ranks 0..trainers-1 train; the `rollout` ranks after them only generate, rollout rank `trainers + j` for the
    trainer ranks of block j (contiguous, trainers // rollout of them)."""

    trainers: int = 1
    rollout: int = 1

    @property
    def world(self) -> int:
        return self.trainers + self.rollout

    def rollout_rank_of(self, trainer: int) -> int:
        return self.trainers + trainer // (self.trainers // self.rollout)

    def trainers_of(self, rollout_rank: int) -> list[int]:
        per = self.trainers // self.rollout
        block = rollout_rank - self.trainers
        return list(range(block * per, (block + 1) * per))

    def weight_ranks(self) -> list[int]:
        """The ranks of the weight broadcast: the first trainer rank and every rollout rank."""
        return [TRAINER_RANK, *range(self.trainers, self.world)]


# this process's place in the split job (split_run.join_split): its layout, the weight broadcast's process group
# (None: the whole job) and its rank; one trainer and one rollout rank unless told otherwise
_PLACE: dict[str, Any] = {"layout": SplitLayout(), "weights_group": None, "rank": TRAINER_RANK}


def join_split(layout: SplitLayout, weights_group: Any, rank: int) -> None:
    _PLACE.update(layout=layout, weights_group=weights_group, rank=rank)


def make_split_groups(layout: SplitLayout) -> tuple[Any, Any]:
    """(the trainer ranks' process group or None for one trainer rank, the weight broadcast's or None when it is the
    whole job). Collective: every rank of the job calls it, in the same order."""
    trainers = dist.new_group(list(range(layout.trainers))) if layout.trainers > 1 else None
    weights = layout.weight_ranks()
    return trainers, (dist.new_group(weights) if len(weights) < layout.world else None)


def _broadcast_weights(model: torch.nn.Module, src: int, group: Any = None) -> None:
    """Every parameter and buffer from `src` to the group's other ranks, in state_dict order (all hold the same
    model)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=src, group=group)


@contextlib.contextmanager
def _not_dropped(stops):
    """No stop signal drops the step in here (the trainer's RunStops): a message half sent or half received would
    leave the two ranks out of step. A signal received meanwhile lets the step finish; the run stops after it."""
    signals = getattr(stops, "signals", None)
    if signals is None or not signals.droppable:
        yield
        return
    signals.droppable = False
    try:
        yield
    finally:
        signals.droppable = signals.received is None


class _RemoteResult(Future):
    """A rollout running on the rollout rank: its scored batch arrives on the first `result()` (and is kept)."""

    def __init__(self, src: int, stops=None):
        super().__init__()
        self.src, self.stops, self.received = src, stops, None

    def result(self, timeout=None):  # noqa: ARG002 - the collective has its own timeout
        if self.received is None:
            with _not_dropped(self.stops):
                box: list[Any] = [None]
                dist.recv_object_list(box, src=self.src)
                self.received = (box[0],)
        return self.received[0]


class SplitRolloutPipeline(RolloutPipeline):
    """A trainer rank's pipeline: its share of each rollout is generated on its rollout rank (validation stays on
    this one)."""

    def __init__(self, cfg: Any, plan: Any, actor, loader, total_steps: int, share=None):
        if not dist.is_initialized():
            from .errors import UserError

            raise UserError("the split placement (trainer.async.rollout_ranks >= 1) runs as a job of several ranks: "
                            "start it with `rlanywhere train` (it launches the ranks) or torchrun, or from Python with "
                            "split_run.run_split in each rank's process")
        # the other ranks overlap; this rank's engine (validation only) reads the actor itself: no second copy
        super().__init__(cfg, plan, actor, loader, total_steps, share, overlap=False, own_weights=False)
        layout, self.rank = _PLACE["layout"], _PLACE["rank"]
        self.rollout_rank, self.weights_group = layout.rollout_rank_of(self.rank), _PLACE["weights_group"]
        self.closed = False
        _OPEN.add(self)

    def rollout_and_score(self, items: list[dict], timer, step: int = 0, first_prompt: int = 0):
        result = super().rollout_and_score(items, timer, step, first_prompt)
        if step + 1 >= self.total_steps and not self.jobs:  # the last batch is here: the rollout rank may go
            self.close()
        return result

    def _start(self, step: int, items: list[dict], first_prompt: int, background: bool = False,
               weights_step: Optional[int] = None) -> _Job:
        stops = getattr(self, "stops", None)
        with _not_dropped(stops):  # the request, the weights and the job that expects the answer: all or none
            dist.send_object_list([("generate", step, items, first_prompt)], dst=self.rollout_rank)
            if self.rank == TRAINER_RANK:  # the trainer ranks hold the same weights: the first sends them
                _broadcast_weights(self.actor, src=TRAINER_RANK, group=self.weights_group)
            job = _Job(step, step if weights_step is None else weights_step, _prompt_keys(items),
                       _RemoteResult(self.rollout_rank, stops))
            self.jobs[step] = job  # also this step's own: a checkpoint must receive every answer on its way
        if background:
            self._publish_busy()
        return job

    def close(self) -> None:
        """The rollout rank's loop ends (after the rollouts in flight were received). Once."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        for job in self.jobs.values():
            job.wait()
        with _not_dropped(getattr(self, "stops", None)):
            dist.send_object_list([("stop",)], dst=self.rollout_rank)


def close_split_pipelines() -> None:
    """End the rollout rank's loop of every split pipeline not closed yet (a run that ended early, or failed)."""
    for pipeline in list(_OPEN):
        pipeline.close()


def serve_rollouts(cfg: Any, plan: Any, trainers: tuple[int, ...] | list[int] = (TRAINER_RANK,),
                   weights_group: Any = None) -> int:
    """A rollout rank: generate and score the shares its trainer ranks (`trainers`) send, with the weights the first
    trainer rank broadcasts (over `weights_group`), until they say stop. Returns the number of rollouts made."""
    from . import builders
    from .distributed import DataParallel
    from .oom import OOMGuard
    from .rollout_phase import RolloutPhase

    source, tokenizer = builders.build_tokenizer(cfg)
    model = builders.build_models(cfg, plan, source, DataParallel(device=plan.device), actor_only=True).actor
    model.requires_grad_(False)
    engine = builders.build_engine(cfg, plan, model, tokenizer)
    rewards = builders.build_reward_manager(cfg, plan)  # a reward model too, where the run has one
    oom = OOMGuard(plan.sizes, log_fn=lambda msg: log.warning("%s", msg), enabled=cfg.hardware.oom_recovery)

    def no_more_prompts() -> list[dict]:
        raise RuntimeError("the rollout rank draws no prompts of its own")

    phase = RolloutPhase(cfg, plan, engine, model, tokenizer, rewards, oom, no_more_prompts)
    phase.defer_tool_stats = True  # the trainer ranks summarise the multi-turn statistics over all their rows
    made = 0
    try:
        while True:
            requests = []
            for trainer in trainers:  # each trainer rank's share of the same step
                box: list[Any] = [None]
                dist.recv_object_list(box, src=trainer)
                requests.append(box[0])
            kinds = {request[0] for request in requests}
            if kinds == {"stop"}:
                return made
            if "stop" in kinds:
                raise RuntimeError(f"the trainer ranks {list(trainers)} are out of step: some stopped, some asked "
                                   "for a rollout")
            _broadcast_weights(model, src=TRAINER_RANK, group=weights_group)
            engine.sync_weights()
            # every share made before any is sent: a trainer rank that receives its own goes on to train with the
            # others, which wait for theirs
            results = rollout_shares(phase, [request[1:] for request in requests])
            for trainer, result in zip(trainers, results):
                dist.send_object_list([result], dst=trainer)
            made += 1
    finally:
        rewards.close()


def rollout_shares(phase, requests: list[tuple[int, list[dict], int]]) -> list[tuple]:
    """The (step, items, first prompt) shares of a rollout rank's trainer ranks, generated and scored in one call
    and cut back into (scored share, metrics, first prompt) each. Their prompts are one contiguous block of the step,
    so every row draws what a call of its own would (its random stream is keyed by its global prompt and sample),
    and one larger batch decodes faster than the shares one after another (cut_into_shares: the call's reward
    counts go with the first share, so that their sum over the trainer ranks stays the batch's)."""
    step, firsts = requests[0][0], [first for _, _, first in requests]
    sizes = [len(items) for _, items, _ in requests]
    if any(firsts[k + 1] != firsts[k] + sizes[k] for k in range(len(requests) - 1)):  # not one block: one by one
        return [timed_rollout(phase, items, step, first) for step, items, first in requests]
    items = [item for _, share, _ in requests for item in share]
    scored, metrics, _ = timed_rollout(phase, items, step, firsts[0])
    return [(part, share_metrics, first)
            for (part, share_metrics), first in zip(cut_into_shares(scored, metrics, sizes), firsts)]


def rollout_pipeline_for_run(cfg: Any, plan: Any, actor, loader, total_steps: int,
                             share=None) -> Optional[RolloutPipeline]:
    """The pipeline a run asks for (trainer.async as planned): None for sync, the split one when a rollout rank
    generates, else the pipeline of this process ([distributed] `share`: this rank's share of a step's prompts)."""
    if plan.async_rollout == SYNC:
        return None
    if plan.async_rollout == SPLIT:
        return SplitRolloutPipeline(cfg, plan, actor, loader, total_steps, share)
    return RolloutPipeline(cfg, plan, actor, loader, total_steps, share)

__all__ = ["SPLIT", "SplitLayout", "SplitRolloutPipeline", "close_split_pipelines", "join_split", "make_split_groups",
           "rollout_pipeline_for_run", "rollout_shares", "serve_rollouts"]
