"""The half-precision decode step's fused Triton kernels (rollout/decode_elementwise.py, rope_store_attention in
rollout/decode_attention.py) against the eager functions they stand in for, run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py). bf16 results may differ from eager by one bf16 rounding step where the
fp32 sums inside (the norm's mean, the new slot's score) are added in another order; fp32 to float rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from rlanywhere.plans import RolloutPlan
from rlanywhere.rollout import FastEngine, SamplingParams
from rlanywhere.rollout import decode_attention as attention
from rlanywhere.rollout import decode_elementwise as elementwise
from rlanywhere.rollout.llama import add_rms_norm, apply_rope, rms_norm, signed_sin, silu_mul

from .test_decode_attention import interpreter_runs
from .test_rollout import PAD, PROMPTS, responses, tiny_model, with_random_biases

pytestmark = pytest.mark.skipif(not interpreter_runs(),
                                reason="needs triton >= 3.9 and TRITON_INTERPRET=1 (scripts/test.sh, conftest.py)")

# one bf16 rounding step relative (2^-8 of the value, doubled for the product of two rounded values); fp32 ulps
TOLERANCE = {torch.bfloat16: dict(rtol=2**-7, atol=1e-6), torch.float32: dict(rtol=1e-6, atol=1e-6)}


@pytest.mark.parametrize("dtype,match_hf", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
def test_add_rms_norm_kernel_matches_the_eager_add_and_norm(dtype, match_hf):
    torch.manual_seed(0)
    h, delta = torch.randn(5, 1, 96).to(dtype), torch.randn(5, 1, 96).to(dtype)  # 96: a padded block of 128
    weight = (torch.rand(96) + 0.5).to(dtype)
    got_h, got_x = elementwise.add_rms_norm(h, delta, weight, 1e-6, match_hf)
    want_h, want_x = add_rms_norm(h, delta, weight, 1e-6, match_hf)
    assert got_h.shape == want_h.shape and got_x.dtype == dtype
    assert torch.equal(got_h, want_h)  # the add rounds once, by integer arithmetic: bitwise
    torch.testing.assert_close(got_x, want_x, **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="does not match"):
        elementwise.add_rms_norm(h, delta[:2], weight, 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embed_rms_norm_kernel_is_the_embedding_then_the_first_norm(dtype):
    torch.manual_seed(1)
    embed, weight = torch.randn(50, 64).to(dtype), (torch.rand(64) + 0.5).to(dtype)
    tokens = torch.tensor([3, 49, 0, 3])
    h, x = elementwise.embed_rms_norm(tokens[:, None], embed, weight, 1e-5, True)
    want_h = F.embedding(tokens[:, None], embed)
    assert torch.equal(h, want_h)
    torch.testing.assert_close(x, rms_norm(want_h, weight, 1e-5, True), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_kernel_matches_eager_swiglu_on_the_fused_gate_up_output(dtype):
    torch.manual_seed(2)
    intermediate = 1100  # two programs per row, the second partly masked
    gate_up = (torch.randn(3, 1, 2 * intermediate) * 4).to(dtype)
    got = elementwise.silu_mul(gate_up, intermediate)
    assert got.shape == (3, 1, intermediate)
    torch.testing.assert_close(got, silu_mul(*gate_up.chunk(2, dim=-1)), **TOLERANCE[dtype])
    with pytest.raises(ValueError, match="is not 2 x"):
        elementwise.silu_mul(gate_up, intermediate + 1)


@pytest.mark.parametrize("match_hf", [True, False])
def test_rope_store_attention_is_rope_and_store_then_attention(match_hf):
    torch.manual_seed(3)
    dtype, batch, heads, kv_heads, head_dim, rows, length, span = torch.bfloat16, 4, 6, 2, 32, 6, 300, 256
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim).to(dtype)
    angles = torch.rand(batch, head_dim // 2) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = signed_sin(torch.cat([angles.sin()] * 2, -1)).to(dtype)
    cache = torch.randn(2, rows, kv_heads, length, head_dim).to(dtype)
    starts, slot, scale = torch.tensor([0, 5, 70, 200]), torch.tensor([200]), head_dim**-0.5
    # the two-kernel path on a copy of the cache
    ref_k, ref_v = cache[0].clone(), cache[1].clone()
    q = attention.rope_and_store(qkv, cos, sin, ref_k, ref_v, slot, heads, match_hf)
    want = attention.decode_attention(q.view(batch, kv_heads, heads // kv_heads, head_dim), ref_k[:batch, :, :span],
                                      ref_v[:batch, :, :span], starts, slot, scale)
    # this step's slot is poisoned in the cache: the fused kernel must take the new key and value from qkv
    cache[:, :batch, :, 200] = float("nan")
    for splits in (None, 1, 3, 4):  # the slot in the last chunk, in a middle one, with and without the merge
        k, v = cache[0].clone(), cache[1].clone()
        got = attention.rope_store_attention(qkv, cos, sin, k, v, starts, slot, heads, span, scale, match_hf,
                                             splits=splits)
        assert got.shape == want.shape and got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2e-3)
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v), splits  # the slot written, nothing else
    with pytest.raises(ValueError, match="half precision only"):
        attention.rope_store_attention(qkv.float(), cos.float(), sin.float(), k.float(), v.float(), starts, slot,
                                       heads, span, scale, match_hf)


FUSED = RolloutPlan(decode_attention="triton", fuse_weights=True, fused_kv_write=True, compile_elementwise=True,
                    check_every=2)


def test_bf16_engine_with_the_fused_kernels_samples_as_the_unfused_one():
    model = with_random_biases(tiny_model("qwen2")).to(torch.bfloat16)
    params = SamplingParams(max_new_tokens=6, temperature=0)  # 5 decode steps (each a second under the interpreter)
    fused = FastEngine(model, None, FUSED, pad_token_id=PAD)
    assert fused.forward.triton_elementwise and fused.forward.rope_attention_kernel
    plain = FastEngine(model, None, dataclasses.replace(FUSED, compile_elementwise=False, fused_kv_write=False),
                       pad_token_id=PAD)
    assert not plain.forward.triton_elementwise and not plain.forward.rope_attention_kernel
    got, want = fused.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert responses(got) == responses(want)
    # log-probs a bf16 rounding step apart here and there (this tiny model's logits are large: the SDPA attention in
    # place of the Triton one moves them by 0.09 on average, 1.3 at most)
    gap = (got.response_logprobs - want.response_logprobs)[want.response_mask.bool()].abs()
    assert gap.mean() < 1e-2 and gap.max() < 5e-2, (gap.mean().item(), gap.max().item())


def test_fp32_keeps_the_compiled_kernels_and_the_separate_attention():
    engine = FastEngine(tiny_model("qwen2"), None, FUSED, pad_token_id=PAD)
    assert not engine.forward.triton_elementwise and not engine.forward.rope_attention_kernel
    assert engine.forward.kv_write_kernel


def test_half_precision_attention_takes_the_nearest_number_of_splits():
    """A second split costs a merge kernel: half precision rounds programs wanted / (row, KV head) pairs to the
    nearest whole number instead of up (fp32 keeps rounding up)."""
    assert attention.plan_splits(512, 384, 528) == (2, 192)  # 1.03 pairs per program wanted: up to 2
    assert attention.plan_splits(512, 384, 528, nearest=True) == (1, 384)  # one split, no merge
    assert attention.plan_splits(256, 384, 528, nearest=True) == (2, 192)
    assert attention.plan_splits(128, 768, 528, nearest=True) == (4, 192)
    assert attention.plan_splits(4096, 384, 528, nearest=True) == (1, 384)


def test_the_attention_kernels_compile_for_a_gpu_with_the_split_count_unspecialized():
    """The interpreter runs what a GPU build refuses: compile the three split-K kernels for sm_90 on the CPU
    (Triton's own compiler and ptxas, in a process without TRITON_INTERPRET), the split count a runtime argument,
    with the launch options and the argument alignment of a bf16 decode step (Qwen2.5-0.5B's heads)."""
    import os
    import subprocess
    import sys

    script = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from rlanywhere.rollout import decode_kernels as kernels
from rlanywhere.rollout.decode_attention import HALF_LAUNCH
constants = dict(G_PAD=16, BLOCK_D=64, BLOCK_S=64, HALF_DOT=True, FP32_DOT="ieee", MATCH_HF=True)
index_pointers = ("starts_ptr", "slot_ptr")
partials = ("acc_ptr", "max_ptr", "sum_ptr")
odd = {"kv_heads", "groups", "heads", "splits"}  # 2, 7, 14, the split count: not multiples of 16 (the rest are)
for kernel in (kernels.split_kernel, kernels.rope_attend_kernel, kernels.merge_kernel):
    signature = {name: "constexpr" if name in constants else "*i64" if name in index_pointers else
                 "*fp32" if name in partials else "*bf16" if name.endswith("_ptr") else
                 "fp32" if name == "scale" else "i32" for name in kernel.arg_names}
    unspecialized = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    assert signature["splits"] == "i32" and "splits" in unspecialized
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if signature[name].startswith("*") or (signature[name] == "i32" and name not in odd)}
    source = ASTSource(fn=kernel, signature=signature, attrs=aligned,
                       constexprs={name: constants[name] for name in kernel.arg_names if name in constants})
    options = {} if kernel is kernels.merge_kernel else HALF_LAUNCH
    compiled = compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    print(kernel.__name__, len(compiled.asm["cubin"]), compiled.metadata.num_warps, compiled.metadata.shared,
          ".maxnreg" in compiled.asm["ptx"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(name in done.stdout for name in ("split_kernel", "rope_attend_kernel", "merge_kernel"))
    # the two attention kernels as launched: 8 programs fit one SM of an H200 (64K registers, 228 KiB of shared
    # memory), so that 512 rows x 2 KV heads run in one wave of its 132 SMs
    for line in done.stdout.splitlines():
        name, _, warps, shared, capped = line.split()
        if name != "merge_kernel":
            assert int(warps) == 2 and capped == "True", line  # 2 warps x 32 threads x 128 registers x 8 = 64K
            assert 8 * int(shared) <= 228 * 1024, line
