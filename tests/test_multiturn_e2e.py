"""Multi-turn training end to end on the CPU with a tiny byte-level Qwen2 taught (in the fixture, a few seconds of
supervised steps) to call verl's GSM8K tool and then answer: verl's sglang_multiturn GSM8K keys and tool config, tool
calls and turns in the metrics, resume in the middle of a multi-turn run, two ranks' rows equal to one
process's, and one_step_off with tool calls (its tool metrics summarised on the trainer's thread, over every rank)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlanywhere.rollout.multiturn import MultiTurnRollout, MultiTurnSettings, render_prompt_with_tools
from rlanywhere.tools import Gsm8kTool

from .conftest import GSM8K_TOOL_CONFIG
from .test_e2e import base_overrides, killed_then_resumed, run_training, train_rows
from .test_multiturn import byte_tokenizer

pytestmark = pytest.mark.slow

SYSTEM = "You are a math expert. Call calc_gsm8k_reward with your answer."
CALL = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "72"}}</tool_call>'
TOOL_CONFIG = GSM8K_TOOL_CONFIG.read_text()


def question(i: int) -> str:
    return f"Tom has {i} apples and buys {72 - i} more. How many apples?"


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    return build_tool_model(tmp_path_factory.mktemp("tool_qwen2"))


def build_tool_model(out):
    """A tiny byte-level Qwen2 that answers any question with CALL, then (after the tool message) '#### 72'."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlanywhere.rollout.multiturn import ToolMessageRenderer, tool_prompt_text

    tool = Gsm8kTool()
    corpus = [tool_prompt_text([tool]), SYSTEM, CALL, "#### 72", "Current parsed answer='72' reward=1.0"]
    corpus += [question(i) for i in range(1, 30)] + [TOOL_CONFIG] * 3
    tok = byte_tokenizer(corpus * 20)
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen2ForCausalLM(config)
    sequences = []
    for i in range(1, 9):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(i)}]
        prompt = render_prompt_with_tools(tok, messages, [tool])
        first = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        result = ToolMessageRenderer(tok, "<|im_end|>").ids(["Current parsed answer='72' reward=1.0"], True)
        second = tok("#### 72", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = prompt + first + result + second
        labels = [-100] * len(prompt) + first + [-100] * len(result) + second
        sequences.append((ids, labels))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(80):
        ids, labels = sequences[step % len(sequences)]
        loss = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def gsm8k_tool_data(tmp_path_factory):
    """verl's examples/data_preprocess/gsm8k_multiturn_w_tool.py layout: system + user prompt, tools_kwargs."""
    out = tmp_path_factory.mktemp("gsm8k_multiturn")
    for split, indices in (("train", range(1, 17)), ("test", range(20, 28))):
        rows = [{"data_source": "openai/gsm8k",
                 "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(i % 9 + 1)}],
                 "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
                 "extra_info": {"split": split, "index": i, "question": question(i % 9 + 1), "answer": "#### 72",
                                "need_tools_kwargs": True,
                                "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
                for i in indices]
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
    (out / "gsm8k_tool_config.yaml").write_text(TOOL_CONFIG)
    return out


def verl_multiturn_overrides(model_dir, data_dir, run_dir, **extra):
    """examples/sglang_multiturn's keys (gsm8k_multiturn_grpo.yaml + run_qwen2.5-3b_gsm8k_multiturn.sh), sizes
    shrunk, paths replaced."""
    keys = {"algorithm.adv_estimator": "grpo", "data.return_raw_chat": True, "data.max_prompt_length": 1024,
            "data.max_response_length": 160, "actor_rollout_ref.rollout.name": "sglang",
            "actor_rollout_ref.rollout.multi_turn.enable": True,
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 5,
            "actor_rollout_ref.rollout.multi_turn.tool_config_path": str(data_dir / "gsm8k_tool_config.yaml"),
            "actor_rollout_ref.rollout.temperature": 0.7, "actor_rollout_ref.actor.use_kl_loss": True,
            "actor_rollout_ref.actor.kl_loss_coef": 0.001, "actor_rollout_ref.actor.optim.lr": 1e-4,
            "data.val_max_samples": 4, "trainer.val_before_train": False, "trainer.test_freq": -1}
    keys.update(extra)
    return base_overrides(model_dir, data_dir, run_dir, **keys)


def test_verl_gsm8k_multiturn_example_trains_with_tool_calls(tool_model_dir, gsm8k_tool_data, tmp_path):
    overrides = verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "run",
                                         **{"trainer.total_training_steps": 1, "trainer.test_freq": 1})
    trainer, metrics = run_training(overrides)
    step = train_rows(metrics)[1]
    # the (briefly) taught model calls the tool, sometimes sloppily: each call and error is counted
    assert step["multi_turn/tool_calls/mean"] >= 0.5 and step["multi_turn/tool_call_rate"] >= 0.5, step
    assert step["multi_turn/assistant_turns/mean"] > 1.0 and step["multi_turn/user_turns/mean"] > 0.5
    assert 0 <= step["multi_turn/tool_errors/total"] <= 8 * step["multi_turn/tool_calls/mean"]
    assert step["response_length/mean"] > 0
    val = [m for m in metrics if "val/acc" in m][-1]
    assert val["val/multi_turn/tool_call_rate"] > 0.5


def test_resume_in_the_middle_of_a_multiturn_run(tool_model_dir, gsm8k_tool_data, tmp_path, monkeypatch):
    extra = {"trainer.total_training_steps": 2, "trainer.save_freq": 1}
    _, uninterrupted = run_training(verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "a", **extra))
    trainer, resumed = killed_then_resumed(
        verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "b", **extra), 1, monkeypatch)
    a, b = train_rows(uninterrupted), train_rows(resumed)
    assert sorted(b) == [1, 2]
    for step in (2,):
        for key in ("reward/mean", "actor/pg_loss", "multi_turn/tool_calls/mean", "multi_turn/assistant_turns/mean",
                    "response_length/mean"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_two_ranks_draw_what_one_process_draws(tool_model_dir):
    """A torch.Generator per chunk of prompts (what validation passes): each rank runs the driver on its block of
    prompts (first_prompt = its global offset); with rows_per_wave dividing a rank's rows, the rows equal one
    process's rows for the same prompts, every turn included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlanywhere.rollout.base import SamplingParams
    from rlanywhere.rollout.hf import HFEngine

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    engine = HFEngine(model, tok)
    items = [{"input_ids": [], "raw_prompt": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question(i)}],
              "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
             for i in range(1, 5)]
    params = SamplingParams(max_new_tokens=120, temperature=1.0, n=2)

    def generator(first_prompt):
        return torch.Generator().manual_seed(1000 + first_prompt)

    def run(part, first):
        driver = MultiTurnRollout([Gsm8kTool()], tok, MultiTurnSettings(), engine.eos_ids)
        return driver.generate(engine, part, params, generator, first_prompt=first, rows_per_wave=4), driver

    whole, driver = run(items, 0)
    halves = [run(items[:2], 0)[0], run(items[2:], 2)[0]]
    assert sum(s.tool_calls for s in driver.last_stats) > 0  # later turns happened
    for rank, half in enumerate(halves):
        rows = slice(4 * rank, 4 * rank + 4)
        width = half.response_ids.shape[1]
        assert torch.equal(half.response_ids, whole.response_ids[rows, :width])
        assert torch.equal(half.response_mask, whole.response_mask[rows, :width])
        assert whole.response_mask[rows, width:].sum() == 0


@pytest.mark.parametrize("path", ["hf", "fast-kv", "fast-re-prefill"])
def test_rows_with_their_own_streams_draw_the_same_on_any_rank_and_in_any_wave(tool_model_dir, path):
    """The trainer's RowStreams: a rank's rows (its prompts' global offset, waves of a size that does not divide its
    rows) equal one process's rows, every turn included, on each engine path; the same streams draw the same again
    (no global random state is read), and other streams draw otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlanywhere.plans import RolloutPlan
    from rlanywhere.rollout.base import RowStreams, SamplingParams
    from rlanywhere.rollout.fast import FastEngine
    from rlanywhere.rollout.hf import HFEngine

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    engine = HFEngine(model, tok) if path == "hf" else FastEngine(model, tok, RolloutPlan(engine="fast"))
    items = [{"input_ids": [], "raw_prompt": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question(i)}],
              "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
             for i in range(1, 5)]
    params = SamplingParams(max_new_tokens=120, temperature=1.0, n=2)

    def run(part, first, rows_per_wave=None, seed=11):
        driver = MultiTurnRollout([Gsm8kTool()], tok, MultiTurnSettings(), engine.eos_ids,
                                  kv_continuation=path == "fast-kv")
        torch.manual_seed(first + (rows_per_wave or 0))  # the global generator must not matter
        with torch.no_grad():
            return driver.generate(engine, part, params, RowStreams(seed), first_prompt=first,
                                   rows_per_wave=rows_per_wave), driver

    whole, driver = run(items, 0)
    assert sum(s.tool_calls for s in driver.last_stats) > 0 and max(s.assistant_turns for s in driver.last_stats) > 1
    assert torch.equal(run(items, 0, rows_per_wave=5)[0].response_ids, whole.response_ids)
    assert not torch.equal(run(items, 0, seed=12)[0].response_ids, whole.response_ids)
    for first, rows_per_wave in ((1, 3), (2, None)):  # a rank holding prompts first.. (of 4), waves of 3 rows
        part = run(items[first:], first, rows_per_wave)[0]
        rows, width = slice(2 * first, None), part.response_ids.shape[1]
        assert torch.equal(part.response_ids, whole.response_ids[rows, :width])
        assert torch.equal(part.response_mask, whole.response_mask[rows, :width])
        assert whole.response_mask[rows, width:].sum() == 0
        assert torch.allclose(part.response_logprobs, whole.response_logprobs[rows, :width], atol=1e-5)


def test_fused_sampler_multiturn_rows_draw_the_same_on_any_rank(tool_model_dir):
    """FastEngine's KV path with the sampler inside the decode step (Triton's interpreter) and RowStreams: the rows'
    keys travel with them through the tool turns and compaction, so a rank's rows (waves of 1 row) equal one
    process's, tool turn included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlanywhere.plans import RolloutPlan
    from rlanywhere.rollout.base import RowStreams, SamplingParams
    from rlanywhere.rollout.fast import FastEngine

    from .test_decode_attention import interpreter_runs

    if not interpreter_runs():
        pytest.skip("the fused sampler on the CPU needs triton >= 3.9 and TRITON_INTERPRET=1")
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    engine = FastEngine(AutoModelForCausalLM.from_pretrained(tool_model_dir).eval(), tok,
                        RolloutPlan(engine="fast", fused_sampling=True))
    items = [{"input_ids": [], "raw_prompt": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question(i)}]} for i in (1, 2)]
    params = SamplingParams(max_new_tokens=28, temperature=1.0, n=2)

    def run(part, first, rows_per_wave=None):
        driver = MultiTurnRollout([Gsm8kTool()], tok, MultiTurnSettings(), engine.eos_ids)
        with torch.no_grad():
            return driver.generate(engine, part, params, RowStreams(3), first_prompt=first,
                                   rows_per_wave=rows_per_wave), driver

    whole, driver = run(items, 0)
    assert sum(s.tool_calls for s in driver.last_stats) > 0
    part = run(items[1:], 1, rows_per_wave=1)[0]
    width = part.response_ids.shape[1]
    assert torch.equal(part.response_ids, whole.response_ids[2:, :width])
    assert torch.equal(part.response_mask, whole.response_mask[2:, :width])
    assert whole.response_mask[2:, width:].sum() == 0


def test_fast_engine_kv_continuation_equals_re_prefill(tool_model_dir):
    """FastEngine continuing rows in their KV cache gives the tokens, masks and log-probs of re-prefilling the whole
    history every turn (greedy), and the same turn and tool counts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlanywhere.plans import RolloutPlan
    from rlanywhere.rollout.base import SamplingParams
    from rlanywhere.rollout.fast import FastEngine

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    engine = FastEngine(AutoModelForCausalLM.from_pretrained(tool_model_dir).eval(), tok, RolloutPlan(engine="fast"))
    items = [{"input_ids": [], "raw_prompt": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question(i)}],
              "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
             for i in range(1, 4)]
    results = {}
    for kv in (True, False):
        driver = MultiTurnRollout([Gsm8kTool()], tok, MultiTurnSettings(), engine.eos_ids, kv_continuation=kv)
        with torch.no_grad():
            batch = driver.generate(engine, items, SamplingParams(max_new_tokens=100, temperature=0.0, n=2))
        results[kv] = batch, [(s.assistant_turns, s.user_turns, s.tool_calls, s.tool_errors)
                              for s in driver.last_stats]
    (kv_batch, kv_stats), (re_batch, re_stats) = results[True], results[False]
    assert kv_stats == re_stats and sum(s[2] for s in kv_stats) > 0
    assert torch.equal(kv_batch.response_ids, re_batch.response_ids)
    assert torch.equal(kv_batch.response_mask, re_batch.response_mask)
    assert (kv_batch.response_mask == 0).any()  # tool tokens are in there
    assert torch.allclose(kv_batch.response_logprobs, re_batch.response_logprobs, atol=1e-4)


def kv_and_re_prefill(engine, tok, sampling, rows_per_wave=None, prompts=range(1, 4), paths=(True, False)):
    """FastEngine's paths on the same rows: {kv_continuation: (batch, per-row turn and call counts)}."""
    items = [{"input_ids": [], "raw_prompt": [{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": question(i)}],
              "extra_info": {"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}}}
             for i in prompts]
    results = {}
    for kv in paths:
        driver = MultiTurnRollout([Gsm8kTool()], tok, MultiTurnSettings(), engine.eos_ids, kv_continuation=kv)
        with torch.no_grad():
            batch = driver.generate(engine, items, sampling, rows_per_wave=rows_per_wave)
        results[kv] = batch, [(s.assistant_turns, s.user_turns, s.tool_calls, s.tool_errors)
                              for s in driver.last_stats]
    return results


def turn_ends(batch, row):
    """Response positions where one of the row's model turns ends (its last generated token)."""
    mask = batch.response_mask[row].tolist()
    return [i for i, bit in enumerate(mask) if bit and (i + 1 == len(mask) or not mask[i + 1])]


def test_kv_continuation_with_the_lagged_look_equals_re_prefill_at_the_edges(tool_model_dir):
    """The KV path looks at step t-1's tokens while step t computes. Greedy, it still gives re-prefill's tokens,
    masks and log-probs: a turn ending on the last step of the budget, a row cut off at the budget while others
    end, rows finishing at different steps (compaction to a smaller batch), two waves."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlanywhere.plans import RolloutPlan
    from rlanywhere.rollout.base import SamplingParams
    from rlanywhere.rollout.fast import FastEngine

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    engine = FastEngine(AutoModelForCausalLM.from_pretrained(tool_model_dir).eval(), tok, RolloutPlan(engine="fast"))
    full = kv_and_re_prefill(engine, tok, SamplingParams(max_new_tokens=100, temperature=0.0, n=2))[False][0]
    first_end = turn_ends(full, 0)[0]
    lengths = full.response_mask.shape[1] - full.response_mask.flip(1).argmax(1)  # each row's last model token + 1
    assert lengths.min() < lengths.max(), lengths  # rows finish at different steps: the wave is compacted
    cases = [(100, None), (100, 4), (first_end + 1, None), (int(lengths.min()), 4)]
    for budget, rows_per_wave in cases:
        results = kv_and_re_prefill(engine, tok, SamplingParams(max_new_tokens=budget, temperature=0.0, n=2),
                                    rows_per_wave)
        assert_same_rollouts(results[True], results[False], (budget, rows_per_wave))
    cut = kv_and_re_prefill(engine, tok, SamplingParams(max_new_tokens=first_end + 1, temperature=0.0, n=2))[True]
    assert turn_ends(cut[0], 0) == [first_end] and cut[1][0][1] == 0  # the turn ended on the last step: no tool ran


def assert_same_rollouts(a, b, case):
    (a_batch, a_stats), (b_batch, b_stats) = a, b
    assert a_stats == b_stats, case
    assert torch.equal(a_batch.response_ids, b_batch.response_ids), case
    assert torch.equal(a_batch.response_mask, b_batch.response_mask), case
    assert torch.allclose(a_batch.response_logprobs, b_batch.response_logprobs, atol=1e-4), case


def test_kv_continuation_with_the_fused_sampler_equals_re_prefill(tool_model_dir):
    """The fused sampler's step (tokens drawn inside the decode step, then the tool tokens put in their place) on
    the KV path, greedy: re-prefill's rollout (Triton's CPU interpreter: a short budget, one tool turn)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlanywhere.plans import RolloutPlan
    from rlanywhere.rollout.base import SamplingParams
    from rlanywhere.rollout.fast import FastEngine

    from .test_decode_attention import interpreter_runs

    if not interpreter_runs():
        pytest.skip("the fused sampler on the CPU needs triton >= 3.9 and TRITON_INTERPRET=1")
    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tool_model_dir).eval()
    sampling = SamplingParams(max_new_tokens=96, temperature=0.0, n=2)
    fused = kv_and_re_prefill(FastEngine(model, tok, RolloutPlan(engine="fast", fused_sampling=True)), tok,
                              sampling, prompts=[1], paths=(True,))
    assert fused[True][1][0][:2] == (2, 1)  # a tool answered, and the model went on
    plain = kv_and_re_prefill(FastEngine(model, tok, RolloutPlan(engine="fast")), tok, sampling, prompts=[1],
                              paths=(False,))
    assert_same_rollouts(fused[True], plain[False], "fused")


MULTI_TURN_KEYS = ("multi_turn/tool_calls/mean", "multi_turn/assistant_turns/mean", "multi_turn/tool_errors/total",
                   "multi_turn/tool_call_rate", "reward/mean", "actor/pg_loss", "response_length/mean")


def test_one_step_off_with_tool_calls_keeps_its_tool_metrics(tool_model_dir, gsm8k_tool_data, tmp_path):
    """one_step_off with multi-turn rollouts: a job keeps its rows' tool statistics and the step summarises them.
    Step 1 trains the batch a synchronous run trains (the initial weights made both): the same tool metrics; the
    rollout on the background thread gives what the phases in turn give."""
    from rlanywhere.async_plan import OVERLAPPED
    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan
    from rlanywhere.trainer import RLTrainer

    extra = {"trainer.total_training_steps": 2}
    _, sync = run_training(verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "sync", **extra))
    osp = {**extra, "trainer.async.mode": "one_step_off"}
    _, in_turn = run_training(verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "turn", **osp))
    cfg = load_config(None, verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "thread", **osp))
    plan = make_plan(cfg, for_execution=True)
    plan.async_rollout = OVERLAPPED  # the background thread's path on a CPU
    threaded = RLTrainer(cfg, plan, cfg.trainer.default_local_dir)
    threaded.fit()
    from rlanywhere.tracking import read_metrics

    s, t, b = train_rows(sync), train_rows(in_turn), train_rows(read_metrics(tmp_path / "thread"))
    assert s[1]["multi_turn/tool_calls/mean"] > 0  # the taught model calls the tool
    for key in MULTI_TURN_KEYS:
        assert t[1][key] == pytest.approx(s[1][key], rel=1e-6, abs=1e-8), key
        for step in (1, 2):
            assert b[step][key] == pytest.approx(t[step][key], rel=1e-6, abs=1e-8), (step, key)
    assert not any(key.startswith("_") for row in (t[1], t[2], b[2]) for key in row)


def test_one_step_off_with_tool_calls_on_two_ranks_summarises_every_ranks_rows(tool_model_dir, gsm8k_tool_data,
                                                                               tmp_path):
    """2 trainer ranks (gloo), each generating its share of the next batch: the tool statistics are summarised over
    both ranks' rows on the trainer's thread. Step 1 trains the batch a synchronous 2-rank run trains (the initial
    weights made both): every metric the same."""
    from rlanywhere.tracking import read_metrics

    from .test_distributed import assert_same_metrics, finish, torchrun

    extra = {"trainer.total_training_steps": 2, "custom_reward_function.timeout_s": 0}
    sync = torchrun(verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "sync", **extra))
    osp = torchrun(verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "osp", **extra, **{
        "trainer.async.mode": "one_step_off", "trainer.async.rollout_ranks": 0}))
    finish(sync), finish(osp)
    want, got = read_metrics(tmp_path / "sync"), read_metrics(tmp_path / "osp")
    assert train_rows(want)[1]["multi_turn/tool_calls/mean"] > 0
    assert train_rows(got)[2]["async/staleness"] == 1.0 and "multi_turn/tool_calls/mean" in train_rows(got)[2]
    sync_keys = {key for row in want for key in row}
    assert_same_metrics([{k: v for k, v in row.items() if k in sync_keys} for row in got], want, steps=(1,))


@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_multiturn_on_two_ranks_trains_what_one_process_trains(tool_model_dir, gsm8k_tool_data, tmp_path, engine):
    """A synchronous multi-turn run on 2 ranks (gloo) against one process generating 3 rows at a time (waves that
    do not divide a rank's rows): the same samples, so every metric of every step the same (one mini-batch a step,
    which one process and 2 ranks split alike). The HF engine's
    later turns are generated as new prompts, FastEngine's continue in the KV cache."""
    from rlanywhere.tracking import read_metrics

    from .test_distributed import assert_same_metrics, finish, single_process, torchrun

    extra = {"trainer.total_training_steps": 2, "custom_reward_function.timeout_s": 0,
             "actor_rollout_ref.rollout.name": engine, "actor_rollout_ref.actor.ppo_mini_batch_size": 4}
    ranks = torchrun(verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "ranks", **extra))
    single_process(verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "one", **extra),
                   rollout_batch_size=3)
    finish(ranks)
    want = read_metrics(tmp_path / "one")
    assert train_rows(want)[1]["multi_turn/tool_calls/mean"] > 0
    assert_same_metrics(read_metrics(tmp_path / "ranks"), want, steps=(1, 2))


def test_multiturn_split_placement_matches_the_one_process_pipeline(tool_model_dir, gsm8k_tool_data, tmp_path):
    """one_step_off with tool calls on 1 trainer rank + 1 rollout rank (gloo, forked): the rollout rank generates the
    multi-turn rows (its own streams: the trainer's block of prompts) and the trainer rank summarises their tool
    statistics; every metric of every step is the one-process run's."""
    from rlanywhere.tracking import read_metrics

    from .test_async import _split_rank
    from .test_distributed import assert_same_metrics, forked_ranks

    extra = {"trainer.total_training_steps": 2, "custom_reward_function.timeout_s": 0,
             "trainer.async.mode": "one_step_off"}
    run_training(verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "one", **extra))
    overrides = verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "split", **extra)
    forked_ranks(_split_rank, (overrides, f"file://{tmp_path / 'rendezvous'}"))
    want, got = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "split")
    assert train_rows(want)[2]["multi_turn/tool_calls/mean"] > 0 and train_rows(got)[2]["async/staleness"] == 1.0
    assert_same_metrics(got, want, steps=(1, 2))


def test_dynamic_sampling_reports_the_tool_use_of_the_rows_it_trains(tool_model_dir, gsm8k_tool_data, tmp_path):
    """Multi-turn with algorithm.filter_groups: multi_turn/* describe the rows kept for training (from every
    generation round), not the last round's: the tool calls counted are those written in the trained responses."""
    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan
    from rlanywhere.stepmetrics import PhaseTimer
    from rlanywhere.trainer import RLTrainer

    from .test_variants_e2e import reward_file

    cfg = load_config(None, verl_multiturn_overrides(tool_model_dir, gsm8k_tool_data, tmp_path / "run", **{
        "algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
        "algorithm.filter_groups.max_num_gen_batches": 6, "actor_rollout_ref.rollout.temperature": 1.0,
        "custom_reward_function.timeout_s": 0, "custom_reward_function.path": reward_file(tmp_path)}))
    trainer = RLTrainer(cfg, make_plan(cfg, for_execution=True), cfg.trainer.default_local_dir)
    scored, metrics, _ = trainer.rollouts.rollout_and_score(trainer.loader.next_batch(), PhaseTimer("cpu"))
    assert metrics["filter_groups/num_gen_batches"] >= 2
    texts = scored.rollout.decode(trainer.tokenizer)  # the model's turns and the tool results between them
    assert metrics["multi_turn/tool_calls/total"] == sum(text.count("<tool_call>") for text in texts) > 0
    assert "multi_turn_row_stats" not in scored.info  # not a number to train or log with
