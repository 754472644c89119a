"""The command line: prepare, plan, eval, plot — as a user types them (tiny model, CPU)."""

import json
import os


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


def test_eval_and_plot_a_trained_run(tiny_model_dir, arith_data, tmp_path, capsys):
    run = tmp_path / "run"
    run_training(base_overrides(tiny_model_dir, arith_data, run, **{"algorithm.adv_estimator": "grpo"}))
    actor = run / "checkpoints" / "global_step_2" / "actor"
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
