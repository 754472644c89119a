"""Checkpoints: written atomically, loadable by plain transformers, enough to resume a killed run exactly.

    RUN_DIR/checkpoints/global_step_N/
        actor/                  HF model (`AutoModelForCausalLM.from_pretrained` loads it) + tokenizer; LoRA merged
        actor_lora/             the peft adapter (LoRA runs only: what resume loads)
        critic/                 backbone (HF format) + value_head.safetensors (PPO/GAE runs only)
        optim.pt                optimizer + scheduler state dicts (torch.load(weights_only=True))
        rng.pt                  torch CPU/CUDA RNG states
        trainer_state.json      step, data position, KL controller, python/numpy RNG, plan adaptations
        config.yaml             the resolved run config (resume compares it with the new one)
        manifest.json           size and sha256 of every file above, written last
    RUN_DIR/checkpoints/latest_checkpointed_iteration.txt

Each checkpoint is written into `global_step_N.tmp`, every file fsynced, and renamed into place, so a run killed
mid-save leaves the previous checkpoint intact and never a half-written one. A write that fails (disk full, no
permission) removes the `.tmp` and raises `CheckpointWriteError`; weights that are NaN/inf are never saved.
Saving, verifying and resuming are driven by the one checkpointer (checkpointer.py) for this layout and the
sharded one (dist_checkpoint.py); this module is the replicated layout's files and the shared helpers.
On resume (`resume_latest`) each checkpoint is verified against its manifest and checked for non-finite weights;
a damaged one is named, moved aside to `global_step_N.damaged`, and the previous one is used; checkpoints later
than the resumed step (another timeline) are moved aside to `global_step_N.stale`.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import logging
import os
import random
import shutil
from typing import Any, Callable, Optional

import numpy as np
import torch

from .checkpoint_dirs import LATEST_FILE, checkpoint_root, find_latest_checkpoint, list_checkpoints  # noqa: F401
from .errors import UserError
from .lora import load_adapter_state

log = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"


class CheckpointError(UserError):
    """A checkpoint that cannot be used (damaged, non-finite) or written; the message names it and the fix."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, permissions); the partial write was removed."""


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


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: str) -> None:
    """Every file under `directory` and the directories themselves on disk (before a rename publishes them)."""
    for parent, _, names in os.walk(directory):
        for name in names:
            with open(os.path.join(parent, name), "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(parent)


def write_manifest(directory: str) -> dict:
    """Hash and fsync every file under `directory`, then write (and fsync) manifest.json listing them."""
    files = {}
    for parent, _, names in os.walk(directory):
        for name in sorted(names):
            path = os.path.join(parent, name)
            rel = os.path.relpath(path, directory)
            if rel == MANIFEST_FILE:
                continue
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            files[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
        _fsync_dir(parent)
    manifest = {"format": 1, "files": files}
    with open(os.path.join(directory, MANIFEST_FILE), "w") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    return manifest


def verify_checkpoint(path: str) -> Optional[str]:
    """None when every file matches manifest.json, else what is wrong (naming the file).

    A checkpoint without one cannot be verified (its manifest deleted, or a save that never finished writing it):
    it is damaged, and the message says so."""
    manifest_path = os.path.join(path, MANIFEST_FILE)
    if not os.path.exists(manifest_path):
        return (f"it has no {MANIFEST_FILE}, so its files cannot be verified (deleted, or written by a save that "
                "did not finish)")
    try:
        with open(manifest_path) as handle:
            files = json.load(handle)["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({exc})"
    for rel, expected in files.items():
        file = os.path.join(path, rel)
        if not os.path.exists(file):
            return f"{rel} is missing"
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {expected['bytes']} (truncated?)"
        if _sha256(file) != expected["sha256"]:
            return f"{rel} does not match its sha256 in the manifest (corrupted)"
    return None


def first_nonfinite_parameter(*models) -> Optional[str]:
    """The name of the first parameter holding NaN/inf in any of `models` (None entries skipped), else None."""
    for model in models:
        if model is None:
            continue
        for name, param in model.named_parameters():
            if not bool(torch.isfinite(param).all()):
                return name
    return None


_DISK_FULL_TEXTS = ("unexpected pos", "file write failed", "no space left on device", "os error 28",
                    "disk quota exceeded", "os error 122")


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC, directly or as the cause of torch.save's "unexpected pos" / "file write failed" RuntimeError or of
    a safetensors error ("No space left on device (os error 28)")."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(exc).lower() for text in _DISK_FULL_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


_is_disk_full = is_disk_full


def publish_checkpoint(run_dir: str, tmp: str, step: int, keep: Optional[int], protect: str | None = None) -> str:
    """Make the complete `tmp` directory checkpoint `step`: rename it into place, fsync, point `latest` at it, and
    keep only the newest `keep` (None or <= 0: all, as verl), never the new one nor `protect` (the run's last healthy
    checkpoint: after diverged updates it is the one to resume from). A crash before the rename leaves the previous
    checkpoints as they were."""
    root = checkpoint_root(run_dir)
    final = os.path.join(root, f"global_step_{step}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    _atomic_write_text(os.path.join(root, LATEST_FILE), str(step))
    if keep is not None and keep > 0:
        spared = {os.path.realpath(path) for path in (final, protect) if path}
        for old in list_checkpoints(run_dir)[:-keep]:
            if os.path.realpath(old) not in spared:
                shutil.rmtree(old, ignore_errors=True)
    return final


@contextlib.contextmanager
def as_users_load_it(model):
    """`model`'s config while it is saved for users: the KV cache on (training turns `use_cache` off; a plain forward
    of the exported model would otherwise run without it)."""
    config = getattr(model, "config", None)
    previous = getattr(config, "use_cache", None)
    if config is not None and previous is not None:
        config.use_cache = True
    try:
        yield model
    finally:
        if config is not None and previous is not None:
            config.use_cache = previous


def write_checkpoint_files(tmp: str, step: int, *, actor, tokenizer, critic, optimizers: dict, schedulers: dict,
                            trainer_state: dict, export_actor, config_yaml: Optional[str]) -> None:
    is_lora = export_actor is not None
    with as_users_load_it(export_actor if is_lora else actor) as exported:
        exported.save_pretrained(os.path.join(tmp, "actor"), safe_serialization=True)
    tokenizer.save_pretrained(os.path.join(tmp, "actor"))
    if is_lora:
        actor.save_pretrained(os.path.join(tmp, "actor_lora"))
    if critic is not None:
        critic.save(os.path.join(tmp, "critic"))
    torch.save({"optimizers": {k: v.state_dict() for k, v in optimizers.items()},
                "schedulers": {k: v.state_dict() for k, v in schedulers.items()}}, os.path.join(tmp, "optim.pt"))
    write_run_state(tmp, step, trainer_state, config_yaml, lora=is_lora)


def write_run_state(tmp: str, step: int, trainer_state: dict, config_yaml: Optional[str], **extra) -> None:
    """The non-model part of a checkpoint: RNG states, the config, and trainer_state.json (written last: its presence
    is what the kill -9 tests wait for)."""
    rng_tensors, rng_plain = capture_rng()
    torch.save(rng_tensors, os.path.join(tmp, "rng.pt"))
    if config_yaml is not None:
        with open(os.path.join(tmp, "config.yaml"), "w") as handle:
            handle.write(config_yaml)
    with open(os.path.join(tmp, "trainer_state.json"), "w") as handle:
        json.dump({**trainer_state, "global_step": step, "rng": rng_plain, **extra}, handle)


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
    """Load weights, optimizer/scheduler state and RNG from `path` into live objects; returns trainer_state.

    Raises CheckpointError naming `path` and the problem when a file fails its manifest check, cannot be read,
    or the loaded weights hold NaN/inf (the live objects may then be partly overwritten: load another one)."""
    problem = verify_checkpoint(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    try:
        state = _load_checkpoint_files(path, actor=actor, critic=critic, optimizers=optimizers,
                                       schedulers=schedulers)
    except Exception as exc:  # noqa: BLE001 - a damaged file fails in many ways (safetensors, zip, json, pickle)
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from exc
    bad = first_nonfinite_parameter(actor, critic)
    if bad is not None:
        raise CheckpointError(f"checkpoint {path} holds NaN/inf weights (first: {bad})")
    return state


def _load_checkpoint_files(path: str, *, actor, critic, optimizers: dict, schedulers: dict) -> dict[str, Any]:
    with open(os.path.join(path, "trainer_state.json")) as handle:
        state = json.load(handle)
    if state.get("lora"):
        try:
            load_adapter_state(actor, _load_safetensors_dir(os.path.join(path, "actor_lora")), path)
        except ValueError as err:
            raise CheckpointError(str(err)) from None
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


def resume_latest(run_dir: str, load: Callable[[str], dict], dp=None) -> Optional[tuple[str, dict]]:
    """Load the newest usable checkpoint of `run_dir` with `load(path) -> state`; (path, state), or None if none.

    A checkpoint that `load` rejects with CheckpointError is logged by name and the next older one is tried; once
    one loads, the damaged newer ones are moved aside to `global_step_N.damaged` (kept for inspection, never picked
    again). When every checkpoint is damaged, nothing is moved and CheckpointError lists them. [distributed] Every
    rank loads (and so judges alike); rank 0 alone moves the damaged ones, the others wait for it."""
    damaged: list[tuple[str, str]] = []
    for path in reversed(list_checkpoints(run_dir)):
        try:
            state = load(path)
        except CheckpointError as exc:
            damaged.append((path, str(exc), getattr(exc, "aside_suffix", "damaged")))
            log.warning("%s; trying the previous checkpoint", exc)
            continue
        if dp is None or dp.is_main:
            for bad_path, _, suffix in damaged:
                shutil.rmtree(f"{bad_path}.{suffix}", ignore_errors=True)
                os.replace(bad_path, f"{bad_path}.{suffix}")
                log.warning("moved the %s %s aside to %s.%s", suffix, bad_path, bad_path, suffix)
        if dp is not None:
            dp.barrier()
        return path, state
    if damaged:
        raise CheckpointError(
            f"no usable checkpoint in {checkpoint_root(run_dir)}: " + "; ".join(msg for _, msg, _ in damaged) +
            ". Start over with trainer.resume_mode=disable trainer.overwrite_run_dir=true, or use another "
            "trainer.default_local_dir")
    return None


def retire_later_checkpoints(run_dir: str, step: int) -> list[str]:
    """After resuming at `step`, checkpoints of later steps belong to another timeline (a diverged run resumed from
    an earlier checkpoint, another run's): move them aside to `global_step_N.stale` so an auto-resume never picks
    one; point the latest marker at `step`. Returns the moved paths."""
    moved = []
    for path in list_checkpoints(run_dir):
        if int(path.rsplit("_", 1)[-1]) > step:
            shutil.rmtree(f"{path}.stale", ignore_errors=True)
            os.replace(path, f"{path}.stale")
            moved.append(path)
            log.warning("%s is later than the resumed step %d: moved aside to %s.stale", path, step, path)
    if moved:
        _atomic_write_text(os.path.join(checkpoint_root(run_dir), LATEST_FILE), str(step))
    return moved


def export_final_model(run_dir: str, step: int, model_to_export: Callable[[], Any], tokenizer, dp) -> str:
    """RUN_DIR/final_model/: the trained actor in HF format at the end of a run (model + tokenizer, no optimizer),
    written atomically by rank 0. When a checkpoint was written at `step`, its actor/ files are linked in (hard
    links: no second copy on disk, and they outlive the checkpoint's deletion); else `model_to_export()` (with LoRA:
    the merged model) is written."""
    final = os.path.join(run_dir, "final_model")
    latest = find_latest_checkpoint(run_dir)
    saved = os.path.join(latest, "actor") if latest and os.path.basename(latest) == f"global_step_{step}" else None
    model = None if saved else model_to_export()
    if dp.is_main:  # [distributed] replicas are identical: rank 0 writes, the others wait for it
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if saved:
            shutil.copytree(saved, tmp, copy_function=_link_or_copy)
        else:
            with as_users_load_it(model):
                model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)  # a run killed mid-write leaves final_model.tmp, never a half-written final_model
        _fsync_dir(run_dir)
        log.info("final model saved: %s", final)
    dp.barrier()
    return final


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or one without hard links
        shutil.copy2(source, target)
