"""Time to accuracy: held-out greedy accuracy against training minutes and steps, per algorithm, and TRL's GRPO.

The task is the GPU demo's (`rlanywhere.cli.demo_profile(on_gpu=True)`): SmolLM2-135M-Instruct (real weights,
dequantized from the demo GGUF into one HF directory that every run loads), 2-digit addition (2,000 train and 200
test prompts, seed 0), 64 prompts x 8 samples a step, up to 96 new tokens, temperature 0.7, lr 5e-6, two optimizer
steps a step (mini-batch 32 prompts), held-out accuracy on the 200 test prompts with greedy decoding.

    python bench/time_to_accuracy.py run --algo grpo --out tta/grpo.json     # also rloo, reinforce_plus_plus, gae
    python bench/time_to_accuracy.py run --algo trl-grpo --out tta/trl-grpo.json
    python bench/time_to_accuracy.py run --algo grpo --emulate p40 --out tta/grpo-p40.json
    python bench/time_to_accuracy.py plot tta/*.json --png docs/time_to_accuracy.png
    python bench/time_to_accuracy.py card tta/*.json          # the docs/results.md rows
    python bench/time_to_accuracy.py run --algo grpo --tiny --out /tmp/tta.json   # CPU, tiny model, minutes

`gae` (PPO with the critic) samples one response per prompt, so it gets 512 prompts x 1 a step (the same 512
sequences) and a mini-batch of 256 prompts (the same two optimizer steps). Extra `rlanywhere train` overrides can
follow `--` (rlanywhere runs only). `trl-grpo` is TRL's GRPOTrainer (no vLLM) on the same model directory, prompts,
group size, lr, weight decay, lengths, temperature and mini-batching, evaluated every --test-freq steps on the same
200 prompts with rlanywhere's greedy decoding and reward function (bench/sides.py).

Minutes are training minutes: the sum of the step times, without the model load and without the evaluations
(whose cost differs between the two frameworks' generation paths and is not part of learning). The process's
whole wall time is recorded as well. "Minutes to 0.8" is the training time at the first evaluation at or above
0.8, so its resolution is --test-freq steps.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sides  # noqa: E402

ALGORITHMS = ("grpo", "rloo", "reinforce_plus_plus", "gae", "trl-grpo")
THRESHOLDS = (0.5, 0.8)


# ------------------------------------------------------------------------------------------------ pure helpers
def flatten_overrides(tree: dict, prefix: str = "") -> list[str]:
    """A nested config dict as dotted `key=value` overrides (lists in OmegaConf's [a,b] syntax)."""
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += flatten_overrides(value, name + ".")
        elif isinstance(value, (list, tuple)):
            out.append(f"{name}=[{','.join(str(v) for v in value)}]")
        elif isinstance(value, bool):
            out.append(f"{name}={'true' if value else 'false'}")
        else:
            out.append(f"{name}={value}")
    return out


def curve_from_rlanywhere(records: list[dict], fields: Optional[dict] = None) -> list[dict]:
    """(step, training minutes, val/acc, and `fields` {name: metric}, by default val/format) at every validation in
    an rlanywhere metrics.jsonl.

    Training minutes at step s are the sum of perf/step_time_s over steps 1..s (validation time excluded)."""
    fields = {"format": "val/format"} if fields is None else fields
    points, seconds, seen = [], 0.0, set()
    for record in sorted(records, key=lambda r: r["step"]):
        if "perf/step_time_s" in record and record["step"] not in seen:
            seen.add(record["step"])
            seconds += record["perf/step_time_s"]
        if "val/acc" in record:
            points.append({"step": record["step"], "minutes": seconds / 60, "acc": record["val/acc"],
                           **{name: record.get(metric) for name, metric in fields.items()}})
    return points


def warmup_minutes(records: list[dict]) -> dict:
    """Training minutes an rlanywhere run spent compiling and capturing decode CUDA graphs (perf/compile_s,
    perf/graph_capture_s summed over its steps, validation excluded): what a longer run would spread thinner."""
    steps = {r["step"]: r for r in records if "perf/step_time_s" in r}
    return {"compile": sum(r.get("perf/compile_s", 0.0) for r in steps.values()) / 60,
            "graph_capture": sum(r.get("perf/graph_capture_s", 0.0) for r in steps.values()) / 60}


STEP_COLUMNS = {"s_per_step": "perf/step_time_s", "rollout_s": "timing/rollout", "old_log_prob_s": "timing/old_log_prob",
                "update_s": "timing/update_actor", "background_rollout_s": "async/rollout_s",
                "rollout_wait_s": "timing/rollout_wait", "peak_memory_gib": "perf/peak_memory_gib"}


def step_summary(records: list[dict], first_step: int = 3) -> dict:
    """Medians per step from `first_step` on (the first steps compile and capture graphs): step time, phases and
    peak memory; a phase the run never timed is left out."""
    steps = {r["step"]: r for r in records if "perf/step_time_s" in r and r["step"] >= first_step}
    summary = {}
    for name, key in STEP_COLUMNS.items():
        values = [r[key] for r in steps.values() if isinstance(r.get(key), (int, float))]
        if values:
            summary[name] = statistics.median(values)
    summary["steps"] = len(steps)
    return summary


def curve_from_trl(records: list[dict]) -> list[dict]:
    """The same points from the TRL side's records (evaluations carry `train_seconds` at that step)."""
    return [{"step": r["step"], "minutes": r["train_seconds"] / 60, "acc": r["val/acc"], "format": r.get("val/format")}
            for r in records if "val/acc" in r]


def trl_seconds_per_step(records: list[dict], skip: int = 1) -> Optional[float]:
    """Median seconds of a TRL run's steps (a step: one generation and its optimizer steps, whose records share
    `step`), the first `skip` steps (model warm-up) left out; None when no step is left."""
    per_step: dict[int, float] = {}
    for record in records:
        if "perf/step_time_s" in record:
            per_step[record["step"]] = per_step.get(record["step"], 0.0) + record["perf/step_time_s"]
    steady = [seconds for step, seconds in sorted(per_step.items())][skip:]
    return statistics.median(steady) if steady else None


def fastest_micro_batch(seconds_per_step: dict[int, Optional[float]]) -> int:
    """The micro-batch whose short run had the fewest seconds a step (runs without a figure left out)."""
    timed = {micro: seconds for micro, seconds in seconds_per_step.items() if seconds is not None}
    if not timed:
        raise SystemExit("the TRL micro-batch sweep timed no step: raise --trl-sweep-steps")
    return min(timed, key=timed.get)


def micro_batches_from(text: str) -> list[int]:
    """--trl-micro-batch: one number, or a comma list to sweep."""
    try:
        values = sorted({int(part) for part in str(text).split(",") if part.strip()})
    except ValueError:
        raise SystemExit(f"--trl-micro-batch {text!r}: expected numbers separated by commas, e.g. 32,64,128")
    if not values or min(values) < 1:
        raise SystemExit(f"--trl-micro-batch {text!r}: expected positive numbers, e.g. 32,64,128")
    return values


def minutes_to_reach(points: list[dict], threshold: float) -> Optional[float]:
    """Training minutes at the first evaluation with accuracy >= threshold; None when never reached."""
    for point in sorted(points, key=lambda p: p["step"]):
        if point["acc"] >= threshold:
            return point["minutes"]
    return None


def card_rows(results: list[dict]) -> list[str]:
    """docs/results.md time-to-accuracy rows: task, model, hardware, algorithm, minutes to 0.5 / 0.8, accuracy."""
    rows = []
    for result in results:
        points = result["points"]
        cells = [result["task"], result["model"], result["hardware"], result["label"]]
        for threshold in THRESHOLDS:
            minutes = minutes_to_reach(points, threshold)
            cells.append(f"{minutes:.2f}" if minutes is not None else "not reached")
        start, final = points[0]["acc"], points[-1]["acc"]
        cells.append(f"{start:.3f} -> {final:.3f} in {points[-1]['step']} steps, {points[-1]['minutes']:.2f} min")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


# ------------------------------------------------------------------------------------------------ runs
def demo_task(work_dir: str, tiny: bool) -> tuple[dict, dict]:
    """The demo's data files and its GPU (or, with --tiny, CPU) profile."""
    from rlanywhere.cli import demo_profile
    from rlanywhere.data import prepare_arithmetic

    paths = prepare_arithmetic(os.path.join(work_dir, "arith"), train_size=2000, test_size=200, digits=2,
                               operators="+", seed=0)
    profile = demo_profile(on_gpu=not tiny)
    if tiny:  # minutes on a shared CPU: a few short steps, few validation prompts
        profile["data"].update(train_batch_size=2, max_response_length=12, val_max_samples=4)
        profile["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 2
        profile["actor_rollout_ref"]["rollout"]["n"] = 2
        profile["trainer"]["total_training_steps"] = 2
    return paths, profile


def algorithm_overrides(algorithm: str, profile: dict) -> list[str]:
    """The demo profile for one rlanywhere algorithm; gae keeps the step's sequences with one sample a prompt."""
    data, actor = profile["data"], profile["actor_rollout_ref"]
    if algorithm != "gae":
        return [f"algorithm.adv_estimator={algorithm}"]
    n = actor["rollout"]["n"]
    return ["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1",
            f"data.train_batch_size={data['train_batch_size'] * n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={actor['actor']['ppo_mini_batch_size'] * n}"]


def hardware_label(emulate: Optional[str]) -> str:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return f"{name}, --emulate {emulate}" if emulate else name


GPU_FIELDS = ("clocks.sm", "temperature.gpu", "power.draw")  # nvidia-smi --query-gpu names


class GpuSampler:
    """nvidia-smi sampling the card's SM clock (MHz), temperature (C) and power (W) once a second while a run goes:
    a run slower than another on a hot or power-capped card shows a lower clock, not a slower program. Nothing
    where nvidia-smi is missing."""

    def __init__(self, work_dir: str):
        import atexit
        import shutil
        import subprocess

        self.path, self.process = os.path.join(work_dir, "gpu_samples.csv"), None
        if shutil.which("nvidia-smi"):
            with open(self.path, "w") as out:
                self.process = subprocess.Popen(
                    ["nvidia-smi", "-i", "0", f"--query-gpu={','.join(GPU_FIELDS)}", "--format=csv,noheader,nounits",
                     "-lms", "1000"], stdout=out, stderr=subprocess.DEVNULL)
            atexit.register(self.stop)  # a run that fails leaves no sampler behind

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)

    def summary(self) -> Optional[dict]:
        """Stops sampling; median, min and max of each field over the samples."""
        if self.process is None:
            return None
        self.stop()
        with open(self.path) as samples:
            return gpu_summary(samples.read())


def gpu_summary(text: str) -> Optional[dict]:
    """{field: {median, min, max}} of nvidia-smi's CSV samples (GPU_FIELDS, no header); rows that do not parse (a
    field the card does not report: "[N/A]") are left out."""
    rows = []
    for line in text.splitlines():
        try:
            rows.append([float(value) for value in line.split(",")])
        except ValueError:
            continue
    rows = [row for row in rows if len(row) == len(GPU_FIELDS)]
    if not rows:
        return None
    return {field: {"median": statistics.median(column), "min": min(column), "max": max(column),
                    "samples": len(column)} for field, column in zip(GPU_FIELDS, zip(*rows))}


def run(args) -> dict:
    import tempfile

    profile_work = args.work_dir or tempfile.mkdtemp(prefix="tta_")
    paths, profile = demo_task(profile_work, args.tiny)
    model_dir = sides.materialize_model(os.path.join(profile_work, "model-" + ("tiny" if args.tiny else "smollm2")),
                                        "tiny" if args.tiny else sides.REAL_SMOLLM2)
    steps = args.steps or profile["trainer"]["total_training_steps"]
    test_freq = args.test_freq
    data, actor = profile["data"], profile["actor_rollout_ref"]
    started = time.time()
    gpu = GpuSampler(profile_work) if not args.tiny else None
    sweep: dict[int, Optional[float]] = {}  # TRL micro-batch -> seconds a step in its short run
    if args.algo == "trl-grpo":
        if not sides.trl_available():
            raise SystemExit(sides.TRL_MISSING.replace("running rlanywhere alone", "cannot run trl-grpo"))
        if args.emulate:
            raise SystemExit("--emulate applies to rlanywhere runs only")
        import torch

        on_gpu = torch.cuda.is_available() and not args.tiny
        spec = dict(model_dir=model_dir, train_parquet=paths["train"], val_parquet=paths["test"],
                    val_max_samples=data["val_max_samples"], max_prompt_length=data["max_prompt_length"],
                    out=os.path.join(profile_work, "trl_records.jsonl"), steps=steps,
                    prompts_per_step=data["train_batch_size"], n=actor["rollout"]["n"],
                    mini_prompts=actor["actor"]["ppo_mini_batch_size"], max_new_tokens=data["max_response_length"],
                    lr=actor["actor"]["optim"]["lr"], temperature=actor["rollout"]["temperature"],
                    precision="bf16" if on_gpu else "fp32", tf32=True, gradient_checkpointing=args.trl_checkpointing,
                    test_freq=test_freq, cpu=not on_gpu, seed=1,
                    max_seconds=args.max_minutes * 60 if args.max_minutes else None)
        micro_batches = micro_batches_from(args.trl_micro_batch)
        if len(micro_batches) > 1:  # TRL at its fastest: a short run per micro-batch, no evaluation, then the curve
            for micro in micro_batches:
                sweep_spec = dict(spec, micro_batch=micro, steps=args.trl_sweep_steps, val_parquet=None,
                                  max_seconds=None, out=os.path.join(profile_work, f"trl_sweep_{micro}.jsonl"))
                sweep[micro] = trl_seconds_per_step(sides.start_trl(
                    sweep_spec, os.path.join(profile_work, f"trl_sweep_{micro}_spec.json")))
                print(f"TRL micro-batch {micro}: {sweep[micro]} s a step", flush=True)
        spec["micro_batch"] = fastest_micro_batch(sweep) if sweep else micro_batches[0]
        started = time.time()  # the process time of the curve's run, the sweep's processes left out
        points = curve_from_trl(sides.start_trl(spec, os.path.join(profile_work, "trl_spec.json")))
        label = f"TRL GRPOTrainer (micro-batch {spec['micro_batch']}" + (", its fastest)" if sweep else ")")
    else:
        overrides = flatten_overrides({k: v for k, v in profile.items() if k != "trainer"})
        overrides += [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={paths['train']}",
                      f"data.val_files={paths['test']}", f"trainer.total_training_steps={steps}",
                      *algorithm_overrides(args.algo, profile)]
        if args.emulate:
            overrides.append(f"hardware.emulate={args.emulate}")
        if args.tiny:
            overrides.append("hardware.device=cpu")
        run_dir = os.path.join(profile_work, "runs", args.algo + (f"-{args.emulate}" if args.emulate else ""))
        # run_rlanywhere turns validation off; asking for it again here (later overrides win).
        records = sides.run_rlanywhere(run_dir, overrides + args.overrides + [
            "trainer.val_before_train=true", f"trainer.test_freq={test_freq}"])
        points = curve_from_rlanywhere(records)
        label = f"rlanywhere {args.algo}" + (f", {args.label}" if args.label else "")
        warmup = warmup_minutes(records)
        timing = step_summary(records)
        print("step medians (steps 3..): " + ", ".join(f"{k} {v:.3f}" for k, v in timing.items()), flush=True)
        print(f"of the training minutes: compiling {warmup['compile']:.2f}, capturing decode graphs "
              f"{warmup['graph_capture']:.2f}", flush=True)
    card = gpu.summary() if gpu is not None else None
    if card:
        print("the card during the run (median, min-max): " + ", ".join(
            f"{field} {v['median']:.0f} ({v['min']:.0f}-{v['max']:.0f})" for field, v in card.items()), flush=True)
    if not points:
        raise SystemExit("the run recorded no held-out accuracy")
    return {"card": card, "label": label + (f" (--emulate {args.emulate})" if args.emulate else ""),
            "algorithm": args.algo,
            "task": f"2-digit addition ({data['val_max_samples']} held-out, greedy)",
            "model": "tiny random (--tiny)" if args.tiny else "SmolLM2-135M-Instruct",
            "hardware": hardware_label(args.emulate), "steps": points[-1]["step"], "test_freq": test_freq,
            "process_minutes": (time.time() - started) / 60, "points": points,
            **({"warmup_minutes": warmup, "step_medians": timing} if args.algo != "trl-grpo" else {}),
            **({"trl_sweep_seconds_per_step": {str(k): v for k, v in sweep.items()}} if sweep else {})}


def write_outputs(result: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as handle:
        json.dump(result, handle, indent=2)
    with open(os.path.splitext(out)[0] + ".csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["step", "minutes", "acc", "format"])
        writer.writeheader()
        writer.writerows(result["points"])
    print(f"wrote {out} and {os.path.splitext(out)[0]}.csv")


def plot(results: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_minutes, by_steps) = plt.subplots(1, 2, figsize=(12, 4.5))
    for result in results:
        points = result["points"]
        by_minutes.plot([p["minutes"] for p in points], [p["acc"] for p in points], marker="o", label=result["label"])
        by_steps.plot([p["step"] for p in points], [p["acc"] for p in points], marker="o", label=result["label"])
    for axis, xlabel in ((by_minutes, "training minutes (evaluation excluded)"), (by_steps, "step")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel("held-out accuracy (greedy)")
        axis.set_ylim(0, 1)
        axis.grid(alpha=0.3)
    by_steps.legend(fontsize=8)
    first = results[0]
    fig.suptitle(f"{first['task']} - {first['model']} - {first['hardware']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="train one algorithm and record its curve")
    run_p.add_argument("--algo", required=True, choices=ALGORITHMS)
    run_p.add_argument("--out", required=True, help="curve JSON (a .csv is written beside it)")
    run_p.add_argument("--steps", type=int, default=None, help="default: the demo profile's (60)")
    run_p.add_argument("--test-freq", type=int, default=5, help="evaluate every this many steps (and at 0, last)")
    run_p.add_argument("--emulate", default=None, help="rlanywhere --emulate CARD (e.g. p40)")
    run_p.add_argument("--label", default=None, help="the curve's name in plots after 'rlanywhere ALGO, ' (e.g. the "
                       "mode the extra overrides set)")
    run_p.add_argument("--trl-micro-batch", default="64",
                       help="TRL completions per forward/backward; a comma list (e.g. 16,32,64,128,256) first runs "
                            "TRL --trl-sweep-steps steps per value without evaluation and takes the fastest (the "
                            "sweep's process time is not in the curve's)")
    run_p.add_argument("--trl-sweep-steps", type=int, default=3,
                       help="steps per micro-batch in the sweep (the first is left out of its median)")
    run_p.add_argument("--trl-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                       help="TRL gradient checkpointing (its default: on)")
    run_p.add_argument("--max-minutes", type=float, default=None,
                       help="trl-grpo: stop after this much wall time (at a step's end, evaluated), e.g. to fit a "
                            "time-limited job; the curve records the steps reached")
    run_p.add_argument("--tiny", action="store_true", help="tiny random model, a few tiny steps, on the CPU")
    run_p.add_argument("--work-dir", default=None, help="model, data and run directories (default: a new temp dir)")
    run_p.add_argument("overrides", nargs="*", help="extra rlanywhere train overrides (after --)")
    plot_p = sub.add_parser("plot", help="all curves on one PNG: accuracy vs minutes and vs steps")
    plot_p.add_argument("results", nargs="+")
    plot_p.add_argument("--png", required=True)
    card_p = sub.add_parser("card", help="print the docs/results.md time-to-accuracy rows")
    card_p.add_argument("results", nargs="+")
    args = parser.parse_args()

    if args.command == "run":
        result = run(args)
        write_outputs(result, args.out)
        print("\n".join(card_rows([result])))
        return 0
    results = []
    for path in args.results:
        with open(path) as handle:
            results.append(json.load(handle))
    if args.command == "plot":
        plot(results, args.png)
    else:
        print("| task | model | hardware | algorithm | min to 0.5 | min to 0.8 | accuracy (start -> final) |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(card_rows(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
