"""Shared prompts (prompt_sharing.py) against packed rows on one training micro-batch: agreement and time.

Builds the Qwen2.5-0.5B-shaped body of bench/vs_trl.py (49,152-token vocabulary, random weights), a micro-batch of
--rows rows (--rows / --n prompts of --prompt-len tokens, each repeated --n times, responses of --response-len
tokens), and runs the actor's log-prob pass forward and backward three ways: packed rows (what the update ran before,
flash attention where it runs), the shared-prompt stream with SDPA and a mask, and with varlen flash attention
(where PyTorch has it and flash runs). Prints the time of each (median over --repeats after warm-up, CUDA events),
the tokens each pushes through the layers, and each one's largest log-prob and gradient difference from packed rows.

    python bench/shared_prompts.py --dtype bf16 --rows 64       # the bf16 plan's micro-batch (H200)
    python bench/shared_prompts.py --dtype fp32 --rows 8        # the P40 path's (fp32, TF32 off)
    python bench/shared_prompts.py --device cpu --tiny          # a smoke run of the whole path

Needs a CUDA GPU for the flash kernels; on a CPU it runs the masked stream only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlanywhere.logprobs import response_logprobs
from rlanywhere.microbatch import pack_rows
from rlanywhere.models import hf_attention_implementation
from rlanywhere.plans import Plan
from rlanywhere.prompt_sharing import MASKED, VARLEN, pack_shared_prompts, varlen_attention_function

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(tiny: bool, expand_kv: bool, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    size = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128) if tiny else dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                                         num_key_value_heads=2, intermediate_size=4864)
    config = Qwen2Config(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=4096, **size)
    config._attn_implementation = hf_attention_implementation(Plan(share_prompts=True, expand_kv_heads=expand_kv))
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


def make_batch(rows: int, n: int, prompt_len: int, response_len: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (rows // n, prompt_len), generator=g)
    prompt_ids = prompts.repeat_interleave(n, dim=0)
    responses = torch.randint(3, vocab, (rows, response_len), generator=g)
    ones = lambda t: torch.ones_like(t)  # noqa: E731
    return prompt_ids, ones(prompt_ids), responses, ones(responses)


def run_layout(model, batch, layout: str, dtype, device: str, repeats: int):
    rows = list(range(batch[0].shape[0]))
    if layout == "packed":
        micro = pack_rows(*batch, rows, 0)
        moved = [t.to(device) if torch.is_tensor(t) else t for t in micro]
        call = lambda: response_logprobs(model, moved[0], moved[1], micro.response_len,  # noqa: E731
                                         position_ids=moved[2], response_start=moved[4], check_labels=False)
        tokens = micro.input_ids.numel()
    else:
        shared = pack_shared_prompts(*batch, rows, 0, 8, layout).to(device)
        call = lambda: response_logprobs(model, None, None, 0, shared=shared, check_labels=False)  # noqa: E731
        tokens = shared.input_ids.numel()
    autocast = torch.autocast(device_type=device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32)
    times, logprobs, grad = [], None, None
    for i in range(repeats + 2):
        model.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            logprobs, _ = call()
        logprobs.float().sum().backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    grad = torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])
    return statistics.median(times) * 1000, tokens, logprobs.detach().float(), grad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--prompt-len", type=int, default=120)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, for a CPU")
    args = parser.parse_args()
    dtype, device = DTYPES[args.dtype], args.device
    on_cuda = device.startswith("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    flash = on_cuda and dtype != torch.float32 and torch.cuda.get_device_capability(device) >= (8, 0)
    model = build_model(args.tiny, expand_kv=on_cuda and not flash, device=device)
    batch = make_batch(args.rows, args.n, args.prompt_len, args.response_len, model.config.vocab_size)
    layouts = ["packed", MASKED] + ([VARLEN] if flash and varlen_attention_function() is not None else [])
    print(f"{args.rows} rows = {args.rows // args.n} prompts x {args.n}, prompt {args.prompt_len} + response "
          f"{args.response_len} tokens, {args.dtype}, {device}"
          + ("" if on_cuda else " (no CUDA: masked stream only)"), flush=True)
    # every layout's error against packed rows in fp32 (TF32 off): the half-precision layouts should err alike
    _, _, exact, _ = run_layout(model, batch, "packed", torch.float32, device, 1)
    print(f"{'layout':<12} {'tokens':>8} {'fwd+bwd ms':>11} {'x packed':>9} {'max|dlogprob|':>14} "
          f"{'max|dgrad|/max|grad|':>21} {'max|dlogprob| vs fp32':>22}")
    reference = None
    for layout in layouts:
        ms, tokens, logprobs, grad = run_layout(model, batch, layout, dtype, device, args.repeats)
        if reference is None:
            reference = (ms, logprobs, grad)
        speed = reference[0] / ms
        dlp = (logprobs - reference[1]).abs().max().item()
        dgrad = ((grad - reference[2]).abs().max() / reference[2].abs().max()).item()
        print(f"{layout:<12} {tokens:>8} {ms:>11.2f} {speed:>9.3f} {dlp:>14.2e} {dgrad:>21.2e} "
              f"{(logprobs - exact).abs().max().item():>22.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
