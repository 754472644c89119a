"""fp16 vs bf16 vs fp32 on a real model: rollout/trainer log-prob agreement, fp16 headroom, and whole training runs.

gap   the real SmolLM2-135M-Instruct (the demo GGUF) on GSM8K prompts. For each precision the trainer's setup is
      rebuilt as a plan makes it (fp32 master weights; FastEngine in the rollout dtype with its fp32-output LM head;
      the trainer's log-probs under the plan's autocast), responses are sampled, and |rollout log-prob - trainer
      log-prob| over the response tokens is printed (mean, p99.9, max; non-finite count), as the trainer logs it
      each step (`actor/rollout_logprob_gap`). Also the largest |activation| of an fp32 forward (residual stream,
      matmul outputs) against fp16's largest value, 65504: how much headroom the model leaves fp16.

        python bench/mixed_precision.py gap --count 16 --new-tokens 64                # CPU: fp32, bf16, fp16
        python bench/mixed_precision.py gap --device cuda --count 64 --new-tokens 256

train runs `rlanywhere train` once per variant (label:override,override;...), the same overrides for all, and
      prints per variant: median step time (steps 2..), rollout / update time, the peak memory against the
      planner's estimate (plan.json), skipped fp16 steps, the final loss scale, the log-prob gap, non-finite
      metrics, and the held-out accuracy at every validation; then step-time ratios against the first variant.

        python bench/mixed_precision.py train --steps 60 \\
            --variants "t4-fp16:hardware.emulate=t4;t4-fp32:hardware.emulate=t4,hardware.precision=fp32;h200-bf16:" \\
            -- trainer.test_freq=10

      Every run starts from the demo's GPU profile (SmolLM2-135M GRPO on 2-digit addition, 64 prompts x 8
      samples, held-out accuracy on 200 prompts; `cli.demo_profile`), then the overrides; `--no-demo` drops it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

FP16_MAX = 65504.0


# ------------------------------------------------------------------------------------------------------- gap
def gsm8k_prompts(tokenizer, path: str, count: int) -> list[list[int]]:
    with open(path) as handle:
        questions = [json.loads(line)["question"] for _, line in zip(range(count), handle)]
    suffix = ' Let\'s think step by step and output the final answer after "####".'
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q + suffix}], add_generation_prompt=True,
                                           tokenize=False) for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def activation_headroom(model, prompts: list[list[int]], device: str) -> dict[str, float]:
    """Largest |value| of an fp32 forward: residual stream after each layer, and every Linear's output."""
    largest = {"residual stream": 0.0, "linear outputs": 0.0}
    where = {"residual stream": "", "linear outputs": ""}

    def track(kind: str, name: str):
        def hook(_module, _inputs, output):
            value = output[0] if isinstance(output, tuple) else output
            peak = float(value.detach().abs().max())
            if peak > largest[kind]:
                largest[kind], where[kind] = peak, name
        return hook

    handles = [layer.register_forward_hook(track("residual stream", f"layer {i}"))
               for i, layer in enumerate(model.model.layers)]
    handles += [m.register_forward_hook(track("linear outputs", n)) for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    with torch.no_grad():
        for prompt in prompts:
            model(input_ids=torch.tensor([prompt], device=device))
    for handle in handles:
        handle.remove()
    return {f"{k} ({where[k]})": v for k, v in largest.items()}


def gap_main(args) -> int:
    from transformers import AutoModelForCausalLM

    from rlanywhere import planner, plans, vocabulary
    from rlanywhere.logprobs import response_logprobs
    from rlanywhere.models import ModelSource, fetch_demo_model, load_tokenizer
    from rlanywhere.precision_guard import rollout_logprob_gap
    from rlanywhere.rollout.base import SamplingParams
    from rlanywhere.rollout.fast import FastEngine

    gguf = args.gguf or str(fetch_demo_model())
    source = ModelSource(os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf))
    tokenizer = load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=vocabulary.FP32, **source.load_kwargs())
    model = model.to(args.device).eval()
    prompts = gsm8k_prompts(tokenizer, args.prompts, args.count)
    torch.backends.cuda.matmul.allow_tf32 = False

    print(f"model {os.path.basename(gguf)}, {len(prompts)} GSM8K prompts x {args.n} samples, <= {args.new_tokens} "
          f"tokens, T={args.temperature}, device {args.device}, torch {torch.__version__}")
    for name, value in activation_headroom(model, prompts[:8], args.device).items():
        print(f"largest |activation| in fp32, {name}: {value:.1f} ({FP16_MAX / value:.0f}x below fp16's max)")

    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, n=args.n)
    print(f"\n{'precision':<10}{'tokens':>8}{'mean':>11}{'p99.9':>11}{'max':>11}{'non-finite':>12}{'seconds':>9}")
    for precision in args.precisions.split(","):
        compute = vocabulary.PRECISION_DTYPES[precision]
        plan = plans.Plan(device=args.device, precision=precision, compute_dtype=compute,
                          rollout=planner.plan_rollout_for(model, args.device, compute),
                          use_autocast=compute != vocabulary.FP32)
        start = time.time()
        engine = FastEngine(model, tokenizer, plan.rollout)
        batch = engine.generate(prompts, params, generator=torch.Generator(args.device).manual_seed(0))
        ids, mask, pos = batch.sequences()
        with torch.no_grad(), planner.autocast_context(plan):
            trainer = response_logprobs(model, ids, mask, batch.response_ids.shape[1], temperature=args.temperature,
                                        position_ids=pos)[0]
        seconds = time.time() - start
        real = batch.response_mask.bool()
        diff = (trainer - batch.response_logprobs)[real].abs().double()
        finite = diff[torch.isfinite(diff)]
        mean = float(rollout_logprob_gap(trainer, batch.response_logprobs, batch.response_mask))
        p999 = float(torch.quantile(finite, 0.999)) if finite.numel() else math.nan
        print(f"{precision:<10}{int(real.sum()):>8}{mean:>11.2e}{p999:>11.2e}{float(finite.max()):>11.2e}"
              f"{int(diff.numel() - finite.numel()):>12}{seconds:>9.1f}")
        del engine
    return 0


# ----------------------------------------------------------------------------------------------------- train
def run_train(label: str, overrides: list[str], steps: int, root: str) -> str:
    run_dir = os.path.join(root, label)
    command = [sys.executable, "-m", "rlanywhere.cli", "train", *overrides, f"trainer.total_training_steps={steps}",
               f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1", "trainer.logger=[console]"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "..", "src"),
                                                                      os.environ.get("PYTHONPATH")])))
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=env)
    return run_dir


def summarise(run_dir: str) -> dict:
    from rlanywhere.tracking import read_metrics

    records = read_metrics(run_dir)
    steps = [r for r in records if "perf/step_time_s" in r]
    plan = json.load(open(os.path.join(run_dir, "plan.json")))

    def median(key: str, rows=None) -> float:
        values = [r[key] for r in (rows if rows is not None else steps[1:]) if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else math.nan

    last = steps[-1] if steps else {}
    nonfinite = sum(1 for r in steps for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)
                    and not k.startswith("actor/grad_norm"))
    return {
        "precision": plan.get("precision"), "card": plan.get("card"),
        "step_s": median("perf/step_time_s"), "rollout_s": median("timing/rollout"),
        "update_s": median("timing/update_actor"),
        "peak_gib": max((r.get("perf/peak_memory_gib", 0.0) for r in steps), default=math.nan),
        "estimate_gib": (plan.get("estimate") or {}).get("peak_bytes", math.nan) / 2 ** 30,
        "budget_gib": (plan.get("memory_budget_bytes") or math.nan) / 2 ** 30,
        "skipped": last.get("actor/skipped_steps_total", 0.0), "loss_scale": last.get("actor/loss_scale"),
        "gap_median": median("actor/rollout_logprob_gap", steps),
        "gap_max": max((r.get("actor/rollout_logprob_gap", math.nan) for r in steps), default=math.nan),
        "nonfinite_metrics": nonfinite,
        "val_acc": [(r["step"], round(r["val/acc"], 3)) for r in records if "val/acc" in r],
    }


def demo_overrides() -> list[str]:
    """The GPU demo profile as dotted overrides (its arithmetic data written first if missing)."""
    from rlanywhere.cli import DEMO_DATA_DIR, demo_profile
    from rlanywhere.data import prepare_arithmetic

    if not os.path.exists(f"{DEMO_DATA_DIR}/train.parquet"):
        prepare_arithmetic(DEMO_DATA_DIR, train_size=2000, test_size=200, digits=2, operators="+", seed=0)

    def flat(prefix: str, value) -> list[str]:
        if isinstance(value, dict):
            return [item for key, sub in value.items() for item in flat(f"{prefix}{key}.", sub)]
        text = f"[{','.join(map(str, value))}]" if isinstance(value, list) else str(value)
        return [f"{prefix[:-1]}={text}"]

    return flat("", demo_profile(on_gpu=True))


def train_main(args) -> int:
    base = ([] if args.no_demo else demo_overrides()) + list(args.overrides)
    variants = []
    for part in filter(None, (p.strip() for p in args.variants.split(";"))):
        label, _, extra = part.partition(":")
        variants.append((label.strip(), [o for o in extra.split(",") if o.strip()]))
    results = {}
    with tempfile.TemporaryDirectory(prefix="mixed_precision_") as root:
        for label, extra in variants:
            results[label] = summarise(run_train(label, [*base, *extra], args.steps, root))
    print(f"\nmedians over steps 2..{args.steps}")
    for label, res in results.items():
        print(f"{label}: {json.dumps(res)}")
    first = variants[0][0]
    for label in results:
        if label != first and results[label]["step_s"]:
            print(f"step time {label} / {first}: {results[label]['step_s'] / results[first]['step_s']:.2f}x")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    gap = sub.add_parser("gap")
    gap.add_argument("--gguf", default=None, help="default: the demo's SmolLM2-135M-Instruct GGUF")
    gap.add_argument("--prompts", default=os.path.join(HERE, "..", "..", "shared", "data", "gsm8k", "test.jsonl"))
    gap.add_argument("--count", type=int, default=16)
    gap.add_argument("--n", type=int, default=2)
    gap.add_argument("--new-tokens", type=int, default=64)
    gap.add_argument("--temperature", type=float, default=1.0)
    gap.add_argument("--precisions", default="fp32,bf16,fp16")
    gap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    train = sub.add_parser("train")
    train.add_argument("--steps", type=int, default=20)
    train.add_argument("--variants", required=True, help="label:override,override;label:...")
    train.add_argument("--no-demo", action="store_true", help="do not start from the demo's GPU profile")
    train.add_argument("overrides", nargs="*", help="rlanywhere train overrides for every variant (after --)")
    args = parser.parse_args()
    return gap_main(args) if args.mode == "gap" else train_main(args)


if __name__ == "__main__":
    sys.exit(main())
