"""What the reward timeout costs: a user reward function scored in-process (custom_reward_function.timeout_s=0)
versus in the worker pool that enforces the per-call limit (the default, 30 s), for each way the pool's workers
can start: "forkserver" (the default: a fresh server process forks them, so they never inherit the trainer's
CUDA/NCCL threads), "spawn" (a fresh interpreter each) and "fork" (a copy of the trainer, the fallback for a
function that cannot be pickled).

    python bench/reward_pool_overhead.py --calls 512 --repeats 5

CPU only. The function is the GSM8K rule on a 500-character response, as cheap as reward functions get, so the
difference is the pool's per-call cost (pickling the call and its result, the round trip to a worker). It comes
from a reward file, as custom_reward_function.path gives it (each worker loads the file again). "start" is the
first batch of 8 calls, which starts the workers (paid once per run, and again after a stuck pool is replaced);
torch is imported beforehand, as in the trainer.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from rlanywhere.rewards import RewardManager, load_custom_reward

REWARD_FILE = """from rlanywhere.rewards import gsm8k_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return gsm8k_score(solution_str, ground_truth)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # torch imported, as in the trainer: no start time below includes its import. Here, not at the top: a worker
    # imports this script again (multiprocessing's __mp_main__), as it imports rlanywhere.cli under a trainer
    import torch  # noqa: F401

    texts = [f"step by step ... so the answer is #### {i} " * 12 for i in range(args.calls)]
    truths, sources = [str(i) for i in range(args.calls)], ["x"] * args.calls
    folder = tempfile.mkdtemp(prefix="reward-bench-")
    (Path(folder) / "reward.py").write_text(REWARD_FILE)
    score = load_custom_reward(Path(folder) / "reward.py")
    for timeout_s, method in ((0.0, None), (30.0, "forkserver"), (30.0, "spawn"), (30.0, "fork")):
        manager = RewardManager(score, timeout_s=timeout_s, start_method=method)
        try:
            start = time.perf_counter()
            manager(texts[:8], truths[:8], sources[:8])  # starts the workers
            started = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(args.repeats):
                manager(texts, truths, sources)
            per_batch = (time.perf_counter() - start) / args.repeats
        finally:
            manager.close()
        where = "in-process" if timeout_s == 0 else f"{manager.num_workers} workers, {method}"
        print(f"timeout_s={timeout_s:g} ({where}): start {started * 1e3:.0f} ms; {per_batch * 1e3:.1f} ms per "
              f"{args.calls} calls, {per_batch / args.calls * 1e6:.0f} us per call")


if __name__ == "__main__":
    main()
