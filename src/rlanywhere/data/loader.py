"""The runtime side of the data: reading verl-schema parquet files and checking their rows (`read_parquet_rows`,
`check_rows`), :class:`RLDataset` (applies the tokenizer's chat template to each prompt, with the overlong-prompt
filter and truncation), and :class:`PromptLoader`, which serves batches of prompt items forever, epoch after epoch,
in an order that depends only on ``(seed, epoch)`` so that its ``state_dict`` resumes a run exactly.
:func:`collate_prompts` left-pads a batch. Writing the files is `data/prepare.py`'s job (`rlanywhere prepare`).

Row schema: ``data_source: str``, ``prompt: [{"role", "content"}]``, ``ability: str``,
``reward_model: {"style": "rule", "ground_truth": str}``, ``extra_info: {"split", "index", "question", "answer"}``.
"""

from __future__ import annotations

import ast
import json
import logging
import math
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from ..errors import UserError
from ..vocabulary import Truncation, drops_overlong_prompts

logger = logging.getLogger(__name__)


class DataError(UserError, ValueError):
    """A data file that cannot be used as it is; the message names the file (and row, column) and the fix."""


class MissingColumnError(DataError, KeyError):
    """A column the config names is not in the file (a KeyError too, as it always was)."""

    __str__ = DataError.__str__  # KeyError would print the message in quotes


TRUNCATION_MODES = Truncation.values()


# --------------------------------------------------------------------------------------------------------------------
# Reading verl-schema parquet
# --------------------------------------------------------------------------------------------------------------------


def _as_path_list(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        text = str(paths).strip()
        # Config values like "['a.parquet', 'b.parquet']" arrive as one string from the command line.
        if text.startswith("[") and text.endswith("]"):
            return [Path(p).expanduser() for p in ast.literal_eval(text)]
        return [Path(text).expanduser()]
    return [Path(p).expanduser() for p in paths]


def read_parquet_rows(paths: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """All rows of one or more parquet files, in order, as plain dicts."""
    path_list = _as_path_list(paths)
    if not path_list:
        raise ValueError("No parquet files given: set data.train_files / data.val_files.")
    rows: list[dict[str, Any]] = []
    for path in path_list:
        if not path.is_file():
            raise FileNotFoundError(
                f"Data file {path} does not exist. Create it with `rlanywhere prepare ...` "
                "(gsm8k, arithmetic or generic) or point data.train_files / data.val_files at existing parquet files."
            )
        rows.extend(_read_parquet_file(path))
    return rows


def _read_parquet_file(path: Path) -> list[dict[str, Any]]:
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{path} is not a readable parquet file ({str(exc).splitlines()[0][:120]}). Training reads verl-schema "
            f"parquet: convert a .jsonl/.json/.parquet file of your own with `rlanywhere prepare generic --src "
            f"{path} --prompt-key <column> --answer-key <column> --out <dir>`"
        ) from None


def check_rows(rows: Sequence[dict[str, Any]], origins: Sequence[tuple[Path, int]], prompt_key: str,
               source_key: str = "data_source", answers: bool = True) -> None:
    """Every row needs a non-empty prompt, a `source_key` value (it picks the reward function) and, with `answers`
    (not when a reward model scores), reward_model.ground_truth; DataError names the file, row and column of the
    first bad row (and how many more)."""
    problems = []
    for row, (path, index) in zip(rows, origins):
        reward_model = row.get("reward_model")
        if not row.get(prompt_key):
            problem = f"column {prompt_key!r} is {'null' if row.get(prompt_key) is None else 'empty'}"
        elif (shape := _message_shape_problem(row[prompt_key])) is not None:
            problem = f"column {prompt_key!r} {shape}"
        elif row.get(source_key) is None:
            problem = f"column {source_key!r} is missing or null"
        elif not answers:
            continue
        elif not isinstance(reward_model, dict):
            problem = f"column 'reward_model' is {'null' if reward_model is None else type(reward_model).__name__}, " \
                      "not a struct with 'ground_truth'"
        elif reward_model.get("ground_truth") is None:
            problem = "reward_model.ground_truth is " + ("missing" if "ground_truth" not in reward_model else "null")
        elif str(reward_model["ground_truth"]).strip() == "":
            problem = "reward_model.ground_truth is empty"
        else:
            continue
        problems.append((path, index, problem))
    if problems:
        path, index, problem = problems[0]
        more = f" ({len(problems) - 1} more bad row(s))" if len(problems) > 1 else ""
        raise DataError(f"{path}, row {index} (0-based): {problem}{more}. Fix those rows or re-create the file "
                        "with `rlanywhere prepare ...`")



# --------------------------------------------------------------------------------------------------------------------
# Tokenised prompts
# --------------------------------------------------------------------------------------------------------------------


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _strip_repeated_bos(ids: list[int], bos_token_id: int | None) -> list[int]:
    # A template that writes the BOS text plus a tokenizer that adds BOS again gives <bos><bos>; keep one.
    if bos_token_id is not None and len(ids) >= 2 and ids[0] == bos_token_id and ids[1] == bos_token_id:
        start = 1
        while start + 1 < len(ids) and ids[start + 1] == bos_token_id:
            start += 1
        return ids[start:]
    return ids


def _json_messages(text: str) -> list | None:
    """The chat messages a prompt stored as JSON text holds (`[{"role": ..., "content": ...}]`), else None."""
    if not text.lstrip().startswith("["):
        return None
    try:
        decoded = json.loads(text)
    except ValueError:
        return None
    if isinstance(decoded, list) and decoded and all(isinstance(m, dict) and "role" in m for m in decoded):
        return decoded
    return None


def _message_shape_problem(prompt: Any) -> str | None:
    """Why a prompt's messages cannot be rendered (each needs a role and a content), or None."""
    if isinstance(prompt, str):
        prompt = _json_messages(prompt)
        if prompt is None:
            return None
    for message in prompt:
        if not isinstance(message, dict) or "role" not in message or (
                "content" not in message and "tool_calls" not in message):  # an assistant's call may have no text
            keys = sorted(message) if isinstance(message, dict) else type(message).__name__
            hint = (" (ShareGPT's from/value form: `rlanywhere prepare generic` writes {role, content})"
                    if isinstance(message, dict) and "from" in message else "")
            return f"holds a message {keys} without 'role' and 'content'{hint}"
    return None


def _normalise_messages(prompt: Any) -> list[dict[str, Any]]:
    """A prompt as chat messages: text is one user message (text that is a JSON list of messages is those
    messages); each message keeps its fields (tool_calls, name, ...) but those the parquet file left null."""
    if isinstance(prompt, str):
        decoded = _json_messages(prompt)
        if decoded is None:
            return [{"role": "user", "content": prompt}]
        prompt = decoded
    return [{key: value for key, value in message.items() if value is not None or key == "content"}
            for message in prompt]


def chat_template_kwargs(data_cfg: Any) -> dict:
    """data.apply_chat_template_kwargs as a plain dict (a DictConfig, a dict, or unset)."""
    from omegaconf import OmegaConf

    kwargs = getattr(data_cfg, "apply_chat_template_kwargs", None) or {}
    return dict(OmegaConf.to_container(kwargs) if OmegaConf.is_config(kwargs) else kwargs)


def cut_prompt(ids: list[int], max_length: int, truncation: str) -> list[int]:
    """`max_length` tokens of an overlong prompt as data.truncation says: left keeps the last ones, right the first
    ones, middle the first half and the last half (the odd one from the end), as verl's dataset does."""
    if truncation == Truncation.LEFT.value:
        return ids[-max_length:]
    if truncation == Truncation.MIDDLE.value:
        head = max_length // 2
        return list(ids[:head]) + list(ids[len(ids) - (max_length - head):])
    return ids[:max_length]


class RLDataset:
    """Prompt rows from verl-schema parquet files, chat template applied and tokenised up front.

    Overlong prompts (more than ``max_prompt_length`` tokens) are dropped (``filter_overlong_prompts=True``, count
    logged; None: when ``truncation`` is ``"error"``) or else handled by ``truncation``: ``"error"`` raises, ``"left"`` keeps the last tokens, ``"right"``
    keeps the first tokens, ``"middle"`` both ends; with ``render_ids`` (multi-turn with tools: the prompt with the
    tools described) the lengths are those of its ids. ``dataset[i]`` is a prompt item: ``input_ids``, ``ground_truth``, ``data_source`` (the
    value of the ``reward_fn_key`` column, which picks the reward function), ``index``, ``extra_info``.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
        filter_overlong_prompts: bool | None = None,
        reward_fn_key: str = "data_source",
        answers: bool = True,
        chat_template_kwargs: dict | None = None,
        render_ids: Callable[[list[dict]], list[int]] | None = None,
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}.")
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be a positive integer, got {max_prompt_length!r}.")
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        rows: list[dict[str, Any]] = []
        origins: list[tuple[Path, int]] = []
        for path in _as_path_list(paths):
            file_rows = read_parquet_rows([path])
            if file_rows:  # each file's columns: files of one set may differ
                missing = [key for key in (prompt_key, "reward_model")
                           if key not in file_rows[0] and (answers or key == prompt_key)]
                if reward_fn_key != "data_source" and reward_fn_key not in file_rows[0]:
                    missing.append(reward_fn_key)
                if missing:
                    raise MissingColumnError(
                        f"{path}: column(s) {missing} missing; columns are {sorted(file_rows[0])}. Set "
                        "data.prompt_key / data.reward_fn_key, or re-create the file with `rlanywhere prepare ...`."
                    )
            rows += file_rows
            origins += [(path, index) for index in range(len(file_rows))]
        if not rows:
            raise ValueError(f"No rows in {paths}.")
        check_rows(rows, origins, prompt_key, source_key=reward_fn_key, answers=answers)

        conversations = [_normalise_messages(row[prompt_key]) for row in rows]  # each row's, read once
        if render_ids is not None:  # multi-turn with tools: the prompt as the rollout sees it, tools described
            token_ids = [render_ids(messages) for messages in conversations]
        else:
            token_ids = self._tokenize([self.render_prompt(messages) for messages in conversations])

        filter_overlong_prompts = drops_overlong_prompts(filter_overlong_prompts, truncation)
        self.items: list[dict[str, Any]] = []
        self.num_filtered = 0
        self.num_truncated = 0  # prompts cut to max_prompt_length as `truncation` says
        for position, (row, ids) in enumerate(zip(rows, token_ids)):
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise ValueError(
                        f"{origins[position][0]}, row {origins[position][1]} (0-based): the prompt has {len(ids)} "
                        f"tokens > data.max_prompt_length="
                        f"{max_prompt_length}. Raise data.max_prompt_length, set data.filter_overlong_prompts=True, "
                        "or set data.truncation=left|right|middle."
                    )
                ids = cut_prompt(ids, max_prompt_length, truncation)
                self.num_truncated += 1
            extra_info = dict(row.get("extra_info") or {})
            index = extra_info.get("index")
            self.items.append(
                {
                    "input_ids": list(ids),
                    # as stored (a number, a list, a dict: verl passes it to the reward function unchanged)
                    "ground_truth": (row.get("reward_model") or {}).get("ground_truth"),
                    # data.reward_fn_key: the column whose value picks the reward function (verl's rule)
                    "data_source": str(row.get(reward_fn_key, "")),
                    # verl's extra_info.index as it is (a string id too); the row's position where there is none
                    "index": position if index is None or (isinstance(index, float) and math.isnan(index)) else index,
                    "extra_info": extra_info,
                    # the messages: a reward model re-templates them, multi-turn rollouts continue them
                    "raw_prompt": conversations[position],
                    # input_ids describe the tools (render_ids): the rollout starts from them as they are
                    **({"tools_in_input_ids": True} if render_ids is not None else {}),
                }
            )
        if self.num_filtered:
            logger.warning(
                "filtered %d of %d prompts longer than data.max_prompt_length=%d tokens",
                self.num_filtered,
                len(rows),
                max_prompt_length,
            )
        if not self.items:
            raise ValueError(
                f"All {len(rows)} prompts in {paths} are longer than data.max_prompt_length={max_prompt_length} "
                "tokens; raise data.max_prompt_length."
            )

    def render_prompt(self, prompt: Any) -> str:
        return render_prompt(self.tokenizer, prompt, self.chat_template_kwargs)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return tokenize_rendered(self.tokenizer, texts)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


def render_prompt(tokenizer, prompt: Any, chat_template_kwargs: dict | None = None) -> str:
    """The prompt text the model sees: chat template + generation prompt (with data.apply_chat_template_kwargs, e.g.
    Qwen3's enable_thinking), or without one every message's text in order (a system instruction and few-shot turns
    included), separated by blank lines."""
    messages = _normalise_messages(prompt)
    if _has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             **(chat_template_kwargs or {}))
    return "\n\n".join(str(m.get("content") or "") for m in messages)


def tokenize_rendered(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of rendered prompts, exactly as training sees them (RLDataset)."""
    # A chat template already writes any BOS it wants; plain text gets the tokenizer's own special tokens.
    encoded = tokenizer(texts, add_special_tokens=not _has_chat_template(tokenizer))["input_ids"]
    bos_token_id = getattr(tokenizer, "bos_token_id", None)
    return [_strip_repeated_bos(list(ids), bos_token_id) for ids in encoded]


# --------------------------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------------------------


class PromptLoader:
    """Endless batches of prompt items, epoch after epoch, resumable from ``state_dict()``.

    Epoch ``e`` visits the dataset in a permutation that depends only on ``(seed, e)`` (identity when not
    shuffling), so ``{epoch, position, seed}`` is all it takes to continue exactly where a run stopped.
    """

    def __init__(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch size must be a positive integer, got {batch_size!r}.")
        if batch_size > len(dataset):
            raise ValueError(
                f"batch size {batch_size} is larger than the dataset ({len(dataset)} prompts after filtering); "
                "lower data.train_batch_size / data.val_batch_size or use more data."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.steps_per_epoch = len(dataset) // batch_size if drop_last else math.ceil(len(dataset) / batch_size)
        self.epoch = 0
        self.position = 0  # batches already served in this epoch
        self._order_cache: tuple[int, np.ndarray] | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Dataset indices in the order epoch ``epoch`` visits them."""
        if self._order_cache is None or self._order_cache[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            else:
                order = np.arange(len(self.dataset))
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def next_batch(self) -> list[dict[str, Any]]:
        if self.position >= self.steps_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        indices = self.epoch_order(self.epoch)[start : start + self.batch_size]
        self.position += 1
        return [self.dataset[int(i)] for i in indices]

    def batches_drawn(self) -> int:
        """Batches handed out since the first epoch began (a resumed loader counts those before the checkpoint)."""
        return self.epoch * self.steps_per_epoch + self.position

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        position = int(state["position"])
        if not 0 <= position <= self.steps_per_epoch:
            raise ValueError(
                f"Loader state position {position} is outside 0..{self.steps_per_epoch} batches per epoch: the "
                "dataset or batch size changed since the checkpoint. Resume with the same data and batch size."
            )
        if int(state.get("seed", self.seed)) != self.seed:
            logger.warning("loader seed %s replaced by checkpoint seed %s", self.seed, state["seed"])
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state["epoch"])
        self.position = position
        self._order_cache = None


def iterate_in_batches(dataset, batch_size: int) -> Iterator[list[dict[str, Any]]]:
    """One ordered pass over ``dataset`` in batches (the last may be smaller): for validation."""
    if batch_size < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch_size!r}.")
    for start in range(0, len(dataset), batch_size):
        yield [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]


def collate_prompts(items: Sequence[dict[str, Any] | Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad prompt token ids to ``input_ids [B, P]`` (LongTensor) and ``attention_mask [B, P]`` (1 = token)."""
    if not items:
        raise ValueError("collate_prompts got an empty batch.")
    if pad_token_id is None:
        raise ValueError("collate_prompts needs a pad_token_id; set tokenizer.pad_token (e.g. to the EOS token).")
    sequences = [item["input_ids"] if isinstance(item, dict) else item for item in items]
    width = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), width), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, ids in enumerate(sequences):
        if len(ids) == 0:
            continue
        input_ids[row, width - len(ids) :] = torch.as_tensor(list(ids), dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask
