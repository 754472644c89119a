"""Whole RL step with FastEngine against the same run with HFEngine (transformers generate), one box.

Runs `rlanywhere train` once per engine with identical config overrides (fresh run dirs, no checkpoints, no
validation), then prints the median per-step times from each run's metrics.jsonl and the speed-ups. The first
step of each run is skipped (CUDA graph capture, allocator warm-up).

    # SmolLM2-135M GRPO on GSM8K, 32 prompts x 8 samples, up to 256 new tokens (GPU)
    python bench/rl_step.py --steps 5 -- data.train_files=data/gsm8k/train.parquet \
        data.val_files=data/gsm8k/test.parquet data.train_batch_size=32 actor_rollout_ref.rollout.n=8 \
        data.max_response_length=256 actor_rollout_ref.rollout.temperature=0.7 algorithm.adv_estimator=grpo

The model defaults to the demo's SmolLM2-135M-Instruct (set RLANYWHERE_DEMO_GGUF to a local .gguf to skip the
download). Any other `rlanywhere train` override can follow `--`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

from rlanywhere.tracking import read_metrics  # noqa: E402

REPORTED = ("perf/step_time_s", "timing/rollout", "timing/old_log_prob", "timing/ref_log_prob", "timing/values",
            "timing/update_actor", "timing/update_critic", "perf/rollout_tokens_per_s", "response_length/mean")


def run_engine(engine: str, steps: int, overrides: list[str], root: str) -> list[dict]:
    run_dir = os.path.join(root, engine)
    command = [sys.executable, "-m", "rlanywhere.cli", "train", *overrides,
               f"actor_rollout_ref.rollout.name={engine}", f"trainer.total_training_steps={steps}",
               f"trainer.default_local_dir={run_dir}", "trainer.val_before_train=false", "trainer.test_freq=0",
               "trainer.save_freq=0", "trainer.logger=[console]"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "..", "src"),
                                                                      os.environ.get("PYTHONPATH")])))
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)
    return read_metrics(run_dir)


def median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="training steps per engine (the first is skipped)")
    parser.add_argument("--engines", default="fast,hf")
    parser.add_argument("overrides", nargs="*", help="rlanywhere train overrides (after --)")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (the first step is not timed)")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    results = {}
    with tempfile.TemporaryDirectory(prefix="rl_step_") as root:
        for engine in engines:
            records = [r for r in run_engine(engine, args.steps, args.overrides, root) if "perf/step_time_s" in r]
            results[engine] = {key: median(records[1:], key) for key in REPORTED}

    print(f"\nmedian over steps 2..{args.steps}")
    print(f"{'metric':<28}" + "".join(f"{e:>14}" for e in engines))
    for key in REPORTED:
        cells = [results[e][key] for e in engines]
        print(f"{key:<28}" + "".join(f"{c:>14.3f}" if c is not None else f"{'-':>14}" for c in cells))
    if "fast" in results and "hf" in results:
        for key in ("perf/step_time_s", "timing/rollout"):
            fast, hf = results["fast"][key], results["hf"][key]
            if fast and hf:
                print(f"speed-up {key}: {hf / fast:.2f}x (hf {hf:.2f} s / fast {fast:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
