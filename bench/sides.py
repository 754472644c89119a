"""What the TRL comparisons share: the model directory both frameworks load, the prompts, and TRL's side of a run.

`bench/vs_trl.py` (throughput) and `bench/time_to_accuracy.py` (learning curves) run each framework in its own
subprocess on the same model directory (HF format: config.json + safetensors + the SmolLM2 tokenizer) and the same
verl-schema parquet. TRL's side is `run_trl(spec)`, started as `python bench/sides.py SPEC.json`: it builds
`GRPOTrainer` (no vLLM) from the spec, times every optimizer step with a callback (generation measured by wrapping
`_generate_and_score_completions`, peak memory reset per step like rlanywhere's `perf/peak_memory_gib`), optionally
evaluates greedy held-out accuracy with rlanywhere's reward functions, and writes one JSON line per step.
rlanywhere's side is `run_rlanywhere(run_dir, overrides)`: `rlanywhere train` in a subprocess, metrics.jsonl back.

Nothing here needs TRL to import; `trl_available()` says whether the TRL side can run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")
if SRC not in sys.path:
    sys.path.insert(0, SRC)

# Model shapes the benches build with random weights. The vocabulary is always the SmolLM2 tokenizer's.
SHAPES = {
    # Qwen2.5-0.5B's body: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, tied embeddings.
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Qwen2.5-1.5B's body: hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, tied embeddings.
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, rope_theta=1000000.0, rms_norm_eps=1e-6),
    # SmolLM2-135M's body (Llama: hidden 576, 30 layers, 9 heads, 3 KV heads, intermediate 1536): the demo's model
    # with random weights, where the GGUF cannot travel
    "smollm2-135m-shape": dict(architecture="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5),
    # For developing the benches on a CPU in seconds.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, rope_theta=10000.0, rms_norm_eps=1e-6),
}
REAL_SMOLLM2 = "smollm2-135m"  # the demo's real weights (SmolLM2-135M-Instruct GGUF, dequantized)
TRL_MISSING = ("TRL is not installed: running rlanywhere alone (pip install 'rlanywhere[bench]' adds trl and "
               "datasets)")


def trl_available() -> bool:
    return importlib.util.find_spec("trl") is not None and importlib.util.find_spec("datasets") is not None


def bench_env() -> dict:
    """Environment for the subprocesses: this checkout's src first, so the code under test is what runs."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.abspath(SRC),
                                                                      os.environ.get("PYTHONPATH")])))


# ------------------------------------------------------------------------------------------------ model + data
def smollm2_tokenizer():
    """The SmolLM2 tokenizer from the demo GGUF, EOS fixed and pad set exactly as rlanywhere loads it.

    RLANYWHERE_BENCH_TOKENIZER=DIR reads it from a directory this function's result was saved to instead (a GPU box
    that has no GGUF: `smollm2_tokenizer().save_pretrained(DIR)` once where the GGUF is)."""
    from rlanywhere.models import load_tokenizer, resolve_model_source

    saved = os.environ.get("RLANYWHERE_BENCH_TOKENIZER")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved)

    return load_tokenizer(resolve_model_source("smollm2-135m-instruct"))


def materialize_model(out_dir: str, shape: str, seed: int = 0) -> str:
    """Write the benchmark model as an HF directory (fp32 safetensors + tokenizer) once; both frameworks load it.

    `shape` is a SHAPES key (random weights, the SmolLM2 vocabulary) or REAL_SMOLLM2 (the real SmolLM2-135M
    weights, dequantized from the demo GGUF). A directory already holding this shape is reused."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    marker = Path(out_dir) / "bench_shape.json"
    if marker.exists() and json.loads(marker.read_text()) == {"shape": shape, "seed": seed}:
        return out_dir
    tokenizer = smollm2_tokenizer()
    if shape == REAL_SMOLLM2:
        from rlanywhere.models import resolve_model_source

        source = resolve_model_source("smollm2-135m-instruct")
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **source.load_kwargs())
        model.hf_quantizer = None  # dequantized: plain tensors, save_pretrained writes them as such
        model.to(torch.float32)
    else:
        if shape not in SHAPES:
            raise SystemExit(f"unknown model shape {shape!r}: use one of {sorted(SHAPES)} or {REAL_SMOLLM2}")
        sizes = dict(SHAPES[shape])
        config_class, model_class = ((LlamaConfig, LlamaForCausalLM) if sizes.pop("architecture", "qwen2") == "llama"
                                     else (Qwen2Config, Qwen2ForCausalLM))
        config = config_class(vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=4096,
                              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, **sizes)
        torch.manual_seed(seed)
        model = model_class(config)
    # One EOS for both frameworks: the tokenizer's (the GGUF's <|im_end|>), nothing hidden in generation_config.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    marker.write_text(json.dumps({"shape": shape, "seed": seed}))
    return out_dir


def write_prompt_subset(src_parquet: str, out_parquet: str, count: int) -> str:
    """The first `count` rows of a verl-schema parquet (every step then sees the same prompts in both frameworks)."""
    import pyarrow.parquet as pq

    table = pq.read_table(src_parquet)
    if table.num_rows < count:
        raise SystemExit(f"{src_parquet} has {table.num_rows} rows, {count} needed")
    os.makedirs(os.path.dirname(os.path.abspath(out_parquet)), exist_ok=True)
    pq.write_table(table.slice(0, count), out_parquet)
    return out_parquet


def default_gsm8k_dir() -> Optional[str]:
    """GSM8K jsonl next to the checkout (../shared/data/gsm8k) or inside tests/, when there is one."""
    for candidate in (os.path.join(HERE, "..", "..", "shared", "data", "gsm8k"),
                      os.path.join(HERE, "..", "tests", "data", "gsm8k")):
        if os.path.isfile(os.path.join(candidate, "train.jsonl")):
            return os.path.abspath(candidate)
    return None


def prepare_prompts(work_dir: str, count: int, gsm8k_dir: Optional[str]) -> tuple[str, str]:
    """A verl-schema parquet of `count` prompts: GSM8K questions when `gsm8k_dir` is given, else 2-digit addition.

    Returns (parquet path, a line saying which prompts these are)."""
    from rlanywhere.data import prepare_arithmetic, prepare_gsm8k

    if gsm8k_dir:
        paths = prepare_gsm8k(gsm8k_dir, os.path.join(work_dir, "gsm8k"))
        what = f"GSM8K train questions from {gsm8k_dir}"
    else:
        paths = prepare_arithmetic(os.path.join(work_dir, "arith"), train_size=max(count, 16), test_size=16,
                                   digits=2, operators="+", seed=0)
        what = "2-digit addition prompts (no GSM8K directory found; --gsm8k DIR to use GSM8K)"
    subset = write_prompt_subset(paths["train"], os.path.join(work_dir, f"prompts_{count}.parquet"), count)
    return subset, f"{count} {what}"


def trl_rows(parquet: str) -> list[dict]:
    """verl-schema rows as TRL dataset rows: conversational `prompt` plus the columns the reward reads."""
    from rlanywhere.data import read_parquet_rows

    return [{"prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
             "ground_truth": str(row["reward_model"]["ground_truth"]), "data_source": str(row["data_source"])}
            for row in read_parquet_rows(parquet)]


def completion_text(completion: Any) -> str:
    """TRL hands a conversational completion as [{"role": "assistant", "content": ...}], a plain one as str."""
    if isinstance(completion, str):
        return completion
    return "".join(message["content"] for message in completion)


def rlanywhere_reward(completions: list, ground_truth: list, data_source: list, **_) -> list[float]:
    """rlanywhere's rule reward (rewards.py, by data_source) in TRL's reward-function signature."""
    from rlanywhere.rewards import RewardManager

    scores, _info = RewardManager()([completion_text(c) for c in completions], list(ground_truth),
                                    list(data_source))
    return scores.tolist()


# ------------------------------------------------------------------------------------------------ TRL's side
def held_out_accuracy(model, tokenizer, val_parquet: str, max_new_tokens: int, max_prompt_length: int,
                      val_max_samples: int = -1, batch_size: int = 200, autocast_dtype=None) -> dict:
    """Greedy held-out accuracy, with the prompts, decoding and scoring of rlanywhere's own validation.

    Prompts from rlanywhere's RLDataset (chat template, generation prompt, overlong filter), greedy decoding with
    rlanywhere's HFEngine, the reward functions of rewards.py and their `acc` / `format` keys."""
    import contextlib

    import torch

    from rlanywhere.data import RLDataset
    from rlanywhere.rewards import RewardManager
    from rlanywhere.rollout import HFEngine, SamplingParams

    dataset = RLDataset([val_parquet], tokenizer, max_prompt_length)
    count = len(dataset) if val_max_samples is None or val_max_samples < 0 else min(val_max_samples, len(dataset))
    items = [dataset[i] for i in range(count)]
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, n=1)
    device = next(model.parameters()).device
    autocast = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    was_training = model.training
    model.eval()
    accs, formats = [], []
    with torch.no_grad(), autocast:
        for start in range(0, len(items), batch_size):
            part = items[start:start + batch_size]
            batch = engine.generate([item["input_ids"] for item in part], params)
            _, info = RewardManager()(batch.decode(tokenizer), [item["ground_truth"] for item in part],
                                      [item["data_source"] for item in part])
            accs += info["acc"]
            formats += info["format"]
    if was_training:
        model.train()
    return {"val/acc": sum(accs) / max(len(accs), 1), "val/format": sum(formats) / max(len(formats), 1),
            "val/num_samples": float(len(accs))}


def run_trl(spec: dict) -> None:
    """One TRL GRPOTrainer run as `spec` says; one JSON line per optimizer step (and per evaluation) to spec['out'].

    spec keys: model_dir, train_parquet, out, steps (generations: rlanywhere's steps), prompts_per_step, n,
    mini_prompts (prompts per optimizer step, default all), max_new_tokens, lr, weight_decay, temperature,
    precision (bf16 | fp32), weights_dtype (fp32 | bf16), tf32 (bool), gradient_checkpointing, micro_batch
    (completions per forward/backward), seed, max_seconds (stop after this much wall time, at a generation's end);
    for held-out accuracy also val_parquet, val_max_samples, test_freq (in steps), max_prompt_length.
    Records carry `step` in generations (rlanywhere's step) and `optimizer_step`."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    on_gpu = torch.cuda.is_available() and not spec.get("cpu", False)
    if on_gpu and not spec.get("tf32", True):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # fp32 master weights as rlanywhere keeps them; "bf16" weights is how many TRL users run (no fp32 copy at all).
    weights = torch.bfloat16 if spec.get("weights_dtype") == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=weights)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.padding_side = "left"
    completions_per_step = spec["prompts_per_step"] * spec["n"]
    # Completions per optimizer step: ppo_mini_batch_size prompts x n, as rlanywhere splits a step's batch.
    per_update = spec.get("mini_prompts", spec["prompts_per_step"]) * spec["n"]
    micro = min(spec.get("micro_batch") or per_update, per_update)
    if completions_per_step % per_update or per_update % micro:
        raise SystemExit(f"micro_batch {micro} must divide the {per_update} completions of an optimizer step, "
                         f"and those the {completions_per_step} of a generation")
    updates_per_generation = completions_per_step // per_update
    bf16 = spec["precision"] == "bf16"
    args = GRPOConfig(
        output_dir=os.path.join(os.path.dirname(spec["out"]), "trl_out"),
        per_device_train_batch_size=micro, gradient_accumulation_steps=per_update // micro,
        steps_per_generation=completions_per_step // micro,
        num_generations=spec["n"], max_completion_length=spec["max_new_tokens"], temperature=spec["temperature"],
        top_p=1.0, top_k=0, learning_rate=spec["lr"], weight_decay=spec.get("weight_decay", 0.01), beta=0.0,
        num_iterations=1, bf16=bf16, fp16=False,
        tf32=bool(spec.get("tf32", True)) if on_gpu else None, use_cpu=not on_gpu,
        gradient_checkpointing=spec["gradient_checkpointing"], max_steps=spec["steps"] * updates_per_generation,
        logging_steps=1, save_strategy="no", report_to="none", use_vllm=False, seed=spec.get("seed", 1),
        disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0)
    out = open(spec["out"], "w")

    def write(record: dict) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    class TimedGRPOTrainer(GRPOTrainer):
        generation_seconds = 0.0

        def _generate_and_score_completions(self, inputs):
            sync()
            start = time.perf_counter()
            result = super()._generate_and_score_completions(inputs)
            sync()
            self.generation_seconds += time.perf_counter() - start
            return result

    clock = {"train_seconds": 0.0, "started": time.time(), "stopping": False}

    def evaluate(step: int) -> None:
        if not spec.get("val_parquet"):
            return
        start = time.perf_counter()
        metrics = held_out_accuracy(trainer.model, tokenizer, spec["val_parquet"], spec["max_new_tokens"],
                                    spec["max_prompt_length"], spec.get("val_max_samples", -1),
                                    autocast_dtype=torch.bfloat16 if bf16 and on_gpu else None)
        write({"step": step, "train_seconds": clock["train_seconds"], "eval_seconds": time.perf_counter() - start,
               **metrics})

    class StepClock(TrainerCallback):
        """Times each optimizer step; the record is written once TRL's log for the step adds the response length."""
        pending: Optional[dict] = None

        def flush(self, logs: Optional[dict] = None) -> None:
            record, self.pending = self.pending, None
            if record is None:
                return
            if logs and "completions/mean_length" in logs:
                record["response_length/mean"] = logs["completions/mean_length"]
            write(record)
            test_freq = spec.get("test_freq", 0)
            finished_generation = record["optimizer_step"] % updates_per_generation == 0
            last = record["step"] == spec["steps"] or clock["stopping"]
            if finished_generation and test_freq > 0 and (record["step"] % test_freq == 0 or last):
                evaluate(record["step"])

        def on_train_begin(self, args, state, control, **kwargs):
            evaluate(0)

        def on_step_begin(self, args, state, control, **kwargs):
            self.flush()
            sync()
            if on_gpu:
                torch.cuda.reset_peak_memory_stats()
            trainer.generation_seconds = 0.0
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            seconds = time.perf_counter() - self.start
            clock["train_seconds"] += seconds
            peak = torch.cuda.max_memory_allocated() / 2**30 if on_gpu else _rss_gib()
            self.pending = {"step": -(-state.global_step // updates_per_generation),
                            "optimizer_step": state.global_step, "perf/step_time_s": seconds,
                            "timing/generate_and_score": trainer.generation_seconds,
                            "timing/update": seconds - trainer.generation_seconds, "perf/peak_memory_gib": peak,
                            "train_seconds": clock["train_seconds"]}
            # A wall-clock limit (max_seconds) ends the run cleanly at the end of a generation, evaluated.
            over = spec.get("max_seconds") and time.time() - clock["started"] > spec["max_seconds"]
            if over and state.global_step % updates_per_generation == 0:
                clock["stopping"] = control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.flush(logs)

        def on_train_end(self, args, state, control, **kwargs):
            self.flush()

    trainer = TimedGRPOTrainer(model=model, reward_funcs=rlanywhere_reward, args=args,
                               train_dataset=Dataset.from_list(trl_rows(spec["train_parquet"])),
                               processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    out.close()


def _rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def start_trl(spec: dict, spec_path: str) -> list[dict]:
    """Run `run_trl(spec)` in its own subprocess and return the JSON lines it wrote."""
    with open(spec_path, "w") as handle:
        json.dump(spec, handle, indent=1)
    command = [sys.executable, os.path.abspath(__file__), spec_path]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=bench_env())
    return read_jsonl(spec["out"])


# Every bench run of rlanywhere: fresh, no validation unless the caller asks again, no checkpoints, console only.
BENCH_RUN_OVERRIDES = ("trainer.resume_mode=disable", "trainer.val_before_train=false", "trainer.test_freq=0",
                       "trainer.save_freq=0", "trainer.logger=[console]")


def run_rlanywhere(run_dir: str, overrides: list[str]) -> list[dict]:
    """`rlanywhere train OVERRIDES` in a subprocess (no validation unless asked, no checkpoints); its metrics.jsonl."""
    from rlanywhere.tracking import read_metrics

    shutil.rmtree(run_dir, ignore_errors=True)  # a bench run is always a fresh run
    command = [sys.executable, "-m", "rlanywhere.cli", "train", *BENCH_RUN_OVERRIDES,
               f"trainer.default_local_dir={run_dir}", *overrides]
    print("$", " ".join(command), flush=True)
    subprocess.run(command, check=True, env=bench_env())
    return read_metrics(run_dir)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/sides.py SPEC.json  (started by vs_trl.py / time_to_accuracy.py)")
    with open(sys.argv[1]) as handle:
        run_trl(json.load(handle))
