"""Current verl's configuration surface: notices for keys without a meaning here, DAPO's spelling, reference-only
offload, loggers and sandbox URL checked while the configuration is read, devices fitted to the machine, Hydra's
--config-path/--config-name."""

from __future__ import annotations

import socket

import pytest
from omegaconf import OmegaConf

from rlanywhere.config import ConfigError, load_config
from rlanywhere.verl_compat import fit_world_to_machine, hydra_config_layer, resolve_loggers


def loaded(*overrides):
    notices: list[str] = []
    return load_config(None, list(overrides), notices=notices), "\n".join(notices)


def test_current_verl_keys_get_one_notice_each():
    keys = ["ray_kwargs.ray_init.runtime_env.env_vars.TOKENIZERS_PARALLELISM=true", "critic.fsdp.fsdp_size=-1",
            "actor_rollout_ref.model.torch_dtype=bfloat16", "actor_rollout_ref.actor.entropy_checkpointing=True"]
    _, notices = loaded(*keys)
    for key in keys:
        assert notices.count(key.split("=")[0]) == 1, key


def test_verls_tool_agent_loop_is_a_multi_turn_rollout():
    """verl picks each row's agent loop (default_agent_loop when the data names none): tool_agent is multi-turn
    with tools here; an agent loop not available here is refused, not run as a single turn."""
    cfg, notices = loaded("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                          "actor_rollout_ref.rollout.agent.num_workers=4")
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable is True
    assert "honoured as actor_rollout_ref.rollout.multi_turn.enable=true" in notices
    assert "agent.num_workers=4: verl-only key, ignored (no agent-loop workers" in notices
    cfg, notices = loaded("actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent")
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable is False and "multi_turn.enable decides" in notices
    for key in ("default_agent_loop=react_agent", "agent_loop_config_path=loops.yaml"):
        with pytest.raises(ConfigError, match="not available here"):
            loaded(f"actor_rollout_ref.rollout.agent.{key}")


def test_reference_offload_offloads_the_reference_only():
    cfg, notices = loaded("actor_rollout_ref.ref.fsdp_config.param_offload=True")
    assert cfg.hardware.ref_device == "cpu" and cfg.hardware.param_offload == "auto"
    assert "reference" in notices
    cfg, _ = loaded("actor_rollout_ref.actor.fsdp_config.param_offload=True")
    assert cfg.hardware.param_offload is True and cfg.hardware.ref_device == "auto"


def test_critic_fsdp_offload_is_honoured_like_the_old_spelling():
    cfg, notices = loaded("critic.fsdp.optimizer_offload=True")
    assert cfg.hardware.optimizer_offload is True and "critic.fsdp.optimizer_offload" in notices


def test_dapo_in_verls_spelling_is_our_overlong_penalty():
    cfg, notices = loaded("reward_model.reward_manager=dapo",
                          "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                          "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
                          "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
                          "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                          "+reward_model.reward_kwargs.max_resp_len=512", "data.max_response_length=512")
    buffer = cfg.reward_model.overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor) == (True, 64, 0.5)
    assert "honoured as reward_model.overlong_buffer.len=64" in notices and "max_resp_len=512" in notices


def test_max_resp_len_alone_in_its_layer_is_taken_with_a_notice():
    """DAPO's max_resp_len on a command line (or a YAML) without the overlong_buffer_cfg keys beside it: the key is
    taken with its notice and the reward_model section it leaves empty goes too (it read as an unknown key)."""
    cfg, notices = loaded("+reward_model.reward_kwargs.max_resp_len=512")
    assert "max_resp_len=512" in notices and cfg.reward_model.overlong_buffer.len == \
        load_config(None, []).reward_model.overlong_buffer.len


def test_prime_reward_manager_is_served():
    cfg, _ = loaded("reward_model.reward_manager=prime")
    assert cfg.reward_model.reward_manager == "prime"


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed when the socket is: nothing listens there


def test_unreachable_sandbox_is_an_error_with_the_other_problems():
    url = f"http://127.0.0.1:{_closed_port()}/run_code"
    with pytest.raises(ConfigError) as info:
        loaded(f"reward_model.sandbox_fusion.url={url}", "trainer.no_such_key=1")
    message = str(info.value)
    assert message.startswith("2 problems") and "cannot be reached" in message and url in message
    assert "trainer.no_such_key" in message


def test_reachable_sandbox_gets_a_notice():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        _, notices = loaded(f"reward_model.sandbox_fusion.url=http://127.0.0.1:{server.getsockname()[1]}/run_code")
    assert "reward_model.sandbox_fusion.url" in notices


def test_missing_logger_is_replaced_by_local_logging():
    absent = lambda name: None  # noqa: E731
    kept, notices = resolve_loggers(["console", "wandb"], installed=absent)
    assert kept == ["console", "tensorboard"] and len(notices) == 1 and "wandb is not installed" in notices[0]
    kept, notices = resolve_loggers(["console", "wandb", "tensorboard"], installed=absent)
    assert kept == ["console", "tensorboard"]
    kept, notices = resolve_loggers(["console", "wandb"], installed=lambda name: object())
    assert kept == ["console", "wandb"] and not notices
    kept, notices = resolve_loggers(["console", "swanlab"], installed=absent)
    assert kept == ["console", "tensorboard"] and "swanlab" in notices[0]


def test_trainer_logger_is_one_list_whichever_way_it_is_written(monkeypatch):
    """console,tensorboard / [console,TensorBoard] / a list: the same loggers; a name that is none is a config error
    (before the model loads, not a traceback after)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    for written in ("console,tensorboard", "[console,TensorBoard]", "['console', 'tensorboard']"):
        assert list(loaded(f"trainer.logger={written}")[0].trainer.logger) == ["console", "tensorboard"]
    cfg, notices = loaded("trainer.logger=[console,WandB]")
    assert list(cfg.trainer.logger) == ["console", "tensorboard"] and "wandb is not installed" in notices
    with pytest.raises(ConfigError, match="Unknown trainer.logger entry 'tensorbord'.*Did you mean 'tensorboard'"):
        loaded("trainer.logger=[console,tensorbord]")


@pytest.mark.parametrize("asked, gpus, device, torchrun, expected, says", [
    ((8, 1), 0, "auto", False, (1, 1), "the CPU"),
    ((8, 1), 1, "auto", False, (1, 1), "1 GPU"),
    ((8, 4), 8, "auto", False, (8, 1), "8 GPUs"),
    ((8, 1), 4, "auto", False, (4, 1), "4 GPUs"),
    ((2, 1), 0, "cpu", False, (2, 1), None),  # CPU processes asked for explicitly: left as asked
    ((4, 1), 4, "auto", False, (4, 1), None),
    ((8, 2), 0, "auto", True, (8, 2), None),  # torchrun decides
])
def test_devices_are_fitted_to_the_machine(asked, gpus, device, torchrun, expected, says):
    cfg = OmegaConf.create({"trainer": {"n_gpus_per_node": asked[0], "nnodes": asked[1]},
                            "hardware": {"device": device}})
    notice = fit_world_to_machine(cfg, gpus, torchrun)
    assert (cfg.trainer.n_gpus_per_node, cfg.trainer.nnodes) == expected
    if says is None:
        assert notice is None
    else:
        assert says in notice and f"asks for {asked[0] * asked[1]} devices" in notice


def test_hydra_config_with_verls_defaults(tmp_path):
    (tmp_path / "run.yaml").write_text("hydra:\n  searchpath: [file://verl/trainer/config]\n"
                                       "defaults:\n  - ppo_trainer\n  - extra\n  - _self_\n"
                                       "data:\n  train_batch_size: 8\n")
    (tmp_path / "extra.yaml").write_text("data:\n  train_batch_size: 4\n  max_prompt_length: 64\n")
    notices: list[str] = []
    layer = hydra_config_layer(str(tmp_path), "run", notices)
    cfg = load_config(None, ["data.max_response_length=32"], base=layer, notices=notices)
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (8, 64, 32)
    assert any("hydra settings ignored" in n for n in notices)
    assert OmegaConf.is_dict(hydra_config_layer(str(tmp_path), "ppo_megatron_trainer", notices))  # verl's own name
    with pytest.raises(Exception, match="not found"):
        hydra_config_layer(str(tmp_path), "missing", notices)


def test_cli_reads_hydra_options(tmp_path, capsys):
    from rlanywhere.cli import main

    (tmp_path / "run.yaml").write_text("defaults:\n  - ppo_trainer\n  - _self_\nalgorithm:\n  adv_estimator: nope\n")
    assert main(["plan", f"--config-path={tmp_path}", "--config-name=run", "trainer.no_such=1"]) == 2
    err = capsys.readouterr().err
    assert "adv_estimator='nope'" in err and "trainer.no_such" in err


def test_a_missing_logger_is_an_error_when_asked(monkeypatch):
    import rlanywhere.verl_compat as compat

    monkeypatch.setattr(compat, "resolve_loggers", lambda asked: (["console", "tensorboard"],
                                                                  ["trainer.logger: wandb is not installed (pip install "
                                                                   "wandb); logging to TensorBoard instead"]))
    cfg, notices = loaded("trainer.logger=[console,wandb]")
    assert list(cfg.trainer.logger) == ["console", "tensorboard"] and "wandb is not installed" in notices
    with pytest.raises(ConfigError, match="require_loggers"):
        loaded("trainer.logger=[console,wandb]", "hardware.require_loggers=true")
