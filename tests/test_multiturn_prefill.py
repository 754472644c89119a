"""Multi-turn rollouts, continued: the tools' calc_reward reaching the reward function (verl's
extra_info["rollout_reward_scores"] and num_turns), the calculator demo's task and reward, and rollout.stop strings
on FastEngine's KV-continuation path equal to the re-prefill driver."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from rlanywhere.rollout.multiturn import MultiTurnRollout, MultiTurnSettings, RowStats, reward_extra_infos
from rlanywhere.tools import CalculatorTool

from .test_multiturn import ScriptedEngine, byte_tokenizer, call, items_for, params

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def demo_reward():
    spec = importlib.util.spec_from_file_location("tool_arith_reward", ROOT / "examples" / "tool_arith_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def test_calc_reward_reaches_extra_info(tok):
    """Row 0 evaluates 12*34 (calc_reward 1.0), row 1's call fails (0.0), row 2 calls nothing (no score)."""
    def script(context, turn):
        if "first" in context:
            return call("calculator", expression="12*34") if turn == 0 else "#### 408"
        if "second" in context:
            return call("calculator", expression="12/0") if turn == 0 else "#### 1"
        return "#### 7"
    engine = ScriptedEngine(tok, script)
    driver = MultiTurnRollout([CalculatorTool()], tok, MultiTurnSettings(), engine.eos_ids)
    items = items_for(tok, ["first", "second", "third"])
    batch = driver.generate(engine, items, params())
    infos = reward_extra_infos([item["extra_info"] for item in items], driver.last_stats)
    assert [info["rollout_reward_scores"] for info in infos] == [{"calculator": 1.0}, {"calculator": 0.0}, {}]
    # num_turns as verl counts it: the prompt + each assistant turn + each tool turn
    assert [info["num_turns"] for info in infos] == [4, 4, 2]
    assert all("tools_kwargs" in info for info in infos)  # the row's own extra_info is kept
    assert "num_turns" not in items[0]["extra_info"]  # copies: the dataset's dicts are not changed
    # the demo's reward: 1.0 for a right answer + 0.1 for a calculator call that evaluated
    score = demo_reward()
    texts = batch.decode(tok)
    results = [score("arithmetic", text, truth, info) for text, truth, info in zip(texts, ["408", "408", "7"], infos)]
    assert [r["score"] for r in results] == [1.1, 0.0, 1.0]
    assert [r["tool_used"] for r in results] == [1.0, 0.0, 0.0]


def test_reward_extra_infos_checks_lengths():
    with pytest.raises(ValueError, match="2 extra_info rows for 1 rollout rows"):
        reward_extra_infos([{}, {}], [RowStats()])
    stats = RowStats(assistant_turns=3, user_turns=2, reward_scores={"gsm8k": 0.5})
    assert reward_extra_infos([None], [stats]) == [{"num_turns": 6, "rollout_reward_scores": {"gsm8k": 0.5}}]


def test_calculator_calc_reward_per_instance():
    tool = CalculatorTool()
    a, _ = tool.create()
    b, _ = tool.create()
    tool.execute(a, {"expression": "2+2"})
    with pytest.raises(Exception):
        tool.execute(b, {"expression": "__import__('os')"})
    assert (tool.calc_reward(a), tool.calc_reward(b)) == (1.0, 0.0)
    tool.release(a)
    assert tool.calc_reward(a) == 0.0


def test_tool_arithmetic_task_shows_one_worked_call(tmp_path):
    from rlanywhere.data import prepare_arithmetic
    from rlanywhere.data.tool_arith import prepare_tool_arithmetic

    paths = prepare_tool_arithmetic(tmp_path / "tool", train_size=6, test_size=3, digits=3)
    plain = prepare_arithmetic(tmp_path / "plain", train_size=6, test_size=3, digits=3, operators="*")
    for split in ("train", "test"):
        rows, plain_rows = pq.read_table(paths[split]).to_pylist(), pq.read_table(plain[split]).to_pylist()
        assert [r["reward_model"] for r in rows] == [r["reward_model"] for r in plain_rows]  # same questions
        for row in rows:
            roles = [m["role"] for m in row["prompt"]]
            assert roles == ["user", "assistant", "tool", "assistant", "user"]
            assert row["prompt"][1]["content"] == call("calculator", expression="12 * 34")
            assert row["prompt"][-1]["content"] == row["extra_info"]["question"]
            a, b = (int(x) for x in row["extra_info"]["question"][len("What is "):-1].split(" * "))
            assert str(a * b) == row["reward_model"]["ground_truth"]
    from rlanywhere.cli import main as cli_main  # the same files from `rlanywhere prepare tool-arithmetic`

    assert cli_main(["prepare", "tool-arithmetic", "--out", str(tmp_path / "cli"), "--train-size", "6",
                     "--test-size", "3", "--digits", "3", "--operators", "*"]) == 0
    assert pq.read_table(tmp_path / "cli" / "test.parquet").to_pylist() == pq.read_table(paths["test"]).to_pylist()


@pytest.mark.slow
def test_stop_strings_on_the_kv_path_equal_re_prefill(tmp_path):
    """rollout.stop ends a turn on FastEngine's KV path as on the re-prefill path (same ids, masks, log-probs, turn
    and call counts). The tiny model opens its turns with '<tool_call>{"name'; a stop string there cuts a turn
    inside its call (an unclosed call: the model gets the error text and goes on)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlanywhere.plans import RolloutPlan
    from rlanywhere.rollout.base import SamplingParams
    from rlanywhere.rollout.fast import FastEngine
    from rlanywhere.tools import Gsm8kTool

    from .test_multiturn_e2e import SYSTEM, build_tool_model, question

    model_dir = build_tool_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = FastEngine(AutoModelForCausalLM.from_pretrained(model_dir).eval(), tok, RolloutPlan(engine="fast"))
    items = [{"input_ids": [], "raw_prompt": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question(i)}],
              "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
             for i in range(1, 3)]
    sampling = SamplingParams(max_new_tokens=160, temperature=0.0, n=2, stop_strings=('{"name',))
    results = {}
    for kv in (True, False):
        driver = MultiTurnRollout([Gsm8kTool()], tok, MultiTurnSettings(max_assistant_turns=3), engine.eos_ids,
                                  kv_continuation=kv)
        with torch.no_grad():
            batch = driver.generate(engine, items, sampling)
        results[kv] = batch, [(s.assistant_turns, s.user_turns, s.tool_calls, s.tool_errors)
                              for s in driver.last_stats]
    (kv_batch, kv_stats), (re_batch, re_stats) = results[True], results[False]
    assert kv_stats == re_stats
    assert torch.equal(kv_batch.response_ids, re_batch.response_ids)
    assert torch.equal(kv_batch.response_mask, re_batch.response_mask)
    assert torch.allclose(kv_batch.response_logprobs, re_batch.response_logprobs, atol=1e-4)
    stopped = 0  # turns that ended at the stop string (and the row went on after the tool's answer)
    for row, stats in enumerate(kv_stats):
        ids, mask = kv_batch.response_ids[row].tolist(), kv_batch.response_mask[row].tolist()
        turns, current = [], []  # the model's own segments (mask 1), one per turn
        for token, bit in zip(ids, mask):
            if bit:
                current.append(token)
            elif current:
                turns.append(current)
                current = []
        turns += [current] if current else []
        assert len(turns) == stats[0]
        for turn in turns[:-1]:  # every turn followed by a tool's answer ended at EOS or at the stop string
            text = tok.decode(turn, skip_special_tokens=False)
            assert turn[-1] == tok.eos_token_id or text.endswith('{"name'), text
            stopped += text.endswith('{"name')
    assert stopped >= 1, kv_stats


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["current", "v0.5.0"])
def test_verl_sglang_multiturn_script_trains_a_cpu_step(layout, tmp_path, capsys):
    """verl's examples/sglang_multiturn GSM8K script as it is (--config-path/--config-name to a YAML whose defaults
    name ppo_trainer, the tool config naming verl.tools.gsm8k_tool.Gsm8kTool), paths replaced and sizes shrunk:
    one CPU step with a tiny model taught to call the tool; tool calls and turns reach the metrics."""
    import json

    import pyarrow as pa

    from rlanywhere.cli import main as cli_main

    from .test_multiturn_e2e import SYSTEM, TOOL_CONFIG, build_tool_model, question
    from .test_verl_examples import EXAMPLES, SMALL, expand

    model_dir = build_tool_model(tmp_path / "model")
    data_dir = tmp_path / "data"  # verl's data_preprocess/gsm8k_multiturn_w_tool.py layout: tools_kwargs per row
    data_dir.mkdir()
    for split in ("train", "test"):
        rows = [{"data_source": "openai/gsm8k", "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
                 "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(i)}],
                 "extra_info": {"split": split, "index": i, "need_tools_kwargs": True,
                                "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
                for i in range(1, 5)]
        pq.write_table(pa.Table.from_pylist(rows), data_dir / f"{split}.parquet")
    (data_dir / "gsm8k_tool_config.yaml").write_text(TOOL_CONFIG)
    path = EXAMPLES / f"{layout}__sglang_multiturn__run_qwen2.5-3b_gsm8k_multiturn.args"
    args = [a for a in expand(path, model_dir, data_dir) if "tool_config_path=" not in a]
    assert any(a.startswith("--config-name=") for a in args)
    tool_config = data_dir / "gsm8k_tool_config.yaml"
    assert 'class_name: "verl.tools.gsm8k_tool.Gsm8kTool"' in tool_config.read_text()
    small = [a for a in SMALL if not a.startswith("data.max_response_length")]
    run = tmp_path / "run"
    args += small + ["data.max_response_length=120", "data.max_prompt_length=1024",
                     f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
                     f"trainer.default_local_dir={run}", "trainer.logger=[console]"]
    assert cli_main(["train", *args]) == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "actor/pg_loss" in row]
    assert len(trained) == 1
    assert trained[0]["multi_turn/tool_calls/total"] > 0 and trained[0]["multi_turn/assistant_turns/mean"] > 1


def test_rollout_phase_score_passes_tool_rewards(tok):
    """RolloutPhase.score (train steps and validation) hands the reward function each row's extra_info with the
    row's num_turns and rollout_reward_scores, n rows per prompt in rollout order."""
    from types import SimpleNamespace

    from rlanywhere.rollout_phase import RolloutPhase

    engine = ScriptedEngine(tok, lambda context, turn: call("calculator", expression="6*7") if turn == 0 and
                            "alpha" in context else "#### 42")
    driver = MultiTurnRollout([CalculatorTool()], tok, MultiTurnSettings(), engine.eos_ids)
    items = items_for(tok, ["alpha", "beta"])
    for item in items:
        item["ground_truth"] = "42"
    batch = driver.generate(engine, items, params(n=2))
    seen = {}

    def reward_manager(texts, truths, sources, extra_infos):
        seen["extra_infos"] = extra_infos
        return torch.ones(len(texts)), {"acc": [1.0] * len(texts)}

    phase = SimpleNamespace(tokenizer=tok, reward_manager=reward_manager, multiturn=driver)
    scores, info, texts = RolloutPhase.score(phase, items, batch, 2)
    assert [(e["num_turns"], e["rollout_reward_scores"]) for e in seen["extra_infos"]] == \
        [(4, {"calculator": 1.0})] * 2 + [(2, {})] * 2
    assert all(t.endswith("#### 42") for t in texts)
