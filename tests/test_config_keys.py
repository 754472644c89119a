"""No key accepted and ignored (issue 10): every key of the schema is read by the run, or it is listed in
config.ACCEPTED_WITHOUT_EFFECT with a one-line notice of what happens instead, printed when a user sets it.

Reads are recorded for real: DictConfig attribute/item access is wrapped while a few short runs (PPO with critic,
KL in reward and as a loss, GRPO with LoRA and token budgets, a validation, a checkpoint and a resume) plan, build,
step, validate, save and resume on the CPU with a tiny model."""

from __future__ import annotations

import re

import pytest
from omegaconf import DictConfig

from rlanywhere import config as config_module
from rlanywhere.config import ACCEPTED_WITHOUT_EFFECT, load_config, schema_keys
from rlanywhere.planner import make_plan
from rlanywhere.trainer import RLTrainer

from .test_e2e import base_overrides

RUNS = {
    "ppo": {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True, "algorithm.use_pf_ppo": True,
            "algorithm.kl_ctrl.type": "adaptive", "actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.actor.optim.warmup_style": "cosine", "critic.optim.warmup_style": "cosine",
            "trainer.max_actor_ckpt_to_keep": 1, "data.val_batch_size": 4,
            "actor_rollout_ref.rollout.stop": "['####']", "critic.model.lora_rank": 2,
            "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
            "actor_rollout_ref.rollout.val_kwargs.temperature": 0.5},
    "grpo-lora": {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.model.lora_rank": 4,
                  "actor_rollout_ref.actor.use_dynamic_bsz": True, "trainer.total_training_steps": 1,
                  "trainer.save_freq": 1, "trainer.test_freq": 1, "data.seed": 5,
                  "actor_rollout_ref.model.enable_gradient_checkpointing": True},
    "dapo-gspo": {"algorithm.adv_estimator": "grpo", "algorithm.filter_groups.enable": True,
                  "algorithm.filter_groups.max_num_gen_batches": 2, "data.gen_batch_size": 3,
                  "reward_model.overlong_buffer.enable": True, "reward_model.overlong_buffer.len": 4,
                  "algorithm.mask_truncated_completions": True, "trainer.total_training_steps": 1,
                  "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"},
}


def _record_reads(monkeypatch) -> set[str]:
    reads: set[str] = set()
    original_getattr, original_getitem = DictConfig.__getattr__, DictConfig.__getitem__

    def note(node, key):
        if isinstance(key, str) and not key.startswith("_"):
            try:
                reads.add(node._get_full_key(key))
            except Exception:  # noqa: BLE001 - a key OmegaConf cannot name is not ours
                pass

    def getattr_(self, key):
        note(self, key)
        return original_getattr(self, key)

    def getitem_(self, key):
        note(self, key)
        return original_getitem(self, key)

    monkeypatch.setattr(DictConfig, "__getattr__", getattr_)
    monkeypatch.setattr(DictConfig, "__getitem__", getitem_)
    return reads


def _listed(key: str) -> bool:
    return any(re.fullmatch(pattern, key) for pattern in ACCEPTED_WITHOUT_EFFECT)


@pytest.mark.slow
def test_every_schema_key_is_read_or_noticed(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n")
    runs = {name: dict(extra) for name, extra in RUNS.items()}
    # a reward model (reward_model.py) and a generative judge: their keys are read only when enabled
    from .test_reward_model import build_tiny_reward_model

    verdict = tmp_path / "verdict.py"
    verdict.write_text("def words(text):\n    return float(len(text.split()))\n")
    runs["ppo-rm"] = {"algorithm.adv_estimator": "gae", "trainer.total_training_steps": 1, "trainer.test_freq": -1,
                      "reward_model.enable": True, "reward_model.model.path": str(
                          build_tiny_reward_model(tmp_path / "tiny_rm")), "reward_model.use_dynamic_bsz": True,
                      "reward_model.forward_max_token_len_per_gpu": 256, "reward_model.max_length": 64,
                      "reward_model.micro_batch_size_per_gpu": 2}
    runs["grpo-judge"] = {"algorithm.adv_estimator": "grpo", "trainer.total_training_steps": 1,
                          "trainer.test_freq": -1, "reward_model.enable": True,
                          "reward_model.model.path": str(tiny_model_dir), "reward_model.judge.enable": True,
                          "reward_model.judge.max_new_tokens": 2, "reward_model.judge.verdict_function.path":
                          str(verdict), "reward_model.judge.verdict_function.name": "words"}
    runs["ppo"].update({"critic.model.path": f"{tiny_model_dir}/",  # a separately loaded critic
                        "custom_reward_function.path": str(reward_file), "custom_reward_function.name": "score"})
    reads = _record_reads(monkeypatch)
    for name, extra in runs.items():
        cfg = load_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path / name, **extra))
        trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
        trainer.fit()
        resumed = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
        resumed.maybe_resume()
    # an explicit checkpoint to resume from
    checkpoint = tmp_path / "grpo-lora" / "checkpoints" / "global_step_1"
    cfg = load_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path / "from-path", **{
        **RUNS["grpo-lora"], "trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(checkpoint)}))
    from_path = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
    from_path.maybe_resume()
    assert from_path.global_step == 1
    # epochs count only when no step count is given
    cfg = load_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path / "epochs",
                                           **{"trainer.total_training_steps": "null", "trainer.total_epochs": 1}))
    assert RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir).total_steps == 16
    unread = [key for key in schema_keys() if key not in reads and not _listed(key)
              and not any(key.startswith(r + ".") for r in reads if r.endswith("override_config"))]
    assert not unread, f"schema keys neither read by a run nor listed in ACCEPTED_WITHOUT_EFFECT: {unread}"
    # a listed key must really be unread: otherwise its notice would be a lie
    misleading = [key for key in schema_keys() if _listed(key) and key in reads]
    assert not misleading, f"listed as without effect but read by the run: {misleading}"


def test_setting_a_key_without_effect_prints_what_happens_instead():
    notices: list[str] = []
    load_config(None, ["actor_rollout_ref.model.use_remove_padding=false", "data.train_batch_size=8"],
                notices=notices)
    assert len(notices) == 1 and "use_remove_padding" in notices[0] and "padding" in notices[0]
    # left at its default, it says nothing
    notices.clear()
    load_config(None, ["data.train_batch_size=8"], notices=notices)
    assert notices == []


def test_every_listed_pattern_names_schema_keys():
    keys = schema_keys()
    for pattern, reason in ACCEPTED_WITHOUT_EFFECT.items():
        assert any(re.fullmatch(pattern, key) for key in keys), pattern
        assert reason and len(reason) < 160, pattern
    assert config_module.ACCEPTED_WITHOUT_EFFECT is ACCEPTED_WITHOUT_EFFECT


def test_cosine_schedule_decays_to_min_lr_ratio():
    import torch

    from rlanywhere.builders import make_scheduler

    cfg = load_config(None, ["actor_rollout_ref.actor.optim.warmup_style=cosine",
                             "actor_rollout_ref.actor.optim.min_lr_ratio=0.1", "actor_rollout_ref.actor.optim.lr=1.0"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = make_scheduler(optimizer, cfg.actor_rollout_ref.actor.optim, total_steps=10)
    lrs = []
    for _ in range(10):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs[-1] == pytest.approx(0.1) and lrs[4] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: mid-point


def test_reward_fn_key_picks_the_column_that_names_the_reward(tiny_model_dir, arith_data, tmp_path):
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from rlanywhere.data import RLDataset

    table = pq.read_table(arith_data / "test.parquet")
    table = table.append_column("task_family", [["gsm8k"] * table.num_rows])
    path = tmp_path / "with_ability.parquet"
    pq.write_table(table, path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert RLDataset([str(path)], tokenizer, 64, reward_fn_key="task_family")[0]["data_source"] == "gsm8k"
    with pytest.raises(KeyError, match="reward_fn_key"):
        RLDataset([str(path)], tokenizer, 64, reward_fn_key="nope")


def test_ignore_eos_applies_to_training_rollouts_only(tiny_model_dir, arith_data, tmp_path):
    cfg = load_config(None, base_overrides(tiny_model_dir, arith_data, tmp_path, **{
        "actor_rollout_ref.rollout.ignore_eos": True, "algorithm.adv_estimator": "grpo"}))
    trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
    assert trainer.rollouts.sampling_params().ignore_eos and not trainer.rollouts.sampling_params(validation=True).ignore_eos
    items = trainer.loader.next_batch()
    rollout = trainer.rollouts.generate(items, trainer.rollouts.sampling_params(), trainer.rollouts.step_generator(0))
    assert bool((rollout.response_mask.sum(-1) == trainer.response_length).all())


@pytest.mark.parametrize("override, needle", [("reward_model.enable=true", "reward_model.model.path"),
                                              ("reward_model.reward_manager=limited", "naive")])
def test_reward_model_keys_we_cannot_honour_are_refused(override, needle):
    from rlanywhere.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load_config(None, [override])
