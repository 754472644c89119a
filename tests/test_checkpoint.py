"""Checkpoints: atomic (a half-written save is ignored), RNG round trip, weights/optimizer restored exactly."""

import os
import random

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlanywhere.checkpoint import (capture_rng, find_latest_checkpoint, list_checkpoints, load_checkpoint, restore_rng)
from rlanywhere.checkpointer import save_checkpoint
from rlanywhere.models import ValueModel


def tiny_lm(seed=0):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=50,
                                        tie_word_embeddings=True))


class FakeTokenizer:
    def save_pretrained(self, path):
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "tokenizer_marker"), "w").close()


def test_rng_round_trip():
    tensors, plain = capture_rng()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    restore_rng(tensors, plain)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_save_load_round_trip_and_atomicity(tmp_path):
    actor, critic = tiny_lm(0), ValueModel.from_causal_lm(tiny_lm(1))
    torch.nn.init.normal_(critic.value_head.weight)
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    actor(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    save_checkpoint(str(tmp_path), 3, actor=actor, tokenizer=FakeTokenizer(), critic=critic,
                    optimizers={"actor": opt}, schedulers={"actor": sched}, trainer_state={"loader": {"position": 3}})
    # A save killed half-way leaves a .tmp directory: it must never be picked up.
    os.makedirs(tmp_path / "checkpoints" / "global_step_9.tmp")
    assert find_latest_checkpoint(str(tmp_path)).endswith("global_step_3")
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["global_step_3"]

    actor2, critic2 = tiny_lm(5), ValueModel.from_causal_lm(tiny_lm(6))
    opt2 = torch.optim.AdamW(actor2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0)
    state = load_checkpoint(find_latest_checkpoint(str(tmp_path)), actor=actor2, critic=critic2,
                            optimizers={"actor": opt2}, schedulers={"actor": sched2})
    assert state["global_step"] == 3 and state["loader"] == {"position": 3}
    for a, b in zip(actor.state_dict().values(), actor2.state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(critic.state_dict().values(), critic2.state_dict().values()):
        assert torch.equal(a, b)
    exp_avg = [s["exp_avg"] for s in opt.state.values()]
    exp_avg2 = [s["exp_avg"] for s in opt2.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, exp_avg2))


def test_keep_limits_old_checkpoints(tmp_path):
    actor = tiny_lm()
    opt = torch.optim.AdamW(actor.parameters())
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, actor=actor, tokenizer=FakeTokenizer(), optimizers={"a": opt},
                        schedulers={}, trainer_state={}, keep=2)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["global_step_2", "global_step_3"]


def test_retention_keeps_the_last_healthy_checkpoint_and_non_positive_keeps_all(tmp_path):
    """keep=1 with a protected (last healthy) checkpoint: the diverged run can still resume from it; keep=-1
    (verl's "keep all") deletes nothing (it deleted every checkpoint, the new one included)."""
    from rlanywhere.checkpointer import Checkpointer
    from rlanywhere.distributed import DataParallel

    actor = tiny_lm()
    opt = torch.optim.AdamW(actor.parameters())

    def save(checkpointer, step, protect=None):
        return checkpointer.save(step, actor=actor, tokenizer=FakeTokenizer(), critic=None, optimizers={"a": opt},
                                 schedulers={}, trainer_state={}, protect=protect)

    one = Checkpointer(str(tmp_path / "one"), DataParallel(), keep=1)
    healthy = save(one, 1)
    save(one, 2, protect=healthy)
    save(one, 3, protect=healthy)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path / "one"))] == ["global_step_1",
                                                                                      "global_step_3"]
    every = Checkpointer(str(tmp_path / "all"), DataParallel(), keep=-1)
    for step in (1, 2, 3):
        assert os.path.isdir(save(every, step))
    assert len(list_checkpoints(str(tmp_path / "all"))) == 3


class _RunsCode:
    """A pickle that makes a directory when loaded: what a tampered checkpoint file could do instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_checkpoint_whose_dcp_metadata_would_run_code_is_refused(tmp_path):
    """A checkpoint folder with a dcp/ directory loads through torch.distributed.checkpoint, whose .metadata is a
    pickle: a tampered one (manifest rewritten to match) is refused without running anything, and resume reports
    the checkpoint as unusable instead of crashing."""
    import json
    import pickle

    import pytest

    from rlanywhere.checkpoint import CheckpointError, write_manifest
    from rlanywhere.checkpointer import Checkpointer
    from rlanywhere.distributed import DataParallel

    step = tmp_path / "run" / "checkpoints" / "global_step_1"
    (step / "dcp").mkdir(parents=True)
    marker = tmp_path / "code_ran"
    (step / "dcp" / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    (step / "trainer_state.json").write_text(json.dumps({"global_step": 1}))
    write_manifest(str(step))
    with pytest.raises(CheckpointError, match="is not something DCP writes"):
        Checkpointer(str(tmp_path / "run"), DataParallel()).resume(actor=torch.nn.Linear(2, 2), optimizers={},
                                                                   schedulers={})
    assert not marker.exists()


def test_a_dcp_entry_that_would_run_code_is_refused_before_it_loads(tmp_path):
    """DCP's own planner loads a checkpoint's non-tensor entries (optimizer param_groups) with weights_only=False;
    ours loads each with weights_only=True first."""
    import io

    import pytest

    from rlanywhere.dist_checkpoint import _weights_only_planner

    marker = tmp_path / "code_ran"
    payload = io.BytesIO()
    torch.save(_RunsCode(str(marker)), payload)
    payload.seek(0)
    with pytest.raises(Exception, match="Weights only load failed"):
        _weights_only_planner().load_bytes(None, payload)
    assert not marker.exists()
    plain = io.BytesIO()
    torch.save({"lr": 1e-3, "betas": (0.9, 0.999)}, plain)
    plain.seek(0)
    planner = _weights_only_planner()
    planner.flatten_state_dict, planner.state_dict = False, {}
    planner.load_bytes(type("Item", (), {"dest_index": type("Index", (), {"fqn": "group"})()})(), plain)
    assert planner.state_dict["group"] == {"lr": 1e-3, "betas": (0.9, 0.999)}
