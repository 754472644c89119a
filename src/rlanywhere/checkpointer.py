"""One checkpointer for every run: a replicated and a sharded backend behind one interface.

    Checkpointer(run_dir, dp, keep, config_yaml)
        .save(step, models...)   -> path     every rank calls it
        .load(path, models...)   -> state    any layout, on any world size
        .resume(models...)       -> (path, state) or None: the newest usable checkpoint
        .retire_later(step)                  checkpoints of later steps moved aside (another timeline)

The two backends differ only in how model and optimizer files are written: the replicated one (checkpoint.py) has
rank 0 write full weights, the sharded one (dist_checkpoint.py) has every rank write its shards with DCP and rank 0
the rest. Everything else is here, once, for both:

- one verification: before a save, the weights of the actor AND the critic are checked for NaN/inf on every rank
  (each its own shards) and the answer is agreed; after a load the same check runs on what was loaded, and every
  file is checked against the manifest (a checkpoint without one cannot be verified: it is treated as damaged);
- one manifest, written by rank 0 after checking that it sees the files every rank wrote (a checkpoint directory
  that is not on one filesystem shared by the ranks is refused with the fix, instead of an incomplete manifest);
- one error type (`CheckpointError`; `CheckpointWriteError` when writing failed): a failed write on any rank
  removes the `.tmp` directory and every rank raises the same error, naming what failed and the intact previous
  checkpoint;
- one publish / retire path: renames in the checkpoint directory (publish, moving damaged or later checkpoints
  aside) are done by rank 0 alone, and the other ranks wait for it at a barrier.
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable, Optional

import torch

from . import checkpoint as replicated
from .checkpoint import (CheckpointError, CheckpointWriteError, checkpoint_root, is_disk_full, list_checkpoints,
                         publish_checkpoint)

log = logging.getLogger(__name__)

RANKS_DIR = ".ranks"  # each rank's marker in a sharded save's .tmp: rank 0 must see them all (shared filesystem)


def local_nonfinite_parameter(*models) -> Optional[str]:
    """The first parameter of `models` holding NaN/inf in this rank's part of it (a shard, or all of it)."""
    for model in models:
        if model is None:
            continue
        for name, param in model.named_parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            if not bool(torch.isfinite(local).all()):
                return name
    return None


class Checkpointer:
    """Saves, verifies, loads and retires the checkpoints of one run dir, for every rank of the job."""

    def __init__(self, run_dir: str, dp, keep: Optional[int] = None, config_yaml: Optional[str] = None):
        self.run_dir, self.dp, self.keep, self.config_yaml = run_dir, dp, keep, config_yaml

    def path(self, step: int) -> str:
        return os.path.join(checkpoint_root(self.run_dir), f"global_step_{step}")

    # ------------------------------------------------------------------------------------------ checks
    def nonfinite(self, actor, critic) -> Optional[str]:
        """The first NaN/inf parameter of actor or critic on any rank (every rank gets the same answer)."""
        found = self.dp.gather_objects([local_nonfinite_parameter(actor, critic)])
        return next((name for name in found if name), None)

    def _agree_on_error(self, error: Optional[str]) -> Optional[str]:
        """Every rank's error of a step every rank takes (None: none failed); the first, naming its rank."""
        errors = self.dp.gather_objects([error])
        failed = [(rank, text) for rank, text in enumerate(errors) if text]
        if not failed:
            return None
        rank, text = failed[0]
        return f"rank {rank}: {text}" if self.dp.enabled else text

    # ------------------------------------------------------------------------------------------ save
    def save(self, step: int, *, actor, tokenizer, critic, optimizers: dict, schedulers: dict,
             trainer_state: dict, export_actor: Callable[[], Any] = None, earlier_hint: str = "",
             protect: str | None = None) -> str:
        """Write checkpoint `step` (every rank calls it); returns its directory. `export_actor()` gives the merged
        HF model of a LoRA run (replicated layout; the sharded one merges while writing); `protect`: a checkpoint
        the retention (max_actor_ckpt_to_keep) must keep, the run's last healthy one."""
        from .sharding import is_sharded

        earlier = list_checkpoints(self.run_dir)
        previous = earlier[-1] if earlier else "(none)"
        bad = self.nonfinite(actor, critic)
        if bad is not None:
            raise CheckpointError(
                f"not saving global_step_{step}: parameter {bad} holds NaN/inf. " + (earlier_hint or (
                    f"The last checkpoint is {previous}; resume from it with a lower learning rate "
                    "(trainer.resume_mode=resume_path trainer.resume_from_path=<it>)")))
        sharded = is_sharded(actor)
        # [distributed] sharded: a collective every rank joins before anything is written; rank 0 holds the tensors
        actor_full = replicated_full = None
        if sharded:
            from .dist_checkpoint import full_model_state

            actor_full = full_model_state(actor)
        elif self.dp.is_main and export_actor is not None:
            replicated_full = export_actor()
        final, tmp = self.path(step), self.path(step) + ".tmp"
        error: Optional[BaseException] = None
        try:
            if self.dp.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
        except OSError as exc:
            error = exc
        made = self._agree_on_error(_describe(error))
        if made is None:
            try:
                if sharded:
                    from .dist_checkpoint import write_sharded_files

                    write_sharded_files(self.dp, tmp, step, actor=actor, actor_full=actor_full,
                                        tokenizer=tokenizer, critic=critic, optimizers=optimizers,
                                        schedulers=schedulers, trainer_state=trainer_state,
                                        config_yaml=self.config_yaml, marker=os.path.join(tmp, RANKS_DIR))
                elif self.dp.is_main:
                    replicated.write_checkpoint_files(tmp, step, actor=actor, tokenizer=tokenizer, critic=critic,
                                                      optimizers=optimizers, schedulers=schedulers,
                                                      trainer_state=trainer_state, export_actor=replicated_full,
                                                      config_yaml=self.config_yaml)
            except Exception as exc:  # noqa: BLE001 - every failure cleans up; a bug is re-raised below
                error = exc
        failed = made or self._agree_on_error(_describe(error))
        if failed is None and self.dp.is_main:
            try:
                if sharded:
                    self._check_shared_filesystem(tmp)
                replicated.write_manifest(tmp)
            except Exception as exc:  # noqa: BLE001
                error = exc
            failed = _describe(error)
        failed = self._agree_on_error(failed if self.dp.is_main else None)
        if failed is not None:
            self._remove_partial(tmp)
            if error is not None and not isinstance(error, (OSError, CheckpointError)) and not is_disk_full(error):
                raise error  # a bug, not the filesystem: its own traceback (the partial write is gone)
            reason = "no space left on device" if error is not None and is_disk_full(error) else failed
            free = _free_mib(checkpoint_root(self.run_dir))
            raise CheckpointWriteError(
                f"could not write checkpoint {final}: {reason} ({free:.0f} MiB free). The partial write was removed; "
                f"the previous checkpoint {previous} is intact. Free space (or point trainer.default_local_dir "
                "elsewhere) and re-run the same command to resume from it") from error
        if self.dp.is_main:
            publish_checkpoint(self.run_dir, tmp, step, self.keep, protect)
        self.dp.barrier()
        return final

    def _check_shared_filesystem(self, tmp: str) -> None:
        """Rank 0 sees every rank's marker, or the checkpoint directory is not one filesystem for all ranks."""
        markers = os.path.join(tmp, RANKS_DIR)
        seen = set(os.listdir(markers)) if os.path.isdir(markers) else set()
        missing = [rank for rank in range(self.dp.world) if str(rank) not in seen]
        if missing:
            raise CheckpointError(
                f"rank 0 cannot see the files ranks {missing} wrote into {tmp}: the checkpoint directory is not on a "
                "filesystem all ranks share. Point trainer.default_local_dir at a shared filesystem (NFS, Lustre, "
                "...) on every node")
        shutil.rmtree(markers)

    def _remove_partial(self, tmp: str) -> None:
        """Rank 0 removes the partial `.tmp` once every rank has stopped writing into it."""
        self.dp.barrier()
        if self.dp.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        self.dp.barrier()

    # ------------------------------------------------------------------------------------------ load and resume
    def load(self, path: str, *, actor, critic=None, optimizers: dict, schedulers: dict) -> dict[str, Any]:
        """Load `path` (either layout, any world size) into live objects; CheckpointError when it is damaged or
        holds NaN/inf (checked on every rank's part, agreed)."""
        from .dist_checkpoint import load_checkpoint_any

        error, state = None, None
        try:
            state = load_checkpoint_any(replicated.load_checkpoint, path, actor=actor, critic=critic,
                                        optimizers=optimizers, schedulers=schedulers)
        except CheckpointError as exc:
            error = exc
        failed = self._agree_on_error(str(error) if error is not None else None)
        if failed is not None:
            raise CheckpointError(str(error) if error is not None else failed)
        bad = self.nonfinite(actor, critic)
        if bad is not None:
            raise CheckpointError(f"checkpoint {path} holds NaN/inf weights (first: {bad})")
        return state

    def resume(self, check: Optional[Callable[[str, dict], None]] = None, **models) -> Optional[tuple[str, dict]]:
        """The newest usable checkpoint loaded into `models`; damaged newer ones moved aside by rank 0.
        `check(path, state)` may refuse a loaded one with CheckpointError (a run's unhealthy checkpoint)."""
        def load(path: str) -> dict:
            state = self.load(path, **models)
            if check is not None:
                check(path, state)
            return state

        return replicated.resume_latest(self.run_dir, load, dp=self.dp)

    def retire_later(self, step: int) -> None:
        """Checkpoints later than the resumed `step` moved aside (rank 0; the others wait)."""
        if self.dp.is_main:
            replicated.retire_later_checkpoints(self.run_dir, step)
        self.dp.barrier()


def _describe(error: Optional[BaseException]) -> Optional[str]:
    return None if error is None else f"{type(error).__name__}: {error}"


def _free_mib(path: str) -> float:
    try:
        return shutil.disk_usage(path).free / 2**20
    except OSError:
        return float("nan")


def save_checkpoint(run_dir: str, step: int, *, actor, tokenizer, critic=None, optimizers: dict, schedulers: dict,
                    trainer_state: dict, export_actor=None, keep: Optional[int] = None,
                    config_yaml: Optional[str] = None, dp=None) -> str:
    """Write checkpoint `step` in the replicated layout; returns its directory. `export_actor` is a merged plain HF
    model for LoRA runs. The one checkpointer (checkpointer.py) does it: refuses (CheckpointError) weights holding
    NaN/inf; a failed write raises CheckpointWriteError after removing the partial `.tmp` directory."""
    from .distributed import DataParallel

    return Checkpointer(run_dir, dp or DataParallel(), keep, config_yaml).save(
        step, actor=actor, tokenizer=tokenizer, critic=critic, optimizers=optimizers, schedulers=schedulers,
        trainer_state=trainer_state, export_actor=(lambda: export_actor) if export_actor is not None else None)
