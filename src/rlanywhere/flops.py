"""Model FLOPs and model-FLOPs utilisation (MFU) of a step's phases, from a model's shape alone.

MFU is the share of the card's dense peak that the model's own arithmetic would fill in the time a phase took:
`model FLOPs / (seconds x peak)`. Model FLOPs count the matrix products a forward needs (the linear layers, the
LM head, the attention scores and their weighted sum over a causal context) and three forwards for a forward plus
backward. Work a run chooses to do on top (activation-checkpointing's recompute) is not counted, and work it
avoids (a prompt shared by a group's rows, computed once) is not counted either, as in PaLM's definition.

    fwd = sequence_forward_flops(shape, prompt_len + response_len)
    mfu(3 * fwd * rows, seconds, peak_flops("h200", "bf16"))

`PEAK_TFLOPS` holds dense (no structured sparsity) tensor-core peaks from the vendors' data sheets, per card and
precision; "fp32" is plain fp32 (TF32 off), which is what the P40 path runs.
"""

from __future__ import annotations

import re
from typing import Optional

from .model_shape import ModelShape

# card -> precision -> dense peak TFLOP/s (SXM parts where a card comes in several)
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "h100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "a10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "rtx3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "v100": {"fp16": 125.0, "fp32": 15.7},
    "t4": {"fp16": 65.0, "fp32": 8.1},
    "p100": {"fp16": 18.7, "fp32": 9.3},
    "p40": {"fp32": 11.8},
}


def card_key(device_name: str) -> Optional[str]:
    """The `PEAK_TFLOPS` key of a device name as torch reports it ('NVIDIA H200', 'Tesla P40'), or None."""
    name = device_name.lower()
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # 'a100' before 'a10'
        if re.search(rf"(^|[^a-z0-9]){key}($|[^0-9])", name.replace("geforce ", "").replace("rtx ", "rtx")):
            return key
    return None


def peak_flops(card: str, precision: str) -> Optional[float]:
    """Dense peak in FLOP/s of `card` (a `PEAK_TFLOPS` key or a device name) at `precision`, or None if unknown."""
    key = card if card in PEAK_TFLOPS else card_key(card)
    tflops = PEAK_TFLOPS.get(key or "", {}).get(precision)
    return tflops * 1e12 if tflops else None


def linear_params_per_layer(shape: ModelShape) -> int:
    """Weights of one decoder block's matrix products (q, k, v, o, gate, up, down)."""
    return sum(fan_in * fan_out for _, fan_in, fan_out in shape.linear_shapes())


def sequence_forward_flops(shape: ModelShape, length: int, *, lm_head: bool = True, context: int = 0) -> float:
    """FLOPs of one forward over `length` new tokens that attend causally to `context` earlier ones and to each
    other: 2 per weight per token in the linear layers (and the LM head when `lm_head`), plus the attention
    scores and weighted sum, 4 x q_dim per (query, key) pair."""
    per_token_linear = 2 * linear_params_per_layer(shape) * shape.num_layers
    head = 2 * shape.hidden_size * shape.vocab_size if lm_head else 0
    # query t (0-based) sees context + t + 1 keys; summed over the new tokens
    pairs = length * context + length * (length + 1) / 2
    attention = 4 * shape.q_dim * pairs * shape.num_layers
    return length * (per_token_linear + head) + attention


def step_forward_flops(shape: ModelShape, *, rows: int, prompt_len: float, response_len: float,
                       groups: Optional[int] = None, lm_head: bool = True) -> float:
    """One forward over a step's rows of `prompt_len + response_len` tokens. With `groups` (prompts shared by
    their rows, computed once per group) each prompt counts once and each response attends to it as context. The LM
    head (`lm_head`) runs on the response positions only: the log-prob passes read no logits of prompt tokens."""
    if groups is None:
        body = rows * sequence_forward_flops(shape, round(prompt_len + response_len), lm_head=False)
    else:
        body = (groups * sequence_forward_flops(shape, round(prompt_len), lm_head=False)
                + rows * sequence_forward_flops(shape, round(response_len), lm_head=False, context=round(prompt_len)))
    head = 2 * shape.hidden_size * shape.vocab_size if lm_head else 0
    return body + rows * round(response_len) * head


def mfu(flops: float, seconds: float, peak: Optional[float]) -> Optional[float]:
    """Model-FLOPs utilisation: `flops` done in `seconds` as a share of `peak` FLOP/s (None if unknown)."""
    if not peak or seconds <= 0:
        return None
    return flops / seconds / peak


# phase timing key -> (forwards' worth of model FLOPs per pass, whether the pass has the LM head, model)
PHASES: dict[str, tuple[int, bool, str]] = {
    "timing/old_log_prob": (1, True, "actor"),
    "timing/ref_log_prob": (1, True, "actor"),
    "timing/values": (1, False, "critic"),
    "timing/update_actor": (3, True, "actor"),
    "timing/update_critic": (3, False, "critic"),
}


def phase_mfus(record: dict, shape: ModelShape, *, rows: int, groups: Optional[int], ppo_epochs: int,
               peak: Optional[float]) -> dict[str, float]:
    """MFU of each training phase of one metrics.jsonl record (`timing/*`, `response_length/mean`,
    `perf/tokens_per_s` x `perf/step_time_s` for the step's tokens). The update phases count `ppo_epochs` passes."""
    total_tokens = record["perf/tokens_per_s"] * record["perf/step_time_s"]
    response_len = record["response_length/mean"]
    prompt_len = max(total_tokens / rows - response_len, 0.0)
    out = {}
    for key, (forwards, lm_head, _) in PHASES.items():
        seconds = record.get(key)
        if not seconds:
            continue
        passes = forwards * (ppo_epochs if key.startswith("timing/update") else 1)
        flops = passes * step_forward_flops(shape, rows=rows, prompt_len=prompt_len, response_len=response_len,
                                            groups=groups, lm_head=lm_head)
        value = mfu(flops, seconds, peak)
        if value is not None:
            out["mfu/" + key.split("/", 1)[1]] = value
    return out


__all__ = ["PEAK_TFLOPS", "PHASES", "card_key", "linear_params_per_layer", "mfu", "peak_flops", "phase_mfus",
           "sequence_forward_flops", "step_forward_flops"]
