"""verl's algorithms through the registries: ReMax, GPG (estimator and loss), GMPO (geo_mean), CISPO, PF-PPO.

Each has a hand-computed case and a comparison with verl's public implementation (volcengine/verl,
verl/trainer/ppo/core_algos.py at commit b178a3cd5, January 2026) on seeded inputs: the reference numbers below are
what verl's functions return for the inputs that `_seeded_loss_inputs` / `_seeded_scores` build (float64).
"""

import math

import pytest
import torch

from rlanywhere import algorithms as A


def close(actual, expected, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), rtol=tol, atol=tol)


# ---------------------------------------------------------------- the registries


def test_registry_carries_each_estimators_needs():
    assert A.estimator_needs("gae").critic and not A.estimator_needs("grpo").critic
    assert A.estimator_needs("grpo").groups and A.estimator_needs("gpg").groups
    assert A.estimator_needs("remax").greedy_baseline and not A.estimator_needs("remax").groups
    with pytest.raises(ValueError, match="valid"):
        A.estimator_needs("ppo")


def test_a_new_estimator_is_one_decorated_function():
    name = "test_constant_one"
    try:
        @A.register_adv_est(name, groups=True)
        def constant(*, mask, **_):
            return mask.double(), mask.double()

        mask = torch.ones(2, 3)
        with pytest.raises(ValueError, match="group_index"):  # the registration's needs are enforced
            A.compute_advantages(name, scores=torch.ones(2), mask=mask)
        adv, _ = A.compute_advantages(name, scores=torch.ones(2), mask=mask, group_index=[0, 0])
        close(adv, torch.ones(2, 3))
        with pytest.raises(ValueError, match="already registered"):
            A.register_adv_est(name)(constant)
    finally:
        A.ADVANTAGE_ESTIMATORS.pop(name, None)


def test_the_planner_and_config_read_the_registry():
    from rlanywhere.config import load_config
    cfg = load_config(None, ["algorithm.adv_estimator=remax",
                             "actor_rollout_ref.actor.policy_loss.loss_mode=cispo"])
    assert cfg.algorithm.adv_estimator == "remax"
    with pytest.raises(Exception, match="gpg"):  # the error lists the registered names
        load_config(None, ["algorithm.adv_estimator=nope"])


# ---------------------------------------------------------------- ReMax


def test_remax_hand_computed():
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    token_rewards = torch.tensor([[0.0, 1.0, 0], [0, 0, 0]])
    adv, returns = A.compute_advantages("remax", token_rewards=token_rewards, mask=mask,
                                        baselines=torch.tensor([0.5, 0.5]))
    close(returns, [[1, 1, 0], [0, 0, 0]])
    close(adv, [[0.5, 0.5, 0], [-0.5, -0.5, -0.5]])
    with pytest.raises(ValueError, match="baselines"):
        A.compute_advantages("remax", token_rewards=token_rewards, mask=mask)


def _seeded_scores():
    g = torch.Generator().manual_seed(99)
    nonzero = (torch.rand(6, generator=g, dtype=torch.float64) > 0.5).double()
    scores = nonzero * torch.rand(6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.float64)
    return scores, mask, [0, 0, 0, 1, 1, 2]


def test_remax_matches_verl_on_seeded_inputs():
    scores, mask, _ = _seeded_scores()
    adv, returns = A.compute_advantages("remax", scores=scores, mask=mask,
                                        baselines=torch.tensor([0.2, 0.2, 0.2, 0.7, 0.7, 0.0], dtype=torch.float64))
    verl_first_token = [0.33088311086955674, 0.4328389710265566, 0.6049020059197769, -0.7, -0.16387945466342957, 0.0]
    close(adv[:, 0], verl_first_token)
    close(returns[:, 0], [0.5308831108695568, 0.6328389710265566, 0.8049020059197769, 0.0, 0.5361205453365704, 0.0])


# ---------------------------------------------------------------- GPG


def test_gpg_advantage_hand_computed():
    # alpha = 3 rows / 2 non-zero scores = 1.5; group {0} alone: mean 0 -> 1.5 * 2; group {1, 2}: mean 0.5
    adv, _ = A.compute_advantages("gpg", scores=torch.tensor([2.0, 1.0, 0.0]), mask=torch.ones(3, 2),
                                  group_index=[0, 1, 1])
    close(adv, [[3.0, 3.0], [0.75, 0.75], [-0.75, -0.75]])


def test_gpg_advantage_matches_verl_on_seeded_inputs():
    scores, mask, groups = _seeded_scores()
    adv, _ = A.compute_advantages("gpg", scores=scores, mask=mask, group_index=groups)
    close(adv[:, 0], [-0.18798737760361, -0.035053587368110206, 0.2230409649717202, -0.40209040900242776,
                      0.40209040900242776, 0.0])
    close(adv * (1 - mask), torch.zeros_like(adv))


def _seeded_loss_inputs():
    g = torch.Generator().manual_seed(1234)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64) * 2
    new = old + (torch.rand(3, 4, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([[1.0] * 4, [-0.5] * 4, [2.0] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float64)
    return old, new.requires_grad_(True), adv, mask


# name, loss_agg_mode, clip low/high, verl's loss, d loss / d logprob at [0, 0] and [2, 1]
VERL_LOSSES = [
    ("gpg", "token-mean", 0.2, 0.28, 1.16546388484544, -0.1111111111111111, -0.2222222222222222),
    ("gpg", "seq-mean-token-mean", 0.2, 0.28, 1.0476394774297435, -0.08333333312499999, -0.22222222148148146),
    ("cispo", "token-mean", 0.2, 0.28, 1.003934918512747, -0.1401368472176532, -0.18773627200767365),
    ("cispo", "seq-mean-token-mean", 0.2, 0.28, 0.9042919120600114, -0.10510263515048332, -0.1877362713818861),
    ("geo_mean", "token-mean", 0.4, 0.4, -0.7625984989389059, -0.08228133470395883, -0.18802061970648806),
    ("geo_mean", "token-mean", 0.1, 0.1, -0.7305977809242569, 0.0, -0.18802061970648806),
]


@pytest.mark.parametrize("name, mode, low, high, loss, grad00, grad21", VERL_LOSSES)
def test_policy_losses_match_verl_on_seeded_inputs(name, mode, low, high, loss, grad00, grad21):
    old, new, adv, mask = _seeded_loss_inputs()
    value, metrics = A.POLICY_LOSSES[name](old, new, adv, mask, low, high, None, mode, A.LossScale.of(mask))
    value.backward()
    close(value, loss, 1e-6)  # verl adds 1e-8 to per-row token counts
    close(new.grad[0, 0], grad00, 1e-6)
    close(new.grad[2, 1], grad21, 1e-6)
    assert {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio_mean", "ratio_max"} <= set(metrics)


def test_geo_mean_clip_fractions_match_verl():
    old, new, adv, mask = _seeded_loss_inputs()
    _, metrics = A.geo_mean_policy_loss(old, new, adv, mask, 0.1, 0.1)
    close(metrics["pg_clipfrac"], 0.7777777777777778)
    close(metrics["pg_clipfrac_lower"], 0.2222222222222222)
    close(metrics["ppo_kl"], 0.11556469772343347)


def test_gpg_loss_hand_computed():
    logprob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = A.gpg_policy_loss(torch.zeros(1, 2), logprob, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    close(loss, (1.0 - 2.0) / 2)  # -A * logprob: 1 and -2, token mean
    loss.backward()
    close(logprob.grad, [[-0.5, 0.5]])


def test_cispo_hand_computed():
    # ratio 1.5 is clipped to 1.28 (still a gradient), ratio 0.9 is inside [0.8, 1.28]
    logprob = torch.tensor([[math.log(1.5), math.log(0.9)]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    loss, metrics = A.cispo_policy_loss(torch.zeros(1, 2, dtype=torch.float64), logprob, adv,
                                        torch.ones(1, 2), 0.2, 0.28)
    close(loss, (-1.28 * math.log(1.5) + 0.9 * math.log(0.9)) / 2)
    loss.backward()
    close(logprob.grad, [[-1.28 / 2, 0.9 / 2]])
    close(metrics["pg_clipfrac"], 0.5)


def test_geo_mean_hand_computed():
    # row 0: A = 1, log-ratios 0.1, 0.6 -> the pessimistic clip keeps 0.1, 0.4 -> ratio e^0.25, loss -e^0.25
    # row 1: A = -1, log-ratios 0.1, 0.6 -> kept as they are (max side) -> ratio e^0.35, loss +e^0.35
    log_ratio = torch.tensor([[0.1, 0.6], [0.1, 0.6]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    loss, _ = A.geo_mean_policy_loss(torch.zeros(2, 2, dtype=torch.float64), log_ratio, adv, torch.ones(2, 2), 0.4)
    close(loss, (-math.exp(0.25) + math.exp(0.35)) / 2)


def test_geo_mean_weighs_a_sequence_by_the_geometric_mean_of_its_token_weights():
    """verl's GMPO takes the rollout correction's token weights per sequence as exp(mean log w): one row, ratio 1,
    A = 1, weights 0.5 and 2 -> geometric mean 1, loss -1 (the arithmetic mean 1.25 would give -1.25)."""
    loss, _ = A.geo_mean_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), 0.4,
                                     token_weights=torch.tensor([[0.5, 2.0]]))
    close(loss, -1.0)


# ---------------------------------------------------------------- PF-PPO


def test_pf_ppo_resample_follows_the_weights():
    g = torch.Generator().manual_seed(0)
    rows = A.pf_ppo_resample(torch.tensor([0.0, 0.0, 2.0, 0.0]), "pow", 2.0, g)  # weights 1e-8 .. 4 .. 1e-8
    assert rows.tolist() == [2, 2, 2, 2]
    rows = A.pf_ppo_resample(torch.tensor([0.0, 0.5, 1.0] * 30), "max_min", generator=g)
    assert len(rows) == 90 and not (rows % 3 == 1).any()  # the middle score has weight 1e-8
    rows = A.pf_ppo_resample(torch.tensor([1.0] + [0.0] * 3999), "max_random", generator=g)
    # 0.4 vs 3999 x 0.1: row 0 is drawn with probability 0.4 / 400.3 each time, about 4 of 4000 draws
    assert 0 < int((rows == 0).sum()) < 20
    with pytest.raises(ValueError, match="reweight_method"):
        A.pf_ppo_resample(torch.ones(2), "nope")


def test_pf_ppo_batch_moves_every_row_field():
    from rlanywhere.rollout.base import RolloutBatch
    from rlanywhere.stepbatch import StepBatch
    from rlanywhere.verl_steps import resample_rows
    ids = torch.arange(6).reshape(3, 2)
    rollout = RolloutBatch(prompt_ids=ids, prompt_mask=torch.ones(3, 2), response_ids=ids + 10,
                           response_mask=torch.ones(3, 2), response_logprobs=-ids.double(), num_prompts=3, n=1)
    batch = StepBatch(rollout=rollout, group_index=torch.arange(3), scores=torch.tensor([0.0, 1.0, 2.0]),
                      reward_info={"acc": [0.0, 1.0, 2.0], "num_errors": 0}, advantages=ids.double())
    moved = resample_rows(batch, torch.tensor([2, 2, 0]))
    assert moved.scores.tolist() == [2.0, 2.0, 0.0] and moved.reward_info["acc"] == [2.0, 2.0, 0.0]
    assert moved.rollout.response_ids[:, 0].tolist() == [14, 14, 10] and moved.advantages[2, 1] == 1.0
    assert moved.group_index.tolist() == [2, 2, 0] and moved.reward_info["num_errors"] == 0


def test_remax_baseline_is_one_greedy_response_per_prompt_scored_and_shaped():
    from types import SimpleNamespace

    from rlanywhere.rollout.base import SamplingParams
    from rlanywhere.verl_steps import row_baselines

    calls = {}

    class Rollouts:
        response_length = 4
        cfg = SimpleNamespace(reward_model=SimpleNamespace(overlong_buffer=SimpleNamespace(
            enable=True, len=2, penalty_factor=1.0)))

        def sampling_params(self):
            return SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, n=4)

        def step_generator(self, step, salt=0, first_prompt=0):
            return None

        def generate(self, items, params, generator, first_prompt=0):
            calls["params"] = params
            return SimpleNamespace(response_lengths=lambda: torch.tensor([2, 4]))

        def score(self, items, rollout, n):
            calls["n"] = n
            return torch.tensor([1.0, 0.0]), {}, []

    baselines = row_baselines(Rollouts(), [{}, {}], step=3, n=3)
    params = calls["params"]
    assert (params.temperature, params.top_k, params.top_p, params.n, calls["n"]) == (0.0, 0, 1.0, 1, 1)
    # the second greedy response ran to the limit: -1 overlong penalty, as the samples get
    assert baselines == [1.0, 1.0, 1.0, -1.0, -1.0, -1.0]


@pytest.mark.parametrize("mode", ["gpg", "cispo", "geo_mean"])
def test_verls_losses_take_the_rollout_corrections_token_weights(mode):
    """Weights of 1 change nothing; weights of 2 on every token double the loss (each loss is linear in them)."""
    from rlanywhere.algorithms import POLICY_LOSSES

    torch.manual_seed(0)
    old, new = torch.randn(2, 4), torch.randn(2, 4)
    advantages, mask = torch.randn(2, 4), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    loss = POLICY_LOSSES[mode]
    plain, _ = loss(old, new, advantages, mask)
    ones, _ = loss(old, new, advantages, mask, token_weights=torch.ones(2, 4))
    twos, _ = loss(old, new, advantages, mask, token_weights=torch.full((2, 4), 2.0))
    assert torch.allclose(plain, ones) and torch.allclose(twos, 2 * plain)
