"""Model and tokenizer loading helpers."""

import logging

import pytest

from rlanywhere.models import align_eos_with_gguf

from .conftest import build_tiny_tokenizer


def write_gguf_with_eos(path, eos_id: int) -> str:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_eos_token_id(eos_id)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_eos_wins_over_a_misread_tokenizer_eos(tmp_path, caplog):
    # transformers 5.17 reads SmolLM2's GGUF tokenizer with eos <|im_start|>; the file says <|im_end|>
    tokenizer = build_tiny_tokenizer(["1 + 1 = 2"])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokenizer.eos_token = "<|im_start|>"
    path = write_gguf_with_eos(tmp_path / "m.gguf", im_end)
    with caplog.at_level(logging.INFO, logger="rlanywhere.models"):
        align_eos_with_gguf(tokenizer, path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == im_end
    assert "'<|im_start|>' -> '<|im_end|>'" in caplog.text


def test_gguf_eos_outside_the_vocabulary_keeps_the_tokenizer_eos(tmp_path, caplog):
    tokenizer = build_tiny_tokenizer(["1 + 1 = 2"])
    path = write_gguf_with_eos(tmp_path / "m.gguf", len(tokenizer) + 5)
    align_eos_with_gguf(tokenizer, path)
    assert tokenizer.eos_token == "<|im_end|>"
    assert "outside the tokenizer" in caplog.text
