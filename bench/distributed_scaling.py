"""Samples/s on 1 and on N GPUs for the same global batch, and the held-out curve of each run (docs/distributed.md).

For every config it runs the same `rlanywhere train` command as 1 process and as N ranks under torchrun (fresh run
dirs), reads each run's metrics.jsonl, and prints: median seconds per step after the warm-up steps, samples/s
(train_batch_size x n / step time), the N-rank / 1-rank ratio (goal >= 1.8 at N = 2), peak memory per rank, and
val/acc per validation step of both runs side by side.

    # two GPUs: the demo's GPU profile and a Qwen2.5-0.5B-shape GRPO step, 1 vs 2 ranks
    PYTHONPATH=src python bench/distributed_scaling.py --configs demo,grpo-0.5b --nproc 2 --out scaling.json
    # CPU smoke test of the script itself (tiny shape, gloo)
    PYTHONPATH=src python bench/distributed_scaling.py --configs tiny-grpo --nproc 2 --steps 3 --warmup 1

Configs: `demo` is `rlanywhere train`'s GPU demo profile (SmolLM2-135M, GRPO on 2-digit addition, 64 prompts x 8,
validation every 10 steps; set RLANYWHERE_DEMO_GGUF to a local .gguf when offline); the others reuse the random
model shapes and exact-length prompts of bench/train_memory.py. Extra `rlanywhere train` overrides follow `--`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from rlanywhere.tracking import read_metrics  # noqa: E402


def config_overrides(name: str, root: str, steps: int) -> list[str]:
    """`rlanywhere train` arguments (a YAML file first when needed) for a named config."""
    if name == "demo":
        from omegaconf import OmegaConf

        from rlanywhere.cli import demo_profile

        path = os.path.join(root, "demo.yaml")
        OmegaConf.save(OmegaConf.create(demo_profile(on_gpu=True)), path)
        if not os.path.exists("data/arith/train.parquet"):
            from rlanywhere.data import prepare_arithmetic

            prepare_arithmetic("data/arith", train_size=2000, test_size=200, digits=2, operators="+", seed=0)
        return [path, f"trainer.total_training_steps={steps}", "trainer.save_freq=0"]
    from train_memory import CONFIGS, build_data, build_model_dir

    shape, prompts, n, plen, rlen, extra = CONFIGS[name]
    data = build_data(root, prompts, plen)
    items = {"actor_rollout_ref.model.path": build_model_dir(shape, root),
             "data.train_files": f"{data}/train.parquet", "data.val_files": "null", "data.train_batch_size": prompts,
             "data.max_prompt_length": plen, "data.max_response_length": rlen, "actor_rollout_ref.rollout.n": n,
             "trainer.total_training_steps": steps, "trainer.test_freq": 0, "trainer.save_freq": 0,
             "trainer.val_before_train": False, **extra}
    return [f"{k}={v}" for k, v in items.items()]


def run(args_list: list[str], nproc: int, run_dir: str) -> list[dict]:
    launcher = ([sys.executable, "-m", "rlanywhere.cli"] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                 "-m", "rlanywhere.cli"])
    command = [*launcher, "train", *args_list, f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "..", "src"),
                                                                      os.environ.get("PYTHONPATH")])))
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)
    return read_metrics(run_dir)


def summarize(records: list[dict], rows_per_step: int, warmup: int) -> dict:
    train = [r for r in records if "perf/step_time_s" in r]
    timed = [r["perf/step_time_s"] for r in train[warmup:]] or [r["perf/step_time_s"] for r in train]
    step_time = statistics.median(timed)
    return {"step_time_s": step_time, "samples_per_s": rows_per_step / step_time,
            "peak_memory_gib_per_rank": max((r.get("perf/peak_memory_gib", 0.0) for r in train), default=None),
            "val_acc": {r["step"]: r["val/acc"] for r in records if "val/acc" in r}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="demo,grpo-0.5b")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--out")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="rla_scaling_")
    results = {}
    for name in args.configs.split(","):
        base = config_overrides(name, root, args.steps) + list(args.overrides)
        from rlanywhere.config import load_config

        path = base[0] if base[0].endswith(".yaml") else None
        cfg = load_config(path, base[1:] if path else base)
        rows = int(cfg.data.train_batch_size) * int(cfg.actor_rollout_ref.rollout.n)
        one = summarize(run(base, 1, os.path.join(root, f"{name}_1")), rows, args.warmup)
        many = summarize(run(base, args.nproc, os.path.join(root, f"{name}_{args.nproc}")), rows, args.warmup)
        results[name] = {"1": one, str(args.nproc): many, "speedup": many["samples_per_s"] / one["samples_per_s"]}
        print(f"\n{name}: 1 rank {one['samples_per_s']:.1f} samples/s ({one['step_time_s']:.2f} s/step), "
              f"{args.nproc} ranks {many['samples_per_s']:.1f} samples/s ({many['step_time_s']:.2f} s/step): "
              f"x{results[name]['speedup']:.2f}; peak/rank {one['peak_memory_gib_per_rank']:.2f} vs "
              f"{many['peak_memory_gib_per_rank']:.2f} GiB")
        for step in sorted(set(one["val_acc"]) | set(many["val_acc"])):
            print(f"  val/acc step {step}: 1 rank {one['val_acc'].get(step)}  {args.nproc} ranks "
                  f"{many['val_acc'].get(step)}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
