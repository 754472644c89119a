"""LoRA (via peft) for the actor and critic, the adapter-disabled reference policy, and merged export.

With LoRA the frozen base weights double as the reference model: ``adapter_disabled(model)`` turns the adapters
off for the reference log-prob pass, so no second copy of the weights is needed. Only the adapter weights (and
their optimizer state) are trained, which is what lets a 0.5B-1.5B model's PPO fit a 24 GB card.

* ``apply_lora(model, r, alpha, target_modules, dropout)`` -> peft ``PeftModel``.
* ``adapter_disabled(model)``: context manager for reference log-probs.
* ``merged_state_for_export(model)``: a plain model with LoRA merged, built from a CPU copy so the training model
  (and the GPU) are untouched; call ``save_pretrained`` on it.
* ``trainable_parameter_summary(model)``: counts for the console / metrics.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Iterator, Sequence

import torch
from torch import nn


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is a declared dependency
        raise ImportError("LoRA needs the 'peft' package: pip install peft") from exc
    return peft


def is_peft_model(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft PeftModel (its LoRA layers stay injected and active), or the model."""
    return model.get_base_model() if is_peft_model(model) else model


def _all_linear_targets(model: nn.Module, modules_to_save: Sequence[str]) -> list[str]:
    """Names of every nn.Linear except the lm head and ``modules_to_save`` (e.g. a critic's value head).

    peft's own "all-linear" only excludes the lm head of transformers models; a critic wrapper's value head would
    otherwise get LoRA instead of being trained in full.
    """
    # GPT-2's linear layers are Conv1D modules (peft adapts them too)
    from transformers.pytorch_utils import Conv1D

    excluded_modules = set()
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    output_embeddings = get_output_embeddings() if callable(get_output_embeddings) else None
    if output_embeddings is not None:
        excluded_modules.add(id(output_embeddings))
    included, excluded_names = [], []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)):
            continue
        leaf = name.rsplit(".", 1)[-1]
        if id(module) in excluded_modules or leaf in modules_to_save or name in modules_to_save:
            excluded_names.append(name)
        else:
            included.append(name)
    if not included:
        raise ValueError(f"target_modules='all-linear' found no linear layers to adapt in {type(model).__name__}")
    leaves = {name.rsplit(".", 1)[-1] for name in included}
    excluded_leaves = {name.rsplit(".", 1)[-1] for name in excluded_names}
    # short leaf names (q_proj, ...) keep the adapter config readable; fall back to full names when ambiguous
    return sorted(leaves) if not leaves & excluded_leaves else included


def apply_lora(
    model: nn.Module,
    r: int,
    alpha: float,
    target_modules: str | Sequence[str] = "all-linear",
    dropout: float = 0.0,
    modules_to_save: Sequence[str] | None = None,
    exclude_modules: str | Sequence[str] | None = None,
):
    """Wrap ``model`` with fresh LoRA adapters (peft); the base weights are frozen, the adapters trainable.

    ``target_modules``: "all-linear" (every linear layer except the lm head and ``modules_to_save``) or a list of
    module names (peft matching, e.g. ["q_proj", "v_proj"]). ``modules_to_save``: modules trained in full (a
    critic's value head). ``exclude_modules``: names or a regex of modules left without adapters (peft matching).
    Note peft modifies ``model`` in place (LoRA layers are injected into it).
    """
    peft = _peft()
    if is_peft_model(model):
        raise ValueError("model already has peft adapters; apply_lora expects the plain model")
    if not (isinstance(r, int) and r > 0):
        raise ValueError(f"LoRA rank r must be a positive int (e.g. 8-64), got {r!r}")
    if not (isinstance(alpha, (int, float)) and alpha > 0):
        raise ValueError(f"LoRA alpha must be > 0 (commonly equal to or twice r), got {alpha!r}")
    if not (0.0 <= dropout < 1.0):
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    modules_to_save = list(modules_to_save or [])
    if isinstance(target_modules, str):
        if target_modules.lower() != "all-linear":
            raise ValueError(
                f"target_modules must be 'all-linear' or a list of module names, got the string {target_modules!r}"
            )
        targets = _all_linear_targets(model, modules_to_save)
    else:
        targets = list(target_modules)
        if not targets:
            raise ValueError("target_modules is an empty list; use 'all-linear' or name the layers to adapt")
    # a causal LM gets PeftModelForCausalLM (generate works); other modules (critic wrappers) a plain PeftModel
    task_type = "CAUSAL_LM" if hasattr(model, "prepare_inputs_for_generation") else None
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=dropout,
        modules_to_save=modules_to_save or None,
        exclude_modules=exclude_modules or None,  # verl's: names or a regex left without adapters
        task_type=task_type,
    )
    peft_model = peft.get_peft_model(model, config)
    # gradient checkpointing with a frozen embedding needs inputs that require grad, or no gradient reaches LoRA
    if _uses_activation_checkpointing(model) and hasattr(peft_model, "enable_input_require_grads"):
        peft_model.enable_input_require_grads()
    return peft_model


def load_adapter_state(model: nn.Module, state: dict, where: str) -> None:
    """Load saved LoRA weights into `model`'s adapters, every one of them: a saved tensor with no adapter to take it
    (the adapters are on other modules now) or an adapter the file has nothing for raises ValueError naming both,
    where peft's loader would drop the one and leave the other fresh without a word."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [key for key in (getattr(result, "missing_keys", []) or []) if "lora_" in key]
    if unexpected or missing:
        raise ValueError(f"the LoRA adapters saved in {where} do not fit this model's: "
                         f"{len(unexpected)} saved tensor(s) without an adapter (e.g. {unexpected[:2]}), "
                         f"{len(missing)} adapter tensor(s) not saved (e.g. {missing[:2]}); the run's lora_rank, "
                         "lora_alpha and target_modules must be those the checkpoint was trained with")


def _uses_activation_checkpointing(model: nn.Module) -> bool:
    # transformers renamed is_gradient_checkpointing -> is_activation_checkpointing; ask the class which it has
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def _require_peft(model: nn.Module, what: str) -> None:
    if not is_peft_model(model):
        raise TypeError(
            f"{what} needs a peft PeftModel (made by rlanywhere.lora.apply_lora), got {type(model).__name__}. "
            "Without LoRA the reference policy is a separate frozen copy of the model (see plan.ref_device)."
        )


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run the base model without its LoRA adapters inside the ``with`` block (the reference policy)."""
    _require_peft(model, "adapter_disabled")
    with model.disable_adapter():
        yield model


def merged_state_for_export(model: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """A plain model (e.g. ``Qwen2ForCausalLM``) with the LoRA adapters merged into its weights, for
    ``save_pretrained``. Built from a copy on ``device`` (default CPU), so the training model keeps its adapters,
    its weights bitwise and its device, and no extra accelerator memory is used. A model without adapters is
    returned as it is.
    """
    if not is_peft_model(model):
        return model
    device = torch.device(device)
    # Pre-seed deepcopy's memo with device copies of every parameter and buffer: the copy never lands on the
    # accelerator, and the original's tensors (and gradients) are not duplicated.
    memo: dict[int, object] = {}
    with torch.no_grad():
        for param in model.parameters():
            if id(param) not in memo:
                memo[id(param)] = nn.Parameter(param.detach().to(device, copy=True), requires_grad=False)
        for buffer in model.buffers():
            if id(buffer) not in memo:
                memo[id(buffer)] = buffer.detach().to(device, copy=True)
    export_copy = copy.deepcopy(model, memo)
    merged = export_copy.merge_and_unload()
    merged.eval()
    return merged


def trainable_parameter_summary(model: nn.Module) -> dict:
    """Counts of trainable / total parameters (tied weights counted once) and the trainable share."""
    seen: set[int] = set()
    total = trainable = trainable_bytes = 0
    for param in model.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        total += param.numel()
        if param.requires_grad:
            trainable += param.numel()
            trainable_bytes += param.numel() * param.element_size()
    return {
        "trainable_params": trainable,
        "total_params": total,
        "trainable_percent": 100.0 * trainable / total if total else 0.0,
        "trainable_bytes": trainable_bytes,
        "is_lora": is_peft_model(model),
    }
