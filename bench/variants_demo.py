"""GRPO, DAPO and GSPO on the demo task, one run each, their held-out accuracy curves on one plot.

The demo (`rlanywhere train` with no arguments: SmolLM2-135M-Instruct, 2-digit addition, GRPO; its GPU profile
is 64 prompts x 8 samples, 2 optimizer steps per rollout, 60 steps, 200 held-out prompts greedy every 10 steps)
with each recipe's keys on top and nothing else changed:

    grpo  the demo as it is
    dapo  clip-higher (clip_ratio_high 0.28), token-mean loss, dynamic sampling (filter_groups on acc,
          gen_batch_size 96, at most 4 rounds), overlong shaping (last 24 of 96 tokens, factor 1),
          truncated responses out of the loss
    gspo  policy_loss.loss_mode=gspo, clip 3e-4 / 4e-4, seq-mean-token-mean

    python bench/variants_demo.py --out runs/variants                 # the GPU profile on a GPU (the must-show)
    python bench/variants_demo.py --out runs/variants --variants dapo # one run (e.g. under a per-command limit)
    python bench/variants_demo.py --out runs/variants --plot-only     # the plot and table from the runs there
    python bench/variants_demo.py --out /tmp/v --steps 2 --cpu        # CPU smoke: the CPU profile, 2 steps

Writes OUT/<variant>/ (a normal run dir each), OUT/heldout_acc.png (val/acc against step and against
training time) and prints a table of the held-out accuracy at each validation and the time taken.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    "dapo": ["actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
             "actor_rollout_ref.actor.loss_agg_mode=token-mean", "algorithm.filter_groups.enable=true",
             "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=4",
             "data.gen_batch_size=GEN_BATCH", "reward_model.overlong_buffer.enable=true",
             "reward_model.overlong_buffer.len=BUFFER", "reward_model.overlong_buffer.penalty_factor=1.0",
             "algorithm.mask_truncated_completions=true"],
    "gspo": ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=3e-4",
             "actor_rollout_ref.actor.clip_ratio_high=4e-4",
             "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"],
}


def variant_overrides(name: str, profile: dict) -> list[str]:
    """The variant's keys, sized to the profile: 1.5x the prompts per generation round, a quarter-length buffer."""
    gen_batch = profile["data"]["train_batch_size"] * 3 // 2
    buffer = max(profile["data"]["max_response_length"] // 4, 1)
    return [item.replace("GEN_BATCH", str(gen_batch)).replace("BUFFER", str(buffer)) for item in VARIANTS[name]]


def run_variant(name: str, out: str, on_gpu: bool, steps: int | None, extra: list[str]) -> list[dict]:
    from omegaconf import OmegaConf

    from rlanywhere import api
    from rlanywhere.cli import demo_profile
    from rlanywhere.config import load_config
    from rlanywhere.tracking import read_metrics
    from rlanywhere.trainer import RLTrainer

    profile = demo_profile(on_gpu)
    run_dir = os.path.abspath(os.path.join(out, name))
    overrides = variant_overrides(name, profile) + [
        f"trainer.experiment_name=demo-{name}", f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1",
        "trainer.resume_mode=disable", "hardware.device=" + ("cuda" if on_gpu else "cpu")]
    if steps is not None:
        test_freq = max(steps // 6, 1)
        overrides += [f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}"]
    cfg = load_config(None, overrides + extra, base=OmegaConf.create(profile))
    api.ensure_demo_data(cfg)  # the task the profile reads (2-digit on a GPU, 1-digit on a CPU)
    plan = api.plan(cfg)  # planned and applied to the process as `rlanywhere train` does
    print(f"== {name}: {' '.join(overrides + extra)}", flush=True)
    RLTrainer(cfg, plan, run_dir).fit()
    return read_metrics(run_dir)


def heldout_curve(records: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """(steps, val/acc, training minutes before that validation) of a run's metrics."""
    steps, accs, minutes, elapsed = [], [], [], 0.0
    for record in sorted(records, key=lambda r: r.get("step", 0)):
        elapsed += record.get("perf/step_time_s", 0.0)
        acc = record.get("val/acc")
        if isinstance(acc, (int, float)) and math.isfinite(acc):
            steps.append(int(record["step"]))
            accs.append(float(acc))
            minutes.append(elapsed / 60)
    return steps, accs, minutes


def plot_curves(curves: dict[str, tuple[list[int], list[float], list[float]]], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 3.8), layout="constrained")
    FigureCanvasAgg(figure)
    by_step, by_time = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    for name, (steps, accs, minutes) in curves.items():
        by_step.plot(steps, accs, marker="o", markersize=3, label=name)
        by_time.plot(minutes, accs, marker="o", markersize=3, label=name)
    for axes, label in ((by_step, "training step"), (by_time, "training minutes (step time, no validation)")):
        axes.set_xlabel(label)
        axes.set_ylabel("held-out accuracy (greedy)")
        axes.grid(True, alpha=0.3)
        axes.legend(loc="lower right")
    figure.suptitle("Demo task (SmolLM2-135M, 2-digit addition): GRPO vs DAPO vs GSPO")
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/variants")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the profile's)")
    parser.add_argument("--cpu", action="store_true", help="the CPU profile on the CPU even if a GPU is present")
    parser.add_argument("--plot-only", action="store_true", help="no training: plot the runs already in --out")
    parser.add_argument("extra", nargs="*", help="more overrides for every run, e.g. trainer.seed=2")
    args = parser.parse_args()

    import torch

    on_gpu = torch.cuda.is_available() and not args.cpu
    os.makedirs(args.out, exist_ok=True)
    curves = {}
    for name in args.variants:
        if args.plot_only:
            from rlanywhere.tracking import read_metrics

            if not os.path.exists(os.path.join(args.out, name)):
                continue
            records = read_metrics(os.path.join(args.out, name))
        else:
            records = run_variant(name, args.out, on_gpu, args.steps, args.extra)
        curves[name] = heldout_curve(records)
        drawn = [r["filter_groups/prompts_drawn"] for r in records if "filter_groups/prompts_drawn" in r]
        if drawn:
            print(f"{name}: dynamic sampling drew {sum(drawn):.0f} prompts over {len(drawn)} steps", flush=True)
    plot_curves(curves, os.path.join(args.out, "heldout_acc.png"))
    print("\nheld-out accuracy (step: acc), training minutes at the last validation")
    for name, (steps, accs, minutes) in curves.items():
        points = ", ".join(f"{s}: {a:.3f}" for s, a in zip(steps, accs))
        print(f"  {name:5s} {points}  [{minutes[-1] if minutes else 0:.2f} min]")
    with open(os.path.join(args.out, "heldout_acc.json"), "w") as handle:
        json.dump({name: {"step": s, "val_acc": a, "minutes": m} for name, (s, a, m) in curves.items()}, handle,
                  indent=2)
    print(f"plot: {os.path.join(args.out, 'heldout_acc.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
