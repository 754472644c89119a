"""Validation: answer the held-out prompts with the current policy (val_kwargs sampling), score them, write every
response to RUN_DIR/val_generations/step_N.jsonl and return the val/* metrics. [distributed] Each rank answers a
contiguous block of the prompts; rank 0 gathers, writes and logs."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
from tqdm.auto import tqdm

from .rollout.multiturn import multiturn_metrics
from .rollout_phase import RolloutPhase
from .sharding import weights_for_rollout

log = logging.getLogger(__name__)


VALIDATION_SALT = 500_009  # validation's streams apart from the training rollout's (salt 0, -1, ...) of a step


def validation_size(rows: int, limit: int | None) -> int:
    """The validation prompts evaluated: the first data.val_max_samples of them; all where it is unset or <= 0, as
    verl reads it."""
    return rows if limit is None or limit <= 0 else min(limit, rows)


def validate(rollouts: RolloutPhase, val_set, dp, run_dir: str, step: int) -> dict:
    cfg = rollouts.cfg
    if val_set is None:
        return {}
    indices = range(validation_size(len(val_set), cfg.data.val_max_samples))
    block = -(-len(indices) // dp.world)
    offset = min(dp.rank * block, len(indices))
    total = len(indices)
    items = [val_set[i] for i in indices[offset:offset + block]]
    params = rollouts.sampling_params(validation=True)
    chunk = cfg.data.val_batch_size or max(cfg.data.train_batch_size * rollouts.n, 64)
    # [distributed] every rank generates as many times as the rank with the most chunks (a sharded model gathers
    # its weights in each call, a collective): a rank out of prompts generates for an empty chunk
    chunks = int(dp.max_value(float(-(-len(items) // chunk))))
    samples, scores_all, lengths, rows = [], [], [], []  # rows: each sample's source and reward numbers
    acc_returned = 0  # samples whose reward returned an `acc`
    tool_stats: list = []  # multi-turn rows' turn and tool-call counts (this rank's)
    # [distributed] the progress bar is rank 0's (it counts rank 0's block of prompts)
    with tqdm(total=len(items), desc=f"validation (step {step})", unit="prompt", leave=False,
              disable=not dp.is_main) as bar:
        for start in range(0, chunks * chunk, chunk):
            part = items[start:start + chunk]
            if not part:  # [distributed] the weight gather of the other ranks' generation, with nothing to generate
                with weights_for_rollout(rollouts.engine, rollouts.actor):
                    continue
            # each row its own stream, keyed by its global validation prompt: sampled validation (val_kwargs) draws
            # the same on any number of ranks and in chunks of any size
            rollout = rollouts.generate(part, params, rollouts.row_streams(step, salt=VALIDATION_SALT),
                                        first_prompt=offset + start)
            scores, info, texts = rollouts.score(part, rollout, params.n)
            acc_returned += info.get("acc_returned", 0)
            numbers = {key: values for key, values in info.items() if isinstance(values, list)}
            rows += [{"data_source": part[i // params.n].get("data_source", "unknown"),
                      **{key: float(values[i]) for key, values in numbers.items()}} for i in range(len(texts))]
            scores_all += scores.tolist()
            lengths += rollout.response_lengths().tolist()
            samples += texts
            tool_stats += rollouts.multiturn.last_stats if rollouts.multiturn is not None else []
            bar.update(len(part))
    # [distributed] every rank's prompts, responses and scores, in prompt order; rank 0 writes and logs them
    all_items = dp.gather_objects([{k: item[k] for k in ("index", "input_ids", "ground_truth")}
                                   for item in items]) if dp.enabled else items
    all_samples, all_scores = dp.gather_objects(samples), dp.gather_objects(scores_all)
    if dp.is_main:
        write_val_generations(run_dir, step, rollouts.tokenizer, all_items, all_samples, all_scores, params.n)
        for text, item in list(zip(all_samples[::params.n], all_items))[: cfg.trainer.log_val_generations]:
            log.info("val sample [truth %s]: %s", item["ground_truth"], text.strip()[:300])
    rows = dp.gather_objects(rows) if dp.enabled else rows
    for row, score in zip(rows, all_scores):
        row["reward"] = score
    with_acc = (dp.sum_dict({"n": float(acc_returned)})["n"] if dp.enabled else acc_returned) > 0
    lengths = dp.gather_objects(lengths)
    return {**sample_means(rows, "val/", with_acc), "val/response_length": float(np.mean(lengths)),
            "val/num_samples": float(total), **by_data_source(rows, params.n, with_acc),
            **multiturn_metrics(dp.gather_objects(tool_stats), "val/multi_turn")}


def sample_means(rows: list[dict], prefix: str, with_acc: bool) -> dict[str, float]:
    """The mean of each reward number over the samples (one the reward returned for some samples only counts 0 for
    the others, as in training), `acc` only where the reward returned it for some sample (otherwise it would read 0:
    `reward` is then the number to watch, as verl's core metric)."""
    keys = sorted({key for row in rows for key in row if key != "data_source"} - (set() if with_acc else {"acc"}))
    return {f"{prefix}{key}": float(np.mean([row.get(key, 0.0) for row in rows])) for key in keys}


def by_data_source(rows: list[dict], n: int, with_acc: bool) -> dict[str, float]:
    """verl's per-source names for the same means: `val-core/<data_source>/<acc, else reward>/mean@<n>`, the other
    numbers under `val-aux/` (verl's std, best, worst and majority-vote statistics are not computed here)."""
    out = {}
    for source in sorted({row["data_source"] for row in rows}):
        means = sample_means([row for row in rows if row["data_source"] == source], "", with_acc)
        core = "acc" if with_acc else "reward"
        for key, value in means.items():
            out[f"{'val-core' if key == core else 'val-aux'}/{source}/{key}/mean@{n}"] = value
    return out


def write_val_generations(run_dir: str, step: int, tokenizer, items: list[dict], texts: list[str],
                          scores: list[float], n: int) -> str:
    """Every validation response of this step as one JSON line each in RUN_DIR/val_generations/step_N.jsonl
    (verl's trainer.validation_data_dir, kept in the run dir): prompt, response, ground truth, score."""
    folder = os.path.join(run_dir, "val_generations")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{step}.jsonl")
    with open(path, "w") as handle:
        for row, (text, score) in enumerate(zip(texts, scores)):
            item = items[row // n]
            prompt = tokenizer.decode(item["input_ids"], skip_special_tokens=False)
            handle.write(json.dumps({"step": step, "index": item["index"], "prompt": prompt,
                                     "response": text, "ground_truth": item["ground_truth"],
                                     "score": score}) + "\n")
    return path
