"""The Python API (rlanywhere.api): config from dict/YAML/overrides, the demo profile with overrides on top, and the
notebook example (examples/notebook_api.py) run end to end with a tiny random model, as CI runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rlanywhere as rl
from rlanywhere.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_make_config_layers_dict_yaml_and_overrides(tmp_path):
    cfg = rl.make_config({"data": {"train_batch_size": 16}, "algorithm": {"adv_estimator": "grpo"}},
                         ["data.train_batch_size=32"])
    assert cfg.data.train_batch_size == 32 and cfg.algorithm.adv_estimator == "grpo"
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  adv_estimator: rloo\n")
    assert rl.make_config(str(path)).algorithm.adv_estimator == "rloo"
    assert rl.make_config(path, base={"algorithm": {"adv_estimator": "grpo"}}).algorithm.adv_estimator == "rloo"
    with pytest.raises(ConfigError, match="did you mean 'data.train_batch_size'"):
        rl.make_config({"data": {"train_batch_sise": 3}})


def test_demo_overrides_apply_on_top_and_each_demo_is_a_new_run(monkeypatch):
    cfg = rl.demo_config(["trainer.total_training_steps=3"], on_gpu=False)
    profile = rl.demo_profile(on_gpu=False)
    assert cfg.trainer.total_training_steps == 3  # the override
    assert cfg.data.train_batch_size == profile["data"]["train_batch_size"]  # the profile, not the full defaults
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.data.max_response_length == 12
    assert cfg.trainer.default_local_dir.startswith("runs/demo/smollm2-grpo-arith-")  # timestamped: a new run
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/7")  # every rank of one torchrun job: one run dir
    assert rl.demo_config([], on_gpu=False).trainer.default_local_dir == "runs/demo/smollm2-grpo-arith-job_7"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    named = rl.demo_config(["trainer.experiment_name=mine"], on_gpu=False)
    assert named.trainer.default_local_dir == "runs/demo/mine"  # a named run resumes as any run does
    cpu = rl.demo_config(["hardware.device=cpu"])
    assert cpu.data.train_batch_size == profile["data"]["train_batch_size"]  # hardware.device=cpu: the CPU profile
    gpu = rl.demo_profile(on_gpu=True)  # the GPU profile is kept as it was measured (README)
    assert (gpu["data"]["train_batch_size"], gpu["actor_rollout_ref"]["rollout"]["n"],
            gpu["trainer"]["total_training_steps"], gpu["data"]["train_files"]) == (
        64, 8, 60, "data/arith/train.parquet")


def test_notebook_example_runs(tiny_model_dir, arith_data, tmp_path):
    """examples/notebook_api.py as a user runs it, with the tiny model: config, plan, train, evaluate, generate."""
    from . import warm_ranks

    run_dir = tmp_path / "run"
    # `python examples/notebook_api.py ...`, started warm (tests/warm_ranks.py: torch and rlanywhere imported);
    # this checkout is first on PYTHONPATH (conftest)
    env = {**os.environ, **warm_ranks.rank_env()}
    result = subprocess.run(
        [sys.executable, *warm_ranks.rank_program(script=str(ROOT / "examples" / "notebook_api.py")), "--model",
         str(tiny_model_dir), "--data", str(arith_data), "--steps", "2", "--run-dir", str(run_dir)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "held-out accuracy" in out and "->" in out and "rlanywhere chat --model" in out
    assert '"accuracy"' in out  # rl.evaluate's result
    # The final model (save_freq=-1: no checkpoints) is saved in HF format with its tokenizer
    final = run_dir / "final_model"
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()
    # save_freq=-1: the final model only, no optimizer checkpoint (the run-dir guard may create the empty folder)
    assert (final / "tokenizer.json").exists() and not list(run_dir.glob("checkpoints/global_step_*"))
    # Every validation's generations, one JSON line per response
    steps = sorted(p.name for p in (run_dir / "val_generations").iterdir())
    assert steps == ["step_0.jsonl", "step_2.jsonl"]
    rows = [json.loads(line) for line in (run_dir / "val_generations" / "step_2.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and {"step", "index", "prompt", "response", "ground_truth", "score"} <= set(rows[0])
    assert "<|im_start|>" in rows[0]["prompt"] and rows[0]["step"] == 2 and rows[0]["ground_truth"]
    # the example trains as the CPU demo's profile says (its learning rate: the one measured not to overshoot)
    from omegaconf import OmegaConf

    saved = OmegaConf.load(run_dir / "config.yaml")
    profile = rl.demo_profile(on_gpu=False)
    assert saved.actor_rollout_ref.actor.optim.lr == profile["actor_rollout_ref"]["actor"]["optim"]["lr"]
    assert saved.actor_rollout_ref.rollout.n == profile["actor_rollout_ref"]["rollout"]["n"]


def test_final_model_loads_with_transformers_and_generates(tiny_model_dir, arith_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from .test_e2e import base_overrides

    cfg = rl.make_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path / "run", **{
        "algorithm.adv_estimator": "grpo", "trainer.save_freq": -1, "trainer.total_training_steps": 1,
        "trainer.val_before_train": False, "trainer.test_freq": -1}))
    result = rl.train(cfg)
    assert result.steps == 1 and result.final_model == str(tmp_path / "run" / "final_model")
    assert result.val_before == {} and "held-out" not in "\n".join(result.summary_lines())  # no validation run
    model = AutoModelForCausalLM.from_pretrained(result.final_model)
    trained = result.trainer.actor.state_dict()
    assert all((model.state_dict()[k] == v).all() for k, v in trained.items() if k in model.state_dict())
    texts = rl.generate(result.final_model, ["What is 1 + 2 ?"], max_new_tokens=4, overrides=["hardware.device=cpu"])
    assert len(texts) == 1
    assert rl.generate(result, ["What is 1 + 2 ?"], max_new_tokens=4) == texts  # same weights, greedy


def test_evaluate_scores_with_the_custom_reward_the_overrides_name(tiny_model_dir, arith_data, tmp_path):
    """A data_source with no built-in rule (your own task) is scored by your function, as in training."""
    reward = tmp_path / "always_one.py"
    reward.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return {'score': 1.0, 'acc': 1.0}\n")
    data = str(arith_data / "test.parquet")
    common = dict(max_samples=4, max_new_tokens=2, progress=False)
    assert rl.evaluate(str(tiny_model_dir), data, overrides=["hardware.device=cpu"], **common)["accuracy"] < 1.0
    custom = rl.evaluate(str(tiny_model_dir), data, overrides=[
        "hardware.device=cpu", f"custom_reward_function.path={reward}", "custom_reward_function.name=score"], **common)
    assert custom["accuracy"] == 1.0 and custom["num_samples"] == 4 and custom["reward"] == 1.0
    number = tmp_path / "number.py"  # a function returning a number: its mean is the result's reward
    number.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 0.25\n")
    scored = rl.evaluate(str(tiny_model_dir), data, overrides=["hardware.device=cpu",
                                                              f"custom_reward_function.path={number}"], **common)
    assert scored["reward"] == 0.25 and scored["reward_errors"] == 0 and scored["accuracy"] is None
    from rlanywhere.preflight import InputError

    for unscored in ("actor_rollout_ref.rollout.multi_turn.enable=true",
                     f"reward_model.enable=true reward_model.model.path={tmp_path}"):
        with pytest.raises(InputError, match="trainer.val_only=true"):  # before the model loads
            rl.evaluate(str(tmp_path / "no_model"), data, overrides=unscored.split(), **common)
    # a data_source no rule scores, without a function of yours: refused before the model loads
    from rlanywhere.data import prepare_generic

    qa = tmp_path / "qa.jsonl"
    qa.write_text('{"q": "capital of France?", "a": "Paris"}\n' * 4)
    generic = prepare_generic(qa, tmp_path / "qa", "q", "a", data_source="capitals", test_ratio=0.5)["test"]
    with pytest.raises(InputError, match="'capitals'.*custom_reward_function.path"):
        rl.evaluate(str(tmp_path / "no-such-model"), str(generic), **common)
    # prompts over the model's prompt length are scored too (their end kept) and counted, not dropped
    short = rl.evaluate(str(tiny_model_dir), data, overrides=["hardware.device=cpu", "data.max_prompt_length=6"],
                        **common)
    assert short["num_samples"] == 4 and short["prompts_cut"] > 0


def test_a_model_folder_without_tokenizer_files_is_named_and_tokenizer_path_is_honoured(tiny_model_dir, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(tiny_model_dir):
        if not name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(os.path.join(tiny_model_dir, name), bare / name)
    with pytest.raises(Exception, match="tokenizer_path"):
        rl.generate(str(bare), ["hi"], max_new_tokens=2, overrides=["hardware.device=cpu"])
    texts = rl.generate(str(bare), ["hi"], max_new_tokens=2, overrides=[
        "hardware.device=cpu", f"actor_rollout_ref.model.tokenizer_path={tiny_model_dir}"])
    assert texts == rl.generate(str(tiny_model_dir), ["hi"], max_new_tokens=2, overrides=["hardware.device=cpu"])


def test_the_suggested_eval_command_scores_as_the_run_validated():
    from rlanywhere.api import eval_arguments

    plain = eval_arguments(rl.make_config(None, ["data.max_response_length=12"]))
    assert plain == " --max-new-tokens 12"
    custom = eval_arguments(rl.make_config(None, ["actor_rollout_ref.rollout.response_length=8",
                                                  "custom_reward_function.path=mine.py",
                                                  "actor_rollout_ref.rollout.stop=['2']"]))
    assert custom.startswith(" --max-new-tokens 8 custom_reward_function.path=mine.py")
    assert custom.endswith(" \"actor_rollout_ref.rollout.stop=['2']\"")


def test_the_marker_note_is_for_the_built_in_gsm8k_rule_only(tmp_path):
    """A summary with a held-out accuracy and a low val/format explains the GSM8K rule's '####' marker; a custom
    reward function (whose val/format counts 0 when it returns none) or a reward model gets no such note."""
    from types import SimpleNamespace

    from rlanywhere.api import TrainResult
    from rlanywhere.config import load_config

    metrics = {"val/acc": 0.9, "val/format": 0.0, "step": 8}

    def lines(*overrides):
        trainer = SimpleNamespace(cfg=load_config(None, list(overrides)))
        return "\n".join(TrainResult(run_dir=str(tmp_path), steps=8, minutes=1.0, final_model=None,
                                     val_after=metrics, trainer=trainer).summary_lines())

    assert "'####' marker in 0%" in lines()
    assert "'####'" not in lines(f"custom_reward_function.path={tmp_path / 'capitals.py'}")
    assert "'####'" not in lines("reward_model.enable=true", "reward_model.model.path=some/rm")
