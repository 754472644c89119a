"""Several GPUs, in one command: scaling 1 -> N GPUs, a model that only fits sharded, and two "nodes" on one host.

Parts (`--parts`, default all three; each prints ONE line of figures, prefixed `RESULT`):

* `scaling`: for every config of `--configs`, the same `rlanywhere train` command as 1 process and as N ranks under
  torchrun (fresh run dirs, same global batch): median seconds per step after `--warmup` steps, samples/s
  (train_batch_size x n / step time), the N/1 ratio (goal >= 1.8 at N = 2), peak memory per rank, and val/acc of
  both runs per validation step (the demo validates every 10 steps). `NAME-shard` is config NAME with
  hardware.data_parallel=shard forced on the N-rank run: the cost of sharding a model that fits replicated.
* `shard`: Qwen2.5-1.5B-shape full fine-tuning GRPO (16 prompts x 8, 256 + 512 tokens, optimizer offload off)
  under `--emulate p40`: `rlanywhere plan` must refuse it on one P40 and plan "shard" on N; then it trains
  `--shard-steps` steps on N emulated P40s (each rank's GPU capped to 24 GB), printing the measured peak per rank
  (max over ranks of torch.cuda.max_memory_allocated) against the plan's estimate.
* `nodes`: two torchrun launches with one c10d rendezvous (`--nnodes=2 --nproc_per_node=1`), each seeing one GPU
  (CUDA_VISIBLE_DEVICES), run `--nodes-steps` steps of grpo-0.5b: the multi-node path on one host.
* `placements` (not in the default parts): for every config of `--configs`, the N ranks placed each way a
  one_step_off job can place them, `--steps` steps each: synchronous data parallelism, every rank training and
  generating its share (trainer.async.rollout_ranks=0), and each split of T trainer + R rollout ranks (T a multiple
  of R); median seconds per step and samples/s, and the fastest. How many ranks to give the rollout is measured
  here, not predicted from one run's phase times (docs/async.md says why).

    # the two-H200 host (NCCL_NVLS_ENABLE=0); demo model offline: RLANYWHERE_DEMO_GGUF=/path/to/smollm2.gguf
    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python bench/distributed_scaling.py --out scaling.json
    # CPU smoke test of the script itself (tiny shapes, gloo; the 1.5B part is planned only)
    PYTHONPATH=src python bench/distributed_scaling.py --cpu --configs tiny-grpo --steps 3 --warmup 1
    # how to place a one_step_off job on 2 (or --nproc) GPUs: measured, each placement in turn
    NCCL_NVLS_ENABLE=0 PYTHONPATH=src python bench/distributed_scaling.py --parts placements --configs demo --steps 12 \
        -- algorithm.rollout_correction.bypass_mode=true

Configs: `demo` is `rlanywhere train`'s GPU demo profile (SmolLM2-135M, GRPO on 2-digit addition, 64 prompts x 8,
validation every 10 steps; set RLANYWHERE_DEMO_GGUF to a local .gguf when offline); the others reuse the random
model shapes and exact-length prompts of bench/train_memory.py. Extra `rlanywhere train` overrides follow `--`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from rlanywhere.tracking import read_metrics  # noqa: E402


# the 1.5B model that fits two P40s only sharded (docs/distributed.md); optimizer offload off: with it one P40
# would hold the model by streaming 11.5 GB of Adam state over PCIe every step
SHARD_CONFIG = ("qwen2.5-1.5b", 16, 8, 256, 512, {
    "algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.ppo_mini_batch_size": 16,
    "hardware.optimizer_offload": False})
TINY_SHARD_CONFIG = ("tiny", 4, 2, 32, 16, {"algorithm.adv_estimator": "grpo", "hardware.data_parallel": "shard"})
SHARD_SUFFIX = "-shard"  # CONFIG-shard: CONFIG with hardware.data_parallel=shard forced on the N-rank run


def shaped_overrides(spec: tuple, root: str, steps: int) -> list[str]:
    from train_memory import build_data, build_model_dir

    shape, prompts, n, plen, rlen, extra = spec
    data = build_data(root, prompts, plen)
    items = {"actor_rollout_ref.model.path": build_model_dir(shape, root),
             "data.train_files": f"{data}/train.parquet", "data.val_files": "null", "data.train_batch_size": prompts,
             "data.max_prompt_length": plen, "data.max_response_length": rlen, "actor_rollout_ref.rollout.n": n,
             "trainer.total_training_steps": steps, "trainer.test_freq": 0, "trainer.save_freq": 0,
             "trainer.val_before_train": False, "data.filter_overlong_prompts": False, **extra}
    return [f"{k}={v}" for k, v in items.items()]


def config_overrides(name: str, root: str, steps: int) -> tuple[list[str], list[str]]:
    """(`rlanywhere train` arguments, a YAML file first when needed; extra arguments of the N-rank run only)."""
    if name.endswith(SHARD_SUFFIX):
        return config_overrides(name[: -len(SHARD_SUFFIX)], root, steps)[0], ["hardware.data_parallel=shard"]
    if name == "demo":
        from omegaconf import OmegaConf

        from rlanywhere.cli import demo_profile

        path = os.path.join(root, "demo.yaml")
        OmegaConf.save(OmegaConf.create(demo_profile(on_gpu=True)), path)
        if not os.path.exists("data/arith/train.parquet"):
            from rlanywhere.data import prepare_arithmetic

            prepare_arithmetic("data/arith", train_size=2000, test_size=200, digits=2, operators="+", seed=0)
        return [path, f"trainer.total_training_steps={steps}", "trainer.save_freq=0"], []
    from train_memory import CONFIGS

    return shaped_overrides(CONFIGS[name], root, steps), []


def python_env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(HERE, "..", "src"),
                                                                     os.environ.get("PYTHONPATH")])))


def run(args_list: list[str], nproc: int, run_dir: str) -> list[dict]:
    launcher = ([sys.executable, "-m", "rlanywhere.cli"] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                 "-m", "rlanywhere.cli"])
    command = [*launcher, "train", *args_list, f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]"]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=python_env())
    return read_metrics(run_dir)


def summarize(records: list[dict], rows_per_step: int, warmup: int) -> dict:
    train = [r for r in records if "perf/step_time_s" in r]
    timed = [r["perf/step_time_s"] for r in train[warmup:]] or [r["perf/step_time_s"] for r in train]
    step_time = statistics.median(timed)
    # median seconds per phase (rank 0's timer): which phases shrink with more ranks and which do not
    later = train[warmup:] or train
    phases = sorted({k for r in later for k in r if k.startswith("timing/")})  # one_step_off: "rollout" at step 1 only
    phase_s = {k[len("timing/"):]: statistics.median([r[k] for r in later if k in r]) for k in phases}
    # the medians hide steps that compiled (perf/compiles > 0): the whole run's time after step 1 shows them
    after_first = [r["perf/step_time_s"] for r in train[1:]]
    compiling = [(r["step"], round(r["perf/step_time_s"], 2), r["perf/compiles"]) for r in train[1:]
                 if r.get("perf/compiles")]
    return {"steps": len(train), "step_time_s": step_time, "samples_per_s": rows_per_step / step_time,
            "run_samples_per_s": rows_per_step * len(after_first) / sum(after_first) if after_first else None,
            "compile_steps": compiling, "phase_s": phase_s,
            "peak_memory_gib_per_rank": max((r.get("perf/peak_memory_gib", 0.0) for r in train), default=None),
            "val_acc": {r["step"]: r["val/acc"] for r in records if "val/acc" in r}}


def rows_per_step(args_list: list[str]) -> int:
    from rlanywhere.config import load_config

    path = args_list[0] if args_list[0].endswith(".yaml") else None
    cfg = load_config(path, args_list[1:] if path else args_list)
    return int(cfg.data.train_batch_size) * int(cfg.actor_rollout_ref.rollout.n)


def part_scaling(args, root: str, extra: list[str]) -> dict:
    results, one_rank = {}, {}
    for name in args.configs.split(","):
        start = time.time()
        base, many_only = config_overrides(name, root, args.steps)
        base = base + extra
        rows = rows_per_step(base)
        key = " ".join(base)  # NAME-shard reuses NAME's 1-rank run: the same command
        if key not in one_rank:
            one_rank[key] = summarize(run(base, 1, os.path.join(root, f"{name}_1")), rows, args.warmup)
        one = one_rank[key]
        many = summarize(run(base + many_only, args.nproc, os.path.join(root, f"{name}_{args.nproc}")), rows,
                         args.warmup)
        mode = json.load(open(os.path.join(root, f"{name}_{args.nproc}", "plan.json")))["data_parallel"]
        results[name] = {"1": one, str(args.nproc): many, "data_parallel": mode,
                         "speedup": many["samples_per_s"] / one["samples_per_s"]}
        last = max(set(one["val_acc"]) & set(many["val_acc"]), default=None)
        val = (f"; val/acc at step {last}: {one['val_acc'][last]:.3f} vs {many['val_acc'][last]:.3f}"
               if last is not None else "")
        print(f"RESULT scaling {name}: 1 rank {one['samples_per_s']:.1f} samples/s ({one['step_time_s']:.2f} s/step), "
              f"{args.nproc} ranks ({mode}) {many['samples_per_s']:.1f} samples/s ({many['step_time_s']:.2f} s/step): "
              f"x{results[name]['speedup']:.2f}; peak/rank {one['peak_memory_gib_per_rank']:.2f} vs "
              f"{many['peak_memory_gib_per_rank']:.2f} GiB{val}", flush=True)
        print(f"  whole run after step 1: 1 rank {one['run_samples_per_s'] or float('nan'):.1f} samples/s, "
              f"{args.nproc} ranks {many['run_samples_per_s'] or float('nan'):.1f}; steps that compiled (step, s, "
              f"graphs): 1 rank {one['compile_steps']}, {args.nproc} ranks {many['compile_steps']}")
        for phase in sorted(set(one["phase_s"]) | set(many["phase_s"])):
            print(f"  {phase}: 1 rank {one['phase_s'].get(phase, float('nan')):.3f} s  {args.nproc} ranks "
                  f"{many['phase_s'].get(phase, float('nan')):.3f} s")
        for step in sorted(set(one["val_acc"]) | set(many["val_acc"])):
            print(f"  val/acc step {step}: 1 rank {one['val_acc'].get(step)}  {args.nproc} ranks "
                  f"{many['val_acc'].get(step)}")
        print(f"[scaling {name}: {time.time() - start:.0f} s]", flush=True)
    return results


def placements(nproc: int) -> list[tuple[str, list[str]]]:
    """(name, overrides) of each way to place a job on `nproc` ranks: sync, one_step_off on trainer ranks, and
    one_step_off split into T trainer + R rollout ranks (T a multiple of R, as split_rollout.SplitLayout needs)."""
    one_step_off = "trainer.async.mode=one_step_off"
    out = [("sync", []), ("one_step_off", [one_step_off, "trainer.async.rollout_ranks=0"])]
    for rollout in range(1, nproc):
        if (nproc - rollout) % rollout == 0:
            out.append((f"split {nproc - rollout}+{rollout}", [one_step_off, f"trainer.async.rollout_ranks={rollout}"]))
    return out


def part_placements(args, root: str, extra: list[str]) -> dict:
    results = {}
    for name in args.configs.split(","):
        base = config_overrides(name, root, args.steps)[0] + extra
        rows = rows_per_step(base)
        runs = {}
        for label, keys in placements(args.nproc):
            run_dir = os.path.join(root, f"{name}_{label.replace(' ', '_').replace('+', 'p')}")
            runs[label] = summarize(run(base + keys, args.nproc, run_dir), rows, args.warmup)
        fastest = min(runs, key=lambda label: runs[label]["step_time_s"])
        print(f"RESULT placements {name} on {args.nproc} ranks: " + "; ".join(
            f"{label} {r['step_time_s']:.2f} s/step ({r['samples_per_s']:.1f} samples/s)" for label, r in runs.items())
            + f"; fastest: {fastest}", flush=True)
        results[name] = {"runs": runs, "fastest": fastest}
    return results


def plan_command(args_list: list[str], nproc: int, emulate: str) -> tuple[int, str]:
    command = [sys.executable, "-m", "rlanywhere.cli", "plan", *args_list, f"trainer.n_gpus_per_node={nproc}"]
    if emulate != "none":
        command += ["--emulate", emulate]
    print("$", " ".join(command), flush=True)
    proc = subprocess.run(command, env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc.returncode, proc.stdout


def part_shard(args, root: str, extra: list[str]) -> dict:
    """Refused on one emulated card, planned sharded on N, then N sharded ranks train: measured vs estimated."""
    big = shaped_overrides(SHARD_CONFIG, root, args.shard_steps) if not args.cpu else None
    # the plan of the 1.5B shape needs no weights: named shape, planning only (runs on a CPU box too)
    named = ["actor_rollout_ref.model.path=qwen2.5-1.5b"] + [
        a for a in shaped_overrides(TINY_SHARD_CONFIG[:1] + SHARD_CONFIG[1:], root, 1)
        if not a.startswith("actor_rollout_ref.model.path=")]
    rc_one, out_one = plan_command(named, 1, "p40")
    rc_many, out_many = plan_command(named, args.nproc, "p40")
    refused = "no plan" in out_one
    planned = re.search(r"ranks\s*\|\s*(\d+) x (\w+)", out_many)
    estimate_one = re.search(r"the peak is ([\d.]+ GiB)", out_one)
    result = {"refused_on_one": refused, "plan_on_n": planned.group(2) if planned else None,
              "one_card_needs": estimate_one.group(1) if estimate_one else None}
    print(out_many[-3000:])
    if args.cpu:  # a plan for N cards on a box without them is one CPU process's: the sharded run alone is the smoke
        print("shard: the plan of N emulated P40s needs N GPUs (here: one CPU process's plan); the tiny sharded run "
              "follows", flush=True)
    elif not refused or not planned or planned.group(2) != "shard":
        print(f"RESULT shard: UNEXPECTED plan: refused on 1 P40={refused}, on {args.nproc}: "
              f"{planned.group(0) if planned else 'no plan'}", flush=True)
        return result
    # the run: the 1.5B on N emulated P40s (on a CPU box: the tiny shape, sharding forced)
    run_args = (big + ["hardware.emulate=p40"]) if big else shaped_overrides(TINY_SHARD_CONFIG, root,
                                                                             args.shard_steps)
    run_dir = os.path.join(root, "shard_run")
    records = run(run_args + extra, args.nproc, run_dir)
    plan = json.load(open(os.path.join(run_dir, "plan.json")))
    summary = summarize(records, rows_per_step(run_args), warmup=1)
    estimate = (plan.get("estimate") or {}).get("peak_bytes", 0) / 2**30
    measured = summary["peak_memory_gib_per_rank"]
    result.update(run=summary, estimate_gib=estimate, data_parallel=plan["data_parallel"])
    refusal = f"refused on 1 emulated P40 (needs {result['one_card_needs']} per card), " if big else ""
    print(f"RESULT shard {'qwen2.5-1.5b full GRPO' if big else 'tiny (CPU smoke)'}: {refusal}"
          f"planned {plan['data_parallel']} on {args.nproc}; "
          f"{summary['steps']} steps at {summary['step_time_s']:.1f} s/step; peak per rank measured "
          f"{measured:.2f} GiB vs estimated {estimate:.2f} GiB (x{measured / max(estimate, 1e-9):.2f})", flush=True)
    return result


def part_nodes(args, root: str, extra: list[str]) -> dict:
    """Two torchrun launches, one rendezvous: node 0 and node 1 of a 2-node job, one process (GPU) each."""
    name = "tiny-grpo" if args.cpu else "grpo-0.5b"
    base, _ = config_overrides(name, root, args.nodes_steps)
    run_dir = os.path.join(root, "two_nodes")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for node in range(2):
        env = python_env()
        if not args.cpu:
            env["CUDA_VISIBLE_DEVICES"] = str(node)
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                   "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=rla-two-nodes",
                   "-m", "rlanywhere.cli", "train", *base, *extra, f"trainer.default_local_dir={run_dir}",
                   "trainer.logger=[console]"]
        print(f"$ CUDA_VISIBLE_DEVICES={node} " if not args.cpu else "$ ", " ".join(command), flush=True)
        procs.append(subprocess.Popen(command, env=env))
    codes = [proc.wait() for proc in procs]
    if any(codes):
        print(f"RESULT nodes: FAILED, exit codes {codes}", flush=True)
        return {"exit_codes": codes}
    plan = json.load(open(os.path.join(run_dir, "plan.json")))
    summary = summarize(read_metrics(run_dir), rows_per_step(base), warmup=0)
    print(f"RESULT nodes: 2 launches (--nnodes=2 --nproc_per_node=1, one c10d rendezvous) ran {summary['steps']} "
          f"steps of {name} as world {plan['world_size']} ({plan['data_parallel']}, {plan['dist_backend']}), "
          f"{summary['step_time_s']:.2f} s/step", flush=True)
    return {"run": summary, "world_size": plan["world_size"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="scaling,shard,nodes")
    parser.add_argument("--configs", default="demo,grpo-0.5b,grpo-0.5b-shard")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="steps of each scaling run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the timing")
    parser.add_argument("--shard-steps", type=int, default=3)
    parser.add_argument("--nodes-steps", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="smoke test on CPU processes (gloo, tiny shapes)")
    parser.add_argument("--out")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    extra = list(args.overrides) + (["hardware.device=cpu"] if args.cpu else [])
    root = tempfile.mkdtemp(prefix="rla_scaling_")
    parts = {"scaling": part_scaling, "shard": part_shard, "nodes": part_nodes, "placements": part_placements}
    results = {}
    for part in args.parts.split(","):
        start = time.time()
        results[part] = parts[part](args, root, extra)
        print(f"[{part}: {time.time() - start:.0f} s]", flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
