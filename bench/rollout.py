"""Rollout throughput: FastEngine against HFEngine (transformers generate) on one model, in one run.

Examples (a CUDA GPU; figures and exact commands in docs/rollout.md):

    # bf16, 256 prompts x 128 tokens, 256 new tokens each, EOS ignored (fixed length)
    python bench/rollout.py --model qwen2.5-0.5b-shape --dtype bf16 --batch 256 --prompt-len 128 \
        --new-tokens 256 --fixed-length --engines fast,hf
    # the Tesla P40 path: fp32 with TF32 off
    python bench/rollout.py --model qwen2.5-0.5b-shape --dtype fp32 --no-tf32 --batch 64 --prompt-len 128 \
        --new-tokens 256 --fixed-length
    # a real model: SmolLM2 GGUF + GSM8K prompts (verl parquet or jsonl with a "question" field)
    python bench/rollout.py --gguf ~/.cache/rlanywhere/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompts data/gsm8k/test.parquet --batch 128 --new-tokens 256 --dtype bf16
    # FastEngine variants (ablations) and a greedy correctness check against transformers first
    python bench/rollout.py --check --fast-variants "fuse_weights=1;fuse_weights=0;decode_attention=matmul"
    # how far each engine's sampling log-probs are from the trainer's, on a real model
    python bench/rollout.py --gguf SmolLM2.gguf --prompts data/gsm8k/test.parquet --batch 128 --engines fast,hf \
        --gap --fast-variants "decode_attention=sdpa;decode_attention=triton"

`--model qwen2.5-0.5b-shape` builds a random-weight model with Qwen2.5-0.5B's configuration (hidden 896, 24
layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings); nothing is downloaded.
Each engine is warmed up first (the fast engine captures its CUDA graphs then); timings synchronize the device.
Throughput counts generated tokens (response_mask) per second of wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from rlanywhere.planner import plan_rollout_for  # noqa: E402
from rlanywhere.plans import RolloutPlan  # noqa: E402
from rlanywhere.rollout import FastEngine, HFEngine, SamplingParams  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def qwen25_05b_shape(device: str, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval(), None


def load_model(args, device: str, dtype: torch.dtype):
    if args.gguf:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        directory, name = os.path.split(os.path.abspath(os.path.expanduser(args.gguf)))
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
        return model.to(device).eval(), tokenizer
    if args.model == "qwen2.5-0.5b-shape":
        return qwen25_05b_shape(device, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model.to(device).eval(), tokenizer


def load_prompts(args, tokenizer, vocab: int) -> list[list[int]]:
    if args.prompts:
        if tokenizer is None:
            raise SystemExit("--prompts needs a model with a tokenizer (--gguf or an HF path)")
        questions = []
        if args.prompts.endswith(".parquet"):
            import pyarrow.parquet as pq

            for row in pq.read_table(args.prompts).to_pylist():
                questions.append(row["prompt"] if "prompt" in row else [{"role": "user", "content": row["question"]}])
        else:
            with open(args.prompts) as f:
                for line in f:
                    row = json.loads(line)
                    questions.append(row.get("prompt") or [{"role": "user", "content": row["question"]}])
        questions = (questions * (args.batch // max(len(questions), 1) + 1))[: args.batch]
        # tokenize=False then encode: transformers 5 returns a dict from tokenize=True
        texts = [tokenizer.apply_chat_template(q, add_generation_prompt=True, tokenize=False) for q in questions]
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    gen = torch.Generator().manual_seed(1)
    return torch.randint(10, vocab, (args.batch, args.prompt_len), generator=gen).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_engine(engine, prompts, params, device, repeats: int, warmup_params) -> tuple[float, int, float, Any]:
    """(best seconds, the tokens of that fastest run, warm-up seconds, the last RolloutBatch)."""
    sync(device)
    start = time.perf_counter()
    engine.generate(prompts, warmup_params, generator=torch.Generator(device=device).manual_seed(0))
    sync(device)
    warm = time.perf_counter() - start
    best, tokens = float("inf"), 0
    for r in range(repeats):
        sync(device)
        start = time.perf_counter()
        batch = engine.generate(prompts, params, generator=torch.Generator(device=device).manual_seed(r + 1))
        sync(device)
        elapsed = time.perf_counter() - start
        if elapsed < best:  # tok/s pairs the fastest run's time with its own tokens
            best, tokens = elapsed, int(batch.response_mask.sum())
    return best, tokens, warm, batch


def fast_plan(model, rows: int | None = None, max_seq_len: int | None = None, **overrides) -> RolloutPlan:
    """The RolloutPlan a training run gives FastEngine for `model` where it lives (the automatic choices), with
    variant overrides by RolloutPlan field name (e.g. fuse_weights=False, decode_attention="matmul")."""
    device = next(model.parameters()).device
    automatic = plan_rollout_for(model, device, rows_per_wave=rows, max_seq_len=max_seq_len)
    return dataclasses.replace(automatic, **overrides)


def step_breakdown(engine, params, device: str, rows: int, slot: int) -> str:
    """Milliseconds per decode-step graph replay and per sampling call for `rows` rows writing cache slot `slot`,
    CUDA events (the runner's public API: the batch bucket and attention span a real step uses). With the fused
    sampler the sampling runs inside the step: its cost is the fused step's time minus the forward's."""
    from rlanywhere.rollout.base import sample_from_logits

    runner = engine.runner
    batch, span = runner.bucket(rows), runner.span(slot)
    gen = torch.Generator(device=device).manual_seed(0)
    timings = {}
    logits = runner.decode_step(batch, slot)
    jobs = [("forward", lambda: runner.decode_step(batch, slot)),
            ("sample", lambda: sample_from_logits(logits, params, gen))]
    fused = engine.scheduler.fused_sampling_for(params)
    if fused:
        runner.set_sampling(torch.zeros(1, dtype=torch.long, device=device), params.temperature)
        jobs[1] = ("fused", lambda: runner.decode_sample(batch, slot))
    for label, fn in jobs:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        timings[label] = start.elapsed_time(end) / 20
    if fused:
        return (f"forward {timings['forward']:.3f} ms; with fused sampling {timings['fused']:.3f} ms per step "
                f"(sampling {timings['fused'] - timings['forward']:.3f} ms; batch {batch}, span {span})")
    return f"forward {timings['forward']:.3f} ms + sample {timings['sample']:.3f} ms per step (batch {batch}, span {span})"


FORMER_KWARGS = {"use_cuda_graphs": "cuda_graphs", "max_batch_size": "rows_per_wave"}  # old FastEngine kwargs


def parse_variants(text: str) -> list[dict]:
    """'a=1,b=x;c=0' -> [{'a': True, 'b': 'x'}, {'c': False}]: RolloutPlan fields over the automatic plan;
    'default' is the automatic plan itself."""
    variants = []
    for chunk in filter(None, (c.strip() for c in text.split(";"))):
        kw = {}
        if chunk == "default":
            variants.append(kw)
            continue
        for item in filter(None, (i.strip() for i in chunk.split(","))):
            key, value = item.split("=")
            key = FORMER_KWARGS.get(key, key)
            kw[key] = {"1": True, "0": False, "true": True, "false": False}.get(value.lower(), value)
            if key in ("check_every", "rows_per_wave", "prefill_tokens_per_chunk", "span_granularity"):
                kw[key] = int(value)
        variants.append(kw)
    return variants or [{}]


def response_rows(batch) -> list[list[int]]:
    """Each row's response tokens (up to its mask) as a plain list."""
    return [r[: int(m.sum())].tolist() for r, m in zip(batch.response_ids.cpu(), batch.response_mask.cpu())]


def forward_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [N, R] of a RolloutBatch's response tokens under one full transformers forward pass (fp32
    log-softmax of the model's own logits / temperature, the sampling distribution): the reference the engines'
    returned log-probs are checked against."""
    ids, mask, pos = batch.sequences()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    width = batch.prompt_ids.shape[1]
    return torch.log_softmax(logits[:, width - 1 : -1] / temperature, -1).gather(-1, batch.response_ids[..., None])[..., 0]


def trainer_logprobs(model, batch, temperature: float = 1.0) -> torch.Tensor:
    """The same log-probs as the trainer computes them (rlanywhere.logprobs: transformers' decoder, then the LM
    head with fp32 output): the other side of a PPO ratio."""
    from rlanywhere.logprobs import response_logprobs

    ids, mask, pos = batch.sequences()
    with torch.no_grad():
        return response_logprobs(model, ids, mask, batch.response_ids.shape[1], temperature=temperature,
                                 position_ids=pos)[0]


def correctness_check(device: str, variants: list[dict]) -> None:
    """Greedy FastEngine (CUDA graphs, compaction, EOS) against per-row transformers generate, fp32 and bf16."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, initializer_range=0.2)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 1000, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (24,), generator=gen)]
    steps = 40

    def reference(eos):
        rows = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=steps, eos_token_id=eos, pad_token_id=0)[0, len(p):].tolist()
            rows.append(out[: out.index(eos) + 1] if eos is not None and eos in out else out)
        return rows

    plain = reference(None)
    eos = max(set(t for r in plain for t in r), key=lambda t: sum(r.count(t) for r in plain))  # most frequent
    expected = reference(eos)
    model.generation_config.eos_token_id = eos
    for kw in variants:
        check_fp32(model, prompts, expected, eos, device, steps, kw)
    # bf16: how far each engine's sampling log-probs are from the trainer's (the numbers a PPO ratio is computed
    # against: bf16 decoder, fp32-output LM head) and from a plain bf16 transformers forward over the same tokens
    model.to(torch.bfloat16)
    sample = SamplingParams(max_new_tokens=steps, temperature=1.0)
    engines = [("HFEngine", HFEngine(model, None, pad_token_id=0))]
    engines += [(f"FastEngine {variant_label(kw)}", FastEngine(model, None, fast_plan(model, **kw), pad_token_id=0))
                for kw in variants]
    for label, eng in engines:
        out = eng.generate(prompts, sample, generator=torch.Generator(device=device).manual_seed(0))
        mask = out.response_mask.bool()
        for name, ref in (("trainer", trainer_logprobs(model, out)), ("HF forward", forward_logprobs(model, out))):
            delta = (ref - out.response_logprobs)[mask].abs()
            print(f"check bf16 {label:<40} |logprob - {name}|: mean {delta.mean():.2e}  max {delta.max():.2e}")
    torch.backends.cuda.matmul.allow_tf32 = True


def variant_label(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


def check_fp32(model, prompts, expected, eos, device, steps, kw) -> None:
    """Greedy fp32 FastEngine (variant kw) against transformers: tokens and log-probs."""

    engine = FastEngine(model, None, fast_plan(model, **{"check_every": 4, **kw}), pad_token_id=0)
    params = SamplingParams(max_new_tokens=steps, temperature=0)
    batch = engine.generate(prompts, params)
    same = sum(a == b for a, b in zip(response_rows(batch), expected))
    lengths = [len(r) for r in expected]
    ref = forward_logprobs(model, batch)
    diff = ((ref - batch.response_logprobs) * batch.response_mask).abs().max().item()
    print(f"check fp32 cuda-graphs [{variant_label(kw)}]: {same}/{len(prompts)} rows token-identical to transformers generate "
          f"(EOS={eos}, lengths {min(lengths)}..{max(lengths)}); max |logprob - forward| = {diff:.2e}")
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0.8, top_k=50, top_p=0.9, n=2),
                              generator=torch.Generator(device=device).manual_seed(0))
    print(f"check fp32 sampling: {int(sampled.response_mask.sum())} tokens, logprobs finite: "
          f"{bool(torch.isfinite(sampled.response_logprobs).all())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-0.5b-shape", help="HF path/hub id, or qwen2.5-0.5b-shape")
    parser.add_argument("--gguf", default=None, help="path to a .gguf file (e.g. SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", default=None, help="parquet (verl schema) or jsonl with 'question'")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=256, help="number of prompts")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--fixed-length", action="store_true", help="ignore EOS: every response has --new-tokens")
    parser.add_argument("--engines", default="fast,hf")
    parser.add_argument("--no-tf32", action="store_true", help="fp32 matmuls without TF32 (the Tesla P40 path)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--fast-variants", default="", help="';'-separated FastEngine kwargs, e.g. 'fuse_weights=0'")
    parser.add_argument("--check", action="store_true", help="greedy correctness check against transformers first")
    parser.add_argument("--breakdown", action="store_true", help="time one decode step's forward and sampling")
    parser.add_argument("--gap", action="store_true",
                        help="each engine's sampling log-probs against the trainer's (rlanywhere.logprobs) on the "
                             "last timed batch: mean and max |difference|")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    device = args.device
    if args.check:
        correctness_check(device, parse_variants(args.fast_variants))
    tf32 = not args.no_tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    dtype = DTYPES[args.dtype]
    model, tokenizer = load_model(args, device, dtype)
    vocab = model.config.get_text_config().vocab_size
    prompts = load_prompts(args, tokenizer, vocab)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature, n=args.n,
                            ignore_eos=args.fixed_length)
    name = f"gguf:{os.path.basename(args.gguf)}" if args.gguf else args.model
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    print(f"model {name} | {args.dtype} | tf32 {'on' if tf32 else 'off'} | {len(prompts)} prompts x n={args.n} | "
          f"prompt {args.prompt_len if not args.prompts else 'dataset'} | new {args.new_tokens} | "
          f"{'fixed length' if args.fixed_length else 'EOS stops'} | {gpu} | torch {torch.__version__}")

    results = []
    for engine_name in [e.strip() for e in args.engines.split(",") if e.strip()]:
        variants = parse_variants(args.fast_variants) if engine_name == "fast" else [{}]
        for kw in variants:
            label = engine_name + ("" if not kw else " " + variant_label(kw))
            try:
                if engine_name == "fast":
                    rows = len(prompts) * args.n
                    plan = fast_plan(model, rows, max(map(len, prompts)) + args.new_tokens, **kw)
                    engine = FastEngine(model, tokenizer, plan)
                    warm_params = params
                else:
                    engine = HFEngine(model, tokenizer)
                    warm_params = SamplingParams(max_new_tokens=8, temperature=args.temperature, n=args.n,
                                                 ignore_eos=args.fixed_length)
                # every engine the same number of timed runs, its best kept
                seconds, tokens, warm, batch = time_engine(engine, prompts, params, device, args.repeats, warm_params)
                results.append({"engine": label, "seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds,
                                "warmup_s": warm})
                print(f"  {label:<40} {tokens:>8} tokens  {seconds:8.3f} s  {tokens / seconds:10.0f} tok/s  "
                      f"(warm-up {warm:.2f} s)", flush=True)
                if args.gap:  # this engine's sampling log-probs against the trainer's, same model and tokens
                    delta = (trainer_logprobs(model, batch, args.temperature) - batch.response_logprobs.float())
                    delta = delta[batch.response_mask.bool()].abs()
                    results[-1]["logprob_gap"] = float(delta.mean())
                    print(f"    |logprob - trainer|: mean {delta.mean():.2e}  max {delta.max():.2e}  "
                          f"({delta.numel()} tokens)", flush=True)
                if engine_name == "fast" and args.breakdown and device.startswith("cuda"):
                    print("    " + step_breakdown(engine, params, device, rows,
                                                  max(map(len, prompts)) + args.new_tokens - 2), flush=True)
                del engine
            except Exception as exc:  # keep the other measurements of a run
                import traceback

                traceback.print_exc()
                print(f"  {label}: FAILED {type(exc).__name__}: {exc}", flush=True)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()

    hf = next((r for r in results if r["engine"] == "hf"), None)
    print()
    print(f"{'engine':<40} {'tok/s':>10} {'x HF':>7}")
    for r in results:
        ratio = f"{r['tok_per_s'] / hf['tok_per_s']:.1f}" if hf else "-"
        print(f"{r['engine']:<40} {r['tok_per_s']:>10.0f} {ratio:>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": gpu, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
