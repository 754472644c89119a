"""verl's own example command lines (tests/data/verl_examples, README there) plan here unchanged: every key is either
ours or answered with a notice, nothing is refused, nothing raises. Five of them also train one CPU step with a tiny
model, only paths and sizes changed."""

from __future__ import annotations

import http.server
import json
import logging
import threading
from pathlib import Path

import pytest

from rlanywhere.cli import main as cli_main
from rlanywhere.config import ConfigError, load_config, schema_keys

EXAMPLES = Path(__file__).resolve().parent / "data" / "verl_examples"
FIXTURES = sorted(EXAMPLES.glob("*.args"))
MULTI_TURN_BUILT = "multi_turn.enable" in schema_keys() or any(k.startswith("actor_rollout_ref.rollout.multi_turn.")
                                                                for k in schema_keys())


def fixture_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def expand(path: Path, model: Path, data: Path, sandbox_url: str = "http://127.0.0.1:9",
           reward_model: Path | None = None) -> list[str]:
    """The fixture's arguments with the placeholders of the replaced paths filled in."""
    values = {"{MODEL}": str(model), "{TRAIN}": f"{data}/train.parquet", "{VAL}": f"{data}/test.parquet",
              "{CONFIG_DIR}": str(EXAMPLES / "config"), "{SANDBOX_URL}": sandbox_url,
              "{RM_MODEL}": str(reward_model or model)}
    out = []
    for line in fixture_lines(path):
        for placeholder, value in values.items():
            line = line.replace(placeholder, value)
        out.append(line)
    return out


def marks_for(path: Path):
    text = path.read_text()
    if ("multi_turn" in text or "--config-name" in text and "multiturn" in path.name) and not MULTI_TURN_BUILT:
        return [pytest.mark.xfail(reason="multi-turn lands separately", strict=False)]
    return []


@pytest.fixture(scope="module")
def tiny_rm_dir(tmp_path_factory) -> Path:
    """A tiny sequence-classification reward model, for the scripts that score with one."""
    from tests.test_reward_model import build_tiny_reward_model

    return build_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"))


@pytest.fixture(scope="module")
def sandbox_url():
    """A local HTTP server standing in for the sandbox service (reachable; never called)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/run_code"
    server.shutdown()


def test_there_are_enough_fixtures_from_both_layouts():
    assert len(FIXTURES) >= 20
    assert any(p.name.startswith("current__") for p in FIXTURES) and any(p.name.startswith("v0.5.0__")
                                                                       for p in FIXTURES)
    for path in FIXTURES:  # each names its source script and verl commit
        assert path.read_text().startswith(("# source: volcengine/verl examples/",
                                            "# source: volcengine/verl verl/experimental/")), path.name


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=marks_for(p)) for p in FIXTURES])
def test_verl_example_plans_with_every_key_answered(path, tiny_model_dir, tiny_rm_dir, gsm8k_data, sandbox_url, caplog,
                                                    capsys):
    args = expand(path, tiny_model_dir, gsm8k_data, sandbox_url, reward_model=tiny_rm_dir)
    with caplog.at_level(logging.WARNING):
        code = cli_main(["plan", *args])  # a traceback fails the test by itself
    captured = capsys.readouterr()
    assert code == 0, captured.out[-2000:] + captured.err[-2000:]
    notices = "\n".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("notice:"))
    schema = set(schema_keys())
    for arg in args:
        if arg.startswith("--"):
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        assert key in schema or any(key.startswith(k + ".") for k in schema if k.endswith("override_config")) \
            or key in notices, f"{key} was neither read nor noticed"


def test_a_reward_model_script_gets_all_its_problems_at_once(tiny_model_dir, tiny_rm_dir, gsm8k_data, capsys):
    path = EXAMPLES / "current__ppo_trainer__run_qwen2-7b_rm_seq_balance.args"
    args = expand(path, tiny_model_dir, gsm8k_data, reward_model=tiny_rm_dir)
    assert cli_main(["plan", *args, "trainer.no_such_key=1", "algorithm.adv_estimator=nope"]) == 2
    err = capsys.readouterr().err
    assert "trainer.no_such_key" in err and "adv_estimator='nope'" in err


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.no_such=1", "data.no_such=2", "algorithm.adv_estimator=ppo",
                           "data.train_batch_size=0", "actor_rollout_ref.rollout.name=tensorrt"])
    message = str(info.value)
    assert message.startswith("5 problems")
    for part in ("trainer.no_such", "data.no_such", "adv_estimator='ppo'", "train_batch_size must be positive",
                 "rollout.name='tensorrt'"):
        assert part in message


def test_cli_exits_2_with_the_whole_list(capsys):
    assert cli_main(["plan", "trainer.no_such=1", "data.no_such=2"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "trainer.no_such" in err and "data.no_such" in err


# name of the fixture -> the sizes that keep one step to seconds on a CPU (paths are filled in by expand)
SMALL = ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_prompt_length=256",
         "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "critic.ppo_micro_batch_size_per_gpu=2", "critic.ppo_mini_batch_size=2",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "data.gen_batch_size=null",
         "+reward_model.reward_kwargs.overlong_buffer_cfg.len=4",  # the size in the spelling the script uses
         "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1",
         "trainer.val_before_train=false"]  # on a machine without a GPU the planner picks the CPU
TRAINED = ["current__ppo_trainer__run_deepseek7b_llm_sp2", "current__remax_trainer__run_qwen2.5-3b_seq_balance",
           "current__gmpo_trainer__test_dapo_7b_math", "current__cispo_trainer__run_cispo_qwen2_5_0_5b_gsm8k",
           "current__gpg_trainer__run_qwen2-7b_math"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_verl_example_trains_one_cpu_step(name, tiny_model_dir, gsm8k_data, tmp_path, capsys):
    args = expand(EXAMPLES / f"{name}.args", tiny_model_dir, gsm8k_data)
    args = args + SMALL + [f"trainer.default_local_dir={tmp_path / 'run'}"]
    assert cli_main(["train", *args]) == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [row for row in rows if "actor/pg_loss" in row]
    assert len(trained) == 1 and all(isinstance(v, (int, float)) for v in trained[0].values())
