"""Greedy parity of FastEngine against transformers `generate` on the real SmolLM2-135M-Instruct, GSM8K prompts, fp32.

Each prompt is generated alone by `model.generate` (no padding: the reference), and all prompts together by
FastEngine (batched, left-padded, compaction as rows finish, CUDA graphs on a GPU). Prints how many rows are
token-identical and the largest |log-prob - full forward| over the generated tokens.

    python bench/parity_smollm2.py --prompts data/gsm8k/test.parquet --count 32 --new-tokens 128
    python bench/parity_smollm2.py --gguf /root/models/SmolLM2-135M-Instruct.Q4_1.gguf --device cuda --dump rows.json
    # several engine variants, each generated twice (is a variant deterministic?), then bf16 log-prob gaps
    python bench/parity_smollm2.py --device cuda --fast-variants "default;use_cuda_graphs=0;decode_attention=sdpa" \
        --runs 2 --bf16

Rows that differ are explained: tokens around the first difference, and the top-3 next tokens after the shared
prefix from (a) an unpadded forward pass of that row alone, (b) the padded forward pass over our whole batch (the
one our log-probs are checked against), and whether FastEngine given that prompt alone reproduces the reference.
`--dump` writes every row (ours, per-prompt and batched HF) and the explanations to JSON.
`--bf16` then casts the model to bf16, samples at T=0.7 with both engines and prints |log-prob - reference|
(mean, 99.9th percentile, max) against the trainer's log-probs, a bf16 forward and an fp32 forward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rollout import (fast_plan, forward_logprobs, parse_variants, response_rows, trainer_logprobs,  # noqa: E402  (bench/rollout.py)
                     variant_label)


def top3(logits: torch.Tensor) -> dict:
    top = torch.log_softmax(logits.float(), -1).topk(3)
    return {"ids": top.indices.tolist(), "logprobs": [round(v, 5) for v in top.values.tolist()]}


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def explain(model, engine, prompts, batch, got, expected, device, params) -> list[dict]:
    """For each differing row: what the unpadded and the padded forward pass say right after the shared prefix.

    The shared prefix is the same on both sides, so (a) and (b) below are the same question asked with and without
    the batch's left padding. A top-2 gap of ~1e-5 is a near-tie that any GEMM kernel change can flip; a large
    gap with (a) != (b) means padding changes the model's answer."""
    if got == expected:
        return []
    ids, mask, pos = batch.sequences()
    width = batch.prompt_ids.shape[1]
    with torch.no_grad():
        padded_logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    details = []
    for row, (a, b) in enumerate(zip(got, expected)):
        if a == b:
            continue
        at = first_difference(a, b)
        prefix = torch.tensor([prompts[row] + b[:at]], device=device)
        with torch.no_grad():
            unpadded = top3(model(input_ids=prefix).logits[0, -1])
        padded = top3(padded_logits[row, width - 1 + at]) if at < len(a) else None
        alone = response_rows(engine.generate([prompts[row]], params))[0]
        info = {"row": row, "at": at, "prompt_len": len(prompts[row]), "pad": width - len(prompts[row]),
                "ours_len": len(a), "reference_len": len(b),
                "ours_tokens": a[max(0, at - 4) : at + 4], "reference_tokens": b[max(0, at - 4) : at + 4],
                "unpadded_forward_top3": unpadded, "padded_forward_top3": padded,
                "ours_logprob_at": float(batch.response_logprobs[row, at]) if at < len(a) else None,
                "alone_matches_reference": alone == b, "alone_first_difference": first_difference(alone, b)}
        details.append(info)
        print(f"  row {row} (prompt {info['prompt_len']} tokens, {info['pad']} pad): first difference at {at} "
              f"(lengths ours {len(a)}, reference {len(b)}); ours {info['ours_tokens']} reference "
              f"{info['reference_tokens']}; top-3 unpadded {unpadded} padded {padded}; our log-prob "
              f"{info['ours_logprob_at']}; FastEngine on this prompt alone matches: {info['alone_matches_reference']}")
    return details


def bf16_gaps(model, tokenizer, prompts, new_tokens: int, device: str) -> None:
    """|sampling log-prob - forward| on the real model in bf16, FastEngine and HFEngine, same prompts and seed.

    References: the trainer's log-probs (bf16 decoder, LM head with fp32 output: what a PPO ratio is computed
    against), a plain bf16 transformers forward (logits rounded to bf16), and the same bf16 weights run in fp32
    (the exact value; how far the bf16 forward itself is from it is printed too). bf16 logits of size ~20 are
    rounded to steps of 0.125, so two bf16-logit passes disagree by a few 1e-2 on real models."""
    import copy

    from rlanywhere.rollout import FastEngine, HFEngine, SamplingParams

    model.to(torch.bfloat16)
    exact = copy.deepcopy(model).float()
    temperature = 0.7
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, n=2)

    def stats(delta: torch.Tensor) -> str:
        return (f"mean {delta.mean():.2e} p99.9 {delta.quantile(0.999):.2e} max {delta.max():.2e} "
                f"(> 1e-2: {int((delta > 1e-2).sum())})")

    fast = FastEngine(model, tokenizer, fast_plan(model))
    for label, engine in (("FastEngine", fast), ("HFEngine", HFEngine(model, tokenizer))):
        out = engine.generate(prompts, params, generator=torch.Generator(device=device).manual_seed(0))
        mask = out.response_mask.bool()
        bf16_forward = forward_logprobs(model, out, temperature)
        exact_forward = forward_logprobs(exact, out, temperature)
        trainer = trainer_logprobs(model, out, temperature)
        print(f"bf16 {label} ({int(mask.sum())} tokens, T={temperature}) |logprob - x|:\n"
              f"  x = trainer (fp32 LM head):     {stats((trainer - out.response_logprobs)[mask].abs())}\n"
              f"  x = bf16 forward:               {stats((bf16_forward - out.response_logprobs)[mask].abs())}\n"
              f"  x = fp32 forward, same weights: {stats((exact_forward - out.response_logprobs)[mask].abs())}\n"
              f"  (bf16 forward vs fp32 forward:  {stats((exact_forward - bf16_forward)[mask].abs())})")


def main() -> int:
    from rlanywhere.data import RLDataset
    from rlanywhere.vocabulary import FP32
    from rlanywhere.models import ModelSource, fetch_demo_model, load_tokenizer
    from rlanywhere.rollout.base import SamplingParams, collect_eos_ids
    from rlanywhere.rollout.fast import FastEngine
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--prompts", default="data/gsm8k/test.parquet")
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fast-variants", default="", help="';'-separated FastEngine kwargs; 'default' = no kwargs")
    parser.add_argument("--runs", type=int, default=1, help="generate this many times per variant")
    parser.add_argument("--bf16", action="store_true", help="then measure bf16 log-prob gaps (FastEngine, HFEngine)")
    parser.add_argument("--dump", default=None, help="write every row (ours, reference, HF batched) to this JSON")
    args = parser.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 here
    gguf = args.gguf or str(fetch_demo_model())
    source = ModelSource(os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf))
    tokenizer = load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=FP32, **source.load_kwargs()).to(args.device).eval()
    dataset = RLDataset([args.prompts], tokenizer, max_prompt_length=512)
    prompts = [dataset[i]["input_ids"] for i in range(args.count)]
    eos_ids = collect_eos_ids(tokenizer, model)  # the engine's stop set: the reference must stop on the same ids
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]

    def until_eos(row: list[int]) -> list[int]:
        end = next((i for i, t in enumerate(row) if t in eos_ids), None)
        return row if end is None else row[: end + 1]

    start = time.time()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=args.device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.new_tokens, eos_token_id=eos_ids, pad_token_id=pad)[0, len(prompt):]
            expected.append(until_eos(out.tolist()))
    print(f"transformers per-prompt generate (stops on {eos_ids}): {time.time() - start:.1f}s; lengths "
          f"{min(map(len, expected))}..{max(map(len, expected))}")

    # The same prompts through transformers' own batched (left-padded) generate: how often HF differs from itself.
    width = max(len(p) for p in prompts)
    padded = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=args.device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
    with torch.no_grad():
        hf_batched = model.generate(input_ids=padded, attention_mask=attention, do_sample=False,
                                    max_new_tokens=args.new_tokens, eos_token_id=eos_ids, pad_token_id=pad)[:, width:]
    hf_rows = [until_eos(r.tolist()) for r in hf_batched]
    print(f"transformers batched generate (left-padded, same device/dtype): "
          f"{sum(a == b for a, b in zip(hf_rows, expected))}/{len(prompts)} rows identical to per-prompt generate")

    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)
    all_same, dump = True, {"reference": expected, "hf_batched": hf_rows, "prompts": prompts, "variants": []}
    for kw in parse_variants(args.fast_variants):
        engine = FastEngine(model, tokenizer, fast_plan(model, **kw))
        for run in range(args.runs):
            start = time.time()
            batch = engine.generate(prompts, params)
            seconds = time.time() - start
            got = response_rows(batch)
            same = sum(a == b for a, b in zip(got, expected))
            diff = ((forward_logprobs(model, batch) - batch.response_logprobs) * batch.response_mask).abs().max().item()
            print(f"device {args.device} [{variant_label(kw)}] run {run + 1}: {same}/{len(prompts)} rows token-identical "
                  f"to per-prompt transformers generate; max |logprob - forward| = {diff:.2e}; {seconds:.1f}s")
            details = explain(model, engine, prompts, batch, got, expected, args.device, params)
            dump["variants"].append({"variant": variant_label(kw), "run": run + 1, "ours": got, "differences": details})
            all_same &= same == len(prompts)
        del engine
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump(dump, f)
    if args.bf16:
        bf16_gaps(model, tokenizer, prompts, args.new_tokens, args.device)
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
