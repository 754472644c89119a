"""Reward models (reward_model.py) on the CPU with tiny random models: a sequence classifier with its own tokenizer
and chat template, and a tiny causal judge. Scores against a direct transformers forward on the re-templated text;
batching, truncation, padding side, offload round trip, combination with a rule reward, the planner's decision,
the config keys, and whole runs (PPO with critic + ref + reward model, resume, LoRA, a judge)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlanywhere import reward_model as rmod
from rlanywhere.config import load_config
from rlanywhere.errors import UserError

from .conftest import build_tiny_tokenizer

# the reward model's own template: unlike the policy's (conftest.CHAT_TEMPLATE), so re-templating shows
RM_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} <|im_end|> {% endfor %}")
WORDS = ("What is 12 + 34 ? The answer is 46 #### 46 no yes good bad Score : seven user assistant system [ ] "
         "Grade the answer to question . Reply with only a score from 0 to 10 Question Answer")


def build_tiny_reward_model(out: Path, seed: int = 0) -> Path:
    """A random Qwen2 sequence classifier (1 label) with a word-level tokenizer of its own, saved like any HF RM."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_tiny_tokenizer([WORDS])
    tokenizer.chat_template = RM_TEMPLATE
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None)
    Qwen2ForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"))


def load_rm(rm_dir, **kwargs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    return rmod.DiscriminativeRewardModel(model, tokenizer, **kwargs), model, tokenizer


PROMPTS = [[{"role": "user", "content": "What is 12 + 34 ?"}]] * 3 + ["Grade the answer", [
    {"role": "system", "content": "Reply with only a score"}, {"role": "user", "content": "What is 0 + 10 ?"}]]
RESPONSES = ["The answer is 46 #### 46", "no", "good good good bad yes no 12 34 46 #### 46 . The answer", "yes",
             "Score : 10"]


def direct_scores(model, tokenizer, prompts, responses, max_length=None, side="right") -> list[float]:
    """One unpadded transformers forward per text: what the reward model says about the re-templated text."""
    out = []
    for prompt, response in zip(prompts, responses):
        messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt))
        text = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        assert text.startswith("[") and "<|im_start|>" not in text  # the RM's template, not the policy's
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if max_length and len(ids) > max_length:
            ids = ids[:max_length] if side == "right" else ids[-max_length:]
        with torch.no_grad():
            out.append(float(model(torch.tensor([ids])).logits[0, 0]))
    return out


def test_scores_equal_a_direct_forward_on_the_re_templated_text(rm_dir):
    scorer, model, tokenizer = load_rm(rm_dir, micro_batch=2)
    scores, _ = scorer.score(PROMPTS, RESPONSES)
    expected = direct_scores(model, tokenizer, PROMPTS, RESPONSES)
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 5) for s in expected)) == len(expected)  # the texts really score differently


@pytest.mark.parametrize("settings", [dict(micro_batch=1), dict(micro_batch=5), dict(micro_batch=3),
                                      dict(max_token_len=40), dict(max_token_len=1)])
def test_micro_batches_and_token_budgets_give_the_same_scores(rm_dir, settings):
    scorer, model, tokenizer = load_rm(rm_dir, **settings)
    scores, _ = scorer.score(PROMPTS, RESPONSES)
    assert scores.tolist() == pytest.approx(direct_scores(model, tokenizer, PROMPTS, RESPONSES), abs=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_at_max_length(rm_dir, side):
    scorer, model, tokenizer = load_rm(rm_dir, micro_batch=4, max_length=7, truncation=side)
    rows = scorer.encode(PROMPTS, RESPONSES)
    assert max(len(r) for r in rows) == 7
    scores, _ = scorer.score(PROMPTS, RESPONSES)
    assert scores.tolist() == pytest.approx(direct_scores(model, tokenizer, PROMPTS, RESPONSES, 7, side), abs=1e-5)
    # and it changed something: the long response scores differently uncut
    assert scores[2] != pytest.approx(direct_scores(model, tokenizer, PROMPTS[2:3], RESPONSES[2:3])[0], abs=1e-6)


def test_truncation_error_names_the_key(rm_dir):
    scorer, _, _ = load_rm(rm_dir, max_length=3, truncation="error")
    with pytest.raises(UserError, match="reward_model.max_length"):
        scorer.score(PROMPTS[:1], RESPONSES[:1])


def test_the_tokenizers_padding_side_does_not_change_the_scores(rm_dir):
    right, _, _ = load_rm(rm_dir, micro_batch=5)
    left, _, tokenizer = load_rm(rm_dir, micro_batch=5)
    left.tokenizer.padding_side = "left"
    # pad == eos: HF's own pad search would stop at the template's final <|im_end|>; the last real token is read
    left.pad_id = tokenizer.eos_token_id
    assert left.score(PROMPTS, RESPONSES)[0].tolist() == pytest.approx(right.score(PROMPTS, RESPONSES)[0].tolist(),
                                                                       abs=1e-5)


def test_offload_round_trip_visits_the_device_only_to_score(rm_dir, monkeypatch):
    scorer, model, tokenizer = load_rm(rm_dir, micro_batch=5, offload=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moves: list[str] = []
    original = model.to

    def to(device, *args, **kwargs):
        moves.append(str(device))
        return original("cpu")  # the CPU stands in for the card

    scorer.device = "cuda:7"
    monkeypatch.setattr(model, "to", to)
    monkeypatch.setattr(scorer, "forward_ids", lambda rows: torch.arange(len(rows), dtype=torch.float32))
    manager = rmod.ModelRewardManager(scorer, _rules(), combine_with_custom=False)
    manager(RESPONSES, ["46"] * 5, ["arithmetic"] * 5, None, prompts=PROMPTS)
    assert moves == ["cuda:7", "cpu"]  # in for the scoring, out after it
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])


@pytest.mark.parametrize("kind", ["bert", "roberta", "deberta-v2"])
def test_encoder_reward_models_score_as_their_own_forward(kind):
    """Encoder classifiers pool (BERT, DeBERTa) or read the first token (RoBERTa) in their own way: their scores are
    their own forward's, in micro-batches of any size (the decoder path reads the last token through `score`)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DebertaV2Config,
        DebertaV2ForSequenceClassification,
        RobertaConfig,
        RobertaForSequenceClassification,
    )

    tokenizer = build_tiny_tokenizer([WORDS])
    tokenizer.chat_template = RM_TEMPLATE
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": len(tokenizer) + 4, "num_labels": 1, "pad_token_id": tokenizer.pad_token_id,
             "max_position_embeddings": 300}
    config_class, model_class = {"bert": (BertConfig, BertForSequenceClassification),
                                 "roberta": (RobertaConfig, RobertaForSequenceClassification),
                                 "deberta-v2": (DebertaV2Config, DebertaV2ForSequenceClassification)}[kind]
    torch.manual_seed(0)
    model = model_class(config_class(**shape)).eval()
    for micro_batch in (1, 3):
        scores, _ = rmod.DiscriminativeRewardModel(model, tokenizer, micro_batch=micro_batch).score(PROMPTS, RESPONSES)
        assert scores.tolist() == pytest.approx(direct_scores(model, tokenizer, PROMPTS, RESPONSES), abs=1e-5)


class _NaNScorer:
    kind, offload = rmod.DISCRIMINATIVE, False

    def to_device(self):
        pass

    def to_home(self):
        pass

    def score(self, prompts, responses):
        return torch.tensor([1.0, float("nan"), float("inf"), -2.0]), {}


def test_non_finite_reward_model_scores_score_zero_and_count_as_errors():
    manager = rmod.ModelRewardManager(_NaNScorer(), _rules(), combine_with_custom=False)
    scores, info = manager(["a", "b", "c", "d"], ["1"] * 4, ["arithmetic"] * 4, None, prompts=["q"] * 4)
    assert scores.tolist() == [1.0, 0.0, 0.0, -2.0] and info["rm_score"] == [1.0, 0.0, 0.0, -2.0]
    assert info["rm_nonfinite"] == 2 and info["num_errors"] == 2


def test_the_default_verdict_is_the_replys_first_number():
    import re

    pattern = re.compile(load_config(None, []).reward_model.judge.verdict_regex)
    assert pattern.pattern == rmod.DEFAULT_VERDICT_REGEX
    for reply, verdict in (("7/10", 7.0), (" 8 out of 10", 8.0), ("Score: -2.5, the answer has 3 errors", -2.5),
                           ("no number", None)):
        assert rmod.parse_verdict(reply, pattern) == verdict, reply


def _rules(custom=None):
    from rlanywhere.rewards import RewardManager

    return RewardManager(custom, timeout_s=0)


def test_the_model_score_is_the_reward_and_the_rule_still_reports_acc(rm_dir):
    scorer, model, tokenizer = load_rm(rm_dir, micro_batch=2)
    manager = rmod.ModelRewardManager(scorer, _rules(), combine_with_custom=False)
    scores, info = manager(RESPONSES, ["46"] * 5, ["arithmetic"] * 5, [{}] * 5, prompts=PROMPTS)
    expected = direct_scores(model, tokenizer, PROMPTS, RESPONSES)
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert info["acc"] == [1.0, 0.0, 1.0, 0.0, 0.0]  # arithmetic rule: 46 after ####
    assert info["rm_score"] == pytest.approx(expected, abs=1e-5) and info["rm_time_s"] > 0
    metrics = rmod.reward_model_metrics([info])
    assert metrics["reward_model/score_mean"] == pytest.approx(sum(expected) / 5, abs=1e-5)
    assert metrics["reward_model/score_std"] == pytest.approx(float(torch.tensor(expected).std()), abs=1e-5)


def test_model_score_plus_a_format_bonus_through_a_custom_reward_function(rm_dir, tmp_path):
    from rlanywhere.rewards import load_custom_reward

    file = tmp_path / "combine.py"
    file.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    bonus = 0.5 if '####' in solution_str else 0.0\n"
                    "    return {'score': extra_info['rm_score'] + bonus, 'format': bonus * 2}\n")
    scorer, model, tokenizer = load_rm(rm_dir, micro_batch=3)
    manager = rmod.ModelRewardManager(scorer, _rules(load_custom_reward(file, "score")), combine_with_custom=True)
    scores, info = manager(RESPONSES, ["46"] * 5, ["arithmetic"] * 5, [{}] * 5, prompts=PROMPTS)
    rm = direct_scores(model, tokenizer, PROMPTS, RESPONSES)
    bonus = [0.5, 0.0, 0.5, 0.0, 0.0]
    assert scores.tolist() == pytest.approx([r + b for r, b in zip(rm, bonus)], abs=1e-5)
    assert info["format"] == [1.0, 0.0, 1.0, 0.0, 0.0] and info["num_errors"] == 0


# ------------------------------------------------------------------------------------------------ judge
def test_judge_generates_greedily_like_transformers_and_counts_parse_failures(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    # the verdict: how many words the judge wrote, or None ("no verdict") when it wrote "####"
    verdict = lambda text: None if "#" in text else float(len(text.split()))  # noqa: E731
    judge = rmod.GenerativeJudge(model, tokenizer, micro_batch=2, max_new_tokens=5, verdict_fn=verdict,
                                 prompt_template="Question : {prompt} Answer : {response} Score :")
    prompts, responses = PROMPTS[:4], RESPONSES[:4]
    scores, info = judge.score(prompts, responses)
    texts = []
    for prompt, response in zip(prompts, responses):
        ids = judge.grading_prompt(prompt, response)
        out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        texts.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    assert info["judge_response"] == texts
    expected = [judge.failure_score if verdict(t) is None else verdict(t) for t in texts]
    assert scores.tolist() == expected
    assert info["rm_parse_failures"] == sum(verdict(t) is None for t in texts)


def test_a_verdict_that_cannot_be_parsed_scores_the_failure_score_and_never_raises(tiny_model_dir):
    import re

    from transformers import AutoModelForCausalLM, AutoTokenizer

    pattern = re.compile(r"Score: (\d+)")
    assert rmod.parse_verdict("I think... Score: 7 of 10", pattern) == 7.0
    assert rmod.parse_verdict("no number", pattern) is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def broken(text):
        raise RuntimeError("parser bug")

    judge = rmod.GenerativeJudge(model, tokenizer, max_new_tokens=3, verdict_fn=broken, failure_score=-1.0)
    scores, info = judge.score(PROMPTS[:3], RESPONSES[:3])
    assert scores.tolist() == [-1.0] * 3 and info["rm_parse_failures"] == 3


# ------------------------------------------------------------------------------------------------ planner
def _shape_dir(tmp_path: Path, name: str, **shape) -> str:
    out = tmp_path / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForSequenceClassification"],
                                                 "num_labels": 1, "max_position_embeddings": 4096, **shape}))
    return str(out)


QWEN05 = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
              num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN7 = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
             num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


def _ppo_plan(tmp_path, card, rm_path, **extra):
    from rlanywhere.planner import make_plan

    overrides = {"actor_rollout_ref.model.path": "Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator": "gae",
                 "algorithm.use_kl_in_reward": True, "data.train_batch_size": 64, "data.max_prompt_length": 256,
                 "data.max_response_length": 256, "actor_rollout_ref.actor.ppo_mini_batch_size": 32,
                 "reward_model.enable": True, "reward_model.model.path": rm_path, **extra}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    return make_plan(cfg, emulate=card, for_execution=False)


def test_planner_keeps_the_reward_model_on_an_h100_and_offloads_it_on_a_p40(tmp_path):
    rm = _shape_dir(tmp_path, "rm05", **QWEN05)
    h100 = _ppo_plan(tmp_path, "h100", rm)
    p40 = _ppo_plan(tmp_path, "p40", rm)
    assert not h100.reward_model["offload"] and p40.reward_model["offload"]
    for plan in (h100, p40):
        phases = plan.estimate["phases"]
        assert "reward" in phases and plan.estimate["peak_bytes"] == max(phases.values())
        assert plan.estimate["peak_bytes"] <= plan.memory_budget_bytes
        assert plan.reward_model["attn_implementation"] == plan.attn_implementation
        assert "reward model" in plan.summary()
    weights = h100.reward_model["weights_bytes"]
    # Qwen2.5-0.5B's 494M parameters (its LM head is the tied embedding) + a 896 x 1 head, bf16 on an H100
    assert weights == pytest.approx(494.0e6 * 2, rel=0.005)
    # resident on the H100: every phase carries its weights; offloaded on the P40: only the scoring phase
    assert h100.estimate["breakdown"]["actor_update"]["reward_model_weights"] == weights
    assert "reward_model_weights" not in p40.estimate["breakdown"]["actor_update"]
    assert p40.estimate["breakdown"]["reward"]["reward_model_weights"] == p40.reward_model["weights_bytes"]


def test_a_reward_model_that_cannot_fit_is_refused_before_loading_with_both_estimates(tmp_path):
    from rlanywhere.vocabulary import NoFitError

    rm = _shape_dir(tmp_path, "rm7", **QWEN7)
    with pytest.raises(NoFitError, match="kept on the GPU the run peaks at .* offloaded between scorings at"):
        _ppo_plan(tmp_path, "p40", rm)


def test_param_offload_true_is_honoured_and_a_micro_batch_size_is_kept(tmp_path):
    rm = _shape_dir(tmp_path, "rm05", **QWEN05)
    plan = _ppo_plan(tmp_path, "h100", rm, **{"reward_model.model.fsdp_config.param_offload": True,
                                              "reward_model.micro_batch_size_per_gpu": 8})
    assert plan.reward_model["offload"] and plan.reward_model["micro_batch"] == 8


def test_plan_reward_model_is_a_pure_function_of_the_estimate():
    from rlanywhere.model_shape import read_model_shape

    shape = read_model_shape(dict(model_type="qwen2", **QWEN05))
    estimate = {"phases": {"rollout": 10 * 2**30, "actor_update": 20 * 2**30},
                "breakdown": {"rollout": {"actor_weights": 2 * 2**30, "kv_cache": 1 * 2**30,
                                          "prefill_or_sampling": 7 * 2**30},
                              "actor_update": {"actor_weights": 2 * 2**30, "activations": 18 * 2**30}},
                "peak_bytes": 20 * 2**30, "peak_phase": "actor_update"}
    kwargs = dict(kind="discriminative", path="rm", dtype=torch.bfloat16, attn_implementation="sdpa", rows=64,
                  seq_len=512, on_cuda=True, micro_batch=4)
    kept, combined = rmod.plan_reward_model(estimate, shape, budget_bytes=40 * 2**30, **kwargs)
    weights = kept.weights_bytes
    assert not kept.offload and combined["phases"]["actor_update"] == 20 * 2**30 + weights
    # the scoring phase: the rollout's state without its transients + the RM's weights + one forward
    forward = rmod.reward_model_scoring_bytes(shape, "discriminative", 4, 512, 2, False)
    assert combined["phases"]["reward"] == 3 * 2**30 + weights + forward
    offloaded, combined = rmod.plan_reward_model(estimate, shape, budget_bytes=20 * 2**30 + weights // 2, **kwargs)
    assert offloaded.offload and combined["phases"]["actor_update"] == 20 * 2**30
    assert estimate["phases"]["actor_update"] == 20 * 2**30  # the input is not changed


# ------------------------------------------------------------------------------------------------ config
def test_verl_reward_model_keys_are_accepted(rm_dir):
    notices: list[str] = []
    cfg = load_config(None, ["reward_model.enable=true", f"reward_model.model.path={rm_dir}",
                             "reward_model.model.input_tokenizer=Qwen/Qwen2.5-0.5B-Instruct",
                             "reward_model.micro_batch_size_per_gpu=4", "reward_model.max_length=128",
                             "reward_model.reward_manager=naive", "reward_model.use_dynamic_bsz=true",
                             "reward_model.forward_max_token_len_per_gpu=2048", "reward_model.strategy=fsdp",
                             "reward_model.model.fsdp_config.param_offload=true",
                             "reward_model.model.fsdp_config.wrap_policy.min_num_params=0",
                             "reward_model.launch_reward_fn_async=false"], notices=notices)
    assert cfg.reward_model.model.fsdp_config.param_offload is True
    assert cfg.reward_model.forward_max_token_len_per_gpu == 2048


@pytest.mark.parametrize("overrides, message", [
    (["reward_model.enable=true"], "reward_model.model.path"),
    (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.max_length=0"], "max_length"),
    (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.judge.enable=true",
      "reward_model.judge.prompt_template=Grade {prompt}"], "{response}"),
    (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.judge.enable=true",
      "reward_model.judge.verdict_regex=Score"], "one group"),
    (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.judge.enable=true",
      "reward_model.judge.prompt_template=Grade {response} as {score}"], "cannot be filled in"),
    (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.truncation=middle"], "truncation"),
])
def test_bad_reward_model_settings_are_named_before_loading(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


# ------------------------------------------------------------------------------------------------ runs
@pytest.mark.slow
def test_ppo_with_a_reward_model_trains_resumes_and_never_saves_it(tiny_model_dir, arith_data, rm_dir, tmp_path,
                                                                    monkeypatch):
    from .test_e2e import base_overrides, killed_then_resumed, run_training, train_rows

    extra = {"algorithm.adv_estimator": "gae", "trainer.total_training_steps": 4, "trainer.save_freq": 2,
             "trainer.test_freq": -1, "trainer.val_before_train": False, "critic.optim.lr": 1e-3,
             "algorithm.use_kl_in_reward": True, "reward_model.enable": True, "reward_model.model.path": str(rm_dir),
             "reward_model.micro_batch_size_per_gpu": 3}
    trainer, uninterrupted = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "a", **extra))
    a = train_rows(uninterrupted)
    assert all(abs(a[s]["reward/mean"] - a[s]["reward_model/score_mean"]) < 1e-6 for s in a)  # the RM's reward
    assert all("timing/reward_model" in a[s] and a[s]["reward_model/parse_failures"] == 0 for s in a)
    saved = [p.name for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert not any("reward" in name and name.endswith((".safetensors", ".pt", ".bin")) for name in saved)
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["reward_model"]["path"] == str(rm_dir)
    resumed_trainer, resumed = killed_then_resumed(base_overrides(tiny_model_dir, arith_data, tmp_path / "b",
                                                                  **extra), 2, monkeypatch)
    b = train_rows(resumed)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("reward/mean", "reward_model/score_std", "actor/pg_loss", "critic/vf_loss"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_lora_grpo_with_a_generative_judge_runs(tiny_model_dir, arith_data, tmp_path):
    from .test_e2e import base_overrides, run_training, train_rows

    verdict = tmp_path / "verdict.py"
    verdict.write_text("def words(text):\n    return float(len(text.split())) if text.strip() else None\n")
    extra = {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.model.lora_rank": 4,
             "trainer.test_freq": -1, "trainer.val_before_train": False, "reward_model.enable": True,
             "reward_model.model.path": str(tiny_model_dir), "reward_model.judge.enable": True,
             "reward_model.judge.max_new_tokens": 4, "reward_model.judge.verdict_function.path": str(verdict),
             "reward_model.judge.verdict_function.name": "words"}
    trainer, metrics = run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **extra))
    rows = train_rows(metrics)
    assert trainer.global_step == 2 and trainer.plan.reward_model["kind"] == "generative"
    for row in rows.values():
        assert row["reward/mean"] == pytest.approx(row["reward_model/score_mean"], abs=1e-6)
        assert 0 <= row["reward_model/score_mean"] <= 4 and "reward_model/parse_failures" in row


@pytest.mark.slow
def test_the_split_placements_rollout_rank_scores_with_the_reward_model(tiny_model_dir, arith_data, rm_dir, tmp_path):
    """one_step_off PPO (a critic, a KL reference) with a reward model on 1 trainer + 1 rollout rank (gloo, forked):
    the rollout rank scores with the reward model (it scored with the rule alone), so every metric is the
    one-process pipeline's."""
    from rlanywhere.tracking import read_metrics

    from .test_async import _split_rank
    from .test_distributed import assert_same_metrics, forked_ranks
    from .test_e2e import base_overrides, run_training, train_rows

    extra = {"algorithm.adv_estimator": "gae", "trainer.total_training_steps": 2, "trainer.test_freq": -1,
             "trainer.val_before_train": False, "critic.optim.lr": 1e-3, "algorithm.use_kl_in_reward": True,
             "reward_model.enable": True, "reward_model.model.path": str(rm_dir),
             "reward_model.micro_batch_size_per_gpu": 3, "trainer.async.mode": "one_step_off",
             "custom_reward_function.timeout_s": 0}
    run_training(base_overrides(tiny_model_dir, arith_data, tmp_path / "one", **extra))
    overrides = base_overrides(tiny_model_dir, arith_data, tmp_path / "split", **extra)
    forked_ranks(_split_rank, (overrides, f"file://{tmp_path / 'rendezvous'}"))
    want, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "split")
    assert all(abs(row["reward/mean"] - row["reward_model/score_mean"]) < 1e-6 for row in train_rows(got).values())
    assert_same_metrics(got, want, steps=(1, 2))
