"""The training passes' kernels: which SDPA backends the training passes may use, whether grouped K/V heads are
repeated for SDPA, the optimizer's step kernel, whether the decoder layers run compiled, and whether a
micro-batch's rows of one prompt share that prompt's tokens (prompt_sharing.py). Each function decides from the
plan built so far and the hardware, and returns the decision with its reason. Measurements behind these choices
are in docs/benchmarks.md, not in the reasons."""

from __future__ import annotations

import math
from typing import Optional

from ..plans import Plan
from ..vocabulary import ATTN_SDPA, COMPILE_TRAINING_MIN_CC, CUDNN_SDPA, FP32, SHARED_PROMPTS_MASKED, \
    SHARED_PROMPTS_VARLEN, PlanError, cc_str, dtype_name
from .device import Decision

# Model families whose attention prompt_sharing.shared_prompt_attention reproduces (transformers' SDPA path with RoPE
# from position_ids; sliding windows honoured): FastEngine's families
SHARED_PROMPT_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

COMPILED_WIDTH_MULTIPLE = 8
# auto compiles the training passes of runs of at least this many parameter-steps (steps x the model's parameters):
# compiling costs about the same tens of seconds for any model, and saves a share of each update that grows with the
# model. On one H200 the demo's job (SmolLM2-135M) spent 18 s compiling on an empty cache to save 0.02 s a step, and
# compiled layers made Qwen2.5-0.5B's update 1.6-1.8x faster (docs/benchmarks.md): SmolLM2-135M compiles from 224
# steps, 0.5B from 61, 1.5B from 20
COMPILE_MIN_PARAM_STEPS = 30e9


def compile_min_steps(params: int) -> int:
    """The fewest steps of a run whose training passes auto compiles, for a model of `params` parameters."""
    return max(1, math.ceil(COMPILE_MIN_PARAM_STEPS / max(params, 1)))


def decide_training_sdpa_backends(plan: Plan, sdpa_backends: list[str], on_cuda: bool) -> Decision:
    """Decision(tuple of SDPA backend names for the training passes, () = PyTorch's choice)."""
    if on_cuda and plan.attn_implementation == ATTN_SDPA and CUDNN_SDPA in sdpa_backends:
        backends = tuple(b for b in sdpa_backends if b != CUDNN_SDPA)
        return Decision(backends, (
            f"{', '.join(backends)}: cuDNN attention is left out of the training passes, whose sequence lengths "
            "change with every micro-batch; it builds an execution plan per new shape, which costs enough CPU time "
            "to make the update wait on the CPU"))
    return Decision((), "PyTorch's choice" if plan.attn_implementation == ATTN_SDPA else
                    f"attention is {plan.attn_implementation}, not SDPA")


def decide_kv_head_expansion(plan: Plan, sdpa_backends: list[str], on_cuda: bool) -> Decision:
    """Whether SDPA gets grouped-query models' K/V heads repeated per query head (models.sdpa_expanded_kv_attention,
    registered with transformers as vocabulary.SDPA_EXPANDED_KV).

    transformers hands SDPA the grouped heads with enable_gqa=True whenever a batch needs no mask, and packed rows
    never do. On CUDA only SDPA's flash kernel takes grouped heads; where it does not run, PyTorch falls back to
    its math kernel, which keeps T x T scores per head for the backward (more memory than the plan counted, and
    slower)."""
    if plan.attn_implementation != ATTN_SDPA:
        return Decision(False, f"attention is {plan.attn_implementation}, not SDPA")
    if not on_cuda:
        return Decision(False, "CPU: SDPA's flash kernel takes grouped K/V heads as they are")
    if "flash_attention" in sdpa_backends:
        return Decision(False, f"SDPA's flash kernel runs for {dtype_name(plan.compute_dtype)} here and takes grouped "
                               "K/V heads as they are")
    return Decision(True, (
        f"SDPA's flash kernel, the only CUDA kernel that takes grouped K/V heads, does not run for "
        f"{dtype_name(plan.compute_dtype)} on compute capability {cc_str(plan.compute_capability)} (bf16/fp16 on "
        ">= 8.0): given grouped heads, PyTorch falls back to its math kernel (T x T scores per head kept for the "
        "backward); repeated per query head they run in the memory-efficient kernel"))


def decide_fused_optimizer(plan: Plan, on_cuda: bool) -> Decision:
    """AdamW's fused step (one kernel per parameter group) where it applies, else its foreach step."""
    offloaded = plan.optimizer_offload or plan.param_offload
    fused = on_cuda and plan.data_parallel != "shard" and not offloaded and not plan.use_grad_scaler
    return Decision(fused, "CUDA: AdamW's fused step (one kernel per parameter group)" if fused else
                    "CPU: AdamW's foreach step" if not on_cuda else
                    "fp16 loss scaling unscales before clipping: AdamW's foreach step" if plan.use_grad_scaler else
                    "sharded parameters: AdamW's foreach step" if plan.data_parallel == "shard" else
                    "offloaded weights or optimizer state: AdamW's foreach step" if offloaded else
                    "AdamW's foreach step")


def plan_training_kernels(plan: Plan, sdpa_backends: list[str], on_cuda: bool) -> None:
    """Which SDPA backends the training passes may use, K/V head expansion, and the optimizer's step kernel."""
    for field, decision in (("training_sdpa_backends", decide_training_sdpa_backends(plan, sdpa_backends, on_cuda)),
                            ("expand_kv_heads", decide_kv_head_expansion(plan, sdpa_backends, on_cuda)),
                            ("fused_optimizer", decide_fused_optimizer(plan, on_cuda))):
        setattr(plan, field, decision.value)
        plan.reasons[field] = decision.reason


def decide_training_compile(plan: Plan, allowed: bool, on_cuda: bool, cc: Optional[tuple[int, int]],
                            triton: bool, requested: Optional[bool] = None, steps: Optional[int] = None,
                            params: Optional[int] = None) -> Decision:
    """Whether the training-side passes (log-probs, values, updates) run compiled: the actor's, reference's and
    critic's decoder layers (torch.compile, one graph per layer class) and the log-prob head's chunk math.
    requested: hardware.compile_training (None: auto); steps: the run's trainer.total_training_steps, where set;
    params: the actor's parameters (auto keeps a run of fewer than compile_min_steps(params) eager: compiling would
    not be repaid)."""
    refusals = (  # the first that applies is the reason
        (not allowed, "actor_rollout_ref.actor.use_torch_compile=false"),
        (requested is False, "hardware.compile_training=false"),
        (not on_cuda, "CPU: compiling takes tens of seconds per layer variant, not repaid by a CPU run's few steps"),
        (not triton, "triton is not installed, or no C compiler to build its kernels' launcher"),
        (cc is None or cc < COMPILE_TRAINING_MIN_CC,
         f"compute capability {cc_str(cc) if cc else 'unknown'} < {cc_str(COMPILE_TRAINING_MIN_CC)} (Triton does not "
         "run on Pascal; Volta and Turing not measured)"),
        (plan.data_parallel == "shard", "sharded models (FSDP2): compiled layers under fully_shard not measured here"),
        (plan.param_offload, "offloaded weights (moved between devices each phase): compiled layers not measured "
                             "there"),
    )
    why_not = next((reason for refused, reason in refusals if refused), None)
    if requested and why_not:
        raise PlanError(f"hardware.compile_training=true: {why_not}. Use hardware.compile_training=auto")
    fewest = compile_min_steps(params) if params else None
    if why_not is None and requested is None and fewest and steps is not None and 0 < steps < fewest:
        why_not = (f"a run of {steps} steps (trainer.total_training_steps) finishes sooner eager: compiling costs "
                   "tens of seconds before the first step on a machine whose compile cache lacks this model's "
                   "kernels, and saves a share of each update that grows with the model; runs of this model compile "
                   f"from {fewest} steps (hardware.compile_training=true compiles any run)")
    return Decision(why_not is None, why_not or (
        "torch.compile per decoder layer (dynamic shapes, one graph shared by every layer) and of the log-prob "
        "head's softmax math: the norms, RoPE, SiLU*mul, residual adds and casts run as fused kernels, a faster "
        "update (docs/benchmarks.md); the first step pays the compile (cached on disk). "
        f"Micro-batch widths are rounded up to a multiple of {COMPILED_WIDTH_MULTIPLE} (padding after every row): "
        "inductor compiles a separate graph for other widths"))


def plan_training_compile(plan: Plan, allowed: bool, on_cuda: bool, cc: Optional[tuple[int, int]],
                          triton: bool, requested: Optional[bool] = None, steps: Optional[int] = None,
                          params: Optional[int] = None) -> None:
    decision = decide_training_compile(plan, allowed, on_cuda, cc, triton, requested, steps, params)
    plan.compile_training = decision.value
    # inductor compiles a graph for widths that are multiples of 8 and another for the rest (an alignment guard)
    plan.micro_batch_width_multiple = COMPILED_WIDTH_MULTIPLE if plan.compile_training else 1
    plan.reasons["compile_training"] = decision.reason


def decide_prompt_sharing(plan: Plan, requested: Optional[bool], samples_per_prompt: int, model_type: str,
                          flash_runs: bool, varlen: bool) -> tuple[Decision, Decision]:
    """(share_prompts, shared_prompt_kernel): whether training micro-batches run as one token stream with each
    distinct prompt once (prompt_sharing.py): a group's n samples then push its prompt through the layers, forward
    and backward, once instead of n times, and with which attention. Where packed rows run SDPA's flash kernel
    (bf16/fp16 on compute capability >= 8.0), the stream needs PyTorch's varlen flash attention (varlen: whether this
    torch has it) and compiled passes to pay, or checkpointing (the forward runs twice); elsewhere packed rows run
    the masked kernels anyway."""
    refusal = (f"attention is {plan.attn_implementation}; shared prompts run through SDPA"
               if plan.attn_implementation != ATTN_SDPA else
               f"model type {model_type!r} is not one whose attention it reproduces ({', '.join(SHARED_PROMPT_MODEL_TYPES)})"
               if model_type not in SHARED_PROMPT_MODEL_TYPES else None)
    if requested and refusal:
        raise PlanError(f"hardware.share_prompts=true: {refusal}. Use hardware.share_prompts=auto")
    use_varlen = flash_runs and varlen
    kernel_why = ("varlen flash attention over the stream: fewer tokens through every layer, no padded slots"
                  if use_varlen else
                  "checkpointing runs the forward twice, so the prompt tokens saved count twice" if flash_runs else
                  "fewer tokens through every layer, and packed rows run the masked attention kernels here anyway"
                  if plan.compute_dtype == FP32 else
                  "no flash kernel here: packed rows run the masked kernels too")
    if requested is False:
        share, reason = False, "off: hardware.share_prompts=false"
    elif refusal:
        share, reason = False, f"off: {refusal}"
    elif requested:
        share, reason = True, "hardware.share_prompts=true"
    elif samples_per_prompt < 2:
        share, reason = False, "off: one sample per prompt (actor_rollout_ref.rollout.n=1), none to share"
    elif flash_runs and not use_varlen and not plan.gradient_checkpointing:
        share = False
        reason = (f"off: packed rows run SDPA's flash kernel for {dtype_name(plan.compute_dtype)} here, which takes no "
                  f"mask, and this torch has no varlen flash attention (torch.nn.attention.varlen, torch >= 2.10); "
                  "the masked attention would cost more than the prompt tokens it saves")
    elif use_varlen and not plan.compile_training and not plan.gradient_checkpointing:
        share = False
        reason = ("off: training passes not compiled: uncompiled, the per-layer gathers and the varlen call cost more "
                  "time than the prompt tokens they save")
    else:
        share = True
        reason = (f"{samples_per_prompt} samples per prompt: a micro-batch's rows of one prompt run its tokens once, "
                  f"forward and backward; attention gathers each response's keys ({kernel_why})")
    kernel = Decision(
        SHARED_PROMPTS_VARLEN if use_varlen else SHARED_PROMPTS_MASKED,
        "flash over variable-length sequences (torch.nn.attention.varlen): no mask, no padded slots" if use_varlen else
        "SDPA with a boolean mask over padded sequence slots" + (
            "" if not flash_runs else " (no varlen flash attention in this torch)" if not varlen else ""))
    return Decision(share, reason), kernel


def plan_prompt_sharing(plan: Plan, requested: Optional[bool], samples_per_prompt: int, model_type: str,
                        flash_runs: bool, varlen: Optional[bool] = None) -> None:
    """Applies decide_prompt_sharing to `plan` (varlen None: look whether this torch has varlen flash attention, where
    a flash kernel runs; elsewhere it is not read, and importing it costs seconds: it imports torch._dynamo)."""
    if varlen is None:
        from ..machine import varlen_attention_function

        varlen = flash_runs and varlen_attention_function() is not None
    share, kernel = decide_prompt_sharing(plan, requested, samples_per_prompt, model_type, flash_runs, varlen)
    plan.share_prompts, plan.reasons["share_prompts"] = share.value, share.reason
    plan.shared_prompt_kernel, plan.reasons["shared_prompt_kernel"] = kernel.value, kernel.reason
