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


# ---------------------------------------------------------------------------------------------- a rank that died
_PEERS: list[tuple[str, int]] = []  # (hostname, pid) of every rank of the job, in rank order (register_ranks)
_PEER_FAILURE_TEXTS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
                       "socket closed", "read error", "write error", "timed out")
# A killed process closes its sockets before it has ended (Linux: its files go before it turns into a zombie), so a
# survivor's collective can fail while the killed rank still looks alive in /proc: look again for up to this long
PEER_EXIT_WAIT_S = 2.0


def register_ranks(dp) -> None:
    """Every rank's host and pid, gathered once when the job starts, so that a survivor can name a rank that died
    (collective: every rank calls it; nothing alone)."""
    import socket

    if dp.enabled:
        _PEERS[:] = [tuple(peer) for peer in dp.gather_objects([(socket.gethostname(), os.getpid())])]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie: killed, not yet reaped
    except (OSError, IndexError):
        return False


def _other_ranks_here() -> list[tuple[int, int]]:
    """(rank, pid) of the job's other ranks on this host (the ones whose end /proc can show)."""
    import socket

    host, me = socket.gethostname(), os.getpid()
    return [(index, pid) for index, (peer_host, pid) in enumerate(_PEERS) if peer_host == host and pid != me]


def a_peer_died() -> bool:
    """Whether another rank of this job on this host has ended: torchrun then stops the others with SIGTERM, and
    what they would save cannot be (their collectives fail); the rank that died is named once, elsewhere."""
    return any(not _alive(pid) for _, pid in _other_ranks_here())


def failed_rank_line(exc: BaseException, rank: int, world: int) -> Optional[str]:
    """One line naming the rank(s) that died when `exc` is this rank's collective failing because a peer went
    away (killed, crashed, its machine lost); None for any other error (reported as it is)."""
    import time

    text = f"{type(exc).__name__}: {exc}".lower()
    # an error of the job's own connections (gloo, NCCL, the c10d store), where a lost peer can be the only cause;
    # the same words from a reward or tool server's socket are this rank's error, said as it is unless a peer died
    collective = any(part in text for part in ("distbackenderror", "distnetworkerror", "diststoreerror", "gloo",
                                               "nccl", "c10d"))
    if world <= 1 or not (any(part in text for part in _PEER_FAILURE_TEXTS) or collective):
        return None
    here = _other_ranks_here()
    deadline = time.monotonic() + PEER_EXIT_WAIT_S
    while True:
        dead = [index for index, pid in here if not _alive(pid)]
        if dead or not here or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if dead:
        names = ", ".join(str(index) for index in dead)
        return (f"error: rank {names} of {world} stopped (killed, or crashed without a message); rank {rank} stops "
                "too. Run the same command to resume from the last checkpoint")
    if not collective:
        return None
    return (f"error: rank {rank} of {world} lost its connection to another rank (stopped, or its machine is "
            "unreachable); run the same command to resume from the last checkpoint")
