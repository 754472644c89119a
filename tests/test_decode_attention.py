"""The split-K decode attention kernels (rollout/decode_attention.py), run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py before triton is imported).

scripts/test.sh installs triton where torch brought none (a CPU build); without it these tests are skipped.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlanywhere.rollout import FastEngine, SamplingParams
from rlanywhere.rollout import decode_attention as kernels
from rlanywhere.plans import RolloutPlan

from .test_rollout import PAD, PROMPTS, reference_greedy, responses, tiny_model, with_random_biases


def interpreter_runs() -> bool:
    """triton >= 3.9 under TRITON_INTERPRET=1: older interpreters fail on loops with tensor bounds (numpy 2.4)."""
    from importlib.metadata import version

    if not (kernels.triton_usable() and kernels.triton_interpreting()):
        return False
    return tuple(int(part) for part in version("triton").split(".")[:2]) >= (3, 9)


pytestmark = pytest.mark.skipif(not interpreter_runs(),
                                reason="needs triton >= 3.9 and TRITON_INTERPRET=1 (scripts/test.sh, conftest.py)")


def reference_attention(q, keys, values, starts, slot, scale):
    """fp64 softmax(q K^T * scale) V over slots [start, slot] of each row."""
    span = keys.shape[2]
    cols = torch.arange(span)
    valid = (cols[None] >= starts[:, None]) & (cols[None] <= slot)
    scores = torch.einsum("bhgd,bhsd->bhgs", q.double(), keys.double()) * scale
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    values = values.double().masked_fill(~valid[:, None, :, None], 0.0)  # 0 * NaN poison would be NaN
    return torch.einsum("bhgs,bhsd->bhgd", scores.softmax(-1), values)


def test_plan_splits_fills_the_gpu_with_whole_blocks():
    assert kernels.BLOCK_SLOTS == 64
    # 12 blocks of 64; 528 programs wanted / 128 (row, head) pairs -> 5 chunks of ceil(12/5)=3 blocks -> 4 chunks
    assert kernels.plan_splits(128, 768, 528) == (4, 192)
    assert kernels.plan_splits(512, 768, 528) == (2, 384)
    assert kernels.plan_splits(1024, 768, 528) == (1, 768)  # enough rows: one program walks the whole span
    assert kernels.plan_splits(2, 100, 528) == (2, 64)  # never a chunk shorter than a block


@pytest.mark.parametrize("dtype,groups,head_dim,tolerance", [
    (torch.float32, 7, 64, 1e-5), (torch.bfloat16, 4, 64, 2e-2), (torch.float32, 1, 48, 1e-5)])
def test_kernel_matches_fp64_attention_over_each_rows_filled_slots(dtype, groups, head_dim, tolerance):
    torch.manual_seed(0)
    rows, kv_heads, layers, length, span = 5, 2, 3, 320, 256
    # views of a [layers, rows, kv, length, D] cache, as the engine passes them (strided, not contiguous)
    cache_k = torch.randn(layers, rows + 2, kv_heads, length, head_dim).to(dtype)
    cache_v = torch.randn(layers, rows + 2, kv_heads, length, head_dim).to(dtype)
    keys, values = cache_k[1, :rows, :, :span], cache_v[1, :rows, :, :span]
    # poison everything a row must not read: left padding and slots after the one written this step
    slot = torch.tensor([200])
    starts = torch.tensor([0, 3, 64, 130, 200])
    for r, s in enumerate(starts.tolist()):
        keys[r, :, :s] = 1e4
        values[r, :, :s] = float("nan")
    keys[:, :, 201:] = 1e4
    values[:, :, 201:] = float("nan")
    q = torch.randn(rows, kv_heads, groups, head_dim).to(dtype)
    expected = reference_attention(q, keys, values, starts, slot, head_dim**-0.5)
    for splits in (None, 1, 3, 4):
        out = kernels.decode_attention(q, keys, values, starts, slot, head_dim**-0.5, splits=splits)
        assert out.dtype == dtype and out.shape == q.shape
        gap = (out.double() - expected).abs().max().item()
        assert gap < tolerance, (splits, gap)
    # the row whose only filled slot is the one just written returns that slot's value
    assert torch.allclose(out[4].double(), values[4, :, 200:201].double().expand(kv_heads, groups, head_dim),
                          atol=tolerance)


def test_kernel_refuses_keys_without_a_contiguous_last_dim():
    q = torch.randn(2, 1, 2, 16)
    keys = torch.randn(2, 1, 16, 64).transpose(2, 3)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        kernels.decode_attention(q, keys, keys, torch.zeros(2, dtype=torch.long), torch.tensor([3]), 0.25)


@pytest.mark.parametrize("kind,tf32x3", [("qwen2", False), ("qwen3", False), ("qwen2", True)])
def test_engine_with_triton_attention_matches_transformers(kind, tf32x3):
    """tf32x3: the fp32 plan of cc >= 8.0 cards (the interpreter multiplies exactly either way; here it checks
    that the setting reaches the kernel's launch and the engine runs with it)."""
    model = tiny_model(kind)
    params = SamplingParams(max_new_tokens=8, temperature=0)
    plan = RolloutPlan(decode_attention="triton", check_every=2, attention_tf32x3=tf32x3)
    engine = FastEngine(model, None, plan, pad_token_id=PAD)
    assert engine.forward.numerics.attention_tf32x3 == tf32x3
    assert responses(engine.generate(PROMPTS, params)) == reference_greedy(model, PROMPTS, 8)


def test_engine_with_triton_attention_in_bf16_stays_within_bf16s_own_error_of_the_trainer():
    """bf16 sampling log-probs against the trainer's (rlanywhere.logprobs on the bf16 model): the kernel rounds the
    probabilities to bf16 before the product with V, as FlashAttention (the trainer's attention on a GPU) does, so
    on a CPU it sits further from the trainer than the SDPA path but inside bf16's own error (bf16 vs fp32
    weights). bench/rollout.py --check measures the same gap on a GPU."""
    import copy

    from rlanywhere.logprobs import response_logprobs

    model = tiny_model("qwen2").to(torch.bfloat16)
    exact = copy.deepcopy(model).float()

    def trainer_logprobs(batch, which):
        ids, mask, pos = batch.sequences()
        with torch.no_grad():
            return response_logprobs(which, ids, mask, batch.response_ids.shape[1], position_ids=pos)[0]

    engine = FastEngine(model, None, RolloutPlan(decode_attention="triton"), pad_token_id=PAD)
    batch = engine.generate(PROMPTS * 2, SamplingParams(max_new_tokens=12, temperature=1.0),
                            generator=torch.Generator().manual_seed(0))
    mask = batch.response_mask.bool()
    gap = (trainer_logprobs(batch, model) - batch.response_logprobs)[mask].abs()
    bf16_error = (trainer_logprobs(batch, model) - trainer_logprobs(batch, exact))[mask].abs()
    assert gap.mean() < bf16_error.mean(), (float(gap.mean()), float(bf16_error.mean()))


def test_triton_attention_off_a_gpu_needs_the_interpreter(monkeypatch):
    from rlanywhere.errors import UserError

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(UserError, match="runs on CUDA GPUs"):
        FastEngine(tiny_model("qwen2"), None, RolloutPlan(decode_attention="triton"), pad_token_id=PAD)


@pytest.mark.parametrize("dtype,match_hf", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
def test_rope_and_store_rounds_like_apply_rope_and_writes_only_the_slot(dtype, match_hf):
    from rlanywhere.rollout.llama import apply_rope, signed_sin

    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, rows, length = 3, 4, 2, 32, 5, 24
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim).to(dtype)
    angles = torch.rand(batch, head_dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = signed_sin(torch.cat([angles.sin()] * 2, -1)).to(dtype)
    cache_k = torch.randn(rows, kv_heads, length, head_dim).to(dtype)
    cache_v = torch.randn(rows, kv_heads, length, head_dim).to(dtype)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    slot = torch.tensor([17])
    q = kernels.rope_and_store(qkv, cos, sin, cache_k, cache_v, slot, heads, match_hf)
    rotated = apply_rope(qkv[:, : heads + kv_heads], cos[:, None], sin[:, None], match_hf)  # the eager path

    assert torch.equal(q, rotated[:, :heads])  # bitwise: bf16 rounds by integer arithmetic inside the kernel
    assert torch.equal(cache_k[:batch, :, 17], rotated[:, heads:])
    assert torch.equal(cache_v[:batch, :, 17], qkv[:, heads + kv_heads:])
    # nothing else moved: other slots, and the rows after the batch
    written = torch.zeros(rows, kv_heads, length, dtype=torch.bool)
    written[:batch, :, 17] = True
    assert torch.equal(cache_k[~written], before_k[~written]) and torch.equal(cache_v[~written], before_v[~written])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_store_with_the_bias_left_to_it_is_rope_of_the_biased_projection(dtype):
    """RolloutPlan.qkv_bias_apart: the QKV GEMM leaves the bias out and the kernel adds it first, one rounding
    to the dtype, as `qkv + bias` does."""
    from rlanywhere.rollout.llama import signed_sin

    torch.manual_seed(1)
    batch, heads, kv_heads, head_dim = 3, 4, 2, 32
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim).to(dtype)
    bias = torch.randn((heads + 2 * kv_heads) * head_dim).to(dtype)
    angles = torch.rand(batch, head_dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = signed_sin(torch.cat([angles.sin()] * 2, -1)).to(dtype)
    caches = [torch.zeros(4, kv_heads, 8, head_dim, dtype=dtype) for _ in range(4)]
    slot = torch.tensor([5])
    q = kernels.rope_and_store(qkv, cos, sin, caches[0], caches[1], slot, heads, True, bias=bias)
    biased = qkv + bias.view(heads + 2 * kv_heads, head_dim)
    q_ref = kernels.rope_and_store(biased, cos, sin, caches[2], caches[3], slot, heads, True)
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[1][:batch, :, 5].abs().sum() > 0  # the values (biased) were written
    with pytest.raises(ValueError, match="bias must be contiguous with"):
        kernels.rope_and_store(qkv, cos, sin, caches[0], caches[1], slot, heads, True, bias=bias[:-1])


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_engine_with_the_fused_kv_write_matches_transformers(kind):
    model = tiny_model(kind)
    # 5 tokens: 4 decode steps, each writing its slot and reading those written before it, with a check of finished
    # rows every 2 (Triton's interpreter runs each program in Python: every step costs a second)
    params = SamplingParams(max_new_tokens=5, temperature=0)
    plan = RolloutPlan(decode_attention="triton", fuse_weights=True, fused_kv_write=True, check_every=2)
    engine = FastEngine(model, None, plan, pad_token_id=PAD)
    assert engine.forward.kv_write_kernel
    assert responses(engine.generate(PROMPTS, params)) == reference_greedy(model, PROMPTS, 5)
    qwen3 = FastEngine(tiny_model("qwen3"), None, plan, pad_token_id=PAD)
    assert not qwen3.forward.kv_write_kernel  # q/k norms come before RoPE: the separate kernels
    biased = with_random_biases(tiny_model(kind))
    expected = reference_greedy(biased, PROMPTS, 5)
    for apart in (False, True):  # the bias in the GEMM, or added by the RoPE + K/V write kernel
        engine = FastEngine(biased, None, dataclasses.replace(plan, qkv_bias_apart=apart), pad_token_id=PAD)
        assert responses(engine.generate(PROMPTS, params)) == expected, apart
