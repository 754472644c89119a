"""Guards around a run: one process per run directory, checks before anything loads, resume-config diffs, and
SIGTERM / Ctrl-C turned into "save a checkpoint and stop".

* :func:`prepare_run_dir` (called first by the trainer): takes the run directory's lock (a second run in the same
  directory refuses with the first one's pid), checks that checkpoints can be written there, refuses
  ``trainer.resume_mode=disable`` over an earlier run's checkpoints unless ``trainer.overwrite_run_dir=true``, and
  compares the config with the one stored in the checkpoint that will be resumed: keys that decide what the run
  *is* (model, data, algorithm, seed, batch) refuse to change, every other change is printed and takes effect.
* :class:`StopSignals`: while a training step can still be dropped (before its first optimizer update) a signal
  drops it; otherwise the step finishes. Either way the trainer then saves a checkpoint and raises
  :class:`RunInterrupted`, which the CLI turns into one line and exit code 128 + signal (130 Ctrl-C, 143 SIGTERM).
  A second signal stops at once, without saving.
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import math
import os
import shutil
import signal
import socket
import sys
import threading
import weakref
from typing import Any, Optional

from omegaconf import OmegaConf

from .checkpoint_dirs import checkpoint_root, list_checkpoints
from .errors import UserError
from .rank_layout import a_peer_died
from .runfaults import check_run_names
from .vocabulary import drops_overlong_prompts


log = logging.getLogger(__name__)

LOCK_FILE = ".rlanywhere.lock"

# What a run *is*: changing one of these on resume would mix two different runs in one directory.
FIXED_ON_RESUME = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.lora_rank",
    "actor_rollout_ref.model.lora_alpha",  # the adapters' scale: the same weights would be another policy
    "actor_rollout_ref.model.target_modules",  # which modules hold the trained adapters
    "critic.model.path",
    "critic.model.lora_rank",
    "critic.model.lora_alpha",
    "critic.model.target_modules",
    "algorithm.adv_estimator",
    "actor_rollout_ref.rollout.n",
    "data.train_files",
    "data.train_max_samples",
    "data.train_batch_size",
    "data.prompt_key",
    "data.max_prompt_length",
    "data.filter_overlong_prompts",
    "data.truncation",
    "data.shuffle",
    "data.seed",
    "trainer.seed",
)


class RunDirError(UserError):
    """The run directory cannot be used as asked (in use, unwritable, holding another run)."""


class RunLock:
    """An exclusive `flock` on RUN_DIR/.rlanywhere.lock, released by `release()`, when the object is collected, or
    when the process dies (kill -9 included: the kernel drops it, so there is never a stale lock to delete by hand).

    The lock is per process: trainers built one after another in the same process (a notebook, a test that saves
    with one trainer and resumes with another) share it; another process is refused with the holder's pid."""

    _held: dict[str, list] = {}  # lock path -> [open file, number of RunLock objects sharing it]

    def __init__(self, run_dir: str):
        self.path = os.path.realpath(os.path.join(run_dir, LOCK_FILE))
        if self.path not in RunLock._held:
            RunLock._held[self.path] = [self._acquire(run_dir), 0]
        RunLock._held[self.path][1] += 1
        self._finalizer = weakref.finalize(self, RunLock._drop, self.path)

    def _acquire(self, run_dir: str):
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RunDirError(
                f"run directory {run_dir} is in use by {holder}. Wait for that run to finish (or stop it), or give "
                "this run its own directory: trainer.experiment_name=<name> or trainer.default_local_dir=<dir>"
            ) from None
        handle.seek(0)
        handle.truncate()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}: {' '.join(sys.argv)[:300]}\n")
        handle.flush()
        return handle

    @staticmethod
    def _drop(path: str) -> None:
        entry = RunLock._held[path]
        entry[1] -= 1
        if entry[1] == 0:
            entry[0].close()  # closing the file releases the flock
            del RunLock._held[path]

    def release(self) -> None:
        self._finalizer()  # runs _drop once; later calls do nothing


def _existing_checkpoints(run_dir: str) -> list[str]:
    root = checkpoint_root(run_dir)
    return sorted(name for name in os.listdir(root) if name.startswith("global_step_")) if os.path.isdir(root) else []


def _check_checkpoints_writable(run_dir: str) -> None:
    root = checkpoint_root(run_dir)
    if os.path.exists(root) and not os.path.isdir(root):
        raise RunDirError(f"{root} is a file, not a directory: checkpoints go there. Move the file away or set "
                          "trainer.default_local_dir to another directory")
    probe = os.path.join(root, f".write_test_{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        with open(probe, "w") as handle:
            handle.write("ok")
        os.remove(probe)
    except OSError as exc:
        raise RunDirError(f"cannot write checkpoints to {root}: {exc.strerror or exc}. Fix the permissions or set "
                          "trainer.default_local_dir to a writable directory") from None


def _saved_config(path: str) -> Optional[dict]:
    """The resolved config stored in checkpoint `path`, or None (older checkpoint, unreadable file)."""
    file = os.path.join(path, "config.yaml")
    try:
        return OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except Exception:  # noqa: BLE001 - a damaged config is reported when the checkpoint itself is verified
        return None


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def config_changes(saved: dict, current: dict) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (saved value, current value)} for every leaf that differs (keys on one side only included)."""
    old, new = _leaves(saved), _leaves(current)
    return {key: (old.get(key), new.get(key)) for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)}


def _with_effective_filter(config: dict) -> dict:
    """The data keys as they act, so that a run saved before a key existed (or could be unset) compares equal when
    it reads the same prompts: data.filter_overlong_prompts unset is true exactly when data.truncation is error;
    data.train_max_samples absent or <= 0 is every prompt (-1)."""
    data = config.get("data") if isinstance(config.get("data"), dict) else None
    if data is None:
        return config
    data = dict(data)
    data["filter_overlong_prompts"] = drops_overlong_prompts(data.get("filter_overlong_prompts"),
                                                             data.get("truncation", "error"))
    cap = data.get("train_max_samples")
    data["train_max_samples"] = cap if isinstance(cap, int) and cap > 0 else -1
    return {**config, "data": data}


def _acts(key: str, config: dict) -> bool:
    """Whether `key` shapes the run: a LoRA setting only where that model has LoRA adapters."""
    if key.rsplit(".", 1)[-1] not in ("lora_alpha", "target_modules"):
        return True
    rank = _leaves(config).get(key.rsplit(".", 1)[0] + ".lora_rank")
    return isinstance(rank, int) and rank > 0


def check_resume_config(saved: dict, current: dict, checkpoint: str) -> dict[str, tuple[Any, Any]]:
    """Refuse changes to FIXED_ON_RESUME keys (RunDirError naming them); return the other changes."""
    changes = config_changes(_with_effective_filter(saved), _with_effective_filter(current))
    fixed = {key: change for key, change in changes.items() if key in FIXED_ON_RESUME and _acts(key, current)}
    if fixed:
        listed = "; ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in fixed.items())
        raise RunDirError(
            f"{checkpoint} belongs to a different run ({listed}); these cannot change on resume. Give the new run "
            "its own directory (trainer.experiment_name=<name> or trainer.default_local_dir=<dir>), start it from "
            f"these weights with actor_rollout_ref.model.path={os.path.join(checkpoint, 'actor')}, or replace the "
            "old run with trainer.resume_mode=disable trainer.overwrite_run_dir=true")
    return changes


def prepare_run_dir(run_dir: str, cfg) -> RunLock:
    """Everything checked before a model loads (see the module docstring); returns the held lock."""
    check_run_names(cfg)  # before the folder is made: a name may not climb out of the runs folder
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create the run directory {run_dir}: {exc.strerror or exc}; set "
                          "trainer.default_local_dir to a writable place") from None
    lock = RunLock(run_dir)
    try:
        _check_checkpoints_writable(run_dir)
        tcfg = cfg.trainer
        existing, overwrite = _existing_checkpoints(run_dir), tcfg.overwrite_run_dir
        if tcfg.resume_mode == "disable" and existing:
            if not overwrite:
                raise RunDirError(
                    f"{run_dir} holds checkpoints of an earlier run ({', '.join(existing[-3:])}); "
                    "trainer.resume_mode=disable would mix them with this run's. Set trainer.overwrite_run_dir=true "
                    "to delete them and start over, trainer.resume_mode=auto to continue that run, or use another "
                    "trainer.default_local_dir")
            shutil.rmtree(checkpoint_root(run_dir))
            os.makedirs(checkpoint_root(run_dir))
            log.warning("trainer.overwrite_run_dir=true: deleted the earlier run's checkpoints in %s", run_dir)
        resume_from = None
        if tcfg.resume_mode == "resume_path":
            resume_from = tcfg.resume_from_path
        elif tcfg.resume_mode == "auto":
            resume_from = next((p for p in reversed(list_checkpoints(run_dir)) if _saved_config(p) is not None), None)
        saved = _saved_config(resume_from) if resume_from else None
        if saved is not None:
            current = OmegaConf.to_container(cfg, resolve=True)
            changes = check_resume_config(saved, current, resume_from)
            for key, (old, new) in changes.items():
                adapted = key == "algorithm.kl_ctrl.kl_coef" and cfg.algorithm.kl_ctrl.type == "adaptive"
                log.warning("resume: %s changed %r -> %r (%s)", key, old, new,
                            "the adaptive controller goes on from its adapted coefficient" if adapted
                            else "the new value is used")
    except BaseException:
        lock.release()
        raise
    return lock


class RunInterrupted(BaseException):
    """The run stopped on a signal; `checkpoint` is what was saved (None: nothing). A BaseException, like
    KeyboardInterrupt, so that no `except Exception` in user or library code swallows it."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if checkpoint:
            text = f"stopped by {name} at step {step}: saved {checkpoint}; run the same command to resume"
        else:
            text = f"stopped by {name} at step {step} without saving; run the same command to resume from the last " \
                   "checkpoint"
        super().__init__(text)


class StepDropped(BaseException):
    """Raised by the signal handler while the current step can be dropped (nothing has been updated yet)."""


class StopSignals:
    """Context manager: SIGINT/SIGTERM set `received`; while `droppable` is true the handler raises StepDropped.

    A second signal raises RunInterrupted at once (no save). Outside the main thread it does nothing."""

    # SIGHUP: the terminal closed (an ssh session dropped) — saved like a Ctrl-C
    SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self):
        self.received: Optional[int] = None
        self.droppable = False
        self.step = 0
        self._previous: dict = {}

    def _handle(self, signum, frame):
        if self.received is not None:
            raise RunInterrupted(signum, self.step, None)
        self.received = signum
        what = "dropping the current step" if self.droppable else "finishing the current step"
        # stderr directly: one line the user sees even with the progress bar, whatever the logging level; a
        # console already gone (Ctrl-C also ended `| tee`, the terminal closed) must not stop the save
        try:
            # one voice: rank 0's (every rank gets the signal); none when torchrun is ending the job for a rank
            # that died (nothing will be saved; that rank is named once, elsewhere)
            if os.environ.get("RANK", "0") in ("", "0") and not a_peer_died():
                print(f"\n{signal.Signals(signum).name} received: {what}, then saving a checkpoint "
                      "(send it again to stop at once, without saving)", file=sys.stderr, flush=True)
        except (BrokenPipeError, OSError, ValueError):
            pass
        if self.droppable:
            self.droppable = False
            raise StepDropped()

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class TrainingStopped(UserError):
    """The run stopped itself rather than train on garbage: diverged updates, or every reward call failing."""


class RunStops:
    """When a run stops itself or is stopped: updates diverging, rewards failing, a signal (with `signals`, the
    StopSignals of the running `fit`, set while it runs). Tracks the last checkpoint saved while the run was
    healthy (finite losses, no update skipped for a NaN/inf gradient so far), and names that one
    in the advice: a checkpoint saved after the updates went bad is marked so in it and never called good."""

    # losses only: a gradient norm is inf on an fp16 loss scaler's planned skips; a real non-finite update is
    # seen in record_update (StepOutcome.nonfinite_failure)
    WATCHED = ("actor/pg_loss", "critic/vf_loss")

    def __init__(self, trainer_cfg, actor_lr: float, dp):
        self.limits = {  # read up front: the run stops itself after this many bad updates / reward steps
            "trainer.max_consecutive_nonfinite_updates": trainer_cfg.max_consecutive_nonfinite_updates,
            "trainer.max_consecutive_failed_reward_steps": trainer_cfg.max_consecutive_failed_reward_steps}
        self.actor_lr, self.dp = actor_lr, dp
        self.nonfinite_streaks: dict[str, int] = {}  # per model: optimizer updates skipped in a row (NaN/inf norm)
        self.failed_reward_streak = 0
        self.last_good_checkpoint: Optional[str] = None  # the newest one saved (or resumed) while healthy
        self.unhealthy: Optional[str] = None  # what went bad since the last healthy checkpoint (None: nothing)
        self.signals: Optional[StopSignals] = None

    @property
    def nonfinite_streak(self) -> int:
        return max(self.nonfinite_streaks.values(), default=0)

    def _stop_after(self, streak: int, limit_key: str, what: str, advice: str) -> None:
        """Raise TrainingStopped once `streak` reaches the config's `limit_key` (0: never)."""
        limit = self.limits[limit_key]
        if limit > 0 and streak >= limit:
            raise TrainingStopped(f"{what} ({limit_key}={limit}): {advice}")

    def last_good_hint(self) -> str:
        if self.last_good_checkpoint:
            return (f"The last good checkpoint is {self.last_good_checkpoint}: resume from it with a lower learning "
                    f"rate (trainer.resume_mode=resume_path trainer.resume_from_path={self.last_good_checkpoint})")
        return "No checkpoint was saved while the run was healthy; lower the learning rate and start again"

    def health_record(self) -> dict:
        """What a checkpoint keeps about the run's health when it is saved."""
        return {"healthy": self.unhealthy is None, "unhealthy_reason": self.unhealthy,
                "last_healthy_checkpoint": self.last_good_checkpoint,
                "failed_reward_streak": self.failed_reward_streak}  # a resume continues the count

    def checkpoint_saved(self, path: str) -> None:
        if self.unhealthy is None:
            self.last_good_checkpoint = path

    def resumed(self, path: str, state: dict) -> None:
        """A resume from `path`: good when it was saved healthy, else its own last healthy checkpoint is."""
        healthy = state.get("healthy", True)
        self.last_good_checkpoint = path if healthy else state.get("last_healthy_checkpoint")
        self.unhealthy = None if healthy else state.get("unhealthy_reason")
        self.failed_reward_streak = int(state.get("failed_reward_streak", 0))

    @staticmethod
    def refuse_unhealthy(path: str, state: dict) -> None:
        """Auto-resume never continues a run from weights saved after its updates went bad."""
        if state.get("healthy", True) is False:
            from .checkpoint import CheckpointError

            error = CheckpointError(f"checkpoint {path} was saved after the updates went bad "
                                    f"({state.get('unhealthy_reason')}): not resumed")
            error.aside_suffix = "diverged"
            raise error

    def check_step(self, metrics: dict) -> None:
        """After each step: a non-finite loss marks the run unhealthy for the rest of this launch (training on from
        bad weights stays bad), so no later checkpoint of it is called good."""
        bad = [key for key in self.WATCHED if key in metrics and not math.isfinite(metrics[key])]
        if bad and self.unhealthy is None:
            self.unhealthy = f"{bad[0]} was {metrics[bad[0]]}"

    def weights_changing(self) -> None:
        """From here the step changes weights: a signal now finishes the step instead of dropping it."""
        if self.signals is not None:
            self.signals.droppable = False

    def record_update(self, outcome, name: str = "actor") -> None:
        """After each optimizer step of `name` (a precision_guard.StepOutcome): stop once too many in a row of the
        same model were non-finite. fp16 scaler skips are not failures (precision_guard counts those)."""
        if outcome.nonfinite_failure:
            streak = self.nonfinite_streaks[name] = self.nonfinite_streaks.get(name, 0) + 1
            if self.unhealthy is None:
                self.unhealthy = f"{name} update skipped for a NaN/inf gradient norm"
            self._stop_after(streak, "trainer.max_consecutive_nonfinite_updates",
                             f"{streak} {name} optimizer updates in a row had a NaN/inf gradient norm and were "
                             "skipped",
                             f"the run has diverged, training on would change nothing. {self.last_good_hint()}, "
                             + (f"e.g. actor_rollout_ref.actor.optim.lr={self.actor_lr / 10:g}" if name == "actor"
                                else "e.g. a lower critic.optim.lr, or rewards on a smaller scale"))
        elif outcome.applied:
            self.nonfinite_streaks[name] = 0

    def record_rewards(self, errors: float, rows: int, last_error) -> None:
        """After each step: stop once every reward call failed for too many steps in a row."""
        self.failed_reward_streak = self.failed_reward_streak + 1 if errors >= rows else 0
        self._stop_after(self.failed_reward_streak, "trainer.max_consecutive_failed_reward_steps",
                         f"every reward call failed for {self.failed_reward_streak} steps in a row",
                         f"nothing can be learned. Last error: {last_error}. Fix the reward "
                         "function (custom_reward_function.path) or the data's data_source / ground_truth")

    def droppable(self, fn):
        """fn() while a stop signal may drop it (it must change no training state): None when dropped."""
        # [distributed] never with several ranks: a rank dropped mid-step would leave the others in a collective;
        # the step finishes and the ranks stop together at the next step boundary (signal_received)
        self.signals.droppable = self.signals.received is None and not self.dp.enabled
        try:
            return fn()
        except StepDropped:
            return None
        finally:
            self.signals.droppable = False

    def signal_received(self) -> Optional[int]:
        """The stop signal received, if any; [distributed] by any rank, so that every rank stops at the same step.

        With several ranks the answer is the collective's, never this rank's own flag: a signal whose handler runs
        while the collective is in flight (after this rank sent 0) would otherwise stop this rank here and let the
        others train on into the next step's collectives (a hang). Such a signal counts at the next boundary."""
        if not self.dp.enabled:
            return self.signals.received
        agreed = int(self.dp.max_value(float(self.signals.received or 0)))
        if agreed and self.signals.received is None:
            self.signals.received = agreed
        return agreed or None
