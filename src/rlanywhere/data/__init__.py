"""Datasets for RL post-training, in two parts: `prepare.py` writes verl-schema parquet files offline (`rlanywhere
prepare`: GSM8K, a synthetic arithmetic task, any jsonl/parquet with a prompt and an answer column), and `loader.py`
reads them at training time (`RLDataset` with the chat template applied, the resumable `PromptLoader`,
`collate_prompts`). Their public names are importable from `rlanywhere.data`."""

from .loader import (
    TRUNCATION_MODES, DataError, MissingColumnError, PromptLoader, RLDataset, check_rows, collate_prompts,
    iterate_in_batches, read_parquet_rows, render_prompt, tokenize_rendered,
)
from .prepare import (
    ARITHMETIC_DATA_SOURCE, ARITHMETIC_INSTRUCTION, ARITHMETIC_OPERATORS, GSM8K_DATA_SOURCE, GSM8K_INSTRUCTION,
    GSM8K_ONE_SHOT_ANSWER, GSM8K_ONE_SHOT_QUESTION, SPLITS, evaluate_arithmetic, extract_gsm8k_answer, gsm8k_messages,
    gsm8k_rows, make_row, prepare_arithmetic, prepare_generic, prepare_gsm8k,
)
