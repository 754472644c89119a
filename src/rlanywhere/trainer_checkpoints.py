"""The trainer's checkpoints: what a checkpoint keeps of the run (`trainer_state`), saving it through the one
checkpointer (checkpointer.py), the final HF export, and resuming: the newest usable checkpoint (a damaged or
unhealthy one named and moved aside), the sizes an out-of-memory event lowered applied as ceilings on this
run's (runstate.py), and the sizes an out-of-memory stop of this job saved for its next launch.

`TrainerCheckpoints` is a part of `RLTrainer` (trainer.py): it reads the trainer's models, loader, run state and
stops, and is not used on its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os

from omegaconf import OmegaConf

from . import builders
from .checkpoint import export_final_model
from .dist_checkpoint import save_full_model
from .lora import merged_state_for_export
from .oom import oom_sizes_path, remembered_sizes
from .sharding import is_sharded, sync_engine

log = logging.getLogger("rlanywhere.trainer")


def batch_settings(cfg) -> str:
    """A fingerprint of what makes and scores a batch (the rollout's sampling and turns, the reward function or
    model): a resumed one_step_off run trains the saved batches only where it is unchanged."""
    rollout = OmegaConf.to_container(cfg.actor_rollout_ref.rollout, resolve=True)
    rollout.pop("val_kwargs", None)
    made = {"rollout": rollout, "reward_model": OmegaConf.to_container(cfg.reward_model, resolve=True),
            "custom_reward_function": OmegaConf.to_container(cfg.custom_reward_function, resolve=True),
            "max_response_length": cfg.data.max_response_length}
    return hashlib.sha256(json.dumps(made, sort_keys=True, default=str).encode()).hexdigest()[:16]


class TrainerCheckpoints:
    """Checkpoint, export and resume for RLTrainer."""

    def trainer_state(self) -> dict:
        return {"loader": self.loader.state_dict(), "kl_ctrl": self.kl_ctrl.state_dict(),
                "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler else None,  # fp16 loss scale
                "precision_guard": self.precision_guard.state_dict(),
                "pending_validation": self.pending_validation,  # a row whose validation a stop signal kept back
                "run_state": self.run_record(), **self.stops.health_record(),
                **({"async_rollouts": self.pipeline_state(), "async_batch_settings": batch_settings(self.cfg)}
                   if self.pipeline else {})}  # finished, in flight; and what made them

    def run_record(self) -> dict:
        """The run state a checkpoint keeps; [distributed] every rank's, merged (RunState.merged_records)."""
        record = self.run.checkpoint_record()
        return self.run.merged_records(self.dp.gather_objects([record])) if self.dp.enabled else record

    def pipeline_state(self) -> dict:
        """[async] The finished rollouts of the steps to come; [distributed] every rank's share of them (its
        pipeline generates its own share), gathered in rank order."""
        state = self.pipeline.state_dict()
        return {"ranks": self.dp.gather_objects([state])} if self.dp.enabled else state

    def save(self) -> str:
        sharded = is_sharded(self.actor)
        path = self.checkpointer.save(
            self.global_step, actor=self.actor, tokenizer=self.tokenizer, critic=self.critic,
            optimizers=self.optimizers, schedulers=self.schedulers, trainer_state=self.trainer_state(),
            export_actor=(lambda: merged_state_for_export(self.actor)) if self.plan.use_lora and not sharded else None,
            earlier_hint=self.stops.last_good_hint(),
            # after updates went bad the retention keeps the last healthy checkpoint (the one to resume from)
            protect=self.stops.last_good_checkpoint if self.stops.unhealthy is not None else None)
        log.info("checkpoint saved: %s", path)
        self.stops.checkpoint_saved(path)
        if getattr(self, "oom_sizes_applied", False) and self.dp.is_main:  # its sizes now live in the checkpoint
            self.oom_sizes_applied = False
            with contextlib.suppress(FileNotFoundError):
                os.remove(oom_sizes_path(self.run_dir))
        return path

    def save_final_model(self) -> str:
        """RUN_DIR/final_model/: the trained actor in HF format at the end of a run (model + tokenizer, LoRA merged,
        no optimizer; the files of a checkpoint written at this step, linked)."""
        if is_sharded(self.actor):  # [distributed] gathered full weights, written by rank 0
            final = os.path.join(self.run_dir, "final_model")
            save_full_model(self.dp, final, self.actor, self.tokenizer)
            return final
        return export_final_model(self.run_dir, self.global_step, lambda: merged_state_for_export(self.actor)
                                  if self.plan.use_lora else self.actor, self.tokenizer, self.dp)

    def maybe_resume(self) -> None:
        """Continue from the newest usable checkpoint (a damaged one is named and skipped), or the given path."""
        trainer_cfg = self.cfg.trainer
        if trainer_cfg.resume_mode == "disable":
            return
        models = dict(actor=self.actor, critic=self.critic, optimizers=self.optimizers, schedulers=self.schedulers)
        if trainer_cfg.resume_mode == "resume_path":  # asked for by name: no fallback
            path = trainer_cfg.resume_from_path
            state = self.checkpointer.load(path, **models)
        else:
            found = self.checkpointer.resume(check=self.stops.refuse_unhealthy, **models)
            if found is None:
                return
            path, state = found
        self.global_step = state["global_step"]
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.grad_scaler is not None and state.get("grad_scaler"):
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        self.precision_guard.load_state_dict(state.get("precision_guard"))
        self.pending_validation = state.get("pending_validation")
        if self.pipeline is not None:  # [async] the next steps' rollouts, made with weights no checkpoint holds
            saved = state.get("async_rollouts") or {}
            made_by = state.get("async_batch_settings")
            if saved and made_by is not None and made_by != batch_settings(self.cfg):
                log.warning("the checkpoint's rollouts for the next steps were generated or scored with other "
                            "rollout or reward settings than this run's: generated again")
                saved = {"ranks": [{} for _ in saved["ranks"]]} if "ranks" in saved else {}
            self.pipeline.load_rank_states(saved["ranks"] if "ranks" in saved else [saved], self.dp.rank,
                                           self.dp.world, self.tokenizer.pad_token_id)
        for name, old, new in self.run.restore(state.get("run_state")):  # what OOM recovery learned, as ceilings
            log.warning("%s %s -> %s: lowered by an out-of-memory event before this checkpoint", name, old, new)
        self.write_plan_record()
        builders.apply_optim_config(self.cfg, self.optimizers, self.schedulers)
        sync_engine(self.engine, self.actor)  # [distributed]
        if not self.cfg.trainer.val_only:  # validating an earlier checkpoint starts no new timeline
            self.checkpointer.retire_later(self.global_step)  # never a mix of two timelines
        self.stops.resumed(path, state)
        log.info("resumed from %s at step %d", path, self.global_step)

    def apply_remembered_sizes(self) -> None:
        """[distributed] The sizes an out-of-memory stop of this run saved for its next launch (a sharded update
        cannot be redone on one rank: OOMGuard.run_matched), each a ceiling on what the plan or checkpoint says."""
        record = remembered_sizes(self.run_dir)
        sizes = {name: size for name, size in ((record or {}).get("sizes") or {}).items() if isinstance(size, int)}
        for name, size in sizes.items():  # the next checkpoint keeps them as ceilings: the file is then retired
            self.run.inherited_ceilings[name] = min(size, self.run.inherited_ceilings.get(name, size))
        self.oom_sizes_applied = record is not None
        changes = self.run.lower_to(sizes)
        if not changes:
            return
        if self.dp.is_main:  # plan.json keeps the history; counted once in oom/recoveries (a sum over ranks)
            self.run.oom_events.append({**record["event"], "stopped_the_job": True})
        log.warning("sizes lowered by an out-of-memory stop of this run (%s): %s", oom_sizes_path(self.run_dir),
                    ", ".join(f"{name} {old} -> {new}" for name, old, new in changes))
        self.write_plan_record()
