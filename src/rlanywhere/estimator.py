"""Memory estimator: predicted peak bytes per training phase from a model's shape alone (no weights loaded).

The trainer runs six phases per step; each has its own peak (what is resident on the device plus what that
phase allocates on top):

    rollout        resident weights + KV cache for the generation batch + prefill/sampling transients
    old_log_prob   resident + one no-grad micro-batch through the actor + chunked logits
    ref_log_prob   resident (+ the reference if it is parked on CPU) + one no-grad micro-batch
    values         resident + one no-grad micro-batch through the critic
    actor_update   resident + grads + activations of one micro-batch (with or without checkpointing) + logits chunks
    critic_update  resident + grads + activations of one critic micro-batch

Every phase also holds the fast rollout engine's own weight copies (it keeps them between rollouts): a cast copy
when rollouts run in another dtype, LoRA-merged linear weights, or small fused QKV / gate-up copies.

`estimate_memory` gives those numbers with a component breakdown; `fit_settings` searches gradient
checkpointing, reference placement, offload and micro-batch sizes for the cheapest setting that fits a budget;
`explain_no_fit` says what would fit when nothing does. All constants that will be calibrated against measured
peaks are named at the top of this file.

Activation model (Llama / Qwen2 / Mistral decoder layer, SDPA attention, per token per layer). HF's RMSNorm
upcasts to fp32; under autocast the residual stream stays in the parameter dtype (fp32) while matmul outputs are in
the compute dtype, and autocast casts the normed input separately for each projection that reads it:

    saved bytes = NORMS_PER_LAYER * RMSNORM_SAVED_COPIES * H * residual_bytes        (norm input + normalized)
                + compute_bytes * ( qkv_inputs * H         (3 casts under autocast, 1 otherwise)
                                  + mlp_inputs * H         (2 casts under autocast, 1 otherwise)
                                  + q_dim                  (o_proj input)
                                  + I                      (down_proj input)
                                  + 2 * q_dim + 2 * kv_dim (SDPA saves q, out, and k, v after GQA repeat)
                                  + MLP_SAVED_INTERMEDIATES * I )   (gate output, SiLU output, up output)

e.g. bf16 autocast with fp32 residual: 36 H + 8 I bytes; plain fp32: 44 H + 16 I bytes (k and v counted repeated to
every query head; where SDPA takes the grouped heads as they are, `Workload.kv_heads_repeated` off, 2 kv_dim). The
eager path and SDPA's math backend also keep the attention matrix: heads x seq_len x (fp32 softmax + compute-dtype
probs) per token.
With gradient checkpointing each layer keeps only its input (H x residual bytes) and one layer is recomputed at a
time.

Compiled decoder layers (`Workload.compiled_layers`, plan.compile_training) keep far less: AOTAutograd's min-cut
partitioner saves the matmul and attention outputs and recomputes the norms, casts, RoPE and residual sums in the
backward (the same saved set in fp32, bf16 and bf16 autocast):

    saved bytes = H * residual_bytes                                (the layer's input)
                + compute_bytes * ( 2 * H                           (the normed input, cast once for q/k/v, once for
                                                                     gate/up)
                                  + H                               (o_proj output: the second residual is recomputed)
                                  + 2 * q_dim + 2 * kv_dim          (q, k after RoPE, v, SDPA's output: o_proj's input)
                                  + MLP_SAVED_INTERMEDIATES * I )   (gate output, up output, SiLU(gate) * up)
                + heads * 4 + NORMS_PER_LAYER * 4                   (SDPA's log-sum-exp, the norms' reciprocal RMS)

e.g. bf16 autocast with fp32 residual and grouped k/v (q_dim = H): 14 H + 4 kv_dim + 6 I bytes (+ the statistics),
0.6x the eager layer for Qwen2.5-0.5B.

Logits are never materialised for the whole batch: log-probs are computed in chunks of `logprob_chunk_size` tokens
(see logprobs.py), so only a chunk x vocab buffer set is alive.

Sequences are assumed to be full length (prompt_length + response_length): the estimate is a worst case. With
shared prompts (`Workload.share_prompts`, prompt_sharing.py) a micro-batch carries each distinct prompt once: its
tokens are counted as prompts x prompt_length + rows x response_length (`micro_batch_tokens`), plus per layer what
its attention keeps of the sequences it gathers (`shared_attention_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

import torch

from .model_shape import NORMS_PER_LAYER, ModelShape
from .vocabulary import SHARED_PROMPTS_MASKED, SHARED_PROMPTS_VARLEN

GIB = 1024 ** 3
MIB = 1024 ** 2

# ----------------------------------------------------------------------------------- calibration constants
# Budget: how much of a card's memory the planner lets itself use.
SAFETY_FRACTION = 0.90  # headroom for fragmentation, cuBLAS/cuDNN workspaces, allocator rounding
CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context + kernels images: outside torch's allocator
CPU_RAM_FRACTION = 0.80  # of available RAM, when training on CPU

# Training state.
GRAD_BYTES_PER_PARAM = 4  # gradients in the fp32 master dtype
ADAM_STATES_PER_PARAM = 2  # exp_avg and exp_avg_sq
ADAM_STATE_BYTES = 4  # fp32
OPTIMIZER_STEP_TEMP_COPIES = 1.0  # foreach Adam: one parameter-sized fp32 temporary list during step()

# Activations (per token per layer, see the module docstring).
RMSNORM_SAVED_COPIES = 2
MLP_SAVED_INTERMEDIATES = 3
NOGRAD_RESIDUAL_COPIES = 3  # residual, normed, and the sum being formed, alive at once inside a layer
NOGRAD_MLP_INTERMEDIATES = 3  # gate, up, SiLU(gate)*up alive at once
BACKWARD_TRANSIENT_I = 2  # grads of the two widest intermediates (gate, up) alive during one layer's backward
BACKWARD_TRANSIENT_H = 2  # residual grad + the grad being added to it
ATTENTION_SCORE_EXTRA_BYTES = 4  # eager/math attention: fp32 softmax on top of the compute-dtype probs
ACTIVATION_CALIBRATION = 1.0  # multiplies every activation term; set from measured peaks on real GPUs

# Logits, computed in chunks of logprob_chunk_size tokens.
LOGIT_CHUNK_FP32_COPIES_GRAD = 3  # fp32 logits, log_softmax, softmax (entropy / grad) of one chunk
LOGIT_CHUNK_FP32_COPIES_NOGRAD = 2
LOGIT_CHUNK_TARGET_FRACTION = 0.04  # logits chunk buffers may take this share of the budget ...
LOGIT_CHUNK_MAX_BYTES = 1 * GIB  # ... but no more than this
LOGIT_CHUNK_MIN_TOKENS = 16
LOGIT_CHUNK_MAX_TOKENS = 8192

# Rollout.
KV_TENSORS = 2  # keys and values
# FastEngine keeps fused QKV and gate/up copies (same dtype, no LoRA) only when they take <= this share of the
# memory budget; the planner decides it from this constant so the engine and the estimate agree.
FUSED_COPY_BUDGET_FRACTION = 0.05
SAMPLING_BYTES_PER_LOGIT = 24  # last-position logits: fp32 logits, probs, sorted values (4) + indices (8), cumsum

# Search.
MIN_TOKENS_PER_MICRO_BATCH = 2048  # below this a GPU matmul is badly under-used: prefer checkpointing
# Update micro-batches stop at MAX_TOKENS_PER_MICRO_BATCH, and grow on to MAX_TOKENS_PER_ROOMY_MICRO_BATCH while the
# update's peak stays under ROOMY_PEAK_FRACTION of the budget. Fewer, larger micro-batches launch fewer kernels: on
# an H200 a Qwen2.5-0.5B-shaped GRPO update of 128 x (~150 + 256) tokens took 0.671 s in 32-row micro-batches and
# 0.623 s in 64-row ones without checkpointing, 0.875 s vs 0.750 s in 32- vs 128-row ones with it; but 128 rows
# without checkpointing (91 GiB) took 0.722 s and pushed the peak past the planner's KV-release threshold, so the
# rollout recaptured its graphs every step: 1.70 s a step instead of 1.25 (bench/vs_trl.py --ours, 2026-11-30).
MAX_TOKENS_PER_MICRO_BATCH = 16384
MAX_TOKENS_PER_ROOMY_MICRO_BATCH = 65536
ROOMY_PEAK_FRACTION = 0.6  # growth stops here, leaving the rollout's KV cache room beside the update (planner)
MAX_TOKENS_PER_FORWARD_MICRO_BATCH = 32768  # no-grad forwards keep far less, so they may take twice as many
# Shared prompts, masked kernel: a prompt's queries run in chunks as long as the longest response, but no shorter than
# this (prompt_sharing.py), so very short responses do not cut a prompt into hundreds of sequences, each holding
# keys as long as the longest (memory quadratic in the prompt)
PROMPT_CHUNK_MIN = 64
DEFAULT_LORA_RANK_SUGGESTION = 16

PHASES = ("rollout", "old_log_prob", "ref_log_prob", "values", "actor_update", "critic_update")


# ----------------------------------------------------------------------------------------- the workload
@dataclass
class Workload:
    """What the run asks for (fixed by config and the precision / attention decisions)."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    rollout_dtype: torch.dtype
    use_autocast: bool
    prompts_per_step: int  # data.train_batch_size per device
    samples_per_prompt: int  # rollout.n
    prompt_length: int
    response_length: int
    actor_mini_batch: int  # sequences per optimizer step
    critic_mini_batch: int
    has_critic: bool
    has_ref: bool  # a separate reference model (False with LoRA: the ref is the adapter-disabled base)
    actor_lora_rank: int = 0
    critic_lora_rank: int = 0
    attention_materializes_scores: bool = False  # eager attention or SDPA's math backend
    on_cuda: bool = True
    use_dynamic_bsz: bool = False
    token_budget_cap: Optional[int] = None  # ppo_max_token_len_per_gpu when use_dynamic_bsz
    rollout_engine: str = "fast"  # "hf" owns no weight copies
    rollout_layout_copies: bool = False  # FastEngine keeps [in, out] copies of o_proj and the LM head (fp32 decode)
    # FSDP2 sharding over this many ranks (plan.data_parallel == "shard"): weights, gradients and Adam states are
    # divided by it; the full weights exist only while gathered (sharding.py): for the rollout and the no-grad
    # passes (the whole model, in gather_dtype), in updates two decoder layers at a time plus the root group
    shard_world: int = 1
    gather_dtype: Optional[torch.dtype] = None  # the MixedPrecisionPolicy's param_dtype; None: param_dtype
    share_prompts: bool = False  # micro-batches carry each distinct prompt once (plan.share_prompts)
    # the training passes' kernels (planned after the memory search, which assumes the eager defaults: a bound)
    compiled_layers: bool = False  # decoder layers run under torch.compile (plan.compile_training)
    kv_heads_repeated: bool = True  # SDPA gets k/v repeated per query head (False: grouped heads, plan.expand_kv_heads)
    shared_prompt_kernel: str = SHARED_PROMPTS_MASKED  # shared prompts' attention (plan.shared_prompt_kernel)

    @property
    def seq_len(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def rollout_sequences(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


@dataclass
class Placement:
    """The knobs fit_settings searches (and the plan reports)."""

    gradient_checkpointing: bool = False
    optimizer_offload: bool = False
    param_offload: bool = False
    ref_on_device: bool = True  # False: the reference is parked on CPU, moved in only for its forward
    actor_micro_batch: int = 1  # sequences
    critic_micro_batch: int = 1
    logprob_micro_batch: int = 1  # no-grad forwards: old log-probs, ref log-probs, values
    max_token_len: Optional[int] = None  # token budget per update micro-batch (use_dynamic_bsz)
    logprob_chunk_size: int = 1024
    rollout_batch: int = 1  # sequences generated at once

    def to_dict(self) -> dict:
        return asdict(self)


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def format_bytes(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


# ----------------------------------------------------------------------------------- activation formulas
def layer_saved_bytes_per_token(shape: ModelShape, compute_bytes: int, residual_bytes: int, autocast: bool,
                                kv_heads_repeated: bool = True) -> int:
    """Bytes one eager decoder layer saves for backward, per token (module docstring has the derivation)."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    norms = NORMS_PER_LAYER * RMSNORM_SAVED_COPIES * hidden * residual_bytes
    linear_inputs = (3 if autocast else 1) * hidden + (2 if autocast else 1) * hidden + shape.q_dim + inter
    # k and v as SDPA saves them: repeated to the query head count unless the kernel takes grouped heads
    attention = 2 * shape.q_dim + 2 * (shape.q_dim if kv_heads_repeated else shape.kv_dim)
    mlp = MLP_SAVED_INTERMEDIATES * inter
    return norms + compute_bytes * (linear_inputs + attention + mlp)


def compiled_layer_saved_bytes_per_token(shape: ModelShape, compute_bytes: int, residual_bytes: int,
                                         kv_heads_repeated: bool = True) -> int:
    """Bytes one compiled decoder layer saves for backward, per token: the matmul and attention outputs only, the
    pointwise work between them recomputed in the backward (module docstring has the derivation)."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    kv = shape.q_dim if kv_heads_repeated else shape.kv_dim
    saved = (2 * hidden + hidden + 2 * shape.q_dim + 2 * kv + MLP_SAVED_INTERMEDIATES * inter) * compute_bytes
    statistics = shape.num_heads * 4 + NORMS_PER_LAYER * 4  # fp32 log-sum-exp per head, reciprocal RMS per norm
    return hidden * residual_bytes + saved + statistics


def attention_scores_bytes_per_token(shape: ModelShape, seq_len: int, compute_bytes: int) -> int:
    """Eager / math attention keeps a heads x seq_len row of probabilities per token."""
    return shape.num_heads * seq_len * (compute_bytes + ATTENTION_SCORE_EXTRA_BYTES)


def nograd_layer_bytes_per_token(shape: ModelShape, compute_bytes: int, residual_bytes: int) -> int:
    """Peak working set inside one layer of a no-grad forward, per token (layers run one after another)."""
    return (NOGRAD_RESIDUAL_COPIES * shape.hidden_size * residual_bytes
            + compute_bytes * (4 * shape.q_dim + NOGRAD_MLP_INTERMEDIATES * shape.intermediate_size))


def training_activation_bytes(shape: ModelShape, tokens: int, seq_len: int, compute_bytes: int,
                              residual_bytes: int, autocast: bool, checkpointing: bool,
                              scores_materialized: bool, compiled: bool = False, kv_heads_repeated: bool = True
                              ) -> int:
    """Activations alive at the peak of one micro-batch's backward (`compiled`: the decoder layers run compiled)."""
    per_layer = (compiled_layer_saved_bytes_per_token(shape, compute_bytes, residual_bytes, kv_heads_repeated)
                 if compiled else
                 layer_saved_bytes_per_token(shape, compute_bytes, residual_bytes, autocast, kv_heads_repeated))
    if scores_materialized:
        per_layer += attention_scores_bytes_per_token(shape, seq_len, compute_bytes)
    if checkpointing:
        # every layer keeps its input; one layer at a time is recomputed with full activations
        saved = shape.num_layers * shape.hidden_size * residual_bytes + per_layer
    else:
        saved = shape.num_layers * per_layer
    final_norm = RMSNORM_SAVED_COPIES * shape.hidden_size * residual_bytes
    transient = (BACKWARD_TRANSIENT_I * shape.intermediate_size * compute_bytes
                 + BACKWARD_TRANSIENT_H * shape.hidden_size * residual_bytes)
    return int(ACTIVATION_CALIBRATION * tokens * (saved + final_norm + transient))


def nograd_activation_bytes(shape: ModelShape, tokens: int, seq_len: int, compute_bytes: int, residual_bytes: int,
                            scores_materialized: bool) -> int:
    per_layer = nograd_layer_bytes_per_token(shape, compute_bytes, residual_bytes)
    if scores_materialized:
        per_layer += attention_scores_bytes_per_token(shape, seq_len, compute_bytes)
    return int(ACTIVATION_CALIBRATION * tokens * (per_layer + shape.hidden_size * residual_bytes))


def logits_chunk_bytes(shape: ModelShape, tokens: int, chunk_size: int, compute_bytes: int, with_grad: bool) -> int:
    chunk = min(chunk_size, tokens)
    copies = LOGIT_CHUNK_FP32_COPIES_GRAD if with_grad else LOGIT_CHUNK_FP32_COPIES_NOGRAD
    buffers = chunk * shape.vocab_size * (compute_bytes + 4 * copies)
    # the backward accumulates d(hidden) for the whole micro-batch, one chunk at a time
    hidden_grad = tokens * shape.hidden_size * 4 if with_grad else 0
    return buffers + hidden_grad


def prompts_per_micro_batch(rows: int, samples_per_prompt: int) -> int:
    """The most distinct prompts in a micro-batch of `rows` rows cut from groups of `samples_per_prompt` rows kept
    next to each other (prompt_sharing.split_rows_keeping_prompts): whole groups when the group size divides `rows`,
    one prompt when `rows` divides the group size; otherwise a cut can fall inside a group at either end."""
    n = max(1, samples_per_prompt)
    if rows % n == 0:
        return rows // n
    if n % rows == 0:
        return 1
    return min(rows, (rows - 1) // n + 2)


def shared_stream_tokens(rows: int, samples_per_prompt: int, prompt_length: int, response_length: int) -> int:
    """Stream tokens of a shared-prompt micro-batch of `rows` full-length rows: each distinct prompt once."""
    return prompts_per_micro_batch(rows, samples_per_prompt) * prompt_length + rows * response_length


def micro_batch_tokens(workload: Workload, rows: int) -> int:
    """Tokens through the layers for a micro-batch of `rows` full-length rows: each row's prompt and response, or
    with shared prompts each distinct prompt once."""
    if not workload.share_prompts:
        return rows * workload.seq_len
    return shared_stream_tokens(rows, workload.samples_per_prompt, workload.prompt_length, workload.response_length)


def shared_attention_bytes(shape: ModelShape, workload: Workload, rows: int, compute_bytes: int) -> int:
    """Shared prompts, per layer: what the stream's attention keeps for the backward beyond a packed row's per-token
    tensors, 0 for packed rows. It gathers every sequence's keys and values from the stream: a sequence per row (its
    prompt and response) and one per prompt (the prompt's own queries). The masked kernel lays them out as long as
    the longest, prompts in chunks about a response long, queries and outputs in padded slots too; varlen flash
    gathers each sequence's keys unpadded, and its queries and outputs are the stream's own (prompt_sharing.py)."""
    if not workload.share_prompts:
        return 0
    prompt, response = workload.prompt_length, workload.response_length
    prompts = prompts_per_micro_batch(rows, workload.samples_per_prompt)
    if workload.shared_prompt_kernel == SHARED_PROMPTS_VARLEN:
        kv_width = shape.q_dim if workload.kv_heads_repeated else shape.kv_dim
        return (prompts * prompt + rows * workload.seq_len) * 2 * kv_width * compute_bytes
    chunk = max(response, PROMPT_CHUNK_MIN)
    sequences = rows + prompts * math.ceil(prompt / chunk)
    queries = max(min(chunk, prompt), response)
    return sequences * (workload.seq_len + queries) * 2 * shape.q_dim * compute_bytes


def kv_cache_bytes(shape: ModelShape, sequences: int, seq_len: int, rollout_bytes: int) -> int:
    return KV_TENSORS * shape.num_layers * shape.kv_dim * sequences * seq_len * rollout_bytes


def fused_copy_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    """Bytes of FastEngine's fused QKV and gate/up weight copies in `dtype` (the planner compares them with
    FUSED_COPY_BUDGET_FRACTION of the budget; the estimate counts them when kept)."""
    linear = {name: n_in * n_out for name, n_in, n_out in shape.linear_shapes()}
    return shape.num_layers * _nbytes(dtype) * sum(linear[k] for k in ("q_proj", "k_proj", "v_proj", "gate_proj",
                                                                        "up_proj"))


def layout_copy_bytes(shape: ModelShape, dtype: torch.dtype) -> int:
    """Bytes of FastEngine's [in, out] copies of every o_proj and of the LM head (RolloutPlan.fp32_gemm_layouts;
    the planner compares them with FUSED_COPY_BUDGET_FRACTION of the budget)."""
    o_proj = next(n_in * n_out for name, n_in, n_out in shape.linear_shapes() if name == "o_proj")
    return _nbytes(dtype) * (shape.num_layers * o_proj + shape.embedding_params())


def rollout_engine_weight_bytes(shape: ModelShape, workload: Workload, budget_bytes: Optional[int]) -> int:
    """Weights FastEngine owns for the whole run, next to the actor's: a cast copy of the model when rollouts run
    in another dtype; else LoRA-merged copies of the linear layers (counted for all seven); else fused QKV and
    gate/up copies when they take <= FUSED_COPY_BUDGET_FRACTION of the budget (on CUDA). Plus the o_proj and LM
    head copies of `rollout_layout_copies` (planned within the same fraction). HFEngine owns none."""
    if workload.rollout_engine != "fast":
        return 0
    layouts = layout_copy_bytes(shape, workload.rollout_dtype) if workload.rollout_layout_copies else 0
    rollout_bytes = _nbytes(workload.rollout_dtype)
    if workload.rollout_dtype != workload.param_dtype:
        return shape.num_params() * rollout_bytes + layouts
    linear = {name: n_in * n_out for name, n_in, n_out in shape.linear_shapes()}
    if workload.actor_lora_rank > 0:
        return shape.num_layers * sum(linear.values()) * rollout_bytes + layouts
    fused = fused_copy_bytes(shape, workload.rollout_dtype)
    if workload.on_cuda and (budget_bytes is None or fused <= FUSED_COPY_BUDGET_FRACTION * budget_bytes):
        return fused + layouts
    return layouts


def choose_logprob_chunk_size(vocab_size: int, budget_bytes: int, compute_bytes: int = 4) -> int:
    """Largest power of two of tokens whose logits buffers stay under a small share of the budget."""
    target = min(LOGIT_CHUNK_MAX_BYTES, LOGIT_CHUNK_TARGET_FRACTION * budget_bytes)
    per_token = vocab_size * (compute_bytes + 4 * LOGIT_CHUNK_FP32_COPIES_GRAD)
    tokens = max(1, int(target // per_token))
    chunk = 2 ** int(math.floor(math.log2(tokens)))
    return int(min(LOGIT_CHUNK_MAX_TOKENS, max(LOGIT_CHUNK_MIN_TOKENS, chunk)))


def memory_budget_bytes(device_bytes: int, on_cuda: bool) -> int:
    """What the planner may use of a device: minus the CUDA context, times the safety fraction."""
    if on_cuda:
        return int(max(0, device_bytes - CUDA_CONTEXT_BYTES) * SAFETY_FRACTION)
    return int(device_bytes * CPU_RAM_FRACTION)


# ----------------------------------------------------------------------------------------- the estimate
@dataclass
class _ModelMemory:
    weights: int
    grads: int
    adam: int
    step_temp: int  # optimizer.step() temporaries
    autocast_cache: int  # autocast's cached low-precision copies of trainable fp32 weights
    largest_trainable: int  # numel of the largest trainable tensor (offloaded optimizer steps one at a time)


def _model_memory(params: int, trainable: int, largest_trainable: int, workload: Workload) -> _ModelMemory:
    param_bytes = _nbytes(workload.param_dtype)
    compute_bytes = _nbytes(workload.compute_dtype)
    # sharded with a gather dtype: the layers' weights arrive already cast, autocast caches nothing
    cast = workload.use_autocast and compute_bytes != param_bytes and workload.gather_dtype is None
    world = max(1, workload.shard_world)
    share = lambda count: -(-count // world)  # noqa: E731 - this rank's shard (FSDP2 pads to whole rows)
    return _ModelMemory(
        weights=share(params) * param_bytes,
        grads=share(trainable) * GRAD_BYTES_PER_PARAM,
        adam=share(trainable) * ADAM_STATES_PER_PARAM * ADAM_STATE_BYTES,
        step_temp=int(share(trainable) * 4 * OPTIMIZER_STEP_TEMP_COPIES),
        autocast_cache=trainable * compute_bytes if cast else 0,
        largest_trainable=largest_trainable,
    )


def gathered_weight_bytes(params: int, workload: Workload) -> int:
    """A sharded model's full weights while gathered (rollout, no-grad passes): params x the gather dtype."""
    return params * _nbytes(workload.gather_dtype or workload.param_dtype)


def sharded_update_unit_bytes(shape: ModelShape, workload: Workload) -> int:
    """What a sharded update holds unsharded at once: the root group (embeddings, lm head, norm) and two decoder
    layers (the one computing and the next one prefetched), in the gather dtype, plus their fp32 gradients
    before the reduce-scatter."""
    units = shape.embedding_params() + 2 * shape.layer_params()
    return units * (_nbytes(workload.gather_dtype or workload.param_dtype) + GRAD_BYTES_PER_PARAM)


def _models(shape: ModelShape, workload: Workload, critic_shape: Optional[ModelShape]) -> dict[str, _ModelMemory]:
    out = {}
    if workload.actor_lora_rank > 0:
        lora = shape.lora_params(workload.actor_lora_rank)
        largest = max(workload.actor_lora_rank * max(n_in, n_out) for _, n_in, n_out in shape.linear_shapes())
        out["actor"] = _model_memory(shape.num_params() + lora, lora, largest, workload)
    else:
        out["actor"] = _model_memory(shape.num_params(), shape.num_params(), shape.largest_tensor_numel(), workload)
    if workload.has_ref:
        out["ref"] = _model_memory(shape.num_params(), 0, 0, workload)
    if workload.has_critic:
        cshape = critic_shape or shape
        value_head = cshape.hidden_size + 1
        if workload.critic_lora_rank > 0:
            lora = cshape.lora_params(workload.critic_lora_rank) + value_head
            largest = max(workload.critic_lora_rank * max(n_in, n_out) for _, n_in, n_out in cshape.linear_shapes())
            out["critic"] = _model_memory(cshape.backbone_params() + lora, lora, largest, workload)
        else:
            params = cshape.backbone_params() + value_head
            out["critic"] = _model_memory(params, params, cshape.largest_tensor_numel(), workload)
    return out


# Which phases use which model (with param offload a model is on the device only in these phases).
_MODEL_PHASES = {"actor": ("rollout", "old_log_prob", "actor_update"), "ref": ("ref_log_prob",),
                 "critic": ("values", "critic_update")}
_UPDATE_PHASE = {"actor": "actor_update", "critic": "critic_update"}


def _resident(models: dict[str, _ModelMemory], placement: Placement, phase: str, on_cuda: bool) -> dict[str, int]:
    """Bytes of model state on the device during `phase`, by component."""
    parts: dict[str, int] = {}
    for name, mem in models.items():
        in_use = phase in _MODEL_PHASES[name]
        offloaded = on_cuda and (placement.param_offload or (name == "ref" and not placement.ref_on_device))
        if in_use or not offloaded:
            parts[f"{name}_weights"] = mem.weights
        if mem.adam:
            if not (on_cuda and placement.optimizer_offload):
                parts[f"{name}_adam"] = mem.adam
        if phase == _UPDATE_PHASE.get(name):
            parts[f"{name}_grads"] = mem.grads
    return parts


def host_offload_bytes(shape: ModelShape, workload: Workload, placement: Placement,
                       critic_shape: Optional[ModelShape] = None) -> dict[str, int]:
    """Bytes one rank keeps in host RAM for what `placement` offloads from the GPU, by component (weights of
    offloaded models, a parked reference, Adam states); {} on a CPU run, where nothing is offloaded."""
    if not workload.on_cuda:
        return {}
    parts: dict[str, int] = {}
    for name, mem in _models(shape, workload, critic_shape).items():
        if placement.param_offload or (name == "ref" and not placement.ref_on_device):
            parts[f"{name}_weights"] = mem.weights
        if mem.adam and placement.optimizer_offload:
            parts[f"{name}_adam"] = mem.adam
    return parts


def estimate_memory(shape: ModelShape, workload: Workload, placement: Placement,
                    critic_shape: Optional[ModelShape] = None, budget_bytes: Optional[int] = None) -> dict:
    """Predicted peak bytes per phase, with a breakdown. JSON-able.

    Returns {"phases": {phase: bytes}, "breakdown": {phase: {component: bytes}}, "peak_bytes", "peak_phase",
    "budget_bytes", "fits", "model": {...}, "settings": placement}. Phases that do not run (no critic, no ref)
    are absent."""
    models = _models(shape, workload, critic_shape)
    cshape = critic_shape or shape
    compute_bytes = _nbytes(workload.compute_dtype)
    rollout_bytes = _nbytes(workload.rollout_dtype)
    # The residual stream stays in the parameter dtype under autocast (fp32 embedding + fp32 adds).
    residual_bytes = _nbytes(workload.param_dtype) if workload.use_autocast else compute_bytes
    seq = workload.seq_len
    scores = workload.attention_materializes_scores
    on_cuda = workload.on_cuda
    breakdown: dict[str, dict[str, int]] = {}
    engine_weights = rollout_engine_weight_bytes(shape, workload, budget_bytes)

    # rollout
    parts = _resident(models, placement, "rollout", on_cuda)
    batch = placement.rollout_batch
    parts["kv_cache"] = kv_cache_bytes(shape, batch, seq, rollout_bytes)
    prefill = nograd_activation_bytes(shape, batch * workload.prompt_length, workload.prompt_length,
                                      rollout_bytes, residual_bytes, scores)
    sampling = batch * shape.vocab_size * SAMPLING_BYTES_PER_LOGIT
    parts["prefill_or_sampling"] = max(prefill, sampling)
    breakdown["rollout"] = parts

    # no-grad forwards
    lp_tokens = micro_batch_tokens(workload, placement.logprob_micro_batch)
    forward = nograd_activation_bytes(shape, lp_tokens, seq, compute_bytes, residual_bytes, scores)
    lp_logits = logits_chunk_bytes(shape, lp_tokens, placement.logprob_chunk_size, compute_bytes, False)
    # shared prompts: one layer's gathered keys at a time in a no-grad pass
    gathered = shared_attention_bytes(shape, workload, placement.logprob_micro_batch, compute_bytes)
    parts = _resident(models, placement, "old_log_prob", on_cuda)
    parts.update(autocast_cache=models["actor"].autocast_cache, activations=forward + gathered,
                 logits_chunks=lp_logits)
    breakdown["old_log_prob"] = parts
    if "ref" in models:
        parts = _resident(models, placement, "ref_log_prob", on_cuda)
        parts.update(activations=forward + gathered, logits_chunks=lp_logits)
        breakdown["ref_log_prob"] = parts
    if "critic" in models:
        parts = _resident(models, placement, "values", on_cuda)
        parts.update(autocast_cache=models["critic"].autocast_cache,
                     activations=nograd_activation_bytes(cshape, lp_tokens, seq, compute_bytes, residual_bytes, scores)
                     + shared_attention_bytes(cshape, workload, placement.logprob_micro_batch, compute_bytes))
        breakdown["values"] = parts

    # updates
    def update_parts(name: str, model_shape: ModelShape, micro_batch: int, with_logits: bool) -> dict[str, int]:
        mem = models[name]
        tokens = placement.max_token_len if placement.max_token_len else micro_batch_tokens(workload, micro_batch)
        parts = _resident(models, placement, _UPDATE_PHASE[name], on_cuda)
        parts["autocast_cache"] = mem.autocast_cache
        parts["activations"] = training_activation_bytes(
            model_shape, tokens, seq, compute_bytes, residual_bytes, workload.use_autocast,
            placement.gradient_checkpointing, scores, workload.compiled_layers, workload.kv_heads_repeated)
        # shared prompts: every layer's gathered keys kept for the backward (one recomputed layer's)
        rows = max(placement.max_token_len // seq, 1) if placement.max_token_len else micro_batch
        layers = 1 if placement.gradient_checkpointing else model_shape.num_layers
        parts["activations"] += layers * shared_attention_bytes(model_shape, workload, rows, compute_bytes)
        if with_logits:
            parts["logits_chunks"] = logits_chunk_bytes(model_shape, tokens, placement.logprob_chunk_size,
                                                        compute_bytes, True)
        # optimizer.step() runs after the activations are freed: count whichever is larger
        if on_cuda and placement.optimizer_offload:
            step = 2 * mem.largest_trainable * ADAM_STATE_BYTES + mem.largest_trainable * 4
        else:
            step = mem.step_temp
        transient_keys = ("autocast_cache", "activations", "logits_chunks")
        forward_backward = sum(parts.get(k, 0) for k in transient_keys)
        if step > forward_backward:
            for key in transient_keys:
                parts.pop(key, None)
            parts["optimizer_step"] = step
        return parts

    breakdown["actor_update"] = update_parts("actor", shape, placement.actor_micro_batch, True)
    if "critic" in models:
        breakdown["critic_update"] = update_parts("critic", cshape, placement.critic_micro_batch, False)

    if workload.shard_world > 1:
        # sharded: each pass holds what it gathers (sharding.gathered / FSDP's per-layer all-gathers)
        full = {"actor": shape.num_params(), "ref": shape.num_params(),
                "critic": cshape.backbone_params() + cshape.hidden_size + 1}
        full_lp = {"rollout": "actor", "old_log_prob": "actor", "ref_log_prob": "ref", "values": "critic"}
        for phase, model in full_lp.items():
            if phase in breakdown:
                breakdown[phase]["gathered_weights"] = gathered_weight_bytes(full[model], workload)
        breakdown["actor_update"]["gathered_units"] = sharded_update_unit_bytes(shape, workload)
        if "critic_update" in breakdown:
            breakdown["critic_update"]["gathered_units"] = sharded_update_unit_bytes(cshape, workload)

    if engine_weights:
        for parts in breakdown.values():
            parts["rollout_engine_weights"] = engine_weights
    phases = {phase: int(sum(parts.values())) for phase, parts in breakdown.items()}
    peak_phase = max(phases, key=phases.get)
    actor = models["actor"]
    return {
        "phases": phases,
        "breakdown": {phase: {k: int(v) for k, v in parts.items()} for phase, parts in breakdown.items()},
        "peak_bytes": phases[peak_phase],
        "peak_phase": peak_phase,
        "budget_bytes": budget_bytes,
        "fits": None if budget_bytes is None else phases[peak_phase] <= budget_bytes,
        "model": {"name": shape.name, "params": shape.num_params(),
                  "actor_trainable": actor.grads // GRAD_BYTES_PER_PARAM,
                  "critic_params": (models["critic"].weights // _nbytes(workload.param_dtype)
                                    if "critic" in models else 0),
                  "seq_len": seq, "rollout_sequences": workload.rollout_sequences},
        "settings": placement.to_dict(),
    }


# ------------------------------------------------------------------------------------------- the search
@dataclass
class FitResult:
    placement: Placement
    estimate: dict
    notes: dict[str, str] = field(default_factory=dict)  # decision -> why


# Escalation order: cheapest first. Checkpointing costs ~30% more compute, parking the ref costs one transfer of
# its weights per step, offloading the optimizer costs its states' transfer (or a CPU step) per update, param
# offload moves every model every phase.
LEVELS: tuple[dict[str, bool], ...] = (
    dict(gradient_checkpointing=False, ref_on_device=True, optimizer_offload=False, param_offload=False),
    dict(gradient_checkpointing=True, ref_on_device=True, optimizer_offload=False, param_offload=False),
    dict(gradient_checkpointing=True, ref_on_device=False, optimizer_offload=False, param_offload=False),
    dict(gradient_checkpointing=True, ref_on_device=False, optimizer_offload=True, param_offload=False),
    dict(gradient_checkpointing=True, ref_on_device=False, optimizer_offload=True, param_offload=True),
)
SEARCHED_SWITCHES = ("gradient_checkpointing", "ref_on_device", "optimizer_offload", "param_offload")
MICRO_BATCH_KEYS = ("actor_micro_batch", "critic_micro_batch", "logprob_micro_batch", "rollout_batch",
                    "max_token_len")


def _candidates(cap: int, floor: int = 1) -> list[int]:
    """cap itself, then the powers of two below it, largest first, then floor itself."""
    out = [cap]
    power = 2 ** int(math.floor(math.log2(cap))) if cap >= 1 else 0
    if power == cap:
        power //= 2
    while power >= floor:
        out.append(power)
        power //= 2
    if out[-1] != floor and floor <= cap:
        out.append(floor)
    return [c for c in out if c >= floor]


def _largest_fitting(candidates: list[int], phase_bytes) -> Optional[tuple[int, int]]:
    for value in candidates:
        need = phase_bytes(value)
        if need is not None:
            return value, need
    return None


def _phase_fits(estimate: dict, phases: tuple[str, ...], budget: int) -> bool:
    return all(estimate["phases"].get(p, 0) <= budget for p in phases)


def micro_batch_caps(workload: Workload) -> dict[str, tuple[int, str]]:
    """The most sequences each searched batch may hold, and why that is the limit."""
    seq = workload.seq_len

    def cap(limit_sequences: int, limit_why: str, tokens: int) -> tuple[int, str]:
        by_tokens = max(1, tokens // seq)
        if by_tokens < limit_sequences:
            return by_tokens, f"capped at {tokens} tokens per micro-batch"
        return limit_sequences, limit_why

    return {
        "rollout_batch": (workload.rollout_sequences, "the whole batch"),
        "logprob_micro_batch": cap(workload.rollout_sequences, "the whole batch", MAX_TOKENS_PER_FORWARD_MICRO_BATCH),
        "actor_micro_batch": cap(workload.actor_mini_batch, "the whole mini-batch", MAX_TOKENS_PER_MICRO_BATCH),
        "critic_micro_batch": cap(workload.critic_mini_batch, "the whole mini-batch", MAX_TOKENS_PER_MICRO_BATCH),
        "roomy_actor_micro_batch": cap(workload.actor_mini_batch, "the whole mini-batch",
                                       MAX_TOKENS_PER_ROOMY_MICRO_BATCH),
        "roomy_critic_micro_batch": cap(workload.critic_mini_batch, "the whole mini-batch",
                                        MAX_TOKENS_PER_ROOMY_MICRO_BATCH),
    }


def _choose_batches(shape: ModelShape, workload: Workload, budget: int, base: Placement,
                    fixed: dict[str, Any], critic_shape: Optional[ModelShape]) -> Optional[Placement]:
    """For a fixed set of switches, the largest micro-batches that fit each phase (explicit values kept)."""
    placement = replace(base)

    def try_value(key: str, phases: tuple[str, ...], limit: Optional[int] = None):
        def check(value: int):
            trial = replace(placement, **{key: value})
            # with the budget: FastEngine's fused copies exist only when small next to it (as the engine decides)
            est = estimate_memory(shape, workload, trial, critic_shape, budget)
            return est["phases"] if _phase_fits(est, phases, budget if limit is None else limit) else None
        return check

    def pick(key: str, cap: int, phases: tuple[str, ...], floor: int = 1, roomy_cap: int = 0) -> bool:
        if key in fixed and fixed[key] is not None:
            setattr(placement, key, int(fixed[key]))
            return _phase_fits(estimate_memory(shape, workload, placement, critic_shape, budget), phases, budget)
        found = _largest_fitting(_candidates(max(cap, floor), floor), try_value(key, phases))
        if found is None:
            setattr(placement, key, floor)
            return False
        setattr(placement, key, found[0])
        if roomy_cap > found[0] and found[0] >= cap:  # at the cap with room to spare: fewer, larger micro-batches
            roomy = int(ROOMY_PEAK_FRACTION * budget)
            bigger = [value for value in _candidates(roomy_cap, found[0]) if value > found[0]]
            grown = _largest_fitting(bigger, try_value(key, phases, limit=roomy))
            if grown is not None:
                setattr(placement, key, grown[0])
        return True

    caps = micro_batch_caps(workload)
    ok = pick("rollout_batch", caps["rollout_batch"][0], ("rollout",))
    ok &= pick("logprob_micro_batch", caps["logprob_micro_batch"][0], ("old_log_prob", "ref_log_prob", "values"))
    if workload.use_dynamic_bsz:
        cap = min(workload.token_budget_cap or workload.seq_len * workload.actor_mini_batch,
                  workload.seq_len * workload.actor_mini_batch)
        ok &= pick("max_token_len", max(cap, workload.seq_len), ("actor_update", "critic_update"),
                   floor=workload.seq_len)
    else:
        placement.max_token_len = None
        ok &= pick("actor_micro_batch", caps["actor_micro_batch"][0], ("actor_update",),
                   roomy_cap=caps["roomy_actor_micro_batch"][0])
        if workload.has_critic:
            ok &= pick("critic_micro_batch", caps["critic_micro_batch"][0], ("critic_update",),
                       roomy_cap=caps["roomy_critic_micro_batch"][0])
    return placement if ok else None


def _levels(workload: Workload, fixed: dict[str, Any]) -> list[dict[str, bool]]:
    levels = []
    for level in LEVELS:
        level = dict(level)
        if not workload.on_cuda:  # nothing to offload to on a CPU-only run
            level.update(ref_on_device=True, optimizer_offload=False, param_offload=False)
        if not workload.has_ref:
            level["ref_on_device"] = True
        for key in SEARCHED_SWITCHES:
            if fixed.get(key) is not None:
                level[key] = bool(fixed[key])
        if level not in levels:
            levels.append(level)
    return levels


def _update_tokens(workload: Workload, placement: Placement, micro_key: str) -> int:
    if placement.max_token_len:
        return placement.max_token_len
    return micro_batch_tokens(workload, getattr(placement, micro_key))


# The costly value of each searched switch.
_COSTLY = {"gradient_checkpointing": True, "ref_on_device": False, "optimizer_offload": True, "param_offload": True}


def fit_settings(shape: ModelShape, workload: Workload, budget_bytes: int, fixed: Optional[dict[str, Any]] = None,
                 critic_shape: Optional[ModelShape] = None, logprob_chunk_size: Optional[int] = None
                 ) -> Optional[FitResult]:
    """The cheapest setting whose every phase fits `budget_bytes`, or None.

    `fixed` holds explicit choices (Placement field names -> value; None means "search it"). Switches are
    escalated in LEVELS order until something fits, then every costly switch that is not needed is turned back
    off. Within a setting each micro-batch is the whole mini-batch or the largest power of two that fits. When
    checkpointing is not fixed, it is also switched on if without it an actor micro-batch would hold fewer than
    MIN_TOKENS_PER_MICRO_BATCH tokens and checkpointing allows more."""
    fixed = dict(fixed or {})
    chunk = logprob_chunk_size or choose_logprob_chunk_size(shape.vocab_size, budget_bytes,
                                                            _nbytes(workload.compute_dtype))

    def attempt(switches: dict[str, bool]) -> Optional[Placement]:
        return _choose_batches(shape, workload, budget_bytes, Placement(logprob_chunk_size=chunk, **switches),
                               fixed, critic_shape)

    found: Optional[Placement] = None
    switches: dict[str, bool] = {}
    for level in _levels(workload, fixed):
        found = attempt(level)
        if found is not None:
            switches = dict(level)
            break
    if found is None:
        return None

    notes: dict[str, str] = {}
    # Turn back off whatever is not needed, most expensive first.
    for key in ("param_offload", "optimizer_offload", "ref_on_device", "gradient_checkpointing"):
        if fixed.get(key) is not None or switches[key] != _COSTLY[key]:
            continue
        cheaper = attempt(dict(switches, **{key: not _COSTLY[key]}))
        if cheaper is not None:
            switches[key] = not _COSTLY[key]
            found = cheaper
        else:
            notes[key] = f"needed to fit in {format_bytes(budget_bytes)}"

    if fixed.get("gradient_checkpointing") is None and not switches["gradient_checkpointing"]:
        want = min(MIN_TOKENS_PER_MICRO_BATCH, micro_batch_caps(workload)["actor_micro_batch"][0] * workload.seq_len)
        tokens = _update_tokens(workload, found, "actor_micro_batch")
        if tokens < want:
            alt = attempt(dict(switches, gradient_checkpointing=True))
            if alt is not None and _update_tokens(workload, alt, "actor_micro_batch") > tokens:
                notes["gradient_checkpointing"] = (
                    f"without it only {tokens} tokens per actor micro-batch fit (< {want}); with it "
                    f"{_update_tokens(workload, alt, 'actor_micro_batch')}")
                switches["gradient_checkpointing"] = True
                found = alt

    for key in SEARCHED_SWITCHES:
        if key == "ref_on_device" and not workload.has_ref:
            continue
        if fixed.get(key) is not None:
            notes[key] = "explicit"
        elif key not in notes:
            notes[key] = ("not needed to fit" if workload.on_cuda or key == "gradient_checkpointing"
                          else "CPU run: nothing to offload to")
    estimate = estimate_memory(shape, workload, found, critic_shape, budget_bytes)
    return FitResult(found, estimate, notes)


def explain_no_fit(shape: ModelShape, workload: Workload, budget_bytes: int, fixed: Optional[dict[str, Any]] = None,
                   critic_shape: Optional[ModelShape] = None, budget_label: str = "") -> str:
    """'nothing fits; what would: ...' with the predicted peak of each alternative."""
    fixed = dict(fixed or {})
    chunk = choose_logprob_chunk_size(shape.vocab_size, budget_bytes, _nbytes(workload.compute_dtype))
    frugal_switches = dict(LEVELS[-1]) if workload.on_cuda else dict(LEVELS[1], ref_on_device=True)

    def frugal_peak(wl: Workload, keep_fixed: bool = True, cs: Optional[ModelShape] = critic_shape) -> dict:
        switches = dict(frugal_switches)
        batches = dict(actor_micro_batch=1, critic_micro_batch=1, logprob_micro_batch=1, rollout_batch=1,
                       max_token_len=wl.seq_len if wl.use_dynamic_bsz else None)
        if keep_fixed:
            switches.update({k: bool(v) for k, v in fixed.items() if k in SEARCHED_SWITCHES and v is not None})
            batches.update({k: v for k, v in fixed.items() if k in MICRO_BATCH_KEYS and v is not None})
        placement = Placement(logprob_chunk_size=min(chunk, 256), **switches, **batches)
        return estimate_memory(shape, wl, placement, cs, budget_bytes)

    best = frugal_peak(workload)
    worst_phase = best["peak_phase"]
    top = sorted(best["breakdown"][worst_phase].items(), key=lambda kv: -kv[1])[:3]
    how = ("gradient checkpointing, optimizer and param offload, the reference parked on CPU, "
           "micro-batch 1 and generating one sequence at a time" if workload.on_cuda
           else "gradient checkpointing and micro-batch 1")
    lines = [f"nothing fits in the memory budget of {format_bytes(budget_bytes)}{budget_label}: "
             f"even with {how} the peak is {format_bytes(best['peak_bytes'])} in {worst_phase} "
             f"({', '.join(f'{k} {format_bytes(v)}' for k, v in top)}).", "what would:"]

    def line(label: str, est: dict) -> str:
        verdict = "fits" if est["peak_bytes"] <= budget_bytes else "still too big"
        return f"  - {label}: {format_bytes(est['peak_bytes'])} ({verdict})"

    explicit = {k: v for k, v in fixed.items() if v is not None}
    if explicit:
        lines.append(line("letting the planner choose " + ", ".join(sorted(explicit)), frugal_peak(workload, False)))
    if workload.actor_lora_rank == 0:
        rank = DEFAULT_LORA_RANK_SUGGESTION
        lora = replace(workload, actor_lora_rank=rank, critic_lora_rank=rank if workload.has_critic else 0,
                       has_ref=False)
        lines.append(line(f"LoRA r={rank} (actor_rollout_ref.model.lora_rank={rank}"
                          f"{f', critic.model.lora_rank={rank}' if workload.has_critic else ''}; "
                          "the reference becomes the adapter-disabled base)", frugal_peak(lora)))
    if workload.has_critic:
        lines.append(line("no critic (algorithm.adv_estimator=grpo)",
                          frugal_peak(replace(workload, has_critic=False))))
    if workload.response_length > 64:
        shorter = max(64, workload.response_length // 2)
        lines.append(line(f"response length {shorter} (data.max_response_length={shorter})",
                          frugal_peak(replace(workload, response_length=shorter))))
    if workload.prompts_per_step > 1:
        smaller = max(1, workload.prompts_per_step // 4)
        lines.append(line(f"train_batch_size {smaller} (data.train_batch_size={smaller})",
                          frugal_peak(replace(workload, prompts_per_step=smaller,
                                              actor_mini_batch=min(workload.actor_mini_batch, smaller),
                                              critic_mini_batch=min(workload.critic_mini_batch, smaller)))))
    # With everything offloaded the actor update still holds weights + grads on the device; leave ~20% for
    # activations. A rough size hint, not a search.
    per_param = _nbytes(workload.param_dtype) + GRAD_BYTES_PER_PARAM
    lines.append(f"  - a smaller model: roughly {budget_bytes * 0.8 / per_param / 1e9:.2f}B parameters at most "
                 f"with full fine-tuning here ({shape.name} has {shape.num_params() / 1e9:.2f}B)")
    return "\n".join(lines)
