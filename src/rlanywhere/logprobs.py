"""Chunked token log-probs and entropy from final hidden states.

The memory killer of PPO on a small card is not the weights but the logits: for Qwen2.5-0.5B a batch of
8 x 512 tokens has 8 * 512 * 151,936 fp32 logits = 2.5 GB, and autograd keeps that tensor (plus a softmax of the
same size) alive until backward. This module never builds the full [N, T, V] logits, neither in forward nor in
backward:

* ``chunked_logprobs_and_entropy`` is a ``torch.autograd.Function`` that walks over the flattened N*T tokens in
  chunks of ``chunk_size``; for each chunk it computes logits, log-sum-exp, the label's log-prob and (optionally) the
  entropy, and keeps only per-token scalars. Backward recomputes each chunk's logits and accumulates the gradients
  w.r.t. the hidden states, the lm-head weight (which is also the input embedding when embeddings are tied) and
  the bias. Peak extra memory is a few ``chunk_size x V`` fp32 buffers instead of ``N x T x V``.
* ``naive_logprobs_and_entropy`` is the straightforward full-logits reference (tests and the bench).
* ``response_logprobs`` runs a causal LM's decoder (no lm head), takes the hidden states that predict the last R
  tokens and feeds them to the chunked function.

Precision choice: every chunk is computed in fp32 by upcasting the hidden chunk and the weight (the weight is
upcast once per call, which is a no-op for fp32 models). Doing the matmul in bf16/fp16 and upcasting the logits
afterwards would round logits of magnitude ~20 by ~0.1, which is far too coarse for PPO importance ratios.
Autocast is disabled inside these functions for the same reason; gradients are returned in the dtype of the
inputs.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from .compiling import compile_dynamic
from .lora import unwrap_peft
from .vocabulary import ACCUMULATE_DTYPE, SDPA_NAMES


def no_autocast(device: torch.device):
    """Disable autocast for ``device`` so fp32 matmuls (LM head, value head) stay fp32."""
    try:
        return torch.autocast(device_type=device.type, enabled=False)
    except RuntimeError:  # a device type autocast does not know: nothing to disable
        return contextlib.nullcontext()


def _check_inputs(hidden, weight, labels, bias, temperature, chunk_size, check_labels=True):
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [N, T, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"lm_head_weight must be [V, H] with H = hidden size {hidden.shape[-1]}, got {tuple(weight.shape)}"
        )
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels must be [N, T] = {tuple(hidden.shape[:2])}, got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be an integer (long) tensor, got {labels.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"lm_head_bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk), got {chunk_size!r}")
    if check_labels and labels.numel() > 0:  # reads the labels on the host: a GPU caller may check them earlier
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= weight.shape[0]:
            raise ValueError(
                f"labels must lie in [0, {weight.shape[0]}) (the vocab size of the lm head), got values in "
                f"[{low}, {high}]; replace padding/ignore ids (e.g. -100) with a real token id such as the pad id "
                "and mask the result instead"
            )


def head_dtype(weight: torch.Tensor) -> torch.dtype:
    """The LM head's math runs in fp32 at least (fp64 weights, as in exactness tests, stay fp64)."""
    return torch.promote_types(weight.dtype, ACCUMULATE_DTYPE)


def _chunk_logits(hidden_chunk, weight_f32, bias_f32, inv_temperature):
    """Logits of one chunk in the head dtype, already divided by the temperature."""
    logits = hidden_chunk.to(weight_f32.dtype) @ weight_f32.t()
    if bias_f32 is not None:
        logits += bias_f32
    if inv_temperature != 1.0:
        logits *= inv_temperature
    return logits


def _chunk_statistics(logits, labels, with_entropy: bool):
    """(log-sum-exp, label log-prob, entropy or None) of one chunk's logits [M, V]."""
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(1, labels[:, None]).squeeze(1) - lse
    if not with_entropy:
        return lse, logprobs, None
    # H = lse - sum_j p_j z_j
    return lse, logprobs, lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def _chunk_logit_grad(logits, lse, entropy, labels, grad_logprobs, grad_entropy, inv_temperature: float):
    """d(loss)/d(raw logits) of one chunk: d(log p_y)/dz = onehot(y) - p, dH/dz = -p * (log p + H), times the
    temperature's 1/T (z = raw / T). grad_logprobs / grad_entropy: [M] or None."""
    log_probs = logits - lse[:, None]
    probs = log_probs.exp()
    grad_z = torch.zeros_like(logits)
    if grad_entropy is not None:
        grad_z = grad_z - (log_probs + entropy[:, None]) * probs * grad_entropy[:, None]
    if grad_logprobs is not None:
        label_column = torch.arange(logits.shape[1], device=logits.device)[None, :] == labels[:, None]
        grad_z = grad_z + (label_column.to(logits.dtype) - probs) * grad_logprobs[:, None]
    return grad_z * inv_temperature


_COMPILED_CHUNK_MATH: dict = {}
COMPILE_BACKEND = "inductor"  # CPU tests trace with "eager" (seconds; no code generation)


def _compiled(fn):
    """fn compiled once per process (dynamic shapes: the last chunk is shorter): inductor fuses each chunk's
    softmax statistics into one or two passes over its logits instead of one pass per eager op."""
    key = (fn, COMPILE_BACKEND)
    if key not in _COMPILED_CHUNK_MATH:
        _COMPILED_CHUNK_MATH[key] = compile_dynamic(fn, COMPILE_BACKEND)
    return _COMPILED_CHUNK_MATH[key]


class _ChunkedLogprobEntropy(torch.autograd.Function):
    """autograd.Function over flattened tokens: hidden [M, H], weight [V, H], bias [V] | None, labels [M]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, with_entropy, compiled):
        num_tokens = hidden.shape[0]
        inv_temperature = 1.0 / temperature
        head = head_dtype(weight)
        logprobs = torch.empty(num_tokens, dtype=head, device=hidden.device)
        logsumexp = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_empty(0)
        with torch.no_grad(), no_autocast(hidden.device):
            weight_f32 = weight.to(head_dtype(weight))
            bias_f32 = bias.to(weight_f32.dtype) if bias is not None else None
            # compiled: the statistics fused into a pass or two; eager (below): in place in the logits buffer, no
            # second chunk-sized buffer, which is what a 24 GB card needs at a 151,936-token vocabulary
            statistics = _compiled(_chunk_statistics) if compiled else None
            for start in range(0, num_tokens, chunk_size):
                stop = min(start + chunk_size, num_tokens)
                logits = _chunk_logits(hidden[start:stop], weight_f32, bias_f32, inv_temperature)
                if statistics is not None:
                    lse, chunk_logprobs, chunk_entropy = statistics(logits, labels[start:stop], with_entropy)
                    logsumexp[start:stop], logprobs[start:stop] = lse, chunk_logprobs
                    if with_entropy:
                        entropy[start:stop] = chunk_entropy
                    del logits
                    continue
                lse = torch.logsumexp(logits, dim=-1)
                logsumexp[start:stop] = lse
                logprobs[start:stop] = logits.gather(1, labels[start:stop, None]).squeeze(1) - lse
                if with_entropy:
                    # H = lse - sum_j p_j z_j; p * z is formed in place in the softmax buffer.
                    probs = torch.softmax(logits, dim=-1)
                    entropy[start:stop] = lse - probs.mul_(logits).sum(-1)
                    del probs
                del logits
        ctx.save_for_backward(hidden, weight, bias, labels, logsumexp, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.with_entropy = with_entropy
        ctx.compiled = compiled
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, logsumexp, entropy = ctx.saved_tensors
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None
        inv_temperature = 1.0 / ctx.temperature
        num_tokens = hidden.shape[0]
        with torch.no_grad(), no_autocast(hidden.device):
            weight_f32 = weight.to(head_dtype(weight))
            bias_f32 = bias.to(weight_f32.dtype) if bias is not None else None
            grad_hidden = torch.empty_like(hidden) if needs_hidden else None
            grad_weight = torch.zeros_like(weight_f32) if needs_weight else None
            grad_bias = torch.zeros_like(bias_f32) if (needs_bias and bias is not None) else None
            logit_grad = _compiled(_chunk_logit_grad) if ctx.compiled else None  # eager: in place, as in forward
            for start in range(0, num_tokens, ctx.chunk_size):
                stop = min(start + ctx.chunk_size, num_tokens)
                hidden_f32 = hidden[start:stop].to(weight_f32.dtype)
                if logit_grad is not None:
                    rows = slice(start, stop)
                    grad_z = logit_grad(_chunk_logits(hidden_f32, weight_f32, bias_f32, inv_temperature),
                                        logsumexp[rows], entropy[rows] if grad_entropy is not None else None,
                                        labels[rows], _rows_of(grad_logprobs, rows, weight_f32.dtype),
                                        _rows_of(grad_entropy, rows, weight_f32.dtype), inv_temperature)
                    _accumulate_head_grads(grad_z, hidden_f32, weight_f32, rows, grad_hidden, grad_weight, grad_bias)
                    del grad_z
                    continue
                # log p = z - lse, computed in place in the recomputed logits buffer.
                log_probs = _chunk_logits(hidden_f32, weight_f32, bias_f32, inv_temperature)
                log_probs -= logsumexp[start:stop, None]
                probs = log_probs.exp()
                # d(log p_y)/dz = onehot(y) - p ;  dH/dz = -p * (log p + H)
                if grad_entropy is not None:
                    grad_z = log_probs.add_(entropy[start:stop, None]).mul_(probs)
                    grad_z.mul_(-grad_entropy[start:stop, None].to(weight_f32.dtype))
                    if grad_logprobs is not None:
                        grad_z.addcmul_(probs, grad_logprobs[start:stop, None].to(weight_f32.dtype), value=-1.0)
                else:
                    grad_z = probs.mul_(-grad_logprobs[start:stop, None].to(weight_f32.dtype))
                if grad_logprobs is not None:
                    grad_z.scatter_add_(1, labels[start:stop, None], grad_logprobs[start:stop, None].to(weight_f32.dtype))
                # chain rule through z = (h W^T + b) / temperature
                if inv_temperature != 1.0:
                    grad_z *= inv_temperature
                _accumulate_head_grads(grad_z, hidden_f32, weight_f32, slice(start, stop), grad_hidden, grad_weight,
                                       grad_bias)
                del log_probs, probs, grad_z
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _rows_of(grad, rows: slice, dtype):
    return grad[rows].to(dtype) if grad is not None else None


def _accumulate_head_grads(grad_z, hidden_f32, weight_f32, rows: slice, grad_hidden, grad_weight, grad_bias):
    """The chain rule through logits = hidden W^T + b for one chunk: its rows of grad_hidden; += grad_weight and
    grad_bias."""
    if grad_hidden is not None:
        grad_hidden[rows] = (grad_z @ weight_f32).to(grad_hidden.dtype)
    if grad_weight is not None:
        grad_weight.addmm_(grad_z.t(), hidden_f32)
    if grad_bias is not None:
        grad_bias += grad_z.sum(0)


def chunked_logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    check_labels: bool = True,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``labels`` and (optionally) entropy under ``softmax((hidden @ W^T + b) / temperature)``.

    hidden [N, T, H] (any float dtype), lm_head_weight [V, H], labels [N, T] long, lm_head_bias [V] | None.
    ``chunk_size`` is the number of tokens (over the flattened N*T) whose logits exist at once.
    Returns (logprobs [N, T] fp32, entropy [N, T] fp32 or None). Both are differentiable w.r.t. hidden, the
    weight and the bias; the full [N, T, V] logits are never materialised. ``check_labels=False`` skips the label
    range check, which waits for the GPU (for labels known to be token ids of this vocabulary). ``compiled=True``
    (plan.compile_training) runs each chunk's softmax statistics and logit gradient as torch.compile kernels:
    the same math in fewer passes over the chunk's logits; the matmuls stay as they are.
    """
    _check_inputs(hidden, lm_head_weight, labels, lm_head_bias, temperature, chunk_size, check_labels)
    batch, length, hidden_size = hidden.shape
    flat_hidden = hidden.reshape(batch * length, hidden_size)
    # a tensor of its own: the compiled chunk math gets slices of it, and slices of a view of the [N, T] labels
    # make dynamo guard on N and T (a recompile whenever a micro-batch has one row or one response token)
    flat_labels = labels.reshape(batch * length).to(torch.long, copy=True)
    logprobs, entropy = _ChunkedLogprobEntropy.apply(
        flat_hidden, lm_head_weight, lm_head_bias, flat_labels, float(temperature), chunk_size, with_entropy,
        compiled)
    logprobs = logprobs.view(batch, length)
    return logprobs, (entropy.view(batch, length) if with_entropy else None)


def naive_logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference implementation with the full fp32 [N, T, V] logits (same signature; ``chunk_size`` ignored)."""
    _check_inputs(hidden, lm_head_weight, labels, lm_head_bias, temperature, chunk_size or 1)
    with no_autocast(hidden.device):
        logits = hidden.float() @ lm_head_weight.float().t()
        if lm_head_bias is not None:
            logits = logits + lm_head_bias.float()
        log_probs = torch.log_softmax(logits / temperature, dim=-1)
        logprobs = log_probs.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return logprobs, entropy


# ---------------------------------------------------------------------------------------------------------------
# From a causal LM


def _effective_temperature(config, temperature: float) -> float:
    """Fold architecture-specific constant logit scalings into the temperature (or refuse what cannot be)."""
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None:
        raise NotImplementedError(
            f"{type(config).__name__} applies final_logit_softcapping={softcap} to its logits, which chunked "
            "log-probs do not implement; use a model without logit soft-capping (Llama, Qwen2, Mistral, Gemma3)"
        )
    logit_scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    if isinstance(logit_scale, (int, float)) and logit_scale not in (0, 1):
        temperature = temperature / float(logit_scale)
    logits_scaling = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    if isinstance(logits_scaling, (int, float)) and logits_scaling not in (0, 1):
        temperature = temperature * float(logits_scaling)
    return temperature


def default_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: (mask.cumsum(-1) - 1).clamp(min=0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def training_attention_mask(model: nn.Module, attention_mask: torch.Tensor) -> torch.Tensor:
    """The attention mask to give a decoder for a left-padded training batch.

    With left padding, a padding position's query sees only padding keys: its attention row is fully masked. Its
    output is never used, but on CUDA some SDPA kernels return NaN *gradients* for such rows, and through the
    shared projections one NaN reaches every weight (the GPU demo skipped steps with a NaN grad norm at random:
    whenever a micro-batch mixed prompt lengths and a kernel with that behaviour was picked). For SDPA we build
    the 4D boolean mask ourselves, letting each padding query attend to itself: real tokens never attend padding,
    so their outputs are unchanged. Batches without left padding keep the 2D mask (and SDPA's causal fast path).
    """
    left_padded = bool((attention_mask[:, 0] == 0).any())
    if not left_padded or getattr(unwrap_peft(model).config, "_attn_implementation", None) not in SDPA_NAMES:
        return attention_mask
    length = attention_mask.shape[1]
    real_key = attention_mask.bool()[:, None, None, :]  # [N, 1, 1, L]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    itself = torch.eye(length, dtype=torch.bool, device=attention_mask.device)
    return (causal & real_key) | itself  # [N, 1, L, L], True = may attend


def response_window(response_start: torch.Tensor, response_len: int, width: int, offset: int = 0) -> torch.Tensor:
    """[b, R'] column indices ``response_start[i] + offset + j`` into a packed micro-batch of ``width`` columns,
    clamped inside it (columns past a row's own response hold padding, masked by the caller)."""
    steps = torch.arange(response_len, device=response_start.device)
    return (response_start.to(steps.device)[:, None] + offset + steps).clamp(0, width - 1)


def decoder_hidden(decoder: nn.Module, input_ids, attention_mask, position_ids, packed: bool = False,
                   shared=None):
    """The decoder's last hidden states for a training micro-batch: left-padded rows with their mask
    (``training_attention_mask``), rows packed from column 0 (``packed``) with none: causal attention alone is
    right for every real token there, and SDPA may take its flash kernel; or a shared-prompt stream (``shared``,
    prompt_sharing.py: [1, N] states, the ids and positions taken from it)."""
    if shared is not None:
        outputs = decoder(input_ids=shared.input_ids, use_cache=False, **shared.decoder_kwargs())
    else:
        mask = None if packed else training_attention_mask(decoder, attention_mask)
        outputs = decoder(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]


def response_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    position_ids: torch.Tensor | None = None,
    check_labels: bool = True,
    compiled_head: bool = False,
    response_start: torch.Tensor | None = None,
    shared=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the last ``response_len`` tokens of ``input_ids`` under ``model``, or, with
    ``response_start`` [N] (rows packed from column 0, ``microbatch.pack_rows``), of the ``response_len`` tokens from
    column ``response_start[i]`` of each row; the decoder then runs with a causal mask only. With ``shared`` (a
    device ``prompt_sharing.SharedPromptBatch``; input_ids, attention_mask and position_ids are then None) of each
    row's response tokens in that stream.

    ``model`` is a transformers causal LM (Llama, Qwen2, ...) or a peft ``PeftModel`` around one (LoRA stays
    active; use ``lora.adapter_disabled`` for the reference policy). Runs only the decoder to get the final hidden
    states, then chunked log-probs with the output embedding, so no [N, L, V] logits exist. Works inside autocast
    (hidden states may come back in the autocast dtype; the log-prob math is fp32). ``compiled_head``: see
    ``chunked_logprobs_and_entropy``'s ``compiled``.
    Returns (logprobs [N, R] fp32, entropy [N, R] fp32 or None); values at response padding are meaningless and
    must be masked by the caller.
    """
    if shared is not None:
        input_ids, attention_mask, response_len = shared.input_ids, None, shared.response_len
    elif input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and attention_mask must both be [N, L]; got {tuple(input_ids.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    seq_len = input_ids.shape[1]
    if shared is None and not (isinstance(response_len, int) and 1 <= response_len < seq_len):
        raise ValueError(
            f"response_len must be an int in [1, {seq_len - 1}] (at least one prompt token must precede the "
            f"response), got {response_len!r}"
        )
    inner = unwrap_peft(model)
    output_embeddings = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if output_embeddings is None or not hasattr(inner, "get_decoder"):
        raise TypeError(
            f"response_logprobs needs a transformers causal LM with get_decoder() and an lm head "
            f"(get_output_embeddings()); got {type(inner).__name__}"
        )
    if hasattr(output_embeddings, "base_layer"):
        raise NotImplementedError(
            "the lm head is wrapped by an adapter (LoRA on lm_head); chunked log-probs read its plain weight only. "
            "Exclude lm_head from the LoRA target_modules ('all-linear' already does)"
        )
    temperature = _effective_temperature(inner.config, temperature)
    decoder = inner.get_decoder()
    if decoder is inner:
        raise TypeError(f"{type(inner).__name__}.get_decoder() returned the model itself; cannot separate the lm head")
    if position_ids is None and shared is None:
        position_ids = default_position_ids(attention_mask)
    hidden = decoder_hidden(decoder, input_ids, attention_mask, position_ids, packed=response_start is not None,
                            shared=shared)
    # hidden state at position t predicts token t + 1
    if shared is not None:
        response_hidden = hidden[0].index_select(0, shared.before_index.flatten()).view(*shared.before_index.shape, -1)
        labels = input_ids[0][shared.label_index]
    elif response_start is None:
        response_hidden = hidden[:, -response_len - 1 : -1]
        labels = input_ids[:, -response_len:]
    else:
        before = response_window(response_start, response_len, seq_len, offset=-1)
        response_hidden = hidden.gather(1, before[..., None].expand(-1, -1, hidden.shape[-1]))
        labels = input_ids.gather(1, response_window(response_start, response_len, seq_len))
    return chunked_logprobs_and_entropy(
        response_hidden,
        output_embeddings.weight,
        labels,
        lm_head_bias=getattr(output_embeddings, "bias", None),
        temperature=temperature,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        check_labels=check_labels,
        compiled=compiled_head,
    )
