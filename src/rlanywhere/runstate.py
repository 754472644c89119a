"""What changes while a run goes, apart from the Plan (what was decided before anything loaded).

The planner's `Plan` is decided once and the trainer never changes it. Everything a run learns on the way lives in
one `RunState`, owned by the trainer and read by the components that need it (OOM recovery, the rollout phase, the
updates, the plan record):

- `sizes`: the batch sizes the phases run at now (a copy of the plan's; OOM recovery halves them);
- `release_kv_between_phases`: whether the rollout frees its KV cache after each rollout (the plan's choice, until
  a phase after the rollout ran out of memory beside the kept cache);
- `engine_name`: the rollout engine actually running (a fast engine may have fallen back to transformers');
- `fallbacks`: each decision the run had to change, with what happened, in a user's words;
- `oom_events`: every out-of-memory recovery of this launch.

A checkpoint keeps `checkpoint_record()`: the sizes an out-of-memory event lowered (and only those) and the freed KV
cache. A resume applies them as ceilings on the new plan's sizes (`restore`): a run resumed on a bigger card, another
world size or another sharding keeps its new plan's sizes unless an out-of-memory event proved a smaller one
necessary, and never raises a size above what the new plan chose.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Optional

from .checkpoint import CheckpointError, checkpoint_root
from .plans import Plan, RuntimeSizes, SizeKind

log = logging.getLogger(__name__)


OOM_SIZES_FILE = "oom_sizes.json"


def oom_sizes_path(run_dir: str) -> str:
    """Where a stopped job leaves the sizes its next launch must not exceed (beside the checkpoints, so
    trainer.overwrite_run_dir=true deletes it with them)."""
    return os.path.join(checkpoint_root(run_dir), OOM_SIZES_FILE)


def remember_sizes(run_dir: str, sizes: dict[str, int], event: dict, rank: int = 0) -> str:
    """Write `sizes` (the ones out-of-memory events lowered, by SizeKind name) and the event that lowered the last
    for the next launch; atomic, any rank (two ranks that run out of memory in the same phase write the same
    sizes). Returns the file's path."""
    path = oom_sizes_path(run_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{rank}"
    with open(tmp, "w") as handle:
        json.dump({"sizes": dict(sizes), "event": {**event, "rank": rank}}, handle, indent=2)
    os.replace(tmp, path)
    return path


def remembered_sizes(run_dir: str) -> Optional[dict]:
    """The record `remember_sizes` left in this run dir, or None; CheckpointError naming the file when it is not
    such a record (edited by hand, another version's)."""
    path = oom_sizes_path(run_dir)
    try:
        with open(path) as handle:
            record = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable ({exc}); delete it to run at the planned sizes") from exc
    sizes = record.get("sizes") if isinstance(record, dict) else None
    known = {kind.value for kind in SizeKind}
    if not isinstance(sizes, dict) or not set(sizes) <= known or not isinstance(record.get("event"), dict):
        raise CheckpointError(f"{path} holds no sizes this version knows ({sorted(known)}); delete it to run at the "
                              "planned sizes")
    return record


class RunState:
    """The run-time side of a run: sizes, KV-cache release, the engine running, fallbacks, OOM events."""

    def __init__(self, sizes: RuntimeSizes, *, release_kv_between_phases: bool = False, engine_name: str = "",
                 device: str = "cpu", run_dir: Optional[str] = None, rank: int = 0):
        self.sizes = sizes
        self.release_kv_between_phases = release_kv_between_phases
        self.engine_name = engine_name
        self.engine = None  # the live rollout engine (its kept KV cache is what `relieve` frees)
        self.engine_busy = False  # a rollout runs in the background on the engine (one_step_off): nothing to free
        self.device, self.run_dir, self.rank = str(device), run_dir, rank
        self.fallbacks: dict[str, str] = {}
        self.oom_events: list[dict] = []
        self.inherited_ceilings: dict[str, int] = {}  # lowered by OOM events of earlier launches (a checkpoint's)
        self.changes = 0  # bumped on every change: the plan record is rewritten when it moved

    @classmethod
    def from_plan(cls, plan: Plan, run_dir: Optional[str] = None, rank: int = 0) -> "RunState":
        """The run state a run starts with: the plan's sizes (a copy: the plan is never changed) and choices."""
        return cls(copy.deepcopy(plan.sizes), release_kv_between_phases=plan.rollout.release_kv_between_phases,
                   engine_name=plan.rollout.engine, device=plan.device, run_dir=run_dir, rank=rank)

    # ------------------------------------------------------------------------------------------ changes
    def record_oom(self, kind: SizeKind, new_size: int, event: dict) -> None:
        """An out-of-memory event: `kind` runs at `new_size` from now on (a relieved event keeps the size)."""
        self.sizes.set(kind, new_size)
        self.oom_events.append(event)
        self.changes += 1

    def relieve(self, phase: str) -> Optional[str]:
        """OOM relief for the phases after the rollout: a KV cache kept between phases is freed now and after every
        rollout from here on; says what it freed. None when there is none to free, in the rollout (which is using
        it), and off CUDA (the cache is kept there: memory is not the limit)."""
        if self.release_kv_between_phases or phase == "rollout" or not self.device.startswith("cuda") or \
                self.engine is None or self.engine_busy:
            return None
        self.engine.release_memory()
        self.release_kv_between_phases = True
        self.fallbacks["release_kv_between_phases"] = (f"freed after every rollout: {phase} ran out of memory "
                                                       "beside the kept cache")
        self.changes += 1
        return "freed the rollout's KV cache (kept between phases until now; freed after every rollout from now on)"

    def remember_for_next_launch(self, event: dict) -> Optional[str]:
        """Save the sizes for the next launch (an OOM a sharded rank cannot redo alone); where, or None."""
        if self.run_dir is None:
            return None
        return remember_sizes(self.run_dir, self.ceilings(), event, self.rank)  # the lowered sizes only

    def engine_running(self, engine, planned: str) -> None:
        """The engine that runs; a fast engine that fell back to transformers' is a fallback with its reason."""
        self.engine = engine
        fallback = getattr(engine, "fallback_reason", None)
        if fallback and planned != "hf":
            self.engine_name = "hf"
            self.fallbacks["rollout_engine"] = f"fell back to hf: {fallback}"
            self.changes += 1

    def lower_to(self, ceilings: dict[str, int]) -> list[tuple[str, int, int]]:
        """Each size above its ceiling lowered to it (an unset size, the whole batch, too); (name, old, new)."""
        changes = []
        for name, ceiling in ceilings.items():
            kind = SizeKind(name)
            current = self.sizes.get(kind)
            if isinstance(ceiling, int) and (current is None or ceiling < current):
                self.sizes.set(kind, ceiling)
                changes.append((name, current, ceiling))
        if changes:
            self.changes += 1
        return changes

    # ------------------------------------------------------------------------------------------ records
    def ceilings(self) -> dict[str, int]:
        """The sizes out-of-memory events lowered (this launch's and earlier ones'), each at its lowest."""
        lowered = dict(self.inherited_ceilings)
        for event in self.oom_events:
            if event.get("relieved") or not isinstance(event.get("new_size"), int):
                continue
            name = event["attribute"]
            lowered[name] = min(event["new_size"], lowered.get(name, event["new_size"]))
        return lowered

    def checkpoint_record(self) -> dict:
        """What a checkpoint keeps: the sizes OOM events lowered and whether the KV cache was freed."""
        return {"oom_ceilings": self.ceilings(), "release_kv_between_phases": self.release_kv_between_phases,
                "fallbacks": dict(self.fallbacks)}

    @staticmethod
    def merged_records(records: list[dict]) -> dict:
        """Every rank's checkpoint_record as one (rank order): each OOM-lowered size at its lowest over the ranks (a
        replicated update lowers each rank's own), the KV cache freed where any rank freed it, the first rank's
        reason for each fallback. A resumed run starts every rank at sizes none of them ran out of memory at."""
        ceilings: dict[str, int] = {}
        fallbacks: dict[str, str] = {}
        for record in records:
            for name, size in record["oom_ceilings"].items():
                ceilings[name] = min(size, ceilings.get(name, size))
            fallbacks = {**record["fallbacks"], **fallbacks}
        return {"oom_ceilings": ceilings, "fallbacks": fallbacks,
                "release_kv_between_phases": any(record["release_kv_between_phases"] for record in records)}

    def restore(self, record: Optional[dict]) -> list[tuple[str, int, int]]:
        """Apply a checkpoint's record: its OOM-lowered sizes as ceilings on this run's; a KV cache freed for memory
        stays freed. A record of an older version (whole sizes, not knowing which were lowered) is not applied."""
        if not record:
            return []
        ceilings = {name: size for name, size in (record.get("oom_ceilings") or {}).items()
                    if name in {kind.value for kind in SizeKind}}
        self.inherited_ceilings = dict(ceilings)
        if record.get("release_kv_between_phases") and not self.release_kv_between_phases and \
                "release_kv_between_phases" in (record.get("fallbacks") or {}):
            self.release_kv_between_phases = True
            self.fallbacks["release_kv_between_phases"] = record["fallbacks"]["release_kv_between_phases"]
        return self.lower_to(ceilings)

    def to_dict(self) -> dict:
        return {"sizes": self.sizes.to_dict(), "release_kv_between_phases": self.release_kv_between_phases,
                "engine": self.engine_name, "fallbacks": dict(self.fallbacks), "oom_ceilings": self.ceilings(),
                "oom_events": list(self.oom_events)}
