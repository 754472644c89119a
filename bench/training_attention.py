"""Training attention of a grouped-query model on a GPU: K/V heads passed grouped (what transformers does when a
batch has no mask) against K/V heads expanded per query head (the plan's `expand_kv_heads`), forward + backward.

On CUDA only SDPA's flash kernel takes grouped heads; where it does not run (fp32, compute capability < 8.0)
PyTorch falls back to its math kernel. This prints, per dtype: milliseconds per layer, the extra memory the pass
held, and the kernels that ran.

    python bench/training_attention.py                        # Qwen2.5-0.5B's heads, 8 rows x 376 tokens
    python bench/training_attention.py --rows 4 --tokens 1024 --dtypes fp32

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def attention_kernels(fn) -> list[str]:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn().float().sum().backward()
        torch.cuda.synchronize()
    keys = ("fmha", "attention", "softmax", "gemm", "bmm")
    return sorted({e.key[:60] for e in prof.key_averages() if any(k in e.key.lower() for k in keys)})


def measure(fn, repeats: int) -> tuple[float, float]:
    """(ms per forward + backward, MiB held above the inputs at the peak)."""
    for _ in range(3):
        fn().float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(repeats):
        fn().float().sum().backward()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / repeats * 1000
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=376)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    groups = args.heads // args.kv_heads
    print(f"{args.rows} rows x {args.tokens} tokens, {args.heads} query / {args.kv_heads} KV heads, head dim "
          f"{args.head_dim}, causal, forward + backward per layer")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        shape_q = (args.rows, args.heads, args.tokens, args.head_dim)
        shape_kv = (args.rows, args.kv_heads, args.tokens, args.head_dim)
        q = torch.randn(shape_q, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(shape_kv, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(shape_kv, device="cuda", dtype=dtype, requires_grad=True)

        def grouped():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def expanded():
            return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                                  is_causal=True)

        for fn in (grouped, expanded):
            ms, mib = measure(fn, args.repeats)
            print(f"  {name:5s} {fn.__name__:9s} {ms:7.3f} ms  +{mib:6.0f} MiB  {', '.join(attention_kernels(fn)[:3])}")
        print(f"  {name:5s} max |grouped - expanded| {(grouped() - expanded()).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
