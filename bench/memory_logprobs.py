"""Peak memory and time of naive vs chunked log-probs (forward + backward) for a Qwen2.5-0.5B-shaped lm head.

The naive path builds fp32 logits of batch x length x vocab (8 x 512 x 151,936 = 2.5 GB) and keeps them plus a
softmax of the same size for backward; the chunked path (rlanywhere.logprobs) keeps only chunk_size x vocab at a
time. The lm head weight is a leaf that requires grad (tied embeddings: it is trained), hidden states too.

Run on one GPU (prints a table; peak = torch.cuda.max_memory_allocated above the inputs):
    CUDA_VISIBLE_DEVICES=0 python bench/memory_logprobs.py
    python bench/memory_logprobs.py --batch 8 --length 1024 --chunk-sizes 512,1024,2048,4096 --entropy
Quick CPU smoke run (tiny shapes; CPU peak memory is not measured):
    python bench/memory_logprobs.py --small
"""

from __future__ import annotations

import argparse
import time

import torch

from rlanywhere.logprobs import chunked_logprobs_and_entropy, naive_logprobs_and_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=512, help="tokens per row")
    parser.add_argument("--hidden", type=int, default=896, help="Qwen2.5-0.5B hidden size")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen2.5-0.5B vocab size")
    parser.add_argument("--chunk-sizes", default="1024,4096", help="comma-separated tokens per chunk")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of hidden and weight")
    parser.add_argument("--entropy", action="store_true", help="also compute and differentiate the entropy")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="tiny shapes for a CPU smoke run")
    args = parser.parse_args(argv)
    if args.small:
        args.batch, args.length, args.hidden, args.vocab = 2, 64, 32, 1000
        args.chunk_sizes, args.repeats = "16,50", 1
    return args


def make_inputs(args):
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = DTYPES[args.dtype]
    hidden = torch.randn(args.batch, args.length, args.hidden, generator=gen).to(args.device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.02).to(args.device, dtype)
    labels = torch.randint(0, args.vocab, (args.batch, args.length), generator=gen).to(args.device)
    return hidden.requires_grad_(), weight.requires_grad_(), labels


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn, hidden, weight, labels, args, chunk_size):
    """Return (peak extra MiB or None, mean ms, logprobs, grad_hidden) of forward + backward."""
    cuda = torch.device(args.device).type == "cuda"
    times, peak = [], None
    for _ in range(args.repeats + 1):  # first run is warm-up
        hidden.grad = weight.grad = None
        synchronize(args.device)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(args.device)
            base = torch.cuda.memory_allocated(args.device)
        start = time.perf_counter()
        logprobs, entropy = fn(hidden, weight, labels, chunk_size=chunk_size, with_entropy=args.entropy)
        loss = logprobs.sum() + (entropy.sum() if entropy is not None else 0)
        loss.backward()
        synchronize(args.device)
        times.append(time.perf_counter() - start)
        if cuda:
            peak = (torch.cuda.max_memory_allocated(args.device) - base) / 2**20
    mean_ms = 1000 * sum(times[1:] or times) / len(times[1:] or times)
    return peak, mean_ms, logprobs.detach(), hidden.grad.detach().clone()


def main(argv=None):
    args = parse_args(argv)
    hidden, weight, labels = make_inputs(args)
    tokens = args.batch * args.length
    full_logits_mib = tokens * args.vocab * 4 / 2**20
    print(
        f"device={args.device} dtype={args.dtype} tokens={args.batch}x{args.length}={tokens} hidden={args.hidden} "
        f"vocab={args.vocab} entropy={args.entropy}; one fp32 copy of the full logits = {full_logits_mib:.1f} MiB"
    )
    rows = []
    try:
        peak, ms, ref_lp, ref_grad = measure(naive_logprobs_and_entropy, hidden, weight, labels, args, None)
        rows.append(("naive", "-", peak, ms, 0.0, 0.0))
    except torch.OutOfMemoryError:
        ref_lp = ref_grad = None
        rows.append(("naive", "-", float("inf"), float("nan"), float("nan"), float("nan")))
        torch.cuda.empty_cache()
    for chunk_size in [int(c) for c in args.chunk_sizes.split(",") if c]:
        peak, ms, lp, grad = measure(chunked_logprobs_and_entropy, hidden, weight, labels, args, chunk_size)
        lp_diff = (lp - ref_lp).abs().max().item() if ref_lp is not None else float("nan")
        grad_diff = (grad.float() - ref_grad.float()).abs().max().item() if ref_grad is not None else float("nan")
        rows.append(("chunked", str(chunk_size), peak, ms, lp_diff, grad_diff))

    header = f"{'method':<8} {'chunk':>6} {'peak MiB':>10} {'fwd+bwd ms':>11} {'max|dlogp|':>11} {'max|dgrad|':>11}"
    print(header)
    print("-" * len(header))
    for method, chunk, peak, ms, lp_diff, grad_diff in rows:
        peak_text = "OOM" if peak == float("inf") else ("n/a" if peak is None else f"{peak:.0f}")
        print(f"{method:<8} {chunk:>6} {peak_text:>10} {ms:>11.1f} {lp_diff:>11.2e} {grad_diff:>11.2e}")
    if torch.device(args.device).type != "cuda":
        print("(peak memory is measured on CUDA only)")


if __name__ == "__main__":
    main()
