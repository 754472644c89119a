"""Tests for rlanywhere.algorithms against hand-computed numbers (worked out in the comments)."""

import math

import pytest
import torch

from rlanywhere import algorithms as A


def close(actual, expected, atol=1e-6):
    expected = torch.as_tensor(expected, dtype=actual.dtype) if isinstance(actual, torch.Tensor) else expected
    if isinstance(actual, torch.Tensor):
        torch.testing.assert_close(actual, expected, atol=atol, rtol=0)
    else:
        assert actual == pytest.approx(expected, abs=atol)


# ---------------------------------------------------------------- masked statistics

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


def test_masked_sum_mean_var():
    # real values 1, 2, 4: sum 7, mean 7/3
    close(A.masked_sum(X, M), 7.0)
    close(A.masked_mean(X, M), 7 / 3)
    close(A.masked_sum(X, M, dim=-1), [3.0, 4.0])
    close(A.masked_mean(X, M, dim=-1), [1.5, 4.0])
    # deviations -4/3, -1/3, 5/3 -> squares sum 42/9; unbiased /2 = 7/3, biased /3 = 14/9
    close(A.masked_var(X, M), 7 / 3)
    close(A.masked_var(X, M, unbiased=False), 14 / 9)
    # float mask behaves like the bool mask
    close(A.masked_mean(X, M.float()), 7 / 3)


def test_masked_mean_empty_row_is_zero():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(A.masked_mean(X, mask, dim=-1), [1.5, 0.0])


def test_masked_whiten():
    out = A.masked_whiten(X, M)
    std = math.sqrt(7 / 3)
    close(out[0, 0], (1 - 7 / 3) / std, atol=1e-5)
    close(out[0, 1], (2 - 7 / 3) / std, atol=1e-5)
    close(out[1, 0], (4 - 7 / 3) / std, atol=1e-5)
    unshifted = A.masked_whiten(X, M, shift_mean=False)
    close(unshifted[1, 0], (4 - 7 / 3) / std + 7 / 3, atol=1e-5)


def test_masked_var_needs_two_elements():
    with pytest.raises(ValueError, match="at least 2"):
        A.masked_var(X, torch.tensor([[1, 0, 0], [0, 0, 0]]))


def test_mask_shape_mismatch_is_clear():
    with pytest.raises(ValueError, match="mask shape"):
        A.masked_mean(X, torch.ones(3, 3))


# ---------------------------------------------------------------- scores -> token rewards


def test_scores_to_token_rewards_last_real_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]])  # right-, un- and left-padded rows
    out = A.scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    close(out, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 3.0]])


def test_scores_to_token_rewards_empty_row_raises():
    with pytest.raises(ValueError, match="no real token"):
        A.scores_to_token_rewards(torch.tensor([1.0, 2.0]), torch.tensor([[1, 0], [0, 0]]))


# ---------------------------------------------------------------- GAE


def test_gae_hand_computed_with_padding():
    # gamma = lam = 0.5, rewards [0, 0, 1], values [0.5, 0.25, 0.5]:
    # t=2: delta = 1 + 0 - 0.5 = 0.5,              A2 = 0.5
    # t=1: delta = 0 + 0.5*0.5 - 0.25 = 0,          A1 = 0 + 0.25*0.5 = 0.125
    # t=0: delta = 0 + 0.5*0.25 - 0.5 = -0.375,     A0 = -0.375 + 0.25*0.125 = -0.34375
    # returns = A + V = [0.15625, 0.375, 1.0]
    # row 1 is the same trajectory right-padded, row 2 has a padding hole at t=1; garbage (7, 9) at padding
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 1.0, 7.0], [0.0, 7.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.5, 0.0], [0.5, 0.25, 0.5, 9.0], [0.5, 9.0, 0.25, 0.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 0, 1, 1]])
    advantages, returns = A.compute_gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    raw = [-0.34375, 0.125, 0.5]
    close(returns[0], [0.15625, 0.375, 1.0, 0.0])
    close(returns[1], [0.15625, 0.375, 1.0, 0.0])
    close(returns[2], [0.15625, 0.0, 0.375, 1.0])
    # whitening over all 9 real tokens (three copies of raw): mean m, unbiased std s
    m = sum(raw) / 3
    s = math.sqrt(3 * sum((a - m) ** 2 for a in raw) / 8)
    white = [(a - m) / s for a in raw]
    close(advantages[0], white + [0.0], atol=1e-5)
    close(advantages[1], white + [0.0], atol=1e-5)
    close(advantages[2], [white[0], 0.0, white[1], white[2]], atol=1e-5)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    # gamma = lam = 1: A_t = sum_{k>=t} r_k - V_t -> rewards [1, 0, 2], values [0, 1, 0.5] -> A = [3, 1, 1.5]
    rewards = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 1.0]])
    values = torch.tensor([[0.0, 1.0, 0.5], [0.0, 0.0, 0.0]])
    mask = torch.ones(2, 3)
    _, returns = A.compute_gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    # returns = A + V = reward-to-go = [3, 2, 2] and [1, 1, 1]
    close(returns, [[3.0, 2.0, 2.0], [1.0, 1.0, 1.0]])


# ---------------------------------------------------------------- GRPO / RLOO


def test_grpo_hand_computed():
    # group "a": scores 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(4*0.25/3) = sqrt(1/3)
    # group "b": single response -> mean 0, std 1 (verl): 5 / (1 + eps); group "c": 2, 2 -> std 0 -> 0/(0+eps) = 0
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 2.0, 2.0])
    groups = ["a", "a", "a", "a", "b", "c", "c"]
    mask = torch.tensor([[1, 1, 0]] * 7)
    advantages, returns = A.compute_grpo_advantages(scores, groups, mask)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    expected_seq = [a, -a, -a, a, 5.0 / (1 + 1e-6), 0.0, 0.0]
    close(advantages, [[v, v, 0.0] for v in expected_seq], atol=1e-5)
    assert torch.equal(advantages, returns)

    plain, _ = A.compute_grpo_advantages(scores, torch.tensor([0, 0, 0, 0, 1, 2, 2]), mask, norm_by_std=False)
    close(plain[:, 0], [0.5, -0.5, -0.5, 0.5, 5.0, 0.0, 0.0])


def test_grpo_accepts_int_scores_and_token_rewards():
    mask = torch.tensor([[1, 1], [1, 0]])
    from_int, _ = A.compute_grpo_advantages(torch.tensor([1, 0]), [0, 0], mask)
    from_tokens, _ = A.compute_grpo_advantages(torch.tensor([[0.0, 1.0], [0.0, 5.0]]), [0, 0], mask)
    # both are scores [1, 0]: mean 0.5, std sqrt(0.5) -> +-0.5/sqrt(0.5) = +-0.7071
    close(from_int, [[0.70710, 0.70710], [-0.70710, 0.0]], atol=1e-4)
    close(from_tokens, from_int)


def test_rloo_hand_computed():
    # group 0: scores 1, 0, 0, 1: row 0 -> 1 - mean(0, 0, 1) = 2/3, row 1 -> 0 - mean(0, 1, 1) = -2/3
    # group 1: single -> its raw score 3 (verl); group 2: 1, 4 -> 1 - 4 = -3, 4 - 1 = 3
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 4.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 2, 2])
    mask = torch.tensor([[1, 0]] * 7)
    advantages, returns = A.compute_rloo_advantages(scores, groups, mask)
    close(advantages[:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3, 3.0, -3.0, 3.0])
    close(advantages[:, 1], [0.0] * 7)
    assert torch.equal(advantages, returns)


def test_group_index_length_mismatch():
    with pytest.raises(ValueError, match="group_index"):
        A.compute_rloo_advantages(torch.tensor([1.0, 0.0]), [0], torch.ones(2, 2))


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_hand_computed():
    # gamma 0.5; row 0 rewards [0, 0, 1] -> returns [0.25, 0.5, 1]; row 1 [0, 2, pad] -> [1, 2, 0]
    # real returns 0.25, 0.5, 1, 1, 2: mean 0.95, deviations -0.7 -0.45 0.05 0.05 1.05,
    # squared sum 1.8, unbiased var 0.45
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    advantages, returns = A.compute_reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    close(returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    s = math.sqrt(0.45)
    close(advantages, [[-0.7 / s, -0.45 / s, 0.05 / s], [0.05 / s, 1.05 / s, 0.0]], atol=1e-5)


def test_reinforce_plus_plus_baseline_hand_computed():
    # groups: rows 0, 1 -> scores 1, 0 (mean 0.5); rows 2, 3 -> 3, 3 (mean 3)
    # centred: 0.5, -0.5, 0, 0; lengths 2, 1, 2, 1 -> real tokens 0.5, 0.5, -0.5, 0, 0, 0
    # mean 1/12; deviations 5/12, 5/12, -7/12, -1/12 x3; squared sum (25+25+49+3)/144 = 102/144; var / 5
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0]])
    advantages, returns = A.compute_reinforce_plus_plus_baseline_advantages(scores, [7, 7, 9, 9], mask)
    s = math.sqrt(102 / 144 / 5)
    expected = [[5 / 12 / s, 5 / 12 / s], [-7 / 12 / s, 0.0], [-1 / 12 / s, -1 / 12 / s], [-1 / 12 / s, 0.0]]
    close(advantages, expected, atol=1e-5)
    assert torch.equal(advantages, returns)
    # token rewards (summed per row) give the same thing
    token_rewards = A.scores_to_token_rewards(scores, mask)
    close(A.compute_reinforce_plus_plus_baseline_advantages(token_rewards, [7, 7, 9, 9], mask)[0], advantages)


def test_reinforce_plus_plus_baseline_discount():
    # gamma 0.5: row 0 centred score 0.5 on its last token -> returns [0.25, 0.5]; row 1 -0.5 -> [-0.5]
    # real tokens 0.25, 0.5, -0.5: mean 1/12, deviations 2/12, 5/12, -7/12, squares (4+25+49)/144, var /2
    mask = torch.tensor([[1, 1], [1, 0]])
    advantages, _ = A.compute_reinforce_plus_plus_baseline_advantages(torch.tensor([1.0, 0.0]), [0, 0], mask, gamma=0.5)
    s = math.sqrt(78 / 144 / 2)
    close(advantages, [[2 / 12 / s, 5 / 12 / s], [-7 / 12 / s, 0.0]], atol=1e-5)


# ---------------------------------------------------------------- dispatcher


def test_compute_advantages_dispatch():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    groups = [0, 0, 1, 1]
    for name, direct in [
        ("grpo", A.compute_grpo_advantages(scores, groups, mask)),
        ("rloo", A.compute_rloo_advantages(scores, groups, mask)),
        ("reinforce_plus_plus_baseline", A.compute_reinforce_plus_plus_baseline_advantages(scores, groups, mask)),
    ]:
        out = A.compute_advantages(name, scores=scores, mask=mask, group_index=groups)
        close(out[0], direct[0])
        close(out[1], direct[1])
    token_rewards = A.scores_to_token_rewards(scores, mask)
    rpp = A.compute_advantages("reinforce_plus_plus", scores=scores, mask=mask, gamma=0.9)
    close(rpp[0], A.compute_reinforce_plus_plus_advantages(token_rewards, mask, 0.9)[0])
    values = torch.full((4, 3), 0.1)
    gae = A.compute_advantages("gae", token_rewards=token_rewards, values=values, mask=mask, gamma=0.9, lam=0.8)
    close(gae[1], A.compute_gae_advantages(token_rewards, values, mask, 0.9, 0.8)[1])
    assert set(A.ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                                           "remax", "gpg"}


def test_compute_advantages_outcome_uses_token_rewards_when_given():
    # token rewards include a KL penalty: row sums 0.5 and -0.5 -> RLOO gives +1, -1 (scores alone would give 0)
    mask = torch.ones(2, 2)
    token_rewards = torch.tensor([[0.0, 0.5], [-0.5, 0.0]])
    adv, _ = A.compute_advantages("rloo", scores=torch.tensor([1.0, 1.0]), token_rewards=token_rewards, mask=mask,
                                  group_index=[0, 0])
    close(adv, [[1.0, 1.0], [-1.0, -1.0]])


def test_compute_advantages_errors():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="grpo.*rloo|valid"):
        A.compute_advantages("ppo", scores=torch.ones(2), mask=mask)
    with pytest.raises(ValueError, match="critic values"):
        A.compute_advantages("gae", scores=torch.ones(2), mask=mask)
    with pytest.raises(ValueError, match="group_index"):
        A.compute_advantages("grpo", scores=torch.ones(2), mask=mask)


# ---------------------------------------------------------------- KL


def test_kl_estimators_hand_computed():
    # pi = 0.5, pi_ref = 0.25: log ratio = ln 2
    logprob = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    ln2 = math.log(2)
    for kind in ("kl", "k1"):
        close(A.kl_penalty(logprob, ref, kind), [ln2])
    close(A.kl_penalty(ref, logprob, "abs"), [ln2])
    for kind in ("mse", "k2"):
        close(A.kl_penalty(logprob, ref, kind), [0.5 * ln2**2])
    # k3: r = pi_ref/pi = 0.5 -> r - ln r - 1 = 0.5 + ln 2 - 1
    for kind in ("low_var_kl", "k3"):
        close(A.kl_penalty(logprob, ref, kind), [ln2 - 0.5])


def test_k3_is_clamped():
    # ref far above policy: r = exp(20 after clamp) -> huge -> clamped to 10
    close(A.kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "k3"), [10.0])


def test_kl_straight_through_gradient_is_k2():
    logprob = torch.tensor([math.log(0.5)], requires_grad=True)
    ref = torch.tensor([math.log(0.25)])
    value = A.kl_penalty(logprob, ref, "k3+")
    close(value.detach(), [math.log(2) - 0.5])
    value.sum().backward()
    close(logprob.grad, [math.log(2)])  # d/dlogprob 0.5 (logprob - ref)^2


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="low_var_kl"):
        A.kl_penalty(torch.zeros(1), torch.zeros(1), "full")


def test_kl_controllers():
    adaptive = A.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=100)
    adaptive.update(current_kl=0.2, n_steps=10)  # error clip(1, +-0.2) = 0.2 -> x(1 + 0.2*10/100) = 0.102
    close(adaptive.value, 0.102)
    adaptive.update(current_kl=0.09, n_steps=10)  # error -0.1 -> x(1 - 0.01) = 0.10098
    close(adaptive.value, 0.10098)
    # a resume: the adapted coefficient goes on; target and horizon are the (possibly changed) configuration's
    restored = A.AdaptiveKLController(1.0, 0.5, 50.0)
    restored.load_state_dict(adaptive.state_dict())
    assert (restored.value, restored.target, restored.horizon) == (adaptive.value, 0.5, 50.0)

    fixed = A.make_kl_controller("fixed", kl_coef=0.3)
    fixed.update(5.0, 100)
    assert fixed.value == 0.3
    other = A.FixedKLController(0.05)  # a resume with another algorithm.kl_ctrl.kl_coef: the new one is used
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05
    assert isinstance(A.make_kl_controller("adaptive", 0.1, 0.1, 100), A.AdaptiveKLController)
    with pytest.raises(ValueError, match="adaptive"):
        A.make_kl_controller("pid")


def test_apply_kl_in_reward():
    # kind kl, beta 0.5, log ratios [[.1 .2 .3], [.4 .5 pad]]:
    # rewards = scores - 0.5 * kl -> [[-.05, -.1, .85], [-.2, .75, 0]]; row KL means .2 and .45 -> batch .325
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    logprob = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    ref = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    ctrl = A.AdaptiveKLController(0.5, target_kl=0.25, horizon=20)
    rewards, metrics = A.apply_kl_in_reward(scores, logprob, ref, mask, ctrl, kind="kl")
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 0.75, 0.0]])
    close(metrics["actor/reward_kl_penalty"], 0.325)
    close(metrics["actor/reward_kl_penalty_coeff"], 0.5)
    # error clip(.325/.25 - 1) = 0.2 -> x(1 + 0.2*2/20) = 0.51
    close(ctrl.value, 0.51)


def test_adaptive_kl_trajectory_follows_verls_rule():
    # verl: beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon, with kl the batch mean of each
    # sequence's mean KL and n_steps the number of rows. Row A has 1 token, row B 3: the sequence mean differs
    # from the token mean, so feeding the wrong one shows.
    ctrl = A.AdaptiveKLController(0.1, target_kl=0.05, horizon=10)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    scores = torch.zeros(2, 3)
    ref = torch.zeros(2, 3)
    steps = [  # (log-probs, expected per-sequence-mean KL, expected beta after the step)
        (torch.tensor([[0.2, 9.0, 9.0], [0.0, 0.0, 0.0]]), 0.1, 0.1 * 1.04),  # kl/target - 1 = 1 -> +0.2 * 2/10
        (torch.tensor([[0.1, 9.0, 9.0], [0.0, 0.0, 0.0]]), 0.05, 0.104),  # on target: unchanged
        (torch.tensor([[0.0, 9.0, 9.0], [0.03, 0.03, 0.03]]), 0.015, 0.104 * (1 - 0.2 * 2 / 10)),  # clipped at -0.2
    ]
    for logprob, kl, beta_after in steps:
        beta_before = ctrl.value
        _, metrics = A.apply_kl_in_reward(scores, logprob, ref, mask, ctrl, kind="kl")
        close(metrics["actor/reward_kl_penalty"], kl)
        close(metrics["actor/reward_kl_penalty_coeff"], beta_before)
        close(ctrl.value, beta_after)


# ---------------------------------------------------------------- aggregation


LOSS = torch.tensor([[1.0, 2.0, 3.0, 0.5], [4.0, 5.0, 6.0, 0.5], [9.0, 9.0, 9.0, 9.0]])
LOSS_MASK = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])  # last row empty


def test_aggregate_loss_modes():
    # real: row0 1, 2 (sum 3, mean 1.5); row1 4 (sum 4, mean 4); row2 empty (left out of sequence means)
    close(A.aggregate_loss(LOSS, LOSS_MASK, "token-mean"), 7 / 3)
    close(A.aggregate_loss(LOSS, LOSS_MASK, "seq-mean-token-mean"), (1.5 + 4) / 2)
    close(A.aggregate_loss(LOSS, LOSS_MASK, "seq-mean-token-sum"), (3 + 4) / 2)
    # Dr. GRPO / verl >= #5417: mean over the 2 sequences of (token sum / T), T = width 4 -> (3/4 + 4/4) / 2
    close(A.aggregate_loss(LOSS, LOSS_MASK, "seq-mean-token-sum-norm"), 7 / 8)
    # T is the run's configured response length, not the tensor's width
    scale = A.LossScale.of(LOSS_MASK, norm_length=10)
    close(A.aggregate_loss(LOSS, LOSS_MASK, "seq-mean-token-sum-norm", scale), (3 / 10 + 4 / 10) / 2)
    with pytest.raises(ValueError, match="token-mean"):
        A.aggregate_loss(LOSS, LOSS_MASK, "mean")


def test_seq_mean_token_sum_norm_is_a_mean_over_sequences():
    # issue 19's case: B = 2 one-token rows, T = 1; the sum over all tokens / T (the old formula) is N = 2 times
    # too large: -0.5836 instead of verl's -0.2918.
    loss = torch.tensor([[-0.3], [-0.2836]])
    mask = torch.ones(2, 1)
    close(A.aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), -0.2918)
    # rows of different lengths, T = 3: row sums 0.6 and -0.9 -> (0.6/3 - 0.9/3) / 2 = -0.05
    loss = torch.tensor([[0.1, 0.2, 0.3], [-0.9, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    close(A.aggregate_loss(loss, mask, "seq-mean-token-sum-norm"), -0.05)


def test_loss_scale_counts_tokens_sequences_and_merges():
    scale = A.LossScale.of(LOSS_MASK)
    assert (scale.tokens, scale.sequences, scale.norm_length) == (3.0, 2.0, 4.0)
    merged = A.LossScale.of(LOSS_MASK[:1]).merged(A.LossScale.of(LOSS_MASK[1:]))
    assert merged == scale
    with pytest.raises(ValueError, match="norm_length"):
        scale.merged(A.LossScale.of(LOSS_MASK, norm_length=9))


@pytest.mark.parametrize("mode", A.LOSS_AGG_MODES)
def test_aggregate_loss_with_the_mini_batch_scale_sums_over_any_split(mode):
    scale = A.LossScale.of(LOSS_MASK)
    whole = A.aggregate_loss(LOSS, LOSS_MASK, mode)
    for split in ([0, 1, 2], [0, 2], [1]):  # row slices: singles, pairs, all
        parts, start = [], 0
        for end in split + [3]:
            if end > start:
                parts.append(A.aggregate_loss(LOSS[start:end], LOSS_MASK[start:end], mode, scale))
            start = end
        close(sum(parts), whole)


# ---------------------------------------------------------------- PPO policy loss


def _ppo_case():
    # ratios 1.5, 0.5, 1.1, 5.0 (+ a padded token with a wild ratio), advantages +1, -1, +1, -1, clip 0.2, c = 3
    ratios = torch.tensor([[1.5, 0.5, 1.1, 5.0, 100.0]])
    logprob = torch.log(ratios).requires_grad_(True)
    old = torch.zeros(1, 5)
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return old, logprob, adv, mask, ratios


def test_ppo_policy_loss_hand_computed():
    old, logprob, adv, mask, ratios = _ppo_case()
    # t0 A=+1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped)
    # t1 A=-1 r=0.5: max(0.5, 0.8) = 0.8 (clipped), dual bound 3 -> 0.8
    # t2 A=+1 r=1.1: max(-1.1, -1.1) = -1.1 (not clipped)
    # t3 A=-1 r=5.0: max(5, 1.2) = 5 -> dual clip min(5, 3) = 3
    # token mean (-1.2 + 0.8 - 1.1 + 3) / 4 = 0.375
    loss, metrics = A.ppo_policy_loss(old, logprob, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    close(loss, 0.375)
    close(metrics["pg_clipfrac"], 0.5)
    close(metrics["pg_clipfrac_lower"], 0.25)
    expected_kl = -(math.log(1.5) + math.log(0.5) + math.log(1.1) + math.log(5.0)) / 4
    close(metrics["ppo_kl"], expected_kl)
    close(metrics["approx_kl"], expected_kl)
    # only the unclipped t2 passes gradient: d(-A r)/dlogprob = -A r = -1.1, / 4 tokens
    loss.backward()
    close(logprob.grad, [[0.0, 0.0, -1.1 / 4, 0.0, 0.0]])


def test_policy_and_value_metrics_stay_on_the_device_and_ignore_padding():
    """Metrics are 0-d tensors (the update reads them once per optimizer step, not once per micro-batch); the
    largest ratio is over real tokens only, even when every real ratio is below 1 and padding holds a larger one."""
    old = torch.zeros(2, 3)
    logprob = torch.log(torch.tensor([[0.5, 0.8, 9.0], [0.7, 9.0, 9.0]]))  # 9.0: padding positions
    adv, mask = torch.ones(2, 3), torch.tensor([[1, 1, 0], [1, 0, 0]])
    for loss_fn in A.POLICY_LOSSES.values():
        _, metrics = loss_fn(old, logprob, adv, mask, 0.2, 0.2)
        assert all(torch.is_tensor(v) and v.dim() == 0 for v in metrics.values()), metrics
    _, metrics = A.ppo_policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    close(metrics["ratio_max"], 0.8)
    close(metrics["ratio_mean"], (0.5 + 0.8 + 0.7) / 3)
    _, metrics = A.gspo_policy_loss(old, logprob, adv, mask, 0.2, 0.2)
    close(metrics["ratio_max"], 0.7)  # per sequence: row 0's geometric mean sqrt(0.5 * 0.8) = 0.632, row 1's 0.7
    close(metrics["ratio_mean"], (math.sqrt(0.5 * 0.8) + 0.7) / 2)
    nothing = torch.zeros(2, 3, dtype=torch.long)
    for loss_fn in A.POLICY_LOSSES.values():  # no real token at all: the largest ratio reads 1
        _, metrics = loss_fn(old, logprob, adv, nothing, 0.2, 0.2)
        close(metrics["ratio_max"], 1.0)
    _, metrics = A.value_loss(torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2, 3), mask, None)
    assert all(torch.is_tensor(v) and v.dim() == 0 for v in metrics.values())


def test_ppo_policy_loss_without_dual_clip_and_asymmetric():
    old, logprob, adv, mask, _ = _ppo_case()
    loss, metrics = A.ppo_policy_loss(old, logprob, adv, mask, 0.2, 0.2, clip_ratio_c=None)
    close(loss, (-1.2 + 0.8 - 1.1 + 5.0) / 4)  # t3 keeps 5
    assert metrics["pg_clipfrac_lower"] == 0.0
    # clip_ratio_high 0.28: t0 becomes max(-1.5, -1.28) = -1.28
    loss, _ = A.ppo_policy_loss(old, logprob, adv, mask, 0.2, 0.28)
    close(loss, (-1.28 + 0.8 - 1.1 + 3.0) / 4)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        A.ppo_policy_loss(old, logprob, adv, mask, clip_ratio_c=0.5)


def test_ppo_gradient_at_ratio_one_equals_reinforce():
    """At logprob == old_logprob the PPO gradient is the REINFORCE gradient of -mean(A * logprob)."""
    gen = torch.Generator().manual_seed(0)
    batch, length, vocab = 4, 5, 7
    logits_ppo = torch.randn(batch, length, vocab, generator=gen).requires_grad_(True)
    logits_pg = logits_ppo.detach().clone().requires_grad_(True)
    actions = torch.randint(0, vocab, (batch, length), generator=gen)
    advantages = torch.randn(batch, length, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])

    def token_logprob(logits):
        return torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)

    logprob = token_logprob(logits_ppo)
    loss, metrics = A.ppo_policy_loss(logprob.detach(), logprob, advantages, mask, 0.2, 0.2, 3.0, "token-mean")
    loss.backward()
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == 0.0

    # textbook REINFORCE surrogate, written out independently of the library
    maskf = mask.float()
    reinforce = -(advantages * token_logprob(logits_pg) * maskf).sum() / maskf.sum()
    reinforce.backward()
    torch.testing.assert_close(logits_ppo.grad, logits_pg.grad, atol=1e-6, rtol=1e-5)
    assert logits_pg.grad.abs().sum() > 0


# ---------------------------------------------------------------- value / entropy / KL losses


def test_value_loss_hand_computed():
    # t0 v=1 old=.5 R=2: clip v to [.3,.7] -> .7; max((1-2)^2, (.7-2)^2) = max(1, 1.69) = 1.69 (clipped)
    # t1 v=2 old=2 R=1: clip keeps 2 -> 1;  t2 v=0 old=0 R=.3 -> .09;  padded t3 ignored
    values = torch.tensor([[1.0, 2.0, 0.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.5, 2.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.3, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = A.value_loss(values, old, returns, mask, cliprange_value=0.2)
    close(loss, 0.5 * (1.69 + 1.0 + 0.09) / 3, atol=1e-5)
    close(metrics["vf_clipfrac"], 1 / 3)
    loss.backward()
    # t0 clipped -> no grad; t1: 0.5 * 2 (v - R) / 3 = 1/3; t2: (0 - .3)/3 = -0.1
    close(values.grad, [[0.0, 1 / 3, -0.1, 0.0]], atol=1e-6)
    unclipped, _ = A.value_loss(values, old, returns, mask, cliprange_value=None)
    close(unclipped, 0.5 * (1.0 + 1.0 + 0.09) / 3, atol=1e-5)


def test_entropy_and_kl_loss():
    entropy = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 0]])
    close(A.entropy_loss(entropy, mask, "token-mean"), 2.0)
    # k1 log ratios 0.2, 0.4 (padding 9 ignored) -> token mean 0.3; k2 -> 0.5 * (0.04 + 0.16) / 2 = 0.05
    logprob = torch.tensor([[0.2, 0.4, 9.0]])
    ref = torch.zeros(1, 3)
    close(A.kl_loss(logprob, ref, mask, "kl"), 0.3)
    close(A.kl_loss(logprob, ref, mask, "mse"), 0.05)


# ---------------------------------------------------------------- huge rewards


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"])
def test_huge_rewards_give_finite_advantages_with_the_right_shape(estimator):
    # Half the samples score 1e30 (a reward bug). In fp32 the group std overflowed: GRPO and REINFORCE++ gave
    # exactly 0 everywhere. Normalised estimators are scale-free: 1e30 x the rewards gives the same advantages.
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    unit = torch.tensor([1.0, 0.0, 1.0, 0.0])
    group = torch.tensor([0, 0, 1, 1])
    values = torch.zeros(4, 3)
    run = lambda scores: A.compute_advantages(estimator, scores=scores, mask=mask, group_index=group,  # noqa: E731
                                              values=values if estimator == "gae" else None)
    with pytest.warns(RuntimeWarning, match="rewards as large as 1e\\+30"):
        huge, huge_returns = run(unit * 1e30)
    small, _ = run(unit)
    assert huge.dtype == torch.float32 and torch.isfinite(huge).all() and torch.isfinite(huge_returns).all()
    assert (huge * mask).abs().sum() > 0
    # (GRPO's std + 1e-6 makes it scale-free only to ~1e-6 relative)
    expected = small * 1e30 if estimator == "rloo" else small  # rloo does not normalise: it keeps the scale
    torch.testing.assert_close(huge, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
