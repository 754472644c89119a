"""Memory estimator: parameter counts against real models, activation formulas against measured saved tensors,
KV cache against a real cache, and the fit search's promises (fits, largest power of two, cheapest switches)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rlanywhere import estimator as est
from rlanywhere.estimator import GIB, ModelShape, Placement, Workload


def tiny_qwen2_config(layers=2, tied=False, hidden=64, inter=128, heads=4, kv=2, vocab=128):
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                       max_position_embeddings=256, tie_word_embeddings=tied)


def shape_of(config, name="tiny") -> ModelShape:
    return ModelShape(name, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                      config.num_key_value_heads, config.intermediate_size, config.vocab_size,
                      config.tie_word_embeddings, attention_bias=True, model_type="qwen2")


QWEN_05B = ModelShape("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True, attention_bias=True, model_type="qwen2")


def workload(**kw) -> Workload:
    base = dict(param_dtype=torch.float32, compute_dtype=torch.float32, rollout_dtype=torch.float32,
                use_autocast=False, prompts_per_step=64, samples_per_prompt=1, prompt_length=256,
                response_length=256, actor_mini_batch=64, critic_mini_batch=64, has_critic=True, has_ref=True)
    base.update(kw)
    return Workload(**base)


# ------------------------------------------------------------------------------------------ parameters
@pytest.mark.parametrize("tied", [True, False])
def test_param_counts_match_real_qwen2(tied):
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(tied=tied)
    model = Qwen2ForCausalLM(config)
    shape = shape_of(config)
    unique = {id(p): p.numel() for p in model.parameters()}  # tied weights counted once
    assert shape.num_params() == sum(unique.values())
    assert shape.backbone_params() == sum(p.numel() for p in model.model.parameters())


def test_qwen25_05b_count_is_the_published_one():
    # 494,032,768: embed 151936*896 + 24 layers * 14,912,384 + final norm 896 (tied head)
    assert QWEN_05B.num_params() == 151936 * 896 + 24 * 14_912_384 + 896 == 494_032_768


def test_lora_params_match_peft():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config()
    model = get_peft_model(Qwen2ForCausalLM(config), LoraConfig(r=4, target_modules="all-linear"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert shape_of(config).lora_params(4) == trainable


# ----------------------------------------------------------------------------------------- activations
def _saved_bytes(config, attn: str, autocast_dtype, checkpointing: bool, batch: int, seq: int) -> int:
    """Bytes of activations autograd keeps after a forward (weights and autocast's weight casts excluded)."""
    from transformers import Qwen2ForCausalLM

    config._attn_implementation = attn
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    if checkpointing:
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        weight_cast = tensor.grad_fn is not None and tensor.grad_fn.name() == "TBackward0"
        if storage.data_ptr() not in params and not weight_cast:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    ids = torch.randint(0, config.vocab_size, (batch, seq))
    context = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
               else torch.autocast("cpu", enabled=False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        model.model(input_ids=ids)
    return sum(seen.values())


@pytest.mark.parametrize("attn,autocast_dtype,checkpointing", [
    ("sdpa", None, False), ("sdpa", torch.bfloat16, False), ("eager", None, False), ("sdpa", None, True)])
def test_activation_formula_bounds_measured_saved_tensors(attn, autocast_dtype, checkpointing):
    batch, seq = 2, 48
    tokens = batch * seq
    # Per layer per token: the difference between a 3-layer and a 1-layer model, so embedding/final norm cancel.
    one = _saved_bytes(tiny_qwen2_config(1, hidden=128, inter=384), attn, autocast_dtype, checkpointing, batch, seq)
    three = _saved_bytes(tiny_qwen2_config(3, hidden=128, inter=384), attn, autocast_dtype, checkpointing, batch, seq)
    measured = (three - one) / 2 / tokens
    shape = shape_of(tiny_qwen2_config(1, hidden=128, inter=384))
    compute = 2 if autocast_dtype is not None else 4
    if checkpointing:
        predicted = shape.hidden_size * 4  # each checkpointed layer keeps its fp32 input only
    else:
        predicted = est.layer_saved_bytes_per_token(shape, compute, 4, autocast_dtype is not None)
        if attn == "eager":
            predicted += est.attention_scores_bytes_per_token(shape, seq, compute)
    # The formula may be conservative (it assumes k/v repeated to all heads) but never optimistic.
    assert measured <= predicted <= 1.25 * measured, (measured, predicted)


def _shared_stream_saved_bytes(layers: int, rows: int, n: int, prompt: int, response: int) -> tuple[int, int]:
    """(bytes autograd keeps after a shared-prompt stream's forward (masked kernel), the stream's tokens) for `rows`
    full-length rows in groups of `n`."""
    from transformers import Qwen2ForCausalLM

    from rlanywhere.models import hf_attention_implementation
    from rlanywhere.plans import Plan
    from rlanywhere.prompt_sharing import MASKED, pack_shared_prompts

    config = tiny_qwen2_config(layers, hidden=128, inter=384)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.config._attn_implementation = hf_attention_implementation(Plan(share_prompts=True))
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, config.vocab_size, (rows // n, prompt), generator=g).repeat_interleave(n, 0)
    response_ids = torch.randint(3, config.vocab_size, (rows, response), generator=g)
    micro = pack_shared_prompts(prompt_ids, torch.ones_like(prompt_ids), response_ids, torch.ones_like(response_ids),
                                list(range(rows)), 0, 1, MASKED)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=micro.input_ids, **micro.decoder_kwargs())
    return sum(seen.values()), micro.input_ids.numel()


@pytest.mark.parametrize("rows,n,prompt,response", [(8, 4, 20, 30), (8, 8, 150, 10)])
def test_shared_prompt_formula_bounds_measured_saved_tensors(rows, n, prompt, response):
    """A shared-prompt stream keeps the per-token tensors of a packed row and, per layer, the keys and values its
    attention gathered for every sequence (rows and prompt chunks): estimator.shared_attention_bytes."""
    one, tokens = _shared_stream_saved_bytes(1, rows, n, prompt, response)
    three, _ = _shared_stream_saved_bytes(3, rows, n, prompt, response)
    measured = (three - one) / 2
    shape = shape_of(tiny_qwen2_config(1, hidden=128, inter=384))
    wl = workload(samples_per_prompt=n, prompt_length=prompt, response_length=response, share_prompts=True)
    assert tokens == est.micro_batch_tokens(wl, rows)
    predicted = (est.layer_saved_bytes_per_token(shape, 4, 4, False) * tokens
                 + est.shared_attention_bytes(shape, wl, rows, 4))
    assert measured <= predicted <= 1.25 * measured, (measured, predicted)


@pytest.mark.parametrize("rows,n,prompt,response", [(16, 8, 20, 30), (4, 8, 150, 10)])
def test_varlen_shared_prompts_count_the_keys_the_layout_gathers(rows, n, prompt, response):
    """Varlen flash shared prompts gather each sequence's keys unpadded (each prompt's own, each row's prompt and
    response); queries and outputs stay in the stream. The estimate's extra is those keys and values, and less than
    the masked kernel's padded slots."""
    from rlanywhere.prompt_sharing import VARLEN, pack_shared_prompts
    from rlanywhere.vocabulary import SHARED_PROMPTS_VARLEN

    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 100, (max(1, rows // n), prompt), generator=g).repeat_interleave(n, 0)[:rows]
    response_ids = torch.randint(3, 100, (rows, response), generator=g)
    micro = pack_shared_prompts(prompt_ids, torch.ones_like(prompt_ids), response_ids, torch.ones_like(response_ids),
                                list(range(rows)), 0, 1, VARLEN)
    keys = micro.layout.key_gather.numel()
    shape = shape_of(tiny_qwen2_config(1, hidden=128, inter=384))
    masked = workload(samples_per_prompt=n, prompt_length=prompt, response_length=response, share_prompts=True)
    varlen = dataclasses.replace(masked, shared_prompt_kernel=SHARED_PROMPTS_VARLEN)
    for repeated, width in ((True, shape.q_dim), (False, shape.kv_dim)):
        counted = est.shared_attention_bytes(shape, dataclasses.replace(varlen, kv_heads_repeated=repeated), rows, 2)
        assert counted == keys * 2 * width * 2
    assert est.shared_attention_bytes(shape, varlen, rows, 2) < est.shared_attention_bytes(shape, masked, rows, 2)


def test_layer_formula_closed_forms():
    # Module docstring: plain fp32 -> 44 H + 16 I bytes; bf16 autocast with fp32 residual -> 36 H + 8 I.
    h, i = QWEN_05B.hidden_size, QWEN_05B.intermediate_size
    assert est.layer_saved_bytes_per_token(QWEN_05B, 4, 4, False) == 44 * h + 16 * i
    assert est.layer_saved_bytes_per_token(QWEN_05B, 2, 4, True) == 36 * h + 8 * i


def test_kv_cache_matches_a_real_cache():
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(layers=3)
    model = Qwen2ForCausalLM(config).eval()
    batch, seq = 3, 20
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 128, (batch, seq)), use_cache=True).past_key_values
    real = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers)
    assert est.kv_cache_bytes(shape_of(config), batch, seq, 4) == real


# -------------------------------------------------------------------------------------------- estimate
def test_resident_state_is_weights_plus_adam():
    placement = Placement(actor_micro_batch=1, critic_micro_batch=1, logprob_micro_batch=1, rollout_batch=1)
    out = est.estimate_memory(QWEN_05B, workload(), placement)
    parts = out["breakdown"]["rollout"]
    params = QWEN_05B.num_params()
    assert parts["actor_weights"] == params * 4
    assert parts["actor_adam"] == params * 8
    assert parts["ref_weights"] == params * 4
    assert parts["critic_weights"] == (QWEN_05B.backbone_params() + QWEN_05B.hidden_size + 1) * 4
    assert "actor_grads" not in parts  # grads exist only during the update
    assert out["breakdown"]["actor_update"]["actor_grads"] == params * 4
    assert out["peak_bytes"] == max(out["phases"].values())


def test_switches_move_the_right_bytes():
    base = Placement(actor_micro_batch=8, critic_micro_batch=8, logprob_micro_batch=8, rollout_batch=64)
    full = est.estimate_memory(QWEN_05B, workload(), base)
    ckpt = est.estimate_memory(QWEN_05B, workload(), Placement(**{**base.to_dict(), "gradient_checkpointing": True}))
    assert ckpt["breakdown"]["actor_update"]["activations"] < full["breakdown"]["actor_update"]["activations"] / 4
    opt = est.estimate_memory(QWEN_05B, workload(), Placement(**{**base.to_dict(), "optimizer_offload": True}))
    assert "actor_adam" not in opt["breakdown"]["rollout"]
    parked = est.estimate_memory(QWEN_05B, workload(), Placement(**{**base.to_dict(), "ref_on_device": False}))
    assert "ref_weights" not in parked["breakdown"]["rollout"]
    assert parked["breakdown"]["ref_log_prob"]["ref_weights"] == QWEN_05B.num_params() * 4
    params_off = est.estimate_memory(QWEN_05B, workload(), Placement(**{**base.to_dict(), "param_offload": True}))
    assert "critic_weights" not in params_off["breakdown"]["rollout"]
    assert "actor_weights" in params_off["breakdown"]["rollout"]
    # on a CPU-only run nothing is offloaded, whatever the placement says
    cpu = est.estimate_memory(QWEN_05B, workload(on_cuda=False), Placement(**{**base.to_dict(), "param_offload": True}))
    assert "critic_weights" in cpu["breakdown"]["rollout"]


def test_budget_and_chunk_size_by_hand():
    assert est.memory_budget_bytes(24 * GIB, True) == int((24 * GIB - 512 * 1024 ** 2) * 0.9)
    assert est.memory_budget_bytes(10 * GIB, False) == int(10 * GIB * 0.8)
    # 0.04 * 19.69 GiB = 0.79 GiB < 1 GiB cap; / (151936 * 16 bytes per token) = 347 tokens -> 256
    assert est.choose_logprob_chunk_size(151936, int(19.69 * GIB), 4) == 256
    # a huge budget hits the 1 GiB cap: 1 GiB / (49152 * 16) = 1365 -> 1024
    assert est.choose_logprob_chunk_size(49152, 500 * GIB, 4) == 1024


# -------------------------------------------------------------------------------------------------- fit
def test_fit_with_room_takes_whole_minibatch_without_switches():
    fit = est.fit_settings(QWEN_05B, workload(prompts_per_step=8, actor_mini_batch=8, critic_mini_batch=8),
                           500 * GIB)
    p = fit.placement
    assert not (p.gradient_checkpointing or p.optimizer_offload or p.param_offload) and p.ref_on_device
    assert p.actor_micro_batch == 8 and p.critic_micro_batch == 8 and p.rollout_batch == 8
    assert fit.estimate["fits"]


def test_fit_picks_largest_power_of_two_that_fits():
    budget = 16 * GIB  # tight enough that the actor micro-batch is below its 32-sequence cap
    wl = workload()
    fit = est.fit_settings(QWEN_05B, wl, budget)
    assert fit is not None and fit.estimate["peak_bytes"] <= budget
    p = fit.placement
    cap = min(wl.actor_mini_batch, est.MAX_TOKENS_PER_MICRO_BATCH // 512)  # 512 = prompt + response tokens
    assert p.actor_micro_batch < est.micro_batch_caps(wl)["actor_micro_batch"][0] == cap
    assert p.actor_micro_batch & (p.actor_micro_batch - 1) == 0  # a power of two
    bigger = Placement(**{**p.to_dict(), "actor_micro_batch": p.actor_micro_batch * 2})
    assert est.estimate_memory(QWEN_05B, wl, bigger)["phases"]["actor_update"] > budget


@pytest.mark.parametrize("budget_gib", [12, 14, 16])
def test_fit_turns_on_only_switches_it_needs(budget_gib):
    budget = budget_gib * GIB
    fit = est.fit_settings(QWEN_05B, workload(), budget)
    p = fit.placement
    costly = [(key, cheap) for key, cheap in (("optimizer_offload", False), ("param_offload", False),
                                              ("ref_on_device", True)) if getattr(p, key) != cheap]
    assert costly  # these budgets cannot hold actor + critic + Adam + ref all at once
    switches = {k: getattr(p, k) for k in est.SEARCHED_SWITCHES}
    for key, cheap in costly:  # each switch that is on is needed: with it off and the others as chosen, no fit
        assert est.fit_settings(QWEN_05B, workload(), budget, {**switches, key: cheap}) is None
        assert fit.notes[key].startswith("needed to fit")


def test_fit_respects_explicit_choices():
    fit = est.fit_settings(QWEN_05B, workload(), 20 * GIB, {"actor_micro_batch": 3, "optimizer_offload": True})
    assert fit.placement.actor_micro_batch == 3 and fit.placement.optimizer_offload
    assert fit.notes["optimizer_offload"] == "explicit"


def test_dynamic_batch_token_budget_is_capped_and_holds_a_sequence():
    wl = workload(use_dynamic_bsz=True, token_budget_cap=4096)
    fit = est.fit_settings(QWEN_05B, wl, 20 * GIB)
    assert wl.seq_len <= fit.placement.max_token_len <= 4096


def test_no_fit_returns_none_and_explains_with_numbers():
    seven_b = ModelShape("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False, attention_bias=True)
    budget = est.memory_budget_bytes(int(22.38 * GIB), True)
    assert est.fit_settings(seven_b, workload(), budget) is None
    text = est.explain_no_fit(seven_b, workload(), budget)
    assert "nothing fits" in text and "LoRA r=16" in text and "response length 128" in text
    # 7.6B fp32 weights alone are 28 GiB: more than the whole budget
    assert "actor_weights 28.37 GiB" in text


# ------------------------------------------------------------------------------ rollout engine's own weights
@pytest.mark.parametrize("case", ["lora", "cast", "plain", "layouts", "lora+layouts"])
def test_engine_weight_copies_match_a_real_fast_engine(case):
    """The estimate of FastEngine's own weight copies equals what a real engine allocates (CPU, so no fusing of
    same-dtype weights), and is added to every phase. layouts: the [in, out] copies of o_proj and the (tied) LM
    head of RolloutPlan.fp32_gemm_layouts."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2ForCausalLM

    from rlanywhere.plans import RolloutPlan
    from rlanywhere.rollout import FastEngine

    config = tiny_qwen2_config(tied=True)
    model = Qwen2ForCausalLM(config)
    rollout_dtype = torch.float64 if case == "cast" else torch.float32
    lora_rank = 4 if "lora" in case else 0
    layouts = "layouts" in case
    if lora_rank:
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))
    engine = FastEngine(model, None, RolloutPlan(dtype=rollout_dtype, fuse_weights=case == "cast",
                                                 fp32_gemm_layouts=layouts), pad_token_id=0)
    wl = workload(rollout_dtype=rollout_dtype, actor_lora_rank=lora_rank, on_cuda=False, has_critic=False,
                  has_ref=False, rollout_layout_copies=layouts)
    predicted = est.rollout_engine_weight_bytes(shape_of(config), wl, budget_bytes=None)
    assert predicted == engine.owned_weight_bytes()
    assert (predicted > 0) == (case != "plain")
    if layouts:
        o_proj = config.num_attention_heads * (config.hidden_size // config.num_attention_heads) * config.hidden_size
        assert est.layout_copy_bytes(shape_of(config), torch.float32) == 4 * (
            config.num_hidden_layers * o_proj + config.vocab_size * config.hidden_size)
    estimate = est.estimate_memory(shape_of(config), wl, Placement())
    for parts in estimate["breakdown"].values():
        assert parts.get("rollout_engine_weights", 0) == predicted
    hf = est.rollout_engine_weight_bytes(shape_of(config), workload(rollout_engine="hf", rollout_dtype=rollout_dtype,
                                                                    actor_lora_rank=lora_rank), None)
    assert hf == 0


def test_fused_copies_counted_only_when_small_on_cuda():
    wl = workload(on_cuda=True)
    fused = QWEN_05B.num_layers * 4 * (896 * (896 + 2 * 128) + 2 * 896 * 4864)
    assert est.rollout_engine_weight_bytes(QWEN_05B, wl, budget_bytes=40 * GIB) == fused
    assert est.rollout_engine_weight_bytes(QWEN_05B, wl, budget_bytes=10 * GIB) == 0  # over 5 % of the budget
    assert est.rollout_engine_weight_bytes(QWEN_05B, workload(on_cuda=False), budget_bytes=40 * GIB) == 0


def test_shared_prompts_count_each_prompt_once_per_micro_batch():
    # groups of 8 rows kept together: whole groups, part of one group, or a cut inside a group at either end
    assert [est.prompts_per_micro_batch(rows, 8) for rows in (1, 2, 4, 8, 16, 64)] == [1, 1, 1, 1, 2, 8]
    assert [est.prompts_per_micro_batch(rows, 8) for rows in (3, 6, 12, 20)] == [2, 2, 3, 4]
    assert est.prompts_per_micro_batch(5, 1) == 5 and est.prompts_per_micro_batch(3, 0) == 3
    packed = est.Workload(param_dtype=torch.float32, compute_dtype=torch.float32, rollout_dtype=torch.float32,
                          use_autocast=False, prompts_per_step=16, samples_per_prompt=8, prompt_length=256,
                          response_length=256, actor_mini_batch=128, critic_mini_batch=128, has_critic=False,
                          has_ref=False)
    shared = dataclasses.replace(packed, share_prompts=True)
    assert est.micro_batch_tokens(packed, 16) == 16 * 512
    assert est.micro_batch_tokens(shared, 16) == 2 * 256 + 16 * 256
    shape = est.ModelShape("q", 896, 24, 14, 2, 4864, 49152, True)
    settings = est.Placement(actor_micro_batch=16, logprob_micro_batch=16)
    a, b = (est.estimate_memory(shape, w, settings)["breakdown"] for w in (packed, shared))
    # activations scale with the tokens through the layers (4608 of 8192), plus what every layer's attention keeps
    # of its gathered sequences
    gathered = shape.num_layers * est.shared_attention_bytes(shape, shared, 16, 4)
    assert gathered > 0
    assert (b["actor_update"]["activations"] - gathered) * 8192 == a["actor_update"]["activations"] * 4608
    assert b["old_log_prob"]["activations"] < a["old_log_prob"]["activations"]
    assert b["rollout"] == a["rollout"]  # generation holds every row's prompt in its cache either way
