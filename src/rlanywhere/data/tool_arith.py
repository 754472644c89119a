"""The calculator demo's task: multi-digit arithmetic whose prompt shows one worked tool call.

Each row is the arithmetic task's row (`prepare_arithmetic`: same questions, answers and splits) with its prompt
replaced by a short chat: an example question, the assistant's calculator call, the tool's result and the
assistant's `#### <answer>`, then the row's own question. A small chat model copies the shape of that exchange, so
some of its samples call the tool from the first step and reinforcement learning has something to rank; what it
still has to learn is to put the question's own numbers into the call and to copy the result into its answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from .prepare import prepare_arithmetic

EXAMPLE_QUESTION = "What is 12 * 34?"
EXAMPLE_EXPRESSION = "12 * 34"
EXAMPLE_RESULT = "408"


def one_shot_messages(question: str, tool_name: str = "calculator") -> list[dict]:
    """The chat for one question: the worked example exchange, then `question` as the user's turn."""
    call = json.dumps({"name": tool_name, "arguments": {"expression": EXAMPLE_EXPRESSION}})
    return [{"role": "user", "content": EXAMPLE_QUESTION},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": EXAMPLE_RESULT},
            {"role": "assistant", "content": f"#### {EXAMPLE_RESULT}"},
            {"role": "user", "content": question}]


def prepare_tool_arithmetic(out_dir: str | Path, train_size: int = 2000, test_size: int = 200, digits: int = 3,
                            operators: str = "*", num_operands: int = 2, seed: int = 0) -> dict[str, str]:
    """Write `out_dir/{train,test}.parquet` for the calculator demo; returns `{split: path}`."""
    paths = prepare_arithmetic(out_dir, train_size=train_size, test_size=test_size, digits=digits,
                               operators=operators, num_operands=num_operands, seed=seed)
    for path in paths.values():
        table = pq.read_table(path)
        rows = table.to_pylist()
        for row in rows:
            row["prompt"] = one_shot_messages(row["extra_info"]["question"])
        pq.write_table(table.from_pylist(rows), path)
    return paths


__all__ = ["prepare_tool_arithmetic", "one_shot_messages"]
