"""Held-out accuracy and tool-call rate of a model on an arithmetic task, with the calculator tool (multi-turn) and
without tools (single-turn baseline), greedy.

    python bench/tool_use_eval.py --data data/tool-arith/test.parquet --plain-data data/arith-mul3/test.parquet
    python bench/tool_use_eval.py --model RUN_DIR/final_model --data data/tool-arith/test.parquet --modes calculator

--data holds the prompts of the calculator half (`rlanywhere prepare tool-arithmetic`), --plain-data those of the
no-tool half (`rlanywhere prepare arithmetic` with the same digits, operators and seed: the same questions, asked
without a tool; default: --data).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from rlanywhere.api import load_model  # noqa: E402
from rlanywhere.data import RLDataset  # noqa: E402
from rlanywhere.rewards import RewardManager  # noqa: E402
from rlanywhere.rollout import SamplingParams  # noqa: E402
from rlanywhere.rollout.multiturn import MultiTurnRollout, MultiTurnSettings, multiturn_metrics  # noqa: E402
from rlanywhere.tools import load_tool_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", required=True)
    parser.add_argument("--plain-data", help="prompts of the no-tool baseline (default: --data)")
    parser.add_argument("--modes", default="no tools,calculator", help="which halves to run, comma-separated")
    parser.add_argument("--tools", default="examples/tools/calculator.yaml")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    args = parser.parse_args()
    loaded = load_model(args.model, max_new_tokens=args.max_new_tokens, overrides=["hardware.device=auto"])
    items = RLDataset([args.data], loaded.tokenizer, 512).items[:args.samples]
    plain = RLDataset([args.plain_data or args.data], loaded.tokenizer, 512).items[:args.samples]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    rewards = RewardManager()
    driver = MultiTurnRollout(load_tool_config(args.tools), loaded.tokenizer, MultiTurnSettings(max_assistant_turns=3),
                              loaded.engine.eos_ids if hasattr(loaded.engine, "eos_ids") else [])
    for name, rows, run in (("no tools", plain, lambda: loaded.engine.generate([i["input_ids"] for i in plain], params)),
                            ("calculator", items, lambda: driver.generate(loaded.engine, items, params))):
        if name not in args.modes.split(","):
            continue
        start = time.perf_counter()
        with torch.no_grad():
            batch = run()
        texts = batch.decode(loaded.tokenizer)
        _, info = rewards(texts, [i["ground_truth"] for i in rows], [i["data_source"] for i in rows],
                          [i["extra_info"] for i in rows])
        acc = sum(info["acc"]) / len(rows)
        line = f"{name:10s} accuracy {acc:.3f} on {len(rows)} held-out prompts ({time.perf_counter() - start:.0f} s)"
        if name == "calculator":
            m = multiturn_metrics(driver.last_stats)
            line += (f"; tool-call rate {m['multi_turn/tool_call_rate']:.2f}, calls/row "
                     f"{m['multi_turn/tool_calls/mean']:.2f}, errors {m['multi_turn/tool_errors/total']:.0f}")
            full = loaded.tokenizer.decode(batch.response_ids[0], skip_special_tokens=False)
            print("sample:", full[:400].replace("\n", "\\n"))
        print(line, flush=True)


if __name__ == "__main__":
    main()
