"""Rollout off the critical path (`trainer.async.mode=one_step_off`): the rollout of step k+1 runs with the weights
of step k while step k's update runs.

A synchronous step generates, scores, computes log-probs and updates one after another. Here the pipeline keeps the
next step's rollout in flight:

    step k:  take batch k (generated with the weights of step k-1; step 0's with the initial ones)
             copy the actor's weights (step k's) into the rollout model      <- the engine's own weight copy
             start the rollout of batch k+1 on that copy                     <- on its own CUDA stream, in a thread
             train on batch k -> the weights of step k+1                     <- meanwhile

so each trained batch is at most one policy version stale (verl's one-step-off-policy recipe, on one GPU). With
`trainer.async.max_staleness=K` the rollouts of the next K steps are kept in flight (each batch K versions old); one
queued behind a running one loads a snapshot of the weights it was started with when its turn comes. The
correction for that staleness is the rollout correction (rollout_correction.py: truncated importance weights between
the rollout's and the trainer's log-probs). Whether the two phases truly overlap on the card is the planner's
decision (`plan_async_rollout`: it must pay and fit: two weight copies, the KV cache and the update's memory at
once); otherwise, and always on a CPU, the same pipeline runs in turn: the same batches from the same weights, so the
samples and metrics do not depend on the overlap (the CPU tests cover the pipeline's logic).

The reference model never changes, so where the plan says so (plan.ref_with_rollout: a reference of its own, not
parked on the CPU) its log-probs of a batch are computed in the same job, right after the rollout, instead of in the
step that trains on the batch: with a KL term that forward leaves each step's critical path too.

Checkpoints stay exact: a save finishes the rollout in flight and stores it (the rollout of the next step, made
with weights no checkpoint holds); a resumed run trains on it instead of generating it again. A stop signal that
drops a step keeps its finished rollout too.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .async_plan import OVERLAPPED
from .oom import is_oom_error
from .rollout.base import RolloutBatch
from .rollout_phase import TOOL_ROWS_KEY
from .stepbatch import ScoredRollout

log = logging.getLogger(__name__)

# By default (trainer.async.priority=rollout) the rollout's stream runs at a higher priority than the update's: a
# decode step is a chain of short kernels (one CUDA graph replay per token), each of which would otherwise queue
# behind the update's GEMM blocks. Measured on an H200 (bench/async_overlap.py) it changes little: the block
# scheduler cannot take SMs back from GEMM blocks already running, so a decode kernel still waits for some to finish
# (docs/async.md, "Why the phases slow each other"). With priority=update the training step runs on a stream of its
# own at that priority instead, the rollout's at the default: for a job whose rollout has time to spare beside the
# update, the step's critical path.
HIGH_STREAM_PRIORITY = -1  # CUDA stream priority: lower is higher; 0 is the default streams'


# a background job's generation seconds (its rollout phase alone, no scoring): the batch's rollout tokens/s
GENERATE_S = "async/generate_s"


def allow_compiled_calls_beside_tracing() -> None:
    """Let this thread call compiled ops while the other one compiles. torch.compile traces with FX, and FX's
    "tracing" flag is one for the whole process: a compiled decode op that the rollout's thread calls while the
    update compiles (or a compiled training op the trainer calls while a new decode shape compiles) refuses to run
    ("Detected that you are using FX to symbolically trace a dynamo-optimized function") and the run stops. Told not
    to refuse, that call runs its Python code uncompiled instead: the same result (the trace in the other thread
    does not record it: its modes are per thread), a little slower, and only while a compile is under way. Called on
    both threads: recent PyTorch keeps this setting per thread."""
    import torch._dynamo

    torch._dynamo.config.error_on_nested_fx_trace = False


# ---------------------------------------------------------------------------------------------------- checkpoints
def _tensor_state(tensor: torch.Tensor) -> dict:
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "values": tensor.flatten().tolist()}


def _tensor_from(state: dict) -> torch.Tensor:
    return torch.tensor(state["values"], dtype=getattr(torch, state["dtype"])).reshape(state["shape"])


_ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "response_logprobs")


def scored_state(scored: ScoredRollout) -> dict:
    """A scored rollout as JSON-able data (trainer_state.json): exact (float32 values round-trip through JSON)."""
    rollout = scored.rollout
    state = {"items": scored.items, "info": scored.info, "scores": _tensor_state(scored.scores),
             "rollout": {**{name: _tensor_state(getattr(rollout, name)) for name in _ROLLOUT_TENSORS},
                         "num_prompts": rollout.num_prompts, "n": rollout.n}}
    if scored.ref_logprobs is not None:
        state["ref_logprobs"] = _tensor_state(scored.ref_logprobs)
    return state


def scored_from(state: dict) -> ScoredRollout:
    saved = state["rollout"]
    rollout = RolloutBatch(**{name: _tensor_from(saved[name]) for name in _ROLLOUT_TENSORS},
                           num_prompts=saved["num_prompts"], n=saved["n"])
    ref = _tensor_from(state["ref_logprobs"]) if "ref_logprobs" in state else None
    return ScoredRollout(state["items"], rollout, _tensor_from(state["scores"]), state["info"], ref)


def cut_into_shares(whole: ScoredRollout, metrics: dict, sizes: list[int]) -> list[tuple[ScoredRollout, dict]]:
    """(scored share, its metrics) for consecutive shares of `sizes` prompts of `whole`: each as wide as its rows
    need (as a rollout of just them would be), the multi-turn rows' tool statistics with their rows, and the reward
    counts (num_errors) with the first share, so that their sum over the shares stays the whole's."""
    n, start, shares = whole.rollout.n, 0, []
    for k, size in enumerate(sizes):
        part = whole.select(list(range(start, start + size)))
        part.rollout = part.rollout.narrowed()
        if part.ref_logprobs is not None:
            part.ref_logprobs = part.ref_logprobs[:, :part.rollout.response_ids.shape[1]]
        if k:
            part.info = {key: value if isinstance(value, list) else type(value)(0) for key, value in part.info.items()}
        share_metrics = dict(metrics)
        if TOOL_ROWS_KEY in metrics:
            share_metrics[TOOL_ROWS_KEY] = metrics[TOOL_ROWS_KEY][start * n:(start + size) * n]
        shares.append((part, share_metrics))
        start += size
    return shares


# ---------------------------------------------------------------------------------------------------- the loader
class LookaheadLoader:
    """The prompt loader, able to draw the prompts of the steps to come early (`peek`). Its state, its epoch and the
    batch `next_batch` returns are those of the step being trained: a checkpoint resumes at the first peeked batch."""

    def __init__(self, loader, on_rewind=None):
        self.inner = loader
        self.ahead: list[tuple[list[dict], dict]] = []  # peeked batches, each with the state before drawing it
        self.on_rewind = on_rewind  # called when a dropped step rewinds the loader

    def next_batch(self) -> list[dict]:
        if self.ahead:
            return self.ahead.pop(0)[0]
        return self.inner.next_batch()

    def peek(self, steps: int = 1) -> list[dict]:
        """The batch `steps` steps after the one being trained (1: the next one)."""
        while len(self.ahead) < steps:
            state = self.inner.state_dict()
            self.ahead.append((self.inner.next_batch(), state))
        return self.ahead[steps - 1][0]

    def state_dict(self) -> dict:
        return dict(self.ahead[0][1]) if self.ahead else self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.ahead = []
        self.inner.load_state_dict(state)
        if self.on_rewind is not None:
            self.on_rewind()

    @property
    def epoch(self) -> int:
        return int(self.ahead[0][1]["epoch"]) if self.ahead else self.inner.epoch

    def batches_drawn(self) -> int:
        """The batches of the steps trained and being trained (not those peeked)."""
        state = self.state_dict()
        return int(state["epoch"]) * self.inner.steps_per_epoch + int(state["position"])

    def __getattr__(self, name: str):  # batch_size, steps_per_epoch, ...
        if name in ("ahead", "inner", "on_rewind"):  # before __init__ set them (copy, pickle)
            raise AttributeError(name)
        return getattr(self.inner, name)


# ---------------------------------------------------------------------------------------------------- the pipeline
class _WallTimer:
    """The rollout phase's timer inside a pipeline job: wall seconds per phase, no device synchronisation."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - start


def timed_rollout(phase, items: list[dict], step: int, first_prompt: int) -> tuple[ScoredRollout, dict, int]:
    """phase.rollout_and_score with the generation's own seconds in its metrics (GENERATE_S: no scoring), for a
    rollout made away from the step that trains on it (a pipeline job, a rollout rank)."""
    timer = _WallTimer()
    scored, metrics, first = phase.rollout_and_score(items, timer, step, first_prompt)
    return scored, {**metrics, GENERATE_S: timer.times.get("rollout", 0.0)}, first


@dataclass
class _Job:
    """One step's rollout: its prompts, the step whose weights generated it, and the result (a future while it
    runs in the background)."""

    step: int
    weights_step: int
    keys: list
    result: Any  # Future | tuple(scored, metrics, first_prompt)
    seconds: float = 0.0

    def wait(self) -> tuple[ScoredRollout, dict, int]:
        if isinstance(self.result, Future):
            self.result = self.result.result()
        return self.result


def _run_now(work: Callable[[], Any]) -> Future:
    """`work` run now, as a finished future holding its result or its error."""
    future: Future = Future()
    try:
        future.set_result(work())
    except Exception as err:  # noqa: BLE001 - kept for whoever waits on the job
        future.set_exception(err)
    return future


def _prompt_keys(items: list[dict]) -> list:
    return [(item.get("index"), list(item["input_ids"])) for item in items]


class _LockedRewards:
    """The reward manager called from one thread at a time (the pipeline scores while validation may)."""

    def __init__(self, manager):
        self.manager, self.lock = manager, threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock:
            return self.manager(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.manager, name)


def rollout_model_copy(actor: nn.Module) -> nn.Module:
    """The engine's own weights: a frozen copy of the actor, refreshed from it before each rollout starts."""
    model = copy.deepcopy(actor)
    model.requires_grad_(False)
    return model.eval()


def copy_weights(source: nn.Module | dict, target: nn.Module) -> None:
    """target's parameters and buffers <- source's (a module or a state dict), in place (the engine's tensors keep
    their addresses)."""
    with torch.no_grad():
        target_state = target.state_dict()
        for name, tensor in (source if isinstance(source, dict) else source.state_dict()).items():
            target_state[name].copy_(tensor)


class RolloutPipeline:
    """one_step_off for the trainer: stands in for its RolloutPhase (same calls), keeping the next rollout in flight.

    Built before the engine (`model` is what the engine must be built on), then `attach`ed to the RolloutPhase.
    `share(items) -> (this rank's items, the global index of its first)`: [distributed] the trainer's
    DataParallel.share, so that each rank generates its share of the steps to come (one process: all of them)."""

    def __init__(self, cfg: Any, plan: Any, actor: nn.Module, loader, total_steps: int,
                 share: Callable[[list], tuple[list, int]] | None = None, overlap: bool | None = None,
                 own_weights: bool = True):
        self.cfg, self.plan, self.actor, self.total_steps = cfg, plan, actor, total_steps
        self.share = share or (lambda items: (items, 0))
        # rollouts kept ahead of the step being trained: each batch is made with weights this many updates old
        self.depth = int(cfg.trainer["async"].max_staleness)
        # on a thread beside the update, as planned (`overlap` for a subclass whose rollouts run elsewhere)
        self.overlap = plan.async_rollout == OVERLAPPED if overlap is None else overlap
        # the engine's weights: a copy of the actor's (`own_weights=False`, for a subclass whose rollouts run
        # elsewhere: the actor itself, which only validation reads, between updates)
        self.model = rollout_model_copy(actor) if own_weights else actor
        self.loader = LookaheadLoader(loader, on_rewind=self._restore_taken)
        self.jobs: dict[int, _Job] = {}
        self.taken: Optional[tuple[int, _Job]] = None  # the batch handed to the step being trained
        self.settled = False  # the engine holds the actor's weights as they are now (until the next step starts)
        self.phase = None
        self.engine = None
        # plan.ref_with_rollout: the reference's log-probs of a scored batch (the trainer's pass), or None
        self.reference_pass: Callable[[ScoredRollout], torch.Tensor] | None = None
        self.reference_oom_warned = False
        self.executor: Optional[ThreadPoolExecutor] = None
        self.stream = None  # the rollout's CUDA stream
        self.update_stream = None  # the training step's, with trainer.async.priority=update
        if self.overlap:
            allow_compiled_calls_beside_tracing()  # the trainer's thread (this one) and the rollout's, below
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout",
                                               initializer=allow_compiled_calls_beside_tracing)
            if str(plan.device).startswith("cuda"):
                update_first = plan.update_stream_first
                self.stream = torch.cuda.Stream(plan.device, priority=0 if update_first else HIGH_STREAM_PRIORITY)
                if update_first:
                    self.update_stream = torch.cuda.Stream(plan.device, priority=HIGH_STREAM_PRIORITY)

    def attach(self, phase, engine, run_state=None, stops=None, reference_pass=None) -> "RolloutPipeline":
        """Stand in for `phase`; `run_state` (the trainer's RunState) learns when the engine is busy in the
        background, so that OOM relief never frees the KV cache of a rollout in flight; `stops` (its RunStops):
        what a stop signal may drop (the split placement keeps its messages whole); `reference_pass` (with
        plan.ref_with_rollout): the reference's log-probs of a scored batch, computed by each job after its rollout,
        without the OOM guard's retries."""
        self.phase, self.engine, self.run_state, self.stops = phase, engine, run_state, stops
        self.reference_pass = reference_pass
        phase.reward_manager = _LockedRewards(phase.reward_manager)
        # [distributed] a job gathers nothing over the ranks (it may run beside the trainer's collectives): its
        # multi-turn statistics are summarised when the step takes its batch
        phase.defer_tool_stats = True
        return self

    @contextlib.contextmanager
    def step_stream(self):
        """Around a training step: with trainer.async.priority=update, the step's kernels on the high-priority
        stream, ordered after the work queued before it and before the work queued after it."""
        if self.update_stream is None:
            yield
            return
        outer = torch.cuda.current_stream(self.plan.device)
        self.update_stream.wait_stream(outer)
        try:
            with torch.cuda.stream(self.update_stream):
                yield
        finally:
            outer.wait_stream(self.update_stream)

    def _publish_busy(self) -> None:
        if getattr(self, "run_state", None) is not None:
            self.run_state.engine_busy = self.overlap and bool(self.jobs)

    # ------------------------------------------------------------------------------------------ the trainer's calls
    def rollout_and_score(self, items: list[dict], timer, step: int = 0,
                          first_prompt: int = 0) -> tuple[ScoredRollout, dict, int]:
        """Step `step`'s scored batch (started `depth` steps ago, or now when none is: the first step, a resumed run
        without a saved one), after starting the rollouts of the steps to come (up to `depth` ahead) from the weights
        as they are now."""
        self.settled = False
        self.taken = None  # the previous step was trained (a dropped one gave its batch back on rewinding)
        job = self.jobs.get(step)
        if job is None or job.keys != _prompt_keys(items):
            with timer("rollout"):
                job = self._start(step, items, first_prompt)
        with timer("rollout_wait"):
            scored, metrics, first = job.wait()
        for ahead in range(1, self.depth + 1):
            later = step + ahead
            if later < self.total_steps and later not in self.jobs:
                # beside the update: the weight copy only; in turn: the whole rollout of the next batch
                with timer("rollout_weight_sync" if self.executor is not None else "rollout"):
                    self._start(later, *self.share(self.loader.peek(ahead)), background=True, weights_step=step)
        # kept until now: a step dropped by a stop signal before this point finds its batch again, and one dropped
        # later (before its update) gets it back when the trainer rewinds the loader (`_restore_taken`)
        self.taken = (step, job)
        self.jobs.pop(step, None)
        self._publish_busy()
        metrics = {**self.phase.finish_tool_stats(metrics), "async/staleness": float(step - job.weights_step),
                   "async/rollout_s": job.seconds}
        return scored, metrics, first

    def truncated_loss_mask(self, rollout):
        return self.phase.truncated_loss_mask(rollout)

    def shutdown(self) -> None:
        """The background thread ends (a rollout in flight finishes first, while the reward manager is open)."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None

    def step_trained(self) -> None:
        """The step that took its batch finished: a stop signal that drops the next step before it takes its own
        rewinds the loader to that next step, and must not put this batch back."""
        self.taken = None

    def weights_changed(self) -> None:
        """The actor was updated: the engine's copy is no longer settled on its weights (validation refreshes it)."""
        self.settled = False

    def settle(self) -> None:
        """Finish the rollout in flight and give the engine the actor's current weights (before validation)."""
        if self.settled:
            return
        for job in self.jobs.values():
            job.wait()
        self._refresh()
        self.settled = True

    def __getattr__(self, name: str):
        """Validation's calls (generate, sampling_params, score, ...): the engine settled on the current weights."""
        if name.startswith("__") or name in ("phase", "jobs", "settled", "stops", "taken") or \
                self.__dict__.get("phase") is None:
            raise AttributeError(name)
        self.settle()
        return getattr(self.phase, name)

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The finished rollouts of the steps to come (the one in flight is finished first). A rollout that failed
        is left out, so that the checkpoint of the step that trained is still written: its error is raised when its
        step needs the batch, and a resumed run generates the batch again."""
        saved = {}
        for step, job in self.jobs.items():
            try:
                scored, metrics, first = job.wait()  # its seconds are known once it has finished
            except Exception as err:  # noqa: BLE001 - raised again by the step that waits for it
                log.warning("the rollout for step %d failed (%s: %s); the checkpoint leaves it out", step,
                            type(err).__name__, err)
                continue
            saved[str(step)] = {"weights_step": job.weights_step, "seconds": job.seconds,
                                "scored": scored_state(scored), "metrics": metrics, "first_prompt": first}
        return saved

    def load_state_dict(self, state: Optional[dict]) -> None:
        jobs = {}
        for step, saved in (state or {}).items():
            scored = scored_from(saved["scored"])
            jobs[int(step)] = _Job(int(step), saved["weights_step"], _prompt_keys(scored.items),
                                   (scored, saved["metrics"], saved["first_prompt"]), saved["seconds"])
        self.jobs = self._within_staleness(jobs)
        self._publish_busy()

    def _within_staleness(self, jobs: dict[int, _Job]) -> dict[int, _Job]:
        """The saved rollouts, or none where one is staler than this run allows (trainer.async.max_staleness
        lowered on resume): the resumed run generates them again from its weights."""
        stale = sorted(step for step, job in jobs.items() if step - job.weights_step > self.depth)
        if stale:
            log.warning("the checkpoint's rollouts for steps %s are more than trainer.async.max_staleness=%d policy "
                        "versions old: generated again", stale, self.depth)
            return {}
        return jobs

    def load_rank_states(self, states: list[dict], rank: int, world: int, pad_token_id: int) -> None:
        """[distributed] Resume from the pipelines of the ranks that saved (`states`, in rank order): this rank's
        own where the world is the same; else each step's batches joined into the whole step's and this rank's
        share of it taken, so that a run resumed on another number of ranks trains on the same batches (each row
        drew from its own random stream, so they are the ones any split would have made)."""
        if len(states) == world:
            self.load_state_dict(states[rank])
            return
        jobs: dict[int, _Job] = {}
        for step in set.intersection(*(set(state) for state in states)) if states else ():
            parts = [state[step] for state in states]
            whole = ScoredRollout.concat([scored_from(part["scored"]) for part in parts], pad_token_id)
            metrics = dict(parts[0]["metrics"])
            if TOOL_ROWS_KEY in metrics:  # multi-turn: every row's tool statistics, in the joined rows' order
                metrics[TOOL_ROWS_KEY] = [stats for part in parts for stats in part["metrics"][TOOL_ROWS_KEY]]
            size = len(whole.items) // world
            mine, metrics = cut_into_shares(whole, metrics, [size] * world)[rank]
            jobs[int(step)] = _Job(int(step), parts[0]["weights_step"], _prompt_keys(mine.items),
                                   (mine, metrics, rank * size), max(part["seconds"] for part in parts))
        self.jobs = self._within_staleness(jobs)
        self._publish_busy()

    # ------------------------------------------------------------------------------------------ internals
    def _restore_taken(self) -> None:
        """A stop signal dropped the step being trained (the trainer rewinds the loader to redo it): its batch is
        the one to train on again, so a checkpoint saves it and the resumed step trains on it."""
        if self.taken is not None:
            step, job = self.taken
            self.jobs.setdefault(step, job)
            self.taken = None
            self._publish_busy()

    def _refresh(self) -> None:
        if self.model is not self.actor:
            copy_weights(self.actor, self.model)
        self.engine.sync_weights()

    def _reference_logprobs(self, scored: ScoredRollout) -> torch.Tensor | None:
        """The reference's log-probs of `scored`, or None when they ran out of memory: beside the update, whose
        memory comes and goes, an out-of-memory error says little about the pass's own size, so rather than halving
        the run's log-prob micro-batch here the step computes them itself, under its OOM guard."""
        try:
            return self.reference_pass(scored)
        except Exception as exc:  # filtered by is_oom_error, everything else re-raised
            if not is_oom_error(exc):
                raise
            error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        gc.collect()  # outside the except block: the traceback no longer holds the pass's tensors
        if torch.cuda.is_available() and str(self.plan.device).startswith("cuda"):
            torch.cuda.empty_cache()
        if not self.reference_oom_warned:
            self.reference_oom_warned = True
            log.warning("[async] the reference's log-probs ran out of memory beside the update (%s); the steps "
                        "that meet this compute them themselves", error)
        return None

    def _running(self) -> list[_Job]:
        return [job for job in self.jobs.values() if isinstance(job.result, Future) and not job.result.done()]

    def _start(self, step: int, items: list[dict], first_prompt: int, background: bool = False,
               weights_step: Optional[int] = None) -> _Job:
        """The rollout of `step`'s prompts from the actor's weights as they are now (those of step `weights_step`,
        default `step`). A background rollout queued behind one still running takes a snapshot of them, which it
        loads into the engine's copy when its turn comes (the copy is in use until then)."""
        job = _Job(step, step if weights_step is None else weights_step, _prompt_keys(items), None)
        pending: dict[str, dict] = {}  # the snapshot, dropped as soon as the engine's copy holds it
        if background and self.executor is not None and self._running():
            pending["weights"] = {name: tensor.detach().clone() for name, tensor in self.actor.state_dict().items()}
        else:
            for running in self._running():  # the engine's copy is about to change under it
                running.wait()
            self._refresh()

        def run() -> tuple[ScoredRollout, dict, int]:
            start = time.perf_counter()
            stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
            with stream:
                if "weights" in pending:
                    snapshot = pending.pop("weights")
                    copy_weights(snapshot, self.model)
                    if self.stream is not None:  # freed below while the copy may still be queued on this stream
                        for tensor in snapshot.values():
                            tensor.record_stream(self.stream)
                    del snapshot
                    self.engine.sync_weights()
                scored, metrics, first = timed_rollout(self.phase, items, step, first_prompt)
                if self.reference_pass is not None:
                    ref_start = time.perf_counter()
                    scored.ref_logprobs = self._reference_logprobs(scored)
                    metrics = {**metrics, "async/ref_log_prob_s": time.perf_counter() - ref_start}
            job.seconds = time.perf_counter() - start
            return scored, metrics, first

        if self.stream is not None:  # the refreshed weights (or the snapshot) first
            self.stream.wait_stream(torch.cuda.current_stream(self.plan.device))
        if background and self.executor is not None:
            job.result = self.executor.submit(run)
        elif background:  # in turn, ahead of its step: a failure is raised when the step needs the batch, as in sync
            job.result = _run_now(run)
        else:
            job.result = run()
        if background:
            self.jobs[step] = job
            self._publish_busy()
        return job


__all__ = ["GENERATE_S", "LookaheadLoader", "RolloutPipeline", "allow_compiled_calls_beside_tracing",
           "copy_weights", "cut_into_shares", "rollout_model_copy", "scored_from", "scored_state", "timed_rollout"]
