"""The calculator demo end to end: SmolLM2-135M-Instruct learning to call a calculator for 3-digit multiplication.

    python bench/tool_use_demo.py run --out demo-tools/h200.json --steps 30                  # one GPU
    python bench/tool_use_demo.py run --out demo-tools/p40.json --steps 10 --emulate p40     # an emulated P40
    python bench/tool_use_demo.py run --out demo-tools/cpu.json --steps 8 -- data.train_batch_size=4 ...  # the CPU
    python bench/tool_use_demo.py plot demo-tools/*.json --png docs/tool_use.png

`run` writes the task (`rlanywhere prepare tool-arithmetic` and, for the no-tool baseline, the same questions as
plain `rlanywhere prepare arithmetic`), measures the base model's held-out accuracy without tools (greedy, single
turn), trains `examples/tool_arith.yaml` (GRPO, multi-turn with the calculator; extra overrides after `--`) and
records every validation: held-out accuracy and tool-call rate (greedy, multi-turn) against training minutes (the
sum of step times, validations excluded). `plot` draws accuracy and tool-call rate of the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONFIG = os.path.join(ROOT, "examples", "tool_arith.yaml")
TOOL_DATA, PLAIN_DATA = "data/tool-arith", "data/arith-mul3"
sys.path.insert(0, HERE)
from time_to_accuracy import curve_from_rlanywhere  # noqa: E402  (the same training-minutes curve)


def curve(records: list[dict]) -> list[dict]:
    """(step, training minutes, held-out accuracy, tool-call rate) at every validation of a metrics.jsonl."""
    return curve_from_rlanywhere(records, {"tool_call_rate": "val/multi_turn/tool_call_rate",
                                           "tool_calls": "val/multi_turn/tool_calls/mean"})


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


def card_label(emulate) -> str:
    """What the run ran on, for the plot's legend: the GPU's name (or the CPU), and the card it emulated."""
    import torch
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return f"{card} as a {emulate.upper()}" if emulate else card


def run(args, extra: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prep = [sys.executable, "-m", "rlanywhere.cli", "prepare"]
    subprocess.run(prep + ["tool-arithmetic", "--out", TOOL_DATA, "--digits", "3", "--operators", "*"], check=True,
                   env=env, cwd=ROOT)
    subprocess.run(prep + ["arithmetic", "--out", PLAIN_DATA, "--digits", "3", "--operators", "*"], check=True,
                   env=env, cwd=ROOT)
    emulate = ["--emulate", args.emulate] if args.emulate else []
    hardware = args.hardware or card_label(args.emulate)
    result = {"task": "3-digit multiplication, held-out prompts, greedy", "model": "SmolLM2-135M-Instruct",
              "hardware": hardware, "steps": args.steps, "overrides": extra}
    if not args.skip_baseline:
        out = subprocess.run([sys.executable, os.path.join(HERE, "tool_use_eval.py"), "--data",
                              f"{TOOL_DATA}/test.parquet", "--plain-data", f"{PLAIN_DATA}/test.parquet", "--samples",
                              "100", "--max-new-tokens", "96", "--modes", "no tools"], env=env, cwd=ROOT,
                             capture_output=True, text=True, timeout=args.timeout)
        found = re.search(r"no tools\s+accuracy ([0-9.]+)", out.stdout)
        result["no_tool_baseline_acc"] = float(found.group(1)) if found else None
        print(out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:], flush=True)
    run_dir = args.run_dir
    command = [sys.executable, "-m", "rlanywhere.cli", "train", *emulate, CONFIG,
               f"trainer.total_training_steps={args.steps}", f"trainer.default_local_dir={run_dir}",
               "trainer.overwrite_run_dir=true", *extra]
    print(" ".join(command), flush=True)
    start = time.perf_counter()
    try:
        subprocess.run(command, env=env, cwd=ROOT, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        result["stopped"] = f"timeout after {args.timeout} s"
    result["wall_s"] = time.perf_counter() - start
    result["points"] = curve(read_jsonl(os.path.join(run_dir, "metrics.jsonl")))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(result, handle, indent=1)
    for p in result["points"]:
        print(f"step {p['step']:3d}  {p['minutes']:5.2f} min  acc {p['acc']:.3f}  tool-call rate "
              f"{p['tool_call_rate']}", flush=True)


def plot(paths: list[str], png: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 4))
    acc_axes, rate_axes = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    for path in paths:
        with open(path) as handle:
            data = json.load(handle)
        steps = [p["step"] for p in data["points"]]
        acc_axes.plot(steps, [p["acc"] for p in data["points"]], marker="o", label=data["hardware"])
        rate_axes.plot(steps, [p["tool_call_rate"] or 0 for p in data["points"]], marker="o", label=data["hardware"])
        if data.get("no_tool_baseline_acc") is not None:
            acc_axes.axhline(data["no_tool_baseline_acc"], linestyle=":", color="grey",
                             label=f"no tool (base model), {data['hardware']}")
    acc_axes.set(title="Held-out accuracy (greedy, with the calculator)", xlabel="step", ylabel="accuracy",
                 ylim=(0, 1))
    rate_axes.set(title="Held-out tool-call rate", xlabel="step", ylabel="rows with a call", ylim=(0, 1.05))
    for axes in (acc_axes, rate_axes):
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.tight_layout()
    FigureCanvasAgg(figure).print_png(png)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--steps", type=int, default=30)
    r.add_argument("--emulate")
    r.add_argument("--hardware", help="the label of the run (default: the card, or '<card> as a P40' with --emulate)")
    r.add_argument("--run-dir", default="/tmp/tool-demo-run")
    r.add_argument("--timeout", type=int, default=900, help="seconds the training run may take")
    r.add_argument("--skip-baseline", action="store_true")
    p = sub.add_parser("plot")
    p.add_argument("paths", nargs="+")
    p.add_argument("--png", required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args, extra)
    else:
        plot(args.paths, args.png)


if __name__ == "__main__":
    main()
