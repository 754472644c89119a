"""Tests for rlanywhere.data: preparers, RLDataset, PromptLoader, collate_prompts."""

import json
import logging
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from rlanywhere import data
from rlanywhere.data import (
    GSM8K_INSTRUCTION,
    PromptLoader,
    RLDataset,
    collate_prompts,
    iterate_in_batches,
    prepare_arithmetic,
    prepare_generic,
    prepare_gsm8k,
    read_parquet_rows,
)
from rlanywhere.data.loader import DataError, MissingColumnError
from rlanywhere.data.prepare import PrepareError

from .conftest import GSM8K_DIR



# ---------------------------------------------------------------------------------------------------------------
# Tiny offline tokenizer
# ---------------------------------------------------------------------------------------------------------------

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
WORDS = "what is ? output the final answer after #### + - * a b c d e".split() + [str(i) for i in range(200)]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer(chat_template=CHAT_TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # The tokenizer adds BOS by itself (like Llama's), so a template that also writes BOS could double it.
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def write_prompt_parquet(path, contents, data_source="test"):
    rows = [
        data.make_row(
            data_source=data_source,
            messages=[{"role": "user", "content": content}],
            ground_truth=str(i * 10),
            split="train",
            index=i,
            question=content,
            answer=str(i * 10),
            ability="math",
        )
        for i, content in enumerate(contents)
    ]
    data.prepare._write_rows(rows, Path(path))
    return str(path)


def vocab_ids(tokenizer, text):
    return [tokenizer.convert_tokens_to_ids(t) for t in text.split()]


# ---------------------------------------------------------------------------------------------------------------
# GSM8K
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def gsm8k_subset(tmp_path):
    """First 50 train rows plus the row answering '1,080' (row 345 of the full split), first 20 test rows."""
    src = tmp_path / "gsm8k_src"
    src.mkdir()
    train_lines = (GSM8K_DIR / "train.jsonl").read_text().splitlines()
    test_lines = (GSM8K_DIR / "test.jsonl").read_text().splitlines()
    thousands = next(line for line in train_lines if line.endswith('#### 1,080"}'))
    (src / "train.jsonl").write_text("\n".join(train_lines[:50] + [thousands]) + "\n")
    (src / "test.jsonl").write_text("\n".join(test_lines[:20]) + "\n")
    return src


def test_prepare_gsm8k_rows_schema_and_ground_truth(gsm8k_subset, tmp_path):
    out = tmp_path / "out"
    paths = prepare_gsm8k(gsm8k_subset, out)
    assert paths == {"train": str(out / "train.parquet"), "test": str(out / "test.parquet")}
    train, test = read_parquet_rows(paths["train"]), read_parquet_rows(paths["test"])
    assert (len(train), len(test)) == (51, 20)

    first_source = json.loads((gsm8k_subset / "train.jsonl").read_text().splitlines()[0])
    row = train[0]
    assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert row["data_source"] == "openai/gsm8k"
    assert row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": first_source["question"] + " " + GSM8K_INSTRUCTION}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": "72"}  # "... #### 72"
    assert row["extra_info"] == {
        "split": "train",
        "index": 0,
        "question": first_source["question"],
        "answer": first_source["answer"],
    }
    assert train[50]["reward_model"]["ground_truth"] == "1080"  # "#### 1,080": commas removed
    assert test[0]["reward_model"]["ground_truth"] == "18"  # Janet's ducks
    assert test[19]["extra_info"]["split"] == "test" and test[19]["extra_info"]["index"] == 19

    schema = pq.read_schema(paths["train"])
    assert str(schema.field("prompt").type) == "list<element: struct<role: string, content: string>>"


def test_prepare_gsm8k_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        (tmp_path / "only_train").mkdir()
        (tmp_path / "only_train" / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
        prepare_gsm8k(tmp_path / "only_train", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        prepare_gsm8k(str(tmp_path / "missing_dir"), tmp_path / "out")


def test_prepare_gsm8k_hub_name_without_datasets(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(ImportError, match="pip install datasets"):
        prepare_gsm8k("openai/gsm8k", tmp_path / "out")


def test_extract_gsm8k_answer():
    assert data.extract_gsm8k_answer("so 3+4=7\n#### 7") == "7"
    assert data.extract_gsm8k_answer("#### -1,234 ") == "-1234"
    with pytest.raises(ValueError, match="####"):
        data.extract_gsm8k_answer("no marker here")


def test_read_parquet_rows_missing_file_names_prepare(tmp_path):
    with pytest.raises(FileNotFoundError, match="rlanywhere prepare"):
        read_parquet_rows(str(tmp_path / "nope.parquet"))


# ---------------------------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------------------------


def _expression(row):
    question = row["extra_info"]["question"]
    assert question.startswith("What is ") and question.endswith("?")
    return question[len("What is ") : -1]


def test_arithmetic_deterministic_correct_and_disjoint(tmp_path):
    kwargs = dict(train_size=300, test_size=60, digits=2, operators="+-*", num_operands=3, seed=7)
    paths_a = prepare_arithmetic(tmp_path / "a", **kwargs)
    paths_b = prepare_arithmetic(tmp_path / "b", **kwargs)
    for split in ("train", "test"):
        assert read_parquet_rows(paths_a[split]) == read_parquet_rows(paths_b[split])
    other_seed = read_parquet_rows(prepare_arithmetic(tmp_path / "c", **{**kwargs, "seed": 8})["train"])
    assert other_seed != read_parquet_rows(paths_a["train"])

    train, test = read_parquet_rows(paths_a["train"]), read_parquet_rows(paths_a["test"])
    assert (len(train), len(test)) == (300, 60)
    expressions = [_expression(row) for row in train + test]
    assert len(set(expressions)) == 360  # unique, so train and test never share a question
    assert not {_expression(r) for r in train} & {_expression(r) for r in test}
    seen_operators = set()
    for row in train + test:
        expression = _expression(row)
        tokens = expression.split(" ")
        operands, operators = tokens[0::2], tokens[1::2]
        assert len(operands) == 3 and all(0 <= int(x) <= 99 for x in operands)
        assert any(len(x) == 2 for x in operands)
        seen_operators |= set(operators)
        assert row["reward_model"]["ground_truth"] == str(eval(expression))  # independent reference
        assert row["data_source"] == "arithmetic"
        assert row["prompt"][0]["content"] == f'What is {expression}? Output the final answer after "####".'
    assert seen_operators == {"+", "-", "*"}


def test_arithmetic_dense_space_is_enumerated_without_overlap(tmp_path):
    # 1-digit a+b has exactly 100 questions; ask for all of them.
    paths = prepare_arithmetic(tmp_path, train_size=90, test_size=10, digits=1, operators="+")
    rows = read_parquet_rows(paths["train"]) + read_parquet_rows(paths["test"])
    expressions = {_expression(r) for r in rows}
    assert expressions == {f"{a} + {b}" for a in range(10) for b in range(10)}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(operators="/"), "unsupported operator"),
        (dict(operators=""), "non-empty"),
        (dict(digits=0), "digits"),
        (dict(num_operands=1), "num_operands"),
        (dict(train_size=0), "train_size"),
        (dict(digits=1, train_size=95, test_size=10), "distinct questions"),
    ],
)
def test_arithmetic_validates_knobs(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        prepare_arithmetic(tmp_path, **kwargs)


def test_evaluate_arithmetic_precedence():
    assert data.evaluate_arithmetic([2, 3, 4], ["+", "*"]) == 14
    assert data.evaluate_arithmetic([2, 3, 4, 5], ["*", "-", "*"]) == -14
    assert data.evaluate_arithmetic([10, 3, 2], ["-", "-"]) == 5


# ---------------------------------------------------------------------------------------------------------------
# Generic
# ---------------------------------------------------------------------------------------------------------------


def test_prepare_generic_split_ratio_and_instruction(tmp_path):
    src = tmp_path / "qa.jsonl"
    src.write_text("".join(json.dumps({"q": f"question {i}", "meta": {"a": i}}) + "\n" for i in range(20)))
    paths = prepare_generic(
        src, tmp_path / "out", prompt_key="q", answer_key="meta.a", data_source="mine", instruction="Be brief.",
        test_ratio=0.25,
    )
    train, test = read_parquet_rows(paths["train"]), read_parquet_rows(paths["test"])
    assert (len(train), len(test)) == (15, 5)
    questions = [r["extra_info"]["question"] for r in train + test]
    assert sorted(questions) == sorted(f"question {i}" for i in range(20))
    for row in train + test:
        number = int(row["extra_info"]["question"].split()[-1])
        assert row["reward_model"]["ground_truth"] == str(number)
        assert row["prompt"] == [{"role": "user", "content": f"question {number} Be brief."}]
        assert row["data_source"] == "mine"


def test_prepare_generic_separate_files_and_bad_key(tmp_path):
    train_file, test_file = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train_file.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": 1}) + "\n")
    test_file.write_text(json.dumps({"prompt": "yo", "answer": 2}) + "\n")
    paths = prepare_generic(train_file, tmp_path / "out", "prompt", "answer", test_src=test_file)
    assert read_parquet_rows(paths["train"])[0]["prompt"] == [{"role": "user", "content": "hi"}]
    assert read_parquet_rows(paths["test"])[0]["reward_model"]["ground_truth"] == "2"
    # a directory with train/test files works the same way
    paths_dir = prepare_generic(tmp_path, tmp_path / "out2", "prompt", "answer")
    assert read_parquet_rows(paths_dir["test"]) == read_parquet_rows(paths["test"])
    with pytest.raises(KeyError, match="question"):
        prepare_generic(train_file, tmp_path / "out3", "question", "answer", test_src=test_file)
    # an answer that is missing or a list would be stored as the text 'None' / "['5', 'five']": refused, named
    for bad in (None, ["5", "five"], " "):
        test_file.write_text(json.dumps({"prompt": "yo", "answer": bad}) + "\n")
        with pytest.raises(PrepareError, match="record 0 has answer="):
            prepare_generic(train_file, tmp_path / "out4", "prompt", "answer", test_src=test_file)


# ---------------------------------------------------------------------------------------------------------------
# RLDataset
# ---------------------------------------------------------------------------------------------------------------


def test_rldataset_applies_template_once_with_single_bos(tmp_path):
    tokenizer = make_tokenizer()
    path = write_prompt_parquet(tmp_path / "p.parquet", ["what is 1 + 2 ?", "what is 3 * 4 ?"])
    dataset = RLDataset(path, tokenizer, max_prompt_length=32)
    assert len(dataset) == 2
    item = dataset[1]
    expected = vocab_ids(tokenizer, "<s> <|user|> what is 3 * 4 ? <|assistant|>")
    assert item["input_ids"] == expected
    assert item["ground_truth"] == "10"
    assert item["data_source"] == "test"
    assert item["index"] == 1
    assert item["extra_info"]["question"] == "what is 3 * 4 ?"


def test_rldataset_without_chat_template_uses_plain_text(tmp_path):
    tokenizer = make_tokenizer(chat_template=None)
    path = write_prompt_parquet(tmp_path / "p.parquet", ["what is 5 + 6 ?"])
    dataset = RLDataset(path, tokenizer, max_prompt_length=32)
    assert dataset[0]["input_ids"] == vocab_ids(tokenizer, "<s> what is 5 + 6 ?")


def test_rldataset_overlong_filter_and_truncation(tmp_path, caplog):
    tokenizer = make_tokenizer()
    short, long_ = "a b", "a b c d e 1 2 3"  # templated: 5 and 11 tokens
    path = write_prompt_parquet(tmp_path / "p.parquet", [short, long_, short])
    with caplog.at_level(logging.WARNING, logger="rlanywhere.data"):
        filtered = RLDataset(path, tokenizer, max_prompt_length=8, filter_overlong_prompts=True)
    assert [item["index"] for item in filtered.items] == [0, 2]
    assert filtered.num_filtered == 1
    assert "filtered 1 of 3" in caplog.text

    with pytest.raises(ValueError, match="max_prompt_length"):
        RLDataset(path, tokenizer, max_prompt_length=8, filter_overlong_prompts=False, truncation="error")
    full = vocab_ids(tokenizer, f"<s> <|user|> {long_} <|assistant|>")
    left = RLDataset(path, tokenizer, max_prompt_length=8, filter_overlong_prompts=False, truncation="left")
    right = RLDataset(path, tokenizer, max_prompt_length=8, filter_overlong_prompts=False, truncation="right")
    assert left[1]["input_ids"] == full[-8:]
    assert right[1]["input_ids"] == full[:8]
    middle = RLDataset(path, tokenizer, max_prompt_length=7, filter_overlong_prompts=False, truncation="middle")
    assert len(full) == 11 and middle[1]["input_ids"] == full[:3] + full[-4:]  # 7 // 2 first, the other 4 last
    assert left[0]["input_ids"] == vocab_ids(tokenizer, f"<s> <|user|> {short} <|assistant|>")
    with pytest.raises(ValueError, match="truncation"):
        RLDataset(path, tokenizer, max_prompt_length=8, truncation="middle-out")


# ---------------------------------------------------------------------------------------------------------------
# PromptLoader and collate
# ---------------------------------------------------------------------------------------------------------------


class ListDataset:
    def __init__(self, n):
        self.items = [{"index": i, "input_ids": [i + 1]} for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _indices(batch):
    return [item["index"] for item in batch]


def test_loader_epochs_are_permutations():
    loader = PromptLoader(ListDataset(10), batch_size=3, seed=1)
    assert loader.steps_per_epoch == 3
    epoch0 = sum((_indices(loader.next_batch()) for _ in range(3)), [])
    assert loader.epoch == 0 and loader.position == 3
    epoch1 = sum((_indices(loader.next_batch()) for _ in range(3)), [])
    assert loader.epoch == 1
    assert len(set(epoch0)) == 9 and len(set(epoch1)) == 9  # no repeats inside an epoch, last item dropped
    assert epoch0 != epoch1

    ordered = PromptLoader(ListDataset(5), batch_size=2, shuffle=False, drop_last=False)
    assert [_indices(ordered.next_batch()) for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]


@pytest.mark.parametrize("served", [0, 2, 3, 7])
def test_loader_resume_matches_uninterrupted(served):
    original = PromptLoader(ListDataset(11), batch_size=3, seed=5)
    for _ in range(served):
        original.next_batch()
    state = original.state_dict()
    assert set(state) == {"epoch", "position", "seed"}
    resumed = PromptLoader(ListDataset(11), batch_size=3, seed=999)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as stored in a checkpoint
    for _ in range(8):
        assert _indices(resumed.next_batch()) == _indices(original.next_batch())


def test_loader_rejects_batch_larger_than_dataset():
    with pytest.raises(ValueError, match="larger than the dataset"):
        PromptLoader(ListDataset(4), batch_size=5)


def test_iterate_in_batches_covers_dataset_once():
    assert [_indices(b) for b in iterate_in_batches(ListDataset(5), 2)] == [[0, 1], [2, 3], [4]]


def test_collate_prompts_left_pads():
    input_ids, mask = collate_prompts([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}], pad_token_id=0)
    assert input_ids.dtype == torch.long
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="empty"):
        collate_prompts([], pad_token_id=0)


def test_validation_size_reads_val_max_samples_as_verl():
    from rlanywhere.validation import validation_size

    assert validation_size(20, 5) == 5 and validation_size(3, 5) == 3
    assert validation_size(20, -1) == validation_size(20, 0) == validation_size(20, None) == 20  # <= 0: all


def _parquet_of_prompts(path, prompts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": p, "data_source": "test", "reward_model": {"ground_truth": "1"}}
                                         for p in prompts]), path)
    return path


def test_rldataset_prompt_forms_verl_data_holds(tmp_path):
    tokenizer = make_tokenizer(  # writes "+" after a turn with tool calls, "a" after the header with think=True
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
        "{% if m['tool_calls'] %}+ {% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% if think %} a{% endif %}{% endif %}")
    few_shot = [{"role": "user", "content": "1 + 1 ?"},
                {"role": "assistant", "content": "2", "tool_calls": [{"name": "calc"}]},
                {"role": "user", "content": "2 + 2 ?"}]
    path = [_parquet_of_prompts(tmp_path / "j.parquet", [json.dumps([{"role": "user", "content": "what is 3 ?"}])]),
            _parquet_of_prompts(tmp_path / "m.parquet", [few_shot])]
    dataset = RLDataset(path, tokenizer, max_prompt_length=64, chat_template_kwargs={"think": True})
    # a prompt stored as JSON text is its messages, not their JSON spelling
    assert dataset[0]["raw_prompt"] == [{"role": "user", "content": "what is 3 ?"}]
    assert tokenizer.decode(dataset[0]["input_ids"]) == "<s> <|user|> what is 3 ? <|assistant|> a"
    # a message keeps its other fields (tool_calls), which the template renders; the template's kwargs reach it
    assert dataset[1]["raw_prompt"][1]["tool_calls"] == [{"name": "calc"}]
    assert tokenizer.decode(dataset[1]["input_ids"]).startswith("<s> <|user|> 1 + 1 ? <|assistant|> 2 + <|user|>")
    assert tokenizer.decode(dataset[1]["input_ids"]).endswith("<|assistant|> a")
    plain = RLDataset(path, tokenizer, max_prompt_length=64)
    assert not tokenizer.decode(plain[0]["input_ids"]).endswith(" a")
    # ShareGPT's from/value messages: refused with the row and the form expected
    sharegpt = _parquet_of_prompts(tmp_path / "s.parquet", [[{"from": "human", "value": "hi"}]])
    with pytest.raises(DataError, match=r"row 0 .*without 'role' and 'content' \(ShareGPT's from/value"):
        RLDataset(sharegpt, tokenizer, max_prompt_length=64)


def test_rldataset_counts_lengths_as_render_ids_gives_them(tmp_path):
    """Multi-turn with tools: the prompt lengths the filter and the truncation see are those of the prompt with the
    tools described, which the rollout starts from."""
    tokenizer = make_tokenizer()
    path = write_prompt_parquet(tmp_path / "p.parquet", ["a b", "a b c d e"])  # templated: 5 and 8 tokens

    def with_tools(messages):
        return vocab_ids(tokenizer, "<s> <|user|> a b c d " + messages[0]["content"] + " <|assistant|>")

    kept = RLDataset(path, tokenizer, max_prompt_length=10, filter_overlong_prompts=True, render_ids=with_tools)
    assert [item["index"] for item in kept.items] == [0] and kept.num_filtered == 1  # 9 and 12 tokens
    assert kept[0]["input_ids"] == with_tools([{"content": "a b"}]) and kept[0]["tools_in_input_ids"]
    cut = RLDataset(path, tokenizer, max_prompt_length=10, truncation="left", render_ids=with_tools)
    assert cut[1]["input_ids"] == with_tools([{"content": "a b c d e"}])[-10:] and cut.num_truncated == 1


def test_errors_of_a_set_of_files_name_the_file_and_its_row(tmp_path):
    tokenizer = make_tokenizer()
    first = write_prompt_parquet(tmp_path / "a.parquet", ["a b"])
    second = write_prompt_parquet(tmp_path / "b.parquet", ["a b", "a b c d e 1 2 3"])
    with pytest.raises(ValueError, match=r"b\.parquet, row 1 \(0-based\): the prompt has 11 tokens"):
        RLDataset([first, second], tokenizer, max_prompt_length=8, truncation="error", filter_overlong_prompts=False)
    other = _parquet_of_prompts(tmp_path / "c.parquet", ["a b"])
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(other).rename_columns(["question", "data_source", "reward_model"]), other)
    with pytest.raises(MissingColumnError, match=r"c\.parquet: column\(s\) \['prompt'\] missing; columns are"):
        RLDataset([first, other], tokenizer, max_prompt_length=8)
