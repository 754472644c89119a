"""Padding in update micro-batches: consecutive rows against rows grouped by length, left-padded or packed.

The update cuts a mini-batch into micro-batches of a fixed number of rows. Left-padded (microbatch.compact_rows,
the layout before session 9), each micro-batch is as wide as its longest prompt + longest response; packed from
column 0 (microbatch.pack_rows, the update's layout now), as wide as its longest prompt + response. Consecutive
rows after the shuffle pad every micro-batch to nearly the batch's longest row; grouping rows of similar length
(microbatch.split_rows_by_length, the update's default) pads each micro-batch only to its own longest row, with the
same number of micro-batches and the same gradient (one LossScale per mini-batch).

This script samples real responses from SmolLM2-135M-Instruct (the demo GGUF) for GSM8K questions in verl's
prompt format (chat template, instruction), n samples a prompt, then prints for each micro-batch size the tokens
both splits compute and, with --time, the seconds of one forward + backward pass of the model over all
micro-batches (the trainer's chunked log-probs) for both. CPU or GPU:

    python bench/micro_batch_padding.py --prompts 16 --n 4 --new-tokens 256 --micro 8,16,32
    python bench/micro_batch_padding.py --prompts 8 --n 4 --micro 8 --time        # ~2 min on 2 CPU cores

GSM8K questions come from --gsm8k DIR (train.jsonl), else the sample shipped with the tests (tests/data/gsm8k).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from rlanywhere.data import GSM8K_INSTRUCTION  # noqa: E402
from rlanywhere.logprobs import response_logprobs  # noqa: E402
from rlanywhere.microbatch import compact_rows, pack_rows, split_fixed, split_rows_by_length  # noqa: E402
from rlanywhere.models import load_tokenizer, resolve_model_source  # noqa: E402
from rlanywhere.rollout import SamplingParams, make_engine  # noqa: E402

SHIPPED_GSM8K = Path(__file__).resolve().parents[1] / "tests" / "data" / "gsm8k"


def gsm8k_prompts(tokenizer, directory: Path, count: int, seed: int) -> list[list[int]]:
    with open(directory / "train.jsonl") as handle:
        questions = [json.loads(line)["question"] for line in handle]
    random.Random(seed).shuffle(questions)
    out = []
    for question in questions[:count]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
                                             add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def split_tokens(batch, groups: list[list[int]], pad_token_id: int, layout=compact_rows) -> int:
    return sum(layout(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, group,
                      pad_token_id).input_ids.numel() for group in groups)


def time_update(model, batch, groups: list[list[int]], pad_token_id: int, device: str, repeats: int,
                layout=compact_rows) -> float:
    """Best seconds of one forward + backward over all micro-batches (chunked log-probs, sum of log-probs)."""
    best = float("inf")
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        began = time.perf_counter()
        for group in groups:
            ids, mask, pos, resp_len, *response_start = (t.to(device) if torch.is_tensor(t) else t for t in layout(
                batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask, group, pad_token_id))
            logprobs, _ = response_logprobs(model, ids, mask, resp_len, position_ids=pos,
                                            response_start=response_start[0] if response_start else None)
            (logprobs * batch.response_mask[group, :resp_len].to(device)).sum().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - began)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--micro", default="8,16,32", help="micro-batch sizes (rows)")
    parser.add_argument("--gsm8k", default=None, help="directory with train.jsonl (default: the tests' sample)")
    parser.add_argument("--time", action="store_true", help="also time forward + backward for both splits")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    source = resolve_model_source("smollm2-135m-instruct")
    tokenizer = load_tokenizer(source)
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, attn_implementation="sdpa",
                                                 **source.load_kwargs())
    model.hf_quantizer = None
    model.to(torch.float32).to(args.device).eval()
    prompts = gsm8k_prompts(tokenizer, Path(args.gsm8k) if args.gsm8k else SHIPPED_GSM8K, args.prompts, args.seed)
    engine = make_engine(model, tokenizer)
    start = time.perf_counter()
    batch = engine.generate(prompts, SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature,
                                                    n=args.n, seed=args.seed)).to("cpu")
    rows = batch.response_ids.shape[0]
    lengths = batch.response_mask.sum(-1).float()
    prompt_lengths = batch.prompt_mask.sum(-1).float()
    print(f"{rows} responses ({args.prompts} GSM8K prompts x {args.n}) in {time.perf_counter() - start:.1f} s on "
          f"{args.device}: response tokens mean {lengths.mean():.0f}, min {lengths.min():.0f}, max "
          f"{lengths.max():.0f}; prompt tokens mean {prompt_lengths.mean():.0f}, min {prompt_lengths.min():.0f}, "
          f"max {prompt_lengths.max():.0f}")
    real = int(batch.prompt_mask.sum() + batch.response_mask.sum())
    # the update sees the rows in a shuffled order (GRPO/PPO shuffle each epoch): consecutive groups of that order
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(args.seed)).tolist()
    shuffled = dataclasses.replace(batch, **{k: getattr(batch, k)[order] for k in
                                             ("prompt_ids", "prompt_mask", "response_ids", "response_mask")})
    pad = tokenizer.pad_token_id
    model.train()
    print(f"\nreal tokens: {real}")
    print(f"{'micro rows':>10} {'consecutive':>12} {'by length':>10} {'saved':>7} {'packed':>8} {'saved':>7}" +
          (f" {'consecutive s':>14} {'by length s':>12} {'packed s':>9}" if args.time else ""))
    for size in (int(s) for s in args.micro.split(",")):
        fixed, by_length = split_fixed(rows, size), split_rows_by_length(shuffled.prompt_mask,
                                                                         shuffled.response_mask, size)
        a, b = split_tokens(shuffled, fixed, pad), split_tokens(shuffled, by_length, pad)
        c = split_tokens(shuffled, by_length, pad, layout=pack_rows)
        line = f"{size:>10} {a:>12} {b:>10} {1 - b / a:>7.1%} {c:>8} {1 - c / a:>7.1%}"
        if args.time:
            line += (f" {time_update(model, shuffled, fixed, pad, args.device, args.repeats):>14.2f}"
                     f" {time_update(model, shuffled, by_length, pad, args.device, args.repeats):>12.2f}"
                     f" {time_update(model, shuffled, by_length, pad, args.device, args.repeats, pack_rows):>9.2f}")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
