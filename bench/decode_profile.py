"""Where a FastEngine decode step spends its time, and how fast each of its GEMM shapes can run.

Prints (1) a kernel-level profile of one decode step (torch.profiler, eager, CUDA time per kernel family), (2) the
step as a rollout runs it (its CUDA graph, sampling inside) and (3) a micro-benchmark of every GEMM shape in the
step under several formulations (cuBLAS / cuBLASLt, weight layout, split-K), in TFLOP/s, and of the decode attention,
so the step time can be compared with its floor: the GEMMs in their best formulation, the Triton attention at the
step's span with the step's full rows, and one read of the step's fp32 logits (the sampling a step cannot avoid).

    python bench/decode_profile.py --dtype fp32 --no-tf32 --batch 64          # the Tesla P40 path
    python bench/decode_profile.py --dtype bf16 --batch 256,512,1024 --span 384 --formulations triton,rope
    python bench/decode_profile.py --dtype bf16 --batch 512 --span 384 --formulations triton,rope \
        --launches planned,uncapped      # the half-precision attention with and without its register cap

`--launches` runs everything once per launch setting of the half-precision attention kernels, in one call; after
each it prints the kernels as compiled (registers, spills, shared memory, programs per SM and waves at the step's
grid). Needs a CUDA GPU. Uses the random-weight Qwen2.5-0.5B-shaped model of bench/rollout.py.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from rollout import DTYPES, fast_plan, qwen25_05b_shape  # noqa: E402

from rlanywhere.rollout import FastEngine, SamplingParams  # noqa: E402
from rlanywhere.rollout import decode_attention as attention_module  # noqa: E402
from rlanywhere.rollout.decode_attention import decode_attention as triton_decode_attention  # noqa: E402
from rlanywhere.rollout.decode_attention import rope_store_attention, triton_usable  # noqa: E402
from rlanywhere.rollout.llama import signed_sin  # noqa: E402

PLANNED_HALF_LAUNCH = dict(attention_module.HALF_LAUNCH)
LAUNCHES = {  # the half-precision attention kernels' launch options (decode_attention.HALF_LAUNCH)
    "planned": PLANNED_HALF_LAUNCH,
    "uncapped": {k: v for k, v in PLANNED_HALF_LAUNCH.items() if k != "maxnreg"},  # registers as ptxas likes
}


def kernel_family(name: str) -> str:
    low = name.lower()
    if "fmha" in low or "attention" in low or "softmax" in low or "sdpa" in low:
        return "attention: " + name[:80]
    for key in ("gemm", "gemv", "splitk", "xmma", "nvjet", "cublas"):
        if key in low:
            return "gemm: " + name[:90]
    return "other: " + name[:80]


def profile_step(engine: FastEngine, batch: int, span: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.runner.decode_step(batch, span - 1, span=span, eager=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.runner.decode_step(batch, span - 1, span=span, eager=True)
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            totals[evt.name] += evt.device_time / 5 / 1000.0  # ms per step
            counts[evt.name] += 1
    total = sum(totals.values())
    launches = sum(counts.values()) // 5
    print(f"\n== eager decode step, batch {batch}, span {span}: {total:.3f} ms of kernel time, {launches} kernels ==")
    fam: dict[str, float] = collections.defaultdict(float)
    for name, ms in totals.items():
        fam[kernel_family(name).split(":")[0]] += ms
    for k, v in sorted(fam.items(), key=lambda kv: -kv[1]):
        print(f"  {k:10s} {v:7.3f} ms  ({100 * v / total:4.1f} %)")
    print("  top kernels (ms/step, calls/step):")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {ms:7.3f}  {counts[name] // 5:4d}  {name[:110]}")
    once = {name: ms for name, ms in totals.items() if counts[name] // 5 <= 3}
    print(f"  kernels run at most 3 times a step (embedding, first norm, final norm, LM head, copies): "
          f"{sum(once.values()):.3f} ms")
    for name, ms in sorted(once.items(), key=lambda kv: -kv[1]):
        print(f"  {ms:7.3f}  {counts[name] // 5:4d}  {name[:110]}")


def time_step(engine: FastEngine, batch: int, span: int) -> float:
    """Milliseconds of one decode step as a rollout runs it: its CUDA graph, sampling inside where planned."""
    runner = engine.runner
    runner.cuda_graphs = True
    sample = runner.fused_sampling
    if sample:
        runner.set_sampling(torch.zeros(1, dtype=torch.long, device="cuda"), 1.0)

    def step():
        if sample:
            runner.decode_sample(batch, span - 1, span=span)
        else:
            runner.decode_step(batch, span - 1, span=span)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        step()
    end.record()
    torch.cuda.synchronize()
    runner.cuda_graphs = False
    return start.elapsed_time(end) / 20


def time_graph(fn, iters: int = 10, replays: int = 10) -> float:
    """Milliseconds per call of fn, captured `iters` times in one CUDA graph (no launch overhead counted)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (iters * replays)


def gemm_variants(x: torch.Tensor, weights: list[torch.Tensor], weights_t: list[torch.Tensor]) -> dict:
    """Formulations of y = x @ W.T, each cycling through distinct per-layer weights (as a real step does, so the
    L2 cache does not hold the weight)."""
    rows, k = x.shape
    count = len(weights)
    variants = {
        "linear": lambda: [F.linear(x, w) for w in weights],
        "x@Wt": lambda: [torch.mm(x, wt) for wt in weights_t],
        "W@xT": lambda: [torch.mm(w, x.t()) for w in weights],
    }
    for parts in (2, 4, 7, 8):
        if k % parts == 0:
            xs = x.view(rows, parts, k // parts).transpose(0, 1)
            variants[f"splitk{parts}"] = (
                lambda xs=xs, parts=parts: [torch.bmm(xs, wt.view(parts, k // parts, -1)).sum(0) for wt in weights_t])
    return {name: time_graph(fn, iters=2) / count for name, fn in variants.items()}


def gemm_bench(rows: int, dtype: torch.dtype, shapes: dict[str, tuple[int, int, int]]) -> float:
    print(f"\n== GEMMs of one decode step at {rows} rows ({dtype}), CUDA-graph timed, distinct weights per layer ==")
    names = None
    best_total = default_total = 0.0
    for label, (k, n, count) in shapes.items():
        x = torch.randn(rows, k, device="cuda", dtype=dtype)
        weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(max(count, 1))]
        weights_t = [w.t().contiguous() for w in weights]
        results = gemm_variants(x, weights, weights_t)
        flops = 2 * rows * k * n
        if names is None:
            names = list(results)
            print("  " + " | ".join(f"{h:>14s}" for h in ["shape (K->N) x", *names]))
        cells = [f"{label} {k}->{n} x{count}"[:14].rjust(14)]
        for name in names:
            ms = results.get(name, float("nan"))
            cells.append(f"{1000 * ms:6.1f}us {flops / ms / 1e9:4.1f}T" if ms == ms else f"{'n/a':>14s}")
        print("  " + " | ".join(cells))
        best_total += count * min(v for v in results.values() if v == v)
        default_total += count * results["linear"]
        del weights, weights_t
    print(f"  GEMM time per step: F.linear {default_total:.3f} ms; best formulation per shape {best_total:.3f} ms")
    return best_total


def attention_bench(rows: int, dtype: torch.dtype, kv_heads: int, groups: int, head_dim: int, span: int,
                    layers: int, only: set[str] | None = None, padded: bool = True) -> dict[str, float]:
    """Decode attention formulations for one step: q [rows, kv, G, D] against [rows, kv, span, D] K/V per layer.
    padded: each row starts at a random slot in the span's first half (a rollout's left-padded prompts); else every
    row fills the whole span, as the profiled step's rows do."""
    fill = "random left padding" if padded else "full rows"
    print(f"\n== decode attention, {rows} rows x {kv_heads} kv heads x {groups} q/kv, span {span}, {fill} "
          f"({dtype}) ==")
    scale = head_dim**-0.5
    q = torch.randn(rows, kv_heads, groups, head_dim, device="cuda", dtype=dtype)
    ks = [torch.randn(rows, kv_heads, span, head_dim, device="cuda", dtype=dtype) for _ in range(layers)]
    vs = [torch.randn(rows, kv_heads, span, head_dim, device="cuda", dtype=dtype) for _ in range(layers)]
    start = (torch.randint(0, span // 2, (rows,), device="cuda") if padded
             else torch.zeros(rows, dtype=torch.long, device="cuda"))
    valid = torch.arange(span, device="cuda")[None] >= start[:, None]
    mask = torch.zeros(rows, 1, 1, span, device="cuda", dtype=dtype).masked_fill_(~valid[:, None, None], float("-inf"))
    bias3 = mask.expand(rows, kv_heads, groups, span).reshape(rows * kv_heads, groups, span).contiguous()

    def sdpa():
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale) for k, v in zip(ks, vs)]

    def matmul():
        out = []
        for k, v in zip(ks, vs):
            s = torch.matmul(q, k.transpose(-1, -2)) * scale + mask
            out.append(torch.matmul(s.softmax(-1, dtype=torch.float32).to(dtype), v))
        return out

    def baddbmm():
        out = []
        qb = q.reshape(rows * kv_heads, groups, head_dim)
        for k, v in zip(ks, vs):
            s = torch.baddbmm(bias3, qb, k.reshape(rows * kv_heads, span, head_dim).transpose(1, 2), alpha=scale)
            out.append(torch.bmm(s.softmax(-1, dtype=torch.float32).to(dtype), v.reshape(rows * kv_heads, span, head_dim)))
        return out

    def split_span(parts: int):
        """baddbmm scores; P.V as `parts` batched GEMMs over span chunks (more programs, shorter loops), summed."""
        chunk = span // parts

        def run():
            out = []
            qb = q.reshape(rows * kv_heads, groups, head_dim)
            for k, v in zip(ks, vs):
                s = torch.baddbmm(bias3, qb, k.reshape(rows * kv_heads, span, head_dim).transpose(1, 2), alpha=scale)
                p = s.softmax(-1, dtype=torch.float32).to(dtype).view(rows * kv_heads, groups, parts, chunk)
                vp = v.reshape(rows * kv_heads * parts, chunk, head_dim)
                pv = torch.bmm(p.transpose(1, 2).reshape(rows * kv_heads * parts, groups, chunk), vp)
                out.append(pv.view(rows * kv_heads, parts, groups, head_dim).sum(1))
            return out

        return run

    def transposed():
        """scores as K.q^T ([span, G] per row and head), softmax over the span, P.V from that layout."""
        out = []
        qt = q.reshape(rows * kv_heads, groups, head_dim).transpose(1, 2)
        bias_t = bias3.transpose(1, 2)
        for k, v in zip(ks, vs):
            s = torch.baddbmm(bias_t, k.reshape(rows * kv_heads, span, head_dim), qt, alpha=scale)
            p = s.softmax(1, dtype=torch.float32).to(dtype)
            out.append(torch.bmm(p.transpose(1, 2), v.reshape(rows * kv_heads, span, head_dim)))
        return out

    slot = torch.tensor([span - 1], device="cuda")

    def triton():  # split-K over each row's filled slots (FastEngine's decode_attention="triton")
        return [triton_decode_attention(q, k, v, start, slot, scale) for k, v in zip(ks, vs)]

    def triton_tf32x3():  # the fp32 plan on cc >= 8.0: each product as three TF32 tensor-core products
        return [triton_decode_attention(q, k, v, start, slot, scale, tf32x3=True) for k, v in zip(ks, vs)]

    # the step's own half-precision kernel: RoPE of this step's query and key from the QKV projection, the new key
    # and value written at the last slot, attention over the slots before it and the new one (angle 0: cos 1, sin
    # 0, so its output is comparable with the others'; the kernel's work does not depend on the angles)
    heads = kv_heads * groups
    qkv = torch.cat([q.reshape(rows, heads, head_dim), torch.randn(rows, 2 * kv_heads, head_dim, device="cuda",
                                                                  dtype=dtype)], 1)
    cos = torch.ones(rows, head_dim, device="cuda", dtype=dtype)
    sin = signed_sin(torch.zeros(rows, head_dim, device="cuda", dtype=dtype))

    def rope():
        return [rope_store_attention(qkv, cos, sin, k, v, start, slot, heads, span, scale, match_hf=True)
                for k, v in zip(ks, vs)]

    formulations = [("sdpa", sdpa), ("matmul", matmul), ("baddbmm", baddbmm), ("transposed", transposed)]
    formulations += [(f"split{parts}", split_span(parts)) for parts in (2, 4, 8) if span % parts == 0]
    if triton_usable():
        formulations.append(("triton", triton))
        if dtype != torch.float32:
            formulations.append(("rope", rope))
        if dtype == torch.float32 and torch.cuda.get_device_capability() >= (8, 0):
            formulations.append(("tf32x3", triton_tf32x3))
    ref = sdpa()[0].float()
    times = {}
    for name, fn in formulations:
        if only and name not in only:
            continue
        if name == "rope":  # writes its new key and value at the last slot: the reference sees the same cache
            fn()
            ref = sdpa()[0].float()
        got = fn()[0].reshape(ref.shape).float()
        times[name] = ms = time_graph(fn, iters=2) / layers
        kv_bytes = 2 * ks[0].numel() * ks[0].element_size()
        print(f"  {name:8s} {1000 * ms:7.1f} us/layer  ({kv_bytes / ms / 1e6:6.0f} GB/s of K+V)  "
              f"max|diff vs sdpa| {(got - ref).abs().max().item():.1e}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--no-tf32", action="store_true")
    parser.add_argument("--batch", default="64", help="rows of the step; several: comma-separated")
    parser.add_argument("--span", type=int, default=512)
    parser.add_argument("--attention", default="auto", choices=["auto", "sdpa", "matmul", "triton"])
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--skip-floor", action="store_true", help="profile and step time only (no GEMM and "
                                                                  "attention micro-benchmarks)")
    parser.add_argument("--formulations", default="", help="attention formulations to time, comma-separated "
                                                           "(default all; e.g. triton,rope)")
    parser.add_argument("--launches", default="planned", help="launch settings of the half-precision attention "
                        f"kernels to run everything under, comma-separated: {', '.join(LAUNCHES)}")
    args = parser.parse_args()
    if args.no_tf32:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
    dtype = DTYPES[args.dtype]
    model, _ = qwen25_05b_shape("cuda", dtype)
    attention = {} if args.attention == "auto" else {"decode_attention": args.attention}
    only = set(filter(None, args.formulations.split(",")))
    for launch in args.launches.split(","):
        attention_module.HALF_LAUNCH = LAUNCHES[launch]
        print(f"\n######## half-precision attention launched with {LAUNCHES[launch]} ({launch}) ########")
        for batch in [int(b) for b in args.batch.split(",")]:
            profile_batch(model, dtype, batch, args.span, attention, args.skip_profile, args.skip_floor, only)
            print_attention_kernels(batch * model.config.num_key_value_heads)


def print_attention_kernels(rows_x_heads: int) -> None:
    """The Triton attention kernels compiled so far, as ptxas built them: registers, spills, shared memory, and
    what those allow: programs per SM and the waves a one-split grid of `rows_x_heads` programs takes."""
    from rlanywhere.rollout import decode_kernels

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    registers = getattr(props, "regs_per_multiprocessor", 65536)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    shared = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    sms = props.multi_processor_count
    print(f"\n== attention kernels as compiled ({sms} SMs, {registers} registers, {shared // 1024} KiB shared an SM; "
          f"waves at {rows_x_heads} programs) ==")
    for kernel in (decode_kernels.split_kernel, decode_kernels.rope_attend_kernel):
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                compiled._init_handles()
                warps = compiled.metadata.num_warps
                per_warp = -(-compiled.n_regs * 32 // 256) * 256  # registers are allocated 256 at a time a warp
                fits = max(1, min(registers // (per_warp * warps), threads // (32 * warps),
                                  shared // max(compiled.metadata.shared, 1)))
                print(f"  {kernel.__name__:20s} warps {warps} stages {compiled.metadata.num_stages} registers "
                      f"{compiled.n_regs:3d} spills {compiled.n_spills:3d} shared {compiled.metadata.shared:6d} B: "
                      f"{fits} programs an SM, {rows_x_heads / (fits * sms):.2f} waves")


def profile_batch(model, dtype: torch.dtype, batch: int, span: int, attention: dict, skip_profile: bool,
                  skip_floor: bool, only: set[str]) -> None:
    engine = FastEngine(model, None, fast_plan(model, cuda_graphs=False, **attention))
    prompts = torch.randint(10, 1000, (batch, 128)).tolist()
    engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0))
    engine.runner.reserve(batch, span)
    if not skip_profile:
        profile_step(engine, batch, span)
    step_ms = time_step(engine, batch, span)
    inside = ", sampling inside" if engine.runner.fused_sampling else ""
    print(f"\n== decode step as a rollout runs it (CUDA graph{inside}), batch {batch}, span {span}: "
          f"{step_ms:.3f} ms ==")
    del engine
    torch.cuda.empty_cache()
    if skip_floor:
        return
    cfg = model.config
    kv = cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    shapes = {
        "qkv": (cfg.hidden_size, cfg.hidden_size + 2 * kv, cfg.num_hidden_layers),
        "o": (cfg.hidden_size, cfg.hidden_size, cfg.num_hidden_layers),
        "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size, cfg.num_hidden_layers),
        "down": (cfg.intermediate_size, cfg.hidden_size, cfg.num_hidden_layers),
        "lm_head": (cfg.hidden_size, cfg.vocab_size, 1),
    }
    gemm_ms = gemm_bench(batch, dtype, shapes)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    heads = (cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads, head_dim)
    for at_span in sorted({256, span}):  # a rollout's rows: left-padded prompts (for the formulations' record)
        attention_bench(batch, dtype, *heads, at_span, cfg.num_hidden_layers, only)
    # the floor's attention: the step's own span and fill (the profiled step's rows are full)
    attention_ms = attention_bench(batch, dtype, *heads, span, cfg.num_hidden_layers, {"triton"}, padded=False)
    sampling_ms = sampling_bench(batch, cfg.vocab_size)
    if "triton" in attention_ms:
        attention_total = cfg.num_hidden_layers * attention_ms["triton"]
        floor = gemm_ms + attention_total + sampling_ms["one read"]
        print(f"\n== floor at batch {batch}, span {span}: GEMMs {gemm_ms:.3f} + attention "
              f"{cfg.num_hidden_layers} x {1000 * attention_ms['triton']:.1f} us ({attention_total:.3f}) + one read "
              f"of the fp32 logits {sampling_ms['one read']:.3f} = {floor:.3f} ms; the step {step_ms:.3f} ms is "
              f"{step_ms / floor:.2f}x of it ==")


def sampling_bench(rows: int, vocab: int) -> dict[str, float]:
    """The sampling a decode step cannot avoid: one read of its fp32 logits [rows, vocab] (a max over each row,
    bandwidth-bound), beside the fused sampler's draw (rollout/fused_sampling.py) on the same logits."""
    from rlanywhere.rollout.fused_sampling import sample_into

    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.float32)
    seed, step = torch.zeros(1, dtype=torch.long, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    temperature = torch.ones(1, device="cuda")
    tokens = torch.empty(rows, dtype=torch.long, device="cuda")
    logprobs = torch.empty(rows, device="cuda")
    times = {"one read": time_graph(lambda: logits.amax(-1)),
             "fused sampler": time_graph(lambda: sample_into(logits, seed, step, temperature, tokens, logprobs))}
    gbytes = logits.numel() * 4 / 1e9
    print(f"\n== sampling, {rows} rows x {vocab} fp32 logits ({gbytes:.3f} GB) ==")
    for name, ms in times.items():
        print(f"  {name:14s} {1000 * ms:7.1f} us  ({gbytes / ms * 1e3:6.0f} GB/s)")
    return times

if __name__ == "__main__":
    main()
