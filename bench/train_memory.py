"""Measured peak memory and step time of real RL steps vs the planner's prediction, under an emulated card.

What it does: builds a random-weight model of a named shape (Qwen2.5-0.5B / 1.5B) with a word-level tokenizer,
writes prompts of exactly --prompt-len tokens, and runs the real trainer for --steps steps with
`hardware.emulate=<card>` (memory capped with set_per_process_memory_fraction, TF32 off, no flash-attn where the
card lacks them). Random weights almost never emit EOS, so every response runs to full length: the worst case.
It prints one row per config: predicted peak (estimator), measured peak (torch.cuda.max_memory_allocated over the
run), their ratio, seconds per step, OOM recoveries. `--logprobs naive` swaps the chunked log-prob path for full
logits (what most frameworks do) to measure what chunking saves. `--reward-model on` scores with a random
sequence-classification reward model of the policy's shape (its own chat template: responses are re-templated)
instead of the rule; `both` runs each config with the rule and with the reward model, for the step-time comparison;
`judge` scores with a generative judge (the policy's random weights grade each response: the mechanics, the memory and
the parse-failure count, not meaningful grades); `all` runs rule, reward model and judge. On CUDA it also prints the
measured peak of each phase (the allocator's peak between the phase's start and end, the max over steps) beside the
estimate's, with the estimate's largest parts: where a prediction misses, that says which term.

One GPU:
    PYTHONPATH=src python bench/train_memory.py --configs ppo-0.5b,grpo-0.5b,grpo-lora-1.5b --emulate p40
    PYTHONPATH=src python bench/train_memory.py --configs ppo-0.5b --logprobs chunked,naive --emulate p40
    PYTHONPATH=src python bench/train_memory.py --configs ppo-0.5b --reward-model both --emulate p40
CPU smoke test (tiny shape, no cap):
    PYTHONPATH=src python bench/train_memory.py --configs tiny-grpo --steps 1 --emulate none
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=True),
}

# name -> (shape, prompts, n, prompt_len, response_len, overrides)
CONFIGS = {
    "ppo-0.5b": ("qwen2.5-0.5b", 64, 1, 256, 256, {
        "algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.kl_coef": 0.001,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 32}),
    "grpo-0.5b": ("qwen2.5-0.5b", 16, 8, 256, 512, {
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 16}),
    # the same with 4x the prompts: 256 rows per rank on 2 GPUs, where a decode step's cost grows with the rows
    # (at 64 rows per rank it is bound by reading the weights, which caps 2-GPU scaling: docs/distributed.md)
    "grpo-0.5b-64": ("qwen2.5-0.5b", 64, 8, 256, 512, {
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 64}),
    "grpo-lora-1.5b": ("qwen2.5-1.5b", 16, 8, 256, 512, {
        "algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.use_kl_loss": True,
        "actor_rollout_ref.model.lora_rank": 32, "actor_rollout_ref.model.lora_alpha": 64,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 16}),
    # PPO at 64 x (256+512): about 40 GiB when the planner believes the card has 40 GiB (whole-batch micro-batches,
    # no checkpointing). "-planned" lets the planner size it for the real card; "-oom" lies to the planner
    # (hardware.memory_budget_gib=40) so the 24 GiB cap is hit and OOM recovery must bring it under, with no crash.
    "ppo-768-planned": ("qwen2.5-0.5b", 64, 1, 256, 512, {
        "algorithm.adv_estimator": "gae", "actor_rollout_ref.actor.ppo_mini_batch_size": 64}),
    "ppo-768-oom": ("qwen2.5-0.5b", 64, 1, 256, 512, {
        "algorithm.adv_estimator": "gae", "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
        "hardware.memory_budget_gib": 40}),
    "tiny-grpo": ("tiny", 4, 2, 32, 16, {"algorithm.adv_estimator": "grpo"}),
    "tiny-ppo": ("tiny", 4, 1, 32, 16, {"algorithm.adv_estimator": "gae", "algorithm.use_kl_in_reward": True,
                                        "actor_rollout_ref.actor.use_kl_loss": True,
                                        "actor_rollout_ref.actor.ppo_mini_batch_size": 2}),
}


def build_model_dir(shape_name: str, root: str) -> str:
    """Random weights + a word-level tokenizer whose words map 1:1 to tokens (exact prompt lengths)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = os.path.join(root, shape_name)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    # Number words only: transformers may re-split mixed letter/digit words on reload.
    words = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"] + [str(i) for i in range(2000)]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['content'] }} <|im_end|> {% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>{% endif %}")
    torch.manual_seed(0)
    config = Qwen2Config(max_position_embeddings=4096, eos_token_id=3, pad_token_id=0, bos_token_id=None,
                         **SHAPES[shape_name])
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def build_reward_model_dir(shape_name: str, root: str) -> str:
    """A random sequence classifier (1 label) of the shape, with the policy's words under a different chat template
    (so the reward model really re-templates each conversation)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    out = os.path.join(root, f"rm_{shape_name}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    tok = AutoTokenizer.from_pretrained(build_model_dir(shape_name, root))
    tok.chat_template = "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    torch.manual_seed(1)
    config = Qwen2Config(max_position_embeddings=4096, eos_token_id=3, pad_token_id=0, bos_token_id=None, num_labels=1,
                         **SHAPES[shape_name])
    Qwen2ForSequenceClassification(config).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def build_data(root: str, prompts: int, prompt_len: int) -> str:
    """Prompts of exactly prompt_len tokens after the chat template (3 template tokens + words)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = os.path.join(root, f"data_{prompts}_{prompt_len}")
    os.makedirs(out, exist_ok=True)
    rows = []
    for i in range(max(prompts, 8) * 2):
        words = " ".join(str((i * 7 + j) % 10) for j in range(prompt_len - 3))  # one digit = one token
        rows.append({"data_source": "arithmetic", "prompt": [{"role": "user", "content": words}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": "7"},
                     "extra_info": {"split": "train", "index": i}})
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(out, f"{split}.parquet"))
    return out


def naive_response_logprobs(model, input_ids, attention_mask, response_len, temperature=1.0, chunk_size=0,
                            with_entropy=False, position_ids=None):
    """Full-logits log-probs: the usual implementation (B x T x V fp32 logits), for the before/after figure."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits[:, -response_len - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, input_ids[:, -response_len:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, entropy


# the trainer's phase timer names -> the estimate's phase names
ESTIMATE_PHASE = {"rollout": "rollout", "reward": "reward", "old_log_prob": "old_log_prob",
                  "ref_log_prob": "ref_log_prob", "values": "values", "update_actor": "actor_update",
                  "update_critic": "critic_update"}


class PhasePeaks:
    """Measured peak per trainer phase: wraps stepmetrics.PhaseTimer so each outermost phase starts with the
    allocator's peak reset and ends by reading it (the max over steps); whatever ran between phases is kept in
    `overall`, so it still equals the whole run's peak. CUDA only."""

    def __init__(self):
        self.phases: dict[str, int] = {}
        self.overall = 0
        self.depth = 0

    def _read(self) -> int:
        peak = torch.cuda.max_memory_allocated()
        self.overall = max(self.overall, peak)
        return peak

    def install(self):
        import contextlib

        from rlanywhere import stepmetrics

        original = stepmetrics.PhaseTimer.__call__
        recorder = self

        @contextlib.contextmanager
        def timed(timer, name):
            outer = recorder.depth == 0 and torch.cuda.is_available()
            if outer:
                recorder._read()  # the peak since the last phase (gaps between phases)
                torch.cuda.reset_peak_memory_stats()
            recorder.depth += 1
            try:
                with original(timer, name):
                    yield
            finally:
                recorder.depth -= 1
                if outer:
                    key = ESTIMATE_PHASE.get(name, name)
                    recorder.phases[key] = max(recorder.phases.get(key, 0), recorder._read())

        stepmetrics.PhaseTimer.__call__ = timed
        return lambda: setattr(stepmetrics.PhaseTimer, "__call__", original)

    def run_peak(self) -> int:
        return self._read() if torch.cuda.is_available() else 0


def phase_table(row: dict) -> list[str]:
    """Predicted vs measured GiB per phase, with the predicted breakdown's largest parts."""
    predicted, measured = row.get("predicted_phases_gib", {}), row.get("measured_phases_gib", {})
    lines = [f"  {'phase':14} {'pred':>7} {'meas':>7} {'ratio':>6}  predicted parts (GiB)"]
    for phase in sorted(set(predicted) | set(measured), key=lambda p: -predicted.get(p, 0)):
        pred, meas = predicted.get(phase), measured.get(phase)
        ratio = f"{pred / meas:.3f}" if pred and meas else "-"
        parts = ", ".join(f"{k}={v}" for k, v in sorted(row.get("predicted_breakdown_gib", {}).get(phase, {}).items(),
                                                         key=lambda kv: -kv[1]) if v >= 0.05)
        lines.append(f"  {phase:14} {pred if pred is not None else '-'!s:>7} {meas if meas is not None else '-'!s:>7} "
                     f"{ratio:>6}  {parts}")
    return lines


REWARDS = {"off": ("rule",), "on": ("rm",), "both": ("rule", "rm"), "judge": ("judge",),
           "all": ("rule", "rm", "judge")}


def run_config(name: str, emulate: str, steps: int, logprobs: str, root: str, reward: str = "rule") -> dict:
    from rlanywhere import trainer as trainer_module
    from rlanywhere import update as update_module  # where the trainer's log-prob passes call response_logprobs
    from rlanywhere.config import load_config
    from rlanywhere import api
    from rlanywhere.vocabulary import PlanError
    from rlanywhere.tracking import read_metrics

    shape, prompts, n, plen, rlen, extra = CONFIGS[name]
    model_dir = build_model_dir(shape, root)
    data_dir = build_data(root, prompts, plen)
    run_dir = os.path.join(root, f"run_{name}_{logprobs}_{time.time_ns()}")
    overrides = {
        "actor_rollout_ref.model.path": model_dir, "data.train_files": f"{data_dir}/train.parquet",
        "data.val_files": "null", "data.train_batch_size": prompts, "data.max_prompt_length": plen,
        "data.max_response_length": rlen, "actor_rollout_ref.rollout.n": n,
        "actor_rollout_ref.rollout.temperature": 1.0, "trainer.total_training_steps": steps,
        "trainer.val_before_train": False, "trainer.test_freq": -1, "trainer.save_freq": -1,
        "trainer.logger": "['console']", "trainer.default_local_dir": run_dir, "data.filter_overlong_prompts": False,
        **({"hardware.emulate": emulate} if emulate != "none" else {}), **extra}
    if reward == "rm":
        overrides.update({"reward_model.enable": True, "reward_model.model.path": build_reward_model_dir(shape, root)})
    elif reward == "judge":  # the policy's random weights grade: the mechanics and the memory, not the grades
        overrides.update({"reward_model.enable": True, "reward_model.model.path": model_dir,
                          "reward_model.judge.enable": True, "reward_model.judge.max_new_tokens": 8})
    cfg = load_config(None, [f"{k}={v}" for k, v in overrides.items()])
    try:
        plan = api.plan(cfg)  # planned and applied to the process (allocator, memory cap) as `rlanywhere train` does
    except PlanError as exc:
        return {"config": name, "logprobs": logprobs, "error": f"plan refused: {exc}"}
    predicted = (plan.estimate or {}).get("peak_bytes")
    original = update_module.response_logprobs
    if logprobs == "naive":
        update_module.response_logprobs = naive_response_logprobs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row = {"config": name + {"rule": "", "rm": "+rm", "judge": "+judge"}[reward], "logprobs": logprobs,
           "emulate": emulate,
           "reward_model": plan.reward_model, "predicted_phases_gib": {
               k: round(v / 2**30, 2) for k, v in (plan.estimate or {}).get("phases", {}).items()},
           "predicted_breakdown_gib": {phase: {k: round(v / 2**30, 2) for k, v in parts.items()}
                                       for phase, parts in (plan.estimate or {}).get("breakdown", {}).items()},
           "compile_training": plan.compile_training, "release_kv_between_phases":
               plan.rollout.release_kv_between_phases, "plan": {
        k: getattr(plan.sizes if hasattr(plan.sizes, k) else plan, k) for k in ("precision", "attn_implementation", "gradient_checkpointing",
                                      "actor_micro_batch_size", "critic_micro_batch_size", "logprob_micro_batch_size",
                                      "rollout_batch_size", "optimizer_offload", "param_offload", "ref_device",
                                      "memory_fraction")}}
    peaks = PhasePeaks()
    restore_timer = peaks.install()
    try:
        trainer = trainer_module.RLTrainer(cfg, plan, run_dir)
        start = time.time()
        trainer.fit()
        metrics = [m for m in read_metrics(run_dir) if "perf/step_time_s" in m]
        row.update({
            "steps": len(metrics), "seconds": round(time.time() - start, 1),
            "step_time_s": round(sorted(m["perf/step_time_s"] for m in metrics)[len(metrics) // 2], 2),
            "measured_peak_gib": round(peaks.run_peak() / 2**30, 2) if torch.cuda.is_available() else None,
            "measured_phases_gib": {k: round(v / 2**30, 2) for k, v in peaks.phases.items()},
            "reward_model_metrics": {k: v for k, v in metrics[-1].items() if k.startswith("reward_model/")},
            "parse_failures_all_steps": sum(m.get("reward_model/parse_failures", 0) for m in metrics),
            "oom_recoveries": len(trainer.oom_guard.events), "oom_events": trainer.oom_guard.events,
            "timings": {k: round(v, 2) for k, v in metrics[-1].items() if k.startswith("timing/")},
        })
    except Exception as exc:  # a crash is a result here: report it
        row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        row["measured_peak_gib"] = round(peaks.run_peak() / 2**30, 2) if torch.cuda.is_available() else None
        row["measured_phases_gib"] = {k: round(v / 2**30, 2) for k, v in peaks.phases.items()}
    finally:
        restore_timer()
        update_module.response_logprobs = original
        trainer = None
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if predicted:
        row["predicted_peak_gib"] = round(predicted / 2**30, 2)
        if row.get("measured_peak_gib"):
            row["predicted_over_measured"] = round(row["predicted_peak_gib"] / row["measured_peak_gib"], 3)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="ppo-0.5b,grpo-0.5b,grpo-lora-1.5b,ppo-768-planned,ppo-768-oom")
    parser.add_argument("--emulate", default="p40")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--logprobs", default="chunked", help="chunked, naive, or both comma-separated")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--root", default=None, help="where models/data/runs go (default: a temp dir)")
    parser.add_argument("--reward-model", default="off", choices=tuple(REWARDS),
                        help="on: score with a random reward model of the policy's shape; judge: a generative judge "
                             "(the policy's random weights); both: rule and model runs; all: rule, model, judge")
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="rla_mem_")
    rows = []
    for name in args.configs.split(","):
        for mode in args.logprobs.split(","):
            for reward in REWARDS[args.reward_model]:
                row = run_config(name, args.emulate, args.steps, mode, root, reward=reward)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=2)
    print(f"\n{'config':16} {'logprobs':8} {'pred GiB':>9} {'meas GiB':>9} {'ratio':>6} {'s/step':>7} {'OOM':>4}  status")
    for r in rows:
        print(f"{r['config']:16} {r['logprobs']:8} {r.get('predicted_peak_gib', '-')!s:>9} "
              f"{r.get('measured_peak_gib', '-')!s:>9} {r.get('predicted_over_measured', '-')!s:>6} "
              f"{r.get('step_time_s', '-')!s:>7} {r.get('oom_recoveries', '-')!s:>4}  {r.get('error', 'ok')[:80]}")
    for r in rows:
        if r.get("measured_phases_gib"):
            print(f"\n{r['config']} ({r['logprobs']}, emulate {r['emulate']}, compiled layers "
                  f"{r.get('compile_training')}, KV cache {'freed' if r.get('release_kv_between_phases') else 'kept'} "
                  "between phases): per phase")
            print("\n".join(phase_table(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
