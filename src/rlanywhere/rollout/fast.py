"""FastEngine: a built-in decoder for Llama / Qwen2 / Qwen3 / Mistral-family transformers models.

It runs the HF model's own parameters (no copy when the engine dtype matches; one cast copy, refreshed by
`sync_weights()`, when it does not) through a hand-written forward pass built for rollouts:

- a pre-allocated static KV cache `[layers, rows, kv_heads, max_len, head_dim]` in the engine dtype (grown on
  demand), filled by a batched prefill of each unique prompt once, copied to its `n` samples (shared prefill);
- left-padded layout: every row writes its next key/value to the same cache slot, and a per-row start offset masks
  the padding, so one decode step is a fixed-shape computation over the batch;
- on CUDA each decode step is captured once as a CUDA graph per (batch bucket, attention span) and replayed;
  on CPU the same code runs eagerly;
- finished rows stop costing compute: every `check_every` steps (the only host synchronisation of the loop) the
  active rows are compacted into the next smaller power-of-two bucket;
- sampling (greedy / temperature / top-k / top-p, with a torch.Generator) happens outside the graph and returns
  the log-prob of each token under the processed distribution; EOS and stop strings end rows individually.

peft LoRA models are supported by reading merged weights (base + delta of the active adapters) into engine-owned
buffers at every `generate`, so the base weights are never modified in place (no merge/unmerge drift).
Attention is SDPA with an explicit mask (or plain matmuls), so it runs on any CUDA GPU of cc >= 6.0 and on CPU.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..estimator import FUSED_COPY_BUDGET_FRACTION
from ..lora import unwrap_peft
from .base import (
    RolloutBatch,
    RolloutEngine,
    SamplingParams,
    StopStringMatcher,
    build_rollout_batch,
    collect_eos_ids,
    eos_lengths,
    resolve_generator,
    resolve_pad_token_id,
    sample_from_logits,
    validate_prompts,
)

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "swish")


# ----------------------------------------------------------------------------------------------------------------
# Reading (possibly peft-wrapped) weights
# ----------------------------------------------------------------------------------------------------------------


def _rope_type(config: Any) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return "default"
    return str(params.get("rope_type", params.get("type", "default")) or "default")


def _is_lora_layer(module: Any) -> bool:
    return hasattr(module, "base_layer") and (hasattr(module, "lora_A") or hasattr(module, "lora_embedding_A"))


def _unwrap_modules_to_save(module: Any) -> Any:
    """The module a peft ModulesToSaveWrapper currently forwards to (the trained copy or the original)."""
    if hasattr(module, "modules_to_save") and hasattr(module, "original_module"):
        active = list(getattr(module, "active_adapters", []) or [])
        if getattr(module, "disable_adapters", False) or not active or active[0] not in module.modules_to_save:
            return module.original_module
        return module.modules_to_save[active[0]]
    return module


def _lora_adapters(module: Any) -> set[str]:
    names = set(getattr(module, "lora_A", {}) or {})
    names |= set(getattr(module, "lora_embedding_A", {}) or {})
    return names


def _effective_weight(module: Any) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(weight, bias, is_live) of a Linear / Embedding as the model currently computes it.

    For a peft LoRA layer the weight is base + sum of the unmerged active adapters' deltas, computed in fp32 into
    a new tensor (is_live False); otherwise the module's own parameter (is_live True).
    """
    module = _unwrap_modules_to_save(module)
    if not _is_lora_layer(module):
        return module.weight.detach(), _bias(module), True
    base = module.base_layer
    weight, bias = base.weight.detach(), _bias(base)
    merged = [a for a in getattr(module, "merged_adapters", []) if a in _lora_adapters(module)]
    if getattr(module, "disable_adapters", False):
        add, sub = [], merged  # disabled adapters: the model computes with the plain base weights
    else:
        add = [a for a in module.active_adapters if a in _lora_adapters(module) and a not in merged]
        sub = []
    if not add and not sub:
        return weight, bias, True
    out = weight.float()
    for a in add:
        out = out + module.get_delta_weight(a).detach().float()
    for a in sub:
        out = out - module.get_delta_weight(a).detach().float()
    return out, bias, False


def _bias(module: Any) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


def _peft_problem(model: Any) -> str | None:
    """Why the peft adapters in `model` cannot be read as merged weights, or None."""
    for name, module in model.named_modules():
        if not hasattr(module, "base_layer"):
            continue
        if not _is_lora_layer(module) or not type(module).__module__.startswith("peft.tuners.lora"):
            return f"peft adapter type {type(module).__module__}.{type(module).__name__} at {name}"
        if type(module).__name__ not in ("Linear", "Embedding"):
            return f"peft LoRA layer type {type(module).__name__} at {name}"
        if any(bool(v) for v in (getattr(module, "use_dora", {}) or {}).values()):
            return f"DoRA adapter at {name}"
        if any(bool(v) for v in (getattr(module, "lora_bias", {}) or {}).values()):
            return f"LoRA bias (lora_bias=True) at {name}"
        if getattr(module, "fan_in_fan_out", False):
            return f"fan_in_fan_out LoRA at {name}"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Pure tensor pieces of the forward pass (same arithmetic as transformers' Llama/Qwen2 modules)
# ----------------------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, match_hf: bool = False) -> torch.Tensor:
    """RMSNorm. Default: one (fused on CUDA) kernel, half-precision inputs normalised in fp32 inside it.
    match_hf: transformers' rounding (normalise in fp32, round to the input dtype, then multiply the weight)."""
    if match_hf:  # the kernel normalises half-precision input in fp32 and rounds once, as transformers does
        return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def residual_linear(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    match_hf: bool = False) -> torch.Tensor:
    """h + x @ weight.T (+ bias). Default without bias: one GEMM with the residual add in its epilogue (rounded
    once). match_hf: round the product first, then add, as transformers does."""
    if bias is not None or match_hf:
        return h + F.linear(x, weight, bias)
    return torch.addmm(h.reshape(-1, h.shape[-1]), x.reshape(-1, x.shape[-1]), weight.t()).view(h.shape)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, so rotate_half(x) * sin == roll(x, D/2) * signed_sin(sin) exactly."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, match_hf: bool = False) -> torch.Tensor:
    """transformers' x*cos + rotate_half(x)*sin with rotate_half as one roll; by default the second product and
    the sum are one fused multiply-add (match_hf: separate, as transformers rounds them)."""
    rolled = torch.roll(x, shifts=x.shape[-1] // 2, dims=-1)
    if match_hf:
        return x * cos + rolled * sin_signed
    return torch.addcmul(x * cos, rolled, sin_signed)


def half_gemm_has_fp32_output(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(..., out_dtype=torch.float32)` runs for `dtype` inputs on `device` (CUDA, torch >= 2.8)."""
    if device.type != "cuda" or dtype == torch.float32:
        return False
    try:
        probe = torch.ones(2, 8, dtype=dtype, device=device)
        return torch.mm(probe, probe.t(), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor, out_dtype_gemm: bool) -> torch.Tensor:
    """Logits [rows, vocab] in fp32 from hidden states [rows, hidden] of any dtype: fp32 accumulation *and* fp32
    output, as the trainer's log-probs are computed (logprobs.py). Rounding half-precision logits (~20 in size,
    steps of 0.125 in bf16) alone moves log-probs by a few 1e-2 between two otherwise equal passes.
    out_dtype_gemm: half inputs, fp32 output in one GEMM (CUDA); else the inputs are upcast."""
    if weight.dtype == torch.float32:
        return F.linear(hidden.float(), weight)
    if out_dtype_gemm:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden.float(), weight.float())


@dataclass
class _Dims:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    scaling: float
    sliding_window: int | None
    qk_norm: bool

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads


class FastEngine(RolloutEngine):
    """Static-KV-cache decoder with CUDA graphs and shared prompt prefill for Llama-family models.

    Args:
        model: a transformers Llama / Qwen2 / Qwen3 / Mistral causal LM, optionally wrapped by peft (LoRA).
        tokenizer: used for EOS ids and stop strings (may be None when neither is needed).
        dtype: engine compute dtype; default: the model's weight dtype. A different dtype keeps one cast copy.
        max_batch_size: rows (prompts x n) decoded together; larger requests run in waves. Default: what the
            call needs, limited on CUDA by free memory.
        max_seq_len: KV cache length (prompt + response); grown on demand.
        use_cuda_graphs: default True on CUDA.
        fuse_weights: keep fused QKV and gate/up weights (an extra copy of the layer weights when the dtype
            matches; free when a cast copy exists anyway). Default: when a cast copy is needed, or on CUDA when
            the copy takes <= 5% of `memory_budget_bytes`.
        transpose_gate_up: store the fused gate/up weight as [hidden, 2 x intermediate] (an "NN" GEMM, faster
            for 64-256 decode rows on an H200; measured in docs/rollout.md).
        memory_budget_bytes: the device memory the run plans for (the plan's budget, e.g. an emulated P40's);
            default: the card's total memory.
        decode_attention: "sdpa", "matmul" (batched GEMMs, softmax in fp32) or "auto" (default: matmul in fp32,
            sdpa in half precision).
        check_every: decode steps between host checks for finished rows (and stop strings).
        pad_token_id: default: the tokenizer's pad id, else the first EOS id.
        prefill_tokens_per_chunk: padded prompt tokens per prefill forward (bounds prefill memory).
        match_hf_numerics: round like transformers inside RMSNorm, RoPE and residual adds (default). In bf16 this
            keeps the sampling log-probs within ~1e-4 (mean, random-weight model) of the trainer's, the numbers a
            PPO ratio is computed against; False fuses those ops (~12% faster decode steps on an H200, but a
            10-100x larger rollout/training log-prob mismatch in bf16; identical in fp32 up to rounding).
        fp32_logits: compute the LM head with fp32 output in half precision (default), as the trainer computes
            its log-probs; False rounds the logits to the model dtype as transformers' forward does. On CUDA it
            needs torch >= 2.8 (`torch.mm(..., out_dtype=)`); older versions keep half-precision logits.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        dtype: torch.dtype | None = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        use_cuda_graphs: bool | None = None,
        fuse_weights: bool | None = None,
        decode_attention: str = "auto",
        check_every: int = 8,
        pad_token_id: int | None = None,
        prefill_tokens_per_chunk: int = 16384,
        match_hf_numerics: bool = True,
        transpose_gate_up: bool = True,
        memory_budget_bytes: int | None = None,
        fp32_logits: bool = True,
    ):
        ok, reason = self.supports(model)
        if not ok:
            raise ValueError(f"FastEngine cannot run this model: {reason}. Use the HF engine (engine='hf').")
        if decode_attention not in ("auto", "sdpa", "matmul"):
            raise ValueError(f"decode_attention must be 'auto', 'sdpa' or 'matmul', got {decode_attention!r}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_seq_len is not None and max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len}")
        self.model = model
        self.tokenizer = tokenizer
        self.hf_model = unwrap_peft(model)
        self.is_peft = self.hf_model is not model
        self.match_hf_numerics = bool(match_hf_numerics)
        self.transpose_gate_up = bool(transpose_gate_up)
        self.check_every = max(1, int(check_every))
        self.prefill_tokens_per_chunk = max(1, int(prefill_tokens_per_chunk))

        inner = self.hf_model.model
        config = self.hf_model.config
        attn0 = inner.layers[0].self_attn
        q_weight = _effective_weight(attn0.q_proj)[0]
        self.device = q_weight.device
        self.dtype = dtype if dtype is not None else q_weight.dtype
        head_dim = int(getattr(attn0, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        sliding = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        self.dims = _Dims(
            layers=len(inner.layers),
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            vocab=_effective_weight(self.hf_model.lm_head)[0].shape[0],
            eps=float(config.rms_norm_eps),
            scaling=float(getattr(attn0, "scaling", head_dim**-0.5)),
            sliding_window=int(sliding) if sliding else None,
            qk_norm=hasattr(attn0, "q_norm"),
        )
        self.use_cuda_graphs = (self.device.type == "cuda") if use_cuda_graphs is None else bool(use_cuda_graphs)
        if self.use_cuda_graphs and self.device.type != "cuda":
            raise ValueError("use_cuda_graphs=True needs the model on a CUDA device")
        self.memory_budget_bytes = memory_budget_bytes
        self.fuse_weights = self._default_fuse(q_weight.dtype) if fuse_weights is None else bool(fuse_weights)
        # fp32: batched GEMMs beat the fused attention kernels for a decode step's few queries (2x on an H200);
        # half precision: SDPA keeps the scores in fp32 inside the kernel, where a bf16 GEMM would round them
        self.decode_attention = decode_attention if decode_attention != "auto" else (
            "matmul" if self.dtype == torch.float32 else "sdpa")
        # fp32 rounds the same either way (up to an ulp), so only half precision pays for transformers' rounding
        self._round_like_hf = self.match_hf_numerics and self.dtype != torch.float32
        self._out_dtype_gemm = bool(fp32_logits) and half_gemm_has_fp32_output(self.device, self.dtype)
        # Without a half-in/fp32-out GEMM (CUDA with torch < 2.8) fp32 logits would need an fp32 copy of the LM
        # head weight every step: keep half-precision logits there.
        self.fp32_logits = bool(fp32_logits) and (self._out_dtype_gemm or self.device.type != "cuda")
        self.eos_ids = collect_eos_ids(tokenizer, self.hf_model)
        self.pad_token_id = resolve_pad_token_id(pad_token_id, tokenizer, self.eos_ids)
        self.max_batch_size = max_batch_size

        self._global: dict[str, torch.Tensor] = {}
        self._layers: list[dict[str, torch.Tensor]] = [{} for _ in range(self.dims.layers)]
        self._owned: set[tuple[int, str]] = set()
        self._tied_head = False
        self._graphs: dict[tuple[int, int], Any] = {}
        self._graph_pool = None
        self._rows_cap = 0
        self._len_cap = 0
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        with torch.no_grad():
            self.sync_weights()
            if max_batch_size is not None and max_seq_len is not None:
                self._ensure_capacity(self._rows_per_wave(max_batch_size, max_seq_len), max_seq_len)

    def _default_fuse(self, weight_dtype: torch.dtype) -> bool:
        """Fuse QKV and gate/up when a cast copy exists anyway, or on CUDA when the copy is small (<= 5% of the
        memory budget; the estimator counts it the same way): fewer, larger GEMMs (~10% faster decode steps)."""
        if weight_dtype != self.dtype:
            return True
        if self.device.type != "cuda":
            return False
        d = self.dims
        inter = self.hf_model.model.layers[0].mlp.gate_proj
        inter_size = _effective_weight(inter)[0].shape[0]
        per_layer = d.hidden * ((d.heads + 2 * d.kv_heads) * d.head_dim + 2 * inter_size)
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        copy_bytes = d.layers * per_layer * itemsize
        budget = self.memory_budget_bytes or torch.cuda.get_device_properties(self.device).total_memory
        return copy_bytes <= FUSED_COPY_BUDGET_FRACTION * budget

    # ------------------------------------------------------------------------------------------------------------
    # Support check
    # ------------------------------------------------------------------------------------------------------------

    @staticmethod
    def supports(model: Any) -> tuple[bool, str]:
        """(True, "") when FastEngine can run `model`, else (False, a reason naming what is unsupported)."""
        hf = unwrap_peft(model)
        config = getattr(hf, "config", None)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            return False, f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
        inner = getattr(hf, "model", None)
        for attr in ("layers", "embed_tokens", "norm", "rotary_emb"):
            if not hasattr(inner, attr):
                return False, f"model.model has no {attr!r} (unexpected module layout)"
        if not hasattr(hf, "lm_head"):
            return False, "model has no lm_head"
        act = getattr(config, "hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            return False, f"activation {act!r} is not SwiGLU/SiLU"
        rope = _rope_type(config)
        if rope not in SUPPORTED_ROPE_TYPES:
            return False, f"rope type {rope!r} is not one of {SUPPORTED_ROPE_TYPES}"
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            return False, "sliding-window attention layers (use_sliding_window) are not supported"
        if getattr(hf, "hf_device_map", None) and len(set(hf.hf_device_map.values())) > 1:
            return False, "the model is split across devices (device_map); FastEngine needs one device"
        devices = {p.device for p in hf.parameters()}
        if len(devices) != 1:
            return False, f"parameters live on several devices {sorted(map(str, devices))}"
        device = next(iter(devices))
        if device.type not in ("cpu", "cuda"):
            return False, f"device type {device.type!r} is not supported (cpu or cuda only)"
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (6, 0):
            return False, "CUDA compute capability below 6.0"
        for name, p in hf.named_parameters():
            if not p.is_floating_point():
                return False, f"parameter {name} is {p.dtype} (quantized weights are not supported)"
        problem = _peft_problem(hf)
        if problem:
            return False, f"unsupported peft setup: {problem}"
        layer = inner.layers[0]
        for attr in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if not hasattr(layer.self_attn, attr):
                return False, f"attention has no {attr}"
        for attr in ("gate_proj", "up_proj", "down_proj"):
            if not hasattr(layer.mlp, attr):
                return False, f"MLP has no {attr} (not SwiGLU)"
        return True, ""

    # ------------------------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------------------------

    def _engine_tensor(self, tensor: torch.Tensor, live: bool) -> tuple[torch.Tensor, bool]:
        """(tensor in engine dtype/device, owned). A live parameter with matching dtype is used as is."""
        if live and tensor.dtype == self.dtype and tensor.device == self.device:
            return tensor, False
        return tensor.to(device=self.device, dtype=self.dtype, copy=True), True

    def _fused(self, modules: list[Any], bias: bool, transpose: bool = False) -> tuple[torch.Tensor | None, bool]:
        """Weights (or biases) of `modules` concatenated along the output dim; transpose: stored [in, out]."""
        parts = [_effective_weight(m) for m in modules]
        if bias:
            if all(p[1] is None for p in parts):
                return None, False
            tensors = [p[1] if p[1] is not None else p[0].new_zeros(p[0].shape[0]) for p in parts]
        else:
            tensors = [p[0] for p in parts]
        fused = torch.cat([t.to(device=self.device, dtype=self.dtype) for t in tensors], dim=0)
        return (fused.t().contiguous() if transpose and not bias else fused), True

    def _producers(self) -> dict[tuple[int, str], Callable[[], tuple[torch.Tensor | None, bool]]]:
        """Functions that produce each engine weight; key (layer index or -1, name)."""
        inner = self.hf_model.model
        prods: dict[tuple[int, str], Callable[[], tuple[torch.Tensor | None, bool]]] = {}

        def weight_of(module: Any) -> Callable[[], tuple[torch.Tensor, bool]]:
            def make() -> tuple[torch.Tensor, bool]:
                w, _, live = _effective_weight(module)
                return self._engine_tensor(w, live)

            return make

        def bias_of(module: Any) -> Callable[[], tuple[torch.Tensor | None, bool]]:
            def make() -> tuple[torch.Tensor | None, bool]:
                b = _effective_weight(module)[1]
                return (None, False) if b is None else self._engine_tensor(b, True)

            return make

        def fused(modules: list[Any], bias: bool, transpose: bool = False) -> Callable[[], tuple[torch.Tensor | None, bool]]:
            return lambda: self._fused(modules, bias, transpose)

        prods[(-1, "embed")] = weight_of(inner.embed_tokens)
        prods[(-1, "norm")] = weight_of(inner.norm)
        head_w = _effective_weight(self.hf_model.lm_head)
        embed_w = _effective_weight(inner.embed_tokens)
        self._tied_head = head_w[0] is embed_w[0] or (
            head_w[2] and embed_w[2] and head_w[0].data_ptr() == embed_w[0].data_ptr()
        )
        if not self._tied_head:
            prods[(-1, "head")] = weight_of(self.hf_model.lm_head)
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            prods[(i, "ln1")] = weight_of(layer.input_layernorm)
            prods[(i, "ln2")] = weight_of(layer.post_attention_layernorm)
            if self.dims.qk_norm:
                prods[(i, "q_norm")] = weight_of(attn.q_norm)
                prods[(i, "k_norm")] = weight_of(attn.k_norm)
            if self.fuse_weights:
                prods[(i, "qkv")] = fused([attn.q_proj, attn.k_proj, attn.v_proj], bias=False)
                prods[(i, "qkv_b")] = fused([attn.q_proj, attn.k_proj, attn.v_proj], bias=True)
                prods[(i, "gate_up")] = fused([mlp.gate_proj, mlp.up_proj], bias=False, transpose=self.transpose_gate_up)
                prods[(i, "gate_up_b")] = fused([mlp.gate_proj, mlp.up_proj], bias=True)
            else:
                for name, mod in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)):
                    prods[(i, name)] = weight_of(mod)
                    prods[(i, name + "_b")] = bias_of(mod)
                for name, mod in (("gate", mlp.gate_proj), ("up", mlp.up_proj)):
                    prods[(i, name)] = weight_of(mod)
                    prods[(i, name + "_b")] = bias_of(mod)
            prods[(i, "o")] = weight_of(attn.o_proj)
            prods[(i, "o_b")] = bias_of(attn.o_proj)
            prods[(i, "down")] = weight_of(mlp.down_proj)
            prods[(i, "down_b")] = bias_of(mlp.down_proj)
        return prods

    @torch.no_grad()
    def sync_weights(self) -> None:
        """Refresh engine-owned weight copies (cast / fused / LoRA-merged) from the model, in place.

        In-place copies keep the addresses the CUDA graphs were captured with; if a live parameter was replaced by
        a new tensor, the graphs are dropped and recaptured on the next step.
        """
        invalidate = False
        for key, produce in self._producers().items():
            layer, name = key
            store = self._global if layer < 0 else self._layers[layer]
            new, owned = produce()
            old = store.get(name)
            if new is None:
                invalidate |= old is not None
                store.pop(name, None)
                self._owned.discard(key)
                continue
            if old is not None and key in self._owned and owned and old.shape == new.shape:
                old.copy_(new)
                continue
            if old is None or old.data_ptr() != new.data_ptr() or old.shape != new.shape:
                invalidate |= old is not None
                store[name] = new
            if owned:
                self._owned.add(key)
            else:
                self._owned.discard(key)
        if self._tied_head:
            self._global["head"] = self._global["embed"]
        if invalidate:
            self._drop_graphs()

    # ------------------------------------------------------------------------------------------------------------
    # Cache and static buffers
    # ------------------------------------------------------------------------------------------------------------

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._graph_pool = None

    def _row_bytes(self, length: int) -> int:
        d = self.dims
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        kv = 2 * d.layers * d.kv_heads * length * d.head_dim * itemsize
        return kv + 4 * d.vocab * 4  # logits buffer + sampling temporaries

    def _ensure_capacity(self, rows: int, length: int) -> None:
        if self.k_cache is not None and rows <= self._rows_cap and length <= self._len_cap:
            return
        rows = max(rows, self._rows_cap)
        length = max(length, self._len_cap)
        length = int(math.ceil(length / 16) * 16)  # aligned rows for the attention kernels
        d = self.dims
        self._drop_graphs()
        self.k_cache = self.v_cache = None  # free the old cache before allocating the new one
        shape = (d.layers, rows, d.kv_heads, length, d.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._rows_cap, self._len_cap = rows, length
        cache_gib = 2 * self.k_cache.numel() * self.k_cache.element_size() / 2**30
        logger.info("FastEngine KV cache: %d rows x %d slots (%.2f GiB, %s)", rows, length, cache_gib, self.dtype)
        long = dict(dtype=torch.long, device=self.device)
        self._tok_buf = torch.zeros(rows, **long)
        self._pos_buf = torch.zeros(rows, **long)
        self._start_buf = torch.zeros(rows, **long)
        self._slot_buf = torch.zeros(1, **long)
        self._slot_range = torch.arange(length, **long)
        self._logits_buf = torch.zeros(rows, d.vocab, dtype=torch.float32, device=self.device)
        positions = torch.arange(length, **long)[None]
        probe = torch.zeros((), dtype=torch.float32, device=self.device)
        cos, sin = self.hf_model.model.rotary_emb(probe, positions)
        self._cos = cos[0].to(self.dtype).contiguous()
        self._sin = signed_sin(sin[0].to(self.dtype)).contiguous()

    def _rows_per_wave(self, rows_needed: int, length: int) -> int:
        """Rows decoded together: max_batch_size (default: all the call needs), on CUDA also bounded so the KV cache
        and logits buffers take at most half of the free memory (counting the cache already held)."""
        limit = min(rows_needed, self.max_batch_size) if self.max_batch_size is not None else rows_needed
        if self.device.type != "cuda":
            return max(1, limit)
        free, _ = torch.cuda.mem_get_info(self.device)
        if self.k_cache is not None:
            free += 2 * self.k_cache.numel() * self.k_cache.element_size()
        fit = int(0.5 * free // self._row_bytes(length))
        if fit < limit:
            logger.info("FastEngine: free GPU memory fits %d rows of %d slots; decoding in waves", fit, length)
        return max(1, min(limit, fit))

    def release_memory(self) -> None:
        """Free the KV cache, static buffers and CUDA graphs (e.g. before a memory-hungry update phase); the next
        generate allocates and captures them again."""
        self._drop_graphs()
        self.k_cache = self.v_cache = None
        self._rows_cap = self._len_cap = 0
        for name in ("_tok_buf", "_pos_buf", "_start_buf", "_slot_buf", "_slot_range", "_logits_buf", "_cos", "_sin"):
            self.__dict__.pop(name, None)

    def _bucket(self, rows: int) -> int:
        """Smallest power of two >= rows, capped at the cache's row capacity (itself a bucket)."""
        return min(1 << max(rows - 1, 0).bit_length(), self._rows_cap)

    def _span(self, slot: int) -> int:
        """Cache slots the attention reads at this step: slot+1 rounded up to a multiple of 256 (bounded)."""
        return min(self._len_cap, int(math.ceil((slot + 1) / 256) * 256))

    # ------------------------------------------------------------------------------------------------------------
    # Forward passes
    # ------------------------------------------------------------------------------------------------------------

    def _mlp_residual(self, h: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """h + SwiGLU(x)."""
        if self.fuse_weights:
            if self.transpose_gate_up:  # weight stored [hidden, 2 * intermediate]
                y = torch.matmul(x, w["gate_up"])
                y = y if w.get("gate_up_b") is None else y + w["gate_up_b"]
            else:
                y = F.linear(x, w["gate_up"], w.get("gate_up_b"))
            gate, up = y.chunk(2, dim=-1)
        else:
            gate, up = F.linear(x, w["gate"], w.get("gate_b")), F.linear(x, w["up"], w.get("up_b"))
        return residual_linear(h, F.silu(gate) * up, w["down"], w.get("down_b"), self._round_like_hf)

    def _qkv(self, x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor):
        """q [N, heads, T, D], k/v [N, kv_heads, T, D] for x [N, T, hidden], rope applied (sin: signed_sin)."""
        d, hf = self.dims, self._round_like_hf
        n, t = x.shape[0], x.shape[1]
        if self.fuse_weights:
            y = F.linear(x, w["qkv"], w.get("qkv_b")).view(n, t, d.heads + 2 * d.kv_heads, d.head_dim)
            qk, v = y[:, :, : d.heads + d.kv_heads], y[:, :, d.heads + d.kv_heads :]
            if d.qk_norm:
                qk = torch.cat((rms_norm(qk[:, :, : d.heads], w["q_norm"], d.eps, hf),
                                rms_norm(qk[:, :, d.heads :], w["k_norm"], d.eps, hf)), dim=2)
            qk = apply_rope(qk.transpose(1, 2), cos, sin, hf)  # q and k heads in one pass
            q, k = qk[:, : d.heads], qk[:, d.heads :]
        else:
            q = F.linear(x, w["q"], w.get("q_b")).view(n, t, d.heads, d.head_dim)
            k = F.linear(x, w["k"], w.get("k_b")).view(n, t, d.kv_heads, d.head_dim)
            v = F.linear(x, w["v"], w.get("v_b")).view(n, t, d.kv_heads, d.head_dim)
            if d.qk_norm:
                q = rms_norm(q, w["q_norm"], d.eps, hf)
                k = rms_norm(k, w["k_norm"], d.eps, hf)
            q = apply_rope(q.transpose(1, 2), cos, sin, hf)
            k = apply_rope(k.transpose(1, 2), cos, sin, hf)
        return q, k, v.transpose(1, 2)

    def _prefill(self, ids: torch.Tensor, lengths: torch.Tensor, row_start: int, copies: torch.Tensor) -> torch.Tensor:
        """Run left-padded prompts ids [U, P]; write their K/V into cache rows row_start.. (each prompt repeated
        `copies[u]` times); return last-position logits [U, vocab] float32."""
        d, hf = self.dims, self._round_like_hf
        n_prompts, width = ids.shape
        rows = int(copies.sum())
        start = width - lengths  # first real slot of each prompt
        slots = torch.arange(width, device=self.device)
        positions = (slots[None, :] - start[:, None]).clamp(min=0)
        cos = self._cos[positions][:, None]  # [U, 1, P, D]
        sin = self._sin[positions][:, None]
        key_ok = slots[None, :] >= start[:, None]  # [U, P]
        causal = slots[None, :] <= slots[:, None]  # [P, P]
        eye = torch.eye(width, dtype=torch.bool, device=self.device)
        # Padding queries attend to themselves only, so no softmax row is empty (no NaN).
        mask = ((causal[None] & key_ok[:, None, :]) | eye[None])[:, None]  # [U, 1, P, P]
        h = F.embedding(ids, self._global["embed"])
        for i, w in enumerate(self._layers):
            x = rms_norm(h, w["ln1"], d.eps, hf)
            q, k, v = self._qkv(x, w, cos, sin)
            self.k_cache[i, row_start : row_start + rows, :, :width] = k.repeat_interleave(copies, dim=0, output_size=rows)
            self.v_cache[i, row_start : row_start + rows, :, :width] = v.repeat_interleave(copies, dim=0, output_size=rows)
            if d.groups > 1:
                k = k.repeat_interleave(d.groups, dim=1)
                v = v.repeat_interleave(d.groups, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d.scaling)
            a = a.transpose(1, 2).reshape(n_prompts, width, d.heads * d.head_dim)
            h = residual_linear(h, a, w["o"], w.get("o_b"), hf)
            h = self._mlp_residual(h, rms_norm(h, w["ln2"], d.eps, hf), w)
        return self._logits(rms_norm(h[:, -1], self._global["norm"], d.eps, hf))

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the final normed hidden states [rows, hidden]."""
        if self.fp32_logits:
            return fp32_logits(last, self._global["head"], self._out_dtype_gemm)
        return F.linear(last, self._global["head"]).float()

    def _decode_forward(self, batch: int, span: int) -> None:
        """One decode step for rows [:batch] from the static buffers; logits go to self._logits_buf[:batch].

        Fixed shapes and no host reads, so it can be captured in a CUDA graph.
        """
        d, hf = self.dims, self._round_like_hf
        tokens, positions = self._tok_buf[:batch], self._pos_buf[:batch]
        slot = self._slot_buf
        cols = self._slot_range[:span]
        valid = (cols[None, :] >= self._start_buf[:batch, None]) & (cols[None, :] <= slot)  # [batch, span]
        # additive mask built once per step (not converted again inside every layer's attention call)
        mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(~valid, float("-inf"))
        if self.decode_attention == "sdpa":
            mask = mask[:, None, None, :]
        else:  # [batch * kv_heads, groups, span]: the addend of one batched GEMM per layer
            mask = mask[:, None, None, :].expand(batch, d.kv_heads, d.groups, span).reshape(-1, d.groups, span)
        cos = self._cos[positions][:, None, None]  # [batch, 1, 1, D]
        sin = self._sin[positions][:, None, None]
        h = F.embedding(tokens, self._global["embed"])[:, None]  # [batch, 1, hidden]
        for i, w in enumerate(self._layers):
            x = rms_norm(h, w["ln1"], d.eps, hf)
            q, k, v = self._qkv(x, w, cos, sin)  # q [batch, heads, 1, D], k/v [batch, kv, 1, D]
            k_cache, v_cache = self.k_cache[i, :batch], self.v_cache[i, :batch]
            k_cache.index_copy_(2, slot, k)
            v_cache.index_copy_(2, slot, v)
            # The query heads of one KV group act as G query positions against that group's keys (no GQA copy).
            keys, values = k_cache[:, :, :span], v_cache[:, :, :span]
            if self.decode_attention == "sdpa":
                q = q.reshape(batch, d.kv_heads, d.groups, d.head_dim)
                a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d.scaling)
            else:
                # Batched GEMMs over (row, kv head): scale and mask fused into the first, softmax in fp32.
                q = q.reshape(batch * d.kv_heads, d.groups, d.head_dim)
                keys = keys.reshape(batch * d.kv_heads, span, d.head_dim)
                values = values.reshape(batch * d.kv_heads, span, d.head_dim)
                scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=d.scaling)
                a = torch.bmm(scores.softmax(dim=-1, dtype=torch.float32).to(self.dtype), values)
            h = residual_linear(h, a.reshape(batch, 1, d.heads * d.head_dim), w["o"], w.get("o_b"), hf)
            h = self._mlp_residual(h, rms_norm(h, w["ln2"], d.eps, hf), w)
        self._logits_buf[:batch].copy_(self._logits(rms_norm(h[:, 0], self._global["norm"], d.eps, hf)))

    def _decode_step(self, batch: int, span: int) -> torch.Tensor:
        if not self.use_cuda_graphs:
            self._decode_forward(batch, span)
            return self._logits_buf[:batch]
        graph = self._graphs.get((batch, span))
        if graph is None:
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            # Warm up on a side stream (lazy kernel/cuBLAS init); it recomputes exactly this step, so the cache
            # write it makes is the one the replay makes.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._decode_forward(batch, span)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                self._decode_forward(batch, span)
            self._graphs[(batch, span)] = graph
        graph.replay()
        return self._logits_buf[:batch]

    # ------------------------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        generator: torch.Generator | None = None,
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
        gen = resolve_generator(generator, params.seed, self.device)
        eos_ids = [] if params.ignore_eos else list(self.eos_ids)
        n, steps = params.n, params.max_new_tokens
        total_rows = len(prompts) * n

        wave_rows = self._rows_per_wave(total_rows, longest)
        # Units of work: (prompt index, first sample, sample count); a prompt is split only when n > wave_rows.
        units = [(p, s, min(wave_rows, n - s)) for p in range(len(prompts)) for s in range(0, n, wave_rows)]
        waves: list[list[tuple[int, int, int]]] = [[]]
        for unit in units:
            if waves[-1] and sum(u[2] for u in waves[-1]) + unit[2] > wave_rows:
                waves.append([])
            waves[-1].append(unit)

        if len(waves) > 1:
            logger.info("FastEngine: %d rows in %d waves of <= %d rows", total_rows, len(waves), wave_rows)
        scratch = total_rows  # dummy output row for filler rows
        out_tokens = torch.full((steps, total_rows + 1), self.pad_token_id, dtype=torch.long, device=self.device)
        out_logprobs = torch.zeros((steps, total_rows + 1), dtype=torch.float32, device=self.device)
        stop_lengths: dict[int, int] = {}
        eos_tensor = torch.tensor(eos_ids or [-1], dtype=torch.long, device=self.device)
        for wave in waves:
            self._run_wave(wave, prompts, params, gen, out_tokens, out_logprobs, scratch, eos_tensor,
                           bool(eos_ids), matcher, stop_lengths)

        tokens = out_tokens[:, :total_rows].T
        logprobs = out_logprobs[:, :total_rows].T
        lengths = eos_lengths(tokens, eos_ids)
        for row, length in stop_lengths.items():
            lengths[row] = min(int(lengths[row]), length)
        return build_rollout_batch(prompts, n, tokens, logprobs, lengths, self.pad_token_id)

    def _run_wave(self, wave, prompts, params, gen, out_tokens, out_logprobs, scratch, eos_tensor, use_eos,
                  matcher, stop_lengths) -> None:
        n, steps = params.n, params.max_new_tokens
        width = max(len(prompts[p]) for p, _, _ in wave)
        rows = sum(c for _, _, c in wave)
        self._ensure_capacity(rows, width + steps)
        device = self.device

        # --- shared prefill: each unit's prompt once, its K/V copied to its rows; first token sampled per row
        first_logits, row = [], 0
        chunk_units = max(1, self.prefill_tokens_per_chunk // width)
        for c in range(0, len(wave), chunk_units):
            chunk = wave[c : c + chunk_units]
            ids = torch.full((len(chunk), width), self.pad_token_id, dtype=torch.long)
            for j, (p, _, _) in enumerate(chunk):
                ids[j, width - len(prompts[p]) :] = torch.tensor(prompts[p])
            lengths = torch.tensor([len(prompts[p]) for p, _, _ in chunk], device=device)
            copies = torch.tensor([cnt for _, _, cnt in chunk], device=device)
            logits = self._prefill(ids.to(device), lengths, row, copies)
            first_logits.append(logits.repeat_interleave(copies, dim=0, output_size=int(copies.sum())))
            row += int(copies.sum())
        row_ids = torch.tensor([p * n + s + j for p, s, cnt in wave for j in range(cnt)], device=device)
        prompt_len = torch.tensor([len(prompts[p]) for p, _, cnt in wave for _ in range(cnt)], device=device)
        tok, logp = sample_from_logits(torch.cat(first_logits), params, gen)
        out_tokens[0].index_copy_(0, row_ids, tok)
        out_logprobs[0].index_copy_(0, row_ids, logp)

        # --- decode state for the batch bucket (filler rows write to the scratch output row)
        batch = self._bucket(rows)
        fill = batch - rows
        self._tok_buf[:batch] = F.pad(tok, (0, fill), value=self.pad_token_id)
        self._pos_buf[:batch] = F.pad(prompt_len, (0, fill))
        self._start_buf[:batch] = F.pad(width - prompt_len, (0, fill))
        row_map = F.pad(row_ids, (0, fill), value=scratch)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        done[rows:] = True
        if use_eos:
            done[:rows] |= torch.isin(tok, eos_tensor)
        scanned = 0  # response positions already scanned for stop strings
        history: dict[int, list[int]] = {int(r): [] for r in row_ids.tolist()} if matcher else {}

        for t in range(1, steps):
            if t % self.check_every == 0:
                if matcher:
                    scanned = self._scan_stop_strings(matcher, history, out_tokens, scanned, t, row_map, done,
                                                      stop_lengths, eos_tensor if use_eos else None)
                active = (~done).nonzero().squeeze(1)
                if active.numel() == 0:
                    break
                smaller = self._bucket(active.numel())
                if smaller < batch:
                    row_map, done = self._compact(active, smaller, width + t - 1, row_map, done, scratch)
                    batch = smaller
            slot = width + t - 1
            self._slot_buf.fill_(slot)
            logits = self._decode_step(batch, self._span(slot))
            tok, logp = sample_from_logits(logits, params, gen)
            out_tokens[t].index_copy_(0, row_map, tok)
            out_logprobs[t].index_copy_(0, row_map, logp)
            if use_eos:
                done |= torch.isin(tok, eos_tensor)
            self._tok_buf[:batch] = tok
            self._pos_buf[:batch] += 1
        if matcher:
            self._scan_stop_strings(matcher, history, out_tokens, scanned, steps, row_map, done, stop_lengths,
                                    eos_tensor if use_eos else None)

    def _compact(self, active, batch, used_slots, row_map, done, scratch):
        """Move the active rows to the front of a `batch`-row bucket (filler rows repeat the first active row)."""
        count = active.numel()
        index = torch.cat([active, active[:1].expand(batch - count)]) if batch > count else active
        self.k_cache[:, :batch, :, :used_slots] = self.k_cache[:, index, :, :used_slots]
        self.v_cache[:, :batch, :, :used_slots] = self.v_cache[:, index, :, :used_slots]
        for buf in (self._tok_buf, self._pos_buf, self._start_buf):
            buf[:batch] = buf[index]
        new_map = row_map[index].clone()
        new_map[count:] = scratch
        new_done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        new_done[count:] = True
        return new_map, new_done

    def _scan_stop_strings(self, matcher, history, out_tokens, scanned, upto, row_map, done, stop_lengths,
                           eos_tensor) -> int:
        """Check response positions [scanned, upto) of rows still being scanned; mark rows that hit a stop string.

        Rows leave the scan at their first EOS or stop string, so a stop string before an EOS within the same
        window is still found.
        """
        if upto <= scanned or not history:
            return scanned
        rows = sorted(history)
        new = out_tokens[scanned:upto][:, rows].T.tolist()
        eos = set(eos_tensor.tolist()) if eos_tensor is not None else set()
        stopped = []
        for r, tokens in zip(rows, new):
            seq = history[r]
            for token in tokens:
                seq.append(token)
                if token in eos:
                    del history[r]
                    break
                if matcher.ends_with_stop(seq):
                    stop_lengths[r] = len(seq)
                    stopped.append(r)
                    del history[r]
                    break
        if stopped:
            hit = torch.isin(row_map, torch.tensor(stopped, dtype=torch.long, device=row_map.device))
            done |= hit
        return upto


__all__ = ["FastEngine", "SUPPORTED_MODEL_TYPES", "rms_norm", "apply_rope", "signed_sin", "residual_linear"]
