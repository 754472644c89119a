"""Data parallelism: with several ranks, whether each holds a full replica of the models ("replicate") or FSDP2
divides them ("shard"), over how many ranks a shard spreads (HSDP groups), and which memory plan goes with that;
the process group's backend and CPU threads per process.

`plan_sharding` takes the memory planner as a function (`plan_memory(shard_world) -> MemoryPlan`, raising
NoFitError) and returns a `ShardingDecision` that holds the memory plan it kept: the Plan is written once, from
the kept attempt (docs/distributed.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..async_plan import trainer_ranks
from ..errors import UserError
from ..machine import HardwareProbe
from ..plans import Plan
from ..rank_layout import one_gpu_per_task
from ..vocabulary import NoFitError, PlanError
from .memory import MemoryPlan

DATA_PARALLEL_MODES = ("auto", "replicate", "shard")


@dataclass
class ShardingDecision:
    """How the ranks hold the models, and the memory plan made for that (the one to apply)."""

    data_parallel: str  # "none" | "replicate" | "shard"
    shard_group_size: int
    memory: MemoryPlan
    reasons: dict[str, str] = field(default_factory=dict)  # data_parallel, and offload reasons of a sharded plan


def plan_sharding(cfg: Any, plan_memory: Callable[[int], MemoryPlan]) -> ShardingDecision:
    """The replicate-or-shard decision and its memory plan. One rank: no data parallelism. Several,
    hardware.data_parallel=auto: "replicate" when a full replica of every model fits each rank (a small model is
    communication-bound when sharded: every layer is all-gathered in each pass and its gradient reduce-scattered),
    else "shard" (FSDP2: weights, gradients and Adam states divided by the ranks, plus the full weights gathered for
    the rollout). When even sharded it does not fit, the NoFitError names both estimates. replicate / shard force
    the choice."""
    world = trainer_ranks(cfg)  # [async] a split placement's rollout ranks hold no share of the training
    mode = str(cfg.hardware.data_parallel if "data_parallel" in cfg.hardware else "auto").lower()
    if mode not in DATA_PARALLEL_MODES:
        raise UserError(f"hardware.data_parallel={mode!r}: use one of {', '.join(DATA_PARALLEL_MODES)}")
    asked_group = int((cfg.hardware.shard_group_size if "shard_group_size" in cfg.hardware else 0) or 0)
    if asked_group < 0:
        raise UserError(f"hardware.shard_group_size={asked_group}: use a number of ranks that divides the world size, "
                        "or 0 to let the planner choose")
    if world == 1:
        return ShardingDecision("none", 0, plan_memory(1))

    def sharded(memory: MemoryPlan, why: Callable[[MemoryPlan, str], str]) -> ShardingDecision:
        group, memory, groups_text = _shard_groups(cfg, memory, plan_memory, world, asked_group)
        reasons = _offload_reasons(cfg)
        reasons["data_parallel"] = why(memory, groups_text) + _shard_note(memory)
        return ShardingDecision("shard", group, memory, reasons)

    if mode == "shard":
        return sharded(plan_memory(world), lambda memory, groups: (
            f"hardware.data_parallel=shard: FSDP2 {groups} ({memory.peak_text()}); "))
    try:
        replica = plan_memory(1)
        if mode == "auto" and replica.offloads:
            # offload moves the optimizer state / weights over PCIe every step; sharding moves them between GPUs
            without_offload = _sharded_without_offload(plan_memory, world)
            if without_offload is not None:
                return sharded(without_offload, lambda memory, groups: (
                    f"shard (FSDP2) {groups}: a full replica fits one rank only with offload to the CPU, sharded it "
                    f"fits without ({memory.peak_text()}); "))
    except NoFitError as replica_error:
        if mode == "replicate":
            raise
        try:
            shard = plan_memory(world)
        except NoFitError as sharded_error:
            raise NoFitError(f"{sharded_error}\n\nReplicated (each rank holding the full models) it does not fit "
                             f"either: {replica_error}") from None
        first_line = str(replica_error).splitlines()[0]
        return sharded(shard, lambda memory, groups: (
            f"shard (FSDP2) {groups}: a full replica does not fit one rank ({first_line[:300]}); sharded, "
            f"{memory.peak_text()}; "))
    reason = (
        f"replicate over {world} ranks: "
        + ("hardware.data_parallel=replicate" if mode == "replicate" else
           "a full replica fits each rank, and replicas communicate once per optimizer step (sharding all-gathers "
           "every layer in every pass, which costs a small model more than it saves)")
        + "; each rank holds the full actor/critic/reference and its share of the batch "
        f"({replica.peak_text()}); gradients summed over ranks once per optimizer step"
        + (f"; hardware.shard_group_size={asked_group} has no effect on replicas (it sizes the shard groups of "
           "hardware.data_parallel=shard)" if asked_group else ""))
    return ShardingDecision("replicate", 0, replica, {"data_parallel": reason})


def _shard_groups(cfg: Any, memory: MemoryPlan, plan_memory: Callable[[int], MemoryPlan], world: int, asked: int
                  ) -> tuple[int, MemoryPlan, str]:
    """(shard_group_size, the memory plan for it, the text for the data_parallel reason) for a sharded plan whose
    memory was planned over all `world` ranks: the ranks that split the weights among them; with fewer than all
    (HSDP), the groups hold replicas of each other and only the gradient shards are all-reduced between them. Asked
    by hardware.shard_group_size (verl's actor_rollout_ref.actor.fsdp_config.fsdp_size); auto: one group per node
    when the shard fits a node without offload (per-layer all-gathers then stay inside a node), else one group of
    all ranks. asked: hardware.shard_group_size (0: the planner's choice)."""
    per_node, nodes = int(cfg.trainer.n_gpus_per_node), int(cfg.trainer.nnodes)
    if asked > 0:
        if asked > world or world % asked:
            raise UserError(f"hardware.shard_group_size={asked} (verl: fsdp_config.fsdp_size) must divide the "
                            f"{world} ranks: use one of {[g for g in range(1, world + 1) if world % g == 0]}, or 0 "
                            "to let the planner choose")
        if asked < world:
            memory = plan_memory(asked)  # a NoFitError here names the per-rank numbers
        group, why = asked, f"hardware.shard_group_size={asked}"
    elif nodes > 1 and per_node < world and not memory.offloads:
        try:
            per_node_memory: Optional[MemoryPlan] = plan_memory(per_node)
            fits = not per_node_memory.offloads
        except NoFitError:
            per_node_memory, fits = None, False
        memory = per_node_memory if fits else plan_memory(world)
        group = per_node if fits else world
        why = ("a shard per node fits: per-layer all-gathers stay inside a node, only gradient shards cross nodes"
               if fits else f"a shard over one node's {per_node} ranks does not fit without offload")
    else:
        group, why = world, ("one node" if nodes <= 1 else "offload planned over all ranks")
    if group == world:
        return group, memory, f"over {world} ranks ({why})"
    return group, memory, f"within groups of {group} ranks, {world // group} replicas of the shards (HSDP; {why})"


def _sharded_without_offload(plan_memory: Callable[[int], MemoryPlan], world: int) -> Optional[MemoryPlan]:
    """The memory plan sharded over `world` ranks when it needs no offload, else None."""
    try:
        memory = plan_memory(world)
    except NoFitError:
        return None
    return None if memory.offloads else memory


def _offload_reasons(cfg: Any) -> dict[str, str]:
    """A sharded plan does not search offload: FSDP2 offloads (CPUOffloadPolicy) when asked to, not our mover."""
    return {key: "off: sharded (FSDP2); hardware.param_offload=true offloads the shards with CPUOffloadPolicy"
            for key in ("param_offload", "optimizer_offload") if str(cfg.hardware.get(key, "auto")).lower() == "auto"}


def _shard_note(memory: MemoryPlan) -> str:
    """How a sharded run holds its weights for the rollout, with the memory it takes (the plan's estimate)."""
    gathered = memory.estimate.get("breakdown", {}).get("rollout", {}).get("gathered_weights")
    gib = f"{gathered / 2**30:.2f} GiB" if gathered else "?"
    return ("the rollout engine reads the actor's full weights gathered for each generation and freed after "
            f"({gib} per rank; a replica kept beside the shards would hold them for the whole step), "
            "no-grad log-prob/value passes run on gathered weights too; gradients reduce-scattered (summed), "
            "checkpoints written with torch.distributed.checkpoint")


def apply_sharding(plan: Plan, decision: ShardingDecision) -> None:
    plan.data_parallel = decision.data_parallel
    if decision.data_parallel == "shard":
        plan.shard_group_size = decision.shard_group_size
    plan.reasons.update(decision.reasons)


def plan_data_parallel(cfg: Any, plan: Plan, machine: HardwareProbe, for_execution: bool) -> None:
    """Several ranks: the process group's backend and, for CPU processes, the threads each may use."""
    reasons = plan.reasons
    per_node = max(1, int(cfg.trainer.n_gpus_per_node))  # processes on a node, sharing its GPUs and cores
    world = trainer_ranks(cfg)  # [async] the ranks that train: a split placement's rollout ranks left out
    plan.world_size = world
    if world == 1:
        reasons["data_parallel"] = ("one process (trainer.nnodes x trainer.n_gpus_per_node = 1)" if per_node == 1 and
                                    int(cfg.trainer.nnodes) == 1 else "one trainer rank (the others only generate)")
        return
    # planning for an emulated card on a machine without one (the plan command): as that card's GPUs
    on_gpu = plan.device.startswith("cuda") or (bool(plan.emulated) and not for_execution)
    if for_execution and on_gpu and per_node > len(machine.devices) and not one_gpu_per_task(len(machine.devices)):
        raise PlanError(f"trainer.n_gpus_per_node={per_node} but this node has {len(machine.devices)} CUDA device(s): "
                        f"use trainer.n_gpus_per_node<={len(machine.devices)} (or hardware.device=cpu for CPU "
                        "processes)")
    plan.dist_backend = "nccl" if on_gpu else "gloo"
    reasons["dist_backend"] = "NCCL between GPUs" if on_gpu else "gloo between CPU processes"
    if not on_gpu:
        plan.cpu_threads = max(1, (machine.cpu_cores or os.cpu_count() or 1) // per_node)
        reasons["cpu_threads"] = f"{machine.cpu_cores} cores shared by {per_node} CPU processes on this node"

