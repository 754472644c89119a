"""Checkpoints of sharded (FSDP2) runs: model and optimizer state with `torch.distributed.checkpoint` (DCP), in the
same atomic, manifest-checked layout as checkpoint.py, plus the HF-format actor written once by rank 0.

    RUN_DIR/checkpoints/global_step_N/
        dcp/                    DCP: actor, critic and their optimizers, each rank's shards + .metadata
        actor/                  HF model (safetensors + config + tokenizer) from the gathered full weights; LoRA merged
        schedulers.pt, rng.pt, trainer_state.json ("sharded": true), config.yaml, manifest.json

Every rank writes its own shards into `global_step_N.tmp/dcp`; rank 0 writes the rest; the one checkpointer
(checkpointer.py) checks the weights before, writes the manifest last and renames the directory into place (a kill before that leaves the previous checkpoint as it was). DCP stores each
tensor with its global shape and FQN, so a checkpoint written by N ranks loads on M ranks, sharded or not
(`load_sharded`: on one process the models are plain modules and DCP reads the shards into full tensors).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
from typing import Any, Optional

import torch
from torch import nn

from .checkpoint import (
    CheckpointError,
    as_users_load_it,
    restore_rng,
    verify_checkpoint,
    write_run_state,
)

log = logging.getLogger(__name__)

DCP_DIR = "dcp"


def is_sharded_checkpoint(path: str) -> bool:
    return os.path.isdir(os.path.join(path, DCP_DIR))


def _state_dicts(models: dict[str, Optional[nn.Module]], optimizers: dict[str, torch.optim.Optimizer]) -> dict:
    """{name: model state, name + "_optim": optimizer state} keyed by parameter names (FQNs), sharded as the live
    objects are (DTensors under FSDP2, plain tensors otherwise)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    state = {}
    for name, model in models.items():
        if model is None:
            continue
        optimizer = optimizers.get(name)
        model_state, optim_state = get_state_dict(model, optimizers=[optimizer] if optimizer is not None else [])
        state[name] = model_state
        if optimizer is not None:
            state[f"{name}_optim"] = optim_state
    return state


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full weights on the CPU of rank 0 (other ranks get {}); collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def merge_lora_state(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """A peft model's full state dict -> the plain model's, each LoRA delta (B @ A x alpha / r) merged into its
    base weight, peft's prefixes stripped; a plain model's is returned as it is."""
    from .lora import is_peft_model

    if not is_peft_model(model):
        return state
    config = model.peft_config[model.active_adapter]
    scale = config.lora_alpha / config.r
    out: dict[str, torch.Tensor] = {}
    prefix = "base_model.model."
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key[len(prefix):] if key.startswith(prefix) else key
        if name.endswith(".base_layer.weight"):
            stem = key[: -len(".base_layer.weight")]
            a, b = state.get(f"{stem}.lora_A.default.weight"), state.get(f"{stem}.lora_B.default.weight")
            if a is not None and b is not None:
                value = (value.float() + scale * (b.float() @ a.float())).to(value.dtype)
            name = name.replace(".base_layer.weight", ".weight")
        elif ".base_layer." in name:
            name = name.replace(".base_layer.", ".")
        out[name] = value
    return out


def write_hf_model(directory: str, model: nn.Module, state: dict[str, torch.Tensor], tokenizer=None) -> None:
    """An HF directory (`AutoModelForCausalLM.from_pretrained` loads it) from a full state dict (rank 0)."""
    from safetensors.torch import save_file

    from .lora import unwrap_peft

    inner = unwrap_peft(model)
    state = merge_lora_state(state, model)
    if getattr(inner.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied: transformers re-ties it from the embeddings
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(directory, "model.safetensors"),
              metadata={"format": "pt"})
    with as_users_load_it(inner):
        inner.config.save_pretrained(directory)
    if getattr(inner, "generation_config", None) is not None:
        inner.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def write_sharded_files(dp, tmp: str, step: int, *, actor, actor_full: dict, tokenizer, critic, optimizers: dict,
                        schedulers: dict, trainer_state: dict, config_yaml: Optional[str], marker: str) -> None:
    """The sharded layout's files in `tmp`: every rank its DCP shards and a marker file named by its rank under
    `marker` (rank 0 checks it sees them all: one shared filesystem); rank 0 the HF actor from `actor_full` (the
    gathered full weights), schedulers, RNG and trainer state. Manifest and publishing: checkpointer.py."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(marker, exist_ok=True)
    with open(os.path.join(marker, str(dp.rank)), "w"):
        pass
    dcp.save(_state_dicts({"actor": actor, "critic": critic}, optimizers),
             checkpoint_id=os.path.join(tmp, DCP_DIR))
    if dp.is_main:
        write_hf_model(os.path.join(tmp, "actor"), actor, actor_full, tokenizer)
        torch.save({k: v.state_dict() for k, v in schedulers.items()}, os.path.join(tmp, "schedulers.pt"))
        write_run_state(tmp, step, trainer_state, config_yaml, sharded=True, world_size=dp.world)


def load_sharded(path: str, *, actor, critic=None, optimizers: dict, schedulers: dict) -> dict[str, Any]:
    """Load a DCP checkpoint into live objects (sharded over any number of ranks, or plain); returns trainer_state.
    Every rank calls it (collective when a process group exists)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    with _reading_checkpoint(path) as state:
        models = {"actor": actor, "critic": critic}
        target = _state_dicts(models, optimizers)
        directory = os.path.join(path, DCP_DIR)
        dcp.load(target, storage_reader=_metadata_checked_reader(directory), planner=_weights_only_planner())
        for name, model in models.items():
            if model is None:
                continue
            optimizer = optimizers.get(name)
            set_state_dict(model, optimizers=[optimizer] if optimizer is not None else [],
                           model_state_dict=target[name], optim_state_dict=target.get(f"{name}_optim", {}))
        saved = torch.load(os.path.join(path, "schedulers.pt"), map_location="cpu", weights_only=True)
        for name, scheduler in schedulers.items():
            scheduler.load_state_dict(saved[name])
        restore_rng(torch.load(os.path.join(path, "rng.pt"), weights_only=True), state["rng"])
    return state


# What DCP writes into a checkpoint's .metadata pickle: its own metadata classes, torch sizes and dtypes, paths.
DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch.serialization", "_get_layout"),
    ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict")})


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a plain pickle, which torch reads with pickle.load: a checkpoint folder from anywhere (a
    shared run dir, a download) could run code when a run resumes from it. Read here with only the classes DCP
    writes (the approach of Python's pickle docs, "Restricting Globals"); anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not something DCP writes into a checkpoint's .metadata; "
                                     "refusing to load it (the checkpoint may have been tampered with)")


def _metadata_checked_reader(directory: str):
    """torch's FileSystemReader reading .metadata with _MetadataUnpickler instead of pickle.load."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataCheckedReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            locate = getattr(self, "_get_metadata_path", None)  # torch's own name for it, where it has one
            path = locate(kwargs.get("rank")) if locate else os.path.join(str(self.path), ".metadata")
            with self.fs.create_stream(path, "rb") as stream:
                metadata = _MetadataUnpickler(stream).load()
            if getattr(metadata, "storage_meta", None) is None:  # as torch's read_metadata
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return MetadataCheckedReader(directory)


def _weights_only_planner():
    """torch's DefaultLoadPlanner, whose non-tensor entries (the optimizers' param_groups) torch.load with
    weights_only=False: each entry is first loaded with weights_only=True, which refuses anything but tensors and
    plain values, and only then handed on."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            torch.load(value, weights_only=True)  # raises on a pickle that would run code
            value.seek(0)
            super().load_bytes(read_item, value)

    return WeightsOnlyLoadPlanner()


@contextlib.contextmanager
def _reading_checkpoint(path: str):
    """Check `path` against its manifest and give its trainer_state; any failure while reading it (inside the block
    too) becomes a CheckpointError naming it (a damaged file fails in many ways), so resume falls back to the
    previous checkpoint."""
    # what dcp.load raises, a BaseException
    from torch.distributed.checkpoint.api import CheckpointException

    problem = verify_checkpoint(path)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    try:
        with open(os.path.join(path, "trainer_state.json")) as handle:
            state = json.load(handle)
        yield state
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(exc).__name__}: {exc}") from exc


def save_full_model(dp, directory: str, model: nn.Module, tokenizer) -> None:
    """The trained actor of a sharded run in HF format (LoRA merged), written by rank 0, atomically."""
    full = full_model_state(model)
    if dp.is_main:
        tmp = directory + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_hf_model(tmp, model, full, tokenizer)
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    dp.barrier()


def load_replicated_into_sharded(path: str, *, actor, critic=None, optimizers: dict,
                                 schedulers: dict) -> dict[str, Any]:
    """A replicated run's checkpoint (one process, or rank 0 of replicas: full weights and optimizer state) into
    sharded models: every rank reads the full state and keeps its shards (DCP's set_model_state_dict /
    set_optimizer_state_dict with full state dicts). So a run that outgrows one GPU, or a 1-GPU run with offload
    that two GPUs plan sharded, continues where it stopped. LoRA models get their saved adapters (and a LoRA
    critic its value head) over the run's base weights (model.path), as a replicated resume does."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from .checkpoint import _load_safetensors_dir
    from .lora import unwrap_peft

    with _reading_checkpoint(path) as state:
        full, adapters_only = {}, set()
        if state.get("lora"):
            if unwrap_peft(actor) is actor:
                raise CheckpointError(f"checkpoint {path} holds LoRA adapters and this run's actor has none: resume "
                                      "with the same actor_rollout_ref.model.lora_rank")
            full["actor"] = _adapters_by_parameter(path, actor, actor.active_adapter,
                                                   _load_safetensors_dir(os.path.join(path, "actor_lora")))
            adapters_only.add("actor")
        else:
            full["actor"] = _load_safetensors_dir(os.path.join(path, "actor"))
        if critic is not None and critic.is_lora:
            full["critic"] = _adapters_by_parameter(path, critic, critic.backbone.active_adapter,
                                                    type(critic).saved_state(os.path.join(path, "critic"), lora=True))
            adapters_only.add("critic")
        elif critic is not None:
            full["critic"] = type(critic).saved_state(os.path.join(path, "critic"))
        saved = torch.load(os.path.join(path, "optim.pt"), map_location="cpu", weights_only=True)
        options = StateDictOptions(full_state_dict=True, strict=False)  # tied heads saved once; LoRA: adapters only
        for name, model in (("actor", actor), ("critic", critic)):
            if model is None:
                continue
            if name not in adapters_only:
                _check_keys(path, name, model, full[name])
            set_model_state_dict(model, full[name], options=options)
            optimizer = optimizers.get(name)
            if optimizer is not None:
                set_optimizer_state_dict(model, optimizer, _named_optimizer_state(saved["optimizers"][name], model,
                                                                                  optimizer), options=options)
        for name, scheduler in schedulers.items():
            scheduler.load_state_dict(saved["schedulers"][name])
        restore_rng(torch.load(os.path.join(path, "rng.pt"), weights_only=True), state["rng"])
    return state


def _adapters_by_parameter(path: str, model: nn.Module, adapter: str,
                           saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Saved trainable tensors keyed as peft writes adapters (no adapter name: `...q_proj.lora_A.weight`) -> the live
    model's trainable parameters (`...q_proj.lora_A.default.weight`); every trainable parameter must be there."""
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    by_parameter = {name: saved.get(name.replace(f".{adapter}.", ".")) for name in names}
    missing = [name for name, tensor in by_parameter.items() if tensor is None]
    if missing or not names:
        raise CheckpointError(f"checkpoint {path}: the saved LoRA adapters do not match this run's trainable "
                              f"parameters (missing {missing[:5]}; same lora_rank, alpha and target modules?)")
    return by_parameter


def _check_keys(path: str, name: str, model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """strict=False lets a tied LM head be absent from the file; anything else missing or extra is an error."""
    expected = {key for key, _ in model.named_parameters()}
    tied = {key for key in expected - set(full) if key.endswith("lm_head.weight")}
    missing, unexpected = expected - set(full) - tied, set(full) - {key for key in model.state_dict()}
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path}: the {name} weights do not match the model: missing "
                              f"{sorted(missing)[:5]} unexpected {sorted(unexpected)[:5]}")


def _named_optimizer_state(saved: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A plain optimizer state dict (parameters by position, as optimizer.state_dict() writes it) keyed by parameter
    names instead, the form DCP's set_optimizer_state_dict takes: position i is the i-th parameter of this run's
    optimizer, built in the same order as the saving run's."""
    names = {id(param): name for name, param in model.named_parameters()}
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    positions = [index for group in saved["param_groups"] for index in group["params"]]
    if len(positions) != len(order):
        raise CheckpointError(f"the saved optimizer has {len(positions)} parameters, this run's {len(order)}")
    by_name = dict(zip(positions, order))
    return {"state": {by_name[index]: value for index, value in saved["state"].items()},
            "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                              "params": [by_name[index] for index in group["params"]]}
                             for group in saved["param_groups"]]}


def load_checkpoint_any(load_replicated, path: str, *, actor, critic=None, optimizers: dict,
                        schedulers: dict) -> dict[str, Any]:
    """A sharded (DCP) checkpoint with `load_sharded`, on any world size, sharded or not; a replicated one with
    `load_replicated` (checkpoint.load_checkpoint), or into sharded models with `load_replicated_into_sharded`."""
    from .sharding import is_sharded

    kwargs = dict(actor=actor, critic=critic, optimizers=optimizers, schedulers=schedulers)
    if is_sharded_checkpoint(path):
        return load_sharded(path, **kwargs)
    if is_sharded(actor):
        return load_replicated_into_sharded(path, **kwargs)
    return load_replicated(path, **kwargs)
