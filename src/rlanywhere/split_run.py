"""Launch one rank of a split one_step_off job (split_rollout.py): rank 0 trains, rank 1 rolls out.

    python -c "from rlanywhere.split_run import run_split; run_split(OVERRIDES, RANK, 2, 'tcp://HOST:PORT')"

Kept apart from split_rollout.py because it builds the trainer, which itself builds the split pipeline.
"""

from __future__ import annotations

import torch.distributed as dist

from .split_rollout import ROLLOUT_RANK, SPLIT, serve_rollouts


def run_split(overrides: list[str], rank: int, world: int, init_method: str) -> None:
    """One rank of a split one_step_off job: rank 0 trains, rank 1 rolls out (gloo on CPUs, NCCL on GPUs)."""
    from .config import load_config
    from .planner import make_plan
    from .trainer import RLTrainer

    if world != 2:
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


__all__ = ["run_split"]
