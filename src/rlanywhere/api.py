"""The Python API: the same objects and steps the command line uses, for a notebook or a script.

    import rlanywhere as rl

    cfg = rl.make_config({"algorithm": {"adv_estimator": "grpo"}}, ["data.train_batch_size=8"])  # dict/YAML + overrides
    plan = rl.plan(cfg)                      # every hardware decision; PlanError before any model loads
    result = rl.train(cfg, plan)             # TrainResult: run_dir, val_before/val_after, final_model, trainer
    rl.evaluate(result.final_model, "data/arith/test.parquet")        # greedy accuracy, as `rlanywhere eval`
    rl.generate(result.final_model, ["What is 2 + 3?"])               # chat-templated prompts -> response texts

`rlanywhere train` is `make_config` + `plan` + `train`; `rlanywhere eval` is `evaluate`; `rlanywhere chat` is
`generate`. `demo_config()` is the profile `rlanywhere demo` runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from omegaconf import DictConfig, OmegaConf

from .demo_runs import DEMO_DATA_DIR, demo_data_dir  # noqa: F401  (the demo's data folders; api's names too)

log = logging.getLogger(__name__)

# The CPU demo's task (cli.demo_profile): single-digit addition, the 100 questions split 68/32.
DEMO_CPU_TASK = {"digits": 1, "train_size": 68, "test_size": 32}
DEMO_GPU_TASK = {"digits": 2, "train_size": 2000, "test_size": 200}

ConfigLike = Union[None, str, os.PathLike, Mapping, DictConfig]


# ---------------------------------------------------------------------------------------------- config and plan
def make_config(config: ConfigLike = None, overrides: Sequence[str] = (), *, base: Optional[Mapping] = None,
                notices: Optional[list[str]] = None) -> DictConfig:
    """A validated run config: defaults <- `base` <- `config` (a YAML path, or a dict in verl's key names) <-
    dotted `overrides` ("data.train_batch_size=64"). Raises config.ConfigError naming the key and the fix."""
    from .config import load_config

    path = None
    layers = [OmegaConf.create(dict(base))] if base is not None else []
    if isinstance(config, (str, os.PathLike)):
        path = str(config)
    elif config is not None:
        layers.append(config if isinstance(config, DictConfig) else OmegaConf.create(dict(config)))
    merged = OmegaConf.merge(*layers) if layers else None
    return load_config(path, list(overrides), base=merged, notices=notices)


def demo_profile(on_gpu: bool) -> dict:
    """The `rlanywhere demo` profile: GRPO on addition with SmolLM2-135M-Instruct.

    CPU (minutes on 2 cores): single-digit addition. Before training the model answers about half the held-out
    questions with "To solve this equation, you need to ..." and runs out of its 12 tokens before any answer;
    GRPO with 4 prompts x 8 samples and lr 1e-5 teaches it within a few steps (3e-5 overshot: +25 points
    at step 4, +9 at step 8) to answer "a + b = c"
    at once (measured before -> after: docs/benchmarks.md). GPU: 2-digit addition, more prompts, samples and steps, as
    measured on an H200 (docs/benchmarks.md); unchanged."""
    small = not on_gpu
    data_dir = demo_data_dir(on_gpu)
    return {
        "data": {"train_files": f"{data_dir}/train.parquet", "val_files": f"{data_dir}/test.parquet",
                 "train_batch_size": 4 if small else 64, "max_prompt_length": 128,
                 "max_response_length": 12 if small else 96, "val_max_samples": 32 if small else 200},
        "actor_rollout_ref": {
            "model": {"path": "smollm2-135m-instruct"},
            "actor": {"optim": {"lr": 1e-5 if small else 5e-6}, "ppo_mini_batch_size": 4 if small else 32,
                      "ppo_epochs": 1, "entropy_coeff": 0.0, "use_kl_loss": False},
            "rollout": {"n": 8, "temperature": 0.8 if small else 0.7, "top_p": 1.0},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"project_name": "demo", "experiment_name": "smollm2-grpo-arith",
                    "total_training_steps": 8 if small else 60, "test_freq": 4 if small else 10,
                    "save_freq": -1 if small else 30, "logger": ["console", "tensorboard"],
                    "val_before_train": True, "log_val_generations": 2},
    }


def demo_config(overrides: Sequence[str] = (), on_gpu: Optional[bool] = None, new_run: bool = True,
                notices: Optional[list[str]] = None) -> DictConfig:
    """The demo profile with `overrides` on top. on_gpu: None decides from the machine (and hardware.device=cpu).

    new_run: each call gets its own run dir (a timestamped experiment name; under torchrun named by the job's run
    id, the same on every rank), unless the overrides name trainer.experiment_name or trainer.default_local_dir:
    then that run resumes as any run does."""
    if on_gpu is None:
        import torch

        wants_cpu = any(item.replace(" ", "").lstrip("+") == "hardware.device=cpu" for item in overrides)
        on_gpu = torch.cuda.is_available() and not wants_cpu
    profile = demo_profile(on_gpu)
    names_run = any(item.lstrip("+").startswith(("trainer.experiment_name=", "trainer.default_local_dir="))
                    for item in overrides)
    if new_run and not names_run:
        # [distributed] every rank of a torchrun job (all its nodes, its restarts too) shares the job's run id;
        # a timestamp would differ between ranks that start a second apart
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        profile["trainer"]["experiment_name"] += (
            "-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id) if run_id
            else time.strftime("-%Y%m%d-%H%M%S"))
    return make_config(None, overrides, base=profile, notices=notices)


def plan(cfg: DictConfig, emulate: Optional[str] = None, check_inputs: bool = True):
    """The hardware plan `cfg` runs with (plans.Plan), applied to this process (TF32 flags, memory cap).

    Call before anything touches torch.cuda. Raises PlanError for a request that cannot run here, and first (with
    check_inputs) preflight.InputError listing every unusable input: data files, model, reward function, values."""
    from . import distributed
    from .planner import make_plan
    from .runtime import apply_runtime, prepare_environment

    if check_inputs:
        from .preflight import require_inputs

        require_inputs(cfg)
    distributed.reconcile_world(cfg)  # under torchrun: plan for the launch's world, as the CLI does
    prepare_environment(cfg)
    chosen = make_plan(cfg, for_execution=True, emulate=emulate)
    apply_runtime(chosen)
    return chosen


# ---------------------------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    """What a finished run left behind (also printed by the CLI as its closing summary)."""

    run_dir: str
    steps: int  # the run's, from its first launch
    minutes: float  # this launch's
    final_model: Optional[str]
    val_before: dict = field(default_factory=dict)  # the first validation of this run dir (its "step": 0 when asked)
    val_after: dict = field(default_factory=dict)  # the last validation (the same dict where there was one)
    trainer: Any = field(default=None, repr=False)  # the RLTrainer: actor, tokenizer, engine, ... for more use
    first_step: int = 0  # the step this launch resumed at (0: it started the run)

    def _sampling(self) -> str:
        """How validation answered (actor_rollout_ref.rollout.val_kwargs), for the summary."""
        if self.trainer is None:
            return ""
        val = self.trainer.cfg.actor_rollout_ref.rollout.val_kwargs
        if not val.do_sample or val.temperature == 0:
            return ", greedy"
        return f", sampled at temperature {val.temperature:g}, {val.n} per prompt"

    def summary_lines(self) -> list[str]:
        """A short human summary: accuracy before -> after, minutes, where the model is, what to run next."""
        done = (f"{self.steps} steps in {self.minutes:.1f} min" if not self.first_step else
                f"{self.steps} steps, {self.steps - self.first_step} of them in {self.minutes:.1f} min (resumed at step "
                f"{self.first_step})")
        lines = [f"run dir: {self.run_dir}", done]
        # accuracy where the reward returns one (`acc`), else the reward itself (a reward function returning a number)
        name, key = ("accuracy", "val/acc") if "val/acc" in self.val_after else ("reward", "val/reward")
        before, after = self.val_before.get(key), self.val_after.get(key)
        if after is not None:
            count = int(self.val_after.get("val/num_samples", 0))
            how = f" ({count} prompts{self._sampling()})" if count else ""
            # before -> after only from a validation of the untrained model to a later one (not one with itself)
            if before is not None and self.val_before is not self.val_after and self.val_before.get("step", 0) == 0:
                verdict = "learned" if after > before else "did not improve"
                lines.append(f"held-out {name}{how}: {before:.3f} -> {after:.3f} ({(after - before) * 100:+.1f} "
                             f"points: {verdict})")
            else:
                step = self.val_after.get("step")
                lines.append(f"held-out {name}{'' if step is None else f' at step {step}'}{how}: {after:.3f}")
            marker_rate = self.val_after.get("val/format")
            cfg = self.trainer.cfg if self.trainer is not None else None
            own_reward = cfg is not None and bool(cfg.custom_reward_function.path or cfg.reward_model.enable)
            if key == "val/acc" and marker_rate is not None and marker_rate < 0.5 <= after and not own_reward:
                # the GSM8K-style rule: the number after "####", else the reply's last number (small models skip it)
                lines.append(f"  (the model writes the '####' marker in {marker_rate:.0%} of its answers; the reward "
                             "reads the last number of a reply that has none)")
        if self.final_model:
            cfg = self.trainer.cfg if self.trainer is not None else None
            val = as_list_first(cfg.data.val_files) if cfg is not None else None
            lines.append(f"final model (Hugging Face format): {self.final_model}")
            lines.append(f"  chat:     rlanywhere chat --model {self.final_model}")
            one_turn_rule = cfg is not None and not (cfg.actor_rollout_ref.rollout.multi_turn.enable
                                                     or cfg.reward_model.enable)  # what `rlanywhere eval` scores
            if val and one_turn_rule:
                lines.append(f"  evaluate: rlanywhere eval --model {self.final_model} --data {val}"
                             + eval_arguments(cfg))
        lines.append(f"  plots:    {os.path.join(self.run_dir, 'plots')}")
        return lines


def eval_arguments(cfg: DictConfig) -> str:
    """What `rlanywhere eval` needs besides the model and the data to score as this run's validation did: its
    response length, and its reward function and stop strings where it has them."""
    from .config import as_list

    length = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
    parts = [f" --max-new-tokens {length}"]
    reward = cfg.custom_reward_function
    if reward.path:
        parts.append(f" custom_reward_function.path={reward.path}")
        if reward.get("name"):
            parts.append(f" custom_reward_function.name={reward.name}")
    stop = as_list(cfg.actor_rollout_ref.rollout.stop)
    if stop:
        parts.append(" \"actor_rollout_ref.rollout.stop=[" + ",".join(repr(str(s)) for s in stop) + "]\"")
    return "".join(parts)


def as_list_first(value) -> Optional[str]:
    from .config import as_list

    items = as_list(value)
    return str(items[0]) if items else None


def ensure_demo_data(cfg: DictConfig) -> None:
    """Write the demo's arithmetic task when the config points at it and it is not there yet."""
    from .data import prepare_arithmetic

    train = str(as_list_first(cfg.data.train_files))
    for on_gpu, task in ((True, DEMO_GPU_TASK), (False, DEMO_CPU_TASK)):
        folder = demo_data_dir(on_gpu)
        if train == f"{folder}/train.parquet" and not os.path.exists(train):
            if int(os.environ.get("LOCAL_RANK", 0)) == 0:
                log.info("demo: writing the arithmetic task to %s/", folder)
                prepare_arithmetic(folder, operators="+", seed=0, **task)
            else:  # [distributed] the node's first rank writes it; the others wait for its last file
                deadline = time.time() + 120
                while not os.path.exists(f"{folder}/test.parquet") and time.time() < deadline:
                    time.sleep(0.5)


def train(cfg: DictConfig, run_plan=None, notices: Optional[list[str]] = None) -> TrainResult:
    """Run `cfg` to the end (resuming its run dir when trainer.resume_mode allows), save the final model, draw the
    plots; returns a TrainResult. run_plan: from `plan(cfg)` (made here when None)."""
    from . import distributed
    from .trainer import RLTrainer

    distributed.reconcile_world(cfg)  # under torchrun: the launch's world (plan() does the same)
    run_plan = run_plan if run_plan is not None else plan(cfg)
    ensure_demo_data(cfg)
    run_dir = os.path.abspath(cfg.trainer.default_local_dir)
    start = time.time()
    trainer = RLTrainer(cfg, run_plan, run_dir, notices)
    try:
        validated = trainer.fit()
        # trainer.val_only validates the model as loaded: there is nothing trained to export
        final_model = None if cfg.trainer.val_only else trainer.save_final_model()
        # [distributed] every rank done before any leaves: a rank tearing its process group down while another still
        # has gloo traffic in flight can abort at exit ("terminate called without an active exception")
        trainer.dp.barrier()
    finally:
        trainer.dp.close()  # [distributed] leave torchrun's process group (nothing to do in one process)
    if trainer.dp.is_main:  # [distributed] rank 0 plots
        try:
            from .plotting import plot_run

            plot_run(run_dir)
        except Exception as exc:  # plots are a convenience: never fail a finished run over them
            log.warning("plotting failed: %s", exc)
    before, after = first_and_last_validation(run_dir)
    if cfg.trainer.val_only:  # this launch's one validation (a resumed run's is not in metrics.jsonl)
        before = after = {"step": trainer.global_step,
                          **{key: value for key, value in (validated or {}).items() if key.startswith("val/")}}
    return TrainResult(run_dir=run_dir, steps=trainer.global_step, minutes=(time.time() - start) / 60,
                       final_model=final_model, val_before=before, val_after=after, trainer=trainer,
                       first_step=trainer.first_step)


def first_and_last_validation(run_dir: str) -> tuple[dict, dict]:
    """The val/* metrics of the first and the last validation logged in RUN_DIR/metrics.jsonl."""
    from .tracking import read_metrics

    try:
        records = read_metrics(run_dir)
    except FileNotFoundError:
        return {}, {}
    vals = [{"step": r["step"], **{k: v for k, v in r.items() if k.startswith("val/")}} for r in records
            if "val/reward" in r]
    return (vals[0], vals[-1]) if vals else ({}, {})


# ---------------------------------------------------------------------------------------------- inference
@dataclass
class LoadedModel:
    """A model ready for generation: the HF model, its tokenizer, the plan and a rollout engine."""

    model: Any
    tokenizer: Any
    plan: Any
    engine: Any
    max_prompt_length: int


def load_model(model: str, max_new_tokens: int = 256, batch_size: int = 64, overrides: Sequence[str] = (),
               max_prompt_length: Optional[int] = None) -> LoadedModel:
    """Load `model` (HF dir, hub id, .gguf, or 'smollm2-135m-instruct') for generation, planned like a run."""
    from .builders import build_tokenizer
    from .models import load_causal_lm
    from .rollout import make_engine

    extra = [f"data.max_prompt_length={max_prompt_length}"] if max_prompt_length else []
    cfg = make_config(None, [f"actor_rollout_ref.model.path={model}", f"data.max_response_length={max_new_tokens}",
                             *extra, *overrides])
    from .preflight import InputError, input_problems

    # the model only (a generation config names no data), spoken of as this function's argument
    problems = input_problems(cfg, data=False, reward=False)
    if problems:
        raise InputError([line.replace("actor_rollout_ref.model.path: ", "model ", 1) for line in problems])
    chosen = plan(cfg, check_inputs=False)
    model_cfg = cfg.actor_rollout_ref.model  # --overrides: trust_remote_code, gguf_file, override_config as in a run
    source, tokenizer = build_tokenizer(cfg)  # model.tokenizer_path / data.tokenizer as in a run, else the model's
    hf_model = load_causal_lm(source, chosen, model_cfg.trust_remote_code,
                              model_cfg.override_config).to(chosen.device).eval()
    chosen.rollout = dataclasses.replace(chosen.rollout, rows_per_wave=batch_size)  # generation only: no training
    engine = make_engine(hf_model, tokenizer, chosen, engine=chosen.rollout.engine)
    return LoadedModel(hf_model, tokenizer, chosen, engine, cfg.data.max_prompt_length)


def _loaded(model, **kwargs) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model
    if isinstance(model, TrainResult):
        model = model.trainer if model.trainer is not None else model.final_model
    if hasattr(model, "engine") and hasattr(model, "actor"):  # an RLTrainer: generate with its current policy
        return LoadedModel(model.actor, model.tokenizer, model.plan, model.engine, model.cfg.data.max_prompt_length)
    return load_model(str(model), **kwargs)


def evaluate(model, data: str, max_samples: int = -1, max_new_tokens: int = 256, batch_size: int = 64,
             overrides: Sequence[str] = (), progress: bool = True) -> dict:
    """Greedy accuracy, format rate and mean reward of `model` (a path, a LoadedModel, a TrainResult) on a
    verl-schema parquet file, scored by the reward for each row's data_source, or by your function when `overrides`
    name one (custom_reward_function.path=FILE, as in training); the overrides' data.prompt_key,
    data.reward_fn_key, data.apply_chat_template_kwargs and rollout stop strings are honoured as in a run. What
    `rlanywhere eval` prints."""
    import torch
    from tqdm.auto import tqdm

    from .config import as_list
    from .data import RLDataset
    from .data.loader import chat_template_kwargs
    from .preflight import InputError, data_file_problems
    from .rewards import REWARD_FUNCTIONS, RewardManager, custom_reward_from_config
    from .rollout.base import SamplingParams

    cfg = make_config(None, list(overrides))
    custom = custom_reward_from_config(cfg.custom_reward_function)
    data_cfg = cfg.data
    unscored = [key for key, on in (("actor_rollout_ref.rollout.multi_turn.enable",
                                     cfg.actor_rollout_ref.rollout.multi_turn.enable),
                                    ("reward_model.enable", cfg.reward_model.enable)) if on]
    if unscored:  # evaluate answers in one turn, scored by the rule or your function: it would quietly differ
        raise InputError([f"{key}=true: evaluate answers each prompt in one turn and scores it with the rule or "
                          "custom reward function; evaluate multi-turn or reward-model runs with trainer.val_only=true "
                          "and the run's config (rlanywhere train CONFIG trainer.val_only=true)" for key in unscored])
    problems = data_file_problems(str(data), "--data", data_cfg.prompt_key, data_cfg.reward_fn_key,
                                  scorers=None if custom else set(REWARD_FUNCTIONS))  # before the model loads
    if problems:
        raise InputError(problems)
    loaded = _loaded(model, max_new_tokens=max_new_tokens, batch_size=batch_size, overrides=overrides)
    # every row is scored: one over the model's prompt length keeps its end (where the question is), and the result
    # counts them in the file (prompts_cut; dropping them would score each model on another subset)
    dataset = RLDataset([data], loaded.tokenizer, loaded.max_prompt_length, prompt_key=data_cfg.prompt_key,
                        filter_overlong_prompts=False, truncation="left", reward_fn_key=data_cfg.reward_fn_key,
                        chat_template_kwargs=chat_template_kwargs(data_cfg))
    count = len(dataset) if max_samples <= 0 else min(max_samples, len(dataset))
    items = [dataset[i] for i in range(count)]
    manager = RewardManager(custom)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0,
                            stop_strings=tuple(as_list(cfg.actor_rollout_ref.rollout.stop)))
    accs, formats, rewards, errors, acc_returned = [], [], [], 0, 0
    start = time.time()
    with tqdm(total=count, desc="eval", unit="prompt", disable=not progress) as bar:
        for begin in range(0, count, batch_size):
            part = items[begin:begin + batch_size]
            with torch.no_grad():
                out = loaded.engine.generate([it["input_ids"] for it in part], params)
            scores, info = manager(out.decode(loaded.tokenizer), [it["ground_truth"] for it in part],
                                   [it["data_source"] for it in part], [it["extra_info"] for it in part])
            accs += info["acc"]
            formats += info["format"]
            rewards += [float(score) for score in scores]
            errors += info["num_errors"]
            acc_returned += info.get("acc_returned", 0)
            bar.update(len(part))
    return {"model": str(model) if isinstance(model, (str, os.PathLike)) else type(model).__name__, "data": data,
            "num_samples": count, "prompts_cut": dataset.num_truncated,
            # null where the reward returns no `acc` (a function returning a number): `reward` is its measure
            "accuracy": sum(accs) / max(count, 1) if acc_returned else None,
            "format_rate": sum(formats) / max(count, 1), "reward": sum(rewards) / max(count, 1),
            "reward_errors": errors, "seconds": round(time.time() - start, 1)}


def generate(model, prompts: Iterable[Union[str, list]], max_new_tokens: int = 128, temperature: float = 0.0,
             n: int = 1, overrides: Sequence[str] = ()) -> list[str]:
    """Responses of `model` (a path, a LoadedModel, a TrainResult, an RLTrainer) to `prompts`: each a user
    message (str) or a list of {"role", "content"} messages, chat template applied. Greedy unless temperature > 0;
    n responses per prompt, prompt-major."""
    import torch

    from .data import render_prompt, tokenize_rendered
    from .rollout.base import SamplingParams

    loaded = _loaded(model, max_new_tokens=max_new_tokens, overrides=overrides)
    texts = [render_prompt(loaded.tokenizer, [{"role": "user", "content": p}] if isinstance(p, str) else list(p))
             for p in prompts]
    with torch.no_grad():
        out = loaded.engine.generate(tokenize_rendered(loaded.tokenizer, texts),
                                     SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=n))
    return [text.strip() for text in out.decode(loaded.tokenizer)]


__all__ = ["make_config", "demo_config", "demo_profile", "plan", "train", "TrainResult", "evaluate", "generate",
           "load_model", "LoadedModel"]
