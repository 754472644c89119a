"""Split placement for one_step_off: a rollout rank generates while the trainer rank trains.

The trainer rank runs the usual run (RLTrainer) with `SplitRolloutPipeline`: where the one-process pipeline would
start the next step's rollout on its own weight copy, it sends the prompts to the rollout rank and broadcasts the
actor's weights to it (NCCL on GPUs, gloo on CPUs); the rollout rank (`serve_rollouts`) generates and scores them
with the same seeds and sends the scored batch back. The trainer rank trains meanwhile, so the two phases overlap
on two devices, and the batches, the weights that made them and the metrics are those of a one-process one_step_off
run. `split_run.run_split` starts both roles in one job (world 2: rank 0 trains, rank 1 rolls out).

`rlanywhere train` under torchrun with 2 ranks runs it (split_run.run_split_rank). Not yet here: several trainer
ranks (data parallelism among them), several rollout ranks.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from concurrent.futures import Future
from typing import Any, Optional

import torch
import torch.distributed as dist

from .async_pipeline import RolloutPipeline, _Job, _prompt_keys
from .async_plan import SPLIT, SYNC

log = logging.getLogger(__name__)

TRAINER_RANK, ROLLOUT_RANK = 0, 1
_OPEN: "weakref.WeakSet[SplitRolloutPipeline]" = weakref.WeakSet()  # pipelines whose rollout rank still serves


def _broadcast_weights(model: torch.nn.Module, src: int) -> None:
    """Every parameter and buffer from `src` to the other rank, in state_dict order (both hold the same model)."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=src)


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
    """The trainer rank's pipeline: rollouts are generated on the rollout rank (validation stays on this one)."""

    def __init__(self, cfg: Any, plan: Any, actor, loader, total_steps: int):
        plan.async_rollout = "in turn"  # no local thread: the other rank is the overlap
        super().__init__(cfg, plan, actor, loader, total_steps)
        plan.async_rollout = SPLIT
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
            dist.send_object_list([("generate", step, items, first_prompt)], dst=ROLLOUT_RANK)
            _broadcast_weights(self.actor, src=TRAINER_RANK)
            job = _Job(step, step if weights_step is None else weights_step, _prompt_keys(items),
                       _RemoteResult(ROLLOUT_RANK, stops))
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
            dist.send_object_list([("stop",)], dst=ROLLOUT_RANK)


def close_split_pipelines() -> None:
    """End the rollout rank's loop of every split pipeline not closed yet (a run that ended early, or failed)."""
    for pipeline in list(_OPEN):
        pipeline.close()


def serve_rollouts(cfg: Any, plan: Any) -> int:
    """The rollout rank: generate and score what the trainer rank sends, with the weights it broadcasts, until told
    to stop. Returns the number of rollouts made."""
    from . import builders
    from .distributed import DataParallel
    from .oom import OOMGuard
    from .rollout_phase import RolloutPhase
    from .async_pipeline import _WallTimer

    source, tokenizer = builders.build_tokenizer(cfg)
    model = builders.build_models(cfg, plan, source, DataParallel(device=plan.device)).actor
    model.requires_grad_(False)
    engine = builders.build_engine(cfg, plan, model, tokenizer)
    rewards = builders.build_reward_manager(cfg)
    oom = OOMGuard(plan.sizes, log_fn=lambda msg: log.warning("%s", msg), enabled=cfg.hardware.oom_recovery)

    def no_more_prompts() -> list[dict]:
        raise RuntimeError("the rollout rank draws no prompts of its own")

    phase = RolloutPhase(cfg, plan, engine, model, tokenizer, rewards, oom, no_more_prompts)
    made = 0
    try:
        while True:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=TRAINER_RANK)
            if box[0][0] == "stop":
                return made
            _, step, items, first_prompt = box[0]
            _broadcast_weights(model, src=TRAINER_RANK)
            engine.sync_weights()
            result = phase.rollout_and_score(items, _WallTimer(), step, first_prompt)
            dist.send_object_list([result], dst=TRAINER_RANK)
            made += 1
    finally:
        rewards.close()


def rollout_pipeline_for_run(cfg: Any, plan: Any, actor, loader, total_steps: int,
                             share=None) -> Optional[RolloutPipeline]:
    """The pipeline a run asks for (trainer.async as planned): None for sync, the split one when a rollout rank
    generates, else the pipeline of this process ([distributed] `share`: this rank's share of a step's prompts)."""
    if plan.async_rollout == SYNC:
        return None
    if plan.async_rollout == SPLIT:
        return SplitRolloutPipeline(cfg, plan, actor, loader, total_steps)
    return RolloutPipeline(cfg, plan, actor, loader, total_steps, share)

__all__ = ["SPLIT", "SplitRolloutPipeline", "close_split_pipelines", "rollout_pipeline_for_run", "serve_rollouts"]
