"""Checks of every input a run names, made before a model loads, reported together.

A run that fails on its data file after a minute of planning and loading, or on the second of three problems after
the first was fixed, wastes the user's time. `input_problems(cfg)` reads what the config points at — the data
files (they exist, parse as parquet, have rows, the columns the run reads and no blank prompt), the model (a local
path exists and holds a model; custom code is allowed only with trust_remote_code; a hub id is in the local cache
or the hub can be reached), the reward function (the file imports and has the function) and the values no other
check covers (learning rates) — and returns one line per problem. `require_inputs(cfg)` raises `InputError` with
all of them; the command line prints each as its own `error:` line and exits 2.

Nothing here loads weights or a tokenizer; a hub id costs at most a cache lookup and a short connection attempt.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

from .errors import UserError

# How long the hub may take to accept a connection before we call it unreachable (seconds)
HUB_CONNECT_TIMEOUT_S = 4.0


class InputError(UserError):
    """One or more inputs of a run are unusable; `problems` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        # the CLI prints "error: <message>": every further problem gets its own "error:" line too
        super().__init__("\nerror: ".join(self.problems))


# ---------------------------------------------------------------------------------------------- data files
def _data_paths(value: Any) -> list[str]:
    from .config import as_list
    from .data.loader import _as_path_list

    items = as_list(value)
    paths: list[str] = []
    for item in items:
        paths += [str(p) for p in _as_path_list(str(item))]
    return paths


def _demo_data_to_write(path: str) -> bool:
    """The demo's arithmetic files are written by the run itself when missing (api.ensure_demo_data)."""
    from .demo_runs import demo_data_dir

    return any(path in (f"{demo_data_dir(gpu)}/train.parquet", f"{demo_data_dir(gpu)}/test.parquet")
               for gpu in (True, False))


def _blank_prompt(prompt: Any) -> bool:
    if prompt is None:
        return True
    if isinstance(prompt, str):
        return not prompt.strip()
    try:
        return not any(str((message or {}).get("content") or "").strip() for message in prompt)
    except (TypeError, AttributeError):
        return False  # an unusual prompt shape: the dataset's own checks speak of it


def data_file_problems(path: str, key: str, prompt_key: str, reward_fn_key: str, answers: bool = True,
                       scorers: set[str] | None = None) -> list[str]:
    """What is wrong with one data file of `key` (data.train_files / data.val_files), one line each. answers: every
    row needs reward_model.ground_truth (not when a reward model scores); scorers: the reward functions that exist
    for the `reward_fn_key` column's values (None: a custom reward function scores every row)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    file = Path(path).expanduser()
    if not file.exists():
        if _demo_data_to_write(path):
            return []
        from .vocabulary import PREPARE_TASKS

        return [f"{key}: {path} does not exist. Create it with `rlanywhere prepare {'|'.join(PREPARE_TASKS)} --out "
                f"DIR` (the task your config was written for), or point {key} at an existing parquet file"]
    if not file.is_file():
        return [f"{key}: {path} is a directory, not a parquet file; name the file (e.g. {path}/train.parquet)"]
    try:
        table = pq.read_table(file)
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        return [f"{key}: {path} is not a readable parquet file ({first}). Convert your file with `rlanywhere prepare "
                f"generic --src {path} --prompt-key COL --answer-key COL --out DIR`"]
    if table.num_rows == 0:
        return [f"{key}: {path} has no rows. Re-create it with `rlanywhere prepare ...`, or point {key} at a file "
                "with prompts"]
    columns = set(table.column_names)
    needed = [(prompt_key, "data.prompt_key"), (reward_fn_key, "data.reward_fn_key")]
    if answers:
        needed.insert(1, ("reward_model", None))
    missing = [name for name, _ in needed if name not in columns]
    if missing:
        keys = [setting for name, setting in needed if name in missing and setting]
        hint = f"set {' / '.join(keys)} to the right column, or " if keys else ""
        return [f"{key}: {path} has no column(s) {missing} (its columns: {sorted(columns)}); {hint}re-create the "
                "file with `rlanywhere prepare ...`"]
    problems = []
    prompts = table.column(prompt_key).to_pylist()
    blank = [index for index, prompt in enumerate(prompts) if _blank_prompt(prompt)]
    if blank:
        shown = ", ".join(str(i) for i in blank[:5]) + (", ..." if len(blank) > 5 else "")
        problems.append(f"{key}: {path} has {len(blank)} blank prompt(s) (row {shown}, 0-based); remove those rows "
                        "or give them a question")
    if answers:
        truths = table.column("reward_model").to_pylist()
        no_answer = [i for i, value in enumerate(truths)
                     if not isinstance(value, dict) or value.get("ground_truth") is None
                     or not str(value.get("ground_truth")).strip()]
        if no_answer:
            shown = ", ".join(str(i) for i in no_answer[:5]) + (", ..." if len(no_answer) > 5 else "")
            problems.append(f"{key}: {path} has {len(no_answer)} row(s) without reward_model.ground_truth (row "
                            f"{shown}, 0-based); the reward needs the answer of every prompt")
    if scorers is not None:
        unknown = sorted({str(value) for value in table.column(reward_fn_key).to_pylist()} - scorers)
        if unknown:
            problems.append(f"{key}: {path} has rows whose {reward_fn_key} ({', '.join(map(repr, unknown[:5]))}) "
                            f"no built-in reward scores (built in: {', '.join(sorted(scorers))}); point "
                            "custom_reward_function.path at your scoring function, register one with "
                            "rlanywhere.rewards.register_reward, or set reward_model.enable=true")
    return problems


def data_problems(cfg) -> list[str]:
    from .reward_model import rows_need_answers
    from .rewards import REWARD_FUNCTIONS

    problems = []
    answers = rows_need_answers(cfg)  # a reward model scores without them (verl's naive manager), a rule not
    # without a custom function or a reward model, each row's data_source must have a built-in rule
    scorers = None if cfg.custom_reward_function.path or cfg.reward_model.enable else set(REWARD_FUNCTIONS)
    for key in ("data.train_files", "data.val_files"):
        value = cfg.data.train_files if key == "data.train_files" else cfg.data.val_files
        try:
            paths = _data_paths(value)
        except (ValueError, SyntaxError) as exc:
            problems.append(f"{key}={value!r} is not a file or a list of files ({exc})")
            continue
        if key == "data.train_files" and not paths:
            problems.append("data.train_files is empty: name the training parquet file(s)")
        for path in paths:
            problems += data_file_problems(path, key, cfg.data.prompt_key, cfg.data.reward_fn_key, answers,
                                           scorers)
    return problems


# ---------------------------------------------------------------------------------------------- model
def _hub_host() -> str:
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    return urlparse(endpoint).hostname or "huggingface.co"


def hub_reachable(timeout_s: float = HUB_CONNECT_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub opens within `timeout_s` (name lookup included): no retries, no waiting
    out a library's backoff."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    result: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((_hub_host(), 443), timeout=timeout_s).close()
            result.append(True)
        except OSError:
            result.append(False)

    worker = threading.Thread(target=connect, daemon=True)
    worker.start()
    worker.join(timeout_s + 0.5)  # the name lookup has no timeout of its own
    return bool(result and result[0])


def _hub_config_cached(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - a malformed id: the loader's own error names it
        return False


def _custom_code_problem(directory: Path, key: str, trust_key: str) -> Optional[str]:
    """A model folder whose config.json needs its own Python code (auto_map, a model_type transformers lacks)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{key}: {directory}/config.json cannot be read ({exc}); copy a valid config.json there"
    if not isinstance(config, dict) or "auto_map" not in config:
        return None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config.get("model_type") in CONFIG_MAPPING:
        return None  # transformers has the architecture itself: the folder's code is not needed
    files = sorted({str(v).split(".")[0] + ".py" for v in dict(config["auto_map"]).values() if isinstance(v, str)})
    return (f"{key}: {directory} runs its own Python code ({', '.join(files) or 'auto_map in config.json'}, model type "
            f"{config.get('model_type')!r}); read that code, then allow it with {trust_key}=true")


def model_problems(path: Optional[str], key: str, trust_remote_code: bool, trust_key: str,
                   gguf_file: Optional[str] = None, named_shape_ok: bool = False) -> list[str]:
    """What keeps the model at `path` from loading, one line each ([] when it will load as far as we can tell
    without reading weights). named_shape_ok: a hub id with a shape known offline is enough (planning only)."""
    from .models import DEMO_MODEL, WEIGHT_FILES

    if not path:
        return []
    path = str(path)
    if path == DEMO_MODEL:
        return []  # fetched on first use, with its own one-line error when that fails
    local = Path(path).expanduser()
    if local.suffix == ".gguf":
        return [] if local.is_file() else [f"{key}: the model file {path} does not exist"]
    if local.is_dir():
        if gguf_file and not (local / gguf_file).is_file():  # with or without a config.json beside it
            return [f"{key}: {path} has no {gguf_file} (actor_rollout_ref.model.gguf_file)"]
        if not (local / "config.json").is_file():
            ggufs = sorted(local.glob("*.gguf"))
            if ggufs or gguf_file:
                return []
            if (local / "actor" / "config.json").is_file():  # a checkpoint: its actor/ holds the model
                return [f"{key}: {path} is a checkpoint; its model is in {local / 'actor'}"]
            if (local / "adapter_config.json").is_file():
                return [(f"{key}: {path} holds LoRA adapters only; point at the merged model (a checkpoint's "
                         "actor/ or the run's final_model/)")]
            return [f"{key}: {path} has no config.json and no .gguf file: it is not a model folder. Point it at a "
                    "Hugging Face model folder (a run's final_model/), a .gguf file or a hub id"]
        problem = _custom_code_problem(local, key, trust_key) if not trust_remote_code else None
        if problem:
            return [problem]
        if not gguf_file and not any(any(local.glob(pattern)) for pattern in WEIGHT_FILES):  # else the GGUF's
            return [f"{key}: {path} has a config.json but no weights (model.safetensors or pytorch_model.bin); copy "
                    "the weight files there or point at the full model folder"]
        return []
    if named_shape_ok:
        from .model_shape import NAMED_SHAPES, _normalise_model_name

        if _normalise_model_name(path) in NAMED_SHAPES:
            return []
    looks_like_hub_id = len(path.split("/")) == 2 and all(path.split("/")) and not path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        if "latest" in Path(path).parts:
            return [f"{key}: {path} does not exist: a demo's `latest` appears once a demo has saved its final model "
                    "(run `rlanywhere demo`, or `rlanywhere demo --resume` to finish a stopped one)"]
        return [f"{key}: {path} does not exist (give a local model folder, a .gguf file, a hub id like "
                "Qwen/Qwen2.5-0.5B-Instruct, or smollm2-135m-instruct)"]
    if _hub_config_cached(path) or hub_reachable():
        return []
    return [f"{key}: {path} is not in the local Hugging Face cache and the hub cannot be reached from here; "
            f"download it where there is network (`hf download {path}`) and copy the cache "
            f"(~/.cache/huggingface) or the model folder here, then set {key} to that folder"]


def run_model_problems(cfg, planning_only: bool = False) -> list[str]:
    model = cfg.actor_rollout_ref.model
    problems = model_problems(model.path, "actor_rollout_ref.model.path", bool(model.trust_remote_code),
                              "actor_rollout_ref.model.trust_remote_code", model.gguf_file,
                              named_shape_ok=planning_only)
    critic = cfg.critic.model
    if cfg.algorithm.adv_estimator == "gae" and critic.path and str(critic.path) != str(model.path):
        problems += model_problems(critic.path, "critic.model.path", bool(critic.trust_remote_code),
                                   "critic.model.trust_remote_code", critic.gguf_file, named_shape_ok=planning_only)
    scorer = cfg.reward_model.model
    if cfg.reward_model.enable and scorer.path:  # a reward model or judge: read before anything loads, as the actor
        problems += model_problems(scorer.path, "reward_model.model.path", bool(scorer.trust_remote_code),
                                   "reward_model.model.trust_remote_code", named_shape_ok=planning_only)
    tokenizer = model.tokenizer_path or cfg.data.get("tokenizer")
    if tokenizer and str(tokenizer).startswith((".", "/", "~")) and not Path(str(tokenizer)).expanduser().exists():
        problems.append(f"actor_rollout_ref.model.tokenizer_path: {tokenizer} does not exist")
    return problems


# ---------------------------------------------------------------------------------------------- reward, values
def reward_problems(cfg) -> list[str]:
    custom = cfg.custom_reward_function
    if not custom.path:
        return []
    from .rewards import custom_reward_from_config

    try:
        custom_reward_from_config(custom)
    except Exception as exc:  # noqa: BLE001 - the user's file may raise anything while it is imported
        first = (str(exc).splitlines() or [""])[0][:200]
        return [f"custom_reward_function: {first or type(exc).__name__}" if isinstance(exc, (UserError, ImportError,
                FileNotFoundError, AttributeError)) else
                f"custom_reward_function.path={custom.path}: importing it raised {type(exc).__name__}: {first}"]
    return []


def value_problems(cfg) -> list[str]:
    problems = []
    keys = ["actor_rollout_ref.actor.optim.lr"] + (["critic.optim.lr"] if cfg.algorithm.adv_estimator == "gae" else [])
    for key in keys:
        from omegaconf import OmegaConf

        lr = OmegaConf.select(cfg, key)
        if lr is None or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            problems.append(f"{key}={lr} must be a positive number (the profiles use 1e-6 to 1e-5 for full "
                            "fine-tuning)")
    from .runfaults import check_run_names

    try:
        check_run_names(cfg)  # a run folder outside the runs folder
    except UserError as err:
        problems.append(str(err))
    return problems


# ---------------------------------------------------------------------------------------------- all of it
def input_problems(cfg, data: bool = True, model: bool = True, reward: bool = True,
                   planning_only: bool = False) -> list[str]:
    """Every problem with the inputs `cfg` names, one line each, in the order data, model, reward, values."""
    problems = data_problems(cfg) if data else []
    if model:
        problems += run_model_problems(cfg, planning_only)
    if reward:
        problems += reward_problems(cfg) + tool_problems(cfg)
    return problems + value_problems(cfg)


def tool_problems(cfg) -> list[str]:
    """Multi-turn rollouts: the tool config loads and every tool in it can be built (class names, configs)."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    if not mt.enable or not mt.tool_config_path:
        return []
    from .tools.registry import load_tool_config

    try:
        load_tool_config(mt.tool_config_path)
    except UserError as err:
        return [str(err)]
    return []


def with_input_problems(error, **what):
    """A configuration's problems (a ConfigError from load_config) and those of the inputs it names, in one answer:
    the inputs are checked on the configuration without its faulty keys (`error.partial`). The error as it was
    when there is nothing more to say."""
    if getattr(error, "partial", None) is None or not error.problems:
        return error
    try:
        more = [problem for problem in input_problems(error.partial, **what) if problem not in error.problems]
    except Exception:  # noqa: BLE001 - a configuration with faulty keys left out may not hold together
        return error
    return InputError(list(error.problems) + more) if more else error


def require_inputs(cfg, **what) -> None:
    """Raise InputError listing every problem `input_problems(cfg, **what)` finds."""
    problems = input_problems(cfg, **what)
    if problems:
        raise InputError(problems)
