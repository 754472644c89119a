"""Launch one rank of a split one_step_off job (split_rollout.py): rank 0 trains, rank 1 rolls out.

From the command line it is torchrun with 2 ranks (or `trainer.n_gpus_per_node=2`, which relaunches under it):

    torchrun --standalone --nproc_per_node=2 -m rlanywhere.cli train my_run.yaml trainer.async.mode=one_step_off

`rlanywhere train` sends each rank here (`run_split_rank`) instead of data parallelism. From Python, without
torchrun: `run_split(overrides, rank, 2, 'tcp://HOST:PORT')` in each of two processes.

Kept apart from split_rollout.py because it builds the trainer, which itself builds the split pipeline.
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .async_plan import SPLIT_WORLD, check_split_world, wants_split
from .errors import UserError
from .split_rollout import ROLLOUT_RANK, SPLIT, close_split_pipelines, serve_rollouts

# torchrun's variables that make a process join data parallelism; a split rank is one process on its own side
_TORCHRUN_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "ROLE_WORLD_SIZE")


def split_world(cfg, world: int, under_torchrun: bool) -> tuple[bool, int]:
    """(is this a split placement, its world) for `rlanywhere train`: one_step_off on 2 ranks, or
    trainer.async.rollout_ranks=1 in one process (which then asks for the 2 ranks: the command relaunches under
    torchrun). Refuses what a split cannot run (more than 2 ranks)."""
    check_split_world(cfg, world)
    if not wants_split(cfg, world):
        return False, world
    if world == 1 and not under_torchrun:
        cfg.trainer.n_gpus_per_node = world = SPLIT_WORLD
    return True, world


def _split_device(cfg, local_rank: int) -> str:
    """hardware.device for this rank: its own GPU (cuda:LOCAL_RANK) on a GPU machine, else the CPU (gloo)."""
    asked = str(cfg.hardware.device or "auto").strip().lower()
    if asked == "cpu" or (asked == "auto" and not torch.cuda.is_available() and not cfg.hardware.get("emulate")):
        return "cpu"
    if torch.cuda.device_count() < SPLIT_WORLD:
        raise UserError(f"split placement (trainer.async.mode=one_step_off on 2 ranks) puts each rank on its own GPU; "
                        f"this machine has {torch.cuda.device_count()}: run one_step_off in one process (one rank) "
                        "or with hardware.device=cpu")
    return f"cuda:{local_rank}"


def run_split_rank(cfg, notices: list[str], emulate: Optional[str], rank: int,
                   resume_command: Optional[str] = None, *, train_rank: Callable[..., int]) -> int:
    """`rlanywhere train` under torchrun for a split placement: rank 0 trains (`train_rank`, the CLI's usual run of
    a rank, its rollouts made on rank 1), rank 1 generates and scores. Returns the exit code."""
    from .distributed import COLLECTIVE_TIMEOUT, env_world
    from . import api

    _, world, local_rank, _ = env_world()
    if world != SPLIT_WORLD:
        raise UserError(f"split placement runs 1 trainer rank + 1 rollout rank; torchrun started {world}")
    device = _split_device(cfg, local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method="env://", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)
    for name in _TORCHRUN_WORLD_VARS:  # from here on each rank plans and runs as one process
        os.environ.pop(name, None)
    cfg.hardware.device = device
    cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = 1, 1
    cfg.trainer["async"].rollout_ranks = 1
    try:
        if rank == ROLLOUT_RANK:
            # a stop signal (torchrun passes it to every rank) is the trainer rank's to handle: it saves, which
            # finishes the rollout in flight here, then releases this rank (torchrun kills it 30 s on at the latest)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            serve_rollouts(cfg, api.plan(cfg, emulate=emulate))
            return 0
        try:
            return train_rank(cfg, notices, emulate, rank, resume_command)
        finally:
            close_split_pipelines()  # the rollout rank's loop ends (also when this rank failed)
    finally:
        dist.destroy_process_group()


def run_split(overrides: list[str], rank: int, world: int, init_method: str) -> None:
    """One rank of a split one_step_off job started from Python (gloo on CPUs, NCCL on GPUs): rank 0 trains,
    rank 1 rolls out."""
    from .config import load_config
    from .planner import make_plan
    from .trainer import RLTrainer

    if world != SPLIT_WORLD:
        raise ValueError(f"split placement runs 1 trainer rank + 1 rollout rank; got a world of {world}")
    cfg = load_config(None, overrides)
    plan = make_plan(cfg, for_execution=True)
    backend = "nccl" if str(plan.device).startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        if rank == ROLLOUT_RANK:
            serve_rollouts(cfg, plan)
            return
        plan.async_rollout = SPLIT
        trainer = RLTrainer(cfg, plan, cfg.trainer.default_local_dir)
        try:
            trainer.fit()
        finally:
            trainer.pipeline.close()
    finally:
        dist.destroy_process_group()


__all__ = ["run_split", "run_split_rank", "split_world"]
