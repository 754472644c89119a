"""Model FLOPs and MFU (flops.py) against hand-computed counts on a tiny shape."""

import pytest

from rlanywhere.flops import card_key, mfu, peak_flops, phase_mfus, sequence_forward_flops, step_forward_flops
from rlanywhere.model_shape import ModelShape

# hidden 4, 1 layer, 2 heads of 2 (q_dim 4), 1 KV head (kv_dim 2), intermediate 8, vocab 10.
# Linear weights per layer: q 16 + k 8 + v 8 + o 16 + gate 32 + up 32 + down 32 = 144 -> 288 FLOPs a token;
# LM head 2 * 4 * 10 = 80 a token; attention 4 * q_dim = 16 a (query, key) pair.
TINY = ModelShape("tiny", 4, 1, 2, 1, 8, 10, True)


def test_a_causal_sequence_counts_its_linear_layers_head_and_attention_pairs():
    # 3 tokens: 3 * (288 + 80) + 16 * (1 + 2 + 3) pairs
    assert sequence_forward_flops(TINY, 3) == 3 * 368 + 16 * 6
    assert sequence_forward_flops(TINY, 3, lm_head=False) == 3 * 288 + 16 * 6
    # the same 3 tokens after a context of 2 see 2 more keys each: 6 + 6 pairs
    assert sequence_forward_flops(TINY, 3, context=2) == 3 * 368 + 16 * 12


def test_a_shared_prompt_counts_once_per_group_and_the_head_runs_on_responses_only():
    # 4 rows in 2 groups, prompt 2, response 3; the LM head (80 a token) on the 3 response tokens of each row only
    shared = step_forward_flops(TINY, rows=4, prompt_len=2, response_len=3, groups=2)
    assert shared == 2 * (2 * 288 + 16 * 3) + 4 * (3 * 288 + 16 * 12) + 4 * 3 * 80
    whole = step_forward_flops(TINY, rows=4, prompt_len=2, response_len=3)
    assert whole == 4 * (5 * 288 + 16 * 15) + 4 * 3 * 80
    assert shared < whole


@pytest.mark.parametrize("name,key", [("NVIDIA H200", "h200"), ("Tesla P40", "p40"),
                                      ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A10", "a10"),
                                      ("NVIDIA GeForce RTX 3090", "rtx3090"), ("Tesla V100-SXM2-16GB", "v100"),
                                      ("NVIDIA L4", "l4"), ("NVIDIA H100 80GB HBM3", "h100"),
                                      ("AMD Instinct MI300X", None)])
def test_device_names_map_to_their_card(name, key):
    assert card_key(name) == key


def test_peaks_are_known_per_precision_and_unknown_ones_are_none():
    assert peak_flops("NVIDIA H200", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("h200", "fp32") == pytest.approx(66.9e12)  # TF32 off: the P40 path's reference
    assert peak_flops("Tesla P40", "bf16") is None  # no bf16 on Pascal
    assert mfu(1e12, 2.0, 1e12) == 0.5
    assert mfu(1e12, 2.0, None) is None


def test_phase_mfus_of_a_metrics_record():
    # 4 rows, response 3, 20 tokens in all -> prompt 2 a row; ungrouped; one epoch; peak 1000 FLOP/s
    record = {"perf/tokens_per_s": 10.0, "perf/step_time_s": 2.0, "response_length/mean": 3.0,
              "timing/old_log_prob": 8.32, "timing/update_actor": 24.96, "timing/values": 1.0}
    out = phase_mfus(record, TINY, rows=4, groups=None, ppo_epochs=2, peak=1000.0)
    forward = 4 * (5 * 288 + 16 * 15) + 4 * 3 * 80  # 7680: the head on the response tokens only
    assert out["mfu/old_log_prob"] == pytest.approx(forward / 8.32 / 1000)
    assert out["mfu/update_actor"] == pytest.approx(2 * 3 * forward / 24.96 / 1000)
    critic_forward = 4 * (5 * 288 + 16 * 15)  # no LM head
    assert out["mfu/values"] == pytest.approx(critic_forward / 1.0 / 1000)
    assert "mfu/update_critic" not in out
