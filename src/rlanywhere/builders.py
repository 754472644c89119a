"""Build what a run trains with, from the config and the plan: tokenizer, data, reward, models (actor, critic,
reference, LoRA, gradient checkpointing), optimizers with their schedules, and the rollout engine.

Each builder takes the config/plan and returns objects; none decides anything about the hardware (the plan did).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from .config import as_list
from .data import PromptLoader, RLDataset
from .data.loader import chat_template_kwargs
from .plans import Plan
from .lora import apply_lora, load_adapter_state
from .models import (ModelFilesError, ModelSource, ValueModel, compile_decoder_layers, enable_gradient_checkpointing,
                     load_causal_lm, load_tokenizer, resolve_model_source)
from .reward_model import rows_need_answers, wrap_reward_manager
from .rewards import RewardManager, custom_reward_from_config
from .rollout import make_engine
from .rollout.multiturn import prompt_render_with_tools
from .sharding import gathered, shard_for_plan


def _plain(value):
    """An OmegaConf list as a plain list (peft wants list or str)."""
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


# ---------------------------------------------------------------------------------------------- tokenizer, data
def lora_model(model, model_cfg: DictConfig):
    """`model` with LoRA adapters as `model_cfg` says (rank, alpha, targets, exclusions), holding the weights of the
    adapter at its lora_adapter_path where one is given (verl's: a run that starts from a trained adapter)."""
    peft_model = apply_lora(model, model_cfg.lora_rank, model_cfg.lora_alpha, _plain(model_cfg.target_modules),
                            exclude_modules=_plain(model_cfg.exclude_modules))
    if model_cfg.lora_adapter_path:
        from safetensors.torch import load_file

        folder = os.path.expanduser(str(model_cfg.lora_adapter_path))
        weights = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(weights):
            raise ModelFilesError(f"lora_adapter_path={folder}: no adapter_model.safetensors there (adapters are read "
                                  "from safetensors only; re-save the adapter with peft's save_pretrained)")
        try:
            load_adapter_state(peft_model, load_file(weights), folder)
        except ValueError as err:
            raise ModelFilesError(str(err)) from None
    return peft_model


def build_tokenizer(cfg: DictConfig):
    """(the actor's model source, the tokenizer: data.tokenizer or model.tokenizer_path, else the model's)."""
    model_cfg = cfg.actor_rollout_ref.model
    source = resolve_model_source(model_cfg.path, model_cfg.gguf_file)
    named = cfg.data.tokenizer or model_cfg.tokenizer_path
    return source, load_tokenizer(ModelSource(named) if named else source, model_cfg.trust_remote_code)


@dataclass
class Data:
    train_set: RLDataset
    val_set: Optional[RLDataset]
    loader: PromptLoader


def build_data(cfg: DictConfig, tokenizer) -> Data:
    data_cfg = cfg.data

    render_ids = prompt_render_with_tools(cfg, tokenizer)

    def dataset(files):
        return RLDataset(as_list(files), tokenizer, data_cfg.max_prompt_length, prompt_key=data_cfg.prompt_key,
                         truncation=data_cfg.truncation, filter_overlong_prompts=data_cfg.filter_overlong_prompts,
                         reward_fn_key=data_cfg.reward_fn_key, answers=rows_need_answers(cfg),
                         chat_template_kwargs=chat_template_kwargs(data_cfg),
                         render_ids=render_ids)

    train_set = dataset(data_cfg.train_files)
    if data_cfg.train_max_samples is not None and 0 < data_cfg.train_max_samples < len(train_set):
        train_set.items = train_set.items[:data_cfg.train_max_samples]  # verl's data.train_max_samples
    val_set = dataset(data_cfg.val_files) if data_cfg.val_files else None
    # with dynamic sampling a step draws gen_batch_size prompts per generation round (verl's DAPO trainer)
    loader = PromptLoader(train_set, data_cfg.gen_batch_size or data_cfg.train_batch_size, shuffle=data_cfg.shuffle,
                          seed=data_cfg.seed if data_cfg.seed is not None else cfg.trainer.seed)
    return Data(train_set, val_set, loader)


def build_reward_manager(cfg: DictConfig, plan: Optional[Plan] = None) -> RewardManager:
    custom = cfg.custom_reward_function
    rules = RewardManager(custom_reward_from_config(custom), timeout_s=custom.timeout_s)
    return wrap_reward_manager(cfg, plan, rules) if plan is not None else rules  # reward_model.py


# ---------------------------------------------------------------------------------------------- models
@dataclass
class Models:
    actor: torch.nn.Module
    critic: Optional[ValueModel]  # PPO/GAE only
    ref: Optional[torch.nn.Module]  # a frozen copy of the initial actor; None without KL or with LoRA


def build_models(cfg: DictConfig, plan: Plan, source: ModelSource, dp, actor_only: bool = False) -> Models:
    """Actor (+LoRA), critic (from the actor's or its own weights, +LoRA on its backbone), reference, on the plan's
    devices; [distributed] broadcast from rank 0 so every replica starts identical. actor_only: the actor alone
    (a split placement's rollout rank generates from it and trains nothing)."""
    model_cfg, device = cfg.actor_rollout_ref.model, plan.device
    actor = load_causal_lm(source, plan, model_cfg.trust_remote_code, model_cfg.override_config)
    # The critic is built first: it copies the actor's backbone before LoRA layers are injected into it.
    critic = None
    if plan.use_critic and not actor_only:
        critic_model_cfg = cfg.critic.model
        base = actor  # the critic starts from the actor's weights (before any LoRA is injected)
        if critic_model_cfg.path and critic_model_cfg.path != model_cfg.path:
            base = load_causal_lm(resolve_model_source(critic_model_cfg.path, critic_model_cfg.gguf_file), plan,
                                  critic_model_cfg.trust_remote_code, critic_model_cfg.override_config)
        critic = ValueModel.from_causal_lm(base).to(device)
        if critic_model_cfg.lora_rank > 0:
            # LoRA on the backbone only: the value head is new and is trained in full.
            critic.backbone = lora_model(critic.backbone, critic_model_cfg)
    if plan.use_lora:
        actor = lora_model(actor, model_cfg)
    ref = None
    if plan.use_ref and not plan.use_lora and not actor_only:  # with LoRA: the adapter-disabled base
        # Same weights as the initial actor; a copy avoids loading (and dequantizing) twice.
        ref = copy.deepcopy(actor).to(plan.ref_device).eval().requires_grad_(False)
    actor.to(device)
    for model in (actor, critic, ref):
        dp.broadcast_parameters(model)  # [distributed] identical replicas from the first step
    if plan.gradient_checkpointing:
        enable_gradient_checkpointing(actor)
        if critic is not None:
            enable_gradient_checkpointing(critic)
    if plan.compile_training:  # after checkpointing: a checkpointed layer recomputes its compiled forward
        for model in (actor, critic, ref):
            if model is not None:
                compile_decoder_layers(model)
    shard_for_plan(plan, actor, critic, ref)  # [distributed] FSDP2 when plan.data_parallel == "shard"
    return Models(actor, critic, ref)


# ---------------------------------------------------------------------------------------------- optimizers
def make_scheduler(optimizer, optim_cfg, total_steps: int):
    """verl's schedules: linear warm-up, then constant or cosine decay to min_lr_ratio * lr."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    warmup = optim_cfg.lr_warmup_steps
    if warmup < 0:
        warmup = int(optim_cfg.lr_warmup_steps_ratio * total_steps)
    schedule = optim_cfg.warmup_style or optim_cfg.lr_scheduler_type  # verl: the older key wins where set
    if schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total_steps,
                                                           min_lr_rate=optim_cfg.min_lr_ratio)
    if schedule != "constant":
        raise ValueError(f"optim.lr_scheduler_type={schedule!r}: use constant or cosine")
    return get_constant_schedule_with_warmup(optimizer, warmup)


def optim_configs(cfg: DictConfig) -> dict:
    """The optim section of each trained model, by optimizer name."""
    return {"actor": cfg.actor_rollout_ref.actor.optim, "critic": cfg.critic.optim}


def build_optimizers(cfg: DictConfig, models: Models, total_steps: int, fused: bool = False) -> tuple[dict, dict]:
    """AdamW over the trainable parameters of the actor (and critic), each with its schedule: (optimizers,
    schedulers), keyed "actor" / "critic"."""
    trained = {"actor": models.actor, "critic": models.critic}
    optimizers, schedulers = {}, {}
    for name, optim_cfg in optim_configs(cfg).items():
        if trained[name] is None:
            continue
        params = [p for p in trained[name].parameters() if p.requires_grad]
        # fused: one kernel per step where the plan says so (plan.fused_optimizer), else torch's default (foreach)
        optimizers[name] = torch.optim.AdamW(params, lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                                             weight_decay=optim_cfg.weight_decay, fused=fused or None)
        schedulers[name] = make_scheduler(optimizers[name], optim_cfg, total_steps)
    return optimizers, schedulers


def apply_optim_config(cfg: DictConfig, optimizers: dict, schedulers: dict) -> None:
    """A resumed optimizer/scheduler carries the old lr, betas and weight decay: the config's values win."""
    for name, optimizer in optimizers.items():
        optim_cfg, scheduler = optim_configs(cfg)[name], schedulers[name]
        scheduler.base_lrs = [optim_cfg.lr] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group.update(initial_lr=optim_cfg.lr, lr=optim_cfg.lr * factor(scheduler.last_epoch),
                         betas=tuple(optim_cfg.betas), weight_decay=optim_cfg.weight_decay)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


# ---------------------------------------------------------------------------------------------- rollout engine
def build_engine(cfg: DictConfig, plan: Plan, actor, tokenizer):
    """The rollout engine, sharing the actor's weights, sized by plan.rollout. A fast engine that fell back to HF
    says why in its `fallback_reason` (the trainer's RunState records it: plan.json shows what runs)."""
    with gathered(actor):  # [distributed] a sharded actor: the engine is built on its full weights
        return make_engine(actor, tokenizer, plan, engine=cfg.actor_rollout_ref.rollout.name)

