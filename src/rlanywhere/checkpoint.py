"""Checkpoints: written atomically, loadable by plain transformers, enough to resume a killed run exactly.

    RUN_DIR/checkpoints/global_step_N/
        actor/                  HF model (`AutoModelForCausalLM.from_pretrained` loads it) + tokenizer; LoRA merged
        actor_lora/             the peft adapter (LoRA runs only: what resume loads)
        critic/                 backbone (HF format) + value_head.safetensors (PPO/GAE runs only)
        optim.pt                optimizer + scheduler state dicts (torch.load(weights_only=True))
        rng.pt                  torch CPU/CUDA RNG states
        trainer_state.json      step, data position, KL controller, python/numpy RNG, plan adaptations
    RUN_DIR/checkpoints/latest_checkpointed_iteration.txt

Each checkpoint is written into `global_step_N.tmp` and renamed into place, so a run killed mid-save leaves the
previous checkpoint intact and never a half-written one.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
from typing import Any, Optional

import numpy as np
import torch

LATEST_FILE = "latest_checkpointed_iteration.txt"


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def capture_rng() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for trainer_state.json)."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    plain = {"python": [py_version, list(py_state), py_gauss],
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return tensors, plain


def restore_rng(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    version, state, gauss = plain["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def checkpoint_root(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def save_checkpoint(run_dir: str, step: int, *, actor, tokenizer, critic=None, optimizers: dict, schedulers: dict,
                    trainer_state: dict, export_actor=None, keep: Optional[int] = None) -> str:
    """Write checkpoint `step`; returns its directory. `export_actor` is a merged plain HF model for LoRA runs."""
    root = checkpoint_root(run_dir)
    final = os.path.join(root, f"global_step_{step}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    is_lora = export_actor is not None
    (export_actor if is_lora else actor).save_pretrained(os.path.join(tmp, "actor"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(tmp, "actor"))
    if is_lora:
        actor.save_pretrained(os.path.join(tmp, "actor_lora"))
    if critic is not None:
        critic.save(os.path.join(tmp, "critic"))
    torch.save({"optimizers": {k: v.state_dict() for k, v in optimizers.items()},
                "schedulers": {k: v.state_dict() for k, v in schedulers.items()}}, os.path.join(tmp, "optim.pt"))
    rng_tensors, rng_plain = capture_rng()
    torch.save(rng_tensors, os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as handle:
        json.dump({**trainer_state, "global_step": step, "rng": rng_plain, "lora": is_lora}, handle)

    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write_text(os.path.join(root, LATEST_FILE), str(step))
    if keep:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints, oldest first (`.tmp` leftovers of a killed save are ignored)."""
    paths = [p for p in glob.glob(os.path.join(checkpoint_root(run_dir), "global_step_*"))
             if not p.endswith(".tmp") and os.path.exists(os.path.join(p, "trainer_state.json"))]
    return sorted(paths, key=lambda p: int(p.rsplit("_", 1)[-1]))


def find_latest_checkpoint(run_dir: str) -> Optional[str]:
    marker = os.path.join(checkpoint_root(run_dir), LATEST_FILE)
    if os.path.exists(marker):
        with open(marker) as handle:
            path = os.path.join(checkpoint_root(run_dir), f"global_step_{handle.read().strip()}")
        if os.path.exists(os.path.join(path, "trainer_state.json")):
            return path
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _load_safetensors_dir(directory: str) -> dict:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {directory}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def load_checkpoint(path: str, *, actor, critic=None, optimizers: dict, schedulers: dict) -> dict[str, Any]:
    """Load weights, optimizer/scheduler state and RNG from `path` into live objects; returns trainer_state."""
    with open(os.path.join(path, "trainer_state.json")) as handle:
        state = json.load(handle)
    if state.get("lora"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(actor, _load_safetensors_dir(os.path.join(path, "actor_lora")))
    else:
        weights = _load_safetensors_dir(os.path.join(path, "actor"))
        missing, unexpected = actor.load_state_dict(weights, strict=False)
        tied = {k for k in missing if k.endswith("lm_head.weight")} if actor.config.tie_word_embeddings else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"actor checkpoint {path} does not match the model: "
                               f"missing={sorted(set(missing) - tied)[:5]} unexpected={unexpected[:5]}")
    if critic is not None:
        critic.load_weights(os.path.join(path, "critic"))
    optim_state = torch.load(os.path.join(path, "optim.pt"), map_location="cpu", weights_only=True)
    for name, optimizer in optimizers.items():
        optimizer.load_state_dict(optim_state["optimizers"][name])
    for name, scheduler in schedulers.items():
        scheduler.load_state_dict(optim_state["schedulers"][name])
    restore_rng(torch.load(os.path.join(path, "rng.pt"), weights_only=True), state["rng"])
    return state
