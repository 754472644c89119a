"""The TRL comparison benches' own logic (bench/vs_trl.py, bench/time_to_accuracy.py, bench/sides.py,
bench/first_steps.py), against
hand-computed numbers; and that every override the benches pass is a key rlanywhere's config accepts."""

from __future__ import annotations

import os
import sys

import pytest
from types import SimpleNamespace
from omegaconf import OmegaConf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import first_steps  # noqa: E402
import sides  # noqa: E402
import time_to_accuracy as tta  # noqa: E402
import trace_gaps  # noqa: E402
import vs_trl  # noqa: E402

from rlanywhere.cli import demo_profile  # noqa: E402
from rlanywhere.config import load_config  # noqa: E402


# ---------------------------------------------------------------- vs_trl: steady-state summary
def test_steady_summary_drops_warmup_takes_medians_and_highest_peak():
    records = [
        {"step": 1, "perf/step_time_s": 9.0, "timing/rollout": 5.0, "perf/peak_memory_gib": 30.0},  # warm-up
        {"step": 2, "perf/step_time_s": 2.0, "timing/rollout": 1.0, "perf/peak_memory_gib": 10.0},
        {"step": 3, "perf/step_time_s": 4.0, "timing/rollout": 3.0, "perf/peak_memory_gib": 12.0},
        {"step": 4, "perf/step_time_s": 3.0, "timing/rollout": 2.0, "perf/peak_memory_gib": 11.0},
        {"step": 4, "val/acc": 0.5},  # a validation record: no step time, not a step
    ]
    summary = vs_trl.steady_summary(records, {"s/step": "perf/step_time_s", "generate s": "timing/rollout",
                                              "critic s": None, "update s": "timing/update_actor"}, warmup=1)
    # steps 2..4: times 2, 4, 3 -> median 3; rollout 1, 3, 2 -> 2; peak max(10, 12, 11) = 12 (not the warm-up's 30)
    # and the first step's time on its own (compiling and capture)
    assert summary == {"steps_timed": 3, "1st step s": 9.0, "s/step": 3.0, "generate s": 2.0, "critic s": None,
                       "update s": None, "peak GiB": 12.0}


def test_steady_summary_reports_what_the_first_step_spent_compiling_and_capturing():
    records = [{"step": 1, "perf/step_time_s": 9.0, "perf/compile_s": 4.5, "perf/graph_capture_s": 1.25},
               {"step": 2, "perf/step_time_s": 2.0, "perf/compile_s": 0.0, "perf/graph_capture_s": 0.0}]
    summary = vs_trl.steady_summary(records, {"s/step": "perf/step_time_s"}, warmup=1)
    assert (summary["1st step s"], summary["1st compile s"], summary["1st capture s"]) == (9.0, 4.5, 1.25)
    row = vs_trl.format_table([("ours", summary)]).splitlines()[1].split()
    assert row[-3:] == ["9.000", "4.500", "1.250"]


def test_steady_summary_without_steady_steps_says_raise_steps():
    with pytest.raises(SystemExit, match="raise --steps"):
        vs_trl.steady_summary([{"step": 1, "perf/step_time_s": 1.0}], {"s/step": "perf/step_time_s"}, warmup=1)


def test_throughput_and_ratio_to_trl():
    # 128 samples in 1.6 s = 80 samples/s; TRL at 16 samples/s -> 5x
    out = vs_trl.with_throughput({"s/step": 1.6}, 128, 16.0)
    assert out["samples/s"] == pytest.approx(80.0)
    assert out["x TRL"] == pytest.approx(5.0)
    assert vs_trl.with_throughput({"s/step": 1.6}, 128, None)["x TRL"] is None


def test_format_table_prints_dashes_for_missing_cells():
    table = vs_trl.format_table([("trl", {"s/step": 5.0, "samples/s": 25.6})])
    header, row = table.splitlines()
    assert header.split()[:3] == ["run", "s/step", "samples/s"]
    assert row.split()[:4] == ["trl", "5.000", "25.600", "-"]


# ---------------------------------------------------------------- overrides are keys rlanywhere accepts
def test_vs_trl_overrides_load_as_rlanywhere_config():
    work = dict(prompts=16, n=8, new_tokens=256, max_prompt_length=256)
    overrides = vs_trl.grpo_overrides(work, "/m", "/p.parquet", 1e-6, 5)
    cfg = load_config(None, [*sides.BENCH_RUN_OVERRIDES, *overrides,
                             "actor_rollout_ref.model.enable_gradient_checkpointing=true"])
    assert cfg.trainer.resume_mode == "disable" and cfg.trainer.save_freq == 0
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, cfg.data.max_response_length) == (16, 8, 256)
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 16  # one optimizer step a step, as TRL's run
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and cfg.algorithm.adv_estimator == "grpo"
    ppo = load_config(None, vs_trl.ppo_overrides("/m", "/p.parquet", 3, vs_trl.PPO_SIZES["full"]))
    assert (ppo.data.train_batch_size, ppo.data.max_response_length, ppo.actor_rollout_ref.actor.ppo_mini_batch_size,
            ppo.critic.optim.lr, ppo.algorithm.adv_estimator) == (256, 512, 64, 1e-5, "gae")


def test_flatten_overrides_hand_example():
    tree = {"a": {"b": 1, "c": True, "d": ["x", "y"]}, "e": 0.5}
    assert tta.flatten_overrides(tree) == ["a.b=1", "a.c=true", "a.d=[x,y]", "e=0.5"]


def test_demo_profile_as_overrides_is_the_demo_profile():
    profile = demo_profile(on_gpu=True)
    as_base = load_config(None, [], base=OmegaConf.create(profile))
    as_overrides = load_config(None, tta.flatten_overrides(profile))
    assert OmegaConf.to_container(as_overrides) == OmegaConf.to_container(as_base)
    # and the validation time_to_accuracy turns back on after the bench defaults (later overrides win)
    cfg = load_config(None, list(sides.BENCH_RUN_OVERRIDES) + tta.flatten_overrides(profile)
                      + ["trainer.val_before_train=true", "trainer.test_freq=5"])
    assert cfg.trainer.val_before_train is True and cfg.trainer.test_freq == 5


def test_gae_keeps_the_step_sequences_with_one_sample_a_prompt():
    profile = demo_profile(on_gpu=True)  # 64 prompts x 8, mini-batch 32 prompts
    cfg = load_config(None, tta.flatten_overrides(profile) + tta.algorithm_overrides("gae", profile))
    assert cfg.actor_rollout_ref.rollout.n == 1
    assert cfg.data.train_batch_size == 512 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert tta.algorithm_overrides("rloo", profile) == ["algorithm.adv_estimator=rloo"]


# ---------------------------------------------------------------- time to accuracy: curves and the card
def test_curve_from_rlanywhere_sums_step_times_without_validation():
    records = [
        {"step": 0, "val/acc": 0.1, "val/format": 0.0},
        {"step": 1, "perf/step_time_s": 30.0},
        {"step": 2, "perf/step_time_s": 30.0, "val/acc": 0.6, "val/format": 0.5},
        {"step": 3, "perf/step_time_s": 60.0},
        {"step": 4, "perf/step_time_s": 60.0, "val/acc": 0.9},
    ]
    # minutes: step 2 -> 60 s = 1.0; step 4 -> 180 s = 3.0
    assert tta.curve_from_rlanywhere(records) == [
        {"step": 0, "minutes": 0.0, "acc": 0.1, "format": 0.0},
        {"step": 2, "minutes": 1.0, "acc": 0.6, "format": 0.5},
        {"step": 4, "minutes": 3.0, "acc": 0.9, "format": None}]


def test_warmup_minutes_sum_each_steps_compile_and_capture_once():
    records = [{"step": 0, "val/acc": 0.1},
               {"step": 1, "perf/step_time_s": 30.0, "perf/compile_s": 24.0, "perf/graph_capture_s": 3.0},
               {"step": 2, "perf/step_time_s": 1.0, "perf/compile_s": 6.0, "perf/graph_capture_s": 0.0},
               {"step": 2, "val/acc": 0.5},
               {"step": 3, "perf/step_time_s": 1.0}]  # a run from before these metrics: counts 0
    assert tta.warmup_minutes(records) == {"compile": 0.5, "graph_capture": 0.05}


def test_step_medians_leave_out_the_first_steps_and_phases_never_timed():
    records = [{"step": 0, "val/acc": 0.1},
               {"step": 1, "perf/step_time_s": 30.0, "timing/rollout": 9.0},  # compiling: left out
               {"step": 2, "perf/step_time_s": 20.0, "timing/rollout": 8.0},
               {"step": 3, "perf/step_time_s": 0.5, "timing/rollout": 0.2, "timing/update_actor": 0.3},
               {"step": 4, "perf/step_time_s": 0.7, "timing/rollout": 0.1, "perf/peak_memory_gib": 9.5},
               {"step": 4, "val/acc": 0.6},
               {"step": 5, "perf/step_time_s": 0.6, "timing/rollout": 0.3, "timing/update_actor": 0.5}]
    assert tta.step_summary(records) == {"s_per_step": pytest.approx(0.6), "rollout_s": pytest.approx(0.2),
                                         "update_s": pytest.approx(0.4), "peak_memory_gib": 9.5, "steps": 3}


def test_trl_sweep_takes_the_micro_batch_with_the_fewest_seconds_a_step():
    # a step is a generation and its optimizer steps (records sharing "step"); the first step is left out
    records = [{"step": 0, "val/acc": 0.1},
               {"step": 1, "optimizer_step": 1, "perf/step_time_s": 9.0},
               {"step": 1, "optimizer_step": 2, "perf/step_time_s": 1.0},
               {"step": 2, "optimizer_step": 3, "perf/step_time_s": 3.0},
               {"step": 2, "optimizer_step": 4, "perf/step_time_s": 1.0},
               {"step": 3, "optimizer_step": 5, "perf/step_time_s": 2.0},
               {"step": 3, "optimizer_step": 6, "perf/step_time_s": 1.0}]
    assert tta.trl_seconds_per_step(records) == 3.5  # median of 4.0 and 3.0
    assert tta.trl_seconds_per_step(records[:3]) is None  # only the warm-up step
    assert tta.fastest_micro_batch({16: 5.0, 64: 3.5, 128: None, 256: 4.0}) == 64
    with pytest.raises(SystemExit, match="trl-sweep-steps"):
        tta.fastest_micro_batch({16: None})
    assert tta.micro_batches_from("128,32, 64,32") == [32, 64, 128]
    for bad in ("", "0,64", "64,x"):
        with pytest.raises(SystemExit, match="--trl-micro-batch"):
            tta.micro_batches_from(bad)


def test_curve_from_trl_reads_evaluation_records_only():
    records = [{"step": 0, "train_seconds": 0.0, "val/acc": 0.2, "val/format": 0.1},
               {"step": 1, "optimizer_step": 2, "perf/step_time_s": 90.0, "train_seconds": 90.0},
               {"step": 1, "train_seconds": 90.0, "val/acc": 0.4, "val/format": 0.3}]
    assert tta.curve_from_trl(records) == [{"step": 0, "minutes": 0.0, "acc": 0.2, "format": 0.1},
                                           {"step": 1, "minutes": 1.5, "acc": 0.4, "format": 0.3}]


def test_minutes_to_reach_first_crossing_or_none():
    points = [{"step": 0, "minutes": 0.0, "acc": 0.2}, {"step": 5, "minutes": 1.0, "acc": 0.55},
              {"step": 10, "minutes": 2.0, "acc": 0.45}, {"step": 15, "minutes": 3.0, "acc": 0.8}]
    assert tta.minutes_to_reach(points, 0.5) == 1.0  # first at or above, even though it dips later
    assert tta.minutes_to_reach(points, 0.8) == 3.0  # "at or above": 0.8 counts
    assert tta.minutes_to_reach(points, 0.9) is None


def test_gpu_summary_of_nvidia_smi_samples():
    """The card's clock, temperature and power during a run: median, min and max over nvidia-smi's samples; a row
    with a value the card does not report, or cut short when sampling stopped, is left out."""
    text = "1980, 45, 300.5\n1755, 60, 650.2\n[N/A], 30, 20\n1900, 50, 500\n1830, 5"
    summary = tta.gpu_summary(text)
    assert summary["clocks.sm"] == {"median": 1900.0, "min": 1755.0, "max": 1980.0, "samples": 3}
    assert summary["temperature.gpu"]["max"] == 60.0 and summary["power.draw"]["median"] == 500.0
    assert tta.gpu_summary("") is None and tta.gpu_summary("[N/A], [N/A], [N/A]") is None


def test_card_row():
    result = {"task": "t", "model": "m", "hardware": "h", "label": "rlanywhere grpo",
              "points": [{"step": 0, "minutes": 0.0, "acc": 0.17}, {"step": 10, "minutes": 0.5, "acc": 0.6},
                         {"step": 60, "minutes": 2.25, "acc": 0.855}]}
    assert tta.card_rows([result]) == [
        "| t | m | h | rlanywhere grpo | 0.50 | 2.25 | 0.170 -> 0.855 in 60 steps, 2.25 min |"]


# ---------------------------------------------------------------- the TRL side's reward adapter
def test_completion_text_conversational_and_plain():
    assert sides.completion_text([{"role": "assistant", "content": "12 + 3 = "}, {"role": "assistant",
                                                                                  "content": "15"}]) == "12 + 3 = 15"
    assert sides.completion_text("#### 7") == "#### 7"


def test_rlanywhere_reward_in_trl_signature_scores_like_rewards_py():
    completions = [[{"role": "assistant", "content": "so #### 15"}], [{"role": "assistant", "content": "it is 14"}],
                   [{"role": "assistant", "content": "#### 72"}]]
    scores = sides.rlanywhere_reward(completions, ground_truth=["15", "15", "72"],
                                     data_source=["arithmetic", "arithmetic", "openai/gsm8k"], prompts=None)
    assert scores == [1.0, 0.0, 1.0]


# ---------------------------------------------------------------- trace_gaps: GPU idle time of a profiled step
def test_idle_gaps_hand_example():
    # phase [0, 1000] us; kernels [0, 100], [400, 900] and one overlapping it [850, 950], one outside the phase
    kernels = [(0.0, 100.0), (400.0, 900.0), (850.0, 950.0), (1200.0, 1300.0)]
    assert trace_gaps.idle_gaps(kernels, 0.0, 1000.0) == [(100.0, 400.0), (950.0, 1000.0)]
    assert trace_gaps.idle_gaps(kernels, 120.0, 380.0) == [(120.0, 380.0)]  # a phase with no kernel at all
    assert trace_gaps.idle_gaps([], 0.0, 10.0) == [(0.0, 10.0)]


def test_trace_gaps_names_the_cpu_operator_the_gpu_waited_on(tmp_path, capsys, monkeypatch):
    events = [{"ph": "X", "cat": "user_annotation", "name": "phase/update_actor", "ts": 0, "dur": 1000},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 400, "dur": 600},
              {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 110, "dur": 280},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 120, "dur": 260}]
    trace = tmp_path / "step_4.trace.json"
    trace.write_text(__import__("json").dumps({"traceEvents": events}))
    monkeypatch.setattr(sys, "argv", ["trace_gaps.py", str(trace)])
    trace_gaps.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "phase/update_actor: wall 1.0 ms, GPU idle 0.3 ms in 1 gaps"
    assert out[1].split() == ["0.3", "ms", "1", "gaps", "phase/update_actor", ">", "aten::copy_", ">",
                              "cudaStreamSynchronize"]


def test_stream_table_splits_busy_and_idle_time_per_stream():
    # window [0, 1000] us. stream 7: kernels [100, 300] and [250, 400] (overlapping: 300 busy), then [700, 800]:
    # span 100..800 = 700, busy 400, idle 300. stream 9: one kernel [900, 1100] cut at the window's end: busy 100, idle 0.
    # A kernel on stream 7 after the window and a CPU op are not counted.
    events = [{"cat": "kernel", "ts": 100, "dur": 200, "args": {"stream": 7}},
              {"cat": "kernel", "ts": 250, "dur": 150, "args": {"stream": 7}},
              {"cat": "kernel", "ts": 700, "dur": 100, "args": {"stream": 7}},
              {"cat": "kernel", "ts": 1500, "dur": 100, "args": {"stream": 7}},
              {"cat": "kernel", "ts": 900, "dur": 200, "args": {"stream": 9}},
              {"cat": "cpu_op", "ts": 0, "dur": 1000}]
    rows = trace_gaps.stream_table(events, (0.0, 1000.0))
    assert [(r["stream"], r["kernels"]) for r in rows] == [(7, 3), (9, 1)]
    assert rows[0]["busy_ms"] == pytest.approx(0.4) and rows[0]["span_ms"] == pytest.approx(0.7)
    assert rows[0]["idle_ms"] == pytest.approx(0.3)
    assert rows[1]["busy_ms"] == pytest.approx(0.1) and rows[1]["idle_ms"] == 0


def test_scaling_summary_reports_the_whole_run_and_the_steps_that_compiled():
    import distributed_scaling

    records = [{"step": 1, "perf/step_time_s": 20.0, "perf/compiles": 9,  # the first step: compiles, left out
                "timing/sync_start": 3.0},  # a phase of the first step only (one_step_off's first rollout)
               {"step": 2, "perf/step_time_s": 1.0, "perf/compiles": 0, "timing/rollout": 0.5},
               {"step": 3, "perf/step_time_s": 7.0, "perf/compiles": 2, "timing/rollout": 0.5},
               {"step": 4, "perf/step_time_s": 2.0, "timing/rollout": 0.7, "perf/peak_memory_gib": 3.0},
               {"step": 4, "val/acc": 0.5}]
    summary = distributed_scaling.summarize(records, rows_per_step=10, warmup=1)
    assert summary["step_time_s"] == 2.0  # median of 1, 7, 2
    assert summary["run_samples_per_s"] == pytest.approx(30 / 10.0)  # 3 steps x 10 rows in 10 s
    assert summary["compile_steps"] == [(3, 7.0, 2)]
    assert summary["val_acc"] == {4: 0.5} and summary["phase_s"] == {"rollout": 0.5}


def test_placements_of_a_one_step_off_job_by_hand():
    import distributed_scaling

    names = [name for name, _ in distributed_scaling.placements(4)]
    assert names == ["sync", "one_step_off", "split 3+1", "split 2+2"]  # 1 trainer for 3 rollout ranks: uneven
    assert distributed_scaling.placements(2)[2] == ("split 1+1", ["trainer.async.mode=one_step_off",
                                                                  "trainer.async.rollout_ranks=1"])
    assert distributed_scaling.placements(2)[1][1][-1] == "trainer.async.rollout_ranks=0"


def test_shared_prompts_bench_runs_on_a_cpu_and_agrees_with_packed_rows(monkeypatch, capsys):
    import shared_prompts

    monkeypatch.setattr(sys, "argv", ["shared_prompts.py", "--device", "cpu", "--tiny", "--dtype", "fp32", "--rows",
                                      "4", "--n", "2", "--prompt-len", "6", "--response-len", "5", "--repeats", "1"])
    assert shared_prompts.main() == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert int(lines["packed"][1]) == 4 * (6 + 5) and int(lines["sdpa_mask"][1]) == 2 * 6 + 4 * 5  # each prompt once
    assert float(lines["sdpa_mask"][4]) < 1e-4  # the same log-probs as packed rows


# ---------------------------------------------------------------- vs_trl: TRL's micro-batch sweep, MFU
def test_trl_runs_once_per_micro_batch_and_its_figure_is_the_fastest():
    assert vs_trl.trl_runs(["trl", "ours-plan"], [16, 32]) == ["trl@16", "trl@32", "ours-plan"]
    assert vs_trl.trl_runs(["trl", "ours-plan"], [16]) == ["trl", "ours-plan"]
    results = {"trl@16": {"s/step": 9.0}, "trl@32": {"s/step": 7.5}, "trl@64": {"s/step": 8.0},
               "trl-bf16w@16": {"s/step": 1.0}, "ours-plan": {"s/step": 0.5}}
    assert vs_trl.fastest_trl(results, "trl") == ("trl@32", {"s/step": 7.5})
    assert vs_trl.fastest_trl({"ours-plan": {"s/step": 0.5}}, "trl") is None


def test_the_sweep_keeps_micro_batches_that_divide_a_step():
    args = SimpleNamespace(tiny=False, model="qwen2.5-0.5b", prompts=16, n=8, new_tokens=256,
                           max_prompt_length=256, trl_micro_batch="16,32,64,128,256,48")
    assert vs_trl.work_from_args(args)["trl_micro_batches"] == [16, 32, 64, 128]
    with pytest.raises(SystemExit, match="none divides"):
        vs_trl.work_from_args(SimpleNamespace(**{**vars(args), "trl_micro_batch": "256"}))


def test_update_mfus_take_the_median_over_steady_steps():
    from rlanywhere.flops import phase_mfus
    from rlanywhere.model_shape import ModelShape

    shape = ModelShape("tiny", 4, 1, 2, 1, 8, 10, True)
    records = [{"step": i, "perf/step_time_s": 2.0, "perf/tokens_per_s": 10.0, "response_length/mean": 3.0,
                "timing/update_actor": t} for i, t in enumerate([100.0, 1.0, 2.0, 3.0])]
    out = vs_trl.update_mfus(records, 1, shape, rows=4, groups=None, ppo_epochs=1, peak=1e3)
    middle = phase_mfus(records[2], shape, rows=4, groups=None, ppo_epochs=1, peak=1e3)["mfu/update_actor"]
    assert out == {"mfu/update_actor": pytest.approx(middle)}


# ---------------------------------------------------------------- first steps: where a short run's start goes
def test_first_step_breakdown_splits_the_process_and_the_first_step():
    records = [{"step": 2, "perf/step_time_s": 1.5},
               {"step": 1, "perf/step_time_s": 20.0, "perf/compile_s": 12.0, "perf/graph_capture_s": 3.0},
               {"step": 3, "perf/step_time_s": 0.5}, {"step": 4, "perf/step_time_s": 1.0}]
    row = first_steps.first_step_breakdown(records, process_seconds=40.0)
    # setup: 40 - (20 + 1.5 + 0.5 + 1) = 17; first step other: 20 - 12 - 3 = 5; later steps' median: 1.0
    assert row == {"process s": 40.0, "outside steps s": 17.0, "1st step s": 20.0, "compile s": 12.0, "capture s": 3.0,
                   "1st other s": 5.0, "later step s": 1.0}
    table = first_steps.format_rows([("cold caches", row)]).splitlines()
    assert table[1].split()[2:] == ["40.00", "17.00", "20.00", "12.00", "3.00", "5.00", "1.00"]
    with pytest.raises(SystemExit, match="no step"):
        first_steps.first_step_breakdown([{"step": 0, "val/acc": 0.1}], 5.0)
