"""Recipe variants (issue 18) against hand-computed numbers: GSPO's sequence-level ratio, DAPO's group filter and
overlong penalty, truncated-response detection."""

import math

import pytest
import torch

from rlanywhere import algorithms as A

from .test_algorithms import close


# ---------------------------------------------------------------- GSPO


def _gspo_case():
    # row 0: token log-ratios 0.1, 0.2, 0.3 -> mean 0.2, s0 = e^0.2 = 1.2214, A = +1
    # row 1: token log-ratios -0.1, 0.1 (then padding) -> mean 0, s1 = 1, A = -1
    old = torch.zeros(2, 3)
    logprob = torch.tensor([[0.1, 0.2, 0.3], [-0.1, 0.1, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return old, logprob, adv, mask


def test_gspo_sequence_ratio_clips_whole_sequences():
    old, logprob, adv, mask = _gspo_case()
    # row 0: max(-1.2214, -1.2) = -1.2 (clipped at 1 + 0.2) on all 3 tokens; row 1: max(1, 1) = 1 on 2 tokens
    # per sequence (GSPO's own aggregation, as verl): (-1.2 + 1) / 2 = -0.1
    loss, metrics = A.gspo_policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    close(loss, -0.1)
    close(metrics["pg_clipfrac"], 3 / 5)  # the three tokens of the clipped sequence
    close(metrics["ratio_mean"], (math.exp(0.2) + 1.0) / 2)
    close(metrics["ratio_max"], math.exp(0.2))
    close(metrics["ppo_kl"], -(0.1 + 0.2 + 0.3 - 0.1 + 0.1) / 5)
    assert metrics["pg_clipfrac_lower"] == 0.0
    # the clipped sequence passes no gradient; row 1's tokens get d(-A s)/dlogprob_t = s1 = 1, / 2 tokens / 2 rows
    loss.backward()
    close(logprob.grad, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]])


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_gspo_averages_per_sequence_whatever_loss_agg_mode_says(mode):
    """verl's GSPO aggregates its policy loss seq-mean-token-mean whatever loss_agg_mode is (the paper's mean).
    Ratio 1, a one-token row with A = +1 and a three-token row with A = -1: the two rows cancel, per sequence."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    logprob = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0, 0.0, 0.0], [-1.0, -1.0, -1.0]])
    loss, _ = A.gspo_policy_loss(logprob.detach(), logprob, adv, mask, 0.2, 0.2, loss_agg_mode=mode)
    close(loss, 0.0)  # token-mean would give (-1 + 3) / 4 = 0.5
    loss.backward()
    close(logprob.grad, [[-0.5, 0.0, 0.0], [1 / 6, 1 / 6, 1 / 6]])


def test_gspo_differs_from_token_ppo_on_the_same_numbers():
    # vanilla PPO clips token by token: row 0 keeps e^0.1 = 1.105 unclipped, clips 1.2214 and 1.3499 to 1.2
    old, logprob, adv, mask = _gspo_case()
    ppo, _ = A.ppo_policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    close(ppo, (-math.exp(0.1) - 1.2 - 1.2 + math.exp(-0.1) + math.exp(0.1)) / 5)
    gspo, _ = A.gspo_policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    assert abs(ppo.item() - gspo.item()) > 0.01


def test_gspo_seq_mean_token_mean_and_asymmetric_clip():
    old, logprob, adv, mask = _gspo_case()
    # clip_ratio_high 0.28 leaves s0 = 1.2214 unclipped: row 0 mean -1.2214, row 1 mean 1 -> (-1.2214 + 1) / 2
    loss, metrics = A.gspo_policy_loss(old, logprob, adv, mask, 0.2, 0.28, loss_agg_mode="seq-mean-token-mean")
    close(loss, (-math.exp(0.2) + 1.0) / 2)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    # GSPO's gradient: -A_i * s_i / |y_i| / N per token: row 0: -1.2214 / 3 / 2, row 1: +1 / 2 / 2
    close(logprob.grad, [[-math.exp(0.2) / 6] * 3, [0.25, 0.25, 0.0]])


def test_gspo_at_ratio_one_is_the_sequence_mean_policy_gradient():
    """On-policy (ratio 1) GSPO with per-sequence averaging has the gradient of -mean_i A_i mean_t logprob_it."""
    gen = torch.Generator().manual_seed(0)
    logprob = torch.randn(3, 4, generator=gen).requires_grad_(True)
    reference = logprob.detach().clone().requires_grad_(True)
    adv = torch.tensor([1.5, -0.5, 2.0]).unsqueeze(-1).expand(3, 4)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    loss, _ = A.gspo_policy_loss(logprob.detach(), logprob, adv, mask, 3e-4, 4e-4,
                                 loss_agg_mode="seq-mean-token-mean")
    loss.backward()
    maskf = mask.float()
    (-(adv * reference * maskf).sum(-1) / maskf.sum(-1)).mean().backward()
    torch.testing.assert_close(logprob.grad, reference.grad)


def test_policy_losses_share_one_signature():
    old, logprob, adv, mask = _gspo_case()
    scale = A.LossScale.of(mask)
    for name, fn in A.POLICY_LOSSES.items():
        loss, metrics = fn(old, logprob, adv, mask, 0.2, 0.28, 3.0, "token-mean", scale)
        assert loss.dim() == 0 and {"pg_clipfrac", "ppo_kl", "ratio_mean"} <= set(metrics), name
    assert set(A.POLICY_LOSSES) == {"vanilla", "gspo", "gpg", "cispo", "geo_mean"}


# ---------------------------------------------------------------- DAPO dynamic sampling


def test_informative_groups_drops_groups_with_equal_metric():
    # groups: a = [1, 1] all correct, b = [0, 1] mixed, c = [0, 0] all wrong, d = [0.5] alone
    metric = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = ["a", "a", "b", "b", "c", "c", "d"]
    keep = A.informative_groups(metric, groups)
    assert keep.tolist() == [False, False, True, True, False, False, True]


def test_informative_groups_compares_exactly_and_checks_lengths():
    # any difference keeps the group (partial credit 0.5 vs 0.5 + 1e-6); three equal thirds are dropped
    assert A.informative_groups(torch.tensor([0.5, 0.5 + 1e-6]), [0, 0]).tolist() == [True, True]
    assert A.informative_groups([1 / 3, 1 / 3, 1 / 3], torch.tensor([4, 4, 4])).tolist() == [False] * 3
    with pytest.raises(ValueError, match="group_index has 2 entries"):
        A.informative_groups(torch.tensor([1.0, 0.0, 1.0]), [0, 0])


# ---------------------------------------------------------------- DAPO overlong reward shaping


def test_overlong_penalty_is_linear_inside_the_buffer():
    # limit 20, buffer 8: free up to 12 tokens, then -1/8 per token down to -1 at 20 (factor 1); factor 0.5 halves
    lengths = torch.tensor([5, 12, 13, 16, 20])
    close(A.overlong_penalty(lengths, 20, 8), [0.0, 0.0, -0.125, -0.5, -1.0])
    close(A.overlong_penalty(lengths, 20, 8, penalty_factor=0.5), [0.0, 0.0, -0.0625, -0.25, -0.5])
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        A.overlong_penalty(lengths, 20, 0)
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        A.overlong_penalty(lengths, 20, 21)


# ---------------------------------------------------------------- truncated responses


def test_truncated_rows_hit_the_limit_without_eos():
    eos, pad = 9, 0
    ids = torch.tensor([[4, 5, 6], [4, 5, 9], [4, 9, pad], [7, pad, pad]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    # row 0: 3 tokens = limit, last is not EOS -> cut off; row 1 ended on EOS exactly at the limit; rows 2-3 short
    assert A.truncated_rows(ids, mask, 3, [eos]).tolist() == [True, False, False, False]
    assert A.truncated_rows(ids, mask, 4, [eos]).tolist() == [False] * 4


# ---------------------------------------------------------------- config keys


def test_variant_keys_in_verl_names():
    from rlanywhere.config import load_config

    notices = []
    cfg = load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                             "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                             "algorithm.filter_groups.max_num_gen_batches=0", "data.gen_batch_size=96",
                             "+reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=128",
                             "reward_model.overlong_buffer.penalty_factor=0.5", "reward_model.overlong_buffer.log=true",
                             "algorithm.mask_truncated_completions=true"], notices=notices)
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    assert cfg.algorithm.filter_groups.metric == "score" and cfg.data.gen_batch_size == 96
    assert cfg.reward_model.overlong_buffer.len == 128 and cfg.algorithm.mask_truncated_completions is True
    assert any("overlong_buffer.log" in line for line in notices)  # accepted with a notice: always logged here


@pytest.mark.parametrize("overrides,expected", [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=nope"], "choose one of vanilla, gspo, gpg, cispo, geo_mean"),
    (["data.gen_batch_size=8"], "algorithm.filter_groups.enable=true"),
    (["algorithm.filter_groups.enable=true", "data.gen_batch_size=0"], "must be positive"),
    (["reward_model.overlong_buffer.enable=true"], "reward_model.overlong_buffer.len=128"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=600"], "must be in 1..512"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=64",
      "reward_model.overlong_buffer.penalty_factor=-1"], "penalty_factor must be >= 0"),
])
def test_variant_keys_bad_values_name_the_fix(overrides, expected):
    from rlanywhere.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)


def test_joined_rollouts_fill_the_reward_numbers_a_part_lacks():
    """A number the reward returned in one round only counts 0 in the other round's rows (as within one reward
    call); counts add up; filter_groups.metric=score compares the reward's own scores, not ones recovered from the
    overlong-shaped score (0.1 + penalty - penalty is not 0.1 in float32)."""
    from types import SimpleNamespace

    from rlanywhere.config import load_config
    from rlanywhere.rollout.base import RolloutBatch
    from rlanywhere.rollout_phase import RolloutPhase
    from rlanywhere.stepbatch import ScoredRollout

    def part(info, scores):
        ids = torch.ones(2, 2, dtype=torch.long)
        rollout = RolloutBatch(prompt_ids=ids, prompt_mask=torch.ones(2, 2), response_ids=ids,
                               response_mask=torch.ones(2, 2), response_logprobs=torch.zeros(2, 2), num_prompts=1, n=2)
        return ScoredRollout([{"index": 0}], rollout, torch.tensor(scores), info)

    first = part({"acc": [1.0, 0.0], "parsed": [3.0, 4.0], "num_errors": 1}, [1.0, 0.0])
    second = part({"acc": [0.0, 0.0], "num_errors": 2}, [0.0, 0.0])
    for parts, parsed in (([first, second], [3.0, 4.0, 0.0, 0.0]), ([second, first], [0.0, 0.0, 3.0, 4.0])):
        joined = ScoredRollout.concat(parts, pad_token_id=0)
        assert joined.info["parsed"] == parsed and joined.info["num_errors"] == 3
    cfg = load_config(None, ["algorithm.filter_groups.metric=score"])
    penalty = A.overlong_penalty(torch.tensor([50, 60]), 64, 16, 1.0)
    shaped = part({"score": [0.1, 0.1], "overlong_penalty": penalty.tolist()}, (0.1 + penalty).float().tolist())
    phase = SimpleNamespace(cfg=cfg, reward_keys_seen=set())
    assert RolloutPhase.filter_metric(phase, shaped).tolist() == [pytest.approx(0.1)] * 2
    assert len(set(RolloutPhase.filter_metric(phase, shaped).tolist())) == 1  # one group value: not informative
