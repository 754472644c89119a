"""Command line: `rlanywhere demo | train | eval | chat | prepare | plan | doctor | plot`.

    rlanywhere demo                                   # the offline demo: SmolLM2-135M + GRPO on addition (a new run)
    rlanywhere demo trainer.total_training_steps=20   # the demo with overrides on top
    rlanywhere demo --resume                          # continue the newest demo that was stopped (Ctrl-C)
    rlanywhere prepare gsm8k --src tests/data/gsm8k --out data/gsm8k  # or --src openai/gsm8k (needs `datasets`)
    rlanywhere prepare arithmetic --out data/arith --digits 2
    rlanywhere train examples/ppo_gsm8k.yaml data.train_batch_size=64 algorithm.adv_estimator=grpo
    rlanywhere plan $(cat tests/data/fixtures/verl-p40-ppo.args) --emulate p40  # a verl P40 command line, as it is
    rlanywhere plan examples/ppo_gsm8k.yaml --emulate p40  # what would run on a Tesla P40, and in how much memory
    rlanywhere doctor --emulate p40                   # real compute checks on the planned path
    rlanywhere eval --model runs/demo/latest/final_model --data data/arith-1digit/test.parquet
    rlanywhere chat --model runs/demo/latest/final_model  # latest: the newest demo that saved its model
    rlanywhere plot runs/demo/latest

Mistakes a user can fix print one `error: ...` line (exit 2); --verbose adds the traceback.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import traceback
from typing import Optional

from .api import DEMO_DATA_DIR, demo_profile  # noqa: F401  (their home before api.py; kept for callers)

from .rank_layout import failed_rank_line
from . import rank_launch, vocabulary
from .rank_launch import FAILED_RANKS_NAMED
from .runfaults import guard_output_streams

log = logging.getLogger("rlanywhere")


def _configure_logging(verbose: bool) -> None:
    # Routine progress ("checkpoint saved", "val sample") is INFO and shown; --verbose adds DEBUG and tracebacks.
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("rlanywhere").setLevel(logging.DEBUG if verbose else logging.INFO)
    for noisy in ("transformers", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def _split_config_and_overrides(items: list[str]) -> tuple[Optional[str], list[str]]:
    if items and "=" not in items[0] and items[0].endswith((".yaml", ".yml")):
        return items[0], items[1:]
    if items and "=" not in items[0]:
        from .errors import UserError

        raise UserError(f"{items[0]!r} is neither a config file (.yaml/.yml) nor a key=value override; write "
                        "`rlanywhere train [config.yaml] [key=value ...]`")
    return None, items


def _load(items: list[str], emulate: Optional[str] = None, hydra: Optional[tuple] = None, fit_world: bool = True):
    from .api import make_config
    from .config import _load_yaml
    from .verl_compat import hydra_config_layer

    path, overrides = _split_config_and_overrides(items)
    if emulate:
        overrides = overrides + [f"hardware.emulate={emulate}"]
    notices: list[str] = []
    if hydra and hydra[1]:  # verl's --config-path/--config-name: that YAML (its defaults applied) under the overrides
        if path is not None:
            from .errors import UserError

            raise UserError(f"give either a config file ({path}) or --config-path/--config-name, not both")
        path = hydra_config_layer(hydra[0] or ".", hydra[1], notices, _load_yaml)
    cfg = make_config(path, overrides, notices=notices)
    if fit_world:
        _fit_world(cfg, notices)
    return cfg, notices


def _hydra(args) -> tuple:
    return getattr(args, "config_path", None), getattr(args, "config_name", None)


def _fit_world(cfg, notices: list[str]) -> None:
    """trainer.n_gpus_per_node x nnodes larger than this machine: plan and run what it has (one notice)."""
    import torch

    from . import distributed
    from .verl_compat import fit_world_to_machine

    notice = fit_world_to_machine(cfg, torch.cuda.device_count(), distributed.launched_by_torchrun())
    if notice:
        notices.append(notice)
        logging.getLogger(__name__).warning("notice: %s", notice)


# ---------------------------------------------------------------------------------------------- commands
def cmd_prepare(args) -> int:
    from . import data

    if args.task == "gsm8k":
        paths = data.prepare_gsm8k(args.src or "openai/gsm8k", args.out)
    elif args.task == "arithmetic":
        paths = data.prepare_arithmetic(args.out, train_size=args.train_size, test_size=args.test_size,
                                        digits=args.digits, operators=args.operators,
                                        num_operands=args.num_operands, seed=args.seed)
    elif args.task == "tool-arithmetic":  # the calculator demo: the prompt shows one worked tool call
        from .data.tool_arith import prepare_tool_arithmetic

        paths = prepare_tool_arithmetic(args.out, train_size=args.train_size, test_size=args.test_size,
                                        digits=args.digits, operators=args.operators,
                                        num_operands=args.num_operands, seed=args.seed)
    else:
        if not args.src or not args.prompt_key or not args.answer_key:
            from .errors import UserError

            raise UserError("prepare generic needs --src FILE --prompt-key COL --answer-key COL")
        paths = data.prepare_generic(args.src, args.out, prompt_key=args.prompt_key, answer_key=args.answer_key,
                                     data_source=args.data_source, instruction=args.instruction)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def _run(cfg, notices: list[str], emulate: Optional[str] = None, relaunch_argv: Optional[list[str]] = None,
         resume_command: Optional[str] = None) -> int:
    """Plan and train `cfg`, print the summary. [distributed] Under torchrun every rank runs this (rank 0 alone
    prints); trainer.n_gpus_per_node > 1 without torchrun reruns `relaunch_argv` (this command line) under it."""
    from . import distributed

    # [distributed] torchrun's launch sets the world; trainer.n_gpus_per_node > 1 without torchrun relaunches via it
    distributed.reconcile_world(cfg)
    world = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    # [async] one_step_off on 2 ranks: one trains, one generates (split_run.py), instead of data parallelism
    from .split_run import run_split_rank, split_world

    split, world = split_world(cfg, world, distributed.launched_by_torchrun())
    if not split:
        distributed.check_world_config(cfg, world)
    if world > 1 and not distributed.launched_by_torchrun():
        if int(cfg.trainer.nnodes) > 1 or relaunch_argv is None:
            raise distributed.UserError(
                f"trainer.nnodes={cfg.trainer.nnodes} x trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node}: start "
                f"every node yourself with torchrun --nnodes={cfg.trainer.nnodes} "
                f"--nproc_per_node={cfg.trainer.n_gpus_per_node} --rdzv_endpoint=HOST:PORT -m rlanywhere.cli train "
                "... (docs/distributed.md has the full command)")
        return _torchrun_until_done(cfg, relaunch_argv)
    rank = distributed.env_world()[0]
    if world > 1 and hasattr(signal, "SIGUSR1"):
        # a rank that hangs (a collective another rank never joined): `kill -USR1 PID` prints its threads' stacks
        print_stacks_on_sigusr1()
    if rank > 0:  # one voice: rank 0 prints, logs and plots
        logging.getLogger().setLevel(logging.ERROR)
        logging.getLogger("rlanywhere").setLevel(logging.ERROR)
    try:
        if split:  # the trainer rank runs as any rank does (_run_rank), its rollouts made on the other
            return run_split_rank(cfg, notices, emulate, rank, resume_command, train_rank=_run_rank)
        return _run_rank(cfg, notices, emulate, rank, resume_command)
    except BaseException as exc:
        if world > 1 and not isinstance(exc, SystemExit):
            # another rank died (killed, crashed): one line naming it, no traceback of this rank's collective
            lost = failed_rank_line(exc, rank, world)
            if lost is not None:
                if not os.environ.get(FAILED_RANKS_NAMED):  # else rlanywhere's launcher names the rank itself
                    print(lost, file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            # torchrun ends the other ranks when this one exits; say which rank failed and why
            print(f"error: rank {rank} of {world} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        raise


def print_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` prints where this process is: at once the stack of the thread the signal interrupts (from C,
    by faulthandler: it works while the rank waits in a collective), then, as soon as the main thread runs Python
    again, every thread's (from Python). faulthandler's own dump of every thread reads the other threads' frames while
    they run, and crashed a rank whose reward pool and rollout threads were busy (SIGSEGV)."""

    def every_thread(signum, frame):  # a signal handler's signature
        import threading
        import traceback

        names = {thread.ident: thread.name for thread in threading.enumerate()}
        stacks = [f"Thread {names.get(ident, ident)} (most recent call last):\n" + "".join(traceback.format_stack(top))
                  for ident, top in sys._current_frames().items()]
        print("\n".join(stacks), file=sys.stderr, flush=True)

    signal.signal(signal.SIGUSR1, every_thread)
    faulthandler.register(signal.SIGUSR1, all_threads=False, chain=True)


# A sharded update that runs out of memory stops the job with its size halved (oom.py); at most this many relaunches
OOM_RELAUNCHES = 8


def _torchrun_until_done(cfg, relaunch_argv: list[str]) -> int:
    """Run this command line as trainer.n_gpus_per_node ranks under torchrun. When the job stopped because a
    sharded update ran out of memory (it saved smaller sizes: oom.OOMGuard.run_matched), relaunch it to resume
    from the last checkpoint at those sizes."""
    from . import distributed
    from .checkpoint_dirs import list_checkpoints
    from .oom import remembered_sizes

    run_dir = cfg.trainer.default_local_dir
    argv = list(relaunch_argv)
    resume = "trainer.resume_mode=auto"
    before = remembered_sizes(run_dir)
    for _ in range(OOM_RELAUNCHES + 1):
        command = distributed.relaunch_command(int(cfg.trainer.n_gpus_per_node), argv)
        print("starting torchrun: " + " ".join(command), flush=True)
        code = rank_launch.run_ranks(command)  # stop signals passed on once; it waits for the ranks' save
        after = remembered_sizes(run_dir)
        if code == 0 or after is None or after == before:
            return code
        before = after
        event = after["event"]
        print(f"rank {event['rank']} ran out of memory in {event['phase']} at {event['attribute']}="
              f"{event['old_size']}: relaunching to resume from the last checkpoint at {event['new_size']}",
              file=sys.stderr, flush=True)
        # the relaunch continues this run: from its own newest checkpoint (a resume_path asked for stays the
        # start until this run has saved one)
        if resume not in argv and (cfg.trainer.resume_mode != "resume_path" or list_checkpoints(run_dir)):
            argv.append(resume)
    return code


def _run_rank(cfg, notices: list[str], emulate: Optional[str], rank: int, resume_command: Optional[str] = None) -> int:
    from . import api

    from .runguard import RunInterrupted

    run_plan = api.plan(cfg, emulate=emulate)
    if rank == 0:
        print(run_plan.summary())
        print(f"run dir: {os.path.abspath(cfg.trainer.default_local_dir)}")
    try:
        result = api.train(cfg, run_plan, notices)
    except RunInterrupted as stop:  # SIGTERM / Ctrl-C: saved (docs/reliability.md lists the exit codes)
        if rank == 0:  # resume_command: what continues this run when it is not the same command line (the demo)
            text = str(stop)
            if resume_command:
                from .checkpoint_dirs import list_checkpoints

                saved = stop.checkpoint or list_checkpoints(cfg.trainer.default_local_dir)
                text = text.split("; run the same command")[0] + (
                    f"; to continue it: {resume_command}" if saved else "; nothing to continue: run the demo again")
            print(text, file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:  # Ctrl-C before training started: nothing to save
        if rank == 0:
            print("interrupted before training started; nothing was saved", file=sys.stderr)
        return 130
    if rank == 0:
        print("\n".join(result.summary_lines()))
    return 0


def cmd_demo(args) -> int:
    from . import demo_runs
    from .api import demo_config

    overrides = list(args.items) + ([f"hardware.emulate={args.emulate}"] if args.emulate else [])
    names_dir = any(item.lstrip("+").startswith("trainer.default_local_dir=") for item in overrides)
    if getattr(args, "resume", False) and not names_dir:
        root = os.path.dirname(os.path.abspath(demo_config(overrides, new_run=False).trainer.default_local_dir))
        # the run's own name: its folder and config resolve as they did when it started
        overrides.append(f"trainer.experiment_name={os.path.basename(demo_runs.run_to_resume(root))}")
    run_dir = _named_run_dir(overrides)
    if run_dir is not None:  # continuing a run: its own experiment name, so the resume changes nothing
        overrides += demo_runs.experiment_name_of(run_dir, overrides)
    notices: list[str] = []
    cfg = demo_config(overrides, notices=notices)
    run_dir = os.path.abspath(cfg.trainer.default_local_dir)
    created = not os.path.exists(run_dir)
    resume_command = demo_runs.RESUME_COMMAND if not names_dir else f"rlanywhere demo {' '.join(args.items)}"
    if int(os.environ.get("RANK", 0)) == 0:
        print(demo_runs.start_line(run_dir))
    # [distributed] a relaunch under torchrun keeps this run dir (the demo's name is timestamped)
    argv = _verbose_argv(args) + ["demo"] + (["--emulate", args.emulate] if args.emulate else []) + [
        *args.items, *overrides[len(args.items) + bool(args.emulate):], f"trainer.default_local_dir={run_dir}"]
    try:
        return _run(cfg, notices, relaunch_argv=argv, resume_command=resume_command)
    finally:
        if int(os.environ.get("RANK", 0)) == 0:
            demo_runs.finish(run_dir, created)


def _named_run_dir(overrides: list[str]) -> Optional[str]:
    for item in overrides:
        if item.lstrip("+").startswith("trainer.default_local_dir="):
            return os.path.abspath(item.split("=", 1)[1])
    return None


def _verbose_argv(args) -> list[str]:
    return ["-v"] if getattr(args, "verbose", False) else []


def _load_checking_inputs(args, fit_world: bool = True, **what):
    """`_load`, whose configuration problems come in one answer with those of the inputs the configuration names
    (a mistyped key and a missing data file are fixed in one go)."""
    from .config import ConfigError
    from .preflight import with_input_problems

    try:
        return _load(args.items, args.emulate, _hydra(args), fit_world)
    except ConfigError as error:
        raise with_input_problems(error, **what) from None


def cmd_train(args) -> int:
    if not args.items and not args.emulate and not args.config_name:
        return cmd_demo(args)  # `rlanywhere train` alone is the demo, as before `rlanywhere demo` existed
    cfg, notices = _load_checking_inputs(args)
    # options before the overrides: a relaunch appends overrides
    argv = _verbose_argv(args) + ["train"] + (["--emulate", args.emulate] if args.emulate else []) + (
        [f"--config-path={args.config_path or '.'}", f"--config-name={args.config_name}"] if args.config_name
        else []) + args.items
    return _run(cfg, notices, relaunch_argv=argv)


def cmd_eval(args) -> int:
    from .api import evaluate

    result = evaluate(args.model, args.data, max_samples=args.max_samples, max_new_tokens=args.max_new_tokens,
                      batch_size=args.batch_size, overrides=args.overrides)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    return 0


def _at_least_one(text: str) -> int:
    """An argparse type: an integer >= 1 (the flag's own error, before any model loads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be a finite number >= 0 (0: greedy)")
    return value


def cmd_chat(args) -> int:
    """One answer per prompt: --prompt TEXT (repeatable), or an interactive loop reading stdin."""
    from .api import generate, load_model

    loaded = load_model(args.model, max_new_tokens=args.max_new_tokens, batch_size=1)
    prompts = args.prompt or []
    if prompts:
        for answer in generate(loaded, prompts, args.max_new_tokens, args.temperature):
            print(answer)
        return 0
    print("chat: an empty line or Ctrl-D ends")
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        print(generate(loaded, [line], args.max_new_tokens, args.temperature)[0])
    return 0


def _estimate_table(plan) -> str:
    from .estimator import format_bytes
    from .plans import format_table

    estimate = plan.estimate or {}
    budget = plan.memory_budget_bytes or 0
    rows = []
    for phase, need in estimate.get("phases", {}).items():
        parts = sorted(estimate["breakdown"][phase].items(), key=lambda kv: -kv[1])[:4]
        rows.append((phase, format_bytes(need), f"{100 * need / budget:.0f}%" if budget else "-",
                     ", ".join(f"{k} {format_bytes(v)}" for k, v in parts)))
    return format_table(("phase", "predicted peak", "of budget", "largest parts"), rows, max_width=100)


def plan_main(config=None, overrides: Optional[list[str]] = None, emulate: Optional[str] = None,
              json_out=None, machine=None) -> int:
    """`rlanywhere plan`: print the probe, the plan table and the predicted per-phase peaks. 0 ok, 2 no plan.

    config: a loaded DictConfig, or a YAML path (None: defaults) loaded with `overrides`. emulate: a CARDS key
    (default: cfg.hardware.emulate). json_out: a path to also write {"probe", "plan"} as JSON; "-" or True prints
    only the JSON. machine: a HardwareProbe (default: probe this machine)."""
    from pathlib import Path

    from .balance import balance_text
    from .config import config_from
    from .estimator import format_bytes
    from .machine import probe_machine
    from .planner import make_plan
    from .vocabulary import PlanError

    cfg = config_from(config, overrides)
    if json_out is True:
        json_out = "-"
    machine = machine if machine is not None else probe_machine()
    try:
        plan = make_plan(cfg, machine, for_execution=False, emulate=emulate)
    except PlanError as exc:
        if json_out == "-":
            print(json.dumps({"probe": machine.to_dict(), "error": str(exc)}, indent=2))
        else:
            print("machine:\n" + machine.summary())
            print(f"\nno plan: {exc}")
        return 2
    payload = {"probe": machine.to_dict(), "plan": plan.to_dict()}
    if plan.world_size > 1:  # [distributed] not a plan decision: the config's, said beside the plan
        payload["balance_batch"] = bool(cfg.trainer.balance_batch)
    if json_out == "-":
        print(json.dumps(payload, indent=2))
        return 0
    sizes = plan.sizes
    print("machine:\n" + machine.summary())
    print(f"\nplan{' (emulating ' + plan.emulated + ')' if plan.emulated else ''}:\n{plan.summary()}")
    print(f"\npredicted peak memory per phase (budget {format_bytes(plan.memory_budget_bytes or 0)}):")
    print(_estimate_table(plan))
    print(f"\nmicro-batches: actor {sizes.actor_micro_batch_size}, critic "
          f"{sizes.critic_micro_batch_size if plan.use_critic else '-'}, log-prob {sizes.logprob_micro_batch_size}"
          + (f", tokens {sizes.max_token_len_per_micro_batch}" if sizes.max_token_len_per_micro_batch else "")
          + f"; rollout {sizes.rollout_batch_size} sequences at once")
    if plan.world_size > 1:
        print(balance_text(bool(cfg.trainer.balance_batch), plan.world_size))
    if json_out:
        Path(json_out).write_text(json.dumps(payload, indent=2))
        print(f"wrote {json_out}")
    return 0


def cmd_plan(args) -> int:
    from .preflight import require_inputs

    what = dict(data=False, reward=False, planning_only=True)  # planning reads the model's shape only
    cfg, notices = _load_checking_inputs(args, fit_world=False, **what)
    if not cfg.hardware.emulate:  # an emulated card (--emulate or hardware.emulate): the world asked for, as planned
        _fit_world(cfg, notices)
    require_inputs(cfg, **what)
    return plan_main(cfg, json_out=args.json)


def cmd_doctor(args) -> int:
    from .runtime import prepare_environment
    from .doctor import doctor_main

    cfg, _ = _load(args.items, args.emulate, _hydra(args))
    prepare_environment(cfg)
    return doctor_main(cfg)


def cmd_plot(args) -> int:
    from .plotting import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="rlanywhere", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rlanywhere {__version__}")
    # -v works before or after the command; SUPPRESS keeps a subcommand's default from hiding the top-level flag
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="debug logging, and a traceback with errors")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and a traceback with errors")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_text: str, func):
        p = sub.add_parser(name, help=help_text, parents=[verbose])
        p.set_defaults(func=func)
        return p

    for name, func, text in (("demo", cmd_demo, "the offline demo, a new run each time; overrides apply on top"),
                             ("train", cmd_train, "run RL post-training (no arguments: the demo)"),
                             ("plan", cmd_plan, "print the hardware plan and predicted memory, load nothing"),
                             ("doctor", cmd_doctor, "check the planned compute path for real")):
        p = command(name, text, func)
        p.add_argument("items", nargs="*", help="[config.yaml] [dotted.key=value ...]" if name != "demo"
                       else "[dotted.key=value ...] on top of the demo profile")
        p.add_argument("--emulate", help="plan for (and cap the run to) a card: p40, t4, v100-16g, a100-40g, ...")
        if name == "plan":
            p.add_argument("--json", action="store_true", help="print the probe and the plan as JSON")
        if name != "demo":  # Hydra's spelling, as verl's scripts use it
            p.add_argument("--config-path", help="with --config-name: a directory of YAML configs (Hydra's option)")
            p.add_argument("--config-name", help="the YAML in --config-path to read (its defaults applied)")
        if name == "demo":
            p.add_argument("--resume", action="store_true",
                           help="continue the newest demo that stopped before it finished (Ctrl-C saves one)")

    ev = command("eval", "greedy accuracy and format rate of a model on a parquet file", cmd_eval)
    ev.add_argument("--model", required=True, help="HF dir (a run's final_model), hub id, .gguf file")
    ev.add_argument("--data", required=True, help="a verl-schema parquet file (`rlanywhere prepare` writes them)")
    ev.add_argument("--max-samples", type=int, default=-1, help="score the first N rows (<= 0: all)")
    ev.add_argument("--max-new-tokens", type=_at_least_one, default=256, help="tokens generated per answer at most")
    ev.add_argument("--batch-size", type=_at_least_one, default=64, help="prompts generated at once")
    ev.add_argument("--out", help="also write the result JSON to this file")
    ev.add_argument("overrides", nargs="*",
                    help="dotted.key=value config overrides (e.g. custom_reward_function.path=FILE)")

    ch = command("chat", "talk to a model: --prompt TEXT, or type lines", cmd_chat)
    ch.add_argument("--model", required=True, help="HF dir (a run's final_model), hub id, .gguf file")
    ch.add_argument("--prompt", action="append", help="answer this and exit (repeatable)")
    ch.add_argument("--max-new-tokens", type=_at_least_one, default=128, help="tokens generated per answer at most")
    ch.add_argument("--temperature", type=_temperature, default=0.0, help="sampling temperature (0: greedy)")

    prep = command("prepare", "write train/test parquet for a task", cmd_prepare)
    prep.add_argument("task", choices=vocabulary.PREPARE_TASKS, help="what to write")
    prep.add_argument("--src", help="gsm8k: a directory with train/test.jsonl or an HF dataset name; generic: a file")
    prep.add_argument("--out", required=True, help="output folder for train.parquet and test.parquet")
    prep.add_argument("--digits", type=int, default=2, help="arithmetic: digits per operand")
    prep.add_argument("--operators", default="+", help="arithmetic: operators to draw from, e.g. +-*")
    prep.add_argument("--num-operands", type=int, default=2, help="arithmetic: operands per question")
    prep.add_argument("--train-size", type=int, default=2000, help="arithmetic: training questions")
    prep.add_argument("--test-size", type=int, default=200, help="arithmetic: test questions")
    prep.add_argument("--seed", type=int, default=0, help="arithmetic: random seed")
    prep.add_argument("--prompt-key",
                      help="generic: the column holding the prompt (text or chat messages; dotted for nested)")
    prep.add_argument("--answer-key", help="generic: the column holding the answer (the reward's ground truth)")
    prep.add_argument("--data-source", default="generic", help="generic: the data_source written on every row")
    prep.add_argument("--instruction", help="generic: text appended to each prompt")

    pl = command("plot", "PNG curves of a run", cmd_plot)
    pl.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    pl.add_argument("--out", help="where to write the PNGs (default: RUN_DIR/plots)")
    return parser


def user_error_message(exc: BaseException) -> Optional[str]:
    """The one line to print for a mistake the user can fix, or None for a bug (which keeps its traceback)."""
    from .errors import UserError

    if isinstance(exc, (UserError, FileNotFoundError, IsADirectoryError, NotADirectoryError, ImportError)):
        return str(exc)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    verbose = getattr(args, "verbose", False)
    guard_output_streams()  # before logging and progress bars take the streams: a reader gone never stops a save
    _configure_logging(verbose)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        message = user_error_message(exc)
        if message is None:
            raise
        if verbose:
            traceback.print_exc()
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
