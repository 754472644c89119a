"""A learning run where a learned reward model carries the whole signal (CPU, a few minutes).

What it does:
1. builds a tiny random policy over a 10-digit vocabulary and a tiny random sequence-classification reward model
   with a tokenizer and chat template of its own;
2. trains the reward model (MSE regression, Adam) on random conversations labelled by a hidden rule: the share of
   the answer's digits that are 7. The rule is registered as the data source's reward only to *report* it
   (`reward/acc`); the policy is paid the reward model's score alone;
3. runs GRPO (`reward_model.enable=true`) and writes the rule's value and the reward model's score per step to
   a JSON file and a PNG: the policy learns the rule it was never shown, through the reward model.

    PYTHONPATH=src python bench/reward_model_learning.py --steps 40 --out docs/curves/reward-model-learning
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

import torch

DIGITS = [str(i) for i in range(10)]
SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
POLICY_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['content'] }} <|im_end|> {% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>{% endif %}")
# the reward model's own template: the response is decoded and re-templated with this one
RM_TEMPLATE = "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
DATA_SOURCE = "share_of_sevens"
RESPONSE_TOKENS = 8


def share_of_sevens(solution_str: str, ground_truth=None) -> dict:
    """The hidden rule: the share of the answer's digits that are 7 (0 for an empty answer)."""
    # by character: a reloaded word-level tokenizer may decode "7 1 7" as "717" (transformers rebuilds it as the
    # model type's tokenizer, whose decoder adds no spaces)
    digits = [c for c in solution_str if c.isdigit()]
    share = sum(c == "7" for c in digits) / max(len(digits), 1)
    return {"score": share, "acc": share}


def build_tokenizer(extra_words: list[str], template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + DIGITS + extra_words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = template
    return tokenizer


def build_policy(out: str, seed: int = 0) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer([], POLICY_TEMPLATE)
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def random_answer(rng: random.Random) -> str:
    """Answers of every kind a policy may collapse to: empty, a random share of 7s among random digits, one digit
    repeated, or two digits mixed, so the reward model is fitted beyond the first kind."""
    length = rng.randint(1, RESPONSE_TOKENS)
    kind = rng.random()
    if kind < 0.1:  # nothing left after special tokens are dropped: fitted without these, the RM paid ~1 for them
        return ""
    if kind < 0.45:
        share = rng.random()
        return " ".join("7" if rng.random() < share else rng.choice(DIGITS) for _ in range(length))
    if kind < 0.7:
        return " ".join([rng.choice(DIGITS)] * length)
    pair = rng.sample(DIGITS, 2)
    return " ".join(rng.choice(pair) for _ in range(length))


def random_prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(DIGITS) for _ in range(5))


def train_reward_model(out: str, samples: int = 1500, epochs: int = 5, seed: int = 0) -> dict:
    """A random sequence classifier trained to predict share_of_sevens from the re-templated conversation."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rlanywhere.reward_model import DiscriminativeRewardModel

    tokenizer = build_tokenizer(["user", "assistant"], RM_TEMPLATE)
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=128, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = Qwen2ForSequenceClassification(config)
    scorer = DiscriminativeRewardModel(model, tokenizer, micro_batch=64)
    rng = random.Random(seed)
    pairs = [(random_prompt(rng), random_answer(rng)) for _ in range(samples)]
    rows = scorer.encode([p for p, _ in pairs], [a for _, a in pairs])
    labels = torch.tensor([share_of_sevens(a)["score"] for _, a in pairs])
    split = samples * 9 // 10
    model.train().requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        order = torch.randperm(split).tolist()
        for start in range(0, split, 64):
            batch = order[start:start + 64]
            with torch.enable_grad():
                loss = torch.nn.functional.mse_loss(scorer.row_scores([rows[i] for i in batch]), labels[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    model.eval().requires_grad_(False)
    held = list(range(split, samples))
    predicted = torch.cat([scorer.forward_ids([rows[i] for i in held[s:s + 64]]) for s in range(0, len(held), 64)])
    truth = labels[held]
    correlation = float(torch.corrcoef(torch.stack([predicted, truth]))[0, 1])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {"heldout_mse": float(((predicted - truth) ** 2).mean()), "heldout_correlation": correlation}


def build_data(out: str, prompts: int = 64, seed: int = 0) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    rows = [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": random_prompt(rng)}],
             "ability": "toy", "reward_model": {"style": "model", "ground_truth": "7"},
             "extra_info": {"split": "train", "index": i}} for i in range(prompts)]
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(out, f"{split}.parquet"))
    return out


def learning_run(root: str, steps: int, seed: int = 1) -> dict:
    """Train the RM, then GRPO paid by it; returns the reward model's fit and the per-step curve."""
    from rlanywhere.config import load_config
    from rlanywhere.planner import make_plan
    from rlanywhere.rewards import register_reward
    from rlanywhere.tracking import read_metrics
    from rlanywhere.trainer import RLTrainer

    register_reward(DATA_SOURCE, share_of_sevens)  # reported as reward/acc; the reward is the model's score
    policy = build_policy(os.path.join(root, "policy"))
    rm_dir = os.path.join(root, "rm")
    fit = train_reward_model(rm_dir)
    data = build_data(os.makedirs(os.path.join(root, "data"), exist_ok=True) or os.path.join(root, "data"))
    run_dir = os.path.join(root, "run")
    overrides = {
        "actor_rollout_ref.model.path": policy, "data.train_files": f"{data}/train.parquet", "data.val_files": "null",
        "data.train_batch_size": 8, "data.max_prompt_length": 16, "data.max_response_length": RESPONSE_TOKENS,
        "actor_rollout_ref.rollout.n": 8, "actor_rollout_ref.rollout.temperature": 1.0,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 8, "actor_rollout_ref.actor.optim.lr": 3e-3,
        "algorithm.adv_estimator": "grpo", "trainer.total_training_steps": steps, "trainer.test_freq": -1,
        "trainer.val_before_train": False, "trainer.save_freq": -1, "trainer.logger": "['console']",
        "trainer.default_local_dir": run_dir, "trainer.seed": seed, "hardware.device": "cpu",
        "reward_model.enable": True, "reward_model.model.path": rm_dir}
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    RLTrainer(cfg, make_plan(cfg, for_execution=True), run_dir).fit()
    rows = [m for m in read_metrics(run_dir) if "reward_model/score_mean" in m]
    curve = [{"step": m["step"], "rule_share_of_sevens": m["reward/acc"], "rm_score": m["reward_model/score_mean"],
              "reward": m["reward/mean"]} for m in rows]
    return {"reward_model_fit": fit, "curve": curve, "run_dir": run_dir}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in result["curve"]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.plot(steps, [p["rule_share_of_sevens"] for p in result["curve"]], label="hidden rule: share of 7s (never paid)")
    ax.plot(steps, [p["rm_score"] for p in result["curve"]], label="reward model score (the reward)", linestyle="--")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1)
    fit = result["reward_model_fit"]
    ax.set_title(f"Policy paid by a learned RM (held-out corr {fit['heldout_correlation']:.2f})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.png")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    result = learning_run(tempfile.mkdtemp(prefix="rla_rm_learn_"), args.steps)
    print(json.dumps(result["reward_model_fit"]))
    for point in result["curve"]:
        print(f"step {point['step']:3d}  share of 7s {point['rule_share_of_sevens']:.3f}  RM score {point['rm_score']:.3f}")
    if args.out:
        with open(args.out + ".json", "w") as handle:
            json.dump({k: v for k, v in result.items() if k != "run_dir"}, handle, indent=1)
        plot(result, args.out + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
