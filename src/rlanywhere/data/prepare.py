"""Offline data preparation (`rlanywhere prepare`): writes verl-schema parquet files (``train.parquet`` /
``test.parquet``) that training reads with `data/loader.py`.

* :func:`prepare_gsm8k` from a local ``train.jsonl``/``test.jsonl`` directory or a Hugging Face dataset name,
* :func:`prepare_arithmetic` a seeded synthetic arithmetic task (no download, good for smoke tests),
* :func:`prepare_generic` any jsonl/parquet file with a prompt column and an answer column.

Row schema (`make_row`): ``data_source: str``, ``prompt: [{"role", "content"}]``, ``ability: str``,
``reward_model: {"style": "rule", "ground_truth": str}``, ``extra_info: {"split", "index", "question", "answer"}``.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import UserError

logger = logging.getLogger(__name__)


GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# What the arithmetic reward reads (rewards.arithmetic_score): the last number of the reply (or one after "####")
ARITHMETIC_INSTRUCTION = 'Output the final answer after "####".'
GSM8K_DATA_SOURCE = "openai/gsm8k"
ARITHMETIC_DATA_SOURCE = "arithmetic"
SPLITS = ("train", "test")
ARITHMETIC_OPERATORS = "+-*"


# --------------------------------------------------------------------------------------------------------------------
# Writing verl-schema parquet, reading a source file
# --------------------------------------------------------------------------------------------------------------------


class PrepareError(UserError, ValueError):
    """A source file or an argument `rlanywhere prepare` cannot use; the message names it and the fix."""


class PrepareColumnError(PrepareError, KeyError):
    """A column named by prompt_key / answer_key is not in the source file."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0]) if self.args else ""


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
        raise PrepareError(f"No rows to write to {path}: the source split is empty.")
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
                    raise PrepareError(
                        f"{path}:{line_number} is not valid JSON ({error.msg}); expected one JSON object per line."
                    ) from None
        return rows
    raise PrepareError(f"Unsupported file type {path.suffix!r} for {path}: use .jsonl or .parquet.")


# --------------------------------------------------------------------------------------------------------------------
# GSM8K
# --------------------------------------------------------------------------------------------------------------------


def extract_gsm8k_answer(answer: str) -> str:
    """The number after the final ``####`` of a GSM8K solution, without thousands separators.

    Parsed by the reward's own strict extractor, so a ground truth is exactly what a correct response yields."""
    from ..rewards import extract_gsm8k_answer as extract_number

    number = extract_number(answer, "strict")
    if number is None:
        raise PrepareError(f"GSM8K answer has no '#### <number>' marker: {answer[-80:]!r}")
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
    elif src_path.exists() or str(src).startswith((".", "/", "~")) or str(src).count("/") != 1 or \
            src_path.parent.is_dir():  # a hub name is ORG/NAME; a path whose folder is here is a local one
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
            raise PrepareError(f"prepare_arithmetic: {name} must be an integer >= {minimum}, got {value!r}.")
    if digits > 18:
        raise PrepareError(f"prepare_arithmetic: digits={digits} is too large; use at most 18.")
    if not isinstance(operators, str) or not operators:
        raise PrepareError(f"prepare_arithmetic: operators must be a non-empty string drawn from {ARITHMETIC_OPERATORS!r}.")
    unknown = sorted(set(operators) - set(ARITHMETIC_OPERATORS))
    if unknown:
        raise PrepareError(
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
        raise PrepareError(
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
            raise PrepareColumnError(
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
            raise PrepareError(f"{source}: a prompt has no user message: {prompt!r}")
        question = messages[user_turns[-1]]["content"]
        messages[user_turns[-1]]["content"] = question + suffix
        return messages, question
    raise PrepareError(f"{source}: a prompt must be a string or a list of {{role, content}} messages, got {prompt!r}.")


def _generic_rows(records, split, prompt_key, answer_key, data_source, instruction, ability, source):
    rows = []
    for index, record in enumerate(records):
        messages, question = _to_messages(_lookup(record, prompt_key, source), instruction, source)
        answer = _lookup(record, answer_key, source)
        if isinstance(answer, dict) and "ground_truth" in answer:  # a verl reward_model column
            answer = answer["ground_truth"]
        if answer is None or isinstance(answer, (list, tuple, dict)) or not str(answer).strip():
            # str() would store 'None' or "['5', 'five']" as the answer: a row no response could score on
            raise PrepareError(f"{source}: record {index} has {answer_key}={answer!r}; each record needs one answer "
                               "as text or a number (fix or drop that record, or point answer_key at another column)")
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
            raise PrepareError(f"test_ratio must be in (0, 1), got {test_ratio}; or pass test_src=FILE.")
        all_records = _read_table_file(src_path)
        if len(all_records) < 2:
            raise PrepareError(f"{src_path} has {len(all_records)} row(s); at least 2 are needed to split train/test.")
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
