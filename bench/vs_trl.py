"""rlanywhere against TRL's GRPOTrainer on the same work: samples/s, phase times, peak memory, and the ratio.

Both frameworks load the same model directory (written once by `sides.materialize_model`), train on the same
prompts with the same group size, lengths, learning rate and precision, each in its own subprocess of this one.
Default work (issue 15): a Qwen2.5-0.5B-shaped body (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
4864) with the SmolLM2 tokenizer's 49,152-token vocabulary and random weights, 16 prompts x 8 samples, 256 new
tokens (random weights practically never emit EOS: the mean response length is printed for both), lr 1e-6, no KL,
temperature 1, bf16 autocast over fp32 master weights, TRL with gradient checkpointing (its default).

    # one H200: TRL, rlanywhere with checkpointing forced on like TRL, rlanywhere as its planner decides
    python bench/vs_trl.py --out vs_trl_bf16.json
    # the P40 path: TRL in fp32 with TF32 off against rlanywhere --emulate p40 (fp32, TF32 off, 22.4 GiB cap)
    python bench/vs_trl.py --p40-path --out vs_trl_p40.json
    # PPO with the critic at verl's single-GPU recipe size (256 prompts, response 512), rlanywhere only
    python bench/vs_trl.py --runs ppo --steps 3 --out ppo_verl_size.json
    # real SmolLM2-135M-Instruct weights on GSM8K questions instead of the random body
    python bench/vs_trl.py --model smollm2-135m --gsm8k ../shared/data/gsm8k
    # develop on a CPU in about a minute: tiny random model, 4 prompts x 4 samples, 16 new tokens
    python bench/vs_trl.py --tiny

TRL gets its fastest configuration: `--trl-micro-batch 16,32,64,128` runs TRL once per micro-batch (its
per_device_train_batch_size, which is also its generation batch: TRL generates what one micro-batch trains) and the
fastest of them is TRL's figure, the others printed beside it. rlanywhere's training phases are also given as
model-FLOPs utilisation (MFU, flops.py: the model's own matrix products over the card's dense peak at the run's
precision; the P40 path against the host card's plain-fp32 peak).

Timing: each run does --steps optimizer steps; the first --warmup steps (CUDA graph capture, allocator and
autotuning warm-up) are dropped, the rest give the median step time and phases, and the highest peak memory
(torch.cuda.max_memory_allocated, reset at every step in both frameworks; the process RSS high-water mark on a
CPU). TRL's "generate" phase is its whole `_generate_and_score_completions` (generation, reward, advantages);
its "update" is the rest of the optimizer step. TRL absent: one line says so and rlanywhere runs alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import sides  # noqa: E402

RUNS = {
    "trl": "TRL GRPOTrainer (no vLLM), gradient checkpointing on, fp32 master weights as ours",
    "trl-bf16w": "TRL GRPOTrainer as above with the model loaded in bf16 (no fp32 master weights; bf16 only)",
    "ours-ckpt": "rlanywhere, gradient checkpointing forced on like TRL",
    "ours-plan": "rlanywhere, the planner's choice",
    "ppo": "rlanywhere PPO + critic (GAE), verl's single-GPU recipe size",
}
# (metric in rlanywhere's metrics.jsonl, the same metric in the TRL side's records). The phase columns split the
# step differently on each side: ours "generate s" is the rollout alone and "update s" the actor's update; TRL's are
# generation with scoring and advantages, and the rest of the step. s/step and samples/s compare the same work.
COLUMNS = {
    "s/step": ("perf/step_time_s", "perf/step_time_s"),
    "generate s": ("timing/rollout", "timing/generate_and_score"),
    "update s": ("timing/update_actor", "timing/update"),
    "critic s": ("timing/update_critic", None),
    "resp len": ("response_length/mean", "response_length/mean"),
}


# what the first step spent getting ready (rlanywhere only; TRL's records have no such keys)
FIRST_STEP_COLUMNS = {"1st compile s": "perf/compile_s", "1st capture s": "perf/graph_capture_s"}


def steady_summary(records: list[dict], columns: dict[str, str | None], warmup: int) -> dict:
    """Median of each column over the steps after `warmup`, and the highest peak memory over those steps."""
    steady = [r for r in records if "perf/step_time_s" in r][warmup:]
    if not steady:
        raise SystemExit(f"no steady steps to summarise ({len(records)} records, warm-up {warmup}): raise --steps")
    summary = {"steps_timed": len(steady),
               # the first step: compiling, CUDA graph capture, autotuning (what a short run pays on top)
               "1st step s": next((r["perf/step_time_s"] for r in records if "perf/step_time_s" in r), None)}
    # of which torch.compile and CUDA-graph capture (rlanywhere's perf/compile_s and perf/graph_capture_s)
    first = next((r for r in records if "perf/step_time_s" in r), {})
    for name, key in FIRST_STEP_COLUMNS.items():
        if key in first:
            summary[name] = first[key]
    for name, key in columns.items():
        values = [r[key] for r in steady if key and isinstance(r.get(key), (int, float))]
        summary[name] = statistics.median(values) if values else None
    peaks = [r["perf/peak_memory_gib"] for r in steady if "perf/peak_memory_gib" in r]
    summary["peak GiB"] = max(peaks) if peaks else None
    return summary


def planned_peak_gib(plan: dict) -> float | None:
    """The plan's predicted peak (its memory estimate over every phase, full-length rows), in GiB."""
    peak = (plan.get("estimate") or {}).get("peak_bytes")
    return peak / 2**30 if peak else None


def with_throughput(summary: dict, samples_per_step: int, reference_samples_per_s: float | None) -> dict:
    """Add samples/s (sequences trained per second) and the ratio to the reference run's samples/s."""
    out = dict(summary)
    out["samples/s"] = samples_per_step / summary["s/step"] if summary.get("s/step") else None
    out["x TRL"] = (out["samples/s"] / reference_samples_per_s
                    if out["samples/s"] and reference_samples_per_s else None)
    return out


def format_table(rows: list[tuple[str, dict]]) -> str:
    names = ["s/step", "samples/s", "x TRL", "generate s", "update s", "critic s", "peak GiB", "resp len", "1st step s",
             *FIRST_STEP_COLUMNS]
    width = max(len(label) for label, _ in rows) + 2
    lines = [f"{'run':<{width}}" + "".join(f"{n:>14}" if n in FIRST_STEP_COLUMNS else f"{n:>11}" for n in names)]
    for label, summary in rows:
        cells = [summary.get(n) for n in names]
        widths = [14 if n in FIRST_STEP_COLUMNS else 11 for n in names]
        lines.append(f"{label:<{width}}" + "".join(f"{c:>{w}.3f}" if isinstance(c, (int, float)) else f"{'-':>{w}}"
                                                   for c, w in zip(cells, widths)))
    return "\n".join(lines)


def work_from_args(args) -> dict:
    if args.tiny:
        return dict(shape="tiny", prompts=4, n=4, new_tokens=16, max_prompt_length=256, trl_micro_batches=[8])
    sizes = sorted({int(v) for v in str(args.trl_micro_batch).split(",") if v.strip()})
    samples = args.prompts * args.n
    usable = [v for v in sizes if v <= samples and samples % v == 0]
    if not usable:
        raise SystemExit(f"--trl-micro-batch {args.trl_micro_batch}: none divides {samples} samples a step")
    return dict(shape=args.model, prompts=args.prompts, n=args.n, new_tokens=args.new_tokens,
                max_prompt_length=args.max_prompt_length, trl_micro_batches=usable)


def trl_runs(runs: list[str], micro_batches: list[int]) -> list[str]:
    """Each TRL run once per micro-batch ('trl@32'); one micro-batch keeps the plain name."""
    out = []
    for run in runs:
        if run.startswith("trl") and len(micro_batches) > 1:
            out += [f"{run}@{m}" for m in micro_batches]
        else:
            out.append(run)
    return out


def fastest_trl(results: dict[str, dict], base: str) -> tuple[str, dict] | None:
    """The fastest of a TRL run's micro-batch sweep (`base@M` or `base`), by median s/step."""
    swept = {name: r for name, r in results.items() if name == base or name.startswith(base + "@")}
    if not swept:
        return None
    name = min(swept, key=lambda n: swept[n]["s/step"])
    return name, swept[name]


def update_mfus(records: list[dict], warmup: int, shape, *, rows: int, groups: int | None,
                ppo_epochs: int, peak: float | None) -> dict:
    """Median MFU of each training phase over the steady steps (flops.phase_mfus)."""
    from rlanywhere.flops import phase_mfus

    steady = [r for r in records if "perf/step_time_s" in r][warmup:]
    per_step = [phase_mfus(r, shape, rows=rows, groups=groups, ppo_epochs=ppo_epochs, peak=peak) for r in steady]
    keys = sorted({k for step in per_step for k in step})
    return {k: statistics.median(step[k] for step in per_step if k in step) for k in keys}


def precision_overrides(args, on_gpu: bool) -> list[str]:
    """The side's precision; in bf16, compiled training passes as a long run has them (the bench's few steps would
    otherwise run eager: planner.compile_min_steps)."""
    if not on_gpu:
        return ["hardware.device=cpu"]
    return ["hardware.emulate=p40"] if args.p40_path else ["hardware.precision=bf16", "hardware.compile_training=true"]


def grpo_overrides(work: dict, model_dir: str, parquet: str, lr: float, steps: int) -> list[str]:
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={parquet}", f"data.val_files={parquet}",
            f"data.train_batch_size={work['prompts']}", f"data.max_prompt_length={work['max_prompt_length']}",
            f"data.max_response_length={work['new_tokens']}", f"actor_rollout_ref.rollout.n={work['n']}",
            "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.rollout.top_p=1.0",
            f"actor_rollout_ref.actor.optim.lr={lr}", "actor_rollout_ref.actor.use_kl_loss=false",
            "algorithm.use_kl_in_reward=false", f"actor_rollout_ref.actor.ppo_mini_batch_size={work['prompts']}",
            "algorithm.adv_estimator=grpo", f"trainer.total_training_steps={steps}"]


# verl's single-GPU PPO quick-start recipe (GSM8K, Qwen2.5-0.5B): 256 prompts, one response each of up to 512
# tokens, mini-batch 64 (--tiny: a CPU-sized version of it).
PPO_SIZES = {"full": dict(prompts=256, response=512, mini=64), "tiny": dict(prompts=8, response=16, mini=4)}


def ppo_overrides(model_dir: str, parquet: str, steps: int, sizes: dict) -> list[str]:
    """PPO with the critic: actor lr 1e-6, critic lr 1e-5 as verl's recipe, no KL term (verl's default
    use_kl_in_reward=false, use_kl_loss=false); micro-batches are the planner's."""
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={parquet}", f"data.val_files={parquet}",
            f"data.train_batch_size={sizes['prompts']}", "data.max_prompt_length=512",
            f"data.max_response_length={sizes['response']}", "actor_rollout_ref.rollout.n=1",
            "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.actor.optim.lr=1e-6",
            "critic.optim.lr=1e-5", f"actor_rollout_ref.actor.ppo_mini_batch_size={sizes['mini']}",
            "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=false",
            "actor_rollout_ref.actor.use_kl_loss=false", f"trainer.total_training_steps={steps}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="trl,ours-ckpt,ours-plan", help=f"comma list of {sorted(RUNS)}")
    parser.add_argument("--p40-path", action="store_true",
                        help="fp32 with TF32 off: TRL without bf16, rlanywhere with --emulate p40")
    parser.add_argument("--model", default="qwen2.5-0.5b",
                        help=f"random-weight shape {sorted(sides.SHAPES)} or {sides.REAL_SMOLLM2} (real weights)")
    parser.add_argument("--gsm8k", default=None, help="GSM8K jsonl directory for the prompts (default: "
                        "../shared/data/gsm8k or tests/data/gsm8k when present, else 2-digit additions)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (group size)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-prompt-length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the medians")
    parser.add_argument("--trl-micro-batch", default="16,32,64,128",
                        help="TRL per_device_train_batch_size (completions per forward/backward and per generation "
                             "call), comma list: TRL runs once per value and the fastest is its figure; gradient "
                             "accumulation makes up the rest of prompts x n")
    parser.add_argument("--tiny", action="store_true", help="tiny random model and sizes, for a CPU")
    parser.add_argument("--work-dir", default=None, help="where the model and prompts are written (kept; "
                        "default: a temporary directory)")
    parser.add_argument("--out", default=None, help="write the summaries as JSON here")
    parser.add_argument("--ours", action="append", default=[], metavar="NAME:KEY=VALUE[;KEY=VALUE...]",
                        help="an extra rlanywhere run `ours-NAME`: the planner's run with these overrides on top "
                             "(repeatable; e.g. --ours 'prof:trainer.profile_steps=[3]')")
    args = parser.parse_args()
    variants = {}
    for spec in args.ours:
        name, _, keys = spec.partition(":")
        if not name or "=" not in keys:
            raise SystemExit(f"--ours {spec!r}: expected NAME:KEY=VALUE[;KEY=VALUE...]")
        variants[f"ours-{name}"] = [k.strip() for k in keys.split(";") if k.strip()]
        RUNS[f"ours-{name}"] = f"rlanywhere, the planner's choice + {'; '.join(variants[f'ours-{name}'])}"
    runs = [r.strip() for r in args.runs.split(",") if r.strip()] + list(variants)
    unknown = [r for r in runs if r.split("@")[0] not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {sorted(RUNS)}")
    if args.steps <= args.warmup:
        raise SystemExit(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if any(r.startswith("trl") for r in runs) and not sides.trl_available():
        print(sides.TRL_MISSING, flush=True)
        runs = [r for r in runs if not r.startswith("trl")]
    if args.p40_path and "trl-bf16w" in runs:
        raise SystemExit("--runs trl-bf16w is a bf16 run; the P40 path is fp32")

    import torch

    on_gpu = torch.cuda.is_available() and not args.tiny
    work = work_from_args(args)
    runs = trl_runs(runs, work["trl_micro_batches"])
    precision = "fp32" if args.p40_path or not on_gpu else "bf16"
    from rlanywhere.flops import peak_flops

    # the P40 path is measured against the host card's own plain-fp32 peak (TF32 off)
    peak = peak_flops(torch.cuda.get_device_name(), precision) if on_gpu else None
    ppo_sizes = PPO_SIZES["tiny" if args.tiny else "full"]
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        root = args.work_dir or tmp
        model_dir = sides.materialize_model(os.path.join(root, f"model-{work['shape']}"), work["shape"])
        gsm8k = args.gsm8k or sides.default_gsm8k_dir()
        parquet, what = sides.prepare_prompts(root, work["prompts"], gsm8k)
        print(f"prompts: {what}; model: {work['shape']} in {model_dir}; precision: {precision}"
              f"{' (TF32 off, rlanywhere --emulate p40)' if args.p40_path else ''}", flush=True)
        samples = work["prompts"] * work["n"]
        base = grpo_overrides(work, model_dir, parquet, args.lr, args.steps) + precision_overrides(args, on_gpu)
        results: dict[str, dict] = {}
        for run in runs:
            run_dir = os.path.join(root, "runs", run)
            if run.startswith("trl"):
                spec = dict(model_dir=model_dir, train_parquet=parquet, out=os.path.join(root, f"{run}_steps.jsonl"),
                            steps=args.steps, prompts_per_step=work["prompts"], n=work["n"],
                            max_new_tokens=work["new_tokens"], lr=args.lr, temperature=1.0, precision=precision,
                            tf32=not args.p40_path, gradient_checkpointing=True,
                            micro_batch=int(run.split("@")[1]) if "@" in run else work["trl_micro_batches"][0],
                            cpu=not on_gpu, seed=1, weights_dtype="bf16" if run.startswith("trl-bf16w") else "fp32")
                records = sides.start_trl(spec, os.path.join(root, f"{run}_spec.json"))
                columns = {name: trl_key for name, (_, trl_key) in COLUMNS.items()}
            else:
                if run == "ppo":
                    ppo_parquet, _ = sides.prepare_prompts(root, ppo_sizes["prompts"], gsm8k)
                    overrides = (ppo_overrides(model_dir, ppo_parquet, args.steps, ppo_sizes)
                                 + precision_overrides(args, on_gpu))
                elif run == "ours-ckpt":
                    overrides = base + ["actor_rollout_ref.model.enable_gradient_checkpointing=true"]
                elif run in variants:
                    overrides = base + variants[run]
                else:
                    overrides = base
                records = sides.run_rlanywhere(run_dir, overrides)
                columns = {name: ours_key for name, (ours_key, _) in COLUMNS.items()}
            results[run] = steady_summary(records, columns, args.warmup)
            if not run.startswith("trl"):
                with open(os.path.join(run_dir, "plan.json")) as handle:
                    plan = json.load(handle)
                sizes = plan.get("sizes", {})
                from rlanywhere.model_shape import read_model_shape

                ppo_run = run == "ppo"
                results[run]["mfu"] = update_mfus(
                    records, args.warmup, read_model_shape(model_dir),
                    rows=ppo_sizes["prompts"] if ppo_run else samples,
                    groups=None if ppo_run or not plan.get("share_prompts") else work["prompts"],
                    ppo_epochs=1, peak=peak)
                results[run]["plan"] = {
                    "precision": plan.get("precision"), "gradient_checkpointing": plan.get("gradient_checkpointing"),
                    "actor_micro_batch_size": sizes.get("actor_micro_batch_size"),
                    "max_token_len_per_micro_batch": sizes.get("max_token_len_per_micro_batch"),
                    "attn_implementation": plan.get("attn_implementation"),
                    "share_prompts": plan.get("share_prompts"),
                    "rollout_engine": plan.get("rollout", {}).get("engine"),
                    "kv_cache_freed_each_step": plan.get("rollout", {}).get("release_kv_between_phases")}
                results[run]["planned peak GiB"] = planned_peak_gib(plan)

    reference = None
    best = fastest_trl(results, "trl")
    if best:
        reference = samples / best[1]["s/step"]
        print(f"TRL's figure: {best[0]} (the fastest of its micro-batch sweep)")
    rows = []
    for run, summary in results.items():
        per_step = ppo_sizes["prompts"] if run == "ppo" else samples
        results[run] = with_throughput(summary, per_step, reference if run != "ppo" else None)
        rows.append((run, results[run]))
    print(f"\n{samples} samples/step ({work['prompts']} prompts x {work['n']}), {work['new_tokens']} new tokens, "
          f"{precision}; medians over steps {args.warmup + 1}..{args.steps}")
    print(format_table(rows))
    for run in results:
        print(f"  {run}: {RUNS[run.split('@')[0]]}"
              + (f" (micro-batch {run.split('@')[1]})" if "@" in run else "")
              + (f"; plan {results[run]['plan']}" if "plan" in results[run] else ""))
        if results[run].get("planned peak GiB"):
            print(f"    memory: planned peak {results[run]['planned peak GiB']:.2f} GiB (the estimate, full-length "
                  f"rows), measured peak {results[run]['peak GiB']:.2f} GiB")
        if results[run].get("mfu"):
            print("    MFU " + ", ".join(f"{k.split('/', 1)[1]} {v:.1%}" for k, v in results[run]["mfu"].items())
                  + f" (of {precision} peak)")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"work": work, "precision": precision, "p40_path": args.p40_path, "steps": args.steps,
                       "warmup": args.warmup, "runs": results}, handle, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
