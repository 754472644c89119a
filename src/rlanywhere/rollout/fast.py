"""FastEngine: the built-in rollout engine for Llama / Qwen2 / Qwen3 / Mistral-family transformers models.

It composes three parts, each with one job, and decides nothing about the hardware itself: every choice (dtype,
decode attention, weight fusion, HF rounding, fp32 logits, CUDA graphs, rows per wave) comes from the
`RolloutPlan` it is given (plans.py; the planner fills it, `RolloutPlan()` is the portable choice):

- `llama.LlamaForward`: the model forward on the HF model's own parameters (no copy when the engine dtype
  matches; one cast copy, refreshed by `sync_weights()`, when it does not; LoRA read as merged copies);
- `runner.DecodeRunner`: the static KV cache (each prompt prefilled once, copied to its n samples), the decode
  buffers and one CUDA graph per (batch bucket, attention span);
- `scheduler.Scheduler`: waves of at most `rows_per_wave` rows, finished rows compacted away every
  `check_every` steps, EOS and stop strings.

Sampling (greedy / temperature / top-k / top-p with a torch.Generator) is the pure `base.sample_from_logits`,
outside the graph; it returns the log-prob of each token under the processed distribution.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..errors import UserError
from ..lora import unwrap_peft
from ..plans import RolloutPlan
from ..vocabulary import DECODE_TRITON, FP32, DecodeAttention, cc_str, has_tf32
from .base import (
    GeneratorSource,
    RowStreams,
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    StopStringMatcher,
    build_rollout_batch,
    chunk_generator,
    collect_eos_ids,
    eos_lengths,
    prompt_chunks,
    resolve_generator,
    resolve_pad_token_id,
    validate_prompts,
)
from .llama import (
    SUPPORTED_MODEL_TYPES,
    LlamaForward,
    Numerics,
    apply_rope,
    effective_weight,
    half_gemm_has_fp32_output,
    residual_linear,
    rms_norm,
    signed_sin,
    supports,
)
from .decode_attention import triton_usable, triton_interpreting
from .runner import DecodeRunner
from .scheduler import RequestOutputs, Scheduler, StopRule, plan_waves

logger = logging.getLogger(__name__)

class RolloutPlanError(UserError, ValueError):
    """A RolloutPlan FastEngine cannot run; the message names the field and the fix."""


def _check_plan(rollout: Any, device: torch.device) -> None:
    """Clear errors for RolloutPlan fields FastEngine cannot use on `device`."""
    if not isinstance(rollout, RolloutPlan):
        raise RolloutPlanError(f"FastEngine takes a rlanywhere.plans.RolloutPlan, got {type(rollout).__name__}; "
                               "build one with RolloutPlan(...) (its defaults run anywhere)")
    if rollout.decode_attention not in DecodeAttention.values():
        raise RolloutPlanError(f"RolloutPlan.decode_attention must be one of {DecodeAttention.values()}, got "
                               f"{rollout.decode_attention!r}")
    for field_text, wants, instead in (
            ("decode_attention='triton'", rollout.decode_attention == DECODE_TRITON, "use 'sdpa' or 'matmul'"),
            ("fused_sampling=True", bool(rollout.fused_sampling), "set it to False (the torch sampler)"),
            ("fused_kv_write=True", bool(rollout.fused_kv_write), "set it to False (RoPE, then index copies)")):
        if not wants:
            continue
        if not triton_usable():
            raise RolloutPlanError(f"RolloutPlan.{field_text} needs the triton package (it comes with PyTorch's CUDA "
                                   "builds on Linux) and a C compiler (cc, gcc or clang, or $CC) to build its "
                                   f"launcher; install them, or {instead}")
        if device.type != "cuda" and not triton_interpreting():
            raise RolloutPlanError(f"RolloutPlan.{field_text} runs on CUDA GPUs; the model is on {device.type}: "
                                   f"{instead} (or TRITON_INTERPRET=1, Triton's slow CPU interpreter, for tests)")
    if rollout.attention_tf32x3:
        if rollout.decode_attention != DECODE_TRITON:
            raise RolloutPlanError("RolloutPlan.attention_tf32x3=True is a setting of the Triton decode attention; "
                                   f"decode_attention is {rollout.decode_attention!r}: set attention_tf32x3=False or "
                                   "decode_attention='triton'")
        cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if cc is not None and not has_tf32(cc):
            raise RolloutPlanError(f"RolloutPlan.attention_tf32x3=True needs TF32 tensor cores (compute capability >= "
                                   f"8.0); {torch.cuda.get_device_name(device)} is {cc_str(cc)}: set "
                                   "attention_tf32x3=False (exact fp32 products)")
    dtype = rollout.dtype
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise RolloutPlanError(f"RolloutPlan.dtype must be a floating torch.dtype or None (the model's), got "
                               f"{rollout.dtype!r}")
    if rollout.cuda_graphs and device.type != "cuda":
        raise RolloutPlanError(f"RolloutPlan.cuda_graphs=True needs the model on a CUDA device; it is on "
                               f"{device.type}. Set cuda_graphs=False.")
    for name, least in (("rows_per_wave", 1), ("max_seq_len", 2)):
        value = getattr(rollout, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise RolloutPlanError(f"RolloutPlan.{name} must be an int >= {least} or None, got {value!r}")
    for name in ("check_every", "prefill_tokens_per_chunk"):
        value = getattr(rollout, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RolloutPlanError(f"RolloutPlan.{name} must be an int >= 1, got {value!r}")


class FastEngine(RolloutEngine):
    """Static-KV-cache decoder with CUDA graphs and shared prompt prefill for Llama-family models.

    Args:
        model: a transformers Llama / Qwen2 / Qwen3 / Mistral causal LM, optionally wrapped by peft (LoRA).
        tokenizer: used for EOS ids and stop strings (may be None when neither is needed).
        rollout: the RolloutPlan (plans.py says what each field means); default `RolloutPlan()`: the model's dtype,
            SDPA attention, no CUDA graphs, no weight copies, the whole request in one wave.
        pad_token_id: default: the tokenizer's pad id, else the first EOS id.
    """

    def __init__(self, model: Any, tokenizer: Any, rollout: RolloutPlan | None = None,
                 pad_token_id: int | None = None):
        ok, reason = supports(model)
        if not ok:
            raise ValueError(f"FastEngine cannot run this model: {reason}. Use the HF engine (engine='hf').")
        rollout = RolloutPlan() if rollout is None else rollout
        self.model = model
        self.tokenizer = tokenizer
        self.hf_model = unwrap_peft(model)
        self.is_peft = self.hf_model is not model
        q_weight = effective_weight(self.hf_model.model.layers[0].self_attn.q_proj)[0]
        self.device = q_weight.device
        _check_plan(rollout, self.device)
        self.rollout = rollout
        self.dtype = rollout.dtype if rollout.dtype is not None else q_weight.dtype
        if rollout.fp32_gemm_layouts and self.dtype != FP32:
            raise RolloutPlanError(f"RolloutPlan.fp32_gemm_layouts=True is for fp32 rollouts; this engine runs in "
                                   f"{self.dtype}: set fp32_gemm_layouts=False (or dtype=torch.float32)")
        numerics = Numerics(
            decode_attention=rollout.decode_attention,
            # fp32 rounds the same either way (up to an ulp): only half precision has transformers' rounding to copy
            round_like_hf=bool(rollout.match_hf_numerics) and self.dtype != FP32,
            fp32_logits=bool(rollout.fp32_logits),
            # how to compute fp32 logits here (one GEMM where torch has it), not whether to
            out_dtype_gemm=bool(rollout.fp32_logits) and half_gemm_has_fp32_output(self.device, self.dtype),
            fuse_weights=bool(rollout.fuse_weights),
            transpose_gate_up=bool(rollout.transpose_gate_up),
            compile_elementwise=bool(rollout.compile_elementwise),
            fused_kv_write=bool(rollout.fused_kv_write),
            qkv_bias_apart=bool(rollout.qkv_bias_apart),
            attention_tf32x3=bool(rollout.attention_tf32x3),
            fp32_gemm_layouts=bool(rollout.fp32_gemm_layouts),
        )
        self.forward = LlamaForward(self.hf_model, self.dtype, self.device, numerics)
        self.dims = self.forward.dims
        self.runner = DecodeRunner(self.forward, cuda_graphs=bool(rollout.cuda_graphs),
                                   span_granularity=rollout.span_granularity,
                                   fused_sampling=bool(rollout.fused_sampling),
                                   decode_halves=bool(rollout.decode_halves))
        self.eos_ids = collect_eos_ids(tokenizer, self.hf_model)
        self.pad_token_id = resolve_pad_token_id(pad_token_id, tokenizer, self.eos_ids)
        self.scheduler = Scheduler(self.runner, self.pad_token_id, rollout.check_every,
                                   rollout.prefill_tokens_per_chunk)
        with torch.no_grad():
            self.runner.sync_weights()
            if rollout.rows_per_wave is not None and rollout.max_seq_len is not None:
                self.runner.reserve(rollout.rows_per_wave, rollout.max_seq_len)

    supports = staticmethod(supports)

    @property
    def decode_attention(self) -> str:
        return self.forward.numerics.decode_attention

    def owned_weight_bytes(self) -> int:
        """Bytes of the weight copies the engine owns (cast, fused, LoRA-merged) next to the model's own."""
        return self.forward.weights.owned_bytes()

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Refresh engine-owned weight copies (cast / fused / LoRA-merged) from the model, in place; graphs
        captured with tensors that moved are dropped and recaptured on the next step."""
        self.runner.sync_weights()

    def release_memory(self) -> None:
        """Free the KV cache, static buffers and CUDA graphs (e.g. before a memory-hungry update phase); the next
        generate allocates and captures them again."""
        self.runner.release()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: GeneratorSource = None,
        rows_per_wave: int | None = None,
    ) -> RolloutBatch:
        prompts = validate_prompts(prompts, self.dims.vocab)
        matcher = StopStringMatcher(self.tokenizer, params.stop_strings)
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        if self.dims.sliding_window is not None and longest > self.dims.sliding_window:
            raise ValueError(
                f"prompt + max_new_tokens = {longest} exceeds the model's sliding window "
                f"({self.dims.sliding_window}), which FastEngine does not implement; use engine='hf' or shorter "
                "responses"
            )
        self.sync_weights()  # cheap; keeps LoRA-merged and cast copies current even without an explicit sync
        eos_ids = [] if params.ignore_eos else list(self.eos_ids)
        n, total_rows = params.n, len(prompts) * params.n
        requested = rows_per_wave if rows_per_wave is not None else self.rollout.rows_per_wave
        chunks = prompt_chunks(len(prompts), n, requested)  # checks rows_per_wave
        wave_rows = total_rows if requested is None else min(total_rows, requested)
        waves = [(chunk, plan_waves(chunk, n, wave_rows)) for chunk in chunks]
        count = sum(len(w) for _, w in waves)
        if count > 1:
            logger.info("FastEngine: %d rows in %d waves of <= %d rows", total_rows, count, wave_rows)

        out = RequestOutputs.empty(params.max_new_tokens, total_rows, self.pad_token_id, self.device)
        stop = StopRule.of(eos_ids, matcher, self.device)
        # One generator per chunk of prompts, as one engine call per chunk resolved it: the caller's generator
        # (or generator(first prompt)) when it lives on this device, else one seeded from it; without a
        # generator one stream from params.seed for the whole request.
        # RowStreams: every row draws from its own stream (its key), whatever wave it runs in.
        keys = generator.keys(len(prompts), n, self.device) if isinstance(generator, RowStreams) else None
        shared = resolve_generator(None, params.seed, self.device) if generator is None or keys is not None else None
        for chunk, chunk_waves in waves:
            gen = shared
            if gen is None:
                gen = resolve_generator(chunk_generator(generator, chunk.start), params.seed, self.device)
            for wave in chunk_waves:
                self.scheduler.run_wave(wave, prompts, params, gen, out, stop, row_keys=keys)

        tokens = out.tokens[:, :total_rows].T
        logprobs = out.logprobs[:, :total_rows].T
        lengths = eos_lengths(tokens, eos_ids)
        for row, length in out.stop_lengths.items():
            lengths[row] = min(int(lengths[row]), length)
        return build_rollout_batch(prompts, n, tokens, logprobs, lengths, self.pad_token_id)


__all__ = ["FastEngine", "RolloutPlanError", "SUPPORTED_MODEL_TYPES", "rms_norm",
           "apply_rope", "signed_sin", "residual_linear"]
