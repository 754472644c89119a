"""Multi-turn rollout throughput: a rollout with 3 tool turns per row against a single-turn rollout of the same
total tokens, and FastEngine's KV continuation against re-prefilling the history every turn, side by side.

    python bench/multiturn_rollout.py --dtype bf16 --batch 128 --prompt-len 256     # a CUDA GPU
    python bench/multiturn_rollout.py --device cpu --dtype fp32 --batch 4 --prompt-len 32 --filler 8 --layers 2

The model is a random-weight model of Qwen2.5-0.5B's shape (`--layers` fewer for a quick CPU run), so its own text
is noise: every decode step runs and samples for real, and then the sampled token is replaced by the scripted
response (filler, a calculator call, EOS; three times; then a final answer), so each row makes exactly 3 real
calculator calls whose results are rendered with the chat template and appended. The single-turn rollout generates
as many tokens per row (EOS ignored). Throughput counts every response token, tool tokens included (they pass
through the model either way); the multi-turn times include the tool calls and the host's per-step look.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from rlanywhere.planner import plan_rollout_for  # noqa: E402
from rlanywhere.rollout import FastEngine, SamplingParams  # noqa: E402
from rlanywhere.rollout import multiturn_fast, scheduler  # noqa: E402
from rlanywhere.rollout.multiturn import MultiTurnRollout, MultiTurnSettings, ToolMessageRenderer  # noqa: E402
from rlanywhere.tools import CalculatorTool  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "1234 * 5678"}}</tool_call>'


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT
    return tok


def build_model(device: str, dtype: torch.dtype, layers: int, eos: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=896, num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, eos_token_id=eos)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    return model.to(dtype).eval()


def scripted_response(tok, filler: int, final: int) -> list[int]:
    """Three turns of filler + a calculator call + EOS, each followed by its rendered tool result; a final turn."""
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn = ids("x" * filler + CALL) + [tok.eos_token_id]
    result = ToolMessageRenderer(tok, "<|im_end|>").ids([str(1234 * 5678)], True)
    return (turn + result) * 3 + ids("y" * final) + [tok.eos_token_id]


class Script:
    """Replaces each sampled token by the scripted token at that response position (all prompts have one length)."""

    def __init__(self, engine: FastEngine, script: list[int], prompt_len: int):
        self.runner, self.prompt_len = engine.runner, prompt_len
        self.script = torch.tensor(script, device=engine.device)
        self.pending = None  # response positions of the next sampler call's rows
        self._sample = scheduler.sample_from_logits
        runner = engine.runner
        prefill, decode_step, decode_sample = runner.prefill, runner.decode_step, runner.decode_sample

        def scripted_prefill(ids, lengths, copies, row_start):
            positions = (lengths - prompt_len).repeat_interleave(copies)
            self.pending = positions if self.pending is None else torch.cat([self.pending, positions])
            return prefill(ids, lengths, copies, row_start)

        def scripted_step(batch, slot, span=None, eager=False):
            logits = decode_step(batch, slot, span, eager)
            self.pending = runner._buffers["positions"][:batch] + 1 - prompt_len
            return logits

        def scripted_sample(batch, slot, span=None, eager=False, position=0):
            tok, logp = decode_sample(batch, slot, span, eager, position)
            return self.at(runner._buffers["positions"][:batch] + 1 - prompt_len), logp

        runner.prefill, runner.decode_step, runner.decode_sample = scripted_prefill, scripted_step, scripted_sample

    def at(self, positions):
        return self.script[positions.clamp(0, len(self.script) - 1)]

    def sample(self, logits, params, gen, row_keys=None, position=0):
        tok, logp = self._sample(logits, params, gen, row_keys, position)
        if self.pending is not None and self.pending.numel() == tok.numel():
            tok = self.at(self.pending.to(tok.device))
        self.pending = None
        return tok, logp

    def install(self):
        scheduler.sample_from_logits = self.sample
        multiturn_fast.sample_from_logits = self.sample


def timed(fn, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--batch", type=int, default=128, help="rows (prompts x n, n = 1)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--filler", type=int, default=64, help="tokens before each call")
    parser.add_argument("--final", type=int, default=64, help="tokens of the last turn")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    device, dtype = args.device, DTYPES[args.dtype]
    tok = byte_tokenizer()
    model = build_model(device, dtype, args.layers, tok.eos_token_id)
    script = scripted_response(tok, args.filler, args.final)
    total = len(script)
    plan = plan_rollout_for(model, device, rows_per_wave=args.batch, max_seq_len=args.prompt_len + total)
    engine = FastEngine(model, tok, plan)
    scripted = Script(engine, script, args.prompt_len)
    scripted.install()
    gen = torch.Generator(device=device if device.startswith("cuda") else "cpu")
    prompts = torch.randint(300, 150000, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(0))
    items = [{"input_ids": p.tolist(), "extra_info": {}} for p in prompts]
    params = SamplingParams(max_new_tokens=total, temperature=1.0)
    single = SamplingParams(max_new_tokens=total, temperature=1.0, ignore_eos=True)
    print(f"{device} {torch.cuda.get_device_name() if device.startswith('cuda') else ''} {args.dtype}, "
          f"{args.layers} layers of Qwen2.5-0.5B's shape; {args.batch} rows x prompt {args.prompt_len}, "
          f"{total} response tokens per row (3 calculator calls); plan: {plan.decode_attention} attention, "
          f"CUDA graphs {plan.cuda_graphs}, fused sampling {plan.fused_sampling}", flush=True)
    results = {}

    def single_turn():
        scripted.pending = None
        return engine.generate([i["input_ids"] for i in items], single, generator=gen.manual_seed(1))

    def multi(kv: bool):
        driver = MultiTurnRollout([CalculatorTool()], tok, MultiTurnSettings(), engine.eos_ids, kv_continuation=kv)

        def run():
            scripted.pending = None
            return driver.generate(engine, items, params, gen.manual_seed(1)), driver.last_stats
        return run

    cases = [("single-turn, same tokens", single_turn), ("multi-turn, KV continuation", multi(True)),
             ("multi-turn, re-prefill each turn", multi(False))]
    for name, fn in cases:
        with torch.no_grad():
            fn()  # warm-up: graphs captured, kernels loaded
            best, out = min((timed(fn, device) for _ in range(args.repeats)), key=lambda r: r[0])
        batch, stats = (out if isinstance(out, tuple) else (out, None))
        tokens = int(batch.response_ids.ne(tok.pad_token_id).sum()) if stats else int(batch.response_mask.sum())
        row = {"seconds": best, "response_tokens": tokens, "tokens_per_s": tokens / best}
        if stats:
            row["tool_calls_per_row"] = sum(s.tool_calls for s in stats) / len(stats)
            row["tool_errors"] = sum(s.tool_errors for s in stats)
            row["model_tokens"] = int(batch.response_mask.sum())
        results[name] = row
        print(f"{name:34s} {best:8.3f} s  {tokens:8d} tokens  {tokens / best:10.0f} tok/s"
              + (f"  tool calls/row {row['tool_calls_per_row']:.1f}, errors {row['tool_errors']}" if stats else ""),
              flush=True)
    base = results["single-turn, same tokens"]["seconds"]
    for name in list(results)[1:]:
        print(f"{name}: {results[name]['seconds'] / base:.2f}x the single-turn time")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()
