"""Every input of a run is checked before a model loads, and every problem is reported at once, one line each."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlanywhere import preflight
from rlanywhere.cli import main
from rlanywhere.config import load_config

ROW = {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
       "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 0}}


def _write(path, rows):
    table = pa.Table.from_pylist(rows or [ROW])
    pq.write_table(table if rows else table.slice(0, 0), path)
    return str(path)


@pytest.fixture
def no_loading(monkeypatch):
    """Anything that plans or loads a model fails the test: the answer must come before. The modules that bind these
    functions at import are imported first and patched too: imported for the first time under the patch, they would
    keep the failing stand-in for the rest of the session."""
    from rlanywhere import builders, doctor, models, planner

    def loaded(*args, **kwargs):
        raise AssertionError("a model was planned or loaded before the inputs were checked")

    for module, name in ((models, "load_causal_lm"), (models, "load_tokenizer"), (planner, "make_plan"),
                         (builders, "load_causal_lm"), (builders, "load_tokenizer"), (doctor, "make_plan")):
        monkeypatch.setattr(module, name, loaded)


def _custom_code_model(folder):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "fancy_lm", "auto_map": {"AutoConfig": "configuration_fancy.FancyConfig",
                                               "AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"}}))
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_every_bad_input_is_one_error_line_before_a_model_loads(tmp_path, capsys, no_loading):
    empty = _write(tmp_path / "empty.parquet", [])
    blank = _write(tmp_path / "blank.parquet", [ROW, {**ROW, "prompt": [{"role": "user", "content": "   "}]}])
    model = _custom_code_model(tmp_path / "fancy")
    code = main(["train", f"data.train_files={empty}", f"data.val_files={blank}", f"actor_rollout_ref.model.path={model}",
                 "actor_rollout_ref.actor.optim.lr=-1", "algorithm.adv_estimator=grpo",
                 f"trainer.default_local_dir={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert all(line.startswith("error: ") for line in lines), lines
    assert len(lines) == 4, lines
    zero_rows, blank_prompt, custom_code, lr = lines
    assert "data.train_files" in zero_rows and "no rows" in zero_rows
    assert "data.val_files" in blank_prompt and "1 blank prompt" in blank_prompt and "row 1" in blank_prompt
    assert "trust_remote_code=true" in custom_code and "modeling_fancy.py" in custom_code
    assert "optim.lr=-1" in lr and "positive" in lr
    assert not (tmp_path / "run").exists()  # nothing written either


def test_hub_id_without_network_is_one_line_at_once(tmp_path, capsys, monkeypatch, no_loading, arith_data):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    start = time.time()
    code = main(["train", f"data.train_files={arith_data}/train.parquet", f"data.val_files={arith_data}/test.parquet",
                 "actor_rollout_ref.model.path=SomeOrg/not-downloaded-7b", "algorithm.adv_estimator=grpo"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "not in the local Hugging Face cache" in lines[0] and "hf download SomeOrg/not-downloaded-7b" \
        in lines[0]
    assert time.time() - start < 10


def test_data_file_problems_name_file_and_fix(tmp_path):
    missing = preflight.data_file_problems(str(tmp_path / "nope.parquet"), "data.train_files", "prompt", "data_source")
    assert len(missing) == 1 and "does not exist" in missing[0] and "rlanywhere prepare" in missing[0]
    assert all(task in missing[0] for task in ("gsm8k", "arithmetic", "tool-arithmetic", "generic"))  # every task
    (tmp_path / "text.parquet").write_text("question,answer\n1+1,2\n")
    unreadable = preflight.data_file_problems(str(tmp_path / "text.parquet"), "data.train_files", "prompt",
                                              "data_source")
    assert len(unreadable) == 1 and "not a readable parquet file" in unreadable[0]
    no_column = _write(tmp_path / "q.parquet", [{"question": "1+1", "reward_model": {"ground_truth": "2"},
                                                "data_source": "x"}])
    lines = preflight.data_file_problems(no_column, "data.train_files", "prompt", "data_source")
    assert len(lines) == 1 and "['prompt']" in lines[0] and "data.prompt_key" in lines[0]
    no_answer = _write(tmp_path / "a.parquet", [ROW, {**ROW, "reward_model": {"ground_truth": " "}},
                                               {**ROW, "prompt": []}])
    lines = preflight.data_file_problems(no_answer, "data.val_files", "prompt", "data_source")
    assert len(lines) == 2 and "row 2" in lines[0] and "ground_truth (row 1" in lines[1]
    # the demo writes its own files on first use: not a problem while missing
    assert preflight.data_file_problems("data/arith-1digit/train.parquet", "data.train_files", "prompt",
                                        "data_source") == []


def test_reward_file_problems(tmp_path):
    raising = tmp_path / "raising.py"
    raising.write_text("import this_module_does_not_exist\n")
    good = tmp_path / "good.py"
    good.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")

    def problems(path, name="compute_score"):
        return preflight.reward_problems(load_config(None, [f"custom_reward_function.path={path}",
                                                            f"custom_reward_function.name={name}"]))

    assert problems(good) == []
    assert len(problems(good, "score")) == 1 and "compute_score" in problems(good, "score")[0]
    assert len(problems(raising)) == 1 and "this_module_does_not_exist" in problems(raising)[0]
    assert "not found" in problems(tmp_path / "missing.py")[0]


def test_model_checks(tmp_path, tiny_model_dir):
    key, trust = "actor_rollout_ref.model.path", "actor_rollout_ref.model.trust_remote_code"
    assert preflight.model_problems(str(tiny_model_dir), key, False, trust) == []
    fancy = _custom_code_model(tmp_path / "fancy")
    assert preflight.model_problems(str(fancy), key, True, trust) == []  # allowed when asked
    assert "trust_remote_code" in preflight.model_problems(str(fancy), key, False, trust)[0]
    # an architecture transformers has itself needs no remote code, auto_map or not
    known = tmp_path / "known"
    known.mkdir()
    (known / "config.json").write_text(json.dumps({"model_type": "qwen2", "auto_map": {"AutoConfig": "x.Y"}}))
    (known / "model.safetensors").write_bytes(b"")
    assert preflight.model_problems(str(known), key, False, trust) == []
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert "no weights" in preflight.model_problems(str(no_weights), key, False, trust)[0]
    assert "does not exist" in preflight.model_problems("./nowhere", key, False, trust)[0]
    checkpoint = tmp_path / "global_step_2"
    (checkpoint / "actor").mkdir(parents=True)
    (checkpoint / "actor" / "config.json").write_text("{}")
    (checkpoint / "actor_lora").mkdir()
    (checkpoint / "actor_lora" / "adapter_config.json").write_text("{}")
    assert "is a checkpoint; its model is in" in preflight.model_problems(str(checkpoint), key, False, trust)[0]
    assert "LoRA adapters only" in preflight.model_problems(str(checkpoint / "actor_lora"), key, False, trust)[0]
    # a gguf_file named beside a config.json must be there too (it is what loads)
    missing = preflight.model_problems(str(tiny_model_dir), key, False, trust, gguf_file="missing.gguf")
    assert "does not exist" in preflight.model_problems(str(tmp_path / "m.gguf"), key, False, trust)[0]
    # planning needs only the shape: a named shape plans without the hub
    assert preflight.model_problems("Qwen/Qwen2.5-0.5B-Instruct", key, False, trust, named_shape_ok=True) == []
    assert len(missing) == 1 and "has no missing.gguf" in missing[0]


def test_a_file_that_is_no_gguf_is_refused_with_its_name_while_planning(tmp_path):
    from rlanywhere.model_shape import read_model_shape
    from rlanywhere.vocabulary import PlanError

    broken = tmp_path / "model.gguf"
    broken.write_bytes(b"not a gguf file" * 64)
    with pytest.raises(PlanError, match="model.gguf is not a readable GGUF file"):
        read_model_shape(str(broken))


def test_the_reward_models_path_is_read_before_anything_loads(tmp_path, tiny_model_dir, monkeypatch):
    """reward_model.model.path is checked as the actor's is: a missing folder, or a hub id neither cached nor
    reachable, is one line naming the key (not huggingface_hub's retries half a minute later); with the reward model
    off the key is not read."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    base = [f"actor_rollout_ref.model.path={tiny_model_dir}"]
    missing = load_config(None, base + ["reward_model.enable=true", "reward_model.model.path=./nowhere"])
    lines = preflight.run_model_problems(missing)
    assert len(lines) == 1 and lines[0].startswith("reward_model.model.path: ") and "does not exist" in lines[0]
    hub = load_config(None, base + ["reward_model.enable=true", "reward_model.model.path=someone/Some-RM-v0.1"])
    lines = preflight.run_model_problems(hub)
    assert len(lines) == 1 and "reward_model.model.path: someone/Some-RM-v0.1 is not in the local" in lines[0]
    off = load_config(None, base + ["reward_model.model.path=./nowhere"])
    assert preflight.run_model_problems(off) == []


def test_an_untold_tie_of_the_lm_head_is_its_model_types_default(tmp_path):
    """A config.json without tie_word_embeddings: llama's and qwen2's classes default to a separate LM head (its
    parameters count in the plan), gemma's to a tied one; a type transformers does not know, PretrainedConfig's True."""
    from rlanywhere.model_shape import read_model_shape

    def shape(model_type):
        folder = tmp_path / model_type
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({
            "model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 1000, "intermediate_size": 128}))
        return read_model_shape(str(folder))

    assert not shape("llama").tie_word_embeddings and not shape("qwen2").tie_word_embeddings
    assert shape("gemma").tie_word_embeddings and shape("not_a_known_type").tie_word_embeddings


def test_a_multimodal_config_keeps_its_tie_flag_outside_its_text_config(tmp_path):
    """transformers writes Qwen2.5-VL's config.json with tie_word_embeddings beside text_config, whose config class
    has no such field: the outer flag is read, and a text type whose class lacks the field does not stop planning."""
    from transformers import AutoConfig

    from rlanywhere.model_shape import read_model_shape

    text = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
            "intermediate_size": 128, "vocab_size": 1000}
    for tied in (False, True):
        folder = tmp_path / f"vl-{tied}"
        AutoConfig.for_model("qwen2_5_vl", text_config=text, tie_word_embeddings=tied).save_pretrained(folder)
        shape = read_model_shape(str(folder))
        assert shape.tie_word_embeddings is tied and shape.model_type == "qwen2_5_vl_text"
    folder = tmp_path / "vl-untold"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl",
                                                    "text_config": {"model_type": "qwen2_5_vl_text", **text}}))
    assert read_model_shape(str(folder)).tie_word_embeddings  # no flag anywhere: PretrainedConfig's default


def test_a_config_json_beside_the_named_gguf_file_is_a_model(tmp_path):
    """With actor_rollout_ref.model.gguf_file the weights come from that file: a folder with a config.json and the
    GGUF (no safetensors) is accepted, as the loader loads it."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "vocab_size": 1000}))
    (tmp_path / "model.Q4.gguf").write_bytes(b"GGUF")
    key, trust = "actor_rollout_ref.model.path", "actor_rollout_ref.model.trust_remote_code"
    assert preflight.model_problems(str(tmp_path), key, False, trust, gguf_file="model.Q4.gguf") == []
    assert "no weights" in preflight.model_problems(str(tmp_path), key, False, trust)[0]


def test_good_inputs_have_no_problems(tiny_model_dir, arith_data):
    cfg = load_config(None, [f"data.train_files={arith_data}/train.parquet", f"data.val_files={arith_data}/test.parquet",
                             f"actor_rollout_ref.model.path={tiny_model_dir}"])
    assert preflight.input_problems(cfg) == []


def test_learning_rates_must_be_positive():
    cfg = load_config(None, ["actor_rollout_ref.actor.optim.lr=0", "critic.optim.lr=-1e-5",
                             "algorithm.adv_estimator=gae"])
    lines = preflight.value_problems(cfg)
    assert len(lines) == 2 and "actor_rollout_ref.actor.optim.lr=0" in lines[0] and "critic.optim.lr" in lines[1]
    grpo = load_config(None, ["critic.optim.lr=-1e-5", "algorithm.adv_estimator=grpo"])
    assert preflight.value_problems(grpo) == []  # no critic: its rate is not used


def test_chat_with_no_demo_yet_says_how_latest_appears(tmp_path, capsys, monkeypatch, no_loading):
    monkeypatch.chdir(tmp_path)
    assert main(["chat", "--model", "runs/demo/latest/final_model", "--prompt", "hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model runs/demo/latest/final_model does not exist")
    assert "rlanywhere demo" in lines[0]


def test_a_mistyped_key_and_bad_inputs_come_in_one_answer(tmp_path, capsys, no_loading):
    """A configuration problem does not hide the inputs' problems: both come in one answer, before anything loads."""
    code = main(["train", "optim.lr=1e-6", f"data.train_files={tmp_path / 'missing.parquet'}",
                 f"custom_reward_function.path={tmp_path / 'missing.py'}", f"trainer.default_local_dir={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert all(line.startswith("error: ") for line in lines), lines
    assert "unknown config key 'optim.lr'" in lines[0]
    assert any("data.train_files" in line and "missing.parquet" in line for line in lines[1:]), lines
    assert any("custom_reward_function" in line and "missing.py" in line for line in lines[1:]), lines
    assert not (tmp_path / "run").exists()
