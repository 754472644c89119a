"""Which GPU a rank takes, from how the launcher laid the GPUs out (a pure decision with its reason).

torchrun gives every process of a node all the node's GPUs and a LOCAL_RANK: the rank takes cuda:LOCAL_RANK.
SLURM (srun with --gpus-per-task=1, or --gpu-bind) gives every task one GPU of its own, set in its
CUDA_VISIBLE_DEVICES, while LOCAL_RANK still counts 0..n-1 on the node: then the one visible device, cuda:0, is the
rank's. Without CUDA_VISIBLE_DEVICES naming a single device, one visible GPU and LOCAL_RANK > 0 means several ranks
on one GPU: refused.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional


def one_gpu_per_task(visible: int, env: Optional[Mapping[str, str]] = None) -> bool:
    """True when the launcher made exactly one GPU visible to this process on purpose (CUDA_VISIBLE_DEVICES)."""
    env = os.environ if env is None else env
    listed = [part for part in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if part.strip()]
    return visible == 1 and len(listed) == 1


def rank_gpu_index(local_rank: int, visible: int, env: Optional[Mapping[str, str]] = None
                   ) -> tuple[Optional[int], str]:
    """(the CUDA index this rank uses, why); (None, what is wrong and the fix) when no GPU is this rank's."""
    if local_rank < visible:
        return local_rank, f"this rank's GPU (LOCAL_RANK={local_rank} of {visible} visible)"
    if one_gpu_per_task(visible, env):
        return 0, (f"the one GPU visible to this rank (LOCAL_RANK={local_rank}; the launcher gives each task its own "
                   "GPU in CUDA_VISIBLE_DEVICES, as SLURM does)")
    return None, (f"rank with LOCAL_RANK={local_rank} but only {visible} CUDA device(s) are visible: start at most "
                  f"{visible} processes per node (--nproc_per_node / trainer.n_gpus_per_node), or give each task "
                  "its own GPU (CUDA_VISIBLE_DEVICES=<one index> per task, e.g. srun --gpus-per-task=1)")
