"""The rest of verl's configuration surface, so that verl's own example command lines run here unchanged.

config.py owns the schema; this module holds what only exists to meet verl where it is:

* `CURRENT_VERL_KEYS`: keys of current verl's schema (Ray, Megatron, FSDP2, profilers, ...) that have no meaning in a
  single-process trainer, each with the one notice line that says what happens instead;
* `translate_verl_spellings`: verl's other spellings of keys that do have a meaning here (DAPO's
  `reward_kwargs.overlong_buffer_cfg`), moved onto our keys with a notice (`critic.fsdp.*` offload switches are
  honoured like `critic.model.fsdp_config.*`, config.OFFLOAD_TRANSLATIONS);
* `reference_offload_notice`: `actor_rollout_ref.ref.fsdp_config.param_offload` offloads the reference alone;
* `verl_runtime_problems`: what verl would find only once its workers start (a logger that is not installed, a
  sandbox URL that does not answer), checked while the configuration is read, before any model loads;
* `hydra_config_layer`: Hydra's `--config-path/--config-name` with a YAML whose `defaults` names verl's trainer
  config;
* `fit_world_to_machine`: `trainer.n_gpus_per_node` / `nnodes` larger than this machine, planned for what exists.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from typing import Any, Callable, Optional
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from .errors import UserError

# verl's reward managers -> what scores here. naive/batch: the rule or custom function per response; dapo: the same
# plus the overlong penalty (reward_model.overlong_buffer); prime: verl's parallel scoring, which the reward pool
# does for every manager here (custom functions run in worker processes with a time limit).
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime")

_NO_RAY = "no Ray here: one process, or torchrun for several GPUs"
_NO_MEGATRON = "no Megatron here: the trainer runs the model through transformers, sharding is planned"
_PLANNED_KERNELS = "not needed: the training kernels are planned for the card"
_NOT_PROFILED = "the profiler is trainer.profile_steps here (torch.profiler of the steps you name)"

# Keys of current verl's schema (January 2026) without a meaning here -> what happens instead. Matched as regex over
# the dotted key; a match is dropped after one notice line.
CURRENT_VERL_KEYS: dict[str, str] = {
    r"(.*\.)?_target_": "verl's Hydra class to instantiate: the section is read into rlanywhere's own config",
    r"actor_rollout_ref\.(actor|ref)\.(rollout_n|data_loader_seed)": "set by verl's trainer from rollout.n and "
    "data.seed; here they are read from those keys directly",
    r"actor_rollout_ref\.ref\.(strategy|entropy_from_logits_with_chunking|entropy_checkpointing)": "the reference "
    "follows the actor's planned data parallelism and passes",
    r"actor_rollout_ref\.actor\.(tau_pos|tau_neg)": "used by verl's loss_mode=sapo, not available here",
    r"actor_rollout_ref\.actor\.(calculate_entropy|calculate_sum_pi_squared|sum_pi_squared_checkpointing)":
    "entropy is computed in every update (actor/entropy) and in the loss when entropy_coeff is set",
    r"actor_rollout_ref\.rollout\.(logprobs_mode|scheduling_policy|skip_tokenizer_init|quantization_config_file"
    r"|mtp(\..*)?)": "the built-in engine returns the log-probs of the distribution it samples from "
    "(temperature applied), tokenizes itself and schedules its own waves",
    r"actor_rollout_ref\.rollout\.multi_turn\.num_repeat_rollouts": "multi-turn rows are sampled rollout.n times "
    "per prompt, as single-turn ones",
    r"critic\.model\.enable_activation_offload": "the plan decides checkpointing and offload for actor and critic",
    r"data\.(image_patch_size)": "text-only prompts are read from parquet directly",
    r"data\.validation_shuffle": "validation scores every prompt it takes; their order does not change the metrics",
    r"reward_manager(\..*)?": "the reward manager is chosen by reward_model.reward_manager / custom_reward_function",
    r"ray_kwargs(\..*)?": _NO_RAY,
    r"critic\.fsdp(\..*)?": "sharding is planned (hardware.data_parallel); offload by hardware.param_offload / "
    "hardware.optimizer_offload",
    r"(actor_rollout_ref\.(actor|ref|rollout|model)|critic(\.model)?)\.megatron(\..*)?": _NO_MEGATRON,
    r"actor_rollout_ref\.model\.torch_dtype|critic\.model\.torch_dtype": "the planner picks the training dtype for "
    "the card (hardware.precision forces one); weights train with fp32 master copies where the card needs them",
    r"actor_rollout_ref\.actor\.(entropy_checkpointing|entropy_from_logits_with_chunking)": "entropy is computed in "
    "chunks from the final hidden states, never from full-vocabulary logits, so it needs no checkpointing",
    r"actor_rollout_ref\.actor\.(fsdp_size|fsdp_config(\..*)?)": "sharding is planned (hardware.data_parallel, "
    "hardware.shard_group_size)",
    r"actor_rollout_ref\.(actor|ref)\.(ulysses_sequence_parallel_size|use_fused_kernels|use_dynamic_bsz_balance"
    r"|router_replay(\..*)?|profiler(\..*)?|grad_norm_threshold)": _PLANNED_KERNELS,
    r"actor_rollout_ref\.actor\.(use_prefix_grouper|tis_imp_ratio_cap|freeze_vision_tower|policy_loss\.(clip_cov|kl_cov"
    r"|ppo_kl_coef|clip_cov_ratio|clip_cov_lb|clip_cov_ub|kl_cov_ratio)(\..*)?|clip_ratio_dual)":
    "used only by loss modes and options not selected here",
    r"actor_rollout_ref\.actor\.optim\.(clip_grad|num_cycles|warmup_style_kw.*"
    r"|override_optimizer_config(\..*)?|optimizer|optimizer_impl|lr_decay_style|lr_decay_steps|min_lr"
    r"|weight_decay_incr_style|lr_warmup_init|use_checkpoint_opt_param_scheduler)":
    "AdamW with the warm-up and schedule of optim.lr_scheduler_type / lr_warmup_steps(_ratio); gradients clipped by "
    "actor.grad_clip",
    r"critic\.optim\.(clip_grad|num_cycles|override_optimizer_config(\..*)?|optimizer"
    r"|optimizer_impl)": "AdamW with the warm-up and schedule of critic.optim.lr_scheduler_type; gradients clipped by "
    "critic.grad_clip",
    r"actor_rollout_ref\.rollout\.(multi_stage_wake_up|update_weights_bucket_megabytes|skip_rollout|skip_dump_dir"
    r"|skip_use_default_dir|enable_prefix_caching|cudagraph_capture_sizes|over_sample_rate|max_num_batched_tokens"
    r"|trace(\..*)?|server(\..*)?|prometheus(\..*)?|quantization|checkpoint_engine(\..*)?|expert_parallel_size"
    r"|data_parallel_size|pipeline_model_parallel_size|do_sample_val|limit_images|val_kwargs\.(repetition_penalty)"
    r"|repetition_penalty|enable_rollout_routing_replay|profiler(\..*)?|nnodes|n_gpus_per_node|free_cache_engine_mode"
    r"|load_format|layer_name_map(\..*)?|enable_sleep_mode|sglang_rollout_mode|agent(\..*)?|custom(\..*)?"
    r"|engine_kwargs(\..*)?)": "the built-in rollout engine plans its cache, batches and kernels itself",
    r"actor_rollout_ref\.(nccl_timeout|rollout\.update_weights_bucket_megabytes)": "actor and rollout share weights "
    "in one process: nothing is sent between them",
    r"actor_rollout_ref\.model\.(custom_chat_template|use_fused_kernels"
    r"|fused_kernel_options(\..*)?|mtp(\..*)?|hf_config_path|tiled_mlp(\..*)?)":
    "not used: models load through transformers with their own chat template",
    r"critic\.(model\.(tiled_mlp(\..*)?)|enable|profiler(\..*)?"
    r"|data_loader_seed|use_dynamic_bsz_balance|nccl_timeout)": "the critic exists exactly when the advantage "
    "estimator needs one (the plan says so)",
    r"reward_model\.(reward_loop_source|reward_loop_module_path|reward_loop_class_name|num_workers|use_reward_loop"
    r"|enable_resource_pool|n_gpus_per_node|nnodes|profiler(\..*)?|rollout(\..*)?)": "rewards are scored by the "
    "reward pool in this process's workers",
    r"reward_model\.reward_kwargs(\..*)?": "extra arguments of verl's reward managers: the rule or custom function "
    "is called with the response, the ground truth, the data source and extra_info",
    r"algorithm\.kl_ctrl\.(.*_kwargs.*)": "the KL controllers take kl_coef, target_kl and horizon",
    r"trainer\.(balance_batch_mode|ray_wait_register_center_timeout|device_mesh.*|npu_profile(\..*)?"
    r"|profile_continuous_steps|controller_nsight_options(\..*)?|worker_nsight_options(\..*)?"
    r"|log_val_generations_freq|val_generations_to_log_to_wandb|remove_previous_ckpt_in_save|remove_clip"
    r"|use_legacy_worker_impl|resume_from_path_mode|hdfs_dir|max_ckpt_to_keep|test_freq_type|save_freq_type"
    r"|validation_data_dir|rollout_data_dir)": "not used by this trainer (checkpoints, validation and logging are "
    "set by save_freq, test_freq, default_local_dir and logger)",
    r"global_profiler(\..*)?|transfer_queue(\..*)?|data_transfer(\..*)?": _NOT_PROFILED,
    r"data\.(tool_config_path|max_samples|seed_for_shuffle|datagen(\..*)?"
    r"|prompt_key_for_rm|multi_modal_keys)": "prompts are read from parquet and rendered with the tokenizer's chat "
    "template",
    r"actor_rollout_ref\.actor\.checkpoint(\..*)?|critic\.checkpoint(\..*)?": "checkpoints hold the model, optimizer, "
    "scheduler and RNG state together (trainer.save_freq)",
    r"actor_rollout_ref\.actor\.(ppo_infer_micro_batch_size_per_gpu|ppo_infer_max_token_len_per_gpu)":
    "log-prob passes use the planned micro-batch or the actor's token budget",
    r"hydra(\..*)?": "Hydra's own settings: --config-path/--config-name are read directly",
}


def pop_key(cfg: DictConfig, dotted: str) -> Any:
    """Remove a dotted key from `cfg` and return its value; parents it leaves empty go too, so that they neither
    shadow the schema's defaults nor read as keys of their own."""
    parts = dotted.split(".")
    node = cfg
    for part in parts[:-1]:
        node = node[part]
    value = node[parts[-1]]
    del node[parts[-1]]
    for depth in range(len(parts) - 1, 0, -1):
        parent = OmegaConf.select(cfg, ".".join(parts[: depth - 1])) if depth > 1 else cfg
        child = parts[depth - 1]
        if isinstance(parent[child], DictConfig) and len(parent[child]) == 0:
            del parent[child]
        else:
            break
    return value


def translate_verl_spellings(user: DictConfig, notices: list[str], problems: list[str]) -> DictConfig:
    """verl's other spellings of keys we implement, moved onto ours (with a notice):

    * DAPO (verl's recipe): `reward_model.reward_kwargs.overlong_buffer_cfg.{enable,len,penalty_factor}` ->
      `reward_model.overlong_buffer.*` (`log`: the penalty is always logged); `reward_kwargs.max_resp_len` is the
      length the penalty counts to, which here is the response length limit;

    * verl 0.6's top-level rollout correction (`algorithm.rollout_is`, `rollout_is_level`, `rollout_is_threshold`):
      onto `algorithm.rollout_correction.*`; its other switches are refused when set (they have no counterpart);

    * verl's agent loops (`rollout.agent.default_agent_loop=tool_agent`): multi-turn rollouts with tools.

    A `reward_model.sandbox_fusion.url` that does not answer is added to `problems` now, before any model loads."""
    _translate_old_rollout_correction(user, notices, problems)
    _adopt_agent_loop(user, notices, problems)
    for model_key in ("actor_rollout_ref.model", "critic.model"):
        _adopt_lora_adapter(user, model_key, notices, problems)
    url = OmegaConf.select(user, "reward_model.sandbox_fusion.url")
    if url:
        problem = sandbox_url_problem(url)
        if problem:
            problems.append(problem)
    kwargs = OmegaConf.select(user, "reward_model.reward_kwargs")
    if isinstance(kwargs, DictConfig):
        buffer = kwargs.get("overlong_buffer_cfg")
        if isinstance(buffer, DictConfig):
            for leaf in list(buffer.keys()):
                value = buffer[leaf]
                if leaf in ("enable", "len", "penalty_factor"):
                    OmegaConf.update(user, f"reward_model.overlong_buffer.{leaf}", value, force_add=True)
                    notices.append(f"reward_model.reward_kwargs.overlong_buffer_cfg.{leaf}={value}: DAPO's overlong "
                                   f"penalty, honoured as reward_model.overlong_buffer.{leaf}={value}")
                else:
                    notices.append(f"reward_model.reward_kwargs.overlong_buffer_cfg.{leaf}={value}: not needed "
                                   "(the overlong penalty is always logged as reward/overlong_penalty)")
            pop_key(user, "reward_model.reward_kwargs.overlong_buffer_cfg")
        if "max_resp_len" in kwargs:
            value = pop_key(user, "reward_model.reward_kwargs.max_resp_len")  # reward_model goes too if left empty
            notices.append(f"reward_model.reward_kwargs.max_resp_len={value}: the overlong penalty counts to the "
                           "response length limit (actor_rollout_ref.rollout.response_length, else "
                           "data.max_response_length)")
    return user


AGENT_LOOP = "actor_rollout_ref.rollout.agent"


def _adopt_agent_loop(user: DictConfig, notices: list[str], problems: list[str]) -> None:
    """verl's agent loops: `agent.default_agent_loop=tool_agent` runs every row as a tool-using conversation, which is
    `rollout.multi_turn.enable=true` here; `single_turn_agent` (verl's default) is a single-turn rollout. Other loops,
    custom ones (`agent_loop_config_path`) among them, are refused: each row would run as something it is not."""
    loop = OmegaConf.select(user, f"{AGENT_LOOP}.default_agent_loop")
    if loop is not None:
        pop_key(user, f"{AGENT_LOOP}.default_agent_loop")
        given = f"{AGENT_LOOP}.default_agent_loop={loop}"
        enabled = OmegaConf.select(user, "actor_rollout_ref.rollout.multi_turn.enable")
        if loop == "tool_agent" and enabled is None:
            OmegaConf.update(user, "actor_rollout_ref.rollout.multi_turn.enable", True, force_add=True)
            notices.append(f"{given}: verl's tool agent loop; honoured as actor_rollout_ref.rollout.multi_turn."
                           "enable=true (the tools of multi_turn.tool_config_path)")
        elif loop in ("tool_agent", "single_turn_agent"):
            notices.append(f"{given}: actor_rollout_ref.rollout.multi_turn.enable decides here "
                           f"(multi_turn.enable={bool(enabled)})")
        else:
            problems.append(f"{given}: that agent loop is not available here; tool_agent (multi-turn rollouts with "
                            "tools: actor_rollout_ref.rollout.multi_turn) and single_turn_agent are")
    custom = OmegaConf.select(user, f"{AGENT_LOOP}.agent_loop_config_path")
    if custom is not None:
        pop_key(user, f"{AGENT_LOOP}.agent_loop_config_path")
        problems.append(f"{AGENT_LOOP}.agent_loop_config_path={custom}: custom agent loops are not available here; "
                        "multi-turn rollouts with tools are (actor_rollout_ref.rollout.multi_turn, docs/multi-turn.md)")


def _adopt_lora_adapter(user: DictConfig, model_key: str, notices: list[str], problems: list[str]) -> None:
    """verl's `<model>.lora_adapter_path`: training starts from that peft adapter, whose rank, alpha and target
    modules are the run's (LoRA is on even with lora_rank 0, as in verl); builders.py loads its weights."""
    path = OmegaConf.select(user, f"{model_key}.lora_adapter_path")
    if not path:
        return
    config_file = os.path.join(os.path.expanduser(str(path)), "adapter_config.json")
    try:
        with open(config_file) as handle:
            adapter = json.load(handle)
    except (OSError, ValueError) as err:
        problems.append(f"{model_key}.lora_adapter_path={path}: no readable adapter_config.json there ({err}); "
                        "give a folder a peft adapter was saved in (adapter_config.json, adapter_model.safetensors)")
        return
    settings = {"lora_rank": adapter.get("r"), "lora_alpha": adapter.get("lora_alpha"),
                "target_modules": adapter.get("target_modules")}
    for leaf, value in settings.items():
        if value is not None:
            OmegaConf.update(user, f"{model_key}.{leaf}", value, force_add=True)
    notices.append(f"{model_key}.lora_adapter_path={path}: training starts from that adapter, with its lora_rank="
                   f"{settings['lora_rank']}, lora_alpha={settings['lora_alpha']} and target_modules="
                   f"{settings['target_modules']}")


_OLD_ROLLOUT_IS = ("rollout_is", "rollout_is_level", "rollout_is_threshold", "rollout_is_threshold_lower",
                   "rollout_is_mode", "rollout_is_veto_threshold", "rollout_token_veto_threshold", "bypass_mode")


def _translate_old_rollout_correction(user: DictConfig, notices: list[str], problems: list[str]) -> None:
    """verl 0.6's `algorithm.rollout_is*` keys: the switch and its level and threshold onto
    `algorithm.rollout_correction`; the rest refused when set (no counterpart here), noticed when off."""
    algorithm = user.get("algorithm") if isinstance(user, DictConfig) else None
    if not isinstance(algorithm, DictConfig) or not any(key in algorithm for key in _OLD_ROLLOUT_IS):
        return
    given = {key: algorithm[key] for key in _OLD_ROLLOUT_IS if key in algorithm}
    for key in given:
        del algorithm[key]
    if len(algorithm) == 0:  # an empty section would shadow the defaults
        del user["algorithm"]
    target = "algorithm.rollout_correction"
    if given.get("rollout_is") not in (None, False, "false", "False"):
        level = str(given.get("rollout_is_level") or "token")
        if level not in ("token", "sequence"):
            problems.append(f"algorithm.rollout_is_level={level}: only token and sequence weights are available "
                            f"({target}.rollout_is=token|sequence)")
        else:
            OmegaConf.update(user, f"{target}.rollout_is", level, force_add=True)
            notices.append(f"algorithm.rollout_is={given['rollout_is']}: verl 0.6's rollout correction, honoured as "
                           f"{target}.rollout_is={level}")
    if given.get("rollout_is_threshold") is not None:
        OmegaConf.update(user, f"{target}.rollout_is_threshold", given["rollout_is_threshold"], force_add=True)
        notices.append(f"algorithm.rollout_is_threshold={given['rollout_is_threshold']}: honoured as "
                       f"{target}.rollout_is_threshold")
    if given.get("bypass_mode") not in (None, False, "false", "False"):
        OmegaConf.update(user, f"{target}.bypass_mode", True, force_add=True)
        notices.append(f"algorithm.bypass_mode={given['bypass_mode']}: honoured as {target}.bypass_mode=true")
    for key in ("rollout_is_threshold_lower", "rollout_is_mode", "rollout_is_veto_threshold",
                "rollout_token_veto_threshold"):
        if given.get(key) not in (None, False):
            problems.append(f"algorithm.{key}={given[key]}: verl 0.6's rollout-correction option has no counterpart "
                            f"here (the weights are capped at {target}.rollout_is_threshold, docs/async.md); drop it")
        elif key in given:
            notices.append(f"algorithm.{key}={given[key]}: off, as here")
    if "rollout_is" in given and given["rollout_is"] in (None, False, "false", "False"):
        notices.append(f"algorithm.rollout_is={given['rollout_is']}: off, as here ({target}.rollout_is)")


def reference_offload_notice(user: DictConfig, key: str, value: Any) -> str:
    """`actor_rollout_ref.ref.fsdp_config.param_offload=True` keeps the reference model in CPU memory (it visits the
    device for its forward): the reference alone, as in verl; actor and critic offload stays the planner's. The
    reference has no optimizer, so its optimizer offload means nothing."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf == "optimizer_offload":
        return f"{key}={value}: no effect (the reference model has no optimizer)"
    if not bool(value):
        return f"{key}={value}: the planner places the reference model (hardware.ref_device=auto)"
    OmegaConf.update(user, "hardware.ref_device", "cpu", force_add=True)
    return (f"{key}={value}: honoured as hardware.ref_device=cpu (the reference model waits in CPU memory and visits "
            "the device for its forward); actor and critic offload stay planned")


EXTERNAL_LOGGERS = {"wandb": "wandb"}  # trainer.logger entry -> the package it needs
VERL_ONLY_LOGGERS = ("swanlab", "mlflow", "vemlp_wandb", "clearml", "trackio", "file")


def resolve_loggers(asked: list[str], installed=importlib.util.find_spec) -> tuple[list[str], list[str]]:
    """The loggers that will run and one notice per one that will not (its package absent, or verl-only): those
    runs log locally instead (metrics.jsonl always, and TensorBoard)."""
    kept, notices = [], []
    for name in asked:
        package = EXTERNAL_LOGGERS.get(name)
        if package is not None and installed(package) is None:
            notices.append(f"trainer.logger: {name} is not installed (pip install {package}); logging to TensorBoard "
                           "and metrics.jsonl in the run directory instead")
        elif name in VERL_ONLY_LOGGERS:
            notices.append(f"trainer.logger: {name} is not available here; logging to TensorBoard and metrics.jsonl "
                           "in the run directory instead")
        else:
            kept.append(name)
            continue
        if "tensorboard" not in kept and "tensorboard" not in asked:
            kept.append("tensorboard")
    return kept, notices


def sandbox_url_problem(url: str, timeout_s: float = 2.0) -> Optional[str]:
    """None when `url`'s host accepts a connection, else a sentence saying which URL did not answer and what to do."""
    parsed = urlparse(str(url))
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    if not host:
        return (f"reward_model.sandbox_fusion.url={url!r} is not a URL; give http(s)://HOST:PORT/run_code of a running "
                "sandbox, or drop the key to score with the rule reward")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as err:
        return (f"reward_model.sandbox_fusion.url={url!r} cannot be reached ({host}:{port}: {err.strerror or err}); "
                "start the sandbox or fix the URL, or drop the key to score with the rule reward")


def verl_runtime_problems(cfg: DictConfig, notices: list[str]) -> list[str]:
    """What verl finds only once its workers start, found now: loggers that are not installed (a notice, and local
    logging instead; a problem with hardware.require_loggers). (A sandbox URL that does not answer is found as the
    keys are read.)"""
    from .tracking import KNOWN_LOGGERS, logger_names, unknown_logger_problem

    asked = logger_names(cfg.trainer.logger)  # WandB and wandb: one
    unknown = [name for name in asked if name not in KNOWN_LOGGERS and name not in VERL_ONLY_LOGGERS]
    problems = [unknown_logger_problem(name) for name in unknown]
    kept, logger_notices = resolve_loggers([name for name in asked if name not in unknown])
    require = bool(cfg.hardware.require_loggers) if "hardware" in cfg else False
    if logger_notices and require:
        problems.extend(f"{line.split(';')[0]}, and hardware.require_loggers=true asks for a hard failure: install "
                        "it, or drop it from trainer.logger" for line in logger_notices)
    notices.extend([] if require else logger_notices)
    cfg.trainer.logger = kept  # one list, whichever way it was written (console,wandb / [console,wandb] / a list)
    return problems


def fit_world_to_machine(cfg: DictConfig, gpus: int, under_torchrun: bool) -> Optional[str]:
    """`trainer.n_gpus_per_node` x `trainer.nnodes` larger than this machine: plan (and run) what exists, and say so.

    Under torchrun the launch decides (distributed.reconcile_world). Otherwise: more nodes than this one -> this
    node; more processes per node than GPUs -> one per GPU; no GPU -> one process on the CPU, unless
    `hardware.device=cpu` asks for CPU processes explicitly (several gloo ranks on one machine, as the tests run).
    A request that fits is left as it is."""
    if under_torchrun:
        return None
    per_node, nodes = int(cfg.trainer.n_gpus_per_node), int(cfg.trainer.nnodes)
    explicit_cpu = str(OmegaConf.select(cfg, "hardware.device") or "auto").lower() == "cpu"
    if gpus > 0:
        fitted = min(per_node, gpus)
    else:
        fitted = per_node if explicit_cpu else 1
    if fitted == per_node and nodes == 1:
        return None
    cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes = fitted, 1
    if gpus > 0:
        where = f"{fitted} GPU{'s' if fitted > 1 else ''}"
    else:
        where = "the CPU" if fitted == 1 else f"{fitted} CPU processes (hardware.device=cpu)"
    have = f"{gpus} GPU{'s' if gpus != 1 else ''}" if gpus > 0 else "no GPU"
    return (f"trainer.nnodes={nodes} x trainer.n_gpus_per_node={per_node} asks for {nodes * per_node} devices; this "
            f"machine has {have}, so the run plans and trains on {where} (batch sizes unchanged; start torchrun on "
            "every node yourself for a multi-node run)")


VERL_TRAINER_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer")  # verl's trainer configs: our defaults are theirs


def hydra_config_layer(config_path: str, config_name: str, notices: list[str],
                       load_yaml: Callable[[str], DictConfig] = OmegaConf.load) -> DictConfig:
    """Hydra's `--config-path DIR --config-name NAME`: DIR/NAME.yaml, with its `defaults` list applied.

    verl's trainer configs (`ppo_trainer`, `ppo_megatron_trainer`, ...) are our defaults; another entry names a YAML
    beside it (merged before the file, as Hydra does when `_self_` comes last). `hydra:` settings are dropped with a
    notice. A missing file is a UserError naming the path. `load_yaml` reads one file (config.py passes its own,
    which names the line of a syntax error)."""
    name = config_name[:-5] if config_name.endswith(".yaml") else config_name
    path = os.path.join(config_path, f"{name}.yaml")
    if not os.path.isfile(path) and name in VERL_TRAINER_CONFIGS:
        notices.append(f"--config-name={config_name}: verl's own trainer config; rlanywhere's defaults are its values"
                       + ("" if name == "ppo_trainer" else " (Megatron settings do not apply here)"))
        return OmegaConf.create()
    if not os.path.isfile(path):
        raise UserError(f"--config-path={config_path} --config-name={config_name}: {path} not found; give the "
                          "directory that holds the YAML and its name without .yaml")
    own = load_yaml(path)
    defaults = own.pop("defaults", None) if "defaults" in own else None
    if "hydra" in own:
        own.pop("hydra")
        notices.append(f"{path}: hydra settings ignored (the file and its defaults are read directly)")
    layers: list[DictConfig] = []
    for entry in list(defaults or []):
        entry = OmegaConf.to_container(entry) if isinstance(entry, DictConfig) else entry
        label = next(iter(entry.values())) if isinstance(entry, dict) else str(entry)
        if label == "_self_":
            continue
        if label in VERL_TRAINER_CONFIGS:
            if label != "ppo_trainer":
                notices.append(f"{path}: defaults {label} -> rlanywhere's defaults (verl's ppo_trainer values; "
                               "Megatron settings do not apply here)")
            continue
        beside = os.path.join(config_path, f"{label}.yaml")
        if os.path.isfile(beside):
            layers.append(hydra_config_layer(config_path, label, notices, load_yaml))
        else:
            notices.append(f"{path}: defaults entry {label!r} has no file in {config_path}; rlanywhere's defaults "
                           "are used for it")
    return OmegaConf.merge(*layers, own) if layers else own
