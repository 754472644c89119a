"""trainer.async as planned: its config checks and the decision whether the rollout of the next step overlaps the
update on this card (`plan_async_rollout`, called once by the planner; the reason is shown by `rlanywhere plan`).
The pipeline itself is async_pipeline.py. Pure functions; a leaf (imports errors, estimator and vocabulary only)."""

from __future__ import annotations

import os
from typing import Any, Optional

from .algorithms import kl_penalty_in_reward, several_optimizer_steps
from .errors import UserError
from .estimator import format_bytes
from .vocabulary import PlanError

MODES = ("sync", "one_step_off")
SYNC, IN_TURN, OVERLAPPED, SPLIT = "sync", "in turn", "overlapped", "split"
SPLIT_WORLD = 2  # one_step_off on this many ranks: a split placement unless trainer.async.rollout_ranks=0


# ---------------------------------------------------------------------------------------------------- config, plan
def _overlap_setting(value: Any) -> Optional[bool]:
    """trainer.async.overlap: None for auto, else the bool asked for."""
    if value is None or str(value).lower() == "auto":
        return None
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise UserError(f"trainer.async.overlap={value!r} is not valid; use auto (the planner decides), true or false")


# trainer.async.priority: whose CUDA stream is at the high priority when the phases overlap on one GPU
PRIORITIES = ("rollout", "update")


def check_async_config(cfg: Any) -> None:
    """What trainer.async cannot run, said before anything loads."""
    section = cfg.trainer["async"]
    if section.mode not in MODES:
        raise UserError(f"trainer.async.mode={section.mode!r} is not valid; use sync (generate, then train) or "
                        "one_step_off (the next step's rollout runs while this step trains)")
    _overlap_setting(section.overlap)
    if section.priority not in PRIORITIES:
        raise UserError(f"trainer.async.priority={section.priority!r} is not valid; use rollout (the decode kernels "
                        "take each SM that frees up first) or update (the training step's kernels do)")
    if int(section.max_staleness) < 1:
        raise UserError(f"trainer.async.max_staleness={section.max_staleness} must be >= 1 (policy versions a "
                        "trained batch may lag the weights that generated it)")
    check_split_world(cfg, int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node))
    if section.mode == "sync":
        return
    if cfg.algorithm.filter_groups.enable:
        raise UserError("trainer.async.mode=one_step_off with dynamic sampling (algorithm.filter_groups.enable) is "
                        "not available: dynamic sampling draws more prompts during the rollout; use one of the two")


def _rollout_ranks(section: Any) -> int | None:
    """trainer.async.rollout_ranks: None when unset (1 on 2 ranks, else 0)."""
    return None if section.rollout_ranks is None else int(section.rollout_ranks)


def rollout_rank_count(cfg: Any, world: int) -> int:
    """The ranks of a `world`-rank one_step_off job that only generate: trainer.async.rollout_ranks, or when it is
    unset 1 on 2 ranks (the split placement) and 0 otherwise (every rank trains and generates its share)."""
    section = cfg.trainer["async"]
    if section.mode != "one_step_off":
        return 0
    ranks = _rollout_ranks(section)
    return ranks if ranks is not None else (1 if world == SPLIT_WORLD else 0)


def trainer_ranks(cfg: Any) -> int:
    """The ranks of the job (trainer.nnodes x trainer.n_gpus_per_node) that train: all of them but the split
    placement's rollout ranks. The data parallelism the planner sizes is theirs."""
    world = max(1, int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node))
    return max(1, world - rollout_rank_count(cfg, world))


def wants_split(cfg: Any, world: int) -> bool:
    """Whether this run is a split placement: some ranks only generate (rollout_rank_count > 0)."""
    return rollout_rank_count(cfg, world) > 0


def check_split_world(cfg: Any, world: int) -> None:
    """What the ranks of a one_step_off run can be: one process; trainer ranks and rollout ranks (each rollout rank
    serving as many trainer ranks); or data-parallel trainer ranks that each generate their share."""
    section = cfg.trainer["async"]
    ranks = _rollout_ranks(section)
    if ranks is not None and ranks < 0:
        raise UserError(f"trainer.async.rollout_ranks={ranks} must be >= 0 (0: every rank trains and generates its "
                        "share; N: N ranks only generate)")
    if section.mode == "sync":
        if ranks:
            raise UserError(f"trainer.async.rollout_ranks={ranks} places the rollout of trainer.async.mode="
                            "one_step_off on ranks of its own; set trainer.async.mode=one_step_off with it")
        return
    rollout = rollout_rank_count(cfg, world)
    if rollout and int(section.max_staleness) > 1:
        raise UserError(f"trainer.async.max_staleness={section.max_staleness}: the split placement keeps one rollout "
                        "ahead (max_staleness=1); deeper queues run on trainer ranks (trainer.async.rollout_ranks=0)")
    trainers = world - rollout
    if rollout and world > 1 and (trainers < 1 or trainers % rollout):
        raise UserError(f"trainer.async.rollout_ranks={rollout} on {world} ranks (trainer.nnodes x "
                        f"trainer.n_gpus_per_node) leaves {trainers} trainer rank(s): each rollout rank serves as many "
                        f"trainer ranks, so the ranks must be {rollout} x (1 + trainer ranks per rollout rank), e.g. "
                        f"{2 * rollout} or {3 * rollout}")


def ref_pass_bytes(estimate: dict | None) -> int:
    """What the reference's log-prob pass allocates on top of what is resident (its weights are, in every phase,
    unless parked on the CPU): one no-grad micro-batch's activations and its logits chunks."""
    parts = (estimate or {}).get("breakdown", {}).get("ref_log_prob", {})
    return int(parts.get("activations", 0) + parts.get("logits_chunks", 0))


def overlap_bytes(estimate: dict | None, snapshots: int = 0, ref_pass: bool = False, scoring: int = 0) -> int | None:
    """Memory the overlapped pipeline holds at its peak: the update's phase (weights, gradients, optimizer,
    activations, engine weights) plus, at the same time, the rollout's KV cache and sampling buffers and a second
    copy of the actor's weights for the engine to read, and `snapshots` more copies (the weights of rollouts queued
    behind a running one, with max_staleness > 1). With `ref_pass` the reference's log-prob pass follows the
    rollout in its job, with the KV cache still held: the larger of its memory and the sampling buffers counts; so
    does `scoring`, a reward model's scoring in the rollout's job (its forward, and its weights where they are moved
    in for it). None without an estimate."""
    if not estimate or "phases" not in estimate:
        return None
    phases, breakdown = estimate["phases"], estimate.get("breakdown", {})
    rollout = breakdown.get("rollout", {})
    training = max(value for name, value in phases.items() if name not in ("rollout", "reward"))  # the rollout's job
    copy_bytes = rollout.get("actor_weights", 0) * (1 + snapshots)
    transient = max(rollout.get("prefill_or_sampling", 0), ref_pass_bytes(estimate) if ref_pass else 0, scoring)
    return int(training + rollout.get("kv_cache", 0) + transient + copy_bytes)


def decide_async_rollout(mode: str, overlap: Optional[bool], on_cuda: bool, half_precision: bool,
                         need_bytes: Optional[int], budget_bytes: Optional[int]) -> tuple[str, str]:
    """(sync | in turn | overlapped, the reason in a user's words). Pure: the planner passes what it decided.

    On a card where generation beside the update does not fit or would not pay, the phases would take turns, and
    then the pipeline only makes each batch one version stale at the same step time: with trainer.async.overlap
    left to the planner the run stays synchronous there. A CPU keeps the pipeline in turn (the batches and weights
    of the overlapped run on a card, to try a run before it goes to one)."""
    if mode == "sync":
        return SYNC, "trainer.async.mode=sync: each step generates its batch, then trains on it"
    head = "one_step_off: the next step's rollout uses this step's weights (at most one version stale)"
    if overlap is False:
        return IN_TURN, f"{head}; trainer.async.overlap=false: generation and update take turns"
    if not on_cuda:
        return IN_TURN, (f"{head}; on a CPU generation and update would share the same cores, so they take turns "
                         "(the same batches and weights as overlapped)")
    cause = None
    if need_bytes is not None and budget_bytes and need_bytes > budget_bytes:
        cause = (f"generating beside the update would need {format_bytes(need_bytes)} at once (a second weight "
                 f"copy, the KV cache and the update's memory), more than the {format_bytes(budget_bytes)} budget")
    elif overlap is None and not half_precision:
        cause = ("in fp32 the update's matmuls keep the card's cores busy, so a rollout beside it would mostly wait "
                 "for them")
    if cause and overlap is None:
        return SYNC, (f"trainer.async.mode=one_step_off asked, but {cause}; with the phases in turn each batch would "
                      "only be one version stale at the same step time, so each step generates, then trains "
                      "(trainer.async.overlap=false runs the one_step_off pipeline in turn anyway)")
    if cause:
        return IN_TURN, f"{head}; {cause}: they take turns"
    why = "trainer.async.overlap=true" if overlap else ("decoding is bound by launches and memory bandwidth while the "
                                                        "update is bound by compute, so each fills the other's gaps")
    return OVERLAPPED, (f"{head}; generation runs on its own CUDA stream from the engine's own weight copy while the "
                        f"update runs: {why}")


def split_reason(rollout: int) -> str:
    """The `async rollout` row of a split placement."""
    who = "one rank only generates" if rollout == 1 else f"{rollout} ranks only generate"
    return (f"one_step_off, split placement: {who} (trainer.async.rollout_ranks), each next batch with the weights "
            "the first trainer rank broadcasts after each update, while the trainer ranks train on the previous one "
            "(at most one version stale)")


def old_policy_forward_stays(cfg: Any) -> bool:
    """Whether each step runs the trainer's forward for the old policy's log-probs, which the background cannot take:
    it needs the weights the previous update produced. Skipped with one optimizer step a step (the update's own
    forward gives them), unless a KL penalty in the reward needs them before the update, and in bypass mode (the
    rollout's own log-probs stand for them: rollout_correction.recomputes_old_logprobs)."""
    several = several_optimizer_steps(cfg.actor_rollout_ref.actor, cfg.data.train_batch_size)
    needed_before = several or kl_penalty_in_reward(cfg.algorithm)
    return needed_before and not cfg.algorithm.rollout_correction.bypass_mode


CRITICAL_PATH_NOTE = ("; the trainer's forward for the old policy's log-probs stays on each step's critical path "
                      "(it needs the weights of the update before): algorithm.rollout_correction.bypass_mode=true "
                      "skips it, taking the PPO ratio against the rollout's own log-probs")


def reference_can_follow_rollout(async_rollout: str, use_lora: bool, ref_parked: bool,
                                 rows_move: bool = False) -> tuple[bool, str]:
    """Whether the reference's log-probs of a batch can be computed in the pipeline's job right after its rollout,
    and why not. The reference never changes, so they need not wait for the update that trains on the batch.
    rows_move: [distributed] trainer.balance_batch moves rows between the ranks after each rollout."""
    if async_rollout == SYNC:
        return False, "each step computes them after its rollout (trainer.async.mode=sync)"
    if async_rollout == SPLIT:
        return False, "the trainer ranks compute them in each step: the rollout ranks hold no reference"
    if rows_move:
        return False, ("in the step: trainer.balance_batch moves rows between the ranks after each rollout "
                       "(trainer.balance_batch=false keeps each row on the rank that generated it)")
    if use_lora:
        return False, ("in the step: with LoRA the reference is the actor with its adapters off, and the update "
                       "changes the actor meanwhile")
    if ref_parked:
        return False, ("in the step: the reference is parked on the CPU, and moving it in beside the update would "
                       "need its weights on the card at the same time")
    return True, ""


def plan_async_rollout(cfg: Any, plan: Any) -> None:
    """The planner's call: plan.async_rollout and its reason; with a reference, plan.ref_with_rollout and its."""
    section = cfg.trainer["async"]
    if section.mode != "sync" and plan.data_parallel == "shard":
        raise PlanError(
            "trainer.async.mode=one_step_off with sharded models (hardware.data_parallel planned as shard: FSDP2) is "
            "not available: each rank's rollout engine generates from a whole copy of the actor's weights, which "
            "the update's ranks also send whole. Use hardware.data_parallel=replicate where a full copy fits each "
            "rank, or trainer.async.mode=sync")
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    if wants_split(cfg, world):
        plan.async_rollout, plan.reasons["async_rollout"] = SPLIT, split_reason(rollout_rank_count(cfg, world))
        if old_policy_forward_stays(cfg):
            plan.reasons["async_rollout"] += CRITICAL_PATH_NOTE
        _plan_reference(plan, False)
        return
    on_cuda = str(plan.device).startswith("cuda") or bool(plan.emulated)
    half = plan.precision in ("bf16", "fp16")
    snapshots, budget = int(section.max_staleness) - 1, plan.memory_budget_bytes
    rows_move = int(plan.world_size) > 1 and bool(cfg.trainer.balance_batch)
    ref_may_follow = plan.use_ref and section.mode != "sync" and reference_can_follow_rollout(
        IN_TURN, plan.use_lora, plan.ref_device == "cpu" and on_cuda, rows_move)[0]
    need_with_ref = overlap_bytes(plan.estimate, snapshots, ref_pass=True) if ref_may_follow else None
    # the reference's pass beside the update, where its memory fits too; else the overlap without it
    ref_beside = ref_may_follow and (need_with_ref is None or not budget or need_with_ref <= budget)
    need = need_with_ref if ref_beside else overlap_bytes(plan.estimate, snapshots)
    plan.async_rollout, plan.reasons["async_rollout"] = decide_async_rollout(
        section.mode, _overlap_setting(section.overlap), on_cuda, half, need, budget)
    if plan.async_rollout == OVERLAPPED and old_policy_forward_stays(cfg):
        plan.reasons["async_rollout"] += CRITICAL_PATH_NOTE
    if plan.async_rollout == OVERLAPPED and on_cuda:
        plan.update_stream_first = section.priority == "update"
        plan.reasons["async_rollout"] += (
            "; the training step's kernels go first (its stream at high priority: trainer.async.priority=update)"
            if plan.update_stream_first else
            "; the decode kernels go first (the rollout's stream at high priority: trainer.async.priority)")
    if plan.async_rollout != SYNC and int(plan.world_size) > 1:
        plan.reasons["async_rollout"] += (f"; each of the {plan.world_size} ranks trains and generates its share of "
                                          "the next batch (trainer.async.rollout_ranks=0)")
    _plan_reference(plan, on_cuda, ref_beside, need_with_ref, budget, rows_move)
    if plan.async_rollout == OVERLAPPED and plan.rollout.release_kv_between_phases:
        # the cache is in use while the update runs: counted in the overlap's memory above
        plan.rollout.release_kv_between_phases = False
        plan.rollout.reasons["release_kv_between_phases"] = "kept: the next rollout decodes while the update runs"


def spare_core_for_rollout(plan: Any, cpu_cores: int, ranks_per_node: int,
                           physical_cores: int | None = None) -> None:
    """Overlapped on a GPU: torch's CPU thread pool one thread short of this process's cores (plan.cpu_threads), so
    that the rollout's thread, launching decode steps beside the update, has a core of its own. With every core in
    the pool, each parallel CPU operator of the update (indexing the batch into micro-batches, ...) waits for the
    pool thread that shares its core with the rollout's: on the Qwen-shaped bench the update's CPU indexing took
    62 ms with every core in the pool, 8 ms with one left (bench/async_overlap.py --settings both,all_cores
    --profile-dir). The cores are physical ones where the machine says (physical_cores: hyper-threads of a core
    counted once), as torch counts its pool by default: a pool over hyper-threads would be larger than torch's."""
    if plan.async_rollout != OVERLAPPED or not (str(plan.device).startswith("cuda") or plan.emulated):
        return
    usable = min(int(cpu_cores), int(physical_cores)) if physical_cores else int(cpu_cores)
    cores = max(1, usable // max(1, int(ranks_per_node)))
    limit = user_thread_limit()
    pool = min(cores, limit) if limit else cores  # a user's limit stays a limit
    if pool <= 1:  # nothing to spare (torchrun gives each rank OMP_NUM_THREADS=1 unless told otherwise)
        return
    plan.cpu_threads = pool - 1
    allowed = ("threads (OMP_NUM_THREADS / MKL_NUM_THREADS)" if pool != cores else
               "physical cores" if usable < int(cpu_cores) else "cores")
    plan.reasons["cpu_threads"] = (f"{plan.cpu_threads} CPU threads for torch's operators: one of the process's "
                                   f"{pool} {allowed} left to the rollout's thread, which runs beside the update")


def user_thread_limit() -> int | None:
    """The CPU threads the user allowed torch (OMP_NUM_THREADS or MKL_NUM_THREADS, read as torch reads them: the
    first number of a list), or None."""
    limits = []
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        first = os.environ.get(name, "").split(",")[0].strip()
        if first.isdigit() and int(first) > 0:
            limits.append(int(first))
    return min(limits) if limits else None


def recheck_overlap_with_reward_model(cfg: Any, plan: Any, rm_plan: Any) -> None:
    """After the reward model is planned: an overlapped pipeline scores each batch in the rollout's job, beside the
    update, so its scoring (and its weights, where offloaded) must fit there too; otherwise the phases take turns."""
    if plan.async_rollout != OVERLAPPED:
        return
    forward = int((plan.estimate or {}).get("breakdown", {}).get("reward", {}).get("reward_model_forward", 0))
    scoring = forward + (int(rm_plan.weights_bytes) if rm_plan.offload else 0)
    snapshots, budget = int(cfg.trainer["async"].max_staleness) - 1, plan.memory_budget_bytes
    need = overlap_bytes(plan.estimate, snapshots, ref_pass=plan.ref_with_rollout, scoring=scoring)
    if need is None or not budget or need <= budget:
        return
    plan.async_rollout = IN_TURN
    plan.update_stream_first = False
    plan.reasons["async_rollout"] = (
        f"one_step_off in turn: generating and scoring with the reward model beside the update would need "
        f"{format_bytes(need)} at once, more than the {format_bytes(budget)} budget, so the next batch is made "
        "between updates (at most one version stale)") + (CRITICAL_PATH_NOTE if old_policy_forward_stays(cfg) else "")
    _plan_reference(plan, True, rows_move=int(plan.world_size) > 1 and bool(cfg.trainer.balance_batch))


def _plan_reference(plan: Any, on_cuda: bool, fits_beside: bool = True, need_beside: int | None = None,
                    budget: int | None = None, rows_move: bool = False) -> None:
    """plan.ref_with_rollout and its reason (none without a reference)."""
    plan.ref_with_rollout = False
    if not plan.use_ref or plan.async_rollout == SYNC:  # no reference, or no pipeline: nothing to say
        plan.reasons.pop("ref_with_rollout", None)
        return
    follows, why = reference_can_follow_rollout(plan.async_rollout, plan.use_lora, plan.ref_device == "cpu" and on_cuda,
                                                rows_move)
    if follows and plan.async_rollout == OVERLAPPED and not fits_beside:
        follows, why = False, (f"in the step: computing them beside the update would need {format_bytes(need_beside)} "
                               f"at once, more than the {format_bytes(budget)} budget")
    plan.ref_with_rollout = follows
    if not follows:
        plan.reasons["ref_with_rollout"] = why
    elif plan.async_rollout == OVERLAPPED:
        plan.reasons["ref_with_rollout"] = (
            "the reference never changes, so its log-probs of the next batch are computed right after that batch's "
            "rollout, on the rollout's stream beside the update: off each step's critical path")
    else:
        plan.reasons["ref_with_rollout"] = (
            "computed right after each batch's rollout (the reference never changes: the same values as in the "
            "step); the phases take turns here, so this moves the pass, it does not shorten the step")


__all__ = ["IN_TURN", "MODES", "OVERLAPPED", "SPLIT", "SPLIT_WORLD", "SYNC", "check_async_config", "check_split_world",
           "decide_async_rollout", "old_policy_forward_stays", "overlap_bytes", "plan_async_rollout",
           "ref_pass_bytes", "reference_can_follow_rollout", "rollout_rank_count", "split_reason", "trainer_ranks",
           "wants_split"]
