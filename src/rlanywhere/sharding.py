"""FSDP2 sharding of the actor, critic and reference (`plan.data_parallel == "shard"`), and the few places where
our code must see full weights of a sharded model.

How a model is sharded (`shard_model`, `shard_for_plan`): over all ranks, or HSDP (`plan.shard_group_size` below
the world size: a 2D mesh of replicas x shard groups of consecutive ranks, a node's; FSDP2 all-gathers and
reduce-scatters within a group and all-reduces the gradient shards across groups). `fully_shard` on every decoder
layer, then on the whole model (the root
holds the embeddings, the final norm, the LM head — one parameter when tied — and a critic's value head). Mixed
precision follows the plan: bf16 autocast plans gather bf16 weights and reduce gradients in fp32
(`MixedPrecisionPolicy`); fp32 and fp16 plans gather the fp32 weights (fp16 keeps today's autocast + loss
scaler). `CPUOffloadPolicy` when the plan offloads parameters.

Three things our code does that FSDP2 does not expect, and how they are made right here:

* Our losses run the decoder (`model.model(...)`) and read `lm_head.weight` directly (chunked log-probs), so the
  root's forward, which would gather the root's parameters, never runs. `call_in_root_forward(model, fn)` runs
  `fn` inside a method registered with `register_fsdp_forward_method`: FSDP's pre-forward (gather the root group,
  set up backward) and post-forward (pre-backward hooks on the outputs) wrap the whole chunked computation, so
  forward and backward see full root parameters and the root's gradients are reduce-scattered like any other.
* Gradients: FSDP reduce-scatters them in backward and divides by the world size by default. Our loss on each
  rank is already its share of the global loss (the denominators are summed over ranks), so the global gradient
  is the SUM: `shard_model` sets the divide factor to 1. `DataParallel.sum_gradients` must not run on a sharded
  model (`needs_gradient_sum`).
* Collectives must match across ranks: every forward/backward of a sharded model all-gathers per layer, so all
  ranks must run the same number of them. Generation (ranks stop at different lengths) and the forward-only
  log-prob / value passes (token-budget micro-batches differ per rank) run inside `gathered(model)`: every unit is
  unsharded once, up front, and stays unsharded (no reshard after forward) until the block ends, so nothing inside
  communicates; the engine reads plain full tensors. Updates pad the shorter ranks with zero-weight micro-batches
  (`matched_micro_batches`), so every rank runs as many backward passes.
"""

from __future__ import annotations

import contextlib
import logging
import types
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from .vocabulary import ACCUMULATE_DTYPE

ROOT_CALL = "rla_call_in_forward"

log = logging.getLogger(__name__)


def fsdp_api():
    """torch.distributed.fsdp's FSDP2 names (torch >= 2.6 exports them there)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method

    return types.SimpleNamespace(fully_shard=fully_shard, FSDPModule=FSDPModule, MixedPrecisionPolicy=MixedPrecisionPolicy,
                                 CPUOffloadPolicy=CPUOffloadPolicy, register=register_fsdp_forward_method)


def is_sharded(model: Optional[nn.Module]) -> bool:
    if model is None:
        return False
    try:
        return isinstance(model, fsdp_api().FSDPModule)
    except ImportError:
        return False


def needs_gradient_sum(model: nn.Module) -> bool:
    """Whether our own all-reduce must sum this model's gradients (replicas); FSDP reduces a sharded model's."""
    return not is_sharded(model)


def decoder_layers(model: nn.Module) -> Sequence[nn.Module]:
    """The transformer blocks of a causal LM, a peft model around one, or a ValueModel (its backbone)."""
    from .lora import unwrap_peft

    inner = unwrap_peft(model)
    if hasattr(inner, "backbone"):  # the critic: ValueModel(backbone=decoder or peft(decoder))
        inner = unwrap_peft(inner.backbone)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else inner
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise TypeError(f"cannot shard {type(inner).__name__}: no decoder .layers to wrap one FSDP unit each")
    return list(layers)


def _call_in_forward(self, fn: Callable, *args, **kwargs):
    return fn(*args, **kwargs)


def shard_model(model: nn.Module, *, mesh=None, param_dtype: Optional[torch.dtype] = None, offload: bool = False,
                reshard_after_forward: bool = True) -> nn.Module:
    """fully_shard every decoder layer, then the root; gradients summed over ranks (divide factor 1). In place."""
    api = fsdp_api()
    # gradients reduced (summed over ranks) in fp32 when the weights are gathered in a lower precision
    policy = api.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=ACCUMULATE_DTYPE if param_dtype else None)
    kwargs = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if offload:
        kwargs["offload_policy"] = api.CPUOffloadPolicy()
    units = []
    for layer in decoder_layers(model):
        units.append(api.fully_shard(layer, **kwargs))
    root = api.fully_shard(model, **kwargs)
    units.append(root)
    for unit in units:
        # each rank's loss is its share of the global loss: the global gradient is the sum, not the mean
        if hasattr(unit, "set_gradient_divide_factor"):
            unit.set_gradient_divide_factor(1.0)
        else:  # torch < 2.8
            unit.set_reduce_scatter_divide_factor(1.0)
        if hasattr(unit, "set_force_sum_reduction_for_comms"):
            # a plain SUM (a custom factor otherwise becomes NCCL's PREMUL_SUM, which gloo does not have)
            unit.set_force_sum_reduction_for_comms(True)
    model.rla_call_in_forward = types.MethodType(_call_in_forward, model)
    api.register(model, ROOT_CALL)
    # the root must be initialised as the root before any layer runs alone (the engine, a decoder-only call)
    root._get_fsdp_state()._lazy_init()
    return model


def call_in_root_forward(model: nn.Module, fn: Callable) -> Callable:
    """`fn` as it must be called on `model`: inside the sharded root's forward hooks, or as it is."""
    if not is_sharded(model):
        return fn
    return lambda *args, **kwargs: getattr(model, ROOT_CALL)(fn, *args, **kwargs)


def _units(model: nn.Module) -> list:
    api = fsdp_api()
    return [m for m in model.modules() if isinstance(m, api.FSDPModule)]


@contextlib.contextmanager
def gathered(*models: Optional[nn.Module]) -> Iterator[None]:
    """Inside: every sharded model among `models` holds its full weights as plain tensors (the FSDP2 unsharded
    parameters), and its forward does no collective; after: resharded (the gathered memory freed).

    Costs one full copy of the weights in the gather dtype per model (the plan's `rollout_weights` bytes)."""
    units = [unit for model in models if is_sharded(model) for unit in _units(model)]
    if not units:
        yield
        return
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    handles = [unit.unshard(async_op=True) for unit in units]
    for handle in handles:
        if handle is not None:
            handle.wait()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)


def sync_engine(engine, model: nn.Module) -> None:
    """Refresh the rollout engine's weights now: a replica's at once; a sharded model's happens at generation,
    inside `gathered` (`sync_and_generate`), the only time its full weights exist."""
    if not is_sharded(model):
        engine.sync_weights()


@contextlib.contextmanager
def weights_for_rollout(engine, model: nn.Module) -> Iterator[None]:
    """Around a generation: a sharded actor's full weights gathered and handed to the engine, freed after."""
    if not is_sharded(model):
        yield
        return
    with gathered(model):
        engine.sync_weights()
        try:
            yield
        finally:
            # the gathered storage is freed now and comes back at another address next time: the engine's CUDA
            # graphs (captured on these addresses) and KV cache go too, to be rebuilt at the next generation
            release = getattr(engine, "release_memory", None)
            if release is not None:
                release()


def matched_micro_batches(micro_batches: list, dp, sharded: bool, fallback: Optional[list] = None
                          ) -> list[tuple[list, bool]]:
    """(micro-batch, is_padding) pairs, as many on every rank: a sharded model's backward communicates per layer,
    so a rank with fewer micro-batches (token budgets differ) repeats its first one with zero loss weight; a rank
    with none at all (an empty share of a mini-batch) repeats `fallback` (rows it holds)."""
    pairs = [(micro, False) for micro in micro_batches]
    if not sharded or not dp.enabled:
        return pairs
    most = int(dp.max_value(float(len(pairs))))
    if most > len(pairs) and not micro_batches and fallback is None:
        raise ValueError("a rank with no rows in a mini-batch needs a fallback micro-batch to pad with")
    padding = micro_batches[0] if micro_batches else fallback
    return pairs + [(padding, True)] * (most - len(pairs))


def shard_for_plan(plan, *models: Optional[nn.Module]) -> None:
    """Shard each given model (None skipped) as the plan says: nothing unless plan.data_parallel == "shard".
    Call after the weights are loaded identically on every rank and before the optimizers are built."""
    if getattr(plan, "data_parallel", "none") != "shard":
        return
    from .planner.memory import sharded_gather_dtype

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if str(plan.device).startswith("cuda") else "cpu"
    world = dist.get_world_size()
    group = int(getattr(plan, "shard_group_size", 0) or world)
    if group < world:  # HSDP: consecutive ranks (a node's) shard, the groups replicate each other
        mesh = init_device_mesh(device_type, (world // group, group), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device_type, (world,))
    if dist.get_rank() == 0:
        log.info("FSDP2 device mesh %s%s", tuple(mesh.shape),
                 " (HSDP: replicas x shard group)" if mesh.ndim == 2 else "")
    for model in models:
        if model is not None:
            shard_model(model, mesh=mesh, param_dtype=sharded_gather_dtype(plan), offload=bool(plan.param_offload))
