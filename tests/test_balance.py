"""trainer.balance_batch: the partition of rows over ranks (hand-computed cases) and the exchange on 2 spawned gloo
ranks holding rows of very different lengths and widths: rows arrive whole (ids, masks, sampling log-probs, score,
reward details, global group index), padded as a RolloutBatch is, and the per-rank token counts end up closer.

The 2-rank runs with balancing against one process are in tests/test_distributed.py; the gradient's independence
of which rank holds a row in tests/test_loss_invariance.py."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from rlanywhere.balance import balance_rows, balanced_partition, per_rank_tokens, rows_after_balancing
from rlanywhere.distributed import DataParallel
from rlanywhere.rollout.base import RolloutBatch
from rlanywhere.stepbatch import StepBatch

from .test_distributed import run_two_gloo_ranks

PAD = 0


# ------------------------------------------------------------------------------------------ the partition
def test_partition_hand_computed():
    # longest first, each to the part with the fewest tokens that has room (ties: lower part)
    assert balanced_partition([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]  # 5+1 | 4+2
    assert balanced_partition([10, 9, 8, 1, 1, 1], 3) == [[0, 5], [1, 4], [2, 3]]  # 11 | 10 | 9
    assert balanced_partition([8, 8, 8, 8, 1, 1, 1, 1], 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]  # 18 | 18
    assert balanced_partition([3, 1, 2], 1) == [[0, 1, 2]]
    assert balanced_partition([], 2) == [[], []]


def test_partition_gives_equal_counts_and_beats_the_contiguous_split():
    rng = random.Random(0)
    for parts in (2, 3, 4, 8):
        lengths = sorted((rng.randint(1, 500) for _ in range(parts * 16)), reverse=True)  # the worst order
        partition = balanced_partition(lengths, parts)
        assert [len(rows) for rows in partition] == [16] * parts
        assert sorted(row for rows in partition for row in rows) == list(range(len(lengths)))
        contiguous = [list(range(p * 16, (p + 1) * 16)) for p in range(parts)]
        balanced, unbalanced = per_rank_tokens(lengths, partition), per_rank_tokens(lengths, contiguous)
        assert max(balanced) - min(balanced) < (max(unbalanced) - min(unbalanced)) / 10
        assert balanced_partition(list(lengths), parts) == partition  # deterministic


def test_partition_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="7 rows cannot be split into 2 parts of equal size"):
        balanced_partition([1] * 7, 2)
    with pytest.raises(ValueError, match="parts must be an int >= 1"):
        balanced_partition([1, 2], 0)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        balanced_partition([1, -2], 2)
    with pytest.raises(ValueError, match="3 row lengths for 4 rows"):
        rows_after_balancing([1, 2, 3], [2, 2])


def test_layout_moves_rows_only_when_that_lowers_the_busiest_rank():
    assert rows_after_balancing([5] * 8, [4, 4]) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # already even: nothing moves
    # rank 0 holds the long rows (32 vs 4 tokens): half of them move, 18 | 18
    assert rows_after_balancing([8, 8, 8, 8, 1, 1, 1, 1], [4, 4]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # 4 | 28 tokens; the greedy parts are {3, 4, 6, 7} (20) and {0, 1, 2, 5} (12): each goes to the rank that holds
    # 3 of its 4 rows, so rows 3 and 5 swap and the other six stay
    lengths = [1, 1, 1, 1, 9, 9, 9, 1]
    layout = rows_after_balancing(lengths, [4, 4])
    assert layout == [[0, 1, 2, 5], [3, 4, 6, 7]]
    assert per_rank_tokens(lengths, layout) == [12, 20]


# ------------------------------------------------------------------------------------------ the exchange
N = 2  # samples per prompt
PROMPT_LENGTHS = [[3, 2, 3, 2], [1, 4, 2, 2]]  # per rank: rank 1's prompts are wider
RESPONSE_LENGTHS = [[6, 6, 5, 5], [1, 1, 2, 1]]  # rank 0 holds the long responses: 32 vs 14 tokens


def token(rank: int, row: int, column: int, part: str) -> int:
    return 1000 * rank + 100 * row + column + (1 if part == "prompt" else 50)  # never PAD


def rank_batch(rank: int) -> StepBatch:
    """Rank `rank`'s rows as its rollout left them: prompts left-padded, responses right-padded to its widest."""
    prompts, responses = PROMPT_LENGTHS[rank], RESPONSE_LENGTHS[rank]
    width_p, width_r = max(prompts), max(responses)
    rows = len(prompts)
    prompt_ids, prompt_mask = torch.full((rows, width_p), PAD), torch.zeros(rows, width_p, dtype=torch.long)
    response_ids, response_mask = torch.full((rows, width_r), PAD), torch.zeros(rows, width_r, dtype=torch.long)
    logprobs = torch.zeros(rows, width_r)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[row, width_p - p:] = torch.tensor([token(rank, row, c, "prompt") for c in range(p)])
        prompt_mask[row, width_p - p:] = 1
        response_ids[row, :r] = torch.tensor([token(rank, row, c, "response") for c in range(r)])
        response_mask[row, :r] = 1
        logprobs[row, :r] = -torch.arange(1, r + 1) / (10.0 * (rank * rows + row + 1))
    rollout = RolloutBatch(prompt_ids, prompt_mask, response_ids, response_mask, logprobs, rows // N, N)
    info = {"acc": [float(rank * rows + row) for row in range(rows)], "format": [0.5] * rows,
            "num_errors": rank + 1}
    if rank == 1:
        info["bonus"] = [0.25] * rows  # a key only one rank's reward returned: 0.0 for the other's rows
    group_index = (rank * rows // N + torch.arange(rows // N)).repeat_interleave(N)  # global prompt index
    scores = torch.tensor([0.1 * (rank * rows + row) for row in range(rows)])
    return StepBatch(rollout=rollout, group_index=group_index, scores=scores, reward_info=info)


def unpadded_rows(batch: StepBatch) -> list[dict]:
    """Each row's content without its padding, comparable across layouts."""
    r = batch.rollout
    out = []
    for row in range(batch.rows):
        prompt, response = r.prompt_mask[row].bool(), r.response_mask[row].bool()
        out.append({"prompt": r.prompt_ids[row][prompt].tolist(), "response": r.response_ids[row][response].tolist(),
                    "logprobs": r.response_logprobs[row][response].tolist(), "score": float(batch.scores[row]),
                    "group": int(batch.group_index[row]),
                    **{key: batch.reward_info[key][row] for key in ("acc", "format", "bonus")
                       if key in batch.reward_info}})
    return out


def _exchange_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dp = DataParallel.from_env("cpu", "gloo")
    dp.set_rows(len(PROMPT_LENGTHS[rank]))
    moved, metrics = balance_rows(dp, rank_batch(rank), PAD)
    r = moved.rollout
    # padding as a RolloutBatch has it: prompts on the left, responses on the right, trimmed to this rank's widest
    padding_ok = (bool((r.prompt_ids[r.prompt_mask == 0] == PAD).all())
                  and bool((r.response_ids[r.response_mask == 0] == PAD).all())
                  and bool((r.response_logprobs[r.response_mask == 0] == 0).all())
                  and bool((r.prompt_mask.cumsum(1) > 0).eq(r.prompt_mask.bool()).all())  # left-padded
                  and bool(r.response_mask.flip(1).cumsum(1).gt(0).eq(r.response_mask.flip(1).bool()).all())
                  and bool(r.prompt_mask[:, 0].any()) and bool(r.response_mask[:, -1].any()))
    result = {"rows": unpadded_rows(moved), "metrics": metrics, "padding_ok": padding_ok,
              "layout": [dp.layout.counts, dp.layout.start], "num_errors": moved.reward_info["num_errors"],
              "dtypes": [str(t.dtype) for t in (r.prompt_ids, r.response_mask, r.response_logprobs, moved.scores,
                                                moved.group_index)],
              "tokens": int(r.prompt_mask.sum() + r.response_mask.sum())}
    dp.close()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def test_rows_move_whole_and_even_out_the_tokens(tmp_path):
    first, second = run_two_gloo_ranks(_exchange_worker, tmp_path)
    before = [unpadded_rows(rank_batch(rank)) for rank in (0, 1)]
    every_row = before[0] + before[1]  # global rows, rank-major
    for row in every_row:
        row.setdefault("bonus", 0.0)
    # lengths 9 8 8 7 | 2 5 4 3 (32 | 14 tokens): hand-computed partition {0, 3, 4, 5} | {1, 2, 6, 7}, 23 | 23
    assert first["rows"] == [every_row[i] for i in (0, 3, 4, 5)]
    assert second["rows"] == [every_row[i] for i in (1, 2, 6, 7)]
    assert first["tokens"] == second["tokens"] == 23
    assert first["metrics"] == second["metrics"] == {
        "global_seqlen/min": 14.0, "global_seqlen/max": 32.0, "global_seqlen/minmax_diff": 18.0,
        "global_seqlen/balanced_min": 23.0, "global_seqlen/balanced_max": 23.0, "global_seqlen/mean": 23.0}
    assert first["padding_ok"] and second["padding_ok"]
    assert first["layout"] == [[4, 4], 0] and second["layout"] == [[4, 4], 4]
    assert (first["num_errors"], second["num_errors"]) == (1, 2)  # counts stay with the rank that scored
    assert first["dtypes"] == second["dtypes"] == ["torch.int64", "torch.int64", "torch.float32", "torch.float32",
                                                   "torch.int64"]


def test_one_process_balancing_is_a_no_op():
    batch = rank_batch(0)
    moved, metrics = balance_rows(DataParallel(), batch, PAD)
    assert moved is batch and metrics == {}


def test_balancing_after_per_row_results_is_refused():
    batch = rank_batch(0)
    batch.old_logprobs = torch.zeros(batch.mask.shape)
    with pytest.raises(ValueError, match="old_logprobs would be left behind"):
        balance_rows(DataParallel(rank=0, world=2), batch, PAD)


def test_balancing_without_this_steps_layout_is_refused():
    with pytest.raises(ValueError, match=r"does not describe this step's 4 rows on rank 0: call dp.set_rows"):
        balance_rows(DataParallel(rank=0, world=2), rank_batch(0), PAD)  # no set_rows: the layout is [0]


# ------------------------------------------------------------------------------------------ what the user is told
def test_plan_says_whether_rows_are_balanced(capsys):
    from rlanywhere.cli import plan_main
    from rlanywhere.config import load_config
    from rlanywhere.machine import DeviceInfo, HardwareProbe

    probe = HardwareProbe.fake("h100")
    probe.devices.append(DeviceInfo.from_card("h100", 1))
    grpo = ["actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "algorithm.adv_estimator=grpo",
            "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    said = {}
    for name, extra in {"one": [], "two": ["trainer.n_gpus_per_node=2"],
                        "two, off": ["trainer.n_gpus_per_node=2", "trainer.balance_batch=false"]}.items():
        assert plan_main(load_config(None, grpo + extra), machine=probe) == 0
        said[name] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("batch balance")]
    assert said["one"] == []  # one process: nothing to balance, nothing said
    assert said["two"] == ["batch balance: on (trainer.balance_batch=true): after each rollout, rows move between the "
                           "2 ranks so each trains as many rows and about as many tokens (global_seqlen/* metrics)"]
    assert said["two, off"][0].startswith("batch balance: off (trainer.balance_batch=false)")


def test_balance_batch_is_a_config_key_not_a_verl_only_notice():
    from rlanywhere.config import load_config

    notices: list[str] = []
    cfg = load_config(None, ["trainer.balance_batch=false"], notices=notices)
    assert cfg.trainer.balance_batch is False and not any("balance_batch" in n for n in notices)
    assert load_config(None, []).trainer.balance_batch is True  # verl's default
