"""The planner package: each decision comes with its reason as one value, the memory plan applied to the Plan is the
one that was kept (with its own reasons), reasons carry no benchmark timings, and the planner imports nothing from
the layer that runs models."""

from __future__ import annotations

import re

import pytest

from rlanywhere.config import load_config
from rlanywhere.machine import HardwareProbe
from rlanywhere.planner import make_plan
from rlanywhere.planner.memory import plan_memory

from .test_vocabulary import import_graph

PPO_05B_KL = ["actor_rollout_ref.model.path=qwen2.5-0.5b", "algorithm.adv_estimator=gae",
              "actor_rollout_ref.actor.use_kl_loss=true", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=8",
              "data.max_prompt_length=256", "data.max_response_length=512",
              "actor_rollout_ref.actor.ppo_mini_batch_size=16"]


def plan_of(items, card):
    return make_plan(load_config(None, list(items)), HardwareProbe.fake(card, triton_usable=True),
                     for_execution=False)


@pytest.mark.slow
def test_reasons_describe_the_memory_plan_that_was_kept():
    """PPO with a critic and a reference on 4 emulated T4s: the replicated memory plan needs gradient checkpointing,
    and offload, so the planner shards, where checkpointing is not needed. The reasons must be the sharded plan's
    (the replicated attempt's "on: ..." once stayed beside a plan that had it off)."""
    auto = plan_of([*PPO_05B_KL, "trainer.n_gpus_per_node=4"], "t4")
    assert auto.data_parallel == "shard"
    forced = plan_of([*PPO_05B_KL, "trainer.n_gpus_per_node=4", "hardware.data_parallel=shard"], "t4")
    for key in ("gradient_checkpointing", "optimizer_offload", "param_offload"):
        assert auto.reasons[key].startswith("on") == bool(getattr(auto, key)), (key, auto.reasons[key])
    for key, reason in forced.reasons.items():
        if key != "data_parallel":
            assert auto.reasons[key] == reason, key
    assert not auto.gradient_checkpointing and auto.reasons["gradient_checkpointing"].startswith("off")


def test_memory_planning_changes_nothing_in_the_plan():
    """plan_memory is a pure function: a discarded attempt leaves no trace."""
    import copy

    from rlanywhere.planner.device import make_target

    cfg = load_config(None, [*PPO_05B_KL, "trainer.n_gpus_per_node=2"])
    machine = HardwareProbe.fake("p40")
    plan = make_plan(cfg, machine, for_execution=False, emulate="p40")
    before = copy.deepcopy(plan.to_dict())
    from rlanywhere.machine import card_spec
    from rlanywhere.model_shape import read_model_shape

    target = make_target(card_spec("p40"), None, "cpu", machine)
    memory = plan_memory(cfg, plan, target, read_model_shape("qwen2.5-0.5b"), None, False, 0, True, shard_world=2)
    assert memory.reasons["gradient_checkpointing"] and memory.estimate["peak_bytes"] <= memory.budget
    assert plan.to_dict() == before


# A timing figure: "3.16 s", "14.6 us", "0.45 ms", "2x", "1.4-1.8x", "14% shorter", "... vs ..."
TIMING = re.compile(r"\d\s?(s|ms|us|µs)\b|\d+(\.\d+)?x\b|\d+\s?% (faster|shorter|slower|longer)|\bvs\.? \d")

CARDS_AND_RUNS = [
    (card, extra) for card in (None, "p40", "t4", "h100")
    for extra in ([], ["hardware.precision=fp32", "trainer.n_gpus_per_node=2"],
                  ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.use_dynamic_bsz=true"])]


@pytest.mark.slow
def test_no_reason_contains_a_timing_figure():
    """Reasons say why in a user's words; measurements belong in docs/benchmarks.md."""
    assert TIMING.search("update 2.58-2.73 s vs 3.16-3.17 s") and TIMING.search("1.4-1.8x faster")
    assert TIMING.search("30.7 instead of 14.6 us") and TIMING.search("14% shorter bf16 decode steps")
    assert not TIMING.search("42 sequences x 768 tokens") and not TIMING.search("8 samples per prompt")
    found = {}
    for card, extra in CARDS_AND_RUNS:
        plan = plan_of([*PPO_05B_KL, *extra], card)
        for key, reason in {**plan.reasons, **plan.rollout.reasons}.items():
            if TIMING.search(reason):
                found[(card, key)] = reason
    assert not found, found


def test_the_planner_imports_nothing_from_the_running_layer():
    """The deciding layer sits below the running one: it reads the config, the machine probe, model shapes and the
    estimator, and writes a Plan. runtime.py (which applies a plan: TF32 flags, autocast) is reachable from it for
    callers that imported those helpers from the planner."""
    graph = import_graph()
    planning = {"rlanywhere.errors", "rlanywhere.vocabulary", "rlanywhere.estimator", "rlanywhere.machine",
                "rlanywhere.cache", "rlanywhere.model_shape", "rlanywhere.plans", "rlanywhere.runtime",
                # leaves the planner reads: each estimator's registered needs, which GPU a rank's layout gives it
                "rlanywhere.algorithms", "rlanywhere.rank_layout", "rlanywhere.async_plan"}
    planner_modules = {name for name in graph if name == "rlanywhere.planner" or name.startswith("rlanywhere.planner.")}
    assert {"rlanywhere.planner.memory", "rlanywhere.planner.sharding", "rlanywhere.planner.rollout"} <= planner_modules
    for name in planner_modules | planning:
        outside = graph[name] - planning - planner_modules
        assert not outside, f"{name} imports {sorted(outside)}"
    assert not any(name in graph["rlanywhere.distributed"] for name in planner_modules)


@pytest.mark.parametrize("name", ["prepare_environment", "apply_runtime", "autocast_context", "make_grad_scaler",
                                  "training_attention_context"])
def test_runtime_helpers_are_still_reachable_from_the_planner(name):
    from rlanywhere import planner, runtime

    assert getattr(planner, name) is getattr(runtime, name)


def test_the_fp16_checks_run_only_when_a_precision_decision_reads_them(monkeypatch):
    """They launch kernels on the live card (seconds on a new machine): a bf16 card's plan never waits for them, a
    card with fp16 tensor cores and no bf16 runs them once, and the probe keeps their result."""
    from rlanywhere.planner import precision
    from rlanywhere.planner.device import make_target

    ran = []
    monkeypatch.setattr(precision, "fp16_problems", lambda device: ran.append(device) or [])
    for card, chosen, runs in (("h100", "bf16", []), ("v100", "fp16", ["cuda:0"])):
        ran.clear()
        machine = HardwareProbe.fake(card)
        machine.live = True  # as probed on the machine itself
        real = machine.devices[0]
        checks = precision.fp16_checks(make_target(None, real, "cuda:0", machine), real, "cuda:0", machine)
        assert ran == []  # nothing yet
        decision = precision.decide_precision("auto", make_target(None, real, "cuda:0", machine), checks)
        assert decision.value.name == chosen and ran == runs
        assert real.fp16_problems == ([] if runs else None)
        precision.decide_precision("fp16", make_target(None, real, "cuda:0", machine), checks)
        assert ran == ["cuda:0"]  # an fp16 request reads them: run once, whichever decision read them first
