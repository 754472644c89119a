"""Move optimizer state and model weights between CPU and the accelerator between training phases.

On a 24 GB card the AdamW state of the actor (2 fp32 tensors per parameter) is only needed during
``optimizer.step()``; parking it in CPU memory during rollout and log-prob passes frees that memory for the KV cache
and activations. The same goes for a model that is idle in a phase (the critic during rollout, a reference model).

* ``offload_optimizer_state`` / ``load_optimizer_state``: move Adam(W)-style state tensors (exp_avg, exp_avg_sq,
  max_exp_avg_sq, ...). ``step`` follows torch's own rule: it lives on the parameter's device only for
  ``capturable`` / ``fused`` param groups, otherwise it stays a CPU scalar.
* ``offload_model``: move parameters, buffers and gradients in place (the Parameter objects stay the same, so an
  optimizer holding them keeps working; tied weights stay tied).
* ``on_device(obj, device, enabled)``: a context manager that moves a model or optimizer in and back out.

Copies to the CPU from an accelerator go into pinned (page-locked) buffers, kept and reused across calls, so the
copies are asynchronous DMA transfers and repeated offloads do not re-allocate host memory. All functions are
device-agnostic; moving to the device a tensor is already on is a no-op that keeps the same tensor.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch import nn

# owner (model or optimizer) -> {key: pinned CPU buffer}; entries vanish with their owner.
_PINNED_BUFFERS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _synchronize(device: torch.device) -> None:
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and module is not None and hasattr(module, "synchronize"):
        module.synchronize()


class _Mover:
    """Moves tensors to ``device``; to the CPU it copies into cached pinned buffers of ``owner``."""

    def __init__(self, owner, device):
        self.device = torch.device(device)
        self.buffers = _PINNED_BUFFERS.setdefault(owner, {})
        self.synced_devices: set[torch.device] = set()

    def __call__(self, key, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor
        if self.device.type == "cpu" and tensor.device.type == "cuda":
            buffer = self.buffers.get(key)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
                self.buffers[key] = buffer
            buffer.copy_(tensor, non_blocking=True)
            self.synced_devices.add(tensor.device)
            return buffer
        return tensor.to(self.device, non_blocking=tensor.is_pinned())

    def finish(self) -> None:
        # device -> host copies must land before anyone reads the CPU tensors
        for device in self.synced_devices:
            _synchronize(device)


def _check_optimizer(optimizer) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device) -> None:
    _check_optimizer(optimizer)
    mover = _Mover(optimizer, device)
    for group in optimizer.param_groups:
        step_follows_param = bool(group.get("capturable", False) or group.get("fused", False))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    continue
                if name == "step" and not step_follows_param:
                    continue  # torch keeps a CPU scalar step here; moving it would force a sync per step
                state[name] = mover((id(param), name), value)
    mover.finish()


def offload_optimizer_state(optimizer: torch.optim.Optimizer, device="cpu") -> None:
    """Move the optimizer's state tensors to ``device`` (normally the CPU), in place."""
    _move_optimizer_state(optimizer, device)


def load_optimizer_state(optimizer: torch.optim.Optimizer, device) -> None:
    """Move the optimizer's state tensors to ``device`` (the accelerator), in place, before ``step()``."""
    _move_optimizer_state(optimizer, device)


def offload_model(model: nn.Module, device) -> None:
    """Move ``model``'s parameters, buffers and gradients to ``device`` in place (Parameter identity kept)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}")
    mover = _Mover(model, device)
    moved_buffers: dict[int, torch.Tensor] = {}  # keeps buffers shared between modules shared
    with torch.no_grad():
        for name, param in model.named_parameters():  # deduplicated: a tied weight moves once
            param.data = mover(("param", name), param.data)
            if param.grad is not None:
                param.grad.data = mover(("grad", name), param.grad.data)
        for module_name, module in model.named_modules():
            for buffer_name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                if id(buffer) not in moved_buffers:
                    moved_buffers[id(buffer)] = mover(("buffer", module_name, buffer_name), buffer)
                module._buffers[buffer_name] = moved_buffers[id(buffer)]
    mover.finish()


def current_device(obj) -> torch.device | None:
    """Device of the first parameter (model) or state tensor (optimizer); None when there is none."""
    if isinstance(obj, nn.Module):
        for tensor in obj.parameters():
            return tensor.device
        for tensor in obj.buffers():
            return tensor.device
        return None
    _check_optimizer(obj)
    for state in obj.state.values():
        for name, value in state.items():
            if isinstance(value, torch.Tensor) and name != "step":
                return value.device
    return None


def move(obj, device) -> None:
    """``offload_model`` for a module, ``load_optimizer_state`` for an optimizer."""
    if isinstance(obj, nn.Module):
        offload_model(obj, device)
    else:
        _move_optimizer_state(obj, device)


@contextlib.contextmanager
def on_device(obj, device, enabled: bool = True, home=None) -> Iterator[None]:
    """Move a model or optimizer to ``device`` for the ``with`` block and back to ``home`` afterwards (also when the
    block raises, e.g. on OOM). ``home`` defaults to where ``obj`` is now, or the CPU for an optimizer without
    state yet (its state is created on the parameters' device by the first ``step()`` inside the block).
    With ``enabled=False`` it does nothing."""
    if not enabled:
        yield
        return
    if home is None:
        home = current_device(obj) or torch.device("cpu")
    move(obj, device)
    try:
        yield
    finally:
        move(obj, home)
