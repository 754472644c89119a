"""Datasets for RL post-training.

Three preparers write verl-schema parquet files (``train.parquet`` / ``test.parquet``):

* :func:`prepare_gsm8k` from a local ``train.jsonl``/``test.jsonl`` directory or a Hugging Face dataset name,
* :func:`prepare_arithmetic` a seeded synthetic arithmetic task (no download, good for smoke tests),
* :func:`prepare_generic` any jsonl/parquet file with a prompt column and an answer column.

Row schema: ``data_source: str``, ``prompt: [{"role", "content"}]``, ``ability: str``,
``reward_model: {"style": "rule", "ground_truth": str}``, ``extra_info: {"split", "index", "question", "answer"}``.

At training time :class:`RLDataset` applies the tokenizer's chat template to each prompt and
:class:`PromptLoader` serves batches of prompt items forever, epoch after epoch, in an order that depends only on
``(seed, epoch)`` so that its ``state_dict`` resumes a run exactly. :func:`collate_prompts` left-pads a batch.
"""

from __future__ import annotations

import ast
import itertools
import json
import logging
import math
import random
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .errors import UserError
from .vocabulary import Truncation

logger = logging.getLogger(__name__)


class DataError(UserError, ValueError):
    """A data file that cannot be used as it is; the message names the file (and row, column) and the fix."""


class MissingColumnError(DataError, KeyError):
    """A column the config names is not in the file (a KeyError too, as it always was)."""

    __str__ = DataError.__str__  # KeyError would print the message in quotes

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ARITHMETIC_INSTRUCTION = 'Output the final answer after "####".'
GSM8K_DATA_SOURCE = "openai/gsm8k"
ARITHMETIC_DATA_SOURCE = "arithmetic"
SPLITS = ("train", "test")
TRUNCATION_MODES = Truncation.values()
ARITHMETIC_OPERATORS = "+-*"


# --------------------------------------------------------------------------------------------------------------------
# Writing and reading verl-schema parquet
# --------------------------------------------------------------------------------------------------------------------


def make_row(
    *,
    data_source: str,
    messages: list[dict[str, str]],
    ground_truth: str,
    split: str,
    index: int,
    question: str,
    answer: str,
    ability: str,
) -> dict[str, Any]:
    """One row in verl's schema."""
    return {
        "data_source": data_source,
        "prompt": messages,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": str(ground_truth)},
        "extra_info": {"split": split, "index": int(index), "question": str(question), "answer": str(answer)},
    }


def _write_rows(rows: list[dict[str, Any]], path: Path) -> Path:
    if not rows:
        raise ValueError(f"No rows to write to {path}: the source split is empty.")
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary name first so an interrupted prepare never leaves a truncated parquet behind.
    tmp_path = path.with_suffix(path.suffix + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path)
    tmp_path.replace(path)
    return path


def _write_splits(rows_by_split: dict[str, list[dict[str, Any]]], out_dir: str | Path) -> dict[str, str]:
    out_dir = Path(out_dir)
    paths = {}
    for split, rows in rows_by_split.items():
        paths[split] = str(_write_rows(rows, out_dir / f"{split}.parquet"))
        logger.info("wrote %d rows to %s", len(rows), paths[split])
    return paths


def _as_path_list(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(paths, (str, Path)):
        text = str(paths).strip()
        # Config values like "['a.parquet', 'b.parquet']" arrive as one string from the command line.
        if text.startswith("[") and text.endswith("]"):
            return [Path(p) for p in ast.literal_eval(text)]
        return [Path(text)]
    return [Path(p) for p in paths]


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
               source_key: str = "data_source") -> None:
    """Every row needs a non-empty prompt, a `source_key` value (it picks the reward function) and
    reward_model.ground_truth; DataError names the file, row and column of the first bad row (and how many more)."""
    problems = []
    for row, (path, index) in zip(rows, origins):
        reward_model = row.get("reward_model")
        if not row.get(prompt_key):
            problem = f"column {prompt_key!r} is {'null' if row.get(prompt_key) is None else 'empty'}"
        elif row.get(source_key) is None:
            problem = f"column {source_key!r} is missing or null"
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


def _read_table_file(path: Path) -> list[dict[str, Any]]:
    """Rows of a .jsonl / .json-lines or .parquet file."""
    if not path.is_file():
        raise FileNotFoundError(f"Input file {path} does not exist.")
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix in (".jsonl", ".json"):
        if path.suffix == ".json":
            text = path.read_text(encoding="utf-8")
            if text.lstrip().startswith("["):  # a JSON array rather than JSON lines
                return json.loads(text)
        rows = []
        with path.open(encoding="utf-8") as handle:
            for line_number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(
                        f"{path}:{line_number} is not valid JSON ({error.msg}); expected one JSON object per line."
                    ) from None
        return rows
    raise ValueError(f"Unsupported file type {path.suffix!r} for {path}: use .jsonl or .parquet.")


# --------------------------------------------------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------------------------------------------------


def extract_gsm8k_answer(answer: str) -> str:
    """The number after the final ``####`` of a GSM8K solution, without thousands separators.

    Parsed by the reward's own strict extractor, so a ground truth is exactly what a correct response yields."""
    from .rewards import extract_gsm8k_answer as extract_number

    number = extract_number(answer, "strict")
    if number is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' marker: {answer[-80:]!r}")
    return number


# The first GSM8K training problem, its calculator annotations (<<48/2=24>>) removed: a short worked solution that
# ends in the "#### n" line. A 135M model mostly ignores the instruction alone; shown one finished exchange in the
# chat, it imitates the format (see gsm8k_rows(one_shot=True) and examples/gsm8k_format.yaml).
GSM8K_ONE_SHOT_QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                           "May. How many clips did Natalia sell altogether in April and May?")
GSM8K_ONE_SHOT_ANSWER = ("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April and "
                         "May.\n#### 72")


def gsm8k_messages(question: str, one_shot: bool = False) -> list[dict[str, str]]:
    """The chat prompt for one GSM8K question: verl's instruction, after one worked example when ``one_shot``."""
    example = [{"role": "user", "content": GSM8K_ONE_SHOT_QUESTION + " " + GSM8K_INSTRUCTION},
               {"role": "assistant", "content": GSM8K_ONE_SHOT_ANSWER}] if one_shot else []
    return example + [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}]


def gsm8k_rows(records: Sequence[dict[str, Any]], split: str, one_shot: bool = False) -> list[dict[str, Any]]:
    """verl-schema rows; with ``one_shot`` every prompt starts with the worked example, and the example's own
    question is left out (it would be a free reward)."""
    rows = []
    for index, record in enumerate(records):
        question, answer = record["question"], record["answer"]
        if one_shot and question.strip() == GSM8K_ONE_SHOT_QUESTION:
            continue
        rows.append(
            make_row(
                data_source=GSM8K_DATA_SOURCE,
                messages=gsm8k_messages(question, one_shot),
                ground_truth=extract_gsm8k_answer(answer),
                split=split,
                index=index,
                question=question,
                answer=answer,
                ability="math",
            )
        )
    return rows


def _load_gsm8k_hub(name: str) -> dict[str, list[dict[str, Any]]]:
    try:
        import datasets  # lazy: optional dependency, only needed for hub names
    except ImportError:
        raise ImportError(
            f"Loading {name!r} from the Hugging Face hub needs the `datasets` package: `pip install datasets`, "
            "or pass a local directory holding train.jsonl and test.jsonl instead."
        ) from None
    loaded = datasets.load_dataset(name, "main")
    return {split: list(loaded[split]) for split in SPLITS}


def prepare_gsm8k(src: str | Path, out_dir: str | Path, one_shot: bool = False) -> dict[str, str]:
    """Write GSM8K as ``out_dir/{train,test}.parquet``; returns ``{split: path}``.

    ``src`` is a directory with ``train.jsonl`` and ``test.jsonl`` (fields ``question``, ``answer``) or a Hugging
    Face dataset name such as ``openai/gsm8k``. ``one_shot``: each prompt opens with one worked example that ends
    in ``#### n`` (:func:`gsm8k_messages`), for small models that ignore the instruction alone.
    """
    src_path = Path(src).expanduser()
    if src_path.is_dir():
        records = {}
        for split in SPLITS:
            file = src_path / f"{split}.jsonl"
            if not file.is_file():
                raise FileNotFoundError(f"{src_path} has no {split}.jsonl; GSM8K needs train.jsonl and test.jsonl.")
            records[split] = _read_table_file(file)
    elif src_path.exists() or str(src).startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"{src} is not a directory. Pass a directory holding train.jsonl and test.jsonl, "
            "or a Hugging Face dataset name such as openai/gsm8k."
        )
    else:
        records = _load_gsm8k_hub(str(src))
    return _write_splits({split: gsm8k_rows(records[split], split, one_shot) for split in SPLITS}, out_dir)


# --------------------------------------------------------------------------------------------------------------------
# Synthetic arithmetic
# --------------------------------------------------------------------------------------------------------------------


def evaluate_arithmetic(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Value of ``operands[0] op operands[1] op ...`` with ``*`` binding tighter than ``+``/``-``."""
    terms: list[int] = []  # signed products, summed at the end
    signs: list[int] = [1]
    product = operands[0]
    for operator, operand in zip(operators, operands[1:]):
        if operator == "*":
            product *= operand
            continue
        terms.append(signs[-1] * product)
        signs.append(1 if operator == "+" else -1)
        product = operand
    terms.append(signs[-1] * product)
    return sum(terms)


def _format_expression(operands: Sequence[int], operators: Sequence[str]) -> str:
    parts = [str(operands[0])]
    for operator, operand in zip(operators, operands[1:]):
        parts += [operator, str(operand)]
    return " ".join(parts)


def _validate_arithmetic_knobs(train_size, test_size, digits, operators, num_operands) -> str:
    for name, value, minimum in (
        ("train_size", train_size, 1),
        ("test_size", test_size, 0),
        ("digits", digits, 1),
        ("num_operands", num_operands, 2),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"prepare_arithmetic: {name} must be an integer >= {minimum}, got {value!r}.")
    if digits > 18:
        raise ValueError(f"prepare_arithmetic: digits={digits} is too large; use at most 18.")
    if not isinstance(operators, str) or not operators:
        raise ValueError(f"prepare_arithmetic: operators must be a non-empty string drawn from {ARITHMETIC_OPERATORS!r}.")
    unknown = sorted(set(operators) - set(ARITHMETIC_OPERATORS))
    if unknown:
        raise ValueError(
            f"prepare_arithmetic: unsupported operator(s) {unknown}; choose from {ARITHMETIC_OPERATORS!r}, e.g. '+-'."
        )
    return "".join(sorted(set(operators), key=ARITHMETIC_OPERATORS.index))


def prepare_arithmetic(
    out_dir: str | Path,
    train_size: int = 2000,
    test_size: int = 200,
    digits: int = 2,
    operators: str = "+",
    num_operands: int = 2,
    seed: int = 0,
) -> dict[str, str]:
    """Write a synthetic arithmetic task as ``out_dir/{train,test}.parquet``; returns ``{split: path}``.

    Each question combines ``num_operands`` integers of 1..``digits`` digits (at least one with exactly ``digits``
    digits) with operators drawn from ``operators`` (a subset of ``"+-*"``; usual precedence). Questions are unique
    across both splits, so test questions never appear in training. The same arguments always give the same files.
    """
    operator_set = _validate_arithmetic_knobs(train_size, test_size, digits, operators, num_operands)
    low_full = 10 ** (digits - 1) if digits > 1 else 0  # smallest operand with exactly `digits` digits
    high = 10**digits  # operands are in [0, high)
    operand_space = high**num_operands - (low_full**num_operands if digits > 1 else 0)
    capacity = operand_space * len(operator_set) ** (num_operands - 1)
    needed = train_size + test_size
    if needed > capacity:
        raise ValueError(
            f"prepare_arithmetic: only {capacity} distinct questions exist for digits={digits}, "
            f"num_operands={num_operands}, operators={operator_set!r}, but train_size+test_size={needed}. "
            "Increase digits / num_operands / operators or ask for fewer examples."
        )

    rng = random.Random(seed)

    def has_full_width(operands: Sequence[int]) -> bool:
        return digits == 1 or max(operands) >= low_full

    if 2 * needed >= capacity:
        # Dense request: enumerate the whole space and take a seeded sample (rejection sampling would crawl).
        space = [
            (operands, ops)
            for operands in itertools.product(range(high), repeat=num_operands)
            if has_full_width(operands)
            for ops in itertools.product(operator_set, repeat=num_operands - 1)
        ]
        questions = rng.sample(space, needed)
    else:
        seen: set[tuple] = set()
        questions = []
        while len(questions) < needed:
            operands = tuple(rng.randrange(high) for _ in range(num_operands))
            if not has_full_width(operands):
                continue
            ops = tuple(rng.choice(operator_set) for _ in range(num_operands - 1))
            if (operands, ops) in seen:
                continue
            seen.add((operands, ops))
            questions.append((operands, ops))

    rows_by_split: dict[str, list[dict[str, Any]]] = {"train": [], "test": []}
    for position, (operands, ops) in enumerate(questions):
        split = "train" if position < train_size else "test"
        index = len(rows_by_split[split])
        expression = _format_expression(operands, ops)
        answer = str(evaluate_arithmetic(operands, ops))
        question = f"What is {expression}?"
        rows_by_split[split].append(
            make_row(
                data_source=ARITHMETIC_DATA_SOURCE,
                messages=[{"role": "user", "content": f"{question} {ARITHMETIC_INSTRUCTION}"}],
                ground_truth=answer,
                split=split,
                index=index,
                question=question,
                answer=answer,
                ability="math",
            )
        )
    if test_size == 0:
        del rows_by_split["test"]
    return _write_splits(rows_by_split, out_dir)


# --------------------------------------------------------------------------------------------------------------------
# Generic prompt/answer files
# --------------------------------------------------------------------------------------------------------------------


def _lookup(record: dict[str, Any], dotted_key: str, source: Path) -> Any:
    """``record["a"]["b"]`` for ``"a.b"``; a literal key containing dots wins."""
    if dotted_key in record:
        return record[dotted_key]
    value: Any = record
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(
                f"{source}: column {dotted_key!r} not found; available columns: {sorted(record)}. "
                "Set prompt_key / answer_key to the right column names."
            )
        value = value[part]
    return value


def _to_messages(prompt: Any, instruction: str | None, source: Path) -> tuple[list[dict[str, str]], str]:
    """Normalise a prompt (text or list of chat messages) to messages; returns (messages, question text)."""
    suffix = f" {instruction}" if instruction else ""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt + suffix}], prompt
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
        user_turns = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not user_turns:
            raise ValueError(f"{source}: a prompt has no user message: {prompt!r}")
        question = messages[user_turns[-1]]["content"]
        messages[user_turns[-1]]["content"] = question + suffix
        return messages, question
    raise ValueError(f"{source}: a prompt must be a string or a list of {{role, content}} messages, got {prompt!r}.")


def _generic_rows(records, split, prompt_key, answer_key, data_source, instruction, ability, source):
    rows = []
    for index, record in enumerate(records):
        messages, question = _to_messages(_lookup(record, prompt_key, source), instruction, source)
        answer = _lookup(record, answer_key, source)
        if isinstance(answer, dict) and "ground_truth" in answer:  # a verl reward_model column
            answer = answer["ground_truth"]
        rows.append(
            make_row(
                data_source=data_source,
                messages=messages,
                ground_truth=str(answer).strip(),
                split=split,
                index=index,
                question=question,
                answer=str(answer),
                ability=ability,
            )
        )
    return rows


def _find_split_file(directory: Path, split: str) -> Path | None:
    for suffix in (".jsonl", ".parquet", ".json"):
        candidate = directory / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def prepare_generic(
    src: str | Path,
    out_dir: str | Path,
    prompt_key: str,
    answer_key: str,
    data_source: str = "generic",
    instruction: str | None = None,
    test_src: str | Path | None = None,
    test_ratio: float = 0.1,
    seed: int = 0,
    ability: str = "general",
) -> dict[str, str]:
    """Convert any jsonl/parquet with a prompt column and an answer column to ``out_dir/{train,test}.parquet``.

    ``src`` is a file, or a directory holding ``train.{jsonl,parquet}`` and ``test.{jsonl,parquet}``. With a single
    file and no ``test_src``, a seeded ``test_ratio`` share of rows becomes the test split. The prompt column may be
    text or a list of chat messages; ``instruction`` is appended to the (last) user message. Keys may be dotted
    (``reward_model.ground_truth``). ``data_source`` picks the reward function at training time.
    """
    src_path = Path(src).expanduser()
    if src_path.is_dir():
        train_file, test_file = _find_split_file(src_path, "train"), _find_split_file(src_path, "test")
        if train_file is None:
            raise FileNotFoundError(f"{src_path} has no train.jsonl or train.parquet.")
        if test_src is not None:
            test_file = Path(test_src).expanduser()
        if test_file is None:
            raise FileNotFoundError(
                f"{src_path} has no test.jsonl or test.parquet; add one or pass test_src=FILE."
            )
        records = {"train": _read_table_file(train_file), "test": _read_table_file(test_file)}
        sources = {"train": train_file, "test": test_file}
    elif test_src is not None:
        test_file = Path(test_src).expanduser()
        records = {"train": _read_table_file(src_path), "test": _read_table_file(test_file)}
        sources = {"train": src_path, "test": test_file}
    else:
        if not 0.0 < test_ratio < 1.0:
            raise ValueError(f"test_ratio must be in (0, 1), got {test_ratio}; or pass test_src=FILE.")
        all_records = _read_table_file(src_path)
        if len(all_records) < 2:
            raise ValueError(f"{src_path} has {len(all_records)} row(s); at least 2 are needed to split train/test.")
        order = list(range(len(all_records)))
        random.Random(seed).shuffle(order)
        test_count = min(len(order) - 1, max(1, round(len(order) * test_ratio)))
        test_ids = set(order[:test_count])
        records = {
            "train": [r for i, r in enumerate(all_records) if i not in test_ids],
            "test": [r for i, r in enumerate(all_records) if i in test_ids],
        }
        sources = {"train": src_path, "test": src_path}
    rows_by_split = {
        split: _generic_rows(
            records[split], split, prompt_key, answer_key, data_source, instruction, ability, sources[split]
        )
        for split in SPLITS
    }
    return _write_splits(rows_by_split, out_dir)


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


def _normalise_messages(prompt: Any) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


class RLDataset:
    """Prompt rows from verl-schema parquet files, chat template applied and tokenised up front.

    Overlong prompts (more than ``max_prompt_length`` tokens) are dropped (``filter_overlong_prompts=True``, count
    logged) or else handled by ``truncation``: ``"error"`` raises, ``"left"`` keeps the last tokens, ``"right"``
    keeps the first tokens. ``dataset[i]`` is a prompt item: ``input_ids``, ``ground_truth``, ``data_source`` (the
    value of the ``reward_fn_key`` column, which picks the reward function), ``index``, ``extra_info``.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        truncation: str = "error",
        filter_overlong_prompts: bool = True,
        reward_fn_key: str = "data_source",
    ):
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}.")
        if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
            raise ValueError(f"data.max_prompt_length must be a positive integer, got {max_prompt_length!r}.")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        rows: list[dict[str, Any]] = []
        origins: list[tuple[Path, int]] = []
        for path in _as_path_list(paths):
            file_rows = read_parquet_rows([path])
            rows += file_rows
            origins += [(path, index) for index in range(len(file_rows))]
        if not rows:
            raise ValueError(f"No rows in {paths}.")
        missing = [key for key in (prompt_key, "reward_model") if key not in rows[0]]
        if reward_fn_key != "data_source" and reward_fn_key not in rows[0]:
            missing.append(reward_fn_key)
        if missing:
            raise MissingColumnError(
                f"{paths}: column(s) {missing} missing; columns are {sorted(rows[0])}. "
                "Set data.prompt_key / data.reward_fn_key, or re-create the files with `rlanywhere prepare ...`."
            )
        check_rows(rows, origins, prompt_key, source_key=reward_fn_key)

        texts = [self.render_prompt(row[prompt_key]) for row in rows]
        token_ids = self._tokenize(texts)

        self.items: list[dict[str, Any]] = []
        self.num_filtered = 0
        for position, (row, ids) in enumerate(zip(rows, token_ids)):
            if len(ids) > max_prompt_length:
                if filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if truncation == "error":
                    raise ValueError(
                        f"Prompt {position} of {paths} has {len(ids)} tokens > data.max_prompt_length="
                        f"{max_prompt_length}. Raise data.max_prompt_length, set data.filter_overlong_prompts=True, "
                        "or set data.truncation=left|right."
                    )
                ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
            extra_info = dict(row.get("extra_info") or {})
            self.items.append(
                {
                    "input_ids": list(ids),
                    "ground_truth": str(row["reward_model"]["ground_truth"]),
                    # data.reward_fn_key: the column whose value picks the reward function (verl's rule)
                    "data_source": str(row.get(reward_fn_key, "")),
                    "index": int(extra_info.get("index", position)),
                    "extra_info": extra_info,
                    "raw_prompt": _normalise_messages(row[prompt_key]),  # verl's return_raw_chat (multi-turn)
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
        return render_prompt(self.tokenizer, prompt)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        return tokenize_rendered(self.tokenizer, texts)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


def render_prompt(tokenizer, prompt: Any) -> str:
    """The prompt text the model sees: chat template + generation prompt, or plain user text without one."""
    messages = _normalise_messages(prompt)
    if _has_chat_template(tokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n\n".join(m["content"] for m in messages if m["role"] == "user")


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
