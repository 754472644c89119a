"""Launch one rank of a split one_step_off job (split_rollout.py): the first ranks train, the last
trainer.async.rollout_ranks only generate.

From the command line it is torchrun (or `trainer.n_gpus_per_node=N`, which relaunches under it):

    torchrun --standalone --nproc_per_node=2 -m rlanywhere.cli train my_run.yaml trainer.async.mode=one_step_off
    torchrun --standalone --nproc_per_node=3 -m rlanywhere.cli train my_run.yaml trainer.async.mode=one_step_off \
        trainer.async.rollout_ranks=1       # 2 trainer ranks (data parallelism), 1 rollout rank

`rlanywhere train` sends each rank here (`run_split_rank`) instead of plain data parallelism. From Python, without
torchrun: `run_split(overrides, rank, world, 'tcp://HOST:PORT')` in each process.

Kept apart from split_rollout.py because it builds the trainer, which itself builds the split pipeline.
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .async_plan import check_split_world, rollout_rank_count, wants_split
from .distributed import check_world_config, join_trainer_group, leave_trainer_group
from .errors import UserError
from .split_rollout import SplitLayout, close_split_pipelines, join_split, make_split_groups, serve_rollouts

# torchrun's variables that make a process join data parallelism; a split rank plans on its own side
_TORCHRUN_WORLD_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                        "ROLE_WORLD_SIZE")


def split_world(cfg, world: int, under_torchrun: bool) -> tuple[bool, int]:
    """(is this a split placement, its world) for `rlanywhere train`: one_step_off on 2 ranks, or with
    trainer.async.rollout_ranks=R >= 1 (in one process that asks for 2R ranks, one trainer rank per rollout rank:
    the command relaunches under torchrun). Refuses what a split cannot run, before anything loads."""
    check_split_world(cfg, world)
    if not wants_split(cfg, world):
        return False, world
    rollout = rollout_rank_count(cfg, world)
    if world == 1 and not under_torchrun:
        cfg.trainer.n_gpus_per_node = world = 2 * rollout
        check_split_world(cfg, world)
    check_world_config(cfg, world - rollout)  # the trainer ranks split each batch as data parallelism does
    return True, world


def _layout(cfg, world: int) -> SplitLayout:
    check_split_world(cfg, world)
    rollout = rollout_rank_count(cfg, world)
    if not rollout or world <= rollout:
        raise UserError(f"a split placement needs ranks that only generate and ranks that train; this job has {world} "
                        f"rank(s) and trainer.async.rollout_ranks={cfg.trainer['async'].rollout_ranks}")
    return SplitLayout(world - rollout, rollout)


def _split_device(cfg, local_rank: int, local_world: int) -> str:
    """hardware.device for this rank: its own GPU (cuda:LOCAL_RANK) on a GPU machine, else the CPU (gloo)."""
    asked = str(cfg.hardware.device or "auto").strip().lower()
    if asked == "cpu" or (asked == "auto" and not torch.cuda.is_available() and not cfg.hardware.get("emulate")):
        return "cpu"
    if torch.cuda.device_count() < local_world:
        raise UserError(f"a split placement (trainer.async.mode=one_step_off with ranks that only generate) puts each "
                        f"rank on its own GPU: {local_world} ranks on this machine, which has "
                        f"{torch.cuda.device_count()} GPU(s); run fewer ranks, one_step_off in one process, or "
                        "hardware.device=cpu")
    return f"cuda:{local_rank}"


def _play_role(cfg, layout: SplitLayout, rank: int, rollout_plan: Callable, train: Callable) -> int:
    """After the job's process group is up: make the split's groups, then serve rollouts (a rollout rank) or train
    (a trainer rank, among the trainer ranks when there are several)."""
    trainer_group, weights_group = make_split_groups(layout)  # every rank, in the same order
    cfg.trainer["async"].rollout_ranks = layout.rollout
    if rank >= layout.trainers:
        cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = 1, 1  # it plans as one process
        serve_rollouts(cfg, rollout_plan(cfg), layout.trainers_of(rank), weights_group)
        return 0
    # the trainer ranks plan for themselves: the planner leaves the rollout ranks out (async_plan.trainer_ranks)
    join_split(layout, weights_group, rank)
    if layout.trainers > 1:
        join_trainer_group(trainer_group, rank, layout.trainers)
    try:
        return train()
    finally:
        close_split_pipelines()  # the rollout ranks' loops end (also when this rank failed)
        leave_trainer_group()


def run_split_rank(cfg, notices: list[str], emulate: Optional[str], rank: int,
                   resume_command: Optional[str] = None, *, train_rank: Callable[..., int]) -> int:
    """`rlanywhere train` under torchrun for a split placement: the trainer ranks train (`train_rank`, the CLI's
    usual run of a rank, their rollouts made on the rollout ranks), the rollout ranks generate and score. Returns
    the exit code."""
    from . import api
    from .distributed import COLLECTIVE_TIMEOUT, env_world

    _, world, local_rank, local_world = env_world()
    layout = _layout(cfg, world)
    device = _split_device(cfg, local_rank, local_world)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method="env://", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)
    for name in _TORCHRUN_WORLD_VARS:  # from here on each rank plans on its own side (split_rollout.SplitLayout)
        os.environ.pop(name, None)
    cfg.hardware.device = device
    try:
        if rank >= layout.trainers:
            # a stop signal (torchrun passes it to every rank) is the trainer ranks' to handle: they save, which
            # finishes the rollouts in flight here, then release this rank (torchrun kills it 30 s on at the latest)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return _play_role(cfg, layout, rank, lambda c: api.plan(c, emulate=emulate),
                          lambda: train_rank(cfg, notices, emulate, rank, resume_command))
    finally:
        dist.destroy_process_group()


def run_split(overrides: list[str], rank: int, world: int, init_method: str) -> None:
    """One rank of a split one_step_off job started from Python (gloo on CPUs, NCCL on GPUs): the first ranks train,
    the last trainer.async.rollout_ranks (1 when unset) roll out."""
    from . import api
    from .config import load_config
    from .planner import make_plan
    from .runtime import prepare_environment
    from .trainer import RLTrainer

    cfg = load_config(None, overrides)
    if cfg.trainer["async"].rollout_ranks is None:
        cfg.trainer["async"].rollout_ranks = 1
    cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node = 1, world  # the job's ranks, all on this machine
    layout = _layout(cfg, world)
    prepare_environment(cfg)  # the allocator's settings before anything below starts CUDA (the machine probe does)
    device = str(make_plan(cfg, for_execution=False).device)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", init_method=init_method, rank=rank,
                            world_size=world)

    def train() -> int:  # planned and applied to this process as a command-line rank's plan is (TF32, threads)
        trainer = RLTrainer(cfg, api.plan(cfg), cfg.trainer.default_local_dir)
        try:
            trainer.fit()
        finally:
            trainer.pipeline.close()
        return 0

    try:
        _play_role(cfg, layout, rank, api.plan, train)
    finally:
        dist.destroy_process_group()


__all__ = ["run_split", "run_split_rank", "split_world"]
