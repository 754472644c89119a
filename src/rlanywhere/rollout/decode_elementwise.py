"""A half-precision decode step's elementwise work as Triton kernels, one kernel per call (decode_kernels.py).

    h, x = add_rms_norm(h, delta, weight, eps, match_hf)      # residual add + the next RMSNorm
    h, x = embed_rms_norm(tokens, embed, weight, eps, match_hf)  # the embedding rows + the first layer's norm
    s = silu_mul(gate_up, intermediate)                         # SwiGLU's SiLU(gate) * up

Each rounds as the eager functions in llama.py do (bf16 by integer arithmetic, as in rope_and_store), so they stand
in for them: `add_rms_norm`, `rms_norm` after `F.embedding`, `silu_mul`. They replace the torch.compile'd kernels in
half precision (no compilation: none of a run's first seconds) and fold the embedding gather into the first norm.
LlamaForward takes them where it plans the compiled ones (RolloutPlan.compile_elementwise) for fp16/bf16 weights;
fp32 keeps the compiled kernels. Tests run them on a CPU with Triton's interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from .decode_attention import _kernels, pow2_block
from .kernel_compiles import launch

SILU_BLOCK = 1024  # intermediate entries per program


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., hidden] as [rows, hidden] (a view; the last dimension contiguous)."""
    flat = t.reshape(-1, t.shape[-1])
    if flat.stride(-1) != 1:
        raise ValueError("decode_elementwise: tensors need a contiguous last dimension")
    return flat


def _norm(source: torch.Tensor, delta: torch.Tensor | None, tokens: torch.Tensor | None, weight: torch.Tensor,
          eps: float, match_hf: bool, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = source.shape[-1]
    rows = tokens.numel() if tokens is not None else source.numel() // hidden
    h_out = torch.empty(rows, hidden, dtype=source.dtype, device=source.device)
    x_out = torch.empty_like(h_out)
    delta_rows = _rows(delta) if delta is not None else h_out
    launch(_kernels().add_rms_norm_kernel, (rows,),
        source, delta_rows, tokens if tokens is not None else source, weight, h_out, x_out, source.stride(0),
        delta_rows.stride(0), h_out.stride(0), x_out.stride(0), hidden, float(eps), HAS_DELTA=delta is not None,
        GATHER=tokens is not None, MATCH_HF=bool(match_hf), BLOCK=pow2_block(hidden))
    return h_out.view(shape), x_out.view(shape)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 match_hf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta) * weight), as llama.add_rms_norm: one kernel."""
    if delta.shape != h.shape:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} does not match h {tuple(h.shape)}")
    return _norm(_rows(h), delta, None, weight, eps, match_hf, h.shape)


def embed_rms_norm(tokens: torch.Tensor, embed: torch.Tensor, weight: torch.Tensor, eps: float,
                   match_hf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h) * weight) for h = embed[tokens] ([*tokens.shape, hidden]), as F.embedding then
    llama.rms_norm: one kernel."""
    shape = torch.Size((*tokens.shape, embed.shape[-1]))
    return _norm(_rows(embed), None, tokens.reshape(-1), weight, eps, match_hf, shape)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """SiLU(gate) * up of the fused gate/up output [..., 2 x intermediate] (gate first), as llama.silu_mul: one
    kernel, [..., intermediate] out."""
    if gate_up.shape[-1] != 2 * intermediate:
        raise ValueError(f"silu_mul: last dimension {gate_up.shape[-1]} is not 2 x {intermediate}")
    y = _rows(gate_up)
    out = torch.empty(y.shape[0], intermediate, dtype=y.dtype, device=y.device)
    launch(_kernels().silu_mul_kernel, (y.shape[0], -(-intermediate // SILU_BLOCK)),
        y, out, y.stride(0), out.stride(0), intermediate, BLOCK=SILU_BLOCK)
    return out.view(*gate_up.shape[:-1], intermediate)


__all__ = ["add_rms_norm", "embed_rms_norm", "silu_mul"]
