"""Run the GSM8K format recipe (examples/gsm8k_format.yaml) once and report it honestly: held-out format rate,
strict accuracy and flexible accuracy before and after, and the curve as JSON in docs/curves/ format.

    # GPU (one H200, <= 8 min): SmolLM2-135M-Instruct from the demo GGUF, GSM8K jsonl under .gsm8k/
    RLANYWHERE_DEMO_GGUF=/root/models/smol.gguf python bench/gsm8k_recipe.py --gsm8k-dir .gsm8k \
        --out docs/curves/gsm8k-format.json
    # CPU smoke (tiny random model, 1 step, a handful of prompts): checks the recipe end to end, learns nothing
    python bench/gsm8k_recipe.py --smoke --out /tmp/gsm8k-smoke.json
    # no training: what the prompt alone gives the untrained model (zero-shot vs one-shot, greedy, N test prompts)
    python bench/gsm8k_recipe.py --probe 200 --out gsm8k-probe.json
    # the contrast run: the same recipe with verl's instruction alone (no worked example)
    python bench/gsm8k_recipe.py --zero-shot --out docs/curves/gsm8k-format-0shot.json

Steps: write the one-shot GSM8K parquet (rlanywhere.data.prepare_gsm8k(one_shot=True)) from train.jsonl /
test.jsonl, run `rlanywhere train examples/gsm8k_format.yaml` in this process (validation before training and every
test_freq steps on the first 200 test prompts, greedy), then re-score every saved validation response
(RUN_DIR/val_generations/step_N.jsonl) with rlanywhere.rewards.gsm8k_metrics:

* format rate: a `#### <number>` is in the response;
* strict accuracy: the number after the last `####` equals the answer (what the reward pays 1.0 for);
* flexible accuracy: the last number anywhere in the response equals the answer (no marker needed).

Minutes are training minutes (sum of perf/step_time_s, validation excluded), as in bench/time_to_accuracy.py.
Extra `rlanywhere train` overrides may follow `--`.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import re
import shutil
import sys
import time
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "src"))

RECIPE = os.path.join(REPO, "examples", "gsm8k_format.yaml")
REWARD_FILE = os.path.join(REPO, "examples", "gsm8k_format_reward.py")
FORMAT_TARGET = 0.9  # issue 16: the recipe must bring the held-out format rate to >= 90 %
# The CPU smoke: the recipe's every key, shrunk to seconds (a handful of prompts, short answers, 1 step).
SMOKE_OVERRIDES = ["data.train_batch_size=2", "data.max_response_length=16", "data.val_max_samples=4",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.n=2",
                   "trainer.total_training_steps=1", "trainer.test_freq=1", "hardware.device=cpu"]


def find_gsm8k_dir(given: Optional[str]) -> str:
    """The directory holding GSM8K's train.jsonl and test.jsonl: --gsm8k-dir, else .gsm8k/ in the repo, else the
    team's ../shared copy or the tests' sample."""
    candidates = [given] if given else [os.path.join(REPO, ".gsm8k")]
    if not given:
        import sides

        candidates.append(sides.default_gsm8k_dir())
    for candidate in filter(None, candidates):
        if all(os.path.isfile(os.path.join(candidate, f"{split}.jsonl")) for split in ("train", "test")):
            return os.path.abspath(candidate)
    raise SystemExit(f"no GSM8K train.jsonl + test.jsonl in {[c for c in candidates if c]}: put them under "
                     f"{os.path.join(REPO, '.gsm8k')}/ or pass --gsm8k-dir DIR")


def val_generation_files(run_dir: str) -> dict[int, str]:
    """{step: RUN_DIR/val_generations/step_N.jsonl} for every validation the run saved."""
    files = {}
    for path in glob.glob(os.path.join(run_dir, "val_generations", "step_*.jsonl")):
        match = re.fullmatch(r"step_(\d+)\.jsonl", os.path.basename(path))
        if match:
            files[int(match.group(1))] = path
    return dict(sorted(files.items()))


def rescore_validations(run_dir: str) -> dict[int, dict]:
    """{step: format_rate / strict_acc / flexible_acc / num_samples} from the saved validation responses."""
    from rlanywhere.rewards import gsm8k_metrics

    out = {}
    for step, path in val_generation_files(run_dir).items():
        with open(path) as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        out[step] = gsm8k_metrics([r["response"] for r in rows], [r["ground_truth"] for r in rows])
    return out


def curve_points(records: list[dict], rescored: dict[int, dict]) -> list[dict]:
    """One point per validation: step, training minutes, strict accuracy as `acc` (docs/curves' key), format rate
    as `format`, flexible accuracy, and the trainer's own val/acc (it must equal the strict accuracy)."""
    seconds, step_seconds = 0.0, {}
    for record in sorted(records, key=lambda r: r["step"]):
        if "perf/step_time_s" in record and record["step"] not in step_seconds:
            seconds += record["perf/step_time_s"]
            step_seconds[record["step"]] = seconds
    trainer_acc = {r["step"]: r["val/acc"] for r in records if "val/acc" in r}
    points = []
    for step, metrics in rescored.items():
        done = [s for s in step_seconds if s <= step]
        minutes = step_seconds[max(done)] / 60 if done else 0.0
        points.append({"step": step, "minutes": minutes, "acc": metrics["strict_acc"],
                       "format": metrics["format_rate"], "flexible_acc": metrics["flexible_acc"],
                       "trainer_val_acc": trainer_acc.get(step), "num_samples": metrics["num_samples"]})
    return points


def summary_lines(points: list[dict]) -> list[str]:
    """Before -> after for the three numbers, and whether the format target was met."""
    first, last = points[0], points[-1]
    count = last["num_samples"]
    lines = [f"held-out GSM8K ({count} test prompts, greedy), step {first['step']} -> step {last['step']} "
             f"({last['minutes']:.2f} training minutes):"]
    for name, key in (("format rate (#### n present)", "format"), ("strict accuracy (#### n == answer)", "acc"),
                      ("flexible accuracy (last number == answer)", "flexible_acc")):
        lines.append(f"  {name:<44} {first[key]:.3f} -> {last[key]:.3f} ({(last[key] - first[key]) * 100:+.1f} points)")
    met = "met" if last["format"] >= FORMAT_TARGET else "NOT met"
    lines.append(f"  format-rate target >= {FORMAT_TARGET:.2f}: {met}")
    return lines


def probe_prompts(gsm8k_dir: str, count: int, model: Optional[str], device: Optional[str]) -> list[dict]:
    """No training: greedy answers of the untrained model to the first `count` test questions, zero-shot and
    one-shot, with the three numbers, mean response tokens and how many hit the 256-token cap. Says how much of the
    format the prompt alone gives (and so how much is left for RL)."""
    import torch
    from rlanywhere.api import load_model
    from rlanywhere.data import extract_gsm8k_answer, gsm8k_messages, render_prompt, tokenize_rendered
    from rlanywhere.rewards import gsm8k_metrics
    from rlanywhere.rollout.base import SamplingParams

    with open(os.path.join(gsm8k_dir, "test.jsonl")) as handle:
        rows = [json.loads(line) for line in handle if line.strip()][:count]
    truths = [extract_gsm8k_answer(row["answer"]) for row in rows]
    cap = 256
    loaded = load_model(model or "smollm2-135m-instruct", max_new_tokens=cap, batch_size=len(rows),
                        overrides=[f"hardware.device={device}"] if device else [])
    tokenizer, results = loaded.tokenizer, []
    for one_shot in (False, True):
        ids = tokenize_rendered(tokenizer, [render_prompt(tokenizer, gsm8k_messages(r["question"], one_shot))
                                            for r in rows])
        started = time.time()
        with torch.no_grad():
            out = loaded.engine.generate(ids, SamplingParams(max_new_tokens=cap, temperature=0.0))
        responses = out.decode(tokenizer)
        lengths = out.response_mask.sum(-1).tolist()
        results.append({"prompt": "one-shot" if one_shot else "zero-shot", **gsm8k_metrics(responses, truths),
                        "prompt_tokens_mean": sum(map(len, ids)) / len(ids),
                        "response_tokens_mean": sum(lengths) / len(lengths),
                        "at_cap": sum(length >= cap for length in lengths), "seconds": time.time() - started,
                        "examples": [text[-300:] for text in responses[:2]]})
        print(json.dumps({k: v for k, v in results[-1].items() if k != "examples"}), flush=True)
    return results


def run_recipe(gsm8k_dir: str, work_dir: str, model: Optional[str], smoke: bool, overrides: list[str],
               one_shot: bool = True) -> dict:
    """Prepare the data, train the recipe in this process, and return the curve (docs/curves/ format)."""
    import torch
    from rlanywhere.cli import main as cli_main
    from rlanywhere.data import prepare_gsm8k
    from rlanywhere.tracking import read_metrics

    paths = prepare_gsm8k(gsm8k_dir, os.path.join(work_dir, "gsm8k_1shot" if one_shot else "gsm8k_0shot"),
                          one_shot=one_shot)
    run_dir = os.path.join(work_dir, "run")
    shutil.rmtree(run_dir, ignore_errors=True)  # one fresh run each time
    items = [RECIPE, f"data.train_files={paths['train']}", f"data.val_files={paths['test']}",
             f"custom_reward_function.path={REWARD_FILE}", f"trainer.default_local_dir={run_dir}",
             "trainer.resume_mode=disable"]
    if model:
        items.append(f"actor_rollout_ref.model.path={model}")
    if smoke:
        items += SMOKE_OVERRIDES
    items += overrides
    started = time.time()
    print("$ rlanywhere train " + " ".join(items), flush=True)
    code = cli_main(["train", *items])
    if code:
        raise SystemExit(f"rlanywhere train exited with {code}")
    points = curve_points(read_metrics(run_dir), rescore_validations(run_dir))
    if len(points) < 2:
        raise SystemExit(f"the run saved {len(points)} validation(s) under {run_dir}/val_generations; before and "
                         "after need two (trainer.val_before_train=true and trainer.test_freq > 0)")
    hardware = torch.cuda.get_device_name(0) if torch.cuda.is_available() and not smoke else "CPU"
    shots = "one-shot" if one_shot else "zero-shot"
    return {"label": f"rlanywhere grpo, gsm8k_format recipe ({shots})", "algorithm": "grpo",
            "task": f"GSM8K {shots} ({points[-1]['num_samples']} held-out, greedy; acc = strict)",
            "model": "tiny random (--smoke)" if smoke else "SmolLM2-135M-Instruct",
            "hardware": hardware, "steps": points[-1]["step"], "test_freq": points[1]["step"] - points[0]["step"],
            "process_minutes": (time.time() - started) / 60, "points": points}


def write_outputs(result: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as handle:
        json.dump(result, handle, indent=2)
    csv_path = os.path.splitext(out)[0] + ".csv"
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(result["points"][0]))
        writer.writeheader()
        writer.writerows(result["points"])
    print(f"wrote {out} and {csv_path}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="curve JSON (a .csv is written beside it)")
    parser.add_argument("--gsm8k-dir", default=None, help="directory with GSM8K train.jsonl and test.jsonl "
                                                          "(default: .gsm8k/ in the repo, else ../shared/data/gsm8k)")
    parser.add_argument("--work-dir", default=None, help="prepared data and the run (default: runs/gsm8k_recipe)")
    parser.add_argument("--model", default=None, help="actor_rollout_ref.model.path (default: the recipe's, the "
                                                      "demo GGUF; with --smoke a tiny random model)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny random model, 1 step, 4 held-out prompts")
    parser.add_argument("--zero-shot", action="store_true", help="the contrast run: verl's instruction alone, no "
                                                                 "worked example in the prompt")
    parser.add_argument("--probe", type=int, default=0, metavar="N",
                        help="no training: greedy format rate / strict / flexible of the untrained model on the "
                             "first N test prompts, zero-shot and one-shot (--out gets the JSON)")
    parser.add_argument("--device", default=None, help="--probe only: cpu or cuda (default: the planner's)")
    parser.add_argument("overrides", nargs="*", help="extra rlanywhere train overrides (after --)")
    args = parser.parse_args(argv)

    if args.probe:
        results = probe_prompts(find_gsm8k_dir(args.gsm8k_dir), args.probe, args.model, args.device)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)
        print(f"wrote {args.out}")
        return 0
    work_dir = os.path.abspath(args.work_dir or os.path.join(REPO, "runs", "gsm8k_recipe" + ("-smoke" if args.smoke else "")
                                            + ("-0shot" if args.zero_shot else "")))
    model = args.model
    if args.smoke and not model:
        import sides

        model = sides.materialize_model(os.path.join(work_dir, "model-tiny"), "tiny")
    result = run_recipe(find_gsm8k_dir(args.gsm8k_dir), work_dir, model, args.smoke, args.overrides,
                        one_shot=not args.zero_shot)
    write_outputs(result, args.out)
    print("\n".join(summary_lines(result["points"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
