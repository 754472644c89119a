"""The Llama-family model forward for FastEngine (Llama / Qwen2 / Qwen3 / Mistral), and reading its weights.

One job: turn token ids into fp32 logits with the HF model's own parameters, arithmetic matching transformers'
Llama/Qwen2 modules. Three pieces:

- shared layers as pure functions: `rms_norm`, `apply_rope`, `residual_linear`, `fp32_logits` (the model family
  differs only in config flags: attention biases (Qwen2), q/k norms (Qwen3), sliding window (Mistral));
- `LlamaWeights`: reads the (possibly peft-wrapped) HF weights into engine tensors: the live parameter when the
  dtype matches, else one cast copy; fused QKV and gate/up copies when asked; LoRA-merged copies for peft models
  (base + active deltas, so the base weights are never modified in place). `sync()` refreshes the copies in place;
- `LlamaForward`: the prefill and decode passes over those tensors. It reads and writes keys/values through the
  cache object it is given (rollout/runner.py `KVCache`); it allocates nothing that outlives a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..compiling import compile_dynamic
from ..lora import unwrap_peft
from ..vocabulary import ACCUMULATE_DTYPE, DECODE_SDPA, DECODE_TRITON, FP32, is_half
from . import decode_elementwise
from .decode_attention import decode_attention as triton_decode_attention
from .decode_attention import rope_and_store, rope_store_attention, triton_interpreting, triton_usable

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu", "swish")


# ----------------------------------------------------------------------------------------------------------------
# Reading (possibly peft-wrapped) weights
# ----------------------------------------------------------------------------------------------------------------


def rope_type(config: Any) -> str:
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


def _bias(module: Any) -> torch.Tensor | None:
    bias = getattr(module, "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


def effective_weight(module: Any) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
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
    out = weight.to(ACCUMULATE_DTYPE)
    for a in add:
        out = out + module.get_delta_weight(a).detach().to(ACCUMULATE_DTYPE)
    for a in sub:
        out = out - module.get_delta_weight(a).detach().to(ACCUMULATE_DTYPE)
    return out, bias, False


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


def supports(model: Any) -> tuple[bool, str]:
    """(True, "") when this forward can run `model`, else (False, a reason naming what is unsupported)."""
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
    rope = rope_type(config)
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


# ----------------------------------------------------------------------------------------------------------------
# Shared layers: pure tensor functions (same arithmetic as transformers' Llama/Qwen2 modules)
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


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 match_hf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta)): a residual add and the next norm, one kernel when compiled."""
    h = h + delta
    return h, rms_norm(h, weight, eps, match_hf)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's SiLU(gate) * up (transformers' rounding)."""
    return F.silu(gate) * up


def compiled_elementwise() -> dict[str, Any]:
    """add_rms_norm, apply_rope and silu_mul compiled by torch.compile (inductor, Triton on a GPU), each
    one fused kernel instead of several, with eager's rounding of every intermediate (inductor's
    emulate_precision_casts, a process-wide setting): transformers' numerics, fewer kernel launches. Shapes are
    dynamic without duck sizing (compiling.py), so every batch bucket and span shares one compiled kernel per
    function. The decode step calls them; a prefill and the first layer's norm run eagerly (LlamaForward)."""
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    return {name: compile_dynamic(fn)
            for name, fn in (("add_rms_norm", add_rms_norm), ("apply_rope", apply_rope), ("silu_mul", silu_mul))}


def half_gemm_has_fp32_output(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch.mm(..., out_dtype=fp32)` runs for `dtype` inputs on `device` (CUDA, torch >= 2.8)."""
    if device.type != "cuda" or dtype == FP32:
        return False
    try:
        probe = torch.ones(2, 8, dtype=dtype, device=device)
        return torch.mm(probe, probe.t(), out_dtype=FP32).dtype == FP32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def fp32_logits(hidden: torch.Tensor, weight: torch.Tensor, out_dtype_gemm: bool) -> torch.Tensor:
    """Logits [rows, vocab] in fp32 from hidden states [rows, hidden] of any dtype: fp32 accumulation *and* fp32
    output, as the trainer's log-probs are computed (logprobs.py). Rounding half-precision logits (~20 in size,
    steps of 0.125 in bf16) alone moves log-probs by a few 1e-2 between two otherwise equal passes.
    out_dtype_gemm: half inputs, fp32 output in one GEMM (CUDA); else the inputs are upcast."""
    if weight.dtype == FP32:
        return F.linear(hidden.to(FP32), weight)
    if out_dtype_gemm:
        return torch.mm(hidden, weight.t(), out_dtype=FP32)
    return F.linear(hidden.to(FP32), weight.to(FP32))


# ----------------------------------------------------------------------------------------------------------------
# Shapes and numerics
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    """The shapes the forward needs, read from the HF config and the first layer."""

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

    @classmethod
    def of(cls, hf_model: Any) -> "ModelDims":
        inner, config = hf_model.model, hf_model.config
        attn0 = inner.layers[0].self_attn
        head_dim = int(getattr(attn0, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        sliding = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        return cls(
            layers=len(inner.layers),
            hidden=config.hidden_size,
            heads=config.num_attention_heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            vocab=effective_weight(hf_model.lm_head)[0].shape[0],
            eps=float(config.rms_norm_eps),
            scaling=float(getattr(attn0, "scaling", head_dim**-0.5)),
            sliding_window=int(sliding) if sliding else None,
            qk_norm=hasattr(attn0, "q_norm"),
        )


@dataclass(frozen=True)
class Numerics:
    """How the forward rounds and which kernels it uses (all decided by the RolloutPlan, resolved for the device)."""

    decode_attention: str  # DecodeAttention: "sdpa" | "matmul" | "triton"
    round_like_hf: bool  # transformers' rounding inside RMSNorm, RoPE, residual adds (half precision only)
    fp32_logits: bool  # LM head with fp32 output
    out_dtype_gemm: bool  # the fp32-output LM head as one half-in/fp32-out GEMM (CUDA, torch >= 2.8)
    fuse_weights: bool
    transpose_gate_up: bool
    compile_elementwise: bool = False  # decode's norms, RoPE, SiLU*mul and residual adds as torch.compile kernels
    fused_kv_write: bool = False  # decode's RoPE and K/V cache writes as one Triton kernel (fused QKV weights)
    qkv_bias_apart: bool = False  # decode's q/k/v biases added after their GEMM, not in its epilogue
    attention_tf32x3: bool = False  # fp32 Triton decode attention's products as three TF32 products each
    fp32_gemm_layouts: bool = False  # decode: o_proj and LM head from [in, out] copies, down as W @ x^T


# ----------------------------------------------------------------------------------------------------------------
# Engine weight tensors
# ----------------------------------------------------------------------------------------------------------------

WeightKey = tuple[int, str]  # (layer index, or -1 for embed/norm/head; name)


class LlamaWeights:
    """Engine tensors for every weight of the model: `globals` (embed, norm, head) and `layers[i]` (ln1, ln2,
    q/k/v or qkv, o, gate/up or gate_up, down, their biases, q_norm/k_norm). A live parameter is used as is when
    the dtype and device match; other tensors (cast, fused, LoRA-merged) are engine-owned copies."""

    def __init__(self, hf_model: Any, dims: ModelDims, dtype: torch.dtype, device: torch.device,
                 fuse: bool, transpose_gate_up: bool, layout_copies: bool = False):
        self.hf_model, self.dims, self.dtype, self.device = hf_model, dims, dtype, device
        self.fuse, self.transpose_gate_up = fuse, transpose_gate_up
        self.layout_copies = layout_copies  # [in, out] copies of o_proj ("o_t") and the LM head ("head_t")
        self.globals: dict[str, torch.Tensor] = {}
        self.layers: list[dict[str, torch.Tensor]] = [{} for _ in range(dims.layers)]
        self.owned: set[WeightKey] = set()
        self.tied_head = False

    def owned_bytes(self) -> int:
        """Bytes of the engine-owned copies (what the estimator's rollout_engine_weight_bytes predicts)."""
        total = 0
        for layer, name in self.owned:
            tensor = self.globals[name] if layer < 0 else self.layers[layer][name]
            total += tensor.numel() * tensor.element_size()
        return total

    def _engine_tensor(self, tensor: torch.Tensor, live: bool) -> tuple[torch.Tensor, bool]:
        """(tensor in engine dtype/device, owned). A live parameter with matching dtype is used as is."""
        if live and tensor.dtype == self.dtype and tensor.device == self.device:
            return tensor, False
        return tensor.to(device=self.device, dtype=self.dtype, copy=True), True

    def _fused(self, modules: list[Any], bias: bool, transpose: bool = False) -> tuple[torch.Tensor | None, bool]:
        """Weights (or biases) of `modules` concatenated along the output dim; transpose: stored [in, out]."""
        parts = [effective_weight(m) for m in modules]
        if bias:
            if all(p[1] is None for p in parts):
                return None, False
            tensors = [p[1] if p[1] is not None else p[0].new_zeros(p[0].shape[0]) for p in parts]
        else:
            tensors = [p[0] for p in parts]
        fused = torch.cat([t.to(device=self.device, dtype=self.dtype) for t in tensors], dim=0)
        return (fused.t().contiguous() if transpose and not bias else fused), True

    def _producers(self) -> dict[WeightKey, Callable[[], tuple[torch.Tensor | None, bool]]]:
        """Functions that produce each engine weight."""
        inner = self.hf_model.model
        prods: dict[WeightKey, Callable[[], tuple[torch.Tensor | None, bool]]] = {}

        def weight_of(module: Any) -> Callable[[], tuple[torch.Tensor, bool]]:
            def make() -> tuple[torch.Tensor, bool]:
                w, _, live = effective_weight(module)
                return self._engine_tensor(w, live)

            return make

        def bias_of(module: Any) -> Callable[[], tuple[torch.Tensor | None, bool]]:
            def make() -> tuple[torch.Tensor | None, bool]:
                b = effective_weight(module)[1]
                return (None, False) if b is None else self._engine_tensor(b, True)

            return make

        def fused(modules: list[Any], bias: bool, transpose: bool = False):
            return lambda: self._fused(modules, bias, transpose)

        prods[(-1, "embed")] = weight_of(inner.embed_tokens)
        prods[(-1, "norm")] = weight_of(inner.norm)
        head_w = effective_weight(self.hf_model.lm_head)
        embed_w = effective_weight(inner.embed_tokens)
        self.tied_head = head_w[0] is embed_w[0] or (
            head_w[2] and embed_w[2] and head_w[0].data_ptr() == embed_w[0].data_ptr()
        )
        if not self.tied_head:
            prods[(-1, "head")] = weight_of(self.hf_model.lm_head)
        if self.layout_copies:
            prods[(-1, "head_t")] = fused([self.hf_model.lm_head], bias=False, transpose=True)
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            prods[(i, "ln1")] = weight_of(layer.input_layernorm)
            prods[(i, "ln2")] = weight_of(layer.post_attention_layernorm)
            if self.dims.qk_norm:
                prods[(i, "q_norm")] = weight_of(attn.q_norm)
                prods[(i, "k_norm")] = weight_of(attn.k_norm)
            if self.fuse:
                prods[(i, "qkv")] = fused([attn.q_proj, attn.k_proj, attn.v_proj], bias=False)
                prods[(i, "qkv_b")] = fused([attn.q_proj, attn.k_proj, attn.v_proj], bias=True)
                prods[(i, "gate_up")] = fused([mlp.gate_proj, mlp.up_proj], bias=False,
                                              transpose=self.transpose_gate_up)
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
            if self.layout_copies:
                prods[(i, "o_t")] = fused([attn.o_proj], bias=False, transpose=True)
            prods[(i, "down")] = weight_of(mlp.down_proj)
            prods[(i, "down_b")] = bias_of(mlp.down_proj)
        return prods

    @torch.no_grad()
    def sync(self) -> bool:
        """Refresh the engine tensors from the model, owned copies in place (so captured CUDA graphs stay valid).

        Returns True when a tensor's address changed (a live parameter replaced by a new tensor, a shape change):
        graphs captured with the old addresses must be dropped.
        """
        moved = False
        for key, produce in self._producers().items():
            layer, name = key
            store = self.globals if layer < 0 else self.layers[layer]
            new, owned = produce()
            old = store.get(name)
            if new is None:
                moved |= old is not None
                store.pop(name, None)
                self.owned.discard(key)
                continue
            if old is not None and key in self.owned and owned and old.shape == new.shape:
                old.copy_(new)
                continue
            if old is None or old.data_ptr() != new.data_ptr() or old.shape != new.shape:
                moved |= old is not None
                store[name] = new
            if owned:
                self.owned.add(key)
            else:
                self.owned.discard(key)
        if self.tied_head:
            self.globals["head"] = self.globals["embed"]
        return moved


# ----------------------------------------------------------------------------------------------------------------
# The forward passes
# ----------------------------------------------------------------------------------------------------------------


class LlamaForward:
    """Prefill and decode passes of a Llama-family decoder over `LlamaWeights`, K/V through a cache object.

    The cache object provides `store_prompt(layer, row_start, k, v, copies, rows)` (prefill),
    `append(layer, batch, slot, k, v, span) -> (keys, values)` (decode) and `layer(i) -> (k, v)` (one layer's
    tensors, for the fused RoPE + cache write); rollout/runner.py `KVCache` does.
    """

    def __init__(self, hf_model: Any, dtype: torch.dtype, device: torch.device, numerics: Numerics):
        self.hf_model = hf_model
        self.dims = ModelDims.of(hf_model)
        self.dtype, self.device, self.numerics = dtype, device, numerics
        self.weights = LlamaWeights(hf_model, self.dims, dtype, device, numerics.fuse_weights,
                                    numerics.transpose_gate_up, layout_copies=numerics.fp32_gemm_layouts)
        # the decode step's elementwise functions: compiled (fused kernels) or as written
        self.ops = compiled_elementwise() if numerics.compile_elementwise else {
            "add_rms_norm": add_rms_norm, "apply_rope": apply_rope, "silu_mul": silu_mul}
        # half precision: the residual adds + norms and SiLU*mul as hand-written Triton kernels instead (no
        # compilation; the embedding gather inside the first norm); fp32 keeps the compiled ones
        self.triton_elementwise = (numerics.compile_elementwise and is_half(dtype) and triton_usable()
                                   and (device.type == "cuda" or triton_interpreting()))
        # the one-kernel RoPE + cache write reads the fused QKV output; q/k norms (Qwen3) come before RoPE
        self.kv_write_kernel = numerics.fused_kv_write and numerics.fuse_weights and not self.dims.qk_norm
        # half precision with the Triton attention: RoPE, cache write and attention in one kernel (the bias, if
        # any, stays in the QKV GEMM)
        self.rope_attention_kernel = (self.kv_write_kernel and numerics.decode_attention == DECODE_TRITON
                                      and is_half(dtype) and not numerics.qkv_bias_apart)

    @property
    def launches_triton(self) -> bool:
        """Whether a decode step launches Triton kernels (attention, RoPE + cache write, norms, SiLU*mul)."""
        return self.triton_elementwise or self.kv_write_kernel or self.numerics.decode_attention == DECODE_TRITON

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) [length, head_dim] in the engine dtype, from the model's own rotary embedding."""
        positions = torch.arange(length, dtype=torch.long, device=self.device)[None]
        probe = torch.zeros((), dtype=FP32, device=self.device)
        cos, sin = self.hf_model.model.rotary_emb(probe, positions)
        return cos[0].to(self.dtype).contiguous(), signed_sin(sin[0].to(self.dtype)).contiguous()

    def logits(self, last: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the final normed hidden states [rows, hidden]. A decode step with
        fp32_gemm_layouts multiplies by the LM head's [in, out] copy (the same sums, a faster cuBLAS kernel)."""
        if decode and self.numerics.fp32_gemm_layouts:
            return torch.mm(last, self.weights.globals["head_t"])
        head = self.weights.globals["head"]
        if self.numerics.fp32_logits:
            return fp32_logits(last, head, self.numerics.out_dtype_gemm)
        return F.linear(last, head).to(FP32)

    def fused_gate_up(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """[..., 2 x intermediate]: gate then up, one GEMM over the fused weights."""
        if self.numerics.transpose_gate_up:  # weight stored [hidden, 2 * intermediate]
            y = torch.matmul(x, w["gate_up"])
            return y if w.get("gate_up_b") is None else y + w["gate_up_b"]
        return F.linear(x, w["gate_up"], w.get("gate_up_b"))

    def gate_up(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """SwiGLU's two projections of x: (gate, up), from one fused GEMM when the weights are fused."""
        if self.numerics.fuse_weights:
            return self.fused_gate_up(x, w).chunk(2, dim=-1)
        return F.linear(x, w["gate"], w.get("gate_b")), F.linear(x, w["up"], w.get("up_b"))

    def decode_activation(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """A decode step's SiLU(gate(x)) * up(x): with the Triton elementwise kernels and fused weights, one kernel
        over the fused gate/up output; else the planned silu_mul of the two halves."""
        if self.triton_elementwise and self.numerics.fuse_weights:
            y = self.fused_gate_up(x, w)
            return decode_elementwise.silu_mul(y, y.shape[-1] // 2)
        return self.ops["silu_mul"](*self.gate_up(x, w))

    def mlp_residual(self, h: torch.Tensor, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """h + SwiGLU(x)."""
        return residual_linear(h, silu_mul(*self.gate_up(x, w)), w["down"], w.get("down_b"),
                               self.numerics.round_like_hf)

    def decode_o(self, a: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """A decode step's o_proj: a @ Wo^T (+ bias), from Wo's [in, out] copy with fp32_gemm_layouts."""
        if self.numerics.fp32_gemm_layouts:
            y = torch.matmul(a, w["o_t"])
            return y if w.get("o_b") is None else y + w["o_b"]
        return F.linear(a, w["o"], w.get("o_b"))

    def decode_down(self, s: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """A decode step's down_proj of s [rows, 1, intermediate]: with fp32_gemm_layouts as (W @ s^T)^T, a
        transposed view (the next norm reads it as it is)."""
        if self.numerics.fp32_gemm_layouts:
            rows = s.shape[0]
            y = torch.mm(w["down"], s.reshape(rows, -1).t()).t().view(rows, 1, -1)
            return y if w.get("down_b") is None else y + w["down_b"]
        return F.linear(s, w["down"], w.get("down_b"))

    def projection(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   decode: bool) -> torch.Tensor:
        """x @ weight.T + bias for the q/k/v projections. A decode step with `qkv_bias_apart` adds the bias
        after the GEMM: cuBLASLt's bias epilogue runs a 2x slower fp32 GEMM at decode shapes (H200, 128 rows:
        30.7 vs 14.6 us); in fp32 the sum is the same either way (one rounding of product + bias)."""
        if bias is not None and decode and self.numerics.qkv_bias_apart:
            return F.linear(x, weight).add_(bias)
        return F.linear(x, weight, bias)

    def qkv(self, x: torch.Tensor, w: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
            decode: bool = False):
        """q [N, heads, T, D], k/v [N, kv_heads, T, D] for x [N, T, hidden], rope applied (sin: signed_sin).
        A prefill applies RoPE eagerly: it runs once a rollout, and compiling it too (RoPE over many positions is a
        graph of its own) costs the first step seconds that its fused kernel repays only over thousands of
        rollouts."""
        d, hf = self.dims, self.numerics.round_like_hf
        n, t = x.shape[0], x.shape[1]
        rope = self.ops["apply_rope"] if decode else apply_rope
        if self.numerics.fuse_weights:
            y = self.projection(x, w["qkv"], w.get("qkv_b"), decode).view(n, t, d.heads + 2 * d.kv_heads,
                                                                         d.head_dim)
            qk, v = y[:, :, : d.heads + d.kv_heads], y[:, :, d.heads + d.kv_heads :]
            if d.qk_norm:
                qk = torch.cat((rms_norm(qk[:, :, : d.heads], w["q_norm"], d.eps, hf),
                                rms_norm(qk[:, :, d.heads :], w["k_norm"], d.eps, hf)), dim=2)
            qk = rope(qk.transpose(1, 2), cos, sin, hf)  # q and k heads in one pass
            q, k = qk[:, : d.heads], qk[:, d.heads :]
        else:
            q = self.projection(x, w["q"], w.get("q_b"), decode).view(n, t, d.heads, d.head_dim)
            k = self.projection(x, w["k"], w.get("k_b"), decode).view(n, t, d.kv_heads, d.head_dim)
            v = self.projection(x, w["v"], w.get("v_b"), decode).view(n, t, d.kv_heads, d.head_dim)
            if d.qk_norm:
                q = rms_norm(q, w["q_norm"], d.eps, hf)
                k = rms_norm(k, w["k_norm"], d.eps, hf)
            q = rope(q.transpose(1, 2), cos, sin, hf)
            k = rope(k.transpose(1, 2), cos, sin, hf)
        return q, k, v.transpose(1, 2)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, copies: torch.Tensor, row_start: int,
                rope: tuple[torch.Tensor, torch.Tensor], cache: Any) -> torch.Tensor:
        """Run left-padded prompts ids [U, P]; store their K/V in cache rows row_start.. (prompt u repeated
        `copies[u]` times); return last-position logits [U, vocab] fp32."""
        d, hf = self.dims, self.numerics.round_like_hf
        n_prompts, width = ids.shape
        rows = int(copies.sum())
        start = width - lengths  # first real slot of each prompt
        slots = torch.arange(width, device=self.device)
        positions = (slots[None, :] - start[:, None]).clamp(min=0)
        cos = rope[0][positions][:, None]  # [U, 1, P, D]
        sin = rope[1][positions][:, None]
        key_ok = slots[None, :] >= start[:, None]  # [U, P]
        causal = slots[None, :] <= slots[:, None]  # [P, P]
        eye = torch.eye(width, dtype=torch.bool, device=self.device)
        # Padding queries attend to themselves only, so no softmax row is empty (no NaN).
        mask = ((causal[None] & key_ok[:, None, :]) | eye[None])[:, None]  # [U, 1, P, P]
        h = F.embedding(ids, self.weights.globals["embed"])
        for i, w in enumerate(self.weights.layers):
            x = rms_norm(h, w["ln1"], d.eps, hf)
            q, k, v = self.qkv(x, w, cos, sin)
            cache.store_prompt(i, row_start, k, v, copies, rows)
            if d.groups > 1:
                k = k.repeat_interleave(d.groups, dim=1)
                v = v.repeat_interleave(d.groups, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d.scaling)
            a = a.transpose(1, 2).reshape(n_prompts, width, d.heads * d.head_dim)
            h = residual_linear(h, a, w["o"], w.get("o_b"), hf)
            h = self.mlp_residual(h, rms_norm(h, w["ln2"], d.eps, hf), w)
        return self.logits(rms_norm(h[:, -1], self.weights.globals["norm"], d.eps, hf))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor, slot: torch.Tensor,
               cols: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: Any) -> torch.Tensor:
        """One decode step for `batch` rows: tokens/positions/starts [batch], slot [1] (the cache slot every row
        writes), cols = arange(span) (the slots attention reads). Returns logits [batch, vocab] fp32.

        Fixed shapes and no host reads, so it can be captured in a CUDA graph.
        """
        d, hf = self.dims, self.numerics.round_like_hf
        batch, span = tokens.shape[0], cols.shape[0]
        mask = self._decode_mask(cols, starts, slot)
        cos = rope[0][positions][:, None, None]  # [batch, 1, 1, D]
        sin = rope[1][positions][:, None, None]
        if self.numerics.compile_elementwise:
            return self._decode_fused(tokens, cos, sin, mask, starts, slot, batch, span, cache)
        h = F.embedding(tokens[:, None], self.weights.globals["embed"])  # [batch, 1, hidden]
        for i, w in enumerate(self.weights.layers):
            x = rms_norm(h, w["ln1"], d.eps, hf)
            q, keys, values = self._decode_qkv(i, x, w, cos, sin, cache, batch, slot, span)
            a = self._decode_attention(q, keys, values, mask, starts, slot, batch, span)
            if self.numerics.fp32_gemm_layouts:
                h = h + self.decode_o(a, w)
                h = h + self.decode_down(silu_mul(*self.gate_up(rms_norm(h, w["ln2"], d.eps, hf), w)), w)
            else:
                h = residual_linear(h, a, w["o"], w.get("o_b"), hf)
                h = self.mlp_residual(h, rms_norm(h, w["ln2"], d.eps, hf), w)
        return self.logits(rms_norm(h[:, 0], self.weights.globals["norm"], d.eps, hf), decode=True)

    def _decode_qkv(self, i: int, x, w, cos, sin, cache: Any, batch: int, slot, span: int):
        """Layer i's rotated queries [batch, heads, 1, D] and the keys/values attention reads ([batch, kv, span, D]
        views of the cache), this step's key and value written at `slot` first."""
        d = self.dims
        if self.kv_write_kernel:
            bias = w.get("qkv_b")
            apart = bias is not None and self.numerics.qkv_bias_apart  # then the kernel adds it
            y = F.linear(x, w["qkv"], None if apart else bias).view(batch, d.heads + 2 * d.kv_heads, d.head_dim)
            cache_k, cache_v = cache.layer(i)
            q = rope_and_store(y, cos.view(batch, d.head_dim), sin.view(batch, d.head_dim), cache_k, cache_v, slot,
                               d.heads, self.numerics.round_like_hf, bias if apart else None)
            return q.view(batch, d.heads, 1, d.head_dim), cache_k[:batch, :, :span], cache_v[:batch, :, :span]
        q, k, v = self.qkv(x, w, cos, sin, decode=True)  # q [batch, heads, 1, D], k/v [batch, kv, 1, D]
        keys, values = cache.append(i, batch, slot, k, v, span)
        return q, keys, values

    def _decode_mask(self, cols: torch.Tensor, starts: torch.Tensor, slot: torch.Tensor) -> torch.Tensor | None:
        """The additive attention mask of a decode step (built once, not inside every layer), shaped for the
        planned kernel; None for the Triton kernel (it reads each row's [start, slot] itself)."""
        kind, d = self.numerics.decode_attention, self.dims
        if kind == DECODE_TRITON:
            return None
        valid = (cols[None, :] >= starts[:, None]) & (cols[None, :] <= slot)  # [batch, span]
        mask = torch.zeros(valid.shape, dtype=self.dtype, device=self.device).masked_fill_(~valid, float("-inf"))
        if kind == DECODE_SDPA:
            return mask[:, None, None, :]
        batch, span = valid.shape  # [batch * kv_heads, groups, span]: the addend of one batched GEMM per layer
        return mask[:, None, None, :].expand(batch, d.kv_heads, d.groups, span).reshape(-1, d.groups, span)

    def _decode_attention(self, q, keys, values, mask, starts, slot, batch: int, span: int) -> torch.Tensor:
        """[batch, 1, heads x D] attention output of one decode step. The query heads of one KV group act as G
        query positions against that group's keys (no GQA copy)."""
        d, kind = self.dims, self.numerics.decode_attention
        if kind == DECODE_TRITON:
            a = triton_decode_attention(q.reshape(batch, d.kv_heads, d.groups, d.head_dim), keys, values, starts,
                                        slot, d.scaling, tf32x3=self.numerics.attention_tf32x3)
        elif kind == DECODE_SDPA:
            q = q.reshape(batch, d.kv_heads, d.groups, d.head_dim)
            a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=d.scaling)
        else:
            # Batched GEMMs over (row, kv head): scale and mask fused into the first, softmax in fp32.
            q = q.reshape(batch * d.kv_heads, d.groups, d.head_dim)
            keys = keys.reshape(batch * d.kv_heads, span, d.head_dim)
            values = values.reshape(batch * d.kv_heads, span, d.head_dim)
            scores = torch.baddbmm(mask, q, keys.transpose(1, 2), alpha=d.scaling)
            a = torch.bmm(scores.softmax(dim=-1, dtype=ACCUMULATE_DTYPE).to(self.dtype), values)
        return a.reshape(batch, 1, d.heads * d.head_dim)

    def _decode_fused(self, tokens, cos, sin, mask, starts, slot, batch: int, span: int, cache: Any) -> torch.Tensor:
        """The decode layers with fused elementwise kernels (compiled, or the Triton ones in half precision): each
        residual add runs inside the next norm's kernel (the last MLP output is added inside the final norm), RoPE
        and SiLU*mul are one kernel each. Residual adds round after the GEMM (transformers' order) in every dtype:
        fp32 matches the default path to an ulp; half precision with round_like_hf matches it exactly (inductor
        rounds every intermediate, the Triton kernels round as eager does)."""
        d, hf, globals_ = self.dims, self.numerics.round_like_hf, self.weights.globals
        add_norm = decode_elementwise.add_rms_norm if self.triton_elementwise else self.ops["add_rms_norm"]
        pending = None  # the previous layer's MLP output, not yet added to h
        for i, w in enumerate(self.weights.layers):
            if pending is not None:
                h, x = add_norm(h, pending, w["ln1"], d.eps, hf)
            elif self.triton_elementwise:  # the embedding rows and the first norm: one kernel
                h, x = decode_elementwise.embed_rms_norm(tokens[:, None], globals_["embed"], w["ln1"], d.eps, hf)
            else:  # eager: one graph fewer to compile for one kernel a step
                h = F.embedding(tokens[:, None], globals_["embed"])  # [batch, 1, hidden]
                x = rms_norm(h, w["ln1"], d.eps, hf)
            if self.rope_attention_kernel:
                a = self._decode_rope_attention(i, x, w, cos, sin, starts, cache, batch, slot, span)
            else:
                q, keys, values = self._decode_qkv(i, x, w, cos, sin, cache, batch, slot, span)
                a = self._decode_attention(q, keys, values, mask, starts, slot, batch, span)
            h, x = add_norm(h, self.decode_o(a, w), w["ln2"], d.eps, hf)
            pending = self.decode_down(self.decode_activation(x, w), w)
        _, x = add_norm(h, pending, globals_["norm"], d.eps, hf)
        return self.logits(x[:, 0], decode=True)

    def _decode_rope_attention(self, i: int, x, w, cos, sin, starts, cache: Any, batch: int, slot,
                               span: int) -> torch.Tensor:
        """Layer i's attention output [batch, 1, heads x D] from its fused QKV projection of x: RoPE, the cache
        write at `slot` and the attention in one Triton kernel (half precision)."""
        d = self.dims
        y = F.linear(x, w["qkv"], w.get("qkv_b")).view(batch, d.heads + 2 * d.kv_heads, d.head_dim)
        cache_k, cache_v = cache.layer(i)
        a = rope_store_attention(y, cos.view(batch, d.head_dim), sin.view(batch, d.head_dim), cache_k, cache_v,
                                 starts, slot, d.heads, span, d.scaling, self.numerics.round_like_hf)
        return a.reshape(batch, 1, d.heads * d.head_dim)


__all__ = ["LlamaForward", "LlamaWeights", "ModelDims", "Numerics", "supports", "rms_norm", "apply_rope",
           "signed_sin", "residual_linear", "fp32_logits", "half_gemm_has_fp32_output", "SUPPORTED_MODEL_TYPES"]
