"""The command line: prepare, plan, eval, chat, plot, and its errors — as a user types them (tiny model, CPU)."""

import json
import os
import shutil

import pytest

from rlanywhere import __version__
from rlanywhere.cli import main

from .test_e2e import base_overrides, run_training


def test_prepare_arithmetic_and_gsm8k(tmp_path, gsm8k_subset, capsys):
    assert main(["prepare", "arithmetic", "--out", str(tmp_path / "arith"), "--digits", "1", "--train-size", "20",
                 "--test-size", "5"]) == 0
    assert main(["prepare", "gsm8k", "--src", str(gsm8k_subset), "--out", str(tmp_path / "gsm8k")]) == 0
    out = capsys.readouterr().out
    assert "train.parquet" in out and (tmp_path / "gsm8k" / "test.parquet").exists()


def test_plan_prints_decisions_and_refuses_bf16_on_p40(capsys):
    assert main(["plan", "actor_rollout_ref.model.path=qwen2.5-0.5b", "--emulate", "p40"]) == 0
    out = capsys.readouterr().out
    assert "fp32" in out and "predicted peak memory per phase" in out
    assert main(["plan", "actor_rollout_ref.model.path=qwen2.5-0.5b", "hardware.precision=bf16",
                 "--emulate", "p40"]) == 2
    assert "compute capability" in capsys.readouterr().out


def test_plan_for_emulated_cards_keeps_the_world_asked_for(capsys, monkeypatch):
    """`plan --emulate p40` with trainer.n_gpus_per_node=2 plans two P40s (sharded, NCCL) whatever GPUs this machine
    has, as docs/distributed.md shows: nothing runs here. (It planned one device on a machine without a GPU.)"""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    job = ["actor_rollout_ref.model.path=qwen2.5-1.5b", "algorithm.adv_estimator=grpo", "data.train_batch_size=16",
           "actor_rollout_ref.rollout.n=8", "data.max_prompt_length=256", "data.max_response_length=512",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "hardware.optimizer_offload=false"]
    assert main(["plan", *job, "--emulate", "p40"]) == 2  # one P40: the update needs 28.75 GiB
    assert "28.75 GiB in actor_update" in capsys.readouterr().out
    for emulated in (["--emulate", "p40"], ["hardware.emulate=p40"]):
        assert main(["plan", *job, "trainer.n_gpus_per_node=2", *emulated]) == 0
        captured = capsys.readouterr()
        assert "2 x shard (nccl)" in captured.out and "plans and trains on the CPU" not in captured.err


def test_eval_and_plot_a_trained_run(tiny_model_dir, arith_data, tmp_path, capsys):
    run = tmp_path / "run"
    trainer, _ = run_training(base_overrides(tiny_model_dir, arith_data, run, **{"algorithm.adv_estimator": "grpo"}))
    checkpointed = run / "checkpoints" / "global_step_2" / "actor"
    # save_freq=2 wrote a checkpoint at the last step: final_model/ links its actor's files, no second copy
    actor = run / "final_model"
    assert trainer.save_final_model() == str(actor) and (actor / "config.json").exists()
    weights = next(actor.glob("*.safetensors"))
    assert weights.stat().st_ino == (checkpointed / weights.name).stat().st_ino  # the same file on disk
    assert json.loads((actor / "config.json").read_text())["use_cache"] is True  # as users load it (training: off)
    out_json = tmp_path / "eval.json"
    assert main(["eval", "--model", str(actor), "--data", str(arith_data / "test.parquet"), "--max-samples", "6",
                 "--max-new-tokens", "8", "--out", str(out_json), "hardware.device=cpu"]) == 0
    result = json.loads(out_json.read_text())
    assert result["num_samples"] == 6 and 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["format_rate"] <= 1.0
    capsys.readouterr()
    assert main(["plot", str(run)]) == 0
    pngs = [line for line in capsys.readouterr().out.splitlines() if line.endswith(".png")]
    assert pngs and all(os.path.exists(p) for p in pngs)


def test_missing_data_file_is_a_clear_error(tiny_model_dir, tmp_path, capsys):
    code = main(["train", f"actor_rollout_ref.model.path={tiny_model_dir}",
                 f"data.train_files={tmp_path}/nope.parquet", f"trainer.default_local_dir={tmp_path}/run",
                 "hardware.device=cpu"])
    assert code == 2
    assert "rlanywhere prepare" in capsys.readouterr().err


def test_chat_answers_a_prompt(tiny_model_dir, capsys):
    assert main(["chat", "--model", str(tiny_model_dir), "--prompt", "What is 12 + 34 ?", "--prompt", "12 + 34",
                 "--max-new-tokens", "4"]) == 0
    answers = capsys.readouterr().out.strip().splitlines()
    assert len(answers) == 2


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"rlanywhere {__version__}"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_yaml_syntax_error_is_one_line_naming_file_and_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("data:\n  train_batch_size: 4\n actor_rollout_ref:\n  x: 1\n")
    assert main(["plan", str(path)]) == 2
    line = one_error_line(capsys)
    assert f"{path}:3:" in line and "YAML" in line
    path.write_text("- just\n- a list\n")
    assert main(["plan", str(path)]) == 2
    assert "mapping" in one_error_line(capsys)


def test_model_dir_without_weights_is_one_line(tiny_model_dir, arith_data, tmp_path, capsys):
    no_weights = tmp_path / "no_weights"
    shutil.copytree(tiny_model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors"))
    assert main(["eval", "--model", str(no_weights), "--data", str(arith_data / "test.parquet"),
                 "hardware.device=cpu"]) == 2
    line = one_error_line(capsys)
    assert str(no_weights) in line and "no weights" in line and "model.safetensors" in line


def test_batch_sizes_must_divide_as_in_verl(capsys):
    assert main(["plan", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=3"]) == 2
    line = one_error_line(capsys)
    assert "data.train_batch_size=4" in line and "ppo_mini_batch_size=3" in line and "e.g. 2" in line


def test_verbose_adds_the_traceback_and_a_bug_keeps_it(tmp_path, capsys, monkeypatch):
    args = ["plan", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=3"]
    assert main([*args, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")
    assert main(["-v", *args]) == 2 and "Traceback" in capsys.readouterr().err
    assert main(["train", "not-a-config"]) == 2 and "neither a config file" in one_error_line(capsys)

    def broken(_args):
        raise ZeroDivisionError("a bug")

    from rlanywhere import cli

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["plan"].set_defaults(func=broken)
    with pytest.raises(ZeroDivisionError):  # not a user error: the traceback stays
        main(["plan"])


def test_demo_with_overrides_is_a_new_run_with_a_summary(tiny_model_dir, arith_data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    overrides = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"data.train_files={arith_data}/train.parquet",
                 f"data.val_files={arith_data}/test.parquet", "trainer.total_training_steps=1", "trainer.test_freq=1",
                 "data.val_max_samples=4", "trainer.logger=['console']", "hardware.device=cpu"]
    assert main(["demo", *overrides]) == 0
    out = capsys.readouterr().out
    runs = [p for p in (tmp_path / "runs" / "demo").iterdir() if p.name.startswith("smollm2-grpo-arith-")]
    assert len(runs) == 1 and "demo: a new run in" in out
    assert os.path.realpath(tmp_path / "runs" / "demo" / "latest") == str(runs[0])
    assert "held-out accuracy (4 prompts, greedy):" in out and "1 steps in" in out
    assert f"rlanywhere chat --model {runs[0] / 'final_model'}" in out
    assert (runs[0] / "final_model" / "model.safetensors").exists()
    from omegaconf import OmegaConf

    config = OmegaConf.load(runs[0] / "config.yaml")  # the demo profile under the overrides
    assert config.actor_rollout_ref.rollout.n == 8 and config.algorithm.adv_estimator == "grpo"
    assert config.data.train_batch_size == 4 and config.trainer.total_training_steps == 1


def test_help_version_and_command_line_errors_answer_without_importing_torch():
    """`rlanywhere --help`, `--version` and a mistyped command line answer in a fraction of a second: torch (about
    3 s to import) loads only when a command needs it."""
    import subprocess
    import sys

    probe = ("import sys\nfrom rlanywhere import cli\nfor argv in (['--help'], ['train', '--help'], ['--version'], "
             "['prepare', 'no-such-task'], ['train', '--no-such-option']):\n"
             "    try:\n        cli.main(argv)\n    except SystemExit:\n        pass\n"
             "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout[-2000:]


@pytest.mark.parametrize("override, message", [
    ("data.train_files=*.parquet", "is not a value the command line can read"),  # an unexpanded shell pattern
    ("data.train_files=[a.parquet", "quote it"),
    ("data.train_batch_size=abc", "data.train_batch_size='abc': expected an integer"),
    ("actor_rollout_ref.actor.optim.lr=1e-6x", "expected a number"),
    ("trainer.val_before_train=maybe", "expected true or false"),
])
def test_values_the_command_line_cannot_read_get_one_error_line(override, message, capsys):
    assert main(["plan", "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", override, "--emulate",
                 "h100"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "object_type" not in err


def test_prepare_and_eval_name_their_inputs_before_anything_loads(tmp_path, capsys):
    source = tmp_path / "rows.jsonl"
    source.write_text('{"q": "1 + 1", "a": "2"}\n{"q": "1 + 2", "a": "3"}\n')
    assert main(["prepare", "generic", "--src", str(source), "--prompt-key", "question", "--answer-key", "a",
                 "--out", str(tmp_path / "out")]) == 2
    assert "column 'question' not found" in capsys.readouterr().err
    assert main(["prepare", "arithmetic", "--digits", "0", "--out", str(tmp_path / "arith")]) == 2
    assert "digits must be an integer >= 1" in capsys.readouterr().err
    assert main(["prepare", "gsm8k", "--src", "tests/data/no-such-folder", "--out", str(tmp_path / "g")]) == 2
    assert "is not a directory" in capsys.readouterr().err  # a path, not a hub dataset name
    assert main(["eval", "--model", "/no/such/model", "--data", str(tmp_path / "missing.parquet")]) == 2
    assert "--data:" in capsys.readouterr().err


def test_flags_and_an_empty_run_get_one_line_errors(tmp_path, capsys):
    for argv in (["chat", "--model", "m", "--prompt", "hi", "--temperature", "-1"],
                 ["eval", "--model", "m", "--data", "d.parquet", "--batch-size", "0"],
                 ["eval", "--model", "m", "--data", "d.parquet", "--max-new-tokens", "0"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path)]) == 2
    assert "has no metrics yet" in capsys.readouterr().err
