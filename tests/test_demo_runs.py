"""The demo's run folders: `latest` names only a run with a final model, a run that saved nothing leaves nothing,
Ctrl-C names the command that continues, and `rlanywhere demo --resume` continues that run as it was."""

from __future__ import annotations

import json
import os
import signal

import pytest
from omegaconf import OmegaConf

from rlanywhere import api
from rlanywhere.cli import main
from rlanywhere.config import to_yaml
from rlanywhere.runguard import RunInterrupted, config_changes


@pytest.fixture
def demo_args(tiny_model_dir, arith_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={arith_data}/train.parquet",
            f"data.val_files={arith_data}/test.parquet", "trainer.logger=['console']", "hardware.device=cpu"]


def _finished_run(tmp_path):
    """An earlier demo with a final model, and `latest` pointing at it."""
    old = tmp_path / "runs" / "demo" / "smollm2-grpo-arith-earlier"
    (old / "final_model").mkdir(parents=True)
    (old / "final_model" / "config.json").write_text("{}")
    os.symlink(old.name, tmp_path / "runs" / "demo" / "latest")
    return old


def _demo_runs(tmp_path):
    return sorted(p.name for p in (tmp_path / "runs" / "demo").iterdir() if p.name != "latest")


def _fake_train(saves_checkpoint: bool, stop):
    """api.train that starts the run folder as the trainer does (config.yaml first), maybe saves a checkpoint, then
    stops with `stop`."""
    def train(cfg, run_plan=None, notices=None):
        run_dir = os.path.abspath(cfg.trainer.default_local_dir)
        os.makedirs(run_dir, exist_ok=True)
        (open(os.path.join(run_dir, "config.yaml"), "w")).write(to_yaml(cfg))
        checkpoint = None
        if saves_checkpoint:
            checkpoint = os.path.join(run_dir, "checkpoints", "global_step_1")
            os.makedirs(checkpoint)
            with open(os.path.join(checkpoint, "trainer_state.json"), "w") as handle:
                json.dump({"global_step": 1}, handle)
            with open(os.path.join(checkpoint, "config.yaml"), "w") as handle:
                handle.write(to_yaml(cfg))
        raise stop(checkpoint) if callable(stop) else stop
    return train


def test_a_demo_with_a_bad_input_leaves_latest_and_no_folder(demo_args, tmp_path, capsys):
    old = _finished_run(tmp_path)
    bad = [arg for arg in demo_args if not arg.startswith("data.val_files")] + [
        f"data.val_files={tmp_path}/missing.parquet"]
    assert main(["demo", *bad]) == 2
    assert "data.val_files" in capsys.readouterr().err
    assert os.path.realpath(tmp_path / "runs" / "demo" / "latest") == str(old)
    assert _demo_runs(tmp_path) == [old.name]


@pytest.mark.parametrize("stop", [KeyboardInterrupt(), RuntimeError("the reward function crashed"),
                                  RunInterrupted(signal.SIGTERM, 0, None)])
def test_a_demo_that_saved_nothing_removes_its_folder(demo_args, tmp_path, monkeypatch, capsys, stop):
    old = _finished_run(tmp_path)
    monkeypatch.setattr(api, "train", _fake_train(False, stop))
    if isinstance(stop, KeyboardInterrupt):
        assert main(["demo", *demo_args]) == 130
    elif isinstance(stop, RunInterrupted):  # stopped during the first step: nothing saved, nothing to resume
        assert main(["demo", *demo_args]) == 143
        err = capsys.readouterr().err
        assert "nothing to continue: run the demo again" in err and "--resume" not in err
    else:
        with pytest.raises(RuntimeError):
            main(["demo", *demo_args])
    assert os.path.realpath(tmp_path / "runs" / "demo" / "latest") == str(old)
    assert _demo_runs(tmp_path) == [old.name]


def test_ctrl_c_names_the_resume_command_and_resume_continues_that_run(demo_args, tmp_path, monkeypatch, capsys):
    old = _finished_run(tmp_path)
    monkeypatch.setattr(api, "train", _fake_train(True, lambda ckpt: RunInterrupted(signal.SIGINT, 1, ckpt)))
    assert main(["demo", *demo_args]) == 130
    err = capsys.readouterr().err
    assert "to continue it: rlanywhere demo --resume" in err and "same command" not in err
    # the interrupted run keeps its checkpoint; `latest` still names a model
    assert os.path.realpath(tmp_path / "runs" / "demo" / "latest") == str(old)
    interrupted = [name for name in _demo_runs(tmp_path) if name != old.name]
    assert len(interrupted) == 1
    run_dir = tmp_path / "runs" / "demo" / interrupted[0]
    saved = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)

    seen = {}

    def resumed(cfg, run_plan=None, notices=None):
        seen["cfg"] = cfg
        final = run_dir / "final_model"
        final.mkdir()
        (final / "config.json").write_text("{}")
        return api.TrainResult(run_dir=str(run_dir), steps=2, minutes=0.1, final_model=str(final), first_step=1)

    monkeypatch.setattr(api, "train", resumed)
    assert main(["demo", "--resume", *demo_args]) == 0
    out = capsys.readouterr().out
    assert f"demo: continuing {run_dir} from global_step_1" in out and "a new run" not in out
    # the same run, the same config: nothing for the resume to warn about
    assert os.path.abspath(seen["cfg"].trainer.default_local_dir) == str(run_dir)
    assert config_changes(saved, OmegaConf.to_container(seen["cfg"], resolve=True)) == {}
    # it finished with a final model: now `latest` names it
    assert os.path.realpath(tmp_path / "runs" / "demo" / "latest") == str(run_dir)


def test_resume_without_an_unfinished_demo_says_so(demo_args, tmp_path, capsys):
    _finished_run(tmp_path)
    assert main(["demo", "--resume", *demo_args]) == 2
    assert "no unfinished demo" in capsys.readouterr().err
