"""What a short run pays before its steps run at full speed: setup, compiling and CUDA-graph capture, cold and warm.

Runs the GPU demo's training job (`rlanywhere.cli.demo_profile`: 64 prompts x 8, up to 96 new tokens, two optimizer
steps a step; the time-to-accuracy job without its evaluations) a few steps, twice in one fresh cache folder:
first with empty compile caches (inductor's and Triton's, as on a new machine), then again with what the first run
left there. For each run it prints the process's wall time, the time outside its steps ("outside steps s": imports,
model load, planning and the engine before step 1, and after the last one the final model's export, the plots and
the exit), the first step and what it spent compiling (`perf/compile_s`) and capturing decode CUDA graphs
(`perf/graph_capture_s`), and the median later step.

    python bench/first_steps.py                                   # SmolLM2-135M's shape, random weights
    python bench/first_steps.py --model smollm2-135m              # the demo's real weights (needs the demo GGUF)
    python bench/first_steps.py --tiny                            # CPU, tiny model: checks the bench itself
    python bench/first_steps.py -- actor_rollout_ref.actor.use_torch_compile=false    # extra train overrides
    python bench/first_steps.py -- hardware.compile_training=true     # compiled, as a long run is

Random weights rarely stop early, so their responses run the whole 96 tokens where the trained demo's are ~25.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sides  # noqa: E402
from time_to_accuracy import demo_task, flatten_overrides  # noqa: E402

COLUMNS = ("process s", "outside steps s", "1st step s", "compile s", "capture s", "1st other s", "later step s")


def first_step_breakdown(records: list[dict], process_seconds: float) -> dict:
    """The columns of one run from its metrics.jsonl records and the process's wall seconds: "outside steps" is the
    wall time no step accounts for (imports, loading and planning before step 1; the final model's export, the plots
    and the exit after the last; the bench runs no evaluation), "1st other" the first step's seconds that were
    neither compiling nor capturing."""
    steps = sorted((r for r in records if "perf/step_time_s" in r), key=lambda r: r["step"])
    if not steps:
        raise SystemExit("the run recorded no step")
    first = steps[0]
    compile_s, capture_s = first.get("perf/compile_s", 0.0), first.get("perf/graph_capture_s", 0.0)
    later = [r["perf/step_time_s"] for r in steps[1:]]
    return {"process s": process_seconds,
            "outside steps s": process_seconds - sum(r["perf/step_time_s"] for r in steps),
            "1st step s": first["perf/step_time_s"], "compile s": compile_s, "capture s": capture_s,
            "1st other s": first["perf/step_time_s"] - compile_s - capture_s,
            "later step s": statistics.median(later) if later else None}


def format_rows(rows: list[tuple[str, dict]]) -> str:
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"{'run':<{width}}" + "".join(f"{name:>14}" for name in COLUMNS)]
    for label, row in rows:
        lines.append(f"{label:<{width}}" + "".join(
            f"{row[name]:>14.2f}" if isinstance(row.get(name), (int, float)) else f"{'-':>14}" for name in COLUMNS))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-shape",
                        help=f"random-weight shape {sorted(sides.SHAPES)} or {sides.REAL_SMOLLM2} (real weights)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="tiny random model and sizes, on the CPU")
    parser.add_argument("--work-dir", default=None, help="model, data, caches and runs (default: a temp dir)")
    parser.add_argument("overrides", nargs="*", help="extra rlanywhere train overrides (after --)")
    args = parser.parse_args()
    if args.steps < 2:
        raise SystemExit(f"--steps {args.steps}: at least 2 (the first step and a later one)")
    work = args.work_dir or tempfile.mkdtemp(prefix="first_steps_")
    paths, profile = demo_task(work, args.tiny)
    model_dir = sides.materialize_model(os.path.join(work, "model-" + ("tiny" if args.tiny else args.model)),
                                        "tiny" if args.tiny else args.model)
    overrides = flatten_overrides({k: v for k, v in profile.items() if k != "trainer"})
    overrides += [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={paths['train']}",
                  f"data.val_files={paths['test']}", f"trainer.total_training_steps={args.steps}"]
    if args.tiny:
        overrides.append("hardware.device=cpu")
    cache = os.path.join(work, "cache")  # fresh: compile caches start empty, as on a new machine
    os.environ["RLANYWHERE_CACHE"] = cache
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")  # the Triton kernels' own cache too
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # inductor's follows RLANYWHERE_CACHE (compiling.py)
    rows = []
    for label in ("cold caches", "warm caches"):
        started = time.perf_counter()
        records = sides.run_rlanywhere(os.path.join(work, "runs", label.split()[0]), overrides + args.overrides)
        rows.append((label, first_step_breakdown(records, time.perf_counter() - started)))
    print(f"\n{args.model if not args.tiny else 'tiny'}, the demo's job ({profile['data']['train_batch_size']} prompts "
          f"x {profile['actor_rollout_ref']['rollout']['n']}), {args.steps} steps, caches in {cache}")
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
