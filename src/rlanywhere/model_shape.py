"""Model shapes without loading weights: from a Hugging Face config (object, dict, config.json, model directory),
a GGUF file's metadata, the hub, or a named shape (`NAMED_SHAPES`). The planner and the estimator size everything
from a `ModelShape`, defined here: the numbers of a decoder-only transformer that memory depends on.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from .vocabulary import PlanError

NORMS_PER_LAYER = 2  # RMSNorms per decoder layer (before attention, before the MLP)


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that memory depends on (read from config.json, never weights)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int = 0  # 0: hidden_size // num_heads
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    model_type: str = "llama"
    max_position_embeddings: Optional[int] = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of the seven linear layers of one decoder block."""
        hidden, inter = self.hidden_size, self.intermediate_size
        return [("q_proj", hidden, self.q_dim), ("k_proj", hidden, self.kv_dim), ("v_proj", hidden, self.kv_dim),
                ("o_proj", self.q_dim, hidden), ("gate_proj", hidden, inter), ("up_proj", hidden, inter),
                ("down_proj", inter, hidden)]

    def layer_params(self) -> int:
        weights = sum(n_in * n_out for _, n_in, n_out in self.linear_shapes())
        biases = (self.q_dim + 2 * self.kv_dim) if self.attention_bias else 0
        return weights + biases + NORMS_PER_LAYER * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def backbone_params(self) -> int:
        """Embedding + decoder layers + final norm (what a critic keeps)."""
        return self.embedding_params() + self.num_layers * self.layer_params() + self.hidden_size

    def num_params(self, with_lm_head: bool = True) -> int:
        head = self.embedding_params() if (with_lm_head and not self.tie_word_embeddings) else 0
        return self.backbone_params() + head

    def lora_params(self, rank: int) -> int:
        """Trainable parameters of a rank-`rank` LoRA on all seven linear layers of every block."""
        return self.num_layers * sum(rank * (n_in + n_out) for _, n_in, n_out in self.linear_shapes())

    def largest_tensor_numel(self) -> int:
        return max(self.embedding_params(), max(n_in * n_out for _, n_in, n_out in self.linear_shapes()))

    def to_dict(self) -> dict:
        return asdict(self)


NAMED_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True, attention_bias=True, model_type="qwen2",
               max_position_embeddings=32768),
    ModelShape("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, True, attention_bias=True, model_type="qwen2",
               max_position_embeddings=32768),
    ModelShape("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True, attention_bias=True, model_type="qwen2",
               max_position_embeddings=32768),
    ModelShape("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False, attention_bias=True, model_type="qwen2",
               max_position_embeddings=32768),
    ModelShape("smollm2-135m", 576, 30, 9, 3, 1536, 49152, True, model_type="llama", max_position_embeddings=8192),
    ModelShape("smollm2-360m", 960, 32, 15, 5, 2560, 49152, True, model_type="llama", max_position_embeddings=8192),
)}
_NAME_SUFFIXES = ("-instruct", "-chat", "-base", "-it", "-gguf")


def _normalise_model_name(path: str) -> str:
    name = str(path).rstrip("/").split("/")[-1].lower()
    name = re.sub(r"\.(gguf|json)$", "", name)
    changed = True
    while changed:
        changed = False
        for suffix in _NAME_SUFFIXES:
            if name.endswith(suffix):
                name, changed = name[: -len(suffix)], True
    return name


def _default_tie(model_type: str) -> bool:
    """Whether a config.json that does not say ties the LM head to the embeddings: its model type's config class
    default (False for llama, mistral, qwen2, qwen3, ...), PretrainedConfig's True for a type transformers lacks or
    whose config class has no such field (some multimodal text configs: their outer config says)."""
    try:
        from transformers import AutoConfig

        tie = getattr(AutoConfig.for_model(model_type), "tie_word_embeddings", None)
    except Exception:  # noqa: BLE001 - an unknown type, an old transformers, a class that needs arguments
        return True
    return True if tie is None else bool(tie)


def _shape_from_hf_dict(config: dict, name: str) -> ModelShape:
    outer = config
    config = dict(config.get("text_config") or config)
    model_type = str(config.get("model_type", "llama"))
    # a multimodal config keeps the flag outside its text_config (transformers writes Qwen2.5-VL's so)
    tie = config.get("tie_word_embeddings", outer.get("tie_word_embeddings"))
    try:
        hidden = int(config.get("hidden_size") or config.get("n_embd") or config["d_model"])
        heads = int(config.get("num_attention_heads") or config["n_head"])
        layers = int(config.get("num_hidden_layers") or config["n_layer"])
        vocab = int(config["vocab_size"])
    except (KeyError, TypeError) as exc:
        raise PlanError(f"model config for {name!r} lacks {exc}: expected a decoder-only HF config.json "
                        "(hidden_size, num_hidden_layers, num_attention_heads, vocab_size)") from exc
    return ModelShape(
        name=name, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        intermediate_size=int(config.get("intermediate_size") or 4 * hidden), vocab_size=vocab,
        tie_word_embeddings=_default_tie(model_type) if tie is None else bool(tie),
        head_dim=int(config.get("head_dim") or 0),
        attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
        model_type=model_type, max_position_embeddings=config.get("max_position_embeddings"))


def gguf_value(field_: Any) -> Any:
    """The value of one GGUF metadata field (a scalar or string), for old and new `gguf` releases."""
    if hasattr(field_, "contents"):
        return field_.contents()
    part = field_.parts[field_.data[0]]  # older gguf: scalar value stored in one part
    value = part.tobytes().decode() if part.dtype.kind == "u" and part.dtype.itemsize == 1 else part[0]
    return value.item() if hasattr(value, "item") else value


def _shape_from_gguf(path: Path) -> ModelShape:
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise PlanError(f"reading {path.name} needs the gguf package: pip install gguf "
                        "(or pip install rlanywhere[gguf])") from exc
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise PlanError(f"{path} is not a readable GGUF file ({exc}): download it again, or point "
                        "actor_rollout_ref.model.path at a Hugging Face model folder") from exc

    def get(key: str, default: Any = None) -> Any:
        field_ = reader.fields.get(key)
        return gguf_value(field_) if field_ is not None else default

    arch = get("general.architecture")
    if arch is None:
        raise PlanError(f"{path} has no general.architecture metadata: not a model GGUF file")
    hidden = get(f"{arch}.embedding_length")
    layers = get(f"{arch}.block_count")
    heads = get(f"{arch}.attention.head_count")
    if None in (hidden, layers, heads):
        raise PlanError(f"{path}: GGUF metadata lacks {arch}.embedding_length / block_count / attention.head_count")
    vocab = get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 0
    names = {tensor.name for tensor in reader.tensors}
    return ModelShape(
        name=_normalise_model_name(path.name), hidden_size=int(hidden), num_layers=int(layers), num_heads=int(heads),
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        intermediate_size=int(get(f"{arch}.feed_forward_length", 4 * int(hidden))), vocab_size=int(vocab),
        tie_word_embeddings="output.weight" not in names, head_dim=int(get(f"{arch}.attention.key_length", 0)),
        attention_bias="blk.0.attn_q.bias" in names, model_type=str(arch),
        max_position_embeddings=get(f"{arch}.context_length"))


def read_model_shape(path_or_config: Any, gguf_file: Optional[str] = None) -> ModelShape:
    """A model's shape without loading weights.

    Accepts a ModelShape, a transformers PretrainedConfig, a config dict, a directory with config.json (or .gguf
    files), a config.json / .gguf file, a named shape (NAMED_SHAPES, e.g. 'Qwen/Qwen2.5-0.5B-Instruct' ->
    'qwen2.5-0.5b'), or a hub id whose config.json is cached or downloadable."""
    if isinstance(path_or_config, ModelShape):
        return path_or_config
    if isinstance(path_or_config, dict):
        return _shape_from_hf_dict(path_or_config, str(path_or_config.get("_name_or_path") or "model"))
    if hasattr(path_or_config, "to_dict") and hasattr(path_or_config, "model_type"):
        config = path_or_config.get_text_config() if hasattr(path_or_config, "get_text_config") else path_or_config
        data = config.to_dict()
        data.setdefault("tie_word_embeddings", getattr(config, "tie_word_embeddings", True))
        return _shape_from_hf_dict(data, str(getattr(config, "_name_or_path", "") or config.model_type))
    path = Path(str(path_or_config)).expanduser()
    if path.is_file():
        if path.suffix == ".gguf":
            return _shape_from_gguf(path)
        return _shape_from_hf_dict(json.loads(path.read_text()), path.parent.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return _shape_from_hf_dict(json.loads((path / "config.json").read_text()), path.name)
        ggufs = [path / gguf_file] if gguf_file else sorted(path.glob("*.gguf"))
        if ggufs and ggufs[0].is_file():
            return _shape_from_gguf(ggufs[0])
        raise PlanError(f"{path} has neither config.json nor a .gguf file: point actor_rollout_ref.model.path at a "
                        "Hugging Face model directory or a .gguf file")
    name = _normalise_model_name(str(path_or_config))
    if name in NAMED_SHAPES:
        return NAMED_SHAPES[name]
    return _shape_from_hub(str(path_or_config))


def _shape_from_hub(repo_id: str) -> ModelShape:
    from transformers import AutoConfig

    errors = []
    for local_only in (True, False):
        try:
            return read_model_shape(AutoConfig.from_pretrained(repo_id, local_files_only=local_only))
        except Exception as exc:  # noqa: BLE001 - hub / network / parse errors all mean "cannot read it"
            errors.append(str(exc).splitlines()[0])
    raise PlanError(f"cannot read the model config of {repo_id!r} ({errors[-1]}). Give a local model directory, a "
                    f".gguf file, or one of the named shapes: {', '.join(NAMED_SHAPES)}")

