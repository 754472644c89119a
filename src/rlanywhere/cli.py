"""Command line: `rlanywhere prepare | train | eval | plan | doctor | plot`.

    rlanywhere train                                  # the offline demo: SmolLM2-135M + GRPO on arithmetic
    rlanywhere train ppo.yaml data.train_batch_size=64 algorithm.adv_estimator=grpo
    rlanywhere train $(cat verl-overrides.args)       # a verl command line's overrides, unchanged
    rlanywhere prepare gsm8k --src ../shared/data/gsm8k --out data/gsm8k
    rlanywhere prepare arithmetic --out data/arith --digits 2
    rlanywhere eval --model runs/demo/checkpoints/global_step_8/actor --data data/arith/test.parquet
    rlanywhere plan ppo.yaml --emulate p40            # what would run on a Tesla P40, and in how much memory
    rlanywhere doctor --emulate p40                   # real compute checks on the planned path
    rlanywhere plot runs/demo
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Optional

from omegaconf import OmegaConf

log = logging.getLogger("rlanywhere")

DEMO_DATA_DIR = "data/arith"


def demo_profile(on_gpu: bool) -> dict:
    """The no-argument `rlanywhere train`: GRPO on 2-digit addition with SmolLM2-135M-Instruct.

    Sized to finish in minutes on a laptop CPU; on a GPU the same run is larger (more prompts, samples, steps)."""
    small = not on_gpu
    return {
        "data": {"train_files": f"{DEMO_DATA_DIR}/train.parquet", "val_files": f"{DEMO_DATA_DIR}/test.parquet",
                 "train_batch_size": 4 if small else 64, "max_prompt_length": 128,
                 "max_response_length": 40 if small else 96, "val_max_samples": 24 if small else 200},
        "actor_rollout_ref": {
            "model": {"path": "smollm2-135m-instruct"},
            "actor": {"optim": {"lr": 5e-6}, "ppo_mini_batch_size": 4 if small else 32,
                      "ppo_epochs": 1, "entropy_coeff": 0.0, "use_kl_loss": False},
            "rollout": {"n": 4 if small else 8, "temperature": 0.7, "top_p": 1.0},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"project_name": "demo", "experiment_name": "smollm2-grpo-arith",
                    "total_training_steps": 6 if small else 60, "test_freq": 3 if small else 10,
                    "save_freq": 6 if small else 30, "logger": ["console", "tensorboard"],
                    "val_before_train": True, "log_val_generations": 2},
    }


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("transformers", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _split_config_and_overrides(items: list[str]) -> tuple[Optional[str], list[str]]:
    if items and "=" not in items[0] and items[0].endswith((".yaml", ".yml")):
        return items[0], items[1:]
    return None, items


def _load(items: list[str], emulate: Optional[str] = None, demo_if_empty: bool = False):
    from .config import load_config

    path, overrides = _split_config_and_overrides(items)
    if emulate:
        overrides = overrides + [f"hardware.emulate={emulate}"]
    base = None
    is_demo = demo_if_empty and path is None and not items
    if is_demo:
        import torch

        base = OmegaConf.create(demo_profile(torch.cuda.is_available()))
    notices: list[str] = []
    cfg = load_config(path, overrides, base=base, notices=notices)
    return cfg, notices, is_demo


# ---------------------------------------------------------------------------------------------- commands
def cmd_prepare(args) -> int:
    from . import data

    if args.task == "gsm8k":
        paths = data.prepare_gsm8k(args.src or "openai/gsm8k", args.out)
    elif args.task == "arithmetic":
        paths = data.prepare_arithmetic(args.out, train_size=args.train_size, test_size=args.test_size,
                                        digits=args.digits, operators=args.operators,
                                        num_operands=args.num_operands, seed=args.seed)
    else:
        if not args.src or not args.prompt_key or not args.answer_key:
            raise SystemExit("prepare generic needs --src FILE --prompt-key COL --answer-key COL")
        paths = data.prepare_generic(args.src, args.out, prompt_key=args.prompt_key, answer_key=args.answer_key,
                                     data_source=args.data_source, instruction=args.instruction)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def cmd_train(args) -> int:
    from . import distributed

    cfg, notices, is_demo = _load(args.items, args.emulate, demo_if_empty=True)
    # [distributed] torchrun's launch sets the world; trainer.n_gpus_per_node > 1 without torchrun relaunches via it
    distributed.reconcile_world(cfg)
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    distributed.check_batch_divisible(cfg, world)
    if world > 1 and not distributed.launched_by_torchrun():
        if int(cfg.trainer.nnodes) > 1:
            raise distributed.UserError(
                f"trainer.nnodes={cfg.trainer.nnodes}: start every node yourself with torchrun --nnodes="
                f"{cfg.trainer.nnodes} --nproc_per_node={cfg.trainer.n_gpus_per_node} --rdzv_endpoint=HOST:PORT "
                "-m rlanywhere.cli train ... (README: multi-node)")
        import subprocess

        argv = (["-v"] if args.verbose else []) + ["train", *args.items] + (
            ["--emulate", args.emulate] if args.emulate else [])
        command = distributed.relaunch_command(int(cfg.trainer.n_gpus_per_node), argv)
        print("starting torchrun: " + " ".join(command), flush=True)
        return subprocess.call(command)
    rank, _, local_rank, _ = distributed.env_world()
    if rank > 0:
        logging.getLogger().setLevel(logging.ERROR)  # one voice: rank 0 prints, logs and plots
    try:
        return _train(args, cfg, notices, is_demo, rank, local_rank, world)
    except BaseException as exc:
        if world > 1 and not isinstance(exc, SystemExit):
            # torchrun ends the other ranks when this one exits; say which rank failed and why
            print(f"error: rank {rank} of {world} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise


def _train(args, cfg, notices, is_demo, rank: int, local_rank: int, world: int) -> int:
    from .hardware import PlanError, apply_runtime, make_plan, prepare_environment

    prepare_environment(cfg)  # allocator settings must be in place before CUDA initialises
    try:
        plan = make_plan(cfg, for_execution=True)
    except PlanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    apply_runtime(plan)
    if rank == 0:
        print(plan.summary())
    if is_demo and not os.path.exists(cfg.data.train_files):
        from .data import prepare_arithmetic

        if local_rank == 0:
            print(f"demo: writing the arithmetic task to {DEMO_DATA_DIR}/")
            prepare_arithmetic(DEMO_DATA_DIR, train_size=2000, test_size=200, digits=2, operators="+", seed=0)
        else:  # the node's first rank writes it
            deadline = time.time() + 120
            while not os.path.exists(f"{DEMO_DATA_DIR}/test.parquet") and time.time() < deadline:
                time.sleep(0.5)
    from .trainer import RLTrainer

    run_dir = os.path.abspath(cfg.trainer.default_local_dir)
    if rank == 0:
        print(f"run dir: {run_dir}")
    start = time.time()
    trainer = RLTrainer(cfg, plan, run_dir, notices)
    final = trainer.fit()
    trainer.dp.close()
    if rank > 0:
        return 0
    try:
        from .plotting import plot_run

        plot_run(run_dir)
    except Exception as exc:  # plots are a convenience: never fail a finished run over them
        log.warning("plotting failed: %s", exc)
    summary = {"run_dir": run_dir, "steps": trainer.global_step, "minutes": round((time.time() - start) / 60, 2),
               **final}
    print(json.dumps(summary, indent=2))
    print(f"done. run dir: {run_dir}")
    return 0


def cmd_eval(args) -> int:
    import torch

    from .config import load_config
    from .data import RLDataset
    from .hardware import apply_runtime, make_plan
    from .models import load_causal_lm, load_tokenizer, resolve_model_source
    from .rewards import RewardManager
    from .rollout import make_engine
    from .rollout.base import SamplingParams

    cfg = load_config(None, [f"actor_rollout_ref.model.path={args.model}",
                             f"data.max_response_length={args.max_new_tokens}"] + list(args.overrides))
    plan = make_plan(cfg, for_execution=True)
    apply_runtime(plan)
    source = resolve_model_source(args.model)
    tokenizer = load_tokenizer(source)
    model = load_causal_lm(source, plan).to(plan.device).eval()
    dataset = RLDataset([args.data], tokenizer, cfg.data.max_prompt_length)
    count = len(dataset) if args.max_samples <= 0 else min(args.max_samples, len(dataset))
    items = [dataset[i] for i in range(count)]
    engine = make_engine(model, tokenizer, plan, engine=plan.rollout_engine, max_batch_size=args.batch_size,
                         max_seq_len=cfg.data.max_prompt_length + args.max_new_tokens)
    manager = RewardManager()
    accs, formats = [], []
    start = time.time()
    for begin in range(0, count, args.batch_size):
        part = items[begin:begin + args.batch_size]
        with torch.no_grad():
            out = engine.generate([it["input_ids"] for it in part],
                                  SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0))
        texts = out.decode(tokenizer)
        _, info = manager(texts, [it["ground_truth"] for it in part], [it["data_source"] for it in part],
                          [it["extra_info"] for it in part])
        accs += info["acc"]
        formats += info["format"]
    result = {"model": args.model, "data": args.data, "num_samples": count, "accuracy": sum(accs) / max(count, 1),
              "format_rate": sum(formats) / max(count, 1), "seconds": round(time.time() - start, 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    return 0


def cmd_plan(args) -> int:
    from .hardware import plan_main

    cfg, notices, _ = _load(args.items, args.emulate)
    return plan_main(cfg, json_out=args.json)


def cmd_doctor(args) -> int:
    from .hardware import prepare_environment
    from .doctor import doctor_main

    cfg, _, _ = _load(args.items, args.emulate)
    prepare_environment(cfg)
    return doctor_main(cfg)


def cmd_plot(args) -> int:
    from .plotting import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlanywhere", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prepare", help="write train/test parquet for a task")
    prep.add_argument("task", choices=["gsm8k", "arithmetic", "generic"])
    prep.add_argument("--src", help="gsm8k: a directory with train/test.jsonl or an HF dataset name; generic: a file")
    prep.add_argument("--out", required=True)
    prep.add_argument("--digits", type=int, default=2)
    prep.add_argument("--operators", default="+")
    prep.add_argument("--num-operands", type=int, default=2)
    prep.add_argument("--train-size", type=int, default=2000)
    prep.add_argument("--test-size", type=int, default=200)
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--prompt-key")
    prep.add_argument("--answer-key")
    prep.add_argument("--data-source", default="generic")
    prep.add_argument("--instruction")
    prep.set_defaults(func=cmd_prepare)

    for name, func, text in (("train", cmd_train, "run RL post-training (no arguments: the offline demo)"),
                             ("plan", cmd_plan, "print the hardware plan and predicted memory, load nothing"),
                             ("doctor", cmd_doctor, "check the planned compute path for real")):
        p = sub.add_parser(name, help=text)
        p.add_argument("items", nargs="*", help="[config.yaml] [dotted.key=value ...]")
        p.add_argument("--emulate", help="plan for (and cap the run to) a card: p40, t4, v100-16g, a100-40g, ...")
        if name == "plan":
            p.add_argument("--json", action="store_true")
        p.set_defaults(func=func)

    ev = sub.add_parser("eval", help="greedy accuracy and format rate of a model on a parquet file")
    ev.add_argument("--model", required=True)
    ev.add_argument("--data", required=True)
    ev.add_argument("--max-samples", type=int, default=-1)
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--batch-size", type=int, default=64)
    ev.add_argument("--out")
    ev.add_argument("overrides", nargs="*")
    ev.set_defaults(func=cmd_eval)

    pl = sub.add_parser("plot", help="PNG curves of a run")
    pl.add_argument("run_dir")
    pl.add_argument("--out")
    pl.set_defaults(func=cmd_plot)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    from .errors import UserError

    try:
        return args.func(args)
    except (UserError, FileNotFoundError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
