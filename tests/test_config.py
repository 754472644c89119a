"""Config: verl keys, overrides, verl-only notices, unknown-key errors with the closest valid key."""

import pytest

from rlanywhere.config import ConfigError, as_list, load_config, schema_keys

from .conftest import VERL_P40_ARGS


def test_defaults_follow_verl():
    cfg = load_config()
    assert cfg.algorithm.adv_estimator == "gae"
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2
    assert cfg.actor_rollout_ref.actor.kl_loss_type == "low_var_kl"
    assert cfg.trainer.resume_mode == "auto"
    for key in ("data.train_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                "critic.cliprange_value", "algorithm.kl_ctrl.target_kl", "trainer.default_local_dir"):
        assert key in schema_keys()


def test_overrides_yaml_and_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_batch_size: 16\nalgorithm:\n  adv_estimator: grpo\n")
    cfg = load_config(str(path), ["data.train_batch_size=32", "+trainer.logger=['console','wandb']"])
    assert cfg.data.train_batch_size == 32  # overrides win over the file
    assert cfg.algorithm.adv_estimator == "grpo"
    # wandb where it is installed, else local logging in its place (a notice says so)
    assert list(cfg.trainer.logger) in (["console", "wandb"], ["console", "tensorboard"])


def test_verl_p40_fixture_parses_with_notices():
    notices = []
    args = [line for line in VERL_P40_ARGS.read_text().splitlines() if line.strip()]
    cfg = load_config(None, args, notices=notices)
    assert cfg.data.train_batch_size == 1 and cfg.critic.optim.lr == 1e-6
    assert cfg.actor_rollout_ref.rollout.name == "auto"  # vllm -> our engine
    assert cfg.hardware.param_offload is True  # fsdp_config offload honoured
    joined = "\n".join(notices)
    for key in ("gpu_memory_utilization", "max_num_seqs", "tensor_model_parallel_size", "fsdp_config.cpu_offload",
                "rollout.name=vllm"):
        assert key in joined


@pytest.mark.parametrize("value, group", [(2, 2), (-1, 0), (0, 0)])
def test_verl_fsdp_size_is_honoured_as_the_shard_group_size(value, group):
    """verl's actor fsdp_size (-1: all ranks) sets the shard group (HSDP below the world size); the critic's and
    the reference's are noticed, not applied (one group size for every model)."""
    notices = []
    cfg = load_config(None, [f"actor_rollout_ref.actor.fsdp_config.fsdp_size={value}",
                             "critic.model.fsdp_config.fsdp_size=4"], notices=notices)
    assert cfg.hardware.shard_group_size == group
    assert any("honoured as hardware.shard_group_size" in n for n in notices) is (group > 0)
    assert any("critic.model.fsdp_config.fsdp_size=4: verl-only key, ignored" in n for n in notices)


@pytest.mark.parametrize("override,expected", [
    ("data.train_batch_sise=3", "did you mean 'data.train_batch_size'"),
    ("critic.optim.lrr=1", "did you mean 'critic.optim.lr'"),
    ("algorithm.adv_estimator=ppo", "choose one of gae, grpo"),
    ("data.train_batch_size=abc", "train_batch_size"),
    ("data.train_batch_size=0", "must be positive"),
    ("hardware.precision=bf32", "choose one of auto, fp32, bf16, fp16"),
    ("trainer.resume_mode=resume_path", "resume_from_path"),
    ("no_equals_sign", "has no '='"),
    ("trainer.seed=-1", "use e.g. trainer.seed=1"),
    ("data.seed=-7", "use e.g. data.seed=7"),
])
def test_bad_input_names_problem_and_fix(override, expected):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(None, [override])
    assert expected in str(info.value)


def test_as_list_accepts_all_spellings():
    assert as_list("a.parquet") == ["a.parquet"]
    assert as_list("['a.parquet', 'b.parquet']") == ["a.parquet", "b.parquet"]
    assert as_list(["x"]) == ["x"]
    assert as_list(None) == []


def test_gamma_with_reinforce_plus_plus_baseline_is_noticed():
    notices: list[str] = []
    load_config(None, ["algorithm.adv_estimator=reinforce_plus_plus_baseline", "algorithm.gamma=0.99"], notices=notices)
    assert any("verl ignores gamma" in line for line in notices)
    notices.clear()
    load_config(None, ["algorithm.adv_estimator=reinforce_plus_plus_baseline", "actor_rollout_ref.rollout.n=4"],
                notices=notices)
    assert notices == []


@pytest.mark.parametrize("overrides, message", [
    (["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=3"], "e.g. 2"),
    (["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], "e.g. 3"),
    (["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
      "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"],
     "mini-batch of 6 sequences"),
    (["algorithm.adv_estimator=gae", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
      "critic.ppo_mini_batch_size=3"], "critic.ppo_mini_batch_size=3"),
])
def test_batch_sizes_must_divide(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_batch_sizes_that_divide_or_exceed_are_accepted():
    ok = [["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
          ["data.train_batch_size=32"],  # the default mini-batch (256) holds the whole step
          ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"],  # a micro-batch holding the whole mini-batch
          ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
           "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"],
          ["algorithm.adv_estimator=grpo", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           "critic.ppo_mini_batch_size=3"]]  # no critic in GRPO: its keys are not used
    for overrides in ok:
        load_config(None, overrides)


def test_pf_ppo_outside_gae_is_noticed_as_verl_ignores_it():
    notices: list[str] = []
    load_config(None, ["algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=true"], notices=notices)
    assert any("PF-PPO reweights the rows of gae runs only" in line for line in notices)
    notices.clear()
    load_config(None, ["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"], notices=notices)
    assert any("its advantage is its raw score (no baseline), as in verl" in line for line in notices)


def test_keys_a_loss_does_not_follow_are_noticed():
    """GSPO's policy loss averages per sequence whatever loss_agg_mode says; bypass mode logs rollout_is's weights
    without applying them. Each is said once, and not when the settings agree."""
    notices: list[str] = []
    load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], notices=notices)
    assert sum("GSPO's policy loss averages per sequence" in line for line in notices) == 1
    notices.clear()
    load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                       "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], notices=notices)
    assert not any("GSPO" in line for line in notices)
    load_config(None, ["algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.rollout_is=token"],
                notices=notices)
    assert sum("the importance weights are logged, not applied" in line for line in notices) == 1
