"""Run configuration: verl's key names, OmegaConf structured config, YAML + dotted overrides.

    cfg = load_config("ppo.yaml", ["data.train_batch_size=64", "algorithm.adv_estimator=grpo"])

Keys follow verl's `ppo_trainer.yaml` wherever the concept exists, so a verl command line runs here unchanged
(`rlanywhere train <the same overrides>`). Keys that only make sense inside verl (vLLM memory fractions, FSDP wrap
policies, Ray settings) are accepted with a one-line notice of what rlanywhere does instead. Anything else unknown
is an error naming the closest valid key. Our own knobs live under `hardware.*`; "auto" there means the planner
(the planner package) decides.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, estimator_needs
from .errors import UserError
from .verl_compat import (CURRENT_VERL_KEYS, REWARD_MANAGERS, pop_key, reference_offload_notice,
                          translate_verl_spellings, verl_runtime_problems)
from .profiling import profile_step_set
from .reward_model import reward_model_config_problem
from .vocabulary import (
    AdvantageEstimator, AttnImplementation, LossAggMode, Precision, RolloutEngineName, Truncation,
)

log = logging.getLogger(__name__)


class ConfigError(UserError, ValueError):
    """A config problem, with the fix in the message. From `load_config`: `problems` (one line each) and `partial`,
    the configuration with the faulty keys left out, so the inputs it names can be checked in the same answer."""

    problems: list = []
    partial: Optional[DictConfig] = None


# --------------------------------------------------------------------------------------------------- schema
@dataclass
class DataConfig:
    tokenizer: Optional[str] = None
    train_files: Any = "data/arith/train.parquet"
    val_files: Any = "data/arith/test.parquet"
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    gen_batch_size: Optional[int] = None  # prompts per round with algorithm.filter_groups (None: train_batch_size)
    val_batch_size: Optional[int] = None
    val_max_samples: int = -1  # <= 0: the whole validation set (as verl)
    train_max_samples: int = -1  # <= 0: every training prompt; N: the first N (after filtering)
    shuffle: bool = True
    seed: Optional[int] = None  # None: trainer.seed
    # None: overlong prompts are cut as data.truncation says (left / right / middle, as verl), and dropped (counted in the log)
    # where it says error, where verl would stop the run at the first one
    filter_overlong_prompts: bool | None = None
    truncation: str = "error"
    return_raw_chat: bool = False
    return_raw_input_ids: bool = False
    # verl's: extra keyword arguments of the chat template when prompts are rendered (e.g. {enable_thinking: false})
    apply_chat_template_kwargs: Any = field(default_factory=dict)


@dataclass
class OptimConfig:
    lr: float = 1e-6
    lr_warmup_steps: int = -1
    lr_warmup_steps_ratio: float = 0.0
    min_lr_ratio: float = 0.0
    # the LR schedule after the warm-up: constant | cosine (verl's lr_scheduler_type; its older warmup_style, where
    # set, wins, as in verl)
    lr_scheduler_type: str = "constant"
    warmup_style: str | None = None
    total_training_steps: int = -1
    weight_decay: float = 0.01
    betas: Any = field(default_factory=lambda: [0.9, 0.999])


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    tokenizer_path: Optional[str] = None
    gguf_file: Optional[str] = None  # for a directory holding several .gguf files
    override_config: Any = field(default_factory=dict)
    enable_gradient_checkpointing: Any = "auto"
    use_remove_padding: bool = True
    trust_remote_code: bool = False
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None  # modules left without adapters (peft: a list of names or a regex), as verl
    lora_adapter_path: str | None = None  # a peft adapter folder to start from (its r, alpha, targets; as verl)


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # vanilla | gspo | gpg | cispo | geo_mean (algorithms.POLICY_LOSSES)


@dataclass
class ActorConfig:
    strategy: str = "fsdp"
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: Optional[int] = None
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # the constant of seq-mean-token-sum-norm; None: the response length
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    use_torch_compile: bool = True  # verl's key: false keeps the training passes eager (the planner decides where on)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class RefConfig:
    log_prob_micro_batch_size: Optional[int] = None
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384


@dataclass
class ValKwargs:
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    n: int = 1
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """verl's actor_rollout_ref.rollout.multi_turn: tool-using rollouts (rollout/multiturn.py, docs/multi-turn.md)."""
    enable: bool = False
    max_assistant_turns: Optional[int] = None  # None: 5 (verl: no limit within the response length)
    max_user_turns: Optional[int] = None  # None: as max_assistant_turns
    max_turns: Optional[int] = None  # older verl releases' name for max_assistant_turns
    tool_config_path: Optional[str] = None
    format: str = "hermes"
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 30.0
    # verl keys accepted without effect here (no interaction agents, token ids are always those generated)
    interaction_config_path: Optional[str] = None
    use_inference_chat_template: bool = False
    tokenization_sanity_check_mode: str = "strict"
    completion_callback: Optional[str] = None


@dataclass
class RolloutConfig:
    name: str = "auto"  # auto | fast | hf  (verl's vllm/sglang/hf are mapped, see VERL_VALUE_MAP)
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True
    n: int = 1
    response_length: Optional[int] = None  # None: data.max_response_length
    prompt_length: Optional[int] = None
    stop: Any = field(default_factory=list)
    ignore_eos: bool = False
    dtype: str = "auto"
    log_prob_micro_batch_size: Optional[int] = None
    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = False
    log_prob_max_token_len_per_gpu: int = 16384
    free_cache_engine: Any = "auto"  # verl's key: true frees the KV cache after each rollout, false keeps it
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


@dataclass
class CriticModelConfig(ModelConfig):
    path: Optional[str] = None  # None: the actor's model


@dataclass
class CriticConfig:
    strategy: str = "fsdp"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    ppo_mini_batch_size: Optional[int] = None  # None: the actor's
    ppo_micro_batch_size: Optional[int] = None
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    forward_micro_batch_size: Optional[int] = None
    forward_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = 32768
    ppo_epochs: Optional[int] = None  # None: the actor's
    shuffle: bool = False
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # as the actor's


@dataclass
class KLCtrlConfig:
    type: str = "fixed"
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling: drop groups whose metric is the same for every response, draw more prompts."""

    enable: bool = False
    metric: str = "acc"  # acc | score | seq_reward | any numeric key the reward function returns
    max_num_gen_batches: int = 10  # generation rounds per step at most; <= 0: no limit (verl's default 0)


# ------------------------------------------------------------------------------- rollout off the critical path
@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction: truncated importance sampling between the rollout engine's policy and
    the trainer's (rollout_correction.py; docs/async.md)."""

    rollout_is: Optional[str] = None  # null (off) | token | sequence
    rollout_is_threshold: float = 2.0  # the cap on each importance weight
    rollout_is_batch_normalize: bool = False  # verl's key; only false is available
    rollout_rs: Optional[str] = None  # verl's rejection sampling; only null is available
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False  # the PPO ratio against the rollout's own log-probs (verl's one-step-off recipe)
    loss_type: str = "ppo_clip"


@dataclass
class AsyncConfig:
    """trainer.async: the rollout of step k+1 runs with the weights of step k while step k trains (async_pipeline.py;
    docs/async.md)."""

    mode: str = "sync"  # sync | one_step_off
    max_staleness: int = 1  # rollouts kept ahead of the update: each batch this many policy versions old at most
    overlap: Any = "auto"  # one GPU: generation on its own CUDA stream beside the update; auto: the planner
    # overlapped on a GPU: whose kernels take each SM that frees up first. rollout: the decode's (its stream at high
    # priority); update: the training step's (on a high-priority stream of its own, the rollout's at the default)
    priority: str = "rollout"
    # ranks that only generate: R = the last R ranks (split placement; each serves as many trainer ranks); 0 = none,
    # every rank trains (data parallelism) and generates its share beside its own update; unset: 1 on 2 ranks, else 0
    rollout_ranks: Optional[int] = None


def _add_keyword_field(cls: type, name: str, default: Any) -> None:
    """A field whose name is a Python keyword (trainer.async), which a dataclass body cannot spell."""
    spec = field(default=default)
    spec.name, spec.type, spec._field_type = name, type(default), dataclasses._FIELD  # type: ignore[attr-defined]
    cls.__dataclass_fields__[name] = spec  # type: ignore[attr-defined]
    cls.__annotations__[name] = type(default)
    setattr(cls, name, default)


def _check_async(cfg: DictConfig) -> None:
    from .async_plan import check_async_config
    from .rollout_correction import check_rollout_correction
    try:
        check_rollout_correction(cfg.algorithm.rollout_correction, cfg.actor_rollout_ref.rollout.top_k,
                                 cfg.actor_rollout_ref.rollout.top_p)
        check_async_config(cfg)
    except UserError as err:
        raise ConfigError(str(err)) from None


def _translate_async_placement(user: DictConfig, notices: list[str], problems: list[str]) -> None:
    """verl's one-step-off recipe places the rollout on GPUs of its own: trainer.nnodes x trainer.n_gpus_per_node
    count the training GPUs there, rollout.nnodes x rollout.n_gpus_per_node the rollout ones. Here the ranks of one
    job are counted together: trainer.n_gpus_per_node becomes the sum per node and trainer.async.rollout_ranks the
    rollout ranks (the last ones), with trainer.async.mode=one_step_off."""
    section = OmegaConf.select(user, "rollout")
    if not isinstance(section, DictConfig) or not {"nnodes", "n_gpus_per_node"} & set(section.keys()):
        return
    rollout_nodes, rollout_per_node = int(section.get("nnodes", 1)), int(section.get("n_gpus_per_node", 1))
    for key in ("rollout.nnodes", "rollout.n_gpus_per_node"):
        if OmegaConf.select(user, key) is not None:
            pop_key(user, key)
    trainer_nodes = int(OmegaConf.select(user, "trainer.nnodes") or 1)
    trainer_per_node = int(OmegaConf.select(user, "trainer.n_gpus_per_node") or 1)
    given = f"rollout.nnodes={rollout_nodes} rollout.n_gpus_per_node={rollout_per_node}"
    OmegaConf.update(user, "trainer.async.mode", "one_step_off", force_add=True)
    if OmegaConf.select(user, "algorithm.rollout_correction.bypass_mode") is None:
        # the recipe's own config (one_step_off_ppo_trainer.yaml) turns it on
        OmegaConf.update(user, "algorithm.rollout_correction.bypass_mode", True, force_add=True)
        notices.append("algorithm.rollout_correction.bypass_mode=true: the one-step-off recipe's default (the PPO "
                       "ratio against the rollout's own log-probs); set it to false for the trainer's forward instead")
    if rollout_nodes * rollout_per_node == 0:
        notices.append(f"{given}: verl's one-step-off recipe without rollout GPUs; honoured as trainer.async.mode="
                       "one_step_off, every rank generating its share beside its own update")
        OmegaConf.update(user, "trainer.async.rollout_ranks", 0, force_add=True)
        return
    if rollout_nodes != trainer_nodes:
        problems.append(f"{given} with trainer.nnodes={trainer_nodes}: the rollout GPUs are counted per node here "
                        f"(trainer.n_gpus_per_node training + rollout GPUs on each node): use rollout.nnodes="
                        f"{trainer_nodes}, or trainer.n_gpus_per_node=<all GPUs of a node> with "
                        "trainer.async.rollout_ranks=<rollout ranks in all>")
        return
    rollout_ranks = rollout_nodes * rollout_per_node
    OmegaConf.update(user, "trainer.n_gpus_per_node", trainer_per_node + rollout_per_node, force_add=True)
    OmegaConf.update(user, "trainer.async.rollout_ranks", rollout_ranks, force_add=True)
    notices.append(f"{given}: verl's one-step-off recipe; honoured as trainer.async.mode=one_step_off with "
                   f"trainer.n_gpus_per_node={trainer_per_node + rollout_per_node} (training and rollout GPUs of a "
                   f"node together) and trainer.async.rollout_ranks={rollout_ranks}: the last {rollout_ranks} "
                   "rank(s) generate each next batch while the others train")


@dataclass
class PFPPOConfig:
    reweight_method: str = "pow"  # pow | max_min | max_random (algorithms.pf_ppo_resample)
    weight_pow: float = 2.0


@dataclass
class AlgorithmConfig:
    gamma: float = 1.0
    lam: float = 1.0
    adv_estimator: str = "gae"
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    mask_truncated_completions: bool = False  # TRL's name (verl has none): cut-off responses leave the loss
    use_pf_ppo: bool = False  # PF-PPO: rows redrawn by their score before the updates (verl_steps.py)
    pf_ppo: PFPPOConfig = field(default_factory=lambda: PFPPOConfig())
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None
    name: str = "compute_score"
    timeout_s: float = 30.0  # per call; the function runs in worker processes (0: in-process, no limit)
    reward_kwargs: Any = field(default_factory=dict)  # verl's: extra keyword arguments of every call


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment: a linear penalty in the last `len` tokens before the length limit."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass
class RewardModelFSDPConfig:
    # verl's switch; here: true keeps the reward model in CPU memory between scorings, false / auto let the planner
    # offload it only when the card needs it
    param_offload: Any = "auto"


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # a sequence-classification reward model, or a causal LM with judge.enable
    # verl: the policy's tokenizer the response is decoded with (here always the actor's); the reward model's own
    # tokenizer and chat template re-template the conversation (reward_model.py)
    input_tokenizer: Optional[str] = None
    trust_remote_code: bool = False
    override_config: dict = field(default_factory=dict)
    fsdp_config: RewardModelFSDPConfig = field(default_factory=RewardModelFSDPConfig)


@dataclass
class JudgeVerdictFunction:
    path: Optional[str] = None  # a .py file whose function `name(text) -> float | None` reads the verdict
    name: str = "parse_verdict"


@dataclass
class JudgeConfig:
    """rlanywhere's generative judge: reward_model.model.path is a causal LM that grades each response."""

    enable: bool = False
    prompt_template: str = ("Grade the answer to the question. Reply with only a score from 0 to 10.\n\n"
                            "Question: {prompt}\n\nAnswer: {response}\n\nScore:")
    # the first group of the last match is the score; by default the reply's first number ("7/10" and "7 out of
    # 10" are 7: the template asks for only a score)
    verdict_regex: str = r"\A\D*?(-?\d+(?:\.\d+)?)"
    verdict_function: JudgeVerdictFunction = field(default_factory=JudgeVerdictFunction)
    max_new_tokens: int = 16
    failure_score: float = 0.0  # the score of a verdict that cannot be parsed (counted, never fatal)


@dataclass
class RewardModelConfig:
    enable: bool = False
    reward_manager: str = "naive"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    strategy: str = "fsdp"
    micro_batch_size: Optional[int] = None  # verl's deprecated global size (one process: the same)
    micro_batch_size_per_gpu: Optional[int] = None  # None: planned
    max_length: Optional[int] = None  # tokens per re-templated sequence; None: prompt + response length
    truncation: str = "right"  # right: keep the first max_length tokens (verl) | left | error
    use_dynamic_bsz: bool = False
    forward_max_token_len_per_gpu: Optional[int] = None
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class TrainerConfig:
    project_name: str = "rlanywhere"
    experiment_name: str = "run"
    # passes over the training prompts; None: one, or as many as total_training_steps needs. With both set the run
    # stops at whichever comes first, as verl's does
    total_epochs: int | None = None
    total_training_steps: Optional[int] = None
    logger: Any = field(default_factory=lambda: ["console", "tensorboard"])
    log_val_generations: int = 0
    nnodes: int = 1
    n_gpus_per_node: int = 1
    save_freq: int = -1
    test_freq: int = -1
    critic_warmup: int = 0
    val_before_train: bool = True
    val_only: bool = False  # verl's: validate the model as loaded (or resumed), then stop without training
    default_local_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None
    max_actor_ckpt_to_keep: Optional[int] = None
    max_critic_ckpt_to_keep: Optional[int] = None
    seed: int = 1
    device: str = "auto"
    overwrite_run_dir: bool = False  # with resume_mode=disable: delete an earlier run's checkpoints, not refuse
    max_consecutive_nonfinite_updates: int = 5  # stop after this many NaN/inf updates in a row (0: never)
    max_consecutive_failed_reward_steps: int = 3  # stop after this many steps whose reward calls all failed
    profile_steps: Any = None  # e.g. [3]: torch.profiler trace + kernel table of those steps in <run dir>/profile/
    # several ranks: after each rollout, move rows so every rank trains about as many tokens (verl's key and default;
    # one process: nothing to balance). docs/distributed.md
    balance_batch: bool = True


_add_keyword_field(TrainerConfig, "async", AsyncConfig())


@dataclass
class HardwareConfig:
    """rlanywhere's own knobs. "auto" everywhere means: the planner decides from the probed hardware."""

    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    attn_implementation: str = "auto"  # auto | flash_attention_2 | sdpa | eager
    emulate: Optional[str] = None  # p40 | t4 | v100-16g | ... (see machine.CARDS)
    param_offload: Any = "auto"
    optimizer_offload: Any = "auto"
    ref_device: str = "auto"  # auto | cpu | cuda
    memory_budget_gib: Optional[float] = None  # None: the card's memory
    data_parallel: str = "auto"  # several ranks: auto | replicate | shard (FSDP2); see docs/distributed.md
    # sharded: ranks per shard group (0: the planner; fewer than all ranks = HSDP, replicas of the shards; verl's
    # actor_rollout_ref.actor.fsdp_config.fsdp_size)
    shard_group_size: int = 0
    logprob_chunk_size: int = 0  # 0: planner picks
    # training passes run each distinct prompt of a micro-batch once for all its samples (prompt_sharing.py):
    # auto (the planner: GRPO-style groups) | true | false
    share_prompts: Any = "auto"
    # the training passes' decoder layers compiled (torch.compile): auto (the planner: where the card runs it and the
    # run is long enough to repay compiling) | true | false
    compile_training: Any = "auto"
    oom_recovery: bool = True
    require_loggers: bool = False  # a trainer.logger entry that cannot run is an error, not local logging instead
    # guard rails (precision_guard.py): stop when the fp16 loss scale falls below min_loss_scale, or when the mean
    # |rollout - trainer| log-prob gap exceeds max_logprob_gap on logprob_gap_patience steps in a row (0: off)
    min_loss_scale: float = 1.0
    max_logprob_gap: float = 0.25
    logprob_gap_patience: int = 3


@dataclass
class RLConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)


# ------------------------------------------------------------------------------- verl keys we do not use
# Pattern (regex over the dotted key) -> what rlanywhere does instead. Matched keys are dropped after the notice,
# except the offload switches, which are translated into hardware.* (see _translate_verl_key).
VERL_ONLY_KEYS: dict[str, str] = {
    r".*\.fsdp_config(\..*)?": "sharding is planned (hardware.data_parallel, hardware.shard_group_size), offload by "
    "hardware.param_offload / hardware.optimizer_offload",
    r"actor_rollout_ref\.rollout\.(gpu_memory_utilization|max_num_batched_tokens|max_num_seqs|max_model_len"
    r"|enable_chunked_prefill|enforce_eager|load_format|disable_log_stats|mode"
    r"|tensor_model_parallel_size|calculate_log_probs|engine_kwargs(\..*)?|multi_turn\._target_|layered_summon)":
    "the built-in rollout engine sizes its KV cache and batches from the plan",
    r"actor_rollout_ref\.rollout\.agent\..*": "no agent-loop workers or servers: the built-in engine runs every "
    "turn (multi-turn rollouts: actor_rollout_ref.rollout.multi_turn)",
    r"actor_rollout_ref\.hybrid_engine": ("the rollout engine reads the actor's weights, or with "
                                          "trainer.async.mode=one_step_off its own copy of them"),
    r"actor_rollout_ref\.(actor|ref|rollout)\.(ulysses_sequence_parallel_size|checkpoint(\..*)?"
    r"|use_fused_kernels|use_remove_padding)": "not needed: padding is removed per micro-batch",
    r"actor_rollout_ref\.(ref|rollout)\.use_torch_compile": "actor_rollout_ref.actor.use_torch_compile decides for "
    "every training-side pass (actor, reference, critic); the rollout engine plans its own kernels",
    r"critic\.(ulysses_sequence_parallel_size|checkpoint(\..*)?|rollout_n)": "not needed on one process",
    r"actor_rollout_ref\.model\.(external_lib|use_liger|use_fused_kernels|enable_activation_offload"
    r"|use_shm)": "not needed: models load through transformers",
    r"critic\.model\.(external_lib|use_shm)": "not needed: models load through transformers",
    r"trainer\.(default_hdfs_dir|del_local_ckpt_after_load|ray_wait_register_center_timeout"
    r"|esi_redundant_time|rollout_data_dir|use_legacy_worker_impl)":
    "not used by the single-process trainer",
    r"trainer\.validation_data_dir": "every validation's responses, prompts, ground truths and scores are written to "
    "RUN_DIR/val_generations/step_N.jsonl",
    r"ray_init(\..*)?": "no Ray: one process (torchrun for several GPUs)",
    r"data\.(image_key|video_key|custom_cls(\..*)?|dataloader_num_workers|return_full_prompt|use_shm"
    r"|trust_remote_code|sampler(\..*)?|return_multi_modal_inputs|filter_overlong_prompts_workers)":
    "text-only prompts are read from parquet directly",
    r"reward_model\.(launch_reward_fn_async|sandbox_fusion(\..*)?|enable_resource_pool|n_gpus_per_node|nnodes"
    r"|reward_loop_.*|use_reward_loop|num_workers|ulysses_sequence_parallel_size|profiler(\..*)?|rollout(\..*)?"
    r"|model\.(external_lib|use_shm|use_remove_padding|use_fused_kernels))": "the reward model scores in this "
    "process, between the rollout and the training phases (reward_model.py)",
    r"reward_model\.overlong_buffer\.log": "the overlong penalty is always logged (reward/overlong_penalty)",
}

VERL_ONLY_KEYS.update(CURRENT_VERL_KEYS)  # the rest of current verl's schema (verl_compat.py)

# Schema keys accepted (verl configs set them) that change nothing here: a user who sets one to a non-default value
# is told what happens instead. tests/test_config_keys.py fails on a key that is neither read by a run nor listed.
ACCEPTED_WITHOUT_EFFECT: dict[str, str] = {
    r"data\.return_raw_(chat|input_ids)": "the prompt's messages always travel with it (a reward model re-templates them)",
    r"reward_model\.strategy": "the reward model is loaded whole in this process, no FSDP/Megatron wrapper",
    r"reward_model\.model\.input_tokenizer": "responses are always decoded with the actor's tokenizer, then "
    "re-templated with the reward model's own",
    r"actor_rollout_ref\.rollout\.multi_turn\.(interaction_config_path|use_inference_chat_template"
    r"|tokenization_sanity_check_mode|completion_callback)": "multi-turn rollouts keep the token ids generated and "
    "run tools only (no interaction agents)",
    r"(actor_rollout_ref|critic)\.model\.use_remove_padding": "padding is always removed inside each micro-batch",
    r"(actor_rollout_ref\.actor|critic)\.strategy": "one process trains the model directly, no FSDP/Megatron wrapper",
    r"(actor_rollout_ref\.actor|critic)\.optim\.total_training_steps": "schedules span trainer.total_training_steps "
    "(verl's trainer sets this key itself)",
    r"actor_rollout_ref\.(ref|rollout)\.log_prob_(use_dynamic_bsz|max_token_len_per_gpu)"
    r"|critic\.forward_max_token_len_per_gpu|critic\.(use_dynamic_bsz|ppo_max_token_len_per_gpu)":
    "forward passes and the critic use the actor's token budget (actor.use_dynamic_bsz), else planned micro-batches",
    r"trainer\.max_critic_ckpt_to_keep": "actor and critic share each checkpoint; max_actor_ckpt_to_keep limits both",
    r"actor_rollout_ref\.rollout\.dtype": "the planner picks the rollout dtype for the card (hardware.precision forces one)",
    r"trainer\.device": "the planner picks the device (hardware.device forces one)",
    r"critic\.model\.tokenizer_path": "the critic reads the actor's tokens, so it uses the actor's tokenizer",
    r"critic\.model\.enable_gradient_checkpointing": "the plan decides checkpointing for actor and critic together "
    "(actor_rollout_ref.model.enable_gradient_checkpointing)",
}

# verl values that mean something else here: rollout engines we don't have map to our own.
VERL_VALUE_MAP = {
    "actor_rollout_ref.rollout.name": {"vllm": "auto", "sglang": "auto", "hf": "hf", "auto": "auto", "fast": "fast"},
}

# verl offload switches that we honour (their concept exists: offload planned for the card).
OFFLOAD_TRANSLATIONS = {
    "param_offload": "hardware.param_offload",
    "offload_params": "hardware.param_offload",
    "cpu_offload": "hardware.param_offload",
    "optimizer_offload": "hardware.optimizer_offload",
}


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf (dict values that are not dicts; lists count as leaves)."""
    if isinstance(node, (dict, DictConfig)):
        out: list[str] = []
        for key in node.keys():
            value = node[key] if isinstance(node, dict) else node._get_node(key)
            value = OmegaConf.to_container(value) if isinstance(value, DictConfig) else value
            if isinstance(value, dict) and value:
                out.extend(_leaf_keys(value, f"{prefix}{key}."))
            else:
                out.append(f"{prefix}{key}")
        return out
    return []


@functools.lru_cache(maxsize=1)
def _schema_defaults() -> DictConfig:
    """The schema with its defaults, built once (OmegaConf.structured of the dataclasses is slow); callers get copies."""
    return OmegaConf.structured(RLConfig)


def schema_defaults() -> DictConfig:
    """A fresh copy of the schema with its defaults (a copy is several times faster to make than the schema)."""
    return copy.deepcopy(_schema_defaults())


@functools.lru_cache(maxsize=1)
def _schema_key_tuple() -> tuple[str, ...]:
    return tuple(_leaf_keys(OmegaConf.to_container(_schema_defaults(), resolve=False)))


def schema_keys() -> list[str]:
    """Every valid dotted key of the schema."""
    return list(_schema_key_tuple())


def _without_effect_reason(key: str) -> Optional[str]:
    for pattern, reason in ACCEPTED_WITHOUT_EFFECT.items():
        if re.fullmatch(pattern, key):
            return reason
    return None


def _verl_only_reason(key: str) -> Optional[str]:
    for pattern, reason in VERL_ONLY_KEYS.items():
        if re.fullmatch(pattern, key):
            return reason
    return None


def _parse_overrides(overrides: list[str]) -> DictConfig:
    """Hydra-style `a.b=c` overrides (a leading `+`/`++` is accepted; `~key` deletions are not supported)."""
    cleaned = []
    for item in overrides:
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        if item.startswith("~"):
            raise ConfigError(f"override {item!r}: deleting keys is not supported; set the key to null instead")
        item = item.lstrip("+")
        if "=" not in item:
            raise ConfigError(f"override {item!r} has no '=': write it as key.path=value (e.g. data.train_batch_size=64)")
        cleaned.append(item)
    try:
        return OmegaConf.from_dotlist(cleaned)
    except (OmegaConfBaseException, yaml.YAMLError):
        pass
    for item in cleaned:  # name the override that does not parse (a YAML scalar is read from each value)
        try:
            OmegaConf.from_dotlist([item])
        except (OmegaConfBaseException, yaml.YAMLError):
            key, value = item.split("=", 1)
            raise ConfigError(f"override {item!r}: {value!r} is not a value the command line can read (a shell "
                              f"pattern, an unclosed bracket, a leading * % @ or `); quote it, e.g. "
                              f"{key}=\"'{value}'\"") from None
    raise ConfigError(f"could not parse the overrides {cleaned}")


def _vet_user_keys(user: DictConfig, notices: list[str], problems: Optional[list[str]] = None) -> DictConfig:
    """Drop verl-only keys (with a notice), translate offload switches and verl's other spellings, reject unknown
    keys: each one is added to `problems` (raised at once when no list is given) and dropped."""
    raise_now = problems is None
    problems = [] if problems is None else problems
    user = translate_verl_spellings(user, notices, problems)
    _translate_async_placement(user, notices, problems)
    valid = set(schema_keys())
    defaults = _schema_defaults()  # read only
    for key in _leaf_keys(OmegaConf.to_container(user, resolve=False)):
        if key in valid:
            without_effect = _without_effect_reason(key)
            value = OmegaConf.select(user, key)
            if without_effect and value != OmegaConf.select(defaults, key):
                notices.append(f"{key}={value}: accepted, no effect here ({without_effect})")
            continue
        # A dict-valued schema field (override_config, custom_reward_function.reward_kwargs) accepts any sub-keys.
        if any(key.startswith(v + ".") for v in valid if v.endswith(("override_config", "reward_kwargs"))):
            continue
        reason = _verl_only_reason(key)
        if reason is not None:
            value = pop_key(user, key)
            leaf = key.rsplit(".", 1)[-1]
            target = OFFLOAD_TRANSLATIONS.get(leaf)
            if target is not None and key.startswith("actor_rollout_ref.ref."):
                notices.append(reference_offload_notice(user, key, value))
            elif target is not None and bool(value):
                OmegaConf.update(user, target, True, force_add=True)
                notices.append(f"{key}={value}: verl-only key; honoured as {target}=true")
            elif leaf == "fsdp_size" and key.startswith("actor_rollout_ref.actor.") and _positive_int(value):
                OmegaConf.update(user, "hardware.shard_group_size", int(value), force_add=True)
                notices.append(f"{key}={value}: verl-only key; honoured as hardware.shard_group_size={int(value)} "
                               "(sharded runs: ranks per shard group)")
            else:
                notices.append(f"{key}={value}: verl-only key, ignored ({reason})")
            continue
        close = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        problems.append(f"unknown config key {key!r}{hint} (every key: docs/reference/config.md)")
        pop_key(user, key)
    for key, mapping in VERL_VALUE_MAP.items():
        value = OmegaConf.select(user, key)
        if value is None:
            continue
        if value not in mapping:
            problems.append(f"{key}={value!r} is not supported; use one of {sorted(set(mapping))}")
            pop_key(user, key)
            continue
        if mapping[value] != value:
            notices.append(f"{key}={value}: not available here; using rlanywhere's built-in engine ({mapping[value]})")
            OmegaConf.update(user, key, mapping[value])
    if raise_now and problems:
        raise ConfigError(_problems_text(problems))
    return user


def _problems_text(problems: list[str]) -> str:
    """One problem as it is; several as a numbered list under one line, so a command line is fixed in one go."""
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in this configuration:\n" + "\n".join(
        f"  {i}. {problem}" for i, problem in enumerate(problems, 1))


def _positive_int(value: Any) -> bool:
    try:
        return int(value) > 0
    except (TypeError, ValueError):
        return False


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None,
                base: Optional[DictConfig] = None, notices: Optional[list[str]] = None) -> DictConfig:
    """Defaults <- `base` (e.g. the demo profile) <- YAML file <- dotted overrides, validated.

    verl-only keys are reported through `logging` and appended to `notices` when a list is given."""
    notices = notices if notices is not None else []
    cfg = schema_defaults()
    layers = [base] if base is not None else []
    if path is not None:
        layers.append(_load_yaml(path))
    layers.append(_parse_overrides(list(overrides or [])))
    problems: list[str] = []  # every problem of the configuration, reported together
    for layer in layers:
        layer = _vet_user_keys(OmegaConf.create(OmegaConf.to_container(layer, resolve=False)), notices, problems)
        cfg = _merge_each_key(cfg, layer, problems)
    problems.extend(_value_problems(cfg))
    problems.extend(verl_runtime_problems(cfg, notices))  # loggers, sandbox URL: checked before anything loads
    if problems:
        error = ConfigError(_problems_text(problems))
        error.problems, error.partial = list(problems), cfg
        raise error
    notices.extend(_differences_from_verl(cfg))
    for line in notices:
        log.warning("notice: %s", line)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _merge_each_key(cfg: DictConfig, layer: DictConfig, problems: list[str]) -> DictConfig:
    """Merge `layer` into `cfg`; a value of the wrong type is a problem named by its key, the rest still merges."""
    try:
        return OmegaConf.merge(cfg, layer)
    except OmegaConfBaseException:
        pass
    for key in _leaf_keys(OmegaConf.to_container(layer, resolve=False)):
        single = OmegaConf.create()
        OmegaConf.update(single, key, OmegaConf.select(layer, key), force_add=True)
        try:
            cfg = OmegaConf.merge(cfg, single)
        except OmegaConfBaseException as exc:
            problems.append(_type_problem(key, OmegaConf.select(layer, key), exc))
    return cfg


def _type_problem(key: str, value: Any, exc: Exception) -> str:
    """One line for a value of the wrong type: the key, the value and what the key takes."""
    message = str(getattr(exc, "msg", exc)).splitlines()[0]
    wanted = re.search(r"converted to (\w+)|field of type '?(\w+)'?|not a valid (\w+)", message)
    kind = next((name for name in (wanted.groups() if wanted else ()) if name), None)
    taken = {"Integer": "an integer", "int": "an integer", "Float": "a number", "float": "a number",
             "Boolean": "true or false", "bool": "true or false", "str": "a string"}.get(kind or "", kind)
    return f"{key}={value!r}: " + (f"expected {taken}" if taken else message)


def config_from(config: Any, overrides: Optional[list[str]] = None) -> DictConfig:
    """A loaded config passes through; a path (or None: the defaults) is loaded with the overrides."""
    if isinstance(config, DictConfig):
        if overrides:
            raise ValueError("overrides are applied when loading: pass a config path, or fold them into the config")
        return config
    return load_config(config, list(overrides or []))


def _load_yaml(path: str) -> DictConfig:
    """A YAML config file as a DictConfig; a missing file or a syntax error is one ConfigError naming file:line."""
    import yaml

    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path!r} not found") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"config file {path!r} is a directory; pass a .yaml file") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: YAML syntax error ({problem}); check the indentation and the ':' after each "
                          "key there") from exc
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{path}: the file must hold a mapping of keys (data:, actor_rollout_ref:, ...), "
                          f"not a {type(loaded).__name__}")
    return loaded


def check_batch_sizes(cfg: DictConfig) -> None:
    """verl's batch arithmetic: prompts per step split into whole mini-batches, and (without dynamic batch sizes)
    each mini-batch's sequences (prompts x rollout.n) into whole micro-batches. Raises ConfigError naming both
    keys and a value that works."""
    batch, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    actor = cfg.actor_rollout_ref.actor
    minis = [("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size,
              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", actor.ppo_micro_batch_size_per_gpu,
              actor.use_dynamic_bsz)]
    if estimator_needs(cfg.algorithm.adv_estimator).critic and cfg.critic.ppo_mini_batch_size:
        minis.append(("critic.ppo_mini_batch_size", cfg.critic.ppo_mini_batch_size,
                      "critic.ppo_micro_batch_size_per_gpu", cfg.critic.ppo_micro_batch_size_per_gpu,
                      cfg.critic.use_dynamic_bsz))
    # Unlike verl, a mini-batch (micro-batch) larger than the step (mini-batch) is accepted: it holds all of it.
    # That keeps the defaults (mini-batch 256) usable with a small data.train_batch_size.
    for mini_key, mini, micro_key, micro, dynamic in minis:
        mini = min(mini, batch)
        if batch % mini:
            raise ConfigError(f"data.train_batch_size={batch} is not divisible by {mini_key}={mini}: a step must "
                              f"split into whole mini-batches (as in verl); use a divisor of {batch}, e.g. "
                              f"{_largest_divisor_at_most(batch, mini)}")
        if micro and not dynamic and micro < mini * n and (mini * n) % micro:
            raise ConfigError(f"{micro_key}={micro} does not divide a mini-batch of {mini * n} sequences "
                              f"({mini_key}={mini} x rollout.n={n}), as verl requires; use a divisor of {mini * n}, "
                              f"e.g. {_largest_divisor_at_most(mini * n, micro)}")


def _largest_divisor_at_most(number: int, limit: int) -> int:
    return max(d for d in range(1, min(number, limit) + 1) if number % d == 0)


def _value_problems(cfg: DictConfig) -> list[str]:
    """Every problem of the values: the choices and positive sizes, then each later check's (those assume sane
    sizes, so they run only when the sizes are)."""
    problems: list[str] = []
    choices = {
        "algorithm.adv_estimator": tuple(ADVANTAGE_ESTIMATORS),  # the registered estimators (algorithms.py)
        "algorithm.pf_ppo.reweight_method": ("pow", "max_min", "max_random"),
        "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
        "actor_rollout_ref.actor.loss_agg_mode": LossAggMode.values(),
        "critic.loss_agg_mode": LossAggMode.values(),
        "trainer.resume_mode": ("auto", "disable", "resume_path"),
        "hardware.precision": Precision.values(),
        "hardware.attn_implementation": AttnImplementation.values(),
        "actor_rollout_ref.rollout.name": RolloutEngineName.values(),
        "data.truncation": Truncation.values(),
        "actor_rollout_ref.actor.policy_loss.loss_mode": tuple(POLICY_LOSSES),
        "actor_rollout_ref.actor.optim.lr_scheduler_type": ("constant", "cosine"),
        "critic.optim.lr_scheduler_type": ("constant", "cosine"),
        "actor_rollout_ref.actor.optim.warmup_style": (None, "constant", "cosine"),
        "critic.optim.warmup_style": (None, "constant", "cosine"),
        "actor_rollout_ref.actor.kl_loss_type": KL_ESTIMATORS,
        "algorithm.kl_penalty": KL_ESTIMATORS,
    }
    for key, allowed in choices.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            names = ", ".join("null" if choice is None else str(choice) for choice in allowed)
            problems.append(f"{key}={value!r} is not valid; choose one of {names}")
    positive = ["data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
                "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_epochs",
                "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.val_kwargs.n", "data.val_batch_size"]
    for key in positive:
        value = OmegaConf.select(cfg, key)
        if value is not None and value <= 0:  # data.val_batch_size may be null (chunks the planner sizes)
            problems.append(f"{key} must be positive, got {value}")
    if cfg.trainer.val_only and not as_list(cfg.data.val_files):
        problems.append("trainer.val_only=true validates on data.val_files, and none are given: set data.val_files "
                        "(e.g. data.val_files=$HOME/data/gsm8k/test.parquet)")
    for key in ("actor_rollout_ref.model.target_modules", "critic.model.target_modules"):
        targets = OmegaConf.select(cfg, key)
        named = [] if targets is None or isinstance(targets, str) else [str(t) for t in targets]
        outside = [t for t in named if re.search(r"(^|\.)(embed_tokens|wte|word_embeddings|lm_head|embed_out)$", t)]
        if outside:
            problems.append(f"{key} names {outside}: LoRA adapters on the embeddings or the LM head are not available "
                            "(the log-prob passes read the LM head's weight, tied to the embeddings in many models, "
                            "directly: an adapter there would not be the policy trained); adapt the decoder's linear "
                            "layers (all-linear, or q_proj, v_proj, ...)")
    clip_c = OmegaConf.select(cfg, "actor_rollout_ref.actor.clip_ratio_c")
    if clip_c is not None and clip_c <= 1.0:
        problems.append(f"actor_rollout_ref.actor.clip_ratio_c={clip_c}: the dual-clip constant must be > 1.0 "
                        "(verl's default 3.0)")
    sizes_sane = not problems
    for check in (_check_reward_model, _check_reward_values, _check_guard_values, check_batch_sizes,
                  _check_variant_values):
        if check is check_batch_sizes and not sizes_sane:
            continue
        try:
            check(cfg)
        except ConfigError as err:
            problems.append(str(err))
    return problems


def _check_reward_model(cfg: DictConfig) -> None:
    problem = reward_model_config_problem(cfg)  # reward_model.py
    if problem:
        raise ConfigError(problem)


def _check_reward_values(cfg: DictConfig) -> None:
    if cfg.reward_model.reward_manager not in REWARD_MANAGERS:
        raise ConfigError(f"reward_model.reward_manager={cfg.reward_model.reward_manager!r} is not available; "
                          f"choose one of {', '.join(REWARD_MANAGERS)} ('naive', the default, scores each response "
                          "with the rule or custom function)")


def _check_guard_values(cfg: DictConfig) -> None:
    for key in ("trainer.max_consecutive_nonfinite_updates", "trainer.max_consecutive_failed_reward_steps",
                "custom_reward_function.timeout_s"):
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (0 turns it off), got {OmegaConf.select(cfg, key)}")
    for key in ("hardware.min_loss_scale", "hardware.max_logprob_gap"):
        if OmegaConf.select(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0 (0 turns the guard off), got {OmegaConf.select(cfg, key)}")
    if cfg.hardware.logprob_gap_patience < 1:
        raise ConfigError(f"hardware.logprob_gap_patience must be >= 1 steps, got {cfg.hardware.logprob_gap_patience}")
    for key in ("trainer.seed", "data.seed"):  # numpy's generators take no negative seed
        value = OmegaConf.select(cfg, key)
        if value is not None and int(value) < 0:
            raise ConfigError(f"{key}={value}: seeds are integers >= 0 here (numpy's generators take no negative "
                              f"seed); use e.g. {key}={-int(value)}")
    try:
        profile_step_set(cfg.trainer.profile_steps)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<checkpoint dir>")
    _check_async(cfg)


def _check_variant_values(cfg: DictConfig) -> None:
    """DAPO's dynamic sampling and overlong buffer."""
    gen_batch_size = cfg.data.gen_batch_size
    if gen_batch_size is not None:
        if gen_batch_size <= 0:
            raise ConfigError(f"data.gen_batch_size must be positive, got {gen_batch_size}")
        if not cfg.algorithm.filter_groups.enable:
            raise ConfigError("data.gen_batch_size (prompts per generation round) only applies with dynamic sampling: "
                              "set algorithm.filter_groups.enable=true or drop data.gen_batch_size")
    if cfg.algorithm.filter_groups.enable and not str(cfg.algorithm.filter_groups.metric or "").strip():
        raise ConfigError("algorithm.filter_groups.metric is empty; use acc, score, seq_reward or a key your "
                          "reward function returns")
    buffer = cfg.reward_model.overlong_buffer
    if buffer.enable:
        limit = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
        if not 0 < buffer.len <= limit:
            raise ConfigError(f"reward_model.overlong_buffer.len={buffer.len} must be in 1..{limit} (the response "
                              "length limit); DAPO uses about a quarter of it, e.g. "
                              f"reward_model.overlong_buffer.len={max(limit // 4, 1)}")
        if buffer.penalty_factor < 0:
            raise ConfigError(f"reward_model.overlong_buffer.penalty_factor must be >= 0, got {buffer.penalty_factor}")


def _differences_from_verl(cfg: DictConfig) -> list[str]:
    """Settings whose meaning here differs from verl's on purpose (docs/algorithms.md says why)."""
    out = []
    if estimator_needs(cfg.algorithm.adv_estimator).groups and cfg.actor_rollout_ref.rollout.n == 1:
        out.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} with actor_rollout_ref.rollout.n=1: each "
                   "group holds one response, with no other to compare it with, so its advantage is its raw score "
                   "(no baseline), as in verl; several responses per prompt (rollout.n) give the estimator its "
                   "baseline")
    if cfg.algorithm.use_pf_ppo and cfg.algorithm.adv_estimator != "gae":
        out.append(f"algorithm.use_pf_ppo=true with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: PF-PPO "
                   "reweights the rows of gae runs only, as in verl; this run trains on the batch as it is")
    actor, correction = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
    if actor.policy_loss.loss_mode == "gspo" and actor.loss_agg_mode != LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        out.append(f"actor_rollout_ref.actor.loss_agg_mode={actor.loss_agg_mode} with policy_loss.loss_mode=gspo: "
                   "GSPO's policy loss averages per sequence (seq-mean-token-mean) whatever loss_agg_mode says, as "
                   "in verl; loss_agg_mode applies to the entropy and KL terms")
    if correction.bypass_mode and correction.rollout_is is not None:
        out.append(f"algorithm.rollout_correction.rollout_is={correction.rollout_is} with bypass_mode=true: the PPO "
                   "ratio is already taken against the rollout's log-probs, so the importance weights are logged, "
                   "not applied (as in verl's bypass mode)")
    if cfg.algorithm.adv_estimator == AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE and cfg.algorithm.gamma != 1.0:
        out.append(f"algorithm.gamma={cfg.algorithm.gamma}: reinforce_plus_plus_baseline discounts the centred "
                   "score back from the last token here; verl ignores gamma for this estimator (same score on "
                   "every token)")
    return out


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def as_list(value: Any) -> list:
    """A str, a list, or a ListConfig as a plain list (data.train_files, trainer.logger accept all three)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple, ListConfig)):
        return list(value)
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        return [part.strip().strip("'\"") for part in text[1:-1].split(",") if part.strip()]
    return [text]
